//! The tool pipeline core: the rules one batch of tool calls goes
//! through, sans-IO. Each call, in the batch's order, is announced, checked
//! by the turn's loop guard, asked about when it needs a person's
//! permission (refused at once when nobody can answer), run, and finished;
//! a turn that ends abandons what is left. The session renders the
//! [`PipeEvent`]s as events and runs the calls [`Progress::Run`] names.
//!
//! Calls are identified by the [`CallId`]s this core assigns, never by the
//! model's own call ids: a model may repeat an id, and two calls that share
//! one must never share a permission request, an output or a result.

use crate::{CallKey, CallOutcome, LoopGuard, LoopType};

/// A call's identity, assigned by the pipeline: the session numbers every
/// call it sees, so ids never repeat within a session actor's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

impl std::fmt::Display for CallId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "call-{}", self.0)
    }
}

/// What the pipeline needs to know of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallSpec {
    /// Its loop-guard key (tool and canonical arguments).
    pub key: CallKey,
    /// A scripted call carries its outcome: it completes as soon as it
    /// runs, without leaving the pipeline.
    pub simulated: Option<CallOutcome>,
}

/// A person's answer to a permission request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run this call.
    AllowOnce,
    /// Run it, and calls like it from now on (the session remembers).
    AllowAlways,
    /// Do not run it.
    Reject,
    /// The turn ended before anyone answered.
    Cancelled,
}

impl Decision {
    /// Reads a permission option id.
    pub fn from_option(id: &str) -> Option<Decision> {
        Some(match id {
            "allow_once" => Decision::AllowOnce,
            "allow_always" => Decision::AllowAlways,
            "reject_once" => Decision::Reject,
            _ => return None,
        })
    }

    /// Its stable name (the option id; `cancelled` for no answer).
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::AllowOnce => "allow_once",
            Decision::AllowAlways => "allow_always",
            Decision::Reject => "reject_once",
            Decision::Cancelled => "cancelled",
        }
    }

    fn allows(self) -> bool {
        matches!(self, Decision::AllowOnce | Decision::AllowAlways)
    }
}

/// Why a call failed without its own output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Loop protection stopped the batch at or before this call.
    Skipped(LoopType),
    /// It needs a permission and the turn runs unattended.
    Unattended,
    /// The person denied it.
    Denied,
    /// The turn ended while it waited for permission.
    Cancelled,
    /// The turn ended while it ran; it was stopped.
    Stopped,
}

impl Failure {
    /// The loop guard's signature of this failure (one per kind: the guard
    /// counts a tool's consecutive failures with one signature).
    fn signature(self) -> u64 {
        0xfa11_0000
            + match self {
                Failure::Skipped(_) => 1,
                Failure::Unattended => 2,
                Failure::Denied => 3,
                Failure::Cancelled => 4,
                Failure::Stopped => 5,
            }
    }
}

/// What happened to a call, in order, for the session to publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipeEvent {
    /// The call is announced (pending).
    Announced(CallId),
    /// It waits for a person's decision.
    Asked(CallId),
    /// The decision came (or the turn ended first: `Cancelled`).
    Resolved(CallId, Decision),
    /// It is running.
    Started(CallId),
    /// It finished with its own output (`ok` or not).
    Completed(CallId, bool),
    /// It failed without its own output.
    Failed(CallId, Failure),
}

/// Where a batch stands after it moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Every call ended: hand the results to the engine.
    Done,
    /// This call waits for a person.
    Waiting(CallId),
    /// This call must run now (off the actor); its output goes to
    /// [`Batch::finish`].
    Run(CallId),
    /// The loop guard stopped the batch; every call from the tripping one
    /// on failed unstarted. The turn must stop.
    Tripped(LoopType),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Unreached,
    Announced,
    Waiting,
    Running,
    Ended,
}

/// One tool batch going through the pipeline. It is resumable: a call that
/// waits for a decision or runs off the actor pauses it, and the batch
/// goes on when the answer or the output arrives.
#[derive(Clone, Debug)]
pub struct Batch {
    first: u64,
    calls: Vec<(CallSpec, State)>,
    /// The next call to consider.
    next: usize,
    /// Nobody is there to answer (a cron, notification, goal or channel
    /// turn): a call that would ask fails at once instead.
    unattended: bool,
}

impl Batch {
    /// A batch whose calls get the ids `first`, `first + 1`, ...
    pub fn new(first: CallId, calls: Vec<CallSpec>, unattended: bool) -> Self {
        Self {
            first: first.0,
            calls: calls.into_iter().map(|c| (c, State::Unreached)).collect(),
            next: 0,
            unattended,
        }
    }

    /// The id of the batch's `i`-th call.
    pub fn id(&self, i: usize) -> CallId {
        CallId(self.first + i as u64)
    }

    /// The position in the batch of call `id`, if it is one of its calls.
    pub fn index(&self, id: CallId) -> Option<usize> {
        let i = id.0.checked_sub(self.first)? as usize;
        (i < self.calls.len()).then_some(i)
    }

    /// The call waiting for a decision, if any.
    pub fn waiting(&self) -> Option<CallId> {
        self.find(State::Waiting)
    }

    /// The call running off the actor, if any.
    pub fn running(&self) -> Option<CallId> {
        self.find(State::Running)
    }

    fn find(&self, state: State) -> Option<CallId> {
        let i = self.calls.iter().position(|(_, s)| *s == state)?;
        Some(self.id(i))
    }

    /// Moves calls on until the batch is done, waits, runs a call, or
    /// trips. `needs(id)` says whether a call needs a person's permission
    /// now (permissions can change during the batch).
    pub fn advance(
        &mut self,
        guard: &mut LoopGuard,
        needs: &dyn Fn(CallId) -> bool,
        fx: &mut Vec<PipeEvent>,
    ) -> Progress {
        if let Some(id) = self.waiting() {
            return Progress::Waiting(id);
        }
        if let Some(id) = self.running() {
            return Progress::Run(id);
        }
        while self.next < self.calls.len() {
            let i = self.next;
            self.next += 1;
            let id = self.id(i);
            self.calls[i].1 = State::Announced;
            fx.push(PipeEvent::Announced(id));
            if let Err(loop_type) = guard.check(&self.calls[i].0.key) {
                self.skip_rest(i, loop_type, fx);
                return Progress::Tripped(loop_type);
            }
            if needs(id) {
                if self.unattended {
                    self.fail(i, Failure::Unattended, guard, fx);
                    continue;
                }
                self.calls[i].1 = State::Waiting;
                fx.push(PipeEvent::Asked(id));
                return Progress::Waiting(id);
            }
            if let Some(p) = self.run(i, guard, fx) {
                return p;
            }
        }
        Progress::Done
    }

    /// Applies a decision to the waiting call `id`, then moves on. `None`
    /// when `id` is not the call that waits (a stale or repeated answer):
    /// nothing changes.
    pub fn decide(
        &mut self,
        id: CallId,
        decision: Decision,
        guard: &mut LoopGuard,
        needs: &dyn Fn(CallId) -> bool,
        fx: &mut Vec<PipeEvent>,
    ) -> Option<Progress> {
        let i = self
            .index(id)
            .filter(|&i| self.calls[i].1 == State::Waiting)?;
        fx.push(PipeEvent::Resolved(id, decision));
        if decision.allows() {
            if let Some(p) = self.run(i, guard, fx) {
                return Some(p);
            }
            return Some(self.advance(guard, needs, fx));
        }
        if decision == Decision::Cancelled {
            self.fail(i, Failure::Cancelled, guard, fx);
            // Nothing more runs; unreached calls are never announced.
            self.next = self.calls.len();
            return Some(Progress::Done);
        }
        self.fail(i, Failure::Denied, guard, fx);
        Some(self.advance(guard, needs, fx))
    }

    /// The running call `id` finished with `outcome`; the batch moves on.
    /// `None` when `id` is not the running call (it was abandoned):
    /// nothing changes.
    pub fn finish(
        &mut self,
        id: CallId,
        outcome: CallOutcome,
        guard: &mut LoopGuard,
        needs: &dyn Fn(CallId) -> bool,
        fx: &mut Vec<PipeEvent>,
    ) -> Option<Progress> {
        let i = self
            .index(id)
            .filter(|&i| self.calls[i].1 == State::Running)?;
        self.complete(i, outcome, guard, fx);
        Some(self.advance(guard, needs, fx))
    }

    /// The turn ended: a call waiting for permission is resolved
    /// `cancelled`, a running one is stopped, nothing more runs. `None`
    /// when neither was there (nothing to do).
    pub fn abandon(&mut self, guard: &mut LoopGuard, fx: &mut Vec<PipeEvent>) -> Option<Progress> {
        if let Some(id) = self.waiting() {
            return self.decide(id, Decision::Cancelled, guard, &|_| false, fx);
        }
        let i = self.index(self.running()?)?;
        self.fail(i, Failure::Stopped, guard, fx);
        self.next = self.calls.len();
        Some(Progress::Done)
    }

    /// Starts call `i`: a simulated call completes now (`None`: go on); a
    /// real one is handed out to run.
    fn run(
        &mut self,
        i: usize,
        guard: &mut LoopGuard,
        fx: &mut Vec<PipeEvent>,
    ) -> Option<Progress> {
        let id = self.id(i);
        fx.push(PipeEvent::Started(id));
        match self.calls[i].0.simulated {
            Some(outcome) => {
                self.complete(i, outcome, guard, fx);
                None
            }
            None => {
                self.calls[i].1 = State::Running;
                Some(Progress::Run(id))
            }
        }
    }

    fn complete(
        &mut self,
        i: usize,
        outcome: CallOutcome,
        guard: &mut LoopGuard,
        fx: &mut Vec<PipeEvent>,
    ) {
        guard.finished(&self.calls[i].0.key, outcome);
        self.calls[i].1 = State::Ended;
        fx.push(PipeEvent::Completed(self.id(i), outcome.ok));
    }

    fn fail(&mut self, i: usize, why: Failure, guard: &mut LoopGuard, fx: &mut Vec<PipeEvent>) {
        // A refusal is the call's outcome as the model sees it; a skip or a
        // stop is the turn's, not the call's.
        if matches!(
            why,
            Failure::Unattended | Failure::Denied | Failure::Cancelled
        ) {
            let outcome = CallOutcome {
                ok: false,
                signature: why.signature(),
            };
            guard.finished(&self.calls[i].0.key, outcome);
        }
        self.calls[i].1 = State::Ended;
        fx.push(PipeEvent::Failed(self.id(i), why));
    }

    /// The tripping call (already announced) and every later call fail
    /// skipped; none runs, none stays pending.
    fn skip_rest(&mut self, from: usize, loop_type: LoopType, fx: &mut Vec<PipeEvent>) {
        for i in from..self.calls.len() {
            if i > from {
                self.calls[i].1 = State::Announced;
                fx.push(PipeEvent::Announced(self.id(i)));
            }
            self.calls[i].1 = State::Ended;
            fx.push(PipeEvent::Failed(self.id(i), Failure::Skipped(loop_type)));
        }
        self.next = self.calls.len();
    }
}
