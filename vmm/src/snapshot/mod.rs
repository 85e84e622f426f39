//! Snapshots on disk: what a snapshot directory holds, how it is written, and everything
//! checked when it is read back, before any guest code runs.
//!
//! A snapshot is a directory of three files:
//! - `config.json`: the VM's configuration (CPUs, memory, devices), as [`SavedConfig`];
//! - `state`: a header (magic, format version, CRC-32 and length of the body) and a JSON
//!   body, [`VmState`]: every vCPU, the in-kernel interrupt controllers and PIT, the KVM
//!   clock, the serial port, the ACPI PM1 registers and the virtio transports;
//! - `memory`: guest RAM, its ranges one after the other, written sparse (pages never
//!   touched are holes), so it can be mapped copy-on-write as it is.
//!
//! Disks and memory-storage files are referenced by path, not copied, as Firecracker and
//! Cloud Hypervisor do: the restored VM opens the same files. `state` is written last, by
//! rename, so a directory whose snapshot did not finish is refused as incomplete.

mod ram;

pub use ram::{pages_that_may_hold_data, write_ram, RamWritten};

use crate::config::{CacheMode, DiskConfig, ExitsMode, KernelImage, SerialMode, VmConfig};
pub use crate::persist::VmState;
use crate::pmem::{Advertise, PmemConfig};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The format this build writes and reads. Any change to [`VmState`] or [`SavedConfig`]
/// that an older reader would misread bumps it.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 16] = b"MUSUBI-SNAPSHOT\n";
const HEADER_LEN: usize = 16 + 4 + 4 + 8;

pub const CONFIG_FILE: &str = "config.json";
pub const STATE_FILE: &str = "state";
pub const MEMORY_FILE: &str = "memory";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a Musubi snapshot state file (bad magic)", .0.display())]
    NotASnapshot(PathBuf),
    #[error("{}: snapshot format version {found}; this Musubi reads version {FORMAT_VERSION}", path.display())]
    Version { path: PathBuf, found: u32 },
    #[error("{}: corrupted: checksum {found:#010x} does not match the header's {want:#010x}", path.display())]
    Checksum {
        path: PathBuf,
        found: u32,
        want: u32,
    },
    #[error("{}: corrupted: {why}", path.display())]
    Corrupt { path: PathBuf, why: String },
    #[error("{}: {len} bytes, shorter than the snapshot's {want} bytes of guest RAM", path.display())]
    MemoryShort { path: PathBuf, len: u64, want: u64 },
    #[error("the snapshot's {what} is {saved}, but {flag} asks for {given}")]
    Differs {
        what: &'static str,
        flag: &'static str,
        saved: String,
        given: String,
    },
    #[error(
        "the snapshot's vsock cid is {saved}, but --vsock asks for cid={given}: the guest \
         keeps the cid it read, only socket= may change"
    )]
    VsockCid { saved: u64, given: u64 },
    #[error("{flag} {}: {why} (a snapshot references its disks and memory-storage files; it does not copy them)", path.display())]
    MissingFile {
        flag: &'static str,
        path: PathBuf,
        why: String,
    },
    /// A saved setting this build does not understand; `what` says which, for callers that
    /// match on it, and the message is the parser's own, as before.
    #[error("{why}")]
    Setting { what: &'static str, why: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One disk as the snapshot records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDisk {
    pub path: PathBuf,
    pub readonly: bool,
    pub cache: String,
}

/// One memory-storage region, with the size it had (the layout depends on it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedPmem {
    pub file: PathBuf,
    pub size: u64,
    pub readonly: bool,
    pub advertise: String,
}

/// The configuration a snapshot was taken with: what a restore builds again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedConfig {
    /// The kernel the VM booted (for people; a restore loads no kernel).
    pub kernel: String,
    pub cmdline: String,
    pub cpus: u8,
    pub memory: u64,
    pub disks: Vec<SavedDisk>,
    pub pmem: Vec<SavedPmem>,
    pub serial: SerialMode,
    pub exits: ExitsMode,
    /// Network devices, reopened by TAP name on restore. Absent in snapshots of VMs that
    /// had none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<crate::config::net::NetConfig>,
    /// The entropy device, built again on restore (it keeps no state of its own). Absent in
    /// snapshots of VMs that had none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng: Option<crate::config::rng::RngConfig>,
    /// The vsock device, listening at the same path again on restore (its connections
    /// are not kept: the guest is told with a transport reset). Absent when there was none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<crate::config::vsock::VsockConfig>,
}

/// The VM flags given on the command line, parsed, each `None` when not given: what a
/// restore or an arriving migration compares with the configuration it was saved with.
#[derive(Debug, Default)]
pub struct GivenDevices {
    pub cpus: Option<u8>,
    pub memory: Option<u64>,
    pub disks: Option<Vec<DiskConfig>>,
    pub pmem: Option<Vec<PmemConfig>>,
    pub serial: Option<SerialMode>,
    pub exits: Option<ExitsMode>,
    /// Must name the saved TAPs (or descriptors), in order.
    pub net: Option<Vec<crate::config::net::NetConfig>>,
    /// Must match the saved entropy device: the guest found the device it has.
    pub rng: Option<crate::config::rng::RngConfig>,
    /// Its cid must match the saved one (the guest keeps the cid it read); its socket is
    /// where the host side listens from now on.
    pub vsock: Option<crate::config::vsock::VsockConfig>,
}

impl SavedConfig {
    /// `config` as built; `pmem_sizes` are the regions' sizes as mapped. Relative paths are
    /// made absolute against the current directory, so a restore started elsewhere opens
    /// the same files and writes the console to the same place.
    pub fn new(config: &VmConfig, pmem_sizes: &[u64]) -> SavedConfig {
        let cwd = std::env::current_dir().unwrap_or_default();
        let abs = |p: &Path| cwd.join(p);
        SavedConfig {
            kernel: config.kernel.name(),
            cmdline: config.cmdline.clone(),
            cpus: config.cpus,
            memory: config.memory,
            disks: config
                .disks
                .iter()
                .map(|d| SavedDisk {
                    path: abs(&d.path),
                    readonly: d.readonly,
                    cache: d.cache.to_string(),
                })
                .collect(),
            pmem: config
                .pmem
                .iter()
                .zip(pmem_sizes)
                .map(|(p, &size)| SavedPmem {
                    file: abs(&p.file),
                    size,
                    readonly: p.readonly,
                    advertise: match p.advertise {
                        Advertise::E820 => "e820".into(),
                        Advertise::Virtio => "virtio".into(),
                    },
                })
                .collect(),
            serial: match &config.serial {
                SerialMode::File(p) => SerialMode::File(abs(p)),
                other => other.clone(),
            },
            exits: config.exits,
            net: config.net.clone(),
            rng: config.rng,
            vsock: config
                .vsock
                .as_ref()
                .map(|v| crate::config::vsock::VsockConfig {
                    cid: v.cid,
                    socket: abs(&v.socket),
                }),
        }
    }

    /// The configuration to build the restored VM from: no kernel (RAM holds it already).
    pub fn to_vm_config(&self) -> Result<VmConfig, SnapshotError> {
        let disks =
            self.disks
                .iter()
                .map(|d| {
                    Ok(DiskConfig {
                        path: d.path.clone(),
                        readonly: d.readonly,
                        cache: d.cache.parse::<CacheMode>().map_err(|e| {
                            SnapshotError::Setting {
                                what: "disk cache mode",
                                why: e.to_string(),
                            }
                        })?,
                    })
                })
                .collect::<Result<Vec<_>, SnapshotError>>()?;
        let pmem = self
            .pmem
            .iter()
            .map(|p| {
                Ok(PmemConfig {
                    file: p.file.clone(),
                    size: Some(p.size),
                    readonly: p.readonly,
                    advertise: p.advertise.parse::<Advertise>().map_err(|e| {
                        SnapshotError::Setting {
                            what: "memory-storage advertise",
                            why: e.to_string(),
                        }
                    })?,
                })
            })
            .collect::<Result<Vec<_>, SnapshotError>>()?;
        Ok(VmConfig {
            kernel: KernelImage::Bytes {
                name: self.kernel.clone(),
                data: std::borrow::Cow::Borrowed(&[]),
            },
            cmdline: self.cmdline.clone(),
            initrd: None,
            cpus: self.cpus,
            memory: self.memory,
            disks,
            pmem,
            serial: self.serial.clone(),
            exits: self.exits,
            net: self.net.clone(),
            rng: self.rng,
            vsock: self.vsock.clone(),
        })
    }

    /// Refuses a restore whose own flags ask for another VM than the one saved. Only what
    /// the user gave is compared (`None` = not given).
    pub fn check_given(
        &self,
        cpus: Option<u8>,
        memory: Option<u64>,
        disks: Option<&[DiskConfig]>,
        pmem: Option<&[PmemConfig]>,
    ) -> Result<(), SnapshotError> {
        let differs = |what, flag, saved: String, given: String| {
            Err(SnapshotError::Differs {
                what,
                flag,
                saved,
                given,
            })
        };
        if let Some(c) = cpus.filter(|&c| c != self.cpus) {
            return differs("CPU count", "--cpus", self.cpus.to_string(), c.to_string());
        }
        if let Some(m) = memory.filter(|&m| m != self.memory) {
            return differs(
                "memory",
                "--memory",
                format!("{} MiB", self.memory >> 20),
                format!("{} MiB", m >> 20),
            );
        }
        let list = |v: Vec<String>| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        let cwd = std::env::current_dir().unwrap_or_default();
        let abs = |p: &Path| cwd.join(p).display().to_string();
        if let Some(d) = disks {
            let saved: Vec<String> = self.disks.iter().map(|d| abs(&d.path)).collect();
            let given: Vec<String> = d.iter().map(|d| abs(&d.path)).collect();
            if saved != given {
                return differs("disk list", "--disk", list(saved), list(given));
            }
        }
        if let Some(p) = pmem {
            let saved: Vec<String> = self.pmem.iter().map(|p| abs(&p.file)).collect();
            let given: Vec<String> = p.iter().map(|p| abs(&p.file)).collect();
            if saved != given {
                return differs("memory-storage list", "--pmem", list(saved), list(given));
            }
        }
        Ok(())
    }

    /// [`SavedConfig::check_given`] for every device flag the command line gave: the
    /// VM's own shape, its entropy device and its vsock cid. What a restore or an arriving
    /// migration may change (the console, the vsock's socket) is [`SavedConfig::apply_given`]'s.
    pub fn check_given_devices(&self, g: &GivenDevices) -> Result<(), SnapshotError> {
        self.check_given(g.cpus, g.memory, g.disks.as_deref(), g.pmem.as_deref())?;
        if let Some(n) = &g.net {
            let names = |list: &[crate::config::net::NetConfig]| {
                let v: Vec<String> = list
                    .iter()
                    .map(|n| match (&n.tap, &n.fd) {
                        (Some(t), _) => format!("tap={t}"),
                        (None, Some(fds)) => format!("fd={fds}"),
                        (None, None) => "a TAP of its own".to_string(),
                    })
                    .collect();
                if v.is_empty() {
                    "none".to_string()
                } else {
                    v.join(", ")
                }
            };
            let (saved, given) = (names(&self.net), names(n));
            if saved != given {
                return Err(SnapshotError::Differs {
                    what: "network device list",
                    flag: "--net",
                    saved,
                    given,
                });
            }
        }
        let rng = |r: Option<crate::config::rng::RngConfig>| match r {
            None => "none".to_string(),
            Some(r) if r.bytes_per_sec.is_none() => "on, uncapped".to_string(),
            Some(r) => r.to_string(),
        };
        if let Some(r) = g.rng.filter(|&r| Some(r) != self.rng) {
            return Err(SnapshotError::Differs {
                what: "entropy device",
                flag: "--rng",
                saved: rng(self.rng),
                given: rng(Some(r)),
            });
        }
        if let Some(v) = &g.vsock {
            match &self.vsock {
                None => {
                    return Err(SnapshotError::Differs {
                        what: "vsock device",
                        flag: "--vsock",
                        saved: "none".into(),
                        given: v.to_string(),
                    })
                }
                Some(s) if s.cid != v.cid => {
                    return Err(SnapshotError::VsockCid {
                        saved: s.cid,
                        given: v.cid,
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Puts into `config` (this snapshot's own, from [`SavedConfig::to_vm_config`]) what
    /// the command line may change of a saved VM: where its console goes (`--serial`) and
    /// where its vsock's host side listens (`--vsock`'s socket, made absolute as a saved
    /// one is). Call [`SavedConfig::check_given_devices`] first.
    pub fn apply_given(config: &mut VmConfig, g: &GivenDevices) {
        if let Some(serial) = g.serial.clone() {
            config.serial = serial;
        }
        if let (Some(v), Some(given)) = (config.vsock.as_mut(), &g.vsock) {
            let cwd = std::env::current_dir().unwrap_or_default();
            v.socket = cwd.join(&given.socket);
        }
    }

    /// Refuses a restore whose disks or memory-storage files are gone, by name.
    pub fn check_files(&self) -> Result<(), SnapshotError> {
        let files = self
            .disks
            .iter()
            .map(|d| ("--disk", &d.path))
            .chain(self.pmem.iter().map(|p| ("--pmem", &p.file)));
        for (flag, path) in files {
            if let Err(e) = std::fs::metadata(path) {
                return Err(SnapshotError::MissingFile {
                    flag,
                    path: path.clone(),
                    why: e.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// Writes `state` to `dir/state` through a temporary file and a rename.
pub fn write_state(dir: &Path, state: &VmState) -> Result<(), SnapshotError> {
    let body = serde_json::to_vec(state).map_err(|e| SnapshotError::Corrupt {
        path: dir.join(STATE_FILE),
        why: format!("cannot encode the state: {e}"),
    })?;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    let tmp = dir.join(".state.tmp");
    let path = dir.join(STATE_FILE);
    let mut f = private_file(&tmp).map_err(io(&tmp))?;
    f.write_all(&out).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

/// Writes `config` to `dir/config.json`.
pub fn write_config(dir: &Path, config: &SavedConfig) -> Result<(), SnapshotError> {
    let path = dir.join(CONFIG_FILE);
    let text = serde_json::to_vec_pretty(config).expect("a configuration always encodes");
    private_file(&path)
        .and_then(|mut f| f.write_all(&text))
        .map_err(io(&path))
}

/// Creates a file only its owner may read, replacing any file of that name: a snapshot
/// holds the guest's memory and registers, secrets included, like the API socket that asked
/// for it (0600). An old file is removed rather than truncated, since it keeps its mode.
pub fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Creates the snapshot directory (and its parents) if missing, only its owner may enter
/// a new one.
pub fn create_dir(dir: &Path) -> Result<(), SnapshotError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))
}

/// Reads and checks `dir/state`: magic, version, length and checksum, then the body.
pub fn read_state(dir: &Path) -> Result<VmState, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(io(&path))?;
    if bytes.len() < HEADER_LEN || &bytes[..16] != MAGIC {
        return Err(SnapshotError::NotASnapshot(path));
    }
    let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let version = word(16);
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path,
            found: version,
        });
    }
    let want = word(20);
    let len = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
    let body = &bytes[HEADER_LEN..];
    if body.len() as u64 != len {
        return Err(SnapshotError::Corrupt {
            path,
            why: format!(
                "the header says {len} bytes of state, the file has {}",
                body.len()
            ),
        });
    }
    let found = crc32fast::hash(body);
    if found != want {
        return Err(SnapshotError::Checksum { path, found, want });
    }
    serde_json::from_slice(body).map_err(|e| SnapshotError::Corrupt {
        path,
        why: e.to_string(),
    })
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<SavedConfig, SnapshotError> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(io(&path))?;
    serde_json::from_slice(&text).map_err(|e| SnapshotError::Corrupt {
        path,
        why: e.to_string(),
    })
}

/// A snapshot read from its directory and checked: everything a restore needs.
pub struct Snapshot {
    pub dir: PathBuf,
    pub config: SavedConfig,
    pub state: VmState,
    pub memory: std::sync::Arc<std::fs::File>,
}

impl Snapshot {
    /// Reads `dir` and refuses it, naming the file and what is wrong, if its state is
    /// from another format version or corrupted, its memory file is shorter than its RAM,
    /// or its vCPUs do not match its configuration.
    pub fn open(dir: &Path) -> Result<Snapshot, SnapshotError> {
        let meta = std::fs::metadata(dir).map_err(io(dir))?;
        if !meta.is_dir() {
            return Err(SnapshotError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::other("not a directory"),
            });
        }
        let state = read_state(dir)?;
        let config = read_config(dir)?;
        let state_path = dir.join(STATE_FILE);
        if state.vcpus.len() != config.cpus as usize
            || state
                .vcpus
                .iter()
                .enumerate()
                .any(|(i, v)| v.id as usize != i)
        {
            return Err(SnapshotError::Corrupt {
                path: state_path,
                why: format!(
                    "{} vCPU states for a VM of {} CPUs",
                    state.vcpus.len(),
                    config.cpus
                ),
            });
        }
        let ram: u64 = state.ram.iter().map(|r| r.1).sum();
        if ram != config.memory {
            return Err(SnapshotError::Corrupt {
                path: state_path,
                why: format!(
                    "{ram} bytes of RAM ranges for a VM of {} bytes",
                    config.memory
                ),
            });
        }
        let mem_path = dir.join(MEMORY_FILE);
        let memory = std::fs::OpenOptions::new()
            .read(true)
            .open(&mem_path)
            .map_err(io(&mem_path))?;
        let len = memory.metadata().map_err(io(&mem_path))?.len();
        if len < ram {
            return Err(SnapshotError::MemoryShort {
                path: mem_path,
                len,
                want: ram,
            });
        }
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            config,
            state,
            memory: std::sync::Arc::new(memory),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::KvmVmState;
    use devices::legacy::{SerialSnapshot, SerialState};

    fn state() -> VmState {
        VmState {
            ram: vec![(0, 64 << 20)],
            pmem: vec![],
            vcpus: vec![],
            vm: KvmVmState {
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
                pit: Default::default(),
                clock: Default::default(),
            },
            serial: SerialSnapshot(SerialState {
                baud_divisor_low: 12,
                baud_divisor_high: 0,
                interrupt_enable: 0,
                interrupt_identification: 1,
                line_control: 3,
                line_status: 0x60,
                modem_control: 8,
                modem_status: 0,
                scratch: 0,
                in_buffer: vec![],
            }),
            pm: Default::default(),
            transports: vec![],
            paused: false,
        }
    }

    #[test]
    fn a_state_from_before_the_pm_device_reads_with_a_powered_on_pm() {
        let mut old = serde_json::to_value(state()).unwrap();
        old.as_object_mut().unwrap().remove("pm").unwrap();
        let read: VmState = serde_json::from_value(old).unwrap();
        assert_eq!(read.pm, devices::legacy::PmState::default());
        assert_eq!(read.pm.control, devices::legacy::SCI_EN);
    }

    #[test]
    fn a_state_file_round_trips_and_every_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_state(dir.path(), &state()).unwrap();
        assert_eq!(read_state(dir.path()).unwrap().ram, vec![(0, 64 << 20)]);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(STATE_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the state file is {mode:o}");
        let path = dir.path().join(STATE_FILE);
        let good = std::fs::read(&path).unwrap();

        let mut other = good.clone();
        other[16..20].copy_from_slice(&7u32.to_le_bytes());
        std::fs::write(&path, &other).unwrap();
        let e = read_state(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("format version 7") && e.contains("reads version 1"),
            "{e}"
        );

        let mut flipped = good.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let e = read_state(dir.path()).unwrap_err().to_string();
        assert!(e.contains("corrupted: checksum"), "{e}");

        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        let e = read_state(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("corrupted") && e.contains("the header says"),
            "{e}"
        );

        std::fs::write(&path, b"hello").unwrap();
        let e = read_state(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a Musubi snapshot"), "{e}");
    }

    #[test]
    fn flags_that_ask_for_another_vm_are_refused_by_name() {
        let saved = SavedConfig {
            kernel: "probe".into(),
            cmdline: String::new(),
            cpus: 2,
            memory: 256 << 20,
            disks: vec![SavedDisk {
                path: "/tmp/a.img".into(),
                readonly: false,
                cache: "writeback".into(),
            }],
            pmem: vec![],
            serial: SerialMode::Off,
            exits: ExitsMode::Kernel,
            net: vec![],
            rng: None,
            vsock: None,
        };
        saved
            .check_given(Some(2), Some(256 << 20), None, None)
            .unwrap();
        let e = saved
            .check_given(Some(4), None, None, None)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "the snapshot's CPU count is 2, but --cpus asks for 4");
        let e = saved
            .check_given(None, Some(1 << 30), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--memory") && e.contains("256 MiB"), "{e}");
        let e = saved
            .check_given(None, None, Some(&[]), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--disk") && e.contains("/tmp/a.img") && e.contains("none"),
            "{e}"
        );
        let back = saved.to_vm_config().unwrap();
        assert_eq!(
            (back.cpus, back.memory, back.disks.len()),
            (2, 256 << 20, 1)
        );
    }

    #[test]
    fn rng_and_vsock_flags_are_compared_and_the_vsock_socket_may_move() {
        use crate::config::rng::RngConfig;
        use crate::config::vsock::VsockConfig;
        let saved = SavedConfig {
            kernel: "probe".into(),
            cmdline: String::new(),
            cpus: 1,
            memory: 128 << 20,
            disks: vec![],
            pmem: vec![],
            serial: SerialMode::Off,
            exits: ExitsMode::Kernel,
            net: vec![],
            rng: Some(RngConfig {
                bytes_per_sec: Some(4096),
            }),
            vsock: Some(VsockConfig {
                cid: 3,
                socket: "/run/a.sock".into(),
            }),
        };
        let rng = |n| RngConfig { bytes_per_sec: n };
        let vsock = |cid, socket: &str| VsockConfig {
            cid,
            socket: socket.into(),
        };
        let given = |rng, vsock| GivenDevices {
            rng,
            vsock,
            ..Default::default()
        };
        saved
            .check_given_devices(&given(Some(rng(Some(4096))), None))
            .unwrap();
        let e = saved
            .check_given_devices(&given(Some(rng(None)), None))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "the snapshot's entropy device is bytes_per_sec=4096, but --rng asks for on, uncapped"
        );
        let e = saved
            .check_given_devices(&given(Some(rng(Some(1))), None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--rng")
                && e.contains("bytes_per_sec=4096")
                && e.contains("bytes_per_sec=1"),
            "{e}"
        );
        let e = saved
            .check_given_devices(&given(None, Some(vsock(4, "/run/b.sock"))))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--vsock") && e.contains("cid is 3") && e.contains("cid=4"),
            "{e}"
        );
        let none = SavedConfig {
            rng: None,
            vsock: None,
            ..saved.clone()
        };
        let e = none
            .check_given_devices(&given(Some(rng(None)), None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--rng") && e.contains("is none"), "{e}");
        let e = none
            .check_given_devices(&given(None, Some(vsock(3, "/run/b.sock"))))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--vsock") && e.contains("is none") && e.contains("/run/b.sock"),
            "{e}"
        );
        // The cid matches: the host side moves to the given socket, the rest stays.
        let moved = given(None, Some(vsock(3, "/run/b.sock")));
        saved.check_given_devices(&moved).unwrap();
        let mut config = saved.to_vm_config().unwrap();
        SavedConfig::apply_given(&mut config, &moved);
        assert_eq!(config.vsock, Some(vsock(3, "/run/b.sock")));
        assert_eq!(config.rng, Some(rng(Some(4096))));
        let mut config = saved.to_vm_config().unwrap();
        SavedConfig::apply_given(&mut config, &GivenDevices::default());
        assert_eq!(config.vsock, Some(vsock(3, "/run/a.sock")));
        let net = GivenDevices {
            net: Some(vec!["tap=t0".parse().unwrap()]),
            ..Default::default()
        };
        let e = saved.check_given_devices(&net).unwrap_err().to_string();
        assert_eq!(
            e,
            "the snapshot's network device list is none, but --net asks for tap=t0"
        );
    }
}
