//! `tiller acp`: relays ACP between stdio and a running daemon.

use anyhow::Context as _;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// Relays until stdin closes or the daemon hangs up.
pub async fn run(target: &str, token: Option<&str>) -> anyhow::Result<()> {
    if let Some(path) = target.strip_prefix("unix:") {
        let stream = tokio::net::UnixStream::connect(path).await.map_err(|e| {
            anyhow::anyhow!(
                "no daemon answers at unix:{path} ({e}); start one with `tiller serve`, \
                 or run `tiller acp --embedded`"
            )
        })?;
        let (mut r, mut w) = stream.into_split();
        let up = async {
            tokio::io::copy(&mut tokio::io::stdin(), &mut w).await?;
            // Half-close: the daemon answers what is in flight, then hangs up.
            w.shutdown().await
        };
        let down = async {
            let mut out = tokio::io::stdout();
            tokio::io::copy(&mut r, &mut out).await?;
            out.flush().await
        };
        tokio::pin!(down);
        tokio::select! {
            r = up => {
                r.context("relaying stdin")?;
                down.await.context("relaying to stdout")?;
            }
            r = &mut down => r.context("relaying to stdout")?,
        }
        return Ok(());
    }
    if target.starts_with("ws://") || target.starts_with("wss://") {
        let mut req = target.into_client_request().context("bad --connect URL")?;
        if let Some(t) = token {
            req.headers_mut().insert(
                "authorization",
                format!("Bearer {t}").parse().context("bad --token")?,
            );
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await.map_err(|e| {
            anyhow::anyhow!(
                "no daemon answers at {target} ({e}); start one with `tiller serve`, \
                 or run `tiller acp --embedded`"
            )
        })?;
        let (mut sink, mut stream) = ws.split();
        // Requests sent and not yet answered: after stdin ends the relay
        // waits for their answers before closing the WebSocket.
        let mut pending = std::collections::HashSet::new();
        let mut lines = BufReader::new(tokio::io::stdin()).lines();
        let mut stdin_open = true;
        let mut out = tokio::io::stdout();
        loop {
            if !stdin_open && pending.is_empty() {
                let _ = sink.close().await;
                return Ok(());
            }
            tokio::select! {
                line = lines.next_line(), if stdin_open => match line? {
                    Some(line) if !line.trim().is_empty() => {
                        if let Some(id) = request_id(&line) {
                            pending.insert(id);
                        }
                        sink.send(Message::Text(line.into())).await?;
                    }
                    Some(_) => {}
                    None => stdin_open = false,
                },
                msg = stream.next() => match msg.transpose()? {
                    Some(Message::Text(t)) => {
                        if let Some(id) = response_id(&t) {
                            pending.remove(&id);
                        }
                        out.write_all(t.as_bytes()).await?;
                        out.write_all(b"\n").await?;
                        out.flush().await?;
                    }
                    Some(Message::Close(_)) | None => return Ok(()),
                    Some(_) => {}
                },
            }
        }
    }
    anyhow::bail!("--connect must be unix:PATH or ws://HOST:PORT/acp, not `{target}`")
}

/// The id of a JSON-RPC request (not a notification or response).
fn request_id(line: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    v.get("method")?;
    Some(v.get("id")?.to_string())
}

/// The id of a JSON-RPC response.
fn response_id(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    if v.get("method").is_some() {
        return None;
    }
    Some(v.get("id")?.to_string())
}
