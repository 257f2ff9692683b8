//! Configuration: TOML with documented defaults (`config/tiller.toml`),
//! environment overrides `TILLER_SECTION__KEY`, unknown keys rejected with
//! their path.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The embedded default, identical to `Config::default()` (tested).
pub const DEFAULT_TOML: &str = include_str!("../../../config/tiller.toml");

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: Server,
    pub store: StoreCfg,
    pub engine: EngineCfg,
    pub turn: Turn,
    pub loop_protection: LoopProtection,
    pub tools: Tools,
    pub channels: std::collections::BTreeMap<String, Channel>,
    pub delivery: DeliveryCfg,
    pub limits: Limits,
    pub log: Log,
    pub metrics: Metrics,
    pub telemetry: Telemetry,
    pub cluster: ClusterCfg,
    /// The file this was read from (it may hold secrets: the file tools
    /// never touch it).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Server {
    pub listen: SocketAddr,
    pub socket: String,
    /// `token` (clients need a token) or `none` (loopback only).
    pub auth: String,
    pub token: String,
    /// A file holding the token; empty means `<data_dir>/token`.
    pub token_file: String,
    pub allowed_hosts: Vec<String>,
    pub allowed_origins: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub channel_replay_window: Duration,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StoreCfg {
    pub data_dir: String,
    /// `sqlite` (the default: a file in the data directory) or `postgres`.
    pub kind: String,
    pub path: String,
    /// PostgreSQL: the variable holding the connection string (never the
    /// string itself in the file).
    pub url_env: String,
    /// PostgreSQL: the schema Tiller's tables live in (created if needed).
    pub schema: String,
}

impl Default for StoreCfg {
    fn default() -> Self {
        StoreCfg {
            data_dir: String::new(),
            kind: "sqlite".into(),
            path: String::new(),
            url_env: "TILLER_DATABASE_URL".into(),
            schema: "tiller".into(),
        }
    }
}

impl StoreCfg {
    /// The PostgreSQL connection string, when `kind = "postgres"`.
    pub fn postgres_url(&self) -> Result<Option<String>, String> {
        match self.kind.as_str() {
            "sqlite" => Ok(None),
            "postgres" => match std::env::var(&self.url_env) {
                Ok(url) if !url.trim().is_empty() => Ok(Some(url)),
                _ => Err(format!(
                    "key `store.url_env`: the variable {} (the PostgreSQL connection string) is not set",
                    self.url_env
                )),
            },
            other => Err(format!(
                "key `store.kind`: unknown store `{other}` (expected sqlite or postgres)"
            )),
        }
    }
}

/// `[engine]`: the default engine and the model engines, one table each
/// (`[engine.NAME]`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, from = "RawEngineCfg")]
pub struct EngineCfg {
    pub default: String,
    /// Model engines (`kind = "openai"` or `"anthropic"`).
    pub models: std::collections::BTreeMap<String, ModelEngineCfg>,
    /// ACP agents as engines (`kind = "acp"`).
    pub agents: std::collections::BTreeMap<String, AcpEngineCfg>,
}

/// `[engine]` as written: each table is a model engine or an agent, by
/// its `kind` (checked table by table with precise errors at load).
#[derive(Deserialize)]
struct RawEngineCfg {
    #[serde(default = "default_engine")]
    default: String,
    #[serde(flatten)]
    tables: std::collections::BTreeMap<String, EngineTable>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum EngineTable {
    Agent(AcpEngineCfg),
    Model(ModelEngineCfg),
}

fn default_engine() -> String {
    SCRIPTED.into()
}

impl From<RawEngineCfg> for EngineCfg {
    fn from(raw: RawEngineCfg) -> Self {
        let mut c = EngineCfg {
            default: raw.default,
            models: Default::default(),
            agents: Default::default(),
        };
        for (name, t) in raw.tables {
            match t {
                EngineTable::Agent(a) => {
                    c.agents.insert(name, a);
                }
                EngineTable::Model(m) => {
                    c.models.insert(name, m);
                }
            }
        }
        c
    }
}

/// `kind = "acp"`, the only value an agent table takes.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum AcpKind {
    Acp,
}

/// `[engine.NAME] kind = "acp"`: an external ACP agent as an engine.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AcpEngineCfg {
    pub kind: AcpKind,
    /// The program: a bare name (looked up on the child's `PATH`) or an
    /// absolute path.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables added to the scrubbed environment.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Variables passed through from the daemon's environment, by name.
    #[serde(default)]
    pub pass_env: Vec<String>,
    /// Sessions one process serves (over one connection).
    #[serde(default = "default_sessions_per_process")]
    pub sessions_per_process: usize,
    /// An idle process is stopped after this long; the next prompt revives
    /// it (and the agent reloads the session).
    #[serde(default = "default_idle_timeout", with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// The most processes the engine runs; a prompt over it fails
    /// `overloaded` (retryable).
    #[serde(default = "default_max_processes")]
    pub max_processes: usize,
    /// Bound on starting a process and opening its session.
    #[serde(default = "default_start_timeout", with = "humantime_serde")]
    pub start_timeout: Duration,
}

fn default_sessions_per_process() -> usize {
    1
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(600)
}
fn default_max_processes() -> usize {
    50
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(60)
}

impl AcpEngineCfg {
    /// The engine's settings: `env` is the daemon's environment (the
    /// child gets the scrubbed base, `pass_env` and `env`).
    pub fn to_acp(
        &self,
        name: &str,
        vars: impl IntoIterator<Item = (String, String)>,
        cancel_grace: Duration,
    ) -> Result<tiller_engine::acp::AcpConfig, String> {
        if self.command.trim().is_empty() {
            return Err(format!(
                "key `engine.{name}.command`: give the agent's program"
            ));
        }
        if self.sessions_per_process == 0 || self.max_processes == 0 {
            return Err(format!(
                "key `engine.{name}`: sessions_per_process and max_processes are at least 1"
            ));
        }
        if let Some(v) = self.pass_env.iter().find(|v| v.starts_with("TILLER_")) {
            return Err(format!(
                "key `engine.{name}.pass_env`: {v} is never passed to agents (TILLER_* variables hold the daemon's secrets)"
            ));
        }
        let mut env = tiller_tools::child_env(vars, &self.pass_env, &[]);
        for (k, v) in &self.env {
            env.retain(|(e, _)| e != k);
            env.push((k.clone(), v.clone()));
        }
        Ok(tiller_engine::acp::AcpConfig {
            name: name.into(),
            command: self.command.clone().into(),
            args: self.args.clone(),
            env,
            sessions_per_process: self.sessions_per_process,
            idle_timeout: self.idle_timeout,
            max_processes: self.max_processes,
            cancel_grace,
            start_timeout: self.start_timeout,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            dir: std::env::var_os("HOME").map_or_else(|| "/".into(), PathBuf::from),
        })
    }
}

/// `[engine.NAME]`: a model engine.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelEngineCfg {
    /// `openai` (Chat Completions and compatible servers) or `anthropic`.
    /// Defaults to the table's name when that is one of them.
    #[serde(default)]
    pub kind: Option<String>,
    /// The API root; defaults to the provider's public API.
    #[serde(default)]
    pub base_url: Option<String>,
    /// The default model.
    pub model: String,
    /// More models a session may switch to (`session/set_config_option`).
    #[serde(default)]
    pub models: Vec<String>,
    /// The environment variable holding the API key. Defaults to
    /// OPENAI_API_KEY / ANTHROPIC_API_KEY for the public APIs, and to none
    /// when `base_url` is set; "" sends no key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Replaces the built-in agent's instructions.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Added after the instructions.
    #[serde(default)]
    pub system_prompt_append: Option<String>,
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    #[serde(default = "default_retry_base", with = "humantime_serde")]
    pub retry_base: Duration,
    #[serde(default = "default_max_requests")]
    pub max_requests_per_turn: u32,
    #[serde(default = "default_context_chars")]
    pub context_chars: usize,
    /// The model's context window in tokens, reported with usage.
    #[serde(default = "default_context_window")]
    pub context_window: u64,
    /// The share of the window the conversation may fill before it is
    /// compacted (0: only on `/compact`).
    #[serde(default = "default_compact_at")]
    pub compact_at: f64,
    /// What the model's tokens cost, per million, for the usage reports.
    #[serde(default)]
    pub prices: Option<PricesCfg>,
}

/// `[engine.NAME] prices = { input = 3.0, output = 15.0, currency = "USD" }`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PricesCfg {
    /// Per million input tokens.
    pub input: f64,
    /// Per million output tokens.
    pub output: f64,
    #[serde(default = "default_currency")]
    pub currency: String,
}

fn default_currency() -> String {
    "USD".into()
}
fn default_compact_at() -> f64 {
    0.8
}
fn default_context_window() -> u64 {
    128_000
}

fn default_request_timeout() -> Duration {
    Duration::from_secs(120)
}
fn default_max_retries() -> u32 {
    3
}
fn default_retry_base() -> Duration {
    Duration::from_millis(500)
}
fn default_max_requests() -> u32 {
    100
}
fn default_context_chars() -> usize {
    400_000
}

impl ModelEngineCfg {
    /// The engine's settings, `name` being its table's name.
    pub fn to_model(&self, name: &str) -> Result<tiller_engine::model::ModelConfig, String> {
        use tiller_engine::model::{ModelConfig, Provider};
        let kind = self.kind.as_deref().unwrap_or(name);
        let provider = Provider::parse(kind).ok_or_else(|| {
            format!(
                "key `engine.{name}.kind`: unknown kind `{kind}` (expected openai, anthropic or acp)"
            )
        })?;
        if self.model.trim().is_empty() {
            return Err(format!("key `engine.{name}.model`: give the model's name"));
        }
        let base_url = self
            .base_url
            .clone()
            .unwrap_or_else(|| provider.default_base_url().to_owned());
        match url::Url::parse(&base_url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            _ => {
                return Err(format!(
                    "key `engine.{name}.base_url`: `{base_url}` is not an http(s) URL"
                ));
            }
        }
        let api_key_env = match (&self.api_key_env, &self.base_url, provider) {
            (Some(v), _, _) => Some(v.clone()).filter(|v| !v.is_empty()),
            (None, Some(_), _) => None,
            (None, None, Provider::OpenAi) => Some("OPENAI_API_KEY".into()),
            (None, None, Provider::Anthropic) => Some("ANTHROPIC_API_KEY".into()),
        };
        Ok(ModelConfig {
            name: name.to_owned(),
            provider,
            base_url,
            model: self.model.clone(),
            models: self.models.clone(),
            api_key_env,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            system_prompt: self.system_prompt.clone(),
            system_prompt_append: self.system_prompt_append.clone(),
            request_timeout: self.request_timeout,
            max_retries: self.max_retries,
            retry_base: self.retry_base,
            max_requests_per_turn: self.max_requests_per_turn.max(1),
            context_chars: self.context_chars.max(1000),
            context_window: self.context_window.max(1),
            compact_at: if (0.0..=1.0).contains(&self.compact_at) {
                self.compact_at
            } else {
                return Err(format!(
                    "key `engine.{name}.compact_at`: {} is not a share between 0 and 1",
                    self.compact_at
                ));
            },
            prices: match &self.prices {
                None => None,
                Some(p)
                    if p.input < 0.0
                        || p.output < 0.0
                        || !p.input.is_finite()
                        || !p.output.is_finite() =>
                {
                    return Err(format!(
                        "key `engine.{name}.prices`: prices are non-negative numbers per million tokens"
                    ));
                }
                Some(p) => Some(tiller_engine::Prices {
                    input_per_mtok: p.input,
                    output_per_mtok: p.output,
                    currency: p.currency.clone(),
                }),
            },
        })
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Turn {
    #[serde(with = "humantime_serde")]
    pub steer_receipt_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub cancel_grace: Duration,
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    pub max_queued_prompts: usize,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LoopProtection {
    pub consecutive_identical_tool_calls: LoopRule,
    pub repeated_tool_failure: LoopRule,
    pub turn_tool_call_cap: LoopRule,
    pub chanting_identical_sentences: LoopRule,
    pub alternating_tool_call_pattern: LoopRule,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoopRule {
    pub enabled: bool,
    pub threshold: usize,
}

impl From<tiller_core::loop_guard::Rule> for LoopRule {
    fn from(r: tiller_core::loop_guard::Rule) -> Self {
        Self {
            enabled: r.enabled,
            threshold: r.threshold,
        }
    }
}

impl From<LoopRule> for tiller_core::loop_guard::Rule {
    fn from(r: LoopRule) -> Self {
        Self {
            enabled: r.enabled,
            threshold: r.threshold,
        }
    }
}

impl Default for LoopProtection {
    fn default() -> Self {
        let d = tiller_core::LoopConfig::default();
        Self {
            consecutive_identical_tool_calls: d.consecutive_identical_tool_calls.into(),
            repeated_tool_failure: d.repeated_tool_failure.into(),
            turn_tool_call_cap: d.turn_tool_call_cap.into(),
            chanting_identical_sentences: d.chanting_identical_sentences.into(),
            alternating_tool_call_pattern: d.alternating_tool_call_pattern.into(),
        }
    }
}

/// `[channels.NAME]`: a channel's HMAC secret (inline or from a
/// variable) and what its unattended turns may reach.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Channel {
    pub secret: String,
    pub secret_env: String,
    /// The working directory of the sessions the channel creates
    /// (required: an existing absolute directory).
    pub cwd: String,
    /// The engine of the sessions it creates (default: engine.default).
    pub engine: String,
    /// Existing sessions it may prompt besides the ones it created.
    pub sessions: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryCfg {
    pub allowed_hosts: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Tools {
    pub permission_mode: String,
    #[serde(with = "humantime_serde")]
    pub shell_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub max_shell_timeout: Duration,
    pub max_output_bytes: usize,
    /// Variables (by name) passed to commands and MCP servers besides
    /// PATH, HOME, LANG and TERM. Secrets and TILLER_* never pass.
    pub pass_env: Vec<String>,
    /// Hosts `web_fetch` may read (as `[delivery] allowed_hosts`); empty:
    /// the tool is not offered.
    pub web_fetch_hosts: Vec<String>,
    pub mcp: Mcp,
}

/// `[tools.mcp]`: which MCP servers clients may name.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Mcp {
    /// Programs a stdio server may run (`npx`, `/usr/local/bin/srv`,
    /// `/opt/mcp/bin/*`); default none.
    pub allowed_commands: Vec<String>,
    /// Hosts an HTTP server may be at (as `[delivery] allowed_hosts`).
    pub allowed_hosts: Vec<String>,
    /// Bound on connecting to each server.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for Mcp {
    fn default() -> Self {
        Self {
            allowed_commands: Vec::new(),
            allowed_hosts: Vec::new(),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl Default for Tools {
    fn default() -> Self {
        let t = tiller_tools::ToolsConfig::default();
        Self {
            permission_mode: "ask".into(),
            shell_timeout: t.shell_timeout,
            max_shell_timeout: t.max_shell_timeout,
            max_output_bytes: t.max_output_bytes,
            pass_env: Vec::new(),
            web_fetch_hosts: Vec::new(),
            mcp: Mcp::default(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_sessions: usize,
    /// How long a session with nothing in flight keeps its actor before it
    /// is parked (stopped, kept as a record, started again by its next
    /// message); `0s`: never.
    #[serde(with = "humantime_serde")]
    pub park_after: Duration,
    pub max_connections: usize,
    pub max_message_bytes: usize,
    pub subscriber_queue: usize,
    pub max_queued_notifications: usize,
    /// HTTP connections served at once (over it: 503 and close).
    pub max_http_connections: usize,
    /// Bound on receiving a request's headers (also how long a kept-alive
    /// HTTP connection may sit idle).
    #[serde(with = "humantime_serde")]
    pub http_header_timeout: Duration,
    /// Most content signals one turn may send (then `turn_too_long`).
    pub max_turn_events: u64,
    /// The longest pause while receiving a request's body (all of it, for
    /// the channel ingress).
    #[serde(with = "humantime_serde")]
    pub http_body_timeout: Duration,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    pub level: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    pub enabled: bool,
}

/// `[telemetry]`: OpenTelemetry traces over OTLP/HTTP, off by default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Telemetry {
    /// The collector's OTLP/HTTP root (`http://collector:4318`); empty
    /// means `OTEL_EXPORTER_OTLP_ENDPOINT` if set, else no tracing export.
    pub otlp_endpoint: String,
}

/// `[cluster]`: this node's identity and lease timings when several
/// daemons share a PostgreSQL store (ignored with SQLite).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterCfg {
    /// This node's id; empty means the one kept in `<data_dir>/node-id`
    /// (made at first start).
    pub node_id: String,
    /// Where other nodes and operators reach this node; empty means
    /// `http://<server.listen>`.
    pub advertise: String,
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub renew_every: Duration,
}

impl Default for ClusterCfg {
    fn default() -> Self {
        ClusterCfg {
            node_id: String::new(),
            advertise: String::new(),
            lease_ttl: Duration::from_secs(10),
            renew_every: Duration::from_secs(3),
        }
    }
}

impl Default for Server {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 4141)),
            socket: String::new(),
            auth: "token".into(),
            token: String::new(),
            token_file: String::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            channel_replay_window: Duration::from_secs(300),
        }
    }
}

impl Default for EngineCfg {
    fn default() -> Self {
        Self {
            default: SCRIPTED.into(),
            models: Default::default(),
            agents: Default::default(),
        }
    }
}

impl Default for Turn {
    fn default() -> Self {
        Self {
            steer_receipt_timeout: Duration::from_secs(10),
            cancel_grace: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(600),
            max_queued_prompts: 8,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_sessions: 100_000,
            park_after: Duration::from_secs(600),
            max_connections: 1024,
            max_message_bytes: 4 * 1024 * 1024,
            subscriber_queue: 4096,
            max_queued_notifications: 32,
            max_http_connections: 1024,
            max_turn_events: 100_000,
            http_header_timeout: Duration::from_secs(10),
            http_body_timeout: Duration::from_secs(30),
        }
    }
}

impl Default for Log {
    fn default() -> Self {
        Self {
            level: "info".into(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self { enabled: true }
    }
}

/// A configuration that cannot be used. The message names the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The engine that needs no model and no key.
pub const SCRIPTED: &str = "scripted";

/// The longest bound a command may be given (`tools.max_shell_timeout`).
const MAX_BOUND: Duration = Duration::from_secs(365 * 24 * 3600);

impl Config {
    /// Reads `path` (or the embedded defaults when `None`), then applies
    /// `env` overrides (`TILLER_SECTION__KEY=value`), then validates.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (
                std::fs::read_to_string(p).map_err(|e| {
                    ConfigError(format!("cannot read config file {}: {e}", p.display()))
                })?,
                p.display().to_string(),
            ),
            None => (String::new(), "the embedded defaults".to_owned()),
        };
        let user: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            ConfigError(format!("{origin}: {}", e.message().trim()))
        })?;
        // The file overlays the documented defaults, key by key.
        let mut table: toml::Table = DEFAULT_TOML.parse().expect("the embedded default parses");
        merge(&mut table, user);
        let mut from_env = Vec::new();
        let env: Vec<(String, String)> = env.into_iter().collect();
        for (key, raw) in env.iter().cloned() {
            let Some(rest) = key.strip_prefix("TILLER_") else {
                continue;
            };
            if !rest.contains("__") {
                continue;
            }
            // Lower-case keys, but an agent's `env` names as given
            // (`TILLER_ENGINE__A__ENV__ANTHROPIC_API_KEY`).
            let mut path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if path.len() > 3 && path[0] == "engine" && path[2] == "env" {
                for (p, given) in path.iter_mut().zip(rest.split("__")).skip(3) {
                    *p = given.to_owned();
                }
            }
            set_path(&mut table, &path, env_value(&path.join("."), &raw))
                .map_err(|e| ConfigError(format!("environment variable {key}: {e}")))?;
            from_env.push((path.join("."), key));
        }
        // Model engine tables are flattened into `[engine]`, which hides
        // their keys' paths from the general error below: check each one
        // on its own first.
        if let Some(toml::Value::Table(engines)) = table.get("engine") {
            for (name, v) in engines {
                if name != "default" && !v.is_table() {
                    return Err(ConfigError(format!(
                        "{origin}: key `engine.{name}`: unknown key (expected `default` or an [engine.NAME] table)"
                    )));
                }
                if let toml::Value::Table(t) = v {
                    let kind = t.get("kind").and_then(toml::Value::as_str);
                    if let Some(k) = kind.filter(|k| !["openai", "anthropic", "acp"].contains(k)) {
                        return Err(ConfigError(format!(
                            "{origin}: key `engine.{name}.kind`: unknown kind `{k}` (expected openai, anthropic or acp)"
                        )));
                    }
                    let agent = kind == Some("acp");
                    let checked = if agent {
                        serde_path_to_error::deserialize::<_, AcpEngineCfg>(v.clone()).map(drop)
                    } else {
                        serde_path_to_error::deserialize::<_, ModelEngineCfg>(v.clone()).map(drop)
                    };
                    checked.map_err(|e| {
                        let at = e.path().to_string();
                        let at = if at == "." || at.is_empty() {
                            format!("engine.{name}")
                        } else {
                            format!("engine.{name}.{at}")
                        };
                        let inner = if secret_key(&at) {
                            "expected a string (the value is not shown: a secret)".to_owned()
                        } else {
                            let inner = e.into_inner().to_string();
                            inner.lines().next().unwrap_or_default().trim().to_owned()
                        };
                        ConfigError(format!("{origin}: key `{at}`: {inner}"))
                    })?;
                }
            }
        }
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let at = e.path().to_string();
                let source = from_env
                    .iter()
                    .find(|(p, _)| at.starts_with(p.as_str()) || p.starts_with(at.as_str()))
                    .map(|(_, k)| format!("environment variable {k}"))
                    .unwrap_or_else(|| origin.clone());
                let inner = if secret_key(&at) {
                    // Serde's message would show the value.
                    "expected a string (the value is not shown: a secret)".to_owned()
                } else {
                    let inner = e.into_inner().to_string();
                    inner.lines().next().unwrap_or_default().trim().to_owned()
                };
                ConfigError(format!("{source}: key `{at}`: {inner}"))
            })?;
        config.validate()?;
        let mut config = config;
        config.source = path.map(Path::to_owned);
        // Channel secrets from the environment are resolved now, so a
        // missing variable is a start-up error naming it.
        for (name, ch) in &mut config.channels {
            match (ch.secret.is_empty(), ch.secret_env.is_empty()) {
                (false, true) => {}
                (true, false) => {
                    let v = env
                        .iter()
                        .find(|(k, _)| *k == ch.secret_env)
                        .map(|(_, v)| v);
                    match v.filter(|v| !v.is_empty()) {
                        Some(v) => ch.secret = v.clone(),
                        None => {
                            return Err(ConfigError(format!(
                                "key `channels.{name}.secret_env`: environment variable {} is not set",
                                ch.secret_env
                            )));
                        }
                    }
                }
                _ => {
                    return Err(ConfigError(format!(
                        "key `channels.{name}`: give exactly one of `secret` or `secret_env`"
                    )));
                }
            }
        }
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        // An origin as a browser sends it: scheme://host[:port], no path
        // (an extension's or an app's scheme too: `tauri://localhost`).
        for o in &self.server.allowed_origins {
            let origin = url::Url::parse(o)
                .ok()
                .filter(|u| u.has_host() && ["/", ""].contains(&u.path()) && u.query().is_none());
            let origin = origin.map(|u| {
                let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
                format!(
                    "{}://{}{port}",
                    u.scheme(),
                    u.host_str().unwrap_or_default()
                )
            });
            match origin {
                Some(form) if form.eq_ignore_ascii_case(o.trim_end_matches('/')) => {}
                Some(form) => {
                    return Err(ConfigError(format!(
                        "key `server.allowed_origins`: write `{o}` as a browser sends it: `{form}`"
                    )));
                }
                None => {
                    return Err(ConfigError(format!(
                        "key `server.allowed_origins`: `{o}` is not an origin (scheme://host[:port], such as https://ide.example; `*` is not allowed)"
                    )));
                }
            }
        }
        if !["sqlite", "postgres"].contains(&self.store.kind.as_str()) {
            return Err(ConfigError(format!(
                "key `store.kind`: unknown store `{}` (expected sqlite or postgres)",
                self.store.kind
            )));
        }
        if self.cluster.renew_every.is_zero()
            || self.cluster.renew_every * 2 > self.cluster.lease_ttl
        {
            return Err(ConfigError(
                "key `cluster.renew_every`: must be above zero and at most half of cluster.lease_ttl"
                    .into(),
            ));
        }
        if !self.cluster.node_id.is_empty()
            && !self
                .cluster
                .node_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(ConfigError(format!(
                "key `cluster.node_id`: `{}` may hold only letters, digits, -, _ and .",
                self.cluster.node_id
            )));
        }
        if self.engine.models.contains_key(SCRIPTED) || self.engine.agents.contains_key(SCRIPTED) {
            return Err(ConfigError(format!(
                "key `engine.{SCRIPTED}`: the name is reserved for the built-in scripted engine"
            )));
        }
        for (name, m) in &self.engine.models {
            m.to_model(name).map_err(ConfigError)?;
        }
        for (name, a) in &self.engine.agents {
            a.to_acp(name, [], Duration::ZERO).map_err(ConfigError)?;
            if self.store.kind == "postgres" && a.pass_env.contains(&self.store.url_env) {
                return Err(ConfigError(format!(
                    "key `engine.{name}.pass_env`: {} holds the store's connection string (store.url_env) and is never passed to agents",
                    self.store.url_env
                )));
            }
        }
        let names = self.engine_names();
        if !names.contains(&self.engine.default) {
            return Err(ConfigError(format!(
                "key `engine.default`: unknown engine `{}` (configured: {})",
                self.engine.default,
                names.join(", ")
            )));
        }
        if self.tools.shell_timeout.is_zero()
            || self.tools.max_shell_timeout < self.tools.shell_timeout
        {
            return Err(ConfigError(
                "key `tools.shell_timeout`: must be above zero and at most tools.max_shell_timeout"
                    .into(),
            ));
        }
        // A command's deadline is now plus the bound: past the clock's
        // range it would not be a deadline at all.
        if self.tools.max_shell_timeout > MAX_BOUND {
            return Err(ConfigError(
                "key `tools.max_shell_timeout`: at most 365 days".into(),
            ));
        }
        if tiller_session::PermissionMode::parse(&self.tools.permission_mode).is_none() {
            return Err(ConfigError(format!(
                "key `tools.permission_mode`: unknown mode `{}` (expected ask, accept-edits or allow-all)",
                self.tools.permission_mode
            )));
        }
        for (key, zero) in [
            ("turn.max_queued_prompts", self.turn.max_queued_prompts == 0),
            ("limits.max_sessions", self.limits.max_sessions == 0),
            ("limits.max_connections", self.limits.max_connections == 0),
            (
                "limits.max_message_bytes",
                self.limits.max_message_bytes < 1024,
            ),
            ("limits.subscriber_queue", self.limits.subscriber_queue < 16),
            (
                "limits.max_queued_notifications",
                self.limits.max_queued_notifications == 0,
            ),
            ("turn.cancel_grace", self.turn.cancel_grace.is_zero()),
            ("turn.stall_timeout", self.turn.stall_timeout.is_zero()),
            (
                "turn.steer_receipt_timeout",
                self.turn.steer_receipt_timeout.is_zero(),
            ),
        ] {
            if zero {
                return Err(ConfigError(format!("key `{key}`: value is too small")));
            }
        }
        match self.server.auth.as_str() {
            "token" => {}
            "none" if self.server.listen.ip().is_loopback() => {}
            "none" => {
                return Err(ConfigError(format!(
                    "key `server.auth`: \"none\" is allowed only on loopback, and server.listen is {}",
                    self.server.listen
                )));
            }
            other => {
                return Err(ConfigError(format!(
                    "key `server.auth`: unknown value `{other}` (expected \"token\" or \"none\")"
                )));
            }
        }
        if !self.server.token.is_empty() && !self.server.token_file.is_empty() {
            return Err(ConfigError(
                "key `server.token_file`: give server.token or server.token_file, not both".into(),
            ));
        }
        for (key, zero) in [
            (
                "limits.max_http_connections",
                self.limits.max_http_connections == 0,
            ),
            (
                "limits.http_header_timeout",
                self.limits.http_header_timeout.is_zero(),
            ),
            (
                "limits.http_body_timeout",
                self.limits.http_body_timeout.is_zero(),
            ),
            ("limits.max_turn_events", self.limits.max_turn_events == 0),
            (
                "tools.mcp.connect_timeout",
                self.tools.mcp.connect_timeout.is_zero(),
            ),
        ] {
            if zero {
                return Err(ConfigError(format!("key `{key}`: value is too small")));
            }
        }
        for (key, hosts) in [
            ("tools.mcp.allowed_hosts", &self.tools.mcp.allowed_hosts),
            ("tools.web_fetch_hosts", &self.tools.web_fetch_hosts),
            ("delivery.allowed_hosts", &self.delivery.allowed_hosts),
        ] {
            if let Err(e) = tiller_tools::egress::Policy::new(hosts) {
                return Err(ConfigError(format!("key `{key}`: {e}")));
            }
        }
        if let Some(v) = self
            .tools
            .pass_env
            .iter()
            .find(|v| v.starts_with("TILLER_"))
        {
            return Err(ConfigError(format!(
                "key `tools.pass_env`: {v} is never passed to commands (TILLER_* variables hold the daemon's secrets)"
            )));
        }
        for (name, ch) in &self.channels {
            let cwd = Path::new(&ch.cwd);
            if ch.cwd.is_empty() {
                return Err(ConfigError(format!(
                    "key `channels.{name}.cwd`: required: the directory the channel's sessions work in"
                )));
            }
            if !cwd.is_absolute() || !cwd.is_dir() {
                return Err(ConfigError(format!(
                    "key `channels.{name}.cwd`: `{}` is not an existing absolute directory",
                    ch.cwd
                )));
            }
            if cwd.parent().is_none() {
                return Err(ConfigError(format!(
                    "key `channels.{name}.cwd`: `/` would give third-party text the whole machine; name the directory its sessions work in"
                )));
            }
            if !ch.engine.is_empty() && !names.contains(&ch.engine) {
                return Err(ConfigError(format!(
                    "key `channels.{name}.engine`: unknown engine `{}` (configured: {})",
                    ch.engine,
                    names.join(", ")
                )));
            }
            if let Some(bad) = ch
                .sessions
                .iter()
                .find(|s| tiller_core::SessionId::parse(s).is_none())
            {
                return Err(ConfigError(format!(
                    "key `channels.{name}.sessions`: `{bad}` is not a session id"
                )));
            }
        }
        Ok(())
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        if !self.store.data_dir.is_empty() {
            return PathBuf::from(&self.store.data_dir);
        }
        if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
            return PathBuf::from(x).join("tiller");
        }
        let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
        PathBuf::from(home).join(".local/share/tiller")
    }

    /// The SQLite database file.
    pub fn db_path(&self) -> PathBuf {
        if self.store.path.is_empty() {
            self.data_dir().join("tiller.db")
        } else {
            PathBuf::from(&self.store.path)
        }
    }

    /// The token file: `server.token_file`, else `<data_dir>/token`.
    pub fn token_path(&self) -> PathBuf {
        if self.server.token_file.is_empty() {
            self.data_dir().join("token")
        } else {
            PathBuf::from(&self.server.token_file)
        }
    }

    /// The ACP unix socket.
    pub fn socket_path(&self) -> PathBuf {
        if self.server.socket.is_empty() {
            self.data_dir().join("tiller.sock")
        } else {
            PathBuf::from(&self.server.socket)
        }
    }

    /// Which tool calls ask first.
    /// Every engine's name: `scripted` and the model engines.
    pub fn engine_names(&self) -> Vec<String> {
        std::iter::once(SCRIPTED.to_owned())
            .chain(self.engine.models.keys().cloned())
            .chain(self.engine.agents.keys().cloned())
            .collect()
    }

    /// Variables that hold secrets: never passed to a child, whatever
    /// `tools.pass_env` says (TILLER_* never pass either).
    pub fn secret_variables(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .engine
            .models
            .iter()
            .filter_map(|(name, m)| m.to_model(name).ok()?.api_key_env)
            .collect();
        // What an agent is given stays the agent's.
        v.extend(
            self.engine
                .agents
                .values()
                .flat_map(|a| a.pass_env.iter().cloned()),
        );
        v.extend(
            self.channels
                .values()
                .map(|c| c.secret_env.clone())
                .filter(|e| !e.is_empty()),
        );
        // The store's connection string (its password).
        if self.store.kind == "postgres" {
            v.push(self.store.url_env.clone());
        }
        v
    }

    /// The tools' settings. `env` is the daemon's environment (children get
    /// a scrubbed copy); `supervisor` the binary that runs commands (`tiller
    /// __supervise`), so everything a command starts dies with it.
    pub fn tools_config(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
        supervisor: Option<PathBuf>,
    ) -> tiller_tools::ToolsConfig {
        let egress = tiller_tools::egress::Policy::new(&self.tools.mcp.allowed_hosts)
            .expect("validated by Config::load")
            .for_setting("tools.mcp.allowed_hosts");
        tiller_tools::ToolsConfig {
            shell_timeout: self.tools.shell_timeout,
            max_shell_timeout: self.tools.max_shell_timeout,
            max_output_bytes: self.tools.max_output_bytes.max(1024),
            child_env: tiller_tools::child_env(env, &self.tools.pass_env, &self.secret_variables()),
            supervisor,
            web_fetch: tiller_tools::egress::Policy::new(&self.tools.web_fetch_hosts)
                .expect("validated by Config::load")
                .for_setting("tools.web_fetch_hosts"),
            mcp: tiller_tools::McpPolicy {
                allowed_commands: self.tools.mcp.allowed_commands.clone(),
                egress,
                connect_timeout: self.tools.mcp.connect_timeout,
            },
        }
    }

    /// Where webhook deliveries may go.
    pub fn delivery_policy(&self) -> tiller_tools::egress::Policy {
        tiller_tools::egress::Policy::new(&self.delivery.allowed_hosts)
            .expect("validated by Config::load")
            .for_setting("delivery.allowed_hosts")
    }

    pub fn permission_mode(&self) -> tiller_session::PermissionMode {
        tiller_session::PermissionMode::parse(&self.tools.permission_mode)
            .expect("validated by Config::load")
    }

    /// The loop guard's settings.
    pub fn loop_config(&self) -> tiller_core::LoopConfig {
        let l = &self.loop_protection;
        tiller_core::LoopConfig {
            consecutive_identical_tool_calls: l.consecutive_identical_tool_calls.into(),
            repeated_tool_failure: l.repeated_tool_failure.into(),
            turn_tool_call_cap: l.turn_tool_call_cap.into(),
            chanting_identical_sentences: l.chanting_identical_sentences.into(),
            alternating_tool_call_pattern: l.alternating_tool_call_pattern.into(),
        }
    }

    /// The turn core's timers.
    pub fn turn_config(&self) -> tiller_core::TurnConfig {
        tiller_core::TurnConfig {
            steer_receipt_timeout: self.turn.steer_receipt_timeout.as_millis() as u64,
            cancel_grace: self.turn.cancel_grace.as_millis() as u64,
            stall_timeout: self.turn.stall_timeout.as_millis() as u64,
            max_queued_prompts: self.turn.max_queued_prompts,
            max_turn_events: self.limits.max_turn_events,
        }
    }
}

/// Overlays `over` onto `base`, recursing into tables.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Whether a key (its dotted path) holds a secret: `server.token`, a
/// channel's `secret`, or anything in a hosted agent's `env` (its keys).
/// Its value is taken as given, never parsed, and never shown in an error.
fn secret_key(key: &str) -> bool {
    let parts: Vec<&str> = key.split('.').collect();
    matches!(
        parts.as_slice(),
        ["server", "token"] | ["channels", _, "secret"] | ["engine", _, "env", ..]
    )
}

/// An environment value as TOML when it parses as one, else as a string;
/// a secret's always as a string.
fn env_value(key: &str, raw: &str) -> toml::Value {
    if secret_key(key) {
        return toml::Value::String(raw.to_owned());
    }
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty key")?;
    let mut t = table;
    for p in parents {
        let entry = t
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a section"))?;
    }
    t.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        Config::load(
            Some(&p),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn allowed_origins_are_origins() {
        for bad in ["*", "*/", "ide.example", "https://ide.example/path", "null"] {
            let e = load_str(&format!("[server]\nallowed_origins = [\"{bad}\"]\n"), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("not an origin"), "{bad}: {e}");
        }
        let e = load_str(
            "[server]\nallowed_origins = [\"https://ide.example:443\"]\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`https://ide.example`"), "{e}");
        for good in [
            "https://ide.example",
            "https://IDE.example/",
            "http://127.0.0.1:3000",
            "tauri://localhost",
            "chrome-extension://abcdefghijklmnop",
            "app://MyApp",
        ] {
            load_str(&format!("[server]\nallowed_origins = [\"{good}\"]\n"), &[])
                .unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    /// A token or secret that looks like a number (or a date, a list...)
    /// is still the string it was given, from the environment; written so
    /// in the file, the error does not show it.
    #[test]
    fn a_secret_is_never_parsed_nor_shown_in_an_error() {
        let c = load_str(
            "",
            &[
                ("TILLER_SERVER__TOKEN", "1234567890123456"),
                ("TILLER_CHANNELS__HOOK__SECRET", "0x7fffffff"),
                ("TILLER_CHANNELS__HOOK__CWD", "/tmp"),
            ],
        )
        .unwrap();
        assert_eq!(c.server.token, "1234567890123456");
        assert_eq!(c.channels["hook"].secret, "0x7fffffff");
        let c = load_str(
            "[engine.a]\nkind = \"acp\"\ncommand = \"x\"\n",
            &[(
                "TILLER_ENGINE__A__ENV__ANTHROPIC_API_KEY",
                "1234567890123456",
            )],
        )
        .unwrap();
        assert_eq!(
            c.engine.agents["a"].env["ANTHROPIC_API_KEY"],
            "1234567890123456"
        );
        for text in [
            "[server]\ntoken = 1234567890123456\n",
            "[channels.hook]\nsecret = 987654321987\ncwd = \"/tmp\"\n",
            "[engine.a]\nkind = \"acp\"\ncommand = \"x\"\nenv = { KEY = 1234567890123456 }\n",
        ] {
            let e = load_str(text, &[]).unwrap_err().to_string();
            assert!(
                !e.contains("1234567890123456") && !e.contains("987654321987"),
                "{e}"
            );
            assert!(e.contains("token") || e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn the_documented_file_is_the_embedded_default() {
        let mut from_file = load_str(DEFAULT_TOML, &[]).unwrap();
        assert!(from_file.source.is_some());
        from_file.source = None;
        assert_eq!(from_file, Config::default());
        assert_eq!(Config::load(None, []).unwrap(), Config::default());
    }

    #[test]
    fn the_example_configs_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/examples");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let c =
                Config::load(Some(&path), []).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                c.engine_names().contains(&c.engine.default),
                "{}",
                path.display()
            );
            for (name, m) in &c.engine.models {
                m.to_model(name).unwrap();
            }
            for (name, a) in &c.engine.agents {
                a.to_acp(name, [], Duration::from_secs(2)).unwrap();
            }
            seen += 1;
        }
        assert_eq!(seen, 4);
    }

    #[test]
    fn an_acp_agent_engine_gets_the_scrubbed_environment_with_pass_env_and_env() {
        let c = load_str(
            "[engine]\ndefault = \"claude\"\n[engine.claude]\nkind = \"acp\"\ncommand = \"claude-agent-acp\"\npass_env = [\"ANTHROPIC_API_KEY\"]\nenv = { IS_SANDBOX = \"1\", HOME = \"/srv/claude\" }\n",
            &[],
        )
        .unwrap();
        assert_eq!(c.engine_names(), ["scripted", "claude"]);
        let vars = [
            ("PATH", "/usr/bin"),
            ("HOME", "/root"),
            ("ANTHROPIC_API_KEY", "sk-secret"),
            ("OPENAI_API_KEY", "sk-other"),
            ("TILLER_SERVER__TOKEN", "tok"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let a = c.engine.agents["claude"]
            .to_acp("claude", vars, Duration::from_secs(2))
            .unwrap();
        let mut env = a.env.clone();
        env.sort();
        let want: Vec<(String, String)> = [
            ("ANTHROPIC_API_KEY", "sk-secret"),
            ("HOME", "/srv/claude"),
            ("IS_SANDBOX", "1"),
            ("PATH", "/usr/bin"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
        assert_eq!(env, want);
        assert_eq!(a.sessions_per_process, 1);
        assert_eq!(a.max_processes, 50);
        assert_eq!(a.idle_timeout, Duration::from_secs(600));
        // Its Debug never shows a value.
        assert!(!format!("{a:?}").contains("sk-secret"));
        // And no tool command gets what the agent was given.
        assert!(
            c.secret_variables()
                .contains(&"ANTHROPIC_API_KEY".to_owned())
        );
    }

    #[test]
    fn a_command_bound_past_a_year_is_refused() {
        let e = load_str(
            "[tools]\nshell_timeout = \"2m\"\nmax_shell_timeout = \"300000000000y\"\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("tools.max_shell_timeout"), "{e}");
        load_str("[tools]\nmax_shell_timeout = \"365days\"\n", &[]).unwrap();
    }

    #[test]
    fn the_store_s_connection_string_reaches_no_child_and_no_agent() {
        // A variable of the operator's naming (not TILLER_*, which never
        // passes): a tool command never gets it, whatever pass_env says.
        let c = load_str(
            "[store]\nkind = \"postgres\"\nurl_env = \"DATABASE_URL\"\n[tools]\npass_env = [\"DATABASE_URL\", \"CARGO_HOME\"]\n",
            &[],
        )
        .unwrap();
        assert!(c.secret_variables().contains(&"DATABASE_URL".to_owned()));
        let vars = [
            ("DATABASE_URL", "postgres://tiller:hunter22@db/tiller"),
            ("CARGO_HOME", "/srv/cargo"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let env = tiller_tools::child_env(vars, &c.tools.pass_env, &c.secret_variables());
        assert_eq!(env, [("CARGO_HOME".to_owned(), "/srv/cargo".to_owned())]);
        // An agent asking for it is refused at load, naming the key.
        let e = load_str(
            "[store]\nkind = \"postgres\"\nurl_env = \"DATABASE_URL\"\n[engine.claude]\nkind = \"acp\"\ncommand = \"claude-agent-acp\"\npass_env = [\"DATABASE_URL\"]\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("engine.claude.pass_env") && e.contains("store.url_env"),
            "{e}"
        );
        // On SQLite the name is nobody's secret: a project's own
        // DATABASE_URL passes as configured, to commands and to agents.
        let c = load_str(
            "[store]\nurl_env = \"DATABASE_URL\"\n[tools]\npass_env = [\"DATABASE_URL\"]\n",
            &[],
        )
        .unwrap();
        assert!(!c.secret_variables().contains(&"DATABASE_URL".to_owned()));
        load_str(
            "[store]\nurl_env = \"DATABASE_URL\"\n[engine.claude]\nkind = \"acp\"\ncommand = \"claude-agent-acp\"\npass_env = [\"DATABASE_URL\"]\n",
            &[],
        )
        .unwrap();
    }

    #[test]
    fn model_engines_take_their_defaults() {
        let c = load_str(
            "[engine]\ndefault = \"anthropic\"\n[engine.anthropic]\nmodel = \"c\"\n[engine.local]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:11434/v1\"\nmodel = \"q\"\n",
            &[],
        )
        .unwrap();
        let a = c.engine.models["anthropic"].to_model("anthropic").unwrap();
        assert_eq!(a.provider, tiller_engine::model::Provider::Anthropic);
        assert_eq!(a.base_url, "https://api.anthropic.com");
        assert_eq!(a.api_key_env.as_deref(), Some("ANTHROPIC_API_KEY"));
        assert_eq!(a.request_timeout, Duration::from_secs(120));
        let l = c.engine.models["local"].to_model("local").unwrap();
        assert_eq!(
            l.api_key_env, None,
            "a local server needs no key by default"
        );
        assert_eq!(c.engine_names(), ["scripted", "anthropic", "local"]);
    }

    #[test]
    fn env_overrides_apply() {
        let c = load_str(
            "",
            &[
                ("TILLER_TURN__CANCEL_GRACE", "150ms"),
                ("TILLER_LIMITS__MAX_SESSIONS", "7"),
                ("TILLER_SERVER__LISTEN", "127.0.0.1:9"),
                ("TILLER_UNRELATED", "x"),
                ("HOME", "/h"),
            ],
        )
        .unwrap();
        assert_eq!(c.turn.cancel_grace, Duration::from_millis(150));
        assert_eq!(c.limits.max_sessions, 7);
        assert_eq!(c.server.listen.port(), 9);
        let c = load_str(
            "[loop_protection.turn_tool_call_cap]\nenabled = true\nthreshold = 20\n",
            &[(
                "TILLER_LOOP_PROTECTION__REPEATED_TOOL_FAILURE__ENABLED",
                "false",
            )],
        )
        .unwrap();
        let l = c.loop_config();
        assert_eq!(l.turn_tool_call_cap.threshold, 20);
        assert!(!l.repeated_tool_failure.enabled);
        assert_eq!(l.consecutive_identical_tool_calls.threshold, 5);
    }

    #[test]
    fn bad_configs_name_the_key() {
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
        let cases: &[Case<'_>] = &[
            ("[turn]\ncancel_grac = \"1s\"\n", &[], "turn.cancel_grac"),
            ("[nope]\n", &[], "nope"),
            (
                "[turn]\ncancel_grace = \"soon\"\n",
                &[],
                "turn.cancel_grace",
            ),
            (
                "[limits]\nmax_sessions = \"many\"\n",
                &[],
                "limits.max_sessions",
            ),
            ("[engine]\ndefault = \"gpt\"\n", &[], "engine.default"),
            ("", &[("TILLER_TURN__BOGUS", "1")], "TILLER_TURN__BOGUS"),
            (
                "[server]\nlisten = \"0.0.0.0:4141\"\nauth = \"none\"\n",
                &[],
                "server.auth",
            ),
            ("[server]\nauth = \"maybe\"\n", &[], "server.auth"),
            (
                "[server]\ntoken = \"a\"\ntoken_file = \"/b\"\n",
                &[],
                "server.token_file",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\n",
                &[],
                "channels.hook.cwd",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\ncwd = \"/\"\n",
                &[],
                "channels.hook.cwd",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\ncwd = \"relative\"\n",
                &[],
                "channels.hook.cwd",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\ncwd = \"/nonexistent/dir\"\n",
                &[],
                "channels.hook.cwd",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\ncwd = \"/tmp\"\nengine = \"gpt\"\n",
                &[],
                "channels.hook.engine",
            ),
            (
                "[channels.hook]\nsecret = \"k\"\ncwd = \"/tmp\"\nsessions = [\"x\"]\n",
                &[],
                "channels.hook.sessions",
            ),
            (
                "[tools]\npass_env = [\"TILLER_SERVER__TOKEN\"]\n",
                &[],
                "tools.pass_env",
            ),
            (
                "[tools]\nmcp_connect_timeout = \"1s\"\n",
                &[],
                "tools.mcp_connect_timeout",
            ),
            (
                "[turn]\nmax_queued_prompts = 0\n",
                &[],
                "turn.max_queued_prompts",
            ),
            (
                "[tools]\npermission_mode = \"yolo\"\n",
                &[],
                "tools.permission_mode",
            ),
            ("this is not toml", &[], "c.toml"),
            ("[engine.gpt]\nmodel = \"x\"\n", &[], "engine.gpt.kind"),
            ("[engine.openai]\n", &[], "engine.openai"),
            (
                "[engine.openai]\nmodel = \"m\"\nbase_url = \"ftp://x\"\n",
                &[],
                "engine.openai.base_url",
            ),
            (
                "[engine.openai]\nmodel = \"m\"\nmodle = \"n\"\n",
                &[],
                "modle",
            ),
            (
                "[engine.scripted]\nkind = \"openai\"\nmodel = \"m\"\n",
                &[],
                "engine.scripted",
            ),
            ("[engine]\ndefualt = \"openai\"\n", &[], "engine.defualt"),
            (
                "[engine.a]\nkind = \"acp\"\n",
                &[],
                "engine.a`: missing field `command`",
            ),
            (
                "[engine.a]\nkind = \"acpx\"\ncommand = \"c\"\n",
                &[],
                "engine.a.kind`: unknown kind `acpx`",
            ),
            (
                "[engine.a]\nkind = \"acp\"\ncommand = \"c\"\nmodel = \"m\"\n",
                &[],
                "engine.a.model",
            ),
            (
                "[engine.a]\nkind = \"acp\"\ncommand = \" \"\n",
                &[],
                "engine.a.command",
            ),
            (
                "[engine.a]\nkind = \"acp\"\ncommand = \"c\"\nsessions_per_process = 0\n",
                &[],
                "engine.a",
            ),
            (
                "[engine.a]\nkind = \"acp\"\ncommand = \"c\"\npass_env = [\"TILLER_SERVER__TOKEN\"]\n",
                &[],
                "engine.a.pass_env",
            ),
            (
                "[engine.a]\nkind = \"acp\"\ncommand = \"c\"\nidle_timeout = \"soon\"\n",
                &[],
                "engine.a.idle_timeout",
            ),
            (
                "[engine.scripted]\nkind = \"acp\"\ncommand = \"c\"\n",
                &[],
                "engine.scripted",
            ),
        ];
        for (text, env, want) in cases {
            let e = load_str(text, env).unwrap_err().0;
            assert!(e.contains(want), "{text:?} -> {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }
}
