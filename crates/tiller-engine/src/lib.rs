//! Engines drive a model backend for one turn and report TurnId-tagged
//! signals to their session. They never execute tools: a tool batch goes to
//! the session's pipeline and the results come back as [`EngineInput`].

pub mod acp;
mod conversation;
pub mod model;
mod script;
mod scripted;

use std::sync::Arc;

use tiller_core::{ErrorKind, SteerId, SteerReceipt, StopReason, TurnId};
use tokio::sync::mpsc;

pub use conversation::{
    CallRecord, Conversation, ConversationChange, HostInfo, Image, Message, OMITTED, TurnContext,
    window,
};
pub use script::{Script, ScriptError, Step, ToolStep};
pub use scripted::ScriptedEngine;

/// Content an engine streams for a turn.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// Agent text.
    Text(String),
    /// Agent thought.
    Thought(String),
    /// The agent's plan: entries and their status (`pending`,
    /// `in_progress`, `completed`).
    Plan(Vec<(String, String)>),
    /// Tokens one model request used.
    Usage { input: u64, output: u64 },
    /// The agent names the session.
    Title(String),
    /// An agent's own account of its context: tokens in use, the window's
    /// size, and what the session cost so far (ACP `usage_update`).
    Context {
        used: u64,
        size: u64,
        cost: Option<(f64, String)>,
    },
    /// The engine compacts the conversation: older turns replaced by a
    /// summary (ACP `compaction_update`). `id` names one compaction.
    Compaction { id: String, phase: CompactionPhase },
}

/// Where a compaction stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompactionPhase {
    Started,
    /// Done: the summary that now stands for the older turns.
    Completed(String),
    /// It failed (why); the turn goes on with the window.
    Failed(String),
    /// The turn was cancelled during it.
    Cancelled,
}

/// Content from an engine that hosts an agent running its own tools (an
/// ACP agent): the session shows its calls, answers its permission
/// requests and serves its file reads and writes.
#[derive(Clone, Debug, PartialEq)]
pub enum Hosted {
    /// A tool call was announced or changed (ACP `tool_call`,
    /// `tool_call_update`). Boxed, as below: every signal is as large as
    /// its largest kind.
    Call(Box<HostedCall>),
    /// The agent asks permission for a call; answer with
    /// [`EngineInput::Permission`] and the same `request`.
    Permission { request: u64, call: Box<HostedCall> },
    /// The agent reads or writes a file through the host; answer with
    /// [`EngineInput::File`] and the same `request`.
    File { request: u64, op: FileOp },
    /// The agent's session for this turn: its id (kept durably), and how
    /// it was reached.
    Session {
        upstream: String,
        start: UpstreamStart,
    },
    /// The agent's own slash commands: `(name, description)`.
    Commands(Vec<(String, String)>),
    /// The agent's own options (its modes, models, ...), as it has them now.
    Options(Vec<AgentOption>),
}

/// One of a hosted agent's options (ACP `configOptions`, or its modes).
/// Kept with the session's settings, so a session that parks or restarts
/// shows them before the agent reports them again.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentOption {
    /// The agent's id.
    pub id: String,
    pub name: String,
    /// ACP's category (`mode`, `model`, ...), `other` when it gave none.
    pub category: String,
    /// Its current value.
    pub current: String,
    /// The values it takes.
    pub choices: Vec<String>,
}

/// How a turn reached its agent session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpstreamStart {
    /// A new session on the agent.
    New,
    /// The agent reloaded the session (after a restart of the agent or the
    /// daemon), with why it had to.
    Loaded(String),
    /// The agent could not reload it: a fresh session, and why.
    Fresh(String),
}

/// A tool call an agent runs itself, as far as it has told: fields it
/// did not send are `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostedCall {
    /// The agent's id for the call.
    pub id: String,
    /// Its name (the agent's tool name, else its title).
    pub name: Option<String>,
    pub title: Option<String>,
    pub kind: Option<ToolKind>,
    /// The ACP kind as the agent named it (`read`, `edit`, `search`, ...).
    pub acp_kind: Option<String>,
    /// `pending`, `in_progress`, `completed`, `failed`.
    pub status: Option<String>,
    pub input: Option<serde_json::Value>,
    /// Text of its output.
    pub output: Option<String>,
    /// Absolute paths it touches.
    pub locations: Vec<String>,
    /// For an edit: `(path, old text, new text)` (no old text: a new file).
    pub diff: Option<(String, Option<String>, String)>,
}

/// A file operation an agent asks its host for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileOp {
    /// Read lines from `line` (1-based), at most `limit`.
    Read {
        path: String,
        line: Option<u64>,
        limit: Option<u64>,
    },
    Write {
        path: String,
        content: String,
    },
}

/// A person's (or the host's) answer to a hosted agent's permission
/// request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermissionAnswer {
    AllowOnce,
    AllowAlways,
    Reject,
    /// The turn ended before anyone answered.
    Cancelled,
}

/// Variables every child (a hosted agent, a command, an MCP server) gets
/// when the daemon has them; anything more is passed by name.
pub const BASE_ENV: &[&str] = &["PATH", "HOME", "LANG", "TERM"];

/// What a tool does, which decides whether it needs permission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolKind {
    Read,
    Edit,
    Execute,
    Other,
}

impl ToolKind {
    /// The kind of the built-in tools, by name.
    pub fn of(name: &str) -> ToolKind {
        match name {
            "read_file" | "list_dir" | "glob" | "grep" => ToolKind::Read,
            "write_file" | "edit" | "apply_patch" => ToolKind::Edit,
            "shell" => ToolKind::Execute,
            _ => ToolKind::Other,
        }
    }

    /// Parses `read`, `edit`, `execute`, `other`.
    pub fn parse(s: &str) -> Option<ToolKind> {
        Some(match s {
            "read" => ToolKind::Read,
            "edit" => ToolKind::Edit,
            "execute" => ToolKind::Execute,
            "other" => ToolKind::Other,
            _ => return None,
        })
    }
}

/// A tool offered to a model: built-in or from an MCP server.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON Schema of its arguments.
    pub input_schema: serde_json::Value,
    /// What it does, which decides whether it needs permission.
    pub kind: ToolKind,
}

/// One tool call requested by an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Unique within the session; ties `tool_call` to its updates.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// What it does.
    pub kind: ToolKind,
    /// Its arguments.
    pub input: serde_json::Value,
    /// For the scripted engine: the outcome the simulated execution returns.
    pub simulated: Option<ToolOutput>,
}

/// What a tool call returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutput {
    /// Whether the call succeeded.
    pub ok: bool,
    /// Its output (or error text).
    pub output: String,
}

/// The result of one call in a batch, in the batch's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolResult {
    /// The call it answers.
    pub id: String,
    /// The output.
    pub output: ToolOutput,
}

/// A signal from an engine, tagged with the turn it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSignal {
    /// The turn this signal belongs to; any other turn treats it as stale.
    pub turn: TurnId,
    /// What happened.
    pub kind: SignalKind,
}

/// The signal kinds of `turn-lifecycle.md`, with their content.
#[derive(Clone, Debug, PartialEq)]
pub enum SignalKind {
    Update(Update),
    ToolBatch(Vec<ToolCall>),
    Result(StopReason),
    Idle,
    SteerReceipt(SteerId, SteerReceipt),
    Failed(ErrorKind, String),
    /// A hosted agent's calls, requests and session.
    Hosted(Hosted),
    /// The engine's task ended by itself (sent by its [`EngineHandle`]'s
    /// watcher, not by the engine): normally, or by a panic, with its
    /// message.
    Exited(Option<String>),
}

/// Messages from the session to a running engine.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineInput {
    /// The results of the last tool batch.
    ToolResults(Vec<ToolResult>),
    /// A steer injected into the turn.
    Steer { id: SteerId, text: String },
    /// Stop: emit `Result(cancelled)` and `Idle` and end.
    Abort,
    /// The answer to [`Hosted::Permission`].
    Permission {
        request: u64,
        answer: PermissionAnswer,
    },
    /// The answer to [`Hosted::File`]: the text read (empty for a write),
    /// or why it failed.
    File {
        request: u64,
        result: Result<String, String>,
    },
}

/// Where an engine sends its signals (the session's mailbox).
pub type SignalSink = Arc<dyn Fn(EngineSignal) + Send + Sync>;

/// The daemon-wide bound on streamed work in flight: every session's
/// engine signals not yet handled and events not yet committed, summed.
/// Engines wait while it is high, so a store that falls behind slows
/// every stream a little instead of growing the daemon's memory, and an
/// event waits for the store about `HIGH / commit rate` at most (a
/// tenth of a second at 150,000 events/s), under any number of sessions.
/// Durable events (admissions, terminals) are not counted: a cancel is
/// never held back. A session with nothing in flight that has waited
/// [`Pace::PATIENCE`] for it goes on: every stream makes progress, and a
/// prompt's first chunk never queues long behind the streams that filled
/// the budget (it once waited seconds, when a thousand engines raced for
/// each drained budget and a new one lost every race). That lets what one
/// engine step sends (a signal or a few, and the events the session
/// publishes for them) per session past the bound at most; the streams
/// that keep the
/// budget full still wait for it to drain, so they go on in bursts (which
/// the store commits as whole segments).
#[derive(Debug, Default)]
pub struct Budget {
    /// Signals and events in flight, every session's.
    used: std::sync::atomic::AtomicUsize,
    /// Woken when `used` falls to [`Budget::LOW`].
    drained: tokio::sync::Notify,
}

impl Budget {
    /// In flight at which engines wait.
    pub const HIGH: usize = 16_384;
    /// In flight at which they go on.
    pub const LOW: usize = 8_192;

    fn add(&self, n: usize) {
        self.used.fetch_add(n, std::sync::atomic::Ordering::AcqRel);
    }

    fn sub(&self, n: usize) {
        let before = self.used.fetch_sub(n, std::sync::atomic::Ordering::AcqRel);
        if before > Self::LOW && before - n <= Self::LOW {
            self.drained.notify_waiters();
        }
    }

    /// Signals and events in flight.
    pub fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Backpressure from a session to its engine: the signals sent and not yet
/// handled, and the events the session published that the store has not
/// committed yet. The session counts each signal in ([`Pace::sent`]) and
/// out ([`Pace::handled`]) and reports its uncommitted events
/// ([`Pace::held`]); an engine awaits [`Pace::room`] before producing more,
/// so at most [`Pace::HIGH`] signals wait in the mailbox, about
/// [`Pace::HELD_HIGH`] events wait for the store, and the daemon's
/// [`Budget`] holds for all sessions together.
#[derive(Debug, Default)]
pub struct Pace {
    /// Signals sent and not yet handled.
    waiting: std::sync::atomic::AtomicUsize,
    /// Events published and not yet committed.
    uncommitted: std::sync::atomic::AtomicUsize,
    /// Woken when either backlog falls to its low mark.
    drained: tokio::sync::Notify,
    /// The daemon's bound (its own, by default).
    budget: Arc<Budget>,
}

impl Pace {
    /// The signal backlog at which engines wait.
    pub const HIGH: usize = 256;
    /// The signal backlog at which they go on.
    pub const LOW: usize = 64;
    /// The uncommitted events at which engines wait.
    pub const HELD_HIGH: usize = 256;
    /// The uncommitted events at which they go on.
    pub const HELD_LOW: usize = 64;
    /// How long a session with nothing in flight waits for the daemon's
    /// [`Budget`] at most.
    pub const PATIENCE: std::time::Duration = std::time::Duration::from_millis(50);

    /// A session's pace within the daemon's `budget`.
    pub fn new(budget: Arc<Budget>) -> Pace {
        Pace {
            waiting: Default::default(),
            uncommitted: Default::default(),
            drained: Default::default(),
            budget,
        }
    }

    /// A signal went into the mailbox.
    pub fn sent(&self) {
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.budget.add(1);
    }

    /// The session handled one.
    pub fn handled(&self) {
        let before = self
            .waiting
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.budget.sub(1);
        // Woken where the backlog falls to its low mark, as the budget's
        // are, and where it empties while the budget is high (a patient
        // session with nothing in flight goes on past a full budget): not
        // at every signal below the mark (a lock each time). A waiting
        // engine checks again after it registers, so none sleeps past
        // either; below its low mark the budget has woken it already.
        if before == Self::LOW + 1 || (before == 1 && self.budget.used() >= Budget::LOW) {
            self.drained.notify_waiters();
        }
    }

    /// The session holds `n` events the store has not committed yet.
    pub fn held(&self, n: usize) {
        let before = self
            .uncommitted
            .swap(n, std::sync::atomic::Ordering::AcqRel);
        if n > before {
            self.budget.add(n - before);
        } else if before > n {
            self.budget.sub(before - n);
            if (before > Self::HELD_LOW && n <= Self::HELD_LOW)
                || (n == 0 && self.budget.used() >= Budget::LOW)
            {
                self.drained.notify_waiters();
            }
        }
    }

    /// Signals waiting.
    pub fn backlog(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether an engine must wait; `patient`: it has waited
    /// [`Pace::PATIENCE`] already.
    fn waits(&self, patient: bool) -> bool {
        let (waiting, held) = (
            self.backlog(),
            self.uncommitted.load(std::sync::atomic::Ordering::Acquire),
        );
        waiting >= Self::HIGH
            || held >= Self::HELD_HIGH
            || (self.budget.used() >= Budget::HIGH && !(patient && waiting + held == 0))
    }

    /// Returns once the session's backlogs and the daemon's budget are
    /// below their high marks.
    pub async fn room(&self) {
        // Patience only ever lets an engine go on sooner, so with room
        // without it there is room: no clock is read (this runs before
        // every chunk, and two clock reads were 3% of a stream's CPU).
        if !self.waits(false) {
            return;
        }
        let since = tokio::time::Instant::now();
        let patient = || since.elapsed() >= Self::PATIENCE;
        while self.waits(patient()) {
            let mine = self.drained.notified();
            let all = self.budget.drained.notified();
            tokio::pin!(mine, all);
            mine.as_mut().enable();
            all.as_mut().enable();
            if !self.waits(patient()) {
                return;
            }
            // Bounded, in case the session went away without handling.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(50), async {
                tokio::select! {
                    () = mine => {}
                    () = all => {}
                }
            })
            .await;
        }
    }
}

impl Drop for Pace {
    /// What a session still counted leaves the daemon's budget with it.
    fn drop(&mut self) {
        self.budget
            .sub(*self.waiting.get_mut() + *self.uncommitted.get_mut());
    }
}

/// A prompt checked by the engine before it is admitted.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedPrompt {
    /// The prompt's text (text blocks joined).
    pub text: String,
    /// The script, when the prompt is one.
    pub script: Option<Script>,
    /// Images attached to the prompt (only for engines that take them).
    pub images: Vec<Image>,
}

/// A running engine turn.
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<EngineInput>,
    /// Ends the task (teardown, drop).
    abort: tokio::task::AbortHandle,
    /// The task, until [`EngineHandle::watch`] takes it.
    task: Option<tokio::task::JoinHandle<()>>,
}

impl EngineHandle {
    pub fn new(tx: mpsc::UnboundedSender<EngineInput>, task: tokio::task::JoinHandle<()>) -> Self {
        Self {
            tx,
            abort: task.abort_handle(),
            task: Some(task),
        }
    }

    pub fn send(&self, input: EngineInput) {
        let _ = self.tx.send(input);
    }

    /// A sender of inputs, for answers produced off the session actor.
    pub fn sender(&self) -> mpsc::UnboundedSender<EngineInput> {
        self.tx.clone()
    }

    pub fn teardown(&self) {
        self.abort.abort();
    }

    /// Calls `exited` when the engine's task ends by itself: with `None`
    /// when it returned, with the panic's message when it panicked (never
    /// when it was aborted). A turn can then settle at once instead of
    /// waiting for a signal that will never come.
    pub fn watch(&mut self, exited: impl FnOnce(Option<String>) + Send + 'static) {
        let Some(task) = self.task.take() else {
            return;
        };
        tokio::spawn(async move {
            match task.await {
                Ok(()) => exited(None),
                Err(e) if e.is_panic() => exited(Some(panic_message(&*e.into_panic()))),
                Err(_) => {} // aborted: the turn already ended
            }
        });
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        // An engine never outlives its turn.
        self.abort.abort();
    }
}

/// What a panic said (its message, when it has one).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned())
}

/// What a session's usage is measured against: the model's context window
/// (tokens) and, when configured, its prices.
#[derive(Clone, Debug, PartialEq)]
pub struct UsageBasis {
    /// Tokens the model's context holds.
    pub context_window: u64,
    pub prices: Option<Prices>,
}

/// What a model's tokens cost, per million.
#[derive(Clone, Debug, PartialEq)]
pub struct Prices {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// ISO 4217, e.g. `USD`.
    pub currency: String,
}

impl Prices {
    /// The cost of `input` and `output` tokens.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        (input as f64 * self.input_per_mtok + output as f64 * self.output_per_mtok) / 1e6
    }
}

pub trait Engine: Send + Sync + 'static {
    /// The engine's name in config and `session/new`.
    fn name(&self) -> &str;

    /// Its on/off settings a session may change: `(id, label, default)`.
    fn switches(&self) -> Vec<(&'static str, &'static str, bool)> {
        Vec::new()
    }

    /// Whether its models see images in prompts.
    fn accepts_images(&self) -> bool {
        false
    }

    /// The context window and prices usage is reported against.
    fn usage_basis(&self) -> UsageBasis {
        UsageBasis {
            context_window: 200_000,
            prices: None,
        }
    }

    /// Checks a prompt before admission. A malformed script is refused here,
    /// so it never becomes an engine crash.
    fn prepare(&self, text: &str) -> Result<PreparedPrompt, ScriptError>;

    /// Starts a turn. Must be called inside a tokio runtime.
    fn start(
        &self,
        turn: TurnId,
        prompt: PreparedPrompt,
        ctx: TurnContext,
        sink: SignalSink,
    ) -> EngineHandle;

    /// Whether its turns touch the session's directory (real tools); such
    /// a session needs a directory that exists.
    fn uses_directory(&self) -> bool {
        false
    }

    /// The models a session may choose (`session/set_config_option`);
    /// the first is the default. Empty when the engine has no choice.
    fn models(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether everything its turns do goes through the session: its tool
    /// calls run in the session's pipeline, which stops them at a cancel,
    /// and its text is the session's to publish. A cancelled turn then
    /// settles at once, its engine stopping behind it before the next turn
    /// starts ([`tiller_core::EngineStop::Behind`]). An agent that runs its
    /// own tools (the default) is answered `cancelled` only once it says
    /// it stopped, or at `turn.cancel_grace`.
    fn acts_through_session(&self) -> bool {
        false
    }

    /// Whether a running turn takes steers. An engine that cannot is
    /// never handed one: the steer is answered `promptRequired`.
    fn steering(&self) -> bool {
        true
    }

    /// The daemon stops: end every process the engine runs.
    fn shutdown(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_budget_holds_a_session_with_nothing_in_flight_back_a_while_only() {
        let budget = Arc::new(Budget::default());
        let busy = Pace::new(budget.clone());
        busy.held(Budget::HIGH); // one session filled the daemon's budget
        assert!(
            busy.waits(false) && busy.waits(true),
            "the session that filled it waits"
        );
        let quiet = Pace::new(budget.clone());
        assert!(quiet.waits(false), "nothing in flight: it waits a while");
        assert!(!quiet.waits(true), "then its next event goes on");
        quiet.held(1);
        assert!(quiet.waits(true), "with an event in flight it waits on");
        quiet.held(0);
        quiet.sent();
        assert!(
            quiet.waits(true),
            "a signal not yet handled counts as in flight"
        );
        quiet.handled();
        quiet.held(1);
        busy.held(0);
        assert!(!quiet.waits(false), "until the budget drains");
        drop((busy, quiet));
        assert_eq!(
            budget.used(),
            0,
            "dropped paces take what they held with them"
        );
    }

    /// An engine task awaiting room on `pace`.
    fn waiting_for_room(pace: &Arc<Pace>) -> tokio::task::JoinHandle<()> {
        let pace = pace.clone();
        tokio::spawn(async move { pace.room().await })
    }

    /// An engine held back by its session's backlog, or by what the
    /// store has not committed, goes on as soon as that falls to its low
    /// mark (time is paused: without a wake-up it would wait for the 50
    /// ms bound on each wait).
    #[tokio::test(start_paused = true)]
    async fn a_held_engine_goes_on_when_its_backlog_falls_to_the_low_mark() {
        let pace = Arc::new(Pace::new(Arc::new(Budget::default())));
        for _ in 0..Pace::HIGH {
            pace.sent();
        }
        let t0 = tokio::time::Instant::now();
        let engine = waiting_for_room(&pace);
        tokio::task::yield_now().await;
        assert!(!engine.is_finished(), "the backlog is full");
        for _ in 0..(Pace::HIGH - Pace::LOW) {
            pace.handled();
            tokio::task::yield_now().await;
        }
        engine.await.unwrap();
        assert_eq!(t0.elapsed(), std::time::Duration::ZERO);

        pace.held(Pace::HELD_HIGH);
        let t0 = tokio::time::Instant::now();
        let engine = waiting_for_room(&pace);
        tokio::task::yield_now().await;
        assert!(!engine.is_finished(), "too much uncommitted");
        pace.held(Pace::HELD_HIGH - 1);
        tokio::task::yield_now().await;
        pace.held(Pace::HELD_LOW);
        engine.await.unwrap();
        assert_eq!(t0.elapsed(), std::time::Duration::ZERO);
    }

    /// A patient session goes on past a full budget as soon as nothing of
    /// it is in flight any more, not at the next 50 ms bound.
    #[tokio::test(start_paused = true)]
    async fn a_patient_session_goes_on_once_its_last_event_is_committed() {
        let budget = Arc::new(Budget::default());
        let busy = Pace::new(budget.clone());
        busy.held(Budget::HIGH);
        let quiet = Arc::new(Pace::new(budget));
        quiet.held(1);
        let t0 = tokio::time::Instant::now();
        let engine = waiting_for_room(&quiet);
        tokio::time::sleep(Pace::PATIENCE + std::time::Duration::from_millis(10)).await;
        assert!(!engine.is_finished(), "one event of it is in flight");
        quiet.held(0);
        engine.await.unwrap();
        let waited = Pace::PATIENCE + std::time::Duration::from_millis(10);
        assert_eq!(t0.elapsed(), waited);

        // The same with a signal not yet handled.
        quiet.sent();
        let t0 = tokio::time::Instant::now();
        let engine = waiting_for_room(&quiet);
        tokio::time::sleep(waited).await;
        assert!(!engine.is_finished(), "one signal of it is in flight");
        quiet.handled();
        engine.await.unwrap();
        assert_eq!(t0.elapsed(), waited);
        drop(busy);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_with_nothing_in_flight_gets_past_a_full_budget_after_its_patience() {
        let budget = Arc::new(Budget::default());
        let busy = Pace::new(budget.clone());
        busy.held(Budget::HIGH);
        let quiet = Pace::new(budget);
        let t0 = tokio::time::Instant::now();
        tokio::time::timeout(Pace::PATIENCE * 3, quiet.room())
            .await
            .expect("it went on after its patience");
        assert!(t0.elapsed() >= Pace::PATIENCE, "{:?}", t0.elapsed());
        assert!(t0.elapsed() < Pace::PATIENCE * 3, "{:?}", t0.elapsed());
    }
}
