//! Parking: an idle session's actor stops and only a record stays; the
//! handles edges hold keep working, its clients keep receiving, and
//! nothing sent while it parks is lost, doubled or reordered.

use std::sync::Arc;
use std::time::Duration;

use tiller_core::{Origin, StopReason, Terminal};
use tiller_engine::ScriptedEngine;
use tiller_session::{EventBody, Sessions};
use tiller_test_support::{Collect, kinds, parked};

/// Sessions that park as soon as they are idle and the sweep runs.
async fn sessions(dir: &tempfile::TempDir) -> Sessions {
    parking_after(dir, Duration::ZERO).await
}

/// Sessions that park once idle for `after` (the registry's own sweep
/// runs every half of it).
async fn parking_after(dir: &tempfile::TempDir, after: Duration) -> Sessions {
    let store = tiller_test_support::Store::open(&dir.path().join("t.db")).unwrap();
    let mut config = tiller_test_support::session_config();
    config.park_after = Some(after);
    config.max_sessions = 100;
    started(store, config).await
}

/// Sessions on the scripted engine over `store`.
async fn started(
    store: tiller_test_support::Store,
    config: tiller_session::SessionConfig,
) -> Sessions {
    Sessions::start(
        store,
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        config,
    )
    .await
    .unwrap()
}

async fn end_turn(h: &tiller_session::SessionHandle, text: &str) {
    let (_, settled) = h
        .prompt(text.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let done = tokio::time::timeout(Duration::from_secs(5), settled)
        .await
        .expect("settled in time")
        .unwrap();
    assert_eq!(done.terminal, Terminal::Completed(StopReason::EndTurn));
}

/// The event numbers a client saw: each once, in order, none missing.
fn contiguous(c: &Collect) {
    let seqs: Vec<u64> = c.events().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
}

#[tokio::test]
async fn an_idle_session_parks_and_its_next_prompt_wakes_it_under_the_same_handle() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    end_turn(&h, "hello").await;
    let first = seen.events().len();
    parked(&s, 1).await;
    assert_eq!(s.live().await, 1, "a parked session is still live");
    assert!(h.is_running(), "its handle is not stale");
    // The same handle wakes it; the attached client sees the next turn.
    end_turn(&h, "again").await;
    assert_eq!(s.parked().await, 0);
    let events = seen.events();
    assert!(events.len() > first, "the client saw the turn after waking");
    assert_eq!(
        kinds(&events[first..])[..2],
        ["prompt_started", "user_message"]
    );
    contiguous(&seen);
    // What it stored before parking is where it was.
    let stored = s.events_after(h.id(), 0, 1000).await.unwrap();
    assert_eq!(stored.len(), events.len());
    // A handle opened now reaches the same run.
    assert!(s.open(h.id()).await.unwrap().same_actor(&h));
}

#[tokio::test]
async fn a_session_with_a_turn_running_does_not_park() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, settled) = h
        .prompt(
            r#"{"script": [{"sleep_ms": 60000}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    for _ in 0..20 {
        s.park_idle();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(s.parked().await, 0);
    h.cancel().unwrap();
    let done = tokio::time::timeout(Duration::from_secs(5), settled)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.terminal, Terminal::Completed(StopReason::Cancelled));
    parked(&s, 1).await;
}

/// Prompts, snapshots and option reads race the sweep: every prompt gets
/// exactly one terminal, every call an answer, and the client sees every
/// event once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_sent_while_a_session_parks_is_lost_or_reordered() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    let sweeper = {
        let s = s.clone();
        tokio::spawn(async move {
            loop {
                s.park_idle();
                tokio::task::yield_now().await;
            }
        })
    };
    let reader = {
        let h = h.clone();
        tokio::spawn(async move {
            for _ in 0..300 {
                h.snapshot().await.expect("a snapshot");
                h.options().await.expect("the options");
            }
        })
    };
    let mut prompts = 0;
    for i in 0..150 {
        end_turn(&h, &format!("turn {i}")).await;
        prompts += 1;
        if i % 10 == 0 {
            // Give the sweep a chance to park it between turns.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    reader.await.unwrap();
    sweeper.abort();
    let events = seen.events();
    let ends = kinds(&events)
        .iter()
        .filter(|k| **k == "turn_complete")
        .count();
    assert_eq!(ends, prompts, "one terminal per prompt");
    contiguous(&seen);
    // The log holds exactly what the client saw.
    let stored = s.events_after(h.id(), 0, 100_000).await.unwrap();
    assert_eq!(stored.len(), events.len());
    // Each turn's user message is the text sent, in order.
    let texts: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::UserMessage { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    let sent: Vec<String> = (0..prompts).map(|i| format!("turn {i}")).collect();
    assert_eq!(texts, sent);
}

#[tokio::test]
async fn a_client_leaving_a_parked_session_does_not_wake_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    let sub = s.subscriber_id();
    h.subscribe(sub, Box::new(seen.clone())).await.unwrap();
    parked(&s, 1).await;
    h.unsubscribe(sub);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(s.parked().await, 1, "still parked");
    end_turn(&h, "after").await;
    assert!(seen.events().is_empty(), "a client that left gets nothing");
}

#[tokio::test]
async fn queued_work_wakes_a_parked_session() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    parked(&s, 1).await;
    s.notify(h.id(), "task-1".into(), "the build finished".into())
        .await
        .unwrap();
    for _ in 0..500 {
        if kinds(&seen.events()).contains(&"turn_complete") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let events = seen.events();
    let started = events.iter().find_map(|e| match &e.body {
        EventBody::PromptStarted { origin } => Some(origin.clone()),
        _ => None,
    });
    assert_eq!(started.as_deref(), Some("notification"));
    assert!(kinds(&events).contains(&"turn_complete"));
}

#[tokio::test]
async fn a_parked_session_is_deleted_and_its_handles_go_stale() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    end_turn(&h, "hello").await;
    parked(&s, 1).await;
    s.delete(h.id()).await.unwrap();
    assert_eq!(s.live().await, 0);
    assert_eq!(s.parked().await, 0);
    assert!(!h.is_running());
    assert!(s.open(h.id()).await.is_err());
}

#[tokio::test]
async fn a_message_waiting_for_a_parked_session_is_answered_when_the_registry_stops() {
    let dir = tempfile::tempdir().unwrap();
    let s = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    parked(&s, 1).await;
    // Its first poll leaves the message in the slot and asks the registry
    // to wake the session; the registry stops before it can.
    let mut snapshot = Box::pin(h.snapshot());
    assert!(futures::poll!(snapshot.as_mut()).is_pending());
    s.crash().await;
    let answer = tokio::time::timeout(Duration::from_secs(5), snapshot)
        .await
        .expect("answered, not left waiting");
    assert!(
        matches!(answer, Err(tiller_session::SessionError::Stopped)),
        "{answer:?}"
    );
    assert!(!h.is_running(), "its handles are stale");
    assert!(h.cancel().is_err(), "and later sends fail at once");
}

#[tokio::test]
async fn a_delete_racing_a_park_waits_for_the_actor_that_closes() {
    let dir = tempfile::tempdir().unwrap();
    // No sweep of the registry's own meanwhile: only the one below.
    let s = parking_after(&dir, Duration::from_secs(3600)).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let seen = Collect::default();
    h.subscribe(s.subscriber_id(), Box::new(seen.clone()))
        .await
        .unwrap();
    end_turn(&h, "hello").await;
    // Settled: it would park if asked.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The delete begins, and the session's answer to a sweep arrives right
    // behind it: it must not park under the delete.
    let woken = s.woken().await;
    let mut delete = Box::pin(s.delete(h.id()));
    assert!(futures::poll!(delete.as_mut()).is_pending());
    s.idle_now();
    delete.await.unwrap();
    assert_eq!(s.woken().await, woken, "it never parked, so never woke");
    assert_eq!(s.live().await, 0, "nothing of it runs once deleted");
    assert!(!h.is_running(), "its handles are stale");
    // Nothing it wrote outlives the delete.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(s.live().await, 0, "nothing of it started again");
    let left = s.events_after(h.id(), 0, 100).await.unwrap();
    assert!(left.is_empty(), "{left:?}");
    let closed = kinds(&seen.events())
        .iter()
        .filter(|k| **k == "session_closed")
        .count();
    assert_eq!(closed, 1, "the client saw it close once");
}

#[tokio::test]
async fn a_delete_its_caller_gave_up_on_leaves_the_session_usable() {
    let dir = tempfile::tempdir().unwrap();
    let s = parking_after(&dir, Duration::from_secs(3600)).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    // Given up before the registry answered: nothing was deleted.
    let mut delete = Box::pin(s.delete(h.id()));
    assert!(futures::poll!(delete.as_mut()).is_pending());
    drop(delete);
    let again = s.open(h.id()).await.expect("it opens");
    assert!(again.same_actor(&h));
    // Given up while it closes: it may be closed, and it can be deleted.
    let mut delete = Box::pin(s.delete(h.id()));
    assert!(futures::poll!(delete.as_mut()).is_pending());
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(futures::poll!(delete.as_mut()).is_pending());
    drop(delete);
    s.delete(h.id()).await.expect("deleted after all");
    assert!(s.open(h.id()).await.is_err());
}

/// A client whose going away detaches it, as a web client's does.
struct Leaves(
    Option<tiller_session::SessionHandle>,
    tiller_session::SubscriberId,
);

impl tiller_session::Subscriber for Leaves {
    fn deliver(&self, _: &Arc<tiller_session::EventRecord>) -> bool {
        true
    }
}

impl Drop for Leaves {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.unsubscribe(self.1);
        }
    }
}

#[test]
fn a_client_dropped_with_what_waited_for_a_parked_session_may_call_it() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let s = sessions(&dir).await;
            let h = s.create("/tmp".into(), None).await.unwrap();
            parked(&s, 1).await;
            // Its attach waits in the slot when the registry stops: it is
            // dropped, and its drop sends to the session.
            let sub = s.subscriber_id();
            let client = Box::new(Leaves(Some(h.clone()), sub));
            let mut attach = Box::pin(h.subscribe(sub, client));
            assert!(futures::poll!(attach.as_mut()).is_pending());
            s.crash().await;
            let answer = tokio::time::timeout(Duration::from_secs(5), attach).await;
            assert!(matches!(answer, Ok(Err(_))), "answered `Stopped`");
        });
        let _ = done.send(());
    });
    // A deadlock would hold this thread forever: the test fails instead.
    finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the session's slot is not locked while a dropped client calls it");
}

/// The stall bound a turn armed outlives the turn (its timer is kept, not
/// aborted: see `actor/wake.rs`); when it fires on the idle session it
/// wakes no one and does not count as input, so the session parks once it
/// has been idle for `park_after`, not that long after the stale tick.
/// (Paused time over an inline store: no thread to wait on, so the clock
/// moves only to timers.)
#[tokio::test(start_paused = true)]
async fn a_timer_outliving_its_turn_does_not_put_off_parking() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiller_test_support::Store::open_inline(&dir.path().join("t.db")).unwrap();
    let mut config = tiller_test_support::session_config();
    config.turn.stall_timeout = 60_000;
    config.park_after = Some(Duration::from_secs(60));
    let s = started(store, config).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    end_turn(&h, "hello").await;
    // The turn's timer fires at about 60 s, the session idle all along.
    tokio::time::sleep(Duration::from_millis(60_020)).await;
    parked(&s, 1).await;
}
