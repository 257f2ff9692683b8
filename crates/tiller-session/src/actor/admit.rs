//! Admission: interactive and channel prompts, automatic work offered by
//! the queue actors, and steers. Each is stored before it is acknowledged.

use super::*;

/// Where a prompt's admission and its terminal are told.
pub(super) type Ports = (
    Option<oneshot::Sender<Result<PromptId, PromptRefused>>>,
    Option<oneshot::Sender<Settlement>>,
);

impl SessionState {
    pub(super) async fn prompt(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        prompt: PromptId,
        (text, images): (String, Vec<tiller_engine::Image>),
        (origin, ack): (Origin, Acknowledge),
        delivery: Option<String>,
        (admitted, settled): Ports,
    ) {
        let refuse = |admitted: Option<oneshot::Sender<_>>, why| {
            if let Some(a) = admitted {
                let _ = a.send(Err(why));
            }
        };
        let mut prepared = match self.engine.prepare(&text) {
            Ok(p) => p,
            Err(e) => return refuse(admitted, PromptRefused::Invalid(e)),
        };
        if !images.is_empty() && !self.engine.accepts_images() {
            let why = format!(
                "engine `{}` does not take images; use a model engine (or send text)",
                self.engine.name()
            );
            return refuse(admitted, PromptRefused::Unsupported(why));
        }
        prepared.images = images;
        let delivery = match delivery
            .map(|url| crate::delivery::check_webhook(&url, &self.config.delivery))
            .transpose()
        {
            Ok(d) => d,
            Err(why) => return refuse(admitted, PromptRefused::BadDelivery(why)),
        };
        let payload = Pending::new(prepared, self.now())
            .settled(settled)
            .delivery(delivery);
        let input = Input::Prompt {
            prompt,
            origin,
            payload,
        };
        let mut effects = std::mem::take(&mut self.fx);
        let answer = self.core.on_into(self.now(), input, &mut effects);
        // Durable before acknowledged: the admission event is committed
        // before the caller hears of it (for `Acknowledge::Terminal`, a start is
        // committed with the turn's first events, before anything of it is
        // shown and before its terminal).
        let mut deferred = false;
        let admission = match answer {
            Answer::Rejected { reason, .. } => {
                refuse(
                    admitted,
                    match reason {
                        Rejection::Overloaded => PromptRefused::Overloaded,
                        Rejection::Closed => PromptRefused::SessionClosed,
                    },
                );
                // The step may hold more than the refusal: a deadline
                // passed before this prompt was handled (its tick behind
                // it in the mailbox) settles the turn here.
                return self.apply(myself, effects, None).await;
            }
            Answer::Queued { depth } => {
                // It waits in the core from now on (a failed actor takes
                // it off again at its stop).
                metrics::gauge!("tiller_prompt_queue_depth").increment(1.0);
                EventBody::PromptQueued {
                    origin: origin.as_str().into(),
                    depth,
                    text: text.clone(),
                }
            }
            _ => {
                deferred = ack == Acknowledge::Terminal;
                EventBody::PromptStarted {
                    origin: origin.as_str().into(),
                }
            }
        };
        if deferred {
            // Stored with what the turn published meanwhile: by its
            // terminal, if that comes first, else at the turn's first
            // `Flush` or before the engine's first signal that is not
            // content (see `store_admission`). If that fails, the owner's
            // terminal is `store_unavailable`.
            self.publish(Some(prompt), None, admission);
            self.admitting = Some((prompt, origin));
        } else if let Err(e) = self
            .publish_durable(Some(prompt), None, admission, Ledger::Admission)
            .await
        {
            // Never acknowledged, never fanned out; the session fails and
            // is rebuilt from the store (see `publish_durable`).
            tracing::warn!(session = %self.id, error = %e, "prompt refused: the store is unavailable");
            refuse(admitted, PromptRefused::StoreUnavailable);
            return self.told_failed(effects.into_iter());
        } else {
            count_admitted(origin);
        }
        if let Some(a) = admitted {
            let _ = a.send(Ok(prompt));
        }
        // A start effect publishes `user_message` and runs the engine.
        self.apply(myself, effects, None).await;
    }

    /// Takes (or refuses) automatic work offered by a queue actor.
    pub(super) async fn offer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        origin: Origin,
        poll: u64,
        work: Option<Work>,
    ) {
        let work = match work {
            None => None,
            Some(work) => match self.engine.prepare(work.text()) {
                Ok(prepared) => {
                    // Announced (and entered in the ledger) at its start.
                    Some((
                        PromptId::new(),
                        Pending::new(prepared, self.now()).work(work),
                    ))
                }
                Err(e) => {
                    // Unrunnable work is dropped, not retried forever.
                    tracing::warn!(session = %self.id, error = %e, origin = origin.as_str(), "dropping invalid automatic work");
                    None
                }
            },
        };
        let step = self
            .core
            .on(self.now(), Input::Offer { origin, poll, work });
        // Refused (the session got busy): it stays in its queue, offered
        // again at the next poll; counted once its start is stored.
        self.apply(myself, step.effects, None).await;
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
        if self.running.is_some() && !self.core.is_cancelling() && !self.engine.steering() {
            metrics::counter!("tiller_steers_total", "outcome" => "prompt_required").increment(1);
            let outcome = SteerOutcome::PromptRequired(tiller_core::SteerRefusal::NotSupported);
            let _ = reply.send(Ok(SteerAnswer { steer, outcome }));
            return;
        }
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
            IdleBehavior::StartNewTurn(PromptId::new(), Pending::new(prepared, self.now()))
        };
        let input = Input::Steer {
            steer,
            text: text.clone(),
            idle_behavior,
        };
        // The turn that takes the steer may end in the same step (a
        // deadline passed, its tick behind this message): the steer is
        // stored under that turn's prompt, not the next one's.
        let before = self.core.active();
        let step = self.core.on(self.now(), input);
        // A prompt payload the steer did not use is simply dropped.
        let Answer::Steer { outcome, .. } = step.answer else {
            unreachable!("the core answers every steer")
        };
        metrics::counter!("tiller_steers_total", "outcome" => steer_outcome_label(&outcome))
            .increment(1);
        let stored = match outcome {
            SteerOutcome::Injected { turn } => {
                self.publish_durable(
                    before.filter(|(_, t)| *t == turn).map(|(p, _)| p),
                    Some(turn),
                    EventBody::SteerAccepted {
                        steer_id: steer.to_string(),
                        text,
                    },
                    Ledger::Admission,
                )
                .await
            }
            SteerOutcome::StartedNewTurn { prompt } => {
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
            return self.told_failed(step.effects.into_iter());
        }
        if let SteerOutcome::StartedNewTurn { .. } = outcome {
            count_admitted(Origin::Interactive);
        }
        let _ = reply.send(Ok(SteerAnswer { steer, outcome }));
        // Forwards the steer to the engine (or starts its turn).
        self.apply(myself, step.effects, None).await;
    }
}

/// Counts a prompt whose admission is stored.
pub(super) fn count_admitted(origin: Origin) {
    metrics::counter!("tiller_prompts_admitted_total", "origin" => origin.as_str()).increment(1);
}

pub(super) fn steer_outcome_label(o: &SteerOutcome) -> &'static str {
    match o {
        SteerOutcome::Injected { .. } => "injected",
        SteerOutcome::PromptRequired(_) => "prompt_required",
        SteerOutcome::StartedNewTurn { .. } => "started_new_turn",
    }
}
