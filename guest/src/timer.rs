//! TSC calibration, the LAPIC tick, and bounded waiting.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::apic;
use crate::arch::{cpuid, inb, outb, pause, rdtsc, sti_hlt_cli};
use crate::global::Global;

pub const TIMER_VECTOR: u64 = 0x20;
pub const TICK_HZ: u64 = 100;

/// The tick count, on a page of its own. The BSP writes it at every tick; on a VM spread
/// over several hosts, any other CPU reading a variable that shared its page would make that
/// page travel between hosts at the tick rate (about 200 page faults a second on two nodes).
#[repr(C, align(4096))]
struct OwnPage(AtomicU64);
static TICKS: OwnPage = OwnPage(AtomicU64::new(0));
static TSC_HZ: AtomicU64 = AtomicU64::new(1_000_000_000);
static LAPIC_HZ: AtomicU64 = AtomicU64::new(0);
static TIMER_OK: AtomicBool = AtomicBool::new(false);
/// The LAPIC timer's initial count for one tick (set by the BSP, used by the APs too).
static PERIOD: AtomicU64 = AtomicU64::new(0);
static SOURCE: Global<&'static str> = Global::new("assumed");

pub fn tick() {
    TICKS.0.fetch_add(1, Ordering::Relaxed);
}

pub fn ticks() -> u64 {
    TICKS.0.load(Ordering::Relaxed)
}

pub fn tsc_hz() -> u64 {
    TSC_HZ.load(Ordering::Relaxed)
}

pub fn lapic_hz() -> u64 {
    LAPIC_HZ.load(Ordering::Relaxed)
}

pub fn timer_ok() -> bool {
    TIMER_OK.load(Ordering::Relaxed)
}

pub fn source() -> &'static str {
    // SAFETY: written once by `calibrate_tsc` at boot; read-only afterwards.
    unsafe { SOURCE.get() }
}

pub fn cycles_to_ns(c: u64) -> u64 {
    (c as u128 * 1_000_000_000 / tsc_hz().max(1) as u128) as u64
}

/// Determines the TSC rate: CPUID leaves when they state it, else PIT channel 2.
pub fn calibrate_tsc() {
    let (hz, src) = tsc_from_cpuid().unwrap_or_else(|| {
        // Median of three: a vCPU preempted mid-measurement (2 host cores, several vCPUs)
        // skews one run, rarely two.
        let mut runs = [0u64; 3];
        for r in runs.iter_mut() {
            *r = pit_measure().unwrap_or(0);
        }
        runs.sort_unstable();
        match runs[1] {
            0 => (1_000_000_000, "assumed"),
            hz => (hz, "pit"),
        }
    });
    TSC_HZ.store(hz, Ordering::Relaxed);
    // SAFETY: boot, on the BSP, before anything reads SOURCE.
    unsafe { *SOURCE.get() = src };
}

fn tsc_from_cpuid() -> Option<(u64, &'static str)> {
    if cpuid(1, 0).ecx & (1 << 31) != 0 && cpuid(0x4000_0000, 0).eax >= 0x4000_0010 {
        let khz = cpuid(0x4000_0010, 0).eax as u64;
        if khz != 0 {
            return Some((khz * 1000, "cpuid-0x40000010"));
        }
    }
    if cpuid(0, 0).eax >= 0x15 {
        let r = cpuid(0x15, 0);
        if r.eax != 0 && r.ebx != 0 && r.ecx != 0 {
            return Some((r.ecx as u64 * r.ebx as u64 / r.eax as u64, "cpuid-0x15"));
        }
    }
    None
}

const PIT_HZ: u64 = 1_193_182;

/// Counts TSC cycles over 30 ms of PIT channel 2 (mode 0, gate on, speaker off). Each port
/// access is a VM exit (~85 µs here), so both ends are taken as the midpoint of the exits
/// around the event. Machines without the speaker port (QEMU microvm) fall back to reading
/// channel 0's counter back.
fn pit_measure() -> Option<u64> {
    const MS: u64 = 30;
    let count = (PIT_HZ * MS / 1000) as u16;
    outb(0x61, (inb(0x61) & 0xfc) | 0x01);
    outb(0x43, 0xb0);
    outb(0x42, count as u8);
    let before = rdtsc();
    outb(0x42, (count >> 8) as u8);
    let t0 = before + (rdtsc() - before) / 2;
    if inb(0x61) & 0x20 != 0 {
        // OUT2 must be low right after a mode-0 count is written: no usable port 0x61.
        return pit_readback_measure();
    }
    let mut prev = rdtsc();
    loop {
        let t = rdtsc();
        if inb(0x61) & 0x20 != 0 {
            let end = prev + (t - prev) / 2;
            let hz = (end - t0) * 1000 / MS;
            return (hz > 1_000_000).then_some(hz);
        }
        if t - t0 > 20_000_000_000 {
            return None;
        }
        prev = t;
    }
}

/// Channel 0 in mode 0 from 0xffff, latched and read back until 50 ms have passed.
fn pit_readback_measure() -> Option<u64> {
    let read = || {
        let t = rdtsc();
        outb(0x43, 0x00);
        let lo = inb(0x40) as u64;
        let hi = inb(0x40) as u64;
        (t, hi << 8 | lo)
    };
    outb(0x43, 0x30);
    outb(0x40, 0xff);
    outb(0x40, 0xff);
    let (mut t0, mut c0) = read();
    let start = t0;
    loop {
        let (t, c) = read();
        if t - start > 20_000_000_000 {
            return None;
        }
        if c > c0 {
            // Read before the count was loaded, or wrapped: start over from here.
            (t0, c0) = (t, c);
            continue;
        }
        if c0 - c >= PIT_HZ / 20 {
            let hz = (t - t0) as u128 * PIT_HZ as u128 / (c0 - c) as u128;
            return (hz > 1_000_000).then_some(hz as u64);
        }
    }
}

pub fn delay_us(us: u64) {
    let end = rdtsc() + us * tsc_hz() / 1_000_000;
    while rdtsc() < end {
        pause();
    }
}

/// Measures the LAPIC timer against the TSC, then starts it periodic at `TICK_HZ`.
/// The tick is only relied on (for `hlt` in waits) once one has been seen.
pub fn start_lapic_timer() {
    apic::write(apic::REG_TIMER_DIV, 0x3); // divide by 16
    apic::write(apic::REG_LVT_TIMER, (1 << 16) | TIMER_VECTOR as u32);
    apic::write(apic::REG_TIMER_INIT, u32::MAX);
    let t0 = rdtsc();
    let span = tsc_hz() / 50;
    while rdtsc() - t0 < span {
        pause();
    }
    let t1 = rdtsc();
    let elapsed = u32::MAX - apic::read(apic::REG_TIMER_CUR);
    let hz = elapsed as u64 * tsc_hz() / (t1 - t0).max(1);
    LAPIC_HZ.store(hz, Ordering::Relaxed);
    let period = (hz / TICK_HZ).clamp(1, u32::MAX as u64) as u32;
    PERIOD.store(period as u64, Ordering::Relaxed);
    apic::write(apic::REG_LVT_TIMER, (1 << 17) | TIMER_VECTOR as u32);
    apic::write(apic::REG_TIMER_INIT, period);
    let end = rdtsc() + tsc_hz() / 5;
    let before = ticks();
    // SAFETY: the IDT and the timer vector's handler are in place (`cpu::init_bsp`); the
    // handler only counts the tick. Interrupts go off again right after.
    unsafe { core::arch::asm!("sti") };
    while ticks() == before && rdtsc() < end {
        pause();
    }
    // SAFETY: disabling interrupts has no memory effects.
    unsafe { core::arch::asm!("cli") };
    TIMER_OK.store(ticks() != before, Ordering::Relaxed);
}

/// Starts an AP's LAPIC timer with the BSP's tick period: an AP's tick wakes it to look at
/// its mailbox, ends its user task at the deadline, and paces its bounded waits.
pub fn start_ap_timer() {
    let period = PERIOD.load(Ordering::Relaxed);
    if period == 0 {
        return;
    }
    apic::write(apic::REG_TIMER_DIV, 0x3);
    apic::write(apic::REG_LVT_TIMER, (1 << 17) | TIMER_VECTOR as u32);
    apic::write(apic::REG_TIMER_INIT, period as u32);
}

/// Sleeps until the next interrupt if the tick works, else spins briefly.
pub fn idle() {
    if timer_ok() {
        sti_hlt_cli();
    } else {
        pause();
    }
}

/// Waits until `done` holds or `ms` milliseconds pass; true if `done` held.
pub fn wait_for(ms: u64, done: impl FnMut() -> bool) -> bool {
    poll_until(rdtsc() + ms * tsc_hz() / 1000, done, idle)
}

/// Polls `done` without halting for up to `us` microseconds: for completions expected
/// sooner than a halt and wake-up of a virtual CPU would take.
pub fn spin_for(us: u64, done: impl FnMut() -> bool) -> bool {
    poll_until(rdtsc() + us * tsc_hz() / 1_000_000, done, || {})
}

/// Checks `done` until it holds or the TSC passes `end`, running `between` after each
/// miss; `done` gets a last look at the deadline, so a late success still counts.
fn poll_until(end: u64, mut done: impl FnMut() -> bool, mut between: impl FnMut()) -> bool {
    loop {
        if done() {
            return true;
        }
        if rdtsc() >= end {
            return done();
        }
        between();
    }
}
