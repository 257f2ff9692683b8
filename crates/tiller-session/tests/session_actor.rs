//! The session actor and registry, driven through the `Sessions` facade with
//! the scripted engine and a real store.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tiller_core::{ErrorKind, Origin, StopReason, Terminal};
use tiller_session::{EventBody, EventRecord, PromptRefused, Sessions};
use tiller_test_support::Collect;

async fn sessions(dir: &tempfile::TempDir) -> Sessions {
    tiller_test_support::sessions(dir).await.0
}

fn kinds(events: &[Arc<EventRecord>]) -> Vec<&'static str> {
    tiller_test_support::kinds(events)
}

#[tokio::test]
async fn demo_prompt_streams_and_completes_and_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sub = s.subscriber_id();
    assert_eq!(
        h.subscribe(sub, Box::new(Collect(seen.clone())))
            .await
            .unwrap()
            .last_seq,
        0
    );
    let (prompt, settled) = h
        .prompt("hello".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let done = settled.await.unwrap();
    assert_eq!(done.prompt, prompt);
    assert_eq!(done.terminal, Terminal::Completed(StopReason::EndTurn));
    let events = seen.lock().unwrap().clone();
    let k = kinds(&events);
    assert_eq!(k[..2], ["prompt_started", "user_message"]);
    assert_eq!(*k.last().unwrap(), "turn_complete");
    assert!(k.iter().filter(|k| **k == "agent_message_chunk").count() >= 2);
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let stored = s.events_after(h.id(), 0, 1000).await.unwrap();
    assert_eq!(stored.len(), events.len());
    assert_eq!(stored.last().unwrap().body, events.last().unwrap().body);
}

#[tokio::test]
async fn cancel_during_sleep_is_prompt_and_queued_prompts_are_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let sleep = r#"{"script": [{"sleep_ms": 60000}]}"#;
    let (_, first) = h
        .prompt(sleep.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let (_, second) = h
        .prompt(sleep.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let (_, third) = h
        .prompt(sleep.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let over = h.prompt(sleep.into(), Origin::Interactive).await.unwrap();
    assert!(matches!(over, Err(PromptRefused::Overloaded)));
    h.cancel().unwrap();
    let cancelled = Terminal::Completed(StopReason::Cancelled);
    for rx in [first, second, third] {
        let t = tokio::time::timeout(Duration::from_secs(1), rx)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(t.terminal, cancelled);
    }
}

#[tokio::test]
async fn hang_is_torn_down_after_cancel_grace_and_silence_stalls() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"hang": true}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    h.cancel().unwrap();
    let t = tokio::time::timeout(Duration::from_secs(2), rx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(t.terminal, Terminal::Completed(StopReason::Cancelled));

    let (_, rx) = h
        .prompt(
            r#"{"script": [{"hang": true}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    let t = tokio::time::timeout(Duration::from_secs(5), rx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(t.terminal, Terminal::failed(ErrorKind::Stalled));
}

/// A turn that ignores its abort (`hang`) on `engine`, with `grace` to
/// stop, cancelled: its registry (kept running), its handle, its terminal
/// and when the cancel was sent.
async fn cancel_a_hung_turn(
    dir: &tempfile::TempDir,
    engine: Arc<dyn tiller_engine::Engine>,
    grace: u64,
) -> (
    Sessions,
    tiller_session::SessionHandle,
    Terminal,
    std::time::Instant,
) {
    let mut config = tiller_test_support::session_config();
    config.turn.cancel_grace = grace;
    let (s, _store) = tiller_test_support::sessions_on(dir, engine, config).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"hang": true}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let cancelled_at = std::time::Instant::now();
    h.cancel().unwrap();
    let t = tokio::time::timeout(Duration::from_secs(20), rx)
        .await
        .expect("the cancelled turn settles within 20 s")
        .unwrap();
    (s, h, t.terminal, cancelled_at)
}

/// The scripted engine acts only through the session, so its cancelled
/// turn settles at the cancel, not at the engine's answer (or its grace).
/// This one ignores the abort (`hang`) and has a minute's grace: the
/// cancel is answered long before. A prompt sent then queues behind the
/// stopping engine and starts only at its teardown, never beside it.
#[tokio::test]
async fn a_cancelled_turn_settles_at_once_and_the_next_waits_for_its_engine() {
    for grace in [60_000, 200] {
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(tiller_engine::ScriptedEngine);
        let (_s, h, terminal, cancelled_at) = cancel_a_hung_turn(&dir, engine, grace).await;
        assert_eq!(terminal, Terminal::Completed(StopReason::Cancelled));
        if grace == 200 {
            let (_, rx) = h
                .prompt(
                    r#"{"script": [{"say": "next"}, {"result": "end_turn"}]}"#.into(),
                    Origin::Interactive,
                )
                .await
                .unwrap()
                .unwrap();
            let t = rx.await.unwrap();
            assert_eq!(t.terminal, Terminal::Completed(StopReason::EndTurn));
            assert!(
                cancelled_at.elapsed() >= Duration::from_millis(grace),
                "the next turn ran beside the stopping engine"
            );
        }
    }
}

/// An engine that acts on its own (as a hosted agent does) is answered
/// `cancelled` only once it says it stopped: this one never does, so its
/// turn settles at the grace, not before.
#[tokio::test]
async fn an_engine_acting_on_its_own_is_cancelled_at_its_answer_or_grace() {
    let dir = tempfile::tempdir().unwrap();
    let grace = tiller_test_support::session_config().turn.cancel_grace;
    let engine = Arc::new(tiller_test_support::AnsweringScripted);
    let (_s, _h, terminal, cancelled_at) = cancel_a_hung_turn(&dir, engine, grace).await;
    assert_eq!(terminal, Terminal::Completed(StopReason::Cancelled));
    assert!(
        cancelled_at.elapsed() >= Duration::from_millis(grace),
        "settled before the agent stopped"
    );
}

#[tokio::test]
async fn malformed_script_is_refused_and_the_session_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let bad = h
        .prompt(r#"{"script": [{"jump": 1}]}"#.into(), Origin::Interactive)
        .await
        .unwrap();
    match bad {
        Err(PromptRefused::Invalid(e)) => assert_eq!(e.path, "script[0]"),
        other => panic!("{other:?}"),
    }
    let (_, rx) = h
        .prompt(r#"{"script": [{"say": "ok"}]}"#.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
}

#[tokio::test]
async fn sessions_reload_after_restart_with_history_and_fresh_turn_ids() {
    let dir = tempfile::tempdir().unwrap();
    let id;
    {
        let s = sessions(&dir).await;
        let h = s.create("/w".into(), Some("t".into())).await.unwrap();
        id = h.id();
        let (_, rx) = h
            .prompt(
                r#"{"script": [{"say": "one"}]}"#.into(),
                Origin::Interactive,
            )
            .await
            .unwrap()
            .unwrap();
        rx.await.unwrap();
        s.shutdown().await;
    }
    let s = sessions(&dir).await;
    let page = s.list(None, 10).await.unwrap();
    assert_eq!(page.sessions.len(), 1);
    assert_eq!(page.sessions[0].id, id);
    let h = s.open(id).await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let last = h
        .subscribe(s.subscriber_id(), Box::new(Collect(seen.clone())))
        .await
        .unwrap()
        .last_seq;
    let history = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(history.len() as u64, last);
    assert!(
        history
            .iter()
            .any(|e| e.body == EventBody::AgentMessageChunk { text: "one".into() })
    );
    let (_, rx) = h
        .prompt("again".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    rx.await.unwrap();
    let live = seen.lock().unwrap().clone();
    assert_eq!(live[0].seq, last + 1, "no gap between replay and live");
    assert!(live[0].turn.is_none() || live[0].turn.unwrap().0 >= 2);
    assert!(
        live.iter().filter_map(|e| e.turn).all(|t| t.0 == 2),
        "turn ids continue after restart"
    );
}

#[tokio::test]
async fn closed_sessions_refuse_prompts_and_vanish_from_the_list() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    h.close().await.unwrap();
    assert!(s.list(None, 10).await.unwrap().sessions.is_empty());
    assert!(s.open(h.id()).await.is_err());
}

#[tokio::test]
async fn the_session_limit_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    for _ in 0..3 {
        s.create("/tmp".into(), None).await.unwrap();
    }
    assert!(s.create("/tmp".into(), None).await.is_err());
    assert_eq!(s.live().await, 3);
}

const SIX_IDENTICAL: &str = r#"{"script": [{"tools": [
    {"name": "read", "input": {"p": 1}, "output": "same"},
    {"name": "read", "input": {"p": 1}, "output": "same"},
    {"name": "read", "input": {"p": 1}, "output": "same"},
    {"name": "read", "input": {"p": 1}, "output": "same"},
    {"name": "read", "input": {"p": 1}, "output": "same"},
    {"name": "read", "input": {"p": 1}, "output": "same"}
]}, {"say": "never said"}]}"#;

#[tokio::test]
async fn an_interactive_loop_is_rejected_logged_and_the_queue_drains() {
    use tiller_core::LoopType;
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (looping, rx1) = h
        .prompt(SIX_IDENTICAL.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let (_, rx2) = h
        .prompt(
            r#"{"script": [{"say": "next"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    let t = rx1.await.unwrap().terminal;
    assert_eq!(
        t,
        Terminal::failed(ErrorKind::LoopDetected(
            LoopType::ConsecutiveIdenticalToolCalls
        ))
    );
    assert_eq!(
        rx2.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );

    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let mine: Vec<_> = log.iter().filter(|e| e.prompt == Some(looping)).collect();
    let completed = mine
        .iter()
        .filter(|e| {
            matches!(
                &e.body,
                EventBody::ToolCallUpdate {
                    status: tiller_session::ToolStatus::Completed,
                    ..
                }
            )
        })
        .count();
    let skipped = mine
        .iter()
        .filter(|e| {
            matches!(
                &e.body,
                EventBody::ToolCallUpdate {
                    status: tiller_session::ToolStatus::Failed,
                    error: Some(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!((completed, skipped), (4, 2));
    assert!(
        !mine
            .iter()
            .any(|e| matches!(&e.body, EventBody::AgentMessageChunk { .. })),
        "the engine stopped"
    );
    let err = mine
        .iter()
        .find(|e| e.body.kind() == "turn_error")
        .expect("turn_error in the log");
    assert_eq!(
        err.body,
        EventBody::TurnError {
            error_kind: "loop_detected".into(),
            message: ErrorKind::LoopDetected(LoopType::ConsecutiveIdenticalToolCalls)
                .default_message(),
            loop_type: Some("consecutive_identical_tool_calls".into()),
            code: Some("LOOP_DETECTED".into()),
        }
    );
}

#[tokio::test]
async fn an_automatic_loop_ends_the_turn_with_loop_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    for origin in [
        Origin::Cron,
        Origin::Notification,
        Origin::Channel,
        Origin::Goal,
    ] {
        let (p, rx) = h
            .prompt(SIX_IDENTICAL.into(), origin)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            rx.await.unwrap().terminal,
            Terminal::Completed(StopReason::EndTurn)
        );
        let log = s.events_after(h.id(), 0, 10_000).await.unwrap();
        let kinds: Vec<_> = log
            .iter()
            .filter(|e| e.prompt == Some(p))
            .map(|e| e.body.kind())
            .collect();
        let stopped = kinds
            .iter()
            .position(|k| *k == "loop_stopped")
            .expect("loop_stopped");
        assert_eq!(kinds[stopped + 1], "turn_complete", "{kinds:?}");
    }
}

#[tokio::test]
async fn in_flight_prompts_get_daemon_restarted_at_start_up() {
    // Simulate a crash: a prompt admitted in the ledger, never settled.
    let dir = tempfile::tempdir().unwrap();
    let id;
    let stuck;
    {
        let s = sessions(&dir).await;
        let h = s.create("/tmp".into(), None).await.unwrap();
        id = h.id();
        let (p, _rx) = h
            .prompt(
                r#"{"script": [{"hang": true}]}"#.into(),
                Origin::Interactive,
            )
            .await
            .unwrap()
            .unwrap();
        stuck = p;
        // No shutdown: the actors stop where they stand, like a killed
        // process (they would otherwise go on running beside the next
        // instance, e.g. the stall bound settling the prompt itself).
        s.crash().await;
    }
    let s = sessions(&dir).await;
    let log = s.events_after(id, 0, 1000).await.unwrap();
    let errors: Vec<_> = log
        .iter()
        .filter(|e| e.prompt == Some(stuck) && e.body.kind() == "turn_error")
        .collect();
    assert_eq!(errors.len(), 1);
    assert!(
        matches!(&errors[0].body, EventBody::TurnError { error_kind, .. } if error_kind == "daemon_restarted")
    );
    // A second start finds nothing left to reconcile.
    s.crash().await;
    let s = sessions(&dir).await;
    let again = s.events_after(id, 0, 1000).await.unwrap();
    assert_eq!(again.len(), log.len());
    // The snapshot shows the error while idle; a new prompt supersedes it.
    let h = s.open(id).await.unwrap();
    let snap = h.snapshot().await.unwrap();
    assert_eq!(snap.state, tiller_session::TurnState::Idle);
    assert_eq!(snap.last_turn_error.as_ref().unwrap().prompt, Some(stuck));
    let (_, rx) = h
        .prompt("hi".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    rx.await.unwrap();
    assert!(h.snapshot().await.unwrap().last_turn_error.is_none());
}

/// A session whose log is damaged (two segments holding the same events)
/// and has a prompt in flight does not stop the start-up, which settles
/// the other sessions' prompts; its reads are refused, and deleting it
/// repairs the store. Before, settling its prompt read its log and
/// `Sessions::start` failed.
#[tokio::test]
async fn a_damaged_session_with_a_prompt_in_flight_does_not_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let hang = || r#"{"script": [{"hang": true}]}"#.to_string();
    let (bad, good, stuck);
    {
        let (s, store) = tiller_test_support::sessions(&dir).await;
        let (b, g) = (
            s.create("/tmp".into(), None).await.unwrap(),
            s.create("/tmp".into(), None).await.unwrap(),
        );
        (bad, good) = (b.id(), g.id());
        b.prompt(hang(), Origin::Interactive)
            .await
            .unwrap()
            .unwrap();
        stuck = g
            .prompt(hang(), Origin::Interactive)
            .await
            .unwrap()
            .unwrap()
            .0;
        s.crash().await;
        store.close().await;
    }
    rusqlite::Connection::open(dir.path().join("t.db"))
        .unwrap()
        .execute(
            "INSERT INTO log (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body)
             SELECT session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body FROM log
             WHERE n = (SELECT MAX(n) FROM log WHERE session_id = ?1)",
            [bad.to_string()],
        )
        .unwrap();
    let s = sessions(&dir).await;
    let log = s.events_after(good, 0, 1000).await.unwrap();
    assert!(
        log.iter().any(|e| e.prompt == Some(stuck)
            && matches!(&e.body, EventBody::TurnError { error_kind, .. } if error_kind == "daemon_restarted")),
        "{:?}",
        log.iter().map(|e| e.body.kind()).collect::<Vec<_>>()
    );
    assert!(s.events_after(bad, 0, 1000).await.is_err());
    s.delete(bad).await.unwrap();
    assert!(s.open(bad).await.is_err());
    s.open(good).await.unwrap();
}

#[tokio::test]
async fn a_failed_session_settles_its_prompt_with_session_restarted_and_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let other = s.create("/tmp".into(), None).await.unwrap();
    let (stuck, rx) = h
        .prompt(
            r#"{"script": [{"hang": true}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    assert!(h.is_running());
    h.crash();
    assert!(rx.await.is_err(), "the owner learns the actor is gone");
    // A handle to the failed actor says so (an edge holding it opens the
    // session again instead of sending to the dead actor).
    assert!(!h.is_running());
    // The registry settled the in-flight prompt before the session reopens.
    let reopened = s.open(h.id()).await.unwrap();
    assert!(reopened.is_running() && !reopened.same_actor(&h));
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let errors: Vec<_> = log
        .iter()
        .filter(|e| e.prompt == Some(stuck) && e.body.kind() == "turn_error")
        .collect();
    assert_eq!(errors.len(), 1);
    assert!(
        matches!(&errors[0].body, EventBody::TurnError { error_kind, .. } if error_kind == "session_restarted")
    );
    // The session works again; the other session never noticed.
    let (_, rx) = reopened
        .prompt(
            r#"{"script": [{"say": "back"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    let (_, rx) = other
        .prompt("hi".into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rx.await.unwrap().terminal,
        Terminal::Completed(StopReason::EndTurn)
    );
    // The reloaded actor continued the log without gaps or reused numbers.
    let all = s.events_after(h.id(), 0, 1000).await.unwrap();
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=all.len() as u64).collect::<Vec<_>>());
    assert!(all.len() > log.len());
    assert_eq!(
        reopened.snapshot().await.unwrap().last_seq,
        all.len() as u64
    );
}

#[tokio::test]
async fn a_prompt_racing_a_close_is_refused_as_closed() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    h.close().await.unwrap();
    // The actor stops once closed; a handle taken before still answers
    // with the close, never `Stopped`.
    for _ in 0..50 {
        match h.prompt("hello".into(), Origin::Interactive).await {
            Ok(Err(PromptRefused::SessionClosed)) => {}
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A slow stream's chunks linger before they go to the store together
/// (at most `LINGER`): the last ones are shown while the turn still runs,
/// with no later event to carry them.
#[tokio::test]
async fn a_slow_stream_s_lingering_chunks_are_shown_while_the_turn_runs() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    h.subscribe(s.subscriber_id(), Box::new(Collect(seen.clone())))
        .await
        .unwrap();
    // A turn that ends while its last chunks linger (its terminal takes
    // them to the store; the linger's flush then finds nothing).
    let ends =
        r#"{"script": [{"repeat": {"times": 20, "steps": [{"say": "x"}, {"sleep_ms": 5}]}}]}"#;
    let (_, first) = h
        .prompt(ends.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let t = first.await.unwrap();
    assert_eq!(t.terminal, Terminal::Completed(StopReason::EndTurn));
    // Then, past the turn's first (eager) events, a chunk every 5 ms and
    // a long silence.
    let script = r#"{"script": [{"repeat": {"times": 20, "steps": [{"say": "x"}, {"sleep_ms": 5}]}}, {"sleep_ms": 60000}]}"#;
    seen.lock().unwrap().clear();
    let (_, settled) = h
        .prompt(script.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let chunks = || {
        kinds(&seen.lock().unwrap())
            .iter()
            .filter(|k| **k == "agent_message_chunk")
            .count()
    };
    let all = tokio::time::timeout(Duration::from_secs(10), async {
        while chunks() < 20 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(all.is_ok(), "only {} of 20 chunks shown", chunks());
    h.cancel().unwrap();
    let t = settled.await.unwrap();
    assert_eq!(t.terminal, Terminal::Completed(StopReason::Cancelled));
}
