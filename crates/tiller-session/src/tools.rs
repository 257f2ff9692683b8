//! The session's tool pipeline. Each call goes through the pipeline's stages
//! before it starts (loop guard and permission arrive with their issues),
//! then executes. The scripted engine's calls carry a simulated outcome;
//! nothing on disk or in processes is touched.

use tiller_engine::{ToolCall, ToolOutput, ToolResult};

use crate::event::{EventBody, ToolStatus};

/// Runs a batch in order. Returns the events to publish and the results for
/// the engine. Every call ends in a terminal status: none stays pending.
pub fn run_batch(calls: &[ToolCall]) -> (Vec<EventBody>, Vec<ToolResult>) {
    let mut events = Vec::with_capacity(calls.len() * 3);
    let mut results = Vec::with_capacity(calls.len());
    for call in calls {
        events.push(EventBody::ToolCall {
            tool_call_id: call.id.clone(),
            name: call.name.clone(),
            input: call.input.clone(),
            status: ToolStatus::Pending,
        });
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: ToolStatus::InProgress,
            output: None,
        });
        let output = execute(call);
        metrics::counter!(
            "tiller_tool_calls_total",
            "status" => if output.ok { "completed" } else { "failed" }
        )
        .increment(1);
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: if output.ok {
                ToolStatus::Completed
            } else {
                ToolStatus::Failed
            },
            output: Some(output.output.clone()),
        });
        results.push(ToolResult {
            id: call.id.clone(),
            output,
        });
    }
    (events, results)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_ends_completed_or_failed() {
        let calls = vec![
            ToolCall {
                id: "a".into(),
                name: "x".into(),
                input: serde_json::json!({}),
                simulated: Some(ToolOutput {
                    ok: true,
                    output: "fine".into(),
                }),
            },
            ToolCall {
                id: "b".into(),
                name: "y".into(),
                input: serde_json::json!({}),
                simulated: None,
            },
        ];
        let (events, results) = run_batch(&calls);
        assert_eq!(events.len(), 6);
        assert_eq!(
            events[2],
            EventBody::ToolCallUpdate {
                tool_call_id: "a".into(),
                status: ToolStatus::Completed,
                output: Some("fine".into())
            }
        );
        assert!(matches!(
            &events[5],
            EventBody::ToolCallUpdate {
                status: ToolStatus::Failed,
                ..
            }
        ));
        assert!(results[0].output.ok && !results[1].output.ok);
    }
}
