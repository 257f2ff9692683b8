//! Any node answers any client: a request for a session another node of
//! the cluster serves is sent on to that node (its advertised address)
//! and its answer, streams included, comes back as is. Runs after this
//! node's own checks (token, Host, Origin), so nothing unauthenticated is
//! ever sent on; the owner checks the token again.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderName, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt as _;
use serde_json::json;

use crate::AppState;

/// Marks a request one node sent to another: it is never sent on again
/// (a lease that moved meanwhile is answered `owned_elsewhere`).
pub const FORWARDED: &str = "x-tiller-forwarded";

/// Headers that belong to one hop, never passed on.
const HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::HOST,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    // Checked here already; the owner would compare it with its own host.
    header::ORIGIN,
];

/// The session a path is about (`/api/sessions/{id}` and below).
fn session_of(path: &str) -> Option<tiller_core::SessionId> {
    let rest = path.strip_prefix("/api/sessions/")?;
    let id = rest.split('/').next()?;
    tiller_core::SessionId::parse(id)
}

/// The middleware.
pub async fn forward(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(id) = session_of(req.uri().path()) else {
        return next.run(req).await;
    };
    if req.headers().contains_key(FORWARDED) {
        return next.run(req).await;
    }
    let Some((node, address)) = st.sessions.served_elsewhere(id).await else {
        return next.run(req).await;
    };
    match send_on(&st, req, &address).await {
        Ok(r) => r,
        Err(failed) => unreachable(id, &node, &address, failed),
    }
}

/// A request already read (a channel's: its signature covers the body)
/// carried to the node serving session `id`: its answer, or why not.
pub(crate) async fn carry(
    st: &AppState,
    (headers, uri, body): (axum::http::HeaderMap, String, axum::body::Bytes),
    id: tiller_core::SessionId,
    node: &str,
    address: &str,
) -> Response {
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = axum::http::Method::POST;
    *req.headers_mut() = headers;
    let parsed = uri.parse().map_err(|_| Failed {
        sent: false,
        why: format!("a path that cannot be sent on: {uri}"),
    });
    let sent = match parsed {
        Ok(u) => {
            *req.uri_mut() = u;
            send_on(st, req, address).await
        }
        Err(failed) => Err(failed),
    };
    match sent {
        Ok(r) => r,
        Err(failed) => unreachable(id, node, address, failed),
    }
}

/// The answer when the node serving session `id` cannot be reached.
fn unreachable(id: tiller_core::SessionId, node: &str, address: &str, failed: Failed) -> Response {
    tracing::warn!(session = %id, %node, %address, error = %failed.why, "cannot reach the node serving the session");
    // Not sent at all: safe to retry. Sent and unanswered: the owner may
    // still carry it out (a paused node that resumes).
    let message = if failed.sent {
        format!(
            "session {id} is served by node {node} ({address}), which did not answer in time; \
             the request may or may not have been carried out"
        )
    } else {
        format!(
            "session {id} is served by node {node} ({address}), which this node cannot reach; \
             retry there or in a moment"
        )
    };
    let error = json!({ "error": {
        "errorKind": "owned_elsewhere",
        "retryable": !failed.sent,
        "message": message,
        "node": node,
        "address": address,
    }});
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(error)).into_response()
}

/// How long the owner may take to answer a request sent on (its headers;
/// a stream then runs as long as it runs).
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a request could not be sent on.
struct Failed {
    /// Whether it may have reached the owner.
    sent: bool,
    why: String,
}

fn client() -> &'static reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            // Nodes talk over the cluster's network, never through a proxy
            // from the environment.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("a plain HTTP client builds")
    })
}

async fn send_on(st: &AppState, req: Request, address: &str) -> Result<Response, Failed> {
    let not_sent = |why: String| Failed { sent: false, why };
    let (parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let body = axum::body::to_bytes(body, st.max_body_bytes)
        .await
        .map_err(|e| not_sent(format!("reading the request: {e}")))?;
    let mut headers = parts.headers;
    for h in &HOP {
        headers.remove(h);
    }
    headers.insert(FORWARDED, axum::http::HeaderValue::from_static("1"));
    let url = format!("{}{path}", address.trim_end_matches('/'));
    let sending = client()
        .request(parts.method, &url)
        .headers(headers)
        .body(body)
        .send();
    let resp = match tokio::time::timeout(ANSWER_WITHIN, sending).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return Err(Failed {
                sent: !e.is_connect(),
                why: e.to_string(),
            });
        }
        Err(_) => {
            return Err(Failed {
                sent: true,
                why: format!("no answer in {} s", ANSWER_WITHIN.as_secs()),
            });
        }
    };
    let mut out = Response::builder().status(resp.status());
    for (k, v) in resp.headers() {
        if !HOP.contains(k) {
            out = out.header(k, v);
        }
    }
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    out.body(Body::from_stream(stream))
        .map_err(|e| not_sent(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_sessions_routes_are_forwarded() {
        let id = tiller_core::SessionId::new();
        for path in [
            format!("/api/sessions/{id}"),
            format!("/api/sessions/{id}/prompts"),
            format!("/api/sessions/{id}/events"),
        ] {
            assert_eq!(session_of(&path), Some(id), "{path}");
        }
        for path in [
            "/api/sessions",
            "/api/sessions/",
            "/api/sessions/nope/prompts",
            "/api/cron",
            "/",
        ] {
            assert_eq!(session_of(path), None, "{path}");
        }
    }
}
