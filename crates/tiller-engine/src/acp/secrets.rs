//! What an agent process is given that may be secret, and keeping it out
//! of what Tiller shows: its error text and the log of its stderr.

/// The values that may be secrets, at least 8 characters long (a shorter
/// one would blank out ordinary words): every one in `env` but the base
/// variables', and what `args` seems to give as one (a heuristic, see
/// [`arg_secrets`]).
pub(super) fn secrets(env: &[(String, String)], args: &[String]) -> Box<[String]> {
    let from_args = arg_secrets(args);
    env.iter()
        .filter(|(k, _)| !crate::BASE_ENV.contains(&k.as_str()))
        .map(|(_, v)| v.as_str())
        .chain(from_args)
        .filter(|v| v.len() >= 8)
        .map(str::to_owned)
        .collect()
}

/// What `args` seems to give as secrets: the value of a flag naming a key,
/// token, secret, password, passphrase, credential or auth (`--api-key
/// VALUE`, `--token=VALUE`), of a `NAME=VALUE` whose name does, and the
/// token after `Bearer `. Not a flag that names where a secret is
/// (`--api-key-env`, `--token-file`, `--key-dir`...) or what kind
/// (`--auth-type`), nor a negated one (`--no-keychain`).
fn arg_secrets(args: &[String]) -> impl Iterator<Item = &str> {
    const NAMES: [&str; 7] = [
        "key",
        "token",
        "secret",
        "passw",
        "passphrase",
        "credential",
        "auth",
    ];
    const NOT: [&str; 10] = [
        "env", "file", "path", "dir", "var", "name", "id", "type", "method", "mode",
    ];
    let secret_name = |name: &str| {
        let name = name.trim_start_matches('-').to_ascii_lowercase();
        let last = name.rsplit(['-', '_']).next().unwrap_or_default();
        !name.starts_with("no-") && !NOT.contains(&last) && NAMES.iter().any(|w| name.contains(w))
    };
    args.iter().enumerate().flat_map(move |(i, a)| {
        let value = match a.split_once('=') {
            Some((name, value)) => secret_name(name).then_some(value),
            None if a.starts_with('-') && secret_name(a) => args
                .get(i + 1)
                .map(String::as_str)
                .filter(|v| !v.starts_with('-')),
            None => None,
        };
        let bearer = a.find("Bearer ").map(|at| a[at + "Bearer ".len()..].trim());
        value.into_iter().chain(bearer)
    })
}

/// `text` with every byte of every occurrence of `secrets` (overlapping
/// ones too) replaced: each run of them becomes one `[redacted]`.
pub(super) fn redact(secrets: &[String], text: &str) -> String {
    redact_upto(secrets, text, text.len())
}

/// [`redact`] of `text[..upto]`, secrets found in the whole of `text` (one
/// that `upto` cuts is hidden too).
fn redact_upto(secrets: &[String], text: &str, upto: usize) -> String {
    let mut hidden = vec![false; text.len()];
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        let mut from = 0;
        while let Some(at) = text[from..].find(s.as_str()) {
            let at = from + at;
            hidden[at..at + s.len()].fill(true);
            // The next occurrence may overlap this one.
            from = at + text[at..].chars().next().map_or(1, char::len_utf8);
        }
    }
    let mut out = String::with_capacity(upto);
    let mut in_secret = false;
    for (i, c) in text[..upto].char_indices() {
        if hidden[i] {
            if !in_secret {
                out.push_str("[redacted]");
            }
            in_secret = true;
        } else {
            out.push(c);
            in_secret = false;
        }
    }
    out
}

/// Most of a stderr line logged, in bytes.
const LOGGED_LINE: usize = 2048;

/// Reads `from` to its end, giving `log` each line's first
/// [`LOGGED_LINE`] bytes with `secrets` redacted (each found whole,
/// wherever the line's reads or its cut fall), when debug logging is on.
pub(super) async fn log_lines(
    from: impl tokio::io::AsyncRead + Unpin,
    secrets: &[String],
    mut log: impl FnMut(&str),
) {
    use tokio::io::AsyncBufReadExt as _;
    // A secret starting in the part shown is kept whole.
    let keep = LOGGED_LINE + secrets.iter().map(String::len).max().unwrap_or(0);
    let mut from = tokio::io::BufReader::new(from);
    let mut line = Vec::with_capacity(keep);
    let mut emit = |line: &mut Vec<u8>| {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let text = String::from_utf8_lossy(line);
            let mut shown = LOGGED_LINE.min(text.len());
            while !text.is_char_boundary(shown) {
                shown -= 1;
            }
            log(&redact_upto(secrets, &text, shown));
        }
        line.clear();
    };
    loop {
        let buf = match from.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(buf) => buf,
        };
        let end = buf.iter().position(|b| *b == b'\n');
        let part = &buf[..end.unwrap_or(buf.len())];
        let room = keep.saturating_sub(line.len());
        line.extend_from_slice(&part[..part.len().min(room)]);
        let used = end.map_or(buf.len(), |e| e + 1);
        from.consume(used);
        if end.is_some() {
            emit(&mut line);
        }
    }
    if !line.is_empty() {
        emit(&mut line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_inside_another_is_redacted_with_no_part_of_the_longer_left() {
        let env = [
            ("PATH", "/usr/bin"),
            ("API_KEY", "sk-live-0123"),
            ("API_KEY_FULL", "sk-live-0123-tail-of-the-secret"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let said = "auth failed for sk-live-0123-tail-of-the-secret (key sk-live-0123)";
        assert_eq!(
            redact(&secrets(&env, &[]), said),
            "auth failed for [redacted] (key [redacted])"
        );
        // Two that overlap, neither holding the other; one that repeats
        // over itself; text around them kept, a multi-byte one too.
        let env = [
            ("A", "abcdefgh12345678"),
            ("B", "12345678zyxwvuts"),
            ("C", "aaaaaaaa"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        assert_eq!(
            redact(
                &secrets(&env, &[]),
                "é abcdefgh12345678zyxwvuts, aaaaaaaaaa é"
            ),
            "é [redacted], [redacted] é"
        );
    }

    /// The agent's stderr is logged a line at a time, each cut to 2 KiB
    /// after its secrets are redacted whole: none shows, in part or whole,
    /// where a read or the cut would split it.
    #[tokio::test]
    async fn the_agent_s_stderr_is_logged_by_line_with_its_secrets_redacted() {
        let secret = "SECRETvalue-0123456789";
        let secrets: Box<[String]> = Box::new([secret.to_owned()]);
        let mut text = Vec::new();
        text.extend_from_slice(b"starting\n");
        // Across the first 8 KiB (a read's size), and across the cut.
        text.extend(std::iter::repeat_n(b'a', 8192 - 9 - 5));
        text.extend_from_slice(format!("{secret} end\n").as_bytes());
        text.extend(std::iter::repeat_n(b'b', 2040));
        text.extend_from_slice(format!("{secret}\nlast {secret}").as_bytes());
        let mut logged = Vec::new();
        let debug = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::sink)
            .finish();
        let _on = tracing::subscriber::set_default(debug);
        log_lines(&text[..], &secrets, |l| logged.push(l.to_owned())).await;
        assert_eq!(logged.len(), 4, "{logged:?}");
        assert_eq!(logged[0], "starting");
        assert_eq!(logged[3], "last [redacted]");
        for line in &logged {
            assert!(line.len() <= 2048 + "[redacted]".len(), "{}", line.len());
            for part in ["SECRET", "0123456789", "SECRETvalue-0"] {
                assert!(!line.contains(part), "{part} in {line}");
            }
        }
        assert!(logged[1].starts_with("aaa") && logged[2].starts_with("bbb"));
    }

    /// A key given on the command line (`--api-key VALUE`,
    /// `--auth-token=VALUE`) is a secret like one in `env`; other
    /// arguments are not.
    #[test]
    fn a_secret_given_in_the_agent_s_arguments_is_redacted() {
        let args = [
            "--experimental-acp",
            "--api-key",
            "sk-from-args-0123",
            "--Auth-Token=tok-from-args-4567",
            "--model",
            "some-long-model-name",
            "--password",
            "--verbose-output",
            "--passphrase",
            "open-sesame-8910",
            "--api-key-env",
            "OPENAI_API_KEY",
            "--token-file",
            "/home/alice/token.txt",
            "--no-keychain",
            "plain-argument",
            "--auth-type",
            "oauth-personal",
            "OTHER_API_KEY=sk-positional-1112",
            "--header",
            "Authorization: Bearer tok-bearer-1314",
        ]
        .map(str::to_owned);
        let said = "bad key sk-from-args-0123 or tok-from-args-4567 or open-sesame-8910 \
                    or sk-positional-1112 or tok-bearer-1314 \
                    for some-long-model-name with --experimental-acp --verbose-output: \
                    OPENAI_API_KEY is not set, /home/alice/token.txt is missing, \
                    plain-argument, oauth-personal";
        assert_eq!(
            redact(&secrets(&[], &args), said),
            "bad key [redacted] or [redacted] or [redacted] \
             or [redacted] or [redacted] \
             for some-long-model-name with --experimental-acp --verbose-output: \
             OPENAI_API_KEY is not set, /home/alice/token.txt is missing, \
             plain-argument, oauth-personal"
        );
    }
}
