//! Guest RAM: anonymous host mappings laid out around the MMIO hole.

use crate::arch::x86_64::layout::ram_ranges;
use vm_memory::{GuestAddress, GuestMemoryMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {size} MiB of guest RAM: {source}")]
    Map {
        size: u64,
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Maps `size` bytes of RAM. Pages are only backed when the guest touches them, so the
/// VMM's resident overhead stays independent of the guest's size.
pub fn create_guest_memory(size: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let ranges: Vec<(GuestAddress, usize)> = ram_ranges(size)
        .into_iter()
        .map(|(a, l)| (GuestAddress(a), l as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Map {
        size: size >> 20,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryBackend;

    #[test]
    fn memory_has_one_region_per_range() {
        let mem = create_guest_memory(64 << 20).unwrap();
        assert_eq!(mem.num_regions(), 1);
        assert_eq!(mem.last_addr(), GuestAddress((64 << 20) - 1));
    }
}
