//! A session whose actor failed is opened again by itself: its prompts in
//! flight were settled (`failed`), and the work queued for it (a goal's
//! next turn, a notification, a cron fire) must not wait until a client
//! happens to open it. While it cannot be opened (the store still down)
//! it is tried again after a pause that grows; one that keeps failing
//! waits longer each time, and after [`TRIES`] failures of its actor in a
//! row it is left for a client to open (a failure its queued work causes would
//! otherwise run that work again, once a minute, for ever).

use super::*;

/// Failures of one session this long apart start its pauses over.
const FORGIVEN_AFTER: Duration = Duration::from_secs(600);

/// Failures of its actor in a row after which a session is no longer
/// opened by itself.
const TRIES: u32 = 8;

/// A failed session being opened again.
pub(super) struct Reopening {
    /// Failures of its actor.
    failures: u32,
    /// Failed opens since it last opened.
    tries: u32,
    /// The last of either.
    at: tokio::time::Instant,
}

/// The pause before try `n` (from 0): a second, doubling to a minute.
fn pause(n: u32) -> Duration {
    tiller_core::backoff::doubling(n, Duration::from_secs(60))
}

impl RegistryState {
    /// After the session's actor failed: open it again after a pause. Not
    /// a damaged session (nothing runs until it is deleted) nor one taken
    /// over (its new owner runs it).
    pub(super) fn reopen_later(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
        err: &ActorProcessingErr,
    ) {
        use crate::SessionFailed::{Damaged, LeaseLost};
        if matches!(err.downcast_ref(), Some(Damaged | LeaseLost)) {
            return;
        }
        self.retry_open(myself, id, true);
    }

    /// Opens it again after a pause: after a failure of its actor
    /// (`failed`: counted, [`TRIES`] in a row at most), or of an open (the
    /// store still down: tried for as long as it takes, once a minute at
    /// most, or its prompts would stay unsettled and its lease held).
    fn retry_open(&mut self, myself: &ActorRef<RegistryMsg>, id: SessionId, failed: bool) {
        let now = crate::clock::instant();
        self.reopening
            .retain(|_, r| now.duration_since(r.at) <= FORGIVEN_AFTER);
        let r = self.reopening.entry(id).or_insert(Reopening {
            failures: 0,
            tries: 0,
            at: now,
        });
        if failed {
            if r.failures >= TRIES {
                tracing::error!(session = %id, failures = r.failures, "the session keeps failing; it is not opened again until a client opens it");
                self.reopening.remove(&id);
                return;
            }
            r.failures += 1;
        } else {
            r.tries = r.tries.saturating_add(1);
        }
        r.at = now;
        let wait = pause(r.failures.saturating_add(r.tries).saturating_sub(1));
        myself.send_after(wait, move || RegistryMsg::Reopen(id));
    }

    /// Opens the failed session and lets it look for work.
    pub(super) async fn reopen(&mut self, myself: &ActorRef<RegistryMsg>, id: SessionId) {
        match self.open(myself, id).await {
            Ok(slot) => {
                if let Some(r) = self.reopening.get_mut(&id) {
                    r.tries = 0;
                }
                let _ = slot.send(SessionMsg::Kick);
            }
            Err(e @ (SessionError::Store(_) | SessionError::TooManySessions(_))) => {
                tracing::warn!(session = %id, error = %e, "cannot open the failed session yet; it is tried again");
                self.retry_open(myself, id, false);
            }
            // Deleted, or another node serves it.
            Err(e) => {
                tracing::debug!(session = %id, error = %e, "the failed session is not opened again");
                self.reopening.remove(&id);
            }
        }
    }
}
