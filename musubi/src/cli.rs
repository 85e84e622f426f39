//! Command-line and JSON-file description of a VM, merged into a `VmConfig`.

use crate::probe;
use clap::Args;
use serde::Deserialize;
use std::path::PathBuf;
use vmm::config::{self, DiskConfig, KernelImage, SerialMode, Size, VmConfig};

/// Flags of `musubi run` (and of every command that boots a VM).
#[derive(Args, Debug, Clone, Default)]
pub struct VmArgs {
    /// Kernel to boot: an ELF vmlinux with a PVH note, a bzImage, or `probe` for the
    /// bundled probe guest.
    #[arg(long, value_name = "PATH|probe")]
    pub kernel: Option<String>,
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
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// A virtio-blk disk; repeat for more. cache=none opens the file with O_DIRECT.
    #[arg(long, value_name = "path=FILE[,readonly=on][,cache=writeback|none]")]
    pub disk: Vec<String>,
    /// Storage as memory: a file mapped into guest-physical memory above RAM; repeat for
    /// more. Advertised as E820 persistent memory (type 12) or as a virtio-pmem device.
    #[arg(long, value_name = vmm::pmem::PMEM_SYNTAX)]
    pub pmem: Vec<String>,
    /// A virtio-net device over a TAP interface; repeat for more. tap=NAME opens the TAP,
    /// creating it when missing (with ip= and mask= given to its host end); fd=N takes one
    /// already opened with IFF_VNET_HDR. rate= limits each direction (token buckets a
    /// second deep). The MAC is made up (locally administered) when not given.
    #[arg(long, value_name = config::net::NET_SYNTAX)]
    pub net: Vec<String>,
    /// Where the guest's COM1 goes. Default stdio.
    #[arg(long, value_name = "stdio|off|file=PATH")]
    pub serial: Option<String>,
    /// Where hot traps are handled: `kernel` (ioeventfd doorbells served by an I/O
    /// thread, irqfd interrupts) or `user` (every doorbell an MMIO exit on the vCPU
    /// thread, every interrupt injected from user space). Default kernel.
    #[arg(long, value_name = "kernel|user")]
    pub exits: Option<String>,
    /// JSON file with the same fields (kernel, cmdline, initrd, cpus, memory, disks,
    /// pmem, net, serial, exits); flags given on the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// How a VM of `musubi run` is controlled while it runs, and where it comes from.
#[derive(Args, Debug, Clone, Default)]
pub struct ControlFlags {
    /// Serve the control API (HTTP/1.1 and JSON, Cloud Hypervisor's paths) on this UNIX
    /// socket, created mode 0600: ping, info, counters, pause, resume, snapshot, shutdown.
    /// `musubi remote --api-socket PATH` is its client.
    #[arg(long, value_name = "PATH", conflicts_with = "nodes")]
    pub api_socket: Option<PathBuf>,
    /// Restore the VM saved in this snapshot directory instead of booting one. Its
    /// configuration comes from the snapshot; --cpus, --memory, --disk, --pmem and --exits, when
    /// given, must match it; --serial may send the console elsewhere. Guest RAM is mapped
    /// copy-on-write from the snapshot's memory file, so the snapshot is never changed and
    /// can be restored again.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kernel", "cmdline", "initrd", "config", "nodes"])]
    pub restore: Option<PathBuf>,
    /// How a restored VM's RAM is filled: `mapped` maps the snapshot's memory file
    /// copy-on-write (the kernel reads a page when the guest first touches it); `ondemand`
    /// gives the guest empty memory and a thread of the VMM reads each page from the file
    /// at its first touch, through userfaultfd (needs root or vm.unprivileged_userfaultfd=1),
    /// so the file is only read, never mapped, and the pages read are counted.
    #[arg(
        long,
        value_name = "mapped|ondemand",
        default_value = "mapped",
        requires = "restore"
    )]
    pub restore_memory: RestoreMemory,
    /// Wait on tcp:HOST:PORT for one VM sent by another musubi (`musubi remote
    /// send-migration`, or PUT vm.send-migration) instead of booting one, then run it: its
    /// configuration comes from the source (--serial may send the console elsewhere), its
    /// pages follow after it starts (post-copy). Peers that do not prove --secret-file's
    /// secret, and VMs whose disks this host cannot open, are refused and the wait goes on.
    #[arg(
        long,
        value_name = "tcp:HOST:PORT",
        requires = "secret_file",
        conflicts_with_all = ["restore", "kernel", "cmdline", "initrd", "config", "nodes"]
    )]
    pub receive_migration: Option<String>,
    /// The migration's shared secret: a file of at least 16 bytes, mode 0600, the same on
    /// both ends.
    #[arg(long, value_name = "FILE", requires = "receive_migration")]
    pub secret_file: Option<PathBuf>,
    /// A storage file another partition owns, as PARTITION:PATH (repeatable): an arriving VM
    /// that uses one is refused. Set by a partition's supervisor for a VM that waits for a
    /// migration, whose disks are known only when it arrives.
    #[arg(
        long,
        value_name = "PARTITION:PATH",
        hide = true,
        requires = "receive_migration"
    )]
    pub foreign_storage: Vec<String>,
    /// A TAP another partition owns, as PARTITION:NAME (repeatable): an arriving VM whose
    /// `--net tap=` names one is refused. Set by a partition's supervisor, as
    /// `--foreign-storage` is.
    #[arg(
        long,
        value_name = "PARTITION:NAME",
        hide = true,
        requires = "receive_migration"
    )]
    pub foreign_tap: Vec<String>,
}

/// `--restore-memory`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RestoreMemory {
    #[default]
    Mapped,
    Ondemand,
}

/// How a VM run is bounded and observed: shared by `run` and `node`.
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// Stop the VM after this many seconds (status 126).
    #[arg(long, value_name = "SECONDS")]
    pub timeout: Option<f64>,
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
}

impl RunFlags {
    /// `--timeout` as a duration; anything but a positive finite number of seconds is refused
    /// by name.
    pub fn timeout(&self) -> Result<Option<std::time::Duration>, String> {
        match self.timeout {
            Some(t) if t.is_finite() && t > 0.0 => Ok(Some(std::time::Duration::from_secs_f64(t))),
            Some(t) => Err(format!(
                "--timeout {t}: expected a positive number of seconds"
            )),
            None => Ok(None),
        }
    }

    /// What the VMM is asked besides the VM: `--timeout` and `--seccomp`, with the serial
    /// console left on the terminal rather than captured.
    pub fn run_options(&self) -> Result<vmm::RunOptions, String> {
        Ok(vmm::RunOptions {
            capture_serial: false,
            timeout: self.timeout()?,
            seccomp: self.seccomp,
        })
    }
}

/// The JSON form of a VM. Sizes may be numbers (bytes) or strings such as "256M".
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    kernel: Option<String>,
    cmdline: Option<String>,
    initrd: Option<PathBuf>,
    cpus: Option<u64>,
    memory: Option<Size>,
    #[serde(default)]
    disks: Vec<DiskConfig>,
    #[serde(default)]
    pmem: Vec<vmm::pmem::PmemConfig>,
    #[serde(default)]
    net: Vec<config::net::NetConfig>,
    serial: Option<SerialMode>,
    exits: Option<config::ExitsMode>,
}

pub const DEFAULT_MEMORY: &str = "256M";
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
pub const DEFAULT_PROBE_CMDLINE: &str = "probe.tasks=hello";

impl VmArgs {
    pub fn to_config(&self) -> Result<VmConfig, String> {
        self.to_config_over(FileConfig::default())
    }

    /// The VM from these flags over `base` (a cluster file's `vm` section), with a
    /// `--config` file, if given, in between.
    pub fn to_config_over(&self, base: FileConfig) -> Result<VmConfig, String> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("--config {}: {e}", p.display()))?;
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
        let kernel = if kernel_arg == probe::PROBE_NAME {
            probe::image()
        } else {
            let p = PathBuf::from(&kernel_arg);
            match std::fs::metadata(&p) {
                Ok(m) if m.is_file() => KernelImage::File(p),
                Ok(_) => return Err(format!("--kernel {kernel_arg}: not a regular file")),
                Err(e) => return Err(format!("--kernel {kernel_arg}: {e}")),
            }
        };
        let is_probe = kernel_arg == probe::PROBE_NAME;
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
        let (mem_flag, mem_text, memory) = match (&self.memory, file.memory) {
            (Some(m), _) => ("--memory", m.clone(), config::parse_size("--memory", m)),
            (None, Some(m)) => ("memory (config)", m.to_string(), Ok(m.bytes())),
            (None, None) => (
                "--memory",
                DEFAULT_MEMORY.into(),
                config::parse_size("--memory", DEFAULT_MEMORY),
            ),
        };
        let memory = memory.map_err(|e| e.to_string())?;
        config::check_memory(mem_flag, &mem_text, memory).map_err(|e| e.to_string())?;
        let disks: Vec<DiskConfig> = flags_or_file(&self.disk, file.disks)?;
        for d in &disks {
            config::check_storage_file("--disk path=", &d.path).map_err(|e| e.to_string())?;
        }
        let pmem = flags_or_file(&self.pmem, file.pmem)?;
        let net: Vec<config::net::NetConfig> = flags_or_file(&self.net, file.net)?;
        for (i, n) in net.iter().enumerate() {
            n.check()
                .map_err(|why| format!("net[{i}] ({}): {why}", n.name()))?;
        }
        config::net::check_distinct(&net).map_err(|e| e.to_string())?;
        let exits = match &self.exits {
            Some(e) => e
                .parse()
                .map_err(|e: config::spec::BadWord| e.to_string())?,
            None => file.exits.unwrap_or_default(),
        };
        let serial = match &self.serial {
            Some(s) => s.parse().map_err(|e: config::ConfigError| e.to_string())?,
            None => file.serial.unwrap_or_default(),
        };
        if let Some(p) = self.initrd.as_ref().or(file.initrd.as_ref()) {
            std::fs::metadata(p).map_err(|e| format!("--initrd {}: {e}", p.display()))?;
        }
        Ok(VmConfig {
            kernel,
            cmdline,
            initrd: self.initrd.clone().or(file.initrd),
            cpus,
            memory,
            disks,
            pmem,
            serial,
            exits,
            net,
        })
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
        let memory = match &self.memory {
            Some(m) => Some(config::parse_size("--memory", m).map_err(|e| e.to_string())?),
            None => None,
        };
        let list = |flags: &[String]| (!flags.is_empty()).then(|| flags.to_vec());
        Ok(GivenDevices {
            cpus,
            memory,
            disks: list(&self.disk)
                .map(|f| flags_or_file(&f, Vec::new()))
                .transpose()?,
            pmem: list(&self.pmem)
                .map(|f| flags_or_file(&f, Vec::new()))
                .transpose()?,
            serial: match &self.serial {
                Some(s) => Some(s.parse().map_err(|e: config::ConfigError| e.to_string())?),
                None => None,
            },
            exits: match &self.exits {
                Some(e) => Some(
                    e.parse()
                        .map_err(|e: config::spec::BadWord| e.to_string())?,
                ),
                None => None,
            },
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
        put("--kernel", self.kernel.clone());
        put("--cmdline", self.cmdline.clone());
        put(
            "--initrd",
            self.initrd.as_ref().map(|p| p.display().to_string()),
        );
        put("--cpus", self.cpus.map(|c| c.to_string()));
        put("--memory", self.memory.clone());
        for d in &self.disk {
            put("--disk", Some(d.clone()));
        }
        for p in &self.pmem {
            put("--pmem", Some(p.clone()));
        }
        for n in &self.net {
            put("--net", Some(n.clone()));
        }
        put("--serial", self.serial.clone());
        put("--exits", self.exits.clone());
        put(
            "--config",
            self.config.as_ref().map(|p| p.display().to_string()),
        );
        a
    }
}

/// The entries of a repeatable spec flag (`--disk`, `--pmem`), or, when the flag is not
/// given, those of the JSON file: flags replace the file's list rather than add to it.
fn flags_or_file<T>(flags: &[String], file: Vec<T>) -> Result<Vec<T>, String>
where
    T: std::str::FromStr<Err = config::ConfigError>,
{
    if flags.is_empty() {
        return Ok(file);
    }
    flags
        .iter()
        .map(|f| f.parse().map_err(|e: config::ConfigError| e.to_string()))
        .collect()
}
