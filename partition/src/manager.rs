//! The operations behind `musubi partition`: the rules that keep partitions disjoint, and
//! the life cycle of a partition's cgroup and supervisor.

use crate::cgroup::{Host, Limits};
use crate::proto::{self, Reply, Request, Status};
use crate::resources::{self, CpuList};
use crate::store::{
    self, check_name, check_tap_name, now_secs, PartitionRecord, ProcId, Store, VmRecord, VmState,
};
use crate::Error;
use host_resources::Size;
use serde::{Deserialize, Serialize};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long `create` waits for a new supervisor to answer.
const SUPERVISOR_START: Duration = Duration::from_secs(10);

pub struct Manager {
    pub store: Store,
    /// Prepended to partition names to make cgroup names.
    pub cgroup_prefix: String,
    /// The `musubi` executable: supervisors are `PROGRAM partition supervise`, VMs
    /// `PROGRAM run`.
    pub program: PathBuf,
}

#[derive(Clone, Debug, Default)]
pub struct CreateRequest {
    pub name: String,
    pub cpus: String,
    pub memory: String,
    pub mems: Option<String>,
    pub io_weight: Option<u32>,
    pub disks: Vec<PathBuf>,
    /// TAP interface names; they need not exist yet.
    pub taps: Vec<String>,
}

/// The program's hidden subcommand that lists the storage files and TAPs of a VM from its
/// `run` arguments.
pub const STORAGE_FILES_COMMAND: &str = "storage-files";

/// What a VM would use that a partition can own, as `PROGRAM partition storage-files`
/// reports it: one answer, so `run` resolves the VM's arguments (and any JSON file or
/// snapshot they name) once for every ownership rule.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct VmResources {
    pub files: Vec<StorageFile>,
    /// Names of the TAPs of its `--net tap=NAME` devices; a `--net fd=N` has none, as the
    /// orchestrator that opened it answers for it.
    pub taps: Vec<String>,
}

/// One file a VM uses as storage, as `PROGRAM partition storage-files` reports it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct StorageFile {
    /// How the VM names it: `--disk path` or `--pmem file`.
    pub flag: String,
    /// As given, relative to the VM's directory or absolute.
    pub path: PathBuf,
}

/// How a partition's supervisor stands, as the CLI sees it.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum SupervisorState {
    Running {
        pid: u32,
    },
    /// Alive but not answering its socket.
    Silent {
        pid: u32,
        error: String,
    },
    Gone {
        pid: Option<u32>,
    },
}

/// A partition with its supervisor and VMs, for `list` and `show`.
#[derive(Serialize, Clone, Debug)]
pub struct PartitionView {
    #[serde(flatten)]
    pub record: PartitionRecord,
    pub supervisor_state: SupervisorState,
    pub vms: Vec<VmRecord>,
    pub supervisor_log: PathBuf,
    pub socket: PathBuf,
}

impl Manager {
    pub fn new(state_dir: &Path, program: PathBuf) -> Result<Manager, Error> {
        Ok(Manager {
            store: Store::open(state_dir)?,
            cgroup_prefix: std::env::var(store::CGROUP_PREFIX_ENV)
                .unwrap_or_else(|_| store::DEFAULT_CGROUP_PREFIX.to_string()),
            program,
        })
    }

    /// Checks the request against the host and the other partitions, makes the cgroup,
    /// and starts the supervisor.
    pub fn create(&self, req: &CreateRequest) -> Result<PartitionRecord, Error> {
        check_name(&req.name)?;
        let cgroup_name = format!("{}{}", self.cgroup_prefix, req.name);
        check_name(&cgroup_name).map_err(|_| {
            Error::refused(format!(
                "cgroup name {cgroup_name:?} ({} + name) is not a plain name of at most 32 \
                 characters",
                store::CGROUP_PREFIX_ENV
            ))
        })?;
        let _lock = self.store.lock()?;
        let others = self.store.load_all()?;
        if let Some(p) = others.iter().find(|p| p.name == req.name) {
            return Err(Error::refused(format!(
                "partition {} already exists in {} (cpus {}, memory {}); destroy it first or \
                 choose another name",
                p.name,
                self.store.dir.display(),
                p.cpus,
                Size(p.memory)
            )));
        }
        let cpus = CpuList::parse("--cpus", &req.cpus)?;
        let online = resources::online_cpus()?;
        if !cpus.is_subset(&online) {
            return Err(Error::refused(format!(
                "--cpus {}: CPU {} not online on this host (online: {online})",
                req.cpus,
                cpus.difference(&online)
            )));
        }
        let clashes: Vec<String> = others
            .iter()
            .filter_map(|p| {
                let common = p.cpus.intersection(&cpus);
                (!common.is_empty())
                    .then(|| format!("partition {} (cpus {}) on CPU {common}", p.name, p.cpus))
            })
            .collect();
        if !clashes.is_empty() {
            return Err(Error::refused(format!(
                "--cpus {} for partition {} overlaps {}; CPU sets of partitions may not overlap",
                req.cpus,
                req.name,
                clashes.join(" and ")
            )));
        }
        let node_online = host_nodes();
        let mems = match &req.mems {
            Some(m) => CpuList::parse("--mems", m)?,
            None => node_online.clone(),
        };
        if !mems.is_subset(&node_online) {
            return Err(Error::refused(format!(
                "--mems {}: memory node {} not online on this host (online: {node_online})",
                req.mems.as_deref().unwrap_or_default(),
                mems.difference(&node_online)
            )));
        }
        let memory = host_resources::parse_size("--memory", &req.memory)
            .map_err(|e| Error::refused(e.to_string()))?;
        if memory == 0 {
            return Err(Error::refused(format!(
                "--memory {:?}: a partition needs some memory",
                req.memory
            )));
        }
        let total = resources::mem_total()?;
        let reserve = resources::host_reserve(total);
        let available = total.saturating_sub(reserve);
        let granted: u64 = others.iter().map(|p| p.memory).sum();
        if granted.saturating_add(memory) > available {
            let holders: Vec<String> = others
                .iter()
                .map(|p| format!("{} {}", p.name, Size(p.memory)))
                .collect();
            return Err(Error::refused(format!(
                "--memory {} for partition {}: the host can give partitions {} (MemTotal {} \
                 less a host reserve of {}){}; {} is left",
                req.memory,
                req.name,
                Size(available),
                Size(total),
                Size(reserve),
                if holders.is_empty() {
                    String::new()
                } else {
                    format!(", and partitions hold {}", holders.join(", "))
                },
                Size(available.saturating_sub(granted))
            )));
        }
        let mut disks: Vec<PathBuf> = Vec::new();
        for d in &req.disks {
            let canon = canonical_disk(d)?;
            if let Some(owner) = others.iter().find(|p| p.disks.contains(&canon)) {
                return Err(Error::refused(format!(
                    "--disk {}: belongs to partition {}; a disk belongs to one partition",
                    d.display(),
                    owner.name
                )));
            }
            if !disks.contains(&canon) {
                disks.push(canon);
            }
        }
        let mut taps: Vec<String> = Vec::new();
        for t in &req.taps {
            check_tap_name(t)?;
            if let Some(owner) = others.iter().find(|p| p.taps.contains(t)) {
                return Err(Error::refused(format!(
                    "--tap {t}: belongs to partition {}; a TAP belongs to one partition",
                    owner.name
                )));
            }
            if !taps.contains(t) {
                taps.push(t.clone());
            }
        }
        let host = Host::detect()?;
        if let Some(w) = req.io_weight {
            let range = if host.version() == 2 {
                1..=10000
            } else {
                10..=1000
            };
            if !range.contains(&w) {
                return Err(Error::refused(format!(
                    "--io-weight {w}: cgroup v{} takes {} to {}",
                    host.version(),
                    range.start(),
                    range.end()
                )));
            }
        }
        let cgroup = host.plan(&cgroup_name)?;
        let limited = cgroup.create(&Limits {
            cpus: cpus.clone(),
            mems: mems.clone(),
            memory,
            io_weight: req.io_weight,
        })?;
        let mut rec = PartitionRecord {
            name: req.name.clone(),
            cpus,
            mems,
            memory,
            io_weight: req.io_weight,
            io_weight_file: limited.io_weight_file,
            disks,
            taps,
            cgroup,
            supervisor: None,
            created: now_secs(),
        };
        let undo = |e: Error| {
            let _ = rec_cleanup(&self.store, &req.name);
            e
        };
        self.store.save(&rec).map_err(|e| {
            let _ = rec.cgroup.remove(Duration::from_secs(2));
            undo(e)
        })?;
        match self.start_supervisor(&rec) {
            Ok(sup) => {
                rec.supervisor = Some(sup);
                self.store.save(&rec)?;
                Ok(rec)
            }
            Err(e) => {
                let _ = rec.cgroup.remove(Duration::from_secs(5));
                Err(undo(e))
            }
        }
    }

    fn start_supervisor(&self, rec: &PartitionRecord) -> Result<ProcId, Error> {
        let log_path = self.store.supervisor_log(&rec.name);
        let log = std::fs::File::create(&log_path)
            .map_err(|e| Error::system(format!("{}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::system(format!("{}: {e}", log_path.display())))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(["partition", "supervise", &rec.name, "--state-dir"])
            .arg(&self.store.dir)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        // SAFETY: setsid is async-signal-safe; it detaches the supervisor from the CLI's
        // session and terminal, so it outlives the CLI and its terminal's hang-up.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            Error::system(format!(
                "cannot start the supervisor {}: {e}",
                self.program.display()
            ))
        })?;
        let pid = child.id();
        let sock = self.store.socket(&rec.name);
        let deadline = Instant::now() + SUPERVISOR_START;
        let failure = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break format!("exited at start ({status})");
            }
            match proto::call(&sock, &Request::Status, Duration::from_secs(2)) {
                Ok(Reply::Status {
                    status: Status { in_cgroup, .. },
                }) => {
                    if in_cgroup {
                        return ProcId::of(pid).ok_or_else(|| {
                            Error::system(format!("supervisor pid {pid} vanished at start"))
                        });
                    }
                    break "is not in the partition's cgroup".to_string();
                }
                Ok(other) => break format!("answered {other:?}"),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(30))
                }
                Err(e) => break format!("did not answer within {SUPERVISOR_START:?}: {e}"),
            }
        };
        let _ = child.kill();
        let _ = child.wait();
        let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
        Err(Error::system(format!(
            "supervisor of partition {} (pid {pid}) {failure}; its log {}:\n{}",
            rec.name,
            log_path.display(),
            tail.trim_end()
        )))
    }

    pub fn view(&self, rec: PartitionRecord) -> PartitionView {
        let pid = rec.supervisor.map(|p| p.pid);
        let sock = self.store.socket(&rec.name);
        let (supervisor_state, vms) = if crate::supervisor::supervisor_alive(rec.supervisor) {
            let pid = pid.unwrap_or(0);
            match proto::call(&sock, &Request::List, Duration::from_secs(5)) {
                Ok(Reply::Vms { vms }) => (SupervisorState::Running { pid }, vms),
                Ok(other) => (
                    SupervisorState::Silent {
                        pid,
                        error: format!("unexpected reply {other:?}"),
                    },
                    self.store.load_vms(&rec.name).unwrap_or_default(),
                ),
                Err(e) => (
                    SupervisorState::Silent {
                        pid,
                        error: e.message,
                    },
                    self.store.load_vms(&rec.name).unwrap_or_default(),
                ),
            }
        } else {
            let reason = match pid {
                Some(p) => format!("supervisor pid {p} gone"),
                None => "supervisor never started".to_string(),
            };
            let vms = self
                .store
                .load_vms(&rec.name)
                .unwrap_or_default()
                .into_iter()
                .map(|mut v| {
                    if v.state.is_live() {
                        v.state = VmState::Lost {
                            reason: reason.clone(),
                        };
                    }
                    v
                })
                .collect();
            (SupervisorState::Gone { pid }, vms)
        };
        PartitionView {
            supervisor_log: self.store.supervisor_log(&rec.name),
            socket: sock,
            record: rec,
            supervisor_state,
            vms,
        }
    }

    pub fn list(&self) -> Result<Vec<PartitionView>, Error> {
        Ok(self
            .store
            .load_all()?
            .into_iter()
            .map(|r| self.view(r))
            .collect())
    }

    pub fn show(&self, name: &str) -> Result<PartitionView, Error> {
        Ok(self.view(self.store.load(name)?))
    }

    fn live_socket(&self, rec: &PartitionRecord) -> Result<PathBuf, Error> {
        if !crate::supervisor::supervisor_alive(rec.supervisor) {
            return Err(Error::system(format!(
                "partition {} has no running supervisor ({}); its VMs are lost — destroy and \
                 create it again",
                rec.name,
                match rec.supervisor {
                    Some(p) => format!("supervisor pid {} gone", p.pid),
                    None => "never started".into(),
                }
            )));
        }
        Ok(self.store.socket(&rec.name))
    }

    /// Starts a VM in partition `name`: `musubi run ARGS` under its supervisor, in `cwd`.
    /// None of the VM's storage or TAPs may belong to another partition: with
    /// `--restore DIR`, those the snapshot's VM uses.
    pub fn run(&self, name: &str, args: &[String], cwd: &Path) -> Result<VmRecord, Error> {
        let rec = self.store.load(name)?;
        let others = self.store.load_all()?;
        let uses = self.vm_resources(args, cwd)?;
        for file in uses.files {
            // Relative paths are the VM's, which runs in `cwd`.
            let Ok(canon) = cwd.join(&file.path).canonicalize() else {
                continue; // `musubi run` reports a missing file itself.
            };
            if let Some(owner) = others
                .iter()
                .find(|p| p.name != rec.name && p.disks.contains(&canon))
            {
                return Err(Error::refused(format!(
                    "{}={}: belongs to partition {}, not to {}; a disk belongs to one partition",
                    file.flag,
                    file.path.display(),
                    owner.name,
                    rec.name
                )));
            }
        }
        for tap in &uses.taps {
            if let Some(owner) = others
                .iter()
                .find(|p| p.name != rec.name && p.taps.contains(tap))
            {
                return Err(Error::refused(format!(
                    "--net tap={tap}: belongs to partition {}, not to {}; a TAP belongs to \
                     one partition",
                    owner.name, rec.name
                )));
            }
        }
        let sock = self.live_socket(&rec)?;
        let mut args = args.to_vec();
        if args.iter().any(|a| a == "--receive-migration") {
            // The VM's disks and TAPs are known only when it arrives: it is told which
            // files and TAPs other partitions own and refuses a VM that uses one.
            for p in others.iter().filter(|p| p.name != rec.name) {
                for d in &p.disks {
                    args.push("--foreign-storage".into());
                    args.push(format!("{}:{}", p.name, d.display()));
                }
                for t in &p.taps {
                    args.push("--foreign-tap".into());
                    args.push(format!("{}:{t}", p.name));
                }
            }
        }
        let req = Request::Run {
            args,
            cwd: Some(cwd.to_path_buf()),
        };
        match proto::call(&sock, &req, proto::REPLY_TIMEOUT)? {
            Reply::Vm { vm } => Ok(vm),
            Reply::Error { message } => Err(Error::refused(message)),
            other => Err(Error::system(format!("unexpected reply {other:?}"))),
        }
    }

    /// The storage files and TAPs a VM started with `args` in `cwd` uses, as the program
    /// itself resolves them (`PROGRAM partition storage-files -- ARGS`): flags, the JSON
    /// file they name and defaults alike, exactly as its `run` will. Arguments it cannot
    /// resolve are refused with its message. With `--restore DIR` they are those of the
    /// snapshot's configuration, which the restored VM will use.
    pub fn vm_resources(&self, args: &[String], cwd: &Path) -> Result<VmResources, Error> {
        let out = Command::new(&self.program)
            .args(["partition", STORAGE_FILES_COMMAND, "--"])
            .args(args)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::system(format!("{}: {e}", self.program.display())))?;
        if !out.status.success() {
            return Err(Error::refused(
                String::from_utf8_lossy(&out.stderr).trim_end(),
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| {
            Error::system(format!(
                "{} partition {STORAGE_FILES_COMMAND}: unreadable answer: {e}",
                self.program.display()
            ))
        })
    }

    /// Pauses VM `vm` of partition `name` through its control API: its vCPUs stop where
    /// they are until [`Manager::resume`].
    pub fn pause(&self, name: &str, vm: u32) -> Result<VmRecord, Error> {
        self.control(name, &Request::Pause { vm }, proto::REPLY_TIMEOUT)
    }

    /// Resumes VM `vm` of partition `name`, paused by `pause` or `snapshot`.
    pub fn resume(&self, name: &str, vm: u32) -> Result<VmRecord, Error> {
        self.control(name, &Request::Resume { vm }, proto::REPLY_TIMEOUT)
    }

    /// Snapshots VM `vm` of partition `name` into `dir` (absolute, or relative to `cwd`):
    /// the VM is paused for it and stays paused. `musubi run --restore DIR` (in a
    /// partition: `run NAME -- --restore DIR`) brings it back.
    pub fn snapshot(&self, name: &str, vm: u32, dir: &Path, cwd: &Path) -> Result<VmRecord, Error> {
        let dir = cwd.join(dir);
        if !dir.is_absolute() {
            return Err(Error::refused(format!(
                "snapshot directory {}: not an absolute path",
                dir.display()
            )));
        }
        self.control(
            name,
            &Request::Snapshot { vm, dir },
            proto::SNAPSHOT_REPLY_TIMEOUT,
        )
    }

    fn control(&self, name: &str, req: &Request, timeout: Duration) -> Result<VmRecord, Error> {
        let rec = self.store.load(name)?;
        let sock = self.live_socket(&rec)?;
        match proto::call(&sock, req, timeout)? {
            Reply::Vm { vm } => Ok(vm),
            Reply::Error { message } => Err(Error::refused(message)),
            other => Err(Error::system(format!("unexpected reply {other:?}"))),
        }
    }

    pub fn stop(&self, name: &str, vm: u32) -> Result<VmRecord, Error> {
        let rec = self.store.load(name)?;
        let sock = self.live_socket(&rec)?;
        match proto::call(&sock, &Request::Stop { vm }, proto::REPLY_TIMEOUT)? {
            Reply::Vm { vm } => Ok(vm),
            Reply::Error { message } => Err(Error::not_found(message)),
            other => Err(Error::system(format!("unexpected reply {other:?}"))),
        }
    }

    /// Stops the supervisor (which stops its VMs), kills whatever is left in the cgroup,
    /// removes the cgroup and the partition's state. Returns the VMs as they ended.
    pub fn destroy(&self, name: &str) -> Result<Vec<VmRecord>, Error> {
        let _lock = self.store.lock()?;
        let rec = self.store.load(name)?;
        let mut vms = Vec::new();
        if let Some(sup) = rec.supervisor.filter(|s| s.alive()) {
            let sock = self.store.socket(name);
            if let Ok(Reply::Vms { vms: v }) =
                proto::call(&sock, &Request::Shutdown, proto::REPLY_TIMEOUT)
            {
                vms = v;
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while sup.alive() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if sup.alive() {
                // SAFETY: kill(2); `alive` just matched pid and start time.
                unsafe { libc::kill(sup.pid as libc::pid_t, libc::SIGKILL) };
            }
        } else {
            vms = self.view(rec.clone()).vms;
        }
        rec.cgroup.remove(Duration::from_secs(15))?;
        self.store.remove(name)?;
        Ok(vms)
    }
}

fn rec_cleanup(store: &Store, name: &str) -> Result<(), Error> {
    store.remove(name)
}

/// Memory nodes of the host (`0` on a machine without NUMA information).
fn host_nodes() -> CpuList {
    std::fs::read_to_string("/sys/devices/system/node/online")
        .ok()
        .and_then(|t| CpuList::parse("nodes", t.trim()).ok())
        .unwrap_or_else(|| CpuList([0].into_iter().collect()))
}

fn canonical_disk(d: &Path) -> Result<PathBuf, Error> {
    host_resources::check_storage_file("--disk ", d).map_err(|e| Error::refused(e.to_string()))?;
    d.canonicalize()
        .map_err(|e| Error::refused(format!("--disk {}: {e}", d.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_happen_before_any_cgroup_is_touched() {
        let tmp = tempfile::tempdir().unwrap();
        let m = Manager::new(tmp.path(), PathBuf::from("/nonexistent")).unwrap();
        let req = |name: &str, cpus: &str, memory: &str| CreateRequest {
            name: name.into(),
            cpus: cpus.into(),
            memory: memory.into(),
            ..Default::default()
        };
        let e = m.create(&req("a/b", "0", "1G")).unwrap_err();
        assert!(e.message.contains("partition name"), "{e}");
        let e = m.create(&req("p", "0-x", "1G")).unwrap_err();
        assert!(e.message.starts_with("--cpus \"0-x\""), "{e}");
        let e = m.create(&req("p", "4000", "1G")).unwrap_err();
        assert!(e.message.contains("not online"), "{e}");
        let e = m.create(&req("p", "0", "100T")).unwrap_err();
        assert!(e.message.contains("host reserve"), "{e}");
        for (memory, why) in [
            ("0", "needs some memory"),
            ("-1G", "cannot be negative"),
            ("lots", "invalid size"),
        ] {
            let e = m.create(&req("p", "0", memory)).unwrap_err();
            assert!(
                e.message.starts_with(&format!("--memory {memory:?}: ")) && e.message.contains(why),
                "{e}"
            );
        }
        let mut r = req("p", "0", "1G");
        r.disks = vec![tmp.path().join("missing.img")];
        let e = m.create(&r).unwrap_err();
        assert!(e.message.contains("missing.img"), "{e}");
        let mut r = req("p", "0", "1G");
        r.taps = vec!["tap0".into(), "a/b".into()];
        let e = m.create(&r).unwrap_err();
        assert!(e.message.starts_with("--tap \"a/b\": "), "{e}");
        assert!(m.list().unwrap().is_empty());
    }

    #[test]
    fn a_tap_another_partition_owns_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let m = Manager::new(tmp.path(), PathBuf::from("/nonexistent")).unwrap();
        // A record only: an offline CPU and a token of memory keep the CPU and memory
        // rules out of the way, so the TAP rule is what answers.
        m.store
            .save(&PartitionRecord {
                name: "owner".into(),
                cpus: CpuList::parse("c", "4000").unwrap(),
                mems: CpuList::parse("m", "0").unwrap(),
                memory: 1 << 20,
                io_weight: None,
                io_weight_file: None,
                disks: vec![],
                taps: vec!["vmtap0".into()],
                cgroup: crate::cgroup::PartitionCgroup {
                    version: 2,
                    places: vec![],
                },
                supervisor: None,
                created: 0,
            })
            .unwrap();
        let e = m
            .create(&CreateRequest {
                name: "p".into(),
                cpus: "0".into(),
                memory: "1M".into(),
                taps: vec!["vmtap1".into(), "vmtap0".into()],
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Refused);
        assert_eq!(
            e.message,
            "--tap vmtap0: belongs to partition owner; a TAP belongs to one partition"
        );
        assert_eq!(m.store.names().unwrap(), ["owner"]);
    }
}
