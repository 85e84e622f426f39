//! The KVM VM: memory slots, the in-kernel interrupt controllers and PIT, and irqfds.

use devices::GuestMemoryMmap;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VmFd};
use std::sync::Arc;
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0} (is KVM enabled, and may this user open /dev/kvm?)")]
    OpenKvm(kvm_ioctls::Error),
    #[error("KVM API version {0} is not the expected 12")]
    ApiVersion(i32),
    #[error("this host's KVM lacks {0:?}, which Musubi needs")]
    MissingCap(Cap),
    #[error("KVM_CREATE_VM failed: {0}")]
    CreateVm(kvm_ioctls::Error),
    #[error("{what} failed: {source}")]
    Ioctl {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("the VM needs {needed} memory slots but KVM offers {available}")]
    TooManySlots { needed: usize, available: usize },
}

/// Address of the three pages KVM needs for the TSS on Intel; just below the BIOS area at
/// the top of 4 GiB, where no RAM or device is placed.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

pub struct KvmVm {
    kvm: Arc<Kvm>,
    fd: Arc<VmFd>,
    next_slot: u32,
    /// Guest RAM's slots, as [`KvmVm::register_memory`] registered them.
    ram_slots: Vec<kvm_userspace_memory_region>,
}

/// Opens `/dev/kvm` and checks that it offers what Musubi needs. Apart from creating the
/// VM, so vCPU threads can start probing the host (CPUID) while the VM is created.
pub fn open_kvm() -> Result<Arc<Kvm>, VmError> {
    let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
    let v = kvm.get_api_version();
    if v != kvm_bindings::KVM_API_VERSION as i32 {
        return Err(VmError::ApiVersion(v));
    }
    for cap in [
        Cap::Irqchip,
        Cap::UserMemory,
        Cap::SetTssAddr,
        Cap::Pit2,
        Cap::Irqfd,
        Cap::Ioeventfd,
        Cap::ImmediateExit,
    ] {
        if !kvm.check_extension(cap) {
            return Err(VmError::MissingCap(cap));
        }
    }
    Ok(Arc::new(kvm))
}

impl KvmVm {
    /// Creates a VM on an opened KVM.
    pub fn create(kvm: Arc<Kvm>) -> Result<Self, VmError> {
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        fd.set_tss_address(KVM_TSS_ADDRESS)
            .map_err(|source| VmError::Ioctl {
                what: "KVM_SET_TSS_ADDR",
                source,
            })?;
        Ok(Self {
            kvm,
            fd: Arc::new(fd),
            next_slot: 0,
            ram_slots: Vec::new(),
        })
    }

    /// Creates the in-kernel IOAPIC and PIC, which must exist before any vCPU (whose LAPIC
    /// is then in the kernel too). Call it after every memory slot is registered: adding
    /// in-kernel I/O devices starts an SRCU grace period that a later
    /// KVM_SET_USER_MEMORY_REGION must wait out (milliseconds on tick-paced kernels), while
    /// slots registered first cost nothing extra. The grace period then runs while the
    /// kernel is loaded and the devices and tables are built.
    pub fn create_irqchip(&self) -> Result<(), VmError> {
        self.fd.create_irq_chip().map_err(|source| VmError::Ioctl {
            what: "KVM_CREATE_IRQCHIP",
            source,
        })
    }

    /// Creates the in-kernel PIT. Unlike the irqchip it may come after the vCPUs, and it
    /// runs under the VM lock that KVM_CREATE_VCPU also takes, so the build makes it last.
    /// Like the irqchip it adds in-kernel I/O devices, so no memory slot may follow it.
    pub fn create_pit(&self) -> Result<(), VmError> {
        let pit = kvm_pit_config {
            // The speaker port is answered in the kernel, so a guest probing it costs no exit.
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd.create_pit2(pit).map_err(|source| VmError::Ioctl {
            what: "KVM_CREATE_PIT2",
            source,
        })
    }

    pub fn kvm_arc(&self) -> Arc<Kvm> {
        self.kvm.clone()
    }

    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// A shared handle, for parts that inject interrupts from other threads.
    pub fn shared_fd(&self) -> Arc<VmFd> {
        self.fd.clone()
    }

    /// Guest RAM's memory slots (for dirty logging).
    pub fn ram_slots(&self) -> &[kvm_userspace_memory_region] {
        &self.ram_slots
    }

    /// Registers every region of `mem`, guest RAM, as a KVM memory slot.
    pub fn register_memory(&mut self, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        let available = self.kvm.get_nr_memslots();
        let needed = self.next_slot as usize + mem.num_regions();
        if needed > available {
            return Err(VmError::TooManySlots { needed, available });
        }
        for region in mem.iter() {
            let slot = kvm_userspace_memory_region {
                slot: self.next_slot,
                flags: 0,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the region's host mapping lives in `mem`, which the VM keeps for as
            // long as the VM fd exists (the builder owns both and drops the VM first).
            unsafe { self.fd.set_user_memory_region(slot) }.map_err(|source| VmError::Ioctl {
                what: "KVM_SET_USER_MEMORY_REGION",
                source,
            })?;
            self.ram_slots.push(slot);
            self.next_slot += 1;
        }
        Ok(())
    }

    /// Has KVM signal `fd` instead of exiting to user space when the guest writes the 32-bit
    /// value `datamatch` to MMIO address `addr`.
    pub fn register_ioevent(&self, fd: &EventFd, addr: u64, datamatch: u32) -> Result<(), VmError> {
        self.fd
            .register_ioevent(fd, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(|source| VmError::Ioctl {
                what: "KVM_IOEVENTFD",
                source,
            })
    }

    /// Memory slots registered so far.
    pub fn slots_in_use(&self) -> usize {
        self.next_slot as usize
    }

    /// Registers one host mapping as the next memory slot. With `readonly`, guest stores to
    /// it exit to user space as MMIO writes instead of changing the memory.
    ///
    /// # Safety
    /// `host_addr..host_addr + size` must be a mapping that outlives the VM fd.
    pub unsafe fn add_memory_slot(
        &mut self,
        guest_addr: u64,
        size: u64,
        host_addr: u64,
        readonly: bool,
    ) -> Result<u32, VmError> {
        let available = self.kvm.get_nr_memslots();
        if self.next_slot as usize >= available {
            return Err(VmError::TooManySlots {
                needed: self.next_slot as usize + 1,
                available,
            });
        }
        let slot = kvm_userspace_memory_region {
            slot: self.next_slot,
            flags: if readonly {
                kvm_bindings::KVM_MEM_READONLY
            } else {
                0
            },
            guest_phys_addr: guest_addr,
            memory_size: size,
            userspace_addr: host_addr,
        };
        // SAFETY: the caller keeps the mapping alive for as long as the VM fd.
        unsafe { self.fd.set_user_memory_region(slot) }.map_err(|source| VmError::Ioctl {
            what: "KVM_SET_USER_MEMORY_REGION",
            source,
        })?;
        self.next_slot += 1;
        Ok(self.next_slot - 1)
    }

    /// Routes an eventfd to an IOAPIC pin: a write then raises the interrupt without any
    /// return to user space.
    pub fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd
            .register_irqfd(fd, gsi)
            .map_err(|source| VmError::Ioctl {
                what: "KVM_IRQFD",
                source,
            })
    }
}
