//! The one place the session layer (and the edges above it) reads a clock.
//! Wall time stamps events and schedules (ordering is always `seq`);
//! monotonic time is tokio's, so tests can pause it. Cores never read
//! either: time is their input. The tidy test keeps clock reads here.

/// Wall-clock time, ms since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Monotonic now (tokio's clock).
pub fn instant() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
