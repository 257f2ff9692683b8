//! Typed durability, end to end through the session actor and a real
//! store made to fail on demand: nothing is acknowledged or shown before
//! it is stored, a terminal is never reported as a success it was not,
//! and a failed session is rebuilt from its log without gaps.

use std::sync::Arc;
use std::time::Duration;

use tiller_core::{ErrorKind, Origin, PromptId, StopReason, Terminal};
use tiller_session::{Acknowledge, EventBody, PromptRefused, SessionError};
use tiller_test_support::{Collect, kinds, sessions};

/// The session's log once it holds an event `found` matches (a hang
/// detector, not a timing: `what` fails the test after 30 s).
async fn log_once(
    s: &tiller_session::Sessions,
    id: tiller_core::SessionId,
    what: &str,
    found: impl Fn(&tiller_session::EventRecord) -> bool,
) -> Vec<tiller_session::EventRecord> {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let log = s.events_after(id, 0, 1000).await.unwrap();
            if log.iter().any(&found) {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}"))
}

fn contiguous(seqs: &[u64]) -> bool {
    seqs.iter().copied().eq(1..=seqs.len() as u64)
}

/// The session's log, which holds exactly one terminal for `prompt`:
/// `turn_error` `store_unavailable`.
async fn settled_store_unavailable_once(
    s: &tiller_session::Sessions,
    id: tiller_core::SessionId,
    prompt: PromptId,
) -> Vec<tiller_session::EventRecord> {
    let log = s.events_after(id, 0, 1000).await.unwrap();
    let terminals: Vec<_> = log
        .iter()
        .filter(|e| e.prompt == Some(prompt))
        .filter(|e| {
            matches!(
                e.body,
                EventBody::TurnComplete { .. } | EventBody::TurnError { .. }
            )
        })
        .collect();
    assert_eq!(terminals.len(), 1, "{:?}", kinds(&log));
    assert!(
        matches!(&terminals[0].body, EventBody::TurnError { error_kind, .. } if error_kind == "store_unavailable"),
        "{:?}",
        terminals[0].body
    );
    log
}

/// `n` prompts of `script` sent to `h` (the first runs, the others queue
/// behind it), with their terminals' ports.
async fn queued(
    h: &tiller_session::SessionHandle,
    script: &str,
    n: usize,
) -> Vec<(
    PromptId,
    tokio::sync::oneshot::Receiver<tiller_session::Settlement>,
)> {
    let mut ports = Vec::new();
    for _ in 0..n {
        ports.push(
            h.prompt(script.into(), Origin::Interactive)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    ports
}

#[tokio::test]
async fn a_prompt_the_store_cannot_record_is_refused_and_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    store.fail_appends(true);
    let refused = h.prompt("hello".into(), Origin::Interactive).await.unwrap();
    assert!(
        matches!(refused, Err(PromptRefused::StoreUnavailable)),
        "{refused:?}"
    );
    assert!(seen.events().is_empty(), "{:?}", kinds(&seen.events()));
    store.fail_appends(false);
    // The session is rebuilt from the store and works again.
    let h = s.open(h.id()).await.unwrap();
    let (_, rx) = h
        .prompt("hello".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    assert_eq!(
        kinds(&log)
            .iter()
            .filter(|k| **k == "prompt_started")
            .count(),
        1
    );
}

#[tokio::test]
async fn a_terminal_the_store_cannot_record_is_never_reported_as_success() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (prompt, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    let done = rx.await.unwrap();
    assert_eq!(done.prompt, prompt);
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
    // Once the store is back the log says the same, exactly once.
    let _h = s.open(h.id()).await.unwrap();
    let log = settled_store_unavailable_once(&s, h.id(), prompt).await;
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
}

/// A failed session whose prompt could not be settled (the store was
/// down) keeps how it is to be settled through a delete that fails: once
/// the store is back, opening it records the prompt's `store_unavailable`
/// terminal. (Its hint was once dropped by any end of a delete, and the
/// prompt stayed unsettled until the daemon restarted.)
#[tokio::test]
async fn a_failed_delete_leaves_a_failed_session_s_prompt_to_be_settled() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (prompt, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::failed(ErrorKind::StoreUnavailable)
    );
    // Its actor failed and its prompt could not be settled: it cannot be
    // opened while the store is down. (A hang detector, not a timing.)
    tokio::time::timeout(Duration::from_secs(30), async {
        while s.open(h.id()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the failed session is no longer served");
    store.fail_deletes(true);
    assert!(s.delete(h.id()).await.is_err(), "the delete fails");
    store.fail_deletes(false);
    store.fail_appends(false);
    let _h = s.open(h.id()).await.unwrap();
    settled_store_unavailable_once(&s, h.id(), prompt).await;
}

#[tokio::test]
async fn a_brief_store_outage_costs_a_turn_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 200}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    // The outage swallows "b" (appended without waiting); the terminal's
    // retry re-sends it once the store is back.
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    tokio::time::sleep(Duration::from_millis(250)).await;
    store.fail_appends(false);
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    // The log holds exactly what the client was shown, same numbers.
    let shown: Vec<(u64, &str)> = seen
        .events()
        .iter()
        .map(|e| (e.seq, e.body.kind()))
        .collect();
    let stored: Vec<(u64, &str)> = log.iter().map(|e| (e.seq, e.body.kind())).collect();
    assert_eq!(shown, stored);
    assert_eq!(*kinds(&log).last().unwrap(), "turn_complete");
}

#[tokio::test]
async fn a_close_the_store_cannot_record_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    store.fail_appends(true);
    let e = h.close().await.unwrap_err();
    assert!(e.to_string().contains("log"), "{e}");
    store.fail_appends(false);
    // Not closed: it is still listed and opens.
    let listed = s.list(None, 10).await.unwrap();
    assert!(listed.sessions.iter().any(|r| r.id == h.id()));
    // Closed again once the store is back, it is closed.
    let h = s.open(h.id()).await.unwrap();
    h.close().await.unwrap();
    let listed = s.list(None, 10).await.unwrap();
    assert!(
        !listed.sessions.iter().any(|r| r.id == h.id()),
        "closed, yet listed"
    );
}

/// A close whose event was stored but not the session's closed mark is
/// an error; closed again (by the actor started afresh), the log says
/// `session_closed` once and the session is closed (the event was
/// published twice).
#[tokio::test]
async fn a_close_stored_half_is_finished_by_the_next_without_a_second_event() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    store.fail_closes(true);
    assert!(h.close().await.is_err());
    store.fail_closes(false);
    assert!(store.switched_failures() > 0, "the close never failed");
    let listed = s.list(None, 10).await.unwrap();
    assert!(listed.sessions.iter().any(|r| r.id == h.id()), "not closed");
    let again = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match s.open(h.id()).await.unwrap().close().await {
                Err(SessionError::Stopped) => tokio::time::sleep(Duration::from_millis(10)).await,
                r => return r,
            }
        }
    })
    .await
    .expect("closed again");
    assert!(again.is_ok(), "{again:?}");
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let closes = log
        .iter()
        .filter(|e| matches!(e.body, EventBody::SessionClosed))
        .count();
    assert_eq!(closes, 1, "{:?}", kinds(&log));
    let listed = s.list(None, 10).await.unwrap();
    assert!(!listed.sessions.iter().any(|r| r.id == h.id()), "closed");
}

#[tokio::test]
async fn a_notification_whose_start_was_never_stored_is_still_queued_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    // The start of the notification's turn is lost, as in a crash between
    // taking it off the queue and storing its start.
    store.fail_appends(true);
    s.notify(
        h.id(),
        "t1".into(),
        r#"{"script": [{"say": "ran t1"}]}"#.into(),
    )
    .await
    .unwrap();
    // Longer than the terminal's retries: the session fails.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    store.fail_appends(false);
    // The queue still holds it, and it runs once the session is back (a
    // prompt's end is when an idle session polls its queues).
    let h = s.open(h.id()).await.unwrap();
    let (_, rx) = h
        .prompt("hello".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    rx.await.unwrap();
    let mut ran = false;
    for _ in 0..100 {
        let log = s.events_after(h.id(), 0, 1000).await.unwrap();
        ran = log.iter().any(
            |e| matches!(&e.body, EventBody::UserMessage { text, .. } if text.contains("ran t1")),
        ) && log.iter().any(|e| e.body.kind() == "turn_complete");
        if ran {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ran, "the notification was lost");
}

/// A goal change is answered once its event is in the log: a client that
/// reads the log after the answer finds it there, and one the store could
/// not record is an error, not a success.
#[tokio::test]
async fn a_goal_change_is_answered_only_once_its_event_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let last = |log: &[tiller_session::EventRecord]| log.last().map(|e| e.body.kind());
    // Without a goal there is nothing to pause or resume: `None`, not an
    // error.
    assert_eq!(s.goal_pause_resume(id, false).await.unwrap(), None);
    assert_eq!(s.goal_pause_resume(id, true).await.unwrap(), None);
    assert!(!s.goal_clear(id).await.unwrap());
    // A long turn keeps the goal's own turns from starting meanwhile.
    let (_, _done) = h
        .prompt(
            r#"{"script": [{"sleep_ms": 3000}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    s.goal_set(id, "keep going".into(), 3).await.unwrap();
    let log = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(last(&log), Some("goal_set"), "{:?}", kinds(&log));
    s.goal_pause_resume(id, false).await.unwrap().unwrap();
    let log = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(last(&log), Some("goal_paused"), "{:?}", kinds(&log));
    assert!(s.goal_clear(id).await.unwrap());
    let log = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(last(&log), Some("goal_cleared"), "{:?}", kinds(&log));
    // Not recorded: an error to the caller.
    s.goal_set(id, "again".into(), 3).await.unwrap();
    store.fail_appends(true);
    let cleared = s.goal_clear(id).await;
    assert!(cleared.is_err(), "{cleared:?}");
    store.fail_appends(false);
}

/// Events are shown once committed: whatever a viewer saw is in the log,
/// under the number it saw, even when the store failed mid-turn and the
/// session was rebuilt (no number is ever given to two events).
#[tokio::test]
async fn a_viewer_never_sees_an_event_the_log_does_not_keep() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}, {"say": "c"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    let done = rx.await.unwrap();
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
    // Rebuilt and reconciled from the log.
    let _h = s.open(h.id()).await.unwrap();
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let shown = seen.events();
    assert!(
        kinds(&shown).contains(&"agent_message_chunk"),
        "{:?}",
        kinds(&shown)
    );
    for e in &shown {
        let stored = log.iter().find(|l| l.seq == e.seq);
        assert_eq!(
            stored.map(|l| l.body.kind()),
            Some(e.body.kind()),
            "seq {} was shown as {} but the log has {:?}",
            e.seq,
            e.body.kind(),
            kinds(&log)
        );
    }
}

/// A store that falls behind slows the engine instead of growing the
/// daemon's memory: a session holds a bounded number of uncommitted
/// events, whatever the stream, and nothing is lost once the store
/// catches up. (Found by `tiller-load`: 1,000 sessions streaming faster
/// than the store commits grew the daemon to 24 GB.)
#[tokio::test]
async fn a_store_that_falls_behind_holds_the_engine_back_not_the_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let say = serde_json::json!([{ "say": "x" }]);
    let script = serde_json::json!({ "script": [
        { "repeat": { "times": 2, "steps": [{ "repeat": { "times": 10_000, "steps": say }}] } }
    ] })
    .to_string();
    // The admission commits before the turn starts: submit, then pause.
    let (_, settled) = h
        .prompt(script, Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    store.pause_appends(true);
    let mut most = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        most = most.max(store.backlog());
    }
    // Bounded by the session's pace (512 uncommitted events, plus what
    // one flush carries past it), nowhere near the 20,000 the engine
    // would have produced.
    assert!(most > 0, "the stream never reached the store");
    assert!(most <= 2_048, "{most} events waited for the store");
    store.pause_appends(false);
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let chunks = s
        .events_after(h.id(), 0, 30_000)
        .await
        .unwrap()
        .iter()
        .filter(|e| e.body.kind() == "agent_message_chunk")
        .count();
    assert_eq!(chunks, 20_000);
}

const THREE_CHUNKS: &str = r#"{"script": [{"say": "a"}, {"say": "b"}, {"say": "c"}]}"#;

/// A prompt whose one acknowledgement is its terminal (ACP's
/// `session/prompt`) is stored with its turn: its admission, content and
/// terminal take one commit, where a prompt acknowledged on admission (the
/// HTTP API's 202) takes two. Either way the ledger ends empty and the log
/// whole. (A session's first prompt, which titles it once it is stored,
/// is not counted.)
#[tokio::test]
async fn a_prompt_acknowledged_by_its_terminal_commits_once_with_its_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, settled) = submit(h.clone(), THREE_CHUNKS).await;
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    for (ack, commits) in [
        (Acknowledge::Terminal, 1),
        (Acknowledge::Admission, 2),
        (Acknowledge::Terminal, 1),
    ] {
        let before = store.append_commits();
        let (_, settled) = h
            .submit(
                PromptId::new(),
                (THREE_CHUNKS.into(), Vec::new()),
                Origin::Interactive,
                None,
                ack,
            )
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            settled.await.unwrap().terminal,
            Terminal::Completed(StopReason::EndTurn)
        );
        assert_eq!(store.append_commits() - before, commits, "{ack:?}");
    }
    assert!(store.unsettled().await.unwrap().is_empty());
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    let started = kinds(&log)
        .iter()
        .filter(|k| **k == "prompt_started")
        .count();
    assert_eq!(started, 4, "{:?}", kinds(&log));
}

/// Such a prompt is admitted without waiting for the store, but nothing
/// of it is shown before it is stored; and one the store cannot keep
/// ends `store_unavailable` (never a success), leaving nothing in the log
/// or the ledger. Its turn goes no further than streaming content: the
/// turn's first flush, or a tool batch, fails it at once (not after the
/// minute its script sleeps).
#[tokio::test]
async fn a_prompt_acknowledged_by_its_terminal_is_shown_only_once_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    store.pause_appends(true);
    let Ok((_, settled)) =
        tokio::time::timeout(Duration::from_secs(5), submit(h.clone(), THREE_CHUNKS)).await
    else {
        store.pause_appends(false);
        panic!("not admitted while the store held its appends back");
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(seen.events().is_empty(), "{:?}", kinds(&seen.events()));
    store.pause_appends(false);
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    assert_eq!(
        kinds(&seen.events()),
        [
            "prompt_started",
            "user_message",
            "session_info", // its first prompt titles the session
            "agent_message_chunk",
            "agent_message_chunk",
            "agent_message_chunk",
            "turn_complete"
        ]
    );

    let mut h = h;
    let mut lost = Vec::new();
    for script in [
        r#"{"script": [{"sleep_ms": 60000}, {"say": "late"}]}"#,
        r#"{"script": [{"tool": {"name": "probe"}}, {"sleep_ms": 60000}]}"#,
        THREE_CHUNKS,
    ] {
        store.fail_appends(true);
        let (prompt, settled) = submit(h.clone(), script).await;
        let done = tokio::time::timeout(Duration::from_secs(20), settled)
            .await
            .unwrap_or_else(|_| panic!("{script}: the turn ran on, its admission not stored"))
            .unwrap();
        assert_eq!(
            done.terminal,
            Terminal::failed(ErrorKind::StoreUnavailable),
            "{script}"
        );
        store.fail_appends(false);
        h = s.open(h.id()).await.unwrap();
        lost.push(prompt);
    }
    assert_eq!(seen.events().len(), 7, "{:?}", kinds(&seen.events()));
    let (_, settled) = submit(h.clone(), THREE_CHUNKS).await;
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    assert!(store.unsettled().await.unwrap().is_empty());
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    assert!(
        log.iter()
            .all(|e| !e.prompt.is_some_and(|p| lost.contains(&p))),
        "{:?}",
        kinds(&log)
    );
    for kind in ["prompt_started", "user_message", "turn_complete"] {
        let n = kinds(&log).iter().filter(|k| **k == kind).count();
        assert_eq!(n, 2, "{kind}: {:?}", kinds(&log));
    }
    assert!(!kinds(&log).contains(&"turn_error"), "{:?}", kinds(&log));
}

/// Sessions on a store of their own whose silent turns are not stopped
/// for two minutes: what ends the turns of the tests below is their
/// admission's failure, not the stall bound.
async fn patient_sessions(
    dir: &tempfile::TempDir,
) -> (tiller_session::Sessions, tiller_store::Store) {
    let store = tiller_store::Store::open(&dir.path().join("t.db")).unwrap();
    let mut config = tiller_test_support::session_config();
    config.turn.stall_timeout = 120_000;
    let engine = Arc::new(tiller_engine::ScriptedEngine);
    let s = tiller_session::Sessions::start(
        store.clone(),
        tiller_session::Engines::single(engine),
        config,
    )
    .await
    .unwrap();
    (s, store)
}

/// Submits `script` as an ACP prompt does (acknowledged by its terminal).
async fn submit(
    h: tiller_session::SessionHandle,
    script: &str,
) -> (
    PromptId,
    tokio::sync::oneshot::Receiver<tiller_session::Settlement>,
) {
    h.submit(
        PromptId::new(),
        (script.to_owned(), Vec::new()),
        Origin::Interactive,
        None,
        Acknowledge::Terminal,
    )
    .await
    .unwrap()
    .unwrap()
}

/// A prompt acknowledged by its terminal is not seen before its
/// admission is stored, and leaves nothing behind when that fails: no
/// snapshot shows it running while its admission is unstored, and a
/// session's first prompt titles the session only once it is stored.
#[tokio::test]
async fn an_unstored_admission_is_not_in_a_snapshot_and_does_not_title_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    // Titled by a first prompt: what waits below is the snapshot itself.
    let (_, settled) = submit(h.clone(), THREE_CHUNKS).await;
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    store.pause_appends(true);
    let (prompt, settled) = tokio::time::timeout(
        Duration::from_secs(5),
        submit(h.clone(), r#"{"script": [{"sleep_ms": 60000}]}"#),
    )
    .await
    .expect("admitted while the store held its appends back");
    let snapshot = tokio::spawn({
        let h = h.clone();
        async move { h.snapshot().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let early = snapshot.is_finished();
    store.pause_appends(false);
    let snapshot = snapshot.await.unwrap().unwrap();
    assert!(
        !early,
        "a snapshot showed the prompt running before its admission was stored"
    );
    assert_eq!(snapshot.active_prompt, Some(prompt));
    h.cancel().unwrap();
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::Cancelled)
    );

    let h = s.create("/tmp".into(), None).await.unwrap();
    store.fail_appends(true);
    let (_, settled) = submit(h.clone(), THREE_CHUNKS).await;
    let done = tokio::time::timeout(Duration::from_secs(20), settled)
        .await
        .expect("the turn ran on, its admission not stored")
        .unwrap();
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
    assert_eq!(
        s.record(h.id()).await.unwrap().title,
        None,
        "a prompt that was never stored titled the session"
    );
    let h = s.open(h.id()).await.unwrap();
    let (_, settled) = submit(h.clone(), THREE_CHUNKS).await;
    assert_eq!(
        settled.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    assert!(s.record(h.id()).await.unwrap().title.is_some());
}

/// A long stream whose streamed appends the store refuses (a full disk)
/// ends `store_unavailable` once the failure is known, not when the
/// stall bound (two minutes here) gives up on an engine held back for
/// commits that will never come. (Found by a review: a failed streamed
/// append told the session nothing.)
#[tokio::test]
async fn a_stream_the_store_refuses_ends_without_waiting_for_the_stall_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let settled = long_stream(&h).await;
    store.fail_appends(true);
    let done = ends(settled).await;
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
}

/// The same stream through a brief outage: what the failed commits lost
/// is sent again once the log reopens, and the turn ends whole.
#[tokio::test]
async fn a_long_stream_through_a_brief_store_outage_ends_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let settled = long_stream(&h).await;
    store.fail_appends(true);
    tokio::time::sleep(Duration::from_millis(150)).await;
    store.fail_appends(false);
    let done = ends(settled).await;
    assert_eq!(done.terminal, Terminal::Completed(StopReason::EndTurn));
    let log = s.events_after(h.id(), 0, 20_000).await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    let chunks = log
        .iter()
        .filter(|e| e.body.kind() == "agent_message_chunk")
        .count();
    assert_eq!(chunks, 10_000);
}

/// Prompts a 10,000-chunk stream, as the two tests above do.
async fn long_stream(
    h: &tiller_session::SessionHandle,
) -> tokio::sync::oneshot::Receiver<tiller_session::Settlement> {
    repeated(h, serde_json::json!([{ "say": "x" }])).await
}

/// Prompts `steps` repeated 10,000 times.
async fn repeated(
    h: &tiller_session::SessionHandle,
    steps: serde_json::Value,
) -> tokio::sync::oneshot::Receiver<tiller_session::Settlement> {
    let script = serde_json::json!({ "script": [
        { "repeat": { "times": 10_000, "steps": steps } }
    ] })
    .to_string();
    let (_, settled) = h
        .prompt(script, Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    settled
}

/// The turn's settlement. A hang detector, not a timing: the stall bound
/// of `patient_sessions` is 120 s.
async fn ends(
    settled: tokio::sync::oneshot::Receiver<tiller_session::Settlement>,
) -> tiller_session::Settlement {
    tokio::time::timeout(Duration::from_secs(60), settled)
        .await
        .expect("the turn ends before the stall bound")
        .unwrap()
}

/// A live session whose log is found damaged (set aside: its reads are
/// refused until it is deleted) stops growing: its stream's next commit is
/// refused with the repair, and the turn ends `store_unavailable` at once.
/// Deleting it (the repair) works whether its actor already stopped or is
/// idle and must close first, whose event the store refuses too. The other
/// sessions are untouched. (Left over from a review: a set-aside session
/// kept appending, unread; refusing that alone left its turn to the stall
/// bound and made its delete fail.)
#[tokio::test]
async fn a_session_set_aside_while_live_stops_growing_and_its_delete_repairs_it() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let streaming = s.create("/tmp".into(), None).await.unwrap();
    let idle = s.create("/tmp".into(), None).await.unwrap();
    let healthy = s.create("/tmp".into(), None).await.unwrap();
    // A stream of at least ten seconds, so it is still going when its log
    // is set aside.
    let settled = repeated(
        &streaming,
        serde_json::json!([{ "say": "x" }, { "sleep_ms": 1 }]),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    for h in [&streaming, &idle] {
        store.set_aside(h.id(), "damaged by a test").await.unwrap();
    }
    let done = ends(settled).await;
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    for h in [&streaming, &idle] {
        s.delete(h.id()).await.unwrap();
        assert!(
            matches!(s.open(h.id()).await, Err(SessionError::Unknown(_))),
            "deleted"
        );
        assert_eq!(
            store.history(h.id(), None, 10).await.unwrap().events,
            [],
            "nothing of it is left"
        );
    }
    let (_, rx) = healthy
        .prompt("hello".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
}

/// A session that fails with a prompt queued behind its turn tells that
/// prompt's owner what its log will say once reconciled, as it tells the
/// running one's: the failed actor's state, dropped without `post_stop`,
/// once dropped the port unsent (the ACP edge then answered
/// `session_restarted` while the log stored `store_unavailable`).
#[tokio::test]
async fn a_prompt_queued_in_a_failed_session_is_told_what_its_log_will_say() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (a, a_done) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    let (b, b_done) = h
        .prompt("hello".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    let failed = Terminal::failed(ErrorKind::StoreUnavailable);
    assert_eq!(a_done.await.unwrap().terminal, failed);
    // A hang detector, not a timing.
    let told = tokio::time::timeout(Duration::from_secs(30), b_done)
        .await
        .expect("the queued prompt's owner is told")
        .expect("told, not dropped");
    assert_eq!((told.prompt, told.terminal), (b, failed.clone()));
    store.fail_appends(false);
    let _h = s.open(h.id()).await.unwrap();
    settled_store_unavailable_once(&s, h.id(), a).await;
    settled_store_unavailable_once(&s, h.id(), b).await;
}

/// A cancel that settles two queued prompts while the store fails: the
/// first's terminal cannot be stored, the session fails, and the second's
/// `Settled` is never carried out; its owner is still told what its log
/// will say (its port left the core with that effect: it was dropped).
#[tokio::test]
async fn terminals_left_in_a_failing_step_are_told_what_the_log_will_say() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let slow = r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}]}"#;
    let mut ports = queued(&h, slow, 3).await;
    store.fail_appends(true);
    h.cancel().unwrap();
    let failed = Terminal::failed(ErrorKind::StoreUnavailable);
    for (prompt, done) in ports.drain(..) {
        // A hang detector, not a timing.
        let told = tokio::time::timeout(Duration::from_secs(30), done)
            .await
            .expect("its owner is told")
            .expect("told, not dropped");
        assert_eq!((told.prompt, told.terminal), (prompt, failed.clone()));
    }
    store.fail_appends(false);
    let _h = s.open(h.id()).await.unwrap();
}

/// A close whose step fails the session (a queued prompt's terminal cannot
/// be stored) writes nothing more: it answers with the failure, and the
/// log holds what the owners were told once it is reconciled, not the
/// close's own writes made once the store came back.
#[tokio::test]
async fn a_close_that_fails_its_session_stores_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let slow = r#"{"script": [{"say": "a"}, {"sleep_ms": 60000}]}"#;
    let mut ports = queued(&h, slow, 2).await;
    store.fail_appends(true);
    let closing = tokio::spawn({
        let h = h.clone();
        async move { h.close().await }
    });
    let failed = Terminal::failed(ErrorKind::StoreUnavailable);
    let (queued, done) = ports.pop().unwrap();
    // A hang detector, not a timing.
    let told = tokio::time::timeout(Duration::from_secs(30), done)
        .await
        .expect("the queued prompt's owner is told")
        .expect("told, not dropped");
    assert_eq!((told.prompt, told.terminal), (queued, failed));
    // The store is back while the close is answered.
    store.fail_appends(false);
    let closed = tokio::time::timeout(Duration::from_secs(30), closing)
        .await
        .expect("the close is answered")
        .unwrap();
    assert!(
        closed.is_err(),
        "a close that failed its session answered {closed:?}"
    );
    let h = s.open(h.id()).await.unwrap();
    let log = settled_store_unavailable_once(&s, h.id(), queued).await;
    settled_store_unavailable_once(&s, h.id(), ports[0].0).await;
    assert!(
        !kinds(&log).contains(&"session_closed"),
        "{:?}",
        kinds(&log)
    );
}

/// A damaged session with a prompt queued behind a quiet turn: the close
/// that its delete begins with settles the queued prompt, which the set
/// aside log refuses, and fails the session; the delete still goes on (it
/// is the repair), as it does when the close's own event is refused.
#[tokio::test]
async fn a_damaged_session_with_a_queued_prompt_is_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = patient_sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let slow = r#"{"script": [{"say": "a"}, {"sleep_ms": 60000}]}"#;
    let _ports = queued(&h, slow, 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.set_aside(h.id(), "damaged by a test").await.unwrap();
    let deleted = s.delete(h.id()).await;
    assert!(deleted.is_ok(), "{deleted:?}");
    assert!(
        matches!(s.open(h.id()).await, Err(SessionError::Unknown(_))),
        "deleted"
    );
}

/// A cron job whose removal cannot be stored is an error to the caller
/// (never "no such job"), and the job stays, as the store keeps it: it
/// neither stops firing until a restart nor fires again after one.
#[tokio::test]
async fn a_cron_removal_that_cannot_be_stored_is_an_error_and_the_job_stays() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let job = s
        .cron_add(h.id(), "0 3 * * *".into(), "UTC".into(), "nightly".into())
        .await
        .unwrap()
        .unwrap();
    store.fail_deletes(true);
    let removed = s.cron_remove(job.id.clone()).await;
    assert!(
        matches!(removed, Err(SessionError::Store(_))),
        "{removed:?}"
    );
    let ids: Vec<String> = s
        .cron_list()
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(ids, std::slice::from_ref(&job.id));
    store.fail_deletes(false);
    assert!(s.cron_remove(job.id.clone()).await.unwrap());
    assert!(s.cron_list().await.unwrap().is_empty());
    assert!(!s.cron_remove(job.id).await.unwrap(), "gone: no such job");
}

/// Closing a session ends its automatic work: its cron jobs go with it
/// (they stayed, and fired for nothing for good) and no new one is taken.
#[tokio::test]
async fn a_closed_sessions_cron_jobs_go_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let (h, other) = (
        s.create("/tmp".into(), None).await.unwrap(),
        s.create("/tmp".into(), None).await.unwrap(),
    );
    let add = |id| s.cron_add(id, "0 3 * * *".into(), "UTC".into(), "nightly".into());
    add(h.id()).await.unwrap().unwrap();
    let kept = add(other.id()).await.unwrap().unwrap();
    h.close().await.unwrap();
    let ids: Vec<String> = s
        .cron_list()
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(ids, [kept.id]);
    let late = add(h.id()).await;
    assert!(late.is_err(), "{late:?}");
}

/// A cron fire that cannot be stored (a full disk) is tried again after a
/// pause that grows, not at once in a loop (the cron actor spun on the
/// store, logging an error each time); it fires once the store is back.
#[tokio::test]
async fn a_cron_fire_that_cannot_be_stored_is_retried_after_a_pause() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    store.fail_appends(true);
    s.cron_add(h.id(), "* * * * * *".into(), "UTC".into(), "tick".into())
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let tries = store.cron_fire_calls();
    assert!((1..=6).contains(&tries), "{tries} tries in 2.5 s");
    store.fail_appends(false);
    log_once(&s, h.id(), "it fires once the store is back", |e| {
        matches!(e.body, EventBody::CronFired { .. })
    })
    .await;
}

/// A goal replaced while one of the old goal's turns runs starts afresh:
/// that turn is not charged to it (a new goal of one turn was completed
/// before any turn of its own ran).
#[tokio::test]
async fn a_goal_replaced_during_its_turn_is_not_charged_for_the_old_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let goal_turn = |e: &tiller_session::EventRecord| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "goal");
    s.goal_set(id, r#"{"script": [{"sleep_ms": 800}]}"#.into(), 5)
        .await
        .unwrap();
    log_once(&s, id, "the old goal's turn starts", goal_turn).await;
    s.goal_set(id, r#"{"script": [{"say": "new"}]}"#.into(), 1)
        .await
        .unwrap();
    let log = log_once(&s, id, "the new goal completes", |e| {
        matches!(e.body, EventBody::GoalCompleted { .. })
    })
    .await;
    let set = log
        .iter()
        .rposition(|e| matches!(e.body, EventBody::GoalSet { .. }))
        .unwrap();
    assert_eq!(
        log[set..].iter().filter(|e| goal_turn(e)).count(),
        1,
        "one turn of the new goal before it completed: {:?}",
        kinds(&log)
    );
}

/// A resume starts a goal's loop-stop count over: a turn stopped by loop
/// protection that was offered before the resume does not count against
/// the resumed goal (it did: one loop stop fewer to its next pause, and
/// its next turn told "the last turn was stopped by loop protection").
#[tokio::test]
async fn a_loop_stop_from_before_a_resume_does_not_count_against_the_resumed_goal() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let goal_turn = |e: &tiller_session::EventRecord| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "goal");
    let tool = r#"{"name": "read", "input": {"p": 1}, "output": "same"}"#;
    let looping = format!(
        r#"{{"script": [{{"sleep_ms": 400}}, {{"tools": [{}]}}, {{"say": "never said"}}]}}"#,
        [tool; 6].join(", ")
    );
    s.goal_set(id, looping, 5).await.unwrap();
    log_once(&s, id, "the goal's turn starts", goal_turn).await;
    s.goal_pause_resume(id, false).await.unwrap().unwrap();
    s.goal_pause_resume(id, true).await.unwrap().unwrap();
    let counted = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let g = s.goal_get(id).await.unwrap().unwrap();
            if g.turns_done >= 1 {
                return g;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the turn is counted");
    let log = s.events_after(id, 0, 1000).await.unwrap();
    assert!(
        log.iter().any(|e| matches!(
            e.body,
            EventBody::TurnError { .. } | EventBody::TurnComplete { .. }
        )),
        "{:?}",
        kinds(&log)
    );
    assert_eq!((counted.turns_done, counted.loop_stops), (1, 0));
}

/// A goal turn whose end the store cannot count is not forgotten: the
/// goal offers nothing until it is counted (tried again after a pause),
/// then goes on, each turn counted once. It was taken for a cleared goal:
/// the turn went uncounted and the session, told "nothing due" by the
/// failed read of its next poll, waited for a kick that never came.
#[tokio::test]
async fn a_goal_turn_the_store_cannot_count_is_counted_once_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let goal_turn = |e: &tiller_session::EventRecord| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "goal");
    s.goal_set(id, r#"{"script": [{"sleep_ms": 300}]}"#.into(), 3)
        .await
        .unwrap();
    log_once(&s, id, "the goal's first turn starts", goal_turn).await;
    store.fail_goals(true, true);
    // The turn ends meanwhile: its count and the next poll fail.
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.fail_goals(false, false);
    assert!(store.switched_failures() > 0, "the store never failed");
    let log = log_once(&s, id, "the goal completes", |e| {
        matches!(e.body, EventBody::GoalCompleted { turns_done: 3 })
    })
    .await;
    assert_eq!(
        log.iter().filter(|e| goal_turn(e)).count(),
        3,
        "{:?}",
        kinds(&log)
    );
}

/// A goal turn's count whose write landed though its answer was lost (a
/// connection to PostgreSQL dropped during `COMMIT`) is not counted again
/// when it is tried again: the goal of three turns runs three (it ran two,
/// the first counted twice).
#[tokio::test]
async fn a_goal_turn_whose_counts_answer_was_lost_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let goal_turn = |e: &tiller_session::EventRecord| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "goal");
    s.goal_set(id, r#"{"script": [{"sleep_ms": 300}]}"#.into(), 3)
        .await
        .unwrap();
    log_once(&s, id, "the goal's first turn starts", goal_turn).await;
    store.lose_goal_answers(true);
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.lose_goal_answers(false);
    assert!(store.switched_failures() > 0, "no answer was lost");
    let log = log_once(&s, id, "the goal completes", |e| {
        matches!(e.body, EventBody::GoalCompleted { .. })
    })
    .await;
    let completed = log
        .iter()
        .find_map(|e| match e.body {
            EventBody::GoalCompleted { turns_done } => Some(turns_done),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        (log.iter().filter(|e| goal_turn(e)).count(), completed),
        (3, 3),
        "{:?}",
        kinds(&log)
    );
}

/// While a goal turn's end waits to be counted (its write failed), the
/// goal offers no next turn: a goal of one turn runs one, even though its
/// reads work meanwhile.
#[tokio::test]
async fn a_goal_offers_nothing_while_its_last_turn_waits_to_be_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let goal_turn = |e: &tiller_session::EventRecord| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "goal");
    s.goal_set(id, r#"{"script": [{"sleep_ms": 300}]}"#.into(), 1)
        .await
        .unwrap();
    log_once(&s, id, "the goal's turn starts", goal_turn).await;
    store.fail_goals(false, true);
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.fail_goals(false, false);
    assert!(store.switched_failures() > 0, "the store never failed");
    log_once(&s, id, "the goal completes", |e| {
        matches!(e.body, EventBody::GoalCompleted { turns_done: 1 })
    })
    .await;
    // A second turn offered before the count would have started by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(
        log.iter().filter(|e| goal_turn(e)).count(),
        1,
        "{:?}",
        kinds(&log)
    );
}

/// A poll whose read of the goal fails is not "nothing due": the session
/// looks again after a pause, and the goal runs once the store is back
/// (it waited for a kick that never came).
#[tokio::test]
async fn a_goal_whose_read_fails_at_a_poll_runs_once_the_store_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"sleep_ms": 300}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    // Set while the user's turn runs; read when it ends, and that fails.
    s.goal_set(id, r#"{"script": [{"say": "on it"}]}"#.into(), 1)
        .await
        .unwrap();
    store.fail_goals(true, true);
    rx.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.fail_goals(false, false);
    assert!(store.switched_failures() > 0, "the store never failed");
    log_once(&s, id, "the goal completes", |e| {
        matches!(e.body, EventBody::GoalCompleted { .. })
    })
    .await;
}

/// On a store nodes share, a session's queued notification and cron fire
/// are read again at each poll; a read that fails is not "nothing due":
/// the session looks again after a pause, and the work runs once the
/// store is back (it waited for a kick that never came).
#[tokio::test]
async fn queued_work_whose_read_fails_at_a_poll_runs_once_the_store_is_back() {
    for origin in ["notification", "cron"] {
        let dir = tempfile::tempdir().unwrap();
        let (s, store) = sessions(&dir).await;
        let h = s.create("/tmp".into(), None).await.unwrap();
        let id = h.id();
        let (_, rx) = h
            .prompt(
                r#"{"script": [{"sleep_ms": 3000}]}"#.into(),
                Origin::Interactive,
            )
            .await
            .unwrap()
            .unwrap();
        // Queued while the user's turn runs.
        if origin == "notification" {
            s.notify(id, "t".into(), r#"{"script": [{"say": "noted"}]}"#.into())
                .await
                .unwrap();
        } else {
            // Once, within two seconds, inside the turn (no later fire kicks
            // the session).
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                + 2;
            let (sec, min, hour) = (at % 60, at / 60 % 60, at / 3600 % 24);
            s.cron_add(
                id,
                format!("{sec} {min} {hour} * * *"),
                "UTC".into(),
                "tick".into(),
            )
            .await
            .unwrap()
            .unwrap();
            log_once(&s, id, "the job fires", |e| {
                matches!(e.body, EventBody::CronFired { .. })
            })
            .await;
        }
        store.read_queues_as_if_shared();
        // Only this queue's reads fail (another's retry would kick it).
        store.fail_queue_reads(origin == "notification", origin == "cron");
        rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let failed = store.switched_failures();
        store.fail_queue_reads(false, false);
        assert!(failed > 0, "{origin}: the store never failed");
        log_once(
            &s,
            id,
            origin,
            |e| matches!(&e.body, EventBody::PromptStarted { origin: o } if o == origin),
        )
        .await;
    }
}

/// Work queued for a session whose actor failed (the store went down
/// mid-turn) runs once the store is back, with nobody opening the session
/// (it waited until a client happened to).
#[tokio::test]
async fn work_queued_for_a_failed_session_runs_once_the_store_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let id = h.id();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    // Queued behind the turn, stored.
    s.notify(id, "t".into(), r#"{"script": [{"say": "noted"}]}"#.into())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::failed(ErrorKind::StoreUnavailable)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.fail_appends(false);
    log_once(
        &s,
        id,
        "the queued notification runs",
        |e| matches!(&e.body, EventBody::PromptStarted { origin } if origin == "notification"),
    )
    .await;
}

/// A terminal whose commit was reported failed though it was stored (a
/// connection lost during `COMMIT`) is found in the log when the session
/// reopens it: its owner hears what the log says (it heard
/// `store_unavailable` of a turn the log says completed), and the session
/// goes on.
#[tokio::test]
async fn a_terminal_stored_despite_a_failed_commit_is_what_its_owner_hears() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (prompt, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 300}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.ambiguous_next_commit();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let terminals: Vec<_> = log
        .iter()
        .filter(|e| e.prompt == Some(prompt))
        .filter(|e| {
            matches!(
                e.body,
                EventBody::TurnComplete { .. } | EventBody::TurnError { .. }
            )
        })
        .map(|e| e.body.kind())
        .collect();
    assert_eq!(terminals, ["turn_complete"], "{:?}", kinds(&log));
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert!(contiguous(&seqs), "{seqs:?}");
    // The session goes on.
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"say": "next"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
}

/// An admission reported failed though it was stored (its commit's answer
/// lost, and no retry left for it) is admitted: its caller was refused a
/// prompt the log holds, which then settled `store_unavailable`.
#[tokio::test]
async fn an_admission_stored_despite_a_failed_commit_is_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    store.ambiguous_next_commit();
    let (prompt, rx) = h
        .prompt(r#"{"script": [{"say": "hi"}]}"#.into(), Origin::Interactive)
        .await
        .unwrap()
        .expect("admitted");
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let mine: Vec<&str> = log
        .iter()
        .filter(|e| e.prompt == Some(prompt))
        .map(|e| e.body.kind())
        .filter(|k| ["prompt_started", "turn_complete", "turn_error"].contains(k))
        .collect();
    assert_eq!(
        mine,
        ["prompt_started", "turn_complete"],
        "{:?}",
        kinds(&log)
    );
}
