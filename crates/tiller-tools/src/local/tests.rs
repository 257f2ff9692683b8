use std::collections::HashMap;
use std::sync::Mutex;

use super::*;
use crate::{BoxFuture, CommandOutput};

fn call(name: &str, input: Value) -> ToolCall {
    ToolCall {
        id: "c".into(),
        name: name.into(),
        kind: ToolKind::of(name),
        input,
        simulated: None,
    }
}

async fn go(root: &Path, name: &str, input: Value) -> ToolOutput {
    run(root, &ToolsConfig::default(), &call(name, input), None).await
}

#[tokio::test]
async fn paths_cannot_leave_the_session_directory() {
    let outer = tempfile::tempdir().unwrap();
    let root = outer.path().join("proj");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(outer.path().join("secret"), "s").unwrap();
    std::os::unix::fs::symlink(outer.path(), root.join("up")).unwrap();
    let real_root = root.canonicalize().unwrap();
    // The lexical helper: (input, Some(path inside the root) or None).
    let inside = real_root.join("x").display().to_string();
    let cases: &[(&str, Option<&str>)] = &[
        ("../secret", None),
        ("/etc/passwd", None),
        ("a/../../secret", None),
        ("a/../b.txt", Some("b.txt")),
        ("new/dir/f", Some("new/dir/f")),
        (&inside, Some("x")),
        // Lexically inside: the helper does not look at links, which is
        // why the file tools never use it to open anything.
        ("up/secret", Some("up/secret")),
    ];
    for (input, want) in cases {
        match (resolve(&root, input), want) {
            (Ok(p), Some(w)) => assert_eq!(p, real_root.join(w), "{input}"),
            (Err(e), None) => assert!(e.contains("outside"), "{input}: {e}"),
            (got, _) => panic!("{input}: {got:?}"),
        }
    }
    let out = go(&root, "read_file", json!({"path": "../secret"})).await;
    assert!(!out.ok && out.output.contains("outside"), "{out:?}");
    let out = go(&root, "read_file", json!({"path": "up/secret"})).await;
    assert!(!out.ok && out.output.contains("outside"), "{out:?}");
    let out = go(
        &root,
        "write_file",
        json!({"path": "up/x", "content": "no"}),
    )
    .await;
    assert!(!out.ok && out.output.contains("outside"), "{out:?}");
    assert!(!outer.path().join("x").exists());
}

fn cfg_with_max(max: usize) -> ToolsConfig {
    ToolsConfig {
        max_output_bytes: max,
        ..ToolsConfig::default()
    }
}

/// Runs a call that must not hang (a FIFO would, without `O_NONBLOCK`).
async fn go_quick(root: &Path, cfg: &ToolsConfig, name: &str, input: Value) -> ToolOutput {
    tokio::time::timeout(
        Duration::from_secs(10),
        run(root, cfg, &call(name, input), None),
    )
    .await
    .unwrap_or_else(|_| panic!("{name} hung"))
}

#[tokio::test]
async fn non_regular_files_are_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let cfg = ToolsConfig::default();
    let st = std::process::Command::new("mkfifo")
        .arg(root.join("fifo"))
        .status()
        .unwrap();
    assert!(st.success());
    let _sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
    std::fs::write(root.join("plain.txt"), "needle\n").unwrap();
    // (root, path, expected words)
    let mut cases: Vec<(PathBuf, &str, &str)> = vec![
        (root.to_owned(), "fifo", "is a FIFO, not a regular file"),
        (root.to_owned(), "sock", "is a socket, not a regular file"),
        (root.to_owned(), ".", "is a directory, not a regular file"),
        (
            "/dev".into(),
            "null",
            "is a character device, not a regular file",
        ),
        ("/proc/self".into(), "status", "is on procfs"),
    ];
    if Path::new("/sys/kernel/uevent_seqnum").is_file() {
        cases.push(("/sys/kernel".into(), "uevent_seqnum", "is on sysfs"));
    }
    for (root, path, want) in &cases {
        let out = go_quick(root, &cfg, "read_file", json!({"path": path})).await;
        assert!(!out.ok && out.output.contains(want), "{path}: {out:?}");
        let out = go_quick(root, &cfg, "grep", json!({"pattern": "x", "path": path})).await;
        if *path != "." {
            assert!(!out.ok && out.output.contains(want), "grep {path}: {out:?}");
        }
    }
    for path in ["fifo", "sock"] {
        let out = go_quick(
            root,
            &cfg,
            "write_file",
            json!({"path": path, "content": "x"}),
        )
        .await;
        assert!(
            !out.ok && out.output.contains("not a regular file"),
            "{path}: {out:?}"
        );
        let out = go_quick(
            root,
            &cfg,
            "edit",
            json!({"path": path, "old_string": "a", "new_string": "b"}),
        )
        .await;
        assert!(
            !out.ok && out.output.contains("not a regular file"),
            "{path}: {out:?}"
        );
    }
    // A search skips them silently.
    let out = go_quick(root, &cfg, "grep", json!({"pattern": "needle"})).await;
    assert_eq!(out.output, "plain.txt:1: needle\n");
}

#[tokio::test]
async fn read_file_reads_at_most_the_bound() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    // 8 GiB, nearly all of it a hole: reading it whole would exhaust
    // memory.
    let f = std::fs::File::create(root.join("huge.txt")).unwrap();
    (&f).write_all("line\n".repeat(20_000).as_bytes()).unwrap();
    f.set_len(8 << 30).unwrap();
    let cfg = cfg_with_max(4096);
    let out = go_quick(root, &cfg, "read_file", json!({"path": "huge.txt"})).await;
    assert!(out.ok, "{out:?}");
    assert!(out.output.starts_with("line\nline\n"));
    assert!(
        out.output
            .ends_with("\n[output truncated: 8589934592 bytes, showing the first 4096]"),
        "{}",
        &out.output[out.output.len() - 100..]
    );
    let out = go_quick(
        root,
        &cfg,
        "read_file",
        json!({"path": "huge.txt", "offset": 2, "limit": 3}),
    )
    .await;
    assert_eq!(out.output, "line\nline\nline");
    // Lines past the bound are counted, not kept.
    std::fs::write(root.join("many.txt"), "abcdefghi\n".repeat(1000)).unwrap();
    let out = go_quick(
        root,
        &cfg_with_max(25),
        "read_file",
        json!({"path": "many.txt", "offset": 1, "limit": 500}),
    )
    .await;
    assert_eq!(
        out.output,
        "abcdefghi\nabcdefghi\nabcde\n[output truncated: 4999 bytes, showing the first 25]"
    );
    // CRLF files read as lines.
    std::fs::write(root.join("crlf.txt"), "a\r\nb\r\nc\r\n").unwrap();
    let out = go_quick(
        root,
        &cfg,
        "read_file",
        json!({"path": "crlf.txt", "offset": 2}),
    )
    .await;
    assert_eq!(out.output, "b\nc");
    let out = go_quick(
        root,
        &cfg,
        "read_file",
        json!({"path": "/proc/self/status"}),
    )
    .await;
    assert!(!out.ok && out.output.contains("outside"), "{out:?}");
}

#[test]
fn the_line_reader_keeps_at_most_its_cap() {
    // 64 MiB without a newline, then a short line.
    let data = std::io::repeat(b'x')
        .take(64 << 20)
        .chain(&b"\nshort\n"[..]);
    let mut r = BufReader::new(data);
    let mut line = Vec::new();
    assert_eq!(
        read_line_capped(&mut r, &mut line, MAX_LINE).unwrap(),
        Some(64 << 20)
    );
    assert_eq!(line.len(), MAX_LINE);
    assert!(line.capacity() < 2 * MAX_LINE, "{}", line.capacity());
    assert_eq!(
        read_line_capped(&mut r, &mut line, MAX_LINE).unwrap(),
        Some(5)
    );
    assert_eq!(line, b"short");
    assert_eq!(read_line_capped(&mut r, &mut line, MAX_LINE).unwrap(), None);
    // A last line without `\n` still counts.
    let mut r = &b"a\nb"[..];
    assert_eq!(read_line_capped(&mut r, &mut line, 10).unwrap(), Some(1));
    assert_eq!(read_line_capped(&mut r, &mut line, 10).unwrap(), Some(1));
    assert_eq!(line, b"b");
    assert_eq!(read_line_capped(&mut r, &mut line, 10).unwrap(), None);
}

#[tokio::test]
async fn grep_streams_lines_and_skips_binary_files() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    // Line 20002 is 32 MiB long (a hole): it is cut, the lines after it
    // keep their numbers.
    // (Enough text first that the first block has no NUL.)
    let mut f = std::fs::File::create(root.join("long.txt")).unwrap();
    let head = format!("needle one\n{}", "pad\n".repeat(20_000));
    f.write_all(head.as_bytes()).unwrap();
    f.set_len(head.len() as u64 + (32 << 20)).unwrap();
    use std::io::Seek;
    f.seek(std::io::SeekFrom::End(0)).unwrap();
    f.write_all(b"\nneedle two\n").unwrap();
    std::fs::write(root.join("bin.dat"), b"needle\0\x01\x02").unwrap();
    let long_line = format!("{}needle\n", "y".repeat(MAX_LINE + 10));
    std::fs::write(
        root.join("wide.txt"),
        format!("{long_line}{}", "z".repeat(10)),
    )
    .unwrap();
    let cfg = ToolsConfig::default();
    let out = go_quick(
        root,
        &cfg,
        "grep",
        json!({"pattern": "needle", "glob": "long.txt"}),
    )
    .await;
    assert_eq!(
        out.output,
        "long.txt:1: needle one\nlong.txt:20003: needle two\n"
    );
    let out = go_quick(
        root,
        &cfg,
        "grep",
        json!({"pattern": "needle", "glob": "*.dat"}),
    )
    .await;
    assert_eq!(out.output, "no matches");
    // A match past the cap of an over-long line is not seen.
    let out = go_quick(
        root,
        &cfg,
        "grep",
        json!({"pattern": "needle", "path": "wide.txt"}),
    )
    .await;
    assert_eq!(out.output, "no matches");
    let out = go_quick(
        root,
        &cfg,
        "grep",
        json!({"pattern": "^y", "path": "wide.txt"}),
    )
    .await;
    assert!(
        out.output.contains(&format!(
            "[line cut: {} bytes, showing {MAX_LINE}]",
            MAX_LINE + 16
        )),
        "{}",
        &out.output[out.output.len().saturating_sub(200)..]
    );
    // MAX_RESULTS bounds the matches.
    std::fs::write(root.join("many.txt"), "hit\n".repeat(MAX_RESULTS + 5)).unwrap();
    let out = go_quick(
        root,
        &cfg,
        "grep",
        json!({"pattern": "hit", "path": "many.txt"}),
    )
    .await;
    assert_eq!(out.output.lines().count(), MAX_RESULTS + 1);
    assert!(out.output.ends_with("[more matches; narrow the search]\n"));
}

#[tokio::test]
async fn shell_output_is_bounded_head_and_tail() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg_with_max(1000);
    let out = go_quick(
        d.path(),
        &cfg,
        "shell",
        json!({"command": "yes line | head -n 100000"}),
    )
    .await;
    assert!(out.ok, "{}", out.output);
    assert!(out.output.starts_with("line\nline\n"), "{}", out.output);
    assert!(
        out.output.contains("\n[... 499000 bytes cut ...]\n"),
        "{}",
        out.output
    );
    assert!(
        out.output.ends_with("line\nline\n[exit code 0]"),
        "{}",
        out.output
    );
    assert!(out.output.len() < 1100);
    // Both streams, as they come.
    let out = go_quick(
        d.path(),
        &cfg,
        "shell",
        json!({"command": "echo out1; sleep 0.1; echo err1 >&2; sleep 0.1; echo out2"}),
    )
    .await;
    assert_eq!(out.output, "out1\nerr1\nout2\n[exit code 0]");
}

#[tokio::test]
async fn a_timed_out_command_returns_what_it_printed() {
    let d = tempfile::tempdir().unwrap();
    let out = go(
        d.path(),
        "shell",
        json!({"command": "echo before; sleep 5", "timeout_ms": 300}),
    )
    .await;
    assert!(!out.ok, "{out:?}");
    assert_eq!(out.output, "before\n[killed after the 300ms timeout]");
}

#[tokio::test]
async fn a_background_process_holding_stdout_does_not_hang_the_call() {
    let d = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let out = go(
        d.path(),
        "shell",
        json!({"command": "sleep 301 & echo hi", "timeout_ms": 20000}),
    )
    .await;
    assert_eq!(out.output, "hi\n[exit code 0]");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn write_read_edit_list() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let out = go(
        root,
        "write_file",
        json!({"path": "src/a.rs", "content": "fn a() {}\nfn b() {}\nfn a2() {}\n"}),
    )
    .await;
    assert!(out.ok, "{out:?}");
    let out = go(
        root,
        "read_file",
        json!({"path": "src/a.rs", "offset": 2, "limit": 1}),
    )
    .await;
    assert_eq!(out.output, "fn b() {}");
    // Not unique, missing, unique.
    let out = go(
        root,
        "edit",
        json!({"path": "src/a.rs", "old_string": "fn a", "new_string": "fn z"}),
    )
    .await;
    assert!(!out.ok && out.output.contains("occurs 2 times"), "{out:?}");
    let out = go(
        root,
        "edit",
        json!({"path": "src/a.rs", "old_string": "nope", "new_string": "x"}),
    )
    .await;
    assert!(!out.ok && out.output.contains("not found"));
    let out = go(
        root,
        "edit",
        json!({"path": "src/a.rs", "old_string": "fn b", "new_string": "fn bee"}),
    )
    .await;
    assert!(out.ok, "{out:?}");
    let out = go(root, "edit", json!({"path": "src/a.rs", "old_string": "fn a", "new_string": "fn q", "replace_all": true})).await;
    assert!(out.ok && out.output.contains("2 occurrences"), "{out:?}");
    assert_eq!(
        std::fs::read_to_string(root.join("src/a.rs")).unwrap(),
        "fn q() {}\nfn bee() {}\nfn q2() {}\n"
    );
    let out = go(root, "list_dir", json!({})).await;
    assert_eq!(out.output, "src/");
    let out = go(root, "read_file", json!({"path": "missing"})).await;
    assert!(!out.ok && out.output.contains("cannot read"));
}

#[tokio::test]
async fn glob_and_grep_skip_vcs_directories() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    for (p, c) in [
        ("src/main.rs", "fn main() {\n    println!(\"hi\");\n}\n"),
        ("src/lib/util.rs", "pub fn util() {}\n"),
        ("README.md", "fn in docs\n"),
        (".git/config", "fn hidden\n"),
    ] {
        std::fs::create_dir_all(root.join(p).parent().unwrap()).unwrap();
        std::fs::write(root.join(p), c).unwrap();
    }
    let out = go(root, "glob", json!({"pattern": "**/*.rs"})).await;
    assert_eq!(out.output, "src/lib/util.rs\nsrc/main.rs");
    let out = go(root, "grep", json!({"pattern": "^fn ", "glob": "**/*.rs"})).await;
    assert_eq!(out.output, "src/main.rs:1: fn main() {\n");
    let out = go(root, "grep", json!({"pattern": "fn"})).await;
    assert!(!out.output.contains(".git"), "{}", out.output);
    assert_eq!(out.output.lines().count(), 3);
    let out = go(root, "grep", json!({"pattern": "("})).await;
    assert!(!out.ok && out.output.contains("bad regular expression"));
}

#[tokio::test]
async fn shell_runs_in_the_session_directory_with_a_timeout() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let out = go(root, "shell", json!({"command": "pwd; echo err >&2"})).await;
    assert!(out.ok, "{out:?}");
    assert!(
        out.output
            .contains(&root.canonicalize().unwrap().display().to_string())
    );
    assert!(out.output.contains("err") && out.output.contains("[exit code 0]"));
    let out = go(root, "shell", json!({"command": "exit 3"})).await;
    assert!(!out.ok && out.output.contains("exit code 3"));
    // The whole group dies at the timeout: the background sleeper's marker
    // never appears.
    let out = go(
        root,
        "shell",
        json!({"command": "(sleep 1; touch late) & sleep 5", "timeout_ms": 200}),
    )
    .await;
    assert!(!out.ok && out.output.contains("timeout"), "{out:?}");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(!root.join("late").exists(), "a child outlived the timeout");
}

#[tokio::test]
async fn arguments_must_be_an_object() {
    let d = tempfile::tempdir().unwrap();
    let out = go(d.path(), "read_file", json!("{\"path\":")).await;
    assert!(!out.ok && out.output.contains("JSON object"));
    let out = go(d.path(), "read_file", json!({})).await;
    assert!(!out.ok && out.output.contains("missing string argument `path`"));
    let out = go(d.path(), "teleport", json!({})).await;
    assert!(!out.ok && out.output.contains("unknown tool"));
}

/// A client whose "editor buffers" differ from the disk.
#[derive(Default)]
struct Editor {
    files: Mutex<HashMap<PathBuf, String>>,
}

impl Editor {
    /// An editor holding `text` as the buffer of `name` under `root`, and
    /// that buffer's path.
    fn holding(root: &Path, name: &str, text: &str) -> (Arc<Editor>, PathBuf) {
        let editor = Arc::new(Editor::default());
        let path = root.canonicalize().unwrap().join(name);
        editor
            .files
            .lock()
            .unwrap()
            .insert(path.clone(), text.into());
        (editor, path)
    }

    /// Each call run through this editor with the default tools, in order.
    async fn run_all(self: &Arc<Self>, root: &Path, calls: &[(&str, Value)]) -> Vec<ToolOutput> {
        let client: Option<Arc<dyn ClientTools>> = Some(self.clone());
        let mut outs = Vec::new();
        for (name, input) in calls {
            let c = call(name, input.clone());
            outs.push(run(root, &ToolsConfig::default(), &c, client.clone()).await);
        }
        outs
    }
}

impl ClientTools for Editor {
    fn can_read(&self) -> bool {
        true
    }
    fn can_write(&self) -> bool {
        true
    }
    fn can_terminal(&self) -> bool {
        false
    }
    fn read_text_file(&self, path: PathBuf) -> BoxFuture<Result<String, String>> {
        let r = self
            .files
            .lock()
            .unwrap()
            .get(&path)
            .cloned()
            .ok_or_else(|| "no buffer".to_owned());
        Box::pin(async move { r })
    }
    fn write_text_file(&self, path: PathBuf, content: String) -> BoxFuture<Result<(), String>> {
        self.files.lock().unwrap().insert(path, content);
        Box::pin(async { Ok(()) })
    }
    fn run_command(
        &self,
        _: String,
        _: PathBuf,
        _: Duration,
    ) -> BoxFuture<Result<CommandOutput, String>> {
        Box::pin(async { Err("no terminal".into()) })
    }
}

#[tokio::test]
async fn an_editor_client_is_the_truth_for_files() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    std::fs::write(root.join("f.txt"), "on disk").unwrap();
    let (editor, path) = Editor::holding(root, "f.txt", "unsaved buffer");
    let client: Option<Arc<dyn ClientTools>> = Some(editor.clone());
    let cfg = ToolsConfig::default();
    let out = run(
        root,
        &cfg,
        &call("read_file", json!({"path": "f.txt"})),
        client.clone(),
    )
    .await;
    assert_eq!(out.output, "unsaved buffer");
    let out = run(
        root,
        &cfg,
        &call(
            "edit",
            json!({"path": "f.txt", "old_string": "unsaved", "new_string": "edited"}),
        ),
        client.clone(),
    )
    .await;
    assert!(out.ok, "{out:?}");
    assert_eq!(editor.files.lock().unwrap()[&path], "edited buffer");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "on disk");
    // Without terminal support, shell runs locally.
    let out = run(
        root,
        &cfg,
        &call("shell", json!({"command": "cat f.txt"})),
        client,
    )
    .await;
    assert!(out.output.starts_with("on disk"), "{out:?}");
}

/// Runs `name` with each input on a fresh copy of `files`; checks
/// whether it succeeded, what it said, and the files afterwards.
struct Case {
    input: Value,
    ok: bool,
    says: &'static str,
    after: &'static [(&'static str, &'static str)],
}

async fn table(name: &str, files: &[(&str, &str)], cases: Vec<Case>) {
    for (i, c) in cases.into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        for (f, text) in files {
            let p = dir.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let out = go(dir.path(), name, c.input.clone()).await;
        let at = format!("{name} case {i}: {} -> {out:?}", c.input);
        assert_eq!(out.ok, c.ok, "{at}");
        assert!(out.output.contains(c.says), "{at}: wanted {:?}", c.says);
        for (f, want) in c.after {
            let got = std::fs::read_to_string(dir.path().join(f)).ok();
            assert_eq!(got.as_deref(), Some(*want), "{at}: {f}");
        }
    }
}

fn case(
    input: Value,
    ok: bool,
    says: &'static str,
    after: &'static [(&'static str, &'static str)],
) -> Case {
    Case {
        input,
        ok,
        says,
        after,
    }
}

#[tokio::test]
async fn read_file_ranges_and_line_numbers() {
    let files = [("f.txt", "alpha\nbeta\ngamma\n")];
    table(
        "read_file",
        &files,
        vec![
            case(json!({"path": "f.txt"}), true, "alpha\nbeta\ngamma", &[]),
            case(
                json!({"path": "f.txt", "line_numbers": true}),
                true,
                "1\talpha\n2\tbeta\n3\tgamma",
                &[],
            ),
            case(
                json!({"path": "f.txt", "offset": 2, "limit": 1, "line_numbers": true}),
                true,
                "2\tbeta",
                &[],
            ),
            case(json!({"path": "f.txt", "offset": 3}), true, "gamma", &[]),
            case(
                json!({"path": "missing.txt", "line_numbers": true}),
                false,
                "missing.txt",
                &[],
            ),
        ],
    )
    .await;
    // Numbers count from the offset, and nothing past the range is read.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.txt"), "alpha\nbeta\ngamma\n").unwrap();
    let out = go(
        dir.path(),
        "read_file",
        json!({"path": "f.txt", "offset": 2, "line_numbers": true}),
    )
    .await;
    assert_eq!(out.output, "2\tbeta\n3\tgamma");
}

#[tokio::test]
async fn edit_applies_several_replacements_in_order_or_none() {
    let files = [("a.rs", "fn one() {}\nfn two() {}\nfn two() {}\n")];
    table(
        "edit",
        &files,
        vec![
            case(
                json!({"path": "a.rs", "old_string": "one", "new_string": "uno"}),
                true,
                "replaced 1 occurrence",
                &[("a.rs", "fn uno() {}\nfn two() {}\nfn two() {}\n")],
            ),
            case(
                json!({"path": "a.rs", "edits": [
                    {"old_string": "one", "new_string": "three"},
                    {"old_string": "two", "new_string": "deux", "replace_all": true},
                    // Sees the text the edits before it left.
                    {"old_string": "three", "new_string": "trois"}
                ]}),
                true,
                "replaced 4 occurrences",
                &[("a.rs", "fn trois() {}\nfn deux() {}\nfn deux() {}\n")],
            ),
            case(
                json!({"path": "a.rs", "edits": [
                    {"old_string": "one", "new_string": "uno"},
                    {"old_string": "two", "new_string": "deux"}
                ]}),
                false,
                "edit 2 of 2: `old_string` occurs 2 times",
                &[("a.rs", "fn one() {}\nfn two() {}\nfn two() {}\n")],
            ),
            case(
                json!({"path": "a.rs", "edits": [{"old_string": "", "new_string": "x"}]}),
                false,
                "edit 1: `old_string` is empty",
                &[("a.rs", "fn one() {}\nfn two() {}\nfn two() {}\n")],
            ),
            case(
                json!({"path": "a.rs", "edits": []}),
                false,
                "non-empty array",
                &[],
            ),
            case(
                json!({"path": "a.rs"}),
                false,
                "missing string argument `old_string`",
                &[],
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn apply_patch_changes_every_file_or_none() {
    let files = [("src/a.txt", "one\ntwo\nthree\n"), ("b.txt", "x\n")];
    table(
        "apply_patch",
        &files,
        vec![
            case(
                json!({"patch": "--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n"}),
                true,
                "patched src/a.txt (1 hunk)",
                &[("src/a.txt", "one\n2\nthree\n")],
            ),
            case(
                json!({"patch": "diff --git a/b.txt b/b.txt\nindex 1..2 100644\n--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-x\n+y\ndiff --git a/new.txt b/new.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1,2 @@\n+hello\n+world\n"}),
                true,
                "patched b.txt (1 hunk), new.txt (1 hunk)",
                &[("b.txt", "y\n"), ("new.txt", "hello\nworld\n")],
            ),
            // The second file does not apply: the first is not changed.
            case(
                json!({"patch": "--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-x\n+y\n--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,2 +1,2 @@\n one\n-TWO\n+2\n"}),
                false,
                "does not apply to src/a.txt",
                &[("b.txt", "x\n"), ("src/a.txt", "one\ntwo\nthree\n")],
            ),
            case(
                json!({"patch": "--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+z\n"}),
                false,
                "creates b.txt, which exists",
                &[("b.txt", "x\n")],
            ),
            case(
                json!({"patch": "--- a/b.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"}),
                false,
                "does not delete files",
                &[("b.txt", "x\n")],
            ),
            case(json!({"patch": "just words"}), false, "no file header", &[]),
            case(
                json!({"patch": "--- a/../escape.txt\n+++ b/../escape.txt\n@@ -0,0 +1 @@\n+z\n"}),
                false,
                "outside",
                &[],
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn todo_checks_the_plan() {
    table(
        "todo",
        &[],
        vec![
            case(
                json!({"todos": [
                    {"content": "read the code", "status": "completed"},
                    {"content": "fix it", "status": "in_progress"},
                    {"content": "run the tests", "status": "pending"}
                ]}),
                true,
                "plan updated: 3 items, 1 completed",
                &[],
            ),
            case(
                json!({"todos": [{"content": "x", "status": "done"}]}),
                false,
                "todo 1: `status` must be",
                &[],
            ),
            case(
                json!({"todos": [{"content": " ", "status": "pending"}]}),
                false,
                "todo 1: `content` is missing",
                &[],
            ),
            case(json!({}), false, "missing array argument `todos`", &[]),
        ],
    )
    .await;
}

#[tokio::test]
async fn shell_runs_in_a_cwd_inside_the_roots_only() {
    let outer = tempfile::tempdir().unwrap();
    let root = outer.path().join("proj");
    std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
    std::fs::write(root.join("file"), "x").unwrap();
    std::os::unix::fs::symlink(outer.path(), root.join("up")).unwrap();
    let real = root.canonicalize().unwrap();
    let cases: &[(&str, bool, String)] = &[
        ("sub", true, real.join("sub").display().to_string()),
        (
            "sub/deeper",
            true,
            real.join("sub/deeper").display().to_string(),
        ),
        (".", true, real.display().to_string()),
        ("..", false, "outside".into()),
        ("up", false, "outside".into()),
        ("file", false, "not a directory".into()),
        ("nope", false, "nope".into()),
    ];
    for (cwd, ok, says) in cases {
        let out = go(&root, "shell", json!({"command": "pwd", "cwd": cwd})).await;
        assert_eq!(out.ok, *ok, "{cwd}: {out:?}");
        assert!(out.output.contains(says.as_str()), "{cwd}: {out:?}");
    }
}

#[test]
fn every_builtin_tool_has_an_object_schema() {
    let specs = builtin_specs();
    for name in [
        "read_file",
        "write_file",
        "edit",
        "apply_patch",
        "todo",
        "list_dir",
        "glob",
        "grep",
        "shell",
    ] {
        let s = specs
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} offered"));
        assert_eq!(s.input_schema["type"], "object", "{name}");
        assert!(!s.description.is_empty(), "{name}");
    }
}

/// A server answering by path, one request per connection.
async fn tiny_http() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = req.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (status, kind, extra, body) = match path.as_str() {
                    "/text" => ("200 OK", "text/plain", "", "hello from the page".to_owned()),
                    "/big" => ("200 OK", "text/plain", "", "y".repeat(200_000)),
                    "/bin" => ("200 OK", "application/octet-stream", "", "\0\0".to_owned()),
                    "/gone" => ("404 Not Found", "text/plain", "", "no such page".to_owned()),
                    _ => (
                        "302 Found",
                        "text/plain",
                        "location: http://169.254.169.254/secret\r\n",
                        String::new(),
                    ),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn web_fetch_reads_allowed_hosts_only() {
    let base = tiny_http().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let on = ToolsConfig {
        web_fetch: crate::egress::Policy::new(&["127.0.0.1".to_owned()])
            .unwrap()
            .for_setting("tools.web_fetch_hosts"),
        ..ToolsConfig::default()
    };
    let off = ToolsConfig::default();
    let cases: Vec<(&ToolsConfig, String, bool, &str)> = vec![
        (
            &on,
            format!("{base}/text"),
            true,
            "HTTP 200 text/plain\n\nhello from the page",
        ),
        (&on, format!("{base}/gone"), false, "HTTP 404"),
        (&on, format!("{base}/bin"), false, "not text"),
        (
            &on,
            format!("{base}/redirect"),
            false,
            "redirects (302 Found) to http://169.254.169.254/secret",
        ),
        (
            &on,
            format!("{base}/big"),
            true,
            "[output truncated: 200000 bytes",
        ),
        (
            &on,
            "http://example.com/".into(),
            false,
            "tools.web_fetch_hosts",
        ),
        (
            &on,
            "file:///etc/passwd".into(),
            false,
            "only http and https",
        ),
        (&off, format!("{base}/text"), false, "web_fetch is off"),
        // Nothing listens there: the error says why, and never the query.
        (
            &on,
            format!("http://{closed}/page?token=hunter22"),
            false,
            "Connection refused",
        ),
    ];
    for (cfg, url, ok, says) in cases {
        let out = run(
            dir.path(),
            cfg,
            &call("web_fetch", json!({"url": url})),
            None,
        )
        .await;
        assert_eq!(out.ok, ok, "{url}: {out:?}");
        assert!(
            out.output.contains(says),
            "{url}: wanted {says:?} in {:?}",
            &out.output[..out.output.len().min(300)]
        );
        assert!(
            out.output.len() <= cfg.max_output_bytes + 200,
            "{url}: bounded"
        );
        assert!(!out.output.contains("hunter22"), "{url}: {}", out.output);
    }
}

#[test]
fn web_fetch_is_offered_only_when_a_host_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let offered = |cfg: ToolsConfig| {
        crate::Toolbox::new(dir.path().to_owned(), Arc::new(cfg))
            .specs()
            .iter()
            .any(|s| s.name == "web_fetch")
    };
    assert!(!offered(ToolsConfig::default()));
    assert!(offered(ToolsConfig {
        web_fetch: crate::egress::Policy::new(&["docs.rs".to_owned()]).unwrap(),
        ..ToolsConfig::default()
    }));
}

async fn tool(tb: &crate::Toolbox, name: &str, input: Value) -> ToolOutput {
    tb.run(&call(name, input), None).await
}

/// Whether the process whose pid the command wrote to `file` is alive.
fn alive(file: &Path) -> bool {
    let pid = std::fs::read_to_string(file).unwrap();
    Path::new(&format!("/proc/{}", pid.trim())).exists()
}

async fn until_gone(file: &Path) -> bool {
    for _ in 0..200 {
        if !alive(file) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn until_file(file: &Path) {
    for _ in 0..200 {
        if std::fs::read_to_string(file).is_ok_and(|s| s.ends_with('\n')) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} never written", file.display());
}

#[tokio::test]
async fn background_commands_are_read_later_stopped_and_die_with_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let tb = crate::Toolbox::new(dir.path().to_owned(), Arc::new(ToolsConfig::default()));
    assert!(!tb.has_jobs());
    // Started: the call returns at once; the output is read later.
    let out = tool(
        &tb,
        "shell",
        json!({"command": "echo one; sleep 0.3; echo two", "background": true}),
    )
    .await;
    assert!(
        out.ok && out.output.contains("started background command 1"),
        "{out:?}"
    );
    let mut last = String::new();
    for _ in 0..200 {
        last = tool(&tb, "shell_output", json!({"id": 1})).await.output;
        if last.ends_with("[exit code 0]") {
            break;
        }
        assert!(last.ends_with("[running]"), "{last}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        last,
        "$ echo one; sleep 0.3; echo two\none\ntwo\n[exit code 0]"
    );
    // Ended, its output is still readable: the session keeps its tools
    // (it does not park).
    assert!(tb.has_jobs());

    // Stopped on request, with what it started.
    let out = tool(
        &tb,
        "shell",
        json!({"command": "sh -c 'echo $$ > pid; exec sleep 100' & wait", "background": true}),
    )
    .await;
    assert!(out.output.contains("command 2"), "{out:?}");
    until_file(&dir.path().join("pid")).await;
    let out = tool(&tb, "shell_output", json!({"id": 2, "stop": true})).await;
    assert!(out.ok && out.output.ends_with("[stopped]"), "{out:?}");
    assert!(
        until_gone(&dir.path().join("pid")).await,
        "stopped command killed"
    );

    // Bad ids and arguments are errors the model can read.
    let table: &[(&str, Value, &str)] = &[
        (
            "shell_output",
            json!({"id": 99}),
            "no background command 99; known: 1, 2",
        ),
        ("shell_output", json!({}), "missing integer argument `id`"),
        (
            "shell",
            json!({"background": true}),
            "missing string argument `command`",
        ),
        (
            "shell",
            json!({"command": "true", "background": true, "cwd": ".."}),
            "outside",
        ),
    ];
    for (name, input, says) in table {
        let out = tool(&tb, name, input.clone()).await;
        assert!(!out.ok && out.output.contains(says), "{input}: {out:?}");
    }

    // A command still running when the session's tools go away dies.
    let out = tool(
        &tb,
        "shell",
        json!({"command": "sh -c 'echo $$ > pid2; exec sleep 100' & wait", "background": true}),
    )
    .await;
    assert!(out.ok, "{out:?}");
    until_file(&dir.path().join("pid2")).await;
    drop(tb);
    assert!(
        until_gone(&dir.path().join("pid2")).await,
        "killed with the session"
    );
}

#[tokio::test]
async fn at_most_a_bounded_number_of_background_commands_run() {
    let dir = tempfile::tempdir().unwrap();
    let tb = crate::Toolbox::new(dir.path().to_owned(), Arc::new(ToolsConfig::default()));
    for _ in 0..crate::shell::MAX_JOBS {
        let out = tool(
            &tb,
            "shell",
            json!({"command": "sleep 30", "background": true}),
        )
        .await;
        assert!(out.ok, "{out:?}");
    }
    let out = tool(
        &tb,
        "shell",
        json!({"command": "sleep 30", "background": true}),
    )
    .await;
    assert!(
        !out.ok && out.output.contains("background commands are running"),
        "{out:?}"
    );
    // A stopped one makes room.
    assert!(
        tool(&tb, "shell_output", json!({"id": 1, "stop": true}))
            .await
            .ok
    );
    let out = tool(&tb, "shell", json!({"command": "true", "background": true})).await;
    assert!(out.ok && out.output.contains("command 9"), "{out:?}");
}

/// A write through a dangling link (or a chain of them) into `.git` is
/// refused before the open would create its target there (an empty
/// `index.lock` stops every git command; a hook runs).
#[tokio::test]
async fn a_dangling_link_into_a_repository_s_own_directory_creates_nothing_there() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join(".git/hooks")).unwrap();
    // An empty `.git/index.lock` stops every git command; a hook runs.
    std::os::unix::fs::symlink(".git/index.lock", root.join("lock")).unwrap();
    std::os::unix::fs::symlink(".git/hooks/post-checkout", root.join("patched")).unwrap();
    std::os::unix::fs::symlink("hop", root.join("chain")).unwrap();
    std::os::unix::fs::symlink(".git/hooks/pre-push", root.join("hop")).unwrap();
    std::os::unix::fs::symlink(root.join(".git/hooks/post-merge"), root.join("abs")).unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::os::unix::fs::symlink("../.git/hooks/pre-commit", root.join("sub/up")).unwrap();
    std::os::unix::fs::symlink(".git", root.join("g")).unwrap();
    // As many links as the kernel follows, the last into `.git`.
    for i in 0..40 {
        let to = if i == 39 {
            ".git/hooks/post-rewrite".to_owned()
        } else {
            format!("l{:02}", i + 1)
        };
        std::os::unix::fs::symlink(to, root.join(format!("l{i:02}"))).unwrap();
    }
    for (name, input) in [
        (
            "write_file",
            json!({"path": "l00", "content": "#!/bin/sh\nevil\n"}),
        ),
        ("write_file", json!({"path": "lock", "content": ""})),
        (
            "write_file",
            json!({"path": "chain", "content": "#!/bin/sh\nevil\n"}),
        ),
        (
            "write_file",
            json!({"path": "sub/up", "content": "#!/bin/sh\nevil\n"}),
        ),
        (
            "apply_patch",
            json!({"patch": "--- /dev/null\n+++ b/patched\n@@ -0,0 +1 @@\n+x\n"}),
        ),
    ] {
        let out = go(&root, name, input.clone()).await;
        assert!(!out.ok, "{name} {input}: {}", out.output);
        assert!(out.output.contains(".git"), "{name}: {}", out.output);
    }
    // A link with an absolute target is never followed; a `..` after a
    // directory that does not exist is refused (creating the parents
    // would make it resolvable).
    for path in ["abs", "nd/../lock", "nd/../g/hooks/pre-rebase"] {
        let out = go(&root, "write_file", json!({"path": path, "content": "x"})).await;
        assert!(!out.ok, "{path}: {}", out.output);
    }
    assert!(
        !root.join("nd").exists(),
        "a parent made for a refused write"
    );
    let made: Vec<_> = [
        "index.lock",
        "hooks/post-rewrite",
        "hooks/pre-rebase",
        "hooks/post-checkout",
        "hooks/pre-push",
        "hooks/post-merge",
        "hooks/pre-commit",
    ]
    .into_iter()
    .filter(|f| root.join(".git").join(f).exists())
    .collect();
    assert!(made.is_empty(), "created in .git: {made:?}");
    // A dangling link elsewhere inside still creates its target.
    std::os::unix::fs::symlink("sub/new.txt", root.join("fresh")).unwrap();
    let out = go(
        &root,
        "write_file",
        json!({"path": "fresh", "content": "x"}),
    )
    .await;
    assert!(out.ok, "{}", out.output);
    assert_eq!(
        std::fs::read_to_string(root.join("sub/new.txt")).unwrap(),
        "x"
    );
}

/// A repository's own directory (`.git`) holds what git runs (its config's
/// `core.fsmonitor`, its hooks): the file tools do not write there, by any
/// name (a link to it too), so an edit the permission mode lets through
/// cannot become a command the next `git status` runs.
#[tokio::test]
async fn the_file_tools_do_not_write_into_a_repository_s_own_directory() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join(".git/hooks")).unwrap();
    std::fs::write(root.join(".git/config"), "[core]\n").unwrap();
    std::os::unix::fs::symlink(".git", root.join("g")).unwrap();
    for (name, input) in [
        (
            "write_file",
            json!({"path": ".git/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "write_file",
            json!({"path": ".git/hooks/pre-commit", "content": "#!/bin/sh\nevil\n"}),
        ),
        (
            "write_file",
            json!({"path": "g/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "edit",
            json!({"path": ".git/config", "old_string": "[core]", "new_string": "[core]\n\tfsmonitor = evil"}),
        ),
        (
            "apply_patch",
            json!({"patch": "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+evil\n"}),
        ),
        // On a case-insensitive file system `.GIT` is `.git`: refused by
        // any case, everywhere.
        (
            "write_file",
            json!({"path": ".GIT/hooks/pre-commit", "content": "#!/bin/sh\nevil\n"}),
        ),
        (
            "write_file",
            json!({"path": "sub/.Git/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        // Other names of `.git` where the file system has them: a FAT or
        // SMB short name, trailing dots and spaces (FAT drops them), code
        // points HFS+ ignores.
        (
            "write_file",
            json!({"path": "GIT~1/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "write_file",
            json!({"path": ".git. ./config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "write_file",
            json!({"path": ".g\u{200c}it/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "write_file",
            json!({"path": ".gi\u{200b}t/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
    ] {
        let out = go(root, name, input.clone()).await;
        assert!(!out.ok, "{name} {input}: {}", out.output);
        assert!(out.output.contains(".git"), "{name}: {}", out.output);
    }
    assert_eq!(
        std::fs::read_to_string(root.join(".git/config")).unwrap(),
        "[core]\n"
    );
    assert!(!root.join(".git/hooks/pre-commit").exists());
    assert!(!root.join(".git/hooks/post-checkout").exists());
    for made in [
        ".GIT",
        "sub",
        "GIT~1",
        ".git. ",
        ".g\u{200c}it",
        ".gi\u{200b}t",
    ] {
        assert!(!root.join(made).exists(), "{made}");
    }
    // Elsewhere in the repository, as before.
    assert!(
        go(
            root,
            "write_file",
            json!({"path": "src/a.txt", "content": "x"})
        )
        .await
        .ok
    );
    // Nor through an attached editor, whichever tool writes.
    let (editor, config) = Editor::holding(root, ".git/config", "[core]\n");
    let calls = [
        (
            "write_file",
            json!({"path": ".git/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "edit",
            json!({"path": ".git/config", "old_string": "[core]", "new_string": "[core]\n\tfsmonitor = evil"}),
        ),
        (
            "apply_patch",
            json!({"patch": "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+evil\n"}),
        ),
    ];
    for ((name, input), out) in calls.iter().zip(editor.run_all(root, &calls).await) {
        assert!(!out.ok, "{name} {input} through the editor: {}", out.output);
    }
    assert_eq!(editor.files.lock().unwrap()[&config], "[core]\n");
    assert_eq!(editor.files.lock().unwrap().len(), 1);
}

/// A file with another name (a hard link, as an archive can carry) may be
/// `.git/config` under a harmless name: the file tools do not write
/// through it, locally or through an editor, and a hosted agent's edit of
/// it weighs as a command. A file with one name is written as before.
#[tokio::test]
async fn the_file_tools_do_not_write_through_a_hard_link() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join(".git")).unwrap();
    std::fs::write(root.join(".git/config"), "[core]\n").unwrap();
    std::fs::hard_link(root.join(".git/config"), root.join("notes.txt")).unwrap();
    let evil = "[core]\n\tfsmonitor = evil\n";
    let calls = [
        ("write_file", json!({"path": "notes.txt", "content": evil})),
        (
            "edit",
            json!({"path": "notes.txt", "old_string": "[core]", "new_string": "[core]\n\tfsmonitor = evil"}),
        ),
        (
            "apply_patch",
            json!({"patch": "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1,2 @@\n [core]\n+\tfsmonitor = evil\n"}),
        ),
    ];
    for (name, input) in &calls {
        let out = go(root, name, input.clone()).await;
        assert!(!out.ok, "{name}: {}", out.output);
        assert!(out.output.contains("hard link"), "{name}: {}", out.output);
    }
    assert_eq!(
        std::fs::read_to_string(root.join(".git/config")).unwrap(),
        "[core]\n"
    );
    let (editor, notes) = Editor::holding(root, "notes.txt", "[core]\n");
    for ((name, _), out) in calls.iter().zip(editor.run_all(root, &calls).await) {
        assert!(!out.ok, "{name} through the editor: {}", out.output);
    }
    assert_eq!(editor.files.lock().unwrap()[&notes], "[core]\n");
    assert!(lands_in_git_dir(root, Path::new("notes.txt")));
    // Named with a trailing `/` or `/.` (which an agent's own write drops:
    // resolving it fails with "not a directory", not "not found").
    std::os::unix::fs::symlink(".git/config", root.join("cfg")).unwrap();
    for p in ["notes.txt/", "notes.txt/.", "cfg/", "cfg/.", "notes.txt/x"] {
        assert!(lands_in_git_dir(root, Path::new(p)), "{p}");
    }
    std::fs::remove_file(root.join("cfg")).unwrap();
    // Read as before; written once it has one name again.
    assert!(go(root, "read_file", json!({"path": "notes.txt"})).await.ok);
    std::fs::remove_file(root.join(".git/config")).unwrap();
    assert!(!lands_in_git_dir(root, Path::new("notes.txt")));
    let out = go(
        root,
        "write_file",
        json!({"path": "notes.txt", "content": "mine"}),
    )
    .await;
    assert!(out.ok, "{}", out.output);
}

/// A hard link to the daemon's own data (its token) in a session's
/// directory is the daemon's data by either name: neither read nor found
/// by grep. (The only test in this binary that protects anything: the
/// first call wins, and it names a directory of its own.)
#[tokio::test]
async fn a_hard_link_to_the_daemon_s_data_is_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let root = dir.path().join("session");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    std::fs::create_dir_all(&root).unwrap();
    let token = "token-7f3a-SECRET";
    std::fs::write(data.join("sub/token"), token).unwrap();
    std::fs::hard_link(data.join("sub/token"), root.join("tok.txt")).unwrap();
    std::fs::write(root.join("mine.txt"), "mine").unwrap();
    std::fs::hard_link(root.join("mine.txt"), root.join("also-mine.txt")).unwrap();
    protect(std::slice::from_ref(&data));
    let out = go(&root, "read_file", json!({"path": "tok.txt"})).await;
    assert!(
        !out.ok && out.output.contains("daemon's own data"),
        "{}",
        out.output
    );
    let out = go(&root, "grep", json!({"pattern": "SECRET"})).await;
    assert!(!out.output.contains(token), "{}", out.output);
    // Nor through an editor, which would read it by its other name.
    let (editor, _) = Editor::holding(&root, "tok.txt", token);
    let read = [("read_file", json!({"path": "tok.txt"}))];
    let out = editor.run_all(&root, &read).await.remove(0);
    assert!(
        !out.ok && out.output.contains("daemon's own data"),
        "{}",
        out.output
    );
    // Hard links among the session's own files are read as before.
    let out = go(&root, "read_file", json!({"path": "also-mine.txt"})).await;
    assert!(out.ok && out.output.contains("mine"), "{}", out.output);
}

/// A patch whose later file is refused (a hard link, a name in `.git`)
/// changes none of its files, as the tool promises: the first was written
/// before the second was refused.
#[tokio::test]
async fn a_patch_with_a_refused_file_changes_none() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join(".git")).unwrap();
    std::fs::write(root.join(".git/config"), "[core]\n").unwrap();
    std::fs::hard_link(root.join(".git/config"), root.join("notes.txt")).unwrap();
    std::fs::write(root.join("a.txt"), "one\n").unwrap();
    let first = "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-one\n+two\n";
    for second in [
        "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1,2 @@\n [core]\n+\tfsmonitor = evil\n",
        "--- /dev/null\n+++ b/.git/hooks/pre-commit\n@@ -0,0 +1 @@\n+evil\n",
    ] {
        let out = go(
            root,
            "apply_patch",
            json!({"patch": format!("{first}{second}")}),
        )
        .await;
        assert!(!out.ok, "{}", out.output);
        assert_eq!(
            std::fs::read_to_string(root.join("a.txt")).unwrap(),
            "one\n",
            "{second}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(root.join(".git/config")).unwrap(),
        "[core]\n"
    );
    assert!(!root.join(".git/hooks").exists());
}

/// A patch that creates a file refuses one that exists, whatever it holds:
/// a binary, non-UTF-8 or large file the tools cannot read as text is not
/// taken for a missing one (it was emptied and shown as new).
#[tokio::test]
async fn a_patch_creating_a_file_never_overwrites_one_that_exists() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let bytes = vec![0u8, 159, 146, 150, 0, 1, 2];
    std::fs::write(root.join("blob.bin"), &bytes).unwrap();
    let out = go(
        root,
        "apply_patch",
        json!({"patch": "--- /dev/null\n+++ b/blob.bin\n@@ -0,0 +1 @@\n+text\n"}),
    )
    .await;
    assert!(!out.ok, "{}", out.output);
    assert!(out.output.contains("exists"), "{}", out.output);
    assert_eq!(std::fs::read(root.join("blob.bin")).unwrap(), bytes);
    // A file that does not exist is created, as before.
    let out = go(
        root,
        "apply_patch",
        json!({"patch": "--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+text\n"}),
    )
    .await;
    assert!(out.ok, "{}", out.output);
    assert_eq!(
        std::fs::read_to_string(root.join("new.txt")).unwrap(),
        "text\n"
    );
}

/// A search over a large tree stops at the command bound
/// (`tools.shell_timeout`) and says so, instead of walking on after its
/// turn ended; here the bound has passed before the first file.
#[tokio::test]
async fn a_search_stops_at_the_command_bound_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("d")).unwrap();
    std::fs::write(dir.path().join("d/a.txt"), "needle\n").unwrap();
    let spent = ToolsConfig {
        shell_timeout: Duration::ZERO,
        ..ToolsConfig::default()
    };
    // A tree of directories only stops too (no file to look at).
    std::fs::create_dir_all(dir.path().join("dirs/x/y")).unwrap();
    for (name, input) in [
        ("grep", json!({"pattern": "needle", "path": "dirs"})),
        ("glob", json!({"pattern": "**/*.txt", "path": "dirs"})),
    ] {
        let out = run(dir.path(), &spent, &call(name, input.clone()), None).await;
        assert!(
            out.output.contains("stopped after"),
            "{name}: {}",
            out.output
        );
    }
    for (name, input) in [
        ("grep", json!({"pattern": "needle"})),
        ("glob", json!({"pattern": "**/*.txt"})),
    ] {
        let out = run(dir.path(), &spent, &call(name, input.clone()), None).await;
        assert!(
            out.output.contains("stopped after"),
            "{name}: {}",
            out.output
        );
        assert!(
            out.output.contains("tools.shell_timeout"),
            "{name}: {}",
            out.output
        );
        // With time to spare it finds the file, whatever the bound.
        let unbounded = ToolsConfig {
            shell_timeout: Duration::MAX,
            ..ToolsConfig::default()
        };
        for cfg in [&ToolsConfig::default(), &unbounded] {
            let out = run(dir.path(), cfg, &call(name, input.clone()), None).await;
            assert!(
                out.ok && out.output.contains("a.txt"),
                "{name}: {}",
                out.output
            );
            assert!(!out.output.contains("stopped"), "{name}: {}", out.output);
        }
    }
}

/// `read_file` with an offset reads the file's lines up to it: on a huge
/// file that was unbounded, on a blocking thread going on after its turn.
/// It stops at the command bound too, with what it read and a note.
#[tokio::test]
async fn a_read_by_lines_stops_at_the_command_bound_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.txt"), "one\ntwo\nthree\n").unwrap();
    let spent = ToolsConfig {
        shell_timeout: Duration::ZERO,
        ..ToolsConfig::default()
    };
    let input = json!({"path": "f.txt", "offset": 2, "limit": 1});
    let out = run(dir.path(), &spent, &call("read_file", input.clone()), None).await;
    assert!(out.output.contains("stopped after"), "{}", out.output);
    assert!(out.output.contains("tools.shell_timeout"), "{}", out.output);
    assert!(!out.output.contains("two"), "{}", out.output);
    let out = run(
        dir.path(),
        &ToolsConfig::default(),
        &call("read_file", input),
        None,
    )
    .await;
    assert_eq!(out.output, "two");
    // The whole file is read up to `max_output_bytes`, whatever the bound.
    let whole = call("read_file", json!({"path": "f.txt"}));
    let out = run(dir.path(), &spent, &whole, None).await;
    assert_eq!(out.output, "one\ntwo\nthree\n");
}

/// A search looks at the bound while it reads a file, not only between
/// lines: a single line of gigabytes (no newline) stops too.
#[test]
fn a_search_stops_inside_a_huge_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut line = vec![b'x'; 4 << 20];
    line.extend_from_slice(b"needle\n");
    std::fs::write(dir.path().join("big.txt"), &line).unwrap();
    let root =
        cap_std::fs::Dir::open_ambient_dir(dir.path(), cap_std::ambient_authority()).unwrap();
    let file = root.open("big.txt").unwrap();
    let spent = ToolsConfig {
        shell_timeout: Duration::ZERO,
        ..ToolsConfig::default()
    };
    let mut m = Matches {
        out: String::new(),
        n: 0,
        max: 1 << 20,
        deadline: Deadline::of(&spent),
        stopped: false,
    };
    let re = regex::bytes::Regex::new("needle").unwrap();
    let flow = grep_file(file, Path::new("big.txt"), &re, &mut m);
    assert!(flow.is_break(), "{}", m.out);
    assert_eq!(m.n, 0, "{}", m.out);
    assert!(m.out.contains("stopped after"), "{}", m.out);
}

/// A person allowing `write_file` sees what it replaces: a file whose text
/// is not shown (binary, too long) is said to be there, never shown as a
/// new file; a file that is not there is new.
#[test]
fn a_write_over_a_file_not_shown_is_never_shown_as_a_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let tb = crate::Toolbox::new(dir.path().to_owned(), Arc::new(ToolsConfig::default()));
    std::fs::write(dir.path().join("text.txt"), "before\n").unwrap();
    std::fs::write(dir.path().join("image.bin"), b"\x89PNG\0\0\x01").unwrap();
    std::fs::write(dir.path().join("big.txt"), "x".repeat(300 * 1024)).unwrap();
    let old = |path: &str| {
        tb.diff("write_file", &json!({"path": path, "content": "after\n"}))
            .expect("a diff")
            .old_text
    };
    assert_eq!(old("text.txt").as_deref(), Some("before\n"));
    assert_eq!(old("new.txt"), None);
    for (path, bytes) in [("image.bin", 7), ("big.txt", 300 * 1024)] {
        let shown = old(path).unwrap_or_else(|| panic!("{path} shown as a new file"));
        assert!(shown.contains(&format!("{bytes} bytes")), "{path}: {shown}");
    }
    // A link out of the session's directory: nothing of what it names is
    // told (its size was), and it is not shown as a new file either.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "s".repeat(12345)).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("out")).unwrap();
    let shown = old("out").expect("not a new file");
    assert!(!shown.contains("12345"), "{shown}");
}
