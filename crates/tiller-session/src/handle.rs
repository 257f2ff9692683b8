//! [`SessionHandle`]: one live session, as edges see it.

use super::*;

/// Where a session's messages go. The registry changes it; every handle
/// to the session shares it, so a session may be parked (its actor stopped
/// while idle, its state in the store) and started again under the handles
/// edges hold, unseen by them.
pub(crate) struct Slot {
    pub(crate) id: SessionId,
    pub(crate) state: std::sync::Mutex<SlotState>,
    pub(crate) registry: ActorRef<RegistryMsg>,
    /// Messages sent through the slot so far, counted and read under its
    /// lock: an engine's signal is stamped with it, so none is handled
    /// before a message sent before it (see `actor/signals.rs`).
    sent: AtomicU64,
}

/// See [`Slot`]. Messages wait in a queue only while no actor may take
/// them; the registry moves them, in order and under the slot's lock, to
/// the actor that then runs, so nothing sent after them overtakes them.
pub(crate) enum SlotState {
    Running(ActorRef<SessionMsg>),
    /// Its actor was asked to park: it parks (and the registry starts
    /// another at once if messages wait) or stays.
    Parking(Vec<SessionMsg>),
    /// No actor. The first message asks the registry to start one.
    Parked(Vec<SessionMsg>),
    /// The session is no longer served here (its actor failed or was
    /// stopped): handles are stale.
    Gone,
    /// As `Gone`, because another node took the session over (this node
    /// found its lease lost): its stopping actor tells the prompts it
    /// holds `node_lost`, what their new owner stores.
    Taken,
}

impl Slot {
    /// A slot with no actor yet (the registry starts one and hands it
    /// over before anyone else sees the slot).
    pub(crate) fn new(id: SessionId, registry: ActorRef<RegistryMsg>) -> Arc<Slot> {
        Arc::new(Slot {
            id,
            state: std::sync::Mutex::new(SlotState::Parked(Vec::new())),
            registry,
            sent: AtomicU64::new(0),
        })
    }

    /// How many messages were sent through the slot (read with its lock
    /// held, for an order with them).
    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        // Nothing panics while holding it; a poisoned lock's state is whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `msg` to the session's actor, or queues it. What cannot be
    /// delivered is dropped once the lock is let go: a message's reply or
    /// a client's drop may do anything, even send here again.
    pub(crate) fn send(&self, msg: SessionMsg) -> Result<(), SessionError> {
        let mut state = self.lock();
        // Counted with the lock held until it is in the mailbox.
        self.sent.fetch_add(1, Ordering::Relaxed);
        match &mut *state {
            SlotState::Running(actor) => {
                let sent = actor.send_message(msg);
                drop(state);
                sent.map_err(|_| SessionError::Stopped)
            }
            SlotState::Parking(queue) => {
                queue.push(msg);
                Ok(())
            }
            SlotState::Parked(queue) => {
                let wake = match msg {
                    // A client going away does not start a parked session.
                    SessionMsg::Unsubscribe(sub) if queue.is_empty() => {
                        return self
                            .registry
                            .send_message(RegistryMsg::Unsubscribe { id: self.id, sub })
                            .map_err(|_| SessionError::Stopped);
                    }
                    msg => {
                        queue.push(msg);
                        queue.len() == 1
                    }
                };
                if wake
                    && self
                        .registry
                        .send_message(RegistryMsg::Unpark(self.id))
                        .is_err()
                {
                    // Nobody would ever take it: its answers are dropped
                    // (the caller sees `Stopped`), never left waiting.
                    let dropped = std::mem::take(queue);
                    drop(state);
                    drop(dropped);
                    return Err(SessionError::Stopped);
                }
                Ok(())
            }
            SlotState::Gone | SlotState::Taken => Err(SessionError::Stopped),
        }
    }
}

/// A session's queues answer through its slot, so an answer sent while
/// it parks waits for its next actor.
impl ports::Inbox for Slot {
    fn offer(&self, origin: Origin, poll: u64, work: Option<ports::Work>) {
        let _ = self.send(SessionMsg::Offer { origin, poll, work });
    }

    fn event(&self, body: EventBody, kick: bool, ack: Option<ports::Ack>) {
        let _ = self.send(SessionMsg::Automation { body, kick, ack });
    }

    fn kick(&self) {
        let _ = self.send(SessionMsg::Kick);
    }
}

/// A live session.
#[derive(Clone)]
pub struct SessionHandle {
    pub(crate) id: SessionId,
    pub(crate) slot: Arc<Slot>,
    /// The policy its MCP servers are connected under.
    pub(crate) tools: Arc<tiller_tools::ToolsConfig>,
    /// To tell a closed session from a stopped one.
    pub(crate) store: Store,
}

impl SessionHandle {
    /// The session's id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Whether both handles reach the same run of the session (one that
    /// failed, or stopped here, and was opened again is another run;
    /// parking and waking are not).
    pub fn same_actor(&self, other: &SessionHandle) -> bool {
        Arc::ptr_eq(&self.slot, &other.slot)
    }

    /// Whether the session is still served through this handle: running,
    /// or parked. A handle to one that stopped (failed, closed, its lease
    /// lost) is stale: the session is opened again through the registry.
    pub fn is_running(&self) -> bool {
        match &*self.slot.lock() {
            SlotState::Running(a) => a.get_status() == ractor::ActorStatus::Running,
            SlotState::Parking(_) | SlotState::Parked(_) => true,
            SlotState::Gone | SlotState::Taken => false,
        }
    }

    pub(crate) fn send(&self, msg: SessionMsg) -> Result<(), SessionError> {
        self.slot.send(msg)
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

    /// Like [`SessionHandle::prompt`], with a webhook that hears how its
    /// turn ended, with the final text.
    pub async fn prompt_with(
        &self,
        text: String,
        origin: Origin,
        delivery: Option<String>,
    ) -> Result<Result<(PromptId, oneshot::Receiver<Settlement>), PromptRefused>, SessionError>
    {
        self.submit(
            PromptId::new(),
            (text, Vec::new()),
            origin,
            delivery,
            Acknowledge::Admission,
        )
        .await
    }

    /// Like [`SessionHandle::prompt_with`], under an id the caller chose
    /// (fresh from [`PromptId::new`]), so it can recognize the prompt's
    /// events before the prompt is acknowledged, with its images, and
    /// with what acknowledges it to its caller (see [`Acknowledge`]).
    pub async fn submit(
        &self,
        id: PromptId,
        (text, images): (String, Vec<Image>),
        origin: Origin,
        delivery: Option<String>,
        ack: Acknowledge,
    ) -> Result<Result<(PromptId, oneshot::Receiver<Settlement>), PromptRefused>, SessionError>
    {
        let (atx, arx) = oneshot::channel();
        let (stx, srx) = oneshot::channel();
        let sent = self.send(SessionMsg::Prompt {
            id,
            text,
            images,
            origin,
            delivery,
            admitted: Some(atx),
            settled: Some(stx),
            ack,
        });
        let admitted = match sent {
            Ok(()) => arx.await.map_err(|_| SessionError::Stopped),
            Err(e) => Err(e),
        };
        match admitted {
            Ok(a) => Ok(a.map(|p| (p, srx))),
            // The actor is gone: a prompt racing a close gets the close's
            // answer, not `Stopped`.
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

    /// Widens the file tools to these additional roots (ACP
    /// `additionalDirectories`, replacing earlier ones); `Ok(Err)` names a
    /// root that is refused.
    pub async fn set_roots(&self, roots: Vec<String>) -> Result<Result<(), String>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::SetRoots { roots, reply: tx })?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Forgets the model conversation (`/clear`); `Ok(Err)` while a turn
    /// runs.
    pub async fn clear_conversation(&self) -> Result<Result<(), String>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::ClearConversation(tx))?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Sets (or, with `None` or blank, clears) the session's title;
    /// answered once it is stored.
    pub async fn set_title(&self, title: Option<String>) -> Result<(), SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(SessionMsg::SetTitle {
            title,
            reply: Some(tx),
        })?;
        rx.await.map_err(|_| SessionError::Stopped)?
    }

    /// Withdraws one prompt: queued, it settles `cancelled`; running, its
    /// turn is cancelled (prompts queued behind it stay); over, nothing.
    pub fn withdraw(&self, prompt: PromptId) -> Result<(), SessionError> {
        self.send(SessionMsg::Withdraw(prompt))
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

    /// Closes the session and waits until its actor has stopped (its
    /// running turn settled), so nothing more is written: for deletion.
    pub(crate) async fn close_and_stop(
        &self,
        actor: &ActorRef<SessionMsg>,
        bound: std::time::Duration,
    ) -> Result<(), SessionError> {
        match self.close().await {
            Ok(()) | Err(SessionError::Stopped) => {}
            Err(e) => return Err(e),
        }
        actor
            .get_cell()
            .wait(Some(bound))
            .await
            .map_err(|_| SessionError::Internal("the session did not stop in time".into()))
    }
}

/// What tells a prompt's caller that the prompt was accepted, and so
/// what must be stored before the caller hears anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acknowledge {
    /// The answer to the submission itself (HTTP 202, a channel's
    /// receipt): the admission is committed before it.
    Admission,
    /// Only the prompt's terminal (ACP `session/prompt`, whose one answer
    /// is its result). A prompt that starts at once has its admission
    /// committed with its turn's first events (one commit fewer); one that
    /// queues is stored first, as it is shown queued.
    Terminal,
}
