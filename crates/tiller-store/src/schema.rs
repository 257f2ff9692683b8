//! The schema, its migrations, and the database file's permissions.

use std::path::Path;

use rusqlite::Connection;

/// The database and its WAL and shared-memory files are the owner's only
/// (0600): they hold every prompt and answer. SQLite creates the `-wal`
/// and `-shm` files with the database file's mode, so creating that one
/// 0600 first covers them; files left by an older version are tightened.
pub(crate) fn restrict(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    // Created when missing, and never opened here when it exists: closing
    // a descriptor of a file would let go of every lock this process holds
    // on it (POSIX), a store's of this process included.
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        // A link to a file not there yet: made through the link, as
        // SQLite would (no lock is held on a file that does not exist).
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && !path.exists() => {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)?;
        }
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        match std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

pub(crate) const SCHEMA: &[&str] = &[
    // v1
    "CREATE TABLE sessions (
        n INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        cwd TEXT NOT NULL,
        title TEXT,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL,
        closed INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE events (
        session_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        ts_ms INTEGER NOT NULL,
        kind TEXT NOT NULL,
        prompt_id TEXT,
        turn_id INTEGER,
        data TEXT NOT NULL,
        PRIMARY KEY (session_id, seq)
    ) WITHOUT ROWID;",
    // v2: the prompt ledger (admitted -> settled), for start-up reconciliation.
    "CREATE TABLE prompts (
        prompt_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        origin TEXT NOT NULL,
        admitted_ms INTEGER NOT NULL,
        settled_ms INTEGER
    );
    CREATE INDEX prompts_unsettled ON prompts (admitted_ms) WHERE settled_ms IS NULL;",
    // v3: background notifications waiting for their session to be idle.
    "CREATE TABLE notifications (
        n INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        text TEXT NOT NULL,
        created_ms INTEGER NOT NULL,
        UNIQUE (session_id, task_id)
    );",
    // v4: cron jobs and their waiting fires (one per job at most).
    "CREATE TABLE cron_jobs (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        schedule TEXT NOT NULL,
        tz TEXT NOT NULL,
        prompt TEXT NOT NULL,
        next_fire_ms INTEGER NOT NULL,
        created_ms INTEGER NOT NULL
    );
    CREATE TABLE cron_fires (
        n INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL,
        prompt TEXT NOT NULL,
        fired_ms INTEGER NOT NULL
    );",
    // v5: one goal per session.
    "CREATE TABLE goals (
        session_id TEXT PRIMARY KEY,
        objective TEXT NOT NULL,
        max_turns INTEGER NOT NULL,
        turns_done INTEGER NOT NULL,
        status TEXT NOT NULL,
        pause_reason TEXT,
        loop_stops INTEGER NOT NULL
    );",
    // v6: webhook deliveries of final turn text, with retries.
    "CREATE TABLE deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        url TEXT NOT NULL,
        session_id TEXT NOT NULL,
        prompt_id TEXT NOT NULL,
        text TEXT NOT NULL,
        stop_reason TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        next_at_ms INTEGER NOT NULL
    );",
    // v7: channel requests seen within the replay window.
    "CREATE TABLE channel_seen (key TEXT PRIMARY KEY, seen_s INTEGER NOT NULL);",
    // v8: per-session engine, settings and model conversation.
    "CREATE TABLE session_state (
        session_id TEXT PRIMARY KEY,
        engine TEXT,
        settings TEXT,
        conversation TEXT
    );",
    // v9: the channel that created a session.
    "ALTER TABLE sessions ADD COLUMN channel TEXT;",
    // v10: the model conversation one row per message (a turn appends its
    // messages instead of rewriting the whole conversation).
    "CREATE TABLE conversation (
        session_id TEXT NOT NULL,
        idx INTEGER NOT NULL,
        message TEXT NOT NULL,
        PRIMARY KEY (session_id, idx)
    ) WITHOUT ROWID;
    INSERT INTO conversation (session_id, idx, message)
        SELECT s.session_id,
               row_number() OVER (PARTITION BY s.session_id ORDER BY j.key) - 1,
               j.value
        FROM session_state s,
             json_each(CASE WHEN json_valid(s.conversation)
                             AND json_type(s.conversation) = 'array'
                            THEN s.conversation ELSE '[]' END) j
        WHERE s.conversation IS NOT NULL AND j.type = 'object';
    UPDATE session_state SET conversation = NULL;",
    // v11: the prompt ledger keeps only prompts not yet settled (a
    // settlement deletes its row), so admitting and settling touch one
    // small table and no partial index.
    "CREATE TABLE prompts_in_flight (
        prompt_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        origin TEXT NOT NULL,
        admitted_ms INTEGER NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO prompts_in_flight (prompt_id, session_id, origin, admitted_ms)
        SELECT prompt_id, session_id, origin, admitted_ms FROM prompts WHERE settled_ms IS NULL;
    DROP TABLE prompts;
    ALTER TABLE prompts_in_flight RENAME TO prompts;",
];

/// Migrations after [`SCHEMA`]'s, written in Rust (each runs in its
/// version's transaction).
pub(crate) const RUST_MIGRATIONS: &[fn(&Connection) -> rusqlite::Result<()>] =
    &[log_segments, crate::index::migrate];

/// v12: the event log in segments (one row per commit and session, see
/// [`crate::segment`]) instead of one row per event. The rows are in
/// insertion order (an append goes to the end of the table); the index on
/// `(session_id, first_seq)` finds a session's segments. Every old event
/// becomes part of a segment, in order.
fn log_segments(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE log (
            n INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL,
            first_seq INTEGER NOT NULL,
            last_seq INTEGER NOT NULL,
            last_ts_ms INTEGER NOT NULL,
            max_turn INTEGER,
            kinds INTEGER NOT NULL,
            body BLOB NOT NULL
        );
        CREATE UNIQUE INDEX log_session ON log (session_id, first_seq);",
    )?;
    {
        let mut read = conn.prepare(
            "SELECT session_id, seq, ts_ms, kind, prompt_id, turn_id, data FROM events
             ORDER BY session_id, seq",
        )?;
        let mut rows = read.query([])?;
        let mut run: Vec<crate::StoredEvent> = Vec::new();
        // The events come in order, by session: a run continues the
        // previous one's log when it is the same session's.
        let mut last: Option<(tiller_core::SessionId, u64)> = None;
        let mut flush = |run: &mut Vec<crate::StoredEvent>| -> rusqlite::Result<()> {
            if let Some(first) = run.first() {
                let head = match last {
                    Some((s, h)) if s == first.session => h,
                    _ => 0,
                };
                let (l, _) =
                    crate::log::insert_events(conn, first.session, head, run.iter(), None)?;
                last = Some((first.session, l));
            }
            run.clear();
            Ok(())
        };
        while let Some(r) = rows.next()? {
            let session: String = r.get(0)?;
            let Some(session) = tiller_core::SessionId::parse(&session) else {
                continue; // not a session id this version can name
            };
            let prompt: Option<String> = r.get(4)?;
            let turn: Option<i64> = r.get(5)?;
            if run.first().is_some_and(|f| f.session != session) || run.len() >= 4096 {
                flush(&mut run)?;
            }
            run.push(crate::StoredEvent {
                session,
                seq: r.get::<_, i64>(1)? as u64,
                ts_ms: r.get(2)?,
                kind: r.get(3)?,
                prompt: prompt.as_deref().and_then(tiller_core::PromptId::parse),
                turn: turn.map(|t| tiller_core::TurnId(t as u64)),
                data: r.get(6)?,
            });
        }
        flush(&mut run)?;
    }
    conn.execute_batch("DROP TABLE events;")
}

/// The schema version this binary writes: the number of migrations.
pub(crate) fn latest() -> i64 {
    (SCHEMA.len() + RUST_MIGRATIONS.len()) as i64
}

/// A database's schema version (0 for a new file).
pub(crate) fn version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.pragma_query_value(None, "user_version", |r| r.get(0))
}

pub(crate) fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    // One process owns the store: opened on the `unix-excl` VFS (see
    // `crate::checkpoint`), its first read takes the file's lock for the
    // process and keeps it (a second daemon on the same file fails at
    // start instead of settling the first one's prompts as "restarted"),
    // and no transaction pays for file locks or a shared-memory index.
    conn.busy_timeout(crate::checkpoint::BUSY_WAIT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // WAL + NORMAL: a commit survives a process crash (kill -9); the last
    // commits may be lost on power failure. See ARCHITECTURE.md.
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.execute_batch("BEGIN EXCLUSIVE; COMMIT;")?;
    let version = version(conn)?;
    for (i, sql) in SCHEMA.iter().enumerate().skip(version as usize) {
        let tx = conn.unchecked_transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", i as i64 + 1)?;
        tx.commit()?;
    }
    let done = (version as usize).max(SCHEMA.len());
    for (i, step) in RUST_MIGRATIONS.iter().enumerate().skip(done - SCHEMA.len()) {
        let tx = conn.unchecked_transaction()?;
        step(&tx)?;
        tx.pragma_update(None, "user_version", (SCHEMA.len() + i) as i64 + 1)?;
        tx.commit()?;
    }
    if version > latest() {
        return Ok(()); // a newer version's file: refused by the caller, no row changed
    }
    let tx = conn.unchecked_transaction()?;
    tx.execute_batch(&crate::sessions::sweep_closed())?;
    tx.commit()
}
