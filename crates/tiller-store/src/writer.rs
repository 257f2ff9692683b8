//! The store thread: the one owner of the connection. Commands run in the
//! order they are sent; queued appends commit in batches (see
//! [`next_batch`]; one transaction per session when a shared one fails, so
//! one session's failure never costs another its events).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tiller_core::SessionId;
use tokio::sync::oneshot;

use crate::checkpoint::{self, Checkpointer, Claim};
use crate::db::Db;
use crate::{LedgerOp, OnCommit, Shared, StoreError, StoredEvent, log};

pub(crate) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// A command for the thread: a closure over the writer, or an append.
pub(crate) enum Cmd {
    /// Every command but appends: one closure each, no per-command enum.
    /// It runs after every append sent before it of the session it names,
    /// or of every session (`None`).
    Call(Option<SessionId>, Box<dyn FnOnce(&mut Writer) + Send>),
    /// Closes the connection (releasing the database's lock) and ends the
    /// thread; later commands fail with `Closed`.
    Close(oneshot::Sender<()>),
    /// Appends, in order (and updates the ledger); each `reply` answers
    /// after the commit.
    Append(Vec<Pending>),
}

/// One event waiting to be appended.
pub(crate) struct Pending {
    pub(crate) event: StoredEvent,
    /// Boxed: few events carry one, and a `Pending` is moved a few times
    /// on its way through the writer (304 bytes with it inline, 168 boxed).
    pub(crate) ledger: Option<Box<LedgerOp>>,
    pub(crate) reply: Option<Reply<()>>,
    /// Told the session's highest committed sequence number.
    pub(crate) on_commit: Option<OnCommit>,
    /// Commits in the same transaction as the event queued right after it
    /// (what a durable append carries before it: a start and its message).
    pub(crate) joined: bool,
}

/// The appends waiting to be written: each session's in a lane of its
/// own, in the order sent, so a batch costs its own size whatever else
/// waits (no queue is read through or moved to pick a batch out of it).
#[derive(Default)]
pub(crate) struct Queue {
    lanes: foldhash::HashMap<SessionId, Lane>,
    /// Every session with a lane, once, in turn: a streamed batch takes
    /// sessions from the front and puts back at the end those it left
    /// appends of (a long stream cannot hold the others back).
    order: VecDeque<SessionId>,
    /// An entry per awaited append, in the order sent: its session and its
    /// ticket. An entry is its lane's turn while its ticket is the lane's
    /// oldest (its awaited append is the oldest one queued); else it is
    /// stale (its append went with a streamed batch, or its session's turn
    /// came with an earlier one, or its lane is gone) and passed over. So a
    /// session's turn comes where its oldest queued awaited append was
    /// sent, never earlier.
    urgent: VecDeque<(SessionId, u64)>,
    /// The last ticket given.
    tickets: u64,
    /// Appends queued, in every lane.
    len: usize,
}

/// Lanes an emptied queue keeps room for; past that, it lets go of the
/// room a burst made (a thousand sessions' backlog once would otherwise
/// hold its peak for the daemon's life).
const KEPT: usize = 1024;

/// Least time between two commits of streamed appends only, on the store
/// thread: a stream's events wait that long for the next ones, so a
/// store thread that keeps up does not commit every few events apart
/// (each commit has its cost, and its sessions' fan-out). Not while an
/// awaited append is queued, nor while more sessions than one commit
/// takes are (a backlog is written without a pause).
const STREAM_GAP: Duration = Duration::from_millis(1);

impl Queue {
    /// How much longer queued streamed appends wait, after a streamed
    /// commit at `last`: none when nothing is queued, an awaited append
    /// is, or more than `sessions` sessions' appends are.
    fn lingers(&self, last: Instant, sessions: usize) -> Option<Duration> {
        if self.is_empty() || !self.urgent.is_empty() || self.order.len() > sessions {
            return None;
        }
        STREAM_GAP
            .checked_sub(last.elapsed())
            .filter(|d| !d.is_zero())
    }
}

/// One session's queued appends, in the order sent.
#[derive(Default)]
struct Lane {
    items: VecDeque<Pending>,
    /// The tickets of its awaited appends, oldest first (one per awaited
    /// append queued).
    awaited: VecDeque<u64>,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, p: Pending) {
        let s = p.event.session;
        let lane = match self.lanes.entry(s) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                self.order.push_back(s);
                v.insert(Lane::default())
            }
        };
        if p.reply.is_some() {
            self.tickets += 1;
            lane.awaited.push_back(self.tickets);
            self.urgent.push_back((s, self.tickets));
        }
        lane.items.push_back(p);
        self.len += 1;
    }

    /// Takes `session`'s queued appends, all of them (its lane stays,
    /// empty, until its turn comes).
    fn take_session(&mut self, session: SessionId) -> Queue {
        let Some(lane) = self.lanes.get_mut(&session) else {
            return Queue::default();
        };
        let items = std::mem::take(&mut lane.items);
        lane.awaited.clear();
        self.len -= items.len();
        self.tidy();
        items.into_iter().collect()
    }

    /// Once nothing is queued, forgets the emptied lanes and stale
    /// entries (else they go one by one as their turn comes).
    fn tidy(&mut self) {
        if self.len == 0 {
            self.lanes.clear();
            self.order.clear();
            self.urgent.clear();
            self.lanes.shrink_to(KEPT);
            self.order.shrink_to(KEPT);
            self.urgent.shrink_to(KEPT);
        }
    }
}

impl Lane {
    /// Moves its front append to `batch`; whether it is joined to the
    /// next.
    fn pop_into(&mut self, batch: &mut Vec<Pending>) -> Option<bool> {
        let p = self.items.pop_front()?;
        if p.reply.is_some() {
            self.awaited.pop_front();
        }
        let joined = p.joined;
        batch.push(p);
        Some(joined)
    }
}

impl Extend<Pending> for Queue {
    fn extend<I: IntoIterator<Item = Pending>>(&mut self, appends: I) {
        for p in appends {
            self.push(p);
        }
    }
}

impl FromIterator<Pending> for Queue {
    fn from_iter<I: IntoIterator<Item = Pending>>(appends: I) -> Self {
        let mut q = Queue::default();
        q.extend(appends);
        q
    }
}

/// What the thread owns.
pub(crate) struct Writer {
    pub(crate) conn: Box<dyn Db>,
    /// Sessions whose log lost a write: later appends to them are refused
    /// (a gap would break the log) until the session is reopened.
    pub(crate) broken: HashSet<SessionId>,
    /// The backlog count and the test switches.
    pub(crate) shared: Arc<Shared>,
    /// Recently written sessions' last sequence numbers.
    pub(crate) heads: log::Heads,
    /// Set when the connection was made again: every session's log is
    /// refused until it is reopened (its head read on the new connection).
    pub(crate) all_broken: bool,
    /// The sessions reopened since `all_broken` was set.
    pub(crate) reopened: HashSet<SessionId>,
    /// The log's length in frames that makes a checkpoint due: after one
    /// failed, as many more as make one due (see `checkpoint_every`; not
    /// every commit) before the next try.
    checkpoint_at: usize,
    /// The thread that checkpoints beside the commits (SQLite's store
    /// thread; none inline or on PostgreSQL). Dropped after the
    /// connection.
    pub(crate) checkpointer: Option<Checkpointer>,
    /// This process's claim on SQLite's file, let go once both
    /// connections are closed.
    pub(crate) claim: Option<Claim>,
    /// An inline store's writer (see [`INLINE_CHECKPOINT_FRAMES`]).
    inline: bool,
    /// Carries each batch's commit notices to the async runtime (see
    /// [`Courier`]); none inline or without a runtime.
    pub(crate) courier: Option<Courier>,
}

/// One session's commit notice: its [`OnCommit`] and its highest
/// committed sequence number.
type Notice = (OnCommit, u64);

/// Hands a batch's commit notices to a task on the async runtime, which
/// tells each session. Called on the store thread, each notice would wake
/// its session's actor through the runtime's shared injection queue, a
/// FIFO: a few hundred streaming sessions a commit put a millisecond of
/// work there, and an awaited append's answer (a cancel's terminal,
/// woken the same way) waited behind the previous commits' notices, up to
/// 1.5 ms. Told from a worker, the wakes go to that worker's own queue;
/// the injection queue keeps only the answers, which a worker takes up
/// between tasks. One wake a batch, not one a session.
pub(crate) struct Courier(tokio::sync::mpsc::UnboundedSender<Vec<Notice>>);

impl Courier {
    /// A courier on the caller's runtime, none outside one. Unbounded: it
    /// holds what commits told and the runtime has not run yet (a notice
    /// is a pointer and a number, and the store's backlog bounds commits).
    pub(crate) fn spawn() -> Option<Courier> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Notice>>();
        rt.spawn(async move {
            while let Some(notices) = rx.recv().await {
                for (tell, seq) in notices {
                    tell(Ok(seq));
                }
            }
        });
        Some(Courier(tx))
    }
}

/// Tells each session of its commit, through the courier when there is
/// one and its runtime still runs, else here.
fn tell_all(courier: Option<&Courier>, notices: Vec<Notice>) {
    if notices.is_empty() {
        return;
    }
    let notices = match courier {
        Some(c) => match c.0.send(notices) {
            Ok(()) => return,
            Err(back) => back.0,
        },
        None => notices,
    };
    for (tell, seq) in notices {
        tell(Ok(seq));
    }
}

/// Frames in SQLite's write-ahead log that make a checkpoint due (the
/// checkpoint thread's next pass; inline, the writer's own). A quarter of
/// SQLite's own default for its automatic one: a checkpoint the writer
/// runs is a stall (what an awaited append queued meanwhile waits for),
/// and since commits no longer write the log's index (see
/// [`crate::index`]) most frames are new pages, not the same hot ones
/// again, so copying them more often costs little more in all. Measured
/// with `tiller-load`: a checkpoint took 3.5 ms instead of 9 ms, cancels
/// flat out p50 17 ms instead of 30 ms.
pub(crate) const CHECKPOINT_FRAMES: usize = 250;

/// The same for an inline store's writer (`tiller acp --embedded`: one
/// client, whose next request waits for the checkpoint the writer runs).
/// Its commits come one at a time, so a longer log costs it little in
/// SQLite's index of the log, and a checkpoint's two fsyncs are its fixed
/// cost: at 250 frames they were 2.7% of a prompt's CPU, about a checkpoint
/// every hundred prompts (`perf`, 2026-12-07).
pub(crate) const INLINE_CHECKPOINT_FRAMES: usize = 1000;

/// Frames in the write-ahead log past which the writer checkpoints itself
/// (when the checkpoint thread is idle) rather than ask the thread: the
/// log starts over only after a pass that nothing was committed during,
/// which writes that never pause do not leave. 8 MiB of log. A longer
/// log costs every commit more (SQLite's index of the log chains each
/// page's frames: a hot page's every version), a shorter one more of the
/// writer's own checkpoints; measured with `tiller-load`, 1,000 made the
/// writer checkpoint five times in the cancel probe at a model's pace
/// (p99 5.84 ms), 4,000 cost 2,250 instructions a prompt in SQLite's
/// index of the log.
pub(crate) const WAL_CAP_FRAMES: usize = 2000;

/// Most sessions a failed append's log line names.
const NAMED: usize = 8;

/// Most appends committed in one transaction.
const MAX_BATCH: usize = 4096;

/// The thread's loop. Appends are taken off the channel as they come and
/// written in batches (see [`next_batch`]): an awaited append (a durable
/// event: an admission, a terminal) is committed with what its session
/// sent before it, ahead of other sessions' streamed events; those go in
/// slices of at most [`Db::sessions_per_commit`] sessions, since a
/// commit's time is what an awaited append may wait for the commit under
/// way. A session's own order is kept, and a cancel's terminal never waits
/// behind every other session's stream. Any other command waits for every
/// append sent before it (a reader sees them).
pub(crate) fn run(mut w: Writer, rx: std_mpsc::Receiver<Cmd>) {
    let mut queued = Queue::default();
    let mut urgent_last = false;
    let mut streamed_at = Instant::now();
    let mut upkeep = Upkeep::default();
    loop {
        let mut gone = false;
        let slice = w.conn.sessions_per_commit();
        let linger = queued.lingers(streamed_at, slice);
        let first = if upkeep.owed {
            None // what came meanwhile is taken, then the upkeep runs
        } else if queued.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return, // every handle dropped
            }
        } else if let Some(wait) = linger {
            match rx.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    gone = true;
                    None
                }
            }
        } else {
            None
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| match rx.try_recv() {
                Ok(c) => Some(c),
                Err(std_mpsc::TryRecvError::Empty) => None,
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    gone = true;
                    None
                }
            }))
        {
            match cmd {
                Cmd::Append(p) => queued.extend(p),
                Cmd::Call(scope, f) => {
                    match scope {
                        Some(session) => w.write_session(&mut queued, session),
                        None => w.write_all(&mut queued),
                    }
                    f(&mut w);
                    w.note_reconnect();
                    w.upkeep();
                    upkeep.ran();
                }
                Cmd::Close(reply) => {
                    w.write_all(&mut queued);
                    drop(w);
                    let _ = reply.send(());
                    return;
                }
            }
        }
        if gone {
            w.write_all(&mut queued);
            return;
        }
        // An awaited append queued goes in the next batch unless the last
        // was one (the streams' turn then): only then is it worth waiting for.
        if upkeep.now(!urgent_last && !queued.urgent.is_empty()) {
            w.upkeep();
            // What came meanwhile is taken first: an awaited append sent
            // during the upkeep goes in the next batch, not after one more
            // slice of the streams.
            continue;
        }
        if queued.lingers(streamed_at, slice).is_some() {
            continue;
        }
        if let Some(batch) = next_batch(&mut queued, slice, MAX_BATCH, &mut urgent_last) {
            if !urgent_last {
                streamed_at = Instant::now();
            }
            w.append_timed(batch);
            upkeep.owed = true;
        }
    }
}

/// When the work between commits ([`Writer::upkeep`]: the log's index
/// written behind, a checkpoint, each when due) runs: it is owed after
/// each batch, and runs once what came meanwhile is off the channel,
/// unless an awaited append (a cancel's terminal, an admission) is
/// queued then for the next batch: that commits first, and the upkeep
/// right after it. An upkeep takes milliseconds now and then (2.1 ms at
/// the median of those over 0.3 ms with 1,000 sessions streaming at a
/// model's pace, 64 sessions' index a transaction), what such an append
/// would otherwise wait; putting it off once at most bounds what the
/// index keeps waiting in memory.
#[derive(Default)]
struct Upkeep {
    owed: bool,
    /// Put off once already for an awaited append.
    deferred: bool,
}

impl Upkeep {
    fn ran(&mut self) {
        *self = Upkeep::default();
    }

    /// Whether the owed upkeep runs now, `awaited` appends queued or not.
    fn now(&mut self, awaited: bool) -> bool {
        if !self.owed || (awaited && !std::mem::replace(&mut self.deferred, true)) {
            return false;
        }
        self.ran();
        true
    }
}

/// The next batch to write: the sessions with an awaited append, each up
/// to its last awaited one, alone, up to `max` in all (a session cut
/// before the awaited append its turn came for goes on first next time);
/// else the streamed appends of the next
/// `sessions` sessions in turn, each from its oldest, up to
/// `max` ([`MAX_BATCH`]) in all (a session's events per segment do not change:
/// its next slice comes about when its next whole batch would). After a
/// batch of awaited appends the next one is streamed if any waits
/// (`urgent_last`): a steady flow of admissions and terminals cannot
/// starve the streams. A batch never ends inside a joined group.
fn next_batch(
    queued: &mut Queue,
    sessions: usize,
    max: usize,
    urgent_last: &mut bool,
) -> Option<Vec<Pending>> {
    if queued.is_empty() {
        queued.tidy();
        return None;
    }
    let mut batch = Vec::new();
    if !*urgent_last {
        let mut taken = 0;
        while taken < sessions
            && batch.len() < max
            && let Some((s, ticket)) = queued.urgent.pop_front()
        {
            let Some(lane) = queued
                .lanes
                .get_mut(&s)
                .filter(|l| l.awaited.front() == Some(&ticket))
            else {
                continue; // stale
            };
            let mut joined = false;
            while !lane.awaited.is_empty()
                && (batch.len() < max || joined)
                && let Some(j) = lane.pop_into(&mut batch)
            {
                joined = j;
            }
            if lane.awaited.front() == Some(&ticket) {
                // Cut at the limit before its awaited append: its turn
                // goes on first. (Past it, a later awaited append's turn
                // comes where that one was sent.)
                queued.urgent.push_front((s, ticket));
            }
            taken += 1;
        }
        if !batch.is_empty() {
            *urgent_last = true;
            queued.len -= batch.len();
            queued.tidy();
            return Some(batch);
        }
    }
    *urgent_last = false;
    let (mut taken, mut again) = (0, Vec::new());
    while taken < sessions
        && batch.len() < max
        && let Some(s) = queued.order.pop_front()
    {
        let Some(lane) = queued.lanes.get_mut(&s) else {
            continue;
        };
        if !lane.items.is_empty() {
            taken += 1;
            let mut joined = false;
            while (batch.len() < max || joined)
                && let Some(j) = lane.pop_into(&mut batch)
            {
                joined = j;
            }
        }
        if lane.items.is_empty() {
            queued.lanes.remove(&s);
        } else {
            again.push(s);
        }
    }
    queued.order.extend(again);
    queued.len -= batch.len();
    queued.tidy();
    Some(batch)
}

/// Runs one command on the caller's thread (an inline store); the writer
/// is gone once it ran `Close`.
pub(crate) fn execute(slot: &mut Option<Writer>, cmd: Cmd) -> Result<(), Cmd> {
    let Some(w) = slot.as_mut() else {
        return Err(cmd);
    };
    match cmd {
        Cmd::Call(_, f) => f(w),
        Cmd::Append(batch) => w.append_timed(batch),
        Cmd::Close(reply) => {
            *slot = None;
            let _ = reply.send(());
            return Ok(());
        }
    }
    w.upkeep();
    Ok(())
}

impl Writer {
    pub(crate) fn new(conn: Box<dyn Db>, shared: Arc<Shared>) -> Writer {
        Writer {
            conn,
            broken: Default::default(),
            shared,
            heads: Default::default(),
            all_broken: false,
            reopened: Default::default(),
            checkpoint_at: CHECKPOINT_FRAMES,
            checkpointer: None,
            claim: None,
            inline: false,
            courier: None,
        }
    }

    /// Makes this an inline store's writer, which checkpoints every
    /// [`INLINE_CHECKPOINT_FRAMES`].
    pub(crate) fn set_inline(&mut self) {
        self.inline = true;
        self.checkpoint_at = INLINE_CHECKPOINT_FRAMES;
    }

    /// After a reconnect: nothing cached of the logs is trusted, and each
    /// session must be reopened before it appends again.
    pub(crate) fn note_reconnect(&mut self) {
        if self.conn.take_reconnected() {
            tracing::warn!("the store's connection was made again; sessions reload their logs");
            self.heads = Default::default();
            self.all_broken = true;
            self.reopened.clear();
        }
    }

    fn is_broken(&self, s: SessionId) -> bool {
        self.broken.contains(&s) || (self.all_broken && !self.reopened.contains(&s))
    }

    /// What is done between commits: the backend's deferred work when due
    /// (timed with the commits, as `tiller_store_write_seconds`: what a
    /// commit queued meanwhile waits for), then a checkpoint when due.
    /// Deferred work that failed is tried again after the next commit; it
    /// loses nothing (see [`crate::index`]).
    pub(crate) fn upkeep(&mut self) {
        self.shared.hold_while(&self.shared.hold_upkeep);
        let started = Instant::now();
        match self.conn.upkeep() {
            Ok(true) => metrics::histogram!("tiller_store_write_seconds")
                .record(started.elapsed().as_secs_f64()),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "the store's deferred upkeep failed"),
        }
        self.checkpoint_if_due();
    }

    /// Checkpoints SQLite's write-ahead log once it holds
    /// [`CHECKPOINT_FRAMES`] ([`INLINE_CHECKPOINT_FRAMES`] inline), after
    /// the commit that filled it was answered: after each batch of appends and each command (not
    /// between a command's preceding writes and the command), so a burst
    /// taken off the channel at once is checkpointed as it goes. With a
    /// checkpoint thread (the store thread's) the thread is asked (see
    /// [`crate::checkpoint`]): the writer goes on committing meanwhile;
    /// it runs one itself only once the log holds [`WAL_CAP_FRAMES`] and
    /// the thread is idle. Inline, it runs every one, once the log holds
    /// [`INLINE_CHECKPOINT_FRAMES`] (a commit queued meanwhile waits for
    /// it). A checkpoint that failed or could not copy every frame loses
    /// nothing (the log keeps every frame); it is tried again once the log
    /// grew by as many frames more.
    fn checkpoint_if_due(&mut self) {
        let frames = self.shared.wal_frames.load(Ordering::Relaxed);
        let every = self.checkpoint_every();
        if frames + every < self.checkpoint_at {
            // The log started over since a checkpoint failed.
            self.checkpoint_at = every;
        }
        if frames < self.checkpoint_at {
            return;
        }
        if self.checkpointer.as_ref().is_some_and(Checkpointer::dead) {
            tracing::warn!("the store's checkpoint thread stopped; the writer checkpoints itself");
            self.checkpointer = None;
        }
        if let Some(c) = &self.checkpointer {
            if frames < WAL_CAP_FRAMES {
                if c.ask() {
                    self.checkpoint_at = frames + every;
                }
                return;
            }
            // The cap holds: the writer waits for the pass under way (the
            // thread stops at the cap) and copies the rest itself.
            c.wait_idle();
        }
        self.shared
            .writer_checkpoints
            .fetch_add(1, Ordering::Relaxed);
        match checkpoint::timed(&self.shared, "writer", || self.conn.checkpoint()) {
            Ok(true) => {
                // The log starts over at the next commit, which reports it.
                self.shared.wal_frames.store(0, Ordering::Relaxed);
                self.checkpoint_at = every;
            }
            Ok(false) => {
                tracing::warn!(
                    frames,
                    "checkpoint of the store's write-ahead log left frames behind"
                );
                self.checkpoint_at = frames + every;
            }
            Err(e) => {
                tracing::warn!(error = %e, frames, "checkpoint of the store's write-ahead log failed");
                self.checkpoint_at = frames + every;
            }
        }
    }

    /// Frames between checkpoints: [`INLINE_CHECKPOINT_FRAMES`] inline,
    /// else [`CHECKPOINT_FRAMES`] (also once the checkpoint thread is
    /// gone: the log's cap is the thread's). PostgreSQL counts no frames.
    fn checkpoint_every(&self) -> usize {
        if self.inline {
            INLINE_CHECKPOINT_FRAMES
        } else {
            CHECKPOINT_FRAMES
        }
    }

    fn append_timed(&mut self, batch: Vec<Pending>) {
        let n = batch.len();
        self.shared.hold_while(&self.shared.pause_appends);
        let started = Instant::now();
        self.append(batch);
        metrics::histogram!("tiller_store_write_seconds").record(started.elapsed().as_secs_f64());
        self.shared.done(n);
    }

    /// Writes everything queued (each session's in order), in the batches
    /// [`next_batch`] cuts, checkpointing between them when due (not after
    /// the last: the command these writes come before runs first, and its
    /// caller does not wait for a checkpoint).
    fn write_all(&mut self, queued: &mut Queue) {
        let sessions = self.conn.sessions_per_commit();
        let mut urgent_last = false;
        let mut first = true;
        while let Some(batch) = next_batch(queued, sessions, MAX_BATCH, &mut urgent_last) {
            if !std::mem::take(&mut first) {
                self.upkeep();
            }
            self.append_timed(batch);
        }
    }

    /// Writes what is queued for one session, in order (the others wait).
    fn write_session(&mut self, queued: &mut Queue, session: SessionId) {
        self.write_all(&mut queued.take_session(session));
    }

    fn append(&mut self, mut batch: Vec<Pending>) {
        // Those of a damaged log (set aside: its reads are refused) are
        // refused with its repair, so it does not grow unread; their
        // session hears it as of a failed append (each time: it stops),
        // even where its log is also broken. Not a failure of the store:
        // not counted as one (the damage has its own alert).
        if self.conn.refuses_any() {
            let mut why: HashMap<SessionId, Option<StoreError>> = HashMap::new();
            for p in &batch {
                let s = p.event.session;
                why.entry(s).or_insert_with(|| self.conn.refusal(s));
            }
            if why.values().any(Option::is_some) {
                let refused;
                (batch, refused) = batch
                    .into_iter()
                    .partition::<Vec<_>, _>(|p| why[&p.event.session].is_none());
                let mut by_session: HashMap<SessionId, Vec<Pending>> = HashMap::new();
                for p in refused {
                    by_session.entry(p.event.session).or_default().push(p);
                }
                for (s, mine) in by_session {
                    let e = why.remove(&s).flatten().unwrap_or(StoreError::LogBroken);
                    self.refuse(mine, Arc::new(e), false);
                }
            }
        }
        // Events of a broken log are refused, not written past the gap
        // (the batch is split only then: a split moves every append).
        if batch.iter().any(|p| self.is_broken(p.event.session)) {
            let refused;
            (batch, refused) = batch
                .into_iter()
                .partition::<Vec<_>, _>(|p| !self.is_broken(p.event.session));
            reply_err(refused, || StoreError::LogBroken);
        }
        if batch.is_empty() {
            return;
        }
        if self.shared.fail_appends.load(Ordering::Relaxed) {
            return self.fail(batch, Arc::new(StoreError::Injected));
        }
        let Err(e) = self.conn.append_batch(&mut self.heads, &batch) else {
            if self.shared.ambiguous_commit.load(Ordering::Relaxed)
                && batch.iter().any(|p| p.reply.is_some())
                && self.shared.ambiguous_commit.swap(false, Ordering::Relaxed)
            {
                return self.fail(batch, Arc::new(StoreError::Injected));
            }
            return self.committed(batch);
        };
        let sessions: HashSet<SessionId> = batch.iter().map(|p| p.event.session).collect();
        if sessions.len() == 1 {
            return self.fail(batch, Arc::new(e));
        }
        // Several sessions shared the failed transaction: retry each alone.
        for s in sessions {
            let (mine, rest): (Vec<_>, Vec<_>) =
                batch.into_iter().partition(|p| p.event.session == s);
            batch = rest;
            match self.conn.append_batch(&mut self.heads, &mine) {
                Ok(()) => self.committed(mine),
                Err(e) => self.fail(mine, Arc::new(e)),
            }
        }
    }

    /// Counts a committed batch and answers its waiters.
    fn committed(&self, batch: Vec<Pending>) {
        self.shared.append_commits.fetch_add(1, Ordering::Relaxed);
        tell_all(self.courier.as_ref(), reply_ok(batch));
    }

    /// Marks the batch's sessions broken and answers every waiter.
    fn fail(&mut self, batch: Vec<Pending>, e: Arc<StoreError>) {
        self.refuse(batch, e, true);
    }

    /// [`Writer::fail`]: a failure of the store when `failed` (counted,
    /// logged as an error), else a refusal (a damaged log's, logged as a
    /// warning).
    fn refuse(&mut self, batch: Vec<Pending>, e: Arc<StoreError>, failed: bool) {
        // Each session hears of it once: a stream whose commits never
        // come would otherwise hold its engine back until the stall bound.
        let mut told: HashMap<SessionId, Option<OnCommit>> = HashMap::new();
        for p in &batch {
            self.broken.insert(p.event.session);
            let tell = told.entry(p.event.session).or_default();
            if tell.is_none() {
                tell.clone_from(&p.on_commit);
            }
        }
        // The sessions named (a few: a batch may hold many streams), as
        // every session's log line names its own.
        let named = told
            .keys()
            .take(NAMED)
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let (sessions, events) = (told.len(), batch.len());
        if failed {
            metrics::counter!("tiller_store_append_failures_total").increment(1);
            tracing::error!(session = %named, sessions, error = %e, events, "store append failed");
        } else {
            tracing::warn!(session = %named, error = %e, events, "append refused: the session's log is damaged");
        }
        reply_err(batch, || StoreError::Append(e.clone()));
        // Told here, at once, not through the courier: a session takes a
        // failure reported after its log was reopened for stale, and reads
        // its reopen count when told (a courier that lagged behind a
        // reopen would make an old failure look current).
        for tell in told.into_values().flatten() {
            tell(Err(e.clone()));
        }
    }
}

/// Answers the batch's waiters; returns its sessions' commit notices.
fn reply_ok(batch: Vec<Pending>) -> Vec<Notice> {
    // Each session hears its commit once per batch, with its highest
    // sequence number.
    let mut committed: HashMap<SessionId, (OnCommit, u64)> = HashMap::new();
    for p in batch {
        if let Some(reply) = p.reply {
            let _ = reply.send(Ok(()));
        }
        if let Some(tell) = p.on_commit {
            committed.insert(p.event.session, (tell, p.event.seq));
        }
    }
    committed.into_values().collect()
}

fn reply_err(batch: Vec<Pending>, err: impl Fn() -> StoreError) {
    for p in batch {
        if let Some(reply) = p.reply {
            let _ = reply.send(Err(err()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SLICE: usize = 64;

    /// `(session, durable)` per append, in the order sent.
    fn appends(spec: &[(usize, bool)], sessions: &[SessionId]) -> Vec<Pending> {
        let mut seq: HashMap<usize, u64> = HashMap::new();
        spec.iter()
            .map(|&(s, durable)| {
                let n = seq.entry(s).or_default();
                *n += 1;
                Pending {
                    event: StoredEvent {
                        session: sessions[s],
                        seq: *n,
                        ts_ms: 0,
                        kind: "k".into(),
                        prompt: None,
                        turn: None,
                        data: String::new(),
                    },
                    ledger: None,
                    reply: durable.then(|| oneshot::channel().0),
                    on_commit: None,
                    joined: false,
                }
            })
            .collect()
    }

    fn queue(spec: &[(usize, bool)], sessions: &[SessionId]) -> Queue {
        appends(spec, sessions).into_iter().collect()
    }

    fn names<'a>(
        batch: impl IntoIterator<Item = &'a Pending>,
        sessions: &[SessionId],
    ) -> Vec<(usize, u64)> {
        batch
            .into_iter()
            .map(|p| {
                let s = sessions.iter().position(|s| *s == p.event.session).unwrap();
                (s, p.event.seq)
            })
            .collect()
    }

    /// What is left, session by session in turn.
    fn left(q: &Queue, sessions: &[SessionId]) -> Vec<(usize, u64)> {
        names(
            q.order.iter().flat_map(|s| q.lanes[s].items.iter()),
            sessions,
        )
    }

    /// The queue's bookkeeping agrees with what it holds: every append
    /// in one lane, counted; a ticket per awaited append, each with its
    /// entry in `urgent` (one it missed would wait behind streams); each
    /// lane in `order` once, and nothing else there.
    fn check(q: &Queue) {
        let held: usize = q.lanes.values().map(|l| l.items.len()).sum();
        assert_eq!(q.len, held);
        let in_order: HashSet<&SessionId> = q.order.iter().collect();
        assert_eq!(in_order.len(), q.order.len(), "a session in turn twice");
        assert_eq!(in_order.len(), q.lanes.len(), "a lane out of turn");
        for (s, lane) in &q.lanes {
            assert!(in_order.contains(s), "a lane out of turn");
            assert!(lane.items.iter().all(|p| p.event.session == *s));
            let awaited = lane.items.iter().filter(|p| p.reply.is_some()).count();
            assert_eq!(lane.awaited.len(), awaited);
            assert!(lane.awaited.iter().is_sorted());
            for t in &lane.awaited {
                assert!(q.urgent.contains(&(*s, *t)));
            }
        }
        if q.is_empty() {
            assert!(q.lanes.is_empty() && q.order.is_empty() && q.urgent.is_empty());
        }
    }

    #[test]
    fn an_upkeep_owed_waits_for_an_awaited_append_once_at_most() {
        let mut u = Upkeep::default();
        assert!(!u.now(false) && !u.now(true), "nothing owed");
        u.owed = true;
        assert!(u.now(false), "owed, nothing awaited: it runs");
        assert!(!u.now(false), "and is no longer owed");
        u.owed = true;
        assert!(!u.now(true), "an awaited append commits first");
        u.owed = true; // that append's batch
        assert!(u.now(true), "then it runs, whatever is awaited next");
        u.owed = true;
        assert!(!u.now(true), "put off again after it ran");
        u.ran(); // a command's own upkeep
        assert!(!u.now(false), "owed no longer");
    }

    #[test]
    fn the_bookkeeping_follows_the_queue() {
        let sessions: Vec<SessionId> = (0..5).map(|_| SessionId::new()).collect();
        let spec: Vec<(usize, bool)> = (0..400).map(|i| (i * 7 % 5, i % 9 == 0)).collect();
        let mut q = queue(&spec, &sessions);
        let mut urgent_last = false;
        let mut awaited_batches = 0;
        loop {
            check(&q);
            let Some(batch) = next_batch(&mut q, 2, MAX_BATCH, &mut urgent_last) else {
                break;
            };
            awaited_batches += usize::from(urgent_last);
            assert!(!batch.is_empty());
        }
        assert!(awaited_batches > 0);
    }

    #[test]
    fn a_batch_is_never_cut_between_joined_appends() {
        let sessions = [SessionId::new()];
        let mut a = appends(&vec![(0, false); MAX_BATCH + 10], &sessions);
        // A durable append that carries three events before it, straddling
        // the batch limit (a start, its message...).
        for p in a.iter_mut().skip(MAX_BATCH - 2).take(3) {
            p.joined = true;
        }
        let mut q: Queue = a.into_iter().collect();
        let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
        assert_eq!(batch.len(), MAX_BATCH + 2, "the group ends the batch");
        assert!(!batch.last().unwrap().joined);
        assert_eq!(q.len, 8);
        check(&q);
    }

    #[test]
    fn an_awaited_batch_is_cut_at_the_limit_and_its_session_goes_on_first() {
        let sessions = [SessionId::new(), SessionId::new()];
        // Session 0 streamed two and a half batches before its awaited
        // append; session 1 awaits too.
        let n = 2 * MAX_BATCH + MAX_BATCH / 2;
        let mut spec = vec![(0, false); n];
        spec.extend([(0, true), (1, true)]);
        let mut q = queue(&spec, &sessions);
        let mut urgent_last = false;
        let (mut sizes, mut last) = (Vec::new(), Vec::new());
        while let Some(batch) = next_batch(&mut q, SLICE, MAX_BATCH, &mut urgent_last) {
            assert!(
                batch.len() <= MAX_BATCH,
                "{} appends in one commit",
                batch.len()
            );
            sizes.push((names(&batch, &sessions)[0].0, batch.len()));
            last = names(&batch, &sessions);
            check(&q);
        }
        // Session 0's lane in three commits (the second a streamed one),
        // its awaited append in the last, with session 1's.
        assert_eq!(
            sizes,
            [(0, MAX_BATCH), (0, MAX_BATCH), (0, MAX_BATCH / 2 + 2)]
        );
        assert_eq!(last[last.len() - 2..], [(0, n as u64 + 1), (1, 1)]);
    }

    #[test]
    fn an_emptied_queue_lets_go_of_its_peak() {
        let sessions: Vec<SessionId> = (0..20_000).map(|_| SessionId::new()).collect();
        let spec: Vec<(usize, bool)> = (0..sessions.len()).map(|s| (s, s % 2 == 0)).collect();
        let mut q = queue(&spec, &sessions);
        let mut urgent_last = false;
        while next_batch(&mut q, SLICE, MAX_BATCH, &mut urgent_last).is_some() {}
        assert!(q.is_empty());
        assert!(
            // A map's room is rounded up to its next size.
            q.lanes.capacity() <= 2 * KEPT
                && q.order.capacity() <= KEPT
                && q.urgent.capacity() <= KEPT,
            "kept room for {} lanes, {} in turn, {} awaited",
            q.lanes.capacity(),
            q.order.capacity(),
            q.urgent.capacity()
        );
    }

    #[test]
    fn awaited_appends_go_first_with_their_session_s_earlier_ones_in_order() {
        let sessions = [SessionId::new(), SessionId::new(), SessionId::new()];
        // (queued appends, expected first batch (session, seq), left behind)
        let many = |s: usize, n: usize| vec![(s, false); n];
        type Case = (Vec<(usize, bool)>, Vec<(usize, u64)>, usize);
        let cases: Vec<Case> = vec![
            // Nothing awaited: the oldest, up to a batch.
            (
                many(0, MAX_BATCH + 88),
                (1..=MAX_BATCH as u64).map(|q| (0, q)).collect(),
                88,
            ),
            // Awaited: its session's appends up to it, alone.
            (
                [vec![(1, false), (0, false), (1, true)], many(0, 3)].concat(),
                vec![(1, 1), (1, 2)],
                4,
            ),
            // Awaited past a batch of another session's stream: that
            // session's appends up to its awaited one, first, in order.
            (
                [
                    vec![(2, false)],
                    many(0, MAX_BATCH + 88),
                    vec![(2, false), (1, false), (2, true), (2, false)],
                ]
                .concat(),
                vec![(2, 1), (2, 2), (2, 3)],
                MAX_BATCH + 88 + 2,
            ),
        ];
        for (spec, first, rest) in cases {
            let mut q = queue(&spec, &sessions);
            let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
            assert_eq!(names(&batch, &sessions), first, "{spec:?}");
            assert_eq!(q.len, rest, "{spec:?}");
            check(&q);
            // What is left keeps each session's order.
            let rest = left(&q, &sessions);
            for s in 0..sessions.len() {
                let seqs: Vec<u64> = rest
                    .iter()
                    .filter(|(x, _)| *x == s)
                    .map(|(_, q)| *q)
                    .collect();
                assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{spec:?}: {rest:?}");
            }
        }
    }

    #[test]
    fn streamed_appends_commit_in_slices_of_sessions_each_in_order() {
        let sessions: Vec<SessionId> = (0..SLICE + 5).map(|_| SessionId::new()).collect();
        // Every session streams three events, interleaved.
        let spec: Vec<(usize, bool)> = (0..3)
            .flat_map(|_| (0..sessions.len()).map(|s| (s, false)))
            .collect();
        let mut q = queue(&spec, &sessions);
        let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
        // The first SLICE sessions, all three events each, session by
        // session; the other five wait, whole.
        let want: Vec<(usize, u64)> = (0..SLICE)
            .flat_map(|s| (1..=3).map(move |seq| (s, seq)))
            .collect();
        assert_eq!(names(&batch, &sessions), want);
        assert_eq!(q.len, 5 * 3);
        assert!(
            left(&q, &sessions).iter().all(|(s, _)| *s >= SLICE),
            "{:?}",
            left(&q, &sessions)
        );
        check(&q);
        let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
        assert_eq!(batch.len(), 5 * 3);
        assert!(q.is_empty());
        check(&q);
    }

    #[test]
    fn a_long_stream_does_not_hold_back_the_sessions_behind_it() {
        let sessions: Vec<SessionId> = (0..3).map(|_| SessionId::new()).collect();
        // Session 0 has three batches queued; 1 and 2 a few appends each.
        let mut spec = vec![(0, false); 3 * MAX_BATCH];
        spec.extend([(1, false), (2, false), (1, false)]);
        let mut q = queue(&spec, &sessions);
        let first = next_batch(&mut q, 2, MAX_BATCH, &mut false).unwrap();
        assert_eq!(first.len(), MAX_BATCH);
        assert!(first.iter().all(|p| p.event.session == sessions[0]));
        // Session 0 waits its turn again, behind the two others.
        let second = next_batch(&mut q, 2, MAX_BATCH, &mut false).unwrap();
        assert_eq!(names(&second, &sessions), vec![(1, 1), (1, 2), (2, 1)]);
        check(&q);
        let third = next_batch(&mut q, 2, MAX_BATCH, &mut false).unwrap();
        assert_eq!(
            names(&third, &sessions),
            ((MAX_BATCH as u64 + 1)..=(2 * MAX_BATCH) as u64)
                .map(|seq| (0, seq))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn writing_one_session_takes_its_lane_only() {
        let sessions: Vec<SessionId> = (0..3).map(|_| SessionId::new()).collect();
        let spec = [(0, false), (1, true), (2, false), (1, false), (0, true)];
        let mut q = queue(&spec, &sessions);
        let mine = q.take_session(sessions[1]);
        assert_eq!(
            names(mine.lanes[&sessions[1]].items.iter(), &sessions),
            [(1, 1), (1, 2)]
        );
        check(&mine);
        check(&q);
        assert_eq!(q.len, 3);
        // Its stale urgent entry is passed over: session 0's awaited
        // append is the next batch.
        let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
        assert_eq!(names(&batch, &sessions), [(0, 1), (0, 2)]);
        check(&q);
    }

    #[test]
    fn a_burst_of_awaited_appends_is_sliced_too() {
        let sessions: Vec<SessionId> = (0..SLICE + 2).map(|_| SessionId::new()).collect();
        let spec: Vec<(usize, bool)> = (0..sessions.len()).map(|s| (s, true)).collect();
        let mut q = queue(&spec, &sessions);
        let batch = next_batch(&mut q, SLICE, MAX_BATCH, &mut false).unwrap();
        let want: Vec<(usize, u64)> = (0..SLICE).map(|s| (s, 1)).collect();
        assert_eq!(names(&batch, &sessions), want);
        let mut rest = left(&q, &sessions);
        rest.sort_unstable();
        assert_eq!(rest, vec![(SLICE, 1), (SLICE + 1, 1)]);
        check(&q);
    }

    #[test]
    fn awaited_appends_cannot_starve_the_streams() {
        let sessions = [SessionId::new(), SessionId::new()];
        let mut urgent_last = false;
        // Session 1 streams; session 0 keeps admitting and settling.
        let mut q = queue(&[(1, false), (0, true)], &sessions);
        let first = next_batch(&mut q, SLICE, MAX_BATCH, &mut urgent_last).unwrap();
        assert_eq!(
            names(&first, &sessions),
            vec![(0, 1)],
            "the awaited one first"
        );
        q.extend(appends(&[(0, true)], &sessions).into_iter().map(|mut p| {
            p.event.seq = 2;
            p
        }));
        let second = next_batch(&mut q, SLICE, MAX_BATCH, &mut urgent_last).unwrap();
        let mut second = names(&second, &sessions);
        second.sort_unstable();
        assert_eq!(
            second,
            vec![(0, 2), (1, 1)],
            "then the stream, with what is queued after it"
        );
        assert!(q.is_empty());
        check(&q);
    }

    /// One step of the writer's loop: appends sent (a session, how many,
    /// whether the last is awaited with the others joined to it), a batch
    /// taken, or one session written alone.
    #[derive(Clone, Debug)]
    enum Step {
        Send(usize, usize, bool),
        Batch(usize),
        Session(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (0..6usize, 1..40usize, any::<bool>()).prop_map(|(s, n, a)| Step::Send(s, n, a)),
            3 => (1..4usize).prop_map(Step::Batch),
            1 => (0..6usize).prop_map(Step::Session),
        ]
    }

    proptest! {
        /// Under any interleaving of sends and batches, with any slice of
        /// sessions (PostgreSQL's is every session) and a batch limit
        /// small enough to cut: every append comes out once, each
        /// session's in the order sent; a batch never ends inside a
        /// joined group, holds at most `slice` sessions and no more than
        /// the limit and the rest of a group; an awaited batch holds the
        /// first sessions with an awaited append, each up to its last
        /// awaited one (the last maybe cut at the limit); and the
        /// bookkeeping stays true.
        #[test]
        fn every_append_comes_out_once_in_its_session_s_order(
            steps in proptest::collection::vec(step(), 1..60),
            slice in prop_oneof![Just(1usize), Just(2), Just(usize::MAX)],
            max in 1..24usize,
        ) {
            let sessions: Vec<SessionId> = (0..6).map(|_| SessionId::new()).collect();
            let mut q = Queue::default();
            let mut sent = [0u64; 6];
            let mut out = [0u64; 6];
            let mut urgent_last = false;
            // The awaited appends not yet out, in the order sent.
            let mut waiting: Vec<(SessionId, u64)> = Vec::new();
            let take = |batch: Vec<Pending>, out: &mut [u64; 6]| {
                prop_assert!(!batch.is_empty());
                prop_assert!(!batch.last().is_some_and(|p| p.joined));
                let mut seen = HashSet::new();
                for p in &batch {
                    seen.insert(p.event.session);
                    let s = sessions.iter().position(|s| *s == p.event.session).unwrap();
                    prop_assert_eq!(p.event.seq, out[s] + 1);
                    out[s] = p.event.seq;
                }
                prop_assert!(seen.len() <= slice);
                Ok(())
            };
            for st in steps.into_iter().chain([Step::Batch(usize::MAX)]) {
                match st {
                    Step::Send(s, n, awaited) => {
                        let mut a = appends(&vec![(s, false); n], &sessions);
                        for (i, p) in a.iter_mut().enumerate() {
                            sent[s] += 1;
                            p.event.seq = sent[s];
                            p.joined = awaited && i + 1 < n;
                        }
                        if awaited {
                            a.last_mut().unwrap().reply = Some(oneshot::channel().0);
                            waiting.push((sessions[s], sent[s]));
                        }
                        q.extend(a);
                    }
                    Step::Batch(times) => {
                        for _ in 0..times {
                            // Awaited appends' turn: the sessions of the
                            // oldest ones queued, `slice` of them.
                            let turn = !urgent_last && !waiting.is_empty();
                            let Some(batch) = next_batch(&mut q, slice, max, &mut urgent_last) else {
                                break;
                            };
                            prop_assert_eq!(turn, urgent_last);
                            // In the order they come in the batch.
                            let mut got: Vec<SessionId> = Vec::new();
                            for p in &batch {
                                if !got.contains(&p.event.session) {
                                    got.push(p.event.session);
                                }
                            }
                            if turn {
                                let mut first: Vec<SessionId> = Vec::new();
                                for (s, _) in &waiting {
                                    if first.len() < slice && !first.contains(s) {
                                        first.push(*s);
                                    }
                                }
                                // The first of them, all unless the limit
                                // was reached.
                                prop_assert!(got.len() <= first.len());
                                prop_assert_eq!(&got[..], &first[..got.len()]);
                                prop_assert!(got.len() == first.len() || batch.len() >= max);
                            }
                            waiting.retain(|(s, seq)| {
                                !batch.iter().any(|p| p.event.session == *s && p.event.seq == *seq)
                            });
                            if urgent_last {
                                // Each of its sessions up to its last awaited
                                // one; the last maybe cut at the limit.
                                for (i, s) in got.iter().enumerate() {
                                    if let Some(lane) = q.lanes.get(s) {
                                        prop_assert!(
                                            lane.awaited.is_empty()
                                                || (i + 1 == got.len() && batch.len() >= max)
                                        );
                                    }
                                }
                            }
                            // The limit, and at most the rest of a group
                            // (a group is at most 39 appends).
                            prop_assert!(batch.len() < max + 39);
                            take(batch, &mut out)?;
                            check(&q);
                        }
                    }
                    Step::Session(s) => {
                        waiting.retain(|(x, _)| *x != sessions[s]);
                        let mut mine = q.take_session(sessions[s]);
                        check(&mine);
                        while let Some(batch) = next_batch(&mut mine, slice, max, &mut false) {
                            take(batch, &mut out)?;
                        }
                    }
                }
                check(&q);
            }
            prop_assert!(q.is_empty());
            prop_assert_eq!(sent, out);
        }
    }

    #[test]
    fn an_awaited_append_waits_its_turn_behind_earlier_ones() {
        let sessions = [SessionId::new(), SessionId::new()];
        // Session 0's first awaited append goes with a stream (the batch
        // after an awaited one), and session 0 has appends left.
        let mut q = queue(&[(1, true), (0, true), (0, false)], &sessions);
        let mut urgent_last = false;
        let first = next_batch(&mut q, 1, MAX_BATCH, &mut urgent_last).unwrap();
        assert_eq!(names(&first, &sessions), [(1, 1)]);
        let second = next_batch(&mut q, 1, 1, &mut urgent_last).unwrap();
        assert_eq!(names(&second, &sessions), [(0, 1)]);
        // Then session 1 awaits again, and only after it session 0.
        q.extend(
            appends(&[(1, true), (0, true)], &sessions)
                .into_iter()
                .map(|mut p| {
                    p.event.seq += if p.event.session == sessions[0] { 2 } else { 1 };
                    p
                }),
        );
        check(&q);
        let third = next_batch(&mut q, 1, MAX_BATCH, &mut false).unwrap();
        assert_eq!(
            names(&third, &sessions),
            [(1, 2)],
            "the earlier awaited append first, not session 0's by its old place"
        );
        let fourth = next_batch(&mut q, 1, MAX_BATCH, &mut false).unwrap();
        assert_eq!(names(&fourth, &sessions), [(0, 2), (0, 3)]);
        assert!(q.is_empty());
        check(&q);
    }
}
