//! A misbehaving ACP agent for tests. Well-behaved by default; each prompt
//! picks its behaviour by its first word:
//!
//! | word | the agent |
//! |---|---|
//! | (any other) | streams three chunks and answers `end_turn` |
//! | `silent` | answers nothing |
//! | `twice` | answers the prompt twice |
//! | `exit` | streams a chunk, then exits |
//! | `foreign` | sends an update for an unknown session, then answers |
//! | `garbage` | writes a line that is not JSON |
//! | `slow` | streams a chunk every 50 ms for 10 s; answers a cancel |
//! | `ignore-cancel` | streams a chunk, ignores the cancel, never answers |
//! | `ask PATH` | announces a write, asks permission, writes PATH through the client when allowed |
//! | `ask-vanish` | asks permission, then exits |
//! | `fail-echo VAR` | fails the prompt with an error quoting its variable VAR |
//! | `ask-kind KIND ARG` | asks permission for a call of ACP kind KIND (its input a `command`, `url` or `path` ARG; `execute-dir`: a command with a `directory`); streams `allowed`, `allowed always` or `refused` |
//! | `loop` | makes the same tool call (read, completed, same output) 12 times |
//! | `read PATH` | reads PATH through the client and streams its text |
//! | `write PATH` | writes PATH through the client without asking; streams `wrote` or why not |
//! | `steer` | waits up to 10 s for a steer and streams what it said |
//! | `steer-hang` | takes a steer, then never answers (seed 003) |
//! | `options` | streams `mode=` and its option `mode` (`ask` or `auto`) |
//!
//! `FAKE_ACP_NO_STEER=1` hides steering; `FAKE_ACP_NO_LOAD=1` fails every
//! `session/load`; `FAKE_ACP_PADDING=N` allocates N MiB at start (memory
//! figures). It uses std and serde_json only, so it starts in milliseconds.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

#[derive(Default)]
struct Shared {
    /// Our requests to the client, waiting for answers.
    answers: Mutex<HashMap<u64, Sender<Value>>>,
    /// Per session: where its running prompt hears of cancels and steers.
    turns: Mutex<HashMap<String, Sender<Value>>>,
    /// Per session: its `mode` option.
    modes: Mutex<HashMap<String, String>>,
    next: AtomicU64,
}

fn out(v: Value) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{v}");
    let _ = o.flush();
}

fn chunk(session: &str, text: &str) {
    out(
        json!({"jsonrpc": "2.0", "method": "session/update", "params": {
            "sessionId": session,
            "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}
        }}),
    );
}

fn update(session: &str, u: Value) {
    out(
        json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": session, "update": u}}),
    );
}

fn answer(id: &Value, result: Value) {
    out(json!({"jsonrpc": "2.0", "id": id, "result": result}));
}

impl Shared {
    /// Sends a request to the client and waits for its answer.
    fn ask(&self, method: &str, params: Value) -> Value {
        let id = 1_000_000 + self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.answers.lock().unwrap().insert(id, tx);
        out(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        rx.recv().unwrap_or(Value::Null)
    }
}

fn main() {
    if let Some(mb) = std::env::var("FAKE_ACP_PADDING")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let pad = vec![1u8; mb << 20];
        std::mem::forget(pad);
    }
    let steering = std::env::var_os("FAKE_ACP_NO_STEER").is_none();
    let load = std::env::var_os("FAKE_ACP_NO_LOAD").is_none();
    let shared = Arc::new(Shared::default());
    let mut sessions = 0u64;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { return };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let id = msg.get("id").cloned();
        let method = msg["method"].as_str().unwrap_or_default().to_owned();
        let params = msg["params"].clone();
        if method.is_empty() {
            // An answer to one of our requests.
            let n = id.as_ref().and_then(Value::as_u64).unwrap_or(0);
            if let Some(tx) = shared.answers.lock().unwrap().remove(&n) {
                let _ = tx.send(msg["result"].clone());
            }
            continue;
        }
        let session = params["sessionId"].as_str().unwrap_or_default().to_owned();
        match (method.as_str(), id) {
            ("initialize", Some(id)) => answer(
                &id,
                json!({
                    "protocolVersion": 1,
                    "agentCapabilities": {"loadSession": true},
                    "agentInfo": {"name": "tiller-fake-acp", "version": "1"},
                    "_meta": {"steering": {"supported": steering}},
                }),
            ),
            ("session/new", Some(id)) => {
                sessions += 1;
                let sid = format!("fake-{}-{sessions}", std::process::id());
                shared
                    .modes
                    .lock()
                    .unwrap()
                    .insert(sid.clone(), "ask".into());
                answer(
                    &id,
                    json!({"sessionId": sid, "configOptions": options("ask")}),
                );
            }
            ("session/load", Some(id)) => {
                if load {
                    // A load replays history (Tiller must not show it again).
                    chunk(&session, "replayed history");
                    answer(&id, json!({}));
                } else {
                    out(
                        json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32002, "message": "no such session"}}),
                    );
                }
            }
            ("session/set_config_option", Some(id)) => {
                let value = params["value"].as_str().unwrap_or_default().to_owned();
                if params["configId"] == "mode" && ["ask", "auto"].contains(&value.as_str()) {
                    shared
                        .modes
                        .lock()
                        .unwrap()
                        .insert(session.clone(), value.clone());
                    answer(&id, json!({"configOptions": options(&value)}));
                } else {
                    out(
                        json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32602, "message": "no such option or value"}}),
                    );
                }
            }
            ("session/prompt", Some(id)) => {
                let text = params["prompt"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let (tx, rx) = channel();
                shared.turns.lock().unwrap().insert(session.clone(), tx);
                let shared = shared.clone();
                std::thread::spawn(move || turn(&shared, &session, &id, &text, &rx));
            }
            ("session/cancel", None) | ("_session/steering", Some(_)) => {
                let tx = shared.turns.lock().unwrap().get(&session).cloned();
                let taken = tx.is_some_and(|tx| tx.send(msg.clone()).is_ok());
                if !taken && let Some(id) = msg.get("id") {
                    answer(
                        id,
                        json!({"outcome": "promptRequired", "reason": "noRunningTurn"}),
                    );
                }
            }
            (_, Some(id)) => out(
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "method not found"}}),
            ),
            _ => {}
        }
    }
}

/// The agent's one option.
fn options(mode: &str) -> Value {
    json!([{"id": "mode", "name": "Mode", "category": "mode", "type": "select", "currentValue": mode,
            "options": [{"value": "ask", "name": "Ask"}, {"value": "auto", "name": "Auto"}]}])
}

/// One prompt's behaviour.
fn turn(shared: &Shared, session: &str, id: &Value, text: &str, rx: &Receiver<Value>) {
    let mut words = text.split_whitespace();
    let word = words.next().unwrap_or_default();
    let arg = words.next().unwrap_or_default().to_owned();
    let end = |reason: &str| answer(id, json!({"stopReason": reason}));
    // Waits for a cancel (answering it) for at most `d`; true when one came.
    let cancelled = |d: Duration| -> bool {
        matches!(rx.recv_timeout(d), Ok(m) if m["method"] == "session/cancel")
    };
    match word {
        "silent" => {}
        "options" => {
            let mode = shared.modes.lock().unwrap().get(session).cloned();
            chunk(session, &format!("mode={}", mode.unwrap_or_default()));
            end("end_turn");
        }
        "twice" => {
            chunk(session, "once");
            end("end_turn");
            end("end_turn");
        }
        "exit" => {
            chunk(session, "about to exit");
            std::process::exit(3);
        }
        "foreign" => {
            chunk("no-such-session", "not yours");
            chunk(session, "mine");
            end("end_turn");
        }
        "garbage" => {
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "this is not json");
            let _ = o.flush();
        }
        "slow" => {
            for i in 0..200 {
                chunk(session, &format!("tick {i} "));
                if cancelled(Duration::from_millis(50)) {
                    end("cancelled");
                    return;
                }
            }
            end("end_turn");
        }
        "ignore-cancel" => {
            chunk(session, "not stopping");
            let _ = rx.recv();
            std::thread::sleep(Duration::from_secs(3600));
        }
        "ask" | "ask-vanish" => {
            let call = "call-write-1";
            update(
                session,
                json!({"sessionUpdate": "tool_call", "toolCallId": call, "title": format!("Write {arg}"),
                       "kind": "edit", "status": "pending",
                       "rawInput": {"path": arg, "content": "written by the agent"},
                       "locations": [{"path": arg}]}),
            );
            let ask = json!({"sessionId": session,
                "toolCall": {"toolCallId": call, "title": format!("Write {arg}"), "kind": "edit",
                             "rawInput": {"path": arg, "content": "written by the agent"}},
                "options": [
                    {"optionId": "yes", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "always", "name": "Always", "kind": "allow_always"},
                    {"optionId": "no", "name": "Reject", "kind": "reject_once"}]});
            if word == "ask-vanish" {
                let n = 1_000_000 + shared.next.fetch_add(1, Ordering::Relaxed);
                out(
                    json!({"jsonrpc": "2.0", "id": n, "method": "session/request_permission", "params": ask}),
                );
                std::thread::sleep(Duration::from_millis(100));
                std::process::exit(4);
            }
            let r = shared.ask("session/request_permission", ask);
            let chosen = r["outcome"]["optionId"].as_str().unwrap_or_default();
            if chosen == "yes" || chosen == "always" {
                shared.ask(
                    "fs/write_text_file",
                    json!({"sessionId": session, "path": arg, "content": "written by the agent"}),
                );
                update(
                    session,
                    json!({"sessionUpdate": "tool_call_update", "toolCallId": call, "status": "completed",
                           "content": [{"type": "content", "content": {"type": "text", "text": "wrote it"}}]}),
                );
                chunk(session, "done");
            } else {
                update(
                    session,
                    json!({"sessionUpdate": "tool_call_update", "toolCallId": call, "status": "failed"}),
                );
                chunk(session, &format!("not allowed ({})", r["outcome"]));
            }
            end("end_turn");
        }
        "fail-echo" => {
            let value = std::env::var(&arg).unwrap_or_default();
            out(json!({"jsonrpc": "2.0", "id": id,
                       "error": {"code": -32603, "message": format!("cannot call the model with key {value}")}}));
        }
        "ask-kind" => {
            let mut parts = text.trim().splitn(3, ' ').skip(1);
            let (kind, arg) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let input = match kind {
                "execute" => json!({"command": arg}),
                // A command run in another directory (`execute-dir`).
                "execute-dir" => json!({"command": arg, "directory": "elsewhere"}),
                "fetch" => json!({"url": arg}),
                _ => json!({"path": arg}),
            };
            let n = shared.next.fetch_add(1, Ordering::Relaxed);
            let call = format!("call-{kind}-{n}");
            let kind = kind.trim_end_matches("-dir");
            // Named as Claude Code names its tools (one name per kind).
            let meta = json!({"claudeCode": {"toolName": format!("Tool-{kind}")}});
            update(
                session,
                json!({"sessionUpdate": "tool_call", "toolCallId": call, "title": format!("{kind} {arg}"),
                       "kind": kind, "status": "pending", "rawInput": input, "_meta": meta}),
            );
            let ask = json!({"sessionId": session,
                "toolCall": {"toolCallId": call, "title": format!("{kind} {arg}"), "kind": kind,
                             "rawInput": input, "_meta": meta},
                "options": [
                    {"optionId": "yes", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "always", "name": "Always", "kind": "allow_always"},
                    {"optionId": "no", "name": "Reject", "kind": "reject_once"}]});
            let r = shared.ask("session/request_permission", ask);
            let chosen = r["outcome"]["optionId"].as_str().unwrap_or_default();
            let allowed = chosen == "yes" || chosen == "always";
            update(
                session,
                json!({"sessionUpdate": "tool_call_update", "toolCallId": call,
                       "status": if allowed { "completed" } else { "failed" }}),
            );
            // What it was told, so a test sees whether it was to remember.
            let said = match chosen {
                "always" => "allowed always",
                "yes" => "allowed",
                _ => "refused",
            };
            chunk(session, said);
            end("end_turn");
        }
        "loop" => {
            for i in 0..12 {
                let call = format!("read-{i}");
                update(
                    session,
                    json!({"sessionUpdate": "tool_call", "toolCallId": call, "title": "Read a.txt",
                           "kind": "read", "status": "in_progress", "rawInput": {"path": "a.txt"}}),
                );
                update(
                    session,
                    json!({"sessionUpdate": "tool_call_update", "toolCallId": call, "status": "completed",
                           "content": [{"type": "content", "content": {"type": "text", "text": "same"}}]}),
                );
                if cancelled(Duration::from_millis(20)) {
                    end("cancelled");
                    return;
                }
            }
            end("end_turn");
        }
        "write" => {
            let n = 1_000_000 + shared.next.fetch_add(1, Ordering::Relaxed);
            let (tx, rx2) = channel();
            shared.answers.lock().unwrap().insert(n, tx);
            out(
                json!({"jsonrpc": "2.0", "id": n, "method": "fs/write_text_file",
                       "params": {"sessionId": session, "path": arg, "content": "unasked"}}),
            );
            let r = rx2.recv().unwrap_or(Value::Null);
            chunk(session, if r.is_null() { "refused" } else { "wrote" });
            end("end_turn");
        }
        "read" => {
            let r = shared.ask(
                "fs/read_text_file",
                json!({"sessionId": session, "path": arg}),
            );
            chunk(session, r["content"].as_str().unwrap_or("(read failed)"));
            end("end_turn");
        }
        "steer" | "steer-hang" => {
            chunk(session, "waiting for a steer");
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(m) if m["method"] == "_session/steering" => {
                    answer(&m["id"], json!({"outcome": "injected"}));
                    if word == "steer-hang" {
                        // The model stream drops: the agent never answers.
                        return;
                    }
                    let said = m["params"]["prompt"][0]["text"]
                        .as_str()
                        .unwrap_or_default();
                    chunk(session, &format!("steered: {said}"));
                    end("end_turn");
                }
                Ok(m) if m["method"] == "session/cancel" => end("cancelled"),
                _ => end("end_turn"),
            }
        }
        _ => {
            for t in ["chunk1 ", "chunk2 ", "chunk3"] {
                chunk(session, t);
            }
            end("end_turn");
        }
    }
}
