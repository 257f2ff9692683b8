//! MCP servers are started or reached only as the configuration allows,
//! with the scrubbed environment, and their results are bounded.

mod common;

use std::io::BufRead;
use std::time::Duration;

use common::{assert_gone, mcp_fixture, processes};
use serde_json::json;
use tiller_tools::{McpPolicy, McpServer, McpServerConfig, ToolsConfig, egress};

fn allowing(commands: &[&str], hosts: &[&str]) -> ToolsConfig {
    ToolsConfig {
        mcp: McpPolicy {
            allowed_commands: commands.iter().map(|s| s.to_string()).collect(),
            egress: egress::Policy::new(&hosts.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap(),
            connect_timeout: Duration::from_secs(20),
        },
        ..ToolsConfig::default()
    }
}

fn stdio(command: &str, args: &[&str]) -> McpServerConfig {
    McpServerConfig::Stdio {
        name: "fx".into(),
        command: command.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
    }
}

#[tokio::test]
async fn a_command_not_allowed_is_never_started() {
    let d = tempfile::tempdir().unwrap();
    let marker = d.path().join("started");
    let script = format!("touch {}", marker.display());
    // (allowed commands, command)
    let cases: &[(&[&str], &str)] = &[
        (&[], "sh"),
        (&["node"], "sh"),
        // A path is never matched by a bare name.
        (&["sh"], "/bin/sh"),
        (&["/usr/bin/*"], "/bin/sh"),
        (&["/usr/bin/s*"], "/usr/bin/x/../../../bin/sh"),
        (&["/bin"], "/bin/sh"),
        (&["sh"], "./sh"),
        (&["sh"], "bin/sh"),
    ];
    for (allowed, command) in cases {
        let e = McpServer::connect(&stdio(command, &["-c", &script]), &allowing(allowed, &[]))
            .await
            .unwrap_err();
        assert!(
            e.contains("refused") && e.contains("tools.mcp.allowed_commands"),
            "{allowed:?} {command}: {e}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!marker.exists(), "a refused command ran");
}

#[tokio::test]
async fn an_allowed_stdio_server_runs_with_the_scrubbed_environment() {
    let fixture = mcp_fixture().display().to_string();
    let cfg = McpServerConfig::Stdio {
        name: "fx".into(),
        command: "node".into(),
        args: vec![fixture],
        env: vec![
            ("GOOD".into(), "yes".into()),
            ("LD_PRELOAD".into(), "/nonexistent/planted.so".into()),
            ("DYLD_INSERT_LIBRARIES".into(), "planted".into()),
            ("TILLER_SERVER__TOKEN".into(), "planted".into()),
        ],
    };
    let mut tools = allowing(&["node"], &[]);
    tools.max_output_bytes = 1000;
    let server = McpServer::connect(&cfg, &tools).await.unwrap();
    let names: Vec<String> = server.specs().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["fx__big", "fx__env"]);
    let out = server.call("fx__env", &json!({}), &tools).await;
    assert!(out.ok, "{out:?}");
    assert!(out.output.contains("GOOD=yes"), "{}", out.output);
    assert!(!out.output.contains("planted"), "{}", out.output);
    let vars: Vec<&str> = out
        .output
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    for v in &vars {
        assert!(
            ["PATH", "HOME", "LANG", "TERM", "GOOD"].contains(v),
            "{v} reached the server"
        );
    }
    let out = server
        .call("fx__big", &json!({"bytes": 200_000}), &tools)
        .await;
    assert!(
        out.output
            .ends_with("\n[output truncated: 200000 bytes, showing the first 1000]"),
        "{}",
        &out.output[out.output.len().saturating_sub(100)..]
    );
}

#[tokio::test]
async fn a_dropped_stdio_server_takes_its_process_group_along() {
    let fixture = mcp_fixture().display().to_string();
    let script = format!("sleep 321 & exec node {fixture}");
    let server = McpServer::connect(&stdio("sh", &["-c", &script]), &allowing(&["sh"], &[]))
        .await
        .unwrap();
    assert!(!processes(&["sleep", "321"]).is_empty());
    drop(server);
    assert_gone(&["sleep", "321"], Duration::from_secs(2));
}

/// The fixture serving HTTP; killed on drop.
struct HttpFixture {
    child: std::process::Child,
    port: u16,
}

impl HttpFixture {
    fn start() -> HttpFixture {
        let mut child = std::process::Command::new("node")
            .arg(mcp_fixture())
            .arg("--http")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        HttpFixture {
            port: line.trim().parse().unwrap(),
            child,
        }
    }
}

impl Drop for HttpFixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn http_servers_are_reached_only_where_egress_allows() {
    let fx = HttpFixture::start();
    let http = |host: &str| McpServerConfig::Http {
        name: "web".into(),
        url: format!("http://{host}:{}/mcp?token=s3cret", fx.port),
        headers: Vec::new(),
    };
    let e = McpServer::connect(&http("127.0.0.1"), &allowing(&[], &[]))
        .await
        .unwrap_err();
    assert!(e.contains("is not in"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
    // Listed by name only: the name resolves to loopback, refused.
    let e = McpServer::connect(&http("localhost"), &allowing(&[], &["localhost"]))
        .await
        .unwrap_err();
    assert!(e.contains("which is loopback"), "{e}");
    let server = McpServer::connect(&http("127.0.0.1"), &allowing(&[], &["127.0.0.1"]))
        .await
        .unwrap();
    let out = server
        .call("web__big", &json!({"bytes": 10}), &ToolsConfig::default())
        .await;
    assert_eq!(out.output, "xxxxxxxxxx");
    let server = McpServer::connect(
        &http("localhost"),
        &allowing(&[], &["localhost", "127.0.0.1"]),
    )
    .await
    .unwrap();
    assert_eq!(server.specs().len(), 2);
}

/// A server that went away after connecting: the call's error names it,
/// and never its URL's query (the HTTP client's error names the URL
/// whole).
#[tokio::test]
async fn an_http_server_s_errors_never_show_its_url_s_query() {
    let fx = HttpFixture::start();
    let cfg = McpServerConfig::Http {
        name: "web".into(),
        url: format!("http://127.0.0.1:{}/mcp?token=s3cret", fx.port),
        headers: Vec::new(),
    };
    let server = McpServer::connect(&cfg, &allowing(&[], &["127.0.0.1"]))
        .await
        .unwrap();
    drop(fx);
    let out = server
        .call("web__big", &json!({"bytes": 10}), &ToolsConfig::default())
        .await;
    assert!(!out.ok, "{out:?}");
    assert!(out.output.contains("MCP server `web`"), "{}", out.output);
    assert!(!out.output.contains("s3cret"), "{}", out.output);
}
