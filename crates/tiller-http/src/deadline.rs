//! A request body bounded as a whole in time (`limits.http_body_timeout`):
//! a client trickling a byte at a time, never idle for long, is cut off
//! at the deadline, not only one that pauses. An idle timer (started over
//! by every byte) let such a body hold its connection for as long as it
//! kept trickling.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::AppState;

/// Gives every request's body its deadline, counted from now.
pub(crate) async fn bound(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let body = if hyper::body::Body::is_end_stream(&body) {
        body
    } else {
        Body::new(Deadline {
            body,
            until: tiller_session::clock::instant() + st.body_timeout,
            clock: None,
            after: st.body_timeout,
        })
    };
    next.run(Request::from_parts(parts, body)).await
}

struct Deadline {
    body: Body,
    until: Instant,
    /// Armed at the first poll (a request without a body has none).
    clock: Option<Pin<Box<Sleep>>>,
    after: Duration,
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let until = self.until;
        let clock = self
            .clock
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
        if clock.as_mut().poll(cx).is_ready() {
            let after = self.after;
            return Poll::Ready(Some(Err(axum::Error::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the request body did not arrive within {after:?} (limits.http_body_timeout)"
                ),
            )))));
        }
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
