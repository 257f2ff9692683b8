//! The lifecycle's time bounds under paused time: tokio's clock is virtual
//! here, so each bound is checked exactly, in no real time at all.

use std::sync::Arc;
use std::time::Duration;

use tiller_core::{ErrorKind, Origin, StopReason, Terminal};
use tiller_test_support::{
    AnsweringScripted, session_config, sessions, sessions_on, virtual_elapsed,
};

/// A script whose engine ignores the abort: only its teardown ends it.
const HANG: &str = r#"{"script": [{"hang": true}]}"#;

/// A session running a turn whose engine stays silent for ten minutes,
/// far past every bound; the turn's terminal comes on the receiver.
async fn silent_turn(
    dir: &tempfile::TempDir,
) -> (
    tiller_session::SessionHandle,
    tokio::sync::oneshot::Receiver<tiller_session::Settlement>,
) {
    let (s, _store) = sessions(dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"sleep_ms": 600000}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    (h, rx)
}

#[tokio::test(start_paused = true)]
async fn a_silent_engine_settles_stalled_at_the_stall_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (_h, rx) = silent_turn(&dir).await;
    let (done, took) = virtual_elapsed(rx).await;
    assert_eq!(done.unwrap().terminal, Terminal::failed(ErrorKind::Stalled));
    let bound = Duration::from_millis(session_config().turn.stall_timeout);
    assert!(took >= bound, "settled early: {took:?}");
    assert!(
        took < bound + Duration::from_millis(50),
        "settled late: {took:?}"
    );
}

/// A turn of `script` on `engine`, and its terminal's receiver.
async fn turn_on(
    dir: &tempfile::TempDir,
    engine: Arc<dyn tiller_engine::Engine>,
    script: &str,
) -> (
    tiller_session::SessionHandle,
    tokio::sync::oneshot::Receiver<tiller_session::Settlement>,
) {
    let (s, _store) = sessions_on(dir, engine, session_config()).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
        .prompt(script.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    (h, rx)
}

/// A prompt refused once a deadline has passed (the session closing, its
/// turn's cancel grace over, the timer's tick not handled yet) still has
/// the rest of its step carried out: the cancelled turn settles then. The
/// close waits on the store, so paused time jumps to the grace meanwhile,
/// with the prompt already in the mailbox ahead of the tick. The engine
/// ignores the abort and acts on its own (as a hosted agent), so only the
/// grace settles the turn.
#[tokio::test(start_paused = true)]
async fn a_prompt_refused_past_a_deadline_still_settles_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (h, rx) = turn_on(&dir, Arc::new(AnsweringScripted), HANG).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.cancel().unwrap();
    let (closed, refused) = tokio::join!(h.close(), h.prompt("hello".into(), Origin::Interactive));
    closed.unwrap();
    assert!(matches!(
        refused.unwrap(),
        Err(tiller_session::PromptRefused::SessionClosed)
    ));
    let (done, _) = virtual_elapsed(rx).await;
    assert_eq!(
        done.expect("the turn's settlement").terminal,
        Terminal::Completed(StopReason::Cancelled)
    );
}

/// A steer taken by a turn in the same step as the turn's stall bound ends
/// it (the tick still behind it in the mailbox) is stored under the prompt
/// of the turn that took it, not under the next prompt that started then.
/// The queued prompt's admission waits on the store, so paused time jumps
/// to the stall bound meanwhile, with the steer already in the mailbox.
#[tokio::test(start_paused = true)]
async fn a_steer_taken_as_its_turn_stalls_is_stored_under_that_turn_s_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let h = s.create("/tmp".into(), None).await.unwrap();
    let silent = r#"{"script": [{"sleep_ms": 600000}]}"#;
    let (a, _a_done) = h
        .prompt(silent.into(), Origin::Interactive)
        .await
        .unwrap()
        .unwrap();
    let (queued, steered) = tokio::join!(
        h.prompt(silent.into(), Origin::Interactive),
        h.steer("look again".into(), true)
    );
    let (b, _b_done) = queued.unwrap().unwrap();
    let answer = steered.unwrap().unwrap();
    let tiller_core::SteerOutcome::Injected { turn } = answer.outcome else {
        panic!("{answer:?}");
    };
    let log = s.events_after(h.id(), 0, 1000).await.unwrap();
    let accepted: Vec<_> = log
        .iter()
        .filter(|e| matches!(e.body, tiller_session::EventBody::SteerAccepted { .. }))
        .collect();
    assert_eq!(accepted.len(), 1);
    assert_eq!(accepted[0].turn, Some(turn));
    assert_eq!(accepted[0].prompt, Some(a), "not b: {b}");
}
