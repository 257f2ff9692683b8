//! Anthropic Messages: request body and streaming parser.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{Delta, Finish, ModelConfig, Obj, Parser, RawCall, Stop};
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
        // Nearly every event is a block's delta, read without a `Value`
        // (its other fields skipped); any other event, or a field of
        // another type, takes the general path, which reads it the same
        // way (but for a skipped field a `Value` cannot hold: see the
        // OpenAI parser).
        if data.trim_start().starts_with('{')
            && let Ok(e) = serde_json::from_str::<BlockDelta>(data)
            && e.kind == "content_block_delta"
        {
            let d = e.delta.map(|Obj(d)| d).unwrap_or_default();
            let mut out = self.block_delta(e.index.unwrap_or(0), d.kind.as_deref(), |key| {
                match key {
                    "text" => d.text.as_deref(),
                    "thinking" => d.thinking.as_deref(),
                    "signature" => d.signature.as_deref(),
                    _ => d.partial_json.as_deref(),
                }
                .unwrap_or("")
            });
            out.retain(|d| !matches!(d, Delta::Text(t) | Delta::Thought(t) if t.is_empty()));
            return Ok(out);
        }
        self.value(event, data)
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

impl AnthropicParser {
    /// Any event, read as a `Value`: the general path.
    fn value(&mut self, event: &str, data: &str) -> Result<Vec<Delta>, String> {
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
                let d = &v["delta"];
                out = self.block_delta(
                    v["index"].as_u64().unwrap_or(0),
                    d["type"].as_str(),
                    |key| d[key].as_str().unwrap_or(""),
                );
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

    /// A `content_block_delta` to the block at `index`, of delta type
    /// `kind`; `field` reads the delta's string fields ("" when absent).
    fn block_delta<'d>(
        &mut self,
        index: u64,
        kind: Option<&str>,
        field: impl Fn(&str) -> &'d str,
    ) -> Vec<Delta> {
        let block = self
            .blocks
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, b)| b);
        match (block, kind) {
            (Some(Block::Text), Some("text_delta")) => vec![Delta::Text(field("text").to_owned())],
            (Some(Block::Thinking(r)), Some("thinking_delta")) => {
                let t = field("thinking");
                let b = &mut self.reasoning[*r]["thinking"];
                *b = json!(format!("{}{t}", b.as_str().unwrap_or("")));
                vec![Delta::Thought(t.to_owned())]
            }
            (Some(Block::Thinking(r)), Some("signature_delta")) => {
                let s = field("signature");
                let b = &mut self.reasoning[*r]["signature"];
                *b = json!(format!("{}{s}", b.as_str().unwrap_or("")));
                Vec::new()
            }
            (Some(Block::Tool(c)), Some("input_json_delta")) => {
                let c = *c;
                self.calls[c].args.push_str(field("partial_json"));
                vec![Delta::ToolProgress]
            }
            _ => Vec::new(),
        }
    }
}

/// A block's delta event, the common shape: only the fields read are
/// built. A field of another type fails the whole read.
#[derive(Deserialize)]
struct BlockDelta {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    delta: Option<Obj<DeltaBody>>,
}

#[derive(Default, Deserialize)]
struct DeltaBody {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    thinking: Option<String>,
    #[serde(default)]
    signature: Option<String>,
    #[serde(default)]
    partial_json: Option<String>,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{AnthropicParser, BlockDelta, Parser};
    use crate::model::tests::{junk, object, taken_of_1000, text, text_or_junk, with_key};

    /// The blocks a response opens (text, thinking, a tool call), at
    /// indexes 0 to 2.
    fn starts() -> Vec<Value> {
        vec![
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "thinking", "thinking": ""}}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t", "name": "read"}}),
        ]
    }

    fn event() -> BoxedStrategy<Value> {
        let kind = prop_oneof![
            6 => Just(json!("content_block_delta")),
            1 => Just(json!("message_delta")),
            1 => Just(json!("ping")),
            1 => junk(),
        ];
        let delta_kind = prop_oneof![
            Just(json!("text_delta")),
            Just(json!("thinking_delta")),
            Just(json!("signature_delta")),
            Just(json!("input_json_delta")),
            junk(),
        ];
        let delta = prop_oneof![
            6 => object(vec![
                ("type", delta_kind.boxed()),
                ("text", text_or_junk().boxed()),
                ("thinking", text_or_junk().boxed()),
                ("signature", text_or_junk().boxed()),
                ("partial_json", text_or_junk().boxed()),
                ("stop_reason", text().boxed()),
            ]),
            1 => junk(),
        ];
        let index = prop_oneof![4 => (0u64..4).prop_map(Value::from), 1 => junk()];
        prop_oneof![
            // A `type` in nearly every event, as the API sends.
            20 => with_key(
                object(vec![("index", index.boxed()), ("delta", delta.boxed())]),
                "type",
                proptest::option::weighted(0.95, kind),
            ),
            1 => junk(),
        ]
        .boxed()
    }

    /// Many generated events take the fast path (else the property below
    /// would test the general path against itself).
    #[test]
    fn many_generated_events_take_the_fast_path() {
        let fast = taken_of_1000(&event(), |data| {
            serde_json::from_str::<BlockDelta>(data).is_ok_and(|e| e.kind == "content_block_delta")
        });
        assert!(fast > 300, "{fast} of 1000");
    }

    proptest! {
        /// The delta reader gives what the general path gives, event by
        /// event and in the end, for any event.
        #[test]
        fn the_fast_path_reads_every_event_as_the_general_path_does(
            events in prop::collection::vec(event(), 1..8),
        ) {
            let mut general = AnthropicParser::default();
            let mut fast = AnthropicParser::default();
            for e in starts() {
                let data = e.to_string();
                prop_assert_eq!(fast.event("", &data), general.value("", &data));
            }
            for e in &events {
                let data = e.to_string();
                prop_assert_eq!(fast.event("content_block_delta", &data), general.value("content_block_delta", &data), "{}", data);
                prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"));
            }
            let stop = r#"{"type":"message_stop"}"#;
            prop_assert_eq!(fast.event("", stop), general.value("", stop));
            prop_assert_eq!(format!("{:?}", fast.finish(true)), format!("{:?}", general.finish(true)));
        }
    }

    /// The fast path is taken for what the API sends.
    #[test]
    fn real_deltas_take_the_fast_path() {
        for data in [
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel\"lo\n"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"thinking_delta","thinking":"hmm"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"signature_delta","signature":"EqQB"}}"#,
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"pa"}}"#,
        ] {
            let e = serde_json::from_str::<BlockDelta>(data);
            assert!(e.is_ok_and(|e| e.kind == "content_block_delta"), "{data}");
        }
    }
}
