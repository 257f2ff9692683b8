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

use super::repo::{Found, Repository};
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

/// Most output read from one `git` run.
const GIT_OUTPUT: usize = 1024 * 1024;

/// Most memory one `git` run may take (`RLIMIT_DATA`).
const GIT_MEMORY: u64 = 512 * 1024 * 1024;

/// Given to git with the overrides and looked for in what it lists: a git
/// before 2.31 ignores `GIT_CONFIG_COUNT`, and with it every override
/// that keeps the repository's commands from running.
const PROBE: &str = "tiller.overrides";

/// Most filter drivers a repository's config may name (each is emptied).
const MAX_FILTERS: usize = 256;

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
            // One deadline for looking and for git: a hostile directory
            // could be slow to look at.
            let deadline = tokio::time::Instant::now() + GIT_TIMEOUT;
            let look =
                tokio::task::spawn_blocking(move || (read_rules(&dir), super::repo::find(&dir)));
            let (rules, found) = match tokio::time::timeout_at(deadline, look).await {
                Ok(Ok(found)) => found,
                Ok(Err(_)) => (None, Found::Nothing),
                Err(_) => (None, Found::Unshown("looking at it took too long")),
            };
            let git = match found {
                Found::Repository(repo) => Some(git_status(&cwd, &repo, deadline).await),
                Found::Unshown(why) => Some(format!("(status not shown: {why})")),
                Found::Nothing => None,
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
    let (file, meta) = super::repo::open_regular(path)?;
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

/// `git` in `dir`, told its git directory and work tree (`repo`: found
/// and checked, so git finds nothing by itself: not a repository around a
/// broken `.git`, nor a work tree a hostile config's `core.worktree` names,
/// whose file names status would list): its environment cleared, no
/// system or global config, no fetching, its output read by `deadline`,
/// [`GIT_OUTPUT`] at most, its memory [`GIT_MEMORY`] at most; `None` when
/// it is missing, slow, too long or fails.
async fn git(
    dir: &Path,
    repo: &Repository,
    deadline: tokio::time::Instant,
    overrides: &[(String, &str)],
    args: &[&str],
) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt as _;
    let mut cmd = tokio::process::Command::new(git_program()?);
    cmd.args(args)
        .current_dir(dir)
        .env_clear()
        .env("GIT_DIR", &repo.git_dir)
        .env("GIT_WORK_TREE", &repo.top)
        .env("GIT_ATTR_NOSYSTEM", "1")
        .env("PATH", GIT_PATH)
        .env("LC_ALL", "C")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_TERMINAL_PROMPT", "0")
        // A partial clone's missing object is fetched from the remote its
        // config names, through commands its config names: never.
        .env("GIT_NO_LAZY_FETCH", "1")
        .env("GIT_ALLOW_PROTOCOL", "")
        // Given as the command line's `-c` would be, above the repository's
        // own config, but each key whole: a name may hold `=`.
        .env("GIT_CONFIG_COUNT", overrides.len().to_string());
    for (i, (key, value)) in overrides.iter().enumerate() {
        cmd.env(format!("GIT_CONFIG_KEY_{i}"), key)
            .env(format!("GIT_CONFIG_VALUE_{i}"), value);
    }
    if let Some(common) = &repo.common {
        cmd.env("GIT_COMMON_DIR", common);
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().ok()?;
    // Its own memory bounded too: a config may include a file of
    // gigabytes (a sparse one, nothing in an archive). Set just after it
    // starts, which keeps `posix_spawn`; never above the daemon's own.
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{Pid, Resource, Rlimit, getrlimit, prlimit};
        let pid = child
            .id()
            .and_then(|p| Pid::from_raw(i32::try_from(p).ok()?))?;
        let own = getrlimit(Resource::Data);
        let most = |l: Option<u64>| Some(l.map_or(GIT_MEMORY, |l| l.min(GIT_MEMORY)));
        let limit = Rlimit {
            current: most(own.current),
            maximum: most(own.maximum),
        };
        prlimit(Some(pid), Resource::Data, limit).ok()?;
    }
    let mut stdout = child.stdout.take()?;
    let run = async move {
        let mut out = Vec::new();
        (&mut stdout)
            .take(GIT_OUTPUT as u64 + 1)
            .read_to_end(&mut out)
            .await
            .ok()?;
        // Past the bound it is killed (dropped), its output not used.
        if out.len() > GIT_OUTPUT {
            return None;
        }
        child.wait().await.ok()?.success().then_some(out)
    };
    tokio::time::timeout_at(deadline, run).await.ok()?
}

/// What neutralizes every filter driver the repository's config (with
/// what it includes) names: status hashes a file whose stat data is stale
/// through its driver, which is a command from a hostile document. `None`
/// when the config cannot be read.
async fn without_filters(
    dir: &Path,
    repo: &Repository,
    deadline: tokio::time::Instant,
) -> Option<Vec<(String, &'static str)>> {
    let probe = [(PROBE.to_owned(), "1")];
    let list = ["config", "-z", "--list", "--show-scope"];
    let out = git(dir, repo, deadline, &probe, &list).await?;
    // A git that ignored the probe ignores every override too. Looked for
    // as given on the command line (the repository's own config could set
    // the same key, but as `local`); a git before 2.26 knows no scopes and
    // fails.
    let fields: Vec<&[u8]> = out.split(|b| *b == 0).collect();
    if !overrides_applied(&fields) {
        return None;
    }
    let mut names: Vec<&[u8]> = fields
        .iter()
        .filter_map(|entry| {
            let key = entry.split(|b| *b == b'\n').next()?;
            let key = key.strip_prefix(b"filter.")?;
            let dot = key.iter().rposition(|b| *b == b'.')?;
            Some(&key[..dot])
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    // Each takes four overrides in git's environment: a config naming
    // tens of thousands would only make it fail to start.
    if names.len() > MAX_FILTERS {
        return None;
    }
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

/// Whether `config -z --list --show-scope` (`scope`, `key\nvalue`, ...)
/// lists the probe as given on the command line.
fn overrides_applied(fields: &[&[u8]]) -> bool {
    let listed = format!("{PROBE}\n1");
    fields
        .windows(2)
        .any(|w| w[0] == b"command" && w[1] == listed.as_bytes())
}

/// `git status --branch --porcelain` of `dir`, bounded, or why it is not
/// shown (git missing, slow, too long or refusing: [`UNREAD`]). The repository
/// is a hostile document: its filter drivers are emptied, its fsmonitor
/// off, its submodules (each with a config of its own) not entered, and
/// no index is written (so no hook runs).
async fn git_status(dir: &Path, repo: &Repository, deadline: tokio::time::Instant) -> String {
    let Some(mut overrides) = without_filters(dir, repo, deadline).await else {
        return UNREAD.into();
    };
    overrides.push(("core.fsmonitor".into(), "false"));
    // Files elsewhere it would read as patterns: none.
    overrides.push(("core.excludesFile".into(), "/dev/null"));
    overrides.push(("core.attributesFile".into(), "/dev/null"));
    overrides.push(("core.untrackedCache".into(), "false"));
    let Some(out) = git(
        dir,
        repo,
        deadline,
        &overrides,
        &[
            "--no-optional-locks",
            "status",
            "--branch",
            "--porcelain=v1",
            "-z",
            "--ignore-submodules=all",
        ],
    )
    .await
    else {
        return UNREAD.into();
    };
    summary(&String::from_utf8_lossy(&out))
}

/// What the model is told when git could not give the status: it failed,
/// took too long or said too much.
const UNREAD: &str = "(status not shown: git could not give it in time and size)";

/// What the model is shown of `git status --branch --porcelain=v1 -z`:
/// its first entries, each cut, control characters escaped. Git never
/// writes a path outside the work tree for an index it made, but reads an
/// index as it finds it: a hand-made one may hold `../x` or `/etc/x`, and
/// status would tell whether each exists (or, hashing it, whether its
/// content is one guessed): then no entry is shown at all.
fn summary(status: &str) -> String {
    let mut fields = status.split('\0');
    let head = fields.next().unwrap_or_default();
    let mut entries = Vec::new();
    while let Some(entry) = fields.next() {
        let Some((xy, path)) = entry.split_at_checked(3) else {
            continue;
        };
        let xy = xy.get(..2).unwrap_or(xy);
        // A rename or copy: the path it came from follows.
        let from = xy.contains(['R', 'C']).then(|| fields.next()).flatten();
        if outside_the_tree(path) || from.is_some_and(outside_the_tree) {
            return format!(
                "{}\n(changes not shown: the index names paths outside the work tree)",
                shown(head)
            );
        }
        entries.push(match from {
            Some(from) => format!("{xy} {} -> {}", shown(from), shown(path)),
            None => format!("{xy} {}", shown(path)),
        });
    }
    let mut summary: Vec<String> = std::iter::once(shown(head))
        .chain(entries.iter().take(GIT_LINES).cloned())
        .collect();
    let more = entries.len().saturating_sub(GIT_LINES);
    if more > 0 {
        summary.push(format!("... and {more} more changed paths"));
    }
    if summary.len() == 1 {
        summary.push("(no changes)".into());
    }
    summary.join("\n")
}

/// `text` cut to 300 characters, its control characters escaped.
fn shown(text: &str) -> String {
    text.chars()
        .take(300)
        .flat_map(|c| {
            let escaped = c.is_control().then(|| c.escape_default());
            escaped
                .into_iter()
                .flatten()
                .chain((!c.is_control()).then_some(c))
        })
        .collect()
}

/// Whether a path as status writes it is absolute or climbs out with `..`.
fn outside_the_tree(path: &str) -> bool {
    path.starts_with('/') || path.split('/').any(|part| part == "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs git in `dir`, away from the machine's and the user's config;
    /// fails the test unless it succeeds; its output.
    fn git_in(dir: &Path, args: &[&str]) -> String {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

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
        git_in(dir.path(), &["init", "-q", "-b", "trunk"]);
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
        let commit = ["-c", "user.name=a", "-c", "user.email=a@b", "commit"];
        git_in(
            dir.path(),
            &[&commit[..], &["-q", "--allow-empty", "-m", "x"]].concat(),
        );
        git_in(
            dir.path(),
            &["worktree", "add", "-q", "-b", "side", wt.to_str().unwrap()],
        );
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
        let git = |args: &[&str]| git_in(&repo, args);
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
        git_in(&repo, &["init", "-q", "-b", "main"]);
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
        let git = |args: &[&str]| git_in(outer, args);
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

    /// A repository whose index is another's (a link from an archive):
    /// git would list that repository's tracked names as deleted; its
    /// status is not shown, and the model is told why.
    #[tokio::test]
    async fn a_repository_borrowing_another_s_index_shows_none_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("private");
        let evil = dir.path().join("evil");
        for d in [&private, &evil] {
            std::fs::create_dir(d).unwrap();
            git_in(d, &["init", "-q", "-b", "main"]);
        }
        std::fs::write(private.join("tracked-private-name.txt"), "x").unwrap();
        git_in(&private, &["add", "."]);
        std::os::unix::fs::symlink(private.join(".git/index"), evil.join(".git/index")).unwrap();
        let host = HostInfo {
            cwd: evil,
            ..Default::default()
        };
        let status = Environment::gather(&host).await.git.expect("a repository");
        assert!(!status.contains("private"), "{status}");
        assert!(status.contains("status not shown"), "{status}");
    }

    /// A partial clone missing an object would fetch it from the remote
    /// its config names, running the command its config names: never.
    #[tokio::test]
    async fn a_hostile_partial_clone_fetches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let pwned = dir.path().join("pwned");
        std::fs::create_dir(&repo).unwrap();
        let git = |args: &[&str]| git_in(&repo, args);
        git(&["init", "-q", "-b", "main"]);
        std::fs::write(repo.join("a.txt"), "hi\n").unwrap();
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
        let tree = git(&["rev-parse", "HEAD^{tree}"]);
        let tree = tree.trim();
        std::fs::remove_file(repo.join(".git/objects").join(&tree[..2]).join(&tree[2..])).unwrap();
        let fetch = format!("touch {}; false", pwned.display());
        let url = repo.display().to_string();
        for (key, value) in [
            ("core.repositoryformatversion", "1"),
            ("extensions.partialClone", "origin"),
            ("remote.origin.promisor", "true"),
            ("remote.origin.url", url.as_str()),
            ("remote.origin.uploadpack", fetch.as_str()),
        ] {
            git(&["config", key, value]);
        }
        let host = HostInfo {
            cwd: repo.clone(),
            ..Default::default()
        };
        let status = Environment::gather(&host).await.git;
        assert!(
            !pwned.exists(),
            "a fetch ran the config's command: {status:?}"
        );
    }

    /// A git that ignores `GIT_CONFIG_COUNT` lists only the repository's
    /// config, which may set the probe's key itself: only the command
    /// line's scope counts.
    #[test]
    fn the_overrides_probe_counts_only_as_given_on_the_command_line() {
        let probe = format!("{PROBE}\n1");
        let listed = |scope: &str| {
            let entries = ["local", "core.bare\nfalse", scope, probe.as_str()];
            overrides_applied(&entries.map(str::as_bytes))
        };
        assert!(listed("command"));
        assert!(!listed("local"));
        assert!(!overrides_applied(&[b"tiller.overrides\n1"]));
    }

    /// Status entries as git writes them with `-z`: renames shown from
    /// and to, control characters escaped; an index naming a path outside
    /// the work tree (a hand-made one may hold `../x` or `/etc/x`, which git
    /// reports as it finds them: whether they exist) shows no entry at all.
    #[test]
    fn status_is_shown_unless_the_index_names_paths_outside_the_work_tree() {
        let status = "## main\0 M src/a.rs\0R  new.rs\0old.rs\0?? q\tok\0?? a..b/c..\0?? x -> y\0";
        assert_eq!(
            summary(status),
            "## main\n M src/a.rs\nR  old.rs -> new.rs\n?? q\\tok\n?? a..b/c..\n?? x -> y"
        );
        assert_eq!(summary("## main\0"), "## main\n(no changes)");
        for outside in [
            "AM ../private/exists.txt\0",
            "AD /etc/nonexistent\0",
            "R  inside.rs\0../b.rs\0",
            "?? sub/../../up\0",
        ] {
            assert_eq!(
                summary(&format!("## main\0 M src/a.rs\0{outside}")),
                "## main\n(changes not shown: the index names paths outside the work tree)",
                "{outside}"
            );
        }
    }
}
