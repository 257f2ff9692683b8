//! A bounded output buffer: what a tool hands back to a model is never
//! held in memory beyond a fixed size, however much the file, the command
//! or the server produced. What does not fit is counted, and the text
//! says so.

use std::collections::VecDeque;

/// Keeps a bounded part of a byte stream: either its first bytes
/// ([`OutputBuffer::head`]), or its first and last bytes
/// ([`OutputBuffer::head_and_tail`], for command output whose end, the
/// error, matters most). Every byte pushed is counted, so the marker in
/// [`OutputBuffer::finish`] says exactly how much was cut.
#[derive(Clone, Debug)]
pub struct OutputBuffer {
    /// The first bytes of the stream, at most `head_cap`.
    head: Vec<u8>,
    /// The last bytes of the stream after the head, at most `tail_cap`
    /// (always empty in head-only mode).
    tail: VecDeque<u8>,
    /// Most bytes kept from the start.
    head_cap: usize,
    /// Most bytes kept from the end (0 in head-only mode).
    tail_cap: usize,
    /// Every byte of the stream, pushed or only counted with
    /// [`OutputBuffer::skip`]: the size the marker reports.
    total: u64,
}

impl OutputBuffer {
    /// Keeps the first `max` bytes.
    pub fn head(max: usize) -> Self {
        Self {
            head: Vec::with_capacity(max.min(64 * 1024)),
            tail: VecDeque::new(),
            head_cap: max,
            tail_cap: 0,
            total: 0,
        }
    }

    /// Keeps the first `max - max / 2` and the last `max / 2` bytes.
    pub fn head_and_tail(max: usize) -> Self {
        let tail_cap = max / 2;
        Self {
            head: Vec::with_capacity((max - tail_cap).min(64 * 1024)),
            tail: VecDeque::with_capacity(tail_cap.min(64 * 1024)),
            head_cap: max - tail_cap,
            tail_cap,
            total: 0,
        }
    }

    /// Appends bytes of the stream.
    pub fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let room = self.head_cap - self.head.len();
        if room > 0 {
            let n = room.min(bytes.len());
            self.head.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
        if self.tail_cap == 0 || bytes.is_empty() {
            return;
        }
        if bytes.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.tail_cap..]);
        } else {
            let excess = (self.tail.len() + bytes.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..excess);
            self.tail.extend(bytes);
        }
    }

    /// Counts `n` bytes of the stream that were never pushed (the rest of
    /// a file left unread, the end of an over-long line).
    pub fn skip(&mut self, n: u64) {
        self.total += n;
        // Later bytes are not contiguous with the head any more.
        self.head_cap = self.head.len();
        if self.tail_cap > 0 {
            // Whatever the tail held is no longer the end of the stream.
            self.tail.clear();
        }
    }

    /// Bytes of the stream so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Whether the head is full: more pushes only count (head-only mode)
    /// or only move the tail.
    pub fn is_full(&self) -> bool {
        self.head.len() == self.head_cap
    }

    /// What [`OutputBuffer::finish`] would say now, keeping the buffer.
    pub fn snapshot(&self) -> String {
        self.clone().finish()
    }

    /// The kept text: the head, and either nothing more, or a marker
    /// saying how many bytes were cut (then the tail). A UTF-8 character
    /// is never split at a cut: its bytes count as cut. Invalid UTF-8 in
    /// the kept bytes is replaced by U+FFFD.
    pub fn finish(self) -> String {
        let kept = (self.head.len() + self.tail.len()) as u64;
        if kept == self.total {
            let mut all = self.head;
            all.extend(self.tail);
            return String::from_utf8(all)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        }
        let head = &self.head[..complete_prefix(&self.head)];
        let tail: Vec<u8> = self.tail.into_iter().collect();
        let tail = &tail[complete_suffix(&tail)..];
        let shown = (head.len() + tail.len()) as u64;
        let mut out = String::from_utf8_lossy(head).into_owned();
        if self.tail_cap == 0 {
            out.push_str(&format!(
                "\n[output truncated: {} bytes, showing the first {shown}]",
                self.total
            ));
        } else {
            out.push_str(&format!("\n[... {} bytes cut ...]\n", self.total - shown));
            out.push_str(&String::from_utf8_lossy(tail));
        }
        out
    }
}

/// `s` cut to its first `max` bytes (on a character boundary), with the
/// marker of [`OutputBuffer::finish`] when it was longer.
pub fn truncate(s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut b = OutputBuffer::head(max);
    b.push(s.as_bytes());
    b.finish()
}

/// The length of the longest prefix of `b` that does not end inside a
/// UTF-8 sequence (an incomplete last character is left out).
fn complete_prefix(b: &[u8]) -> usize {
    // The last character starts at most 3 bytes before the end.
    for back in 1..=b.len().min(4) {
        let i = b.len() - back;
        let lead = b[i];
        if lead & 0b1100_0000 == 0b1000_0000 {
            continue; // a continuation byte
        }
        let need = match lead {
            0x00..=0x7f => 1,
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf7 => 4,
            _ => 1, // not a lead byte: invalid, left for lossy decoding
        };
        return if back < need { i } else { b.len() };
    }
    b.len()
}

/// Where the first whole character of `b` starts (continuation bytes at
/// the start belong to a character that was cut).
fn complete_suffix(b: &[u8]) -> usize {
    b.iter()
        .take(3)
        .take_while(|&&c| c & 0b1100_0000 == 0b1000_0000)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug)]
    enum Mode {
        Head,
        HeadTail,
    }

    #[test]
    fn keeps_a_bounded_part_and_counts_the_rest() {
        // (mode, max, pushed chunks, expected text)
        let cases: &[(Mode, usize, &[&str], &str)] = &[
            (Mode::Head, 10, &[], ""),
            (Mode::Head, 10, &["0123456789"], "0123456789"),
            (Mode::Head, 10, &["01234", "56789"], "0123456789"),
            (
                Mode::Head,
                10,
                &["0123456789a"],
                "0123456789\n[output truncated: 11 bytes, showing the first 10]",
            ),
            (
                Mode::Head,
                10,
                &["01234567", "89", "abc"],
                "0123456789\n[output truncated: 13 bytes, showing the first 10]",
            ),
            (
                Mode::Head,
                0,
                &["abc"],
                "\n[output truncated: 3 bytes, showing the first 0]",
            ),
            // "é" is 2 bytes: a cut inside it drops the whole character.
            (
                Mode::Head,
                4,
                &["abcé"],
                "abc\n[output truncated: 5 bytes, showing the first 3]",
            ),
            // "€" is 3 bytes, "😀" 4.
            (
                Mode::Head,
                5,
                &["ab€€"],
                "ab€\n[output truncated: 8 bytes, showing the first 5]",
            ),
            (
                Mode::Head,
                6,
                &["ab😀x"],
                "ab😀\n[output truncated: 7 bytes, showing the first 6]",
            ),
            (
                Mode::Head,
                5,
                &["ab😀x"],
                "ab\n[output truncated: 7 bytes, showing the first 2]",
            ),
            (Mode::HeadTail, 10, &["0123456789"], "0123456789"),
            (Mode::HeadTail, 10, &["01234", "56789"], "0123456789"),
            (
                Mode::HeadTail,
                10,
                &["0123456789a"],
                "01234\n[... 1 bytes cut ...]\n6789a",
            ),
            (
                Mode::HeadTail,
                10,
                &["012", "34", "5", "6789", "abcdefgh", "ij"],
                "01234\n[... 10 bytes cut ...]\nfghij",
            ),
            (
                Mode::HeadTail,
                11,
                &["0123456789abcdef"],
                "012345\n[... 5 bytes cut ...]\nbcdef",
            ),
            // Cuts at both ends of the gap fall inside characters.
            (
                Mode::HeadTail,
                8,
                &["abcé", "xx", "éfgh"],
                "abc\n[... 6 bytes cut ...]\nfgh",
            ),
            (
                Mode::HeadTail,
                8,
                &["ab€xyz€cd"],
                "ab\n[... 9 bytes cut ...]\ncd",
            ),
        ];
        for (mode, max, chunks, want) in cases {
            let mut b = match mode {
                Mode::Head => OutputBuffer::head(*max),
                Mode::HeadTail => OutputBuffer::head_and_tail(*max),
            };
            for c in *chunks {
                b.push(c.as_bytes());
            }
            let total: usize = chunks.iter().map(|c| c.len()).sum();
            assert_eq!(b.total(), total as u64, "{mode:?} {max} {chunks:?}");
            assert_eq!(b.finish(), *want, "{mode:?} {max} {chunks:?}");
        }
    }

    #[test]
    fn skipped_bytes_are_counted() {
        let mut b = OutputBuffer::head(4);
        b.push(b"abcd");
        assert!(b.is_full());
        b.skip(1000);
        assert_eq!(
            b.finish(),
            "abcd\n[output truncated: 1004 bytes, showing the first 4]"
        );
        let mut b = OutputBuffer::head_and_tail(4);
        b.push(b"abcdef");
        b.skip(10);
        b.push(b"x");
        assert_eq!(b.finish(), "ab\n[... 14 bytes cut ...]\nx");
    }

    #[test]
    fn memory_stays_bounded() {
        let mut b = OutputBuffer::head_and_tail(1000);
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..100 {
            b.push(&chunk);
        }
        assert!(b.head.len() + b.tail.len() <= 1000);
        assert!(b.head.capacity() <= 64 * 1024 && b.tail.capacity() <= 64 * 1024);
        assert!(b.finish().contains("[... 6552600 bytes cut ...]"));
    }

    #[test]
    fn truncate_keeps_short_strings() {
        assert_eq!(truncate("short".into(), 10), "short");
        assert_eq!(
            truncate("0123456789ab".into(), 10),
            "0123456789\n[output truncated: 12 bytes, showing the first 10]"
        );
    }

    #[test]
    fn invalid_utf8_is_replaced_not_dropped() {
        let mut b = OutputBuffer::head(10);
        b.push(b"a\xffb");
        assert_eq!(b.finish(), "a\u{fffd}b");
    }
}
