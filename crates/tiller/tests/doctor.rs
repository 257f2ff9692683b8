//! `tiller doctor` against real directories, files and servers.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// A server answering every request with `status` (one per connection).
fn server(status: &'static str) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let body = r#"{"data":[]}"#;
            let _ = write!(
                s,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}/v1")
}

/// Runs `tiller doctor` with `config` and `data_dir`; its exit code and
/// output.
fn doctor(config: &str, data_dir: &std::path::Path) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiller.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tiller"))
        .args(["doctor", "--config"])
        .arg(&path)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("TILLER_DOCTOR_TEST_KEY")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn private_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    d
}

/// A config, the data directory's mode, the store file's bytes, the exit
/// code, and lines the output must hold.
type Case<'a> = (String, u32, Option<&'a [u8]>, i32, Vec<String>);

#[test]
fn each_problem_is_named_with_what_to_do() {
    let ok = server("200 OK");
    let refused = server("401 Unauthorized");
    let agent_data = private_dir();
    // (config, data dir mode, store file contents, exit code, lines wanted)
    let cases: Vec<Case<'_>> = vec![
        (String::new(), 0o700, None, 0, vec!["ok    data directory".into(), "all checks passed".into()]),
        (String::new(), 0o755, None, 1, vec!["FAIL  data directory".into(), "chmod 700".into()]),
        (
            String::new(),
            0o700,
            Some(b"this is not a database, whatever it says".as_slice()),
            1,
            vec!["FAIL  store".into()],
        ),
        (
            format!("[engine.m]\nkind = \"openai\"\nbase_url = \"{ok}\"\nmodel = \"x\"\n"),
            0o700,
            None,
            0,
            vec![format!("ok    engine m: {ok}/models answers")],
        ),
        (
            format!("[engine.m]\nkind = \"openai\"\nbase_url = \"{refused}\"\nmodel = \"x\"\napi_key_env = \"PATH\"\n"),
            0o700,
            None,
            1,
            vec!["FAIL  engine m".into(), "refused the key".into()],
        ),
        (
            "[engine.m]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"x\"\n".into(),
            0o700,
            None,
            1,
            vec!["FAIL  engine m: http://127.0.0.1:1/v1/models is unreachable".into()],
        ),
        (
            "[engine.m]\nkind = \"anthropic\"\nmodel = \"x\"\napi_key_env = \"TILLER_DOCTOR_TEST_KEY\"\n".into(),
            0o700,
            None,
            1,
            vec!["TILLER_DOCTOR_TEST_KEY (engine.m.api_key_env) is not set".into()],
        ),
        (
            "[engine.a]\nkind = \"acp\"\ncommand = \"surely-not-an-installed-agent\"\n".into(),
            0o700,
            None,
            1,
            vec!["FAIL  engine a: `surely-not-an-installed-agent` is not on PATH".into()],
        ),
        (
            // Found, but not an ACP agent: it never answers `initialize`.
            "[engine.a]\nkind = \"acp\"\ncommand = \"/bin/cat\"\nstart_timeout = \"1s\"\n".into(),
            0o700,
            None,
            1,
            vec![
                "ok    engine a: /bin/cat is executable".into(),
                "FAIL  engine a initialize: it did not answer `initialize`".into(),
            ],
        ),
        (
            // A real ACP agent: Tiller's own `acp --embedded`.
            format!(
                "[engine.a]\nkind = \"acp\"\ncommand = \"{}\"\nargs = [\"acp\", \"--embedded\", \"--data-dir\", \"{}\"]\n",
                env!("CARGO_BIN_EXE_tiller"),
                agent_data.path().display()
            ),
            0o700,
            None,
            0,
            vec![format!("ok    engine a initialize: tiller {} speaks ACP v1", env!("CARGO_PKG_VERSION"))],
        ),
        ("[server]\nnonsense = 1\n".into(), 0o700, None, 1, vec!["FAIL  config".into()]),
    ];
    for (config, mode, store, code, wanted) in cases {
        let data = private_dir();
        std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        if let Some(bytes) = store {
            std::fs::write(data.path().join("tiller.db"), bytes).unwrap();
        }
        let (got, out) = doctor(&config, data.path());
        assert_eq!(got, code, "{config:?} mode {mode:o}:\n{out}");
        for w in wanted {
            assert!(out.contains(&w), "{config:?}: wanted {w:?} in\n{out}");
        }
        // A key never shows.
        assert!(!out.contains(&std::env::var("PATH").unwrap()), "{out}");
    }
}

/// A session whose log holds two segments with the same events (the
/// daemon refuses its reads) is named, with the repair.
#[tokio::test]
async fn a_damaged_session_log_is_named_with_its_repair() {
    let data = private_dir();
    let db = data.path().join("tiller.db");
    let id = tiller_core::SessionId::new();
    {
        let store = tiller_store::Store::open(&db).unwrap();
        let event = tiller_store::StoredEvent {
            session: id,
            seq: 1,
            ts_ms: 1,
            kind: "agent_message_chunk".into(),
            prompt: None,
            turn: None,
            data: "{}".into(),
        };
        store.append_durable(event, None).await.unwrap();
        store.close().await;
    }
    let (code, out) = doctor("", data.path());
    assert_eq!(code, 0, "{out}");
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute(
            "INSERT INTO log (session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body)
             SELECT session_id, first_seq, last_seq, last_ts_ms, max_turn, kinds, body FROM log",
            [],
        )
        .unwrap();
    let (code, out) = doctor("", data.path());
    assert_eq!(code, 1, "{out}");
    for wanted in [
        "FAIL  store".to_string(),
        format!("session {id}: segments 1 and 2 of its log both hold event 1"),
        "DELETE /api/sessions/<id>?purge=true".to_string(),
    ] {
        assert!(out.contains(&wanted), "wanted {wanted:?} in\n{out}");
    }
}

/// A `base_url` carrying credentials or a query (a proxy's, a gateway's
/// key) is named without them, in the finding and in the HTTP client's
/// error it quotes.
#[test]
fn a_base_url_s_credentials_are_never_shown() {
    let data = private_dir();
    for base in [
        "http://user:pa55word@127.0.0.1:1/v1?key=s3cretq",
        "http://user:pa55word@127.0.0.1:1/v1",
    ] {
        let (code, out) = doctor(
            &format!("[engine.m]\nkind = \"openai\"\nbase_url = \"{base}\"\nmodel = \"x\"\n"),
            data.path(),
        );
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("is unreachable"), "{out}");
        assert!(
            !out.contains("pa55word") && !out.contains("s3cretq"),
            "{out}"
        );
    }
}
