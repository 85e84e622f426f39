//! Command-line and JSON-file description of a VM, merged into a `VmConfig`.

use crate::probe;
use clap::Args;
use serde::Deserialize;
use std::path::PathBuf;
use vmm::config::{self, DiskConfig, KernelImage, SerialMode, VmConfig};

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
    /// Guest RAM, e.g. 256M or 2G. Default 256M.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// A virtio-blk disk; repeat for more. cache=none opens the file with O_DIRECT.
    #[arg(long, value_name = "path=FILE[,readonly=on][,cache=writeback|none]")]
    pub disk: Vec<String>,
    /// Storage as memory: a file mapped into guest-physical memory above RAM; repeat for
    /// more. Advertised as E820 persistent memory (type 12) or as a virtio-pmem device.
    #[arg(long, value_name = vmm::pmem::PMEM_SYNTAX)]
    pub pmem: Vec<String>,
    /// Where the guest's COM1 goes. Default stdio.
    #[arg(long, value_name = "stdio|off|file=PATH")]
    pub serial: Option<String>,
    /// Where hot traps are handled: `kernel` (ioeventfd doorbells served by an I/O
    /// thread, irqfd interrupts) or `user` (every doorbell an MMIO exit on the vCPU
    /// thread, every interrupt injected from user space). Default kernel.
    #[arg(long, value_name = "kernel|user")]
    pub exits: Option<String>,
    /// JSON file with the same fields (kernel, cmdline, initrd, cpus, memory, disks,
    /// pmem, serial, exits); flags given on the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// The JSON form of a VM. Sizes may be numbers (bytes) or strings such as "256M".
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    kernel: Option<String>,
    cmdline: Option<String>,
    initrd: Option<PathBuf>,
    cpus: Option<u64>,
    memory: Option<serde_json::Value>,
    #[serde(default)]
    disks: Vec<DiskConfig>,
    #[serde(default)]
    pmem: Vec<vmm::pmem::PmemConfig>,
    serial: Option<SerialMode>,
    exits: Option<config::ExitsMode>,
}

pub const DEFAULT_MEMORY: &str = "256M";
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
pub const DEFAULT_PROBE_CMDLINE: &str = "probe.tasks=hello";

impl VmArgs {
    pub fn to_config(&self) -> Result<VmConfig, String> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("--config {}: {e}", p.display()))?;
                serde_json::from_str::<FileConfig>(&text)
                    .map_err(|e| format!("--config {}: invalid JSON config: {e}", p.display()))?
            }
            None => FileConfig::default(),
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
        let (mem_text, mem_flag) = match (&self.memory, &file.memory) {
            (Some(m), _) => (m.clone(), "--memory"),
            (None, Some(serde_json::Value::Number(n))) => (n.to_string(), "memory (config)"),
            (None, Some(serde_json::Value::String(s))) => (s.clone(), "memory (config)"),
            (None, Some(v)) => return Err(format!("memory (config): {v} is not a size")),
            (None, None) => (DEFAULT_MEMORY.to_string(), "--memory"),
        };
        let memory = config::parse_size(mem_flag, &mem_text).map_err(|e| e.to_string())?;
        config::check_memory(mem_flag, &mem_text, memory).map_err(|e| e.to_string())?;
        let disks = if self.disk.is_empty() {
            file.disks
        } else {
            self.disk
                .iter()
                .map(|d| d.parse::<DiskConfig>().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?
        };
        for d in &disks {
            config::check_storage_file("--disk path", &d.path).map_err(|e| e.to_string())?;
        }
        let pmem = if self.pmem.is_empty() {
            file.pmem
        } else {
            self.pmem
                .iter()
                .map(|p| {
                    p.parse::<vmm::pmem::PmemConfig>()
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<_, _>>()?
        };
        let exits = match &self.exits {
            Some(e) => e.parse()?,
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
        })
    }
}
