//! The ACP connection's ordering, replay and attachment, through the
//! in-process client (`tiller_test_support::AcpClient`).

use serde_json::{Value, json};
use tiller_test_support::{AcpClient, sessions, update_kinds};

fn script(steps: Value) -> Value {
    json!([{ "type": "text", "text": json!({ "script": steps }).to_string() }])
}

fn text_of(updates: &[Value], kind: &str) -> String {
    updates
        .iter()
        .filter(|u| u["sessionUpdate"] == kind)
        .filter_map(|u| u["content"]["text"].as_str())
        .collect()
}

#[tokio::test]
async fn every_update_of_a_prompt_arrives_before_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let mut c = AcpClient::connect(&s);
    let sid = c.new_session("/tmp").await;
    let r = c
        .request(
            "session/prompt",
            json!({ "sessionId": sid, "prompt": script(json!([{ "say": "a" }, { "say": "b" }, { "say": "c" }])) }),
        )
        .await
        .unwrap();
    assert_eq!(r["stopReason"], "end_turn");
    // Everything seen so far came before the answer.
    assert_eq!(text_of(&c.updates(&sid), "agent_message_chunk"), "abc");
    c.hang_up().await;
}

#[tokio::test]
async fn session_load_replays_history_before_its_answer_then_follows_live() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let mut a = AcpClient::connect(&s);
    let sid = a.new_session("/tmp").await;
    a.request(
        "session/prompt",
        json!({ "sessionId": sid, "prompt": script(json!([{ "say": "before" }])) }),
    )
    .await
    .unwrap();
    let mut b = AcpClient::connect(&s);
    b.request("initialize", json!({ "protocolVersion": 1 }))
        .await
        .unwrap();
    b.request(
        "session/load",
        json!({ "sessionId": sid, "cwd": "/tmp", "mcpServers": [] }),
    )
    .await
    .unwrap();
    let replayed = b.updates(&sid);
    let kinds = update_kinds(&replayed);
    assert!(
        kinds.contains(&"user_message_chunk".to_owned()),
        "{kinds:?}"
    );
    assert_eq!(text_of(&replayed, "agent_message_chunk"), "before");
    // A's next turn reaches B live, once.
    a.request(
        "session/prompt",
        json!({ "sessionId": sid, "prompt": script(json!([{ "say": "after" }])) }),
    )
    .await
    .unwrap();
    b.until(|m| {
        m["method"] == "session/update" && m["params"]["update"]["content"]["text"] == "after"
    })
    .await;
    assert_eq!(
        text_of(&b.updates(&sid), "agent_message_chunk"),
        "beforeafter",
        "history once, then live, nothing twice"
    );
    a.hang_up().await;
    b.hang_up().await;
}

#[tokio::test]
async fn a_cancel_settles_the_prompt_cancelled_and_its_answer_comes_last() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let mut c = AcpClient::connect(&s);
    let sid = c.new_session("/tmp").await;
    let id = c
        .send_request(
            "session/prompt",
            json!({ "sessionId": sid, "prompt": script(json!([{ "say": "x" }, { "sleep_ms": 5000 }, { "say": "never" }])) }),
        )
        .await;
    c.until(|m| m["params"]["update"]["content"]["text"] == "x")
        .await;
    c.notify("session/cancel", json!({ "sessionId": sid }))
        .await;
    let answer = c.until(|m| m.get("id") == Some(&id)).await;
    assert_eq!(answer["result"]["stopReason"], "cancelled");
    assert!(!text_of(&c.updates(&sid), "agent_message_chunk").contains("never"));
    c.hang_up().await;
}

/// A client that only watches a session (attached by `session/load`)
/// goes on seeing it after the session's actor failed on a store that
/// cannot write, even though the store was still failing when the
/// connection first tried to attach to the session again. (Found by the
/// e2e full-disk test, which saw it now and then.)
#[tokio::test]
async fn a_watcher_stays_attached_across_a_store_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (s, store) = sessions(&dir).await;
    let mut a = AcpClient::connect(&s);
    let sid = a.new_session("/tmp").await;
    let mut w = AcpClient::connect(&s);
    w.request("initialize", json!({ "protocolVersion": 1 }))
        .await
        .unwrap();
    w.request(
        "session/load",
        json!({ "sessionId": sid, "cwd": "/tmp", "mcpServers": [] }),
    )
    .await
    .unwrap();
    // A turn under way when the store starts failing: its actor fails,
    // and its prompt cannot be settled until the store is back, so the
    // session cannot be opened meanwhile.
    let running = a
        .send_request(
            "session/prompt",
            json!({ "sessionId": sid, "prompt": script(json!([{ "say": "x" }, { "sleep_ms": 300 }, { "say": "lost" }])) }),
        )
        .await;
    w.until(|m| m["method"] == "session/update" && m["params"]["update"]["content"]["text"] == "x")
        .await;
    store.fail_appends(true);
    let answer = a
        .until(|m| m.get("id") == Some(&running) && m.get("method").is_none())
        .await;
    assert!(answer.get("error").is_some(), "{answer}");
    // The failed actor's end makes the watcher re-attach while the store
    // still fails.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    store.fail_appends(false);
    a.request(
        "session/prompt",
        json!({ "sessionId": sid, "prompt": script(json!([{ "say": "after" }])) }),
    )
    .await
    .unwrap();
    w.until(|m| {
        m["method"] == "session/update" && m["params"]["update"]["content"]["text"] == "after"
    })
    .await;
    a.hang_up().await;
    w.hang_up().await;
}

#[tokio::test]
async fn a_connection_ends_once_its_transport_stops_writing() {
    // The transport's writer gave up on a client that reads nothing
    // (`write_within_stall`): the connection ends with it, even while the
    // client sends nothing and nothing more is written to it.
    let dir = tempfile::tempdir().unwrap();
    let (s, _store) = sessions(&dir).await;
    let (_client, incoming) = tokio::sync::mpsc::channel(4);
    let (outgoing, transport) = tokio::sync::mpsc::channel(4);
    let config = tiller_acp::AcpConfig {
        max_message_bytes: 1 << 20,
        subscriber_queue: 1024,
        version: "test".into(),
        forward: None,
    };
    let serving = tokio::spawn(tiller_acp::serve(s, config, "test", incoming, outgoing));
    drop(transport);
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), serving).await;
    assert!(
        matches!(ended, Ok(Ok(()))),
        "the connection outlived its transport"
    );
}
