//! The ACP edge: the only crate that imports `agent-client-protocol`.
//!
//! It uses the crate's schema types for every ACP message, and runs its own
//! small JSON-RPC layer (see ARCHITECTURE.md for why): one connection loop
//! ([`conn::serve`]) shared by stdio, the unix socket and WebSocket.

pub mod accept;
pub mod client;
pub mod conn;
pub mod jsonrpc;
pub mod map;
pub mod socket;
pub mod splice;

use std::sync::Arc;
use std::task::Poll;

use tiller_session::Sessions;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, mpsc, watch};

pub use conn::{AcpConfig, Frame, WRITE_STALL, serve};

/// Reads newline-delimited messages, enforcing `max` bytes per message
/// without ever buffering more than that. Ends when the reader does.
pub async fn read_lines<R: AsyncRead + Unpin>(reader: R, max: usize, tx: mpsc::Sender<Frame>) {
    let mut reader = BufReader::new(reader);
    let mut line: Vec<u8> = Vec::new();
    // Bytes of the current message, counted even while discarding it.
    let mut size = 0usize;
    loop {
        let buf = match reader.fill_buf().await {
            Ok([]) | Err(_) => return,
            Ok(b) => b,
        };
        let (chunk, found) = match memchr::memchr(b'\n', buf) {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        size += chunk.len();
        if size <= max {
            line.extend_from_slice(chunk);
        } else {
            line.clear(); // discarding: the message is too large
        }
        let used = chunk.len() + usize::from(found);
        reader.consume(used);
        if found {
            let frame = if size > max {
                Frame::TooLarge(size)
            } else {
                let text = match std::str::from_utf8(&line) {
                    Ok(text) => text.trim().to_owned(),
                    Err(_) => String::from_utf8_lossy(&line).trim().to_owned(),
                };
                line.clear();
                if text.is_empty() {
                    size = 0;
                    continue;
                }
                Frame::Text(text)
            };
            size = 0;
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    }
}

/// Writes one message per line.
pub async fn write_lines<W: AsyncWrite + Unpin>(mut writer: W, mut rx: mpsc::Receiver<String>) {
    let mut buf: Vec<u8> = Vec::new();
    while let Some(msg) = rx.recv().await {
        // What is already queued goes out in the same write: one system
        // call (and one wake-up of the reader) per burst, not per message.
        buf.clear();
        buf.extend_from_slice(msg.as_bytes());
        buf.push(b'\n');
        // Tasks woken with this one run first (a prompt's answer, sent
        // just after its turn's last update), so their lines join the write.
        tiller_session::task::yield_to_woken().await;
        while buf.len() < WRITE_BATCH {
            let Ok(more) = rx.try_recv() else { break };
            buf.extend_from_slice(more.as_bytes());
            buf.push(b'\n');
        }
        // Each write bounded on its own: a client that reads slowly but
        // steadily is not cut off, one that stops reading is.
        let mut sent = 0;
        while sent < buf.len() {
            match write_within_stall(writer.write(&buf[sent..])).await {
                Some(0) | None => return,
                Some(n) => sent += n,
            }
        }
        if write_within_stall(writer.flush()).await.is_none() {
            return;
        }
        if buf.capacity() > 4 * WRITE_BATCH {
            buf = Vec::new(); // one huge message does not stay allocated
        }
    }
}

/// Bytes gathered into one write, at most (one message may be larger).
const WRITE_BATCH: usize = 64 * 1024;

/// Runs one write to a client; what it returned, or `None` when it
/// failed. A client that leaves the write unfinished for
/// [`WRITE_STALL`] (no byte taken) is given up on, so its connection
/// ends (its tasks, its permit, its descriptor) instead of waiting on it
/// forever; the timer is armed only when the write does not finish at once
/// (nearly always it does: no clock read).
pub async fn write_within_stall<T, E>(write: impl Future<Output = Result<T, E>>) -> Option<T> {
    let mut write = std::pin::pin!(write);
    match std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await {
        Poll::Ready(r) => r.ok(),
        Poll::Pending => match tokio::time::timeout(WRITE_STALL, write).await {
            Ok(r) => r.ok(),
            Err(_) => {
                tracing::warn!(
                    "an ACP client left a write unread for {:?}; closing its connection",
                    WRITE_STALL
                );
                None
            }
        },
    }
}

/// Serves ACP over a newline-delimited byte stream (stdio, unix socket).
pub async fn serve_stream<R, W>(
    sessions: Sessions,
    config: AcpConfig,
    transport: &'static str,
    reader: R,
    writer: W,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (in_tx, in_rx) = mpsc::channel(64);
    let (out_tx, out_rx) = mpsc::channel(256);
    let max = config.max_message_bytes;
    let reading = tokio::spawn(read_lines(reader, max, in_tx));
    let writing = tokio::spawn(write_lines(writer, out_rx));
    serve(sessions, config, transport, in_rx, out_tx).await;
    reading.abort();
    let _ = writing.await;
}

/// Accepts ACP connections on a unix socket until `shutdown` turns true.
/// At most `permits` connections are served at once (shared with the other
/// transports); over that a client gets a one-line error and is closed.
pub async fn serve_unix(
    listener: UnixListener,
    sessions: Sessions,
    config: AcpConfig,
    permits: Arc<Semaphore>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = accept::Backoff::new("unix");
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // EMFILE and friends persist: wait, never spin.
                        let wait = backoff.failed(&e);
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            _ = shutdown.changed() => return,
                        }
                        continue;
                    }
                };
                backoff.reset();
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tokio::spawn(refuse(stream));
                    continue;
                };
                let sessions = sessions.clone();
                let config = config.clone();
                tokio::spawn(async move {
                    // Registered for what each direction waits on only
                    // (see `socket`); a failure here (no descriptor left)
                    // closes the connection.
                    let split = stream.into_std().and_then(socket::split);
                    match split {
                        Ok((r, w)) => serve_stream(sessions, config, "unix", r, w).await,
                        Err(e) => tracing::warn!(error = %e, "unix connection dropped at accept"),
                    }
                    drop(permit);
                });
            }
            _ = shutdown.changed() => return,
        }
    }
}

async fn refuse(mut stream: tokio::net::UnixStream) {
    let e = jsonrpc::RpcError::new(
        jsonrpc::code::OVERLOADED,
        "too many connections (limits.max_connections); retry later",
    )
    .with_data(serde_json::json!({ "errorKind": "overloaded", "retryable": true }));
    let msg = jsonrpc::error(&serde_json::Value::Null, &e);
    let _ = stream.write_all(format!("{msg}\n").as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn frames(input: &'static [u8], max: usize) -> Vec<String> {
        let (tx, mut rx) = mpsc::channel(16);
        read_lines(input, max, tx).await;
        let mut out = Vec::new();
        while let Some(f) = rx.recv().await {
            out.push(match f {
                Frame::Text(t) => t,
                Frame::TooLarge(n) => format!("TOO LARGE {n}"),
            });
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_nothing_cannot_hold_its_writer_forever() {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let (tx, rx) = mpsc::channel(4);
        // Far more than the socket holds, and the channel kept open.
        tx.send("x".repeat(4 << 20)).await.unwrap();
        let writing = tokio::spawn(write_lines(socket::Writer::new(ours).unwrap(), rx));
        let hour = std::time::Duration::from_secs(3600);
        assert!(
            matches!(tokio::time::timeout(hour, writing).await, Ok(Ok(()))),
            "the writer still waited on a client that read nothing for an hour"
        );
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_reading_slowly_but_steadily_gets_all_of_a_long_write() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let (tx, rx) = mpsc::channel(4);
        let big = "x".repeat(4 << 20);
        tx.send(big.clone()).await.unwrap();
        drop(tx);
        let writing = tokio::spawn(write_lines(socket::Writer::new(ours).unwrap(), rx));
        // 64 KiB every 30 s: the whole takes far longer than WRITE_STALL,
        // yet no write waits that long without progress.
        let mut theirs = socket::Reader::new(theirs).unwrap();
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            let n = tokio::io::AsyncReadExt::read(&mut theirs, &mut chunk)
                .await
                .unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        writing.await.unwrap();
        assert_eq!(got.len(), big.len() + 1, "the client was cut off");
    }

    #[tokio::test]
    async fn lines_are_split_and_oversized_ones_reported() {
        assert_eq!(frames(b"a\n\nbb\r\n", 10).await, vec!["a", "bb"]);
        assert_eq!(
            frames(b"0123456789abc\nok\n", 10).await,
            vec!["TOO LARGE 13", "ok"]
        );
        assert_eq!(frames(b"0123456789\n", 10).await, vec!["0123456789"]);
    }
}
