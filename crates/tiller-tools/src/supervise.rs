//! The command supervisor: a tiny process between the daemon and `sh`
//! that kills everything the command started, wherever it went.
//!
//! A process group is not enough: `setsid cmd &` leaves it, and so does
//! anything that calls `setpgid`. The supervisor instead becomes a *child
//! subreaper*: every orphan in the tree below it is reparented to it, so
//! its children (found in `/proc`) are always all that is left of the
//! command. When `sh` exits, or when the daemon closes the supervisor's
//! stdin (a timeout, a cancelled turn, a dropped call, or the daemon
//! dying), it SIGKILLs its children and their process groups, reaps them,
//! and repeats until it has no children left.
//!
//! The daemon binary runs it as `tiller __supervise -- sh -c COMMAND` and
//! calls [`supervise`] with the arguments after [`SUPERVISE_ARG`].

use std::ffi::OsString;

/// The first argument that makes the daemon binary a supervisor.
pub const SUPERVISE_ARG: &str = "__supervise";

/// Runs `args` (an optional `--`, then a program and its arguments) as
/// the supervisor described in the module docs, and returns the exit
/// code to exit with: the program's, or 128 + the signal that killed it
/// (137 when killed because stdin closed). Synchronous: call it from
/// `main` before any runtime starts.
///
/// Stdin must be a pipe the caller keeps open while the command may run:
/// its end (EOF) means "kill everything". Stdout and stderr are passed to
/// the program; the program's stdin is `/dev/null`.
pub fn supervise(args: &[OsString]) -> i32 {
    let args = match args.first() {
        Some(a) if a == "--" => &args[1..],
        _ => args,
    };
    let Some((program, rest)) = args.split_first() else {
        eprintln!("usage: {SUPERVISE_ARG} -- PROGRAM [ARGUMENT...]");
        return 2;
    };
    imp::run(program, rest)
}

#[cfg(target_os = "linux")]
mod imp {
    use std::ffi::OsString;
    use std::os::fd::AsFd;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use rustix::event::{PollFd, PollFlags, poll};
    use rustix::io::Errno;
    use rustix::process::{
        Pid, PidfdFlags, Signal, WaitOptions, WaitStatus, getpid, kill_process, kill_process_group,
        pidfd_open, set_child_subreaper, setsid, wait, waitpid,
    };

    pub(super) fn run(program: &OsString, args: &[OsString]) -> i32 {
        // Its own session and process group, without a controlling
        // terminal. Fails only when already a group leader, which is
        // then good enough.
        let _ = setsid();
        if let Err(e) = set_child_subreaper(Some(getpid())) {
            eprintln!(
                "tiller supervisor: cannot become a child subreaper ({e}); orphans of the command may survive it"
            );
        }
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            // Its own group, so killing it never kills us.
            .process_group(0)
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) => {
                eprintln!("tiller supervisor: cannot start {}: {e}", program.display());
                return 127;
            }
        };
        let sh = Pid::from_child(&child);
        let status = watch(sh);
        let status = kill_all(sh, status);
        match status {
            Some(s) => code(s),
            None => 1,
        }
    }

    fn code(s: WaitStatus) -> i32 {
        match (s.exit_status(), s.terminating_signal()) {
            (Some(c), _) => c,
            (None, Some(sig)) => 128 + sig,
            (None, None) => 1,
        }
    }

    /// Waits until `sh` exits (its status) or stdin reaches its end
    /// (`None`).
    fn watch(sh: Pid) -> Option<WaitStatus> {
        let stdin = std::io::stdin();
        let lifeline = stdin.as_fd();
        // A pidfd makes the exit of `sh` an event to poll for; without one
        // (kernels before 5.3) we look every 50 ms.
        let pidfd = pidfd_open(sh, PidfdFlags::empty()).ok();
        let tick = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 50_000_000,
        };
        let mut buf = [0u8; 256];
        loop {
            let mut fds = vec![PollFd::new(&lifeline, PollFlags::IN)];
            if let Some(p) = &pidfd {
                fds.push(PollFd::new(p, PollFlags::IN));
            }
            let timeout = if pidfd.is_some() { None } else { Some(&tick) };
            match poll(&mut fds, timeout) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    eprintln!("tiller supervisor: poll failed ({e}); stopping the command");
                    return None;
                }
            }
            let stdin_ready = !fds[0].revents().is_empty();
            drop(fds);
            if stdin_ready {
                match rustix::io::read(lifeline, &mut buf) {
                    Ok(0) => return None,
                    Ok(_) | Err(Errno::INTR) | Err(Errno::AGAIN) => {}
                    Err(_) => return None,
                }
            }
            match waitpid(Some(sh), WaitOptions::NOHANG) {
                Ok(Some((_, status))) => return Some(status),
                Ok(None) | Err(Errno::INTR) => {}
                // Not our child any more: nothing to wait for.
                Err(_) => return None,
            }
        }
    }

    /// Kills and reaps every child until none is left; returns the status
    /// of `sh` (`known`, or seen while reaping).
    fn kill_all(sh: Pid, known: Option<WaitStatus>) -> Option<WaitStatus> {
        let me = getpid();
        let mut sh_status = known;
        // The command's own group first, in case `/proc` cannot be read.
        let _ = kill_process_group(sh, Signal::KILL);
        loop {
            for (pid, pgid) in children_of(me) {
                let _ = kill_process(pid, Signal::KILL);
                if pgid != me && pgid.as_raw_nonzero().get() > 1 {
                    let _ = kill_process_group(pgid, Signal::KILL);
                }
            }
            match wait(WaitOptions::empty()) {
                Ok(Some((pid, status))) => {
                    if pid == sh {
                        sh_status = Some(status);
                    }
                }
                Ok(None) | Err(Errno::INTR) => {}
                // ECHILD: nothing left.
                Err(_) => return sh_status,
            }
        }
    }

    /// The processes whose parent is `me`, with their process groups
    /// (from `/proc/<pid>/stat`).
    fn children_of(me: Pid) -> Vec<(Pid, Pid)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|n| {
                let stat = std::fs::read_to_string(format!("/proc/{n}/stat")).ok()?;
                let (ppid, pgid) = parse_stat(&stat)?;
                (ppid == me.as_raw_nonzero().get())
                    .then(|| Some((Pid::from_raw(n)?, Pid::from_raw(pgid)?)))?
            })
            .collect()
    }

    /// `(ppid, pgrp)` from a `/proc/<pid>/stat` line: `pid (comm) state
    /// ppid pgrp ...`, where `comm` may hold spaces and parentheses.
    pub(super) fn parse_stat(stat: &str) -> Option<(i32, i32)> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let mut f = rest.split_whitespace().skip(1);
        let ppid = f.next()?.parse().ok()?;
        let pgrp = f.next()?.parse().ok()?;
        Some((ppid, pgrp))
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::ffi::OsString;
    use std::process::{Command, Stdio};

    /// Without `/proc` and child subreapers, the program simply runs; the
    /// daemon's process-group kill is all the cleanup there is.
    pub(super) fn run(program: &OsString, args: &[OsString]) -> i32 {
        match Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .status()
        {
            Ok(s) => s.code().unwrap_or(1),
            Err(e) => {
                eprintln!("tiller supervisor: cannot start {}: {e}", program.display());
                127
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::imp::parse_stat;

    #[test]
    fn stat_lines_parse_whatever_the_command_name() {
        for (line, want) in [
            ("123 (sh) S 1 123 123 0 -1", Some((1, 123))),
            ("7 (a b) c) R 42 7 7 0", Some((42, 7))),
            ("9 ((sd-pam)) S 8 8 8", Some((8, 8))),
            ("garbage", None),
            ("1 (x) S", None),
        ] {
            assert_eq!(parse_stat(line), want, "{line}");
        }
    }
}
