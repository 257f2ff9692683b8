//! Webhook deliveries of a turn's final text, with their retries. A
//! delivery is added in the transaction of its turn's terminal.

use rusqlite::{Connection, params};
use tiller_core::{PromptId, SessionId};

use crate::Delivery;

pub(crate) fn add(conn: &Connection, d: &Delivery) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT INTO deliveries (url, session_id, prompt_id, text, stop_reason, attempts, next_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![d.url, d.session.to_string(), d.prompt.to_string(), d.text, d.stop_reason, d.attempts, d.next_at_ms],
    )
    .map(drop)
}

/// Deliveries due at `now`, oldest first (rows this version cannot read
/// are skipped).
pub(crate) fn due(conn: &Connection, now: i64) -> rusqlite::Result<Vec<Delivery>> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, url, session_id, prompt_id, text, stop_reason, attempts, next_at_ms
         FROM deliveries WHERE next_at_ms <= ?1 ORDER BY id LIMIT 100",
    )?;
    let rows = stmt.query_map(params![now], |r| {
        let sid: String = r.get(2)?;
        let pid: String = r.get(3)?;
        Ok((
            SessionId::parse(&sid),
            PromptId::parse(&pid),
            (
                r.get(0)?,
                r.get(1)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
            ),
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        if let (Some(session), Some(prompt), (id, url, text, stop_reason, attempts, next_at_ms)) =
            row?
        {
            out.push(Delivery {
                id,
                url,
                session,
                prompt,
                text,
                stop_reason,
                attempts,
                next_at_ms,
            });
        }
    }
    Ok(out)
}

/// Sent or given up (`retry = None`: deleted), or retried at a time.
pub(crate) fn done(conn: &Connection, id: i64, retry: Option<(i64, u32)>) -> rusqlite::Result<()> {
    match retry {
        None => conn.execute("DELETE FROM deliveries WHERE id = ?1", params![id]),
        Some((next, attempts)) => conn.execute(
            "UPDATE deliveries SET next_at_ms = ?2, attempts = ?3 WHERE id = ?1",
            params![id, next, attempts],
        ),
    }
    .map(drop)
}

/// Holds delivery `id` until `until` while its row still says `held` (as
/// taken); false when another node took it since, or it is gone.
pub(crate) fn start(conn: &Connection, id: i64, held: i64, until: i64) -> rusqlite::Result<bool> {
    conn.execute(
        "UPDATE deliveries SET next_at_ms = ?3 WHERE id = ?1 AND next_at_ms = ?2",
        params![id, held, until],
    )
    .map(|n| n == 1)
}
