//! OpenAI Chat Completions (and the servers compatible with it: Ollama,
//! vLLM, llama.cpp): request body and streaming parser.

use serde_json::{Value, json};

use super::{Delta, Finish, ModelConfig, Parser, RawCall, Stop};
use crate::{Message, ToolSpec};

/// The request body for one model call.
pub(super) fn body(
    cfg: &ModelConfig,
    model: &str,
    system: &str,
    msgs: &[Message],
    tools: &[ToolSpec],
) -> Value {
    let mut messages = Vec::with_capacity(msgs.len() + 1);
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    for m in msgs {
        messages.push(match m {
            Message::User { text } => json!({"role": "user", "content": text}),
            // Anthropic's own; other providers do not take them back.
            Message::Reasoning { .. } => continue,
            Message::Image(i) => json!({"role": "user", "content": [{
                "type": "image_url",
                "image_url": {"url": format!("data:{};base64,{}", i.mime_type, i.data)},
            }]}),
            Message::Assistant { text, calls } => {
                let mut a = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    a["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.input.to_string()},
                            })
                        })
                        .collect();
                }
                a
            }
            Message::ToolResult { id, output, .. } => {
                json!({"role": "tool", "tool_call_id": id, "content": output})
            }
        });
    }
    let mut body = json!({
        "model": model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                })
            })
            .collect();
    }
    if let Some(n) = cfg.max_tokens {
        body["max_tokens"] = json!(n);
    }
    if let Some(t) = cfg.temperature {
        body["temperature"] = json!(t);
    }
    body
}

/// Accumulates one streamed response.
#[derive(Debug, Default)]
pub(super) struct OpenAiParser {
    /// Calls by their `index` in the stream.
    calls: Vec<(usize, RawCall)>,
    stop: Option<Stop>,
    usage: (u64, u64),
    done: bool,
}

impl Parser for OpenAiParser {
    fn event(&mut self, _event: &str, data: &str) -> Result<Vec<Delta>, String> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(Vec::new());
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| format!("the model sent a chunk that is not JSON ({e})"))?;
        if let Some(err) = v.get("error") {
            return Err(super::error_text(err));
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = (
                u["prompt_tokens"].as_u64().unwrap_or(0),
                u["completion_tokens"].as_u64().unwrap_or(0),
            );
        }
        let mut out = Vec::new();
        for choice in v["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                out.push(Delta::Text(t.to_owned()));
            }
            // Reasoning text of local servers (vLLM, llama.cpp, Ollama).
            for key in ["reasoning_content", "reasoning"] {
                if let Some(t) = delta[key].as_str().filter(|t| !t.is_empty()) {
                    out.push(Delta::Thought(t.to_owned()));
                }
            }
            if let Some(r) = delta["refusal"].as_str().filter(|t| !t.is_empty()) {
                out.push(Delta::Text(r.to_owned()));
            }
            for tc in delta["tool_calls"].as_array().into_iter().flatten() {
                let index = tc["index"].as_u64().unwrap_or(0) as usize;
                let pos = match self.calls.iter().position(|(i, _)| *i == index) {
                    Some(p) => p,
                    None => {
                        self.calls.push((index, RawCall::default()));
                        self.calls.len() - 1
                    }
                };
                let call = &mut self.calls[pos].1;
                if let Some(id) = tc["id"].as_str() {
                    call.id.push_str(id);
                }
                if let Some(name) = tc["function"]["name"].as_str() {
                    call.name.push_str(name);
                }
                if let Some(args) = tc["function"]["arguments"].as_str() {
                    call.args.push_str(args);
                }
                out.push(Delta::ToolProgress);
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.stop = Some(match reason {
                    "length" => Stop::MaxTokens,
                    "content_filter" => Stop::Refusal,
                    "tool_calls" | "function_call" => Stop::ToolUse,
                    _ => Stop::EndTurn,
                });
            }
        }
        Ok(out)
    }

    fn finish(&mut self, ended: bool) -> Option<Finish> {
        // Usage comes after the finish reason, so `[DONE]` ends a response;
        // some compatible servers close the stream without it, and a finish
        // reason is then the sign of a complete response.
        if !(self.done || ended && self.stop.is_some()) {
            return None;
        }
        let calls: Vec<RawCall> = std::mem::take(&mut self.calls)
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        let stop = match self.stop {
            // A server that says `stop` while calling tools still called them.
            Some(Stop::EndTurn) | None if !calls.is_empty() => Stop::ToolUse,
            Some(s) => s,
            None => Stop::EndTurn,
        };
        Some(Finish {
            reasoning: Vec::new(),
            stop,
            calls,
            usage: self.usage,
        })
    }
}
