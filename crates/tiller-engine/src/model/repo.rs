//! Which git repository a session's directory is in, and whether its
//! status may be shown to the model. The repository is a hostile document
//! (copied from an archive, its `.git` included): what git would read
//! through it must stay inside it, or a hand-made `.git` could make status
//! list the tracked names of any other repository on the machine (a
//! password store's).

use std::io::Read as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// Where status is run: the work tree and its git directory, both given to
/// git (`GIT_DIR`, `GIT_WORK_TREE`), so it finds nothing by itself.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Repository {
    pub top: PathBuf,
    pub git_dir: PathBuf,
    /// A linked work tree's common directory, as checked: given to git
    /// too (`GIT_COMMON_DIR`), which would otherwise read `commondir`
    /// again by itself.
    pub common: Option<PathBuf>,
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

/// Most entries of a git directory looked at (its loose objects aside).
const MAX_ENTRIES: usize = 50_000;

/// Most of a small file of a git directory read (`gitdir`, `commondir`,
/// `config`, a `.git` file).
const SMALL: u64 = 64 * 1024;

/// The nearest of `dir` and the directories above it that has a `.git`,
/// and whether to believe it.
///
/// A `.git` directory is believed when it is the user's and
/// self-contained (see [`self_contained`]). A `.git` link never is. A
/// `.git` file (read as git reads it) is believed when the git directory
/// it names names it back: a linked work tree's does (its `gitdir` file;
/// and it lies in its common directory's `worktrees`), a submodule's does
/// (its `core.worktree`); `git clone --separate-git-dir` writes no such
/// name, so its status is not shown.
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
    match checked(top) {
        Ok((git_dir, common)) => Found::Repository(Repository {
            top: top.to_owned(),
            git_dir,
            common,
        }),
        Err(why) => Found::Unshown(why),
    }
}

/// The git directory of the work tree `top`, and a linked work tree's
/// common directory, if they are to be believed.
fn checked(top: &Path) -> Result<(PathBuf, Option<PathBuf>), &'static str> {
    if !ours(top) {
        return Err("it belongs to another user");
    }
    let dot_git = top.join(".git");
    let meta = dot_git.symlink_metadata().map_err(|_| "its .git is gone")?;
    if meta.file_type().is_symlink() {
        return Err("its .git is a link");
    }
    if meta.is_dir() {
        self_contained(&dot_git, false)?;
        return Ok((dot_git, None));
    }
    if !meta.is_file() {
        return Err("its .git is neither a directory nor a file");
    }
    let git_dir = named_git_dir(&dot_git, top).ok_or("its .git file names no git directory")?;
    let back = read_small(&git_dir.join("gitdir")).and_then(|back| {
        let back = back.trim_end_matches(['\n', '\r']);
        git_dir.join(back).canonicalize().ok()
    });
    if back.as_deref() == Some(dot_git.as_path()) {
        // A linked work tree's: in its common directory's `worktrees`, as
        // `git worktree add` makes it (an archive cannot put one in
        // another repository's).
        let named =
            read_small(&git_dir.join("commondir")).ok_or("its common directory is unreadable")?;
        // As git reads it: only the line break dropped.
        let common = git_dir
            .join(named.trim_end_matches(['\n', '\r']))
            .canonicalize()
            .map_err(|_| "its common directory is missing")?;
        if git_dir.parent() != Some(common.join("worktrees").as_path()) {
            return Err("its git directory is not one of its common directory's work trees");
        }
        self_contained(&git_dir, true)?;
        self_contained(&common, false)?;
        return Ok((git_dir, Some(common)));
    }
    if core_worktree(&git_dir).as_deref() == Some(top) {
        self_contained(&git_dir, false)?;
        return Ok((git_dir, None));
    }
    Err("its .git file names a git directory that does not name it back")
}

/// Whether `path` is the daemon's user's, as git requires of a repository
/// it finds by itself (told `GIT_DIR`, git does not check).
fn ours(path: &Path) -> bool {
    path.symlink_metadata()
        .is_ok_and(|m| m.uid() == rustix::process::geteuid().as_raw())
}

/// `path` opened to read, with its metadata, only if it is a regular file:
/// `None` for a link (not followed), a FIFO (opened without blocking) or
/// anything else, which could block or never end.
pub(super) fn open_regular(path: &Path) -> Option<(std::fs::File, std::fs::Metadata)> {
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits() as i32)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    meta.is_file().then_some((file, meta))
}

/// A small regular file's text ([`open_regular`]); `None` also for one
/// longer than [`SMALL`] (git would read all of it: a cut one could name
/// another place than git reads).
fn read_small(path: &Path) -> Option<String> {
    let (file, _) = open_regular(path)?;
    let mut text = String::new();
    file.take(SMALL + 1).read_to_string(&mut text).ok()?;
    (text.len() as u64 <= SMALL).then_some(text)
}

/// The git directory a `.git` file names, as git reads it: everything
/// after `gitdir: `, its final line breaks dropped; `None` when it holds
/// another line break or a NUL, or names nothing there.
fn named_git_dir(dot_git: &Path, top: &Path) -> Option<PathBuf> {
    let text = read_small(dot_git)?;
    let named = text
        .strip_prefix("gitdir: ")?
        .trim_end_matches(['\n', '\r']);
    if named.is_empty() || named.contains(['\n', '\r', '\0']) {
        return None;
    }
    top.join(named).canonicalize().ok()
}

/// Whether what git reads through `git_dir` stays in it: the user's, no
/// link anywhere in it (a ref, the index, `ORIG_HEAD`, an object
/// directory, a work tree's directory: each could lead into another
/// repository; loose objects are not looked into, named by their hash), no
/// alternate object store, and no common directory but a linked work
/// tree's (`linked`), checked by the caller.
fn self_contained(git_dir: &Path, linked: bool) -> Result<(), &'static str> {
    if !ours(git_dir) {
        return Err("its git directory belongs to another user");
    }
    if git_dir
        .join("objects/info/alternates")
        .symlink_metadata()
        .is_ok()
    {
        return Err("its git directory borrows objects from elsewhere");
    }
    if !linked && git_dir.join("commondir").symlink_metadata().is_ok() {
        return Err("its git directory names a common directory");
    }
    no_links(git_dir)
}

/// Refuses a link anywhere under `git_dir`, and a part that cannot be
/// read (git may still open what is in it by name), looking at
/// [`MAX_ENTRIES`] at most. Not entered: loose object directories
/// (`objects/xx`), `hooks` (whose links are common; status runs none),
/// `lfs`, and `modules` (status reads a submodule's `HEAD` there, but the
/// submodule's own `.git` in the work tree may name anything anyway, and
/// it is never listed: `--ignore-submodules=all`).
fn no_links(git_dir: &Path) -> Result<(), &'static str> {
    const UNREAD: &str = "a part of its git directory cannot be read";
    let objects = git_dir.join("objects");
    let mut pending = vec![git_dir.to_owned()];
    let mut seen = 0;
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|_| UNREAD)?;
        for entry in entries {
            let entry = entry.map_err(|_| UNREAD)?;
            seen += 1;
            if seen > MAX_ENTRIES {
                return Err("its git directory holds too much to check");
            }
            let kind = entry.file_type().map_err(|_| UNREAD)?;
            if kind.is_symlink() {
                return Err("its git directory holds a link");
            }
            if !kind.is_dir() {
                // A FIFO or a device would hold git up, or never end (a
                // socket fails at once: fsmonitor's daemon leaves one).
                use std::os::unix::fs::FileTypeExt as _;
                if kind.is_fifo() || kind.is_block_device() || kind.is_char_device() {
                    return Err("its git directory holds a FIFO or a device");
                }
                continue;
            }
            let name = entry.file_name();
            let skipped = if dir == objects {
                name.len() == 2 && name.as_encoded_bytes().iter().all(u8::is_ascii_hexdigit)
            } else {
                dir == git_dir && ["hooks", "modules", "lfs"].iter().any(|n| name == *n)
            };
            if !skipped {
                pending.push(entry.path());
            }
        }
    }
    Ok(())
}

/// The work tree a git directory's own config names (`core.worktree`, as
/// `git submodule` writes it: relative to that directory; the last one
/// given wins, as in git), real.
fn core_worktree(git_dir: &Path) -> Option<PathBuf> {
    let config = read_small(&git_dir.join("config"))?;
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
                git_dir: top.join(".git"),
                common: None,
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
        std::fs::write(linked.join("commondir"), "../..\n").unwrap();
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
        let cases: [(&str, Setup); 9] = [
            ("an ORIG_HEAD link a ref names", |git, private| {
                std::fs::create_dir_all(git.join("refs/heads")).unwrap();
                std::fs::write(git.join("refs/heads/main"), "ref: ORIG_HEAD\n").unwrap();
                std::os::unix::fs::symlink(private.join("refs/heads/main"), git.join("ORIG_HEAD"))
                    .unwrap();
            }),
            ("a work tree's directory link", |git, private| {
                std::fs::create_dir_all(git.join("worktrees")).unwrap();
                std::os::unix::fs::symlink(private, git.join("worktrees/x")).unwrap();
            }),
            ("a loose object directory link", |git, private| {
                std::fs::create_dir_all(git.join("objects")).unwrap();
                std::os::unix::fs::symlink(private.join("objects"), git.join("objects/00"))
                    .unwrap();
            }),
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
        // A linked work tree naming it back, whose common directory is
        // another repository's (it is not in that one's `worktrees`).
        let evil = real.join("evil-linked");
        std::fs::create_dir_all(evil.join("wt")).unwrap();
        std::fs::write(evil.join(".git"), "gitdir: wt\n").unwrap();
        std::fs::write(evil.join("wt/gitdir"), "../.git\n").unwrap();
        std::fs::write(
            evil.join("wt/commondir"),
            format!("{}\n", private.display()),
        )
        .unwrap();
        assert!(
            matches!(find(&evil), Found::Unshown(_)),
            "a borrowed common directory"
        );
        // A `commondir` longer than is read, and one with a trailing
        // space: git would read another directory than the one checked.
        for (i, named) in [
            format!("../..{}/../../private/.git\n", "/.".repeat(40_000)),
            "../.. \n".to_owned(),
        ]
        .iter()
        .enumerate()
        {
            let top = real.join(format!("long{i}"));
            let git = top.join("c/worktrees/wt");
            std::fs::create_dir_all(&git).unwrap();
            std::fs::write(top.join(".git"), "gitdir: c/worktrees/wt\n").unwrap();
            std::fs::write(git.join("gitdir"), "../../../.git\n").unwrap();
            std::fs::write(git.join("commondir"), named).unwrap();
            std::fs::create_dir_all(top.join("c/ ")).unwrap();
            assert!(matches!(find(&top), Found::Unshown(_)), "commondir {i}");
        }
        // A FIFO where a small file is read is refused, not waited on.
        let fifo = real.join("fifo");
        std::fs::create_dir(&fifo).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            fifo.join(".git"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(matches!(find(&fifo), Found::Unshown(_)), "a FIFO");
        // A self-contained one is shown.
        let fine = real.join("fine/.git");
        std::fs::create_dir_all(fine.join("refs/heads")).unwrap();
        std::fs::write(fine.join("refs/heads/main"), "0").unwrap();
        assert_eq!(top_of(&real.join("fine")), Some(real.join("fine")));
    }
}
