//! The per-session event log (in segments, see [`segment`]) and the
//! prompt ledger that rides on it.

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::{PromptId, SessionId};

use crate::index::{Entry, Tail};
use crate::writer::Pending;
use crate::{Claim, HistoryPage, LedgerOp, LogHead, StoredEvent, Unsettled, segment};

/// Commits a batch of appends and everything they imply, in one transaction.
/// `heads` caches each session's last stored sequence number (read from
/// the log when missing); it is updated once the batch committed, and
/// forgets the batch's sessions when it did not.
/// The segments' index entries wait in `tail` (see [`crate::index`]).
pub(crate) fn append_batch(
    conn: &mut Connection,
    heads: &mut Heads,
    tail: &mut Tail,
    batch: &[Pending],
) -> rusqlite::Result<()> {
    let mut next = Heads::default();
    let mut entries = Vec::new();
    let done = in_transaction(conn, |c| {
        insert_batch(c, heads, tail, &mut next, &mut entries, batch)
    });
    match done {
        Ok(()) => {
            heads.commit(next);
            for (s, e) in entries {
                tail.add(s, e);
            }
        }
        Err(_) => heads.forget(batch.iter().map(|p| p.event.session)),
    }
    done
}

/// The last stored sequence number of recently written sessions, so an
/// append does not read the log's head first. Bounded: emptied when it
/// grows past [`Heads::MAX`] (entries are read back as needed).
#[derive(Default)]
pub(crate) struct Heads(foldhash::HashMap<SessionId, u64>);

impl Heads {
    const MAX: usize = 200_000;

    /// The cached last sequence number of a session.
    pub(crate) fn cached(&self, session: SessionId) -> Option<u64> {
        self.0.get(&session).copied()
    }

    /// Records a session's last sequence number (in a batch's `next`).
    pub(crate) fn set(&mut self, session: SessionId, last: u64) {
        self.0.insert(session, last);
    }

    /// Takes a committed batch's heads.
    pub(crate) fn commit(&mut self, next: Heads) {
        if self.0.len() + next.0.len() > Self::MAX {
            self.0.clear();
        }
        self.0.extend(next.0);
    }

    /// Forgets sessions (a failed write, a deleted or reopened log).
    pub(crate) fn forget(&mut self, sessions: impl IntoIterator<Item = SessionId>) {
        for s in sessions {
            self.0.remove(&s);
        }
    }
}

/// Runs `f` in a transaction whose BEGIN and COMMIT are cached statements
/// (parsed once, not per call); rolled back when anything fails.
pub(crate) fn in_transaction<T>(
    conn: &Connection,
    f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    conn.prepare_cached("BEGIN")?.execute([])?;
    let done = f(conn).and_then(|v| {
        conn.prepare_cached("COMMIT")?.execute([])?;
        Ok(v)
    });
    if done.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    done
}

/// The prompts a batch settles. A prompt the same batch admits never
/// enters the ledger, which holds only prompts not yet settled: its
/// admission skips the insert (a page fewer to write per commit for a
/// prompt whose admission and terminal commit together). The
/// settlement's delete still runs: the row may be there from an earlier
/// commit of the same admission, sent again after a failure.
pub(crate) fn settled_in(batch: &[Pending]) -> std::collections::HashSet<PromptId> {
    batch
        .iter()
        .filter_map(|p| match p.ledger.as_deref() {
            Some(LedgerOp::Settle { prompt, .. }) => Some(*prompt),
            _ => None,
        })
        .collect()
}

fn insert_batch(
    tx: &Connection,
    heads: &mut Heads,
    tail: &mut Tail,
    next: &mut Heads,
    entries: &mut Vec<(SessionId, Vec<Entry>)>,
    batch: &[Pending],
) -> rusqlite::Result<()> {
    // Prepared when first needed: most batches (streamed events) carry
    // no ledger change, and taking a statement from the cache and giving
    // it back is not free.
    let (mut admit, mut settle) = (None, None);
    let settled = settled_in(batch);
    for Pending {
        event: e, ledger, ..
    } in batch
    {
        match ledger.as_deref() {
            Some(LedgerOp::Admit {
                prompt,
                origin,
                consumes,
            }) => {
                if !settled.contains(prompt) {
                    let admit = match &mut admit {
                        Some(a) => a,
                        None => admit.insert(tx.prepare_cached(
                            "INSERT OR IGNORE INTO prompts (prompt_id, session_id, origin, admitted_ms)
                             VALUES (?1, ?2, ?3, ?4)",
                        )?),
                    };
                    admit.execute(params![
                        prompt.encode(&mut [0; 36]),
                        e.session.encode(&mut [0; 36]),
                        origin,
                        e.ts_ms
                    ])?;
                }
                match consumes {
                    Some(Claim::Notification(n)) => {
                        tx.execute("DELETE FROM notifications WHERE n = ?1", params![n])?;
                    }
                    Some(Claim::CronFire(n)) => {
                        tx.execute("DELETE FROM cron_fires WHERE n = ?1", params![n])?;
                    }
                    None => {}
                }
            }
            Some(LedgerOp::Settle { prompt, delivery }) => {
                let settle = match &mut settle {
                    Some(d) => d,
                    None => settle
                        .insert(tx.prepare_cached("DELETE FROM prompts WHERE prompt_id = ?1")?),
                };
                settle.execute(params![prompt.encode(&mut [0; 36])])?;
                if let Some(d) = delivery {
                    crate::deliveries::add(tx, d)?;
                }
            }
            None => {}
        }
    }
    // Each session's events, in order, as segments after what it holds.
    for (s, events) in by_session(batch) {
        let head = match next.cached(s).or_else(|| heads.cached(s)) {
            Some(h) => h,
            None => match tail.last_seq(s) {
                Some(h) => h,
                None => head_seq(tx, s)?,
            },
        };
        let (last, mine) = insert_events(tx, s, head, events.into_iter(), Some(&mut tail.next_n))?;
        next.set(s, last);
        entries.push((s, mine));
    }
    Ok(())
}

/// The batch's events grouped by session (each session's in order), the
/// sessions in the order they first appear. Linear in the batch: a batch
/// may hold a thousand sessions' streams.
pub(crate) fn by_session(batch: &[Pending]) -> Vec<(SessionId, Vec<&StoredEvent>)> {
    let mut at: foldhash::HashMap<SessionId, usize> = foldhash::HashMap::default();
    let mut groups: Vec<(SessionId, Vec<&StoredEvent>)> = Vec::new();
    for p in batch {
        let s = p.event.session;
        let i = *at.entry(s).or_insert_with(|| {
            groups.push((s, Vec::new()));
            groups.len() - 1
        });
        groups[i].1.push(&p.event);
    }
    groups
}

/// The last sequence number once `events` (one session's, in order) follow
/// `head`, the last one its log holds; why not, when one does not come
/// after what the log holds (a sequence number reused).
pub(crate) fn follows(
    session: SessionId,
    head: u64,
    events: &[&StoredEvent],
) -> Result<u64, String> {
    let mut last = head;
    for e in events {
        if e.seq <= last {
            return Err(format!(
                "event {} of session {session} does not follow the log's {last}",
                e.seq
            ));
        }
        last = e.seq;
    }
    Ok(last)
}

/// Appends one session's events (in order) as segments after `head`, the
/// last sequence number its log holds; returns the new last one and the
/// segments' index entries. An event that does not come after what the
/// log holds (a sequence number reused) is refused, as the per-event key
/// used to. Segments are numbered from `next_n` (advanced past them), or
/// by SQLite when it is `None` (a migration before the index moved out).
pub(crate) fn insert_events<'a>(
    tx: &Connection,
    session: SessionId,
    head: u64,
    events: impl Iterator<Item = &'a StoredEvent>,
    mut next_n: Option<&mut i64>,
) -> rusqlite::Result<(u64, Vec<Entry>)> {
    let mut id = [0; 36];
    let id = session.encode(&mut id);
    let mut insert = tx.prepare_cached(
        "INSERT INTO log (n, session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    let events: Vec<&StoredEvent> = events.collect();
    let last = follows(session, head, &events).map_err(|why| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT),
            Some(why),
        )
    })?;
    let mut entries = Vec::new();
    for seg in segment::split(events.iter().copied()) {
        let n = next_n.as_deref_mut().map(|next| {
            *next += 1;
            *next - 1
        });
        insert.execute(params![
            n,
            id,
            seg.first_seq as i64,
            seg.last_seq as i64,
            seg.last_ts_ms,
            seg.max_turn.map(|t| t as i64),
            seg.kinds,
            seg.body,
        ])?;
        entries.push(Entry {
            first_seq: seg.first_seq,
            last_seq: seg.last_seq,
            last_ts_ms: seg.last_ts_ms,
            max_turn: seg.max_turn,
            kinds: seg.kinds,
            n: n.unwrap_or_else(|| tx.last_insert_rowid()),
        });
    }
    Ok((last, entries))
}

/// The last sequence number of a session's log (0 when empty), as the
/// index names it.
pub(crate) fn head_seq(conn: &Connection, id: SessionId) -> rusqlite::Result<u64> {
    let mut stmt = conn.prepare_cached(
        "SELECT last_seq FROM log_index WHERE session_id = ?1 ORDER BY first_seq DESC LIMIT 1",
    )?;
    let last: Option<i64> = stmt
        .query_row(params![id.to_string()], |r| r.get(0))
        .optional()?;
    Ok(last.unwrap_or(0) as u64)
}

/// The head of a session's log; `waiting` is its segments the index does
/// not name yet (see [`crate::index`]), its newest.
pub(crate) fn head(
    conn: &Connection,
    id: SessionId,
    waiting: &[Entry],
) -> rusqlite::Result<LogHead> {
    let last_seq = match waiting.last() {
        Some(e) => e.last_seq,
        None => head_seq(conn, id)?,
    };
    // Turn ids grow with sequence numbers: the newest segment with a turn
    // has the highest.
    let last_turn = match waiting.iter().rev().find_map(|e| e.max_turn) {
        Some(t) => t,
        None => {
            let mut stmt = conn.prepare_cached(
                "SELECT max_turn FROM log_index WHERE session_id = ?1 AND max_turn IS NOT NULL
                 ORDER BY first_seq DESC LIMIT 1",
            )?;
            let t: Option<i64> = stmt
                .query_row(params![id.to_string()], |r| r.get(0))
                .optional()?;
            t.unwrap_or(0) as u64
        }
    };
    Ok(LogHead {
        last_seq,
        last_turn,
    })
}

fn corrupt(e: segment::Corrupt) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(e))
}

fn decode(session: SessionId, row: &rusqlite::Row<'_>) -> rusqlite::Result<Vec<StoredEvent>> {
    segment::decode(session, row.get_ref(0)?.as_blob()?).map_err(corrupt)
}

/// The events of a segment the index does not name yet, by its row.
fn waiting_segment(
    conn: &Connection,
    session: SessionId,
    e: &Entry,
) -> rusqlite::Result<Vec<StoredEvent>> {
    conn.prepare_cached("SELECT body FROM log WHERE n = ?1")?
        .query_row(params![e.n], |r| decode(session, r))
}

/// Up to `limit` events before `before`, and whether older ones exist;
/// `waiting` as for [`head`].
pub(crate) fn history(
    conn: &Connection,
    session: SessionId,
    before: u64,
    limit: usize,
    waiting: &[Entry],
) -> rusqlite::Result<HistoryPage> {
    // Newest first, one more than asked (to tell whether older ones
    // exist): the waiting segments, then what the index names.
    let mut events = Vec::new();
    for e in waiting.iter().rev().filter(|e| e.first_seq < before) {
        if events.len() > limit {
            break;
        }
        let seg = waiting_segment(conn, session, e)?;
        events.extend(seg.into_iter().rev().filter(|e| e.seq < before));
    }
    if events.len() <= limit {
        let mut stmt = conn.prepare_cached(
            "SELECT l.body FROM log_index i JOIN log l ON l.n = i.n
             WHERE i.session_id = ?1 AND i.first_seq < ?2 ORDER BY i.first_seq DESC",
        )?;
        let mut rows = stmt.query(params![session.to_string(), before as i64])?;
        while events.len() <= limit
            && let Some(row) = rows.next()?
        {
            let seg = decode(session, row)?;
            events.extend(seg.into_iter().rev().filter(|e| e.seq < before));
        }
    }
    let has_more = events.len() > limit;
    events.truncate(limit);
    events.reverse();
    Ok(HistoryPage { events, has_more })
}

/// The newest event of one of `kinds`; `waiting` as for [`head`].
pub(crate) fn last_of_kinds(
    conn: &Connection,
    session: SessionId,
    kinds: &[&str],
    waiting: &[Entry],
) -> rusqlite::Result<Option<StoredEvent>> {
    let mask = kinds.iter().fold(0, |m, k| m | segment::kind_bit(k));
    let newest = |seg: Vec<StoredEvent>| {
        seg.into_iter()
            .rev()
            .find(|e| kinds.contains(&e.kind.as_str()))
    };
    for e in waiting.iter().rev().filter(|e| e.kinds & mask != 0) {
        if let Some(found) = newest(waiting_segment(conn, session, e)?) {
            return Ok(Some(found));
        }
    }
    let mut stmt = conn.prepare_cached(
        "SELECT l.body FROM log_index i JOIN log l ON l.n = i.n
         WHERE i.session_id = ?1 AND (i.kinds & ?2) != 0 ORDER BY i.first_seq DESC",
    )?;
    let mut rows = stmt.query(params![session.to_string(), mask])?;
    while let Some(row) = rows.next()? {
        if let Some(found) = newest(decode(session, row)?) {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

pub(crate) fn unsettled(conn: &Connection) -> rusqlite::Result<Vec<Unsettled>> {
    let mut stmt = conn
        .prepare_cached("SELECT session_id, prompt_id, origin FROM prompts ORDER BY admitted_ms")?;
    let rows = stmt.query_map([], |r| {
        let s: String = r.get(0)?;
        let p: String = r.get(1)?;
        Ok((s, p, r.get::<_, String>(2)?))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (s, p, origin) = row?;
        if let (Some(session), Some(prompt)) = (SessionId::parse(&s), PromptId::parse(&p)) {
            out.push(Unsettled {
                session,
                prompt,
                origin,
            });
        }
    }
    Ok(out)
}

/// Up to `limit` events after `after`, oldest first; `waiting` as for
/// [`head`].
pub(crate) fn events_after(
    conn: &Connection,
    session: SessionId,
    after: u64,
    limit: usize,
    waiting: &[Entry],
) -> rusqlite::Result<Vec<StoredEvent>> {
    // From the segment holding `after + 1` (the newest starting at or
    // before it), then every later one: among the waiting segments when
    // the first of them starts at or before it, else in the index and on
    // through every waiting one.
    let from = after.saturating_add(1);
    let in_waiting = waiting.partition_point(|e| e.first_seq <= from);
    let mut events = Vec::new();
    if in_waiting == 0 {
        let mut stmt = conn.prepare_cached(
            "SELECT l.body FROM log_index i JOIN log l ON l.n = i.n
             WHERE i.session_id = ?1 AND i.first_seq >= (
                 SELECT COALESCE(MAX(first_seq), 0) FROM log_index
                 WHERE session_id = ?1 AND first_seq <= ?2
             ) ORDER BY i.first_seq",
        )?;
        let mut rows = stmt.query(params![session.to_string(), from as i64])?;
        while events.len() < limit
            && let Some(row) = rows.next()?
        {
            let seg = decode(session, row)?;
            events.extend(seg.into_iter().filter(|e| e.seq > after));
        }
    }
    for e in &waiting[in_waiting.saturating_sub(1)..] {
        if events.len() >= limit {
            break;
        }
        let seg = waiting_segment(conn, session, e)?;
        events.extend(seg.into_iter().filter(|e| e.seq > after));
    }
    events.truncate(limit);
    Ok(events)
}
