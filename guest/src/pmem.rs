//! Memory storage (VMMS): persistent-memory regions the guest reaches with loads and stores.
//!
//! Two ways to learn of them: E820 type-12 ranges in the PVH memory map (Musubi's default,
//! `--pmem ...,advertise=e820`), and virtio-pmem devices (device id 27, `advertise=virtio`)
//! whose configuration space gives `start` and `size`. Regions are numbered E820 ranges first,
//! then virtio-pmem devices in command-line order. Every region is identity-mapped
//! user-accessible and write-back (normal memory: it is RAM-backed on the host), so user
//! tasks read and write it directly. Durability: an E820 region needs nothing (the host maps
//! the file shared); a virtio-pmem region is flushed with the device's flush request.

use crate::bootinfo::BootInfo;
use crate::global::Global;
use crate::{kprintln, paging, virtio};

pub const MAX_REGIONS: usize = 8;

#[derive(Clone, Copy)]
pub struct Region {
    pub base: u64,
    pub size: u64,
    /// virtio-pmem device index, or `None` for an E820 range.
    pub dev: Option<usize>,
}

const NONE: Region = Region {
    base: 0,
    size: 0,
    dev: None,
};

static REGIONS: Global<([Region; MAX_REGIONS], usize)> = Global::new(([NONE; MAX_REGIONS], 0));

/// Collects the regions (after `virtio::probe_all`) and maps them.
pub fn init(info: &BootInfo) {
    // SAFETY: boot, on the BSP alone: nothing else can hold a reference to REGIONS yet.
    let (list, n) = unsafe { REGIONS.get() };
    let e820 = info.memmap().iter().filter(|e| e.kind == 12 && e.size > 0);
    let virt = (0..virtio::pmem_count())
        .filter_map(|j| virtio::pmem_region(j).map(|(base, size)| (base, size, j)));
    let all = e820
        .map(|e| (e.addr, e.size, None))
        .chain(virt.map(|(b, s, j)| (b, s, Some(j))));
    for (base, size, dev) in all {
        if *n == MAX_REGIONS {
            kprintln!("probe: more than {} memory-storage regions", MAX_REGIONS);
            break;
        }
        if size == 0 || !paging::map_identity(base, size) {
            kprintln!(
                "probe: memory storage {:#x}+{:#x} cannot be mapped",
                base,
                size
            );
            continue;
        }
        list[*n] = Region { base, size, dev };
        kprintln!(
            "probe: memory storage {}: {:#x}+{:#x} ({})",
            *n,
            base,
            size,
            if dev.is_some() {
                "virtio-pmem"
            } else {
                "e820 type 12"
            }
        );
        *n += 1;
    }
}

pub fn count() -> usize {
    // SAFETY: REGIONS is written only by `init` at boot; later uses only copy values out.
    unsafe { REGIONS.get().1 }
}

pub fn region(i: usize) -> Option<Region> {
    // SAFETY: as in `count`.
    (i < count()).then(|| unsafe { REGIONS.get().0[i] })
}

/// Makes the region durable: a flush request for virtio-pmem (returns true), nothing for an
/// E820 region (false).
pub fn flush(i: usize) -> Result<bool, crate::abi::Error> {
    match region(i).ok_or(crate::abi::Error::BadFd)?.dev {
        Some(j) => virtio::pmem_flush(j).map(|_| true),
        None => Ok(false),
    }
}
