//! CPU discovery (Intel MP table, else ACPI MADT) and AP start-up (INIT, SIPI, SIPI).

use core::sync::atomic::{AtomicU32, Ordering};

use crate::apic;
use crate::boot::{enter_long_mode, load_data_segments, Stack};
use crate::bootinfo::BootInfo;
use crate::cpu::{self, GDT, GDT_BYTES, MAX_CPUS};
use crate::global::Global;
use crate::paging::PML4;
use crate::timer;

pub struct Platform {
    pub lapic: u64,
    pub ioapic: u64,
    pub apic_ids: [u8; MAX_CPUS],
    pub ncpus: usize,
    pub source: &'static str,
}

impl Platform {
    /// A platform with the LAPIC at `lapic`, the IOAPIC at its usual address until a table
    /// says otherwise, and no CPUs listed yet.
    fn new(lapic: u64, source: &'static str) -> Platform {
        Platform {
            lapic,
            ioapic: 0xfec0_0000,
            apic_ids: [0; MAX_CPUS],
            ncpus: 0,
            source,
        }
    }
}

/// CPUs running kernel code: the BSP plus every AP that reached `ap_main`.
pub static ONLINE: AtomicU32 = AtomicU32::new(1);
/// Next AP index (stack and TSS slot); taken with `lock xadd` by the APs themselves, so
/// they can all be started at once.
static AP_NEXT: AtomicU32 = AtomicU32::new(1);

const AP_STACK_SIZE: usize = 8192;
#[link_section = ".noinit.apstacks"]
static AP_STACKS: Global<Stack<{ AP_STACK_SIZE * (MAX_CPUS - 1) }>> =
    Global::new(Stack([0; AP_STACK_SIZE * (MAX_CPUS - 1)]));

const TRAMPOLINE: u64 = 0x8000;

extern "C" {
    static tramp_start: u8;
    static tramp_end: u8;
}

core::arch::global_asm!(
    r#"
    .section .rodata.trampoline, "a"
    .global tramp_start
    .global tramp_end
    .code16
tramp_start:
    cli
    cld
    xor %ax, %ax
    mov %ax, %ds
    lgdtl tr_gdtr - tramp_start + 0x8000
    mov %cr0, %eax
    or $1, %eax
    mov %eax, %cr0
    ljmpl ${kcode32}, $(tr_pm32 - tramp_start + 0x8000)
    .code32
tr_pm32:
    mov ${kdata}, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
"#,
    enter_long_mode!(),
    r#"
    ljmp ${kcode}, $(tr_lm - tramp_start + 0x8000)
    .code64
tr_lm:
    mov $ap_entry64, %rax
    jmp *%rax
    .p2align 3
tr_gdtr:
    .word {gdt_limit}
    .long {gdt}
tramp_end:

    .section .text.ap, "ax"
    .code64
ap_entry64:
"#,
    load_data_segments!(),
    r#"
    mov $1, %eax
    lock xaddl %eax, {ap_next}
    cmp ${max_cpus}, %eax
    jae 2f
    mov %eax, %edi
    imul ${stack_size}, %rax, %rax
    add ${stacks}, %rax
    mov %rax, %rsp
    call {ap_main}
2:
    cli
    hlt
    jmp 2b
    "#,
    pml4 = sym PML4,
    gdt = sym GDT,
    gdt_limit = const GDT_BYTES - 1,
    ap_next = sym AP_NEXT,
    max_cpus = const MAX_CPUS,
    stack_size = const AP_STACK_SIZE,
    stacks = sym AP_STACKS,
    ap_main = sym ap_main,
    kcode32 = const cpu::KCODE32,
    kcode = const cpu::KCODE,
    kdata = const cpu::KDATA,
    options(att_syntax)
);

extern "C" fn ap_main(idx: u32) -> ! {
    cpu::load(idx as usize);
    apic::enable();
    ONLINE.fetch_add(1, Ordering::SeqCst);
    loop {
        // SAFETY: this CPU's IDT and TSS are loaded (`cpu::load` above) and its handlers
        // restore every register they use; waiting with interrupts on is all an AP does.
        unsafe { core::arch::asm!("sti", "hlt", options(nomem, nostack)) };
    }
}

// The firmware tables read below lie in the low megabyte (EBDA, BIOS area) or below 4 GiB
// where the loader's RSDP and the tables' own pointers lead (the callers skip pointers above
// 4 GiB). The boot stub identity-maps all of that, nothing writes it while the probe runs,
// and no Rust reference points into it.

fn checksum_ok(addr: u64, len: usize) -> bool {
    // SAFETY: see above; `len` comes from the table's own header, at most 64 KiB.
    let s = unsafe { core::slice::from_raw_parts(addr as *const u8, len) };
    s.iter().fold(0u8, |a, &b| a.wrapping_add(b)) == 0
}

fn rd8(a: u64) -> u8 {
    // SAFETY: a firmware-table address (see above).
    unsafe { core::ptr::read_volatile(a as *const u8) }
}
fn rd16(a: u64) -> u16 {
    // SAFETY: a firmware-table address (see above); unaligned reads are allowed.
    unsafe { core::ptr::read_unaligned(a as *const u16) }
}
fn rd32(a: u64) -> u32 {
    // SAFETY: as in `rd16`.
    unsafe { core::ptr::read_unaligned(a as *const u32) }
}
fn rd64(a: u64) -> u64 {
    // SAFETY: as in `rd16`.
    unsafe { core::ptr::read_unaligned(a as *const u64) }
}

fn find_mp(from: u64, to: u64) -> Option<u64> {
    let mut a = from & !15;
    while a + 16 <= to {
        if rd32(a) == 0x5f50_4d5f && checksum_ok(a, (rd8(a + 8) as usize).max(1) * 16) {
            return Some(a);
        }
        a += 16;
    }
    None
}

fn from_mp(info: &BootInfo) -> Option<Platform> {
    let mut ranges = [(0u64, 0u64); 3];
    let mut n = 0;
    if info.ebda >= 0x80000 && info.ebda < 0xa0000 {
        ranges[n] = (info.ebda, info.ebda + 1024);
        n += 1;
    }
    if info.ebda != 0x9fc00 {
        ranges[n] = (0x9fc00, 0xa0000);
        n += 1;
    }
    ranges[n] = (0xf0000, 0x100000);
    n += 1;
    let fp = ranges[..n].iter().find_map(|&(a, b)| find_mp(a, b))?;
    let table = rd32(fp + 4) as u64;
    if table == 0 || rd32(table) != 0x504d_4350 {
        return None;
    }
    let len = rd16(table + 4) as usize;
    if !checksum_ok(table, len) {
        return None;
    }
    let mut p = Platform::new(rd32(table + 36) as u64, "mp-table");
    let count = rd16(table + 34);
    let end = table + len as u64;
    let mut e = table + 44;
    let mut ioapic_found = false;
    for _ in 0..count {
        if e >= end {
            break;
        }
        match rd8(e) {
            0 => {
                if rd8(e + 3) & 1 != 0 && p.ncpus < MAX_CPUS {
                    p.apic_ids[p.ncpus] = rd8(e + 1);
                    p.ncpus += 1;
                }
                e += 20;
            }
            2 => {
                if !ioapic_found && rd8(e + 3) & 1 != 0 {
                    p.ioapic = rd32(e + 4) as u64;
                    ioapic_found = true;
                }
                e += 8;
            }
            1 | 3 | 4 => e += 8,
            _ => break,
        }
    }
    Some(p)
}

fn find_rsdp(info: &BootInfo) -> Option<u64> {
    let ok = |a: u64| rd64(a) == u64::from_le_bytes(*b"RSD PTR ") && checksum_ok(a, 20);
    if info.rsdp != 0 && ok(info.rsdp) {
        return Some(info.rsdp);
    }
    let mut a = 0xe0000;
    while a < 0x100000 {
        if ok(a) {
            return Some(a);
        }
        a += 16;
    }
    None
}

fn from_madt(info: &BootInfo) -> Option<Platform> {
    let rsdp = find_rsdp(info)?;
    let (root, wide) = if rd8(rsdp + 15) >= 2 && rd64(rsdp + 24) != 0 {
        (rd64(rsdp + 24), true)
    } else {
        (rd32(rsdp + 16) as u64, false)
    };
    if root == 0 || root >= 0x1_0000_0000 {
        return None;
    }
    let root_len = rd32(root + 4) as u64;
    let step = if wide { 8 } else { 4 };
    let mut a = root + 36;
    let mut madt = None;
    while a + step <= root + root_len {
        let t = if wide { rd64(a) } else { rd32(a) as u64 };
        if t != 0 && t < 0x1_0000_0000 && rd32(t) == u32::from_le_bytes(*b"APIC") {
            madt = Some(t);
            break;
        }
        a += step;
    }
    let madt = madt?;
    let len = rd32(madt + 4) as u64;
    let mut p = Platform::new(rd32(madt + 36) as u64, "acpi-madt");
    let mut e = madt + 44;
    let mut ioapic_found = false;
    while e + 2 <= madt + len {
        let (kind, elen) = (rd8(e), rd8(e + 1) as u64);
        if elen < 2 {
            break;
        }
        match kind {
            0 if rd32(e + 4) & 1 != 0 && p.ncpus < MAX_CPUS => {
                p.apic_ids[p.ncpus] = rd8(e + 3);
                p.ncpus += 1;
            }
            1 if !ioapic_found => {
                p.ioapic = rd32(e + 4) as u64;
                ioapic_found = true;
            }
            5 => p.lapic = rd64(e + 4),
            _ => {}
        }
        e += elen;
    }
    Some(p)
}

/// CPUs from the MP table (what Musubi provides) or the ACPI MADT. SeaBIOS (QEMU `-M pc`)
/// lists only the BSP in its MP table, so when the MP table names a single CPU, or the
/// loader passed an RSDP, the MADT is read too and the longer list wins.
pub fn discover(info: &BootInfo) -> Platform {
    let mp = from_mp(info).filter(|p| p.ncpus > 0);
    let need_acpi = info.rsdp != 0 || mp.as_ref().is_none_or(|p| p.ncpus < 2);
    let madt = if need_acpi {
        from_madt(info).filter(|p| p.ncpus > 0)
    } else {
        None
    };
    match (mp, madt) {
        (Some(m), Some(a)) => Some(if a.ncpus > m.ncpus { a } else { m }),
        (m, a) => m.or(a),
    }
    .unwrap_or(Platform::new(0xfee0_0000, "none"))
}

/// Starts every listed AP at once and waits (bounded) for them to report in. Returns the
/// number of CPUs online.
pub fn start_aps(p: &Platform, bsp: u32) -> u32 {
    let targets = || {
        p.apic_ids[..p.ncpus]
            .iter()
            .map(|&id| id as u32)
            .filter(move |&id| id != bsp)
    };
    let expected = 1 + targets().count() as u32;
    if expected == 1 && p.ncpus > 0 {
        return 1;
    }
    // SAFETY: copies the trampoline (rodata between two labels of the asm above) to 0x8000,
    // low memory below the kernel image that nothing in the kernel uses (the boot info that
    // was there has been copied out, see bootinfo.rs); the copy is what the APs execute.
    unsafe {
        let start = core::ptr::addr_of!(tramp_start);
        let len = core::ptr::addr_of!(tramp_end) as usize - start as usize;
        core::ptr::copy_nonoverlapping(start, TRAMPOLINE as *mut u8, len);
    }
    let sipi = 0x4600 | (TRAMPOLINE >> 12) as u32;
    if p.ncpus == 0 {
        // No table names the CPUs (QEMU microvm with acpi=off): start whoever is there
        // with the all-excluding-self shorthand, then count who reports in until the
        // count stops changing.
        const ALL_BUT_SELF: u32 = 3 << 18;
        apic::send_ipi(0, ALL_BUT_SELF | 0x4500);
        timer::delay_us(10_000);
        apic::send_ipi(0, ALL_BUT_SELF | sipi);
        timer::delay_us(200);
        apic::send_ipi(0, ALL_BUT_SELF | sipi);
        let mut last = 0;
        timer::wait_for(500, || {
            timer::delay_us(20_000);
            let now = ONLINE.load(Ordering::SeqCst);
            let settled = now == last && now > 1;
            last = now;
            settled
        });
        return ONLINE.load(Ordering::SeqCst);
    }
    for id in targets() {
        apic::send_ipi(id, 0x4500);
    }
    timer::delay_us(10_000);
    for id in targets() {
        apic::send_ipi(id, sipi);
    }
    timer::delay_us(200);
    if ONLINE.load(Ordering::SeqCst) < expected {
        for id in targets() {
            apic::send_ipi(id, sipi);
        }
    }
    timer::wait_for(1000, || ONLINE.load(Ordering::SeqCst) >= expected);
    ONLINE.load(Ordering::SeqCst)
}
