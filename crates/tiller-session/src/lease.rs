//! A node's leases on its sessions when the store is shared (see
//! `Registry::take`): renewing them, noticing the ones another node took,
//! and adopting sessions whose node went away.

use super::*;

impl Sessions {
    /// Renews this node's leases every `renew_every` (stopping the
    /// sessions another node took over) and, on a task of its own so a
    /// slow takeover never delays a renewal, adopts orphaned sessions and
    /// follows the queues, until shutdown.
    ///
    /// A lease holds for `lease_ttl` from its last renewal: when no
    /// renewal got through in time (the store out of reach, or too slow),
    /// every session here stops before its lease can lapse, so no session
    /// runs on two nodes (fencing guards the store; this guards what a
    /// turn does beside it). Their leases are let go before the next
    /// renewal, which would otherwise keep them from every other node.
    pub(crate) async fn keep_leases(self) {
        let Some(c) = self.cluster.clone() else {
            return;
        };
        let ttl = c.lease_ttl.as_millis() as i64;
        // Stopped a fifth of the lease's life before it could lapse.
        let safe = c.lease_ttl - c.lease_ttl / 5;
        let mut valid_until = clock::instant() + safe;
        let mut to_release: Vec<SessionId> = Vec::new();
        let tend = {
            let this = self.clone();
            let every = c.renew_every;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    this.adopt_orphans().await;
                    this.follow_queues().await;
                }
            })
        };
        loop {
            // The next renewal, or the moment the leases may no longer
            // hold, whichever comes first.
            let wake = (clock::instant() + c.renew_every).min(valid_until);
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.stop_leases.notified() => {
                    tend.abort();
                    return;
                }
            }
            if !to_release.is_empty() {
                let only = Some(to_release.clone());
                let release = self.store.release_leases(c.node.clone(), only, false);
                let by = (clock::instant() + c.renew_every).min(valid_until);
                match tokio::time::timeout_at(by, release).await {
                    Ok(Ok(())) => {
                        let released = std::mem::take(&mut to_release);
                        let _ = (self.registry).send_message(RegistryMsg::LeasesReleased(released));
                    }
                    // Tried again next round; the renewal goes on meanwhile
                    // (these sessions stay stopped here until let go).
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "cannot let go of the stopped sessions' leases yet");
                    }
                    Err(_) => {
                        tracing::warn!("letting go of the stopped sessions' leases took too long");
                    }
                }
            }
            let sent = clock::instant();
            let renewal = self.store.renew_leases(c.node.clone(), ttl);
            match tokio::time::timeout_at(valid_until, renewal).await {
                Ok(Ok(lost)) => {
                    valid_until = sent + safe;
                    if !lost.is_empty() {
                        metrics::counter!("tiller_leases_lost_total").increment(lost.len() as u64);
                        let _ = self.registry.send_message(RegistryMsg::LeasesLost(lost));
                    }
                    continue;
                }
                Ok(Err(e)) => {
                    metrics::counter!("tiller_lease_renewal_failures_total").increment(1);
                    tracing::warn!(error = %e, "cannot renew this node's leases");
                    if clock::instant() < valid_until {
                        continue;
                    }
                }
                Err(_) => {
                    metrics::counter!("tiller_lease_renewal_failures_total").increment(1);
                    tracing::warn!("this node's leases were not renewed in time");
                }
            }
            // Out of time: every session here stops. (The registry handles
            // it after the message it is on, which may itself wait for the
            // store: an open of a session, bounded by the connection's own
            // timeouts.)
            let (tx, rx) = oneshot::channel();
            if self
                .registry
                .send_message(RegistryMsg::LeasesExpiring(tx))
                .is_ok()
                && let Ok(stopped) = rx.await
            {
                to_release.extend(stopped);
            }
            // Sessions opened from now on hold fresh leases.
            valid_until = clock::instant() + safe;
        }
    }

    /// The queue actors read what other nodes queued or fired (for
    /// sessions this node serves, a notification posted elsewhere before
    /// it took them, a cron fire another node recorded); the sessions
    /// served here with work waiting poll for it.
    async fn follow_queues(&self) {
        let mut waiting = Vec::new();
        let (tx, rx) = oneshot::channel();
        if self
            .notify
            .send_message(notify::NotifyMsg::Reload(tx))
            .is_ok()
            && let Ok(s) = rx.await
        {
            waiting.extend(s);
        }
        let (tx, rx) = oneshot::channel();
        if self.cron.send_message(cron::CronMsg::Reload(tx)).is_ok()
            && let Ok(s) = rx.await
        {
            waiting.extend(s);
        }
        if !waiting.is_empty() {
            let _ = self.registry.send_message(RegistryMsg::Kick(waiting));
        }
    }

    /// Takes over sessions with work in flight or queued whose owner is
    /// gone (its lease expired): their prompts in flight settle
    /// (`node_lost`) and their queued work runs here.
    pub(crate) async fn adopt_orphans(&self) {
        let Some(c) = &self.cluster else { return };
        let orphans = match self.store.orphans(c.node.clone(), 64).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for sessions without an owner");
                return;
            }
        };
        for id in orphans {
            match self.open(id).await {
                Ok(h) => {
                    tracing::info!(session = %id, "took over a session whose node went away");
                    let _ = h.send(SessionMsg::Kick);
                }
                // Another node was faster, or it was just deleted.
                Err(e) => {
                    tracing::debug!(session = %id, error = %e, "did not take over the session");
                }
            }
        }
    }
}
