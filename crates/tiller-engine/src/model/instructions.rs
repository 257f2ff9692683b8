//! What a model engine tells the model besides the conversation: the
//! instructions for a coding agent (`instructions.md`, or the engine's
//! `system_prompt`), the engine's `system_prompt_append`, the session's
//! environment and the project's own rules (`AGENTS.md`, else `CLAUDE.md`).
//!
//! The project's files are hostile documents: the rules file is opened
//! without following links and only when it is a regular file (a FIFO
//! would block, a link could point anywhere), read up to [`RULES_MAX`];
//! `git` runs with a cleared environment, no system or global config, no
//! fsmonitor, no filter drivers, no submodules and no optional locks,
//! bounded in time and output.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::HostInfo;

/// The default instructions (the file a reviewer reads).
pub const DEFAULT: &str = include_str!("instructions.md");

/// The system text of a compaction's summary call.
pub const COMPACTION: &str = include_str!("compaction.md");

/// The request that closes the conversation sent for a summary.
pub const COMPACTION_REQUEST: &str =
    "Summarize the conversation above as your instructions say, under their headings.";

/// What the summary is introduced with in the conversation.
pub fn summary_message(summary: &str) -> String {
    format!(
        "(Earlier turns of this session were compacted into this summary; the full history is kept in the session's log.)\n\n{}",
        summary.trim()
    )
}

/// Most bytes of the project's rules file sent to the model.
pub const RULES_MAX: usize = 32 * 1024;

/// Most lines of `git status` shown (the rest counted).
const GIT_LINES: usize = 30;

/// How long `git status` may take.
const GIT_TIMEOUT: Duration = Duration::from_secs(3);

/// The `PATH` `git` runs with (its environment is cleared).
const GIT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The rules files looked for, in order: the first one present is used.
pub const RULES_FILES: [&str; 2] = ["AGENTS.md", "CLAUDE.md"];

/// The session's environment as the model is told it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Environment {
    pub cwd: PathBuf,
    pub roots: Vec<PathBuf>,
    pub os: String,
    pub shell: String,
    /// Today, `YYYY-MM-DD` and the zone.
    pub date: String,
    /// `Some` in a git repository: its branch and status summary.
    pub git: Option<String>,
    /// The project's rules: the file's name and its text (bounded).
    pub rules: Option<(String, String)>,
}

impl Environment {
    /// Looks at the session's directory (off the async workers: it reads
    /// a file and runs `git`).
    pub async fn gather(host: &HostInfo) -> Environment {
        let cwd = host.cwd.clone();
        let (rules, git) = if cwd.as_os_str().is_empty() {
            (None, None)
        } else {
            let dir = cwd.clone();
            let (rules, top) =
                tokio::task::spawn_blocking(move || (read_rules(&dir), repository_top(&dir)))
                    .await
                    .unwrap_or((None, None));
            let git = match top {
                Some(top) => git_status(&cwd, &top).await,
                None => None,
            };
            (rules, git)
        };
        let now = jiff::Zoned::now();
        Environment {
            cwd: host.cwd.clone(),
            roots: host.roots.clone(),
            os: format!("{} ({})", std::env::consts::OS, std::env::consts::ARCH),
            // What the `shell` tool runs.
            shell: "sh -c".into(),
            date: format!(
                "{} {}",
                now.date(),
                now.time_zone().iana_name().unwrap_or("UTC")
            ),
            git,
            rules,
        }
    }
}

/// The system text: the instructions (`system_prompt` replaces the
/// default), `append` after them, then the environment and the rules.
pub fn system_text(replace: Option<&str>, append: Option<&str>, env: &Environment) -> String {
    let mut s = String::with_capacity(DEFAULT.len() + 1024);
    s.push_str(replace.unwrap_or(DEFAULT).trim_end());
    if let Some(a) = append.filter(|a| !a.trim().is_empty()) {
        s.push_str("\n\n");
        s.push_str(a.trim_end());
    }
    s.push_str("\n\n# Environment\n");
    if !env.cwd.as_os_str().is_empty() {
        s.push_str(&format!("Working directory: {}\n", env.cwd.display()));
    }
    if !env.roots.is_empty() {
        let roots: Vec<String> = env.roots.iter().map(|r| r.display().to_string()).collect();
        s.push_str(&format!("Additional roots: {}\n", roots.join(", ")));
    }
    s.push_str(&format!(
        "OS: {}\nShell: {}\nDate: {}\n",
        env.os, env.shell, env.date
    ));
    match &env.git {
        Some(status) => {
            s.push_str("Git repository: yes\n```\n");
            s.push_str(status.trim_end());
            s.push_str("\n```\n");
        }
        None => s.push_str("Git repository: no\n"),
    }
    if let Some((name, text)) = &env.rules {
        s.push_str(&format!(
            "\n# Project rules ({name})\nThe project's own instructions, from {name} in the working directory. Follow them unless the user says otherwise.\n\n"
        ));
        s.push_str(text.trim_end());
        s.push('\n');
    }
    s
}

/// The first rules file present in `dir`, read safely and bounded.
fn read_rules(dir: &Path) -> Option<(String, String)> {
    RULES_FILES
        .iter()
        .find_map(|name| read_bounded(&dir.join(name)).map(|t| ((*name).to_owned(), t)))
}

/// A regular file's first [`RULES_MAX`] bytes as text (a note says when it
/// was cut); `None` when it is missing, a link, or anything but a file.
fn read_bounded(path: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits() as i32)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        return None;
    }
    let mut buf = Vec::with_capacity(RULES_MAX.min(meta.len() as usize));
    file.take(RULES_MAX as u64 + 1).read_to_end(&mut buf).ok()?;
    let cut = buf.len() > RULES_MAX;
    buf.truncate(RULES_MAX);
    let mut text = String::from_utf8_lossy(&buf).into_owned();
    if cut {
        // A cut through a character shows as a replacement character.
        text.push_str(&format!(
            "\n\n(The file is longer; only its first {} KiB are shown.)",
            RULES_MAX / 1024
        ));
    }
    Some(text)
}

/// The nearest of `dir` and the directories above it that has a `.git`:
/// the work tree git finds from `dir`. Without one, `git` (its environment
/// cleared: no `GIT_DIR`) finds no work tree and would only say so, so it
/// is not run: a turn in such a directory costs no process.
///
/// A `.git` directory is believed. A `.git` file or link may name any
/// repository on the machine (a password store's), whose tracked names
/// status would list as deleted: a file is believed only when the git
/// directory it names names it back, as a linked work tree's does (its
/// `gitdir` file), or lies in an enclosing repository's `.git/modules` (a
/// submodule's); a link never.
fn repository_top(dir: &Path) -> Option<PathBuf> {
    // Git looks up from the real directory: a link into a repository's
    // subdirectory is in that repository.
    let real = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let top = real
        .ancestors()
        .find(|d| d.join(".git").symlink_metadata().is_ok())?;
    let dot_git = top.join(".git");
    let meta = dot_git.symlink_metadata().ok()?;
    if meta.is_dir() {
        return Some(top.to_owned());
    }
    if !meta.is_file() || meta.len() > 4096 {
        return None;
    }
    let text = std::fs::read_to_string(&dot_git).ok()?;
    let named = text.lines().next()?.strip_prefix("gitdir:")?.trim();
    let git_dir = top.join(named).canonicalize().ok()?;
    let named_back = std::fs::read_to_string(git_dir.join("gitdir"))
        .ok()
        .and_then(|back| Path::new(back.trim_end()).canonicalize().ok())
        .is_some_and(|back| back == dot_git);
    let submodule = top
        .ancestors()
        .skip(1)
        .any(|above| git_dir.starts_with(above.join(".git/modules")))
        && core_worktree(&git_dir).is_some_and(|w| w == top);
    (named_back || submodule).then(|| top.to_owned())
}

/// The work tree a git directory's own config names (`core.worktree`, as
/// `git submodule` writes it: relative to that directory), real.
fn core_worktree(git_dir: &Path) -> Option<PathBuf> {
    let config = std::fs::read_to_string(git_dir.join("config")).ok()?;
    let mut in_core = false;
    for line in config.lines().map(str::trim) {
        if line.starts_with('[') {
            in_core = line.eq_ignore_ascii_case("[core]");
        } else if in_core
            && let Some((key, value)) = line.split_once('=')
            && key.trim().eq_ignore_ascii_case("worktree")
        {
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            return git_dir.join(value).canonicalize().ok();
        }
    }
    None
}

/// `git` in [`GIT_PATH`], found once. Started by its path, the child is
/// spawned without a copy of the daemon's page tables (`posix_spawn`; a
/// lookup under a changed `PATH` makes the standard library fork).
fn git_program() -> Option<&'static Path> {
    static GIT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(g) = GIT.get() {
        return Some(g);
    }
    // As a `PATH` lookup would: the first this process may run.
    let found = GIT_PATH
        .split(':')
        .map(|d| Path::new(d).join("git"))
        .find(|p| {
            p.metadata().is_ok_and(|m| m.is_file())
                && rustix::fs::access(p, rustix::fs::Access::EXEC_OK).is_ok()
        })?;
    Some(GIT.get_or_init(|| found))
}

/// `git` in `dir`, its work tree `top` (the directory holding the `.git`
/// it finds: a hostile config's `core.worktree` cannot point it at
/// another directory, whose file names status would list), never looking
/// above `top` (`None` when `top` is `/` or its parent holds a `:`, which
/// would split that list): its
/// environment cleared, no system or global config, its output read whole
/// within [`GIT_TIMEOUT`]; `None` when it is missing, slow or fails.
async fn git(
    dir: &Path,
    top: &Path,
    overrides: &[(String, &str)],
    args: &[&str],
) -> Option<Vec<u8>> {
    if top.parent()?.as_os_str().as_encoded_bytes().contains(&b':') {
        return None;
    }
    let mut cmd = tokio::process::Command::new(git_program()?);
    cmd.args(args)
        .current_dir(dir)
        .env_clear()
        .env("GIT_WORK_TREE", top)
        // Nor may git go on up past it: a `.git` that is no repository
        // would make it describe the one around it.
        .env("GIT_CEILING_DIRECTORIES", top.parent()?)
        .env("PATH", GIT_PATH)
        .env("LC_ALL", "C")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_TERMINAL_PROMPT", "0")
        // Given as the command line's `-c` would be, above the repository's
        // own config, but each key whole: a name may hold `=`.
        .env("GIT_CONFIG_COUNT", overrides.len().to_string());
    for (i, (key, value)) in overrides.iter().enumerate() {
        cmd.env(format!("GIT_CONFIG_KEY_{i}"), key)
            .env(format!("GIT_CONFIG_VALUE_{i}"), value);
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(GIT_TIMEOUT, cmd.output())
        .await
        .ok()?
        .ok()?;
    out.status.success().then_some(out.stdout)
}

/// What neutralizes every filter driver the repository's config (with
/// what it includes) names: status hashes a file whose stat data is stale
/// through its driver, which is a command from a hostile document. `None`
/// when the config cannot be read.
async fn without_filters(dir: &Path, top: &Path) -> Option<Vec<(String, &'static str)>> {
    let out = git(dir, top, &[], &["config", "-z", "--list"]).await?;
    let mut names: Vec<&[u8]> = out
        .split(|b| *b == 0)
        .filter_map(|entry| {
            let key = entry.split(|b| *b == b'\n').next()?;
            let key = key.strip_prefix(b"filter.")?;
            let dot = key.iter().rposition(|b| *b == b'.')?;
            Some(&key[..dot])
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut overrides = Vec::with_capacity(names.len() * 4);
    for name in names {
        let name = std::str::from_utf8(name).ok()?;
        for (var, value) in [
            ("clean", ""),
            ("smudge", ""),
            ("process", ""),
            ("required", "false"),
        ] {
            overrides.push((format!("filter.{name}.{var}"), value));
        }
    }
    Some(overrides)
}

/// `git status --branch --porcelain` of `dir`, bounded; `None` when it is
/// not a repository (or git is missing, slow or refuses). The repository
/// is a hostile document: its filter drivers are emptied, its fsmonitor
/// off, its submodules (each with a config of its own) not entered, and
/// no index is written (so no hook runs).
async fn git_status(dir: &Path, top: &Path) -> Option<String> {
    let mut overrides = without_filters(dir, top).await?;
    overrides.push(("core.fsmonitor".into(), "false"));
    overrides.push(("core.untrackedCache".into(), "false"));
    let out = git(
        dir,
        top,
        &overrides,
        &[
            "--no-optional-locks",
            "status",
            "--branch",
            "--porcelain=v1",
            "--ignore-submodules=all",
        ],
    )
    .await?;
    Some(summary(&String::from_utf8_lossy(&out)))
}

/// What the model is shown of `git status --branch --porcelain=v1`: its
/// first lines, each cut, without those naming a path outside the work
/// tree. Git never writes one for an index it made, but reads an index
/// as it finds it: a hand-made one may hold `../x` or `/etc/x`, and status
/// would tell whether each exists.
fn summary(status: &str) -> String {
    let mut lines = status.lines();
    let head = lines.next().unwrap_or_default();
    let (inside, outside): (Vec<&str>, Vec<&str>) = lines.partition(|l| {
        l.get(3..)
            .unwrap_or_default()
            .split(" -> ")
            .all(|path| !outside_the_tree(path))
    });
    let mut summary: Vec<String> = std::iter::once(head)
        .chain(inside.iter().copied().take(GIT_LINES))
        .map(|l| l.chars().take(300).collect())
        .collect();
    let more = inside.len().saturating_sub(GIT_LINES);
    if more > 0 {
        summary.push(format!("... and {more} more changed paths"));
    }
    if !outside.is_empty() {
        summary.push(format!(
            "({} paths outside the work tree left out)",
            outside.len()
        ));
    }
    if summary.len() == 1 {
        summary.push("(no changes)".into());
    }
    summary.join("\n")
}

/// Whether a path as status writes it (C-quoted when it holds special
/// characters) is absolute or climbs out with `..`.
fn outside_the_tree(path: &str) -> bool {
    let path = path
        .strip_prefix('"')
        .and_then(|p| p.strip_suffix('"'))
        .unwrap_or(path);
    path.starts_with('/') || path.split('/').any(|part| part == "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> Environment {
        Environment {
            cwd: "/p".into(),
            roots: vec!["/extra".into()],
            os: "linux (x86_64)".into(),
            shell: "sh -c".into(),
            date: "2026-12-02 UTC".into(),
            git: Some("## main\n M src/lib.rs".into()),
            rules: Some(("AGENTS.md".into(), "Use tabs.".into())),
        }
    }

    /// `system_prompt`, `system_prompt_append`, what the text must hold,
    /// what it must not.
    type Case<'a> = (
        Option<&'a str>,
        Option<&'a str>,
        &'a [&'a str],
        &'a [&'a str],
    );

    #[test]
    fn the_text_carries_instructions_environment_and_rules() {
        let table: &[Case<'_>] = &[
            (
                None,
                None,
                &[
                    "Understand before you change",
                    "Working directory: /p",
                    "Additional roots: /extra",
                    "Date: 2026-12-02 UTC",
                    "Git repository: yes",
                    " M src/lib.rs",
                    "# Project rules (AGENTS.md)",
                    "Use tabs.",
                ],
                &[],
            ),
            (
                Some("Be a pirate."),
                Some("Answer in haiku."),
                &["Be a pirate.\n\nAnswer in haiku.", "Use tabs."],
                &["Understand before you change"],
            ),
            (
                None,
                Some("  "),
                &["Understand before you change"],
                &["\n\n  \n"],
            ),
        ];
        for (replace, append, has, lacks) in table {
            let s = system_text(*replace, *append, &env());
            for h in *has {
                assert!(s.contains(h), "{h:?} missing from:\n{s}");
            }
            for l in *lacks {
                assert!(!s.contains(l), "{l:?} present in:\n{s}");
            }
        }
        let bare = Environment {
            git: None,
            rules: None,
            ..env()
        };
        let s = system_text(None, None, &bare);
        assert!(s.contains("Git repository: no"));
        assert!(!s.contains("Project rules"));
    }

    #[tokio::test]
    async fn agents_md_wins_and_a_link_or_a_fifo_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostInfo {
            cwd: dir.path().to_owned(),
            ..Default::default()
        };
        assert_eq!(Environment::gather(&host).await.rules, None);
        std::fs::write(dir.path().join("CLAUDE.md"), "claude rules").unwrap();
        let got = Environment::gather(&host).await.rules.unwrap();
        assert_eq!(got, ("CLAUDE.md".into(), "claude rules".into()));
        std::fs::write(dir.path().join("AGENTS.md"), "agents rules").unwrap();
        let got = Environment::gather(&host).await.rules.unwrap();
        assert_eq!(got, ("AGENTS.md".into(), "agents rules".into()));

        // A link to a secret outside is not followed (CLAUDE.md is then
        // the rules); a FIFO does not block the turn.
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "TOP SECRET").unwrap();
        std::fs::remove_file(dir.path().join("AGENTS.md")).unwrap();
        std::os::unix::fs::symlink(secret.path(), dir.path().join("AGENTS.md")).unwrap();
        let got = Environment::gather(&host).await.rules.unwrap();
        assert_eq!(got.0, "CLAUDE.md");
        std::fs::remove_file(dir.path().join("CLAUDE.md")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.path().join("CLAUDE.md"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert_eq!(Environment::gather(&host).await.rules, None);
    }

    #[tokio::test]
    async fn a_long_rules_file_is_cut_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("AGENTS.md"), "x".repeat(RULES_MAX * 3)).unwrap();
        let host = HostInfo {
            cwd: dir.path().to_owned(),
            ..Default::default()
        };
        let (_, text) = Environment::gather(&host).await.rules.unwrap();
        assert!(text.starts_with(&"x".repeat(RULES_MAX)));
        assert!(text.len() < RULES_MAX + 200);
        assert!(text.contains("only its first 32 KiB"));
    }

    #[tokio::test]
    async fn a_git_repository_is_described() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostInfo {
            cwd: dir.path().to_owned(),
            ..Default::default()
        };
        assert_eq!(Environment::gather(&host).await.git, None);
        let ok = std::process::Command::new("git")
            .args(["init", "-q", "-b", "trunk"])
            .current_dir(dir.path())
            .status()
            .unwrap();
        assert!(ok.success());
        std::fs::write(dir.path().join("new.txt"), "x").unwrap();
        let git = Environment::gather(&host).await.git.unwrap();
        assert!(git.contains("trunk"), "{git}");
        assert!(git.contains("?? new.txt"), "{git}");
        // From a directory below the work tree's top too.
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let below = HostInfo {
            cwd: dir.path().join("sub"),
            ..Default::default()
        };
        let git = Environment::gather(&below).await.git.unwrap();
        assert!(git.contains("?? new.txt"), "{git}");
        // A linked work tree, as `git worktree add` makes it.
        let other = tempfile::tempdir().unwrap();
        let wt = other.path().join("wt");
        let ok = std::process::Command::new("git")
            .args(["-c", "user.name=a", "-c", "user.email=a@b"])
            .args(["commit", "-q", "--allow-empty", "-m", "x"])
            .current_dir(dir.path())
            .status()
            .unwrap()
            .success()
            && std::process::Command::new("git")
                .args(["worktree", "add", "-q", "-b", "side"])
                .arg(&wt)
                .current_dir(dir.path())
                .status()
                .unwrap()
                .success();
        assert!(ok);
        std::fs::write(wt.join("there.txt"), "x").unwrap();
        let linked = HostInfo {
            cwd: wt,
            ..Default::default()
        };
        let git = Environment::gather(&linked).await.git.unwrap();
        assert!(
            git.contains("## side") && git.contains("?? there.txt"),
            "{git}"
        );
    }

    /// A hostile repository (copied from an archive, its `.git` included)
    /// names filter drivers in its config, an included file and
    /// `info/attributes`, and its file's stat data is stale, so status
    /// hashes it again: no driver runs, and the change is still shown.
    #[tokio::test]
    async fn a_hostile_repository_s_filters_never_run() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let pwned = dir.path().join("pwned");
        std::fs::create_dir(&repo).unwrap();
        let git = |args: &[&str]| {
            let ok = std::process::Command::new("git")
                .args(args)
                .current_dir(&repo)
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_CONFIG_GLOBAL", "/dev/null")
                .status()
                .unwrap();
            assert!(ok.success(), "git {args:?}");
        };
        git(&["init", "-q", "-b", "main"]);
        std::fs::write(repo.join("a.txt"), "hi\n").unwrap();
        std::fs::write(repo.join(".gitattributes"), "* filter=Ev.il=x\n").unwrap();
        git(&["add", "."]);
        git(&[
            "-c",
            "user.name=a",
            "-c",
            "user.email=a@b",
            "commit",
            "-qm",
            "x",
        ]);
        let touch = format!("touch {}; cat", pwned.display());
        for (key, value) in [
            ("filter.Ev.il=x.clean", touch.as_str()),
            ("filter.Ev.il=x.process", touch.as_str()),
            ("include.path", "more"),
        ] {
            git(&["config", key, value]);
        }
        std::fs::write(
            repo.join(".git/more"),
            format!("[filter \"two\"]\n\tclean = {touch}\n\trequired = true\n"),
        )
        .unwrap();
        std::fs::create_dir_all(repo.join(".git/info")).unwrap();
        std::fs::write(repo.join(".git/info/attributes"), "*.txt filter=two\n").unwrap();
        // Stale stat data: status reads the file again.
        std::fs::write(repo.join("a.txt"), "hi\nthere\n").unwrap();
        let host = HostInfo {
            cwd: repo.clone(),
            ..Default::default()
        };
        let status = Environment::gather(&host).await.git;
        assert!(!pwned.exists(), "a filter driver ran");
        let status = status.expect("status");
        assert!(status.contains(" M a.txt"), "{status}");
    }

    /// A hostile repository's config points its work tree elsewhere
    /// (`core.worktree`, and says it has none: `core.bare`): status
    /// describes the directory holding its `.git`, never what lies outside
    /// it.
    #[tokio::test]
    async fn a_hostile_repository_cannot_move_its_work_tree() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let private = dir.path().join("private");
        std::fs::create_dir(&repo).unwrap();
        std::fs::create_dir(&private).unwrap();
        std::fs::write(private.join("secret-plans.txt"), "x").unwrap();
        std::fs::write(repo.join("mine.txt"), "x").unwrap();
        let ok = std::process::Command::new("git")
            .args(["init", "-q", "-b", "main"])
            .current_dir(&repo)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .status()
            .unwrap();
        assert!(ok.success());
        let config = repo.join(".git/config");
        let mut text = std::fs::read_to_string(&config).unwrap();
        text.push_str(&format!(
            "[core]\n\tworktree = {}\n\tbare = true\n",
            private.display()
        ));
        std::fs::write(&config, text).unwrap();
        for cwd in [repo.clone(), repo.join("sub")] {
            std::fs::create_dir_all(&cwd).unwrap();
            let host = HostInfo {
                cwd,
                ..Default::default()
            };
            let status = Environment::gather(&host).await.git.expect("status");
            assert!(!status.contains("secret-plans"), "{status}");
            assert!(status.contains("?? mine.txt"), "{status}");
        }
    }

    /// A `.git` that is no repository (an empty directory from an archive)
    /// inside a real one: git would go on up and describe the enclosing
    /// repository (a dotfiles repository in `$HOME`), whose tracked names
    /// the model would read. It stops at the `.git` found.
    #[tokio::test]
    async fn a_broken_repository_never_shows_the_one_around_it() {
        let dir = tempfile::tempdir().unwrap();
        let outer = dir.path();
        let git = |args: &[&str]| {
            let ok = std::process::Command::new("git")
                .args(args)
                .current_dir(outer)
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_CONFIG_GLOBAL", "/dev/null")
                .status()
                .unwrap();
            assert!(ok.success(), "git {args:?}");
        };
        git(&["init", "-q", "-b", "main"]);
        std::fs::write(outer.join("tracked-private-name.txt"), "x").unwrap();
        git(&["add", "."]);
        let evil = outer.join("evil");
        std::fs::create_dir_all(evil.join(".git")).unwrap();
        std::fs::write(evil.join("x"), "x").unwrap();
        let host = HostInfo {
            cwd: evil,
            ..Default::default()
        };
        let status = Environment::gather(&host).await.git;
        assert!(
            !status.as_deref().unwrap_or("").contains("private"),
            "{status:?}"
        );
    }

    /// Status lines naming a path outside the work tree (a hand-made
    /// index may hold `../x` or `/etc/x`, which git reports as it finds
    /// them: whether they exist) are left out, counted.
    #[test]
    fn status_lines_outside_the_work_tree_are_left_out() {
        let status = "## main\n M src/a.rs\nAM ../private/exists.txt\nAD /etc/nonexistent\n\
                      R  a.rs -> ../b.rs\n?? \"../quoted\\tname\"\n?? \"q\\tok\"\n?? a..b/c..\n\
                      ?? sub/../../up\n";
        assert_eq!(
            summary(status),
            "## main\n M src/a.rs\n?? \"q\\tok\"\n?? a..b/c..\n\
             (5 paths outside the work tree left out)"
        );
        assert_eq!(summary("## main\n"), "## main\n(no changes)");
    }

    /// A `.git` file (a linked work tree, a submodule) marks a repository
    /// as a `.git` directory does; no `.git` anywhere above, none.
    #[test]
    fn a_repository_is_found_by_its_dot_git_above() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let deep = dir.path().join("a/b");
        std::fs::create_dir_all(&deep).unwrap();
        // The temporary directory is not in a repository.
        assert_eq!(repository_top(&deep), None);
        std::fs::create_dir(dir.path().join("a/.git")).unwrap();
        let top = real.join("a");
        assert_eq!(repository_top(&deep), Some(top.clone()));
        assert_eq!(repository_top(dir.path()), None);
        // A link to a directory inside the repository, from outside it.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&deep, &link).unwrap();
        assert_eq!(repository_top(&link), Some(top));
    }

    /// A `.git` file or link may name any repository on the machine (a
    /// password store's), whose tracked names status would list as
    /// deleted: believed only when that git directory names this one
    /// back, as a linked work tree's does (`gitdir`), or lies in an
    /// enclosing repository's `.git/modules` (a submodule's).
    #[test]
    fn a_dot_git_naming_another_repository_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let private = real.join("private/.git");
        std::fs::create_dir_all(&private).unwrap();
        let evil = real.join("evil");
        std::fs::create_dir(&evil).unwrap();
        for target in [private.display().to_string(), "../private/.git".into()] {
            std::fs::write(evil.join(".git"), format!("gitdir: {target}\n")).unwrap();
            assert_eq!(repository_top(&evil), None, "{target}");
        }
        std::fs::remove_file(evil.join(".git")).unwrap();
        std::os::unix::fs::symlink(&private, evil.join(".git")).unwrap();
        assert_eq!(repository_top(&evil), None, "a link");
        // A linked work tree: its git directory names it back.
        let linked = private.join("worktrees/wt");
        std::fs::create_dir_all(&linked).unwrap();
        let wt = real.join("wt");
        std::fs::create_dir(&wt).unwrap();
        std::fs::write(wt.join(".git"), format!("gitdir: {}\n", linked.display())).unwrap();
        assert_eq!(repository_top(&wt), None, "not named back yet");
        std::fs::write(
            linked.join("gitdir"),
            format!("{}\n", wt.join(".git").display()),
        )
        .unwrap();
        assert_eq!(repository_top(&wt), Some(wt.clone()));
        // A submodule: its git directory in the enclosing repository's.
        let modules = real.join("private/.git/modules/sub");
        std::fs::create_dir_all(&modules).unwrap();
        let sub = real.join("private/sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join(".git"), "gitdir: ../.git/modules/sub\n").unwrap();
        assert_eq!(repository_top(&sub), None, "the module names no work tree");
        std::fs::write(
            modules.join("config"),
            "[core]\n\tbare = false\n\tworktree = ../../../sub\n",
        )
        .unwrap();
        assert_eq!(repository_top(&sub), Some(sub.clone()));
        // Another repository's module, named from elsewhere: not this one's.
        std::fs::remove_file(evil.join(".git")).unwrap();
        std::fs::write(
            evil.join(".git"),
            format!("gitdir: {}\n", modules.display()),
        )
        .unwrap();
        let inside = real.join("private/evil");
        std::fs::create_dir(&inside).unwrap();
        std::fs::write(inside.join(".git"), "gitdir: ../.git/modules/sub\n").unwrap();
        assert_eq!(repository_top(&evil), None);
        assert_eq!(repository_top(&inside), None);
    }
}
