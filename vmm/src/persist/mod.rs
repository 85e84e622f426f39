//! Saving and restoring a VM, part by part: every part that holds guest-visible state (a
//! vCPU, the in-kernel interrupt controllers and PIT, the KVM clock, the serial port, the
//! ACPI PM1 registers, each virtio-mmio transport) implements [`Persist`], and a whole VM's state, [`VmState`], is
//! theirs put together. A snapshot directory, a migration and a replica all save and
//! restore through here; how the state is stored or carried is their own business.

mod device_state;
mod kvm;
mod vcpu;

pub use kvm::KvmVmState;
pub(crate) use kvm::{Clock, InKernel};
pub use vcpu::VcpuState;

use crate::arch::x86_64::layout::GuestLayout;
use crate::control::RunControl;
use crate::vstate::pause::{PauseError, PauseGate};
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vm::VmError;
use devices::legacy::{Pm, PmState, Serial, SerialSnapshot};
use devices::virtio::{MmioTransport, TransportState};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, OnceLock};

/// A part of a VM whose state can be read out and put back. `save` reads what the guest
/// could observe (the VM paused, so nothing changes meanwhile); `restore` writes it back
/// into a part built from the same configuration, checking it as if the guest had written
/// it, since a state may come from a file or another host.
pub trait Persist {
    /// The saved state: plain data, serializable.
    type State;
    /// What saving needs that the part does not hold itself (the MSRs a vCPU should save,
    /// the clock read when the VM paused); `()` for most parts.
    type SaveArgs: ?Sized;
    type Error;

    fn save(&self, args: &Self::SaveArgs) -> Result<Self::State, Self::Error>;
    fn restore(&self, state: &Self::State) -> Result<(), Self::Error>;
}

/// Why a VM's state could not be read out or put back.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Kvm(#[from] VmError),
    #[error(transparent)]
    Pause(#[from] PauseError),
    #[error("KVM_GET_MSR_INDEX_LIST failed: {0}")]
    MsrList(kvm_ioctls::Error),
    /// The VM is not paused, so there is no clock of the pause to save.
    #[error("the VM is not paused")]
    NotPaused,
    /// The serial port refused its saved state; the message is the device's own.
    #[error(transparent)]
    Serial(#[from] devices::legacy::SerialRestoreError),
    /// A virtio transport refused its saved state; the message is the device's own.
    #[error(transparent)]
    Device(#[from] devices::virtio::RestoreError),
    #[error("virtio device {index}: {source}")]
    Transport {
        index: usize,
        source: devices::virtio::RestoreError,
    },
    #[error("the snapshot has {saved} virtio devices, this VM {here}")]
    TransportCount { saved: usize, here: usize },
    #[error(
        "{from}: the snapshot's guest-physical map (RAM {saved_ram:x?}, memory storage \
         {saved_pmem:x?}) is not this build's (RAM {ram:x?}, memory storage {pmem:x?})"
    )]
    Layout {
        from: String,
        saved_ram: Vec<(u64, u64)>,
        saved_pmem: Vec<u64>,
        ram: Vec<(u64, u64)>,
        pmem: Vec<u64>,
    },
    #[error("{from}: {states} vCPU states for a VM of {cpus} CPUs")]
    VcpuCount {
        from: String,
        states: usize,
        cpus: u8,
    },
    #[error("{from}: this VM was not built to take a state")]
    NotAwaitingState { from: String },
    #[error("the VM was built to take a state and none was applied")]
    NoStateApplied,
}

/// Everything of a paused VM that is not its RAM or its configuration.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    /// Guest-physical (start, length) of each RAM range, in the memory file's order.
    pub ram: Vec<(u64, u64)>,
    /// Guest-physical address of each memory-storage region.
    pub pmem: Vec<u64>,
    pub vcpus: Vec<VcpuState>,
    pub vm: KvmVmState,
    pub serial: SerialSnapshot,
    /// The ACPI PM1 registers (power button). Snapshots written before the device existed
    /// have none and restore a powered-on machine's.
    #[serde(default)]
    pub pm: PmState,
    /// Every virtio transport, in the order the devices were created.
    pub transports: Vec<TransportState>,
    /// The VM's owner had paused it before it was captured (a migration of a paused VM): it
    /// is put back paused, to be resumed by whoever controls it there. Snapshots never set
    /// it, so a restore runs at once.
    #[serde(default)]
    pub paused: bool,
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VM state: {} vCPUs, {} RAM ranges, {} virtio transports",
            self.vcpus.len(),
            self.ram.len(),
            self.transports.len()
        )
    }
}

impl VmState {
    /// Refuses a state (from `from`, for messages) that does not fit a VM built as
    /// `layout`: RAM or memory-storage regions elsewhere in the guest-physical map (another
    /// host's address width can move them), or another number of vCPUs.
    pub(crate) fn check_fits(&self, from: &str, layout: &GuestLayout) -> Result<(), PersistError> {
        let ram: Vec<(u64, u64)> = layout.ram.iter().map(|r| (r.start, r.len)).collect();
        let pmem: Vec<u64> = layout.pmem.iter().map(|p| p.addr).collect();
        if ram != self.ram || pmem != self.pmem {
            return Err(PersistError::Layout {
                from: from.to_string(),
                saved_ram: self.ram.clone(),
                saved_pmem: self.pmem.clone(),
                ram,
                pmem,
            });
        }
        if self.vcpus.len() != layout.cpus as usize {
            return Err(PersistError::VcpuCount {
                from: from.to_string(),
                states: self.vcpus.len(),
                cpus: layout.cpus,
            });
        }
        Ok(())
    }
}

/// The devices whose state a VM saves, in a fixed order: the serial port, the PM
/// registers, then every virtio transport in creation order.
#[derive(Clone)]
pub(crate) struct DeviceSet {
    pub serial: Arc<Mutex<Serial>>,
    pub pm: Arc<Mutex<Pm>>,
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
}

impl Persist for DeviceSet {
    type State = (SerialSnapshot, PmState, Vec<TransportState>);
    type SaveArgs = ();
    type Error = PersistError;

    fn save(&self, _: &()) -> Result<Self::State, PersistError> {
        Ok((
            self.serial.save(&())?,
            self.pm.save(&())?,
            self.transports.save(&())?,
        ))
    }

    fn restore(&self, (serial, pm, transports): &Self::State) -> Result<(), PersistError> {
        self.serial.restore(serial)?;
        self.pm.restore(pm)?;
        self.transports.restore(transports)
    }
}

impl DeviceSet {
    /// Serves every doorbell the I/O thread had not read when it parked, so a restored VM
    /// does not wait for a request nobody will see.
    fn serve_all(&self) {
        for t in &self.transports {
            t.lock().unwrap_or_else(|e| e.into_inner()).serve_all();
        }
    }
}

/// The parts a running VM is saved from, kept by its handles.
pub(crate) struct VmParts {
    vm_fd: Arc<kvm_ioctls::VmFd>,
    kvm: Arc<kvm_ioctls::Kvm>,
    /// The MSRs KVM says a VMM should save, asked once.
    msr_list: OnceLock<Result<Vec<u32>, kvm_ioctls::Error>>,
    devices: DeviceSet,
    /// Guest RAM's (start, length) and each memory-storage region's address, as built.
    ram: Vec<(u64, u64)>,
    pmem: Vec<u64>,
}

impl VmParts {
    pub fn new(
        vm_fd: Arc<kvm_ioctls::VmFd>,
        kvm: Arc<kvm_ioctls::Kvm>,
        devices: DeviceSet,
        layout: &GuestLayout,
    ) -> VmParts {
        VmParts {
            vm_fd,
            kvm,
            msr_list: OnceLock::new(),
            devices,
            ram: layout.ram.iter().map(|r| (r.start, r.len)).collect(),
            pmem: layout.pmem.iter().map(|p| p.addr).collect(),
        }
    }

    pub fn vm_fd(&self) -> &kvm_ioctls::VmFd {
        &self.vm_fd
    }

    pub fn devices(&self) -> &DeviceSet {
        &self.devices
    }

    /// Guest RAM's ranges: (guest-physical start, length).
    pub fn ram_ranges(&self) -> &[(u64, u64)] {
        &self.ram
    }

    /// The MSRs KVM says a VMM should save.
    pub fn msr_list(&self) -> Result<Vec<u32>, PersistError> {
        self.msr_list
            .get_or_init(|| self.kvm.get_msr_index_list().map(|l| l.as_slice().to_vec()))
            .clone()
            .map_err(PersistError::MsrList)
    }

    /// Reads every part of the paused VM behind `gate`; `clock` is the KVM clock read when
    /// it paused. The state says the VM runs ([`VmState::paused`] false).
    pub fn save(
        &self,
        gate: &PauseGate,
        control: &RunControl,
        clock: &kvm_bindings::kvm_clock_data,
    ) -> Result<VmState, PersistError> {
        self.devices.serve_all();
        let msr_list = Arc::new(self.msr_list()?);
        let vcpus = gate
            .on_each_vcpu(control, move |_, v| v.save(&msr_list))?
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let vm = InKernel(&self.vm_fd).save(clock)?;
        let (serial, pm, transports) = self.devices.save(&())?;
        Ok(VmState {
            ram: self.ram.clone(),
            pmem: self.pmem.clone(),
            vcpus,
            vm,
            serial,
            pm,
            transports,
            paused: false,
        })
    }
}
