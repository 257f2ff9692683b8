//! The session event log's entries.
//!
//! `EventBody` is deliberately `Serialize`: its JSON is the durable payload
//! format of the log (the store treats it as opaque text). Wire shapes (ACP
//! `session/update`, the HTTP envelope) are made from it by the edges.

use serde::{Deserialize, Serialize};
use tiller_core::{PromptId, SessionId, TurnId};
use tiller_store::{LedgerOp, StoredEvent};

/// Status of a tool call, as ACP names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    Pending,
    InProgress,
    Completed,
    Failed,
}

/// Why a tool call failed without running.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolError {
    /// Machine-readable kind (`loop_detected`).
    pub error_kind: String,
    /// The loop type, for `loop_detected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_type: Option<String>,
    /// `LOOP_DETECTED`.
    pub code: String,
    /// Plain English.
    pub message: String,
}

/// One entry of an agent's plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanEntry {
    pub content: String,
    /// `pending`, `in_progress`, `completed`.
    pub status: String,
}

/// A slash command of a hosted agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentCommand {
    pub name: String,
    pub description: String,
}

/// One choice of a permission request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PermissionOption {
    pub option_id: String,
    pub name: String,
    /// `allow_once`, `allow_always`, `reject_once`.
    pub kind: String,
}

/// One entry of a session's log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "snake_case",
    rename_all_fields = "camelCase"
)]
pub enum EventBody {
    /// A prompt was admitted behind the running turn.
    PromptQueued {
        origin: String,
        depth: usize,
        text: String,
    },
    /// A prompt's turn started.
    PromptStarted { origin: String },
    /// The prompt's text, as the user sent it.
    UserMessage {
        text: String,
        /// Images it carried.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<tiller_engine::Image>,
    },
    /// Streamed agent text.
    AgentMessageChunk { text: String },
    /// Streamed agent thought.
    AgentThoughtChunk { text: String },
    /// The agent's plan (replaces any earlier plan of the turn).
    Plan { entries: Vec<PlanEntry> },
    /// A tool call was requested.
    ToolCall {
        tool_call_id: String,
        name: String,
        input: serde_json::Value,
        status: ToolStatus,
        /// Absolute paths the call works on (editors follow along).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        locations: Vec<String>,
        /// The ACP tool kind a hosted agent gave it (Tiller's own calls
        /// take theirs from the tool's name).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<CallKind>,
    },
    /// A tool call changed status.
    ToolCallUpdate {
        tool_call_id: String,
        status: ToolStatus,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output: Option<String>,
        /// Why a call failed without running (loop protection).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ToolError>,
    },
    /// A tool call waits for a person's decision.
    PermissionRequested {
        request_id: String,
        tool_call_id: String,
        title: String,
        options: Vec<PermissionOption>,
        /// The call, as its `tool_call` showed it, so a person sees what
        /// they decide on (boxed: every event pays for the largest kind).
        #[serde(flatten)]
        call: Box<AskedCall>,
    },
    /// The decision (an option id, or `cancelled`).
    PermissionResolved {
        request_id: String,
        tool_call_id: String,
        outcome: String,
    },
    /// A steer joined the running turn.
    SteerAccepted { steer_id: String, text: String },
    /// The engine made the steer part of the conversation.
    SteerConsumed { steer_id: String },
    /// The steer was dropped; clients may resend `text`.
    SteerDropped {
        steer_id: String,
        text: String,
        reason: String,
    },
    /// A background notification was queued for this session.
    NotificationQueued {
        task_id: String,
        text: String,
        /// It replaced a queued notification of the same task.
        deduplicated: bool,
    },
    /// A goal was set: continuation turns run while the session is idle.
    GoalSet { objective: String, max_turns: u32 },
    /// The goal paused (`user` or `loop_detected`): no more turns until resumed.
    GoalPaused { reason: String, turns_done: u32 },
    /// The goal was resumed.
    GoalResumed,
    /// The goal ran all its turns.
    GoalCompleted { turns_done: u32 },
    /// The goal was cleared.
    GoalCleared,
    /// A cron job fired; its turn runs when the session is idle.
    CronFired { job_id: String },
    /// A queued notification was evicted to keep the queue within its cap.
    NotificationEvicted { task_id: String },
    /// A prompt completed.
    TurnComplete { stop_reason: String },
    /// A prompt failed. `loop_type` and `code` come with `loop_detected`.
    TurnError {
        error_kind: String,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        loop_type: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
    },
    /// Loop protection stopped an automatic turn (which ended `end_turn`).
    LoopStopped { loop_type: String, message: String },
    /// The session was closed.
    SessionClosed,
    /// Tokens one model request used, against the model's context window,
    /// and what the session cost so far (when prices are configured).
    Usage {
        input_tokens: u64,
        output_tokens: u64,
        #[serde(default)]
        context_window: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost: Option<Cost>,
    },
    /// The file tools' additional roots changed (ACP `additionalDirectories`).
    Roots { roots: Vec<String> },
    /// `/clear`: the model conversation was forgotten (the log keeps it).
    ConversationCleared,
    /// The engine compacted the conversation: older turns replaced by a
    /// summary (the log keeps them). One id per compaction; `status` is
    /// `in_progress`, then `completed` (with the summary), `failed` (with
    /// why: the window applies instead) or `cancelled`.
    Compaction {
        compaction_id: String,
        status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// The session's title was set (by its first prompt, a person or the
    /// agent) or cleared.
    SessionInfo { title: Option<String> },
    /// The session's options changed (model, permission mode).
    ConfigOptions { options: Vec<ConfigOption> },
    /// A hosted agent's session for a turn: `new`, `loaded` (the agent
    /// or the daemon restarted and the agent reloaded it) or `fresh` (it
    /// could not: the agent starts without the earlier conversation), with
    /// why.
    AgentSession {
        upstream: String,
        start: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A hosted agent's own slash commands.
    AgentCommands { commands: Vec<AgentCommand> },
    /// An MCP server connected (with its tools) or failed to.
    McpServer {
        name: String,
        #[serde(default)]
        tools: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// The call a permission request asks about.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AskedCall {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub input: serde_json::Value,
    /// Absolute paths it works on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locations: Vec<String>,
    /// For edits: the change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<tiller_tools::FileDiff>,
    /// The ACP tool kind a hosted agent gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<CallKind>,
}

/// The kinds of tool call ACP names (a hosted agent's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    Read,
    Edit,
    Delete,
    Move,
    Search,
    Execute,
    Think,
    Fetch,
    SwitchMode,
    #[serde(other)]
    Other,
}

impl CallKind {
    /// Reads an agent's kind; anything unknown is `other`.
    pub fn parse(s: &str) -> CallKind {
        serde_json::from_value(serde_json::Value::String(s.to_owned())).unwrap_or(CallKind::Other)
    }
}

/// An amount of money.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    pub amount: f64,
    /// ISO 4217.
    pub currency: String,
}

/// A session's usage so far, kept with its settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageTotals {
    /// Input tokens of every model request.
    pub input_tokens: u64,
    /// Output tokens of every model request.
    pub output_tokens: u64,
    /// Tokens in context after the last request.
    pub used: u64,
    /// The model's context window then.
    pub context_window: u64,
    /// The cost so far, when prices are known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
}

/// A session option a client may change (`session/set_config_option`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigOption {
    /// `model` or `permission_mode`.
    pub id: String,
    /// A label.
    pub name: String,
    /// ACP's category: `model` or `mode`.
    pub category: String,
    /// The current value.
    pub current: String,
    /// The values it may take (`false`, `true` for a switch).
    pub choices: Vec<String>,
    /// An on/off switch (clients that take boolean options see one).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub boolean: bool,
}

impl EventBody {
    /// The `type` name.
    pub fn kind(&self) -> &'static str {
        match self {
            EventBody::PromptQueued { .. } => "prompt_queued",
            EventBody::PromptStarted { .. } => "prompt_started",
            EventBody::UserMessage { .. } => "user_message",
            EventBody::AgentMessageChunk { .. } => "agent_message_chunk",
            EventBody::AgentThoughtChunk { .. } => "agent_thought_chunk",
            EventBody::Plan { .. } => "plan",
            EventBody::ToolCall { .. } => "tool_call",
            EventBody::ToolCallUpdate { .. } => "tool_call_update",
            EventBody::PermissionRequested { .. } => "permission_requested",
            EventBody::PermissionResolved { .. } => "permission_resolved",
            EventBody::SteerAccepted { .. } => "steer_accepted",
            EventBody::SteerConsumed { .. } => "steer_consumed",
            EventBody::SteerDropped { .. } => "steer_dropped",
            EventBody::NotificationQueued { .. } => "notification_queued",
            EventBody::NotificationEvicted { .. } => "notification_evicted",
            EventBody::CronFired { .. } => "cron_fired",
            EventBody::GoalSet { .. } => "goal_set",
            EventBody::GoalPaused { .. } => "goal_paused",
            EventBody::GoalResumed => "goal_resumed",
            EventBody::GoalCompleted { .. } => "goal_completed",
            EventBody::GoalCleared => "goal_cleared",
            EventBody::TurnComplete { .. } => "turn_complete",
            EventBody::TurnError { .. } => "turn_error",
            EventBody::LoopStopped { .. } => "loop_stopped",
            EventBody::SessionClosed => "session_closed",
            EventBody::Usage { .. } => "usage",
            EventBody::SessionInfo { .. } => "session_info",
            EventBody::ConversationCleared => "conversation_cleared",
            EventBody::Compaction { .. } => "compaction",
            EventBody::Roots { .. } => "roots",
            EventBody::ConfigOptions { .. } => "config_options",
            EventBody::McpServer { .. } => "mcp_server",
            EventBody::AgentSession { .. } => "agent_session",
            EventBody::AgentCommands { .. } => "agent_commands",
        }
    }
}

/// An event with its place in the log.
#[derive(Clone, Debug, PartialEq)]
pub struct EventRecord {
    /// The session.
    pub session: SessionId,
    /// Sequence number in the session's log, from 1.
    pub seq: u64,
    /// Time, ms since the Unix epoch.
    pub ts_ms: i64,
    /// The prompt it belongs to.
    pub prompt: Option<PromptId>,
    /// The turn it belongs to.
    pub turn: Option<TurnId>,
    /// What happened.
    pub body: EventBody,
}

impl EventRecord {
    /// The store's row for this event.
    pub fn to_stored(&self) -> StoredEvent {
        StoredEvent {
            session: self.session,
            seq: self.seq,
            ts_ms: self.ts_ms,
            kind: self.body.kind().to_owned(),
            prompt: self.prompt,
            turn: self.turn,
            // Nearly every event (the chunks, and the three of every
            // prompt) has one string member: written straight, the same
            // bytes as serde's (property-tested).
            data: match self.one_string() {
                Some((field, value)) => one_string_json(self.body.kind(), field, value),
                None => serde_json::to_string(&self.body).expect("events serialize"),
            },
        }
    }

    /// The one member and its value of an event that has only a string
    /// besides its type.
    fn one_string(&self) -> Option<(&'static str, &str)> {
        match &self.body {
            EventBody::AgentMessageChunk { text } | EventBody::AgentThoughtChunk { text } => {
                Some(("text", text))
            }
            EventBody::UserMessage { text, images } if images.is_empty() => Some(("text", text)),
            EventBody::PromptStarted { origin } => Some(("origin", origin)),
            EventBody::TurnComplete { stop_reason } => Some(("stopReason", stop_reason)),
            _ => None,
        }
    }

    /// The prompt-ledger change this event carries: admission events admit
    /// their prompt, terminals settle it.
    pub fn ledger_op(&self) -> Option<LedgerOp> {
        let prompt = self.prompt?;
        match &self.body {
            EventBody::PromptStarted { origin } | EventBody::PromptQueued { origin, .. } => {
                Some(LedgerOp::Admit {
                    prompt,
                    origin: origin.clone(),
                    consumes: None,
                })
            }
            EventBody::TurnComplete { .. } | EventBody::TurnError { .. } => {
                Some(LedgerOp::Settle {
                    prompt,
                    delivery: None,
                })
            }
            _ => None,
        }
    }

    /// Reads a stored row back. Rows this version does not know are skipped
    /// (`None`), so an older binary can read a newer log.
    pub fn from_stored(e: &StoredEvent) -> Option<Self> {
        let body = serde_json::from_str(&e.data).ok()?;
        Some(EventRecord {
            session: e.session,
            seq: e.seq,
            ts_ms: e.ts_ms,
            prompt: e.prompt,
            turn: e.turn,
            body,
        })
    }
}

/// The stored payload of an event of `kind` with one string member
/// `field` (neither needs escaping): `{"type":kind,field:value}`.
fn one_string_json(kind: &str, field: &str, value: &str) -> String {
    debug_assert!(
        [kind, field]
            .iter()
            .all(|s| s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\')),
        "{kind:?} and {field:?} are written unescaped"
    );
    let mut out = Vec::with_capacity(value.len() + kind.len() + field.len() + 20);
    out.extend_from_slice(br#"{"type":""#);
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(br#"",""#);
    out.extend_from_slice(field.as_bytes());
    out.extend_from_slice(br#"":"#);
    serde_json::to_writer(&mut out, value).expect("writing to memory does not fail");
    out.push(b'}');
    String::from_utf8(out).expect("JSON is UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A payload written straight (a text chunk, a prompt's start,
        /// text and end) is serde's, byte for byte, for any text (quotes,
        /// control characters, any Unicode); a prompt's text with images
        /// is serialized.
        #[test]
        fn a_payload_written_straight_is_the_serialized_body(text in proptest::prelude::any::<String>(), kind in 0..6u8) {
            let body = match kind {
                0 => EventBody::AgentThoughtChunk { text: text.clone() },
                1 => EventBody::AgentMessageChunk { text: text.clone() },
                2 => EventBody::PromptStarted { origin: text.clone() },
                3 => EventBody::TurnComplete { stop_reason: text.clone() },
                4 => EventBody::UserMessage { text: text.clone(), images: Vec::new() },
                _ => EventBody::UserMessage {
                    text: text.clone(),
                    images: vec![tiller_engine::Image { mime_type: "image/png".into(), data: text.clone() }],
                },
            };
            let rec = EventRecord {
                session: SessionId::new(),
                seq: 1,
                ts_ms: 0,
                prompt: None,
                turn: None,
                body: body.clone(),
            };
            proptest::prop_assert_eq!(rec.to_stored().data, serde_json::to_string(&body).unwrap());
        }
    }

    #[test]
    fn bodies_round_trip_through_the_store_format() {
        let bodies = vec![
            EventBody::PromptQueued {
                origin: "interactive".into(),
                depth: 1,
                text: "t".into(),
            },
            EventBody::ToolCall {
                tool_call_id: "a".into(),
                name: "n".into(),
                input: serde_json::json!({"x": 1}),
                status: ToolStatus::Pending,
                locations: vec!["/w/a.rs".into()],
                kind: None,
            },
            EventBody::ToolCallUpdate {
                tool_call_id: "a".into(),
                status: ToolStatus::Failed,
                output: Some("no".into()),
                error: Some(ToolError {
                    error_kind: "loop_detected".into(),
                    loop_type: Some("turn_tool_call_cap".into()),
                    code: "LOOP_DETECTED".into(),
                    message: "m".into(),
                }),
            },
            EventBody::TurnError {
                error_kind: "no_result".into(),
                message: "m".into(),
                loop_type: None,
                code: None,
            },
            EventBody::LoopStopped {
                loop_type: "repeated_tool_failure".into(),
                message: "m".into(),
            },
            EventBody::SessionClosed,
        ];
        for (i, body) in bodies.into_iter().enumerate() {
            let rec = EventRecord {
                session: SessionId::from_u128(1),
                seq: i as u64 + 1,
                ts_ms: 5,
                prompt: Some(PromptId::from_u128(2)),
                turn: Some(TurnId(3)),
                body,
            };
            let stored = rec.to_stored();
            assert_eq!(stored.kind, rec.body.kind());
            assert_eq!(EventRecord::from_stored(&stored), Some(rec));
        }
        let json = serde_json::to_value(EventBody::TurnComplete {
            stop_reason: "end_turn".into(),
        })
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": "turn_complete", "stopReason": "end_turn"})
        );
    }
}
