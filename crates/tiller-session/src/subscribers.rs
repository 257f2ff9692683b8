//! [`Subscribers`]: a session's attached clients, wherever they are held
//! (its actor, or the registry's record while it is parked), counted in
//! `tiller_subscribers_active` for exactly as long as they are held.

use std::sync::Arc;

use crate::{EventRecord, Subscriber, SubscriberId};

/// See the module docs. Every way a client leaves goes through here, so
/// the gauge cannot drift: detached, evicted, or dropped with its holder
/// (a session that stopped, failed or could not wake).
#[derive(Default)]
pub(crate) struct Subscribers(Vec<(SubscriberId, Box<dyn Subscriber>)>);

/// Clients just detached: dropped by their caller, outside any lock (a
/// client's drop may do anything).
pub(crate) type Detached = Vec<Box<dyn Subscriber>>;

fn gauge() -> metrics::Gauge {
    metrics::gauge!("tiller_subscribers_active")
}

impl Subscribers {
    pub(crate) fn attach(&mut self, id: SubscriberId, subscriber: Box<dyn Subscriber>) {
        self.0.push((id, subscriber));
        gauge().increment(1.0);
    }

    /// Detaches the client `id` (if attached).
    #[must_use = "drop the detached clients outside any lock"]
    pub(crate) fn detach(&mut self, id: SubscriberId) -> Detached {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|(s, _)| *s == id);
        self.0 = kept;
        if !gone.is_empty() {
            gauge().decrement(gone.len() as f64);
        }
        gone.into_iter().map(|(_, s)| s).collect()
    }

    /// Delivers an event to every client; those that cannot keep up are
    /// detached. The answer is how many were.
    pub(crate) fn deliver(&mut self, event: &Arc<EventRecord>) -> usize {
        let before = self.0.len();
        self.0.retain(|(_, s)| s.deliver(event));
        let evicted = before - self.0.len();
        if evicted > 0 {
            gauge().decrement(evicted as f64);
        }
        evicted
    }

    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = &dyn Subscriber> {
        self.0.iter().map(|(_, s)| &**s)
    }
}

impl Drop for Subscribers {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            gauge().decrement(self.0.len() as f64);
        }
    }
}
