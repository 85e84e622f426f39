//! Which guest RAM pages changed since the last look, for a live migration's pre-copy
//! rounds: KVM's dirty log gives the guest's own stores (and KVM's, such as the KVM clock
//! page), and the guest memory's bitmap gives the VMM's (used rings, received frames, block
//! reads), which KVM never sees.

use crate::vstate::memory::GuestRam;
use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use std::sync::{Arc, Mutex};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::GuestMemoryBackend;

const PAGE: u64 = 4096;

/// Why dirty-page tracking could not be turned on or off, or read.
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error("KVM_SET_USER_MEMORY_REGION (dirty logging {}) on slot {slot}: {source}", if *.on { "on" } else { "off" })]
    SetLogging {
        on: bool,
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_DIRTY_LOG on slot {slot}: {source}")]
    GetLog {
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("dirty-page tracking is off")]
    Off,
}

/// Dirty-page tracking over guest RAM's KVM memory slots; off until [`DirtyLog::start`].
pub struct DirtyLog {
    vm_fd: Arc<VmFd>,
    ram: Arc<GuestRam>,
    /// Guest RAM's slots as registered, region for region of `ram`.
    slots: Vec<kvm_userspace_memory_region>,
    on: Mutex<bool>,
}

impl DirtyLog {
    pub fn new(
        vm_fd: Arc<VmFd>,
        ram: Arc<GuestRam>,
        slots: Vec<kvm_userspace_memory_region>,
    ) -> DirtyLog {
        DirtyLog {
            vm_fd,
            ram,
            slots,
            on: Mutex::new(false),
        }
    }

    fn set_logging(&self, on: bool) -> Result<(), DirtyLogError> {
        set_logging(&self.vm_fd, &self.slots, on)
    }

    /// Turns tracking on: from here every page written, by the guest or the VMM, is
    /// reported once by the next [`DirtyLog::take`]. Earlier writes are forgotten.
    pub fn start(&self) -> Result<(), DirtyLogError> {
        let mut on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        for region in self.ram.memory().iter() {
            bitmap(region).reset();
        }
        self.set_logging(true)?;
        *on = true;
        Ok(())
    }

    /// Guest-physical addresses of the pages written since [`DirtyLog::start`] or the last
    /// call, in order; each call starts a new interval.
    pub fn take(&self) -> Result<Vec<u64>, DirtyLogError> {
        let on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        if !*on {
            return Err(DirtyLogError::Off);
        }
        let mut out = Vec::new();
        for (s, region) in self.slots.iter().zip(self.ram.memory().iter()) {
            for offset in dirty_offsets(&self.vm_fd, s, region)? {
                out.push(s.guest_phys_addr + offset);
            }
        }
        Ok(out)
    }

    /// Turns tracking off (a migration that failed before the switch).
    pub fn stop(&self) -> Result<(), DirtyLogError> {
        let mut on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        if *on {
            self.set_logging(false)?;
            *on = false;
        }
        Ok(())
    }
}

/// Sets or clears KVM's dirty logging on each of `slots`, as registered otherwise.
fn set_logging(
    vm_fd: &VmFd,
    slots: &[kvm_userspace_memory_region],
    on: bool,
) -> Result<(), DirtyLogError> {
    for s in slots {
        let slot = kvm_userspace_memory_region {
            flags: (s.flags & !KVM_MEM_LOG_DIRTY_PAGES)
                | if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
            ..*s
        };
        // SAFETY: the same slot, guest range and host mapping as registered (which the VM
        // keeps for as long as its fd lives); only the logging flag changes.
        unsafe { vm_fd.set_user_memory_region(slot) }.map_err(|source| {
            DirtyLogError::SetLogging {
                on,
                slot: s.slot,
                source,
            }
        })?;
    }
    Ok(())
}

/// Offsets in slot `s` of the pages written since the last look: KVM's log (the guest's
/// stores) joined with `region`'s bitmap (the VMM's), both reset.
fn dirty_offsets(
    vm_fd: &VmFd,
    s: &kvm_userspace_memory_region,
    region: &devices::GuestRegionMmap,
) -> Result<Vec<u64>, DirtyLogError> {
    let kvm = vm_fd
        .get_dirty_log(s.slot, s.memory_size as usize)
        .map_err(|source| DirtyLogError::GetLog {
            slot: s.slot,
            source,
        })?;
    let vmm = bitmap(region).get_and_reset();
    let mut out = Vec::new();
    for i in 0..kvm.len().max(vmm.len()) {
        let mut w = kvm.get(i).copied().unwrap_or(0) | vmm.get(i).copied().unwrap_or(0);
        while w != 0 {
            let bit = w.trailing_zeros() as u64;
            w &= w - 1;
            let offset = (i as u64 * 64 + bit) * PAGE;
            if offset < s.memory_size {
                out.push(offset);
            }
        }
    }
    Ok(out)
}

/// Dirty-page tracking over the writable memory-storage regions' KVM slots, for a replica:
/// their pages are not guest RAM, so a pre-copy migration (whose destination opens the same
/// files) never asks for them. Off until [`PmemDirtyLog::start`].
pub struct PmemDirtyLog {
    vm_fd: Arc<VmFd>,
    /// Each tracked region: its index among the `--pmem` regions, its slot as registered
    /// and its mapping.
    regions: Vec<(usize, kvm_userspace_memory_region, crate::pmem::PmemRegion)>,
    on: Mutex<bool>,
}

impl PmemDirtyLog {
    /// Tracks the writable regions of `regions` that have a KVM slot (a read-only region's
    /// guest stores never reach its file).
    pub fn new(vm_fd: Arc<VmFd>, regions: &[crate::pmem::PmemRegion]) -> PmemDirtyLog {
        let regions = regions
            .iter()
            .filter(|r| !r.config.readonly)
            .filter_map(|r| {
                let slot = kvm_userspace_memory_region {
                    slot: r.slot?,
                    flags: 0,
                    guest_phys_addr: r.guest_addr,
                    memory_size: r.size,
                    userspace_addr: r.host_addr() as u64,
                };
                Some((r.index, slot, r.clone()))
            })
            .collect();
        PmemDirtyLog {
            vm_fd,
            regions,
            on: Mutex::new(false),
        }
    }

    fn slots(&self) -> Vec<kvm_userspace_memory_region> {
        self.regions.iter().map(|r| r.1).collect()
    }

    /// Turns tracking on; earlier writes are forgotten.
    pub fn start(&self) -> Result<(), DirtyLogError> {
        let mut on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        for (_, _, r) in &self.regions {
            bitmap(r.mapping()).reset();
        }
        set_logging(&self.vm_fd, &self.slots(), true)?;
        *on = true;
        Ok(())
    }

    /// (region index, offset in the region) of each page written since
    /// [`PmemDirtyLog::start`] or the last call, in order.
    pub fn take(&self) -> Result<Vec<(usize, u64)>, DirtyLogError> {
        let on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        // A VM without writable regions has nothing to track, started or not.
        if !*on && !self.regions.is_empty() {
            return Err(DirtyLogError::Off);
        }
        let mut out = Vec::new();
        for (index, s, r) in &self.regions {
            out.extend(
                dirty_offsets(&self.vm_fd, s, r.mapping())?
                    .into_iter()
                    .map(|o| (*index, o)),
            );
        }
        Ok(out)
    }

    /// Turns tracking off.
    pub fn stop(&self) -> Result<(), DirtyLogError> {
        let mut on = self.on.lock().unwrap_or_else(|e| e.into_inner());
        if *on {
            set_logging(&self.vm_fd, &self.slots(), false)?;
            *on = false;
        }
        Ok(())
    }
}

/// The VMM-side dirty bitmap of one RAM region (the mapping's own, not a slice of it).
fn bitmap(region: &devices::GuestRegionMmap) -> &AtomicBitmap {
    std::ops::Deref::deref(region).bitmap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pmem::test_files::{cfg, file_of};
    use crate::pmem::PmemRegions;
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_vm_without_regions_has_no_pmem_pages_to_report_started_or_not() {
        let vm = Arc::new(kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap());
        let log = PmemDirtyLog::new(vm, &[]);
        assert_eq!(log.take().unwrap(), vec![]);
        log.start().unwrap();
        assert_eq!(log.take().unwrap(), vec![]);
        log.stop().unwrap();
    }

    #[test]
    fn pmem_pages_the_vmm_writes_are_reported_once_by_region_and_offset() {
        let f = file_of(2 * MIB);
        let mut p = PmemRegions::open(&[cfg(f.path())], 32 * MIB, &[], 46).unwrap();
        let vm = Arc::new(kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap());
        let r = &mut p.regions[0];
        let slot = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: r.guest_addr,
            memory_size: r.size,
            userspace_addr: r.host_addr() as u64,
        };
        // SAFETY: the region's mapping outlives the VM fd (both end with this test, the
        // regions after the log that holds the fd).
        unsafe { vm.set_user_memory_region(slot) }.unwrap();
        r.slot = Some(0);
        let log = PmemDirtyLog::new(vm, &p.regions);
        assert!(matches!(log.take(), Err(DirtyLogError::Off)));
        let mem = devices::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (32 * MIB) as usize)])
            .unwrap();
        let mem = p.extend_guest_memory(mem).unwrap();
        // Written before the start: forgotten.
        mem.write_slice(&[1], GuestAddress(p.regions[0].guest_addr))
            .unwrap();
        log.start().unwrap();
        mem.write_slice(&[2; 16], GuestAddress(p.regions[0].guest_addr + 8192 + 7))
            .unwrap();
        assert_eq!(log.take().unwrap(), vec![(0, 8192)]);
        assert_eq!(log.take().unwrap(), vec![]);
        log.stop().unwrap();
    }
}
