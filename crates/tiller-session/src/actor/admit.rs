//! Admission: interactive and channel prompts, automatic work offered by
//! the queue actors, and steers. Each is stored before it is acknowledged.

use super::*;

impl SessionState {
    pub(super) async fn prompt(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        text: String,
        origin: Origin,
        delivery: Option<String>,
        admitted: Option<oneshot::Sender<Result<PromptId, PromptRefused>>>,
        settled: Option<oneshot::Sender<Settlement>>,
    ) {
        let refuse = |admitted: Option<oneshot::Sender<_>>, why| {
            if let Some(a) = admitted {
                let _ = a.send(Err(why));
            }
        };
        let prepared = match self.engine.prepare(&text) {
            Ok(p) => p,
            Err(e) => return refuse(admitted, PromptRefused::Invalid(e)),
        };
        let delivery = match delivery
            .map(|url| crate::delivery::check_webhook(&url, &self.config.delivery))
            .transpose()
        {
            Ok(d) => d,
            Err(why) => return refuse(admitted, PromptRefused::BadDelivery(why)),
        };
        let prompt = PromptId::new();
        self.pending.insert(
            prompt,
            Pending {
                prepared: Some(prepared),
                settled,
                admitted_at: self.now(),
                queued: false,
                work: None,
                delivery,
            },
        );
        let fx = self.core.on(self.now(), Input::Prompt { prompt, origin });
        if let Some(Effect::Rejected { reason, .. }) = fx.first() {
            self.pending.remove(&prompt);
            return refuse(
                admitted,
                match reason {
                    Rejection::Overloaded => PromptRefused::Overloaded,
                    Rejection::Closed => PromptRefused::SessionClosed,
                },
            );
        }
        metrics::counter!("tiller_prompts_admitted_total", "origin" => origin.as_str())
            .increment(1);
        // Durable before acknowledged: the admission event is committed first.
        let admission = match &fx[..] {
            [Effect::Queued { depth, .. }, ..] => EventBody::PromptQueued {
                origin: origin.as_str().into(),
                depth: *depth,
                text: text.clone(),
            },
            _ => EventBody::PromptStarted {
                origin: origin.as_str().into(),
            },
        };
        if let EventBody::PromptQueued { .. } = admission {
            metrics::gauge!("tiller_prompt_queue_depth").increment(1.0);
            if let Some(p) = self.pending.get_mut(&prompt) {
                p.queued = true;
            }
        }
        if let Err(e) = self
            .publish_durable(Some(prompt), None, admission, Ledger::Admission)
            .await
        {
            // Never acknowledged, never fanned out; the session fails and
            // is rebuilt from the store (see `publish_durable`).
            tracing::warn!(error = %e, "prompt refused: the store is unavailable");
            return refuse(admitted, PromptRefused::StoreUnavailable);
        }
        if let Some(a) = admitted {
            let _ = a.send(Ok(prompt));
        }
        // A start effect publishes `user_message` and runs the engine.
        self.apply(myself, fx, None).await;
    }

    /// Takes (or refuses) automatic work offered by a queue actor.
    pub(super) async fn offer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        origin: Origin,
        poll: u64,
        work: Option<Work>,
    ) {
        let prompt = match work {
            None => None,
            Some(work) => match self.engine.prepare(work.text()) {
                Ok(prepared) => {
                    let prompt = PromptId::new();
                    self.pending.insert(
                        prompt,
                        Pending {
                            prepared: Some(prepared),
                            settled: None,
                            admitted_at: self.now(),
                            // Announced (and entered in the ledger) at start.
                            queued: true,
                            work: Some(work),
                            delivery: None,
                        },
                    );
                    metrics::counter!("tiller_prompts_admitted_total", "origin" => origin.as_str())
                        .increment(1);
                    Some(prompt)
                }
                Err(e) => {
                    // Unrunnable work is dropped, not retried forever.
                    tracing::warn!(error = %e, origin = origin.as_str(), "dropping invalid automatic work");
                    None
                }
            },
        };
        self.feed(
            myself,
            Input::Offer {
                origin,
                poll,
                prompt,
            },
            None,
        )
        .await;
    }

    pub(super) async fn steer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        text: String,
        prompt_required: bool,
        reply: oneshot::Sender<Result<SteerAnswer, PromptRefused>>,
    ) {
        if self.closing {
            let _ = reply.send(Err(PromptRefused::SessionClosed));
            return;
        }
        let steer = SteerId::new();
        let idle_behavior = if prompt_required {
            IdleBehavior::PromptRequired
        } else {
            // Validate now: a steer that becomes a prompt obeys prompt rules.
            let prepared = match self.engine.prepare(&text) {
                Ok(p) => p,
                Err(e) => {
                    let _ = reply.send(Err(PromptRefused::Invalid(e)));
                    return;
                }
            };
            let prompt = PromptId::new();
            self.pending.insert(
                prompt,
                Pending {
                    prepared: Some(prepared),
                    settled: None,
                    admitted_at: self.now(),
                    queued: false,
                    work: None,
                    delivery: None,
                },
            );
            IdleBehavior::StartNewTurn(prompt)
        };
        let fx = self.core.on(
            self.now(),
            Input::Steer {
                steer,
                idle_behavior,
            },
        );
        let mut answer = None;
        for e in &fx {
            if let Effect::SteerAnswer { outcome, .. } = e {
                answer = Some(*outcome);
            }
        }
        let outcome = answer.expect("the core answers every steer");
        // An unused prompt reservation is released.
        if let IdleBehavior::StartNewTurn(p) = idle_behavior
            && !matches!(outcome, SteerOutcome::StartedNewTurn { .. })
        {
            self.pending.remove(&p);
        }
        metrics::counter!("tiller_steers_total", "outcome" => steer_outcome_label(&outcome))
            .increment(1);
        let stored = match outcome {
            SteerOutcome::Injected { turn } => {
                self.steers.insert(steer, text.clone());
                self.publish_durable(
                    self.core.active().map(|(p, _)| p),
                    Some(turn),
                    EventBody::SteerAccepted {
                        steer_id: steer.to_string(),
                        text: text.clone(),
                    },
                    Ledger::Admission,
                )
                .await
            }
            SteerOutcome::StartedNewTurn { prompt } => {
                metrics::counter!("tiller_prompts_admitted_total", "origin" => "interactive")
                    .increment(1);
                self.publish_durable(
                    Some(prompt),
                    None,
                    EventBody::PromptStarted {
                        origin: Origin::Interactive.as_str().into(),
                    },
                    Ledger::Admission,
                )
                .await
            }
            SteerOutcome::PromptRequired(_) => Ok(()),
        };
        if stored.is_err() {
            // Not acknowledged; the session fails after this message.
            let _ = reply.send(Err(PromptRefused::StoreUnavailable));
            return;
        }
        let _ = reply.send(Ok(SteerAnswer { steer, outcome }));
        let steer_text = text;
        self.apply_with_steer(myself, fx, steer, steer_text).await;
    }

    pub(super) async fn apply_with_steer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        fx: Vec<Effect>,
        steer: SteerId,
        text: String,
    ) {
        for e in &fx {
            if let Effect::ForwardSteer { turn, steer: s } = e
                && *s == steer
                && let Some(run) = self.running.as_ref().filter(|r| r.turn == *turn)
            {
                run.handle.send(EngineInput::Steer {
                    id: steer,
                    text: text.clone(),
                });
            }
        }
        self.apply(myself, fx, None).await;
    }
}

pub(super) fn steer_outcome_label(o: &SteerOutcome) -> &'static str {
    match o {
        SteerOutcome::Injected { .. } => "injected",
        SteerOutcome::PromptRequired(_) => "prompt_required",
        SteerOutcome::StartedNewTurn { .. } => "started_new_turn",
    }
}
