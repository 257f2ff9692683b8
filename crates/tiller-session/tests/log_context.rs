//! A session's log lines name their session. The actor does not enter
//! the session's span for every message it handles (that cost the daemon
//! 8% of its CPU under load), so each line enters it itself; these tests
//! read what a real subscriber writes.

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
            .with_max_level(tracing::Level::INFO)
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
async fn a_refused_prompt_and_a_failed_terminal_are_logged_in_their_session() {
    logged();
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;

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
    assert!(!lines.is_empty(), "nothing logged");
    let name = format!("session{{session={}}}", h.id());
    assert!(lines.iter().all(|l| l.contains(&name)), "{lines:?}");

    // A terminal the store cannot record (logged by the durable append).
    let h = s.create("/tmp".into(), None).await.unwrap();
    let (_, rx) = h
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
    assert_eq!(done.terminal, Terminal::failed(ErrorKind::StoreUnavailable));
    store.fail_appends(false);
    let lines = lines_with("the session stops");
    let name = format!("session{{session={}}}", h.id());
    assert!(
        lines.iter().any(|l| l.contains(&name)),
        "no line names {name}: {lines:?}"
    );
    // The turn's own lines name the session too (its span's parent).
    let started = lines_with("turn started");
    assert!(
        started.iter().any(|l| l.contains(&name)),
        "no line names {name}: {started:?}"
    );
}
