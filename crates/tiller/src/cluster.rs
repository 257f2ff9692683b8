//! `tiller cluster status`: the cluster as the shared store sees it.

use anyhow::Context as _;
use tiller_store::{NodeStatus, Store};

use crate::config::Config;

/// Prints the nodes of the cluster sharing the configured PostgreSQL
/// store: address, live leases, heartbeat age, and whether it is alive
/// (renewed within `cluster.lease_ttl`).
pub async fn status(cfg: &Config, json: bool) -> anyhow::Result<()> {
    let url = cfg
        .store
        .postgres_url()
        .map_err(anyhow::Error::msg)?
        .context("a cluster needs store.kind = \"postgres\" (this config uses SQLite: one node)")?;
    let schema = cfg.store.schema.clone();
    let store = tokio::task::spawn_blocking(move || Store::open_postgres(&url, &schema))
        .await
        .context("the store's opening task failed")??;
    let nodes = store.cluster_status().await?;
    let ttl = cfg.cluster.lease_ttl.as_millis() as i64;
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", render(&nodes, ttl, json));
    }
    Ok(())
}

fn render(nodes: &[NodeStatus], ttl_ms: i64, json: bool) -> String {
    let alive = |n: &NodeStatus| n.heartbeat_age_ms <= ttl_ms;
    if json {
        let list: Vec<_> = nodes
            .iter()
            .map(|n| {
                serde_json::json!({
                    "node": n.id,
                    "address": n.address,
                    "alive": alive(n),
                    "leases": n.leases,
                    "heartbeatAgeMs": n.heartbeat_age_ms,
                    "startedAt": n.started_ms,
                })
            })
            .collect();
        return serde_json::json!({ "nodes": list }).to_string();
    }
    let mut out = format!(
        "{:<24} {:<28} {:>7} {:>10}  {}",
        "NODE", "ADDRESS", "LEASES", "HEARTBEAT", "STATE"
    );
    for n in nodes {
        out.push_str(&format!(
            "\n{:<24} {:<28} {:>7} {:>8}ms  {}",
            n.id,
            n.address,
            n.leases,
            n.heartbeat_age_ms,
            if alive(n) { "alive" } else { "lost" }
        ));
    }
    if nodes.is_empty() {
        out.push_str("\n(no node has joined)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_past_the_lease_time_is_lost() {
        let node = |id: &str, age| NodeStatus {
            id: id.into(),
            address: format!("http://{id}:1"),
            started_ms: 5,
            heartbeat_age_ms: age,
            leases: 2,
        };
        let nodes = [node("a", 900), node("b", 12_000)];
        let table = render(&nodes, 10_000, false);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[1].starts_with("a ") && lines[1].ends_with("alive"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("b ") && lines[2].ends_with("lost"),
            "{table}"
        );
        let v: serde_json::Value = serde_json::from_str(&render(&nodes, 10_000, true)).unwrap();
        assert_eq!(v["nodes"][1]["alive"], false);
        assert_eq!(v["nodes"][0]["leases"], 2);
    }
}
