//! Conformance cases of `turn-lifecycle.md`, at the core level.

use super::*;
use crate::LoopType;

const CFG: TurnConfig = TurnConfig {
    steer_receipt_timeout: 100,
    cancel_grace: 20,
    stall_timeout: 1_000,
    max_queued_prompts: 2,
    max_turn_events: 100_000,
};

/// A core plus the clock, recording every effect.
struct Harness {
    core: SessionCore,
    now: Millis,
    log: Vec<Effect>,
    /// The answer to the last input.
    answer: Answer,
}

impl Harness {
    fn new() -> Self {
        Self {
            core: SessionCore::new(CFG, 0),
            now: 0,
            log: Vec::new(),
            answer: Answer::None,
        }
    }

    fn at(&mut self, now: Millis, input: Input) -> Vec<Effect> {
        self.now = now;
        let step = self.core.on(now, input);
        self.log.extend(step.effects.iter().cloned());
        self.answer = step.answer;
        step.effects
    }

    fn feed(&mut self, input: Input) -> Vec<Effect> {
        self.at(self.now, input)
    }

    fn prompt(&mut self, n: u128) -> PromptId {
        let p = PromptId::from_u128(n);
        self.feed(Input::Prompt {
            prompt: p,
            origin: Origin::Interactive,
            payload: (),
        });
        p
    }

    fn prompt_as(&mut self, n: u128, origin: Origin) -> PromptId {
        let p = PromptId::from_u128(n);
        self.feed(Input::Prompt {
            prompt: p,
            origin,
            payload: (),
        });
        p
    }

    fn sig(&mut self, turn: u64, signal: Signal) -> Vec<Effect> {
        self.feed(Input::Signal {
            turn: TurnId(turn),
            signal,
        })
    }

    fn steer(&mut self, n: u128) -> SteerId {
        let s = SteerId::from_u128(n);
        self.feed(Input::Steer {
            steer: s,
            text: (),
            idle_behavior: IdleBehavior::PromptRequired,
        });
        s
    }

    fn terminals(&self) -> Vec<(PromptId, Terminal)> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Settled {
                    prompt, terminal, ..
                } => Some((*prompt, terminal.clone())),
                _ => None,
            })
            .collect()
    }
}

fn settled(fx: &[Effect]) -> Option<Terminal> {
    fx.iter().find_map(|e| match e {
        Effect::Settled { terminal, .. } => Some(terminal.clone()),
        _ => None,
    })
}

const END: Terminal = Terminal::Completed(StopReason::EndTurn);

#[test]
fn case1_result_settles_without_idle() {
    let mut h = Harness::new();
    h.prompt(1);
    assert_eq!(
        settled(&h.sig(1, Signal::Result(StopReason::EndTurn))),
        Some(END)
    );
    assert_eq!(
        settled(&h.sig(1, Signal::Idle)),
        None,
        "the idle is stale now"
    );
    assert_eq!(h.terminals().len(), 1);
}

#[test]
fn case2_idle_without_result_is_no_result() {
    let mut h = Harness::new();
    h.prompt(1);
    assert_eq!(
        settled(&h.sig(1, Signal::Idle)),
        Some(Terminal::failed(ErrorKind::NoResult))
    );
}

#[test]
fn case3_steer_consumed_then_idle_fails_at_first_idle() {
    let mut h = Harness::new();
    h.prompt(1);
    let s = h.steer(10);
    h.sig(1, Signal::SteerReceipt(s, SteerReceipt::Consumed));
    assert_eq!(
        settled(&h.sig(1, Signal::Idle)),
        Some(Terminal::failed(ErrorKind::NoResult))
    );
    assert!(
        h.sig(1, Signal::Idle)
            .contains(&Effect::Stale { turn: TurnId(1) })
    );
}

#[test]
fn case4_steer_result_idle_drops_steer_and_ends() {
    let mut h = Harness::new();
    let p = h.prompt(1);
    let s = h.steer(10);
    assert_eq!(
        settled(&h.sig(1, Signal::Result(StopReason::EndTurn))),
        None
    );
    let fx = h.sig(1, Signal::Idle);
    assert!(fx.contains(&Effect::SteerDropped {
        steer: s,
        reason: SteerDropReason::TurnEnded,
        prompt: p,
        turn: TurnId(1),
        text: (),
    }));
    assert_eq!(settled(&fx), Some(END));
}

#[test]
fn case5_result_without_idle_plain_and_steered() {
    let mut h = Harness::new();
    h.prompt(1);
    assert_eq!(
        settled(&h.sig(1, Signal::Result(StopReason::EndTurn))),
        Some(END)
    );

    let mut h = Harness::new();
    h.prompt(1);
    let s = h.steer(10);
    h.sig(1, Signal::SteerReceipt(s, SteerReceipt::Consumed));
    assert_eq!(
        settled(&h.sig(1, Signal::Result(StopReason::EndTurn))),
        Some(END)
    );
}

#[test]
fn case6_stale_signals_change_nothing() {
    let mut h = Harness::new();
    h.prompt(1);
    h.sig(1, Signal::Result(StopReason::EndTurn));
    h.prompt(2); // turn 2
    for stale in [Signal::Idle, Signal::Result(StopReason::Refusal)] {
        assert_eq!(h.sig(1, stale), vec![Effect::Stale { turn: TurnId(1) }]);
    }
    assert_eq!(
        settled(&h.sig(2, Signal::Result(StopReason::EndTurn))),
        Some(END)
    );
    assert_eq!(h.terminals().len(), 2);
}

#[test]
fn case7_steer_then_silence_is_bounded() {
    // Steer and a result, then silence: settles at the receipt timeout.
    let mut h = Harness::new();
    h.prompt(1);
    h.steer(10);
    h.at(
        5,
        Input::Signal {
            turn: TurnId(1),
            signal: Signal::Result(StopReason::EndTurn),
        },
    );
    assert_eq!(settled(&h.at(104, Input::Tick)), None);
    assert_eq!(settled(&h.at(105, Input::Tick)), Some(END));

    // Steer and total silence: the stall bound ends it.
    let mut h = Harness::new();
    h.prompt(1);
    h.steer(10);
    assert_eq!(settled(&h.at(999, Input::Tick)), None);
    assert_eq!(
        settled(&h.at(1_000, Input::Tick)),
        Some(Terminal::failed(ErrorKind::Stalled))
    );
}

#[test]
fn case8_cancel_then_silence_settles_within_grace() {
    let mut h = Harness::new();
    h.prompt(1);
    let fx = h.at(10, Input::Cancel(EngineStop::Answered));
    assert!(fx.contains(&Effect::AbortEngine {
        turn: TurnId(1),
        teardown: false
    }));
    assert!(fx.contains(&Effect::ArmTimer { at: Some(30) }));
    assert_eq!(settled(&h.at(29, Input::Tick)), None);
    let fx = h.at(30, Input::Tick);
    assert_eq!(
        settled(&fx),
        Some(Terminal::Completed(StopReason::Cancelled))
    );
    assert!(fx.contains(&Effect::AbortEngine {
        turn: TurnId(1),
        teardown: true
    }));
}

/// An engine whose every act goes through the session: its turn settles
/// at the cancel, and a prompt sent then waits until the engine's last
/// word, which is the engine's end (not a stale signal).
#[test]
fn case8_behind_cancel_settles_at_once_and_the_next_turn_waits_for_the_engine() {
    let cancelled = Terminal::Completed(StopReason::Cancelled);
    let mut h = Harness::new();
    h.prompt(1);
    let fx = h.at(10, Input::Cancel(EngineStop::Behind));
    let abort = fx.iter().position(|e| {
        *e == Effect::AbortEngine {
            turn: TurnId(1),
            teardown: false,
        }
    });
    let settle = fx.iter().position(|e| matches!(e, Effect::Settled { .. }));
    assert!(abort < settle && abort.is_some(), "{fx:?}");
    assert_eq!(settled(&fx), Some(cancelled.clone()));
    assert!(
        !fx.contains(&Effect::Idle),
        "not idle while it stops: {fx:?}"
    );
    assert!(fx.contains(&Effect::ArmTimer { at: Some(30) }));
    assert!(h.core.is_cancelling() && h.core.busy() && !h.core.parkable());
    assert_eq!(h.core.winding(), Some(TurnId(1)));
    // Meanwhile a prompt queues, a steer is refused, content is stale.
    let p2 = h.prompt(2);
    assert_eq!(h.answer, Answer::Queued { depth: 1 });
    h.feed(Input::Steer {
        steer: SteerId::from_u128(9),
        text: (),
        idle_behavior: IdleBehavior::StartNewTurn(PromptId::from_u128(10), ()),
    });
    assert_eq!(
        h.answer,
        Answer::Steer {
            outcome: SteerOutcome::PromptRequired(SteerRefusal::TurnCancelling),
            unused: Some(()),
        }
    );
    assert_eq!(
        h.sig(1, Signal::Update),
        vec![Effect::Stale { turn: TurnId(1) }]
    );
    // Its last word: the engine is gone, then the next turn starts.
    let fx = h.at(
        12,
        Input::Signal {
            turn: TurnId(1),
            signal: Signal::Result(StopReason::Cancelled),
        },
    );
    let gone = fx
        .iter()
        .position(|e| *e == Effect::EngineStopped { turn: TurnId(1) });
    let start = fx.iter().position(|e| {
        matches!(e, Effect::StartTurn { prompt, turn: TurnId(2), deferred: true, .. } if *prompt == p2)
    });
    assert!(gone.is_some() && gone < start, "{fx:?}");
    assert_eq!(settled(&fx), None);
    assert_eq!(h.terminals(), vec![(PromptId::from_u128(1), cancelled)]);
    // Later words of the old engine are stale.
    assert_eq!(
        h.sig(1, Signal::Idle),
        vec![Effect::Stale { turn: TurnId(1) }]
    );
}

/// A silent engine is torn down at its grace, and only then does the
/// session go idle (or start what waits).
#[test]
fn a_silent_engine_behind_its_settled_turn_is_torn_down_at_the_grace() {
    let mut h = Harness::new();
    h.prompt(1);
    h.at(10, Input::Cancel(EngineStop::Behind));
    // A repeated cancel extends nothing.
    let fx = h.at(15, Input::Cancel(EngineStop::Behind));
    assert!(fx.is_empty(), "{fx:?}");
    assert!(h.at(29, Input::Tick).is_empty());
    let fx = h.at(30, Input::Tick);
    assert_eq!(
        fx,
        vec![
            Effect::WatchdogFired {
                kind: WatchdogKind::CancelGrace
            },
            Effect::EngineStopped { turn: TurnId(1) },
            Effect::Idle,
            Effect::ArmTimer { at: None },
        ]
    );
    assert!(h.core.parkable());
    assert_eq!(h.terminals().len(), 1);
}

/// A cancel while the engine stops cancels what was queued since; a close
/// then reports the session idle only at the engine's end.
#[test]
fn behind_a_stopping_engine_a_cancel_cancels_the_queued_and_a_close_waits() {
    let cancelled = Terminal::Completed(StopReason::Cancelled);
    let mut h = Harness::new();
    let p1 = h.prompt(1);
    h.at(10, Input::Cancel(EngineStop::Behind));
    let p2 = h.prompt(2);
    let auto = h.prompt_as(3, Origin::Cron);
    let fx = h.feed(Input::Cancel(EngineStop::Behind));
    assert_eq!(settled(&fx), Some(cancelled.clone()), "{fx:?}");
    assert_eq!(h.core.queued().collect::<Vec<_>>(), vec![auto]);
    let fx = h.feed(Input::Close(EngineStop::Behind));
    assert!(!fx.contains(&Effect::Idle), "{fx:?}");
    let fx = h.sig(1, Signal::Exited(None));
    assert_eq!(
        fx[..2],
        [Effect::EngineStopped { turn: TurnId(1) }, Effect::Idle]
    );
    assert_eq!(
        h.terminals(),
        vec![
            (p1, cancelled.clone()),
            (p2, cancelled.clone()),
            (auto, cancelled)
        ]
    );
}

#[test]
fn cancel_wins_over_a_racing_result_or_failure() {
    for racing in [
        Signal::Result(StopReason::EndTurn),
        Signal::Failed(ErrorKind::ModelStreamInterrupted, "x".into()),
        Signal::Idle,
    ] {
        let mut h = Harness::new();
        h.prompt(1);
        h.feed(Input::Cancel(EngineStop::Answered));
        assert_eq!(
            settled(&h.sig(1, racing)),
            Some(Terminal::Completed(StopReason::Cancelled))
        );
    }
}

#[test]
fn cancel_cancels_queued_prompts_each_once_and_repeat_extends_nothing() {
    let mut h = Harness::new();
    let p1 = h.prompt(1);
    let p2 = h.prompt(2);
    let p3 = h.prompt(3);
    h.at(10, Input::Cancel(EngineStop::Answered));
    let fx = h.at(15, Input::Cancel(EngineStop::Answered));
    assert!(!fx.iter().any(|e| matches!(e, Effect::ArmTimer { .. })));
    h.at(30, Input::Tick);
    let t = h.terminals();
    let cancelled = Terminal::Completed(StopReason::Cancelled);
    assert_eq!(
        t,
        vec![
            (p2, cancelled.clone()),
            (p3, cancelled.clone()),
            (p1, cancelled)
        ]
    );
    assert_eq!(h.log.last(), Some(&Effect::ArmTimer { at: None }));
    assert!(h.log.contains(&Effect::Idle));
}

#[test]
fn withdraw_settles_only_its_own_prompt() {
    let mut h = Harness::new();
    let p1 = h.prompt(1);
    let p2 = h.prompt(2);
    let p3 = h.prompt(3);
    let cancelled = Terminal::Completed(StopReason::Cancelled);
    // Queued: settled at once; the others stay.
    let fx = h.feed(Input::Withdraw {
        prompt: p2,
        stop: EngineStop::Answered,
    });
    assert_eq!(settled(&fx), Some(cancelled.clone()));
    assert_eq!(h.core.queued().collect::<Vec<_>>(), vec![p3]);
    // Running: cancelled like session/cancel, and the queued one runs next.
    let fx = h.at(
        10,
        Input::Withdraw {
            prompt: p1,
            stop: EngineStop::Answered,
        },
    );
    assert!(fx.contains(&Effect::AbortEngine {
        turn: TurnId(1),
        teardown: false
    }));
    assert_eq!(h.core.queued().collect::<Vec<_>>(), vec![p3]);
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    assert_eq!(settled(&fx), Some(cancelled.clone()));
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::StartTurn { prompt, .. } if *prompt == p3))
    );
    // Over, or unknown: nothing.
    assert!(
        h.feed(Input::Withdraw {
            prompt: p1,
            stop: EngineStop::Answered
        })
        .is_empty()
    );
    assert!(
        h.feed(Input::Withdraw {
            prompt: PromptId::from_u128(99),
            stop: EngineStop::Answered,
        })
        .is_empty()
    );
    assert_eq!(
        h.terminals(),
        vec![(p2, cancelled.clone()), (p1, cancelled)]
    );
}

#[test]
fn cancel_with_nothing_running_is_a_noop() {
    let mut h = Harness::new();
    assert!(h.feed(Input::Cancel(EngineStop::Answered)).is_empty());
}

#[test]
fn queue_is_fifo_and_bounded() {
    let mut h = Harness::new();
    h.prompt(1);
    let p2 = h.prompt(2);
    let p3 = h.prompt(3);
    let fx = h.feed(Input::Prompt {
        prompt: PromptId::from_u128(4),
        origin: Origin::Interactive,
        payload: (),
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::Rejected {
            reason: Rejection::Overloaded,
            payload: ()
        }
    );
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    assert!(fx.contains(&Effect::StartTurn {
        prompt: p2,
        turn: TurnId(2),
        origin: Origin::Interactive,
        deferred: true,
    }));
    let fx = h.sig(2, Signal::Result(StopReason::EndTurn));
    assert!(fx.contains(&Effect::StartTurn {
        prompt: p3,
        turn: TurnId(3),
        origin: Origin::Interactive,
        deferred: true,
    }));
    let fx = h.sig(3, Signal::Result(StopReason::EndTurn));
    assert_eq!(fx.iter().filter(|e| **e == Effect::Idle).count(), 1);
}

#[test]
fn idle_comes_after_the_terminal() {
    let mut h = Harness::new();
    h.prompt(1);
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    let settled_at = fx
        .iter()
        .position(|e| matches!(e, Effect::Settled { .. }))
        .unwrap();
    let idle_at = fx.iter().position(|e| *e == Effect::Idle).unwrap();
    assert!(settled_at < idle_at);
}

#[test]
fn steering_outcomes() {
    let mut h = Harness::new();
    let s = SteerId::from_u128(1);
    let fx = h.feed(Input::Steer {
        steer: s,
        text: (),
        idle_behavior: IdleBehavior::PromptRequired,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::Steer {
            outcome: SteerOutcome::PromptRequired(SteerRefusal::NoRunningTurn),
            unused: None,
        }
    );
    let p = PromptId::from_u128(9);
    let fx = h.feed(Input::Steer {
        steer: s,
        text: (),
        idle_behavior: IdleBehavior::StartNewTurn(p, ()),
    });
    assert_eq!(
        h.answer,
        Answer::Steer {
            outcome: SteerOutcome::StartedNewTurn { prompt: p },
            unused: None,
        }
    );
    assert!(matches!(fx[0], Effect::StartTurn { prompt, deferred: false, .. } if prompt == p));
    let fx = h.steer(2);
    let _ = fx;
    h.feed(Input::Cancel(EngineStop::Answered));
    let s3 = SteerId::from_u128(3);
    let fx = h.feed(Input::Steer {
        steer: s3,
        text: (),
        idle_behavior: IdleBehavior::PromptRequired,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::Steer {
            outcome: SteerOutcome::PromptRequired(SteerRefusal::TurnCancelling),
            unused: None,
        }
    );
}

#[test]
fn dropped_receipt_after_result_settles() {
    let mut h = Harness::new();
    h.prompt(1);
    let s = h.steer(10);
    h.sig(1, Signal::Result(StopReason::MaxTokens));
    let fx = h.sig(1, Signal::SteerReceipt(s, SteerReceipt::Dropped));
    assert_eq!(
        settled(&fx),
        Some(Terminal::Completed(StopReason::MaxTokens))
    );
}

#[test]
fn consumed_receipt_after_result_waits_for_a_new_result() {
    let mut h = Harness::new();
    h.prompt(1);
    let s = h.steer(10);
    h.sig(1, Signal::Result(StopReason::EndTurn));
    assert_eq!(
        settled(&h.sig(1, Signal::SteerReceipt(s, SteerReceipt::Consumed))),
        None
    );
    // The cleared result no longer bounds the turn by the receipt timer.
    assert_eq!(settled(&h.at(500, Input::Tick)), None);
    assert_eq!(
        settled(&h.sig(1, Signal::Result(StopReason::EndTurn))),
        Some(END)
    );
}

#[test]
fn engine_failure_settles_with_its_kind() {
    let mut h = Harness::new();
    h.prompt(1);
    let fx = h.sig(
        1,
        Signal::Failed(ErrorKind::ModelStreamInterrupted, "broken pipe".into()),
    );
    assert_eq!(
        settled(&fx),
        Some(Terminal::Failed {
            kind: ErrorKind::ModelStreamInterrupted,
            message: "broken pipe".into()
        })
    );
}

#[test]
fn stall_is_measured_from_the_last_signal_of_the_turn() {
    let mut h = Harness::new();
    h.prompt(1);
    h.at(
        900,
        Input::Signal {
            turn: TurnId(1),
            signal: Signal::Update,
        },
    );
    // A stale signal is not progress.
    h.at(
        950,
        Input::Signal {
            turn: TurnId(0),
            signal: Signal::Update,
        },
    );
    assert_eq!(settled(&h.at(1_899, Input::Tick)), None);
    assert_eq!(
        settled(&h.at(1_900, Input::Tick)),
        Some(Terminal::failed(ErrorKind::Stalled))
    );
}

#[test]
fn tool_progress_defers_the_stall_and_nothing_else() {
    let mut h = Harness::new();
    h.prompt(1);
    // Another turn's progress does not count.
    h.at(500, Input::ToolProgress { turn: TurnId(9) });
    assert!(
        h.at(800, Input::ToolProgress { turn: TurnId(1) })
            .iter()
            .all(|e| matches!(e, Effect::ArmTimer { .. }))
    );
    assert_eq!(settled(&h.at(1_799, Input::Tick)), None);
    assert_eq!(
        settled(&h.at(1_800, Input::Tick)),
        Some(Terminal::failed(ErrorKind::Stalled))
    );
    // While cancelling, progress neither settles nor extends the grace.
    let mut h = Harness::new();
    h.prompt(1);
    h.at(100, Input::Cancel(EngineStop::Answered));
    assert_eq!(
        settled(&h.at(110, Input::ToolProgress { turn: TurnId(1) })),
        None
    );
    assert_eq!(settled(&h.at(119, Input::Tick)), None);
    assert_eq!(
        settled(&h.at(120, Input::Tick)),
        Some(Terminal::Completed(StopReason::Cancelled))
    );
}

#[test]
fn restored_core_continues_turn_ids() {
    let mut core: SessionCore = SessionCore::new(CFG, 41);
    let step = core.on(
        0,
        Input::Prompt {
            prompt: PromptId::from_u128(1),
            origin: Origin::Interactive,
            payload: (),
        },
    );
    assert_eq!(step.answer, Answer::Started { turn: TurnId(42) });
    assert!(step.effects.contains(&Effect::StartTurn {
        prompt: PromptId::from_u128(1),
        turn: TurnId(42),
        origin: Origin::Interactive,
        deferred: false,
    }));
}

#[test]
fn case9_loop_trip_racing_a_cancel_that_came_first_is_cancelled() {
    let mut h = Harness::new();
    h.prompt(1);
    h.feed(Input::Cancel(EngineStop::Answered));
    let fx = h.feed(Input::LoopTrip {
        turn: TurnId(1),
        loop_type: LoopType::ConsecutiveIdenticalToolCalls,
    });
    assert_eq!(
        settled(&fx),
        Some(Terminal::Completed(StopReason::Cancelled))
    );
}

#[test]
fn case10_interactive_loop_trip_fails_and_the_queue_drains() {
    let mut h = Harness::new();
    h.prompt(1);
    let p2 = h.prompt(2);
    let fx = h.feed(Input::LoopTrip {
        turn: TurnId(1),
        loop_type: LoopType::RepeatedToolFailure,
    });
    assert_eq!(
        settled(&fx),
        Some(Terminal::failed(ErrorKind::LoopDetected(
            LoopType::RepeatedToolFailure
        )))
    );
    assert!(fx.contains(&Effect::AbortEngine {
        turn: TurnId(1),
        teardown: true
    }));
    assert!(fx.contains(&Effect::StartTurn {
        prompt: p2,
        turn: TurnId(2),
        origin: Origin::Interactive,
        deferred: true,
    }));
}

#[test]
fn case11_automatic_loop_trip_ends_the_turn_with_loop_stopped() {
    for origin in [
        Origin::Cron,
        Origin::Notification,
        Origin::Channel,
        Origin::Goal,
    ] {
        let mut h = Harness::new();
        h.feed(Input::Prompt {
            prompt: PromptId::from_u128(1),
            origin,
            payload: (),
        });
        let fx = h.feed(Input::LoopTrip {
            turn: TurnId(1),
            loop_type: LoopType::TurnToolCallCap,
        });
        let stopped = fx
            .iter()
            .position(|e| matches!(e, Effect::LoopStopped { .. }))
            .expect("loop_stopped");
        let settled_at = fx
            .iter()
            .position(|e| matches!(e, Effect::Settled { .. }))
            .unwrap();
        assert!(stopped < settled_at);
        assert_eq!(settled(&fx), Some(END), "{origin:?}");
        assert!(fx.contains(&Effect::Idle));
    }
}

#[test]
fn a_loop_trip_for_another_turn_is_stale() {
    let mut h = Harness::new();
    h.prompt(1);
    let fx = h.feed(Input::LoopTrip {
        turn: TurnId(0),
        loop_type: LoopType::TurnToolCallCap,
    });
    assert_eq!(fx, vec![Effect::Stale { turn: TurnId(0) }]);
}

#[test]
fn an_engine_that_exits_without_its_terminal_crashed_at_once() {
    // Panicked, or returned without a result: engine_crashed, not a wait
    // for the stall bound.
    for panic in [Some("index out of bounds".to_string()), None] {
        let mut h = Harness::new();
        h.prompt(1);
        h.sig(1, Signal::Update);
        let t = settled(&h.sig(1, Signal::Exited(panic.clone())));
        let Some(Terminal::Failed { kind, message }) = t else {
            panic!("{t:?}")
        };
        assert_eq!(kind, ErrorKind::EngineCrashed);
        if let Some(p) = panic {
            assert!(message.contains(&p), "{message}");
        }
    }
    // A result recorded while a steer was outstanding stands: the steer is
    // dropped, since the engine is gone.
    let mut h = Harness::new();
    let p = h.prompt(1);
    let s = h.steer(10);
    h.sig(1, Signal::Result(StopReason::EndTurn));
    let fx = h.sig(1, Signal::Exited(None));
    assert!(fx.contains(&Effect::SteerDropped {
        steer: s,
        reason: SteerDropReason::TurnEnded,
        prompt: p,
        turn: TurnId(1),
        text: (),
    }));
    assert_eq!(settled(&fx), Some(END));
    // After the terminal, an exit is stale.
    let mut h = Harness::new();
    h.prompt(1);
    h.sig(1, Signal::Result(StopReason::EndTurn));
    let fx = h.sig(1, Signal::Exited(None));
    assert_eq!(settled(&fx), None);
    assert!(fx.contains(&Effect::Stale { turn: TurnId(1) }));
}

#[test]
fn closing_cancels_the_turn_settles_every_queued_prompt_and_starts_nothing() {
    let mut h = Harness::new();
    let running = h.prompt(1);
    let queued = h.prompt_as(2, Origin::Channel);
    let fx = h.feed(Input::Close(EngineStop::Answered));
    // The queued channel prompt settles now, cancelled; the turn is told to abort.
    assert!(fx.iter().any(
        |e| matches!(e, Effect::Settled { prompt, turn: None, terminal, .. }
        if *prompt == queued && *terminal == Terminal::Completed(StopReason::Cancelled))
    ));
    assert!(fx.iter().any(|e| matches!(e, Effect::AbortEngine { .. })));
    // Its engine's next signal settles the running turn cancelled, then idle: no start, no poll.
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Settled { prompt, terminal, .. }
        if *prompt == running && *terminal == Terminal::Completed(StopReason::Cancelled)))
    );
    assert!(fx.contains(&Effect::Idle));
    assert!(
        !fx.iter()
            .any(|e| matches!(e, Effect::StartTurn { .. } | Effect::Poll { .. }))
    );
    // Later prompts, steers, kicks and offers start nothing.
    let p = PromptId::from_u128(99);
    let fx = h.feed(Input::Prompt {
        prompt: p,
        origin: Origin::Interactive,
        payload: (),
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::Rejected {
            reason: Rejection::Closed,
            payload: ()
        }
    );
    assert!(h.feed(Input::Kick).is_empty());
    let fx = h.feed(Input::Steer {
        steer: SteerId::from_u128(5),
        text: (),
        idle_behavior: IdleBehavior::StartNewTurn(PromptId::from_u128(98), ()),
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::Steer {
            outcome: SteerOutcome::PromptRequired(SteerRefusal::SessionClosing),
            unused: Some(()),
        }
    );
    let offered = PromptId::from_u128(97);
    let fx = h.feed(Input::Offer {
        origin: Origin::Cron,
        poll: 1,
        work: Some((offered, ())),
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        h.answer,
        Answer::OfferRefused {
            origin: Origin::Cron,
            prompt: offered,
            payload: ()
        }
    );
}

#[test]
fn a_turn_past_its_event_bound_fails_and_its_engine_is_torn_down() {
    let mut core: SessionCore = SessionCore::new(
        TurnConfig {
            max_turn_events: 3,
            ..CFG
        },
        0,
    );
    let p = PromptId::from_u128(1);
    core.on(
        0,
        Input::Prompt {
            prompt: p,
            origin: Origin::Interactive,
            payload: (),
        },
    );
    let sig = |core: &mut SessionCore, s: Signal| {
        core.on(
            0,
            Input::Signal {
                turn: TurnId(1),
                signal: s,
            },
        )
        .effects
    };
    for _ in 0..3 {
        assert!(sig(&mut core, Signal::Update).contains(&Effect::Deliver { turn: TurnId(1) }));
    }
    let fx = sig(&mut core, Signal::ToolBatch);
    assert!(
        !fx.contains(&Effect::Deliver { turn: TurnId(1) }),
        "past the bound, nothing is delivered"
    );
    assert!(fx.contains(&Effect::AbortEngine {
        turn: TurnId(1),
        teardown: true
    }));
    assert_eq!(settled(&fx), Some(Terminal::failed(ErrorKind::TurnTooLong)));
}

/// Polls in `fx`, as (origin, poll id).
fn polls(fx: &[Effect]) -> Vec<(Origin, u64)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Poll { origin, poll } => Some((*origin, *poll)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_session_without_automatic_work_polls_nothing_when_its_turns_end() {
    let mut h = Harness::new();
    h.core = SessionCore::new(CFG, 0).with_automatic(vec![Origin::Notification, Origin::Cron]);
    // The first turn's end asks each queue once; both are empty.
    h.prompt(1);
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    assert_eq!(polls(&fx), vec![(Origin::Notification, 1)]);
    let fx = h.feed(Input::Offer {
        origin: Origin::Notification,
        poll: 1,
        work: None,
    });
    assert_eq!(polls(&fx), vec![(Origin::Cron, 2)]);
    assert!(
        polls(&h.feed(Input::Offer {
            origin: Origin::Cron,
            poll: 2,
            work: None,
        }))
        .is_empty()
    );
    // Later turns end without a single poll.
    h.prompt(2);
    let fx = h.sig(2, Signal::Result(StopReason::EndTurn));
    assert!(fx.contains(&Effect::Idle));
    assert!(polls(&fx).is_empty(), "{fx:?}");
    // New work (a kick) makes every queue worth asking again.
    assert_eq!(polls(&h.feed(Input::Kick)), vec![(Origin::Notification, 3)]);
}

#[test]
fn a_kick_during_a_poll_round_brings_another_round() {
    let mut h = Harness::new();
    h.core = SessionCore::new(CFG, 0).with_automatic(vec![Origin::Notification, Origin::Cron]);
    assert_eq!(polls(&h.feed(Input::Kick)), vec![(Origin::Notification, 1)]);
    // Work arrives after the notification queue answered, before the
    // answer is handled: its "nothing" must not hide the new work.
    assert!(h.feed(Input::Kick).is_empty());
    let fx = h.feed(Input::Offer {
        origin: Origin::Notification,
        poll: 1,
        work: None,
    });
    assert_eq!(polls(&fx), vec![(Origin::Cron, 2)]);
    let fx = h.feed(Input::Offer {
        origin: Origin::Cron,
        poll: 2,
        work: None,
    });
    assert_eq!(polls(&fx), vec![(Origin::Notification, 3)]);
}

#[test]
fn a_turn_a_steer_starts_mid_poll_ends_that_round() {
    let mut h = Harness::new();
    h.core = SessionCore::new(CFG, 0).with_automatic(vec![Origin::Notification, Origin::Cron]);
    assert_eq!(polls(&h.feed(Input::Kick)), vec![(Origin::Notification, 1)]);
    // A steer while idle starts a turn: the poll round is over.
    h.feed(Input::Steer {
        steer: SteerId::from_u128(1),
        text: (),
        idle_behavior: IdleBehavior::StartNewTurn(PromptId::from_u128(2), ()),
    });
    assert!(!h.core.is_polling());
    // A kick during the turn is no reason for an extra round later.
    assert!(h.feed(Input::Kick).is_empty());
    let fx = h.sig(1, Signal::Result(StopReason::EndTurn));
    assert_eq!(polls(&fx), vec![(Origin::Notification, 2)]);
    let fx = h.feed(Input::Offer {
        origin: Origin::Notification,
        poll: 2,
        work: None,
    });
    assert_eq!(polls(&fx), vec![(Origin::Cron, 3)]);
    let fx = h.feed(Input::Offer {
        origin: Origin::Cron,
        poll: 3,
        work: None,
    });
    assert!(polls(&fx).is_empty(), "one round only: {fx:?}");
}

/// The core carries payloads and hands each back exactly where the actor
/// needs it: a prompt's at its terminal (or refusal), a steer's when it is
/// forwarded, consumed or dropped.
#[test]
fn payloads_come_back_with_their_terminals_and_receipts() {
    let mut core: SessionCore<u32, String> = SessionCore::new(CFG, 0);
    let p = |n| PromptId::from_u128(n);
    let prompt = |core: &mut SessionCore<u32, String>, n: u128| {
        core.on(
            0,
            Input::Prompt {
                prompt: p(n),
                origin: Origin::Interactive,
                payload: n as u32 * 10,
            },
        )
    };
    assert_eq!(
        prompt(&mut core, 1).answer,
        Answer::Started { turn: TurnId(1) }
    );
    assert_eq!(core.active_payload(), Some(&10));
    *core.active_payload_mut().unwrap() += 1;
    assert_eq!(prompt(&mut core, 2).answer, Answer::Queued { depth: 1 });
    assert_eq!(prompt(&mut core, 3).answer, Answer::Queued { depth: 2 });
    let refused = prompt(&mut core, 4).answer;
    assert_eq!(
        refused,
        Answer::Rejected {
            reason: Rejection::Overloaded,
            payload: 40
        }
    );
    let step = core.on(
        0,
        Input::Steer {
            steer: SteerId::from_u128(7),
            text: "look here".into(),
            idle_behavior: IdleBehavior::StartNewTurn(p(8), 80),
        },
    );
    assert_eq!(
        step.answer,
        Answer::Steer {
            outcome: SteerOutcome::Injected { turn: TurnId(1) },
            unused: Some(80),
        }
    );
    assert!(
        step.effects
            .iter()
            .any(|e| matches!(e, Effect::ForwardSteer { text, .. } if text == "look here"))
    );
    let step = core.on(1, Input::Cancel(EngineStop::Answered));
    let dropped: Vec<_> = step
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::SteerDropped { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(dropped, ["look here"]);
    let payloads: Vec<(PromptId, u32)> = step
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Settled {
                prompt, payload, ..
            } => Some((*prompt, *payload)),
            _ => None,
        })
        .collect();
    assert_eq!(payloads, [(p(2), 20), (p(3), 30)], "queued ones, cancelled");
    let step = core.on(
        2,
        Input::Signal {
            turn: TurnId(1),
            signal: Signal::Idle,
        },
    );
    assert!(step.effects.iter().any(|e| matches!(
        e,
        Effect::Settled { prompt, payload: 11, .. } if *prompt == p(1)
    )));
}
