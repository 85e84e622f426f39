//! Builds a VM, or this process's share of one: memory, vCPUs, kernel, devices and boot
//! data, in one readable sequence, with nothing running yet.
//!
//! The life of a VM is [`Vm::build`] or [`VmBuilder::build`] (everything created, nothing
//! running, here), [`Vm::start`] (in `start`) and [`RunningVm::wait`](crate::RunningVm::wait)
//! (in `running`).

use super::Vm;
use crate::arch::x86_64::cpuid::Topology;
use crate::arch::x86_64::layout::GuestLayout;
use crate::arch::x86_64::{linux, regs};
use crate::boot_data::{write_boot_data, BootDataError};
use crate::config::VmConfig;
use crate::control::RunControl;
use crate::device_manager::{create_devices, DeviceError, HostSide};
use crate::exit::DeviceBus;
use crate::loader::{load_kernel, EntryPoint, LoadError};
use crate::pmem::{host_phys_bits, PmemError, PmemRegions};
use crate::seccomp::SeccompMode;
use crate::vstate::memory::{GuestRam, MemoryError, RamBackend};
use crate::vstate::vcpu::{install_kick_handler, VcpuError};
use crate::vstate::vcpu_thread::{Boot, PendingVcpu, VcpuSetup};
use crate::vstate::vm::{open_kvm, KvmVm, VmError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    #[error(transparent)]
    BootData(#[from] BootDataError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Persist(#[from] crate::persist::PersistError),
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
    /// Stop the VM (outcome [`Outcome::VmmError`](crate::Outcome::VmmError)) if it runs longer than this.
    pub timeout: Option<Duration>,
    /// System-call filters on the vCPU and I/O threads.
    pub seccomp: SeccompMode,
    /// How long the I/O thread polls for its next event after each one before it sleeps
    /// (`run --io-poll`); zero sleeps at once.
    pub io_poll: Duration,
    /// Poll each window to its end even while another task waits for a CPU
    /// (`run --io-poll-hold`).
    pub io_poll_hold: bool,
    /// How many I/O threads serve the doorbells and device events (`run --io-threads`).
    pub io_threads: crate::io_thread::IoThreadCount,
}

/// Fills the `--metrics` sections the VM's embedder counts (demand paging, migration, a
/// node's coherence), called whenever the metrics are read.
pub type ExtraMetrics = Arc<dyn Fn(&mut musubi_types::Metrics) + Send + Sync>;

/// Builds a VM, or the share of one that this process runs. A whole VM on this host is
/// [`Vm::build`]; the builder is for the VMs that are not made in one piece from their
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
    /// Of those, the ones that stand by until given a state.
    standby: Vec<u8>,
    ram: GuestRamSource,
    /// This process holds the devices, loads the kernel and writes the firmware tables.
    devices: bool,
    topology: Option<Topology>,
    on_stopped: Option<Box<dyn FnOnce() + Send>>,
    extra_metrics: Option<ExtraMetrics>,
    /// Build the VM a snapshot holds instead of booting one.
    restore: Option<crate::snapshot::Snapshot>,
    /// Build everything but the state, which [`Vm::apply_state`] puts in later.
    later: bool,
    prefault: bool,
    /// Bind host-side sockets beside their paths, taken over at start.
    staged_sockets: bool,
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
    backend: RamBackend,
    source: Option<Arc<std::fs::File>>,
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
        ExternalRam {
            host,
            len,
            owner,
            backend: RamBackend::Coherent,
            source: None,
        }
    }

    /// Marks the mapping as filled on demand by its owner from elsewhere (a migration's
    /// source): the layout's RAM ranges lie one after the other in it.
    pub fn on_demand(mut self) -> Self {
        self.backend = RamBackend::OnDemand;
        self
    }

    /// Marks the mapping as filled on demand from `file` (a snapshot's memory file): the
    /// layout's RAM ranges lie one after the other in it, and a snapshot of this VM knows
    /// that pages it has not touched yet hold the file's data.
    pub fn on_demand_from(mut self, file: Arc<std::fs::File>) -> Self {
        self.backend = RamBackend::OnDemand;
        self.source = Some(file);
        self
    }
}

impl<'a> VmBuilder<'a> {
    /// The whole VM of `config`, on this host: every vCPU, anonymous RAM, the devices.
    pub fn new(config: &'a VmConfig) -> VmBuilder<'a> {
        VmBuilder {
            config,
            opts: RunOptions::default(),
            vcpus: (0..config.cpus).collect(),
            standby: Vec::new(),
            ram: GuestRamSource::Anonymous,
            devices: true,
            topology: None,
            on_stopped: None,
            extra_metrics: None,
            restore: None,
            later: false,
            prefault: false,
            staged_sockets: false,
        }
    }

    /// Builds the VM with no kernel and no state: memory, vCPUs and devices exist, and the
    /// state comes later through [`Vm::apply_state`]. A migration's destination builds
    /// this way before the source pauses, so the pause lasts only as long as sending and
    /// applying the state, whatever the VM's size.
    pub fn restore_later(mut self) -> Self {
        self.later = true;
        self
    }

    /// Binds the vsock device's listener beside its path and moves it onto the path only
    /// when the VM starts ([`Vm::start`]): a VM migrating within one host is built while
    /// its source still listens at that path, and must not take it before the switch
    /// (the migration may yet fail and the VM go on there), nor fail for finding it taken.
    pub fn staged_sockets(mut self) -> Self {
        self.staged_sockets = true;
        self
    }

    /// Builds the VM `snapshot` holds: RAM mapped copy-on-write from its memory file, every
    /// vCPU, interrupt controller, timer and device put back as saved, no kernel loaded.
    /// `config` must be the snapshot's own (`snapshot.config.to_vm_config()`).
    /// It is built as [`VmBuilder::restore_later`] builds and then given the snapshot's
    /// state, so a snapshot and a migration put a VM back the one same way.
    pub fn restore(mut self, snapshot: crate::snapshot::Snapshot) -> Self {
        self.restore = Some(snapshot);
        self
    }

    /// Reads a restored VM's whole memory file in while building, so its first run takes
    /// no page faults for it (Cloud Hypervisor's `prefault`).
    pub fn prefault(mut self, prefault: bool) -> Self {
        self.prefault = prefault;
        self
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

    /// Creates these vCPUs too (global ids not in [`VmBuilder::vcpus`]), standing by: each
    /// waits without running until it is given the state of the same vCPU from the share
    /// that ran it ([`crate::VmHandle::adopt_vcpu`]). A node of a VM over several hosts
    /// creates every vCPU this way, so any of them can move to it while the VM runs.
    pub fn standby_vcpus(mut self, ids: Vec<u8>) -> Self {
        self.standby = ids;
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
        Vm::build_share(self)
    }
}

/// Sends message-signalled interrupts into a VM, as a device would.
#[derive(Clone)]
pub struct MsiInjector(pub(super) Arc<kvm_ioctls::VmFd>);

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

impl Vm {
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
            config.disks.len()
                + config.net.len()
                + usize::from(config.vsock.is_some())
                + pmem_files.virtio_devices()
                + usize::from(config.rng.is_some()),
            host_phys_bits(),
        )?;
        let addrs: Vec<u64> = layout.pmem.iter().map(|p| p.addr).collect();
        let mut pmem = pmem_files.map(&addrs)?;
        // The vCPU threads start first and set up their vCPUs beside the rest of the build
        // (see `vcpu_thread`): the first probes the host's CPUID while the VM is created.
        let kvm_host = open_kvm()?;
        let mut ids = share.vcpus.clone();
        ids.extend(share.standby.iter().filter(|s| !share.vcpus.contains(s)));
        let setup = VcpuSetup::new(
            kvm_host.clone(),
            layout.cpus,
            ids.len(),
            share.topology,
            opts.seccomp,
        );
        let vcpus = ids
            .iter()
            .map(|&id| PendingVcpu::spawn(id, &setup))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| BuildError::Thread {
                what: "vCPU",
                source,
            })?;
        let mut kvm = KvmVm::create(kvm_host)?;
        let snapshot = share.restore;
        // A VM put back from a state has no kernel to load and no entry state: its vCPUs
        // wait for `Vm::apply_state`.
        let later = share.later || snapshot.is_some();
        let ram = Arc::new(match share.ram {
            GuestRamSource::Anonymous => match &snapshot {
                Some(snap) => GuestRam::from_file(&layout, snap.memory.clone(), share.prefault)?,
                None => GuestRam::new(&layout, RamBackend::Anonymous)?,
            },
            // SAFETY: `ExternalRam::new`'s contract: the owner keeps the mapping while it
            // lives, and `GuestRam` keeps the owner.
            GuestRamSource::External(r) => unsafe {
                GuestRam::shared(&layout, r.host, r.len, r.owner, r.backend, r.source)?
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
        let loaded = if share.devices && !later {
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
        if !later {
            for v in &vcpus {
                v.boot(if v.id == 0 { boot } else { None });
            }
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
                HostSide {
                    capture: capture.clone(),
                    staged_sockets: share.staged_sockets,
                },
                pmem.devices(),
                control.clone(),
            )?
        } else {
            // A node without devices still has the legacy set (serial off), never reached:
            // its vCPUs' exits go to the node that holds the real ones.
            let bare = VmConfig {
                disks: Vec::new(),
                pmem: Vec::new(),
                net: Vec::new(),
                rng: None,
                vsock: None,
                serial: crate::config::SerialMode::Off,
                ..config.clone()
            };
            create_devices(
                &kvm,
                &mem,
                &bare,
                &layout,
                HostSide::default(),
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
        let mut saved_config = crate::snapshot::SavedConfig::new(
            config,
            &pmem.regions.iter().map(|r| r.size).collect::<Vec<_>>(),
        );
        for (n, mac) in saved_config.net.iter_mut().zip(&devices.net_macs) {
            n.mac = Some(crate::config::net::MacAddr(*mac));
        }

        let bus: Arc<dyn DeviceBus> = devices.bus.clone();
        let mut vm = Vm {
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
            start_clock: None,
            saved_config,
            awaits_state: later,
            standby: share.standby.clone(),
            start_paused: false,
        };
        if let Some(snap) = snapshot {
            vm.apply_state(snap.dir.display().to_string(), snap.state)?;
            phase("state restored");
        }
        Ok(vm)
    }
}
