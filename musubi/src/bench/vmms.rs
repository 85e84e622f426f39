//! `musubi bench vmms`: paper 000's §5.2 and §5.3. The probe guest moves a file-sized extent
//! through the paper's four access paths (read/write × system calls/mmap, each warm and
//! cold) on storage as memory (`--pmem`, advertised by E820) and on virtio-blk with the host
//! page cache on (`cache=writeback`) and off (`cache=none`), with the host file on tmpfs (the
//! paper's RAM disk) and on the regular file system. Then the same with a second VM writing a
//! large disk at the same time, with and without a memory cgroup on it.
//!
//! Times on this machine are distorted (guest CPL0 code is emulated, so every kernel copy
//! crawls), so beside each time we print what the guest and the VMM counted per MB moved:
//! VM exits, interrupts, page faults, virtio requests and bytes the guest kernel copied. Those
//! counts are what §6.1 reasons with, and they do not depend on the machine.

use super::qemu::{self, Outcome, Peer, Qemu, Standing};
use super::report::{figures_table, median_min, ms, Csv, Figure, Table};
use super::stats::{ratio, Summary};
use super::watch::{observe, tail, time_to_marker, Watch};
use super::{plot, BenchArgs, Harness};
use crate::probe;
use serde_json::Value;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm::config::{CacheMode, DiskConfig, ExitsMode, SerialMode, VmConfig};
use vmm::pmem::{Advertise, PmemConfig};

const MIB: u64 = 1 << 20;
/// Chosen so that a full run stays under 15 minutes on the nested-KVM development machine
/// (it took 7.3 minutes there): every system-call case copies the extent at CPL0 once or
/// twice, which that machine emulates at about 13 MB/s, over 54 configurations × 3
/// repetitions plus §5.3's 72 runs beside a disturbing VM. `--extent 512M` is the paper's.
const DEFAULT_EXTENT: u64 = 16 * MIB;
const QUICK_EXTENT: u64 = 2 * MIB;
const PAPER_EXTENT: &str = "512M";
/// Paper 000 §5.3: the disturbing VM moved 4 GB, and its cgroup was limited to 1 GB.
const DISTURB_BYTES: u64 = 4 << 30;
const DISTURB_LIMIT: u64 = 1 << 30;
const QUICK_DISTURB_BYTES: u64 = 256 * MIB;
const QUICK_DISTURB_LIMIT: u64 = 64 * MIB;
const RESULT_MARKER: &str = "{\"probe\":\"storage-io\"";
const TMPFS_MAGIC: i64 = 0x0102_1994;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Storage {
    Vmms,
    VirtioWb,
    VirtioNone,
    /// QEMU's virtio-blk with the host page cache on, for the read cases.
    QemuWb,
}

impl Storage {
    fn name(self) -> &'static str {
        match self {
            Storage::Vmms => "vmms",
            Storage::VirtioWb => "virtio/writeback",
            Storage::VirtioNone => "virtio/none",
            Storage::QemuWb => "qemu virtio/writeback",
        }
    }

    fn probe_storage(self) -> &'static str {
        match self {
            Storage::Vmms => "pmem",
            _ => "blk",
        }
    }

    fn file_stem(self) -> &'static str {
        match self {
            Storage::Vmms => "vmms",
            Storage::VirtioWb => "virtio-wb",
            Storage::VirtioNone => "virtio-none",
            Storage::QemuWb => "qemu-wb",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum HostFs {
    Tmpfs,
    Disk,
}

impl HostFs {
    fn name(self) -> &'static str {
        match self {
            HostFs::Tmpfs => "tmpfs",
            HostFs::Disk => "disk",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Case {
    write: bool,
    mmap: bool,
    warm: bool,
}

impl Case {
    fn all() -> Vec<Case> {
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

    fn op(self) -> &'static str {
        if self.write {
            "write"
        } else {
            "read"
        }
    }

    fn path(self) -> &'static str {
        if self.mmap {
            "mmap"
        } else {
            "syscall"
        }
    }

    fn warmth(self) -> &'static str {
        if self.warm {
            "warm"
        } else {
            "cold"
        }
    }

    /// The paper's range for virtio/VMMS with the host page cache on (§5.2): the mmap warm
    /// cases are the widest gap, the rest are given as one range per direction.
    fn paper_ratio(self) -> (f64, f64) {
        match (self.write, self.mmap && self.warm) {
            (false, true) => (8.4, 9.0),
            (true, true) => (9.8, 10.6),
            (false, false) => (2.8, 3.8),
            (true, false) => (1.4, 3.4),
        }
    }

    fn task(self, storage: Storage, bytes: u64) -> String {
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

/// What one measured run reported.
#[derive(Clone, Debug)]
struct Sample {
    ns: f64,
    kernel_copy_bytes: Option<f64>,
    page_faults: Option<f64>,
    virtio_requests: Option<f64>,
    interrupts: Option<f64>,
    /// VM exits of the whole run (boot, untimed warm pass, timed pass); `None` under QEMU.
    exits: Option<f64>,
    /// Virtio queue notifications the VMM saw over the whole run: the guest's counts cover
    /// only the timed pass, which a warm read serves from the guest cache without a request.
    doorbells: Option<f64>,
}

impl Sample {
    fn of(result: &Value, metrics: &Value) -> Result<Sample, String> {
        if result["ok"] == false {
            return Err(format!("the guest reported a failure: {result}"));
        }
        let ns = result["ns"]
            .as_f64()
            .ok_or_else(|| format!("no ns in {result}"))?;
        Ok(Sample {
            ns,
            kernel_copy_bytes: result["kernel_copy_bytes"].as_f64(),
            page_faults: result["page_faults"].as_f64(),
            virtio_requests: result["virtio_requests"].as_f64(),
            interrupts: result["interrupts"].as_f64(),
            exits: metrics["total_exits"].as_f64(),
            doorbells: match (
                metrics["notifications"]["ioeventfd"].as_f64(),
                metrics["notifications"]["mmio_exit"].as_f64(),
            ) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
        })
    }
}

/// The sizes one run of the experiment uses.
struct Plan {
    extent: u64,
    /// Backing files are whole 2 MiB units, as `--pmem` requires.
    file_len: u64,
    memory: u64,
    reps: usize,
    disturb_bytes: u64,
    disturb_limit: u64,
    timeout: Duration,
}

impl Plan {
    fn new(h: &Harness, args: &BenchArgs) -> Result<Plan, String> {
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
        // The probe's page cache takes about three quarters of RAM and must hold the extent.
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
            reps: if h.quick { 1 } else { 3 },
            disturb_bytes,
            disturb_limit,
            // Two passes of kernel copies at about 2 MB/s, and boot, with a wide margin.
            timeout: Duration::from_secs(300 + 4 * extent / MIB),
        })
    }
}

/// A host directory holding backing files, and what the directory's file system can do.
struct HostDir {
    fs: HostFs,
    dir: tempfile::TempDir,
    /// Whether files here can be opened with O_DIRECT (`cache=none`).
    direct: bool,
}

impl HostDir {
    fn new(fs: HostFs) -> Result<HostDir, String> {
        let candidates: Vec<PathBuf> = match fs {
            HostFs::Tmpfs => vec!["/dev/shm".into()],
            HostFs::Disk => {
                let target = std::env::current_exe()
                    .ok()
                    .and_then(|e| e.parent().map(Path::to_path_buf));
                ["/var/tmp".into()].into_iter().chain(target).collect()
            }
        };
        let mut why = Vec::new();
        for c in candidates {
            match statfs_type(&c) {
                Some(t) if (t == TMPFS_MAGIC) != (fs == HostFs::Tmpfs) => {
                    why.push(format!("{} is the wrong kind of file system", c.display()));
                    continue;
                }
                None => {
                    why.push(format!("{} is not there", c.display()));
                    continue;
                }
                _ => {}
            }
            match tempfile::Builder::new()
                .prefix("musubi-vmms-")
                .tempdir_in(&c)
            {
                Ok(dir) => {
                    let direct = direct_io_works(dir.path());
                    return Ok(HostDir { fs, dir, direct });
                }
                Err(e) => why.push(format!("{}: {e}", c.display())),
            }
        }
        Err(format!(
            "no directory for the {} backing files: {}",
            fs.name(),
            why.join("; ")
        ))
    }

    fn file(&self, s: Storage) -> PathBuf {
        self.dir.path().join(format!("{}.img", s.file_stem()))
    }
}

fn statfs_type(p: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a properly sized out-parameter.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    (r == 0).then_some(st.f_type as i64)
}

/// Older tmpfs refuses O_DIRECT with EINVAL; `cache=none` is meaningless there.
fn direct_io_works(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(".direct-probe");
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

/// Writes a backing file with data in every byte, so reads reach real blocks and no run
/// measures the host filling holes.
fn make_file(path: &Path, len: u64) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let block: Vec<u8> = (0..MIB).map(|i| (i * 7 + 3) as u8).collect();
    let mut left = len;
    while left > 0 {
        let n = left.min(MIB) as usize;
        f.write_all(&block[..n])
            .map_err(|e| format!("{}: {e}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| format!("{}: {e}", path.display()))
}

fn vm_config(plan: &Plan, storage: Storage, file: &Path, task: &str) -> VmConfig {
    let disk = |cache| {
        vec![DiskConfig {
            path: file.to_path_buf(),
            readonly: false,
            cache,
        }]
    };
    let (disks, pmem) = match storage {
        Storage::Vmms => (
            Vec::new(),
            vec![PmemConfig {
                file: file.to_path_buf(),
                size: None,
                readonly: false,
                advertise: Advertise::E820,
            }],
        ),
        Storage::VirtioNone => (disk(CacheMode::None), Vec::new()),
        Storage::VirtioWb | Storage::QemuWb => (disk(CacheMode::Writeback), Vec::new()),
    };
    VmConfig {
        kernel: probe::image(),
        cmdline: format!("probe.task_timeout=0 probe.tasks={task}"),
        initrd: None,
        cpus: 1,
        memory: plan.memory,
        disks,
        pmem,
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    }
}

/// Runs one probe task in this process and returns its result line and exit accounting.
fn musubi_run(plan: &Plan, storage: Storage, file: &Path, task: &str) -> Result<Sample, String> {
    let config = vm_config(plan, storage, file, task);
    let opts = vmm::RunOptions {
        capture_serial: true,
        timeout: Some(plan.timeout),
        ..Default::default()
    };
    let report = vmm::run_vm(&config, &opts).map_err(|e| e.to_string())?;
    let console = String::from_utf8_lossy(&report.serial).into_owned();
    if report.outcome != vmm::Outcome::GuestExit(0) {
        return Err(format!(
            "{task}: the guest ended with {:?}; console:\n{}",
            report.outcome,
            tail(&console, 15)
        ));
    }
    let results = probe::results(&report.serial);
    let r = probe::result(&results, "storage-io")
        .ok_or_else(|| format!("{task}: no result line; console:\n{}", tail(&console, 15)))?;
    Sample::of(r, &report.metrics)
}

/// The same task under QEMU (microvm, virtio-blk over virtio-mmio, host page cache on).
fn qemu_run(q: &Qemu, plan: &Plan, file: &Path, task: &str) -> Result<Sample, String> {
    let mut cmd = q.command(
        plan.memory / MIB,
        &format!("probe.task_timeout=0 probe.tasks={task}"),
    );
    // With acpi=off microvm appends `virtio_mmio.device=` for each transport to the command
    // line, which is how the probe finds disks; the probe speaks virtio-mmio version 2 only.
    cmd.args(["-global", "virtio-mmio.force-legacy=false"])
        .arg("-drive")
        .arg(format!(
            "if=none,id=d0,file={},format=raw,cache=writeback",
            file.display()
        ))
        .args(["-device", "virtio-blk-device,drive=d0"]);
    let watch = Watch {
        marker: RESULT_MARKER,
        // A sampler would take CPU time from the measured VM.
        guest_bytes: None,
        timeout: plan.timeout,
        sample_every: Duration::from_millis(20),
    };
    let o = observe(cmd, &watch).map_err(|e| format!("cannot start QEMU: {e}"))?;
    time_to_marker(&o, qemu::CLEAN_STATUS, qemu::STDERR_LINES)?;
    let results = probe::results(o.stdout.as_bytes());
    let r = probe::result(&results, "storage-io")
        .ok_or_else(|| format!("a storage-io line that is not JSON: {}", tail(&o.stdout, 3)))?;
    Sample::of(r, &Value::Null)
}

/// One configuration of §5.2. `base` runs the smallest extent once per storage and file
/// system, so the exits of boot and reporting can be taken out of the per-MB counts.
#[derive(Clone, Copy, Debug)]
struct Config {
    storage: Storage,
    fs: HostFs,
    case: Case,
    base: bool,
}

impl Config {
    fn name(&self) -> String {
        format!(
            "{} on {} {}{}",
            self.storage.name(),
            self.fs.name(),
            self.case,
            if self.base { " (base)" } else { "" }
        )
    }

    fn task(&self, plan: &Plan) -> String {
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

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    let plan = Plan::new(h, args)?;
    let started = Instant::now();
    println!(
        "VMMS (paper 000 §5.2): {} extent (paper: {PAPER_EXTENT}), {} repetition(s), guest RAM {} MiB",
        size_text(plan.extent),
        plan.reps,
        plan.memory / MIB
    );
    let dirs = [HostDir::new(HostFs::Tmpfs)?, HostDir::new(HostFs::Disk)?];
    for d in &dirs {
        println!(
            "  host files on {}: {}{}",
            d.fs.name(),
            d.dir.path().display(),
            if d.direct {
                ""
            } else {
                " (O_DIRECT refused here: virtio/none is skipped on this file system)"
            }
        );
    }
    let mut peer = Standing::default();
    let qemu = match qemu::peer(args, &["microvm,acpi=off"])? {
        Peer::Ready(q) => Some(q),
        Peer::Skipped(why) => {
            println!("  QEMU: {why}; no side-by-side runs");
            None
        }
        Peer::Unavailable(why) => {
            peer.unavailable = Some(why);
            None
        }
    };
    if qemu.is_some() {
        println!(
            "  QEMU: the read cases with virtio-blk (microvm, acpi=off, modern virtio-mmio, cache=writeback) on tmpfs. QEMU has no\n  \
             file-backed E820 type-12 region for a PVH guest, so VMMS is compared with QEMU's virtio-blk."
        );
    }

    let mut configs = Vec::new();
    for d in &dirs {
        let mut storages = vec![Storage::Vmms, Storage::VirtioWb];
        if d.direct {
            storages.push(Storage::VirtioNone);
        }
        for &s in &storages {
            make_file(&d.file(s), plan.file_len)?;
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
        if qemu.is_some() && d.fs == HostFs::Tmpfs {
            make_file(&d.file(Storage::QemuWb), plan.file_len)?;
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
    let dir_of = |fs: HostFs| dirs.iter().find(|d| d.fs == fs).expect("both dirs exist");

    // A failed QEMU run is reported and the rest goes on: QEMU is a comparison, not the subject.
    let runs = h.run_schedule(
        &configs,
        plan.reps,
        |c| c.name(),
        |rep, c| {
            let file = dir_of(c.fs).file(c.storage);
            let task = c.task(&plan);
            match (c.storage, &qemu) {
                (Storage::QemuWb, Some(q)) => Ok(peer
                    .run(&format!("{} run {}", c.name(), rep + 1), || {
                        qemu_run(q, &plan, &file, &task)
                    })),
                _ => musubi_run(&plan, c.storage, &file, &task).map(Outcome::Measured),
            }
        },
    )?;

    let mut csv = Csv::new(&[
        "experiment",
        "storage",
        "host_fs",
        "op",
        "path",
        "warm",
        "disturb",
        "rep",
        "bytes",
        "ns",
        "vm_exits",
        "base_vm_exits",
        "interrupts",
        "page_faults",
        "virtio_requests",
        "kernel_copy_bytes",
        "run_doorbells",
        "cpu_model",
        "unavailable",
    ]);
    let base_exits = |storage: Storage, fs: HostFs| -> Option<f64> {
        let xs: Vec<f64> = runs
            .iter()
            .filter(|(_, ci, _)| {
                let c = &configs[*ci];
                c.base && c.storage == storage && c.fs == fs
            })
            .filter_map(|(_, _, s)| s.measured()?.exits)
            .collect();
        super::stats::median(&xs)
    };
    for (rep, ci, s) in &runs {
        let c = &configs[*ci];
        if c.base {
            continue;
        }
        let cpu_model = match (c.storage, &qemu) {
            (Storage::QemuWb, Some(q)) => q.cpu_model().to_string(),
            _ => String::new(),
        };
        let mut row = vec![
            "5.2".to_string(),
            c.storage.name().to_string(),
            c.fs.name().to_string(),
            c.case.op().to_string(),
            c.case.path().to_string(),
            c.case.warmth().to_string(),
            "none".to_string(),
            rep.to_string(),
            plan.extent.to_string(),
        ];
        match s {
            Outcome::Measured(s) => row.extend([
                format!("{:.0}", s.ns),
                opt(s.exits),
                opt(base_exits(c.storage, c.fs)),
                opt(s.interrupts),
                opt(s.page_faults),
                opt(s.virtio_requests),
                opt(s.kernel_copy_bytes),
                opt(s.doorbells),
                cpu_model.clone(),
                String::new(),
            ]),
            Outcome::PeerFailed(why) => {
                row.resize(17, String::new());
                row.push(cpu_model);
                row.push(why.clone());
            }
            Outcome::NotMade => continue,
        }
        csv.row(row);
    }
    // A peer that never started has no runs, and one row that says why.
    if let (None, Some(why)) = (&qemu, &peer.unavailable) {
        let mut row = vec![
            "5.2".to_string(),
            Storage::QemuWb.name().to_string(),
            HostFs::Tmpfs.name().to_string(),
        ];
        row.resize(18, String::new());
        row.push(why.clone());
        csv.row(row);
    }

    let pick = |storage: Storage, fs: HostFs, case: Case| -> Vec<&Sample> {
        runs.iter()
            .filter(|(_, ci, _)| {
                let c = &configs[*ci];
                !c.base && c.storage == storage && c.fs == fs && c.case == case
            })
            .filter_map(|(_, _, s)| s.measured())
            .collect()
    };
    let time = |storage, fs, case| {
        Summary::of(
            &pick(storage, fs, case)
                .iter()
                .map(|s| s.ns)
                .collect::<Vec<_>>(),
        )
    };
    let has = |storage: Storage, fs: HostFs| {
        configs
            .iter()
            .any(|c| c.storage == storage && c.fs == fs && !c.base)
    };

    // Costs and ratios.
    let mut t = Table::new(&[
        "host file",
        "case",
        ">vmms ms",
        ">virtio/wb ms",
        ">virtio/none ms",
        ">qemu/wb ms",
        ">wb/vmms",
        ">none/vmms",
        ">qemu/vmms",
        ">paper virtio/vmms (wb)",
    ]);
    let mut figures = Vec::new();
    let mut panels = Vec::new();
    let f2 = |v: Option<f64>| v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
    for d in &dirs {
        let mut ahead = Vec::new();
        for case in Case::all() {
            let v = time(Storage::Vmms, d.fs, case);
            let wb = time(Storage::VirtioWb, d.fs, case);
            let none = time(Storage::VirtioNone, d.fs, case);
            let qm = time(Storage::QemuWb, d.fs, case);
            let r = |o: Option<Summary>| match (o, v) {
                (Some(o), Some(v)) => ratio(o.median, v.median),
                _ => None,
            };
            let cell = |s: Option<Summary>, present: bool| {
                if present {
                    median_min(s, ms)
                } else {
                    "-".into()
                }
            };
            let (lo, hi) = case.paper_ratio();
            t.row([
                d.fs.name().to_string(),
                case.to_string(),
                cell(v, true),
                cell(wb, true),
                cell(none, has(Storage::VirtioNone, d.fs)),
                cell(qm, has(Storage::QemuWb, d.fs)),
                f2(r(wb)),
                f2(r(none)),
                f2(r(qm)),
                format!("{lo:.1}-{hi:.1}x"),
            ]);
            for x in [r(wb), r(none)].into_iter().flatten() {
                ahead.push((case, x));
            }
            if case.mmap && case.warm {
                let goal = if case.write { 10.6 } else { 9.0 };
                figures.push(Figure {
                    what: format!("virtio/wb / vmms, {case}, {}", d.fs.name()),
                    ours: f2(r(wb)),
                    reference: format!(">= {goal:.1}x"),
                    source: "paper 000 §5.2 (mmap warm, host page cache on)".into(),
                    met: r(wb).map(|x| x >= goal),
                });
            }
        }
        let worst = ahead
            .iter()
            .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
        figures.push(Figure {
            what: format!("vmms ahead of virtio in every case, {}", d.fs.name()),
            ours: worst
                .map(|(c, x)| format!("min {x:.2}x ({c})"))
                .unwrap_or_else(|| "-".into()),
            reference: "> 1x".into(),
            source: "issue 3 goal; paper: 1.4x at least".into(),
            met: worst.map(|(_, x)| *x > 1.0),
        });
    }
    // One panel per case, each on its own scale: the costs span three orders of magnitude.
    for case in Case::all() {
        let mut bars = Vec::new();
        for d in &dirs {
            for s in [
                Storage::Vmms,
                Storage::VirtioWb,
                Storage::VirtioNone,
                Storage::QemuWb,
            ] {
                if let Some(m) = time(s, d.fs, case) {
                    let short = match s {
                        Storage::Vmms => "vmms",
                        Storage::VirtioWb => "wb",
                        Storage::VirtioNone => "none",
                        Storage::QemuWb => "qemu",
                    };
                    bars.push(plot::Bar {
                        label: format!("{short}/{}", &d.fs.name()[..1]),
                        value: m.median / 1e6,
                        low: Some(m.min / 1e6),
                    });
                }
            }
        }
        panels.push(plot::Panel {
            title: case.to_string(),
            unit: "ms".into(),
            bars,
        });
    }
    println!();
    println!(
        "Cost of moving {} (median / min over {} run(s); ratios of medians)",
        size_text(plan.extent),
        plan.reps
    );
    println!("{}", t.render());
    println!(
        "paper 000 §5.2 (512 MB, host page cache on): virtio/VMMS up to 9.0x reading and 10.6x writing;\n\
         mmap warm 8.4-9.0x (read) / 9.8-10.6x (write); the other cases 2.8-3.8x (read) / 1.4-3.4x (write)."
    );
    peer.print();

    // Counts per MB: what each path costs in the currency §6.1 reasons with.
    let mut c = Table::new(&[
        "storage",
        "case",
        ">VM exits/MB",
        ">interrupts/MB",
        ">page faults/MB",
        ">virtio req/MB",
        ">CPL0 copy B/B",
        ">doorbells/MB (run)",
    ]);
    let mb = plan.extent as f64 / MIB as f64;
    let count_fs = HostFs::Disk;
    for storage in [
        Storage::Vmms,
        Storage::VirtioWb,
        Storage::VirtioNone,
        Storage::QemuWb,
    ] {
        let fs = if storage == Storage::QemuWb {
            HostFs::Tmpfs
        } else {
            count_fs
        };
        if !has(storage, fs) {
            continue;
        }
        let base = base_exits(storage, fs);
        for case in Case::all() {
            let ss = pick(storage, fs, case);
            if ss.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&Sample) -> Option<f64>| {
                super::stats::median(&ss.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
            };
            // Exits cover the whole run: a warm run moves the extent twice.
            let passes = if case.warm { 2.0 } else { 1.0 };
            let exits = med(&|s| Some(((s.exits? - base?) / (passes * mb)).max(0.0)));
            let per = |f: &dyn Fn(&Sample) -> Option<f64>| {
                med(&|s| f(s).map(|v| v / mb))
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into())
            };
            c.row([
                storage.name().to_string(),
                case.to_string(),
                exits
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
                per(&|s| s.interrupts),
                per(&|s| s.page_faults),
                per(&|s| s.virtio_requests),
                med(&|s| s.kernel_copy_bytes.map(|b| b / plan.extent as f64))
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_else(|| "-".into()),
                med(&|s| Some(s.doorbells? / (passes * mb)))
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
            ]);
        }
    }
    println!();
    println!(
        "What each path did per MB moved (host file on {}; QEMU on tmpfs; medians). VM exits are the\n\
         run's exits less a run of a 4 KiB extent, over every pass (a warm run moves the extent twice);\n\
         the guest's counts cover the timed pass. CPL0 copy B/B: bytes the guest kernel copied per byte moved;\n\
         doorbells: virtio queue notifications the VMM saw over the whole run, per MB of every pass.",
        count_fs.name()
    );
    println!("{}", c.render());
    println!(
        "On this machine guest kernel code is emulated (see DESIGN): every CPL0 copy runs at a few MB/s\n\
         and every exit costs about 85 us, so the times above exaggerate the paths with kernel copies\n\
         and exits (virtio; VMMS syscall). The counts are what carries over to a real KVM host: VMMS\n\
         moves data with no virtio request, no interrupt and, on mmap, no kernel copy at all (§6.1).\n\
         Where the counts match, the times cannot differ by the paper's factors: in the system-call\n\
         cases both storages copy every byte at CPL0 once (CPL0 copy B/B = 1) and that emulated copy is\n\
         most of the time; in the mmap warm reads the warm pass leaves every page mapped in both (the\n\
         region itself, or the guest's page cache), so the timed pass is user-mode loads with no fault,\n\
         request or copy on either side. The paper's guests were Linux 3.4 with ext2 and a block layer\n\
         with request scheduling (§6.1 attributes most of the gap to that); the probe guest has neither."
    );

    // §5.3.
    let disturb = disturbance(h, &plan, &dirs[1], &mut csv)?;

    println!();
    println!("{}", figures_table(&figures));
    if let Some(text) = disturb {
        println!("{text}");
    }
    let p = h.write_csv("vmms.csv", &csv)?;
    let s = h.write_chart(
        "vmms.svg",
        "VMMS vs virtio-blk: cost (median ms; /t tmpfs, /d disk)",
        &panels,
    )?;
    println!("csv: {}\nplot: {}", p.display(), s.display());
    println!("elapsed: {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.0}")).unwrap_or_default()
}

fn size_text(b: u64) -> String {
    if b.is_multiple_of(MIB) {
        format!("{} MiB", b / MIB)
    } else {
        format!("{} KiB", b / 1024)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Disturb {
    Alone,
    Disturbed,
    Cgroup,
}

impl Disturb {
    fn name(self) -> &'static str {
        match self {
            Disturb::Alone => "none",
            Disturb::Disturbed => "disturb",
            Disturb::Cgroup => "disturb+cgroup",
        }
    }
}

/// A temporary cgroup v1 memory group for the disturbing VM, removed on drop.
struct MemCgroup {
    dir: PathBuf,
    procs: std::ffi::CString,
}

impl MemCgroup {
    fn create(limit: u64) -> Result<MemCgroup, String> {
        let root = Path::new("/sys/fs/cgroup/memory");
        if !root.join("memory.limit_in_bytes").exists() {
            return Err(format!(
                "{} is not a cgroup v1 memory hierarchy",
                root.display()
            ));
        }
        let dir = root.join(format!("musubi-vmms-disturb-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let g = MemCgroup {
            procs: std::ffi::CString::new(dir.join("cgroup.procs").to_string_lossy().into_owned())
                .map_err(|e| e.to_string())?,
            dir,
        };
        // The paper turned hierarchical accounting on; a fresh group accepts it.
        let _ = std::fs::write(g.dir.join("memory.use_hierarchy"), "1");
        let lim = g.dir.join("memory.limit_in_bytes");
        std::fs::write(&lim, limit.to_string()).map_err(|e| format!("{}: {e}", lim.display()))?;
        Ok(g)
    }

    /// Makes `cmd` join the group before it runs, so every page the disturbing VM touches,
    /// its guest RAM and the host page cache of its disk, is charged to the group.
    fn spawn_in(&self, cmd: &mut Command) -> std::io::Result<Child> {
        use std::os::unix::process::CommandExt;
        let procs = self.procs.clone();
        // SAFETY: the closure only calls async-signal-safe functions (open, write, close)
        // on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn()
    }

    fn peak(&self) -> Option<u64> {
        std::fs::read_to_string(self.dir.join("memory.max_usage_in_bytes"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "musubi bench vmms: could not remove the cgroup {}",
            self.dir.display()
        );
    }
}

/// A disturbing VM (`musubi run ... blk-fill`) kept running, restarted whenever it finishes,
/// until dropped.
struct Disturber {
    stop: Arc<AtomicBool>,
    fills: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Disturber {
    fn start(disk: PathBuf, cgroup: Option<Arc<MemCgroup>>) -> Result<Disturber, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let fills = Arc::new(AtomicU64::new(0));
        let (stop2, fills2) = (stop.clone(), fills.clone());
        let thread = std::thread::spawn(move || -> Result<(), String> {
            let mut seed = 1u64;
            while !stop2.load(Ordering::Relaxed) {
                let mut cmd = Command::new(&exe);
                cmd.args(["run", "--kernel", "probe", "--serial", "off"])
                    .arg("--disk")
                    .arg(format!("path={}", disk.display()))
                    .arg("--cmdline")
                    .arg(format!("probe.tasks=blk-fill={seed}"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped());
                let child = match &cgroup {
                    Some(g) => g.spawn_in(&mut cmd),
                    None => cmd.spawn(),
                };
                let mut child =
                    child.map_err(|e| format!("disturbing VM {}: {e}", exe.display()))?;
                let status = loop {
                    if stop2.load(Ordering::Relaxed) {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Ok(());
                    }
                    match child.try_wait() {
                        Ok(Some(s)) => break s,
                        Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                        Err(e) => return Err(format!("disturbing VM: wait: {e}")),
                    }
                };
                if !status.success() {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = std::io::Read::read_to_string(&mut e, &mut err);
                    }
                    return Err(format!(
                        "the disturbing VM ended with {status}: {}",
                        tail(&err, 5)
                    ));
                }
                fills2.fetch_add(1, Ordering::Relaxed);
                seed += 1;
            }
            Ok(())
        });
        // Let it boot and start writing before anything is measured.
        std::thread::sleep(Duration::from_secs(2));
        Ok(Disturber {
            stop,
            fills,
            thread: Some(thread),
        })
    }

    /// Stops the VM and says whether it kept running the whole time, and how many whole
    /// fills of its disk it finished.
    fn finish(mut self) -> Result<u64, String> {
        self.stop.store(true, Ordering::Relaxed);
        let r = self.thread.take().map(|t| t.join());
        match r {
            Some(Ok(Ok(()))) => Ok(self.fills.load(Ordering::Relaxed)),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err("the disturbing VM's watcher panicked".into()),
            None => Ok(0),
        }
    }
}

impl Drop for Disturber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// §5.3: the paper's measurement again (VMMS and virtio/writeback, read and write, both
/// paths, warm) alone, beside a VM writing a large disk, and with that VM in a memory
/// cgroup. Host files on the regular file system, where the host page cache is shared.
fn disturbance(
    h: &Harness,
    plan: &Plan,
    dir: &HostDir,
    csv: &mut Csv,
) -> Result<Option<String>, String> {
    let big = dir.dir.path().join("disturb.img");
    // A new file for every disturbed run: cgroup v1 charges a cached page to the group that
    // first read or wrote it, so pages left cached by an earlier run outside the group would
    // never count against its limit. Unlinking the old file drops its pages.
    let fresh_disk = || -> Result<(), String> {
        let _ = std::fs::remove_file(&big);
        let f = std::fs::File::create(&big).map_err(|e| format!("{}: {e}", big.display()))?;
        f.set_len(plan.disturb_bytes)
            .map_err(|e| format!("{}: {e}", big.display()))
    };
    let mut conds = vec![Disturb::Alone, Disturb::Disturbed];
    let cgroup_note = match MemCgroup::create(plan.disturb_limit) {
        Ok(g) => {
            drop(g);
            conds.push(Disturb::Cgroup);
            None
        }
        Err(e) => Some(format!(
            "the cgroup condition is skipped: cannot make a memory cgroup ({e}); run as root on cgroup v1"
        )),
    };
    let storages = [Storage::Vmms, Storage::VirtioWb];
    let cases: Vec<Case> = Case::all().into_iter().filter(|c| c.warm).collect();
    println!();
    println!(
        "Page-cache interference (paper 000 §5.3): a second VM fills a {} virtio-blk disk (cache=writeback)\n\
         over and over while the measured VM runs the warm cases; cgroup: the disturber in a {} memory cgroup.",
        size_text(plan.disturb_bytes),
        size_text(plan.disturb_limit)
    );
    if let Some(n) = &cgroup_note {
        println!("  {n}");
    }
    let mut peaks = Vec::new();
    let runs = h.run_schedule(
        &conds,
        plan.reps,
        |d| format!("§5.3 {}", d.name()),
        |_, d| {
            let group = match d {
                Disturb::Cgroup => Some(Arc::new(MemCgroup::create(plan.disturb_limit)?)),
                _ => None,
            };
            let disturber = match d {
                Disturb::Alone => None,
                _ => {
                    fresh_disk()?;
                    Some(Disturber::start(big.clone(), group.clone())?)
                }
            };
            let mut out = Vec::new();
            for &s in &storages {
                for &c in &cases {
                    let task = c.task(s, plan.extent);
                    out.push((s, c, musubi_run(plan, s, &dir.file(s), &task)?));
                }
            }
            let fills = match disturber {
                Some(x) => x.finish()?,
                None => 0,
            };
            if let Some(g) = &group {
                peaks.push(g.peak());
            }
            Ok((out, fills))
        },
    )?;
    for (rep, ci, (out, _)) in &runs {
        for (s, c, x) in out {
            csv.row([
                "5.3".to_string(),
                s.name().to_string(),
                dir.fs.name().to_string(),
                c.op().to_string(),
                c.path().to_string(),
                c.warmth().to_string(),
                conds[*ci].name().to_string(),
                rep.to_string(),
                plan.extent.to_string(),
                format!("{:.0}", x.ns),
                opt(x.exits),
                String::new(),
                opt(x.interrupts),
                opt(x.page_faults),
                opt(x.virtio_requests),
                opt(x.kernel_copy_bytes),
                opt(x.doorbells),
                String::new(),
                String::new(),
            ]);
        }
    }
    let med = |d: Disturb, s: Storage, c: Case| -> Option<f64> {
        let xs: Vec<f64> = runs
            .iter()
            .filter(|(_, ci, _)| conds[*ci] == d)
            .flat_map(|(_, _, (out, _))| out.iter())
            .filter(|(s2, c2, _)| *s2 == s && *c2 == c)
            .map(|(_, _, x)| x.ns)
            .collect();
        super::stats::median(&xs)
    };
    let mut t = Table::new(&[
        "storage",
        "case",
        ">alone ms",
        ">+disturb ms",
        ">increase",
        ">paper",
        ">+cgroup ms",
        ">increase",
        ">paper",
    ]);
    let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:+.0}%", (a / b - 1.0) * 100.0),
        _ => "-".into(),
    };
    let msv = |v: Option<f64>| v.map(ms).unwrap_or_else(|| "-".into());
    for &s in &storages {
        for &c in &cases {
            let (a, d, g) = (
                med(Disturb::Alone, s, c),
                med(Disturb::Disturbed, s, c),
                med(Disturb::Cgroup, s, c),
            );
            let (pd, pg) = match (s, c.write) {
                (Storage::Vmms, false) => ("16-22%", "2-9%"),
                (Storage::Vmms, true) => ("17-63%", "6-17%"),
                (_, false) => ("20-25%", "16-31%"),
                (_, true) => ("7-25%", "7-24%"),
            };
            t.row([
                s.name().to_string(),
                c.to_string(),
                msv(a),
                msv(d),
                pct(d, a),
                pd.to_string(),
                msv(g),
                pct(g, a),
                pg.to_string(),
            ]);
        }
    }
    let fills: u64 = runs.iter().map(|(_, _, (_, f))| *f).sum();
    let peak = peaks
        .iter()
        .flatten()
        .max()
        .map(|p| format!("; cgroup peak usage {} MiB", p / MIB))
        .unwrap_or_default();
    let mut text = String::new();
    text.push_str(&format!(
        "Cost increase with a disturbing VM (median; host files on {}; extent {})\n",
        dir.fs.name(),
        size_text(plan.extent)
    ));
    text.push_str(&t.render());
    text.push_str(&format!(
        "paper 000 §5.3 (increase over alone): VMMS read 16-22% / write 17-63%, with the cgroup 2-9% / 6-17%;\n\
         virtio read 20-25% / write 7-25%, with the cgroup 16-31% / 7-24%.\n\
         The disturbing VM finished {fills} whole fill(s) of its disk during the measurements{peak}. With 2 cores\n\
         the two VMs also compete for CPU time, which the paper's 4-core host did not have to share."
    ));
    if let Some(n) = cgroup_note {
        text.push_str(&format!("\n{n}"));
    }
    Ok(Some(text))
}
