//! The rows the store reads and writes, typed.

use tiller_core::{PromptId, SessionId, TurnId};

/// Which piece of a session's state to save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateColumn {
    /// The engine's name.
    Engine,
    /// Session settings (JSON).
    Settings,
    /// The model conversation (JSON).
    Conversation,
}

impl StateColumn {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StateColumn::Engine => "engine",
            StateColumn::Settings => "settings",
            StateColumn::Conversation => "conversation",
        }
    }
}

/// A session's stored state beyond its record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionExtras {
    pub engine: Option<String>,
    pub settings: Option<String>,
    pub conversation: Option<String>,
}

/// A session row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRecord {
    /// The session.
    pub id: SessionId,
    /// Its working directory.
    pub cwd: String,
    /// A title, if any.
    pub title: Option<String>,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: i64,
    /// Last append, ms since the Unix epoch.
    pub updated_ms: i64,
    /// Closed sessions are kept (their log stays readable) but not listed.
    pub closed: bool,
    /// The channel that created it, if one did: a channel may prompt only
    /// its own sessions (and ones its config lists).
    pub channel: Option<String>,
}

/// One stored event. The payload is opaque JSON to the store.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    /// The session whose log holds it.
    pub session: SessionId,
    /// Position in that log, from 1, without gaps.
    pub seq: u64,
    /// Time of the event, ms since the Unix epoch.
    pub ts_ms: i64,
    /// Its type (`agent_message_chunk`, `turn_complete`, ...).
    pub kind: String,
    /// The prompt it belongs to, if any.
    pub prompt: Option<PromptId>,
    /// The turn it belongs to, if any.
    pub turn: Option<TurnId>,
    /// The payload, as JSON text.
    pub data: String,
}

/// A change to the prompt ledger, committed in the same transaction as
/// the event it rides on: what an event implies is stored with it or not
/// at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerOp {
    /// The prompt was admitted (queued or started).
    Admit {
        prompt: PromptId,
        origin: String,
        /// The queued automatic work it takes off its queue.
        consumes: Option<Claim>,
    },
    /// The prompt got its terminal.
    Settle {
        prompt: PromptId,
        /// The webhook delivery of its final text, if it has one.
        delivery: Option<Delivery>,
    },
}

/// Queued automatic work a started prompt consumes: its row is deleted
/// when (and only when) the prompt's start is committed, so a crash in
/// between leaves it queued, never lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// A background notification, by queue position.
    Notification(i64),
    /// A waiting cron fire, by queue position.
    CronFire(i64),
}

/// A prompt admitted but never settled (found at start-up after a crash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsettled {
    pub session: SessionId,
    pub prompt: PromptId,
    pub origin: String,
}

/// One page of a session's history, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryPage {
    pub events: Vec<StoredEvent>,
    /// Whether older events exist.
    pub has_more: bool,
}

/// A queued background notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    pub session: SessionId,
    pub task_id: String,
    pub text: String,
    pub created_ms: i64,
}

/// A cron job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronJob {
    pub id: String,
    pub session: SessionId,
    pub schedule: String,
    pub tz: String,
    pub prompt: String,
    /// The next scheduled fire, ms since the epoch.
    pub next_fire_ms: i64,
    pub created_ms: i64,
}

/// A cron fire waiting for its session to be idle (one per job at most).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronFire {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    pub job_id: String,
    pub session: SessionId,
    pub prompt: String,
    pub fired_ms: i64,
}

/// A session's goal, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoalRow {
    pub session: SessionId,
    pub objective: String,
    pub max_turns: u32,
    pub turns_done: u32,
    /// `active`, `paused`, `completed`.
    pub status: String,
    /// Why it paused (`user`, `loop_detected`).
    pub pause_reason: Option<String>,
    pub loop_stops: u32,
}

/// A webhook delivery of a turn's final text, waiting to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub id: i64,
    pub url: String,
    pub session: SessionId,
    pub prompt: PromptId,
    pub text: String,
    pub stop_reason: String,
    pub attempts: u32,
    pub next_at_ms: i64,
}

/// What enqueueing did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The notification replaced a queued one with the same task id.
    pub deduplicated: bool,
    /// Task ids evicted (oldest first) to keep the queue within its cap.
    pub evicted: Vec<String>,
}

/// What a session's log looks like at load time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogHead {
    /// The last sequence number (0 when empty).
    pub last_seq: u64,
    /// The highest turn id used (0 when none).
    pub last_turn: u64,
}

/// One page of sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionPage {
    pub sessions: Vec<SessionRecord>,
    /// Pass back to get the next page; `None` at the end.
    pub next_cursor: Option<String>,
}
