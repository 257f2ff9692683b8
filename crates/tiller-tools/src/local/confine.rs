//! The session's directory as a capability: every file the built-in tools
//! touch is opened through a `cap_std::fs::Dir` handle on it, so the
//! kernel (`openat2` with `RESOLVE_BENEATH`) or cap-std's own resolution
//! refuses any path, `..` or symbolic link that would lead out of it, at
//! the moment of the open.

use std::ffi::OsStr;
use std::io;
use std::ops::ControlFlow;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Component, Path, PathBuf};

use cap_std::fs::{
    Dir, File, FileTypeExt, Metadata, MetadataExt as _, OpenOptions, OpenOptionsExt,
};

use super::SKIP_DIRS;

/// Deepest directory nesting the walkers descend into.
const MAX_DEPTH: usize = 128;

/// Most symbolic links one path goes through (as the kernel follows).
const MAX_LINKS: usize = 40;

/// The daemon's own files (its data directory: token, database, socket;
/// its config file), which no session may touch even when its directory
/// contains them (a session in `$HOME` contains `~/.local/share/tiller`).
/// Set once at start by the daemon ([`crate::protect`]).
static PROTECTED: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

/// Protects `paths` from the file tools, for the life of the process
/// (canonicalized; one that does not exist yet, as a new database, by its
/// canonical parent and its name; one whose parent is missing too is
/// skipped). The first call wins.
pub fn protect(paths: &[PathBuf]) {
    let canonical = paths
        .iter()
        .filter_map(|p| {
            p.canonicalize()
                .ok()
                .or_else(|| Some(p.parent()?.canonicalize().ok()?.join(p.file_name()?)))
        })
        .collect();
    let _ = PROTECTED.set(canonical);
}

/// Whether the file or directory open as `fd` is one of the daemon's own
/// (or inside one): its real path, from the kernel, not from any name.
fn protected(fd: &impl std::os::fd::AsRawFd) -> bool {
    let Some(list) = PROTECTED.get().filter(|l| !l.is_empty()) else {
        return false;
    };
    real_path(fd).is_some_and(|real| list.iter().any(|p| real.starts_with(p)))
}

/// Entries looked at under the daemon's own paths for a file with other
/// names; past it, the file is taken as one of them.
const PROTECTED_SCAN: usize = 10_000;

/// Whether the file open as `file` is one of the daemon's own: by its real
/// path ([`protected`]), or by [`linked_to_protected`].
fn protected_file(file: &File) -> bool {
    protected(file)
        || file.metadata().map_or_else(
            |_| PROTECTED.get().is_some_and(|l| !l.is_empty()),
            |m| linked_to_protected(m.nlink(), m.dev(), m.ino()),
        )
}

/// Whether a file with `names` names (hard links, which the kernel's real
/// path does not show) is the same file, `(dev, ino)`, as one under the
/// daemon's own paths.
fn linked_to_protected(names: u64, dev: u64, ino: u64) -> bool {
    names > 1
        && PROTECTED
            .get()
            .is_some_and(|l| l.iter().any(|p| holds_file(p, dev, ino)))
}

/// Whether `path` or anything under it (links not followed) is the file
/// `(dev, ino)`; true past [`PROTECTED_SCAN`] entries.
fn holds_file(path: &Path, dev: u64, ino: u64) -> bool {
    let mut stack = vec![path.to_owned()];
    let mut seen = 0;
    while let Some(p) = stack.pop() {
        let Ok(m) = p.symlink_metadata() else {
            continue;
        };
        if m.dev() == dev && m.ino() == ino {
            return true;
        }
        if m.is_dir() {
            for entry in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                seen += 1;
                if seen > PROTECTED_SCAN {
                    return true;
                }
                stack.push(entry.path());
            }
        }
    }
    false
}

/// The real path of what is open as `fd`, from the kernel.
fn real_path(fd: &impl std::os::fd::AsRawFd) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
}

/// Whether `path` (absolute, canonical) is one of the daemon's own.
fn protected_path(path: &Path) -> bool {
    PROTECTED
        .get()
        .is_some_and(|l| l.iter().any(|p| path.starts_with(p)))
}

/// Whether `path` names a repository's own directory (`.git`) as one of
/// its parts, by any name a file system gives it (git's own
/// `is_ntfs_dotgit` and `is_hfs_dotgit` rules): in any case (a `casefold`
/// directory, a FAT or SMB mount), with trailing dots or spaces (FAT drops
/// them), as the short name `git~1`, or with code points HFS+ ignores.
pub fn in_git_dir(path: &Path) -> bool {
    path.components().any(|c| {
        let name = c.as_os_str().to_string_lossy();
        let name: String = name.chars().filter(|c| !ignorable(*c)).collect();
        let name = name.trim_end_matches(['.', ' ']);
        name.eq_ignore_ascii_case(".git") || name.eq_ignore_ascii_case("git~1")
    })
}

/// Whether `path` (relative to `dir`) would land in a repository's own
/// directory: by its name ([`in_git_dir`]), or once the links on its way
/// are followed (`tools -> .git/hooks`, then `tools/pre-commit` or
/// `tools/../config`), as far as it exists; or may, being a file with
/// other names (hard links), which could be one there, or going where
/// that cannot be told ([`landing_of`]).
pub fn lands_in_git_dir(dir: &Path, path: &Path) -> bool {
    if in_git_dir(path) {
        return true;
    }
    match landing_of(dir, path) {
        Some((real, linked)) => linked || in_git_dir(&real),
        None => true,
    }
}

/// Whether a write to `path` (relative to `dir`) lands inside `dir` or
/// one of `roots`, once the links on its way are followed; false where
/// that cannot be told ([`landing_of`]).
pub fn lands_within(dir: &Path, roots: &[PathBuf], path: &Path) -> bool {
    let Some((real, _)) = landing_of(dir, path) else {
        return false;
    };
    // A root that does not exist (any more) is taken as written.
    std::iter::once(dir)
        .chain(roots.iter().map(PathBuf::as_path))
        .any(|r| real.starts_with(r.canonicalize().unwrap_or_else(|_| r.to_owned())))
}

/// Where a write to `path` (relative to `dir`) lands, as far as it exists
/// (its links followed), the rest appended; and whether it is a file with
/// other names. `None` when that cannot be told: a dangling link on the
/// way (a write through it creates its target, wherever that is), a `..`
/// after a directory that does not exist yet (it lands wherever the links
/// before it lead once it is made), or a path that cannot be resolved for
/// another reason than a missing part (`notes.txt/`: not a directory,
/// which an agent's own write drops).
fn landing_of(dir: &Path, path: &Path) -> Option<(PathBuf, bool)> {
    let full = dir.join(path);
    let mut rest: Vec<std::ffi::OsString> = Vec::new();
    let mut at = full.as_path();
    loop {
        let found = at.canonicalize();
        if let Ok(real) = found {
            if rest.iter().any(|c| c == "..") {
                return None;
            }
            let linked =
                rest.is_empty() && real.metadata().is_ok_and(|m| m.is_file() && m.nlink() > 1);
            return Some((rest.iter().rev().fold(real, |p, c| p.join(c)), linked));
        }
        if found.is_err_and(|e| e.kind() != io::ErrorKind::NotFound)
            || at
                .symlink_metadata()
                .is_ok_and(|m| m.file_type().is_symlink())
        {
            return None;
        }
        let name = match at.components().next_back() {
            Some(Component::Normal(name)) => name.to_owned(),
            Some(Component::ParentDir) => "..".into(),
            _ => return Some((full.clone(), false)),
        };
        rest.push(name);
        at = at.parent()?;
    }
}

/// The code points a file system may leave out of a name when it compares
/// names: HFS+'s, and Unicode's default ignorable ones, which a Linux
/// `casefold` directory has ignored in some kernels.
fn ignorable(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{034f}'
            | '\u{061c}'
            | '\u{115f}'..='\u{1160}'
            | '\u{17b4}'..='\u{17b5}'
            | '\u{180b}'..='\u{180f}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{3164}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{feff}'
            | '\u{ffa0}'
            | '\u{fff0}'..='\u{fff8}'
            | '\u{1bca0}'..='\u{1bca3}'
            | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0000}'..='\u{e0fff}'
    )
}

/// Why a write into a repository's own directory (`.git`, by its name in
/// `path`) is refused: git runs what its config and hooks name, so a write
/// there is a command, which the file tools never make. `None` elsewhere.
pub(crate) fn git_dir_refusal(path: &Path, shown: &str) -> Option<String> {
    in_git_dir(path).then(|| {
        format!(
            "{} is inside a repository's own directory (.git), whose config and hooks git runs; \
                 the file tools do not write there (use shell, which asks)",
            Shown(shown)
        )
    })
}

/// Why a write through a file with other names (hard links) is refused:
/// one of them may lie inside a repository's own directory (an archive
/// can carry `notes.txt` linked to `.git/config`) or the daemon's data,
/// and a write through any name changes them all. `None` for a file with
/// one name (or anything else).
pub(crate) fn linked_refusal(is_file: bool, names: u64, shown: &str) -> Option<String> {
    (is_file && names > 1).then(|| {
        format!(
            "{} has {} names (hard links), one of which may be inside a repository's own directory (.git) or the daemon's data; \
                 the file tools do not write through it (use shell, which asks)",
            Shown(shown),
            names
        )
    })
}

/// [`git_dir_refusal`] for the file open as `fd`, by its real path.
fn git_dir_refusal_of(fd: &impl std::os::fd::AsRawFd, shown: &str) -> Option<String> {
    git_dir_refusal(&real_path(fd)?, shown)
}

fn protected_message(path: &str) -> String {
    format!(
        "{} is part of the daemon's own data (its data directory or configuration); the file tools never touch it",
        Shown(path)
    )
}

/// The session's directory, opened.
pub(crate) struct Root {
    /// The handle every access goes through.
    dir: Dir,
    /// Its canonical absolute path: for messages, for absolute paths
    /// given by a model, and for paths handed to an editor.
    path: PathBuf,
    /// The directory as configured, when it differs from `path` (a path
    /// through a symlink): absolute paths under it are accepted too.
    given: PathBuf,
}

/// The lexical form of `p`: `.` dropped, `..` applied (never above the
/// start). `None` when `..` would climb above it.
fn normalize(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if depth == 0 {
                    return None;
                }
                out.pop();
                depth -= 1;
            }
            Component::Normal(n) => {
                out.push(n);
                depth += 1;
            }
            Component::RootDir | Component::Prefix(_) => out.push(c.as_os_str()),
        }
    }
    Some(out)
}

/// `path` relative to the session directory `root` (canonical) or
/// `given`, lexically: relative paths as they are, absolute paths only
/// when inside the directory.
fn relative_to(root: &Path, given: &Path, path: &str) -> Result<PathBuf, String> {
    if path.is_empty() {
        return Err("the path is empty; give a path relative to the working directory".into());
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        // `..` that climbs above the directory on paper is refused here,
        // with a clear message; the open judges the rest (links).
        if normalize(p).is_none() {
            return Err(format!(
                "{} leads outside the session's directory {} (`..` climbs above it); only files inside it can be used",
                Shown(path),
                root.display()
            ));
        }
        return Ok(p.to_owned());
    }
    let outside = || {
        format!(
            "`{path}` is outside the session's directory {}; give a path relative to it or an absolute path inside it",
            root.display()
        )
    };
    let norm = normalize(p).ok_or_else(outside)?;
    for base in [root, given] {
        if let Ok(rel) = norm.strip_prefix(base) {
            return Ok(if rel.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                rel.to_owned()
            });
        }
    }
    Err(outside())
}

/// The lexical helper behind [`crate::resolve`]: the absolute path of
/// `path` inside `root`, or an error when it is not inside.
pub(crate) fn lexical(root: &Path, path: &str) -> Result<PathBuf, String> {
    let real = root
        .canonicalize()
        .map_err(|e| format!("the working directory {} is unusable: {e}", root.display()))?;
    let rel = relative_to(&real, root, path)?;
    let norm = normalize(&rel).ok_or_else(|| {
        format!(
            "{path} is outside the session's directory {}; `..` may not climb above it",
            real.display()
        )
    })?;
    // `join("")` would add a trailing slash: the root itself stays as it is.
    if norm.as_os_str().is_empty() {
        return Ok(real);
    }
    Ok(real.join(norm))
}

/// What a file is, when it is not a regular file.
fn not_regular(meta: &Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    if t.is_file() {
        None
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_block_device() {
        Some("a block device")
    } else if t.is_symlink() {
        Some("a symbolic link")
    } else {
        Some("a special file")
    }
}

/// Refuses files on pseudo file systems, whose sizes lie and whose reads
/// have effects or never end.
#[cfg(target_os = "linux")]
fn pseudo_fs(file: &File) -> Option<&'static str> {
    // The numbers are 32 bits; `f_type` is signed, and 32 bits wide on
    // some targets.
    pseudo_fs_named(u64::from(rustix::fs::fstatfs(file).ok()?.f_type as u32))
}

/// The kernel's pseudo file systems by their magic number (`statfs`'s
/// `f_type`, `linux/magic.h`): the kernel's and processes' state, whose
/// files are not data on disk.
#[cfg(target_os = "linux")]
fn pseudo_fs_named(f_type: u64) -> Option<&'static str> {
    const PSEUDO: &[(u64, &str)] = &[
        (0x9fa0, "procfs"),
        (0x6265_6572, "sysfs"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0x7363_6673, "securityfs"),
        (0x6367_7270, "cgroup2"),
        (0x0027_e0eb, "cgroup"),
        (0x6265_6570, "configfs"),
        (0xcafe_4a11, "bpffs"),
        (0xde5e_81e4, "efivarfs"),
        (0x6165_676c, "pstore"),
        (0x6573_5543, "fusectl"),
        (0x0000_1cd1, "devpts"),
        (0xf97c_ff8c, "selinuxfs"),
        (0x4341_5d53, "smackfs"),
        (0x6e73_6673, "nsfs"),
        (0x0765_5821, "resctrl"),
        (0xabba_1974, "xenfs"),
        (0x4249_4e4d, "binfmt_misc"),
        (0x1980_0202, "mqueue"),
        (0x0000_9fa1, "openprom"),
        (0x0000_9fa2, "usbdevfs"),
    ];
    PSEUDO
        .iter()
        .find(|(magic, _)| *magic == f_type)
        .map(|(_, name)| *name)
}

#[cfg(not(target_os = "linux"))]
fn pseudo_fs(_: &File) -> Option<&'static str> {
    None
}

/// Flags of every open: a FIFO never blocks the open, a terminal never
/// becomes ours.
fn flags() -> i32 {
    use rustix::fs::OFlags;
    (OFlags::NONBLOCK | OFlags::NOCTTY).bits() as i32
}

/// How the file tools name a file in messages.
pub(crate) struct Shown<'a>(pub &'a str);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`", self.0)
    }
}

impl Root {
    /// Opens the session's directory `root`.
    pub fn open(root: &Path) -> Result<Root, String> {
        let path = root
            .canonicalize()
            .map_err(|e| format!("the working directory {} is unusable: {e}", root.display()))?;
        let dir = Dir::open_ambient_dir(&path, cap_std::ambient_authority())
            .map_err(|e| format!("the working directory {} is unusable: {e}", path.display()))?;
        if protected(&dir) {
            return Err(format!(
                "the working directory {} is inside the daemon's own data; no tool works there",
                path.display()
            ));
        }
        Ok(Root {
            dir,
            path,
            given: root.to_owned(),
        })
    }

    /// Its canonical path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path` (as a model gave it) relative to the directory, lexically.
    /// `..` that stays inside on paper is left for the open to judge
    /// (it may follow a link).
    pub fn relative(&self, path: &str) -> Result<PathBuf, String> {
        relative_to(&self.path, &self.given, path)
    }

    /// A message for an I/O error on `path` while trying to `what`.
    pub fn error(&self, what: &str, path: &str, e: &io::Error) -> String {
        // cap-std's word for a path that would leave the directory.
        if e.kind() == io::ErrorKind::PermissionDenied && e.to_string().contains("outside") {
            return format!(
                "{} leads outside the session's directory {} (through `..` or a symbolic link; links with absolute targets are never followed); only files inside it can be used",
                Shown(path),
                self.path.display()
            );
        }
        if e.kind() == io::ErrorKind::NotFound {
            return format!("cannot {what} {}: it does not exist", Shown(path));
        }
        format!("cannot {what} {}: {e}", Shown(path))
    }

    fn refuse(&self, path: &str, kind: &str) -> String {
        let hint = match kind {
            "a directory" => "; use list_dir to see what it holds",
            _ => "; the file tools only use regular files (use shell for anything else)",
        };
        format!("{} is {kind}, not a regular file{hint}", Shown(path))
    }

    /// Checks an opened file: a regular file, not on a pseudo file system.
    fn vet(&self, file: &File, path: &str) -> Result<u64, String> {
        let meta = file
            .metadata()
            .map_err(|e| self.error("inspect", path, &e))?;
        if let Some(kind) = not_regular(&meta) {
            return Err(self.refuse(path, kind));
        }
        if let Some(fs) = pseudo_fs(file) {
            return Err(format!(
                "{} is on {fs}, not a regular file on disk; the file tools do not read it (use shell)",
                Shown(path)
            ));
        }
        if protected_file(file) {
            return Err(protected_message(path));
        }
        Ok(meta.len())
    }

    /// Opens `rel` for reading: a regular file, checked on the opened
    /// handle. Returns it with its size.
    pub fn open_read(&self, rel: &Path, path: &str) -> Result<(File, u64), String> {
        // Look first, so a device node is never even opened.
        match self.dir.metadata(rel) {
            Ok(m) => {
                if let Some(kind) = not_regular(&m) {
                    return Err(self.refuse(path, kind));
                }
            }
            Err(e) => return Err(self.error("read", path, &e)),
        }
        let mut o = OpenOptions::new();
        o.read(true).custom_flags(flags());
        let file = self
            .dir
            .open_with(rel, &o)
            .map_err(|e| self.error("read", path, &e))?;
        let len = self.vet(&file, path)?;
        Ok((file, len))
    }

    /// Why a write to `rel` would be refused, told before anything is
    /// created or changed (a patch checks all its files first): where it
    /// lands (not the daemon's own data, not a repository's own
    /// directory; a path that cannot be resolved so is checked by its name
    /// here and on the opened handle), and what is there (a regular file
    /// with one name, or nothing). `Ok(true)` when nothing is there.
    pub fn check_write(&self, rel: &Path, path: &str) -> Result<bool, String> {
        let real = self.landing(rel, path)?;
        if let Some(refused) = git_dir_refusal(real.as_deref().unwrap_or(rel), path) {
            return Err(refused);
        }
        match self.dir.metadata(rel) {
            Ok(m) => {
                if let Some(kind) = not_regular(&m) {
                    return Err(self.refuse(path, kind));
                }
                if let Some(refused) = linked_refusal(m.is_file(), m.nlink(), path) {
                    return Err(refused);
                }
                Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(self.error("write", path, &e)),
        }
    }

    /// Opens `rel` for writing (created if missing, with its parent
    /// directories; emptied): [`Self::check_write`] first, then a regular
    /// file, checked on the opened handle before anything is changed.
    pub fn open_write(&self, rel: &Path, path: &str) -> Result<File, String> {
        if self.check_write(rel, path)?
            && let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty())
        {
            self.dir
                .create_dir_all(parent)
                .map_err(|e| self.error("create the parent directories of", path, &e))?;
        }
        let mut o = OpenOptions::new();
        o.write(true).create(true).custom_flags(flags());
        let file = self
            .dir
            .open_with(rel, &o)
            .map_err(|e| self.error("write", path, &e))?;
        self.vet(&file, path)?;
        // Reached by another name (a link to it), or given one meanwhile.
        if let Some(refused) = git_dir_refusal_of(&file, path) {
            return Err(refused);
        }
        let meta = file.metadata().map_err(|e| self.error("write", path, &e))?;
        if let Some(refused) = linked_refusal(meta.is_file(), meta.nlink(), path) {
            return Err(refused);
        }
        file.set_len(0).map_err(|e| self.error("write", path, &e))?;
        Ok(file)
    }

    /// Where a write to `rel` would land: [`Self::editor_path`], or, for a
    /// dangling link (or a chain of them, as many as the kernel follows),
    /// where its target would be created; the open would create that
    /// file before its handle could be checked. `None` when it cannot be
    /// told and nothing would be created unchecked (a link with an
    /// absolute target, never followed: the open refuses it). A `..`
    /// after a directory that does not exist is refused: creating the
    /// parents would make it resolvable, past this check.
    fn landing(&self, rel: &Path, path: &str) -> Result<Option<PathBuf>, String> {
        let mut at = rel.to_owned();
        // The path itself, then each link's target: 40 links at most.
        for _ in 0..=MAX_LINKS {
            match self.editor_path(&at, path) {
                Ok(real) => return Ok(Some(real)),
                Err(e) if e == protected_message(path) => return Err(e),
                Err(_) => {}
            }
            let is_link = self
                .dir
                .symlink_metadata(&at)
                .is_ok_and(|m| m.file_type().is_symlink());
            let target = match self.dir.read_link_contents(&at) {
                Ok(t) if is_link && t.is_relative() => t,
                _ if self.climbs_from_missing(&at) => {
                    return Err(format!(
                        "{} goes through `..` after a directory that does not exist; give the path without it",
                        Shown(path)
                    ));
                }
                _ => return Ok(None),
            };
            at = at.parent().unwrap_or(Path::new("")).join(target);
        }
        Err(format!(
            "{} goes through more than {MAX_LINKS} symbolic links",
            Shown(path)
        ))
    }

    /// Whether a `..` in `rel` follows a directory that does not exist
    /// (the open would fail, but creating the parents first would make
    /// it resolvable).
    fn climbs_from_missing(&self, rel: &Path) -> bool {
        let mut prefix = PathBuf::new();
        for c in rel.components() {
            if c == Component::ParentDir
                && !prefix.as_os_str().is_empty()
                && self.dir.symlink_metadata(&prefix).is_err()
            {
                return true;
            }
            prefix.push(c);
        }
        false
    }

    /// Opens the directory `rel`.
    pub fn open_dir(&self, rel: &Path, path: &str) -> Result<Dir, String> {
        match self.dir.metadata(rel) {
            Ok(m) if !m.is_dir() => {
                return Err(format!("{} is not a directory", Shown(path)));
            }
            Ok(_) => {}
            Err(e) => return Err(self.error("list", path, &e)),
        }
        let dir = self
            .dir
            .open_dir(rel)
            .map_err(|e| self.error("list", path, &e))?;
        if protected(&dir) {
            return Err(protected_message(path));
        }
        Ok(dir)
    }

    /// Whether anything at all is at `rel` (a link is not followed).
    pub fn names_something(&self, rel: &Path) -> bool {
        self.dir.symlink_metadata(rel).is_ok()
    }

    /// The metadata of `rel` (links inside followed).
    pub fn metadata(&self, rel: &Path, path: &str) -> Result<Metadata, String> {
        self.dir
            .metadata(rel)
            .map_err(|e| self.error("read", path, &e))
    }

    /// The absolute path of `rel` with no symbolic link in it, for an
    /// editor (which opens paths itself): the longest existing prefix is
    /// resolved through the handle (so a link out is refused), the rest
    /// appended. A dangling link is refused: the editor would follow it.
    pub fn editor_path(&self, rel: &Path, path: &str) -> Result<PathBuf, String> {
        let mut existing = rel.to_owned();
        let mut rest: Vec<std::ffi::OsString> = Vec::new();
        loop {
            let probe = if existing.as_os_str().is_empty() {
                Path::new(".")
            } else {
                existing.as_path()
            };
            match self.dir.symlink_metadata(probe) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.error("resolve", path, &e)),
            }
            match (existing.file_name(), existing.parent()) {
                (Some(name), Some(parent)) => {
                    rest.push(name.to_owned());
                    existing = parent.to_owned();
                }
                // `..` or `.` at the end: resolve it as it is.
                _ => break,
            }
        }
        let probe = if existing.as_os_str().is_empty() {
            Path::new(".")
        } else {
            existing.as_path()
        };
        let real = self.dir.canonicalize(probe).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                format!(
                    "{} goes through a dangling symbolic link; the editor cannot be asked to follow it",
                    Shown(path)
                )
            } else {
                self.error("resolve", path, &e)
            }
        })?;
        let mut out = self.path.join(real);
        for r in rest.into_iter().rev() {
            if r == OsStr::new("..") || r == OsStr::new(".") {
                return Err(format!(
                    "{} leads outside the session's directory {}",
                    Shown(path),
                    self.path.display()
                ));
            }
            out.push(r);
        }
        let out = normalize(&out).unwrap_or(out);
        let linked = || {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(&out).is_ok_and(|m| linked_to_protected(m.nlink(), m.dev(), m.ino()))
        };
        if protected_path(&out) || linked() {
            return Err(protected_message(path));
        }
        if !out.starts_with(&self.path) {
            return Err(format!(
                "{} leads outside the session's directory {}",
                Shown(path),
                self.path.display()
            ));
        }
        Ok(out)
    }
}

/// Calls `f(dir, rel, name)` for every regular file under `dir` (whose
/// path is `rel`), never following symbolic links, skipping
/// [`SKIP_DIRS`] and anything it cannot open; stops when `f` breaks, or
/// when `stop` says so (asked at every entry, whatever its kind).
pub(crate) fn walk(
    dir: &Dir,
    rel: &Path,
    stop: &dyn Fn() -> bool,
    f: &mut dyn FnMut(&Dir, &Path, &OsStr) -> ControlFlow<()>,
) -> ControlFlow<()> {
    walk_at(dir, rel, 0, stop, f)
}

fn walk_at(
    dir: &Dir,
    rel: &Path,
    depth: usize,
    stop: &dyn Fn() -> bool,
    f: &mut dyn FnMut(&Dir, &Path, &OsStr) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let Ok(entries) = dir.entries() else {
        return ControlFlow::Continue(());
    };
    for entry in entries.filter_map(Result::ok) {
        if stop() {
            return ControlFlow::Break(());
        }
        let Ok(t) = entry.file_type() else { continue };
        let name = entry.file_name();
        let child = rel.join(&name);
        if t.is_dir() {
            if depth + 1 >= MAX_DEPTH || SKIP_DIRS.iter().any(|s| OsStr::new(s) == name) {
                continue;
            }
            if let Ok(sub) = entry.open_dir()
                && !protected(&sub)
            {
                walk_at(&sub, &child, depth + 1, stop, f)?;
            }
        } else if t.is_file() {
            f(dir, &child, &name)?;
        }
    }
    ControlFlow::Continue(())
}

/// Opens `name` in `dir` for reading when it is a regular file on a real
/// file system (for the walkers: anything else is skipped).
pub(crate) fn open_walked(dir: &Dir, name: &OsStr) -> Option<File> {
    let mut o = OpenOptions::new();
    o.read(true).custom_flags(flags());
    let file = dir.open_with(name, &o).ok()?;
    let meta = file.metadata().ok()?;
    (meta.is_file() && pseudo_fs(&file).is_none() && !protected_file(&file)).then_some(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pseudo file system the kernel's headers name is known by its
    /// number (checked against libc's), and the real /proc and /sys are
    /// found so on this machine; a disk's file is not.
    #[cfg(target_os = "linux")]
    #[test]
    fn pseudo_file_systems_are_known_by_the_kernel_s_numbers() {
        let known = [
            (libc::PROC_SUPER_MAGIC as u64, "procfs"),
            (libc::SYSFS_MAGIC as u64, "sysfs"),
            (libc::DEBUGFS_MAGIC as u64, "debugfs"),
            (libc::TRACEFS_MAGIC as u64, "tracefs"),
            (libc::SECURITYFS_MAGIC as u64, "securityfs"),
            (libc::CGROUP2_SUPER_MAGIC as u64, "cgroup2"),
            (libc::CGROUP_SUPER_MAGIC as u64, "cgroup"),
            (libc::BPF_FS_MAGIC as u64, "bpffs"),
            (libc::DEVPTS_SUPER_MAGIC as u64, "devpts"),
            (libc::SELINUX_MAGIC as u64, "selinuxfs"),
            (libc::SMACK_MAGIC as u64, "smackfs"),
            (libc::NSFS_MAGIC as u64, "nsfs"),
            (libc::RDTGROUP_SUPER_MAGIC as u64, "resctrl"),
            (libc::XENFS_SUPER_MAGIC as u64, "xenfs"),
            (libc::OPENPROM_SUPER_MAGIC as u64, "openprom"),
            (libc::USBDEVICE_SUPER_MAGIC as u64, "usbdevfs"),
            // Not in libc: linux/magic.h.
            (0xde5e_81e4, "efivarfs"),
            (0x6165_676c, "pstore"),
            (0x6573_5543, "fusectl"),
            (0x6265_6570, "configfs"),
            (0x4249_4e4d, "binfmt_misc"),
            (0x1980_0202, "mqueue"),
        ];
        for (magic, name) in known {
            assert_eq!(pseudo_fs_named(magic), Some(name), "{magic:#x}");
        }
        let on = |dir: &str, file: &str| {
            let d = Dir::open_ambient_dir(dir, cap_std::ambient_authority()).unwrap();
            pseudo_fs(&d.open(file).unwrap())
        };
        assert_eq!(on("/proc/self", "status"), Some("procfs"));
        assert_eq!(on("/sys/devices/system/cpu", "online"), Some("sysfs"));
        let disk = tempfile::tempdir().unwrap();
        std::fs::write(disk.path().join("f"), "x").unwrap();
        assert_eq!(on(disk.path().to_str().unwrap(), "f"), None);
    }

    #[test]
    fn absolute_and_relative_paths_map_into_the_root() {
        let root = Path::new("/srv/proj");
        let given = Path::new("/link/proj");
        // (input, Ok(relative) or Err)
        let cases: &[(&str, Result<&str, ()>)] = &[
            ("a/b", Ok("a/b")),
            ("a/../b", Ok("a/../b")), // judged by the open, through the handle
            ("link/../b", Ok("link/../b")),
            ("../x", Err(())),
            ("a/../../x", Err(())),
            ("/srv/proj", Ok(".")),
            ("/srv/proj/a/b", Ok("a/b")),
            ("/srv/proj/a/../b", Ok("b")),
            ("/srv/proj/../proj/b", Ok("b")),
            ("/link/proj/c", Ok("c")),
            ("/srv/proj/../other", Err(())),
            ("/srv/projx/a", Err(())),
            ("/etc/passwd", Err(())),
            ("/../../etc", Err(())),
            ("", Err(())),
        ];
        for (input, want) in cases {
            let got = relative_to(root, given, input);
            match (want, &got) {
                (Ok(w), Ok(g)) => assert_eq!(g, Path::new(w), "{input}"),
                (Err(()), Err(e)) => assert!(
                    input.is_empty() || e.contains("outside the session's directory /srv/proj"),
                    "{input}: {e}"
                ),
                _ => panic!("{input}: {got:?}"),
            }
        }
    }
}
