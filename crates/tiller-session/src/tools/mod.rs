//! The session's tool pipeline. Each call goes through the loop guard, then
//! permission, then execution, in the batch's order. A batch is resumable:
//! when a call needs a person's decision it pauses (the session keeps
//! handling messages) and continues when the decision arrives. A call that
//! really runs (a file, search, shell or MCP tool) pauses the batch the same
//! way: the actor runs it off the mailbox and hands the output back. The
//! scripted engine's calls carry a simulated outcome and finish at once.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use tiller_core::{CallKey, CallOutcome, LoopGuard, LoopType};
use tiller_engine::{ToolCall, ToolKind, ToolOutput, ToolResult};

use crate::event::{EventBody, PermissionOption, ToolError, ToolStatus};
mod permissions;

pub use permissions::*;

/// A call waiting for a decision.
#[derive(Clone, Debug)]
pub struct Waiting {
    /// The request's id (clients answer with it).
    pub request_id: String,
    /// The call's index in the batch.
    index: usize,
    /// Its loop-guard key, to report the outcome.
    key: CallKey,
}

/// Where a batch stands after it advanced.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// Every call ended: hand the results to the engine.
    Done(Vec<ToolResult>),
    /// A call waits for a person.
    Waiting,
    /// This call must run now (off the actor); hand its output to
    /// [`Batch::finish`].
    Run(ToolCall),
    /// The loop guard stopped the batch; the rest of it failed unstarted.
    Tripped(LoopType, Vec<ToolResult>),
}

/// One tool batch going through the pipeline.
#[derive(Debug)]
pub struct Batch {
    calls: Vec<ToolCall>,
    /// The next call to consider.
    next: usize,
    results: Vec<ToolResult>,
    /// The call paused on a decision, if any.
    waiting: Option<Waiting>,
    /// The call running off the actor, if any, and its loop-guard key.
    running: Option<(usize, CallKey)>,
    /// Nobody is there to answer (a cron, notification, goal or channel
    /// turn): a call that would ask fails at once instead.
    unattended: bool,
}

impl Batch {
    pub fn new(calls: Vec<ToolCall>) -> Self {
        Self {
            results: Vec::with_capacity(calls.len()),
            calls,
            next: 0,
            waiting: None,
            running: None,
            unattended: false,
        }
    }

    /// A batch of an automatic turn: calls that would ask are refused.
    pub fn unattended(mut self, unattended: bool) -> Self {
        self.unattended = unattended;
        self
    }

    /// The pending request, if the batch waits for one.
    pub fn waiting(&self) -> Option<(&Waiting, &ToolCall)> {
        self.waiting.as_ref().map(|w| (w, &self.calls[w.index]))
    }

    /// Runs calls until the batch is done, waits, or trips. Appends the
    /// events to publish to `events`.
    pub fn advance(
        &mut self,
        guard: &mut LoopGuard,
        perms: &Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        while self.waiting.is_none() && self.running.is_none() && self.next < self.calls.len() {
            let i = self.next;
            self.next += 1;
            let call = self.calls[i].clone();
            events.push(announce(&call));
            let key = CallKey {
                tool: call.name.clone(),
                args: canonical_json(&call.input),
            };
            if let Err(loop_type) = guard.check(&key) {
                self.skip_rest(i, loop_type, events);
                return Progress::Tripped(loop_type, std::mem::take(&mut self.results));
            }
            if perms.needs(&call) && self.unattended {
                let output = ToolOutput {
                    ok: false,
                    output: unattended_message(&call, perms.mode),
                };
                guard.finished(
                    &key,
                    CallOutcome {
                        ok: false,
                        signature: signature(&output),
                    },
                );
                let error = ToolError {
                    error_kind: "permission_unavailable".into(),
                    loop_type: None,
                    code: "PERMISSION_UNAVAILABLE".into(),
                    message: output.output.clone(),
                };
                self.fail(i, output, Some(error), events);
                continue;
            }
            if perms.needs(&call) {
                let request_id = format!("perm-{}", tiller_core::RequestId::new());
                events.push(EventBody::PermissionRequested {
                    request_id: request_id.clone(),
                    tool_call_id: call.id.clone(),
                    title: call.name.clone(),
                    options: options(&call),
                });
                self.waiting = Some(Waiting {
                    request_id,
                    index: i,
                    key,
                });
                return Progress::Waiting;
            }
            if let Some(call) = self.run(i, key, guard, events) {
                return Progress::Run(call);
            }
        }
        if let Some((i, _)) = &self.running {
            Progress::Run(self.calls[*i].clone())
        } else if self.waiting.is_some() {
            Progress::Waiting
        } else {
            Progress::Done(std::mem::take(&mut self.results))
        }
    }

    /// Applies a decision to the waiting call, then advances.
    pub fn decide(
        &mut self,
        decision: Decision,
        guard: &mut LoopGuard,
        perms: &mut Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        let Some(w) = self.waiting.take() else {
            return Progress::Waiting;
        };
        events.push(EventBody::PermissionResolved {
            request_id: w.request_id.clone(),
            tool_call_id: self.calls[w.index].id.clone(),
            outcome: decision.as_str().into(),
        });
        match decision {
            Decision::AllowOnce | Decision::AllowAlways => {
                if decision == Decision::AllowAlways {
                    perms.allow_always(&self.calls[w.index]);
                }
                if let Some(call) = self.run(w.index, w.key, guard, events) {
                    return Progress::Run(call);
                }
                self.advance(guard, perms, events)
            }
            Decision::Reject | Decision::Cancelled => {
                let why = if decision == Decision::Reject {
                    "The user denied permission for this call; it did not run."
                } else {
                    "The turn ended before permission was given; this call did not run."
                };
                let output = ToolOutput {
                    ok: false,
                    output: why.into(),
                };
                guard.finished(
                    &w.key,
                    CallOutcome {
                        ok: false,
                        signature: signature(&output),
                    },
                );
                self.fail(w.index, output, None, events);
                if decision == Decision::Cancelled {
                    // Nothing more runs; unreached calls were never announced.
                    self.next = self.calls.len();
                    return Progress::Done(std::mem::take(&mut self.results));
                }
                self.advance(guard, perms, events)
            }
        }
    }

    /// The id of the call running off the actor, if any.
    pub fn running(&self) -> Option<&str> {
        self.running
            .as_ref()
            .map(|(i, _)| self.calls[*i].id.as_str())
    }

    /// Takes the output of the running call `id`, then advances. A stale id
    /// (the call was abandoned) changes nothing.
    pub fn finish(
        &mut self,
        id: &str,
        output: ToolOutput,
        guard: &mut LoopGuard,
        perms: &Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        if self.running() != Some(id) {
            return Progress::Waiting;
        }
        let (i, key) = self.running.take().expect("checked above");
        self.complete(i, &key, output, guard, events);
        self.advance(guard, perms, events)
    }

    /// The turn ended: a call waiting for permission or still running
    /// fails, nothing more runs, and the results so far are returned.
    pub fn abandon(
        &mut self,
        guard: &mut LoopGuard,
        perms: &mut Permissions,
        events: &mut Vec<EventBody>,
    ) -> Option<Progress> {
        if self.waiting.is_some() {
            return Some(self.decide(Decision::Cancelled, guard, perms, events));
        }
        let (i, _) = self.running.take()?;
        let output = ToolOutput {
            ok: false,
            output: "The turn ended before this call finished; it was stopped.".into(),
        };
        self.fail(i, output, None, events);
        self.next = self.calls.len();
        Some(Progress::Done(std::mem::take(&mut self.results)))
    }

    /// Starts call `i`: a simulated call completes now; a real one is
    /// returned to be run off the actor.
    fn run(
        &mut self,
        i: usize,
        key: CallKey,
        guard: &mut LoopGuard,
        events: &mut Vec<EventBody>,
    ) -> Option<ToolCall> {
        let call = &self.calls[i];
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: ToolStatus::InProgress,
            output: None,
            error: None,
        });
        match call.simulated.clone() {
            Some(output) => {
                self.complete(i, &key, output, guard, events);
                None
            }
            None => {
                let call = call.clone();
                self.running = Some((i, key));
                Some(call)
            }
        }
    }

    fn complete(
        &mut self,
        i: usize,
        key: &CallKey,
        output: ToolOutput,
        guard: &mut LoopGuard,
        events: &mut Vec<EventBody>,
    ) {
        let call = &self.calls[i];
        guard.finished(
            key,
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
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: call.id.clone(),
            status: if output.ok {
                ToolStatus::Completed
            } else {
                ToolStatus::Failed
            },
            output: Some(output.output.clone()),
            error: None,
        });
        self.results.push(ToolResult {
            id: call.id.clone(),
            output,
        });
    }

    fn fail(
        &mut self,
        i: usize,
        output: ToolOutput,
        error: Option<ToolError>,
        events: &mut Vec<EventBody>,
    ) {
        metrics::counter!("tiller_tool_calls_total", "status" => "failed").increment(1);
        let id = self.calls[i].id.clone();
        events.push(EventBody::ToolCallUpdate {
            tool_call_id: id.clone(),
            status: ToolStatus::Failed,
            output: Some(output.output.clone()),
            error,
        });
        self.results.push(ToolResult { id, output });
    }

    /// The tripping call (already announced) and every later call fail
    /// with the skip reason; none runs, none stays pending.
    fn skip_rest(&mut self, from: usize, loop_type: LoopType, events: &mut Vec<EventBody>) {
        let message = skip_message(loop_type);
        for i in from..self.calls.len() {
            if i > from {
                events.push(announce(&self.calls[i]));
            }
            let error = ToolError {
                error_kind: "loop_detected".into(),
                loop_type: Some(loop_type.as_str().into()),
                code: "LOOP_DETECTED".into(),
                message: message.clone(),
            };
            self.fail(
                i,
                ToolOutput {
                    ok: false,
                    output: message.clone(),
                },
                Some(error),
                events,
            );
        }
        self.next = self.calls.len();
    }
}

/// The event that announces a call (the session adds its locations).
fn announce(call: &ToolCall) -> EventBody {
    EventBody::ToolCall {
        tool_call_id: call.id.clone(),
        name: call.name.clone(),
        input: call.input.clone(),
        status: ToolStatus::Pending,
        locations: Vec::new(),
    }
}

/// What a refused call of an unattended turn tells the model.
fn unattended_message(call: &ToolCall, mode: PermissionMode) -> String {
    format!(
        "Refused: `{}` needs a person's permission (permission mode `{}`), and this turn runs \
         unattended, so nobody can give it. It did not run. Continue without it, or say what \
         you would need a person to allow.",
        call.name,
        mode.as_str()
    )
}

/// The text a skipped call carries (and the model would see).
pub fn skip_message(loop_type: LoopType) -> String {
    format!(
        "Skipped by loop protection ({loop_type}): {}. This call did not run.",
        loop_type.describe()
    )
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
mod tests;

#[cfg(test)]
mod batch_model;
