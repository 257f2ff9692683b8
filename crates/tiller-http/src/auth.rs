//! Access control for every HTTP route: Host allow-list (DNS rebinding),
//! Origin check (cross-origin requests), then the client's credentials: a
//! bearer token (constant-time) or the Web Shell's cookie. The token in a
//! query string is accepted only by the Web Shell's bootstrap (`/?token=`),
//! which trades it for the cookie and sends the browser to a clean `/`.
//! State-changing requests must be `application/json` (a cross-site form
//! cannot send that), and every response carries the headers that keep the
//! Web Shell out of frames and referrers.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::{KeyInit, Mac};
use subtle::ConstantTimeEq;

/// What the checks compare against.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// The token clients must present; `None` only with `server.auth =
    /// "none"` (which the configuration allows on loopback only).
    pub token: Option<String>,
    /// The address the server is bound to (its IP is an allowed Host, its
    /// port names the cookie).
    pub bind: Option<SocketAddr>,
    /// Extra Host names allowed (besides loopback names and the bind IP).
    pub allowed_hosts: Vec<String>,
    /// Origins allowed to make cross-origin requests.
    pub allowed_origins: Vec<String>,
}

/// The Web Shell's cookie: its name (per port, since browsers share
/// cookies between the ports of one host) and the value that proves the
/// token was presented. The value is derived from the token, so it is
/// not the token itself and changes when the token does.
#[derive(Clone, Debug)]
struct Cookie {
    name: String,
    value: String,
}

impl AuthConfig {
    fn cookie(&self) -> Option<Cookie> {
        let token = self.token.as_ref()?;
        let mut mac =
            hmac::Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes()).expect("any key length");
        mac.update(b"tiller web shell cookie v1");
        Some(Cookie {
            name: format!("tiller_{}", self.bind.map_or(0, |b| b.port())),
            value: hex::encode(mac.finalize().into_bytes()),
        })
    }
}

/// The checks, ready to run (the cookie is derived once).
#[derive(Clone, Debug)]
pub struct Auth {
    config: AuthConfig,
    cookie: Option<Cookie>,
}

impl Auth {
    /// CORS for the allowed origins (none: no layer, no CORS header).
    pub(crate) fn cors(&self) -> Option<tower_http::cors::CorsLayer> {
        let origins: Vec<String> = self
            .config
            .allowed_origins
            .iter()
            .map(|o| o.trim_end_matches('/').to_owned())
            .collect();
        (!origins.is_empty()).then(|| {
            tower_http::cors::CorsLayer::new()
                // In any case, as the Origin check compares.
                .allow_origin(tower_http::cors::AllowOrigin::predicate(
                    move |origin: &HeaderValue, _| {
                        origins
                            .iter()
                            .any(|o| o.as_bytes().eq_ignore_ascii_case(origin.as_bytes()))
                    },
                ))
                .allow_methods([
                    Method::GET,
                    Method::POST,
                    Method::PUT,
                    Method::PATCH,
                    Method::DELETE,
                ])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::HeaderName::from_static("last-event-id"),
                ])
                .max_age(std::time::Duration::from_secs(600))
        })
    }

    pub fn new(config: AuthConfig) -> Arc<Auth> {
        let cookie = config.cookie();
        Arc::new(Auth { config, cookie })
    }
}

/// Routes anyone may reach (probes).
const OPEN: &[&str] = &["/healthz", "/readyz"];

fn deny(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({ "error": { "errorKind": kind, "message": message } })),
    )
        .into_response()
}

fn unauthorized() -> Response {
    let mut r = deny(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong token: send `Authorization: Bearer TOKEN` (the token is in the data \
         directory's `token` file, or server.token), or open the Web Shell link `tiller serve` printed",
    );
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// The middleware.
pub async fn check(State(auth): State<Arc<Auth>>, req: Request, next: Next) -> Response {
    let mut res = decide(&auth, req, next).await;
    secure_headers(res.headers_mut());
    res
}

async fn decide(auth: &Auth, req: Request, next: Next) -> Response {
    let cfg = &auth.config;
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if !host_allowed(cfg, host) {
        return deny(
            StatusCode::MISDIRECTED_REQUEST,
            "forbidden",
            "this Host is not served here (add it to server.allowed_hosts)",
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok())
        && !origin_allowed(cfg, origin, host)
    {
        return deny(
            StatusCode::FORBIDDEN,
            "forbidden",
            "cross-origin request refused (add the origin to server.allowed_origins)",
        );
    }
    let path = req.uri().path();
    // The Web Shell's bootstrap: `/?token=T` sets the cookie and sends the
    // browser to `/`, so the token leaves the address bar at once.
    if path == "/"
        && let Some(given) = query_token(&req)
    {
        return match (&cfg.token, &auth.cookie) {
            (Some(token), Some(cookie)) if equal(&given, token) => bootstrap(cookie),
            (Some(_), _) => unauthorized(),
            // No auth configured: nothing to trade; just clean the URL.
            (None, _) => redirect_home(None),
        };
    }
    let open = OPEN.contains(&path) || crate::web::PATHS.contains(&path);
    // Channel ingress authenticates with the channel's own secret.
    let channel = path.starts_with("/api/channels/");
    if !open
        && !channel
        && let Some(token) = &cfg.token
    {
        let by_header = bearer(headers).is_some_and(|t| equal(t, token));
        let by_cookie = auth
            .cookie
            .as_ref()
            .is_some_and(|c| cookie_value(headers, &c.name).is_some_and(|v| equal(v, &c.value)));
        if !(by_header || by_cookie) {
            // Refused before the body is read.
            return unauthorized();
        }
    }
    if changes_state(req.method()) && !is_json(headers) {
        return deny(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_params",
            "state-changing requests must be sent with `Content-Type: application/json`",
        );
    }
    next.run(req).await
}

fn changes_state(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

fn equal(given: &str, want: &str) -> bool {
    bool::from(given.as_bytes().ct_eq(want.as_bytes()))
}

fn bootstrap(cookie: &Cookie) -> Response {
    // HttpOnly: scripts cannot read it; SameSite=Strict: other sites'
    // pages cannot make the browser send it.
    let set = format!(
        "{}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=31536000",
        cookie.name, cookie.value
    );
    redirect_home(Some(set))
}

fn redirect_home(set_cookie: Option<String>) -> Response {
    let mut r = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
    if let Some(c) = set_cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Headers on every response: no framing (clickjacking), no referrer (a
/// bootstrap URL never leaks), a strict content policy for the Web Shell.
fn secure_headers(h: &mut HeaderMap) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src data:; \
             connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
             frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
}

/// The token from `Authorization: Bearer`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// `?token=` (only the bootstrap reads it).
fn query_token(req: &Request) -> Option<String> {
    let query = req.uri().query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
}

/// The value of cookie `name`, from every `Cookie` header.
fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim())
}

/// The host part of a `Host` value (`[::1]:4141` -> `[::1]`), or `None`
/// when it is not one.
fn host_name(host: &str) -> Option<&str> {
    if host.starts_with('[') {
        let end = host.find(']')?;
        let rest = &host[end + 1..];
        if !(rest.is_empty() || rest.starts_with(':')) {
            return None;
        }
        return Some(&host[..=end]);
    }
    let name = host.rsplit_once(':').map_or(host, |(h, _)| h);
    (!name.is_empty()).then_some(name)
}

fn host_allowed(cfg: &AuthConfig, host: &str) -> bool {
    let Some(name) = host_name(host) else {
        return false;
    };
    let name = name.to_ascii_lowercase();
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
            ("[::1]", true),
            ("10.1.2.3:4141", true),
            ("tiller.example", true),
            ("evil.example:4141", false),
            ("", false),
            // Malformed values are refused, never a panic.
            ("[", false),
            ("[]", false),
            ("[::1", false),
            ("[::1]x", false),
            (":4141", false),
            ("]", false),
            ("[::1]]:1", false),
        ] {
            assert_eq!(host_allowed(&cfg, host), ok, "{host:?}");
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

    #[test]
    fn cookies_and_bearer_are_parsed() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; tiller_4141=v"),
        );
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  t0k "),
        );
        assert_eq!(cookie_value(&h, "tiller_4141"), Some("v"));
        assert_eq!(cookie_value(&h, "b"), Some("2"));
        assert_eq!(cookie_value(&h, "tiller_1"), None);
        assert_eq!(bearer(&h), Some("t0k"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic x"));
        assert_eq!(bearer(&h), None);
    }

    #[test]
    fn the_cookie_is_derived_per_port_and_token() {
        let a = AuthConfig {
            token: Some("t".into()),
            bind: Some("127.0.0.1:4141".parse().unwrap()),
            ..AuthConfig::default()
        };
        let c = a.cookie().unwrap();
        assert_eq!(c.name, "tiller_4141");
        assert_ne!(c.value, "t");
        let b = AuthConfig {
            token: Some("u".into()),
            ..a.clone()
        };
        assert_ne!(b.cookie().unwrap().value, c.value);
        assert!(AuthConfig { token: None, ..a }.cookie().is_none());
    }
}
