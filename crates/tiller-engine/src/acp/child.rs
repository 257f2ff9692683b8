//! One ACP agent process and Tiller's JSON-RPC connection to it. Tiller is
//! its only client. Nothing the child writes is trusted: malformed JSON, an
//! answer to a request Tiller never sent (or answered twice), an exit or a
//! closed stdout kill the child, and every turn on it fails at once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{FramedRead, LinesCodec};

use super::AcpConfig;
use super::secrets::{log_lines, redact, secrets};

/// Longest line a child may write: a file's text travels in one, twice in
/// a diff, escaped (files an agent reads through Tiller are at most
/// 16 MiB).
const MAX_LINE: usize = 80 * 1024 * 1024;

/// Messages waiting for a turn: past this the reader waits, so an agent
/// that floods is held back by its own output pipe.
const ROUTE_QUEUE: usize = 1024;

/// What may wait for all of a process's turns at once, weighed as parsed
/// ([`weight`]): past this the reader waits too, for every session on the
/// process. Lines as long as [`MAX_LINE`] would otherwise let
/// [`ROUTE_QUEUE`] of them wait for each session. One message weighing
/// more waits alone.
const QUEUE_BYTES: usize = 32 * 1024 * 1024;

/// Most a single message may weigh ([`weight`]): an agent writing more
/// (`[0,0,0,...]` as long as [`MAX_LINE`] would take gigabytes parsed) is
/// killed. A file's text in a message weighs about its length.
const MAX_WEIGHT: usize = 4 * MAX_LINE;

/// About what a line takes parsed, told before parsing it: its bytes, and
/// outside its strings 128 for each `:` (a map's entry), 64 for each `,`
/// and `[` (an element, with its array's growth) and 32 for each `{` and
/// string. A file's text in a message weighs about its length; `[0,0,...]`
/// weighs 33 times its length.
fn weight(line: &str) -> usize {
    let (mut in_string, mut escaped, mut extra) = (false, false, 0usize);
    for b in line.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        extra = extra.saturating_add(match b {
            b':' => 128,
            b',' | b'[' => 64,
            b'"' => {
                in_string = true;
                32
            }
            b'{' => 32,
            _ => 0,
        });
    }
    line.len().saturating_add(extra)
}

/// The bounds a child's reader keeps.
#[derive(Clone, Copy)]
struct Limits {
    queue_bytes: usize,
    max_weight: usize,
    /// [`OUT_BYTES`].
    out_bytes: usize,
}

const LIMITS: Limits = Limits {
    queue_bytes: QUEUE_BYTES,
    max_weight: MAX_WEIGHT,
    out_bytes: OUT_BYTES,
};

/// Bytes Tiller's messages to an agent may wait for it to read; past it
/// the agent, which takes nothing of its input, is killed (its answers to
/// its own file requests could otherwise pile up without end). Room for
/// a few answers of the largest file served (16 MiB, up to six times that
/// escaped), two served at once per turn, while a busy agent parses.
const OUT_BYTES: usize = 256 * 1024 * 1024;

/// A message for a turn and its share of [`QUEUE_BYTES`], given back once
/// the turn takes it.
#[derive(Debug)]
struct Routed {
    msg: Inbound,
    _held: tokio::sync::OwnedSemaphorePermit,
}

/// What a turn reads the agent's messages for its session from.
#[derive(Debug)]
pub(super) struct Route(mpsc::Receiver<Routed>);

impl Route {
    pub(super) async fn recv(&mut self) -> Option<Inbound> {
        self.0.recv().await.map(|r| r.msg)
    }

    pub(super) fn try_recv(&mut self) -> Result<Inbound, mpsc::error::TryRecvError> {
        self.0.try_recv().map(|r| r.msg)
    }

    /// Messages waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// What the agent sent for one of its sessions.
#[derive(Debug)]
pub(super) enum Inbound {
    /// `session/update`'s `update`.
    Update(Value),
    /// A request: its JSON-RPC id, method and params.
    Request {
        id: Value,
        method: String,
        params: Value,
    },
}

/// Why a request got no result.
#[derive(Clone, Debug)]
pub(super) enum RpcError {
    /// The agent answered with an error.
    Agent { code: i64, message: String },
    /// The child died first.
    Dead(String),
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RpcError::Agent { code, message } => write!(f, "{message} (code {code})"),
            RpcError::Dead(why) => f.write_str(why),
        }
    }
}

/// What the agent said it can do (`initialize`).
#[derive(Clone, Debug, Default)]
pub(super) struct Caps {
    pub load: bool,
    pub resume: bool,
    pub steering: bool,
    pub images: bool,
}

/// Why a child ended, as `tiller_engine_restarts_total{reason}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Death {
    /// It exited or closed its output by itself.
    Exited,
    /// It broke the protocol (malformed JSON, an unknown answer).
    Protocol,
    /// Tiller killed it (a cancel it did not answer, shutdown).
    Killed,
    /// Stopped after `idle_timeout`.
    Idle,
}

impl Death {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Death::Exited => "exited",
            Death::Protocol => "protocol",
            Death::Killed => "killed",
            Death::Idle => "idle",
        }
    }
}

#[derive(Default)]
struct State {
    next_id: u64,
    pending: HashMap<u64, oneshot::Sender<Result<Value, RpcError>>>,
    /// Upstream session id -> the turn listening.
    routes: HashMap<String, mpsc::Sender<Routed>>,
    /// Upstream sessions this process knows (created or loaded on it).
    known: HashSet<String>,
    /// Sessions whose updates are dropped silently (a load replays them).
    muted: HashSet<String>,
    /// Each session's options as the agent last told them, and whether
    /// they are `configOptions` (else its modes).
    options: HashMap<String, (Vec<crate::AgentOption>, bool)>,
    /// Turns running on it.
    busy: usize,
    /// Bumped at each turn's end: an idle stop checks it did not change.
    generation: u64,
    /// When its last turn ended (or it started).
    last_used: Option<std::time::Instant>,
    dead: Option<(Death, String)>,
}

/// A running agent process.
pub(super) struct Child {
    engine: Arc<str>,
    /// The values of what the agent is given beyond the base variables
    /// (its `env` and `pass_env`: its keys) and what its `args` seem to
    /// give as secrets ([`arg_secrets`]), never let out in its error text
    /// or the log.
    secrets: Box<[String]>,
    pid: Option<u32>,
    out: mpsc::UnboundedSender<String>,
    /// Bytes sent and not yet written to the agent, and their bound.
    out_waiting: Arc<std::sync::atomic::AtomicUsize>,
    out_bytes: usize,
    /// [`QUEUE_BYTES`], in KiB: all of it, and what is not waiting.
    queue_kib: u32,
    queued: Arc<tokio::sync::Semaphore>,
    state: Mutex<State>,
    caps: Mutex<Caps>,
}

impl Child {
    /// `text` with every secret the agent was given replaced.
    fn redact(&self, text: &str) -> String {
        redact(&self.secrets, text)
    }

    /// Starts the process in its own process group with the configured
    /// environment only, and its reader, writer and exit watcher.
    pub(super) fn spawn(cfg: &AcpConfig) -> Result<Arc<Child>, String> {
        Self::spawn_with(cfg, LIMITS)
    }

    /// [`Child::spawn`] with `limits` in place of [`LIMITS`].
    fn spawn_with(cfg: &AcpConfig, limits: Limits) -> Result<Arc<Child>, String> {
        let queue_bytes = limits.queue_bytes;
        let mut cmd = tokio::process::Command::new(&cfg.command);
        cmd.args(&cfg.args)
            .env_clear()
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&cfg.dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut proc = cmd
            .spawn()
            .map_err(|e| format!("cannot start `{}`: {e}", cfg.command.display()))?;
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let child = Arc::new(Child {
            engine: cfg.name.clone(),
            secrets: secrets(&cfg.env, &cfg.args),
            pid: proc.id(),
            out: tx,
            out_waiting: Arc::default(),
            out_bytes: limits.out_bytes,
            queue_kib: kib(queue_bytes),
            queued: Arc::new(tokio::sync::Semaphore::new(kib(queue_bytes) as usize)),
            state: Mutex::new(State::default()),
            caps: Mutex::new(Caps::default()),
        });
        let mut stdin = proc.stdin.take().expect("piped");
        let stdout = proc.stdout.take().expect("piped");
        let stderr = proc.stderr.take().expect("piped");
        let w = Arc::downgrade(&child);
        let waiting = child.out_waiting.clone();
        tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                let ok = stdin.write_all(line.as_bytes()).await.is_ok()
                    && stdin.write_all(b"\n").await.is_ok()
                    && stdin.flush().await.is_ok();
                waiting.fetch_sub(line.len(), std::sync::atomic::Ordering::Relaxed);
                if !ok {
                    if let Some(c) = w.upgrade() {
                        c.die(Death::Exited, "the agent stopped reading its input".into());
                    }
                    return;
                }
            }
            // Every sender is gone: closing stdin asks the agent to exit.
        });
        let r = Arc::downgrade(&child);
        tokio::spawn(async move {
            let mut lines = FramedRead::new(stdout, LinesCodec::new_with_max_length(MAX_LINE));
            loop {
                let item = lines.next().await;
                let Some(c) = r.upgrade() else { return };
                match item {
                    Some(Ok(line)) => {
                        // Bounded, in messages and in weight, before it is
                        // parsed: the agent waits while its turn is behind
                        // (the turn waits for its session).
                        let weight = weight(&line);
                        if weight > limits.max_weight {
                            let mib = weight >> 20;
                            c.die(
                                Death::Protocol,
                                format!(
                                    "the agent wrote a message too large to hold ({mib} MiB parsed)"
                                ),
                            );
                            return;
                        }
                        let share = kib(weight).min(c.queue_kib);
                        let Ok(held) = c.queued.clone().acquire_many_owned(share).await else {
                            return;
                        };
                        if let Some((tx, msg)) = c.read(&line) {
                            drop(line);
                            let routed = Routed { msg, _held: held };
                            if let Err(e) = tx.send(routed).await {
                                c.stale(e.0.msg);
                            }
                        }
                    }
                    Some(Err(e)) => {
                        c.die(
                            Death::Protocol,
                            format!("the agent's output is unreadable: {e}"),
                        );
                        return;
                    }
                    None => {
                        c.die(Death::Exited, "the agent closed its output".into());
                        return;
                    }
                }
            }
        });
        let engine = cfg.name.clone();
        let secrets = child.secrets.clone();
        tokio::spawn(async move {
            // The agent's diagnostics go to the daemon's log at debug
            // level only (they may quote the user's files); the pipe is
            // always drained, so the agent never blocks on it.
            log_lines(stderr, &secrets, |l| {
                tracing::debug!(engine = %engine, "agent stderr: {l}");
            })
            .await;
        });
        let e = Arc::downgrade(&child);
        tokio::spawn(async move {
            let status = proc.wait().await;
            if let Some(c) = e.upgrade() {
                let why = match status {
                    Ok(s) => format!("the agent exited ({s})"),
                    Err(e) => format!("the agent's process failed: {e}"),
                };
                c.die(Death::Exited, why);
            }
        });
        Ok(child)
    }

    pub(super) fn pid(&self) -> Option<u32> {
        self.pid
    }

    pub(super) fn caps(&self) -> Caps {
        self.caps.lock().unwrap().clone()
    }

    pub(super) fn set_caps(&self, caps: Caps) {
        *self.caps.lock().unwrap() = caps;
    }

    /// Why it died, if it did.
    pub(super) fn death(&self) -> Option<(Death, String)> {
        self.state.lock().unwrap().dead.clone()
    }

    pub(super) fn alive(&self) -> bool {
        self.death().is_none()
    }

    /// Sends a request; the answer comes on the receiver.
    pub(super) fn request(
        &self,
        method: &str,
        params: Value,
    ) -> oneshot::Receiver<Result<Value, RpcError>> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().unwrap();
        if let Some((_, why)) = &st.dead {
            let _ = tx.send(Err(RpcError::Dead(why.clone())));
            return rx;
        }
        st.next_id += 1;
        let id = st.next_id;
        st.pending.insert(id, tx);
        drop(st);
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        rx
    }

    /// Sends a request and waits for its answer, at most `bound`.
    pub(super) async fn call(
        &self,
        method: &str,
        params: Value,
        bound: Duration,
    ) -> Result<Value, RpcError> {
        match tokio::time::timeout(bound, self.request(method, params)).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(RpcError::Dead(
                self.death().map(|d| d.1).unwrap_or_default(),
            )),
            Err(_) => Err(RpcError::Agent {
                code: -32603,
                message: format!("the agent did not answer `{method}` within {bound:?}"),
            }),
        }
    }

    pub(super) fn notify(&self, method: &str, params: Value) {
        self.send(json!({"jsonrpc": "2.0", "method": method, "params": params}));
    }

    /// Answers one of the agent's requests.
    pub(super) fn respond(&self, id: Value, result: Result<Value, (i64, String)>) {
        let msg = match result {
            Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
            Err((code, message)) => {
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
            }
        };
        self.send(msg);
    }

    /// Queues `msg` for the agent; an agent that has let more than
    /// [`OUT_BYTES`] wait (it takes nothing of its input) is killed.
    fn send(&self, msg: Value) {
        let line = msg.to_string();
        let len = line.len();
        let waiting = self
            .out_waiting
            .fetch_add(len, std::sync::atomic::Ordering::Relaxed)
            + len;
        if waiting > self.out_bytes {
            self.die(
                Death::Protocol,
                format!(
                    "the agent stopped reading its input ({} MiB waiting for it)",
                    waiting >> 20
                ),
            );
            return;
        }
        let _ = self.out.send(line);
    }

    /// Routes the agent's messages for `upstream` to the returned receiver
    /// (replacing any earlier route).
    pub(super) fn route(&self, upstream: &str) -> Route {
        let (tx, rx) = mpsc::channel(ROUTE_QUEUE);
        let mut st = self.state.lock().unwrap();
        if st.dead.is_none() {
            st.routes.insert(upstream.to_owned(), tx);
        }
        Route(rx)
    }

    pub(super) fn unroute(&self, upstream: &str) {
        self.state.lock().unwrap().routes.remove(upstream);
    }

    pub(super) fn knows(&self, upstream: &str) -> bool {
        self.state.lock().unwrap().known.contains(upstream)
    }

    pub(super) fn options(&self, upstream: &str) -> Option<(Vec<crate::AgentOption>, bool)> {
        self.state.lock().unwrap().options.get(upstream).cloned()
    }

    pub(super) fn set_options(
        &self,
        upstream: &str,
        options: Vec<crate::AgentOption>,
        config: bool,
    ) {
        self.state
            .lock()
            .unwrap()
            .options
            .insert(upstream.to_owned(), (options, config));
    }

    pub(super) fn learn(&self, upstream: &str) {
        self.state.lock().unwrap().known.insert(upstream.to_owned());
    }

    /// Drops the session's updates silently while it is reloaded (the
    /// agent replays history Tiller already holds).
    pub(super) fn mute(&self, upstream: &str, on: bool) {
        let mut st = self.state.lock().unwrap();
        if on {
            st.muted.insert(upstream.to_owned());
        } else {
            st.muted.remove(upstream);
        }
    }

    /// A turn starts on it.
    /// A turn starts on it; false when it is dead (checked under the same
    /// lock an idle stop takes, so a turn never holds a process stopped
    /// under it).
    pub(super) fn enter(&self) -> bool {
        let mut st = self.state.lock().unwrap();
        if st.dead.is_some() {
            return false;
        }
        st.busy += 1;
        true
    }

    /// A turn ended; returns the generation an idle stop must still see.
    pub(super) fn leave(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap();
        st.busy = st.busy.saturating_sub(1);
        st.generation += 1;
        st.last_used = Some(std::time::Instant::now());
        (st.busy == 0).then_some(st.generation)
    }

    /// Stops it if it has stayed idle since `generation`.
    pub(super) fn stop_if_idle(&self, generation: u64) -> bool {
        let idle = {
            let st = self.state.lock().unwrap();
            st.busy == 0 && st.generation == generation && st.dead.is_none()
        };
        if idle {
            self.die(Death::Idle, "stopped after its idle timeout".into());
        }
        idle
    }

    /// When it last finished a turn, if no turn runs on it now.
    pub(super) fn idle_since(&self) -> Option<std::time::Instant> {
        let st = self.state.lock().unwrap();
        (st.busy == 0 && st.dead.is_none())
            .then(|| st.last_used.unwrap_or_else(std::time::Instant::now))
    }

    /// Stops it to make room (its sessions reload on their next turn).
    pub(super) fn evict(&self) {
        self.die(
            Death::Idle,
            "stopped to make room for another session".into(),
        );
    }

    /// Kills it: every turn on it fails with `why`.
    pub(super) fn kill(&self, why: String) {
        self.die(Death::Killed, why);
    }

    fn die(&self, death: Death, why: String) {
        let (pending, routes) = {
            let mut st = self.state.lock().unwrap();
            if st.dead.is_some() {
                return;
            }
            st.dead = Some((death, why.clone()));
            (
                std::mem::take(&mut st.pending),
                std::mem::take(&mut st.routes),
            )
        };
        if death != Death::Idle {
            tracing::warn!(engine = %self.engine, pid = ?self.pid, reason = %why, "an ACP agent process ended");
        }
        for (_, tx) in pending {
            let _ = tx.send(Err(RpcError::Dead(why.clone())));
        }
        drop(routes);
        // A reader waiting for room gives up (and lets the child go).
        self.queued.close();
        self.signal_group();
    }

    /// Kills the whole process group (the agent and what it started).
    fn signal_group(&self) {
        if let Some(pid) = self
            .pid
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }

    /// Handles one line the agent wrote; returns a message for a turn
    /// and where it goes.
    fn read(&self, line: &str) -> Option<(mpsc::Sender<Routed>, Inbound)> {
        if line.trim().is_empty() {
            return None;
        }
        let Ok(Value::Object(mut msg)) = serde_json::from_str(line) else {
            self.die(
                Death::Protocol,
                "the agent wrote something that is not JSON-RPC".into(),
            );
            return None;
        };
        // Taken, not copied: a message may be large.
        let method = match msg.remove("method") {
            Some(Value::String(m)) => Some(m),
            _ => None,
        };
        let id = msg.remove("id").filter(|v| !v.is_null());
        let params = msg.remove("params").unwrap_or(Value::Null);
        match (method.as_deref(), id) {
            (Some(method), Some(id)) => {
                let session = params["sessionId"].as_str().map(str::to_owned);
                self.inbound(
                    session.as_deref(),
                    Inbound::Request {
                        id,
                        method: method.to_owned(),
                        params,
                    },
                )
            }
            (Some("session/update"), None) => {
                let mut params = params;
                let update = params
                    .get_mut("update")
                    .map(Value::take)
                    .unwrap_or(Value::Null);
                self.inbound(params["sessionId"].as_str(), Inbound::Update(update))
            }
            (Some(_), None) => None, // other notifications (auth status, ...)
            (None, Some(id)) => {
                let tx = id
                    .as_u64()
                    .and_then(|n| self.state.lock().unwrap().pending.remove(&n));
                let Some(tx) = tx else {
                    let shown: String = self.redact(&id.to_string()).chars().take(40).collect();
                    self.die(
                        Death::Protocol,
                        format!("the agent answered a request Tiller did not send or had answered (id {shown})"),
                    );
                    return None;
                };
                let result = match msg.get("error") {
                    Some(e) => Err(RpcError::Agent {
                        code: e.get("code").and_then(Value::as_i64).unwrap_or(0),
                        // Redacted whole, then cut (a cut secret's head
                        // would not match).
                        message: self
                            .redact(e.get("message").and_then(Value::as_str).unwrap_or("error"))
                            .chars()
                            .take(500)
                            .collect(),
                    }),
                    None => Ok(msg.remove("result").unwrap_or(Value::Null)),
                };
                let _ = tx.send(result);
                None
            }
            (None, None) => {
                self.die(
                    Death::Protocol,
                    "the agent wrote a message with neither method nor id".into(),
                );
                None
            }
        }
    }

    /// Where a message for `session` goes: its turn, if one listens; a
    /// message for no running turn is stale.
    fn inbound(
        &self,
        session: Option<&str>,
        msg: Inbound,
    ) -> Option<(mpsc::Sender<Routed>, Inbound)> {
        let st = self.state.lock().unwrap();
        if let Some(s) = session
            && st.muted.contains(s)
            && matches!(msg, Inbound::Update(_))
        {
            return None;
        }
        let route = session.and_then(|s| st.routes.get(s)).cloned();
        drop(st);
        match route {
            Some(tx) => Some((tx, msg)),
            None => {
                self.stale(msg);
                None
            }
        }
    }

    /// Counts a message no turn takes; a request is refused.
    fn stale(&self, msg: Inbound) {
        metrics::counter!("tiller_engine_stale_messages_total", "engine" => self.engine.to_string())
            .increment(1);
        if let Inbound::Request { id, method, .. } = msg {
            let answer = if method == "session/request_permission" {
                Ok(json!({"outcome": {"outcome": "cancelled"}}))
            } else {
                Err((-32002, "no turn of this session is running".to_owned()))
            };
            self.respond(id, answer);
        }
    }
}

/// `bytes` in whole KiB, at least one.
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024).max(1)).unwrap_or(u32::MAX)
}

impl Drop for Child {
    fn drop(&mut self) {
        self.signal_group();
    }
}

#[cfg(test)]
mod tests {
    use super::Death;

    /// An agent that is `sh -c script`, one session per process.
    fn sh_agent(name: &str, script: String) -> super::AcpConfig {
        super::AcpConfig {
            name: name.into(),
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            sessions_per_process: 1,
            idle_timeout: std::time::Duration::from_secs(60),
            max_processes: 1,
            cancel_grace: std::time::Duration::from_secs(1),
            start_timeout: std::time::Duration::from_secs(5),
            version: "0".into(),
            dir: "/".into(),
        }
    }

    /// An agent flooding a turn that does not keep up is held back by the
    /// bytes waiting, not by a count of messages each as long as 80 MiB:
    /// 1 MiB of queue holds about 16 of its 64 KiB updates, the reader
    /// then waits (the agent on its pipe), and every update still arrives
    /// once the turn reads.
    #[tokio::test]
    async fn a_flooding_agent_is_held_back_by_the_bytes_waiting() {
        const LINES: usize = 200;
        let script = format!(
            "read go; s=$(head -c 65536 /dev/zero | tr '\\0' a); i=0; \
             while [ $i -lt {LINES} ]; do \
             printf '{{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{{\"sessionId\":\"s\",\"update\":{{\"n\":%d,\"x\":\"%s\"}}}}}}\\n' $i \"$s\"; \
             i=$((i+1)); done; sleep 30"
        );
        let cfg = sh_agent("flood", script);
        let limits = super::Limits {
            queue_bytes: 1 << 20,
            max_weight: super::MAX_WEIGHT,
            out_bytes: super::OUT_BYTES,
        };
        let child = super::Child::spawn_with(&cfg, limits).unwrap();
        let mut route = child.route("s");
        child.notify("go", serde_json::Value::Null);
        // Until what waits stops growing (the agent would have written
        // everything by then, were it let).
        let mut waiting = 0;
        let mut still = 0;
        for _ in 0..200 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let now = route.len();
            still = if now == waiting && now > 0 {
                still + 1
            } else {
                0
            };
            waiting = now;
            if still == 6 {
                break;
            }
        }
        assert!(
            (8..=17).contains(&waiting),
            "{waiting} updates of 64 KiB waiting"
        );
        let all = async {
            for n in 0..LINES {
                let Some(super::Inbound::Update(u)) = route.recv().await else {
                    panic!("update {n} missing")
                };
                assert_eq!(u["n"], n, "in order");
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(20), all)
            .await
            .expect("every update arrives");
    }

    /// An agent that takes nothing of what Tiller writes to it (answers to
    /// its own file requests, of up to 16 MiB each) is killed once the
    /// bytes waiting for it pass the bound, instead of holding them all.
    #[tokio::test]
    async fn an_agent_that_reads_nothing_is_killed_past_the_bytes_waiting() {
        let cfg = sh_agent("deaf", "exec sleep 30".into());
        let limits = super::Limits {
            queue_bytes: 1 << 20,
            max_weight: super::MAX_WEIGHT,
            out_bytes: 1 << 20,
        };
        let child = super::Child::spawn_with(&cfg, limits).unwrap();
        let text = "x".repeat(64 * 1024);
        for i in 0..64 {
            child.respond(
                serde_json::json!(i),
                Ok(serde_json::json!({ "content": text })),
            );
        }
        let dead = async {
            while child.alive() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), dead)
            .await
            .expect("the agent was killed");
        let (_, why) = child.death().unwrap();
        assert!(why.contains("reading"), "{why}");
    }

    /// A message that would take more than its bound parsed (told before
    /// parsing it) kills the agent; a long text does not.
    #[tokio::test]
    async fn a_message_too_large_to_hold_parsed_kills_the_agent() {
        // `x` is "s" (a text of 40,000 commas: light), then [0s] (an
        // array of 40,001 numbers: about 1.36 MB parsed).
        let line = |x: &str| {
            format!(
                "printf '{{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{{\"sessionId\":\"s\",\"update\":{{\"x\":{x}}}}}}}\\n' \"$s\";"
            )
        };
        let script = format!(
            "read go; s=$(head -c 40000 /dev/zero | tr '\\0' ,); {} \
             s=$(head -c 40000 /dev/zero | tr '\\0' a | sed 's/a/,0/g'); {} sleep 30",
            line("\"%s\""),
            line("[0%s]")
        );
        let cfg = sh_agent("large", script);
        let limits = super::Limits {
            queue_bytes: 4 << 20,
            max_weight: 1 << 20,
            out_bytes: super::OUT_BYTES,
        };
        let child = super::Child::spawn_with(&cfg, limits).unwrap();
        let mut route = child.route("s");
        child.notify("go", serde_json::Value::Null);
        let first = tokio::time::timeout(std::time::Duration::from_secs(10), route.recv()).await;
        assert!(
            matches!(first, Ok(Some(super::Inbound::Update(_)))),
            "the long text arrives"
        );
        let second = tokio::time::timeout(std::time::Duration::from_secs(10), route.recv()).await;
        assert!(
            matches!(second, Ok(None)),
            "the second message was delivered, or the route stayed open"
        );
        let (death, why) = child.death().expect("dead");
        assert_eq!(death, Death::Protocol);
        assert!(why.contains("too large"), "{why}");
    }

    #[test]
    fn every_death_reason_is_registered_at_start_up() {
        let restarts = tiller_core::metrics::ALL
            .iter()
            .find(|m| m.name == "tiller_engine_restarts_total")
            .unwrap();
        let registered: Vec<String> =
            tiller_core::metrics::combinations(restarts, &[], &["a".into()])
                .into_iter()
                .map(|labels| labels[1].1.clone())
                .collect();
        let all = [Death::Exited, Death::Protocol, Death::Killed, Death::Idle];
        assert_eq!(registered, all.map(|d| d.as_str().to_owned()));
    }
}
