//! What a user asks a VM to be: parsed from flags and JSON, validated before any KVM call.

pub mod net;
pub mod rng;
pub mod spec;
pub mod vsock;

pub use devices::virtio::block::CacheMode;
pub use host_resources::{host_memory_bytes, Size, SizeError, SIZE_SYNTAX};

use crate::arch::x86_64::{acpi, mptable};
use serde::{Deserialize, Serialize};
use spec::Spec;
use std::fmt;
use std::path::{Path, PathBuf};

/// Errors in the user's description of a VM; each names the flag or field and the value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{flag} {value:?}: invalid size: {why}; expected {SIZE_SYNTAX}")]
    BadSize {
        flag: String,
        value: String,
        why: SizeError,
    },
    #[error("{flag}: {value} is too small: {why}")]
    TooSmall {
        flag: String,
        value: String,
        why: String,
    },
    #[error("{flag}: {value} is more than this host has ({host_mib} MiB of RAM: MemTotal)")]
    MoreThanHost {
        flag: String,
        value: String,
        host_mib: u64,
    },
    #[error("{flag} {spec:?}: {why}; expected {syntax}")]
    BadSpec {
        flag: &'static str,
        spec: String,
        why: String,
        syntax: &'static str,
    },
    #[error(transparent)]
    NotStorage(#[from] host_resources::NotStorage),
    #[error("--serial {0:?}: expected stdio, off or file=PATH")]
    BadSerial(String),
    #[error(
        "--cpus {0}: expected 1 to {max}; at most {max} CPUs fit in the MP table, from which \
         guests without ACPI (the probe guest among them) learn their CPUs",
        max = MAX_VCPUS
    )]
    BadCpus(u64),
}

/// The most vCPUs a VM may have: as many as both firmware tables that list CPUs can hold,
/// so a bad count is refused while the configuration is read, not after the VM exists. The
/// MP table is the smaller (it must fit in the last KiB of base memory, where guests scan
/// for it). CPUs beyond it are not described in the MADT alone: the probe guest and kernels
/// without ACPI count CPUs from the MP table only, so they would never start those vCPUs,
/// and two guests would disagree on how many CPUs one configuration has.
pub const MAX_VCPUS: u8 = {
    let (mp, madt) = (mptable::MAX_CPUS, acpi::MAX_CPUS);
    if mp < madt {
        mp
    } else {
        madt
    }
};

pub const DISK_SYNTAX: &str = "path=FILE[,readonly=on|off][,cache=writeback|none]";

/// One `--disk`, or one entry of the JSON config's `disks`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default, deserialize_with = "spec::from_str")]
    pub cache: CacheMode,
}

impl std::str::FromStr for DiskConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let spec = Spec::parse("--disk", DISK_SYNTAX, text, &["path", "readonly", "cache"])?;
        Ok(DiskConfig {
            path: spec.path("path")?,
            readonly: spec.on_off("readonly")?,
            cache: spec.value("cache")?.unwrap_or_default(),
        })
    }
}

/// The flag's own form, defaults left out, so a command line made from a parsed `--disk`
/// (one node's, handed to the next) parses back to the same disk.
impl fmt::Display for DiskConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "path={}", self.path.display())?;
        if self.readonly {
            f.write_str(",readonly=on")?;
        }
        if self.cache != CacheMode::default() {
            write!(f, ",cache={}", self.cache)?;
        }
        Ok(())
    }
}

/// Checks that `path`, given as `flag`, can hold storage (see
/// [`host_resources::check_storage_file`]).
pub fn check_storage_file(flag: &'static str, path: &Path) -> Result<(), ConfigError> {
    Ok(host_resources::check_storage_file(flag, path)?)
}

/// Which part of the hypervisor handles the hot traps (paper 002's composite design).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExitsMode {
    /// Queue notifications end in the kernel (ioeventfd, served by an I/O thread) and
    /// interrupts are raised in the kernel (irqfd): no return to the VMM for either.
    #[default]
    Kernel,
    /// Every notification is an MMIO exit served on the vCPU thread, and every interrupt is
    /// injected from user space with KVM_IRQ_LINE, as a VMM without those kernel features.
    User,
}

/// The words of `--exits`, for parsing and printing alike.
const EXITS_WORDS: [(&str, ExitsMode); 2] =
    [("kernel", ExitsMode::Kernel), ("user", ExitsMode::User)];

impl std::str::FromStr for ExitsMode {
    type Err = spec::BadWord;
    fn from_str(s: &str) -> Result<Self, spec::BadWord> {
        spec::word(s, &EXITS_WORDS).map_err(|source| spec::BadWord {
            flag: "--exits",
            value: s.to_string(),
            source,
        })
    }
}

impl fmt::Display for ExitsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(spec::name_of(*self, &EXITS_WORDS))
    }
}

/// Where the guest's COM1 output goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SerialMode {
    #[default]
    Stdio,
    Off,
    File(PathBuf),
}

impl std::str::FromStr for SerialMode {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "stdio" => Ok(SerialMode::Stdio),
            "off" => Ok(SerialMode::Off),
            _ => match s.strip_prefix("file=") {
                Some(p) if !p.is_empty() => Ok(SerialMode::File(PathBuf::from(p))),
                _ => Err(ConfigError::BadSerial(s.to_string())),
            },
        }
    }
}

impl fmt::Display for SerialMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialMode::Stdio => write!(f, "stdio"),
            SerialMode::Off => write!(f, "off"),
            SerialMode::File(p) => write!(f, "file={}", p.display()),
        }
    }
}

impl Serialize for SerialMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for SerialMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A kernel image: a file, or bytes the binary carries (the bundled probe guest).
#[derive(Clone)]
pub enum KernelImage {
    File(PathBuf),
    Bytes {
        name: String,
        /// Borrowed for the image the binary carries: loading it copies it once, straight
        /// into guest memory.
        data: std::borrow::Cow<'static, [u8]>,
    },
}

impl fmt::Debug for KernelImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name())
    }
}

impl KernelImage {
    pub fn name(&self) -> String {
        match self {
            KernelImage::File(p) => p.display().to_string(),
            KernelImage::Bytes { name, .. } => name.clone(),
        }
    }
}

/// Everything needed to build one VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub kernel: KernelImage,
    pub cmdline: String,
    pub initrd: Option<PathBuf>,
    pub cpus: u8,
    pub memory: u64,
    pub disks: Vec<DiskConfig>,
    /// File-backed guest-physical regions (`--pmem`), placed above RAM.
    pub pmem: Vec<crate::pmem::PmemConfig>,
    pub serial: SerialMode,
    pub exits: ExitsMode,
    /// Network devices (`--net`), after the disks in the virtio slots.
    pub net: Vec<net::NetConfig>,
    /// The entropy device (`--rng`), in the last virtio slot.
    pub rng: Option<rng::RngConfig>,
    /// The vsock device (`--vsock`), after the network devices.
    pub vsock: Option<vsock::VsockConfig>,
}

/// One host file a VM uses as storage, named as the user names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageFile<'a> {
    /// How the file was given: `--disk path` or `--pmem file`.
    pub flag: &'static str,
    pub path: &'a Path,
}

impl fmt::Display for StorageFile<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.flag, self.path.display())
    }
}

impl VmConfig {
    /// Every file the guest reads and writes as storage: the disks, then the memory-storage
    /// files. Rules about who may use a file (a partition owns its disks) look here, so they
    /// judge the configuration as resolved from flags and the JSON file alike, never a
    /// re-reading of one of them.
    pub fn storage_files(&self) -> Vec<StorageFile<'_>> {
        let disks = self.disks.iter().map(|d| StorageFile {
            flag: "--disk path",
            path: &d.path,
        });
        let pmem = self.pmem.iter().map(|p| StorageFile {
            flag: "--pmem file",
            path: &p.file,
        });
        disks.chain(pmem).collect()
    }
}

/// Parses a size given to `flag` (see [`Size`] for the grammar).
pub fn parse_size(flag: &str, value: &str) -> Result<u64, ConfigError> {
    host_resources::parse_size(flag, value).map_err(|e| ConfigError::BadSize {
        flag: e.flag,
        value: e.value,
        why: e.why,
    })
}

/// The smallest RAM the VM can boot with: the boot structures and a kernel at 1 MiB.
pub const MIN_MEMORY: u64 = 8 << 20;

/// Checks a guest memory size against what the VM needs and the host has.
pub fn check_memory(flag: &str, value: &str, bytes: u64) -> Result<(), ConfigError> {
    if bytes < MIN_MEMORY {
        return Err(ConfigError::TooSmall {
            flag: flag.into(),
            value: value.into(),
            why: format!("a VM needs at least {} MiB", MIN_MEMORY >> 20),
        });
    }
    if !bytes.is_multiple_of(4096) {
        return Err(ConfigError::TooSmall {
            flag: flag.into(),
            value: value.into(),
            why: "the size must be a whole number of 4 KiB pages".into(),
        });
    }
    if let Ok(host) = host_memory_bytes() {
        if bytes > host {
            return Err(ConfigError::MoreThanHost {
                flag: flag.into(),
                value: value.into(),
                host_mib: host >> 20,
            });
        }
    }
    Ok(())
}

pub fn check_cpus(n: u64) -> Result<u8, ConfigError> {
    match u8::try_from(n) {
        Ok(c) if (1..=MAX_VCPUS).contains(&c) => Ok(c),
        _ => Err(ConfigError::BadCpus(n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_name_the_flag_and_the_value() {
        assert_eq!(parse_size("--memory", "1.5G").unwrap(), 3 << 29);
        for bad in ["", "M", "12X", "-1G", "99999999999999T"] {
            let e = parse_size("--memory", bad).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("--memory {bad:?}: invalid size: ")),
                "{e}"
            );
            assert!(e.ends_with(SIZE_SYNTAX), "{e}");
        }
    }

    #[test]
    fn zero_and_huge_memory_are_refused_with_the_flag_named() {
        let e = check_memory("--memory", "0", 0).unwrap_err().to_string();
        assert!(e.contains("--memory") && e.contains("at least"), "{e}");
        let e = check_memory("--memory", "1T", 1 << 40)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than this host has"), "{e}");
        check_memory("--memory", "64M", 64 << 20).unwrap();
    }

    #[test]
    fn disk_specs_parse() {
        let d: DiskConfig = "path=/tmp/a.img,readonly=on,cache=none".parse().unwrap();
        assert_eq!(d.path, PathBuf::from("/tmp/a.img"));
        assert!(d.readonly);
        assert_eq!(d.cache, CacheMode::None);
        let d: DiskConfig = "path=x".parse().unwrap();
        assert!(!d.readonly);
        assert_eq!(d.cache, CacheMode::Writeback);
    }

    #[test]
    fn malformed_disk_specs_name_the_problem() {
        spec::assert_refusals::<DiskConfig>(
            "--disk",
            DISK_SYNTAX,
            &[
                ("readonly=on", "path= is missing"),
                ("path=", "path is empty"),
                (
                    "path=a,cache=maybe",
                    "cache=\"maybe\": expected writeback or none",
                ),
                ("path=a,readonly=perhaps", "readonly=\"perhaps\""),
                ("path=a,colour=red", "unknown key"),
                ("path=a,path=b", "path= is given twice"),
            ],
        );
    }

    #[test]
    fn disks_print_as_specs_that_parse_back() {
        for text in ["path=a.img", "path=/x/b=c.img,readonly=on,cache=none"] {
            let d: DiskConfig = text.parse().unwrap();
            assert_eq!(d.to_string(), text);
        }
        let d: DiskConfig = "cache=writeback,readonly=off,path=a".parse().unwrap();
        assert_eq!(d.to_string(), "path=a");
    }

    #[test]
    fn serial_modes_print_as_they_parse() {
        for text in ["stdio", "off", "file=/tmp/console.log"] {
            assert_eq!(text.parse::<SerialMode>().unwrap().to_string(), text);
        }
    }

    #[test]
    fn json_disks_take_the_words_the_flag_takes() {
        let d: DiskConfig =
            serde_json::from_str(r#"{"path": "a.img", "cache": "none", "readonly": true}"#)
                .unwrap();
        assert_eq!(d, "path=a.img,cache=none,readonly=on".parse().unwrap());
        let e = serde_json::from_str::<DiskConfig>(r#"{"path": "a", "cache": "maybe"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"maybe\": expected writeback or none"), "{e}");
    }

    #[test]
    fn storage_files_list_disks_and_pmem_files() {
        let vm = VmConfig {
            kernel: KernelImage::File("k".into()),
            cmdline: String::new(),
            initrd: Some("initrd.img".into()),
            cpus: 1,
            memory: 64 << 20,
            disks: vec![
                "path=a.img".parse().unwrap(),
                "path=/b.img".parse().unwrap(),
            ],
            pmem: vec!["file=p.img".parse().unwrap()],
            net: Vec::new(),
            rng: None,
            vsock: None,
            serial: SerialMode::Off,
            exits: ExitsMode::Kernel,
        };
        let files: Vec<String> = vm.storage_files().iter().map(|f| f.to_string()).collect();
        assert_eq!(
            files,
            [
                "--disk path=a.img",
                "--disk path=/b.img",
                "--pmem file=p.img"
            ]
        );
    }

    #[test]
    fn serial_modes_parse() {
        assert_eq!("stdio".parse::<SerialMode>().unwrap(), SerialMode::Stdio);
        assert_eq!("off".parse::<SerialMode>().unwrap(), SerialMode::Off);
        assert_eq!(
            "file=/tmp/x".parse::<SerialMode>().unwrap(),
            SerialMode::File("/tmp/x".into())
        );
        assert!("tty".parse::<SerialMode>().is_err());
    }

    #[test]
    fn cpu_bounds() {
        assert!(check_cpus(0).is_err());
        assert_eq!(check_cpus(2).unwrap(), 2);
        assert_eq!(check_cpus(37).unwrap(), 37);
        for n in [38, 40, 64, 255, 256, u64::MAX] {
            let e = check_cpus(n).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("--cpus {n}:")) && e.contains("at most 37"),
                "{e}"
            );
        }
    }

    #[test]
    fn every_accepted_cpu_count_fits_both_firmware_tables() {
        use devices::GuestMemoryMmap;
        use vm_memory::GuestAddress;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        assert_eq!(MAX_VCPUS, mptable::MAX_CPUS);
        let n = check_cpus(u64::from(MAX_VCPUS)).unwrap();
        mptable::write_mptable(&mem, n).unwrap();
        acpi::write_acpi_tables(&mem, n).unwrap();
        assert!(mptable::write_mptable(&mem, n + 1).is_err());
    }
}
