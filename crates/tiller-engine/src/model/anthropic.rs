//! Anthropic Messages: request body and streaming parser.

use serde_json::{Value, json};

use super::{Delta, Finish, ModelConfig, Parser, RawCall, Stop};
use crate::{Message, ToolSpec};

/// `max_tokens` is required by the Messages API.
const DEFAULT_MAX_TOKENS: u32 = 8192;

/// The request body for one model call. Consecutive user-side messages
/// (tool results, prompts, steers) become one user message, results first,
/// as the API requires.
pub(super) fn body(
    cfg: &ModelConfig,
    model: &str,
    system: &str,
    msgs: &[Message],
    tools: &[ToolSpec],
    thinking: bool,
) -> Value {
    let mut messages: Vec<Value> = Vec::new();
    let mut user: Vec<Value> = Vec::new();
    // Reasoning blocks lead the assistant reply they came with.
    let mut reasoning: Vec<Value> = Vec::new();
    let flush = |user: &mut Vec<Value>, messages: &mut Vec<Value>| {
        if !user.is_empty() {
            // Tool results must lead the message.
            user.sort_by_key(|b| b["type"] != "tool_result");
            messages.push(json!({"role": "user", "content": std::mem::take(user)}));
        }
    };
    for m in msgs {
        match m {
            Message::User { text } => user.push(json!({"type": "text", "text": text})),
            Message::Image(i) => user.push(json!({
                "type": "image",
                "source": {"type": "base64", "media_type": i.mime_type, "data": i.data},
            })),
            Message::ToolResult { id, ok, output } => user.push(json!({
                "type": "tool_result",
                "tool_use_id": id,
                "content": output,
                "is_error": !ok,
            })),
            Message::Reasoning { blocks } => {
                flush(&mut user, &mut messages);
                reasoning = blocks.clone();
            }
            Message::Assistant { text, calls } => {
                flush(&mut user, &mut messages);
                let mut content = std::mem::take(&mut reasoning);
                if !text.is_empty() {
                    content.push(json!({"type": "text", "text": text}));
                }
                for c in calls {
                    let input = if c.input.is_object() {
                        c.input.clone()
                    } else {
                        json!({})
                    };
                    content.push(
                        json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}),
                    );
                }
                if content.is_empty() {
                    content.push(json!({"type": "text", "text": "(no reply)"}));
                }
                messages.push(json!({"role": "assistant", "content": content}));
            }
        }
    }
    flush(&mut user, &mut messages);
    let mut max_tokens = cfg.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if thinking {
        // The budget must leave room for the answer.
        max_tokens = max_tokens.max(THINKING_BUDGET + 1024);
    }
    let mut body = json!({
        "model": model,
        "max_tokens": max_tokens,
        "messages": messages,
        "stream": true,
    });
    if thinking {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": THINKING_BUDGET});
    }
    if !system.is_empty() {
        body["system"] = json!(system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema}))
            .collect();
    }
    // Extended thinking takes no temperature of its own.
    if let Some(t) = cfg.temperature.filter(|_| !thinking) {
        body["temperature"] = json!(t);
    }
    body
}

/// Tokens a reply may spend thinking, with `thinking` on.
const THINKING_BUDGET: u32 = 4096;

/// What a content block streams into.
#[derive(Debug)]
enum Block {
    Text,
    /// Its reasoning block as the API must get it back.
    Thinking(usize),
    Tool(usize),
    Other,
}

/// Accumulates one streamed response.
#[derive(Debug, Default)]
pub(super) struct AnthropicParser {
    blocks: Vec<(u64, Block)>,
    calls: Vec<RawCall>,
    /// Thinking (and redacted thinking) blocks, with their signatures.
    reasoning: Vec<Value>,
    stop: Option<Stop>,
    usage: (u64, u64),
    done: bool,
}

impl Parser for AnthropicParser {
    fn event(&mut self, event: &str, data: &str) -> Result<Vec<Delta>, String> {
        let v: Value = serde_json::from_str(data)
            .map_err(|e| format!("the model sent an event that is not JSON ({e})"))?;
        let kind = v["type"].as_str().unwrap_or(event);
        let mut out = Vec::new();
        match kind {
            "message_start" => {
                let u = &v["message"]["usage"];
                self.usage.0 = u["input_tokens"].as_u64().unwrap_or(0)
                    + u["cache_read_input_tokens"].as_u64().unwrap_or(0)
                    + u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
                self.usage.1 = u["output_tokens"].as_u64().unwrap_or(0);
            }
            "content_block_start" => {
                let index = v["index"].as_u64().unwrap_or(0);
                let cb = &v["content_block"];
                let block = match cb["type"].as_str() {
                    Some("text") => {
                        if let Some(t) = cb["text"].as_str().filter(|t| !t.is_empty()) {
                            out.push(Delta::Text(t.to_owned()));
                        }
                        Block::Text
                    }
                    Some("thinking") | Some("redacted_thinking") => {
                        let mut b = cb.clone();
                        if b["type"] == "thinking" {
                            b["thinking"] = json!(cb["thinking"].as_str().unwrap_or(""));
                            b["signature"] = json!(cb["signature"].as_str().unwrap_or(""));
                        }
                        self.reasoning.push(b);
                        Block::Thinking(self.reasoning.len() - 1)
                    }
                    Some("tool_use") => {
                        self.calls.push(RawCall {
                            id: cb["id"].as_str().unwrap_or_default().to_owned(),
                            name: cb["name"].as_str().unwrap_or_default().to_owned(),
                            args: String::new(),
                        });
                        out.push(Delta::ToolProgress);
                        Block::Tool(self.calls.len() - 1)
                    }
                    _ => Block::Other,
                };
                self.blocks.push((index, block));
            }
            "content_block_delta" => {
                let index = v["index"].as_u64().unwrap_or(0);
                let d = &v["delta"];
                let block = self
                    .blocks
                    .iter()
                    .find(|(i, _)| *i == index)
                    .map(|(_, b)| b);
                match (block, d["type"].as_str()) {
                    (Some(Block::Text), Some("text_delta")) => {
                        out.push(Delta::Text(d["text"].as_str().unwrap_or("").to_owned()));
                    }
                    (Some(Block::Thinking(r)), Some("thinking_delta")) => {
                        let t = d["thinking"].as_str().unwrap_or("");
                        let b = &mut self.reasoning[*r]["thinking"];
                        *b = json!(format!("{}{t}", b.as_str().unwrap_or("")));
                        out.push(Delta::Thought(t.to_owned()));
                    }
                    (Some(Block::Thinking(r)), Some("signature_delta")) => {
                        let s = d["signature"].as_str().unwrap_or("");
                        let b = &mut self.reasoning[*r]["signature"];
                        *b = json!(format!("{}{s}", b.as_str().unwrap_or("")));
                    }
                    (Some(Block::Tool(c)), Some("input_json_delta")) => {
                        let c = *c;
                        self.calls[c]
                            .args
                            .push_str(d["partial_json"].as_str().unwrap_or(""));
                        out.push(Delta::ToolProgress);
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = v["delta"]["stop_reason"].as_str() {
                    self.stop = Some(match reason {
                        "max_tokens" | "model_context_window_exceeded" => Stop::MaxTokens,
                        "refusal" => Stop::Refusal,
                        "tool_use" => Stop::ToolUse,
                        _ => Stop::EndTurn,
                    });
                }
                if let Some(n) = v["usage"]["output_tokens"].as_u64() {
                    self.usage.1 = n;
                }
            }
            "message_stop" => self.done = true,
            "error" => return Err(super::error_text(&v["error"])),
            _ => {} // ping, content_block_stop, future events
        }
        out.retain(|d| !matches!(d, Delta::Text(t) | Delta::Thought(t) if t.is_empty()));
        Ok(out)
    }

    fn finish(&mut self, _ended: bool) -> Option<Finish> {
        if !self.done {
            return None;
        }
        let calls = std::mem::take(&mut self.calls);
        let stop = match self.stop {
            Some(s) => s,
            None if !calls.is_empty() => Stop::ToolUse,
            None => Stop::EndTurn,
        };
        Some(Finish {
            stop,
            calls,
            reasoning: std::mem::take(&mut self.reasoning),
            usage: self.usage,
        })
    }
}
