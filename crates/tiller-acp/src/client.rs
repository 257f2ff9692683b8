//! Requests from the agent to the ACP client: `fs/*` and `terminal/*`,
//! when the client advertised them in `initialize`. The session's tools
//! use them through [`ClientTools`], so the editor's buffers are the truth.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tiller_core::SessionId;
use tiller_tools::{BoxFuture, ClientTools, CommandOutput};
use tokio::sync::{mpsc, oneshot};

use crate::jsonrpc;

/// Bound on a file request; an editor that never answers cannot hold a
/// turn longer than this.
const FS_TIMEOUT: Duration = Duration::from_secs(60);

/// What the client said it can do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientCaps {
    pub read: bool,
    pub write: bool,
    pub terminal: bool,
}

impl ClientCaps {
    /// Reads `clientCapabilities` from `initialize`.
    pub fn from_initialize(params: &Value) -> ClientCaps {
        let c = &params["clientCapabilities"];
        ClientCaps {
            read: c["fs"]["readTextFile"].as_bool().unwrap_or(false),
            write: c["fs"]["writeTextFile"].as_bool().unwrap_or(false),
            terminal: c["terminal"].as_bool().unwrap_or(false),
        }
    }

    fn any(self) -> bool {
        self.read || self.write || self.terminal
    }
}

type Pending = std::sync::Mutex<HashMap<String, oneshot::Sender<Result<Value, Value>>>>;

/// The connection's outstanding requests to its client.
pub struct Calls {
    out: mpsc::Sender<String>,
    pending: Pending,
    next: AtomicU64,
    caps: std::sync::Mutex<ClientCaps>,
}

impl Calls {
    /// `out` carries ready-made messages into the connection's writer.
    pub fn new(out: mpsc::Sender<String>) -> Arc<Calls> {
        Arc::new(Calls {
            out,
            pending: Default::default(),
            next: AtomicU64::new(1),
            caps: Default::default(),
        })
    }

    /// Records the client's capabilities.
    pub fn set_caps(&self, caps: ClientCaps) {
        *self.caps.lock().unwrap_or_else(|e| e.into_inner()) = caps;
    }

    fn caps(&self) -> ClientCaps {
        *self.caps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bridge for one session, if the client offers anything.
    pub fn tools_for(self: &Arc<Calls>, session: SessionId) -> Option<Arc<dyn ClientTools>> {
        self.caps().any().then(|| {
            Arc::new(AcpClientTools {
                calls: self.clone(),
                session,
            }) as Arc<dyn ClientTools>
        })
    }

    /// A response from the client; false when it answers none of ours.
    pub fn answered(&self, id: &Value, result: Result<Value, Value>) -> bool {
        let Some(id) = id.as_str() else { return false };
        let tx = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        match tx {
            Some(tx) => {
                let _ = tx.send(result);
                true
            }
            None => false,
        }
    }

    fn forget(&self, id: &str) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// The connection ended: every outstanding request fails now.
    pub fn close(&self) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    async fn call(&self, method: &str, params: Value, timeout: Duration) -> Result<Value, String> {
        let id = format!("tiller-c{}", self.next.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), tx);
        let gone = || format!("the editor disconnected before answering {method}");
        if self
            .out
            .send(jsonrpc::request(&id, method, params))
            .await
            .is_err()
        {
            self.forget(&id);
            return Err(gone());
        }
        let r = tokio::time::timeout(timeout, rx).await;
        self.forget(&id);
        match r {
            Err(_) => Err(format!(
                "the editor did not answer {method} within {}s",
                timeout.as_secs()
            )),
            Ok(Err(_)) => Err(gone()),
            Ok(Ok(Err(e))) => Err(format!(
                "the editor refused {method}: {}",
                e["message"].as_str().unwrap_or("no message")
            )),
            Ok(Ok(Ok(v))) => Ok(v),
        }
    }
}

/// One session's view of its client.
struct AcpClientTools {
    calls: Arc<Calls>,
    session: SessionId,
}

impl ClientTools for AcpClientTools {
    fn can_read(&self) -> bool {
        self.calls.caps().read
    }

    fn can_write(&self) -> bool {
        self.calls.caps().write
    }

    fn can_terminal(&self) -> bool {
        self.calls.caps().terminal
    }

    fn read_text_file(&self, path: PathBuf) -> BoxFuture<Result<String, String>> {
        let calls = self.calls.clone();
        let params = json!({"sessionId": self.session.to_string(), "path": path});
        Box::pin(async move {
            let v = calls.call("fs/read_text_file", params, FS_TIMEOUT).await?;
            v["content"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| "the editor's fs/read_text_file answer has no content".into())
        })
    }

    fn write_text_file(&self, path: PathBuf, content: String) -> BoxFuture<Result<(), String>> {
        let calls = self.calls.clone();
        let params =
            json!({"sessionId": self.session.to_string(), "path": path, "content": content});
        Box::pin(async move {
            calls
                .call("fs/write_text_file", params, FS_TIMEOUT)
                .await
                .map(drop)
        })
    }

    fn run_command(
        &self,
        command: String,
        cwd: PathBuf,
        timeout: Duration,
    ) -> BoxFuture<Result<CommandOutput, String>> {
        let calls = self.calls.clone();
        let session = self.session.to_string();
        Box::pin(async move {
            let created = calls
                .call(
                    "terminal/create",
                    json!({
                        "sessionId": session,
                        "command": "sh",
                        "args": ["-c", command],
                        "cwd": cwd,
                        "outputByteLimit": 256 * 1024,
                    }),
                    FS_TIMEOUT,
                )
                .await?;
            let terminal = created["terminalId"]
                .as_str()
                .ok_or("the editor's terminal/create answer has no terminalId")?
                .to_owned();
            let ids = json!({"sessionId": session, "terminalId": terminal});
            let waited = calls
                .call("terminal/wait_for_exit", ids.clone(), timeout)
                .await;
            let timed_out = waited.is_err();
            if timed_out {
                let _ = calls.call("terminal/kill", ids.clone(), FS_TIMEOUT).await;
            }
            let out = calls.call("terminal/output", ids.clone(), FS_TIMEOUT).await;
            let _ = calls.call("terminal/release", ids, FS_TIMEOUT).await;
            let out = out?;
            let status = match &waited {
                Ok(w) if !w["exitCode"].is_null() || !w["signal"].is_null() => w.clone(),
                _ => out["exitStatus"].clone(),
            };
            Ok(CommandOutput {
                output: out["output"].as_str().unwrap_or_default().to_owned(),
                exit_code: status["exitCode"].as_i64().map(|c| c as i32),
                timed_out,
            })
        })
    }
}
