#![allow(clippy::print_stdout)] // a load generator prints its figures
//! Load generator: what a streamed chunk costs the session actor and the
//! store, without a client protocol. N sessions (default 200) each run one
//! turn of M chunks (default 2,000) at once through the registry, the
//! scripted engine and a real store (SQLite in a temporary directory), a
//! subscriber counting what each session fans out; a few rounds, each
//! printing chunks per second and the process's CPU per chunk (from
//! `getrusage`). It asserts nothing.
//! Run: `cargo bench -p tiller-session --bench streams [-- N M ROUNDS]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The daemon's allocator (`crates/tiller/src/main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use tiller_core::{Origin, TurnConfig};
use tiller_engine::ScriptedEngine;
use tiller_session::{EventRecord, SessionConfig, Sessions, Subscriber};
use tiller_store::Store;

/// Counts the chunks fanned out to it.
struct Count(Arc<AtomicU64>);

impl Subscriber for Count {
    fn deliver(&self, e: &Arc<EventRecord>) -> bool {
        if e.body.kind() == "agent_message_chunk" {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        true
    }
}

/// User and system CPU of the whole process, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    f.iter().sum::<u64>() as f64 / 100.0 // USER_HZ
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(200);
    let m = args.get(1).copied().unwrap_or(2_000);
    let rounds = args.get(2).copied().unwrap_or(5);
    // Two workers, as on the 2-core machines the figures are for.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(n, m, rounds));
}

async fn run(n: usize, m: usize, rounds: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::open(&dir.path().join("streams.db")).expect("store");
    let sessions = Sessions::start(
        store,
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        SessionConfig {
            turn: TurnConfig::default(),
            max_sessions: n + 1,
            ..tiller_test_support::session_config()
        },
    )
    .await
    .expect("sessions");
    let counted = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        let h = sessions.create("/w".into(), None).await.expect("create");
        h.subscribe(sessions.subscriber_id(), Box::new(Count(counted.clone())))
            .await
            .expect("subscribe");
        handles.push(h);
    }
    let script = format!(
        r#"{{"script": [{{"repeat": {{"times": {m}, "steps": [{{"say": "token "}}]}}}}]}}"#
    );
    println!(
        "{n} sessions streaming {m} chunks each at once, {rounds} rounds (the first warms up):"
    );
    for round in 0..=rounds {
        let (c0, t0, k0) = (
            cpu_seconds(),
            Instant::now(),
            counted.load(Ordering::Relaxed),
        );
        let mut turns = Vec::with_capacity(n);
        for h in &handles {
            let (_, done) = h
                .prompt(script.clone(), Origin::Interactive)
                .await
                .expect("session")
                .expect("admitted");
            turns.push(done);
        }
        for t in turns {
            t.await.expect("settled");
        }
        let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let chunks = (counted.load(Ordering::Relaxed) - k0) as f64;
        if round > 0 {
            println!(
                "  round {round}: {:.0} chunks/s, {:.2} us of CPU per chunk ({chunks:.0} chunks)",
                chunks / wall,
                cpu * 1e6 / chunks
            );
        }
    }
    sessions.shutdown().await;
}
