//! The per-partition supervisor: a long-running process inside its partition's cgroup that
//! starts, watches and stops the partition's VMs and answers the CLI on a Unix socket.
//!
//! It knows nothing of other partitions: no shared socket, lock or process tree, so its
//! failure cannot reach them. Its own failure ends its VMs: each VM process asks the kernel
//! (`PR_SET_PDEATHSIG`) for SIGTERM when the supervisor dies, which the VMM answers by
//! flushing its disks and exiting, so no VM runs on unwatched and unaccounted.
//!
//! One thread does everything. That is deliberate: the kernel sends the parent-death signal
//! when the *thread* that forked the child exits, so VMs must be forked by a thread that
//! lives as long as the supervisor.

use crate::proto::{Reply, Request, Status};
use crate::store::{now_secs, ProcId, Store, VmRecord, VmState};
use crate::Error;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a VM has to end after SIGTERM before it gets SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// The signal a VM gets when its supervisor dies.
pub const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGTERM;

static TERMINATE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(_: libc::c_int) {
    TERMINATE.store(true, Ordering::SeqCst);
}

struct Supervisor {
    store: Store,
    name: String,
    /// The executable whose `run` subcommand boots one VM.
    program: PathBuf,
    vms: Vec<VmRecord>,
    children: BTreeMap<u32, Child>,
    in_cgroup: bool,
    started: u64,
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[{}] {}", now_secs(), msg.as_ref());
}

/// Runs the supervisor of partition `name` until `shutdown` or SIGTERM/SIGINT.
pub fn run(store: &Store, name: &str, program: &Path) -> Result<(), Error> {
    let rec = store.load(name)?;
    let me = std::process::id();
    // Into the cgroup before anything else, so every VM forked later inherits it.
    rec.cgroup.add_process(me)?;
    let in_cgroup = rec.cgroup.contains(me);
    log(format!(
        "supervisor of partition {name}: pid {me}, cgroup v{} {}, cpus {}, memory {}",
        rec.cgroup.version,
        rec.cgroup.places[0].proc_path,
        rec.cpus,
        host_resources::Size(rec.memory)
    ));
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_terminate as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_terminate as *const () as libc::sighandler_t,
        );
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let sock = store.socket(name);
    let _ = std::fs::remove_file(&sock);
    let listener =
        UnixListener::bind(&sock).map_err(|e| Error::system(format!("{}: {e}", sock.display())))?;
    // Only the owner may connect, whatever the umask was; peers are checked on every
    // connection as well, in case the socket is reachable after all.
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(|e| Error::system(format!("{}: chmod 0600: {e}", sock.display())))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::system(format!("{}: {e}", sock.display())))?;
    let owner = crate::store::current_uid();
    let mut sup = Supervisor {
        store: store.clone(),
        name: name.to_string(),
        program: program.to_path_buf(),
        vms: Vec::new(),
        children: BTreeMap::new(),
        in_cgroup,
        started: now_secs(),
    };
    sup.persist();
    loop {
        if TERMINATE.load(Ordering::SeqCst) {
            log("terminated by signal: stopping VMs");
            sup.stop_all();
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => match peer_allowed(&stream, owner) {
                Ok(()) => {
                    if sup.serve(stream) {
                        break;
                    }
                }
                Err(why) => {
                    log(format!("refused a connection: {why}"));
                    let reply = Reply::Error { message: why };
                    let mut text = serde_json::to_string(&reply).unwrap_or_default();
                    text.push('\n');
                    let _ = (&stream).write_all(text.as_bytes());
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => log(format!("accept: {e}")),
        }
        sup.reap();
    }
    let _ = std::fs::remove_file(&sock);
    log("supervisor exits");
    Ok(())
}

/// Root and the partition's owner may drive a supervisor; anyone else could have it read
/// any file it can read (as a disk) or create files where it can write (as a console log).
fn peer_allowed(stream: &UnixStream, owner: u32) -> Result<(), String> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the size given, on a socket this process owns.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(format!(
            "cannot read the peer's credentials: {}",
            std::io::Error::last_os_error()
        ));
    }
    check_peer(cred.uid, cred.pid, owner)
}

fn check_peer(uid: u32, pid: i32, owner: u32) -> Result<(), String> {
    if uid == 0 || uid == owner {
        Ok(())
    } else {
        Err(format!(
            "uid {uid} (pid {pid}) is neither root nor the partition's owner (uid {owner})"
        ))
    }
}

impl Supervisor {
    /// Answers one connection; true when the supervisor should exit.
    fn serve(&mut self, stream: UnixStream) -> bool {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut line = String::new();
        let mut reader = BufReader::new(&stream);
        if reader.read_line(&mut line).is_err() || line.trim().is_empty() {
            return false;
        }
        let mut exit = false;
        let reply = match serde_json::from_str::<Request>(&line) {
            Err(e) => Reply::Error {
                message: format!("bad request {:?}: {e}", line.trim()),
            },
            Ok(Request::Run { args, cwd }) => match self.start_vm(args, cwd) {
                Ok(vm) => Reply::Vm { vm },
                Err(message) => Reply::Error { message },
            },
            Ok(Request::Stop { vm }) => match self.stop_vm(vm) {
                Ok(vm) => Reply::Vm { vm },
                Err(message) => Reply::Error { message },
            },
            Ok(Request::List) => {
                self.reap();
                Reply::Vms {
                    vms: self.vms.clone(),
                }
            }
            Ok(Request::Status) => Reply::Status {
                status: Status {
                    partition: self.name.clone(),
                    pid: std::process::id(),
                    in_cgroup: self.in_cgroup,
                    vms_running: self.children.len(),
                    started: self.started,
                },
            },
            Ok(Request::Shutdown) => {
                log("shutdown requested: stopping VMs");
                self.stop_all();
                exit = true;
                Reply::Vms {
                    vms: self.vms.clone(),
                }
            }
        };
        let mut text = serde_json::to_string(&reply).unwrap_or_default();
        text.push('\n');
        let _ = (&stream).write_all(text.as_bytes());
        exit
    }

    fn start_vm(&mut self, args: Vec<String>, cwd: Option<PathBuf>) -> Result<VmRecord, String> {
        let id = self.vms.iter().map(|v| v.id).max().unwrap_or(0) + 1;
        let log_path = self.store.vm_log(&self.name, id);
        let out = std::fs::File::create(&log_path)
            .map_err(|e| format!("console log {}: {e}", log_path.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("console log {}: {e}", log_path.display()))?;
        let me = std::process::id();
        let mut cmd = Command::new(&self.program);
        cmd.arg("run")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if let Some(dir) = &cwd {
            cmd.current_dir(dir);
        }
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (prctl, getppid) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    PARENT_DEATH_SIGNAL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The supervisor may have died before prctl took effect: then no signal
                // will come, and the VM must not start at all.
                if libc::getppid() as u32 != me {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {} run: {e}", self.program.display()))?;
        let vm = VmRecord {
            id,
            pid: child.id(),
            args,
            state: VmState::Running,
            started: now_secs(),
            log: log_path,
        };
        log(format!(
            "vm {id}: pid {} started: run {:?}",
            vm.pid, vm.args
        ));
        self.children.insert(id, child);
        self.vms.push(vm.clone());
        self.persist();
        Ok(vm)
    }

    fn stop_vm(&mut self, id: u32) -> Result<VmRecord, String> {
        let Some(idx) = self.vms.iter().position(|v| v.id == id) else {
            let ids: Vec<String> = self.vms.iter().map(|v| v.id.to_string()).collect();
            return Err(format!(
                "partition {} has no VM {id} (VMs: {})",
                self.name,
                if ids.is_empty() {
                    "none".to_string()
                } else {
                    ids.join(", ")
                }
            ));
        };
        if self.children.contains_key(&id) {
            self.terminate(&[id]);
        }
        Ok(self.vms[idx].clone())
    }

    fn stop_all(&mut self) {
        let ids: Vec<u32> = self.children.keys().copied().collect();
        self.terminate(&ids);
    }

    /// SIGTERM to each VM, then SIGKILL to those still there after the grace period.
    fn terminate(&mut self, ids: &[u32]) {
        for id in ids {
            if let Some(c) = self.children.get(id) {
                // SAFETY: kill(2) on our own child, not yet reaped, so the pid is ours.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            let left: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|id| self.children.contains_key(id))
                .collect();
            for id in &left {
                self.reap_one(*id, true);
            }
            if ids.iter().all(|id| !self.children.contains_key(id)) {
                break;
            }
            if Instant::now() > deadline {
                for id in ids {
                    if let Some(c) = self.children.get_mut(id) {
                        log(format!("vm {id}: still running after SIGTERM: SIGKILL"));
                        let _ = c.kill();
                    }
                }
                for id in ids {
                    if let Some(mut c) = self.children.remove(id) {
                        let status = c.wait().ok();
                        self.record_exit(*id, status, true);
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.persist();
    }

    fn reap(&mut self) {
        let ids: Vec<u32> = self.children.keys().copied().collect();
        let mut changed = false;
        for id in ids {
            changed |= self.reap_one(id, false);
        }
        if changed {
            self.persist();
        }
    }

    fn reap_one(&mut self, id: u32, stopped: bool) -> bool {
        let status = match self.children.get_mut(&id).map(|c| c.try_wait()) {
            Some(Ok(Some(s))) => s,
            Some(Ok(None)) | None => return false,
            Some(Err(e)) => {
                log(format!("vm {id}: wait: {e}"));
                return false;
            }
        };
        self.children.remove(&id);
        self.record_exit(id, Some(status), stopped);
        true
    }

    fn record_exit(&mut self, id: u32, status: Option<std::process::ExitStatus>, stopped: bool) {
        let (code, signal) = match status {
            Some(s) => (s.code(), s.signal()),
            None => (None, None),
        };
        log(format!(
            "vm {id}: exited (status {code:?}, signal {signal:?}{})",
            if stopped { ", stopped" } else { "" }
        ));
        if let Some(v) = self.vms.iter_mut().find(|v| v.id == id) {
            v.state = VmState::Exited {
                status: code,
                signal,
                stopped,
            };
        }
    }

    fn persist(&self) {
        if let Err(e) = self.store.save_vms(&self.name, &self.vms) {
            log(format!("cannot record VMs: {e}"));
        }
    }
}

/// Whether the supervisor recorded in a partition is still running.
pub fn supervisor_alive(sup: Option<ProcId>) -> bool {
    sup.map(|p| p.alive()).unwrap_or(false)
}

#[cfg(test)]
mod peer_tests {
    use super::*;

    #[test]
    fn only_root_and_the_owner_are_answered() {
        check_peer(0, 1, 1000).unwrap();
        check_peer(1000, 1, 1000).unwrap();
        let e = check_peer(65534, 42, 1000).unwrap_err();
        assert!(
            e.contains("uid 65534 (pid 42)") && e.contains("uid 1000"),
            "{e}"
        );
    }
}
