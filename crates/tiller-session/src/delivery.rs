//! Delivery destinations: a prompt may ask for its final text to be posted
//! to a webhook on `end_turn`. Only hosts the config allows are accepted.
//! Asking for delivery never changes how a turn is classified.

/// Checks a webhook URL against `[delivery] allowed_hosts` (the name or
/// address is checked again, resolved, when it is sent); returns it
/// normalized.
pub fn check_webhook(raw: &str, allowed: &tiller_tools::egress::Policy) -> Result<String, String> {
    allowed.check(raw).map(|u| u.to_string())
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
        let allowed = tiller_tools::egress::Policy::new(&[
            "127.0.0.1".to_string(),
            "hooks.example:8443".to_string(),
        ])
        .unwrap();
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
