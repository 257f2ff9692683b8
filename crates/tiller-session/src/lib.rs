//! Sessions: the session actor, the registry that supervises them, the tool
//! pipeline and the event fan-out. Knows nothing of ACP or HTTP JSON: edges
//! use the [`Sessions`] and [`SessionHandle`] facades and map
//! [`EventRecord`]s to their own wire shapes.

mod actor;
pub mod clock;
pub mod commands;
mod cron;
pub mod delivery;
pub mod event;
mod facade;
mod goal;
mod handle;
#[cfg(feature = "test-hooks")]
mod hooks;
mod ingress;
mod lease;
mod notify;
pub mod ports;
mod reconcile;
mod registry;
mod subscribers;
pub mod task;
mod tools;
pub mod view;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ractor::{Actor, ActorRef};
use tiller_core::{LoopConfig, Origin, PromptId, SessionId, SteerId, SteerOutcome, TurnConfig};
use tiller_engine::{Engine, ScriptError};
use tiller_store::{Store, StoreError};
use tokio::sync::oneshot;

pub use actor::{SessionMsg, Settlement};
pub use event::{
    ConfigOption, Cost, EventBody, EventRecord, PermissionOption, ToolError, ToolStatus,
    UsageTotals,
};
pub use facade::Sessions;
pub use handle::{Acknowledge, SessionHandle};
pub(crate) use reconcile::reconcile;
use registry::{Registry, RegistryArgs, RegistryMsg};
pub use tiller_engine::Image;
/// Rows edges show (read through the facade; edges never open the store).
pub use tiller_store::{CronJob, Delivery, Enqueued, GoalRow, SessionPage, SessionRecord};
pub use tools::Decision;
pub use tools::PermissionMode;

/// Session-level settings.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Turn timers and the prompt queue bound.
    pub turn: TurnConfig,
    /// Most live sessions in the process.
    pub max_sessions: usize,
    /// Loop protection (a fresh guard per turn).
    pub loops: LoopConfig,
    /// Which tool calls ask a person first.
    pub permission_mode: PermissionMode,
    /// Most background notifications queued per session.
    pub notification_cap: usize,
    /// Where webhook deliveries may go (`[delivery] allowed_hosts`).
    pub delivery: tiller_tools::egress::Policy,
    /// Wakes the delivery worker when a delivery is scheduled.
    pub delivery_wake: Option<Arc<tokio::sync::Notify>>,
    /// The built-in tools' settings.
    pub tools: Arc<tiller_tools::ToolsConfig>,
    /// The daemon-wide bound on streamed work in flight (every session's
    /// engine paces itself within it).
    pub budget: Arc<tiller_engine::Budget>,
    /// This node's place in a cluster (used when the store is shared:
    /// PostgreSQL). `None`: a node called `local`, default timings.
    pub cluster: Option<ClusterConfig>,
    /// How long a session with nothing in flight keeps its actor before
    /// it is parked (`None`: never).
    pub park_after: Option<std::time::Duration>,
}

/// A node's identity and lease timings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// This node's id, unique in the cluster and stable across restarts
    /// (a restarted node settles its own prompts `daemon_restarted`,
    /// another node's `node_lost`).
    pub node: String,
    /// Where other nodes and operators reach this node.
    pub address: String,
    /// How long a lease runs unless renewed: the bound on how long a dead
    /// node's sessions wait for a new owner.
    pub lease_ttl: std::time::Duration,
    /// How often leases are renewed (well under `lease_ttl`).
    pub renew_every: std::time::Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            node: "local".into(),
            address: String::new(),
            lease_ttl: std::time::Duration::from_secs(10),
            renew_every: std::time::Duration::from_secs(3),
        }
    }
}

/// What a new session is.
#[derive(Clone, Debug, Default)]
pub struct NewSession {
    /// Its working directory.
    pub cwd: String,
    pub title: Option<String>,
    /// The engine's name (`None`: the default).
    pub engine: Option<String>,
    /// The channel creating it, if any (it may then prompt the session).
    pub channel: Option<String>,
}

/// Why a session could not be found or created.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("unknown session {0}")]
    Unknown(SessionId),
    #[error("too many live sessions (limit {0}); close some or raise limits.max_sessions")]
    TooManySessions(usize),
    /// A store failure (a session deleted meanwhile is `Unknown`).
    #[error(transparent)]
    Store(StoreError),
    /// The session's actor went away while it handled the request (its
    /// lease moved to another node, or it failed and reloads): the request
    /// may or may not have been carried out.
    #[error(
        "the session stopped while handling the request (it moved to another node, or restarts); \
         it may or may not have been carried out: read the session's events before sending it again"
    )]
    Stopped,
    #[error("internal error: {0}")]
    Internal(String),
    #[error("unknown engine `{0}` (configured: {1})")]
    UnknownEngine(String, String),
    #[error("cwd {0} is not a directory this daemon can use: {1}")]
    BadCwd(String, String),
    /// This node stopped the session because it could not renew its lease
    /// in time (the store out of reach): nothing was done; retry in a
    /// moment (here or on another node).
    #[error(
        "session {0} is being handed over (this node could not renew its lease); nothing was done: retry in a moment"
    )]
    HandingOver(SessionId),
    /// Another live node serves the session.
    #[error("session {id} is served by node {node} ({address}); retry there or in a moment")]
    Elsewhere {
        id: SessionId,
        node: String,
        address: String,
    },
}

/// A session deleted since the caller found it is unknown (no cron job,
/// goal or notification outlives it); any other failure is the store's.
impl From<StoreError> for SessionError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::SessionGone(s) => SessionError::Unknown(s),
            e => SessionError::Store(e),
        }
    }
}

/// The engines this daemon has, by name, and the default one.
#[derive(Clone)]
pub struct Engines {
    default: String,
    by_name: Arc<std::collections::BTreeMap<String, Arc<dyn Engine>>>,
}

impl Engines {
    /// `engines` by their names; `default` must be one of them.
    pub fn new(default: &str, engines: Vec<Arc<dyn Engine>>) -> Engines {
        let by_name: std::collections::BTreeMap<_, _> = engines
            .into_iter()
            .map(|e| (e.name().to_owned(), e))
            .collect();
        assert!(by_name.contains_key(default), "the default engine exists");
        Engines {
            default: default.to_owned(),
            by_name: Arc::new(by_name),
        }
    }

    /// The daemon stops: every engine ends the processes it runs.
    pub fn shutdown(&self) {
        for e in self.by_name.values() {
            e.shutdown();
        }
    }

    /// One engine, the default.
    pub fn single(engine: Arc<dyn Engine>) -> Engines {
        let name = engine.name().to_owned();
        Engines::new(&name, vec![engine])
    }

    /// The engine called `name` (the default for `None`).
    pub fn get(&self, name: Option<&str>) -> Result<Arc<dyn Engine>, SessionError> {
        let name = name.unwrap_or(&self.default);
        self.by_name
            .get(name)
            .cloned()
            .ok_or_else(|| SessionError::UnknownEngine(name.to_owned(), self.names().join(", ")))
    }

    /// The engines' names.
    pub fn names(&self) -> Vec<String> {
        self.by_name.keys().cloned().collect()
    }

    /// The default engine's name.
    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// Each engine's name and the models a session may choose (empty for
    /// an engine without a choice).
    pub fn describe(&self) -> Vec<(String, Vec<String>)> {
        self.by_name
            .iter()
            .map(|(name, e)| (name.clone(), e.models()))
            .collect()
    }
}

/// Why a prompt (or steer) was not admitted.
/// Why a permission answer was not taken.
#[derive(Debug, thiserror::Error)]
pub enum PermissionRefused {
    #[error("no pending permission request {0} (it was answered, or its turn ended)")]
    Unknown(String),
    #[error("unknown option `{0}`; expected allow_once, allow_always or reject_once")]
    BadOption(String),
}

#[derive(Debug, thiserror::Error)]
pub enum PromptRefused {
    #[error(transparent)]
    Invalid(#[from] ScriptError),
    #[error("the prompt queue is full; retry when the running turn ends")]
    Overloaded,
    #[error("the session is closed")]
    SessionClosed,
    #[error("{0}")]
    BadDelivery(String),
    /// Content the session's engine cannot take (an image for an engine
    /// without images).
    #[error("{0}")]
    Unsupported(String),
    /// The admission could not be stored (disk full, database locked):
    /// nothing was acknowledged; retry later.
    #[error("the daemon cannot store the prompt right now (the disk may be full); retry later")]
    StoreUnavailable,
}

/// Why a session actor failed on purpose (the registry reconciles its
/// prompts with the matching error kind).
#[derive(Clone, Copy, Debug, thiserror::Error)]
pub enum SessionFailed {
    #[error("the store could not record the session's events")]
    StoreUnavailable,
    /// The session's log was set aside as damaged (its appends refused
    /// until it is deleted).
    #[error("the session's log is damaged")]
    Damaged,
    /// Another node took the session over: its new owner settles what
    /// was in flight; this node settles nothing.
    #[error("another node took the session over")]
    LeaseLost,
}

impl SessionFailed {
    /// Why a failed write stops the session.
    pub(crate) fn of(e: &StoreError) -> SessionFailed {
        if e.fenced().is_some() {
            SessionFailed::LeaseLost
        } else if e.is_damaged_log() {
            SessionFailed::Damaged
        } else {
            SessionFailed::StoreUnavailable
        }
    }

    /// What the log will say of the prompts it had in flight once they
    /// are reconciled (here, or by the session's new owner), and so what
    /// their owners are told.
    pub(crate) fn kind(self) -> tiller_core::ErrorKind {
        match self {
            SessionFailed::StoreUnavailable | SessionFailed::Damaged => {
                tiller_core::ErrorKind::StoreUnavailable
            }
            SessionFailed::LeaseLost => tiller_core::ErrorKind::NodeLost,
        }
    }

    /// The answer to a request the failure of session `id` cut short
    /// (a damaged log's answer says how to repair it).
    pub(crate) fn error(self, id: SessionId) -> SessionError {
        match self {
            SessionFailed::StoreUnavailable => SessionError::Store(StoreError::LogBroken),
            SessionFailed::Damaged => SessionError::Store(StoreError::Damaged {
                session: id,
                why: "it was set aside".into(),
            }),
            SessionFailed::LeaseLost => SessionError::Stopped,
        }
    }
}

/// The answer to a steer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SteerAnswer {
    pub steer: SteerId,
    pub outcome: SteerOutcome,
}

/// Whether a turn runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnState {
    Idle,
    Running,
    Cancelling,
}

impl TurnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Idle => "idle",
            TurnState::Running => "running",
            TurnState::Cancelling => "cancelling",
        }
    }
}

/// The server-owned state of a session: what every stream starts with, so
/// clients never guess busy/idle.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub state: TurnState,
    /// The prompt whose turn runs.
    pub active_prompt: Option<PromptId>,
    /// Prompts waiting, oldest first.
    pub queued: Vec<PromptId>,
    /// The last turn error, while the session is idle and no newer turn
    /// started.
    pub last_turn_error: Option<Arc<EventRecord>>,
    /// The permission request the running turn waits on.
    pub pending_permission: Option<Arc<EventRecord>>,
    /// The last sequence number published.
    pub last_seq: u64,
    /// Its model usage so far, if any.
    pub usage: Option<UsageTotals>,
}

/// Identifies one attached subscriber.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SubscriberId(pub u64);

/// Receives a session's events as they are published. `deliver` must not
/// block: a subscriber that cannot keep up returns `false` and is detached,
/// so it never slows the session or the other subscribers.
pub trait Subscriber: Send + 'static {
    fn deliver(&self, event: &Arc<EventRecord>) -> bool;

    /// The client's file and terminal methods, when it offers them (an
    /// ACP editor): the session's tools then act through it.
    fn client_tools(&self) -> Option<Arc<dyn tiller_tools::ClientTools>> {
        None
    }
}

/// A session title made from a prompt: its first line that has text,
/// spaces collapsed, at most 60 characters (cut at a word when it can).
pub fn title_of(text: &str) -> Option<String> {
    const MAX: usize = 60;
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let line = words.join(" ");
    if line.chars().count() <= MAX {
        return Some(line);
    }
    let cut: String = line.chars().take(MAX - 1).collect();
    let cut = match cut.rfind(' ') {
        Some(i) if i > MAX / 2 => &cut[..i],
        _ => cut.as_str(),
    };
    Some(format!("{}…", cut.trim_end()))
}

/// Additional roots as the file tools take them: each absolute and an
/// existing directory, canonical, without repeats; the error names the one
/// refused.
pub async fn check_roots(roots: &[String]) -> Result<Vec<std::path::PathBuf>, String> {
    let mut canonical = Vec::new();
    for r in roots {
        let p = std::path::Path::new(r);
        if !p.is_absolute() {
            return Err(format!(
                "additional directory {r}: it must be an absolute path"
            ));
        }
        let c = tokio::fs::canonicalize(p)
            .await
            .map_err(|e| format!("additional directory {r}: {e}"))?;
        if !tokio::fs::metadata(&c).await.is_ok_and(|m| m.is_dir()) {
            return Err(format!("additional directory {r}: not a directory"));
        }
        if !canonical.contains(&c) {
            canonical.push(c);
        }
    }
    Ok(canonical)
}

#[cfg(test)]
mod title_tests {
    use super::title_of;

    #[test]
    fn titles_from_prompts() {
        let long = "word ".repeat(30);
        for (text, want) in [
            ("fix the build", Some("fix the build")),
            ("\n\n   spaced    out  \nsecond line", Some("spaced out")),
            ("", None),
            ("  \n\t\n", None),
        ] {
            assert_eq!(title_of(text).as_deref(), want, "{text:?}");
        }
        let t = title_of(&long).unwrap();
        assert!(
            t.chars().count() <= 60 && t.ends_with('…') && !t.contains("  "),
            "{t}"
        );
        assert!(t.starts_with("word word"));
        let wide = "é".repeat(100);
        let t = title_of(&wide).unwrap();
        assert_eq!(t.chars().count(), 60);
    }
}

#[cfg(test)]
mod size_tests {
    /// Every event is as large as its largest kind, and every message to
    /// a session as its largest: big, rare fields are boxed
    /// (`PermissionRequested::call`) so common events stay small.
    #[test]
    fn events_and_messages_stay_small() {
        let body = size_of::<crate::EventBody>();
        let msg = size_of::<crate::actor::SessionMsg>();
        assert!(body <= 152, "EventBody is {body} bytes");
        assert!(msg <= 176, "SessionMsg is {msg} bytes");
    }
}
