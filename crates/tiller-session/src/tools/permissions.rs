//! Who decides a call: the permission mode, the calls allowed "always",
//! shell rules, and the options a person is offered.

use super::*;

/// Which calls ask a person first (`[tools] permission_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PermissionMode {
    /// Edits and commands ask.
    #[default]
    Ask,
    /// Edits run; commands ask.
    AcceptEdits,
    /// Nothing asks.
    AllowAll,
}

impl PermissionMode {
    /// The config and wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            PermissionMode::Ask => "ask",
            PermissionMode::AcceptEdits => "accept-edits",
            PermissionMode::AllowAll => "allow-all",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ask" => PermissionMode::Ask,
            "accept-edits" => PermissionMode::AcceptEdits,
            "allow-all" => PermissionMode::AllowAll,
            _ => return None,
        })
    }
}

/// A session's permission state: the mode and what the user allowed
/// "always".
#[derive(Clone, Debug, Default)]
pub struct Permissions {
    pub mode: PermissionMode,
    /// What the user allowed for the rest of the session: tool names, and
    /// for `shell` one rule per command (see [`ShellRule`]), stored as
    /// [`ShellRule::key`].
    always: HashSet<String>,
}

/// What "always allow" on a `shell` call allows: never the tool as a whole.
/// A plain command (no shell operators) allows itself, and the later plain
/// commands that start with its first two words and add only plain
/// arguments: words of letters, digits and `_.,+-`, not starting with `-`
/// and without `..` (`npm test` allows `npm test unit`, not `npm test
/// --config /tmp/x`, `rm -rf build` allows `rm -rf dist`, not `rm -rf
/// /home`). An option or a path could make the same program do anything.
/// A command with operators (`;`, `|`, `&`, `$(`, redirections...) allows
/// only itself, since a prefix of it says nothing of what follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShellRule {
    /// The first words of a plain command.
    Prefix(Vec<String>),
    /// One exact command line.
    Exact(String),
}

/// Characters that make a command more than one plain program call.
const SHELL_OPERATORS: &[char] = &[
    ';', '&', '|', '<', '>', '$', '`', '(', ')', '{', '}', '\n', '\r', '\\', '"', '\'', '*', '?',
    '[', ']', '~', '#', '!',
];

/// Programs that run whatever their arguments say: a prefix of them would
/// allow anything (`bash -c ls` must not allow `bash -c rm`), so "always"
/// on them allows that exact command only. A first word with `=` (an
/// environment assignment) likewise.
/// Matched by name, any version suffix dropped (`python3.12`, `pypy3`).
const WRAPPERS: &[&str] = &[
    "sh",
    "bash",
    "zsh",
    "dash",
    "ksh",
    "fish",
    "env",
    "sudo",
    "doas",
    "su",
    "xargs",
    "nohup",
    "timeout",
    "nice",
    "exec",
    "eval",
    "command",
    "builtin",
    "setsid",
    "strace",
    "time",
    "watch",
    "python",
    "node",
    "nodejs",
    "perl",
    "ruby",
    "php",
    "lua",
    "luajit",
    "deno",
    "bun",
    "npx",
    "uvx",
    "pypy",
    "tsx",
    "ts-node",
    "java",
    "busybox",
    "flock",
    "stdbuf",
    "ionice",
    "chroot",
    "unshare",
    "nsenter",
    "taskset",
    "chrt",
    "script",
    "parallel",
    "systemd-run",
    "at",
    "batch",
    "tmux",
    "screen",
    "ssh",
    "osascript",
    "pwsh",
    "pnpx",
    "bunx",
    "xvfb-run",
    "valgrind",
    "gdb",
    "ltrace",
    "docker",
    "podman",
    "nerdctl",
    "kubectl",
    "dbus-run-session",
];

/// Words after which the next one names what runs (`uv run pytest`,
/// `bundle exec rspec`, `uv tool run ruff`): a rule keeps that one too,
/// so it covers that program, never another.
const RUNNERS: &[&str] = &[
    "run",
    "rum",
    "urn",
    "exec",
    "x",
    "dlx",
    "run-script",
    "tool",
    "tools",
    "script",
    "start",
    "foreach",
];

/// Words that install, create or fetch what then runs (a package's
/// scripts, a generator, a module): never covered after a rule's prefix.
const INSTALLS: &[&str] = &[
    "install", "i", "add", "create", "init", "download", "get", "sync", "update", "upgrade",
];

/// Package managers, with the subcommands a rule may cover: those that
/// run the project's own scripts or only read. Any other subcommand
/// (`install`, `create`, `dlx`, one of npm's many aliases or
/// abbreviations of them) is allowed only exactly.
const PACKAGE_MANAGERS: &[(&str, &[&str])] = &[
    (
        "npm",
        &[
            "test",
            "t",
            "tst",
            "run",
            "run-script",
            "start",
            "ls",
            "list",
            "outdated",
            "view",
            "why",
            "explain",
        ],
    ),
    (
        "pnpm",
        &["test", "t", "run", "start", "ls", "list", "outdated", "why"],
    ),
    ("yarn", &["test", "run", "start", "list", "outdated", "why"]),
    (
        "cargo",
        &[
            "build", "b", "check", "c", "test", "t", "bench", "clippy", "fmt", "doc", "d", "run",
            "r", "tree", "metadata",
        ],
    ),
    (
        "go",
        &["build", "test", "vet", "fmt", "list", "version", "run"],
    ),
    ("pip", &["list", "show", "freeze", "check"]),
    ("uv", &["run", "lock", "tree"]),
    ("poetry", &["run", "show", "check", "build"]),
    ("gem", &["list"]),
];

/// Words whose commands change settings that can name commands to run
/// (`git config core.hooksPath`, `npm config set registry`): as a
/// subcommand, "always" allows that exact command only; later, never
/// covered.
const SETTINGS: &[&str] = &["config", "alias", "set"];

/// `word`'s program name without its directory and version suffix
/// (`/usr/bin/python3.12` is `python`).
fn program(word: &str) -> &str {
    word.rsplit('/')
        .next()
        .unwrap_or(word)
        .trim_end_matches(|c: char| c.is_ascii_digit() || c == '.')
}

impl ShellRule {
    /// How many leading words a prefix rule keeps.
    const WORDS: usize = 2;

    /// The rule "always allow" makes of `command`.
    pub fn of(command: &str) -> ShellRule {
        let words: Vec<&str> = command.split_whitespace().collect();
        let exact = || ShellRule::Exact(command.trim().to_owned());
        let Some(first) = words.first() else {
            return exact();
        };
        let wrapper = WRAPPERS.contains(&program(first)) || first.contains('=');
        let settings = words.get(1).is_some_and(|w| SETTINGS.contains(w));
        let unsafe_subcommand = PACKAGE_MANAGERS
            .iter()
            .find(|(pm, _)| *pm == program(first))
            .is_some_and(|(_, safe)| words.get(1).is_some_and(|w| !safe.contains(w)));
        if wrapper || settings || unsafe_subcommand || command.contains(SHELL_OPERATORS) {
            return exact();
        }
        // Two words, and while the last kept is a runner, the next.
        let mut kept = words.len().min(Self::WORDS);
        while kept >= Self::WORDS && RUNNERS.contains(&words[kept - 1]) {
            if kept == words.len() {
                // Nothing named after the runner: the rule would cover
                // whatever a later command names there.
                return exact();
            }
            kept += 1;
        }
        let kept = &words[..kept];
        // An option or a setting among them (`kubectl -n prod get`, `git
        // -C dir`, `uv run -m`) changes what the words after it mean; a
        // program a runner runs may run anything itself (`uv run python`).
        let ran = (kept.len() > Self::WORDS).then(|| kept[kept.len() - 1]);
        if kept.iter().any(|w| w.starts_with('-') || w.contains('='))
            || ran.is_some_and(|w| WRAPPERS.contains(&program(w)))
        {
            return exact();
        }
        ShellRule::Prefix(kept.iter().map(|w| (*w).to_owned()).collect())
    }

    /// Whether the rule allows `command`.
    pub fn allows(&self, command: &str) -> bool {
        match self {
            ShellRule::Exact(c) => c == command.trim(),
            ShellRule::Prefix(p) => {
                let words: Vec<&str> = command.split_whitespace().collect();
                // After the prefix, plain arguments only, none of which
                // runs another program or changes a setting
                // (`docker compose` then `run web sh`).
                !command.contains(SHELL_OPERATORS)
                    && words.len() >= p.len()
                    && words[..p.len()].iter().eq(p.iter())
                    && words[p.len()..].iter().all(|w| {
                        plain_argument(w)
                            && ![RUNNERS, INSTALLS, SETTINGS].iter().any(|l| l.contains(w))
                            && !WRAPPERS.contains(&program(w))
                    })
            }
        }
    }

    /// Its stored form.
    pub fn key(&self) -> String {
        match self {
            ShellRule::Prefix(p) => format!("shell:{}", p.join(" ")),
            ShellRule::Exact(c) => format!("shell={c}"),
        }
    }

    fn parse(key: &str) -> Option<ShellRule> {
        if let Some(p) = key.strip_prefix("shell:") {
            return Some(ShellRule::Prefix(
                p.split_whitespace().map(str::to_owned).collect(),
            ));
        }
        key.strip_prefix("shell=")
            .map(|c| ShellRule::Exact(c.to_owned()))
    }

    /// What the "always" option says it allows.
    pub fn describe(&self) -> String {
        match self {
            ShellRule::Prefix(p) => format!(
                "Always allow `{} …` (plain arguments, no options or paths)",
                p.join(" ")
            ),
            ShellRule::Exact(c) => {
                let short: String = c.chars().take(60).collect();
                let more = if c.chars().count() > 60 { "…" } else { "" };
                format!("Always allow exactly `{short}{more}`")
            }
        }
    }
}

/// Whether a stored key is one this version would still make: a prefix
/// rule an older version made that is wider than today's rule for the
/// same command (`uv run`, `git config`) is not restored.
fn still_made(key: &str) -> bool {
    match ShellRule::parse(key) {
        Some(ShellRule::Prefix(p)) => ShellRule::of(&p.join(" ")) == ShellRule::Prefix(p),
        _ => true,
    }
}

/// The stored form of "always" for a tool other than `shell`: its name,
/// unless that reads like a shell rule's key (a hosted agent's tool is
/// named by its title: `shell: rm` must not become a rule), then marked
/// as a tool's.
fn tool_key(name: &str) -> String {
    if name.starts_with("shell") || name.starts_with("tool:") {
        format!("tool:{name}")
    } else {
        name.to_owned()
    }
}

/// An argument a prefix rule lets through: a name, not an option or a path.
pub(super) fn plain_argument(word: &str) -> bool {
    word.chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.,+-".contains(c))
        && !word.starts_with('-')
        && !word.contains("..")
}

/// The command line of a `shell` call that an "always" rule may cover:
/// one run in the session's directory. Given another directory (`cwd`),
/// the same command line may run that directory's scripts (`npm test`
/// reads the `package.json` it finds there), so no rule covers it.
pub(super) fn shell_command(call: &ToolCall) -> Option<&str> {
    if call.name != "shell" {
        return None;
    }
    let elsewhere = match call.input.get("cwd") {
        None | Some(serde_json::Value::Null) => false,
        // `""`, `.`, `./`: the session's directory.
        Some(serde_json::Value::String(d)) => std::path::Path::new(d)
            .components()
            .any(|c| c != std::path::Component::CurDir),
        Some(_) => true,
    };
    if elsewhere {
        return None;
    }
    call.input
        .get("command")
        .and_then(serde_json::Value::as_str)
}

impl Permissions {
    pub fn new(mode: PermissionMode) -> Self {
        Self {
            mode,
            always: HashSet::new(),
        }
    }

    /// What was allowed for the rest of the session, restored from the
    /// store. A bare `shell` (stored by an older version, allowing every
    /// command) is not restored.
    pub fn with_always(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.always
            .extend(names.into_iter().filter(|n| n != "shell" && still_made(n)));
        self
    }

    /// What is allowed "always", sorted.
    pub fn always(&self) -> Vec<String> {
        let mut v: Vec<String> = self.always.iter().cloned().collect();
        v.sort();
        v
    }

    /// Remembers "always allow" for `call`.
    pub(crate) fn allow_always(&mut self, call: &ToolCall) {
        if call.name == "shell" {
            // No command line: nothing to remember but this one call.
            if let Some(c) = shell_command(call) {
                // The command itself, and the prefix rule it makes.
                self.always
                    .insert(ShellRule::Exact(c.trim().to_owned()).key());
                self.always.insert(ShellRule::of(c).key());
            }
        } else {
            self.always.insert(tool_key(&call.name));
        }
    }

    fn allowed_always(&self, call: &ToolCall) -> bool {
        if call.name != "shell" {
            return self.always.contains(&tool_key(&call.name));
        }
        let Some(command) = shell_command(call) else {
            return false;
        };
        self.always
            .iter()
            .filter_map(|k| ShellRule::parse(k))
            .any(|r| r.allows(command))
    }

    pub(crate) fn needs(&self, call: &ToolCall) -> bool {
        if self.allowed_always(call) {
            return false;
        }
        match (self.mode, call.kind) {
            (PermissionMode::AllowAll, _) => false,
            (PermissionMode::Ask, ToolKind::Edit | ToolKind::Execute) => true,
            (PermissionMode::AcceptEdits, ToolKind::Execute) => true,
            _ => false,
        }
    }
}

/// Whether "always" can cover more than this one call: not for a `shell`
/// call without a command line (no prefix to remember).
pub fn may_always(call: &ToolCall) -> bool {
    call.name != "shell" || shell_command(call).is_some()
}

/// The options a permission request for `call` offers. For `shell`, the
/// "always" option names the commands it covers (none without a command
/// line).
pub fn options(call: &ToolCall) -> Vec<PermissionOption> {
    let always = shell_command(call).map_or_else(
        || "Always allow".to_owned(),
        |c| ShellRule::of(c).describe(),
    );
    [
        ("allow_once", "Allow".to_owned(), "allow_once"),
        ("allow_always", always, "allow_always"),
        ("reject_once", "Deny".to_owned(), "reject_once"),
    ]
    .into_iter()
    .filter(|(id, ..)| *id != "allow_always" || may_always(call))
    .map(|(id, name, kind)| PermissionOption {
        option_id: id.into(),
        name,
        kind: kind.into(),
    })
    .collect()
}
