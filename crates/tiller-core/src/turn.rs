//! The session's turn core: admission, the running turn, settlement,
//! steering, cancellation and timers, as one pure state machine.
//!
//! `SessionCore::on(now, input)` returns the effects the session actor must
//! carry out, in order. Rules (see `turn-lifecycle.md`):
//!
//! * every admitted prompt gets exactly one [`Effect::Settled`];
//! * signals are tagged with a [`TurnId`]; a signal for any turn but the
//!   running one is [`Effect::Stale`] and changes nothing;
//! * every waiting state has a deadline owned here ([`Effect::ArmTimer`]), so
//!   with a silent engine every turn settles within the largest timer;
//! * a cancel received before settlement makes the terminal `cancelled`;
//! * after a terminal, the next queued prompt starts or [`Effect::Idle`] is
//!   emitted, always after the [`Effect::Settled`].

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
pub enum IdleBehavior {
    /// Start a new interactive prompt with this id (the default).
    StartNewTurn(PromptId),
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

/// Everything that can happen to a session's turns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A prompt asks to run. The actor has already validated and stored it.
    Prompt { prompt: PromptId, origin: Origin },
    /// A steer for the running turn.
    Steer {
        steer: SteerId,
        idle_behavior: IdleBehavior,
    },
    /// `session/cancel`.
    Cancel,
    /// The session closes (or the daemon drains): the running turn is
    /// cancelled, every queued prompt of any origin settles `cancelled`,
    /// and nothing starts any more (prompts are refused, offers handed
    /// back, queues not polled). Work still in the queue actors stays
    /// there, durable, for a reopen.
    Close,
    /// An engine signal.
    Signal { turn: TurnId, signal: Signal },
    /// The tool pipeline's loop guard tripped in this turn (the offending
    /// calls are already failed and the engine must stop).
    LoopTrip { turn: TurnId, loop_type: LoopType },
    /// The tool pipeline finished a call of this turn. While tools run the
    /// engine is silent on purpose; this is progress for the stall bound,
    /// and nothing else.
    ToolProgress { turn: TurnId },
    /// A timer armed by [`Effect::ArmTimer`] fired (or any wake-up: the core
    /// re-checks every deadline against `now`).
    Tick,
    /// Automatic work may be waiting (a queue actor got some): poll the
    /// queues if the session is idle.
    Kick,
    /// A queue actor's answer to [`Effect::Poll`]: its next due work for
    /// this session, as a prompt, or nothing.
    Offer {
        origin: Origin,
        /// The poll this answers (from [`Effect::Poll`]); an answer to an
        /// older poll is stale.
        poll: u64,
        prompt: Option<PromptId>,
    },
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
    NoRunningTurn,
    TurnCancelling,
    /// The session is closing: a steer cannot start a turn.
    SessionClosing,
}

/// The answer to a steer request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteerOutcome {
    /// The steer joins the running turn.
    Injected { turn: TurnId },
    /// Nothing was consumed; the client must send a prompt.
    PromptRequired(SteerRefusal),
    /// No turn was running: the steer became a new prompt.
    StartedNewTurn { prompt: PromptId },
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
    Stall,
    CancelGrace,
    SteerReceipt,
}

/// What the actor must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The prompt waits behind the running turn; `depth` counts it.
    Queued { prompt: PromptId, depth: usize },
    /// The prompt was refused and never admitted.
    Rejected { prompt: PromptId, reason: Rejection },
    /// Start the engine on this prompt with a fresh turn id.
    StartTurn {
        prompt: PromptId,
        turn: TurnId,
        origin: Origin,
    },
    /// The content of the signal just given belongs to the running turn:
    /// publish it (updates) or run it (tool batches).
    Deliver { turn: TurnId },
    /// The answer to a steer request.
    SteerAnswer {
        steer: SteerId,
        outcome: SteerOutcome,
    },
    /// Hand an injected steer to the engine.
    ForwardSteer { turn: TurnId, steer: SteerId },
    /// The engine consumed the steer (of this prompt's turn).
    SteerConsumed {
        steer: SteerId,
        prompt: PromptId,
        turn: TurnId,
    },
    /// The steer was dropped; clients may resend its text.
    SteerDropped {
        steer: SteerId,
        reason: SteerDropReason,
        prompt: PromptId,
        turn: TurnId,
    },
    /// Ask the engine to stop (cancel, stall, ...). `teardown` means the
    /// engine had its chance: stop its task now.
    AbortEngine { turn: TurnId, teardown: bool },
    /// The prompt's one terminal. Publish it, answer its owner.
    Settled {
        prompt: PromptId,
        turn: Option<TurnId>,
        origin: Origin,
        terminal: Terminal,
    },
    /// The signal belonged to another turn and was dropped.
    Stale { turn: TurnId },
    /// Loop protection stopped an automatic turn, which resolves `end_turn`;
    /// record a `loop_stopped` event (before its `Settled`).
    LoopStopped {
        prompt: PromptId,
        turn: TurnId,
        loop_type: LoopType,
    },
    /// A watchdog bound was reached.
    WatchdogFired { kind: WatchdogKind },
    /// Wake the core with [`Input::Tick`] at this time (replaces any earlier
    /// request; `None` means no timer is needed).
    ArmTimer { at: Option<Millis> },
    /// Nothing runs and nothing is queued: the queue actors may offer work.
    Idle,
    /// Ask the queue actor of `origin` for its next due work; its answer
    /// must carry `poll`.
    Poll { origin: Origin, poll: u64 },
    /// An offer came when the session could not take it: hand it back to
    /// its queue (it is offered again at the next idle).
    OfferRefused { origin: Origin, prompt: PromptId },
}

/// A steer handed to the engine that has no receipt yet.
#[derive(Clone, Debug)]
struct OutstandingSteer {
    /// Which steer.
    id: SteerId,
    /// When it was accepted; with a recorded result, its receipt deadline
    /// runs from the later of this and the result.
    accepted_at: Millis,
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

/// The one unsettled turn.
#[derive(Clone, Debug)]
struct ActiveTurn {
    /// The prompt that owns completion.
    prompt: PromptId,
    /// Its turn id; signals with any other id are stale.
    turn: TurnId,
    /// Decides the terminal of loop stops and labels metrics.
    origin: Origin,
    /// Running or cancelling.
    phase: Phase,
    /// The result recorded while steers were outstanding, and when.
    result: Option<(StopReason, Millis)>,
    /// Steers handed to the engine without a receipt, oldest first.
    steers: Vec<OutstandingSteer>,
    /// Time of the last signal of this turn (the stall watchdog runs from it).
    last_signal: Millis,
    /// Content signals so far (bounded by `max_turn_events`).
    events: u64,
}

impl ActiveTurn {
    /// Drops every outstanding steer, reporting each with `reason`.
    fn drop_steers(&mut self, reason: SteerDropReason, fx: &mut Vec<Effect>) {
        for s in self.steers.drain(..) {
            fx.push(Effect::SteerDropped {
                steer: s.id,
                reason,
                prompt: self.prompt,
                turn: self.turn,
            });
        }
    }
}

/// The turn state of one session.
#[derive(Clone, Debug)]
pub struct SessionCore {
    /// Timers and bounds.
    config: TurnConfig,
    /// The last turn id handed out (monotonic per session).
    last_turn: u64,
    /// The unsettled turn, if any.
    active: Option<ActiveTurn>,
    /// Prompts waiting behind the running turn, FIFO within each origin;
    /// interactive ones are taken first, then channel ones.
    queue: VecDeque<(PromptId, Origin)>,
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

impl SessionCore {
    /// A core whose next turn id is `last_turn + 1` (restored sessions pass
    /// the highest turn id they ever used, so old signals stay stale).
    pub fn new(config: TurnConfig, last_turn: u64) -> Self {
        Self {
            config,
            last_turn,
            active: None,
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

    /// True once the session is closing (nothing starts any more).
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// True while the running turn is being cancelled.
    pub fn is_cancelling(&self) -> bool {
        matches!(
            self.active.as_ref().map(|a| &a.phase),
            Some(Phase::Cancelling { .. })
        )
    }

    /// Queued prompts, oldest first.
    pub fn queued(&self) -> impl Iterator<Item = PromptId> + '_ {
        self.queue.iter().map(|(p, _)| *p)
    }

    /// The highest turn id handed out so far.
    pub fn last_turn(&self) -> TurnId {
        TurnId(self.last_turn)
    }

    /// Feeds one input at time `now`; returns the effects, in order.
    pub fn on(&mut self, now: Millis, input: Input) -> Vec<Effect> {
        let mut fx = Vec::new();
        match input {
            Input::Prompt { prompt, origin } => self.prompt(now, prompt, origin, &mut fx),
            Input::Steer {
                steer,
                idle_behavior,
            } => self.steer(now, steer, idle_behavior, &mut fx),
            Input::Cancel => self.cancel(now, &mut fx),
            Input::Close => self.close(now, &mut fx),
            Input::Signal { turn, signal } => self.signal(now, turn, signal, &mut fx),
            Input::LoopTrip { turn, loop_type } => self.loop_trip(now, turn, loop_type, &mut fx),
            Input::ToolProgress { turn } => {
                if let Some(active) = self.active.as_mut().filter(|a| a.turn == turn) {
                    active.last_signal = now;
                }
            }
            Input::Tick => {}
            Input::Kick => {
                self.maybe = u64::MAX;
                if self.polling.is_some() {
                    self.rekick = true;
                } else if self.active.is_none() && !self.closing {
                    self.poll_from(0, &mut fx);
                }
            }
            Input::Offer {
                origin,
                poll,
                prompt,
            } => self.offer(now, origin, poll, prompt, &mut fx),
        }
        // Deadlines after the input: a signal that arrives late still counts.
        self.expire(now, &mut fx);
        self.rearm(&mut fx);
        fx
    }

    fn prompt(&mut self, now: Millis, prompt: PromptId, origin: Origin, fx: &mut Vec<Effect>) {
        if self.closing {
            fx.push(Effect::Rejected {
                prompt,
                reason: Rejection::Closed,
            });
            return;
        }
        let same_class = self
            .queue
            .iter()
            .filter(|(_, o)| (*o == Origin::Interactive) == (origin == Origin::Interactive))
            .count();
        if self.active.is_none() {
            // A prompt beats automatic work being polled for: late offers
            // are refused and handed back.
            self.polling = None;
            self.start(now, prompt, origin, fx);
        } else if same_class >= self.config.max_queued_prompts {
            fx.push(Effect::Rejected {
                prompt,
                reason: Rejection::Overloaded,
            });
        } else {
            self.queue.push_back((prompt, origin));
            fx.push(Effect::Queued {
                prompt,
                depth: self.queue.len(),
            });
        }
    }

    fn start(&mut self, now: Millis, prompt: PromptId, origin: Origin, fx: &mut Vec<Effect>) {
        // A poll round a start interrupts is over (late offers are refused);
        // a kick during it already set the queues' flags.
        self.polling = None;
        self.rekick = false;
        self.last_turn += 1;
        let turn = TurnId(self.last_turn);
        self.active = Some(ActiveTurn {
            prompt,
            turn,
            origin,
            phase: Phase::Running,
            result: None,
            steers: Vec::new(),
            last_signal: now,
            events: 0,
        });
        fx.push(Effect::StartTurn {
            prompt,
            turn,
            origin,
        });
    }

    fn steer(&mut self, now: Millis, steer: SteerId, idle: IdleBehavior, fx: &mut Vec<Effect>) {
        let Some(active) = self.active.as_mut() else {
            if self.closing {
                fx.push(Effect::SteerAnswer {
                    steer,
                    outcome: SteerOutcome::PromptRequired(SteerRefusal::SessionClosing),
                });
                return;
            }
            match idle {
                IdleBehavior::PromptRequired => fx.push(Effect::SteerAnswer {
                    steer,
                    outcome: SteerOutcome::PromptRequired(SteerRefusal::NoRunningTurn),
                }),
                IdleBehavior::StartNewTurn(prompt) => {
                    fx.push(Effect::SteerAnswer {
                        steer,
                        outcome: SteerOutcome::StartedNewTurn { prompt },
                    });
                    self.start(now, prompt, Origin::Interactive, fx);
                }
            }
            return;
        };
        if active.phase != Phase::Running {
            fx.push(Effect::SteerAnswer {
                steer,
                outcome: SteerOutcome::PromptRequired(SteerRefusal::TurnCancelling),
            });
            return;
        }
        active.steers.push(OutstandingSteer {
            id: steer,
            accepted_at: now,
        });
        fx.push(Effect::SteerAnswer {
            steer,
            outcome: SteerOutcome::Injected { turn: active.turn },
        });
        fx.push(Effect::ForwardSteer {
            turn: active.turn,
            steer,
        });
    }

    fn cancel(&mut self, now: Millis, fx: &mut Vec<Effect>) {
        // Queued interactive prompts are cancelled, each with its own result.
        let (cancelled, kept): (Vec<_>, Vec<_>) = self
            .queue
            .drain(..)
            .partition(|(_, o)| *o == Origin::Interactive);
        self.queue = kept.into();
        let Some(active) = self.active.as_mut() else {
            // Nothing is unsettled, so nothing can be queued behind it.
            debug_assert!(cancelled.is_empty());
            return;
        };
        for (prompt, origin) in cancelled {
            fx.push(Effect::Settled {
                prompt,
                turn: None,
                origin,
                terminal: Terminal::Completed(StopReason::Cancelled),
            });
        }
        if active.phase != Phase::Running {
            return; // a repeated cancel extends nothing
        }
        active.phase = Phase::Cancelling { at: now };
        active.drop_steers(SteerDropReason::Cancelled, fx);
        fx.push(Effect::AbortEngine {
            turn: active.turn,
            teardown: false,
        });
    }

    fn close(&mut self, now: Millis, fx: &mut Vec<Effect>) {
        if self.closing {
            return;
        }
        self.closing = true;
        self.polling = None;
        for (prompt, origin) in std::mem::take(&mut self.queue) {
            fx.push(Effect::Settled {
                prompt,
                turn: None,
                origin,
                terminal: Terminal::Completed(StopReason::Cancelled),
            });
        }
        if self.active.is_some() {
            self.cancel(now, fx);
        } else {
            fx.push(Effect::Idle);
        }
    }

    fn signal(&mut self, now: Millis, turn: TurnId, signal: Signal, fx: &mut Vec<Effect>) {
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
                active.steers.remove(pos);
                match receipt {
                    SteerReceipt::Consumed => {
                        // The engine goes on with the steer: a new result is due.
                        active.result = None;
                        fx.push(Effect::SteerConsumed {
                            steer,
                            prompt: active.prompt,
                            turn: active.turn,
                        });
                    }
                    SteerReceipt::Dropped => {
                        fx.push(Effect::SteerDropped {
                            steer,
                            reason: SteerDropReason::Engine,
                            prompt: active.prompt,
                            turn: active.turn,
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

    fn loop_trip(&mut self, now: Millis, turn: TurnId, loop_type: LoopType, fx: &mut Vec<Effect>) {
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
    fn expire(&mut self, now: Millis, fx: &mut Vec<Effect>) {
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
            let mut expired = Vec::new();
            active.steers.retain(|s| {
                let due = s.accepted_at.max(result_at) + timeout;
                if now >= due {
                    expired.push(s.id);
                }
                now < due
            });
            for steer in expired {
                fx.push(Effect::WatchdogFired {
                    kind: WatchdogKind::SteerReceipt,
                });
                fx.push(Effect::SteerDropped {
                    steer,
                    reason: SteerDropReason::ReceiptTimeout,
                    prompt: active.prompt,
                    turn: active.turn,
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
    fn settle(&mut self, now: Millis, terminal: Terminal, fx: &mut Vec<Effect>) {
        let Some(active) = self.active.take() else {
            return;
        };
        fx.push(Effect::Settled {
            prompt: active.prompt,
            turn: Some(active.turn),
            origin: active.origin,
            terminal,
        });
        // Interactive prompts first (FIFO), then channel prompts.
        let next = self
            .queue
            .iter()
            .position(|(_, o)| *o == Origin::Interactive)
            .or_else(|| self.queue.iter().position(|(_, o)| *o == Origin::Channel))
            .or(if self.queue.is_empty() { None } else { Some(0) });
        // Closing emptied the queue; nothing starts then in any case.
        let next = next.filter(|_| !self.closing);
        match next.and_then(|i| self.queue.remove(i)) {
            Some((prompt, origin)) => self.start(now, prompt, origin, fx),
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
    fn poll_from(&mut self, i: usize, fx: &mut Vec<Effect>) {
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
        prompt: Option<PromptId>,
        fx: &mut Vec<Effect>,
    ) {
        // Only the answer to the current poll counts: an answer to an older
        // one may rest on state that has changed since.
        let expected = self.polling.filter(|i| {
            poll == self.poll_seq
                && self.automatic.get(*i) == Some(&origin)
                && self.active.is_none()
        });
        match (expected, prompt) {
            (Some(_), Some(prompt)) => {
                self.polling = None;
                self.start(now, prompt, origin, fx);
            }
            (Some(i), None) => {
                // Empty, unless a kick since the poll may have brought work.
                if !self.rekick {
                    self.maybe &= !(1 << i);
                }
                self.poll_from(i + 1, fx);
            }
            // Not asked for, or the session got busy meanwhile.
            (None, Some(prompt)) => fx.push(Effect::OfferRefused { origin, prompt }),
            (None, None) => {}
        }
    }

    /// The earliest deadline of the running turn.
    fn next_deadline(&self) -> Option<Millis> {
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

    fn rearm(&mut self, fx: &mut Vec<Effect>) {
        let at = self.next_deadline();
        if at != self.armed {
            self.armed = at;
            fx.push(Effect::ArmTimer { at });
        }
    }
}

#[cfg(test)]
mod tests;
