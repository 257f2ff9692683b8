#![allow(clippy::print_stdout)] // a load generator prints its figures
//! Load generator: what an idle session costs. Creates N live sessions
//! (default 100,000) through the registry with a real store, then prints the
//! resident memory per session and the creation rate, beside its floor:
//! what the same number of bare ractor actors (no state, no messages)
//! costs in the same process; then N more that park (their actors stop,
//! a record stays), the memory each costs parked, and what waking one
//! costs.
//! Run: `cargo bench -p tiller-session --bench idle_sessions [-- N]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// The daemon's allocator (`crates/tiller/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use tiller_core::TurnConfig;
use tiller_engine::ScriptedEngine;
use tiller_session::{SessionConfig, Sessions};
use tiller_store::Store;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn config(n: usize, park_after: Option<Duration>) -> SessionConfig {
    SessionConfig {
        // The daemon's turn bounds, not the tests' short ones.
        turn: TurnConfig::default(),
        max_sessions: n + 1,
        park_after,
        ..tiller_test_support::session_config()
    }
}

async fn start(dir: &tempfile::TempDir, name: &str, config: SessionConfig) -> Sessions {
    let store = Store::open(&dir.path().join(name)).expect("store");
    Sessions::start(
        store,
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        config,
    )
    .await
    .expect("sessions")
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let running = start(&dir, "running.db", config(n, None)).await;
    let parking = start(&dir, "parked.db", config(n, Some(Duration::ZERO))).await;
    // Warm up allocator and runtime.
    drop(running.create("/w".into(), None).await.expect("create"));
    // The floor first, kept alive: memory freed and reused would flatter
    // whichever is measured second.
    let (bare, floor) = bare_actors(n).await;

    // Idle sessions with their actors (parking off), each handle held as
    // an edge holds it.
    let before = rss_bytes();
    let t0 = Instant::now();
    let mut handles = Vec::with_capacity(2 * n);
    for _ in 0..n {
        handles.push(running.create("/w".into(), None).await.expect("create"));
    }
    let took = t0.elapsed();
    let after = rss_bytes();
    println!("live sessions:        {}", running.live().await);
    println!(
        "created in:           {:.2} s ({:.0} sessions/s)",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64()
    );
    println!(
        "resident memory:      {:.1} MiB -> {:.1} MiB",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0
    );
    let with_actor = (after.saturating_sub(before)) as f64 / n as f64;
    println!("per idle session:     {with_actor:.0} bytes (its actor running)");
    println!("reference:            a bare ractor actor costs {floor:.0} bytes");

    // Parked: created in batches, each parked before the next, as idle
    // sessions park over a daemon's life (an actor's memory is reused by
    // the next one). Handles held, as edges hold them.
    let before = rss_bytes();
    let t0 = Instant::now();
    let batch = 1_000.min(n);
    let mut made = 0;
    while made < n {
        let k = batch.min(n - made);
        for _ in 0..k {
            handles.push(parking.create("/w".into(), None).await.expect("create"));
        }
        made += k;
        while parking.parked().await < made {
            parking.park_idle();
            tokio::task::yield_now().await;
        }
    }
    let took = t0.elapsed();
    let after = rss_bytes();
    println!(
        "parked sessions:      {} of {} live, created and parked in {:.2} s",
        parking.parked().await,
        parking.live().await,
        took.as_secs_f64()
    );
    let parked = (after.saturating_sub(before)) as f64 / n as f64;
    println!("per parked session:   {parked:.0} bytes (goal: < 5,000)");

    // What waking costs: the first message to a parked session (a
    // snapshot) starts its actor from the store.
    let sample = 1_000.min(n);
    let mut waits = Vec::with_capacity(sample);
    for h in &handles[n..n + sample] {
        let t = Instant::now();
        h.snapshot().await.expect("snapshot");
        waits.push(t.elapsed());
    }
    waits.sort();
    println!(
        "waking a parked one:  p50 {:.0} us, p99 {:.0} us (its first message; then it runs)",
        waits[sample / 2].as_secs_f64() * 1e6,
        waits[sample * 99 / 100].as_secs_f64() * 1e6
    );
    running.shutdown().await;
    parking.shutdown().await;
    for a in bare {
        a.stop(None);
    }
}

/// An actor with nothing in it: what ractor and tokio cost per actor.
struct Bare;

impl ractor::Actor for Bare {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _: ractor::ActorRef<()>,
        _: (),
    ) -> Result<(), ractor::ActorProcessingErr> {
        Ok(())
    }
}

/// `n` live bare actors and the resident bytes each costs.
async fn bare_actors(n: usize) -> (Vec<ractor::ActorRef<()>>, f64) {
    let mut actors = Vec::with_capacity(n);
    let before = rss_bytes();
    for _ in 0..n {
        let (a, _) = ractor::Actor::spawn(None, Bare, ()).await.expect("spawn");
        actors.push(a);
    }
    let per = rss_bytes().saturating_sub(before) as f64 / n as f64;
    (actors, per)
}
