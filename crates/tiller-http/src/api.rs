//! The HTTP API of the Web Shell and admin tools (`/api`): sessions,
//! prompts, steering, cancel, history pages and the SSE event stream. The
//! only place that knows these JSON shapes.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::{Value, json};
use tiller_core::{Origin, PromptId, SessionId};
use tiller_session::view::{Cursor, Live};
use tiller_session::{
    EventBody, EventRecord, PermissionRefused, PromptRefused, SessionError, SessionHandle,
    Sessions, Snapshot, Subscriber,
};
use tokio::sync::mpsc;

use crate::AppState;
use crate::wire::*;

/// An API error: status and `{error: {errorKind, message, ...}}`.
pub struct ApiError(pub StatusCode, pub Value);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError(
        StatusCode::BAD_REQUEST,
        json!({ "errorKind": "invalid_params", "message": message.into() }),
    )
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Unknown(id) => ApiError(
                StatusCode::NOT_FOUND,
                json!({ "errorKind": "unknown_session", "message": e.to_string(), "sessionId": id.to_string() }),
            ),
            SessionError::UnknownEngine(..) | SessionError::BadCwd(..) => {
                bad_request(e.to_string())
            }
            SessionError::TooManySessions(_) => ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "errorKind": "overloaded", "retryable": true, "message": e.to_string() }),
            ),
            SessionError::Store(e) => {
                tracing::warn!(error = %e, "a request failed in the store");
                if e.is_unavailable() {
                    store_unavailable(e.for_client())
                } else {
                    ApiError(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        json!({ "errorKind": "internal", "message": e.for_client() }),
                    )
                }
            }
            SessionError::Elsewhere {
                ref node,
                ref address,
                ..
            } => ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "errorKind": "owned_elsewhere", "retryable": true, "message": e.to_string(),
                        "node": node, "address": address }),
            ),
            SessionError::HandingOver(_) => store_unavailable(e.to_string()),
            SessionError::Stopped => ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "errorKind": "session_stopped", "retryable": false, "message": e.to_string() }),
            ),
            other => ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({ "errorKind": "internal", "message": other.to_string() }),
            ),
        }
    }
}

impl From<PromptRefused> for ApiError {
    fn from(e: PromptRefused) -> Self {
        match e {
            PromptRefused::Invalid(s) => ApiError(
                StatusCode::BAD_REQUEST,
                json!({ "errorKind": "invalid_params", "message": s.to_string(), "step": s.path }),
            ),
            PromptRefused::Overloaded => ApiError(
                StatusCode::TOO_MANY_REQUESTS,
                json!({ "errorKind": "overloaded", "retryable": true, "message": e.to_string() }),
            ),
            PromptRefused::BadDelivery(why) | PromptRefused::Unsupported(why) => ApiError(
                StatusCode::BAD_REQUEST,
                json!({ "errorKind": "invalid_params", "message": why }),
            ),
            PromptRefused::SessionClosed => ApiError(
                StatusCode::CONFLICT,
                json!({ "errorKind": "session_closed", "message": e.to_string() }),
            ),
            PromptRefused::StoreUnavailable => store_unavailable(e.to_string()),
        }
    }
}

/// 503: the store cannot record the request; nothing was acknowledged.
fn store_unavailable(message: String) -> ApiError {
    ApiError(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({ "errorKind": "store_unavailable", "retryable": true, "message": message }),
    )
}

type ApiResult<T> = Result<T, ApiError>;

/// A JSON body whose rejections are API errors (400 with a message naming
/// the problem), like every other error here.
pub struct ApiJson<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    Json<T>: axum::extract::FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(e) => Err(bad_request(e.body_text())),
        }
    }
}

/// A query string whose rejections are API errors too.
pub struct ApiQuery<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for ApiQuery<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(bad_request(e.body_text())),
        }
    }
}

fn session_id(raw: &str) -> ApiResult<SessionId> {
    SessionId::parse(raw).ok_or_else(|| SessionError::Unknown(SessionId::from_u128(0)).into())
}

async fn open(st: &AppState, raw: &str) -> ApiResult<SessionHandle> {
    let id = SessionId::parse(raw).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            json!({ "errorKind": "unknown_session", "message": format!("unknown session {raw}"), "sessionId": raw }),
        )
    })?;
    Ok(st.sessions.open(id).await?)
}

/// The JSON envelope of one event: `{seq, type, promptId?, turnId?, ts, data}`.
pub fn envelope(rec: &EventRecord) -> Value {
    serde_json::to_value(typed_envelope(rec)).expect("events serialize")
}

fn typed_envelope(rec: &EventRecord) -> Envelope {
    let mut data = serde_json::to_value(&rec.body).expect("events serialize");
    let kind = data
        .as_object_mut()
        .and_then(|o| o.remove("type"))
        .and_then(|t| t.as_str().map(str::to_owned))
        .unwrap_or_default();
    if let EventBody::TurnError { .. } = rec.body {
        data["sessionId"] = json!(rec.session.to_string());
        data["promptId"] = json!(rec.prompt.map(|p| p.to_string()));
    }
    Envelope {
        seq: rec.seq,
        kind,
        prompt_id: rec.prompt.map(|p| p.to_string()),
        turn_id: rec.turn.map(|t| t.0),
        ts: rec.ts_ms,
        data,
    }
}

fn snapshot_json(snap: &Snapshot) -> crate::wire::Snapshot {
    crate::wire::Snapshot {
        state: snap.state.as_str().to_owned(),
        active_prompt_id: snap.active_prompt.map(|p| p.to_string()),
        queued: snap.queued.iter().map(PromptId::to_string).collect(),
        pending_permission: snap.pending_permission.as_ref().map(|e| {
            let mut data = envelope(e)["data"].clone();
            data["promptId"] = json!(e.prompt.map(|p| p.to_string()));
            data
        }),
        last_turn_error: snap.last_turn_error.as_ref().map(|e| {
            let env = envelope(e);
            let mut data = env["data"].clone();
            data["seq"] = env["seq"].clone();
            data
        }),
        last_seq: snap.last_seq,
        usage: snap.usage.clone(),
    }
}

fn session_json(rec: &tiller_session::SessionRecord) -> SessionInfo {
    SessionInfo {
        id: rec.id.to_string(),
        cwd: rec.cwd.clone(),
        title: rec.title.clone(),
        created_at: rec.created_ms,
        updated_at: rec.updated_ms,
    }
}

/// Sessions, newest first, a page at a time.
#[utoipa::path(get, path = "/api/sessions", tag = "sessions", params(ListQuery),
    responses((status = 200, body = SessionList)))]
pub async fn list_sessions(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SessionList>> {
    let page = st
        .sessions
        .list(q.cursor.as_deref(), q.limit.unwrap_or(50).clamp(1, 500))
        .await?;
    Ok(Json(SessionList {
        sessions: page.sessions.iter().map(session_json).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// Creates a session; answered once it is stored.
#[utoipa::path(post, path = "/api/sessions", tag = "sessions", request_body(content = CreateBody, description = "Empty for every default"),
    responses((status = 201, body = SessionInfo)))]
pub async fn create_session(
    State(st): State<AppState>,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<SessionInfo>)> {
    // An empty body means every default.
    let body: CreateBody = if body.is_empty() {
        CreateBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| bad_request(format!("invalid body: {e}")))?
    };
    let engine = st.sessions.engines().get(body.engine.as_deref())?;
    let cwd = match body.cwd {
        Some(cwd) => cwd,
        // Its tools act in that directory: never a default.
        None if engine.uses_directory() => {
            return Err(bad_request(format!(
                "cwd is required for a session on engine `{}` (its tools work in that directory)",
                engine.name()
            )));
        }
        None => "/".into(),
    };
    let handle = st
        .sessions
        .create_with(cwd, body.title, body.engine)
        .await?;
    let rec = st.sessions.record(handle.id()).await?;
    Ok((StatusCode::CREATED, Json(session_json(&rec))))
}

/// The engines sessions may use.
#[utoipa::path(get, path = "/api/engines", tag = "engines",
    responses((status = 200, body = EngineList)))]
pub async fn list_engines(State(st): State<AppState>) -> Json<EngineList> {
    let engines = st.sessions.engines();
    Json(EngineList {
        default: engines.default_name().to_owned(),
        engines: engines
            .describe()
            .into_iter()
            .map(|(name, models)| EngineInfo { name, models })
            .collect(),
    })
}

/// The options a client may change.
#[utoipa::path(get, path = "/api/sessions/{id}/options", tag = "sessions", params(("id" = String, Path)),
    responses((status = 200, body = OptionList)))]
pub async fn get_options(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<OptionList>> {
    let options = open(&st, &id).await?.options().await?;
    Ok(Json(OptionList { options }))
}

/// Sets one option (`model`, `permission_mode`); answers every option.
#[utoipa::path(put, path = "/api/sessions/{id}/options/{option}", tag = "sessions",
    params(("id" = String, Path), ("option" = String, Path)), request_body = OptionBody,
    responses((status = 200, body = OptionList)))]
pub async fn set_option(
    State(st): State<AppState>,
    Path((id, option)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> ApiResult<Json<OptionList>> {
    let body: OptionBody =
        serde_json::from_slice(&body).map_err(|e| bad_request(format!("invalid body: {e}")))?;
    let options = open(&st, &id)
        .await?
        .set_option(option, body.value)
        .await?
        .map_err(bad_request)?;
    Ok(Json(OptionList { options }))
}

/// A session and the state of its turns.
#[utoipa::path(get, path = "/api/sessions/{id}", tag = "sessions", params(("id" = String, Path)),
    responses((status = 200, body = SessionState)))]
pub async fn get_session(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionState>> {
    let handle = open(&st, &id).await?;
    let rec = st.sessions.record(handle.id()).await?;
    let snap = handle.snapshot().await?;
    Ok(Json(SessionState {
        info: session_json(&rec),
        snapshot: snapshot_json(&snap),
    }))
}

/// Renames a session: answered once stored; attached clients get
/// `session_info_update`.
#[utoipa::path(patch, path = "/api/sessions/{id}", tag = "sessions", params(("id" = String, Path)),
    request_body = SessionPatch, responses((status = 200, body = SessionInfo)))]
pub async fn update_session(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SessionPatch>,
) -> ApiResult<Json<SessionInfo>> {
    let handle = open(&st, &id).await?;
    if body.title.as_ref().is_some_and(|t| t.len() > 1024) {
        return Err(bad_request("title: at most 1024 bytes"));
    }
    handle.set_title(body.title).await?;
    let rec = st.sessions.record(handle.id()).await?;
    Ok(Json(session_json(&rec)))
}

/// Closes a session (its history stays), or with `purge=true` deletes it.
#[utoipa::path(delete, path = "/api/sessions/{id}", tag = "sessions", params(("id" = String, Path), CloseQuery),
    responses((status = 204, description = "Closed or deleted")))]
pub async fn close_session(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<CloseQuery>,
) -> ApiResult<StatusCode> {
    if q.purge {
        st.sessions.delete(session_id(&id)?).await?;
    } else {
        open(&st, &id).await?.close().await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The prompt's text and images: `text`, or ACP content blocks.
fn prompt_content(body: &PromptBody) -> ApiResult<(String, Vec<tiller_session::Image>)> {
    match (&body.text, &body.content) {
        (Some(t), None) => Ok((t.clone(), Vec::new())),
        (None, Some(blocks)) => tiller_acp::map::prompt_content_json(blocks).map_err(bad_request),
        _ => Err(bad_request("give exactly one of `text` or `content`")),
    }
}

/// Sends a prompt: 202 once it is stored (its events and terminal arrive
/// on the event stream), or 200 for a slash command Tiller ran at once.
#[utoipa::path(post, path = "/api/sessions/{id}/prompts", tag = "turns", params(("id" = String, Path)),
    request_body = PromptBody,
    responses((status = 202, body = PromptAccepted), (status = 200, body = CommandResult),
        (status = 409, body = ErrorResponse, description = "The session is closed"),
        (status = 429, body = ErrorResponse, description = "Too many prompts queued; retry later")))]
pub async fn post_prompt(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<PromptBody>,
) -> ApiResult<Response> {
    let (text, images) = prompt_content(&body)?;
    let handle = open(&st, &id).await?;
    // Tiller's slash commands run at once: 200 with what to show.
    if let Some(cmd) = tiller_session::commands::parse(&text) {
        use tiller_session::commands::CommandError;
        let message = match cmd {
            Ok(cmd) => st.sessions.run_command(&handle, cmd).await,
            Err(why) => Err(CommandError::Refused(why)),
        };
        return match message {
            Ok(m) => Ok((
                StatusCode::OK,
                Json(CommandResult {
                    command: true,
                    message: m,
                }),
            )
                .into_response()),
            Err(CommandError::Refused(why)) => Err(bad_request(why)),
            Err(CommandError::Session(e)) => Err(e.into()),
        };
    }
    let delivery = tiller_session::delivery::caller_meta(body.meta.as_ref(), "http");
    // Answered once the prompt is stored; its terminal arrives on the stream.
    let (prompt, _settled) = handle
        .submit(
            PromptId::new(),
            (text, images),
            Origin::Interactive,
            delivery,
            tiller_session::Acknowledge::Admission,
        )
        .await??;
    Ok(accepted(prompt).into_response())
}

fn accepted(prompt: PromptId) -> (StatusCode, Json<PromptAccepted>) {
    (
        StatusCode::ACCEPTED,
        Json(PromptAccepted {
            prompt_id: prompt.to_string(),
        }),
    )
}

/// `/compact` as a prompt of its own: the engine summarizes the older
/// turns (model engines; a hosted agent that knows `/compact` does its
/// own). 202 with the prompt's id, like any prompt.
#[utoipa::path(post, path = "/api/sessions/{id}/compact", tag = "turns", params(("id" = String, Path)),
    responses((status = 202, body = PromptAccepted),
        (status = 409, body = ErrorResponse, description = "The session is closed"),
        (status = 429, body = ErrorResponse, description = "Too many prompts queued; retry later")))]
pub async fn post_compact(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<PromptAccepted>)> {
    let handle = open(&st, &id).await?;
    let (prompt, _settled) = handle
        .submit(
            PromptId::new(),
            ("/compact".to_owned(), Vec::new()),
            Origin::Interactive,
            None,
            tiller_session::Acknowledge::Admission,
        )
        .await??;
    Ok(accepted(prompt))
}

/// Steers the running turn: the text reaches the engine mid-turn, or
/// (idle) starts a turn unless `idleBehavior` is `promptRequired`.
#[utoipa::path(post, path = "/api/sessions/{id}/steer", tag = "turns", params(("id" = String, Path)),
    request_body = SteerBody, responses((status = 200, body = SteerAnswer),
        (status = 409, body = ErrorResponse, description = "The session is closed"),
        (status = 429, body = ErrorResponse, description = "Too many prompts queued; retry later")))]
pub async fn post_steer(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SteerBody>,
) -> ApiResult<Json<SteerAnswer>> {
    let prompt_required = match body.idle_behavior.as_deref() {
        None => false,
        Some("promptRequired") => true,
        Some(other) => {
            return Err(bad_request(format!(
                "unknown idleBehavior `{other}`; expected \"promptRequired\""
            )));
        }
    };
    let handle = open(&st, &id).await?;
    let answer = handle.steer(body.text, prompt_required).await??;
    let v = tiller_acp::map::steer_answer(&answer);
    let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Ok(Json(SteerAnswer {
        outcome: field("outcome").unwrap_or_default(),
        steer_id: field("steerId"),
        prompt_id: field("promptId"),
        reason: field("reason"),
    }))
}

/// Cancels the running turn; its terminal (`cancelled`) arrives on the
/// stream. Accepted even when nothing runs.
#[utoipa::path(post, path = "/api/sessions/{id}/cancel", tag = "turns", params(("id" = String, Path)),
    responses((status = 202, description = "Cancel requested")))]
pub async fn post_cancel(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    open(&st, &id).await?.cancel()?;
    Ok(StatusCode::ACCEPTED)
}

/// Answers a permission request of the running turn.
#[utoipa::path(post, path = "/api/sessions/{id}/permissions/{req}", tag = "turns",
    params(("id" = String, Path), ("req" = String, Path, description = "The request's id")),
    request_body = PermissionBody, responses((status = 204, description = "Answered")))]
pub async fn post_permission(
    State(st): State<AppState>,
    Path((id, req_id)): Path<(String, String)>,
    ApiJson(body): ApiJson<PermissionBody>,
) -> ApiResult<StatusCode> {
    let handle = open(&st, &id).await?;
    match handle.permission(req_id, body.option_id).await? {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(e @ PermissionRefused::Unknown(_)) => Err(ApiError(
            StatusCode::NOT_FOUND,
            json!({ "errorKind": "unknown_permission_request", "message": e.to_string() }),
        )),
        Err(e @ PermissionRefused::BadOption(_)) => Err(bad_request(e.to_string())),
    }
}

/// A background notification, run as its own turn when the session is
/// idle; answered once stored.
#[utoipa::path(post, path = "/api/sessions/{id}/notifications", tag = "automation", params(("id" = String, Path)),
    request_body = NotificationBody, responses((status = 202, body = NotificationAccepted)))]
pub async fn post_notification(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<NotificationBody>,
) -> ApiResult<(StatusCode, Json<NotificationAccepted>)> {
    if body.task_id.is_empty() || body.text.is_empty() {
        return Err(bad_request("`taskId` and `text` must not be empty"));
    }
    let handle = open(&st, &id).await?;
    let e = st
        .sessions
        .notify(handle.id(), body.task_id, body.text)
        .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(NotificationAccepted {
            deduplicated: e.deduplicated,
            evicted: e.evicted,
        }),
    ))
}

fn goal_json(g: &tiller_session::GoalRow) -> Goal {
    Goal {
        objective: g.objective.clone(),
        max_turns: g.max_turns,
        turns_done: g.turns_done,
        status: g.status.clone(),
        pause_reason: g.pause_reason.clone(),
        consecutive_loop_stops: g.loop_stops,
    }
}

fn no_goal() -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        json!({ "errorKind": "no_goal", "message": "this session has no goal" }),
    )
}

/// The session's goal.
#[utoipa::path(get, path = "/api/sessions/{id}/goal", tag = "automation", params(("id" = String, Path)),
    responses((status = 200, body = Goal)))]
pub async fn get_goal(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<Goal>> {
    let id = session_id(&id)?;
    match st.sessions.goal_get(id).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

/// Sets the session's goal: turns continue toward it until done or
/// `maxTurns`.
#[utoipa::path(put, path = "/api/sessions/{id}/goal", tag = "automation", params(("id" = String, Path)),
    request_body = GoalBody, responses((status = 200, body = Goal)))]
pub async fn put_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<GoalBody>,
) -> ApiResult<Json<Goal>> {
    let id = session_id(&id)?;
    if body.objective.trim().is_empty() {
        return Err(bad_request("`objective` must not be empty"));
    }
    let max_turns = body.max_turns.unwrap_or(10);
    if !(1..=1000).contains(&max_turns) {
        return Err(bad_request("`maxTurns` must be between 1 and 1000"));
    }
    let g = st.sessions.goal_set(id, body.objective, max_turns).await?;
    Ok(Json(goal_json(&g)))
}

/// Clears the session's goal.
#[utoipa::path(delete, path = "/api/sessions/{id}/goal", tag = "automation", params(("id" = String, Path)),
    responses((status = 204, description = "Cleared")))]
pub async fn delete_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = session_id(&id)?;
    if st.sessions.goal_clear(id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(no_goal())
    }
}

/// Pauses the session's goal.
#[utoipa::path(post, path = "/api/sessions/{id}/goal/pause", tag = "automation", params(("id" = String, Path)),
    responses((status = 200, body = Goal)))]
pub async fn pause_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Goal>> {
    let id = session_id(&id)?;
    match st.sessions.goal_pause_resume(id, false).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

/// Resumes the session's goal.
#[utoipa::path(post, path = "/api/sessions/{id}/goal/resume", tag = "automation", params(("id" = String, Path)),
    responses((status = 200, body = Goal)))]
pub async fn resume_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Goal>> {
    let id = session_id(&id)?;
    match st.sessions.goal_pause_resume(id, true).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

fn cron_json(j: &tiller_session::CronJob) -> CronJob {
    CronJob {
        id: j.id.clone(),
        session_id: j.session.to_string(),
        schedule: j.schedule.clone(),
        tz: j.tz.clone(),
        prompt: j.prompt.clone(),
        next_fire: j.next_fire_ms,
    }
}

/// Every cron job.
#[utoipa::path(get, path = "/api/cron", tag = "automation", responses((status = 200, body = CronList)))]
pub async fn list_cron(State(st): State<AppState>) -> ApiResult<Json<CronList>> {
    let jobs = st.sessions.cron_list().await?;
    Ok(Json(CronList {
        jobs: jobs.iter().map(cron_json).collect(),
    }))
}

/// Adds a cron job: each fire queues the prompt in the session.
#[utoipa::path(post, path = "/api/cron", tag = "automation", request_body = CronBody,
    responses((status = 201, body = CronCreated)))]
pub async fn add_cron(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<CronBody>,
) -> ApiResult<(StatusCode, Json<CronCreated>)> {
    let session = SessionId::parse(&body.session_id)
        .ok_or_else(|| ApiError::from(SessionError::Unknown(SessionId::from_u128(0))))?;
    if body.prompt.is_empty() {
        return Err(bad_request("`prompt` must not be empty"));
    }
    let tz = body.tz.unwrap_or_else(|| "UTC".into());
    let job = st
        .sessions
        .cron_add(session, body.schedule, tz, body.prompt)
        .await?
        .map_err(bad_request)?;
    Ok((
        StatusCode::CREATED,
        Json(CronCreated {
            id: job.id,
            next_fire: job.next_fire_ms,
        }),
    ))
}

/// Removes a cron job.
#[utoipa::path(delete, path = "/api/cron/{id}", tag = "automation", params(("id" = String, Path)),
    responses((status = 204, description = "Removed")))]
pub async fn remove_cron(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    if st.sessions.cron_remove(id.clone()).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError(
            StatusCode::NOT_FOUND,
            json!({ "errorKind": "unknown_cron_job", "message": format!("no cron job {id}") }),
        ))
    }
}

/// A page of the session's event log, oldest first, ending before `before`.
#[utoipa::path(get, path = "/api/sessions/{id}/history", tag = "sessions", params(("id" = String, Path), HistoryQuery),
    responses((status = 200, body = HistoryPage)))]
pub async fn get_history(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<HistoryQuery>,
) -> ApiResult<Json<HistoryPage>> {
    let id = session_id(&id)?;
    st.sessions.record(id).await?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let (events, has_more) = st.sessions.history(id, q.before, limit).await?;
    let next_before = if has_more {
        events.first().map(|e| e.seq)
    } else {
        None
    };
    Ok(Json(HistoryPage {
        events: events.iter().map(typed_envelope).collect(),
        next_before,
        has_more,
    }))
}

/// Feeds one SSE stream. Bounded, and never slows the session: when its
/// queue is full the event is dropped for it and the stream reads what it
/// missed from the log ([`Cursor`]).
struct SseSubscriber {
    tx: mpsc::Sender<Arc<EventRecord>>,
    behind: Arc<AtomicBool>,
}

impl Subscriber for SseSubscriber {
    fn deliver(&self, event: &Arc<EventRecord>) -> bool {
        match self.tx.try_send(event.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.behind.store(true, Ordering::Release);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// Unsubscribes when the client goes away.
struct Detach(SessionHandle, tiller_session::SubscriberId);

impl Drop for Detach {
    fn drop(&mut self) {
        self.0.unsubscribe(self.1);
    }
}

fn sse_event(rec: &EventRecord) -> Event {
    Event::default()
        .id(rec.seq.to_string())
        .event("event")
        .data(envelope(rec).to_string())
}

/// `GET /api/sessions/:id/events`: `session_snapshot` first, then the events
/// after `Last-Event-ID` (or `?after=`) from the log, then live ones. The
/// subscription is made before the replay is read, so nothing falls
/// between; a client too slow for the live events reads them from the log.
#[utoipa::path(get, path = "/api/sessions/{id}/events", tag = "sessions",
    params(("id" = String, Path), EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this sequence number")),
    responses((status = 200, content_type = "text/event-stream",
        description = "`session_snapshot` (a Snapshot), then `event` messages (each an Envelope, its `seq` as the id)")))]
pub async fn events(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
    headers: HeaderMap,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let handle = open(&st, &id).await?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .or(q.after);
    let (tx, mut rx) = mpsc::channel(st.subscriber_queue);
    let behind = Arc::new(AtomicBool::new(false));
    let sub = st.sessions.subscriber_id();
    let snap = handle
        .subscribe(
            sub,
            Box::new(SseSubscriber {
                tx,
                behind: behind.clone(),
            }),
        )
        .await?;
    let sessions = st.sessions.clone();
    let session = handle.id();
    let detach = Detach(handle, sub);
    let stream = async_stream(move |out| async move {
        let _detach = detach;
        let _ = follow(&sessions, session, snap, after, &mut rx, &behind, &out).await;
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// Why a stream ended: the client stopped reading, the log could not be
/// read, or the session's actor ended (the client reconnects).
struct Ended;

/// Feeds one stream: the snapshot, the replay up to it, then live events
/// by the view rule ([`Cursor`]).
async fn follow(
    sessions: &Sessions,
    session: SessionId,
    snap: Snapshot,
    after: Option<u64>,
    rx: &mut mpsc::Receiver<Arc<EventRecord>>,
    behind: &AtomicBool,
    out: &Out,
) -> Result<(), Ended> {
    let last = snap.last_seq;
    out.send(
        Event::default()
            .event("session_snapshot")
            .data(serde_json::to_string(&snapshot_json(&snap)).expect("snapshots serialize")),
    )
    .await?;
    // Without a position the client starts from the snapshot.
    let mut cursor = Cursor::at(session, after.map_or(last, |a| a.min(last)));
    // Replay what the client missed, up to `last`; later ones are live.
    replay(sessions, &mut cursor, Some(last), out).await?;
    loop {
        if behind.swap(false, Ordering::AcqRel) {
            metrics::counter!("tiller_sse_catch_ups_total").increment(1);
            replay(sessions, &mut cursor, None, out).await?;
        }
        // While a gap is open, the log is read again now and then even if
        // the session has gone quiet.
        let next = if behind.load(Ordering::Acquire) {
            match tokio::time::timeout(GAP_RETRY, rx.recv()).await {
                Ok(next) => next,
                Err(_) => continue,
            }
        } else {
            rx.recv().await
        };
        let rec = next.ok_or(Ended)?;
        if cursor.live(rec.seq) == Live::CatchUp {
            replay(sessions, &mut cursor, Some(rec.seq), out).await?;
        }
        match cursor.live(rec.seq) {
            Live::Skip => {}
            // The next one (at once, or once the gap before it was read).
            Live::Send => {
                out.send(sse_event(&rec)).await?;
                cursor.advance(rec.seq);
            }
            // The log does not hold the gap yet (the store is recovering):
            // never out of order; read again soon.
            Live::CatchUp => behind.store(true, Ordering::Release),
        }
    }
}

/// How soon a stream with a gap the log did not hold reads it again.
const GAP_RETRY: Duration = Duration::from_millis(100);

/// How long a stream may wait for its client to read before it ends (the
/// client reconnects with `Last-Event-ID` and loses nothing).
const WRITE_STALL: Duration = Duration::from_secs(300);

/// Sends the stored events after `cursor` up to `until` (`None`: all),
/// page by page.
async fn replay(
    sessions: &Sessions,
    cursor: &mut Cursor,
    until: Option<u64>,
    out: &Out,
) -> Result<(), Ended> {
    loop {
        let page = match cursor.page(sessions, until, 500).await {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the log for an event stream");
                return Err(Ended);
            }
        };
        if page.is_empty() {
            return Ok(());
        }
        for rec in &page {
            out.send(sse_event(rec)).await?;
        }
    }
}

/// Where an SSE producer writes.
struct Out(mpsc::Sender<Event>);

impl Out {
    /// Ends the stream when the client went away or read nothing for
    /// [`WRITE_STALL`].
    async fn send(&self, e: Event) -> Result<(), Ended> {
        match tokio::time::timeout(WRITE_STALL, self.0.send(e)).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Ended),
        }
    }
}

/// A stream fed by an async producer (ends when the producer does, or is
/// dropped with the response when the client goes away).
fn async_stream<F, Fut>(producer: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(Out) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(producer(Out(tx)));
    let abort = AbortOnDrop(task);
    futures::stream::unfold((rx, abort), |(mut rx, abort)| async move {
        rx.recv().await.map(|e| (Ok(e), (rx, abort)))
    })
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session whose actor went away mid-request (its lease moved, or
    /// it failed) is the service's condition, not a bug: 503, and not
    /// retryable blindly, since the request may have been carried out.
    #[test]
    fn a_session_that_stopped_mid_request_is_unavailable_not_internal() {
        let ApiError(status, body) = SessionError::Stopped.into();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["errorKind"], "session_stopped");
        assert_eq!(body["retryable"], false);
        assert!(body["message"].as_str().unwrap().contains("may or may not"));
    }
}
