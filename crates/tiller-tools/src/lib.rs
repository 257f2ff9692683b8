//! Tool execution: the built-in file and shell tools, confined to a
//! session's directory (or carried out by the ACP client when it offers
//! `fs` or `terminal`), and tools of MCP servers.
//!
//! The session's pipeline decides *whether* a call runs (loop guard, then
//! permission); this crate only runs it. What it guarantees:
//!
//! - **Confinement by construction.** The file tools open everything
//!   through a directory handle on the session's directory
//!   (`cap_std::fs::Dir`): no `..`, absolute path or symbolic link
//!   (dangling or not) leads out of it, and there is no window between a
//!   check and an open. Absolute paths are accepted only inside the
//!   directory; [`resolve`] is the lexical helper for showing paths.
//! - **Regular files only.** FIFOs, sockets, devices and files on procfs
//!   or sysfs are refused at once (a FIFO never blocks a call).
//! - **Bounded memory.** Every output is streamed into a buffer of
//!   [`ToolsConfig::max_output_bytes`] ([`bounded::OutputBuffer`]); what
//!   was cut is counted and said.
//! - **Scrubbed environment.** Every child (`shell`, MCP stdio servers)
//!   starts with exactly [`ToolsConfig::child_env`], never the daemon's
//!   environment (API keys, `TILLER_*` secrets).
//! - **Whole process trees die.** With [`ToolsConfig::supervisor`] set, a
//!   command runs under [`supervise`], which kills everything the command
//!   started (`setsid` included) when it ends, times out or is cancelled.
//! - **Spawning is configured, never requested.** An MCP stdio server
//!   runs only if its command is in [`McpPolicy::allowed_commands`]; an
//!   HTTP server only at a destination [`egress::Policy`] allows.

pub mod bounded;
pub mod egress;
mod local;
pub mod mcp;
mod shell;
mod supervise;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tiller_engine::{ToolCall, ToolOutput, ToolSpec};

pub use local::{
    builtin_specs, in_git_dir, lands_in_git_dir, lands_within, protect, resolve, todo_entries,
};
pub use mcp::{McpPolicy, McpServer, McpServerConfig};
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
#[derive(Clone, PartialEq)]
pub struct ToolsConfig {
    /// Default bound on a `shell` call.
    pub shell_timeout: Duration,
    /// Longest bound a call may ask for.
    pub max_shell_timeout: Duration,
    /// Largest output handed back to the model (bytes): also the bound of
    /// every buffer a tool fills.
    pub max_output_bytes: usize,
    /// The complete environment of every child (`shell`, MCP stdio
    /// servers), which start from an empty one: the daemon's own holds
    /// secrets. Build it with [`child_env`].
    pub child_env: Vec<(String, String)>,
    /// The binary to run commands under, as `<path> __supervise -- sh -c
    /// CMD` (see [`supervise`]), so that everything a command starts dies
    /// with it. `None`: `sh` runs in its own process group, which a
    /// `setsid` inside the command escapes.
    pub supervisor: Option<PathBuf>,
    /// Where `web_fetch` may read; empty (the default): it is not offered.
    pub web_fetch: egress::Policy,
    /// Which MCP servers may be started or reached.
    pub mcp: McpPolicy,
}

impl std::fmt::Debug for ToolsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: a variable passed on may hold a secret.
        let env: Vec<&str> = self.child_env.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ToolsConfig")
            .field("shell_timeout", &self.shell_timeout)
            .field("max_shell_timeout", &self.max_shell_timeout)
            .field("max_output_bytes", &self.max_output_bytes)
            .field("child_env", &env)
            .field("supervisor", &self.supervisor)
            .field("web_fetch", &self.web_fetch)
            .field("mcp", &self.mcp)
            .finish()
    }
}

impl Default for ToolsConfig {
    fn default() -> Self {
        Self {
            shell_timeout: Duration::from_secs(120),
            max_shell_timeout: Duration::from_secs(300),
            max_output_bytes: 64 * 1024,
            child_env: child_env(
                std::env::vars_os()
                    .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
                &[],
                &[],
            ),
            supervisor: None,
            web_fetch: egress::Policy::default(),
            mcp: McpPolicy::default(),
        }
    }
}

use tiller_engine::BASE_ENV;

/// The environment for children, from `vars` (usually
/// `std::env::vars()`): only `PATH`, `HOME`, `LANG`, `TERM` and the names
/// in `pass_env`; never a name in `deny`, nor any name starting with
/// `TILLER_` (the daemon's own settings and secrets), even when listed in
/// `pass_env`.
pub fn child_env(
    vars: impl IntoIterator<Item = (String, String)>,
    pass_env: &[String],
    deny: &[String],
) -> Vec<(String, String)> {
    vars.into_iter()
        .filter(|(k, _)| {
            (BASE_ENV.contains(&k.as_str()) || pass_env.contains(k))
                && !deny.contains(k)
                && !k.starts_with("TILLER_")
        })
        .collect()
}

/// Largest file whose whole text a permission request shows.
const MAX_DIFF_BYTES: u64 = 256 * 1024;

/// A file change as a person reviews it: `old_text` is `None` for a file
/// that does not exist yet.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileDiff {
    /// Absolute path.
    pub path: String,
    /// The text replaced (the whole file for `write_file`).
    pub old_text: Option<String>,
    /// The text after the change.
    pub new_text: String,
}

/// A session's tools: the built-ins rooted at its directory, and its MCP
/// servers.
#[derive(Clone)]
pub struct Toolbox {
    root: PathBuf,
    /// More roots the file tools may use (ACP `additionalDirectories`),
    /// canonical; a path names one by being absolute and inside it.
    /// `None` when there are none (most sessions: no allocation).
    roots: Option<Arc<[PathBuf]>>,
    config: Arc<ToolsConfig>,
    mcp: Vec<Arc<McpServer>>,
    /// Background commands, made at the first.
    jobs: std::sync::OnceLock<Arc<shell::Jobs>>,
}

impl Toolbox {
    /// Tools rooted at `root` (the session's cwd).
    pub fn new(root: PathBuf, config: Arc<ToolsConfig>) -> Self {
        Self {
            root,
            roots: None,
            config,
            mcp: Vec::new(),
            jobs: std::sync::OnceLock::new(),
        }
    }

    /// Widens the file tools to `roots` besides the session's directory
    /// (each is confined like it). Relative paths stay in the directory.
    pub fn with_roots(mut self, roots: Vec<PathBuf>) -> Self {
        self.roots = (!roots.is_empty()).then(|| roots.into());
        self
    }

    /// The additional roots.
    pub fn roots(&self) -> &[PathBuf] {
        self.roots.as_deref().unwrap_or_default()
    }

    /// The root a call of tool `name` works in: the additional root an
    /// absolute `path` (a shell's `cwd`, and only that: an "always" rule
    /// is weighed by it) lies in, else the session's directory.
    fn root_for(&self, name: &str, input: &serde_json::Value) -> &PathBuf {
        let given = if name == "shell" {
            input.get("cwd")
        } else {
            input.get("path").or_else(|| input.get("cwd"))
        };
        let Some(p) = given.and_then(serde_json::Value::as_str) else {
            return &self.root;
        };
        if self.roots().is_empty()
            || !std::path::Path::new(p).is_absolute()
            || resolve(&self.root, p).is_ok()
        {
            return &self.root;
        }
        self.roots()
            .iter()
            .find(|r| resolve(r, p).is_ok())
            .unwrap_or(&self.root)
    }

    /// Adds the tools of connected MCP servers.
    pub fn with_mcp(mut self, servers: Vec<Arc<McpServer>>) -> Self {
        self.mcp = servers;
        self
    }

    /// Whether MCP servers are connected (they live only in this process).
    pub fn has_mcp(&self) -> bool {
        !self.mcp.is_empty()
    }

    /// Whether background commands were started: they (and their output)
    /// live only in this process and die with these tools.
    pub fn has_jobs(&self) -> bool {
        self.jobs.get().is_some_and(|j| !j.is_empty())
    }

    /// The session's directory.
    pub fn root(&self) -> &PathBuf {
        &self.root
    }

    /// Every tool a model may call (the built-ins are built once).
    pub fn specs(&self) -> Arc<Vec<ToolSpec>> {
        static BUILTIN: std::sync::LazyLock<Arc<Vec<ToolSpec>>> =
            std::sync::LazyLock::new(|| Arc::new(builtin_specs()));
        let fetch = !self.config.web_fetch.is_empty();
        if self.mcp.is_empty() && !fetch {
            return BUILTIN.clone();
        }
        let mut specs = BUILTIN.as_ref().clone();
        if fetch {
            specs.push(local::web_fetch_spec());
        }
        for s in &self.mcp {
            specs.extend(s.specs());
        }
        Arc::new(specs)
    }

    /// The absolute paths a built-in call works on, when it names one
    /// inside the session's directory (for editors to follow along).
    pub fn locations(&self, name: &str, input: &serde_json::Value) -> Vec<String> {
        let is_builtin = matches!(
            name,
            "read_file" | "write_file" | "edit" | "list_dir" | "glob" | "grep"
        );
        match input.get("path").and_then(serde_json::Value::as_str) {
            Some(p) if is_builtin => resolve(self.root_for(name, input), p)
                .map(|p| vec![p.display().to_string()])
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// The change a built-in edit would make, for a person to see before
    /// allowing it: `edit` shows the text it replaces, `write_file` the
    /// file as it is now (none for a new file; a line saying a file is
    /// there when its text is not shown). Read confined, bounded.
    pub fn diff(&self, name: &str, input: &serde_json::Value) -> Option<FileDiff> {
        let arg = |k: &str| input.get(k).and_then(serde_json::Value::as_str);
        if name == "apply_patch" {
            return local::patch_diff(&self.root, arg("patch")?, MAX_DIFF_BYTES);
        }
        let path = arg("path")?;
        let root = self.root_for(name, input);
        let shown = resolve(root, path).ok()?.display().to_string();
        match name {
            // Several replacements: the file before and after.
            "edit" if input.get("edits").is_some() => {
                let (old_text, new_text) = local::edited(root, path, input, MAX_DIFF_BYTES)?;
                Some(FileDiff {
                    path: shown,
                    old_text: Some(old_text),
                    new_text,
                })
            }
            "edit" => Some(FileDiff {
                path: shown,
                old_text: Some(arg("old_string")?.to_owned()),
                new_text: arg("new_string")?.to_owned(),
            }),
            "write_file" => {
                let new_text = arg("content")?;
                if new_text.len() as u64 > MAX_DIFF_BYTES {
                    return None;
                }
                Some(FileDiff {
                    path: shown,
                    old_text: local::replaced_text(root, path, MAX_DIFF_BYTES),
                    new_text: new_text.to_owned(),
                })
            }
            _ => None,
        }
    }

    /// A file's whole text for an agent that edits it (ACP
    /// `fs/read_text_file`): confined to the roots like every file tool,
    /// through the editor when it offers reads, never cut (refused past
    /// `max` bytes).
    pub async fn read_whole(
        &self,
        path: &str,
        max: u64,
        client: Option<Arc<dyn ClientTools>>,
    ) -> Result<String, String> {
        let root = self.root_for("read_file", &serde_json::json!({ "path": path }));
        local::whole_text(root, path, max, client).await
    }

    /// Runs one call. Never panics on bad input: every failure is an
    /// output with `ok: false` the model can read.
    pub async fn run(&self, call: &ToolCall, client: Option<Arc<dyn ClientTools>>) -> ToolOutput {
        if let Some(server) = self.mcp.iter().find(|m| m.owns(&call.name)) {
            return server.call(&call.name, &call.input, &self.config).await;
        }
        let background = call.name == "shell"
            && call
                .input
                .get("background")
                .and_then(serde_json::Value::as_bool)
                == Some(true);
        if background || call.name == "shell_output" {
            return self.background(call).await;
        }
        local::run(
            self.root_for(&call.name, &call.input),
            &self.config,
            call,
            client,
        )
        .await
    }

    /// `shell` with `background: true` (always local: an editor's terminal
    /// is for commands the turn waits for) and `shell_output`.
    async fn background(&self, call: &ToolCall) -> ToolOutput {
        let jobs = self.jobs.get_or_init(Arc::default);
        let input = &call.input;
        let r = if call.name == "shell_output" {
            match input.get("id").and_then(serde_json::Value::as_u64) {
                Some(id) => jobs.output(
                    id,
                    input.get("stop").and_then(serde_json::Value::as_bool) == Some(true),
                ),
                None => Err("missing integer argument `id`".into()),
            }
        } else {
            match input.get("command").and_then(serde_json::Value::as_str) {
                None => Err("missing string argument `command`".into()),
                Some(command) => match local::shell_cwd(self.root_for("shell", input), input).await
                {
                    Ok(cwd) => jobs.start(command, &cwd, &self.config).await,
                    Err(e) => Err(e),
                },
            }
        };
        let max = self.config.max_output_bytes + 256;
        match r {
            Ok(out) => ToolOutput {
                ok: true,
                output: bounded::truncate(out, max),
            },
            Err(e) => ToolOutput {
                ok: false,
                output: bounded::truncate(e, max),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_env_keeps_only_what_is_allowed() {
        let vars = || {
            [
                ("PATH", "/usr/bin"),
                ("HOME", "/home/t"),
                ("LANG", "C.UTF-8"),
                ("TERM", "xterm"),
                ("LC_ALL", "C"),
                ("OPENAI_API_KEY", "sk-secret"),
                ("TILLER_SERVER__TOKEN", "tok"),
                ("TILLER_PATH", "x"),
                ("GITHUB_TOKEN", "gh"),
                ("EDITOR", "vi"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        };
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // (pass_env, deny, the names kept)
        let cases: &[(&[&str], &[&str], &[&str])] = &[
            (&[], &[], &["PATH", "HOME", "LANG", "TERM"]),
            (
                &["EDITOR"],
                &[],
                &["PATH", "HOME", "LANG", "TERM", "EDITOR"],
            ),
            (
                &["TILLER_SERVER__TOKEN", "TILLER_PATH"],
                &[],
                &["PATH", "HOME", "LANG", "TERM"],
            ),
            (&["EDITOR"], &["EDITOR", "HOME"], &["PATH", "LANG", "TERM"]),
            (&["MISSING"], &[], &["PATH", "HOME", "LANG", "TERM"]),
        ];
        for (pass, deny, want) in cases {
            let got: Vec<String> = child_env(vars(), &s(pass), &s(deny))
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            assert_eq!(got, s(want), "pass {pass:?} deny {deny:?}");
        }
    }

    #[test]
    fn debug_shows_variable_names_not_values() {
        let cfg = ToolsConfig {
            child_env: vec![("GITHUB_TOKEN".into(), "gh-secret".into())],
            ..ToolsConfig::default()
        };
        let shown = format!("{cfg:?}");
        assert!(
            shown.contains("GITHUB_TOKEN") && !shown.contains("gh-secret"),
            "{shown}"
        );
    }
}
