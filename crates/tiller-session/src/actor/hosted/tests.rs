//! The pure parts of hosting an ACP agent's turn.

/// An agent's edit weighs as an edit, unless it lands in a
/// repository's own directory, by any case of its name (`.GIT` is
/// `.git` on a case-insensitive file system): then as a command.
/// [`super::asked`] with no additional roots.
fn asked_in(
    call: tiller_engine::ToolCall,
    locations: &[String],
    dir: &std::path::Path,
) -> tiller_engine::ToolCall {
    super::asked(call, locations, dir, &[])
}

#[test]
fn an_edit_into_a_repository_s_own_directory_weighs_as_a_command() {
    use tiller_engine::{ToolCall, ToolKind};
    let edit = |path: &str| ToolCall {
        id: "t".into(),
        name: "Write".into(),
        kind: ToolKind::Edit,
        input: serde_json::json!({ "file_path": path }),
        simulated: None,
    };
    for (path, kind) in [
        ("src/a.rs", ToolKind::Edit),
        (".git/config", ToolKind::Execute),
        ("/p/.GIT/hooks/pre-commit", ToolKind::Execute),
        ("sub/.Git/config", ToolKind::Execute),
        ("GIT~1/config", ToolKind::Execute),
        (".git. /hooks/x", ToolKind::Execute),
        ("src/.gitignore", ToolKind::Edit),
    ] {
        assert_eq!(
            asked_in(edit(path), &[], "/p".as_ref()).kind,
            kind,
            "{path}"
        );
    }
    // Whatever the agent calls its path argument.
    for key in ["path", "notebook_path", "absolute_path", "filePath"] {
        let mut call = edit("a.rs");
        call.input = serde_json::json!({ key: "/p/.git/config" });
        assert_eq!(
            asked_in(call, &[], "/p".as_ref()).kind,
            ToolKind::Execute,
            "{key}"
        );
    }
    let located = asked_in(edit("a.rs"), &["/p/.gIT/config".into()], "/p".as_ref());
    assert_eq!(located.kind, ToolKind::Execute);
    // Through a link the repository checked out (`tools -> .git/hooks`).
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join(".git/hooks")).unwrap();
    std::os::unix::fs::symlink(".git/hooks", dir.path().join("tools")).unwrap();
    std::os::unix::fs::symlink(".git/hooks/post-merge", dir.path().join("dangling")).unwrap();
    for path in [
        "tools/pre-commit",
        "tools/../config",
        "tools/new/x",
        "tools/new/../pre-commit",
        "dangling",
    ] {
        assert_eq!(
            asked_in(edit(path), &[], dir.path()).kind,
            ToolKind::Execute,
            "{path}"
        );
    }
    assert_eq!(
        asked_in(edit("src/a.rs"), &[], dir.path()).kind,
        ToolKind::Edit
    );
    // An edit naming no path Tiller can check (under another key, in a
    // list, or none) weighs as a command; a list of paths is checked.
    for input in [
        serde_json::json!({ "changes": { "/p/.git/config": "x" } }),
        serde_json::json!({ "target": "/p/.git/config" }),
        serde_json::json!({}),
        serde_json::json!({ "paths": ["/p/a.rs", "/p/.git/config"] }),
    ] {
        let mut call = edit("a.rs");
        call.input = input.clone();
        assert_eq!(
            asked_in(call, &[], "/p".as_ref()).kind,
            ToolKind::Execute,
            "{input}"
        );
    }
    let mut call = edit("a.rs");
    call.input = serde_json::json!({ "paths": ["/p/a.rs", "/p/b.rs"] });
    assert_eq!(asked_in(call, &[], "/p".as_ref()).kind, ToolKind::Edit);
    let located = asked_in(
        ToolCall {
            input: serde_json::json!({}),
            ..edit("x")
        },
        &["/p/a.rs".into()],
        "/p".as_ref(),
    );
    assert_eq!(located.kind, ToolKind::Edit);
}

/// An agent asks before editing outside its directory (that is why it
/// asks): such an edit weighs as a command, never let through by
/// `accept-edits` or an "always" given to edits inside. An additional
/// root is inside.
#[test]
fn an_edit_outside_the_session_s_roots_weighs_as_a_command() {
    use tiller_engine::{ToolCall, ToolKind};
    let dir = tempfile::tempdir().unwrap();
    let (home, extra) = (dir.path().join("p"), dir.path().join("lib"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&extra).unwrap();
    std::os::unix::fs::symlink(dir.path(), home.join("up")).unwrap();
    let edit = |path: String| ToolCall {
        id: "t".into(),
        name: "Write".into(),
        kind: ToolKind::Edit,
        input: serde_json::json!({ "file_path": path }),
        simulated: None,
    };
    let roots = [extra.clone()];
    for (path, kind) in [
        ("src/a.rs".to_owned(), ToolKind::Edit),
        (home.join("b.rs").display().to_string(), ToolKind::Edit),
        (extra.join("c.rs").display().to_string(), ToolKind::Edit),
        ("/etc/profile.d/x.sh".to_owned(), ToolKind::Execute),
        ("../.bashrc".to_owned(), ToolKind::Execute),
        ("up/.bashrc".to_owned(), ToolKind::Execute),
        (
            dir.path()
                .join(".ssh/authorized_keys")
                .display()
                .to_string(),
            ToolKind::Execute,
        ),
    ] {
        assert_eq!(
            super::asked(edit(path.clone()), &[], &home, &roots).kind,
            kind,
            "{path}"
        );
    }
}

#[test]
fn an_agents_read_takes_the_lines_it_asked_for() {
    let text = "a\nb\nc\n";
    // (line, limit, text)
    let cases = [
        (None, None, "a\nb\nc\n"),
        (Some(2), None, "b\nc\n"),
        (Some(2), Some(1), "b\n"),
        (None, Some(2), "a\nb\n"),
        (Some(0), Some(1), "a\n"),
        (Some(9), None, ""),
    ];
    for (line, limit, want) in cases {
        assert_eq!(super::lines(text, line, limit), want, "{line:?} {limit:?}");
    }
}
