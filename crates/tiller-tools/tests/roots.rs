//! Additional roots (ACP `additionalDirectories`): an absolute path inside
//! one of them works there, confined like the session's directory;
//! anything else stays where it was.

mod common;

use std::sync::Arc;

use common::call;
use serde_json::json;
use tiller_engine::ToolCall;
use tiller_tools::{Toolbox, ToolsConfig};

#[tokio::test]
async fn absolute_paths_in_an_additional_root_work_there_and_nowhere_else() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (cwd, lib, other) = (base.join("cwd"), base.join("lib"), base.join("other"));
    for d in [&cwd, &lib, &other] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(cwd.join("a.txt"), "in cwd\n").unwrap();
    std::fs::write(lib.join("b.txt"), "in lib\n").unwrap();
    std::fs::write(other.join("c.txt"), "secret\n").unwrap();
    std::os::unix::fs::symlink(&other, lib.join("escape")).unwrap();
    let tools =
        Toolbox::new(cwd.clone(), Arc::new(ToolsConfig::default())).with_roots(vec![lib.clone()]);
    let read = |p: String| call("read_file", json!({ "path": p }));
    let run = |c: ToolCall| {
        let t = tools.clone();
        async move { t.run(&c, None).await }
    };

    let out = run(read("a.txt".into())).await;
    assert!(out.ok && out.output.contains("in cwd"), "{}", out.output);
    let out = run(read(lib.join("b.txt").display().to_string())).await;
    assert!(out.ok && out.output.contains("in lib"), "{}", out.output);
    // Relative paths stay in the session's directory: `..` cannot reach lib.
    assert!(!run(read("../lib/b.txt".into())).await.ok);
    // Outside every root, and through a link out of a root: refused.
    assert!(
        !run(read(other.join("c.txt").display().to_string()))
            .await
            .ok
    );
    let through = run(read(lib.join("escape/c.txt").display().to_string())).await;
    assert!(
        !through.ok && !through.output.contains("secret"),
        "{}",
        through.output
    );
    // Writes land in the root they name, and the call shows where.
    let target = lib.join("new.txt");
    let w = call(
        "write_file",
        json!({ "path": target.display().to_string(), "content": "x" }),
    );
    assert_eq!(
        tools.locations("write_file", &w.input),
        vec![target.display().to_string()]
    );
    assert!(run(w).await.ok);
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "x");
    // Without the root, the same path is refused.
    let plain = Toolbox::new(cwd, Arc::new(ToolsConfig::default()));
    assert!(
        !plain
            .run(&read(lib.join("b.txt").display().to_string()), None)
            .await
            .ok
    );
}

/// A shell's directory comes from its `cwd` only: a `path` naming another
/// root does not move it there (an "always" rule, which looks at `cwd`,
/// would have covered `npm test` run in another project).
#[tokio::test]
async fn a_shell_runs_where_its_cwd_says_never_where_a_path_says() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (cwd, lib) = (base.join("cwd"), base.join("lib"));
    for d in [&cwd, &lib] {
        std::fs::create_dir_all(d).unwrap();
    }
    let tools =
        Toolbox::new(cwd.clone(), Arc::new(ToolsConfig::default())).with_roots(vec![lib.clone()]);
    for background in [false, true] {
        let c = call(
            "shell",
            json!({ "command": "pwd; sleep 0.2", "path": lib.join("x").display().to_string(), "background": background }),
        );
        let mut out = tools.run(&c, None).await.output;
        if background {
            let id: u64 = out
                .split(|ch: char| !ch.is_ascii_digit())
                .find(|w| !w.is_empty())
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("a job id in {out}"));
            tokio::time::sleep(std::time::Duration::from_millis(600)).await;
            out = tools
                .run(&call("shell_output", json!({ "id": id })), None)
                .await
                .output;
        }
        assert!(out.contains(&cwd.display().to_string()), "{out}");
        assert!(!out.contains(&lib.display().to_string()), "{out}");
    }
}
