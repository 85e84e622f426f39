//! Builds a VM from its configuration in one readable sequence, runs it, and tears it down
//! so that nothing the guest wrote is lost.
//!
//! The life of a VM is `Vmm::build` (everything created, nothing running), `Vm::start`
//! (vCPU and I/O threads running) and `RunningVm::wait` (until an outcome, then flushed).
//! The library installs no process-wide signal handlers: the program that embeds it decides
//! what SIGTERM or SIGUSR1 mean and acts through a [`VmHandle`].

use crate::arch::x86_64::cpuid::Topology;
use crate::arch::x86_64::layout::{GuestLayout, CMDLINE_MAX_SIZE};
use crate::arch::x86_64::{acpi, linux, mptable, pvh, regs};
use crate::config::{ExitsMode, VmConfig};
use crate::control::{Outcome, RunControl};
use crate::device_manager::{create_devices, DeviceError, Devices};
use crate::exit::DeviceBus;
use crate::io_thread::IoThread;
use crate::irq::IrqLine;
use crate::loader::{load_kernel, EntryPoint, LoadError};
use crate::metrics::{detailed, summarize, ExitSummary, VcpuMetrics};
use crate::pmem::{host_phys_bits, PmemError, PmemRegions};
use crate::seccomp::SeccompMode;
use crate::vstate::memory::{GuestRam, MemoryError, RamBackend};
use crate::vstate::vcpu::{
    install_kick_handler, kick_signal, VcpuContext, VcpuError, VcpuState, VcpuStatus,
};
use crate::vstate::vcpu_thread::{Boot, PendingVcpu, VcpuSetup};
use crate::vstate::vm::{open_kvm, KvmVm, VmError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::signal::Killable;

/// Why a VM could not be built or started. Each variant keeps its cause as `source()`.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Layout(#[from] crate::arch::x86_64::layout::LayoutError),
    #[error(transparent)]
    Kvm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Pmem(#[from] PmemError),
    #[error(transparent)]
    Kernel(#[from] LoadError),
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("cannot write the MP table: {0}")]
    MpTable(#[from] mptable::MpTableError),
    #[error("cannot write the ACPI tables: {0}")]
    Acpi(#[from] acpi::AcpiError),
    #[error("cannot write the PVH start info: {0}")]
    Pvh(#[from] pvh::PvhError),
    #[error("cannot write the Linux boot parameters: {0}")]
    LinuxBoot(#[from] linux::LinuxBootError),
    #[error("--cmdline: {0} (with the virtio device fragments it must fit in {max} bytes of printable ASCII)", max = CMDLINE_MAX_SIZE - 1)]
    Cmdline(#[from] linux_loader::cmdline::Error),
    #[error("cannot write the command line into guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
    #[error("--initrd {}: {why}", path.display())]
    Initrd { path: PathBuf, why: String },
    #[error("cannot start the {what} thread: {source}")]
    Thread {
        what: &'static str,
        source: std::io::Error,
    },
}

/// Options that change how a VM is observed, not what it is.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Keep a copy of everything the guest writes to COM1 in the report.
    pub capture_serial: bool,
    /// Stop the VM (outcome [`Outcome::VmmError`]) if it runs longer than this.
    pub timeout: Option<Duration>,
    /// System-call filters on the vCPU and I/O threads.
    pub seccomp: SeccompMode,
}

/// What happened during one VM run.
#[derive(Debug)]
pub struct RunReport {
    pub outcome: Outcome,
    pub exits: Vec<ExitSummary>,
    pub total_exits: u64,
    pub interrupts: u64,
    pub serial: Vec<u8>,
    /// The full exit accounting (per vCPU, per port and device register, histograms).
    pub metrics: serde_json::Value,
    /// Queue notifications that reached the VMM's I/O thread through ioeventfds.
    pub ioeventfd_notifications: u64,
    /// From the start of the build to the BSP's first KVM_RUN.
    pub to_first_run: Option<Duration>,
    /// CLOCK_MONOTONIC at the BSP's first KVM_RUN, comparable across processes, so a parent
    /// can measure from its own spawn of the VMM.
    pub first_run_monotonic_ns: Option<u64>,
    pub wall: Duration,
}

/// Builds VMs.
pub struct Vmm;

/// A VM with its memory, kernel, devices and vCPUs in place, not yet running.
pub struct Vm {
    started: Instant,
    opts: RunOptions,
    exits: ExitsMode,
    layout: GuestLayout,
    kvm: KvmVm,
    ram: Arc<GuestRam>,
    mem: GuestMemoryMmap,
    pmem: PmemRegions,
    devices: Devices,
    vcpus: Vec<PendingVcpu>,
    control: Arc<RunControl>,
    capture: Option<Arc<Mutex<Vec<u8>>>>,
    /// Where the vCPUs' port and MMIO exits go: the local devices unless a node forwards them.
    bus: Arc<dyn DeviceBus>,
    /// More entries for `--metrics` (a node's coherence counters).
    extra_metrics: Option<ExtraMetrics>,
    /// Run once the vCPUs and the I/O thread have stopped, before the VM is destroyed.
    on_stopped: Option<Box<dyn FnOnce() + Send>>,
}

/// A source of more `--metrics` entries, called whenever the metrics are read.
pub type ExtraMetrics = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Builds a VM, or the share of one that this process runs. A whole VM on this host is
/// [`Vmm::build`]; the builder is for the VMs that are not made in one piece from their
/// configuration: a node of a VM over several hosts (its own vCPUs only, on guest RAM the
/// coherence layer maps, devices only on one node), and next a snapshot restore and a
/// migration destination (guest RAM filled from elsewhere, no kernel to load).
///
/// Every node builds the same guest-physical layout from the same configuration, so the
/// share is described by what differs, each with the whole-VM case as its default.
pub struct VmBuilder<'a> {
    config: &'a VmConfig,
    opts: RunOptions,
    /// Global ids (APIC ids) of the vCPUs created here.
    vcpus: Vec<u8>,
    ram: GuestRamSource,
    /// This process holds the devices, loads the kernel and writes the firmware tables.
    devices: bool,
    topology: Option<Topology>,
    on_stopped: Option<Box<dyn FnOnce() + Send>>,
    extra_metrics: Option<ExtraMetrics>,
}

/// Where guest RAM comes from.
pub enum GuestRamSource {
    /// Anonymous memory of this process, zeroed: a VM that boots from its kernel.
    Anonymous,
    /// A mapping someone else made and keeps filled (a coherence layer's shared RAM, a
    /// snapshot's file), which the VM registers with KVM as it is.
    External(ExternalRam),
}

/// A guest-RAM mapping owned by someone else. The VM holds `owner` until it is destroyed,
/// which is what keeps the mapping alive.
pub struct ExternalRam {
    host: *mut u8,
    len: usize,
    owner: Arc<dyn std::any::Any + Send + Sync>,
}

impl ExternalRam {
    /// # Safety
    /// `host..host + len` must be a readable and writable mapping, at least as long as the
    /// VM's RAM, that stays mapped as long as `owner` lives and that nothing else unmaps or
    /// remaps meanwhile.
    pub unsafe fn new(
        host: *mut u8,
        len: usize,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> ExternalRam {
        ExternalRam { host, len, owner }
    }
}

impl<'a> VmBuilder<'a> {
    /// The whole VM of `config`, on this host: every vCPU, anonymous RAM, the devices.
    pub fn new(config: &'a VmConfig) -> VmBuilder<'a> {
        VmBuilder {
            config,
            opts: RunOptions::default(),
            vcpus: (0..config.cpus).collect(),
            ram: GuestRamSource::Anonymous,
            devices: true,
            topology: None,
            on_stopped: None,
            extra_metrics: None,
        }
    }

    /// How the VM is observed (serial capture, timeout, system-call filters).
    pub fn options(mut self, opts: RunOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Creates only these vCPUs (global APIC ids); the others run elsewhere. Only the vCPU
    /// with id 0 gets the boot entry state; the others wait for start-up IPIs.
    pub fn vcpus(mut self, ids: Vec<u8>) -> Self {
        self.vcpus = ids;
        self
    }

    pub fn guest_ram(mut self, ram: GuestRamSource) -> Self {
        self.ram = ram;
        self
    }

    /// Whether this process holds the devices, loads the kernel and writes the firmware
    /// tables. Exactly one share of a VM does; the others forward device accesses to it
    /// through their own [`DeviceBus`] (see [`Vm::set_device_bus`]).
    pub fn devices(mut self, devices: bool) -> Self {
        self.devices = devices;
        self
    }

    /// Tells the guest, through CPUID, that it runs over several nodes and how to send
    /// IPIs that cross them.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    /// `f` runs once no guest code runs any more, before the VM is destroyed: the moment
    /// an owner of external RAM can stop serving its faults.
    pub fn on_stopped(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.on_stopped = Some(Box::new(f));
        self
    }

    /// Creates memory, vCPUs, devices and boot data. No guest code runs until
    /// [`Vm::start`].
    pub fn build(self) -> Result<Vm, BuildError> {
        Vmm::build_share(self)
    }
}

/// Sends message-signalled interrupts into a VM, as a device would.
#[derive(Clone)]
pub struct MsiInjector(Arc<kvm_ioctls::VmFd>);

impl MsiInjector {
    /// Delivers the MSI with this address and data. KVM refuses one that names no vCPU of
    /// this process (the error says so); like a PC, such an interrupt is simply lost.
    pub fn signal(&self, address: u32, data: u32) -> Result<(), kvm_ioctls::Error> {
        let msi = kvm_bindings::kvm_msi {
            address_lo: address,
            address_hi: 0,
            data,
            ..Default::default()
        };
        self.0.signal_msi(msi).map(|_| ())
    }
}

/// What the VM's threads and its handles share.
struct Shared {
    exits: ExitsMode,
    /// Global id of each vCPU of `metrics`, in order.
    vcpu_ids: Vec<u8>,
    extra_metrics: Option<ExtraMetrics>,
    ram: Arc<GuestRam>,
    control: Arc<RunControl>,
    metrics: Vec<Arc<VcpuMetrics>>,
    irqs: Vec<Arc<dyn IrqLine>>,
    names: Arc<crate::device_manager::MmioNames>,
    ioeventfd_served: Arc<AtomicU64>,
    serial: Arc<Mutex<devices::legacy::Serial>>,
}

impl Shared {
    fn metrics_json(&self) -> serde_json::Value {
        let names = |t| self.names.name(t);
        let (per_vcpu, all) = detailed(&self.metrics, &names);
        let notify_exits: u64 = all
            .iter()
            .filter(|d| {
                d.detail
                    .as_deref()
                    .is_some_and(|n| n.ends_with(":queue_notify"))
            })
            .map(|d| d.count)
            .sum();
        let mut irq_paths = serde_json::Map::new();
        for irq in &self.irqs {
            let e = irq_paths.entry(irq.path()).or_insert(serde_json::json!(0));
            *e = serde_json::json!(e.as_u64().unwrap_or(0) + irq.count());
        }
        let mut json = serde_json::json!({
            "exits_mode": self.exits.to_string(),
            "total_exits": all.iter().map(|d| d.count).sum::<u64>(),
            "exits": all,
            "vcpus": per_vcpu.into_iter().zip(&self.vcpu_ids).map(|(e, id)| serde_json::json!({"id": id, "exits": e})).collect::<Vec<_>>(),
            "notifications": {
                "mmio_exit": notify_exits,
                "ioeventfd": self.ioeventfd_served.load(Ordering::Relaxed),
            },
            "interrupts": irq_paths,
            "memory": {
                "backend": self.ram.backend(),
                "vcpu_threads": self.ram.vcpu_threads(),
            },
        });
        if let (Some(extra), Some(obj)) = (&self.extra_metrics, json.as_object_mut()) {
            if let serde_json::Value::Object(more) = extra() {
                obj.extend(more);
            }
        }
        json
    }
}

/// A VM whose vCPUs run.
pub struct RunningVm {
    vm: Vm,
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    statuses: Vec<Arc<VcpuStatus>>,
    request: Arc<AtomicU64>,
    io_thread: Option<IoThread>,
    first_run: Arc<OnceLock<(Instant, u64)>>,
}

/// Stops a running VM or reads its accounting from any thread (a signal handler's thread,
/// a supervisor).
#[derive(Clone)]
pub struct VmHandle {
    shared: Arc<Shared>,
}

impl VmHandle {
    /// Ends the VM with `outcome` unless it has already ended.
    pub fn stop(&self, outcome: Outcome) {
        self.shared.control.finish(outcome);
    }

    /// The exit accounting so far, as `--metrics` writes it.
    pub fn metrics(&self) -> serde_json::Value {
        self.shared.metrics_json()
    }

    /// Types `bytes` into COM1 as if they came down the serial line, raising its receive
    /// interrupt. Returns how many were taken: fewer than offered (maybe 0) while the UART's
    /// 64-byte receive FIFO is full. A UART has no way to stall its sender without losing
    /// data, so the caller keeps the rest and offers it again later; this never waits, so
    /// it cannot hold up a vCPU. Bytes offered after the VM ended are taken and ignored.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        if self.shared.control.is_finished() {
            return bytes.len();
        }
        self.shared
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_input(bytes)
    }
}

impl Vmm {
    /// Creates the VM described by `config`: memory, kernel, devices and firmware tables in
    /// that order on this thread, the vCPUs meanwhile on their own threads. No guest code
    /// runs until [`Vm::start`].
    pub fn build(config: &VmConfig, opts: &RunOptions) -> Result<Vm, BuildError> {
        VmBuilder::new(config).options(opts.clone()).build()
    }

    fn build_share(share: VmBuilder) -> Result<Vm, BuildError> {
        let config = share.config;
        let opts = &share.opts;
        let started = Instant::now();
        install_kick_handler().map_err(|source| BuildError::Thread {
            what: "vCPU kick handler",
            source,
        })?;
        // Set-up time per phase, at debug level (MUSUBI_LOG=vmm=debug).
        let phase = |name: &str| {
            tracing::debug!(
                phase = name,
                us = started.elapsed().as_micros() as u64,
                "set-up"
            )
        };

        // 1. The guest-physical layout, and the memory behind it. Memory-storage files are
        // opened first, so bad files are reported before any KVM work.
        let pmem_files = PmemRegions::open_files(&config.pmem, &config.disks)?;
        let layout = GuestLayout::new(
            config.memory,
            config.cpus,
            &pmem_files.spans(),
            config.disks.len() + pmem_files.virtio_devices(),
            host_phys_bits(),
        )?;
        let addrs: Vec<u64> = layout.pmem.iter().map(|p| p.addr).collect();
        let pmem = pmem_files.map(&addrs)?;
        // The vCPU threads start first and set up their vCPUs beside the rest of the build
        // (see `vcpu_thread`): the first probes the host's CPUID while the VM is created.
        let kvm_host = open_kvm()?;
        let setup = VcpuSetup::new(
            kvm_host.clone(),
            layout.cpus,
            share.vcpus.len(),
            share.topology,
            opts.seccomp,
        );
        let vcpus = share
            .vcpus
            .iter()
            .map(|&id| PendingVcpu::spawn(id, &setup))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| BuildError::Thread {
                what: "vCPU",
                source,
            })?;
        let mut kvm = KvmVm::create(kvm_host)?;
        let ram = Arc::new(match share.ram {
            GuestRamSource::Anonymous => GuestRam::new(&layout, RamBackend::Anonymous)?,
            // SAFETY: `ExternalRam::new`'s contract: the owner keeps the mapping while it
            // lives, and `GuestRam` keeps the owner.
            GuestRamSource::External(r) => unsafe {
                GuestRam::shared(&layout, r.host, r.len, r.owner)?
            },
        });
        kvm.register_memory(ram.memory())?;
        pmem.register(&mut kvm)?;
        kvm.create_irqchip()?;
        for v in &vcpus {
            v.create(&kvm.shared_fd());
        }
        let mem = pmem.extend_guest_memory(ram.memory().clone())?;
        phase("vm and memory");

        // 2. The kernel, loaded once for the whole VM by the node that holds the devices.
        let loaded = if share.devices {
            Some(load_kernel(&mem, &config.kernel)?)
        } else {
            None
        };
        let boot = loaded.as_ref().map(|(entry, _)| match *entry {
            EntryPoint::Pvh(rip) => Boot {
                regs: regs::pvh_regs(rip, layout.pvh_start_info),
                sregs: regs::pvh_sregs,
            },
            EntryPoint::Linux64 { entry, .. } => Boot {
                regs: linux::long_mode_regs(entry),
                sregs: linux::long_mode_sregs,
            },
        });
        for v in &vcpus {
            v.boot(if v.id == 0 { boot } else { None });
        }
        phase("kernel loaded");

        // 3. Devices, and the command line that announces them.
        let control = Arc::new(RunControl::default());
        let capture = opts
            .capture_serial
            .then(|| Arc::new(Mutex::new(Vec::new())));
        let devices = if share.devices {
            create_devices(
                &kvm,
                &mem,
                config,
                &layout,
                capture.clone(),
                pmem.devices(),
                control.clone(),
            )?
        } else {
            // A node without devices still has the legacy set (serial off), never reached:
            // its vCPUs' exits go to the node that holds the real ones.
            let bare = VmConfig {
                disks: Vec::new(),
                pmem: Vec::new(),
                serial: crate::config::SerialMode::Off,
                ..config.clone()
            };
            create_devices(
                &kvm,
                &mem,
                &bare,
                &layout,
                None,
                Default::default(),
                control.clone(),
            )?
        };
        phase("devices");

        if let Some((entry, kernel_end)) = loaded {
            write_boot_data(config, &layout, &mem, &devices, &entry, kernel_end)?;
            phase("firmware tables");
        }
        // Last: KVM_CREATE_PIT2 runs under the VM's lock, which KVM_CREATE_VCPU takes too,
        // so made earlier it held up the vCPUs being created on their threads.
        kvm.create_pit()?;

        let bus: Arc<dyn DeviceBus> = devices.bus.clone();
        Ok(Vm {
            started,
            opts: opts.clone(),
            exits: config.exits,
            layout,
            kvm,
            ram,
            mem,
            pmem,
            devices,
            vcpus,
            control,
            capture,
            bus,
            extra_metrics: share.extra_metrics,
            on_stopped: share.on_stopped,
        })
    }
}

/// The command line, firmware tables and boot structures, written into guest memory by the
/// process that loaded the kernel.
fn write_boot_data(
    config: &VmConfig,
    layout: &GuestLayout,
    mem: &GuestMemoryMmap,
    devices: &Devices,
    entry: &EntryPoint,
    kernel_end: u64,
) -> Result<(), BuildError> {
    let cmdline = build_cmdline(&config.cmdline, devices)?;
    mem.write_slice(cmdline.as_bytes_with_nul(), GuestAddress(layout.cmdline))?;

    // 4. Firmware tables and boot structures. Both CPU tables: the MP table for simple
    // guests, ACPI for kernels built without MP-table parsing (Debian's cloud kernel).
    mptable::write_mptable(mem, layout.cpus)?;
    let rsdp = acpi::write_acpi_tables(mem, layout.cpus)?;
    let e820 = layout.e820();
    let initrd = load_initrd(mem, config, layout, entry, kernel_end)?;
    match entry {
        EntryPoint::Pvh(_) => {
            pvh::write_start_info(mem, &e820, layout.cmdline, Some(rsdp))?;
            if let Some((addr, size)) = initrd {
                pvh::add_initrd_module(mem, addr, size)?;
            }
        }
        EntryPoint::Linux64 { header, .. } => {
            let len = cmdline.as_bytes_with_nul().len() - 1;
            linux::write_boot_params(mem, *header, &e820, layout.cmdline, len, initrd)?;
            linux::set_acpi_rsdp_addr(mem, rsdp)?;
            linux::write_boot_gdt_and_page_tables(mem)?;
        }
    }
    Ok(())
}

impl Vm {
    /// The guest-physical map the VM was built with.
    pub fn layout(&self) -> &GuestLayout {
        &self.layout
    }

    /// The bus of this process's own devices: a share of a VM that holds the devices
    /// serves the accesses other shares forward to it here.
    pub fn device_bus(&self) -> Arc<dyn DeviceBus> {
        self.devices.bus.clone()
    }

    /// Sends the vCPUs' port and MMIO accesses to `bus` instead of the local devices (a
    /// node forwards them to the node that holds the devices, and carries IPIs).
    pub fn set_device_bus(&mut self, bus: Arc<dyn DeviceBus>) {
        self.bus = bus;
    }

    /// Adds `extra()`'s object to the metrics whenever they are read (a node's coherence
    /// counters). Set after the build, as the counters usually live in the device bus.
    pub fn set_extra_metrics(&mut self, extra: ExtraMetrics) {
        self.extra_metrics = Some(extra);
    }

    /// Where the VM's outcome is decided: a node ends the VM when a peer does, and its
    /// forwarded accesses stop waiting once the VM has ended.
    pub fn run_control(&self) -> Arc<RunControl> {
        self.control.clone()
    }

    /// Delivers interrupts into the VM from any thread (IPIs that came from another node).
    pub fn msi_injector(&self) -> MsiInjector {
        MsiInjector(self.kvm.shared_fd())
    }

    /// Starts the I/O thread (kernel exit path) and one thread per vCPU.
    pub fn start(mut self) -> Result<RunningVm, BuildError> {
        let notifiers = std::mem::take(&mut self.devices.notifiers);
        let io_thread = if notifiers.is_empty() {
            None
        } else {
            Some(
                IoThread::start(notifiers, self.control.clone(), self.opts.seccomp).map_err(
                    |source| BuildError::Thread {
                        what: "virtio I/O",
                        source,
                    },
                )?,
            )
        };
        let shared = Arc::new(Shared {
            exits: self.exits,
            vcpu_ids: self.vcpus.iter().map(|v| v.id).collect(),
            extra_metrics: self.extra_metrics.clone(),
            ram: self.ram.clone(),
            control: self.control.clone(),
            metrics: self.vcpus.iter().map(|_| Arc::default()).collect(),
            irqs: self.devices.irqs.clone(),
            names: self.devices.mmio_names.clone(),
            ioeventfd_served: io_thread
                .as_ref()
                .map(|t| t.served_counter())
                .unwrap_or_default(),
            serial: self.devices.serial.clone(),
        });
        let first_run: Arc<OnceLock<(Instant, u64)>> = Arc::default();
        let request = Arc::new(AtomicU64::new(0));
        let statuses: Vec<Arc<VcpuStatus>> = self.vcpus.iter().map(|_| Arc::default()).collect();
        let mut threads = Vec::new();
        // The BSP has its entry state; APs wait for INIT/SIPI in the kernel. A vCPU whose
        // set-up failed ends the VM with the reason as soon as it is told to run.
        for ((vcpu, metrics), status) in std::mem::take(&mut self.vcpus)
            .into_iter()
            .zip(&shared.metrics)
            .zip(&statuses)
        {
            threads.push(vcpu.run(VcpuContext {
                bus: self.bus.clone(),
                control: self.control.clone(),
                metrics: metrics.clone(),
                status: status.clone(),
                request: request.clone(),
                ram: self.ram.clone(),
                first_run: first_run.clone(),
            }));
        }
        Ok(RunningVm {
            vm: self,
            shared,
            threads,
            statuses,
            request,
            io_thread,
            first_run,
        })
    }
}

/// How long the guest must cause no exit before the VM asks its vCPUs whether they are
/// halted for good.
const IDLE_CHECK_AFTER: Duration = Duration::from_millis(1000);

impl RunningVm {
    pub fn handle(&self) -> VmHandle {
        VmHandle {
            shared: self.shared.clone(),
        }
    }

    /// Ends the VM with `outcome` unless it has already ended.
    pub fn stop(&self, outcome: Outcome) {
        self.shared.control.finish(outcome);
    }

    /// The exit accounting so far.
    pub fn metrics(&self) -> serde_json::Value {
        self.shared.metrics_json()
    }

    /// Waits until the VM ends (the guest, a crash, [`VmHandle::stop`], or the timeout),
    /// stops every thread and makes the guest's writes durable.
    pub fn wait(mut self) -> RunReport {
        let started = self.vm.started;
        let deadline = self.vm.opts.timeout.map(|t| started + t);
        let mut idle = IdleCheck::default();
        let mut outcome = self.shared.control.wait(Duration::from_millis(20), || {
            if let Some(refused) = crate::seccomp::refused_call() {
                return Some(Outcome::VmmError(refused));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Some(Outcome::VmmError(format!(
                    "the VM did not finish within {:?}",
                    self.vm.opts.timeout.unwrap_or_default()
                )));
            }
            idle.poll(
                &self.shared.metrics,
                &self.statuses,
                &self.request,
                &self.threads,
            )
        });

        // Stop every vCPU, then make the guest's writes durable.
        stop_vcpus(std::mem::take(&mut self.threads));
        if let Some(t) = self.io_thread.as_mut() {
            t.stop();
        }
        if let Some(f) = self.vm.on_stopped.take() {
            f();
        }
        let mut flush_errors = self.vm.devices.flush();
        flush_errors.extend(self.vm.pmem.sync());
        if !flush_errors.is_empty() {
            outcome = Outcome::VmmError(format!(
                "guest writes may not be on disk: {}",
                flush_errors.join("; ")
            ));
        }
        let metrics = self.shared.metrics_json();
        let first_run = self.first_run.get().copied();
        let report = RunReport {
            metrics,
            ioeventfd_notifications: self.shared.ioeventfd_served.load(Ordering::Relaxed),
            exits: summarize(&self.shared.metrics),
            total_exits: self.shared.metrics.iter().map(|m| m.total()).sum(),
            interrupts: self.vm.devices.interrupts(),
            serial: self
                .vm
                .capture
                .as_ref()
                .map(|c| std::mem::take(&mut *c.lock().unwrap_or_else(|e| e.into_inner())))
                .unwrap_or_default(),
            to_first_run: first_run.map(|t| t.0.duration_since(started)),
            first_run_monotonic_ns: first_run.map(|t| t.1),
            wall: started.elapsed(),
            outcome,
        };
        let Vm {
            kvm,
            devices,
            mem,
            ram,
            ..
        } = self.vm;
        drop(devices);
        // The VM fd goes before the memory it maps.
        drop(kvm);
        drop(mem);
        drop(ram);
        report
    }
}

/// Finds a guest that can never run again: every vCPU halted with interrupts disabled (or
/// still waiting for a start-up IPI nobody will send). With the in-kernel LAPIC such a vCPU
/// sleeps inside KVM_RUN and no exit ever tells the VMM, so after a quiet spell the vCPUs
/// are kicked and each reports its state.
#[derive(Default)]
struct IdleCheck {
    last_exits: u64,
    quiet_since: Option<Instant>,
    asked: Option<u64>,
}

impl IdleCheck {
    fn poll(
        &mut self,
        metrics: &[Arc<VcpuMetrics>],
        statuses: &[Arc<VcpuStatus>],
        request: &AtomicU64,
        threads: &[std::thread::JoinHandle<()>],
    ) -> Option<Outcome> {
        let exits: u64 = metrics.iter().map(|m| m.guest_exits()).sum();
        let now = Instant::now();
        if exits != self.last_exits {
            self.last_exits = exits;
            self.quiet_since = Some(now);
            self.asked = None;
            return None;
        }
        let quiet_since = *self.quiet_since.get_or_insert(now);
        if let Some(req) = self.asked {
            let answers: Option<Vec<VcpuState>> = statuses.iter().map(|s| s.get(req)).collect();
            let answers = answers?;
            self.asked = None;
            self.quiet_since = Some(now);
            let halted = answers.iter().enumerate().find_map(|(i, s)| match s {
                VcpuState::HaltedForGood { rip } => Some((i, *rip)),
                _ => None,
            });
            let all_stuck = answers.iter().all(|s| {
                matches!(
                    s,
                    VcpuState::HaltedForGood { .. } | VcpuState::WaitingForStartup
                )
            });
            return match halted {
                Some((i, rip)) if all_stuck => Some(Outcome::GuestCrash(format!(
                    "every vCPU is halted with interrupts disabled and nothing can wake it (vCPU {i} at RIP {rip:#x})"
                ))),
                _ => None,
            };
        }
        if now.duration_since(quiet_since) >= IDLE_CHECK_AFTER {
            // Requests are tagged with 8 bits and 0 means "never answered".
            let mut req = request.load(Ordering::Relaxed) + 1;
            if req & 0xff == 0 {
                req += 1;
            }
            request.store(req, Ordering::Release);
            self.asked = Some(req);
            for t in threads {
                let _ = t.kill(kick_signal());
            }
        }
        None
    }
}

/// Kicks every vCPU thread out of KVM_RUN once and waits for it to return. The kick sets
/// `immediate_exit`, so it is not lost even when it lands just before a thread re-enters
/// the guest; the VM's control is already finished, so no thread goes back in.
fn stop_vcpus(handles: Vec<std::thread::JoinHandle<()>>) {
    for h in &handles {
        let _ = h.kill(kick_signal());
    }
    for h in handles {
        let _ = h.join();
    }
}

/// Builds, starts and waits for the VM described by `config`.
pub fn run_vm(config: &VmConfig, opts: &RunOptions) -> Result<RunReport, BuildError> {
    Ok(Vmm::build(config, opts)?.start()?.wait())
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The user's command line with the device fragments added to the kernel's part (before
/// any ` -- `, after which arguments go to init).
fn build_cmdline(base: &str, devices: &Devices) -> Result<std::ffi::CString, BuildError> {
    let mut cmdline = linux_loader::cmdline::Cmdline::new(CMDLINE_MAX_SIZE)?;
    let (kernel, init) = match base.trim().split_once(" -- ") {
        Some((k, i)) => (k.trim(), Some(i.trim())),
        None => (base.trim(), None),
    };
    if !kernel.is_empty() {
        cmdline.insert_str(kernel)?;
    }
    for f in &devices.cmdline_fragments {
        cmdline.insert_str(f)?;
    }
    if let Some(init) = init.filter(|i| !i.is_empty()) {
        cmdline.insert_init_args(init)?;
    }
    Ok(cmdline.as_cstring()?)
}

fn load_initrd(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    layout: &GuestLayout,
    entry: &EntryPoint,
    kernel_end: u64,
) -> Result<Option<(u64, u64)>, BuildError> {
    let Some(path) = &config.initrd else {
        return Ok(None);
    };
    let fail = |why: String| BuildError::Initrd {
        path: path.clone(),
        why,
    };
    let data = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let header = match entry {
        EntryPoint::Linux64 { header, .. } => header.as_ref(),
        EntryPoint::Pvh(_) => None,
    };
    let top = layout.low_ram_end();
    let addr = linux::initrd_address(top, data.len() as u64, header)?;
    if addr < kernel_end {
        return Err(fail(format!(
            "{} MiB does not fit between the kernel (ending at {kernel_end:#x}) and the top of low RAM ({top:#x}); give the VM more --memory",
            data.len() >> 20
        )));
    }
    mem.write_slice(&data, GuestAddress(addr))
        .map_err(|e| fail(format!("cannot place it in guest memory: {e}")))?;
    Ok(Some((addr, data.len() as u64)))
}
