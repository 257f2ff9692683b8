//! The session's message loop: each message becomes core inputs.

use super::*;

impl SessionState {
    pub(super) fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// How the running turn's engine stops at a cancel (with none running,
    /// the turn settles at its grace, as it always did).
    fn engine_stop(&self) -> EngineStop {
        self.running
            .as_ref()
            .map_or(EngineStop::Answered, |r| r.stop)
    }

    /// Handles at once the frequent messages that await nothing (a
    /// commit's report, a flush's second round): as [`Self::handle`] does.
    /// Returns the others, for it.
    pub(super) fn handle_now(&mut self, msg: SessionMsg) -> Option<SessionMsg> {
        match msg {
            SessionMsg::Committed(seq) => {
                self.input_at = crate::clock::instant();
                self.committed(seq);
                None
            }
            SessionMsg::Flush
                if (self.flush_deferred || self.unsent == 0) && self.admitting.is_none() =>
            {
                self.input_at = crate::clock::instant();
                self.flush_deferred = false;
                self.flush();
                None
            }
            msg => Some(msg),
        }
    }

    pub(super) async fn handle(&mut self, myself: &ActorRef<SessionMsg>, msg: SessionMsg) {
        // Not input: the registry asking.
        match msg {
            SessionMsg::ParkIfIdle => return self.park_if_idle(myself),
            SessionMsg::Park => return self.park(myself),
            _ => {}
        }
        // A tick that wakes no one is not input either: it must not put
        // off parking (see `wake.rs`).
        if !matches!(msg, SessionMsg::Tick(_)) {
            self.input_at = crate::clock::instant();
        }
        match msg {
            SessionMsg::ParkIfIdle | SessionMsg::Park => {}
            SessionMsg::Prompt {
                id,
                text,
                images,
                origin,
                delivery,
                admitted,
                settled,
                ack,
            } => {
                let ports = (admitted, settled);
                self.prompt(myself, id, (text, images), (origin, ack), delivery, ports)
                    .await;
            }
            SessionMsg::Steer {
                text,
                prompt_required,
                reply,
            } => self.steer(myself, text, prompt_required, reply).await,
            SessionMsg::Cancel => {
                if self.core.active().is_some() && !self.core.is_cancelling() {
                    self.cancel_at = Some(crate::clock::instant());
                }
                let stop = self.engine_stop();
                self.feed(myself, Input::Cancel(stop), None).await;
            }
            SessionMsg::SaveSettings => {
                let _ = self.save_settings().await; // logged; retried at the next change
            }
            SessionMsg::SetRoots { roots, reply } => {
                let _ = reply.send(self.set_roots(roots).await);
            }
            SessionMsg::ClearConversation(reply) => {
                let r = if self.core.busy() {
                    Err("a turn is running (or its engine still stopping): /cancel it first, or wait for it to end".into())
                } else {
                    // Acknowledged once stored (a failed write is retried
                    // with the next save, and the caller hears of it).
                    self.conversation.clear();
                    match self.save_conversation().await {
                        Ok(()) => {
                            self.publish(None, None, EventBody::ConversationCleared);
                            Ok(())
                        }
                        Err(e) => Err(format!("the cleared conversation could not be stored: {e}")),
                    }
                };
                let _ = reply.send(r);
            }
            SessionMsg::SetTitle { title, reply } => {
                let r = self.set_title(title).await;
                if let Some(reply) = reply {
                    let _ = reply.send(r);
                }
            }
            SessionMsg::Withdraw(prompt) => {
                if self.core.active().is_some_and(|(p, _)| p == prompt)
                    && !self.core.is_cancelling()
                {
                    self.cancel_at = Some(crate::clock::instant());
                }
                let stop = self.engine_stop();
                self.feed(myself, Input::Withdraw { prompt, stop }, None)
                    .await;
            }
            SessionMsg::Signals => {
                for sig in self.signals.next_run(&self.slot, myself) {
                    if self.failed.is_some() {
                        break; // the actor stops after this message
                    }
                    // Each signal is an input of its own (settle latency).
                    self.input_at = crate::clock::instant();
                    self.signals.pace.handled();
                    // Content may go ahead of a deferred admission; a tool
                    // batch, a hosted agent's call or request, a steer's
                    // receipt may not.
                    let content = matches!(
                        sig.kind,
                        SignalKind::Update(_) | SignalKind::Result(_) | SignalKind::Idle
                    );
                    if !content && !self.store_admission().await {
                        continue;
                    }
                    let signal = core_signal(&sig.kind);
                    self.feed(
                        myself,
                        Input::Signal {
                            turn: sig.turn,
                            signal,
                        },
                        Some(sig.kind),
                    )
                    .await;
                }
            }
            SessionMsg::Tick(generation) => {
                let now = self.now();
                if self.wake.fired(myself, generation, now) {
                    self.input_at = crate::clock::instant();
                    self.feed(myself, Input::Tick, None).await;
                }
            }
            SessionMsg::Committed(seq) => self.committed(seq),
            SessionMsg::AppendFailed(reopens, e) => self.append_failed(reopens, &e).await,
            SessionMsg::Flush if !self.flush_deferred && self.unsent > 0 => {
                self.flush_deferred = true;
                crate::task::yield_to_woken().await;
                let _ = myself.send_message(SessionMsg::Flush);
            }
            SessionMsg::Flush => {
                self.flush_deferred = false;
                if self.admitting.is_some() {
                    self.store_admission().await;
                } else {
                    self.flush();
                }
            }
            SessionMsg::ToolDone { turn, id, output } => {
                let trip = self.tool_done(turn, id, output);
                // The engine is silent while tools run: a finished call is
                // the turn's progress (the stall bound restarts).
                self.feed(myself, Input::ToolProgress { turn }, None).await;
                if let Some(loop_type) = trip {
                    self.feed(myself, Input::LoopTrip { turn, loop_type }, None)
                        .await;
                }
            }
            SessionMsg::SetMcp {
                servers,
                events,
                done,
            } => {
                self.toolbox = Arc::new((*self.toolbox).clone().with_mcp(servers));
                for body in events {
                    self.publish(None, None, body);
                }
                let _ = done.send(());
            }
            SessionMsg::Options(reply) => {
                let _ = reply.send(self.options());
            }
            SessionMsg::SetOption { id, value, reply } => {
                let r = self.set_option(&id, &value).await;
                let _ = reply.send(r);
            }
            SessionMsg::Kick => self.feed(myself, Input::Kick, None).await,
            SessionMsg::Offer { origin, poll, work } => {
                self.offer(myself, origin, poll, work).await;
            }
            SessionMsg::Automation { body, kick, ack } => {
                match ack {
                    Some(ack) => {
                        let stored = self.publish_durable(None, None, body, Ledger::Plain).await;
                        let _ = ack.send(stored.map_err(crate::SessionError::from));
                    }
                    None => self.publish(None, None, body),
                }
                if kick {
                    self.feed(myself, Input::Kick, None).await;
                }
            }
            SessionMsg::NotificationQueued {
                task_id,
                text,
                deduplicated,
                evicted,
            } => {
                for t in evicted {
                    self.publish(None, None, EventBody::NotificationEvicted { task_id: t });
                }
                self.publish(
                    None,
                    None,
                    EventBody::NotificationQueued {
                        task_id,
                        text,
                        deduplicated,
                    },
                );
                self.feed(myself, Input::Kick, None).await;
            }
            SessionMsg::Permission {
                request_id,
                option_id,
                reply,
            } => {
                let trip = match self.permission(&request_id, &option_id) {
                    Ok(trip) => {
                        let _ = reply.send(Ok(()));
                        if option_id == "allow_always" {
                            let _ = self.save_settings().await; // logged
                        }
                        Some(trip)
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        None
                    }
                };
                if let (Some(trip), Some((_, turn))) = (trip, self.core.active()) {
                    // A decision is progress too: the stall bound restarts
                    // for what the call does next.
                    self.feed(myself, Input::ToolProgress { turn }, None).await;
                    if let Some(loop_type) = trip {
                        self.feed(myself, Input::LoopTrip { turn, loop_type }, None)
                            .await;
                    }
                }
            }
            SessionMsg::Subscribe {
                id,
                subscriber,
                reply,
            } => {
                self.subscribers.attach(id, subscriber);
                let _ = reply.send(self.snapshot());
            }
            SessionMsg::Snapshot(reply) => {
                // A prompt is shown running once its admission is stored;
                // if that fails the session fails, and the caller hears
                // that it stopped.
                if self.store_admission().await {
                    let _ = reply.send(self.snapshot());
                }
            }
            SessionMsg::Unsubscribe(id) => drop(self.subscribers.detach(id)),
            #[cfg(feature = "test-hooks")]
            SessionMsg::Crash => panic!("session actor crash requested by a test"),
            SessionMsg::Drain(reply) => {
                // Nothing starts any more; what runs is cancelled, what is
                // queued settles. Work in the queue actors stays durable.
                if !self.core.busy() && self.core.is_closing() {
                    let _ = reply.send(());
                } else {
                    self.drained.push(reply);
                    if self.core.active().is_some() {
                        self.cancel_at = Some(crate::clock::instant());
                    }
                    self.feed(myself, Input::Close(self.engine_stop()), None)
                        .await;
                }
            }
            SessionMsg::Close(reply) => {
                if !self.closing {
                    self.closing = true;
                    if self.core.active().is_some() {
                        self.cancel_at = Some(crate::clock::instant());
                    }
                    self.feed(myself, Input::Close(self.engine_stop()), None)
                        .await;
                }
                // Answered only once the close is stored (a close after one
                // that failed stores what it did not). A session its step
                // failed writes nothing more.
                let stored = match self.failed {
                    Some(f) => Err(f.error(self.id)),
                    None => self.store_close().await.map_err(crate::SessionError::from),
                };
                if stored.is_ok() {
                    // Its queued work went with the close.
                    for q in self.automation.queues.iter() {
                        q.forget(self.id);
                    }
                }
                let _ = reply.send(stored);
                if !self.core.busy() {
                    myself.stop(Some("closed".into()));
                }
            }
        }
    }

    /// Stores the close: its event, then the session's row (its queued
    /// work removed with it), each once.
    async fn store_close(&mut self) -> Result<(), StoreError> {
        if !self.close_stored.0 {
            // A close that failed before this actor started may have
            // stored its event: last in the log, it is not published again.
            let last = self
                .store
                .last_of_kinds(self.id, &["session_closed"])
                .await?;
            self.close_stored.0 = last.is_some_and(|e| e.seq == self.seq);
        }
        if !self.close_stored.0 {
            self.publish_durable(None, None, EventBody::SessionClosed, Ledger::Plain)
                .await?;
            self.close_stored.0 = true;
        }
        if !self.close_stored.1 {
            self.store.close_session(self.id).await?;
            self.close_stored.1 = true;
        }
        Ok(())
    }
}
