//! The tool pipeline's shell: delivering engine content, permissions and
//! finished calls (the rules are in `crate::tools`).

use super::*;

impl SessionState {
    /// The prompt of `turn`: its running engine's, else the core's when it
    /// is the active turn. Inside a step the core may already have moved on
    /// (a deadline ended the turn and the next one started), so the core's
    /// active prompt alone is not the turn's.
    fn prompt_of(&self, turn: TurnId) -> Option<PromptId> {
        self.running
            .as_ref()
            .filter(|r| r.turn == turn)
            .map(|r| r.prompt)
            .or_else(|| {
                self.core
                    .active()
                    .filter(|(_, t)| *t == turn)
                    .map(|(p, _)| p)
            })
    }

    /// Publishes or runs a signal's content. Returns a loop trip, if the
    /// tool pipeline's guard found one.
    pub(super) fn deliver(&mut self, turn: TurnId, kind: SignalKind) -> Option<LoopType> {
        let prompt = self.prompt_of(turn);
        if let SignalKind::Hosted(h) = kind {
            let (events, trip) = self.hosted(turn, h);
            for body in events {
                self.publish(prompt, Some(turn), body);
            }
            return self.tripped(trip);
        }
        // Only a tool batch needs what running calls takes.
        let exec = matches!(kind, SignalKind::ToolBatch(_)).then(|| Exec::of(self));
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let (events, trip) = match kind {
            SignalKind::Update(Update::Text(text)) => {
                let trip = run.guard.text(&text).err();
                run.text.push_str(&text);
                (vec![EventBody::AgentMessageChunk { text }], trip)
            }
            SignalKind::Update(Update::Thought(text)) => {
                (vec![EventBody::AgentThoughtChunk { text }], None)
            }
            SignalKind::Update(Update::Usage { input, output }) => (
                vec![usage_event(&mut self.usage, &*self.engine, input, output)],
                None,
            ),
            SignalKind::Update(Update::Context { used, size, cost }) => {
                // The agent's own account replaces Tiller's (it counts its
                // background calls too).
                let totals = self.usage.get_or_insert_with(Box::default);
                totals.used = used;
                totals.context_window = size;
                let cost = cost.map(|(amount, currency)| crate::Cost { amount, currency });
                if cost.is_some() {
                    totals.cost = cost.clone();
                }
                (
                    vec![EventBody::Usage {
                        input_tokens: used,
                        output_tokens: 0,
                        context_window: size,
                        cost: totals.cost.clone(),
                    }],
                    None,
                )
            }
            SignalKind::Update(Update::Compaction { id, phase }) => {
                use tiller_engine::CompactionPhase as P;
                let (status, summary, message) = match phase {
                    P::Started => ("in_progress", None, None),
                    P::Completed(s) => ("completed", Some(s), None),
                    P::Failed(why) => ("failed", None, Some(why)),
                    P::Cancelled => ("cancelled", None, None),
                };
                (
                    vec![EventBody::Compaction {
                        compaction_id: id,
                        status: status.into(),
                        summary,
                        message,
                    }],
                    None,
                )
            }
            SignalKind::Update(Update::Title(title)) => {
                // Stored first, in order with everything else the actor does.
                let _ = self.myself.send_message(SessionMsg::SetTitle {
                    title: Some(title),
                    reply: None,
                });
                (Vec::new(), None)
            }
            SignalKind::Update(Update::Plan(entries)) => (
                vec![EventBody::Plan {
                    entries: entries
                        .into_iter()
                        .map(|(content, status)| crate::event::PlanEntry { content, status })
                        .collect(),
                }],
                None,
            ),
            SignalKind::ToolBatch(calls) => {
                // Nobody answers for an automatic turn: calls that would
                // ask are refused at once.
                let unattended = run.origin != Origin::Interactive;
                let ids = self.call_ids.get_or_insert_with(Box::default);
                let mut batch = Batch::new(calls, ids, unattended);
                let mut events = Vec::new();
                let progress = batch.advance(&mut run.guard, &self.permissions, &mut events);
                run.batch = Some(batch);
                let exec = exec.as_ref().expect("made for tool batches");
                (events, batch_progress(run, progress, exec))
            }
            _ => (Vec::new(), None),
        };
        if events.iter().any(|e| matches!(e, EventBody::Usage { .. })) {
            self.usage_changed();
        }
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        self.tripped(trip)
    }

    /// Logs and counts a loop trip.
    fn tripped(&self, trip: Option<LoopType>) -> Option<LoopType> {
        let run = self.running.as_ref()?;
        if let Some(loop_type) = trip {
            run.span.in_scope(|| {
                tracing::warn!(loop_type = loop_type.as_str(), "loop protection tripped");
            });
            metrics::counter!(
                "tiller_loop_detected_total",
                "loop_type" => loop_type.as_str(),
                "origin" => run.origin.as_str()
            )
            .increment(1);
        }
        trip
    }

    /// Stores the usage totals after a model request (in order with the
    /// actor's other writes).
    pub(super) fn usage_changed(&self) {
        let _ = self.myself.send_message(SessionMsg::SaveSettings);
    }

    /// Applies a person's decision to the paused batch. Returns a loop trip
    /// found while the batch went on.
    pub(super) fn permission(
        &mut self,
        request_id: &str,
        option_id: &str,
    ) -> Result<Option<LoopType>, PermissionRefused> {
        let unknown = || PermissionRefused::Unknown(request_id.to_owned());
        let prompt = self.core.active().map(|(p, _)| p);
        let turn = self.core.active().map(|(_, t)| t);
        let asked_hosted = self
            .running
            .as_ref()
            .is_some_and(|r| r.hosted.is_some() && r.batch.is_none());
        if asked_hosted {
            let decision = Decision::from_option(option_id)
                .ok_or_else(|| PermissionRefused::BadOption(option_id.to_owned()))?;
            let events = self
                .hosted_answer(request_id, decision)
                .ok_or_else(unknown)?;
            for body in events {
                self.publish(prompt, turn, body);
            }
            return Ok(None);
        }
        let exec = Exec::of(self);
        let run = self.running.as_mut().ok_or_else(unknown)?;
        let batch = run.batch.as_mut().ok_or_else(unknown)?;
        if batch.waiting().map(|(w, _)| w.request_id.as_str()) != Some(request_id) {
            return Err(unknown());
        }
        let decision = Decision::from_option(option_id)
            .ok_or_else(|| PermissionRefused::BadOption(option_id.to_owned()))?;
        let mut events = Vec::new();
        let progress = batch.decide(decision, &mut run.guard, &mut self.permissions, &mut events);
        let turn = run.turn;
        let trip = batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        Ok(trip)
    }

    /// A turn that ends (cancel, settle) while a call waits for permission
    /// or runs resolves it as cancelled (a running call is stopped), so no
    /// call stays pending.
    pub(super) fn abandon_permission(&mut self, turn: TurnId) {
        let prompt = self.prompt_of(turn);
        for body in self.hosted_abandon(turn) {
            self.publish(prompt, Some(turn), body);
        }
        let exec = Exec::of(self);
        let Some(run) = self.running.as_mut().filter(|r| r.turn == turn) else {
            return;
        };
        run.stopping = true;
        if let Some(task) = run.exec.take() {
            task.abort();
        }
        let prompt = Some(run.prompt);
        let Some(batch) = run.batch.as_mut() else {
            return;
        };
        let mut events = Vec::new();
        let Some(progress) = batch.abandon(&mut run.guard, &mut self.permissions, &mut events)
        else {
            return;
        };
        batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
    }

    /// A call that ran off the actor finished: the batch goes on. Returns
    /// a loop trip found while it did.
    pub(super) fn tool_done(
        &mut self,
        turn: TurnId,
        id: CallId,
        output: ToolOutput,
    ) -> Option<LoopType> {
        let exec = Exec::of(self);
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let prompt = Some(run.prompt);
        let batch = run.batch.as_mut()?;
        if batch.running() != Some(id) {
            return None; // abandoned meanwhile
        }
        run.exec = None;
        let mut events = Vec::new();
        let progress = batch.finish(id, output, &mut run.guard, &self.permissions, &mut events);
        let trip = batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        trip
    }
}

/// What running a call off the actor needs.
pub(super) struct Exec {
    toolbox: Arc<Toolbox>,
    client: Option<Arc<dyn ClientTools>>,
    actor: ActorRef<SessionMsg>,
    conversation: Conversation,
}

impl Exec {
    /// Runs one call with the session's tools (or the attached editor).
    pub(super) async fn run(&self, call: &tiller_engine::ToolCall) -> ToolOutput {
        run_call(&self.toolbox, call, self.client.clone()).await
    }

    /// A file's whole text, confined (or from the attached editor).
    pub(super) async fn read_whole(&self, path: &str, max: u64) -> Result<String, String> {
        self.toolbox
            .read_whole(path, max, self.client.clone())
            .await
    }
    /// Adds a batch's results to the conversation (for an engine that will
    /// not see them).
    pub(super) fn record(&self, results: Vec<tiller_engine::ToolResult>) {
        for r in results {
            self.conversation.push(tiller_engine::Message::ToolResult {
                id: r.id,
                ok: r.output.ok,
                output: r.output.output,
            });
        }
    }

    /// The newest attached client that offers file or terminal methods
    /// acts for the session.
    pub(super) fn of(st: &SessionState) -> Exec {
        Exec {
            toolbox: st.toolbox.clone(),
            client: st.subscribers.iter().rev().find_map(|s| s.client_tools()),
            actor: st.myself.clone(),
            conversation: st.conversation.clone(),
        }
    }
}

/// Hands a batch's results to the engine once it is done, or starts the
/// call it waits on. Returns the loop trip that stopped it, if any.
pub(super) fn batch_progress(
    run: &mut RunningEngine,
    progress: Progress,
    exec: &Exec,
) -> Option<LoopType> {
    match progress {
        // The turn is ending: the engine is about to be stopped and must
        // not take the results as a cue to call its model again. The
        // conversation still records every result.
        Progress::Done(results) if run.stopping => {
            run.batch = None;
            exec.record(results);
            None
        }
        Progress::Waiting => None,
        Progress::Run(id, call) => {
            let (toolbox, client, actor) = (
                exec.toolbox.clone(),
                exec.client.clone(),
                exec.actor.clone(),
            );
            let turn = run.turn;
            let task = async move {
                let output = run_call(&toolbox, &call, client).await;
                let _ = actor.send_message(SessionMsg::ToolDone { turn, id, output });
            };
            run.exec = Some(tokio::spawn(task.instrument(run.span.clone())));
            None
        }
        Progress::Done(results) => {
            run.batch = None;
            run.handle.send(EngineInput::ToolResults(results));
            None
        }
        Progress::Tripped(loop_type, results) => {
            // As above: the trip stops the engine; skipped calls included.
            run.batch = None;
            exec.record(results);
            Some(loop_type)
        }
    }
}

/// Runs one call off the actor. A tool that panics fails its call at once
/// (the turn goes on) instead of leaving the batch waiting, until the
/// stall bound, for an output that will never come.
pub(super) async fn run_call(
    toolbox: &Toolbox,
    call: &tiller_engine::ToolCall,
    client: Option<Arc<dyn ClientTools>>,
) -> ToolOutput {
    use futures::FutureExt;
    // A span per call (exported with the turn's when telemetry is on): the
    // tool and the call's id, never its input.
    let span = tracing::info_span!("tool_call", tool = %call.name, call_id = %call.id, ok = tracing::field::Empty);
    let ran = std::panic::AssertUnwindSafe(toolbox.run(call, client))
        .catch_unwind()
        .instrument(span.clone())
        .await;
    span.record("ok", ran.as_ref().is_ok_and(|o| o.ok));
    match ran {
        Ok(output) => output,
        Err(panic) => {
            let why = tiller_engine::panic_message(&*panic);
            tracing::error!(tool = %call.name, panic = %why, "a tool panicked");
            metrics::counter!("tiller_tool_panics_total").increment(1);
            ToolOutput {
                ok: false,
                output: format!(
                    "The `{}` tool failed unexpectedly ({why}); the call did not finish.",
                    call.name
                ),
            }
        }
    }
}

/// The `usage` event of one model request, with the session's totals
/// brought up to date.
fn usage_event(
    usage: &mut Option<Box<crate::UsageTotals>>,
    engine: &dyn Engine,
    input: u64,
    output: u64,
) -> EventBody {
    let basis = engine.usage_basis();
    let totals = usage.get_or_insert_with(Box::default);
    totals.input_tokens += input;
    totals.output_tokens += output;
    totals.used = input + output;
    totals.context_window = basis.context_window;
    if let Some(p) = &basis.prices {
        let before = totals
            .cost
            .as_ref()
            .filter(|c| c.currency == p.currency)
            .map_or(0.0, |c| c.amount);
        totals.cost = Some(crate::Cost {
            amount: before + p.cost(input, output),
            currency: p.currency.clone(),
        });
    }
    EventBody::Usage {
        input_tokens: input,
        output_tokens: output,
        context_window: basis.context_window,
        cost: totals.cost.clone(),
    }
}

/// A tool call never outlives its turn, as its engine does not: a turn
/// that ends stops its call first (`abandon_permission`), and a session
/// that fails (its actor's state dropped, no `post_stop` on that path)
/// stops it here. A `JoinHandle` dropped would only detach it.
impl Drop for RunningEngine {
    fn drop(&mut self) {
        if let Some(task) = self.exec.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use tiller_tools::{BoxFuture, CommandOutput};

    use super::*;

    /// An editor whose file reads crash.
    struct Crashing;

    impl ClientTools for Crashing {
        fn can_read(&self) -> bool {
            true
        }
        fn can_write(&self) -> bool {
            false
        }
        fn can_terminal(&self) -> bool {
            false
        }
        fn read_text_file(&self, _: PathBuf) -> BoxFuture<Result<String, String>> {
            Box::pin(async { panic!("the editor bridge broke") })
        }
        fn write_text_file(&self, _: PathBuf, _: String) -> BoxFuture<Result<(), String>> {
            Box::pin(async { Err("no".into()) })
        }
        fn run_command(
            &self,
            _: String,
            _: PathBuf,
            _: Duration,
        ) -> BoxFuture<Result<CommandOutput, String>> {
            Box::pin(async { Err("no".into()) })
        }
    }

    /// The state of a failed session is dropped without `post_stop`: the
    /// call its turn was running stops then, not when it would finish.
    #[tokio::test(start_paused = true)]
    async fn a_running_call_stops_when_its_turn_s_state_is_dropped() {
        let (held, gone) = oneshot::channel::<()>();
        let call = tokio::spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let run = RunningEngine {
            turn: TurnId(1),
            prompt: PromptId::new(),
            origin: Origin::Interactive,
            handle: EngineHandle::new(tx, tokio::spawn(std::future::pending())),
            guard: LoopGuard::new(LoopConfig::default()),
            text: String::new(),
            batch: None,
            exec: Some(call),
            hosted: None,
            stopping: false,
            stop: EngineStop::Answered,
            span: Span::none(),
        };
        drop(run);
        let stopped = tokio::time::timeout(Duration::from_secs(3600), gone).await;
        assert!(
            matches!(stopped, Ok(Err(_))),
            "the call still runs: {stopped:?}"
        );
    }

    #[tokio::test]
    async fn a_tool_that_panics_fails_its_call_instead_of_hanging_the_turn() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "hi").unwrap();
        let toolbox = Toolbox::new(dir.path().to_path_buf(), Default::default());
        let call = tiller_engine::ToolCall {
            id: "c".into(),
            name: "read_file".into(),
            kind: tiller_engine::ToolKind::of("read_file"),
            input: serde_json::json!({ "path": "a.txt" }),
            simulated: None,
        };
        let out = run_call(&toolbox, &call, Some(Arc::new(Crashing))).await;
        assert!(!out.ok);
        assert!(
            out.output.contains("the editor bridge broke"),
            "{}",
            out.output
        );
        // A tool that works is untouched.
        let out = run_call(&toolbox, &call, None).await;
        assert!(out.ok, "{}", out.output);
    }
}
