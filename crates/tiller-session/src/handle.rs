//! [`SessionHandle`]: one live session, as edges see it.

use super::*;

/// A live session.
#[derive(Clone)]
pub struct SessionHandle {
    pub(crate) id: SessionId,
    pub(crate) actor: ActorRef<SessionMsg>,
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

    /// Whether both handles reach the same actor (a session's actor is
    /// replaced when it fails and is reopened).
    pub fn same_actor(&self, other: &SessionHandle) -> bool {
        self.actor.get_id() == other.actor.get_id()
    }

    /// Whether the session's actor still runs. A handle to one that
    /// stopped (failed, closed, its lease lost) is stale: the session is
    /// opened again through the registry.
    pub fn is_running(&self) -> bool {
        self.actor.get_status() == ractor::ActorStatus::Running
    }

    pub(crate) fn send(&self, msg: SessionMsg) -> Result<(), SessionError> {
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
        self.submit(PromptId::new(), text, Vec::new(), origin, delivery)
            .await
    }

    /// Like [`SessionHandle::prompt_with`], under an id the caller chose
    /// (fresh from [`PromptId::new`]), so it can recognize the prompt's
    /// events before the prompt is acknowledged.
    pub async fn submit(
        &self,
        id: PromptId,
        text: String,
        images: Vec<Image>,
        origin: Origin,
        delivery: Option<String>,
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
        bound: std::time::Duration,
    ) -> Result<(), SessionError> {
        match self.close().await {
            Ok(()) | Err(SessionError::Stopped) => {}
            Err(e) => return Err(e),
        }
        self.actor
            .get_cell()
            .wait(Some(bound))
            .await
            .map_err(|_| SessionError::Internal("the session did not stop in time".into()))
    }
}
