//! No child sees the daemon's environment: the test re-runs itself with
//! secrets planted in its environment (as the daemon would have them)
//! and checks what `shell` (with and without the supervisor) and an MCP
//! stdio server see.

mod common;

use common::{mcp_fixture, run, supervisor};
use serde_json::json;
use tiller_tools::{McpPolicy, McpServer, McpServerConfig, ToolsConfig};

/// Set in the re-run only.
const PROBE: &str = "TILLER_TOOLS_ENV_PROBE";

const PLANTED: &[(&str, &str)] = &[
    ("TILLER_SERVER__TOKEN", "planted-server-token"),
    ("OPENAI_API_KEY", "planted-api-key"),
    ("TILLER_CHANNELS__SLACK__SECRET", "planted-channel-secret"),
    ("LD_PRELOAD", "/nonexistent/planted.so"),
];

#[test]
fn the_daemon_environment_never_reaches_children() {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "probe_children",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(PROBE, "1");
    for (k, v) in PLANTED {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("probe: checked 3 children"),
        "{stdout}\n{stderr}"
    );
}

/// The half that runs in the re-run (it does nothing otherwise).
#[tokio::test]
async fn probe_children() {
    if std::env::var_os(PROBE).is_none() {
        return;
    }
    for (k, v) in PLANTED {
        assert_eq!(std::env::var(k).as_deref(), Ok(*v), "not planted");
    }
    let d = tempfile::tempdir().unwrap();
    let plain = ToolsConfig::default();
    let supervised = ToolsConfig {
        supervisor: Some(supervisor()),
        ..ToolsConfig::default()
    };
    let mut seen = Vec::new();
    for cfg in [&plain, &supervised] {
        let out = run(d.path(), cfg, "shell", json!({"command": "env"})).await;
        assert!(out.ok, "{out:?}");
        seen.push(out.output);
    }
    let mcp = ToolsConfig {
        mcp: McpPolicy {
            allowed_commands: vec!["node".into()],
            ..McpPolicy::default()
        },
        ..ToolsConfig::default()
    };
    let server = McpServer::connect(
        &McpServerConfig::Stdio {
            name: "fx".into(),
            command: "node".into(),
            args: vec![mcp_fixture().display().to_string()],
            env: Vec::new(),
        },
        &mcp,
    )
    .await
    .unwrap();
    let out = server.call("fx__env", &json!({}), &mcp).await;
    seen.push(out.output);
    for env in &seen {
        assert!(env.contains("PATH="), "{env}");
        for (k, v) in PLANTED {
            assert!(!env.contains(k) && !env.contains(v), "{k} leaked: {env}");
        }
        assert!(!env.contains(PROBE), "{env}");
    }
    eprintln!("probe: checked {} children", seen.len());
}
