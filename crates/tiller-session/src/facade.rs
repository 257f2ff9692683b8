//! The [`Sessions`] facade: what edges call to create, open, list and
//! drive sessions. Validation of what they send lives here, once.

use super::*;

/// Entry point for edges: create, open, list sessions.
#[derive(Clone)]
pub struct Sessions {
    pub(crate) registry: ActorRef<RegistryMsg>,
    pub(crate) notify: ActorRef<notify::NotifyMsg>,
    pub(crate) cron: ActorRef<cron::CronMsg>,
    pub(crate) goal: ActorRef<goal::GoalMsg>,
    pub(crate) store: Store,
    engines: Engines,
    next_subscriber: Arc<AtomicU64>,
    /// The tools' settings (MCP servers are connected under its policy).
    tools: Arc<tiller_tools::ToolsConfig>,
    /// How long a cancelled turn may take to settle.
    cancel_grace_ms: u64,
    /// Announces committed deletions.
    deleted: tokio::sync::broadcast::Sender<SessionId>,
    /// This node, when the store is shared by a cluster.
    pub(crate) cluster: Option<Arc<ClusterConfig>>,
    /// Stops the lease keeper at shutdown.
    pub(crate) stop_leases: Arc<tokio::sync::Notify>,
}

impl Sessions {
    /// The node (id, address) serving the session when it is another one
    /// of the cluster; `None` when this node serves it (it takes the
    /// lease if nobody holds it) or the answer is some other error, which
    /// the request's own handling reports.
    pub async fn served_elsewhere(&self, id: SessionId) -> Option<(String, String)> {
        self.cluster.as_ref()?;
        match self.open(id).await {
            Err(SessionError::Elsewhere { node, address, .. }) => Some((node, address)),
            _ => None,
        }
    }

    /// Whether the store answers (for `/readyz`).
    pub async fn store_answers(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }

    /// Starts the registry.
    pub async fn start(
        store: Store,
        engines: Engines,
        config: SessionConfig,
    ) -> Result<Sessions, SessionError> {
        // A shared store: sessions are settled and run by whoever takes
        // their lease (see `Registry::take`), not all at start-up.
        let cluster = match store.clustered().await? {
            true => {
                let c = config.cluster.clone().unwrap_or_default();
                store
                    .join(tiller_store::NodeInfo {
                        id: c.node.clone(),
                        address: c.address.clone(),
                    })
                    .await?;
                Some(Arc::new(c))
            }
            false => {
                let reconciled =
                    reconcile(&store, None, tiller_core::ErrorKind::DaemonRestarted).await?;
                if reconciled > 0 {
                    tracing::warn!(
                        prompts = reconciled,
                        "prompts in flight when the daemon stopped got a daemon_restarted error"
                    );
                }
                None
            }
        };
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
        let cancel_grace_ms = config.turn.cancel_grace;
        let args = RegistryArgs {
            store: store.clone(),
            // Admission order: goal, then notifications, then cron fires.
            automation: actor::Automation {
                queues: Arc::new([
                    Arc::new(goal.clone()) as Arc<dyn ports::WorkQueue>,
                    Arc::new(notify.clone()),
                    Arc::new(cron.clone()),
                ]),
            },
            engines: engines.clone(),
            config: Arc::new(config),
            cluster: cluster.clone(),
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
            cancel_grace_ms,
            deleted: tokio::sync::broadcast::channel(64).0,
            cluster,
            stop_leases: Arc::new(tokio::sync::Notify::new()),
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
        if sessions.cluster.is_some() {
            sessions.adopt_orphans().await;
            tokio::spawn(sessions.clone().keep_leases());
        }
        // The cron actor starts its timer (and catches up) once it can wake
        // sessions.
        let _ = sessions
            .cron
            .send_message(cron::CronMsg::Attach(Arc::new(sessions.clone())));
        Ok(sessions)
    }

    /// Adds a cron job for a session. `Ok(Err(message))` for a bad schedule.
    pub async fn cron_add(
        &self,
        session: SessionId,
        schedule: String,
        tz: String,
        prompt: String,
    ) -> Result<Result<CronJob, String>, SessionError> {
        self.record(session).await?; // the session exists
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

    /// A goal change: `make` builds the message from where its event is
    /// published and the reply. Answered once the change and its event are
    /// both stored.
    async fn goal_change<T>(
        &self,
        id: SessionId,
        make: impl FnOnce(goal::Publish, oneshot::Sender<Result<T, StoreError>>) -> goal::GoalMsg,
    ) -> Result<T, SessionError> {
        let handle = self.open(id).await?;
        let (ack, stored) = oneshot::channel();
        let publish = goal::Publish {
            inbox: handle.slot.clone(),
            ack,
        };
        let (tx, rx) = oneshot::channel();
        self.goal
            .send_message(make(publish, tx))
            .map_err(|_| SessionError::Stopped)?;
        let r = rx.await.map_err(|_| SessionError::Stopped)??;
        stored.await.map_err(|_| SessionError::Stopped)??;
        Ok(r)
    }

    /// Sets (replaces) a session's goal; its turns start when the session
    /// is idle.
    pub async fn goal_set(
        &self,
        id: SessionId,
        objective: String,
        max_turns: u32,
    ) -> Result<GoalRow, SessionError> {
        self.goal_change(id, |publish, reply| goal::GoalMsg::Set {
            session: id,
            objective,
            max_turns,
            publish,
            reply,
        })
        .await
    }

    /// A session's goal.
    pub async fn goal_get(&self, id: SessionId) -> Result<Option<GoalRow>, SessionError> {
        self.record(id).await?;
        let (tx, rx) = oneshot::channel();
        self.goal
            .send_message(goal::GoalMsg::Get {
                session: id,
                reply: tx,
            })
            .map_err(|_| SessionError::Stopped)?;
        Ok(rx.await.map_err(|_| SessionError::Stopped)??)
    }

    /// Pauses (`resume = false`) or resumes a goal. `None` when there is none.
    pub async fn goal_pause_resume(
        &self,
        id: SessionId,
        resume: bool,
    ) -> Result<Option<GoalRow>, SessionError> {
        self.goal_change(id, |publish, reply| goal::GoalMsg::PauseResume {
            session: id,
            resume,
            publish,
            reply,
        })
        .await
    }

    /// Clears a session's goal; false when it had none.
    pub async fn goal_clear(&self, id: SessionId) -> Result<bool, SessionError> {
        self.goal_change(id, |publish, reply| goal::GoalMsg::Clear {
            session: id,
            publish,
            reply,
        })
        .await
    }

    /// Every cron job.
    pub async fn cron_list(&self) -> Result<Vec<CronJob>, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.cron
            .send_message(cron::CronMsg::List(tx))
            .map_err(|_| SessionError::Stopped)?;
        rx.await.map_err(|_| SessionError::Stopped)
    }

    /// Removes a cron job; false when there was none, an error (the job
    /// kept) when its removal could not be stored.
    pub async fn cron_remove(&self, id: String) -> Result<bool, SessionError> {
        let (tx, rx) = oneshot::channel();
        self.cron
            .send_message(cron::CronMsg::Remove { id, reply: tx })
            .map_err(|_| SessionError::Stopped)?;
        rx.await.map_err(|_| SessionError::Stopped)?
    }

    /// Queues a background notification for a session (durable when this
    /// returns). It runs as its own turn once the session is idle.
    pub async fn notify(
        &self,
        id: SessionId,
        task_id: String,
        text: String,
    ) -> Result<Enqueued, SessionError> {
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

    /// Creates a session. Every edge (ACP, HTTP, channels) comes through
    /// here, so what a new session needs is checked once: an absolute
    /// cwd, an engine that exists, and for an engine whose tools work in
    /// the cwd, a directory this daemon can use.
    pub async fn create_session(&self, new: NewSession) -> Result<SessionHandle, SessionError> {
        if !std::path::Path::new(&new.cwd).is_absolute() {
            return Err(SessionError::BadCwd(
                new.cwd,
                "it must be an absolute path".into(),
            ));
        }
        let engine = self.engines.get(new.engine.as_deref())?;
        if engine.uses_directory() {
            match tokio::fs::metadata(&new.cwd).await {
                Ok(m) if m.is_dir() => {}
                Ok(_) => return Err(SessionError::BadCwd(new.cwd, "not a directory".into())),
                Err(e) => return Err(SessionError::BadCwd(new.cwd, e.to_string())),
            }
        }
        let (id, slot) = self
            .ask(|reply| RegistryMsg::Create { new, reply })
            .await??;
        Ok(self.handle(id, slot))
    }

    fn handle(&self, id: SessionId, slot: Arc<handle::Slot>) -> SessionHandle {
        SessionHandle {
            id,
            slot,
            tools: self.tools.clone(),
            store: self.store.clone(),
        }
    }

    /// The engines sessions may use.
    pub fn engines(&self) -> &Engines {
        &self.engines
    }

    /// Deletes a session: it is closed (its running turn cancelled, its
    /// queued prompts settled `cancelled`, attached clients see
    /// `session_closed`), then its history, state, queued work and cron
    /// jobs are removed from the store in one transaction. Answered, and
    /// announced to attached clients ([`Sessions::deletions`]), once that
    /// committed. It is not opened again meanwhile.
    pub async fn delete(&self, id: SessionId) -> Result<(), SessionError> {
        let live = self
            .ask(|reply| RegistryMsg::BeginDelete { id, reply })
            .await??;
        // Ends however this ends, even if its caller goes away meanwhile.
        let registry = self.registry.clone();
        let mut end = scopeguard::guard(false, move |deleted| {
            let _ = registry.send_message(RegistryMsg::EndDelete { id, deleted });
        });
        self.delete_begun(id, live).await?;
        *end = true;
        let _ = self.notify.send_message(notify::NotifyMsg::Forget(id));
        let _ = self.cron.send_message(cron::CronMsg::Forget(id));
        let _ = self.goal.send_message(goal::GoalMsg::Forget(id));
        let _ = self.deleted.send(id);
        metrics::counter!("tiller_sessions_deleted_total").increment(1);
        Ok(())
    }

    async fn delete_begun(
        &self,
        id: SessionId,
        live: Option<registry::Running>,
    ) -> Result<(), SessionError> {
        if let Some((slot, actor)) = live {
            let bound = std::time::Duration::from_millis(self.cancel_grace_ms)
                + std::time::Duration::from_secs(5);
            match self.handle(id, slot).close_and_stop(&actor, bound).await {
                Ok(()) => {}
                // A damaged log (set aside) refuses the close's event, and
                // the session stops on it: the delete is its repair.
                Err(SessionError::Store(e)) if e.is_damaged_log() => {
                    actor.get_cell().wait(Some(bound)).await.map_err(|_| {
                        SessionError::Internal("the session did not stop in time".into())
                    })?;
                }
                Err(e) => return Err(e),
            }
        }
        // A session that is not running is deleted without starting it.
        if !self.store.delete_session(id).await? {
            return Err(SessionError::Unknown(id));
        }
        Ok(())
    }

    /// Sessions deleted from now on, as they are (each once committed).
    pub fn deletions(&self) -> tokio::sync::broadcast::Receiver<SessionId> {
        self.deleted.subscribe()
    }

    /// Finds a live session or loads it from the store.
    pub async fn open(&self, id: SessionId) -> Result<SessionHandle, SessionError> {
        let slot = self.ask(|reply| RegistryMsg::Open { id, reply }).await??;
        Ok(self.handle(id, slot))
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

    /// The stored record of a session.
    pub async fn record(&self, id: SessionId) -> Result<SessionRecord, SessionError> {
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

    /// How many sessions are live, parked, and how often one woke.
    async fn counts(&self) -> (usize, usize, u64) {
        self.ask(RegistryMsg::Live).await.unwrap_or_default()
    }

    /// Live sessions (running or parked).
    pub async fn live(&self) -> usize {
        self.counts().await.0
    }

    /// Live sessions parked (no actor until a message wakes them).
    pub async fn parked(&self) -> usize {
        self.counts().await.1
    }

    /// How many times a parked session woke since the start (its next
    /// message, or a delete, started its actor again).
    pub async fn woken(&self) -> u64 {
        self.counts().await.2
    }

    /// Parks every session idle for `park_after` now, as the registry's
    /// timer does every half of it: each one with nothing in flight stops
    /// its actor and keeps only a record here until a message wakes it.
    pub fn park_idle(&self) {
        let _ = self.registry.send_message(RegistryMsg::Sweep);
    }

    /// Graceful shutdown: cancel running turns, wait (bounded) for them to
    /// settle, stop every actor, flush the store.
    pub async fn shutdown(&self) {
        let _ = self.ask(RegistryMsg::Shutdown).await;
        self.stop_leases.notify_one();
        self.registry.stop_children(None);
        self.registry.stop(None);
        // Turns have settled: the agents' processes end.
        self.engines.shutdown();
        self.notify.stop(None);
        self.cron.stop(None);
        self.goal.stop(None);
        if let Err(e) = self.store.flush().await {
            tracing::error!(error = %e, "store flush at shutdown failed");
        }
        // Every turn settled and was stored: other nodes may take this
        // node's sessions at once instead of after the lease time.
        if let Some(c) = &self.cluster
            && let Err(e) = self.store.release_leases(c.node.clone(), None, true).await
        {
            tracing::error!(error = %e, "cannot release this node's leases; they expire");
        }
        // The database's lock is released (the next daemon may open it).
        self.store.close().await;
    }
}

/// The cron actor wakes sessions through the facade.
impl ports::Waker for Sessions {
    fn wake(&self, session: SessionId, body: EventBody) -> ports::WakeFuture<'_> {
        Box::pin(async move {
            match self.open(session).await {
                Ok(h) => {
                    let _ = h.send(SessionMsg::Automation {
                        body,
                        kick: true,
                        ack: None,
                    });
                }
                Err(e) => {
                    tracing::warn!(%session, error = %e, "automatic work for an unavailable session");
                }
            }
        })
    }
}
