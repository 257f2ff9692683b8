//! Identifiers. Opaque, cheap to copy, and printable; how they are written on
//! the wire is the edges' business.

use std::fmt;

use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        impl $name {
            /// A fresh random id.
            pub fn new() -> Self {
                Self(Uuid::new_v4())
            }

            /// Parses the canonical hyphenated form written by `Display`.
            pub fn parse(s: &str) -> Option<Self> {
                Uuid::try_parse(s).ok().map(Self)
            }

            /// Writes the canonical hyphenated form (what `Display` writes)
            /// into `buf`, without the formatting machinery.
            pub fn encode<'b>(&self, buf: &'b mut [u8; 36]) -> &'b str {
                self.0.hyphenated().encode_lower(buf)
            }

            /// Builds an id from raw bits (tests and property models use this
            /// to get small, readable ids).
            pub const fn from_u128(v: u128) -> Self {
                Self(Uuid::from_u128(v))
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.hyphenated().fmt(f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0.hyphenated())
            }
        }
    };
}

uuid_id!(
    /// One session: a conversation with its own log, queue and turns.
    SessionId
);
uuid_id!(
    /// One admitted (or refused) request to run a turn.
    PromptId
);
uuid_id!(
    /// One steer: text injected into a running turn.
    SteerId
);
uuid_id!(
    /// One permission request: a tool call waiting for a person. The
    /// daemon assigns it, so two calls that share a model's call id never
    /// share a request (an answer meant for one cannot approve the other).
    RequestId
);

/// One run of a prompt by an engine. Monotonic per session, so a signal from
/// an older turn is recognised as stale by comparison alone.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct TurnId(pub u64);

impl fmt::Display for TurnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_written_in_its_canonical_form() {
        let id = SessionId::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(id.to_string(), "01234567-89ab-cdef-0011-223344556677");
        assert_eq!(SessionId::parse(&id.to_string()), Some(id));
        // The form written without the formatting machinery is the same.
        assert_eq!(id.encode(&mut [0; 36]), id.to_string());
    }
}
