//! Optional OpenTelemetry: the `session`, `turn` and `tool_call` tracing
//! spans exported over OTLP/HTTP when `[telemetry] otlp_endpoint` (or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) is set. Off, nothing of it is built: no
//! layer, no exporter thread, no cost.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

use crate::config::Config;

/// Flushes and stops the exporter when the daemon ends.
pub struct Guard(SdkTracerProvider);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("telemetry: the last spans were not exported: {e}");
        }
    }
}

/// Where traces go, if anywhere: the config's collector root, else the
/// standard variables; never when `OTEL_SDK_DISABLED=true`.
fn endpoint(cfg: &Config) -> Option<Option<String>> {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return None;
    }
    let root = cfg.telemetry.otlp_endpoint.trim();
    if !root.is_empty() {
        let root = root.trim_end_matches('/');
        let url = if root.ends_with("/v1/traces") {
            root.to_owned()
        } else {
            format!("{root}/v1/traces")
        };
        return Some(Some(url));
    }
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .then_some(None)
}

/// The tracing layer that exports spans, and its guard; `None` when
/// telemetry is off.
pub fn layer<S>(
    cfg: &Config,
) -> anyhow::Result<Option<(impl tracing_subscriber::Layer<S> + use<S>, Guard)>>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let Some(url) = endpoint(cfg) else {
        return Ok(None);
    };
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if let Some(url) = url {
        exporter = exporter.with_endpoint(url);
    }
    let exporter = exporter
        .build()
        .context("telemetry: cannot build the OTLP exporter ([telemetry] otlp_endpoint)")?;
    let mut resource = Resource::builder()
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .with_attribute(opentelemetry::KeyValue::new(
            "vcs.ref.head.revision",
            crate::metrics::COMMIT,
        ));
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("tiller");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("tiller");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_default(tracing::Level::INFO)
                .with_target("ractor", tracing::Level::WARN)
                // Its errors name an MCP server's URL whole.
                .with_target("rmcp", tracing_subscriber::filter::LevelFilter::OFF),
        );
    Ok(Some((layer, Guard(provider))))
}

use tracing_subscriber::Layer as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_the_collector_root_plus_the_traces_path() {
        let mut cfg = Config::default();
        // No endpoint configured and none in the environment of the test
        // runner that matters here: the config wins when set.
        cfg.telemetry.otlp_endpoint = "http://127.0.0.1:4318/".into();
        assert_eq!(
            endpoint(&cfg),
            Some(Some("http://127.0.0.1:4318/v1/traces".into()))
        );
        cfg.telemetry.otlp_endpoint = "http://c:4318/v1/traces".into();
        assert_eq!(endpoint(&cfg), Some(Some("http://c:4318/v1/traces".into())));
    }
}
