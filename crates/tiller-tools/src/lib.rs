//! Tool execution: the built-in file and shell tools, confined to a
//! session's directory (or carried out by the ACP client when it offers
//! `fs` or `terminal`), and tools of MCP servers.
//!
//! The session's pipeline decides *whether* a call runs (loop guard, then
//! permission); this crate only runs it.

pub mod bounded;
pub mod egress;
mod local;
pub mod mcp;
mod supervise;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tiller_engine::{ToolCall, ToolOutput, ToolSpec};

pub use local::{builtin_specs, resolve};
pub use mcp::{McpServer, McpServerConfig};
pub use supervise::{SUPERVISE_ARG, supervise};

/// A boxed future, for the client bridge's object-safe methods.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a command printed and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandOutput {
    /// Combined output (possibly truncated).
    pub output: String,
    /// The exit code; `None` when killed by a signal or the timeout.
    pub exit_code: Option<i32>,
    /// The command ran past its timeout and was killed.
    pub timed_out: bool,
}

/// The file-system and terminal methods of an ACP client, when it
/// advertised them. The editor's view (unsaved buffers included) is the
/// truth, so these win over the local file system.
pub trait ClientTools: Send + Sync {
    /// `fs.readTextFile` was advertised.
    fn can_read(&self) -> bool;
    /// `fs.writeTextFile` was advertised.
    fn can_write(&self) -> bool;
    /// `terminal` was advertised.
    fn can_terminal(&self) -> bool;
    /// `fs/read_text_file`.
    fn read_text_file(&self, path: PathBuf) -> BoxFuture<Result<String, String>>;
    /// `fs/write_text_file`.
    fn write_text_file(&self, path: PathBuf, content: String) -> BoxFuture<Result<(), String>>;
    /// `terminal/create`, wait for exit (or kill at the timeout), output,
    /// release.
    fn run_command(
        &self,
        command: String,
        cwd: PathBuf,
        timeout: Duration,
    ) -> BoxFuture<Result<CommandOutput, String>>;
}

/// Settings of the built-in tools (`[tools]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolsConfig {
    /// Default bound on a `shell` call.
    pub shell_timeout: Duration,
    /// Longest bound a call may ask for.
    pub max_shell_timeout: Duration,
    /// Largest output handed back to the model (bytes).
    pub max_output_bytes: usize,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        Self {
            shell_timeout: Duration::from_secs(120),
            max_shell_timeout: Duration::from_secs(300),
            max_output_bytes: 64 * 1024,
        }
    }
}

/// A session's tools: the built-ins rooted at its directory, and its MCP
/// servers.
#[derive(Clone)]
pub struct Toolbox {
    root: PathBuf,
    config: Arc<ToolsConfig>,
    mcp: Vec<Arc<McpServer>>,
}

impl Toolbox {
    /// Tools rooted at `root` (the session's cwd).
    pub fn new(root: PathBuf, config: Arc<ToolsConfig>) -> Self {
        Self {
            root,
            config,
            mcp: Vec::new(),
        }
    }

    /// Adds the tools of connected MCP servers.
    pub fn with_mcp(mut self, servers: Vec<Arc<McpServer>>) -> Self {
        self.mcp = servers;
        self
    }

    /// The session's directory.
    pub fn root(&self) -> &PathBuf {
        &self.root
    }

    /// Every tool a model may call.
    pub fn specs(&self) -> Vec<ToolSpec> {
        let mut specs = builtin_specs();
        for s in &self.mcp {
            specs.extend(s.specs());
        }
        specs
    }

    /// The absolute paths a built-in call works on, when it names one
    /// inside the session's directory (for editors to follow along).
    pub fn locations(&self, name: &str, input: &serde_json::Value) -> Vec<String> {
        let is_builtin = matches!(
            name,
            "read_file" | "write_file" | "edit" | "list_dir" | "glob" | "grep"
        );
        match input.get("path").and_then(serde_json::Value::as_str) {
            Some(p) if is_builtin => resolve(&self.root, p)
                .map(|p| vec![p.display().to_string()])
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// Runs one call. Never panics on bad input: every failure is an
    /// output with `ok: false` the model can read.
    pub async fn run(&self, call: &ToolCall, client: Option<Arc<dyn ClientTools>>) -> ToolOutput {
        if let Some(server) = self.mcp.iter().find(|m| m.owns(&call.name)) {
            return server.call(&call.name, &call.input, &self.config).await;
        }
        local::run(&self.root, &self.config, call, client).await
    }
}
