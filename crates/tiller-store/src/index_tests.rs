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
/// log that the index does not name; opening the store takes them back
/// into the waiting entries, so every read, the heads, the listing and
/// later appends see the whole log.
#[tokio::test]
async fn segments_left_unindexed_by_a_crash_wait_again_at_open() {
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
    assert_eq!(rows(&conn), (31, 31), "the deleted session left rows");
}

/// A store whose disk takes no more writes: reads of logs whose newest
/// entries wait to be indexed still answer whole (they merge the waiting
/// segments, they do not write them first), and after a process died
/// with entries waiting the store still opens and reads. Before, each
/// such read and the opening wrote the index first, so all of them
/// failed.
#[test]
fn reads_and_opening_write_nothing_so_a_full_disk_keeps_them() {
    use crate::db::{Db, Sqlite};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let open = || {
        let conn = Connection::open(&path).unwrap();
        crate::schema::migrate(&conn).unwrap();
        conn
    };
    let sessions: Vec<SessionId> = (0..3).map(|_| SessionId::new()).collect();
    let mut model = vec![0u64; sessions.len()];
    let mut db = Sqlite::new(open()).unwrap();
    let mut heads = Heads::default();
    for s in &sessions {
        db.create_session(&rec(*s), None).unwrap();
    }
    for (mask, n) in [(0b111, 40), (0b011, 9), (0b001, 30)] {
        let b = batch(&sessions, mask, n, &mut model);
        db.append_batch(&mut heads, &b).unwrap();
    }
    let full = |db: &mut Sqlite| {
        db.conn.pragma_update(None, "query_only", true).unwrap();
        for (i, s) in sessions.iter().enumerate() {
            let last = model[i];
            let head = db.head(*s).unwrap();
            assert_eq!((head.last_seq, head.last_turn), (last, last / 3));
            let (row, head) = db.get_session(*s).unwrap().expect("the session");
            assert_eq!((row.updated_ms, head.last_seq), (1_000 + last as i64, last));
            let page = db.history(*s, i64::MAX as u64, 10).unwrap();
            let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, (last - 9..=last).collect::<Vec<_>>());
            let after = db.events_after(*s, 5, 3).unwrap();
            assert_eq!(after.iter().map(|e| e.seq).collect::<Vec<_>>(), [6, 7, 8]);
            let newest = db.last_of_kinds(*s, &["turn_error"]).unwrap();
            assert_eq!(newest.map(|e| e.seq), Some(last - last % 7));
        }
        let listed = db.list_sessions(None, 10, None).unwrap();
        let mut updated: Vec<i64> = listed.sessions.iter().map(|r| r.updated_ms).collect();
        updated.sort_unstable();
        assert_eq!(updated, [1_040, 1_049, 1_079]);
    };
    full(&mut db);
    // The close cannot write the waiting entries either: what a process
    // that died leaves.
    drop(db);
    let conn = open();
    conn.pragma_update(None, "query_only", true).unwrap();
    let mut db = Sqlite::new(conn).expect("a store on a full disk opens");
    full(&mut db);
    // Space again: the log goes on, and the index catches up.
    db.conn.pragma_update(None, "query_only", false).unwrap();
    let b = batch(&sessions, 0b001, 1, &mut model);
    db.append_batch(&mut heads, &b).unwrap();
    drop(db);
    let conn = open();
    let (log, index) = rows(&conn);
    assert_eq!(log, index);
}

/// A session whose entries the index refuses (it already names one of
/// their segments: two segments claim the same events, which nothing is
/// known to make) is set aside: the other sessions' entries are still
/// written (upkeep and the close try each session alone), its reads are
/// refused with the repair to make rather than showing events twice,
/// the store still opens (it once refused to), and deleting the session
/// repairs it.
#[test]
fn a_session_the_index_refuses_is_set_aside_and_the_store_still_opens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let mut conn = Connection::open(&path).unwrap();
    crate::schema::migrate(&conn).unwrap();
    let sessions: Vec<SessionId> = (0..3).map(|_| SessionId::new()).collect();
    let mut model = vec![0u64; sessions.len()];
    let mut tail = Tail::open(&conn).unwrap();
    let mut heads = Heads::default();
    let b = batch(&sessions, 0b111, 20, &mut model);
    log::append_batch(&mut conn, &mut heads, &mut tail, &b).unwrap();
    let bad = sessions[1];
    let first = tail.of(bad)[0];
    // The entry names another session's row: deleting `bad` must leave it.
    let others = tail.of(sessions[0])[0].n;
    conn.execute(
        "INSERT INTO log_index (session_id, first_seq, last_seq, last_ts_ms, kinds, n)
         VALUES (?1, ?2, ?3, 0, 0, ?4)",
        rusqlite::params![
            bad.to_string(),
            first.first_seq as i64,
            first.last_seq as i64,
            others
        ],
    )
    .unwrap();
    let refused_read = |tail: &Tail| {
        let e = tail.readable(bad).expect_err("its reads are refused");
        let repair = format!("DELETE /api/sessions/{bad}?purge=true");
        assert!(
            matches!(&e, crate::StoreError::Damaged { session, .. } if *session == bad)
                && e.to_string().contains(&repair),
            "{e}"
        );
    };
    assert!(tail.write_oldest(&conn).is_err(), "the refusal is reported");
    for s in &sessions {
        assert_eq!(tail.of(*s).is_empty(), *s != bad, "session {s}");
    }
    assert!(tail.is_set_aside(bad));
    refused_read(&tail);
    tail.assert_consistent();
    // Passed over from then on, at upkeep and at the close; the others
    // read whole.
    let b = batch(&sessions, 0b111, 5, &mut model);
    log::append_batch(&mut conn, &mut heads, &mut tail, &b).unwrap();
    tail.write_oldest(&conn).unwrap();
    let b = batch(&sessions, 0b111, 5, &mut model);
    log::append_batch(&mut conn, &mut heads, &mut tail, &b).unwrap();
    tail.write_all(&conn).unwrap();
    for (i, s) in sessions.iter().enumerate() {
        assert_eq!(tail.of(*s).is_empty(), *s != bad, "session {s}");
        if *s != bad {
            check(&conn, &tail, *s, model[i]);
        }
    }
    // The next open finds the clash again, and sets the session aside
    // rather than refusing the store.
    let mut tail = Tail::open(&conn).expect("the store opens");
    assert!(tail.is_set_aside(bad));
    refused_read(&tail);
    assert_eq!(tail.of(bad).len(), 3, "every segment of it waits");
    let found = crate::index::damaged(&conn).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains(&bad.to_string()), "{found:?}");
    // The repair: the session deleted.
    crate::sessions::delete(&mut conn, bad, tail.of(bad)).unwrap();
    tail.forget(bad);
    tail.assert_consistent();
    let tail = Tail::open(&conn).unwrap();
    assert!(!tail.is_set_aside(bad));
    assert_eq!(tail.readable(bad).unwrap().len(), 0);
    assert_eq!(crate::index::damaged(&conn).unwrap(), Vec::<String>::new());
    let (log, index) = rows(&conn);
    assert_eq!((log, index), (6, 6));
    for (i, s) in sessions.iter().enumerate() {
        if *s != bad {
            check(&conn, &tail, *s, model[i]);
        }
    }
}

/// The close, too, writes the other sessions' entries when the index
/// refuses one session's.
#[test]
fn the_close_writes_the_others_when_the_index_refuses_one_session() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = Connection::open(dir.path().join("t.db")).unwrap();
    crate::schema::migrate(&conn).unwrap();
    let sessions: Vec<SessionId> = (0..3).map(|_| SessionId::new()).collect();
    let mut model = vec![0u64; sessions.len()];
    let mut tail = Tail::open(&conn).unwrap();
    let b = batch(&sessions, 0b111, 4, &mut model);
    log::append_batch(&mut conn, &mut Heads::default(), &mut tail, &b).unwrap();
    let bad = sessions[0];
    conn.execute(
        "INSERT INTO log_index (session_id, first_seq, last_seq, last_ts_ms, kinds, n)
         VALUES (?1, 1, 1, 0, 0, -1)",
        [bad.to_string()],
    )
    .unwrap();
    assert!(tail.write_all(&conn).is_err(), "the refusal is reported");
    for s in &sessions {
        assert_eq!(tail.of(*s).is_empty(), *s != bad, "session {s}");
    }
    assert!(tail.is_set_aside(bad));
    tail.assert_consistent();
}

/// Segments that hold the same events (a copy of a segment, or one
/// claiming events the index gives to another: nothing is known to make
/// either) set their session aside at open, where both copies once came
/// back into the waiting entries and every read showed the events twice;
/// a segment that names no session is left where it is, where it once
/// kept the store from opening. The other sessions open and go on, and
/// deleting a damaged one repairs the store. `damaged_logs` (what `tiller
/// doctor` runs) names them all.
#[tokio::test]
async fn damaged_segments_set_their_session_aside_and_the_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (a, b, c) = (SessionId::new(), SessionId::new(), SessionId::new());
    {
        let store = Store::open(&path).unwrap();
        // c's five events in one segment, the first in the log.
        store.create_session(rec(c)).await.unwrap();
        let five = (1..=5).map(|seq| (ev(c, seq), None)).collect();
        store.append_many(five, Arc::new(|_| {}));
        for s in [a, b] {
            store.create_session(rec(s)).await.unwrap();
            for seq in 1..=10 {
                // Each one's last prompt is left unsettled (a crash).
                let admit = (seq == 10).then(|| crate::LedgerOp::Admit {
                    prompt: PromptId::new(),
                    origin: "interactive".into(),
                    consumes: None,
                });
                store.append_durable(ev(s, seq), admit).await.unwrap();
            }
        }
        store.close().await;
    }
    assert_eq!(crate::damaged_logs(&path).unwrap(), Vec::<String>::new());
    let copy = |conn: &Connection, of: SessionId, id: String, first: &str| {
        conn.execute(
            &format!(
                "INSERT INTO log (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body)
                 SELECT ?2, {first}, last_seq, last_ts_ms, max_turn, kinds, body FROM log
                 WHERE n = (SELECT MAX(n) FROM log WHERE session_id = ?1)"
            ),
            [of.to_string(), id],
        )
        .unwrap();
    };
    {
        let conn = Connection::open(&path).unwrap();
        // What a crash leaves (a's last two segments and b's unindexed),
        // then a copy of a's newest segment, one naming no session, and
        // one claiming c's events 3 to 5.
        let upto: i64 = conn
            .query_row(
                "SELECT MAX(n) - 2 FROM log WHERE session_id = ?1",
                [a.to_string()],
                |r| r.get(0),
            )
            .unwrap();
        conn.execute("DELETE FROM log_index WHERE n > ?1", [upto])
            .unwrap();
        conn.execute("UPDATE log_indexed SET upto = ?1", [upto])
            .unwrap();
        copy(&conn, a, a.to_string(), "first_seq");
        copy(&conn, a, "not a session\n".into(), "first_seq");
        copy(&conn, c, c.to_string(), "3");
        // And c's row gone: its delete must still be the repair.
        conn.execute("DELETE FROM sessions WHERE id = ?1", [c.to_string()])
            .unwrap();
    }
    let found = crate::damaged_logs(&path).unwrap();
    assert_eq!(found.len(), 3, "{found:?}");
    for wanted in [
        format!("session {a}"),
        format!("session {c}"),
        "names no session".into(),
    ] {
        assert!(
            found.iter().any(|f| f.contains(&wanted)),
            "{wanted}: {found:?}"
        );
    }
    let store = Store::open(&path).expect("the store opens");
    for s in [a, c] {
        let refused = store.history(s, None, 100).await.expect_err("refused");
        assert!(
            matches!(&refused, crate::StoreError::Damaged { session, .. } if *session == s)
                && refused.to_string().contains("purge=true"),
            "{refused}"
        );
        assert!(store.get_session(s).await.is_err());
        assert!(store.reopen_log(s).await.is_err());
        assert!(store.events_after(s, 0, 10).await.is_err());
        assert!(store.last_of_kinds(s, &["turn_error"]).await.is_err());
        // Nor does it grow: its appends are refused with the repair, an
        // awaited one to its caller and a streamed one to its session.
        let refused = store
            .append_durable(ev(s, 1_000), None)
            .await
            .expect_err("its appends are refused");
        assert!(refused.to_string().contains("purge=true"), "{refused}");
        let (tx, rx) = std::sync::mpsc::channel();
        let tell: crate::OnCommit = Arc::new(move |r| {
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        store.append(ev(s, 1_001), None, Some(tell));
        store.flush().await.unwrap();
        let told = rx.try_recv().expect("the session is told");
        assert!(
            told.as_ref().is_err_and(|e| e.contains("purge=true")),
            "{told:?}"
        );
    }
    // Settling what the crash left (at start-up) reads each session's
    // log: a damaged one's prompt waits for its delete, rather than stop
    // the start-up.
    let unsettled: Vec<SessionId> = store
        .unsettled()
        .await
        .unwrap()
        .iter()
        .map(|u| u.session)
        .collect();
    assert_eq!(unsettled, [b]);
    let page = store.history(b, None, 100).await.unwrap();
    let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    store.append_durable(ev(b, 11), None).await.unwrap();
    for s in [a, c] {
        assert!(store.delete_session(s).await.unwrap(), "{s} was there");
    }
    store.close().await;
    let found = crate::damaged_logs(&path).unwrap();
    assert_eq!(
        found.len(),
        1,
        "only the nameless segment is left: {found:?}"
    );
    let store = Store::open(&path).unwrap();
    assert_eq!(store.history(a, None, 100).await.unwrap().events, []);
    assert_eq!(store.reopen_log(b).await.unwrap().last_seq, 11);
    store.close().await;
    let conn = Connection::open(&path).unwrap();
    assert_eq!(rows(&conn), (12, 11), "b's segments, and the nameless one");
}

/// A database a newer Tiller wrote (a schema version above this
/// binary's) is refused at open: this binary would neither know its
/// tables nor keep their rules (an older one would append without the
/// index and reuse segment numbers).
#[tokio::test]
async fn a_store_from_a_newer_tiller_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    Store::open(&path).unwrap().close().await;
    let newer = crate::schema::latest() + 1;
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", newer)
        .unwrap();
    let refused = Store::open(&path).err().expect("refused");
    assert!(
        matches!(&refused, crate::StoreError::Config(why) if why.contains("newer")),
        "{refused}"
    );
    let version: i64 = Connection::open(&path)
        .unwrap()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, newer, "nothing was migrated");
}

#[derive(Debug, Clone)]
enum Op {
    /// A commit of `n` events of each of the sessions in `mask`.
    Append { mask: u8, n: u64 },
    /// Upkeep: the oldest sessions' entries written, at most this many
    /// (a session's may be written in part).
    WriteOldest(usize),
    /// Reads of one session's log, on a disk that takes no write.
    Read(usize),
    /// A session's log deleted (it starts again from 1).
    Delete(usize),
    /// The process dies: entries waiting are lost, the log is not.
    Crash,
    /// A commit, and then upkeep, on a disk that takes no write: both
    /// fail, and nothing changes.
    Full { mask: u8, n: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..16, 1u64..100).prop_map(|(mask, n)| Op::Append { mask, n }),
        2 => (1usize..20).prop_map(Op::WriteOldest),
        2 => (0usize..4).prop_map(Op::Read),
        1 => (0usize..4).prop_map(Op::Delete),
        1 => Just(Op::Crash),
        1 => (1u8..16, 1u64..20).prop_map(|(mask, n)| Op::Full { mask, n }),
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

/// How many rows the log and its index hold.
fn rows(conn: &Connection) -> (i64, i64) {
    conn.query_row(
        "SELECT (SELECT COUNT(*) FROM log), (SELECT COUNT(*) FROM log_index)",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
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

/// Each session's log reads whole and in order, from the index and the
/// waiting entries together, and with no write (a full disk).
fn check(conn: &Connection, tail: &Tail, s: SessionId, last: u64) {
    conn.pragma_update(None, "query_only", true).unwrap();
    let waiting = tail.of(s);
    let page = log::history(conn, s, i64::MAX as u64, 100_000, waiting).unwrap();
    let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=last).collect::<Vec<_>>());
    assert_eq!(log::head(conn, s, waiting).unwrap().last_seq, last);
    // A short page from the middle, and its older neighbour.
    let before = last / 2 + 1;
    let page = log::history(conn, s, before, 5, waiting).unwrap();
    let want: Vec<u64> = (before.saturating_sub(5).max(1)..before).collect();
    let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, want);
    assert_eq!(page.has_more, want.first().is_some_and(|f| *f > 1));
    for after in [0, last / 3, last.saturating_sub(1), last] {
        let got = log::events_after(conn, s, after, 7, waiting).unwrap();
        let seqs: Vec<u64> = got.iter().map(|e| e.seq).collect();
        let want: Vec<u64> = (after + 1..=last).take(7).collect();
        assert_eq!(seqs, want, "after {after}");
    }
    let newest = log::last_of_kinds(conn, s, &["turn_error"], waiting).unwrap();
    assert_eq!(
        newest.map(|e| e.seq),
        Some(last - last % 7).filter(|n| *n > 0)
    );
    conn.pragma_update(None, "query_only", false).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under any interleaving of commits, upkeep, reads, deletes and
    /// crashes, the index behind the log never loses a segment nor names
    /// one twice, and reads (which write nothing) see every session's log
    /// whole.
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
                Op::Read(i) => check(&conn, &tail, sessions[i], model[i]),
                Op::Delete(i) => {
                    let s = sessions[i];
                    crate::sessions::delete(&mut conn, s, tail.of(s)).unwrap();
                    tail.forget(s);
                    heads.forget([s]);
                    model[i] = 0;
                }
                Op::Full { mask, n } => {
                    conn.pragma_update(None, "query_only", true).unwrap();
                    let mut lost = model.clone();
                    let b = batch(&sessions, mask, n, &mut lost);
                    prop_assert!(log::append_batch(&mut conn, &mut heads, &mut tail, &b).is_err());
                    let waiting = tail.clone_waiting();
                    tail.write_cap = 1024;
                    prop_assert!(tail.write_oldest(&conn).is_err() || waiting.is_empty());
                    prop_assert_eq!(tail.clone_waiting(), waiting);
                    conn.pragma_update(None, "query_only", false).unwrap();
                }
                Op::Crash => {
                    heads = Heads::default();
                    tail = Tail::open(&conn).unwrap();
                }
            }
            mark_holds(&conn);
            tail.assert_consistent();
            for s in &sessions {
                prop_assert!(!tail.is_set_aside(*s), "a healthy session set aside");
            }
        }
        tail = Tail::open(&conn).unwrap();
        for (i, s) in sessions.iter().enumerate() {
            prop_assert!(!tail.is_set_aside(*s), "a healthy session set aside");
            check(&conn, &tail, *s, model[i]);
        }
        tail.write_all(&conn).unwrap();
        let (log, index) = rows(&conn);
        prop_assert_eq!(log, index);
    }
}

/// Counts `tiller_store_append_failures_total` on the thread it is set on.
#[derive(Default)]
struct Failures(Arc<std::sync::atomic::AtomicU64>);

impl metrics::CounterFn for Failures {
    fn increment(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    fn absolute(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
}

impl metrics::Recorder for Failures {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == "tiller_store_append_failures_total" {
            metrics::Counter::from_arc(Arc::new(Failures(self.0.clone())))
        } else {
            metrics::Counter::noop()
        }
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// A damaged log's refused append is not a failure of the store: it is not
/// counted in `tiller_store_append_failures_total`, whose critical alert
/// says the store cannot write (free disk space); a store that cannot
/// write is. (An inline store commits on the caller's thread, where the
/// counting recorder is.)
#[test]
fn a_damaged_log_s_refusal_is_not_counted_as_a_store_failure() {
    let failures = Failures::default();
    let count = failures.0.clone();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&failures, || {
        runtime.block_on(async {
            let store = Store::open_inline(&path).unwrap();
            let (bad, good) = (SessionId::new(), SessionId::new());
            for s in [bad, good] {
                store.create_session(rec(s)).await.unwrap();
                store.append_durable(ev(s, 1), None).await.unwrap();
            }
            store.set_aside(bad, "a test").await.unwrap();
            let refused = store.append_durable(ev(bad, 2), None).await;
            assert!(refused.is_err_and(|e| e.is_damaged_log()));
            assert_eq!(
                count.load(Ordering::Relaxed),
                0,
                "a refusal is not a failure"
            );
            store.fail_appends(true);
            assert!(store.append_durable(ev(good, 2), None).await.is_err());
            assert_eq!(count.load(Ordering::Relaxed), 1, "a failed write is");
        });
    });
}

/// Many sessions streaming leave many entries waiting, a few each: one
/// upkeep then writes as many sessions' as a commit carries, so the index
/// keeps up with the log; fewer waiting, it writes a few sessions' (a
/// short stall for the commits queued meanwhile).
#[test]
fn far_behind_an_upkeep_writes_as_many_sessions_as_a_commit_carries() {
    use crate::index::{PENDING, SLICE, SLICE_BEHIND};
    let dir = tempfile::tempdir().unwrap();
    let mut conn = Connection::open(dir.path().join("t.db")).unwrap();
    crate::schema::migrate(&conn).unwrap();
    let sessions: Vec<SessionId> = (0..2100).map(|_| SessionId::new()).collect();
    let mut tail = Tail::open(&conn).unwrap();
    let mut heads = Heads::default();
    for seq in 1..=8u64 {
        let b: Vec<Pending> = sessions
            .iter()
            .map(|s| Pending {
                event: ev(*s, seq),
                ledger: None,
                reply: None,
                on_commit: None,
                joined: false,
            })
            .collect();
        log::append_batch(&mut conn, &mut heads, &mut tail, &b).unwrap();
    }
    let written = |tail: &Tail| sessions.iter().filter(|s| tail.of(**s).is_empty()).count();
    assert!(8 * sessions.len() > 2 * PENDING, "far behind");
    assert_eq!(written(&tail), 0);
    tail.write_oldest(&conn).unwrap();
    assert_eq!(written(&tail), SLICE_BEHIND);
    assert!(
        8 * (sessions.len() - SLICE_BEHIND) <= 2 * PENDING,
        "no longer far behind"
    );
    tail.write_oldest(&conn).unwrap();
    assert_eq!(written(&tail), SLICE_BEHIND + SLICE);
}
