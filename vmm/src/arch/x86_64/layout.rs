//! Where everything sits in guest-physical memory (see `docs/platform.md`).

/// First byte above the real-mode RAM; the MP table takes the last KiB below it.
pub const EBDA_START: u64 = 0x9fc00;
/// Where Intel MP tables are found by every guest that scans the last KiB of base memory.
pub const MPTABLE_START: u64 = EBDA_START;
/// Start of the legacy VGA/ROM hole; nothing in `0xa0000..0x100000` is RAM to the guest.
pub const LEGACY_HOLE_START: u64 = 0xa0000;
/// Kernels load here.
pub const HIGH_MEMORY_START: u64 = 0x10_0000;

/// Boot GDT for the 64-bit Linux entry.
pub const BOOT_GDT_START: u64 = 0x500;
/// The PVH module list (the initrd), below the start info.
pub const PVH_MODLIST_START: u64 = 0x5f00;
/// PVH start info, followed by its memory map.
pub const PVH_INFO_START: u64 = 0x6000;
pub const PVH_MEMMAP_START: u64 = 0x6040;
/// Linux `boot_params` (the "zero page").
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Identity page tables for the 64-bit Linux entry (PML4, PDPT, PD).
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
pub const CMDLINE_MAX_SIZE: usize = 4096;
/// Initial stack for the 64-bit Linux entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;

/// The 32-bit MMIO hole: RAM stops here and resumes at 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// virtio-mmio device `i` is at `VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE`, IRQ `VIRTIO_IRQ_BASE + i`.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// The last IOAPIC pin a device may use (KVM's IOAPIC has 24).
pub const MAX_IRQ: u32 = 23;
pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const APIC_START: u64 = 0xfee0_0000;

/// E820 entry types (ACPI spec, "Address Range Types").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum E820Kind {
    Ram = 1,
    Reserved = 2,
    /// Legacy persistent memory; Linux makes `/dev/pmemN` of it.
    Pmem = 12,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: E820Kind,
}

/// The guest-physical RAM ranges for `ram_size` bytes of RAM: below the MMIO hole first,
/// the rest from 4 GiB up.
pub fn ram_ranges(ram_size: u64) -> Vec<(u64, u64)> {
    if ram_size <= MMIO_HOLE_START {
        vec![(0, ram_size)]
    } else {
        vec![
            (0, MMIO_HOLE_START),
            (MMIO_HOLE_END, ram_size - MMIO_HOLE_START),
        ]
    }
}

/// The firmware memory map a guest with `ram_size` bytes of RAM is given.
pub fn e820_map(ram_size: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820Kind::Ram,
        },
        E820Entry {
            addr: EBDA_START,
            size: LEGACY_HOLE_START - EBDA_START,
            kind: E820Kind::Reserved,
        },
    ];
    for (start, len) in ram_ranges(ram_size) {
        // Low RAM below 1 MiB is already described above.
        let lo = start.max(HIGH_MEMORY_START);
        let hi = start + len;
        if hi > lo {
            map.push(E820Entry {
                addr: lo,
                size: hi - lo,
                kind: E820Kind::Ram,
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn small_vm_has_low_ram_only() {
        let map = e820_map(256 * MIB);
        assert_eq!(map.len(), 3);
        assert_eq!(map[2].addr, HIGH_MEMORY_START);
        assert_eq!(map[2].size, 256 * MIB - HIGH_MEMORY_START);
        let ram: u64 = map
            .iter()
            .filter(|e| e.kind == E820Kind::Ram)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram, 256 * MIB - (HIGH_MEMORY_START - EBDA_START));
    }

    #[test]
    fn large_vm_splits_around_the_hole() {
        let map = e820_map(4 * GIB);
        assert_eq!(ram_ranges(4 * GIB), vec![(0, 3 * GIB), (4 * GIB, GIB)]);
        let last = map.last().unwrap();
        assert_eq!((last.addr, last.size), (4 * GIB, GIB));
        assert_eq!(map[2].addr + map[2].size, MMIO_HOLE_START);
        for e in &map {
            assert!(e.addr + e.size <= MMIO_HOLE_START || e.addr >= MMIO_HOLE_END);
        }
    }
}
