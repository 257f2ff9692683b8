//! SQLite's write-ahead log copied into the database on a thread of its
//! own, beside the store thread's commits.
//!
//! A checkpoint copies the log's new pages into the database and syncs
//! both files: milliseconds, most of them fsyncs. Run by the writer, it is
//! what a durable append queued meanwhile waits for (a cancel's terminal
//! above all), whichever session it is for. SQLite lets a checkpoint run
//! on another connection while the writer commits (`PASSIVE`), so the
//! store thread only asks for one: the [`Checkpointer`]'s thread copies
//! what was committed when a pass starts, and the writer's first commit
//! after a pass that nothing was committed during starts the log over.
//! An inline store (`tiller acp --embedded`: one client, on the caller's
//! thread) has no such thread: its writer checkpoints, as before.
//!
//! Two connections to one file need locks between them, where the store
//! held one connection in `locking_mode = EXCLUSIVE`. Both are opened on
//! SQLite's `unix-excl` VFS: the process takes the file's lock once, at
//! the first read, and keeps it (another process, a second daemon, is
//! refused as before), and the locks between its own connections and the
//! log's index stay in the process's memory (no `-shm` file), so a
//! transaction makes no more system calls than it did. Within the
//! process, [`Claim`] refuses a second store on the same file.
//!
//! Under writes that never pause (many sessions streaming), every pass
//! ends with frames committed during it and the log never starts over;
//! once it holds [`WAL_CAP_FRAMES`] the writer waits for the pass under
//! way (the thread stops at the cap) and runs the checkpoint itself
//! between commits, over what came during that pass (near the cap the
//! thread passes again at once, so that is little). The log stays
//! bounded however slow the disk. A thread that ended (a panic) is not
//! waited for: the writer checkpoints itself from then on.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};

use crate::writer::{CHECKPOINT_FRAMES, WAL_CAP_FRAMES};
use crate::{Shared, StoreError};

/// The VFS both connections use (see the module's text).
pub(crate) const VFS: &str = "unix-excl";

/// Opens the database file at `path` on [`VFS`] (creating it).
pub(crate) fn open(path: &Path) -> rusqlite::Result<Connection> {
    Connection::open_with_flags_and_vfs(path, OpenFlags::default(), VFS)
}

/// Copies the log on a thread of its own while the writer commits.
/// Dropped with the writer (after its connection): the thread finishes
/// the pass it is in, its connection closes, and the file is let go.
pub(crate) struct Checkpointer {
    asks: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
    state: Arc<State>,
}

/// What the writer and the thread share.
#[derive(Default)]
struct State {
    /// Set by the writer when it asks, cleared by the thread once it
    /// stops passing (under `idle`, whose waiters it then wakes): the
    /// writer asks again, or checkpoints itself, only when the thread is
    /// idle.
    running: AtomicBool,
    idle: Mutex<()>,
    wake: Condvar,
}

impl State {
    fn stopped(&self) {
        let _held = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.running.store(false, Ordering::Release);
        self.wake.notify_all();
    }
}

/// Clears `running` when the thread stops passing, or unwinds.
struct Stopped<'a>(&'a State);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.stopped();
    }
}

impl Checkpointer {
    /// Opens the thread's connection to the migrated database at `path`
    /// and starts it.
    pub(crate) fn start(path: &Path, shared: Arc<Shared>) -> Result<Checkpointer, StoreError> {
        let open_err = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let conn = open(path).map_err(open_err)?;
        // The same durability as the writer's: the log is synced before
        // its pages are copied, the database after.
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(open_err)?;
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(open_err)?;
        let (asks, rx) = sync_channel(1);
        let state = Arc::new(State::default());
        let thread = {
            let state = state.clone();
            std::thread::Builder::new()
                .name("tiller-checkpoint".into())
                .spawn(move || passes(conn, rx, &state, &shared))
                .map_err(|e| StoreError::Io {
                    path: path.to_owned(),
                    source: e,
                })?
        };
        Ok(Checkpointer {
            asks: Some(asks),
            thread: Some(thread),
            state,
        })
    }

    /// Whether a pass is under way.
    pub(crate) fn running(&self) -> bool {
        self.state.running.load(Ordering::Acquire)
    }

    /// Whether the thread ended while the writer still has it (a panic):
    /// the writer then checkpoints itself.
    pub(crate) fn dead(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits until the thread is idle (it stops passing at the cap, so at
    /// most the rest of one pass), or dead.
    pub(crate) fn wait_idle(&self) {
        let mut held = self.state.idle.lock().unwrap_or_else(|e| e.into_inner());
        while self.running() && !self.dead() {
            held = self
                .state
                .wake
                .wait_timeout(held, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Asks the thread for a pass; false when it is in one already (or
    /// gone).
    pub(crate) fn ask(&self) -> bool {
        if self.running() {
            return false;
        }
        let Some(asks) = &self.asks else { return false };
        self.state.running.store(true, Ordering::Release);
        match asks.try_send(()) {
            Ok(()) => true,
            Err(TrySendError::Full(())) => true,
            Err(TrySendError::Disconnected(())) => {
                self.state.stopped();
                false
            }
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.asks = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread's loop: asked by the writer once the log is due, it passes
/// over it until the log can start over (a pass with nothing committed
/// during it), the writer's turn comes (the cap), a pass fails, or the
/// writer is gone.
fn passes(conn: Connection, asks: Receiver<()>, state: &State, shared: &Shared) {
    while asks.recv().is_ok() {
        let _stopped = Stopped(state);
        loop {
            let from = shared.wal_frames.load(Ordering::Relaxed);
            let copied = pass(&conn, shared, from);
            if !copied || !again(&asks, shared, from) {
                break;
            }
        }
    }
}

/// Pauses between looks at the log after a pass.
const SETTLE: Duration = Duration::from_millis(2);

/// After a pass over the log's first `from` frames: whether to pass
/// again. Not when nothing was committed during it (the writer's next
/// commit starts the log over), nor once the log started over, reached
/// the cap or the writer is gone. Again once it grew by
/// [`CHECKPOINT_FRAMES`] (at once within that of the cap), or as soon as
/// it stops growing for a moment: that pass copies everything, and the
/// log starts over at the next commit.
fn again(asks: &Receiver<()>, shared: &Shared, from: usize) -> bool {
    let frames = || shared.wal_frames.load(Ordering::Relaxed);
    let mut seen = frames();
    loop {
        if seen <= from || seen >= WAL_CAP_FRAMES {
            return false;
        }
        if seen >= from + CHECKPOINT_FRAMES || seen + CHECKPOINT_FRAMES >= WAL_CAP_FRAMES {
            // Due again; near the cap at once, so that what the writer
            // copies itself there is only what came during the last pass.
            return true;
        }
        std::thread::sleep(SETTLE);
        if matches!(asks.try_recv(), Err(TryRecvError::Disconnected)) {
            return false;
        }
        let now = frames();
        if now == seen {
            return true;
        }
        seen = now;
    }
}

/// One pass, timed: whether it copied every frame the log held when it
/// began (a failure loses nothing: the log keeps every frame).
fn pass(conn: &Connection, shared: &Shared, frames: usize) -> bool {
    assert!(
        !shared.crash_passes.load(Ordering::Relaxed),
        "a test made the checkpoint thread panic"
    );
    let slow = shared.slow_passes.load(Ordering::Relaxed);
    if slow > 0 {
        std::thread::sleep(Duration::from_millis(slow));
    }
    match timed(shared, "thread", || passive(conn)) {
        Ok(all) => all,
        Err(e) => {
            tracing::warn!(error = %e, frames, "checkpoint of the store's write-ahead log failed");
            false
        }
    }
}

/// Runs a checkpoint (or fails it, when a test says so), counted and
/// timed as `tiller_store_checkpoint_seconds` (`by`: `thread` or
/// `writer`).
pub(crate) fn timed(
    shared: &Shared,
    by: &'static str,
    run: impl FnOnce() -> Result<bool, StoreError>,
) -> Result<bool, StoreError> {
    let started = Instant::now();
    shared.checkpoints.fetch_add(1, Ordering::Relaxed);
    let outcome = if shared.fail_checkpoints.load(Ordering::Relaxed) {
        Err(StoreError::Injected)
    } else {
        run()
    };
    metrics::histogram!("tiller_store_checkpoint_seconds", "by" => by)
        .record(started.elapsed().as_secs_f64());
    outcome
}

/// One `PASSIVE` checkpoint on `conn`: whether it copied every frame the
/// log held when it began (nothing blocks it but another checkpoint).
pub(crate) fn passive(conn: &Connection) -> Result<bool, StoreError> {
    let (busy, log, copied): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    Ok(busy == 0 && copied >= log)
}

/// How long an open waits for the file's lock (SQLite's busy timeout on
/// the writer's connection) or a claim of this process to be let go.
pub(crate) const BUSY_WAIT: Duration = Duration::from_secs(5);

/// Database files open in this process (device and inode): the
/// process-wide lock of [`VFS`] keeps other processes out, not a second
/// store of this one.
static CLAIMED: Mutex<Option<HashSet<(u64, u64)>>> = Mutex::new(None);

/// This process's claim on a database file, let go when dropped.
pub(crate) struct Claim(u64, u64);

impl Claim {
    /// Claims the file at `path` (which exists), or answers
    /// [`StoreError::InUse`] when a store of this process still holds it
    /// after [`BUSY_WAIT`] (as SQLite waits for another process's lock).
    pub(crate) fn take(path: &Path) -> Result<Claim, StoreError> {
        let id = file_id(path)?;
        let deadline = Instant::now() + BUSY_WAIT;
        loop {
            {
                let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
                if claimed.get_or_insert_with(HashSet::new).insert(id) {
                    return Ok(Claim(id.0, id.1));
                }
            }
            if Instant::now() >= deadline {
                return Err(StoreError::InUse {
                    path: path.to_owned(),
                    here: true,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Whether a store of this process holds the file at `path`.
    pub(crate) fn held(path: &Path) -> bool {
        let Ok(id) = file_id(path) else { return false };
        let claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        claimed.as_ref().is_some_and(|c| c.contains(&id))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = claimed.as_mut() {
            c.remove(&(self.0, self.1));
        }
    }
}

fn file_id(path: &Path) -> Result<(u64, u64), StoreError> {
    let m = std::fs::metadata(path).map_err(|source| StoreError::Io {
        path: PathBuf::from(path),
        source,
    })?;
    Ok((m.dev(), m.ino()))
}
