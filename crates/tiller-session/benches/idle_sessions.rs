#![allow(clippy::print_stdout)] // a load generator prints its figures
//! Load generator: what an idle session costs. Creates N live sessions
//! (default 100,000) through the registry with a real store, then prints the
//! resident memory per session and the creation rate, beside its floor:
//! what the same number of bare ractor actors (no state, no messages)
//! costs in the same process.
//! Run: `cargo bench -p tiller-session --bench idle_sessions [-- N]`.

use std::sync::Arc;
use std::time::Instant;

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

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::open(&dir.path().join("bench.db")).expect("store");
    let sessions = Sessions::start(
        store,
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        SessionConfig {
            turn: TurnConfig::default(),
            max_sessions: n + 1,
            loops: Default::default(),
            permission_mode: Default::default(),
            notification_cap: 32,
            delivery: Default::default(),
            delivery_wake: None,
            budget: Default::default(),
            cluster: None,
            tools: Default::default(),
        },
    )
    .await
    .expect("sessions");
    // Warm up allocator and runtime.
    let warm = sessions.create("/w".into(), None).await.expect("create");
    drop(warm);
    // The floor first, kept alive: memory freed and reused would flatter
    // whichever is measured second.
    let (bare, floor) = bare_actors(n).await;
    let before = rss_bytes();
    let t0 = Instant::now();
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        handles.push(sessions.create("/w".into(), None).await.expect("create"));
    }
    let took = t0.elapsed();
    let after = rss_bytes();
    let live = sessions.live().await;
    println!("live sessions:        {live}");
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
    println!(
        "per idle session:     {:.0} bytes",
        (after.saturating_sub(before)) as f64 / n as f64
    );
    println!("reference:            a bare ractor actor costs {floor:.0} bytes");
    sessions.shutdown().await;
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
