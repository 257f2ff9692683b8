//! Origins and terminals: where a prompt came from and how it ended.

use std::fmt;

use crate::LoopType;

/// Where a prompt entered the daemon. Decided by the daemon from the ingress,
/// never from anything the caller wrote.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Origin {
    /// A person, through ACP or the Web Shell.
    Interactive,
    /// An authenticated channel ingress.
    Channel,
    /// A cron job fire.
    Cron,
    /// A background notification.
    Notification,
    /// A goal continuation.
    Goal,
}

impl Origin {
    /// Every origin, for metric labels registered at start-up.
    pub const ALL: [Origin; 5] = [
        Origin::Interactive,
        Origin::Channel,
        Origin::Cron,
        Origin::Notification,
        Origin::Goal,
    ];

    /// Stable lower-case name, used as a metric label and in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Interactive => "interactive",
            Origin::Channel => "channel",
            Origin::Cron => "cron",
            Origin::Notification => "notification",
            Origin::Goal => "goal",
        }
    }

    /// Parses [`Origin::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "interactive" => Origin::Interactive,
            "channel" => Origin::Channel,
            "cron" => Origin::Cron,
            "notification" => Origin::Notification,
            "goal" => Origin::Goal,
            _ => return None,
        })
    }
}

/// Why a completed turn stopped (the ACP stop reasons).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum StopReason {
    /// The model finished its answer.
    EndTurn,
    /// The model hit its output token limit.
    MaxTokens,
    /// The turn made as many model requests as it may.
    MaxTurnRequests,
    /// The model refused.
    Refusal,
    /// The turn was cancelled.
    Cancelled,
}

impl StopReason {
    /// Every stop reason.
    pub const ALL: [StopReason; 5] = [
        StopReason::EndTurn,
        StopReason::MaxTokens,
        StopReason::MaxTurnRequests,
        StopReason::Refusal,
        StopReason::Cancelled,
    ];

    /// The snake_case name ACP and the event log use.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::MaxTurnRequests => "max_turn_requests",
            StopReason::Refusal => "refusal",
            StopReason::Cancelled => "cancelled",
        }
    }

    /// Parses [`StopReason::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "end_turn" => StopReason::EndTurn,
            "max_tokens" => StopReason::MaxTokens,
            "max_turn_requests" => StopReason::MaxTurnRequests,
            "refusal" => StopReason::Refusal,
            "cancelled" => StopReason::Cancelled,
            _ => return None,
        })
    }
}

/// The machine-readable kind of a failed turn. Clients localize from this,
/// never from the English message.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ErrorKind {
    /// The engine said it was done without producing a result.
    NoResult,
    /// The model stream broke.
    ModelStreamInterrupted,
    /// The engine task died.
    EngineCrashed,
    /// No signal for `stall_timeout`.
    Stalled,
    /// The daemon died while the prompt was in flight.
    DaemonRestarted,
    /// The session actor failed and was restarted while the prompt was in flight.
    SessionRestarted,
    /// Loop protection stopped an interactive turn.
    LoopDetected(LoopType),
    /// The engine sent more content than one turn may (`limits.max_turn_events`).
    TurnTooLong,
    /// The store could not record the turn (disk full, database locked):
    /// the session stopped rather than report what was never stored.
    StoreUnavailable,
    /// The engine had no room for the turn (an agent engine at
    /// `max_processes`); retry later.
    Overloaded,
    /// The node serving the session died (or lost its lease) while the
    /// prompt was in flight; another node took the session over.
    NodeLost,
}

impl ErrorKind {
    /// One of each kind (a loop stop stands for every loop type: the
    /// `errorKind` is the same).
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::NoResult,
        ErrorKind::ModelStreamInterrupted,
        ErrorKind::EngineCrashed,
        ErrorKind::Stalled,
        ErrorKind::DaemonRestarted,
        ErrorKind::SessionRestarted,
        ErrorKind::LoopDetected(LoopType::TurnToolCallCap),
        ErrorKind::TurnTooLong,
        ErrorKind::StoreUnavailable,
        ErrorKind::Overloaded,
        ErrorKind::NodeLost,
    ];

    /// The snake_case `errorKind` clients see.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NoResult => "no_result",
            ErrorKind::ModelStreamInterrupted => "model_stream_interrupted",
            ErrorKind::EngineCrashed => "engine_crashed",
            ErrorKind::Stalled => "stalled",
            ErrorKind::DaemonRestarted => "daemon_restarted",
            ErrorKind::SessionRestarted => "session_restarted",
            ErrorKind::LoopDetected(_) => "loop_detected",
            ErrorKind::TurnTooLong => "turn_too_long",
            ErrorKind::StoreUnavailable => "store_unavailable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::NodeLost => "node_lost",
        }
    }

    /// The loop type, for `loop_detected`.
    pub fn loop_type(self) -> Option<LoopType> {
        match self {
            ErrorKind::LoopDetected(t) => Some(t),
            _ => None,
        }
    }

    /// A plain-English message older clients can show as is.
    pub fn default_message(self) -> String {
        let s = match self {
            ErrorKind::NoResult => "The agent stopped without producing a result.",
            ErrorKind::ModelStreamInterrupted => "The model stream was interrupted.",
            ErrorKind::EngineCrashed => "The engine crashed while running this turn.",
            ErrorKind::Stalled => "The turn made no progress and was stopped.",
            ErrorKind::DaemonRestarted => "The daemon restarted while this turn was running.",
            ErrorKind::SessionRestarted => "The session restarted while this turn was running.",
            ErrorKind::TurnTooLong => {
                "The engine produced more than one turn may hold, so the turn was stopped."
            }
            ErrorKind::StoreUnavailable => {
                "The daemon could not store this turn (the disk may be full), so it was stopped. \
                 Send the prompt again once storage is available."
            }
            ErrorKind::Overloaded => {
                "The engine is running as many agent processes as it may; send the prompt \
                 again in a moment."
            }
            ErrorKind::NodeLost => {
                "The server running this turn went away; another one took the session over. \
                 Nothing else was lost; send the prompt again."
            }
            ErrorKind::LoopDetected(t) => {
                return format!(
                    "Loop protection stopped this turn: {} ({t}). Only this turn stopped; \
                     the session is still available. Continue with a more specific instruction.",
                    t.describe()
                );
            }
        };
        s.to_owned()
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The one outcome of an admitted prompt.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Terminal {
    /// The turn completed; ACP answers `session/prompt` with this stop reason.
    Completed(StopReason),
    /// The turn failed; ACP answers with a JSON-RPC error carrying `kind`.
    Failed {
        /// What failed, as clients match on it.
        kind: ErrorKind,
        /// A readable account (never a secret).
        message: String,
    },
}

impl Terminal {
    /// A failure with the kind's default message.
    pub fn failed(kind: ErrorKind) -> Self {
        Terminal::Failed {
            kind,
            message: kind.default_message(),
        }
    }

    /// Label for the `outcome` metric label: a stop reason or an error kind.
    pub fn outcome_label(&self) -> &'static str {
        match self {
            Terminal::Completed(r) => r.as_str(),
            Terminal::Failed { kind, .. } => kind.as_str(),
        }
    }
}
