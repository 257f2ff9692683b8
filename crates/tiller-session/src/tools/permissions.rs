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
/// A command allows itself. It also allows later commands that start with
/// its first words and add only plain arguments (words of letters, digits
/// and `_.,+-`, not starting with `-` or `+`, without `..`) when it is one
/// of the [`PREFIXES`]: a program, or a program's subcommand, that runs
/// only the project's own code or looks at names (`cargo test` allows
/// `cargo test parser`, `uv run pytest` allows `uv run pytest tests`). Anything else (a package manager's install, a
/// network client, a task runner, a program that runs its arguments, a
/// command with an option among those first words or with shell
/// operators) allows only itself: a list of what is safe can be complete,
/// one of what is not cannot.
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

/// The commands a prefix rule may cover, by program (the first word, as
/// written) and the subcommands it may cover; none listed: the program
/// itself, whose rule keeps its first argument too (`ls src`, `echo one`).
/// Each runs only the project's own code (tests, builds: no sandbox, they
/// run whatever the project says) or looks at names and metadata. Not
/// listed, so exact only: programs that print a file's contents (a link
/// in the directory may name any file: `cat notes`), `npm test` and `npm
/// run` (npm appends extra words to the script's command line: `make`
/// then runs `make install`), `go test` (`go test all` runs the
/// dependencies' tests), `tsc` (named files are compiled next to
/// themselves), `date` (sets the clock as root), test runners with
/// subcommands (`mocha init`).
const PREFIXES: &[(&str, &[&str])] = &[
    ("ls", &[]),
    ("echo", &[]),
    ("pwd", &[]),
    ("tree", &[]),
    ("du", &[]),
    ("df", &[]),
    ("stat", &[]),
    ("file", &[]),
    ("which", &[]),
    ("pytest", &[]),
    ("jest", &[]),
    ("eslint", &[]),
    ("mypy", &[]),
    ("rspec", &[]),
    (
        "cargo",
        &[
            "build", "b", "check", "c", "test", "t", "bench", "clippy", "fmt", "doc", "tree",
            "metadata",
        ],
    ),
    ("go", &["build", "vet", "fmt", "list"]),
    ("uv", &["run"]),
    ("poetry", &["run"]),
    ("bundle", &["exec"]),
    ("ruff", &["check", "format"]),
    ("dotnet", &["build", "test"]),
    ("swift", &["build", "test"]),
    (
        "git",
        &["status", "log", "diff", "show", "add", "blame", "grep"],
    ),
];

/// Subcommands whose next word names what runs, kept in the rule: where
/// `true`, a program that must itself be one of [`PREFIXES`] with no
/// subcommands (`uv run pytest`; `uv run python` only exactly).
const RUNS: &[(&str, &str, bool)] = &[
    ("uv", "run", true),
    ("poetry", "run", true),
    ("bundle", "exec", true),
];

impl ShellRule {
    /// The rule "always allow" makes of `command`.
    pub fn of(command: &str) -> ShellRule {
        let words: Vec<&str> = command.split_whitespace().collect();
        let exact = || ShellRule::Exact(command.trim().to_owned());
        let Some(first) = words.first() else {
            return exact();
        };
        let Some((_, subs)) = PREFIXES.iter().find(|(p, _)| p == first) else {
            return exact();
        };
        if command.contains(SHELL_OPERATORS) {
            return exact();
        }
        let mut kept = words.len().min(2);
        if !subs.is_empty() {
            let Some(sub) = words.get(1).filter(|w| subs.contains(w)) else {
                return exact();
            };
            if let Some((_, _, program)) = RUNS.iter().find(|(p, s, _)| p == first && s == sub) {
                let Some(next) = words.get(2) else {
                    return exact();
                };
                let listed = PREFIXES.iter().any(|(p, s)| p == next && s.is_empty());
                if *program && !listed {
                    return exact();
                }
                kept = 3;
            }
        }
        if !words[1..kept].iter().all(|w| plain_argument(w)) {
            return exact();
        }
        ShellRule::Prefix(words[..kept].iter().map(|w| (*w).to_owned()).collect())
    }

    /// Whether the rule allows `command`.
    pub fn allows(&self, command: &str) -> bool {
        match self {
            ShellRule::Exact(c) => c == command.trim(),
            ShellRule::Prefix(p) => {
                let words: Vec<&str> = command.split_whitespace().collect();
                !command.contains(SHELL_OPERATORS)
                    && words.len() >= p.len()
                    && words[..p.len()].iter().eq(p.iter())
                    && words[p.len()..].iter().all(|w| plain_argument(w))
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
        && !word.starts_with(['-', '+'])
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
