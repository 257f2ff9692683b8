//! The delivery worker: posts final turn texts to their webhooks, durably,
//! with retries and exponential backoff. A delivery survives restarts (it
//! is in the store until sent or given up).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tiller_store::{Delivery, Store};
use tokio::sync::{Notify, watch};

/// Attempts before a delivery is given up.
pub const MAX_ATTEMPTS: u32 = 8;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The wait before attempt `n` (1-based): 1 s, 2 s, 4 s ... at most 5 min.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_secs((1u64 << attempt.saturating_sub(1).min(9)).min(300))
}

/// Runs until `stop` turns true.
pub async fn run(store: Store, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client");
    loop {
        match store.deliveries_due(now_ms()).await {
            Ok(due) => {
                for d in due {
                    attempt(&store, &client, d).await;
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot read deliveries"),
        }
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn attempt(store: &Store, client: &reqwest::Client, d: Delivery) {
    let body = json!({
        "sessionId": d.session.to_string(),
        "promptId": d.prompt.to_string(),
        "stopReason": d.stop_reason,
        "text": d.text,
    });
    let ok = match client.post(&d.url).json(&body).send().await {
        Ok(res) if res.status().is_success() => true,
        Ok(res) => {
            tracing::warn!(url = %d.url, status = %res.status(), "webhook refused a delivery");
            false
        }
        Err(e) => {
            tracing::warn!(url = %d.url, error = %e, "webhook delivery failed");
            false
        }
    };
    let attempts = d.attempts + 1;
    let next = if ok {
        metrics::counter!("tiller_deliveries_total", "outcome" => "delivered").increment(1);
        None
    } else if attempts >= MAX_ATTEMPTS {
        metrics::counter!("tiller_deliveries_total", "outcome" => "given_up").increment(1);
        tracing::error!(url = %d.url, attempts, "giving up a delivery");
        None
    } else {
        Some((now_ms() + backoff(attempts).as_millis() as i64, attempts))
    };
    if let Err(e) = store.delivery_done(d.id, next).await {
        tracing::error!(error = %e, "cannot record a delivery attempt");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=12).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
    }
}
