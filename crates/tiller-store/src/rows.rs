//! The rows the store reads and writes, typed.

use tiller_core::{PromptId, SessionId, TurnId};

/// Which piece of a session's state to save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateColumn {
    /// The engine's name.
    Engine,
    /// Session settings (JSON).
    Settings,
}

impl StateColumn {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StateColumn::Engine => "engine",
            StateColumn::Settings => "settings",
        }
    }
}

/// A session's stored state beyond its record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionExtras {
    /// The engine's name.
    pub engine: Option<String>,
    /// Session settings, JSON.
    pub settings: Option<String>,
    /// The model conversation.
    pub conversation: StoredConversation,
}

/// A session's model conversation as stored: one row per message (JSON,
/// opaque to the store), by position. Appending a turn writes only its
/// messages; the whole conversation is never rewritten.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredConversation {
    /// The position of `messages[0]` (older ones were trimmed).
    pub base: u64,
    /// The messages, oldest first.
    pub messages: Vec<String>,
}

/// A change to a stored conversation: rows before `keep_from` are
/// dropped, rows from `replace_from` on are replaced by `messages`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConversationWrite {
    /// The position of the oldest message kept.
    pub keep_from: u64,
    /// The position of `messages[0]`.
    pub replace_from: u64,
    /// The messages (JSON) from `replace_from` on.
    pub messages: Vec<String>,
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
        /// The prompt.
        prompt: PromptId,
        /// Where it came from (`interactive`, `channel`, `notification`...).
        origin: String,
        /// The queued automatic work it takes off its queue.
        consumes: Option<Claim>,
    },
    /// The prompt got its terminal.
    Settle {
        /// The prompt.
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
    /// Its session.
    pub session: SessionId,
    /// The prompt.
    pub prompt: PromptId,
    /// Where it came from.
    pub origin: String,
}

/// One page of a session's history, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryPage {
    /// The events, oldest first.
    pub events: Vec<StoredEvent>,
    /// Whether older events exist.
    pub has_more: bool,
}

/// A queued background notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    /// The session it is for.
    pub session: SessionId,
    /// The task it reports on (the dedup key within the session).
    pub task_id: String,
    /// What the session is told.
    pub text: String,
    /// When it was first queued, ms since the epoch.
    pub created_ms: i64,
}

/// A cron job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronJob {
    /// Its id (`cron-<uuid>`).
    pub id: String,
    /// The session it prompts.
    pub session: SessionId,
    /// The cron expression.
    pub schedule: String,
    /// The time zone it is read in (IANA name).
    pub tz: String,
    /// The prompt text each fire runs.
    pub prompt: String,
    /// The next scheduled fire, ms since the epoch.
    pub next_fire_ms: i64,
    /// When it was added, ms since the epoch.
    pub created_ms: i64,
}

/// A cron fire waiting for its session to be idle (one per job at most).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronFire {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    /// The job that fired.
    pub job_id: String,
    /// The session it prompts.
    pub session: SessionId,
    /// The prompt text it runs.
    pub prompt: String,
    /// When it (last) fired, ms since the epoch.
    pub fired_ms: i64,
}

/// A session's goal, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoalRow {
    /// The session.
    pub session: SessionId,
    /// What the goal turns work towards.
    pub objective: String,
    /// Most goal turns.
    pub max_turns: u32,
    /// Goal turns run so far.
    pub turns_done: u32,
    /// `active`, `paused`, `completed`.
    pub status: String,
    /// Why it paused (`user`, `loop_detected`).
    pub pause_reason: Option<String>,
    /// Consecutive goal turns loop protection stopped.
    pub loop_stops: u32,
}

/// A webhook delivery of a turn's final text, waiting to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// Its row id.
    pub id: i64,
    /// Where the text is posted.
    pub url: String,
    /// The session of the turn.
    pub session: SessionId,
    /// The prompt whose final text it is.
    pub prompt: PromptId,
    /// The final agent text.
    pub text: String,
    /// The turn's stop reason.
    pub stop_reason: String,
    /// Attempts made so far.
    pub attempts: u32,
    /// When the next attempt is due, ms since the epoch.
    pub next_at_ms: i64,
}

impl Delivery {
    /// How a terminal is stored in `stop_reason`: the stop reason of a
    /// completed turn (`end_turn`, `cancelled`...), `error:KIND` of a
    /// failed one.
    pub fn stop_reason_of(terminal: &tiller_core::Terminal) -> String {
        match terminal {
            tiller_core::Terminal::Completed(r) => r.as_str().to_owned(),
            tiller_core::Terminal::Failed { kind, .. } => format!("error:{}", kind.as_str()),
        }
    }

    /// The stop reason a webhook is told (`error` for a failure) and the
    /// failure's kind.
    pub fn told(&self) -> (&str, Option<&str>) {
        match self.stop_reason.strip_prefix("error:") {
            Some(kind) => ("error", Some(kind)),
            None => (&self.stop_reason, None),
        }
    }
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
    /// The sessions, newest first.
    pub sessions: Vec<SessionRecord>,
    /// Pass back to get the next page; `None` at the end.
    pub next_cursor: Option<String>,
}

/// A queue whose rows are numbered (see [`crate::Store::fresh_id`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdQueue {
    /// Background notifications.
    Notifications,
    /// Waiting cron fires.
    CronFires,
}

/// A node of a cluster sharing one PostgreSQL schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its id, unique in the cluster (stable across restarts).
    pub id: String,
    /// Where other nodes and operators reach it (`http://host:port`).
    pub address: String,
}

/// The answer to a lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lease {
    /// This node owns the session now; every write for it carries `fence`.
    Acquired {
        /// The fencing counter: higher than any earlier owner's.
        fence: i64,
        /// The node that held the lease before, if any (this node itself
        /// after a restart).
        previous: Option<String>,
    },
    /// Another node's lease is live.
    Held {
        /// Its holder.
        node: String,
        /// The holder's advertised address (empty if it never joined).
        address: String,
        /// How long the lease still runs unless renewed.
        expires_in_ms: i64,
    },
}

/// A node as `tiller cluster status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    /// Its id.
    pub id: String,
    /// Its advertised address.
    pub address: String,
    /// When it joined (its clock, ms since the epoch).
    pub started_ms: i64,
    /// How long ago it last renewed its leases (the store's clock).
    pub heartbeat_age_ms: i64,
    /// How many leases it holds that have not expired.
    pub leases: i64,
}
