//! Local APIC (xAPIC, MMIO), IOAPIC and the legacy PICs.

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::arch::{cpuid, mmio_read32, mmio_write32, outb, outl};
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

/// Musubi's paravirtual leaves: the signature leaf and the one after it.
const PV_LEAF: u32 = 0x4000_0100;
/// EBX, ECX, EDX of `PV_LEAF`: "MusubiMusubi".
const PV_SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"Musu"),
    u32::from_le_bytes(*b"biMu"),
    u32::from_le_bytes(*b"subi"),
];
/// The I/O port for paravirtual IPIs, plus one (0: none, use the LAPIC ICR).
static PV_IPI_PORT: AtomicU32 = AtomicU32::new(0);
static NODES: AtomicU32 = AtomicU32::new(1);
static PV_LEAF_SEEN: AtomicBool = AtomicBool::new(false);

/// True if the VMM advertises Musubi's paravirtual leaves (several nodes).
fn pv_leaf_present() -> bool {
    let r = cpuid(PV_LEAF, 0);
    [r.ebx, r.ecx, r.edx] == PV_SIGNATURE && r.eax > PV_LEAF
}

/// Reads the paravirtual leaves (BSP, at boot, before any IPI): the IPI port, if offered,
/// and the number of nodes. Without the signature nothing changes: one node, LAPIC IPIs.
pub fn pv_detect() {
    if !pv_leaf_present() {
        return;
    }
    PV_LEAF_SEEN.store(true, Ordering::Relaxed);
    let r = cpuid(PV_LEAF + 1, 0);
    NODES.store(r.ecx.max(1), Ordering::Relaxed);
    if r.eax & 1 != 0 && r.ebx <= 0xffff {
        PV_IPI_PORT.store(r.ebx + 1, Ordering::Relaxed);
    }
}

/// Number of nodes (hosts) the VM spans: 1 without the paravirtual leaf.
pub fn nodes() -> u32 {
    NODES.load(Ordering::Relaxed)
}

/// The paravirtual IPI port, if the VMM offers one.
pub fn pv_ipi_port() -> Option<u16> {
    match PV_IPI_PORT.load(Ordering::Relaxed) {
        0 => None,
        p => Some((p - 1) as u16),
    }
}

/// The node of the CPU executing this (CPUID leaf 0x4000_0101 EDX); 0 without the leaf.
pub fn this_node() -> u32 {
    if PV_LEAF_SEEN.load(Ordering::Relaxed) {
        cpuid(PV_LEAF + 1, 0).edx
    } else {
        0
    }
}

/// Sends an IPI: through the paravirtual port when the VMM offers one (a LAPIC cannot reach
/// vCPUs on other nodes), else through the ICR, waiting (bounded) for the delivery-status
/// bit to clear. `icr_lo` is the ICR low word (vector, delivery mode, level, trigger,
/// destination shorthand 0 or 3).
pub fn send_ipi(dest: u32, icr_lo: u32) {
    if let Some(port) = pv_ipi_port() {
        outl(port, (dest << 24) | (icr_lo & 0x000f_ffff));
        return;
    }
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
    ioapic_route_with(pin, vector, dest, false, false)
}

/// Routes an IOAPIC pin to `vector` on `dest`, with the trigger mode and polarity the
/// firmware gives for it (the ACPI SCI is level-triggered).
pub fn ioapic_route_with(pin: u32, vector: u8, dest: u32, level: bool, active_low: bool) {
    let base = ioapic_base();
    let sel = |reg: u32, v: u32| {
        mmio_write32(base, reg);
        mmio_write32(base + 0x10, v);
    };
    let flags = (u32::from(active_low) << 13) | (u32::from(level) << 15);
    sel(0x11 + 2 * pin, dest << 24);
    sel(0x10 + 2 * pin, vector as u32 | flags);
}

/// Number of redirection entries the IOAPIC has.
pub fn ioapic_pins() -> u32 {
    let base = ioapic_base();
    mmio_write32(base, 1);
    ((mmio_read32(base + 0x10) >> 16) & 0xff) + 1
}
