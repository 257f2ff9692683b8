//! The session registry: creates, finds and loads sessions, enforces the
//! session limit, and supervises the session actors.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tiller_core::SessionId;
use tiller_store::{LogHead, SessionExtras, SessionRecord, Store};
use tokio::sync::oneshot;

use crate::SessionError;
use crate::actor::{Automation, SessionActor, SessionArgs, SessionMsg};
use crate::{Engines, SessionConfig};

/// The closed set of messages the registry handles.
pub enum RegistryMsg {
    /// Create and start a new session.
    Create {
        new: crate::NewSession,
        reply: oneshot::Sender<Result<(SessionId, ActorRef<SessionMsg>), SessionError>>,
    },
    /// Find a live session or load it from the store.
    Open {
        id: SessionId,
        reply: oneshot::Sender<Result<ActorRef<SessionMsg>, SessionError>>,
    },
    /// How many sessions are live.
    Live(oneshot::Sender<usize>),
    /// A delete starts: the session is not opened again until it ends
    /// (`EndDelete`); the answer is its live actor, if any. Refused while
    /// another delete of it runs.
    BeginDelete {
        id: SessionId,
        reply: oneshot::Sender<Result<Option<ActorRef<SessionMsg>>, SessionError>>,
    },
    EndDelete(SessionId),
    /// Queued work may wait for these sessions: the live ones poll their
    /// queues (the others are not served here).
    Kick(Vec<SessionId>),
    /// Another node took these sessions over (the leases this node held
    /// at these fences): their actors stop at once, settling nothing (the
    /// new owner settles what was in flight). An actor started since on a
    /// newer lease of the same session is not one of them.
    LeasesLost(Vec<(SessionId, i64)>),
    /// Cancel every running turn and wait (bounded) until all are idle.
    Shutdown(oneshot::Sender<()>),
}

/// What the registry needs.
pub struct RegistryArgs {
    pub store: Store,
    pub automation: Automation,
    pub engines: Engines,
    pub config: Arc<SessionConfig>,
    /// This node, when the store is shared by a cluster.
    pub cluster: Option<Arc<crate::ClusterConfig>>,
}

/// The registry's state.
pub struct RegistryState {
    store: Store,
    /// The queue actors every session polls.
    automation: Automation,
    engines: Engines,
    config: Arc<SessionConfig>,
    /// Live sessions.
    live: HashMap<SessionId, ActorRef<SessionMsg>>,
    /// The fence of the lease each live session runs on (a cluster).
    fences: HashMap<SessionId, i64>,
    /// Reverse map for supervision events.
    by_actor: HashMap<ActorId, SessionId>,
    /// Failed sessions whose prompts could not be settled yet (the store
    /// was down): settled before the session runs again.
    unreconciled: HashMap<SessionId, tiller_core::ErrorKind>,
    /// Sessions being deleted: not opened meanwhile.
    deleting: std::collections::HashSet<SessionId>,
    /// This node, when the store is shared: a session runs here only
    /// while this node holds its lease.
    cluster: Option<Arc<crate::ClusterConfig>>,
}

/// See the module docs.
pub struct Registry;

impl Actor for Registry {
    type Msg = RegistryMsg;
    type State = RegistryState;
    type Arguments = RegistryArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<RegistryMsg>,
        args: RegistryArgs,
    ) -> Result<RegistryState, ActorProcessingErr> {
        Ok(RegistryState {
            store: args.store,
            automation: args.automation,
            engines: args.engines,
            config: args.config,
            live: HashMap::new(),
            fences: HashMap::new(),
            by_actor: HashMap::new(),
            unreconciled: HashMap::new(),
            deleting: Default::default(),
            cluster: args.cluster,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RegistryMsg>,
        msg: RegistryMsg,
        st: &mut RegistryState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RegistryMsg::Create { new, reply } => {
                let _ = reply.send(st.create(&myself, new).await);
            }
            RegistryMsg::Open { id, reply } => {
                let _ = reply.send(st.open(&myself, id).await);
            }
            RegistryMsg::Live(reply) => {
                let _ = reply.send(st.live.len());
            }
            RegistryMsg::BeginDelete { id, reply } => {
                let r = if st.deleting.insert(id) {
                    Ok(st.live.get(&id).cloned())
                } else {
                    Err(SessionError::Unknown(id))
                };
                let _ = reply.send(r);
            }
            RegistryMsg::EndDelete(id) => {
                st.deleting.remove(&id);
            }
            RegistryMsg::Kick(ids) => {
                for id in ids {
                    if let Some(actor) = st.live.get(&id) {
                        let _ = actor.send_message(SessionMsg::Kick);
                    }
                }
            }
            RegistryMsg::LeasesLost(ids) => {
                for (id, fence) in ids {
                    if st.fences.get(&id) != Some(&fence) {
                        continue; // it runs on a newer lease
                    }
                    st.fences.remove(&id);
                    if let Some(actor) = st.live.remove(&id) {
                        tracing::warn!(%id, "another node took this session over; it stops here");
                        st.by_actor.remove(&actor.get_id());
                        metrics::gauge!("tiller_sessions_active").set(st.live.len() as f64);
                        actor.stop(Some("lease lost".into()));
                    }
                }
            }
            RegistryMsg::Shutdown(reply) => {
                let mut waits = Vec::new();
                for actor in st.live.values() {
                    let (tx, rx) = oneshot::channel();
                    if actor.send_message(SessionMsg::Drain(tx)).is_ok() {
                        waits.push(rx);
                    }
                }
                // Every turn settles within cancel_grace; allow a margin.
                let bound =
                    Duration::from_millis(st.config.turn.cancel_grace) + Duration::from_secs(1);
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(bound, futures_join_all(waits)).await;
                    let _ = reply.send(());
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<RegistryMsg>,
        evt: SupervisionEvent,
        st: &mut RegistryState,
    ) -> Result<(), ActorProcessingErr> {
        // ractor's default stops the supervisor when a child dies; a session
        // failing must never take the others down.
        match evt {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(id) = st.forget(cell.get_id()) {
                    st.release(id).await;
                }
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                tracing::error!(error = %err, "session actor failed; it reloads from the store on next use");
                if let Some(id) = st.forget(cell.get_id()) {
                    // Settle what it had in flight before anyone can open it
                    // again (this handler runs before the next message).
                    let kind = match err.downcast_ref::<crate::SessionFailed>() {
                        Some(crate::SessionFailed::StoreUnavailable) => {
                            tiller_core::ErrorKind::StoreUnavailable
                        }
                        // Its new owner settles them.
                        Some(crate::SessionFailed::LeaseLost) => return Ok(()),
                        None => tiller_core::ErrorKind::SessionRestarted,
                    };
                    match crate::reconcile(&st.store, Some(id), kind).await {
                        Ok(_) => st.release(id).await,
                        Err(e) => {
                            tracing::error!(%id, error = %e, "cannot settle the failed session's prompts yet; they settle before it reopens");
                            st.unreconciled.insert(id, kind);
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

async fn futures_join_all(waits: Vec<oneshot::Receiver<()>>) {
    for w in waits {
        let _ = w.await;
    }
}

impl RegistryState {
    fn forget(&mut self, actor: ActorId) -> Option<SessionId> {
        let id = self.by_actor.remove(&actor)?;
        self.live.remove(&id);
        self.fences.remove(&id);
        metrics::gauge!("tiller_sessions_active").set(self.live.len() as f64);
        Some(id)
    }

    /// Lets go of a session no actor serves here any more, so any node may
    /// take it at once (after every append its actor sent).
    async fn release(&self, id: SessionId) {
        if let Some(c) = &self.cluster
            && let Err(e) = self
                .store
                .release_leases(c.node.clone(), Some(vec![id]), false)
                .await
        {
            tracing::warn!(%id, error = %e, "cannot release the session's lease; it expires");
        }
    }

    /// Makes this node the session's owner (when the store is shared) and
    /// settles what was left in flight: by a failed actor here (its
    /// recorded kind), by this node's earlier run (`daemon_restarted`) or
    /// by another node that went away (`node_lost`). The answer is the
    /// lease's fence (a cluster); on an error the lease is let go.
    async fn take(&mut self, id: SessionId) -> Result<Option<i64>, SessionError> {
        use tiller_core::ErrorKind;
        let hint = self.unreconciled.get(&id).copied();
        let mut fence = None;
        let kind = match &self.cluster {
            None => hint,
            Some(c) => {
                let ttl = c.lease_ttl.as_millis() as i64;
                match self.store.acquire_lease(id, c.node.clone(), ttl).await? {
                    tiller_store::Lease::Acquired { previous, fence: f } => {
                        fence = Some(f);
                        Some(hint.unwrap_or(match previous {
                            Some(p) if p != c.node => {
                                metrics::counter!("tiller_sessions_taken_over_total").increment(1);
                                ErrorKind::NodeLost
                            }
                            _ => ErrorKind::DaemonRestarted,
                        }))
                    }
                    tiller_store::Lease::Held { node, address, .. } => {
                        return Err(SessionError::Elsewhere { id, node, address });
                    }
                }
            }
        };
        if let Some(kind) = kind {
            match crate::reconcile(&self.store, Some(id), kind).await {
                Ok(n) if n > 0 => {
                    tracing::warn!(%id, prompts = n, kind = kind.as_str(), "settled prompts left in flight");
                }
                Ok(_) => {}
                Err(e) => {
                    // Settled by whoever takes it next, as this kind.
                    self.unreconciled.insert(id, kind);
                    self.release(id).await;
                    return Err(e);
                }
            }
            self.unreconciled.remove(&id);
        }
        Ok(fence)
    }

    async fn spawn(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
        head: LogHead,
        (cwd, title): (String, Option<String>),
        extras: SessionExtras,
    ) -> Result<ActorRef<SessionMsg>, SessionError> {
        if self.live.len() >= self.config.max_sessions {
            return Err(SessionError::TooManySessions(self.config.max_sessions));
        }
        let engine = match self.engines.get(extras.engine.as_deref()) {
            Ok(e) => e,
            Err(_) => {
                tracing::warn!(%id, engine = ?extras.engine, "the session's engine is no longer configured; using the default");
                self.engines.get(None)?
            }
        };
        let args = SessionArgs {
            id,
            head,
            cwd,
            title,
            extras,
            engine,
            engines: self.engines.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            automation: self.automation.clone(),
        };
        let (actor, _) = Actor::spawn_linked(None, SessionActor, args, myself.get_cell())
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        self.by_actor.insert(actor.get_id(), id);
        self.live.insert(id, actor.clone());
        metrics::gauge!("tiller_sessions_active").set(self.live.len() as f64);
        Ok(actor)
    }

    async fn create(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        new: crate::NewSession,
    ) -> Result<(SessionId, ActorRef<SessionMsg>), SessionError> {
        let crate::NewSession {
            cwd,
            title,
            engine,
            channel,
        } = new;
        let given = title.clone();
        if self.live.len() >= self.config.max_sessions {
            return Err(SessionError::TooManySessions(self.config.max_sessions));
        }
        // Checked by the facade (`Sessions::create_session`).
        let engine = self.engines.get(engine.as_deref())?;
        let engine_name = engine.name().to_owned();
        let id = SessionId::new();
        let now = crate::clock::unix_ms();
        self.store
            .create_session_with_engine(
                SessionRecord {
                    id,
                    cwd: cwd.clone(),
                    title,
                    created_ms: now,
                    updated_ms: now,
                    closed: false,
                    channel,
                },
                engine_name.clone(),
            )
            .await?;
        metrics::counter!("tiller_sessions_created_total").increment(1);
        let mut fence = None;
        if let Some(c) = &self.cluster {
            let ttl = c.lease_ttl.as_millis() as i64;
            match self.store.acquire_lease(id, c.node.clone(), ttl).await? {
                tiller_store::Lease::Acquired { fence: f, .. } => fence = Some(f),
                tiller_store::Lease::Held { node, .. } => {
                    return Err(SessionError::Internal(format!(
                        "node {node} holds the lease of session {id}, which was just created"
                    )));
                }
            }
        }
        let extras = SessionExtras {
            engine: Some(engine_name),
            ..SessionExtras::default()
        };
        let spawned = self
            .spawn(myself, id, LogHead::default(), (cwd, given), extras)
            .await;
        let actor = self.running(id, fence, spawned).await?;
        Ok((id, actor))
    }

    /// A session's actor started on the lease at `fence` (a cluster), or
    /// could not start: then its lease is let go at once, so it does not
    /// sit on a session no node serves until it expires.
    async fn running(
        &mut self,
        id: SessionId,
        fence: Option<i64>,
        spawned: Result<ActorRef<SessionMsg>, SessionError>,
    ) -> Result<ActorRef<SessionMsg>, SessionError> {
        match (spawned, fence) {
            (Ok(actor), Some(f)) => {
                self.fences.insert(id, f);
                Ok(actor)
            }
            (Ok(actor), None) => Ok(actor),
            (Err(e), _) => {
                self.release(id).await;
                Err(e)
            }
        }
    }

    async fn open(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
    ) -> Result<ActorRef<SessionMsg>, SessionError> {
        if self.deleting.contains(&id) {
            return Err(SessionError::Unknown(id));
        }
        if let Some(actor) = self.live.get(&id) {
            return Ok(actor.clone());
        }
        if self.live.len() >= self.config.max_sessions {
            return Err(SessionError::TooManySessions(self.config.max_sessions));
        }
        match self.store.get_session(id).await? {
            Some((rec, _)) if !rec.closed => {
                let fence = self.take(id).await?;
                let spawned = async {
                    // A failed actor may have left its log refusing appends.
                    let head = self.store.reopen_log(id).await?;
                    let extras = self.store.load_state(id).await?;
                    self.spawn(myself, id, head, (rec.cwd, rec.title), extras)
                        .await
                }
                .await;
                self.running(id, fence, spawned).await
            }
            _ => Err(SessionError::Unknown(id)),
        }
    }
}
