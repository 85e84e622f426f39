//! What one run of `bench vmms` measures: the storages, host file systems and access
//! cases, the sizes (extent, guest RAM, the disturber's disk and limit), and the schedule
//! of configurations.

use super::files::HostDir;
use crate::{BenchArgs, Harness};
use std::fmt;
use std::time::Duration;

pub(super) const MIB: u64 = 1 << 20;
/// Chosen so that a full run stays under 15 minutes on the nested-KVM development machine
/// (it took 7.3 minutes there): every system-call case copies the extent at CPL0 once or
/// twice, which that machine emulates at about 13 MB/s, over 54 configurations × 3
/// repetitions plus §5.3's 72 runs beside a disturbing VM. `--extent 512M` is the paper's.
const DEFAULT_EXTENT: u64 = 16 * MIB;
const QUICK_EXTENT: u64 = 2 * MIB;
pub(super) const PAPER_EXTENT: &str = "512M";
/// Paper 000 §5.3: the disturbing VM moved 4 GB, and its cgroup was limited to 1 GB.
const DISTURB_BYTES: u64 = 4 << 30;
const DISTURB_LIMIT: u64 = 1 << 30;
const QUICK_DISTURB_BYTES: u64 = 256 * MIB;
const QUICK_DISTURB_LIMIT: u64 = 64 * MIB;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Storage {
    Vmms,
    VirtioWb,
    VirtioNone,
    /// QEMU's virtio-blk with the host page cache on, for the read cases.
    QemuWb,
}

impl Storage {
    pub(super) fn name(self) -> &'static str {
        match self {
            Storage::Vmms => "vmms",
            Storage::VirtioWb => "virtio/writeback",
            Storage::VirtioNone => "virtio/none",
            Storage::QemuWb => "qemu virtio/writeback",
        }
    }

    pub(super) fn probe_storage(self) -> &'static str {
        match self {
            Storage::Vmms => "pmem",
            _ => "blk",
        }
    }

    pub(super) fn file_stem(self) -> &'static str {
        match self {
            Storage::Vmms => "vmms",
            Storage::VirtioWb => "virtio-wb",
            Storage::VirtioNone => "virtio-none",
            Storage::QemuWb => "qemu-wb",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum HostFs {
    Tmpfs,
    Disk,
}

impl HostFs {
    pub(super) fn name(self) -> &'static str {
        match self {
            HostFs::Tmpfs => "tmpfs",
            HostFs::Disk => "disk",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Case {
    pub(super) write: bool,
    pub(super) mmap: bool,
    pub(super) warm: bool,
}

impl Case {
    pub(super) fn all() -> Vec<Case> {
        let mut v = Vec::new();
        for write in [false, true] {
            for mmap in [false, true] {
                for warm in [true, false] {
                    v.push(Case { write, mmap, warm });
                }
            }
        }
        v
    }

    pub(super) fn op(self) -> &'static str {
        if self.write {
            "write"
        } else {
            "read"
        }
    }

    pub(super) fn path(self) -> &'static str {
        if self.mmap {
            "mmap"
        } else {
            "syscall"
        }
    }

    pub(super) fn warmth(self) -> &'static str {
        if self.warm {
            "warm"
        } else {
            "cold"
        }
    }

    /// The paper's range for virtio/VMMS with the host page cache on (§5.2): the mmap warm
    /// cases are the widest gap, the rest are given as one range per direction.
    pub(super) fn paper_ratio(self) -> (f64, f64) {
        match (self.write, self.mmap && self.warm) {
            (false, true) => (8.4, 9.0),
            (true, true) => (9.8, 10.6),
            (false, false) => (2.8, 3.8),
            (true, false) => (1.4, 3.4),
        }
    }

    pub(super) fn task(self, storage: Storage, bytes: u64) -> String {
        format!(
            "storage-io={}:{}:{}:{}:{}K",
            storage.probe_storage(),
            self.op(),
            self.path(),
            self.warmth(),
            bytes / 1024
        )
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.op(), self.path(), self.warmth())
    }
}

/// The sizes one run of the experiment uses.
pub(super) struct Plan {
    pub(super) extent: u64,
    /// Backing files are whole 2 MiB units, as `--pmem` requires.
    pub(super) file_len: u64,
    pub(super) memory: u64,
    /// The probe's page cache for virtio (`probe.page_cache=`): half the extent, the
    /// proportion of paper 000 §5.2 (256 MB of guest RAM, a 512 MB file), so a warm virtio
    /// pass cannot be served from the guest's cache alone, as it could not in the paper.
    pub(super) page_cache: u64,
    pub(super) reps: usize,
    pub(super) disturb_bytes: u64,
    pub(super) disturb_limit: u64,
    pub(super) timeout: Duration,
}

impl Plan {
    pub(super) fn new(h: &Harness, args: &BenchArgs) -> Result<Plan, String> {
        let extent = match &args.extent {
            Some(s) => vmm::config::parse_size("--extent", s).map_err(|e| e.to_string())?,
            None if h.quick => QUICK_EXTENT,
            None => DEFAULT_EXTENT,
        };
        if extent == 0 || !extent.is_multiple_of(4096) {
            return Err(format!(
                "--extent {extent}: must be a non-zero multiple of 4 KiB (e.g. 4M, {PAPER_EXTENT})"
            ));
        }
        let file_len = extent.div_ceil(2 * MIB) * 2 * MIB;
        // The probe's page cache takes about three quarters of RAM; RAM holds the whole
        // extent, so the cap (`page_cache`), not RAM, sets the proportion.
        let memory = (256 * MIB).max((extent * 2 + 64 * MIB).div_ceil(MIB) * MIB);
        let (disturb_bytes, disturb_limit) = if h.quick {
            (QUICK_DISTURB_BYTES, QUICK_DISTURB_LIMIT)
        } else {
            (DISTURB_BYTES, DISTURB_LIMIT)
        };
        Ok(Plan {
            extent,
            file_len,
            memory,
            page_cache: (extent / 2).max(4096),
            reps: if h.quick { 1 } else { 3 },
            disturb_bytes,
            disturb_limit,
            // Two passes of kernel copies at about 2 MB/s, and boot, with a wide margin.
            timeout: Duration::from_secs(300 + 4 * extent / MIB),
        })
    }
}

/// One configuration of §5.2. `base` runs the smallest extent once per storage and file
/// system, so the exits of boot and reporting can be taken out of the per-MB counts.
#[derive(Clone, Copy, Debug)]
pub(super) struct Config {
    pub(super) storage: Storage,
    pub(super) fs: HostFs,
    pub(super) case: Case,
    pub(super) base: bool,
}

impl Config {
    pub(super) fn name(&self) -> String {
        format!(
            "{} on {} {}{}",
            self.storage.name(),
            self.fs.name(),
            self.case,
            if self.base { " (base)" } else { "" }
        )
    }

    pub(super) fn task(&self, plan: &Plan) -> String {
        if self.base {
            Case {
                write: false,
                mmap: false,
                warm: false,
            }
            .task(self.storage, 4096)
        } else {
            self.case.task(self.storage, plan.extent)
        }
    }
}

/// §5.2's configurations: per host file system, each storage it allows once at the smallest
/// extent (`base`) and then in every case, and QEMU's read cases on tmpfs when it runs.
pub(super) fn schedule(dirs: &[HostDir], with_qemu: bool) -> Vec<Config> {
    let mut configs = Vec::new();
    for d in dirs {
        let mut storages = vec![Storage::Vmms, Storage::VirtioWb];
        if d.direct {
            storages.push(Storage::VirtioNone);
        }
        for &s in &storages {
            configs.push(Config {
                storage: s,
                fs: d.fs,
                case: Case::all()[0],
                base: true,
            });
            for case in Case::all() {
                configs.push(Config {
                    storage: s,
                    fs: d.fs,
                    case,
                    base: false,
                });
            }
        }
        if with_qemu && d.fs == HostFs::Tmpfs {
            for case in Case::all().into_iter().filter(|c| !c.write) {
                configs.push(Config {
                    storage: Storage::QemuWb,
                    fs: d.fs,
                    case,
                    base: false,
                });
            }
        }
    }
    configs
}

/// A size for the report: whole MiB, else KiB.
pub(super) fn size_text(b: u64) -> String {
    if b.is_multiple_of(MIB) {
        format!("{} MiB", b / MIB)
    } else {
        format!("{} KiB", b / 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn dir(fs: HostFs, direct: bool) -> HostDir {
        HostDir {
            fs,
            dir: tempfile::tempdir().unwrap(),
            direct,
        }
    }

    #[test]
    fn the_schedule_has_a_base_and_every_case_per_storage_and_qemu_reads_on_tmpfs() {
        let dirs = [dir(HostFs::Tmpfs, false), dir(HostFs::Disk, true)];
        let configs = schedule(&dirs, true);
        let count = |s: Storage, fs: HostFs, base: bool| {
            configs
                .iter()
                .filter(|c| c.storage == s && c.fs == fs && c.base == base)
                .count()
        };
        for (s, fs) in [
            (Storage::Vmms, HostFs::Tmpfs),
            (Storage::VirtioWb, HostFs::Tmpfs),
            (Storage::Vmms, HostFs::Disk),
            (Storage::VirtioWb, HostFs::Disk),
            (Storage::VirtioNone, HostFs::Disk),
        ] {
            assert_eq!(
                (count(s, fs, true), count(s, fs, false)),
                (1, 8),
                "{s:?} {fs:?}"
            );
        }
        // No O_DIRECT on this tmpfs: no cache=none there.
        assert_eq!(count(Storage::VirtioNone, HostFs::Tmpfs, false), 0);
        assert_eq!(count(Storage::QemuWb, HostFs::Tmpfs, false), 4);
        assert!(configs
            .iter()
            .filter(|c| c.storage == Storage::QemuWb)
            .all(|c| !c.case.write));
        assert_eq!(count(Storage::QemuWb, HostFs::Disk, false), 0);
        assert!(!schedule(&dirs, false)
            .iter()
            .any(|c| c.storage == Storage::QemuWb));
    }

    #[test]
    fn an_extent_off_the_page_size_is_refused_naming_the_flag() {
        let h = Harness {
            out: PathBuf::from("."),
            quick: true,
        };
        let args = BenchArgs {
            experiment: "vmms".into(),
            quick: true,
            out: PathBuf::from("."),
            compare: None,
            extent: Some("5000".into()),
            qemu: None,
            nodes: None,
            link_delay: std::time::Duration::from_micros(100),
            ch_remote: None,
        };
        let e = Plan::new(&h, &args).err().unwrap();
        assert!(
            e.starts_with("--extent 5000: must be a non-zero multiple of 4 KiB"),
            "{e}"
        );
        let quick = Plan::new(
            &h,
            &BenchArgs {
                extent: None,
                ..args
            },
        )
        .unwrap();
        assert_eq!(quick.extent, QUICK_EXTENT);
        assert_eq!(quick.file_len % (2 * MIB), 0);
    }
}
