//! The core's wake-up timer (`Effect::ArmTimer`), carried out with at
//! most one timer per session, moved later lazily.
//!
//! The core asks for a new deadline with nearly every turn (its stall
//! bound moves with each signal, and is dropped when the turn ends).
//! Starting a timer task for each request and aborting the previous one
//! cost a task spawn, a wheel entry and an abort per prompt. Instead a
//! running timer that fires no later than the deadline asked for is kept;
//! when it fires before the deadline (it was moved later meanwhile, or
//! dropped), the core is not woken and a timer for the deadline starts
//! then. Waking the core early would be harmless (it checks every
//! deadline against the clock), but it would not ask again for a deadline
//! it already asked for, so the deadline is kept here. A timer replaced by
//! one for an earlier deadline is aborted, and its tick, if already sent,
//! is told apart by its generation.

use std::time::Duration;

use ractor::ActorRef;
use tiller_core::Millis;

use super::SessionMsg;

/// The deadline bookkeeping, without the timer task (pure, tested below).
#[derive(Debug, Default)]
struct Deadline {
    /// The deadline the core asked for last.
    want: Option<Millis>,
    /// The running timer: when it fires, and its generation.
    set: Option<(Millis, u64)>,
    /// The last generation started.
    generation: u64,
}

impl Deadline {
    /// `ArmTimer { at }`: the timer to start (when, and its generation)
    /// unless the running one fires in time.
    fn arm(&mut self, at: Option<Millis>) -> Option<(Millis, u64)> {
        self.want = at;
        let at = at?;
        match self.set {
            Some((fires, _)) if fires <= at => None,
            _ => Some(self.start(at)),
        }
    }

    /// Timer `generation` fired at `now`: whether to wake the core, and a
    /// timer to start (the deadline moved later meanwhile).
    fn fired(&mut self, generation: u64, now: Millis) -> (bool, Option<(Millis, u64)>) {
        if self.set.map(|(_, g)| g) != Some(generation) {
            return (false, None); // a replaced timer's tick, sent before it was aborted
        }
        self.set = None;
        match self.want {
            Some(w) if w > now => (false, Some(self.start(w))),
            Some(_) => (true, None),
            None => (false, None),
        }
    }

    fn start(&mut self, at: Millis) -> (Millis, u64) {
        self.generation += 1;
        self.set = Some((at, self.generation));
        (at, self.generation)
    }
}

/// The session's wake-up timer.
#[derive(Default)]
pub(super) struct Wake {
    deadline: Deadline,
    timer: Option<tokio::task::JoinHandle<Result<(), ractor::MessagingErr<SessionMsg>>>>,
}

impl Wake {
    /// Carries out `ArmTimer { at }` at `now`.
    pub(super) fn arm(&mut self, myself: &ActorRef<SessionMsg>, now: Millis, at: Option<Millis>) {
        if let Some(start) = self.deadline.arm(at) {
            self.start(myself, now, start);
        }
    }

    /// Timer `generation` fired at `now`: whether the core is to be woken.
    pub(super) fn fired(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        generation: u64,
        now: Millis,
    ) -> bool {
        let (wake, start) = self.deadline.fired(generation, now);
        if let Some(start) = start {
            self.start(myself, now, start);
        }
        wake
    }

    /// No deadline is wanted (a timer may still run: it wakes no one).
    pub(super) fn idle(&self) -> bool {
        self.deadline.want.is_none()
    }

    /// Stops the timer (the actor stops).
    pub(super) fn stop(&mut self) {
        if let Some(t) = self.timer.take() {
            t.abort();
        }
    }

    fn start(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        now: Millis,
        (at, generation): (Millis, u64),
    ) {
        self.stop();
        let delay = Duration::from_millis(at.saturating_sub(now));
        self.timer = Some(myself.send_after(delay, move || SessionMsg::Tick(generation)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// The core asks for a deadline this far ahead (or none).
        Arm(Option<Millis>),
        /// Time passes; a timer due by then fires (ticks arrive in order),
        /// at its time or, `late`, only at the end.
        Pass { by: Millis, late: bool },
        /// A replaced timer's tick arrives late.
        Stale,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            proptest::option::of(0..50u64).prop_map(Op::Arm),
            (0..30u64, any::<bool>()).prop_map(|(by, late)| Op::Pass { by, late }),
            Just(Op::Stale),
        ]
    }

    proptest! {
        /// Whatever the core asks, when: while it waits for a deadline a
        /// timer runs that fires by then; it is woken once the deadline is
        /// reached, never before; a timer starts only when none runs, for a
        /// deadline earlier than the running one's, or when one fired
        /// early; a replaced timer's tick changes nothing.
        #[test]
        fn the_core_is_woken_at_its_deadline_never_before_and_never_missed(
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let mut d = Deadline::default();
            let mut now: Millis = 0;
            let mut replaced: Vec<u64> = Vec::new();
            // Woken for the deadline it asked for last.
            let mut woken = false;
            for op in ops {
                match op {
                    Op::Arm(ahead) => {
                        let before = d.set;
                        let want = ahead.map(|a| now + a);
                        woken = false;
                        if let Some((at, g)) = d.arm(want) {
                            prop_assert_eq!(Some(at), want);
                            prop_assert!(before.is_none_or(|(fires, _)| fires > at));
                            if let Some((_, old)) = before {
                                replaced.push(old);
                            }
                            prop_assert!(g > before.map_or(0, |(_, old)| old));
                        }
                    }
                    Op::Pass { by, late } => {
                        now += by;
                        while let Some((fires, g)) = d.set.filter(|(fires, _)| *fires <= now) {
                            let at = if late { now } else { fires };
                            let want = d.want;
                            let (wake, start) = d.fired(g, at);
                            prop_assert_eq!(wake, want.is_some_and(|w| w <= at));
                            prop_assert_eq!(start.map(|(s, _)| s), want.filter(|w| *w > at));
                            woken |= wake;
                        }
                    }
                    Op::Stale => {
                        if let Some(g) = replaced.pop() {
                            let set = d.set;
                            prop_assert_eq!(d.fired(g, now), (false, None));
                            prop_assert_eq!(d.set, set);
                        }
                    }
                }
                if let Some(w) = d.want.filter(|_| !woken) {
                    prop_assert!(d.set.is_some_and(|(fires, _)| fires <= w));
                }
            }
        }
    }

    #[test]
    fn a_deadline_moved_later_keeps_the_timer_and_restarts_it_when_it_fires() {
        let mut d = Deadline::default();
        let (at, g) = d.arm(Some(100)).expect("a timer starts");
        assert_eq!(at, 100);
        assert_eq!(d.arm(Some(150)), None, "the running timer fires in time");
        assert_eq!(d.arm(None), None);
        assert_eq!(d.arm(Some(200)), None);
        assert_eq!(d.fired(g, 100), (false, Some((200, g + 1))));
        assert_eq!(d.fired(g + 1, 200), (true, None));
        assert_eq!(d.arm(Some(300)).map(|(at, _)| at), Some(300));
        assert_eq!(
            d.arm(Some(250)).map(|(at, _)| at),
            Some(250),
            "an earlier deadline replaces it"
        );
    }
}
