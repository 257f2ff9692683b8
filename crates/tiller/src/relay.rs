//! `tiller acp`: relays ACP between stdio and a running daemon, one
//! JSON-RPC message per line.
//!
//! It keeps the ids of the editor's requests the daemon has not answered.
//! When the editor closes stdin, the relay waits for those answers, then
//! ends. When the daemon goes away first (killed, restarted, or it closed
//! the connection), every unanswered request gets a JSON-RPC error at once
//! and the relay exits non-zero with a one-line reason on stderr: an editor
//! never waits on an agent that is gone.

use std::collections::HashSet;

use anyhow::Context as _;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// How a relay ended.
pub enum End {
    /// The editor closed stdin and every request was answered.
    Done,
    /// The daemon went away; the reason.
    DaemonGone(String),
}

/// The editor's requests still waiting for the daemon's answer.
#[derive(Default)]
struct Pending(HashSet<String>);

impl Pending {
    /// Notes a message from the editor.
    fn sent_by_editor(&mut self, line: &str) {
        if let Some(id) = request_id(line) {
            self.0.insert(id);
        }
    }

    /// Notes a message from the daemon.
    fn sent_by_daemon(&mut self, line: &str) {
        if let Some(id) = response_id(line) {
            self.0.remove(&id);
        }
    }

    /// The errors that answer every pending request.
    fn fail_all(&mut self, why: &str) -> Vec<String> {
        self.0
            .drain()
            .filter_map(|id| serde_json::from_str::<Value>(&id).ok())
            .map(|id| {
                json!({
                    "jsonrpc": "2.0",
                    "id": id,
                    "error": {
                        "code": -32603,
                        "message": format!("the Tiller daemon went away: {why}"),
                        "data": { "errorKind": "daemon_gone", "retryable": true },
                    },
                })
                .to_string()
            })
            .collect()
    }
}

async fn write_line(out: &mut tokio::io::Stdout, line: &str) -> std::io::Result<()> {
    out.write_all(line.as_bytes()).await?;
    out.write_all(b"\n").await?;
    out.flush().await
}

/// Relays until stdin closes and the daemon has answered, or the daemon
/// hangs up.
pub async fn run(target: &str, token: Option<&str>) -> anyhow::Result<End> {
    if let Some(path) = target.strip_prefix("unix:") {
        let stream = tokio::net::UnixStream::connect(path).await.map_err(|e| {
            anyhow::anyhow!(
                "no daemon answers at unix:{path} ({e}); start one with `tiller serve`, \
                 or run `tiller acp --embedded`"
            )
        })?;
        let (r, mut w) = stream.into_split();
        let mut from_daemon = BufReader::new(r).lines();
        let mut from_editor = BufReader::new(tokio::io::stdin()).lines();
        let mut out = tokio::io::stdout();
        let mut pending = Pending::default();
        let mut editor_open = true;
        loop {
            if !editor_open && pending.0.is_empty() {
                return Ok(End::Done);
            }
            tokio::select! {
                line = from_editor.next_line(), if editor_open => match line.context("reading stdin")? {
                    Some(line) => {
                        pending.sent_by_editor(&line);
                        if let Err(e) = w.write_all(format!("{line}\n").as_bytes()).await {
                            return gone(&mut out, &mut pending, &format!("cannot write to it ({e})")).await;
                        }
                    }
                    None => {
                        editor_open = false;
                        // Half-close: the daemon answers what is in flight.
                        let _ = w.shutdown().await;
                    }
                },
                line = from_daemon.next_line() => match line {
                    Ok(Some(line)) => {
                        pending.sent_by_daemon(&line);
                        write_line(&mut out, &line).await.context("writing stdout")?;
                    }
                    Ok(None) if !editor_open => return Ok(End::Done),
                    Ok(None) => return gone(&mut out, &mut pending, "it closed the connection").await,
                    Err(e) => return gone(&mut out, &mut pending, &e.to_string()).await,
                },
            }
        }
    }
    if target.starts_with("ws://") || target.starts_with("wss://") {
        let mut req = target.into_client_request().context("bad --connect URL")?;
        if let Some(t) = token {
            req.headers_mut().insert(
                "authorization",
                format!("Bearer {t}")
                    .parse()
                    .context("the token is not a valid header value")?,
            );
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await.map_err(|e| {
            anyhow::anyhow!(
                "no daemon answers at {target} ({e}); start one with `tiller serve`, \
                 or run `tiller acp --embedded`"
            )
        })?;
        let (mut sink, mut stream) = ws.split();
        let mut pending = Pending::default();
        let mut lines = BufReader::new(tokio::io::stdin()).lines();
        let mut stdin_open = true;
        let mut out = tokio::io::stdout();
        loop {
            if !stdin_open && pending.0.is_empty() {
                let _ = sink.close().await;
                return Ok(End::Done);
            }
            tokio::select! {
                line = lines.next_line(), if stdin_open => match line.context("reading stdin")? {
                    Some(line) if !line.trim().is_empty() => {
                        pending.sent_by_editor(&line);
                        if let Err(e) = sink.send(Message::Text(line.into())).await {
                            return gone(&mut out, &mut pending, &e.to_string()).await;
                        }
                    }
                    Some(_) => {}
                    None => stdin_open = false,
                },
                msg = stream.next() => match msg {
                    Some(Ok(Message::Text(t))) => {
                        pending.sent_by_daemon(&t);
                        write_line(&mut out, &t).await.context("writing stdout")?;
                    }
                    Some(Ok(Message::Close(_))) | None => {
                        if !stdin_open {
                            return Ok(End::Done);
                        }
                        return gone(&mut out, &mut pending, "it closed the connection").await;
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return gone(&mut out, &mut pending, &e.to_string()).await,
                },
            }
        }
    }
    anyhow::bail!("--connect must be unix:PATH or ws://HOST:PORT/acp, not `{target}`")
}

/// The daemon went away: answer what is pending, then say so.
async fn gone(
    out: &mut tokio::io::Stdout,
    pending: &mut Pending,
    why: &str,
) -> anyhow::Result<End> {
    for line in pending.fail_all(why) {
        let _ = write_line(out, &line).await;
    }
    Ok(End::DaemonGone(why.to_owned()))
}

/// The id of a JSON-RPC request (not a notification or response).
fn request_id(line: &str) -> Option<String> {
    let v: Value = serde_json::from_str(line).ok()?;
    v.get("method")?;
    Some(v.get("id")?.to_string())
}

/// The id of a JSON-RPC response.
fn response_id(text: &str) -> Option<String> {
    let v: Value = serde_json::from_str(text).ok()?;
    if v.get("method").is_some() {
        return None;
    }
    Some(v.get("id")?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_requests_are_failed_with_their_ids() {
        let mut p = Pending::default();
        p.sent_by_editor(r#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#);
        p.sent_by_editor(r#"{"jsonrpc":"2.0","id":"a","method":"session/prompt"}"#);
        p.sent_by_editor(r#"{"jsonrpc":"2.0","method":"session/cancel"}"#);
        // The editor's answer to a daemon request is no request.
        p.sent_by_editor(r#"{"jsonrpc":"2.0","id":"tiller-1","result":{}}"#);
        p.sent_by_daemon(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
        let errors: Vec<Value> = p
            .fail_all("killed")
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0]["id"], "a");
        assert_eq!(errors[0]["error"]["data"]["errorKind"], "daemon_gone");
        assert!(p.0.is_empty());
    }
}
