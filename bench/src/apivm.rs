//! A VMM process driven through its HTTP API, shared by the experiments that pause, save,
//! restore or move running VMs (`snapshot`, `migrate`): the process in a group of its own,
//! killed and reaped on every way out, and the API request whose failure quotes the VMM.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::watch::{ended_with, has_ended, kill_group, spawn_group_with_stdin};

/// Bound on one API answer (a full 4 GiB snapshot is written before it).
pub const API_TIMEOUT: Duration = Duration::from_secs(120);
/// Lines of a VMM's stderr quoted in an error.
pub const ERROR_LINES: usize = 8;

pub fn one_line(s: &str, n: usize) -> String {
    let s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() > n {
        format!("{}...", s.chars().take(n).collect::<String>())
    } else {
        s
    }
}

/// A VMM process in a group of its own, killed with its group and reaped on every way out.
pub struct Vm {
    pub child: Child,
    name: &'static str,
    pub stderr: PathBuf,
}

impl Vm {
    /// Starts `cmd` with its stdout in `dir/console.out` and its stderr in
    /// `dir/stderr.txt`.
    pub fn start(cmd: Command, name: &'static str, dir: &Path) -> Result<Vm, String> {
        Vm::start_to(cmd, name, &dir.join("console.out"), &dir.join("stderr.txt"))
    }

    /// Starts `cmd` with its stdout in `out` and its stderr in `err`.
    pub fn start_to(
        cmd: Command,
        name: &'static str,
        out: &Path,
        err: &Path,
    ) -> Result<Vm, String> {
        Vm::start_with(cmd, name, out, err, Stdio::null())
    }

    /// [`Vm::start_to`] with a pipe to its stdin (`child.stdin`), for a console typed into.
    pub fn start_typed(
        cmd: Command,
        name: &'static str,
        out: &Path,
        err: &Path,
    ) -> Result<Vm, String> {
        Vm::start_with(cmd, name, out, err, Stdio::piped())
    }

    fn start_with(
        mut cmd: Command,
        name: &'static str,
        out: &Path,
        err: &Path,
        stdin: Stdio,
    ) -> Result<Vm, String> {
        let (out, err) = (out.to_path_buf(), err.to_path_buf());
        let open = |p: &Path| {
            std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))
        };
        cmd.stdout(Stdio::from(open(&out)?))
            .stderr(Stdio::from(open(&err)?));
        let child = spawn_group_with_stdin(&mut cmd, stdin)
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Vm {
            child,
            name,
            stderr: err,
        })
    }

    /// Why it failed, with the end of what it said on stderr.
    pub fn said(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        format!(
            "{} stderr: {}",
            self.name,
            if lines.is_empty() {
                "(nothing)".to_string()
            } else {
                lines[lines.len().saturating_sub(ERROR_LINES)..].join(" | ")
            }
        )
    }

    pub fn ended(&self) -> bool {
        has_ended(&self.child).unwrap_or(true)
    }

    /// Waits until `file` holds a line starting with `marker`, or fails when the VMM ends
    /// or the time runs out.
    pub fn wait_for_line(&self, file: &Path, marker: &str, limit: Duration) -> Result<(), String> {
        poll_until(
            self,
            &format!("{marker:?}"),
            limit,
            Duration::from_millis(1),
            || {
                let text = std::fs::read(file).unwrap_or_default();
                String::from_utf8_lossy(&text)
                    .lines()
                    .any(|l| l.trim_start().starts_with(marker))
            },
        )
    }

    /// Its exit code once it has exited by itself, read without reaping it.
    pub fn exit_code(&self) -> Option<i32> {
        ended_with(&self.child).ok().flatten().flatten()
    }

    /// Waits up to `limit` for the VMM to end by itself.
    pub fn wait_exit(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if self.ended() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }
}

/// Waits up to `limit` for `ready`, failing early if `vm` ends.
pub fn wait_until(
    vm: &Vm,
    what: &str,
    limit: Duration,
    ready: impl Fn() -> bool,
) -> Result<(), String> {
    poll_until(vm, what, limit, Duration::from_millis(2), ready)
}

/// [`wait_until`], asking `ready` every `every`.
fn poll_until(
    vm: &Vm,
    what: &str,
    limit: Duration,
    every: Duration,
    ready: impl Fn() -> bool,
) -> Result<(), String> {
    let start = Instant::now();
    while !ready() {
        if vm.ended() {
            return Err(format!("ended before {what}; {}", vm.said()));
        }
        if start.elapsed() > limit {
            return Err(format!(
                "no {what} within {} s; {}",
                limit.as_secs(),
                vm.said()
            ));
        }
        std::thread::sleep(every);
    }
    Ok(())
}

impl Drop for Vm {
    fn drop(&mut self) {
        kill_group(&self.child);
        let _ = self.child.wait();
    }
}

/// `method path` with `body` on `socket`; an answer outside 2xx is an error with its text.
pub fn api(socket: &Path, method: &str, path: &str, body: Option<&str>) -> Result<(), String> {
    let (status, text) = musubi_api::request_with_timeout(socket, method, path, body, API_TIMEOUT)
        .map_err(|e| e.to_string())?;
    if (200..300).contains(&status) {
        Ok(())
    } else {
        // Cloud Hypervisor appends a backtrace of "<unknown>" frames to its error chain.
        let text = match text.split_once("\\n\\nStack backtrace:") {
            Some((head, _)) => format!("{head} [backtrace cut]"),
            None => text,
        };
        Err(format!(
            "{method} {path} answered {status}: {}",
            one_line(&text, 600)
        ))
    }
}

/// Which VMM an API-driven experiment runs: Musubi (its program and the probe guest's ELF)
/// or a peer set up as `bench boot` sets them up.
#[derive(Clone, Debug)]
pub enum Vmm {
    Musubi { exe: PathBuf, elf: PathBuf },
    Peer(super::peers::Micro),
}

impl Vmm {
    pub fn name(&self) -> &'static str {
        match self {
            Vmm::Musubi { .. } => "musubi",
            Vmm::Peer(m) => m.kind.name(),
        }
    }
}
