//! The token TCP clients present. Configured (`server.token`, usually
//! from `TILLER_SERVER__TOKEN`), read from `server.token_file`, or, with
//! neither, generated at first start into `<data_dir>/token` (0600), the
//! way Jupyter does, so `tiller serve` stays a one-command start. Admin
//! commands and `tiller acp --connect ws://...` find it the same way.

use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::config::Config;

/// Where the daemon's token came from.
#[derive(Debug, PartialEq, Eq)]
pub enum Source {
    /// `server.token` (the config or TILLER_SERVER__TOKEN).
    Configured,
    /// A file that already held it.
    File(PathBuf),
    /// Generated now into this file.
    Generated(PathBuf),
}

/// The daemon's token (`None` with `server.auth = "none"`).
pub fn for_daemon(cfg: &Config) -> anyhow::Result<Option<(String, Source)>> {
    if cfg.server.auth == "none" {
        return Ok(None);
    }
    if !cfg.server.token.is_empty() {
        if cfg.server.token.len() < 16 {
            tracing::warn!(
                "server.token is shorter than 16 characters; anyone who can reach the port may guess it"
            );
        }
        return Ok(Some((cfg.server.token.clone(), Source::Configured)));
    }
    let path = cfg.token_path();
    // The data directory's own file must be the daemon's user's (one
    // `server.token_file` names, a secrets mount's, is the operator's
    // choice).
    if cfg.server.token_file.is_empty()
        && let Ok(meta) = std::fs::symlink_metadata(&path)
        && meta.uid() != rustix::process::geteuid().as_raw()
    {
        anyhow::bail!(
            "the token file {} belongs to another user (uid {}), who chose the token; remove it \
             (a new one is generated)",
            path.display(),
            meta.uid()
        );
    }
    if let Some(token) = read(&path)? {
        return Ok(Some((token, Source::File(path))));
    }
    if !cfg.server.token_file.is_empty() {
        anyhow::bail!(
            "server.token_file {} does not exist; create it (one line, the token) or leave \
             server.token_file empty to have one generated in the data directory",
            path.display()
        );
    }
    // An empty file (a crash between create and write) holds no token:
    // make a new one.
    if path.exists() {
        std::fs::remove_file(&path)
            .with_context(|| format!("cannot replace the empty token file {}", path.display()))?;
    }
    let token = generate();
    // O_EXCL: two daemons starting at once never overwrite each other's.
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let token = read(&path)?.context("the token file appeared empty")?;
            return Ok(Some((token, Source::File(path))));
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("cannot create the token file {}", path.display()));
        }
    };
    f.write_all(format!("{token}\n").as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write the token file {}", path.display()))?;
    Ok(Some((token, Source::Generated(path))))
}

/// The token a client command presents: `--token-file`, else the config's
/// (TILLER_SERVER__TOKEN, server.token_file), else the data directory's
/// `token` file if there is one.
pub fn for_client(cfg: &Config, token_file: Option<&Path>) -> anyhow::Result<Option<String>> {
    if let Some(p) = token_file {
        return read(p)?
            .map(Some)
            .with_context(|| format!("--token-file {} is empty or missing", p.display()));
    }
    if !cfg.server.token.is_empty() {
        return Ok(Some(cfg.server.token.clone()));
    }
    // Unreadable (another user's daemon) is the same as absent: the
    // daemon then answers 401, which says what to do.
    Ok(read(&cfg.token_path()).ok().flatten())
}

/// Reads a token file: its first line, trimmed; `None` when absent. A
/// file others may read is tightened to 0600 (it is a password).
fn read(path: &Path) -> anyhow::Result<Option<String>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
            Ok(()) => {
                tracing::warn!(file = %path.display(), "the token file was readable by others; it is now 0600");
            }
            // A file the operator named (a read-only secrets mount): as
            // they chose. The data directory's own is the daemon's user's
            // (checked by `for_daemon`), so this does not fail there.
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "the token file is readable by others and cannot be made 0600");
            }
        }
    }
    let token = text.lines().next().unwrap_or_default().trim().to_owned();
    Ok((!token.is_empty()).then_some(token))
}

/// 244 random bits (two v4 UUIDs, from the OS's generator), as hex.
fn generate() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, extra: &[(&str, &str)]) -> Config {
        let mut env = vec![(
            "TILLER_STORE__DATA_DIR".to_owned(),
            format!("\"{}\"", dir.display()),
        )];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::load(None, env).unwrap()
    }

    #[test]
    fn generated_once_then_read_and_found_by_clients() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), &[]);
        let (t1, s1) = for_daemon(&c).unwrap().unwrap();
        let path = d.path().join("token");
        assert_eq!(s1, Source::Generated(path.clone()));
        assert_eq!(t1.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (t2, s2) = for_daemon(&c).unwrap().unwrap();
        assert_eq!((t2.as_str(), s2), (t1.as_str(), Source::File(path.clone())));
        assert_eq!(for_client(&c, None).unwrap().as_deref(), Some(t1.as_str()));
        // An empty file is replaced.
        std::fs::write(&path, "").unwrap();
        let (t3, s3) = for_daemon(&c).unwrap().unwrap();
        assert_eq!(s3, Source::Generated(path.clone()));
        assert_ne!(t3, t1);
        // A loose file is tightened.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        for_daemon(&c).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    /// A token file in the data directory that another user owns (placed
    /// while the directory was open) is theirs: refused, not used. (Run as
    /// root, as CI does, to give the file away.)
    #[test]
    fn a_token_file_another_user_owns_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), &[]);
        let path = d.path().join("token");
        std::fs::write(&path, "chosen-by-someone-else-0123456789\n").unwrap();
        if rustix::fs::chown(&path, Some(rustix::fs::Uid::from_raw(65534)), None).is_err() {
            assert!(!rustix::process::geteuid().is_root());
            return;
        }
        let e = for_daemon(&c).expect_err("another user's token file");
        assert!(format!("{e:#}").contains("another user"), "{e:#}");
    }

    #[test]
    fn configured_token_and_auth_none() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), &[("TILLER_SERVER__TOKEN", "s3cret")]);
        assert_eq!(
            for_daemon(&c).unwrap(),
            Some(("s3cret".into(), Source::Configured))
        );
        assert!(!d.path().join("token").exists(), "nothing generated");
        let c = cfg(d.path(), &[("TILLER_SERVER__AUTH", "none")]);
        assert_eq!(for_daemon(&c).unwrap(), None);
        let f = d.path().join("given");
        std::fs::write(&f, "from-file\n").unwrap();
        assert_eq!(
            for_client(&c, Some(&f)).unwrap().as_deref(),
            Some("from-file")
        );
        let c = cfg(
            d.path(),
            &[(
                "TILLER_SERVER__TOKEN_FILE",
                &format!("\"{}\"", d.path().join("nope").display()),
            )],
        );
        assert!(for_daemon(&c).is_err(), "a named file must exist");
    }
}
