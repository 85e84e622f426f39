//! Local APIC (xAPIC, MMIO), IOAPIC and the legacy PICs.

use core::sync::atomic::{AtomicU64, Ordering};

use crate::arch::{mmio_read32, mmio_write32, outb};
use crate::cpu::{PIC_VECTOR_BASE, SPURIOUS_VECTOR};

static LAPIC_BASE: AtomicU64 = AtomicU64::new(0xfee0_0000);
static IOAPIC_BASE: AtomicU64 = AtomicU64::new(0xfec0_0000);

pub const REG_ID: u64 = 0x20;
pub const REG_TPR: u64 = 0x80;
pub const REG_EOI: u64 = 0xb0;
pub const REG_SVR: u64 = 0xf0;
pub const REG_ICR_LO: u64 = 0x300;
pub const REG_ICR_HI: u64 = 0x310;
pub const REG_LVT_TIMER: u64 = 0x320;
pub const REG_TIMER_INIT: u64 = 0x380;
pub const REG_TIMER_CUR: u64 = 0x390;
pub const REG_TIMER_DIV: u64 = 0x3e0;

pub fn set_bases(lapic: u64, ioapic: u64) {
    LAPIC_BASE.store(lapic, Ordering::Relaxed);
    IOAPIC_BASE.store(ioapic, Ordering::Relaxed);
}

pub fn ioapic_base() -> u64 {
    IOAPIC_BASE.load(Ordering::Relaxed)
}

pub fn read(reg: u64) -> u32 {
    mmio_read32(LAPIC_BASE.load(Ordering::Relaxed) + reg)
}

pub fn write(reg: u64, v: u32) {
    mmio_write32(LAPIC_BASE.load(Ordering::Relaxed) + reg, v)
}

pub fn id() -> u32 {
    read(REG_ID) >> 24
}

pub fn enable() {
    write(REG_TPR, 0);
    write(REG_SVR, 0x100 | SPURIOUS_VECTOR as u32);
}

pub fn eoi() {
    write(REG_EOI, 0);
}

/// Sends an IPI and waits (bounded) for the delivery-status bit to clear.
pub fn send_ipi(dest: u32, icr_lo: u32) {
    write(REG_ICR_HI, dest << 24);
    write(REG_ICR_LO, icr_lo);
    for _ in 0..100 {
        if read(REG_ICR_LO) & (1 << 12) == 0 {
            break;
        }
    }
}

/// Moves the 8259s off the exception vectors and masks every line: all interrupts come
/// through the LAPIC and IOAPIC.
pub fn pic_disable() {
    let base = PIC_VECTOR_BASE as u8;
    outb(0x20, 0x11);
    outb(0xa0, 0x11);
    outb(0x21, base);
    outb(0xa1, base + 8);
    outb(0x21, 4);
    outb(0xa1, 2);
    outb(0x21, 1);
    outb(0xa1, 1);
    outb(0x21, 0xff);
    outb(0xa1, 0xff);
}

/// Routes an IOAPIC pin, edge-triggered and active high, to `vector` on `dest`.
pub fn ioapic_route(pin: u32, vector: u8, dest: u32) {
    let base = ioapic_base();
    let sel = |reg: u32, v: u32| {
        mmio_write32(base, reg);
        mmio_write32(base + 0x10, v);
    };
    sel(0x11 + 2 * pin, dest << 24);
    sel(0x10 + 2 * pin, vector as u32);
}

/// Number of redirection entries the IOAPIC has.
pub fn ioapic_pins() -> u32 {
    let base = ioapic_base();
    mmio_write32(base, 1);
    ((mmio_read32(base + 0x10) >> 16) & 0xff) + 1
}
