//! Pauses between tries of something that failed: a second, doubling.

use std::time::Duration;

/// The pause before try `n` after the first (0: one second), doubling,
/// never more than `max`.
pub fn doubling(n: u32, max: Duration) -> Duration {
    Duration::from_secs(1u64 << n.min(30)).min(max)
}

/// How many tries in a row failed, per key (a session), and whether a
/// try is armed: each key's next try waits a pause [`doubling`] from a
/// second to a minute, and a key has at most one armed at a time (a
/// failure while one is armed arms nothing: retries never pile up, however
/// many other paths fail meanwhile). Bounded: past [`Failures::MAX`] keys
/// the counts are forgotten (their next pauses start again at a second).
#[derive(Debug)]
pub struct Failures<K> {
    counts: std::collections::HashMap<K, u32>,
    armed: std::collections::HashSet<K>,
}

impl<K> Default for Failures<K> {
    fn default() -> Self {
        Failures {
            counts: std::collections::HashMap::new(),
            armed: std::collections::HashSet::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> Failures<K> {
    /// Most keys counted.
    pub const MAX: usize = 10_000;

    /// One more failure for `key`: the pause before its next try, to be
    /// armed; `None` when one is armed already.
    pub fn failed(&mut self, key: K) -> Option<Duration> {
        if self.armed.contains(&key) {
            return None;
        }
        if self.counts.len() >= Self::MAX && !self.counts.contains_key(&key) {
            // Only those with no try armed (those are bounded by the
            // timers in flight): a long outage of many keys keeps
            // doubling.
            let armed = &self.armed;
            self.counts.retain(|k, _| armed.contains(k));
        }
        let n = self.counts.entry(key.clone()).or_insert(0);
        let pause = doubling(*n, Duration::from_secs(60));
        *n = n.saturating_add(1);
        self.armed.insert(key);
        Some(pause)
    }

    /// `key`'s armed try is due (it is no longer armed).
    pub fn due(&mut self, key: &K) {
        self.armed.remove(key);
    }

    /// `key`'s try worked: its failures are forgotten.
    pub fn succeeded(&mut self, key: &K) {
        self.counts.remove(key);
    }

    /// `key` is gone (a deleted session): everything about it forgotten.
    pub fn forget(&mut self, key: &K) {
        self.counts.remove(key);
        self.armed.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_doubling_to_the_bound() {
        let minute = Duration::from_secs(60);
        let pauses: Vec<u64> = (0..9).map(|n| doubling(n, minute).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(doubling(u32::MAX, minute), minute);
    }

    #[test]
    fn failures_pause_doubling_per_key_one_armed_at_a_time() {
        let mut f = Failures::default();
        let mut pauses = Vec::new();
        for _ in 0..8 {
            pauses.push(f.failed("a").unwrap().as_secs());
            assert_eq!(f.failed("a"), None, "one armed at a time");
            f.due(&"a");
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(f.failed("b").map(|p| p.as_secs()), Some(1), "per key");
        f.due(&"b");
        f.succeeded(&"a");
        assert_eq!(
            f.failed("a").map(|p| p.as_secs()),
            Some(1),
            "forgotten once it worked"
        );
        f.forget(&"a");
        assert_eq!(
            f.failed("a").map(|p| p.as_secs()),
            Some(1),
            "forgotten when gone"
        );
        assert_eq!(f.failed("b").map(|p| p.as_secs()), Some(2));
        let mut f = Failures::default();
        for k in 0..Failures::<usize>::MAX {
            f.failed(k);
            f.due(&k);
        }
        f.failed(0); // armed: kept past the bound
        f.failed(Failures::<usize>::MAX);
        assert_eq!(f.counts.len(), 2, "bounded: only the armed ones kept");
        f.due(&0);
        assert_eq!(
            f.failed(0).map(|p| p.as_secs()),
            Some(4),
            "an armed key keeps doubling"
        );
    }
}
