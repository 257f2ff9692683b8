//! The model engine's turn loop against an in-process HTTP server that
//! streams the OpenAI wire format: the engine-level rules the end-to-end
//! tests do not reach (a steer during the final answer, a missing key,
//! tool calls cut off by max_tokens, abort during a retry's backoff).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tiller_core::{ErrorKind, SteerId, SteerReceipt, StopReason, TurnId};
use tiller_engine::model::{ModelConfig, ModelEngine, Provider};
use tiller_engine::{Engine, EngineInput, Message, SignalKind, TurnContext};
use tokio::sync::mpsc;

#[derive(Clone, Default)]
struct Mock {
    replies: Arc<Mutex<VecDeque<(u16, String)>>>,
    bodies: Arc<Mutex<Vec<Value>>>,
    /// A `Retry-After` value for error replies.
    retry_after: Arc<Mutex<Option<String>>>,
}

async fn chat(State(m): State<Mock>, body: String) -> Response {
    m.bodies
        .lock()
        .unwrap()
        .push(serde_json::from_str(&body).unwrap());
    // Slow enough that inputs sent at the start of a turn arrive first.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, text) = m
        .replies
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or((500, "{}".into()));
    let ct = if status == 200 {
        "text/event-stream"
    } else {
        "application/json"
    };
    let mut res = (
        StatusCode::from_u16(status).unwrap(),
        [(header::CONTENT_TYPE, ct)],
        text,
    )
        .into_response();
    if status != 200
        && let Some(v) = m.retry_after.lock().unwrap().clone()
    {
        res.headers_mut()
            .insert(header::RETRY_AFTER, v.parse().unwrap());
    }
    res
}

fn sse(chunks: &[Value]) -> String {
    let mut s: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    s.push_str("data: [DONE]\n\n");
    s
}

fn text(t: &str, finish: &str) -> String {
    sse(&[
        json!({"choices": [{"index": 0, "delta": {"content": t}}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
    ])
}

async fn serve(mock: Mock) -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(mock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/v1")
}

fn config(base_url: String) -> ModelConfig {
    ModelConfig {
        name: "test".into(),
        provider: Provider::OpenAi,
        base_url,
        model: "m".into(),
        models: vec![],
        api_key_env: None,
        max_tokens: None,
        temperature: None,
        system_prompt: None,
        system_prompt_append: None,
        request_timeout: Duration::from_secs(5),
        max_retries: 2,
        retry_base: Duration::from_millis(10),
        max_requests_per_turn: 10,
        context_chars: 100_000,
        context_window: 128_000,
        compact_at: 0.8,
        prices: None,
    }
}

/// Starts a turn; returns its input handle, the signals and the
/// conversation.
fn start(
    engine: &ModelEngine,
    prompt: &str,
) -> (
    tiller_engine::EngineHandle,
    mpsc::UnboundedReceiver<SignalKind>,
    tiller_engine::Conversation,
) {
    start_in(engine, prompt, tiller_engine::HostInfo::default())
}

/// [`start`] in a session with `host`'s directory.
fn start_in(
    engine: &ModelEngine,
    prompt: &str,
    host: tiller_engine::HostInfo,
) -> (
    tiller_engine::EngineHandle,
    mpsc::UnboundedReceiver<SignalKind>,
    tiller_engine::Conversation,
) {
    start_with(
        engine,
        prompt,
        TurnContext {
            host,
            ..TurnContext::default()
        },
    )
}

/// [`start`] with a turn context of the test's.
fn start_with(
    engine: &ModelEngine,
    prompt: &str,
    ctx: TurnContext,
) -> (
    tiller_engine::EngineHandle,
    mpsc::UnboundedReceiver<SignalKind>,
    tiller_engine::Conversation,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let conversation = ctx.conversation.clone();
    let sink: tiller_engine::SignalSink = Arc::new(move |s: tiller_engine::EngineSignal| {
        assert_eq!(s.turn, TurnId(1));
        let _ = tx.send(s.kind);
    });
    let prepared = engine.prepare(prompt).unwrap();
    (
        engine.start(TurnId(1), prepared, ctx, sink),
        rx,
        conversation,
    )
}

/// Signals until the turn's last one (`Idle` or `Failed`).
async fn until_end(rx: &mut mpsc::UnboundedReceiver<SignalKind>) -> Vec<SignalKind> {
    let mut out = Vec::new();
    loop {
        let s = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the turn ends")
            .expect("the engine runs");
        let end = matches!(s, SignalKind::Idle | SignalKind::Failed(..));
        out.push(s);
        if end {
            return out;
        }
    }
}

#[tokio::test]
async fn the_model_is_told_the_instructions_the_environment_and_the_project_rules() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("AGENTS.md"), "Always run `make check`.").unwrap();
    std::fs::write(dir.path().join("CLAUDE.md"), "CLAUDE-ONLY RULE").unwrap();
    let extra = tempfile::tempdir().unwrap();
    let mock = Mock::default();
    mock.replies
        .lock()
        .unwrap()
        .extend([(200, text("ok", "stop")), (200, text("ok", "stop"))]);
    let url = serve(mock.clone()).await;
    let host = tiller_engine::HostInfo {
        cwd: dir.path().to_owned(),
        roots: vec![extra.path().to_owned()],
        ..Default::default()
    };
    let engine = ModelEngine::new(config(url.clone()));
    let (_h, mut rx, _) = start_in(&engine, "hi", host.clone());
    until_end(&mut rx).await;
    // `system_prompt` replaces the instructions, `system_prompt_append`
    // adds to them; the environment and the rules stay.
    let engine = ModelEngine::new(ModelConfig {
        system_prompt: Some("You are terse.".into()),
        system_prompt_append: Some("Sign with -- T.".into()),
        ..config(url)
    });
    let (_h, mut rx, _) = start_in(&engine, "hi", host);
    until_end(&mut rx).await;

    let bodies = mock.bodies.lock().unwrap();
    let system = |i: usize| {
        let first = &bodies[i]["messages"][0];
        assert_eq!(first["role"], "system");
        first["content"].as_str().unwrap().to_owned()
    };
    let default = system(0);
    for want in [
        tiller_engine::model::instructions::DEFAULT
            .lines()
            .next()
            .unwrap(),
        &format!("Working directory: {}", dir.path().display()),
        &format!("Additional roots: {}", extra.path().display()),
        "OS: ",
        "Date: ",
        "Git repository: no",
        "# Project rules (AGENTS.md)",
        "Always run `make check`.",
    ] {
        assert!(default.contains(want), "{want:?} missing from:\n{default}");
    }
    assert!(!default.contains("CLAUDE-ONLY RULE"));
    let custom = system(1);
    assert!(custom.starts_with("You are terse.\n\nSign with -- T."));
    assert!(
        !custom.contains(
            tiller_engine::model::instructions::DEFAULT
                .lines()
                .next()
                .unwrap()
        )
    );
    assert!(custom.contains("Always run `make check`."));
}

#[tokio::test]
async fn a_steer_during_the_final_answer_gets_one_more_model_call() {
    let mock = Mock::default();
    mock.replies.lock().unwrap().extend([
        (200, text("Done.", "stop")),
        (200, text("Steered answer.", "stop")),
    ]);
    let engine = ModelEngine::new(config(serve(mock.clone()).await));
    let (h, mut rx, conversation) = start(&engine, "do it");
    // The steer arrives while the (final) answer is on its way.
    while mock.bodies.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let steer = SteerId::new();
    h.send(EngineInput::Steer {
        id: steer,
        text: "actually, be brief".into(),
    });
    let signals = until_end(&mut rx).await;
    assert!(signals.contains(&SignalKind::SteerReceipt(steer, SteerReceipt::Consumed)));
    assert_eq!(
        signals[signals.len() - 2..],
        [SignalKind::Result(StopReason::EndTurn), SignalKind::Idle]
    );
    let bodies = mock.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 2);
    let last = bodies[1]["messages"].as_array().unwrap();
    assert_eq!(last.last().unwrap()["content"], "actually, be brief");
    assert_eq!(
        conversation.snapshot().last(),
        Some(&Message::Assistant {
            text: "Steered answer.".into(),
            calls: vec![]
        })
    );
}

#[tokio::test]
async fn a_missing_key_fails_the_turn_naming_the_variable_and_sends_nothing() {
    let mock = Mock::default();
    let mut cfg = config(serve(mock.clone()).await);
    cfg.api_key_env = Some("TILLER_TEST_SURELY_UNSET_KEY".into());
    let engine = ModelEngine::new(cfg);
    let (_h, mut rx, _) = start(&engine, "hi");
    let signals = until_end(&mut rx).await;
    match signals.last() {
        Some(SignalKind::Failed(ErrorKind::ModelStreamInterrupted, m)) => {
            assert!(m.contains("TILLER_TEST_SURELY_UNSET_KEY"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    assert!(mock.bodies.lock().unwrap().is_empty());
}

/// A redirect to another origin (an open redirect at the provider, a
/// hijacked `base_url`) is not followed: the HTTP client drops only the
/// headers it knows (`Authorization`), and would send Anthropic's
/// `x-api-key` to the other host.
#[tokio::test]
async fn a_redirect_elsewhere_never_gets_the_key() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let other = {
        let seen = seen.clone();
        let app = Router::new().fallback(move |headers: axum::http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let mut seen = seen.lock().unwrap();
                seen.extend(headers.keys().map(|k| k.to_string()));
                seen.push("(a request)".into());
                StatusCode::NOT_FOUND
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    };
    let app = Router::new().fallback(move || async move {
        (
            StatusCode::TEMPORARY_REDIRECT,
            [(header::LOCATION, format!("http://{other}/v1/messages"))],
        )
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut cfg = config(format!("http://{addr}/v1"));
    cfg.provider = Provider::Anthropic;
    cfg.max_retries = 0;
    // Any variable that is set serves as the key.
    cfg.api_key_env = Some("PATH".into());
    let engine = ModelEngine::new(cfg);
    let (_h, mut rx, _) = start(&engine, "hi");
    let signals = until_end(&mut rx).await;
    assert!(
        matches!(signals.last(), Some(SignalKind::Failed(..))),
        "{signals:?}"
    );
    let seen = seen.lock().unwrap();
    assert!(!seen.iter().any(|h| h == "x-api-key"), "{seen:?}");
}

#[tokio::test]
async fn tool_calls_cut_off_by_max_tokens_never_run() {
    let mock = Mock::default();
    mock.replies.lock().unwrap().push_back((
        200,
        sse(&[
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "write_file", "arguments": "{\"path\": \"a"}}]}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        ]),
    ));
    let engine = ModelEngine::new(config(serve(mock.clone()).await));
    let (_h, mut rx, conversation) = start(&engine, "write");
    let signals = until_end(&mut rx).await;
    assert!(
        !signals
            .iter()
            .any(|s| matches!(s, SignalKind::ToolBatch(_)))
    );
    assert!(signals.contains(&SignalKind::Result(StopReason::MaxTokens)));
    assert!(
        conversation
            .snapshot()
            .iter()
            .all(|m| !matches!(m, Message::Assistant { calls, .. } if !calls.is_empty()))
    );
}

#[tokio::test]
async fn abort_during_a_retry_backoff_stops_at_once() {
    let mock = Mock::default();
    mock.replies
        .lock()
        .unwrap()
        .push_back((429, r#"{"error": {"message": "slow down"}}"#.into()));
    let mut cfg = config(serve(mock.clone()).await);
    cfg.retry_base = Duration::from_secs(30);
    let engine = ModelEngine::new(cfg);
    let (h, mut rx, _) = start(&engine, "hi");
    // Wait until the first call was answered (429), then abort.
    while mock.bodies.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.send(EngineInput::Abort);
    // (until_end gives up after 5 s; the backoff is 30 s.)
    let signals = until_end(&mut rx).await;
    assert_eq!(
        signals,
        [SignalKind::Result(StopReason::Cancelled), SignalKind::Idle]
    );
    assert_eq!(mock.bodies.lock().unwrap().len(), 1, "no retry after abort");
}

/// A server that sends an error's headers and then never the rest of its
/// body: the engine reading that body still stops at an abort (its turn's
/// next one waits for it), not at `request_timeout`.
#[tokio::test]
async fn abort_while_an_error_body_trickles_stops_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (asked_tx, asked) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = vec![0; 64 * 1024];
        let _ = conn.read(&mut buf).await;
        let head = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{";
        conn.write_all(head.as_bytes()).await.unwrap();
        let _ = asked_tx.send(());
        std::future::pending::<()>().await; // the rest never comes
        drop(conn);
    });
    let mut cfg = config(format!("http://{addr}/v1"));
    cfg.request_timeout = Duration::from_secs(60);
    let engine = ModelEngine::new(cfg);
    let (h, mut rx, _) = start(&engine, "hi");
    asked.await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.send(EngineInput::Abort);
    // (until_end gives up after 5 s; the body's bound is a minute.)
    assert_eq!(
        until_end(&mut rx).await,
        [SignalKind::Result(StopReason::Cancelled), SignalKind::Idle]
    );
}

#[tokio::test]
async fn a_retry_after_that_is_not_a_number_is_ignored_not_a_panic() {
    // `Retry-After: NaN` used to panic the engine's task (a Duration from
    // NaN), leaving its turn to the stall bound.
    for bogus in ["NaN", "inf", "-inf", "1e400"] {
        let mock = Mock::default();
        *mock.retry_after.lock().unwrap() = Some(bogus.into());
        mock.replies
            .lock()
            .unwrap()
            .extend([(429, "{}".into()), (200, text("Fine.", "stop"))]);
        let engine = ModelEngine::new(config(serve(mock.clone()).await));
        let (_h, mut rx, _) = start(&engine, "go");
        let signals = until_end(&mut rx).await;
        assert_eq!(
            signals[signals.len() - 2..],
            [SignalKind::Result(StopReason::EndTurn), SignalKind::Idle],
            "{bogus}"
        );
    }
}

/// A conversation of `turns` earlier turns of about 200 chars each.
fn history(turns: usize) -> tiller_engine::Conversation {
    let mut msgs = Vec::new();
    for i in 0..turns {
        msgs.push(Message::User {
            text: format!("old question {i} {}", "q".repeat(100)),
        });
        msgs.push(Message::Assistant {
            text: format!("old answer {i} {}", "a".repeat(100)),
            calls: vec![],
        });
    }
    tiller_engine::Conversation::new(msgs)
}

/// A model with a tiny window and short instructions: 4 earlier turns
/// (~900 chars) and the system text (~250) pass 80 % of 300 tokens (4
/// chars a token); a summary and one turn do not.
fn small_window(url: String) -> ModelConfig {
    ModelConfig {
        context_window: 300,
        system_prompt: Some("Be brief.".into()),
        ..config(url)
    }
}

fn compactions(signals: &[SignalKind]) -> Vec<tiller_engine::CompactionPhase> {
    signals
        .iter()
        .filter_map(|s| match s {
            SignalKind::Update(tiller_engine::Update::Compaction { phase, .. }) => {
                Some(phase.clone())
            }
            _ => None,
        })
        .collect()
}

fn contents(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test]
async fn a_conversation_past_the_threshold_is_summarized_once_and_the_summary_replaces_it() {
    use tiller_engine::CompactionPhase as P;
    let mock = Mock::default();
    mock.replies.lock().unwrap().extend([
        (200, text("## Goal\nShip it.", "stop")),
        (200, text("Answer.", "stop")),
        (200, text("Next answer.", "stop")),
    ]);
    let url = serve(mock.clone()).await;
    let engine = ModelEngine::new(small_window(url));
    let ctx = TurnContext {
        conversation: history(4),
        ..TurnContext::default()
    };
    let conversation = ctx.conversation.clone();
    let (_h, mut rx, _) = start_with(&engine, "new question", ctx);
    let signals = until_end(&mut rx).await;
    assert_eq!(
        compactions(&signals),
        [P::Started, P::Completed("## Goal\nShip it.".into())]
    );
    assert_eq!(
        signals[signals.len() - 2..],
        [SignalKind::Result(StopReason::EndTurn), SignalKind::Idle]
    );
    // The summary's text is not shown as the agent's.
    assert!(
        !signals.contains(&SignalKind::Update(tiller_engine::Update::Text(
            "## Goal\nShip it.".into()
        )))
    );
    {
        let bodies = mock.bodies.lock().unwrap();
        assert_eq!(bodies.len(), 2, "one summary call, one turn call");
        // The summary call: its own instructions, the old turns, no tools.
        let summary = contents(&bodies[0]);
        assert!(summary[0].contains("You summarize a coding session"));
        assert!(summary.iter().any(|m| m.starts_with("old question 0")));
        assert!(!summary.iter().any(|m| m == "new question"));
        assert_eq!(
            summary.last().unwrap(),
            tiller_engine::model::instructions::COMPACTION_REQUEST
        );
        assert!(bodies[0].get("tools").is_none());
        // The next call carries the summary, not the old turns.
        let turn = contents(&bodies[1]);
        assert!(turn[0].starts_with("Be brief."));
        assert!(turn[1].contains("compacted into this summary"));
        assert!(turn[1].ends_with("## Goal\nShip it."));
        assert!(!turn.iter().any(|m| m.starts_with("old ")));
        assert_eq!(turn[2], "new question");
    }
    let snap = conversation.snapshot();
    assert_eq!(snap.len(), 3, "summary, question, answer: {snap:?}");
    // The next turn is under the threshold: no summary call.
    let ctx = TurnContext {
        conversation,
        ..TurnContext::default()
    };
    let (_h, mut rx, _) = start_with(&engine, "and then?", ctx);
    let signals = until_end(&mut rx).await;
    assert!(compactions(&signals).is_empty());
    assert_eq!(mock.bodies.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn a_failed_summary_falls_back_to_the_window_and_says_so() {
    use tiller_engine::CompactionPhase as P;
    let mock = Mock::default();
    mock.replies.lock().unwrap().extend([
        (400, r#"{"error": {"message": "context too long"}}"#.into()),
        (200, text("Answer anyway.", "stop")),
    ]);
    let engine = ModelEngine::new(small_window(serve(mock.clone()).await));
    let ctx = TurnContext {
        conversation: history(4),
        ..TurnContext::default()
    };
    let conversation = ctx.conversation.clone();
    let (_h, mut rx, _) = start_with(&engine, "new question", ctx);
    let signals = until_end(&mut rx).await;
    let phases = compactions(&signals);
    assert_eq!(phases[0], P::Started);
    match &phases[1..] {
        [P::Failed(why)] => {
            assert!(why.contains("context too long"), "{why}");
            assert!(
                why.contains("left out of the context window instead"),
                "{why}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(signals.contains(&SignalKind::Result(StopReason::EndTurn)));
    let bodies = mock.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 2);
    assert!(contents(&bodies[1]).iter().any(|m| m == "new question"));
    // Nothing was replaced.
    assert!(
        matches!(&conversation.snapshot()[0], Message::User { text } if text.starts_with("old question 0"))
    );
}

#[tokio::test]
async fn a_cancel_during_a_compaction_cancels_it_and_the_turn() {
    use tiller_engine::CompactionPhase as P;
    let mock = Mock::default();
    // The summary call hangs (no reply queued: the server answers 500
    // after its delay; the abort comes first).
    let engine = ModelEngine::new(small_window(serve(mock.clone()).await));
    let ctx = TurnContext {
        conversation: history(4),
        ..TurnContext::default()
    };
    let conversation = ctx.conversation.clone();
    let before = conversation.snapshot();
    let (h, mut rx, _) = start_with(&engine, "/compact", ctx);
    while mock.bodies.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    h.send(EngineInput::Abort);
    let signals = until_end(&mut rx).await;
    assert_eq!(compactions(&signals), [P::Started, P::Cancelled]);
    assert_eq!(
        signals[signals.len() - 2..],
        [SignalKind::Result(StopReason::Cancelled), SignalKind::Idle]
    );
    assert_eq!(conversation.snapshot(), before, "nothing replaced");
}

#[tokio::test]
async fn slash_compact_summarizes_everything_so_far_and_asks_nothing_else() {
    use tiller_engine::CompactionPhase as P;
    let mock = Mock::default();
    mock.replies
        .lock()
        .unwrap()
        .extend([(200, text("Summary.", "stop"))]);
    // A large window: /compact does not wait for the threshold.
    let engine = ModelEngine::new(config(serve(mock.clone()).await));
    let ctx = TurnContext {
        conversation: history(2),
        ..TurnContext::default()
    };
    let conversation = ctx.conversation.clone();
    let (_h, mut rx, _) = start_with(&engine, " /compact ", ctx);
    let signals = until_end(&mut rx).await;
    assert_eq!(
        compactions(&signals),
        [P::Started, P::Completed("Summary.".into())]
    );
    assert!(signals.contains(&SignalKind::Result(StopReason::EndTurn)));
    assert_eq!(mock.bodies.lock().unwrap().len(), 1);
    match &conversation.snapshot()[..] {
        [Message::User { text }] => assert!(text.ends_with("Summary.")),
        other => panic!("{other:?}"),
    }
    // On an empty conversation there is nothing to summarize: no call.
    let (_h, mut rx, _) = start(&engine, "/compact");
    let signals = until_end(&mut rx).await;
    assert!(compactions(&signals).is_empty());
    assert!(signals.contains(&SignalKind::Result(StopReason::EndTurn)));
    assert_eq!(mock.bodies.lock().unwrap().len(), 1);
}

/// What this test binary logged at warn: one global subscriber (a scoped
/// one races other tests' threads for the callsites' interest).
fn logged() -> &'static Logged {
    static LOG: std::sync::OnceLock<Logged> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let logged = Logged::default();
        let sink = logged.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || sink.clone())
            .init();
        logged
    })
}

#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_failing_model_call_is_logged_with_its_session_at_warn() {
    // The engine's task is not the session actor's: its lines carry the
    // session themselves (no session span reaches them, and a filter at
    // warn leaves the info spans out anyway).
    let logged = logged();
    let mock = Mock::default(); // every call answered 500
    let engine = ModelEngine::new(config(serve(mock.clone()).await));
    let host = tiller_engine::HostInfo {
        session: "the-session-id".into(),
        ..Default::default()
    };
    let (_h, mut rx, _) = start_in(&engine, "hi", host);
    let signals = until_end(&mut rx).await;
    assert!(
        matches!(signals.last(), Some(SignalKind::Failed(..))),
        "{signals:?}"
    );
    let log = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("model call failed"))
        .collect();
    // Two retries, then the failure, each naming the session and turn
    // (the other tests' lines name none: their host has no session).
    let mine = |l: &&&str| l.contains("session=the-session-id turn=1");
    assert_eq!(lines.iter().filter(mine).count(), 3, "{log}");
    assert!(
        lines.iter().any(|l| mine(&l) && !l.contains("retrying")),
        "{log}"
    );
}
