//! `tiller`: the daemon and its command line. Thin: parse, configure, wire
//! the crates together, wait for a signal. Business rules live elsewhere.

mod admin;
mod cluster;
mod config;
mod daemon;
mod doctor;
mod handover;
mod metrics;
mod relay;
mod stdio;
mod telemetry;
mod token;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;

/// mimalloc: the daemon allocates for every event on every thread, and
/// glibc's malloc and free were a fifth of the fan-out profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "tiller",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TILLER_COMMIT"), ")"),
    about = "A host for coding-agent sessions (ACP, Web Shell, metrics)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon.
    Serve {
        /// Config file (default: the embedded defaults, see config/tiller.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// HTTP listen address (server.listen).
        #[arg(long)]
        listen: Option<String>,
        /// ACP unix socket path (server.socket).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Data directory (store.data_dir).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Default engine (engine.default).
        #[arg(long)]
        engine: Option<String>,
        /// A file holding the client token (server.token_file). Without
        /// one, a token is generated at first start into
        /// <data-dir>/token; TILLER_SERVER__TOKEN also sets it.
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
    /// Speak ACP on stdio: relay to a running daemon, or run a private one.
    Acp {
        /// `unix:PATH` or `ws://HOST:PORT/acp` (default: the unix socket in
        /// the default data directory).
        #[arg(long)]
        connect: Option<String>,
        /// A file holding the token for a WebSocket daemon (default: the
        /// data directory's token file, or TILLER_SERVER__TOKEN).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Run a private in-process daemon instead of relaying.
        #[arg(long)]
        embedded: bool,
        /// Config file (for --embedded, and to find the default socket).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Data directory (for --embedded, and to find the default socket).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Sessions of the running daemon (through its HTTP API).
    Sessions {
        #[command(flatten)]
        daemon: DaemonArgs,
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// Cron jobs of the running daemon.
    Cron {
        #[command(flatten)]
        daemon: DaemonArgs,
        #[command(subcommand)]
        command: CronCommand,
    },
    /// The goal of a session: continuation turns while it is idle.
    Goal {
        #[command(flatten)]
        daemon: DaemonArgs,
        #[command(subcommand)]
        command: GoalCommand,
    },
    /// Queue a background notification for a session.
    Notify {
        #[command(flatten)]
        daemon: DaemonArgs,
        #[arg(long)]
        session: String,
        #[arg(long)]
        task_id: String,
        #[arg(long)]
        text: String,
    },
    /// Checks the config, the data directory, the store, the socket and
    /// each engine; prints what to fix (exit 1 when something failed).
    Doctor {
        /// Config file (default: the embedded defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Data directory (store.data_dir).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// The cluster sharing the PostgreSQL store (read from the store).
    Cluster {
        /// Config file (default: the embedded defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(subcommand)]
        command: ClusterCommand,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCommand {
    /// Nodes, their addresses, the leases they hold and how long ago
    /// each renewed them (a node past cluster.lease_ttl is lost).
    Status {
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// How admin commands reach the daemon.
#[derive(clap::Args, Debug)]
struct DaemonArgs {
    /// The daemon's HTTP address (default: http://<server.listen>).
    #[arg(long, global = true)]
    url: Option<String>,
    /// A file holding the token (default: TILLER_SERVER__TOKEN, then
    /// the daemon's token file in the data directory).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// Config file to read server.listen and the token's place from.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum GoalCommand {
    /// Set (replace) the goal.
    Set {
        #[arg(long)]
        session: String,
        #[arg(long)]
        objective: String,
        #[arg(long)]
        max_turns: Option<u32>,
    },
    Show {
        #[arg(long)]
        session: String,
    },
    Pause {
        #[arg(long)]
        session: String,
    },
    Resume {
        #[arg(long)]
        session: String,
    },
    Clear {
        #[arg(long)]
        session: String,
    },
}

#[derive(Subcommand, Debug)]
enum CronCommand {
    /// Add a job: SCHEDULE is a cron expression (5 fields, or 6 with
    /// seconds first), evaluated in ZONE (default UTC).
    Add {
        #[arg(long)]
        session: String,
        #[arg(long)]
        schedule: String,
        #[arg(long)]
        tz: Option<String>,
        #[arg(long)]
        prompt: String,
    },
    /// Every job, with its next fire time.
    List,
    /// Remove a job.
    Remove { job: String },
}

#[derive(Subcommand, Debug)]
enum SessionsCommand {
    /// Open sessions, newest first.
    List {
        #[arg(long)]
        cursor: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// A session and its state.
    Show { id: String },
    /// A page of a session's event log.
    History {
        id: String,
        /// Events before this sequence number (default: the newest).
        #[arg(long)]
        before: Option<u64>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Close a session.
    Close { id: String },
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Check a config file (default: the embedded defaults) and the
    /// environment overrides; exit 2 naming the bad key.
    Check { path: Option<PathBuf> },
}

/// Loads the config and applies command-line overrides (as env-style
/// overrides, so errors name the key the same way).
fn load_config(
    path: Option<&std::path::Path>,
    overrides: &[(&str, Option<String>)],
) -> Result<Config, config::ConfigError> {
    let mut env: Vec<(String, String)> = utf8_env().collect();
    for (key, value) in overrides {
        if let Some(v) = value {
            // Quoted so paths and addresses stay strings.
            env.push((key.to_string(), toml_string(v)));
        }
    }
    Config::load(path, env)
}

/// The environment's UTF-8 variables (`std::env::vars` panics on others;
/// those cannot be configuration, and children never get them).
fn utf8_env() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

fn main() -> ExitCode {
    // `tiller __supervise -- sh -c CMD`: how the daemon runs a command so
    // that everything it starts dies with it. Before clap, which would
    // refuse the argument.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == tiller_tools::SUPERVISE_ARG)
    {
        let code = tiller_tools::supervise(&args[2..]);
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            config,
            listen,
            socket,
            data_dir,
            engine,
            token_file,
        } => {
            let overrides = [
                ("TILLER_SERVER__LISTEN", listen),
                (
                    "TILLER_SERVER__SOCKET",
                    socket.map(|p| p.display().to_string()),
                ),
                (
                    "TILLER_STORE__DATA_DIR",
                    data_dir.map(|p| p.display().to_string()),
                ),
                ("TILLER_ENGINE__DEFAULT", engine),
                (
                    "TILLER_SERVER__TOKEN_FILE",
                    token_file.map(|p| p.display().to_string()),
                ),
            ];
            let cfg = match load_config(config.as_deref(), &overrides) {
                Ok(c) => c,
                Err(e) => return config_error(&e),
            };
            let telemetry = match daemon::init_tracing(&cfg) {
                Ok(t) => t,
                Err(e) => return exit(Err(e)),
            };
            let result = runtime().block_on(daemon::serve(cfg));
            drop(telemetry); // the last spans go out before the process ends
            exit(result)
        }
        Command::Cluster {
            config,
            command: ClusterCommand::Status { json },
        } => {
            let cfg = match load_config(config.as_deref(), &[]) {
                Ok(c) => c,
                Err(e) => return exit(Err(e.into())),
            };
            exit(current_thread().block_on(cluster::status(&cfg, json)))
        }
        Command::Doctor { config, data_dir } => {
            let overrides = [(
                "TILLER_STORE__DATA_DIR",
                data_dir.map(|p| p.display().to_string()),
            )];
            let cfg = match load_config(config.as_deref(), &overrides) {
                Ok(c) => c,
                Err(e) => {
                    #[allow(clippy::print_stdout)] // the command's output
                    {
                        println!("FAIL  config: {e}");
                    }
                    return ExitCode::from(1);
                }
            };
            let findings = current_thread().block_on(doctor::run(&cfg));
            let (text, code) = doctor::report(&findings);
            #[allow(clippy::print_stdout)] // the command's output
            {
                println!("{text}");
            }
            ExitCode::from(code)
        }
        Command::Acp {
            connect,
            token_file,
            embedded,
            config,
            data_dir,
        } => {
            let overrides = [(
                "TILLER_STORE__DATA_DIR",
                data_dir.map(|p| p.display().to_string()),
            )];
            let cfg = match load_config(config.as_deref(), &overrides) {
                Ok(c) => c,
                Err(e) => return config_error(&e),
            };
            if embedded {
                let telemetry = match daemon::init_tracing_embedded(&cfg) {
                    Ok(t) => t,
                    Err(e) => return exit(Err(e)),
                };
                // One client, one thread: every hop between the edge, the
                // session and the engine stays on it (no cross-thread
                // wake-ups); the store keeps its own thread.
                let result = current_thread().block_on(daemon::embedded(cfg));
                drop(telemetry);
                exit(result)
            } else {
                let target =
                    connect.unwrap_or_else(|| format!("unix:{}", cfg.socket_path().display()));
                // The unix socket (0600) needs no token.
                let token = if target.starts_with("unix:") {
                    None
                } else {
                    match token::for_client(&cfg, token_file.as_deref()) {
                        Ok(t) => t,
                        Err(e) => {
                            eprintln!("tiller: {e:#}");
                            return ExitCode::from(2);
                        }
                    }
                };
                let rt = runtime();
                let end = rt.block_on(relay::run(&target, token.as_deref()));
                // Stdin is read on a blocking thread that a dropped runtime
                // would wait for, i.e. until the editor writes again.
                rt.shutdown_background();
                match end {
                    Ok(relay::End::Done) => ExitCode::SUCCESS,
                    Ok(relay::End::DaemonGone(why)) => {
                        eprintln!(
                            "tiller: the daemon at {target} went away ({why}); its pending requests were failed"
                        );
                        ExitCode::FAILURE
                    }
                    Err(e) => exit(Err(e)),
                }
            }
        }
        Command::Notify {
            daemon,
            session,
            task_id,
            text,
        } => {
            let client = match admin_client(daemon) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if !is_id(&session) {
                eprintln!("tiller: `{session}` is not a session id");
                return ExitCode::from(2);
            }
            let body = serde_json::json!({ "taskId": task_id, "text": text });
            exit(runtime().block_on(async {
                let v = client
                    .call(
                        reqwest::Method::POST,
                        &format!("/api/sessions/{session}/notifications"),
                        Some(body),
                    )
                    .await?;
                admin::print(&v);
                Ok(())
            }))
        }
        Command::Goal { daemon, command } => {
            let client = match admin_client(daemon) {
                Ok(c) => c,
                Err(code) => return code,
            };
            use reqwest::Method;
            let (session, method, suffix, body) = match command {
                GoalCommand::Set {
                    session,
                    objective,
                    max_turns,
                } => (
                    session,
                    Method::PUT,
                    "",
                    Some(serde_json::json!({ "objective": objective, "maxTurns": max_turns })),
                ),
                GoalCommand::Show { session } => (session, Method::GET, "", None),
                GoalCommand::Pause { session } => (session, Method::POST, "/pause", None),
                GoalCommand::Resume { session } => (session, Method::POST, "/resume", None),
                GoalCommand::Clear { session } => (session, Method::DELETE, "", None),
            };
            if !is_id(&session) {
                eprintln!("tiller: `{session}` is not a session id");
                return ExitCode::from(2);
            }
            exit(runtime().block_on(async {
                let v = client
                    .call(
                        method,
                        &format!("/api/sessions/{session}/goal{suffix}"),
                        body,
                    )
                    .await?;
                admin::print(&v);
                Ok(())
            }))
        }
        Command::Cron { daemon, command } => {
            let client = match admin_client(daemon) {
                Ok(c) => c,
                Err(code) => return code,
            };
            use reqwest::Method;
            let (method, path, body) = match command {
                CronCommand::Add {
                    session,
                    schedule,
                    tz,
                    prompt,
                } => (
                    Method::POST,
                    "/api/cron".to_owned(),
                    Some(serde_json::json!({
                        "sessionId": session, "schedule": schedule, "tz": tz, "prompt": prompt,
                    })),
                ),
                CronCommand::List => (Method::GET, "/api/cron".to_owned(), None),
                CronCommand::Remove { job } => {
                    if !is_id(&job) {
                        eprintln!("tiller: `{job}` is not a job id");
                        return ExitCode::from(2);
                    }
                    (Method::DELETE, format!("/api/cron/{job}"), None)
                }
            };
            exit(runtime().block_on(async {
                let v = client.call(method, &path, body).await?;
                admin::print(&v);
                Ok(())
            }))
        }
        Command::Sessions { daemon, command } => {
            let client = match admin_client(daemon) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if let SessionsCommand::Show { id }
            | SessionsCommand::History { id, .. }
            | SessionsCommand::Close { id } = &command
                && !is_id(id)
            {
                eprintln!("tiller: `{id}` is not a session id");
                return ExitCode::from(2);
            }
            use reqwest::Method;
            let (method, path) = match command {
                SessionsCommand::List { cursor, limit } => (
                    Method::GET,
                    match cursor {
                        Some(c) => format!("/api/sessions?limit={limit}&cursor={c}"),
                        None => format!("/api/sessions?limit={limit}"),
                    },
                ),
                SessionsCommand::Show { id } => (Method::GET, format!("/api/sessions/{id}")),
                SessionsCommand::History { id, before, limit } => (
                    Method::GET,
                    match before {
                        Some(b) => format!("/api/sessions/{id}/history?limit={limit}&before={b}"),
                        None => format!("/api/sessions/{id}/history?limit={limit}"),
                    },
                ),
                SessionsCommand::Close { id } => (Method::DELETE, format!("/api/sessions/{id}")),
            };
            exit(runtime().block_on(async {
                let v = client.call(method, &path, None).await?;
                admin::print(&v);
                Ok(())
            }))
        }
        Command::Config {
            command: ConfigCommand::Check { path },
        } => match load_config(path.as_deref(), &[]) {
            Ok(_) => {
                eprintln!("config ok");
                ExitCode::SUCCESS
            }
            Err(e) => config_error(&e),
        },
    }
}

/// An HTTP client for the daemon named by flags or config.
fn admin_client(daemon: DaemonArgs) -> Result<admin::Client, ExitCode> {
    let cfg = load_config(daemon.config.as_deref(), &[]).map_err(|e| config_error(&e))?;
    let url = daemon
        .url
        .unwrap_or_else(|| format!("http://{}", cfg.server.listen));
    let token = token::for_client(&cfg, daemon.token_file.as_deref()).map_err(|e| {
        eprintln!("tiller: {e:#}");
        ExitCode::from(2)
    })?;
    Ok(admin::Client::new(url, token))
}

/// Ids are interpolated into URL paths: only id characters pass.
fn is_id(id: &str) -> bool {
    !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

fn config_error(e: &config::ConfigError) -> ExitCode {
    eprintln!("tiller: config error: {e}");
    ExitCode::from(2)
}

fn exit(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tiller: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("tiller-worker")
        .build()
        .expect("start the tokio runtime")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tiller-worker")
        .build()
        .expect("start the tokio runtime")
}
