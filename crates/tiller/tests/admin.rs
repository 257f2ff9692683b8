//! Admin commands, run as a person would.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Accepts connections on a thread, counting them; each gets `answer`.
fn listener(answer: &'static str) -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(answer.as_bytes());
        }
    });
    (addr, seen)
}

/// The token goes to the daemon only: never through a proxy the
/// environment names (`http_proxy`, `ALL_PROXY`), which would see it in
/// the clear on its way to a loopback address.
#[test]
fn admin_commands_never_send_the_token_through_a_proxy() {
    let body = "{\"sessions\":[]}";
    let answer: &'static str = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_boxed_str(),
    );
    let (daemon, served) = listener(answer);
    let (proxy, proxied) = listener(answer);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "admin-token-SECRET-0123456789abcdef").unwrap();
    let proxy_url = format!("http://{proxy}");
    let out = Command::new(env!("CARGO_BIN_EXE_tiller"))
        .args(["sessions", "list", "--url", &format!("http://{daemon}")])
        .arg("--token-file")
        .arg(&token)
        .env("http_proxy", &proxy_url)
        .env("HTTP_PROXY", &proxy_url)
        .env("ALL_PROXY", &proxy_url)
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(proxied.load(Ordering::SeqCst), 0, "the proxy was used");
    assert_eq!(served.load(Ordering::SeqCst), 1, "{out:?}");
}
