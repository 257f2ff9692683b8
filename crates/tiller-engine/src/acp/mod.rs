//! An external ACP agent (Claude Code's adapter, Qwen Code, codex-acp, ...)
//! as an engine. Tiller is the agent's only client and stays the host: the
//! agent's updates become the session's signals, its permission requests
//! and file reads and writes go to the session, and its turn settles by
//! Tiller's rules, never by trusting the agent:
//!
//! - the `session/prompt` answer is the turn's result;
//! - the child exiting, closing its output, writing malformed JSON or
//!   answering a request Tiller never sent is `engine_crashed`;
//! - silence is the session's stall bound (the engine sends nothing);
//! - a cancel is forwarded, answered pending requests `cancelled`, and the
//!   child is killed when it has not answered within `cancel_grace`;
//! - updates for another session or after the turn ended are stale.
//!
//! The JSON of the wire is read here, as the model engines read their
//! providers' wires; only the ACP edge crate holds ACP's types.

mod child;
mod map;
mod secrets;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tiller_core::{ErrorKind, StopReason, TurnId};
use tokio::sync::mpsc;

use crate::{
    Engine, EngineHandle, EngineInput, EngineSignal, Hosted, PreparedPrompt, ScriptError,
    SignalKind, SignalSink, SteerReceipt, TurnContext, UpstreamStart,
};
use child::{Caps, Child, Death, Inbound, RpcError};

/// One configured ACP agent engine (`[engine.NAME] kind = "acp"`).
#[derive(Clone)]
pub struct AcpConfig {
    pub name: Arc<str>,
    /// The program (a bare name is looked up on the child's `PATH`).
    pub command: PathBuf,
    pub args: Vec<String>,
    /// The child's whole environment (scrubbed, with `env` and `pass_env`).
    pub env: Vec<(String, String)>,
    /// Sessions one process serves (over one connection).
    pub sessions_per_process: usize,
    /// An idle process is stopped after this long.
    pub idle_timeout: Duration,
    pub max_processes: usize,
    /// How long a cancelled turn's agent has to answer before it is killed.
    pub cancel_grace: Duration,
    /// Bound on starting a process and opening its session.
    pub start_timeout: Duration,
    /// Tiller's version, for `clientInfo`.
    pub version: String,
    /// Where a process starts when no session directory is known.
    pub dir: PathBuf,
}

impl std::fmt::Debug for AcpConfig {
    /// Variable names only: values may be secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcpConfig")
            .field("name", &self.name)
            .field("command", &self.command)
            // Arguments may carry a key too (`--api-key ...`): counted only.
            .field("args", &self.args.len())
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("sessions_per_process", &self.sessions_per_process)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_processes", &self.max_processes)
            .finish()
    }
}

/// What Tiller sends an agent as `initialize`.
fn initialize_params(cfg: &AcpConfig) -> Value {
    json!({
        "protocolVersion": 1,
        "clientCapabilities": {
            "fs": { "readTextFile": true, "writeTextFile": true },
            "terminal": false,
        },
        "clientInfo": { "name": "tiller", "version": cfg.version },
    })
}

/// What an agent said of itself at `initialize`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The ACP version it speaks.
    pub protocol_version: u64,
    /// Its `agentInfo` (name and version), when it sent one.
    pub agent: Option<String>,
}

/// Starts the agent as the engine would (same program, arguments and
/// scrubbed environment), sends `initialize`, and stops it: `tiller
/// doctor`'s check that an agent engine can really start.
pub async fn probe(cfg: &AcpConfig) -> Result<Probe, String> {
    let child = Child::spawn(cfg)?;
    let answer = child
        .call("initialize", initialize_params(cfg), cfg.start_timeout)
        .await;
    child.kill("probed".into());
    let r = answer.map_err(|e| format!("it did not answer `initialize`: {e}"))?;
    let protocol_version = r
        .get("protocolVersion")
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("its `initialize` answer has no protocolVersion: {r}"))?;
    let info = r.get("agentInfo");
    let field = |k: &str| info.and_then(|i| i.get(k)).and_then(Value::as_str);
    let agent = field("name").map(|n| match field("version") {
        Some(v) => format!("{n} {v}"),
        None => n.to_owned(),
    });
    Ok(Probe {
        protocol_version,
        agent,
    })
}

/// The engine: a pool of agent processes.
pub struct AcpEngine {
    shared: Arc<Shared>,
}

struct Shared {
    cfg: AcpConfig,
    /// Never held across an await: starting a process happens outside it.
    pool: Mutex<Pool>,
    /// Per Tiller session: one turn (or its wind-down) at a time.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// What the last process said it can do (none started yet: unknown).
    caps: Mutex<Option<Caps>>,
}

#[derive(Default)]
struct Pool {
    children: Vec<Arc<Child>>,
    /// Tiller session id -> the process serving it.
    assigned: HashMap<String, Arc<Child>>,
    /// When processes died by themselves (crash-loop back-off).
    crashes: std::collections::VecDeque<Instant>,
    /// Processes being started (they count against `max_processes`).
    starting: usize,
}

/// A turn's hold on its process: while held, the process is busy (never
/// stopped idle, never evicted); dropped, its idle timer starts.
struct Busy {
    child: Arc<Child>,
    idle: Duration,
}

impl Busy {
    /// `None` when the process died meanwhile (an idle stop that won).
    fn new(child: Arc<Child>, idle: Duration) -> Option<Busy> {
        child.enter().then_some(Busy { child, idle })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let Some(generation) = self.child.leave() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let child = Arc::downgrade(&self.child);
        let idle = self.idle;
        tokio::spawn(async move {
            tokio::time::sleep(idle).await;
            if let Some(c) = child.upgrade() {
                c.stop_if_idle(generation);
            }
        });
    }
}

/// A process being started: it holds its place under `max_processes`
/// until it is in the pool (or failed, or the turn gave up).
struct Starting<'a>(&'a Mutex<Pool>);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let mut p = self.0.lock().unwrap();
        p.starting = p.starting.saturating_sub(1);
    }
}

impl AcpEngine {
    pub fn new(cfg: AcpConfig) -> Self {
        let engine = cfg.name.to_string();
        metrics::gauge!("tiller_engine_processes", "engine" => engine).set(0.0);
        let shared = Arc::new(Shared {
            cfg,
            pool: Default::default(),
            locks: Default::default(),
            caps: Default::default(),
        });
        let weak = Arc::downgrade(&shared);
        // Child memory, for operators (a hosted agent is hundreds of MB).
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    let Some(s) = weak.upgrade() else { return };
                    s.measure();
                }
            });
        }
        AcpEngine { shared }
    }

    /// Live processes (for tests and figures).
    pub async fn processes(&self) -> Vec<u32> {
        let pool = self.shared.pool.lock().unwrap();
        pool.children
            .iter()
            .filter(|c| c.alive())
            .filter_map(|c| c.pid())
            .collect()
    }
}

impl Engine for AcpEngine {
    fn name(&self) -> &str {
        &self.shared.cfg.name
    }

    fn prepare(&self, text: &str) -> Result<PreparedPrompt, ScriptError> {
        Ok(PreparedPrompt {
            text: text.to_owned(),
            script: None,
            images: Vec::new(),
        })
    }

    /// Until a process said, images are taken (and refused at the turn
    /// if the agent turns out not to take them).
    fn accepts_images(&self) -> bool {
        self.shared
            .caps
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|c| c.images)
    }

    fn uses_directory(&self) -> bool {
        true
    }

    /// Until a process said, steers are taken (dropped, with their text
    /// handed back, if the agent turns out not to steer).
    fn steering(&self) -> bool {
        self.shared
            .caps
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|c| c.steering)
    }

    fn shutdown(&self) {
        let children = self.shared.pool.lock().unwrap().children.clone();
        for c in children {
            c.kill("the daemon is shutting down".into());
        }
    }

    fn start(
        &self,
        turn: TurnId,
        prompt: PreparedPrompt,
        ctx: TurnContext,
        sink: SignalSink,
    ) -> EngineHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            let emit: Emit = Arc::new(move |kind| sink(EngineSignal { turn, kind }));
            run_turn(shared, prompt, ctx, &emit, rx).await;
        });
        EngineHandle::new(tx, task)
    }
}

/// Sends one of the turn's signals.
type Emit = Arc<dyn Fn(SignalKind) + Send + Sync>;

impl Shared {
    fn lock_for(&self, session: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap();
        if locks.len() > 4096 {
            locks.retain(|_, l| Arc::strong_count(l) > 1);
        }
        locks.entry(session.to_owned()).or_default().clone()
    }

    /// The process serving `session` (its own, one with room, or a new
    /// one), held busy for the turn. Also says why an earlier process of
    /// the session ended.
    async fn acquire(
        &self,
        session: &str,
        dir: &std::path::Path,
    ) -> Result<(Busy, Option<String>), (ErrorKind, String)> {
        let cfg = &self.cfg;
        let idle = cfg.idle_timeout;
        let (previous, backoff, starting) = {
            let mut pool = self.pool.lock().unwrap();
            let now = Instant::now();
            let mut gone = Vec::new();
            pool.children.retain(|c| match c.death() {
                Some((d, _)) => {
                    gone.push(d);
                    false
                }
                None => true,
            });
            for d in gone {
                if matches!(d, Death::Exited | Death::Protocol | Death::Killed) {
                    pool.crashes.push_back(now);
                }
            }
            while pool
                .crashes
                .front()
                .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
            {
                pool.crashes.pop_front();
            }
            if let Some(busy) = pool
                .assigned
                .get(session)
                .and_then(|c| Busy::new(c.clone(), idle))
            {
                return Ok((busy, None));
            }
            // Why the session's process ended (other sessions' dead
            // entries stay until their own next turn reads them).
            let previous = pool
                .assigned
                .remove(session)
                .and_then(|c| c.death())
                .map(|(d, why)| {
                    metrics::counter!(
                        "tiller_engine_restarts_total",
                        "engine" => cfg.name.to_string(),
                        "reason" => d.as_str()
                    )
                    .increment(1);
                    why
                });
            if pool.assigned.len() > 4 * cfg.max_processes * cfg.sessions_per_process + 1024 {
                pool.assigned.retain(|_, c| c.alive());
            }
            if cfg.sessions_per_process > 1 {
                let room = pool.children.iter().find(|c| {
                    c.alive()
                        && pool.assigned.values().filter(|a| Arc::ptr_eq(a, c)).count()
                            < cfg.sessions_per_process
                });
                if let Some(busy) = room.cloned().and_then(|c| Busy::new(c, idle)) {
                    pool.assigned.insert(session.to_owned(), busy.child.clone());
                    return Ok((busy, previous));
                }
            }
            if pool.children.len() + pool.starting >= cfg.max_processes {
                // The process idle the longest makes room (its sessions
                // reload on their next turn); with every one busy, the
                // prompt waits for nobody: it is refused, retryably.
                let idle = pool
                    .children
                    .iter()
                    .filter_map(|c| Some((c.idle_since()?, c.clone())))
                    .min_by_key(|(t, _)| *t);
                if let Some((_, c)) = idle {
                    c.evict();
                    pool.children.retain(|x| !Arc::ptr_eq(x, &c));
                }
            }
            if pool.children.len() + pool.starting >= cfg.max_processes {
                return Err((
                    ErrorKind::Overloaded,
                    format!(
                        "The `{}` engine already runs {} agent processes (max_processes); send \
                         the prompt again once one is free.",
                        cfg.name, cfg.max_processes
                    ),
                ));
            }
            pool.starting += 1;
            // A process that keeps dying is restarted ever more slowly.
            let backoff = pool
                .crashes
                .len()
                .checked_sub(1)
                .map(|n| Duration::from_millis(100 << n.min(7)).min(Duration::from_secs(10)));
            (previous, backoff, Starting(&self.pool))
        };
        if let Some(wait) = backoff {
            tokio::time::sleep(wait).await;
        }
        let dir = if dir.is_dir() { dir } else { &cfg.dir };
        let mut c = cfg.clone();
        c.dir = dir.to_owned();
        let child = Child::spawn(&c).map_err(|e| (ErrorKind::EngineCrashed, e))?;
        let busy = Busy::new(child.clone(), idle).ok_or_else(|| {
            (
                ErrorKind::EngineCrashed,
                format!("The agent `{}` exited as it started.", cfg.name),
            )
        })?;
        let r = child
            .call("initialize", initialize_params(cfg), cfg.start_timeout)
            .await
            .map_err(|e| {
                child.kill("it did not initialize".into());
                (
                    ErrorKind::EngineCrashed,
                    format!("The agent `{}` did not start: {e}", cfg.name),
                )
            })?;
        let caps = map::caps(&r);
        *self.caps.lock().unwrap() = Some(caps.clone());
        child.set_caps(caps);
        let mut pool = self.pool.lock().unwrap();
        // Its place becomes the process's, under one lock.
        std::mem::forget(starting);
        pool.starting = pool.starting.saturating_sub(1);
        pool.children.push(child.clone());
        pool.assigned.insert(session.to_owned(), child);
        metrics::gauge!("tiller_engine_processes", "engine" => cfg.name.to_string())
            .set(pool.children.len() as f64);
        Ok((busy, previous))
    }

    /// Opens the session's agent session on `child`: the known one (loaded
    /// or resumed when this process has not seen it), else a new one.
    async fn open(
        &self,
        child: &Child,
        ctx: &TurnContext,
        previous: Option<String>,
        emit: &Emit,
    ) -> Result<String, (ErrorKind, String)> {
        let cfg = &self.cfg;
        let host = &ctx.host;
        let cwd = host.cwd.display().to_string();
        let dirs: Vec<String> = host.roots.iter().map(|r| r.display().to_string()).collect();
        let mut fresh_reason = None;
        if let Some(up) = &host.upstream {
            if child.knows(up) {
                return Ok(up.clone());
            }
            let caps = child.caps();
            let why = previous.unwrap_or_else(|| "the daemon restarted".to_owned());
            let method = if caps.resume {
                Some("session/resume")
            } else if caps.load {
                Some("session/load")
            } else {
                None
            };
            match method {
                Some(m) => {
                    let mut params = json!({"sessionId": up, "cwd": cwd, "mcpServers": []});
                    if !dirs.is_empty() {
                        params["additionalDirectories"] = json!(dirs);
                    }
                    child.mute(up, true);
                    let r = child.call(m, params, cfg.start_timeout).await;
                    child.mute(up, false);
                    match r {
                        Ok(r) => {
                            child.learn(up);
                            self.took_options(child, up, &r, emit);
                            emit(SignalKind::Hosted(Hosted::Session {
                                upstream: up.clone(),
                                start: UpstreamStart::Loaded(why),
                            }));
                            return Ok(up.clone());
                        }
                        Err(RpcError::Dead(d)) => {
                            return Err((ErrorKind::EngineCrashed, d));
                        }
                        Err(e) => fresh_reason = Some(format!("{why}; it could not reload: {e}")),
                    }
                }
                None => {
                    fresh_reason = Some(format!("{why}; the agent cannot reload sessions"));
                }
            }
        }
        let mut params = json!({"cwd": cwd, "mcpServers": []});
        if !dirs.is_empty() {
            params["additionalDirectories"] = json!(dirs);
        }
        let r = child
            .call("session/new", params, cfg.start_timeout)
            .await
            .map_err(|e| {
                (
                    ErrorKind::EngineCrashed,
                    format!("The agent `{}` could not open a session: {e}", cfg.name),
                )
            })?;
        let Some(up) = r.get("sessionId").and_then(Value::as_str) else {
            child.kill("it answered session/new without a session id".into());
            return Err((
                ErrorKind::EngineCrashed,
                "The agent answered session/new without a session id.".into(),
            ));
        };
        child.learn(up);
        self.took_options(child, up, &r, emit);
        emit(SignalKind::Hosted(Hosted::Session {
            upstream: up.to_owned(),
            start: match fresh_reason {
                Some(why) => UpstreamStart::Fresh(why),
                None => UpstreamStart::New,
            },
        }));
        if let Some(cmds) = r.pointer("/_meta/availableCommands") {
            emit(SignalKind::Hosted(Hosted::Commands(map::commands(cmds))));
        }
        Ok(up.to_owned())
    }

    /// Keeps and reports the options an answer carries.
    fn took_options(&self, child: &Child, up: &str, answer: &Value, emit: &Emit) {
        if let Some(opts) = map::options(answer) {
            let config = answer["configOptions"].is_array();
            child.set_options(up, opts.clone(), config);
            emit(SignalKind::Hosted(Hosted::Options(opts)));
        }
    }

    /// Sets the values the session chose on the agent where it has others
    /// (forwarded `session/set_config_option`; `session/set_mode` for an
    /// agent with modes only). A refused value is logged; the turn goes on.
    async fn apply_options(
        &self,
        session: &str,
        child: &Child,
        up: &str,
        chosen: &[(String, String)],
        emit: &Emit,
    ) {
        for (id, value) in chosen {
            let Some((opts, config)) = child.options(up) else {
                return;
            };
            let Some(o) = opts.iter().find(|o| &o.id == id) else {
                continue;
            };
            if &o.current == value || !o.choices.contains(value) {
                continue;
            }
            let r = if config {
                child
                    .call(
                        "session/set_config_option",
                        json!({"sessionId": up, "configId": id, "value": value}),
                        self.cfg.start_timeout,
                    )
                    .await
            } else {
                child
                    .call(
                        "session/set_mode",
                        json!({"sessionId": up, "modeId": value}),
                        self.cfg.start_timeout,
                    )
                    .await
            };
            match r {
                Ok(answer) if config => self.took_options(child, up, &answer, emit),
                Ok(_) => {
                    let mut opts = opts.clone();
                    if let Some(m) = opts.iter_mut().find(|o| &o.id == id) {
                        m.current = value.clone();
                    }
                    child.set_options(up, opts.clone(), false);
                    emit(SignalKind::Hosted(Hosted::Options(opts)));
                }
                Err(e) => {
                    tracing::warn!(%session, engine = %self.cfg.name, option = %id, error = %e, "the agent refused an option");
                }
            }
        }
    }

    /// Updates the process count and memory gauges.
    fn measure(&self) {
        let pids: Vec<u32> = {
            let pool = self.pool.lock().unwrap();
            pool.children
                .iter()
                .filter(|c| c.alive())
                .filter_map(|c| c.pid())
                .collect()
        };
        metrics::gauge!("tiller_engine_processes", "engine" => self.cfg.name.to_string())
            .set(pids.len() as f64);
        let rss: u64 = pids.iter().filter_map(|p| rss_bytes(*p)).sum();
        metrics::gauge!("tiller_engine_resident_memory_bytes", "engine" => self.cfg.name.to_string())
            .set(rss as f64);
    }
}

/// A process's resident memory, from `/proc`.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// One turn: reach the process and the agent session, send the prompt,
/// relay until the answer.
async fn run_turn(
    shared: Arc<Shared>,
    prompt: PreparedPrompt,
    ctx: TurnContext,
    emit: &Emit,
    mut rx: mpsc::UnboundedReceiver<EngineInput>,
) {
    let session = ctx.host.session.clone();
    let lock = shared.lock_for(&session);
    let pool = shared.clone();
    // Setup is cancellable: an abort before the prompt reached the agent
    // ends the turn at once.
    let setup = async {
        let guard = lock.lock_owned().await;
        let (busy, previous) = pool.acquire(&session, &ctx.host.cwd).await?;
        let child = busy.child.clone();
        if !prompt.images.is_empty() && !child.caps().images {
            return Err((
                ErrorKind::EngineCrashed,
                format!(
                    "The agent `{}` does not take images; send the prompt without them.",
                    pool.cfg.name
                ),
            ));
        }
        let upstream = pool.open(&child, &ctx, previous, emit).await?;
        pool.apply_options(&session, &child, &upstream, &ctx.host.agent_options, emit)
            .await;
        Ok::<_, (ErrorKind, String)>((guard, busy, upstream))
    };
    tokio::pin!(setup);
    let (guard, busy, upstream) = loop {
        tokio::select! {
            r = &mut setup => match r {
                Ok(v) => break v,
                Err((kind, message)) => {
                    emit(SignalKind::Failed(kind, message));
                    return;
                }
            },
            input = rx.recv() => match input {
                Some(EngineInput::Abort) | None => {
                    emit(SignalKind::Result(StopReason::Cancelled));
                    emit(SignalKind::Idle);
                    return;
                }
                Some(EngineInput::Steer { id, .. }) => {
                    emit(SignalKind::SteerReceipt(id, SteerReceipt::Dropped));
                }
                Some(_) => {}
            },
        }
    };
    let child = busy.child.clone();
    let inbound = child.route(&upstream);
    let mut blocks = vec![json!({"type": "text", "text": prompt.text})];
    for i in &prompt.images {
        blocks.push(json!({"type": "image", "mimeType": i.mime_type, "data": i.data}));
    }
    let answer = child.request(
        "session/prompt",
        json!({"sessionId": upstream, "prompt": blocks}),
    );
    let mut live = Live {
        shared,
        child,
        upstream,
        answer: Some(answer),
        inbound: Some(inbound),
        asked: HashMap::new(),
        next_request: 0,
        cancelled_at: None,
        steers: Default::default(),
        guard: Some(guard),
        busy: Some(busy),
        rx: Some(rx),
        closed: false,
        winding: false,
    };
    live.relay(&ctx, emit).await;
}

type Answer = tokio::sync::oneshot::Receiver<Result<Value, RpcError>>;

/// A turn whose prompt the agent holds. Dropped before the answer came
/// (the session tore the engine down), it winds down off the session:
/// forwards the cancel, answers what the agent asked, and kills the
/// process if it does not answer within `cancel_grace`.
struct Live {
    shared: Arc<Shared>,
    child: Arc<Child>,
    upstream: String,
    /// The `session/prompt` answer, until it came.
    answer: Option<Answer>,
    inbound: Option<child::Route>,
    /// Tiller's request number -> the agent's request (its JSON-RPC id and,
    /// for a permission, its options).
    asked: HashMap<u64, (Value, Option<Value>)>,
    next_request: u64,
    cancelled_at: Option<tokio::time::Instant>,
    /// Steers forwarded, until the agent answers them.
    steers: futures::stream::FuturesUnordered<
        futures::future::BoxFuture<'static, (tiller_core::SteerId, SteerReceipt)>,
    >,
    /// The session's turn lock, held until the agent answered (or died).
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The process is busy until then too.
    busy: Option<Busy>,
    /// The session's inputs (a teardown's wind-down still reads the answers
    /// the session sent last, such as the refusal of a loop trip).
    rx: Option<mpsc::UnboundedReceiver<EngineInput>>,
    /// The agent's messages stopped (it died; its answer fails next).
    closed: bool,
    /// This is a torn-down turn's wind-down.
    winding: bool,
}

impl Live {
    async fn relay(&mut self, ctx: &TurnContext, emit: &Emit) {
        use futures::{FutureExt as _, StreamExt as _};
        loop {
            let answer = self.answer.as_mut().expect("until the answer");
            let inbound = self.inbound.as_mut().expect("until the answer");
            let rx = self.rx.as_mut().expect("until the answer");
            let steers = &mut self.steers;
            let closed = self.closed;
            tokio::select! {
                biased;
                input = rx.recv() => match input {
                    None => return, // torn down: dropping winds down
                    Some(input) => self.input(input, emit),
                },
                // A steer's answer came before what the agent sent next.
                Some((id, receipt)) = steers.next(), if !steers.is_empty() => {
                    emit(SignalKind::SteerReceipt(id, receipt));
                }
                r = answer => {
                    // Answered: nothing may poll it again, whatever follows.
                    self.answer = None;
                    while let Some(Some((id, receipt))) = self.steers.next().now_or_never() {
                        emit(SignalKind::SteerReceipt(id, receipt));
                    }
                    // What the agent sent before its answer is the turn's.
                    let mut before = Vec::new();
                    while let Ok(msg) = inbound.try_recv() {
                        before.push(msg);
                    }
                    for msg in before {
                        match msg {
                            Inbound::Update(u) if self.cancelled_at.is_none() => {
                                if u["sessionUpdate"] == "current_mode_update" {
                                    self.mode_changed(&u, emit);
                                }
                                for kind in map::update(&u) {
                                    ctx.pace.room().await;
                                    emit(kind);
                                }
                            }
                            Inbound::Update(_) => stale(&self.shared.cfg.name),
                            Inbound::Request { id, method, .. } => {
                                self.child.respond(id, refusal(&method));
                            }
                        }
                    }
                    self.finish();
                    match r {
                        Ok(Ok(v)) => {
                            let stop = if self.cancelled_at.is_some() {
                                StopReason::Cancelled
                            } else {
                                map::stop_reason(&v)
                            };
                            emit(SignalKind::Result(stop));
                            emit(SignalKind::Idle);
                        }
                        Ok(Err(RpcError::Agent { code, message })) => emit(SignalKind::Failed(
                            ErrorKind::EngineCrashed,
                            format!("The agent failed the turn: {message} (code {code})"),
                        )),
                        Ok(Err(RpcError::Dead(why))) => emit(SignalKind::Failed(
                            ErrorKind::EngineCrashed,
                            format!("The agent process ended during the turn: {why}."),
                        )),
                        Err(_) => emit(SignalKind::Failed(
                            ErrorKind::EngineCrashed,
                            "The agent process ended during the turn.".into(),
                        )),
                    }
                    return;
                }
                msg = inbound.recv(), if !closed => match msg {
                    // The child died: its answer fails next.
                    None => self.closed = true,
                    Some(Inbound::Update(u)) => {
                        if self.cancelled_at.is_some() {
                            stale(&self.shared.cfg.name);
                            continue;
                        }
                        if u["sessionUpdate"] == "current_mode_update" {
                            self.mode_changed(&u, emit);
                        }
                        for kind in map::update(&u) {
                            ctx.pace.room().await;
                            emit(kind);
                        }
                    }
                    Some(Inbound::Request { id, method, params }) => {
                        self.request(id, &method, &params, emit);
                    }
                },
            }
        }
    }

    /// The agent switched its mode itself (its option `mode`, for an agent
    /// whose options are its modes).
    fn mode_changed(&self, u: &Value, emit: &Emit) {
        let Some(mode) = u["currentModeId"].as_str() else {
            return;
        };
        let Some((mut opts, config)) = self.child.options(&self.upstream) else {
            return;
        };
        if config {
            return; // its config options say it (`config_option_update`)
        }
        let Some(o) = opts.iter_mut().find(|o| o.id == "mode") else {
            return;
        };
        if o.current == mode {
            return;
        }
        o.current = mode.to_owned();
        self.child.set_options(&self.upstream, opts.clone(), false);
        emit(SignalKind::Hosted(Hosted::Options(opts)));
    }

    /// A message from the session.
    fn input(&mut self, input: EngineInput, emit: &Emit) {
        match input {
            EngineInput::Abort => self.cancel(),
            EngineInput::Permission { request, answer } => {
                if let Some((id, options)) = self.asked.remove(&request) {
                    let outcome = map::permission_outcome(answer, options.as_ref());
                    self.child.respond(id, Ok(outcome));
                }
            }
            EngineInput::File { request, result } => {
                if let Some((id, _)) = self.asked.remove(&request) {
                    self.child
                        .respond(id, result.map(map::file_result).map_err(|e| (-32603, e)));
                }
            }
            EngineInput::Steer { id, text } => {
                if !self.child.caps().steering || self.cancelled_at.is_some() {
                    emit(SignalKind::SteerReceipt(id, SteerReceipt::Dropped));
                    return;
                }
                let answer = self.child.request(
                    "_session/steering",
                    json!({
                        "sessionId": self.upstream,
                        "prompt": [{"type": "text", "text": text}],
                        "_meta": {"steering": {"idleBehavior": "promptRequired"}},
                    }),
                );
                // The receipt comes when the agent answers, in order with
                // what it streams (the session bounds the wait with
                // `steer_receipt_timeout`).
                self.steers.push(Box::pin(async move {
                    let receipt = match answer.await {
                        Ok(Ok(v))
                            if v.get("outcome").and_then(Value::as_str) == Some("injected") =>
                        {
                            SteerReceipt::Consumed
                        }
                        _ => SteerReceipt::Dropped,
                    };
                    (id, receipt)
                }));
            }
            EngineInput::ToolResults(_) => {}
        }
    }

    /// A request from the agent.
    fn request(&mut self, id: Value, method: &str, params: &Value, emit: &Emit) {
        if self.cancelled_at.is_some() {
            self.child.respond(id, refusal(method));
            return;
        }
        self.next_request += 1;
        let n = self.next_request;
        match method {
            "session/request_permission" => {
                let call = Box::new(map::call(params.get("toolCall").unwrap_or(&Value::Null)));
                self.asked.insert(n, (id, params.get("options").cloned()));
                emit(SignalKind::Hosted(Hosted::Permission { request: n, call }));
            }
            "fs/read_text_file" | "fs/write_text_file" => match map::file_op(method, params) {
                Some(op) => {
                    self.asked.insert(n, (id, None));
                    emit(SignalKind::Hosted(Hosted::File { request: n, op }));
                }
                None => self
                    .child
                    .respond(id, Err((-32602, format!("invalid params for {method}")))),
            },
            _ => self
                .child
                .respond(id, Err((-32601, format!("method not found: {method}")))),
        }
    }

    /// Forwards a cancel (once) and answers what the agent asked.
    fn cancel(&mut self) {
        if self.cancelled_at.is_some() {
            return;
        }
        self.cancelled_at = Some(tokio::time::Instant::now());
        self.child
            .notify("session/cancel", json!({"sessionId": self.upstream}));
        for (_, (id, options)) in self.asked.drain() {
            let method = if options.is_some() {
                "session/request_permission"
            } else {
                "fs"
            };
            self.child.respond(id, refusal(method));
        }
    }

    /// The agent answered (or died): the session's next turn may start
    /// (its route is removed first, so it never removes the next turn's),
    /// and an idle process is stopped after `idle_timeout`.
    fn finish(&mut self) {
        self.child.unroute(&self.upstream);
        self.guard = None;
        self.busy = None;
    }

    /// The turn was torn down with the prompt still at the agent.
    async fn wind_down(mut self) {
        // What the session answered last (a loop trip's refusal) goes
        // first; the cancel refuses whatever is left.
        if let Some(rx) = self.rx.as_mut() {
            let mut answers = Vec::new();
            while let Ok(input) = rx.try_recv() {
                answers.push(input);
            }
            for input in answers {
                if matches!(
                    input,
                    EngineInput::Permission { .. } | EngineInput::File { .. }
                ) {
                    let noop: Emit = Arc::new(|_| {});
                    self.input(input, &noop);
                }
            }
        }
        self.cancel();
        let deadline = self.cancelled_at.expect("just cancelled") + self.shared.cfg.cancel_grace;
        loop {
            let answer = self.answer.as_mut().expect("until the answer");
            let inbound = self.inbound.as_mut().expect("until the answer");
            tokio::select! {
                _ = answer => break,
                msg = inbound.recv() => match msg {
                    None => break,
                    Some(Inbound::Update(_)) => stale(&self.shared.cfg.name),
                    Some(Inbound::Request { id, method, .. }) => {
                        self.child.respond(id, refusal(&method));
                    }
                },
                _ = tokio::time::sleep_until(deadline) => {
                    // Its session cannot go on while the agent still runs
                    // the old prompt: killed (a shared process's other
                    // sessions reload on their next turn).
                    self.child.kill(format!(
                        "it did not answer a cancel within {:?}",
                        self.shared.cfg.cancel_grace
                    ));
                    break;
                }
            }
        }
        self.answer = None;
        self.finish();
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if self.answer.is_none() {
            return;
        }
        if self.winding {
            // The wind-down itself was dropped (the runtime is stopping):
            // nothing may wait any more; the agent goes with it.
            self.answer = None;
            self.child.kill("the daemon stopped during a cancel".into());
            return;
        }
        let mut rest = Live {
            shared: self.shared.clone(),
            child: self.child.clone(),
            upstream: std::mem::take(&mut self.upstream),
            answer: self.answer.take(),
            inbound: self.inbound.take(),
            asked: std::mem::take(&mut self.asked),
            next_request: self.next_request,
            cancelled_at: self.cancelled_at,
            steers: Default::default(),
            guard: self.guard.take(),
            busy: self.busy.take(),
            rx: self.rx.take(),
            closed: self.closed,
            winding: true,
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(rest.wind_down());
        } else {
            rest.answer = None;
            rest.child.kill("the runtime stopped".into());
        }
    }
}

/// What an agent's request is answered once its turn is over.
fn refusal(method: &str) -> Result<Value, (i64, String)> {
    if method == "session/request_permission" {
        Ok(json!({"outcome": {"outcome": "cancelled"}}))
    } else {
        Err((-32603, "the turn was cancelled".to_owned()))
    }
}

fn stale(engine: &str) {
    metrics::counter!("tiller_engine_stale_messages_total", "engine" => engine.to_owned())
        .increment(1);
}
