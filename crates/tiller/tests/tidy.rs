//! Tidy: the workspace's shape, checked so it cannot drift unnoticed.
//! Which crate may depend on which (pure core at the bottom, edges at the
//! top, SQL only in the store), no clock reads in the pure core or the
//! store (time is an input there), and no session-crate file over 600
//! lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Each workspace crate and the workspace crates in its `[dependencies]`.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let dir = entry.unwrap().path();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut deps = BTreeSet::new();
        let mut in_deps = false;
        for line in manifest.lines() {
            let line = line.trim();
            if line.starts_with('[') {
                in_deps = line == "[dependencies]";
            } else if in_deps && line.starts_with("tiller") {
                let dep = line.split(['.', ' ', '=']).next().unwrap();
                deps.insert(dep.to_owned());
            }
        }
        out.insert(name, deps);
    }
    out
}

#[test]
fn crates_depend_only_downward() {
    // Who may use whom. Anything not listed here is a drift to discuss
    // (and record in ARCHITECTURE.md) before it lands.
    let allowed: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("tiller-core", &[][..]),
        ("tiller-engine", &["tiller-core"][..]),
        ("tiller-tools", &["tiller-core", "tiller-engine"][..]),
        ("tiller-store", &["tiller-core"][..]),
        (
            "tiller-session",
            &[
                "tiller-core",
                "tiller-engine",
                "tiller-store",
                "tiller-tools",
            ][..],
        ),
        (
            "tiller-acp",
            &["tiller-core", "tiller-session", "tiller-tools"][..],
        ),
        // Edges reach the store only through the session facade.
        (
            "tiller-http",
            &[
                "tiller-acp",
                "tiller-core",
                "tiller-session",
                "tiller-tools",
            ][..],
        ),
        (
            "tiller-test-support",
            &[
                "tiller-acp",
                "tiller-core",
                "tiller-engine",
                "tiller-session",
                "tiller-store",
            ][..],
        ),
        // Load generators: they drive the binary from outside.
        ("tiller-bench", &[][..]),
        (
            "tiller",
            &[
                "tiller-acp",
                "tiller-core",
                "tiller-engine",
                "tiller-http",
                "tiller-session",
                "tiller-store",
                "tiller-tools",
            ][..],
        ),
    ]);
    let graph = graph();
    for (krate, deps) in &graph {
        let ok: BTreeSet<String> = allowed
            .get(krate.as_str())
            .unwrap_or_else(|| panic!("{krate} is not in the tidy test's dependency table"))
            .iter()
            .map(|s| s.to_string())
            .collect();
        let extra: Vec<_> = deps.difference(&ok).collect();
        assert!(extra.is_empty(), "{krate} must not depend on {extra:?}");
        assert!(
            !deps.contains("tiller-test-support"),
            "{krate} depends on test support outside dev-dependencies"
        );
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_core_and_the_store_never_read_the_wall_clock() {
    for krate in ["tiller-core", "tiller-store"] {
        let mut files = Vec::new();
        rust_files(&root().join("crates").join(krate).join("src"), &mut files);
        assert!(!files.is_empty());
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap();
                assert!(
                    !code.contains("SystemTime::now"),
                    "{}:{}: the wall clock is an input here, not a read",
                    f.display(),
                    i + 1
                );
                // The store times its own writes for a metric, and paces
                // its checkpoint thread and streamed commits by a clock of
                // its own (never the wall clock).
                if krate == "tiller-core" {
                    assert!(
                        !code.contains("Instant::now"),
                        "{}:{}: time is an input to the core",
                        f.display(),
                        i + 1
                    );
                }
            }
        }
    }
}

#[test]
fn no_session_crate_file_is_over_600_lines() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/tiller-session/src"), &mut files);
    assert!(files.len() > 10);
    for f in files {
        let n = std::fs::read_to_string(&f).unwrap().lines().count();
        assert!(n <= 600, "{} has {n} lines (split it)", f.display());
    }
}

#[test]
fn the_cores_and_the_store_document_every_public_item_and_field() {
    // With `-D warnings` (CI), an undocumented input, effect or row field
    // fails the build.
    for krate in ["tiller-core", "tiller-store"] {
        let lib =
            std::fs::read_to_string(root().join("crates").join(krate).join("src/lib.rs")).unwrap();
        assert!(lib.contains("#![warn(missing_docs)]"), "{krate}");
    }
}

#[test]
fn the_session_layer_reads_the_clock_in_one_module() {
    for krate in ["tiller-session", "tiller-http"] {
        let mut files = Vec::new();
        rust_files(&root().join("crates").join(krate).join("src"), &mut files);
        for f in files.iter().filter(|f| !f.ends_with("clock.rs")) {
            let text = std::fs::read_to_string(f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap();
                assert!(
                    !code.contains("SystemTime::now") && !code.contains("Instant::now"),
                    "{}:{}: read the clock through tiller_session::clock",
                    f.display(),
                    i + 1
                );
            }
        }
    }
}
