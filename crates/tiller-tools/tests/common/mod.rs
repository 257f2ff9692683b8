//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tiller_engine::{ToolCall, ToolKind, ToolOutput};
use tiller_tools::{Toolbox, ToolsConfig};

/// The supervisor binary built for the tests.
pub fn supervisor() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tiller-supervise-test"))
}

/// The dependency-free MCP server of `tests/fixtures`.
pub fn mcp_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp-server.mjs")
}

pub fn call(name: &str, input: Value) -> ToolCall {
    ToolCall {
        id: "c".into(),
        name: name.into(),
        kind: ToolKind::of(name),
        input,
        simulated: None,
    }
}

/// Runs one built-in tool in `root`.
pub async fn run(root: &Path, cfg: &ToolsConfig, name: &str, input: Value) -> ToolOutput {
    Toolbox::new(root.to_owned(), Arc::new(cfg.clone()))
        .run(&call(name, input), None)
        .await
}

/// The pids of live processes whose command line is exactly `args`.
pub fn processes(args: &[&str]) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let parts: Vec<&[u8]> = c.split(|&b| b == 0).filter(|p| !p.is_empty()).collect();
                parts.len() == args.len() && parts.iter().zip(args).all(|(p, a)| *p == a.as_bytes())
            })
        })
        .collect()
}

/// Asserts that no process runs `args` within `within`; kills any
/// found before failing, so a failed test leaves nothing behind.
pub fn assert_gone(args: &[&str], within: Duration) {
    let start = Instant::now();
    loop {
        let left = processes(args);
        if left.is_empty() {
            return;
        }
        if start.elapsed() > within {
            kill(args);
            panic!("{args:?} survived: pids {left:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills every process running `args`.
pub fn kill(args: &[&str]) {
    for pid in processes(args) {
        if let Some(p) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
}
