//! The store thread: the one owner of the connection. Commands run in the
//! order they are sent; queued appends commit in batches (see
//! [`next_batch`]; one transaction per session when a shared one fails, so
//! one session's failure never costs another its events).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use tiller_core::SessionId;
use tokio::sync::oneshot;

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

/// The appends waiting to be written, in the order sent, and how many of
/// them are awaited: a batch looks for those only when there are some (a
/// long queue of streamed appends is not read through for each batch).
#[derive(Default)]
pub(crate) struct Queue {
    items: VecDeque<Pending>,
    awaited: usize,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Extend<Pending> for Queue {
    fn extend<I: IntoIterator<Item = Pending>>(&mut self, appends: I) {
        for p in appends {
            self.awaited += usize::from(p.reply.is_some());
            self.items.push_back(p);
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
    /// failed, [`CHECKPOINT_FRAMES`] more (not every commit) before the
    /// next try.
    checkpoint_at: usize,
}

/// Frames in SQLite's write-ahead log that make a checkpoint due. A
/// quarter of SQLite's own default for its automatic one: a checkpoint is
/// a stall of the store thread (what an awaited append queued meanwhile
/// waits for), and since commits no longer write the log's index (see
/// [`crate::index`]) most frames are new pages, not the same hot ones
/// again, so copying them more often costs little more in all. Measured
/// with `tiller-load`: a checkpoint took 3.5 ms instead of 9 ms, cancels
/// flat out p50 17 ms instead of 30 ms.
pub(crate) const CHECKPOINT_FRAMES: usize = 250;

/// Most sessions a failed append's log line names.
const NAMED: usize = 8;

/// Most appends committed in one transaction.
const MAX_BATCH: usize = 4096;

/// Most queued appends a batch of streamed ones is chosen from.
const SCAN: usize = 4 * MAX_BATCH;

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
    loop {
        let first = if queued.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return, // every handle dropped
            }
        } else {
            None
        };
        let mut gone = false;
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
        let slice = w.conn.sessions_per_commit();
        if let Some(batch) = next_batch(&mut queued, slice, &mut urgent_last) {
            w.append_timed(batch);
            w.upkeep();
        }
    }
}

/// The next batch to write: the sessions with an awaited append, each up
/// to its last awaited one, alone; else the oldest streamed appends of at
/// most `sessions` sessions (a session's events per segment do not
/// change: its next slice comes about when its next whole batch would).
/// After a batch of awaited appends the next one is streamed if any waits
/// (`urgent_last`): a steady flow of admissions and terminals cannot
/// starve the streams.
fn next_batch(queued: &mut Queue, sessions: usize, urgent_last: &mut bool) -> Option<Vec<Pending>> {
    if queued.is_empty() {
        return None;
    }
    // Each urgent session's position of its last awaited append, for the
    // first `sessions` of them (a burst of admissions is sliced too).
    let mut urgent: HashMap<SessionId, usize> = HashMap::new();
    if queued.awaited > 0 && !*urgent_last {
        for (i, p) in queued.items.iter().enumerate() {
            let s = p.event.session;
            if p.reply.is_some() && (urgent.len() < sessions || urgent.contains_key(&s)) {
                urgent.insert(s, i);
            }
        }
    }
    if let Some(&end) = urgent.values().max() {
        *urgent_last = true;
        return Some(take_front(queued, end + 1, |i, p| {
            urgent.get(&p.event.session).is_some_and(|&last| i <= last)
        }));
    }
    *urgent_last = false;
    // Only the oldest appends are looked at (never cut between joined
    // ones): a batch costs its size, not the queue's, however long the
    // queue (a store that fell behind, a caller that does not wait).
    let mut window = queued.items.len().min(SCAN);
    while window < queued.items.len() && queued.items[window - 1].joined {
        window += 1;
    }
    // Each taken session's appends are a prefix of its queued ones: once
    // the batch is full (never between joined appends) nothing more is.
    let mut taken: HashSet<SessionId> = HashSet::new();
    let (mut n, mut last_joined, mut full) = (0, false, false);
    // The session taken last (a stream's appends come in runs).
    let mut last = None;
    Some(take_front(queued, window, |_, p| {
        let s = p.event.session;
        full = full || (n >= MAX_BATCH && !last_joined);
        let take = !full
            && (last == Some(s)
                || taken.contains(&s)
                || (taken.len() < sessions && taken.insert(s)));
        if take {
            last = Some(s);
            (n, last_joined) = (n + 1, p.joined);
        }
        take
    }))
}

/// Takes the appends `take` picks (by position, in order) among the first
/// `n` queued; the others stay in front, in order. Only the queue up to
/// the last one taken moves.
fn take_front(
    queued: &mut Queue,
    n: usize,
    mut take: impl FnMut(usize, &Pending) -> bool,
) -> Vec<Pending> {
    let picked: Vec<bool> = queued
        .items
        .iter()
        .take(n)
        .enumerate()
        .map(|(i, p)| take(i, p))
        .collect();
    let end = picked.iter().rposition(|&t| t).map_or(0, |last| last + 1);
    let taken = picked.iter().filter(|&&t| t).count();
    let mut batch = Vec::with_capacity(taken);
    let mut rest = Vec::with_capacity(end - taken);
    for (p, t) in queued.items.drain(..end).zip(picked) {
        if t {
            queued.awaited -= usize::from(p.reply.is_some());
            batch.push(p);
        } else {
            rest.push(p);
        }
    }
    while let Some(p) = rest.pop() {
        queued.items.push_front(p);
    }
    batch
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
        }
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
    /// [`CHECKPOINT_FRAMES`], after the commit that filled it was
    /// answered and before the next one: after each batch of appends and
    /// each command (not between a command's preceding writes and the
    /// command), so a burst taken off the channel at once is checkpointed
    /// as it goes. (SQLite's automatic checkpoint ran inside a commit, so
    /// the callers waiting for it waited for the copy and its fsyncs too.)
    /// Timed as `tiller_store_checkpoint_seconds`: what a commit queued
    /// meanwhile waits for. A checkpoint that failed or could not copy
    /// every frame loses nothing (the log keeps every frame); it is tried
    /// again once the log grew by [`CHECKPOINT_FRAMES`] more.
    fn checkpoint_if_due(&mut self) {
        let frames = self.shared.wal_frames.load(Ordering::Relaxed);
        if frames + CHECKPOINT_FRAMES < self.checkpoint_at {
            // The log started over since a checkpoint failed.
            self.checkpoint_at = CHECKPOINT_FRAMES;
        }
        if frames < self.checkpoint_at {
            return;
        }
        let started = Instant::now();
        self.shared.checkpoints.fetch_add(1, Ordering::Relaxed);
        let outcome = if self.shared.fail_checkpoints.load(Ordering::Relaxed) {
            Err(StoreError::Injected)
        } else {
            self.conn.checkpoint()
        };
        match outcome {
            Ok(true) => {
                // The log starts over at the next commit, which reports it.
                self.shared.wal_frames.store(0, Ordering::Relaxed);
                self.checkpoint_at = CHECKPOINT_FRAMES;
            }
            Ok(false) => {
                tracing::warn!(
                    frames,
                    "checkpoint of the store's write-ahead log left frames behind"
                );
                self.checkpoint_at = frames + CHECKPOINT_FRAMES;
            }
            Err(e) => {
                tracing::warn!(error = %e, frames, "checkpoint of the store's write-ahead log failed");
                self.checkpoint_at = frames + CHECKPOINT_FRAMES;
            }
        }
        metrics::histogram!("tiller_store_checkpoint_seconds")
            .record(started.elapsed().as_secs_f64());
    }

    fn append_timed(&mut self, batch: Vec<Pending>) {
        let n = batch.len();
        while self.shared.pause_appends.load(Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
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
        while let Some(batch) = next_batch(queued, sessions, &mut urgent_last) {
            if !std::mem::take(&mut first) {
                self.upkeep();
            }
            self.append_timed(batch);
        }
    }

    /// Writes what is queued for one session, in order (the others wait).
    fn write_session(&mut self, queued: &mut Queue, session: SessionId) {
        if !queued.items.iter().any(|p| p.event.session == session) {
            return;
        }
        let (mine, rest): (Queue, Queue) = std::mem::take(&mut queued.items)
            .into_iter()
            .partition(|p| p.event.session == session);
        *queued = rest;
        let mut mine = mine;
        self.write_all(&mut mine);
    }

    fn append(&mut self, mut batch: Vec<Pending>) {
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
        reply_ok(batch);
    }

    /// Marks the batch's sessions broken and answers every waiter.
    fn fail(&mut self, batch: Vec<Pending>, e: Arc<StoreError>) {
        metrics::counter!("tiller_store_append_failures_total").increment(1);
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
        let named: Vec<String> = told.keys().take(NAMED).map(|s| s.to_string()).collect();
        tracing::error!(
            session = %named.join(","),
            sessions = told.len(),
            error = %e,
            events = batch.len(),
            "store append failed"
        );
        reply_err(batch, || StoreError::Append(e.clone()));
        for tell in told.into_values().flatten() {
            tell(Err(e.clone()));
        }
    }
}

fn reply_ok(batch: Vec<Pending>) {
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
    for (tell, seq) in committed.into_values() {
        tell(Ok(seq));
    }
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

    const SLICE: usize = 64;

    /// `(session, durable)` per queued append, in the order sent.
    fn queue(spec: &[(usize, bool)], sessions: &[SessionId]) -> Queue {
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

    fn names(batch: &[Pending], sessions: &[SessionId]) -> Vec<(usize, u64)> {
        batch
            .iter()
            .map(|p| {
                let s = sessions.iter().position(|s| *s == p.event.session).unwrap();
                (s, p.event.seq)
            })
            .collect()
    }

    /// The count of awaited appends follows the queue through every kind
    /// of batch (an awaited append it missed would wait behind streams).
    #[test]
    fn the_awaited_count_follows_the_queue() {
        let sessions: Vec<SessionId> = (0..5).map(|_| SessionId::new()).collect();
        let spec: Vec<(usize, bool)> = (0..400).map(|i| (i * 7 % 5, i % 9 == 0)).collect();
        let mut q = queue(&spec, &sessions);
        let mut urgent_last = false;
        let mut awaited_batches = 0;
        loop {
            let count = q.items.iter().filter(|p| p.reply.is_some()).count();
            assert_eq!(q.awaited, count);
            let Some(batch) = next_batch(&mut q, 2, &mut urgent_last) else {
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
        let mut q = queue(&vec![(0, false); MAX_BATCH + 10], &sessions);
        // A durable append that carries three events before it, straddling
        // the batch limit (a start, its message...).
        for p in q.items.iter_mut().skip(MAX_BATCH - 2).take(3) {
            p.joined = true;
        }
        let batch = next_batch(&mut q, SLICE, &mut false).unwrap();
        assert_eq!(batch.len(), MAX_BATCH + 2, "the group ends the batch");
        assert!(!batch.last().unwrap().joined);
        assert_eq!(q.items.len(), 8);
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
        for (spec, first, left) in cases {
            let mut q = queue(&spec, &sessions);
            let batch = next_batch(&mut q, SLICE, &mut false).unwrap();
            assert_eq!(names(&batch, &sessions), first, "{spec:?}");
            assert_eq!(q.items.len(), left, "{spec:?}");
            // What is left keeps each session's order.
            let rest = names(q.items.make_contiguous(), &sessions);
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
        let batch = next_batch(&mut q, SLICE, &mut false).unwrap();
        let got = names(&batch, &sessions);
        // The first SLICE sessions, all three events each, in the
        // order they were sent; the other five wait, whole.
        let want: Vec<(usize, u64)> = (1..=3)
            .flat_map(|seq| (0..SLICE).map(move |s| (s, seq)))
            .collect();
        assert_eq!(got, want);
        assert_eq!(q.items.len(), 5 * 3);
        assert!(
            q.items
                .iter()
                .all(|p| sessions[SLICE..].contains(&p.event.session))
        );
        let batch = next_batch(&mut q, SLICE, &mut false).unwrap();
        assert_eq!(batch.len(), 5 * 3);
        assert!(q.is_empty());
    }

    #[test]
    fn a_batch_is_chosen_from_the_oldest_appends_and_never_cuts_a_joined_group() {
        let sessions: Vec<SessionId> = (0..SLICE + 1).map(|_| SessionId::new()).collect();
        // Session 0 streams past the window; a joined group of session 1
        // straddles the window's end; the last session shows up after it.
        let mut spec = vec![(0, false); SCAN - 2];
        spec.extend([(1, false); 4]);
        spec.push((SLICE, false));
        spec.extend([(0, false); 3]);
        let mut q = queue(&spec, &sessions);
        for p in q.items.iter_mut().skip(SCAN - 2).take(3) {
            p.joined = true;
        }
        let batch = next_batch(&mut q, 2, &mut false).unwrap();
        // Session 0 up to a batch; session 1 is not taken (the batch is
        // full first), nor what lies past the window.
        assert_eq!(batch.len(), MAX_BATCH);
        let rest = names(q.items.make_contiguous(), &sessions);
        assert_eq!(rest.len(), spec.len() - MAX_BATCH);
        for s in [0, 1, SLICE] {
            let seqs: Vec<u64> = rest
                .iter()
                .filter(|(x, _)| *x == s)
                .map(|(_, q)| *q)
                .collect();
            assert!(
                seqs.windows(2).all(|w| w[1] == w[0] + 1),
                "session {s} in order: {seqs:?}"
            );
        }
        // The order of the queue is the order sent, but for what was taken.
        let want: Vec<(usize, u64)> =
            names(queue(&spec, &sessions).items.make_contiguous(), &sessions)
                .into_iter()
                .filter(|(s, q)| !(*s == 0 && *q <= MAX_BATCH as u64))
                .collect();
        assert_eq!(rest, want);
        // A joined group across the window's end is taken whole: session
        // 0 is the one taken (a slice of one), session 1 fills the window.
        let mut spec = vec![(0, false)];
        spec.extend(vec![(1, false); SCAN - 2]);
        spec.extend([(0, false); 3]);
        let mut q = queue(&spec, &sessions);
        for p in q.items.iter_mut().skip(SCAN - 1).take(2) {
            p.joined = true;
        }
        let batch = next_batch(&mut q, 1, &mut false).unwrap();
        assert_eq!(
            names(&batch, &sessions),
            vec![(0, 1), (0, 2), (0, 3), (0, 4)]
        );
        assert!(!batch.last().unwrap().joined);
    }

    #[test]
    fn a_burst_of_awaited_appends_is_sliced_too() {
        let sessions: Vec<SessionId> = (0..SLICE + 2).map(|_| SessionId::new()).collect();
        let spec: Vec<(usize, bool)> = (0..sessions.len()).map(|s| (s, true)).collect();
        let mut q = queue(&spec, &sessions);
        let batch = next_batch(&mut q, SLICE, &mut false).unwrap();
        let want: Vec<(usize, u64)> = (0..SLICE).map(|s| (s, 1)).collect();
        assert_eq!(names(&batch, &sessions), want);
        assert_eq!(
            names(q.items.make_contiguous(), &sessions),
            vec![(SLICE, 1), (SLICE + 1, 1)]
        );
    }

    #[test]
    fn awaited_appends_cannot_starve_the_streams() {
        let sessions = [SessionId::new(), SessionId::new()];
        let mut urgent_last = false;
        // Session 1 streams; session 0 keeps admitting and settling.
        let mut q = queue(&[(1, false), (0, true)], &sessions);
        let first = next_batch(&mut q, SLICE, &mut urgent_last).unwrap();
        assert_eq!(
            names(&first, &sessions),
            vec![(0, 1)],
            "the awaited one first"
        );
        q.extend(
            queue(&[(0, true)], &sessions)
                .items
                .into_iter()
                .map(|mut p| {
                    p.event.seq = 2;
                    p
                }),
        );
        let second = next_batch(&mut q, SLICE, &mut urgent_last).unwrap();
        assert_eq!(
            names(&second, &sessions),
            vec![(1, 1), (0, 2)],
            "then the stream, with what is queued after it"
        );
        assert!(q.is_empty());
    }
}
