//! Pauses between tries of something that failed: a second, doubling.

use std::time::Duration;

/// The pause before try `n` after the first (0: one second), doubling,
/// never more than `max`.
pub fn doubling(n: u32, max: Duration) -> Duration {
    Duration::from_secs(1u64 << n.min(30)).min(max)
}

/// How many tries in a row failed, per key (a session), and the pause
/// before each one's next try: [`doubling`] from a second to a minute.
#[derive(Debug)]
pub struct Failures<K> {
    counts: std::collections::HashMap<K, u32>,
}

impl<K> Default for Failures<K> {
    fn default() -> Self {
        Failures {
            counts: std::collections::HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq> Failures<K> {
    /// One more failure for `key`: the pause before its next try.
    pub fn failed(&mut self, key: K) -> Duration {
        let n = self.counts.entry(key).or_insert(0);
        let pause = doubling(*n, Duration::from_secs(60));
        *n = n.saturating_add(1);
        pause
    }

    /// `key`'s try worked: its failures are forgotten.
    pub fn succeeded(&mut self, key: &K) {
        self.counts.remove(key);
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
    fn failures_pause_doubling_per_key_until_one_works() {
        let mut f = Failures::default();
        let pauses: Vec<u64> = (0..8).map(|_| f.failed("a").as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(f.failed("b").as_secs(), 1, "per key");
        f.succeeded(&"a");
        assert_eq!(f.failed("a").as_secs(), 1, "forgotten once it worked");
        assert_eq!(f.failed("b").as_secs(), 2);
    }
}
