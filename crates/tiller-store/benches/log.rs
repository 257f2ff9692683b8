#![allow(clippy::print_stdout)] // a load generator prints its figures
//! Append throughput and last-page latency for one session with 1,000,000
//! events; then a backlog of many sessions' streamed events sent at once
//! (a store that fell behind): how fast it drains, and how long an
//! awaited append sent behind it waits. Run:
//! `cargo bench -p tiller-store --bench log [-- N]`.

use std::time::{Duration, Instant};

use tiller_core::{PromptId, SessionId, TurnId};
use tiller_store::{SessionRecord, Store, StoredEvent};

#[tokio::main]
async fn main() {
    let n: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::open(&dir.path().join("bench.db")).expect("store");
    let s = SessionId::new();
    store.create_session(record(s)).await.expect("session");
    backlog(&store, 1_000, 200).await;
    let prompt = PromptId::new();
    let data = r#"{"type":"agent_message_chunk","text":"a streamed chunk of agent text, about this long"}"#;
    let t0 = Instant::now();
    for seq in 1..=n {
        store.append(
            StoredEvent {
                session: s,
                seq,
                ts_ms: seq as i64,
                kind: "agent_message_chunk".into(),
                prompt: Some(prompt),
                turn: Some(TurnId(seq / 1000 + 1)),
                data: data.into(),
            },
            None,
            None,
        );
    }
    store.flush().await.expect("flush");
    let took = t0.elapsed();
    println!(
        "appended {n} events in {:.2} s: {:.0} events/s",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64()
    );

    let mut samples = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let page = store.history(s, None, 100).await.expect("page");
        samples.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(page.events.last().map(|e| e.seq), Some(n));
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "last page (100 events): p50 {:.3} ms, p99 {:.3} ms",
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100]
    );
    let mut mid = Vec::new();
    for i in 0..200u64 {
        let t = Instant::now();
        store
            .history(s, Some(n / 2 + i * 7), 100)
            .await
            .expect("page");
        mid.push(t.elapsed().as_secs_f64() * 1e3);
    }
    mid.sort_by(f64::total_cmp);
    println!(
        "page in the middle (100 events): p50 {:.3} ms, p99 {:.3} ms",
        mid[mid.len() / 2],
        mid[mid.len() * 99 / 100]
    );

    // Replay as a catch-up reads it: every event, page after page.
    let t = Instant::now();
    let (mut after, mut read) = (0u64, 0u64);
    loop {
        let page = store.events_after(s, after, 1024).await.expect("page");
        let Some(last) = page.last() else { break };
        after = last.seq;
        read += page.len() as u64;
    }
    assert_eq!(read, n);
    let took = t.elapsed();
    println!(
        "replay from the store (pages of 1,024): {n} events in {:.2} s: {:.0} events/s",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64()
    );
}

fn record(id: SessionId) -> SessionRecord {
    SessionRecord {
        id,
        cwd: "/".into(),
        title: None,
        created_ms: 0,
        updated_ms: 0,
        closed: false,
        channel: None,
    }
}

fn chunk(session: SessionId, seq: u64) -> StoredEvent {
    StoredEvent {
        session,
        seq,
        ts_ms: seq as i64,
        kind: "agent_message_chunk".into(),
        prompt: None,
        turn: Some(TurnId(1)),
        data: r#"{"type":"agent_message_chunk","text":"a chunk"}"#.into(),
    }
}

/// `sessions` sessions' `each` streamed events, interleaved, sent at once
/// (five rounds): the drain rate, and the wait of an awaited append of
/// another session sent right behind them.
async fn backlog(store: &Store, sessions: usize, each: u64) {
    let ids: Vec<SessionId> = (0..=sessions).map(|_| SessionId::new()).collect();
    for id in &ids {
        store.create_session(record(*id)).await.expect("session");
    }
    let (streams, awaited) = ids.split_at(sessions);
    let mut rates = Vec::new();
    let mut waits: Vec<Duration> = Vec::new();
    for round in 0..5u64 {
        let t0 = Instant::now();
        for seq in round * each + 1..=(round + 1) * each {
            for s in streams {
                store.append(chunk(*s, seq), None, None);
            }
        }
        let t = Instant::now();
        store
            .append_durable(chunk(awaited[0], round + 1), None)
            .await
            .expect("awaited");
        waits.push(t.elapsed());
        store.flush().await.expect("flush");
        rates.push((sessions as u64 * each) as f64 / t0.elapsed().as_secs_f64());
    }
    println!(
        "backlog of {sessions} sessions x {each} events sent at once, 5 rounds: \
         {} events/s drained; an awaited append behind it waited {} ms",
        rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        waits
            .iter()
            .map(|w| format!("{:.2}", w.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(", "),
    );
}
