//! MCP servers a client passed in `session/new` (stdio or streamable
//! HTTP), through the official Rust SDK. Their tools are offered to the
//! model as `<server>__<tool>`.

use std::collections::HashMap;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, Tool};
use rmcp::service::RunningService;
use rmcp::transport::{
    ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess,
    streamable_http_client::StreamableHttpClientTransportConfig,
};
use rmcp::{RoleClient, ServiceExt};
use tiller_engine::{ToolKind, ToolOutput, ToolSpec};

use crate::ToolsConfig;

/// How to reach one MCP server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum McpServerConfig {
    Stdio {
        name: String,
        command: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    Http {
        name: String,
        url: String,
        headers: Vec<(String, String)>,
    },
}

impl McpServerConfig {
    pub fn name(&self) -> &str {
        match self {
            McpServerConfig::Stdio { name, .. } | McpServerConfig::Http { name, .. } => name,
        }
    }
}

/// A connected MCP server and the tools it listed.
pub struct McpServer {
    name: String,
    service: RunningService<RoleClient, ()>,
    /// Our name for each tool -> (its own name, spec).
    tools: HashMap<String, (String, ToolSpec)>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.name)
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .finish()
    }
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
        Some(a) if a.destructive_hint == Some(false) => ToolKind::Other,
        // Unknown effects are treated like a command: they ask in `ask`
        // and `accept-edits` modes.
        _ => ToolKind::Execute,
    }
}

impl McpServer {
    /// Connects, initializes and lists the server's tools, all within
    /// `timeout`.
    pub async fn connect(cfg: &McpServerConfig, timeout: Duration) -> Result<McpServer, String> {
        let name = cfg.name().to_owned();
        let fut = async {
            let service = match cfg {
                McpServerConfig::Stdio {
                    command, args, env, ..
                } => {
                    let cmd = tokio::process::Command::new(command).configure(|c| {
                        c.args(args);
                        for (k, v) in env {
                            c.env(k, v);
                        }
                        c.stderr(std::process::Stdio::null());
                    });
                    let transport = TokioChildProcess::new(cmd)
                        .map_err(|e| format!("cannot start `{command}`: {e}"))?;
                    ().serve(transport)
                        .await
                        .map_err(|e| format!("initialize failed: {e}"))?
                }
                McpServerConfig::Http { url, headers, .. } => {
                    let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
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
                    let transport =
                        StreamableHttpClientTransport::with_client(reqwest::Client::new(), config);
                    ().serve(transport)
                        .await
                        .map_err(|e| format!("initialize failed: {e}"))?
                }
            };
            let listed = service
                .list_all_tools()
                .await
                .map_err(|e| format!("tools/list failed: {e}"))?;
            Ok::<_, String>((service, listed))
        };
        let (service, listed) = tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("MCP server `{name}` did not answer within {timeout:?}"))?
            .map_err(|e| format!("MCP server `{name}`: {e}"))?;
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
                output: format!("MCP server `{}`: {e}", self.name),
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
                    output: text.join("\n"),
                }
            }
        }
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        // Stops the service (and a stdio server's process).
        self.service.cancellation_token().cancel();
    }
}
