//! How a run of one session's events is stored in one row (a segment).
//!
//! A session's log is a sequence of segments, each holding the events one
//! commit wrote for it (at most [`MAX_EVENTS`] events, about
//! [`MAX_BYTES`] of payload), in order. One row per commit and session
//! instead of one per event: a streamed turn costs the store a row insert
//! per burst, not per chunk.
//!
//! The body is the events one after the other, each a header line of six
//! fields separated by single spaces, `seq ts_ms turn prompt kind len`
//! (`-` for no turn or prompt), a newline, then exactly `len` bytes of the
//! event's JSON payload. Nothing is escaped: the length says where the
//! payload ends.

use tiller_core::{PromptId, SessionId, TurnId};

use crate::StoredEvent;

/// Most events in one segment.
pub(crate) const MAX_EVENTS: usize = 64;
/// About the most payload bytes in one segment (a larger event gets a
/// segment of its own): a history page decodes little beyond its events.
pub(crate) const MAX_BYTES: usize = 3_000;

/// The bit a kind sets in a segment's `kinds` mask (FNV-1a, 63 bits: the
/// mask is a positive SQLite integer). Two kinds may share a bit; a
/// reader that filters by mask checks the kind of each event it decodes.
pub(crate) fn kind_bit(kind: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in kind.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    1 << (h % 63)
}

/// A segment ready to be inserted.
#[derive(Debug, PartialEq)]
pub(crate) struct Segment {
    pub(crate) first_seq: u64,
    pub(crate) last_seq: u64,
    pub(crate) last_ts_ms: i64,
    /// The highest turn id among its events, if any has one.
    pub(crate) max_turn: Option<u64>,
    pub(crate) kinds: i64,
    pub(crate) body: Vec<u8>,
}

impl Segment {
    fn new() -> Segment {
        Segment {
            first_seq: 0,
            last_seq: 0,
            last_ts_ms: 0,
            max_turn: None,
            kinds: 0,
            body: Vec::new(),
        }
    }

    fn push(&mut self, e: &StoredEvent) {
        if self.body.is_empty() {
            self.first_seq = e.seq;
        }
        self.last_seq = e.seq;
        self.last_ts_ms = e.ts_ms;
        if let Some(t) = e.turn {
            self.max_turn = Some(self.max_turn.map_or(t.0, |m| m.max(t.0)));
        }
        self.kinds |= kind_bit(&e.kind);
        let mut n = itoa::Buffer::new();
        let b = &mut self.body;
        b.reserve(e.data.len() + e.kind.len() + HEADER);
        b.extend_from_slice(n.format(e.seq).as_bytes());
        b.push(b' ');
        b.extend_from_slice(n.format(e.ts_ms).as_bytes());
        b.push(b' ');
        match e.turn {
            Some(t) => b.extend_from_slice(n.format(t.0).as_bytes()),
            None => b.push(b'-'),
        }
        b.push(b' ');
        match e.prompt {
            Some(p) => b.extend_from_slice(p.encode(&mut [0; 36]).as_bytes()),
            None => b.push(b'-'),
        }
        b.push(b' ');
        // Kinds are identifiers; one with a separator in it is never
        // written as one (it would garble the header).
        if e.kind.is_empty() || e.kind.contains([' ', '\n']) {
            b.extend_from_slice(e.kind.replace([' ', '\n'], "_").as_bytes());
            b.push(b'_');
        } else {
            b.extend_from_slice(e.kind.as_bytes());
        }
        b.push(b' ');
        b.extend_from_slice(n.format(e.data.len()).as_bytes());
        b.push(b'\n');
        b.extend_from_slice(e.data.as_bytes());
    }
}

/// Cuts a session's events (in order) into segments.
pub(crate) fn split<'a, I>(events: I) -> Vec<Segment>
where
    I: IntoIterator<Item = &'a StoredEvent>,
    I::IntoIter: Clone,
{
    let mut out = Vec::new();
    let mut cur = Segment::new();
    let mut n = 0;
    let mut events = events.into_iter();
    loop {
        let ahead = events.clone();
        let Some(e) = events.next() else { break };
        if n > 0 && (n == MAX_EVENTS || cur.body.len() + e.data.len() > MAX_BYTES) {
            out.push(std::mem::replace(&mut cur, Segment::new()));
            n = 0;
        }
        if n == 0 {
            cur.body.reserve_exact(room(ahead));
        }
        cur.push(e);
        n += 1;
    }
    if n > 0 {
        out.push(cur);
    }
    out
}

/// Room for the segment that starts with the first of `events`: what
/// [`Segment::push`] reserves for each event it can take, so its body is
/// allocated once. The events counted are those a body of the fewest
/// bytes per header would take (a segment cuts no later).
fn room<'a>(events: impl Iterator<Item = &'a StoredEvent>) -> usize {
    let (mut room, mut least) = (0, 0);
    for (i, e) in events.enumerate() {
        if i > 0 && (i == MAX_EVENTS || least + e.data.len() > MAX_BYTES) {
            break;
        }
        least += e.data.len() + e.kind.len() + HEADER_MIN;
        room += e.data.len() + e.kind.len() + HEADER;
    }
    room
}

/// Most bytes of an event's header besides its kind (three 20-digit
/// numbers, a 36-byte prompt id, a length, separators).
const HEADER: usize = 125;
/// Fewest bytes of an event's header besides its kind (`1 1 - - `, a
/// space, a one-digit length, the newline).
const HEADER_MIN: usize = 10;

/// Why a stored segment could not be read.
#[derive(Debug, thiserror::Error)]
#[error("a stored log segment is corrupt: {0}")]
pub(crate) struct Corrupt(&'static str);

/// The events of a stored segment, in order.
pub(crate) fn decode(session: SessionId, body: &[u8]) -> Result<Vec<StoredEvent>, Corrupt> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let nl = body[at..]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(Corrupt("a header without its end"))?;
        let header = std::str::from_utf8(&body[at..at + nl]).map_err(|_| Corrupt("header"))?;
        at += nl + 1;
        let mut f = header.split(' ');
        let mut next = || f.next().ok_or(Corrupt("a header field is missing"));
        let seq: u64 = next()?.parse().map_err(|_| Corrupt("seq"))?;
        let ts_ms: i64 = next()?.parse().map_err(|_| Corrupt("ts"))?;
        let turn = match next()? {
            "-" => None,
            t => Some(TurnId(t.parse().map_err(|_| Corrupt("turn"))?)),
        };
        let prompt = match next()? {
            "-" => None,
            p => Some(PromptId::parse(p).ok_or(Corrupt("prompt"))?),
        };
        let kind = next()?.to_owned();
        let len: usize = next()?.parse().map_err(|_| Corrupt("len"))?;
        let data = body
            .get(at..at + len)
            .ok_or(Corrupt("a payload cut short"))?;
        let data = std::str::from_utf8(data)
            .map_err(|_| Corrupt("payload"))?
            .to_owned();
        at += len;
        out.push(StoredEvent {
            session,
            seq,
            ts_ms,
            kind,
            prompt,
            turn,
            data,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event(seq: u64, kind: &str, data: String, turn: Option<u64>, prompt: bool) -> StoredEvent {
        StoredEvent {
            session: SessionId::new(),
            seq,
            ts_ms: seq as i64 * 7,
            kind: kind.into(),
            prompt: prompt.then(PromptId::new),
            turn: turn.map(TurnId),
            data,
        }
    }

    proptest! {
        /// Whatever the payloads (newlines, spaces, multi-byte text, empty),
        /// events read back exactly as written, in order, and segments are
        /// bounded.
        #[test]
        fn events_read_back_exactly(
            payloads in proptest::collection::vec((".{0,200}", any::<bool>(), proptest::option::of(0u64..50), 0usize..3), 1..200),
        ) {
            let session = SessionId::new();
            let kinds = ["agent_message_chunk", "turn_complete", "tool_call"];
            let events: Vec<StoredEvent> = payloads
                .into_iter()
                .enumerate()
                .map(|(i, (data, prompt, turn, k))| StoredEvent {
                    session,
                    ..event(i as u64 + 1, kinds[k], data, turn, prompt)
                })
                .collect();
            let segments = split(&events);
            let mut back = Vec::new();
            for s in &segments {
                // Allocated once: the room reserved up front was enough.
                let at = events.iter().position(|e| e.seq == s.first_seq).unwrap();
                prop_assert_eq!(s.body.capacity(), room(events[at..].iter()));
                let got = decode(session, &s.body).unwrap();
                prop_assert!(got.len() <= MAX_EVENTS);
                prop_assert_eq!(s.first_seq, got[0].seq);
                prop_assert_eq!(s.last_seq, got.last().unwrap().seq);
                prop_assert_eq!(s.max_turn, got.iter().filter_map(|e| e.turn.map(|t| t.0)).max());
                for e in &got {
                    prop_assert!(s.kinds & kind_bit(&e.kind) != 0);
                }
                back.extend(got);
            }
            prop_assert_eq!(back, events);
        }
    }

    #[test]
    fn a_large_event_gets_a_segment_of_its_own() {
        let events = [
            event(1, "a", "x".repeat(10), None, false),
            event(2, "b", "y".repeat(MAX_BYTES * 2), None, false),
            event(3, "c", "z".repeat(10), None, false),
        ];
        let firsts: Vec<u64> = split(&events).iter().map(|s| s.first_seq).collect();
        assert_eq!(firsts, [1, 2, 3]);
    }

    #[test]
    fn a_cut_or_garbled_body_is_an_error_not_a_panic() {
        let events = [event(1, "a", "{\"t\":1}".into(), Some(3), true)];
        let body = &split(&events)[0].body;
        for cut in 0..body.len() {
            let r = decode(SessionId::new(), &body[..cut]);
            assert!(cut == 0 || r.is_err(), "{cut}");
        }
        assert!(decode(SessionId::new(), b"1 2 x - k 0\n").is_err());
    }
}
