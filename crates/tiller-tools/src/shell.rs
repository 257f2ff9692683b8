//! Running a `shell` command locally: a scrubbed environment, output
//! streamed into one bounded buffer, and everything the command started
//! killed when it ends, times out or the call is dropped.
//!
//! With a supervisor ([`ToolsConfig::supervisor`]) the daemon starts
//! `<supervisor> __supervise -- sh -c CMD` with a pipe as its stdin (the
//! *lifeline*) and closes that pipe to have the supervisor kill the whole
//! tree (see [`crate::supervise`]); the supervisor is SIGKILLed (with its
//! process group) only as a last resort, when it has not exited
//! [`STOP_GRACE`] after. Without one, `sh` runs in its own process group
//! and the group is killed.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStdin};
use tokio::time::Instant;

use crate::bounded::OutputBuffer;
use crate::{CommandOutput, SUPERVISE_ARG, ToolsConfig};

/// How long a supervisor gets to clean up after its lifeline closed.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// How long output is still read after the command exited and its
/// leftovers were killed (a process that escaped may hold the pipes).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Runs `sh -c command` in `cwd` for at most `timeout`.
pub(crate) async fn run_local(
    command: &str,
    cwd: &Path,
    timeout: Duration,
    cfg: &ToolsConfig,
) -> Result<CommandOutput, String> {
    let deadline = Instant::now() + timeout;
    let mut running = Running::spawn(command, cwd, cfg).await?;
    let mut out = OutputBuffer::head_and_tail(cfg.max_output_bytes);
    let (status, timed_out) = drive(&mut running, deadline, |b| out.push(b)).await?;
    Ok(CommandOutput {
        output: out.finish(),
        exit_code: if timed_out {
            None
        } else {
            status.and_then(|s| s.code())
        },
        timed_out,
    })
}

/// Reads a started command's output into `push` until it exits (and its
/// pipes end) or `deadline` passes (then it is stopped). Returns its exit
/// status and whether it timed out.
async fn drive(
    running: &mut Running,
    deadline: Instant,
    mut push: impl FnMut(&[u8]),
) -> Result<(Option<ExitStatus>, bool), String> {
    let mut stdout = running.child.as_mut().and_then(|c| c.stdout.take());
    let mut stderr = running.child.as_mut().and_then(|c| c.stderr.take());
    let (mut b1, mut b2) = (vec![0u8; 8192], vec![0u8; 8192]);
    let mut status: Option<ExitStatus> = None;
    let mut until = deadline;
    let timed_out = loop {
        if stdout.is_none() && stderr.is_none() && status.is_some() {
            break false;
        }
        tokio::select! {
            r = read(stdout.as_mut(), &mut b1) => match r {
                Some(n) => push(&b1[..n]),
                None => stdout = None,
            },
            r = read(stderr.as_mut(), &mut b2) => match r {
                Some(n) => push(&b2[..n]),
                None => stderr = None,
            },
            s = running.wait(), if status.is_none() => {
                status = Some(s.map_err(|e| format!("cannot wait for the command: {e}"))?);
                // Leftovers of the command die now (the supervisor has
                // killed its own), so the pipes reach their end.
                running.kill_leftovers();
                until = deadline.min(Instant::now() + DRAIN_GRACE);
            },
            () = tokio::time::sleep_until(until) => break status.is_none(),
        }
    };
    if timed_out {
        running.stop().await;
    }
    Ok((status, timed_out))
}

/// Most background commands a session keeps (finished ones are forgotten
/// first to make room).
pub(crate) const MAX_JOBS: usize = 8;

/// How long a background command may run before it is killed.
pub(crate) const BACKGROUND_LIMIT: Duration = Duration::from_secs(3600);

/// A session's background commands (`shell` with `background: true`),
/// read with `shell_output`. Dropped with the session's tools: every
/// command still running is killed with everything it started.
#[derive(Default)]
pub(crate) struct Jobs(std::sync::Mutex<JobList>);

#[derive(Default)]
struct JobList {
    next: u64,
    jobs: std::collections::BTreeMap<u64, Job>,
}

struct Job {
    command: String,
    state: std::sync::Arc<std::sync::Mutex<JobState>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Job {
    /// Dropping the task drops its command, which kills it.
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct JobState {
    out: OutputBuffer,
    /// How it ended; `None` while it runs.
    end: Option<String>,
}

impl Jobs {
    fn list(&self) -> std::sync::MutexGuard<'_, JobList> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any command was started (running, or its output still
    /// readable with `shell_output`).
    pub(crate) fn is_empty(&self) -> bool {
        self.list().jobs.is_empty()
    }

    /// Starts `command` in `cwd`; returns what to tell the model.
    pub(crate) async fn start(
        &self,
        command: &str,
        cwd: &Path,
        cfg: &ToolsConfig,
    ) -> Result<String, String> {
        {
            let mut list = self.list();
            if list.jobs.len() >= MAX_JOBS {
                let done = list
                    .jobs
                    .iter()
                    .find(|(_, j)| j.state.lock().is_ok_and(|s| s.end.is_some()))
                    .map(|(id, _)| *id);
                match done {
                    Some(id) => {
                        list.jobs.remove(&id);
                    }
                    None => {
                        return Err(format!(
                            "{MAX_JOBS} background commands are running; stop one with shell_output {{\"id\": N, \"stop\": true}}"
                        ));
                    }
                }
            }
        }
        let mut running = Running::spawn(command, cwd, cfg).await?;
        let state = std::sync::Arc::new(std::sync::Mutex::new(JobState {
            out: OutputBuffer::head_and_tail(cfg.max_output_bytes),
            end: None,
        }));
        let st = state.clone();
        let task = tokio::spawn(async move {
            let deadline = Instant::now() + BACKGROUND_LIMIT;
            let push = |b: &[u8]| {
                if let Ok(mut s) = st.lock() {
                    s.out.push(b);
                }
            };
            let end = match drive(&mut running, deadline, push).await {
                Ok((_, true)) => format!("killed after {}s", BACKGROUND_LIMIT.as_secs()),
                Ok((Some(s), false)) => match s.code() {
                    Some(c) => format!("exit code {c}"),
                    None => "killed by a signal".into(),
                },
                Ok((None, false)) => "ended".into(),
                Err(e) => e,
            };
            if let Ok(mut s) = st.lock() {
                s.end = Some(end);
            }
        });
        let mut list = self.list();
        list.next += 1;
        let id = list.next;
        list.jobs.insert(
            id,
            Job {
                command: command.to_owned(),
                state,
                task,
            },
        );
        Ok(format!(
            "started background command {id}; read its output with shell_output {{\"id\": {id}}}"
        ))
    }

    /// A background command's output so far and whether it still runs;
    /// `stop` kills it first.
    pub(crate) fn output(&self, id: u64, stop: bool) -> Result<String, String> {
        let mut list = self.list();
        let known: Vec<String> = list.jobs.keys().map(u64::to_string).collect();
        let Some(job) = list.jobs.get_mut(&id) else {
            return Err(format!(
                "no background command {id}; known: {}",
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                }
            ));
        };
        if stop && !job.task.is_finished() {
            job.task.abort();
            if let Ok(mut s) = job.state.lock()
                && s.end.is_none()
            {
                s.end = Some("stopped".into());
            }
        }
        let s = job
            .state
            .lock()
            .map_err(|_| "the command's output is unusable".to_owned())?;
        let status = s.end.clone().unwrap_or_else(|| "running".into());
        let out = s.out.snapshot();
        let printed = out.trim_end();
        Ok(format!(
            "$ {}\n{}{}[{status}]",
            job.command,
            printed,
            if printed.is_empty() { "" } else { "\n" }
        ))
    }
}

/// The next chunk from a pipe; `None` at its end (or error). A pipe
/// already closed never answers.
async fn read<R: AsyncReadExt + Unpin>(pipe: Option<&mut R>, buf: &mut [u8]) -> Option<usize> {
    match pipe {
        Some(p) => match p.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}

/// A started command, killed (with everything it started) when dropped
/// before it ended.
struct Running {
    /// The process started: the supervisor, or `sh`. `None` once handed
    /// to the reaper on drop.
    child: Option<Child>,
    /// The supervisor's stdin: closing it tells the supervisor to kill
    /// the tree. `None` without a supervisor (or once closed).
    lifeline: Option<ChildStdin>,
    /// The process group to kill as a last resort: the child's pid (the
    /// supervisor leads its own session, `sh` its own group).
    pgid: Option<Pid>,
    /// Whether the child is a supervisor.
    supervised: bool,
    /// The child has exited and was reaped.
    exited: bool,
}

impl Running {
    async fn spawn(command: &str, cwd: &Path, cfg: &ToolsConfig) -> Result<Running, String> {
        let supervised = cfg.supervisor.is_some();
        let mut cmd = match &cfg.supervisor {
            Some(sup) => {
                let mut c = tokio::process::Command::new(sup);
                // No `process_group` here: the supervisor calls `setsid`,
                // which a group leader may not; it leads a new session
                // (and group) right after.
                c.args([SUPERVISE_ARG, "--", "sh", "-c"])
                    .arg(command)
                    .stdin(Stdio::piped());
                c
            }
            None => {
                let mut c = tokio::process::Command::new("sh");
                c.arg("-c")
                    .arg(command)
                    .stdin(Stdio::null())
                    // Its own process group, so a timeout or a cancelled
                    // turn kills everything the command started (unless
                    // it left the group).
                    .process_group(0)
                    .kill_on_drop(true);
                c
            }
        };
        cmd.current_dir(cwd)
            .env_clear()
            .envs(cfg.child_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // fork and exec block: not on an async worker.
        let mut child = tokio::task::spawn_blocking(move || cmd.spawn())
            .await
            .map_err(|e| format!("cannot start the command: {e}"))?
            .map_err(|e| match &cfg.supervisor {
                Some(s) => format!(
                    "cannot start the command supervisor {}: {e}; check tools.supervisor",
                    s.display()
                ),
                None => format!("cannot start the command: {e}"),
            })?;
        let lifeline = child.stdin.take();
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw);
        Ok(Running {
            child: Some(child),
            lifeline,
            pgid,
            supervised,
            exited: false,
        })
    }

    /// Waits for the child to exit (cancel-safe).
    async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        let child = self.child.as_mut().expect("the child is kept until drop");
        let s = child.wait().await?;
        self.exited = true;
        Ok(s)
    }

    /// After the command exited: without a supervisor, kills what is left
    /// of its process group (with one, the supervisor already did).
    fn kill_leftovers(&self) {
        if !self.supervised
            && let Some(g) = self.pgid
        {
            let _ = kill_process_group(g, Signal::KILL);
        }
    }

    /// Stops a command that is still running (the timeout): closes the
    /// lifeline and gives the supervisor [`STOP_GRACE`] to clean up, then
    /// (or at once without a supervisor) kills the group and the child.
    async fn stop(&mut self) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        if self.supervised {
            drop(self.lifeline.take());
            if tokio::time::timeout(STOP_GRACE, child.wait()).await.is_ok() {
                self.exited = true;
                return;
            }
        }
        if let Some(g) = self.pgid {
            let _ = kill_process_group(g, Signal::KILL);
        }
        let _ = child.kill().await;
        self.exited = true;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let still_running = !self.exited && matches!(child.try_wait(), Ok(None));
        if !self.supervised {
            // Like the old behaviour: whatever is left of the group dies,
            // and `kill_on_drop` kills `sh`.
            if let Some(g) = self.pgid {
                let _ = kill_process_group(g, Signal::KILL);
            }
            return;
        }
        if !still_running {
            return;
        }
        // Cancelled: close the lifeline (the supervisor kills the tree),
        // and kill the supervisor's group only if it is still there after
        // the grace period.
        drop(self.lifeline.take());
        let pgid = self.pgid;
        let last_resort = async move {
            if tokio::time::timeout(STOP_GRACE, child.wait())
                .await
                .is_err()
            {
                if let Some(g) = pgid {
                    let _ = kill_process_group(g, Signal::KILL);
                }
                let _ = child.kill().await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(last_resort);
            }
            Err(_) => {
                // No runtime (dropped while shutting down): the child was
                // started by one that is gone; the closed lifeline is all
                // we can do.
            }
        }
    }
}
