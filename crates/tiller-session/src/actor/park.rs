//! Parking: an idle session's actor stops and keeps only a record in the
//! registry (its clients, the slot its handles send through) until a
//! message wakes it; it then starts again from the store, as after a
//! restart. An actor costs about 10 KB; a parked session a few hundred
//! bytes.
//!
//! Two steps, so that nothing sent to it is lost or reordered: the actor
//! tells the registry it is idle (`Idle`); the registry makes the slot hold
//! what handles send from then on and asks it to park (`Park`); everything
//! sent before is in the mailbox ahead of `Park`. If it is still idle then,
//! it hands its clients to the registry (`Parked`), which stops it and
//! starts another at once if messages wait; otherwise it stays (`Stays`)
//! and the registry hands it what waited, in order.

use super::*;

impl SessionState {
    /// Nothing in flight here: the core's turns and queues (see
    /// [`tiller_core::SessionCore::parkable`]), events, the conversation
    /// and settings not yet stored, timers, permission requests; and
    /// nothing that lives only in this process (MCP servers, background
    /// commands). A hosted agent's session parks: its id and options are
    /// in the settings, and the agent's process belongs to the engine.
    pub(super) fn parkable(&self) -> bool {
        self.core.parkable()
            && self.running.is_none()
            && self.winding.is_none()
            && self.signals.is_empty()
            && self.unconfirmed.is_empty()
            && self.unsent == 0
            && !self.lingering
            && !self.flush_deferred
            && self.fanned == self.seq
            && self.wake.idle()
            && self.pending_permission.is_none()
            && self.cancel_at.is_none()
            && !self.closing
            && self.drained.is_empty()
            && self.failed.is_none()
            && self.conversation.is_saved()
            && !self.settings_unsaved
            && !self.toolbox.has_mcp()
            && !self.toolbox.has_jobs()
    }

    /// The registry's sweep.
    pub(super) fn park_if_idle(&self, myself: &ActorRef<SessionMsg>) {
        let Some(after) = self.config.park_after else {
            return;
        };
        if self.parkable() && self.input_at.elapsed() >= after {
            let _ = self.slot.registry.send_message(crate::RegistryMsg::Idle {
                id: self.id,
                actor: myself.get_id(),
            });
        }
    }

    /// The registry holds this session's messages back.
    pub(super) fn park(&mut self, myself: &ActorRef<SessionMsg>) {
        let actor = myself.get_id();
        let msg = if self.parkable() {
            crate::RegistryMsg::Parked {
                id: self.id,
                actor,
                subscribers: std::mem::take(&mut self.subscribers),
            }
        } else {
            crate::RegistryMsg::Stays { id: self.id, actor }
        };
        let _ = self.slot.registry.send_message(msg);
    }
}
