//! The session's turn core: admission, the running turn, settlement,
//! steering, cancellation and timers, as one pure state machine.
//!
//! `SessionCore::on(now, input)` returns a [`Step`]: the [`Answer`] for
//! whoever sent the input (admitted, queued, refused; a steer's outcome),
//! and the effects the session actor must carry out, in order. The core
//! carries each prompt's and steer's payload (opaque type parameters `P`
//! and `S`) from admission to settlement and hands it back where it is
//! needed, so the actor keeps no copy of what is queued or outstanding.
//! Rules (see `turn-lifecycle.md`):
//!
//! * every admitted prompt gets exactly one [`Effect::Settled`];
//! * signals are tagged with a [`TurnId`]; a signal for any turn but the
//!   running one is [`Effect::Stale`] and changes nothing;
//! * every waiting state has a deadline owned here ([`Effect::ArmTimer`]), so
//!   with a silent engine every turn settles within the largest timer;
//! * a cancel received before settlement makes the terminal `cancelled`;
//! * after a terminal, the next queued prompt starts or [`Effect::Idle`] is
//!   emitted, always after the [`Effect::Settled`]; after a turn settled at
//!   its cancel while its engine stops behind it ([`EngineStop::Behind`]),
//!   only once [`Effect::EngineStopped`] says the engine is gone.

use std::collections::VecDeque;

use crate::{ErrorKind, LoopType, Origin, PromptId, SteerId, StopReason, Terminal, TurnId};

/// Milliseconds on the actor's monotonic clock. The core never reads a clock.
pub type Millis = u64;

/// Timers and bounds of the turn lifecycle (`[turn]` in the config).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnConfig {
    /// How long a recorded result waits for an outstanding steer's receipt.
    pub steer_receipt_timeout: Millis,
    /// How long a cancelled turn waits for the engine before it is torn down.
    pub cancel_grace: Millis,
    /// How long a turn may go without any signal before it fails `stalled`.
    pub stall_timeout: Millis,
    /// Bound of the interactive prompt queue; over it prompts are refused.
    pub max_queued_prompts: usize,
    /// Most content signals (text, thoughts, plans, tool batches) one turn
    /// may send; past it the turn fails `turn_too_long` and its engine is
    /// torn down, so a runaway engine cannot flood the session.
    pub max_turn_events: u64,
}

impl Default for TurnConfig {
    fn default() -> Self {
        Self {
            steer_receipt_timeout: 10_000,
            cancel_grace: 2_000,
            stall_timeout: 600_000,
            max_queued_prompts: 8,
            max_turn_events: 100_000,
        }
    }
}

/// What a steer does when no turn is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleBehavior<P = ()> {
    /// Start a new interactive prompt with this id and payload (the
    /// default).
    StartNewTurn(PromptId, P),
    /// Refuse with `promptRequired`.
    PromptRequired,
}

/// An engine's answer about one steer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteerReceipt {
    /// The steer became part of the conversation.
    Consumed,
    /// The engine will not use the steer.
    Dropped,
}

/// An engine signal, always delivered with the [`TurnId`] it belongs to.
/// Content (text, tool calls) stays with the actor; the core only needs
/// the kind to decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Text, thought or plan content.
    Update,
    /// Tool calls to run through the session's pipeline.
    ToolBatch,
    /// The engine's result for the turn.
    Result(StopReason),
    /// The engine will do nothing more for the turn.
    Idle,
    /// Receipt for a steer handed to the engine.
    SteerReceipt(SteerId, SteerReceipt),
    /// The engine failed.
    Failed(ErrorKind, String),
    /// The engine's task ended by itself: it returned, or panicked (with
    /// the panic's message). Whatever it still owed the turn will never
    /// come, so an unsettled turn settles now: by its recorded result, or
    /// `engine_crashed`.
    Exited(Option<String>),
}

/// How the running turn's engine stops when the turn is cancelled
/// (given with [`Input::Cancel`], [`Input::Withdraw`], [`Input::Close`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineStop {
    /// The turn settles `cancelled` at the engine's first signal after the
    /// cancel, or at `cancel_grace`: an agent that acts on its own (its own
    /// tools) is answered `cancelled` only once it says it stopped.
    #[default]
    Answered,
    /// Everything the engine does goes through the session, which stops
    /// taking it at the cancel: the turn settles `cancelled` at once, and
    /// nothing starts until the engine's final signal (its end of the
    /// turn: result, idle, failure, exit) or `cancel_grace`, so the next
    /// turn never runs beside it.
    Behind,
}

impl Signal {
    /// The engine's last word for a turn: after it, it does nothing more
    /// (updates, tool batches and receipts may come before it).
    fn is_final(&self) -> bool {
        matches!(
            self,
            Signal::Result(_) | Signal::Idle | Signal::Failed(..) | Signal::Exited(_)
        )
    }
}

/// Everything that can happen to a session's turns. `P` is what the actor
/// keeps with a prompt, `S` with a steer; the core hands them back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input<P = (), S = ()> {
    /// A prompt asks to run. The actor has already validated it; its
    /// admission is stored before the answer is acknowledged.
    Prompt {
        /// The prompt.
        prompt: PromptId,
        /// Who sent it.
        origin: Origin,
        /// Kept until it settles (or handed back if refused).
        payload: P,
    },
    /// A steer for the running turn.
    Steer {
        /// The steer.
        steer: SteerId,
        /// Kept while the steer is outstanding (its text, for the engine
        /// and for `steer_dropped`).
        text: S,
        /// What it does when no turn runs.
        idle_behavior: IdleBehavior<P>,
    },
    /// `session/cancel`; how the running turn's engine stops.
    Cancel(EngineStop),
    /// Its sender withdraws one prompt (`$/cancel_request`): queued, it
    /// settles `cancelled` at once; running, its turn is cancelled as by
    /// [`Input::Cancel`], but prompts queued behind it stay. A prompt that
    /// is over (or unknown) is left alone.
    Withdraw {
        /// The prompt.
        prompt: PromptId,
        /// How the running turn's engine stops.
        stop: EngineStop,
    },
    /// The session closes (or the daemon drains): the running turn is
    /// cancelled, every queued prompt of any origin settles `cancelled`,
    /// and nothing starts any more (prompts are refused, offers handed
    /// back, queues not polled). Work still in the queue actors stays
    /// there, durable, for a reopen. How the running turn's engine stops.
    Close(EngineStop),
    /// An engine signal.
    Signal {
        /// The turn it belongs to (any other than the running one is stale).
        turn: TurnId,
        /// What the engine said.
        signal: Signal,
    },
    /// The tool pipeline's loop guard tripped in this turn (the offending
    /// calls are already failed and the engine must stop).
    LoopTrip {
        /// The turn.
        turn: TurnId,
        /// Which rule tripped.
        loop_type: LoopType,
    },
    /// The tool pipeline finished a call of this turn. While tools run the
    /// engine is silent on purpose; this is progress for the stall bound,
    /// and nothing else.
    ToolProgress {
        /// The turn.
        turn: TurnId,
    },
    /// A timer armed by [`Effect::ArmTimer`] fired (or any wake-up: the core
    /// re-checks every deadline against `now`).
    Tick,
    /// Automatic work may be waiting (a queue actor got some): poll the
    /// queues if the session is idle.
    Kick,
    /// A queue actor's answer to [`Effect::Poll`]: its next due work for
    /// this session, as a prompt and its payload, or nothing.
    Offer {
        /// The queue that answers.
        origin: Origin,
        /// The poll this answers (from [`Effect::Poll`]); an answer to an
        /// older poll is stale.
        poll: u64,
        /// The work, if any.
        work: Option<(PromptId, P)>,
    },
}

/// The core's answer to the one who sent an input, apart from the effects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer<P = ()> {
    /// The input asks for no answer (signals, timers, cancel, close...), or
    /// an offer was empty.
    None,
    /// The prompt (or offered work) was admitted and its turn started.
    Started {
        /// The new turn.
        turn: TurnId,
    },
    /// The prompt was admitted and waits behind the running turn.
    Queued {
        /// Prompts waiting, this one included.
        depth: usize,
    },
    /// The prompt was refused and never admitted: its payload is back.
    Rejected {
        /// Why.
        reason: Rejection,
        /// The payload it came with.
        payload: P,
    },
    /// The answer to a steer. A prompt payload the steer did not use (it
    /// did not start a turn) is handed back.
    Steer {
        /// What became of it.
        outcome: SteerOutcome,
        /// The unused payload of [`IdleBehavior::StartNewTurn`].
        unused: Option<P>,
    },
    /// Offered work came when the session could not take it: hand it back
    /// to its queue (it is offered again at the next idle).
    OfferRefused {
        /// Its queue.
        origin: Origin,
        /// The prompt it would have been.
        prompt: PromptId,
        /// Its payload.
        payload: P,
    },
}

/// What one input did: the answer for its sender, and the effects for the
/// actor, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step<P = (), S = ()> {
    /// For the sender of the input.
    pub answer: Answer<P>,
    /// For the actor to carry out, in order.
    pub effects: Vec<Effect<P, S>>,
}

/// Why a prompt was refused at admission (it was never admitted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// The interactive queue is full; the caller may retry.
    Overloaded,
    /// The session is closing: nothing starts any more.
    Closed,
}

/// Why a steer could not be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteerRefusal {
    /// No turn runs (and the steer was not to start one).
    NoRunningTurn,
    /// The running turn is being cancelled.
    TurnCancelling,
    /// The session is closing: a steer cannot start a turn.
    SessionClosing,
    /// The running turn's engine takes no steers (an ACP agent that does
    /// not advertise steering): send a prompt, which queues.
    NotSupported,
}

/// The answer to a steer request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteerOutcome {
    /// The steer joins the running turn.
    Injected {
        /// That turn.
        turn: TurnId,
    },
    /// Nothing was consumed; the client must send a prompt.
    PromptRequired(SteerRefusal),
    /// No turn was running: the steer became a new prompt.
    StartedNewTurn {
        /// That prompt.
        prompt: PromptId,
    },
}

/// Why a steer was dropped without being consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteerDropReason {
    /// The engine said so.
    Engine,
    /// The turn ended (idle) before the engine used it.
    TurnEnded,
    /// The result was recorded and no receipt came in time.
    ReceiptTimeout,
    /// The turn was cancelled.
    Cancelled,
}

/// Which watchdog fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchdogKind {
    /// No signal within `stall_timeout`.
    Stall,
    /// A cancelled engine did not stop within `cancel_grace`.
    CancelGrace,
    /// A steer's receipt did not come within `steer_receipt_timeout`.
    SteerReceipt,
}

impl WatchdogKind {
    /// Every watchdog.
    pub const ALL: [WatchdogKind; 3] = [
        WatchdogKind::Stall,
        WatchdogKind::CancelGrace,
        WatchdogKind::SteerReceipt,
    ];

    /// The `kind` label of `tiller_watchdog_fired_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            WatchdogKind::Stall => "stall",
            WatchdogKind::CancelGrace => "cancel_grace",
            WatchdogKind::SteerReceipt => "steer_receipt",
        }
    }
}

/// What the actor must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect<P = (), S = ()> {
    /// Start the engine on this prompt with a fresh turn id. Its payload
    /// is [`SessionCore::active_payload_mut`] until it settles.
    StartTurn {
        /// The prompt.
        prompt: PromptId,
        /// Its new turn.
        turn: TurnId,
        /// Who sent it.
        origin: Origin,
        /// It starts later than its admission was answered (it waited in
        /// the queue, or it is offered automatic work): its start is news.
        deferred: bool,
    },
    /// The content of the signal just given belongs to the running turn:
    /// publish it (updates) or run it (tool batches).
    Deliver {
        /// The turn.
        turn: TurnId,
    },
    /// Hand an injected steer to the engine.
    ForwardSteer {
        /// The turn it joins.
        turn: TurnId,
        /// The steer.
        steer: SteerId,
        /// Its payload (a copy; the core keeps it while outstanding).
        text: S,
    },
    /// The engine consumed the steer (of this prompt's turn).
    SteerConsumed {
        /// The steer.
        steer: SteerId,
        /// The prompt of the turn.
        prompt: PromptId,
        /// The turn.
        turn: TurnId,
        /// Its payload, handed back.
        text: S,
    },
    /// The steer was dropped; clients may resend its text.
    SteerDropped {
        /// The steer.
        steer: SteerId,
        /// Why.
        reason: SteerDropReason,
        /// The prompt of the turn.
        prompt: PromptId,
        /// The turn.
        turn: TurnId,
        /// Its payload, handed back.
        text: S,
    },
    /// Ask the engine to stop (cancel, stall, ...). `teardown` means the
    /// engine had its chance: stop its task now.
    AbortEngine {
        /// The turn.
        turn: TurnId,
        /// Stop its task now.
        teardown: bool,
    },
    /// The prompt's one terminal. Publish it, answer its owner.
    Settled {
        /// The prompt.
        prompt: PromptId,
        /// Its turn (`None`: it never started).
        turn: Option<TurnId>,
        /// Who sent it.
        origin: Origin,
        /// Its one terminal.
        terminal: Terminal,
        /// Loop protection stopped it (an automatic turn: see
        /// [`Effect::LoopStopped`]).
        loop_stopped: bool,
        /// Its payload, handed back.
        payload: P,
    },
    /// The signal belonged to another turn and was dropped.
    Stale {
        /// The turn it named.
        turn: TurnId,
    },
    /// Loop protection stopped an automatic turn, which resolves `end_turn`;
    /// record a `loop_stopped` event (before its `Settled`).
    LoopStopped {
        /// The prompt.
        prompt: PromptId,
        /// The turn.
        turn: TurnId,
        /// Which rule tripped.
        loop_type: LoopType,
    },
    /// The engine of a turn that settled at its cancel
    /// ([`EngineStop::Behind`]) is done: its final signal came, or its
    /// `cancel_grace` passed. Drop it (one still running is torn down);
    /// whatever starts next comes after this.
    EngineStopped {
        /// The turn it ran.
        turn: TurnId,
    },
    /// A watchdog bound was reached.
    WatchdogFired {
        /// Which.
        kind: WatchdogKind,
    },
    /// Wake the core with [`Input::Tick`] at this time (replaces any earlier
    /// request; `None` means no timer is needed).
    ArmTimer {
        /// When (`None`: no timer).
        at: Option<Millis>,
    },
    /// Nothing runs and nothing is queued: the queue actors may offer work.
    Idle,
    /// Ask the queue actor of `origin` for its next due work; its answer
    /// must carry `poll`.
    Poll {
        /// The queue.
        origin: Origin,
        /// Echoed in its answer.
        poll: u64,
    },
}

/// A steer handed to the engine that has no receipt yet.
#[derive(Clone, Debug)]
struct OutstandingSteer<S> {
    /// Which steer.
    id: SteerId,
    /// When it was accepted; with a recorded result, its receipt deadline
    /// runs from the later of this and the result.
    accepted_at: Millis,
    /// Its payload.
    text: S,
}

/// Running or being cancelled.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// Cancel received at this time; the turn settles `cancelled` at the
    /// engine's next signal or at `at + cancel_grace`.
    Cancelling {
        at: Millis,
    },
}

/// The engine of a turn settled at its cancel, still stopping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Winding {
    /// The turn it ran.
    turn: TurnId,
    /// Its cancel's grace ends: it is torn down then.
    until: Millis,
}

/// The one unsettled turn.
#[derive(Clone, Debug)]
struct ActiveTurn<P, S> {
    /// The prompt that owns completion.
    prompt: PromptId,
    /// Its payload.
    payload: P,
    /// Its turn id; signals with any other id are stale.
    turn: TurnId,
    /// Decides the terminal of loop stops and labels metrics.
    origin: Origin,
    /// Running or cancelling.
    phase: Phase,
    /// The result recorded while steers were outstanding, and when.
    result: Option<(StopReason, Millis)>,
    /// Steers handed to the engine without a receipt, oldest first.
    steers: Vec<OutstandingSteer<S>>,
    /// Time of the last signal of this turn (the stall watchdog runs from it).
    last_signal: Millis,
    /// Content signals so far (bounded by `max_turn_events`).
    events: u64,
    /// Loop protection stopped it.
    loop_stopped: bool,
}

impl<P, S> ActiveTurn<P, S> {
    /// Starts cancelling the turn: its steers are dropped and the engine
    /// aborted. A turn already cancelling is left as it is (a repeated
    /// cancel extends nothing).
    fn cancel(&mut self, now: Millis, fx: &mut Vec<Effect<P, S>>) {
        if self.phase != Phase::Running {
            return;
        }
        self.phase = Phase::Cancelling { at: now };
        self.drop_steers(SteerDropReason::Cancelled, fx);
        fx.push(Effect::AbortEngine {
            turn: self.turn,
            teardown: false,
        });
    }

    /// Drops every outstanding steer, reporting each with `reason`.
    fn drop_steers(&mut self, reason: SteerDropReason, fx: &mut Vec<Effect<P, S>>) {
        for s in self.steers.drain(..) {
            fx.push(Effect::SteerDropped {
                steer: s.id,
                reason,
                prompt: self.prompt,
                turn: self.turn,
                text: s.text,
            });
        }
    }
}

/// A prompt waiting behind the running turn.
#[derive(Clone, Debug)]
struct Waiting<P> {
    prompt: PromptId,
    origin: Origin,
    payload: P,
}

/// The turn state of one session. `P` is the payload the actor keeps with
/// each prompt, `S` with each steer.
#[derive(Clone, Debug)]
pub struct SessionCore<P = (), S = ()> {
    /// Timers and bounds.
    config: TurnConfig,
    /// The last turn id handed out (monotonic per session).
    last_turn: u64,
    /// The unsettled turn, if any.
    active: Option<ActiveTurn<P, S>>,
    /// The engine of the last turn, settled at its cancel and still
    /// stopping: nothing starts until it is gone.
    winding: Option<Winding>,
    /// Prompts waiting behind the running turn, FIFO within each origin;
    /// interactive ones are taken first, then channel ones.
    queue: VecDeque<Waiting<P>>,
    /// The automatic queues to poll when idle, in admission order.
    automatic: Vec<Origin>,
    /// Per queue in `automatic` (a bit each): whether it may have work. An empty answer
    /// clears it, a kick (new work somewhere) sets them all, so a session
    /// without automatic work polls nothing when its turns end.
    maybe: u64,
    /// A kick arrived during a poll round: once the round ends empty, it
    /// runs again (an empty answer it overtook may predate the new work).
    rekick: bool,
    /// While idle: the index in `automatic` of the queue being polled.
    polling: Option<usize>,
    /// The id of the last poll; only its answer is taken.
    poll_seq: u64,
    /// The deadline last requested with [`Effect::ArmTimer`], to avoid
    /// re-arming an unchanged timer.
    armed: Option<Millis>,
    /// Set by [`Input::Close`]: nothing starts any more.
    closing: bool,
}

impl<P, S: Clone> SessionCore<P, S> {
    /// A core whose next turn id is `last_turn + 1` (restored sessions pass
    /// the highest turn id they ever used, so old signals stay stale).
    pub fn new(config: TurnConfig, last_turn: u64) -> Self {
        Self {
            config,
            last_turn,
            active: None,
            winding: None,
            queue: VecDeque::new(),
            automatic: Vec::new(),
            maybe: 0,
            rekick: false,
            polling: None,
            poll_seq: 0,
            armed: None,
            closing: false,
        }
    }

    /// The automatic queues this session polls when idle, in admission
    /// order (e.g. goal, notification, cron).
    pub fn with_automatic(mut self, origins: Vec<Origin>) -> Self {
        assert!(origins.len() <= 64, "at most 64 automatic queues");
        self.automatic = origins;
        // Unknown at start: each queue is asked once.
        self.maybe = u64::MAX;
        self
    }

    /// True while the idle session is polling its automatic queues.
    pub fn is_polling(&self) -> bool {
        self.polling.is_some()
    }

    /// The running turn's prompt and id, if any.
    pub fn active(&self) -> Option<(PromptId, TurnId)> {
        self.active.as_ref().map(|a| (a.prompt, a.turn))
    }

    /// The running turn's prompt payload.
    pub fn active_payload(&self) -> Option<&P> {
        self.active.as_ref().map(|a| &a.payload)
    }

    /// The running turn's prompt payload, to change.
    pub fn active_payload_mut(&mut self) -> Option<&mut P> {
        self.active.as_mut().map(|a| &mut a.payload)
    }

    /// True when nothing is in flight or due: no turn, no queued prompt,
    /// no poll round, no timer, not closing. Every prompt admitted so far
    /// has its terminal, so the session may be stopped and started again
    /// from the store (parked while idle) with nothing lost: work queued
    /// for it meanwhile wakes it, as it wakes a session after a restart.
    pub fn parkable(&self) -> bool {
        !self.busy()
            && self.queue.is_empty()
            && self.polling.is_none()
            && !self.rekick
            && self.armed.is_none()
            && !self.closing
    }

    /// True once the session is closing (nothing starts any more).
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// True while the running turn is being cancelled, or the engine of
    /// one settled at its cancel is still stopping.
    pub fn is_cancelling(&self) -> bool {
        self.winding.is_some()
            || matches!(
                self.active.as_ref().map(|a| &a.phase),
                Some(Phase::Cancelling { .. })
            )
    }

    /// A turn runs, or the engine of one settled at its cancel is still
    /// stopping: a prompt now waits in the queue.
    pub fn busy(&self) -> bool {
        self.active.is_some() || self.winding.is_some()
    }

    /// The turn whose engine is still stopping after it settled at its
    /// cancel (the actor keeps that engine until [`Effect::EngineStopped`]).
    pub fn winding(&self) -> Option<TurnId> {
        self.winding.map(|w| w.turn)
    }

    /// Queued prompts, oldest first.
    pub fn queued(&self) -> impl Iterator<Item = PromptId> + '_ {
        self.queue.iter().map(|w| w.prompt)
    }

    /// Queued prompts and their payloads, oldest first.
    pub fn queued_payloads_mut(&mut self) -> impl Iterator<Item = (PromptId, &mut P)> + '_ {
        self.queue.iter_mut().map(|w| (w.prompt, &mut w.payload))
    }

    /// The highest turn id handed out so far.
    pub fn last_turn(&self) -> TurnId {
        TurnId(self.last_turn)
    }

    /// Feeds one input at time `now`; returns the answer for its sender and
    /// the effects, in order.
    pub fn on(&mut self, now: Millis, input: Input<P, S>) -> Step<P, S> {
        let mut effects = Vec::new();
        let answer = self.on_into(now, input, &mut effects);
        Step { answer, effects }
    }

    /// [`SessionCore::on`], the effects appended to `fx` (a buffer the
    /// caller keeps: no allocation per input).
    pub fn on_into(
        &mut self,
        now: Millis,
        input: Input<P, S>,
        fx: &mut Vec<Effect<P, S>>,
    ) -> Answer<P> {
        let answer = match input {
            Input::Prompt {
                prompt,
                origin,
                payload,
            } => self.prompt(now, prompt, origin, payload, fx),
            Input::Steer {
                steer,
                text,
                idle_behavior,
            } => self.steer(now, steer, text, idle_behavior, fx),
            Input::Cancel(stop) => {
                self.cancel(now, stop, fx);
                Answer::None
            }
            Input::Withdraw { prompt, stop } => {
                self.withdraw(now, prompt, stop, fx);
                Answer::None
            }
            Input::Close(stop) => {
                self.close(now, stop, fx);
                Answer::None
            }
            Input::Signal { turn, signal } => {
                self.signal(now, turn, signal, fx);
                Answer::None
            }
            Input::LoopTrip { turn, loop_type } => {
                self.loop_trip(now, turn, loop_type, fx);
                Answer::None
            }
            Input::ToolProgress { turn } => {
                if let Some(active) = self.active.as_mut().filter(|a| a.turn == turn) {
                    active.last_signal = now;
                }
                Answer::None
            }
            Input::Tick => Answer::None,
            Input::Kick => {
                self.maybe = u64::MAX;
                if self.polling.is_some() {
                    self.rekick = true;
                } else if !self.busy() && !self.closing {
                    self.poll_from(0, fx);
                }
                Answer::None
            }
            Input::Offer { origin, poll, work } => self.offer(now, origin, poll, work, fx),
        };
        // Deadlines after the input: a signal that arrives late still counts.
        self.expire(now, fx);
        self.rearm(fx);
        answer
    }

    fn prompt(
        &mut self,
        now: Millis,
        prompt: PromptId,
        origin: Origin,
        payload: P,
        fx: &mut Vec<Effect<P, S>>,
    ) -> Answer<P> {
        if self.closing {
            return Answer::Rejected {
                reason: Rejection::Closed,
                payload,
            };
        }
        let same_class = self
            .queue
            .iter()
            .filter(|w| (w.origin == Origin::Interactive) == (origin == Origin::Interactive))
            .count();
        if !self.busy() {
            // A prompt beats automatic work being polled for: late offers
            // are refused and handed back.
            self.polling = None;
            let turn = self.start(now, prompt, origin, payload, false, fx);
            Answer::Started { turn }
        } else if same_class >= self.config.max_queued_prompts {
            Answer::Rejected {
                reason: Rejection::Overloaded,
                payload,
            }
        } else {
            self.queue.push_back(Waiting {
                prompt,
                origin,
                payload,
            });
            Answer::Queued {
                depth: self.queue.len(),
            }
        }
    }

    fn start(
        &mut self,
        now: Millis,
        prompt: PromptId,
        origin: Origin,
        payload: P,
        deferred: bool,
        fx: &mut Vec<Effect<P, S>>,
    ) -> TurnId {
        // A poll round a start interrupts is over (late offers are refused);
        // a kick during it already set the queues' flags.
        self.polling = None;
        self.rekick = false;
        self.last_turn += 1;
        let turn = TurnId(self.last_turn);
        self.active = Some(ActiveTurn {
            prompt,
            payload,
            turn,
            origin,
            phase: Phase::Running,
            result: None,
            steers: Vec::new(),
            last_signal: now,
            events: 0,
            loop_stopped: false,
        });
        fx.push(Effect::StartTurn {
            prompt,
            turn,
            origin,
            deferred,
        });
        turn
    }

    fn steer(
        &mut self,
        now: Millis,
        steer: SteerId,
        text: S,
        idle: IdleBehavior<P>,
        fx: &mut Vec<Effect<P, S>>,
    ) -> Answer<P> {
        let unused = |idle: IdleBehavior<P>| match idle {
            IdleBehavior::StartNewTurn(_, payload) => Some(payload),
            IdleBehavior::PromptRequired => None,
        };
        let Some(active) = self.active.as_mut() else {
            if self.closing {
                return Answer::Steer {
                    outcome: SteerOutcome::PromptRequired(SteerRefusal::SessionClosing),
                    unused: unused(idle),
                };
            }
            if self.winding.is_some() {
                return Answer::Steer {
                    outcome: SteerOutcome::PromptRequired(SteerRefusal::TurnCancelling),
                    unused: unused(idle),
                };
            }
            return match idle {
                IdleBehavior::PromptRequired => Answer::Steer {
                    outcome: SteerOutcome::PromptRequired(SteerRefusal::NoRunningTurn),
                    unused: None,
                },
                IdleBehavior::StartNewTurn(prompt, payload) => {
                    self.start(now, prompt, Origin::Interactive, payload, false, fx);
                    Answer::Steer {
                        outcome: SteerOutcome::StartedNewTurn { prompt },
                        unused: None,
                    }
                }
            };
        };
        if active.phase != Phase::Running {
            return Answer::Steer {
                outcome: SteerOutcome::PromptRequired(SteerRefusal::TurnCancelling),
                unused: unused(idle),
            };
        }
        active.steers.push(OutstandingSteer {
            id: steer,
            accepted_at: now,
            text: text.clone(),
        });
        fx.push(Effect::ForwardSteer {
            turn: active.turn,
            steer,
            text,
        });
        Answer::Steer {
            outcome: SteerOutcome::Injected { turn: active.turn },
            unused: unused(idle),
        }
    }

    fn cancel(&mut self, now: Millis, stop: EngineStop, fx: &mut Vec<Effect<P, S>>) {
        // Queued interactive prompts are cancelled, each with its own result.
        let (cancelled, kept): (Vec<_>, Vec<_>) = self
            .queue
            .drain(..)
            .partition(|w| w.origin == Origin::Interactive);
        self.queue = kept.into();
        // (Prompts queue with no turn running only behind a winding engine.)
        for w in cancelled {
            fx.push(never_started(w));
        }
        self.cancel_active(now, stop, fx);
    }

    /// Cancels the running turn; with [`EngineStop::Behind`] it settles
    /// now, its engine winding down until its grace ends.
    fn cancel_active(&mut self, now: Millis, stop: EngineStop, fx: &mut Vec<Effect<P, S>>) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        active.cancel(now, fx);
        if let (EngineStop::Behind, Phase::Cancelling { at }) = (stop, &active.phase) {
            self.winding = Some(Winding {
                turn: active.turn,
                // A repeated cancel extends nothing.
                until: *at + self.config.cancel_grace,
            });
            self.settle(now, Terminal::Completed(StopReason::Cancelled), fx);
        }
    }

    fn withdraw(
        &mut self,
        now: Millis,
        prompt: PromptId,
        stop: EngineStop,
        fx: &mut Vec<Effect<P, S>>,
    ) {
        if let Some(i) = self.queue.iter().position(|w| w.prompt == prompt) {
            let w = self.queue.remove(i).expect("position is in the queue");
            fx.push(never_started(w));
            return;
        }
        if self.active.as_ref().is_some_and(|a| a.prompt == prompt) {
            self.cancel_active(now, stop, fx);
        }
    }

    fn close(&mut self, now: Millis, stop: EngineStop, fx: &mut Vec<Effect<P, S>>) {
        if self.closing {
            return;
        }
        self.closing = true;
        self.polling = None;
        for w in std::mem::take(&mut self.queue) {
            fx.push(never_started(w));
        }
        if self.active.is_some() {
            self.cancel(now, stop, fx);
        } else if self.winding.is_none() {
            // (A winding engine's end reports the session idle.)
            fx.push(Effect::Idle);
        }
    }

    fn signal(&mut self, now: Millis, turn: TurnId, signal: Signal, fx: &mut Vec<Effect<P, S>>) {
        if self.winding.is_some_and(|w| w.turn == turn) {
            if signal.is_final() {
                self.winding = None;
                fx.push(Effect::EngineStopped { turn });
                self.next(now, fx);
            } else {
                fx.push(Effect::Stale { turn });
            }
            return;
        }
        let Some(active) = self.active.as_mut().filter(|a| a.turn == turn) else {
            fx.push(Effect::Stale { turn });
            return;
        };
        active.last_signal = now;
        if matches!(active.phase, Phase::Cancelling { .. }) {
            // The engine's first signal after a cancel settles the turn.
            self.settle(now, Terminal::Completed(StopReason::Cancelled), fx);
            return;
        }
        match signal {
            Signal::Update | Signal::ToolBatch => {
                active.events += 1;
                if active.events > self.config.max_turn_events {
                    fx.push(Effect::AbortEngine {
                        turn,
                        teardown: true,
                    });
                    active.drop_steers(SteerDropReason::TurnEnded, fx);
                    self.settle(now, Terminal::failed(ErrorKind::TurnTooLong), fx);
                } else {
                    fx.push(Effect::Deliver { turn });
                }
            }
            Signal::Result(reason) => {
                if active.steers.is_empty() {
                    self.settle(now, Terminal::Completed(reason), fx);
                } else {
                    active.result = Some((reason, now));
                }
            }
            Signal::Idle => {
                active.drop_steers(SteerDropReason::TurnEnded, fx);
                let terminal = match active.result {
                    Some((reason, _)) => Terminal::Completed(reason),
                    None => Terminal::failed(ErrorKind::NoResult),
                };
                self.settle(now, terminal, fx);
            }
            Signal::SteerReceipt(steer, receipt) => {
                let Some(pos) = active.steers.iter().position(|s| s.id == steer) else {
                    // A receipt for a steer this turn does not hold.
                    fx.push(Effect::Stale { turn });
                    return;
                };
                let held = active.steers.remove(pos);
                match receipt {
                    SteerReceipt::Consumed => {
                        // The engine goes on with the steer: a new result is due.
                        active.result = None;
                        fx.push(Effect::SteerConsumed {
                            steer,
                            prompt: active.prompt,
                            turn: active.turn,
                            text: held.text,
                        });
                    }
                    SteerReceipt::Dropped => {
                        fx.push(Effect::SteerDropped {
                            steer,
                            reason: SteerDropReason::Engine,
                            prompt: active.prompt,
                            turn: active.turn,
                            text: held.text,
                        });
                        if let (Some((reason, _)), true) = (active.result, active.steers.is_empty())
                        {
                            self.settle(now, Terminal::Completed(reason), fx);
                        }
                    }
                }
            }
            Signal::Failed(kind, message) => {
                self.settle(now, Terminal::Failed { kind, message }, fx);
            }
            Signal::Exited(panic) => {
                active.drop_steers(SteerDropReason::TurnEnded, fx);
                let terminal = match (active.result, panic) {
                    (Some((reason, _)), _) => Terminal::Completed(reason),
                    (None, panic) => Terminal::Failed {
                        kind: ErrorKind::EngineCrashed,
                        message: match panic {
                            Some(why) => format!(
                                "{} ({})",
                                ErrorKind::EngineCrashed.default_message(),
                                why.chars().take(200).collect::<String>()
                            ),
                            None => "The engine stopped without finishing this turn.".into(),
                        },
                    },
                };
                self.settle(now, terminal, fx);
            }
        }
    }

    fn loop_trip(
        &mut self,
        now: Millis,
        turn: TurnId,
        loop_type: LoopType,
        fx: &mut Vec<Effect<P, S>>,
    ) {
        let Some(active) = self.active.as_mut().filter(|a| a.turn == turn) else {
            fx.push(Effect::Stale { turn });
            return;
        };
        active.last_signal = now;
        fx.push(Effect::AbortEngine {
            turn,
            teardown: true,
        });
        active.drop_steers(SteerDropReason::TurnEnded, fx);
        let terminal = match (&active.phase, active.origin) {
            // A cancel received first wins.
            (Phase::Cancelling { .. }, _) => Terminal::Completed(StopReason::Cancelled),
            (Phase::Running, Origin::Interactive) => {
                Terminal::failed(ErrorKind::LoopDetected(loop_type))
            }
            (Phase::Running, _) => {
                active.loop_stopped = true;
                fx.push(Effect::LoopStopped {
                    prompt: active.prompt,
                    turn,
                    loop_type,
                });
                Terminal::Completed(StopReason::EndTurn)
            }
        };
        self.settle(now, terminal, fx);
    }

    /// Applies every deadline that has passed at `now`.
    fn expire(&mut self, now: Millis, fx: &mut Vec<Effect<P, S>>) {
        if let Some(w) = self.winding.filter(|w| now >= w.until) {
            self.winding = None;
            fx.push(Effect::WatchdogFired {
                kind: WatchdogKind::CancelGrace,
            });
            fx.push(Effect::EngineStopped { turn: w.turn });
            self.next(now, fx);
        }
        let Some(active) = self.active.as_mut() else {
            return;
        };
        if let Phase::Cancelling { at } = active.phase {
            if now >= at + self.config.cancel_grace {
                fx.push(Effect::WatchdogFired {
                    kind: WatchdogKind::CancelGrace,
                });
                fx.push(Effect::AbortEngine {
                    turn: active.turn,
                    teardown: true,
                });
                self.settle(now, Terminal::Completed(StopReason::Cancelled), fx);
            }
            return;
        }
        if let Some((reason, result_at)) = active.result {
            let timeout = self.config.steer_receipt_timeout;
            let (expired, kept): (Vec<_>, Vec<_>) = active
                .steers
                .drain(..)
                .partition(|s| now >= s.accepted_at.max(result_at) + timeout);
            active.steers = kept;
            for s in expired {
                fx.push(Effect::WatchdogFired {
                    kind: WatchdogKind::SteerReceipt,
                });
                fx.push(Effect::SteerDropped {
                    steer: s.id,
                    reason: SteerDropReason::ReceiptTimeout,
                    prompt: active.prompt,
                    turn: active.turn,
                    text: s.text,
                });
            }
            if active.steers.is_empty() {
                self.settle(now, Terminal::Completed(reason), fx);
                return;
            }
        }
        if now >= active.last_signal + self.config.stall_timeout {
            fx.push(Effect::WatchdogFired {
                kind: WatchdogKind::Stall,
            });
            fx.push(Effect::AbortEngine {
                turn: active.turn,
                teardown: true,
            });
            active.drop_steers(SteerDropReason::TurnEnded, fx);
            self.settle(now, Terminal::failed(ErrorKind::Stalled), fx);
        }
    }

    /// Publishes the running turn's terminal, then starts the next queued
    /// prompt or reports the session idle.
    fn settle(&mut self, now: Millis, terminal: Terminal, fx: &mut Vec<Effect<P, S>>) {
        let Some(active) = self.active.take() else {
            return;
        };
        fx.push(Effect::Settled {
            prompt: active.prompt,
            turn: Some(active.turn),
            origin: active.origin,
            terminal,
            loop_stopped: active.loop_stopped,
            payload: active.payload,
        });
        if self.winding.is_none() {
            self.next(now, fx);
        }
    }

    /// Starts the next queued prompt, or reports the session idle.
    fn next(&mut self, now: Millis, fx: &mut Vec<Effect<P, S>>) {
        // Interactive prompts first (FIFO), then channel prompts.
        let next = self
            .queue
            .iter()
            .position(|w| w.origin == Origin::Interactive)
            .or_else(|| self.queue.iter().position(|w| w.origin == Origin::Channel))
            .or(if self.queue.is_empty() { None } else { Some(0) });
        // Closing emptied the queue; nothing starts then in any case.
        let next = next.filter(|_| !self.closing);
        match next.and_then(|i| self.queue.remove(i)) {
            Some(w) => {
                self.start(now, w.prompt, w.origin, w.payload, true, fx);
            }
            None => {
                fx.push(Effect::Idle);
                if !self.closing {
                    self.poll_from(0, fx);
                }
            }
        }
    }

    /// Polls the automatic queues that may have work, from `i` on (or
    /// stops when none is left, unless a kick asked for another round).
    fn poll_from(&mut self, i: usize, fx: &mut Vec<Effect<P, S>>) {
        let next = (i..self.automatic.len()).find(|j| self.maybe & (1 << j) != 0);
        match next {
            Some(j) => {
                self.polling = Some(j);
                self.poll_seq += 1;
                fx.push(Effect::Poll {
                    origin: self.automatic[j],
                    poll: self.poll_seq,
                });
            }
            None if std::mem::take(&mut self.rekick) => {
                self.polling = None;
                self.poll_from(0, fx);
            }
            None => self.polling = None,
        }
    }

    fn offer(
        &mut self,
        now: Millis,
        origin: Origin,
        poll: u64,
        work: Option<(PromptId, P)>,
        fx: &mut Vec<Effect<P, S>>,
    ) -> Answer<P> {
        // Only the answer to the current poll counts: an answer to an older
        // one may rest on state that has changed since.
        let expected = self.polling.filter(|i| {
            poll == self.poll_seq && self.automatic.get(*i) == Some(&origin) && !self.busy()
        });
        match (expected, work) {
            (Some(_), Some((prompt, payload))) => {
                self.polling = None;
                let turn = self.start(now, prompt, origin, payload, true, fx);
                Answer::Started { turn }
            }
            (Some(i), None) => {
                // Empty, unless a kick since the poll may have brought work.
                if !self.rekick {
                    self.maybe &= !(1 << i);
                }
                self.poll_from(i + 1, fx);
                Answer::None
            }
            // Not asked for, or the session got busy meanwhile.
            (None, Some((prompt, payload))) => Answer::OfferRefused {
                origin,
                prompt,
                payload,
            },
            (None, None) => Answer::None,
        }
    }

    /// The earliest deadline: the winding engine's grace, the running
    /// turn's bounds.
    fn next_deadline(&self) -> Option<Millis> {
        let winding = self.winding.map(|w| w.until);
        let active = self.turn_deadline();
        match (winding, active) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The earliest deadline of the running turn.
    fn turn_deadline(&self) -> Option<Millis> {
        let active = self.active.as_ref()?;
        if let Phase::Cancelling { at } = active.phase {
            return Some(at + self.config.cancel_grace);
        }
        let stall = active.last_signal + self.config.stall_timeout;
        let receipt = active.result.and_then(|(_, result_at)| {
            active
                .steers
                .iter()
                .map(|s| s.accepted_at.max(result_at) + self.config.steer_receipt_timeout)
                .min()
        });
        Some(receipt.map_or(stall, |r| r.min(stall)))
    }

    fn rearm(&mut self, fx: &mut Vec<Effect<P, S>>) {
        let at = self.next_deadline();
        if at != self.armed {
            self.armed = at;
            fx.push(Effect::ArmTimer { at });
        }
    }
}

/// The terminal of a queued prompt that never started.
fn never_started<P, S>(w: Waiting<P>) -> Effect<P, S> {
    Effect::Settled {
        prompt: w.prompt,
        turn: None,
        origin: w.origin,
        terminal: Terminal::Completed(StopReason::Cancelled),
        loop_stopped: false,
        payload: w.payload,
    }
}

#[cfg(test)]
mod tests;
