//! MCP servers a client passed in `session/new` (stdio or streamable
//! HTTP), through the official Rust SDK. Their tools are offered to the
//! model as `<server>__<tool>`.
//!
//! A client only *asks*; the daemon's configuration ([`McpPolicy`])
//! decides. A stdio command runs only when it is in
//! [`McpPolicy::allowed_commands`], with the scrubbed environment of
//! [`ToolsConfig::child_env`] (plus the server's own variables, minus
//! loader and `TILLER_` ones), in its own process group, killed with the
//! group when the server is dropped. An HTTP server is reached only at a
//! destination [`McpPolicy::egress`] allows, through its pinned resolver,
//! without redirects. Results are bounded by
//! [`ToolsConfig::max_output_bytes`].

use std::collections::HashMap;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};

use rmcp::model::{CallToolRequestParams, Tool};
use rmcp::service::RunningService;
use rmcp::transport::{
    ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess,
    streamable_http_client::StreamableHttpClientTransportConfig,
};
use rmcp::{RoleClient, ServiceExt};
use tiller_engine::{ToolKind, ToolOutput, ToolSpec};

use crate::bounded::truncate;
use crate::{ToolsConfig, egress};

/// Which MCP servers clients may use (`[tools.mcp]`).
#[derive(Clone, Debug, PartialEq)]
pub struct McpPolicy {
    /// The commands a stdio server may be started with: bare program
    /// names (`npx`, matched against a bare command, found on the
    /// scrubbed `PATH`), absolute paths (matched exactly) or absolute
    /// path globs (`/opt/mcp/bin/*`, where `*` stays within one
    /// directory). Empty: no stdio server runs.
    pub allowed_commands: Vec<String>,
    /// Where HTTP servers may be.
    pub egress: egress::Policy,
    /// Bound on connecting, initializing and listing the tools.
    pub connect_timeout: Duration,
}

impl Default for McpPolicy {
    fn default() -> Self {
        Self {
            allowed_commands: Vec::new(),
            egress: egress::Policy::default(),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl McpPolicy {
    /// Whether `command` may be started, or why not.
    pub fn check_command(&self, command: &str) -> Result<(), String> {
        let refused = |why: &str| {
            format!(
                "refused: `{command}` {why}; a stdio MCP server must be allowed in tools.mcp.allowed_commands"
            )
        };
        if command.is_empty() {
            return Err(refused("is empty"));
        }
        let path = std::path::Path::new(command);
        if command.contains('/') {
            if !path.is_absolute() {
                return Err(refused(
                    "is a relative path (give a bare name or an absolute path)",
                ));
            }
            if path.components().any(|c| {
                matches!(
                    c,
                    std::path::Component::ParentDir | std::path::Component::CurDir
                )
            }) || command.contains("//")
            {
                return Err(refused("is not a plain absolute path (`.`, `..` or `//`)"));
            }
        }
        let allowed = self.allowed_commands.iter().any(|entry| {
            if !entry.contains('/') {
                // A bare name matches only the same bare name.
                return entry == command;
            }
            if !entry.starts_with('/') || !command.starts_with('/') {
                return false;
            }
            if entry == command {
                return true;
            }
            globset::GlobBuilder::new(entry)
                .literal_separator(true)
                .build()
                .is_ok_and(|g| g.compile_matcher().is_match(command))
        });
        if allowed {
            Ok(())
        } else {
            Err(format!(
                "refused: `{command}` is not in tools.mcp.allowed_commands; add it there to let clients start it"
            ))
        }
    }
}

/// Whether a variable a client set for its stdio server is dropped: the
/// daemon's own (`TILLER_*`), and every variable that makes an allowed
/// program run other code than it was allowed as: the program lookup
/// (`PATH`, `HOME` with its dotfiles), the dynamic loader (`LD_*`,
/// `DYLD_*`), shells (`BASH_ENV`, `ENV`, `IFS`, ...), interpreters and
/// package managers (`NODE_*`, `npm_config_*`, `PYTHON*`, `PERL5*`,
/// `RUBY*`, `UV_*`, `PIP_*`, `CARGO_*`, Go's, `*_OPTIONS`, ...), config
/// homes (`XDG_*`), certificates and proxies, and git (`GIT_*`).
fn dropped_var(name: &str) -> bool {
    const NAMES: &[&str] = &[
        "PATH",
        "HOME",
        "BASH_ENV",
        "ENV",
        "IFS",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "GCONV_PATH",
        "HOSTALIASES",
        "PERLLIB",
        "GEM_HOME",
        "GEM_PATH",
        "PHPRC",
        "PHP_INI_SCAN_DIR",
        "TMPDIR",
        "CURL_CA_BUNDLE",
        "REQUESTS_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "GOFLAGS",
        "GOPROXY",
        "GOPATH",
        "GOROOT",
        "GOBIN",
        "GOENV",
        "GOTOOLCHAIN",
        "GOPRIVATE",
        "GONOSUMDB",
        "GONOSUMCHECK",
        "GOINSECURE",
        "GOSUMDB",
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "CC",
        "CXX",
        "LD",
        "AR",
        "CFLAGS",
        "CXXFLAGS",
        "LDFLAGS",
    ];
    const PREFIXES: &[&str] = &[
        "LD_",
        "DYLD_",
        "TILLER_",
        "NODE_",
        "NPM_CONFIG_",
        "YARN_",
        "PYTHON",
        "PERL5",
        "RUBY",
        "BUNDLE_",
        "GIT_",
        "JAVA_",
        "_JAVA_",
        "DENO_",
        "BUN_",
        "UV_",
        "PIP_",
        "PIPX_",
        "XDG_",
        "CARGO_",
        "RUSTC",
        "RUSTUP_",
        "LUA_",
        "SSL_CERT_",
        "PNPM_",
        "COREPACK_",
        "CONDA",
        "BASH_FUNC_",
        "DOTNET_",
        "CORECLR_",
        "COMPLUS_",
        "CGO_",
        "PYENV",
        "ASDF_",
        "MISE_",
        "GRADLE_",
        "MAVEN_",
        "SDKMAN_",
        "NVM_",
        "VOLTA_",
    ];
    let upper = name.to_ascii_uppercase();
    NAMES.contains(&upper.as_str())
        || PREFIXES.iter().any(|p| upper.starts_with(p))
        || upper.ends_with("_OPTIONS")
        || upper.ends_with("_OPTS")
}

/// How to reach one MCP server (as a client asked; [`McpPolicy`]
/// decides whether it may).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum McpServerConfig {
    /// A child process speaking MCP on stdin/stdout.
    Stdio {
        /// The client's name for the server.
        name: String,
        /// The program: a bare name (looked up on the scrubbed `PATH`) or
        /// an absolute path.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Variables added to the scrubbed environment.
        env: Vec<(String, String)>,
    },
    /// A streamable HTTP server.
    Http {
        /// The client's name for the server.
        name: String,
        /// Its endpoint.
        url: String,
        /// Headers sent with every request (`Authorization` included).
        headers: Vec<(String, String)>,
    },
}

impl McpServerConfig {
    /// The client's name for the server.
    pub fn name(&self) -> &str {
        match self {
            McpServerConfig::Stdio { name, .. } | McpServerConfig::Http { name, .. } => name,
        }
    }
}

/// A connected MCP server and the tools it listed.
pub struct McpServer {
    /// The client's name for it, in messages.
    name: String,
    /// The connection.
    service: RunningService<RoleClient, ()>,
    /// Our name for each tool -> (its own name, spec).
    tools: HashMap<String, (String, ToolSpec)>,
    /// A stdio server's process group, killed on drop (whatever the
    /// server started dies with it).
    group: Option<Pid>,
    /// An HTTP server's URL as configured: shown redacted in errors
    /// (the HTTP client's errors name it whole, query included).
    url: Option<String>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.name)
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// `text` with an HTTP server's `url` in it redacted ([`egress::scrub`]).
fn scrubbed(text: &str, url: Option<&str>) -> String {
    url.map_or_else(|| text.to_owned(), |u| egress::scrub(text, u))
}

/// A tool name as providers accept it: `[A-Za-z0-9_-]`, at most 64 chars.
fn clean(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn kind(tool: &Tool) -> ToolKind {
    match &tool.annotations {
        Some(a) if a.read_only_hint == Some(true) => ToolKind::Read,
        // Anything else, `destructiveHint: false` included (additive:
        // creating an issue, sending a message), is treated like a
        // command: it asks in `ask` and `accept-edits` modes.
        _ => ToolKind::Execute,
    }
}

impl McpServer {
    /// Connects, initializes and lists the server's tools, all within
    /// `tools.mcp.connect_timeout`, if `tools.mcp` allows the server: a
    /// command not allowed is never started, a URL not allowed never
    /// requested.
    pub async fn connect(cfg: &McpServerConfig, tools: &ToolsConfig) -> Result<McpServer, String> {
        let name = cfg.name().to_owned();
        let url = match cfg {
            McpServerConfig::Http { url, .. } => Some(url.clone()),
            McpServerConfig::Stdio { .. } => None,
        };
        let timeout = tools.mcp.connect_timeout;
        let policy = &tools.mcp;
        let mut group = None;
        let fut = async {
            let service = match cfg {
                McpServerConfig::Stdio {
                    command, args, env, ..
                } => {
                    policy.check_command(command)?;
                    let mut extra = Vec::new();
                    for (k, v) in env {
                        if dropped_var(k) {
                            tracing::warn!(server = %name, variable = %k, "dropped an environment variable the client set for an MCP server");
                        } else {
                            extra.push((k.clone(), v.clone()));
                        }
                    }
                    let cmd = tokio::process::Command::new(command).configure(|c| {
                        c.args(args)
                            .env_clear()
                            .envs(tools.child_env.iter().cloned())
                            .envs(extra)
                            .process_group(0)
                            .kill_on_drop(true);
                    });
                    // fork and exec block: not on an async worker.
                    let (transport, _) = tokio::task::spawn_blocking(move || {
                        TokioChildProcess::builder(cmd)
                            .stderr(std::process::Stdio::null())
                            .spawn()
                    })
                    .await
                    .map_err(|e| format!("cannot start `{command}`: {e}"))?
                    .map_err(|e| format!("cannot start `{command}`: {e}"))?;
                    group = transport
                        .id()
                        .and_then(|id| i32::try_from(id).ok())
                        .and_then(Pid::from_raw);
                    ().serve(transport)
                        .await
                        .map_err(|e| format!("initialize failed: {e}"))?
                }
                McpServerConfig::Http { url, headers, .. } => {
                    let checked = policy.egress.check(url)?;
                    if let Some(url::Host::Domain(host)) = checked.host() {
                        // Resolving first gives a clear error; the client
                        // resolves (and filters) again when it connects.
                        policy.egress.resolve(host).await?;
                    }
                    let mut config =
                        StreamableHttpClientTransportConfig::with_uri(checked.as_str());
                    let mut custom = HashMap::new();
                    for (k, v) in headers {
                        if k.eq_ignore_ascii_case("authorization") {
                            let token = v.strip_prefix("Bearer ").unwrap_or(v);
                            config = config.auth_header(token.to_owned());
                        } else {
                            let k = http::HeaderName::try_from(k.as_str())
                                .map_err(|e| format!("bad header name {k}: {e}"))?;
                            let v = http::HeaderValue::try_from(v.as_str())
                                .map_err(|e| format!("bad header value for {k}: {e}"))?;
                            custom.insert(k, v);
                        }
                    }
                    let config = config.custom_headers(custom);
                    let client = policy
                        .egress
                        .client_builder()
                        .connect_timeout(timeout)
                        .build()
                        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
                    let transport = StreamableHttpClientTransport::with_client(client, config);
                    ().serve(transport)
                        .await
                        .map_err(|e| format!("initialize failed at {}: {e}", egress::redact(url)))?
                }
            };
            let listed = service
                .list_all_tools()
                .await
                .map_err(|e| format!("tools/list failed: {e}"))?;
            Ok::<_, String>((service, listed))
        };
        let r = tokio::time::timeout(timeout, fut).await;
        let kill = |group: Option<Pid>| {
            if let Some(g) = group {
                let _ = kill_process_group(g, Signal::KILL);
            }
        };
        let (service, listed) = match r {
            Err(_) => {
                kill(group);
                return Err(format!(
                    "MCP server `{name}` did not answer within {timeout:?}"
                ));
            }
            Ok(Err(e)) => {
                kill(group);
                return Err(format!(
                    "MCP server `{name}`: {}",
                    scrubbed(&e, url.as_deref())
                ));
            }
            Ok(Ok(v)) => v,
        };
        let prefix = clean(&name);
        let tools = listed
            .into_iter()
            .map(|t| {
                let ours: String = format!("{prefix}__{}", clean(&t.name))
                    .chars()
                    .take(64)
                    .collect();
                let spec = ToolSpec {
                    name: ours.clone(),
                    description: t
                        .description
                        .as_deref()
                        .unwrap_or("(no description)")
                        .to_owned(),
                    input_schema: serde_json::Value::Object((*t.input_schema).clone()),
                    kind: kind(&t),
                };
                (ours, (t.name.to_string(), spec))
            })
            .collect();
        Ok(McpServer {
            name,
            service,
            tools,
            group,
            url,
        })
    }

    /// Its tools, as offered to models.
    pub fn specs(&self) -> Vec<ToolSpec> {
        let mut v: Vec<ToolSpec> = self.tools.values().map(|(_, s)| s.clone()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Whether `tool` (our name) is one of its tools.
    pub fn owns(&self, tool: &str) -> bool {
        self.tools.contains_key(tool)
    }

    /// Calls a tool; the result's text blocks become the output.
    pub async fn call(
        &self,
        tool: &str,
        input: &serde_json::Value,
        cfg: &ToolsConfig,
    ) -> ToolOutput {
        let Some((theirs, _)) = self.tools.get(tool) else {
            return ToolOutput {
                ok: false,
                output: format!("unknown tool `{tool}`"),
            };
        };
        let Some(args) = input.as_object() else {
            return ToolOutput {
                ok: false,
                output: format!("the arguments of `{tool}` must be a JSON object"),
            };
        };
        let mut params = CallToolRequestParams::new(theirs.clone());
        params.arguments = Some(args.clone());
        let call = self.service.call_tool(params);
        match tokio::time::timeout(cfg.max_shell_timeout, call).await {
            Err(_) => ToolOutput {
                ok: false,
                output: format!(
                    "MCP server `{}` did not answer within {:?}",
                    self.name, cfg.max_shell_timeout
                ),
            },
            Ok(Err(e)) => ToolOutput {
                ok: false,
                output: truncate(
                    format!(
                        "MCP server `{}`: {}",
                        self.name,
                        scrubbed(&e.to_string(), self.url.as_deref())
                    ),
                    cfg.max_output_bytes,
                ),
            },
            Ok(Ok(r)) => {
                let mut text: Vec<String> = r
                    .content
                    .iter()
                    .filter_map(|c| c.as_text().map(|t| t.text.clone()))
                    .collect();
                if text.is_empty()
                    && let Some(s) = &r.structured_content
                {
                    text.push(s.to_string());
                }
                ToolOutput {
                    ok: !r.is_error.unwrap_or(false),
                    output: truncate(text.join("\n"), cfg.max_output_bytes),
                }
            }
        }
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        // Stops the service, and a stdio server's process group (the
        // server and whatever it started).
        self.service.cancellation_token().cancel();
        if let Some(g) = self.group {
            let _ = kill_process_group(g, Signal::KILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a read-only tool runs unasked: `destructiveHint: false` means
    /// "additive" (it may create an issue, send a message, push a file),
    /// which a hostile document could use unasked.
    #[test]
    fn only_read_only_mcp_tools_run_unasked() {
        let tool = |a: Option<rmcp::model::ToolAnnotations>| {
            let t = Tool::new("t", "d", serde_json::Map::new());
            match a {
                Some(a) => t.annotate(a),
                None => t,
            }
        };
        let annotated = rmcp::model::ToolAnnotations::new();
        assert_eq!(
            kind(&tool(Some(annotated.clone().read_only(true)))),
            ToolKind::Read
        );
        for t in [
            tool(None),
            tool(Some(annotated.clone().destructive(false))),
            tool(Some(annotated.clone().destructive(true))),
            tool(Some(annotated.read_only(false))),
        ] {
            assert_eq!(kind(&t), ToolKind::Execute, "{:?}", t.annotations);
        }
    }

    #[test]
    fn commands_match_only_configured_entries() {
        // (allowed, command, allowed?)
        let cases: &[(&[&str], &str, bool)] = &[
            (&[], "npx", false),
            (&["npx"], "npx", true),
            (&["npx"], "npx2", false),
            (&["npx", "uvx"], "uvx", true),
            // A path is matched only by a path.
            (&["node"], "/usr/bin/node", false),
            (&["/usr/bin/node"], "/usr/bin/node", true),
            (&["/usr/bin/node"], "node", false),
            (&["/opt/mcp/bin/*"], "/opt/mcp/bin/server", true),
            (&["/opt/mcp/bin/*"], "/opt/mcp/bin/sub/server", false),
            (&["/opt/mcp/**"], "/opt/mcp/bin/sub/server", true),
            (&["/opt/mcp/**"], "/opt/mcp/../../bin/sh", false),
            (&["/opt/mcp/bin/*"], "/opt/mcp/bin/./x", false),
            (&["/opt/mcp/bin/*"], "/opt/mcp/bin//x", false),
            (&["bin/server"], "bin/server", false),
            (&["node"], "./node", false),
            (&["*"], "sh", false),
            (&["/*"], "/sh", true),
            (&["node"], "", false),
        ];
        for (allowed, command, ok) in cases {
            let p = McpPolicy {
                allowed_commands: allowed.iter().map(|s| s.to_string()).collect(),
                ..McpPolicy::default()
            };
            match p.check_command(command) {
                Ok(()) => assert!(ok, "{allowed:?} {command} was allowed"),
                Err(e) => {
                    assert!(!ok, "{allowed:?} {command}: {e}");
                    assert!(e.starts_with("refused: "), "{e}");
                }
            }
        }
    }

    #[test]
    fn variables_that_change_what_runs_are_dropped() {
        for (name, dropped) in [
            ("LD_PRELOAD", true),
            ("LD_LIBRARY_PATH", true),
            ("DYLD_INSERT_LIBRARIES", true),
            ("TILLER_SERVER__TOKEN", true),
            // The allowed program must stay the program it was allowed as.
            ("PATH", true),
            ("HOME", true),
            ("NODE_OPTIONS", true),
            ("NODE_ENV", true),
            ("npm_config_script_shell", true),
            ("PYTHONPATH", true),
            ("PYTHONSTARTUP", true),
            ("PERL5OPT", true),
            ("RUBYOPT", true),
            ("BASH_ENV", true),
            ("JAVA_TOOL_OPTIONS", true),
            ("GIT_SSH_COMMAND", true),
            // Package managers' indexes and config homes, toolchains'
            // wrappers, certificates and proxies: another package runs.
            ("UV_DEFAULT_INDEX", true),
            ("UV_INDEX_URL", true),
            ("PIP_INDEX_URL", true),
            ("PIPX_HOME", true),
            ("XDG_CONFIG_HOME", true),
            ("CARGO_HOME", true),
            ("RUSTC_WRAPPER", true),
            ("GOFLAGS", true),
            ("GOPROXY", true),
            ("LUA_INIT", true),
            ("PHPRC", true),
            ("TMPDIR", true),
            ("SSL_CERT_FILE", true),
            ("REQUESTS_CA_BUNDLE", true),
            ("https_proxy", true),
            ("PNPM_HOME", true),
            ("COREPACK_NPM_REGISTRY", true),
            ("CONDA_PREFIX", true),
            ("BASH_FUNC_ls%%", true),
            ("MAVEN_OPTS", true),
            ("GRADLE_OPTS", true),
            ("DOTNET_STARTUP_HOOKS", true),
            ("CORECLR_PROFILER_PATH", true),
            ("RUSTFLAGS", true),
            ("CC", true),
            ("CGO_LDFLAGS", true),
            ("PYENV_VERSION", true),
            ("MISE_CONFIG_FILE", true),
            ("GOOGLE_API_KEY", false),
            ("OLD_PATH", false),
            ("API_KEY", false),
            ("GITHUB_TOKEN", false),
        ] {
            assert_eq!(dropped_var(name), dropped, "{name}");
        }
    }
}
