//! The per-partition supervisor: a long-running process inside its partition's cgroup that
//! starts, watches and stops the partition's VMs and answers the CLI on a Unix socket.
//!
//! It knows nothing of other partitions: no shared socket, lock or process tree, so its
//! failure cannot reach them. Its own failure ends its VMs: each VM process asks the kernel
//! (`PR_SET_PDEATHSIG`) for SIGTERM when the supervisor dies, which the VMM answers by
//! flushing its disks and exiting, so no VM runs on unwatched and unaccounted.
//!
//! One thread does everything but wait on VMs' control APIs. That is deliberate: the kernel
//! sends the parent-death signal when the *thread* that forked the child exits, so VMs must
//! be forked by a thread that lives as long as the supervisor. A pause, resume or snapshot
//! is a call on the VM's own API socket (`--api-socket`, given to every VM) made by a
//! short-lived helper thread, so a snapshot that takes seconds holds up no other request;
//! the helper hands its result back, and the main thread records it and answers.

use crate::proto::{Reply, Request, Status, CONTROL_TIMEOUT, SNAPSHOT_TIMEOUT};
use crate::store::{now_secs, ProcId, Store, VmRecord, VmState};
use crate::Error;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

/// How long a VM has to end after SIGTERM before it gets SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// The signal a VM gets when its supervisor dies.
pub const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGTERM;
/// The longest path a UNIX socket can be bound at (`sun_path` less its final NUL).
pub const MAX_SOCKET_PATH: usize = 107;

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
    /// Where helper threads hand back the outcome of a call on a VM's control API.
    done_tx: Sender<ControlDone>,
    done_rx: Receiver<ControlDone>,
}

/// What the supervisor asks of a VM through its control API.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ControlOp {
    Pause,
    Resume,
    Snapshot(PathBuf),
}

impl ControlOp {
    fn name(&self) -> &'static str {
        match self {
            ControlOp::Pause => "pause",
            ControlOp::Resume => "resume",
            ControlOp::Snapshot(_) => "snapshot",
        }
    }
}

/// Why a request about one VM is refused; its message is what the CLI is answered.
#[derive(Debug, thiserror::Error)]
enum VmError {
    #[error("partition {partition} has no VM {id} (VMs: {})", vm_list(vms))]
    NoSuchVm {
        partition: String,
        id: u32,
        vms: Vec<u32>,
    },
    #[error(
        "vm {id} of partition {partition} is not running (it {}); only a running VM can be \
         asked to {op}",
        how_it_ended(state)
    )]
    NotRunning {
        partition: String,
        id: u32,
        state: VmState,
        op: &'static str,
    },
    #[error("snapshot directory {}: give an absolute path", .0.display())]
    RelativeSnapshotDir(PathBuf),
    #[error(
        "vm {id} of partition {partition} has no control API socket (it runs with --nodes, or \
         was started before VMs had one), so it cannot be asked to {op}"
    )]
    NoApiSocket {
        partition: String,
        id: u32,
        op: &'static str,
    },
    #[error(transparent)]
    SocketPath(#[from] SocketPathError),
    #[error("console log {}: {source}", path.display())]
    ConsoleLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {} run: {source}", program.display())]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
}

fn vm_list(ids: &[u32]) -> String {
    if ids.is_empty() {
        "none".to_string()
    } else {
        ids.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn how_it_ended(state: &VmState) -> String {
    match state {
        VmState::Exited {
            status: Some(c), ..
        } => format!("exited with status {c}"),
        VmState::Exited {
            signal: Some(s), ..
        } => format!("was ended by signal {s}"),
        _ => "has ended".to_string(),
    }
}

/// A VM's API socket the kernel could not bind, refused before the VM starts.
#[derive(Debug, thiserror::Error)]
#[error(
    "the VM's API socket {} is {len} bytes long, and a UNIX socket path may have at most \
     {MAX_SOCKET_PATH}; {}",
    path.display(),
    if *chosen {
        "use a state directory with a shorter path (--state-dir), or give the VM a \
         shorter --api-socket PATH"
    } else {
        "give a shorter --api-socket PATH"
    }
)]
struct SocketPathError {
    path: PathBuf,
    len: usize,
    /// The supervisor chose the path (in its state directory), not the VM's arguments.
    chosen: bool,
}

/// Why a connection to the supervisor is not served.
#[derive(Debug, thiserror::Error)]
enum PeerError {
    #[error("cannot read the peer's credentials: {0}")]
    Credentials(#[source] std::io::Error),
    #[error("uid {uid} (pid {pid}) is neither root nor the partition's owner (uid {owner})")]
    NotOwner { uid: u32, pid: i32, owner: u32 },
}

/// Why a call on a VM's control API did not do what it asked.
#[derive(Debug, thiserror::Error)]
enum ApiCallError {
    #[error(transparent)]
    Client(#[from] musubi_api::ClientError),
    /// The VM answered outside 2xx.
    #[error("{}", api_message(*status, body))]
    Refused { status: u16, body: String },
}

/// A call on a VM's control API, done: the connection that asked, for the answer.
struct ControlDone {
    stream: UnixStream,
    id: u32,
    op: ControlOp,
    result: Result<(), ApiCallError>,
    /// Whether the VM said it was paused when asked after the call (`None`: no answer).
    paused: Option<bool>,
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
    let (done_tx, done_rx) = channel();
    let mut sup = Supervisor {
        store: store.clone(),
        name: name.to_string(),
        program: program.to_path_buf(),
        vms: Vec::new(),
        children: BTreeMap::new(),
        in_cgroup,
        started: now_secs(),
        done_tx,
        done_rx,
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
                    let reply = Reply::Error {
                        message: why.to_string(),
                    };
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
        sup.finish_controls();
    }
    let _ = std::fs::remove_file(&sock);
    log("supervisor exits");
    Ok(())
}

/// Root and the partition's owner may drive a supervisor; anyone else could have it read
/// any file it can read (as a disk) or create files where it can write (as a console log).
fn peer_allowed(stream: &UnixStream, owner: u32) -> Result<(), PeerError> {
    let cred = musubi_api::server::peer_credentials(stream).map_err(PeerError::Credentials)?;
    check_peer(cred.uid, cred.pid, owner)
}

fn check_peer(uid: u32, pid: i32, owner: u32) -> Result<(), PeerError> {
    if uid == 0 || uid == owner {
        Ok(())
    } else {
        Err(PeerError::NotOwner { uid, pid, owner })
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
        drop(reader);
        let mut exit = false;
        let reply = match serde_json::from_str::<Request>(&line) {
            Err(e) => Reply::Error {
                message: format!("bad request {:?}: {e}", line.trim()),
            },
            Ok(Request::Run { args, cwd }) => match self.start_vm(args, cwd) {
                Ok(vm) => Reply::Vm { vm },
                Err(e) => Reply::Error {
                    message: e.to_string(),
                },
            },
            Ok(Request::Stop { vm }) => match self.stop_vm(vm) {
                Ok(vm) => Reply::Vm { vm },
                Err(e) => Reply::Error {
                    message: e.to_string(),
                },
            },
            Ok(Request::Pause { vm }) => return self.control(stream, vm, ControlOp::Pause),
            Ok(Request::Resume { vm }) => return self.control(stream, vm, ControlOp::Resume),
            Ok(Request::Snapshot { vm, dir }) => {
                return self.control(stream, vm, ControlOp::Snapshot(dir))
            }
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
        answer(&stream, &reply);
        exit
    }

    fn start_vm(&mut self, args: Vec<String>, cwd: Option<PathBuf>) -> Result<VmRecord, VmError> {
        let id = self.vms.iter().map(|v| v.id).max().unwrap_or(0) + 1;
        let dir = cwd.clone().unwrap_or_else(|| PathBuf::from("/"));
        let (api_socket, extra) = match vm_api_socket(&args, &dir) {
            ApiSocket::Given(p) => (Some(p), None),
            ApiSocket::None => (None, None),
            ApiSocket::Default => {
                let p = self.store.vm_socket(&self.name, id);
                (Some(p.clone()), Some(p))
            }
        };
        if let Some(p) = &api_socket {
            check_socket_path(p, extra.is_some())?;
        }
        let log_path = self.store.vm_log(&self.name, id);
        let console_log = |source| VmError::ConsoleLog {
            path: log_path.clone(),
            source,
        };
        let out = std::fs::File::create(&log_path).map_err(console_log)?;
        let err = out.try_clone().map_err(console_log)?;
        let me = std::process::id();
        let mut cmd = Command::new(&self.program);
        cmd.arg("run").args(&args);
        if let Some(p) = &extra {
            cmd.arg("--api-socket").arg(p);
        }
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
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
        let child = cmd.spawn().map_err(|source| VmError::Spawn {
            program: self.program.clone(),
            source,
        })?;
        let vm = VmRecord {
            id,
            pid: child.id(),
            args,
            state: VmState::Running,
            started: now_secs(),
            log: log_path,
            api_socket,
        };
        log(format!(
            "vm {id}: pid {} started: run {:?}{}",
            vm.pid,
            vm.args,
            match &extra {
                Some(p) => format!(" --api-socket {}", p.display()),
                None => String::new(),
            }
        ));
        self.children.insert(id, child);
        self.vms.push(vm.clone());
        self.persist();
        Ok(vm)
    }

    fn no_such_vm(&self, id: u32) -> VmError {
        VmError::NoSuchVm {
            partition: self.name.clone(),
            id,
            vms: self.vms.iter().map(|v| v.id).collect(),
        }
    }

    fn stop_vm(&mut self, id: u32) -> Result<VmRecord, VmError> {
        let Some(idx) = self.vms.iter().position(|v| v.id == id) else {
            return Err(self.no_such_vm(id));
        };
        if self.children.contains_key(&id) {
            self.terminate(&[id]);
        }
        Ok(self.vms[idx].clone())
    }

    /// Starts `op` on VM `id`'s control API from a helper thread, which hands the outcome
    /// back to [`Supervisor::finish_controls`] with `stream`; a request that cannot be
    /// made is answered at once. Never asks the supervisor to exit.
    fn control(&mut self, stream: UnixStream, id: u32, op: ControlOp) -> bool {
        let socket = match self.control_target(id, &op) {
            Ok(s) => s,
            Err(e) => {
                let message = e.to_string();
                answer(&stream, &Reply::Error { message });
                return false;
            }
        };
        log(format!(
            "vm {id}: {}{} through {}",
            op.name(),
            match &op {
                ControlOp::Snapshot(d) => format!(" into {}", d.display()),
                _ => String::new(),
            },
            socket.display()
        ));
        let tx = self.done_tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("vm{id}-{}", op.name()))
            .spawn({
                let op = op.clone();
                move || {
                    let result = call_vm_api(&socket, &op);
                    let paused = vm_paused(&socket);
                    let _ = tx.send(ControlDone {
                        stream,
                        id,
                        op,
                        result,
                        paused,
                    });
                }
            });
        if let Err(e) = spawned {
            log(format!(
                "vm {id}: cannot start a thread for {}: {e}",
                op.name()
            ));
        }
        false
    }

    /// The API socket of VM `id`, if `op` may be asked of it.
    fn control_target(&self, id: u32, op: &ControlOp) -> Result<PathBuf, VmError> {
        let vm = self
            .vms
            .iter()
            .find(|v| v.id == id)
            .ok_or_else(|| self.no_such_vm(id))?;
        if !self.children.contains_key(&id) || !vm.state.is_live() {
            return Err(VmError::NotRunning {
                partition: self.name.clone(),
                id,
                state: vm.state.clone(),
                op: op.name(),
            });
        }
        if let ControlOp::Snapshot(dir) = op {
            if !dir.is_absolute() {
                return Err(VmError::RelativeSnapshotDir(dir.clone()));
            }
        }
        vm.api_socket.clone().ok_or_else(|| VmError::NoApiSocket {
            partition: self.name.clone(),
            id,
            op: op.name(),
        })
    }

    /// Records and answers the calls on VMs' control APIs that helper threads have done.
    fn finish_controls(&mut self) {
        let mut changed = false;
        while let Ok(done) = self.done_rx.try_recv() {
            // A VM that ended meanwhile is recorded as it ended, not as paused.
            changed |= self.reap_one(done.id, false);
            let live = self.children.contains_key(&done.id);
            let Some(vm) = self.vms.iter_mut().find(|v| v.id == done.id) else {
                continue;
            };
            if live {
                // What the VM says it is after the call; failing an answer, what the call
                // makes of it when it succeeds.
                let paused = done.paused.or(match (&done.result, &done.op) {
                    (Ok(()), ControlOp::Resume) => Some(false),
                    (Ok(()), _) => Some(true),
                    (Err(_), _) => None,
                });
                if let Some(p) = paused {
                    let state = if p { VmState::Paused } else { VmState::Running };
                    changed |= vm.state != state;
                    vm.state = state;
                }
            }
            let reply = match done.result {
                Ok(()) => {
                    log(format!("vm {}: {} done", done.id, done.op.name()));
                    Reply::Vm { vm: vm.clone() }
                }
                Err(e) => {
                    log(format!("vm {}: {} failed: {e}", done.id, done.op.name()));
                    Reply::Error {
                        message: format!(
                            "vm {} of partition {}: {} refused: {e}",
                            done.id,
                            self.name,
                            done.op.name()
                        ),
                    }
                }
            };
            answer(&done.stream, &reply);
        }
        if changed {
            self.persist();
        }
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
        let default_socket = self.store.vm_socket(&self.name, id);
        if let Some(v) = self.vms.iter_mut().find(|v| v.id == id) {
            v.state = VmState::Exited {
                status: code,
                signal,
                stopped,
            };
            // The socket the supervisor chose goes with the VM, even one killed before it
            // could remove it; one the arguments named is theirs.
            if v.api_socket.as_deref() == Some(default_socket.as_path()) {
                let _ = std::fs::remove_file(&default_socket);
            }
        }
    }

    fn persist(&self) {
        if let Err(e) = self.store.save_vms(&self.name, &self.vms) {
            log(format!("cannot record VMs: {e}"));
        }
    }
}

fn answer(stream: &UnixStream, reply: &Reply) {
    let mut text = serde_json::to_string(reply).unwrap_or_default();
    text.push('\n');
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut out = stream;
    let _ = out.write_all(text.as_bytes());
}

/// Where a VM's control API is, from its `musubi run` arguments.
#[derive(Debug, PartialEq, Eq)]
enum ApiSocket {
    /// The arguments name one (`--api-socket PATH`; relative to the VM's directory).
    Given(PathBuf),
    /// None can be given: `--nodes` runs without a control API.
    None,
    /// The supervisor gives the VM one in the partition's directory.
    Default,
}

fn vm_api_socket(args: &[String], cwd: &Path) -> ApiSocket {
    let mut it = args.iter();
    let mut nodes = false;
    while let Some(a) = it.next() {
        let given = if a == "--api-socket" {
            it.next().cloned()
        } else {
            a.strip_prefix("--api-socket=").map(str::to_string)
        };
        if let Some(p) = given {
            return ApiSocket::Given(cwd.join(p));
        }
        nodes |= a == "--nodes" || a.starts_with("--nodes=");
    }
    if nodes {
        ApiSocket::None
    } else {
        ApiSocket::Default
    }
}

/// A socket path the kernel can bind: refused by name otherwise, before the VM starts.
fn check_socket_path(p: &Path, chosen: bool) -> Result<(), SocketPathError> {
    let len = p.as_os_str().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    Err(SocketPathError {
        path: p.to_path_buf(),
        len,
        chosen,
    })
}

/// Asks the VM's control API to do `op`: Ok on its 204, else its message.
fn call_vm_api(socket: &Path, op: &ControlOp) -> Result<(), ApiCallError> {
    let (path, body, timeout) = match op {
        ControlOp::Pause => ("/api/v1/vm.pause", None, CONTROL_TIMEOUT),
        ControlOp::Resume => ("/api/v1/vm.resume", None, CONTROL_TIMEOUT),
        ControlOp::Snapshot(dir) => (
            "/api/v1/vm.snapshot",
            Some(
                serde_json::json!({ "destination_url": format!("file://{}", dir.display()) })
                    .to_string(),
            ),
            SNAPSHOT_TIMEOUT,
        ),
    };
    let (status, text) =
        musubi_api::request_with_timeout(socket, "PUT", path, body.as_deref(), timeout)?;
    if (200..300).contains(&status) {
        Ok(())
    } else {
        Err(ApiCallError::Refused { status, body: text })
    }
}

/// The message of an API error answer: its JSON array of strings joined, else its text.
fn api_message(status: u16, body: &str) -> String {
    let text = match serde_json::from_str::<Vec<String>>(body) {
        Ok(parts) if !parts.is_empty() => parts.join(": "),
        _ if body.trim().is_empty() => "no message".to_string(),
        _ => body.trim().to_string(),
    };
    format!("{text} (HTTP {status})")
}

/// Whether the VM at `socket` says it is paused (`GET /api/v1/vm.info`); `None` when it
/// does not say.
fn vm_paused(socket: &Path) -> Option<bool> {
    let (status, text) = musubi_api::request_with_timeout(
        socket,
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(5),
    )
    .ok()?;
    if status != 200 {
        return None;
    }
    let info: serde_json::Value = serde_json::from_str(&text).ok()?;
    match info.get("state")?.as_str()? {
        "Paused" => Some(true),
        "Running" => Some(false),
        _ => None,
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
    fn every_vm_gets_an_api_socket_unless_its_arguments_name_one_or_forbid_it() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cwd = Path::new("/home/u");
        assert_eq!(
            vm_api_socket(&args(&["--kernel", "probe"]), cwd),
            ApiSocket::Default
        );
        assert_eq!(
            vm_api_socket(
                &args(&["--api-socket", "vm.sock", "--kernel", "probe"]),
                cwd
            ),
            ApiSocket::Given("/home/u/vm.sock".into())
        );
        assert_eq!(
            vm_api_socket(&args(&["--api-socket=/run/a.sock"]), cwd),
            ApiSocket::Given("/run/a.sock".into())
        );
        assert_eq!(
            vm_api_socket(&args(&["--kernel", "probe", "--nodes", "2"]), cwd),
            ApiSocket::None
        );
    }

    #[test]
    fn socket_paths_the_kernel_cannot_bind_are_refused_by_length() {
        check_socket_path(&PathBuf::from(format!("/{}", "x".repeat(106))), true).unwrap();
        let long = PathBuf::from(format!("/{}", "x".repeat(107)));
        let e = check_socket_path(&long, true).unwrap_err().to_string();
        assert!(
            e.contains("108 bytes long") && e.contains("at most 107") && e.contains("--state-dir"),
            "{e}"
        );
        let e = check_socket_path(&long, false).unwrap_err().to_string();
        assert!(e.contains("shorter --api-socket"), "{e}");
    }

    #[test]
    fn api_errors_become_one_message() {
        assert_eq!(
            api_message(
                500,
                r#"["Error from API","The VM could not be paused","already paused"]"#
            ),
            "Error from API: The VM could not be paused: already paused (HTTP 500)"
        );
        assert_eq!(api_message(404, ""), "no message (HTTP 404)");
        assert_eq!(api_message(502, "gateway"), "gateway (HTTP 502)");
    }

    #[test]
    fn only_root_and_the_owner_are_answered() {
        check_peer(0, 1, 1000).unwrap();
        check_peer(1000, 1, 1000).unwrap();
        let e = check_peer(65534, 42, 1000).unwrap_err().to_string();
        assert!(
            e.contains("uid 65534 (pid 42)") && e.contains("uid 1000"),
            "{e}"
        );
    }
}
