//! A session's log lines name their session. The actor does not enter
//! the session's span for every message it handles (that cost the daemon
//! 8% of its CPU under load), so each line carries the session's id as a
//! field: it names the session even where a quieter filter leaves the
//! (info) session span out. These tests read what a real subscriber,
//! filtered at warn, writes.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tiller_core::{ErrorKind, Origin, Terminal};
use tiller_session::PromptRefused;
use tiller_test_support::sessions;

/// Everything logged by this test binary (one subscriber for the process:
/// the actors run on the runtime's threads).
fn logged() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || Sink(sink.clone()))
            .init();
        log
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The lines that contain `needle`.
fn lines_with(needle: &str) -> Vec<String> {
    let log = logged().lock().unwrap();
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_prompt_and_a_failed_terminal_are_logged_with_their_session_at_warn() {
    logged();
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let wait = Duration::from_secs(30);

    // Refused at admission (logged by the admission).
    let h = s.create("/tmp".into(), None).await.unwrap();
    store.fail_appends(true);
    let refused = h.prompt("hello".into(), Origin::Interactive).await.unwrap();
    assert!(
        matches!(refused, Err(PromptRefused::StoreUnavailable)),
        "{refused:?}"
    );
    store.fail_appends(false);
    let lines = lines_with("prompt refused: the store is unavailable");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&format!("session={}", h.id())),
        "{lines:?}"
    );

    // A terminal the store cannot record (logged by the durable append's
    // retries and its failure).
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
        .prompt(
            r#"{"script": [{"say": "a"}, {"sleep_ms": 2000}, {"say": "b"}]}"#.into(),
            Origin::Interactive,
        )
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.fail_appends(true);
    let done = tokio::time::timeout(wait, rx).await.unwrap().unwrap();
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
    let name = format!("session={}", h.id());
    let lines = lines_with(&name);
    for needed in [
        "store append failed",
        "durable append failed; retrying",
        "the session stops",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(needed)),
            "no {needed:?} naming {name}: {lines:?}"
        );
    }
    // Every line the session actor wrote names a session.
    let actor = lines_with("tiller_session::actor");
    assert!(actor.len() >= 3, "{actor:?}");
    assert!(actor.iter().all(|l| l.contains(" session=")), "{actor:?}");
}
