//! The automatic work queues: background notifications, cron jobs and
//! their waiting fires, goals. Reading a queue never changes it: queued
//! work leaves its queue only when the prompt that runs it is committed
//! (see [`crate::Claim`]).

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::SessionId;

use crate::{CronFire, CronJob, GoalRow, Notification};

/// Writes what the notification core decided, in one transaction. The
/// session it is for, when it was deleted or closed meanwhile (nothing written: a
/// notification would outlive it).
pub(crate) fn notification_changes(
    conn: &mut Connection,
    changes: &[tiller_core::notify::Change],
) -> rusqlite::Result<Option<SessionId>> {
    use tiller_core::notify::Change;
    let tx = conn.transaction()?;
    for c in changes {
        match c {
            // A replaced row may be gone (run meanwhile): queued again.
            Change::Insert { session, item } | Change::Replace { session, item } => {
                let n = tx.execute(
                    "INSERT INTO notifications (n, session_id, task_id, text, created_ms)
                     SELECT ?1, ?2, ?3, ?4, ?5
                     WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?2 AND closed = 0)
                     ON CONFLICT (session_id, task_id) DO UPDATE SET text = excluded.text",
                    params![
                        item.id,
                        session.to_string(),
                        item.task_id,
                        item.text,
                        item.created_ms
                    ],
                )?;
                if n == 0 {
                    return Ok(Some(*session)); // rolled back
                }
            }
            Change::Evict { id } => {
                tx.execute("DELETE FROM notifications WHERE n = ?1", params![id])?;
            }
        }
    }
    tx.commit().map(|()| None)
}

/// Every queued notification (the core is rebuilt from them at start),
/// or `only` one session's.
pub(crate) fn notifications(
    conn: &Connection,
    only: Option<SessionId>,
) -> rusqlite::Result<Vec<Notification>> {
    queue_rows(
        conn,
        "SELECT n, session_id, task_id, text, created_ms FROM notifications
         WHERE ?1 IS NULL OR session_id = ?1 ORDER BY n",
        only,
        |id, session, task_id, text, created_ms| Notification {
            id,
            session,
            task_id,
            text,
            created_ms,
        },
    )
}

/// The rows of a queue table, oldest first: its position, the session
/// (rows of a session id that does not parse are skipped), two texts and a
/// time, in that column order.
fn queue_rows<T>(
    conn: &Connection,
    sql: &str,
    only: Option<SessionId>,
    make: impl Fn(i64, SessionId, String, String, i64) -> T,
) -> rusqlite::Result<Vec<T>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map([only.map(|s| s.to_string())], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?,
            r.get::<_, i64>(4)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (id, sid, a, b, ms) = row?;
        if let Some(session) = SessionId::parse(&sid) {
            out.push(make(id, session, a, b, ms));
        }
    }
    Ok(out)
}

pub(crate) fn cron_list(conn: &Connection) -> rusqlite::Result<Vec<CronJob>> {
    let mut stmt = conn.prepare(
        "SELECT id, session_id, schedule, tz, prompt, next_fire_ms, created_ms FROM cron_jobs ORDER BY created_ms, id",
    )?;
    let rows = stmt.query_map([], |r| {
        let s: String = r.get(1)?;
        Ok((
            s,
            CronJob {
                id: r.get(0)?,
                session: SessionId::from_u128(0),
                schedule: r.get(2)?,
                tz: r.get(3)?,
                prompt: r.get(4)?,
                next_fire_ms: r.get(5)?,
                created_ms: r.get(6)?,
            },
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (s, mut job) = row?;
        if let Some(id) = SessionId::parse(&s) {
            job.session = id;
            out.push(job);
        }
    }
    Ok(out)
}

/// Stores what the cron core decided for a fire, and moves the job from
/// its due time `from` to `to`, in one transaction. `Ok(false)`, nothing
/// written: the job was no longer due at `from` (another node fired it).
pub(crate) fn cron_fire(
    conn: &mut Connection,
    change: &tiller_core::cron::FireChange,
    job_id: &str,
    (from, to): (i64, i64),
) -> rusqlite::Result<bool> {
    use tiller_core::cron::FireChange;
    let tx = conn.transaction()?;
    let moved = tx.execute(
        "UPDATE cron_jobs SET next_fire_ms = ?2 WHERE id = ?1 AND next_fire_ms = ?3",
        params![job_id, to, from],
    )?;
    if moved != 1 {
        return Ok(false);
    }
    // A refreshed fire may be gone (run meanwhile): it waits again.
    let (FireChange::Insert { session, fire } | FireChange::Refresh { session, fire }) = change;
    tx.execute(
        "INSERT INTO cron_fires (n, job_id, session_id, prompt, fired_ms) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (job_id) DO UPDATE SET prompt = excluded.prompt, fired_ms = excluded.fired_ms",
        params![fire.id, fire.job_id, session.to_string(), fire.prompt, fire.fired_ms],
    )?;
    tx.commit()?;
    Ok(true)
}

/// Every waiting fire (the cron core is rebuilt from them at start).
pub(crate) fn cron_fires(
    conn: &Connection,
    only: Option<SessionId>,
) -> rusqlite::Result<Vec<CronFire>> {
    queue_rows(
        conn,
        "SELECT n, session_id, job_id, prompt, fired_ms FROM cron_fires
         WHERE ?1 IS NULL OR session_id = ?1 ORDER BY n",
        only,
        |id, session, job_id, prompt, fired_ms| CronFire {
            id,
            job_id,
            session,
            prompt,
            fired_ms,
        },
    )
}

/// Adds a job for a session that is still open (false, nothing written,
/// when it was deleted or closed meanwhile: a job would outlive it).
pub(crate) fn cron_add(conn: &Connection, j: &CronJob) -> rusqlite::Result<bool> {
    conn.execute(
        "INSERT INTO cron_jobs (id, session_id, schedule, tz, prompt, next_fire_ms, created_ms)
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7
         WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?2 AND closed = 0)",
        params![
            j.id,
            j.session.to_string(),
            j.schedule,
            j.tz,
            j.prompt,
            j.next_fire_ms,
            j.created_ms
        ],
    )
    .map(|n| n == 1)
}

/// Removes a job and its waiting fire; false when there was no job.
pub(crate) fn cron_remove(conn: &mut Connection, id: &str) -> rusqlite::Result<bool> {
    let tx = conn.transaction()?;
    tx.execute("DELETE FROM cron_fires WHERE job_id = ?1", params![id])?;
    let n = tx.execute("DELETE FROM cron_jobs WHERE id = ?1", params![id])?;
    tx.commit()?;
    Ok(n > 0)
}

/// Sessions with waiting cron fires (the same SQL on both backends).
pub(crate) const CRON_BACKLOG: &str = "SELECT DISTINCT session_id FROM cron_fires";

/// Sessions whose goal is active (the same SQL on both backends).
pub(crate) const GOALS_ACTIVE: &str = "SELECT session_id FROM goals WHERE status = 'active'";

/// The session ids a one-column query returns.
pub(crate) fn session_ids(conn: &Connection, sql: &str) -> rusqlite::Result<Vec<SessionId>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    Ok(rows
        .filter_map(|s| s.ok().and_then(|s| SessionId::parse(&s)))
        .collect())
}

pub(crate) fn notification_backlog(conn: &Connection) -> rusqlite::Result<(Vec<SessionId>, usize)> {
    let sessions = session_ids(conn, "SELECT DISTINCT session_id FROM notifications")?;
    let total: i64 = conn.query_row("SELECT COUNT(*) FROM notifications", [], |r| r.get(0))?;
    Ok((sessions, total as usize))
}

pub(crate) fn goal_get(conn: &Connection, session: SessionId) -> rusqlite::Result<Option<GoalRow>> {
    conn.query_row(
        "SELECT objective, max_turns, turns_done, status, pause_reason, loop_stops
         FROM goals WHERE session_id = ?1",
        params![session.to_string()],
        |r| {
            Ok(GoalRow {
                session,
                objective: r.get(0)?,
                max_turns: r.get(1)?,
                turns_done: r.get(2)?,
                status: r.get(3)?,
                pause_reason: r.get(4)?,
                loop_stops: r.get(5)?,
            })
        },
    )
    .optional()
}

/// Stores a goal for a session that is still open (false, nothing
/// written, when it was deleted or closed meanwhile: a goal would outlive it).
pub(crate) fn goal_put(conn: &Connection, g: &GoalRow) -> rusqlite::Result<bool> {
    conn.execute(
        "INSERT OR REPLACE INTO goals
         (session_id, objective, max_turns, turns_done, status, pause_reason, loop_stops)
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7
         WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?1 AND closed = 0)",
        params![
            g.session.to_string(),
            g.objective,
            g.max_turns,
            g.turns_done,
            g.status,
            g.pause_reason,
            g.loop_stops
        ],
    )
    .map(|n| n == 1)
}

pub(crate) fn goal_delete(conn: &Connection, session: SessionId) -> rusqlite::Result<bool> {
    conn.execute(
        "DELETE FROM goals WHERE session_id = ?1",
        params![session.to_string()],
    )
    .map(|n| n > 0)
}
