//! Sessions: the session actor, the registry that supervises them, the tool
//! pipeline and the event fan-out. Knows nothing of ACP or HTTP JSON: edges
//! use the [`Sessions`] and [`SessionHandle`] facades and map
//! [`EventRecord`]s to their own wire shapes.

mod actor;
mod cron;
pub mod delivery;
pub mod event;
mod goal;
mod notify;
mod registry;
mod tools;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ractor::{Actor, ActorRef};
use tiller_core::{LoopConfig, Origin, PromptId, SessionId, SteerId, SteerOutcome, TurnConfig};
use tiller_engine::{Engine, ScriptError};
use tiller_store::{SessionPage, Store, StoreError};
use tokio::sync::oneshot;

pub use actor::{SessionMsg, Settlement};
pub use event::{ConfigOption, EventBody, EventRecord, PermissionOption, ToolError, ToolStatus};
use registry::{Registry, RegistryArgs, RegistryMsg};
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
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the session stopped; open it again")]
    Stopped,
    #[error("internal error: {0}")]
    Internal(String),
    #[error("unknown engine `{0}` (configured: {1})")]
    UnknownEngine(String, String),
    #[error("cwd {0} is not a directory this daemon can use: {1}")]
    BadCwd(String, String),
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
    /// The admission could not be stored (disk full, database locked):
    /// nothing was acknowledged; retry later.
    #[error("the daemon cannot store the prompt right now (the disk may be full); retry later")]
    StoreUnavailable,
}

/// Why a session actor failed on purpose (the registry reconciles its
/// prompts with the matching error kind).
#[derive(Debug, thiserror::Error)]
pub enum SessionFailed {
    #[error("the store could not record the session's events")]
    StoreUnavailable,
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

/// Entry point for edges: create, open, list sessions.
#[derive(Clone)]
pub struct Sessions {
    registry: ActorRef<RegistryMsg>,
    notify: ActorRef<notify::NotifyMsg>,
    cron: ActorRef<cron::CronMsg>,
    goal: ActorRef<goal::GoalMsg>,
    store: Store,
    engines: Engines,
    next_subscriber: Arc<AtomicU64>,
    /// The tools' settings (MCP servers are connected under its policy).
    tools: Arc<tiller_tools::ToolsConfig>,
}

impl Sessions {
    /// Starts the registry.
    pub async fn start(
        store: Store,
        engines: Engines,
        config: SessionConfig,
    ) -> Result<Sessions, SessionError> {
        let reconciled = reconcile(&store, None, tiller_core::ErrorKind::DaemonRestarted).await?;
        if reconciled > 0 {
            tracing::warn!(
                prompts = reconciled,
                "prompts in flight when the daemon stopped got a daemon_restarted error"
            );
        }
        let cap = config.notification_cap;
        let (notify, _) = Actor::spawn(None, notify::NotifyActor, (store.clone(), cap))
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        let (cron, _) = Actor::spawn(None, cron::CronActor, store.clone())
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        let (goal, _) = Actor::spawn(None, goal::GoalActor, store.clone())
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        let tools = config.tools.clone();
        let args = RegistryArgs {
            store: store.clone(),
            automation: actor::Automation {
                notify: Some(notify.clone()),
                cron: Some(cron.clone()),
                goal: Some(goal.clone()),
            },
            engines: engines.clone(),
            config: Arc::new(config),
        };
        let (registry, _) = Actor::spawn(None, Registry, args)
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        let sessions = Sessions {
            registry,
            notify,
            cron,
            goal,
            store,
            engines,
            next_subscriber: Arc::new(AtomicU64::new(1)),
            tools,
        };
        // Work queued before a restart runs: wake the sessions it is for.
        let (mut waiting, _) = sessions.store.notification_backlog().await?;
        waiting.extend(sessions.store.cron_backlog().await?);
        waiting.extend(sessions.store.goals_active().await?);
        for id in waiting {
            if let Ok(h) = sessions.open(id).await {
                let _ = h.send(SessionMsg::Kick);
            }
        }
        // The cron actor starts its timer (and catches up) once it can wake
        // sessions.
        let _ = sessions
            .cron
            .send_message(cron::CronMsg::Attach(sessions.clone()));
        Ok(sessions)
    }

    /// Adds a cron job for a session. `Ok(Err(message))` for a bad schedule.
    pub async fn cron_add(
        &self,
        session: SessionId,
        schedule: String,
        tz: String,
        prompt: String,
    ) -> Result<Result<tiller_store::CronJob, String>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.cron
            .send_message(cron::CronMsg::Add {
                session,
                schedule,
                tz,
                prompt,
                reply: tx,
            })
            .map_err(|_| SessionError::Stopped)?;
        match rx.await.map_err(|_| SessionError::Stopped)? {
            Ok(job) => Ok(Ok(job)),
            Err(cron::CronError::Schedule(m)) => Ok(Err(m)),
            Err(cron::CronError::Session(e)) => Err(e),
        }
    }

    async fn goal_call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> goal::GoalMsg,
    ) -> Result<T, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.goal
            .send_message(make(tx))
            .map_err(|_| SessionError::Stopped)?;
        Ok(rx.await.map_err(|_| SessionError::Stopped)??)
    }

    /// Sets (replaces) a session's goal; its turns start when the session
    /// is idle.
    pub async fn goal_set(
        &self,
        id: SessionId,
        objective: String,
        max_turns: u32,
    ) -> Result<tiller_store::GoalRow, SessionError> {
        let handle = self.open(id).await?;
        let row = self
            .goal_call(|reply| goal::GoalMsg::Set {
                session: id,
                objective: objective.clone(),
                max_turns,
                reply,
            })
            .await?;
        handle.send(SessionMsg::Automation {
            body: EventBody::GoalSet {
                objective,
                max_turns,
            },
            kick: true,
        })?;
        Ok(row)
    }

    /// A session's goal.
    pub async fn goal_get(
        &self,
        id: SessionId,
    ) -> Result<Option<tiller_store::GoalRow>, SessionError> {
        self.record(id).await?;
        self.goal_call(|reply| goal::GoalMsg::Get { session: id, reply })
            .await
    }

    /// Pauses (`resume = false`) or resumes a goal. `None` when there is none.
    pub async fn goal_pause_resume(
        &self,
        id: SessionId,
        resume: bool,
    ) -> Result<Option<tiller_store::GoalRow>, SessionError> {
        let handle = self.open(id).await?;
        let before = self
            .goal_call(|reply| goal::GoalMsg::Get { session: id, reply })
            .await?;
        let after = self
            .goal_call(|reply| {
                if resume {
                    goal::GoalMsg::Resume { session: id, reply }
                } else {
                    goal::GoalMsg::Pause { session: id, reply }
                }
            })
            .await?;
        if let (Some(b), Some(a)) = (&before, &after)
            && b.status != a.status
        {
            let body = if resume {
                EventBody::GoalResumed
            } else {
                EventBody::GoalPaused {
                    reason: "user".into(),
                    turns_done: a.turns_done,
                }
            };
            handle.send(SessionMsg::Automation { body, kick: resume })?;
        }
        Ok(after)
    }

    /// Clears a session's goal; false when it had none.
    pub async fn goal_clear(&self, id: SessionId) -> Result<bool, SessionError> {
        let handle = self.open(id).await?;
        let cleared = self
            .goal_call(|reply| goal::GoalMsg::Clear { session: id, reply })
            .await?;
        if cleared {
            handle.send(SessionMsg::Automation {
                body: EventBody::GoalCleared,
                kick: false,
            })?;
        }
        Ok(cleared)
    }

    /// Every cron job.
    pub async fn cron_list(&self) -> Result<Vec<tiller_store::CronJob>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.cron
            .send_message(cron::CronMsg::List(tx))
            .map_err(|_| SessionError::Stopped)?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Removes a cron job; false when there was none.
    pub async fn cron_remove(&self, id: String) -> Result<bool, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.cron
            .send_message(cron::CronMsg::Remove { id, reply: tx })
            .map_err(|_| SessionError::Stopped)?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Queues a background notification for a session (durable when this
    /// returns). It runs as its own turn once the session is idle.
    pub async fn notify(
        &self,
        id: SessionId,
        task_id: String,
        text: String,
    ) -> Result<tiller_store::Enqueued, SessionError> {
        let handle = self.open(id).await?;
        let (tx, rx) = oneshot::channel();
        self.notify
            .send_message(notify::NotifyMsg::Enqueue {
                session: id,
                task_id: task_id.clone(),
                text: text.clone(),
                reply: tx,
            })
            .map_err(|_| SessionError::Stopped)?;
        let enqueued = rx.await.map_err(|_| SessionError::Stopped)??;
        handle.send(SessionMsg::NotificationQueued {
            task_id,
            text,
            deduplicated: enqueued.deduplicated,
            evicted: enqueued.evicted.clone(),
        })?;
        Ok(enqueued)
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> RegistryMsg,
    ) -> Result<T, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.registry
            .send_message(make(tx))
            .map_err(|_| SessionError::Stopped)?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Creates a session with the default engine.
    pub async fn create(
        &self,
        cwd: String,
        title: Option<String>,
    ) -> Result<SessionHandle, SessionError> {
        self.create_with(cwd, title, None).await
    }

    /// Creates a session with the engine called `engine`.
    pub async fn create_with(
        &self,
        cwd: String,
        title: Option<String>,
        engine: Option<String>,
    ) -> Result<SessionHandle, SessionError> {
        self.create_session(NewSession {
            cwd,
            title,
            engine,
            channel: None,
        })
        .await
    }

    /// Creates a session.
    pub async fn create_session(&self, new: NewSession) -> Result<SessionHandle, SessionError> {
        let (id, actor) = self
            .ask(|reply| RegistryMsg::Create { new, reply })
            .await??;
        Ok(self.handle(id, actor))
    }

    fn handle(&self, id: SessionId, actor: ActorRef<SessionMsg>) -> SessionHandle {
        SessionHandle {
            id,
            actor,
            tools: self.tools.clone(),
            store: self.store.clone(),
        }
    }

    /// The engines sessions may use.
    pub fn engines(&self) -> &Engines {
        &self.engines
    }

    /// Finds a live session or loads it from the store.
    pub async fn open(&self, id: SessionId) -> Result<SessionHandle, SessionError> {
        let actor = self.ask(|reply| RegistryMsg::Open { id, reply }).await??;
        Ok(self.handle(id, actor))
    }

    /// Open sessions, newest first.
    pub async fn list(
        &self,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<SessionPage, SessionError> {
        Ok(self.store.list_sessions(cursor, limit).await?)
    }

    /// Open sessions in `cwd`, newest first.
    pub async fn list_in(
        &self,
        cursor: Option<&str>,
        limit: usize,
        cwd: Option<String>,
    ) -> Result<SessionPage, SessionError> {
        Ok(self.store.list_sessions_in(cursor, limit, cwd).await?)
    }

    /// The durable replay guard of channel ingress: true when `key` was not
    /// seen within the last `window_s` seconds.
    pub async fn channel_seen(
        &self,
        key: String,
        now_s: i64,
        window_s: i64,
    ) -> Result<bool, SessionError> {
        Ok(self.store.channel_seen(key, now_s, window_s).await?)
    }

    /// The stored record of a session.
    pub async fn record(&self, id: SessionId) -> Result<tiller_store::SessionRecord, SessionError> {
        match self.store.get_session(id).await? {
            Some((rec, _)) => Ok(rec),
            None => Err(SessionError::Unknown(id)),
        }
    }

    /// A page of history: up to `limit` events before `before`, oldest
    /// first, and whether older ones exist.
    pub async fn history(
        &self,
        id: SessionId,
        before: Option<u64>,
        limit: usize,
    ) -> Result<(Vec<EventRecord>, bool), SessionError> {
        let page = self.store.history(id, before, limit).await?;
        Ok((
            page.events
                .iter()
                .filter_map(EventRecord::from_stored)
                .collect(),
            page.has_more,
        ))
    }

    /// Events with `seq > after`, oldest first.
    pub async fn events_after(
        &self,
        id: SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<EventRecord>, SessionError> {
        let rows = self.store.events_after(id, after, limit).await?;
        Ok(rows.iter().filter_map(EventRecord::from_stored).collect())
    }

    /// A fresh subscriber id.
    pub fn subscriber_id(&self) -> SubscriberId {
        SubscriberId(self.next_subscriber.fetch_add(1, Ordering::Relaxed))
    }

    /// Live sessions.
    pub async fn live(&self) -> usize {
        self.ask(RegistryMsg::Live).await.unwrap_or(0)
    }

    /// Tests only: stops every actor where it stands, as a killed process
    /// would (nothing settles), and waits until what the store was given is
    /// on disk.
    #[cfg(feature = "test-hooks")]
    pub async fn crash(&self) {
        self.registry.stop_children(None);
        self.registry.stop(None);
        self.notify.stop(None);
        self.cron.stop(None);
        self.goal.stop(None);
        // Let the stop signals land before the last flush.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let _ = self.store.flush().await;
    }

    /// Graceful shutdown: cancel running turns, wait (bounded) for them to
    /// settle, stop every actor, flush the store.
    pub async fn shutdown(&self) {
        let _ = self.ask(RegistryMsg::Shutdown).await;
        self.registry.stop_children(None);
        self.registry.stop(None);
        self.notify.stop(None);
        self.cron.stop(None);
        self.goal.stop(None);
        if let Err(e) = self.store.flush().await {
            tracing::error!(error = %e, "store flush at shutdown failed");
        }
    }
}

/// A live session.
#[derive(Clone)]
pub struct SessionHandle {
    id: SessionId,
    actor: ActorRef<SessionMsg>,
    /// The policy its MCP servers are connected under.
    tools: Arc<tiller_tools::ToolsConfig>,
    /// To tell a closed session from a stopped one.
    store: Store,
}

impl SessionHandle {
    /// The session's id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    fn send(&self, msg: SessionMsg) -> Result<(), SessionError> {
        self.actor
            .send_message(msg)
            .map_err(|_| SessionError::Stopped)
    }

    /// Submits a prompt. Returns once it is stored (or refused), with a
    /// receiver for its terminal.
    pub async fn prompt(
        &self,
        text: String,
        origin: Origin,
    ) -> Result<Result<(PromptId, oneshot::Receiver<Settlement>), PromptRefused>, SessionError>
    {
        self.prompt_with(text, origin, None).await
    }

    /// Like [`SessionHandle::prompt`], with a webhook that receives the
    /// final text on `end_turn`.
    pub async fn prompt_with(
        &self,
        text: String,
        origin: Origin,
        delivery: Option<String>,
    ) -> Result<Result<(PromptId, oneshot::Receiver<Settlement>), PromptRefused>, SessionError>
    {
        let (atx, arx) = oneshot::channel();
        let (stx, srx) = oneshot::channel();
        let sent = self.send(SessionMsg::Prompt {
            text,
            origin,
            delivery,
            admitted: Some(atx),
            settled: Some(stx),
        });
        let admitted = match sent {
            Ok(()) => arx.await.map_err(|_| SessionError::Stopped),
            Err(e) => Err(e),
        };
        match admitted {
            Ok(a) => Ok(a.map(|p| (p, srx))),
            // The actor is gone: a prompt racing a close gets the close's
            // answer, not "open it again".
            Err(e) => match self.store.get_session(self.id).await {
                Ok(Some((rec, _))) if rec.closed => Ok(Err(PromptRefused::SessionClosed)),
                _ => Err(e),
            },
        }
    }

    /// Steers the running turn.
    pub async fn steer(
        &self,
        text: String,
        prompt_required: bool,
    ) -> Result<Result<SteerAnswer, PromptRefused>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Steer {
            text,
            prompt_required,
            reply: tx,
        })?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Cancels the running turn and the queued interactive prompts.
    pub fn cancel(&self) -> Result<(), SessionError> {
        self.send(SessionMsg::Cancel)
    }

    /// Attaches a subscriber; returns the state at that instant. Events up
    /// to `last_seq` are replayed from the store; later ones arrive live.
    pub async fn subscribe(
        &self,
        id: SubscriberId,
        subscriber: Box<dyn Subscriber>,
    ) -> Result<Snapshot, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Subscribe {
            id,
            subscriber,
            reply: tx,
        })?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// The session's state.
    pub async fn snapshot(&self) -> Result<Snapshot, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Snapshot(tx))?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Answers a pending permission request with one of its option ids.
    pub async fn permission(
        &self,
        request_id: String,
        option_id: String,
    ) -> Result<Result<(), PermissionRefused>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Permission {
            request_id,
            option_id,
            reply: tx,
        })?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Connects the MCP servers a client passed, under `[tools.mcp]` (a
    /// command not allowed there is never started, an HTTP server must be
    /// at an allowed address; each within the connect timeout), and gives
    /// their tools to the session. A server refused or failing is reported
    /// in the log (`mcp_server` with `error`) and skipped. Returns the
    /// failures.
    pub async fn set_mcp(
        &self,
        configs: Vec<tiller_tools::McpServerConfig>,
    ) -> Result<Vec<String>, SessionError> {
        let results = futures::future::join_all(
            configs
                .iter()
                .map(|c| tiller_tools::McpServer::connect(c, &self.tools)),
        )
        .await;
        let mut servers = Vec::new();
        let mut events = Vec::new();
        let mut failures = Vec::new();
        for (cfg, r) in configs.iter().zip(results) {
            match r {
                Ok(server) => {
                    events.push(EventBody::McpServer {
                        name: cfg.name().to_owned(),
                        tools: server.specs().into_iter().map(|t| t.name).collect(),
                        error: None,
                    });
                    servers.push(Arc::new(server));
                }
                Err(e) => {
                    tracing::warn!(session = %self.id, server = cfg.name(), error = %e, "MCP server unavailable");
                    events.push(EventBody::McpServer {
                        name: cfg.name().to_owned(),
                        tools: Vec::new(),
                        error: Some(e.clone()),
                    });
                    failures.push(e);
                }
            }
        }
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::SetMcp {
            servers,
            events,
            done: tx,
        })?;
        rx.await.map_err(|_| SessionError::Stopped)?;
        Ok(failures)
    }

    /// The options a client may change.
    pub async fn options(&self) -> Result<Vec<ConfigOption>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Options(tx))?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Changes an option; `Ok(Err(message))` for an unknown option or value.
    pub async fn set_option(
        &self,
        id: String,
        value: String,
    ) -> Result<Result<Vec<ConfigOption>, String>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::SetOption {
            id,
            value,
            reply: tx,
        })?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Tests only: makes the session actor fail.
    #[cfg(feature = "test-hooks")]
    pub fn crash(&self) {
        let _ = self.send(SessionMsg::Crash);
    }

    /// Detaches a subscriber.
    pub fn unsubscribe(&self, id: SubscriberId) {
        let _ = self.send(SessionMsg::Unsubscribe(id));
    }

    /// Closes the session.
    pub async fn close(&self) -> Result<(), SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::Close(tx))?;
        rx.await.map_err(|_| SessionError::Stopped)?
    }
}

/// Reconciliation: every prompt admitted and never settled gets exactly one
/// `turn_error` of `kind`: at start-up for all sessions (`daemon_restarted`),
/// and for one session whose actor failed (`session_restarted`).
pub(crate) async fn reconcile(
    store: &Store,
    only: Option<SessionId>,
    kind: tiller_core::ErrorKind,
) -> Result<usize, SessionError> {
    let open: Vec<_> = store
        .unsettled()
        .await?
        .into_iter()
        .filter(|u| only.is_none_or(|s| s == u.session))
        .collect();
    let mut heads: std::collections::HashMap<SessionId, u64> = std::collections::HashMap::new();
    for u in &open {
        let seq = match heads.get(&u.session) {
            Some(s) => *s,
            // Reopened: a failed actor may have left the log refusing appends.
            None => store.reopen_log(u.session).await?.last_seq,
        } + 1;
        heads.insert(u.session, seq);
        let rec = EventRecord {
            session: u.session,
            seq,
            ts_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
            prompt: Some(u.prompt),
            turn: None,
            body: EventBody::TurnError {
                error_kind: kind.as_str().into(),
                message: kind.default_message(),
                loop_type: None,
                code: None,
            },
        };
        store
            .append_durable(rec.to_stored(), rec.ledger_op())
            .await?;
    }
    Ok(open.len())
}
