//! Reading an ACP agent's messages into signals, and writing Tiller's
//! answers back. Pure: JSON in, values out; anything unexpected is left
//! out rather than guessed.

use serde_json::{Value, json};
use tiller_core::StopReason;

use super::child::Caps;
use crate::{
    AgentOption, FileOp, Hosted, HostedCall, PermissionAnswer, SignalKind, ToolKind, Update,
};

/// What `initialize` says the agent can do.
pub(super) fn caps(init: &Value) -> Caps {
    let a = &init["agentCapabilities"];
    Caps {
        load: a["loadSession"].as_bool().unwrap_or(false),
        resume: !a
            .pointer("/sessionCapabilities/resume")
            .is_none_or(Value::is_null),
        steering: init
            .pointer("/_meta/steering/supported")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        images: a
            .pointer("/promptCapabilities/image")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    }
}

/// A `session/prompt` answer's stop reason (an unknown one ends the turn).
pub(super) fn stop_reason(answer: &Value) -> StopReason {
    match answer["stopReason"].as_str() {
        Some("max_tokens") => StopReason::MaxTokens,
        Some("max_turn_requests") => StopReason::MaxTurnRequests,
        Some("refusal") => StopReason::Refusal,
        Some("cancelled") => StopReason::Cancelled,
        _ => StopReason::EndTurn,
    }
}

/// The agent's options in a `session/new` (load, resume,
/// `set_config_option`) answer: its select `configOptions`, else its
/// `modes` as an option `mode`.
pub(super) fn options(answer: &Value) -> Option<Vec<AgentOption>> {
    if let Some(list) = answer["configOptions"].as_array() {
        return Some(
            list.iter()
                .filter_map(|o| {
                    let choices: Vec<String> = o["options"]
                        .as_array()?
                        .iter()
                        .flat_map(|c| {
                            // Grouped options hold their own lists.
                            match c["options"].as_array() {
                                Some(group) => group.iter().collect::<Vec<_>>(),
                                None => vec![c],
                            }
                        })
                        .filter_map(|c| c["value"].as_str().map(str::to_owned))
                        .collect();
                    Some(AgentOption {
                        id: o["id"].as_str()?.to_owned(),
                        name: o["name"].as_str().unwrap_or_default().to_owned(),
                        category: o["category"].as_str().unwrap_or("other").to_owned(),
                        current: o["currentValue"].as_str()?.to_owned(),
                        choices,
                    })
                })
                .take(32)
                .collect(),
        );
    }
    let modes = answer.get("modes").filter(|m| m.is_object())?;
    Some(vec![AgentOption {
        id: "mode".into(),
        name: "Mode".into(),
        category: "mode".into(),
        current: modes["currentModeId"].as_str()?.to_owned(),
        choices: modes["availableModes"]
            .as_array()?
            .iter()
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .collect(),
    }])
}

/// An `available_commands` list as `(name, description)`.
pub(super) fn commands(list: &Value) -> Vec<(String, String)> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let name = c["name"].as_str()?.trim_start_matches('/');
            (!name.is_empty()).then(|| {
                (
                    name.to_owned(),
                    c["description"].as_str().unwrap_or_default().to_owned(),
                )
            })
        })
        .take(200)
        .collect()
}

/// The signals of one `session/update`.
pub(super) fn update(u: &Value) -> Vec<SignalKind> {
    let text = || u.pointer("/content/text").and_then(Value::as_str);
    let kind = match u["sessionUpdate"].as_str().unwrap_or_default() {
        "agent_message_chunk" => text().map(|t| SignalKind::Update(Update::Text(t.to_owned()))),
        "agent_thought_chunk" => text().map(|t| SignalKind::Update(Update::Thought(t.to_owned()))),
        "tool_call" | "tool_call_update" => {
            Some(SignalKind::Hosted(Hosted::Call(Box::new(call(u)))))
        }
        "plan" => Some(SignalKind::Update(Update::Plan(
            u["entries"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    (
                        e["content"].as_str().unwrap_or_default().to_owned(),
                        e["status"].as_str().unwrap_or("pending").to_owned(),
                    )
                })
                .collect(),
        ))),
        "usage_update" => Some(SignalKind::Update(Update::Context {
            used: u["used"].as_u64().unwrap_or(0),
            size: u["size"].as_u64().unwrap_or(0),
            cost: u["cost"]["amount"].as_f64().map(|a| {
                (
                    a,
                    u["cost"]["currency"].as_str().unwrap_or("USD").to_owned(),
                )
            }),
        })),
        "session_info_update" => u["title"]
            .as_str()
            .filter(|t| !t.trim().is_empty())
            .map(|t| SignalKind::Update(Update::Title(t.to_owned()))),
        "available_commands_update" => Some(SignalKind::Hosted(Hosted::Commands(commands(
            &u["availableCommands"],
        )))),
        "config_option_update" => options(u).map(|o| SignalKind::Hosted(Hosted::Options(o))),
        // The user's own words (Tiller has them), modes and options Tiller
        // does not relay yet.
        _ => None,
    };
    kind.into_iter().collect()
}

/// A `tool_call`, `tool_call_update` or a permission request's `toolCall`.
pub(super) fn call(c: &Value) -> HostedCall {
    let s = |k: &str| c[k].as_str().map(str::to_owned);
    let name = c
        .pointer("/_meta/claudeCode/toolName")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| s("title"));
    let output = c["content"].as_array().and_then(|blocks| {
        let text: Vec<&str> = blocks
            .iter()
            .filter_map(|b| {
                b.pointer("/content/text")
                    .or_else(|| b.get("newText"))
                    .and_then(Value::as_str)
            })
            .collect();
        (!text.is_empty()).then(|| text.join("\n"))
    });
    let output = output.or_else(|| match &c["rawOutput"] {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        v => Some(v.to_string()),
    });
    let diff = c["content"].as_array().and_then(|blocks| {
        let d = blocks.iter().find(|b| b["type"] == "diff")?;
        Some((
            d["path"].as_str()?.to_owned(),
            d["oldText"].as_str().map(str::to_owned),
            d["newText"].as_str()?.to_owned(),
        ))
    });
    HostedCall {
        diff,
        id: s("toolCallId").unwrap_or_default(),
        name,
        title: s("title"),
        kind: c["kind"].as_str().map(|k| match k {
            "read" | "search" => ToolKind::Read,
            "edit" | "delete" | "move" => ToolKind::Edit,
            "execute" => ToolKind::Execute,
            _ => ToolKind::Other,
        }),
        acp_kind: s("kind"),
        status: s("status"),
        // Agents announce a call with `{}` before its arguments stream in.
        input: c
            .get("rawInput")
            .filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
            .cloned(),
        output,
        locations: c["locations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["path"].as_str().map(str::to_owned))
            .collect(),
    }
}

/// The agent's option for Tiller's answer: the first of the same kind
/// (an "always" answer falls back to "once" and back), else `cancelled`.
pub(super) fn permission_outcome(answer: PermissionAnswer, options: Option<&Value>) -> Value {
    let wanted: &[&str] = match answer {
        // Never the agent's "always": it may cover its whole tool.
        PermissionAnswer::AllowOnce => &["allow_once"],
        PermissionAnswer::AllowAlways => &["allow_always", "allow_once"],
        // Nor its "never": a person's "deny" is for this call.
        PermissionAnswer::Reject => &["reject_once"],
        PermissionAnswer::Cancelled => &[],
    };
    let options = options.and_then(Value::as_array);
    let chosen = wanted.iter().find_map(|kind| {
        options?
            .iter()
            .find(|o| o["kind"].as_str() == Some(kind))
            .and_then(|o| o["optionId"].as_str())
    });
    match chosen {
        Some(id) => json!({"outcome": {"outcome": "selected", "optionId": id}}),
        None => json!({"outcome": {"outcome": "cancelled"}}),
    }
}

/// The result of a served file request: the text for a read, nothing for
/// a write.
pub(super) fn file_result(text: String) -> Value {
    json!({ "content": text })
}

/// An `fs/*` request's operation.
pub(super) fn file_op(method: &str, p: &Value) -> Option<FileOp> {
    let path = p["path"].as_str()?.to_owned();
    Some(match method {
        "fs/read_text_file" => FileOp::Read {
            path,
            line: p["line"].as_u64(),
            limit: p["limit"].as_u64(),
        },
        _ => FileOp::Write {
            path,
            content: p["content"].as_str()?.to_owned(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_answers_pick_the_agents_option_of_the_same_kind() {
        let opts = json!([
            {"optionId": "a1", "kind": "allow_always", "name": "Always"},
            {"optionId": "o1", "kind": "allow_once", "name": "Once"},
            {"optionId": "r1", "kind": "reject_once", "name": "No"},
        ]);
        let pick = |a| permission_outcome(a, Some(&opts))["outcome"]["optionId"].clone();
        assert_eq!(pick(PermissionAnswer::AllowOnce), "o1");
        assert_eq!(pick(PermissionAnswer::AllowAlways), "a1");
        assert_eq!(pick(PermissionAnswer::Reject), "r1");
        assert_eq!(
            permission_outcome(PermissionAnswer::Cancelled, Some(&opts))["outcome"]["outcome"],
            "cancelled"
        );
        // No option of that kind: never a guess.
        let only = json!([{"optionId": "o1", "kind": "allow_once", "name": "Once"}]);
        assert_eq!(
            permission_outcome(PermissionAnswer::Reject, Some(&only))["outcome"]["outcome"],
            "cancelled"
        );
        // "Once" is never answered with the agent's "always" (which may
        // cover its whole tool for the rest of its session).
        let no_once = json!([
            {"optionId": "a1", "kind": "allow_always", "name": "Always"},
            {"optionId": "r1", "kind": "reject_once", "name": "No"},
        ]);
        assert_eq!(
            permission_outcome(PermissionAnswer::AllowOnce, Some(&no_once))["outcome"]["outcome"],
            "cancelled"
        );
        // Nor "deny" with its "deny always".
        let never = json!([
            {"optionId": "o1", "kind": "allow_once", "name": "Once"},
            {"optionId": "n1", "kind": "reject_always", "name": "Never"},
        ]);
        assert_eq!(
            permission_outcome(PermissionAnswer::Reject, Some(&never))["outcome"]["outcome"],
            "cancelled"
        );
    }

    #[test]
    fn updates_become_signals() {
        let cases = [
            (
                json!({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hi"}}),
                Some(SignalKind::Update(Update::Text("hi".into()))),
            ),
            (
                json!({"sessionUpdate": "usage_update", "used": 10, "size": 100}),
                Some(SignalKind::Update(Update::Context {
                    used: 10,
                    size: 100,
                    cost: None,
                })),
            ),
            (
                json!({"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "me"}}),
                None,
            ),
            (json!({"sessionUpdate": "mystery"}), None),
        ];
        for (u, want) in cases {
            assert_eq!(update(&u).into_iter().next(), want, "{u}");
        }
        let c = call(&json!({
            "toolCallId": "t1", "title": "Write a.txt", "kind": "edit", "status": "pending",
            "rawInput": {"file_path": "/x/a.txt"}, "locations": [{"path": "/x/a.txt"}],
            "_meta": {"claudeCode": {"toolName": "Write"}}
        }));
        assert_eq!(c.name.as_deref(), Some("Write"));
        assert_eq!(c.kind, Some(ToolKind::Edit));
        assert_eq!(c.locations, ["/x/a.txt"]);
    }
}
