//! A VM built and not yet running, or this process's share of one: what it holds, how a
//! saved state is put into it, and what its runner needs of it. How it is built is in
//! `builder`, how it starts in `start`.

mod builder;
mod start;

pub use builder::{
    BuildError, ExternalRam, ExtraMetrics, GuestRamSource, MsiInjector, RunOptions, VmBuilder,
};

use crate::arch::x86_64::layout::GuestLayout;
use crate::config::ExitsMode;
use crate::control::RunControl;
use crate::device_manager::Devices;
use crate::exit::DeviceBus;
use crate::persist::{InKernel, Persist, PersistError};
use crate::pmem::PmemRegions;
use crate::vstate::memory::GuestRam;
use crate::vstate::vcpu_thread::PendingVcpu;
use crate::vstate::vm::KvmVm;
use devices::GuestMemoryMmap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The KVM clock a restored VM goes on from, set just before its vCPUs run.
    start_clock: Option<kvm_bindings::kvm_clock_data>,
    /// What a snapshot of this VM records as its configuration.
    saved_config: crate::snapshot::SavedConfig,
    /// Built by [`VmBuilder::restore_later`]: its vCPUs wait for [`Vm::apply_state`].
    awaits_state: bool,
    /// The vCPUs (global ids) created standing by ([`VmBuilder::standby_vcpus`]).
    standby: Vec<u8>,
    /// The state applied says the VM was paused: it starts paused.
    start_paused: bool,
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

    /// Lets `extra` fill its sections of the metrics whenever they are read (a node's
    /// coherence counters). Set after the build, as the counters usually live in the
    /// device bus.
    pub fn set_extra_metrics(&mut self, extra: ExtraMetrics) {
        self.extra_metrics = Some(extra);
    }

    /// Where the VM's outcome is decided: a node ends the VM when a peer does, and its
    /// forwarded accesses stop waiting once the VM has ended.
    pub fn run_control(&self) -> Arc<RunControl> {
        self.control.clone()
    }

    /// Puts `state` (from `from`, for messages) into a VM built with
    /// [`VmBuilder::restore_later`]: every vCPU, the interrupt controllers and PIT, the
    /// devices, and the KVM clock it starts from.
    pub fn apply_state(
        &mut self,
        from: String,
        mut state: crate::snapshot::VmState,
    ) -> Result<(), BuildError> {
        if !self.awaits_state {
            return Err(PersistError::NotAwaitingState { from }.into());
        }
        state.check_fits(&from, &self.layout)?;
        let vcpus = std::mem::take(&mut state.vcpus);
        InKernel(self.kvm.fd()).restore(&state.vm)?;
        self.devices
            .device_set()
            .restore(&(state.serial, state.pm, state.transports))?;
        let mut states: Vec<Option<_>> = vcpus.into_iter().map(Some).collect();
        for v in &self.vcpus {
            if let Some(s) = states.get_mut(v.id as usize).and_then(Option::take) {
                v.restore(s);
            }
        }
        self.start_clock = Some(state.vm.clock);
        self.start_paused = state.paused;
        self.awaits_state = false;
        Ok(())
    }

    /// Makes the VM start paused whatever its state says, to wait for a resume (Cloud
    /// Hypervisor's restore leaves a VM so).
    pub fn hold_paused(&mut self) {
        self.start_paused = true;
    }

    /// Whether the VM will start paused: the state it was given says its owner had paused it.
    pub fn starts_paused(&self) -> bool {
        self.start_paused
    }

    /// Writes `frames` (each with its network device's number, as
    /// [`crate::VmHandle::captured_output`] numbers them) out of their devices' backends,
    /// in order, before the VM runs: a standby taking over sends the output its primary
    /// held for the epoch it resumes from and may have died holding. Returns how many
    /// frames the devices took; those for a device the VM lacks are left out.
    pub fn send_frames(&self, frames: Vec<(u32, Vec<u8>)>) -> usize {
        let mut per_net: Vec<Vec<Vec<u8>>> = Vec::new();
        for (net, frame) in frames {
            let net = net as usize;
            if per_net.len() <= net {
                per_net.resize_with(net + 1, Vec::new);
            }
            per_net[net].push(frame);
        }
        let nets = self.devices.transports.iter().filter(|t| {
            t.lock()
                .unwrap_or_else(|e| e.into_inner())
                .output_gate()
                .is_some()
        });
        nets.zip(per_net)
            .map(|(t, frames)| {
                t.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .send_frames(frames)
            })
            .sum()
    }

    /// Delivers interrupts into the VM from any thread (IPIs that came from another node).
    pub fn msi_injector(&self) -> MsiInjector {
        MsiInjector(self.kvm.shared_fd())
    }
}

/// What the runner of a started VM needs of it, once its vCPUs have stopped.
impl Vm {
    /// When the build started.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// How long the VM may run ([`RunOptions::timeout`]).
    pub(crate) fn timeout(&self) -> Option<Duration> {
        self.opts.timeout
    }

    /// Runs what the builder asked to run once no guest code runs, then makes the guest's
    /// disk writes durable; returns one message per disk that could not be synced.
    pub(crate) fn after_stop(&mut self) -> Vec<String> {
        if let Some(f) = self.on_stopped.take() {
            f();
        }
        self.devices.flush()
    }

    /// Syncs the memory-storage regions; returns one message per region that failed.
    pub(crate) fn sync_pmem(&self) -> Vec<String> {
        self.pmem.sync().iter().map(ToString::to_string).collect()
    }

    /// Interrupts raised by all devices so far.
    pub(crate) fn interrupts(&self) -> u64 {
        self.devices.interrupts()
    }

    /// What the guest wrote to COM1, if [`RunOptions::capture_serial`] asked to keep it.
    pub(crate) fn take_serial(&self) -> Vec<u8> {
        self.capture
            .as_ref()
            .map(|c| std::mem::take(&mut *c.lock().unwrap_or_else(|e| e.into_inner())))
            .unwrap_or_default()
    }

    /// Destroys the VM: its devices, then the VM fd before the memory it maps.
    pub(crate) fn destroy(self) {
        let Vm {
            kvm,
            devices,
            mem,
            ram,
            ..
        } = self;
        devices.remove_sockets();
        drop(devices);
        drop(kvm);
        drop(mem);
        drop(ram);
    }
}
