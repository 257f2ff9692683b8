//! Sessions this node stops because their leases are lost, or may lapse
//! (see `Sessions::keep_leases`).

use super::*;

impl RegistryState {
    /// Stops a live session whose lease this node lost (or may have): its
    /// clients hear `node_lost`; what waited for it to park is answered.
    pub(super) fn lose(&mut self, id: SessionId) -> Vec<RegistryMsg> {
        let Some(live) = self.live.get(&id) else {
            return Vec::new();
        };
        let (slot, actor) = (live.slot.clone(), live.run.actor().cloned());
        let resumed = self.drop_live(id).into_iter().flatten().collect();
        // Marked before the stop, which its actor reads.
        *slot.lock() = SlotState::Taken;
        if let Some(actor) = actor {
            actor.stop(Some("lease lost".into()));
        }
        resumed
    }

    /// This node's leases may lapse: every live session it holds one for
    /// stops, and is not opened here again until its lease is let go (a
    /// newer lease of it would be let go with the old one); its prompts
    /// settle as its clients were told (`node_lost`). The answer is them.
    pub(super) fn expire_all(
        &mut self,
        reply: oneshot::Sender<Vec<SessionId>>,
    ) -> Vec<RegistryMsg> {
        let held: Vec<SessionId> = (self.live.keys())
            .filter(|id| self.fences.contains_key(id))
            .copied()
            .collect();
        let mut resumed = Vec::new();
        for &id in &held {
            tracing::warn!(session = %id, "this node's lease may lapse (the store is out of reach); the session stops here");
            resumed.extend(self.lose(id));
            self.expiring.insert(id);
            (self.unreconciled).insert(id, tiller_core::ErrorKind::NodeLost);
        }
        let _ = reply.send(held);
        resumed
    }
}
