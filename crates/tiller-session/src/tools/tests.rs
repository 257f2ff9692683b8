//! The pipeline's unit tests.

use tiller_core::LoopConfig;

use super::*;

pub(super) fn call(
    id: &str,
    name: &str,
    input: serde_json::Value,
    ok: bool,
    output: &str,
) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        kind: ToolKind::of(name),
        input,
        simulated: Some(ToolOutput {
            ok,
            output: output.into(),
        }),
    }
}

fn finals(events: &[EventBody]) -> Vec<(String, ToolStatus)> {
    events
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

/// A batch of an interactive turn, numbered from 0.
fn batch(calls: Vec<ToolCall>) -> Batch {
    Batch::new(calls, &mut CallIds::default(), false)
}

fn guard() -> LoopGuard {
    LoopGuard::new(LoopConfig::default())
}

#[test]
fn a_real_call_pauses_the_batch_until_its_output_arrives() {
    let real = |id: &str| ToolCall {
        simulated: None,
        ..call(id, "list_dir", serde_json::json!({"p": id}), true, "")
    };
    let calls = vec![
        call("a", "read_file", serde_json::json!({}), true, "fine"),
        real("b"),
        real("c"),
    ];
    let mut ev = Vec::new();
    let mut g = guard();
    let perms = Permissions::default();
    let mut b = batch(calls);
    let Progress::Run(id, c) = b.advance(&mut g, &perms, &mut ev) else {
        panic!("b must run off the actor")
    };
    assert_eq!((c.id.as_str(), b.running()), ("b", Some(id)));
    assert_eq!(id, CallId(1), "the pipeline numbers the calls");
    // A stale output changes nothing.
    let out = |ok| ToolOutput {
        ok,
        output: "x".into(),
    };
    assert_eq!(
        b.finish(CallId(7), out(true), &mut g, &perms, &mut ev),
        Progress::Waiting
    );
    let Progress::Run(next, c) = b.finish(id, out(false), &mut g, &perms, &mut ev) else {
        panic!("c runs next")
    };
    assert_eq!(c.id, "c");
    // The finished call's id is stale now.
    assert_eq!(
        b.finish(id, out(true), &mut g, &perms, &mut ev),
        Progress::Waiting
    );
    let p = b.finish(next, out(true), &mut g, &perms, &mut ev);
    let Progress::Done(results) = p else {
        panic!("{p:?}")
    };
    assert_eq!(
        results.iter().map(|r| r.output.ok).collect::<Vec<_>>(),
        vec![true, false, true]
    );
    assert_eq!(
        finals(&ev),
        vec![
            ("a".into(), ToolStatus::Completed),
            ("b".into(), ToolStatus::Failed),
            ("c".into(), ToolStatus::Completed)
        ]
    );
}

#[test]
fn abandoning_a_running_call_fails_it_and_ends_the_batch() {
    let real = |id: &str| ToolCall {
        simulated: None,
        ..call(id, "list_dir", serde_json::json!({"p": id}), true, "")
    };
    let mut ev = Vec::new();
    let mut g = guard();
    let mut perms = Permissions::default();
    let mut b = batch(vec![real("a"), real("b")]);
    assert!(matches!(
        b.advance(&mut g, &perms, &mut ev),
        Progress::Run(..)
    ));
    let p = b.abandon(&mut g, &mut perms, &mut ev);
    assert!(matches!(p, Some(Progress::Done(ref r)) if r.len() == 1 && !r[0].output.ok));
    assert_eq!(finals(&ev), vec![("a".into(), ToolStatus::Failed)]);
    assert_eq!(b.running(), None);
    assert!(b.abandon(&mut g, &mut perms, &mut ev).is_none());
}

#[test]
fn six_identical_calls_run_four_and_fail_two() {
    let calls: Vec<_> = (0..6)
        .map(|i| {
            // Argument order does not matter.
            let input = if i % 2 == 0 {
                serde_json::json!({"a": 1, "b": 2})
            } else {
                serde_json::json!({"b": 2, "a": 1})
            };
            call(&format!("c{i}"), "read_file", input, true, "same")
        })
        .collect();
    let mut ev = Vec::new();
    let p = batch(calls).advance(&mut guard(), &Permissions::default(), &mut ev);
    let Progress::Tripped(LoopType::ConsecutiveIdenticalToolCalls, results) = p else {
        panic!("{p:?}")
    };
    assert_eq!(results.len(), 6);
    let s = finals(&ev);
    assert_eq!(s.len(), 6, "no call stays pending");
    assert!(s[..4].iter().all(|(_, st)| *st == ToolStatus::Completed));
    assert!(s[4..].iter().all(|(_, st)| *st == ToolStatus::Failed));
    let announced = ev
        .iter()
        .filter(|e| matches!(e, EventBody::ToolCall { .. }))
        .count();
    assert_eq!(announced, 6);
}

#[test]
fn permission_pauses_the_batch_and_decisions_resume_it() {
    let calls = vec![
        call(
            "w1",
            "write_file",
            serde_json::json!({"p": 1}),
            true,
            "written",
        ),
        call("r", "read_file", serde_json::json!({}), true, "read"),
        call(
            "w2",
            "write_file",
            serde_json::json!({"p": 2}),
            true,
            "written",
        ),
        call(
            "w3",
            "write_file",
            serde_json::json!({"p": 3}),
            true,
            "written",
        ),
    ];
    let mut perms = Permissions::default();
    let mut g = guard();
    let mut b = batch(calls);
    let mut ev = Vec::new();
    assert_eq!(b.advance(&mut g, &perms, &mut ev), Progress::Waiting);
    let first = b.waiting().unwrap().0.request_id.clone();
    assert!(first.starts_with("perm-"), "{first}");
    // Deny: w1 fails, r runs, w2 waits.
    assert_eq!(
        b.decide(Decision::Reject, &mut g, &mut perms, &mut ev),
        Progress::Waiting
    );
    assert_ne!(b.waiting().unwrap().0.request_id, first);
    // Always allow: w2 runs and w3 no longer asks.
    let p = b.decide(Decision::AllowAlways, &mut g, &mut perms, &mut ev);
    let Progress::Done(results) = p else {
        panic!("{p:?}")
    };
    assert_eq!(
        results.iter().map(|r| r.output.ok).collect::<Vec<_>>(),
        vec![false, true, true, true]
    );
    assert_eq!(
        finals(&ev),
        vec![
            ("w1".into(), ToolStatus::Failed),
            ("r".into(), ToolStatus::Completed),
            ("w2".into(), ToolStatus::Completed),
            ("w3".into(), ToolStatus::Completed),
        ]
    );
    let resolved: Vec<_> = ev
        .iter()
        .filter_map(|e| match e {
            EventBody::PermissionResolved { outcome, .. } => Some(outcome.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(resolved, vec!["reject_once", "allow_always"]);
}

#[test]
fn calls_that_share_a_model_call_id_never_share_a_request() {
    let calls = vec![
        call(
            "same",
            "write_file",
            serde_json::json!({"p": 1}),
            true,
            "one",
        ),
        call(
            "same",
            "write_file",
            serde_json::json!({"p": 2}),
            true,
            "two",
        ),
    ];
    let mut perms = Permissions::default();
    let mut g = guard();
    let mut b = batch(calls);
    let mut ev = Vec::new();
    assert_eq!(b.advance(&mut g, &perms, &mut ev), Progress::Waiting);
    let first = b.waiting().unwrap().0.request_id.clone();
    assert_eq!(
        b.decide(Decision::AllowOnce, &mut g, &mut perms, &mut ev),
        Progress::Waiting
    );
    let second = b.waiting().unwrap().0.request_id.clone();
    assert_ne!(
        first, second,
        "a second answer to the first request must not approve the second call"
    );
    // Nor do they share a published id: no client can mistake one for the
    // other.
    let announced: Vec<String> = ev
        .iter()
        .filter_map(|e| match e {
            EventBody::ToolCall { tool_call_id, .. } => Some(tool_call_id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(announced.len(), 2);
    assert_ne!(announced[0], announced[1]);
    assert_eq!(announced[0], "same", "a first use keeps the model's id");
}

/// Published ids for the model's `call_0` in two batches, given `ids`.
fn published_twice(mut ids: CallIds) -> Vec<String> {
    let mut ev = Vec::new();
    let mut g = guard();
    let perms = Permissions::default();
    for _ in 0..2 {
        let calls = vec![call(
            "call_0",
            "read_file",
            serde_json::json!({}),
            true,
            "x",
        )];
        Batch::new(calls, &mut ids, false).advance(&mut g, &perms, &mut ev);
    }
    ev.iter()
        .filter_map(|e| match e {
            EventBody::ToolCall { tool_call_id, .. } => Some(tool_call_id.clone()),
            _ => None,
        })
        .collect()
}

/// A session rebuilt from its log (woken, restarted) does not remember
/// what its earlier runs published: after 5 turns its ids are of a form
/// none of them used (they had fewer turns), so the model's `call_0`,
/// which an earlier run published bare, is not published bare again.
#[test]
fn a_reloaded_session_publishes_ids_its_earlier_runs_did_not() {
    assert_eq!(
        published_twice(CallIds::reloaded(5)),
        ["call_0#r5", "call_0#r5#1"]
    );
    assert!(
        CallIds::after(0).is_none(),
        "a new session's are made when first needed"
    );
    assert!(CallIds::after(5).is_some());
}

#[test]
fn a_model_id_reused_in_a_later_batch_is_published_as_its_own_call() {
    assert_eq!(published_twice(CallIds::default()), ["call_0", "call_0#1"]);
}

#[test]
fn a_cancelled_wait_fails_the_call_and_ends_the_batch() {
    let calls = vec![
        call("s", "shell", serde_json::json!({}), true, "ok"),
        call("t", "shell", serde_json::json!({"x": 1}), true, "ok"),
    ];
    let mut perms = Permissions::new(PermissionMode::AcceptEdits);
    let mut g = guard();
    let mut b = batch(calls);
    let mut ev = Vec::new();
    assert_eq!(b.advance(&mut g, &perms, &mut ev), Progress::Waiting);
    let p = b.decide(Decision::Cancelled, &mut g, &mut perms, &mut ev);
    assert!(matches!(p, Progress::Done(ref r) if r.len() == 1));
    assert_eq!(finals(&ev), vec![("s".into(), ToolStatus::Failed)]);
    assert!(b.waiting().is_none());
}

#[test]
fn modes() {
    let edit = call("e", "write_file", serde_json::json!({}), true, "");
    let exec = call("x", "shell", serde_json::json!({}), true, "");
    let read = call("r", "read_file", serde_json::json!({}), true, "");
    for (mode, want) in [
        (PermissionMode::Ask, [true, true, false]),
        (PermissionMode::AcceptEdits, [false, true, false]),
        (PermissionMode::AllowAll, [false, false, false]),
    ] {
        let p = Permissions::new(mode);
        assert_eq!(
            [p.needs(&edit), p.needs(&exec), p.needs(&read)],
            want,
            "{mode:?}"
        );
    }
}

#[test]
fn an_unattended_call_that_would_ask_is_refused_at_once() {
    let calls = vec![
        call("r", "read_file", serde_json::json!({}), true, "read"),
        call("w", "write_file", serde_json::json!({}), true, "written"),
        call(
            "s",
            "shell",
            serde_json::json!({"command": "ls"}),
            true,
            "ran",
        ),
    ];
    let mut ev = Vec::new();
    let p = Batch::new(calls, &mut CallIds::default(), true).advance(
        &mut guard(),
        &Permissions::default(),
        &mut ev,
    );
    let Progress::Done(results) = p else {
        panic!("{p:?}")
    };
    assert_eq!(
        results.iter().map(|r| r.output.ok).collect::<Vec<_>>(),
        vec![true, false, false]
    );
    assert!(results[1].output.output.contains("unattended"));
    assert!(
        !ev.iter()
            .any(|e| matches!(e, EventBody::PermissionRequested { .. })),
        "nobody is asked"
    );
    // In allow-all mode nothing needs asking, so everything runs.
    let mut ev = Vec::new();
    let p = Batch::new(
        vec![call("w", "write_file", serde_json::json!({}), true, "ok")],
        &mut CallIds::default(),
        true,
    )
    .advance(
        &mut guard(),
        &Permissions::new(PermissionMode::AllowAll),
        &mut ev,
    );
    assert!(matches!(p, Progress::Done(ref r) if r[0].output.ok));
}

#[test]
fn canonical_json_sorts_keys_deeply() {
    let a = serde_json::json!({"z": [{"y": 1, "x": 2}], "a": "s"});
    assert_eq!(canonical_json(&a), r#"{"a":"s","z":[{"x":2,"y":1}]}"#);
}

/// "Always" on a command covers it in the session's directory only: the
/// same command line elsewhere (`cwd`) may run another directory's scripts
/// (`npm test` reads the `package.json` it finds), so it asks; a command
/// given a directory is not offered "always".
#[test]
fn an_always_rule_covers_its_command_in_the_session_s_directory_only() {
    let shell = |input| call("s", "shell", input, true, "");
    let mut perms = Permissions::new(PermissionMode::Ask);
    perms.allow_always(&shell(serde_json::json!({ "command": "npm test" })));
    assert!(!perms.needs(&shell(serde_json::json!({ "command": "npm test" }))));
    for here in ["", ".", "./"] {
        let call = shell(serde_json::json!({ "command": "npm test", "cwd": here }));
        assert!(
            !perms.needs(&call),
            "cwd {here:?} is the session's directory"
        );
    }
    let elsewhere = shell(serde_json::json!({ "command": "npm test", "cwd": "examples/x" }));
    assert!(
        perms.needs(&elsewhere),
        "the same command in another directory asks"
    );
    assert!(!may_always(&elsewhere));
    assert!(!options(&elsewhere).iter().any(|o| o.kind == "allow_always"));
    // Its "always" remembers nothing that covers it.
    perms.allow_always(&elsewhere);
    assert!(perms.needs(&elsewhere));
}
