//! Carrying out the core's effects, in order, and starting turns.

use super::*;

impl SessionState {
    /// Feeds the core an input that asks for no answer (or whose answer
    /// only hands a payload back, which is dropped), and carries out its
    /// effects.
    pub(super) async fn feed(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        input: Input<Pending, String>,
        content: Option<SignalKind>,
    ) {
        // Only the effects: the rest of the step (an answer that may hold
        // a prompt) would live in this future while it waits. Into the
        // actor's buffer, given back once carried out.
        let mut fx = std::mem::take(&mut self.fx);
        self.core.on_into(self.now(), input, &mut fx);
        self.apply(myself, fx, content).await;
    }

    /// Carries out the core's effects in order.
    pub(super) async fn apply(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        mut fx: Vec<Effect<Pending, String>>,
        mut content: Option<SignalKind>,
    ) {
        let mut trip = None;
        let mut rest = fx.drain(..);
        while let Some(e) = rest.next() {
            if self.failed.is_some() {
                // The session is failing: its state is not the log's. The
                // owners of the terminals left hear what it will say.
                return self.told_failed(std::iter::once(e).chain(rest));
            }
            match e {
                Effect::ForwardSteer { turn, steer, text } => {
                    if let Some(run) = self.running.as_ref().filter(|r| r.turn == turn) {
                        run.handle.send(EngineInput::Steer { id: steer, text });
                    }
                }
                Effect::StartTurn {
                    prompt,
                    turn,
                    origin,
                    deferred,
                } => {
                    // Boxed, as `settle` below (once a turn each): inline
                    // they doubled the future of every input fed to the
                    // core (3.9 KB against 1.9 KB in a debug build).
                    Box::pin(self.start_turn(myself, prompt, turn, origin, deferred)).await;
                }
                Effect::Deliver { turn } => {
                    if let Some(kind) = content.take()
                        && let Some(loop_type) = self.deliver(turn, kind)
                    {
                        trip = Some(Input::LoopTrip { turn, loop_type });
                    }
                }
                Effect::LoopStopped {
                    prompt,
                    turn,
                    loop_type,
                } => {
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::LoopStopped {
                            loop_type: loop_type.as_str().into(),
                            message: tiller_core::ErrorKind::LoopDetected(loop_type)
                                .default_message(),
                        },
                    );
                }
                Effect::SteerConsumed {
                    steer,
                    prompt,
                    turn,
                    text: _,
                } => {
                    metrics::counter!("tiller_steer_receipts_total", "kind" => "consumed")
                        .increment(1);
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::SteerConsumed {
                            steer_id: steer.to_string(),
                        },
                    );
                }
                Effect::SteerDropped {
                    steer,
                    reason,
                    prompt,
                    turn,
                    text,
                } => {
                    match reason {
                        SteerDropReason::Engine => {
                            metrics::counter!("tiller_steer_receipts_total", "kind" => "dropped")
                                .increment(1);
                        }
                        SteerDropReason::ReceiptTimeout => {
                            metrics::counter!("tiller_steer_receipt_timeouts_total").increment(1);
                        }
                        _ => {}
                    }
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::SteerDropped {
                            steer_id: steer.to_string(),
                            text,
                            reason: drop_reason_label(reason).into(),
                        },
                    );
                }
                Effect::AbortEngine { turn, teardown } => {
                    self.abandon_permission(turn);
                    if let Some(run) = self.running.as_ref().filter(|r| r.turn == turn) {
                        run.handle.send(EngineInput::Abort);
                        if teardown {
                            run.handle.teardown();
                        }
                    }
                }
                Effect::Settled {
                    prompt,
                    turn,
                    origin,
                    terminal,
                    loop_stopped,
                    payload,
                } => {
                    Box::pin(self.settle(prompt, turn, origin, terminal, loop_stopped, payload))
                        .await;
                }
                // An engine task ending after its turn settled is no stale signal.
                Effect::Stale { .. } if matches!(content, Some(SignalKind::Exited(_))) => {}
                Effect::Stale { .. } => {
                    metrics::counter!("tiller_stale_signals_total").increment(1);
                }
                Effect::EngineStopped { turn } => {
                    if let Some((_, since)) = self.winding.take_if(|(w, _)| w.turn == turn) {
                        // (One still running is torn down as it is dropped.)
                        metrics::histogram!("tiller_engine_stop_seconds")
                            .record(since.elapsed().as_secs_f64());
                        // What it kept of the turn is in the conversation now.
                        let _ = self.save_conversation().await; // logged; retried at the next save
                    }
                }
                Effect::WatchdogFired { kind } => {
                    let kind = kind.as_str();
                    tracing::warn!(session = %self.id, kind, "watchdog fired");
                    metrics::counter!("tiller_watchdog_fired_total", "kind" => kind).increment(1);
                }
                Effect::ArmTimer { at } => {
                    let now = self.now();
                    self.wake.arm(myself, now, at);
                }
                Effect::Poll { origin, poll } => {
                    let inbox: Arc<dyn Inbox> = self.slot.clone();
                    self.automation.poll(origin, self.id, poll, inbox);
                }
                Effect::Idle => {
                    tracing::debug!(session = %self.id, "session idle");
                    for d in self.drained.drain(..) {
                        let _ = d.send(());
                    }
                    if self.closing {
                        myself.stop(Some("closed".into()));
                    }
                }
            }
        }
        drop(rest);
        // The buffer is kept for the running turn's next input (one a
        // nested step took meanwhile is there already); an idle session
        // holds none (most sessions are idle: their memory counts).
        if self.fx.capacity() == 0 && self.core.active().is_some() {
            self.fx = fx;
        }
        // A loop trip found while delivering content is the core's next input.
        if let Some(input) = trip {
            let step = self.core.on(self.now(), input);
            let rest = Box::pin(self.apply(myself, step.effects, None));
            rest.await;
        }
    }

    pub(super) async fn start_turn(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        prompt: PromptId,
        turn: TurnId,
        origin: Origin,
        deferred: bool,
    ) {
        let starting = self.core.active().map(|(p, _)| p) == Some(prompt);
        let Some(prepared) = self
            .core
            .active_payload_mut()
            .filter(|_| starting)
            .and_then(|p| p.prepared.take())
        else {
            tracing::error!(session = %self.id, %prompt, "started a prompt with no content");
            return;
        };
        // The turn's first events go to the store at once.
        self.eager = LINGER_AFTER;
        let span = tracing::info_span!(parent: &self.span, "turn", %turn, %prompt, origin = origin.as_str());
        span.in_scope(|| tracing::info!("turn started"));
        let message = EventBody::UserMessage {
            text: prepared.text.clone(),
            images: prepared.images.clone(),
        };
        // A prompt that waited (or automatic work) has no start event yet.
        if deferred {
            let work = self.core.active_payload().and_then(|p| p.work.as_ref());
            if work.is_none() {
                metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
            }
            let start = EventBody::PromptStarted {
                origin: origin.as_str().into(),
            };
            match work.map(Work::claim) {
                // Automatic work is admitted here: its start and its message
                // are stored (with the queue row it consumes) before it
                // runs, and only then does its queue forget it.
                Some(claim) => {
                    let stored = self
                        .publish_start(prompt, turn, start, claim, message)
                        .await;
                    if stored.is_err() {
                        return; // the session fails; the work stays queued
                    }
                    admit::count_admitted(origin);
                    if let (Some(work), Some(q)) = (
                        self.core.active_payload().and_then(|p| p.work.as_ref()),
                        self.automation.queue(origin),
                    ) {
                        q.started(self.id, work);
                    }
                }
                None => {
                    self.publish(Some(prompt), Some(turn), start);
                    self.publish(Some(prompt), Some(turn), message);
                }
            }
        } else {
            self.publish(Some(prompt), Some(turn), message);
        }
        if self.title.is_none() {
            // The prompt names the session once it is stored (a deferred
            // admission is stored first; if that fails, the turn ends
            // here, the session fails, and nothing of the prompt stays).
            if !self.store_admission().await {
                return;
            }
            self.title_from(&prepared.text).await;
        }
        let actor = myself.clone();
        let (signals, slot) = (self.signals.clone(), self.slot.clone());
        let sink: tiller_engine::SignalSink = Arc::new(move |sig| signals.send(sig, &slot, &actor));
        let ctx = TurnContext {
            conversation: self.conversation.clone(),
            tools: self.toolbox.specs(),
            model: self.model.clone(),
            switches: self.switch_values(),
            pace: self.signals.pace.clone(),
            host: tiller_engine::HostInfo {
                session: self.id.to_string(),
                cwd: self.toolbox.root().clone(),
                roots: self.toolbox.roots().to_vec(),
                upstream: self.upstream.clone(),
                agent_options: self.agent_choices(),
            },
        };
        let mut handle = {
            let _g = span.enter();
            self.engine.start(turn, prepared, ctx, sink.clone())
        };
        // An engine task that ends (or panics) without its terminal settles
        // the turn at once, not at the stall bound.
        handle.watch(move |panic| {
            sink(EngineSignal {
                turn,
                kind: SignalKind::Exited(panic),
            });
        });
        self.running = Some(RunningEngine {
            turn,
            prompt,
            origin,
            handle,
            guard: LoopGuard::new(self.loops.clone()),
            text: String::new(),
            batch: None,
            exec: None,
            hosted: None,
            stopping: false,
            stop: if self.engine.acts_through_session() {
                EngineStop::Behind
            } else {
                EngineStop::Answered
            },
            span,
        });
    }
}

pub(super) fn core_signal(kind: &SignalKind) -> Signal {
    match kind {
        // A hosted agent's calls and requests are the turn's content.
        SignalKind::Update(_) | SignalKind::Hosted(_) => Signal::Update,
        SignalKind::ToolBatch(_) => Signal::ToolBatch,
        SignalKind::Result(r) => Signal::Result(*r),
        SignalKind::Idle => Signal::Idle,
        SignalKind::SteerReceipt(s, r) => Signal::SteerReceipt(*s, *r),
        SignalKind::Failed(k, m) => Signal::Failed(*k, m.clone()),
        SignalKind::Exited(panic) => Signal::Exited(panic.clone()),
    }
}

pub(super) fn drop_reason_label(r: SteerDropReason) -> &'static str {
    match r {
        SteerDropReason::Engine => "engine",
        SteerDropReason::TurnEnded => "turn_ended",
        SteerDropReason::ReceiptTimeout => "receipt_timeout",
        SteerDropReason::Cancelled => "cancelled",
    }
}
