//! Any interleaving of permission decisions, call outputs (timely or stale)
//! and abandonment ends every announced call exactly once.

use std::collections::HashMap;

use proptest::prelude::*;
use tiller_core::{LoopConfig, loop_guard::Rule};

use super::*;

#[derive(Clone, Debug)]
struct Spec {
    name: &'static str,
    /// Few distinct arguments, so loop trips happen.
    arg: u8,
    /// A scripted call (simulated output) or a real one.
    simulated: Option<bool>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop::sample::select(vec!["read_file", "write_file", "shell", "poll"]),
        0u8..2,
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(name, arg, simulated)| Spec {
            name,
            arg,
            simulated,
        })
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Decide(u8),
    Finish(bool),
    Stale,
    Abandon,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0u8..4).prop_map(Action::Decide),
        4 => any::<bool>().prop_map(Action::Finish),
        1 => Just(Action::Stale),
        1 => Just(Action::Abandon),
    ]
}

fn mode() -> impl Strategy<Value = PermissionMode> {
    prop::sample::select(vec![
        PermissionMode::Ask,
        PermissionMode::AcceptEdits,
        PermissionMode::AllowAll,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn every_announced_call_ends_exactly_once(
        specs in prop::collection::vec(spec(), 1..9),
        actions in prop::collection::vec(action(), 0..40),
        mode in mode(),
        threshold in 2usize..5,
        unattended in any::<bool>(),
    ) {
        let calls: Vec<ToolCall> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| ToolCall {
                id: format!("c{i}"),
                name: s.name.into(),
                kind: ToolKind::of(s.name),
                input: serde_json::json!({ "a": s.arg }),
                simulated: s.simulated.map(|ok| ToolOutput { ok, output: "o".into() }),
            })
            .collect();
        let mut guard = LoopGuard::new(LoopConfig {
            consecutive_identical_tool_calls: Rule { enabled: true, threshold },
            ..LoopConfig::default()
        });
        let mut perms = Permissions::new(mode);
        let mut batch = Batch::new(calls.clone(), &mut CallIds::default(), unattended);
        let mut ev = Vec::new();
        let mut progress = batch.advance(&mut guard, &perms, &mut ev);
        let mut actions = actions.into_iter();
        // Drive until the batch ends; out of actions, every wait is
        // answered and every run finishes.
        let results = loop {
            match progress {
                Progress::Done(r) => break r,
                Progress::Tripped(_, r) => {
                    prop_assert_eq!(r.len(), calls.len(), "a trip fails every remaining call");
                    break r;
                }
                Progress::Waiting | Progress::Run(..) => {
                    let act = actions.next().unwrap_or(if batch.running().is_some() {
                        Action::Finish(true)
                    } else {
                        Action::Decide(0)
                    });
                    progress = match act {
                        Action::Abandon => {
                            let p = batch.abandon(&mut guard, &mut perms, &mut ev);
                            prop_assert!(p.is_some(), "a waiting or running batch can be abandoned");
                            p.expect("checked")
                        }
                        Action::Stale => {
                            let p = batch.finish(CallId(u64::MAX), ToolOutput { ok: true, output: String::new() }, &mut guard, &perms, &mut ev);
                            prop_assert_eq!(&p, &Progress::Waiting, "a stale output changes nothing");
                            if let Some(id) = batch.running() {
                                Progress::Run(id, calls[id.0 as usize].clone())
                            } else {
                                Progress::Waiting
                            }
                        }
                        Action::Finish(ok) => match batch.running() {
                            Some(id) => batch.finish(id, ToolOutput { ok, output: "r".into() }, &mut guard, &perms, &mut ev),
                            None => Progress::Waiting,
                        },
                        Action::Decide(d) => {
                            if batch.waiting().is_some() {
                                let d = [Decision::AllowOnce, Decision::AllowAlways, Decision::Reject, Decision::Cancelled][d as usize];
                                batch.decide(d, &mut guard, &mut perms, &mut ev)
                            } else if let Some(id) = batch.running() {
                                Progress::Run(id, calls[id.0 as usize].clone())
                            } else {
                                Progress::Waiting
                            }
                        }
                    };
                }
            }
        };
        // Announcements, finals and permission pairs, per call.
        let mut announced: Vec<String> = Vec::new();
        let mut finals: HashMap<String, usize> = HashMap::new();
        let mut requested = 0;
        let mut resolved = 0;
        for e in &ev {
            match e {
                EventBody::ToolCall { tool_call_id, .. } => {
                    prop_assert!(!announced.contains(tool_call_id), "announced twice");
                    announced.push(tool_call_id.clone());
                }
                EventBody::ToolCallUpdate { tool_call_id, status, .. } => {
                    prop_assert!(announced.contains(tool_call_id), "update before announcement");
                    prop_assert_eq!(finals.get(tool_call_id).copied().unwrap_or(0), 0, "update after the end");
                    if *status != ToolStatus::InProgress {
                        *finals.entry(tool_call_id.clone()).or_default() += 1;
                    }
                }
                EventBody::PermissionRequested { .. } => requested += 1,
                EventBody::PermissionResolved { .. } => resolved += 1,
                _ => {}
            }
        }
        for id in &announced {
            prop_assert_eq!(finals.get(id).copied(), Some(1), "call {} ends exactly once", id);
        }
        prop_assert_eq!(requested, resolved, "every request is resolved");
        prop_assert!(!unattended || requested == 0, "an unattended batch never asks");
        prop_assert_eq!(
            results.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
            announced,
            "one result per announced call, in order"
        );
        prop_assert!(batch.running().is_none() && batch.waiting().is_none());
    }
}
