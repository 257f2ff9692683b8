//! A session's model conversation, provider-neutral. The session owns it
//! (and stores it after each turn); a model engine's turn appends to it.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::ToolSpec;

/// A tool call as the model made it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    pub id: String,
    pub name: String,
    pub input: serde_json::Value,
}

/// One message of the conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    /// A prompt or a steer.
    User { text: String },
    /// A model reply: its text and the tools it called.
    Assistant {
        text: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        calls: Vec<CallRecord>,
    },
    /// The result of one call.
    ToolResult {
        id: String,
        ok: bool,
        output: String,
    },
    /// An image the user attached to the prompt before it (base64).
    Image(Image),
    /// The provider's own reasoning blocks of the model reply that follows
    /// (Anthropic extended thinking, with their signatures), sent back
    /// with it as the API requires.
    Reasoning { blocks: Vec<serde_json::Value> },
}

/// An image in a prompt: its MIME type and its bytes, base64.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Image {
    pub mime_type: String,
    pub data: String,
}

/// The conversation a session shares with its running turn. One turn runs
/// at a time, so the lock is never contended for long.
#[derive(Clone, Debug, Default)]
pub struct Conversation(Arc<Mutex<Inner>>);

/// `Inner::dirty` when nothing changed.
const CLEAN: u64 = u64::MAX;
/// `Inner::saved_base` before the first save.
const NEVER: u64 = u64::MAX;

#[derive(Debug)]
struct Inner {
    msgs: Vec<Message>,
    /// The position of `msgs[0]` in the session's whole conversation
    /// (trimming drops the oldest messages; positions never move).
    base: u64,
    /// The lowest position changed since the owner last took the changes
    /// ([`CLEAN`]: none).
    dirty: u64,
    /// `base` when the owner last took the changes ([`NEVER`]: never).
    saved_base: u64,
}

/// What changed since the owner last stored the conversation: stored
/// messages before `keep_from` are dropped (trimmed), those from
/// `replace_from` on are replaced by `messages`. A turn only appends, so a
/// save writes only what the turn added.
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationChange {
    /// The position of the oldest message kept.
    pub keep_from: u64,
    /// The position of `messages[0]`.
    pub replace_from: u64,
    /// The messages from `replace_from` on.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// A conversation holding `messages` (none stored yet).
    pub fn new(messages: Vec<Message>) -> Self {
        let dirty = if messages.is_empty() { CLEAN } else { 0 };
        Self(Arc::new(Mutex::new(Inner {
            msgs: messages,
            base: 0,
            dirty,
            saved_base: NEVER,
        })))
    }

    /// The conversation as stored: `messages` from position `base` on.
    pub fn restore(base: u64, messages: Vec<Message>) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            msgs: messages,
            base,
            dirty: CLEAN,
            saved_base: base,
        })))
    }

    /// Appends a message.
    pub fn push(&self, m: Message) {
        let mut inner = self.lock();
        let at = inner.base + inner.msgs.len() as u64;
        inner.mark(at);
        inner.msgs.push(m);
    }

    /// A copy of the messages.
    pub fn snapshot(&self) -> Vec<Message> {
        self.lock().msgs.clone()
    }

    /// Whether everything is stored (nothing for [`Conversation::take_changes`]).
    pub fn is_saved(&self) -> bool {
        let inner = self.lock();
        inner.dirty == CLEAN && inner.saved_base == inner.base
    }

    /// What changed since the last call (`None`: nothing). The owner
    /// stores it; if that fails it hands it back with
    /// [`Conversation::unsaved`].
    pub fn take_changes(&self) -> Option<ConversationChange> {
        let mut inner = self.lock();
        let trimmed = inner.saved_base != inner.base;
        if inner.dirty == CLEAN && !trimmed {
            return None;
        }
        let end = inner.base + inner.msgs.len() as u64;
        let replace_from = inner.dirty.min(end).max(inner.base);
        let messages = inner.msgs[(replace_from - inner.base) as usize..].to_vec();
        inner.dirty = CLEAN;
        inner.saved_base = inner.base;
        Some(ConversationChange {
            keep_from: inner.base,
            replace_from,
            messages,
        })
    }

    /// A change that could not be stored: it is taken again next time.
    pub fn unsaved(&self, change: &ConversationChange) {
        let mut inner = self.lock();
        inner.mark(change.replace_from);
        inner.saved_base = NEVER;
    }

    /// Makes the conversation valid for a provider after a turn ended
    /// abruptly: every call gets a result (a call without one is answered
    /// "did not run"), so no request is refused for a dangling tool call.
    pub fn repair(&self) {
        let mut inner = self.lock();
        let msgs = std::mem::take(&mut inner.msgs);
        let mut out = Vec::with_capacity(msgs.len());
        let mut open: Vec<String> = Vec::new();
        let mut first_insert = None;
        let mut close_at = |open: &mut Vec<String>, out: &mut Vec<Message>| {
            if !open.is_empty() && first_insert.is_none() {
                first_insert = Some(out.len());
            }
            close(open, out);
        };
        for m in msgs {
            match &m {
                Message::ToolResult { id, .. } => open.retain(|o| o != id),
                _ => {
                    close_at(&mut open, &mut out);
                    if let Message::Assistant { calls, .. } = &m {
                        open = calls.iter().map(|c| c.id.clone()).collect();
                    }
                }
            }
            out.push(m);
        }
        close_at(&mut open, &mut out);
        inner.msgs = out;
        if let Some(i) = first_insert {
            let at = inner.base + i as u64;
            inner.mark(at);
        }
    }

    /// Forgets every message (`/clear`): the next turn starts afresh.
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.base += inner.msgs.len() as u64;
        inner.msgs.clear();
    }

    /// Replaces the first `upto` messages with one user message holding
    /// `summary` (compaction). Later messages keep their positions; the
    /// stored copy is rewritten from the summary on. False (and nothing
    /// changed) when there is nothing to replace.
    pub fn compact(&self, upto: usize, summary: String) -> bool {
        let mut inner = self.lock();
        if upto == 0 || upto > inner.msgs.len() {
            return false;
        }
        inner.msgs.drain(..upto - 1);
        inner.msgs[0] = Message::User { text: summary };
        inner.base += (upto - 1) as u64;
        let at = inner.base;
        inner.mark(at);
        true
    }

    /// The conversation's size in chars (what [`window`] counts).
    pub fn chars(&self) -> usize {
        self.lock().msgs.iter().map(size).sum()
    }

    /// How many messages it holds.
    pub fn len(&self) -> usize {
        self.lock().msgs.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the oldest turns while the conversation holds more than
    /// `max_chars` (it keeps at least the last user turn). Memory and the
    /// stored copy stay bounded in a session that lives for months.
    pub fn trim(&self, max_chars: usize) {
        let mut inner = self.lock();
        let cut = cut_for(&inner.msgs, max_chars);
        if cut > 0 {
            inner.msgs.drain(..cut);
            inner.base += cut as u64;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A turn that panicked mid-push leaves a usable vector.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            msgs: Vec::new(),
            base: 0,
            dirty: CLEAN,
            saved_base: NEVER,
        }
    }
}

impl Inner {
    fn mark(&mut self, at: u64) {
        self.dirty = self.dirty.min(at);
    }
}

/// The text a message carries, in chars (what a context window holds).
fn size(m: &Message) -> usize {
    match m {
        Message::User { text } => text.len(),
        Message::Assistant { text, calls } => {
            text.len()
                + calls
                    .iter()
                    .map(|c| c.name.len() + c.input.to_string().len())
                    .sum::<usize>()
        }
        Message::ToolResult { output, .. } => output.len(),
        Message::Image(i) => i.data.len(),
        Message::Reasoning { blocks } => blocks.iter().map(|b| b.to_string().len()).sum(),
    }
}

/// Where a suffix that fits `max_chars` starts: always at a user message
/// (so every tool result keeps its call), as early as fits; the last user
/// message when even that turn alone is larger.
fn cut_for(msgs: &[Message], max_chars: usize) -> usize {
    let mut total = 0;
    let mut cut = None;
    for (i, m) in msgs.iter().enumerate().rev() {
        total += size(m);
        if matches!(m, Message::User { .. }) {
            if total <= max_chars || cut.is_none() {
                cut = Some(i);
            } else {
                break;
            }
        }
    }
    cut.unwrap_or(0)
}

/// The note that stands for turns left out of a request.
pub const OMITTED: &str =
    "(Earlier messages of this session were left out to fit the model's context window.)";

/// The messages to send: the newest turns that fit `max_chars`, after a
/// note when older ones were left out.
pub fn window(msgs: &[Message], max_chars: usize) -> Vec<Message> {
    let cut = cut_for(msgs, max_chars);
    let mut out = Vec::with_capacity(msgs.len() - cut + 1);
    if cut > 0 {
        out.push(Message::User {
            text: OMITTED.into(),
        });
    }
    out.extend_from_slice(&msgs[cut..]);
    out
}

fn close(open: &mut Vec<String>, out: &mut Vec<Message>) {
    for id in open.drain(..) {
        out.push(Message::ToolResult {
            id,
            ok: false,
            output: "The turn ended before this call returned; it did not complete.".into(),
        });
    }
}

/// What a turn needs besides its prompt.
#[derive(Clone, Debug, Default)]
pub struct TurnContext {
    /// The session's conversation (the turn appends to it).
    pub conversation: Conversation,
    /// The tools the model may call.
    pub tools: Arc<Vec<ToolSpec>>,
    /// The model the session chose, if not the engine's default.
    pub model: Option<String>,
    /// The session's switches (`session/set_config_option`), by id; an
    /// engine reads the ones it offers ([`crate::Engine::switches`]).
    pub switches: Vec<(String, bool)>,
    /// How far the session is behind the engine's signals: engines wait
    /// on it, so a fast engine never floods the session's mailbox (and a
    /// cancel never waits behind a backlog).
    pub pace: Arc<crate::Pace>,
    /// The session the turn belongs to: its directories (a model engine
    /// describes them to the model) and what an agent host needs.
    pub host: HostInfo,
}

/// What an engine hosting an agent needs to know of its session.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostInfo {
    /// Tiller's session id.
    pub session: String,
    /// The session's working directory.
    pub cwd: std::path::PathBuf,
    /// Its additional roots.
    pub roots: Vec<std::path::PathBuf>,
    /// The agent's session id from an earlier turn, if any.
    pub upstream: Option<String>,
    /// The values the session chose for the agent's own options (set on
    /// the agent before the prompt when it has others).
    pub agent_options: Vec<(String, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_kind_is_stored_and_read_back() {
        let all = vec![
            Message::User { text: "u".into() },
            Message::Image(Image {
                mime_type: "image/png".into(),
                data: "AAAA".into(),
            }),
            Message::Reasoning {
                blocks: vec![
                    serde_json::json!({"type": "thinking", "thinking": "t", "signature": "s"}),
                ],
            },
            Message::Assistant {
                text: "a".into(),
                calls: Vec::new(),
            },
            Message::ToolResult {
                id: "c".into(),
                ok: true,
                output: "o".into(),
            },
        ];
        for m in all {
            let stored = serde_json::to_string(&m).expect("stored");
            let back: Message = serde_json::from_str(&stored).expect("read back");
            assert_eq!(back, m, "{stored}");
        }
    }

    fn call(id: &str) -> CallRecord {
        CallRecord {
            id: id.into(),
            name: "read_file".into(),
            input: serde_json::json!({}),
        }
    }

    #[test]
    fn repair_answers_dangling_calls_in_place() {
        let c = Conversation::new(vec![
            Message::User { text: "go".into() },
            Message::Assistant {
                text: String::new(),
                calls: vec![call("a"), call("b")],
            },
            Message::ToolResult {
                id: "a".into(),
                ok: true,
                output: "x".into(),
            },
            Message::User {
                text: "next".into(),
            },
            Message::Assistant {
                text: String::new(),
                calls: vec![call("c")],
            },
        ]);
        c.repair();
        let ids: Vec<String> = c
            .snapshot()
            .into_iter()
            .map(|m| match m {
                Message::User { text } => format!("u:{text}"),
                Message::Assistant { calls, .. } => format!("a:{}", calls.len()),
                Message::ToolResult { id, ok, .. } => format!("r:{id}:{ok}"),
                Message::Image(_) => "image".into(),
                Message::Reasoning { .. } => "reasoning".into(),
            })
            .collect();
        assert_eq!(
            ids,
            [
                "u:go",
                "a:2",
                "r:a:true",
                "r:b:false",
                "u:next",
                "a:1",
                "r:c:false"
            ]
        );
        // Idempotent.
        let before = c.snapshot();
        c.repair();
        assert_eq!(c.snapshot(), before);
    }

    fn arb_conversation() -> impl proptest::strategy::Strategy<Value = Vec<Message>> {
        use proptest::prelude::*;
        // Turns: a user message, then rounds of calls and their results.
        let turn = (
            "[a-z]{0,30}",
            proptest::collection::vec(("[a-z]{0,20}", 0usize..3, "[a-z]{0,40}"), 0..3),
        );
        proptest::collection::vec(turn, 0..8).prop_map(|turns| {
            let mut out = Vec::new();
            let mut n = 0;
            for (prompt, rounds) in turns {
                out.push(Message::User { text: prompt });
                for (text, k, result) in rounds {
                    let calls: Vec<CallRecord> = (0..k)
                        .map(|_| {
                            n += 1;
                            call(&format!("c{n}"))
                        })
                        .collect();
                    let ids: Vec<String> = calls.iter().map(|c| c.id.clone()).collect();
                    out.push(Message::Assistant { text, calls });
                    for id in ids {
                        out.push(Message::ToolResult {
                            id,
                            ok: true,
                            output: result.clone(),
                        });
                    }
                }
            }
            out
        })
    }

    proptest::proptest! {
        #[test]
        fn the_window_is_a_fitting_suffix_that_keeps_calls_with_results(
            msgs in arb_conversation(),
            max in 0usize..400,
        ) {
            let w = window(&msgs, max);
            let omitted = w.first() == Some(&Message::User { text: OMITTED.into() });
            let kept = if omitted { &w[1..] } else { &w[..] };
            // A suffix of the conversation.
            proptest::prop_assert!(msgs.ends_with(kept));
            proptest::prop_assert_eq!(omitted, kept.len() < msgs.len());
            // It starts at a user message (when there is one).
            if msgs.iter().any(|m| matches!(m, Message::User { .. })) {
                let starts_with_user = matches!(kept.first(), Some(Message::User { .. }));
                proptest::prop_assert!(starts_with_user);
            }
            // Every result's call is in it.
            let ids: Vec<&str> = kept.iter().flat_map(|m| match m {
                Message::Assistant { calls, .. } => calls.iter().map(|c| c.id.as_str()).collect(),
                _ => Vec::new(),
            }).collect();
            for m in kept {
                if let Message::ToolResult { id, .. } = m {
                    proptest::prop_assert!(ids.contains(&id.as_str()));
                }
            }
            // It fits, unless the last user turn alone does not.
            let total: usize = kept.iter().map(size).sum();
            let last_user = msgs.iter().rposition(|m| matches!(m, Message::User { .. }));
            let last_turn: usize = last_user.map_or(0, |i| msgs[i..].iter().map(size).sum());
            proptest::prop_assert!(total <= max || kept.len() == msgs.len() - last_user.unwrap_or(0) && total == last_turn);
            // Trimming keeps the same suffix.
            let c = Conversation::new(msgs.clone());
            c.trim(max);
            proptest::prop_assert_eq!(c.snapshot(), kept.to_vec());
        }
    }

    use proptest::strategy::Strategy as _;

    /// What a store does with a change: rows by position.
    fn apply(rows: &mut std::collections::BTreeMap<u64, Message>, c: &ConversationChange) {
        rows.retain(|&i, _| i >= c.keep_from && i < c.replace_from);
        for (k, m) in c.messages.iter().enumerate() {
            rows.insert(c.replace_from + k as u64, m.clone());
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Push(bool),
        Repair,
        Trim(usize),
        Compact(usize),
        Save,
        SaveFails,
    }

    proptest::proptest! {
        /// Stored change by change (some saves failing), the rows always
        /// rebuild the conversation; a save writes only what changed.
        #[test]
        fn stored_changes_rebuild_the_conversation(
            start in arb_conversation(),
            ops in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just(Op::Push(false)),
                proptest::strategy::Just(Op::Push(true)),
                proptest::strategy::Just(Op::Repair),
                (0usize..200).prop_map(Op::Trim),
                (0usize..10).prop_map(Op::Compact),
                proptest::strategy::Just(Op::Save),
                proptest::strategy::Just(Op::SaveFails),
            ], 0..30),
        ) {
            let c = Conversation::new(start);
            let mut rows = std::collections::BTreeMap::new();
            let mut n = 0;
            for op in ops {
                match op {
                    Op::Push(user) => {
                        n += 1;
                        c.push(if user {
                            Message::User { text: format!("u{n}") }
                        } else {
                            Message::Assistant { text: String::new(), calls: vec![call(&format!("p{n}"))] }
                        });
                    }
                    Op::Repair => c.repair(),
                    Op::Trim(max) => c.trim(max),
                    Op::Compact(upto) => {
                        let before = c.snapshot();
                        let done = c.compact(upto, format!("summary {n}"));
                        let after = c.snapshot();
                        proptest::prop_assert_eq!(done, upto > 0 && upto <= before.len());
                        if done {
                            // The summary stands for what it replaced; the
                            // rest is untouched.
                            proptest::prop_assert_eq!(&after[0], &Message::User { text: format!("summary {n}") });
                            proptest::prop_assert_eq!(&after[1..], &before[upto..]);
                        } else {
                            proptest::prop_assert_eq!(after, before);
                        }
                    }
                    Op::Save => {
                        let len = c.snapshot().len();
                        if let Some(ch) = c.take_changes() {
                            proptest::prop_assert!(ch.messages.len() <= len);
                            apply(&mut rows, &ch);
                        }
                        proptest::prop_assert!(c.take_changes().is_none(), "nothing new");
                    }
                    Op::SaveFails => {
                        if let Some(ch) = c.take_changes() {
                            c.unsaved(&ch);
                        }
                    }
                }
            }
            if let Some(ch) = c.take_changes() {
                apply(&mut rows, &ch);
            }
            let stored: Vec<Message> = rows.values().cloned().collect();
            proptest::prop_assert_eq!(stored, c.snapshot());
            let base = c.lock().base;
            proptest::prop_assert_eq!(rows.keys().next().copied().unwrap_or(base), base);
        }
    }

    #[test]
    fn a_turn_saves_only_what_it_appended() {
        let c = Conversation::restore(40, vec![Message::User { text: "a".into() }]);
        assert_eq!(c.take_changes(), None, "restored as stored");
        c.push(Message::User { text: "b".into() });
        assert_eq!(
            c.take_changes(),
            Some(ConversationChange {
                keep_from: 40,
                replace_from: 41,
                messages: vec![Message::User { text: "b".into() }],
            })
        );
        c.trim(1);
        let ch = c.take_changes().unwrap();
        assert_eq!((ch.keep_from, ch.messages.len()), (41, 0));
    }

    #[test]
    fn messages_round_trip_as_json() {
        let m = vec![
            Message::User { text: "hi".into() },
            Message::Assistant {
                text: "t".into(),
                calls: vec![call("x")],
            },
            Message::ToolResult {
                id: "x".into(),
                ok: false,
                output: "no".into(),
            },
        ];
        let s = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<Vec<Message>>(&s).unwrap(), m);
    }
}
