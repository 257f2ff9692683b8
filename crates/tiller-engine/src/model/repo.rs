//! Which git repository a session's directory is in, and whether its
//! status may be shown to the model. The repository is a hostile document
//! (copied from an archive, its `.git` included): what git would read
//! through it must stay inside it, or a hand-made `.git` could make status
//! list the tracked names of any other repository on the machine (a
//! password store's).

use std::path::{Path, PathBuf};

/// Where status is run: the work tree and its git directory, both given to
/// git (`GIT_WORK_TREE`, `GIT_DIR`), so it finds nothing by itself.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Repository {
    pub top: PathBuf,
    pub git_dir: PathBuf,
}

/// What was found from a directory.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// No `.git` in it or above it: git is not run.
    Nothing,
    /// A repository whose status is not shown, and why.
    Unshown(&'static str),
    Repository(Repository),
}

/// Most entries under a git directory's `refs` looked at for links.
const MAX_REFS: usize = 10_000;

/// The nearest of `dir` and the directories above it that has a `.git`,
/// and whether to believe it.
///
/// A `.git` directory is believed when it is self-contained (see
/// [`self_contained`]). A `.git` link never is. A `.git` file (read as git
/// reads it) is believed when the git directory it names names it back:
/// a linked work tree's does (its `gitdir` file), a submodule's does (its
/// `core.worktree`); `git clone --separate-git-dir` writes no such name, so
/// its status is not shown.
pub(super) fn find(dir: &Path) -> Found {
    // Git looks up from the real directory: a link into a repository's
    // subdirectory is in that repository.
    let real = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let Some(top) = real
        .ancestors()
        .find(|d| d.join(".git").symlink_metadata().is_ok())
    else {
        return Found::Nothing;
    };
    let dot_git = top.join(".git");
    let Ok(meta) = dot_git.symlink_metadata() else {
        return Found::Nothing;
    };
    let repository = |git_dir: PathBuf, linked: bool| match self_contained(&git_dir, linked) {
        Ok(()) => Found::Repository(Repository {
            top: top.to_owned(),
            git_dir,
        }),
        Err(why) => Found::Unshown(why),
    };
    if meta.is_dir() {
        return repository(dot_git, false);
    }
    if !meta.is_file() {
        return Found::Unshown("its .git is a link");
    }
    let Some(git_dir) = named_git_dir(&dot_git, top) else {
        return Found::Unshown("its .git file names no git directory");
    };
    let back = std::fs::read_to_string(git_dir.join("gitdir"))
        .ok()
        .and_then(|back| git_dir.join(back.trim_end()).canonicalize().ok());
    if back.as_deref() == Some(dot_git.as_path()) {
        return repository(git_dir, true);
    }
    if core_worktree(&git_dir).as_deref() == Some(top) {
        return repository(git_dir, false);
    }
    Found::Unshown("its .git file names a git directory that does not name it back")
}

/// The git directory a `.git` file names, as git reads it: everything
/// after `gitdir: `, only a final line break dropped; `None` when it holds
/// another line break or a NUL, or names nothing there.
fn named_git_dir(dot_git: &Path, top: &Path) -> Option<PathBuf> {
    if dot_git.metadata().ok()?.len() > 4096 {
        return None;
    }
    let text = std::fs::read_to_string(dot_git).ok()?;
    let named = text.strip_prefix("gitdir: ")?;
    let named = named.strip_suffix('\n').unwrap_or(named);
    let named = named.strip_suffix('\r').unwrap_or(named);
    if named.is_empty() || named.contains(['\n', '\r', '\0']) {
        return None;
    }
    top.join(named).canonicalize().ok()
}

/// Whether what git reads through `git_dir` stays in it: no link where git
/// finds its index, head, refs or objects, no alternate object store, and
/// no common directory elsewhere but a linked work tree's (`linked`),
/// which is held to the same rules.
fn self_contained(git_dir: &Path, linked: bool) -> Result<(), &'static str> {
    for name in ["index", "HEAD", "packed-refs", "objects", "refs", "config"] {
        if is_link(&git_dir.join(name)) {
            return Err("a part of its git directory is a link");
        }
    }
    if git_dir
        .join("objects/info/alternates")
        .symlink_metadata()
        .is_ok()
    {
        return Err("its git directory borrows objects from elsewhere");
    }
    links_under(&git_dir.join("refs"))?;
    let common = git_dir.join("commondir");
    if common.symlink_metadata().is_err() {
        return Ok(());
    }
    if !linked {
        return Err("its git directory names a common directory");
    }
    let named =
        std::fs::read_to_string(&common).map_err(|_| "its common directory is unreadable")?;
    let common = git_dir
        .join(named.trim_end())
        .canonicalize()
        .map_err(|_| "its common directory is missing")?;
    if common.join("commondir").symlink_metadata().is_ok() {
        return Err("its common directory names another");
    }
    self_contained(&common, false)
}

fn is_link(path: &Path) -> bool {
    path.symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
}

/// Refuses a link anywhere under `refs` (a ref may be a link to another
/// repository's), looking at [`MAX_REFS`] entries at most.
fn links_under(refs: &Path) -> Result<(), &'static str> {
    let mut pending = vec![refs.to_owned()];
    let mut seen = 0;
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > MAX_REFS {
                return Err("its git directory holds too many refs to check");
            }
            match entry.file_type() {
                Ok(t) if t.is_symlink() => return Err("a ref is a link"),
                Ok(t) if t.is_dir() => pending.push(entry.path()),
                _ => {}
            }
        }
    }
    Ok(())
}

/// The work tree a git directory's own config names (`core.worktree`, as
/// `git submodule` writes it: relative to that directory; the last one
/// given wins, as in git), real.
fn core_worktree(git_dir: &Path) -> Option<PathBuf> {
    let config = std::fs::read_to_string(git_dir.join("config")).ok()?;
    let mut in_core = false;
    let mut found = None;
    for line in config.lines().map(str::trim) {
        if line.starts_with('[') {
            in_core = line.eq_ignore_ascii_case("[core]");
        } else if in_core
            && let Some((key, value)) = line.split_once('=')
            && key.trim().eq_ignore_ascii_case("worktree")
        {
            let value = value.split([';', '#']).next().unwrap_or_default().trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            found = Some(value.to_owned());
        }
    }
    git_dir.join(found?).canonicalize().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top_of(dir: &Path) -> Option<PathBuf> {
        match find(dir) {
            Found::Repository(r) => Some(r.top),
            _ => None,
        }
    }

    /// A `.git` file (a linked work tree, a submodule) marks a repository
    /// as a `.git` directory does; no `.git` anywhere above, none.
    #[test]
    fn a_repository_is_found_by_its_dot_git_above() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let deep = dir.path().join("a/b");
        std::fs::create_dir_all(&deep).unwrap();
        // The temporary directory is not in a repository.
        assert_eq!(find(&deep), Found::Nothing);
        std::fs::create_dir(dir.path().join("a/.git")).unwrap();
        let top = real.join("a");
        assert_eq!(
            find(&deep),
            Found::Repository(Repository {
                top: top.clone(),
                git_dir: top.join(".git")
            })
        );
        assert_eq!(find(dir.path()), Found::Nothing);
        // A link to a directory inside the repository, from outside it.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&deep, &link).unwrap();
        assert_eq!(top_of(&link), Some(top));
    }

    /// A `.git` file or link may name any repository on the machine (a
    /// password store's), whose tracked names status would list as
    /// deleted: believed only when that git directory names this one
    /// back, as a linked work tree's does (`gitdir`, absolute or relative),
    /// or a submodule's (`core.worktree`).
    #[test]
    fn a_dot_git_naming_another_repository_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let private = real.join("private/.git");
        std::fs::create_dir_all(&private).unwrap();
        let evil = real.join("evil");
        std::fs::create_dir(&evil).unwrap();
        for target in [private.display().to_string(), "../private/.git".into()] {
            std::fs::write(evil.join(".git"), format!("gitdir: {target}\n")).unwrap();
            assert!(matches!(find(&evil), Found::Unshown(_)), "{target}");
        }
        // Read as git reads it: a second line is part of the name.
        std::fs::write(evil.join(".git"), "gitdir: ../wt-git\nelse\n").unwrap();
        assert!(matches!(find(&evil), Found::Unshown(_)));
        std::fs::remove_file(evil.join(".git")).unwrap();
        std::os::unix::fs::symlink(&private, evil.join(".git")).unwrap();
        assert_eq!(find(&evil), Found::Unshown("its .git is a link"));
        // A linked work tree: its git directory names it back.
        let linked = private.join("worktrees/wt");
        std::fs::create_dir_all(&linked).unwrap();
        let wt = real.join("wt");
        std::fs::create_dir(&wt).unwrap();
        std::fs::write(wt.join(".git"), format!("gitdir: {}\n", linked.display())).unwrap();
        assert!(matches!(find(&wt), Found::Unshown(_)), "not named back yet");
        std::fs::write(
            linked.join("gitdir"),
            format!("{}\n", wt.join(".git").display()),
        )
        .unwrap();
        assert_eq!(top_of(&wt), Some(wt.clone()));
        // Named back relatively (`worktree.useRelativePaths`).
        std::fs::write(linked.join("gitdir"), "../../../../wt/.git\n").unwrap();
        assert_eq!(top_of(&wt), Some(wt.clone()));
        // A submodule: its git directory names its work tree.
        let modules = real.join("private/.git/modules/sub");
        std::fs::create_dir_all(&modules).unwrap();
        let sub = real.join("private/sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join(".git"), "gitdir: ../.git/modules/sub\n").unwrap();
        assert!(
            matches!(find(&sub), Found::Unshown(_)),
            "no work tree named"
        );
        std::fs::write(
            modules.join("config"),
            "[core]\n\tworktree = elsewhere\n\tbare = false\n\tworktree = ../../../sub ; git's\n",
        )
        .unwrap();
        assert_eq!(top_of(&sub), Some(sub.clone()));
        // Another repository's module, named from elsewhere: not this one's.
        std::fs::remove_file(evil.join(".git")).unwrap();
        std::fs::write(
            evil.join(".git"),
            format!("gitdir: {}\n", modules.display()),
        )
        .unwrap();
        assert!(matches!(find(&evil), Found::Unshown(_)));
    }

    /// A `.git` directory whose index, refs or objects are another
    /// repository's (a link, alternates, a common directory) is not shown:
    /// status would list that repository's tracked names.
    #[test]
    fn a_git_directory_reaching_into_another_is_not_shown() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let private = real.join("private/.git");
        std::fs::create_dir_all(private.join("refs/heads")).unwrap();
        std::fs::create_dir_all(private.join("objects/info")).unwrap();
        std::fs::write(private.join("index"), "DIRC").unwrap();
        std::fs::write(private.join("refs/heads/main"), "0").unwrap();
        type Setup = fn(&Path, &Path);
        let cases: [(&str, Setup); 6] = [
            ("an index link", |git, private| {
                std::os::unix::fs::symlink(private.join("index"), git.join("index")).unwrap();
            }),
            ("an objects link", |git, private| {
                std::os::unix::fs::symlink(private.join("objects"), git.join("objects")).unwrap();
            }),
            ("a ref link", |git, private| {
                std::fs::create_dir_all(git.join("refs/heads")).unwrap();
                std::os::unix::fs::symlink(
                    private.join("refs/heads/main"),
                    git.join("refs/heads/main"),
                )
                .unwrap();
            }),
            ("alternates", |git, private| {
                std::fs::create_dir_all(git.join("objects/info")).unwrap();
                let to = private.join("objects").display().to_string();
                std::fs::write(git.join("objects/info/alternates"), to).unwrap();
            }),
            ("a common directory", |git, private| {
                std::fs::write(git.join("commondir"), private.display().to_string()).unwrap();
            }),
            ("a head link", |git, private| {
                std::os::unix::fs::symlink(private.join("HEAD"), git.join("HEAD")).unwrap();
            }),
        ];
        for (i, (what, setup)) in cases.into_iter().enumerate() {
            let top = real.join(format!("evil{i}"));
            let git = top.join(".git");
            std::fs::create_dir_all(&git).unwrap();
            setup(&git, &private);
            assert!(matches!(find(&top), Found::Unshown(_)), "{what}");
        }
        // A self-contained one is shown.
        let fine = real.join("fine/.git");
        std::fs::create_dir_all(fine.join("refs/heads")).unwrap();
        std::fs::write(fine.join("refs/heads/main"), "0").unwrap();
        assert_eq!(top_of(&real.join("fine")), Some(real.join("fine")));
    }
}
