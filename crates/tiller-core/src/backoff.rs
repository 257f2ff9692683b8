//! Pauses between tries of something that failed: a second, doubling.

use std::time::Duration;

/// The pause before try `n` after the first (0: one second), doubling,
/// never more than `max`.
pub fn doubling(n: u32, max: Duration) -> Duration {
    Duration::from_secs(1u64 << n.min(30)).min(max)
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
}
