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
use serde::Deserialize;
use serde_json::{Value, json};
use tiller_core::{Origin, PromptId, SessionId};
use tiller_session::view::{Cursor, Live};
use tiller_session::{
    EventBody, EventRecord, PermissionRefused, PromptRefused, SessionError, SessionHandle,
    Sessions, Snapshot, Subscriber,
};
use tokio::sync::mpsc;

use crate::AppState;

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
            SessionError::Store(e) if e.is_unavailable() => store_unavailable(e.to_string()),
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
    let mut data = serde_json::to_value(&rec.body).expect("events serialize");
    let kind = data
        .as_object_mut()
        .and_then(|o| o.remove("type"))
        .unwrap_or(Value::Null);
    if let EventBody::TurnError { .. } = rec.body {
        data["sessionId"] = json!(rec.session.to_string());
        data["promptId"] = json!(rec.prompt.map(|p| p.to_string()));
    }
    let mut env = json!({ "seq": rec.seq, "type": kind, "ts": rec.ts_ms, "data": data });
    if let Some(p) = rec.prompt {
        env["promptId"] = json!(p.to_string());
    }
    if let Some(t) = rec.turn {
        env["turnId"] = json!(t.0);
    }
    env
}

fn snapshot_json(snap: &Snapshot) -> Value {
    json!({
        "state": snap.state.as_str(),
        "activePromptId": snap.active_prompt.map(|p| p.to_string()),
        "queued": snap.queued.iter().map(PromptId::to_string).collect::<Vec<_>>(),
        "pendingPermission": snap.pending_permission.as_ref().map(|e| {
            let mut data = envelope(e)["data"].clone();
            data["promptId"] = json!(e.prompt.map(|p| p.to_string()));
            data
        }),
        "lastTurnError": snap.last_turn_error.as_ref().map(|e| {
            let env = envelope(e);
            let mut data = env["data"].clone();
            data["seq"] = env["seq"].clone();
            data
        }),
        "lastSeq": snap.last_seq,
        "usage": snap.usage,
    })
}

fn session_json(rec: &tiller_session::SessionRecord) -> Value {
    json!({
        "id": rec.id.to_string(),
        "cwd": rec.cwd,
        "title": rec.title,
        "createdAt": rec.created_ms,
        "updatedAt": rec.updated_ms,
    })
}

#[derive(Deserialize)]
pub struct ListQuery {
    cursor: Option<String>,
    limit: Option<usize>,
}

pub async fn list_sessions(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<Value>> {
    let page = st
        .sessions
        .list(q.cursor.as_deref(), q.limit.unwrap_or(50).clamp(1, 500))
        .await?;
    Ok(Json(json!({
        "sessions": page.sessions.iter().map(session_json).collect::<Vec<_>>(),
        "nextCursor": page.next_cursor,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    cwd: Option<String>,
    engine: Option<String>,
    title: Option<String>,
}

pub async fn create_session(
    State(st): State<AppState>,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    // An empty body means every default.
    let body: CreateBody = if body.is_empty() {
        CreateBody {
            cwd: None,
            engine: None,
            title: None,
        }
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

/// `GET /api/engines`: the engines sessions may use.
pub async fn list_engines(State(st): State<AppState>) -> Json<Value> {
    let engines = st.sessions.engines();
    Json(json!({
        "default": engines.default_name(),
        "engines": engines
            .describe()
            .into_iter()
            .map(|(name, models)| json!({ "name": name, "models": models }))
            .collect::<Vec<_>>(),
    }))
}

/// `GET /api/sessions/:id/options`: the options a client may change.
pub async fn get_options(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let options = open(&st, &id).await?.options().await?;
    Ok(Json(json!({ "options": options })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptionBody {
    value: String,
}

/// `PUT /api/sessions/:id/options/:option` `{value}`.
pub async fn set_option(
    State(st): State<AppState>,
    Path((id, option)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> ApiResult<Json<Value>> {
    let body: OptionBody =
        serde_json::from_slice(&body).map_err(|e| bad_request(format!("invalid body: {e}")))?;
    let options = open(&st, &id)
        .await?
        .set_option(option, body.value)
        .await?
        .map_err(bad_request)?;
    Ok(Json(json!({ "options": options })))
}

pub async fn get_session(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let handle = open(&st, &id).await?;
    let rec = st.sessions.record(handle.id()).await?;
    let snap = handle.snapshot().await?;
    let mut v = session_json(&rec);
    if let (Some(o), Value::Object(s)) = (v.as_object_mut(), snapshot_json(&snap)) {
        o.extend(s);
    }
    Ok(Json(v))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionPatch {
    /// The new title; `null` or blank clears it.
    title: Option<String>,
}

/// `PATCH /api/sessions/:id {title}`: answered once stored; attached
/// clients get `session_info_update`.
pub async fn update_session(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SessionPatch>,
) -> ApiResult<Json<Value>> {
    let handle = open(&st, &id).await?;
    if body.title.as_ref().is_some_and(|t| t.len() > 1024) {
        return Err(bad_request("title: at most 1024 bytes"));
    }
    handle.set_title(body.title).await?;
    let rec = st.sessions.record(handle.id()).await?;
    Ok(Json(session_json(&rec)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloseQuery {
    /// Delete the session with its history, state, queued work and cron
    /// jobs, instead of closing it.
    #[serde(default)]
    purge: bool,
}

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PromptBody {
    text: Option<String>,
    content: Option<Vec<Value>>,
    #[allow(dead_code)] // accepted for clients that tag their prompts
    client_id: Option<String>,
    /// May ask for delivery; origin markers in it are ignored.
    #[serde(rename = "_meta")]
    meta: Option<Value>,
}

/// The prompt's text and images: `text`, or ACP content blocks.
fn prompt_content(body: &PromptBody) -> ApiResult<(String, Vec<tiller_session::Image>)> {
    match (&body.text, &body.content) {
        (Some(t), None) => Ok((t.clone(), Vec::new())),
        (None, Some(blocks)) => tiller_acp::map::prompt_content_json(blocks).map_err(bad_request),
        _ => Err(bad_request("give exactly one of `text` or `content`")),
    }
}

pub async fn post_prompt(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<PromptBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
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
                Json(json!({ "command": true, "message": m })),
            )),
            Err(CommandError::Refused(why)) => Err(bad_request(why)),
            Err(CommandError::Session(e)) => Err(e.into()),
        };
    }
    let delivery = tiller_session::delivery::caller_meta(body.meta.as_ref(), "http");
    // Answered once the prompt is stored; its terminal arrives on the stream.
    let (prompt, _settled) = handle
        .submit(PromptId::new(), text, images, Origin::Interactive, delivery)
        .await??;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "promptId": prompt.to_string() })),
    ))
}

/// `/compact` as a prompt of its own: the engine summarizes the older
/// turns (model engines; a hosted agent that knows `/compact` does its
/// own). 202 with the prompt's id, like any prompt.
pub async fn post_compact(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let handle = open(&st, &id).await?;
    let (prompt, _settled) = handle
        .submit(
            PromptId::new(),
            "/compact".to_owned(),
            Vec::new(),
            Origin::Interactive,
            None,
        )
        .await??;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "promptId": prompt.to_string() })),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SteerBody {
    text: String,
    idle_behavior: Option<String>,
}

pub async fn post_steer(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SteerBody>,
) -> ApiResult<Json<Value>> {
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
    Ok(Json(tiller_acp::map::steer_answer(&answer)))
}

pub async fn post_cancel(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    open(&st, &id).await?.cancel()?;
    Ok(StatusCode::ACCEPTED)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PermissionBody {
    option_id: String,
}

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NotificationBody {
    task_id: String,
    text: String,
}

/// `POST /api/sessions/:id/notifications`: a background notification, run
/// as its own turn when the session is idle.
pub async fn post_notification(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<NotificationBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
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
        Json(json!({ "deduplicated": e.deduplicated, "evicted": e.evicted })),
    ))
}

fn goal_json(g: &tiller_session::GoalRow) -> Value {
    json!({
        "objective": g.objective,
        "maxTurns": g.max_turns,
        "turnsDone": g.turns_done,
        "status": g.status,
        "pauseReason": g.pause_reason,
        "consecutiveLoopStops": g.loop_stops,
    })
}

fn no_goal() -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        json!({ "errorKind": "no_goal", "message": "this session has no goal" }),
    )
}

pub async fn get_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let id = session_id(&id)?;
    match st.sessions.goal_get(id).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GoalBody {
    objective: String,
    max_turns: Option<u32>,
}

pub async fn put_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<GoalBody>,
) -> ApiResult<Json<Value>> {
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

pub async fn pause_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let id = session_id(&id)?;
    match st.sessions.goal_pause_resume(id, false).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

pub async fn resume_goal(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let id = session_id(&id)?;
    match st.sessions.goal_pause_resume(id, true).await? {
        Some(g) => Ok(Json(goal_json(&g))),
        None => Err(no_goal()),
    }
}

fn cron_json(j: &tiller_session::CronJob) -> Value {
    json!({
        "id": j.id,
        "sessionId": j.session.to_string(),
        "schedule": j.schedule,
        "tz": j.tz,
        "prompt": j.prompt,
        "nextFire": j.next_fire_ms,
    })
}

pub async fn list_cron(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let jobs = st.sessions.cron_list().await?;
    Ok(Json(
        json!({ "jobs": jobs.iter().map(cron_json).collect::<Vec<_>>() }),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CronBody {
    session_id: String,
    schedule: String,
    tz: Option<String>,
    prompt: String,
}

pub async fn add_cron(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<CronBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
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
        Json(json!({ "id": job.id, "nextFire": job.next_fire_ms })),
    ))
}

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

#[derive(Deserialize)]
pub struct HistoryQuery {
    before: Option<u64>,
    limit: Option<usize>,
}

pub async fn get_history(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<HistoryQuery>,
) -> ApiResult<Json<Value>> {
    let id = session_id(&id)?;
    st.sessions.record(id).await?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let (events, has_more) = st.sessions.history(id, q.before, limit).await?;
    let next_before = if has_more {
        events.first().map(|e| e.seq)
    } else {
        None
    };
    Ok(Json(json!({
        "events": events.iter().map(envelope).collect::<Vec<_>>(),
        "nextBefore": next_before,
        "hasMore": has_more,
    })))
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

#[derive(Deserialize)]
pub struct EventsQuery {
    after: Option<u64>,
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
            .data(snapshot_json(&snap).to_string()),
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
