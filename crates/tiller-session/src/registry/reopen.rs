//! A session whose actor failed is opened again by itself: its prompts in
//! flight were settled (`failed`), and the work queued for it (a goal's
//! next turn, a notification, a cron fire) must not wait until a client
//! happens to open it. While it cannot be opened (the store still down)
//! it is tried again after a pause that grows; one that keeps failing
//! waits longer each time, and after [`TRIES`] failures in a row it is
//! left for a client to open (a failure its queued work causes would
//! otherwise run that work again, once a minute, for ever).

use super::*;

/// Failures of one session this long apart start its pauses over.
const FORGIVEN_AFTER: Duration = Duration::from_secs(600);

/// Failures in a row after which a session is no longer opened by itself.
const TRIES: u32 = 8;

/// The pause before try `n` (from 0): a second, doubling to a minute.
fn pause(n: u32) -> Duration {
    Duration::from_millis((1_000u64 << n.min(6)).min(60_000))
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
        self.retry_open(myself, id);
    }

    fn retry_open(&mut self, myself: &ActorRef<RegistryMsg>, id: SessionId) {
        let now = crate::clock::instant();
        self.reopening
            .retain(|_, (_, at)| now.duration_since(*at) <= FORGIVEN_AFTER);
        let (n, at) = self.reopening.entry(id).or_insert((0, now));
        if *n >= TRIES {
            tracing::error!(session = %id, failures = *n, "the session keeps failing; it is not opened again until a client opens it");
            self.reopening.remove(&id);
            return;
        }
        let wait = pause(*n);
        (*n, *at) = (n.saturating_add(1), now);
        myself.send_after(wait, move || RegistryMsg::Reopen(id));
    }

    /// Opens the failed session and lets it look for work.
    pub(super) async fn reopen(&mut self, myself: &ActorRef<RegistryMsg>, id: SessionId) {
        match self.open(myself, id).await {
            Ok(slot) => {
                let _ = slot.send(SessionMsg::Kick);
            }
            Err(e @ (SessionError::Store(_) | SessionError::TooManySessions(_))) => {
                tracing::warn!(session = %id, error = %e, "cannot open the failed session yet; it is tried again");
                self.retry_open(myself, id);
            }
            // Deleted, or another node serves it.
            Err(e) => {
                tracing::debug!(session = %id, error = %e, "the failed session is not opened again");
                self.reopening.remove(&id);
            }
        }
    }
}
