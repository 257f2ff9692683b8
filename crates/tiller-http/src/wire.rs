//! The JSON shapes of `/api`: what the handlers take and answer. The
//! OpenAPI description (`openapi.rs`) is generated from these types, so the
//! description and the handlers cannot disagree.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

/// Every error: `{"error": {...}}`.
#[derive(Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

/// What went wrong. Clients branch on `errorKind`, never on `message`;
/// some kinds add fields (`sessionId`, `step`, `retryable`; `node` and
/// `address` for `owned_elsewhere`).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    /// `invalid_params`, `unauthorized`, `forbidden`, `unknown_session`,
    /// `session_closed`, `overloaded`, `store_unavailable`, `no_goal`,
    /// `unknown_cron_job`, `unknown_permission_request`, `owned_elsewhere`
    /// (another node of the cluster serves the session), `session_stopped`
    /// (the session stopped while handling the request, which may or may
    /// not have been carried out), `internal`.
    pub error_kind: String,
    /// In English, for people.
    pub message: String,
    /// Whether the same request may succeed later.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
}

/// A session as listed.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    pub id: String,
    /// The directory its tools work in.
    pub cwd: String,
    pub title: Option<String>,
    /// Unix milliseconds.
    pub created_at: i64,
    /// Unix milliseconds.
    pub updated_at: i64,
}

/// A session with its server-owned state: what every stream starts with.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionState {
    #[serde(flatten)]
    pub info: SessionInfo,
    #[serde(flatten)]
    pub snapshot: Snapshot,
}

/// The state of a session's turns (the SSE stream's `session_snapshot`).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// `idle`, `running` or `cancelling`.
    pub state: String,
    pub active_prompt_id: Option<String>,
    /// Prompts admitted and waiting, in order.
    pub queued: Vec<String>,
    /// The permission request waiting for an answer (a `permission_request`
    /// event's data with its `promptId`).
    #[schema(value_type = Option<Object>)]
    pub pending_permission: Option<Value>,
    /// The last failed turn (a `turn_error` event's data with its `seq`):
    /// survives a reload until the next turn starts.
    #[schema(value_type = Option<Object>)]
    pub last_turn_error: Option<Value>,
    /// The sequence number of the last stored event.
    pub last_seq: u64,
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<tiller_session::UsageTotals>,
}

/// Token use and cost so far (model engines).
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // the schema of `tiller_session::UsageTotals`
pub struct Usage {
    input_tokens: u64,
    output_tokens: u64,
    /// Tokens in context after the last request.
    used: u64,
    context_window: u64,
    cost: Option<Cost>,
}

/// An amount of money.
#[derive(ToSchema)]
#[allow(dead_code)] // the schema of `tiller_session::Cost`
pub struct Cost {
    amount: f64,
    /// ISO 4217.
    currency: String,
}

/// A page of sessions, newest first.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
    /// Pass as `cursor` for the next page; `null` on the last.
    pub next_cursor: Option<String>,
}

/// The engines sessions may use.
#[derive(Serialize, ToSchema)]
pub struct EngineList {
    pub default: String,
    pub engines: Vec<EngineInfo>,
}

/// One engine and the models it offers.
#[derive(Serialize, ToSchema)]
pub struct EngineInfo {
    pub name: String,
    pub models: Vec<String>,
}

/// The options a client may change.
#[derive(Serialize, ToSchema)]
pub struct OptionList {
    #[schema(value_type = Vec<OptionInfo>)]
    pub options: Vec<tiller_session::ConfigOption>,
}

/// One session option (`session/set_config_option` in ACP).
#[derive(ToSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // the schema of `tiller_session::ConfigOption`
pub struct OptionInfo {
    /// `model` or `permission_mode`.
    id: String,
    name: String,
    /// `model` or `mode`.
    category: String,
    current: String,
    choices: Vec<String>,
    /// Present (true) for an on/off switch.
    boolean: Option<bool>,
}

/// A prompt stored and queued; its events and terminal arrive on the stream.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromptAccepted {
    pub prompt_id: String,
}

/// A slash command Tiller ran at once (`/compact` is a prompt instead).
#[derive(Serialize, ToSchema)]
pub struct CommandResult {
    /// Always true.
    pub command: bool,
    /// What to show.
    pub message: String,
}

/// A prompt sent through a channel.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChannelAccepted {
    pub prompt_id: String,
    pub session_id: String,
}

/// What became of a steer: `injected` (with `steerId`), `startedNewTurn`
/// (with `promptId`) or `promptRequired` (with `reason`).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SteerAnswer {
    pub outcome: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steer_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_id: Option<String>,
    /// `noRunningTurn`, `turnCancelling`, `sessionClosing`, `notSupported`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A notification stored.
#[derive(Serialize, ToSchema)]
pub struct NotificationAccepted {
    /// The session already held one with this `taskId`.
    pub deduplicated: bool,
    /// Older notifications dropped to stay under the queue's cap.
    pub evicted: Vec<String>,
}

/// A session's goal.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Goal {
    pub objective: String,
    pub max_turns: u32,
    pub turns_done: u32,
    /// `active`, `paused` or `completed`.
    pub status: String,
    pub pause_reason: Option<String>,
    pub consecutive_loop_stops: u32,
}

/// A cron job.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CronJob {
    pub id: String,
    pub session_id: String,
    pub schedule: String,
    pub tz: String,
    pub prompt: String,
    /// Unix milliseconds.
    pub next_fire: i64,
}

/// Every cron job.
#[derive(Serialize, ToSchema)]
pub struct CronList {
    pub jobs: Vec<CronJob>,
}

/// A cron job stored.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CronCreated {
    pub id: String,
    /// Unix milliseconds.
    pub next_fire: i64,
}

/// One stored event.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Envelope {
    /// Its place in the session's log, from 1, without gaps.
    pub seq: u64,
    /// `user_message`, `agent_message_chunk`, `tool_call`, `turn_complete`,
    /// `turn_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<u64>,
    /// Unix milliseconds.
    pub ts: i64,
    /// The event's fields.
    #[schema(value_type = Object)]
    pub data: Value,
}

/// A page of a session's log, oldest first.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryPage {
    pub events: Vec<Envelope>,
    /// Pass as `before` for the previous page.
    pub next_before: Option<u64>,
    pub has_more: bool,
}

// Requests.

/// `POST /api/sessions`. An empty body takes every default.
#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// The directory its tools work in (required by engines with tools).
    pub cwd: Option<String>,
    /// An engine's name; the default engine when absent.
    pub engine: Option<String>,
    pub title: Option<String>,
}

/// `PUT /api/sessions/{id}/options/{option}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OptionBody {
    pub value: String,
}

/// `PATCH /api/sessions/{id}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionPatch {
    /// The new title (at most 1024 bytes); `null` or blank clears it.
    #[schema(max_length = 256)]
    pub title: Option<String>,
}

/// `POST /api/sessions/{id}/prompts`: exactly one of `text` or `content`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PromptBody {
    pub text: Option<String>,
    /// ACP content blocks (text, images).
    #[schema(value_type = Option<Vec<Object>>)]
    pub content: Option<Vec<Value>>,
    /// Accepted for clients that tag their prompts; not used.
    #[allow(dead_code)]
    pub client_id: Option<String>,
    /// May ask for delivery of the result (`{"tiller": {"delivery":
    /// {"webhook": URL}}}`); origin markers in it are ignored.
    #[serde(rename = "_meta")]
    #[schema(value_type = Option<Object>)]
    pub meta: Option<Value>,
}

/// `POST /api/sessions/{id}/steer`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SteerBody {
    pub text: String,
    /// `promptRequired`: refuse rather than start a turn when idle.
    pub idle_behavior: Option<String>,
}

/// `POST /api/sessions/{id}/permissions/{req}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PermissionBody {
    /// `allow_once`, `allow_always` or `reject_once`.
    pub option_id: String,
}

/// `POST /api/sessions/{id}/notifications`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NotificationBody {
    /// Deduplicates: one queued notification per task.
    #[schema(min_length = 1)]
    pub task_id: String,
    #[schema(min_length = 1)]
    pub text: String,
}

/// `PUT /api/sessions/{id}/goal`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GoalBody {
    #[schema(min_length = 1, pattern = r"\S")]
    pub objective: String,
    /// 10 when absent.
    #[schema(minimum = 1, maximum = 1000)]
    pub max_turns: Option<u32>,
}

/// `POST /api/cron`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CronBody {
    pub session_id: String,
    /// A cron expression (five or six fields).
    pub schedule: String,
    /// An IANA time zone; `UTC` when absent.
    pub tz: Option<String>,
    #[schema(min_length = 1)]
    pub prompt: String,
}

/// `POST /api/channels/{channel}/prompts`, signed with the channel's secret.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ChannelBody {
    /// One of the channel's own sessions, or one its config lists; a new
    /// session when absent.
    pub session_id: Option<String>,
    pub text: String,
    pub delivery: Option<DeliveryBody>,
}

/// Where to deliver the turn's result.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveryBody {
    pub webhook: String,
}

// Query strings.

/// `GET /api/sessions`.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// From a previous page's `nextCursor`.
    pub cursor: Option<String>,
    /// 1 to 500; 50 when absent.
    pub limit: Option<usize>,
}

/// `DELETE /api/sessions/{id}`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CloseQuery {
    /// Delete the session with its history, state, queued work and cron
    /// jobs, instead of closing it.
    #[serde(default)]
    pub purge: bool,
}

/// `GET /api/sessions/{id}/history`.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// Events before this sequence number; the newest when absent.
    pub before: Option<u64>,
    /// 1 to 1000; 100 when absent.
    pub limit: Option<usize>,
}

/// `GET /api/sessions/{id}/events`.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Replay the events after this sequence number (`Last-Event-ID` wins).
    pub after: Option<u64>,
}
