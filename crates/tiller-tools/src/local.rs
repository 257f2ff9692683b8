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
pub use confine::{in_git_dir, lands_in_git_dir, lands_within, protect};

use std::io::{BufRead, BufReader, Read, Write};
use std::ops::ControlFlow;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
            "Read a text file in the working directory. Optional `offset` (1-based first line) and `limit` (number of lines); `line_numbers` prefixes each line with its number and a tab.",
            json!({"type": "object", "properties": {
                "path": {"type": "string", "description": "Path relative to the working directory (or absolute inside it)"},
                "offset": {"type": "integer", "minimum": 1},
                "limit": {"type": "integer", "minimum": 1},
                "line_numbers": {"type": "boolean"}
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
            "Replace exact strings in a file: one (`old_string`, `new_string`) or several in order (`edits`), all or none. Each `old_string` must occur exactly once unless `replace_all` is true.",
            json!({"type": "object", "properties": {
                "path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
                "replace_all": {"type": "boolean"},
                "edits": {"type": "array", "items": {"type": "object", "properties": {
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                    "replace_all": {"type": "boolean"}
                }, "required": ["old_string", "new_string"]}}
            }, "required": ["path"]}),
        ),
        spec(
            "apply_patch",
            ToolKind::Edit,
            "Apply a unified diff (`--- a/file`, `+++ b/file`, `@@` hunks; several files allowed; `/dev/null` as the old file creates one). All files change or none.",
            json!({"type": "object", "properties": {
                "patch": {"type": "string"}
            }, "required": ["patch"]}),
        ),
        spec(
            "todo",
            ToolKind::Other,
            "Replace the task plan the user sees: every item with its status (`pending`, `in_progress`, `completed`). Keep one item in progress.",
            json!({"type": "object", "properties": {
                "todos": {"type": "array", "items": {"type": "object", "properties": {
                    "content": {"type": "string"},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}
                }, "required": ["content", "status"]}}
            }, "required": ["todos"]}),
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
            "Run a shell command (`sh -c`) in the working directory, or in `cwd` (a directory inside it or an additional root); returns its output and exit code. With `background: true` it returns at once with an id: read its output later with shell_output (for servers, watchers, long builds).",
            json!({"type": "object", "properties": {
                "command": {"type": "string"},
                "cwd": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1},
                "background": {"type": "boolean"}
            }, "required": ["command"]}),
        ),
        spec(
            "shell_output",
            ToolKind::Other,
            "The output so far of a background shell command, and whether it still runs (`stop: true` kills it first).",
            json!({"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1},
                "stop": {"type": "boolean"}
            }, "required": ["id"]}),
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

/// Runs `f` on a blocking thread with `root` opened and `path` (relative
/// to it) checked to stay inside; `f` gets the root, the relative path
/// and the path as given (for its messages).
async fn in_root<T: Send + 'static>(
    root: &Path,
    path: &str,
    f: impl FnOnce(Root, PathBuf, String) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let (root, path) = (root.to_owned(), path.to_owned());
    blocking(move || {
        let r = Root::open(&root)?;
        let rel = r.relative(&path)?;
        f(r, rel, path)
    })
    .await
}

/// Whether `path` names anything inside `root` (links inside followed).
async fn exists(root: &Path, path: &str) -> bool {
    in_root(root, path, move |r, rel, path| {
        r.metadata(&rel, &path).map(|_| ())
    })
    .await
    .is_ok()
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
        "apply_patch" => apply_patch(root, &call.input, client).await,
        "todo" => todo(&call.input),
        "web_fetch" => web_fetch(cfg, &call.input).await,
        "list_dir" => list_dir(root, &call.input).await,
        "glob" => glob(root, cfg, &call.input).await,
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
    in_root(root, path, move |r, rel, path| r.editor_path(&rel, &path)).await
}

/// [`editor_path`] for a write: never into a repository's own directory
/// (see `confine::git_dir_refusal`).
async fn editor_write_path(root: &Path, path: &str) -> Result<PathBuf, String> {
    let p = editor_path(root, path).await?;
    let linked = || {
        let m = std::fs::metadata(&p).ok()?;
        confine::linked_refusal(m.is_file(), m.nlink(), path)
    };
    match confine::git_dir_refusal(&p, path).or_else(linked) {
        Some(refused) => Err(refused),
        None => Ok(p),
    }
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
/// `max` bytes; `numbered`: each after its number and a tab.
fn select_lines(
    r: &mut impl BufRead,
    offset: usize,
    limit: Option<usize>,
    max: usize,
    numbered: bool,
) -> std::io::Result<String> {
    let mut out = OutputBuffer::head(max);
    match lines_into(r, &mut out, offset, limit, max, numbered) {
        Ok(()) => Ok(out.finish()),
        // Stopped by a `Timed` reader: what was read, and why no more.
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            let mut text = out.finish();
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&e.to_string());
            Ok(text)
        }
        Err(e) => Err(e),
    }
}

/// [`select_lines`]' reading, into `out`.
fn lines_into(
    r: &mut impl BufRead,
    out: &mut OutputBuffer,
    offset: usize,
    limit: Option<usize>,
    max: usize,
    numbered: bool,
) -> std::io::Result<()> {
    let mut line = Vec::new();
    for _ in 1..offset {
        if read_line_capped(r, &mut line, 0)?.is_none() {
            return Ok(());
        }
    }
    let mut first = true;
    for n in offset..offset.saturating_add(limit.unwrap_or(usize::MAX)) {
        let cap = if out.is_full() { 0 } else { max };
        let Some(full) = read_line_capped(r, &mut line, cap)? else {
            break;
        };
        let cut = trim_cr(&mut line, full);
        if !first {
            out.push(b"\n");
        }
        first = false;
        if numbered {
            out.push(format!("{n}\t").as_bytes());
        }
        out.push(&line);
        if cut > 0 {
            out.skip(cut as u64);
        }
    }
    Ok(())
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
    let numbered = input
        .get("line_numbers")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let whole = offset == 1 && limit.is_none() && !numbered;
    if let Some(c) = client.filter(|c| c.can_read()) {
        let p = editor_path(root, &path).await?;
        let text = c.read_text_file(p).await?;
        if whole {
            return Ok(truncate(text, max));
        }
        return select_lines(&mut text.as_bytes(), offset, limit, max, numbered)
            .map_err(|e| e.to_string());
    }
    let deadline = Deadline::of(cfg);
    in_root(root, &path, move |r, rel, path| {
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
            let advice = "read nearer the start, or use shell (e.g. `tail`)";
            let mut timed = Timed::new(reader, deadline, advice);
            return select_lines(&mut timed, offset, limit, max, numbered).map_err(failed);
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
    in_root(root, path, move |r, rel, path| {
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

/// What a person is shown of the file a write would replace: its text, or
/// a line saying a file is there whose text is not shown (binary, longer
/// than `max`, unreadable); `None` only when nothing is there (a new file).
pub(crate) fn replaced_text(root: &Path, path: &str, max: u64) -> Option<String> {
    if let Some(text) = current_text(root, path, max) {
        return Some(text);
    }
    // Looked at through the session's directory: a link out of it is not
    // followed (nothing of what it names is told).
    let r = Root::open(root).ok()?;
    let rel = r.relative(path).ok()?;
    match r.metadata(&rel, path) {
        Ok(meta) => Some(format!(
            "(a file of {} bytes is here, not shown: binary, too long or unreadable; the write replaces it whole)",
            meta.len()
        )),
        Err(_) => r.names_something(&rel).then(|| {
            "(something is here that the file tools do not follow, such as a link out of the session's directory; the write is refused or replaces it)".to_owned()
        }),
    }
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
        let p = editor_write_path(root, &path).await?;
        c.write_text_file(p.clone(), content).await?;
        return Ok(format!("wrote {n} bytes to {}", p.display()));
    }
    in_root(root, &path, move |r, rel, path| {
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

/// One replacement of an `edit` call.
struct Replacement {
    old: String,
    new: String,
    all: bool,
}

/// The replacements an `edit` call asks for: `edits`, or the single one.
fn replacements(input: &Value) -> Result<Vec<Replacement>, String> {
    let one = |v: &Value, what: &str| -> Result<Replacement, String> {
        let old = str_arg(v, "old_string").map_err(|e| format!("{what}{e}"))?;
        let new = str_arg(v, "new_string").map_err(|e| format!("{what}{e}"))?;
        if old.is_empty() {
            return Err(format!(
                "{what}`old_string` is empty; use write_file to create a file"
            ));
        }
        Ok(Replacement {
            old: old.to_owned(),
            new: new.to_owned(),
            all: v
                .get("replace_all")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    };
    match input.get("edits") {
        Some(Value::Array(list)) if !list.is_empty() => list
            .iter()
            .enumerate()
            .map(|(i, e)| one(e, &format!("edit {}: ", i + 1)))
            .collect(),
        Some(_) => Err("`edits` must be a non-empty array of {old_string, new_string}".into()),
        None => Ok(vec![one(input, "")?]),
    }
}

/// `text` with every replacement applied in order (each sees the text the
/// ones before it left), and how many occurrences changed; an error names
/// the first that does not apply, and nothing changes.
fn replace_each(text: &str, reps: &[Replacement], shown: &str) -> Result<(String, usize), String> {
    let mut text = text.to_owned();
    let mut total = 0;
    for (i, r) in reps.iter().enumerate() {
        let (t, n) = replace(&text, &r.old, &r.new, r.all, shown).map_err(|e| {
            if reps.len() > 1 {
                format!("edit {} of {}: {e}; no edit was made", i + 1, reps.len())
            } else {
                e
            }
        })?;
        text = t;
        total += n;
    }
    Ok((text, total))
}

async fn edit(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let path = str_arg(input, "path")?.to_owned();
    let reps = replacements(input)?;
    let shown = match &client {
        Some(c) if c.can_read() => editor_path(root, &path).await?.display().to_string(),
        _ => in_root(root, &path, move |r, rel, _| Ok(shown_path(&r, &rel))).await?,
    };
    let text = edit_text(root, &path, client.clone()).await?;
    let (updated, count) = replace_each(&text, &reps, &shown)?;
    put_text(root, &path, updated, client).await?;
    Ok(replaced(count, &shown))
}

/// A file's text for changing it: read confined (through the editor when it
/// offers reads), up to [`MAX_EDIT_BYTES`], UTF-8 only.
async fn edit_text(
    root: &Path,
    path: &str,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    whole_text(root, path, MAX_EDIT_BYTES, client)
        .await
        .map_err(|e| {
            if e.contains("larger than") {
                format!(
                    "{} is larger than {MAX_EDIT_BYTES} bytes; edits change files up to that size (use shell, e.g. sed, for larger ones)",
                    Shown(path)
                )
            } else if e.contains("not a text file") {
                format!("{} is not UTF-8 text; edits only change text files", Shown(path))
            } else {
                e
            }
        })
}

/// Why [`put_text`] would refuse `path` (the editor's path, or
/// [`Root::check_write`]), told without changing anything.
async fn check_put(
    root: &Path,
    path: &str,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<(), String> {
    if client.is_some_and(|c| c.can_write()) {
        return editor_write_path(root, path).await.map(drop);
    }
    in_root(root, path, move |r, rel, path| {
        r.check_write(&rel, &path).map(drop)
    })
    .await
}

/// Writes a file's new text (through the editor when it offers writes).
async fn put_text(
    root: &Path,
    path: &str,
    text: String,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<(), String> {
    if let Some(c) = client.filter(|c| c.can_write()) {
        let p = editor_write_path(root, path).await?;
        return c.write_text_file(p, text).await;
    }
    in_root(root, path, move |r, rel, path| {
        write_local(&r, &rel, &path, text.as_bytes())
    })
    .await
}

/// One file's part of a unified diff.
#[derive(Debug, PartialEq)]
struct FilePatch {
    /// The file's path (`b/` or `a/` dropped), and whether it is new.
    path: String,
    new: bool,
    /// The part, from its `---` line on.
    text: String,
}

/// Splits a unified diff into its files (`diff --git` and other lines
/// before a `---` are ignored).
fn split_patch(patch: &str) -> Result<Vec<FilePatch>, String> {
    let lines: Vec<&str> = patch.split_inclusive('\n').collect();
    let mut starts = Vec::new();
    for i in 0..lines.len() {
        if lines[i].starts_with("--- ") && lines.get(i + 1).is_some_and(|l| l.starts_with("+++ ")) {
            starts.push(i);
        }
    }
    if starts.is_empty() {
        return Err("the patch has no file header (`--- a/path` then `+++ b/path`)".into());
    }
    let name = |line: &str, prefix: &str| -> String {
        let n = line[4..].trim_end_matches(['\n', '\r']);
        // A timestamp after a tab is part of the header, not the name.
        let n = n.split('\t').next().unwrap_or(n).trim();
        n.strip_prefix(prefix).unwrap_or(n).to_owned()
    };
    let mut files = Vec::new();
    for (k, &i) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(lines.len());
        // Lines between files that are not hunks (a `diff --git` header).
        let mut stop = end;
        while stop > i + 2 && !is_hunk_line(lines[stop - 1]) {
            stop -= 1;
        }
        let old = name(lines[i], "a/");
        let new_name = name(lines[i + 1], "b/");
        if new_name == "/dev/null" {
            return Err(format!(
                "the patch deletes {old}; apply_patch does not delete files (use shell)"
            ));
        }
        files.push(FilePatch {
            path: new_name,
            new: old == "/dev/null",
            text: lines[i..stop].concat(),
        });
    }
    Ok(files)
}

fn is_hunk_line(l: &str) -> bool {
    l.starts_with(['+', '-', ' ', '@', '\\']) || l == "\n"
}

async fn apply_patch(
    root: &Path,
    input: &Value,
    client: Option<Arc<dyn ClientTools>>,
) -> Result<String, String> {
    let patch = str_arg(input, "patch")?;
    let files = split_patch(patch)?;
    // Every file is computed first: all change or none.
    let mut out = Vec::with_capacity(files.len());
    for f in &files {
        let parsed = diffy::Patch::from_str(&f.text)
            .map_err(|e| format!("the patch for {} does not parse: {e}", f.path))?;
        let base = if f.new {
            // Anything there counts, text or not (a file the tools cannot
            // read as text is not a missing one).
            if exists(root, &f.path).await || edit_text(root, &f.path, client.clone()).await.is_ok()
            {
                return Err(format!(
                    "the patch creates {}, which exists; no file was changed",
                    f.path
                ));
            }
            String::new()
        } else {
            edit_text(root, &f.path, client.clone()).await?
        };
        let text = diffy::apply(&base, &parsed).map_err(|e| {
            format!(
                "the patch does not apply to {} ({e}); read the file again and make the patch from its current text; no file was changed",
                f.path
            )
        })?;
        out.push((f.path.clone(), text, parsed.hunks().len()));
    }
    // Every file may be written, before any is.
    for (path, _, _) in &out {
        check_put(root, path, client.clone()).await?;
    }
    let mut said = Vec::new();
    for (path, text, hunks) in out {
        put_text(root, &path, text, client.clone()).await?;
        said.push(format!(
            "{path} ({hunks} hunk{})",
            if hunks == 1 { "" } else { "s" }
        ));
    }
    Ok(format!("patched {}", said.join(", ")))
}

/// A file before and after an `edit` call's replacements, for showing the
/// change before it is made (`None` when it would not apply or is large).
pub(crate) fn edited(root: &Path, path: &str, input: &Value, max: u64) -> Option<(String, String)> {
    let reps = replacements(input).ok()?;
    let old = current_text(root, path, max)?;
    let (new, _) = replace_each(&old, &reps, path).ok()?;
    Some((old, new))
}

/// The change a one-file patch would make, for showing before it is made.
pub(crate) fn patch_diff(root: &Path, patch: &str, max: u64) -> Option<crate::FileDiff> {
    let files = split_patch(patch).ok()?;
    let [f] = &files[..] else { return None };
    let parsed = diffy::Patch::from_str(&f.text).ok()?;
    let old = if f.new {
        None
    } else {
        Some(current_text(root, &f.path, max)?)
    };
    let new_text = diffy::apply(old.as_deref().unwrap_or(""), &parsed).ok()?;
    Some(crate::FileDiff {
        path: resolve(root, &f.path).ok()?.display().to_string(),
        old_text: old,
        new_text,
    })
}

/// `web_fetch`, offered only when `[tools] web_fetch_hosts` allows some.
pub(crate) fn web_fetch_spec() -> ToolSpec {
    ToolSpec {
        name: "web_fetch".into(),
        description: "Fetch a web page or file over http(s) from an allowed host; returns its status, type and text (bounded).".into(),
        input_schema: json!({"type": "object", "properties": {
            "url": {"type": "string"}
        }, "required": ["url"]}),
        kind: ToolKind::Other,
    }
}

/// How long a `web_fetch` may take, connection included.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

async fn web_fetch(cfg: &ToolsConfig, input: &Value) -> Result<String, String> {
    let url = str_arg(input, "url")?;
    if cfg.web_fetch.is_empty() {
        return Err("web_fetch is off: no host is allowed (tools.web_fetch_hosts)".into());
    }
    // The host is vetted here and every address again at resolution; no
    // redirects are followed (a redirect is reported with its target).
    let url = cfg.web_fetch.check(url)?;
    let shown = crate::egress::redact(url.as_str());
    let client = cfg.web_fetch.client(FETCH_TIMEOUT);
    let asked = url.as_str().to_owned();
    let mut resp = client.get(url).send().await.map_err(|e| {
        let why = crate::egress::describe(e);
        format!(
            "cannot fetch {shown}: {}",
            crate::egress::scrub(&why, &asked)
        )
    })?;
    let status = resp.status();
    let kind = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if status.is_redirection() {
        let to = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(crate::egress::redact)
            .unwrap_or_default();
        return Err(format!(
            "{shown} redirects ({status}) to {to}; fetch that URL if its host is allowed"
        ));
    }
    let textual = kind.is_empty()
        || kind.starts_with("text/")
        || ["json", "xml", "javascript", "yaml", "toml"]
            .iter()
            .any(|t| kind.contains(t));
    if !textual {
        return Err(format!("{shown} is `{kind}`, not text"));
    }
    let mut out = OutputBuffer::head(cfg.max_output_bytes);
    let read = async {
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            let full = out.is_full();
            if full {
                out.skip(chunk.len() as u64);
            } else {
                out.push(&chunk);
            }
        }
        Ok::<(), String>(())
    };
    tokio::time::timeout(FETCH_TIMEOUT, read)
        .await
        .map_err(|_| format!("{shown} took longer than {}s", FETCH_TIMEOUT.as_secs()))?
        .map_err(|e| format!("reading {shown} failed: {e}"))?;
    let body = out.finish();
    let head = format!("HTTP {} {kind}", status.as_u16());
    if status.is_success() {
        Ok(format!("{head}\n\n{body}"))
    } else {
        Err(format!("{head}\n\n{body}"))
    }
}

/// The plan a `todo` call sets: its items and their statuses.
pub fn todo_entries(input: &Value) -> Result<Vec<(String, String)>, String> {
    let list = input
        .get("todos")
        .and_then(Value::as_array)
        .ok_or("missing array argument `todos`")?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let content = t
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .trim();
            let status = t.get("status").and_then(Value::as_str).unwrap_or("");
            if content.is_empty() {
                return Err(format!("todo {}: `content` is missing or empty", i + 1));
            }
            if !matches!(status, "pending" | "in_progress" | "completed") {
                return Err(format!(
                    "todo {}: `status` must be pending, in_progress or completed, not `{status}`",
                    i + 1
                ));
            }
            Ok((content.to_owned(), status.to_owned()))
        })
        .collect()
}

fn todo(input: &Value) -> Result<String, String> {
    let entries = todo_entries(input)?;
    let done = entries.iter().filter(|(_, s)| s == "completed").count();
    Ok(format!(
        "plan updated: {} items, {done} completed",
        entries.len()
    ))
}

async fn list_dir(root: &Path, input: &Value) -> Result<String, String> {
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or(".")
        .to_owned();
    in_root(root, &path, move |r, rel, path| {
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

/// Until when a search (`grep`, `glob`) walks, or `read_file` reads by
/// lines: a command's bound (`tools.shell_timeout`), so a search over a
/// huge tree or a read deep into a huge file ends, as a command would,
/// rather than go on after its turn ended.
#[derive(Clone, Copy)]
struct Deadline {
    /// `None` for a bound past what the clock can count.
    at: Option<Instant>,
    after: Duration,
}

impl Deadline {
    fn of(cfg: &ToolsConfig) -> Deadline {
        Deadline {
            at: Instant::now().checked_add(cfg.shell_timeout),
            after: cfg.shell_timeout,
        }
    }

    fn passed(&self) -> bool {
        self.at.is_some_and(|at| Instant::now() >= at)
    }

    /// A `stop` for [`confine::walk`]: whether the deadline passed, kept
    /// in `stopped`.
    fn stop<'a>(&'a self, stopped: &'a std::cell::Cell<bool>) -> impl Fn() -> bool + 'a {
        move || {
            stopped.set(self.passed());
            stopped.get()
        }
    }

    /// What the output ends with when the search stopped there.
    fn note(&self) -> String {
        self.note_with(SEARCH_ADVICE)
    }

    fn note_with(&self, advice: &str) -> String {
        format!(
            "[stopped after {:?} (tools.shell_timeout); {advice}]",
            self.after
        )
    }
}

const SEARCH_ADVICE: &str = "narrow the search";

/// A reader that fails with `TimedOut`, the deadline's note its message,
/// once the deadline passed: checked at every 16th fill of its buffer,
/// whether that reads (at most 64 KiB) or hands out the next line, so a
/// line of gigabytes stops too.
struct Timed<R> {
    inner: R,
    deadline: Deadline,
    advice: &'static str,
    fills: u32,
}

impl<R: BufRead> Timed<R> {
    fn new(inner: R, deadline: Deadline, advice: &'static str) -> Self {
        Timed {
            inner,
            deadline,
            advice,
            fills: 0,
        }
    }
}

impl<R: BufRead> Read for Timed<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = {
            let buf = self.fill_buf()?;
            let n = buf.len().min(out.len());
            out[..n].copy_from_slice(&buf[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl<R: BufRead> BufRead for Timed<R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        let check = self.fills.is_multiple_of(16);
        self.fills = self.fills.wrapping_add(1);
        if check && self.deadline.passed() {
            let note = self.deadline.note_with(self.advice);
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, note));
        }
        self.inner.fill_buf()
    }

    fn consume(&mut self, n: usize) {
        self.inner.consume(n);
    }
}

async fn glob(root: &Path, cfg: &ToolsConfig, input: &Value) -> Result<String, String> {
    let pattern = str_arg(input, "pattern")?.to_owned();
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or(".")
        .to_owned();
    let matcher = globset::Glob::new(&pattern)
        .map_err(|e| format!("bad glob `{pattern}`: {e}"))?
        .compile_matcher();
    let deadline = Deadline::of(cfg);
    in_root(root, &path, move |r, rel, path| {
        let base = r.open_dir(&rel, &path)?;
        let mut found = Vec::new();
        let stopped = std::cell::Cell::new(false);
        let stop = deadline.stop(&stopped);
        let _ = confine::walk(&base, Path::new(""), &stop, &mut |_, rel, _| {
            if matcher.is_match(rel) {
                found.push(rel.display().to_string());
                if found.len() > MAX_RESULTS {
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        });
        found.sort();
        if stopped.get() {
            found.truncate(MAX_RESULTS);
            found.push(deadline.note());
            return Ok(found.join("\n"));
        }
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
    deadline: Deadline,
    /// Set once the deadline passed (and said so in `out`).
    stopped: bool,
}

impl Matches {
    /// Whether the search is to stop for time (saying so, once).
    fn out_of_time(&mut self) -> bool {
        if !self.stopped && self.deadline.passed() {
            self.stopped = true;
            self.out.push_str(&self.deadline.note());
            self.out.push('\n');
        }
        self.stopped
    }
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
    let mut reader = Timed::new(reader, m.deadline, SEARCH_ADVICE);
    let mut line = Vec::new();
    let mut no = 0usize;
    loop {
        let full = match read_line_capped(&mut reader, &mut line, MAX_LINE) {
            Ok(Some(full)) => full,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut && m.out_of_time() => {
                return ControlFlow::Break(());
            }
            // The end, or a file that cannot be read on: the next one.
            _ => break,
        };
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
    let deadline = Deadline::of(cfg);
    in_root(root, &path, move |r, rel, path| {
        let mut m = Matches {
            out: String::new(),
            n: 0,
            max,
            deadline,
            stopped: false,
        };
        if r.metadata(&rel, &path)?.is_dir() {
            let base = r.open_dir(&rel, &path)?;
            let stopped = std::cell::Cell::new(false);
            let stop = deadline.stop(&stopped);
            let _ = confine::walk(&base, Path::new(""), &stop, &mut |dir, rel, name| {
                if filter.as_ref().is_some_and(|f| !f.is_match(rel)) {
                    return ControlFlow::Continue(());
                }
                match confine::open_walked(dir, name) {
                    Some(file) => grep_file(file, rel, &re, &mut m),
                    None => ControlFlow::Continue(()),
                }
            });
            if stopped.get() {
                m.out_of_time(); // says so
            }
        } else {
            let name = PathBuf::from(rel.file_name().unwrap_or_default());
            if filter.as_ref().is_none_or(|f| f.is_match(&name)) {
                let (file, _) = r.open_read(&rel, &path)?;
                let _ = grep_file(file, &name, &re, &mut m);
            }
        }
        Ok(if m.n == 0 && !m.stopped {
            "no matches".into()
        } else {
            m.out
        })
    })
    .await
}

/// The directory a `shell` call runs in: the session's, or its `cwd`
/// (inside the root once links are resolved, and a directory).
pub(crate) async fn shell_cwd(root: &Path, input: &Value) -> Result<PathBuf, String> {
    let dir = input.get("cwd").and_then(Value::as_str).map(str::to_owned);
    let root = root.to_owned();
    blocking(move || {
        let base = root
            .canonicalize()
            .map_err(|e| format!("the working directory is unusable: {e}"))?;
        let Some(dir) = dir else { return Ok(base) };
        // Inside the root once links are resolved, and a directory.
        let r = Root::open(&root)?;
        let rel = r.relative(&dir)?;
        let real = base
            .join(&rel)
            .canonicalize()
            .map_err(|e| format!("`cwd` {}: {e}", Shown(&dir)))?;
        if !real.starts_with(&base) {
            return Err(format!(
                "`cwd` {} is outside the working directory",
                Shown(&dir)
            ));
        }
        if !real.is_dir() {
            return Err(format!("`cwd` {} is not a directory", Shown(&dir)));
        }
        Ok(real)
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
    let cwd = shell_cwd(root, input).await?;
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
