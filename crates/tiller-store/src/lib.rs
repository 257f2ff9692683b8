//! Tiller's store: sessions and an ordered per-session event log in SQLite
//! (WAL). The only crate that knows SQL; it stores, it decides nothing.
//!
//! All SQLite work runs on one dedicated thread that owns the connection
//! ([`writer`]), but for the checkpoints of its log, which a thread of its
//! own runs beside the commits on a second connection ([`checkpoint`]);
//! callers talk to the writer through a channel, so blocking I/O never
//! runs on the async workers (inline, `tiller acp --embedded`, the
//! caller's thread is the writer and checkpoints too). Commands are executed in the order they
//! are sent, queued appends are committed in batches (awaited ones first,
//! each session's in order), and a reader always sees every append sent
//! before it.
//!
//! Durability is typed: an append either commits with everything it
//! implies ([`LedgerOp`]) or returns an error, and once a session's log
//! loses a write nothing more is written to it until it is reopened
//! ([`Store::reopen_log`]), so a log never has a gap.

#![warn(missing_docs)]

mod checkpoint;
mod db;
mod deliveries;
mod error;
mod index;
mod log;
mod pg;
mod queues;
mod rows;
mod schema;
mod segment;
mod sessions;
mod writer;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;

use rusqlite::Connection;
use tiller_core::SessionId;
use tokio::sync::oneshot;

pub use error::StoreError;

/// How long a node that took a due webhook delivery keeps it from the
/// others (a store shared by a cluster): its attempt ends long before,
/// and if the node dies meanwhile another one retries it after this.
pub const DELIVERY_HOLD_MS: i64 = 120_000;

/// `PRAGMA integrity_check` of the store at `path`, opened read-only and
/// apart from any daemon (a running daemon holds the file exclusively:
/// that is [`StoreError::is_unavailable`]). `Ok` holds SQLite's findings,
/// empty when the file is sound.
pub fn integrity_check(path: &Path) -> Result<Vec<String>, StoreError> {
    let conn = read_only(path)?;
    let mut stmt = conn.prepare("PRAGMA integrity_check")?;
    let found: Vec<String> = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<_, _>>()?;
    Ok(found.into_iter().filter(|f| f != "ok").collect())
}

/// What is wrong with the event log of the store at `path` (opened as
/// [`integrity_check`] opens it), one finding per line: a session two of
/// whose segments hold the same events, or whose index entry names
/// another segment (the daemon refuses reads of such a session; deleting
/// it repairs the store), and segments that name no session (no read
/// reaches them). Empty when the log is sound, or when the file is not
/// at this binary's schema version (the daemon migrates it first).
pub fn damaged_logs(path: &Path) -> Result<Vec<String>, StoreError> {
    let conn = read_only(path)?;
    if schema::version(&conn)? != schema::latest() {
        return Ok(Vec::new());
    }
    Ok(index::damaged(&conn)?)
}

fn read_only(path: &Path) -> Result<Connection, StoreError> {
    if checkpoint::Claim::held(path) {
        return Err(StoreError::InUse {
            path: path.to_owned(),
            here: true,
        });
    }
    let conn = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::from_millis(200))?;
    Ok(conn)
}

/// Called once appends of a session committed, with the highest sequence
/// number among them (what the session may now show), on a task of the
/// runtime the store was opened on (`writer::Courier`; on the store thread
/// without one, the caller's inline), so possibly after later calls to the
/// store were answered; or at once on the store thread when a commit of
/// them failed (`Err`: they are lost, and the session's log stays broken
/// until it is reopened; a session reads its reopen count when told, which
/// must be the failure's moment).
pub type OnCommit = Arc<dyn Fn(Result<u64, Arc<StoreError>>) + Send + Sync>;
use db::Db;
pub use rows::*;
use writer::{Cmd, Pending, Writer};

/// A handle to the store thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    /// Where commands go.
    tx: Route,
    /// Shared with the thread.
    shared: Arc<Shared>,
}

/// What the handles and the thread share.
#[derive(Default)]
pub(crate) struct Shared {
    /// Events sent to be appended and not yet committed (or failed): what
    /// the store holds in memory, reported as `tiller_store_backlog_events`.
    pub(crate) backlog: AtomicUsize,
    /// Set by a test to make every append fail.
    pub(crate) fail_appends: AtomicBool,
    /// Set by a test to hold appends back (a store that falls behind).
    pub(crate) pause_appends: AtomicBool,
    /// Set by a test to hold the store thread at its next upkeep.
    pub(crate) hold_upkeep: AtomicBool,
    /// Set while the store thread waits at a test's hold (appends paused
    /// or an upkeep held).
    pub(crate) held: AtomicBool,
    /// Set by a test to make every checkpoint fail.
    pub(crate) fail_checkpoints: AtomicBool,
    /// Set by a test: milliseconds each of the checkpoint thread's passes
    /// waits first (a slow disk).
    pub(crate) slow_passes: std::sync::atomic::AtomicU64,
    /// Set by a test to make the checkpoint thread's next pass panic.
    pub(crate) crash_passes: AtomicBool,
    /// Set by a test to make every session delete fail.
    pub(crate) fail_deletes: AtomicBool,
    /// Whether several daemons may share the store (PostgreSQL).
    pub(crate) clustered: AtomicBool,
    /// Frames in SQLite's write-ahead log after the last commit (set by
    /// the connection's WAL hook; 0 on PostgreSQL): a checkpoint is due
    /// once there are [`writer::CHECKPOINT_FRAMES`] (inline
    /// [`writer::INLINE_CHECKPOINT_FRAMES`]; after a failed checkpoint,
    /// that many more); see [`checkpoint`].
    pub(crate) wal_frames: AtomicUsize,
    /// Frames written to SQLite's write-ahead log in all (tests read it).
    pub(crate) frames_written: AtomicUsize,
    /// Checkpoints tried, by the checkpoint thread or the writer (tests
    /// read it).
    pub(crate) checkpoints: AtomicUsize,
    /// Of those, the ones the writer ran itself (tests read it).
    pub(crate) writer_checkpoints: AtomicUsize,
    /// Transactions of appends committed (tests read it).
    pub(crate) append_commits: AtomicUsize,
    /// Cron fires the store was asked to record (tests read it).
    pub(crate) cron_fire_calls: AtomicUsize,
    /// Test switches: goal reads, goal writes fail.
    pub(crate) fail_goal_reads: AtomicBool,
    pub(crate) fail_goal_writes: AtomicBool,
    /// Test switch: goal writes are stored but answered as failed (an
    /// answer lost after the commit).
    pub(crate) lose_goal_answers: AtomicBool,
    /// Test switch: marking a session closed fails.
    pub(crate) fail_closes: AtomicBool,
    /// Test switches: reads of a session's notifications, of its cron
    /// fires, fail.
    pub(crate) fail_notification_reads: AtomicBool,
    pub(crate) fail_cron_reads: AtomicBool,
    /// How many calls those switches failed.
    pub(crate) switched_failures: AtomicUsize,
    /// Set by a test: the next commit holding an awaited append is
    /// reported failed though it was stored (a connection lost during
    /// `COMMIT`).
    pub(crate) ambiguous_commit: AtomicBool,
}

impl Shared {
    pub(crate) fn queued(&self, n: usize) {
        let now = self.backlog.fetch_add(n, Ordering::AcqRel) + n;
        metrics::gauge!("tiller_store_backlog_events").set(now as f64);
    }

    pub(crate) fn done(&self, n: usize) {
        let now = self.backlog.fetch_sub(n, Ordering::AcqRel) - n;
        metrics::gauge!("tiller_store_backlog_events").set(now as f64);
    }

    /// Waits on the store thread while a test's hold (`switch`) is on.
    pub(crate) fn hold_while(&self, switch: &AtomicBool) {
        if !switch.load(Ordering::Relaxed) {
            return;
        }
        self.held.store(true, Ordering::Relaxed);
        while switch.load(Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.held.store(false, Ordering::Relaxed);
    }
}

/// The store thread's channel, or the connection itself (inline).
#[derive(Clone)]
enum Route {
    /// Commands to the thread; the thread ends when every handle is dropped.
    Thread(std_mpsc::Sender<Cmd>),
    /// Commands run on the caller's thread, under the lock.
    Inline(Arc<std::sync::Mutex<Option<Writer>>>),
}

impl Route {
    fn send(&self, cmd: Cmd) -> Result<(), Cmd> {
        match self {
            Route::Thread(tx) => tx.send(cmd).map_err(|e| e.0),
            Route::Inline(w) => {
                writer::execute(&mut w.lock().unwrap_or_else(|e| e.into_inner()), cmd)
            }
        }
    }
}

impl Store {
    /// Opens the store for a process with one client on a current-thread
    /// runtime (`tiller acp --embedded`): every command runs at once on
    /// the caller's thread (an append commits before `append` returns), so
    /// no message crosses a thread. The cost: the caller's thread blocks
    /// for each write (page-cache writes; now and then a checkpoint with
    /// its fsyncs, right after the commit that made it due, which the
    /// caller then waits for too), which in that process only its one
    /// client waits for anyway.
    pub fn open_inline(path: &Path) -> Result<Store, StoreError> {
        let (writer, shared) = Self::connect(path, false)?;
        Ok(Store {
            tx: Route::Inline(Arc::new(std::sync::Mutex::new(Some(writer)))),
            shared,
        })
    }

    /// Opens (creating if needed) the database at `path` and starts its thread.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let (mut writer, shared) = Self::connect(path, true)?;
        writer.courier = writer::Courier::spawn();
        let (tx, rx) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("tiller-store".into())
            .spawn(move || writer::run(writer, rx))
            .map_err(|e| StoreError::Io {
                path: path.to_owned(),
                source: e,
            })?;
        Ok(Store {
            tx: Route::Thread(tx),
            shared,
        })
    }

    /// Opens the PostgreSQL database at `url` (a `postgres://` URL or a
    /// libpq key=value string), in `schema` (created if needed), migrates
    /// it and starts the store thread, which owns the connection (and
    /// makes it again when it drops).
    pub fn open_postgres(url: &str, schema: &str) -> Result<Store, StoreError> {
        let (tx, rx) = std_mpsc::channel();
        let (ready_tx, ready) = std_mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.clustered.store(true, Ordering::Relaxed);
        let thread_shared = shared.clone();
        let (url, schema) = (url.to_owned(), schema.to_owned());
        let courier = writer::Courier::spawn();
        // The client blocks on its own runtime: connect on the store
        // thread, never on an async worker.
        std::thread::Builder::new()
            .name("tiller-store".into())
            .spawn(move || match pg::PgDb::connect(&url, &schema) {
                Ok(db) => {
                    let _ = ready_tx.send(Ok(()));
                    let mut w = Writer::new(Box::new(db), thread_shared);
                    w.courier = courier;
                    writer::run(w, rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| StoreError::Config(format!("cannot start the store thread: {e}")))?;
        ready.recv().map_err(|_| StoreError::Closed)??;
        Ok(Store {
            tx: Route::Thread(tx),
            shared,
        })
    }

    /// Opens SQLite's file for the writer; `beside`: with a checkpoint
    /// thread (the store thread's), else (inline) the connection holds
    /// the file alone (`locking_mode = EXCLUSIVE`: no transaction takes
    /// even the process's own locks) and the writer runs every
    /// checkpoint, as the caller's thread has the CPU to spare and a
    /// client of its own waiting anyway.
    fn connect(path: &Path, beside: bool) -> Result<(Writer, Arc<Shared>), StoreError> {
        let open_err = |source: rusqlite::Error| match source.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
                StoreError::InUse {
                    path: path.to_owned(),
                    here: false,
                }
            }
            _ => StoreError::Open {
                path: path.to_owned(),
                source,
            },
        };
        schema::restrict(path).map_err(|e| StoreError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        let claim = checkpoint::Claim::take(path)?;
        let mut conn = checkpoint::open(path).map_err(open_err)?;
        if !beside {
            conn.pragma_update(None, "locking_mode", "EXCLUSIVE")
                .map_err(open_err)?;
        }
        // Every statement the store runs stays prepared (the default of 16
        // is fewer than it has: evicted ones were parsed again per use).
        conn.set_prepared_statement_cache_capacity(256);
        schema::migrate(&conn).map_err(open_err)?;
        // A newer Tiller's database is refused (migrating it ran no step):
        // this binary would neither keep its rules nor know its tables.
        let version = schema::version(&conn).map_err(open_err)?;
        if version > schema::latest() {
            return Err(StoreError::Config(format!(
                "the store at {} has schema version {version}, newer than this Tiller's {}: run the Tiller that wrote it, or a newer one",
                path.display(),
                schema::latest()
            )));
        }
        let shared = Arc::new(Shared::default());
        // The writer checkpoints, not SQLite inside a commit: a commit's
        // callers are answered before the log is copied into the database
        // (see `Writer::checkpoint_if_due`). The hook replaces SQLite's
        // automatic checkpoint; it only counts.
        let frames = shared.clone();
        conn.wal_hook(Some(
            move |_: &mut rusqlite::hooks::Wal, n: std::ffi::c_int| {
                let n = usize::try_from(n).unwrap_or(0);
                let before = frames.wal_frames.swap(n, Ordering::Relaxed);
                // The log started over (after a checkpoint) when it shrank.
                let added = n.checked_sub(before).unwrap_or(n);
                frames.frames_written.fetch_add(added, Ordering::Relaxed);
                Ok(())
            },
        ))
        .map_err(open_err)?;
        let db = db::Sqlite::new(conn).map_err(open_err)?;
        let mut writer = Writer::new(Box::new(db), shared.clone());
        if beside {
            writer.checkpointer = Some(checkpoint::Checkpointer::start(path, shared.clone())?);
        } else {
            writer.set_inline();
        }
        writer.claim = Some(claim);
        Ok((writer, shared))
    }

    /// The one command path: runs `f` on the store thread, in order,
    /// after every append sent before it.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Db) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.call_writer(None, move |w| f(&mut *w.conn)).await
    }

    /// [`Store::call`] for a command about one session: it runs after
    /// every append of that session sent before it, not behind every
    /// other session's (a catch-up read under load waits for its own log
    /// only).
    async fn call_for<T: Send + 'static>(
        &self,
        session: SessionId,
        f: impl FnOnce(&mut dyn Db) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.call_writer(Some(session), move |w| f(&mut *w.conn))
            .await
    }

    async fn call_writer<T: Send + 'static>(
        &self,
        scope: Option<SessionId>,
        f: impl FnOnce(&mut Writer) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, rx) = oneshot::channel();
        let job = Box::new(move |w: &mut Writer| {
            let _ = reply.send(f(w));
        });
        self.tx
            .send(Cmd::Call(scope, job))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Makes every append and cron fire fail (as a full disk would) until
    /// turned off.
    #[cfg(feature = "test-hooks")]
    pub fn fail_appends(&self, on: bool) {
        self.shared.fail_appends.store(on, Ordering::Relaxed);
    }

    /// Makes every session delete and cron job removal fail until turned
    /// off.
    #[cfg(feature = "test-hooks")]
    pub fn fail_deletes(&self, on: bool) {
        self.shared.fail_deletes.store(on, Ordering::Relaxed);
    }

    /// Sets a session aside as if upkeep had found its log damaged (its
    /// reads and appends refused until it is deleted).
    #[cfg(feature = "test-hooks")]
    pub async fn set_aside(&self, session: SessionId, why: &'static str) -> Result<(), StoreError> {
        self.call(move |c| {
            c.set_aside_for_test(session, why);
            Ok(())
        })
        .await
    }

    /// Makes each of the checkpoint thread's passes take `ms` longer.
    #[cfg(feature = "test-hooks")]
    pub fn slow_passes(&self, ms: u64) {
        self.shared.slow_passes.store(ms, Ordering::Relaxed);
    }

    /// Makes the checkpoint thread's next pass panic (the thread ends).
    #[cfg(feature = "test-hooks")]
    pub fn crash_passes(&self) {
        self.shared.crash_passes.store(true, Ordering::Relaxed);
    }

    /// Makes every checkpoint of SQLite's log fail until turned off.
    #[cfg(feature = "test-hooks")]
    pub fn fail_checkpoints(&self, on: bool) {
        self.shared.fail_checkpoints.store(on, Ordering::Relaxed);
    }

    /// Makes the next commit that holds an awaited append (an admission, a
    /// terminal) report a failure the store may recover from, though it
    /// was stored: what a connection lost during `COMMIT` leaves the
    /// caller with.
    #[cfg(feature = "test-hooks")]
    pub fn ambiguous_next_commit(&self) {
        self.shared.ambiguous_commit.store(true, Ordering::Relaxed);
    }

    /// Makes every goal read, and every goal write, fail (or not) until
    /// changed.
    #[cfg(feature = "test-hooks")]
    pub fn fail_goals(&self, reads: bool, writes: bool) {
        self.shared.fail_goal_reads.store(reads, Ordering::Relaxed);
        self.shared
            .fail_goal_writes
            .store(writes, Ordering::Relaxed);
    }

    /// Makes marking a session closed fail (or not) until changed (its
    /// `session_closed` event is still stored).
    #[cfg(feature = "test-hooks")]
    pub fn fail_closes(&self, on: bool) {
        self.shared.fail_closes.store(on, Ordering::Relaxed);
    }

    /// Makes every goal write be stored but answered as failed (what a
    /// connection lost during `COMMIT` leaves the caller with), or not,
    /// until changed.
    #[cfg(feature = "test-hooks")]
    pub fn lose_goal_answers(&self, on: bool) {
        self.shared.lose_goal_answers.store(on, Ordering::Relaxed);
    }

    /// Makes every read of one session's notifications, and of its cron
    /// fires, fail (or not) until changed.
    #[cfg(feature = "test-hooks")]
    pub fn fail_queue_reads(&self, notifications: bool, cron_fires: bool) {
        let s = &self.shared;
        s.fail_notification_reads
            .store(notifications, Ordering::Relaxed);
        s.fail_cron_reads.store(cron_fires, Ordering::Relaxed);
    }

    /// How many goal or queue reads and writes `fail_goals` and
    /// `fail_queue_reads` failed so far (a test checks it was hit).
    #[cfg(feature = "test-hooks")]
    pub fn switched_failures(&self) -> usize {
        self.shared.switched_failures.load(Ordering::Relaxed)
    }

    /// Makes the store behave as one nodes share, as far as the queue
    /// actors can tell (they read a session's queue again at each poll;
    /// `fresh_id` asks the backend, which SQLite cannot answer): for good.
    #[cfg(feature = "test-hooks")]
    pub fn read_queues_as_if_shared(&self) {
        self.shared.clustered.store(true, Ordering::Relaxed);
    }

    /// How many cron fires the store was asked to record so far.
    #[cfg(feature = "test-hooks")]
    pub fn cron_fire_calls(&self) -> usize {
        self.shared.cron_fire_calls.load(Ordering::Relaxed)
    }

    /// How many transactions of appends committed so far.
    #[cfg(feature = "test-hooks")]
    pub fn append_commits(&self) -> usize {
        self.shared.append_commits.load(Ordering::Relaxed)
    }

    /// Holds every append back (as a store that cannot keep up would)
    /// until turned off; other commands wait behind them, in order.
    #[cfg(feature = "test-hooks")]
    pub fn pause_appends(&self, on: bool) {
        self.shared.pause_appends.store(on, Ordering::Relaxed);
    }

    /// Holds the store thread at its next upkeep (the work between
    /// commits) until turned off.
    #[cfg(feature = "test-hooks")]
    pub fn hold_upkeep(&self, on: bool) {
        self.shared.hold_upkeep.store(on, Ordering::Relaxed);
    }

    /// Whether the store thread waits at a hold ([`Store::pause_appends`],
    /// [`Store::hold_upkeep`]).
    #[cfg(feature = "test-hooks")]
    pub fn writer_held(&self) -> bool {
        self.shared.held.load(Ordering::Relaxed)
    }

    /// Events sent to be appended and not yet committed (nor failed).
    pub fn backlog(&self) -> usize {
        self.shared.backlog.load(Ordering::Acquire)
    }

    /// Sends appends, counted in the backlog until the writer is done
    /// with them.
    fn send_appends(&self, batch: Vec<Pending>) -> Result<(), StoreError> {
        let n = batch.len();
        self.shared.queued(n);
        self.tx.send(Cmd::Append(batch)).map_err(|_| {
            self.shared.done(n);
            StoreError::Closed
        })
    }

    /// Whether several daemons may share this store (PostgreSQL): each
    /// session is then written only by the node holding its lease.
    pub async fn clustered(&self) -> Result<bool, StoreError> {
        self.call(|c| Ok(c.clustered())).await
    }

    /// Whether several nodes share this store (known once it is open):
    /// what one node holds in memory of the queues may then be stale.
    pub fn shared_by_nodes(&self) -> bool {
        self.shared.clustered.load(Ordering::Relaxed)
    }

    /// A queue id no other node uses, when the store is shared (`None`
    /// on SQLite without asking the store thread: one daemon numbers its
    /// own rows).
    pub async fn fresh_id(&self, queue: IdQueue) -> Result<Option<i64>, StoreError> {
        if !self.shared.clustered.load(Ordering::Relaxed) {
            return Ok(None);
        }
        self.call(move |c| c.fresh_id(queue)).await
    }

    /// Records this node in the cluster (its address for the others and
    /// for `tiller cluster status`).
    pub async fn join(&self, node: NodeInfo) -> Result<(), StoreError> {
        self.call(move |c| c.join(&node)).await
    }

    /// Takes the session's lease for `node` if it is free, expired or the
    /// node's own, for `ttl_ms` (the store's clock). From then on every
    /// write for the session checks the lease's fence: once another node
    /// takes it over, this store refuses them ([`StoreError::Fenced`]).
    pub async fn acquire_lease(
        &self,
        session: SessionId,
        node: String,
        ttl_ms: i64,
    ) -> Result<Lease, StoreError> {
        self.call_for(session, move |c| c.acquire_lease(session, &node, ttl_ms))
            .await
    }

    /// Renews the node's heartbeat and every lease it holds; the answer
    /// is the sessions it lost (another node took them over, or deleted
    /// them), each with the fence this node held.
    pub async fn renew_leases(
        &self,
        node: String,
        ttl_ms: i64,
    ) -> Result<Vec<(SessionId, i64)>, StoreError> {
        self.call(move |c| c.renew_leases(&node, ttl_ms)).await
    }

    /// Lets go of the node's leases (`only` those, or all), after every
    /// append already sent; `leave` also removes the node from the cluster.
    pub async fn release_leases(
        &self,
        node: String,
        only: Option<Vec<SessionId>>,
        leave: bool,
    ) -> Result<(), StoreError> {
        self.call(move |c| c.release_leases(&node, only.as_deref(), leave))
            .await
    }

    /// Sessions with work in flight or queued and no live owner (or an
    /// owner that is an earlier run of `node`): someone must take them.
    pub async fn orphans(&self, node: String, limit: usize) -> Result<Vec<SessionId>, StoreError> {
        self.call(move |c| c.orphans(&node, limit)).await
    }

    /// The cluster's nodes, their addresses, leases and heartbeat ages.
    pub async fn cluster_status(&self) -> Result<Vec<NodeStatus>, StoreError> {
        self.call(|c| c.cluster_status()).await
    }

    /// Stores a new session (durable when this returns).
    pub async fn create_session(&self, rec: SessionRecord) -> Result<(), StoreError> {
        self.call(move |c| c.create_session(&rec, None)).await
    }

    /// Stores a new session and the engine it runs, in one transaction
    /// (durable when this returns; all or nothing).
    pub async fn create_session_with_engine(
        &self,
        rec: SessionRecord,
        engine: String,
    ) -> Result<(), StoreError> {
        self.call(move |c| c.create_session(&rec, Some(&engine)))
            .await
    }

    /// A session and the head of its log.
    pub async fn get_session(
        &self,
        id: SessionId,
    ) -> Result<Option<(SessionRecord, LogHead)>, StoreError> {
        self.call_for(id, move |c| c.get_session(id)).await
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
        let limit = limit.clamp(1, 1000);
        self.call(move |c| c.list_sessions(cursor, limit, cwd.as_deref()))
            .await
    }

    /// Stores one piece of a session's state (engine, settings JSON).
    pub async fn save_state(
        &self,
        id: SessionId,
        column: StateColumn,
        value: String,
    ) -> Result<(), StoreError> {
        self.call_for(id, move |c| c.save_state(id, column, &value))
            .await
    }

    /// Applies a change to a session's stored conversation (one
    /// transaction: what a turn appended, what trimming dropped).
    pub async fn save_conversation(
        &self,
        id: SessionId,
        write: ConversationWrite,
    ) -> Result<(), StoreError> {
        self.call_for(id, move |c| c.save_conversation(id, &write))
            .await
    }

    /// A session's stored state (empty when nothing was saved).
    pub async fn load_state(&self, id: SessionId) -> Result<SessionExtras, StoreError> {
        self.call_for(id, move |c| c.load_state(id)).await
    }

    /// Durable replay guard for channel requests: true when `key` is new.
    pub async fn channel_seen(
        &self,
        key: String,
        now_s: i64,
        window_s: i64,
    ) -> Result<bool, StoreError> {
        self.call(move |c| c.channel_seen(&key, now_s, window_s))
            .await
    }

    /// Forgets a channel request key [`Store::channel_seen`] recorded at
    /// `seen_s`: its request was not admitted.
    pub async fn channel_unseen(&self, key: String, seen_s: i64) -> Result<(), StoreError> {
        self.call(move |c| c.channel_unseen(&key, seen_s)).await
    }

    /// Sets (or clears) a session's title.
    pub async fn set_title(&self, id: SessionId, title: Option<String>) -> Result<(), StoreError> {
        self.call_for(id, move |c| c.set_title(id, title.as_deref()))
            .await
    }

    /// Marks a session closed.
    pub async fn close_session(&self, id: SessionId) -> Result<(), StoreError> {
        self.failing(&self.shared.fail_closes)?;
        self.call_for(id, move |c| c.close_session(id)).await
    }

    /// Removes a session and everything kept for it (see
    /// [`sessions::delete`]); false when nothing of it was there. Ordered after
    /// every append issued before it.
    pub async fn delete_session(&self, id: SessionId) -> Result<bool, StoreError> {
        self.call_writer(Some(id), move |w| {
            if w.shared.fail_deletes.load(Ordering::Relaxed) {
                return Err(StoreError::Injected);
            }
            let deleted = w.conn.delete_session(id)?;
            w.broken.remove(&id);
            w.reopened.insert(id);
            w.heads.forget([id]);
            Ok(deleted)
        })
        .await
    }

    /// Appends (and updates the ledger) without waiting. Ordered with
    /// every other command; a failure breaks the session's log, so the
    /// next awaited append of that session reports it. `on_commit` hears
    /// when it committed, or that it failed.
    pub fn append(
        &self,
        event: StoredEvent,
        ledger: Option<LedgerOp>,
        on_commit: Option<OnCommit>,
    ) {
        let _ = self.send_appends(vec![Pending {
            event,
            ledger: ledger.map(Box::new),
            reply: None,
            on_commit,
            joined: false,
        }]);
    }

    /// Appends several events in order (not awaited), committed together
    /// unless the store is already holding more; `on_commit` hears the
    /// highest sequence number committed.
    pub fn append_many(&self, events: Vec<(StoredEvent, Option<LedgerOp>)>, on_commit: OnCommit) {
        if events.is_empty() {
            return;
        }
        let _ = self.send_appends(pending(events, Some(on_commit)));
    }

    /// Appends and waits for the commit (durable before acknowledged). An
    /// error means neither this event nor any later one of its session is
    /// stored until [`Store::reopen_log`].
    pub async fn append_durable(
        &self,
        event: StoredEvent,
        ledger: Option<LedgerOp>,
    ) -> Result<(), StoreError> {
        self.append_durable_after(Vec::new(), event, ledger).await
    }

    /// [`Store::append_durable`] after `before` (events of the same
    /// session, appended in order first, in the same transaction, so its
    /// outcome is theirs): one commit for what a session had not yet sent
    /// and the event it must wait for.
    pub async fn append_durable_after(
        &self,
        before: Vec<(StoredEvent, Option<LedgerOp>)>,
        event: StoredEvent,
        ledger: Option<LedgerOp>,
    ) -> Result<(), StoreError> {
        // One session's (the writer queues each session's appends apart:
        // a joined group is one session's).
        debug_assert!(before.iter().all(|(e, _)| e.session == event.session));
        let (reply, rx) = oneshot::channel();
        let mut batch = pending(before, None);
        // One transaction for all of it, however the writer cuts batches.
        for p in &mut batch {
            p.joined = true;
        }
        batch.push(Pending {
            event,
            ledger: ledger.map(Box::new),
            joined: false,
            reply: Some(reply),
            on_commit: None,
        });
        self.send_appends(batch)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Accepts appends to a session's log again (after a failed one) and
    /// returns the head of what is stored.
    pub async fn reopen_log(&self, session: SessionId) -> Result<LogHead, StoreError> {
        self.call_writer(Some(session), move |w| {
            let head = w.conn.head(session)?;
            w.note_reconnect();
            w.broken.remove(&session);
            w.reopened.insert(session);
            w.heads.forget([session]);
            Ok(head)
        })
        .await
    }

    /// Up to `limit` events with `seq < before` (all when `before` is
    /// `None`), oldest first, and whether older ones exist.
    pub async fn history(
        &self,
        session: SessionId,
        before: Option<u64>,
        limit: usize,
    ) -> Result<HistoryPage, StoreError> {
        // No sequence number is above i64::MAX (both backends store them
        // signed).
        let before = before.map_or(u64::MAX >> 1, |b| b.min(u64::MAX >> 1));
        let limit = limit.clamp(1, 10_000);
        self.call_for(session, move |c| c.history(session, before, limit))
            .await
    }

    /// The newest event of a session whose kind is one of `kinds`.
    pub async fn last_of_kinds(
        &self,
        session: SessionId,
        kinds: &[&'static str],
    ) -> Result<Option<StoredEvent>, StoreError> {
        let kinds = kinds.to_vec();
        self.call_for(session, move |c| c.last_of_kinds(session, &kinds))
            .await
    }

    /// Events of a session with `seq > after`, oldest first.
    pub async fn events_after(
        &self,
        session: SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        // Nothing follows i64::MAX (see `history`).
        let after = after.min(u64::MAX >> 1);
        self.call_for(session, move |c| c.events_after(session, after, limit))
            .await
    }

    /// Prompts admitted and never settled, oldest first.
    pub async fn unsettled(&self) -> Result<Vec<Unsettled>, StoreError> {
        self.call(|c| c.unsettled()).await
    }

    /// Whether the database answers: a trivial query, in order after what
    /// was sent before (`/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        // Scoped to no session: it does not wait behind the write backlog.
        self.call_for(SessionId::from_u128(0), |c| c.ping()).await
    }

    /// Waits until every command sent before it is committed.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.call(|_| Ok(())).await
    }

    /// Runs what was sent before, then closes the database (its lock is
    /// released: another process, or a test's next `open`, may take it).
    /// Every later command of any handle fails with `Closed`.
    pub async fn close(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Cmd::Close(reply)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Stores what the notification core decided (durable when this
    /// returns; all or nothing).
    pub async fn notification_changes(
        &self,
        changes: Vec<tiller_core::notify::Change>,
    ) -> Result<(), StoreError> {
        self.call(move |c| c.notification_changes(&changes)).await
    }

    /// Every queued notification, oldest first.
    pub async fn notifications(&self) -> Result<Vec<Notification>, StoreError> {
        self.call(|c| c.notifications(None)).await
    }

    /// One session's queued notifications, oldest first.
    pub async fn notifications_of(
        &self,
        session: SessionId,
    ) -> Result<Vec<Notification>, StoreError> {
        self.failing(&self.shared.fail_notification_reads)?;
        self.call(move |c| c.notifications(Some(session))).await
    }

    /// Sessions that have queued notifications, and how many are queued.
    pub async fn notification_backlog(&self) -> Result<(Vec<SessionId>, usize), StoreError> {
        self.call(|c| c.notification_backlog()).await
    }

    /// Stores a new cron job.
    pub async fn cron_add(&self, job: CronJob) -> Result<(), StoreError> {
        self.call(move |c| c.cron_add(&job)).await
    }

    /// Every cron job.
    pub async fn cron_list(&self) -> Result<Vec<CronJob>, StoreError> {
        self.call(|c| c.cron_list()).await
    }

    /// Removes a job (and its waiting fire); false when there was none.
    pub async fn cron_remove(&self, id: String) -> Result<bool, StoreError> {
        let fail = self.shared.fail_deletes.load(Ordering::Relaxed);
        self.call(move |c| {
            if fail {
                return Err(StoreError::Injected);
            }
            c.cron_remove(&id)
        })
        .await
    }

    /// Stores what the cron core decided for a fire of job `job_id` and
    /// moves the job from its due time `from_to.0` to its next,
    /// `from_to.1` (durable when this returns).
    /// [`StoreError::AlreadyClaimed`], with nothing written, when the job
    /// was no longer due at `from_to.0`: another node fired it.
    pub async fn cron_fire(
        &self,
        change: tiller_core::cron::FireChange,
        job_id: String,
        from_to: (i64, i64),
    ) -> Result<(), StoreError> {
        self.shared.cron_fire_calls.fetch_add(1, Ordering::Relaxed);
        // A full disk fails it as it fails appends.
        let fail = self.shared.fail_appends.load(Ordering::Relaxed);
        self.call(move |c| {
            if fail {
                return Err(StoreError::Injected);
            }
            c.cron_fire(&change, &job_id, from_to)
        })
        .await
    }

    /// Every waiting fire, oldest first.
    pub async fn cron_fires(&self) -> Result<Vec<CronFire>, StoreError> {
        self.call(|c| c.cron_fires(None)).await
    }

    /// One session's waiting fires, oldest first.
    pub async fn cron_fires_of(&self, session: SessionId) -> Result<Vec<CronFire>, StoreError> {
        self.failing(&self.shared.fail_cron_reads)?;
        self.call(move |c| c.cron_fires(Some(session))).await
    }

    /// Sessions with waiting fires.
    pub async fn cron_backlog(&self) -> Result<Vec<SessionId>, StoreError> {
        self.call(|c| c.cron_backlog()).await
    }

    /// A session's goal.
    pub async fn goal_get(&self, session: SessionId) -> Result<Option<GoalRow>, StoreError> {
        self.failing(&self.shared.fail_goal_reads)?;
        self.call(move |c| c.goal_get(session)).await
    }

    /// Stores (replaces) a session's goal.
    pub async fn goal_put(&self, goal: GoalRow) -> Result<(), StoreError> {
        self.failing(&self.shared.fail_goal_writes)?;
        self.call(move |c| c.goal_put(&goal)).await?;
        self.failing(&self.shared.lose_goal_answers)
    }

    /// A test switch made this fail.
    fn failing(&self, switch: &AtomicBool) -> Result<(), StoreError> {
        match switch.load(Ordering::Relaxed) {
            true => {
                self.shared
                    .switched_failures
                    .fetch_add(1, Ordering::Relaxed);
                Err(StoreError::Injected)
            }
            false => Ok(()),
        }
    }

    /// Clears a session's goal; false when it had none.
    pub async fn goal_delete(&self, session: SessionId) -> Result<bool, StoreError> {
        self.call(move |c| c.goal_delete(session)).await
    }

    /// Sessions whose goal is active.
    pub async fn goals_active(&self) -> Result<Vec<SessionId>, StoreError> {
        self.call(|c| c.goals_active()).await
    }

    /// Deliveries due at `now_ms`, oldest first. On a store shared by a
    /// cluster they are taken: no other node sees them for
    /// [`DELIVERY_HOLD_MS`] (or until [`Store::delivery_done`]). One
    /// daemon on SQLite keeps track of its attempts itself.
    pub async fn deliveries_due(&self, now_ms: i64) -> Result<Vec<Delivery>, StoreError> {
        self.call(move |c| c.deliveries_due(now_ms)).await
    }

    /// An attempt of `d` (as [`Store::deliveries_due`] gave it) starts at
    /// `now_ms`: true, with the delivery held [`DELIVERY_HOLD_MS`] from
    /// now, while no other node took it since; false when one did (or it
    /// is gone): the attempt is not made.
    pub async fn delivery_start(&self, d: &Delivery, now_ms: i64) -> Result<bool, StoreError> {
        let (id, held) = (d.id, d.next_at_ms);
        let until = now_ms.saturating_add(DELIVERY_HOLD_MS);
        self.call(move |c| c.delivery_start(id, held, until)).await
    }

    /// Marks a delivery sent or given up (`retry = None`), or schedules its
    /// next attempt.
    pub async fn delivery_done(
        &self,
        id: i64,
        retry: Option<(i64, u32)>,
    ) -> Result<(), StoreError> {
        self.call(move |c| c.delivery_done(id, retry)).await
    }
}

#[cfg(test)]
mod index_tests;
#[cfg(test)]
mod tests;

fn pending(
    events: Vec<(StoredEvent, Option<LedgerOp>)>,
    on_commit: Option<OnCommit>,
) -> Vec<Pending> {
    let mut out = Vec::with_capacity(events.len() + 1);
    out.extend(events.into_iter().map(|(event, ledger)| Pending {
        event,
        ledger: ledger.map(Box::new),
        reply: None,
        on_commit: on_commit.clone(),
        joined: false,
    }));
    out
}
