//! Hooks for tests (feature `test-hooks`): orderings and failures a test
//! cannot bring about from outside.

use super::*;

impl Sessions {
    /// Tests only: asks every running session to park now, whatever it
    /// told the last sweep (it parks only if idle when the ask reaches it).
    pub fn idle_now(&self) {
        let _ = self.registry.send_message(RegistryMsg::IdleNow);
    }

    /// Tests only: stops every actor where it stands, as a killed process
    /// would (nothing settles), and waits until what the store was given is
    /// on disk.
    pub async fn crash(&self) {
        self.registry.stop_children(None);
        self.registry.stop(None);
        self.notify.stop(None);
        self.cron.stop(None);
        self.goal.stop(None);
        // Let the stop signals land before the last flush.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // What the store was given is on disk, and the database is free
        // for the next start, as after a killed process.
        self.store.close().await;
    }
}
