//! The loop guard: decides, before each tool call starts, whether the turn
//! is looping. Created fresh for every turn and dropped at settle.
//!
//! Calls are identified by a [`CallKey`] (tool name and canonical
//! arguments); results by a hash of their outcome, so a repeated call whose
//! result changed since the last identical call (polling a task that makes
//! progress) does not count as a repeat.

use std::collections::HashMap;
use std::fmt;

/// The kinds of loop the guard detects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoopType {
    /// The same call (tool and arguments) several times in a row.
    ConsecutiveIdenticalToolCalls,
    /// Calls of one tool failing several times in a row.
    RepeatedToolFailure,
    /// More tool calls in one turn than the cap.
    TurnToolCallCap,
    /// The same sentence repeated in the model's text.
    ChantingIdenticalSentences,
    /// Two calls alternating (A, B, A, B...).
    AlternatingToolCallPattern,
}

impl LoopType {
    /// The snake_case name clients see as `loopType`.
    pub fn as_str(self) -> &'static str {
        match self {
            LoopType::ConsecutiveIdenticalToolCalls => "consecutive_identical_tool_calls",
            LoopType::RepeatedToolFailure => "repeated_tool_failure",
            LoopType::TurnToolCallCap => "turn_tool_call_cap",
            LoopType::ChantingIdenticalSentences => "chanting_identical_sentences",
            LoopType::AlternatingToolCallPattern => "alternating_tool_call_pattern",
        }
    }

    /// Parses [`LoopType::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// Every loop type.
    pub const ALL: [LoopType; 5] = [
        LoopType::ConsecutiveIdenticalToolCalls,
        LoopType::RepeatedToolFailure,
        LoopType::TurnToolCallCap,
        LoopType::ChantingIdenticalSentences,
        LoopType::AlternatingToolCallPattern,
    ];

    /// What happened, in plain English.
    pub fn describe(self) -> &'static str {
        match self {
            LoopType::ConsecutiveIdenticalToolCalls => {
                "the agent made the same tool call with the same result too many times in a row"
            }
            LoopType::RepeatedToolFailure => "a tool kept failing with the same error",
            LoopType::TurnToolCallCap => "the turn reached its safety limit of tool calls",
            LoopType::ChantingIdenticalSentences => "the agent kept repeating the same sentence",
            LoopType::AlternatingToolCallPattern => {
                "the agent alternated between the same tool calls without progress"
            }
        }
    }
}

impl fmt::Display for LoopType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One loop type's switch and threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Whether the rule is checked.
    pub enabled: bool,
    /// How many repetitions trip it.
    pub threshold: usize,
}

/// `[loop_protection]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoopConfig {
    /// Trips when the `threshold`-th consecutive identical call would start.
    pub consecutive_identical_tool_calls: Rule,
    /// Trips when a tool that failed `threshold` times in a row with the
    /// same error is called again.
    pub repeated_tool_failure: Rule,
    /// `threshold == 0`: the default rule (past 100 calls some call repeated
    /// 6+ times; hard stop at 1000). `threshold > 0`: a hard cap.
    pub turn_tool_call_cap: Rule,
    /// Trips when the same sentence appears `threshold` times in the turn.
    pub chanting_identical_sentences: Rule,
    /// Trips at `threshold` full A,B cycles with unchanged arguments.
    pub alternating_tool_call_pattern: Rule,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            consecutive_identical_tool_calls: Rule {
                enabled: true,
                threshold: 5,
            },
            repeated_tool_failure: Rule {
                enabled: true,
                threshold: 3,
            },
            turn_tool_call_cap: Rule {
                enabled: true,
                threshold: 0,
            },
            chanting_identical_sentences: Rule {
                enabled: false,
                threshold: 10,
            },
            alternating_tool_call_pattern: Rule {
                enabled: false,
                threshold: 3,
            },
        }
    }
}

/// Calls in the turn past which a repeated call trips the default cap.
const SOFT_CAP: usize = 100;
/// Repeats of one call that trip the default cap past [`SOFT_CAP`].
const SOFT_CAP_REPEATS: usize = 6;
/// The default hard stop.
const HARD_CAP: usize = 1000;
/// Shortest text that counts as a sentence for chanting.
const MIN_SENTENCE: usize = 8;

/// A tool call's identity: name and canonical arguments (the caller
/// canonicalizes, e.g. JSON with sorted keys).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    /// The tool's name.
    pub tool: String,
    /// Its arguments, canonical (object keys sorted).
    pub args: String,
}

/// How a call ended, reduced to what the guard compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallOutcome {
    /// Whether the call succeeded.
    pub ok: bool,
    /// A hash of the output (or error signature).
    pub signature: u64,
}

/// The per-turn loop state.
#[derive(Clone, Debug)]
pub struct LoopGuard {
    config: LoopConfig,
    /// Calls started this turn.
    total: usize,
    /// Starts per call key.
    per_key: HashMap<CallKey, usize>,
    /// The last call and the current run of counted repeats.
    last: Option<CallKey>,
    streak: usize,
    /// Results of the last two calls of the current run (newest first), to
    /// tell a repeat from progress.
    last_outcomes: (Option<CallOutcome>, Option<CallOutcome>),
    /// Per tool: consecutive failures with one signature.
    failures: HashMap<String, (u64, usize)>,
    /// The last calls, for the alternating pattern.
    recent: Vec<CallKey>,
    /// Sentence counts for chanting, and the unfinished tail of the text.
    sentences: HashMap<String, usize>,
    tail: String,
}

impl LoopGuard {
    /// A guard for one turn.
    pub fn new(config: LoopConfig) -> Self {
        Self {
            config,
            total: 0,
            per_key: HashMap::new(),
            last: None,
            streak: 0,
            last_outcomes: (None, None),
            failures: HashMap::new(),
            recent: Vec::new(),
            sentences: HashMap::new(),
            tail: String::new(),
        }
    }

    /// Decides whether `call` may start. On `Ok` the call is recorded as
    /// started; report its outcome with [`LoopGuard::finished`].
    pub fn check(&mut self, call: &CallKey) -> Result<(), LoopType> {
        let c = &self.config;
        // Would this call extend a run of identical calls?
        let same = self.last.as_ref() == Some(call);
        let progressed = match self.last_outcomes {
            (Some(a), Some(b)) => a != b,
            _ => false,
        };
        let streak = match (same, progressed) {
            (true, false) => self.streak + 1,
            (true, true) => 2, // progress since the last identical call
            (false, _) => 1,
        };
        if c.consecutive_identical_tool_calls.enabled
            && streak >= c.consecutive_identical_tool_calls.threshold
        {
            return Err(LoopType::ConsecutiveIdenticalToolCalls);
        }
        if c.repeated_tool_failure.enabled
            && let Some((_, n)) = self.failures.get(&call.tool)
            && *n >= c.repeated_tool_failure.threshold
        {
            return Err(LoopType::RepeatedToolFailure);
        }
        let total = self.total + 1;
        let repeats = self.per_key.get(call).copied().unwrap_or(0) + 1;
        if c.turn_tool_call_cap.enabled {
            let cap = c.turn_tool_call_cap.threshold;
            let tripped = if cap > 0 {
                total > cap
            } else {
                total > HARD_CAP
                    || (total > SOFT_CAP
                        && (repeats >= SOFT_CAP_REPEATS
                            || self.per_key.values().any(|n| *n >= SOFT_CAP_REPEATS)))
            };
            if tripped {
                return Err(LoopType::TurnToolCallCap);
            }
        }
        if c.alternating_tool_call_pattern.enabled {
            let window = 2 * c.alternating_tool_call_pattern.threshold;
            let n = self.recent.len();
            if window >= 4 && n + 1 >= window {
                let mut seq: Vec<&CallKey> = self.recent[n + 1 - window..].iter().collect();
                seq.push(call);
                let (a, b) = (seq[0], seq[1]);
                if a != b
                    && seq
                        .iter()
                        .enumerate()
                        .all(|(i, k)| *k == if i % 2 == 0 { a } else { b })
                {
                    return Err(LoopType::AlternatingToolCallPattern);
                }
            }
        }
        // Start it.
        if !same {
            self.last_outcomes = (None, None);
        }
        self.streak = streak;
        self.last = Some(call.clone());
        self.total = total;
        self.per_key.insert(call.clone(), repeats);
        self.recent.push(call.clone());
        if self.recent.len() > 64 {
            self.recent.drain(..32);
        }
        Ok(())
    }

    /// Records how a started call ended.
    pub fn finished(&mut self, call: &CallKey, outcome: CallOutcome) {
        if self.last.as_ref() == Some(call) {
            self.last_outcomes = (Some(outcome), self.last_outcomes.0);
        }
        if outcome.ok {
            self.failures.remove(&call.tool);
        } else {
            let entry = self
                .failures
                .entry(call.tool.clone())
                .or_insert((outcome.signature, 0));
            if entry.0 == outcome.signature {
                entry.1 += 1;
            } else {
                *entry = (outcome.signature, 1);
            }
        }
    }

    /// Feeds streamed agent text; trips on chanting.
    pub fn text(&mut self, chunk: &str) -> Result<(), LoopType> {
        let rule = self.config.chanting_identical_sentences;
        if !rule.enabled {
            return Ok(());
        }
        self.tail.push_str(chunk);
        while let Some(end) = self.tail.find(['.', '!', '?', '\n']) {
            let sentence: String = self.tail[..=end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .to_lowercase();
            self.tail.drain(..=end);
            if sentence.len() < MIN_SENTENCE {
                continue;
            }
            let n = self.sentences.entry(sentence).or_insert(0);
            *n += 1;
            if *n >= rule.threshold {
                return Err(LoopType::ChantingIdenticalSentences);
            }
        }
        // A run-on "sentence" longer than any reasonable one is cut here.
        if self.tail.len() > 4096 {
            self.tail.clear();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tool: &str, args: &str) -> CallKey {
        CallKey {
            tool: tool.into(),
            args: args.into(),
        }
    }

    fn ok(sig: u64) -> CallOutcome {
        CallOutcome {
            ok: true,
            signature: sig,
        }
    }

    fn err(sig: u64) -> CallOutcome {
        CallOutcome {
            ok: false,
            signature: sig,
        }
    }

    /// Runs calls `(tool, args, outcome)` and returns the index of the call
    /// that tripped, and how.
    fn run(config: LoopConfig, calls: &[(&str, &str, CallOutcome)]) -> Option<(usize, LoopType)> {
        let mut g = LoopGuard::new(config);
        for (i, (t, a, o)) in calls.iter().enumerate() {
            let k = key(t, a);
            if let Err(lt) = g.check(&k) {
                return Some((i, lt));
            }
            g.finished(&k, *o);
        }
        None
    }

    fn with(f: impl FnOnce(&mut LoopConfig)) -> LoopConfig {
        let mut c = LoopConfig::default();
        f(&mut c);
        c
    }

    #[test]
    fn table() {
        use LoopType::*;
        let same = |n: usize| vec![("read", "{\"p\":1}", ok(1)); n];
        let polling: Vec<_> = (0..20).map(|i| ("status", "{}", ok(i))).collect();
        let fails = |n: usize| vec![("build", "{}", err(7)); n];
        let mut mixed_fails = fails(2);
        mixed_fails.push(("build", "{}", err(8)));
        mixed_fails.extend(fails(2));
        let mut fails_then_ok = fails(3);
        fails_then_ok.insert(2, ("build", "{}", ok(0)));
        let distinct: Vec<_> = (0..1000)
            .map(|i| {
                (
                    "t",
                    Box::leak(format!("{i}").into_boxed_str()) as &str,
                    ok(1),
                )
            })
            .collect();
        // 100 calls, each of 20 pairs 5 times; the 101st is a 6th repeat.
        let mut over_soft: Vec<_> = (0..100)
            .map(|i| {
                (
                    "t",
                    Box::leak(format!("{}", i % 20).into_boxed_str()) as &str,
                    ok(1),
                )
            })
            .collect();
        over_soft.push(("t", "0", ok(1)));
        // 150 calls, no pair more than 5 times.
        let under_repeats: Vec<_> = (0..150)
            .map(|i| {
                (
                    "t",
                    Box::leak(format!("{}", i % 30).into_boxed_str()) as &str,
                    ok(1),
                )
            })
            .collect();
        let ab: Vec<_> = (0..6)
            .map(|i| {
                if i % 2 == 0 {
                    ("a", "{}", ok(1))
                } else {
                    ("b", "{}", ok(2))
                }
            })
            .collect();

        type Calls<'a> = Vec<(&'a str, &'a str, CallOutcome)>;
        type Case<'a> = (&'a str, LoopConfig, Calls<'a>, Option<(usize, LoopType)>);
        let cases: Vec<Case<'_>> = vec![
            (
                "four identical calls: near miss",
                LoopConfig::default(),
                same(4),
                None,
            ),
            (
                "the fifth identical call trips",
                LoopConfig::default(),
                same(6),
                Some((4, ConsecutiveIdenticalToolCalls)),
            ),
            (
                "threshold is configurable",
                with(|c| c.consecutive_identical_tool_calls.threshold = 3),
                same(3),
                Some((2, ConsecutiveIdenticalToolCalls)),
            ),
            (
                "disabled rule never trips",
                with(|c| c.consecutive_identical_tool_calls.enabled = false),
                same(50),
                None,
            ),
            (
                "polling with changing results: no trip",
                LoopConfig::default(),
                polling,
                None,
            ),
            (
                "three same failures, then the 4th call trips",
                LoopConfig::default(),
                fails(5),
                Some((3, RepeatedToolFailure)),
            ),
            (
                "a different error resets the failure count",
                LoopConfig::default(),
                mixed_fails,
                None,
            ),
            (
                "a success resets the failure count",
                LoopConfig::default(),
                fails_then_ok,
                None,
            ),
            (
                "1000 distinct calls: near miss",
                LoopConfig::default(),
                distinct.clone(),
                None,
            ),
            (
                "explicit cap is hard",
                with(|c| c.turn_tool_call_cap.threshold = 10),
                distinct[..12].to_vec(),
                Some((10, TurnToolCallCap)),
            ),
            (
                "past 100 calls a call repeated 6 times trips",
                LoopConfig::default(),
                over_soft,
                Some((100, TurnToolCallCap)),
            ),
            (
                "past 100 calls, no pair 6 times: near miss",
                LoopConfig::default(),
                under_repeats,
                None,
            ),
            (
                "alternating off by default",
                LoopConfig::default(),
                ab.clone(),
                None,
            ),
            (
                "alternating A,B x3 trips at the 6th",
                with(|c| c.alternating_tool_call_pattern.enabled = true),
                ab.clone(),
                Some((5, AlternatingToolCallPattern)),
            ),
            (
                "alternating A,B x2.5: near miss",
                with(|c| c.alternating_tool_call_pattern.enabled = true),
                ab[..5].to_vec(),
                None,
            ),
        ];
        for (name, config, calls, want) in cases {
            assert_eq!(run(config, &calls), want, "{name}");
        }
    }

    #[test]
    fn hard_stop_at_1000() {
        let mut g = LoopGuard::new(LoopConfig::default());
        for i in 0..1000 {
            let k = key("t", &i.to_string());
            g.check(&k).unwrap();
            g.finished(&k, ok(i));
        }
        assert_eq!(g.check(&key("t", "new")), Err(LoopType::TurnToolCallCap));
    }

    #[test]
    fn polling_that_stalls_trips_later() {
        // Progress for a while, then the same result over and over.
        let mut calls: Vec<_> = (0..3).map(|i| ("status", "{}", ok(i))).collect();
        calls.extend(vec![("status", "{}", ok(9)); 6]);
        let got = run(LoopConfig::default(), &calls);
        assert_eq!(
            got.map(|(_, t)| t),
            Some(LoopType::ConsecutiveIdenticalToolCalls)
        );
    }

    #[test]
    fn chanting() {
        let mut on = LoopGuard::new(with(|c| c.chanting_identical_sentences.enabled = true));
        for _ in 0..9 {
            on.text("I will now check the file. ").unwrap();
        }
        assert_eq!(
            on.text("I will now check the file."),
            Err(LoopType::ChantingIdenticalSentences)
        );
        let mut off = LoopGuard::new(LoopConfig::default());
        for _ in 0..20 {
            off.text("I will now check the file. ").unwrap();
        }
        let mut varied = LoopGuard::new(with(|c| c.chanting_identical_sentences.enabled = true));
        for i in 0..20 {
            varied.text(&format!("Step {i} is different. ")).unwrap();
        }
    }
}
