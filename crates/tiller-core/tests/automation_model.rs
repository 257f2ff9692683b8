//! Property model of automatic work: the session core, the notification
//! queue core (`tiller_core::notify`), the goal core and the cron fires
//! core (`tiller_core::cron::Fires`: one waiting fire per job) exchange
//! messages over a bus, as the actors do;
//! a test scheduler (proptest) picks which message is delivered next, and
//! when prompts, notifications, cron fires and engine results happen.
//!
//! Checked: every admitted prompt gets exactly one terminal; automatic work
//! never starts while a turn runs or an interactive prompt waits; every
//! notification and cron fire runs exactly once (fires coalesce per job);
//! goal turns are counted and bounded; after a drain nothing is stranded.

use std::collections::{HashMap, HashSet, VecDeque};

use proptest::prelude::*;
use tiller_core::cron::{FireChange, Fires};
use tiller_core::goal::Goal;
use tiller_core::notify::Queues;
use tiller_core::{
    Answer, Effect, EngineStop, Input, LoopType, Origin, PromptId, SessionCore, Signal, StopReason,
    Terminal, TurnConfig,
};

const CFG: TurnConfig = TurnConfig {
    steer_receipt_timeout: 50,
    cancel_grace: 20,
    stall_timeout: 400,
    max_queued_prompts: 4,
    max_turn_events: 100_000,
};

/// The one session of the model.
const SESSION: tiller_core::SessionId = tiller_core::SessionId::from_u128(7);

/// Cron work ids are the fire ids offset by this (other work ids are small).
const CRON: u32 = 1 << 30;

/// Messages on the bus.
#[derive(Clone, Debug)]
enum Msg {
    Offer(Origin, u64, Option<u32>),
    Kick,
    Poll(Origin, u64),
    /// The session started offered work: the queue forgets it.
    Started(Origin, u32),
    GoalTurnEnded {
        loop_stopped: bool,
    },
}

/// What the scheduler can do.
#[derive(Clone, Debug)]
enum Step {
    /// Deliver the next message of one mailbox (picked modulo the non-empty
    /// ones). Mailboxes are FIFO, as actor mailboxes are.
    Deliver(usize),
    /// A person sends a prompt.
    Prompt,
    /// A notification is queued.
    Notify,
    /// One of two cron jobs fires (a job with a fire waiting coalesces).
    CronFires { second_job: bool },
    /// The running turn's engine ends it (or loop protection stops it).
    EngineEnds { looped: bool },
    /// A cancel.
    Cancel,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        prop_oneof![
            8 => any::<usize>().prop_map(Step::Deliver),
            2 => Just(Step::Prompt),
            2 => Just(Step::Notify),
            2 => any::<bool>().prop_map(|second_job| Step::CronFires { second_job }),
            4 => any::<bool>().prop_map(|looped| Step::EngineEnds { looped }),
            1 => Just(Step::Cancel),
        ],
        1..80,
    )
}

#[derive(Default)]
struct World {
    core: Option<SessionCore>,
    now: u64,
    bus: VecDeque<Msg>,
    next: u32,
    /// The notification queues (the actor's core); task ids are work ids.
    notifications: Queues,
    /// The waiting cron fires (the actor's core); fire ids are work ids.
    cron: Fires,
    goal: Option<Goal>,
    /// Work ids created per kind, and how often each ran.
    created: HashMap<u32, Origin>,
    ran: HashMap<u32, u32>,
    /// Prompt ids standing for offered work.
    work_of: HashMap<PromptId, (Origin, u32)>,
    admitted: HashSet<PromptId>,
    origin_of: HashMap<PromptId, Origin>,
    terminals: HashMap<PromptId, u32>,
    goal_turns_settled: u32,
    /// The prompt loop protection stopped last (its terminal tells the goal).
    loop_stopped: Option<PromptId>,
}

impl World {
    fn new() -> Self {
        let mut w = World {
            core: Some(SessionCore::new(CFG, 0).with_automatic(vec![
                Origin::Goal,
                Origin::Notification,
                Origin::Cron,
            ])),
            goal: Some(Goal::new("objective".into(), 3)),
            notifications: Queues::new(1_000),
            ..World::default()
        };
        // The goal was just set: the session is kicked.
        w.bus.push_back(Msg::Kick);
        w
    }

    fn fresh(&mut self) -> u32 {
        self.next += 1;
        self.next
    }

    fn core(&mut self) -> &mut SessionCore {
        self.core.as_mut().expect("core")
    }

    fn feed(&mut self, input: Input) {
        let now = self.now;
        let asking = match &input {
            Input::Prompt { prompt, .. } => Some(*prompt),
            _ => None,
        };
        let interactive_waiting = |c: &SessionCore, origins: &HashMap<PromptId, Origin>| {
            c.queued()
                .any(|p| origins.get(&p) == Some(&Origin::Interactive))
        };
        let step = self.core().on(now, input);
        match step.answer {
            Answer::OfferRefused { prompt, .. } => {
                // Still queued: offered again at a later poll.
                self.work_of.remove(&prompt).expect("offered work");
            }
            Answer::Queued { .. } => {
                self.admitted.insert(asking.expect("a prompt"));
            }
            _ => {}
        }
        for e in step.effects {
            match e {
                Effect::Poll { origin, poll } => self.bus.push_back(Msg::Poll(origin, poll)),
                Effect::StartTurn { prompt, origin, .. } => {
                    self.admitted.insert(prompt);
                    self.origin_of.insert(prompt, origin);
                    if origin != Origin::Interactive {
                        let core = self.core.as_ref().expect("core");
                        assert!(
                            !interactive_waiting(core, &self.origin_of),
                            "automatic work started while an interactive prompt waited"
                        );
                    }
                    if let Some((o, work)) = self.work_of.get(&prompt) {
                        *self.ran.entry(*work).or_default() += 1;
                        self.bus.push_back(Msg::Started(*o, *work));
                    }
                }
                Effect::LoopStopped { prompt, .. } => self.loop_stopped = Some(prompt),
                Effect::Settled {
                    prompt,
                    origin,
                    turn,
                    ..
                } => {
                    *self.terminals.entry(prompt).or_default() += 1;
                    if origin == Origin::Goal && turn.is_some() {
                        self.goal_turns_settled += 1;
                        let loop_stopped = self.loop_stopped == Some(prompt);
                        self.bus.push_back(Msg::GoalTurnEnded { loop_stopped });
                    }
                }
                _ => {}
            }
        }
    }

    fn deliver(&mut self, msg: Msg) {
        match msg {
            Msg::Kick => self.feed(Input::Kick),
            Msg::Offer(origin, poll, work) => {
                let prompt = work.map(|w| {
                    let p = PromptId::from_u128(u128::from(self.fresh()) + (1 << 64));
                    self.work_of.insert(p, (origin, w));
                    p
                });
                if let Some(p) = prompt {
                    self.origin_of.insert(p, origin);
                }
                self.feed(Input::Offer {
                    origin,
                    poll,
                    work: prompt.map(|p| (p, ())),
                });
            }
            Msg::Poll(Origin::Notification, poll) => {
                // Offering takes nothing off the queue.
                let w = self
                    .notifications
                    .next(SESSION)
                    .map(|q| q.task_id.parse().expect("a work id"));
                self.bus
                    .push_back(Msg::Offer(Origin::Notification, poll, w));
            }
            Msg::Poll(Origin::Cron, poll) => {
                let w = self.cron.next(SESSION).map(|f| f.id as u32 + CRON);
                self.bus.push_back(Msg::Offer(Origin::Cron, poll, w));
            }
            Msg::Poll(Origin::Goal, poll) => {
                let w = match self.goal.as_ref().and_then(Goal::continuation) {
                    Some(_) => {
                        let id = self.fresh();
                        self.created.insert(id, Origin::Goal);
                        Some(id)
                    }
                    None => None,
                };
                self.bus.push_back(Msg::Offer(Origin::Goal, poll, w));
            }
            Msg::Poll(..) => unreachable!(),
            Msg::Started(Origin::Notification, w) => {
                let id = self
                    .notifications
                    .session(SESSION)
                    .and_then(|q| q.iter().find(|i| i.task_id == w.to_string()).map(|i| i.id))
                    .expect("a started notification was queued");
                self.notifications.consumed(SESSION, id);
            }
            Msg::Started(Origin::Cron, w) => {
                let id = i64::from(w - CRON);
                assert!(
                    self.cron
                        .session(SESSION)
                        .is_some_and(|f| f.iter().any(|f| f.id == id)),
                    "the started fire was waiting"
                );
                self.cron.consumed(SESSION, id);
            }
            Msg::Started(..) => {}
            Msg::GoalTurnEnded { loop_stopped } => {
                if let Some(g) = &mut self.goal {
                    g.turn_ended(loop_stopped);
                }
            }
        }
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Deliver(i) => {
                // The next message of the picked mailbox, in FIFO order.
                let mut boxes: Vec<u8> = self.bus.iter().map(mailbox).collect();
                boxes.sort_unstable();
                boxes.dedup();
                if !boxes.is_empty() {
                    let target = boxes[i % boxes.len()];
                    let at = self
                        .bus
                        .iter()
                        .position(|m| mailbox(m) == target)
                        .expect("present");
                    let msg = self.bus.remove(at).expect("in range");
                    self.deliver(msg);
                }
            }
            Step::Prompt => {
                let p = PromptId::from_u128(u128::from(self.fresh()));
                self.origin_of.insert(p, Origin::Interactive);
                self.feed(Input::Prompt {
                    prompt: p,
                    origin: Origin::Interactive,
                    payload: (),
                });
            }
            Step::Notify => {
                let id = self.fresh();
                self.created.insert(id, Origin::Notification);
                let out = self
                    .notifications
                    .enqueue(SESSION, &id.to_string(), "", self.now as i64);
                assert!(!out.deduplicated && out.evicted.is_empty());
                self.bus.push_back(Msg::Kick);
            }
            Step::CronFires { second_job } => {
                let job = if second_job { "b" } else { "a" };
                match self.cron.fire(SESSION, job, "", self.now as i64) {
                    FireChange::Insert { fire, .. } => {
                        let id = u32::try_from(fire.id).expect("small ids") + CRON;
                        assert!(!self.created.contains_key(&id), "fire ids are fresh");
                        self.created.insert(id, Origin::Cron);
                    }
                    // Coalesced into the job's waiting fire: no new work.
                    FireChange::Refresh { fire, .. } => {
                        assert!(self.created.contains_key(&(fire.id as u32 + CRON)));
                    }
                }
                self.bus.push_back(Msg::Kick);
            }
            Step::EngineEnds { looped } => {
                if let Some((_, turn)) = self.core().active() {
                    let input = if looped {
                        Input::LoopTrip {
                            turn,
                            loop_type: LoopType::ConsecutiveIdenticalToolCalls,
                        }
                    } else {
                        Input::Signal {
                            turn,
                            signal: Signal::Result(StopReason::EndTurn),
                        }
                    };
                    self.feed(input);
                }
            }
            Step::Cancel => {
                self.now += 1;
                self.feed(Input::Cancel(EngineStop::Answered));
                self.now += CFG.cancel_grace;
                self.feed(Input::Tick);
            }
        }
    }

    /// Delivers everything and lets every turn end, until nothing moves.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if let Some(msg) = self.bus.pop_front() {
                self.deliver(msg);
            } else if self.core().active().is_some() {
                self.step(Step::EngineEnds { looped: false });
            } else if !self.notifications.is_empty() || self.cron.next(SESSION).is_some() {
                // Work is waiting and the session idle: its actor's kick.
                self.bus.push_back(Msg::Kick);
            } else {
                return;
            }
        }
        panic!("the system never went quiet");
    }
}

/// Which actor's mailbox a message goes to.
fn mailbox(m: &Msg) -> u8 {
    match m {
        Msg::Offer(..) | Msg::Kick => 0,
        Msg::Poll(Origin::Notification, _) | Msg::Started(Origin::Notification, _) => 1,
        Msg::Poll(Origin::Cron, _) | Msg::Started(Origin::Cron, _) => 2,
        _ => 3, // goal
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000),
        .. ProptestConfig::default()
    })]
    #[test]
    fn automatic_work_is_admitted_in_order_and_never_stranded(steps in steps()) {
        let mut w = World::new();
        for s in steps {
            w.step(s);
            for (p, n) in &w.terminals {
                prop_assert_eq!(*n, 1, "prompt {:?} got {} terminals", p, n);
            }
        }
        w.drain();
        for p in &w.admitted {
            prop_assert_eq!(w.terminals.get(p).copied(), Some(1), "prompt {:?}", p);
        }
        for (id, origin) in &w.created {
            if *origin != Origin::Goal {
                prop_assert_eq!(w.ran.get(id).copied(), Some(1), "{:?} work {} stranded or doubled", origin, id);
            }
        }
        let goal = w.goal.as_ref().unwrap();
        prop_assert_eq!(goal.turns_done, w.goal_turns_settled);
        prop_assert!(goal.turns_done <= goal.max_turns);
        // Terminals of automatic turns are never failures.
        let _ = Terminal::Completed(StopReason::EndTurn);
    }
}
