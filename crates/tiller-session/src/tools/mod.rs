//! The session's tool pipeline: the rules (announce, loop check,
//! permission, run, finish, abandon) are the pure core
//! `tiller_core::pipeline`; this module renders what the core decides as
//! events and tool results, and owns what the core does not know: the
//! calls' content, outputs, permission request ids and the wire ids.
//!
//! Every call has a [`CallId`] the core assigns; the id a call is
//! published under is the model's own, made unique when the model repeats
//! one in the session (as some servers do every turn), so two calls never
//! alias each other in any client.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use tiller_core::pipeline::{self, CallId, CallSpec, Failure, PipeEvent};
use tiller_core::{CallKey, CallOutcome, LoopGuard, LoopType};
use tiller_engine::{ToolCall, ToolKind, ToolOutput, ToolResult};

use crate::event::{EventBody, PermissionOption, ToolError, ToolStatus};
mod permissions;

pub use permissions::*;
pub use tiller_core::pipeline::Decision;

/// The call waiting for a decision.
#[derive(Clone, Debug)]
pub struct Waiting {
    /// The request's id (clients answer with it).
    pub request_id: String,
    /// The call.
    pub call: CallId,
}

/// Where a batch stands after it advanced.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// Every call ended: hand the results to the engine.
    Done(Vec<ToolResult>),
    /// A call waits for a person.
    Waiting,
    /// This call must run now (off the actor); hand its output to
    /// [`Batch::finish`] with its id.
    Run(CallId, ToolCall),
    /// The loop guard stopped the batch; the rest of it failed unstarted.
    Tripped(LoopType, Vec<ToolResult>),
}

/// One tool batch going through the pipeline.
#[derive(Debug)]
pub struct Batch {
    core: pipeline::Batch,
    /// The id of `calls[0]`.
    first: u64,
    calls: Vec<ToolCall>,
    /// The id each call is published under.
    wire: Vec<String>,
    results: Vec<ToolResult>,
    /// The pending request, if a call waits.
    waiting: Option<Waiting>,
}

/// Numbers a session's calls and keeps the ids they are published under
/// unique (among the last [`CallIds::REMEMBERED`], so a session that lives
/// for months does not grow: clients only ever confuse recent calls).
#[derive(Debug, Default)]
pub struct CallIds {
    next: u64,
    /// Set for a session rebuilt from its log (woken, or after a restart)
    /// that had turns: the turns it had then. What its earlier runs
    /// published is not remembered, so each id is published as
    /// `<model's id>#r<turns>`, which no earlier run used (its turns were
    /// fewer). A model's id that is itself of that form could still meet
    /// one; clients only ever see ids of calls that were stored.
    reloaded: Option<u64>,
    published: HashSet<String>,
    order: std::collections::VecDeque<String>,
}

impl CallIds {
    /// How many published ids are remembered.
    pub const REMEMBERED: usize = 4096;

    /// The ids of a session rebuilt from its log after `turns` turns.
    pub fn reloaded(turns: u64) -> Self {
        Self {
            reloaded: Some(turns),
            ..Self::default()
        }
    }

    /// What a session starting after `turns` turns holds: nothing until
    /// its first call for a new session, its reloaded ids for another.
    pub fn after(turns: u64) -> Option<Box<CallIds>> {
        (turns > 0).then(|| Box::new(Self::reloaded(turns)))
    }

    /// The id a hosted agent's call `model` is published under (numbered
    /// like any other call).
    pub(crate) fn hosted(&mut self, model: &str) -> String {
        let n = self.next;
        self.next += 1;
        self.publish(model, n)
    }

    /// The id call `n` with the model's id `model` is published under: the
    /// model's own (`<id>#r<turns>` in a reloaded session) unless that was
    /// published recently, then with `#<k>` after it.
    fn publish(&mut self, model: &str, n: u64) -> String {
        let base = match self.reloaded {
            None => model.to_owned(),
            Some(turns) => format!("{model}#r{turns}"),
        };
        let mut id = base.clone();
        let mut k = n;
        while self.published.contains(&id) {
            id = format!("{base}#{k}");
            k += 1;
        }
        self.published.insert(id.clone());
        self.order.push_back(id.clone());
        if self.order.len() > Self::REMEMBERED
            && let Some(old) = self.order.pop_front()
        {
            self.published.remove(&old);
        }
        id
    }
}

impl Batch {
    /// A batch of `calls`, numbered by `ids`. `unattended`: nobody is there
    /// to answer (a cron, notification, goal or channel turn), so calls
    /// that would ask are refused at once.
    pub fn new(calls: Vec<ToolCall>, ids: &mut CallIds, unattended: bool) -> Self {
        let first = CallId(ids.next);
        ids.next += calls.len() as u64;
        // A repeated model id is published as its own call.
        let wire = calls
            .iter()
            .enumerate()
            .map(|(i, c)| ids.publish(&c.id, first.0 + i as u64))
            .collect();
        let specs = calls
            .iter()
            .map(|c| CallSpec {
                key: CallKey {
                    tool: c.name.clone(),
                    args: canonical_json(&c.input),
                },
                simulated: c.simulated.as_ref().map(outcome),
            })
            .collect();
        Self {
            core: pipeline::Batch::new(first, specs, unattended),
            first: first.0,
            results: Vec::with_capacity(calls.len()),
            calls,
            wire,
            waiting: None,
        }
    }

    /// The pending request, if the batch waits for one.
    pub fn waiting(&self) -> Option<(&Waiting, &ToolCall)> {
        let w = self.waiting.as_ref()?;
        Some((w, self.call(w.call)))
    }

    /// The call running off the actor, if any.
    pub fn running(&self) -> Option<CallId> {
        self.core.running()
    }

    fn call(&self, id: CallId) -> &ToolCall {
        &self.calls[self.core.index(id).expect("a call of this batch")]
    }

    /// Runs calls until the batch is done, waits, or trips. Appends the
    /// events to publish to `events`.
    pub fn advance(
        &mut self,
        guard: &mut LoopGuard,
        perms: &Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        let mut fx = Vec::new();
        let needs = needs(&self.calls, self.first, perms);
        let p = self.core.advance(guard, &needs, &mut fx);
        drop(needs);
        self.render(fx, None, perms, events);
        self.progress(p)
    }

    /// Applies a decision to the waiting call, then advances.
    pub fn decide(
        &mut self,
        decision: Decision,
        guard: &mut LoopGuard,
        perms: &mut Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        let Some(id) = self.core.waiting() else {
            return Progress::Waiting;
        };
        if decision == Decision::AllowAlways {
            perms.allow_always(self.call(id));
        }
        let mut fx = Vec::new();
        let needs = needs(&self.calls, self.first, perms);
        let p = self.core.decide(id, decision, guard, &needs, &mut fx);
        drop(needs);
        self.render(fx, None, perms, events);
        p.map_or(Progress::Waiting, |p| self.progress(p))
    }

    /// Takes the output of the running call `id`, then advances. A stale id
    /// (the call was abandoned) changes nothing.
    pub fn finish(
        &mut self,
        id: CallId,
        output: ToolOutput,
        guard: &mut LoopGuard,
        perms: &Permissions,
        events: &mut Vec<EventBody>,
    ) -> Progress {
        let mut fx = Vec::new();
        let needs = needs(&self.calls, self.first, perms);
        let p = self
            .core
            .finish(id, outcome(&output), guard, &needs, &mut fx);
        drop(needs);
        let Some(p) = p else {
            return Progress::Waiting;
        };
        // A `todo` call that succeeded sets the plan the user sees.
        let call = self.call(id);
        let plan = (output.ok && call.name == "todo")
            .then(|| tiller_tools::todo_entries(&call.input).ok())
            .flatten();
        self.render(fx, Some((id, output)), perms, events);
        if let Some(entries) = plan {
            events.push(EventBody::Plan {
                entries: entries
                    .into_iter()
                    .map(|(content, status)| crate::event::PlanEntry { content, status })
                    .collect(),
            });
        }
        self.progress(p)
    }

    /// The turn ended: a call waiting for permission or still running
    /// fails, nothing more runs, and the results so far are returned.
    pub fn abandon(
        &mut self,
        guard: &mut LoopGuard,
        perms: &mut Permissions,
        events: &mut Vec<EventBody>,
    ) -> Option<Progress> {
        let mut fx = Vec::new();
        let p = self.core.abandon(guard, &mut fx)?;
        self.render(fx, None, perms, events);
        Some(self.progress(p))
    }

    fn progress(&mut self, p: pipeline::Progress) -> Progress {
        match p {
            pipeline::Progress::Done => Progress::Done(std::mem::take(&mut self.results)),
            pipeline::Progress::Waiting(_) => Progress::Waiting,
            pipeline::Progress::Run(id) => Progress::Run(id, self.call(id).clone()),
            pipeline::Progress::Tripped(t) => {
                Progress::Tripped(t, std::mem::take(&mut self.results))
            }
        }
    }

    /// The core's events as session events and tool results. `finished`
    /// is the output a [`Batch::finish`] brought.
    fn render(
        &mut self,
        fx: Vec<PipeEvent>,
        mut finished: Option<(CallId, ToolOutput)>,
        perms: &Permissions,
        events: &mut Vec<EventBody>,
    ) {
        for e in fx {
            match e {
                PipeEvent::Announced(id) => events.push(self.announce(id)),
                PipeEvent::Asked(id) => {
                    let request_id = format!("perm-{}", tiller_core::RequestId::new());
                    let call = self.call(id);
                    events.push(EventBody::PermissionRequested {
                        request_id: request_id.clone(),
                        tool_call_id: self.wire_id(id),
                        title: call.name.clone(),
                        options: options(call),
                        // Locations and diff are filled in from the toolbox
                        // as it is published.
                        call: Box::new(crate::event::AskedCall {
                            name: call.name.clone(),
                            input: call.input.clone(),
                            ..Default::default()
                        }),
                    });
                    self.waiting = Some(Waiting {
                        request_id,
                        call: id,
                    });
                }
                PipeEvent::Resolved(id, decision) => {
                    let request_id = self
                        .waiting
                        .take()
                        .filter(|w| w.call == id)
                        .map(|w| w.request_id)
                        .unwrap_or_default();
                    events.push(EventBody::PermissionResolved {
                        request_id,
                        tool_call_id: self.wire_id(id),
                        outcome: decision.as_str().into(),
                    });
                }
                PipeEvent::Started(id) => events.push(EventBody::ToolCallUpdate {
                    tool_call_id: self.wire_id(id),
                    status: ToolStatus::InProgress,
                    output: None,
                    error: None,
                }),
                PipeEvent::Completed(id, ok) => {
                    let output = match finished.take_if(|(f, _)| *f == id) {
                        Some((_, output)) => output,
                        None => self.call(id).simulated.clone().unwrap_or(ToolOutput {
                            ok,
                            output: String::new(),
                        }),
                    };
                    metrics::counter!(
                        "tiller_tool_calls_total",
                        "status" => if output.ok { "completed" } else { "failed" }
                    )
                    .increment(1);
                    events.push(EventBody::ToolCallUpdate {
                        tool_call_id: self.wire_id(id),
                        status: if output.ok {
                            ToolStatus::Completed
                        } else {
                            ToolStatus::Failed
                        },
                        output: Some(output.output.clone()),
                        error: None,
                    });
                    self.results.push(ToolResult {
                        id: self.call(id).id.clone(),
                        output,
                    });
                }
                PipeEvent::Failed(id, why) => {
                    let (text, error) = failure(self.call(id), why, perms.mode);
                    metrics::counter!("tiller_tool_calls_total", "status" => "failed").increment(1);
                    events.push(EventBody::ToolCallUpdate {
                        tool_call_id: self.wire_id(id),
                        status: ToolStatus::Failed,
                        output: Some(text.clone()),
                        error,
                    });
                    self.results.push(ToolResult {
                        id: self.call(id).id.clone(),
                        output: ToolOutput {
                            ok: false,
                            output: text,
                        },
                    });
                }
            }
        }
    }

    /// The id call `id` is published under.
    fn wire_id(&self, id: CallId) -> String {
        self.wire[self.core.index(id).expect("a call of this batch")].clone()
    }

    /// The event that announces a call (the session adds its locations).
    fn announce(&self, id: CallId) -> EventBody {
        let call = self.call(id);
        EventBody::ToolCall {
            tool_call_id: self.wire_id(id),
            name: call.name.clone(),
            input: call.input.clone(),
            status: ToolStatus::Pending,
            locations: Vec::new(),
            kind: None,
        }
    }
}

/// Whether a call needs a person's permission under `perms` now.
fn needs<'a>(
    calls: &'a [ToolCall],
    first: u64,
    perms: &'a Permissions,
) -> impl Fn(CallId) -> bool + 'a {
    move |id| perms.needs(&calls[(id.0 - first) as usize])
}

/// What a call that failed without its own output tells the model, and
/// the structured error clients get, if any.
pub(crate) fn failure(
    call: &ToolCall,
    why: Failure,
    mode: PermissionMode,
) -> (String, Option<ToolError>) {
    match why {
        Failure::Skipped(loop_type) => {
            let message = skip_message(loop_type);
            let error = ToolError {
                error_kind: "loop_detected".into(),
                loop_type: Some(loop_type.as_str().into()),
                code: "LOOP_DETECTED".into(),
                message: message.clone(),
            };
            (message, Some(error))
        }
        Failure::Unattended => {
            let message = unattended_message(call, mode);
            let error = ToolError {
                error_kind: "permission_unavailable".into(),
                loop_type: None,
                code: "PERMISSION_UNAVAILABLE".into(),
                message: message.clone(),
            };
            (message, Some(error))
        }
        Failure::Denied => (
            "The user denied permission for this call; it did not run.".into(),
            None,
        ),
        Failure::Cancelled => (
            "The turn ended before permission was given; this call did not run.".into(),
            None,
        ),
        Failure::Stopped => (
            "The turn ended before this call finished; it was stopped.".into(),
            None,
        ),
    }
}

fn outcome(out: &ToolOutput) -> CallOutcome {
    CallOutcome {
        ok: out.ok,
        signature: signature(out),
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
mod always_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod batch_model;
