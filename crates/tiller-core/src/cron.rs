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

/// When a job whose due fire could not be stored is tried again: after a
/// pause that doubles from a second to a minute (a store that is down
/// would otherwise be asked again at once, in a loop).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retry {
    /// Not before this (Unix ms).
    pub at_ms: i64,
    failures: u32,
}

impl Retry {
    /// The next try after one more failure at `now`.
    pub fn failed(self, now: i64) -> Retry {
        let failures = self.failures.saturating_add(1);
        let pause = crate::backoff::doubling(failures - 1, std::time::Duration::from_secs(60));
        Retry {
            at_ms: now + pause.as_millis() as i64,
            failures,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    /// 2026-11-30T00:00:00Z
    const T0: i64 = 1_796_083_200_000;

    #[test]
    fn a_failed_fire_is_tried_again_after_a_pause_that_doubles_to_a_minute() {
        let mut r = Retry::default();
        let mut pauses = Vec::new();
        for _ in 0..9 {
            r = r.failed(T0);
            pauses.push(r.at_ms - T0);
        }
        assert_eq!(
            pauses,
            [
                1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
    }

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

/// A cron fire waiting for its session to be idle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// Queue position, unique across sessions (the store's row id).
    pub id: i64,
    /// The job that fired.
    pub job_id: String,
    /// The prompt it runs.
    pub prompt: String,
    /// When it (last) fired, ms since the epoch.
    pub fired_ms: i64,
}

/// A change to the waiting fires, to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FireChange {
    /// A new waiting fire.
    Insert {
        /// The session it prompts.
        session: crate::SessionId,
        /// The fire.
        fire: Waiting,
    },
    /// A fire of a job that already had one waiting: that one is kept in
    /// its place and refreshed (fires coalesce per job). The whole fire: a
    /// store shared by several nodes may no longer hold it (another node
    /// ran it meanwhile), and then it waits again.
    Refresh {
        /// The session it prompts.
        session: crate::SessionId,
        /// The waiting fire, with the job's prompt now and the newer time.
        fire: Waiting,
    },
}

/// The waiting fires of every session: at most one per job, FIFO per
/// session. The cron actor keeps them in memory, rebuilt from the store at
/// start; reading the next one never removes it (the session's stored start
/// consumes it, [`Fires::consumed`]).
#[derive(Clone, Debug, Default)]
pub struct Fires {
    by_session: std::collections::BTreeMap<crate::SessionId, Vec<Waiting>>,
    next_id: i64,
}

impl Fires {
    /// Fires rebuilt from stored rows (ids give the order).
    pub fn restore(rows: impl IntoIterator<Item = (crate::SessionId, Waiting)>) -> Self {
        let mut f = Fires {
            by_session: Default::default(),
            next_id: 1,
        };
        let mut rows: Vec<_> = rows.into_iter().collect();
        rows.sort_by_key(|(_, w)| w.id);
        for (session, w) in rows {
            f.next_id = f.next_id.max(w.id + 1);
            f.by_session.entry(session).or_default().push(w);
        }
        f
    }

    /// The next new fire's id is at least `from` (see
    /// [`crate::notify::Queues::reserve_ids`]).
    pub fn reserve_ids(&mut self, from: i64) {
        self.next_id = self.next_id.max(from);
    }

    /// Job `job_id` of `session` fired at `now`.
    pub fn fire(
        &mut self,
        session: crate::SessionId,
        job_id: &str,
        prompt: &str,
        now: i64,
    ) -> FireChange {
        let waiting = self.by_session.entry(session).or_default();
        if let Some(w) = waiting.iter_mut().find(|w| w.job_id == job_id) {
            w.prompt = prompt.to_owned();
            w.fired_ms = now;
            return FireChange::Refresh {
                session,
                fire: w.clone(),
            };
        }
        let fire = Waiting {
            id: self.next_id,
            job_id: job_id.to_owned(),
            prompt: prompt.to_owned(),
            fired_ms: now,
        };
        self.next_id += 1;
        waiting.push(fire.clone());
        FireChange::Insert { session, fire }
    }

    /// The sessions with a waiting fire.
    pub fn sessions(&self) -> Vec<crate::SessionId> {
        self.by_session
            .iter()
            .filter(|(_, w)| !w.is_empty())
            .map(|(s, _)| *s)
            .collect()
    }

    /// The session's oldest waiting fire (it stays waiting).
    pub fn next(&self, session: crate::SessionId) -> Option<&Waiting> {
        self.by_session.get(&session)?.first()
    }

    /// A started prompt consumed fire `id`.
    pub fn consumed(&mut self, session: crate::SessionId, id: i64) {
        if let Some(w) = self.by_session.get_mut(&session) {
            w.retain(|f| f.id != id);
            if w.is_empty() {
                self.by_session.remove(&session);
            }
        }
    }

    /// A job was removed: its waiting fire goes too.
    pub fn remove_job(&mut self, job_id: &str) {
        self.by_session.retain(|_, w| {
            w.retain(|f| f.job_id != job_id);
            !w.is_empty()
        });
    }

    /// Puts a session's fires back as they were (a store write failed).
    pub fn put_back(&mut self, session: crate::SessionId, fires: Option<Vec<Waiting>>) {
        match fires {
            Some(f) => self.by_session.insert(session, f),
            None => self.by_session.remove(&session),
        };
    }

    /// One session's waiting fires, oldest first.
    pub fn session(&self, session: crate::SessionId) -> Option<Vec<Waiting>> {
        self.by_session.get(&session).cloned()
    }
}

#[cfg(test)]
mod fires_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::SessionId;

    proptest! {
        /// At most one waiting fire per job, FIFO by first fire, a refresh
        /// keeps the place; replaying the changes on rows rebuilds the same.
        #[test]
        fn fires_coalesce_per_job_and_restore_from_their_changes(
            ops in proptest::collection::vec((0u8..2, 0u8..4, any::<bool>()), 0..50)
        ) {
            let sid = |s: u8| SessionId::from_u128(u128::from(s) + 1);
            let mut f = Fires::restore([]);
            let mut rows: std::collections::BTreeMap<i64, (SessionId, Waiting)> = Default::default();
            for (n, (s, job, consume)) in ops.into_iter().enumerate() {
                if consume {
                    if let Some(w) = f.next(sid(s)).cloned() {
                        f.consumed(sid(s), w.id);
                        rows.remove(&w.id);
                    }
                    continue;
                }
                match f.fire(sid(s), &format!("j{job}"), "p", n as i64) {
                    FireChange::Insert { session, fire } => {
                        prop_assert!(rows.insert(fire.id, (session, fire)).is_none());
                    }
                    FireChange::Refresh { session, fire } => {
                        let r = rows.get_mut(&fire.id).expect("stored");
                        prop_assert_eq!(r.0, session);
                        prop_assert_eq!(&r.1.job_id, &fire.job_id);
                        r.1 = fire;
                    }
                }
                for s in 0..2 {
                    let w = f.session(sid(s)).unwrap_or_default();
                    let mut jobs: Vec<_> = w.iter().map(|w| w.job_id.clone()).collect();
                    let ids: Vec<_> = w.iter().map(|w| w.id).collect();
                    prop_assert!(ids.windows(2).all(|p| p[0] < p[1]), "FIFO");
                    jobs.sort();
                    jobs.dedup();
                    prop_assert_eq!(jobs.len(), w.len(), "one per job");
                }
                let restored = Fires::restore(rows.values().cloned());
                for s in 0..2 {
                    prop_assert_eq!(restored.session(sid(s)), f.session(sid(s)));
                }
            }
        }
    }
}
