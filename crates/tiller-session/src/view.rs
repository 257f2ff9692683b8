//! How every edge follows a session's log: one rule, one cursor.
//!
//! A viewer subscribes (the answer names the last event already
//! published), replays the stored events after its position up to that
//! one, then takes live events. Sequence numbers are contiguous, so a
//! live event is either already sent (skip), the next one (send), or past
//! a gap (the viewer fell behind and events were dropped for it: read the
//! gap from the store first). A viewer that cannot keep up therefore costs
//! the session nothing and misses nothing: it reads what it lacks from the
//! log, page by page. SSE streams and ACP connections both go through
//! [`Cursor`].

use tiller_core::SessionId;

use crate::{EventRecord, SessionError, Sessions};

/// What to do with a live event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// The viewer has it already (a replay or a catch-up covered it).
    Skip,
    /// The next one: send it.
    Send,
    /// Events between the last sent and this one are missing: read them
    /// from the log first ([`Cursor::page`]).
    CatchUp,
}

/// A viewer's position in a session's log: the last sequence number it
/// was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    session: SessionId,
    sent: u64,
}

impl Cursor {
    /// A viewer of `session` that has everything up to `sent`.
    pub fn at(session: SessionId, sent: u64) -> Self {
        Self { session, sent }
    }

    /// The last sequence number sent.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// What to do with live event `seq`.
    pub fn live(&self, seq: u64) -> Live {
        if seq <= self.sent {
            Live::Skip
        } else if seq == self.sent + 1 {
            Live::Send
        } else {
            Live::CatchUp
        }
    }

    /// Event `seq` was sent.
    pub fn advance(&mut self, seq: u64) {
        self.sent = self.sent.max(seq);
    }

    /// The next page of stored events after the cursor, up to `until`
    /// (inclusive; `None`: the end of the log), at most `limit`; the cursor
    /// moves past them. Empty when there is nothing more.
    pub async fn page(
        &mut self,
        sessions: &Sessions,
        until: Option<u64>,
        limit: usize,
    ) -> Result<Vec<EventRecord>, SessionError> {
        if until.is_some_and(|u| u <= self.sent) {
            return Ok(Vec::new());
        }
        let mut page = sessions
            .events_after(self.session, self.sent, limit)
            .await?;
        if let Some(u) = until {
            page.retain(|e| e.seq <= u);
        }
        if let Some(last) = page.last() {
            self.sent = last.seq;
        }
        Ok(page)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_event_is_skipped_sent_or_a_gap_to_read() {
        let mut c = Cursor::at(SessionId::from_u128(1), 5);
        assert_eq!(c.live(4), Live::Skip);
        assert_eq!(c.live(5), Live::Skip);
        assert_eq!(c.live(6), Live::Send);
        assert_eq!(c.live(8), Live::CatchUp);
        c.advance(8);
        assert_eq!(c.live(8), Live::Skip);
        c.advance(3);
        assert_eq!(c.sent(), 8, "never moves back");
    }
}
