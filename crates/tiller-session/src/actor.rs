//! The session actor: a thin shell around [`SessionCore`]. It stores and
//! publishes events, runs the engine and the tool pipeline, and carries out
//! the core's effects. Every rule about turns lives in the core.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::{
    Effect, IdleBehavior, Input, LoopConfig, LoopGuard, LoopType, Millis, Origin, PromptId,
    Rejection, SessionCore, SessionId, Signal, SteerDropReason, SteerId, SteerOutcome, Terminal,
    TurnId,
};
use tiller_engine::{
    Conversation, Engine, EngineHandle, EngineInput, EngineSignal, PreparedPrompt, SignalKind,
    ToolOutput, TurnContext, Update,
};
use tiller_store::{LedgerOp, LogHead, Store, StoreError};
use tiller_tools::{ClientTools, McpServer, Toolbox};
use tokio::sync::oneshot;
use tracing::{Instrument, Span};

use crate::event::ConfigOption;
use crate::event::{EventBody, EventRecord};
use crate::tools::{Batch, Decision, PermissionMode, Permissions, Progress};
use crate::{
    PermissionRefused, PromptRefused, SessionConfig, Snapshot, SteerAnswer, Subscriber,
    SubscriberId, TurnState,
};

/// Automatic work a queue actor offers a session.
#[derive(Debug)]
pub enum Work {
    Notification(tiller_store::Notification),
    Cron(tiller_store::CronFire),
    /// A goal continuation (the goal re-offers; nothing to hand back).
    Goal(String),
}

impl Work {
    /// The queue row the prompt that runs it consumes (in the transaction
    /// of its start: a crash before that leaves it queued).
    fn claim(&self) -> Option<tiller_store::Claim> {
        match self {
            Work::Notification(n) => Some(tiller_store::Claim::Notification(n.id)),
            Work::Cron(f) => Some(tiller_store::Claim::CronFire(f.id)),
            Work::Goal(_) => None,
        }
    }

    fn text(&self) -> &str {
        match self {
            Work::Notification(n) => &n.text,
            Work::Cron(f) => &f.prompt,
            Work::Goal(text) => text,
        }
    }
}

/// The queue actors a session polls when idle.
#[derive(Clone, Default)]
pub struct Automation {
    pub notify: Option<ActorRef<crate::notify::NotifyMsg>>,
    pub cron: Option<ActorRef<crate::cron::CronMsg>>,
    pub goal: Option<ActorRef<crate::goal::GoalMsg>>,
}

impl Automation {
    /// The queues to poll, in admission order: one notification, then due
    /// cron fires.
    fn origins(&self) -> Vec<Origin> {
        let mut o = Vec::new();
        if self.goal.is_some() {
            o.push(Origin::Goal);
        }
        if self.notify.is_some() {
            o.push(Origin::Notification);
        }
        if self.cron.is_some() {
            o.push(Origin::Cron);
        }
        o
    }

    /// Asks the queue actor of `origin` for its next work (the answer comes
    /// as `SessionMsg::Offer`). False when no actor can answer.
    fn poll(
        &self,
        origin: Origin,
        session: SessionId,
        poll: u64,
        reply_to: &ActorRef<SessionMsg>,
    ) -> bool {
        let reply_to = reply_to.clone();
        match origin {
            Origin::Notification => self.notify.as_ref().is_some_and(|a| {
                a.send_message(crate::notify::NotifyMsg::Poll {
                    session,
                    poll,
                    reply_to,
                })
                .is_ok()
            }),
            Origin::Cron => self.cron.as_ref().is_some_and(|a| {
                a.send_message(crate::cron::CronMsg::Poll {
                    session,
                    poll,
                    reply_to,
                })
                .is_ok()
            }),
            Origin::Goal => self.goal.as_ref().is_some_and(|a| {
                a.send_message(crate::goal::GoalMsg::Poll {
                    session,
                    poll,
                    reply_to,
                })
                .is_ok()
            }),
            Origin::Interactive | Origin::Channel => false,
        }
    }
}

/// How a prompt's terminal is reported to its owner.
#[derive(Debug)]
pub struct Settlement {
    /// The prompt.
    pub prompt: PromptId,
    /// Its one terminal.
    pub terminal: Terminal,
}

/// The closed set of messages a session handles.
pub enum SessionMsg {
    /// Run a prompt. `admitted` answers once it is stored (or refused);
    /// `settled` answers with its terminal.
    Prompt {
        text: String,
        origin: Origin,
        /// A webhook to receive the final text on `end_turn`.
        delivery: Option<String>,
        admitted: Option<oneshot::Sender<Result<PromptId, PromptRefused>>>,
        settled: Option<oneshot::Sender<Settlement>>,
    },
    /// Steer the running turn.
    Steer {
        text: String,
        prompt_required: bool,
        reply: oneshot::Sender<Result<SteerAnswer, PromptRefused>>,
    },
    /// `session/cancel`.
    Cancel,
    /// A queue actor may have work: poll if idle.
    Kick,
    /// A queue actor's answer to a poll.
    Offer {
        origin: Origin,
        /// The poll it answers.
        poll: u64,
        work: Option<Work>,
    },
    /// An event from a queue actor to publish (goal changes), and whether
    /// to poll afterwards.
    Automation { body: EventBody, kick: bool },
    /// A cron job of this session fired (its fire is queued).
    CronFired { job_id: String },
    /// A notification was queued for this session (already durable).
    NotificationQueued {
        task_id: String,
        text: String,
        deduplicated: bool,
        evicted: Vec<String>,
    },
    /// A person's answer to a permission request.
    Permission {
        request_id: String,
        option_id: String,
        reply: oneshot::Sender<Result<(), PermissionRefused>>,
    },
    /// A signal from this session's engine.
    Engine(EngineSignal),
    /// A tool call that ran off the actor finished.
    ToolDone {
        turn: TurnId,
        id: String,
        output: ToolOutput,
    },
    /// The session's MCP servers (connected by the edge), and the events
    /// that report them.
    SetMcp {
        servers: Vec<Arc<McpServer>>,
        events: Vec<EventBody>,
        done: oneshot::Sender<()>,
    },
    /// The session's options.
    Options(oneshot::Sender<Vec<ConfigOption>>),
    /// Change one option; answers the options after the change.
    SetOption {
        id: String,
        value: String,
        reply: oneshot::Sender<Result<Vec<ConfigOption>, String>>,
    },
    /// A timer armed by the core fired.
    Tick,
    /// Attach a subscriber; answers with the state at that instant, whose
    /// `last_seq` is the last event already published (every later event
    /// goes to the subscriber).
    Subscribe {
        id: SubscriberId,
        subscriber: Box<dyn Subscriber>,
        reply: oneshot::Sender<Snapshot>,
    },
    /// The server-owned state of the session.
    Snapshot(oneshot::Sender<Snapshot>),
    /// Detach a subscriber.
    Unsubscribe(SubscriberId),
    /// Close the session: cancel what runs, refuse new prompts, stop when idle.
    Close(oneshot::Sender<Result<(), crate::SessionError>>),
    /// Daemon shutdown: cancel what runs; answer once idle.
    Drain(oneshot::Sender<()>),
    /// Tests only: fail the actor, as a bug would.
    #[cfg(feature = "test-hooks")]
    Crash,
}

/// What a session needs to start.
pub struct SessionArgs {
    pub id: SessionId,
    pub head: LogHead,
    pub engine: Arc<dyn Engine>,
    /// Every engine, for switching with `session/set_config_option`.
    pub engines: crate::Engines,
    pub store: Store,
    pub config: Arc<SessionConfig>,
    pub automation: Automation,
    /// The session's working directory.
    pub cwd: String,
    /// What the store kept of the session (settings, conversation).
    pub extras: tiller_store::SessionExtras,
}

/// Session options kept in the store (`session_state.settings`).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Settings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    permission_mode: Option<String>,
    /// Tools the user allowed "always" in this session.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    always: Vec<String>,
}

/// A prompt admitted but not yet settled.
struct Pending {
    /// The engine's view of the prompt (taken when its turn starts).
    prepared: Option<PreparedPrompt>,
    /// The owner's terminal port.
    settled: Option<oneshot::Sender<Settlement>>,
    /// When it was admitted, for `turn_duration_seconds`.
    admitted_at: Millis,
    /// It waited in the queue, so its start is announced when it starts.
    queued: bool,
    /// The queue item it came from (consumed when its start is committed).
    work: Option<Work>,
    /// Where to deliver the final text on `end_turn`.
    delivery: Option<String>,
}

/// The running engine and the turn it serves.
struct RunningEngine {
    turn: TurnId,
    /// The prompt that owns the turn.
    prompt: PromptId,
    /// Labels loop metrics.
    origin: Origin,
    handle: EngineHandle,
    /// This turn's loop guard (fresh per turn, dropped at settle).
    guard: LoopGuard,
    /// The agent text of the turn so far (the final text a delivery sends).
    text: String,
    /// The tool batch going through the pipeline (paused on a permission
    /// or a running call).
    batch: Option<Batch>,
    /// The call running off the actor.
    exec: Option<tokio::task::JoinHandle<()>>,
    /// The turn is ending (cancel, settle): results no longer go to the
    /// engine.
    stopping: bool,
    /// The turn's tracing span.
    span: Span,
}

/// The session actor's state.
pub struct SessionState {
    id: SessionId,
    core: SessionCore,
    engine: Arc<dyn Engine>,
    /// Every engine (the session may switch between turns).
    engines: crate::Engines,
    store: Store,
    /// Loop protection settings for each new turn's guard.
    loops: LoopConfig,
    /// This actor (queue actors answer to it).
    myself: ActorRef<SessionMsg>,
    /// Session settings (delivery destinations and wake-up).
    config: Arc<SessionConfig>,
    /// The queue actors polled when idle.
    automation: Automation,
    /// The last prompt loop protection stopped (tells the goal actor).
    loop_stopped: Option<PromptId>,
    /// The permission mode and the tools allowed for the whole session.
    permissions: Permissions,
    /// The session's tools (built-ins in its cwd, MCP servers).
    toolbox: Arc<Toolbox>,
    /// The model conversation (model engines append to it).
    conversation: Conversation,
    /// The engine's signals waiting in this mailbox (engines wait while
    /// it is high).
    pace: Arc<tiller_engine::Pace>,
    /// The conversation's revision already stored.
    conversation_saved: u64,
    /// The model chosen with `session/set_config_option`.
    model: Option<String>,
    /// The `permission_requested` the running turn waits on.
    pending_permission: Option<Arc<EventRecord>>,
    /// The last sequence number given out.
    seq: u64,
    /// Events appended without waiting since the last durable commit
    /// (re-sent, same sequence numbers, if the store lost them).
    unconfirmed: Vec<(Arc<EventRecord>, Option<LedgerOp>)>,
    /// Set when the store failed: the actor fails after this message.
    failed: Option<crate::SessionFailed>,
    /// The last `turn_error`, while no newer turn has started (survives a
    /// reload: restored from the log at start).
    last_turn_error: Option<Arc<EventRecord>>,
    /// Prompts admitted and not settled.
    pending: HashMap<PromptId, Pending>,
    /// Text of steers that may still be dropped (for `steer_dropped`).
    steers: HashMap<SteerId, String>,
    /// At most one engine runs.
    running: Option<RunningEngine>,
    /// Attached subscribers.
    subscribers: Vec<(SubscriberId, Box<dyn Subscriber>)>,
    /// The wake-up timer the core asked for.
    timer: Option<tokio::task::JoinHandle<Result<(), ractor::MessagingErr<SessionMsg>>>>,
    /// The actor's clock origin (time is an input to the core).
    epoch: tokio::time::Instant,
    /// When the message being handled arrived, for `settle_latency_seconds`
    /// (deciding input to terminal sent).
    input_at: tokio::time::Instant,
    /// When a cancel arrived, for `cancel_latency_seconds`.
    cancel_at: Option<tokio::time::Instant>,
    /// Set by `Close`: refuse prompts, stop when idle.
    closing: bool,
    /// Answered at the next idle (daemon shutdown).
    drained: Vec<oneshot::Sender<()>>,
    /// The session span.
    span: Span,
}

/// See the module docs.
pub struct SessionActor;

impl Actor for SessionActor {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SessionMsg>,
        args: SessionArgs,
    ) -> Result<SessionState, ActorProcessingErr> {
        let last_turn_error = match args
            .store
            .last_of_kinds(args.id, &["prompt_started", "turn_error"])
            .await?
        {
            Some(e) if e.kind == "turn_error" => EventRecord::from_stored(&e).map(Arc::new),
            _ => None,
        };
        let span = tracing::info_span!("session", session = %args.id);
        let settings: Settings = args
            .extras
            .settings
            .as_deref()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default();
        let conversation: Vec<tiller_engine::Message> = args
            .extras
            .conversation
            .as_deref()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default();
        let mode = settings
            .permission_mode
            .as_deref()
            .and_then(PermissionMode::parse)
            .unwrap_or(args.config.permission_mode);
        Ok(SessionState {
            toolbox: Arc::new(Toolbox::new(
                args.cwd.clone().into(),
                args.config.tools.clone(),
            )),
            conversation_saved: 0,
            conversation: Conversation::new(conversation),
            pace: Arc::default(),
            model: settings.model,
            id: args.id,
            core: SessionCore::new(args.config.turn.clone(), args.head.last_turn)
                .with_automatic(args.automation.origins()),
            automation: args.automation,
            config: args.config.clone(),
            myself: myself.clone(),
            loop_stopped: None,
            engine: args.engine,
            engines: args.engines,
            store: args.store,
            loops: args.config.loops.clone(),
            permissions: Permissions::new(mode).with_always(settings.always),
            pending_permission: None,
            seq: args.head.last_seq,
            unconfirmed: Vec::new(),
            failed: None,
            last_turn_error,
            pending: HashMap::new(),
            steers: HashMap::new(),
            running: None,
            subscribers: Vec::new(),
            timer: None,
            epoch: tokio::time::Instant::now(),
            input_at: tokio::time::Instant::now(),
            cancel_at: None,
            closing: false,
            drained: Vec::new(),
            span,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        st: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        let span = st.span.clone();
        // Boxed: the handling future exists only while a message is being
        // handled, so an idle session's task stays small.
        Box::pin(st.handle(&myself, msg).instrument(span)).await;
        match st.failed.take() {
            Some(why) => Err(Box::new(why)),
            None => Ok(()),
        }
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionMsg>,
        st: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = st.timer.take() {
            t.abort();
        }
        Ok(())
    }
}

impl SessionState {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    async fn handle(&mut self, myself: &ActorRef<SessionMsg>, msg: SessionMsg) {
        self.input_at = tokio::time::Instant::now();
        match msg {
            SessionMsg::Prompt {
                text,
                origin,
                delivery,
                admitted,
                settled,
            } => {
                self.prompt(myself, text, origin, delivery, admitted, settled)
                    .await;
            }
            SessionMsg::Steer {
                text,
                prompt_required,
                reply,
            } => self.steer(myself, text, prompt_required, reply).await,
            SessionMsg::Cancel => {
                if self.core.active().is_some() && !self.core.is_cancelling() {
                    self.cancel_at = Some(tokio::time::Instant::now());
                }
                self.feed(myself, Input::Cancel, None).await;
            }
            SessionMsg::Engine(sig) => {
                self.pace.handled();
                let signal = core_signal(&sig.kind);
                self.feed(
                    myself,
                    Input::Signal {
                        turn: sig.turn,
                        signal,
                    },
                    Some(sig.kind),
                )
                .await;
            }
            SessionMsg::Tick => self.feed(myself, Input::Tick, None).await,
            SessionMsg::ToolDone { turn, id, output } => {
                let trip = self.tool_done(turn, &id, output);
                // The engine is silent while tools run: a finished call is
                // the turn's progress (the stall bound restarts).
                self.feed(myself, Input::ToolProgress { turn }, None).await;
                if let Some(loop_type) = trip {
                    self.feed(myself, Input::LoopTrip { turn, loop_type }, None)
                        .await;
                }
            }
            SessionMsg::SetMcp {
                servers,
                events,
                done,
            } => {
                self.toolbox = Arc::new((*self.toolbox).clone().with_mcp(servers));
                for body in events {
                    self.publish(None, None, body);
                }
                let _ = done.send(());
            }
            SessionMsg::Options(reply) => {
                let _ = reply.send(self.options());
            }
            SessionMsg::SetOption { id, value, reply } => {
                let r = self.set_option(&id, &value).await;
                let _ = reply.send(r);
            }
            SessionMsg::Kick => self.feed(myself, Input::Kick, None).await,
            SessionMsg::Offer { origin, poll, work } => {
                self.offer(myself, origin, poll, work).await;
            }
            SessionMsg::Automation { body, kick } => {
                self.publish(None, None, body);
                if kick {
                    self.feed(myself, Input::Kick, None).await;
                }
            }
            SessionMsg::CronFired { job_id } => {
                self.publish(None, None, EventBody::CronFired { job_id });
                self.feed(myself, Input::Kick, None).await;
            }
            SessionMsg::NotificationQueued {
                task_id,
                text,
                deduplicated,
                evicted,
            } => {
                for t in evicted {
                    self.publish(None, None, EventBody::NotificationEvicted { task_id: t });
                }
                self.publish(
                    None,
                    None,
                    EventBody::NotificationQueued {
                        task_id,
                        text,
                        deduplicated,
                    },
                );
                self.feed(myself, Input::Kick, None).await;
            }
            SessionMsg::Permission {
                request_id,
                option_id,
                reply,
            } => {
                let trip = match self.permission(&request_id, &option_id) {
                    Ok(trip) => {
                        let _ = reply.send(Ok(()));
                        if option_id == "allow_always" {
                            self.save_settings().await;
                        }
                        Some(trip)
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        None
                    }
                };
                if let (Some(trip), Some((_, turn))) = (trip, self.core.active()) {
                    // A decision is progress too: the stall bound restarts
                    // for what the call does next.
                    self.feed(myself, Input::ToolProgress { turn }, None).await;
                    if let Some(loop_type) = trip {
                        self.feed(myself, Input::LoopTrip { turn, loop_type }, None)
                            .await;
                    }
                }
            }
            SessionMsg::Subscribe {
                id,
                subscriber,
                reply,
            } => {
                self.subscribers.push((id, subscriber));
                metrics::gauge!("tiller_subscribers_active").increment(1.0);
                let _ = reply.send(self.snapshot());
            }
            SessionMsg::Snapshot(reply) => {
                let _ = reply.send(self.snapshot());
            }
            SessionMsg::Unsubscribe(id) => {
                let before = self.subscribers.len();
                self.subscribers.retain(|(s, _)| *s != id);
                let removed = before - self.subscribers.len();
                metrics::gauge!("tiller_subscribers_active").decrement(removed as f64);
            }
            #[cfg(feature = "test-hooks")]
            SessionMsg::Crash => panic!("session actor crash requested by a test"),
            SessionMsg::Drain(reply) => {
                // Nothing starts any more; what runs is cancelled, what is
                // queued settles. Work in the queue actors stays durable.
                if self.core.active().is_none() && self.core.is_closing() {
                    let _ = reply.send(());
                } else {
                    self.drained.push(reply);
                    if self.core.active().is_some() {
                        self.cancel_at = Some(tokio::time::Instant::now());
                    }
                    self.feed(myself, Input::Close, None).await;
                }
            }
            SessionMsg::Close(reply) => {
                if !self.closing {
                    self.closing = true;
                    if self.core.active().is_some() {
                        self.cancel_at = Some(tokio::time::Instant::now());
                    }
                    self.feed(myself, Input::Close, None).await;
                    // Answered only once the close is stored.
                    let stored = match self
                        .publish_durable(None, None, EventBody::SessionClosed, Ledger::Plain)
                        .await
                    {
                        Ok(()) => self.store.close_session(self.id).await,
                        Err(e) => Err(e),
                    };
                    let _ = reply.send(stored.map_err(crate::SessionError::from));
                } else {
                    let _ = reply.send(Ok(()));
                }
                if self.core.active().is_none() {
                    myself.stop(Some("closed".into()));
                }
            }
        }
    }

    async fn prompt(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        text: String,
        origin: Origin,
        delivery: Option<String>,
        admitted: Option<oneshot::Sender<Result<PromptId, PromptRefused>>>,
        settled: Option<oneshot::Sender<Settlement>>,
    ) {
        let refuse = |admitted: Option<oneshot::Sender<_>>, why| {
            if let Some(a) = admitted {
                let _ = a.send(Err(why));
            }
        };
        let prepared = match self.engine.prepare(&text) {
            Ok(p) => p,
            Err(e) => return refuse(admitted, PromptRefused::Invalid(e)),
        };
        let delivery = match delivery
            .map(|url| crate::delivery::check_webhook(&url, &self.config.delivery))
            .transpose()
        {
            Ok(d) => d,
            Err(why) => return refuse(admitted, PromptRefused::BadDelivery(why)),
        };
        let prompt = PromptId::new();
        self.pending.insert(
            prompt,
            Pending {
                prepared: Some(prepared),
                settled,
                admitted_at: self.now(),
                queued: false,
                work: None,
                delivery,
            },
        );
        let fx = self.core.on(self.now(), Input::Prompt { prompt, origin });
        if let Some(Effect::Rejected { reason, .. }) = fx.first() {
            self.pending.remove(&prompt);
            return refuse(
                admitted,
                match reason {
                    Rejection::Overloaded => PromptRefused::Overloaded,
                    Rejection::Closed => PromptRefused::SessionClosed,
                },
            );
        }
        metrics::counter!("tiller_prompts_admitted_total", "origin" => origin.as_str())
            .increment(1);
        // Durable before acknowledged: the admission event is committed first.
        let admission = match &fx[..] {
            [Effect::Queued { depth, .. }, ..] => EventBody::PromptQueued {
                origin: origin.as_str().into(),
                depth: *depth,
                text: text.clone(),
            },
            _ => EventBody::PromptStarted {
                origin: origin.as_str().into(),
            },
        };
        if let EventBody::PromptQueued { .. } = admission {
            metrics::gauge!("tiller_prompt_queue_depth").increment(1.0);
            if let Some(p) = self.pending.get_mut(&prompt) {
                p.queued = true;
            }
        }
        if let Err(e) = self
            .publish_durable(Some(prompt), None, admission, Ledger::Admission)
            .await
        {
            // Never acknowledged, never fanned out; the session fails and
            // is rebuilt from the store (see `publish_durable`).
            tracing::warn!(error = %e, "prompt refused: the store is unavailable");
            return refuse(admitted, PromptRefused::StoreUnavailable);
        }
        if let Some(a) = admitted {
            let _ = a.send(Ok(prompt));
        }
        // A start effect publishes `user_message` and runs the engine.
        self.apply(myself, fx, None).await;
    }

    /// Takes (or refuses) automatic work offered by a queue actor.
    async fn offer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        origin: Origin,
        poll: u64,
        work: Option<Work>,
    ) {
        let prompt = match work {
            None => None,
            Some(work) => match self.engine.prepare(work.text()) {
                Ok(prepared) => {
                    let prompt = PromptId::new();
                    self.pending.insert(
                        prompt,
                        Pending {
                            prepared: Some(prepared),
                            settled: None,
                            admitted_at: self.now(),
                            // Announced (and entered in the ledger) at start.
                            queued: true,
                            work: Some(work),
                            delivery: None,
                        },
                    );
                    metrics::counter!("tiller_prompts_admitted_total", "origin" => origin.as_str())
                        .increment(1);
                    Some(prompt)
                }
                Err(e) => {
                    // Unrunnable work is dropped, not retried forever.
                    tracing::warn!(error = %e, origin = origin.as_str(), "dropping invalid automatic work");
                    None
                }
            },
        };
        self.feed(
            myself,
            Input::Offer {
                origin,
                poll,
                prompt,
            },
            None,
        )
        .await;
    }

    async fn steer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        text: String,
        prompt_required: bool,
        reply: oneshot::Sender<Result<SteerAnswer, PromptRefused>>,
    ) {
        if self.closing {
            let _ = reply.send(Err(PromptRefused::SessionClosed));
            return;
        }
        let steer = SteerId::new();
        let idle_behavior = if prompt_required {
            IdleBehavior::PromptRequired
        } else {
            // Validate now: a steer that becomes a prompt obeys prompt rules.
            let prepared = match self.engine.prepare(&text) {
                Ok(p) => p,
                Err(e) => {
                    let _ = reply.send(Err(PromptRefused::Invalid(e)));
                    return;
                }
            };
            let prompt = PromptId::new();
            self.pending.insert(
                prompt,
                Pending {
                    prepared: Some(prepared),
                    settled: None,
                    admitted_at: self.now(),
                    queued: false,
                    work: None,
                    delivery: None,
                },
            );
            IdleBehavior::StartNewTurn(prompt)
        };
        let fx = self.core.on(
            self.now(),
            Input::Steer {
                steer,
                idle_behavior,
            },
        );
        let mut answer = None;
        for e in &fx {
            if let Effect::SteerAnswer { outcome, .. } = e {
                answer = Some(*outcome);
            }
        }
        let outcome = answer.expect("the core answers every steer");
        // An unused prompt reservation is released.
        if let IdleBehavior::StartNewTurn(p) = idle_behavior
            && !matches!(outcome, SteerOutcome::StartedNewTurn { .. })
        {
            self.pending.remove(&p);
        }
        metrics::counter!("tiller_steers_total", "outcome" => steer_outcome_label(&outcome))
            .increment(1);
        let stored = match outcome {
            SteerOutcome::Injected { turn } => {
                self.steers.insert(steer, text.clone());
                self.publish_durable(
                    self.core.active().map(|(p, _)| p),
                    Some(turn),
                    EventBody::SteerAccepted {
                        steer_id: steer.to_string(),
                        text: text.clone(),
                    },
                    Ledger::Admission,
                )
                .await
            }
            SteerOutcome::StartedNewTurn { prompt } => {
                metrics::counter!("tiller_prompts_admitted_total", "origin" => "interactive")
                    .increment(1);
                self.publish_durable(
                    Some(prompt),
                    None,
                    EventBody::PromptStarted {
                        origin: Origin::Interactive.as_str().into(),
                    },
                    Ledger::Admission,
                )
                .await
            }
            SteerOutcome::PromptRequired(_) => Ok(()),
        };
        if stored.is_err() {
            // Not acknowledged; the session fails after this message.
            let _ = reply.send(Err(PromptRefused::StoreUnavailable));
            return;
        }
        let _ = reply.send(Ok(SteerAnswer { steer, outcome }));
        let steer_text = text;
        self.apply_with_steer(myself, fx, steer, steer_text).await;
    }

    async fn apply_with_steer(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        fx: Vec<Effect>,
        steer: SteerId,
        text: String,
    ) {
        for e in &fx {
            if let Effect::ForwardSteer { turn, steer: s } = e
                && *s == steer
                && let Some(run) = self.running.as_ref().filter(|r| r.turn == *turn)
            {
                run.handle.send(EngineInput::Steer {
                    id: steer,
                    text: text.clone(),
                });
            }
        }
        self.apply(myself, fx, None).await;
    }

    async fn feed(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        input: Input,
        content: Option<SignalKind>,
    ) {
        let fx = self.core.on(self.now(), input);
        self.apply(myself, fx, content).await;
    }

    /// Carries out the core's effects in order.
    async fn apply(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        fx: Vec<Effect>,
        mut content: Option<SignalKind>,
    ) {
        let mut trip = None;
        for e in fx {
            if self.failed.is_some() {
                return; // the session is failing: its state is not the log's
            }
            match e {
                Effect::Queued { .. }
                | Effect::Rejected { .. }
                | Effect::SteerAnswer { .. }
                | Effect::ForwardSteer { .. } => {} // handled by the caller
                Effect::StartTurn {
                    prompt,
                    turn,
                    origin,
                } => self.start_turn(myself, prompt, turn, origin).await,
                Effect::Deliver { turn } => {
                    if let Some(kind) = content.take()
                        && let Some(loop_type) = self.deliver(turn, kind)
                    {
                        trip = Some(Input::LoopTrip { turn, loop_type });
                    }
                }
                Effect::LoopStopped {
                    prompt,
                    turn,
                    loop_type,
                } => {
                    self.loop_stopped = Some(prompt);
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::LoopStopped {
                            loop_type: loop_type.as_str().into(),
                            message: tiller_core::ErrorKind::LoopDetected(loop_type)
                                .default_message(),
                        },
                    );
                }
                Effect::SteerConsumed {
                    steer,
                    prompt,
                    turn,
                } => {
                    self.steers.remove(&steer);
                    metrics::counter!("tiller_steer_receipts_total", "kind" => "consumed")
                        .increment(1);
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::SteerConsumed {
                            steer_id: steer.to_string(),
                        },
                    );
                }
                Effect::SteerDropped {
                    steer,
                    reason,
                    prompt,
                    turn,
                } => {
                    let text = self.steers.remove(&steer).unwrap_or_default();
                    match reason {
                        SteerDropReason::Engine => {
                            metrics::counter!("tiller_steer_receipts_total", "kind" => "dropped")
                                .increment(1);
                        }
                        SteerDropReason::ReceiptTimeout => {
                            metrics::counter!("tiller_steer_receipt_timeouts_total").increment(1);
                        }
                        _ => {}
                    }
                    self.publish(
                        Some(prompt),
                        Some(turn),
                        EventBody::SteerDropped {
                            steer_id: steer.to_string(),
                            text,
                            reason: drop_reason_label(reason).into(),
                        },
                    );
                }
                Effect::AbortEngine { turn, teardown } => {
                    self.abandon_permission(turn);
                    if let Some(run) = self.running.as_ref().filter(|r| r.turn == turn) {
                        run.handle.send(EngineInput::Abort);
                        if teardown {
                            run.handle.teardown();
                        }
                    }
                }
                Effect::Settled {
                    prompt,
                    turn,
                    origin,
                    terminal,
                } => self.settle(prompt, turn, origin, terminal).await,
                // An engine task ending after its turn settled is no stale signal.
                Effect::Stale { .. } if matches!(content, Some(SignalKind::Exited(_))) => {}
                Effect::Stale { .. } => {
                    metrics::counter!("tiller_stale_signals_total").increment(1);
                }
                Effect::WatchdogFired { kind } => {
                    let kind = match kind {
                        tiller_core::WatchdogKind::Stall => "stall",
                        tiller_core::WatchdogKind::CancelGrace => "cancel_grace",
                        tiller_core::WatchdogKind::SteerReceipt => "steer_receipt",
                    };
                    tracing::warn!(kind, "watchdog fired");
                    metrics::counter!("tiller_watchdog_fired_total", "kind" => kind).increment(1);
                }
                Effect::ArmTimer { at } => self.arm(myself, at),
                Effect::Poll { origin, poll } => {
                    if !self.automation.poll(origin, self.id, poll, myself) {
                        // No actor for that queue: nothing is due there.
                        let _ = myself.send_message(SessionMsg::Offer {
                            origin,
                            poll,
                            work: None,
                        });
                    }
                }
                Effect::OfferRefused { prompt, .. } => {
                    // Still queued in the store: offered again at the next poll.
                    self.pending.remove(&prompt);
                }
                Effect::Idle => {
                    tracing::debug!("session idle");
                    for d in self.drained.drain(..) {
                        let _ = d.send(());
                    }
                    if self.closing {
                        myself.stop(Some("closed".into()));
                    }
                }
            }
        }
        // A loop trip found while delivering content is the core's next input.
        if let Some(input) = trip {
            let fx = self.core.on(self.now(), input);
            Box::pin(self.apply(myself, fx, None)).await;
        }
    }

    async fn start_turn(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        prompt: PromptId,
        turn: TurnId,
        origin: Origin,
    ) {
        let Some((prepared, queued)) = self
            .pending
            .get_mut(&prompt)
            .and_then(|p| Some((p.prepared.take()?, p.queued)))
        else {
            tracing::error!(%prompt, "started a prompt with no content");
            return;
        };
        let span = tracing::info_span!(parent: &self.span, "turn", %turn, %prompt, origin = origin.as_str());
        span.in_scope(|| tracing::info!("turn started"));
        // A queued prompt already has its admission event; announce the start.
        if queued {
            metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
            let claim = self
                .pending
                .get(&prompt)
                .and_then(|p| p.work.as_ref())
                .and_then(Work::claim);
            if let Some(tiller_store::Claim::Notification(_)) = claim {
                metrics::gauge!("tiller_notifications_queued").decrement(1.0);
            }
            self.publish_with(
                Some(prompt),
                Some(turn),
                EventBody::PromptStarted {
                    origin: origin.as_str().into(),
                },
                claim,
            );
        }
        self.publish(
            Some(prompt),
            Some(turn),
            EventBody::UserMessage {
                text: prepared.text.clone(),
            },
        );
        let actor = myself.clone();
        let pace = self.pace.clone();
        let sink: tiller_engine::SignalSink = Arc::new(move |sig| {
            pace.sent();
            let _ = actor.send_message(SessionMsg::Engine(sig));
        });
        let ctx = TurnContext {
            conversation: self.conversation.clone(),
            tools: Arc::new(self.toolbox.specs()),
            model: self.model.clone(),
            pace: self.pace.clone(),
        };
        let mut handle = {
            let _g = span.enter();
            self.engine.start(turn, prepared, ctx, sink.clone())
        };
        // An engine task that ends (or panics) without its terminal settles
        // the turn at once, not at the stall bound.
        handle.watch(move |panic| {
            sink(EngineSignal {
                turn,
                kind: SignalKind::Exited(panic),
            });
        });
        self.running = Some(RunningEngine {
            turn,
            prompt,
            origin,
            handle,
            guard: LoopGuard::new(self.loops.clone()),
            text: String::new(),
            batch: None,
            exec: None,
            stopping: false,
            span,
        });
    }

    /// Publishes or runs a signal's content. Returns a loop trip, if the
    /// tool pipeline's guard found one.
    fn deliver(&mut self, turn: TurnId, kind: SignalKind) -> Option<LoopType> {
        let prompt = self.core.active().map(|(p, _)| p);
        // Only a tool batch needs what running calls takes.
        let exec = matches!(kind, SignalKind::ToolBatch(_)).then(|| Exec::of(self));
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let (events, trip) = match kind {
            SignalKind::Update(Update::Text(text)) => {
                let trip = run.guard.text(&text).err();
                run.text.push_str(&text);
                (vec![EventBody::AgentMessageChunk { text }], trip)
            }
            SignalKind::Update(Update::Thought(text)) => {
                (vec![EventBody::AgentThoughtChunk { text }], None)
            }
            SignalKind::Update(Update::Usage { input, output }) => (
                vec![EventBody::Usage {
                    input_tokens: input,
                    output_tokens: output,
                }],
                None,
            ),
            SignalKind::Update(Update::Plan(entries)) => (
                vec![EventBody::Plan {
                    entries: entries
                        .into_iter()
                        .map(|(content, status)| crate::event::PlanEntry { content, status })
                        .collect(),
                }],
                None,
            ),
            SignalKind::ToolBatch(calls) => {
                // Nobody answers for an automatic turn: calls that would
                // ask are refused at once.
                let mut batch = Batch::new(calls).unattended(run.origin != Origin::Interactive);
                let mut events = Vec::new();
                let progress = batch.advance(&mut run.guard, &self.permissions, &mut events);
                run.batch = Some(batch);
                let exec = exec.as_ref().expect("made for tool batches");
                (events, batch_progress(run, progress, exec))
            }
            _ => (Vec::new(), None),
        };
        if let Some(loop_type) = trip {
            run.span.in_scope(|| {
                tracing::warn!(loop_type = loop_type.as_str(), "loop protection tripped");
            });
            metrics::counter!(
                "tiller_loop_detected_total",
                "loop_type" => loop_type.as_str(),
                "origin" => run.origin.as_str()
            )
            .increment(1);
        }
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        trip
    }

    /// Applies a person's decision to the paused batch. Returns a loop trip
    /// found while the batch went on.
    fn permission(
        &mut self,
        request_id: &str,
        option_id: &str,
    ) -> Result<Option<LoopType>, PermissionRefused> {
        let unknown = || PermissionRefused::Unknown(request_id.to_owned());
        let prompt = self.core.active().map(|(p, _)| p);
        let exec = Exec::of(self);
        let run = self.running.as_mut().ok_or_else(unknown)?;
        let batch = run.batch.as_mut().ok_or_else(unknown)?;
        if batch.waiting().map(|(w, _)| w.request_id.as_str()) != Some(request_id) {
            return Err(unknown());
        }
        let decision = Decision::from_option(option_id)
            .ok_or_else(|| PermissionRefused::BadOption(option_id.to_owned()))?;
        let mut events = Vec::new();
        let progress = batch.decide(decision, &mut run.guard, &mut self.permissions, &mut events);
        let turn = run.turn;
        let trip = batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        Ok(trip)
    }

    /// A turn that ends (cancel, settle) while a call waits for permission
    /// or runs resolves it as cancelled (a running call is stopped), so no
    /// call stays pending.
    fn abandon_permission(&mut self, turn: TurnId) {
        let exec = Exec::of(self);
        let Some(run) = self.running.as_mut().filter(|r| r.turn == turn) else {
            return;
        };
        run.stopping = true;
        if let Some(task) = run.exec.take() {
            task.abort();
        }
        let prompt = Some(run.prompt);
        let Some(batch) = run.batch.as_mut() else {
            return;
        };
        let mut events = Vec::new();
        let Some(progress) = batch.abandon(&mut run.guard, &mut self.permissions, &mut events)
        else {
            return;
        };
        batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
    }

    /// A call that ran off the actor finished: the batch goes on. Returns
    /// a loop trip found while it did.
    fn tool_done(&mut self, turn: TurnId, id: &str, output: ToolOutput) -> Option<LoopType> {
        let exec = Exec::of(self);
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let prompt = Some(run.prompt);
        let batch = run.batch.as_mut()?;
        if batch.running() != Some(id) {
            return None; // abandoned meanwhile
        }
        run.exec = None;
        let mut events = Vec::new();
        let progress = batch.finish(id, output, &mut run.guard, &self.permissions, &mut events);
        let trip = batch_progress(run, progress, &exec);
        for body in events {
            self.publish(prompt, Some(turn), body);
        }
        trip
    }

    /// The options a client may change.
    fn options(&self) -> Vec<ConfigOption> {
        let mut v = Vec::new();
        let engines = self.engines.names();
        if engines.len() > 1 {
            v.push(ConfigOption {
                id: "engine".into(),
                name: "Engine".into(),
                category: "engine".into(),
                current: self.engine.name().to_owned(),
                choices: engines,
            });
        }
        let models = self.engine.models();
        if let Some(default) = models.first() {
            v.push(ConfigOption {
                id: "model".into(),
                name: "Model".into(),
                category: "model".into(),
                current: self
                    .model
                    .clone()
                    .filter(|m| models.contains(m))
                    .unwrap_or_else(|| default.clone()),
                choices: models.clone(),
            });
        }
        v.push(ConfigOption {
            id: "permission_mode".into(),
            name: "Permission mode".into(),
            category: "mode".into(),
            current: self.permissions.mode.as_str().into(),
            choices: ["ask", "accept-edits", "allow-all"]
                .map(String::from)
                .to_vec(),
        });
        v
    }

    async fn set_option(&mut self, id: &str, value: &str) -> Result<Vec<ConfigOption>, String> {
        let Some(opt) = self.options().into_iter().find(|o| o.id == id) else {
            let known: Vec<String> = self.options().into_iter().map(|o| o.id).collect();
            return Err(format!(
                "unknown config option `{id}` (this session has: {})",
                known.join(", ")
            ));
        };
        if !opt.choices.iter().any(|c| c == value) {
            return Err(format!(
                "`{value}` is not a value of `{id}` (choices: {})",
                opt.choices.join(", ")
            ));
        }
        match id {
            "engine" => {
                let engine = self.engines.get(Some(value)).map_err(|e| e.to_string())?;
                let root = self.toolbox.root();
                if engine.uses_directory() && !root.is_dir() {
                    return Err(format!(
                        "engine `{value}` runs tools in the session's directory, and {} is not one",
                        root.display()
                    ));
                }
                // The next turn runs on it, with the whole conversation.
                self.engine = engine;
                if let Err(e) = self
                    .store
                    .save_state(self.id, tiller_store::StateColumn::Engine, value.to_owned())
                    .await
                {
                    tracing::error!(error = %e, "cannot store the session's engine");
                }
                let models = self.engine.models();
                self.model = self.model.take().filter(|m| models.contains(m));
            }
            "model" => self.model = Some(value.to_owned()),
            _ => {
                self.permissions.mode =
                    PermissionMode::parse(value).expect("choices are valid modes");
            }
        }
        self.save_settings().await;
        let options = self.options();
        self.publish(
            None,
            None,
            EventBody::ConfigOptions {
                options: options.clone(),
            },
        );
        Ok(options)
    }

    /// Stores the session's options and "always allowed" tools.
    async fn save_settings(&mut self) {
        let settings = Settings {
            model: self.model.clone(),
            // A session on the configured mode follows the config.
            permission_mode: (self.permissions.mode != self.config.permission_mode)
                .then(|| self.permissions.mode.as_str().into()),
            always: self.permissions.always(),
        };
        let json = serde_json::to_string(&settings).expect("settings serialize");
        if let Err(e) = self
            .store
            .save_state(self.id, tiller_store::StateColumn::Settings, json)
            .await
        {
            tracing::error!(error = %e, "cannot store the session's settings");
        }
    }

    /// Stores the conversation when a turn added to it.
    async fn save_conversation(&mut self) {
        let revision = self.conversation.revision();
        if revision == self.conversation_saved {
            return;
        }
        self.conversation_saved = revision;
        let msgs = self.conversation.snapshot();
        let json = serde_json::to_string(&msgs).expect("messages serialize");
        if let Err(e) = self
            .store
            .save_state(self.id, tiller_store::StateColumn::Conversation, json)
            .await
        {
            tracing::error!(error = %e, "cannot store the conversation");
        }
    }

    async fn settle(
        &mut self,
        prompt: PromptId,
        turn: Option<TurnId>,
        origin: Origin,
        terminal: Terminal,
    ) {
        let now = self.now();
        let pending = self.pending.remove(&prompt);
        if turn.is_none() {
            // A queued prompt settled without running.
            metrics::gauge!("tiller_prompt_queue_depth").decrement(1.0);
        }
        if let Some(t) = turn {
            self.abandon_permission(t);
        }
        let final_text = self
            .running
            .as_ref()
            .filter(|r| Some(r.turn) == turn)
            .map(|r| r.text.clone());
        if let Some(run) = self.running.take_if(|r| Some(r.turn) == turn) {
            run.span
                .in_scope(|| tracing::info!(outcome = terminal.outcome_label(), "turn settled"));
            drop(run); // the engine never outlives its turn
            self.save_conversation().await;
        }
        if terminal == Terminal::Completed(tiller_core::StopReason::Cancelled)
            && let Some(at) = self.cancel_at.take()
            && turn.is_some()
        {
            metrics::histogram!("tiller_cancel_latency_seconds").record(at.elapsed().as_secs_f64());
        }
        let body = match &terminal {
            Terminal::Completed(r) => EventBody::TurnComplete {
                stop_reason: r.as_str().into(),
            },
            Terminal::Failed { kind, message } => EventBody::TurnError {
                error_kind: kind.as_str().into(),
                message: message.clone(),
                loop_type: kind.loop_type().map(|t| t.as_str().into()),
                code: kind.loop_type().map(|_| "LOOP_DETECTED".into()),
            },
        };
        // The delivery of the final text commits with the terminal.
        let ledger = match (pending.as_ref().and_then(|p| p.delivery.clone()), &terminal) {
            (Some(url), Terminal::Completed(tiller_core::StopReason::EndTurn)) => {
                Ledger::Deliver(tiller_store::Delivery {
                    id: 0,
                    url,
                    session: self.id,
                    prompt,
                    text: final_text.unwrap_or_default(),
                    stop_reason: "end_turn".into(),
                    attempts: 0,
                    next_at_ms: unix_ms(),
                })
            }
            _ => Ledger::Plain,
        };
        let delivers = matches!(ledger, Ledger::Deliver(_));
        let terminal = match self.publish_durable(Some(prompt), turn, body, ledger).await {
            Ok(()) => terminal,
            // Not stored: the owner hears what the log will say once the
            // failed session is reconciled.
            Err(_) => Terminal::failed(tiller_core::ErrorKind::StoreUnavailable),
        };
        if self.failed.is_none() {
            if delivers && let Some(w) = &self.config.delivery_wake {
                w.notify_one();
            }
            if origin == Origin::Goal
                && turn.is_some()
                && let Some(goal) = &self.automation.goal
            {
                let _ = goal.send_message(crate::goal::GoalMsg::TurnEnded {
                    session: self.id,
                    loop_stopped: self.loop_stopped == Some(prompt),
                    reply_to: self.myself.clone(),
                });
            }
        }
        metrics::counter!(
            "tiller_turns_settled_total",
            "origin" => origin.as_str(),
            "outcome" => terminal.outcome_label()
        )
        .increment(1);
        if let Some(p) = pending {
            metrics::histogram!("tiller_turn_duration_seconds", "origin" => origin.as_str())
                .record(now.saturating_sub(p.admitted_at) as f64 / 1000.0);
            if let Some(tx) = p.settled {
                let _ = tx.send(Settlement { prompt, terminal });
            }
        }
        metrics::histogram!("tiller_settle_latency_seconds")
            .record(self.input_at.elapsed().as_secs_f64());
    }

    fn arm(&mut self, myself: &ActorRef<SessionMsg>, at: Option<Millis>) {
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        if let Some(at) = at {
            let delay = Duration::from_millis(at.saturating_sub(self.now()));
            self.timer = Some(myself.send_after(delay, || SessionMsg::Tick));
        }
    }

    fn snapshot(&self) -> Snapshot {
        let (state, active_prompt) = match self.core.active() {
            None => (TurnState::Idle, None),
            Some((p, _)) if self.core.is_cancelling() => (TurnState::Cancelling, Some(p)),
            Some((p, _)) => (TurnState::Running, Some(p)),
        };
        Snapshot {
            state,
            active_prompt,
            queued: self.core.queued().collect(),
            // Only while idle: a running turn is newer content.
            last_turn_error: self
                .last_turn_error
                .clone()
                .filter(|_| state == TurnState::Idle),
            pending_permission: self.pending_permission.clone(),
            last_seq: self.seq,
        }
    }

    /// Gives an event the next sequence number.
    fn record(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        body: EventBody,
    ) -> Arc<EventRecord> {
        self.seq += 1;
        Arc::new(EventRecord {
            session: self.id,
            seq: self.seq,
            ts_ms: unix_ms(),
            prompt,
            turn,
            body,
        })
    }

    /// Keeps what the session's state shows of a published event.
    fn remember(&mut self, rec: &Arc<EventRecord>) {
        match rec.body {
            EventBody::PermissionRequested { .. } => self.pending_permission = Some(rec.clone()),
            EventBody::PermissionResolved { .. } => self.pending_permission = None,
            EventBody::TurnError { .. } => self.last_turn_error = Some(rec.clone()),
            // Newer turn content supersedes the error.
            EventBody::PromptStarted { .. } => self.last_turn_error = None,
            _ => {}
        }
    }

    fn fan_out(&mut self, rec: &Arc<EventRecord>) {
        self.remember(rec);
        metrics::counter!("tiller_events_published_total").increment(1);
        let before = self.subscribers.len();
        self.subscribers.retain(|(_, s)| s.deliver(rec));
        let evicted = before - self.subscribers.len();
        if evicted > 0 {
            metrics::counter!("tiller_subscriber_evictions_total").increment(evicted as u64);
            metrics::gauge!("tiller_subscribers_active").decrement(evicted as f64);
        }
    }

    /// Appends an event (ordered, not awaited) and fans it out.
    fn publish(&mut self, prompt: Option<PromptId>, turn: Option<TurnId>, body: EventBody) {
        self.publish_with(prompt, turn, body, None);
    }

    /// [`Self::publish`], for a start that consumes queued work.
    fn publish_with(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        mut body: EventBody,
        claim: Option<tiller_store::Claim>,
    ) {
        if let EventBody::ToolCall {
            name,
            input,
            locations,
            ..
        } = &mut body
        {
            *locations = self.toolbox.locations(name, input);
        }
        let rec = self.record(prompt, turn, body);
        let mut op = rec.ledger_op();
        if let Some(LedgerOp::Admit { consumes, .. }) = &mut op {
            *consumes = claim;
        }
        self.store.append(rec.to_stored(), op.clone());
        self.unconfirmed.push((rec.clone(), op));
        self.fan_out(&rec);
    }

    /// Appends an event, waits for its commit, and only then fans it out.
    /// `retries` is how often a failure the store may recover from is
    /// retried (the log is reopened and what it lost sent again, with the
    /// sequence numbers clients already saw). On error nobody saw the
    /// event, and the session fails once the current message is handled:
    /// its in-memory state is no longer the log's, so it is rebuilt from
    /// the store and its unsettled prompts are reconciled.
    async fn publish_durable(
        &mut self,
        prompt: Option<PromptId>,
        turn: Option<TurnId>,
        body: EventBody,
        ledger: Ledger,
    ) -> Result<(), StoreError> {
        let rec = self.record(prompt, turn, body);
        let mut op = rec.ledger_op();
        if let (Some(LedgerOp::Settle { delivery, .. }), Ledger::Deliver(d)) = (&mut op, &ledger) {
            *delivery = Some(d.clone());
        }
        let retries = if matches!(ledger, Ledger::Admission) {
            0
        } else {
            3
        };
        let mut attempt = 0;
        loop {
            let r = self.store.append_durable(rec.to_stored(), op.clone()).await;
            match r {
                Ok(()) => {
                    self.unconfirmed.clear();
                    self.fan_out(&rec);
                    return Ok(());
                }
                Err(e) if attempt < retries && e.is_unavailable() => {
                    attempt += 1;
                    tracing::warn!(error = %e, attempt, seq = rec.seq, "durable append failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100 << (2 * attempt))).await;
                    if let Ok(head) = self.store.reopen_log(self.id).await {
                        for (u, op) in self
                            .unconfirmed
                            .iter()
                            .filter(|(u, _)| u.seq > head.last_seq)
                        {
                            self.store.append(u.to_stored(), op.clone());
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, seq = rec.seq, "durable append failed; the session stops");
                    self.failed = Some(crate::SessionFailed::StoreUnavailable);
                    return Err(e);
                }
            }
        }
    }
}

/// What a durable event carries besides its ledger change.
enum Ledger {
    /// An admission: refused at once if it cannot be stored (the caller
    /// retries; nothing was acknowledged).
    Admission,
    /// Anything else durable: retried before the session gives up.
    Plain,
    /// A terminal with the webhook delivery of its final text.
    Deliver(tiller_store::Delivery),
}

/// What running a call off the actor needs.
struct Exec {
    toolbox: Arc<Toolbox>,
    client: Option<Arc<dyn ClientTools>>,
    actor: ActorRef<SessionMsg>,
    conversation: Conversation,
}

impl Exec {
    /// Adds a batch's results to the conversation (for an engine that will
    /// not see them).
    fn record(&self, results: Vec<tiller_engine::ToolResult>) {
        for r in results {
            self.conversation.push(tiller_engine::Message::ToolResult {
                id: r.id,
                ok: r.output.ok,
                output: r.output.output,
            });
        }
    }

    /// The newest attached client that offers file or terminal methods
    /// acts for the session.
    fn of(st: &SessionState) -> Exec {
        Exec {
            toolbox: st.toolbox.clone(),
            client: st
                .subscribers
                .iter()
                .rev()
                .find_map(|(_, s)| s.client_tools()),
            actor: st.myself.clone(),
            conversation: st.conversation.clone(),
        }
    }
}

/// Hands a batch's results to the engine once it is done, or starts the
/// call it waits on. Returns the loop trip that stopped it, if any.
fn batch_progress(run: &mut RunningEngine, progress: Progress, exec: &Exec) -> Option<LoopType> {
    match progress {
        // The turn is ending: the engine is about to be stopped and must
        // not take the results as a cue to call its model again. The
        // conversation still records every result.
        Progress::Done(results) if run.stopping => {
            run.batch = None;
            exec.record(results);
            None
        }
        Progress::Waiting => None,
        Progress::Run(call) => {
            let (toolbox, client, actor) = (
                exec.toolbox.clone(),
                exec.client.clone(),
                exec.actor.clone(),
            );
            let turn = run.turn;
            let task = async move {
                let output = toolbox.run(&call, client).await;
                let _ = actor.send_message(SessionMsg::ToolDone {
                    turn,
                    id: call.id,
                    output,
                });
            };
            run.exec = Some(tokio::spawn(task.instrument(run.span.clone())));
            None
        }
        Progress::Done(results) => {
            run.batch = None;
            run.handle.send(EngineInput::ToolResults(results));
            None
        }
        Progress::Tripped(loop_type, results) => {
            // As above: the trip stops the engine; skipped calls included.
            run.batch = None;
            exec.record(results);
            Some(loop_type)
        }
    }
}

fn core_signal(kind: &SignalKind) -> Signal {
    match kind {
        SignalKind::Update(_) => Signal::Update,
        SignalKind::ToolBatch(_) => Signal::ToolBatch,
        SignalKind::Result(r) => Signal::Result(*r),
        SignalKind::Idle => Signal::Idle,
        SignalKind::SteerReceipt(s, r) => Signal::SteerReceipt(*s, *r),
        SignalKind::Failed(k, m) => Signal::Failed(*k, m.clone()),
        SignalKind::Exited(panic) => Signal::Exited(panic.clone()),
    }
}

fn steer_outcome_label(o: &SteerOutcome) -> &'static str {
    match o {
        SteerOutcome::Injected { .. } => "injected",
        SteerOutcome::PromptRequired(_) => "prompt_required",
        SteerOutcome::StartedNewTurn { .. } => "started_new_turn",
    }
}

fn drop_reason_label(r: SteerDropReason) -> &'static str {
    match r {
        SteerDropReason::Engine => "engine",
        SteerDropReason::TurnEnded => "turn_ended",
        SteerDropReason::ReceiptTimeout => "receipt_timeout",
        SteerDropReason::Cancelled => "cancelled",
    }
}

/// Wall-clock time for event timestamps (display only; ordering is `seq`).
fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
