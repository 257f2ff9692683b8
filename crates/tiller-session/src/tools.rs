//! The session's tool pipeline: every call goes through the loop guard
//! before it starts (permission arrives with its issue), then executes. The
//! scripted engine's calls carry a simulated outcome; nothing on disk or in
//! processes is touched.

use std::hash::{DefaultHasher, Hash, Hasher};

use tiller_core::{CallKey, CallOutcome, LoopGuard, LoopType};
use tiller_engine::{ToolCall, ToolOutput, ToolResult};

use crate::event::{EventBody, ToolError, ToolStatus};

/// What a batch produced.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// Events to publish, in order.
    pub events: Vec<EventBody>,
    /// Results for the engine, one per call, in the batch's order.
    pub results: Vec<ToolResult>,
    /// Set when the loop guard stopped the batch.
    pub trip: Option<LoopType>,
}

/// Runs a batch in order. Every call ends `completed` or `failed`: when
/// the guard trips, the tripping call and every call after it fail with the
/// skip reason and never run; calls already completed keep their results.
pub fn run_batch(calls: &[ToolCall], guard: &mut LoopGuard) -> BatchOutcome {
    let mut out = BatchOutcome {
        events: Vec::with_capacity(calls.len() * 3),
        results: Vec::with_capacity(calls.len()),
        trip: None,
    };
    for call in calls {
        out.events.push(EventBody::ToolCall {
            tool_call_id: call.id.clone(),
            name: call.name.clone(),
            input: call.input.clone(),
            status: ToolStatus::Pending,
        });
        let key = CallKey {
            tool: call.name.clone(),
            args: canonical_json(&call.input),
        };
        let verdict = match out.trip {
            Some(t) => Err(t),
            None => guard.check(&key),
        };
        if let Err(loop_type) = verdict {
            out.trip = Some(loop_type);
            let message = skip_message(loop_type);
            metrics::counter!("tiller_tool_calls_total", "status" => "skipped").increment(1);
            out.events.push(EventBody::ToolCallUpdate {
                tool_call_id: call.id.clone(),
                status: ToolStatus::Failed,
                output: Some(message.clone()),
                error: Some(ToolError {
                    error_kind: "loop_detected".into(),
                    loop_type: Some(loop_type.as_str().into()),
                    code: "LOOP_DETECTED".into(),
                    message: message.clone(),
                }),
            });
            out.results.push(ToolResult {
                id: call.id.clone(),
                output: ToolOutput {
                    ok: false,
                    output: message,
                },
            });
            continue;
        }
        out.events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: ToolStatus::InProgress,
            output: None,
            error: None,
        });
        let output = execute(call);
        guard.finished(
            &key,
            CallOutcome {
                ok: output.ok,
                signature: signature(&output),
            },
        );
        metrics::counter!(
            "tiller_tool_calls_total",
            "status" => if output.ok { "completed" } else { "failed" }
        )
        .increment(1);
        out.events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: if output.ok {
                ToolStatus::Completed
            } else {
                ToolStatus::Failed
            },
            output: Some(output.output.clone()),
            error: None,
        });
        out.results.push(ToolResult {
            id: call.id.clone(),
            output,
        });
    }
    out
}

/// The text a skipped call carries (and the model would see).
pub fn skip_message(loop_type: LoopType) -> String {
    format!(
        "Skipped by loop protection ({loop_type}): {}. This call did not run.",
        loop_type.describe()
    )
}

fn execute(call: &ToolCall) -> ToolOutput {
    match &call.simulated {
        Some(out) => out.clone(),
        None => ToolOutput {
            ok: false,
            output: format!("no executor for tool `{}` in this daemon", call.name),
        },
    }
}

fn signature(out: &ToolOutput) -> u64 {
    let mut h = DefaultHasher::new();
    out.ok.hash(&mut h);
    out.output.hash(&mut h);
    h.finish()
}

/// JSON with object keys sorted at every level, so argument order never
/// makes two identical calls look different.
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn write(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<_> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::String(k.clone()).to_string());
                    out.push(':');
                    write(&m[k], out);
                }
                out.push('}');
            }
            serde_json::Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut s = String::new();
    write(v, &mut s);
    s
}

#[cfg(test)]
mod tests {
    use tiller_core::LoopConfig;

    use super::*;

    fn call(id: &str, input: serde_json::Value, ok: bool, output: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "read".into(),
            input,
            simulated: Some(ToolOutput {
                ok,
                output: output.into(),
            }),
        }
    }

    fn statuses(out: &BatchOutcome) -> Vec<(String, ToolStatus)> {
        out.events
            .iter()
            .filter_map(|e| match e {
                EventBody::ToolCallUpdate {
                    tool_call_id,
                    status,
                    ..
                } if *status != ToolStatus::InProgress => Some((tool_call_id.clone(), *status)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_call_ends_completed_or_failed() {
        let mut calls = vec![call("a", serde_json::json!({}), true, "fine")];
        calls.push(ToolCall {
            simulated: None,
            ..call("b", serde_json::json!({}), true, "")
        });
        let out = run_batch(&calls, &mut LoopGuard::new(LoopConfig::default()));
        assert_eq!(
            statuses(&out),
            vec![
                ("a".into(), ToolStatus::Completed),
                ("b".into(), ToolStatus::Failed)
            ]
        );
        assert!(out.results[0].output.ok && !out.results[1].output.ok);
        assert_eq!(out.trip, None);
    }

    #[test]
    fn six_identical_calls_run_four_and_fail_two() {
        // Argument order does not matter.
        let calls: Vec<_> = (0..6)
            .map(|i| {
                let input = if i % 2 == 0 {
                    serde_json::json!({"a": 1, "b": 2})
                } else {
                    serde_json::json!({"b": 2, "a": 1})
                };
                call(&format!("c{i}"), input, true, "same")
            })
            .collect();
        let out = run_batch(&calls, &mut LoopGuard::new(LoopConfig::default()));
        assert_eq!(out.trip, Some(LoopType::ConsecutiveIdenticalToolCalls));
        let s = statuses(&out);
        assert_eq!(s.len(), 6, "no call stays pending");
        assert!(s[..4].iter().all(|(_, st)| *st == ToolStatus::Completed));
        assert!(s[4..].iter().all(|(_, st)| *st == ToolStatus::Failed));
        let skipped = out
            .events
            .iter()
            .filter(|e| matches!(e, EventBody::ToolCallUpdate { error: Some(_), .. }))
            .count();
        assert_eq!(skipped, 2);
        assert_eq!(out.results.len(), 6);
    }

    #[test]
    fn canonical_json_sorts_keys_deeply() {
        let a = serde_json::json!({"z": [{"y": 1, "x": 2}], "a": "s"});
        assert_eq!(canonical_json(&a), r#"{"a":"s","z":[{"x":2,"y":1}]}"#);
    }
}
