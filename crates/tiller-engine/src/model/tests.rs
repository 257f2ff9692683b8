use proptest::prelude::*;
use serde_json::json;

use super::anthropic::AnthropicParser;
use super::openai::OpenAiParser;
use super::*;
use crate::ToolSpec;

/// Feeds `data` events; collects deltas.
fn feed(p: &mut dyn Parser, events: &[(&str, String)]) -> Result<Vec<Delta>, String> {
    let mut out = Vec::new();
    for (e, d) in events {
        out.extend(p.event(e, d)?);
    }
    Ok(out)
}

/// Splits `s` at the given (sorted, deduplicated) char boundaries.
fn split(s: &str, cuts: &[usize]) -> Vec<String> {
    let mut parts = Vec::new();
    let mut last = 0;
    for &c in cuts {
        if c > last && c < s.len() && s.is_char_boundary(c) {
            parts.push(s[last..c].to_owned());
            last = c;
        }
    }
    parts.push(s[last..].to_owned());
    parts
}

fn openai_tool_chunks(
    index: usize,
    id: &str,
    name: &str,
    args: &[String],
) -> Vec<(&'static str, String)> {
    let mut v = vec![(
        "",
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}
        ]}}]})
        .to_string(),
    )];
    for a in args {
        v.push((
            "",
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": index, "function": {"arguments": a}}
            ]}}]})
            .to_string(),
        ));
    }
    v
}

proptest! {
    /// However the arguments of two parallel calls are split and
    /// interleaved, the finished calls carry the whole arguments.
    #[test]
    fn openai_parallel_calls_survive_any_split(
        cuts_a in proptest::collection::vec(0usize..40, 0..8),
        cuts_b in proptest::collection::vec(0usize..40, 0..8),
        interleave in any::<bool>(),
    ) {
        let args_a = r#"{"path":"src/main.rs","note":"ünïcode ✓"}"#;
        let args_b = r#"{"pattern":"fn main","glob":"**/*.rs"}"#;
        let mut ca = cuts_a; ca.sort_unstable(); ca.dedup();
        let mut cb = cuts_b; cb.sort_unstable(); cb.dedup();
        let a = openai_tool_chunks(0, "call_a", "read_file", &split(args_a, &ca));
        let b = openai_tool_chunks(1, "call_b", "grep", &split(args_b, &cb));
        let mut events = Vec::new();
        if interleave {
            let (mut ia, mut ib) = (a.into_iter(), b.into_iter());
            loop {
                match (ia.next(), ib.next()) {
                    (None, None) => break,
                    (x, y) => { events.extend(x); events.extend(y); }
                }
            }
        } else {
            events.extend(a);
            events.extend(b);
        }
        events.push(("", json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}).to_string()));
        events.push(("", "[DONE]".to_owned()));
        let mut p = OpenAiParser::default();
        feed(&mut p, &events).unwrap();
        let f = p.finish(false).unwrap();
        prop_assert_eq!(f.stop, Stop::ToolUse);
        prop_assert_eq!(f.calls.len(), 2);
        prop_assert_eq!(parse_args(&f.calls[0].args), serde_json::from_str::<serde_json::Value>(args_a).unwrap());
        prop_assert_eq!(&f.calls[1].name, "grep");
        prop_assert_eq!(parse_args(&f.calls[1].args), serde_json::from_str::<serde_json::Value>(args_b).unwrap());
    }

    /// The same for Anthropic's `input_json_delta`.
    #[test]
    fn anthropic_tool_input_survives_any_split(cuts in proptest::collection::vec(0usize..40, 0..10)) {
        let args = r#"{"command":"ls -la","timeout_ms":5000}"#;
        let mut c = cuts; c.sort_unstable(); c.dedup();
        let mut events = vec![
            ("message_start", json!({"type":"message_start","message":{"usage":{"input_tokens":12,"output_tokens":1}}}).to_string()),
            ("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"toolu_1","name":"shell","input":{}}}).to_string()),
        ];
        for part in split(args, &c) {
            events.push(("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":part}}).to_string()));
        }
        events.push(("content_block_stop", json!({"type":"content_block_stop","index":0}).to_string()));
        events.push(("message_delta", json!({"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":30}}).to_string()));
        events.push(("message_stop", json!({"type":"message_stop"}).to_string()));
        let mut p = AnthropicParser::default();
        feed(&mut p, &events).unwrap();
        let f = p.finish(false).unwrap();
        prop_assert_eq!(f.stop, Stop::ToolUse);
        prop_assert_eq!(f.usage, (12, 30));
        prop_assert_eq!(parse_args(&f.calls[0].args), serde_json::from_str::<serde_json::Value>(args).unwrap());
    }
}

#[test]
fn openai_text_usage_and_stop_reasons() {
    for (reason, stop) in [
        ("stop", Stop::EndTurn),
        ("length", Stop::MaxTokens),
        ("content_filter", Stop::Refusal),
    ] {
        let mut p = OpenAiParser::default();
        let d = feed(
            &mut p,
            &[
                ("", json!({"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}).to_string()),
                ("", json!({"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}).to_string()),
                ("", json!({"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":reason}]}).to_string()),
                ("", json!({"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}).to_string()),
                ("", "[DONE]".into()),
            ],
        )
        .unwrap();
        assert_eq!(
            d,
            vec![
                Delta::Text("Hel".into()),
                Delta::Thought("hmm".into()),
                Delta::Text("lo".into())
            ]
        );
        let f = p.finish(false).unwrap();
        assert_eq!((f.stop, f.usage), (stop, (7, 2)), "{reason}");
    }
}

#[test]
fn incomplete_streams_have_no_finish() {
    let mut p = OpenAiParser::default();
    feed(
        &mut p,
        &[(
            "",
            json!({"choices":[{"index":0,"delta":{"content":"Hi"}}]}).to_string(),
        )],
    )
    .unwrap();
    assert_eq!(p.finish(false), None);
    let mut a = AnthropicParser::default();
    feed(
        &mut a,
        &[("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}).to_string())],
    )
    .unwrap();
    assert_eq!(a.finish(true), None);
}

#[test]
fn errors_mid_stream_are_reported() {
    let mut p = OpenAiParser::default();
    let e = p
        .event(
            "",
            &json!({"error":{"message":"overloaded","type":"server_error"}}).to_string(),
        )
        .unwrap_err();
    assert!(e.contains("server_error: overloaded"), "{e}");
    let mut a = AnthropicParser::default();
    let e = a
        .event(
            "error",
            &json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}})
                .to_string(),
        )
        .unwrap_err();
    assert!(e.contains("overloaded_error: Overloaded"), "{e}");
    assert!(OpenAiParser::default().event("", "{not json").is_err());
}

#[test]
fn anthropic_text_thinking_and_refusal() {
    let mut p = AnthropicParser::default();
    let d = feed(
        &mut p,
        &[
            ("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}).to_string()),
            ("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"consider"}}).to_string()),
            ("content_block_start", json!({"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}).to_string()),
            ("content_block_delta", json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"No."}}).to_string()),
            ("ping", json!({"type":"ping"}).to_string()),
            ("message_delta", json!({"type":"message_delta","delta":{"stop_reason":"refusal"},"usage":{"output_tokens":3}}).to_string()),
            ("message_stop", json!({"type":"message_stop"}).to_string()),
        ],
    )
    .unwrap();
    assert_eq!(
        d,
        vec![Delta::Thought("consider".into()), Delta::Text("No.".into())]
    );
    assert_eq!(p.finish(false).unwrap().stop, Stop::Refusal);
}

fn cfg(provider: Provider) -> ModelConfig {
    ModelConfig {
        name: "t".into(),
        provider,
        base_url: "http://127.0.0.1:1".into(),
        model: "m".into(),
        models: vec![],
        api_key_env: None,
        max_tokens: None,
        temperature: None,
        system_prompt: Some("be brief".into()),
        system_prompt_append: None,
        request_timeout: Duration::from_secs(5),
        max_retries: 0,
        retry_base: Duration::from_millis(10),
        max_requests_per_turn: 10,
        context_chars: 100_000,
        context_window: 128_000,
        compact_at: 0.8,
        prices: None,
    }
}

fn conversation() -> Vec<Message> {
    vec![
        Message::User {
            text: "list".into(),
        },
        Message::Assistant {
            text: "Looking.".into(),
            calls: vec![
                CallRecord {
                    id: "a".into(),
                    name: "list_dir".into(),
                    input: json!({"path": "."}),
                },
                CallRecord {
                    id: "b".into(),
                    name: "glob".into(),
                    input: json!({"pattern": "*"}),
                },
            ],
        },
        Message::ToolResult {
            id: "a".into(),
            ok: true,
            output: "x".into(),
        },
        Message::User {
            text: "steer: only rust".into(),
        },
        Message::ToolResult {
            id: "b".into(),
            ok: false,
            output: "no".into(),
        },
    ]
}

#[test]
fn anthropic_body_groups_user_side_blocks_results_first() {
    let b = anthropic::body(
        &cfg(Provider::Anthropic),
        "m",
        "be brief",
        &conversation(),
        &[],
        false,
    );
    assert_eq!(b["system"], "be brief");
    assert_eq!(b["max_tokens"], 8192);
    let msgs = b["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 3);
    let last: Vec<&str> = msgs[2]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(last, ["tool_result", "tool_result", "text"]);
    assert_eq!(msgs[2]["content"][1]["is_error"], true);
    assert_eq!(msgs[1]["content"][1]["type"], "tool_use");
}

#[test]
fn openai_body_carries_calls_and_results() {
    let tools = vec![ToolSpec {
        name: "glob".into(),
        description: "d".into(),
        input_schema: json!({"type": "object"}),
        kind: ToolKind::Read,
    }];
    let b = openai::body(
        &cfg(Provider::OpenAi),
        "m",
        "be brief",
        &conversation(),
        &tools,
    );
    let msgs = b["messages"].as_array().unwrap();
    assert_eq!(msgs[0]["role"], "system");
    assert_eq!(
        msgs[2]["tool_calls"][1]["function"]["arguments"],
        r#"{"pattern":"*"}"#
    );
    assert_eq!(msgs[3]["role"], "tool");
    assert_eq!(b["tools"][0]["function"]["name"], "glob");
    assert_eq!(b["stream"], true);
}

#[test]
fn args_parse_leniently() {
    assert_eq!(parse_args(""), json!({}));
    assert_eq!(parse_args("{\"a\":1}"), json!({"a": 1}));
    assert_eq!(parse_args("{\"a\":"), json!("{\"a\":"));
}

// Strategies for the parsers' property tests: what a server might send.

/// Anything a server might put where a field is expected.
pub(super) fn junk() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        Just(json!(18446744073709551615u64)),
        Just(json!(1e30)),
        Just(json!(-1)),
        Just(json!(2.5)),
        text(),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Text, escapes and non-ASCII included.
pub(super) fn text() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(String::new()),
        "[a-z ]{1,8}",
        "[\"\\\\\n\t/é€😀a]{1,6}",
    ]
    .prop_map(serde_json::Value::from)
}

pub(super) fn text_or_junk() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![4 => text(), 1 => junk()]
}

/// An object with each of `fields` present or not.
pub(super) fn object(
    fields: Vec<(&'static str, BoxedStrategy<serde_json::Value>)>,
) -> BoxedStrategy<serde_json::Value> {
    let parts: Vec<_> = fields
        .into_iter()
        .map(|(k, v)| proptest::option::weighted(0.6, v).prop_map(move |v| (k, v)))
        .collect();
    parts
        .prop_map(|kvs| {
            let mut m = serde_json::Map::new();
            for (k, v) in kvs {
                if let Some(v) = v {
                    m.insert(k.to_owned(), v);
                }
            }
            serde_json::Value::Object(m)
        })
        .boxed()
}

/// `object` with `key` set to a value of `value` (when it gives one).
pub(super) fn with_key(
    object: BoxedStrategy<serde_json::Value>,
    key: &'static str,
    value: impl Strategy<Value = Option<serde_json::Value>> + 'static,
) -> BoxedStrategy<serde_json::Value> {
    (object, value)
        .prop_map(move |(mut o, v)| {
            if let (serde_json::Value::Object(m), Some(v)) = (&mut o, v) {
                m.insert(key.into(), v);
            }
            o
        })
        .boxed()
}

/// How many of 1,000 values of `strategy` (deterministic), as JSON text,
/// `fast` takes.
pub(super) fn taken_of_1000(
    strategy: &BoxedStrategy<serde_json::Value>,
    fast: impl Fn(&str) -> bool,
) -> usize {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    (0..1000)
        .filter(|_| {
            fast(
                &strategy
                    .new_tree(&mut runner)
                    .unwrap()
                    .current()
                    .to_string(),
            )
        })
        .count()
}
