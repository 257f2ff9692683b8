//! The store thread: the one owner of the connection. Commands run in the
//! order they are sent; appends that arrive together commit in one
//! transaction (one per session when a shared one fails, so one session's
//! failure never costs another its events).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use rusqlite::Connection;
use tiller_core::SessionId;
use tokio::sync::oneshot;

use crate::{LedgerOp, OnCommit, StoreError, StoredEvent, log};

pub(crate) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// A command for the thread: a closure over the writer, or an append.
pub(crate) enum Cmd {
    /// Every command but appends: one closure each, no per-command enum.
    Call(Box<dyn FnOnce(&mut Writer) + Send>),
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
    pub(crate) ledger: Option<LedgerOp>,
    pub(crate) reply: Option<Reply<()>>,
    /// Told the session's highest committed sequence number.
    pub(crate) on_commit: Option<OnCommit>,
}

/// What the thread owns.
pub(crate) struct Writer {
    pub(crate) conn: Connection,
    /// Sessions whose log lost a write: later appends to them are refused
    /// (a gap would break the log) until the session is reopened.
    pub(crate) broken: HashSet<SessionId>,
    /// Set by a test to make every append fail.
    pub(crate) fail_appends: Arc<AtomicBool>,
}

/// Most appends committed in one transaction.
const MAX_BATCH: usize = 512;

pub(crate) fn run(mut w: Writer, rx: std_mpsc::Receiver<Cmd>) {
    let mut next: Option<Cmd> = None;
    loop {
        let cmd = match next.take() {
            Some(c) => c,
            None => match rx.recv() {
                Ok(c) => c,
                Err(_) => return, // every handle dropped
            },
        };
        match cmd {
            Cmd::Call(f) => f(&mut w),
            Cmd::Close(reply) => {
                drop(w);
                let _ = reply.send(());
                return;
            }
            Cmd::Append(first) => {
                let mut batch = first;
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(Cmd::Append(p)) => batch.extend(p),
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                w.append_timed(batch);
            }
        }
    }
}

/// Runs one command on the caller's thread (an inline store); the writer
/// is gone once it ran `Close`.
pub(crate) fn execute(slot: &mut Option<Writer>, cmd: Cmd) -> Result<(), Cmd> {
    let Some(w) = slot.as_mut() else {
        return Err(cmd);
    };
    match cmd {
        Cmd::Call(f) => f(w),
        Cmd::Append(batch) => w.append_timed(batch),
        Cmd::Close(reply) => {
            *slot = None;
            let _ = reply.send(());
        }
    }
    Ok(())
}

impl Writer {
    fn append_timed(&mut self, batch: Vec<Pending>) {
        let started = Instant::now();
        self.append(batch);
        metrics::histogram!("tiller_store_write_seconds").record(started.elapsed().as_secs_f64());
    }

    fn append(&mut self, batch: Vec<Pending>) {
        // Events of a broken log are refused, not written past the gap.
        let (mut batch, refused): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|p| !self.broken.contains(&p.event.session));
        reply_err(refused, || StoreError::LogBroken);
        if batch.is_empty() {
            return;
        }
        if self.fail_appends.load(Ordering::Relaxed) {
            return self.fail(batch, Arc::new(StoreError::Injected));
        }
        let Err(e) = log::append_batch(&mut self.conn, &batch) else {
            return reply_ok(batch);
        };
        let sessions: HashSet<SessionId> = batch.iter().map(|p| p.event.session).collect();
        if sessions.len() == 1 {
            return self.fail(batch, Arc::new(e.into()));
        }
        // Several sessions shared the failed transaction: retry each alone.
        for s in sessions {
            let (mine, rest): (Vec<_>, Vec<_>) =
                batch.into_iter().partition(|p| p.event.session == s);
            batch = rest;
            match log::append_batch(&mut self.conn, &mine) {
                Ok(()) => reply_ok(mine),
                Err(e) => self.fail(mine, Arc::new(e.into())),
            }
        }
    }

    /// Marks the batch's sessions broken and answers every waiter.
    fn fail(&mut self, batch: Vec<Pending>, e: Arc<StoreError>) {
        tracing::error!(error = %e, events = batch.len(), "store append failed");
        metrics::counter!("tiller_store_append_failures_total").increment(1);
        for p in &batch {
            self.broken.insert(p.event.session);
        }
        reply_err(batch, || StoreError::Append(e.clone()));
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
        tell(seq);
    }
}

fn reply_err(batch: Vec<Pending>, err: impl Fn() -> StoreError) {
    for p in batch {
        if let Some(reply) = p.reply {
            let _ = reply.send(Err(err()));
        }
    }
}
