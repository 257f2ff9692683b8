//! Channel ingress: `POST /api/channels/:channel/prompts`, authenticated by
//! the channel's own secret (HMAC-SHA256 over `"<timestamp>.<raw body>"`),
//! with a replay window. The only way a turn becomes a channel turn.

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use hmac::{KeyInit, Mac};
use serde_json::json;
use tiller_core::{Origin, SessionId};

use crate::AppState;
use crate::api::ApiError;
use crate::wire::{ChannelAccepted, ChannelBody, ErrorResponse};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// One configured channel (`[channels.NAME]`).
#[derive(Clone, Debug, Default)]
pub struct Channel {
    /// The HMAC secret its requests are signed with.
    pub secret: Vec<u8>,
    /// The working directory of the sessions it creates.
    pub cwd: String,
    /// The engine of the sessions it creates (`None`: the default).
    pub engine: Option<String>,
    /// Existing sessions it may prompt besides its own.
    pub sessions: Vec<SessionId>,
}

/// The channels and the replay window. Seen requests are remembered in the
/// store (durable), so a replay is refused across restarts too.
#[derive(Default)]
pub struct Channels {
    /// Each channel by name.
    pub channels: HashMap<String, Channel>,
    /// Requests older (or newer) than this are refused.
    pub replay_window: Duration,
}

impl Channels {
    pub fn new(channels: HashMap<String, Channel>, replay_window: Duration) -> Self {
        Self {
            channels,
            replay_window,
        }
    }

    /// What can be checked before the body is read: a known channel, a
    /// timestamp inside the window, a signature of the right form. Returns
    /// the timestamp and the signature's hex.
    pub fn admit<'a>(
        &self,
        channel: &str,
        timestamp: Option<&str>,
        signature: Option<&'a str>,
        now_s: i64,
    ) -> Result<(i64, &'a str), &'static str> {
        if !self.channels.contains_key(channel) {
            return Err("unknown channel");
        }
        let ts: i64 = timestamp
            .ok_or("missing X-Tiller-Timestamp")?
            .trim()
            .parse()
            .map_err(|_| "bad X-Tiller-Timestamp")?;
        // Checked: any i64 a client sends must not overflow.
        if now_s.abs_diff(ts) > self.replay_window.as_secs() {
            return Err("timestamp outside the replay window");
        }
        let hex_sig = signature
            .and_then(|s| s.trim().strip_prefix("sha256="))
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or("missing or malformed X-Tiller-Signature")?;
        Ok((ts, hex_sig))
    }

    /// Authenticates a request; returns the key its replay guard uses, or
    /// why it is refused.
    pub fn verify(
        &self,
        channel: &str,
        timestamp: Option<&str>,
        signature: Option<&str>,
        body: &[u8],
        now_s: i64,
    ) -> Result<String, &'static str> {
        let (ts, hex_sig) = self.admit(channel, timestamp, signature, now_s)?;
        let secret = &self.channels.get(channel).ok_or("unknown channel")?.secret;
        let sig = hex::decode(hex_sig).map_err(|_| "malformed X-Tiller-Signature")?;
        let mut mac = HmacSha256::new_from_slice(secret).map_err(|_| "bad channel secret")?;
        mac.update(ts.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        // Constant-time comparison.
        mac.verify_slice(&sig).map_err(|_| "bad signature")?;
        Ok(format!("{channel}:{}", hex_sig.to_ascii_lowercase()))
    }
}

fn refuse(why: &str) -> ApiError {
    metrics::counter!("tiller_channel_refusals_total").increment(1);
    ApiError(
        StatusCode::UNAUTHORIZED,
        json!({ "errorKind": "unauthorized", "message": format!("channel request refused: {why}") }),
    )
}

/// The body, at most `max` bytes, within `timeout` in all.
async fn read_body(
    body: axum::body::Body,
    max: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let too_slow = || {
        ApiError(
            StatusCode::REQUEST_TIMEOUT,
            json!({ "errorKind": "invalid_params", "message": "the request body did not arrive in time (limits.http_body_timeout)" }),
        )
    };
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, max)).await {
        Err(_) => Err(too_slow()),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            json!({ "errorKind": "invalid_params", "message": format!("cannot read the request body: {e}") }),
        )),
    }
}

fn forbidden(channel: &str, session: &str) -> ApiError {
    metrics::counter!("tiller_channel_refusals_total").increment(1);
    ApiError(
        StatusCode::FORBIDDEN,
        json!({
            "errorKind": "forbidden",
            "message": format!(
                "channel `{channel}` may not prompt session {session}: only sessions it created or \
                 ones listed in channels.{channel}.sessions"
            ),
        }),
    )
}

/// A prompt from an outside system (a chat bridge, a CI hook), signed with
/// the channel's secret instead of the daemon's token: `X-Tiller-Signature:
/// sha256=HEX` of HMAC-SHA256 over `TIMESTAMP.BODY`, `X-Tiller-Timestamp`
/// within the replay window. Runs on the channel's own sessions only.
#[utoipa::path(post, path = "/api/channels/{channel}/prompts", tag = "automation",
    params(("channel" = String, Path),
        ("X-Tiller-Timestamp" = i64, Header, description = "Unix seconds"),
        ("X-Tiller-Signature" = String, Header, description = "sha256=HEX")),
    request_body = ChannelBody, security(()),
    responses((status = 202, body = ChannelAccepted),
        (status = 403, body = ErrorResponse, description = "Not one of the channel's sessions"),
        (status = 408, body = ErrorResponse, description = "The body did not arrive in time"),
        (status = 409, body = ErrorResponse, description = "The session is closed"),
        (status = 429, body = ErrorResponse, description = "Too many prompts queued; retry later")))]
pub async fn post_prompt(
    State(st): State<AppState>,
    Path(channel): Path<String>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse as _;
    let header = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
    let now = tiller_session::clock::unix_ms() / 1000;
    // Nothing of the body is read for a request that cannot be genuine:
    // this route has no token, so these checks are its gate.
    st.channels
        .admit(
            &channel,
            header("x-tiller-timestamp"),
            header("x-tiller-signature"),
            now,
        )
        .map_err(refuse)?;
    let body = read_body(body, st.max_body_bytes, st.body_timeout).await?;
    let key = st
        .channels
        .verify(
            &channel,
            header("x-tiller-timestamp"),
            header("x-tiller-signature"),
            &body,
            now,
        )
        .map_err(refuse)?;
    // Durable replay guard: twice the window covers timestamps from the future.
    let window = 2 * st.channels.replay_window.as_secs() as i64;
    if !st.sessions.channel_seen(key.clone(), now, window).await? {
        return Err(refuse("replayed request"));
    }
    let admitted = admit_prompt(&st, &channel, &body).await;
    if admitted.is_err()
        && let Err(e) = st.sessions.channel_unseen(key, now).await
    {
        // The sender's retry is refused as a replay until the window ends.
        tracing::warn!(%channel, error = %e, "cannot forget a refused channel request");
    }
    match admitted {
        Ok(accepted) => Ok(accepted.into_response()),
        Err(NotHere::Refused(e)) => Err(e),
        // Another node serves the session: the request, as signed, is
        // carried to it (once: it does not carry it on).
        Err(NotHere::Owner { id, node, address })
            if !headers.contains_key(crate::forward::FORWARDED) =>
        {
            // The path as it came (the channel's name still encoded).
            let uri = uri.path().to_owned();
            Ok(crate::forward::carry(&st, (headers, uri, body), id, &node, &address).await)
        }
        Err(NotHere::Owner { id, node, address }) => {
            Err(ApiError::from(tiller_session::SessionError::Elsewhere {
                id,
                node,
                address,
            }))
        }
    }
}

/// Why a verified channel request was not admitted here.
enum NotHere {
    Refused(ApiError),
    /// Another node serves its session.
    Owner {
        id: SessionId,
        node: String,
        address: String,
    },
}

impl From<ApiError> for NotHere {
    fn from(e: ApiError) -> NotHere {
        NotHere::Refused(e)
    }
}

impl From<tiller_session::SessionError> for NotHere {
    fn from(e: tiller_session::SessionError) -> NotHere {
        match e {
            tiller_session::SessionError::Elsewhere { id, node, address } => {
                NotHere::Owner { id, node, address }
            }
            e => NotHere::Refused(e.into()),
        }
    }
}

/// The prompt of a verified channel request, admitted (or why not).
async fn admit_prompt(
    st: &AppState,
    channel: &str,
    body: &[u8],
) -> Result<(StatusCode, Json<ChannelAccepted>), NotHere> {
    let req: ChannelBody = serde_json::from_slice(body).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            json!({ "errorKind": "invalid_params", "message": format!("invalid body: {e}") }),
        )
    })?;
    let config = st
        .channels
        .channels
        .get(channel)
        .expect("verified above: the channel exists");
    let handle = match &req.session_id {
        Some(raw) => {
            // Only its own sessions, or ones its config lists: a channel
            // carries third-party text and must not reach a person's session.
            let id = SessionId::parse(raw).ok_or_else(|| NotHere::from(forbidden(channel, raw)))?;
            let rec = st
                .sessions
                .record(id)
                .await
                .map_err(|_| NotHere::from(forbidden(channel, raw)))?;
            if rec.channel.as_deref() != Some(channel) && !config.sessions.contains(&id) {
                return Err(forbidden(channel, raw).into());
            }
            st.sessions.open(id).await?
        }
        None => {
            st.sessions
                .create_session(tiller_session::NewSession {
                    cwd: config.cwd.clone(),
                    title: Some(format!("channel {channel}")),
                    engine: config.engine.clone(),
                    channel: Some(channel.to_owned()),
                })
                .await?
        }
    };
    let (prompt, _) = handle
        .prompt_with(req.text, Origin::Channel, req.delivery.map(|d| d.webhook))
        .await?
        .map_err(ApiError::from)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(ChannelAccepted {
            prompt_id: prompt.to_string(),
            session_id: handle.id().to_string(),
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &[u8], ts: i64, body: &[u8]) -> String {
        let mut mac = HmacSha256::new_from_slice(secret).unwrap();
        mac.update(format!("{ts}.").as_bytes());
        mac.update(body);
        format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
    }

    #[test]
    fn verification_table() {
        let c = Channels::new(
            HashMap::from([(
                "hook".to_string(),
                Channel {
                    secret: b"k3y".to_vec(),
                    ..Channel::default()
                },
            )]),
            Duration::from_secs(300),
        );
        let body = br#"{"text":"hi"}"#;
        let now = 1_000_000;
        let good = sign(b"k3y", now, body);
        type Case<'a> = (
            &'a str,
            Option<String>,
            Option<String>,
            &'a [u8],
            Result<String, &'a str>,
        );
        let cases: Vec<Case<'_>> = vec![
            (
                "nope",
                Some(now.to_string()),
                Some(good.clone()),
                body,
                Err("unknown channel"),
            ),
            (
                "hook",
                None,
                Some(good.clone()),
                body,
                Err("missing X-Tiller-Timestamp"),
            ),
            (
                "hook",
                Some((now - 301).to_string()),
                Some(sign(b"k3y", now - 301, body)),
                body,
                Err("timestamp outside the replay window"),
            ),
            (
                "hook",
                Some(i64::MIN.to_string()),
                Some(good.clone()),
                body,
                Err("timestamp outside the replay window"),
            ),
            (
                "hook",
                Some(i64::MAX.to_string()),
                Some(good.clone()),
                body,
                Err("timestamp outside the replay window"),
            ),
            (
                "hook",
                Some(now.to_string()),
                None,
                body,
                Err("missing or malformed X-Tiller-Signature"),
            ),
            (
                "hook",
                Some(now.to_string()),
                Some(sign(b"wrong", now, body)),
                body,
                Err("bad signature"),
            ),
            (
                "hook",
                Some(now.to_string()),
                Some(good.clone()),
                br#"{"text":"tampered"}"#,
                Err("bad signature"),
            ),
            (
                "hook",
                Some(now.to_string()),
                Some(good.clone()),
                body,
                Ok(format!("hook:{}", &good["sha256=".len()..])),
            ),
        ];
        for (channel, ts, sig, b, want) in cases {
            assert_eq!(
                c.verify(channel, ts.as_deref(), sig.as_deref(), b, now),
                want,
                "{channel} {ts:?} {sig:?}"
            );
        }
    }
}
