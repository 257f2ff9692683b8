#![allow(clippy::print_stdout)] // a load generator prints its figures
//! Figures for hosted ACP agents: N sessions on the misbehaving agent in
//! its well-behaved mode, each prompted once; prints the memory of each
//! child and what each session costs the daemon.
//!
//!   cargo bench -p tiller-test-support --bench hosted_agents -- [SESSIONS] [SESSIONS_PER_PROCESS]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tiller_core::{Origin, StopReason, Terminal};
use tiller_engine::Engine as _;
use tiller_engine::acp::{AcpConfig, AcpEngine, rss_bytes};
use tiller_session::{Engines, Sessions};
use tiller_test_support::{Store, session_config};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(200);
    let per = args.get(1).copied().unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(run(n, per));
}

async fn run(n: usize, per: usize) {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let env: Vec<(String, String)> = ["PATH", "HOME"]
        .iter()
        .filter_map(|k| Some((k.to_string(), std::env::var(k).ok()?)))
        .collect();
    let engine = Arc::new(AcpEngine::new(AcpConfig {
        name: "fake".into(),
        command: env!("CARGO_BIN_EXE_tiller-fake-acp").into(),
        args: Vec::new(),
        env,
        sessions_per_process: per,
        idle_timeout: Duration::from_secs(3600),
        max_processes: n,
        cancel_grace: Duration::from_secs(2),
        start_timeout: Duration::from_secs(30),
        version: "bench".into(),
        dir: std::env::temp_dir(),
    }));
    let mut config = session_config();
    config.max_sessions = n + 1;
    config.turn.stall_timeout = 60_000;
    let store = Store::open(&dir.path().join("b.db")).unwrap();
    let sessions = Sessions::start(store, Engines::single(engine.clone()), config)
        .await
        .unwrap();
    let me = std::process::id();
    let before = rss_bytes(me).unwrap_or(0);
    let start = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..n {
        handles.push(
            sessions
                .create(work.path().display().to_string(), None)
                .await
                .unwrap(),
        );
    }
    let mut latencies = Vec::new();
    for chunk in handles.chunks(20) {
        let mut waits = Vec::new();
        for h in chunk {
            let t = Instant::now();
            let (_, settled) = h
                .prompt("hello".into(), Origin::Interactive)
                .await
                .unwrap()
                .unwrap();
            waits.push((t, settled));
        }
        for (t, settled) in waits {
            let s = settled.await.unwrap();
            assert_eq!(s.terminal, Terminal::Completed(StopReason::EndTurn));
            latencies.push(t.elapsed());
        }
    }
    let took = start.elapsed();
    let after = rss_bytes(me).unwrap_or(0);
    let pids = engine.processes().await;
    let child: Vec<u64> = pids.iter().filter_map(|p| rss_bytes(*p)).collect();
    let total: u64 = child.iter().sum();
    latencies.sort();
    let kib = |b: u64| b as f64 / 1024.0;
    println!(
        "hosted sessions: {n}, sessions per process: {per}, processes: {}",
        pids.len()
    );
    println!(
        "first prompts (process start + initialize + session/new + 3 chunks): {:.1} s in all, p50 {:.1} ms, p99 {:.1} ms",
        took.as_secs_f64(),
        latencies[latencies.len() / 2].as_secs_f64() * 1e3,
        latencies[latencies.len() * 99 / 100].as_secs_f64() * 1e3
    );
    println!(
        "agent processes: {:.0} KiB RSS each on average ({:.1} MiB in all)",
        kib(total) / child.len().max(1) as f64,
        total as f64 / (1024.0 * 1024.0)
    );
    println!(
        "daemon: {:.1} KiB RSS per hosted session ({:.1} MiB before, {:.1} MiB after)",
        kib(after.saturating_sub(before)) / n as f64,
        before as f64 / (1024.0 * 1024.0),
        after as f64 / (1024.0 * 1024.0)
    );
    println!(
        "per session in all (daemon share + its process share): {:.0} KiB",
        (kib(after.saturating_sub(before)) + kib(total)) / n as f64
    );
    engine.shutdown();
    sessions.shutdown().await;
}
