//! The WebSocket client a node hands ACP connections over with (see
//! `tiller_acp::splice`): one ACP connection to the node serving a
//! session, authenticated with the cluster's token.

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use tiller_acp::splice::{Forwarder, Pipe};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

/// How long connecting to another node may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);

/// Connects to `<address>/acp` (the address a node advertises) with the
/// token every node of the cluster shares.
pub fn forwarder(token: Option<String>) -> Forwarder {
    Forwarder(Arc::new(move |address: String| {
        let token = token.clone();
        Box::pin(async move { connect(&address, token.as_deref()).await })
    }))
}

async fn connect(address: &str, token: Option<&str>) -> Result<Pipe, String> {
    let base = address.trim_end_matches('/');
    let url = match (base.strip_prefix("http://"), base.strip_prefix("https://")) {
        (Some(rest), _) => format!("ws://{rest}/acp"),
        (_, Some(rest)) => format!("wss://{rest}/acp"),
        _ => return Err(format!("`{address}` is not an http:// or https:// address")),
    };
    let mut req = url.into_client_request().map_err(|e| e.to_string())?;
    // Handed over once, never on again.
    req.headers_mut().insert(
        tiller_http::forward::FORWARDED,
        tokio_tungstenite::tungstenite::http::HeaderValue::from_static("1"),
    );
    if let Some(t) = token {
        let value = format!("Bearer {t}")
            .parse()
            .map_err(|_| "the token cannot be sent in a header".to_owned())?;
        req.headers_mut().insert("authorization", value);
    }
    let (ws, _) = tokio::time::timeout(CONNECT_WITHIN, tokio_tungstenite::connect_async(req))
        .await
        .map_err(|_| format!("no connection in {} s", CONNECT_WITHIN.as_secs()))?
        .map_err(|e| e.to_string())?;
    let (mut sink, mut stream) = ws.split();
    let (up_tx, mut up_rx) = mpsc::channel::<String>(64);
    let (down_tx, down_rx) = mpsc::channel::<String>(256);
    tokio::spawn(async move {
        while let Some(m) = up_rx.recv().await {
            if sink.send(Message::Text(m.into())).await.is_err() {
                return;
            }
        }
        let _ = sink.close().await;
    });
    tokio::spawn(async move {
        while let Some(Ok(m)) = stream.next().await {
            match m {
                Message::Text(t) if down_tx.send(t.to_string()).await.is_err() => return,
                Message::Close(_) => return,
                _ => {}
            }
        }
    });
    Ok((up_tx, down_rx))
}
