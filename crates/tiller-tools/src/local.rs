//! The built-in tools.
//!
//! Every file they touch is opened through a `cap_std::fs::Dir` handle on
//! the session's directory ([`confine::Root`]), so confinement holds by
//! construction, at the moment of each open:
//!
//! - a relative path is taken from the session's directory; an absolute
//!   path is accepted only when it lies lexically inside it (and is then
//!   made relative); any other absolute path is refused;
//! - `..` works while it stays inside; symbolic links (dangling or not,
//!   with absolute or relative targets) are followed only while they stay
//!   inside; `write_file` cannot create a file through a link that points
//!   out; there is no window between a check and an open;
//! - only regular files are read or written: FIFOs (opened non-blocking,
//!   so they never hang a call), sockets, devices and files on procfs or
//!   sysfs are refused with a tool error; `grep`, `glob` and `list_dir`
//!   walk directories through the handle, never into symbolic links, and
//!   `grep` skips anything that is not a regular file;
//! - nothing is buffered beyond [`ToolsConfig::max_output_bytes`]
//!   (`read_file` reads at most that much, `grep` reads line by line with
//!   lines capped at [`MAX_LINE`], `shell` keeps the head and the tail of
//!   its output); `edit` works on files up to [`MAX_EDIT_BYTES`].
//!
//! When an ACP editor does the file work ([`ClientTools`]), it is given an
//! absolute path inside the directory with every symbolic link resolved
//! through the handle.

mod confine;
pub use confine::protect;

use std::io::{BufRead, BufReader, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tiller_engine::{ToolCall, ToolKind, ToolOutput, ToolSpec};

use crate::bounded::{OutputBuffer, truncate};
use crate::{ClientTools, ToolsConfig};
use confine::{Root, Shown};

/// Most entries `glob` and `list_dir` return, and matches `grep` returns.
const MAX_RESULTS: usize = 1000;

/// Directories never searched.
const SKIP_DIRS: &[&str] = &[".git", "node_modules", "target"];

/// Longest line `grep` looks at; the rest of a longer line is skipped.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// Largest file `edit` changes (it holds the file in memory).
pub(crate) const MAX_EDIT_BYTES: u64 = 16 * 1024 * 1024;

/// Room for the markers and status lines the tools append to an output
/// bounded at `max_output_bytes`.
const MARKER_ROOM: usize = 256;

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

/// The absolute path of `path` inside `root`, decided lexically (`..`
/// applied, never above `root`; an absolute path must lie inside it),
/// without looking at the file system: for showing and for editors.
/// Links are not followed, so this is never used to open files: the file
/// tools go through a directory handle instead.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, String> {
    confine::lexical(root, path)
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

/// Runs blocking file work off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("the tool failed: {e}"))?
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
    // Each tool bounds its own output; this is the safety net.
    let max = cfg.max_output_bytes + MARKER_ROOM;
    match r {
        Ok(out) => ok(truncate(out, max)),
        Err(e) => fail(truncate(e, max)),
    }
}

/// The path of `path` for an editor, checked through the handle.
async fn editor_path(root: &Path, path: &str) -> Result<PathBuf, String> {
    let (root, path) = (root.to_owned(), path.to_owned());
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        r.editor_path(&rel, &path)
    })
    .await
}

/// Reads one line into `line` (without its `\n`), keeping at most `cap`
/// bytes of it and skipping the rest. Returns the line's full length, or
/// `None` at the end of the input.
pub(crate) fn read_line_capped(
    r: &mut impl BufRead,
    line: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<Option<usize>> {
    line.clear();
    let mut total = 0;
    let mut any = false;
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(any.then_some(total));
        }
        any = true;
        let (chunk, used, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = cap.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        total += chunk.len();
        r.consume(used);
        if done {
            return Ok(Some(total));
        }
    }
}

/// Drops a `\r` ending a whole line (`\r\n` files). Returns how many
/// bytes of the line were cut by the reader's cap (not counting the `\r`).
fn trim_cr(line: &mut Vec<u8>, full: usize) -> usize {
    if line.len() == full && line.last() == Some(&b'\r') {
        line.pop();
        return 0;
    }
    full - line.len()
}

/// The lines `offset..offset+limit` (1-based) of `r`, into a buffer of
/// `max` bytes.
fn select_lines(
    r: &mut impl BufRead,
    offset: usize,
    limit: Option<usize>,
    max: usize,
) -> std::io::Result<String> {
    let mut out = OutputBuffer::head(max);
    let mut line = Vec::new();
    for _ in 1..offset {
        if read_line_capped(r, &mut line, 0)?.is_none() {
            return Ok(String::new());
        }
    }
    let mut first = true;
    for _ in 0..limit.unwrap_or(usize::MAX) {
        let cap = if out.is_full() { 0 } else { max };
        let Some(full) = read_line_capped(r, &mut line, cap)? else {
            break;
        };
        let cut = trim_cr(&mut line, full);
        if !first {
            out.push(b"\n");
        }
        first = false;
        out.push(&line);
        if cut > 0 {
            out.skip(cut as u64);
        }
    }
    Ok(out.finish())
}

/// Whether the first block of `r` holds a NUL byte.
fn looks_binary(r: &mut impl BufRead) -> bool {
    r.fill_buf().is_ok_and(|b| b.contains(&0))
}

async fn read_file(
    root: &Path,
    cfg: &ToolsConfig,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = str_arg(input, "path")?.to_owned();
    let offset = input
        .get("offset")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let limit = input
        .get("limit")
        .and_then(Value::as_u64)
        .map(|l| l as usize);
    let max = cfg.max_output_bytes;
    let whole = offset == 1 && limit.is_none();
    if let Some(c) = client.filter(|c| c.can_read()) {
        let p = editor_path(root, &path).await?;
        let text = c.read_text_file(p).await?;
        if whole {
            return Ok(truncate(text, max));
        }
        return select_lines(&mut text.as_bytes(), offset, limit, max).map_err(|e| e.to_string());
    }
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let (file, len) = r.open_read(&rel, &path)?;
        let mut reader = BufReader::with_capacity(64 * 1024, file);
        if looks_binary(&mut reader) {
            return Err(format!(
                "{} looks binary (it holds NUL bytes); use shell (e.g. `xxd | head`) to inspect it",
                Shown(&path)
            ));
        }
        let failed = |e: std::io::Error| r.error("read", &path, &e);
        if !whole {
            return select_lines(&mut reader, offset, limit, max).map_err(failed);
        }
        let mut out = OutputBuffer::head(max);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut limited = reader.take(max as u64);
        let mut read = 0u64;
        loop {
            let n = match limited.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(failed(e)),
            };
            out.push(&chunk[..n]);
            read += n as u64;
        }
        if read == max as u64 {
            // The rest is not read: its size comes from the metadata.
            out.skip(len.saturating_sub(read));
        }
        Ok(out.finish())
    })
    .await
}

/// A file's whole text, read confined (through the editor when it offers
/// reads), for an agent that edits it: never cut, refused past `max`
/// bytes or when it is not text.
pub(crate) async fn whole_text(
    root: &Path,
    path: &str,
    max: u64,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    if let Some(c) = client.filter(|c| c.can_read()) {
        let p = editor_path(root, path).await?;
        let text = c.read_text_file(p).await?;
        if text.len() as u64 > max {
            return Err(format!("{} is larger than {max} bytes", Shown(path)));
        }
        return Ok(text);
    }
    let (root, path) = (root.to_owned(), path.to_owned());
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let (file, len) = r.open_read(&rel, &path)?;
        if len > max {
            return Err(format!("{} is larger than {max} bytes", Shown(&path)));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(max + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| r.error("read", &path, &e))?;
        if bytes.len() as u64 > max {
            return Err(format!("{} is larger than {max} bytes", Shown(&path)));
        }
        String::from_utf8(bytes)
            .ok()
            .filter(|t| !t.contains('\0'))
            .ok_or_else(|| format!("{} is not a text file", Shown(&path)))
    })
    .await
}

/// The current text of a file inside `root`, read confined, for showing
/// a change before it is made: `None` when it does not exist, is not a
/// regular text file, or is larger than `max` bytes.
pub(crate) fn current_text(root: &Path, path: &str, max: u64) -> Option<String> {
    let r = Root::open(root).ok()?;
    let rel = r.relative(path).ok()?;
    let (file, len) = r.open_read(&rel, path).ok()?;
    if len > max {
        return None;
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max).read_to_end(&mut bytes).ok()?;
    String::from_utf8(bytes).ok().filter(|t| !t.contains('\0'))
}

async fn write_file(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = str_arg(input, "path")?.to_owned();
    let content = str_arg(input, "content")?.to_owned();
    let n = content.len();
    if let Some(c) = client.filter(|c| c.can_write()) {
        let p = editor_path(root, &path).await?;
        c.write_text_file(p.clone(), content).await?;
        return Ok(format!("wrote {n} bytes to {}", p.display()));
    }
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        write_local(&r, &rel, &path, content.as_bytes())?;
        Ok(format!("wrote {n} bytes to {}", shown_path(&r, &rel)))
    })
    .await
}

fn write_local(r: &Root, rel: &Path, path: &str, content: &[u8]) -> Result<(), String> {
    let mut file = r.open_write(rel, path)?;
    file.write_all(content)
        .and_then(|()| file.flush())
        .map_err(|e| r.error("write", path, &e))
}

/// The absolute path of `rel` for messages.
fn shown_path(r: &Root, rel: &Path) -> String {
    let joined = r.path().join(rel);
    confine::lexical(r.path(), &joined.to_string_lossy())
        .unwrap_or(joined)
        .display()
        .to_string()
}

/// `text` with `old` replaced (once, or everywhere with `all`), and how
/// often it occurred; an error when that is not what was asked.
fn replace(
    text: &str,
    old: &str,
    new: &str,
    all: bool,
    shown: &str,
) -> Result<(String, usize), String> {
    let count = text.matches(old).count();
    match (count, all) {
        (0, _) => Err(format!("`old_string` was not found in {shown}")),
        (1, _) | (_, true) => Ok((text.replace(old, new), count)),
        (n, false) => Err(format!(
            "`old_string` occurs {n} times in {shown}; add context to make it unique or set replace_all"
        )),
    }
}

fn replaced(count: usize, shown: &str) -> String {
    format!(
        "replaced {count} occurrence{} in {shown}",
        if count == 1 { "" } else { "s" }
    )
}

async fn edit(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = str_arg(input, "path")?.to_owned();
    let old = str_arg(input, "old_string")?.to_owned();
    let new = str_arg(input, "new_string")?.to_owned();
    let all = input
        .get("replace_all")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if old.is_empty() {
        return Err("`old_string` is empty; use write_file to create a file".into());
    }
    if let Some(c) = client.filter(|c| c.can_read()) {
        let p = editor_path(root, &path).await?;
        let shown = p.display().to_string();
        let text = c.read_text_file(p.clone()).await?;
        let (updated, count) = replace(&text, &old, &new, all, &shown)?;
        if c.can_write() {
            c.write_text_file(p, updated).await?;
        } else {
            let root = root.to_owned();
            blocking(move || {
                let r = Root::open(&root)?;
                let rel = r.relative(&path)?;
                write_local(&r, &rel, &path, updated.as_bytes())
            })
            .await?;
        }
        return Ok(replaced(count, &shown));
    }
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let shown = shown_path(&r, &rel);
        let (file, len) = r.open_read(&rel, &path)?;
        if len > MAX_EDIT_BYTES {
            return Err(format!(
                "{} is {len} bytes; edit changes files up to {MAX_EDIT_BYTES} bytes (use shell, e.g. sed, for larger ones)",
                Shown(&path)
            ));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(MAX_EDIT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| r.error("read", &path, &e))?;
        if bytes.len() as u64 > MAX_EDIT_BYTES {
            return Err(format!(
                "{} grew past {MAX_EDIT_BYTES} bytes while being read; edit changes files up to that size",
                Shown(&path)
            ));
        }
        let text = String::from_utf8(bytes).map_err(|_| {
            format!(
                "{} is not UTF-8 text; edit only changes text files",
                Shown(&path)
            )
        })?;
        let (updated, count) = replace(&text, &old, &new, all, &shown)?;
        write_local(&r, &rel, &path, updated.as_bytes())?;
        Ok(replaced(count, &shown))
    })
    .await
}

async fn list_dir(root: &Path, input: &Value) -> Result<String, String> {
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or(".")
        .to_owned();
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let dir = r.open_dir(&rel, &path)?;
        let entries = dir.entries().map_err(|e| r.error("list", &path, &e))?;
        // The first MAX_RESULTS names in order, without holding them all.
        let mut names = std::collections::BinaryHeap::new();
        let mut total = 0usize;
        for e in entries.filter_map(Result::ok) {
            total += 1;
            let mut name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                name.push('/');
            }
            names.push(name);
            if names.len() > MAX_RESULTS {
                names.pop();
            }
        }
        let mut out = names.into_sorted_vec().join("\n");
        if total > MAX_RESULTS {
            out.push_str(&format!("\n[{total} entries, showing {MAX_RESULTS}]"));
        }
        Ok(out)
    })
    .await
}

async fn glob(root: &Path, input: &Value) -> Result<String, String> {
    let pattern = str_arg(input, "pattern")?.to_owned();
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or(".")
        .to_owned();
    let matcher = globset::Glob::new(&pattern)
        .map_err(|e| format!("bad glob `{pattern}`: {e}"))?
        .compile_matcher();
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let base = r.open_dir(&rel, &path)?;
        let mut found = Vec::new();
        let _ = confine::walk(&base, Path::new(""), &mut |_, rel, _| {
            if matcher.is_match(rel) {
                found.push(rel.display().to_string());
                if found.len() > MAX_RESULTS {
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        });
        found.sort();
        if found.is_empty() {
            return Ok(format!("no files match `{pattern}`"));
        }
        if found.len() > MAX_RESULTS {
            found.truncate(MAX_RESULTS);
            found.push(format!(
                "[more than {MAX_RESULTS} files match; narrow the pattern]"
            ));
        }
        Ok(found.join("\n"))
    })
    .await
}

/// Matches so far, for `grep`.
struct Matches {
    /// The output.
    out: String,
    /// How many lines matched.
    n: usize,
    /// Bound on `out`.
    max: usize,
}

/// Greps one file line by line; breaks when the output is full.
fn grep_file(
    file: cap_std::fs::File,
    rel: &Path,
    re: &regex::bytes::Regex,
    m: &mut Matches,
) -> ControlFlow<()> {
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    if looks_binary(&mut reader) {
        return ControlFlow::Continue(());
    }
    let mut line = Vec::new();
    let mut no = 0usize;
    while let Ok(Some(full)) = read_line_capped(&mut reader, &mut line, MAX_LINE) {
        no += 1;
        let cut = trim_cr(&mut line, full);
        if !re.is_match(&line) {
            continue;
        }
        m.n += 1;
        let cut = if cut > 0 {
            format!(" [line cut: {full} bytes, showing {}]", line.len())
        } else {
            String::new()
        };
        m.out.push_str(&format!(
            "{}:{no}: {}{cut}\n",
            rel.display(),
            String::from_utf8_lossy(&line)
        ));
        if m.n >= MAX_RESULTS || m.out.len() > m.max {
            m.out.push_str("[more matches; narrow the search]\n");
            return ControlFlow::Break(());
        }
    }
    ControlFlow::Continue(())
}

async fn grep(root: &Path, cfg: &ToolsConfig, input: &Value) -> Result<String, String> {
    let pattern = str_arg(input, "pattern")?;
    let re =
        regex::bytes::Regex::new(pattern).map_err(|e| format!("bad regular expression: {e}"))?;
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or(".")
        .to_owned();
    let filter = match input.get("glob").and_then(Value::as_str) {
        Some(g) => Some(
            globset::Glob::new(g)
                .map_err(|e| format!("bad glob `{g}`: {e}"))?
                .compile_matcher(),
        ),
        None => None,
    };
    let max = cfg.max_output_bytes;
    let root = root.to_owned();
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        let mut m = Matches {
            out: String::new(),
            n: 0,
            max,
        };
        if r.metadata(&rel, &path)?.is_dir() {
            let base = r.open_dir(&rel, &path)?;
            let _ = confine::walk(&base, Path::new(""), &mut |dir, rel, name| {
                if filter.as_ref().is_some_and(|f| !f.is_match(rel)) {
                    return ControlFlow::Continue(());
                }
                match confine::open_walked(dir, name) {
                    Some(file) => grep_file(file, rel, &re, &mut m),
                    None => ControlFlow::Continue(()),
                }
            });
        } else {
            let name = PathBuf::from(rel.file_name().unwrap_or_default());
            if filter.as_ref().is_none_or(|f| f.is_match(&name)) {
                let (file, _) = r.open_read(&rel, &path)?;
                let _ = grep_file(file, &name, &re, &mut m);
            }
        }
        Ok(if m.n == 0 { "no matches".into() } else { m.out })
    })
    .await
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
    let root = root.to_owned();
    let cwd = blocking(move || {
        root.canonicalize()
            .map_err(|e| format!("the working directory is unusable: {e}"))
    })
    .await?;
    let out = match client {
        Some(c) if c.can_terminal() => {
            let mut out = c.run_command(command, cwd, timeout).await?;
            let mut b = OutputBuffer::head_and_tail(cfg.max_output_bytes);
            b.push(out.output.as_bytes());
            out.output = b.finish();
            out
        }
        _ => crate::shell::run_local(&command, &cwd, timeout, cfg).await?,
    };
    let status = match (out.timed_out, out.exit_code) {
        (true, _) => format!("killed after the {}ms timeout", timeout.as_millis()),
        (false, Some(c)) => format!("exit code {c}"),
        (false, None) => "killed by a signal".into(),
    };
    let printed = out.output.trim_end();
    let text = if printed.is_empty() {
        format!("[{status}]")
    } else {
        format!("{printed}\n[{status}]")
    };
    if out.exit_code == Some(0) && !out.timed_out {
        Ok(text)
    } else {
        Err(text)
    }
}

#[cfg(test)]
mod tests;
