//! `tiller doctor`: checks what a daemon needs and prints what to fix.
//! Each check is a line `ok`, `warn` or `FAIL`; the exit code is 1 when
//! any check failed. It never changes anything.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use crate::config::Config;

/// How a check ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

/// One finding: what was checked, how it ended, and what to do.
#[derive(Debug)]
pub struct Finding {
    pub level: Level,
    pub what: String,
    pub detail: String,
}

fn finding(level: Level, what: impl Into<String>, detail: impl Into<String>) -> Finding {
    Finding {
        level,
        what: what.into(),
        detail: detail.into(),
    }
}

/// How long an engine gets to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs every check.
pub async fn run(cfg: &Config) -> Vec<Finding> {
    let mut out = vec![finding(Level::Ok, "config", "loaded and valid")];
    out.extend(data_dir(cfg));
    out.push(daemon_socket(cfg).await);
    out.push(store(
        cfg,
        out.last()
            .is_some_and(|f| f.detail.starts_with("a daemon is listening")),
    ));
    for (name, m) in &cfg.engine.models {
        out.push(model_engine(name, m).await);
    }
    for (name, a) in &cfg.engine.agents {
        let found = agent(name, &a.command);
        let runs = found.level == Level::Ok;
        out.push(found);
        if runs {
            out.push(agent_initialize(name, a, cfg).await);
        }
    }
    out
}

/// Most characters of one finding's part printed.
const SHOWN_MAX: usize = 2_000;

/// `text` as the terminal may show it: what an agent or a server said
/// (its name, its answer) can hold control characters (an escape sequence
/// would drive the operator's terminal) and be of any length.
fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(SHOWN_MAX));
    for (count, c) in text.chars().enumerate() {
        if count == SHOWN_MAX {
            let rest = text.chars().count() - count;
            out.push_str(&format!("... ({rest} more characters)"));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The findings as the command prints them, and its exit code (1 when
/// any failed).
pub fn report(findings: &[Finding]) -> (String, u8) {
    let mut text = String::new();
    for f in findings {
        let tag = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        text.push_str(&format!(
            "{tag}  {}: {}\n",
            shown(&f.what),
            shown(&f.detail)
        ));
    }
    let failed = findings.iter().filter(|f| f.level == Level::Fail).count();
    if failed > 0 {
        text.push_str(&format!(
            "{failed} check(s) failed: fix the FAIL lines above."
        ));
        (text, 1)
    } else {
        text.push_str("all checks passed");
        (text, 0)
    }
}

/// The data directory and the token file: ours, and nobody else's.
fn data_dir(cfg: &Config) -> Vec<Finding> {
    let dir = cfg.data_dir();
    let shown = dir.display();
    let meta = match std::fs::metadata(&dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return vec![finding(
                Level::Ok,
                "data directory",
                format!("{shown} does not exist yet; the first start creates it (0700)"),
            )];
        }
        Err(e) => {
            return vec![finding(
                Level::Fail,
                "data directory",
                format!("{shown}: {e}"),
            )];
        }
    };
    let mut out = Vec::new();
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_dir() {
        out.push(finding(
            Level::Fail,
            "data directory",
            format!("{shown} is not a directory"),
        ));
    } else if meta.uid() != me {
        out.push(finding(
            Level::Fail,
            "data directory",
            format!("{shown} belongs to uid {}, not to this user ({me}): run the daemon as its owner or `chown` it", meta.uid()),
        ));
    } else if meta.permissions().mode() & 0o077 != 0 {
        out.push(finding(
            Level::Fail,
            "data directory",
            format!(
                "{shown} is mode {:o}: other users can reach the token and the store; run `chmod 700 {shown}`",
                meta.permissions().mode() & 0o777
            ),
        ));
    } else {
        out.push(finding(
            Level::Ok,
            "data directory",
            format!("{shown} (0700, ours)"),
        ));
    }
    let token = cfg.token_path();
    if let Ok(m) = std::fs::metadata(&token) {
        if m.permissions().mode() & 0o077 != 0 {
            out.push(finding(
                Level::Fail,
                "token file",
                format!(
                    "{} is readable by others: run `chmod 600 {}`",
                    token.display(),
                    token.display()
                ),
            ));
        } else {
            out.push(finding(
                Level::Ok,
                "token file",
                format!("{} (0600)", token.display()),
            ));
        }
    }
    out
}

/// Whether a daemon answers on the unix socket.
async fn daemon_socket(cfg: &Config) -> Finding {
    let path = cfg.socket_path();
    let shown = path.display();
    if !path.exists() {
        return finding(Level::Ok, "socket", format!("{shown}: no daemon running"));
    }
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::UnixStream::connect(&path)).await {
        Ok(Ok(_)) => finding(
            Level::Ok,
            "socket",
            format!("a daemon is listening on {shown}"),
        ),
        Ok(Err(e)) => finding(
            Level::Warn,
            "socket",
            format!(
                "{shown} exists but nothing answers ({e}): a daemon stopped without removing it; the next start replaces it"
            ),
        ),
        Err(_) => finding(
            Level::Warn,
            "socket",
            format!("{shown} did not answer within {}s", PROBE_TIMEOUT.as_secs()),
        ),
    }
}

/// The store's integrity (only when no daemon holds it).
fn store(cfg: &Config, daemon_running: bool) -> Finding {
    let path = cfg.db_path();
    let shown = path.display();
    if !path.exists() {
        return finding(Level::Ok, "store", format!("{shown} does not exist yet"));
    }
    if daemon_running {
        return finding(
            Level::Warn,
            "store",
            format!("{shown} is held by the running daemon: stop it to check its integrity"),
        );
    }
    match tiller_store::integrity_check(&path) {
        Ok(found) if found.is_empty() => match tiller_store::damaged_logs(&path) {
            Ok(damaged) if damaged.is_empty() => {
                finding(Level::Ok, "store", format!("{shown}: integrity_check ok"))
            }
            Ok(damaged) => finding(
                Level::Fail,
                "store",
                format!(
                    "{shown}: damaged session logs ({}); start the daemon and delete each session named (`DELETE /api/sessions/<id>?purge=true`) to repair the store (it refuses the reads of those whose damage it finds at start)",
                    damaged
                        .iter()
                        .take(5)
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ),
            Err(e) => finding(Level::Fail, "store", format!("{shown} cannot be read: {e}")),
        },
        Ok(found) => finding(
            Level::Fail,
            "store",
            format!(
                "{shown} is damaged ({}); restore it from a backup (SQLite's `.recover` may save what is left)",
                found.into_iter().take(5).collect::<Vec<_>>().join("; ")
            ),
        ),
        Err(e) if e.is_in_use() => finding(
            Level::Warn,
            "store",
            format!("{shown} is in use ({e}): stop the daemon to check it"),
        ),
        Err(e) => finding(Level::Fail, "store", format!("{shown} cannot be read: {e}")),
    }
}

/// A model engine answers its `/models` (with its key, if it has one).
async fn model_engine(name: &str, m: &crate::config::ModelEngineCfg) -> Finding {
    let what = format!("engine {name}");
    let cfg = match m.to_model(name) {
        Ok(c) => c,
        Err(e) => return finding(Level::Fail, what, e),
    };
    let mut key = None;
    if let Some(var) = &cfg.api_key_env {
        match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => key = Some(k.trim().to_owned()),
            _ => {
                return finding(
                    Level::Fail,
                    what,
                    format!(
                        "the environment variable {var} (engine.{name}.api_key_env) is not set"
                    ),
                );
            }
        }
    }
    let base = cfg.base_url.trim_end_matches('/');
    let url = match cfg.provider {
        tiller_engine::model::Provider::OpenAi => format!("{base}/models"),
        tiller_engine::model::Provider::Anthropic => format!("{base}/v1/models"),
    };
    // Shown without credentials or query (a base_url may carry them).
    let shown = tiller_tools::egress::redact(&url);
    let client = match reqwest::Client::builder()
        .timeout(PROBE_TIMEOUT)
        .redirect(tiller_engine::model::same_origin_redirects())
        .build()
    {
        Ok(c) => c,
        Err(e) => return finding(Level::Fail, what, format!("no HTTP client: {e}")),
    };
    let mut req = client.get(&url);
    if let Some(k) = &key {
        req = match cfg.provider {
            tiller_engine::model::Provider::OpenAi => req.bearer_auth(k),
            tiller_engine::model::Provider::Anthropic => req
                .header("x-api-key", k)
                .header("anthropic-version", "2023-06-01"),
        };
    }
    let redact = |s: String| match &key {
        Some(k) if k.len() >= 4 => s.replace(k.as_str(), "[redacted]"),
        _ => s,
    };
    match req.send().await {
        Ok(r) if r.status().is_success() => finding(Level::Ok, what, format!("{shown} answers")),
        Ok(r) if r.status().as_u16() == 401 || r.status().as_u16() == 403 => finding(
            Level::Fail,
            what,
            format!(
                "{shown} refused the key ({}): check {}",
                r.status(),
                cfg.api_key_env.as_deref().unwrap_or("api_key_env")
            ),
        ),
        Ok(r) => finding(
            Level::Warn,
            what,
            format!(
                "{shown} answered {} (the server may not list models; turns may still work)",
                r.status()
            ),
        ),
        Err(e) => finding(
            Level::Fail,
            what,
            redact(format!(
                "{shown} is unreachable: {}; check engine.{name}.base_url and that the server runs",
                tiller_tools::egress::scrub(&e.to_string(), &url)
            )),
        ),
    }
}

/// An ACP agent starts as the engine would start it and answers
/// `initialize`.
async fn agent_initialize(name: &str, a: &crate::config::AcpEngineCfg, cfg: &Config) -> Finding {
    let what = format!("engine {name} initialize");
    let acp = match a.to_acp(name, std::env::vars(), cfg.turn.cancel_grace) {
        Ok(acp) => acp,
        Err(e) => return finding(Level::Fail, what, e),
    };
    match tiller_engine::acp::probe(&acp).await {
        Ok(p) if p.protocol_version == 1 => finding(
            Level::Ok,
            what,
            format!(
                "{} speaks ACP v1",
                p.agent.as_deref().unwrap_or("the agent")
            ),
        ),
        Ok(p) => finding(
            Level::Fail,
            what,
            format!(
                "{} speaks ACP v{}, Tiller speaks v1: install a version of the agent for ACP v1",
                p.agent.as_deref().unwrap_or("the agent"),
                p.protocol_version
            ),
        ),
        Err(e) => finding(
            Level::Fail,
            what,
            format!(
                "{e}; run `{}` by hand with the engine's env (its API key, engine.{name}.pass_env) and check engine.{name}.start_timeout",
                a.command
            ),
        ),
    }
}

/// An ACP agent's program can be started (found and executable).
fn agent(name: &str, command: &str) -> Finding {
    let what = format!("engine {name}");
    let path = Path::new(command);
    let found = if path.is_absolute() {
        Some(path.to_owned())
    } else {
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(command))
                .find(|c| c.is_file())
        })
    };
    match found {
        Some(p)
            if std::fs::metadata(&p)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) =>
        {
            finding(Level::Ok, what, format!("{} is executable", p.display()))
        }
        Some(p) => finding(
            Level::Fail,
            what,
            format!("{} is not an executable file", p.display()),
        ),
        None => finding(
            Level::Fail,
            what,
            format!(
                "`{command}` is not on PATH: install the agent or give engine.{name}.command as an absolute path"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an agent said reaches the terminal with its control characters
    /// escaped and its length bounded.
    #[test]
    fn a_finding_shows_no_control_character_and_no_endless_text() {
        let hostile = finding(
            Level::Fail,
            "engine a initialize",
            format!("evil\u{1b}]0;owned\u{7} agent\n{}", "x".repeat(1_000_000)),
        );
        let (text, code) = report(&[hostile]);
        assert_eq!(code, 1);
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:.200}"
        );
        assert!(
            text.contains(r"evil\u{1b}]0;owned\u{7} agent\n"),
            "{text:.200}"
        );
        assert!(text.len() < 2 * SHOWN_MAX + 200, "{} bytes", text.len());
        assert!(text.contains("more characters)"));
    }
}
