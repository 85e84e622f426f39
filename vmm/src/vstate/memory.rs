//! Guest RAM: the host mappings behind the layout's RAM ranges, what backs them, and which
//! host thread runs each vCPU (so a fault on guest memory can be tied to a vCPU).

use crate::arch::x86_64::layout::GuestLayout;
use devices::{GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use std::sync::{Arc, Mutex};
use vm_memory::GuestAddress;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {size} MiB of guest RAM: {source}")]
    Map {
        size: u64,
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("guest RAM mapped elsewhere must be {want} MiB (and, kept coherent across nodes, one range at 0 below the 32-bit hole); the layout has {ranges} range(s) and the shared mapping is {got} MiB")]
    SharedShape { want: u64, got: u64, ranges: usize },
    #[error("cannot use the shared guest-RAM mapping: {0}")]
    Shared(String),
}

/// What keeps guest RAM's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RamBackend {
    /// Private anonymous memory on this host, backed as the guest touches it, so the VMM's
    /// resident overhead stays independent of the guest's size. A RAM kept coherent across
    /// hosts registers the same mappings with userfaultfd instead of taking faults locally.
    Anonymous,
    /// A mapping owned by the coherence layer of a VM spread over several nodes: pages come
    /// and go as the protocol moves them, through userfaultfd.
    Coherent,
    /// A snapshot's memory file, mapped copy-on-write: pages are read from the file when
    /// the guest first touches them, and the guest's writes stay private to this VM, so a
    /// restore costs nothing per page and one snapshot can be restored many times.
    Snapshot,
    /// Anonymous memory whose pages a thread reads from a snapshot's memory file the first
    /// time they are touched, through userfaultfd (`--restore-memory ondemand`).
    OnDemand,
}

pub struct GuestRam {
    mem: GuestMemoryMmap,
    backend: RamBackend,
    /// Whatever owns a mapping made elsewhere, kept so the mapping outlives the VM.
    _owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// The file a snapshot-backed RAM was mapped from: pages the guest has not touched
    /// still hold its data though the page map shows them absent.
    source: Option<Arc<std::fs::File>>,
    /// Host thread id of each vCPU, filled in as vCPU threads start.
    vcpu_threads: Mutex<Vec<Option<i32>>>,
}

impl GuestRam {
    /// Maps the layout's RAM ranges.
    pub fn new(layout: &GuestLayout, backend: RamBackend) -> Result<Self, MemoryError> {
        let ranges: Vec<(GuestAddress, usize)> = layout
            .ram
            .iter()
            .map(|r| (GuestAddress(r.start), r.len as usize))
            .collect();
        let mem = GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Map {
            size: layout.ram_size >> 20,
            source,
        })?;
        Ok(Self {
            mem,
            backend,
            _owner: None,
            source: None,
            vcpu_threads: Mutex::new(vec![None; layout.cpus as usize]),
        })
    }

    /// Guest RAM on a mapping made elsewhere (`host..host + len`, kept alive by `owner`),
    /// the layout's RAM ranges one after the other in it: the coherence layer of a
    /// multi-node VM owns such a mapping and serves its faults, and so does a restore that
    /// reads pages on demand. `source` is the file whose data the mapping stands for, if
    /// any (see [`GuestRam::source`]).
    ///
    /// # Safety
    /// `host..host + len` must be a private anonymous read-write mapping that stays mapped for
    /// as long as `owner` lives.
    pub unsafe fn shared(
        layout: &GuestLayout,
        host: *mut u8,
        len: usize,
        owner: Arc<dyn std::any::Any + Send + Sync>,
        backend: RamBackend,
        source: Option<Arc<std::fs::File>>,
    ) -> Result<Self, MemoryError> {
        // Pages of a coherent RAM are numbered by guest-physical address, so it must be one
        // range at 0.
        let coherent_shape = layout.ram.len() == 1 && layout.ram[0].start == 0;
        if layout.ram_size != len as u64 || (backend == RamBackend::Coherent && !coherent_shape) {
            return Err(MemoryError::SharedShape {
                want: layout.ram_size >> 20,
                got: (len as u64) >> 20,
                ranges: layout.ram.len(),
            });
        }
        let mut regions = Vec::with_capacity(layout.ram.len());
        let mut offset = 0usize;
        for r in &layout.ram {
            // SAFETY: the caller guarantees the mapping and its lifetime; `owner` is kept
            // below, and the ranges' lengths add up to `len` (checked above).
            let region = unsafe {
                MmapRegion::build_raw(
                    host.add(offset),
                    r.len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                )
            }
            .map_err(|e| MemoryError::Shared(e.to_string()))?;
            regions.push(
                GuestRegionMmap::new(region, GuestAddress(r.start)).ok_or_else(|| {
                    MemoryError::Shared("the region does not fit the address space".into())
                })?,
            );
            offset += r.len as usize;
        }
        let mem = GuestMemoryMmap::from_regions(regions)
            .map_err(|e| MemoryError::Shared(e.to_string()))?;
        Ok(Self {
            mem,
            backend,
            _owner: Some(owner),
            source,
            vcpu_threads: Mutex::new(vec![None; layout.cpus as usize]),
        })
    }

    /// The layout's RAM ranges mapped copy-on-write from `file`, which holds them one after
    /// the other (a snapshot's memory file). The caller has checked the file is long enough.
    /// `prefault` reads every page in now (`MAP_POPULATE`) instead of at the guest's first
    /// touch.
    pub fn from_file(
        layout: &GuestLayout,
        file: Arc<std::fs::File>,
        prefault: bool,
    ) -> Result<Self, MemoryError> {
        let populate = if prefault { libc::MAP_POPULATE } else { 0 };
        let mut regions = Vec::with_capacity(layout.ram.len());
        let mut offset = 0u64;
        for r in &layout.ram {
            let fd =
                std::fs::File::try_clone(&file).map_err(|e| MemoryError::Shared(e.to_string()))?;
            let region = vm_memory::mmap::MmapRegionBuilder::new(r.len as usize)
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE | populate)
                .with_file_offset(vm_memory::FileOffset::new(fd, offset))
                .build()
                .map_err(|e| MemoryError::Shared(format!("mapping the memory file: {e}")))?;
            regions.push(
                GuestRegionMmap::new(region, GuestAddress(r.start)).ok_or_else(|| {
                    MemoryError::Shared("the region does not fit the address space".into())
                })?,
            );
            offset += r.len;
        }
        let mem = GuestMemoryMmap::from_regions(regions)
            .map_err(|e| MemoryError::Shared(e.to_string()))?;
        Ok(Self {
            mem,
            backend: RamBackend::Snapshot,
            _owner: None,
            source: Some(file),
            vcpu_threads: Mutex::new(vec![None; layout.cpus as usize]),
        })
    }

    /// The memory file a snapshot-backed RAM maps, if it is one.
    pub fn source(&self) -> Option<&std::fs::File> {
        self.source.as_deref()
    }

    /// The RAM mappings alone (memory storage regions are added by the builder).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    pub fn backend(&self) -> RamBackend {
        self.backend
    }

    /// Host thread id of each vCPU (None until its thread has started), so faults and
    /// profiles taken on the host can be tied to vCPUs.
    pub fn vcpu_threads(&self) -> Vec<Option<i32>> {
        self.vcpu_threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn register_vcpu_thread(&self, vcpu: u8, tid: i32) {
        let mut t = self.vcpu_threads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = t.get_mut(vcpu as usize) {
            *slot = Some(tid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::GuestLayout;
    use vm_memory::GuestMemoryBackend;

    #[test]
    fn memory_has_one_region_per_ram_range() {
        let layout = GuestLayout::new(64 << 20, 2, &[], 0, 46).unwrap();
        let ram = GuestRam::new(&layout, RamBackend::Anonymous).unwrap();
        assert_eq!(ram.memory().num_regions(), 1);
        assert_eq!(ram.memory().last_addr(), GuestAddress((64 << 20) - 1));
        let big = GuestLayout::new(4 << 30, 1, &[], 0, 46).unwrap();
        let ram = GuestRam::new(&big, RamBackend::Anonymous).unwrap();
        assert_eq!(ram.memory().num_regions(), 2);
        assert!(ram.memory().address_in_range(GuestAddress(1 << 32)));
    }

    #[test]
    fn vcpu_threads_are_recorded() {
        let layout = GuestLayout::new(16 << 20, 2, &[], 0, 46).unwrap();
        let ram = GuestRam::new(&layout, RamBackend::Anonymous).unwrap();
        ram.register_vcpu_thread(1, 4242);
        ram.register_vcpu_thread(9, 1); // no such vCPU: ignored
        assert_eq!(ram.vcpu_threads(), vec![None, Some(4242)]);
        assert_eq!(ram.backend(), RamBackend::Anonymous);
    }
}
