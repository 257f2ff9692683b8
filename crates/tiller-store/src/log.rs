//! The per-session event log and the prompt ledger that rides on it.

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::{PromptId, SessionId, TurnId};

use crate::writer::Pending;
use crate::{Claim, HistoryPage, LedgerOp, LogHead, StoredEvent, Unsettled};

/// Commits a batch of appends and everything they imply, in one transaction.
pub(crate) fn append_batch(conn: &mut Connection, batch: &[Pending]) -> rusqlite::Result<()> {
    in_transaction(conn, |c| insert_batch(c, batch))
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

fn insert_batch(tx: &Connection, batch: &[Pending]) -> rusqlite::Result<()> {
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO events (session_id, seq, ts_ms, kind, prompt_id, turn_id, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?;
        let mut admit = tx.prepare_cached(
            "INSERT OR IGNORE INTO prompts (prompt_id, session_id, origin, admitted_ms)
             VALUES (?1, ?2, ?3, ?4)",
        )?;
        let mut settle = tx.prepare_cached("DELETE FROM prompts WHERE prompt_id = ?1")?;
        for Pending {
            event: e, ledger, ..
        } in batch
        {
            match ledger {
                Some(LedgerOp::Admit {
                    prompt,
                    origin,
                    consumes,
                }) => {
                    admit.execute(params![
                        prompt.to_string(),
                        e.session.to_string(),
                        origin,
                        e.ts_ms
                    ])?;
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
                    settle.execute(params![prompt.to_string()])?;
                    if let Some(d) = delivery {
                        crate::deliveries::add(tx, d)?;
                    }
                }
                None => {}
            }
            insert.execute(params![
                e.session.to_string(),
                e.seq as i64,
                e.ts_ms,
                e.kind,
                e.prompt.map(|p| p.to_string()),
                e.turn.map(|t| t.0 as i64),
                e.data,
            ])?;
        }
    }
    Ok(())
}

/// The head of a session's log.
pub(crate) fn head(conn: &Connection, id: SessionId) -> rusqlite::Result<LogHead> {
    let (last_seq, last_turn): (i64, i64) = conn.query_row(
        "SELECT COALESCE(MAX(seq), 0), COALESCE(MAX(turn_id), 0) FROM events WHERE session_id = ?1",
        params![id.to_string()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(LogHead {
        last_seq: last_seq as u64,
        last_turn: last_turn as u64,
    })
}

pub(crate) fn event_row(
    session: SessionId,
    r: &rusqlite::Row<'_>,
) -> rusqlite::Result<StoredEvent> {
    let prompt: Option<String> = r.get("prompt_id")?;
    let turn: Option<i64> = r.get("turn_id")?;
    Ok(StoredEvent {
        session,
        seq: r.get::<_, i64>("seq")? as u64,
        ts_ms: r.get("ts_ms")?,
        kind: r.get("kind")?,
        prompt: prompt.as_deref().and_then(PromptId::parse),
        turn: turn.map(|t| TurnId(t as u64)),
        data: r.get("data")?,
    })
}

pub(crate) fn history(
    conn: &Connection,
    session: SessionId,
    before: u64,
    limit: usize,
) -> rusqlite::Result<HistoryPage> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, ts_ms, kind, prompt_id, turn_id, data FROM events
         WHERE session_id = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT ?3",
    )?;
    let mut events = stmt
        .query_map(
            params![session.to_string(), before as i64, limit as i64 + 1],
            |r| event_row(session, r),
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let has_more = events.len() > limit;
    events.truncate(limit);
    events.reverse();
    Ok(HistoryPage { events, has_more })
}

pub(crate) fn last_of_kinds(
    conn: &Connection,
    session: SessionId,
    kinds: &[&str],
) -> rusqlite::Result<Option<StoredEvent>> {
    let marks = vec!["?"; kinds.len()].join(",");
    let sql = format!(
        "SELECT seq, ts_ms, kind, prompt_id, turn_id, data FROM events
         WHERE session_id = ? AND kind IN ({marks}) ORDER BY seq DESC LIMIT 1"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let id = session.to_string();
    let mut args: Vec<&dyn rusqlite::ToSql> = vec![&id];
    for k in kinds {
        args.push(k);
    }
    stmt.query_row(args.as_slice(), |r| event_row(session, r))
        .optional()
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

pub(crate) fn events_after(
    conn: &Connection,
    session: SessionId,
    after: u64,
    limit: usize,
) -> rusqlite::Result<Vec<StoredEvent>> {
    let mut stmt = conn.prepare_cached(
        "SELECT seq, ts_ms, kind, prompt_id, turn_id, data FROM events
         WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
    )?;
    let rows = stmt.query_map(
        params![session.to_string(), after as i64, limit as i64],
        |r| event_row(session, r),
    )?;
    rows.collect()
}
