//! The notification actor: owns the durable queues of background
//! notifications (one per session, in the store). Sessions poll it when
//! idle; it offers one notification per turn, oldest first. An offer takes
//! nothing off the queue: the session's committed start does. What is due is
//! its business; admission order is the session core's.

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::{Origin, SessionId};
use tiller_store::{Enqueued, Store, StoreError};
use tokio::sync::oneshot;

use crate::actor::{SessionMsg, Work};

/// The closed set of messages the notification actor handles.
pub enum NotifyMsg {
    /// Queue a notification (durable before the reply).
    Enqueue {
        session: SessionId,
        task_id: String,
        text: String,
        reply: oneshot::Sender<Result<Enqueued, StoreError>>,
    },
    /// A session is idle and asks for its next notification; the answer
    /// goes to its mailbox as `SessionMsg::Offer`.
    Poll {
        session: SessionId,
        /// Echoed in the answer.
        poll: u64,
        reply_to: ActorRef<SessionMsg>,
    },
}

/// See the module docs.
pub struct NotifyActor;

/// The actor's state.
pub struct NotifyState {
    store: Store,
    /// Most notifications queued per session; the oldest are evicted.
    cap: usize,
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
        let (_, total) = store.notification_backlog().await?;
        metrics::gauge!("tiller_notifications_queued").set(total as f64);
        Ok(NotifyState { store, cap })
    }

    async fn handle(
        &self,
        _myself: ActorRef<NotifyMsg>,
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
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as i64)
                    .unwrap_or(0);
                let r = st
                    .store
                    .enqueue_notification(session, task_id, text, now, st.cap)
                    .await;
                if let Ok(e) = &r {
                    let delta = i64::from(!e.deduplicated) - e.evicted.len() as i64;
                    metrics::gauge!("tiller_notifications_queued").increment(delta as f64);
                }
                let _ = reply.send(r);
            }
            NotifyMsg::Poll {
                session,
                poll,
                reply_to,
            } => {
                // The notification stays queued until the prompt that runs
                // it is committed; a refused or lost offer needs no hand-back.
                let work = match st.store.next_notification(session).await {
                    Ok(n) => n.map(Work::Notification),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the notification queue");
                        None
                    }
                };
                let _ = reply_to.send_message(SessionMsg::Offer {
                    poll,
                    origin: Origin::Notification,
                    work,
                });
            }
        }
        Ok(())
    }
}
