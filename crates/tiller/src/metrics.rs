//! `/metrics`: the Prometheus recorder, installed from the catalogue in
//! `tiller_core::metrics` (every metric described, every bounded label set
//! registered at zero), the process metrics, and `tiller_build_info`.

use std::sync::Arc;

use anyhow::Context as _;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tiller_core::metrics::{ALL, Kind, LATENCY_BUCKETS, TURN_BUCKETS, combinations};

use crate::config::Config;

/// The commit this binary was built from (see `build.rs`).
pub const COMMIT: &str = env!("TILLER_COMMIT");

/// Installs the global recorder and returns what renders a scrape.
pub fn install(cfg: &Config) -> anyhow::Result<tiller_http::RenderMetrics> {
    let mut builder = PrometheusBuilder::new();
    for m in ALL.iter().filter(|m| m.kind == Kind::Histogram) {
        let buckets = if m.name == "tiller_turn_duration_seconds" {
            TURN_BUCKETS
        } else {
            LATENCY_BUCKETS
        };
        builder = builder
            .set_buckets_for_metric(Matcher::Full(m.name.to_owned()), buckets)
            .context("histogram buckets")?;
    }
    let handle = builder
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    let models: Vec<String> = cfg.engine.models.keys().cloned().collect();
    let agents: Vec<String> = cfg.engine.agents.keys().cloned().collect();
    register(&models, &agents);
    let process = metrics_process::Collector::default();
    process.describe();
    process.collect();
    Ok(Arc::new(move || {
        process.collect();
        handle.render()
    }))
}

/// Describes every metric and creates each bounded series at zero.
fn register(models: &[String], agents: &[String]) {
    for m in ALL {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
        if m.name == "tiller_build_info" {
            continue;
        }
        for labels in combinations(m, models, agents) {
            match m.kind {
                Kind::Counter => metrics::counter!(m.name, &labels).increment(0),
                Kind::Gauge => metrics::gauge!(m.name, &labels).increment(0.0),
                Kind::Histogram => drop(metrics::histogram!(m.name, &labels)),
            }
        }
    }
    metrics::gauge!(
        "tiller_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "commit" => COMMIT
    )
    .set(1.0);
}
