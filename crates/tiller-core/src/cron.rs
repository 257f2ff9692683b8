//! Cron timing: parsing schedules (with the `croner` crate) in a time zone,
//! the next fire after an instant, and the catch-up rule. Pure: time is an
//! input, in ms since the Unix epoch.
//!
//! Catch-up: when the daemon was down (or busy) past one or more scheduled
//! fires, they coalesce into one fire now; the next fire is the first
//! occurrence after now. A job never has more than one fire waiting.

use std::str::FromStr;

use croner::Cron;
use croner::parser::{CronParser, Seconds};
use jiff::Timestamp;
use jiff::tz::TimeZone;

/// A schedule that cannot be used. The message says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleError(pub String);

impl std::fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A parsed cron expression in a time zone.
#[derive(Clone, Debug)]
pub struct Schedule {
    cron: Cron,
    tz: TimeZone,
}

impl Schedule {
    /// Parses a cron expression (5 fields, or 6 with seconds first) and an
    /// IANA time zone name (`UTC`, `Europe/Berlin`).
    pub fn parse(expr: &str, tz: &str) -> Result<Schedule, ScheduleError> {
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(expr)
            .map_err(|e| ScheduleError(format!("invalid cron expression `{expr}`: {e}")))?;
        let tz = TimeZone::get(tz).map_err(|_| {
            ScheduleError(format!(
                "unknown time zone `{tz}` (use an IANA name like Europe/Berlin)"
            ))
        })?;
        // Reject expressions that never fire.
        let s = Schedule { cron, tz };
        if s.next_after(0).is_none() {
            return Err(ScheduleError(format!("`{expr}` never fires")));
        }
        Ok(s)
    }

    /// The first fire strictly after `ms`.
    pub fn next_after(&self, ms: i64) -> Option<i64> {
        let ts = Timestamp::from_millisecond(ms).ok()?;
        let zoned = ts.to_zoned(self.tz.clone());
        let next = self.cron.find_next_occurrence(&zoned, false).ok()?;
        Some(next.timestamp().as_millisecond())
    }
}

impl FromStr for Schedule {
    type Err = ScheduleError;

    /// `EXPR` in UTC.
    fn from_str(expr: &str) -> Result<Self, Self::Err> {
        Schedule::parse(expr, "UTC")
    }
}

/// What a job's timer should do at `now`: `Some(next)` when the job is due
/// (fire once, however many fires were missed, then wait for `next`), or
/// `None` when it is not due yet.
pub fn due(schedule: &Schedule, next_fire: i64, now: i64) -> Option<i64> {
    (next_fire <= now).then(|| schedule.next_after(now).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    /// 2026-11-30T00:00:00Z
    const T0: i64 = 1_796_083_200_000;

    #[test]
    fn parse_table() {
        for (expr, tz, ok) in [
            ("*/5 * * * *", "UTC", true),
            ("0 9 * * MON-FRI", "Europe/Berlin", true),
            ("*/2 * * * * *", "UTC", true),
            ("61 * * * *", "UTC", false),
            ("not cron", "UTC", false),
            ("* * * * *", "Mars/Olympus", false),
        ] {
            assert_eq!(Schedule::parse(expr, tz).is_ok(), ok, "{expr} {tz}");
        }
    }

    #[test]
    fn next_fire_respects_the_time_zone() {
        // 09:00 in Berlin is 08:00 UTC in winter.
        let s = Schedule::parse("0 9 * * *", "Europe/Berlin").unwrap();
        assert_eq!(s.next_after(T0), Some(T0 + 8 * 60 * MIN));
        let utc = Schedule::parse("0 9 * * *", "UTC").unwrap();
        assert_eq!(utc.next_after(T0), Some(T0 + 9 * 60 * MIN));
    }

    #[test]
    fn missed_fires_coalesce_into_one() {
        let s: Schedule = "*/5 * * * *".parse().unwrap();
        let next = T0 + 5 * MIN;
        assert_eq!(due(&s, next, T0 + MIN), None, "not due yet");
        // Down for an hour: one fire now, the next on the schedule after now.
        let now = T0 + 63 * MIN;
        assert_eq!(due(&s, next, now), Some(T0 + 65 * MIN));
    }
}
