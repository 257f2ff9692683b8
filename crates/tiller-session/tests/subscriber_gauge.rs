//! `tiller_subscribers_active` counts the clients sessions hold, however
//! they leave: detached from a running or a parked session, or dropped
//! with a session that closed. (Its own test binary: the recorder is
//! global.)

use std::sync::Arc;
use std::time::Duration;

use tiller_engine::ScriptedEngine;
use tiller_session::Sessions;
use tiller_test_support::Collect;

fn subscribers(metrics: &metrics_exporter_prometheus::PrometheusHandle) -> f64 {
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("tiller_subscribers_active "))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

/// Waits (bounded) until the gauge reads `n`.
async fn reads(metrics: &metrics_exporter_prometheus::PrometheusHandle, n: f64, what: &str) {
    for _ in 0..500 {
        if subscribers(metrics) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("{what}: the gauge reads {}, not {n}", subscribers(metrics));
}

#[tokio::test]
async fn the_subscriber_gauge_follows_every_way_a_client_leaves() {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = tiller_test_support::Store::open(&dir.path().join("t.db")).unwrap();
    let mut config = tiller_test_support::session_config();
    config.park_after = Some(Duration::ZERO);
    let s = Sessions::start(
        store,
        tiller_session::Engines::single(Arc::new(ScriptedEngine)),
        config,
    )
    .await
    .unwrap();

    // Detached from a running session.
    let h = s.create("/tmp".into(), None).await.unwrap();
    let a = s.subscriber_id();
    h.subscribe(a, Box::new(Collect::default())).await.unwrap();
    reads(&metrics, 1.0, "one client attached").await;
    h.unsubscribe(a);
    reads(&metrics, 0.0, "it detached").await;

    // Detached from a parked session: the registry holds it then.
    let b = s.subscriber_id();
    h.subscribe(b, Box::new(Collect::default())).await.unwrap();
    tiller_test_support::parked(&s, 1).await;
    reads(&metrics, 1.0, "a parked session's client still counts").await;
    h.unsubscribe(b);
    reads(&metrics, 0.0, "it detached from the parked session").await;
    assert_eq!(s.parked().await, 1, "which stayed parked");

    // Dropped with a session that closed.
    let c = s.subscriber_id();
    h.subscribe(c, Box::new(Collect::default())).await.unwrap();
    reads(&metrics, 1.0, "a client attached again").await;
    h.close().await.unwrap();
    reads(&metrics, 0.0, "the session closed").await;
}
