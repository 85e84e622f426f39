//! Command-line and JSON-file description of a VM, merged into a `VmConfig`.

use crate::migrate::{MigrationUrl, Owned};
use crate::probe;
use crate::value::{from_str, Own};
use clap::Args;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;
use vmm::config::net::NetConfig;
use vmm::config::rng::{RngConfig, RNG_SYNTAX};
use vmm::config::vsock::VsockConfig;
use vmm::config::{self, DiskConfig, ExitsMode, KernelImage, SerialMode, Size, VmConfig};
use vmm::pmem::PmemConfig;

/// Flags of `musubi run` (and of every command that boots a VM).
#[derive(Args, Debug, Clone, Default)]
pub struct VmArgs {
    /// Kernel to boot: an ELF vmlinux with a PVH note, a bzImage, or `probe` for the
    /// bundled probe guest.
    #[arg(long, value_name = "PATH|probe", value_parser = from_str::<Kernel>())]
    pub kernel: Option<Kernel>,
    /// Kernel command line. Default: `probe.tasks=hello` for the probe guest,
    /// `console=ttyS0 reboot=k panic=1` otherwise. virtio-mmio devices are appended.
    #[arg(long, value_name = "STR")]
    pub cmdline: Option<String>,
    /// Initial ramdisk for Linux.
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    #[arg(long, value_name = "N", help = format!(
        "Number of vCPUs, 1 to {} (what the MP table holds). Default 1.",
        config::MAX_VCPUS
    ))]
    pub cpus: Option<u64>,
    /// Guest RAM: bytes, or a number with a K, M, G or T suffix (binary units, decimals
    /// allowed), e.g. 256M, 1.5G. Default 256M.
    #[arg(long, value_name = "SIZE", value_parser = Own(memory_size))]
    pub memory: Option<Size>,
    /// A virtio-blk disk; repeat for more. cache=none opens the file with O_DIRECT.
    #[arg(
        long,
        value_name = "path=FILE[,readonly=on][,cache=writeback|none]",
        value_parser = from_str::<DiskConfig>()
    )]
    pub disk: Vec<DiskConfig>,
    /// Storage as memory: a file mapped into guest-physical memory above RAM; repeat for
    /// more. Advertised as E820 persistent memory (type 12) or as a virtio-pmem device.
    #[arg(long, value_name = vmm::pmem::PMEM_SYNTAX, value_parser = from_str::<PmemConfig>())]
    pub pmem: Vec<PmemConfig>,
    /// A virtio-net device over a TAP interface; repeat for more. tap=NAME opens the TAP,
    /// creating it when missing (with ip= and mask= given to its host end); fd=N takes one
    /// already opened with IFF_VNET_HDR, fd=A:B:... several queues of one multiqueue TAP.
    /// num_queues= counts receive and transmit queues (even, 2 to 32, default 2, with fd=
    /// twice the descriptors): a TAP queue per pair. rate= limits each
    /// direction (token buckets a second deep). The MAC is made up (locally administered)
    /// when not given.
    #[arg(long, value_name = config::net::NET_SYNTAX, value_parser = from_str::<NetConfig>())]
    pub net: Vec<NetConfig>,
    /// A virtio-rng device fed from the host's getrandom(2); bytes_per_sec= caps the bytes
    /// the guest gets a second (a token bucket a second deep). `--rng` alone: no cap.
    #[arg(
        long,
        value_name = RNG_SYNTAX,
        num_args = 0..=1,
        default_missing_value = "",
        value_parser = from_str::<RngConfig>()
    )]
    pub rng: Option<RngConfig>,
    /// A virtio-vsock device whose host side is a UNIX socket at PATH (Firecracker's and
    /// Cloud Hypervisor's hybrid vsock): a host program connects there and writes
    /// `CONNECT <port>\n` to reach the guest's listener on that port (answered
    /// `OK <hostport>\n`); a guest connecting to host port P reaches the UNIX listener at
    /// `PATH_P`. cid is the guest's context id, 3 or more. The socket file is removed
    /// when the VM ends.
    #[arg(long, value_name = config::vsock::VSOCK_SYNTAX, value_parser = from_str::<VsockConfig>())]
    pub vsock: Option<VsockConfig>,
    /// Where the guest's COM1 goes. Default stdio.
    #[arg(long, value_name = "stdio|off|file=PATH", value_parser = from_str::<SerialMode>())]
    pub serial: Option<SerialMode>,
    /// Where hot traps are handled: `kernel` (ioeventfd doorbells served by an I/O
    /// thread, irqfd interrupts) or `user` (every doorbell an MMIO exit on the vCPU
    /// thread, every interrupt injected from user space). Default kernel.
    #[arg(long, value_name = "kernel|user", value_parser = from_str::<ExitsMode>())]
    pub exits: Option<ExitsMode>,
    /// JSON file with the same fields (kernel, cmdline, initrd, cpus, memory, disks,
    /// pmem, net, rng, vsock, serial, exits); flags given on the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// `--kernel`: the bundled probe guest, or a file (whether it is one is checked when the
/// configuration is resolved, as for a JSON file's `kernel`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kernel {
    Probe,
    File(PathBuf),
}

impl std::str::FromStr for Kernel {
    type Err = std::convert::Infallible;

    fn from_str(text: &str) -> Result<Kernel, Self::Err> {
        Ok(match text {
            probe::PROBE_NAME => Kernel::Probe,
            path => Kernel::File(PathBuf::from(path)),
        })
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kernel::Probe => f.write_str(probe::PROBE_NAME),
            Kernel::File(p) => write!(f, "{}", p.display()),
        }
    }
}

impl<'de> Deserialize<'de> for Kernel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Ok(text.parse().unwrap_or_else(|never| match never {}))
    }
}

/// How a VM of `musubi run` is controlled while it runs, and where it comes from.
#[derive(Args, Debug, Clone, Default)]
pub struct ControlFlags {
    /// Serve the control API (HTTP/1.1 and JSON, Cloud Hypervisor's paths) on this UNIX
    /// socket, created mode 0600: ping, info, counters, pause, resume, snapshot, shutdown,
    /// and Musubi's vm.replicate (`musubi remote replicate`: keep the VM on a standby).
    /// `musubi remote --api-socket PATH` is its client.
    #[arg(long, value_name = "PATH", conflicts_with = "nodes")]
    pub api_socket: Option<PathBuf>,
    /// Restore the VM saved in this snapshot directory instead of booting one. Its
    /// configuration comes from the snapshot; --cpus, --memory, --disk, --pmem, --net,
    /// --rng and --exits, when given, must match it; --serial may send the console elsewhere, and
    /// --vsock (of the same cid) may move the vsock's host socket. Guest RAM is mapped
    /// copy-on-write from the snapshot's memory file, so the snapshot is never changed and
    /// can be restored again.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kernel", "cmdline", "initrd", "config", "nodes"])]
    pub restore: Option<PathBuf>,
    /// How a restored VM's RAM is filled: `mapped` maps the snapshot's memory file
    /// copy-on-write (the kernel reads a page when the guest first touches it); `prefault`
    /// maps it so and reads every page in before the VM runs; `ondemand`
    /// gives the guest empty memory and a thread of the VMM reads each page from the file
    /// at its first touch, through userfaultfd (needs root or vm.unprivileged_userfaultfd=1),
    /// so the file is only read, never mapped, and the pages read are counted.
    #[arg(
        long,
        value_name = "mapped|prefault|ondemand",
        default_value = "mapped",
        requires = "restore"
    )]
    pub restore_memory: RestoreMemory,
    /// Wait on tcp:HOST:PORT for one VM sent by another musubi (`musubi remote
    /// send-migration`, or PUT vm.send-migration) instead of booting one, then run it: its
    /// configuration comes from the source (as with --restore, --serial may send the console
    /// elsewhere and --vsock of the same cid may move the vsock's host socket), its
    /// pages follow after it starts (post-copy). Peers that do not prove --secret-file's
    /// secret, and VMs whose disks this host cannot open, are refused and the wait goes on.
    #[arg(
        long,
        value_name = "tcp:HOST:PORT",
        requires = "secret_file",
        conflicts_with_all = ["restore", "kernel", "cmdline", "initrd", "config", "nodes"],
        value_parser = Own(|s: &str| s.parse::<MigrationUrl>().map_err(|e| format!("--receive-migration: {e}")))
    )]
    pub receive_migration: Option<MigrationUrl>,
    /// The migration's shared secret: a file of at least 16 bytes, mode 0600, the same on
    /// both ends. Needed by --receive-migration, --standby-for and --replicate-to; with --api-socket, a vm.send-migration
    /// whose body names no secret file (Cloud Hypervisor's clients cannot) uses this one.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// A storage file another partition owns, as PARTITION:PATH (repeatable): an arriving VM
    /// that uses one is refused. Set by a partition's supervisor for a VM that waits for a
    /// migration, whose disks are known only when it arrives.
    #[arg(
        long,
        value_name = "PARTITION:PATH",
        hide = true,
        requires = "receive_migration",
        value_parser = Own(|s: &str| Owned::parse("--foreign-storage", "PARTITION:PATH", s))
    )]
    pub foreign_storage: Vec<Owned>,
    /// A TAP another partition owns, as PARTITION:NAME (repeatable): an arriving VM whose
    /// `--net tap=` names one is refused. Set by a partition's supervisor, as
    /// `--foreign-storage` is.
    #[arg(
        long,
        value_name = "PARTITION:NAME",
        hide = true,
        requires = "receive_migration",
        value_parser = Own(|s: &str| Owned::parse("--foreign-tap", "PARTITION:NAME", s))
    )]
    pub foreign_tap: Vec<Owned>,
    /// Wait on tcp:HOST:PORT as the standby of a primary (`run --replicate-to`): build its
    /// VM from the configuration it sends (--serial may send the console elsewhere), store
    /// each whole epoch it sends, and run the VM from the last whole one once the primary
    /// is lost (the link closes, or it is silent longer than --heartbeat). Never while the
    /// primary is alive and connected. Peers that do not prove --secret-file's secret are
    /// refused and the wait goes on. A VM with disks needs --disk path=COPY here for each of
    /// its disks, in order: this standby's own copy, which must hold what the primary's
    /// does when replication starts (same size and CRC-32, else the primary is refused,
    /// naming the file), and is written with each epoch's disk writes. Likewise a VM with
    /// memory storage needs --pmem file=COPY here for each of its files, in order, written
    /// with the pages the guest stored in them during each epoch. If the primary's VM ends,
    /// this process ends with status 0.
    #[arg(
        long,
        value_name = "tcp:HOST:PORT",
        requires = "secret_file",
        conflicts_with_all = ["restore", "kernel", "cmdline", "initrd", "config", "nodes", "receive_migration"],
        value_parser = Own(|s: &str| s.parse::<MigrationUrl>().map_err(|e| format!("--standby-for: {e}")))
    )]
    pub standby_for: Option<MigrationUrl>,
    /// Longest silence of the primary, in milliseconds, before a standby takes over.
    #[arg(
        long,
        value_name = "MS",
        default_value = "100",
        requires = "standby_for",
        value_parser = Own(|s: &str| millis("--heartbeat", s))
    )]
    pub heartbeat: Duration,
    /// Keep this VM on the standby waiting at tcp:HOST:PORT (`run --standby-for`), which
    /// takes over if this process dies: first the whole RAM while the VM runs, then every
    /// --epoch the pages written and the vCPU and device state, copied in a short pause.
    /// Each epoch carries the disks' writes too. Network output is not held back yet
    /// (frames the guest sends during an epoch go out before the standby has that epoch).
    /// If the standby is lost the VM goes on alone and says so, or pauses
    /// (--replicate-policy stop). Needs --secret-file.
    #[arg(
        long,
        value_name = "tcp:HOST:PORT",
        requires = "secret_file",
        conflicts_with_all = ["nodes", "receive_migration", "restore", "standby_for"],
        value_parser = Own(|s: &str| s.parse::<MigrationUrl>().map_err(|e| format!("--replicate-to: {e}")))
    )]
    pub replicate_to: Option<MigrationUrl>,
    /// Time between two checkpoints of a replicated VM, in milliseconds (Remus: 25); a link
    /// that falls behind makes epochs longer.
    #[arg(
        long,
        value_name = "MS",
        default_value = "20",
        requires = "replicate_to",
        value_parser = Own(|s: &str| millis("--epoch", s))
    )]
    pub epoch: Duration,
    /// What the VM does if its standby is lost: go-on (alone, unprotected, said on stderr
    /// and in vm.info), or stop (paused until resumed through the API, said on stderr and
    /// in vm.info and the metrics).
    #[arg(
        long,
        value_name = "go-on|stop",
        default_value = "go-on",
        requires = "replicate_to",
        value_parser = Own(|s: &str| s.parse::<musubi_types::ReplicationPolicy>().map_err(|e| format!("--replicate-policy {e}")))
    )]
    pub replicate_policy: musubi_types::ReplicationPolicy,
}

/// `--heartbeat`, `--epoch`: a positive whole number of milliseconds.
fn millis(flag: &str, text: &str) -> Result<Duration, String> {
    match text.parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(format!(
            "{flag} {text}: expected a positive whole number of milliseconds"
        )),
    }
}

/// `--restore-memory`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RestoreMemory {
    #[default]
    Mapped,
    Prefault,
    Ondemand,
}

/// How a VM run is bounded and observed: shared by `run` and `node`.
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// Stop the VM after this many seconds (status 126).
    #[arg(long, value_name = "SECONDS", value_parser = Own(seconds), allow_negative_numbers = true)]
    pub timeout: Option<Duration>,
    /// Write a JSON report at exit: outcome, exits by reason with VMM time, interrupts,
    /// and the time to the first KVM_RUN.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Write the exit accounting (per vCPU, per port and device register, VMM time with a
    /// log2 histogram, doorbells and interrupts by path; with nodes, the coherence counters)
    /// as JSON at exit and on SIGUSR1.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// System-call filters per thread kind (vCPU, virtio I/O, control): `true` makes a call
    /// outside them fail and end the VM with a message naming the thread and the call
    /// (status 126), `log` only has the kernel log it, `false` installs none.
    #[arg(long, value_name = "true|false|log", default_value = "true")]
    pub seccomp: vmm::seccomp::SeccompMode,
    /// After each doorbell or TAP event, the kernel path's I/O thread polls up to this long
    /// for the next one before it sleeps (at most 10ms; 0: never), with the transmit queues'
    /// doorbells off meanwhile: it finds the guest's frames on their rings, without a VM
    /// exit. The window grows after short idle spells and closes over long ones, so a quiet
    /// VM is not polled for. A window also ends as soon as more tasks are runnable than the
    /// host has CPUs (one waits, perhaps for the CPU the poll holds), unless --io-poll-hold.
    /// Wake-ups and doorbells saved, windows given up and CPU spent are all in --metrics
    /// (`io_thread`).
    #[arg(long, value_name = "DURATION", default_value = "32us", value_parser = Own(io_poll))]
    pub io_poll: Duration,
    /// Poll each --io-poll window to its end even while other tasks wait for a CPU: for a
    /// host whose CPUs the VM has to itself, where a task that waits is one of its own.
    #[arg(long)]
    pub io_poll_hold: bool,
    /// I/O threads: `auto` or a number. A net device's queue pair k is served by thread k
    /// modulo the threads (its doorbells and its TAP queue), everything else by the first;
    /// each thread waits, wakes and polls on its own, and their passes over one device's
    /// rings take turns. `auto` gives one per queue pair as far as the host has CPUs
    /// this process may use beyond the VM's vCPUs, and at least one: a thread that polls
    /// needs a CPU of its own. Each thread's counters are in --metrics (`io_threads`).
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = Own(io_threads))]
    pub io_threads: vmm::IoThreadCount,
}

/// The longest `--io-poll`: polling covers the gaps between the packets of one exchange,
/// microseconds; beyond this it is a CPU spent for nothing.
const MAX_IO_POLL: Duration = Duration::from_millis(10);

/// `--io-poll`: 0, or a duration with its unit up to [`MAX_IO_POLL`].
fn io_poll(text: &str) -> Result<Duration, String> {
    let bad = || format!("--io-poll {text}: expected 0 or a duration up to 10ms, e.g. 50us");
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    match musubi_cluster::parse_duration(text) {
        Ok(d) if d <= MAX_IO_POLL => Ok(d),
        _ => Err(bad()),
    }
}

/// `--io-threads`: `auto` or a count from 1 to [`MAX_IO_THREADS`].
fn io_threads(text: &str) -> Result<vmm::IoThreadCount, String> {
    if text.trim() == "auto" {
        return Ok(vmm::IoThreadCount::Auto);
    }
    match text.trim().parse::<std::num::NonZeroUsize>() {
        Ok(n) if n.get() <= MAX_IO_THREADS => Ok(vmm::IoThreadCount::Fixed(n)),
        _ => Err(format!(
            "--io-threads {text}: expected auto or a number from 1 to {MAX_IO_THREADS}"
        )),
    }
}

/// The most `--io-threads`: one per queue pair a net device may have.
const MAX_IO_THREADS: usize = vmm::config::net::MAX_NUM_QUEUES as usize / 2;

/// `--timeout`: a positive, finite number of seconds.
fn seconds(text: &str) -> Result<Duration, String> {
    match text.parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 => {
            Duration::try_from_secs_f64(t).map_err(|e| format!("--timeout {text}: {e}"))
        }
        _ => Err(format!(
            "--timeout {text}: expected a positive number of seconds"
        )),
    }
}

/// `--memory`: a size, refused naming the flag (the bounds are checked with the JSON file's
/// size, once the two are merged).
fn memory_size(text: &str) -> Result<Size, config::ConfigError> {
    config::parse_size("--memory", text).map(Size)
}

impl RunFlags {
    /// What the VMM is asked besides the VM: `--timeout` and `--seccomp`, with the serial
    /// console left on the terminal rather than captured.
    pub fn run_options(&self) -> vmm::RunOptions {
        vmm::RunOptions {
            capture_serial: false,
            timeout: self.timeout,
            seccomp: self.seccomp,
            io_poll: self.io_poll,
            io_poll_hold: self.io_poll_hold,
            io_threads: self.io_threads,
        }
    }
}

/// The JSON form of a VM. Sizes may be numbers (bytes) or strings such as "256M".
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    kernel: Option<Kernel>,
    cmdline: Option<String>,
    initrd: Option<PathBuf>,
    cpus: Option<u64>,
    memory: Option<Size>,
    #[serde(default)]
    disks: Vec<DiskConfig>,
    #[serde(default)]
    pmem: Vec<PmemConfig>,
    #[serde(default)]
    net: Vec<NetConfig>,
    rng: Option<RngConfig>,
    #[serde(default, deserialize_with = "config::vsock::from_flag_or_object")]
    vsock: Option<VsockConfig>,
    serial: Option<SerialMode>,
    exits: Option<ExitsMode>,
}

pub const DEFAULT_MEMORY: Size = Size(256 << 20);
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
pub const DEFAULT_PROBE_CMDLINE: &str = "probe.tasks=hello";

impl VmArgs {
    pub fn to_config(&self) -> Result<VmConfig, String> {
        self.to_config_over(FileConfig::default())
    }

    /// The VM from these flags over `base` (a cluster file's `vm` section), with a
    /// `--config` file, if given, in between.
    pub fn to_config_over(&self, base: FileConfig) -> Result<VmConfig, String> {
        self.to_config_for(base, true)
    }

    /// As [`VmArgs::to_config_over`], for a process that `holds_devices` or not: one that
    /// does not (a node of a VM over several hosts other than the I/O node) creates no
    /// vsock listener, so it does not ask whether the path is free: the I/O node on the
    /// same host may have taken it already.
    pub fn to_config_for(&self, base: FileConfig, holds_devices: bool) -> Result<VmConfig, String> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("--config {}: {e}", p.display()))?;
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) {
                    if crate::ch_config::is_ch_config(&value) {
                        return self.over_ch_config(p, &value, holds_devices);
                    }
                }
                // The error names the field (`pmem[0].size`) as well as the line and column.
                let json = &mut serde_json::Deserializer::from_str(&text);
                serde_path_to_error::deserialize::<_, FileConfig>(json).map_err(|e| {
                    let at = match e.path().to_string() {
                        root if root == "." => String::new(),
                        field => format!("{field}: "),
                    };
                    format!(
                        "--config {}: invalid JSON config: {at}{}",
                        p.display(),
                        e.inner()
                    )
                })?
            }
            None => base,
        };
        let kernel_arg = self.kernel.clone().or(file.kernel).ok_or(
            "--kernel is required (a vmlinux, a bzImage, or `probe` for the bundled guest)",
        )?;
        let kernel = match &kernel_arg {
            Kernel::Probe => probe::image(),
            Kernel::File(p) => match std::fs::metadata(p) {
                Ok(m) if m.is_file() => KernelImage::File(p.clone()),
                Ok(_) => return Err(format!("--kernel {kernel_arg}: not a regular file")),
                Err(e) => return Err(format!("--kernel {kernel_arg}: {e}")),
            },
        };
        let is_probe = kernel_arg == Kernel::Probe;
        let cmdline = self.cmdline.clone().or(file.cmdline).unwrap_or_else(|| {
            if is_probe {
                DEFAULT_PROBE_CMDLINE
            } else {
                DEFAULT_LINUX_CMDLINE
            }
            .to_string()
        });
        let cpus =
            config::check_cpus(self.cpus.or(file.cpus).unwrap_or(1)).map_err(|e| e.to_string())?;
        let (mem_flag, memory) = match (self.memory, file.memory) {
            (Some(m), _) => ("--memory", m),
            (None, Some(m)) => ("memory (config)", m),
            (None, None) => ("--memory", DEFAULT_MEMORY),
        };
        config::check_memory(mem_flag, &memory.to_string(), memory.bytes())
            .map_err(|e| e.to_string())?;
        let disks = flags_or_file(&self.disk, file.disks);
        for d in &disks {
            config::check_storage_file("--disk path=", &d.path).map_err(|e| e.to_string())?;
        }
        let pmem = flags_or_file(&self.pmem, file.pmem);
        let net = flags_or_file(&self.net, file.net);
        for (i, n) in net.iter().enumerate() {
            n.check()
                .map_err(|why| format!("net[{i}] ({}): {why}", n.name()))?;
        }
        config::net::check_distinct(&net).map_err(|e| e.to_string())?;
        let rng = self.rng.or(file.rng);
        if rng.is_some_and(|r| r.bytes_per_sec == Some(0)) {
            return Err("rng (config): bytes_per_sec=0 would never serve a byte".into());
        }
        let vsock = self.vsock.clone().or(file.vsock);
        if let Some(v) = vsock.as_ref().filter(|_| holds_devices) {
            v.check_free().map_err(|e| format!("--vsock {v}: {e}"))?;
        }
        let exits = self.exits.or(file.exits).unwrap_or_default();
        let serial = self.serial.clone().or(file.serial).unwrap_or_default();
        if let Some(p) = self.initrd.as_ref().or(file.initrd.as_ref()) {
            std::fs::metadata(p).map_err(|e| format!("--initrd {}: {e}", p.display()))?;
        }
        Ok(VmConfig {
            kernel,
            cmdline,
            initrd: self.initrd.clone().or(file.initrd),
            cpus,
            memory: memory.bytes(),
            disks,
            pmem,
            serial,
            exits,
            net,
            rng,
            vsock,
        })
    }
}

impl VmArgs {
    /// The VM of a Cloud Hypervisor VmConfig file (`path`, read as `value`), with the flags
    /// given on the command line over it.
    fn over_ch_config(
        &self,
        path: &std::path::Path,
        value: &serde_json::Value,
        holds_devices: bool,
    ) -> Result<VmConfig, String> {
        let mut c = crate::ch_config::from_value(value)
            .map_err(|e| {
                format!(
                    "--config {}: Cloud Hypervisor VmConfig: {e}",
                    path.display()
                )
            })?
            .config;
        if self.kernel.is_some() || self.initrd.is_some() {
            return Err(format!(
                "--config {}: the kernel and initramfs of a Cloud Hypervisor VmConfig come \
                 from its payload; leave out --kernel and --initrd",
                path.display()
            ));
        }
        if let Some(cmdline) = &self.cmdline {
            c.cmdline = cmdline.clone();
        }
        if let Some(n) = self.cpus {
            c.cpus = config::check_cpus(n).map_err(|e| e.to_string())?;
        }
        if let Some(m) = self.memory {
            config::check_memory("--memory", &m.to_string(), m.bytes())
                .map_err(|e| e.to_string())?;
            c.memory = m.bytes();
        }
        c.disks = flags_or_file(&self.disk, c.disks);
        // The file's disks were checked as it was read; the flags' are checked here, as
        // without a file.
        for d in &self.disk {
            config::check_storage_file("--disk path=", &d.path).map_err(|e| e.to_string())?;
        }
        c.pmem = flags_or_file(&self.pmem, c.pmem);
        c.net = flags_or_file(&self.net, c.net);
        config::net::check_distinct(&c.net).map_err(|e| e.to_string())?;
        if let Some(r) = self.rng {
            c.rng = Some(r);
        }
        if let Some(v) = &self.vsock {
            if holds_devices {
                v.check_free().map_err(|e| format!("--vsock {v}: {e}"))?;
            }
            c.vsock = Some(v.clone());
        }
        if let Some(s) = &self.serial {
            c.serial = s.clone();
        }
        if let Some(e) = self.exits {
            c.exits = e;
        }
        Ok(c)
    }
}

pub use vmm::snapshot::GivenDevices;

impl VmArgs {
    /// What of the VM the command line itself asks for (no file, no defaults).
    pub fn given_devices(&self) -> Result<GivenDevices, String> {
        let cpus = match self.cpus {
            Some(n) => Some(config::check_cpus(n).map_err(|e| e.to_string())?),
            None => None,
        };
        Ok(GivenDevices {
            cpus,
            memory: self.memory.map(Size::bytes),
            disks: given(&self.disk),
            pmem: given(&self.pmem),
            serial: self.serial.clone(),
            exits: self.exits,
            net: given(&self.net),
            rng: self.rng,
            vsock: self.vsock.clone(),
        })
    }

    /// The flags again, as a command line: how `run --nodes` hands the same VM to each node.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut put = |flag: &str, v: Option<String>| {
            if let Some(v) = v {
                a.push(flag.to_string());
                a.push(v);
            }
        };
        put("--kernel", self.kernel.as_ref().map(|k| k.to_string()));
        put("--cmdline", self.cmdline.clone());
        put(
            "--initrd",
            self.initrd.as_ref().map(|p| p.display().to_string()),
        );
        put("--cpus", self.cpus.map(|c| c.to_string()));
        put("--memory", self.memory.map(|m| m.to_string()));
        for d in &self.disk {
            put("--disk", Some(d.to_string()));
        }
        for p in &self.pmem {
            put("--pmem", Some(p.to_string()));
        }
        for n in &self.net {
            put("--net", Some(n.to_string()));
        }
        put("--rng", self.rng.map(|r| r.to_string()));
        put("--vsock", self.vsock.as_ref().map(|v| v.to_string()));
        put("--serial", self.serial.as_ref().map(|s| s.to_string()));
        put("--exits", self.exits.map(|e| e.to_string()));
        put(
            "--config",
            self.config.as_ref().map(|p| p.display().to_string()),
        );
        a
    }
}

/// A repeatable flag's entries, if it is given at all.
fn given<T: Clone>(flags: &[T]) -> Option<Vec<T>> {
    (!flags.is_empty()).then(|| flags.to_vec())
}

/// The entries of a repeatable spec flag (`--disk`, `--pmem`, `--net`), or, when the flag is
/// not given, those of the JSON file: flags replace the file's list rather than add to it.
fn flags_or_file<T: Clone>(flags: &[T], file: Vec<T>) -> Vec<T> {
    if flags.is_empty() {
        file
    } else {
        flags.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The `run` command of `line` (after `musubi run`), or clap's refusal.
    fn run(line: &[&str]) -> Result<crate::RunCmd, clap::Error> {
        let argv = ["musubi", "run"].iter().chain(line);
        match crate::Cli::try_parse_from(argv)?.command {
            Some(crate::Command::Run(r)) => Ok(r),
            _ => unreachable!("not a run"),
        }
    }

    fn refusal(line: &[&str]) -> String {
        run(line).map(drop).unwrap_err().to_string()
    }

    #[test]
    fn io_threads_are_auto_unless_given_and_bad_counts_are_refused() {
        assert_eq!(run(&[]).unwrap().run.io_threads, vmm::IoThreadCount::Auto);
        let two = std::num::NonZeroUsize::new(2).unwrap();
        assert_eq!(
            run(&["--io-threads", "2"]).unwrap().run.io_threads,
            vmm::IoThreadCount::Fixed(two)
        );
        for bad in ["0", "17", "many", "-1"] {
            let e = run(&[&format!("--io-threads={bad}")])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("--io-threads {bad}")), "{e}");
        }
    }

    #[test]
    fn io_poll_is_the_vmms_default_unless_given() {
        assert_eq!(run(&[]).unwrap().run.io_poll, vmm::DEFAULT_IO_POLL);
        let us = std::time::Duration::from_micros;
        assert_eq!(run(&["--io-poll=0"]).unwrap().run.io_poll, us(0));
        assert_eq!(run(&["--io-poll=1.5ms"]).unwrap().run.io_poll, us(1500));
        assert!(!run(&[]).unwrap().run.io_poll_hold);
        assert!(run(&["--io-poll-hold"]).unwrap().run.io_poll_hold);
    }

    #[test]
    fn flags_are_typed_as_they_are_read() {
        let r = run(&[
            "--memory=1.5G",
            "--disk=path=a.img,cache=none",
            "--pmem=file=p.img,size=2M",
            "--net=tap=t0,mac=52:54:00:00:00:01",
            "--serial=file=out.txt",
            "--exits=user",
            "--timeout=2.5",
        ])
        .unwrap();
        assert_eq!(r.vm.memory, Some(Size(3 << 29)));
        assert_eq!(r.vm.disk[0].cache, config::CacheMode::None);
        assert_eq!(r.vm.pmem[0].size, Some(2 << 20));
        assert_eq!(r.vm.net[0].tap.as_deref(), Some("t0"));
        assert_eq!(r.vm.serial, Some(SerialMode::File("out.txt".into())));
        assert_eq!(r.vm.exits, Some(ExitsMode::User));
        assert_eq!(r.run.timeout, Some(Duration::from_millis(2500)));
        let given = r.vm.given_devices().unwrap();
        assert_eq!(given.memory, Some(3 << 29));
        assert_eq!(given.disks.unwrap().len(), 1);
        assert_eq!(given.exits, Some(ExitsMode::User));
    }

    #[test]
    fn rng_and_vsock_flags_are_given_devices_and_only_a_device_holder_checks_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let taken = dir.path().join("v.sock");
        std::fs::write(&taken, b"").unwrap();
        let vsock = format!("cid=5,socket={}", taken.display());
        let line = [
            "--kernel",
            "probe",
            "--rng",
            "bytes_per_sec=100",
            "--vsock",
            vsock.as_str(),
        ];
        let r = run(&line).unwrap();
        let given = r.vm.given_devices().unwrap();
        assert_eq!(given.rng.unwrap().bytes_per_sec, Some(100));
        assert_eq!(given.vsock.as_ref().unwrap().cid, 5);
        assert_eq!(given.vsock.unwrap().socket, taken);
        // The process that makes the listener refuses a taken path; a node that makes no
        // devices takes the same VM as it is, its layout counting the vsock all the same.
        let e = r.vm.to_config_for(FileConfig::default(), true).unwrap_err();
        assert!(e.contains("--vsock") && e.contains("already exists"), "{e}");
        let c = r.vm.to_config_for(FileConfig::default(), false).unwrap();
        assert_eq!(c.vsock.unwrap().cid, 5);
        assert_eq!(c.rng.unwrap().bytes_per_sec, Some(100));
    }

    #[test]
    fn a_disk_flag_over_a_cloud_hypervisor_file_is_checked_as_without_one() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"k").unwrap();
        let file = dir.path().join("vm.json");
        let vm = serde_json::json!({"payload": {"kernel": kernel}});
        std::fs::write(&file, vm.to_string()).unwrap();
        let missing = dir.path().join("missing.img");
        let r = run(&[
            "--config",
            file.to_str().unwrap(),
            "--disk",
            &format!("path={}", missing.display()),
        ])
        .unwrap();
        let e = r.vm.to_config().unwrap_err();
        assert!(
            e.contains("--disk path=") && e.contains("missing.img"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_are_refused_by_the_parser_naming_flag_and_value() {
        for (line, wants) in [
            (
                vec!["--memory", "lots"],
                "--memory \"lots\": invalid size: ",
            ),
            (
                vec!["--exits", "fast"],
                "--exits \"fast\": expected kernel or user",
            ),
            (
                vec!["--serial", "tty"],
                "--serial \"tty\": expected stdio, off or file=PATH",
            ),
            (
                vec!["--disk", "cache=none"],
                "--disk \"cache=none\": path= is missing",
            ),
            (
                vec!["--pmem", "file=a,size=x"],
                "--pmem \"file=a,size=x\": size=\"x\"",
            ),
            (
                vec!["--net", "tap=t,fd=4"],
                "--net \"tap=t,fd=4\": tap= and fd=",
            ),
            (
                vec!["--rng", "bytes_per_sec=lots"],
                "--rng \"bytes_per_sec=lots\": bytes_per_sec=\"lots\" is not a positive whole number",
            ),
            (
                vec!["--rng=bytes_per_sec=0"],
                "--rng \"bytes_per_sec=0\": bytes_per_sec=0 would never serve a byte",
            ),
            (
                vec!["--timeout", "0"],
                "--timeout 0: expected a positive number of seconds",
            ),
            (
                vec!["--timeout", "soon"],
                "--timeout soon: expected a positive number",
            ),
            (
                vec!["--timeout", "inf"],
                "--timeout inf: expected a positive number",
            ),
            (
                vec!["--io-poll", "20ms"],
                "--io-poll 20ms: expected 0 or a duration up to 10ms",
            ),
            (
                vec!["--io-poll", "50"],
                "--io-poll 50: expected 0 or a duration up to 10ms",
            ),
            (
                vec!["--receive-migration", "udp:h:1", "--secret-file", "s"],
                "--receive-migration: migration URL \"udp:h:1\": expected tcp:HOST:PORT",
            ),
            (
                vec![
                    "--receive-migration=tcp:h:1",
                    "--secret-file=s",
                    "--foreign-storage=a.img",
                ],
                "--foreign-storage \"a.img\": expected PARTITION:PATH",
            ),
            (
                vec![
                    "--receive-migration=tcp:h:1",
                    "--secret-file=s",
                    "--foreign-tap=tap0",
                ],
                "--foreign-tap \"tap0\": expected PARTITION:NAME",
            ),
            (
                vec!["--standby-for", "udp:h:1", "--secret-file", "s"],
                "--standby-for: migration URL \"udp:h:1\": expected tcp:HOST:PORT",
            ),
            (
                vec!["--replicate-to=tcp:h:1", "--secret-file=s", "--epoch=0"],
                "--epoch 0: expected a positive whole number of milliseconds",
            ),
            (
                vec!["--standby-for=tcp:h:1", "--secret-file=s", "--heartbeat=soon"],
                "--heartbeat soon: expected a positive whole number of milliseconds",
            ),
            (
                vec![
                    "--replicate-to=tcp:h:1",
                    "--secret-file=s",
                    "--replicate-policy=pause",
                ],
                "--replicate-policy pause: expected go-on or stop",
            ),
        ] {
            let e = refusal(&line);
            assert!(e.starts_with(&format!("error: {wants}")), "{line:?}: {e}");
        }
    }

    #[test]
    fn replication_flags_need_their_side_and_a_secret() {
        let r = run(&["--replicate-to=tcp:h:1", "--secret-file=s"]).unwrap();
        assert_eq!(r.control.epoch, Duration::from_millis(20));
        assert_eq!(
            r.control.replicate_policy,
            musubi_types::ReplicationPolicy::GoOn
        );
        let r = run(&[
            "--replicate-to=tcp:h:1",
            "--secret-file=s",
            "--replicate-policy=stop",
        ])
        .unwrap();
        assert_eq!(
            r.control.replicate_policy,
            musubi_types::ReplicationPolicy::Stop
        );
        let r = run(&[
            "--standby-for=tcp:h:1",
            "--secret-file=s",
            "--heartbeat=250",
        ])
        .unwrap();
        assert_eq!(r.control.heartbeat, Duration::from_millis(250));
        for line in [
            vec!["--replicate-to=tcp:h:1"],
            vec!["--standby-for=tcp:h:1"],
            vec!["--epoch=5"],
            vec!["--heartbeat=5"],
            vec!["--replicate-policy=stop"],
            vec!["--standby-for=tcp:h:1", "--secret-file=s", "--kernel=probe"],
            vec![
                "--standby-for=tcp:h:1",
                "--replicate-to=tcp:h:2",
                "--secret-file=s",
            ],
        ] {
            let e = refusal(&line);
            assert!(e.starts_with("error: "), "{line:?}: {e}");
        }
    }

    #[test]
    fn rng_takes_an_optional_limit() {
        assert_eq!(run(&[]).unwrap().vm.rng, None);
        assert_eq!(run(&["--rng"]).unwrap().vm.rng, Some(RngConfig::default()));
        let r = run(&["--rng", "--exits", "user"]).unwrap().vm;
        assert_eq!(r.rng, Some(RngConfig::default()));
        assert_eq!(r.exits, Some(ExitsMode::User));
        let r = run(&["--rng=bytes_per_sec=512"]).unwrap().vm.rng.unwrap();
        assert_eq!(r.bytes_per_sec, Some(512));
        let args = run(&["--rng"]).unwrap().vm.to_args();
        assert_eq!(args, ["--rng", ""]);
        let back = run(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.vm.rng, Some(RngConfig::default()));
        let c = run(&["--kernel", "probe", "--rng"])
            .unwrap()
            .vm
            .to_config()
            .unwrap();
        assert_eq!(c.rng, Some(RngConfig::default()));
    }

    #[test]
    fn to_args_gives_a_command_line_that_reads_back_the_same() {
        let line = [
            "--kernel",
            "probe",
            "--cmdline",
            "probe.tasks=hello",
            "--cpus",
            "2",
            "--memory",
            "64.5M",
            "--disk",
            "path=a.img,readonly=on",
            "--disk",
            "path=b.img,cache=none",
            "--pmem",
            "file=p.img,size=4M,advertise=virtio",
            "--net",
            "tap=t0,ip=10.0.0.1,mask=255.255.255.0,rate=1048576/100",
            "--rng",
            "bytes_per_sec=4096",
            "--serial",
            "off",
            "--exits",
            "user",
        ];
        let vm = run(&line).unwrap().vm;
        let args = vm.to_args();
        assert_eq!(args, line, "the canonical forms are the ones given");
        let again = run(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(format!("{:?}", again.vm), format!("{vm:?}"));
        // Other spellings of the same values come back in their canonical form.
        let vm = run(&["--memory", "67108864", "--disk", "cache=writeback,path=a"])
            .unwrap()
            .vm;
        assert_eq!(vm.to_args(), ["--memory", "64M", "--disk", "path=a"]);
    }

    #[test]
    fn flags_override_the_json_file_and_replace_its_lists() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vm.json");
        let disk = dir.path().join("d.img");
        std::fs::write(&disk, [0u8; 4096]).unwrap();
        let json = serde_json::json!({
            "kernel": "probe",
            "memory": "32M",
            "disks": [{"path": disk}],
            "serial": "off",
            "exits": "user",
        });
        std::fs::write(&file, json.to_string()).unwrap();
        let path = file.to_str().unwrap();
        let c = run(&["--config", path]).unwrap().vm.to_config().unwrap();
        assert_eq!(
            (c.memory, c.disks.len(), c.serial, c.exits),
            (32 << 20, 1, SerialMode::Off, ExitsMode::User)
        );
        let c = run(&["--config", path, "--memory", "64M", "--exits", "kernel"])
            .unwrap()
            .vm
            .to_config()
            .unwrap();
        assert_eq!((c.memory, c.exits), (64 << 20, ExitsMode::Kernel));
        assert_eq!(c.disks.len(), 1);
        let other = dir.path().join("e.img");
        std::fs::write(&other, [0u8; 4096]).unwrap();
        let spec = format!("path={}", other.display());
        let c = run(&["--config", path, "--disk", &spec])
            .unwrap()
            .vm
            .to_config()
            .unwrap();
        assert_eq!(c.disks.len(), 1);
        assert_eq!(c.disks[0].path, other);
        // A size too small for a VM is refused after the merge, naming where it came from.
        let e = run(&["--memory", "4M", "--kernel", "probe"])
            .unwrap()
            .vm
            .to_config()
            .unwrap_err();
        assert!(e.starts_with("--memory: 4M is too small"), "{e}");
    }
}
