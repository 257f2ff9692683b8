//! Tiller's store: sessions and an ordered per-session event log in SQLite
//! (WAL). The only crate that knows SQL.
//!
//! All SQLite work runs on one dedicated thread that owns the connection;
//! callers talk to it through a channel, so blocking I/O never runs on the
//! async workers. Commands are executed in the order they are sent, appends
//! that arrive together are committed in one transaction, and a reader
//! always sees every append sent before it.

use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use rusqlite::{Connection, OptionalExtension, params};
use tiller_core::{PromptId, SessionId, TurnId};
use tokio::sync::oneshot;

/// Store failures. Messages say what happened and what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {path}: {source} (check the path and its permissions)")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("cannot prepare the store file {path}: {source} (check the path and its permissions)")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("store error: {0}")]
    Sql(String),
    #[error("the store thread has stopped (the daemon is shutting down)")]
    Closed,
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Sql(e.to_string())
    }
}

/// Which piece of a session's state to save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateColumn {
    /// The engine's name.
    Engine,
    /// Session settings (JSON).
    Settings,
    /// The model conversation (JSON).
    Conversation,
}

impl StateColumn {
    fn as_str(self) -> &'static str {
        match self {
            StateColumn::Engine => "engine",
            StateColumn::Settings => "settings",
            StateColumn::Conversation => "conversation",
        }
    }
}

/// A session's stored state beyond its record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionExtras {
    pub engine: Option<String>,
    pub settings: Option<String>,
    pub conversation: Option<String>,
}

/// A session row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRecord {
    /// The session.
    pub id: SessionId,
    /// Its working directory.
    pub cwd: String,
    /// A title, if any.
    pub title: Option<String>,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: i64,
    /// Last append, ms since the Unix epoch.
    pub updated_ms: i64,
    /// Closed sessions are kept (their log stays readable) but not listed.
    pub closed: bool,
    /// The channel that created it, if one did: a channel may prompt only
    /// its own sessions (and ones its config lists).
    pub channel: Option<String>,
}

/// One stored event. The payload is opaque JSON to the store.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    /// The session whose log holds it.
    pub session: SessionId,
    /// Position in that log, from 1, without gaps.
    pub seq: u64,
    /// Time of the event, ms since the Unix epoch.
    pub ts_ms: i64,
    /// Its type (`agent_message_chunk`, `turn_complete`, ...).
    pub kind: String,
    /// The prompt it belongs to, if any.
    pub prompt: Option<PromptId>,
    /// The turn it belongs to, if any.
    pub turn: Option<TurnId>,
    /// The payload, as JSON text.
    pub data: String,
}

/// A change to the prompt ledger, committed with the event it rides on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerOp {
    /// The prompt was admitted (queued or started).
    Admit { prompt: PromptId, origin: String },
    /// The prompt got its terminal.
    Settle { prompt: PromptId },
}

/// A prompt admitted but never settled (found at start-up after a crash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsettled {
    pub session: SessionId,
    pub prompt: PromptId,
    pub origin: String,
}

/// One page of a session's history, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryPage {
    pub events: Vec<StoredEvent>,
    /// Whether older events exist.
    pub has_more: bool,
}

/// A queued background notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    pub session: SessionId,
    pub task_id: String,
    pub text: String,
    pub created_ms: i64,
}

/// A cron job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronJob {
    pub id: String,
    pub session: SessionId,
    pub schedule: String,
    pub tz: String,
    pub prompt: String,
    /// The next scheduled fire, ms since the epoch.
    pub next_fire_ms: i64,
    pub created_ms: i64,
}

/// A cron fire waiting for its session to be idle (one per job at most).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronFire {
    /// Queue position (keeps its place when handed back).
    pub id: i64,
    pub job_id: String,
    pub session: SessionId,
    pub prompt: String,
    pub fired_ms: i64,
}

/// A session's goal, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoalRow {
    pub session: SessionId,
    pub objective: String,
    pub max_turns: u32,
    pub turns_done: u32,
    /// `active`, `paused`, `completed`.
    pub status: String,
    /// Why it paused (`user`, `loop_detected`).
    pub pause_reason: Option<String>,
    pub loop_stops: u32,
}

/// A webhook delivery of a turn's final text, waiting to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub id: i64,
    pub url: String,
    pub session: SessionId,
    pub prompt: PromptId,
    pub text: String,
    pub stop_reason: String,
    pub attempts: u32,
    pub next_at_ms: i64,
}

/// What enqueueing did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The notification replaced a queued one with the same task id.
    pub deduplicated: bool,
    /// Task ids evicted (oldest first) to keep the queue within its cap.
    pub evicted: Vec<String>,
}

/// What a session's log looks like at load time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogHead {
    /// The last sequence number (0 when empty).
    pub last_seq: u64,
    /// The highest turn id used (0 when none).
    pub last_turn: u64,
}

/// One page of sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionPage {
    pub sessions: Vec<SessionRecord>,
    /// Pass back to get the next page; `None` at the end.
    pub next_cursor: Option<String>,
}

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// The closed set of commands the store thread handles.
enum Cmd {
    CreateSession(SessionRecord, Reply<()>),
    GetSession(SessionId, Reply<Option<(SessionRecord, LogHead)>>),
    ListSessions {
        cursor: Option<i64>,
        limit: usize,
        cwd: Option<String>,
        reply: Reply<SessionPage>,
    },
    /// Records a channel request key; false when it was seen within the
    /// window (a replay). Forgets keys older than the window.
    ChannelSeen {
        key: String,
        now_s: i64,
        window_s: i64,
        reply: Reply<bool>,
    },
    SaveState {
        id: SessionId,
        column: StateColumn,
        value: String,
        reply: Reply<()>,
    },
    LoadState(SessionId, Reply<SessionExtras>),
    CloseSession(SessionId, Reply<()>),
    /// Appends (and updates the ledger); `reply` answers after the commit.
    Append(StoredEvent, Option<LedgerOp>, Option<Reply<()>>),
    History {
        session: SessionId,
        before: u64,
        limit: usize,
        reply: Reply<HistoryPage>,
    },
    LastOfKinds {
        session: SessionId,
        kinds: Vec<&'static str>,
        reply: Reply<Option<StoredEvent>>,
    },
    Unsettled(Reply<Vec<Unsettled>>),
    Enqueue {
        session: SessionId,
        task_id: String,
        text: String,
        now_ms: i64,
        cap: usize,
        reply: Reply<Enqueued>,
    },
    /// Takes the oldest queued notification of a session off the queue.
    Claim(SessionId, Reply<Option<Notification>>),
    /// Puts a claimed notification back in its place.
    HandBack(Notification, Reply<()>),
    /// Sessions with queued notifications, and the total queued.
    NotificationBacklog(Reply<(Vec<SessionId>, usize)>),
    CronAdd(CronJob, Reply<()>),
    CronList(Reply<Vec<CronJob>>),
    CronRemove(String, Reply<bool>),
    /// Records a fire (coalesced per job) and the job's next fire time.
    CronFire {
        job: CronJob,
        fired_ms: i64,
        next_fire_ms: i64,
        reply: Reply<()>,
    },
    CronClaim(SessionId, Reply<Option<CronFire>>),
    CronHandBack(CronFire, Reply<()>),
    CronBacklog(Reply<Vec<SessionId>>),
    GoalGet(SessionId, Reply<Option<GoalRow>>),
    GoalPut(GoalRow, Reply<()>),
    GoalDelete(SessionId, Reply<bool>),
    GoalsActive(Reply<Vec<SessionId>>),
    DeliveryAdd(Delivery, Reply<()>),
    DeliveriesDue(i64, Reply<Vec<Delivery>>),
    /// Sent (delete), or retry at a time (update).
    DeliveryDone(i64, Option<(i64, u32)>, Reply<()>),
    Events {
        session: SessionId,
        after: u64,
        limit: usize,
        reply: Reply<Vec<StoredEvent>>,
    },
    /// Answers once every earlier command is done.
    Flush(Reply<()>),
}

/// A handle to the store thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    /// Commands to the thread; the thread ends when every handle is dropped.
    tx: std_mpsc::Sender<Cmd>,
}

impl Store {
    /// Opens (creating if needed) the database at `path` and starts its thread.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let open_err = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        restrict(path).map_err(|e| StoreError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        let conn = Connection::open(path).map_err(open_err)?;
        migrate(&conn).map_err(open_err)?;
        let (tx, rx) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("tiller-store".into())
            .spawn(move || run(conn, rx))
            .expect("spawn the store thread");
        Ok(Store { tx })
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Stores a new session (durable when this returns).
    pub async fn create_session(&self, rec: SessionRecord) -> Result<(), StoreError> {
        self.ask(|r| Cmd::CreateSession(rec, r)).await
    }

    /// A session and the head of its log.
    pub async fn get_session(
        &self,
        id: SessionId,
    ) -> Result<Option<(SessionRecord, LogHead)>, StoreError> {
        self.ask(|r| Cmd::GetSession(id, r)).await
    }

    /// Open sessions, most recently created first; `cursor` from a previous page.
    pub async fn list_sessions(
        &self,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<SessionPage, StoreError> {
        self.list_sessions_in(cursor, limit, None).await
    }

    /// Like [`Store::list_sessions`], only sessions whose cwd is `cwd`.
    pub async fn list_sessions_in(
        &self,
        cursor: Option<&str>,
        limit: usize,
        cwd: Option<String>,
    ) -> Result<SessionPage, StoreError> {
        let cursor = cursor.and_then(|c| c.parse::<i64>().ok());
        self.ask(|reply| Cmd::ListSessions {
            cursor,
            limit: limit.clamp(1, 1000),
            cwd,
            reply,
        })
        .await
    }

    /// Stores one piece of a session's state (engine, settings JSON or
    /// conversation JSON).
    pub async fn save_state(
        &self,
        id: SessionId,
        column: StateColumn,
        value: String,
    ) -> Result<(), StoreError> {
        self.ask(|reply| Cmd::SaveState {
            id,
            column,
            value,
            reply,
        })
        .await
    }

    /// A session's stored state (all `None` when nothing was saved).
    pub async fn load_state(&self, id: SessionId) -> Result<SessionExtras, StoreError> {
        self.ask(|reply| Cmd::LoadState(id, reply)).await
    }

    /// Durable replay guard for channel requests: true when `key` is new.
    pub async fn channel_seen(
        &self,
        key: String,
        now_s: i64,
        window_s: i64,
    ) -> Result<bool, StoreError> {
        self.ask(|reply| Cmd::ChannelSeen {
            key,
            now_s,
            window_s,
            reply,
        })
        .await
    }

    /// Marks a session closed.
    pub async fn close_session(&self, id: SessionId) -> Result<(), StoreError> {
        self.ask(|r| Cmd::CloseSession(id, r)).await
    }

    /// Appends (and updates the ledger) without waiting. Ordered with
    /// every other command.
    pub fn append(&self, event: StoredEvent, ledger: Option<LedgerOp>) {
        let _ = self.tx.send(Cmd::Append(event, ledger, None));
    }

    /// Appends and waits for the commit (durable before acknowledged).
    pub async fn append_durable(
        &self,
        event: StoredEvent,
        ledger: Option<LedgerOp>,
    ) -> Result<(), StoreError> {
        self.ask(|r| Cmd::Append(event, ledger, Some(r))).await
    }

    /// Up to `limit` events with `seq < before` (all when `before` is
    /// `None`), oldest first, and whether older ones exist.
    pub async fn history(
        &self,
        session: SessionId,
        before: Option<u64>,
        limit: usize,
    ) -> Result<HistoryPage, StoreError> {
        self.ask(|reply| Cmd::History {
            session,
            before: before.unwrap_or(u64::MAX >> 1),
            limit: limit.clamp(1, 10_000),
            reply,
        })
        .await
    }

    /// The newest event of a session whose kind is one of `kinds`.
    pub async fn last_of_kinds(
        &self,
        session: SessionId,
        kinds: &[&'static str],
    ) -> Result<Option<StoredEvent>, StoreError> {
        let kinds = kinds.to_vec();
        self.ask(|reply| Cmd::LastOfKinds {
            session,
            kinds,
            reply,
        })
        .await
    }

    /// Queues a background notification (durable when this returns),
    /// replacing a queued one with the same task id, evicting the oldest
    /// over `cap`.
    pub async fn enqueue_notification(
        &self,
        session: SessionId,
        task_id: String,
        text: String,
        now_ms: i64,
        cap: usize,
    ) -> Result<Enqueued, StoreError> {
        self.ask(|reply| Cmd::Enqueue {
            session,
            task_id,
            text,
            now_ms,
            cap,
            reply,
        })
        .await
    }

    /// Takes the oldest queued notification of a session.
    pub async fn claim_notification(
        &self,
        session: SessionId,
    ) -> Result<Option<Notification>, StoreError> {
        self.ask(|r| Cmd::Claim(session, r)).await
    }

    /// Returns a claimed notification to its place in the queue.
    pub async fn hand_back_notification(&self, n: Notification) -> Result<(), StoreError> {
        self.ask(|r| Cmd::HandBack(n, r)).await
    }

    /// Sessions that have queued notifications, and how many are queued.
    pub async fn notification_backlog(&self) -> Result<(Vec<SessionId>, usize), StoreError> {
        self.ask(Cmd::NotificationBacklog).await
    }

    /// Stores a new cron job.
    pub async fn cron_add(&self, job: CronJob) -> Result<(), StoreError> {
        self.ask(|r| Cmd::CronAdd(job, r)).await
    }

    /// Every cron job.
    pub async fn cron_list(&self) -> Result<Vec<CronJob>, StoreError> {
        self.ask(Cmd::CronList).await
    }

    /// Removes a job (and its waiting fire); false when there was none.
    pub async fn cron_remove(&self, id: String) -> Result<bool, StoreError> {
        self.ask(|r| Cmd::CronRemove(id, r)).await
    }

    /// Queues a fire of `job` (at most one per job: a waiting fire is kept
    /// in its place) and moves the job to its next fire time.
    pub async fn cron_fire(
        &self,
        job: CronJob,
        fired_ms: i64,
        next_fire_ms: i64,
    ) -> Result<(), StoreError> {
        self.ask(|reply| Cmd::CronFire {
            job,
            fired_ms,
            next_fire_ms,
            reply,
        })
        .await
    }

    /// Takes the oldest waiting fire of a session.
    pub async fn cron_claim(&self, session: SessionId) -> Result<Option<CronFire>, StoreError> {
        self.ask(|r| Cmd::CronClaim(session, r)).await
    }

    /// Returns a claimed fire to its place.
    pub async fn cron_hand_back(&self, fire: CronFire) -> Result<(), StoreError> {
        self.ask(|r| Cmd::CronHandBack(fire, r)).await
    }

    /// Sessions with waiting fires.
    pub async fn cron_backlog(&self) -> Result<Vec<SessionId>, StoreError> {
        self.ask(Cmd::CronBacklog).await
    }

    /// A session's goal.
    pub async fn goal_get(&self, session: SessionId) -> Result<Option<GoalRow>, StoreError> {
        self.ask(|r| Cmd::GoalGet(session, r)).await
    }

    /// Stores (replaces) a session's goal.
    pub async fn goal_put(&self, goal: GoalRow) -> Result<(), StoreError> {
        self.ask(|r| Cmd::GoalPut(goal, r)).await
    }

    /// Clears a session's goal; false when it had none.
    pub async fn goal_delete(&self, session: SessionId) -> Result<bool, StoreError> {
        self.ask(|r| Cmd::GoalDelete(session, r)).await
    }

    /// Sessions whose goal is active.
    pub async fn goals_active(&self) -> Result<Vec<SessionId>, StoreError> {
        self.ask(Cmd::GoalsActive).await
    }

    /// Stores a delivery to send (durable when this returns).
    pub async fn delivery_add(&self, d: Delivery) -> Result<(), StoreError> {
        self.ask(|r| Cmd::DeliveryAdd(d, r)).await
    }

    /// Deliveries due at `now_ms`, oldest first.
    pub async fn deliveries_due(&self, now_ms: i64) -> Result<Vec<Delivery>, StoreError> {
        self.ask(|r| Cmd::DeliveriesDue(now_ms, r)).await
    }

    /// Marks a delivery sent or given up (`retry = None`), or schedules its
    /// next attempt.
    pub async fn delivery_done(
        &self,
        id: i64,
        retry: Option<(i64, u32)>,
    ) -> Result<(), StoreError> {
        self.ask(|r| Cmd::DeliveryDone(id, retry, r)).await
    }

    /// Prompts admitted and never settled, oldest first.
    pub async fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        self.ask(Cmd::Unsettled).await
    }

    /// Waits until every command sent before it is committed.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.ask(Cmd::Flush).await
    }

    /// Events of a session with `seq > after`, oldest first.
    pub async fn events_after(
        &self,
        session: SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        self.ask(|reply| Cmd::Events {
            session,
            after,
            limit,
            reply,
        })
        .await
    }
}

/// The database and its WAL and shared-memory files are the owner's only
/// (0600): they hold every prompt and answer. SQLite creates the `-wal`
/// and `-shm` files with the database file's mode, so creating that one
/// 0600 first covers them; files left by an older version are tightened.
fn restrict(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
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

const SCHEMA: &[&str] = &[
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
];

fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // WAL + NORMAL: a commit survives a process crash (kill -9); the last
    // commits may be lost on power failure. See ARCHITECTURE.md.
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    for (i, sql) in SCHEMA.iter().enumerate().skip(version as usize) {
        let tx = conn.unchecked_transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", i as i64 + 1)?;
        tx.commit()?;
    }
    Ok(())
}

/// Most appends committed in one transaction.
const MAX_BATCH: usize = 512;

fn run(mut conn: Connection, rx: std_mpsc::Receiver<Cmd>) {
    let mut pending: Option<Cmd> = None;
    loop {
        let cmd = match pending.take() {
            Some(c) => c,
            None => match rx.recv() {
                Ok(c) => c,
                Err(_) => return, // every handle dropped
            },
        };
        match cmd {
            Cmd::Append(first, ledger, reply) => {
                let mut batch = vec![(first, ledger, reply)];
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(Cmd::Append(e, l, r)) => batch.push((e, l, r)),
                        Ok(other) => {
                            pending = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                let started = Instant::now();
                let result = append_batch(&mut conn, &batch);
                metrics::histogram!("tiller_store_write_seconds")
                    .record(started.elapsed().as_secs_f64());
                if let Err(e) = &result {
                    tracing::error!(error = %e, events = batch.len(), "store append failed");
                }
                for (_, _, reply) in batch {
                    if let Some(reply) = reply {
                        let _ = reply.send(match &result {
                            Ok(()) => Ok(()),
                            Err(e) => Err(StoreError::Sql(e.to_string())),
                        });
                    }
                }
            }
            Cmd::CreateSession(rec, reply) => {
                let _ = reply.send(create_session(&conn, &rec).map_err(Into::into));
            }
            Cmd::GetSession(id, reply) => {
                let _ = reply.send(get_session(&conn, id).map_err(Into::into));
            }
            Cmd::ListSessions {
                cursor,
                limit,
                cwd,
                reply,
            } => {
                let r = list_sessions(&conn, cursor, limit, cwd.as_deref());
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::SaveState {
                id,
                column,
                value,
                reply,
            } => {
                let col = column.as_str();
                let r = conn
                    .execute(
                        &format!(
                            "INSERT INTO session_state (session_id, {col}) VALUES (?1, ?2)
                             ON CONFLICT(session_id) DO UPDATE SET {col} = excluded.{col}"
                        ),
                        params![id.to_string(), value],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::LoadState(id, reply) => {
                let r = conn
                    .query_row(
                        "SELECT engine, settings, conversation FROM session_state WHERE session_id = ?1",
                        params![id.to_string()],
                        |r| {
                            Ok(SessionExtras {
                                engine: r.get(0)?,
                                settings: r.get(1)?,
                                conversation: r.get(2)?,
                            })
                        },
                    )
                    .optional()
                    .map(Option::unwrap_or_default);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::ChannelSeen {
                key,
                now_s,
                window_s,
                reply,
            } => {
                let r = conn
                    .execute(
                        "DELETE FROM channel_seen WHERE seen_s < ?1",
                        params![now_s - window_s],
                    )
                    .and_then(|_| {
                        conn.execute(
                            "INSERT OR IGNORE INTO channel_seen (key, seen_s) VALUES (?1, ?2)",
                            params![key, now_s],
                        )
                    })
                    .map(|n| n == 1);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::CloseSession(id, reply) => {
                let r = conn
                    .execute(
                        "UPDATE sessions SET closed = 1 WHERE id = ?1",
                        params![id.to_string()],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::Flush(reply) => {
                let _ = reply.send(Ok(()));
            }
            Cmd::History {
                session,
                before,
                limit,
                reply,
            } => {
                let _ = reply.send(history(&conn, session, before, limit).map_err(Into::into));
            }
            Cmd::LastOfKinds {
                session,
                kinds,
                reply,
            } => {
                let _ = reply.send(last_of_kinds(&conn, session, &kinds).map_err(Into::into));
            }
            Cmd::Unsettled(reply) => {
                let _ = reply.send(unsettled(&conn).map_err(Into::into));
            }
            Cmd::Enqueue {
                session,
                task_id,
                text,
                now_ms,
                cap,
                reply,
            } => {
                let r = enqueue(&mut conn, session, &task_id, &text, now_ms, cap);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::Claim(session, reply) => {
                let _ = reply.send(claim(&mut conn, session).map_err(Into::into));
            }
            Cmd::HandBack(n, reply) => {
                let r = conn
                    .execute(
                        "INSERT OR IGNORE INTO notifications (n, session_id, task_id, text, created_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                        params![n.id, n.session.to_string(), n.task_id, n.text, n.created_ms],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::NotificationBacklog(reply) => {
                let _ = reply.send(backlog(&conn).map_err(Into::into));
            }
            Cmd::CronAdd(j, reply) => {
                let r = conn
                    .execute(
                        "INSERT INTO cron_jobs (id, session_id, schedule, tz, prompt, next_fire_ms, created_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                        params![j.id, j.session.to_string(), j.schedule, j.tz, j.prompt, j.next_fire_ms, j.created_ms],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::CronList(reply) => {
                let _ = reply.send(cron_list(&conn).map_err(Into::into));
            }
            Cmd::CronRemove(id, reply) => {
                let r = conn
                    .execute("DELETE FROM cron_fires WHERE job_id = ?1", params![id])
                    .and_then(|_| conn.execute("DELETE FROM cron_jobs WHERE id = ?1", params![id]))
                    .map(|n| n > 0);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::CronFire {
                job,
                fired_ms,
                next_fire_ms,
                reply,
            } => {
                let _ = reply
                    .send(cron_fire(&mut conn, &job, fired_ms, next_fire_ms).map_err(Into::into));
            }
            Cmd::CronClaim(session, reply) => {
                let _ = reply.send(cron_claim(&mut conn, session).map_err(Into::into));
            }
            Cmd::CronHandBack(f, reply) => {
                let r = conn
                    .execute(
                        "INSERT OR IGNORE INTO cron_fires (n, job_id, session_id, prompt, fired_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                        params![f.id, f.job_id, f.session.to_string(), f.prompt, f.fired_ms],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::GoalGet(session, reply) => {
                let r = conn
                    .query_row(
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
                    .optional();
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::GoalPut(g, reply) => {
                let r = conn
                    .execute(
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
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::GoalDelete(session, reply) => {
                let r = conn
                    .execute(
                        "DELETE FROM goals WHERE session_id = ?1",
                        params![session.to_string()],
                    )
                    .map(|n| n > 0);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::GoalsActive(reply) => {
                let r = session_ids(
                    &conn,
                    "SELECT session_id FROM goals WHERE status = 'active'",
                );
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::DeliveryAdd(d, reply) => {
                let r = conn
                    .execute(
                        "INSERT INTO deliveries (url, session_id, prompt_id, text, stop_reason, attempts, next_at_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                        params![d.url, d.session.to_string(), d.prompt.to_string(), d.text, d.stop_reason, d.attempts, d.next_at_ms],
                    )
                    .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::DeliveriesDue(now, reply) => {
                let r = conn
                    .prepare(
                        "SELECT id, url, session_id, prompt_id, text, stop_reason, attempts, next_at_ms
                         FROM deliveries WHERE next_at_ms <= ?1 ORDER BY id LIMIT 100",
                    )
                    .and_then(|mut s| {
                        s.query_map(params![now], |r| {
                            let sid: String = r.get(2)?;
                            let pid: String = r.get(3)?;
                            Ok((sid, pid, Delivery {
                                id: r.get(0)?,
                                url: r.get(1)?,
                                session: SessionId::from_u128(0),
                                prompt: PromptId::from_u128(0),
                                text: r.get(4)?,
                                stop_reason: r.get(5)?,
                                attempts: r.get(6)?,
                                next_at_ms: r.get(7)?,
                            }))
                        })
                        .map(|rows| {
                            rows.filter_map(|x| {
                                let (s, p, mut d) = x.ok()?;
                                d.session = SessionId::parse(&s)?;
                                d.prompt = PromptId::parse(&p)?;
                                Some(d)
                            })
                            .collect()
                        })
                    });
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::DeliveryDone(id, retry, reply) => {
                let r = match retry {
                    None => conn.execute("DELETE FROM deliveries WHERE id = ?1", params![id]),
                    Some((next, attempts)) => conn.execute(
                        "UPDATE deliveries SET next_at_ms = ?2, attempts = ?3 WHERE id = ?1",
                        params![id, next, attempts],
                    ),
                }
                .map(drop);
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::CronBacklog(reply) => {
                let r = session_ids(&conn, "SELECT DISTINCT session_id FROM cron_fires");
                let _ = reply.send(r.map_err(Into::into));
            }
            Cmd::Events {
                session,
                after,
                limit,
                reply,
            } => {
                let _ = reply.send(events_after(&conn, session, after, limit).map_err(Into::into));
            }
        }
    }
}

type Batch = [(StoredEvent, Option<LedgerOp>, Option<Reply<()>>)];

fn append_batch(conn: &mut Connection, batch: &Batch) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO events (session_id, seq, ts_ms, kind, prompt_id, turn_id, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?;
        let mut touch = tx.prepare_cached("UPDATE sessions SET updated_ms = ?2 WHERE id = ?1")?;
        let mut admit = tx.prepare_cached(
            "INSERT OR IGNORE INTO prompts (prompt_id, session_id, origin, admitted_ms)
             VALUES (?1, ?2, ?3, ?4)",
        )?;
        let mut settle = tx.prepare_cached(
            "UPDATE prompts SET settled_ms = ?2 WHERE prompt_id = ?1 AND settled_ms IS NULL",
        )?;
        let mut last: Option<(SessionId, i64)> = None;
        for (e, ledger, _) in batch {
            match ledger {
                Some(LedgerOp::Admit { prompt, origin }) => {
                    admit.execute(params![
                        prompt.to_string(),
                        e.session.to_string(),
                        origin,
                        e.ts_ms
                    ])?;
                }
                Some(LedgerOp::Settle { prompt }) => {
                    settle.execute(params![prompt.to_string(), e.ts_ms])?;
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
            if let Some((s, ts)) = last
                && s != e.session
            {
                touch.execute(params![s.to_string(), ts])?;
            }
            last = Some((e.session, e.ts_ms));
        }
        if let Some((s, ts)) = last {
            touch.execute(params![s.to_string(), ts])?;
        }
    }
    tx.commit()
}

fn create_session(conn: &Connection, rec: &SessionRecord) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT INTO sessions (id, cwd, title, created_ms, updated_ms, closed, channel)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            rec.id.to_string(),
            rec.cwd,
            rec.title,
            rec.created_ms,
            rec.updated_ms,
            rec.closed,
            rec.channel
        ],
    )
    .map(drop)
}

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

fn get_session(
    conn: &Connection,
    id: SessionId,
) -> rusqlite::Result<Option<(SessionRecord, LogHead)>> {
    let Some(rec) = conn
        .query_row(
            "SELECT id, cwd, title, created_ms, updated_ms, closed, channel FROM sessions WHERE id = ?1",
            params![id.to_string()],
            session_row,
        )
        .optional()?
    else {
        return Ok(None);
    };
    let (last_seq, last_turn): (i64, i64) = conn.query_row(
        "SELECT COALESCE(MAX(seq), 0), COALESCE(MAX(turn_id), 0) FROM events WHERE session_id = ?1",
        params![id.to_string()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(Some((
        rec,
        LogHead {
            last_seq: last_seq as u64,
            last_turn: last_turn as u64,
        },
    )))
}

fn list_sessions(
    conn: &Connection,
    cursor: Option<i64>,
    limit: usize,
    cwd: Option<&str>,
) -> rusqlite::Result<SessionPage> {
    let mut stmt = conn.prepare_cached(
        "SELECT n, id, cwd, title, created_ms, updated_ms, closed, channel FROM sessions
         WHERE closed = 0 AND n < ?1 AND (?3 IS NULL OR cwd = ?3) ORDER BY n DESC LIMIT ?2",
    )?;
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

fn event_row(session: SessionId, r: &rusqlite::Row<'_>) -> rusqlite::Result<StoredEvent> {
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

fn history(
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

fn last_of_kinds(
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

fn enqueue(
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

fn claim(conn: &mut Connection, session: SessionId) -> rusqlite::Result<Option<Notification>> {
    let tx = conn.transaction()?;
    let found = tx
        .query_row(
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
        .optional()?;
    if let Some(n) = &found {
        tx.execute("DELETE FROM notifications WHERE n = ?1", params![n.id])?;
    }
    tx.commit()?;
    Ok(found)
}

fn cron_list(conn: &Connection) -> rusqlite::Result<Vec<CronJob>> {
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

fn cron_fire(
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

fn cron_claim(conn: &mut Connection, session: SessionId) -> rusqlite::Result<Option<CronFire>> {
    let tx = conn.transaction()?;
    let found = tx
        .query_row(
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
        .optional()?;
    if let Some(f) = &found {
        tx.execute("DELETE FROM cron_fires WHERE n = ?1", params![f.id])?;
    }
    tx.commit()?;
    Ok(found)
}

/// The session ids a one-column query returns.
fn session_ids(conn: &Connection, sql: &str) -> rusqlite::Result<Vec<SessionId>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    Ok(rows
        .filter_map(|s| s.ok().and_then(|s| SessionId::parse(&s)))
        .collect())
}

fn backlog(conn: &Connection) -> rusqlite::Result<(Vec<SessionId>, usize)> {
    let sessions = session_ids(conn, "SELECT DISTINCT session_id FROM notifications")?;
    let total: i64 = conn.query_row("SELECT COUNT(*) FROM notifications", [], |r| r.get(0))?;
    Ok((sessions, total as usize))
}

fn unsettled(conn: &Connection) -> rusqlite::Result<Vec<Unsettled>> {
    let mut stmt = conn.prepare_cached(
        "SELECT session_id, prompt_id, origin FROM prompts
         WHERE settled_ms IS NULL ORDER BY admitted_ms",
    )?;
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

fn events_after(
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
        |r| {
            let prompt: Option<String> = r.get(3)?;
            let turn: Option<i64> = r.get(4)?;
            Ok(StoredEvent {
                session,
                seq: r.get::<_, i64>(0)? as u64,
                ts_ms: r.get(1)?,
                kind: r.get(2)?,
                prompt: prompt.as_deref().and_then(PromptId::parse),
                turn: turn.map(|t| TurnId(t as u64)),
                data: r.get(5)?,
            })
        },
    )?;
    rows.collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(n: i64) -> SessionRecord {
        SessionRecord {
            id: SessionId::new(),
            cwd: "/tmp".into(),
            title: None,
            created_ms: n,
            updated_ms: n,
            closed: false,
            channel: None,
        }
    }

    fn ev(session: SessionId, seq: u64) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: 10 + seq as i64,
            kind: "agent_message_chunk".into(),
            prompt: Some(PromptId::from_u128(3)),
            turn: Some(TurnId(seq)),
            data: format!("{{\"n\":{seq}}}"),
        }
    }

    #[tokio::test]
    async fn sessions_and_events_round_trip_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = Store::open(&path).unwrap();
        let a = rec(1);
        let b = rec(2);
        store.create_session(a.clone()).await.unwrap();
        store.create_session(b.clone()).await.unwrap();
        for seq in 1..=5 {
            store.append(ev(a.id, seq), None);
        }
        store.append_durable(ev(a.id, 6), None).await.unwrap();
        drop(store);

        let store = Store::open(&path).unwrap();
        let (got, head) = store.get_session(a.id).await.unwrap().unwrap();
        assert_eq!(got.id, a.id);
        assert_eq!(got.updated_ms, 16, "appends touch updated_ms");
        assert_eq!(
            head,
            LogHead {
                last_seq: 6,
                last_turn: 6
            }
        );
        let events = store.events_after(a.id, 2, 3).await.unwrap();
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert_eq!(events[0], ev(a.id, 3));
        assert!(store.get_session(SessionId::new()).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn session_state_saves_each_column_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let id = SessionId::new();
        {
            let store = Store::open(&path).unwrap();
            assert_eq!(
                store.load_state(id).await.unwrap(),
                SessionExtras::default()
            );
            store
                .save_state(id, StateColumn::Engine, "openai".into())
                .await
                .unwrap();
            store
                .save_state(id, StateColumn::Conversation, "[1]".into())
                .await
                .unwrap();
            store
                .save_state(id, StateColumn::Conversation, "[2]".into())
                .await
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(
            store.load_state(id).await.unwrap(),
            SessionExtras {
                engine: Some("openai".into()),
                settings: None,
                conversation: Some("[2]".into()),
            }
        );
    }

    #[tokio::test]
    async fn duplicate_seq_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        store.append_durable(ev(a.id, 1), None).await.unwrap();
        assert!(store.append_durable(ev(a.id, 1), None).await.is_err());
    }

    #[tokio::test]
    async fn listing_pages_newest_first_and_skips_closed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let recs: Vec<_> = (0..5).map(rec).collect();
        for r in &recs {
            store.create_session(r.clone()).await.unwrap();
        }
        store.close_session(recs[3].id).await.unwrap();
        let p1 = store.list_sessions(None, 2).await.unwrap();
        assert_eq!(
            p1.sessions.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![recs[4].id, recs[2].id]
        );
        let p2 = store
            .list_sessions(p1.next_cursor.as_deref(), 2)
            .await
            .unwrap();
        assert_eq!(
            p2.sessions.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![recs[1].id, recs[0].id]
        );
        assert_eq!(p2.next_cursor, None);
    }
}

#[cfg(test)]
mod ledger_tests {
    use super::*;

    fn ev(session: SessionId, seq: u64, kind: &str) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: seq as i64,
            kind: kind.into(),
            prompt: None,
            turn: None,
            data: "{}".into(),
        }
    }

    #[tokio::test]
    async fn the_ledger_finds_unsettled_prompts_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let s = SessionId::new();
        let (p1, p2) = (PromptId::new(), PromptId::new());
        {
            let store = Store::open(&path).unwrap();
            let admit = |p| {
                Some(LedgerOp::Admit {
                    prompt: p,
                    origin: "interactive".into(),
                })
            };
            store
                .append_durable(ev(s, 1, "prompt_started"), admit(p1))
                .await
                .unwrap();
            store
                .append_durable(ev(s, 2, "prompt_queued"), admit(p2))
                .await
                .unwrap();
            store
                .append_durable(
                    ev(s, 3, "turn_complete"),
                    Some(LedgerOp::Settle { prompt: p1 }),
                )
                .await
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let open = store.unsettled().await.unwrap();
        assert_eq!(
            open,
            vec![Unsettled {
                session: s,
                prompt: p2,
                origin: "interactive".into()
            }]
        );
        let last = store
            .last_of_kinds(s, &["prompt_started", "turn_complete"])
            .await
            .unwrap()
            .unwrap();
        assert_eq!(last.seq, 3);
        assert!(
            store
                .last_of_kinds(s, &["turn_error"])
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn history_pages_backward() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let s = SessionId::new();
        for seq in 1..=10 {
            store.append(ev(s, seq, "x"), None);
        }
        let p = store.history(s, None, 4).await.unwrap();
        assert_eq!(
            p.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![7, 8, 9, 10]
        );
        assert!(p.has_more);
        let p = store.history(s, Some(3), 4).await.unwrap();
        assert_eq!(
            p.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(!p.has_more);
    }
}

#[cfg(test)]
mod notification_tests {
    use super::*;

    #[tokio::test]
    async fn fifo_dedup_cap_and_hand_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let s = SessionId::new();
        let e = |t: &str| store.enqueue_notification(s, t.into(), format!("{t} text"), 1, 3);
        assert_eq!(
            e("a").await.unwrap(),
            Enqueued {
                deduplicated: false,
                evicted: vec![]
            }
        );
        e("b").await.unwrap();
        let again = store
            .enqueue_notification(s, "a".into(), "a newer".into(), 2, 3)
            .await
            .unwrap();
        assert!(again.deduplicated);
        e("c").await.unwrap();
        let over = e("d").await.unwrap();
        assert_eq!(over.evicted, vec!["a".to_string()], "oldest first");
        assert_eq!(store.notification_backlog().await.unwrap(), (vec![s], 3));
        let b = store.claim_notification(s).await.unwrap().unwrap();
        assert_eq!(b.task_id, "b");
        store.hand_back_notification(b).await.unwrap();
        let mut order = Vec::new();
        for _ in 0..3 {
            order.push(store.claim_notification(s).await.unwrap().unwrap().task_id);
        }
        assert_eq!(order, vec!["b", "c", "d"]);
        assert!(store.claim_notification(s).await.unwrap().is_none());
    }
}
