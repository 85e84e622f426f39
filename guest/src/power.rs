//! The ACPI power button: found through the FADT (PM1a event and control blocks, SCI), taken
//! as an interrupt, and acted on as `probe.power=` says: end the VM (status 0), ignore it,
//! or power off through ACPI S5.
//!
//! The interrupt handler only acknowledges and counts: the press is acted on between tasks
//! (or at once by `wait-power`), so a task's output is never cut in half.

use core::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

use crate::abi::STATUS_POWER_TIMEOUT;
use crate::arch::{inw, outw, rdtsc};
use crate::bootinfo::BootInfo;
use crate::smp::{find_acpi_table, rd16, rd32, rd64, rd8};
use crate::{apic, kprintln, timer};

pub const POWER_VECTOR: u64 = 0x29;

const PWRBTN_STS: u16 = 1 << 8;
const PWRBTN_EN: u16 = 1 << 8;
const SCI_EN: u16 = 1 << 0;
const SLP_EN: u16 = 1 << 13;
const SLP_TYP_SHIFT: u16 = 10;

/// What a press does (`probe.power=`).
const MODE_EXIT: u8 = 0;
const MODE_IGNORE: u8 = 1;
const MODE_S5: u8 = 2;

/// PM1a event block port, plus one (0: no power button); its length; the control port.
static EVT_PORT: AtomicU32 = AtomicU32::new(0);
static EVT_LEN: AtomicU32 = AtomicU32::new(0);
static CNT_PORT: AtomicU32 = AtomicU32::new(0);
static DSDT: AtomicU64 = AtomicU64::new(0);
/// The SCI as routed: IRQ in bits 0..16, pin in 16..24, level bit 24, active low bit 25.
static SCI_ROUTE: AtomicU32 = AtomicU32::new(0);
static MODE: AtomicU8 = AtomicU8::new(MODE_EXIT);
static PRESSES: AtomicU64 = AtomicU64::new(0);
static SCI_INTERRUPTS: AtomicU64 = AtomicU64::new(0);

/// The FADT's fixed-feature registers, as the guest needs them.
struct Fadt {
    sci: u32,
    smi_cmd: u32,
    acpi_enable: u8,
    evt: u16,
    evt_len: u8,
    cnt: u16,
    dsdt: u64,
}

/// A register block's port: the 32-bit field, else the 64-bit GAS if it is in system I/O.
fn block(fadt: u64, len: u32, legacy: u64, gas: u64) -> u64 {
    match rd32(fadt + legacy) {
        0 if len >= gas as u32 + 12 && rd8(fadt + gas) == 1 => rd64(fadt + gas + 4),
        p => u64::from(p),
    }
}

fn read_fadt(info: &BootInfo) -> Option<Fadt> {
    let t = find_acpi_table(info, b"FACP")?;
    let len = rd32(t + 4);
    if len < 116 {
        return None;
    }
    let evt = block(t, len, 56, 148);
    let cnt = block(t, len, 64, 172);
    let evt_len = rd8(t + 88);
    if evt == 0 || cnt == 0 || evt > 0xffff || cnt > 0xffff || evt_len < 4 {
        return None;
    }
    let dsdt = match rd32(t + 40) {
        0 if len >= 148 => rd64(t + 140),
        d => u64::from(d),
    };
    Some(Fadt {
        sci: u32::from(rd16(t + 46)),
        smi_cmd: rd32(t + 48),
        acpi_enable: rd8(t + 52),
        evt: evt as u16,
        evt_len,
        cnt: cnt as u16,
        dsdt,
    })
}

/// The SCI's IOAPIC pin and whether it is level-triggered and active low: from the MADT's
/// interrupt source override for it, else ACPI's default for an SCI (level, active low).
fn sci_route(info: &BootInfo, sci: u32) -> (u32, bool, bool) {
    let (mut gsi, mut flags) = (sci, 0u16);
    if let Some(madt) = find_acpi_table(info, b"APIC") {
        let end = madt + u64::from(rd32(madt + 4));
        let mut e = madt + 44;
        while e + 2 <= end {
            let (kind, elen) = (rd8(e), u64::from(rd8(e + 1)));
            if elen < 2 {
                break;
            }
            if kind == 2 && elen >= 10 && u32::from(rd8(e + 3)) == sci {
                gsi = rd32(e + 4);
                flags = rd16(e + 8);
            }
            e += elen;
        }
    }
    let active_low = !matches!(flags & 3, 1);
    let level = !matches!((flags >> 2) & 3, 1);
    (gsi, level, active_low)
}

/// Enables the power button if the firmware describes one: ACPI mode (through SMI_CMD when
/// the platform has one), PWRBTN_EN, and the SCI's pin routed to this CPU.
pub fn init(info: &BootInfo) {
    let mode = match info.param(b"probe.power") {
        None | Some(b"exit") => MODE_EXIT,
        Some(b"ignore") => MODE_IGNORE,
        Some(b"s5") => MODE_S5,
        Some(_) => {
            kprintln!("probe: probe.power= takes exit, ignore or s5; using exit");
            MODE_EXIT
        }
    };
    MODE.store(mode, Ordering::Relaxed);
    let Some(f) = read_fadt(info) else {
        return;
    };
    if f.smi_cmd != 0 && f.acpi_enable != 0 && inw(f.cnt) & SCI_EN == 0 {
        crate::arch::outb(f.smi_cmd as u16, f.acpi_enable);
        timer::wait_for(300, || inw(f.cnt) & SCI_EN != 0);
    }
    let en = f.evt + u16::from(f.evt_len / 2);
    outw(f.evt, PWRBTN_STS);
    outw(en, inw(en) | PWRBTN_EN);
    let (pin, level, active_low) = sci_route(info, f.sci);
    apic::ioapic_route_with(pin, POWER_VECTOR as u8, apic::id(), level, active_low);
    EVT_LEN.store(u32::from(f.evt_len), Ordering::Relaxed);
    CNT_PORT.store(u32::from(f.cnt), Ordering::Relaxed);
    DSDT.store(f.dsdt, Ordering::Relaxed);
    SCI_ROUTE.store(
        (f.sci & 0xffff)
            | (pin & 0xff) << 16
            | u32::from(level) << 24
            | u32::from(active_low) << 25,
        Ordering::Relaxed,
    );
    // Nothing is printed here: every boot would pay for the line (one exit a byte), and
    // `wait-power` says it all when asked.
    EVT_PORT.store(u32::from(f.evt) + 1, Ordering::Relaxed);
}

/// The SCI: a power-button press is acknowledged (write 1 to clear) and counted.
pub fn irq() {
    SCI_INTERRUPTS.fetch_add(1, Ordering::Relaxed);
    if let Some(evt) = evt_port() {
        if inw(evt) & PWRBTN_STS != 0 {
            outw(evt, PWRBTN_STS);
            PRESSES.fetch_add(1, Ordering::Relaxed);
        }
    }
    apic::eoi();
}

fn evt_port() -> Option<u16> {
    match EVT_PORT.load(Ordering::Relaxed) {
        0 => None,
        p => Some((p - 1) as u16),
    }
}

fn mode_name() -> &'static str {
    match MODE.load(Ordering::Relaxed) {
        MODE_IGNORE => "ignore",
        MODE_S5 => "s5",
        _ => "exit",
    }
}

/// Whether a press was taken that the guest acts on (not under `probe.power=ignore`).
pub fn shutdown_requested() -> bool {
    MODE.load(Ordering::Relaxed) != MODE_IGNORE && PRESSES.load(Ordering::Relaxed) > 0
}

/// `wait-power=SECS`: waits for a press the guest acts on. Under `probe.power=ignore`
/// each press is noted on the console and the wait goes on.
pub fn wait_task(secs: u64) -> u8 {
    let Some(evt) = evt_port() else {
        kprintln!(
            "{{\"probe\":\"wait-power\",\"ok\":false,\"error\":\"no ACPI power button: no FADT with a PM1a event block\"}}"
        );
        return STATUS_POWER_TIMEOUT;
    };
    let route = SCI_ROUTE.load(Ordering::Relaxed);
    kprintln!(
        "probe: wait-power: waiting for the power button ({}; PM1a {:#x}, SCI {} on pin {}, {}, active {})",
        mode_name(),
        evt,
        route & 0xffff,
        (route >> 16) & 0xff,
        if route & 1 << 24 != 0 { "level" } else { "edge" },
        if route & 1 << 25 != 0 { "low" } else { "high" }
    );
    let start = rdtsc();
    let mut noted = PRESSES.load(Ordering::Relaxed);
    let got = timer::wait_for(secs * 1000, || {
        let now = PRESSES.load(Ordering::Relaxed);
        if now != noted && MODE.load(Ordering::Relaxed) == MODE_IGNORE {
            kprintln!("probe: power button pressed: ignored (probe.power=ignore)");
            noted = now;
        }
        shutdown_requested()
    });
    let ms = (rdtsc() - start) * 1000 / timer::tsc_hz().max(1);
    let (presses, sci) = (
        PRESSES.load(Ordering::Relaxed),
        SCI_INTERRUPTS.load(Ordering::Relaxed),
    );
    if got {
        kprintln!(
            "{{\"probe\":\"wait-power\",\"ok\":true,\"presses\":{},\"sci_interrupts\":{},\"ms\":{}}}",
            presses,
            sci,
            ms
        );
        0
    } else {
        kprintln!(
            "{{\"probe\":\"wait-power\",\"ok\":false,\"error\":\"no power-button press acted on within {} s\",\"mode\":\"{}\",\"presses\":{},\"sci_interrupts\":{}}}",
            secs,
            mode_name(),
            presses,
            sci
        );
        STATUS_POWER_TIMEOUT
    }
}

/// Says the guest shuts down because of the button (the line tests look for).
pub fn report_shutdown() {
    kprintln!(
        "{{\"probe\":\"power-button\",\"event\":\"power-button\",\"action\":\"{}\"}}",
        if MODE.load(Ordering::Relaxed) == MODE_S5 {
            "s5"
        } else {
            "exit"
        }
    );
}

/// Under `probe.power=s5`, after a press: powers off through PM1a_CNT with the DSDT's
/// `\_S5_` sleep type. Returns if the write did not end the VM (or S5 is not described);
/// the caller then ends it through the exit port.
pub fn soft_off_if_asked() {
    if !shutdown_requested() || MODE.load(Ordering::Relaxed) != MODE_S5 {
        return;
    }
    let Some(typ) = s5_type(DSDT.load(Ordering::Relaxed)) else {
        kprintln!("probe: power button: no \\_S5_ in the DSDT; ending through the exit port");
        return;
    };
    let cnt = CNT_PORT.load(Ordering::Relaxed) as u16;
    let keep = inw(cnt) & SCI_EN;
    outw(cnt, keep | (u16::from(typ & 7) << SLP_TYP_SHIFT));
    outw(cnt, keep | (u16::from(typ & 7) << SLP_TYP_SHIFT) | SLP_EN);
    timer::wait_for(1000, || false);
}

/// SLP_TYPa of `Name (_S5_, Package () { a, ... })` in the DSDT at `dsdt`: the bytes after
/// the name are PackageOp, a one-byte length, the count, then the first element (Zero,
/// One, or BytePrefix and a byte).
fn s5_type(dsdt: u64) -> Option<u8> {
    if dsdt == 0 || dsdt >= 0x1_0000_0000 || rd32(dsdt) != u32::from_le_bytes(*b"DSDT") {
        return None;
    }
    let end = dsdt + u64::from(rd32(dsdt + 4));
    let name = u32::from_le_bytes(*b"_S5_");
    let mut a = dsdt + 36;
    while a + 8 <= end {
        if rd32(a) == name && rd8(a + 4) == 0x12 {
            let e = a + 7;
            return match rd8(e) {
                0x00 => Some(0),
                0x01 => Some(1),
                0x0a => Some(rd8(e + 1)),
                _ => None,
            };
        }
        a += 1;
    }
    None
}
