//! The HTTP API through the router, without a socket (`oneshot`), with real
//! sessions and a real store.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::PrometheusBuilder;
use serde_json::{Value, json};
use tiller_core::TurnConfig;
use tiller_engine::ScriptedEngine;
use tiller_http::{
    AppState,
    auth::{Auth, AuthConfig},
    router,
};
use tiller_session::{SessionConfig, Sessions};
use tiller_test_support::Store;
use tokio::sync::Semaphore;
use tower::ServiceExt;

struct App {
    state: AppState,
    store: Store,
    _dir: tempfile::TempDir,
}

async fn app(auth: AuthConfig, subscriber_queue: usize) -> App {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("t.db")).unwrap();
    let sessions = Sessions::start(
        store.clone(),
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        // The shared test config, with the default timers, one queued
        // prompt and room for many sessions.
        SessionConfig {
            turn: TurnConfig {
                max_queued_prompts: 1,
                ..TurnConfig::default()
            },
            max_sessions: 100,
            ..tiller_test_support::session_config()
        },
    )
    .await
    .unwrap();
    let state = AppState {
        sessions,
        acp: tiller_acp::AcpConfig {
            max_message_bytes: 1 << 20,
            subscriber_queue: 64,
            version: "test".into(),
            forward: None,
        },
        metrics: Some({
            let handle = PrometheusBuilder::new().build_recorder().handle();
            Arc::new(move || handle.render())
        }),
        permits: Arc::new(Semaphore::new(8)),
        ready: Arc::new(AtomicBool::new(true)),
        subscriber_queue,
        auth: Auth::new(auth),
        channels: Arc::new(tiller_http::channels::Channels::default()),
        max_body_bytes: 1 << 20,
        body_timeout: std::time::Duration::from_secs(5),
    };
    App {
        state,
        store,
        _dir: dir,
    }
}

async fn call(app: &App, req: Request<Body>) -> (StatusCode, Value) {
    let res = router(app.state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v)
}

fn get(uri: &str) -> Request<Body> {
    Request::get(uri)
        .header("host", "127.0.0.1:4141")
        .body(Body::empty())
        .unwrap()
}

fn post(uri: &str, body: Value) -> Request<Body> {
    Request::post(uri)
        .header("host", "127.0.0.1:4141")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn new_session(app: &App) -> String {
    let (s, v) = call(app, post("/api/sessions", json!({"cwd": "/w"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    v["id"].as_str().unwrap().to_owned()
}

async fn wait_idle(app: &App, id: &str) -> Value {
    for _ in 0..500 {
        let (_, v) = call(app, get(&format!("/api/sessions/{id}"))).await;
        if v["state"] == "idle" {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("session never idle");
}

#[tokio::test]
async fn errors_have_the_right_status() {
    let app = app(AuthConfig::default(), 64).await;
    let id = new_session(&app).await;
    let cases = [
        (
            get("/api/sessions/nope"),
            StatusCode::NOT_FOUND,
            "unknown_session",
        ),
        (
            get("/api/sessions/00000000-0000-4000-8000-000000000000/history"),
            StatusCode::NOT_FOUND,
            "unknown_session",
        ),
        (
            post(
                &format!("/api/sessions/{id}/prompts"),
                json!({"text": "{\"script\": [{\"x\": 1}]}"}),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            post(&format!("/api/sessions/{id}/prompts"), json!({})),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            post(
                &format!("/api/sessions/{id}/steer"),
                json!({"text": "x", "idleBehavior": "maybe"}),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            Request::post(format!("/api/sessions/{id}/prompts"))
                .header("host", "127.0.0.1:4141")
                .header("content-type", "application/json")
                .body(Body::from("{not json"))
                .unwrap(),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            post(
                &format!("/api/sessions/{id}/notifications"),
                json!({"text": "x"}),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            post("/api/sessions", json!({"engine": "gpt-9"})),
            StatusCode::BAD_REQUEST,
            "invalid_params",
        ),
        (
            post(
                &format!("/api/sessions/{id}/permissions/p1"),
                json!({"optionId": "allow"}),
            ),
            StatusCode::NOT_FOUND,
            "unknown_permission_request",
        ),
    ];
    for (req, status, kind) in cases {
        let uri = req.uri().to_string();
        let (s, v) = call(&app, req).await;
        assert_eq!(s, status, "{uri}: {v}");
        assert_eq!(v["error"]["errorKind"], kind, "{uri}: {v}");
    }
}

#[tokio::test]
async fn prompts_queue_and_overload_is_retryable() {
    let app = app(AuthConfig::default(), 64).await;
    let id = new_session(&app).await;
    let slow = json!({"text": "{\"script\": [{\"sleep_ms\": 2000}]}"});
    let uri = format!("/api/sessions/{id}/prompts");
    let (s, v) = call(&app, post(&uri, slow.clone())).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let first = v["promptId"].as_str().unwrap().to_owned();
    let (s, _) = call(&app, post(&uri, slow.clone())).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (s, v) = call(&app, post(&uri, slow)).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["error"]["retryable"], true);
    let (_, snap) = call(&app, get(&format!("/api/sessions/{id}"))).await;
    assert_eq!(snap["state"], "running");
    assert_eq!(snap["activePromptId"], first.as_str());
    assert_eq!(snap["queued"].as_array().unwrap().len(), 1);
    let (s, _) = call(&app, post(&format!("/api/sessions/{id}/cancel"), json!({}))).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let snap = wait_idle(&app, &id).await;
    assert!(snap["queued"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn history_pages_walk_back_to_the_start() {
    let app = app(AuthConfig::default(), 64).await;
    let id = new_session(&app).await;
    let script = json!({"script": [{"repeat": {"times": 30, "steps": [{"say": "x"}]}}]});
    call(
        &app,
        post(
            &format!("/api/sessions/{id}/prompts"),
            json!({"text": script.to_string()}),
        ),
    )
    .await;
    let snap = wait_idle(&app, &id).await;
    let last = snap["lastSeq"].as_u64().unwrap();
    let mut seqs = Vec::new();
    let mut before: Option<u64> = None;
    loop {
        let uri = match before {
            Some(b) => format!("/api/sessions/{id}/history?limit=7&before={b}"),
            None => format!("/api/sessions/{id}/history?limit=7"),
        };
        let (_, page) = call(&app, get(&uri)).await;
        let mut page_seqs: Vec<u64> = page["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["seq"].as_u64().unwrap())
            .collect();
        page_seqs.extend(seqs);
        seqs = page_seqs;
        if !page["hasMore"].as_bool().unwrap() {
            break;
        }
        before = page["nextBefore"].as_u64();
    }
    assert_eq!(seqs, (1..=last).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_slow_sse_subscriber_costs_the_session_nothing_and_misses_nothing() {
    let app = app(AuthConfig::default(), 16).await;
    let id = new_session(&app).await;
    // Open the stream but do not read it yet.
    let res = router(app.state.clone())
        .oneshot(get(&format!("/api/sessions/{id}/events?after=0")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let script = json!({"script": [{"repeat": {"times": 2000, "steps": [{"say": "chunk "}]}}]});
    call(
        &app,
        post(
            &format!("/api/sessions/{id}/prompts"),
            json!({"text": script.to_string()}),
        ),
    )
    .await;
    // The session finishes its turn regardless of the stuck reader.
    let snap = wait_idle(&app, &id).await;
    let last = snap["lastSeq"].as_u64().unwrap();
    assert!(last > 2000);
    // Now read: every event once, in order, up to the last (what did not
    // fit the stream's queue was read from the log); no resync.
    let mut body = res.into_body();
    let mut text = String::new();
    let mut seqs: Vec<u64> = Vec::new();
    while seqs.last() != Some(&last) {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
            .await
            .expect("the stream goes on")
            .expect("not ended")
            .unwrap();
        if let Some(data) = frame.data_ref() {
            text.push_str(&String::from_utf8_lossy(data));
        }
        seqs = text
            .lines()
            .filter_map(|l| l.strip_prefix("id: ").and_then(|v| v.parse().ok()))
            .collect();
    }
    assert!(
        text.starts_with("event: session_snapshot"),
        "{}",
        &text[..100]
    );
    assert!(!text.contains("event: resync"));
    assert_eq!(seqs, (1..=last).collect::<Vec<_>>());
}

#[tokio::test]
async fn auth_token_host_and_origin() {
    let app = app(
        AuthConfig {
            token: Some("s3cret".into()),
            bind: Some("127.0.0.1:4141".parse().unwrap()),
            allowed_hosts: vec![],
            allowed_origins: vec!["https://ide.example".into()],
        },
        64,
    )
    .await;
    let with = |uri: &str, headers: &[(&str, &str)]| {
        let mut b = Request::get(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).unwrap()
    };
    let h = ("host", "127.0.0.1:4141");
    let cases: Vec<(Request<Body>, StatusCode)> = vec![
        (with("/api/sessions", &[h]), StatusCode::UNAUTHORIZED),
        (
            with("/api/sessions", &[h, ("authorization", "Bearer nope")]),
            StatusCode::UNAUTHORIZED,
        ),
        (
            with("/api/sessions", &[h, ("authorization", "Bearer s3cret")]),
            StatusCode::OK,
        ),
        // The query string is only the Web Shell's bootstrap: elsewhere it
        // is no credential (it would sit in logs and the address bar).
        (
            with("/api/sessions?token=s3cret", &[h]),
            StatusCode::UNAUTHORIZED,
        ),
        (
            with("/api/sessions/x/events?token=s3cret", &[h]),
            StatusCode::UNAUTHORIZED,
        ),
        (with("/?token=s3cret", &[h]), StatusCode::SEE_OTHER),
        (with("/?token=nope", &[h]), StatusCode::UNAUTHORIZED),
        (with("/", &[h]), StatusCode::OK),
        (with("/app.js", &[h]), StatusCode::OK),
        (
            with("/api/sessions", &[h, ("cookie", "tiller_4141=s3cret")]),
            StatusCode::UNAUTHORIZED,
        ),
        (with("/metrics", &[h]), StatusCode::UNAUTHORIZED),
        (
            with("/metrics", &[h, ("authorization", "Bearer s3cret")]),
            StatusCode::OK,
        ),
        (
            with("/api/sessions", &[("host", "[")]),
            StatusCode::MISDIRECTED_REQUEST,
        ),
        (
            with("/api/sessions", &[("host", "[::1")]),
            StatusCode::MISDIRECTED_REQUEST,
        ),
        (with("/healthz", &[h]), StatusCode::OK),
        (
            with(
                "/api/sessions",
                &[("host", "evil.example"), ("authorization", "Bearer s3cret")],
            ),
            StatusCode::MISDIRECTED_REQUEST,
        ),
        (
            with(
                "/api/sessions",
                &[
                    h,
                    ("origin", "https://evil.example"),
                    ("authorization", "Bearer s3cret"),
                ],
            ),
            StatusCode::FORBIDDEN,
        ),
        (
            with(
                "/api/sessions",
                &[
                    h,
                    ("origin", "https://ide.example"),
                    ("authorization", "Bearer s3cret"),
                ],
            ),
            StatusCode::OK,
        ),
        (
            with(
                "/api/sessions",
                &[
                    h,
                    ("origin", "http://127.0.0.1:4141"),
                    ("authorization", "Bearer s3cret"),
                ],
            ),
            StatusCode::OK,
        ),
    ];
    for (req, want) in cases {
        let desc = format!("{} {:?}", req.uri(), req.headers());
        let (s, _) = call(&app, req).await;
        assert_eq!(s, want, "{desc}");
    }

    // The bootstrap sets an HttpOnly, SameSite=Strict cookie (not the token
    // itself) and sends the browser to a clean `/`; the cookie then works.
    let res = router(app.state.clone())
        .oneshot(with("/?token=s3cret", &[h]))
        .await
        .unwrap();
    assert_eq!(res.headers()["location"], "/");
    let set = res.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(set.starts_with("tiller_4141="), "{set}");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attr), "{set}");
    }
    assert!(
        !set.contains("s3cret"),
        "the cookie is not the token: {set}"
    );
    let cookie = set.split(';').next().unwrap();
    let (s, _) = call(&app, with("/api/sessions", &[h, ("cookie", cookie)])).await;
    assert_eq!(s, StatusCode::OK);

    // Every response keeps the Web Shell out of frames and referrers.
    let res = router(app.state.clone())
        .oneshot(with("/", &[h]))
        .await
        .unwrap();
    assert_eq!(res.headers()["x-frame-options"], "DENY");
    assert_eq!(res.headers()["referrer-policy"], "no-referrer");
    let csp = res.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");

    // State changes are JSON only, even with the token.
    let post = |ct: Option<&str>| {
        let mut b = Request::post("/api/sessions")
            .header("host", "127.0.0.1:4141")
            .header("authorization", "Bearer s3cret");
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b.body(Body::from("{}")).unwrap()
    };
    for (ct, want) in [
        (None, StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (
            Some("application/x-www-form-urlencoded"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (Some("text/plain"), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (Some("application/json; charset=utf-8"), StatusCode::CREATED),
    ] {
        let (s, body) = call(&app, post(ct)).await;
        assert_eq!(s, want, "{ct:?}: {body}");
    }
}

#[tokio::test]
async fn metrics_disabled_is_404() {
    let mut app = app(AuthConfig::default(), 64).await;
    app.state.metrics = None;
    let req = Request::get("/metrics")
        .header("host", "127.0.0.1:4141")
        .body(Body::empty())
        .unwrap();
    let (s, _) = call(&app, req).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_served_openapi_description_is_the_committed_one() {
    let app = app(AuthConfig::default(), 64).await;
    let (s, served) = call(&app, get("/api/openapi.json")).await;
    assert_eq!(s, StatusCode::OK);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        served, committed,
        "/api/openapi.json differs from docs/openapi.json"
    );
    assert_eq!(served["openapi"], "3.1.0");
}

#[tokio::test]
async fn readyz_is_false_while_the_store_does_not_answer() {
    let app = app(AuthConfig::default(), 64).await;
    let ready = || async {
        let req = Request::get("/readyz")
            .header("host", "127.0.0.1:4141")
            .body(Body::empty())
            .unwrap();
        let res = router(app.state.clone()).oneshot(req).await.unwrap();
        res.status()
    };
    assert_eq!(ready().await, StatusCode::OK);
    app.store.close().await;
    assert_eq!(ready().await, StatusCode::SERVICE_UNAVAILABLE);
}

/// A page at an origin in `server.allowed_origins` can call the API with
/// the token, as a browser lets it: its preflight is answered (it got a
/// 405, and no response carried `Access-Control-Allow-Origin`, so the
/// setting allowed nothing a browser would do). Other origins get
/// nothing, and the token is still needed.
#[tokio::test]
async fn an_allowed_origin_s_page_can_call_the_api() {
    let app = app(
        AuthConfig {
            token: Some("tok-0123456789abcdef".into()),
            allowed_origins: vec!["https://IDE.example/".into()],
            ..AuthConfig::default()
        },
        64,
    )
    .await;
    let preflight = |origin: &str| {
        Request::options("/api/sessions")
            .header("host", "127.0.0.1:4141")
            .header("origin", origin)
            .header("access-control-request-method", "PATCH")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .body(Body::empty())
            .unwrap()
    };
    let allow = |res: &axum::response::Response| {
        res.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let res = router(app.state.clone())
        .oneshot(preflight("https://ide.example"))
        .await
        .unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    assert_eq!(allow(&res).as_deref(), Some("https://ide.example"));
    let allowed_headers = res
        .headers()
        .get("access-control-allow-headers")
        .map(|v| v.to_str().unwrap().to_ascii_lowercase())
        .unwrap_or_default();
    assert!(
        allowed_headers.contains("authorization"),
        "{allowed_headers}"
    );
    let res = router(app.state.clone())
        .oneshot(preflight("https://evil.example"))
        .await
        .unwrap();
    assert_eq!(allow(&res), None);
    // The call itself, with the token.
    let mut req = post("/api/sessions", json!({"cwd": "/w"}));
    req.headers_mut()
        .insert("origin", "https://ide.example".parse().unwrap());
    req.headers_mut().insert(
        "authorization",
        "Bearer tok-0123456789abcdef".parse().unwrap(),
    );
    let res = router(app.state.clone()).oneshot(req).await.unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    assert_eq!(allow(&res).as_deref(), Some("https://ide.example"));
    // Without it, refused as before.
    let mut req = post("/api/sessions", json!({"cwd": "/w"}));
    req.headers_mut()
        .insert("origin", "https://ide.example".parse().unwrap());
    let res = router(app.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
}
