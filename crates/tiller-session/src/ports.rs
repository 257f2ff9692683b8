//! The small ports between a session and its automatic-work queues, so
//! neither side imports the other: a session sees each queue as a
//! [`WorkQueue`]; a queue answers through the session's [`Inbox`]; the
//! cron actor wakes sessions through a [`Waker`] (the facade). Queue actors
//! depend on this module and on events, never on the session actor.

use std::sync::Arc;

use tiller_core::{Origin, SessionId};

use crate::event::EventBody;

/// Automatic work a queue offers a session.
#[derive(Debug)]
pub enum Work {
    Notification(tiller_store::Notification),
    Cron(tiller_store::CronFire),
    /// A goal continuation (the goal re-offers; nothing to consume).
    Goal(String),
}

impl Work {
    /// The queue row the prompt that runs it consumes (in the transaction
    /// of its start: a crash before that leaves it queued).
    pub fn claim(&self) -> Option<tiller_store::Claim> {
        match self {
            Work::Notification(n) => Some(tiller_store::Claim::Notification(n.id)),
            Work::Cron(f) => Some(tiller_store::Claim::CronFire(f.id)),
            Work::Goal(_) => None,
        }
    }

    /// The prompt text it runs.
    pub fn text(&self) -> &str {
        match self {
            Work::Notification(n) => &n.text,
            Work::Cron(f) => &f.prompt,
            Work::Goal(text) => text,
        }
    }
}

/// Where a queue answers a session.
pub trait Inbox: Send + Sync + 'static {
    /// The answer to poll `poll`: one item, or nothing due.
    fn offer(&self, origin: Origin, poll: u64, work: Option<Work>);
    /// An event for the session's log (a goal paused, completed...), and
    /// whether the session should look for work afterwards. `ack`, when
    /// given, is answered once the event is stored (or could not be).
    fn event(&self, body: EventBody, kick: bool, ack: Option<Ack>);
    /// Lets the session look for work (poll its queues if idle).
    fn kick(&self);
}

/// The queues a session polls when idle, in admission order (goal,
/// notification, cron), behind the [`WorkQueue`] port.
#[derive(Clone, Default)]
pub struct Automation {
    /// Shared by every session (a clone is one reference count).
    pub queues: Arc<[Arc<dyn WorkQueue>]>,
}

impl Automation {
    pub(crate) fn origins(&self) -> Vec<Origin> {
        self.queues.iter().map(|q| q.origin()).collect()
    }

    pub(crate) fn queue(&self, origin: Origin) -> Option<&Arc<dyn WorkQueue>> {
        self.queues.iter().find(|q| q.origin() == origin)
    }

    /// Asks the queue of `origin` for its next work (the answer comes as
    /// the session's `Offer`; without such a queue, at once: nothing due).
    pub(crate) fn poll(
        &self,
        origin: Origin,
        session: SessionId,
        poll: u64,
        inbox: Arc<dyn Inbox>,
    ) {
        let reply = PollReply::new(origin, poll, inbox);
        if let Some(q) = self.queue(origin) {
            q.poll(session, reply);
        }
    }
}

/// A poll's one answer, given with [`PollReply::offer`]; a reply dropped
/// unanswered (its queue stopped or failed before it answered, or never
/// took the message) answers that nothing is due, so a session never
/// waits on a poll.
pub struct PollReply {
    origin: Origin,
    poll: u64,
    inbox: Option<Arc<dyn Inbox>>,
}

impl PollReply {
    /// The reply to poll `poll` of the queue of `origin`, for `inbox`.
    pub fn new(origin: Origin, poll: u64, inbox: Arc<dyn Inbox>) -> PollReply {
        PollReply {
            origin,
            poll,
            inbox: Some(inbox),
        }
    }

    /// The session's inbox, for a queue that will kick it later.
    pub fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        self.inbox.clone()
    }

    /// Answers with one item, or nothing due.
    pub fn offer(mut self, work: Option<Work>) {
        self.answer(work);
    }

    fn answer(&mut self, work: Option<Work>) {
        if let Some(inbox) = self.inbox.take() {
            inbox.offer(self.origin, self.poll, work);
        }
    }
}

impl Drop for PollReply {
    fn drop(&mut self) {
        self.answer(None);
    }
}

/// A queue actor's tries again after the store failed it, per session:
/// at most one armed at a time ([`tiller_core::backoff::Failures`]), and
/// the inbox to kick when it is due: the latest one a poll came from (a
/// session opened again since has a new one).
#[derive(Default)]
pub struct Retries {
    failures: tiller_core::backoff::Failures<SessionId>,
    inboxes: std::collections::HashMap<SessionId, Arc<dyn Inbox>>,
}

impl Retries {
    /// The store failed a read or write for `session`, on behalf of
    /// `inbox`: the pause before the try again, when one is to be armed.
    pub fn failed(
        &mut self,
        session: SessionId,
        inbox: Option<Arc<dyn Inbox>>,
    ) -> Option<std::time::Duration> {
        self.waiting(session, inbox);
        self.failures.failed(session)
    }

    /// A poll of `session` held back while a try is armed: its inbox is
    /// the one to kick.
    pub fn waiting(&mut self, session: SessionId, inbox: Option<Arc<dyn Inbox>>) {
        if let Some(inbox) = inbox {
            self.inboxes.insert(session, inbox);
        }
    }

    /// The armed try is due: the inbox to kick (or to try for).
    pub fn due(&mut self, session: SessionId) -> Option<Arc<dyn Inbox>> {
        self.failures.due(&session);
        self.inboxes.remove(&session)
    }

    /// The store worked for `session`.
    pub fn succeeded(&mut self, session: SessionId) {
        self.failures.succeeded(&session);
    }

    /// `session` was deleted.
    pub fn forget(&mut self, session: SessionId) {
        self.failures.forget(&session);
        self.inboxes.remove(&session);
    }
}

/// Answered once an event is stored: what a caller waits for before it
/// acknowledges the change the event records.
pub type Ack = tokio::sync::oneshot::Sender<Result<(), crate::SessionError>>;

/// One kind of automatic work, as a session sees it.
pub trait WorkQueue: Send + Sync + 'static {
    /// Which origin its work runs as.
    fn origin(&self) -> Origin;
    /// Asks for the session's next work; `reply` answers it (dropped,
    /// nothing due).
    fn poll(&self, session: SessionId, reply: PollReply);
    /// A prompt the queue offered has started (its stored start consumes
    /// the row; the queue forgets the item).
    fn started(&self, _session: SessionId, _work: &Work) {}
    /// A turn of this origin ended (`loop_stopped`: loop protection ended
    /// it).
    fn turn_ended(&self, _session: SessionId, _loop_stopped: bool, _inbox: Arc<dyn Inbox>) {}
    /// The session was closed or deleted (the store removed its queued
    /// work): the queue forgets what it holds of it.
    fn forget(&self, _session: SessionId) {}
}

/// How a queue wakes a session that is not asking (a cron fire).
pub trait Waker: Send + Sync + 'static {
    /// Publishes `body` in the session's log and lets it look for work.
    fn wake(&self, session: SessionId, body: EventBody) -> WakeFuture<'_>;
}

/// What [`Waker::wake`] returns.
pub type WakeFuture<'a> = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records every answer.
    #[derive(Default)]
    struct Answers(Mutex<Vec<(Origin, u64, Option<String>)>>);

    impl Inbox for Answers {
        fn offer(&self, origin: Origin, poll: u64, work: Option<Work>) {
            let text = work.map(|w| w.text().to_owned());
            self.0.lock().unwrap().push((origin, poll, text));
        }
        fn event(&self, _: EventBody, _: bool, _: Option<Ack>) {}
        fn kick(&self) {}
    }

    /// Counts kicks.
    #[derive(Default)]
    struct Kicks(std::sync::atomic::AtomicUsize);

    impl Inbox for Kicks {
        fn offer(&self, _: Origin, _: u64, _: Option<Work>) {}
        fn event(&self, _: EventBody, _: bool, _: Option<Ack>) {}
        fn kick(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn a_try_again_is_armed_once_and_kicks_the_latest_inbox() {
        use std::sync::atomic::Ordering::Relaxed;
        use std::time::Duration;
        let (old, new) = (Arc::new(Kicks::default()), Arc::new(Kicks::default()));
        let s = SessionId::new();
        let mut r = Retries::default();
        assert_eq!(r.failed(s, Some(old.clone())), Some(Duration::from_secs(1)));
        assert_eq!(r.failed(s, Some(new.clone())), None, "one armed at a time");
        r.due(s).unwrap().kick();
        assert_eq!(
            (old.0.load(Relaxed), new.0.load(Relaxed)),
            (0, 1),
            "the latest inbox"
        );
        assert!(r.due(s).is_none(), "kicked once");
        assert_eq!(r.failed(s, Some(new.clone())), Some(Duration::from_secs(2)));
        r.forget(s);
        assert!(r.due(s).is_none(), "forgotten");
        assert_eq!(r.failed(s, Some(new)), Some(Duration::from_secs(1)));
    }

    #[test]
    fn a_poll_is_answered_exactly_once_however_its_reply_ends() {
        let inbox = Arc::new(Answers::default());
        // Answered with work: that answer only.
        PollReply::new(Origin::Goal, 1, inbox.clone()).offer(Some(Work::Goal("go on".into())));
        // Dropped unanswered (its queue failed, or never took it).
        drop(PollReply::new(Origin::Cron, 2, inbox.clone()));
        // A message holding it, dropped with it (a stopped actor's mailbox).
        drop(vec![PollReply::new(Origin::Notification, 3, inbox.clone())]);
        assert_eq!(
            *inbox.0.lock().unwrap(),
            vec![
                (Origin::Goal, 1, Some("go on".into())),
                (Origin::Cron, 2, None),
                (Origin::Notification, 3, None),
            ]
        );
    }
}
