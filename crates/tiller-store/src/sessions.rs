//! Session rows, their stored state, and the channel replay guard.

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::SessionId;

use crate::index::Entry;
use crate::{
    ConversationWrite, LogHead, SessionExtras, SessionPage, SessionRecord, StateColumn,
    StoredConversation,
};

/// A new session with the engine it runs, in one transaction.
pub(crate) fn create_with_engine(
    conn: &mut Connection,
    rec: &SessionRecord,
    engine: &str,
) -> rusqlite::Result<()> {
    crate::log::in_transaction(conn, |c| {
        create_session(c, rec)?;
        save_state(c, rec.id, StateColumn::Engine, engine)
    })
}

pub(crate) fn create_session(conn: &Connection, rec: &SessionRecord) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO sessions (id, cwd, title, created_ms, updated_ms, closed, channel)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        rec.id.to_string(),
        rec.cwd,
        rec.title,
        rec.created_ms,
        rec.updated_ms,
        rec.closed,
        rec.channel
    ])
    .map(drop)
}

/// A session's last activity: the time of its newest event the index
/// names (one index seek), or its creation. Appends do not write the
/// session row; the newest events may still wait to be indexed (see
/// [`crate::index`]), and the callers take their time then.
const UPDATED: &str =
    "COALESCE((SELECT last_ts_ms FROM log_index l WHERE l.session_id = sessions.id
    ORDER BY l.first_seq DESC LIMIT 1), updated_ms) AS updated_ms";

fn session_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionRecord> {
    let id: String = r.get("id")?;
    Ok(SessionRecord {
        id: SessionId::parse(&id).ok_or_else(|| {
            rusqlite::Error::InvalidColumnType(0, "id".into(), rusqlite::types::Type::Text)
        })?,
        cwd: r.get("cwd")?,
        title: r.get("title")?,
        created_ms: r.get("created_ms")?,
        updated_ms: r.get("updated_ms")?,
        closed: r.get("closed")?,
        channel: r.get("channel")?,
    })
}

/// A session and its log's head; `waiting` is its segments the index
/// does not name yet, its newest.
pub(crate) fn get_session(
    conn: &Connection,
    id: SessionId,
    waiting: &[Entry],
) -> rusqlite::Result<Option<(SessionRecord, LogHead)>> {
    let Some(mut rec) = conn
        .query_row(
            &format!("SELECT id, cwd, title, created_ms, {UPDATED}, closed, channel FROM sessions WHERE id = ?1"),
            params![id.to_string()],
            session_row,
        )
        .optional()?
    else {
        return Ok(None);
    };
    if let Some(e) = waiting.last() {
        rec.updated_ms = e.last_ts_ms;
    }
    Ok(Some((rec, crate::log::head(conn, id, waiting)?)))
}

/// A page of open sessions, newest first; `updated` is a session's last
/// activity when its newest events wait to be indexed.
pub(crate) fn list_sessions(
    conn: &Connection,
    cursor: Option<i64>,
    limit: usize,
    cwd: Option<&str>,
    updated: impl Fn(SessionId) -> Option<i64>,
) -> rusqlite::Result<SessionPage> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT n, id, cwd, title, created_ms, {UPDATED}, closed, channel FROM sessions
         WHERE closed = 0 AND n < ?1 AND (?3 IS NULL OR cwd = ?3) ORDER BY n DESC LIMIT ?2"
    ))?;
    let mut rows = stmt.query(params![cursor.unwrap_or(i64::MAX), limit as i64 + 1, cwd])?;
    let mut sessions = Vec::new();
    let mut last_n = None;
    let mut more = false;
    while let Some(r) = rows.next()? {
        if sessions.len() == limit {
            more = true;
            break;
        }
        last_n = Some(r.get::<_, i64>("n")?);
        let mut rec = session_row(r)?;
        if let Some(ms) = updated(rec.id) {
            rec.updated_ms = ms;
        }
        sessions.push(rec);
    }
    Ok(SessionPage {
        sessions,
        next_cursor: if more {
            last_n.map(|n| n.to_string())
        } else {
            None
        },
    })
}

pub(crate) fn set_title(
    conn: &Connection,
    id: SessionId,
    title: Option<&str>,
) -> rusqlite::Result<()> {
    conn.execute(
        "UPDATE sessions SET title = ?2 WHERE id = ?1",
        params![id.to_string(), title],
    )
    .map(drop)
}

/// The tables of a session's queued automatic work: closing the session
/// removes its rows, since nothing runs for a closed session (its cron
/// jobs would fire, and a goal or notification wait, for ever).
/// Jobs before their fires: on PostgreSQL a node firing a job holds the
/// job's row, so the close's delete of the fires, after that of the jobs,
/// sees a fire that node committed meanwhile.
pub(crate) const QUEUE_TABLES: [&str; 4] = ["cron_jobs", "cron_fires", "notifications", "goals"];

/// Removes the queued automatic work of sessions closed before their close
/// removed it (an older version's): run at every start, on both backends
/// (it finds nothing once done).
pub(crate) fn sweep_closed() -> String {
    QUEUE_TABLES
        .iter()
        .map(|t| {
            format!("DELETE FROM {t} WHERE session_id IN (SELECT id FROM sessions WHERE closed);")
        })
        .collect()
}

/// Marks a session closed and removes its queued automatic work, in one
/// transaction.
pub(crate) fn close(conn: &mut Connection, id: SessionId) -> rusqlite::Result<()> {
    let id = id.to_string();
    let tx = conn.transaction()?;
    tx.execute("UPDATE sessions SET closed = 1 WHERE id = ?1", params![id])?;
    for table in QUEUE_TABLES {
        tx.execute(
            &format!("DELETE FROM {table} WHERE session_id = ?1"),
            params![id],
        )?;
    }
    tx.commit()
}

/// Every table that keeps rows of a session (besides `sessions`).
pub(crate) const SESSION_TABLES: [&str; 9] = [
    "log",
    "prompts",
    "notifications",
    "cron_jobs",
    "cron_fires",
    "goals",
    "deliveries",
    "session_state",
    "conversation",
];

/// Removes a session and everything kept for it, in one transaction:
/// its log, prompt ledger, queued work (notifications, cron jobs and their
/// fires, goal), webhook deliveries, state and conversation. False when
/// none of that was there (a damaged session's log without its row is
/// still there: its delete is the repair). The log has no index of its own (see
/// [`crate::index`]): its rows are the ones `log_index` names and the
/// `waiting` ones.
pub(crate) fn delete(
    conn: &mut Connection,
    id: SessionId,
    waiting: &[Entry],
) -> rusqlite::Result<bool> {
    let id = id.to_string();
    let tx = conn.transaction()?;
    // Only rows that are this session's, whatever a damaged index names.
    let mut removed = tx.execute(
        "DELETE FROM log WHERE session_id = ?1
         AND n IN (SELECT n FROM log_index WHERE session_id = ?1)",
        params![id],
    )?;
    for e in waiting {
        removed += tx.execute(
            "DELETE FROM log WHERE n = ?1 AND session_id = ?2",
            params![e.n, id],
        )?;
    }
    removed += tx.execute("DELETE FROM log_index WHERE session_id = ?1", params![id])?;
    for table in SESSION_TABLES.iter().filter(|t| **t != "log") {
        removed += tx.execute(
            &format!("DELETE FROM {table} WHERE session_id = ?1"),
            params![id],
        )?;
    }
    removed += tx.execute("DELETE FROM sessions WHERE id = ?1", params![id])?;
    tx.commit()?;
    Ok(removed > 0)
}

pub(crate) fn save_state(
    conn: &Connection,
    id: SessionId,
    column: StateColumn,
    value: &str,
) -> rusqlite::Result<()> {
    let col = column.as_str();
    conn.prepare_cached(&format!(
        "INSERT INTO session_state (session_id, {col}) VALUES (?1, ?2)
         ON CONFLICT(session_id) DO UPDATE SET {col} = excluded.{col}"
    ))?
    .execute(params![id.to_string(), value])
    .map(drop)
}

pub(crate) fn load_state(conn: &Connection, id: SessionId) -> rusqlite::Result<SessionExtras> {
    let sid = id.to_string();
    let (engine, settings) = conn
        .query_row(
            "SELECT engine, settings FROM session_state WHERE session_id = ?1",
            params![sid],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?
        .unwrap_or_default();
    let mut stmt = conn.prepare_cached(
        "SELECT idx, message FROM conversation WHERE session_id = ?1 ORDER BY idx",
    )?;
    let mut conversation = StoredConversation::default();
    for row in stmt.query_map(params![sid], |r| Ok((r.get::<_, i64>(0)?, r.get(1)?)))? {
        let (idx, message) = row?;
        if conversation.messages.is_empty() {
            conversation.base = idx as u64;
        }
        conversation.messages.push(message);
    }
    Ok(SessionExtras {
        engine,
        settings,
        conversation,
    })
}

/// Applies a conversation change in one transaction.
pub(crate) fn save_conversation(
    conn: &Connection,
    id: SessionId,
    w: &ConversationWrite,
) -> rusqlite::Result<()> {
    let sid = id.to_string();
    let tx = conn.unchecked_transaction()?;
    tx.prepare_cached(
        "DELETE FROM conversation WHERE session_id = ?1 AND (idx < ?2 OR idx >= ?3)",
    )?
    .execute(params![sid, w.keep_from as i64, w.replace_from as i64])?;
    let mut insert = tx.prepare_cached(
        "INSERT INTO conversation (session_id, idx, message) VALUES (?1, ?2, ?3)",
    )?;
    for (k, m) in w.messages.iter().enumerate() {
        insert.execute(params![sid, (w.replace_from + k as u64) as i64, m])?;
    }
    drop(insert);
    tx.commit()
}

/// Records a channel request key; false when it was seen within the
/// window (a replay). Forgets keys older than the window.
pub(crate) fn channel_seen(
    conn: &Connection,
    key: &str,
    now_s: i64,
    window_s: i64,
) -> rusqlite::Result<bool> {
    conn.execute(
        "DELETE FROM channel_seen WHERE seen_s < ?1",
        params![now_s - window_s],
    )?;
    conn.execute(
        "INSERT OR IGNORE INTO channel_seen (key, seen_s) VALUES (?1, ?2)",
        params![key, now_s],
    )
    .map(|n| n == 1)
}

/// Forgets a channel request key recorded at `seen_s` (its request was not
/// admitted: the sender's retry is no replay).
pub(crate) fn channel_unseen(conn: &Connection, key: &str, seen_s: i64) -> rusqlite::Result<()> {
    conn.execute(
        "DELETE FROM channel_seen WHERE key = ?1 AND seen_s = ?2",
        params![key, seen_s],
    )
    .map(drop)
}
