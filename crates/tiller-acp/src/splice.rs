//! Any node answers any ACP client: when a connection's first use of a
//! session names one another node of the cluster serves, the connection
//! is handed to that node. This node opens an ACP connection to the owner
//! (`Forwarder`: the daemon's WebSocket client), repeats the client's
//! `initialize` there (its answer was already given here, the same
//! agent's), sends the request, and from then on passes every message
//! both ways unchanged: the client sees exactly what it would on the
//! owner, permission requests and streams included.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::conn::Frame;
use crate::jsonrpc::{self, RpcError, code};

/// Messages to the owner, and the owner's messages, one JSON-RPC message
/// per item; the connection ends when either side is dropped.
pub type Pipe = (mpsc::Sender<String>, mpsc::Receiver<String>);

/// Opens an ACP connection to the node at an address (`http://host:port`).
#[derive(Clone)]
pub struct Forwarder(
    pub Arc<dyn Fn(String) -> BoxFuture<'static, Result<Pipe, String>> + Send + Sync>,
);

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Forwarder")
    }
}

/// A request to hand the connection over.
pub(crate) struct Handover {
    /// The owner.
    pub node: String,
    pub address: String,
    /// The request that named the session, and its text.
    pub id: Value,
    pub request: String,
}

/// The id of the repeated `initialize` (its answer is not the client's).
const INIT_ID: &str = "tiller-handover-initialize";

/// After the client stopped sending, how long the owner may stay silent
/// before the connection ends.
const QUIET: Duration = Duration::from_secs(10);

/// How long the owner may take to answer the repeated `initialize`.
const INIT_WITHIN: Duration = Duration::from_secs(5);

/// Hands the connection over and passes messages until either side ends.
/// `Err` (nothing was sent to the owner but its `initialize`): the caller
/// answers the request itself.
pub(crate) async fn run(
    forward: &Forwarder,
    handover: &Handover,
    initialize: Option<Value>,
    incoming: &mut mpsc::Receiver<Frame>,
    outgoing: &mpsc::Sender<String>,
) -> Result<(), String> {
    let (up, mut down) = (forward.0)(handover.address.clone()).await?;
    let params = initialize.unwrap_or_else(|| json!({ "protocolVersion": 1 }));
    let init = json!({ "jsonrpc": "2.0", "id": INIT_ID, "method": "initialize", "params": params });
    up.send(init.to_string())
        .await
        .map_err(|_| "the owner closed the connection".to_owned())?;
    let answered = tokio::time::timeout(INIT_WITHIN, async {
        while let Some(m) = down.recv().await {
            let v: Value = serde_json::from_str(&m).unwrap_or(Value::Null);
            if v["id"] == json!(INIT_ID) {
                return match v.get("error") {
                    Some(e) => Err(format!("the owner refused initialize: {e}")),
                    None => Ok(()),
                };
            }
        }
        Err("the owner closed the connection".to_owned())
    })
    .await;
    match answered {
        Ok(r) => r?,
        Err(_) => return Err(format!("no answer in {} s", INIT_WITHIN.as_secs())),
    }
    tracing::debug!(node = %handover.node, "ACP connection handed to the session's node");
    if up.send(handover.request.clone()).await.is_err() {
        return Ok(());
    }
    // Once the client stops sending, the owner's answers to what is in
    // flight still come back (until it is quiet for a while).
    let mut input_open = true;
    loop {
        tokio::select! {
            frame = incoming.recv(), if input_open => match frame {
                Some(Frame::Text(t)) => {
                    if up.send(t).await.is_err() {
                        break;
                    }
                }
                Some(Frame::TooLarge(n)) => {
                    let e = RpcError::new(
                        code::INVALID_REQUEST,
                        format!("message of {n} bytes is over the limit"),
                    );
                    if outgoing.send(jsonrpc::error(&Value::Null, &e)).await.is_err() {
                        break;
                    }
                }
                None => input_open = false,
            },
            () = tokio::time::sleep(QUIET), if !input_open => break,
            msg = down.recv() => match msg {
                Some(m) => {
                    if outgoing.send(m).await.is_err() {
                        break;
                    }
                }
                None => break,
            },
        }
    }
    Ok(())
}
