//! The PostgreSQL backend: the same tables and rules as SQLite's (the log
//! in the same segments, the ledger in the same transaction as the events
//! it rides on), over the synchronous `postgres` client on the store
//! thread. Every statement is prepared once per connection; a dropped
//! connection is made again on the next command (what failed meanwhile
//! was an error to its caller, never a silent success).

use std::collections::HashMap;

use postgres::types::ToSql;
use postgres::{Client, GenericClient, NoTls, Statement};
use tiller_core::{PromptId, SessionId};

use crate::db::Db;
use crate::log::Heads;
use crate::writer::Pending;
use crate::{
    Claim, ConversationWrite, CronFire, CronJob, Delivery, GoalRow, HistoryPage, Lease, LedgerOp,
    LogHead, NodeInfo, NodeStatus, Notification, SessionExtras, SessionPage, SessionRecord,
    StateColumn, StoreError, StoredConversation, StoredEvent, Unsettled, segment,
};

type R<T> = Result<T, StoreError>;

/// The schema, version by version (`tiller_schema` holds how many ran).
const MIGRATIONS: &[&str] = &[
    "CREATE TABLE sessions (
        n BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        cwd TEXT NOT NULL,
        title TEXT,
        created_ms BIGINT NOT NULL,
        updated_ms BIGINT NOT NULL,
        closed BOOLEAN NOT NULL DEFAULT false,
        channel TEXT
    );
    CREATE TABLE log (
        session_id TEXT NOT NULL,
        first_seq BIGINT NOT NULL,
        last_seq BIGINT NOT NULL,
        last_ts_ms BIGINT NOT NULL,
        max_turn BIGINT,
        kinds BIGINT NOT NULL,
        body BYTEA NOT NULL,
        PRIMARY KEY (session_id, first_seq)
    );
    CREATE TABLE prompts (
        prompt_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        origin TEXT NOT NULL,
        admitted_ms BIGINT NOT NULL
    );
    CREATE TABLE notifications (
        n BIGINT PRIMARY KEY,
        session_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        text TEXT NOT NULL,
        created_ms BIGINT NOT NULL,
        UNIQUE (session_id, task_id)
    );
    CREATE TABLE cron_jobs (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        schedule TEXT NOT NULL,
        tz TEXT NOT NULL,
        prompt TEXT NOT NULL,
        next_fire_ms BIGINT NOT NULL,
        created_ms BIGINT NOT NULL
    );
    CREATE TABLE cron_fires (
        n BIGINT PRIMARY KEY,
        job_id TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL,
        prompt TEXT NOT NULL,
        fired_ms BIGINT NOT NULL
    );
    CREATE TABLE goals (
        session_id TEXT PRIMARY KEY,
        objective TEXT NOT NULL,
        max_turns BIGINT NOT NULL,
        turns_done BIGINT NOT NULL,
        status TEXT NOT NULL,
        pause_reason TEXT,
        loop_stops BIGINT NOT NULL
    );
    CREATE TABLE deliveries (
        id BIGSERIAL PRIMARY KEY,
        url TEXT NOT NULL,
        session_id TEXT NOT NULL,
        prompt_id TEXT NOT NULL,
        text TEXT NOT NULL,
        stop_reason TEXT NOT NULL,
        attempts BIGINT NOT NULL,
        next_at_ms BIGINT NOT NULL
    );
    CREATE TABLE channel_seen (key TEXT PRIMARY KEY, seen_s BIGINT NOT NULL);
    CREATE TABLE session_state (session_id TEXT PRIMARY KEY, engine TEXT, settings TEXT);
    CREATE TABLE conversation (
        session_id TEXT NOT NULL,
        idx BIGINT NOT NULL,
        message TEXT NOT NULL,
        PRIMARY KEY (session_id, idx)
    );",
    // Clustering: the nodes sharing the schema and who owns each session.
    // A lease row is never deleted: its fence only grows, so a node that
    // lost a lease can never write with a counter someone reuses.
    "CREATE TABLE nodes (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        started_ms BIGINT NOT NULL,
        heartbeat_ms BIGINT NOT NULL
    );
    CREATE TABLE leases (
        session_id TEXT PRIMARY KEY,
        node_id TEXT NOT NULL,
        fence BIGINT NOT NULL,
        expires_ms BIGINT NOT NULL,
        previous TEXT
    );
    CREATE INDEX leases_node ON leases (node_id);",
    // Queue ids are handed out by the store: nodes never reuse each other's.
    "CREATE SEQUENCE notification_ids;
    SELECT setval('notification_ids', COALESCE((SELECT max(n) FROM notifications), 0) + 1, false);
    CREATE SEQUENCE cron_fire_ids;
    SELECT setval('cron_fire_ids', COALESCE((SELECT max(n) FROM cron_fires), 0) + 1, false);",
];

/// The store server's clock in ms: leases are timed by one clock, never
/// by the nodes' own.
macro_rules! now_ms {
    () => {
        "(extract(epoch from clock_timestamp()) * 1000)::bigint"
    };
}
const NOW_MS: &str = now_ms!();

/// Whether `s` may name a schema (it is put in SQL as is).
pub(crate) fn valid_schema(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 63
}

/// A connection to the database, made again when it drops.
pub(crate) struct PgDb {
    url: String,
    schema: String,
    client: Client,
    stmts: HashMap<&'static str, Statement>,
    /// Set when the connection was made again (see `Db::take_reconnected`).
    reconnected: bool,
    /// The leases this node holds, by session, with their fences: an
    /// append for a session whose lease row has another fence is refused.
    held: HashMap<String, i64>,
}

impl PgDb {
    /// `write` in a transaction whose session's lease this node still
    /// holds (see [`check_fence`]), committed if it succeeds.
    fn fenced(
        &mut self,
        id: SessionId,
        write: impl FnOnce(
            &mut postgres::Transaction<'_>,
            &mut HashMap<&'static str, Statement>,
        ) -> R<()>,
    ) -> R<()> {
        self.client()?;
        let PgDb {
            client,
            stmts,
            held,
            ..
        } = self;
        let mut tx = client.transaction()?;
        check_fence(&mut tx, stmts, held, id)?;
        write(&mut tx, stmts)?;
        tx.commit()?;
        Ok(())
    }

    /// `sql` (`$1` the session, `$2` the value), [`fenced`](Self::fenced).
    fn fenced_update(
        &mut self,
        id: SessionId,
        sql: &'static str,
        value: impl ToSql + Sync,
    ) -> R<()> {
        self.fenced(id, |tx, stmts| {
            let q = prep(tx, stmts, sql)?;
            tx.execute(&q, &[&id.to_string(), &value])?;
            Ok(())
        })
    }

    /// Connects, creates the schema if needed and migrates it (under an
    /// advisory lock: nodes starting together migrate once).
    pub(crate) fn connect(url: &str, schema: &str) -> R<PgDb> {
        if !valid_schema(schema) {
            return Err(StoreError::Config(format!(
                "`{schema}` is not a valid schema name (lower-case letters, digits, _)"
            )));
        }
        let client = open(url, schema)?;
        let mut db = PgDb {
            url: url.to_owned(),
            schema: schema.to_owned(),
            client,
            stmts: HashMap::new(),
            reconnected: false,
            held: HashMap::new(),
        };
        db.migrate()?;
        Ok(db)
    }

    fn migrate(&mut self) -> R<()> {
        let mut tx = self.client.transaction()?;
        tx.batch_execute(
            "SELECT pg_advisory_xact_lock(7239118431);
             CREATE TABLE IF NOT EXISTS tiller_schema (version BIGINT NOT NULL);",
        )?;
        let have: i64 = match tx.query_opt("SELECT version FROM tiller_schema", &[])? {
            Some(row) => row.get(0),
            None => {
                tx.execute("INSERT INTO tiller_schema (version) VALUES (0)", &[])?;
                0
            }
        };
        if have as usize > MIGRATIONS.len() {
            return Err(StoreError::Config(format!(
                "the database's schema is version {have}, newer than this Tiller's {}: upgrade Tiller",
                MIGRATIONS.len()
            )));
        }
        for m in &MIGRATIONS[have as usize..] {
            tx.batch_execute(m)?;
        }
        tx.batch_execute(&crate::sessions::sweep_closed())?;
        tx.execute(
            "UPDATE tiller_schema SET version = $1",
            &[&(MIGRATIONS.len() as i64)],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// The live connection, made again if it dropped.
    fn client(&mut self) -> R<&mut Client> {
        if self.client.is_closed() {
            self.client = open(&self.url, &self.schema)?;
            self.stmts.clear();
            self.reconnected = true;
        }
        Ok(&mut self.client)
    }
}

/// How long a transaction may sit idle (its client stalled) before the
/// server ends it and releases its locks: well under any lease.
const STALL_BOUND_MS: u64 = 1_500;
/// The longest a statement waits for a lock (a stalled holder's is
/// released after `STALL_BOUND_MS`).
const LOCK_BOUND_MS: u64 = 10_000;

/// Connects and selects the schema. Several daemons (nodes) may share
/// it: who writes a session's log is decided by its lease (see
/// `acquire_lease`), not by the connection.
pub(crate) fn open(url: &str, schema: &str) -> R<Client> {
    let mut cfg: postgres::Config = url.parse()?;
    // A server that vanished (no FIN) must not hold the store thread for
    // the kernel's retransmission limit: bounded connects, keepalives.
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(std::time::Duration::from_secs(10));
    }
    if cfg.get_tcp_user_timeout().is_none() {
        cfg.tcp_user_timeout(std::time::Duration::from_secs(30));
    }
    cfg.keepalives(true);
    if cfg.get_keepalives_idle() > std::time::Duration::from_secs(30) {
        cfg.keepalives_idle(std::time::Duration::from_secs(30));
    }
    let mut client = cfg.connect(NoTls).map_err(StoreError::Pg)?;
    // A node that stalls inside a transaction (paused, or cut off) would
    // hold the locks its write took (a lease row's, see `check_fence`)
    // and freeze every node that takes a lease: the server ends such a
    // transaction after a moment (this store never waits on anything
    // else inside one), and no statement waits on a lock for long.
    client.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema}; SET search_path TO {schema};
         SET idle_in_transaction_session_timeout = {STALL_BOUND_MS};
         SET lock_timeout = {LOCK_BOUND_MS};"
    ))?;
    Ok(client)
}

/// Refuses a write for `session` if its lease row names a fence this node
/// does not hold (a newer owner took it over). The row stays share-locked
/// until the transaction ends, so a takeover waits for this write and
/// then sees it. A session without a lease row (one daemon, or a store
/// used without a cluster) is anyone's, unless this node held it: then
/// the row went with the session, deleted by the node that took it over.
fn check_fence(
    tx: &mut impl GenericClient,
    stmts: &mut HashMap<&'static str, Statement>,
    held: &HashMap<String, i64>,
    session: SessionId,
) -> R<()> {
    let q = prep(
        tx,
        stmts,
        "SELECT fence FROM leases WHERE session_id = $1 FOR SHARE",
    )?;
    let id = session.to_string();
    match (tx.query_opt(&q, &[&id])?, held.contains_key(&id)) {
        (Some(row), _) if held.get(&id) != Some(&row.get::<_, i64>(0)) => {
            Err(StoreError::Fenced(session))
        }
        // Held here, and its row went with the session (deleted by the
        // node that took it over).
        (None, true) => Err(StoreError::Fenced(session)),
        _ => Ok(()),
    }
}

/// A statement prepared once per connection.
fn prep(
    c: &mut impl GenericClient,
    stmts: &mut HashMap<&'static str, Statement>,
    sql: &'static str,
) -> R<Statement> {
    if let Some(s) = stmts.get(sql) {
        return Ok(s.clone());
    }
    let s = c.prepare(sql)?;
    stmts.insert(sql, s.clone());
    Ok(s)
}

fn corrupt(e: segment::Corrupt) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn sid(s: &str) -> R<SessionId> {
    SessionId::parse(s).ok_or_else(|| StoreError::Corrupt(format!("a stored session id `{s}`")))
}

fn head_seq(
    c: &mut impl GenericClient,
    st: &mut HashMap<&'static str, Statement>,
    id: &str,
) -> R<u64> {
    let q = prep(
        c,
        st,
        "SELECT last_seq FROM log WHERE session_id = $1 ORDER BY first_seq DESC LIMIT 1",
    )?;
    Ok(c.query_opt(&q, &[&id])?
        .map_or(0, |r| r.get::<_, i64>(0) as u64))
}

const UPDATED: &str = "COALESCE((SELECT last_ts_ms FROM log l WHERE l.session_id = sessions.id
    ORDER BY l.first_seq DESC LIMIT 1), updated_ms)";

fn session_row(r: &postgres::Row) -> R<SessionRecord> {
    Ok(SessionRecord {
        id: sid(r.get("id"))?,
        cwd: r.get("cwd"),
        title: r.get("title"),
        created_ms: r.get("created_ms"),
        updated_ms: r.get("updated_ms"),
        closed: r.get("closed"),
        channel: r.get("channel"),
    })
}

fn ids(rows: Vec<postgres::Row>) -> Vec<SessionId> {
    rows.iter()
        .filter_map(|r| SessionId::parse(r.get::<_, &str>(0)))
        .collect()
}

impl Db for PgDb {
    fn append_batch(&mut self, heads: &mut Heads, batch: &[Pending]) -> R<()> {
        // Never reconnect for an append: what the writer cached may be
        // stale on a new connection. Another command reconnects, and the
        // writer then makes every session reload its log first.
        if self.client.is_closed() {
            return Err(StoreError::Disconnected);
        }
        let PgDb {
            client,
            stmts,
            held,
            ..
        } = self;
        let mut next = Heads::default();
        let done = (|| {
            let mut tx = client.transaction()?;
            let sessions = crate::log::by_session(batch);
            for (s, _) in &sessions {
                check_fence(&mut tx, stmts, held, *s)?;
            }
            let settled = crate::log::settled_in(batch);
            for p in batch {
                let e = &p.event;
                match p.ledger.as_deref() {
                    Some(LedgerOp::Admit {
                        prompt,
                        origin,
                        consumes,
                    }) => {
                        if !settled.contains(prompt) {
                            let q = prep(
                                &mut tx,
                                stmts,
                                "INSERT INTO prompts (prompt_id, session_id, origin, admitted_ms)
                                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                            )?;
                            tx.execute(
                                &q,
                                &[
                                    &prompt.to_string(),
                                    &e.session.to_string(),
                                    origin,
                                    &e.ts_ms,
                                ],
                            )?;
                        }
                        // Exactly one row: another node may have started
                        // the same work (its start committed first).
                        let claimed = match consumes {
                            Some(Claim::Notification(n)) => {
                                tx.execute("DELETE FROM notifications WHERE n = $1", &[n])?
                            }
                            Some(Claim::CronFire(n)) => {
                                tx.execute("DELETE FROM cron_fires WHERE n = $1", &[n])?
                            }
                            None => 1,
                        };
                        if claimed != 1 {
                            return Err(StoreError::AlreadyClaimed);
                        }
                    }
                    Some(LedgerOp::Settle { prompt, delivery }) => {
                        let q = prep(&mut tx, stmts, "DELETE FROM prompts WHERE prompt_id = $1")?;
                        tx.execute(&q, &[&prompt.to_string()])?;
                        if let Some(d) = delivery {
                            add_delivery(&mut tx, d)?;
                        }
                    }
                    None => {}
                }
            }
            for (s, events) in sessions {
                let id = s.to_string();
                let head = match next.cached(s).or_else(|| heads.cached(s)) {
                    Some(h) => h,
                    None => head_seq(&mut tx, stmts, &id)?,
                };
                let last = crate::log::follows(s, head, &events).map_err(StoreError::Corrupt)?;
                let q = prep(
                    &mut tx,
                    stmts,
                    "INSERT INTO log (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )?;
                for seg in segment::split(events.iter().copied()) {
                    let first = seg.first_seq as i64;
                    let last_seq = seg.last_seq as i64;
                    let max_turn = seg.max_turn.map(|t| t as i64);
                    let params: [&(dyn ToSql + Sync); 7] = [
                        &id,
                        &first,
                        &last_seq,
                        &seg.last_ts_ms,
                        &max_turn,
                        &seg.kinds,
                        &seg.body,
                    ];
                    tx.execute(&q, &params)?;
                }
                next.set(s, last);
            }
            tx.commit()?;
            Ok(())
        })();
        match &done {
            Ok(()) => heads.commit(next),
            Err(_) => heads.forget(batch.iter().map(|p| p.event.session)),
        }
        done
    }

    fn head(&mut self, session: SessionId) -> R<LogHead> {
        self.client()?;
        let PgDb { client, stmts, .. } = self;
        let id = session.to_string();
        let q = prep(
            client,
            stmts,
            "SELECT max_turn FROM log WHERE session_id = $1 AND max_turn IS NOT NULL
             ORDER BY first_seq DESC LIMIT 1",
        )?;
        let last_turn = client
            .query_opt(&q, &[&id])?
            .map_or(0, |r| r.get::<_, i64>(0) as u64);
        Ok(LogHead {
            last_seq: head_seq(client, stmts, &id)?,
            last_turn,
        })
    }

    fn create_session(&mut self, rec: &SessionRecord, engine: Option<&str>) -> R<()> {
        let mut tx = self.client()?.transaction()?;
        tx.execute(
            "INSERT INTO sessions (id, cwd, title, created_ms, updated_ms, closed, channel)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &rec.id.to_string(),
                &rec.cwd,
                &rec.title,
                &rec.created_ms,
                &rec.updated_ms,
                &rec.closed,
                &rec.channel,
            ],
        )?;
        if let Some(engine) = engine {
            tx.execute(
                "INSERT INTO session_state (session_id, engine) VALUES ($1, $2)
                 ON CONFLICT (session_id) DO UPDATE SET engine = excluded.engine",
                &[&rec.id.to_string(), &engine],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    fn get_session(&mut self, id: SessionId) -> R<Option<(SessionRecord, LogHead)>> {
        let row = self.client()?.query_opt(
            &format!(
                "SELECT id, cwd, title, created_ms, {UPDATED} AS updated_ms, closed, channel
                 FROM sessions WHERE id = $1"
            ),
            &[&id.to_string()],
        )?;
        let Some(row) = row else { return Ok(None) };
        let rec = session_row(&row)?;
        Ok(Some((rec, self.head(id)?)))
    }

    fn list_sessions(
        &mut self,
        cursor: Option<i64>,
        limit: usize,
        cwd: Option<&str>,
    ) -> R<SessionPage> {
        let rows = self.client()?.query(
            &format!(
                "SELECT n, id, cwd, title, created_ms, {UPDATED} AS updated_ms, closed, channel
                 FROM sessions
                 WHERE NOT closed AND n < $1 AND ($3::TEXT IS NULL OR cwd = $3)
                 ORDER BY n DESC LIMIT $2"
            ),
            &[&cursor.unwrap_or(i64::MAX), &(limit as i64 + 1), &cwd],
        )?;
        let more = rows.len() > limit;
        let mut sessions = Vec::new();
        let mut last_n = None;
        for r in rows.iter().take(limit) {
            last_n = Some(r.get::<_, i64>("n"));
            sessions.push(session_row(r)?);
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

    fn save_state(&mut self, id: SessionId, column: StateColumn, value: &str) -> R<()> {
        let sql = match column {
            StateColumn::Engine => {
                "INSERT INTO session_state (session_id, engine) VALUES ($1, $2)
                 ON CONFLICT (session_id) DO UPDATE SET engine = excluded.engine"
            }
            StateColumn::Settings => {
                "INSERT INTO session_state (session_id, settings) VALUES ($1, $2)
                 ON CONFLICT (session_id) DO UPDATE SET settings = excluded.settings"
            }
        };
        self.fenced_update(id, sql, value)
    }

    fn save_conversation(&mut self, id: SessionId, w: &ConversationWrite) -> R<()> {
        let sid = id.to_string();
        self.fenced(id, |tx, stmts| {
            let del = prep(
                tx,
                stmts,
                "DELETE FROM conversation WHERE session_id = $1 AND (idx < $2 OR idx >= $3)",
            )?;
            tx.execute(
                &del,
                &[&sid, &(w.keep_from as i64), &(w.replace_from as i64)],
            )?;
            let ins = prep(
                tx,
                stmts,
                "INSERT INTO conversation (session_id, idx, message) VALUES ($1, $2, $3)",
            )?;
            for (k, m) in w.messages.iter().enumerate() {
                tx.execute(&ins, &[&sid, &((w.replace_from + k as u64) as i64), m])?;
            }
            Ok(())
        })
    }

    fn load_state(&mut self, id: SessionId) -> R<SessionExtras> {
        let sid = id.to_string();
        let c = self.client()?;
        let (engine, settings) = c
            .query_opt(
                "SELECT engine, settings FROM session_state WHERE session_id = $1",
                &[&sid],
            )?
            .map(|r| (r.get(0), r.get(1)))
            .unwrap_or_default();
        let mut conversation = StoredConversation::default();
        for r in c.query(
            "SELECT idx, message FROM conversation WHERE session_id = $1 ORDER BY idx",
            &[&sid],
        )? {
            if conversation.messages.is_empty() {
                conversation.base = r.get::<_, i64>(0) as u64;
            }
            conversation.messages.push(r.get(1));
        }
        Ok(SessionExtras {
            engine,
            settings,
            conversation,
        })
    }

    fn channel_seen(&mut self, key: &str, now_s: i64, window_s: i64) -> R<bool> {
        let c = self.client()?;
        c.execute(
            "DELETE FROM channel_seen WHERE seen_s < $1",
            &[&(now_s - window_s)],
        )?;
        let n = c.execute(
            "INSERT INTO channel_seen (key, seen_s) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&key, &now_s],
        )?;
        Ok(n == 1)
    }

    fn channel_unseen(&mut self, key: &str, seen_s: i64) -> R<()> {
        self.client()?.execute(
            "DELETE FROM channel_seen WHERE key = $1 AND seen_s = $2",
            &[&key, &seen_s],
        )?;
        Ok(())
    }

    fn set_title(&mut self, id: SessionId, title: Option<&str>) -> R<()> {
        self.fenced_update(id, "UPDATE sessions SET title = $2 WHERE id = $1", title)
    }

    fn close_session(&mut self, id: SessionId) -> R<()> {
        // Its queued automatic work goes with it (see `sessions::close`).
        self.fenced(id, |tx, _| {
            let id = id.to_string();
            tx.execute("UPDATE sessions SET closed = true WHERE id = $1", &[&id])?;
            for table in crate::sessions::QUEUE_TABLES {
                tx.execute(
                    &format!("DELETE FROM {table} WHERE session_id = $1"),
                    &[&id],
                )?;
            }
            Ok(())
        })
    }

    fn delete_session(&mut self, id: SessionId) -> R<bool> {
        let id = id.to_string();
        let mut tx = self.client()?.transaction()?;
        // True when anything of it was there, as for SQLite. Rows are
        // locked in the order every other writer takes them: the lease
        // (a fenced write holds it, then the session's row), then the
        // session's row (a node queueing work for it holds that row, `FOR
        // SHARE`), then its tables. So the deletes after wait for those
        // writers and see what they committed, or the writers find no
        // session; and none deadlocks with the delete.
        let mut removed = tx.execute("DELETE FROM leases WHERE session_id = $1", &[&id])?;
        removed += tx.execute("DELETE FROM sessions WHERE id = $1", &[&id])?;
        for table in crate::sessions::SESSION_TABLES {
            removed += tx.execute(
                &format!("DELETE FROM {table} WHERE session_id = $1"),
                &[&id],
            )?;
        }
        tx.commit()?;
        self.held.remove(&id);
        Ok(removed > 0)
    }

    fn history(&mut self, session: SessionId, before: u64, limit: usize) -> R<HistoryPage> {
        self.client()?;
        let PgDb { client, stmts, .. } = self;
        // Segments hold at most 64 events: enough of them for the page.
        let q = prep(
            client,
            stmts,
            "SELECT body FROM log WHERE session_id = $1 AND first_seq < $2
             ORDER BY first_seq DESC LIMIT $3",
        )?;
        let rows = client.query(
            &q,
            &[&session.to_string(), &(before as i64), &(limit as i64 + 2)],
        )?;
        let mut events = Vec::new();
        for row in rows {
            if events.len() > limit {
                break;
            }
            let seg = segment::decode(session, row.get::<_, &[u8]>(0)).map_err(corrupt)?;
            events.extend(seg.into_iter().rev().filter(|e| e.seq < before));
        }
        let has_more = events.len() > limit;
        events.truncate(limit);
        events.reverse();
        Ok(HistoryPage { events, has_more })
    }

    fn last_of_kinds(&mut self, session: SessionId, kinds: &[&str]) -> R<Option<StoredEvent>> {
        self.client()?;
        let PgDb { client, stmts, .. } = self;
        let mask = kinds.iter().fold(0, |m, k| m | segment::kind_bit(k));
        // Two kinds may share a bit: pages of candidate segments, newest
        // first, until one holds a wanted kind.
        let q = prep(
            client,
            stmts,
            "SELECT first_seq, body FROM log
             WHERE session_id = $1 AND (kinds & $2) != 0 AND first_seq < $3
             ORDER BY first_seq DESC LIMIT 8",
        )?;
        let id = session.to_string();
        let mut before = i64::MAX;
        loop {
            let rows = client.query(&q, &[&id, &mask, &before])?;
            if rows.is_empty() {
                return Ok(None);
            }
            for row in &rows {
                before = row.get(0);
                let seg = segment::decode(session, row.get::<_, &[u8]>(1)).map_err(corrupt)?;
                if let Some(e) = seg
                    .into_iter()
                    .rev()
                    .find(|e| kinds.contains(&e.kind.as_str()))
                {
                    return Ok(Some(e));
                }
            }
        }
    }

    fn events_after(
        &mut self,
        session: SessionId,
        after: u64,
        limit: usize,
    ) -> R<Vec<StoredEvent>> {
        self.client()?;
        let PgDb { client, stmts, .. } = self;
        let q = prep(
            client,
            stmts,
            "SELECT body FROM log WHERE session_id = $1 AND first_seq >= (
                 SELECT COALESCE(MAX(first_seq), 0) FROM log WHERE session_id = $1 AND first_seq <= $2
             ) ORDER BY first_seq LIMIT $3",
        )?;
        let rows = client.query(
            &q,
            &[
                &session.to_string(),
                &(after as i64).saturating_add(1),
                &(limit as i64 + 1),
            ],
        )?;
        let mut events = Vec::new();
        for row in rows {
            if events.len() >= limit {
                break;
            }
            let seg = segment::decode(session, row.get::<_, &[u8]>(0)).map_err(corrupt)?;
            events.extend(seg.into_iter().filter(|e| e.seq > after));
        }
        events.truncate(limit);
        Ok(events)
    }

    fn unsettled(&mut self) -> R<Vec<Unsettled>> {
        let rows = self.client()?.query(
            "SELECT session_id, prompt_id, origin FROM prompts ORDER BY admitted_ms",
            &[],
        )?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(Unsettled {
                    session: SessionId::parse(r.get::<_, &str>(0))?,
                    prompt: PromptId::parse(r.get::<_, &str>(1))?,
                    origin: r.get(2),
                })
            })
            .collect())
    }

    fn notification_changes(&mut self, changes: &[tiller_core::notify::Change]) -> R<()> {
        use tiller_core::notify::Change;
        let mut tx = self.client()?.transaction()?;
        for c in changes {
            match c {
                // A replaced row may be gone (another node ran it): queued
                // again. One that another node queued meanwhile is updated.
                Change::Insert { session, item } | Change::Replace { session, item } => {
                    let n = tx.execute(
                        "INSERT INTO notifications (n, session_id, task_id, text, created_ms)
                         SELECT $1::BIGINT, $2::TEXT, $3::TEXT, $4::TEXT, $5::BIGINT
                         WHERE EXISTS (SELECT 1 FROM sessions WHERE id = $2::TEXT AND NOT closed FOR SHARE)
                         ON CONFLICT (session_id, task_id) DO UPDATE SET text = excluded.text",
                        &[
                            &item.id,
                            &session.to_string(),
                            &item.task_id,
                            &item.text,
                            &item.created_ms,
                        ],
                    )?;
                    if n == 0 {
                        return Err(StoreError::SessionGone(*session)); // rolled back
                    }
                }
                Change::Evict { id } => {
                    tx.execute("DELETE FROM notifications WHERE n = $1", &[id])?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn notifications(&mut self, only: Option<SessionId>) -> R<Vec<Notification>> {
        let rows = self.client()?.query(
            "SELECT n, session_id, task_id, text, created_ms FROM notifications
             WHERE $1::TEXT IS NULL OR session_id = $1 ORDER BY n",
            &[&only.map(|s| s.to_string())],
        )?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(Notification {
                    id: r.get(0),
                    session: SessionId::parse(r.get::<_, &str>(1))?,
                    task_id: r.get(2),
                    text: r.get(3),
                    created_ms: r.get(4),
                })
            })
            .collect())
    }

    fn notification_backlog(&mut self) -> R<(Vec<SessionId>, usize)> {
        let c = self.client()?;
        let sessions = ids(c.query("SELECT DISTINCT session_id FROM notifications", &[])?);
        let total: i64 = c
            .query_one("SELECT COUNT(*) FROM notifications", &[])?
            .get(0);
        Ok((sessions, total as usize))
    }

    fn cron_add(&mut self, j: &CronJob) -> R<()> {
        let n = self.client()?.execute(
            "INSERT INTO cron_jobs (id, session_id, schedule, tz, prompt, next_fire_ms, created_ms)
             SELECT $1::TEXT, $2::TEXT, $3::TEXT, $4::TEXT, $5::TEXT, $6::BIGINT, $7::BIGINT
             WHERE EXISTS (SELECT 1 FROM sessions WHERE id = $2::TEXT AND NOT closed FOR SHARE)",
            &[
                &j.id,
                &j.session.to_string(),
                &j.schedule,
                &j.tz,
                &j.prompt,
                &j.next_fire_ms,
                &j.created_ms,
            ],
        )?;
        match n {
            1 => Ok(()),
            _ => Err(StoreError::SessionGone(j.session)),
        }
    }

    fn cron_list(&mut self) -> R<Vec<CronJob>> {
        let rows = self.client()?.query(
            "SELECT id, session_id, schedule, tz, prompt, next_fire_ms, created_ms
             FROM cron_jobs ORDER BY created_ms, id",
            &[],
        )?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(CronJob {
                    id: r.get(0),
                    session: SessionId::parse(r.get::<_, &str>(1))?,
                    schedule: r.get(2),
                    tz: r.get(3),
                    prompt: r.get(4),
                    next_fire_ms: r.get(5),
                    created_ms: r.get(6),
                })
            })
            .collect())
    }

    fn cron_remove(&mut self, id: &str) -> R<bool> {
        let mut tx = self.client()?.transaction()?;
        // The job before its fire, as a fire and a close take them.
        let n = tx.execute("DELETE FROM cron_jobs WHERE id = $1", &[&id])?;
        tx.execute("DELETE FROM cron_fires WHERE job_id = $1", &[&id])?;
        tx.commit()?;
        Ok(n > 0)
    }

    fn cron_fire(
        &mut self,
        change: &tiller_core::cron::FireChange,
        job_id: &str,
        (from, to): (i64, i64),
    ) -> R<()> {
        use tiller_core::cron::FireChange;
        let mut tx = self.client()?.transaction()?;
        // Once per due time across nodes: only the node that moves the
        // job from this due time records the fire.
        let moved = tx.execute(
            "UPDATE cron_jobs SET next_fire_ms = $2 WHERE id = $1 AND next_fire_ms = $3",
            &[&job_id, &to, &from],
        )?;
        if moved != 1 {
            return Err(StoreError::AlreadyClaimed);
        }
        // A refreshed fire may be gone (another node ran it): it waits
        // again. One another node recorded meanwhile is refreshed.
        let (FireChange::Insert { session, fire } | FireChange::Refresh { session, fire }) = change;
        tx.execute(
            "INSERT INTO cron_fires (n, job_id, session_id, prompt, fired_ms)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (job_id) DO UPDATE SET prompt = excluded.prompt, fired_ms = excluded.fired_ms",
            &[
                &fire.id,
                &fire.job_id,
                &session.to_string(),
                &fire.prompt,
                &fire.fired_ms,
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    fn cron_fires(&mut self, only: Option<SessionId>) -> R<Vec<CronFire>> {
        let rows = self.client()?.query(
            "SELECT n, session_id, job_id, prompt, fired_ms FROM cron_fires
             WHERE $1::TEXT IS NULL OR session_id = $1 ORDER BY n",
            &[&only.map(|s| s.to_string())],
        )?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(CronFire {
                    id: r.get(0),
                    session: SessionId::parse(r.get::<_, &str>(1))?,
                    job_id: r.get(2),
                    prompt: r.get(3),
                    fired_ms: r.get(4),
                })
            })
            .collect())
    }

    fn cron_backlog(&mut self) -> R<Vec<SessionId>> {
        Ok(ids(self
            .client()?
            .query(crate::queues::CRON_BACKLOG, &[])?))
    }

    fn goal_get(&mut self, session: SessionId) -> R<Option<GoalRow>> {
        let row = self.client()?.query_opt(
            "SELECT objective, max_turns, turns_done, status, pause_reason, loop_stops
             FROM goals WHERE session_id = $1",
            &[&session.to_string()],
        )?;
        Ok(row.map(|r| GoalRow {
            session,
            objective: r.get(0),
            max_turns: r.get::<_, i64>(1) as u32,
            turns_done: r.get::<_, i64>(2) as u32,
            status: r.get(3),
            pause_reason: r.get(4),
            loop_stops: r.get::<_, i64>(5) as u32,
        }))
    }

    fn goal_put(&mut self, g: &GoalRow) -> R<()> {
        let n = self.client()?.execute(
            "INSERT INTO goals
             (session_id, objective, max_turns, turns_done, status, pause_reason, loop_stops)
             SELECT $1::TEXT, $2::TEXT, $3::BIGINT, $4::BIGINT, $5::TEXT, $6::TEXT, $7::BIGINT
             WHERE EXISTS (SELECT 1 FROM sessions WHERE id = $1::TEXT AND NOT closed FOR SHARE)
             ON CONFLICT (session_id) DO UPDATE SET objective = excluded.objective,
                 max_turns = excluded.max_turns, turns_done = excluded.turns_done,
                 status = excluded.status, pause_reason = excluded.pause_reason,
                 loop_stops = excluded.loop_stops",
            &[
                &g.session.to_string(),
                &g.objective,
                &i64::from(g.max_turns),
                &i64::from(g.turns_done),
                &g.status,
                &g.pause_reason,
                &i64::from(g.loop_stops),
            ],
        )?;
        match n {
            1 => Ok(()),
            _ => Err(StoreError::SessionGone(g.session)),
        }
    }

    fn goal_delete(&mut self, session: SessionId) -> R<bool> {
        let n = self.client()?.execute(
            "DELETE FROM goals WHERE session_id = $1",
            &[&session.to_string()],
        )?;
        Ok(n > 0)
    }

    fn goals_active(&mut self) -> R<Vec<SessionId>> {
        Ok(ids(self
            .client()?
            .query(crate::queues::GOALS_ACTIVE, &[])?))
    }

    fn deliveries_due(&mut self, now_ms: i64) -> R<Vec<Delivery>> {
        // Taken, not just read: held from the other nodes for a while (the
        // attempt's outcome then sets the row's next time); rows another
        // node is taking right now are skipped, not waited for.
        let rows = self.client()?.query(
            "UPDATE deliveries d SET next_at_ms = $2
             FROM (SELECT id FROM deliveries WHERE next_at_ms <= $1
                   ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) due
             WHERE d.id = due.id
             RETURNING d.id, d.url, d.session_id, d.prompt_id, d.text, d.stop_reason,
                 d.attempts, d.next_at_ms",
            &[&now_ms, &now_ms.saturating_add(crate::DELIVERY_HOLD_MS)],
        )?;
        let mut due: Vec<Delivery> = rows
            .iter()
            .filter_map(|r| {
                Some(Delivery {
                    id: r.get(0),
                    url: r.get(1),
                    session: SessionId::parse(r.get::<_, &str>(2))?,
                    prompt: PromptId::parse(r.get::<_, &str>(3))?,
                    text: r.get(4),
                    stop_reason: r.get(5),
                    attempts: r.get::<_, i64>(6) as u32,
                    next_at_ms: r.get(7),
                })
            })
            .collect();
        due.sort_by_key(|d| d.id);
        Ok(due)
    }

    fn delivery_start(&mut self, id: i64, held: i64, until: i64) -> R<bool> {
        let n = self.client()?.execute(
            "UPDATE deliveries SET next_at_ms = $3 WHERE id = $1 AND next_at_ms = $2",
            &[&id, &held, &until],
        )?;
        Ok(n == 1)
    }

    fn ping(&mut self) -> R<()> {
        self.ping_server()
    }

    fn take_reconnected(&mut self) -> bool {
        std::mem::take(&mut self.reconnected)
    }

    fn clustered(&self) -> bool {
        true
    }

    fn fresh_id(&mut self, queue: crate::IdQueue) -> R<Option<i64>> {
        let sql = match queue {
            crate::IdQueue::Notifications => "SELECT nextval('notification_ids')",
            crate::IdQueue::CronFires => "SELECT nextval('cron_fire_ids')",
        };
        self.client()?;
        let PgDb { client, stmts, .. } = self;
        let q = prep(client, stmts, sql)?;
        Ok(Some(client.query_one(&q, &[])?.get(0)))
    }

    fn join(&mut self, node: &NodeInfo) -> R<()> {
        self.client()?.execute(
            &format!(
                "INSERT INTO nodes (id, address, started_ms, heartbeat_ms)
                 VALUES ($1, $2, {NOW_MS}, {NOW_MS})
                 ON CONFLICT (id) DO UPDATE SET address = excluded.address,
                     started_ms = excluded.started_ms, heartbeat_ms = excluded.heartbeat_ms"
            ),
            &[&node.id, &node.address],
        )?;
        Ok(())
    }

    fn acquire_lease(&mut self, session: SessionId, node: &str, ttl_ms: i64) -> R<Lease> {
        self.client()?;
        let PgDb {
            client,
            stmts,
            held,
            ..
        } = self;
        let id = session.to_string();
        // Free, expired, or this node's own (an earlier run of it): the
        // fence grows, and the update waits for any write still holding
        // the row (see `check_fence`), so no older owner's write lands
        // after it.
        let take = prep(
            client,
            stmts,
            concat!(
                "INSERT INTO leases AS l (session_id, node_id, fence, expires_ms)
                 VALUES ($1, $2, 1, ",
                now_ms!(),
                " + $3)
                 ON CONFLICT (session_id) DO UPDATE SET node_id = excluded.node_id,
                     fence = l.fence + 1, expires_ms = excluded.expires_ms, previous = l.node_id
                 WHERE l.expires_ms < ",
                now_ms!(),
                " OR l.node_id = excluded.node_id
                 RETURNING fence, previous"
            ),
        )?;
        if let Some(row) = client.query_opt(&take, &[&id, &node, &ttl_ms])? {
            let fence: i64 = row.get(0);
            held.insert(id, fence);
            return Ok(Lease::Acquired {
                fence,
                previous: row.get(1),
            });
        }
        held.remove(&id);
        let who = prep(
            client,
            stmts,
            concat!(
                "SELECT l.node_id, COALESCE(n.address, ''), l.expires_ms - ",
                now_ms!(),
                " FROM leases l LEFT JOIN nodes n ON n.id = l.node_id WHERE l.session_id = $1"
            ),
        )?;
        match client.query_opt(&who, &[&id])? {
            Some(row) => Ok(Lease::Held {
                node: row.get(0),
                address: row.get(1),
                expires_in_ms: row.get::<_, i64>(2).max(0),
            }),
            // Deleted meanwhile (lease rows are never deleted but with
            // their session): taken by nobody, try once more later.
            None => Err(StoreError::Corrupt(format!(
                "the lease of session {session} vanished while it was taken"
            ))),
        }
    }

    fn renew_leases(&mut self, node: &str, ttl_ms: i64) -> R<Vec<(SessionId, i64)>> {
        self.client()?;
        let PgDb {
            client,
            stmts,
            held,
            ..
        } = self;
        let beat = prep(
            client,
            stmts,
            concat!(
                "UPDATE nodes SET heartbeat_ms = ",
                now_ms!(),
                " WHERE id = $1"
            ),
        )?;
        client.execute(&beat, &[&node])?;
        let mine: Vec<&str> = held.keys().map(String::as_str).collect();
        // Only the leases this run holds, at the fence it holds: rows an
        // earlier run of this node left expire (or are taken over).
        let renew = prep(
            client,
            stmts,
            concat!(
                "UPDATE leases SET expires_ms = ",
                now_ms!(),
                " + $2 WHERE node_id = $1 AND session_id = ANY($3) RETURNING session_id, fence"
            ),
        )?;
        let rows = client.query(&renew, &[&node, &ttl_ms, &mine])?;
        let still: HashMap<String, i64> = rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .filter(|(s, f)| held.get(s) == Some(f))
            .collect();
        let lost = held
            .iter()
            .filter(|(s, _)| !still.contains_key(*s))
            .filter_map(|(s, f)| Some((SessionId::parse(s)?, *f)))
            .collect();
        *held = still;
        Ok(lost)
    }

    fn release_leases(&mut self, node: &str, only: Option<&[SessionId]>, leave: bool) -> R<()> {
        self.client()?;
        let PgDb { client, held, .. } = self;
        let ids: Vec<String> = match only {
            Some(only) => only.iter().map(|s| s.to_string()).collect(),
            None => held.keys().cloned().collect(),
        };
        // Expired at once, the fence kept: the next owner counts on.
        let mut tx = client.transaction()?;
        let mut held_fences = Vec::new();
        for id in &ids {
            if let Some(f) = held.get(id) {
                held_fences.push((id.clone(), *f));
            }
        }
        for (id, fence) in &held_fences {
            tx.execute(
                "UPDATE leases SET expires_ms = 0 WHERE session_id = $1 AND node_id = $2 AND fence = $3",
                &[id, &node, fence],
            )?;
        }
        if leave {
            tx.execute("DELETE FROM nodes WHERE id = $1", &[&node])?;
        }
        tx.commit()?;
        for id in &ids {
            held.remove(id);
        }
        Ok(())
    }

    fn orphans(&mut self, node: &str, limit: usize) -> R<Vec<SessionId>> {
        self.client()?;
        let PgDb {
            client,
            stmts,
            held,
            ..
        } = self;
        let mine: Vec<&str> = held.keys().map(String::as_str).collect();
        let q = prep(
            client,
            stmts,
            concat!(
                "SELECT w.session_id FROM (
                     SELECT session_id FROM prompts
                     UNION SELECT session_id FROM notifications
                     UNION SELECT session_id FROM cron_fires
                     UNION SELECT session_id FROM goals WHERE status = 'active'
                 ) w
                 JOIN sessions s ON s.id = w.session_id AND NOT s.closed
                 LEFT JOIN leases l ON l.session_id = w.session_id
                 WHERE NOT (w.session_id = ANY($2)) AND (l.session_id IS NULL OR l.expires_ms < ",
                now_ms!(),
                " OR l.node_id = $1)
                 LIMIT $3"
            ),
        )?;
        Ok(ids(client.query(&q, &[&node, &mine, &(limit as i64)])?))
    }

    fn cluster_status(&mut self) -> R<Vec<NodeStatus>> {
        let rows = self.client()?.query(
            &format!(
                "SELECT n.id, n.address, n.started_ms, {NOW_MS} - n.heartbeat_ms,
                     (SELECT count(*) FROM leases l WHERE l.node_id = n.id AND l.expires_ms > {NOW_MS})
                 FROM nodes n ORDER BY n.id"
            ),
            &[],
        )?;
        Ok(rows
            .iter()
            .map(|r| NodeStatus {
                id: r.get(0),
                address: r.get(1),
                started_ms: r.get(2),
                heartbeat_age_ms: r.get(3),
                leases: r.get(4),
            })
            .collect())
    }

    fn delivery_done(&mut self, id: i64, retry: Option<(i64, u32)>) -> R<()> {
        let c = self.client()?;
        match retry {
            None => c.execute("DELETE FROM deliveries WHERE id = $1", &[&id])?,
            Some((next, attempts)) => c.execute(
                "UPDATE deliveries SET next_at_ms = $2, attempts = $3 WHERE id = $1",
                &[&id, &next, &i64::from(attempts)],
            )?,
        };
        Ok(())
    }
}

impl PgDb {
    /// A trivial query over the connection (made again if it dropped).
    pub(crate) fn ping_server(&mut self) -> R<()> {
        self.client()?.simple_query("SELECT 1")?;
        Ok(())
    }
}

fn add_delivery(tx: &mut impl GenericClient, d: &Delivery) -> R<()> {
    tx.execute(
        "INSERT INTO deliveries (url, session_id, prompt_id, text, stop_reason, attempts, next_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &d.url,
            &d.session.to_string(),
            &d.prompt.to_string(),
            &d.text,
            &d.stop_reason,
            &i64::from(d.attempts),
            &d.next_at_ms,
        ],
    )?;
    Ok(())
}
