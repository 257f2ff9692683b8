//! The scripted engine's script format (`interfaces.md`), parsed strictly:
//! every error names the step and what is wrong with it.

use serde_json::{Map, Value};
use tiller_core::StopReason;

/// A parsed script.
#[derive(Clone, Debug, PartialEq)]
pub struct Script {
    /// The steps, with `result end_turn` and `idle` appended when the
    /// script has no `result`, `idle`, `fail` or `hang` step.
    pub steps: Vec<Step>,
}

/// One simulated tool call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolStep {
    pub name: String,
    /// `kind` in the script, else the kind of the built-in tool of that name.
    pub kind: crate::ToolKind,
    pub input: Value,
    pub ok: bool,
    pub output: String,
}

/// One script step.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Say(String),
    Think(String),
    /// Plan entries `(content, status)`.
    Plan(Vec<(String, String)>),
    /// The agent names the session.
    Title(String),
    /// What a model request used: `(input, output)` tokens.
    Usage(u64, u64),
    Tools(Vec<ToolStep>),
    SleepMs(u64),
    Result(StopReason),
    Idle,
    Fail(String),
    Hang,
    /// The engine's task panics with this message (to show what a crashing
    /// engine does to a turn).
    Crash(String),
    AwaitSteer(u64),
    ConsumeSteer,
    DropSteer,
    Stale(Box<Step>),
    Repeat {
        times: u32,
        steps: Vec<Step>,
    },
}

/// A script that could not be parsed. The message names the bad step.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid script: {path}: {message}")]
pub struct ScriptError {
    /// Where: `script[2].tool.outcome`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// Where a step is, formatted only when an error names it (a script is
/// parsed at every prompt).
#[derive(Clone, Copy)]
enum At<'a> {
    Root(&'static str),
    Index(&'a At<'a>, usize),
    Key(&'a At<'a>, &'a str),
}

impl std::fmt::Display for At<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Root(name) => f.write_str(name),
            At::Index(parent, i) => write!(f, "{parent}[{i}]"),
            At::Key(parent, key) => write!(f, "{parent}.{key}"),
        }
    }
}

impl<'a> At<'a> {
    fn index(&'a self, i: usize) -> At<'a> {
        At::Index(self, i)
    }

    fn key(&'a self, key: &'a str) -> At<'a> {
        At::Key(self, key)
    }
}

fn err(path: &At<'_>, message: impl Into<String>) -> ScriptError {
    ScriptError {
        path: path.to_string(),
        message: message.into(),
    }
}

impl Script {
    /// Reads a prompt's text: `Ok(None)` when it is not a script (the demo
    /// reply), `Err` when it is a script with a bad step.
    pub fn from_prompt(text: &str) -> Result<Option<Script>, ScriptError> {
        let trimmed = text.trim_start();
        if !trimmed.starts_with('{') {
            return Ok(None);
        }
        // The script is the JSON object the text starts with; text after it
        // (a goal continuation's note, say) is ignored. A script of plain
        // steps only (what a benchmark's prompt is) is read straight into
        // them; any other is read through a `Value`, which says what is
        // wrong where.
        if let Some(Ok(plain)) = serde_json::Deserializer::from_str(trimmed)
            .into_iter::<Plain>()
            .next()
        {
            return Ok(Some(Script::finish(
                plain.script.into_iter().map(Step::from).collect(),
            )));
        }
        Self::from_value_text(trimmed)
    }

    /// [`Script::from_prompt`] through a `Value`, for text that starts
    /// with `{`.
    fn from_value_text(trimmed: &str) -> Result<Option<Script>, ScriptError> {
        let mut values = serde_json::Deserializer::from_str(trimmed).into_iter::<Value>();
        let Some(Ok(Value::Object(obj))) = values.next() else {
            return Ok(None);
        };
        let Some(steps) = obj.get("script") else {
            return Ok(None);
        };
        Script::parse_steps(steps).map(Some)
    }

    /// Parses the value of `script`.
    pub fn parse_steps(steps: &Value) -> Result<Script, ScriptError> {
        Ok(Script::finish(parse_list(steps, &At::Root("script"))?))
    }

    fn finish(mut steps: Vec<Step>) -> Script {
        if !steps.iter().any(Step::ends_turn) {
            steps.push(Step::Result(StopReason::EndTurn));
            steps.push(Step::Idle);
        }
        Script { steps }
    }
}

/// A script whose steps are all plain ones, read without a `Value`. Only
/// `script`: another member would be skipped unchecked (a number beyond
/// `f64`, a lone surrogate, nesting past the `Value` read's limit), where
/// the `Value` read refuses the text as a script.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Plain {
    script: Vec<PlainStep>,
}

/// A step with one string or number (externally tagged, as a script
/// writes it: `{"say": "..."}`).
#[derive(serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum PlainStep {
    Say(String),
    Think(String),
    Title(String),
    SleepMs(u64),
}

impl From<PlainStep> for Step {
    fn from(s: PlainStep) -> Step {
        match s {
            PlainStep::Say(t) => Step::Say(t),
            PlainStep::Think(t) => Step::Think(t),
            PlainStep::Title(t) => Step::Title(t),
            PlainStep::SleepMs(ms) => Step::SleepMs(ms),
        }
    }
}

impl Step {
    fn ends_turn(&self) -> bool {
        match self {
            Step::Result(_) | Step::Idle | Step::Fail(_) | Step::Hang | Step::Crash(_) => true,
            Step::Repeat { steps, .. } => steps.iter().any(Step::ends_turn),
            _ => false,
        }
    }
}

fn parse_list(v: &Value, path: &At<'_>) -> Result<Vec<Step>, ScriptError> {
    let Value::Array(items) = v else {
        return Err(err(path, "expected an array of steps"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, s)| parse_step(s, &path.index(i)))
        .collect()
}

fn parse_step(v: &Value, path: &At<'_>) -> Result<Step, ScriptError> {
    let Value::Object(obj) = v else {
        return Err(err(path, "expected an object with one key"));
    };
    if obj.len() != 1 {
        return Err(err(path, format!("expected one key, found {}", obj.len())));
    }
    let (key, val) = obj.iter().next().expect("one key");
    let here = &path.key(key);
    Ok(match key.as_str() {
        "say" => Step::Say(string(val, here)?),
        "title" => Step::Title(string(val, here)?),
        "usage" => {
            let n = |k: &str| {
                val.get(k)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| err(&here.key(k), "expected a number of tokens"))
            };
            Step::Usage(n("input")?, n("output")?)
        }
        "think" => Step::Think(string(val, here)?),
        "plan" => {
            let Value::Array(entries) = val else {
                return Err(err(here, "expected an array of {\"content\", \"status\"}"));
            };
            let mut plan = Vec::new();
            for (i, e) in entries.iter().enumerate() {
                let at = here.index(i);
                let content = e
                    .get("content")
                    .ok_or_else(|| err(&at, "missing `content`"))
                    .and_then(|c| string(c, &at.key("content")))?;
                let status = match e.get("status").map(Value::as_str) {
                    None => "pending".to_owned(),
                    Some(Some(s @ ("pending" | "in_progress" | "completed"))) => s.to_owned(),
                    _ => {
                        return Err(err(
                            &at.key("status"),
                            "expected \"pending\", \"in_progress\" or \"completed\"",
                        ));
                    }
                };
                plan.push((content, status));
            }
            Step::Plan(plan)
        }
        "tool" => Step::Tools(vec![tool(val, here)?]),
        "tools" => {
            let Value::Array(calls) = val else {
                return Err(err(here, "expected an array of tool calls"));
            };
            if calls.is_empty() {
                return Err(err(here, "expected at least one tool call"));
            }
            Step::Tools(
                calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| tool(c, &here.index(i)))
                    .collect::<Result<_, _>>()?,
            )
        }
        "sleep_ms" => Step::SleepMs(uint(val, here)?),
        "result" => {
            let s = string(val, here)?;
            Step::Result(StopReason::parse(&s).ok_or_else(|| {
                err(
                    here,
                    format!(
                        "unknown stop reason `{s}` (expected end_turn, max_tokens, \
                         max_turn_requests, refusal or cancelled)"
                    ),
                )
            })?)
        }
        "idle" => {
            flag(val, here)?;
            Step::Idle
        }
        "fail" => Step::Fail(string(val, here)?),
        "crash" => Step::Crash(string(val, here)?),
        "hang" => {
            flag(val, here)?;
            Step::Hang
        }
        "await_steer" => Step::AwaitSteer(uint(val, here)?),
        "consume_steer" => {
            flag(val, here)?;
            Step::ConsumeSteer
        }
        "drop_steer" => {
            flag(val, here)?;
            Step::DropSteer
        }
        "stale" => {
            let inner = parse_step(val, here)?;
            match inner {
                Step::Say(_)
                | Step::Think(_)
                | Step::Plan(_)
                | Step::Title(_)
                | Step::Usage(..)
                | Step::Result(_)
                | Step::Idle
                | Step::Fail(_)
                | Step::Tools(_) => Step::Stale(Box::new(inner)),
                _ => return Err(err(here, "only a signal step can be stale")),
            }
        }
        "repeat" => {
            let Value::Object(r) = val else {
                return Err(err(here, "expected {\"times\": N, \"steps\": [...]}"));
            };
            let times = r
                .get("times")
                .ok_or_else(|| err(here, "missing `times`"))
                .and_then(|t| uint(t, &here.key("times")))?;
            let times = u32::try_from(times)
                .ok()
                .filter(|t| *t <= 10_000)
                .ok_or_else(|| err(here, "`times` must be at most 10000"))?;
            let steps = r
                .get("steps")
                .ok_or_else(|| err(here, "missing `steps`"))
                .and_then(|s| parse_list(s, &here.key("steps")))?;
            if let Some(extra) = r.keys().find(|k| *k != "times" && *k != "steps") {
                return Err(err(here, format!("unknown field `{extra}`")));
            }
            Step::Repeat { times, steps }
        }
        other => return Err(err(path, format!("unknown step `{other}`"))),
    })
}

fn string(v: &Value, path: &At<'_>) -> Result<String, ScriptError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| err(path, "expected a string"))
}

fn uint(v: &Value, path: &At<'_>) -> Result<u64, ScriptError> {
    v.as_u64()
        .ok_or_else(|| err(path, "expected a non-negative integer"))
}

fn flag(v: &Value, path: &At<'_>) -> Result<(), ScriptError> {
    match v {
        Value::Bool(true) => Ok(()),
        _ => Err(err(path, "expected true")),
    }
}

fn tool(v: &Value, path: &At<'_>) -> Result<ToolStep, ScriptError> {
    let Value::Object(t) = v else {
        return Err(err(
            path,
            "expected {\"name\", \"input\", \"outcome\", \"output\"}",
        ));
    };
    check_keys(t, path, &["name", "input", "outcome", "output", "kind"])?;
    let name = t
        .get("name")
        .ok_or_else(|| err(path, "missing `name`"))
        .and_then(|n| string(n, &path.key("name")))?;
    let ok = match t.get("outcome").map(Value::as_str) {
        None | Some(Some("ok")) => true,
        Some(Some("error")) => false,
        _ => {
            return Err(err(&path.key("outcome"), "expected \"ok\" or \"error\""));
        }
    };
    let output = match t.get("output") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    let kind = match t.get("kind") {
        None => crate::ToolKind::of(&name),
        Some(k) => k.as_str().and_then(crate::ToolKind::parse).ok_or_else(|| {
            err(
                &path.key("kind"),
                "expected \"read\", \"edit\", \"execute\" or \"other\"",
            )
        })?,
    };
    Ok(ToolStep {
        name,
        kind,
        input: t.get("input").cloned().unwrap_or(Value::Object(Map::new())),
        ok,
        output,
    })
}

fn check_keys(
    obj: &Map<String, Value>,
    path: &At<'_>,
    allowed: &[&str],
) -> Result<(), ScriptError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(err(path, format!("unknown field `{k}`"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A script read straight into its plain steps is the script read
        /// through a `Value`, and anything else is read through one: steps
        /// plain, of other kinds, malformed, in any order; the `script`
        /// member absent, `null`, given twice, among others; text after it.
        #[test]
        fn a_plain_script_reads_as_through_a_value(
            steps in proptest::collection::vec(
                proptest::prop_oneof![
                    // Plain steps, most of the time: whole plain scripts.
                    6 => proptest::sample::select(&[
                        r#"{"say": "one "}"#, r#"{"say": "a \"quoted\" \u00e9"}"#,
                        r#"{"think": "t"}"#, r#"{"title": "t"}"#, r#"{"sleep_ms": 5}"#,
                    ][..]),
                    1 => proptest::sample::select(&[
                        r#"{"say": 1}"#, r#"{"sleep_ms": -1}"#, r#"{"sleep_ms": 1.5}"#,
                        r#"{"say": "a", "think": "b"}"#, "{}", r#"{"dance": 1}"#,
                        r#"{"result": "max_tokens"}"#, r#"{"idle": true}"#, r#"{"say": null}"#,
                        r#"{"usage": {"input": 1, "output": 2}}"#, "[]", "3",
                    ][..]),
                ],
                0..6,
            ),
            shape in 0..8u8,
            other in proptest::sample::select(&[
                r#""x""#, "[1]", "1e400", r#""\ud800""#, "deep",
            ][..]),
        ) {
            let list = format!("[{}]", steps.join(", "));
            let other = match other {
                "deep" => format!("{}{}", "[".repeat(130), "]".repeat(130)),
                o => o.to_owned(),
            };
            let text = match shape {
                0 => format!(r#"{{"script": {list}}}"#),
                1 => format!(r#"  {{"note": {other}, "script": {list}}} and after"#),
                7 => format!(r#"{{"script": {list}, "more": {other}}}"#),
                2 => format!(r#"{{"script": {list}, "script": [{{"say": "b"}}]}}"#),
                3 => r#"{"script": null}"#.to_owned(),
                4 => format!(r#"{{"scripts": {list}}}"#),
                5 => format!(r#"{{"script": {list}"#),
                _ => format!(r#"{{"script": [{list}]}}"#),
            };
            let trimmed = text.trim_start();
            proptest::prop_assert_eq!(
                Script::from_prompt(&text),
                Script::from_value_text(trimmed),
                "{}",
                text
            );
        }
    }

    #[test]
    fn non_scripts_are_demo_prompts() {
        for text in ["hello", "{not json", "{\"a\": 1}", "[1,2]"] {
            assert_eq!(Script::from_prompt(text), Ok(None), "{text}");
        }
    }

    #[test]
    fn every_step_parses() {
        let text = r#"{"script": [
            {"say": "a"}, {"think": "b"},
            {"tool": {"name": "read", "input": {"p": 1}, "outcome": "error", "output": "nope"}},
            {"tools": [{"name": "x"}, {"name": "y", "output": {"k": 2}}]},
            {"sleep_ms": 5}, {"await_steer": 10}, {"consume_steer": true}, {"drop_steer": true},
            {"stale": {"idle": true}}, {"repeat": {"times": 2, "steps": [{"say": "r"}]}},
            {"result": "max_tokens"}, {"idle": true}, {"fail": "boom"}, {"hang": true},
            {"crash": "bug"}, {"title": "t"}, {"usage": {"input": 3, "output": 4}}
        ]}"#;
        let s = Script::from_prompt(text).unwrap().unwrap();
        assert_eq!(s.steps.len(), 17);
        assert_eq!(s.steps[14], Step::Crash("bug".into()));
        assert_eq!(s.steps[15], Step::Title("t".into()));
        assert_eq!(s.steps[16], Step::Usage(3, 4));
        assert_eq!(
            s.steps[2],
            Step::Tools(vec![ToolStep {
                name: "read".into(),
                kind: crate::ToolKind::Other,
                input: serde_json::json!({"p": 1}),
                ok: false,
                output: "nope".into()
            }])
        );
        assert_eq!(s.steps[8], Step::Stale(Box::new(Step::Idle)));
        assert_eq!(s.steps[10], Step::Result(StopReason::MaxTokens));
    }

    #[test]
    fn text_after_the_script_is_ignored() {
        let s =
            Script::from_prompt("{\"script\": [{\"say\": \"a\"}]}\n\nNote: the last turn looped.")
                .unwrap()
                .unwrap();
        assert_eq!(s.steps[0], Step::Say("a".into()));
    }

    #[test]
    fn result_and_idle_are_appended_when_missing() {
        let s = Script::from_prompt(r#"{"script": [{"say": "hi"}]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            s.steps,
            vec![
                Step::Say("hi".into()),
                Step::Result(StopReason::EndTurn),
                Step::Idle
            ]
        );
    }

    #[test]
    fn bad_steps_are_named() {
        let cases = [
            (r#"{"script": 3}"#, "script"),
            (r#"{"script": [{"say": "a"}, {"dance": 1}]}"#, "script[1]"),
            (r#"{"script": [{"say": 1}]}"#, "script[0].say"),
            (r#"{"script": [{"result": "done"}]}"#, "script[0].result"),
            (r#"{"script": [{"tool": {"input": {}}}]}"#, "script[0].tool"),
            (
                r#"{"script": [{"tools": [{"name": "a", "outcome": "maybe"}]}]}"#,
                "script[0].tools[0].outcome",
            ),
            (r#"{"script": [{"sleep_ms": -1}]}"#, "script[0].sleep_ms"),
            (r#"{"script": [{"title": 7}]}"#, "script[0].title"),
            (
                r#"{"script": [{"usage": {"input": 1}}]}"#,
                "script[0].usage.output",
            ),
            (r#"{"script": [{"say": "a", "think": "b"}]}"#, "script[0]"),
            (
                r#"{"script": [{"stale": {"sleep_ms": 1}}]}"#,
                "script[0].stale",
            ),
            (
                r#"{"script": [{"plan": [{"content": "a", "status": "done"}]}]}"#,
                "script[0].plan[0].status",
            ),
            (
                r#"{"script": [{"plan": [{"status": "pending"}]}]}"#,
                "script[0].plan[0]",
            ),
            (
                r#"{"script": [{"repeat": {"times": 2, "steps": [{"x": 1}]}}]}"#,
                "script[0].repeat.steps[0]",
            ),
        ];
        for (text, path) in cases {
            let e = Script::from_prompt(text).unwrap_err();
            assert_eq!(e.path, path, "{text}: {e}");
        }
    }
}
