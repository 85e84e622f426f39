//! Where the regions go: guest-physical addresses above RAM, clear of the MMIO hole and
//! within the guest's physical address width.

use super::{describe_size, MIB};
use crate::arch::x86_64::layout::{ram_ranges, MMIO_HOLE_END, MMIO_HOLE_START};

/// Why regions cannot go where asked; each names the region by its index.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("region {index}: {size} bytes is not a positive multiple of 2 MiB")]
    Size { index: usize, size: u64 },
    #[error(
        "region {index} ({}) would end at {end:#x}, past the guest's {phys_bits}-bit \
         physical address space; use fewer or smaller regions",
        describe_size(*.size)
    )]
    PastAddressWidth {
        index: usize,
        size: u64,
        end: u128,
        phys_bits: u8,
    },
    #[error("region {index} at {start:#x}, {size:#x} bytes, is not 2 MiB aligned")]
    Unaligned { index: usize, start: u64, size: u64 },
    #[error("region {index} at {start:#x} wraps the address space")]
    Wraps { index: usize, start: u64 },
    #[error("region {index} at {start:#x}..{end:#x} overlaps {what} at {a:#x}..{b:#x}")]
    Overlaps {
        index: usize,
        start: u64,
        end: u64,
        what: Occupant,
        a: u64,
        b: u64,
    },
}

/// What already holds a stretch of guest-physical addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occupant {
    Ram,
    MmioHole,
    Region(usize),
}

impl std::fmt::Display for Occupant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Occupant::Ram => f.write_str("guest RAM"),
            Occupant::MmioHole => f.write_str("the 32-bit MMIO hole"),
            Occupant::Region(i) => write!(f, "region {i}"),
        }
    }
}

/// Alignment of every region's start and size (see the module comment of `pmem`).
pub const PMEM_ALIGN: u64 = 2 * MIB;

/// Where each region goes, given guest RAM and the region sizes in order: from the first
/// 2 MiB boundary above RAM, one after another, jumping over the 32-bit MMIO hole, and never
/// past the guest's physical address width.
pub fn place(ram_size: u64, sizes: &[u64], phys_bits: u8) -> Result<Vec<u64>, PlaceError> {
    let ram_end = ram_ranges(ram_size)
        .iter()
        .map(|&(a, l)| a + l)
        .max()
        .unwrap_or(0);
    let limit = 1u128 << phys_bits.min(64);
    let mut cursor = ram_end.next_multiple_of(PMEM_ALIGN);
    let mut out = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        if size == 0 || !size.is_multiple_of(PMEM_ALIGN) {
            return Err(PlaceError::Size { index: i, size });
        }
        if cursor < MMIO_HOLE_END && cursor.saturating_add(size) > MMIO_HOLE_START {
            cursor = MMIO_HOLE_END;
        }
        let end = u128::from(cursor) + u128::from(size);
        if end > limit {
            return Err(PlaceError::PastAddressWidth {
                index: i,
                size,
                end,
                phys_bits,
            });
        }
        out.push(cursor);
        cursor = (end as u64).next_multiple_of(PMEM_ALIGN);
    }
    check_layout(
        ram_size,
        &out.iter()
            .copied()
            .zip(sizes.iter().copied())
            .collect::<Vec<_>>(),
    )?;
    Ok(out)
}

/// Checks that regions (start, size) are aligned and overlap neither RAM, the MMIO hole nor
/// each other. `place` only produces layouts that pass; this is the statement of what
/// "never overlapping" means, kept apart so it can be tested on its own.
pub fn check_layout(ram_size: u64, regions: &[(u64, u64)]) -> Result<(), PlaceError> {
    let mut taken: Vec<(u64, u64, Occupant)> = ram_ranges(ram_size)
        .into_iter()
        .map(|(a, l)| (a, a + l, Occupant::Ram))
        .collect();
    taken.push((MMIO_HOLE_START, MMIO_HOLE_END, Occupant::MmioHole));
    for (i, &(start, size)) in regions.iter().enumerate() {
        if !start.is_multiple_of(PMEM_ALIGN) || !size.is_multiple_of(PMEM_ALIGN) || size == 0 {
            return Err(PlaceError::Unaligned {
                index: i,
                start,
                size,
            });
        }
        let end = start
            .checked_add(size)
            .ok_or(PlaceError::Wraps { index: i, start })?;
        for &(a, b, what) in &taken {
            if start < b && a < end {
                return Err(PlaceError::Overlaps {
                    index: i,
                    start,
                    end,
                    what,
                    a,
                    b,
                });
            }
        }
        taken.push((start, end, Occupant::Region(i)));
    }
    Ok(())
}

/// The guest's physical address width, as the host CPU reports it (CPUID 0x80000008), which
/// KVM passes on to the guest.
pub fn host_phys_bits() -> u8 {
    let max = std::arch::x86_64::__cpuid(0x8000_0000).eax;
    if max < 0x8000_0008 {
        return 36;
    }
    (std::arch::x86_64::__cpuid(0x8000_0008).eax & 0xff) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn regions_go_above_ram_on_2mib_boundaries() {
        assert_eq!(place(32 * MIB, &[2 * MIB], 46).unwrap(), vec![32 * MIB]);
        // RAM that is not a 2 MiB multiple: the region starts at the next boundary.
        assert_eq!(
            place(33 * MIB, &[2 * MIB, 4 * MIB], 46).unwrap(),
            vec![34 * MIB, 36 * MIB]
        );
        assert_eq!(
            place(512 * MIB, &[64 * MIB, 2 * MIB, 8 * MIB], 46).unwrap(),
            vec![512 * MIB, 576 * MIB, 578 * MIB]
        );
    }

    #[test]
    fn regions_jump_over_the_mmio_hole() {
        // Fits below the hole exactly.
        assert_eq!(place(2 * GIB, &[GIB], 46).unwrap(), vec![2 * GIB]);
        // Would run into it: goes to 4 GiB, and the next one follows.
        assert_eq!(
            place(2 * GIB, &[GIB + 2 * MIB, 2 * MIB], 46).unwrap(),
            vec![4 * GIB, 5 * GIB + 2 * MIB]
        );
        // A second one that would cross into the hole also jumps.
        assert_eq!(
            place(2 * GIB, &[GIB - 2 * MIB, 4 * MIB], 46).unwrap(),
            vec![2 * GIB, 4 * GIB]
        );
        // RAM reaching the hole: regions start after high RAM.
        assert_eq!(place(4 * GIB, &[2 * MIB], 46).unwrap(), vec![5 * GIB]);
        for (ram, sizes) in [
            (32 * MIB, vec![2 * MIB, 2 * MIB]),
            (3 * GIB, vec![2 * MIB]),
            (6 * GIB, vec![GIB, 2 * MIB]),
            (GIB + MIB, vec![2 * GIB, 2 * MIB]),
        ] {
            let addrs = place(ram, &sizes, 46).unwrap();
            let regions: Vec<_> = addrs.into_iter().zip(sizes).collect();
            check_layout(ram, &regions).unwrap();
        }
    }

    #[test]
    fn placement_respects_the_physical_address_width() {
        let e = place(32 * MIB, &[64 * GIB], 36).unwrap_err().to_string();
        assert!(e.contains("36-bit"), "{e}");
        place(32 * MIB, &[32 * GIB], 36).unwrap();
    }

    #[test]
    fn overlaps_are_named() {
        let e = check_layout(64 * MIB, &[(32 * MIB, 2 * MIB)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("guest RAM"), "{e}");
        let e = check_layout(64 * MIB, &[(MMIO_HOLE_START - 2 * MIB, 4 * MIB)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MMIO hole"), "{e}");
        let e = check_layout(64 * MIB, &[(64 * MIB, 4 * MIB), (66 * MIB, 2 * MIB)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("region 0"), "{e}");
        let e = check_layout(64 * MIB, &[(65 * MIB, 2 * MIB)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("aligned"), "{e}");
        check_layout(64 * MIB, &[(64 * MIB, 2 * MIB), (66 * MIB, 2 * MIB)]).unwrap();
    }
}
