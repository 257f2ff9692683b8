//! The HTTP edge: the `/api` of the Web Shell and admin tools (REST and
//! SSE), health and readiness, Prometheus metrics, and ACP over WebSocket at
//! `/acp` (one JSON-RPC message per text frame). Every route passes the
//! access checks of [`auth`].

pub mod api;
pub mod auth;
pub mod channels;
pub mod delivery;
pub mod forward;
pub mod openapi;
pub mod serve;
mod web;
pub mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::{SinkExt, StreamExt};
use tiller_acp::{AcpConfig, Frame};
use tiller_session::Sessions;
use tokio::sync::{Semaphore, mpsc};

/// Renders a `/metrics` scrape (the Prometheus text format).
pub type RenderMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// What the HTTP handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The sessions every edge serves.
    pub sessions: Sessions,
    /// ACP connection settings.
    pub acp: AcpConfig,
    /// Renders `/metrics`; `None` when `[metrics] enabled = false` (the
    /// route then answers 404).
    pub metrics: Option<RenderMetrics>,
    /// The connection cap, shared with the unix socket.
    pub permits: Arc<Semaphore>,
    /// False until start-up is complete, and again during shutdown.
    pub ready: Arc<AtomicBool>,
    /// Events buffered per SSE stream; past it the stream reads what it
    /// missed from the log.
    pub subscriber_queue: usize,
    /// Token, cookie, Host and Origin checks.
    pub auth: Arc<auth::Auth>,
    /// Channel secrets and the replay guard.
    pub channels: Arc<channels::Channels>,
    /// Largest request body (`limits.max_message_bytes`).
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's body.
    pub body_timeout: std::time::Duration,
}

/// The router.
pub fn router(state: AppState) -> Router {
    let auth = state.auth.clone();
    let routes = Router::new()
        .route("/", get(web::index))
        .route("/app.js", get(web::app))
        .route("/i18n.js", get(web::i18n))
        .route("/style.css", get(web::style))
        .route("/vendor/{name}", get(web::vendor))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/acp", get(acp_upgrade))
        .route(
            "/api/sessions",
            get(api::list_sessions).post(api::create_session),
        )
        .route(
            "/api/sessions/{id}",
            get(api::get_session)
                .patch(api::update_session)
                .delete(api::close_session),
        )
        .route("/api/engines", get(api::list_engines))
        .route("/api/openapi.json", get(openapi_json))
        .route("/api/sessions/{id}/options", get(api::get_options))
        .route(
            "/api/sessions/{id}/options/{option}",
            axum::routing::put(api::set_option),
        )
        .route("/api/sessions/{id}/prompts", post(api::post_prompt))
        .route("/api/sessions/{id}/compact", post(api::post_compact))
        .route("/api/sessions/{id}/steer", post(api::post_steer))
        .route("/api/sessions/{id}/cancel", post(api::post_cancel))
        .route(
            "/api/sessions/{id}/permissions/{req}",
            post(api::post_permission),
        )
        .route("/api/sessions/{id}/history", get(api::get_history))
        .route(
            "/api/sessions/{id}/notifications",
            post(api::post_notification),
        )
        .route(
            "/api/sessions/{id}/goal",
            get(api::get_goal)
                .put(api::put_goal)
                .delete(api::delete_goal),
        )
        .route("/api/sessions/{id}/goal/pause", post(api::pause_goal))
        .route("/api/sessions/{id}/goal/resume", post(api::resume_goal))
        .route(
            "/api/channels/{channel}/prompts",
            post(channels::post_prompt),
        )
        .route("/api/cron", get(api::list_cron).post(api::add_cron))
        .route("/api/cron/{id}", axum::routing::delete(api::remove_cron))
        .route("/api/sessions/{id}/events", get(api::events))
        .layer(axum::extract::DefaultBodyLimit::max(state.max_body_bytes))
        // After the checks: a request for a session another node serves
        // goes there.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            forward::forward,
        ))
        // Every body, a forwarded one too: no pause longer than
        // `limits.http_body_timeout` (channels also bound the whole).
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            state.body_timeout,
        ))
        // Outermost: nothing runs, and no body is read, before the checks.
        .layer(axum::middleware::from_fn_with_state(
            auth.clone(),
            auth::check,
        ));
    // Around them, for the origins `server.allowed_origins` lists: a
    // browser's preflight (which carries no token) is answered, and
    // responses say those origins may read them. The token is still
    // needed, as a header: cookies are never sent cross-site.
    match auth.cors() {
        Some(cors) => routes.layer(cors),
        None => routes,
    }
    .with_state(state)
}

async fn openapi_json() -> Response {
    static DOC: std::sync::LazyLock<String> = std::sync::LazyLock::new(openapi::json);
    ([(header::CONTENT_TYPE, "application/json")], DOC.as_str()).into_response()
}

/// How long `/readyz` waits for the store to answer.
const STORE_PING: std::time::Duration = std::time::Duration::from_secs(5);

/// Ready: start-up complete, not shutting down, and the store answers (a
/// node whose database is unreachable takes no traffic). The reason is
/// generic: this route needs no token.
async fn readyz(State(st): State<AppState>) -> Response {
    if !st.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response();
    }
    match tokio::time::timeout(STORE_PING, st.sessions.store_answers()).await {
        Ok(Ok(())) => "ready\n".into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readyz: the store does not answer");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: the store does not answer\n",
            )
                .into_response()
        }
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the store does not answer\n",
        )
            .into_response(),
    }
}

async fn metrics(State(st): State<AppState>) -> Response {
    let Some(metrics) = &st.metrics else {
        return (
            StatusCode::NOT_FOUND,
            "metrics are disabled ([metrics] enabled = false)\n",
        )
            .into_response();
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics(),
    )
        .into_response()
}

async fn acp_upgrade(
    State(st): State<AppState>,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let Ok(permit) = st.permits.clone().try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "too many connections (limits.max_connections); retry later\n",
        )
            .into_response();
    };
    // The transport's limits are ours: nothing larger is ever buffered. A
    // message over them still gets a JSON-RPC error before the close.
    let cap = st.acp.max_message_bytes;
    let mut acp = st.acp;
    // A connection another node handed over is never handed on again (a
    // node advertising a wrong address would start an endless chain).
    if headers.contains_key(forward::FORWARDED) {
        acp.forward = None;
    }
    ws.max_message_size(cap)
        .max_frame_size(cap)
        .on_upgrade(move |socket| async move {
            serve_ws(socket, st.sessions, acp).await;
            drop(permit);
        })
}

/// Serves ACP on an upgraded WebSocket.
pub async fn serve_ws(socket: WebSocket, sessions: Sessions, config: AcpConfig) {
    let (mut sink, mut stream) = socket.split();
    let (in_tx, in_rx) = mpsc::channel(64);
    let (out_tx, mut out_rx) = mpsc::channel::<String>(256);
    let max = config.max_message_bytes;
    let reading = tokio::spawn(async move {
        while let Some(msg) = stream.next().await {
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    // Over the size limit: say so, then stop reading (the
                    // protocol cannot skip the rest of a message).
                    if e.to_string().contains("too long") {
                        let _ = in_tx.send(Frame::TooLarge(max + 1)).await;
                    }
                    break;
                }
            };
            let frame = match msg {
                Message::Text(t) if t.len() > max => Frame::TooLarge(t.len()),
                Message::Text(t) => Frame::Text(t.to_string()),
                Message::Binary(b) if b.len() > max => Frame::TooLarge(b.len()),
                Message::Binary(b) => Frame::Text(String::from_utf8_lossy(&b).into_owned()),
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => continue,
            };
            if in_tx.send(frame).await.is_err() {
                break;
            }
        }
    });
    let writing = tokio::spawn(async move {
        while let Some(msg) = out_rx.recv().await {
            let sent = tiller_acp::write_within_stall(sink.send(Message::Text(msg.into())));
            if sent.await.is_none() {
                // Not closed: a close would wait on the same full socket.
                return;
            }
        }
        tiller_acp::write_within_stall(sink.close()).await;
    });
    tiller_acp::serve(sessions, config, "websocket", in_rx, out_tx).await;
    reading.abort();
    let _ = writing.await;
}
