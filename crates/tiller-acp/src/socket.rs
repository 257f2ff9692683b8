//! A unix stream socket's two directions, registered with the runtime's
//! I/O driver only for what they wait on.
//!
//! Linux wakes every epoll watching a unix socket for `EPOLLOUT` each time
//! its peer reads (`unix_write_space` has no "was full" check, unlike a pipe
//! or TCP). `tokio::net::UnixStream` registers both directions, so each
//! batch a client read woke the daemon's thread once for nothing: one
//! `epoll_wait` and a context switch a prompt. Here the reading side is
//! registered for `EPOLLIN` only, and the writing side writes straight to
//! the socket, registering a duplicate of it for `EPOLLOUT` only while a
//! write waits for room (a slow client), and dropping that registration once
//! a write goes through.

use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::unix::pipe;

// tokio's pipe ends are what is wanted here: plain `read(2)` and `write(2)`
// on a non-blocking descriptor registered for one direction only, which a
// stream socket serves exactly as a pipe does. (`AsyncFd` registers a
// chosen direction too, but only through an `unsafe` or a deprecated
// constructor; `tokio::net::UnixStream` always registers both.)

/// Both directions of one connected socket (two descriptors of it).
pub fn split(stream: UnixStream) -> io::Result<(Reader, Writer)> {
    let write = stream.try_clone()?;
    Ok((Reader::new(stream)?, Writer::new(write)?))
}

/// The reading direction, woken only for input.
#[derive(Debug)]
pub struct Reader {
    rx: pipe::Receiver,
}

impl Reader {
    /// Sets `stream` non-blocking and registers it for reading.
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            rx: pipe::Receiver::from_owned_fd_unchecked(OwnedFd::from(stream))?,
        })
    }
}

impl AsyncRead for Reader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.rx).poll_read(cx, buf)
    }
}

/// The writing direction: written straight, registered only while full.
/// Dropping it shuts the socket's writing side down, as tokio's
/// `OwnedWriteHalf` does: the peer sees the end even while the reading
/// side is still open.
#[derive(Debug)]
pub struct Writer {
    stream: UnixStream,
    /// While a write waits for room: a duplicate of `stream`, registered
    /// for `EPOLLOUT` only, its readiness waited on (the writes still go
    /// through `stream`: `send` with `MSG_NOSIGNAL`). Dropped, and so
    /// deregistered, once a write takes a whole buffer again.
    room: Option<pipe::Sender>,
}

impl Writer {
    /// Sets `stream` non-blocking; registers nothing yet.
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self { stream, room: None })
    }

    /// Whether a write is waiting for room (registered with the driver).
    pub fn waiting(&self) -> bool {
        self.room.is_some()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

impl AsyncWrite for Writer {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            let Some(room) = &this.room else {
                match (&this.stream).write(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let dup = OwnedFd::from(this.stream.try_clone()?);
                        this.room = Some(pipe::Sender::from_owned_fd_unchecked(dup)?);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    done => return Poll::Ready(done),
                }
                continue;
            };
            ready!(room.poll_write_ready(cx))?;
            // `try_io` clears the readiness when the write would block.
            let done = match room.try_io(|| (&this.stream).write(buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                done => done,
            };
            if matches!(done, Ok(n) if n == buf.len()) {
                // Room again: stop watching (a part written leaves it
                // registered for the rest, no churn under a slow reader).
                this.room = None;
            }
            return Poll::Ready(done);
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.stream.shutdown(Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    impl Writer {
        /// The descriptor the driver watches while waiting, else the
        /// socket's own.
        fn raw_fd(&self) -> std::os::fd::RawFd {
            use std::os::fd::AsRawFd;
            self.room
                .as_ref()
                .map_or(self.stream.as_raw_fd(), AsRawFd::as_raw_fd)
        }
    }

    #[tokio::test]
    async fn both_directions_carry_bytes_and_a_full_socket_waits_for_room() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (mut r, mut w) = split(ours).unwrap();
        let (mut tr, mut tw) = split(theirs).unwrap();

        tw.write_all(b"hello\n").await.unwrap();
        let mut got = [0u8; 6];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello\n");

        // Far more than a socket buffer: the writer must wait for room,
        // registered, and finish once the peer reads it all.
        let big: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let writing = tokio::spawn(async move {
            w.write_all(&sent).await.unwrap();
            assert!(
                !w.waiting(),
                "a write that went through leaves no registration"
            );
            w.shutdown().await.unwrap();
        });
        let mut back = Vec::new();
        tr.read_to_end(&mut back).await.unwrap();
        writing.await.unwrap();
        assert_eq!(back.len(), big.len());
        assert!(back == big);
        tw.shutdown().await.unwrap();
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    /// The event masks every epoll of this process watches `fd` with
    /// (`/proc/self/fdinfo` of each epoll descriptor; a runtime holds two
    /// descriptors of its epoll, so identical lines count once).
    fn watched(fd: std::os::fd::RawFd) -> Vec<u32> {
        let mut lines = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir("/proc/self/fdinfo").unwrap().flatten() {
            let Ok(info) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            for line in info.lines().filter(|l| l.starts_with("tfd:")) {
                let words: Vec<&str> = line.split_whitespace().collect();
                if words.get(1).and_then(|w| w.parse().ok()) == Some(fd) {
                    lines.insert(line.to_owned());
                }
            }
        }
        let mask = |l: &String| u32::from_str_radix(l.split_whitespace().nth(3).unwrap(), 16);
        lines.iter().map(|l| mask(l).unwrap()).collect()
    }

    const EPOLLIN: u32 = 0x1;
    const EPOLLOUT: u32 = 0x4;

    #[tokio::test]
    async fn a_peer_reading_cannot_wake_the_daemon() {
        use std::os::fd::AsRawFd;
        // The probe sees what tokio's own stream registers: both ways.
        let (control, _peer) = UnixStream::pair().unwrap();
        control.set_nonblocking(true).unwrap();
        let control = tokio::net::UnixStream::from_std(control).unwrap();
        assert!(
            watched(control.as_raw_fd())
                .iter()
                .any(|m| m & EPOLLOUT != 0)
        );

        let (ours, theirs) = UnixStream::pair().unwrap();
        let (mut r, mut w) = split(ours).unwrap();
        let (read_fd, write_fd) = (r.rx.as_raw_fd(), w.raw_fd());
        let mut theirs = Reader::new(theirs).unwrap();
        w.write_all(b"answer\n").await.unwrap();
        let mut got = [0u8; 7];
        theirs.read_exact(&mut got).await.unwrap();
        // Only input wakes: the reading side is watched for `EPOLLIN`
        // alone, the writing side not at all.
        let read_masks = watched(read_fd);
        assert_eq!(read_masks.len(), 1, "{read_masks:?}");
        assert!(read_masks[0] & EPOLLIN != 0 && read_masks[0] & EPOLLOUT == 0);
        assert!(watched(write_fd).is_empty());
        drop(theirs);
        let mut none = [0u8; 1];
        assert_eq!(r.read(&mut none).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_full_socket_registers_its_writer_until_room_is_made() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = Writer::new(ours).unwrap();
        let mut theirs = Reader::new(theirs).unwrap();
        let chunk = vec![7u8; 64 * 1024];
        // Fill the socket: a write that cannot go through must leave the
        // writer registered and pending, not fail and not spin.
        let mut written = 0usize;
        loop {
            let n = std::future::poll_fn(|cx| match Pin::new(&mut w).poll_write(cx, &chunk) {
                Poll::Pending => Poll::Ready(None),
                Poll::Ready(r) => Poll::Ready(Some(r.unwrap())),
            })
            .await;
            match n {
                Some(n) => written += n,
                None => break,
            }
        }
        assert!(written > 0);
        assert!(w.waiting());
        {
            let masks = watched(w.raw_fd());
            assert_eq!(masks.len(), 1, "{masks:?}");
            assert!(masks[0] & EPOLLOUT != 0 && masks[0] & EPOLLIN == 0);
        }
        let mut drained = vec![0u8; written];
        theirs.read_exact(&mut drained).await.unwrap();
        w.write_all(b"more").await.unwrap();
        assert!(!w.waiting());
        let mut more = [0u8; 4];
        theirs.read_exact(&mut more).await.unwrap();
        assert_eq!(&more, b"more");
    }

    #[tokio::test]
    async fn a_dropped_writer_ends_the_stream_while_its_reader_lives() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (_r, w) = split(ours).unwrap();
        let mut theirs = Reader::new(theirs).unwrap();
        drop(w);
        let mut rest = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            theirs.read_to_end(&mut rest),
        );
        assert_eq!(read.await.expect("the peer saw no end").unwrap(), 0);
    }

    #[tokio::test]
    async fn a_peer_gone_while_the_writer_waits_fails_the_write() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = Writer::new(ours).unwrap();
        let big = vec![1u8; 4 * 1024 * 1024];
        let writing = tokio::spawn(async move {
            let r = w.write_all(&big).await;
            (r, w.waiting())
        });
        // Let the writer fill the socket and wait for room, then go.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        drop(theirs);
        let (r, _) = tokio::time::timeout(std::time::Duration::from_secs(10), writing)
            .await
            .expect("the write hung after its peer left")
            .unwrap();
        assert!(r.is_err());
    }
}
