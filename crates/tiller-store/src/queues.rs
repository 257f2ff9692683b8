//! The automatic work queues: background notifications, cron jobs and
//! their waiting fires, goals. Reading a queue never changes it: queued
//! work leaves its queue only when the prompt that runs it is committed
//! (see [`crate::Claim`]).

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::SessionId;

use crate::{CronFire, CronJob, Enqueued, GoalRow, Notification};

pub(crate) fn enqueue(
    conn: &mut Connection,
    session: SessionId,
    task_id: &str,
    text: &str,
    now_ms: i64,
    cap: usize,
) -> rusqlite::Result<Enqueued> {
    let tx = conn.transaction()?;
    let sid = session.to_string();
    let updated = tx.execute(
        "UPDATE notifications SET text = ?3 WHERE session_id = ?1 AND task_id = ?2",
        params![sid, task_id, text],
    )?;
    if updated == 0 {
        tx.execute(
            "INSERT INTO notifications (session_id, task_id, text, created_ms) VALUES (?1, ?2, ?3, ?4)",
            params![sid, task_id, text, now_ms],
        )?;
    }
    let mut evicted = Vec::new();
    {
        let mut over = tx.prepare(
            "SELECT n, task_id FROM notifications WHERE session_id = ?1 ORDER BY n DESC LIMIT -1 OFFSET ?2",
        )?;
        let rows: Vec<(i64, String)> = over
            .query_map(params![sid, cap as i64], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        for (n, task) in rows.into_iter().rev() {
            tx.execute("DELETE FROM notifications WHERE n = ?1", params![n])?;
            evicted.push(task);
        }
    }
    tx.commit()?;
    Ok(Enqueued {
        deduplicated: updated > 0,
        evicted,
    })
}

/// The oldest queued notification of a session (it stays queued).
pub(crate) fn next_notification(
    conn: &Connection,
    session: SessionId,
) -> rusqlite::Result<Option<Notification>> {
    conn.query_row(
        "SELECT n, task_id, text, created_ms FROM notifications
         WHERE session_id = ?1 ORDER BY n LIMIT 1",
        params![session.to_string()],
        |r| {
            Ok(Notification {
                id: r.get(0)?,
                session,
                task_id: r.get(1)?,
                text: r.get(2)?,
                created_ms: r.get(3)?,
            })
        },
    )
    .optional()
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

pub(crate) fn cron_fire(
    conn: &mut Connection,
    job: &CronJob,
    fired_ms: i64,
    next_fire_ms: i64,
) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    // At most one waiting fire per job: a newer fire refreshes the waiting one.
    tx.execute(
        "INSERT INTO cron_fires (job_id, session_id, prompt, fired_ms) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(job_id) DO UPDATE SET fired_ms = excluded.fired_ms, prompt = excluded.prompt",
        params![job.id, job.session.to_string(), job.prompt, fired_ms],
    )?;
    tx.execute(
        "UPDATE cron_jobs SET next_fire_ms = ?2 WHERE id = ?1",
        params![job.id, next_fire_ms],
    )?;
    tx.commit()
}

pub(crate) fn cron_add(conn: &Connection, j: &CronJob) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT INTO cron_jobs (id, session_id, schedule, tz, prompt, next_fire_ms, created_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
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
    .map(drop)
}

/// Removes a job and its waiting fire; false when there was no job.
pub(crate) fn cron_remove(conn: &mut Connection, id: &str) -> rusqlite::Result<bool> {
    let tx = conn.transaction()?;
    tx.execute("DELETE FROM cron_fires WHERE job_id = ?1", params![id])?;
    let n = tx.execute("DELETE FROM cron_jobs WHERE id = ?1", params![id])?;
    tx.commit()?;
    Ok(n > 0)
}

/// The oldest waiting fire of a session (it stays queued).
pub(crate) fn next_cron_fire(
    conn: &Connection,
    session: SessionId,
) -> rusqlite::Result<Option<CronFire>> {
    conn.query_row(
        "SELECT n, job_id, prompt, fired_ms FROM cron_fires WHERE session_id = ?1 ORDER BY n LIMIT 1",
        params![session.to_string()],
        |r| {
            Ok(CronFire {
                id: r.get(0)?,
                job_id: r.get(1)?,
                session,
                prompt: r.get(2)?,
                fired_ms: r.get(3)?,
            })
        },
    )
    .optional()
}

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

pub(crate) fn goal_put(conn: &Connection, g: &GoalRow) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT OR REPLACE INTO goals
         (session_id, objective, max_turns, turns_done, status, pause_reason, loop_stops)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
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
    .map(drop)
}

pub(crate) fn goal_delete(conn: &Connection, session: SessionId) -> rusqlite::Result<bool> {
    conn.execute(
        "DELETE FROM goals WHERE session_id = ?1",
        params![session.to_string()],
    )
    .map(|n| n > 0)
}
