//! Running a program under test (Musubi, its bench) from a test: its output collected on
//! threads so a full pipe never stalls it, its time bounded so a hung VM fails the test
//! instead of hanging the suite, and the probe guest's result lines read from its console.

use serde_json::Value;
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
    /// The probe guest's result lines on the console.
    pub fn results(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("{\"probe\""))
            .map(|l| {
                serde_json::from_str(l.trim())
                    .unwrap_or_else(|e| panic!("bad result line {l:?}: {e}"))
            })
            .collect()
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
pub fn run_command(cmd: Command, args: &[&str], input: Option<&[u8]>, limit: Duration) -> Run {
    start_command(cmd, args, input).finish(limit)
}

/// A process whose output is being collected, for tests that act on it while it
/// runs (its pid, a signal).
pub struct Started {
    pub child: Child,
    pub what: String,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

/// Starts `cmd` with `args` as [`run_command`] does, without waiting for it. VMs need
/// `/dev/kvm`: without it the test fails saying so.
pub fn start_command(mut cmd: Command, args: &[&str], input: Option<&[u8]>) -> Started {
    assert!(
        Path::new("/dev/kvm").exists(),
        "these tests need /dev/kvm, which this machine lacks"
    );
    let what = format!("{} {args:?}", cmd.get_program().to_string_lossy());
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
        out: std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default()),
        err: std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default()),
    }
}

impl Started {
    /// Waits for the process (failing the test after `limit`) and returns what it printed.
    pub fn finish(mut self, limit: Duration) -> Run {
        let status = wait_with_limit(&mut self.child, limit, &self.what);
        Run {
            code: status.code(),
            stdout: self.out.join().unwrap(),
            stderr: self.err.join().unwrap(),
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
