//! Wiring: store, engine, sessions, listeners, signals, shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tiller_acp::AcpConfig;
use tiller_engine::model::ModelEngine;
use tiller_engine::{Engine, ScriptedEngine};
use tiller_session::{Engines, SessionConfig, Sessions};
use tiller_store::Store;
use tokio::sync::{Semaphore, watch};

use crate::config::Config;

/// What is logged: `RUST_LOG` if set and readable, else `[log] level`;
/// ractor's own spans only when asked for by name. ractor wraps every
/// actor's message loop in an info span (`Actor{id=..}`, no use to an
/// operator), entered and left at each message: with 1,000 sessions
/// streaming that was 4% of the daemon's CPU. A span no layer enables
/// costs nothing to enter.
pub fn log_filter(cfg: &Config) -> tracing_subscriber::EnvFilter {
    filter_of(std::env::var("RUST_LOG").ok(), &cfg.log.level)
}

fn filter_of(env: Option<String>, level: &str) -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::filter::LevelFilter;
    let spec = env
        .filter(|v| !v.trim().is_empty() && EnvFilter::try_new(v).is_ok())
        .unwrap_or_else(|| level.to_owned());
    let mut filter = EnvFilter::new(&spec);
    let names = |krate: &str| {
        spec.split(',')
            .any(|d| d.trim().split(['=', ':', '[']).next() == Some(krate))
    };
    // A directive for ractor, only where it quiets something: added to a
    // filter at warn or quieter it would let ractor's warnings through.
    let info = filter
        .max_level_hint()
        .is_none_or(|l| l >= LevelFilter::INFO);
    if !names("ractor") && info {
        filter = filter.add_directive(QUIET_RACTOR.parse().expect("a valid directive"));
    }
    if !names("rmcp") {
        filter = filter.add_directive(QUIET_RMCP.parse().expect("a valid directive"));
    }
    filter
}

/// The directive that keeps ractor's per-actor spans (and its info
/// events) out of the logs.
pub(crate) const QUIET_RACTOR: &str = "ractor=warn";

/// The directive that keeps rmcp's own events out of the logs: its errors
/// name an MCP server's URL whole, credentials and query included (what
/// Tiller reports of a server's failures shows it redacted).
pub(crate) const QUIET_RMCP: &str = "rmcp=off";

/// Logs go to stderr (stdout is ACP's in `tiller acp --embedded`); spans
/// also to an OTLP collector when telemetry is on (keep the guard until
/// the daemon ends).
pub fn init_tracing(cfg: &Config) -> anyhow::Result<Option<crate::telemetry::Guard>> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let (otel, guard) = crate::telemetry::layer(cfg)?.unzip();
    daemon_dispatch(log_filter(cfg), otel.map(|l| l.boxed())).init();
    Ok(guard)
}

/// A layer of the daemon's subscribers.
type Boxed = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// The daemon's subscriber: `filter`'s logs to stderr, and `otel` (the
/// spans exported when telemetry is on).
fn daemon_dispatch(
    filter: tracing_subscriber::EnvFilter,
    otel: Option<Boxed>,
) -> tracing::Dispatch {
    use std::io::IsTerminal as _;
    use tracing_subscriber::{Layer as _, fmt};
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter)
        .boxed();
    layered(std::iter::once(stderr).chain(otel).collect())
}

/// The subscriber of `layers`, those present only. tracing-subscriber's
/// own `Option` layer, when `None`, enables every span and event for the
/// layers beside it: each span no filter wants was built and entered
/// anyway (ractor's per-actor one at every message: 3.3% of the daemon's
/// CPU with 1,000 sessions streaming). A stand-in filtered off would
/// make each callsite the one real layer logs "sometimes", asked again
/// at every hit.
fn layered(layers: Vec<Boxed>) -> tracing::Dispatch {
    use tracing_subscriber::layer::SubscriberExt as _;
    tracing::Dispatch::new(tracing_subscriber::registry().with(layers))
}

/// Logging for `tiller acp --embedded`: an editor shows whatever its agent
/// writes to stderr as agent errors, so everything goes to
/// `<data_dir>/tiller-acp.log` (0600, appended) and only warnings and errors
/// also to stderr.
pub fn init_tracing_embedded(cfg: &Config) -> anyhow::Result<Option<crate::telemetry::Guard>> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let path = cfg.data_dir().join("tiller-acp.log");
    let file = prepare_data_dir(&cfg.data_dir()).and_then(|()| {
        use std::os::unix::fs::OpenOptionsExt as _;
        Ok(std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)?)
    });
    let (file, failed) = match file {
        Ok(f) => (Some(f), None),
        Err(e) => (None, Some(e)),
    };
    let (otel, guard) = crate::telemetry::layer(cfg)?.unzip();
    embedded_dispatch(log_filter(cfg), file, otel.map(|l| l.boxed())).init();
    if let Some(e) = failed {
        tracing::warn!(path = %path.display(), error = %e, "cannot open the log file; logging warnings to stderr only");
    }
    Ok(guard)
}

/// `tiller acp --embedded`'s subscriber: `filter`'s logs to `file` (when
/// it could be opened), warnings and errors to stderr, and `otel`.
fn embedded_dispatch(
    filter: tracing_subscriber::EnvFilter,
    file: Option<std::fs::File>,
    otel: Option<Boxed>,
) -> tracing::Dispatch {
    use tracing_subscriber::{Layer as _, filter::LevelFilter, fmt};
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_default(LevelFilter::WARN)
                .with_target("rmcp", LevelFilter::OFF),
        )
        .boxed();
    let file = file.map(|f| {
        fmt::layer()
            .with_writer(std::sync::Mutex::new(f))
            .with_ansi(false)
            .with_filter(filter)
            .boxed()
    });
    layered(file.into_iter().chain([stderr]).chain(otel).collect())
}

/// The configured engines (`Config::load` has checked them).
fn engines(cfg: &Config) -> Engines {
    let mut all: Vec<Arc<dyn Engine>> = vec![Arc::new(ScriptedEngine)];
    for (name, m) in &cfg.engine.models {
        let model = m.to_model(name).expect("validated by Config::load");
        if let Some(var) = &model.api_key_env
            && std::env::var(var).map_or(true, |v| v.trim().is_empty())
        {
            tracing::warn!(engine = %name, variable = %var, "the engine's API key variable is not set; its turns will fail until it is");
        }
        all.push(Arc::new(ModelEngine::new(model)));
    }
    for (name, a) in &cfg.engine.agents {
        let acp = a
            .to_acp(name, std::env::vars(), cfg.turn.cancel_grace)
            .expect("validated by Config::load");
        all.push(Arc::new(tiller_engine::acp::AcpEngine::new(acp)));
    }
    Engines::new(&cfg.engine.default, all)
}

fn acp_config(cfg: &Config) -> AcpConfig {
    AcpConfig {
        max_message_bytes: cfg.limits.max_message_bytes,
        subscriber_queue: cfg.limits.subscriber_queue,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        forward: None,
    }
}

/// Creates the data directory 0700 (or tightens an existing one): it
/// holds the token, the database and the socket.
fn prepare_data_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("cannot read the data directory {}", dir.display()))?;
    // Made first by someone else (in a shared `/tmp`), it would be theirs
    // to read, or to fill with a token, a database and a socket of theirs.
    // Root's is trusted (a container's or a mount's root) unless someone
    // else may write in it: everyone, or a group the daemon is not in (a
    // volume's `fsGroup` is one of its groups; its other members, if
    // any, are trusted).
    let me = rustix::process::geteuid().as_raw();
    let mode = meta.permissions().mode();
    let in_group = |gid: u32| {
        rustix::process::getegid().as_raw() == gid
            || rustix::process::getgroups().is_ok_and(|gs| gs.iter().any(|g| g.as_raw() == gid))
    };
    let roots_closed =
        meta.uid() == 0 && mode & 0o002 == 0 && (mode & 0o020 == 0 || in_group(meta.gid()));
    if meta.uid() != me && !roots_closed {
        anyhow::bail!(
            "the data directory {} belongs to another user (uid {}), who could read or replace \
             its token, database and socket; use a directory of your own (store.data_dir)",
            dir.display(),
            meta.uid()
        );
    }
    if meta.permissions().mode() & 0o077 != 0 {
        match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
            Ok(()) => {
                tracing::warn!(dir = %dir.display(), "the data directory was open to other users; it is now 0700");
            }
            // A mount that keeps its own modes (vfat, CIFS, a volume's
            // root): as before, a warning.
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "the data directory is open to other users and cannot be tightened");
            }
        }
    }
    Ok(())
}

/// Makes the daemon's `/proc/<pid>` files (its environment with the model
/// keys and token, its memory, its open files) unreadable to the commands
/// its sessions run, which share its user: they are not dumpable, so the
/// kernel gives those files to root. Commands get their own, dumpable
/// process image at exec.
fn protect_process() {
    use rustix::process::{DumpableBehavior, set_dumpable_behavior};
    if let Err(e) = set_dumpable_behavior(DumpableBehavior::NotDumpable) {
        tracing::warn!(error = %e, "cannot make the daemon undumpable; its children may read its environment");
    }
}

/// Raises the soft limit on open files to the hard one: every connection
/// and session's files count against it.
fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        l.current = l.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, l) {
            tracing::debug!(error = %e, "cannot raise the open-files limit");
        }
    }
}

/// This node's id: `cluster.node_id`, else the one kept in
/// `<data_dir>/node-id` (made at first start, so a restarted node is the
/// same node and settles its own prompts `daemon_restarted`).
fn node_id(cfg: &Config) -> anyhow::Result<String> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    if !cfg.cluster.node_id.is_empty() {
        return Ok(cfg.cluster.node_id.clone());
    }
    let path = cfg.data_dir().join("node-id");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
    let id = format!("node-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(f, "{id}").with_context(|| format!("cannot write {}", path.display()))?;
    Ok(id)
}

async fn start_sessions(
    cfg: &Config,
    db: &std::path::Path,
    delivery_wake: Option<Arc<tokio::sync::Notify>>,
    inline_store: bool,
    advertise: Option<String>,
) -> anyhow::Result<Sessions> {
    prepare_data_dir(&cfg.data_dir())?;
    if let Some(dir) = db.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // No session's file tools may touch the daemon's own data, even when
    // its directory contains it (a session in $HOME): the database with
    // SQLite's files beside it, before any of them exists.
    let mut own = vec![
        cfg.data_dir(),
        db.to_owned(),
        cfg.token_path(),
        cfg.socket_path(),
    ];
    own.extend(["-wal", "-shm", "-journal"].map(|end| {
        let mut name = db.as_os_str().to_owned();
        name.push(end);
        std::path::PathBuf::from(name)
    }));
    own.extend(cfg.source.clone());
    tiller_tools::protect(&own);
    let postgres = cfg.store.postgres_url().map_err(anyhow::Error::msg)?;
    let cluster = match postgres {
        Some(_) => Some(tiller_session::ClusterConfig {
            node: node_id(cfg)?,
            address: if cfg.cluster.advertise.is_empty() {
                advertise.unwrap_or_default()
            } else {
                cfg.cluster.advertise.clone()
            },
            lease_ttl: cfg.cluster.lease_ttl,
            renew_every: cfg.cluster.renew_every,
        }),
        None => None,
    };
    if let Some(c) = &cluster {
        let host = c
            .address
            .split_once("://")
            .map_or("", |(_, rest)| rest)
            .split(['/', ':'])
            .next()
            .unwrap_or("");
        if c.address.is_empty() {
            tracing::warn!(
                "this node advertises no address: the others cannot send it requests for its sessions (set [cluster] advertise)"
            );
        } else if host == "localhost" || host.starts_with("127.") || c.address.contains("://[::1]")
        {
            tracing::warn!(address = %c.address, "this node advertises a loopback address: only nodes on this machine can reach it (set [cluster] advertise)");
        }
    }
    let schema = cfg.store.schema.clone();
    let store = {
        let db = db.to_owned();
        tokio::task::spawn_blocking(move || match postgres {
            Some(url) => Store::open_postgres(&url, &schema),
            None if inline_store => Store::open_inline(&db),
            None => Store::open(&db),
        })
        .await
        .context("the store's opening task failed")??
    };
    let sessions = Sessions::start(
        store,
        engines(cfg),
        SessionConfig {
            turn: cfg.turn_config(),
            max_sessions: cfg.limits.max_sessions,
            loops: cfg.loop_config(),
            permission_mode: cfg.permission_mode(),
            notification_cap: cfg.limits.max_queued_notifications,
            delivery: cfg.delivery_policy(),
            delivery_wake,
            budget: Default::default(),
            cluster,
            park_after: (!cfg.limits.park_after.is_zero()).then_some(cfg.limits.park_after),
            tools: Arc::new(cfg.tools_config(
                crate::utf8_env(),
                // The running binary, even if it is replaced on disk.
                Some(std::path::PathBuf::from("/proc/self/exe")),
            )),
        },
    )
    .await?;
    Ok(sessions)
}

/// `tiller serve`.
pub async fn serve(cfg: Config) -> anyhow::Result<()> {
    protect_process();
    raise_fd_limit();
    let metrics = if cfg.metrics.enabled {
        Some(crate::metrics::install(&cfg)?)
    } else {
        None
    };
    prepare_data_dir(&cfg.data_dir())?;
    let token = crate::token::for_daemon(&cfg)?;
    if token.is_none() {
        tracing::warn!(
            listen = %cfg.server.listen,
            "server.auth = \"none\": any local user can use this daemon over TCP"
        );
    }

    let db = cfg.db_path();
    let delivery_wake = Arc::new(tokio::sync::Notify::new());
    // Bound first: a node advertises the address it really listens on.
    let listener = tokio::net::TcpListener::bind(cfg.server.listen)
        .await
        .with_context(|| format!("cannot listen on {} (server.listen)", cfg.server.listen))?;
    let bound = listener.local_addr()?;
    let sessions = start_sessions(
        &cfg,
        &db,
        Some(delivery_wake.clone()),
        false,
        Some(format!("http://{bound}")),
    )
    .await?;
    let mut acp = acp_config(&cfg);
    if cfg.store.kind == "postgres" {
        // A cluster: connections naming a session another node serves are
        // handed to it (every node shares the token).
        acp.forward = Some(crate::handover::forwarder(
            token.as_ref().map(|(t, _)| t.clone()),
        ));
    }
    let permits = Arc::new(Semaphore::new(cfg.limits.max_connections));
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);

    let socket_path = cfg.socket_path();
    let unix = bind_unix(&socket_path)?;

    let channels = cfg
        .channels
        .iter()
        .map(|(name, ch)| {
            let channel = tiller_http::channels::Channel {
                secret: ch.secret.as_bytes().to_vec(),
                cwd: ch.cwd.clone(),
                engine: Some(ch.engine.clone()).filter(|e| !e.is_empty()),
                sessions: ch
                    .sessions
                    .iter()
                    .filter_map(|s| tiller_core::SessionId::parse(s))
                    .collect(),
            };
            (name.clone(), channel)
        })
        .collect();
    let state = tiller_http::AppState {
        channels: Arc::new(tiller_http::channels::Channels::new(
            channels,
            cfg.server.channel_replay_window,
        )),
        sessions: sessions.clone(),
        acp: acp.clone(),
        metrics,
        permits: permits.clone(),
        ready: ready.clone(),
        subscriber_queue: cfg.limits.subscriber_queue,
        auth: tiller_http::auth::Auth::new(tiller_http::auth::AuthConfig {
            token: token.as_ref().map(|(t, _)| t.clone()),
            bind: Some(bound),
            allowed_hosts: {
                // The other nodes of a cluster name this one by the
                // address it advertises.
                let mut hosts = cfg.server.allowed_hosts.clone();
                let advertised = cfg
                    .cluster
                    .advertise
                    .split_once("://")
                    .map(|(_, rest)| rest);
                if let Some(host) = advertised.and_then(|r| r.split('/').next())
                    && cfg.store.kind == "postgres"
                    && !host.is_empty()
                {
                    hosts.push(host.to_owned());
                }
                hosts
            },
            allowed_origins: cfg.server.allowed_origins.clone(),
        }),
        max_body_bytes: cfg.limits.max_message_bytes,
        body_timeout: cfg.limits.http_body_timeout,
    };
    let limits = tiller_http::serve::Limits {
        max_connections: cfg.limits.max_http_connections,
        header_timeout: cfg.limits.http_header_timeout,
        write_stall: tiller_acp::WRITE_STALL,
    };
    let http = tokio::spawn(tiller_http::serve::serve(
        listener,
        tiller_http::router(state),
        limits,
        stop_rx.clone(),
        Duration::from_secs(2),
    ));
    let deliveries = tokio::spawn(tiller_http::delivery::run(
        sessions.clone(),
        cfg.delivery_policy(),
        delivery_wake,
        stop_rx.clone(),
    ));
    let unix_task = tokio::spawn(tiller_acp::serve_unix(
        unix,
        sessions.clone(),
        acp,
        permits,
        stop_rx,
    ));

    ready.store(true, Ordering::Release);
    let web = web_shell_url(bound);
    tracing::info!(
        listen = %bound,
        socket = %socket_path.display(),
        store = %db.display(),
        engine = %cfg.engine.default,
        version = env!("CARGO_PKG_VERSION"),
        web_shell = %web,
        "tiller is ready"
    );
    announce(&web, token.as_ref());

    wait_for_signal().await;
    tracing::info!("shutting down: settling in-flight turns");
    ready.store(false, Ordering::Release);
    let _ = stop_tx.send(true);
    sessions.shutdown().await;
    let _ = unix_task.await;
    let _ = deliveries.await;
    let _ = std::fs::remove_file(&socket_path);
    // Open WebSockets do not end on their own; `serve` gives them a moment.
    let _ = tokio::time::timeout(Duration::from_secs(3), http).await;
    tracing::info!("stopped");
    Ok(())
}

/// Where a browser opens the Web Shell.
fn web_shell_url(bound: std::net::SocketAddr) -> String {
    let host = match bound.ip() {
        ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };
    format!("http://{host}:{}/", bound.port())
}

/// Tells the person who started the daemon where to open the Web Shell.
/// The link carrying the token goes to a terminal only (never the log):
/// otherwise the line names the file that holds the token.
fn announce(web: &str, token: Option<&(String, crate::token::Source)>) {
    use std::io::{IsTerminal as _, Write as _};
    let line = match token {
        None => format!("Web Shell: {web}"),
        Some((t, _)) if std::io::stderr().is_terminal() => format!("Web Shell: {web}?token={t}"),
        Some((_, crate::token::Source::Configured)) => {
            format!("Web Shell: {web}?token=<server.token>")
        }
        Some((_, crate::token::Source::File(p) | crate::token::Source::Generated(p))) => {
            format!("Web Shell: {web}?token=<the token in {}>", p.display())
        }
    };
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `tiller acp --embedded`: a private daemon speaking ACP on stdio.
pub async fn embedded(cfg: Config) -> anyhow::Result<()> {
    protect_process();
    raise_fd_limit();
    let db = if cfg.store.path.is_empty() {
        cfg.data_dir().join("embedded.db")
    } else {
        cfg.db_path()
    };
    // Embedded: no delivery worker runs, so deliveries wait in the store
    // for the next `tiller serve` on the same data. One client on one
    // thread: the store runs inline on it (no message crosses a thread).
    let sessions = start_sessions(&cfg, &db, None, true, None).await?;
    // On a task of its own, not in the runtime's `block_on` future: a
    // current-thread runtime polls its I/O driver (an `epoll_wait`) before
    // each poll of that future, so the connection read there cost one a
    // message.
    let serve = tokio::spawn(tiller_acp::serve_stream(
        sessions.clone(),
        acp_config(&cfg),
        "stdio",
        crate::stdio::stdin(),
        crate::stdio::stdout(),
    ));
    if let Err(e) = serve.await
        && e.is_panic()
    {
        std::panic::resume_unwind(e.into_panic());
    }
    sessions.shutdown().await;
    Ok(())
}

fn bind_unix(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another daemon is listening on {} (server.socket); stop it or choose another socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path).with_context(|| {
        format!(
            "cannot bind the ACP socket {} (server.socket)",
            path.display()
        )
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt as _;

    /// A data directory another user owns (made first in a shared `/tmp`,
    /// say) could hand that user the token, the database and the socket:
    /// the daemon refuses it, and changes nothing in it. As root the
    /// directory is given to `nobody`; otherwise `/tmp`, which everyone may write in.
    #[test]
    fn a_data_directory_another_user_owns_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let d = tempfile::tempdir().unwrap();
        let theirs = d.path().join("tiller");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o777)).unwrap();
        let nobody = rustix::fs::Uid::from_raw(65534);
        let dir = match rustix::fs::chown(&theirs, Some(nobody), None) {
            Ok(()) => theirs.clone(),
            // Not root: `/tmp` is root's and everyone may write in it.
            Err(_) => std::path::PathBuf::from("/tmp"),
        };
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        let e = super::prepare_data_dir(&dir).expect_err("another user's directory");
        assert!(format!("{e:#}").contains("another user"), "{e:#}");
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode(), mode);
        // One's own is taken and tightened, as before.
        let mine = d.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
        super::prepare_data_dir(&mine).unwrap();
        assert_eq!(
            std::fs::metadata(&mine).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }

    /// Whether a span of `target` at info is built under the filter.
    fn enabled(env: Option<&str>, level: &str, target_is_ractor: bool) -> bool {
        let filter = super::filter_of(env.map(str::to_owned), level);
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::Layer::with_filter(tracing_subscriber::fmt::layer(), filter),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = if target_is_ractor {
                tracing::info_span!(target: "ractor::actor", "Actor")
            } else {
                tracing::info_span!("session")
            };
            !span.is_disabled()
        })
    }

    /// Whether an error event of `target` is written under the filter.
    fn errors_of(target_is_rmcp: bool, env: Option<&str>, level: &str) -> bool {
        let filter = super::filter_of(env.map(str::to_owned), level);
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::Layer::with_filter(tracing_subscriber::fmt::layer(), filter),
        );
        tracing::subscriber::with_default(subscriber, || {
            if target_is_rmcp {
                tracing::enabled!(target: "rmcp::transport::worker", tracing::Level::ERROR)
            } else {
                tracing::enabled!(target: "tiller_tools::mcp", tracing::Level::ERROR)
            }
        })
    }

    fn rmcp_errors(env: Option<&str>, level: &str) -> bool {
        errors_of(true, env, level)
    }

    #[test]
    fn rmcp_s_own_events_are_off_unless_asked_for_by_name() {
        assert!(!rmcp_errors(None, "info"));
        assert!(!rmcp_errors(Some("trace"), "info"));
        assert!(!rmcp_errors(None, "warn"));
        assert!(rmcp_errors(Some("info,rmcp=error"), "info"));
        assert!(rmcp_errors(None, "warn,rmcp::transport=debug"));
        // Tiller's own errors still are.
        assert!(errors_of(false, None, "info"));
        assert!(errors_of(false, None, "warn"));
    }

    #[test]
    fn ractors_per_actor_spans_are_off_unless_asked_for_by_name() {
        assert!(!enabled(None, "info", true));
        assert!(enabled(None, "info", false));
        assert!(!enabled(Some("debug"), "info", true));
        assert!(enabled(Some("debug"), "info", false));
        assert!(enabled(Some("info,ractor=info"), "warn", true));
        assert!(enabled(None, "info,ractor=debug", true));
        assert!(enabled(Some("ractor::actor=trace"), "info", true));
        // A target that merely contains the word is not ractor.
        assert!(!enabled(Some("info,extractor=info"), "info", true));
        // An unreadable RUST_LOG falls back to the configured level.
        assert!(!enabled(Some("=!bad["), "info", true));
        assert!(enabled(Some("=!bad["), "info", false));
        assert!(enabled(Some("ractor=verbose"), "info,ractor=info", true));
    }

    /// Whether a warning from ractor is written under the filter.
    fn ractor_warns(env: Option<&str>, level: &str) -> bool {
        use std::sync::{Arc, Mutex};
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = out.clone();
        let filter = super::filter_of(env.map(str::to_owned), level);
        let layer = tracing_subscriber::fmt::layer().with_writer(move || Sink(sink.clone()));
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::Layer::with_filter(layer, filter));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "ractor::actor", "a warning");
        });
        !out.lock().unwrap().is_empty()
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A span's callsite: its metadata, the interest a subscriber
    /// registers in it ignored.
    struct Callsite(&'static tracing::Metadata<'static>);

    impl tracing::callsite::Callsite for Callsite {
        fn set_interest(&self, _: tracing::subscriber::Interest) {}
        fn metadata(&self) -> &tracing::Metadata<'_> {
            self.0
        }
    }

    /// An info span named `name` of `target`.
    macro_rules! info_span_site {
        ($name:literal, $target:literal) => {{
            static SITE: Callsite = Callsite(&META);
            static META: tracing::Metadata<'static> = tracing::Metadata::new(
                $name,
                $target,
                tracing::Level::INFO,
                None,
                None,
                None,
                tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&SITE)),
                tracing::metadata::Kind::SPAN,
            );
            &META
        }};
    }

    /// The spans the daemon's own subscribers build, telemetry off, its
    /// log file open or not: none that no layer logs. ractor's per-actor
    /// span, entered and left at every message, cost 3.3% of the daemon's
    /// CPU with 1,000 sessions streaming while the filter alone left it
    /// out. Each subscriber is asked for its interest in a callsite (what
    /// decides, for the process's one subscriber, whether its spans are
    /// built and whether each hit asks the filters again): a span built
    /// here would answer for every subscriber alive in the test process.
    #[test]
    fn the_daemon_s_subscribers_build_no_span_that_nothing_logs() {
        use tracing::subscriber::Interest;
        let actor = info_span_site!("Actor", "ractor::actor");
        let session = info_span_site!("session", "tiller_session::registry");
        let dir = tempfile::tempdir().unwrap();
        let file = || Some(std::fs::File::create(dir.path().join("log")).unwrap());
        let kind = |i: Interest| {
            if i.is_always() {
                "always"
            } else if i.is_never() {
                "never"
            } else {
                "sometimes"
            }
        };
        for level in ["info", "warn"] {
            let filter = || super::filter_of(None, level);
            let info = level == "info";
            // What each says of Tiller's info span: the log file wants it
            // and stderr not, so that one is asked again at each hit.
            let dispatches = [
                (
                    "serve",
                    super::daemon_dispatch(filter(), None),
                    if info { "always" } else { "never" },
                ),
                (
                    "embedded",
                    super::embedded_dispatch(filter(), file(), None),
                    if info { "sometimes" } else { "never" },
                ),
                (
                    "embedded without its log file",
                    super::embedded_dispatch(filter(), None, None),
                    "never",
                ),
            ];
            for (name, dispatch, logged) in dispatches {
                let of = |site| kind(dispatch.register_callsite(site));
                assert_eq!(of(actor), "never", "{name} at {level}: ractor's span");
                assert_eq!(of(session), logged, "{name} at {level}: Tiller's info span");
            }
        }
    }

    #[test]
    fn a_quieter_filter_stays_as_quiet_for_ractor() {
        assert!(!ractor_warns(Some("off"), "info"));
        assert!(!ractor_warns(None, "error"));
        assert!(ractor_warns(None, "warn"));
        assert!(ractor_warns(None, "info"));
    }
}
