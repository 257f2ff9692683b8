//! The HTTP listener's own bounds, on a real TCP socket.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A client that pipelines requests for a large response and never reads
/// holds its connection only until the listener's write stall: then the
/// connection, and its slot under the cap, are let go (it was held
/// forever: the header timer stops once a request is read).
#[tokio::test]
async fn a_client_that_never_reads_is_let_go_after_the_write_stall() {
    let big = "x".repeat(8 << 20);
    let app = axum::Router::new().route("/big", axum::routing::get(move || async move { big }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    let limits = tiller_http::serve::Limits {
        max_connections: 1,
        header_timeout: Duration::from_millis(300),
        write_stall: Duration::from_millis(500),
    };
    tokio::spawn(tiller_http::serve::serve(
        listener,
        app,
        limits,
        stop,
        Duration::from_secs(1),
    ));
    let mut hog = TcpStream::connect(addr).await.unwrap();
    hog.write_all(&b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(4))
        .await
        .unwrap();
    // Well past the header timeout: the hog still holds the only slot.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let status = |s: &str| s.split_whitespace().nth(1).unwrap_or("").to_owned();
    let get = || async {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_string(&mut out)).await;
        out
    };
    assert_eq!(status(&get().await), "503", "the hog holds the slot");
    // Then let go within a few stalls.
    let mut answered = String::new();
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        answered = get().await;
        if status(&answered) != "503" {
            break;
        }
    }
    assert_eq!(status(&answered), "404", "served again: {answered}");
    drop(hog);
}
