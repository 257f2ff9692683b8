//! The floor of the per-prompt benchmark (`tests/e2e/bench/prompts.mjs`): a
//! bare ACP agent over stdio, JSON-RPC parsed with `serde_json`, no storage,
//! no runtime. Every prompt is answered with three `agent_message_chunk`s
//! and `end_turn`, as the other agents in the benchmark do.

use std::io::{BufRead, BufWriter, Write};

use serde_json::{Value, json};

fn main() -> std::io::Result<()> {
    let stdin = std::io::stdin().lock();
    let mut out = BufWriter::new(std::io::stdout().lock());
    let mut sessions = 0u64;
    for line in stdin.lines() {
        let line = line?;
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let Some(id) = msg.get("id").cloned() else {
            continue; // a notification (session/cancel): nothing to answer
        };
        let result = match msg["method"].as_str().unwrap_or("") {
            "initialize" => json!({ "protocolVersion": 1, "agentCapabilities": {} }),
            "session/new" => {
                sessions += 1;
                json!({ "sessionId": format!("s{sessions}") })
            }
            "session/prompt" => {
                let session = &msg["params"]["sessionId"];
                for text in ["one ", "two ", "three"] {
                    let update = json!({
                        "jsonrpc": "2.0",
                        "method": "session/update",
                        "params": {
                            "sessionId": session,
                            "update": {
                                "sessionUpdate": "agent_message_chunk",
                                "content": { "type": "text", "text": text },
                            },
                        },
                    });
                    serde_json::to_writer(&mut out, &update)?;
                    out.write_all(b"\n")?;
                }
                json!({ "stopReason": "end_turn" })
            }
            _ => {
                let error = json!({ "jsonrpc": "2.0", "id": id, "error": { "code": -32601, "message": "method not found" } });
                serde_json::to_writer(&mut out, &error)?;
                out.write_all(b"\n")?;
                out.flush()?;
                continue;
            }
        };
        serde_json::to_writer(
            &mut out,
            &json!({ "jsonrpc": "2.0", "id": id, "result": result }),
        )?;
        out.write_all(b"\n")?;
        out.flush()?;
    }
    Ok(())
}
