//! Access control for every HTTP route: bearer token (constant-time),
//! Host allow-list (DNS rebinding), Origin check (cross-origin requests).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

/// What the checks compare against.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// Required token, if any.
    pub token: Option<String>,
    /// The address the server is bound to.
    pub bind: Option<SocketAddr>,
    /// Extra Host names allowed (besides loopback names and the bind IP).
    pub allowed_hosts: Vec<String>,
    /// Origins allowed to make cross-origin requests.
    pub allowed_origins: Vec<String>,
}

/// Routes anyone may reach (probes).
const OPEN: &[&str] = &["/healthz", "/readyz"];

fn deny(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(
            serde_json::json!({ "error": { "errorKind": "forbidden", "message": message } }),
        ),
    )
        .into_response()
}

/// The middleware.
pub async fn check(State(cfg): State<Arc<AuthConfig>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if !host_allowed(&cfg, host) {
        return deny(
            StatusCode::MISDIRECTED_REQUEST,
            "this Host is not served here (add it to server.allowed_hosts)",
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok())
        && !origin_allowed(&cfg, origin, host)
    {
        return deny(
            StatusCode::FORBIDDEN,
            "cross-origin request refused (add the origin to server.allowed_origins)",
        );
    }
    // Channel ingress authenticates with the channel's own secret.
    if let Some(token) = &cfg.token
        && !OPEN.contains(&req.uri().path())
        && !crate::web::PATHS.contains(&req.uri().path())
        && !req.uri().path().starts_with("/api/channels/")
    {
        let given = bearer(&req).unwrap_or_default();
        if !bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                axum::Json(serde_json::json!({
                    "error": { "errorKind": "unauthorized", "message": "missing or wrong token" }
                })),
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// The token from `Authorization: Bearer`, or `?token=` (EventSource and
/// WebSocket clients in browsers cannot set headers).
fn bearer(req: &Request) -> Option<String> {
    if let Some(v) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        && let Some(t) = v.strip_prefix("Bearer ")
    {
        return Some(t.trim().to_owned());
    }
    let query = req.uri().query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
}

/// The host part of a `Host` value (`[::1]:4141` -> `[::1]`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host
            .split(']')
            .next()
            .map_or(host, |h| &host[..h.len() + 1]);
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
}

fn host_allowed(cfg: &AuthConfig, host: &str) -> bool {
    if host.is_empty() {
        return false;
    }
    let name = host_name(host).to_ascii_lowercase();
    if ["localhost", "127.0.0.1", "[::1]"].contains(&name.as_str()) {
        return true;
    }
    if let Some(bind) = cfg.bind {
        let ip = match bind.ip() {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        };
        if name == ip {
            return true;
        }
    }
    cfg.allowed_hosts
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&name) || h.eq_ignore_ascii_case(host))
}

fn origin_allowed(cfg: &AuthConfig, origin: &str, host: &str) -> bool {
    let authority = origin
        .split_once("://")
        .map_or(origin, |(_, rest)| rest)
        .trim_end_matches('/');
    authority.eq_ignore_ascii_case(host)
        || cfg
            .allowed_origins
            .iter()
            .any(|o| o.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        let cfg = AuthConfig {
            bind: Some("10.1.2.3:4141".parse().unwrap()),
            allowed_hosts: vec!["tiller.example".into()],
            ..AuthConfig::default()
        };
        for (host, ok) in [
            ("127.0.0.1:4141", true),
            ("localhost:4141", true),
            ("[::1]:4141", true),
            ("10.1.2.3:4141", true),
            ("tiller.example", true),
            ("evil.example:4141", false),
            ("", false),
        ] {
            assert_eq!(host_allowed(&cfg, host), ok, "{host}");
        }
    }

    #[test]
    fn origins() {
        let cfg = AuthConfig {
            allowed_origins: vec!["https://ide.example".into()],
            ..AuthConfig::default()
        };
        for (origin, host, ok) in [
            ("http://127.0.0.1:4141", "127.0.0.1:4141", true),
            ("https://ide.example", "127.0.0.1:4141", true),
            ("https://evil.example", "127.0.0.1:4141", false),
            ("http://127.0.0.1:9999", "127.0.0.1:4141", false),
        ] {
            assert_eq!(origin_allowed(&cfg, origin, host), ok, "{origin}");
        }
    }
}
