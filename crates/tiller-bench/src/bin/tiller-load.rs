//! Load generator for a running `tiller serve` (not a test: it prints
//! figures and asserts nothing about speed). It starts the daemon itself
//! (`TILLER_BIN`, default `target/release/tiller`) on a fresh data
//! directory and speaks ACP over the unix socket as raw JSON lines, so the
//! client costs little next to the daemon on the same machine.
//!
//!   cargo run --release -p tiller-bench --bin tiller-load -- [--sessions 1000] [--connections 50] [--chunks 250] [--cancels 200] [--replay 200000]
//!
//! Prints: session creation rate (pipelined over the connections); fan-out
//! (every session streaming at once: `session/update`s delivered per
//! second, daemon CPU per update), then the same with one connection that
//! never reads; `session/load` replay of a long session;
//! `session/cancel` -> `cancelled` latency while every session streams,
//! at a model's pace (100 chunks a second each) and flat out (both cores
//! saturated), with the daemon's CPU per update meanwhile; the daemon's
//! graceful stop.

#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Mutex, oneshot};

type Waiters = Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// One ACP connection: requests by id, `session/update`s counted.
struct Conn {
    write: Mutex<OwnedWriteHalf>,
    next: AtomicU64,
    waiters: Waiters,
    updates: Arc<AtomicU64>,
}

impl Conn {
    async fn open(socket: &Path) -> Arc<Conn> {
        let (read, write) = UnixStream::connect(socket)
            .await
            .expect("connect to the daemon's socket")
            .into_split();
        let conn = Arc::new(Conn {
            write: Mutex::new(write),
            next: AtomicU64::new(1),
            waiters: Default::default(),
            updates: Default::default(),
        });
        tokio::spawn(read_loop(read, conn.waiters.clone(), conn.updates.clone()));
        conn.request(
            "initialize",
            json!({ "protocolVersion": 1, "clientCapabilities": {} }),
        )
        .await;
        conn
    }

    async fn send(&self, msg: &Value) {
        let mut line = serde_json::to_vec(msg).expect("serialize");
        line.push(b'\n');
        let _ = self.write.lock().await.write_all(&line).await;
    }

    async fn request(&self, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().expect("poisoned").insert(id, tx);
        self.send(&json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }))
            .await;
        rx.await.expect("the daemon answered")
    }

    async fn new_session(&self) -> String {
        let res = self
            .request("session/new", json!({ "cwd": "/tmp", "mcpServers": [] }))
            .await;
        res["result"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("session/new failed: {res}"))
            .to_owned()
    }

    async fn prompt(&self, session: &str, script: &Value) -> Value {
        let text = json!({ "script": script }).to_string();
        self.request(
            "session/prompt",
            json!({ "sessionId": session, "prompt": [{ "type": "text", "text": text }] }),
        )
        .await
    }
}

async fn read_loop(read: OwnedReadHalf, waiters: Waiters, updates: Arc<AtomicU64>) {
    let mut lines = BufReader::with_capacity(1 << 16, read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.contains("\"session/update\"") {
            updates.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if msg.get("method").is_some() {
            continue; // another notification
        }
        if let Some(id) = msg["id"].as_u64()
            && let Some(tx) = waiters.lock().expect("poisoned").remove(&id)
        {
            let _ = tx.send(msg);
        }
    }
}

/// Process CPU in seconds (utime + stime of every thread, live or ended).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

struct Args {
    sessions: usize,
    connections: usize,
    chunks: usize,
    cancels: usize,
    replay: usize,
}

fn args() -> Args {
    let mut a = Args {
        sessions: 1000,
        connections: 50,
        chunks: 250,
        cancels: 200,
        replay: 200_000,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v = || pair.get(1).and_then(|v| v.parse().ok()).expect("a number");
        match pair[0].as_str() {
            "--sessions" => a.sessions = v(),
            "--connections" => a.connections = v(),
            "--chunks" => a.chunks = v(),
            "--cancels" => a.cancels = v(),
            "--replay" => a.replay = v(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

struct Daemon {
    child: tokio::process::Child,
    pid: u32,
    socket: PathBuf,
    /// The HTTP listener's address, from the ready line.
    http: String,
    _dir: PathBuf,
}

async fn start_daemon() -> Daemon {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = std::env::var_os("TILLER_BIN")
        .map_or_else(|| repo.join("target/release/tiller"), PathBuf::from);
    let dir = std::env::temp_dir().join(format!("tiller-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the data directory");
    let mut child = tokio::process::Command::new(&bin)
        .args(["serve", "--data-dir"])
        .arg(&dir)
        .args([
            "--listen",
            &std::env::var("TILLER_LOAD_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into()),
        ])
        .env("RUST_LOG", "warn,tiller::daemon=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let mut err = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let http = loop {
        match err.next_line().await {
            Ok(Some(l)) if l.contains("tiller is ready") => {
                break l
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix("listen="))
                    .expect("the ready line names the HTTP listener")
                    .to_owned();
            }
            Ok(Some(_)) => {}
            _ => panic!("the daemon did not start"),
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = err.next_line().await {} });
    let pid = child.id().expect("pid");
    Daemon {
        child,
        pid,
        socket: dir.join("tiller.sock"),
        http,
        _dir: dir,
    }
}

/// The sums and counts of the daemon's store-thread histograms, and the
/// buckets of the two that time a cancel's parts inside the daemon, read
/// from its `/metrics` (with the data directory's token).
#[derive(Clone, Default)]
struct StoreTimes {
    /// Seconds and number of commits of appends.
    writes: (f64, f64),
    /// Seconds and number of checkpoints of SQLite's log the store thread
    /// ran itself (committing nothing meanwhile).
    checkpoints: (f64, f64),
    /// Seconds and number of the checkpoint thread's passes (beside the
    /// commits).
    passes: (f64, f64),
    /// `tiller_cancel_latency_seconds`: from the cancel reaching its
    /// session to the turn's end decided.
    decided: Buckets,
    /// `tiller_settle_latency_seconds`: from the input that settled a turn
    /// (for a cancelled one, the engine's stop) to its end committed and
    /// handed to the prompt's request.
    settled: Buckets,
}

/// A histogram's cumulative buckets: upper bound in seconds, count.
#[derive(Clone, Default)]
struct Buckets(Vec<(f64, f64)>);

impl Buckets {
    fn read(body: &str, name: &str) -> Buckets {
        let prefix = format!("{name}_bucket{{le=\"");
        Buckets(
            body.lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .filter_map(|l| {
                    let (le, n) = l.split_once("\"} ")?;
                    Some((le.parse().ok()?, n.trim().parse().ok()?))
                })
                .collect(),
        )
    }

    /// What was recorded between `before` and `self` (a bucket the earlier
    /// scrape lacked held nothing then).
    fn since(&self, before: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|(le, n)| {
                    let was = before.0.iter().find(|(b, _)| b == le).map_or(0.0, |b| b.1);
                    (*le, n - was)
                })
                .collect(),
        )
    }

    /// The least bucket bound, in milliseconds, that holds `p`% of what
    /// was recorded (`inf` past the last bound; `-` when nothing was).
    fn at_most(&self, p: f64) -> String {
        let Some(&(_, all)) = self.0.last() else {
            return "-".into();
        };
        if all <= 0.0 {
            return "-".into();
        }
        self.0
            .iter()
            .find(|(_, n)| *n >= all * p / 100.0)
            .map_or("-".into(), |(le, _)| format!("{}", le * 1000.0))
    }
}

async fn store_times(d: &Daemon) -> StoreTimes {
    use tokio::io::AsyncReadExt;
    let token = std::fs::read_to_string(d._dir.join("token")).expect("the daemon's token file");
    let mut s = tokio::net::TcpStream::connect(&d.http)
        .await
        .expect("connect to the daemon's HTTP listener");
    let req = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        d.http,
        token.trim()
    );
    s.write_all(req.as_bytes()).await.expect("send the request");
    let mut body = String::new();
    s.read_to_string(&mut body).await.expect("read /metrics");
    let sum = |name: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let by = |name: &str, by: &str| sum(&format!("{name}{{by=\"{by}\"}}"));
    StoreTimes {
        writes: (
            sum("tiller_store_write_seconds_sum"),
            sum("tiller_store_write_seconds_count"),
        ),
        checkpoints: (
            by("tiller_store_checkpoint_seconds_sum", "writer"),
            by("tiller_store_checkpoint_seconds_count", "writer"),
        ),
        passes: (
            by("tiller_store_checkpoint_seconds_sum", "thread"),
            by("tiller_store_checkpoint_seconds_count", "thread"),
        ),
        decided: Buckets::read(&body, "tiller_cancel_latency_seconds"),
        settled: Buckets::read(&body, "tiller_settle_latency_seconds"),
    }
}

/// A script saying `text` `n` times (nested: a `repeat` takes at most
/// 10,000; `n` is rounded down to a multiple of 10,000 above that).
fn saying(n: usize, text: &str) -> Value {
    let say = json!([{ "say": text }]);
    if n <= 10_000 {
        return json!([{ "repeat": { "times": n, "steps": say } }]);
    }
    json!([{ "repeat": { "times": n / 10_000, "steps": [{ "repeat": { "times": 10_000, "steps": say } }] } }])
}

fn pct(sorted: &[f64], p: usize) -> f64 {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// Every session prompts at once; waits for every answer.
async fn stream_all(conns: &[(Arc<Conn>, Vec<String>)], script: &Value) -> (Duration, u64) {
    let before: u64 = conns
        .iter()
        .map(|(c, _)| c.updates.load(Ordering::Relaxed))
        .sum();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (c, sessions) in conns {
        for s in sessions {
            let (c, s, script) = (c.clone(), s.clone(), script.clone());
            tasks.push(tokio::spawn(async move {
                let res = c.prompt(&s, &script).await;
                assert_eq!(res["result"]["stopReason"], "end_turn", "{res}");
            }));
        }
    }
    for t in tasks {
        t.await.expect("prompt task");
    }
    let wall = t0.elapsed();
    // Updates written before the answers are read by now (same stream).
    let after: u64 = conns
        .iter()
        .map(|(c, _)| c.updates.load(Ordering::Relaxed))
        .sum();
    (wall, after - before)
}

/// What [`cancel_latency`] measured.
struct Cancels {
    /// Milliseconds from `session/cancel` sent to the prompt's answer, sorted.
    times: Vec<f64>,
    /// Milliseconds from the prompt sent to its first chunk, sorted.
    first: Vec<f64>,
    /// Prompts answered other than `cancelled`.
    missed: usize,
    /// `session/update`s the background sessions were delivered meanwhile.
    updates_per_s: f64,
    /// The daemon's CPU meanwhile, in cores.
    cores: f64,
    /// The store thread's commits and checkpoints meanwhile.
    store: StoreTimes,
    /// How long the probe ran, in seconds.
    wall: f64,
}

/// On a connection of its own, `cancels` times: a prompt that would
/// sleep ten seconds after its first chunk is cancelled once that chunk
/// arrived. Returns the cancels' and the first chunks' latencies in
/// milliseconds, sorted, and how many prompts ended other than cancelled.
async fn probe_cancels(socket: &Path, cancels: usize) -> (Vec<f64>, Vec<f64>, usize) {
    let probe = Conn::open(socket).await;
    let session = probe.new_session().await;
    // The session's command list follows its creation's answer: counted
    // before the first prompt, so the first chunk below is the prompt's.
    while probe.updates.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (mut times, mut first) = (Vec::new(), Vec::new());
    let mut missed = 0;
    for _ in 0..cancels {
        let seen = probe.updates.load(Ordering::Relaxed);
        let sent = Instant::now();
        let p = {
            let (probe, session) = (probe.clone(), session.clone());
            tokio::spawn(async move {
                probe
                    .prompt(&session, &json!([{ "say": "x" }, { "sleep_ms": 10_000 }]))
                    .await
            })
        };
        // Cancelled once it runs (its first chunk arrived).
        while probe.updates.load(Ordering::Relaxed) == seen {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        first.push(sent.elapsed().as_secs_f64() * 1000.0);
        let t0 = Instant::now();
        probe
            .send(&json!({ "jsonrpc": "2.0", "method": "session/cancel", "params": { "sessionId": session } }))
            .await;
        let res = p.await.expect("prompt task");
        times.push(t0.elapsed().as_secs_f64() * 1000.0);
        if res["result"]["stopReason"] != "cancelled" {
            if missed == 0 {
                println!("a cancel that did not end its turn: the prompt was answered {res}");
            }
            missed += 1; // reported: a cancel that did not end the turn
        }
    }
    times.sort_by(f64::total_cmp);
    first.sort_by(f64::total_cmp);
    (times, first, missed)
}

/// `session/cancel` -> `cancelled` latency of a prompt on a connection of
/// its own, `cancels` times, while every session of `groups` runs the
/// script `background(i)` (its `i`th session); the background is
/// cancelled and settled before it returns.
async fn cancel_latency(
    d: &Daemon,
    groups: &[(Arc<Conn>, Vec<String>)],
    background: &dyn Fn(usize) -> Value,
    cancels: usize,
) -> Cancels {
    let mut running = Vec::new();
    for (i, (c, s)) in groups
        .iter()
        .flat_map(|(c, ss)| ss.iter().map(move |s| (c, s)))
        .enumerate()
    {
        let (c, s, script) = (c.clone(), s.clone(), background(i));
        running.push(tokio::spawn(async move { c.prompt(&s, &script).await }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let delivered = || {
        groups
            .iter()
            .map(|(c, _)| c.updates.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let store0 = store_times(d).await;
    let (updates0, cpu0, t0) = (delivered(), cpu_seconds(d.pid), Instant::now());
    // The probe runs on a thread and a runtime of its own: what it times
    // is the daemon's answer, not its turn among this process's readers
    // of the background streams.
    let socket = d.socket.clone();
    let probe = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the probe's runtime")
            .block_on(probe_cancels(&socket, cancels))
    });
    let (times, first, missed) = tokio::task::spawn_blocking(move || probe.join())
        .await
        .expect("join")
        .expect("the probe thread");
    let wall = t0.elapsed().as_secs_f64();
    let (updates, cpu) = (delivered() - updates0, cpu_seconds(d.pid) - cpu0);
    let store1 = store_times(d).await;
    let store = StoreTimes {
        writes: (
            store1.writes.0 - store0.writes.0,
            store1.writes.1 - store0.writes.1,
        ),
        checkpoints: (
            store1.checkpoints.0 - store0.checkpoints.0,
            store1.checkpoints.1 - store0.checkpoints.1,
        ),
        passes: (
            store1.passes.0 - store0.passes.0,
            store1.passes.1 - store0.passes.1,
        ),
        decided: store1.decided.since(&store0.decided),
        settled: store1.settled.since(&store0.settled),
    };
    for (c, sessions) in groups {
        for s in sessions {
            c.send(&json!({ "jsonrpc": "2.0", "method": "session/cancel", "params": { "sessionId": s } }))
                .await;
        }
    }
    let mut ended = 0;
    for r in running {
        let res = r.await.expect("background prompt task");
        if res["result"]["stopReason"] != "cancelled" {
            ended += 1;
        }
    }
    if ended > 0 {
        // The figures above then had less background than they say, and
        // those streams' settlements are in the second window's figures.
        println!("{ended} background streams ended before the cancels did");
    }
    Cancels {
        times,
        first,
        missed,
        updates_per_s: updates as f64 / wall,
        cores: cpu / wall,
        store,
        wall,
    }
}

#[tokio::main]
async fn main() {
    let a = args();
    let mut d = start_daemon().await;
    let rss0 = rss_bytes(d.pid);
    let mut conns = Vec::new();
    for _ in 0..a.connections {
        conns.push(Conn::open(&d.socket).await);
    }

    // Session creation, pipelined: every connection creates its share at once.
    let per = a.sessions / a.connections;
    let t0 = Instant::now();
    let mut made = Vec::new();
    for c in &conns {
        let c = c.clone();
        made.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut pending = Vec::new();
            for _ in 0..per {
                let c = c.clone();
                pending.push(tokio::spawn(async move { c.new_session().await }));
            }
            for p in pending {
                ids.push(p.await.expect("session/new task"));
            }
            (c, ids)
        }));
    }
    let mut groups = Vec::new();
    for m in made {
        groups.push(m.await.expect("creation task"));
    }
    let created = per * a.connections;
    let creation = created as f64 / t0.elapsed().as_secs_f64();
    let rss1 = rss_bytes(d.pid);
    println!(
        "session creation: {created} over {} connections, pipelined: {creation:.0} sessions/s (goal >= 5,000); daemon RSS +{:.1} KiB per live session",
        a.connections,
        (rss1.saturating_sub(rss0)) as f64 / created as f64 / 1024.0
    );

    let script = saying(a.chunks, "token ");
    // Warm up once (allocations, SQLite's cache).
    stream_all(&groups, &json!([{ "say": "warm" }])).await;

    let cpu0 = cpu_seconds(d.pid);
    let (wall, updates) = stream_all(&groups, &script).await;
    let cpu = cpu_seconds(d.pid) - cpu0;
    let chunks = (created * a.chunks) as f64;
    println!(
        "fan-out: {created} sessions x {} chunks over {} connections: {:.0} session/update/s delivered ({updates} updates for {chunks:.0} chunks), {:.2} us daemon CPU per update (goal >= 250,000/s, < 4 us); {:.0} chunks/s",
        a.chunks,
        a.connections,
        updates as f64 / wall.as_secs_f64(),
        cpu * 1e6 / updates as f64,
        chunks / wall.as_secs_f64(),
    );

    // The same with a connection that never reads: its sessions stream
    // into a socket nobody drains.
    let stalled = {
        let stream = UnixStream::connect(&d.socket).await.expect("connect");
        let (read, write) = stream.into_split();
        let c = Arc::new(Conn {
            write: Mutex::new(write),
            next: AtomicU64::new(1),
            waiters: Default::default(),
            updates: Default::default(),
        });
        // Reads only until its sessions exist, then stops reading.
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let waiters = c.waiters.clone();
        let updates = c.updates.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = read_loop(read, waiters, updates) => {}
                // From here on nothing reads the socket (the write half
                // keeps it open): the daemon's writes to it back up.
                _ = stop_rx => {}
            }
        });
        c.request(
            "initialize",
            json!({ "protocolVersion": 1, "clientCapabilities": {} }),
        )
        .await;
        let mut ids = Vec::new();
        for _ in 0..20 {
            ids.push(c.new_session().await);
        }
        let _ = stop_tx.send(());
        for s in &ids {
            let text = json!({ "script": saying(90_000, "never read ") }).to_string();
            c.send(&json!({ "jsonrpc": "2.0", "id": 1_000_000, "method": "session/prompt", "params": { "sessionId": s, "prompt": [{ "type": "text", "text": text }] } })).await;
        }
        c
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu0 = cpu_seconds(d.pid);
    let (wall, updates) = stream_all(&groups, &script).await;
    let cpu = cpu_seconds(d.pid) - cpu0;
    println!(
        "fan-out with one connection not reading (20 sessions streaming into it): {:.0} session/update/s delivered to the others, {:.2} us daemon CPU per update",
        updates as f64 / wall.as_secs_f64(),
        cpu * 1e6 / updates as f64,
    );
    drop(stalled);

    // Replay: a session with a long log, loaded by a new connection.
    {
        let (c, _) = &groups[0];
        let session = c.new_session().await;
        let events = a.replay;
        // In turns of 50,000 (under `limits.max_turn_events`).
        for times in (0..events)
            .step_by(50_000)
            .map(|i| (events - i).min(50_000))
        {
            let res = c.prompt(&session, &saying(times, "replayed ")).await;
            assert_eq!(res["result"]["stopReason"], "end_turn", "{res}");
        }
        let reader = Conn::open(&d.socket).await;
        let t0 = Instant::now();
        let res = reader
            .request(
                "session/load",
                json!({ "sessionId": session, "cwd": "/tmp", "mcpServers": [] }),
            )
            .await;
        let took = t0.elapsed();
        assert!(res.get("result").is_some(), "session/load failed: {res}");
        println!(
            "replay (session/load of a {events}-chunk session, {} updates after coalescing): {:.0} events/s (goal >= 500,000)",
            reader.updates.load(Ordering::Relaxed),
            events as f64 / took.as_secs_f64()
        );
    }

    // Cancel latency while every session streams: at a model's pace (100
    // chunks a second each, as a model writes), then flat out (both cores
    // saturated by the streams).
    let paced = |i: usize| json!([{ "sleep_ms": i % 10 }, { "repeat": { "times": 6_000, "steps": [{ "say": "paced " }, { "sleep_ms": 10 }] } }]);
    let flat = |_: usize| saying(90_000, "background ");
    for (label, background) in [
        (
            "each at a model's pace (100 chunks/s)",
            &paced as &dyn Fn(usize) -> Value,
        ),
        ("flat out", &flat),
    ] {
        let c = cancel_latency(&d, &groups, background, a.cancels).await;
        println!(
            "cancel -> answer with {created} sessions streaming {label}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} ({} not answered cancelled; meanwhile {:.0} session/update/s delivered, daemon busy {:.2} of {} cores, {:.1} us of its CPU an update) (goal p99 < 2 ms)",
            pct(&c.times, 50),
            pct(&c.times, 99),
            c.times[c.times.len() - 1],
            c.times.len(),
            c.missed,
            c.updates_per_s,
            c.cores,
            std::thread::available_parallelism().map_or(0, usize::from),
            1e6 * c.cores / c.updates_per_s.max(1.0),
        );
        println!(
            "  the same prompts' first chunk: p50 {:.2} ms, p99 {:.2} ms after it was sent",
            pct(&c.first, 50),
            pct(&c.first, 99),
        );
        // What a durable append (the cancel's terminal) may wait behind.
        let (w, wn) = c.store.writes;
        let (k, kn) = c.store.checkpoints;
        let (p, pn) = c.store.passes;
        println!(
            "  the store thread meanwhile: committing {:.0}% of the time ({wn:.0} commits, {:.2} ms each on average), checkpointing {:.0}% ({kn:.0} checkpoints, {:.2} ms each); the checkpoint thread beside it {:.0}% ({pn:.0} passes, {:.2} ms each)",
            100.0 * w / c.wall,
            1000.0 * w / wn.max(1.0),
            100.0 * k / c.wall,
            1000.0 * k / kn.max(1.0),
            100.0 * p / c.wall,
            1000.0 * p / pn.max(1.0),
        );
        // Two windows of the answer's time, as the daemon's histograms
        // bucket them. They overlap (both hold the engine's stop, and for
        // a model's turn the save of its conversation), so they do not add
        // up to the figure above, and bounds cannot be subtracted from it.
        let (d, s) = (&c.store.decided, &c.store.settled);
        println!(
            "  inside the daemon (two overlapping windows, to the histogram's bucket, ms): the turn's end decided p50 <= {}, p99 <= {} after the cancel reached its session; its end committed and handed to the request p50 <= {}, p99 <= {} after the input that ended it",
            d.at_most(50.0),
            d.at_most(99.0),
            s.at_most(50.0),
            s.at_most(99.0),
        );
    }
    println!(
        "daemon peak RSS over the run: {:.0} MiB",
        peak_rss_bytes(d.pid) as f64 / (1024.0 * 1024.0)
    );
    // A graceful stop (SIGTERM), as an operator would.
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &d.pid.to_string()])
        .status();
    let t0 = Instant::now();
    match tokio::time::timeout(Duration::from_secs(30), d.child.wait()).await {
        Ok(_) => println!(
            "graceful stop (SIGTERM) with {created} sessions: {:.0} ms",
            t0.elapsed().as_secs_f64() * 1000.0
        ),
        Err(_) => {
            println!("the daemon did not stop within 30 s of SIGTERM; killed");
            let _ = d.child.kill().await;
        }
    }
    let _ = std::fs::remove_dir_all(&d._dir);
}

#[cfg(test)]
mod tests {
    use super::Buckets;

    const BEFORE: &str = "tiller_cancel_latency_seconds_bucket{le=\"0.001\"} 10\n\
        tiller_cancel_latency_seconds_bucket{le=\"0.0025\"} 10\n\
        tiller_cancel_latency_seconds_bucket{le=\"+Inf\"} 10\n\
        tiller_cancel_latency_seconds_sum 0.005\n";
    const AFTER: &str = "tiller_cancel_latency_seconds_bucket{le=\"0.001\"} 108\n\
        tiller_cancel_latency_seconds_bucket{le=\"0.0025\"} 109\n\
        tiller_cancel_latency_seconds_bucket{le=\"+Inf\"} 110\n\
        tiller_settle_latency_seconds_bucket{le=\"0.001\"} 1\n";

    /// Only what was recorded between two scrapes counts, and a bound is
    /// the least bucket holding that share of it.
    #[test]
    fn a_phase_s_bucket_bounds_count_only_what_it_recorded() {
        let name = "tiller_cancel_latency_seconds";
        let phase = Buckets::read(AFTER, name).since(&Buckets::read(BEFORE, name));
        assert_eq!(
            phase.0,
            [(0.001, 98.0), (0.0025, 99.0), (f64::INFINITY, 100.0)]
        );
        assert_eq!(phase.at_most(50.0), "1");
        assert_eq!(phase.at_most(99.0), "2.5");
        assert_eq!(phase.at_most(100.0), "inf");
        assert_eq!(Buckets::read("", name).at_most(99.0), "-");
        let first = Buckets::read(AFTER, name).since(&Buckets::default());
        assert_eq!(
            first.0,
            [(0.001, 108.0), (0.0025, 109.0), (f64::INFINITY, 110.0)]
        );
    }
}
