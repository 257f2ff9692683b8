//! The shell for engines that host an agent running its own tools (ACP
//! agents): the agent's calls are shown and watched by the turn's loop
//! guard, its permission requests go through the session's permission
//! flow, and its file reads and writes run through the session's confined
//! tools (or the attached editor). Every call the session announced ends
//! exactly once: by the agent's own terminal update, with the skip details
//! when loop protection trips, or stopped when the turn ends first.

use super::*;
use crate::event::{AgentCommand, AskedCall, CallKind, ToolStatus};
use tiller_core::CallKey;
use tiller_core::pipeline::Failure;
use tiller_engine::{FileOp, Hosted, HostedCall, PermissionAnswer, ToolKind, UpstreamStart};

/// What the session knows of a hosted turn's calls.
pub(super) struct HostedTurn {
    calls: Vec<CallState>,
    /// The agent's id -> its place in `calls`.
    index: std::collections::HashMap<String, usize>,
    /// The permission request a person is asked, if any.
    waiting: Option<Wait>,
    /// File requests served at once ([`FILES_AT_ONCE`]): each may hold a
    /// file of up to [`MAX_AGENT_READ`] while it is read and answered.
    files: Arc<tokio::sync::Semaphore>,
}

impl Default for HostedTurn {
    fn default() -> Self {
        HostedTurn {
            calls: Vec::new(),
            index: Default::default(),
            waiting: None,
            files: Arc::new(tokio::sync::Semaphore::new(FILES_AT_ONCE)),
        }
    }
}

/// File requests of one hosted turn served at once; the rest wait.
const FILES_AT_ONCE: usize = 2;

struct CallState {
    /// The agent's id.
    id: String,
    /// The id it is published under (unique in the session).
    wire: String,
    name: String,
    kind: ToolKind,
    /// The ACP kind the agent named.
    acp_kind: Option<String>,
    input: Option<serde_json::Value>,
    locations: Vec<String>,
    /// Its loop-guard key, once checked.
    key: Option<CallKey>,
    ended: bool,
}

struct Wait {
    request_id: String,
    /// The engine's number for the request.
    request: u64,
    call: usize,
}

impl CallState {
    /// The call as the permission rules see it.
    fn as_tool_call(&self) -> tiller_engine::ToolCall {
        tiller_engine::ToolCall {
            id: self.id.clone(),
            name: self.name.clone(),
            kind: self.kind,
            input: self.input.clone().unwrap_or(serde_json::Value::Null),
            simulated: None,
        }
    }
}

/// How the session's rules weigh a hosted agent's permission request.
/// The agent asks for what it would not do unasked (a read outside its
/// directory, a fetch, its own tools, a command), and Tiller does not
/// confine what the agent does itself: an edit weighs as an edit (unless
/// it touches a repository's own directory, whose config and hooks git
/// runs, lands outside the session's roots, or names no path that can be
/// checked), anything else as a command. A bare command line the agent names
/// is weighed as a `shell` call, so "always" covers that command's prefix,
/// never the agent's whole tool; with anything more (a directory...),
/// "always" covers nothing but this call.
fn asked(
    mut call: tiller_engine::ToolCall,
    locations: &[String],
    dir: &std::path::Path,
    roots: &[std::path::PathBuf],
) -> tiller_engine::ToolCall {
    // Whatever the agent calls them: `path`, `file_path`, `notebook_path`,
    // `filePath`, a list under `paths`...
    let paths: Vec<&str> = call
        .input
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            k.ends_with("path") || k.ends_with("paths")
        })
        .flat_map(|(_, v)| match v {
            serde_json::Value::Array(list) => list.iter().collect(),
            v => vec![v],
        })
        .filter_map(|v| v.as_str())
        .chain(locations.iter().map(String::as_str))
        .collect();
    // An edit naming no path that can be checked could be anywhere; one
    // outside the session's roots is what an agent asks about.
    let weighs_as_command = paths.is_empty()
        || paths.iter().any(|p| {
            let p = std::path::Path::new(p);
            tiller_tools::lands_in_git_dir(dir, p) || !tiller_tools::lands_within(dir, roots, p)
        });
    if call.kind == ToolKind::Edit && !weighs_as_command {
        return call;
    }
    let bare = call.input.as_object().is_some_and(|o| {
        o.keys()
            .all(|k| ["command", "description", "timeout"].contains(&k.as_str()))
    });
    call.kind = ToolKind::Execute;
    call.name = "shell".into();
    call.input = match call.input.get("command") {
        Some(serde_json::Value::String(c)) if bare => serde_json::json!({ "command": c }),
        _ => serde_json::Value::Null,
    };
    call
}

fn status(s: Option<&str>) -> Option<ToolStatus> {
    Some(match s? {
        "pending" => ToolStatus::Pending,
        "in_progress" => ToolStatus::InProgress,
        "completed" => ToolStatus::Completed,
        "failed" => ToolStatus::Failed,
        _ => return None,
    })
}

impl SessionState {
    /// Handles a hosted agent's content. Returns the events to publish and
    /// a loop trip, if the guard found one.
    pub(super) fn hosted(&mut self, turn: TurnId, h: Hosted) -> (Vec<EventBody>, Option<LoopType>) {
        let mut events = Vec::new();
        let trip = match h {
            Hosted::Call(c) => self.hosted_call(turn, *c, &mut events).and_then(|(_, t)| t),
            Hosted::Permission { request, call } => {
                self.hosted_permission(turn, request, *call, &mut events)
            }
            Hosted::File { request, op } => {
                self.hosted_file(turn, request, op);
                None
            }
            Hosted::Session { upstream, start } => {
                let (start, reason) = match start {
                    UpstreamStart::New => ("new", None),
                    UpstreamStart::Loaded(why) => ("loaded", Some(why)),
                    UpstreamStart::Fresh(why) => ("fresh", Some(why)),
                };
                if self.upstream.as_deref() != Some(upstream.as_str()) {
                    self.upstream = Some(upstream.clone());
                    let _ = self.myself.send_message(SessionMsg::SaveSettings);
                }
                events.push(EventBody::AgentSession {
                    upstream,
                    start: start.into(),
                    reason,
                });
                None
            }
            Hosted::Options(offered) => {
                self.agent_offers(offered);
                None
            }
            Hosted::Commands(list) => {
                events.push(EventBody::AgentCommands {
                    commands: list
                        .into_iter()
                        .map(|(name, description)| AgentCommand { name, description })
                        .collect(),
                });
                None
            }
        };
        (events, trip)
    }

    /// Takes in what the agent said of a call: announces a new one, checks
    /// it with the loop guard once its input is known, ends it at its
    /// terminal status. Returns the call's index and a trip.
    fn hosted_call(
        &mut self,
        turn: TurnId,
        c: HostedCall,
        events: &mut Vec<EventBody>,
    ) -> Option<(usize, Option<LoopType>)> {
        let ids = self.call_ids.get_or_insert_with(Box::default);
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let hosted = run.hosted.get_or_insert_with(Box::default);
        let i = match hosted.index.get(&c.id).copied() {
            Some(i) => {
                let s = &mut hosted.calls[i];
                if let Some(input) = c.input.clone() {
                    s.input = Some(input);
                }
                if let Some(k) = c.kind {
                    s.kind = k;
                }
                if c.acp_kind.is_some() {
                    s.acp_kind = c.acp_kind.clone();
                }
                if !c.locations.is_empty() {
                    s.locations = c.locations.clone();
                }
                i
            }
            None => {
                let name = c
                    .name
                    .clone()
                    .or(c.title.clone())
                    .unwrap_or_else(|| "tool".into());
                let wire = ids.hosted(&c.id);
                events.push(EventBody::ToolCall {
                    tool_call_id: wire.clone(),
                    name: name.clone(),
                    input: c.input.clone().unwrap_or(serde_json::json!({})),
                    status: ToolStatus::Pending,
                    locations: c.locations.clone(),
                    kind: Some(
                        c.acp_kind
                            .as_deref()
                            .map_or(CallKind::Other, CallKind::parse),
                    ),
                });
                hosted.calls.push(CallState {
                    id: c.id.clone(),
                    wire,
                    name,
                    kind: c.kind.unwrap_or(ToolKind::Other),
                    acp_kind: c.acp_kind.clone(),
                    input: c.input.clone(),
                    locations: c.locations.clone(),
                    key: None,
                    ended: false,
                });
                hosted.index.insert(c.id.clone(), hosted.calls.len() - 1);
                hosted.calls.len() - 1
            }
        };
        let s = &mut hosted.calls[i];
        if s.ended {
            return Some((i, None));
        }
        let st = status(c.status.as_deref());
        let terminal = matches!(st, Some(ToolStatus::Completed | ToolStatus::Failed));
        // Checked once, when its arguments are known (or when it ends
        // without ever showing them).
        if s.key.is_none() && (s.input.is_some() || terminal) {
            let key = CallKey {
                tool: s.name.clone(),
                args: crate::tools::canonical_json(
                    s.input.as_ref().unwrap_or(&serde_json::Value::Null),
                ),
            };
            let checked = run.guard.check(&key);
            s.key = Some(key);
            if let Err(loop_type) = checked {
                // A question still open is refused.
                end_unfinished(
                    hosted,
                    &run.handle.sender(),
                    PermissionAnswer::Reject,
                    Failure::Skipped(loop_type),
                    self.permissions.mode,
                    events,
                );
                return Some((i, Some(loop_type)));
            }
        }
        match st {
            Some(ToolStatus::InProgress) => events.push(EventBody::ToolCallUpdate {
                tool_call_id: s.wire.clone(),
                status: ToolStatus::InProgress,
                output: None,
                error: None,
            }),
            Some(done @ (ToolStatus::Completed | ToolStatus::Failed)) => {
                s.ended = true;
                let ok = done == ToolStatus::Completed;
                let output = c.output.unwrap_or_default();
                if let Some(key) = &s.key {
                    let mut h = std::hash::DefaultHasher::new();
                    std::hash::Hash::hash(&(ok, &output), &mut h);
                    let outcome = tiller_core::CallOutcome {
                        ok,
                        signature: std::hash::Hasher::finish(&h),
                    };
                    run.guard.finished(key, outcome);
                }
                metrics::counter!(
                    "tiller_tool_calls_total",
                    "status" => if ok { "completed" } else { "failed" }
                )
                .increment(1);
                events.push(EventBody::ToolCallUpdate {
                    tool_call_id: s.wire.clone(),
                    status: done,
                    output: Some(output),
                    error: None,
                });
            }
            _ => {}
        }
        Some((i, None))
    }

    /// The agent asks permission for a call.
    fn hosted_permission(
        &mut self,
        turn: TurnId,
        request: u64,
        call: HostedCall,
        events: &mut Vec<EventBody>,
    ) -> Option<LoopType> {
        let (i, trip) = self.hosted_call(turn, call.clone(), events)?;
        let run = self.running.as_mut().filter(|r| r.turn == turn)?;
        let answer = |a| {
            run.handle
                .send(EngineInput::Permission { request, answer: a });
        };
        if trip.is_some() {
            // Loop protection refuses the tripping call.
            answer(PermissionAnswer::Reject);
            return trip;
        }
        let hosted = run.hosted.as_mut()?;
        let s = &hosted.calls[i];
        let tool = s.as_tool_call();
        let weighed = asked(
            tool.clone(),
            &s.locations,
            self.toolbox.root(),
            self.toolbox.roots(),
        );
        // The session's rules may allow the call without asking; else
        // nobody answers for an automatic turn.
        if !self.permissions.needs(&weighed) {
            answer(PermissionAnswer::AllowOnce);
            return None;
        }
        if run.origin != Origin::Interactive {
            answer(PermissionAnswer::Reject);
            return None;
        }
        let request_id = format!("perm-{}", tiller_core::RequestId::new());
        events.push(EventBody::PermissionRequested {
            request_id: request_id.clone(),
            tool_call_id: s.wire.clone(),
            title: call.title.clone().unwrap_or_else(|| s.name.clone()),
            options: crate::tools::options(&weighed),
            call: Box::new(AskedCall {
                name: s.name.clone(),
                input: tool.input.clone(),
                locations: s.locations.clone(),
                kind: Some(
                    s.acp_kind
                        .as_deref()
                        .map_or(CallKind::Other, CallKind::parse),
                ),
                diff: call
                    .diff
                    .clone()
                    .map(|(path, old_text, new_text)| tiller_tools::FileDiff {
                        path,
                        old_text,
                        new_text,
                    }),
            }),
        });
        if let Some(old) = hosted.waiting.replace(Wait {
            request_id,
            request,
            call: i,
        }) {
            // One question at a time: an older one is withdrawn, and
            // everyone is told.
            run.handle.send(EngineInput::Permission {
                request: old.request,
                answer: PermissionAnswer::Cancelled,
            });
            events.insert(
                events.len() - 1,
                EventBody::PermissionResolved {
                    request_id: old.request_id,
                    tool_call_id: hosted.calls[old.call].wire.clone(),
                    outcome: Decision::Cancelled.as_str().into(),
                },
            );
        }
        None
    }

    /// A person's answer to a hosted agent's request; `None` when the
    /// request is not the hosted turn's.
    pub(super) fn hosted_answer(
        &mut self,
        request_id: &str,
        mut decision: Decision,
    ) -> Option<Vec<EventBody>> {
        let run = self.running.as_mut()?;
        let hosted = run.hosted.as_mut()?;
        if hosted.waiting.as_ref()?.request_id != request_id {
            return None;
        }
        let w = hosted.waiting.take()?;
        let s = &hosted.calls[w.call];
        let answer = match decision {
            Decision::AllowOnce => PermissionAnswer::AllowOnce,
            Decision::AllowAlways => {
                // Tiller remembers the rule and answers the agent's later
                // requests by it; the agent itself is told once only (its
                // own "always" may cover its whole tool).
                let call = asked(
                    s.as_tool_call(),
                    &s.locations,
                    self.toolbox.root(),
                    self.toolbox.roots(),
                );
                if crate::tools::may_always(&call) {
                    self.permissions.allow_always(&call);
                } else {
                    // Not offered: nothing is remembered.
                    decision = Decision::AllowOnce;
                }
                PermissionAnswer::AllowOnce
            }
            Decision::Reject => PermissionAnswer::Reject,
            Decision::Cancelled => PermissionAnswer::Cancelled,
        };
        run.handle.send(EngineInput::Permission {
            request: w.request,
            answer,
        });
        Some(vec![EventBody::PermissionResolved {
            request_id: w.request_id,
            tool_call_id: s.wire.clone(),
            outcome: decision.as_str().into(),
        }])
    }

    /// The turn ends: a question still open is withdrawn and every call
    /// the agent did not end is stopped.
    pub(super) fn hosted_abandon(&mut self, turn: TurnId) -> Vec<EventBody> {
        let mut events = Vec::new();
        let Some(run) = self.running.as_mut().filter(|r| r.turn == turn) else {
            return events;
        };
        // File requests still waiting their turn, or coming after this,
        // are not served (made here if none came yet).
        let hosted = run.hosted.get_or_insert_with(Box::default);
        hosted.files.close();
        end_unfinished(
            hosted,
            &run.handle.sender(),
            PermissionAnswer::Cancelled,
            Failure::Stopped,
            self.permissions.mode,
            &mut events,
        );
        events
    }

    /// Serves a file request off the actor: the attached editor when it
    /// offers files, else the session's confined tools.
    fn hosted_file(&mut self, turn: TurnId, request: u64, op: FileOp) {
        let exec = pipeline::Exec::of(self);
        let Some(run) = self.running.as_mut().filter(|r| r.turn == turn) else {
            return;
        };
        let engine = run.handle.sender();
        // Made here if no call came first: every file request waits its
        // turn, and those waiting when the turn ends are refused.
        let files = run.hosted.get_or_insert_with(Box::default).files.clone();
        let task: futures::future::BoxFuture<'static, Result<String, String>> = match op {
            // Whole text, never cut: an agent writes back what it read.
            FileOp::Read { path, line, limit } => Box::pin(async move {
                let text = exec.read_whole(&path, MAX_AGENT_READ).await?;
                Ok(lines(&text, line, limit))
            }),
            FileOp::Write { path, content } => {
                let call = tiller_engine::ToolCall {
                    id: format!("fs-{request}"),
                    name: "write_file".into(),
                    kind: ToolKind::Edit,
                    input: serde_json::json!({ "path": path, "content": content }),
                    simulated: None,
                };
                // The agent's own permission flow covered an interactive
                // write; nobody is there for an automatic one, which the
                // session's rules must allow by themselves.
                if run.origin != Origin::Interactive && self.permissions.needs(&call) {
                    let mode = self.permissions.mode.as_str();
                    let _ = engine.send(EngineInput::File {
                        request,
                        result: Err(format!(
                            "Refused: writing {path} needs a person's permission (permission \
                             mode `{mode}`), and this turn runs unattended."
                        )),
                    });
                    return;
                }
                Box::pin(async move {
                    let out = exec.run(&call).await;
                    if out.ok {
                        Ok(String::new())
                    } else {
                        Err(out.output)
                    }
                })
            }
        };
        let task = async move {
            // A turn's file requests wait their turn: an agent asking for
            // a thousand large files at once holds a few of them only.
            let result = match files.acquire_owned().await {
                Ok(_held) => task.await,
                Err(_) => Err("the turn ended before this file request was served".to_owned()),
            };
            let _ = engine.send(EngineInput::File { request, result });
        };
        tokio::spawn(task.instrument(run.span.clone()));
    }
}

/// Largest file an agent reads through Tiller.
const MAX_AGENT_READ: u64 = 16 * 1024 * 1024;

/// Lines `line..line+limit` (1-based) of `text`, as ACP's
/// `fs/read_text_file` takes them.
fn lines(text: &str, line: Option<u64>, limit: Option<u64>) -> String {
    if line.is_none() && limit.is_none() {
        return text.to_owned();
    }
    let skip = line.unwrap_or(1).max(1) as usize - 1;
    let take = limit.map_or(usize::MAX, |l| l as usize);
    text.split_inclusive('\n').skip(skip).take(take).collect()
}

/// The turn ends (or loop protection stopped it): a question still open
/// gets `answer`, and every call the agent has not ended fails `why`, as
/// the pipeline fails its own calls.
fn end_unfinished(
    hosted: &mut HostedTurn,
    engine: &tokio::sync::mpsc::UnboundedSender<EngineInput>,
    answer: PermissionAnswer,
    why: Failure,
    mode: PermissionMode,
    events: &mut Vec<EventBody>,
) {
    if let Some(w) = hosted.waiting.take() {
        let _ = engine.send(EngineInput::Permission {
            request: w.request,
            answer,
        });
        events.push(EventBody::PermissionResolved {
            request_id: w.request_id,
            tool_call_id: hosted.calls[w.call].wire.clone(),
            outcome: Decision::Cancelled.as_str().into(),
        });
    }
    for s in hosted.calls.iter_mut().filter(|s| !s.ended) {
        s.ended = true;
        let (output, error) = crate::tools::failure(&s.as_tool_call(), why, mode);
        metrics::counter!("tiller_tool_calls_total", "status" => "failed").increment(1);
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: s.wire.clone(),
            status: ToolStatus::Failed,
            output: Some(output),
            error,
        });
    }
}

#[cfg(test)]
mod tests;
