//! Publishing: sequence numbers, durable appends and their failures,
//! fan-out, terminals and snapshots.

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most time a streamed event waits for the events after it before it is
/// sent to the store, when the one before was sent less than this ago.
pub(super) const LINGER: Duration = Duration::from_millis(50);

/// Events that end a linger early.
pub(super) const LINGER_MAX: usize = 32;

/// Failed streamed commits in a row a session retries before it stops
/// (see `SessionState::append_failed`).
const LOST_TRIES: u32 = 3;

/// How a session recovers from failed streamed commits.
#[derive(Default)]
pub(super) struct Recovery {
    /// How often the log was reopened after a failed append: a failure
    /// reported before the last reopen is stale (that reopen sent its
    /// events again). `SessionMsg::AppendFailed` carries its value then.
    reopens: Arc<AtomicU64>,
    /// Failed streamed commits since the last one that succeeded.
    lost: u32,
}

/// A turn's first events, which never linger (its start, its first
/// chunks: what a person waits for).
pub(super) const LINGER_AFTER: u8 = 8;

/// A `last_flush` that lets the next event go at once (a new session, a
/// new turn: its first chunk is not held back).
pub(super) fn unlingered() -> tokio::time::Instant {
    let now = crate::clock::instant();
    now.checked_sub(LINGER).unwrap_or(now)
}

impl SessionState {
    pub(super) async fn settle(
        &mut self,
        prompt: PromptId,
        turn: Option<TurnId>,
        origin: Origin,
        terminal: Terminal,
        loop_stopped: bool,
        pending: Pending,
    ) {
        let now = self.now();
        if turn.is_none() {
            // A queued prompt settled without running.
            metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
        }
        if let Some(t) = turn {
            self.abandon_permission(t);
        }
        let final_text = self
            .running
            .as_ref()
            .filter(|r| Some(r.turn) == turn)
            .map(|r| r.text.clone());
        if let Some(run) = self.running.take_if(|r| Some(r.turn) == turn) {
            run.span
                .in_scope(|| tracing::info!(outcome = terminal.outcome_label(), "turn settled"));
            if self.core.winding() == turn {
                // Settled at its cancel: the engine stops behind it (its
                // calls were stopped at the abort), and the conversation
                // is saved once it is gone.
                self.winding = Some((Box::new(run), crate::clock::instant()));
            } else {
                drop(run); // the engine never outlives its turn
                let _ = self.save_conversation().await; // logged; retried at the next save
            }
        }
        if terminal == Terminal::Completed(tiller_core::StopReason::Cancelled)
            && let Some(at) = self.cancel_at.take()
            && turn.is_some()
        {
            metrics::histogram!("tiller_cancel_latency_seconds").record(at.elapsed().as_secs_f64());
        }
        let body = match &terminal {
            Terminal::Completed(r) => EventBody::TurnComplete {
                stop_reason: r.as_str().into(),
            },
            Terminal::Failed { kind, message } => EventBody::TurnError {
                error_kind: kind.as_str().into(),
                message: message.clone(),
                loop_type: kind.loop_type().map(|t| t.as_str().into()),
                code: kind.loop_type().map(|_| "LOOP_DETECTED".into()),
            },
        };
        // The delivery of the final text commits with the terminal: every
        // end of the turn, so a sender hears of a cancel or a failure too.
        let ledger = match pending.delivery.clone() {
            Some(url) => Ledger::Deliver(tiller_store::Delivery {
                id: 0,
                url,
                session: self.id,
                prompt,
                text: final_text.unwrap_or_default(),
                stop_reason: tiller_store::Delivery::stop_reason_of(&terminal),
                attempts: 0,
                next_at_ms: unix_ms(),
            }),
            None => Ledger::Plain,
        };
        let delivers = matches!(ledger, Ledger::Deliver(_));
        let terminal = match self.publish_durable(Some(prompt), turn, body, ledger).await {
            Ok(()) => terminal,
            // Not stored: the owner hears what the log will say once the
            // failed session is reconciled.
            Err(_) => Terminal::failed(self.failure_kind()),
        };
        if self.failed.is_none() {
            if delivers && let Some(w) = &self.config.delivery_wake {
                w.notify_one();
            }
            if turn.is_some()
                && let Some(q) = self.automation.queue(origin)
            {
                let inbox: Arc<dyn Inbox> = self.slot.clone();
                q.turn_ended(self.id, loop_stopped, inbox);
            }
        }
        metrics::counter!(
            "tiller_turns_settled_total",
            "origin" => origin.as_str(),
            "outcome" => terminal.outcome_label()
        )
        .increment(1);
        metrics::histogram!("tiller_turn_duration_seconds", "origin" => origin.as_str())
            .record(now.saturating_sub(pending.admitted_at) as f64 / 1000.0);
        // Recorded before the request hears it: a scrape after the answer
        // counts it.
        metrics::histogram!("tiller_settle_latency_seconds")
            .record(self.input_at.elapsed().as_secs_f64());
        if let Some(tx) = pending.settled {
            let _ = tx.send(Settlement { prompt, terminal });
        }
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        // A turn settled at its cancel is over, its engine stopping or not
        // (what was sent meanwhile is listed as queued).
        let (state, active_prompt) = match self.core.active() {
            None => (TurnState::Idle, None),
            Some((p, _)) if self.core.is_cancelling() => (TurnState::Cancelling, Some(p)),
            Some((p, _)) => (TurnState::Running, Some(p)),
        };
        Snapshot {
            state,
            active_prompt,
            queued: self.core.queued().collect(),
            // Only while idle: a running turn is newer content.
            last_turn_error: self
                .last_turn_error
                .clone()
                .filter(|_| state == TurnState::Idle),
            pending_permission: self.pending_permission.clone(),
            last_seq: self.fanned,
            usage: self.usage.as_deref().cloned(),
        }
    }

    /// Gives an event the next sequence number.
    pub(super) fn record(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        body: EventBody,
    ) -> Arc<EventRecord> {
        self.seq += 1;
        Arc::new(EventRecord {
            session: self.id,
            seq: self.seq,
            ts_ms: unix_ms(),
            prompt,
            turn,
            body,
        })
    }

    /// Keeps what the session's state shows of a published event.
    pub(super) fn remember(&mut self, rec: &Arc<EventRecord>) {
        match rec.body {
            EventBody::PermissionRequested { .. } => self.pending_permission = Some(rec.clone()),
            EventBody::PermissionResolved { .. } => self.pending_permission = None,
            EventBody::TurnError { .. } => self.last_turn_error = Some(rec.clone()),
            // Newer turn content supersedes the error.
            EventBody::PromptStarted { .. } => self.last_turn_error = None,
            _ => {}
        }
    }

    pub(super) fn fan_out(&mut self, rec: &Arc<EventRecord>) {
        self.remember(rec);
        self.published.increment(1);
        let evicted = self.subscribers.deliver(rec);
        if evicted > 0 {
            metrics::counter!("tiller_subscriber_evictions_total").increment(evicted as u64);
        }
    }

    /// Appends an event (ordered, not awaited); it is fanned out once the
    /// store says it committed.
    pub(super) fn publish(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        mut body: EventBody,
    ) {
        match &mut body {
            // A hosted agent's calls carry their own locations and diff.
            EventBody::ToolCall {
                name,
                input,
                locations,
                kind: None,
                ..
            } => *locations = self.toolbox.locations(name, input),
            EventBody::PermissionRequested { call, .. } if call.kind.is_none() => {
                call.locations = self.toolbox.locations(&call.name, &call.input);
                call.diff = self.toolbox.diff(&call.name, &call.input);
            }
            _ => {}
        }
        // Only streamed text lingers; any other event goes at once, with
        // what lingers before it.
        let streamed = matches!(
            body,
            EventBody::AgentMessageChunk { .. } | EventBody::AgentThoughtChunk { .. }
        );
        let rec = self.record(prompt, turn, body);
        let op = rec.ledger_op();
        // Sent at the next `Flush` (or with the next durable event), and
        // shown once committed (`committed`): a viewer never sees an event
        // the log may not keep, nor a number the log may give another.
        self.unconfirmed.push((rec, op));
        self.signals.pace.held(self.unconfirmed.len());
        if self.unsent == 0 {
            // A slow stream (a model's pace) lingers: its chunks go to the
            // store together, at most every `LINGER`, so a commit carries
            // several of them (each commit costs a page of the log per
            // session, however few events it holds). A turn's first
            // events, the first after a pause and a stream that fills
            // `LINGER_MAX` go at once.
            let since = crate::clock::instant().saturating_duration_since(self.last_flush);
            if !streamed || self.eager > 0 || since >= LINGER {
                let _ = self.myself.send_message(SessionMsg::Flush);
            } else if !self.lingering {
                self.lingering = true;
                // The message finds the events sent already if the
                // stream filled up meanwhile: then it does nothing.
                self.myself.send_after(LINGER - since, || SessionMsg::Flush);
            }
        } else if self.lingering && !streamed {
            let _ = self.myself.send_message(SessionMsg::Flush);
        }
        self.unsent += 1;
        self.eager = self.eager.saturating_sub(1);
        if self.lingering && self.unsent as usize == LINGER_MAX {
            let _ = self.myself.send_message(SessionMsg::Flush);
        }
    }

    /// What was published and not yet sent to the store, oldest first.
    fn take_unsent(&mut self) -> Vec<(tiller_store::StoredEvent, Option<LedgerOp>)> {
        let n = std::mem::take(&mut self.unsent) as usize;
        let from = self.unconfirmed.len().saturating_sub(n);
        self.unconfirmed[from..]
            .iter()
            .map(|(r, op)| (r.to_stored(), op.clone()))
            .collect()
    }

    /// Sends the store what was published and not sent yet, in one batch.
    pub(super) fn flush(&mut self) {
        // Whatever `Flush` this is, a linger's is no longer needed: the
        // next slow event arms one afresh (never a linger without its
        // `Flush` on the way, even after a durable append took the events).
        self.lingering = false;
        if self.unsent == 0 {
            return;
        }
        self.last_flush = crate::clock::instant();
        let events = self.take_unsent();
        let tell = self.on_commit();
        self.store.append_many(events, tell);
    }

    /// What the store calls once this session's appends committed (or a
    /// commit of them failed).
    fn on_commit(&mut self) -> tiller_store::OnCommit {
        let actor = &self.myself;
        let reopens = &self.recovery.reopens;
        self.on_commit
            .get_or_insert_with(|| {
                let actor = actor.clone();
                let reopens = reopens.clone();
                Arc::new(move |r| {
                    let _ = actor.send_message(match r {
                        Ok(seq) => SessionMsg::Committed(seq),
                        Err(e) => SessionMsg::AppendFailed(reopens.load(Ordering::Relaxed), e),
                    });
                })
            })
            .clone()
    }

    /// A commit of streamed events failed, so the log is broken and what
    /// was published since will not commit either: nothing would end a
    /// stream whose engine waits for room (see `Pace`) but the stall
    /// bound. Reopens the log and sends again what it lost, as a durable
    /// append's retry does (backing off, at most [`LOST_TRIES`] failures
    /// in a row, and only for a store that may come back); then the
    /// session fails, as a failed durable append makes it, and the running
    /// prompt's owner hears `store_unavailable`. Stale when the log was
    /// reopened since the failure (that reopen sent them again).
    pub(super) async fn append_failed(&mut self, reopens: u64, e: &StoreError) {
        if reopens != self.recovery.reopens.load(Ordering::Relaxed) || self.unconfirmed.is_empty() {
            return;
        }
        self.recovery.lost += 1;
        while e.is_unavailable() && self.recovery.lost <= LOST_TRIES {
            let lost = self.recovery.lost;
            tracing::warn!(session = %self.id, error = %e, attempt = lost, "streamed events were not stored; retrying");
            tokio::time::sleep(Duration::from_millis(25 << (2 * lost))).await;
            if self.resend_lost().await.is_some() {
                return;
            }
            self.recovery.lost += 1;
        }
        tracing::error!(session = %self.id, error = %e, "streamed events could not be stored; the session stops");
        self.failed = Some(crate::SessionFailed::of(e));
        if let Some((prompt, tx)) = self.core.active().map(|(prompt, _)| prompt).zip(
            self.core
                .active_payload_mut()
                .and_then(|p| p.settled.take()),
        ) {
            let terminal = Terminal::failed(self.failure_kind());
            let _ = tx.send(Settlement { prompt, terminal });
        }
    }

    /// Reopens the log after a failed append and sends again what it
    /// lost (everything published after its stored head, with the
    /// sequence numbers clients already saw); the log's last sequence
    /// number, `None` when it cannot be reopened. Reports older than this
    /// reopen become stale.
    async fn resend_lost(&mut self) -> Option<u64> {
        let Ok(head) = self.store.reopen_log(self.id).await else {
            return None;
        };
        self.recovery.reopens.fetch_add(1, Ordering::Relaxed);
        // Sent here, with the rest.
        self.unsent = 0;
        let tell = self.on_commit();
        for (u, op) in self
            .unconfirmed
            .iter()
            .filter(|(u, _)| u.seq > head.last_seq)
        {
            self.store
                .append(u.to_stored(), op.clone(), Some(tell.clone()));
        }
        Some(head.last_seq)
    }

    /// Whether `rec`, whose append was reported failed, is in the log
    /// after all, itself (another node's reconcile may have written at
    /// its number). Before another try the log is reopened and what it
    /// lost sent again; on the last, it is only looked at (the session
    /// fails with nothing more stored) and reopened if `rec` is there.
    async fn stored_after_all(&mut self, rec: &EventRecord, last_try: bool) -> bool {
        if last_try {
            return self.holds(rec).await && self.resend_lost().await.is_some();
        }
        if self.resend_lost().await.is_none_or(|last| last < rec.seq) {
            return false;
        }
        self.holds(rec).await
    }

    /// Whether the log holds `rec` at its number.
    async fn holds(&mut self, rec: &EventRecord) -> bool {
        let there = self.store.events_after(self.id, rec.seq - 1, 1).await;
        there.is_ok_and(|e| e.first() == Some(&rec.to_stored()))
    }

    /// The store committed this session's events up to `seq`: they are
    /// fanned out, in order, and need no re-sending.
    pub(super) fn committed(&mut self, seq: u64) {
        let ready: Vec<Arc<EventRecord>> = self
            .unconfirmed
            .iter()
            .filter(|(r, _)| r.seq > self.fanned && r.seq <= seq)
            .map(|(r, _)| r.clone())
            .collect();
        for r in &ready {
            self.fan_out(r);
        }
        self.fanned = self.fanned.max(seq);
        self.recovery.lost = 0;
        self.unconfirmed.retain(|(r, _)| r.seq > seq);
        self.signals.pace.held(self.unconfirmed.len());
    }

    /// Appends an event, waits for its commit, and only then fans it out
    /// (after every earlier one).
    /// `retries` is how often a failure the store may recover from is
    /// retried (the log is reopened and what it lost sent again, with the
    /// sequence numbers clients already saw). On error nobody saw the
    /// event, and the session fails once the current message is handled:
    /// its in-memory state is no longer the log's, so it is rebuilt from
    /// the store and its unsettled prompts are reconciled.
    pub(super) async fn publish_durable(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        body: EventBody,
        ledger: Ledger,
    ) -> Result<(), StoreError> {
        let rec = self.record(prompt, turn, body);
        let mut op = rec.ledger_op();
        if let (Some(LedgerOp::Settle { delivery, .. }), Ledger::Deliver(d)) = (&mut op, &ledger) {
            *delivery = Some(d.clone());
        }
        let retries = match ledger {
            Ledger::Admission => 0,
            Ledger::Plain | Ledger::Deliver(_) => 3,
        };
        let mut attempt = 0;
        // What was published before it goes first, in the same commit.
        let mut before = self.take_unsent();
        loop {
            // Nothing to tell: what went before commits or fails with it,
            // in one transaction, and both outcomes are handled below.
            let r = self
                .store
                .append_durable_after(std::mem::take(&mut before), rec.to_stored(), op.clone())
                .await;
            let stored = match r {
                Ok(()) => true,
                Err(e) if e.is_unavailable() => {
                    let last_try = attempt >= retries;
                    if !last_try {
                        attempt += 1;
                        tracing::warn!(session = %self.id, error = %e, attempt, seq = rec.seq, "durable append failed; retrying");
                        tokio::time::sleep(Duration::from_millis(25 << (2 * attempt))).await;
                    }
                    // Stored after all (the commit's answer was lost, not
                    // the commit): what the log says is what happened.
                    let stored = self.stored_after_all(&rec, last_try).await;
                    if !stored && last_try {
                        tracing::error!(session = %self.id, error = %e, seq = rec.seq, "durable append failed; the session stops");
                        self.failed = Some(crate::SessionFailed::of(&e));
                        return Err(e);
                    }
                    stored
                }
                Err(e) => {
                    tracing::error!(session = %self.id, error = %e, seq = rec.seq, "durable append failed; the session stops");
                    self.failed = Some(crate::SessionFailed::of(&e));
                    return Err(e);
                }
            };
            if stored {
                // Everything before it committed too (appends commit in
                // order; a lost one would have failed this one).
                self.admission_stored();
                self.committed(rec.seq - 1);
                self.fan_out(&rec);
                self.fanned = rec.seq;
                self.unconfirmed.clear();
                self.signals.pace.held(0);
                return Ok(());
            }
        }
    }
}

impl SessionState {
    /// Stores what was published and not sent (a deferred admission among
    /// it, see `Acknowledge::Terminal`) and waits for the commit: a turn
    /// goes no further than streaming content before its prompt is stored.
    /// On error the prompt's owner hears `store_unavailable` (nothing of
    /// it was shown, nothing is in the log) and the session fails; false.
    pub(super) async fn store_admission(&mut self) -> bool {
        let Some((prompt, _)) = self.admitting else {
            return true;
        };
        // Every path that sends a deferred admission waits for it, so it
        // is still unsent here.
        let mut events = self.take_unsent();
        let Some((last, op)) = events.pop() else {
            self.admission_stored();
            return true;
        };
        let seq = last.seq;
        // Its outcome is the events' too (one transaction): nothing to tell.
        let r = self.store.append_durable_after(events, last, op).await;
        match r {
            Ok(()) => {
                self.admission_stored();
                self.committed(seq);
                true
            }
            Err(e) => {
                self.admitting = None;
                tracing::error!(session = %self.id, error = %e, %prompt, "a prompt's admission could not be stored; the session stops");
                self.failed = Some(crate::SessionFailed::of(&e));
                if let Some(tx) = self
                    .core
                    .active_payload_mut()
                    .and_then(|p| p.settled.take())
                {
                    let terminal = Terminal::failed(self.failure_kind());
                    let _ = tx.send(Settlement { prompt, terminal });
                }
                false
            }
        }
    }

    /// A deferred admission is stored: it counts as admitted.
    fn admission_stored(&mut self) {
        if let Some((_, origin)) = self.admitting.take() {
            admit::count_admitted(origin);
        }
    }

    /// Stores the start of automatic work (its queue row consumed) and the
    /// prompt's message in one commit, then shows both: a start is never
    /// stored without what it asked, whose only other copy was the row it
    /// consumed. Not retried (an admission): on error the work stays
    /// queued and the session fails, as for [`SessionState::publish_durable`].
    pub(super) async fn publish_start(
        &mut self,
        prompt: PromptId,
        turn: TurnId,
        start: EventBody,
        claim: Option<tiller_store::Claim>,
        message: EventBody,
    ) -> Result<(), StoreError> {
        let rec = self.record(Some(prompt), Some(turn), start);
        let mut op = rec.ledger_op();
        if let Some(LedgerOp::Admit { consumes, .. }) = &mut op {
            *consumes = claim;
        }
        let msg = self.record(Some(prompt), Some(turn), message);
        let mut before = self.take_unsent();
        before.push((rec.to_stored(), op));
        // Its outcome is theirs too (one transaction): nothing to tell.
        let r = self
            .store
            .append_durable_after(before, msg.to_stored(), msg.ledger_op())
            .await;
        match r {
            Ok(()) => {
                self.admission_stored();
                self.committed(rec.seq - 1);
                self.fan_out(&rec);
                self.fan_out(&msg);
                self.fanned = msg.seq;
                self.unconfirmed.clear();
                self.signals.pace.held(0);
                Ok(())
            }
            Err(e) => {
                tracing::error!(session = %self.id, error = %e, seq = rec.seq, "durable append failed; the session stops");
                self.failed = Some(crate::SessionFailed::of(&e));
                Err(e)
            }
        }
    }
}

/// What a durable event carries besides its ledger change.
pub(super) enum Ledger {
    /// An admission: refused at once if it cannot be stored (the caller
    /// retries; nothing was acknowledged).
    Admission,
    /// Anything else durable: retried before the session gives up.
    Plain,
    /// A terminal with the webhook delivery of its final text.
    Deliver(tiller_store::Delivery),
}

/// Wall-clock time for event timestamps (display only; ordering is `seq`).
pub(super) fn unix_ms() -> i64 {
    crate::clock::unix_ms()
}
