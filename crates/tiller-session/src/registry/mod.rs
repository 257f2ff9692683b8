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
use crate::handle::{Slot, SlotState};

mod leases;
mod park;
mod reopen;
mod spawn;
use crate::{Engines, SessionConfig, SubscriberId};
use park::{Live, Run, resume};

/// A running session: its slot and its actor.
pub(crate) type Running = (Arc<Slot>, ActorRef<SessionMsg>);

pub(crate) use crate::subscribers::Subscribers;

/// The closed set of messages the registry handles.
pub enum RegistryMsg {
    /// Create and start a new session.
    Create {
        new: crate::NewSession,
        reply: oneshot::Sender<Result<(SessionId, Arc<Slot>), SessionError>>,
    },
    /// Find a live session or load it from the store.
    Open {
        id: SessionId,
        reply: oneshot::Sender<Result<Arc<Slot>, SessionError>>,
    },
    /// How many sessions are live, how many of them parked, and how many
    /// times one woke.
    Live(oneshot::Sender<(usize, usize, u64)>),
    /// A delete starts: the session is not opened again until it ends
    /// (`EndDelete`); the answer is its live actor (a parked one is
    /// started, so its clients see it close), if any. Refused while
    /// another delete of it runs.
    BeginDelete {
        id: SessionId,
        reply: oneshot::Sender<Result<Option<Running>, SessionError>>,
    },
    /// The delete ended; `deleted`: the session is gone from the store.
    EndDelete { id: SessionId, deleted: bool },
    /// Queued work may wait for these sessions: the live ones poll their
    /// queues (the others are not served here).
    Kick(Vec<SessionId>),
    /// A session whose actor failed is opened again (see `reopen`).
    Reopen(SessionId),
    /// Another node took these sessions over (the leases this node held
    /// at these fences): their actors stop after the message they are
    /// handling, storing nothing more (the new owner settles what was in
    /// flight, `node_lost`, what their prompts' owners here are told). An
    /// actor started since on a newer lease of the same session is not
    /// one of them.
    LeasesLost(Vec<(SessionId, i64)>),
    /// This node could not renew its leases in time: they may lapse, and
    /// another node take the sessions over. Every live session it holds a
    /// lease for stops here now (as for `LeasesLost`); the answer is them.
    LeasesExpiring(oneshot::Sender<Vec<SessionId>>),
    /// The leases of sessions `LeasesExpiring` stopped were let go: they
    /// may be opened here again.
    LeasesReleased(Vec<SessionId>),
    /// Cancel every running turn and wait (bounded) until all are idle.
    Shutdown(oneshot::Sender<()>),
    /// Ask every running session to park if it has been idle for
    /// `park_after` (sent by the registry's own timer, or by an operator).
    Sweep,
    /// A session's actor has been idle for `park_after` and nothing is in
    /// flight: the registry holds its messages back and asks it to park.
    Idle { id: SessionId, actor: ActorId },
    /// The actor parked (and stops): its clients wait here.
    Parked {
        id: SessionId,
        actor: ActorId,
        subscribers: Subscribers,
    },
    /// The actor got work before it could park: it goes on.
    Stays { id: SessionId, actor: ActorId },
    /// A message waits for a parked session: start its actor.
    Unpark(SessionId),
    /// A client detached from a parked session.
    Unsubscribe { id: SessionId, sub: SubscriberId },
    /// Tests only: every running session is taken as idle now, as if each
    /// had just answered a sweep (an actor's `Idle` may arrive behind any
    /// message).
    #[cfg(feature = "test-hooks")]
    IdleNow,
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
    /// Live sessions, running or parked.
    live: HashMap<SessionId, Live>,
    /// How many of them are parked.
    parked: usize,
    /// How many times a parked session woke.
    woken: u64,
    /// The fence of the lease each live session runs on (a cluster).
    fences: HashMap<SessionId, i64>,
    /// Reverse map for supervision events.
    by_actor: HashMap<ActorId, SessionId>,
    /// Failed sessions whose prompts could not be settled yet (the store
    /// was down): settled before the session runs again.
    unreconciled: HashMap<SessionId, tiller_core::ErrorKind>,
    /// Sessions being deleted: not opened meanwhile.
    deleting: std::collections::HashSet<SessionId>,
    /// Sessions stopped because this node's leases may have lapsed, until
    /// their leases are let go.
    expiring: std::collections::HashSet<SessionId>,
    /// Failed sessions opened again: how many times, the last when.
    reopening: HashMap<SessionId, reopen::Reopening>,
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
        myself: ActorRef<RegistryMsg>,
        args: RegistryArgs,
    ) -> Result<RegistryState, ActorProcessingErr> {
        if let Some(after) = args.config.park_after {
            let every = (after / 2).max(Duration::from_secs(1));
            myself.send_interval(every, || RegistryMsg::Sweep);
        }
        Ok(RegistryState {
            store: args.store,
            automation: args.automation,
            engines: args.engines,
            config: args.config,
            live: HashMap::new(),
            parked: 0,
            woken: 0,
            fences: HashMap::new(),
            by_actor: HashMap::new(),
            unreconciled: HashMap::new(),
            deleting: Default::default(),
            reopening: Default::default(),
            expiring: Default::default(),
            cluster: args.cluster,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RegistryMsg>,
        msg: RegistryMsg,
        st: &mut RegistryState,
    ) -> Result<(), ActorProcessingErr> {
        // What waited for a session to park or stay is handled after it,
        // in order (it may wait again: a later park).
        let mut todo = std::collections::VecDeque::from([msg]);
        while let Some(msg) = todo.pop_front() {
            if let Some(resumed) = st.on(&myself, msg).await {
                for m in resumed.into_iter().rev() {
                    todo.push_front(m);
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RegistryMsg>,
        evt: SupervisionEvent,
        st: &mut RegistryState,
    ) -> Result<(), ActorProcessingErr> {
        // ractor's default stops the supervisor when a child dies; a session
        // failing must never take the others down.
        let waiting = match evt {
            SupervisionEvent::ActorTerminated(cell, _, _) => match st.forget(cell.get_id()) {
                Some((id, waiting)) => {
                    st.release(id).await;
                    waiting
                }
                None => None,
            },
            SupervisionEvent::ActorFailed(cell, err) => match st.forget(cell.get_id()) {
                Some((id, waiting)) => {
                    tracing::error!(session = %id, error = %err, "session actor failed; it reloads from the store on next use");
                    st.failed(id, &err).await;
                    st.reopen_later(&myself, id, &err);
                    waiting
                }
                // A session taken over fails as its writes are refused.
                None if matches!(
                    err.downcast_ref::<crate::SessionFailed>(),
                    Some(crate::SessionFailed::LeaseLost)
                ) =>
                {
                    None
                }
                None => {
                    tracing::error!(error = %err, "an actor the registry no longer tracks failed");
                    None
                }
            },
            _ => None,
        };
        // What waited for it to park is answered now that it is gone.
        for msg in waiting.into_iter().flatten() {
            self.handle(myself.clone(), msg, st).await?;
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
    /// Handles one message; the answer is what waited for a session that
    /// just parked or stayed, to handle next.
    async fn on(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        msg: RegistryMsg,
    ) -> Option<Vec<RegistryMsg>> {
        match msg {
            RegistryMsg::Create { new, reply } => {
                let _ = reply.send(self.create(myself, new).await);
            }
            RegistryMsg::Open { id, reply } => {
                let _ = reply.send(self.open(myself, id).await);
            }
            RegistryMsg::Live(reply) => {
                let _ = reply.send((self.live.len(), self.parked, self.woken));
            }
            RegistryMsg::BeginDelete { id, reply } => {
                if let Some(Live {
                    run: Run::Parking(_, waiting),
                    ..
                }) = self.live.get_mut(&id)
                {
                    waiting
                        .get_mut()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(RegistryMsg::BeginDelete { id, reply });
                    return None;
                }
                let r = if self.deleting.insert(id) {
                    // A parked session starts, so its clients see the close.
                    self.wake(myself, id).await;
                    Ok(self
                        .live
                        .get(&id)
                        .and_then(|l| Some((l.slot.clone(), l.run.actor()?.clone()))))
                } else {
                    Err(SessionError::Unknown(id))
                };
                if let Err(Ok(_)) = reply.send(r) {
                    // Its caller went away: no delete runs.
                    self.deleting.remove(&id);
                }
            }
            RegistryMsg::EndDelete { id, deleted } => {
                self.deleting.remove(&id);
                // A deleted session's prompts went with it; one whose
                // delete failed keeps how they are settled when it opens.
                if deleted {
                    self.unreconciled.remove(&id);
                }
            }
            RegistryMsg::Reopen(id) => self.reopen(myself, id).await,
            RegistryMsg::Kick(ids) => {
                for id in ids {
                    if let Some(l) = self.live.get(&id) {
                        // A parked session starts to look (`Unpark`).
                        let _ = l.slot.send(SessionMsg::Kick);
                    }
                }
            }
            RegistryMsg::LeasesLost(ids) => {
                let mut resumed = Vec::new();
                for (id, fence) in ids {
                    if self.fences.get(&id) != Some(&fence) {
                        continue; // it runs on a newer lease
                    }
                    tracing::warn!(session = %id, "another node took this session over; it stops here");
                    resumed.extend(self.lose(id));
                }
                return Some(resumed);
            }
            RegistryMsg::LeasesExpiring(reply) => return Some(self.expire_all(reply)),
            RegistryMsg::LeasesReleased(ids) => {
                for id in ids {
                    self.expiring.remove(&id);
                }
            }
            RegistryMsg::Shutdown(reply) => {
                let mut waits = Vec::new();
                for actor in self.live.values().filter_map(|l| l.run.actor()) {
                    let (tx, rx) = oneshot::channel();
                    if actor.send_message(SessionMsg::Drain(tx)).is_ok() {
                        waits.push(rx);
                    }
                }
                // Every turn settles within cancel_grace; allow a margin.
                let bound =
                    Duration::from_millis(self.config.turn.cancel_grace) + Duration::from_secs(1);
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(bound, futures_join_all(waits)).await;
                    let _ = reply.send(());
                });
            }
            RegistryMsg::Sweep => self.sweep(),
            RegistryMsg::Idle { id, actor } => self.idle(id, actor),
            RegistryMsg::Parked {
                id,
                actor,
                subscribers,
            } => return self.parked(myself, id, actor, subscribers).await,
            RegistryMsg::Stays { id, actor } => return self.stays(id, actor),
            // Only if a message still waits: an `Unpark` sent to an
            // earlier run of the session (forgotten since) wakes nothing.
            RegistryMsg::Unpark(id) if self.waits(id) => self.wake(myself, id).await,
            RegistryMsg::Unpark(_) => {}
            RegistryMsg::Unsubscribe { id, sub } => self.unsubscribe(id, sub),
            #[cfg(feature = "test-hooks")]
            RegistryMsg::IdleNow => {
                let running: Vec<_> = (self.live.iter())
                    .filter_map(|(id, l)| match &l.run {
                        Run::Running(a) => Some((*id, a.get_id())),
                        _ => None,
                    })
                    .collect();
                for (id, actor) in running {
                    self.idle(id, actor);
                }
            }
        }
        None
    }

    /// The session whose actor stopped, forgotten, and what waited for it
    /// to park.
    fn forget(&mut self, actor: ActorId) -> Option<(SessionId, Option<Vec<RegistryMsg>>)> {
        let id = *self.by_actor.get(&actor)?;
        let waiting = self.drop_live(id);
        Some((id, waiting))
    }

    /// A session's actor failed: settle what it had in flight before
    /// anyone can open it again (this runs before the next message).
    async fn failed(&mut self, id: SessionId, err: &ActorProcessingErr) {
        let kind = match err.downcast_ref::<crate::SessionFailed>() {
            // Its new owner settles them.
            Some(crate::SessionFailed::LeaseLost) => return,
            Some(f) => f.kind(),
            None => tiller_core::ErrorKind::SessionRestarted,
        };
        match crate::reconcile(&self.store, Some(id), kind).await {
            Ok(_) => self.release(id).await,
            Err(e) => {
                tracing::error!(session = %id, error = %e, "cannot settle the failed session's prompts yet; they settle before it reopens");
                self.unreconciled.insert(id, kind);
            }
        }
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
            tracing::warn!(session = %id, error = %e, "cannot release the session's lease; it expires");
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
                    tracing::warn!(session = %id, prompts = n, kind = kind.as_str(), "settled prompts left in flight");
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

    async fn create(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        new: crate::NewSession,
    ) -> Result<(SessionId, Arc<Slot>), SessionError> {
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
        let started = self
            .start(myself, id, (cwd, given), Some((LogHead::default(), extras)))
            .await;
        let slot = self.running(id, fence, started).await?;
        Ok((id, slot))
    }

    /// A session's actor started on the lease at `fence` (a cluster), or
    /// could not start: then its lease is let go at once, so it does not
    /// sit on a session no node serves until it expires.
    async fn running(
        &mut self,
        id: SessionId,
        fence: Option<i64>,
        started: Result<Arc<Slot>, SessionError>,
    ) -> Result<Arc<Slot>, SessionError> {
        match (started, fence) {
            (Ok(slot), Some(f)) => {
                self.fences.insert(id, f);
                Ok(slot)
            }
            (Ok(slot), None) => Ok(slot),
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
    ) -> Result<Arc<Slot>, SessionError> {
        if self.deleting.contains(&id) {
            return Err(SessionError::Unknown(id));
        }
        if self.expiring.contains(&id) {
            return Err(SessionError::HandingOver(id));
        }
        if let Some(l) = self.live.get(&id) {
            return Ok(l.slot.clone());
        }
        if self.live.len() >= self.config.max_sessions {
            return Err(SessionError::TooManySessions(self.config.max_sessions));
        }
        match self.store.get_session(id).await? {
            Some((rec, _)) if !rec.closed => {
                let fence = self.take(id).await?;
                let started = self.start(myself, id, (rec.cwd, rec.title), None).await;
                self.running(id, fence, started).await
            }
            _ => Err(SessionError::Unknown(id)),
        }
    }
}
