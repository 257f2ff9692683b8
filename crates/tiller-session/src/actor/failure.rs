//! What a failing session tells: the owners of the prompts it still
//! holds hear what its log will say once it is reconciled (see the
//! registry's `failed`), whatever step or path the failure cut short.

use super::*;

impl SessionState {
    /// What the log will say of this failing session's prompts once they
    /// are reconciled (see [`crate::SessionFailed::kind`]).
    pub(super) fn failure_kind(&self) -> tiller_core::ErrorKind {
        self.failure()
            .map_or(tiller_core::ErrorKind::StoreUnavailable, |f| f.kind())
    }

    /// Why the session fails: another node took it over (this node found
    /// its lease lost, whatever else failed meanwhile), or what its store
    /// refused. The owners of its prompts hear what the log will say.
    fn failure(&self) -> Option<crate::SessionFailed> {
        if self.taken_over() {
            return Some(crate::SessionFailed::LeaseLost);
        }
        self.failed
    }

    /// Whether another node took the session over (this node found its
    /// lease lost): it writes nothing more, and the owners of the prompts
    /// it holds hear `node_lost`, what the new owner stores (see the
    /// `Drop` below).
    pub(super) fn taken_over(&self) -> bool {
        matches!(*self.slot.lock(), crate::handle::SlotState::Taken)
    }

    /// A failing session's effects that will not be carried out: each
    /// terminal's owner hears what the log will say once reconciled (its
    /// port left the core with the effect), and a queued prompt settled or
    /// started here no longer counts as queued.
    pub(super) fn told_failed(&mut self, effects: impl Iterator<Item = Effect<Pending, String>>) {
        let terminal = Terminal::failed(self.failure_kind());
        for e in effects {
            match e {
                Effect::Settled {
                    prompt,
                    turn,
                    mut payload,
                    ..
                } => {
                    if turn.is_none() {
                        metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
                    }
                    if let Some(tx) = payload.settled.take() {
                        let terminal = terminal.clone();
                        let _ = tx.send(Settlement { prompt, terminal });
                    }
                }
                Effect::StartTurn {
                    prompt,
                    deferred: true,
                    ..
                } if self.core.active().is_some_and(|(p, _)| p == prompt)
                    && self.core.active_payload().is_some_and(|p| p.work.is_none()) =>
                {
                    metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
                }
                _ => {}
            }
        }
    }
}

/// However the actor ends (stopped, failed, panicked: a failure and a
/// panic skip `post_stop`), the prompts whose ports it still holds are
/// told, and no longer counted as queued. A failed session's owners (and a
/// taken-over one's) hear what its log will say once reconciled; after a
/// panic the ports are dropped, which the edges report as
/// `session_restarted`, what the registry then stores.
impl Drop for SessionState {
    fn drop(&mut self) {
        let queued = self.core.queued().count();
        if queued > 0 {
            metrics::gauge!("tiller_prompt_queue_depth").decrement(queued as f64);
        }
        let Some(failed) = self.failure() else {
            return;
        };
        let terminal = Terminal::failed(failed.kind());
        let tell = |prompt, payload: &mut Pending| {
            if let Some(tx) = payload.settled.take() {
                let terminal = terminal.clone();
                let _ = tx.send(Settlement { prompt, terminal });
            }
        };
        if let Some((prompt, _)) = self.core.active()
            && let Some(payload) = self.core.active_payload_mut()
        {
            tell(prompt, payload);
        }
        for (prompt, payload) in self.core.queued_payloads_mut() {
            tell(prompt, payload);
        }
    }
}
