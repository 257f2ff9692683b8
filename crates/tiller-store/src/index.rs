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
//! behind), at most [`WRITE`] at a time, and a session's own before
//! anything reads its log (every read goes through the index, whole).
//!
//! Nothing is lost when the process dies with entries waiting: the
//! segments are in the log, and the row `log_indexed.upto` says that
//! every segment numbered up to it is indexed. Opening the store indexes
//! the segments after it ([`Tail::open`]). Segment numbers are the
//! writer's ([`Tail::next_n`]), always above every number used before,
//! so a segment written later is never numbered at or below `upto`.

use std::collections::{BTreeSet, HashMap};

use rusqlite::{Connection, params};
use tiller_core::SessionId;

/// Entries waiting that make the oldest sessions' due.
pub(crate) const PENDING: usize = 8192;
/// Sessions whose entries one transaction of upkeep writes (one page
/// each, about).
pub(crate) const SLICE: usize = 64;
/// Most entries one transaction of upkeep writes (a few sessions
/// streaming fast may have thousands each): the stall it is for the
/// commits queued meanwhile stays short.
pub(crate) const WRITE: usize = 1024;
/// How far (in segments) the oldest waiting entry may fall behind the
/// newest: it bounds what opening the store reindexes.
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

/// The entries not yet written to `log_index`, each session's in order.
#[derive(Default)]
pub(crate) struct Tail {
    pending: HashMap<SessionId, Vec<Entry>>,
    /// Each waiting session's first waiting segment number: the oldest
    /// first.
    firsts: BTreeSet<(i64, SessionId)>,
    count: usize,
    /// The number the next segment takes.
    pub(crate) next_n: i64,
    /// Most entries one [`Tail::write_oldest`] writes ([`WRITE`]).
    pub(crate) write_cap: usize,
}

impl Tail {
    /// Indexes what a previous run left unindexed, and starts numbering
    /// segments after every number used.
    pub(crate) fn open(conn: &Connection) -> rusqlite::Result<Tail> {
        let upto: i64 = conn.query_row("SELECT upto FROM log_indexed", [], |r| r.get(0))?;
        let max: i64 = conn.query_row("SELECT COALESCE(MAX(n), 0) FROM log", [], |r| r.get(0))?;
        let next_n = max.max(upto) + 1;
        if max > upto {
            crate::log::in_transaction(conn, |c| {
                c.execute(
                    "INSERT OR IGNORE INTO log_index
                         (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n)
                     SELECT session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n
                     FROM log WHERE n > ?1",
                    params![upto],
                )?;
                set_upto(c, next_n - 1)
            })?;
        }
        Ok(Tail {
            next_n,
            write_cap: WRITE,
            ..Tail::default()
        })
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

    /// The last sequence number of a session's waiting entries.
    pub(crate) fn last_seq(&self, session: SessionId) -> Option<u64> {
        self.pending
            .get(&session)
            .and_then(|e| e.last())
            .map(|e| e.last_seq)
    }

    /// Whether the oldest sessions' entries should be written now.
    pub(crate) fn due(&self) -> bool {
        self.count >= PENDING
            || self
                .firsts
                .first()
                .is_some_and(|(n, _)| *n < self.next_n - AGE)
    }

    /// Writes one session's waiting entries (before a read of its log).
    pub(crate) fn write_session(
        &mut self,
        conn: &Connection,
        session: SessionId,
    ) -> rusqlite::Result<()> {
        match self.pending.get(&session) {
            Some(e) => {
                let all = e.len();
                self.write(conn, &[(session, all)])
            }
            None => Ok(()),
        }
    }

    /// Writes every waiting entry.
    pub(crate) fn write_all(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        let all: Vec<(SessionId, usize)> =
            self.pending.iter().map(|(s, e)| (*s, e.len())).collect();
        if all.is_empty() {
            return Ok(());
        }
        self.write(conn, &all)
    }

    /// Writes the oldest entries of the [`SLICE`] sessions waiting
    /// longest, at most `write_cap` ([`WRITE`]) of them.
    pub(crate) fn write_oldest(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        let mut budget = self.write_cap;
        let mut picked = Vec::new();
        for &(_, s) in self.firsts.iter().take(SLICE) {
            if budget == 0 {
                break;
            }
            let k = self.pending[&s].len().min(budget);
            budget -= k;
            picked.push((s, k));
        }
        if picked.is_empty() {
            return Ok(());
        }
        self.write(conn, &picked)
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
            let mut insert = c.prepare_cached(
                "INSERT INTO log_index
                     (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?;
            for (id, s, k) in &sorted {
                for e in self.pending.get(s).into_iter().flatten().take(*k) {
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

fn set_upto(conn: &Connection, upto: i64) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE log_indexed SET upto = ?1")?
        .execute(params![upto])
        .map(drop)
}

/// v13: the log's index moves out of the log into `log_index`, written
/// behind it (see the module's documentation). Every segment is indexed.
pub(crate) fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
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
        INSERT INTO log_index (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n)
            SELECT session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, n FROM log
            ORDER BY session_id, first_seq;
        DROP INDEX log_session;
        CREATE TABLE log_indexed (upto INTEGER NOT NULL);
        INSERT INTO log_indexed (upto) SELECT COALESCE(MAX(n), 0) FROM log;",
    )
}
