//! The engine's signals on their way to the session. They queue here in
//! the order sent, and the mailbox holds one [`SessionMsg::Signals`] for
//! any run of them: a burst (a scripted reply, a model's chunks read in one
//! go) costs the actor one message, not one per signal.
//!
//! At most one such message is in the mailbox, exactly while the queue is
//! not empty: the sender rings when the queue becomes non-empty, and the
//! session, which takes at most [`RUN`] signals a message, rings again
//! when it leaves some (other messages are handled between runs).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tiller_engine::{Budget, EngineSignal, Pace};

/// Most signals the session handles for one message.
pub(super) const RUN: usize = 32;

/// A session's queue of signals, and its engines' backpressure.
#[derive(Debug)]
pub(super) struct Signals {
    /// Counts each signal in ([`Signals::push`]) and out (the session).
    pub(super) pace: Arc<Pace>,
    queue: Mutex<VecDeque<EngineSignal>>,
}

impl Signals {
    /// Within the daemon's `budget`.
    pub(super) fn new(budget: &Arc<Budget>) -> Signals {
        Signals {
            pace: Arc::new(Pace::new(budget.clone())),
            queue: Mutex::new(VecDeque::new()),
        }
    }

    /// Queues `sig`: true when the caller must ring (the queue was empty).
    pub(super) fn push(&self, sig: EngineSignal) -> bool {
        self.pace.sent();
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back(sig);
        q.len() == 1
    }

    /// Takes the next run, oldest first: true with it when signals are
    /// left (the caller rings again).
    pub(super) fn take(&self) -> (Vec<EngineSignal>, bool) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let n = q.len().min(RUN);
        let run = q.drain(..n).collect();
        (run, !q.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tiller_core::TurnId;
    use tiller_engine::SignalKind;

    fn signal(n: u64) -> EngineSignal {
        EngineSignal {
            turn: TurnId(n),
            kind: SignalKind::Idle,
        }
    }

    proptest! {
        /// Under any interleaving of sends and takes, the session gets
        /// every signal once, in order; one message is in the mailbox
        /// exactly while signals wait; no run is longer than `RUN`.
        #[test]
        fn every_signal_arrives_once_in_order_with_one_ring_pending(
            steps in proptest::collection::vec(0..4u8, 1..400),
        ) {
            let s = Signals::new(&Arc::new(Budget::default()));
            let (mut sent, mut got, mut rings) = (0u64, Vec::new(), 0usize);
            for step in steps {
                if step < 3 {
                    rings += usize::from(s.push(signal(sent)));
                    sent += 1;
                } else if rings > 0 {
                    rings -= 1; // the session handles the message
                    let (run, more) = s.take();
                    prop_assert!(!run.is_empty() && run.len() <= RUN);
                    got.extend(run.iter().map(|g| g.turn.0));
                    rings += usize::from(more);
                }
                prop_assert!(rings <= 1);
                prop_assert_eq!(rings == 1, got.len() as u64 != sent);
            }
            while rings > 0 {
                rings -= 1;
                let (run, more) = s.take();
                got.extend(run.iter().map(|g| g.turn.0));
                rings += usize::from(more);
            }
            prop_assert_eq!(got, (0..sent).collect::<Vec<_>>());
            prop_assert_eq!(s.pace.backlog(), sent as usize);
        }
    }
}
