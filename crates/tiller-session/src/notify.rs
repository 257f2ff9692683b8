//! The notification actor: owns the background-notification queues. Their
//! rules (FIFO per session, dedup by task id, cap with eviction) are the
//! pure core `tiller_core::notify`, kept in memory and rebuilt from the
//! store at start; the store only writes what the core decided. An idle
//! session polls it; it offers the oldest notification, which stays queued
//! until the session's stored start consumes it.

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::notify::{Queued, Queues};
use tiller_core::{Origin, SessionId};
use tiller_store::{Enqueued, Notification, Store, StoreError};
use tokio::sync::oneshot;

use crate::ports::{PollReply, Retries, Work, WorkQueue};

/// The closed set of messages the notification actor handles.
pub enum NotifyMsg {
    /// Queue a notification (durable before the reply).
    Enqueue {
        session: SessionId,
        task_id: String,
        text: String,
        reply: oneshot::Sender<Result<Enqueued, StoreError>>,
    },
    /// A session is idle and asks for its next notification.
    Poll {
        session: SessionId,
        reply: PollReply,
    },
    /// The session started the notification `id` (its start consumes it).
    Started { session: SessionId, id: i64 },
    /// The session was closed or deleted (its queued rows are gone): forget its queue.
    Forget(SessionId),
    /// Reads the queues again from a store other nodes share (what they
    /// queued for sessions this node now serves); the answer is the
    /// sessions with a queued notification.
    Reload(oneshot::Sender<Vec<SessionId>>),
    /// The try again after a failed read of the session's queue is due:
    /// the session looks for work again.
    Retry(SessionId),
}

/// See the module docs.
pub struct NotifyActor;

/// The queues the store holds.
async fn load(store: &Store, cap: usize) -> Result<Queues, StoreError> {
    let rows = store.notifications().await?;
    let queues = Queues::restore(cap, rows.into_iter().map(|n| (n.session, queued(n))));
    Ok(queues)
}

fn queued(n: Notification) -> Queued {
    Queued {
        id: n.id,
        task_id: n.task_id,
        text: n.text,
        created_ms: n.created_ms,
    }
}

/// The actor's state.
pub struct NotifyState {
    store: Store,
    queues: Queues,
    /// Most notifications queued per session.
    cap: usize,
    /// Sessions whose queue could not be read again (a shared store).
    retries: Retries,
}

impl NotifyState {
    fn gauge(&self) {
        metrics::gauge!("tiller_notifications_queued").set(self.queues.len() as f64);
    }
}

impl Actor for NotifyActor {
    type Msg = NotifyMsg;
    type State = NotifyState;
    type Arguments = (Store, usize);

    async fn pre_start(
        &self,
        _myself: ActorRef<NotifyMsg>,
        (store, cap): (Store, usize),
    ) -> Result<NotifyState, ActorProcessingErr> {
        let queues = load(&store, cap).await?;
        let st = NotifyState {
            store,
            queues,
            cap,
            retries: Retries::default(),
        };
        st.gauge();
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<NotifyMsg>,
        msg: NotifyMsg,
        st: &mut NotifyState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NotifyMsg::Enqueue {
                session,
                task_id,
                text,
                reply,
            } => {
                let now = crate::clock::unix_ms();
                // A shared store numbers the rows (nodes never collide).
                match st
                    .store
                    .fresh_id(tiller_store::IdQueue::Notifications)
                    .await
                {
                    Ok(Some(id)) => st.queues.reserve_ids(id),
                    Ok(None) => {}
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return Ok(());
                    }
                }
                let before = st.queues.session(session);
                let out = st.queues.enqueue(session, &task_id, &text, now);
                let r = match st.store.notification_changes(out.changes).await {
                    Ok(()) => Ok(Enqueued {
                        deduplicated: out.deduplicated,
                        evicted: out.evicted,
                    }),
                    Err(e) => {
                        // Not stored, not queued.
                        st.queues.put_back(session, before);
                        Err(e)
                    }
                };
                st.gauge();
                let _ = reply.send(r);
            }
            NotifyMsg::Poll { session, reply } => {
                // Nodes sharing the store: what is queued for the session
                // is read again first (the node that served it before may
                // have run some, or queued more); this node holds its
                // lease, so nobody else consumes its rows meanwhile.
                if st.store.shared_by_nodes() {
                    match st.store.notifications_of(session).await {
                        Ok(rows) => {
                            st.retries.succeeded(session);
                            st.queues.put_back(
                                session,
                                (!rows.is_empty()).then(|| rows.into_iter().map(queued).collect()),
                            );
                        }
                        Err(e) => {
                            // Not "nothing due": the session looks again.
                            tracing::warn!(%session, error = %e, "cannot read the session's notifications; it looks again after a pause");
                            if let Some(pause) = st.retries.failed(session, reply.inbox()) {
                                myself.send_after(pause, move || NotifyMsg::Retry(session));
                            }
                            reply.offer(None);
                            return Ok(());
                        }
                    }
                }
                let work = st.queues.next(session).map(|q| {
                    Work::Notification(Notification {
                        id: q.id,
                        session,
                        task_id: q.task_id.clone(),
                        text: q.text.clone(),
                        created_ms: q.created_ms,
                    })
                });
                reply.offer(work);
            }
            NotifyMsg::Started { session, id } => {
                st.queues.consumed(session, id);
                st.gauge();
            }
            NotifyMsg::Forget(session) => {
                st.queues.put_back(session, None);
                st.retries.forget(session);
                st.gauge();
            }
            NotifyMsg::Reload(reply) => match load(&st.store, st.cap).await {
                Ok(queues) => {
                    st.queues = queues;
                    st.gauge();
                    let _ = reply.send(st.queues.sessions().collect());
                }
                Err(e) => tracing::warn!(error = %e, "cannot reload the notification queues"),
            },
            NotifyMsg::Retry(session) => {
                if let Some(inbox) = st.retries.due(session) {
                    inbox.kick();
                }
            }
        }
        Ok(())
    }
}

impl WorkQueue for ActorRef<NotifyMsg> {
    fn origin(&self) -> Origin {
        Origin::Notification
    }

    fn poll(&self, session: SessionId, reply: PollReply) {
        // Not sent (the queue stopped): the reply, dropped, answers.
        let _ = self.send_message(NotifyMsg::Poll { session, reply });
    }

    fn started(&self, session: SessionId, work: &Work) {
        if let Work::Notification(n) = work {
            let _ = self.send_message(NotifyMsg::Started { session, id: n.id });
        }
    }

    fn forget(&self, session: SessionId) {
        let _ = self.send_message(NotifyMsg::Forget(session));
    }
}
