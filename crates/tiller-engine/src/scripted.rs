//! The scripted engine: offline, deterministic, needs no key. It plays a
//! prompt's script step by step, or streams a short demo reply.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use tiller_core::{ErrorKind, SteerId, SteerReceipt, StopReason, TurnId};
use tokio::sync::mpsc;

use crate::{
    Engine, EngineHandle, EngineInput, EngineSignal, PreparedPrompt, Script, ScriptError,
    SignalKind, SignalSink, Step, ToolCall, ToolOutput, TurnContext, Update,
};

/// Words of the demo reply, streamed one chunk at a time.
const DEMO: &[&str] = &[
    "Hello from Tiller's scripted engine. ",
    "It runs offline and needs no key. ",
    "Send a prompt whose text is a JSON object with a `script` array ",
    "to drive a turn step by step.",
];

/// Pause between demo chunks, so the reply visibly streams.
const DEMO_PACE_MS: u64 = 15;

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub struct ScriptedEngine;

impl Engine for ScriptedEngine {
    fn name(&self) -> &str {
        "scripted"
    }

    /// Its tool calls are the session's; it has nothing else.
    fn acts_through_session(&self) -> bool {
        true
    }

    fn prepare(&self, text: &str) -> Result<PreparedPrompt, ScriptError> {
        Ok(PreparedPrompt {
            images: Vec::new(),
            text: text.to_owned(),
            script: Script::from_prompt(text)?,
        })
    }

    fn start(
        &self,
        turn: TurnId,
        prompt: PreparedPrompt,
        ctx: TurnContext,
        sink: SignalSink,
    ) -> EngineHandle {
        let steps: VecDeque<Step> = match prompt.script {
            Some(script) => script.steps.into(),
            None => demo_steps(),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let run = Run {
            turn,
            sink,
            rx,
            steers: VecDeque::new(),
            steps,
            next_tool: 0,
            pace: ctx.pace,
        };
        EngineHandle::new(tx, tokio::spawn(run.play()))
    }
}

fn demo_steps() -> VecDeque<Step> {
    let mut steps = VecDeque::new();
    for (i, chunk) in DEMO.iter().enumerate() {
        if i > 0 {
            steps.push_back(Step::SleepMs(DEMO_PACE_MS));
        }
        steps.push_back(Step::Say((*chunk).to_owned()));
    }
    steps.push_back(Step::Result(StopReason::EndTurn));
    steps.push_back(Step::Idle);
    steps
}

/// The engine was told to abort (or its session went away).
struct Aborted;

/// One playing turn.
struct Run {
    /// The turn every signal is tagged with.
    turn: TurnId,
    /// The session's mailbox.
    sink: SignalSink,
    /// Inputs from the session.
    rx: mpsc::UnboundedReceiver<EngineInput>,
    /// Steers that reached the engine and have no receipt yet, oldest first.
    steers: VecDeque<(SteerId, String)>,
    /// Steps still to play (repeats expand lazily at the front).
    steps: VecDeque<Step>,
    /// Counter for tool call ids.
    next_tool: u32,
    /// The session's backlog (the script waits while it is high).
    pace: std::sync::Arc<crate::Pace>,
}

impl Run {
    async fn play(mut self) {
        while let Some(step) = self.steps.pop_front() {
            // Never more than a bounded backlog in the session's mailbox.
            let pace = self.pace.clone();
            if self.wait(pace.room()).await.is_err() {
                self.emit(SignalKind::Result(StopReason::Cancelled));
                self.emit(SignalKind::Idle);
                return;
            }
            if self.step(step).await.is_err() {
                self.emit(SignalKind::Result(StopReason::Cancelled));
                self.emit(SignalKind::Idle);
                return;
            }
        }
    }

    fn emit(&self, kind: SignalKind) {
        (self.sink)(EngineSignal {
            turn: self.turn,
            kind,
        });
    }

    fn emit_stale(&self, kind: SignalKind) {
        (self.sink)(EngineSignal {
            turn: TurnId(self.turn.0.saturating_sub(1)),
            kind,
        });
    }

    /// Runs `fut` while taking in steers; `Err` on abort.
    async fn wait<F: Future>(&mut self, fut: F) -> Result<F::Output, Aborted> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                input = self.rx.recv() => match input {
                    Some(EngineInput::Steer { id, text }) => self.steers.push_back((id, text)),
                    // Results outside a batch wait are ignored.
                    Some(EngineInput::ToolResults(_) | EngineInput::Permission { .. } | EngineInput::File { .. }) => {}
                    Some(EngineInput::Abort) | None => return Err(Aborted),
                },
            }
        }
    }

    /// Takes in inputs already queued, without waiting.
    fn poll_inputs(&mut self) -> Result<(), Aborted> {
        while let Ok(input) = self.rx.try_recv() {
            match input {
                EngineInput::Steer { id, text } => self.steers.push_back((id, text)),
                EngineInput::ToolResults(_)
                | EngineInput::Permission { .. }
                | EngineInput::File { .. } => {}
                EngineInput::Abort => return Err(Aborted),
            }
        }
        Ok(())
    }

    fn signal_of(&mut self, step: Step) -> SignalKind {
        match step {
            Step::Say(t) => SignalKind::Update(Update::Text(t)),
            Step::Think(t) => SignalKind::Update(Update::Thought(t)),
            Step::Plan(p) => SignalKind::Update(Update::Plan(p)),
            Step::Title(t) => SignalKind::Update(Update::Title(t)),
            Step::Usage(input, output) => SignalKind::Update(Update::Usage { input, output }),
            Step::Result(r) => SignalKind::Result(r),
            Step::Idle => SignalKind::Idle,
            Step::Fail(m) => SignalKind::Failed(ErrorKind::ModelStreamInterrupted, m),
            Step::Tools(calls) => SignalKind::ToolBatch(
                calls
                    .into_iter()
                    .map(|c| {
                        self.next_tool += 1;
                        ToolCall {
                            id: format!("t{}-{}", self.turn, self.next_tool),
                            kind: c.kind,
                            name: c.name,
                            input: c.input,
                            simulated: Some(ToolOutput {
                                ok: c.ok,
                                output: c.output,
                            }),
                        }
                    })
                    .collect(),
            ),
            other => unreachable!("not a signal step: {other:?}"),
        }
    }

    async fn step(&mut self, step: Step) -> Result<(), Aborted> {
        self.poll_inputs()?;
        match step {
            Step::Say(_)
            | Step::Think(_)
            | Step::Plan(_)
            | Step::Title(_)
            | Step::Usage(..)
            | Step::Result(_)
            | Step::Idle
            | Step::Fail(_) => {
                let kind = self.signal_of(step);
                self.emit(kind);
            }
            Step::Tools(calls) => {
                let kind = self.signal_of(Step::Tools(calls));
                self.emit(kind);
                self.await_tool_results().await?;
            }
            Step::SleepMs(ms) => {
                self.wait(tokio::time::sleep(Duration::from_millis(ms)))
                    .await?;
            }
            Step::Hang => {
                // Emit nothing more and ignore abort: only teardown ends us.
                std::future::pending::<()>().await;
            }
            #[allow(clippy::panic)] // the step's whole point
            Step::Crash(why) => panic!("{why}"),
            Step::AwaitSteer(ms) => {
                let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
                while self.steers.is_empty() {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => break, // MS passed
                        input = self.rx.recv() => match input {
                            Some(EngineInput::Steer { id, text }) => self.steers.push_back((id, text)),
                            Some(EngineInput::ToolResults(_) | EngineInput::Permission { .. } | EngineInput::File { .. }) => {}
                            Some(EngineInput::Abort) | None => return Err(Aborted),
                        },
                    }
                }
            }
            Step::ConsumeSteer => {
                if let Some((id, text)) = self.steers.pop_front() {
                    self.emit(SignalKind::SteerReceipt(id, SteerReceipt::Consumed));
                    // A steer that is itself a script runs next.
                    if let Ok(Some(script)) = Script::from_prompt(&text) {
                        let mut steps = script.steps;
                        strip_auto_end(&mut steps);
                        for s in steps.into_iter().rev() {
                            self.steps.push_front(s);
                        }
                    }
                }
            }
            Step::DropSteer => {
                if let Some((id, _)) = self.steers.pop_front() {
                    self.emit(SignalKind::SteerReceipt(id, SteerReceipt::Dropped));
                }
            }
            Step::Stale(inner) => {
                let kind = self.signal_of(*inner);
                self.emit_stale(kind);
            }
            Step::Repeat { times, steps } => {
                if times > 0 {
                    self.steps.push_front(Step::Repeat {
                        times: times - 1,
                        steps: steps.clone(),
                    });
                    for s in steps.into_iter().rev() {
                        self.steps.push_front(s);
                    }
                }
            }
        }
        Ok(())
    }

    async fn await_tool_results(&mut self) -> Result<(), Aborted> {
        loop {
            match self.rx.recv().await {
                Some(EngineInput::ToolResults(_)) => return Ok(()),
                Some(EngineInput::Steer { id, text }) => self.steers.push_back((id, text)),
                Some(EngineInput::Permission { .. } | EngineInput::File { .. }) => {}
                Some(EngineInput::Abort) | None => return Err(Aborted),
            }
        }
    }
}

/// A steer's script gets `result`/`idle` appended by the parser when it has
/// no terminal step; inside a running turn the outer script ends the turn.
fn strip_auto_end(steps: &mut Vec<Step>) {
    let n = steps.len();
    if n >= 2 && steps[n - 2] == Step::Result(StopReason::EndTurn) && steps[n - 1] == Step::Idle {
        steps.truncate(n - 2);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn start(text: &str) -> (EngineHandle, Arc<Mutex<Vec<EngineSignal>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink_seen = seen.clone();
        let sink: SignalSink = Arc::new(move |s| sink_seen.lock().unwrap().push(s));
        let engine = ScriptedEngine;
        let prompt = engine.prepare(text).unwrap();
        (
            engine.start(TurnId(7), prompt, TurnContext::default(), sink),
            seen,
        )
    }

    async fn settle_until(seen: &Arc<Mutex<Vec<EngineSignal>>>, n: usize) -> Vec<EngineSignal> {
        for _ in 0..10_000 {
            if seen.lock().unwrap().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen.lock().unwrap().clone()
    }

    #[tokio::test(start_paused = true)]
    async fn demo_streams_then_ends() {
        let (_h, seen) = start("hi");
        let got = settle_until(&seen, DEMO.len() + 2).await;
        let kinds: Vec<_> = got.iter().map(|s| s.kind.clone()).collect();
        assert_eq!(kinds.len(), DEMO.len() + 2);
        assert!(matches!(kinds[0], SignalKind::Update(Update::Text(_))));
        assert_eq!(kinds[DEMO.len()], SignalKind::Result(StopReason::EndTurn));
        assert_eq!(kinds[DEMO.len() + 1], SignalKind::Idle);
        assert!(got.iter().all(|s| s.turn == TurnId(7)));
    }

    #[tokio::test(start_paused = true)]
    async fn abort_during_sleep_emits_cancelled_and_idle() {
        let (h, seen) = start(r#"{"script": [{"sleep_ms": 60000}]}"#);
        tokio::task::yield_now().await;
        h.send(EngineInput::Abort);
        let got = settle_until(&seen, 2).await;
        assert_eq!(
            got.into_iter().map(|s| s.kind).collect::<Vec<_>>(),
            vec![SignalKind::Result(StopReason::Cancelled), SignalKind::Idle]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn tools_wait_for_results_and_stale_uses_previous_turn() {
        let (h, seen) = start(
            r#"{"script": [{"stale": {"idle": true}}, {"tool": {"name": "x", "output": "o"}}, {"say": "after"}]}"#,
        );
        let got = settle_until(&seen, 2).await;
        assert_eq!(got[0].turn, TurnId(6));
        assert_eq!(got[0].kind, SignalKind::Idle);
        let SignalKind::ToolBatch(calls) = &got[1].kind else {
            panic!("{got:?}")
        };
        assert_eq!(calls[0].simulated.as_ref().unwrap().output, "o");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(seen.lock().unwrap().len(), 2, "waits for tool results");
        h.send(EngineInput::ToolResults(vec![]));
        let got = settle_until(&seen, 5).await;
        assert_eq!(
            got[2].kind,
            SignalKind::Update(Update::Text("after".into()))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn consumed_steer_script_runs_next() {
        let t0 = tokio::time::Instant::now();
        let (h, seen) = start(
            r#"{"script": [{"await_steer": 1000}, {"consume_steer": true}, {"say": "tail"}]}"#,
        );
        let id = SteerId::from_u128(1);
        h.send(EngineInput::Steer {
            id,
            text: r#"{"script": [{"say": "steered"}]}"#.into(),
        });
        let got = settle_until(&seen, 5).await;
        assert!(
            t0.elapsed() < Duration::from_millis(1000),
            "await_steer returns when the steer arrives, not at its deadline"
        );
        let kinds: Vec<_> = got.into_iter().map(|s| s.kind).collect();
        assert_eq!(
            kinds,
            vec![
                SignalKind::SteerReceipt(id, SteerReceipt::Consumed),
                SignalKind::Update(Update::Text("steered".into())),
                SignalKind::Update(Update::Text("tail".into())),
                SignalKind::Result(StopReason::EndTurn),
                SignalKind::Idle,
            ]
        );
    }
}
