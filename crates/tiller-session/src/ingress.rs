//! What the HTTP edge's ingress and delivery worker ask of the store
//! through the sessions: channel requests' replay guard, webhook
//! deliveries.

use crate::{Delivery, SessionError, Sessions};

impl Sessions {
    /// The durable replay guard of channel ingress: true when `key` was not
    /// seen within the last `window_s` seconds.
    pub async fn channel_seen(
        &self,
        key: String,
        now_s: i64,
        window_s: i64,
    ) -> Result<bool, SessionError> {
        Ok(self.store.channel_seen(key, now_s, window_s).await?)
    }

    /// Forgets a channel request key recorded at `seen_s` (see
    /// [`Sessions::channel_seen`]): its request was not admitted, so the
    /// sender's retry is no replay.
    pub async fn channel_unseen(&self, key: String, seen_s: i64) -> Result<(), SessionError> {
        Ok(self.store.channel_unseen(key, seen_s).await?)
    }

    /// Webhook deliveries due at `now_ms`, oldest first (for the worker
    /// that sends them).
    pub async fn deliveries_due(&self, now_ms: i64) -> Result<Vec<Delivery>, SessionError> {
        Ok(self.store.deliveries_due(now_ms).await?)
    }

    /// An attempt of `d` starts now: false when another node took it
    /// since it was due here (the attempt is not made).
    pub async fn delivery_start(&self, d: &Delivery, now_ms: i64) -> Result<bool, SessionError> {
        Ok(self.store.delivery_start(d, now_ms).await?)
    }

    /// A delivery was sent or given up (`retry = None`), or is retried at
    /// a time with a new attempt count.
    pub async fn delivery_done(
        &self,
        id: i64,
        retry: Option<(i64, u32)>,
    ) -> Result<(), SessionError> {
        Ok(self.store.delivery_done(id, retry).await?)
    }
}
