//! The HTTP listener: one task per connection under a connection cap,
//! every connection bounded in time until its request headers arrive
//! (which also bounds how long a kept-alive connection may sit idle) and
//! while a write waits with no byte taken (a client that pipelines
//! requests and never reads, an event stream nobody reads), and an accept
//! loop that backs off instead of spinning when it runs out of file
//! descriptors. Request bodies are bounded in size and time by the
//! router's layers (see [`crate::router`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tower_http::set_header::SetResponseHeaderLayer;

/// The listener's bounds (`[limits]`).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once; over it a client gets a 503 and is
    /// closed.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers,
    /// counted from its start or from the end of the previous response.
    pub header_timeout: Duration,
    /// How long a write to a connection may wait with no byte taken.
    pub write_stall: Duration,
}

/// Serves `app` until `stop` turns true, then asks every connection to
/// finish (graceful shutdown) and returns once they have, or after
/// `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    // The daemon closes a connection idle for `header_timeout`; saying so
    // lets a client stop reusing it first, instead of sending a request
    // (a POST it will not retry) into a connection being closed.
    let idle = format!("timeout={}", limits.header_timeout.as_secs().max(1));
    let app = app.layer(SetResponseHeaderLayer::if_not_present(
        axum::http::header::HeaderName::from_static("keep-alive"),
        axum::http::HeaderValue::from_str(&idle).expect("a valid header value"),
    ));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    // Connection tasks hold a receiver; shutdown waits until all dropped.
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut backoff = tiller_acp::accept::Backoff::new("http");
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                let wait = backoff.failed(&e);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => break,
                }
                continue;
            }
        };
        backoff.reset();
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics::counter!("tiller_http_connections_refused_total").increment(1);
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let mut closing = closing_rx.clone();
        let (header_timeout, write_stall) = (limits.header_timeout, limits.write_stall);
        tokio::spawn(async move {
            metrics::gauge!("tiller_http_connections_active").increment(1.0);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(64 * 1024);
            let io = TokioIo::new(StallBound::new(stream, write_stall));
            let conn = http
                .serve_connection(io, TowerToHyperService::new(app))
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => log_end(r),
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    log_end(conn.await);
                }
            }
            metrics::gauge!("tiller_http_connections_active").decrement(1.0);
            drop(permit);
            drop(closing);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drop(closing_rx);
    let _ = tokio::time::timeout(drain, closing_tx.closed()).await;
}

fn log_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        if e.is_timeout() {
            metrics::counter!("tiller_http_header_timeouts_total").increment(1);
        }
        tracing::debug!(error = %e, "HTTP connection ended");
    }
}

/// Over the cap: a short answer, then close.
async fn refuse(mut stream: TcpStream) {
    let body = "too many connections (limits.max_http_connections); retry later\n";
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = stream.write_all(msg.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// A connection whose writes fail once one has waited `stall` with no byte
/// taken: the connection then ends, its slot and descriptor freed. The
/// clock runs only while a write waits (nearly always it does not); any
/// progress starts it over, so a slow but steady reader is served.
struct StallBound {
    io: TcpStream,
    stall: Duration,
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl StallBound {
    fn new(io: TcpStream, stall: Duration) -> StallBound {
        StallBound {
            io,
            stall,
            waiting: None,
        }
    }

    /// `r`, a write's poll, bounded by the stall.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if r.is_ready() {
            self.waiting = None;
            return r;
        }
        let stall = self.stall;
        let clock = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        match clock.as_mut().poll(cx) {
            Poll::Ready(()) => {
                metrics::counter!("tiller_http_write_stalls_total").increment(1);
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the client took nothing of a write for {stall:?}"),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for StallBound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallBound {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.bounded(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.bounded(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.bounded(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.bounded(cx, r)
    }
}
