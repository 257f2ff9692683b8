//! Stdin and stdout for ACP over stdio, read and written by the runtime's
//! own I/O driver when they are a pipe or a socket (what an editor gives a
//! child), so a message costs no hand-off to a blocking thread.
//! `tokio::io::stdin()` reads on the blocking pool, one thread hop per read;
//! it stays the fallback for a terminal or a file, whose shared file
//! description must not be switched to non-blocking.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

/// Stdin as a byte stream.
pub fn stdin() -> Pin<Box<dyn AsyncRead + Send>> {
    match own(std::io::stdin().as_fd()) {
        Some(Own::Pipe(file)) => match tokio::net::unix::pipe::Receiver::from_file(file) {
            Ok(r) => Box::pin(r),
            Err(_) => Box::pin(tokio::io::stdin()),
        },
        Some(Own::Socket(s)) => match tiller_acp::socket::Reader::new(s) {
            Ok(r) => Box::pin(r),
            Err(_) => Box::pin(tokio::io::stdin()),
        },
        None => Box::pin(tokio::io::stdin()),
    }
}

/// Stdout as a byte sink.
pub fn stdout() -> Pin<Box<dyn AsyncWrite + Send>> {
    match own(std::io::stdout().as_fd()) {
        Some(Own::Pipe(file)) => match tokio::net::unix::pipe::Sender::from_file(file) {
            Ok(w) => Box::pin(w),
            Err(_) => Box::pin(tokio::io::stdout()),
        },
        Some(Own::Socket(s)) => match tiller_acp::socket::Writer::new(s) {
            Ok(w) => Box::pin(w),
            Err(_) => Box::pin(tokio::io::stdout()),
        },
        None => Box::pin(tokio::io::stdout()),
    }
}

enum Own {
    Pipe(File),
    Socket(std::os::unix::net::UnixStream),
}

/// A duplicate of `fd` when it is a pipe or a unix socket.
fn own(fd: std::os::fd::BorrowedFd<'_>) -> Option<Own> {
    let owned: OwnedFd = fd.try_clone_to_owned().ok()?;
    let file = File::from(owned);
    let kind = file.metadata().ok()?.file_type();
    if kind.is_fifo() {
        Some(Own::Pipe(file))
    } else if kind.is_socket() {
        Some(Own::Socket(OwnedFd::from(file).into()))
    } else {
        None
    }
}
