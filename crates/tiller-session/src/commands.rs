//! Tiller's slash commands: a prompt that starts with one of them is
//! handled by the daemon, whatever the client or the engine (ACP lists
//! them in `available_commands_update`). Any other `/word` is an ordinary
//! prompt (the engine may know it).

use crate::{SessionError, SessionHandle, Sessions};

/// One of Tiller's commands, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Forget the model conversation (the log keeps everything).
    Clear,
    /// Switch the session's model.
    Model(String),
    /// Switch the permission mode.
    Mode(String),
    /// Set a goal (`None`: show the current one).
    Goal(Option<String>),
    /// Cancel the running turn.
    Cancel,
}

/// The commands, as clients list them: name, description, and the hint
/// for its argument, if it takes one.
pub const COMMANDS: &[(&str, &str, Option<&str>)] = &[
    (
        "clear",
        "Forget the conversation so far (the history stays)",
        None,
    ),
    ("model", "Switch the model", Some("model name")),
    (
        "mode",
        "Switch the permission mode: ask, accept-edits or allow-all",
        Some("mode"),
    ),
    (
        "goal",
        "Work towards a goal in turns of their own while idle",
        Some("what to achieve"),
    ),
    ("cancel", "Cancel the running turn", None),
];

/// Commands listed for clients that the daemon does not run itself: the
/// prompt reaches the engine (a model engine compacts; a hosted agent
/// that knows `/compact` does its own).
pub const ENGINE_COMMANDS: &[(&str, &str, Option<&str>)] = &[(
    "compact",
    "Summarize the older turns to free the model's context (the history stays)",
    None,
)];

/// Most goal turns a `/goal` runs.
const GOAL_TURNS: u32 = 10;

/// The command a prompt is, if it is one of Tiller's: `Some(Err)` for one
/// of them used wrongly (the message says how).
pub fn parse(text: &str) -> Option<Result<Command, String>> {
    let rest = text.trim().strip_prefix('/')?;
    let (name, arg) = match rest.split_once(char::is_whitespace) {
        Some((n, a)) => (n, a.trim()),
        None => (rest, ""),
    };
    let needs = |what: &str| Err(format!("/{name} needs {what}, as in /{name} {what}"));
    Some(match name {
        "clear" if arg.is_empty() => Ok(Command::Clear),
        "cancel" if arg.is_empty() => Ok(Command::Cancel),
        "clear" | "cancel" => Err(format!("/{name} takes no argument")),
        "model" if arg.is_empty() => needs("a model name"),
        "model" => Ok(Command::Model(arg.to_owned())),
        "mode" if arg.is_empty() => needs("a mode"),
        "mode" => Ok(Command::Mode(arg.to_owned())),
        "goal" => Ok(Command::Goal((!arg.is_empty()).then(|| arg.to_owned()))),
        _ => return None,
    })
}

/// Why a command could not run: for the person who typed it.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Session(#[from] SessionError),
}

impl Sessions {
    /// Runs a command on a session; returns what to tell the person.
    pub async fn run_command(
        &self,
        handle: &SessionHandle,
        cmd: Command,
    ) -> Result<String, CommandError> {
        let set = |id: &'static str, value: String| async move {
            handle
                .set_option(id.into(), value.clone())
                .await?
                .map_err(CommandError::Refused)
                .map(|_| value)
        };
        Ok(match cmd {
            Command::Clear => {
                handle
                    .clear_conversation()
                    .await?
                    .map_err(CommandError::Refused)?;
                "The conversation is cleared; the next prompt starts afresh.".into()
            }
            Command::Model(m) => format!("Model: {}", set("model", m).await?),
            Command::Mode(m) => format!("Permission mode: {}", set("permission_mode", m).await?),
            Command::Goal(Some(objective)) => {
                let g = self.goal_set(handle.id(), objective, GOAL_TURNS).await?;
                format!(
                    "Goal set: {} (at most {} turns; /cancel stops the running one)",
                    g.objective, g.max_turns
                )
            }
            Command::Goal(None) => match self.goal_get(handle.id()).await? {
                Some(g) => format!(
                    "Goal: {} ({}, {} of {} turns)",
                    g.objective, g.status, g.turns_done, g.max_turns
                ),
                None => "No goal is set; /goal TEXT sets one.".into(),
            },
            Command::Cancel => {
                handle.cancel()?;
                "Cancelling the running turn.".into()
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let ok = |c| Some(Ok(c));
        for (text, want) in [
            ("/clear", ok(Command::Clear)),
            ("  /cancel  ", ok(Command::Cancel)),
            ("/model gpt-x", ok(Command::Model("gpt-x".into()))),
            ("/mode   allow-all ", ok(Command::Mode("allow-all".into()))),
            ("/goal ship it", ok(Command::Goal(Some("ship it".into())))),
            ("/goal", ok(Command::Goal(None))),
            ("/compactify", None),
            ("/review this", None),
            ("clear", None),
            ("please /clear", None),
            ("", None),
        ] {
            assert_eq!(parse(text), want, "{text:?}");
        }
        for bad in ["/model", "/mode", "/clear now", "/cancel it"] {
            assert!(matches!(parse(bad), Some(Err(_))), "{bad}");
        }
        for (name, _, _) in COMMANDS {
            assert!(parse(&format!("/{name} x")).is_some(), "{name} parses");
        }
        for (name, _, _) in ENGINE_COMMANDS {
            assert_eq!(
                parse(&format!("/{name}")),
                None,
                "{name} reaches the engine"
            );
        }
    }
}
