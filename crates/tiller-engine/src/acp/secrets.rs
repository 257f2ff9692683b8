//! What an agent process is given that may be secret, and keeping it out
//! of what Tiller shows: its error text and the log of its stderr.

/// The values that may be secrets, at least 8 characters long (a shorter
/// one would blank out ordinary words): every one in `env` but the base
/// variables' (and each line of one on several: a PEM key), and what
/// `args` seem to give as one (a heuristic, see [`arg_secrets`]).
pub(super) fn secrets(env: &[(String, String)], args: &[String]) -> Box<[String]> {
    let from_env = env
        .iter()
        .filter(|(k, _)| !crate::BASE_ENV.contains(&k.as_str()))
        .flat_map(|(_, v)| {
            let lines = v.contains('\n').then(|| v.lines().map(str::trim));
            std::iter::once(v.as_str()).chain(lines.into_iter().flatten())
        });
    from_env
        .chain(arg_secrets(args))
        .filter(|v| v.len() >= 8)
        .map(str::to_owned)
        .collect()
}

/// Whether a flag's, a variable's or a header's name names a secret: its
/// last word is (or ends in) key, token, secret, password, passphrase,
/// credential(s) or auth(orization) (`--api-key`, `--apikey`,
/// `OPENAI_API_KEY`, `Authorization`), not what names where or what kind
/// (`--api-key-env`, `--token-url`, `--auth-provider`, `--tokenizer`), and
/// not a negated flag (`--no-keychain`).
fn names_a_secret(name: &str) -> bool {
    const WORDS: [&str; 10] = [
        "key",
        "token",
        "secret",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "auth",
        "authorization",
    ];
    let name = name.trim().trim_start_matches('-').to_ascii_lowercase();
    let last = name.rsplit(['-', '_', '.']).next().unwrap_or_default();
    !name.starts_with("no-") && WORDS.iter().any(|w| last.ends_with(w))
}

/// What `args` seem to give as secrets: the value of a flag naming one
/// (`--api-key VALUE`, `--token=VALUE`), of a `NAME=VALUE` or a header
/// `Name: value` whose name does (see [`names_a_secret`]), the token after
/// `Bearer ` or `Basic ` (any case), and the password in a URL
/// (`https://user:PASSWORD@host`).
fn arg_secrets(args: &[String]) -> impl Iterator<Item = &str> {
    args.iter().enumerate().flat_map(move |(i, a)| {
        let value = match a.split_once('=') {
            Some((name, value)) if names_a_secret(name) => Some(value),
            // `--header=Name: value` is a header, below.
            Some(_) => None,
            None if a.starts_with('-') && names_a_secret(a) => args
                .get(i + 1)
                .map(String::as_str)
                .filter(|v| !v.starts_with('-')),
            None => None,
        };
        // A header, given whole or as `--header=Name: value` (its value
        // may hold `=`: base64).
        let header = match a.split_once('=') {
            Some((flag, rest)) if flag.starts_with('-') && !flag.contains(':') => rest,
            _ => a.as_str(),
        }
        .split_once(':')
        .filter(|(name, _)| !name.contains("//") && names_a_secret(name))
        .map(|(_, v)| v.trim());
        // Its last word too (`Authorization: token ghp_...`).
        let word = header.and_then(|h| h.split_whitespace().next_back());
        value
            .into_iter()
            .chain(header)
            .chain(word)
            .chain(scheme_token(a))
            .chain(url_password(a))
    })
}

/// The token after `Bearer ` or `Basic ` (any case), to the next space,
/// comma or quote.
fn scheme_token(text: &str) -> Option<&str> {
    let lower = text.to_ascii_lowercase();
    let at = ["bearer ", "basic "]
        .iter()
        .find_map(|s| lower.find(s).map(|at| at + s.len()))?;
    let token = text[at..].trim_start();
    let end = token
        .find(|c: char| c.is_whitespace() || c == ',' || c == '"')
        .unwrap_or(token.len());
    Some(&token[..end])
}

/// The password in a URL's `user:password@`.
fn url_password(text: &str) -> Option<&str> {
    let after = &text[text.find("://")? + 3..];
    let authority = &after[..after.find(['/', '?', '#']).unwrap_or(after.len())];
    let (userinfo, _) = authority.rsplit_once('@')?;
    userinfo.split_once(':').map(|(_, password)| password)
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
    // A secret starting in the part shown is kept whole, and a byte more
    // tells a cut line.
    let keep = LOGGED_LINE + secrets.iter().map(String::len).max().unwrap_or(0) + 1;
    let mut from = tokio::io::BufReader::new(from);
    let mut line = Vec::with_capacity(keep);
    let mut emit = |line: &mut Vec<u8>| {
        if tracing::enabled!(tracing::Level::DEBUG) {
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let text = String::from_utf8_lossy(line);
            let mut shown = LOGGED_LINE.min(text.len());
            while !text.is_char_boundary(shown) {
                shown -= 1;
            }
            let mut logged = redact_upto(secrets, &text, shown);
            if shown < text.len() {
                logged.push_str(" (cut)");
            }
            log(&logged);
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

    /// Flags naming a kind or a place (`--auth-provider`, `--token-url`,
    /// `--tokenizer`, `--keyring-backend`) keep their values shown; headers
    /// and URLs carrying a credential do not; a multi-line secret (a PEM
    /// key in `env`) is hidden line by line.
    #[test]
    fn what_names_a_secret_is_told_from_what_names_where_or_what_kind() {
        let args = [
            "--auth-provider",
            "vertex-provider",
            "--token-url",
            "https://auth.example/token",
            "--tokenizer",
            "cl100k_base_x",
            "--keyring-backend",
            "secretservice",
            "--api-key-environment",
            "PROD_SETTINGS",
            "-H",
            "x-api-key: hdr-secret-1516",
            "--header=authorization: bearer tok-lower-1718, other",
            "--proxy",
            "https://user:url-pass-1920@proxy.example:8080",
            "--apikey",
            "sk-joined-2122",
            "x-api-key: padded-2324==",
            "--header=Authorization: token ghp-bare-2526",
        ]
        .map(str::to_owned);
        let env = [(
            "KEY_PEM".to_owned(),
            "-----BEGIN KEY-----\nline-one-of-key\nline-two-of-key\n-----END KEY-----".to_owned(),
        )];
        let said = "vertex-provider https://auth.example/token cl100k_base_x secretservice \
                    PROD_SETTINGS hdr-secret-1516 tok-lower-1718 url-pass-1920 \
                    sk-joined-2122 line-two-of-key padded-2324== ghp-bare-2526";
        assert_eq!(
            redact(&secrets(&env, &args), said),
            "vertex-provider https://auth.example/token cl100k_base_x secretservice \
             PROD_SETTINGS [redacted] [redacted] [redacted] [redacted] [redacted] [redacted] \
             [redacted]"
        );
    }

    /// A line's carriage return is not logged; a cut line says so.
    #[tokio::test]
    async fn a_logged_line_drops_its_carriage_return_and_says_when_cut() {
        let debug = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::sink)
            .finish();
        let _on = tracing::subscriber::set_default(debug);
        let mut text = b"one\r\n".to_vec();
        text.extend(std::iter::repeat_n(b'x', 3000));
        let mut logged = Vec::new();
        log_lines(&text[..], &[], |l| logged.push(l.to_owned())).await;
        assert_eq!(logged[0], "one");
        assert!(
            logged[1].starts_with("xxx") && logged[1].ends_with(" (cut)"),
            "{}",
            logged[1]
        );
    }
}
