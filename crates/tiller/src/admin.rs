//! Admin subcommands: each talks to the running daemon's HTTP API and
//! prints its JSON answer.

use anyhow::Context as _;
use serde_json::Value;

/// Where the daemon is and how to authenticate.
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: String, token: Option<String>) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            token,
            http: {
                let mut b = reqwest::Client::builder();
                // Plain HTTP straight to the daemon: a proxy the environment
                // names would see the token in the clear. (Over HTTPS a
                // proxy sees only the tunnel, and may be the only way to a
                // remote daemon.)
                if !base.starts_with("https://") {
                    b = b.no_proxy();
                }
                b.build()
                    .expect("an HTTP client (as reqwest::Client::new would)")
            },
        }
    }

    /// Sends a request; returns the JSON body, or an error with the
    /// daemon's message.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        let changes_state = method != reqwest::Method::GET;
        let mut req = self.http.request(method, &url);
        if changes_state {
            // The daemon takes state changes as JSON only.
            req = req.header(reqwest::header::CONTENT_TYPE, "application/json");
        }
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.with_context(|| {
            format!(
                "no daemon answers at {} (start one with `tiller serve`, or pass --url)",
                self.base
            )
        })?;
        let status = res.status();
        let text = res.text().await.unwrap_or_default();
        let json: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if !status.is_success() {
            let msg = json["error"]["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| json.to_string());
            anyhow::bail!("{status}: {msg}");
        }
        Ok(json)
    }
}

/// Prints a JSON answer for people and scripts alike.
pub fn print(v: &Value) {
    if !v.is_null() {
        let text = serde_json::to_string_pretty(v).unwrap_or_default();
        #[allow(clippy::print_stdout)] // the command's output
        {
            println!("{text}");
        }
    }
}
