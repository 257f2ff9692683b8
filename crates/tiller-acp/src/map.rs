//! Mapping between the session log and ACP's wire types.

use std::path::PathBuf;

use agent_client_protocol_schema::v1::{
    AvailableCommand, AvailableCommandInput, AvailableCommandsUpdate, CompactionStatus,
    CompactionUpdate, ConfigOptionUpdate, ContentBlock, ContentChunk, Cost, CurrentModeUpdate,
    Diff, EmbeddedResourceResource, ImageContent, McpServer, MessageId, PermissionOption,
    PermissionOptionKind, Plan, PlanEntry, PlanEntryPriority, PlanEntryStatus,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse,
    SessionConfigOption, SessionConfigOptionCategory, SessionConfigSelectOption, SessionInfoUpdate,
    SessionMode, SessionModeState, SessionNotification, SessionUpdate, StopReason as AcpStop,
    ToolCall, ToolCallContent, ToolCallLocation, ToolCallStatus, ToolCallUpdate,
    ToolCallUpdateFields, ToolKind, UnstructuredCommandInput, UsageUpdate,
};
use serde_json::{Value, json};
use tiller_core::{PromptId, SessionId, StopReason, Terminal};
use tiller_session::{ConfigOption, EventBody, EventRecord, ToolStatus};
use tiller_tools::McpServerConfig;

use crate::jsonrpc::{RpcError, code};

/// The `session/update` line (a JSON-RPC notification) an event shows as,
/// if any: [`session_update`] serialized, with streamed text chunks, nearly
/// every event of a turn, written straight to the line instead
/// ([`chunk_line`]: the same bytes at a fraction of the cost).
pub fn update_line(rec: &EventRecord, message: Option<&str>, booleans: bool) -> Option<String> {
    chunk_line(rec, message)
        .or_else(|| session_update(rec, message, booleans).map(|n| update_message(&n)))
}

/// A `session/update` notification, serialized.
pub fn update_message(n: &SessionNotification) -> String {
    crate::jsonrpc::notification_of("session/update", n)
}

/// The `session/update` line of an agent message or thought chunk, written
/// directly: byte for byte what serializing [`session_update`]'s
/// notification gives (property-tested against it), without building the
/// schema's types and a `_meta` map for each chunk.
fn chunk_line(rec: &EventRecord, message: Option<&str>) -> Option<String> {
    let (kind, text) = match &rec.body {
        EventBody::AgentMessageChunk { text } => ("agent_message_chunk", text),
        EventBody::AgentThoughtChunk { text } => ("agent_thought_chunk", text),
        _ => return None,
    };
    let mut out: Vec<u8> = Vec::with_capacity(text.len() + 300);
    // Ids written from their canonical form, encoded on the stack.
    let mut id = [0; 36];
    let wrote: std::io::Result<()> = (|| {
        out.extend_from_slice(
            br#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":""#,
        );
        out.extend_from_slice(rec.session.encode(&mut id).as_bytes());
        out.extend_from_slice(br#"","update":{"sessionUpdate":""#);
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(br#"","content":{"type":"text","text":"#);
        serde_json::to_writer(&mut out, text)?;
        out.push(b'}');
        if let Some(m) = message {
            out.extend_from_slice(br#","messageId":"#);
            serde_json::to_writer(&mut out, m)?;
        }
        out.push(b'}');
        if rec.prompt.is_some() || rec.turn.is_some() {
            out.extend_from_slice(br#","_meta":{"tiller":{"#);
            if let Some(p) = rec.prompt {
                out.extend_from_slice(br#""promptId":""#);
                out.extend_from_slice(p.encode(&mut id).as_bytes());
                out.push(b'"');
            }
            if let Some(t) = rec.turn {
                if rec.prompt.is_some() {
                    out.push(b',');
                }
                out.extend_from_slice(br#""turnId":"#);
                out.extend_from_slice(itoa::Buffer::new().format(t.0).as_bytes());
            }
            out.extend_from_slice(b"}}");
        }
        out.extend_from_slice(b"}}");
        Ok(())
    })();
    wrote.expect("writing to memory does not fail");
    Some(String::from_utf8(out).expect("JSON is UTF-8"))
}

/// The `session/update` an event shows as, if any. Message chunks carry
/// `message` as their `messageId` (a user message: its prompt's id), and
/// every update names its prompt and turn in `_meta.tiller`.
/// `booleans`: the client takes boolean config options.
pub fn session_update(
    rec: &EventRecord,
    message: Option<&str>,
    booleans: bool,
) -> Option<SessionNotification> {
    let chunk = |text: &String| {
        ContentChunk::new(ContentBlock::from(text.clone())).message_id(message.map(MessageId::new))
    };
    let update = match &rec.body {
        EventBody::UserMessage { text, .. } => {
            let id = rec.prompt.map(|p| MessageId::new(p.to_string()));
            SessionUpdate::UserMessageChunk(
                ContentChunk::new(ContentBlock::from(text.clone())).message_id(id),
            )
        }
        EventBody::AgentMessageChunk { text } => SessionUpdate::AgentMessageChunk(chunk(text)),
        EventBody::AgentThoughtChunk { text } => SessionUpdate::AgentThoughtChunk(chunk(text)),
        EventBody::Plan { entries } => SessionUpdate::Plan(Plan::new(
            entries
                .iter()
                .map(|e| {
                    let status = match e.status.as_str() {
                        "in_progress" => PlanEntryStatus::InProgress,
                        "completed" => PlanEntryStatus::Completed,
                        _ => PlanEntryStatus::Pending,
                    };
                    PlanEntry::new(e.content.clone(), PlanEntryPriority::Medium, status)
                })
                .collect(),
        )),
        EventBody::ToolCall {
            tool_call_id,
            name,
            input,
            status,
            locations,
            kind,
        } => SessionUpdate::ToolCall(
            ToolCall::new(tool_call_id.clone(), name.clone())
                .kind(kind.map_or_else(|| tool_kind(name), acp_kind))
                .status(tool_status(*status))
                .raw_input(input.clone())
                .locations(acp_locations(locations)),
        ),
        EventBody::ToolCallUpdate {
            tool_call_id,
            status,
            output,
            error,
        } => {
            let mut fields = ToolCallUpdateFields::new().status(tool_status(*status));
            if let Some(e) = error {
                // Skipped by loop protection: the reason as content, and
                // structured details clients can localize from.
                fields = fields
                    .content(vec![ToolCallContent::from(ContentBlock::from(
                        e.message.clone(),
                    ))])
                    .raw_output(json!({
                        "error": e.message,
                        "errorKind": e.error_kind,
                        "loopType": e.loop_type,
                        "code": e.code,
                    }));
            } else if let Some(out) = output {
                // Editors show `content`; keep it short, the raw output whole.
                let shown: String = out.chars().take(8 * 1024).collect();
                fields = fields
                    .content(vec![ToolCallContent::from(ContentBlock::from(shown))])
                    .raw_output(Value::String(out.clone()));
            }
            SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(tool_call_id.clone(), fields))
        }
        EventBody::ConfigOptions { options } => SessionUpdate::ConfigOptionUpdate(
            ConfigOptionUpdate::new(config_options(options, booleans)),
        ),
        // Old logs carry no window: nothing to report against.
        EventBody::Usage {
            input_tokens,
            output_tokens,
            context_window,
            cost,
        } if *context_window > 0 => SessionUpdate::UsageUpdate(
            UsageUpdate::new(input_tokens + output_tokens, *context_window).cost(
                cost.as_ref()
                    .map(|c| Cost::new(c.amount, c.currency.clone())),
            ),
        ),
        EventBody::AgentCommands { commands } => {
            SessionUpdate::AvailableCommandsUpdate(AvailableCommandsUpdate::new(command_list(
                commands
                    .iter()
                    .map(|c| AvailableCommand::new(c.name.clone(), c.description.clone())),
            )))
        }
        EventBody::SessionInfo { title } => SessionUpdate::SessionInfoUpdate(
            SessionInfoUpdate::new()
                .title(title.clone())
                .updated_at(crate::conn::rfc3339(rec.ts_ms)),
        ),
        _ => return None,
    };
    Some(SessionNotification::new(rec.session.to_string(), update).meta(turn_meta(rec)))
}

/// `{"tiller": {"promptId", "turnId"}}`: which prompt and turn an update
/// belongs to, so a client with several attached can tell turns apart.
fn turn_meta(rec: &EventRecord) -> Option<serde_json::Map<String, Value>> {
    if rec.prompt.is_none() && rec.turn.is_none() {
        return None;
    }
    let mut tiller = serde_json::Map::new();
    if let Some(p) = rec.prompt {
        tiller.insert("promptId".into(), Value::String(p.to_string()));
    }
    if let Some(t) = rec.turn {
        tiller.insert("turnId".into(), json!(t.0));
    }
    let mut meta = serde_json::Map::new();
    meta.insert("tiller".into(), Value::Object(tiller));
    Some(meta)
}

/// The paths a call works on, as ACP locations.
fn acp_locations(paths: &[String]) -> Vec<ToolCallLocation> {
    paths
        .iter()
        .map(|p| ToolCallLocation::new(PathBuf::from(p)))
        .collect()
}

/// ACP's kind of a tool, by name (MCP tools are `other`).
/// A hosted agent's own kind, as ACP names them.
fn acp_kind(kind: tiller_session::event::CallKind) -> ToolKind {
    use tiller_session::event::CallKind as K;
    match kind {
        K::Read => ToolKind::Read,
        K::Edit => ToolKind::Edit,
        K::Delete => ToolKind::Delete,
        K::Move => ToolKind::Move,
        K::Search => ToolKind::Search,
        K::Execute => ToolKind::Execute,
        K::Think => ToolKind::Think,
        K::Fetch => ToolKind::Fetch,
        K::SwitchMode => ToolKind::SwitchMode,
        K::Other => ToolKind::Other,
    }
}

fn tool_kind(name: &str) -> ToolKind {
    match name {
        "read_file" => ToolKind::Read,
        "write_file" | "edit" | "apply_patch" => ToolKind::Edit,
        "list_dir" | "glob" | "grep" => ToolKind::Search,
        "todo" => ToolKind::Think,
        "web_fetch" => ToolKind::Fetch,
        "shell" => ToolKind::Execute,
        _ => ToolKind::Other,
    }
}

/// A session's options as ACP config options (selects).
/// Switches are boolean options for clients that take them (`booleans`),
/// and `off`/`on` selects for the others.
pub fn config_options(options: &[ConfigOption], booleans: bool) -> Vec<SessionConfigOption> {
    options
        .iter()
        .map(|o| {
            if o.boolean {
                let on = o.current == "true";
                if booleans {
                    return SessionConfigOption::boolean(o.id.clone(), o.name.clone(), on);
                }
                let choices = ["off", "on"]
                    .map(|c| SessionConfigSelectOption::new(c, c))
                    .to_vec();
                let current = if on { "on" } else { "off" };
                return SessionConfigOption::select(o.id.clone(), o.name.clone(), current, choices);
            }
            let choices: Vec<SessionConfigSelectOption> = o
                .choices
                .iter()
                .map(|c| SessionConfigSelectOption::new(c.clone(), c.clone()))
                .collect();
            let category = match o.category.as_str() {
                "model" => SessionConfigOptionCategory::Model,
                "mode" => SessionConfigOptionCategory::Mode,
                other => SessionConfigOptionCategory::Other(other.to_owned()),
            };
            SessionConfigOption::select(o.id.clone(), o.name.clone(), o.current.clone(), choices)
                .category(category)
        })
        .collect()
}

/// The permission modes as ACP session modes (`session/set_mode`), for
/// clients that switch modes rather than config options.
pub fn modes(options: &[ConfigOption]) -> Option<SessionModeState> {
    let o = options.iter().find(|o| o.id == "permission_mode")?;
    let modes = o
        .choices
        .iter()
        .map(|c| {
            let (name, description) = match c.as_str() {
                "ask" => ("Ask", "Edits and commands ask first"),
                "accept-edits" => ("Accept edits", "Edits run; commands ask first"),
                "allow-all" => ("Allow all", "Nothing asks"),
                other => (other, ""),
            };
            SessionMode::new(c.clone(), name)
                .description((!description.is_empty()).then(|| description.to_owned()))
        })
        .collect();
    Some(SessionModeState::new(o.current.clone(), modes))
}

/// The updates that follow an event's own: the `current_mode_update`
/// of a `config_options`, the images of a user message (chunks of the
/// same message).
pub fn extra_updates(rec: &EventRecord) -> Vec<SessionNotification> {
    let update = |u| SessionNotification::new(rec.session.to_string(), u).meta(turn_meta(rec));
    match &rec.body {
        EventBody::ConfigOptions { options } => options
            .iter()
            .find(|o| o.id == "permission_mode")
            .map(|o| {
                update(SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(
                    o.current.clone(),
                )))
            })
            .into_iter()
            .collect(),
        EventBody::UserMessage { images, .. } => images
            .iter()
            .map(|i| {
                let block =
                    ContentBlock::Image(ImageContent::new(i.data.clone(), i.mime_type.clone()));
                let id = rec.prompt.map(|p| MessageId::new(p.to_string()));
                update(SessionUpdate::UserMessageChunk(
                    ContentChunk::new(block).message_id(id),
                ))
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// `available_commands_update`: Tiller's slash commands, which the daemon
/// handles whatever the engine.
pub fn available_commands(session: SessionId) -> SessionNotification {
    SessionNotification::new(
        session.to_string(),
        SessionUpdate::AvailableCommandsUpdate(AvailableCommandsUpdate::new(command_list(
            std::iter::empty(),
        ))),
    )
}

/// [`available_commands`]'s `session/update` line, serialized: the same
/// for every session but its id, so the rest is serialized once (a
/// session made or resumed pays a copy, not the command list's
/// serialization).
pub fn available_commands_line(session: SessionId) -> String {
    static AROUND: std::sync::LazyLock<(String, String)> = std::sync::LazyLock::new(|| {
        // A session id's text has no escapes and a fixed length; the
        // commands' texts never hold this one.
        let at = SessionId::from_u128(0);
        let line = update_message(&available_commands(at));
        let (before, after) = line
            .split_once(&at.to_string())
            .expect("the line names its session");
        (before.to_owned(), after.to_owned())
    });
    let (before, after) = &*AROUND;
    let mut line = String::with_capacity(before.len() + 36 + after.len());
    line.push_str(before);
    line.push_str(session.encode(&mut [0; 36]));
    line.push_str(after);
    line
}

/// Tiller's commands, then a hosted agent's own (those Tiller does not
/// answer itself: its prompts reach the agent).
fn command_list(agent: impl Iterator<Item = AvailableCommand>) -> Vec<AvailableCommand> {
    use tiller_session::commands::{COMMANDS, ENGINE_COMMANDS};
    let own: Vec<_> = COMMANDS.iter().chain(ENGINE_COMMANDS).collect();
    own.iter()
        .map(|(name, description, hint)| {
            AvailableCommand::new(*name, *description).input(
                hint.map(|h| AvailableCommandInput::Unstructured(UnstructuredCommandInput::new(h))),
            )
        })
        .chain(agent.filter(|a| !own.iter().any(|(n, _, _)| *n == a.name)))
        .collect()
}

/// A message of the daemon's own (a command's answer), shown as agent text.
pub fn agent_text(session: SessionId, text: &str) -> SessionNotification {
    SessionNotification::new(
        session.to_string(),
        SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::from(text.to_owned()))),
    )
}

/// The MCP servers of `session/new` (or load/resume) as the tools crate
/// takes them. SSE is deprecated in MCP and refused with a clear error.
pub fn mcp_servers(servers: &[McpServer]) -> Result<Vec<McpServerConfig>, RpcError> {
    servers
        .iter()
        .map(|s| match s {
            McpServer::Stdio(s) => Ok(McpServerConfig::Stdio {
                name: s.name.clone(),
                command: s.command.display().to_string(),
                args: s.args.clone(),
                env: s
                    .env
                    .iter()
                    .map(|e| (e.name.clone(), e.value.clone()))
                    .collect(),
            }),
            McpServer::Http(h) => Ok(McpServerConfig::Http {
                name: h.name.clone(),
                url: h.url.clone(),
                headers: h
                    .headers
                    .iter()
                    .map(|e| (e.name.clone(), e.value.clone()))
                    .collect(),
            }),
            McpServer::Sse(s) => Err(RpcError::invalid_params(format!(
                "MCP server `{}`: the SSE transport is not supported; use HTTP or stdio",
                s.name
            ))
            .with_data(json!({ "field": "mcpServers" }))),
            _ => Err(RpcError::invalid_params("unsupported MCP server transport")
                .with_data(json!({ "field": "mcpServers" }))),
        })
        .collect()
}

fn tool_status(s: ToolStatus) -> ToolCallStatus {
    match s {
        ToolStatus::Pending => ToolCallStatus::Pending,
        ToolStatus::InProgress => ToolCallStatus::InProgress,
        ToolStatus::Completed => ToolCallStatus::Completed,
        ToolStatus::Failed => ToolCallStatus::Failed,
    }
}

/// The `session/request_permission` params for a `permission_requested`.
pub fn permission_request(rec: &EventRecord) -> Option<(String, Value)> {
    let EventBody::PermissionRequested {
        request_id,
        tool_call_id,
        title,
        options,
        call,
    } = &rec.body
    else {
        return None;
    };
    let tiller_session::event::AskedCall {
        name,
        input,
        locations,
        diff,
        kind,
    } = &**call;
    let options = options
        .iter()
        .map(|o| {
            let kind = match o.kind.as_str() {
                "allow_always" => PermissionOptionKind::AllowAlways,
                "reject_once" => PermissionOptionKind::RejectOnce,
                "reject_always" => PermissionOptionKind::RejectAlways,
                _ => PermissionOptionKind::AllowOnce,
            };
            PermissionOption::new(o.option_id.clone(), o.name.clone(), kind)
        })
        .collect();
    // The whole call, as `tool_call` showed it: what is decided on.
    let mut fields = ToolCallUpdateFields::new().title(title.clone());
    if !name.is_empty() {
        let mut content = Vec::new();
        if let Some(d) = diff {
            content.push(ToolCallContent::Diff(
                Diff::new(PathBuf::from(&d.path), d.new_text.clone()).old_text(d.old_text.clone()),
            ));
        }
        if let Some(cmd) = input.get("command").and_then(Value::as_str)
            && name == "shell"
        {
            content.push(ToolCallContent::from(ContentBlock::from(format!(
                "$ {cmd}"
            ))));
        }
        fields = fields
            .kind(kind.map_or_else(|| tool_kind(name), acp_kind))
            .status(ToolCallStatus::Pending)
            .raw_input(input.clone())
            .locations(acp_locations(locations));
        if !content.is_empty() {
            fields = fields.content(content);
        }
    }
    let req = RequestPermissionRequest::new(
        rec.session.to_string(),
        ToolCallUpdate::new(tool_call_id.clone(), fields),
        options,
    );
    Some((
        request_id.clone(),
        serde_json::to_value(req).expect("serialize"),
    ))
}

/// The option a `session/request_permission` response selected
/// (`cancelled` when the client cancelled).
pub fn permission_choice(result: &Value) -> Option<String> {
    let res: RequestPermissionResponse = serde_json::from_value(result.clone()).ok()?;
    Some(match res.outcome {
        RequestPermissionOutcome::Selected(s) => s.option_id.0.to_string(),
        RequestPermissionOutcome::Cancelled => "reject_once".into(),
        #[allow(unreachable_patterns)]
        _ => "reject_once".into(),
    })
}

/// A compaction for clients that take them (`session.compaction`).
pub fn compaction_update(rec: &EventRecord, capable: bool) -> Option<SessionNotification> {
    let EventBody::Compaction {
        compaction_id,
        status,
        summary,
        message,
    } = &rec.body
    else {
        return None;
    };
    if !capable {
        return None;
    }
    let status = match status.as_str() {
        "in_progress" => CompactionStatus::InProgress,
        "completed" => CompactionStatus::Completed,
        "failed" => CompactionStatus::Failed,
        "cancelled" => CompactionStatus::Cancelled,
        other => CompactionStatus::Other(format!("_{other}")),
    };
    let mut update = CompactionUpdate::new(compaction_id.clone(), status);
    if let Some(s) = summary {
        update = update.summary(vec![ContentBlock::from(s.clone())]);
    }
    if let Some(m) = message {
        update = update.error(m.clone());
    }
    Some(
        SessionNotification::new(
            rec.session.to_string(),
            SessionUpdate::CompactionUpdate(update),
        )
        .meta(turn_meta(rec)),
    )
}

/// The notification a compaction is for clients without the capability.
pub const COMPACTION_NOTIFICATION: &str = "_tiller/compaction";

/// The params of a `_tiller/*` notification: the two of every turn are
/// written straight from their fields ([`extension_line`]; their derived
/// serialization is its reference in the tests), the others serialized
/// through a `Value`.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum ExtParams<'a> {
    #[serde(rename_all = "camelCase")]
    TurnStarted {
        #[serde(serialize_with = "id_str")]
        session_id: SessionId,
        #[serde(serialize_with = "opt_id_str")]
        prompt_id: Option<PromptId>,
        turn_id: Option<u64>,
    },
    #[serde(rename_all = "camelCase")]
    TurnSettled {
        #[serde(serialize_with = "id_str")]
        session_id: SessionId,
        #[serde(serialize_with = "opt_id_str")]
        prompt_id: Option<PromptId>,
        stop_reason: &'a str,
    },
    Other(Value),
}

/// A `_tiller/*` notification's line. A turn's two are written straight
/// from their fields: byte for byte what [`crate::jsonrpc::notification_of`]
/// gives (property-tested against it), without serde's machinery for
/// each key (`callgrind`: about 3,000 instructions a line that way, two
/// lines in every turn). The others are serialized.
pub fn extension_line(method: &str, params: &ExtParams<'_>) -> String {
    let mut out: Vec<u8> = Vec::with_capacity(200);
    let wrote: serde_json::Result<()> = match params {
        ExtParams::TurnStarted {
            session_id,
            prompt_id,
            turn_id,
        } => (|| {
            ext_head(&mut out, method, session_id, prompt_id)?;
            out.extend_from_slice(br#","turnId":"#);
            match turn_id {
                Some(t) => out.extend_from_slice(itoa::Buffer::new().format(*t).as_bytes()),
                None => out.extend_from_slice(b"null"),
            }
            Ok(())
        })(),
        ExtParams::TurnSettled {
            session_id,
            prompt_id,
            stop_reason,
        } => (|| {
            ext_head(&mut out, method, session_id, prompt_id)?;
            out.extend_from_slice(br#","stopReason":"#);
            serde_json::to_writer(&mut out, stop_reason)
        })(),
        ExtParams::Other(_) => return crate::jsonrpc::notification_of(method, params),
    };
    wrote.expect("writing to memory does not fail");
    out.extend_from_slice(b"}}");
    String::from_utf8(out).expect("JSON is UTF-8")
}

/// A turn notification's line up to its last param: the method, the
/// session's id and the prompt's (`null` when absent).
fn ext_head(
    out: &mut Vec<u8>,
    method: &str,
    session: &SessionId,
    prompt: &Option<PromptId>,
) -> serde_json::Result<()> {
    let mut id = [0; 36];
    out.extend_from_slice(br#"{"jsonrpc":"2.0","method":"#);
    serde_json::to_writer(&mut *out, method)?;
    out.extend_from_slice(br#","params":{"sessionId":""#);
    out.extend_from_slice(session.encode(&mut id).as_bytes());
    out.extend_from_slice(br#"","promptId":"#);
    match prompt {
        Some(p) => {
            out.push(b'"');
            out.extend_from_slice(p.encode(&mut id).as_bytes());
            out.push(b'"');
        }
        None => out.extend_from_slice(b"null"),
    }
    Ok(())
}

/// An id as its canonical string, encoded on the stack.
fn id_str<S: serde::Serializer>(id: &SessionId, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(id.encode(&mut [0; 36]))
}

/// [`id_str`] of an id that may be absent (`null`).
fn opt_id_str<S: serde::Serializer>(id: &Option<PromptId>, s: S) -> Result<S::Ok, S::Error> {
    match id {
        Some(p) => s.serialize_str(p.encode(&mut [0; 36])),
        None => s.serialize_none(),
    }
}

/// `_tiller/*` notifications an event produces for live subscribers.
pub fn extension_notification(rec: &EventRecord) -> Option<(&'static str, ExtParams<'_>)> {
    // Formatted only for the events that have a notification (not for
    // every streamed chunk).
    let session = || rec.session.to_string();
    let prompt = || rec.prompt.map(|p| p.to_string());
    let other = |method, params| Some((method, ExtParams::Other(params)));
    match &rec.body {
        // Its text comes first in every turn.
        EventBody::UserMessage { .. } => Some((
            "_tiller/turn_started",
            ExtParams::TurnStarted {
                session_id: rec.session,
                prompt_id: rec.prompt,
                turn_id: rec.turn.map(|t| t.0),
            },
        )),
        EventBody::SessionClosed => {
            other("_tiller/session_closed", json!({ "sessionId": session() }))
        }
        EventBody::Compaction {
            compaction_id,
            status,
            summary,
            message,
        } => other(
            COMPACTION_NOTIFICATION,
            json!({ "sessionId": session(), "promptId": prompt(), "compactionId": compaction_id,
                    "status": status, "summary": summary, "message": message }),
        ),
        EventBody::Roots { roots } => other(
            "_tiller/roots_changed",
            json!({ "sessionId": session(), "additionalDirectories": roots }),
        ),
        EventBody::TurnComplete { stop_reason } => Some((
            "_tiller/turn_settled",
            ExtParams::TurnSettled {
                session_id: rec.session,
                prompt_id: rec.prompt,
                stop_reason,
            },
        )),
        EventBody::TurnError {
            error_kind,
            message,
            loop_type,
            code,
        } => {
            let mut error = json!({ "errorKind": error_kind, "message": message });
            if let Some(t) = loop_type {
                error["loopType"] = json!(t);
            }
            if let Some(c) = code {
                error["code"] = json!(c);
            }
            other(
                "_tiller/turn_settled",
                json!({ "sessionId": session(), "promptId": prompt(), "error": error }),
            )
        }
        EventBody::SteerDropped {
            steer_id,
            text,
            reason,
        } => other(
            "_tiller/steer_dropped",
            json!({
                "sessionId": session(),
                "steerId": steer_id,
                "prompt": [{ "type": "text", "text": text }],
                "reason": reason,
            }),
        ),
        _ => None,
    }
}

fn acp_stop(r: StopReason) -> AcpStop {
    match r {
        StopReason::EndTurn => AcpStop::EndTurn,
        StopReason::MaxTokens => AcpStop::MaxTokens,
        StopReason::MaxTurnRequests => AcpStop::MaxTurnRequests,
        StopReason::Refusal => AcpStop::Refusal,
        StopReason::Cancelled => AcpStop::Cancelled,
    }
}

/// The `session/prompt` answer for a terminal: its stop reason, or the error.
pub fn prompt_result(
    session: SessionId,
    prompt: PromptId,
    terminal: &Terminal,
) -> Result<AcpStop, RpcError> {
    match terminal {
        Terminal::Completed(r) => Ok(acp_stop(*r)),
        Terminal::Failed { kind, message } => {
            let mut data = json!({
                "errorKind": kind.as_str(),
                "sessionId": session.to_string(),
                "promptId": prompt.to_string(),
            });
            if let Some(t) = kind.loop_type() {
                data["loopType"] = json!(t.as_str());
                data["code"] = json!("LOOP_DETECTED");
            }
            // Sending the same prompt again later may work.
            if matches!(
                kind,
                tiller_core::ErrorKind::Overloaded | tiller_core::ErrorKind::StoreUnavailable
            ) {
                data["retryable"] = json!(true);
            }
            Err(RpcError::new(code::INTERNAL_ERROR, message.clone()).with_data(data))
        }
    }
}

/// [`prompt_content`] of ACP content blocks given as JSON (the HTTP
/// API's `content`); the error says what is wrong.
pub fn prompt_content_json(
    blocks: &[Value],
) -> Result<(String, Vec<tiller_session::Image>), String> {
    let parsed: Vec<ContentBlock> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| serde_json::from_value(b.clone()).map_err(|e| format!("content[{i}]: {e}")))
        .collect::<Result<_, _>>()?;
    prompt_content(&parsed).map_err(|e| e.message.replace("prompt[", "content["))
}

/// Image types the model providers take.
const IMAGE_TYPES: &[&str] = &["image/png", "image/jpeg", "image/gif", "image/webp"];

/// A prompt's content blocks as text and images: text blocks joined,
/// embedded text resources inlined as context (`<context uri="...">`),
/// resource links named; images kept apart (checked: a known type, valid
/// base64). Audio and binary resources are refused with a clear error.
pub fn prompt_content(
    blocks: &[ContentBlock],
) -> Result<(String, Vec<tiller_session::Image>), RpcError> {
    use base64::Engine as _;
    let refuse = |i: usize, why: String| {
        RpcError::invalid_params(format!("prompt[{i}]: {why}"))
            .with_data(json!({ "field": format!("prompt[{i}]") }))
    };
    let mut text = String::new();
    let mut images = Vec::new();
    let mut add = |s: &str| {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(s);
    };
    for (i, b) in blocks.iter().enumerate() {
        match b {
            ContentBlock::Text(t) => add(&t.text),
            ContentBlock::Image(img) => {
                if !IMAGE_TYPES.contains(&img.mime_type.as_str()) {
                    return Err(refuse(
                        i,
                        format!(
                            "image type `{}` is not supported (use one of {})",
                            img.mime_type,
                            IMAGE_TYPES.join(", ")
                        ),
                    ));
                }
                if base64::engine::general_purpose::STANDARD
                    .decode(img.data.as_bytes())
                    .is_err()
                {
                    return Err(refuse(i, "the image data is not valid base64".into()));
                }
                images.push(tiller_session::Image {
                    mime_type: img.mime_type.clone(),
                    data: img.data.clone(),
                });
            }
            ContentBlock::Resource(r) => match &r.resource {
                EmbeddedResourceResource::TextResourceContents(t) => add(&format!(
                    "<context uri=\"{}\">\n{}\n</context>",
                    t.uri.replace('"', "%22"),
                    t.text
                )),
                EmbeddedResourceResource::BlobResourceContents(b) => {
                    return Err(refuse(
                        i,
                        format!("binary resource {} is not supported; send text", b.uri),
                    ));
                }
                _ => return Err(refuse(i, "unsupported resource".into())),
            },
            ContentBlock::ResourceLink(l) => add(&format!("[{}]({})", l.name, l.uri)),
            ContentBlock::Audio(_) => {
                return Err(refuse(i, "audio is not supported".into()));
            }
            _ => return Err(refuse(i, "unsupported content block".into())),
        }
    }
    Ok((text, images))
}

/// The answer to a steer, as both `_session/steering` and the HTTP API give
/// it: `{outcome, steerId?, promptId?, reason?}`.
pub fn steer_answer(answer: &tiller_session::SteerAnswer) -> Value {
    use tiller_core::{SteerOutcome, SteerRefusal};
    match answer.outcome {
        SteerOutcome::Injected { .. } => {
            json!({ "outcome": "injected", "steerId": answer.steer.to_string() })
        }
        SteerOutcome::StartedNewTurn { prompt } => {
            json!({ "outcome": "startedNewTurn", "promptId": prompt.to_string() })
        }
        SteerOutcome::PromptRequired(why) => json!({
            "outcome": "promptRequired",
            "reason": match why {
                SteerRefusal::NoRunningTurn => "noRunningTurn",
                SteerRefusal::TurnCancelling => "turnCancelling",
                SteerRefusal::SessionClosing => "sessionClosing",
                SteerRefusal::NotSupported => "notSupported",
            },
        }),
    }
}

/// Whether an event shows as a `session/update`.
pub fn shown(body: &EventBody) -> bool {
    matches!(
        body,
        EventBody::UserMessage { .. }
            | EventBody::AgentMessageChunk { .. }
            | EventBody::AgentThoughtChunk { .. }
            | EventBody::Plan { .. }
            | EventBody::ToolCall { .. }
            | EventBody::ToolCallUpdate { .. }
            | EventBody::ConfigOptions { .. }
            | EventBody::SessionInfo { .. }
            | EventBody::AgentCommands { .. }
            | EventBody::Compaction { .. }
    ) || matches!(body, EventBody::Usage { context_window, .. } if *context_window > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tiller_core::{ErrorKind, TurnId};

    proptest! {
        /// A chunk written straight to its line is, byte for byte, the
        /// schema's serialization of the same update: any text (quotes,
        /// control characters, any Unicode), thought or message, with or
        /// without a message id, a prompt, a turn.
        #[test]
        fn a_chunk_line_is_the_serialized_update(
            text in any::<String>(),
            thought in any::<bool>(),
            message in proptest::option::of("\\PC{0,12}"),
            prompt in any::<bool>(),
            turn in proptest::option::of(any::<u64>()),
        ) {
            let rec = EventRecord {
                session: SessionId::new(),
                seq: 7,
                ts_ms: 0,
                prompt: prompt.then(PromptId::new),
                turn: turn.map(TurnId),
                body: if thought {
                    EventBody::AgentThoughtChunk { text }
                } else {
                    EventBody::AgentMessageChunk { text }
                },
            };
            let fast = chunk_line(&rec, message.as_deref()).expect("a chunk has a line");
            let slow = update_message(
                &session_update(&rec, message.as_deref(), false).expect("a chunk shows"),
            );
            prop_assert_eq!(fast, slow);
        }

        /// The command list's line, serialized once around a session's
        /// id, is, byte for byte, the serialization of that session's
        /// notification.
        #[test]
        fn the_commands_line_is_the_serialized_notification(id in any::<u128>()) {
            let session = SessionId::from_u128(id);
            prop_assert_eq!(
                available_commands_line(session),
                update_message(&available_commands(session))
            );
        }

        /// A turn's start and end notifications written straight to their
        /// lines are, byte for byte, their serialization: any ids, turn
        /// and stop reason (quotes, control characters, any Unicode), any
        /// method; the other notifications are serialized.
        #[test]
        fn an_extension_line_is_the_serialized_notification(
            method in "\\PC{0,12}",
            prompt in any::<bool>(),
            turn in proptest::option::of(any::<u64>()),
            stop_reason in any::<String>(),
            kind in 0..3u8,
        ) {
            let (session_id, prompt_id) = (SessionId::new(), prompt.then(PromptId::new));
            let params = match kind {
                0 => ExtParams::TurnStarted { session_id, prompt_id, turn_id: turn },
                1 => ExtParams::TurnSettled { session_id, prompt_id, stop_reason: &stop_reason },
                _ => ExtParams::Other(json!({ "sessionId": session_id.to_string(), "why": stop_reason })),
            };
            prop_assert_eq!(
                extension_line(&method, &params),
                crate::jsonrpc::notification_of(&method, &params)
            );
        }
    }

    #[test]
    fn only_chunks_take_the_direct_line() {
        let rec = EventRecord {
            session: SessionId::new(),
            seq: 1,
            ts_ms: 0,
            prompt: Some(PromptId::new()),
            turn: Some(TurnId(1)),
            body: EventBody::UserMessage {
                text: "hi".into(),
                images: Vec::new(),
            },
        };
        assert!(chunk_line(&rec, None).is_none());
        let line = update_line(&rec, None, false).expect("a user message shows");
        assert!(line.contains("user_message_chunk"), "{line}");
    }

    #[test]
    fn a_turn_s_start_and_end_notifications_carry_its_ids() {
        let session = SessionId::new();
        let prompt = PromptId::new();
        let line = |prompt: Option<PromptId>, turn: Option<u64>, body: EventBody| {
            let rec = EventRecord {
                session,
                seq: 3,
                ts_ms: 0,
                prompt,
                turn: turn.map(TurnId),
                body,
            };
            let (method, params) = extension_notification(&rec).expect("a notification");
            let line: Value = serde_json::from_str(&extension_line(method, &params)).unwrap();
            line
        };
        let started = || EventBody::UserMessage {
            text: "hi".into(),
            images: Vec::new(),
        };
        assert_eq!(
            line(Some(prompt), Some(4), started()),
            json!({ "jsonrpc": "2.0", "method": "_tiller/turn_started", "params": {
                "sessionId": session.to_string(), "promptId": prompt.to_string(), "turnId": 4 } })
        );
        assert_eq!(
            line(None, None, started())["params"],
            json!({ "sessionId": session.to_string(), "promptId": null, "turnId": null })
        );
        assert_eq!(
            line(
                Some(prompt),
                Some(4),
                EventBody::TurnComplete {
                    stop_reason: "end_turn".into()
                }
            ),
            json!({ "jsonrpc": "2.0", "method": "_tiller/turn_settled", "params": {
                "sessionId": session.to_string(), "promptId": prompt.to_string(),
                "stopReason": "end_turn" } })
        );
        assert_eq!(
            line(None, None, EventBody::SessionClosed),
            json!({ "jsonrpc": "2.0", "method": "_tiller/session_closed",
                    "params": { "sessionId": session.to_string() } })
        );
    }

    #[test]
    fn a_failed_prompt_says_whether_sending_it_again_may_work() {
        let (s, p) = (SessionId::new(), PromptId::new());
        for (kind, retryable) in [
            (ErrorKind::Overloaded, true),
            (ErrorKind::StoreUnavailable, true),
            (ErrorKind::EngineCrashed, false),
            (ErrorKind::Stalled, false),
        ] {
            let e = prompt_result(s, p, &Terminal::failed(kind)).unwrap_err();
            let data = e.data.unwrap();
            assert_eq!(data["errorKind"], kind.as_str());
            assert_eq!(data["retryable"] == json!(true), retryable, "{kind}");
        }
    }
}
