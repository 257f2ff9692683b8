//! SQLite's index of the log, written behind the log.
//!
//! The log's rows (segments, see [`crate::segment`]) go to the end of the
//! `log` table, in the order they are committed: a commit writes a few
//! pages, one after the other. What finds a session's segments is the
//! `log_index` table, keyed by `(session_id, first_seq)`, and each
//! session's entries sit on pages of their own: an index kept with every
//! commit cost a commit one page per session in it (a thousand sessions
//! streaming wrote about sixty pages per commit, most of them index
//! pages, and the checkpoints that copied them were most of the store
//! thread's time). So a commit writes only the log; the entries of its
//! segments wait here, in memory, and are written later, many of a
//! session's at once: the oldest sessions' in small transactions between
//! commits once [`PENDING`] entries wait (or the oldest is [`AGE`] rows
//! behind), at most [`WRITE`] at a time, and all of them at a clean
//! close.
//!
//! Writing the index is an optimisation, never what a read waits for: a
//! session's waiting entries are its newest segments (each session's
//! entries are written oldest first), and each names its row in `log`, so
//! a read takes what the index names and then the waiting segments by
//! row number ([`Tail::of`]); a head and a last activity time come from
//! the newest waiting entry. Reads and opening the store write nothing,
//! so on a full disk they still work.
//!
//! Nothing is lost when the process dies with entries waiting: the
//! segments are in the log, and the row `log_indexed.upto` says that
//! every segment numbered up to it is indexed. Opening the store takes
//! the segments after it that the index does not name back into the
//! waiting entries ([`Tail::open`]). Segment numbers are the writer's
//! ([`Tail::next_n`]), always above every number used before, so a
//! segment written later is never numbered at or below `upto`.

use std::collections::{BTreeSet, HashMap};

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::SessionId;

use crate::StoreError;

/// Entries waiting that make the oldest sessions' due.
pub(crate) const PENDING: usize = 8192;
/// Sessions whose entries one transaction of upkeep writes (one page
/// each, about). Each costs the commits queued meanwhile about 33 us:
/// 64 made an upkeep a stall of 2.1 ms at the median with 1,000 sessions
/// streaming at a model's pace, 8 several times shorter for about the
/// same leaf pages written in all (a session's entries wait for its turn
/// either way), at the cost of more, smaller transactions.
pub(crate) const SLICE: usize = 8;
/// Sessions one transaction of upkeep writes while more than twice
/// [`PENDING`] entries wait: as many as a commit carries (see
/// `Db::sessions_per_commit`), so with many thousands of sessions
/// streaming, a few entries each, the index keeps up with the log (at 8
/// it fell behind by about 8 segments per session streaming, past
/// [`AGE`] with several thousand).
pub(crate) const SLICE_BEHIND: usize = 64;
/// Most entries one transaction of upkeep writes (a few sessions
/// streaming fast may have thousands each): the stall it is for the
/// commits queued meanwhile stays short.
pub(crate) const WRITE: usize = 1024;
/// How far (in segments) the oldest waiting entry may fall behind the
/// newest: it bounds what opening the store reads back into the Tail
/// (unless a session is set aside: the mark stays below its entries
/// until it is deleted).
pub(crate) const AGE: i64 = 8 * PENDING as i64;

/// One segment's entry in the index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Entry {
    pub(crate) first_seq: u64,
    pub(crate) last_seq: u64,
    pub(crate) last_ts_ms: i64,
    pub(crate) max_turn: Option<u64>,
    pub(crate) kinds: i64,
    /// The segment's row in `log`.
    pub(crate) n: i64,
}

/// The columns of an index entry, in `log` and in `log_index` alike.
macro_rules! columns {
    () => {
        "session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n"
    };
}

/// The entries not yet written to `log_index`, each session's in order.
/// Reads merge them with the index (see the module's documentation).
#[derive(Default)]
pub(crate) struct Tail {
    pending: foldhash::HashMap<SessionId, Vec<Entry>>,
    /// Each waiting session's first waiting segment number: the oldest
    /// first.
    firsts: BTreeSet<(i64, SessionId)>,
    count: usize,
    /// Sessions whose log is damaged, with what is wrong: two of their
    /// segments claim the same events (the index refused an entry, or
    /// opening found the clash). Upkeep passes them over, so the others
    /// still drain; their entries keep waiting (so deleting the session,
    /// the repair, finds every row), and reads of their log are refused
    /// rather than showing events twice.
    set_aside: HashMap<SessionId, String>,
    /// The number the next segment takes.
    pub(crate) next_n: i64,
    /// Most entries one [`Tail::write_oldest`] writes ([`WRITE`]).
    pub(crate) write_cap: usize,
}

impl Tail {
    /// Takes up what a previous run left unindexed: the segments after
    /// the mark that the index does not name wait again, as they did
    /// before the process stopped. Opening writes nothing (a store on a
    /// full disk still opens, and reads). A session two of whose
    /// segments claim the same events (a key the index gives to another
    /// segment, a waiting segment overlapping the one before it or the
    /// newest one the index names) is set aside, and
    /// the others open as usual; a segment naming no session (which no
    /// read can reach) is left where it is. A session set aside is logged
    /// and counted (`tiller_store_damaged_sessions`); a nameless segment
    /// is logged (once: the mark then passes it). `tiller doctor` names
    /// both.
    pub(crate) fn open(conn: &Connection) -> rusqlite::Result<Tail> {
        let upto: i64 = conn.query_row("SELECT upto FROM log_indexed", [], |r| r.get(0))?;
        let max: i64 = conn.query_row("SELECT COALESCE(MAX(n), 0) FROM log", [], |r| r.get(0))?;
        let mut tail = Tail {
            next_n: max.max(upto) + 1,
            write_cap: WRITE,
            ..Tail::default()
        };
        let mut stmt = conn.prepare(
            "SELECT l.session_id, l.first_seq, l.last_seq, l.last_ts_ms, l.max_turn, l.kinds,
                    l.n, i.n
             FROM log l LEFT JOIN log_index i
                 ON i.session_id = l.session_id AND i.first_seq = l.first_seq
             WHERE l.n > ?1 ORDER BY l.n",
        )?;
        let mut rows = stmt.query(params![upto])?;
        while let Some(r) = rows.next()? {
            let id: String = r.get(0)?;
            let e = Entry {
                first_seq: r.get::<_, i64>(1)? as u64,
                last_seq: r.get::<_, i64>(2)? as u64,
                last_ts_ms: r.get(3)?,
                max_turn: r.get::<_, Option<i64>>(4)?.map(|t| t as u64),
                kinds: r.get(5)?,
                n: r.get(6)?,
            };
            let Some(session) = SessionId::parse(&id) else {
                tracing::error!(segment = e.n, session_id = %id.escape_debug(), "the log's segment names no session; no read reaches it, and it is left where it is (`tiller doctor` lists it)");
                continue;
            };
            let claimed = match (r.get::<_, Option<i64>>(7)?, tail.of(session).last()) {
                (Some(n), _) if n == e.n => continue,
                (Some(n), _) => Some(n),
                (None, Some(prev)) if e.first_seq <= prev.last_seq => Some(prev.n),
                (None, _) => None,
            };
            tail.add(session, vec![e]);
            if let Some(other) = claimed {
                tail.set_aside(session, clash(other, e.n, e.first_seq));
            }
        }
        // A session's first waiting segment follows what its index names.
        let mut newest = conn.prepare(
            "SELECT n, last_seq FROM log_index WHERE session_id = ?1 AND first_seq < ?2
             ORDER BY first_seq DESC LIMIT 1",
        )?;
        let firsts: Vec<(SessionId, Entry)> = tail
            .pending
            .iter()
            .filter(|(s, _)| !tail.set_aside.contains_key(s))
            .map(|(s, e)| (*s, e[0]))
            .collect();
        for (session, first) in firsts {
            let before = newest
                .query_row(params![session.to_string(), first.first_seq as i64], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)? as u64))
                })
                .optional()?;
            if let Some((n, _)) = before.filter(|(_, last)| *last >= first.first_seq) {
                tail.set_aside(session, clash(n, first.n, first.first_seq));
            }
        }
        Ok(tail)
    }

    /// Sets a damaged session aside (see the field of that name), logged
    /// and counted; the first reason found is kept.
    fn set_aside(&mut self, session: SessionId, why: String) {
        if self.set_aside.contains_key(&session) {
            return;
        }
        tracing::error!(%session, problem = %why, "a session's log is damaged: its reads are refused and its index entries stay unwritten until it is deleted (`DELETE /api/sessions/<id>?purge=true`); the other sessions are unaffected");
        self.set_aside.insert(session, why);
        metrics::gauge!("tiller_store_damaged_sessions").set(self.set_aside.len() as f64);
    }

    /// A session's waiting entries, for a read of its log; refused when
    /// the session is set aside (its log is damaged).
    pub(crate) fn readable(&self, session: SessionId) -> Result<&[Entry], StoreError> {
        match self.set_aside.get(&session) {
            None => Ok(self.of(session)),
            Some(why) => Err(StoreError::Damaged {
                session,
                why: why.clone(),
            }),
        }
    }

    /// Why a session's appends are refused: it is set aside (its reads
    /// are refused the same way), so its log does not grow while it cannot
    /// be read. Quick when no session is.
    pub(crate) fn refusal(&self, session: SessionId) -> Option<StoreError> {
        if self.set_aside.is_empty() {
            return None;
        }
        self.readable(session).err()
    }

    /// Whether any session is set aside.
    pub(crate) fn refuses_any(&self) -> bool {
        !self.set_aside.is_empty()
    }

    /// Sets a session aside as a damaged log would (a test's way to reach
    /// a live session whose log upkeep finds damaged).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_aside_for_test(&mut self, session: SessionId, why: &str) {
        self.set_aside(session, why.to_owned());
    }

    /// Takes a committed batch's entries (each session's in order).
    pub(crate) fn add(&mut self, session: SessionId, entries: Vec<Entry>) {
        let Some(first) = entries.first() else {
            return;
        };
        self.count += entries.len();
        let mine = self.pending.entry(session).or_default();
        if mine.is_empty() {
            self.firsts.insert((first.n, session));
        }
        mine.extend(entries);
    }

    /// A session's waiting entries, in order: its newest segments, after
    /// every one the index names.
    pub(crate) fn of(&self, session: SessionId) -> &[Entry] {
        self.pending.get(&session).map_or(&[], Vec::as_slice)
    }

    /// The last sequence number of a session's waiting entries.
    pub(crate) fn last_seq(&self, session: SessionId) -> Option<u64> {
        self.of(session).last().map(|e| e.last_seq)
    }

    /// Drops a session's waiting entries (its log was deleted).
    pub(crate) fn forget(&mut self, session: SessionId) {
        if self.set_aside.remove(&session).is_some() {
            metrics::gauge!("tiller_store_damaged_sessions").set(self.set_aside.len() as f64);
        }
        if let Some(e) = self.pending.remove(&session) {
            self.count -= e.len();
            self.firsts.remove(&(e[0].n, session));
        }
    }

    /// Entries waiting to be written (not those of sessions set aside).
    fn waiting(&self) -> usize {
        let aside: usize = self.set_aside.keys().map(|s| self.of(*s).len()).sum();
        self.count - aside
    }

    /// Whether the oldest sessions' entries should be written now.
    pub(crate) fn due(&self) -> bool {
        self.waiting() >= PENDING
            || self
                .firsts
                .iter()
                .find(|(_, s)| !self.set_aside.contains_key(s))
                .is_some_and(|(n, _)| *n < self.next_n - AGE)
    }

    /// Writes every waiting entry (at a clean close).
    pub(crate) fn write_all(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        let all: Vec<(SessionId, usize)> = self
            .pending
            .iter()
            .filter(|(s, _)| !self.set_aside.contains_key(s))
            .map(|(s, e)| (*s, e.len()))
            .collect();
        self.write_or_set_aside(conn, all)
    }

    /// Writes the oldest entries of the [`SLICE`] sessions waiting
    /// longest ([`SLICE_BEHIND`] when far behind), at most `write_cap`
    /// ([`WRITE`]) of them.
    pub(crate) fn write_oldest(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        let mut budget = self.write_cap;
        let mut picked = Vec::new();
        let sessions = if self.waiting() > 2 * PENDING {
            SLICE_BEHIND
        } else {
            SLICE
        };
        for &(_, s) in self
            .firsts
            .iter()
            .filter(|(_, s)| !self.set_aside.contains_key(s))
            .take(sessions)
        {
            if budget == 0 {
                break;
            }
            let k = self.pending[&s].len().min(budget);
            budget -= k;
            picked.push((s, k));
        }
        self.write_or_set_aside(conn, picked)
    }

    /// Writes `picked` (see [`Tail::write`]). When the index refuses them
    /// (a constraint: it names one of their segments already), each
    /// session is tried alone and the ones it refuses are set aside; any
    /// other failure (a full disk) leaves everything waiting for the
    /// next try.
    fn write_or_set_aside(
        &mut self,
        conn: &Connection,
        picked: Vec<(SessionId, usize)>,
    ) -> rusqlite::Result<()> {
        if picked.is_empty() {
            return Ok(());
        }
        match self.write(conn, &picked) {
            Err(e) if refused(&e) && picked.len() > 1 => {
                let mut first = Ok(());
                for p in picked {
                    if let Err(e) = self.write(conn, &[p]) {
                        if refused(&e) {
                            self.set_aside(p.0, format!("the index refused its entries: {e}"));
                        }
                        first = first.and(Err(e));
                    }
                }
                first
            }
            Err(e) if refused(&e) => {
                self.set_aside(picked[0].0, format!("the index refused its entries: {e}"));
                Err(e)
            }
            done => done,
        }
    }

    /// Panics unless the counts and the oldest-first set agree with the
    /// waiting entries.
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        let count: usize = self.pending.values().map(Vec::len).sum();
        assert_eq!(self.count, count, "the count of waiting entries");
        let firsts: BTreeSet<(i64, SessionId)> = self
            .pending
            .iter()
            .map(|(s, e)| (e.first().expect("no empty list waits").n, *s))
            .collect();
        assert_eq!(self.firsts, firsts, "each session's first waiting segment");
        assert!(
            self.set_aside.keys().all(|s| self.pending.contains_key(s)),
            "a session set aside waits"
        );
    }

    /// Every waiting entry, by session.
    #[cfg(test)]
    pub(crate) fn clone_waiting(&self) -> std::collections::BTreeMap<SessionId, Vec<Entry>> {
        self.pending.iter().map(|(s, e)| (*s, e.clone())).collect()
    }

    /// Whether a session is set aside (passed over by upkeep).
    #[cfg(test)]
    pub(crate) fn is_set_aside(&self, session: SessionId) -> bool {
        self.set_aside.contains_key(&session)
    }

    /// Writes the first `k` waiting entries of each `(session, k)`, and
    /// the new `upto`, in one transaction; they stop waiting once it
    /// committed (nothing changes here when it failed).
    fn write(&mut self, conn: &Connection, picked: &[(SessionId, usize)]) -> rusqlite::Result<()> {
        let mut sorted: Vec<(String, SessionId, usize)> = picked
            .iter()
            .map(|(s, k)| (s.to_string(), *s, *k))
            .collect();
        sorted.sort_unstable();
        let taken: HashMap<SessionId, usize> = picked.iter().copied().collect();
        // The oldest segment still waiting afterwards: the oldest of
        // another session's, or of what is left of a picked one's.
        let untouched = self
            .firsts
            .iter()
            .find(|(_, s)| !taken.contains_key(s))
            .map(|(n, _)| *n);
        let rest = picked
            .iter()
            .filter_map(|(s, k)| self.pending.get(s).and_then(|e| e.get(*k)))
            .map(|e| e.n);
        let left = rest.chain(untouched).min();
        let upto = left.map_or(self.next_n - 1, |n| n - 1);
        crate::log::in_transaction(conn, |c| {
            let mut insert = c.prepare_cached(concat!(
                "INSERT INTO log_index (",
                columns!(),
                ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            ))?;
            for (id, s, k) in &sorted {
                for e in self.of(*s).iter().take(*k) {
                    insert.execute(params![
                        id,
                        e.first_seq as i64,
                        e.last_seq as i64,
                        e.last_ts_ms,
                        e.max_turn.map(|t| t as i64),
                        e.kinds,
                        e.n
                    ])?;
                }
            }
            set_upto(c, upto)
        })?;
        for (_, s, k) in sorted {
            let Some(e) = self.pending.get_mut(&s) else {
                continue;
            };
            let k = k.min(e.len());
            if k == 0 {
                continue;
            }
            self.firsts.remove(&(e[0].n, s));
            e.drain(..k);
            self.count -= k;
            match e.first() {
                Some(f) => {
                    self.firsts.insert((f.n, s));
                }
                None => {
                    self.pending.remove(&s);
                }
            }
        }
        Ok(())
    }
}

/// Two segments of a session's log holding the same event, in words.
fn clash(one: i64, other: i64, seq: u64) -> String {
    format!("segments {one} and {other} of its log both hold event {seq}")
}

/// What is wrong with the log (see [`crate::damaged_logs`]): reads every
/// segment's key, once.
pub(crate) fn damaged(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    // Each damaged session once (however many of its rows are), with the
    // first problem found and how many more there are.
    let mut by_session: std::collections::BTreeMap<String, (String, usize)> = Default::default();
    let mut note = |id: String, what: String| {
        by_session.entry(id).or_insert((what, 0)).1 += 1;
    };
    let mut overlaps = conn.prepare(
        "SELECT session_id, first_seq, n, prev_n FROM (
             SELECT session_id, first_seq, n,
                    LAG(last_seq) OVER w AS prev_last, LAG(n) OVER w AS prev_n
             FROM log WINDOW w AS (PARTITION BY session_id ORDER BY first_seq, n)
         ) WHERE first_seq <= prev_last",
    )?;
    let mut rows = overlaps.query([])?;
    while let Some(r) = rows.next()? {
        let (id, seq, n, prev): (String, i64, i64, i64) =
            (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?);
        note(id, clash(prev, n, seq as u64));
    }
    let mut misnamed = conn.prepare(
        "SELECT i.session_id, i.first_seq, i.n FROM log_index i LEFT JOIN log l ON l.n = i.n
         WHERE l.n IS NULL OR l.session_id != i.session_id OR l.first_seq != i.first_seq",
    )?;
    let mut rows = misnamed.query([])?;
    while let Some(r) = rows.next()? {
        let (id, seq, n): (String, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
        note(
            id,
            format!(
                "its index names segment {n} for event {seq}, which that segment does not hold"
            ),
        );
    }
    let mut found: Vec<String> = by_session
        .into_iter()
        .map(|(id, (what, count))| {
            let who = match SessionId::parse(&id) {
                Some(s) => format!("session {s}"),
                None => format!("{id:?} (no session)"),
            };
            match count {
                1 => format!("{who}: {what}"),
                _ => format!("{who}: {what} ({} more problems)", count - 1),
            }
        })
        .collect();
    let mut ids = conn.prepare("SELECT session_id, COUNT(*) FROM log GROUP BY session_id")?;
    let mut rows = ids.query([])?;
    while let Some(r) = rows.next()? {
        let (id, count): (String, i64) = (r.get(0)?, r.get(1)?);
        if SessionId::parse(&id).is_none() {
            found.push(format!(
                "{count} segment(s) of {id:?}, which names no session: no read reaches them"
            ));
        }
    }
    Ok(found)
}

/// Whether the index refused a write (a constraint failed), which
/// trying again would not change.
fn refused(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
}

fn set_upto(conn: &Connection, upto: i64) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE log_indexed SET upto = ?1")?
        .execute(params![upto])
        .map(drop)
}

/// v13: the log's index moves out of the log into `log_index`, written
/// behind it (see the module's documentation). Every segment is indexed.
pub(crate) fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(concat!(
        "CREATE TABLE log_index (
            session_id TEXT NOT NULL,
            first_seq INTEGER NOT NULL,
            last_seq INTEGER NOT NULL,
            last_ts_ms INTEGER NOT NULL,
            max_turn INTEGER,
            kinds INTEGER NOT NULL,
            n INTEGER NOT NULL,
            PRIMARY KEY (session_id, first_seq)
        ) WITHOUT ROWID;
        INSERT INTO log_index (",
        columns!(),
        ") SELECT ",
        columns!(),
        " FROM log ORDER BY session_id, first_seq;
        DROP INDEX log_session;
        CREATE TABLE log_indexed (upto INTEGER NOT NULL);
        INSERT INTO log_indexed (upto) SELECT COALESCE(MAX(n), 0) FROM log;"
    ))
}
