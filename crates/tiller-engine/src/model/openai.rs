//! OpenAI Chat Completions (and the servers compatible with it: Ollama,
//! vLLM, llama.cpp): request body and streaming parser.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{Delta, Finish, ModelConfig, Obj, Parser, RawCall, Stop};
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
        // Nearly every chunk has the common shape, read without a `Value`
        // (its other fields are skipped, not built); anything else (an
        // error, a field of another type) takes the general path, which
        // reads it the same way. The one difference: a field skipped here
        // may hold what JSON text can but a `Value` cannot (a lone
        // surrogate, a number out of range, nesting past 128), which the
        // general path refuses as not JSON and this reads.
        if data.starts_with('{')
            && let Ok(chunk) = serde_json::from_str::<Chunk>(data)
            && !chunk.error
        {
            return Ok(self.chunk(chunk));
        }
        self.value(data)
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

impl OpenAiParser {
    /// Any chunk, read as a `Value`: the general path.
    fn value(&mut self, data: &str) -> Result<Vec<Delta>, String> {
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
                let call = self.call(tc["index"].as_u64().unwrap_or(0) as usize);
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
                self.stop = Some(stop(reason));
            }
        }
        Ok(out)
    }

    /// A chunk of the common shape: the same reading as [`Self::value`].
    fn chunk(&mut self, chunk: Chunk) -> Vec<Delta> {
        if let Some(Obj(u)) = chunk.usage {
            self.usage = (
                u.prompt_tokens.unwrap_or(0),
                u.completion_tokens.unwrap_or(0),
            );
        }
        let mut out = Vec::new();
        for Obj(choice) in chunk.choices.into_iter().flatten() {
            if let Some(Obj(d)) = choice.delta {
                let text = |t: Option<String>| t.filter(|t| !t.is_empty());
                if let Some(t) = text(d.content) {
                    out.push(Delta::Text(t));
                }
                for t in [d.reasoning_content, d.reasoning] {
                    if let Some(t) = text(t) {
                        out.push(Delta::Thought(t));
                    }
                }
                if let Some(t) = text(d.refusal) {
                    out.push(Delta::Text(t));
                }
                for Obj(tc) in d.tool_calls.into_iter().flatten() {
                    let call = self.call(tc.index.unwrap_or(0) as usize);
                    if let Some(id) = tc.id {
                        call.id.push_str(&id);
                    }
                    if let Some(Obj(f)) = tc.function {
                        if let Some(name) = f.name {
                            call.name.push_str(&name);
                        }
                        if let Some(args) = f.arguments {
                            call.args.push_str(&args);
                        }
                    }
                    out.push(Delta::ToolProgress);
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.stop = Some(stop(&reason));
            }
        }
        out
    }

    /// The call streamed at `index` (made at its first piece).
    fn call(&mut self, index: usize) -> &mut RawCall {
        let pos = match self.calls.iter().position(|(i, _)| *i == index) {
            Some(p) => p,
            None => {
                self.calls.push((index, RawCall::default()));
                self.calls.len() - 1
            }
        };
        &mut self.calls[pos].1
    }
}

fn stop(reason: &str) -> Stop {
    match reason {
        "length" => Stop::MaxTokens,
        "content_filter" => Stop::Refusal,
        "tool_calls" | "function_call" => Stop::ToolUse,
        _ => Stop::EndTurn,
    }
}

/// A streamed chunk of the common shape: only the fields read are built.
/// A field of another type fails the whole read (and the chunk takes the
/// general path).
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<Obj<Choice>>>,
    #[serde(default)]
    usage: Option<Obj<Usage>>,
    /// Present at all (even `null`): the general path reports it.
    #[serde(default, deserialize_with = "present")]
    error: bool,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Obj<ChunkDelta>>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChunkDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<Obj<ToolCallPiece>>>,
}

#[derive(Deserialize)]
struct ToolCallPiece {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<Obj<FunctionPiece>>,
}

#[derive(Deserialize)]
struct FunctionPiece {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(d).map(|_| true)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{Chunk, OpenAiParser, Parser};
    use crate::model::tests::{junk, object, taken_of_1000, text, text_or_junk, with_key};

    fn chunk() -> BoxedStrategy<Value> {
        let function = prop_oneof![
            4 => object(vec![("name", text_or_junk().boxed()), ("arguments", text_or_junk().boxed())]),
            1 => junk(),
        ];
        let index = prop_oneof![4 => (0u64..3).prop_map(Value::from), 1 => junk()];
        let call = prop_oneof![
            4 => object(vec![
                ("index", index.boxed()),
                ("id", text_or_junk().boxed()),
                ("function", function.boxed()),
                ("type", text().boxed()),
            ]),
            1 => junk(),
        ];
        let calls = prop_oneof![
            4 => prop::collection::vec(call, 0..3).prop_map(Value::from),
            1 => junk(),
        ];
        let delta = prop_oneof![
            6 => object(vec![
                ("role", text().boxed()),
                ("content", text_or_junk().boxed()),
                ("reasoning_content", text_or_junk().boxed()),
                ("reasoning", text_or_junk().boxed()),
                ("refusal", text_or_junk().boxed()),
                ("tool_calls", calls.boxed()),
            ]),
            1 => junk(),
        ];
        let reason = prop_oneof![
            Just(json!("stop")),
            Just(json!("length")),
            Just(json!("tool_calls")),
            Just(json!("content_filter")),
            Just(json!("function_call")),
            junk(),
        ];
        let choice = prop_oneof![
            6 => object(vec![
                ("index", Just(json!(0)).boxed()),
                ("delta", delta.boxed()),
                ("finish_reason", reason.boxed()),
            ]),
            1 => junk(),
        ];
        let choices = prop_oneof![
            6 => prop::collection::vec(choice, 0..3).prop_map(Value::from),
            1 => junk(),
        ];
        let count = prop_oneof![4 => (0u64..100_000).prop_map(Value::from), 1 => junk()];
        let usage = prop_oneof![
            4 => object(vec![("prompt_tokens", count.clone().boxed()), ("completion_tokens", count.boxed())]),
            1 => junk(),
        ];
        let error = prop_oneof![
            Just(json!({"type": "server_error", "message": "overloaded"})),
            junk(),
        ];
        prop_oneof![
            // An `error` key in one chunk in ten (even `null`).
            20 => with_key(
                object(vec![
                    ("id", text().boxed()),
                    ("choices", choices.boxed()),
                    ("usage", usage.boxed()),
                ]),
                "error",
                proptest::option::weighted(0.1, error),
            ),
            1 => junk(),
        ]
        .boxed()
    }

    /// Most generated chunks take the fast path (else the property below
    /// would test the general path against itself).
    #[test]
    fn most_generated_chunks_take_the_fast_path() {
        let fast = taken_of_1000(&chunk(), |data| {
            serde_json::from_str::<Chunk>(data).is_ok_and(|c| !c.error)
        });
        assert!(fast > 400, "{fast} of 1000");
    }

    proptest! {
        /// The common shape's reader gives what the general path gives,
        /// chunk by chunk and in the end, for any chunk.
        #[test]
        fn the_fast_path_reads_every_chunk_as_the_general_path_does(
            chunks in prop::collection::vec(chunk(), 1..6),
        ) {
            let mut general = OpenAiParser::default();
            let mut fast = OpenAiParser::default();
            for c in &chunks {
                let data = c.to_string();
                prop_assert_eq!(fast.event("", &data), general.value(&data), "{}", data);
                prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"));
            }
            prop_assert_eq!(format!("{:?}", fast.finish(true)), format!("{:?}", general.finish(true)));
        }
    }

    /// The fast path is taken for what servers send (else the property
    /// above would hold trivially).
    #[test]
    fn real_chunks_take_the_fast_path() {
        for data in [
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel\"lo\n"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"read","arguments":"{\"pa"}}]},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#,
        ] {
            let chunk = serde_json::from_str::<Chunk>(data);
            assert!(chunk.is_ok_and(|c| !c.error), "{data}");
        }
        // An error goes the general way.
        let err = r#"{"error":{"type":"server_error","message":"overloaded"}}"#;
        assert!(serde_json::from_str::<Chunk>(err).is_ok_and(|c| c.error));
    }
}
