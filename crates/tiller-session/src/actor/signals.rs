//! The engine's signals on their way to the session. They queue here in
//! the order sent, and the mailbox holds one [`SessionMsg::Signals`] for
//! any run of them: a burst (a scripted reply, a model's chunks read in one
//! go) costs the actor one message, not one per signal.
//!
//! At most one such message is in the mailbox, exactly while the queue is
//! not empty: the sender rings when the queue becomes non-empty, and the
//! session, which takes at most [`RUN`] signals a message, rings again
//! when it leaves some.
//!
//! Order: with a message per signal, a signal sent after a client's
//! message (a cancel, a steer) was handled after it. A run would take it
//! ahead: so each signal is stamped with how many messages the session's
//! handles had sent ([`Slot`]), each ring with the same count, and a run
//! stops at the first signal stamped after its ring (the session rings
//! again, behind those messages). Stamps and rings are taken under the
//! slot's lock, which a message holds from its count to its place in the
//! mailbox (or in the slot's queue while the session is asked to park: a
//! ring then queues there too, behind it): a ring's count covers exactly
//! the messages ahead of it. A signal may wait behind a message sent after
//! it, never go ahead of one sent before it: a cancel still wins over a
//! result sent after it.
//!
//! [`SessionMsg::Signals`]: super::SessionMsg::Signals

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ractor::ActorRef;
use tiller_engine::{Budget, EngineSignal, Pace};

use super::SessionMsg;
use crate::handle::{Slot, SlotState};

/// Puts a ring behind every message counted so far: in the slot's queue
/// while the session is asked to park (the queue goes to the mailbox
/// first if it stays), else in the session's mailbox (a stopped session
/// drops it: its engine's signals are then stale).
fn ring(slot: &mut SlotState, session: &ActorRef<SessionMsg>) {
    match slot {
        SlotState::Parking(held) => held.push(SessionMsg::Signals),
        _ => {
            let _ = session.send_message(SessionMsg::Signals);
        }
    }
}

/// Most signals the session handles for one message.
pub(super) const RUN: usize = 32;

/// A session's queue of signals, and its engines' backpressure.
#[derive(Debug)]
pub(super) struct Signals {
    /// Counts each signal in ([`Signals::push`]) and out (the session).
    pub(super) pace: Arc<Pace>,
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    /// Signals with the count of messages sent when each was.
    signals: VecDeque<(u64, EngineSignal)>,
    /// The count when the message in the mailbox was sent.
    rung: u64,
}

impl Signals {
    /// Within the daemon's `budget`.
    pub(super) fn new(budget: &Arc<Budget>) -> Signals {
        Signals {
            pace: Arc::new(Pace::new(budget.clone())),
            queue: Mutex::new(Queue::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // Nothing panics while holding it.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine's side: queues `sig`, ringing `session` when the queue
    /// was empty.
    pub(super) fn send(&self, sig: EngineSignal, slot: &Slot, session: &ActorRef<SessionMsg>) {
        let mut state = slot.lock();
        if self.push(sig, slot.sent()) {
            ring(&mut state, session);
        }
    }

    /// The session's side, at a ring: the next run, ringing again when
    /// signals are left.
    pub(super) fn next_run(
        &self,
        slot: &Slot,
        session: &ActorRef<SessionMsg>,
    ) -> Vec<EngineSignal> {
        let mut state = slot.lock();
        let (run, more) = self.take(slot.sent());
        if more {
            ring(&mut state, session);
        }
        run
    }

    /// No signal waits.
    pub(super) fn is_empty(&self) -> bool {
        self.lock().signals.is_empty()
    }

    /// Queues `sig`, sent when `sent` messages had been: true when the
    /// caller must ring (the queue was empty).
    fn push(&self, sig: EngineSignal, sent: u64) -> bool {
        self.pace.sent();
        let mut q = self.lock();
        q.signals.push_back((sent, sig));
        let ring = q.signals.len() == 1;
        if ring {
            q.rung = sent;
        }
        ring
    }

    /// Takes the next run, oldest first, now that `sent` messages have
    /// been: true with it when signals are left (the caller rings again).
    fn take(&self, sent: u64) -> (Vec<EngineSignal>, bool) {
        let mut q = self.lock();
        let rung = q.rung;
        let n = q
            .signals
            .iter()
            .take(RUN)
            .take_while(|(stamp, _)| *stamp <= rung)
            .count();
        let run = q.signals.drain(..n).map(|(_, s)| s).collect();
        let more = !q.signals.is_empty();
        if more {
            q.rung = sent;
        } else if q.signals.capacity() > RUN {
            // A burst's room is not kept by a session that goes idle.
            q.signals = VecDeque::new();
        }
        (run, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tiller_core::TurnId;
    use tiller_engine::SignalKind;

    /// What is in the mailbox.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Mail {
        /// A handle's message, numbered from 1.
        Message(u64),
        Ring,
    }

    /// The session's side: its mailbox and what it handled.
    #[derive(Default)]
    struct Session {
        mailbox: VecDeque<Mail>,
        /// Messages sent through the handles.
        sent: u64,
        /// Messages handled.
        handled: u64,
        /// Per signal: the messages sent before it.
        before: Vec<u64>,
        /// Signals handled.
        got: Vec<u64>,
    }

    impl Session {
        fn rings(&self) -> usize {
            self.mailbox.iter().filter(|m| **m == Mail::Ring).count()
        }

        /// Handles the next message.
        fn handle(&mut self, s: &Signals) -> Result<(), TestCaseError> {
            match self.mailbox.pop_front() {
                Some(Mail::Message(n)) => {
                    prop_assert_eq!(n, self.handled + 1);
                    self.handled = n;
                }
                Some(Mail::Ring) => {
                    let (run, more) = s.take(self.sent);
                    prop_assert!(run.len() <= RUN);
                    for sig in run {
                        let i = sig.turn.0 as usize;
                        prop_assert!(
                            self.before[i] <= self.handled,
                            "signal {} handled before message {}",
                            i,
                            self.before[i]
                        );
                        self.got.push(i as u64);
                    }
                    if more {
                        self.mailbox.push_back(Mail::Ring);
                    } else {
                        prop_assert!(s.lock().signals.capacity() <= RUN, "a burst's room kept");
                    }
                }
                None => {}
            }
            Ok(())
        }
    }

    /// A session that records the rings it is sent.
    struct Rings(Arc<Mutex<usize>>);

    impl ractor::Actor for Rings {
        type Msg = SessionMsg;
        type State = ();
        type Arguments = ();

        async fn pre_start(
            &self,
            _: ActorRef<SessionMsg>,
            (): (),
        ) -> Result<(), ractor::ActorProcessingErr> {
            Ok(())
        }

        async fn handle(
            &self,
            _: ActorRef<SessionMsg>,
            msg: SessionMsg,
            (): &mut (),
        ) -> Result<(), ractor::ActorProcessingErr> {
            if matches!(msg, SessionMsg::Signals) {
                *self.0.lock().unwrap() += 1;
            }
            Ok(())
        }
    }

    /// While the session is asked to park, the messages sent to it wait
    /// in the slot's queue: a ring waits there too, behind them, not in
    /// the mailbox ahead of them.
    #[tokio::test]
    async fn a_ring_waits_behind_the_messages_held_while_parking() {
        let rung = Arc::new(Mutex::new(0));
        let (session, task) = ractor::Actor::spawn(None, Rings(rung.clone()), ())
            .await
            .unwrap();
        let mut parking = SlotState::Parking(vec![SessionMsg::Cancel]);
        ring(&mut parking, &session);
        let SlotState::Parking(held) = &parking else {
            unreachable!()
        };
        assert!(matches!(
            held[..],
            [SessionMsg::Cancel, SessionMsg::Signals]
        ));
        let mut running = SlotState::Running(session.clone());
        ring(&mut running, &session);
        // Handles what its mailbox holds, then stops.
        session.drain().unwrap();
        task.await.unwrap();
        assert_eq!(*rung.lock().unwrap(), 1, "the running session's ring");
    }

    proptest! {
        /// Under any interleaving of signals, handles' messages and the
        /// session handling its mailbox: every signal is handled once, in
        /// order, and none before a message sent before it; one ring is in
        /// the mailbox exactly while signals wait; no run is longer than
        /// `RUN`; an emptied queue keeps no burst's room; once nothing
        /// more is sent, the mailbox empties.
        #[test]
        fn signals_arrive_once_in_order_and_never_before_an_earlier_message(
            steps in proptest::collection::vec(0..7u8, 1..400),
        ) {
            let s = Signals::new(&Arc::new(Budget::default()));
            let mut m = Session::default();
            for step in steps {
                match step {
                    // One signal, or a burst of them.
                    0 | 1 | 6 => {
                        for _ in 0..if step == 6 { RUN + 9 } else { 1 } {
                            let n = m.before.len() as u64;
                            m.before.push(m.sent);
                            let sig = EngineSignal { turn: TurnId(n), kind: SignalKind::Idle };
                            if s.push(sig, m.sent) {
                                m.mailbox.push_back(Mail::Ring);
                            }
                        }
                    }
                    2 => {
                        m.sent += 1;
                        m.mailbox.push_back(Mail::Message(m.sent));
                    }
                    _ => m.handle(&s)?,
                }
                prop_assert!(m.rings() <= 1);
                prop_assert_eq!(m.rings() == 1, m.got.len() != m.before.len());
            }
            let signals = m.before.len();
            let mut bound = m.mailbox.len() + 2 * (signals / RUN + 2);
            while !m.mailbox.is_empty() {
                prop_assert!(bound > 0, "the mailbox does not empty");
                bound -= 1;
                m.handle(&s)?;
            }
            prop_assert_eq!(m.got, (0..signals as u64).collect::<Vec<_>>());
            prop_assert_eq!(s.pace.backlog(), signals);
        }
    }
}
