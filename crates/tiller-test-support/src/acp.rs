//! An ACP client in the same process: it speaks JSON-RPC over the very
//! channels `tiller_acp::serve` reads and writes (the transports only frame
//! them), so the connection's ordering, replay and attachment have Rust
//! tests that need no socket and no Node.

use std::time::Duration;

use serde_json::{Value, json};
use tiller_acp::{AcpConfig, Frame};
use tiller_session::Sessions;
use tokio::sync::mpsc;

/// One client connection. Every message the daemon sends is kept, in
/// order, in [`AcpClient::seen`].
pub struct AcpClient {
    tx: Option<mpsc::Sender<Frame>>,
    rx: mpsc::Receiver<String>,
    next: u64,
    /// Every message received so far, in order.
    pub seen: Vec<Value>,
    /// The connection task.
    task: tokio::task::JoinHandle<()>,
}

/// How long a client waits for what it expects before the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

impl AcpClient {
    /// Connects to `sessions` (as the stdio, socket and WebSocket edges do).
    pub fn connect(sessions: &Sessions) -> AcpClient {
        let (tx, incoming) = mpsc::channel(64);
        let (outgoing, rx) = mpsc::channel(1024);
        let config = AcpConfig {
            max_message_bytes: 1 << 20,
            subscriber_queue: 1024,
            version: "test".into(),
            forward: None,
        };
        let task = tokio::spawn(tiller_acp::serve(
            sessions.clone(),
            config,
            "test",
            incoming,
            outgoing,
        ));
        AcpClient {
            tx: Some(tx),
            rx,
            next: 0,
            seen: Vec::new(),
            task,
        }
    }

    /// Sends a request and waits for its answer: `Ok(result)` or
    /// `Err(error)`. What arrives meanwhile is kept in `seen`.
    pub async fn request(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        let id = self.send_request(method, params).await;
        let answer = self
            .until(|m| m.get("id") == Some(&id) && m.get("method").is_none())
            .await;
        match answer.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(answer["result"].clone()),
        }
    }

    /// Sends a request without waiting; returns its id.
    pub async fn send_request(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = json!(self.next);
        self.send(json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }))
            .await;
        id
    }

    /// Sends a notification.
    pub async fn notify(&mut self, method: &str, params: Value) {
        self.send(json!({ "jsonrpc": "2.0", "method": method, "params": params }))
            .await;
    }

    /// Answers a request the daemon sent (a permission request, say).
    pub async fn respond(&mut self, id: &Value, result: Value) {
        self.send(json!({ "jsonrpc": "2.0", "id": id, "result": result }))
            .await;
    }

    async fn send(&mut self, msg: Value) {
        let tx = self.tx.as_ref().expect("the client has not hung up");
        tx.send(Frame::Text(msg.to_string()))
            .await
            .expect("the connection reads");
    }

    /// Reads until a message matching `pred` arrives (also one already
    /// seen but not yet returned is not looked at again: only new ones).
    pub async fn until(&mut self, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("nothing expected arrived; seen: {:#?}", self.seen))
                .expect("the connection ended");
            let v: Value = serde_json::from_str(&msg).expect("the daemon sends JSON");
            self.seen.push(v.clone());
            if pred(&v) {
                return v;
            }
        }
    }

    /// `initialize`, then `session/new` in `cwd`; returns the session id.
    pub async fn new_session(&mut self, cwd: &str) -> String {
        self.request("initialize", json!({ "protocolVersion": 1 }))
            .await
            .expect("initialize");
        let r = self
            .request("session/new", json!({ "cwd": cwd, "mcpServers": [] }))
            .await
            .expect("session/new");
        r["sessionId"].as_str().expect("a session id").to_owned()
    }

    /// The `session/update` payloads received for `session`, in order.
    pub fn updates(&self, session: &str) -> Vec<Value> {
        self.seen
            .iter()
            .filter(|m| m["method"] == "session/update" && m["params"]["sessionId"] == session)
            .map(|m| m["params"]["update"].clone())
            .collect()
    }

    /// Hangs up (as a client that closes its end) and waits for the
    /// connection to end.
    pub async fn hang_up(mut self) {
        self.tx = None;
        let _ = tokio::time::timeout(PATIENCE, &mut self.task).await;
    }
}

/// The kind (`sessionUpdate`) of each update.
pub fn update_kinds(updates: &[Value]) -> Vec<String> {
    updates
        .iter()
        .map(|u| u["sessionUpdate"].as_str().unwrap_or("?").to_owned())
        .collect()
}
