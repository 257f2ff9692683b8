//! Shared helpers for Tiller's Rust tests, so every test builds sessions
//! the same way: one session config, a subscriber that collects what it
//! is sent, a real store (in a temporary directory) that a test can
//! make fail on demand ([`Store::fail_appends`]), paused time
//! ([`virtual_elapsed`]) and an in-process ACP client ([`AcpClient`]).

mod acp;

pub use acp::{AcpClient, update_kinds};

use std::sync::{Arc, Mutex};

use tiller_core::{TurnConfig, TurnId};
use tiller_engine::{
    Engine, EngineHandle, PreparedPrompt, ScriptError, ScriptedEngine, SignalSink, TurnContext,
};
use tiller_session::{EventRecord, SessionConfig, Sessions, Subscriber};
pub use tiller_store::Store;

/// The session config tests use: short bounds, small queues.
pub fn session_config() -> SessionConfig {
    SessionConfig {
        turn: TurnConfig {
            steer_receipt_timeout: 200,
            cancel_grace: 200,
            stall_timeout: 2_000,
            max_queued_prompts: 2,
            max_turn_events: 100_000,
        },
        max_sessions: 3,
        loops: Default::default(),
        permission_mode: Default::default(),
        notification_cap: 32,
        delivery: Default::default(),
        delivery_wake: None,
        budget: Default::default(),
        cluster: None,
        park_after: None,
        tools: Default::default(),
    }
}

/// A started registry on the scripted engine, and its store.
pub async fn sessions(dir: &tempfile::TempDir) -> (Sessions, Store) {
    sessions_on(dir, Arc::new(ScriptedEngine), session_config()).await
}

/// A started registry on `engine` with `config`, and its store.
pub async fn sessions_on(
    dir: &tempfile::TempDir,
    engine: Arc<dyn Engine>,
    config: SessionConfig,
) -> (Sessions, Store) {
    let store = Store::open(&dir.path().join("t.db")).expect("open the test store");
    let sessions = Sessions::start(
        store.clone(),
        tiller_session::Engines::single(engine),
        config,
    )
    .await
    .expect("start the sessions");
    (sessions, store)
}

/// The scripted engine as an agent that acts on its own would be: its
/// cancelled turn settles at its answer or at `turn.cancel_grace`
/// ([`tiller_core::EngineStop::Answered`], the rule of hosted agents).
#[derive(Clone, Debug, Default)]
pub struct AnsweringScripted;

impl Engine for AnsweringScripted {
    fn name(&self) -> &str {
        "scripted"
    }

    fn prepare(&self, text: &str) -> Result<PreparedPrompt, ScriptError> {
        ScriptedEngine.prepare(text)
    }

    fn start(
        &self,
        turn: TurnId,
        prompt: PreparedPrompt,
        ctx: TurnContext,
        sink: SignalSink,
    ) -> EngineHandle {
        ScriptedEngine.start(turn, prompt, ctx, sink)
    }
}

/// A subscriber that keeps every event it is sent.
#[derive(Clone, Default)]
pub struct Collect(pub Arc<Mutex<Vec<Arc<EventRecord>>>>);

impl Collect {
    /// What it received so far.
    pub fn events(&self) -> Vec<Arc<EventRecord>> {
        self.0.lock().expect("not poisoned").clone()
    }
}

impl Subscriber for Collect {
    fn deliver(&self, e: &Arc<EventRecord>) -> bool {
        self.0.lock().expect("not poisoned").push(e.clone());
        true
    }
}

/// Sweeps `s` until `n` of its sessions are parked (bounded: fails the
/// test if they do not park).
pub async fn parked(s: &Sessions, n: usize) {
    for _ in 0..2500 {
        s.park_idle();
        if s.parked().await == n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    panic!("{} sessions parked, not {n}", s.parked().await);
}

/// The kinds of `events`, in order.
pub fn kinds<E: std::borrow::Borrow<EventRecord>>(events: &[E]) -> Vec<&'static str> {
    events.iter().map(|e| e.borrow().body.kind()).collect()
}

/// Runs `f` and returns its output with the time it took on tokio's clock.
/// In a `#[tokio::test(start_paused = true)]` that clock is virtual: it
/// jumps to the next timer whenever every task waits, so a bound of ten
/// minutes is checked in milliseconds of real time, exactly.
pub async fn virtual_elapsed<F: Future>(f: F) -> (F::Output, std::time::Duration) {
    let start = tokio::time::Instant::now();
    let out = f.await;
    (out, start.elapsed())
}
