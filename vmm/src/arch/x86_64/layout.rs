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

/// One range of guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRange {
    pub start: u64,
    pub len: u64,
}

/// Where one memory-storage region sits, and whether the E820 map announces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PmemSpan {
    pub addr: u64,
    pub size: u64,
    pub e820: bool,
}

/// One virtio-mmio device window and its interrupt line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioSlot {
    pub base: u64,
    pub gsi: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("--pmem: {0}")]
    Pmem(#[from] Box<crate::pmem::PlaceError>),
    #[error("too many virtio devices ({count}): interrupt lines {VIRTIO_IRQ_BASE} to {MAX_IRQ} hold {max}")]
    TooManyDevices { count: usize, max: usize },
}

/// The whole guest-physical map of one VM, computed once from its configuration: RAM,
/// memory-storage regions, virtio windows and where the firmware tables go. Memory
/// creation, storage mapping, the E820 map, ACPI and the MP table all read this one value,
/// and every node of a VM spread over hosts computes the same one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestLayout {
    pub ram_size: u64,
    pub cpus: u8,
    pub ram: Vec<RamRange>,
    pub pmem: Vec<PmemSpan>,
    pub virtio: Vec<VirtioSlot>,
    pub mptable: u64,
    pub acpi_rsdp: u64,
    pub cmdline: u64,
    pub pvh_start_info: u64,
    pub zero_page: u64,
}

impl GuestLayout {
    /// Lays out `ram_size` bytes of RAM, memory-storage regions of the given (size, in the
    /// E820 map) in order, and `virtio_devices` virtio-mmio windows, for a guest whose
    /// physical addresses have `phys_bits` bits.
    pub fn new(
        ram_size: u64,
        cpus: u8,
        pmem: &[(u64, bool)],
        virtio_devices: usize,
        phys_bits: u8,
    ) -> Result<Self, LayoutError> {
        let sizes: Vec<u64> = pmem.iter().map(|p| p.0).collect();
        let addrs = crate::pmem::place(ram_size, &sizes, phys_bits).map_err(Box::new)?;
        let max = (MAX_IRQ - VIRTIO_IRQ_BASE + 1) as usize;
        if virtio_devices > max {
            return Err(LayoutError::TooManyDevices {
                count: virtio_devices,
                max,
            });
        }
        Ok(Self {
            ram_size,
            cpus,
            ram: ram_ranges(ram_size)
                .into_iter()
                .map(|(start, len)| RamRange { start, len })
                .collect(),
            pmem: addrs
                .into_iter()
                .zip(pmem)
                .map(|(addr, &(size, e820))| PmemSpan { addr, size, e820 })
                .collect(),
            virtio: (0..virtio_devices as u64)
                .map(|i| VirtioSlot {
                    base: VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE,
                    gsi: VIRTIO_IRQ_BASE + i as u32,
                })
                .collect(),
            mptable: MPTABLE_START,
            acpi_rsdp: super::acpi::RSDP_START,
            cmdline: CMDLINE_START,
            pvh_start_info: PVH_INFO_START,
            zero_page: ZERO_PAGE_START,
        })
    }

    /// The firmware memory map: RAM, and the memory-storage regions announced as type 12.
    pub fn e820(&self) -> Vec<E820Entry> {
        let mut map = e820_map(self.ram_size);
        map.extend(self.pmem.iter().filter(|p| p.e820).map(|p| E820Entry {
            addr: p.addr,
            size: p.size,
            kind: E820Kind::Pmem,
        }));
        map
    }

    /// The end of RAM below the MMIO hole, where an initrd is placed under.
    pub fn low_ram_end(&self) -> u64 {
        self.ram[0].start + self.ram[0].len
    }
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
    fn one_layout_holds_ram_storage_devices_and_firmware() {
        let l =
            GuestLayout::new(512 * MIB, 2, &[(64 * MIB, true), (2 * MIB, false)], 3, 46).unwrap();
        assert_eq!(
            l.ram,
            vec![RamRange {
                start: 0,
                len: 512 * MIB
            }]
        );
        assert_eq!(l.pmem[0].addr, 512 * MIB);
        assert_eq!(l.pmem[1].addr, 576 * MIB);
        assert_eq!(
            l.virtio[2],
            VirtioSlot {
                base: VIRTIO_MMIO_BASE + 0x2000,
                gsi: 7
            }
        );
        assert_eq!(l.low_ram_end(), 512 * MIB);
        let e820 = l.e820();
        let pmem: Vec<_> = e820.iter().filter(|e| e.kind == E820Kind::Pmem).collect();
        assert_eq!(
            pmem.len(),
            1,
            "only regions advertised in E820 appear there"
        );
        assert_eq!((pmem[0].addr, pmem[0].size), (512 * MIB, 64 * MIB));
        let e = GuestLayout::new(64 * MIB, 1, &[], 40, 46).unwrap_err();
        assert!(
            e.to_string().contains("too many virtio devices (40)"),
            "{e}"
        );
        let e = GuestLayout::new(64 * MIB, 1, &[(3 * MIB, true)], 0, 46).unwrap_err();
        assert!(e.to_string().starts_with("--pmem"), "{e}");
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
