//! The PVH boot structures: `hvm_start_info` and its memory map.
//!
//! A PVH kernel starts in 32-bit protected mode with `EBX` pointing at `hvm_start_info`;
//! that structure and the map it points to are all it knows about the machine, so they
//! are written before the vCPU first runs.

use std::mem::size_of;

use devices::GuestMemoryMmap;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info, XEN_HVM_START_MAGIC_VALUE,
};
use vm_memory::{Bytes, GuestAddress};

use super::layout::{
    E820Entry, PVH_INFO_START, PVH_MEMMAP_START, PVH_MODLIST_START, ZERO_PAGE_START,
};

/// The layout of `hvm_start_info` this code fills (no module list, no extra fields).
const START_INFO_VERSION: u32 = 1;

/// How many map entries fit between `PVH_MEMMAP_START` and the zero page.
pub const MAX_MEMMAP_ENTRIES: usize =
    (ZERO_PAGE_START - PVH_MEMMAP_START) as usize / size_of::<hvm_memmap_table_entry>();

// The start info must not run into its own memory map.
const _: () = assert!(PVH_INFO_START + size_of::<hvm_start_info>() as u64 <= PVH_MEMMAP_START);

#[derive(Debug, thiserror::Error)]
pub enum PvhError {
    #[error("the PVH memory map is empty; a guest cannot run without RAM")]
    EmptyMemoryMap,
    #[error(
        "the PVH memory map has {entries} entries, but only {max} fit between {PVH_MEMMAP_START:#x} and the zero page at {ZERO_PAGE_START:#x}"
    )]
    TooManyEntries { entries: usize, max: usize },
    #[error("writing hvm_start_info at {PVH_INFO_START:#x} and its memory map: {0}")]
    Write(#[source] linux_loader::configurator::Error),
    #[error("adding the initrd to the PVH module list at {PVH_MODLIST_START:#x}: {0}")]
    Module(#[source] vm_memory::GuestMemoryError),
}

/// Writes `hvm_start_info` at `PVH_INFO_START` and the memory map at `PVH_MEMMAP_START`.
///
/// Entry types are the E820 ones (`E820Kind` values), not Xen's own numbering: Linux's
/// PVH entry copies them into its E820 table unchanged, so type 12 reaches it as legacy
/// persistent memory, which is what makes it create `/dev/pmemN`.
pub fn write_start_info(
    mem: &GuestMemoryMmap,
    e820: &[E820Entry],
    cmdline_addr: u64,
    rsdp: Option<u64>,
) -> Result<(), PvhError> {
    if e820.is_empty() {
        return Err(PvhError::EmptyMemoryMap);
    }
    if e820.len() > MAX_MEMMAP_ENTRIES {
        return Err(PvhError::TooManyEntries {
            entries: e820.len(),
            max: MAX_MEMMAP_ENTRIES,
        });
    }

    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind as u32,
            reserved: 0,
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: START_INFO_VERSION,
        cmdline_paddr: cmdline_addr,
        rsdp_paddr: rsdp.unwrap_or(0),
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };

    let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    PvhBootConfigurator::write_bootparams(&params, mem).map_err(PvhError::Write)
}

/// Lists the initrd (`paddr`, `size`) as the one PVH module of the start info already
/// written: a PVH Linux finds its initrd there, not in `boot_params`.
pub fn add_initrd_module(mem: &GuestMemoryMmap, paddr: u64, size: u64) -> Result<(), PvhError> {
    let module = hvm_modlist_entry {
        paddr,
        size,
        ..Default::default()
    };
    mem.write_obj(module, GuestAddress(PVH_MODLIST_START))
        .map_err(PvhError::Module)?;
    let mut info: hvm_start_info = mem
        .read_obj(GuestAddress(PVH_INFO_START))
        .map_err(PvhError::Module)?;
    info.nr_modules = 1;
    info.modlist_paddr = PVH_MODLIST_START;
    mem.write_obj(info, GuestAddress(PVH_INFO_START))
        .map_err(PvhError::Module)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{e820_map, E820Kind, CMDLINE_START};

    fn guest_mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap()
    }

    fn read_back(mem: &GuestMemoryMmap) -> (hvm_start_info, Vec<hvm_memmap_table_entry>) {
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        let entries = (0..u64::from(info.memmap_entries))
            .map(|i| {
                let addr = info.memmap_paddr + i * size_of::<hvm_memmap_table_entry>() as u64;
                mem.read_obj(GuestAddress(addr)).unwrap()
            })
            .collect();
        (info, entries)
    }

    #[test]
    fn start_info_and_map_read_back() {
        let mem = guest_mem();
        let mut map = e820_map(64 << 20);
        map.push(E820Entry {
            addr: 0x1_0000_0000,
            size: 1 << 30,
            kind: E820Kind::Pmem,
        });
        write_start_info(&mem, &map, CMDLINE_START, None).unwrap();

        let (info, entries) = read_back(&mem);
        assert_eq!(info.magic, 0x336e_c578);
        assert_eq!(info.version, 1);
        assert_eq!(info.flags, 0);
        assert_eq!(info.nr_modules, 0);
        assert_eq!(info.modlist_paddr, 0);
        assert_eq!(info.cmdline_paddr, CMDLINE_START);
        assert_eq!(info.rsdp_paddr, 0);
        assert_eq!(info.memmap_paddr, PVH_MEMMAP_START);
        assert_eq!(entries.len(), map.len());
        for (got, want) in entries.iter().zip(&map) {
            assert_eq!(
                (got.addr, got.size, got.type_, got.reserved),
                (want.addr, want.size, want.kind as u32, 0)
            );
        }
        assert_eq!(entries.last().unwrap().type_, 12);
    }

    #[test]
    fn rsdp_is_passed_on() {
        let mem = guest_mem();
        write_start_info(&mem, &e820_map(64 << 20), CMDLINE_START, Some(0xe0000)).unwrap();
        assert_eq!(read_back(&mem).0.rsdp_paddr, 0xe0000);
    }

    #[test]
    fn the_largest_map_stops_short_of_the_zero_page() {
        let mem = guest_mem();
        let entry = E820Entry {
            addr: 0,
            size: 0x1000,
            kind: E820Kind::Ram,
        };
        // Something recognisable in the zero page must survive the largest map.
        mem.write_obj(0xdead_beef_u32, GuestAddress(ZERO_PAGE_START))
            .unwrap();
        let map = vec![entry; MAX_MEMMAP_ENTRIES];
        write_start_info(&mem, &map, CMDLINE_START, None).unwrap();
        assert_eq!(read_back(&mem).1.len(), MAX_MEMMAP_ENTRIES);
        let zero_page: u32 = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!(zero_page, 0xdead_beef);

        let map = vec![entry; MAX_MEMMAP_ENTRIES + 1];
        let err = write_start_info(&mem, &map, CMDLINE_START, None).unwrap_err();
        assert!(matches!(err, PvhError::TooManyEntries { entries, max }
            if entries == MAX_MEMMAP_ENTRIES + 1 && max == MAX_MEMMAP_ENTRIES));
        assert!(err.to_string().contains("0x7000"), "{err}");
    }

    #[test]
    fn empty_map_is_an_error() {
        let mem = guest_mem();
        assert!(matches!(
            write_start_info(&mem, &[], CMDLINE_START, None),
            Err(PvhError::EmptyMemoryMap)
        ));
    }

    #[test]
    fn missing_memory_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        assert!(matches!(
            write_start_info(&mem, &e820_map(64 << 20), CMDLINE_START, None),
            Err(PvhError::Write(_))
        ));
    }

    #[test]
    fn initrd_becomes_the_one_module() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        write_start_info(&mem, &e820_map(64 << 20), CMDLINE_START, None).unwrap();
        add_initrd_module(&mem, 0x300_0000, 0x12_3000).unwrap();
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC_VALUE);
        assert_eq!(
            (info.nr_modules, info.modlist_paddr),
            (1, PVH_MODLIST_START)
        );
        let m: hvm_modlist_entry = mem.read_obj(GuestAddress(PVH_MODLIST_START)).unwrap();
        assert_eq!((m.paddr, m.size), (0x300_0000, 0x12_3000));
        assert_eq!(info.memmap_entries as usize, e820_map(64 << 20).len());
    }
}
