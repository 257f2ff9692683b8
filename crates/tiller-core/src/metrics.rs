//! The catalogue of every metric the daemon exports: name, type, help,
//! and the label values known in advance.
//!
//! Pure data. The daemon describes each metric from it (`# HELP`) and
//! registers every bounded label combination at zero at start-up, so that
//! `rate()` and absence alerts work from the first scrape after a restart.
//! `docs/metrics.md` is generated from it, and a test checks that every
//! metric the code records is listed here and every one listed is recorded.

use crate::{ErrorKind, LoopType, Origin, StopReason, WatchdogKind};

/// A Prometheus metric type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (`_total`).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations in buckets (`_seconds`).
    Histogram,
}

impl Kind {
    /// The Prometheus name of the type.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Where a label's values come from.
#[derive(Clone, Copy, Debug)]
pub enum Values {
    /// A fixed set, known to the code.
    Fixed(fn() -> Vec<&'static str>),
    /// The configured model engines' names.
    ModelEngines,
    /// The configured ACP agent engines' names.
    AgentEngines,
}

/// One label of a metric.
#[derive(Clone, Copy, Debug)]
pub struct Label {
    /// The label's name.
    pub name: &'static str,
    /// Its values.
    pub values: Values,
}

/// One metric.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// The metric's name (unit in the name).
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// The `# HELP` line.
    pub help: &'static str,
    /// Its labels, in order.
    pub labels: &'static [Label],
}

const fn fixed(name: &'static str, values: fn() -> Vec<&'static str>) -> Label {
    Label {
        name,
        values: Values::Fixed(values),
    }
}

const ORIGIN: Label = fixed("origin", || Origin::ALL.map(Origin::as_str).to_vec());
const MODEL: Label = Label {
    name: "engine",
    values: Values::ModelEngines,
};
const AGENT: Label = Label {
    name: "engine",
    values: Values::AgentEngines,
};

/// How a turn settled: a stop reason or an error kind.
pub fn outcomes() -> Vec<&'static str> {
    let mut out: Vec<_> = StopReason::ALL.map(StopReason::as_str).to_vec();
    out.extend(ErrorKind::ALL.map(ErrorKind::as_str));
    out
}

/// Every metric, sorted by name.
pub const ALL: &[Metric] = &[
    Metric {
        name: "tiller_accept_errors_total",
        kind: Kind::Counter,
        help: "Errors accepting a connection (fd exhaustion and the like), by listener.",
        labels: &[fixed("listener", || vec!["http", "unix"])],
    },
    Metric {
        name: "tiller_acp_catch_ups_total",
        kind: Kind::Counter,
        help: "ACP subscribers that fell behind and caught up from the store.",
        labels: &[],
    },
    Metric {
        name: "tiller_build_info",
        kind: Kind::Gauge,
        help: "Always 1; the labels name the running build.",
        labels: &[],
    },
    Metric {
        name: "tiller_cancel_latency_seconds",
        kind: Kind::Histogram,
        help: "From session/cancel to the turn's terminal.",
        labels: &[],
    },
    Metric {
        name: "tiller_channel_refusals_total",
        kind: Kind::Counter,
        help: "Channel ingress requests refused (bad signature, unknown channel, replay).",
        labels: &[],
    },
    Metric {
        name: "tiller_compactions_total",
        kind: Kind::Counter,
        help: "Context compactions, by model engine and outcome.",
        labels: &[
            MODEL,
            fixed("outcome", || vec!["completed", "failed", "cancelled"]),
        ],
    },
    Metric {
        name: "tiller_connections_active",
        kind: Kind::Gauge,
        help: "Open ACP connections, by transport.",
        labels: &[fixed("transport", || vec!["unix", "websocket", "stdio"])],
    },
    Metric {
        name: "tiller_cron_fires_total",
        kind: Kind::Counter,
        help: "Cron job fires queued as prompts.",
        labels: &[],
    },
    Metric {
        name: "tiller_deliveries_total",
        kind: Kind::Counter,
        help: "Outbound result deliveries, by outcome.",
        labels: &[fixed("outcome", || {
            vec!["delivered", "retried", "given_up"]
        })],
    },
    Metric {
        name: "tiller_engine_processes",
        kind: Kind::Gauge,
        help: "Live ACP agent child processes, by engine.",
        labels: &[AGENT],
    },
    Metric {
        name: "tiller_engine_resident_memory_bytes",
        kind: Kind::Gauge,
        help: "Resident memory of an engine's agent processes, summed.",
        labels: &[AGENT],
    },
    Metric {
        name: "tiller_engine_restarts_total",
        kind: Kind::Counter,
        help: "ACP agent processes that ended, by engine and reason.",
        labels: &[
            AGENT,
            fixed("reason", || vec!["exited", "protocol", "killed", "idle"]),
        ],
    },
    Metric {
        name: "tiller_engine_stale_messages_total",
        kind: Kind::Counter,
        help: "Messages from an agent for a turn that had already settled.",
        labels: &[AGENT],
    },
    Metric {
        name: "tiller_engine_stop_seconds",
        kind: Kind::Histogram,
        help: "From a cancel that settled its turn at once to the end of the turn's engine (its last word, or its teardown at turn.cancel_grace); the next turn waits for it.",
        labels: &[],
    },
    Metric {
        name: "tiller_events_published_total",
        kind: Kind::Counter,
        help: "Session events stored and published to subscribers.",
        labels: &[],
    },
    Metric {
        name: "tiller_goal_turns_total",
        kind: Kind::Counter,
        help: "Goal continuation turns, by outcome.",
        labels: &[fixed("outcome", || vec!["end_turn", "loop_stopped"])],
    },
    Metric {
        name: "tiller_http_connections_active",
        kind: Kind::Gauge,
        help: "Open HTTP connections.",
        labels: &[],
    },
    Metric {
        name: "tiller_http_connections_refused_total",
        kind: Kind::Counter,
        help: "HTTP connections refused at limits.max_connections.",
        labels: &[],
    },
    Metric {
        name: "tiller_http_header_timeouts_total",
        kind: Kind::Counter,
        help: "HTTP connections closed for sending their headers too slowly.",
        labels: &[],
    },
    Metric {
        name: "tiller_http_write_stalls_total",
        kind: Kind::Counter,
        help: "HTTP connections closed for taking nothing of a write for five minutes.",
        labels: &[],
    },
    Metric {
        name: "tiller_lease_renewal_failures_total",
        kind: Kind::Counter,
        help: "Lease renewals that failed (the store did not answer; cluster).",
        labels: &[],
    },
    Metric {
        name: "tiller_leases_lost_total",
        kind: Kind::Counter,
        help: "Sessions another node took over from this one (it was paused or cut off; cluster).",
        labels: &[],
    },
    Metric {
        name: "tiller_loop_detected_total",
        kind: Kind::Counter,
        help: "Turns stopped by loop protection, by loop type and origin.",
        labels: &[
            fixed("loop_type", || LoopType::ALL.map(LoopType::as_str).to_vec()),
            ORIGIN,
        ],
    },
    Metric {
        name: "tiller_model_requests_total",
        kind: Kind::Counter,
        help: "Requests to a model API, by engine and outcome.",
        labels: &[MODEL, fixed("outcome", || vec!["ok", "error"])],
    },
    Metric {
        name: "tiller_model_retries_total",
        kind: Kind::Counter,
        help: "Model API requests retried after a transient failure.",
        labels: &[MODEL],
    },
    Metric {
        name: "tiller_model_tokens_total",
        kind: Kind::Counter,
        help: "Tokens a model API reported, by engine and kind.",
        labels: &[MODEL, fixed("kind", || vec!["input", "output"])],
    },
    Metric {
        name: "tiller_notifications_queued",
        kind: Kind::Gauge,
        help: "Background notifications waiting for their session.",
        labels: &[],
    },
    Metric {
        name: "tiller_origin_markers_stripped_total",
        kind: Kind::Counter,
        help: "Caller-supplied origin markers removed at ingress, by ingress.",
        labels: &[fixed("ingress", || vec!["acp", "http"])],
    },
    Metric {
        name: "tiller_prompt_queue_depth",
        kind: Kind::Gauge,
        help: "Prompts admitted and waiting for their session's current turn.",
        labels: &[],
    },
    Metric {
        name: "tiller_prompts_admitted_total",
        kind: Kind::Counter,
        help: "Prompts admitted, by origin: counted once the admission is stored (a prompt the store refused is not).",
        labels: &[ORIGIN],
    },
    Metric {
        name: "tiller_sessions_active",
        kind: Kind::Gauge,
        help: "Sessions running in memory (with an actor).",
        labels: &[],
    },
    Metric {
        name: "tiller_sessions_created_total",
        kind: Kind::Counter,
        help: "Sessions created.",
        labels: &[],
    },
    Metric {
        name: "tiller_sessions_deleted_total",
        kind: Kind::Counter,
        help: "Sessions deleted.",
        labels: &[],
    },
    Metric {
        name: "tiller_sessions_parked",
        kind: Kind::Gauge,
        help: "Idle sessions parked: no actor, a record kept until a message wakes them.",
        labels: &[],
    },
    Metric {
        name: "tiller_sessions_taken_over_total",
        kind: Kind::Counter,
        help: "Sessions this node took from another node (one that went away or let go; cluster).",
        labels: &[],
    },
    Metric {
        name: "tiller_sessions_woken_total",
        kind: Kind::Counter,
        help: "Parked sessions woken: a message started their actor again from the store.",
        labels: &[],
    },
    Metric {
        name: "tiller_settle_latency_seconds",
        kind: Kind::Histogram,
        help: "From the input that settled a turn (engine signal, cancel, watchdog) to its terminal being published.",
        labels: &[],
    },
    Metric {
        name: "tiller_sse_catch_ups_total",
        kind: Kind::Counter,
        help: "SSE subscribers that fell behind and caught up from the store.",
        labels: &[],
    },
    Metric {
        name: "tiller_stale_signals_total",
        kind: Kind::Counter,
        help: "Engine signals for a turn that had already settled, dropped.",
        labels: &[],
    },
    Metric {
        name: "tiller_steer_receipt_timeouts_total",
        kind: Kind::Counter,
        help: "Steers whose receipt did not come within steer_receipt_timeout.",
        labels: &[],
    },
    Metric {
        name: "tiller_steer_receipts_total",
        kind: Kind::Counter,
        help: "Steer receipts from engines, by kind.",
        labels: &[fixed("kind", || vec!["consumed", "dropped"])],
    },
    Metric {
        name: "tiller_steers_total",
        kind: Kind::Counter,
        help: "Steering messages, by outcome.",
        labels: &[fixed("outcome", || {
            vec!["injected", "prompt_required", "started_new_turn"]
        })],
    },
    Metric {
        name: "tiller_store_append_failures_total",
        kind: Kind::Counter,
        help: "Store writes that failed (the caller got an error).",
        labels: &[],
    },
    Metric {
        name: "tiller_store_backlog_events",
        kind: Kind::Gauge,
        help: "Events accepted by the store writer and not yet committed.",
        labels: &[],
    },
    Metric {
        name: "tiller_store_checkpoint_seconds",
        kind: Kind::Histogram,
        help: "Time of one checkpoint of SQLite's write-ahead log into the database (its fsyncs included). `thread`: the checkpoint thread's, beside the commits; `writer`: one the writer ran itself, committing nothing meanwhile (`tiller serve` once the log holds 2,000 frames; inline, as in `tiller acp --embedded`, every one).",
        labels: &[fixed("by", || vec!["thread", "writer"])],
    },
    Metric {
        name: "tiller_store_damaged_sessions",
        kind: Kind::Gauge,
        help: "Sessions whose event log is damaged (two segments hold the same events): their reads are refused until they are deleted; `tiller doctor` names them.",
        labels: &[],
    },
    Metric {
        name: "tiller_store_write_seconds",
        kind: Kind::Histogram,
        help: "Time of one store write transaction.",
        labels: &[],
    },
    Metric {
        name: "tiller_subscriber_evictions_total",
        kind: Kind::Counter,
        help: "Live subscribers dropped for falling too far behind.",
        labels: &[],
    },
    Metric {
        name: "tiller_subscribers_active",
        kind: Kind::Gauge,
        help: "Live subscribers to session events (ACP, SSE, Web Shell).",
        labels: &[],
    },
    Metric {
        name: "tiller_tool_calls_total",
        kind: Kind::Counter,
        help: "Tool calls run by the daemon, by status.",
        labels: &[fixed("status", || vec!["completed", "failed"])],
    },
    Metric {
        name: "tiller_tool_panics_total",
        kind: Kind::Counter,
        help: "Tool calls whose task panicked (reported to the model as a failure).",
        labels: &[],
    },
    Metric {
        name: "tiller_turn_duration_seconds",
        kind: Kind::Histogram,
        help: "From a prompt's admission to its terminal, by origin.",
        labels: &[ORIGIN],
    },
    Metric {
        name: "tiller_turns_settled_total",
        kind: Kind::Counter,
        help: "Turns settled, by origin and outcome (a stop reason or an error kind).",
        labels: &[ORIGIN, fixed("outcome", outcomes)],
    },
    Metric {
        name: "tiller_watchdog_fired_total",
        kind: Kind::Counter,
        help: "Watchdogs that fired (a turn that would otherwise hang, or a cancelled turn's engine that did not stop), by kind.",
        labels: &[fixed("kind", || {
            WatchdogKind::ALL.map(WatchdogKind::as_str).to_vec()
        })],
    },
];

/// Histogram buckets for latencies, in seconds: 100 us to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// Histogram buckets for whole turns, in seconds: 10 ms to 1 h.
pub const TURN_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Each combination of a metric's label values, given the configured
/// engines. Empty when a label has no value (no engine of that kind):
/// such a series appears on its first event.
pub fn combinations(
    m: &Metric,
    models: &[String],
    agents: &[String],
) -> Vec<Vec<(&'static str, String)>> {
    let mut out = vec![vec![]];
    for label in m.labels {
        let values: Vec<String> = match label.values {
            Values::Fixed(f) => f().into_iter().map(str::to_owned).collect(),
            Values::ModelEngines => models.to_vec(),
            Values::AgentEngines => agents.to_vec(),
        };
        out = out
            .into_iter()
            .flat_map(|prefix| {
                values.iter().map(move |v| {
                    let mut next = prefix.clone();
                    next.push((label.name, v.clone()));
                    next
                })
            })
            .collect();
    }
    out
}

/// The metrics reference, as `docs/metrics.md` holds it.
pub fn reference() -> String {
    let mut out = String::from(
        "# Metrics reference\n\n\
         Generated from `crates/tiller-core/src/metrics.rs` (a test keeps this file equal to it:\n\
         `TILLER_BLESS=1 cargo test -p tiller --test metrics` rewrites it). Every series with\n\
         bounded labels exists at zero from start-up; `engine` labels take the configured\n\
         engines' names. Besides these, the `process_*` metrics (resident memory, CPU seconds,\n\
         open and max fds, threads, start time) describe the daemon's process.\n\n\
         | Metric | Type | Labels | Description |\n|---|---|---|---|\n",
    );
    for m in ALL {
        let labels = m
            .labels
            .iter()
            .map(|l| match l.values {
                Values::Fixed(f) => format!("`{}` ({})", l.name, f().join(", ")),
                Values::ModelEngines => format!("`{}` (model engines)", l.name),
                Values::AgentEngines => format!("`{}` (ACP agent engines)", l.name),
            })
            .collect::<Vec<_>>();
        let labels = if m.name == "tiller_build_info" {
            "`version`, `commit`".to_owned()
        } else {
            labels.join("; ")
        };
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            m.name,
            m.kind.as_str(),
            labels,
            m.help
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sorted_unique_and_follow_the_conventions() {
        for w in ALL.windows(2) {
            assert!(w[0].name < w[1].name, "{} before {}", w[0].name, w[1].name);
        }
        for m in ALL {
            assert!(m.name.starts_with("tiller_"), "{}", m.name);
            match m.kind {
                Kind::Counter => assert!(m.name.ends_with("_total"), "{}", m.name),
                Kind::Histogram => assert!(m.name.ends_with("_seconds"), "{}", m.name),
                Kind::Gauge => assert!(!m.name.ends_with("_total"), "{}", m.name),
            }
            assert!(m.help.ends_with('.'), "{}", m.name);
        }
    }

    #[test]
    fn combinations_cover_every_origin_and_outcome() {
        let settled = ALL
            .iter()
            .find(|m| m.name == "tiller_turns_settled_total")
            .unwrap();
        let all = combinations(settled, &[], &[]);
        assert_eq!(all.len(), Origin::ALL.len() * outcomes().len());
        let want = vec![
            ("origin", "cron".to_owned()),
            ("outcome", "loop_detected".to_owned()),
        ];
        assert!(all.contains(&want));
        let tokens = ALL
            .iter()
            .find(|m| m.name == "tiller_model_tokens_total")
            .unwrap();
        assert!(combinations(tokens, &[], &["a".into()]).is_empty());
        assert_eq!(
            combinations(tokens, &["m1".into(), "m2".into()], &[]).len(),
            4
        );
    }
}
