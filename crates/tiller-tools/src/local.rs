//! The built-in tools. Paths are confined to the session's directory:
//! `..` and symlinks cannot lead out of it.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tiller_engine::{ToolCall, ToolKind, ToolOutput, ToolSpec};

use crate::{ClientTools, CommandOutput, ToolsConfig};

/// Most entries `glob` and `list_dir` return, and matches `grep` returns.
const MAX_RESULTS: usize = 1000;

/// Directories never searched.
const SKIP_DIRS: &[&str] = &[".git", "node_modules", "target"];

/// The built-in tools, as offered to models.
pub fn builtin_specs() -> Vec<ToolSpec> {
    let spec = |name: &str, kind, description: &str, schema: Value| ToolSpec {
        name: name.into(),
        description: description.into(),
        input_schema: schema,
        kind,
    };
    vec![
        spec(
            "read_file",
            ToolKind::Read,
            "Read a text file in the working directory. Optional `offset` (1-based first line) and `limit` (number of lines).",
            json!({"type": "object", "properties": {
                "path": {"type": "string", "description": "Path relative to the working directory (or absolute inside it)"},
                "offset": {"type": "integer", "minimum": 1},
                "limit": {"type": "integer", "minimum": 1}
            }, "required": ["path"]}),
        ),
        spec(
            "write_file",
            ToolKind::Edit,
            "Create or overwrite a text file (parent directories are created).",
            json!({"type": "object", "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"}
            }, "required": ["path", "content"]}),
        ),
        spec(
            "edit",
            ToolKind::Edit,
            "Replace an exact string in a file. `old_string` must occur exactly once unless `replace_all` is true.",
            json!({"type": "object", "properties": {
                "path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
                "replace_all": {"type": "boolean"}
            }, "required": ["path", "old_string", "new_string"]}),
        ),
        spec(
            "list_dir",
            ToolKind::Read,
            "List a directory (directories end with `/`).",
            json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        ),
        spec(
            "glob",
            ToolKind::Read,
            "Find files whose path (relative to `path`, default the working directory) matches a glob such as `**/*.rs`.",
            json!({"type": "object", "properties": {
                "pattern": {"type": "string"},
                "path": {"type": "string"}
            }, "required": ["pattern"]}),
        ),
        spec(
            "grep",
            ToolKind::Read,
            "Search file contents with a regular expression; prints `file:line: text`. Optional `path` and file `glob` filter.",
            json!({"type": "object", "properties": {
                "pattern": {"type": "string"},
                "path": {"type": "string"},
                "glob": {"type": "string"}
            }, "required": ["pattern"]}),
        ),
        spec(
            "shell",
            ToolKind::Execute,
            "Run a shell command (`sh -c`) in the working directory; returns its output and exit code.",
            json!({"type": "object", "properties": {
                "command": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1}
            }, "required": ["command"]}),
        ),
    ]
}

/// Resolves `path` inside `root`. Relative paths are taken from `root`;
/// the result must stay inside it, also after following symlinks of the
/// parts that exist.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, String> {
    if path.is_empty() {
        return Err("the path is empty".into());
    }
    let root = root
        .canonicalize()
        .map_err(|e| format!("the working directory {} is unusable: {e}", root.display()))?;
    let joined = root.join(path);
    // Lexical normalization first, so `..` cannot climb out.
    let mut norm = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                norm.pop();
            }
            Component::CurDir => {}
            other => norm.push(other.as_os_str()),
        }
    }
    // Then the deepest existing ancestor, with symlinks followed.
    let mut existing = norm.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        rest.push(existing.file_name().map(PathBuf::from).unwrap_or_default());
        existing = existing.parent().unwrap_or(Path::new("/"));
    }
    let mut real = existing
        .canonicalize()
        .map_err(|e| format!("cannot resolve {path}: {e}"))?;
    for r in rest.into_iter().rev() {
        real.push(r);
    }
    if !real.starts_with(&root) {
        return Err(format!(
            "{path} is outside the session's directory {}",
            root.display()
        ));
    }
    Ok(real)
}

fn ok(output: impl Into<String>) -> ToolOutput {
    ToolOutput {
        ok: true,
        output: output.into(),
    }
}

fn fail(output: impl Into<String>) -> ToolOutput {
    ToolOutput {
        ok: false,
        output: output.into(),
    }
}

fn str_arg<'a>(input: &'a Value, key: &str) -> Result<&'a str, String> {
    input
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("missing string argument `{key}`"))
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        let total = s.len();
        s.truncate(cut);
        s.push_str(&format!(
            "\n[output truncated: {total} bytes, showing the first {cut}]"
        ));
    }
    s
}

/// Runs a built-in tool.
pub(crate) async fn run(
    root: &Path,
    cfg: &ToolsConfig,
    call: &ToolCall,
    client: Option<Arc<dyn ClientTools>>,
) -> ToolOutput {
    if !call.input.is_object() {
        return fail(format!(
            "the arguments of `{}` must be a JSON object; got: {}",
            call.name,
            truncate(call.input.to_string(), 200)
        ));
    }
    let r = match call.name.as_str() {
        "read_file" => read_file(root, cfg, &call.input, client).await,
        "write_file" => write_file(root, &call.input, client).await,
        "edit" => edit(root, &call.input, client).await,
        "list_dir" => list_dir(root, &call.input).await,
        "glob" => glob(root, &call.input).await,
        "grep" => grep(root, cfg, &call.input).await,
        "shell" => shell(root, cfg, &call.input, client).await,
        other => Err(format!("unknown tool `{other}`")),
    };
    match r {
        Ok(out) => ok(truncate(out, cfg.max_output_bytes)),
        Err(e) => fail(e),
    }
}

async fn read_text(path: &Path, client: &Option<Arc<dyn ClientTools>>) -> Result<String, String> {
    match client {
        Some(c) if c.can_read() => c.read_text_file(path.to_owned()).await,
        _ => tokio::fs::read_to_string(path)
            .await
            .map_err(|e| format!("cannot read {}: {e}", path.display())),
    }
}

async fn write_text(
    path: &Path,
    content: String,
    client: &Option<Arc<dyn ClientTools>>,
) -> Result<(), String> {
    match client {
        Some(c) if c.can_write() => c.write_text_file(path.to_owned(), content).await,
        _ => {
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
            }
            tokio::fs::write(path, content)
                .await
                .map_err(|e| format!("cannot write {}: {e}", path.display()))
        }
    }
}

async fn read_file(
    root: &Path,
    cfg: &ToolsConfig,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = resolve(root, str_arg(input, "path")?)?;
    let text = read_text(&path, &client).await?;
    let offset = input
        .get("offset")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let limit = input
        .get("limit")
        .and_then(Value::as_u64)
        .map(|l| l as usize);
    if offset == 1 && limit.is_none() {
        return Ok(truncate(text, cfg.max_output_bytes));
    }
    let lines: Vec<&str> = text
        .lines()
        .skip(offset - 1)
        .take(limit.unwrap_or(usize::MAX))
        .collect();
    Ok(lines.join("\n"))
}

async fn write_file(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = resolve(root, str_arg(input, "path")?)?;
    let content = str_arg(input, "content")?.to_owned();
    let n = content.len();
    write_text(&path, content, &client).await?;
    Ok(format!("wrote {n} bytes to {}", path.display()))
}

async fn edit(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = resolve(root, str_arg(input, "path")?)?;
    let old = str_arg(input, "old_string")?;
    let new = str_arg(input, "new_string")?;
    let all = input
        .get("replace_all")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if old.is_empty() {
        return Err("`old_string` is empty; use write_file to create a file".into());
    }
    let text = read_text(&path, &client).await?;
    let count = text.matches(old).count();
    let updated = match (count, all) {
        (0, _) => return Err(format!("`old_string` was not found in {}", path.display())),
        (1, _) | (_, true) => text.replace(old, new),
        (n, false) => {
            return Err(format!(
                "`old_string` occurs {n} times in {}; add context to make it unique or set replace_all",
                path.display()
            ));
        }
    };
    write_text(&path, updated, &client).await?;
    Ok(format!(
        "replaced {count} occurrence{} in {}",
        if count == 1 { "" } else { "s" },
        path.display()
    ))
}

async fn list_dir(root: &Path, input: &Value) -> Result<String, String> {
    let path = resolve(
        root,
        input.get("path").and_then(Value::as_str).unwrap_or("."),
    )?;
    let mut rd = tokio::fs::read_dir(&path)
        .await
        .map_err(|e| format!("cannot list {}: {e}", path.display()))?;
    let mut names = Vec::new();
    while let Some(e) = rd.next_entry().await.map_err(|e| e.to_string())? {
        let mut name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().await.is_ok_and(|t| t.is_dir()) {
            name.push('/');
        }
        names.push(name);
    }
    names.sort();
    let total = names.len();
    names.truncate(MAX_RESULTS);
    let mut out = names.join("\n");
    if total > MAX_RESULTS {
        out.push_str(&format!("\n[{total} entries, showing {MAX_RESULTS}]"));
    }
    Ok(out)
}

/// Files under `base`, skipping VCS and build directories, as paths
/// relative to `base`.
fn walk(base: &Path) -> impl Iterator<Item = (PathBuf, PathBuf)> + '_ {
    walkdir::WalkDir::new(base)
        .follow_links(false)
        .into_iter()
        .filter_entry(|e| {
            !(e.file_type().is_dir()
                && e.depth() > 0
                && SKIP_DIRS.contains(&e.file_name().to_string_lossy().as_ref()))
        })
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_file())
        .map(move |e| {
            let rel = e.path().strip_prefix(base).unwrap_or(e.path()).to_owned();
            (e.into_path(), rel)
        })
}

async fn glob(root: &Path, input: &Value) -> Result<String, String> {
    let pattern = str_arg(input, "pattern")?.to_owned();
    let base = resolve(
        root,
        input.get("path").and_then(Value::as_str).unwrap_or("."),
    )?;
    let matcher = globset::Glob::new(&pattern)
        .map_err(|e| format!("bad glob `{pattern}`: {e}"))?
        .compile_matcher();
    tokio::task::spawn_blocking(move || {
        let mut found: Vec<String> = walk(&base)
            .filter(|(_, rel)| matcher.is_match(rel))
            .map(|(_, rel)| rel.display().to_string())
            .take(MAX_RESULTS + 1)
            .collect();
        found.sort();
        if found.is_empty() {
            return format!("no files match `{pattern}`");
        }
        if found.len() > MAX_RESULTS {
            found.truncate(MAX_RESULTS);
            found.push(format!(
                "[more than {MAX_RESULTS} files match; narrow the pattern]"
            ));
        }
        found.join("\n")
    })
    .await
    .map_err(|e| e.to_string())
}

async fn grep(root: &Path, cfg: &ToolsConfig, input: &Value) -> Result<String, String> {
    let pattern = str_arg(input, "pattern")?;
    let re = regex::Regex::new(pattern).map_err(|e| format!("bad regular expression: {e}"))?;
    let base = resolve(
        root,
        input.get("path").and_then(Value::as_str).unwrap_or("."),
    )?;
    let filter = match input.get("glob").and_then(Value::as_str) {
        Some(g) => Some(
            globset::Glob::new(g)
                .map_err(|e| format!("bad glob `{g}`: {e}"))?
                .compile_matcher(),
        ),
        None => None,
    };
    let max = cfg.max_output_bytes;
    tokio::task::spawn_blocking(move || {
        let files: Vec<(PathBuf, PathBuf)> = if base.is_file() {
            let name = PathBuf::from(base.file_name().unwrap_or_default());
            vec![(base.clone(), name)]
        } else {
            walk(&base).collect()
        };
        let mut out = String::new();
        let mut n = 0;
        for (full, rel) in files {
            if filter.as_ref().is_some_and(|f| !f.is_match(&rel)) {
                continue;
            }
            // Binary or unreadable files are skipped.
            let Ok(text) = std::fs::read_to_string(&full) else {
                continue;
            };
            for (i, line) in text.lines().enumerate() {
                if re.is_match(line) {
                    n += 1;
                    out.push_str(&format!("{}:{}: {}\n", rel.display(), i + 1, line));
                    if n >= MAX_RESULTS || out.len() > max {
                        out.push_str("[more matches; narrow the search]\n");
                        return out;
                    }
                }
            }
        }
        if n == 0 { "no matches".into() } else { out }
    })
    .await
    .map_err(|e| e.to_string())
}

async fn shell(
    root: &Path,
    cfg: &ToolsConfig,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let command = str_arg(input, "command")?.to_owned();
    let timeout = input
        .get("timeout_ms")
        .and_then(Value::as_u64)
        .map_or(cfg.shell_timeout, Duration::from_millis)
        .min(cfg.max_shell_timeout);
    let cwd = root
        .canonicalize()
        .map_err(|e| format!("the working directory is unusable: {e}"))?;
    let out = match client {
        Some(c) if c.can_terminal() => c.run_command(command, cwd, timeout).await?,
        _ => run_local(&command, &cwd, timeout, cfg.max_output_bytes).await?,
    };
    let status = match (out.timed_out, out.exit_code) {
        (true, _) => format!("killed after the {}ms timeout", timeout.as_millis()),
        (false, Some(c)) => format!("exit code {c}"),
        (false, None) => "killed by a signal".into(),
    };
    let text = format!("{}\n[{status}]", out.output.trim_end());
    if out.exit_code == Some(0) && !out.timed_out {
        Ok(text)
    } else {
        Err(text)
    }
}

async fn run_local(
    command: &str,
    cwd: &Path,
    timeout: Duration,
    max: usize,
) -> Result<CommandOutput, String> {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        // Its own process group, so a timeout or a cancelled turn kills
        // everything the command started, not only the shell.
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start the command: {e}"))?;
    let _group = child.id().map(GroupKill);
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => Ok(CommandOutput {
            output: String::new(),
            exit_code: None,
            timed_out: true,
        }),
        Ok(Err(e)) => Err(format!("cannot start the command: {e}")),
        Ok(Ok(o)) => {
            let mut text = String::from_utf8_lossy(&o.stdout).into_owned();
            let err = String::from_utf8_lossy(&o.stderr);
            if !err.is_empty() {
                if !text.is_empty() && !text.ends_with('\n') {
                    text.push('\n');
                }
                text.push_str(&err);
            }
            Ok(CommandOutput {
                output: truncate(text, max),
                exit_code: o.status.code(),
                timed_out: false,
            })
        }
    }
}

/// Kills a process group when dropped (after the command ended this
/// finds nothing left to kill).
struct GroupKill(u32);

impl Drop for GroupKill {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[cfg(test)]
mod tests;
