//! The metrics catalogue against everything that depends on it: the code
//! that records metrics, `docs/metrics.md`, the Grafana dashboard, the
//! alert rules, and a live daemon's `/metrics`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tiller_core::metrics::{ALL, Kind};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `process_*` metrics the process collector exports.
const PROCESS: &[&str] = &[
    "process_cpu_seconds_total",
    "process_max_fds",
    "process_open_fds",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_threads",
    "process_virtual_memory_bytes",
    "process_virtual_memory_max_bytes",
];

fn catalogue() -> BTreeSet<&'static str> {
    ALL.iter().map(|m| m.name).collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every metric name the daemon's code records with a literal name.
fn recorded() -> BTreeSet<String> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let src = entry.unwrap().path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for mac in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(mac) {
                let rest = text[at + mac.len()..].trim_start();
                if let Some(rest) = rest.strip_prefix('"') {
                    let name = &rest[..rest.find('"').unwrap()];
                    names.insert(name.to_owned());
                }
            }
        }
    }
    names
}

#[test]
fn the_catalogue_and_the_code_name_the_same_metrics() {
    let recorded = recorded();
    let listed: BTreeSet<String> = catalogue().into_iter().map(str::to_owned).collect();
    let unlisted: Vec<_> = recorded.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "recorded but not in tiller_core::metrics::ALL: {unlisted:?}"
    );
    let unrecorded: Vec<_> = listed.difference(&recorded).collect();
    assert!(
        unrecorded.is_empty(),
        "in the catalogue but never recorded: {unrecorded:?}"
    );
}

#[test]
fn docs_metrics_md_is_the_catalogue() {
    let path = root().join("docs/metrics.md");
    let want = tiller_core::metrics::reference();
    if std::env::var_os("TILLER_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "docs/metrics.md is out of date: run `TILLER_BLESS=1 cargo test -p tiller --test metrics`"
    );
}

/// Metric names in a PromQL expression: identifiers that start with one
/// of our prefixes, with the histogram suffixes taken off.
fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts = (expr[i..].starts_with("tiller_") || expr[i..].starts_with("process_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts {
            let end = expr[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(expr.len(), |n| i + n);
            let mut name = &expr[i..end];
            for suffix in ["_bucket", "_sum", "_count"] {
                if let Some(base) = name.strip_suffix(suffix)
                    && ALL
                        .iter()
                        .any(|m| m.name == base && m.kind == Kind::Histogram)
                {
                    name = base;
                }
            }
            out.push(name.to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

fn known(name: &str) -> bool {
    catalogue().contains(name) || PROCESS.contains(&name)
}

/// Every `expr` in a JSON document, wherever it sits.
fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_queries_only_exported_metrics() {
    let text = std::fs::read_to_string(root().join("deploy/grafana/tiller.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    assert!(all.len() >= 12, "a dashboard of {} queries", all.len());
    for expr in &all {
        let names = names_in(expr);
        assert!(!names.is_empty(), "a query with no metric: {expr}");
        for name in names {
            assert!(
                known(&name),
                "the dashboard queries {name}, not exported: {expr}"
            );
        }
    }
    // The panels the operators asked for are there.
    let joined = all.join("\n");
    for needed in [
        "tiller_sessions_active",
        "tiller_turns_settled_total",
        "tiller_settle_latency_seconds_bucket",
        "tiller_cancel_latency_seconds_bucket",
        "tiller_loop_detected_total",
        "tiller_steers_total",
        "tiller_steer_receipt_timeouts_total",
        "tiller_prompt_queue_depth",
        "tiller_notifications_queued",
        "tiller_subscriber_evictions_total",
        "tiller_store_write_seconds_bucket",
        "tiller_engine_processes",
        "tiller_engine_restarts_total",
        "process_resident_memory_bytes",
    ] {
        assert!(joined.contains(needed), "no panel shows {needed}");
    }
}

#[test]
fn the_alert_rules_query_only_exported_metrics() {
    let text = std::fs::read_to_string(root().join("deploy/prometheus/alerts.yml")).unwrap();
    let mut seen = 0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(expr) = line.strip_prefix("expr:") {
            seen += 1;
            for name in names_in(expr) {
                assert!(
                    known(&name),
                    "an alert queries {name}, not exported: {expr}"
                );
            }
        }
    }
    assert!(seen >= 6, "{seen} alert expressions");
}

/// A running `tiller serve` on a free port with its own data directory.
struct Daemon {
    child: std::process::Child,
    listen: String,
    token: String,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(config: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tiller.toml");
    std::fs::write(&cfg, config).unwrap();
    let data = dir.path().join("data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tiller"))
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let listen = loop {
        let line = lines.next().expect("the daemon exited").unwrap();
        if let Some(rest) = line.split("tiller is ready listen=").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let token = std::fs::read_to_string(data.join("token")).unwrap();
    Daemon {
        child,
        listen,
        token: token.trim().to_owned(),
        _dir: dir,
    }
}

fn scrape(d: &Daemon) -> String {
    let mut s = std::net::TcpStream::connect(&d.listen).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\r\n",
        d.listen, d.token
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"));
    text.split_once("\r\n\r\n").unwrap().1.to_owned()
}

#[test]
fn a_fresh_daemon_describes_every_metric_and_starts_bounded_series_at_zero() {
    let d = start(
        "[engine.m]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"x\"\n\
         [engine.a]\nkind = \"acp\"\ncommand = \"/bin/false\"\n",
    );
    let text = scrape(&d);
    for m in ALL {
        assert!(
            text.contains(&format!("# HELP {} {}\n", m.name, m.help)),
            "no HELP for {}",
            m.name
        );
        assert!(
            text.contains(&format!("# TYPE {} {}\n", m.name, m.kind.as_str())),
            "no TYPE for {}",
            m.name
        );
    }
    for name in PROCESS {
        assert!(text.contains(&format!("# HELP {name} ")), "no {name}");
    }
    for series in [
        "tiller_turns_settled_total{origin=\"cron\",outcome=\"loop_detected\"} 0",
        "tiller_loop_detected_total{loop_type=\"repeated_tool_failure\",origin=\"goal\"} 0",
        "tiller_connections_active{transport=\"websocket\"} 0",
        "tiller_prompts_admitted_total{origin=\"notification\"} 0",
        "tiller_watchdog_fired_total{kind=\"stall\"} 0",
        "tiller_model_tokens_total{engine=\"m\",kind=\"output\"} 0",
        "tiller_engine_restarts_total{engine=\"a\",reason=\"killed\"} 0",
        "tiller_settle_latency_seconds_bucket{le=\"0.001\"} 0",
        "tiller_turn_duration_seconds_count{origin=\"cron\"} 0",
    ] {
        assert!(text.contains(series), "no {series}");
    }
    let build = format!(
        "tiller_build_info{{version=\"{}\",commit=\"",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.contains(&build), "no build info");
    let rss = text
        .lines()
        .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert!(rss > 1e6, "resident memory {rss}");
}
