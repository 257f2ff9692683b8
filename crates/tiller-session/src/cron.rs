//! The cron actor: owns the durable cron jobs and their waiting fires. It
//! decides what is due (timing rules in `tiller_core::cron`); sessions poll
//! it when idle and decide admission. A job has at most one waiting fire
//! (`tiller_core::cron::Fires`, in memory, rebuilt from the store); fires
//! missed while the daemon was down coalesce into one catch-up fire.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::cron::{Fires, Waiting};
use tiller_core::cron::{Retry, Schedule, due};
use tiller_core::{Origin, SessionId};
use tiller_store::{CronFire, CronJob, Store};
use tokio::sync::oneshot;

use crate::SessionError;
use crate::event::EventBody;
use crate::ports::{PollReply, Retries, Waker, Work, WorkQueue};

/// Why a job could not be added.
#[derive(Debug, thiserror::Error)]
pub enum CronError {
    #[error("{0}")]
    Schedule(String),
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// The closed set of messages the cron actor handles.
pub enum CronMsg {
    /// Gives the actor the sessions it wakes when jobs fire; it starts its
    /// timer then.
    Attach(Arc<dyn Waker>),
    Add {
        session: SessionId,
        schedule: String,
        tz: String,
        prompt: String,
        reply: oneshot::Sender<Result<CronJob, CronError>>,
    },
    List(oneshot::Sender<Vec<CronJob>>),
    /// False when there was no such job; an error, with the job kept,
    /// when its removal could not be stored.
    Remove {
        id: String,
        reply: oneshot::Sender<Result<bool, SessionError>>,
    },
    /// The timer: fire what is due, re-arm.
    Tick,
    /// The session started fire `id` (its stored start consumes it).
    Started {
        session: SessionId,
        id: i64,
    },
    /// An idle session asks for its next fire (answered as an `Offer`).
    Poll {
        session: SessionId,
        reply: PollReply,
    },
    /// The session was closed or deleted (its queued rows are gone): forget its jobs and
    /// fires.
    Forget(SessionId),
    /// Reads the jobs and waiting fires again from a store other nodes
    /// share (jobs they added, fires they recorded); the answer is the
    /// sessions with a waiting fire.
    Reload(oneshot::Sender<Vec<SessionId>>),
    /// The try again after a failed read of the session's fires is due:
    /// the session looks for work again.
    Retry(SessionId),
}

/// See the module docs.
pub struct CronActor;

/// The actor's state.
pub struct CronState {
    store: Store,
    /// Jobs by id, with their parsed schedules.
    jobs: HashMap<String, (CronJob, Schedule)>,
    /// The waiting fires (the core's rules; the store keeps its changes).
    fires: Fires,
    /// Set by `Attach`.
    sessions: Option<Arc<dyn Waker>>,
    /// The pending wake-up.
    timer: Option<tokio::task::JoinHandle<Result<(), ractor::MessagingErr<CronMsg>>>>,
    /// Jobs whose due fire could not be stored, and when they are tried
    /// again.
    retry: HashMap<String, Retry>,
    /// Sessions whose fires could not be read again (a shared store).
    retries: Retries,
}

fn now_ms() -> i64 {
    crate::clock::unix_ms()
}

impl Actor for CronActor {
    type Msg = CronMsg;
    type State = CronState;
    type Arguments = Store;

    async fn pre_start(
        &self,
        _myself: ActorRef<CronMsg>,
        store: Store,
    ) -> Result<CronState, ActorProcessingErr> {
        let (jobs, fires) = load(&store).await?;
        Ok(CronState {
            store,
            jobs,
            fires,
            sessions: None,
            timer: None,
            retry: HashMap::new(),
            retries: Retries::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CronMsg>,
        msg: CronMsg,
        st: &mut CronState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CronMsg::Attach(sessions) => {
                st.sessions = Some(sessions);
                st.tick(&myself).await;
            }
            CronMsg::Add {
                session,
                schedule,
                tz,
                prompt,
                reply,
            } => {
                let r = st.add(session, schedule, tz, prompt).await;
                let _ = reply.send(r);
                st.arm(&myself);
            }
            CronMsg::List(reply) => {
                let mut jobs: Vec<CronJob> = st.jobs.values().map(|(j, _)| j.clone()).collect();
                jobs.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
                let _ = reply.send(jobs);
            }
            CronMsg::Remove { id, reply } => {
                let removed = st.store.cron_remove(id.clone()).await;
                if removed.is_ok() {
                    st.jobs.remove(&id);
                    st.fires.remove_job(&id);
                    st.retry.remove(&id);
                }
                let _ = reply.send(removed.map_err(SessionError::from));
                st.arm(&myself);
            }
            CronMsg::Tick => st.tick(&myself).await,
            CronMsg::Poll { session, reply } => {
                // Nodes sharing the store: the session's fires are read
                // again first (see the notification actor's poll).
                if st.store.shared_by_nodes() {
                    match st.store.cron_fires_of(session).await {
                        Ok(rows) => {
                            st.retries.succeeded(session);
                            st.fires.put_back(
                                session,
                                (!rows.is_empty()).then(|| rows.into_iter().map(waiting).collect()),
                            );
                        }
                        Err(e) => {
                            // Not "nothing due": the session looks again.
                            tracing::warn!(%session, error = %e, "cannot read the session's cron fires; it looks again after a pause");
                            if let Some(pause) = st.retries.failed(session, reply.inbox()) {
                                myself.send_after(pause, move || CronMsg::Retry(session));
                            }
                            reply.offer(None);
                            return Ok(());
                        }
                    }
                }
                // The fire stays waiting until the prompt that runs it is
                // stored; a refused or lost offer needs no hand-back.
                let work = st.fires.next(session).map(|w| {
                    Work::Cron(CronFire {
                        id: w.id,
                        job_id: w.job_id.clone(),
                        session,
                        prompt: w.prompt.clone(),
                        fired_ms: w.fired_ms,
                    })
                });
                reply.offer(work);
            }
            CronMsg::Started { session, id } => st.fires.consumed(session, id),
            CronMsg::Retry(session) => {
                if let Some(inbox) = st.retries.due(session) {
                    inbox.kick();
                }
            }
            CronMsg::Reload(reply) => {
                match st.reload().await {
                    Ok(()) => {
                        let _ = reply.send(st.fires.sessions());
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot reload the cron jobs"),
                }
                st.arm(&myself);
            }
            CronMsg::Forget(session) => {
                st.jobs.retain(|_, (job, _)| job.session != session);
                st.fires.put_back(session, None);
                st.retries.forget(session);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CronMsg>,
        st: &mut CronState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = st.timer.take() {
            t.abort();
        }
        Ok(())
    }
}

/// The jobs (with their parsed schedules) and waiting fires the store holds.
async fn load(
    store: &Store,
) -> Result<(HashMap<String, (CronJob, Schedule)>, Fires), tiller_store::StoreError> {
    let mut jobs = HashMap::new();
    for job in store.cron_list().await? {
        match Schedule::parse(&job.schedule, &job.tz) {
            Ok(s) => {
                jobs.insert(job.id.clone(), (job, s));
            }
            Err(e) => tracing::error!(job = %job.id, error = %e, "skipping a stored cron job"),
        }
    }
    let fires = Fires::restore(
        store
            .cron_fires()
            .await?
            .into_iter()
            .map(|f| (f.session, waiting(f))),
    );
    Ok((jobs, fires))
}

fn waiting(f: CronFire) -> Waiting {
    Waiting {
        id: f.id,
        job_id: f.job_id,
        prompt: f.prompt,
        fired_ms: f.fired_ms,
    }
}

impl CronState {
    /// Follows the store: jobs and fires other nodes changed.
    async fn reload(&mut self) -> Result<(), tiller_store::StoreError> {
        let (jobs, fires) = load(&self.store).await?;
        self.jobs = jobs;
        self.fires = fires;
        Ok(())
    }

    async fn add(
        &mut self,
        session: SessionId,
        schedule: String,
        tz: String,
        prompt: String,
    ) -> Result<CronJob, CronError> {
        let parsed = Schedule::parse(&schedule, &tz).map_err(|e| CronError::Schedule(e.0))?;
        let now = now_ms();
        let job = CronJob {
            id: format!("cron-{}", tiller_core::PromptId::new()),
            session,
            schedule,
            tz,
            prompt,
            next_fire_ms: parsed.next_after(now).unwrap_or(i64::MAX),
            created_ms: now,
        };
        self.store
            .cron_add(job.clone())
            .await
            .map_err(SessionError::from)?;
        self.jobs.insert(job.id.clone(), (job.clone(), parsed));
        Ok(job)
    }

    /// Fires every due job once, then re-arms the timer.
    async fn tick(&mut self, myself: &ActorRef<CronMsg>) {
        let now = now_ms();
        let mut fired = Vec::new();
        let mut stale = false;
        for (job, schedule) in self.jobs.values_mut() {
            let Some(next) = due(schedule, job.next_fire_ms, now) else {
                continue;
            };
            if self.retry.get(&job.id).is_some_and(|r| r.at_ms > now) {
                continue;
            }
            let failed = |retry: &mut HashMap<String, Retry>| {
                let r = retry.entry(job.id.clone()).or_default();
                *r = r.failed(now);
            };
            match self.store.fresh_id(tiller_store::IdQueue::CronFires).await {
                Ok(Some(id)) => self.fires.reserve_ids(id),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(job = %job.id, error = %e, "cannot number a cron fire; it is tried again later");
                    failed(&mut self.retry);
                    continue;
                }
            }
            let before = self.fires.session(job.session);
            let change = self.fires.fire(job.session, &job.id, &job.prompt, now);
            match self
                .store
                .cron_fire(change, job.id.clone(), (job.next_fire_ms, next))
                .await
            {
                Ok(()) => {}
                // Another node fired this due time: follow the store.
                Err(tiller_store::StoreError::AlreadyClaimed) => {
                    self.fires.put_back(job.session, before);
                    stale = true;
                    continue;
                }
                Err(e) => {
                    tracing::error!(job = %job.id, error = %e, "cannot record a cron fire; it is tried again later");
                    self.fires.put_back(job.session, before);
                    failed(&mut self.retry);
                    continue;
                }
            }
            self.retry.remove(&job.id);
            job.next_fire_ms = next;
            metrics::counter!("tiller_cron_fires_total").increment(1);
            fired.push((job.session, job.id.clone()));
        }
        if stale && let Err(e) = self.reload().await {
            tracing::warn!(error = %e, "cannot reload the cron jobs");
        }
        if let Some(sessions) = &self.sessions {
            for (session, job) in fired {
                sessions
                    .wake(session, EventBody::CronFired { job_id: job })
                    .await;
            }
        }
        self.arm(myself);
    }

    fn arm(&mut self, myself: &ActorRef<CronMsg>) {
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        if self.sessions.is_none() {
            return;
        }
        // (Jobs removed meanwhile, by a delete or a reload, are not tried.)
        let jobs = &self.jobs;
        self.retry.retain(|id, _| jobs.contains_key(id));
        let retry = |j: &CronJob| self.retry.get(&j.id).map_or(i64::MIN, |r| r.at_ms);
        let Some(next) = self
            .jobs
            .values()
            .map(|(j, _)| j.next_fire_ms.max(retry(j)))
            .min()
        else {
            return;
        };
        // Wake at the earliest fire (at least every hour, to follow clock
        // changes without drifting).
        let wait = (next - now_ms()).clamp(0, 3_600_000) as u64;
        self.timer = Some(myself.send_after(Duration::from_millis(wait), || CronMsg::Tick));
    }
}

impl WorkQueue for ActorRef<CronMsg> {
    fn origin(&self) -> Origin {
        Origin::Cron
    }

    fn poll(&self, session: SessionId, reply: PollReply) {
        // Not sent (the queue stopped): the reply, dropped, answers.
        let _ = self.send_message(CronMsg::Poll { session, reply });
    }

    fn started(&self, session: SessionId, work: &Work) {
        if let Work::Cron(f) = work {
            let _ = self.send_message(CronMsg::Started { session, id: f.id });
        }
    }

    fn forget(&self, session: SessionId) {
        let _ = self.send_message(CronMsg::Forget(session));
    }
}
