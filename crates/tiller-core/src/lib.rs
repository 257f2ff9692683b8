//! Pure cores of Tiller.
//!
//! Everything here is sans-IO: no tokio, no clock reads (time is an input),
//! no serialization formats, no SQL. Actors feed inputs to these cores and
//! carry out the effects they return. That is what lets the property tests
//! check "every admitted prompt gets exactly one terminal" over arbitrary
//! interleavings.

#![warn(missing_docs)]

pub mod backoff;
pub mod cron;
pub mod goal;
mod ids;
pub mod loop_guard;
pub mod metrics;
pub mod notify;
pub mod pipeline;
mod terminal;
pub mod turn;

pub use ids::{PromptId, RequestId, SessionId, SteerId, TurnId};
pub use loop_guard::{CallKey, CallOutcome, LoopConfig, LoopGuard, LoopType};
pub use terminal::{ErrorKind, Origin, StopReason, Terminal};
pub use turn::{
    Answer, Effect, EngineStop, IdleBehavior, Input, Millis, Rejection, SessionCore, Signal,
    SteerDropReason, SteerOutcome, SteerReceipt, SteerRefusal, Step, TurnConfig, WatchdogKind,
};
