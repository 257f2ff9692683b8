//! The goal actor: owns each session's goal (durable) and its pacing
//! (`tiller_core::goal`). An idle session polls it first; an active goal
//! offers one continuation turn. Each ended goal turn comes back here, so
//! three loop-stopped turns in a row pause the goal visibly. A read or
//! write the store fails is tried again after a pause (`ports::Retries`;
//! an uncounted turn's end holds the goal back, `tiller_core::goal::Unstored`),
//! never taken for "nothing due".

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::goal::{Counted, End, Goal, GoalChange, GoalStatus, PauseReason, Turns, Unstored};
use tiller_core::{Origin, SessionId};
use tiller_store::{GoalRow, Store, StoreError};
use tokio::sync::oneshot;

use std::sync::Arc;

use crate::event::EventBody;
use crate::ports::{Ack, Inbox, PollReply, Retries, Work, WorkQueue};

/// Where a change's event goes: the session's inbox, and the answer the
/// caller waits for once the event is stored. A change publishes its event
/// from this actor, so events are in the order the changes were made.
pub struct Publish {
    pub inbox: Arc<dyn Inbox>,
    pub ack: Ack,
}

impl Publish {
    fn send(self, event: Option<(EventBody, bool)>) {
        match event {
            Some((body, kick)) => self.inbox.event(body, kick, Some(self.ack)),
            None => {
                let _ = self.ack.send(Ok(()));
            }
        }
    }
}

/// The closed set of messages the goal actor handles.
pub enum GoalMsg {
    Set {
        session: SessionId,
        objective: String,
        max_turns: u32,
        publish: Publish,
        reply: oneshot::Sender<Result<GoalRow, StoreError>>,
    },
    Get {
        session: SessionId,
        reply: oneshot::Sender<Result<Option<GoalRow>, StoreError>>,
    },
    /// The user pauses (`resume = false`) or resumes the goal; the change
    /// (the core decides if there is one) is published. `None`: no goal.
    PauseResume {
        session: SessionId,
        resume: bool,
        publish: Publish,
        reply: oneshot::Sender<Result<Option<GoalRow>, StoreError>>,
    },
    /// False when there was no goal.
    Clear {
        session: SessionId,
        publish: Publish,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    /// An idle session asks for a continuation (answered as an `Offer`).
    Poll {
        session: SessionId,
        reply: PollReply,
    },
    /// A goal turn of the session ended.
    TurnEnded {
        session: SessionId,
        loop_stopped: bool,
        inbox: Arc<dyn Inbox>,
    },
    /// The try again after the store failed the session's goal is due:
    /// a turn's end waiting is stored, else the session looks for work.
    Retry(SessionId),
    /// The session was closed or deleted: nothing of it is kept.
    Forget(SessionId),
}

/// See the module docs.
pub struct GoalActor;

/// The actor's state: the store, and which goal each turn is for.
pub struct GoalState {
    store: Store,
    turns: Turns,
    unstored: Unstored,
    retries: Retries,
}

fn to_core(row: &GoalRow) -> Goal {
    Goal {
        objective: row.objective.clone(),
        max_turns: row.max_turns,
        turns_done: row.turns_done,
        status: match row.status.as_str() {
            "paused" => GoalStatus::Paused(
                row.pause_reason
                    .as_deref()
                    .and_then(PauseReason::parse)
                    .unwrap_or(PauseReason::User),
            ),
            "completed" => GoalStatus::Completed,
            _ => GoalStatus::Active,
        },
        loop_stops: row.loop_stops,
    }
}

fn to_row(session: SessionId, g: &Goal) -> GoalRow {
    let (status, reason) = match g.status {
        GoalStatus::Active => ("active", None),
        GoalStatus::Paused(r) => ("paused", Some(r.as_str().to_owned())),
        GoalStatus::Completed => ("completed", None),
    };
    GoalRow {
        session,
        objective: g.objective.clone(),
        max_turns: g.max_turns,
        turns_done: g.turns_done,
        status: status.into(),
        pause_reason: reason,
        loop_stops: g.loop_stops,
    }
}

impl Actor for GoalActor {
    type Msg = GoalMsg;
    type State = GoalState;
    type Arguments = Store;

    async fn pre_start(
        &self,
        _myself: ActorRef<GoalMsg>,
        store: Store,
    ) -> Result<GoalState, ActorProcessingErr> {
        Ok(GoalState {
            store,
            turns: Turns::default(),
            unstored: Unstored::default(),
            retries: Retries::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<GoalMsg>,
        msg: GoalMsg,
        st: &mut GoalState,
    ) -> Result<(), ActorProcessingErr> {
        let store = &st.store;
        match msg {
            GoalMsg::Set {
                session,
                objective,
                max_turns,
                publish,
                reply,
            } => {
                let row = to_row(session, &Goal::new(objective.clone(), max_turns));
                let r = store.goal_put(row.clone()).await.map(|()| row);
                if r.is_ok() {
                    st.turns.set(session);
                    st.unstored.replaced(session);
                    st.retries.succeeded(session);
                    let set = EventBody::GoalSet {
                        objective,
                        max_turns,
                    };
                    publish.send(Some((set, true)));
                }
                let _ = reply.send(r);
            }
            GoalMsg::Get { session, reply } => {
                let _ = reply.send(store.goal_get(session).await);
            }
            GoalMsg::PauseResume {
                session,
                resume,
                publish,
                reply,
            } => {
                let mut change = None;
                let r = update(store, session, |g| {
                    change = if resume { g.resume() } else { g.pause() };
                })
                .await;
                if let (Ok(Some(_)), Some(GoalChange::Resumed)) = (&r, change) {
                    st.turns.resumed(session);
                    st.unstored.resumed(session);
                }
                match &r {
                    Ok(Some(row)) => publish.send(change.map(|c| event(c, row.turns_done))),
                    // No goal: nothing to publish, the caller hears `None`.
                    Ok(None) => publish.send(None),
                    Err(_) => {} // the caller hears the error first
                }
                let _ = reply.send(r);
            }
            GoalMsg::Clear {
                session,
                publish,
                reply,
            } => {
                let r = store.goal_delete(session).await;
                if let Ok(cleared) = r {
                    st.turns.cleared(session);
                    st.unstored.replaced(session);
                    st.retries.succeeded(session);
                    publish.send(cleared.then_some((EventBody::GoalCleared, false)));
                }
                let _ = reply.send(r);
            }
            GoalMsg::Poll { session, reply } => {
                if st.unstored.end_waiting(session) {
                    // Its last turn counts first; the try again kicks it.
                    st.retries.waiting(session, reply.inbox());
                    reply.offer(None);
                    return Ok(());
                }
                let text = match store.goal_get(session).await {
                    Ok(row) => {
                        st.retries.succeeded(session);
                        let text = row.and_then(|row| to_core(&row).continuation());
                        if text.is_some() {
                            st.turns.offered(session);
                        }
                        text
                    }
                    Err(e) => {
                        tracing::error!(%session, error = %e, "cannot read a goal; the session looks again after a pause");
                        if let Some(pause) = st.retries.failed(session, reply.inbox()) {
                            myself.send_after(pause, move || GoalMsg::Retry(session));
                        }
                        None
                    }
                };
                reply.offer(text.map(Work::Goal));
            }
            GoalMsg::TurnEnded {
                session,
                loop_stopped,
                inbox,
            } => {
                // None: replaced or cleared meanwhile.
                if let Some(counts_as_stop) = st.turns.ended(session, loop_stopped) {
                    metrics::counter!(
                        "tiller_goal_turns_total",
                        "outcome" => if loop_stopped { "loop_stopped" } else { "end_turn" }
                    )
                    .increment(1);
                    let end = End::new(counts_as_stop);
                    end_turn(&myself, st, session, end, inbox, false).await;
                }
            }
            GoalMsg::Retry(session) => {
                let Some(inbox) = st.retries.due(session) else {
                    return Ok(());
                };
                match st.unstored.take_end(session) {
                    Some(end) => end_turn(&myself, st, session, end, inbox, true).await,
                    None => inbox.kick(),
                }
            }
            GoalMsg::Forget(session) => {
                st.turns.forget(session);
                st.unstored.replaced(session);
                st.retries.forget(session);
            }
        }
        Ok(())
    }
}

/// Counts an ended goal turn in the stored goal and publishes what changed.
/// A read or write the store fails keeps the end waiting (the goal offers
/// nothing meanwhile) and tries again after a pause; a try again that
/// stores it lets the session (its latest inbox) look for work. A try
/// again finds a write of the try before that landed though its answer
/// was lost ([`End::count`]): the turn counts once.
async fn end_turn(
    myself: &ActorRef<GoalMsg>,
    st: &mut GoalState,
    session: SessionId,
    mut end: End,
    inbox: Arc<dyn Inbox>,
    again: bool,
) {
    let stored = async {
        let Some(row) = st.store.goal_get(session).await? else {
            return Ok(None); // cleared meanwhile
        };
        let mut goal = to_core(&row);
        let change = match end.count(&mut goal) {
            Counted::Landed(change) => change,
            Counted::Write(change) => {
                end.trying(&goal, change);
                st.store.goal_put(to_row(session, &goal)).await?;
                change
            }
        };
        Ok::<_, StoreError>(Some((change, goal.turns_done)))
    };
    match stored.await {
        Ok(done) => {
            st.retries.succeeded(session);
            if let Some((Some(change), turns_done)) = done {
                let (body, kick) = event(change, turns_done);
                inbox.event(body, kick, None);
                return;
            }
            if again {
                inbox.kick(); // it was held back meanwhile
            }
        }
        Err(StoreError::SessionGone(_)) => {
            // Deleted meanwhile: nothing to count, nothing kept.
            st.turns.forget(session);
            st.retries.forget(session);
        }
        Err(e) => {
            st.unstored.end_waits(session, end);
            tracing::error!(%session, error = %e, "cannot count a goal turn; tried again after a pause");
            if let Some(pause) = st.retries.failed(session, Some(inbox)) {
                myself.send_after(pause, move || GoalMsg::Retry(session));
            }
        }
    }
}

/// The event a goal change is published as, and whether the session
/// should look for work afterwards (a resumed goal has turns to offer).
fn event(change: GoalChange, turns_done: u32) -> (EventBody, bool) {
    match change {
        GoalChange::Paused(reason) => (
            EventBody::GoalPaused {
                reason: reason.as_str().into(),
                turns_done,
            },
            false,
        ),
        GoalChange::Resumed => (EventBody::GoalResumed, true),
        GoalChange::Completed => (EventBody::GoalCompleted { turns_done }, false),
    }
}

/// Applies `f` to a stored goal; `None` when the session has none.
async fn update(
    store: &Store,
    session: SessionId,
    f: impl FnOnce(&mut Goal),
) -> Result<Option<GoalRow>, StoreError> {
    let Some(row) = store.goal_get(session).await? else {
        return Ok(None);
    };
    let mut goal = to_core(&row);
    f(&mut goal);
    let row = to_row(session, &goal);
    store.goal_put(row.clone()).await?;
    Ok(Some(row))
}

impl WorkQueue for ActorRef<GoalMsg> {
    fn origin(&self) -> Origin {
        Origin::Goal
    }

    fn poll(&self, session: SessionId, reply: PollReply) {
        // Not sent (the queue stopped): the reply, dropped, answers.
        let _ = self.send_message(GoalMsg::Poll { session, reply });
    }

    fn turn_ended(&self, session: SessionId, loop_stopped: bool, inbox: Arc<dyn Inbox>) {
        let _ = self.send_message(GoalMsg::TurnEnded {
            session,
            loop_stopped,
            inbox,
        });
    }

    fn forget(&self, session: SessionId) {
        let _ = self.send_message(GoalMsg::Forget(session));
    }
}
