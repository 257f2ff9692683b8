//! The delivery worker: posts final turn texts to their webhooks, durably,
//! with retries and exponential backoff. A delivery survives restarts (it
//! is in the store until sent or given up).
//!
//! Every request goes through the egress policy of `[delivery]
//! allowed_hosts`: the URL is checked, the name resolved and each address
//! checked (loopback, private and link-local ones only when listed), the
//! connection made to exactly those addresses, and redirects are never
//! followed. Deliveries run concurrently, a few per host at a time, so one
//! slow host delays no other. URLs are logged without credentials or query.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tiller_session::{Delivery, Sessions};
use tiller_tools::egress::{Policy, redact_origin};
use tokio::sync::{Notify, Semaphore, watch};

/// Attempts before a delivery is given up.
pub const MAX_ATTEMPTS: u32 = 8;
/// Deliveries to one host at once.
const PER_HOST: usize = 4;
/// Deliveries at once in all.
const IN_FLIGHT: usize = 64;
/// Bound on one attempt (connect, send, answer).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

fn now_ms() -> i64 {
    tiller_session::clock::unix_ms()
}

/// The wait before attempt `n` (1-based): 1 s, 2 s, 4 s ... at most 5 min.
pub fn backoff(attempt: u32) -> Duration {
    tiller_core::backoff::doubling(attempt.saturating_sub(1), Duration::from_secs(300))
}

/// What the worker's attempts share.
struct Worker {
    sessions: Sessions,
    policy: Policy,
    client: reqwest::Client,
    /// Deliveries being attempted (so a due row is not taken twice).
    busy: Mutex<HashSet<i64>>,
    /// One bound per destination host.
    hosts: Mutex<HashMap<String, Arc<Semaphore>>>,
    all: Arc<Semaphore>,
    /// Wakes the loop when an attempt ends (a retry may be due sooner).
    wake: Arc<Notify>,
}

/// Runs until `stop` turns true; attempts under way then get a moment to
/// finish (an unfinished one is retried at the next start).
pub async fn run(
    sessions: Sessions,
    policy: Policy,
    wake: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) {
    let worker = Arc::new(Worker {
        sessions,
        client: policy.client(ATTEMPT_TIMEOUT),
        policy,
        busy: Mutex::new(HashSet::new()),
        hosts: Mutex::new(HashMap::new()),
        all: Arc::new(Semaphore::new(IN_FLIGHT)),
        wake: wake.clone(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        match worker.sessions.deliveries_due(now_ms()).await {
            Ok(due) => {
                for d in due {
                    if !worker.busy.lock().expect("poisoned").insert(d.id) {
                        continue; // under way
                    }
                    let w = worker.clone();
                    tasks.spawn(async move {
                        let id = d.id;
                        w.attempt(d).await;
                        w.busy.lock().expect("poisoned").remove(&id);
                        w.wake.notify_one();
                    });
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot read deliveries"),
        }
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => break,
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
}

impl Worker {
    fn host_bound(&self, url: &str) -> Arc<Semaphore> {
        let key = url::Url::parse(url)
            .ok()
            .map(|u| {
                format!(
                    "{}:{}",
                    u.host_str().unwrap_or(""),
                    u.port_or_known_default().unwrap_or(0)
                )
            })
            .unwrap_or_default();
        self.hosts
            .lock()
            .expect("poisoned")
            .entry(key)
            .or_insert_with(|| Arc::new(Semaphore::new(PER_HOST)))
            .clone()
    }

    async fn attempt(&self, d: Delivery) {
        let host = self.host_bound(&d.url);
        let (Ok(_host), Ok(_all)) = (host.acquire().await, self.all.acquire().await) else {
            return;
        };
        // It may have waited past its hold (behind a slow host's attempts)
        // and another node taken it: then that node posts it, not this one.
        match self.sessions.delivery_start(&d, now_ms()).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a delivery attempt; it is tried again");
                return;
            }
        }
        // Not the path: some webhooks' is their credential.
        let shown = redact_origin(&d.url);
        let (stop_reason, error_kind) = d.told();
        let mut body = json!({
            "sessionId": d.session.to_string(),
            "promptId": d.prompt.to_string(),
            "stopReason": stop_reason,
            "text": d.text,
        });
        if let Some(kind) = error_kind {
            body["errorKind"] = json!(kind);
        }
        let ok = match self.send(&d.url, &body).await {
            Ok(status) if status.is_success() => true,
            Ok(status) => {
                tracing::warn!(url = %shown, %status, "webhook refused a delivery (redirects are not followed)");
                false
            }
            Err(e) => {
                // The policy's errors name the URL with its path.
                let e = e.replace(&tiller_tools::egress::redact(&d.url), &shown);
                tracing::warn!(url = %shown, error = %e, "webhook delivery failed");
                false
            }
        };
        let attempts = d.attempts + 1;
        let next = if ok {
            metrics::counter!("tiller_deliveries_total", "outcome" => "delivered").increment(1);
            None
        } else if attempts >= MAX_ATTEMPTS {
            metrics::counter!("tiller_deliveries_total", "outcome" => "given_up").increment(1);
            tracing::error!(url = %shown, attempts, "giving up a delivery");
            None
        } else {
            metrics::counter!("tiller_deliveries_total", "outcome" => "retried").increment(1);
            Some((now_ms() + backoff(attempts).as_millis() as i64, attempts))
        };
        if let Err(e) = self.sessions.delivery_done(d.id, next).await {
            tracing::error!(error = %e, "cannot record a delivery attempt");
        }
    }

    /// One request, under the policy. Errors never carry the URL's
    /// credentials.
    async fn send(
        &self,
        url: &str,
        body: &serde_json::Value,
    ) -> Result<reqwest::StatusCode, String> {
        let url = self.policy.check(url)?;
        let res = self
            .client
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(|e| describe(&e))?;
        Ok(res.status())
    }
}

/// A request error's cause, without the URL (reqwest's Display includes
/// it, credentials and all).
fn describe(e: &reqwest::Error) -> String {
    let mut cause = String::new();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        cause = s.to_string();
        source = s.source();
    }
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    if cause.is_empty() {
        what.to_owned()
    } else {
        format!("{what}: {cause}")
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
