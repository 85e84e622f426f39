//! Identity page tables.
//!
//! The 32-bit boot stub (boot.rs) maps 0..4 GiB with 2 MiB pages: 2 MiB..3 GiB user
//! accessible, 3..4 GiB (the MMIO hole) kernel-only and uncached, the first 2 MiB kernel-only.
//! `init` then refines the first 2 MiB with 4 KiB pages (page 0 absent to catch null
//! pointers; kernel text and rodata readable by user tasks, which run code from the kernel
//! image; everything else kernel-only) and maps RAM above 4 GiB.

use crate::arch::{cpuid, write_cr3};
use crate::bootinfo::BootInfo;
use crate::global::Global;

pub const P: u64 = 1;
pub const RW: u64 = 1 << 1;
pub const US: u64 = 1 << 2;
pub const PS: u64 = 1 << 7;
/// Accessed and dirty, set from the start: the CPU would otherwise write them into the
/// table on first use of each page, and on a VM over several hosts every such write takes
/// the table's page away from the other nodes.
const AD: u64 = (1 << 5) | (1 << 6);

const GIB: u64 = 1 << 30;
const MIB2: u64 = 1 << 21;

#[repr(C, align(4096))]
pub struct Table(pub [u64; 512]);

/// PDs for RAM above 4 GiB when the CPU has no 1 GiB pages: covers RAM up to 20 GiB (the
/// image must end below 2 MiB, and each CPU's page of its own, each device driver and
/// smoltcp's segmentation offload, which needs its IPv6 too, take room); RAM past that goes
/// unmapped, and the memory map the tasks see ends there.
const POOL_PDS: usize = 16;

#[link_section = ".noinit.pml4"]
pub static PML4: Global<Table> = Global::new(Table([0; 512]));
#[link_section = ".noinit.pdpt"]
pub static PDPT: Global<Table> = Global::new(Table([0; 512]));
#[link_section = ".noinit.pds"]
pub static PDS: Global<[Table; 4]> = Global::new([const { Table([0; 512]) }; 4]);
#[link_section = ".noinit.pt0"]
static PT0: Global<Table> = Global::new(Table([0; 512]));
#[link_section = ".noinit.pool"]
static POOL: Global<[Table; POOL_PDS]> = Global::new([const { Table([0; 512]) }; POOL_PDS]);

extern "C" {
    static __kernel_start: u8;
    static __user_ro_end: u8;
}

pub fn user_ro_range() -> (u64, u64) {
    (
        core::ptr::addr_of!(__kernel_start) as u64,
        core::ptr::addr_of!(__user_ro_end) as u64,
    )
}

/// Returns the end of the identity mapping of RAM.
pub fn init(info: &BootInfo) -> u64 {
    let (ro_start, ro_end) = user_ro_range();
    // SAFETY: boot-time, single CPU, no other reference to the tables is live.
    let (pt0, pds) = unsafe { (PT0.get(), PDS.get()) };
    for (i, e) in pt0.0.iter_mut().enumerate() {
        let a = i as u64 * 4096;
        *e = if i == 0 {
            0
        } else if a >= ro_start && a < ro_end {
            a | P | US | AD
        } else {
            a | P | RW | AD
        };
    }
    pds[0].0[0] = PT0.addr() | P | RW | US | AD;

    let top = info
        .memmap()
        .iter()
        .filter(|e| e.kind == 1 || e.kind == 12)
        .map(|e| e.addr.saturating_add(e.size))
        .max()
        .unwrap_or(0);
    let gigs = top.div_ceil(GIB).min(512);
    let mut mapped_end = top.min(4 * GIB);
    for g in 4..gigs {
        let (lo, hi) = (g * GIB, (g + 1) * GIB);
        let wanted = info
            .memmap()
            .iter()
            .any(|e| (e.kind == 1 || e.kind == 12) && e.addr < hi && e.addr + e.size > lo);
        if !wanted {
            continue;
        }
        if !map_gig(g) {
            crate::kprintln!("probe: RAM above {:#x} is not mapped", lo);
            break;
        }
        mapped_end = hi.min(top);
    }
    // SAFETY: the new tables still identity-map everything the kernel uses.
    unsafe { write_cr3(PML4.addr()) };
    mapped_end
}

static USED_POOL: Global<usize> = Global::new(0);

fn has_1g_pages() -> bool {
    cpuid(0x8000_0000, 0).eax >= 0x8000_0001 && cpuid(0x8000_0001, 0).edx & (1 << 26) != 0
}

/// Identity-maps gigabyte `g` (>= 4) user-accessible, write-back. False if out of tables.
fn map_gig(g: u64) -> bool {
    // SAFETY: BSP only; no other reference to these tables is live.
    let (pdpt, pool, used) = unsafe { (PDPT.get(), POOL.get(), USED_POOL.get()) };
    if g >= 512 {
        return false;
    }
    if pdpt.0[g as usize] & P != 0 {
        return true;
    }
    let lo = g * GIB;
    if has_1g_pages() {
        pdpt.0[g as usize] = lo | P | RW | US | PS;
    } else if *used < POOL_PDS {
        let pd = &mut pool[*used];
        *used += 1;
        for (i, e) in pd.0.iter_mut().enumerate() {
            *e = (lo + i as u64 * MIB2) | P | RW | US | PS;
        }
        pdpt.0[g as usize] = pd as *const Table as u64 | P | RW | US;
    } else {
        return false;
    }
    true
}

/// Makes `[addr, addr + size)` (memory storage that the memory map did not list, e.g. a
/// virtio-pmem region) identity-mapped, user-accessible and write-back: 2 MiB pages in the
/// 32-bit hole (which the boot stub maps kernel-only and uncached), gigabytes above 4 GiB.
/// Below 3 GiB everything is mapped that way already. False if it cannot be mapped.
pub fn map_identity(addr: u64, size: u64) -> bool {
    let end = match addr.checked_add(size) {
        Some(e) if size > 0 => e,
        _ => return false,
    };
    // SAFETY: BSP only.
    let pds = unsafe { PDS.get() };
    let mut a = addr & !(MIB2 - 1);
    while a < end.min(4 * GIB) {
        if a >= 3 * GIB {
            let i = ((a - 3 * GIB) / MIB2) as usize;
            pds[3].0[i] = a | P | RW | US | PS;
        }
        a += MIB2;
    }
    for g in (4 * GIB).max(addr) / GIB..end.div_ceil(GIB) {
        if g >= 4 && !map_gig(g) {
            return false;
        }
    }
    flush_tlb();
    true
}

/// Reloads CR3: drops every non-global TLB entry.
pub fn flush_tlb() {
    // SAFETY: the same tables, still mapping the running code.
    unsafe { write_cr3(PML4.addr()) };
}

pub fn invlpg(va: u64) {
    // SAFETY: only drops a TLB entry.
    unsafe { core::arch::asm!("invlpg [{}]", in(reg) va, options(nostack, preserves_flags)) };
}

const PWT: u64 = 1 << 3;
const PCD: u64 = 1 << 4;

/// A 4 KiB table for one 2 MiB page of the MMIO hole, so that a single device register
/// page can be handed to user mode without exposing its neighbours.
#[link_section = ".noinit.mmiopt"]
static MMIO_PT: Global<Table> = Global::new(Table([0; 512]));
/// The 2 MiB page `MMIO_PT` splits (0: none yet).
static MMIO_SPLIT: Global<u64> = Global::new(0);

/// Makes the 4 KiB MMIO page at `page` (in the 3..4 GiB hole) user-accessible or, with
/// `user` false, kernel-only again; uncached either way. False if it is outside the hole or
/// in a different 2 MiB page from one split before.
pub fn set_user_mmio(page: u64, user: bool) -> bool {
    let big = page & !(MIB2 - 1);
    if !(3 * GIB..4 * GIB).contains(&page) {
        return false;
    }
    // SAFETY: the kernel path of the one task that is not a worker (a system call of it,
    // on whichever CPU it runs, or its end on the BSP, which waits meanwhile), one at a time.
    let (pds, pt, split) = unsafe { (PDS.get(), MMIO_PT.get(), MMIO_SPLIT.get()) };
    if *split != big {
        if *split != 0 {
            return false;
        }
        for (i, e) in pt.0.iter_mut().enumerate() {
            *e = (big + i as u64 * 4096) | P | RW | PWT | PCD;
        }
        pds[3].0[((big - 3 * GIB) / MIB2) as usize] = MMIO_PT.addr() | P | RW | US;
        *split = big;
        flush_tlb();
    }
    let i = ((page - big) / 4096) as usize;
    pt.0[i] = (page & !0xfff) | P | RW | PWT | PCD | if user { US } else { 0 };
    invlpg(page);
    true
}
