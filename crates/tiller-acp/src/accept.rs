//! What an accept loop does when `accept` fails: back off instead of
//! spinning (EMFILE, ENFILE and ENOMEM persist until connections close),
//! and log at most once per interval, with the number of failures since.

use std::time::{Duration, Instant};

/// One accept loop's failure state.
#[derive(Debug)]
pub struct Backoff {
    /// Which listener, for the log.
    listener: &'static str,
    /// The next wait; doubles per consecutive failure.
    delay: Duration,
    /// When the last line was logged.
    logged: Option<Instant>,
    /// Failures not yet logged.
    unlogged: u64,
}

/// First wait after a failure.
const FIRST: Duration = Duration::from_millis(5);
/// Longest wait between attempts.
const MAX: Duration = Duration::from_secs(1);
/// At most one log line per this interval.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Backoff {
    pub fn new(listener: &'static str) -> Self {
        Self {
            listener,
            delay: FIRST,
            logged: None,
            unlogged: 0,
        }
    }

    /// A connection was accepted: the next failure starts over.
    pub fn reset(&mut self) {
        self.delay = FIRST;
    }

    /// Records a failure and returns how long to wait before accepting again.
    pub fn failed(&mut self, error: &std::io::Error) -> Duration {
        self.failed_at(error, Instant::now())
    }

    fn failed_at(&mut self, error: &std::io::Error, now: Instant) -> Duration {
        self.unlogged += 1;
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= LOG_EVERY)
        {
            tracing::warn!(
                listener = self.listener,
                error = %error,
                failures = self.unlogged,
                "accept failed; backing off (too many open files? raise LimitNOFILE or limits)"
            );
            self.logged = Some(now);
            self.unlogged = 0;
        }
        metrics::counter!("tiller_accept_errors_total", "listener" => self.listener).increment(1);
        let wait = self.delay;
        self.delay = (self.delay * 2).min(MAX);
        wait
    }

    /// Failures since the last log line (for tests).
    #[cfg(test)]
    fn pending(&self) -> u64 {
        self.unlogged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_a_second_and_logs_are_rate_limited() {
        let mut b = Backoff::new("test");
        let e = std::io::Error::from_raw_os_error(24);
        let t0 = Instant::now();
        let waits: Vec<u64> = (0..10)
            .map(|i| b.failed_at(&e, t0 + Duration::from_millis(i)).as_millis() as u64)
            .collect();
        assert_eq!(waits, vec![5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        // The first failure logged; nine are waiting for the next line.
        assert_eq!(b.pending(), 9);
        b.failed_at(&e, t0 + LOG_EVERY);
        assert_eq!(b.pending(), 0);
        b.reset();
        assert_eq!(b.failed_at(&e, t0 + LOG_EVERY).as_millis(), 5);
    }
}
