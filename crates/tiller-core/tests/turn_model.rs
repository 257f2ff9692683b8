//! Property model of the session turn core.
//!
//! Random interleavings of prompts, steers, cancels, every engine signal
//! (current, stale, duplicated, out of order), receipts and timer firings.
//! After every step the five invariants of `turn-lifecycle.md` are checked,
//! and a silent-engine drain proves that nothing can park.
//!
//! Cases: `PROPTEST_CASES` (default 10,000 here). Long run:
//! `PROPTEST_CASES=1000000 cargo test --release -p tiller-core --test turn_model`.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use tiller_core::{
    Answer, Effect, ErrorKind, IdleBehavior, LoopType, Millis, Origin, PromptId, Signal, SteerId,
    SteerOutcome, SteerReceipt, StopReason, Terminal, TurnConfig, TurnId,
};

/// The core under test carries each prompt's id as its payload and each
/// steer's id as its text, so every hand-back can be checked.
type SessionCore = tiller_core::SessionCore<PromptId, SteerId>;
type Input = tiller_core::Input<PromptId, SteerId>;

const CFG: TurnConfig = TurnConfig {
    steer_receipt_timeout: 50,
    cancel_grace: 20,
    stall_timeout: 400,
    max_queued_prompts: 3,
    max_turn_events: 5,
};

#[derive(Clone, Debug)]
enum SigKind {
    Update,
    ToolBatch,
    Result(StopReason),
    Idle,
    Failed,
    /// The engine's task ended (panicked when true).
    Exited(bool),
    /// A receipt for the n-th steer ever sent (may be unknown or settled).
    Receipt(usize, bool),
}

#[derive(Clone, Debug)]
enum Which {
    Current,
    /// A turn `n` behind the newest (stale unless n == 0).
    Behind(u64),
    /// A turn from the future (never valid).
    Ahead,
}

#[derive(Clone, Debug)]
enum Step {
    Prompt(Origin),
    Steer {
        start_new: bool,
    },
    Cancel,
    /// The session closes (or the daemon drains).
    Close,
    Signal(Which, SigKind),
    /// The tool pipeline's loop guard trips in a turn.
    LoopTrip(Which, LoopType),
    /// The tool pipeline finished a call of a turn.
    ToolProgress(Which),
    /// A queue actor says work may be waiting.
    Kick,
    /// A queue actor answers the last poll (or, when `stale`, an older one).
    Offer(Origin, bool, bool),
    /// Repeat the last signal as is.
    Duplicate,
    Advance(Millis),
}

struct Model;

impl ReferenceStateMachine for Model {
    type State = ();
    type Transition = Step;

    fn init_state() -> BoxedStrategy<()> {
        Just(()).boxed()
    }

    fn transitions(_: &()) -> BoxedStrategy<Step> {
        let stop = prop_oneof![
            Just(StopReason::EndTurn),
            Just(StopReason::MaxTokens),
            Just(StopReason::Refusal),
        ];
        let kind = prop_oneof![
            3 => Just(SigKind::Update),
            1 => Just(SigKind::ToolBatch),
            3 => stop.prop_map(SigKind::Result),
            3 => Just(SigKind::Idle),
            1 => Just(SigKind::Failed),
            1 => any::<bool>().prop_map(SigKind::Exited),
            3 => (0usize..8, any::<bool>()).prop_map(|(n, c)| SigKind::Receipt(n, c)),
        ];
        let which = prop_oneof![
            8 => Just(Which::Current),
            2 => (1u64..3).prop_map(Which::Behind),
            1 => Just(Which::Ahead),
        ];
        let origin = prop_oneof![
            8 => Just(Origin::Interactive),
            1 => Just(Origin::Cron),
            1 => Just(Origin::Notification),
            1 => Just(Origin::Channel),
            1 => Just(Origin::Goal),
        ];
        let loop_type = prop_oneof![
            Just(LoopType::ConsecutiveIdenticalToolCalls),
            Just(LoopType::RepeatedToolFailure),
            Just(LoopType::TurnToolCallCap),
        ];
        prop_oneof![
            4 => origin.prop_map(Step::Prompt),
            3 => any::<bool>().prop_map(|start_new| Step::Steer { start_new }),
            2 => Just(Step::Cancel),
            1 => Just(Step::Close),
            10 => (which.clone(), kind).prop_map(|(w, k)| Step::Signal(w, k)),
            2 => (which.clone(), loop_type).prop_map(|(w, t)| Step::LoopTrip(w, t)),
            2 => which.prop_map(Step::ToolProgress),
            1 => Just(Step::Duplicate),
            1 => Just(Step::Kick),
            4 => (prop_oneof![Just(Origin::Goal), Just(Origin::Notification), Just(Origin::Cron)], any::<bool>(), prop::bool::weighted(0.2))
                .prop_map(|(o, some, stale)| Step::Offer(o, some, stale)),
            3 => prop_oneof![1u64..30, 30u64..500].prop_map(Step::Advance),
        ]
        .boxed()
    }

    fn apply(_: (), _: &Step) {}
}

/// The core under test plus everything the invariants need to remember.
#[derive(Clone)]
struct Sut {
    core: SessionCore,
    now: Millis,
    next_id: u128,
    /// Admitted prompts (queued or started).
    admitted: HashSet<PromptId>,
    /// Refused prompts: they must never get a terminal.
    rejected: HashSet<PromptId>,
    /// Terminal(s) seen per prompt.
    terminals: HashMap<PromptId, Vec<Terminal>>,
    /// Prompts whose turn had a cancel before it settled.
    cancel_first: HashSet<PromptId>,
    /// Every turn that has settled.
    settled_turns: HashSet<TurnId>,
    /// Turn id per started prompt.
    turn_of: HashMap<PromptId, TurnId>,
    /// Steers sent, in order.
    steers: Vec<SteerId>,
    /// The last signal fed, for `Duplicate`.
    last_signal: Option<(TurnId, Signal)>,
    /// Origin per admitted prompt.
    origins: HashMap<PromptId, Origin>,
    /// The loop trip that a running (not cancelling) turn received.
    tripped: HashMap<PromptId, LoopType>,
    /// Work offered by queue actors: started, or handed back, exactly once.
    offered: HashSet<PromptId>,
    handed_back: HashSet<PromptId>,
    /// The index of the last queue polled in the current idle round.
    round: Option<usize>,
    /// The id of the last poll.
    last_poll: u64,
    /// Queues that answered "nothing" since the last kick: the only ones
    /// a round may skip.
    empty: HashSet<Origin>,
    /// A kick arrived during the current round: another round may follow.
    kicked_in_round: bool,
    /// A close was fed: nothing may start (or be polled) after it.
    closed: bool,
}

/// The automatic queues, in admission order.
const AUTO: [Origin; 3] = [Origin::Goal, Origin::Notification, Origin::Cron];

impl Sut {
    fn new() -> Self {
        Self {
            core: SessionCore::new(CFG, 0).with_automatic(AUTO.to_vec()),
            now: 0,
            next_id: 1,
            admitted: HashSet::new(),
            rejected: HashSet::new(),
            terminals: HashMap::new(),
            cancel_first: HashSet::new(),
            settled_turns: HashSet::new(),
            turn_of: HashMap::new(),
            steers: Vec::new(),
            last_signal: None,
            origins: HashMap::new(),
            tripped: HashMap::new(),
            offered: HashSet::new(),
            handed_back: HashSet::new(),
            round: None,
            last_poll: 0,
            empty: HashSet::new(),
            kicked_in_round: false,
            closed: false,
        }
    }

    /// The turn a step aims at.
    fn turn_of(&self, which: Which) -> TurnId {
        let newest = self.current_turn().0;
        TurnId(match which {
            Which::Current => newest,
            Which::Behind(n) => newest.saturating_sub(n),
            Which::Ahead => newest + 1,
        })
    }

    fn fresh(&mut self) -> u128 {
        self.next_id += 1;
        self.next_id
    }

    /// Feeds the core and checks the per-batch invariants.
    fn feed(&mut self, input: Input) {
        let stale_target = match &input {
            Input::Signal { turn, .. } | Input::LoopTrip { turn, .. }
                if self.core.active().map(|(_, t)| t) != Some(*turn) =>
            {
                Some(*turn)
            }
            _ => None,
        };
        if matches!(input, Input::Cancel)
            && let Some((p, _)) = self.core.active()
        {
            self.cancel_first.insert(p);
        }
        if let Input::LoopTrip { turn, loop_type } = &input
            && let Some((p, t)) = self.core.active()
            && t == *turn
            && !self.core.is_cancelling()
        {
            self.tripped.insert(p, *loop_type);
        }
        // A kick while not polling starts a new round from the first queue;
        // during one, it may bring another.
        if matches!(input, Input::Kick) {
            self.empty.clear();
            if self.core.is_polling() {
                self.kicked_in_round = true;
            } else {
                self.round = None;
            }
        }
        // An empty answer to the current poll, with no kick since, marks
        // its queue empty.
        if let Input::Offer {
            origin,
            poll,
            work: None,
        } = &input
            && *poll == self.last_poll
            && self.core.is_polling()
            && !self.kicked_in_round
        {
            self.empty.insert(*origin);
        }
        if let Input::Prompt { prompt, origin, .. } = &input {
            self.origins.insert(*prompt, *origin);
        }
        if matches!(input, Input::Close) {
            if let Some((p, _)) = self.core.active() {
                self.cancel_first.insert(p);
            }
            // Queued prompts settle `cancelled` at the close.
            self.cancel_first.extend(self.core.queued());
            self.closed = true;
        }
        // The prompt the input would admit, if any.
        let asking = match &input {
            Input::Prompt { prompt, .. }
            | Input::Steer {
                idle_behavior: IdleBehavior::StartNewTurn(prompt, _),
                ..
            }
            | Input::Offer {
                work: Some((prompt, _)),
                ..
            } => Some(*prompt),
            _ => None,
        };
        let step = self.core.on(self.now, input);
        let fx = step.effects;
        match step.answer {
            Answer::None | Answer::Started { .. } => {}
            Answer::Queued { .. } => {
                let prompt = asking.expect("only a prompt queues");
                assert!(self.admitted.insert(prompt));
            }
            Answer::Rejected { payload, .. } => {
                let prompt = asking.expect("only a prompt is refused");
                assert_eq!(payload, prompt, "its own payload comes back");
                assert!(!self.admitted.contains(&prompt));
                self.rejected.insert(prompt);
            }
            Answer::Steer { outcome, unused } => {
                if let SteerOutcome::StartedNewTurn { prompt } = outcome {
                    assert_eq!(Some(prompt), asking);
                    assert_eq!(unused, None);
                    self.admitted.insert(prompt);
                } else {
                    assert_eq!(unused, asking, "an unused payload comes back");
                }
            }
            Answer::OfferRefused {
                prompt, payload, ..
            } => {
                assert_eq!(Some(prompt), asking);
                assert_eq!(payload, prompt);
                assert!(self.offered.contains(&prompt));
                assert!(!self.turn_of.contains_key(&prompt), "refused after start");
                assert!(self.handed_back.insert(prompt), "handed back twice");
            }
        }
        if self.closed {
            // Closing: nothing starts, nothing is polled, nothing queues.
            assert!(
                !fx.iter()
                    .any(|e| matches!(e, Effect::StartTurn { .. } | Effect::Poll { .. })),
                "work after the close: {fx:?}"
            );
            assert_eq!(self.core.queued().count(), 0, "queued after the close");
        }

        if let Some(turn) = stale_target {
            // Invariant 2: a signal for any other turn changes nothing.
            assert!(
                fx.iter().all(|e| matches!(
                    e,
                    Effect::Stale { .. }
                        | Effect::Settled { .. }
                        | Effect::StartTurn { .. }
                        | Effect::Idle
                        | Effect::AbortEngine { .. }
                        | Effect::WatchdogFired { .. }
                        | Effect::SteerDropped { .. }
                        | Effect::ArmTimer { .. }
                )),
                "stale signal produced {fx:?}"
            );
            assert!(fx.contains(&Effect::Stale { turn }));
        }

        for (i, e) in fx.iter().enumerate() {
            match e {
                Effect::StartTurn { prompt, turn, .. } => {
                    self.admitted.insert(*prompt);
                    assert!(
                        self.turn_of.insert(*prompt, *turn).is_none(),
                        "started twice"
                    );
                    assert!(
                        !self.handed_back.contains(prompt),
                        "started after hand-back"
                    );
                    self.round = None;
                    self.kicked_in_round = false;
                }
                Effect::Poll { origin, poll } => {
                    assert!(*poll > self.last_poll, "poll ids grow");
                    self.last_poll = *poll;
                    // Admission order: the queues are polled in order, each
                    // only after the ones before had nothing; a queue known
                    // empty (no kick since) is skipped.
                    let k = AUTO
                        .iter()
                        .position(|o| o == origin)
                        .expect("a known queue");
                    let from = match self.round {
                        Some(r) if k <= r => {
                            assert!(
                                std::mem::take(&mut self.kicked_in_round),
                                "a new round without a kick: {fx:?}"
                            );
                            0
                        }
                        Some(r) => r + 1,
                        None => 0,
                    };
                    for skipped in &AUTO[from..k] {
                        assert!(
                            self.empty.contains(skipped),
                            "skipped {skipped:?}, which may have work: {fx:?}"
                        );
                    }
                    assert!(self.core.active().is_none(), "polled while busy");
                    self.round = Some(k);
                }
                Effect::ForwardSteer { steer, text, .. }
                | Effect::SteerConsumed { steer, text, .. }
                | Effect::SteerDropped { steer, text, .. } => {
                    assert_eq!(steer, text, "a steer's own payload comes back");
                }
                Effect::Settled {
                    prompt,
                    turn,
                    terminal,
                    payload,
                    ..
                } => {
                    assert_eq!(prompt, payload, "a prompt's own payload comes back");
                    assert!(
                        self.admitted.contains(prompt),
                        "terminal for unadmitted prompt"
                    );
                    self.terminals
                        .entry(*prompt)
                        .or_default()
                        .push(terminal.clone());
                    if let Some(t) = turn {
                        assert!(self.settled_turns.insert(*t));
                    }
                    // Invariant 5: cancellation wins.
                    if self.cancel_first.contains(prompt) {
                        assert_eq!(*terminal, Terminal::Completed(StopReason::Cancelled));
                    }
                    // Loop protection: terminal by origin.
                    if let Some(lt) = self.tripped.get(prompt) {
                        let origin = self
                            .origins
                            .get(prompt)
                            .copied()
                            .unwrap_or(Origin::Interactive);
                        if origin == Origin::Interactive {
                            assert_eq!(*terminal, Terminal::failed(ErrorKind::LoopDetected(*lt)));
                        } else {
                            assert_eq!(*terminal, Terminal::Completed(StopReason::EndTurn));
                            assert!(
                                fx[..i].iter().any(|e| matches!(e, Effect::LoopStopped { loop_type, .. } if loop_type == lt)),
                                "loop_stopped before the terminal: {fx:?}"
                            );
                        }
                    }
                    // Invariant 4: a terminal is followed by the next start or Idle.
                    if turn.is_some() {
                        let rest = &fx[i + 1..];
                        assert!(
                            rest.iter()
                                .any(|e| matches!(e, Effect::StartTurn { .. } | Effect::Idle)),
                            "terminal not followed by start or idle: {fx:?}"
                        );
                    }
                }
                Effect::Idle => {
                    self.round = None;
                    self.kicked_in_round = false;
                    assert!(self.core.active().is_none(), "idle while a turn runs");
                    assert_eq!(self.core.queued().count(), 0, "idle with queued prompts");
                }
                Effect::Deliver { turn } => {
                    assert!(!self.settled_turns.contains(turn));
                }
                _ => {}
            }
        }
        // Invariant 1 (at most one): never two terminals for one prompt.
        for (p, t) in &self.terminals {
            assert_eq!(t.len(), 1, "prompt {p:?} got {t:?}");
        }
    }

    fn current_turn(&self) -> TurnId {
        self.core.last_turn()
    }
}

struct TurnCoreTest;

impl StateMachineTest for TurnCoreTest {
    type SystemUnderTest = Sut;
    type Reference = Model;

    fn init_test(_: &()) -> Sut {
        Sut::new()
    }

    fn apply(mut sut: Sut, _: &(), step: Step) -> Sut {
        match step {
            Step::Prompt(origin) => {
                let prompt = PromptId::from_u128(sut.fresh());
                sut.feed(Input::Prompt {
                    prompt,
                    origin,
                    payload: prompt,
                });
            }
            Step::Steer { start_new } => {
                let steer = SteerId::from_u128(sut.fresh());
                sut.steers.push(steer);
                let idle_behavior = if start_new {
                    let p = PromptId::from_u128(sut.fresh());
                    IdleBehavior::StartNewTurn(p, p)
                } else {
                    IdleBehavior::PromptRequired
                };
                sut.feed(Input::Steer {
                    steer,
                    text: steer,
                    idle_behavior,
                });
            }
            Step::Cancel => sut.feed(Input::Cancel),
            Step::Close => sut.feed(Input::Close),
            Step::Signal(which, kind) => {
                let turn = sut.turn_of(which);
                let signal = match kind {
                    SigKind::Update => Signal::Update,
                    SigKind::ToolBatch => Signal::ToolBatch,
                    SigKind::Result(r) => Signal::Result(r),
                    SigKind::Idle => Signal::Idle,
                    SigKind::Failed => {
                        Signal::Failed(ErrorKind::ModelStreamInterrupted, "broken".into())
                    }
                    SigKind::Exited(panicked) => Signal::Exited(panicked.then(|| "boom".into())),
                    SigKind::Receipt(n, consumed) => {
                        let steer = sut
                            .steers
                            .get(n)
                            .copied()
                            .unwrap_or(SteerId::from_u128(u128::MAX));
                        let r = if consumed {
                            SteerReceipt::Consumed
                        } else {
                            SteerReceipt::Dropped
                        };
                        Signal::SteerReceipt(steer, r)
                    }
                };
                sut.last_signal = Some((turn, signal.clone()));
                sut.feed(Input::Signal { turn, signal });
            }
            Step::LoopTrip(which, loop_type) => {
                let turn = sut.turn_of(which);
                sut.feed(Input::LoopTrip { turn, loop_type });
            }
            Step::ToolProgress(which) => {
                let turn = sut.turn_of(which);
                sut.feed(Input::ToolProgress { turn });
            }
            Step::Kick => sut.feed(Input::Kick),
            Step::Offer(origin, some, stale) => {
                let prompt = some.then(|| PromptId::from_u128(sut.fresh()));
                if let Some(p) = prompt {
                    sut.offered.insert(p);
                    sut.origins.insert(p, origin);
                }
                let poll = if stale {
                    sut.last_poll.saturating_sub(1)
                } else {
                    sut.last_poll
                };
                let started_before = sut.turn_of.len();
                sut.feed(Input::Offer {
                    origin,
                    poll,
                    work: prompt.map(|p| (p, p)),
                });
                if stale && poll != sut.last_poll {
                    assert_eq!(
                        sut.turn_of.len(),
                        started_before,
                        "a stale offer started a turn"
                    );
                }
            }
            Step::Duplicate => {
                if let Some((turn, signal)) = sut.last_signal.clone() {
                    sut.feed(Input::Signal { turn, signal });
                }
            }
            Step::Advance(ms) => {
                sut.now += ms;
                sut.feed(Input::Tick);
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, _: &()) {
        // Invariant 3: with the engine silent from here on, everything admitted
        // settles, each turn within the largest timer of the config.
        let mut drain = sut.clone();
        let bound = CFG
            .stall_timeout
            .max(CFG.cancel_grace)
            .max(CFG.steer_receipt_timeout);
        let mut rounds = 0;
        while drain.core.active().is_some() {
            rounds += 1;
            // At most one running turn plus the two bounded queues (interactive, automatic).
            assert!(rounds <= 2 * CFG.max_queued_prompts + 2, "a turn parked");
            drain.now += bound;
            drain.feed(Input::Tick);
        }
        for p in &drain.admitted {
            assert!(drain.terminals.contains_key(p), "prompt {p:?} stranded");
        }
        for p in &drain.rejected {
            assert!(!drain.terminals.contains_key(p));
        }
        // No stranded automatic work: every offer was started or handed back.
        for p in &drain.offered {
            assert!(
                drain.turn_of.contains_key(p) != drain.handed_back.contains(p),
                "offer {p:?} stranded or doubled"
            );
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000),
        max_shrink_iters: 10_000,
        .. ProptestConfig::default()
    })]
    #[test]
    fn every_admitted_prompt_gets_exactly_one_terminal(sequential 1..40 => TurnCoreTest);
}
