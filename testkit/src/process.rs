//! Child processes under test (Musubi, its bench): their output collected on threads so a
//! full pipe never stalls them, their time bounded so a hung VM fails the test instead of
//! hanging the suite, and every one reaped, also when a test fails while it runs.

use serde_json::Value;
use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a finished run printed, and how it ended.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// The probe guest's result lines on the console; a malformed one fails the test.
    pub fn results(&self) -> Vec<Value> {
        crate::probe::results_in(&self.stdout)
    }

    pub fn result(&self, task: &str) -> Value {
        self.results()
            .into_iter()
            .find(|v| v["probe"] == task)
            .unwrap_or_else(|| {
                panic!(
                    "no {task} result in output:\n{}\nstderr:\n{}",
                    self.stdout, self.stderr
                )
            })
    }

    pub fn explain(&self) -> String {
        format!(
            "status {:?}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` with `args`, `input` written to a pipe on stdin and then closed (stdin is
/// empty without it), and fails the test after `limit`.
pub fn run_command<S: AsRef<OsStr>>(
    cmd: Command,
    args: &[S],
    input: Option<&[u8]>,
    limit: Duration,
) -> Run {
    start_command(cmd, args, input).finish(limit)
}

/// A process whose output is being collected, for tests that act on it while it
/// runs (its pid, a signal). Dropped before it ended (a test that failed while it ran), it
/// is killed and reaped, so no VM outlives its test.
pub struct Started {
    pub child: Child,
    pub what: String,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
}

/// Fails the test, saying why, on a machine without `/dev/kvm`: the test boots VMs.
pub fn assert_kvm() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "these tests boot VMs and need /dev/kvm, which this machine lacks"
    );
}

/// Starts `cmd` with `args` as [`run_command`] does, without waiting for it. VMs need
/// `/dev/kvm`: without it the test fails saying so.
pub fn start_command<S: AsRef<OsStr>>(
    mut cmd: Command,
    args: &[S],
    input: Option<&[u8]>,
) -> Started {
    assert_kvm();
    let shown: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
    let what = format!("{} {shown:?}", cmd.get_program().to_string_lossy());
    let mut child = cmd
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    if let (Some(data), Some(mut stdin)) = (input, child.stdin.take()) {
        // Small inputs fit in the pipe, so this does not wait for the guest to read.
        stdin.write_all(data).expect("stdin takes the input");
    }
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    Started {
        child,
        what,
        out: Some(std::thread::spawn(move || {
            std::io::read_to_string(out).unwrap_or_default()
        })),
        err: Some(std::thread::spawn(move || {
            std::io::read_to_string(err).unwrap_or_default()
        })),
    }
}

impl Started {
    /// Waits for the process (failing the test after `limit`) and returns what it printed.
    pub fn finish(mut self, limit: Duration) -> Run {
        let status = wait_with_limit(&mut self.child, limit, &self.what);
        let joined = |h: Option<std::thread::JoinHandle<String>>| {
            h.map(|h| h.join().unwrap()).unwrap_or_default()
        };
        Run {
            code: status.code(),
            stdout: joined(self.out.take()),
            stderr: joined(self.err.take()),
        }
    }

    /// Polls `poll` until it has an answer and returns it; fails the test, naming `what` it
    /// waited for, if the process ends first or after `limit`.
    pub fn wait_for<T>(
        &mut self,
        limit: Duration,
        mut poll: impl FnMut() -> Option<T>,
        what: impl Fn() -> String,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = poll() {
                return v;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!("{} ended ({s}) while waiting for {}", self.what, what());
            }
            assert!(
                start.elapsed() < limit,
                "no {} after {limit:?} ({} still runs)",
                what(),
                self.what
            );
            std::thread::sleep(crate::wait::POLL);
        }
    }

    /// Waits until the file `path` (a VM's `--serial file=`) contains `needle` and returns
    /// its text; fails the test if the process ends first or after `limit`.
    pub fn wait_for_text(&mut self, path: &Path, needle: &str, limit: Duration) -> String {
        self.wait_for(
            limit,
            || Some(crate::read_text(path)).filter(|t| t.contains(needle)),
            || {
                format!(
                    "{needle:?} in {}, which holds:\n{}",
                    path.display(),
                    crate::read_text(path)
                )
            },
        )
    }

    /// Waits until `path` exists (a socket or file the process makes once it runs).
    pub fn wait_for_file(&mut self, path: &Path, limit: Duration) {
        self.wait_for(
            limit,
            || path.exists().then_some(()),
            || path.display().to_string(),
        )
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits for `child`; after `limit` stops it and fails the test, naming `what`.
pub fn wait_with_limit(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > limit {
            // SIGTERM first, so the VMM flushes and a benchmark's guards remove what it
            // created (partitions, cgroups); SIGKILL if that does not end it.
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_dropped_while_it_runs_is_killed_and_reaped() {
        let started = start_command(Command::new("sleep"), &["600"], None);
        let proc_dir = format!("/proc/{}", started.child.id());
        drop(started);
        // Reaped: not even a zombie is left.
        assert!(!Path::new(&proc_dir).exists(), "{proc_dir} is still there");
    }

    #[test]
    fn a_wait_ends_when_the_process_prints_what_it_waits_for() {
        let dir = std::env::temp_dir().join(format!("testkit-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("out");
        let script = format!("sleep 0.2; echo ready > {}; sleep 600", file.display());
        let mut started = start_command(Command::new("sh"), &["-c", &script], None);
        let text = started.wait_for_text(&file, "ready", Duration::from_secs(30));
        assert_eq!(text, "ready\n");
        drop(started);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
