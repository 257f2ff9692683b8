//! The session actor: a thin shell around [`SessionCore`]. It stores and
//! publishes events, runs the engine and the tool pipeline, and carries out
//! the core's effects. Every rule about turns lives in the core.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tiller_core::{
    Answer, Effect, EngineStop, IdleBehavior, Input, LoopConfig, LoopGuard, LoopType, Millis,
    Origin, PromptId, Rejection, SessionCore, SessionId, Signal, SteerDropReason, SteerId,
    SteerOutcome, Terminal, TurnId,
};
use tiller_engine::{
    Conversation, Engine, EngineHandle, EngineInput, EngineSignal, PreparedPrompt, SignalKind,
    ToolOutput, TurnContext, Update,
};
use tiller_store::{LedgerOp, LogHead, Store, StoreError};
use tiller_tools::{ClientTools, McpServer, Toolbox};
use tokio::sync::oneshot;
use tracing::{Instrument, Span};

mod admit;
mod effects;
mod failure;
mod handle;
mod hosted;
mod options;
mod park;
mod pipeline;
mod publish;
mod signals;
mod wake;

use effects::core_signal;
use publish::{LINGER_AFTER, Ledger, unlingered};

use crate::Acknowledge;
use crate::event::{ConfigOption, EventBody, EventRecord};
use crate::ports::{Ack, Inbox};
pub use crate::ports::{Automation, Work};
use crate::tools::{Batch, CallIds, Decision, PermissionMode, Permissions, Progress};
use crate::{
    PermissionRefused, PromptRefused, SessionConfig, Snapshot, SteerAnswer, Subscriber,
    SubscriberId, TurnState,
};
use tiller_core::pipeline::CallId;

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
    /// Run a prompt. `admitted` answers once it is admitted (or refused):
    /// stored first unless `ack` is [`Acknowledge::Terminal`]; `settled` answers
    /// with its terminal.
    Prompt {
        /// Chosen by the caller (fresh).
        id: PromptId,
        text: String,
        /// Attached images (refused by engines that take none).
        images: Vec<tiller_engine::Image>,
        origin: Origin,
        /// A webhook to receive the final text on `end_turn`.
        delivery: Option<String>,
        admitted: Option<oneshot::Sender<Result<PromptId, PromptRefused>>>,
        settled: Option<oneshot::Sender<Settlement>>,
        ack: Acknowledge,
    },
    /// Steer the running turn.
    Steer {
        text: String,
        prompt_required: bool,
        reply: oneshot::Sender<Result<SteerAnswer, PromptRefused>>,
    },
    /// `session/cancel`.
    Cancel,
    /// Store the settings (the usage changed).
    SaveSettings,
    /// Set the additional roots (ACP `additionalDirectories`); answered
    /// once stored, or with why a root is refused.
    SetRoots {
        roots: Vec<String>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// `/clear`: forget the model conversation (refused while a turn runs).
    ClearConversation(oneshot::Sender<Result<(), String>>),
    /// Set (or clear) the title; answered once it is stored (the agent's
    /// own naming has no one to answer).
    SetTitle {
        title: Option<String>,
        reply: Option<oneshot::Sender<Result<(), crate::SessionError>>>,
    },
    /// Its sender withdraws a prompt (see [`tiller_core::Input::Withdraw`]).
    Withdraw(PromptId),
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
    /// to poll afterwards. With `ack` it is stored before it is answered
    /// and fanned out.
    Automation {
        body: EventBody,
        kick: bool,
        ack: Option<Ack>,
    },
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
    /// Signals from this session's engine wait in `signals`.
    Signals,
    /// The store committed this session's events up to this one: shown.
    Committed(u64),
    /// A commit of streamed events failed (see `Recovery`).
    AppendFailed(u64, Arc<StoreError>),
    /// Send the store what this session published and has not sent yet
    /// (sent to itself at the first such event: every message already in
    /// the mailbox is handled first, so a burst commits together). The
    /// first `Flush` lets the other ready tasks run and goes to the back of
    /// the mailbox once more: a turn's engine, just started, sends its
    /// first signals before the flush, and they commit with it.
    Flush,
    /// A tool call that ran off the actor finished.
    ToolDone {
        turn: TurnId,
        /// The call, as the pipeline numbered it.
        id: CallId,
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
    /// A timer armed by the core fired (its generation: see `wake.rs`).
    Tick(u64),
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
    /// The registry's sweep: ask to park if idle for `park_after`.
    ParkIfIdle,
    /// The registry holds the session's messages back: park (hand the
    /// clients over) if still idle, else stay.
    Park,
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
    /// Its title, if it has one.
    pub title: Option<String>,
    /// What the store kept of the session (settings, conversation).
    pub extras: tiller_store::SessionExtras,
    /// Where its handles and queues send (see [`crate::handle::Slot`]).
    pub slot: Arc<crate::handle::Slot>,
    /// Its clients, when it wakes from parking.
    pub subscribers: crate::subscribers::Subscribers,
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
    /// Model usage so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage: Option<crate::UsageTotals>,
    /// Additional roots of the file tools (canonical).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    roots: Vec<String>,
    /// The engine switches set away from their defaults.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    switches: std::collections::BTreeMap<String, bool>,
    /// A hosted agent's session id (ACP engines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    upstream: Option<String>,
    /// Values chosen for a hosted agent's own options, by the agent's id.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    agent_options: std::collections::BTreeMap<String, String>,
    /// A hosted agent's options as it last reported them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    agent_offered: Vec<tiller_engine::AgentOption>,
}

/// A hosted agent's options: what it offers, what the session chose.
#[derive(Default)]
pub(super) struct AgentOptions {
    offered: Vec<tiller_engine::AgentOption>,
    chosen: std::collections::BTreeMap<String, String>,
}

/// The prefix of a hosted agent's option ids among the session's.
pub(super) const AGENT_OPTION: &str = "agent.";

/// What the session keeps with a prompt from admission to its terminal
/// (the core carries it: `SessionCore<Pending, String>`).
pub(crate) struct Pending {
    /// The engine's view of the prompt (taken when its turn starts).
    prepared: Option<PreparedPrompt>,
    /// The owner's terminal port.
    settled: Option<oneshot::Sender<Settlement>>,
    /// When it was admitted, for `turn_duration_seconds`.
    admitted_at: Millis,
    /// The queue item it came from (consumed when its start is committed).
    work: Option<Work>,
    /// Where to deliver the final text on `end_turn`.
    delivery: Option<String>,
}

impl Pending {
    fn new(prepared: PreparedPrompt, admitted_at: Millis) -> Self {
        Pending {
            prepared: Some(prepared),
            settled: None,
            admitted_at,
            work: None,
            delivery: None,
        }
    }

    fn settled(mut self, settled: Option<oneshot::Sender<Settlement>>) -> Self {
        self.settled = settled;
        self
    }

    fn delivery(mut self, delivery: Option<String>) -> Self {
        self.delivery = delivery;
        self
    }

    fn work(mut self, work: Work) -> Self {
        self.work = Some(work);
        self
    }
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
    /// A hosted agent's calls and open question (ACP engines).
    hosted: Option<Box<hosted::HostedTurn>>,
    /// The turn is ending (cancel, settle): results no longer go to the
    /// engine.
    stopping: bool,
    /// How its engine stops at a cancel (its engine's kind).
    stop: EngineStop,
    /// The turn's tracing span.
    span: Span,
}

/// The session actor's state.
pub struct SessionState {
    id: SessionId,
    core: SessionCore<Pending, String>,
    engine: Arc<dyn Engine>,
    /// Every engine (the session may switch between turns).
    engines: crate::Engines,
    store: Store,
    /// Loop protection settings for each new turn's guard.
    loops: LoopConfig,
    /// This actor (queue actors answer to it).
    myself: ActorRef<SessionMsg>,
    /// Where its handles and queues send: its queues answer through it.
    slot: Arc<crate::handle::Slot>,
    /// Session settings (delivery destinations and wake-up).
    config: Arc<SessionConfig>,
    /// The queue actors polled when idle.
    automation: Automation,
    /// The permission mode and the tools allowed for the whole session.
    permissions: Permissions,
    /// The session's tools (built-ins in its cwd, MCP servers).
    toolbox: Arc<Toolbox>,
    /// The model conversation (model engines append to it).
    conversation: Conversation,
    /// Numbers the session's tool calls, keeps their published ids unique
    /// (made at the first tool call: an idle session pays one pointer).
    call_ids: Option<Box<CallIds>>,
    /// The engine's signals waiting (engines wait while they are many).
    signals: Arc<signals::Signals>,
    /// The model chosen with `session/set_config_option`.
    model: Option<String>,
    /// The `permission_requested` the running turn waits on.
    pending_permission: Option<Arc<EventRecord>>,
    /// The last sequence number given out.
    seq: u64,
    /// Events appended and not known committed: shown once they are, and
    /// re-sent with the same sequence numbers if the store lost them.
    unconfirmed: Vec<(Arc<EventRecord>, Option<LedgerOp>)>,
    /// How many of the newest `unconfirmed` are not sent to the store yet
    /// (they go at the next `Flush` or with the next durable event).
    unsent: u32,
    /// A `Flush` was put back once (see `SessionMsg::Flush`).
    flush_deferred: bool,
    /// When events were last sent to the store (see `publish::LINGER`).
    last_flush: tokio::time::Instant,
    /// A `Flush` is due at the end of a linger.
    lingering: bool,
    /// Events the running turn may still publish without lingering.
    eager: u8,
    /// The last sequence number fanned out (committed and shown).
    fanned: u64,
    /// How the store tells this session its appends committed (made at
    /// the first append: an idle session pays no allocation).
    on_commit: Option<tiller_store::OnCommit>,
    recovery: publish::Recovery,
    /// Set when the store failed: the actor fails after this message.
    failed: Option<crate::SessionFailed>,
    /// A started prompt whose admission is published and not yet stored
    /// (`Acknowledge::Terminal`; see `SessionState::store_admission`).
    /// Counted in `tiller_prompts_admitted_total` once stored.
    admitting: Option<(PromptId, Origin)>,
    /// The last `turn_error`, while no newer turn has started (survives a
    /// reload: restored from the log at start).
    last_turn_error: Option<Arc<EventRecord>>,
    /// At most one engine runs.
    running: Option<RunningEngine>,
    /// The engine of a turn settled at its cancel, stopping behind it
    /// (`SessionCore::winding`), and since when: kept until
    /// `Effect::EngineStopped`.
    winding: Option<(Box<RunningEngine>, tokio::time::Instant)>,
    /// Attached subscribers.
    subscribers: crate::subscribers::Subscribers,
    /// The wake-up timer the core asked for.
    wake: wake::Wake,
    /// The core's effects, a buffer reused while a turn runs.
    fx: Vec<Effect<Pending, String>>,
    /// The actor's clock origin (time is an input to the core).
    epoch: tokio::time::Instant,
    /// When the message being handled arrived, for `settle_latency_seconds`
    /// (deciding input to terminal sent).
    input_at: tokio::time::Instant,
    /// When a cancel arrived, for `cancel_latency_seconds`.
    cancel_at: Option<tokio::time::Instant>,
    /// Set by `Close`: refuse prompts, stop when idle.
    closing: bool,
    /// What of the close is stored: its event, the session's row.
    close_stored: (bool, bool),
    /// The session's title (set from the first prompt unless given).
    title: Option<Box<str>>,
    /// Model usage so far (none until the first request).
    usage: Option<Box<crate::UsageTotals>>,
    /// Engine switches set for this session (others take their defaults).
    switches: std::collections::BTreeMap<String, bool>,
    /// A hosted agent's session id (ACP engines), kept in the settings.
    upstream: Option<String>,
    /// A hosted agent's options as it last reported them (none until its
    /// first turn), and the values chosen for them (both kept in the
    /// settings; the values are set on the agent at each turn's start).
    agent: Option<Box<AgentOptions>>,
    /// Answered at the next idle (daemon shutdown).
    drained: Vec<oneshot::Sender<()>>,
    /// The last settings save failed: they live only here until one works.
    settings_unsaved: bool,
    /// `tiller_events_published_total`, looked up once (not per event).
    published: metrics::Counter,
    /// The session span (its turns' spans' parent).
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
        // A new session's log is empty: nothing to read back.
        let last = if args.head.last_seq == 0 {
            None
        } else {
            args.store
                .last_of_kinds(args.id, &["prompt_started", "turn_error"])
                .await?
        };
        let last_turn_error = match last {
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
        let stored = &args.extras.conversation;
        // A message this version cannot read is dropped (and the rest
        // kept), never the whole conversation.
        let conversation: Vec<tiller_engine::Message> = stored
            .messages
            .iter()
            .filter_map(|m| serde_json::from_str(m).ok())
            .collect();
        let conversation = if conversation.len() == stored.messages.len() {
            Conversation::restore(stored.base, conversation)
        } else {
            tracing::warn!(session = %args.id, "some stored conversation messages are unreadable");
            // Positions moved: stored afresh at the next save.
            let c = Conversation::restore(stored.base, Vec::new());
            for m in conversation {
                c.push(m);
            }
            c
        };
        let mode = settings
            .permission_mode
            .as_deref()
            .and_then(PermissionMode::parse)
            .unwrap_or(args.config.permission_mode);
        Ok(SessionState {
            toolbox: Arc::new(
                Toolbox::new(args.cwd.clone().into(), args.config.tools.clone())
                    .with_roots(settings.roots.iter().map(Into::into).collect()),
            ),
            conversation,
            call_ids: CallIds::after(args.head.last_turn),
            signals: Arc::new(signals::Signals::new(&args.config.budget)),
            model: settings.model,
            id: args.id,
            core: SessionCore::new(args.config.turn.clone(), args.head.last_turn)
                .with_automatic(args.automation.origins()),
            automation: args.automation,
            config: args.config.clone(),
            myself: myself.clone(),
            slot: args.slot,
            engine: args.engine,
            engines: args.engines,
            store: args.store,
            loops: args.config.loops.clone(),
            permissions: Permissions::new(mode).with_always(settings.always),
            pending_permission: None,
            seq: args.head.last_seq,
            unconfirmed: Vec::new(),
            unsent: 0,
            flush_deferred: false,
            last_flush: unlingered(),
            lingering: false,
            eager: 0,
            fanned: args.head.last_seq,
            on_commit: None,
            recovery: Default::default(),
            failed: None,
            admitting: None,
            last_turn_error,
            running: None,
            winding: None,
            subscribers: args.subscribers,
            wake: Default::default(),
            fx: Vec::new(),
            epoch: crate::clock::instant(),
            input_at: crate::clock::instant(),
            cancel_at: None,
            closing: false,
            close_stored: (false, false),
            title: args.title.map(String::into_boxed_str),
            usage: settings.usage.map(Box::new),
            switches: settings.switches,
            upstream: settings.upstream,
            agent: (!settings.agent_options.is_empty() || !settings.agent_offered.is_empty()).then(
                || {
                    Box::new(AgentOptions {
                        offered: settings.agent_offered,
                        chosen: settings.agent_options,
                    })
                },
            ),
            drained: Vec::new(),
            settings_unsaved: false,
            published: metrics::counter!("tiller_events_published_total"),
            span,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        st: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        // Boxed: an idle session's task stays small. Not in the session's
        // span (entered per message, 4% of the CPU under load): the log
        // lines name the session (`session = %self.id`). The messages that
        // await nothing skip the box (2.8 KB, allocated and copied).
        if let Some(msg) = st.handle_now(msg) {
            Box::pin(st.handle(&myself, msg)).await;
        }
        match st.failed {
            Some(why) => Err(Box::new(why)),
            None => Ok(()),
        }
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionMsg>,
        st: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        st.wake.stop();
        // A session taken over writes nothing more (it would be refused).
        if !st.taken_over() {
            st.flush();
        }
        Ok(())
    }
}
