//! Delivery destinations: a prompt may ask for its final text to be posted
//! to a webhook on `end_turn`. Only hosts the config allows are accepted.
//! Asking for delivery never changes how a turn is classified.

/// Checks a webhook URL against `[delivery] allowed_hosts`; returns it
/// normalized.
pub fn check_webhook(raw: &str, allowed: &[String]) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("invalid webhook URL `{raw}`: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("webhook URL `{raw}` must be http or https"));
    }
    let host = url.host_str().unwrap_or_default();
    let with_port = url
        .port()
        .map_or_else(|| host.to_owned(), |p| format!("{host}:{p}"));
    if !allowed.iter().any(|a| a == host || *a == with_port) {
        return Err(format!(
            "webhook host `{host}` is not in delivery.allowed_hosts"
        ));
    }
    Ok(url.to_string())
}

/// Reads what a caller may ask for in a prompt's `_meta`: a delivery
/// webhook (`_meta.tiller.delivery.webhook`). Origin and channel markers
/// (`channel`, `origin`, at the top or under `tiller`) are ignored and
/// counted: only the channel ingress can classify a turn as a channel turn.
pub fn caller_meta(meta: Option<&serde_json::Value>, ingress: &'static str) -> Option<String> {
    let meta = meta?;
    let tiller = meta.get("tiller");
    for scope in [Some(meta), tiller].into_iter().flatten() {
        for key in ["channel", "origin"] {
            if scope.get(key).is_some() {
                metrics::counter!("tiller_origin_markers_stripped_total", "ingress" => ingress)
                    .increment(1);
                tracing::warn!(ingress, key, "ignoring a caller-supplied origin marker");
            }
        }
    }
    tiller?
        .get("delivery")?
        .get("webhook")?
        .as_str()
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let allowed = vec!["127.0.0.1".to_string(), "hooks.example:8443".to_string()];
        for (url, ok) in [
            ("http://127.0.0.1:9000/hook", true),
            ("https://hooks.example:8443/x", true),
            ("https://hooks.example/x", false),
            ("http://evil.example/x", false),
            ("ftp://127.0.0.1/x", false),
            ("not a url", false),
        ] {
            assert_eq!(check_webhook(url, &allowed).is_ok(), ok, "{url}");
        }
    }
}
