//! Thin wrappers over privileged and port instructions.

use core::arch::asm;

#[inline(always)]
pub fn outb(port: u16, v: u8) {
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags))
    }
}

#[inline(always)]
pub fn outl(port: u16, v: u32) {
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags))
    }
}

#[inline(always)]
pub fn inb(port: u16) -> u8 {
    let v: u8;
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack, preserves_flags))
    }
    v
}

#[inline(always)]
pub fn rdtsc() -> u64 {
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
    unsafe { asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags)) }
    v
}

/// # Safety
/// `pml4` must be a valid top-level table that maps the running code.
pub unsafe fn write_cr3(pml4: u64) {
    asm!("mov cr3, {}", in(reg) pml4, options(nostack, preserves_flags));
}

#[inline(always)]
pub fn pause() {
    unsafe { asm!("pause", options(nomem, nostack, preserves_flags)) }
}

/// Waits for the next interrupt with interrupts enabled only while halted, so no handler
/// runs between the caller's check and the halt.
#[inline(always)]
pub fn sti_hlt_cli() {
    unsafe { asm!("sti", "hlt", "cli", options(nomem, nostack)) }
}

pub fn cli_hlt_forever() -> ! {
    loop {
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) }
    }
}

/// Privilege level of the running code, from the CS selector.
pub fn cpl() -> u16 {
    let cs: u16;
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) }
    cs & 3
}

#[inline(always)]
pub fn mmio_read32(addr: u64) -> u32 {
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}

#[inline(always)]
pub fn mmio_write32(addr: u64, v: u32) {
    unsafe { core::ptr::write_volatile(addr as *mut u32, v) }
}

/// Ends the VM through the exit port; falls back to an i8042 reset if nothing is there.
pub fn exit_vm(status: u8) -> ! {
    outl(0xf4, status as u32);
    outb(0x64, 0xfe);
    cli_hlt_forever()
}
