//! The state directory: one subdirectory per partition with its record
//! (`partition.json`), the supervisor's socket and log, the VM records the supervisor keeps
//! (`vms.json`) and one console log per VM (`vms/ID.log`). Records are written to a
//! temporary file and renamed, so a reader never sees half a record, and everything a later
//! CLI process needs is on disk: the state outlives the CLI that made it.

use crate::cgroup::PartitionCgroup;
use crate::resources::CpuList;
use crate::Error;
use serde::{Deserialize, Serialize};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Where partitions live unless `--state-dir` or `MUSUBI_STATE_DIR` says otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/musubi/partitions";
/// Overrides the state directory.
pub const STATE_DIR_ENV: &str = "MUSUBI_STATE_DIR";
/// Prefix of the cgroup names of partitions (default `musubi-`), so tests and several
/// installations on one host do not collide.
pub const CGROUP_PREFIX_ENV: &str = "MUSUBI_CGROUP_PREFIX";
pub const DEFAULT_CGROUP_PREFIX: &str = "musubi-";

/// The state directory from the flag, else the environment, else the default.
pub fn state_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(STATE_DIR_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
}

/// A process named so that a recycled pid is not mistaken for it: the pid and its start
/// time in clock ticks since boot (`/proc/PID/stat` field 22).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcId {
    pub pid: u32,
    pub start_ticks: u64,
}

impl ProcId {
    pub fn of(pid: u32) -> Option<ProcId> {
        let (state, start_ticks) = proc_stat(pid)?;
        (state != 'Z' && state != 'X').then_some(ProcId { pid, start_ticks })
    }

    /// Running (not a zombie) and still the same process.
    pub fn alive(&self) -> bool {
        ProcId::of(self.pid) == Some(*self)
    }
}

/// State letter and start time of a process.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// A partition as `create` made it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct PartitionRecord {
    pub name: String,
    pub cpus: CpuList,
    pub mems: CpuList,
    /// Bytes.
    pub memory: u64,
    pub io_weight: Option<u32>,
    /// The cgroup file that took the weight; `None`: recorded, not enforced by this host.
    pub io_weight_file: Option<String>,
    /// Canonical paths of the disks the partition owns.
    pub disks: Vec<PathBuf>,
    /// Names of the TAP interfaces the partition owns. Defaulted because records written
    /// before partitions owned TAPs lack it and must still load.
    #[serde(default)]
    pub taps: Vec<String>,
    pub cgroup: PartitionCgroup,
    pub supervisor: Option<ProcId>,
    /// Seconds since the Unix epoch.
    pub created: u64,
}

/// How a VM stands.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum VmState {
    Running,
    /// Alive with its vCPUs stopped, by `pause` or `snapshot` through its control API,
    /// until `resume`.
    Paused,
    Exited {
        /// Exit status, when it exited by itself.
        status: Option<i32>,
        /// The signal that ended it.
        signal: Option<i32>,
        /// Ended by `stop` or the supervisor's shutdown.
        stopped: bool,
    },
    /// Its supervisor is gone, so nothing watches or owns it any more.
    Lost {
        reason: String,
    },
}

impl VmState {
    /// Whether the VM's process is there: running or paused.
    pub fn is_live(&self) -> bool {
        matches!(self, VmState::Running | VmState::Paused)
    }
}

/// One VM of a partition: a `musubi run` child of the supervisor.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VmRecord {
    pub id: u32,
    pub pid: u32,
    /// The `musubi run` arguments.
    pub args: Vec<String>,
    #[serde(flatten)]
    pub state: VmState,
    /// Seconds since the Unix epoch.
    pub started: u64,
    /// The console (stdout and stderr of the VM process).
    pub log: PathBuf,
    /// The VM's control API socket (`--api-socket`), through which the supervisor pauses,
    /// resumes and snapshots it; `None` for a VM without one (`--nodes`, or recorded
    /// before VMs had one).
    #[serde(default)]
    pub api_socket: Option<PathBuf>,
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Partition names become directory and cgroup names: keep them plain.
pub fn check_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with(['.', '-']);
    if ok {
        Ok(())
    } else {
        Err(Error::refused(format!(
            "partition name {name:?}: use 1 to 32 letters, digits, '-', '_' or '.', not \
             starting with '.' or '-'"
        )))
    }
}

/// The kernel's rule for interface names (`dev_valid_name`), checked at `create` so a
/// partition cannot claim a name no TAP can have and the refusal names the flag, not a
/// later VM.
pub fn check_tap_name(name: &str) -> Result<(), Error> {
    let why = if name.is_empty() || name.len() > 15 {
        "an interface name is 1 to 15 bytes"
    } else if name == "." || name == ".." {
        "an interface name cannot be . or .."
    } else if name.contains(['/', ':']) || name.contains(char::is_whitespace) {
        "an interface name has no '/', ':' or white space"
    } else {
        return Ok(());
    };
    Err(Error::refused(format!("--tap {name:?}: {why}")))
}

#[derive(Clone, Debug)]
pub struct Store {
    pub dir: PathBuf,
}

pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The state-directory rule, apart from the file system so it can be tested for any owner.
pub fn check_state_dir(dir: &Path, owner: u32, mode: u32, caller: u32) -> Result<(), Error> {
    if owner != caller && caller != 0 {
        return Err(Error::refused(format!(
            "state directory {} belongs to uid {owner}, not to you (uid {caller}); use a \
             directory of your own with --state-dir or {STATE_DIR_ENV}",
            dir.display()
        )));
    }
    if mode & 0o022 != 0 {
        return Err(Error::refused(format!(
            "state directory {} is writable by its group or by others (mode {:o}); \
             run `chmod go-w {}` or choose another with --state-dir",
            dir.display(),
            mode & 0o7777,
            dir.display()
        )));
    }
    Ok(())
}

/// An exclusive lock on the state directory, held while partitions are created or
/// destroyed so two CLIs cannot both grant the same CPU.
pub struct Lock {
    _file: std::fs::File,
}

impl Store {
    /// Opens (creating it 0700 if need be) a state directory only its owner can change:
    /// the supervisors trust what it holds, and anyone who could write it could plant a
    /// socket or a record there. Refused, as sshd's StrictModes does, when the directory is
    /// not the caller's (root may use any) or is writable by its group or others.
    pub fn open(dir: &Path) -> Result<Store, Error> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                Error::system(format!(
                    "state directory {}: {e} (choose another with --state-dir or {STATE_DIR_ENV})",
                    dir.display()
                ))
            })?;
        let meta = std::fs::metadata(dir)
            .map_err(|e| Error::system(format!("state directory {}: {e}", dir.display())))?;
        check_state_dir(dir, meta.uid(), meta.mode(), current_uid())?;
        Ok(Store {
            dir: dir.to_path_buf(),
        })
    }

    pub fn lock(&self) -> Result<Lock, Error> {
        let p = self.dir.join(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| Error::system(format!("{}: {e}", p.display())))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error::system(format!(
                "{}: flock: {}",
                p.display(),
                std::io::Error::last_os_error()
            )));
        }
        Ok(Lock { _file: file })
    }

    pub fn partition_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn record_path(&self, name: &str) -> PathBuf {
        self.partition_dir(name).join("partition.json")
    }

    pub fn socket(&self, name: &str) -> PathBuf {
        self.partition_dir(name).join("supervisor.sock")
    }

    pub fn supervisor_log(&self, name: &str) -> PathBuf {
        self.partition_dir(name).join("supervisor.log")
    }

    pub fn vms_file(&self, name: &str) -> PathBuf {
        self.partition_dir(name).join("vms.json")
    }

    pub fn vm_log(&self, name: &str, id: u32) -> PathBuf {
        self.partition_dir(name)
            .join("vms")
            .join(format!("{id}.log"))
    }

    /// Where VM `id` of partition `name` serves its control API, unless its arguments
    /// name a socket of their own.
    pub fn vm_socket(&self, name: &str, id: u32) -> PathBuf {
        self.partition_dir(name)
            .join("vms")
            .join(format!("{id}.sock"))
    }

    pub fn exists(&self, name: &str) -> bool {
        self.record_path(name).is_file()
    }

    pub fn load(&self, name: &str) -> Result<PartitionRecord, Error> {
        check_name(name).map_err(|_| self.unknown(name))?;
        let p = self.record_path(name);
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(self.unknown(name)),
            Err(e) => return Err(Error::system(format!("{}: {e}", p.display()))),
        };
        serde_json::from_str(&text)
            .map_err(|e| Error::system(format!("{}: damaged record: {e}", p.display())))
    }

    fn unknown(&self, name: &str) -> Error {
        let known = self.names().unwrap_or_default();
        Error::not_found(format!(
            "unknown partition {name:?} in {} (partitions: {})",
            self.dir.display(),
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        ))
    }

    /// Names of all partitions, sorted.
    pub fn names(&self) -> Result<Vec<String>, Error> {
        let mut names = Vec::new();
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| Error::system(format!("{}: {e}", self.dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if check_name(&name).is_ok() && self.exists(&name) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    pub fn load_all(&self) -> Result<Vec<PartitionRecord>, Error> {
        self.names()?.iter().map(|n| self.load(n)).collect()
    }

    pub fn save(&self, rec: &PartitionRecord) -> Result<(), Error> {
        std::fs::create_dir_all(self.partition_dir(&rec.name).join("vms")).map_err(|e| {
            Error::system(format!("{}: {e}", self.partition_dir(&rec.name).display()))
        })?;
        write_atomic(&self.record_path(&rec.name), &to_json(rec))
    }

    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let d = self.partition_dir(name);
        match std::fs::remove_dir_all(&d) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::system(format!("{}: {e}", d.display()))),
        }
    }

    /// The VM records the supervisor last wrote (empty before its first VM).
    pub fn load_vms(&self, name: &str) -> Result<Vec<VmRecord>, Error> {
        let p = self.vms_file(name);
        match std::fs::read_to_string(&p) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| Error::system(format!("{}: damaged record: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::system(format!("{}: {e}", p.display()))),
        }
    }

    pub fn save_vms(&self, name: &str, vms: &[VmRecord]) -> Result<(), Error> {
        write_atomic(&self.vms_file(name), &to_json(&vms))
    }
}

fn to_json<T: Serialize>(v: &T) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s
}

fn write_atomic(path: &Path, text: &str) -> Result<(), Error> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::system(format!("{}: {e}", path.display()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::Place;

    fn record(name: &str) -> PartitionRecord {
        PartitionRecord {
            name: name.into(),
            cpus: CpuList::parse("c", "0").unwrap(),
            mems: CpuList::parse("m", "0").unwrap(),
            memory: 1 << 30,
            io_weight: Some(200),
            io_weight_file: None,
            disks: vec![PathBuf::from("/x/disk.img")],
            taps: vec!["tap0".into()],
            cgroup: PartitionCgroup {
                version: 1,
                places: vec![Place {
                    controller: "cpuset".into(),
                    mount: "/sys/fs/cgroup/cpuset".into(),
                    rel: format!("musubi-{name}"),
                    proc_path: format!("/musubi-{name}"),
                }],
            },
            supervisor: ProcId::of(std::process::id()),
            created: now_secs(),
        }
    }

    #[test]
    fn state_directories_others_can_write_or_own_are_refused() {
        let d = Path::new("/srv/state");
        check_state_dir(d, 1000, 0o40700, 1000).unwrap();
        check_state_dir(d, 1000, 0o40755, 0).unwrap();
        for mode in [0o40770, 0o40777, 0o40702] {
            let e = check_state_dir(d, 1000, mode, 1000)
                .unwrap_err()
                .to_string();
            assert!(e.contains("/srv/state") && e.contains("writable"), "{e}");
        }
        let e = check_state_dir(d, 0, 0o40700, 1000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("belongs to uid 0"), "{e}");
    }

    #[test]
    fn records_round_trip_and_list_sorted() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        store.save(&record("b")).unwrap();
        store.save(&record("a")).unwrap();
        assert_eq!(store.names().unwrap(), ["a", "b"]);
        let a = store.load("a").unwrap();
        assert_eq!(a.cpus.to_string(), "0");
        assert_eq!(a.taps, ["tap0"]);
        assert_eq!(a.cgroup, record("a").cgroup);
        let e = store.load("zz").unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::NotFound);
        assert!(e.message.contains("partitions: a, b"), "{e}");
        store.remove("a").unwrap();
        assert_eq!(store.names().unwrap(), ["b"]);
        let _lock = store.lock().unwrap();
    }

    #[test]
    fn vm_records_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        store.save(&record("p")).unwrap();
        let vms = vec![
            VmRecord {
                id: 1,
                pid: 10,
                args: vec!["--kernel".into(), "probe".into()],
                state: VmState::Running,
                started: 5,
                log: store.vm_log("p", 1),
                api_socket: Some(store.vm_socket("p", 1)),
            },
            VmRecord {
                id: 2,
                pid: 11,
                args: vec![],
                state: VmState::Exited {
                    status: Some(0),
                    signal: None,
                    stopped: false,
                },
                started: 6,
                log: store.vm_log("p", 2),
                api_socket: None,
            },
            VmRecord {
                id: 3,
                pid: 12,
                args: vec![],
                state: VmState::Paused,
                started: 7,
                log: store.vm_log("p", 3),
                api_socket: Some("/run/x.sock".into()),
            },
        ];
        store.save_vms("p", &vms).unwrap();
        assert_eq!(store.load_vms("p").unwrap(), vms);
        let text = std::fs::read_to_string(store.vms_file("p")).unwrap();
        assert!(text.contains("\"state\": \"running\""), "{text}");
        assert!(text.contains("\"state\": \"paused\""), "{text}");
    }

    #[test]
    fn vm_records_written_before_api_sockets_still_load() {
        let old = r#"[{"id": 1, "pid": 10, "args": ["--kernel", "probe"], "state": "running",
                       "started": 5, "log": "/s/p/vms/1.log"}]"#;
        let vms: Vec<VmRecord> = serde_json::from_str(old).unwrap();
        assert_eq!(vms[0].api_socket, None);
        assert_eq!(vms[0].state, VmState::Running);
        assert!(vms[0].state.is_live() && VmState::Paused.is_live());
        assert!(!VmState::Lost { reason: "x".into() }.is_live());
    }

    #[test]
    fn partition_records_written_before_taps_still_load() {
        let mut old = serde_json::to_value(record("p")).unwrap();
        old.as_object_mut().unwrap().remove("taps").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        std::fs::create_dir_all(store.partition_dir("p")).unwrap();
        std::fs::write(store.record_path("p"), old.to_string()).unwrap();
        let rec = store.load("p").unwrap();
        assert!(rec.taps.is_empty());
        assert_eq!(rec.disks, [PathBuf::from("/x/disk.img")]);
    }

    #[test]
    fn tap_names_follow_the_kernels_rule() {
        for good in ["t", "tap0", "vm-1.eth_0", &"x".repeat(15)] {
            check_tap_name(good).unwrap();
        }
        let long = "x".repeat(16);
        for (bad, why) in [
            ("", "1 to 15 bytes"),
            (long.as_str(), "1 to 15 bytes"),
            // 8 two-byte characters: 16 bytes though 8 characters.
            ("éééééééé", "1 to 15 bytes"),
            (".", ". or .."),
            ("..", ". or .."),
            ("a/b", "no '/'"),
            ("a:1", "no '/'"),
            ("a b", "white space"),
            ("a\tb", "white space"),
        ] {
            let e = check_tap_name(bad).unwrap_err();
            assert_eq!(e.kind, crate::ErrorKind::Refused);
            assert!(
                e.message.starts_with(&format!("--tap {bad:?}: ")) && e.message.contains(why),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn names_and_processes() {
        for good in ["a", "web-1", "p_2.x"] {
            check_name(good).unwrap();
        }
        for bad in ["", ".x", "-x", "a/b", "a b", &"x".repeat(33)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        let me = ProcId::of(std::process::id()).unwrap();
        assert!(me.alive());
        let other = ProcId {
            pid: me.pid,
            start_ticks: me.start_ticks + 1,
        };
        assert!(!other.alive());
    }
}
