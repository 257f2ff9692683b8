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
//! a write takes a whole buffer.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use rustix::net::{SendFlags, Shutdown};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::unix::pipe;

// tokio's pipe ends are what is wanted here: a non-blocking descriptor
// registered for one direction only, read with `read(2)`, which a stream
// socket serves exactly as a pipe does. (`AsyncFd` registers a chosen
// direction too, but only through an `unsafe` or a deprecated constructor;
// `tokio::net::UnixStream` always registers both.)

/// Both directions of one connected socket, on its one descriptor (a
/// connection costs one, as before: under `ulimit -n` pressure a second
/// would refuse connections the daemon could serve).
pub fn split(stream: UnixStream) -> io::Result<(Reader, Writer)> {
    let reader = Reader::new(stream)?;
    let writer = Writer {
        fd: WriteFd::Shared(reader.rx.clone()),
        room: Room::Open,
        shut_on_drop: true,
        #[cfg(test)]
        no_dup: false,
    };
    Ok((reader, writer))
}

/// The reading direction, woken only for input.
#[derive(Debug)]
pub struct Reader {
    /// Shared with the [`Writer`] of a [`split`], which writes to the same
    /// descriptor: it stays open until both are dropped. The lock is only
    /// ever held for a non-blocking call.
    rx: Arc<Mutex<pipe::Receiver>>,
}

impl Reader {
    /// Sets `stream` non-blocking and registers it for reading.
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        let rx = pipe::Receiver::from_owned_fd_unchecked(OwnedFd::from(stream))?;
        Ok(Self {
            rx: Arc::new(Mutex::new(rx)),
        })
    }
}

fn lock(rx: &Mutex<pipe::Receiver>) -> MutexGuard<'_, pipe::Receiver> {
    rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl AsyncRead for Reader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // tokio's own read: a short read clears the readiness (no read
        // that would only say `EAGAIN`).
        Pin::new(&mut *lock(&self.rx)).poll_read(cx, buf)
    }
}

/// The writing direction: written straight (`send` with `MSG_NOSIGNAL`),
/// registered only while the socket is full.
#[derive(Debug)]
pub struct Writer {
    fd: WriteFd,
    /// How a write waiting for room waits.
    room: Room,
    /// A [`split`]'s writer shuts its side down when dropped, as tokio's
    /// `OwnedWriteHalf` does: the peer sees the end while the reader
    /// lives. Not stdout's: the process's stderr may be the same socket.
    shut_on_drop: bool,
    /// Tests: the duplicate cannot be made, as when out of descriptors.
    #[cfg(test)]
    no_dup: bool,
}

#[derive(Debug)]
enum Room {
    /// Nothing waits: writes go straight through.
    Open,
    /// A duplicate of the descriptor, registered for `EPOLLOUT` only, its
    /// readiness waited on (the writes still go through the writer's
    /// own). Dropped, and so deregistered, once a write takes a whole
    /// buffer again.
    Watched(pipe::Sender),
    /// Out of descriptors for a duplicate (`EMFILE`, `ENFILE`): the write
    /// is tried again at each [`TICK`] (and a duplicate with it), so a
    /// slow client is not cut off for the daemon's lack.
    Ticking(Pin<Box<tokio::time::Sleep>>),
}

/// How often a write waiting for room tries again when no duplicate could
/// be made to watch the socket with.
const TICK: std::time::Duration = std::time::Duration::from_millis(10);

#[derive(Debug)]
enum WriteFd {
    /// A [`split`]'s: the reader's descriptor.
    Shared(Arc<Mutex<pipe::Receiver>>),
    /// Its own (stdout).
    Own(OwnedFd),
}

impl Writer {
    /// Writes to `stream` (sets it non-blocking); registers nothing yet.
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            fd: WriteFd::Own(OwnedFd::from(stream)),
            room: Room::Open,
            shut_on_drop: false,
            #[cfg(test)]
            no_dup: false,
        })
    }

    /// Whether a write is waiting for room (registered with the driver,
    /// or on the clock).
    pub fn waiting(&self) -> bool {
        !matches!(self.room, Room::Open)
    }

    /// How to wait for room: watching a duplicate of the descriptor, or,
    /// when there is no descriptor left for one, the clock.
    fn wait_for_room(&self) -> io::Result<Room> {
        match self.dup() {
            Ok(dup) => Ok(Room::Watched(pipe::Sender::from_owned_fd_unchecked(dup)?)),
            Err(e)
                if [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE]
                    .iter()
                    .any(|n| e.raw_os_error() == Some(n.raw_os_error())) =>
            {
                Ok(Room::Ticking(Box::pin(tokio::time::sleep(TICK))))
            }
            Err(e) => Err(e),
        }
    }

    /// Runs `f` on the descriptor written to.
    fn with_fd<R>(&self, f: impl FnOnce(BorrowedFd<'_>) -> R) -> R {
        match &self.fd {
            WriteFd::Shared(rx) => f(lock(rx).as_fd()),
            WriteFd::Own(fd) => f(fd.as_fd()),
        }
    }

    /// A duplicate of the descriptor written to.
    fn dup(&self) -> io::Result<OwnedFd> {
        #[cfg(test)]
        if self.no_dup {
            return Err(io::Error::from_raw_os_error(
                rustix::io::Errno::MFILE.raw_os_error(),
            ));
        }
        self.with_fd(|fd| fd.try_clone_to_owned())
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.with_fd(|fd| rustix::net::send(fd, buf, SendFlags::NOSIGNAL))
            .map_err(io::Error::from)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.shut_on_drop {
            let _ = self.with_fd(|fd| rustix::net::shutdown(fd, Shutdown::Write));
        }
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
            if let Room::Ticking(tick) = &mut this.room {
                ready!(tick.as_mut().poll(cx));
                this.room = Room::Open;
            }
            let Room::Watched(room) = &this.room else {
                match this.send(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // Full: wait for room (a slow client; a duplicate
                        // watched lives as long).
                        this.room = this.wait_for_room()?;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    done => return Poll::Ready(done),
                }
                continue;
            };
            ready!(room.poll_write_ready(cx))?;
            // `try_io` clears the readiness when the write would block.
            let done = match room.try_io(|| this.send(buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                done => done,
            };
            if matches!(done, Ok(n) if n == buf.len()) {
                // Room again: stop watching. (A part written leaves it
                // registered for the rest of a `write_all`.)
                this.room = Room::Open;
            }
            return Poll::Ready(done);
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let shut = self.with_fd(|fd| rustix::net::shutdown(fd, Shutdown::Write));
        Poll::Ready(shut.map_err(io::Error::from))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, RawFd};
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    impl Reader {
        fn raw_fd(&self) -> RawFd {
            lock(&self.rx).as_raw_fd()
        }
    }

    impl Writer {
        /// The descriptor the driver watches while waiting, else the one
        /// written to.
        fn raw_fd(&self) -> RawFd {
            match &self.room {
                Room::Watched(room) => room.as_raw_fd(),
                _ => self.with_fd(|fd| fd.as_raw_fd()),
            }
        }
    }

    /// The event masks every epoll of this process watches `fd` with
    /// (`/proc/self/fdinfo` of each epoll descriptor; a runtime holds two
    /// descriptors of its epoll, so identical lines count once).
    fn watched(fd: RawFd) -> Vec<u32> {
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

    /// Writes `chunk` until a write is left pending (the socket is full);
    /// the bytes written.
    async fn fill(w: &mut Writer, chunk: &[u8]) -> usize {
        let mut written = 0usize;
        loop {
            let n = std::future::poll_fn(|cx| match Pin::new(&mut *w).poll_write(cx, chunk) {
                Poll::Pending => Poll::Ready(None),
                Poll::Ready(r) => Poll::Ready(Some(r.unwrap())),
            })
            .await;
            match n {
                Some(n) => written += n,
                None => return written,
            }
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

        // Far more than a socket buffer: the writer waits for room,
        // registered, and finishes once the peer reads it all.
        let big: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let writing = tokio::spawn(async move {
            w.write_all(&sent).await.unwrap();
            assert!(!w.waiting(), "a whole write leaves no registration");
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

    /// Out of descriptors (`EMFILE`: the duplicate cannot be made), a
    /// full socket is waited on by the clock instead, and the write still
    /// finishes once the peer reads; with descriptors back, it is watched
    /// again.
    #[tokio::test]
    async fn a_full_socket_out_of_descriptors_is_waited_on_by_the_clock() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = Writer::new(ours).unwrap();
        w.no_dup = true;
        let mut theirs = Reader::new(theirs).unwrap();
        let big: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let writing = tokio::spawn(async move { w.write_all(&sent).await.map(|()| w) });
        let mut back = vec![0u8; big.len()];
        theirs.read_exact(&mut back).await.unwrap();
        let mut w = writing.await.unwrap().expect("the write finishes");
        assert!(back == big);
        assert!(!w.waiting());
        w.no_dup = false;
        let written = fill(&mut w, &[7u8; 64 * 1024]).await;
        assert!(w.waiting() && !watched(w.raw_fd()).is_empty());
        let mut drained = vec![0u8; written];
        theirs.read_exact(&mut drained).await.unwrap();
    }

    #[tokio::test]
    async fn a_peer_reading_cannot_wake_the_daemon() {
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
        // One descriptor for both directions.
        assert_eq!(r.raw_fd(), w.raw_fd());
        let mut theirs = Reader::new(theirs).unwrap();
        w.write_all(b"answer\n").await.unwrap();
        let mut got = [0u8; 7];
        theirs.read_exact(&mut got).await.unwrap();
        // Only input wakes: the socket is watched for `EPOLLIN` alone.
        let masks = watched(r.raw_fd());
        assert_eq!(masks.len(), 1, "{masks:?}");
        assert!(masks[0] & EPOLLIN != 0 && masks[0] & EPOLLOUT == 0);
        drop(theirs);
        let mut none = [0u8; 1];
        assert_eq!(r.read(&mut none).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_full_socket_registers_its_writer_until_room_is_made() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = Writer::new(ours).unwrap();
        let mut theirs = Reader::new(theirs).unwrap();
        // A write that cannot go through leaves the writer registered and
        // pending, neither failed nor spinning.
        let written = fill(&mut w, &[7u8; 64 * 1024]).await;
        assert!(written > 0);
        assert!(w.waiting());
        let masks = watched(w.raw_fd());
        assert_eq!(masks.len(), 1, "{masks:?}");
        assert!(masks[0] & EPOLLOUT != 0 && masks[0] & EPOLLIN == 0);
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
        let read = tokio::time::timeout(Duration::from_secs(10), theirs.read_to_end(&mut rest));
        assert_eq!(read.await.expect("the peer saw no end").unwrap(), 0);
    }

    #[tokio::test]
    async fn stdouts_writer_leaves_the_socket_open_when_dropped() {
        // Stdout may be the same socket as stderr (an inetd-style launch):
        // its writer ending must not end the socket for the others.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let stderr = ours.try_clone().unwrap();
        drop(Writer::new(ours).unwrap());
        use std::io::{Read, Write};
        (&stderr).write_all(b"still here").unwrap();
        let mut got = [0u8; 10];
        (&theirs).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"still here");
    }

    #[tokio::test]
    async fn a_peer_gone_while_the_writer_waits_fails_the_write() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = Writer::new(ours).unwrap();
        fill(&mut w, &[1u8; 64 * 1024]).await;
        assert!(w.waiting());
        drop(theirs);
        let write = tokio::time::timeout(Duration::from_secs(10), w.write_all(b"more"));
        let r = write.await.expect("the write hung after its peer left");
        assert!(r.is_err());
    }
}
