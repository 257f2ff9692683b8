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
}

/// The conversation a session shares with its running turn. One turn runs
/// at a time, so the lock is never contended for long.
#[derive(Clone, Debug, Default)]
pub struct Conversation(Arc<Mutex<Vec<Message>>>);

impl Conversation {
    /// A conversation holding `messages`.
    pub fn new(messages: Vec<Message>) -> Self {
        Self(Arc::new(Mutex::new(messages)))
    }

    /// Appends a message.
    pub fn push(&self, m: Message) {
        self.lock().push(m);
    }

    /// A copy of the messages.
    pub fn snapshot(&self) -> Vec<Message> {
        self.lock().clone()
    }

    /// How many messages it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Makes the conversation valid for a provider after a turn ended
    /// abruptly: every call gets a result (a call without one is answered
    /// "did not run"), so no request is refused for a dangling tool call.
    pub fn repair(&self) {
        let mut msgs = self.lock();
        let mut out = Vec::with_capacity(msgs.len());
        let mut open: Vec<String> = Vec::new();
        for m in msgs.drain(..) {
            match &m {
                Message::ToolResult { id, .. } => open.retain(|o| o != id),
                _ => {
                    close(&mut open, &mut out);
                    if let Message::Assistant { calls, .. } = &m {
                        open = calls.iter().map(|c| c.id.clone()).collect();
                    }
                }
            }
            out.push(m);
        }
        close(&mut open, &mut out);
        *msgs = out;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Message>> {
        // A turn that panicked mid-push leaves a usable vector.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
