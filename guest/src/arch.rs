//! Thin wrappers over privileged and port instructions.

use core::arch::asm;

#[inline(always)]
pub fn outb(port: u16, v: u8) {
    // SAFETY: `out` reaches an I/O port, never memory (`nomem`); the ports the kernel and
    // tasks use (COM1, PIT, PICs, i8042, exit port) change nothing Rust code relies on.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags))
    }
}

#[inline(always)]
pub fn outl(port: u16, v: u32) {
    // SAFETY: as in `outb`.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags))
    }
}

#[inline(always)]
pub fn outw(port: u16, v: u16) {
    // SAFETY: as in `outb`.
    unsafe {
        asm!("out dx, ax", in("dx") port, in("ax") v, options(nomem, nostack, preserves_flags))
    }
}

#[inline(always)]
pub fn inw(port: u16) -> u16 {
    let v: u16;
    // SAFETY: as in `outb`: `in` reads an I/O port and touches no memory.
    unsafe {
        asm!("in ax, dx", in("dx") port, out("ax") v, options(nomem, nostack, preserves_flags))
    }
    v
}

#[inline(always)]
pub fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as in `outb`: `in` reads an I/O port and touches no memory.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack, preserves_flags))
    }
    v
}

#[inline(always)]
pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC only reads the time-stamp counter; the kernel never sets CR4.TSD, so it
    // is allowed at CPL3 as well.
    unsafe { core::arch::x86_64::_rdtsc() }
}

pub struct Cpuid {
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

pub fn cpuid(leaf: u32, sub: u32) -> Cpuid {
    let r = core::arch::x86_64::__cpuid_count(leaf, sub);
    Cpuid {
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
    }
}

pub fn read_cr2() -> u64 {
    let v: u64;
    // SAFETY: reading CR2 has no side effects; only the trap path (CPL0) calls this.
    unsafe { asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags)) }
    v
}

/// Switches to the page tables at `pml4` (and drops non-global TLB entries).
///
/// # Safety
/// `pml4` must be a valid top-level table that maps the running code, its stack and every
/// static the kernel uses, at the addresses it uses them now.
pub unsafe fn write_cr3(pml4: u64) {
    asm!("mov cr3, {}", in(reg) pml4, options(nostack, preserves_flags));
}

#[inline(always)]
pub fn pause() {
    // SAFETY: PAUSE is a spin-wait hint with no architectural effect.
    unsafe { asm!("pause", options(nomem, nostack, preserves_flags)) }
}

/// Waits for the next interrupt with interrupts enabled only while halted, so no handler
/// runs between the caller's check and the halt.
#[inline(always)]
pub fn sti_hlt_cli() {
    // SAFETY: the IDT is loaded before anything waits (`cpu::init_bsp` runs first), and
    // every handler saves and restores the registers it uses, so an interrupt taken here
    // resumes this code unchanged.
    unsafe { asm!("sti", "hlt", "cli", options(nomem, nostack)) }
}

pub fn cli_hlt_forever() -> ! {
    loop {
        // SAFETY: stops this CPU with interrupts off; nothing it runs depends on what follows.
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) }
    }
}

/// Privilege level of the running code, from the CS selector.
pub fn cpl() -> u16 {
    let cs: u16;
    // SAFETY: reading CS has no side effects and is allowed at any privilege level.
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) }
    cs & 3
}

#[inline(always)]
/// A 16-bit read: a virtio configuration field whose neighbours may lie past the end of
/// the device's configuration (QEMU reads a wider access beyond it as all ones).
pub fn mmio_read16(addr: u64) -> u16 {
    // SAFETY: as for `mmio_read32`, for a 2-byte field of a virtio-mmio window.
    unsafe { core::ptr::read_volatile(addr as *const u16) }
}

pub fn mmio_read32(addr: u64) -> u32 {
    // SAFETY: callers pass a 4-byte register of a device the firmware or the command line
    // announced (LAPIC, IOAPIC, a virtio-mmio window), identity-mapped by the boot tables.
    // No Rust reference points into device memory, and a bad address from the command line
    // faults into the trap handler, which reports it and ends the VM.
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}

#[inline(always)]
pub fn mmio_write32(addr: u64, v: u32) {
    // SAFETY: as in `mmio_read32`.
    unsafe { core::ptr::write_volatile(addr as *mut u32, v) }
}

/// Ends the VM through the exit port; falls back to an i8042 reset if nothing is there.
pub fn exit_vm(status: u8) -> ! {
    outl(0xf4, status as u32);
    outb(0x64, 0xfe);
    cli_hlt_forever()
}
