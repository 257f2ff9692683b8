use std::collections::HashMap;
use std::sync::Mutex;

use super::*;
use crate::BoxFuture;

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
    for bad in [
        "../secret",
        "/etc/passwd",
        "up/secret",
        "a/../../secret",
        "up/new-file",
    ] {
        let e = resolve(&root, bad).unwrap_err();
        assert!(e.contains("outside"), "{bad}: {e}");
    }
    let real_root = root.canonicalize().unwrap();
    assert_eq!(
        resolve(&root, "a/../b.txt").unwrap(),
        real_root.join("b.txt")
    );
    assert_eq!(
        resolve(&root, "new/dir/f").unwrap(),
        real_root.join("new/dir/f")
    );
    let out = go(&root, "read_file", json!({"path": "../secret"})).await;
    assert!(!out.ok && out.output.contains("outside"), "{out:?}");
    let out = go(
        &root,
        "write_file",
        json!({"path": "up/x", "content": "no"}),
    )
    .await;
    assert!(!out.ok);
    assert!(!outer.path().join("x").exists());
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
    let editor = Arc::new(Editor::default());
    let path = root.canonicalize().unwrap().join("f.txt");
    editor
        .files
        .lock()
        .unwrap()
        .insert(path.clone(), "unsaved buffer".into());
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
