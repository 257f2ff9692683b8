//! The registry's side of parking (see `actor/park.rs` for the whole
//! protocol): the sweep, the switch of a session's slot while it parks,
//! its record while parked, and waking it.

use super::*;

/// A live session: how it runs, and the slot its handles send through.
pub(super) struct Live {
    pub(super) slot: Arc<Slot>,
    pub(super) run: Run,
}

pub(super) enum Run {
    Running(ActorRef<SessionMsg>),
    /// Asked to park; what the registry is asked about the session
    /// meanwhile waits until it parks or stays.
    Parking(ActorRef<SessionMsg>, std::sync::Mutex<Vec<RegistryMsg>>),
    /// No actor: its state is in the store, its clients here (behind a
    /// lock only so the registry's state may be shared across awaits).
    Parked(std::sync::Mutex<Subscribers>),
}

impl Run {
    pub(super) fn actor(&self) -> Option<&ActorRef<SessionMsg>> {
        match self {
            Run::Running(a) | Run::Parking(a, _) => Some(a),
            Run::Parked(_) => None,
        }
    }
}

/// Hands what waits in a slot to its actor, in order, and lets handles
/// reach the actor directly again: under the slot's lock, so nothing sent
/// later overtakes what waited.
pub(super) fn resume(slot: &Slot, actor: ActorRef<SessionMsg>) {
    let mut undelivered = Vec::new();
    {
        let mut state = slot.lock();
        let queued = match &mut *state {
            SlotState::Parking(q) | SlotState::Parked(q) => std::mem::take(q),
            SlotState::Running(_) | SlotState::Gone | SlotState::Taken => Vec::new(),
        };
        for m in queued {
            if let Err(e) = actor.send_message(m) {
                undelivered.push(e);
            }
        }
        *state = SlotState::Running(actor);
    }
    // Dropped outside the lock: each sender sees `Stopped`.
    drop(undelivered);
}

/// What waited while a session parked, less the clients that left: they
/// start nothing and are detached from its record now, unless they also
/// came meanwhile (then both wait for the next actor, in order).
fn leavers(
    queued: Vec<SessionMsg>,
    subscribers: &mut Subscribers,
) -> (Vec<SessionMsg>, crate::subscribers::Detached) {
    let mut rest = Vec::new();
    let mut detached = Vec::new();
    for m in queued {
        match m {
            SessionMsg::Unsubscribe(sub) if !subscribes(&rest, sub) => {
                detached.extend(subscribers.detach(sub));
            }
            m => rest.push(m),
        }
    }
    (rest, detached)
}

/// Whether a `Subscribe` of this client waits among these messages.
fn subscribes(queued: &[SessionMsg], sub: SubscriberId) -> bool {
    queued
        .iter()
        .any(|m| matches!(m, SessionMsg::Subscribe { id, .. } if *id == sub))
}

impl RegistryState {
    /// Asks every running session to park if it has been idle long enough.
    pub(super) fn sweep(&self) {
        for l in self.live.values() {
            if let Run::Running(a) = &l.run {
                let _ = a.send_message(SessionMsg::ParkIfIdle);
            }
        }
    }

    /// A session says it is idle: its slot holds what handles send from
    /// now on, and it is asked to park.
    pub(super) fn idle(&mut self, id: SessionId, actor: ActorId) {
        // A session being deleted keeps the actor its delete waits on.
        if self.deleting.contains(&id) {
            return;
        }
        if let Some(l) = self.live.get_mut(&id)
            && let Run::Running(a) = &l.run
            && a.get_id() == actor
        {
            let a = a.clone();
            // From here on no handle reaches the actor: whatever they send
            // waits in the slot, behind all they sent.
            *l.slot.lock() = SlotState::Parking(Vec::new());
            l.run = Run::Parking(a.clone(), Vec::new().into());
            let _ = a.send_message(SessionMsg::Park);
        }
    }

    /// The session parked: its actor stops, its clients stay here, and if
    /// messages waited meanwhile it starts again at once. The answer is
    /// what waited in the registry for the outcome.
    pub(super) async fn parked(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
        actor: ActorId,
        mut subscribers: Subscribers,
    ) -> Option<Vec<RegistryMsg>> {
        let l = self.live.get_mut(&id)?;
        let Run::Parking(a, _) = &l.run else {
            return None;
        };
        if a.get_id() != actor {
            return None;
        }
        // Its stop is not a session ending: forgotten first.
        self.by_actor.remove(&actor);
        a.stop(Some("parked".into()));
        let (wake, detached) = {
            let mut slot = l.slot.lock();
            let queued = match &mut *slot {
                SlotState::Parking(q) => std::mem::take(q),
                _ => Vec::new(),
            };
            let (rest, detached) = leavers(queued, &mut subscribers);
            let wake = !rest.is_empty();
            *slot = SlotState::Parked(rest);
            (wake, detached)
        };
        drop(detached);
        let Run::Parking(_, waiting) =
            std::mem::replace(&mut l.run, Run::Parked(subscribers.into()))
        else {
            unreachable!("matched above")
        };
        self.parked += 1;
        self.gauges();
        tracing::debug!(session = %id, "session parked");
        if wake {
            self.wake(myself, id).await;
        }
        Some(waiting.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// The session got work before it could park: it goes on with what
    /// waited in its slot. The answer is what waited in the registry.
    pub(super) fn stays(&mut self, id: SessionId, actor: ActorId) -> Option<Vec<RegistryMsg>> {
        let l = self.live.get_mut(&id)?;
        let Run::Parking(a, _) = &l.run else {
            return None;
        };
        if a.get_id() != actor {
            return None;
        }
        let a = a.clone();
        let Run::Parking(_, waiting) = std::mem::replace(&mut l.run, Run::Running(a.clone()))
        else {
            unreachable!("matched above")
        };
        resume(&l.slot, a);
        Some(waiting.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether a message waits in the slot of this parked session.
    pub(super) fn waits(&self, id: SessionId) -> bool {
        self.live.get(&id).is_some_and(|l| {
            matches!(l.run, Run::Parked(_))
                && matches!(&*l.slot.lock(), SlotState::Parked(q) if !q.is_empty())
        })
    }

    /// A client detached: from the record of a parked session, else
    /// through its slot.
    pub(super) fn unsubscribe(&mut self, id: SessionId, sub: SubscriberId) {
        if let Some(l) = self.live.get_mut(&id) {
            match &mut l.run {
                Run::Parked(subs) => {
                    drop(
                        subs.get_mut()
                            .unwrap_or_else(|e| e.into_inner())
                            .detach(sub),
                    );
                }
                _ => {
                    let _ = l.slot.send(SessionMsg::Unsubscribe(sub));
                }
            }
        }
    }

    pub(super) fn gauges(&self) {
        debug_assert!(self.parked <= self.live.len(), "parked count out of step");
        metrics::gauge!("tiller_sessions_active")
            .set(self.live.len().saturating_sub(self.parked) as f64);
        metrics::gauge!("tiller_sessions_parked").set(self.parked as f64);
    }

    /// Starts the actor of a parked session, with its clients, and hands
    /// it what waits in its slot. If it cannot start (the store is down),
    /// it is forgotten: what waits is dropped (each sender sees `Stopped`)
    /// and the next open loads it from the store.
    pub(super) async fn wake(&mut self, myself: &ActorRef<RegistryMsg>, id: SessionId) {
        let Some(Live {
            run: run @ Run::Parked(_),
            slot,
        }) = self.live.get_mut(&id)
        else {
            return;
        };
        let slot = slot.clone();
        let Run::Parked(subscribers) = std::mem::replace(run, Run::Parked(Default::default()))
        else {
            unreachable!("matched above")
        };
        let subscribers = subscribers.into_inner().unwrap_or_else(|e| e.into_inner());
        self.parked -= 1;
        let started = async {
            let Some((rec, _)) = self.store.get_session(id).await? else {
                return Err(SessionError::Unknown(id));
            };
            let at = (slot.clone(), subscribers);
            self.load(myself, id, (rec.cwd, rec.title), None, at).await
        }
        .await;
        match started {
            Ok(actor) => {
                if let Some(l) = self.live.get_mut(&id) {
                    l.run = Run::Running(actor.clone());
                }
                resume(&slot, actor);
                self.woken += 1;
                metrics::counter!("tiller_sessions_woken_total").increment(1);
                tracing::debug!(session = %id, "session woke");
            }
            Err(e) => {
                // Its handles go stale: what waited, and its clients, see
                // `Stopped` and open it again through the registry.
                tracing::error!(session = %id, error = %e, "a parked session cannot start; it is opened again on next use");
                self.parked += 1; // counted out again below
                let _ = self.drop_live(id);
                self.release(id).await;
            }
        }
        self.gauges();
    }

    /// Forgets a live session (its actor stopped, or another node took
    /// it): its handles are stale from now on. The answer is what waited
    /// for it to park.
    pub(super) fn drop_live(&mut self, id: SessionId) -> Option<Vec<RegistryMsg>> {
        let live = self.live.remove(&id)?;
        self.fences.remove(&id);
        let queued = std::mem::replace(&mut *live.slot.lock(), SlotState::Gone);
        drop(queued); // outside the lock
        let waiting = match live.run {
            Run::Running(a) => {
                self.by_actor.remove(&a.get_id());
                None
            }
            Run::Parking(a, waiting) => {
                self.by_actor.remove(&a.get_id());
                Some(waiting.into_inner().unwrap_or_else(|e| e.into_inner()))
            }
            Run::Parked(_) => {
                self.parked -= 1;
                None
            }
        };
        self.gauges();
        waiting
    }
}

/// However the registry ends (stopped, or failed), no caller waits on it:
/// every slot is `Gone`, so what waits in one is dropped (each sender sees
/// `Stopped`, outside the slot's lock) and later sends fail at once.
impl Drop for RegistryState {
    fn drop(&mut self) {
        for l in self.live.values() {
            let queued = std::mem::replace(&mut *l.slot.lock(), SlotState::Gone);
            drop(queued); // outside the lock
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Subscriber;

    struct Quiet;
    impl Subscriber for Quiet {
        fn deliver(&self, _: &Arc<crate::EventRecord>) -> bool {
            true
        }
    }

    fn subscribe(id: u64) -> SessionMsg {
        SessionMsg::Subscribe {
            id: SubscriberId(id),
            subscriber: Box::new(Quiet),
            reply: oneshot::channel().0,
        }
    }

    fn kinds(msgs: &[SessionMsg]) -> Vec<String> {
        msgs.iter()
            .map(|m| match m {
                SessionMsg::Subscribe { id, .. } => format!("subscribe {}", id.0),
                SessionMsg::Unsubscribe(id) => format!("unsubscribe {}", id.0),
                SessionMsg::Kick => "kick".into(),
                _ => "other".into(),
            })
            .collect()
    }

    #[test]
    fn a_client_that_left_while_the_session_parked_is_detached_unless_it_came_meanwhile() {
        let mut subs = Subscribers::default();
        subs.attach(SubscriberId(1), Box::new(Quiet));
        subs.attach(SubscriberId(2), Box::new(Quiet));
        let queued = vec![
            SessionMsg::Unsubscribe(SubscriberId(1)),
            subscribe(3),
            SessionMsg::Kick,
            SessionMsg::Unsubscribe(SubscriberId(3)),
        ];
        let (rest, detached) = leavers(queued, &mut subs);
        // 1 was attached and left: detached now, starting nothing.
        assert_eq!(detached.len(), 1);
        assert_eq!(subs.iter().count(), 1, "2 stays attached");
        // 3 came and left meanwhile: both wait for the actor, in order.
        assert_eq!(
            kinds(&rest),
            ["subscribe 3", "kick", "unsubscribe 3"].map(String::from)
        );
        // Only clients leaving: nothing wakes the session.
        let (rest, detached) = leavers(vec![SessionMsg::Unsubscribe(SubscriberId(2))], &mut subs);
        assert!(rest.is_empty());
        assert_eq!((detached.len(), subs.iter().count()), (1, 0));
    }
}
