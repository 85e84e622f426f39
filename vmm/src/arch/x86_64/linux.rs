//! The Linux x86 boot protocol with the 64-bit entry point.
//!
//! Used for bzImages and for ELF vmlinux files that lack a PVH note. The kernel is
//! entered directly in long mode, which skips the real-mode setup code and any BIOS
//! services it would call: the zero page (`boot_params`) carries everything the setup code
//! would otherwise have gathered, and a minimal GDT and identity page tables stand in for
//! what a boot loader would leave behind.

use devices::GuestMemoryMmap;
use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{
    boot_e820_entry, boot_params, setup_header, E820_MAX_ENTRIES_ZEROPAGE, LOADED_HIGH,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::layout::{
    E820Entry, BOOT_GDT_START, BOOT_STACK_POINTER, CMDLINE_MAX_SIZE, HIGH_MEMORY_START, PDE_START,
    PDPTE_START, PML4_START, ZERO_PAGE_START,
};

const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// "HdrS", little endian.
const HEADER_MAGIC: u32 = 0x5372_6448;
/// "Undefined" boot loader id: Musubi has no id of its own assigned.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// What a header-less kernel is assumed to want; 16 MiB is where x86-64 kernels are
/// linked, so it is always acceptable.
const DEFAULT_KERNEL_ALIGNMENT: u32 = 0x100_0000;
const PAGE_SIZE: u64 = 0x1000;

/// GDT slots; the selector of slot `n` is `n * 8`.
const GDT_NULL: usize = 0;
const GDT_CODE: usize = 1;
const GDT_DATA: usize = 2;
const GDT_TSS: usize = 3;
const GDT_ENTRIES: usize = 4;

/// Access byte in the low 8 bits, G/DB/L/AVL nibble in bits 12..16 (the layout of the
/// descriptor's bytes 5 and 6, with the limit nibble left out).
/// 64-bit code: present, DPL 0, execute/read, accessed; G=1, L=1.
const CODE_64_FLAGS: u16 = 0xa09b;
/// Data: present, DPL 0, read/write, accessed; G=1, D/B=1.
const DATA_FLAGS: u16 = 0xc093;
/// Busy 64-bit TSS, present: KVM refuses to enter long mode with an unusable TR.
const TSS_FLAGS: u16 = 0x808b;

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_NE: u64 = 1 << 5;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITABLE: u64 = 1 << 1;
const PTE_HUGE: u64 = 1 << 7;
const HUGE_PAGE_SIZE: u64 = 2 << 20;
const PT_ENTRIES: u64 = 512;

/// The boot page tables map this much, identity: enough for the kernel image, the zero
/// page, the command line and the stack; the kernel builds its own tables before it
/// touches anything else.
#[cfg(test)]
const IDENTITY_MAPPED: u64 = PT_ENTRIES * HUGE_PAGE_SIZE;

#[derive(Debug, thiserror::Error)]
pub enum LinuxBootError {
    #[error("the E820 map has {entries} entries; boot_params holds at most {max}")]
    TooManyE820Entries { entries: usize, max: usize },
    #[error(
        "the kernel command line is {len} bytes (with its terminating NUL); at most {max} are accepted{why}"
    )]
    CmdlineTooLong {
        len: usize,
        max: usize,
        why: &'static str,
    },
    #[error(
        "the {what} at {addr:#x} (+{len:#x} bytes) is not below 4 GiB, where boot_params can point"
    )]
    Above4GiB {
        what: &'static str,
        addr: u64,
        len: u64,
    },
    #[error(
        "an initrd of {size} bytes does not fit in low RAM: it must end below {top:#x} and start above {HIGH_MEMORY_START:#x}"
    )]
    InitrdTooLarge { size: u64, top: u64 },
    #[error("writing boot_params at {ZERO_PAGE_START:#x}: {0}")]
    WriteBootParams(#[source] linux_loader::configurator::Error),
    #[error("writing the boot {what} at {addr:#x}: {source}")]
    Write {
        what: &'static str,
        addr: u64,
        #[source]
        source: GuestMemoryError,
    },
}

/// Fills `boot_params` at `ZERO_PAGE_START`.
///
/// `setup_header` is the header read from a bzImage; the kernel's own values in it
/// (`setup_sects`, `xloadflags`, `initrd_addr_max`, ...) must reach the kernel unchanged,
/// so only the loader-owned fields are overwritten. Without one (ELF vmlinux) a minimal
/// header is made. `cmdline_len` counts the terminating NUL; `initrd` is `(address, size)`.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    setup_header: Option<setup_header>,
    e820: &[E820Entry],
    cmdline_addr: u64,
    cmdline_len: usize,
    initrd: Option<(u64, u64)>,
) -> Result<(), LinuxBootError> {
    if e820.len() > E820_MAX_ENTRIES_ZEROPAGE {
        return Err(LinuxBootError::TooManyE820Entries {
            entries: e820.len(),
            max: E820_MAX_ENTRIES_ZEROPAGE,
        });
    }
    if cmdline_len > CMDLINE_MAX_SIZE {
        return Err(LinuxBootError::CmdlineTooLong {
            len: cmdline_len,
            max: CMDLINE_MAX_SIZE,
            why: " (the space reserved for it in guest memory)",
        });
    }
    if let Some(h) = &setup_header {
        // The header's limit excludes the NUL and is only meaningful from protocol 2.06.
        let kernel_max = h.cmdline_size as usize;
        if { h.version } >= 0x206 && kernel_max != 0 && cmdline_len > kernel_max + 1 {
            return Err(LinuxBootError::CmdlineTooLong {
                len: cmdline_len,
                max: kernel_max + 1,
                why: " by this kernel (setup header cmdline_size)",
            });
        }
    }
    let cmd_line_ptr = below_4g("command line", cmdline_addr, cmdline_len as u64)?;

    let hdr = match setup_header {
        Some(h) => h,
        None => setup_header {
            boot_flag: BOOT_FLAG_MAGIC,
            header: HEADER_MAGIC,
            kernel_alignment: DEFAULT_KERNEL_ALIGNMENT,
            ..Default::default()
        },
    };
    let mut params = boot_params {
        hdr,
        ..Default::default()
    };
    params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    params.hdr.loadflags |= LOADED_HIGH;
    params.hdr.cmd_line_ptr = cmd_line_ptr;
    params.hdr.cmdline_size = cmdline_len as u32;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = below_4g("initrd", addr, size)?;
        params.hdr.ramdisk_size = size as u32;
    }

    for (slot, e) in params.e820_table.iter_mut().zip(e820) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind as u32,
        };
    }
    params.e820_entries = e820.len() as u8;

    let bp = BootParams::new(&params, GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams(&bp, mem).map_err(LinuxBootError::WriteBootParams)
}

/// The zero page has 32-bit fields for these; the `ext_*` high halves exist, but nothing
/// here is placed that high, so an address above 4 GiB is a caller's mistake.
fn below_4g(what: &'static str, addr: u64, len: u64) -> Result<u32, LinuxBootError> {
    match addr.checked_add(len) {
        Some(end) if end <= 1 << 32 => Ok(addr as u32),
        _ => Err(LinuxBootError::Above4GiB { what, addr, len }),
    }
}

/// Records the RSDP's address in the `boot_params` that `write_boot_params` wrote, so it
/// must be called after that (which rewrites the whole zero page).
///
/// Linux scans `0xe0000..0x100000` for the RSDP when this field is 0, so it is not
/// strictly needed; but the field (boot protocol 2.14) is the documented way to pass
/// it, and kernels that do not scan the BIOS area, or a future RSDP elsewhere, need it.
/// Older kernels ignore it.
pub fn set_acpi_rsdp_addr(mem: &GuestMemoryMmap, rsdp: u64) -> Result<(), LinuxBootError> {
    let addr = ZERO_PAGE_START + std::mem::offset_of!(boot_params, acpi_rsdp_addr) as u64;
    mem.write_obj(rsdp, GuestAddress(addr))
        .map_err(|source| LinuxBootError::Write {
            what: "boot_params.acpi_rsdp_addr",
            addr,
            source,
        })
}

/// Where to load an initrd of `initrd_size` bytes: as high as possible in the RAM below
/// `ram_top_below_hole` (exclusive), page aligned, and ending at or below the kernel's
/// `initrd_addr_max` when the header has one. High placement keeps it clear of the
/// kernel, which loads low and decompresses upwards.
pub fn initrd_address(
    ram_top_below_hole: u64,
    initrd_size: u64,
    setup_header: Option<&setup_header>,
) -> Result<u64, LinuxBootError> {
    let mut top = ram_top_below_hole;
    if let Some(h) = setup_header {
        // initrd_addr_max is the highest address the initrd's last byte may occupy.
        let max = u64::from(h.initrd_addr_max);
        if max != 0 {
            top = top.min(max + 1);
        }
    }
    let too_large = LinuxBootError::InitrdTooLarge {
        size: initrd_size,
        top,
    };
    let start = top.checked_sub(initrd_size).ok_or(too_large)? & !(PAGE_SIZE - 1);
    if start < HIGH_MEMORY_START {
        return Err(LinuxBootError::InitrdTooLarge {
            size: initrd_size,
            top,
        });
    }
    Ok(start)
}

/// One descriptor in the layout the CPU reads. `flags` as in the `*_FLAGS` constants.
fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    let flags = u64::from(flags);
    (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | ((flags & 0xff) << 40)
        | (((limit >> 16) & 0xf) << 48)
        | (((flags >> 12) & 0xf) << 52)
        | (((base >> 24) & 0xff) << 56)
}

/// The same descriptor as KVM wants it in `kvm_sregs`, which must agree with the GDT in
/// memory: the CPU reloads segments from the GDT, KVM does not.
fn segment_from_entry(entry: u64, slot: usize) -> kvm_segment {
    let limit_raw = (entry & 0xffff) | (((entry >> 48) & 0xf) << 16);
    let base = ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24);
    let access = (entry >> 40) & 0xff;
    let g = (entry >> 55) & 1;
    kvm_segment {
        base,
        limit: if g == 1 {
            ((limit_raw << 12) | 0xfff) as u32
        } else {
            limit_raw as u32
        },
        selector: (slot * 8) as u16,
        type_: (access & 0xf) as u8,
        s: ((access >> 4) & 1) as u8,
        dpl: ((access >> 5) & 3) as u8,
        present: ((access >> 7) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        db: ((entry >> 54) & 1) as u8,
        g: g as u8,
        unusable: 0,
        padding: 0,
    }
}

fn boot_gdt() -> [u64; GDT_ENTRIES] {
    let mut gdt = [0u64; GDT_ENTRIES];
    gdt[GDT_NULL] = 0;
    gdt[GDT_CODE] = gdt_entry(CODE_64_FLAGS, 0, 0xfffff);
    gdt[GDT_DATA] = gdt_entry(DATA_FLAGS, 0, 0xfffff);
    gdt[GDT_TSS] = gdt_entry(TSS_FLAGS, 0, 0xfffff);
    gdt
}

fn write_bytes(
    mem: &GuestMemoryMmap,
    what: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), LinuxBootError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| LinuxBootError::Write { what, addr, source })
}

/// Writes the boot GDT at `BOOT_GDT_START` and page tables at `PML4_START`, `PDPTE_START`
/// and `PDE_START` that identity-map the first `IDENTITY_MAPPED` bytes with 2 MiB pages.
pub fn write_boot_gdt_and_page_tables(mem: &GuestMemoryMmap) -> Result<(), LinuxBootError> {
    let gdt: Vec<u8> = boot_gdt().iter().flat_map(|e| e.to_le_bytes()).collect();
    write_bytes(mem, "GDT", BOOT_GDT_START, &gdt)?;

    // Whole pages, so stale entries from an earlier boot of the same memory cannot survive.
    let mut pml4 = vec![0u8; PAGE_SIZE as usize];
    pml4[..8].copy_from_slice(&(PDPTE_START | PTE_PRESENT | PTE_WRITABLE).to_le_bytes());
    write_bytes(mem, "PML4", PML4_START, &pml4)?;

    let mut pdpt = vec![0u8; PAGE_SIZE as usize];
    pdpt[..8].copy_from_slice(&(PDE_START | PTE_PRESENT | PTE_WRITABLE).to_le_bytes());
    write_bytes(mem, "page directory pointer table", PDPTE_START, &pdpt)?;

    let pd: Vec<u8> = (0..PT_ENTRIES)
        .flat_map(|i| ((i * HUGE_PAGE_SIZE) | PTE_PRESENT | PTE_WRITABLE | PTE_HUGE).to_le_bytes())
        .collect();
    write_bytes(mem, "page directory", PDE_START, &pd)
}

/// Puts the vCPU in 64-bit mode on the tables `write_boot_gdt_and_page_tables` writes.
/// Other fields of `sregs` (as read from a fresh vCPU) are kept.
pub fn long_mode_sregs(sregs: &mut kvm_sregs) {
    let gdt = boot_gdt();
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (GDT_ENTRIES * 8 - 1) as u16;
    // No IDT: until the kernel loads its own, any exception should end the VM at once
    // (triple fault) rather than jump through whatever the real-mode IVT holds.
    sregs.idt.base = 0;
    sregs.idt.limit = 0;

    sregs.cs = segment_from_entry(gdt[GDT_CODE], GDT_CODE);
    let data = segment_from_entry(gdt[GDT_DATA], GDT_DATA);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_entry(gdt[GDT_TSS], GDT_TSS);

    // Assigned, not or-ed: a fresh vCPU has CD and NW set, and running the early kernel
    // with caches disabled would only make it slow.
    sregs.cr0 = X86_CR0_PE | X86_CR0_ET | X86_CR0_NE | X86_CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;
}

/// General registers for the 64-bit entry at `entry`: the boot protocol passes
/// `boot_params` in RSI and wants interrupts off (RFLAGS bit 1 is reserved, always set).
pub fn long_mode_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        rflags: 0x2,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{e820_map, E820Kind, CMDLINE_START};

    fn guest_mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap()
    }

    fn read_params(mem: &GuestMemoryMmap) -> boot_params {
        mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap()
    }

    /// A header as a 6.1 bzImage carries it, reduced to the fields that matter here.
    fn bzimage_header() -> setup_header {
        setup_header {
            setup_sects: 39,
            boot_flag: BOOT_FLAG_MAGIC,
            header: HEADER_MAGIC,
            version: 0x20f,
            loadflags: LOADED_HIGH,
            initrd_addr_max: 0x7fff_ffff,
            kernel_alignment: 0x20_0000,
            relocatable_kernel: 1,
            xloadflags: 0x7f,
            cmdline_size: 2047,
            ..Default::default()
        }
    }

    #[test]
    fn fresh_header_and_e820() {
        let mem = guest_mem();
        let map = e820_map(64 << 20);
        write_boot_params(&mem, None, &map, CMDLINE_START, 20, None).unwrap();
        let p = read_params(&mem);
        assert_eq!({ p.hdr.boot_flag }, 0xaa55);
        assert_eq!({ p.hdr.header }, 0x5372_6448);
        assert_eq!(p.hdr.type_of_loader, 0xff);
        assert_eq!({ p.hdr.kernel_alignment }, 0x100_0000);
        assert_eq!(p.hdr.loadflags & LOADED_HIGH, LOADED_HIGH);
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ p.hdr.cmdline_size }, 20);
        assert_eq!({ p.hdr.ramdisk_image }, 0);
        assert_eq!({ p.hdr.ramdisk_size }, 0);
        assert_eq!(usize::from(p.e820_entries), map.len());
        for (got, want) in p.e820_table.iter().zip(&map) {
            assert_eq!(
                ({ got.addr }, { got.size }, { got.r#type }),
                (want.addr, want.size, want.kind as u32)
            );
        }
        assert_eq!({ p.e820_table[map.len()].size }, 0);
    }

    #[test]
    fn bzimage_header_is_kept_and_initrd_recorded() {
        let mem = guest_mem();
        let map = e820_map(64 << 20);
        let initrd = (0x3a0_0000, 0x12_3456);
        write_boot_params(
            &mem,
            Some(bzimage_header()),
            &map,
            CMDLINE_START,
            100,
            Some(initrd),
        )
        .unwrap();
        let p = read_params(&mem);
        assert_eq!(p.hdr.setup_sects, 39);
        assert_eq!({ p.hdr.version }, 0x20f);
        assert_eq!({ p.hdr.kernel_alignment }, 0x20_0000);
        assert_eq!({ p.hdr.xloadflags }, 0x7f);
        assert_eq!(p.hdr.type_of_loader, 0xff);
        assert_eq!({ p.hdr.ramdisk_image }, 0x3a0_0000);
        assert_eq!({ p.hdr.ramdisk_size }, 0x12_3456);
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
    }

    #[test]
    fn pmem_entries_reach_the_zero_page_as_type_12() {
        let mem = guest_mem();
        let mut map = e820_map(64 << 20);
        map.push(E820Entry {
            addr: 0x1_0000_0000,
            size: 512 << 20,
            kind: E820Kind::Pmem,
        });
        write_boot_params(&mem, None, &map, CMDLINE_START, 1, None).unwrap();
        let p = read_params(&mem);
        assert_eq!({ p.e820_table[map.len() - 1].r#type }, 12);
        assert_eq!({ p.e820_table[map.len() - 1].addr }, 0x1_0000_0000);
    }

    #[test]
    fn e820_limit() {
        let mem = guest_mem();
        let e = E820Entry {
            addr: 0,
            size: 0x1000,
            kind: E820Kind::Ram,
        };
        write_boot_params(&mem, None, &vec![e; 128], CMDLINE_START, 1, None).unwrap();
        assert_eq!(read_params(&mem).e820_entries, 128);
        let err = write_boot_params(&mem, None, &vec![e; 129], CMDLINE_START, 1, None).unwrap_err();
        assert!(matches!(
            err,
            LinuxBootError::TooManyE820Entries {
                entries: 129,
                max: 128
            }
        ));
    }

    #[test]
    fn command_line_limits() {
        let mem = guest_mem();
        let map = e820_map(64 << 20);
        let err = write_boot_params(&mem, None, &map, CMDLINE_START, 4097, None).unwrap_err();
        assert!(matches!(
            err,
            LinuxBootError::CmdlineTooLong {
                len: 4097,
                max: 4096,
                ..
            }
        ));
        // 2047 characters and the NUL fit this kernel; one more does not.
        let h = Some(bzimage_header());
        write_boot_params(&mem, h, &map, CMDLINE_START, 2048, None).unwrap();
        let err = write_boot_params(&mem, h, &map, CMDLINE_START, 2049, None).unwrap_err();
        assert!(matches!(
            err,
            LinuxBootError::CmdlineTooLong {
                len: 2049,
                max: 2048,
                ..
            }
        ));
        assert!(err.to_string().contains("cmdline_size"), "{err}");
    }

    #[test]
    fn addresses_above_4g_are_rejected() {
        let mem = guest_mem();
        let map = e820_map(64 << 20);
        let err = write_boot_params(
            &mem,
            None,
            &map,
            CMDLINE_START,
            1,
            Some((0xffff_f000, 0x2000)),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            LinuxBootError::Above4GiB { what: "initrd", .. }
        ));
        let err = write_boot_params(&mem, None, &map, 1 << 32, 1, None).unwrap_err();
        assert!(matches!(
            err,
            LinuxBootError::Above4GiB {
                what: "command line",
                ..
            }
        ));
    }

    #[test]
    fn rsdp_address_reaches_the_zero_page() {
        let mem = guest_mem();
        let map = e820_map(64 << 20);
        let h = Some(bzimage_header());
        write_boot_params(&mem, h, &map, CMDLINE_START, 20, None).unwrap();
        assert_eq!({ read_params(&mem).acpi_rsdp_addr }, 0);
        set_acpi_rsdp_addr(&mem, 0xe0000).unwrap();
        let p = read_params(&mem);
        assert_eq!({ p.acpi_rsdp_addr }, 0xe0000);
        // Offset 0x70 in the zero page, as the boot protocol documents it.
        assert_eq!(read_u64(&mem, ZERO_PAGE_START + 0x70), 0xe0000);
        // Nothing else moved.
        assert_eq!(p.hdr.setup_sects, 39);
        assert_eq!(usize::from(p.e820_entries), map.len());
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
    }

    #[test]
    fn boot_params_need_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        let err = write_boot_params(&mem, None, &[], CMDLINE_START, 1, None).unwrap_err();
        assert!(matches!(err, LinuxBootError::WriteBootParams(_)));
    }

    #[test]
    fn initrd_goes_to_the_top_of_low_ram() {
        let top = 64 << 20;
        assert_eq!(initrd_address(top, 0x1000, None).unwrap(), top - 0x1000);
        // Rounded down to a page, so it still ends below the top.
        let addr = initrd_address(top, 0x1234, None).unwrap();
        assert_eq!(addr, top - 0x2000);
        assert_eq!(addr % 0x1000, 0);
    }

    #[test]
    fn initrd_respects_initrd_addr_max() {
        let mut h = bzimage_header();
        h.initrd_addr_max = 0x37ff_ffff;
        let addr = initrd_address(0xc000_0000, 0x10_0000, Some(&h)).unwrap();
        assert_eq!(addr, 0x3800_0000 - 0x10_0000);
        // Below the limit, the RAM top wins.
        let addr = initrd_address(64 << 20, 0x10_0000, Some(&h)).unwrap();
        assert_eq!(addr, (64 << 20) - 0x10_0000);
        // A zero limit means the header does not say.
        h.initrd_addr_max = 0;
        let addr = initrd_address(64 << 20, 0x10_0000, Some(&h)).unwrap();
        assert_eq!(addr, (64 << 20) - 0x10_0000);
    }

    #[test]
    fn initrd_too_large() {
        assert!(matches!(
            initrd_address(64 << 20, 64 << 20, None),
            Err(LinuxBootError::InitrdTooLarge { .. })
        ));
        assert!(matches!(
            initrd_address(64 << 20, 1 << 40, None),
            Err(LinuxBootError::InitrdTooLarge { .. })
        ));
    }

    fn read_u64(mem: &GuestMemoryMmap, addr: u64) -> u64 {
        mem.read_obj(GuestAddress(addr)).unwrap()
    }

    /// Walks the boot tables as the MMU would, for a 2 MiB page mapping.
    fn translate(mem: &GuestMemoryMmap, cr3: u64, va: u64) -> Option<u64> {
        let pml4e = read_u64(mem, cr3 + ((va >> 39) & 0x1ff) * 8);
        if pml4e & PTE_PRESENT == 0 {
            return None;
        }
        let pdpte = read_u64(mem, (pml4e & !0xfff) + ((va >> 30) & 0x1ff) * 8);
        if pdpte & PTE_PRESENT == 0 {
            return None;
        }
        let pde = read_u64(mem, (pdpte & !0xfff) + ((va >> 21) & 0x1ff) * 8);
        if pde & PTE_PRESENT == 0 {
            return None;
        }
        assert_ne!(pde & PTE_HUGE, 0);
        Some((pde & !0x1f_ffff & ((1 << 52) - 1)) | (va & 0x1f_ffff))
    }

    #[test]
    fn gdt_in_memory() {
        let mem = guest_mem();
        write_boot_gdt_and_page_tables(&mem).unwrap();
        let gdt: Vec<u64> = (0..4)
            .map(|i| read_u64(&mem, BOOT_GDT_START + i * 8))
            .collect();
        assert_eq!(gdt[0], 0);
        assert_eq!(gdt[1], 0x00af_9b00_0000_ffff);
        assert_eq!(gdt[2], 0x00cf_9300_0000_ffff);
        assert_eq!(gdt[3], 0x008f_8b00_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_the_first_gib() {
        let mem = guest_mem();
        // Leftovers from an earlier boot must not survive.
        mem.write_obj(0xffff_u64, GuestAddress(PML4_START + 8))
            .unwrap();
        write_boot_gdt_and_page_tables(&mem).unwrap();
        assert_eq!(read_u64(&mem, PML4_START), PDPTE_START | 3);
        assert_eq!(read_u64(&mem, PML4_START + 8), 0);
        assert_eq!(read_u64(&mem, PDPTE_START), PDE_START | 3);
        assert_eq!(read_u64(&mem, PDE_START), 0x83);
        assert_eq!(read_u64(&mem, PDE_START + 511 * 8), (511 << 21) | 0x83);
        for va in [
            0,
            ZERO_PAGE_START,
            0x100_0000,
            0x1234_5678,
            IDENTITY_MAPPED - 1,
        ] {
            assert_eq!(translate(&mem, PML4_START, va), Some(va), "{va:#x}");
        }
        assert_eq!(translate(&mem, PML4_START, IDENTITY_MAPPED), None);
    }

    #[test]
    fn boot_tables_need_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        let err = write_boot_gdt_and_page_tables(&mem).unwrap_err();
        assert!(matches!(err, LinuxBootError::Write { what: "GDT", .. }));
    }

    #[test]
    fn sregs_match_the_gdt() {
        let mem = guest_mem();
        write_boot_gdt_and_page_tables(&mem).unwrap();
        let mut sregs = kvm_sregs {
            cr0: 0x6000_0010,
            ..Default::default()
        };
        long_mode_sregs(&mut sregs);

        assert_eq!(sregs.gdt.base, BOOT_GDT_START);
        assert_eq!(sregs.gdt.limit, 31);
        for (seg, slot) in [
            (sregs.cs, 1),
            (sregs.ds, 2),
            (sregs.es, 2),
            (sregs.fs, 2),
            (sregs.gs, 2),
            (sregs.ss, 2),
            (sregs.tr, 3),
        ] {
            assert_eq!(seg.selector, slot * 8);
            let in_memory = read_u64(&mem, BOOT_GDT_START + u64::from(slot) * 8);
            assert_eq!(seg, segment_from_entry(in_memory, usize::from(slot)));
        }
        let cs = sregs.cs;
        assert_eq!((cs.l, cs.db, cs.present, cs.s, cs.type_), (1, 0, 1, 1, 0xb));
        assert_eq!((cs.base, cs.limit, cs.g), (0, 0xffff_ffff, 1));
        let ds = sregs.ds;
        assert_eq!((ds.l, ds.db, ds.present, ds.s, ds.type_), (0, 1, 1, 1, 3));
        let tr = sregs.tr;
        assert_eq!((tr.s, tr.type_, tr.present), (0, 0xb, 1));

        assert_eq!(sregs.cr0, 0x8000_0031);
        assert_eq!(sregs.cr3, PML4_START);
        assert_eq!(sregs.cr4 & X86_CR4_PAE, X86_CR4_PAE);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
    }

    #[test]
    fn regs_for_the_64_bit_entry() {
        let regs = long_mode_regs(0x100_0200);
        assert_eq!(regs.rip, 0x100_0200);
        assert_eq!(regs.rsp, BOOT_STACK_POINTER);
        assert_eq!(regs.rbp, BOOT_STACK_POINTER);
        assert_eq!(regs.rsi, ZERO_PAGE_START);
        assert_eq!(regs.rflags, 2);
        assert_eq!((regs.rax, regs.rbx, regs.rdi), (0, 0, 0));
    }
}
