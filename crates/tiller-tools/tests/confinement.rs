//! Hostile paths and link layouts against every file tool: each call
//! either works (inside the session's directory) or fails with a clear
//! error, and nothing outside the directory is created or changed.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::symlink;
use std::path::Path;

use common::run;
use serde_json::{Value, json};
use tiller_tools::ToolsConfig;

/// What a call must do.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Succeed.
    Ok,
    /// Fail, saying the path leads outside the session's directory.
    Out,
    /// Fail, saying this.
    Fail(&'static str),
    /// Not tried (writing to a real system file is not a test to risk).
    Skip,
}
use Expect::{Fail, Ok, Out, Skip};

const OUT_MSG: &str = "outside the session's directory";
const NOT_DIR: &str = "is not a directory";
const MISSING: &str = "does not exist";

/// Builds the layout: `outer/{secret, outside_dir/f}` and the session's
/// directory `outer/proj` with files, a FIFO and links of every kind.
fn layout(outer: &Path) {
    let root = outer.join("proj");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::create_dir_all(outer.join("outside_dir")).unwrap();
    std::fs::write(outer.join("secret"), "secret hello\n").unwrap();
    std::fs::write(outer.join("outside_dir/f"), "outside hello\n").unwrap();
    std::fs::write(root.join("inside.txt"), "hello inside\n").unwrap();
    std::fs::write(root.join("sub/a.txt"), "hello sub\n").unwrap();
    let links: &[(&str, String)] = &[
        ("out_dir", outer.join("outside_dir").display().to_string()),
        ("out_file", outer.join("secret").display().to_string()),
        ("out_file_rel", "../secret".into()),
        ("dangling_abs", outer.join("new_abs").display().to_string()),
        ("dangling_rel", "../new_rel".into()),
        ("dangling_in", "sub/new_in.txt".into()),
        ("chain1", "chain2".into()),
        ("chain2", "out_file".into()),
        ("in_link", "inside.txt".into()),
        ("in_dir_link", "sub".into()),
        ("in_abs_link", root.join("inside.txt").display().to_string()),
        ("dotdot", "..".into()),
        ("devnull", "/dev/null".into()),
        ("procstatus", "/proc/self/status".into()),
    ];
    for (name, target) in links {
        symlink(target, root.join(name)).unwrap();
    }
    let st = std::process::Command::new("mkfifo")
        .arg(root.join("fifo"))
        .status()
        .unwrap();
    assert!(st.success());
}

/// Everything under `outer` except the session's directory: paths, with
/// file contents and link targets.
fn outside(outer: &Path) -> BTreeMap<String, String> {
    let mut seen = BTreeMap::new();
    for e in walkdir::WalkDir::new(outer).follow_links(false) {
        let e = e.unwrap();
        let p = e.path();
        if p.starts_with(outer.join("proj")) {
            continue;
        }
        let what = if e.file_type().is_symlink() {
            format!("-> {}", std::fs::read_link(p).unwrap().display())
        } else if e.file_type().is_file() {
            std::fs::read_to_string(p).unwrap()
        } else {
            "dir".into()
        };
        seen.insert(p.display().to_string(), what);
    }
    seen
}

/// The six file tools' arguments for `path`.
fn inputs(path: &str) -> [(&'static str, Value); 6] {
    [
        ("read_file", json!({"path": path})),
        ("write_file", json!({"path": path, "content": "pwned\n"})),
        (
            "edit",
            json!({"path": path, "old_string": "hello", "new_string": "HELLO"}),
        ),
        ("list_dir", json!({"path": path})),
        ("grep", json!({"pattern": "hello", "path": path})),
        ("glob", json!({"pattern": "**", "path": path})),
    ]
}

#[tokio::test]
async fn no_path_or_link_leads_out_of_the_session_directory() {
    let cfg = ToolsConfig::default();
    // (path, with `{outer}`/`{root}` filled in; expectations for read_file,
    // write_file, edit, list_dir, grep, glob)
    let cases: &[(&str, [Expect; 6])] = &[
        ("../secret", [Out; 6]),
        ("a/../../secret", [Out; 6]),
        ("sub/../../secret", [Out; 6]),
        ("/etc/passwd", [Out, Skip, Skip, Out, Out, Out]),
        ("{outer}/secret", [Out; 6]),
        ("{outer}/new_file", [Out; 6]),
        (
            "{root}/inside.txt",
            [Ok, Ok, Ok, Fail(NOT_DIR), Ok, Fail(NOT_DIR)],
        ),
        ("{root}/../secret", [Out; 6]),
        ("out_dir", [Out; 6]),
        ("out_dir/f", [Out; 6]),
        // A directory link used as the parent of a new file.
        ("out_dir/new.txt", [Out; 6]),
        ("out_file", [Out; 6]),
        ("out_file_rel", [Out; 6]),
        ("dangling_abs", [Out; 6]),
        ("dangling_rel", [Out; 6]),
        ("chain1", [Out; 6]),
        ("dotdot/secret", [Out; 6]),
        ("devnull", [Out; 6]),
        ("procstatus", [Out; 6]),
        // `..` through a link that points inside: physical, like the kernel.
        ("in_dir_link/../../secret", [Out; 6]),
        (
            "in_dir_link/../inside.txt",
            [Ok, Ok, Ok, Fail(NOT_DIR), Ok, Fail(NOT_DIR)],
        ),
        ("in_link", [Ok, Ok, Ok, Fail(NOT_DIR), Ok, Fail(NOT_DIR)]),
        (
            "in_dir_link/a.txt",
            [Ok, Ok, Ok, Fail(NOT_DIR), Ok, Fail(NOT_DIR)],
        ),
        (
            "in_dir_link",
            [
                Fail("is a directory, not a regular file"),
                Fail("is a directory, not a regular file"),
                Fail("is a directory, not a regular file"),
                Ok,
                Ok,
                Ok,
            ],
        ),
        // An absolute link target inside the directory is still an
        // absolute target: refused (the handle has no "/").
        ("in_abs_link", [Out; 6]),
        // A dangling link to inside: writing creates its target.
        (
            "dangling_in",
            [
                Fail(MISSING),
                Ok,
                Fail(MISSING),
                Fail(MISSING),
                Fail(MISSING),
                Fail(MISSING),
            ],
        ),
        (
            "sub/new/deeper.txt",
            [
                Fail(MISSING),
                Ok,
                Fail(MISSING),
                Fail(MISSING),
                Fail(MISSING),
                Fail(MISSING),
            ],
        ),
        (
            "fifo",
            [
                Fail("is a FIFO, not a regular file"),
                Fail("is a FIFO, not a regular file"),
                Fail("is a FIFO, not a regular file"),
                Fail(NOT_DIR),
                Fail("is a FIFO, not a regular file"),
                Fail(NOT_DIR),
            ],
        ),
    ];
    for (template, expects) in cases {
        for ((tool, _), expect) in inputs("").iter().zip(expects) {
            if matches!(expect, Skip) {
                continue;
            }
            // A fresh layout for every call: writes must not leak into
            // the next case.
            let outer = tempfile::tempdir().unwrap();
            let outer = outer.path().canonicalize().unwrap();
            layout(&outer);
            let root = outer.join("proj");
            let path = template
                .replace("{outer}", &outer.display().to_string())
                .replace("{root}", &root.display().to_string());
            let input = inputs(&path)
                .into_iter()
                .find(|(t, _)| t == tool)
                .unwrap()
                .1;
            let before = outside(&outer);
            let out = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                run(&root, &cfg, tool, input),
            )
            .await
            .unwrap_or_else(|_| panic!("{tool} {path} hung"));
            let what = format!("{tool} {template}: {out:?}");
            match expect {
                Ok => assert!(out.ok, "{what}"),
                Out => assert!(!out.ok && out.output.contains(OUT_MSG), "{what}"),
                Fail(words) => assert!(!out.ok && out.output.contains(words), "{what}"),
                Skip => unreachable!(),
            }
            assert_eq!(outside(&outer), before, "{what} changed the outside");
            assert!(
                !outer.join("new_abs").exists() && !outer.join("new_rel").exists(),
                "{what} created a link target outside"
            );
        }
    }
}

#[tokio::test]
async fn writes_through_inside_links_land_inside() {
    let cfg = ToolsConfig::default();
    let outer = tempfile::tempdir().unwrap();
    let outer = outer.path().canonicalize().unwrap();
    layout(&outer);
    let root = outer.join("proj");
    for (path, lands) in [
        ("in_link", "inside.txt"),
        ("in_dir_link/a.txt", "sub/a.txt"),
        ("dangling_in", "sub/new_in.txt"),
        ("sub/new/deeper.txt", "sub/new/deeper.txt"),
    ] {
        let out = run(
            &root,
            &cfg,
            "write_file",
            json!({"path": path, "content": path}),
        )
        .await;
        assert!(out.ok, "{path}: {out:?}");
        assert_eq!(std::fs::read_to_string(root.join(lands)).unwrap(), path);
    }
    // Searches do not walk into directory links.
    let out = run(&root, &cfg, "glob", json!({"pattern": "**/a.txt"})).await;
    assert_eq!(out.output, "sub/a.txt");
    let out = run(&root, &cfg, "grep", json!({"pattern": "hello"})).await;
    assert!(
        !out.output.contains("secret") && !out.output.contains("outside"),
        "{out:?}"
    );
}
