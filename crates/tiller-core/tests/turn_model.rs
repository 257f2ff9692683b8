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
use tiller_core::pipeline::{Batch, CallId, CallSpec, Decision, PipeEvent, Progress};
use tiller_core::{
    Answer, CallKey, CallOutcome, Effect, EngineStop, ErrorKind, IdleBehavior, LoopConfig,
    LoopGuard, LoopType, Millis, Origin, PromptId, Signal, SteerId, SteerOutcome, SteerReceipt,
    StopReason, Terminal, TurnConfig, TurnId,
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
    Cancel(EngineStop),
    /// The sender withdraws the n-th prompt ever sent (queued, running,
    /// over or refused).
    Withdraw(usize, EngineStop),
    /// The session closes (or the daemon drains).
    Close(EngineStop),
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
    /// A person answers the running turn's permission request (or, when
    /// `stale`, a request that is not pending).
    Decide(u8, bool),
    /// The call running off the actor finishes (or, when `stale`, a call
    /// that is not running reports).
    ToolDone(bool, bool),
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
            4 => Just(SigKind::ToolBatch),
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
        let stop = || prop_oneof![Just(EngineStop::Answered), Just(EngineStop::Behind)];
        prop_oneof![
            4 => origin.prop_map(Step::Prompt),
            3 => any::<bool>().prop_map(|start_new| Step::Steer { start_new }),
            2 => stop().prop_map(Step::Cancel),
            2 => (0usize..12, stop()).prop_map(|(n, s)| Step::Withdraw(n, s)),
            1 => stop().prop_map(Step::Close),
            10 => (which.clone(), kind).prop_map(|(w, k)| Step::Signal(w, k)),
            2 => (which.clone(), loop_type).prop_map(|(w, t)| Step::LoopTrip(w, t)),
            2 => which.prop_map(Step::ToolProgress),
            1 => Just(Step::Duplicate),
            1 => Just(Step::Kick),
            4 => (prop_oneof![Just(Origin::Goal), Just(Origin::Notification), Just(Origin::Cron)], any::<bool>(), prop::bool::weighted(0.2))
                .prop_map(|(o, some, stale)| Step::Offer(o, some, stale)),
            3 => prop_oneof![1u64..30, 30u64..500].prop_map(Step::Advance),
            3 => (0u8..4, prop::bool::weighted(0.2)).prop_map(|(d, s)| Step::Decide(d, s)),
            3 => (any::<bool>(), prop::bool::weighted(0.2)).prop_map(|(ok, s)| Step::ToolDone(ok, s)),
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
    /// Prompts sent, in order.
    sent: Vec<PromptId>,
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
    /// The running turn's tool batch going through the pipeline core.
    tools: Option<Tools>,
    /// The next call id to hand out.
    next_call: u64,
    /// What happened to each call, in order.
    calls: HashMap<CallId, Vec<PipeEvent>>,
}

/// A tool batch of a turn, with that turn's loop guard.
#[derive(Clone)]
struct Tools {
    turn: TurnId,
    batch: Batch,
    guard: LoopGuard,
}

/// Which calls need a person's permission (a third of them).
fn needs(id: CallId) -> bool {
    id.0.is_multiple_of(3)
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
            sent: Vec::new(),
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
            tools: None,
            next_call: 0,
            calls: HashMap::new(),
        }
    }

    /// Records the pipeline's events, checking each call's life: announced
    /// once, asked and resolved at most once (in that order), started at
    /// most once, then ended exactly once, and nothing after its end.
    fn record(&mut self, fx: Vec<PipeEvent>) {
        for e in fx {
            let id = match e {
                PipeEvent::Announced(id)
                | PipeEvent::Asked(id)
                | PipeEvent::Resolved(id, _)
                | PipeEvent::Started(id)
                | PipeEvent::Completed(id, _)
                | PipeEvent::Failed(id, _) => id,
            };
            let life = self.calls.entry(id).or_default();
            let ended =
                |e: &PipeEvent| matches!(e, PipeEvent::Completed(..) | PipeEvent::Failed(..));
            assert!(
                !life.iter().any(ended),
                "{e:?} after the call ended: {life:?}"
            );
            match e {
                PipeEvent::Announced(_) => assert!(life.is_empty(), "announced twice"),
                PipeEvent::Asked(_) => {
                    assert_eq!(
                        life.as_slice(),
                        [PipeEvent::Announced(id)],
                        "asked out of order"
                    );
                }
                PipeEvent::Resolved(..) => {
                    assert_eq!(life.last(), Some(&PipeEvent::Asked(id)), "resolved unasked");
                }
                PipeEvent::Started(_) => {
                    assert!(!life.contains(&PipeEvent::Started(id)), "started twice");
                    assert!(
                        matches!(
                            life.last(),
                            Some(
                                PipeEvent::Announced(_)
                                    | PipeEvent::Resolved(
                                        _,
                                        Decision::AllowOnce | Decision::AllowAlways
                                    )
                            )
                        ),
                        "started without leave: {life:?}"
                    );
                }
                PipeEvent::Completed(..) => {
                    assert_eq!(
                        life.last(),
                        Some(&PipeEvent::Started(id)),
                        "completed unstarted"
                    );
                }
                PipeEvent::Failed(..) => assert!(!life.is_empty(), "failed unannounced"),
            }
            life.push(e);
        }
    }

    /// Where the batch stands: done batches are handed back (to the
    /// engine), a trip is the core's next input.
    fn batch_moved(&mut self, turn: TurnId, p: Option<Progress>) {
        match p {
            Some(Progress::Done) => self.tools = None,
            Some(Progress::Tripped(loop_type)) => {
                self.tools = None;
                self.feed(Input::LoopTrip { turn, loop_type });
            }
            Some(Progress::Waiting(_) | Progress::Run(_)) | None => {}
        }
    }

    /// A tool batch of `turn` arrives: a few calls, some scripted, some
    /// real, some asking, with few distinct keys so loop trips happen.
    fn start_batch(&mut self, turn: TurnId) {
        if self.tools.is_some() {
            return; // an engine waits for its batch's results
        }
        let n = 1 + (self.next_call % 3) as usize;
        let first = CallId(self.next_call);
        let specs = (0..n as u64)
            .map(|i| {
                let k = self.next_call + i;
                CallSpec {
                    key: CallKey {
                        tool: format!("t{}", k % 2),
                        args: "a".into(),
                    },
                    // A third scripted, a third real, a third asking first.
                    simulated: (k % 3 == 1).then_some(CallOutcome {
                        ok: k.is_multiple_of(2),
                        signature: 1,
                    }),
                }
            })
            .collect();
        self.next_call += n as u64;
        let unattended = self
            .core
            .active()
            .and_then(|(p, _)| self.origins.get(&p))
            .is_some_and(|o| *o != Origin::Interactive);
        let mut tools = Tools {
            turn,
            batch: Batch::new(first, specs, unattended),
            guard: LoopGuard::new(LoopConfig::default()),
        };
        let mut fx = Vec::new();
        let p = tools.batch.advance(&mut tools.guard, &needs, &mut fx);
        self.tools = Some(tools);
        self.record(fx);
        self.batch_moved(turn, Some(p));
    }

    /// The turn of the batch ends (aborted or settled): what waits or runs
    /// is abandoned, nothing more runs.
    fn abandon(&mut self, turn: TurnId) {
        let Some(mut tools) = self.tools.take_if(|t| t.turn == turn) else {
            return;
        };
        let mut fx = Vec::new();
        tools.batch.abandon(&mut tools.guard, &mut fx);
        self.record(fx);
        assert!(tools.batch.waiting().is_none() && tools.batch.running().is_none());
    }

    /// A person's decision, or a call's output, reaches the pipeline.
    fn tool_step(&mut self, decide: Option<Decision>, ok: bool, stale: bool) {
        let Some(mut tools) = self.tools.take() else {
            return;
        };
        let turn = tools.turn;
        let pending = match decide {
            Some(_) => tools.batch.waiting(),
            None => tools.batch.running(),
        };
        let target = if stale {
            // A call of this batch that is not the pending one (ended, or
            // not reached yet), or one of no batch at all.
            let other = (0..3)
                .map(|i| tools.batch.id(i))
                .find(|id| tools.batch.index(*id).is_some() && Some(*id) != pending);
            Some(other.unwrap_or(CallId(u64::MAX)))
        } else {
            pending
        };
        let Some(id) = target else {
            self.tools = Some(tools);
            return;
        };
        let mut fx = Vec::new();
        let p = match decide {
            Some(d) => tools.batch.decide(id, d, &mut tools.guard, &needs, &mut fx),
            None => {
                let outcome = CallOutcome { ok, signature: 2 };
                tools
                    .batch
                    .finish(id, outcome, &mut tools.guard, &needs, &mut fx)
            }
        };
        if stale {
            assert!(
                p.is_none() && fx.is_empty(),
                "a stale answer changed the batch"
            );
        } else {
            assert!(p.is_some(), "the pending call took its answer");
        }
        self.tools = Some(tools);
        self.record(fx);
        // As the session does: the call's end is progress for the turn.
        self.feed(Input::ToolProgress { turn });
        if self.tools.as_ref().is_some_and(|t| t.turn == turn) {
            self.batch_moved(turn, p);
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
        let winding = self.core.winding();
        // (A loop trip for a turn that settled at its cancel is stale too.)
        let stale_target = match &input {
            Input::Signal { turn, .. } | Input::LoopTrip { turn, .. }
                if self.core.active().map(|(_, t)| t) != Some(*turn)
                    && (winding != Some(*turn) || matches!(input, Input::LoopTrip { .. })) =>
            {
                Some(*turn)
            }
            _ => None,
        };
        // A signal for the engine still stopping after its turn settled at
        // its cancel: its last word lets the next turn start, anything
        // else is stale.
        let to_winding = match &input {
            Input::Signal { turn, signal } if winding == Some(*turn) => {
                Some((*turn, signal.clone()))
            }
            _ => None,
        };
        // A cancel with the engine stopping behind settles its turn at once.
        let mut settles_now = None;
        if let Input::Cancel(stop) = &input
            && let Some((p, _)) = self.core.active()
        {
            self.cancel_first.insert(p);
            if *stop == EngineStop::Behind {
                settles_now = Some(p);
            }
        }
        // A withdrawn prompt that is not over ends `cancelled`, and nothing
        // else changes: what is queued behind it stays queued.
        let mut withdrawn = None;
        if let Input::Withdraw { prompt, stop } = &input {
            let queued_before: Vec<PromptId> = self.core.queued().collect();
            let running = self.core.active().is_some_and(|(p, _)| p == *prompt);
            if queued_before.contains(prompt) || running {
                self.cancel_first.insert(*prompt);
            }
            if running && *stop == EngineStop::Behind {
                settles_now = Some(*prompt);
            }
            withdrawn = Some((*prompt, queued_before));
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
        if let Input::Close(stop) = &input {
            if let Some((p, _)) = self.core.active() {
                self.cancel_first.insert(p);
                // (A second close changes nothing.)
                if *stop == EngineStop::Behind && !self.closed {
                    settles_now = Some(p);
                }
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
        let tool_batch = matches!(
            &input,
            Input::Signal {
                signal: Signal::ToolBatch,
                ..
            }
        );
        let mut deliver_batch = None;
        let step = self.core.on(self.now, input);
        let fx = step.effects;
        if let Some((prompt, before)) = withdrawn {
            let after: Vec<PromptId> = self.core.queued().collect();
            let kept: Vec<PromptId> = before.into_iter().filter(|p| *p != prompt).collect();
            assert_eq!(after, kept, "a withdraw touched other queued prompts");
            assert!(
                fx.iter().all(|e| match e {
                    Effect::Settled { prompt: p, .. } => *p == prompt,
                    _ => true,
                }),
                "a withdraw settled another prompt: {fx:?}"
            );
        }
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

        if let Some(p) = settles_now {
            assert!(
                fx.iter()
                    .any(|e| matches!(e, Effect::Settled { prompt, .. } if *prompt == p)),
                "a cancel with the engine stopping behind did not settle at once: {fx:?}"
            );
        }
        if let Some(w) = winding {
            // Nothing starts beside a stopping engine: a start comes only
            // after the engine is gone.
            let gone = fx
                .iter()
                .position(|e| *e == Effect::EngineStopped { turn: w });
            let start = fx.iter().position(|e| {
                matches!(
                    e,
                    Effect::StartTurn { .. } | Effect::Idle | Effect::Poll { .. }
                )
            });
            if let Some(start) = start {
                assert!(
                    gone.is_some_and(|g| g < start),
                    "started beside a stopping engine: {fx:?}"
                );
            }
            match &to_winding {
                Some((
                    _,
                    Signal::Result(_) | Signal::Idle | Signal::Failed(..) | Signal::Exited(_),
                )) => {
                    assert!(
                        gone.is_some(),
                        "its last word did not release the engine: {fx:?}"
                    );
                }
                Some((turn, _)) => {
                    assert_eq!(
                        fx.iter()
                            .filter(|e| !matches!(e, Effect::ArmTimer { .. }))
                            .cloned()
                            .collect::<Vec<_>>(),
                        vec![Effect::Stale { turn: *turn }],
                        "a stopping engine's content"
                    );
                }
                None => {}
            }
            if let Some(g) = gone {
                // Invariant 4, for a turn settled at its cancel: the next
                // start or Idle follows its engine's end.
                assert!(
                    fx[g + 1..]
                        .iter()
                        .any(|e| matches!(e, Effect::StartTurn { .. } | Effect::Idle)),
                    "an engine's end not followed by start or idle: {fx:?}"
                );
            }
        }
        if self.core.winding().is_some() {
            assert!(
                self.core.active().is_none(),
                "a turn runs beside a stopping engine"
            );
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
                    assert!(!self.core.busy(), "polled while busy");
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
                        self.abandon(*t);
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
                    // Invariant 4: a terminal is followed by the next start
                    // or Idle (or, its engine stopping behind it, by
                    // nothing until that engine is gone: checked above).
                    if turn.is_some() && self.core.winding() != *turn {
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
                    assert!(!self.core.busy(), "idle while a turn runs");
                    assert_eq!(self.core.queued().count(), 0, "idle with queued prompts");
                }
                Effect::Deliver { turn } => {
                    assert!(!self.settled_turns.contains(turn));
                    if tool_batch {
                        deliver_batch = Some(*turn);
                    }
                }
                // As the session does: a turn that is stopped abandons its
                // batch (a waiting call is resolved, a running one stopped).
                Effect::AbortEngine { turn, .. } => self.abandon(*turn),
                _ => {}
            }
        }
        // Invariant 1 (at most one): never two terminals for one prompt.
        for (p, t) in &self.terminals {
            assert_eq!(t.len(), 1, "prompt {p:?} got {t:?}");
        }
        // A parkable core has nothing in flight: every admitted prompt has
        // its terminal, every offered work started or went back.
        if self.core.parkable() {
            for p in &self.admitted {
                assert!(
                    self.terminals.contains_key(p),
                    "parkable with {p:?} unsettled"
                );
            }
            for p in &self.offered {
                assert!(
                    self.turn_of.contains_key(p) || self.handed_back.contains(p),
                    "parkable with offered work {p:?} neither started nor handed back"
                );
            }
            // And it waits for no queue's answer: work offered now, even
            // for the last poll, goes back (a parked session's next actor
            // numbers its polls afresh).
            for origin in AUTO {
                let probe = PromptId::from_u128(u128::MAX);
                let step = self.core.clone().on(
                    self.now,
                    Input::Offer {
                        origin,
                        poll: self.last_poll,
                        work: Some((probe, probe)),
                    },
                );
                assert!(
                    matches!(step.answer, Answer::OfferRefused { .. }),
                    "parkable while waiting for {origin:?}'s answer: {:?}",
                    step.answer
                );
            }
        }
        // The delivered batch goes into the pipeline.
        if let Some(turn) = deliver_batch {
            self.start_batch(turn);
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
                sut.sent.push(prompt);
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
            Step::Cancel(stop) => sut.feed(Input::Cancel(stop)),
            Step::Withdraw(n, stop) => {
                let prompt = sut
                    .sent
                    .get(n)
                    .copied()
                    .unwrap_or(PromptId::from_u128(u128::MAX));
                sut.feed(Input::Withdraw { prompt, stop });
            }
            Step::Close(stop) => sut.feed(Input::Close(stop)),
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
            Step::Decide(d, stale) => {
                let d =
                    [Decision::AllowOnce, Decision::AllowAlways, Decision::Reject][d as usize % 3];
                sut.tool_step(Some(d), false, stale);
            }
            Step::ToolDone(ok, stale) => sut.tool_step(None, ok, stale),
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
        while drain.core.busy() {
            rounds += 1;
            // At most a stopping engine, one running turn plus the two
            // bounded queues (interactive, automatic).
            assert!(rounds <= 2 * CFG.max_queued_prompts + 3, "a turn parked");
            drain.now += bound;
            drain.feed(Input::Tick);
        }
        for p in &drain.admitted {
            assert!(drain.terminals.contains_key(p), "prompt {p:?} stranded");
        }
        // Tool calls: none is left waiting or running once the turns ended,
        // and every announced call ended exactly once.
        assert!(drain.tools.is_none(), "a batch outlived its turn");
        for (id, life) in &drain.calls {
            let ends = life
                .iter()
                .filter(|e| matches!(e, PipeEvent::Completed(..) | PipeEvent::Failed(..)))
                .count();
            assert_eq!(ends, 1, "call {id:?} ended {ends} times: {life:?}");
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
