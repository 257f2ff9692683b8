//! SQLite's log index written behind the log (see [`crate::index`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use proptest::prelude::*;
use rusqlite::Connection;
use tiller_core::{PromptId, SessionId, TurnId};

use crate::index::Tail;
use crate::log::{self, Heads};
use crate::writer::Pending;
use crate::{SessionRecord, Store, StoredEvent};

fn rec(id: SessionId) -> SessionRecord {
    SessionRecord {
        id,
        cwd: "/tmp".into(),
        title: None,
        created_ms: 1,
        updated_ms: 1,
        closed: false,
        channel: None,
    }
}

fn ev(session: SessionId, seq: u64) -> StoredEvent {
    StoredEvent {
        session,
        seq,
        ts_ms: 1_000 + seq as i64,
        kind: if seq.is_multiple_of(7) {
            "turn_error".into()
        } else {
            "agent_message_chunk".into()
        },
        prompt: Some(PromptId::from_u128(5)),
        turn: Some(TurnId(seq / 3)),
        data: format!("{{\"content\":{{\"text\":\"chunk {seq} of a streamed reply\"}}}}"),
    }
}

/// What a commit of many sessions' streams writes: the log's pages, one
/// after the other, not a page of the index per session (the index
/// entries are written later, many of a session's at once). With the
/// index kept at every commit, a round of 64 sessions' bursts wrote about
/// 106 frames; now about 9, counting the index written behind it.
#[tokio::test]
async fn a_commit_of_many_sessions_writes_the_log_not_a_page_per_session() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let store = Store::open_inline(&path).unwrap();
    let sessions: Vec<SessionId> = (0..64).map(|_| SessionId::new()).collect();
    for s in &sessions {
        store.create_session(rec(*s)).await.unwrap();
    }
    let round = |seq: u64| {
        let events = sessions.iter().map(|s| (ev(*s, seq), None)).collect();
        store.append_many(events, Arc::new(|_| {}));
    };
    // Enough segments that each session's index entries fill pages of
    // their own.
    for seq in 1..=400 {
        round(seq);
    }
    let before = store.shared.frames_written.load(Ordering::Relaxed);
    let rounds = 600;
    for seq in 401..=400 + rounds {
        round(seq);
    }
    let per_round =
        (store.shared.frames_written.load(Ordering::Relaxed) - before) as f64 / rounds as f64;
    assert!(
        per_round < 16.0,
        "a commit of 64 sessions' bursts wrote {per_round:.1} frames on average"
    );
    // Everything is found, through the index.
    for s in &sessions {
        let page = store.history(*s, None, 50).await.unwrap();
        assert_eq!(page.events.last().map(|e| e.seq), Some(1_000));
        assert!(page.has_more);
    }
    store.close().await;
}

/// A process that dies with index entries waiting leaves segments in the
/// log that the index does not name; opening the store indexes them, so
/// every read, the heads, the listing and later appends see the whole log.
#[tokio::test]
async fn segments_left_unindexed_by_a_crash_are_indexed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (a, b) = (SessionId::new(), SessionId::new());
    {
        let store = Store::open(&path).unwrap();
        for s in [a, b] {
            store.create_session(rec(s)).await.unwrap();
        }
        for seq in 1..=30 {
            for s in [a, b] {
                store.append_durable(ev(s, seq), None).await.unwrap();
            }
        }
        store.close().await;
    }
    // What a crash leaves: the index and its mark stop part-way.
    {
        let conn = Connection::open(&path).unwrap();
        let (segments, max): (i64, i64) = conn
            .query_row("SELECT COUNT(*), MAX(n) FROM log", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        assert_eq!(segments, 60);
        let upto = max - 25;
        conn.execute("DELETE FROM log_index WHERE n > ?1", [upto])
            .unwrap();
        conn.execute("UPDATE log_indexed SET upto = ?1", [upto])
            .unwrap();
    }
    let store = Store::open(&path).unwrap();
    for s in [a, b] {
        let page = store.history(s, None, 100).await.unwrap();
        let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=30).collect::<Vec<_>>(), "session {s}");
        assert_eq!(store.reopen_log(s).await.unwrap().last_seq, 30);
        let after = store.events_after(s, 20, 100).await.unwrap();
        assert_eq!(after.first().map(|e| e.seq), Some(21));
        assert_eq!(
            store
                .last_of_kinds(s, &["turn_error"])
                .await
                .unwrap()
                .map(|e| e.seq),
            Some(28)
        );
    }
    let listed = store.list_sessions(None, 10).await.unwrap();
    assert!(
        listed.sessions.iter().all(|r| r.updated_ms == 1_030),
        "{:?}",
        listed.sessions
    );
    // The log goes on after what it holds; a number it holds is refused.
    store.append_durable(ev(a, 31), None).await.unwrap();
    assert!(store.append_durable(ev(b, 30), None).await.is_err());
    assert!(store.delete_session(b).await.unwrap());
    store.close().await;
    let conn = Connection::open(&path).unwrap();
    let (log, index): (i64, i64) = conn
        .query_row(
            "SELECT (SELECT COUNT(*) FROM log), (SELECT COUNT(*) FROM log_index)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((log, index), (31, 31), "the deleted session left rows");
}

#[derive(Debug, Clone)]
enum Op {
    /// A commit of `n` events of each of the sessions in `mask`.
    Append { mask: u8, n: u64 },
    /// Upkeep: the oldest sessions' entries written, at most this many
    /// (a session's may be written in part).
    WriteOldest(usize),
    /// A read of one session's log (its entries written first).
    Read(usize),
    /// The process dies: entries waiting are lost, the log is not.
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..16, 1u64..100).prop_map(|(mask, n)| Op::Append { mask, n }),
        2 => (1usize..20).prop_map(Op::WriteOldest),
        2 => (0usize..4).prop_map(Op::Read),
        1 => Just(Op::Crash),
    ]
}

fn batch(sessions: &[SessionId], mask: u8, n: u64, model: &mut [u64]) -> Vec<Pending> {
    let mut out = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        if mask & (1 << i) == 0 {
            continue;
        }
        for _ in 0..n {
            model[i] += 1;
            out.push(Pending {
                event: ev(*s, model[i]),
                ledger: None,
                reply: None,
                on_commit: None,
                joined: false,
            });
        }
    }
    out
}

/// Every segment numbered up to the mark is in the index: what makes a
/// crash lose nothing.
fn mark_holds(conn: &Connection) {
    let unindexed: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM log l WHERE l.n <= (SELECT upto FROM log_indexed)
             AND NOT EXISTS (SELECT 1 FROM log_index i WHERE i.n = l.n)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(unindexed, 0, "segments at or below the mark are unindexed");
}

/// Each session's log reads whole and in order.
fn check(conn: &Connection, tail: &mut Tail, sessions: &[SessionId], model: &[u64]) {
    for (i, s) in sessions.iter().enumerate() {
        tail.write_session(conn, *s).unwrap();
        let page = log::history(conn, *s, i64::MAX as u64, 100_000).unwrap();
        let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=model[i]).collect::<Vec<_>>());
        assert_eq!(log::head(conn, *s).unwrap().last_seq, model[i]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under any interleaving of commits, upkeep, reads and crashes, the
    /// index behind the log never loses a segment nor names one twice.
    #[test]
    fn the_index_behind_the_log_loses_nothing_under_any_interleaving(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut conn = Connection::open(&path).unwrap();
        crate::schema::migrate(&conn).unwrap();
        let sessions: Vec<SessionId> = (0..4).map(|_| SessionId::new()).collect();
        let mut model = vec![0u64; sessions.len()];
        let mut tail = Tail::open(&conn).unwrap();
        let mut heads = Heads::default();
        for op in ops {
            match op {
                Op::Append { mask, n } => {
                    let b = batch(&sessions, mask, n, &mut model);
                    log::append_batch(&mut conn, &mut heads, &mut tail, &b).unwrap();
                }
                Op::WriteOldest(cap) => {
                    tail.write_cap = cap;
                    tail.write_oldest(&conn).unwrap();
                }
                Op::Read(i) => {
                    tail.write_session(&conn, sessions[i]).unwrap();
                    let head = log::head(&conn, sessions[i]).unwrap();
                    prop_assert_eq!(head.last_seq, model[i]);
                }
                Op::Crash => {
                    heads = Heads::default();
                    tail = Tail::open(&conn).unwrap();
                }
            }
            mark_holds(&conn);
            tail.assert_consistent();
        }
        tail = Tail::open(&conn).unwrap();
        check(&conn, &mut tail, &sessions, &model);
        let (log, index): (i64, i64) = conn
            .query_row(
                "SELECT (SELECT COUNT(*) FROM log), (SELECT COUNT(*) FROM log_index)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        prop_assert_eq!(log, index);
    }
}
