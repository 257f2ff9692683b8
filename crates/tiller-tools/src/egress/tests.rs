use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

fn policy(allowed: &[&str]) -> Policy {
    Policy::new(&allowed.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

#[test]
fn bad_entries_are_errors_naming_them() {
    for bad in [
        "",
        "https://example.com",
        "example.com:http",
        "example.com:99999",
        "10.0.0.0/33",
        "[::1",
        "exa mple.com",
        "*.example.com",
        "a..b",
    ] {
        let e = Policy::new(&[bad.to_string()]).unwrap_err();
        assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
    }
    for good in [
        "example.com",
        "Example.COM.",
        "example.com:8443",
        "127.0.0.1",
        "127.0.0.1:8080",
        "::1",
        "[::1]:8080",
        "10.0.0.0/8",
        "fd00::/8",
        "localhost",
    ] {
        Policy::new(&[good.to_string()]).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
}

#[test]
fn check_allows_only_listed_destinations() {
    let p = policy(&[
        "hooks.example",
        "api.example:8443",
        "127.0.0.1:8080",
        "10.0.0.0/8",
        "::1",
        "203.0.113.7",
    ]);
    // (url, allowed, a word the error must contain)
    let cases: &[(&str, bool, &str)] = &[
        ("https://hooks.example/x", true, ""),
        ("http://hooks.example:9999/x", true, ""),
        ("https://HOOKS.example./x", true, ""),
        ("https://api.example:8443/", true, ""),
        (
            "https://api.example/",
            false,
            "api.example (port 443) is not in",
        ),
        (
            "https://other.example/",
            false,
            "not in the allowed destinations",
        ),
        ("https://sub.hooks.example/", false, "not in"),
        ("ftp://hooks.example/", false, "only http and https"),
        ("file:///etc/passwd", false, "only http and https"),
        ("not a url", false, "not a valid URL"),
        ("http://127.0.0.1:8080/", true, ""),
        ("http://127.0.0.1:8081/", false, "not in"),
        ("http://127.0.0.1/", false, "not in"),
        // 127.1 is 127.0.0.1 for the URL parser, and so for us.
        ("http://127.1:8080/", true, ""),
        ("http://[::ffff:127.0.0.1]:8080/", true, ""),
        ("http://10.1.2.3/", true, ""),
        ("http://11.1.2.3/", false, "not in"),
        ("http://[::1]:1234/", true, ""),
        ("http://[::2]/", false, "not in"),
        ("http://203.0.113.7/", true, ""),
        ("http://169.254.169.254/latest/meta-data", false, "not in"),
        ("http://0x7f000001:8080/", true, ""),
    ];
    for (url, allowed, why) in cases {
        match p.check(url) {
            Ok(u) => assert!(*allowed, "{url} was allowed as {u}"),
            Err(e) => {
                assert!(!allowed, "{url} was refused: {e}");
                assert!(e.contains(why), "{url}: {e}");
            }
        }
    }
}

#[test]
fn check_errors_never_show_credentials() {
    let p = policy(&["hooks.example"]);
    let e = p
        .check("https://user:hunter2@evil.example/p?token=s3cret#frag")
        .unwrap_err();
    assert!(!e.contains("hunter2") && !e.contains("s3cret"), "{e}");
    assert!(e.contains("https://evil.example/p"), "{e}");
    let e = policy(&[])
        .for_setting("tools.mcp.allowed_hosts")
        .check("https://x.example/")
        .unwrap_err();
    assert!(e.contains("tools.mcp.allowed_hosts"), "{e}");
}

#[test]
fn addresses_are_classified() {
    let cases: &[(&str, Option<&str>)] = &[
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2606:4700:4700::1111", None),
        ("::ffff:8.8.8.8", None),
        ("2002:0808:0808::1", None),
        ("64:ff9b::808:808", None),
        ("127.0.0.1", Some("loopback")),
        ("127.255.0.9", Some("loopback")),
        ("::1", Some("loopback")),
        ("0.0.0.0", Some("unspecified")),
        ("::", Some("unspecified")),
        ("0.1.2.3", Some("\"this network\" (0.0.0.0/8)")),
        ("10.2.3.4", Some("private")),
        ("172.16.0.1", Some("private")),
        ("172.31.255.255", Some("private")),
        ("172.32.0.1", None),
        ("192.168.1.1", Some("private")),
        ("169.254.169.254", Some("link-local")),
        ("fe80::1", Some("link-local")),
        ("100.64.0.1", Some("carrier-grade NAT (100.64.0.0/10)")),
        ("100.127.255.255", Some("carrier-grade NAT (100.64.0.0/10)")),
        ("100.128.0.1", None),
        ("fc00::1", Some("unique-local")),
        ("fd12:3456::1", Some("unique-local")),
        ("224.0.0.1", Some("multicast")),
        ("ff02::1", Some("multicast")),
        ("255.255.255.255", Some("broadcast")),
        ("240.0.0.1", Some("reserved")),
        ("192.0.2.1", Some("documentation")),
        ("2001:db8::1", Some("documentation")),
        ("198.18.0.1", Some("benchmarking")),
        ("::ffff:127.0.0.1", Some("loopback")),
        ("::ffff:10.0.0.1", Some("private")),
        ("::ffff:169.254.169.254", Some("link-local")),
        ("64:ff9b::7f00:1", Some("loopback")),
        ("2002:7f00:0001::1", Some("loopback")),
        ("2002:c0a8:0101::1", Some("private")),
        ("::7f00:1", Some("IPv4-compatible (deprecated)")),
        ("2001::1", Some("an IETF protocol assignment")),
        ("fec0::1", Some("site-local (deprecated)")),
        ("100::1", Some("discard-only")),
    ];
    for (ip, want) in cases {
        let got = special_purpose(ip.parse().unwrap());
        assert_eq!(got, *want, "{ip}");
    }
}

#[test]
fn listed_special_addresses_are_allowed() {
    let p = policy(&["127.0.0.1", "10.0.0.0/8"]);
    for (ip, allowed) in [
        ("8.8.8.8", true),
        ("127.0.0.1", true),
        ("::ffff:127.0.0.1", true),
        ("127.0.0.2", false),
        ("::1", false),
        ("10.9.9.9", true),
        ("192.168.0.1", false),
    ] {
        assert_eq!(p.allows_address(ip.parse().unwrap()), allowed, "{ip}");
    }
    // An address listed on one port does not let a name resolve to it:
    // the name's URL could name any port of it.
    let p = policy(&["hooks.example", "127.0.0.1:9000"]);
    assert!(!p.allows_address("127.0.0.1".parse().unwrap()));
    assert!(p.check("http://127.0.0.1:9000/x").is_ok());
    assert!(p.check("http://127.0.0.1:22/x").is_err());
}

#[test]
fn redact_removes_credentials_query_and_fragment() {
    for (url, want) in [
        (
            "https://u:p@host.example/a/b?x=1#f",
            "https://host.example/a/b",
        ),
        ("http://host.example:8080", "http://host.example:8080/"),
        ("http://[::1]:9/x?y", "http://[::1]:9/x"),
        ("https://host.example:443/", "https://host.example/"),
        ("nonsense", "(an unparseable URL)"),
    ] {
        assert_eq!(redact(url), want, "{url}");
    }
}

#[test]
fn redact_origin_shows_no_path() {
    for (url, want) in [
        (
            "https://u:p@hooks.slack.com/services/T0/B0/SECRET?x=1#f",
            "https://hooks.slack.com/…",
        ),
        ("http://host.example:8080", "http://host.example:8080/"),
        ("http://[::1]:9/x", "http://[::1]:9/…"),
        ("mailto:a@b", "(an unparseable URL)"),
        ("nonsense", "(an unparseable URL)"),
    ] {
        assert_eq!(redact_origin(url), want, "{url}");
    }
}

#[test]
fn an_error_naming_its_url_shows_it_redacted_as_given_or_as_parsed() {
    let given = "HTTPS://u:pw@Host.example/mcp?token=hunter22";
    for said in [
        format!("error sending request for url ({given})"),
        "error sending request for url (https://u:pw@host.example/mcp?token=hunter22)".to_owned(),
        // The client moves the credentials to a header.
        "error sending request for url (https://host.example/mcp?token=hunter22)".to_owned(),
    ] {
        let shown = scrub(&said, given);
        assert_eq!(
            shown, "error sending request for url (https://host.example/mcp)",
            "{said}"
        );
    }
}

/// A one-shot HTTP server on 127.0.0.1 answering every request with
/// `response`; counts the connections it accepted.
async fn serve(response: String) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
            let response = response.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = sock.write_all(response.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (port, hits)
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

const OK: &str = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";

#[tokio::test]
async fn a_name_resolving_to_loopback_needs_the_address_listed() {
    let (port, hits) = serve(OK.into()).await;
    let url = format!("http://localhost:{port}/");

    let names_only = policy(&["localhost"]);
    names_only.check(&url).unwrap();
    let e = names_only
        .client(Duration::from_secs(5))
        .get(&url)
        .send()
        .await
        .unwrap_err();
    let e = chain(&e);
    assert!(
        e.contains("`localhost` resolves to") && e.contains("which is loopback"),
        "{e}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "a refused address was reached"
    );
    let e = names_only.resolve("localhost").await.unwrap_err();
    assert!(e.contains("list the address"), "{e}");

    let with_address = policy(&["localhost", "127.0.0.1"]);
    let r = with_address
        .client(Duration::from_secs(5))
        .get(&url)
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "ok");
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    // A name that is not listed is refused by the resolver too, for
    // callers that forgot `check`.
    let e = policy(&["other.example"])
        .client(Duration::from_secs(5))
        .get(&url)
        .send()
        .await
        .unwrap_err();
    assert!(chain(&e).contains("`localhost` is not in"), "{}", chain(&e));
}

#[tokio::test]
async fn redirects_are_not_followed() {
    let (target, target_hits) = serve(OK.into()).await;
    let (start, _) = serve(format!(
        "HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:{target}/\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    ))
    .await;
    let p = policy(&["127.0.0.1"]);
    let url = p.check(&format!("http://127.0.0.1:{start}/")).unwrap();
    let r = p
        .client(Duration::from_secs(5))
        .get(url)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 302);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        target_hits.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
}
