//! The Musubi probe guest: a small x86-64 kernel booted through PVH that runs the tasks named
//! on its command line and prints one JSON line per task on COM1.
//!
//! CPL0 code is slow on the nested KVM this was built for (instruction emulation), so the
//! kernel path is kept short and bulk work runs in user-mode tasks (see `utasks`).

#![no_std]
#![no_main]

mod abi;
mod apic;
mod arch;
mod boot;
mod bootinfo;
mod console;
mod cpu;
mod file;
mod global;
mod mm;
mod mtasks;
mod net;
mod paging;
mod pmem;
mod power;
mod serial;
mod smp;
mod tasks;
mod timer;
mod ulib;
mod user;
mod utasks;
mod virtio;
mod vsock;
mod wtasks;

use core::fmt::Write;
use core::panic::PanicInfo;

use abi::{STATUS_KERNEL_FAULT, STATUS_USER_FAULT};
use arch::exit_vm;

extern "C" fn kmain(start_info: u32) -> ! {
    serial::init();
    kprintln!("probe: Musubi probe guest");
    cpu::init_bsp();
    // SAFETY: `start_info` is EBX from the PVH entry, the boot stub still identity-maps the
    // first 4 GiB with page 0 present, and nothing has called `bootinfo::get` yet.
    unsafe { bootinfo::parse(start_info as u64) };
    let info = bootinfo::get();
    kprintln!(
        "probe: command line: {}",
        core::str::from_utf8(info.cmdline()).unwrap_or("(not UTF-8)")
    );
    let mapped_end = paging::init(info);
    user::init(info, mapped_end);
    apic::pic_disable();
    let platform = smp::discover(info);
    apic::set_bases(platform.lapic, platform.ioapic);
    apic::enable();
    let bsp = apic::id();
    apic::pv_detect();
    smp::init_bsp(bsp);
    timer::calibrate_tsc();
    timer::start_lapic_timer();
    kprintln!(
        "probe: tsc {} Hz ({}), lapic timer {} Hz, tick {}",
        timer::tsc_hz(),
        timer::source(),
        timer::lapic_hz(),
        if timer::timer_ok() {
            "running"
        } else {
            "NOT seen"
        }
    );
    let online = smp::start_aps(&platform, bsp);
    kprintln!(
        "probe: {} cpus listed ({}), {} online; {} bytes RAM; {} node(s), {} IPIs",
        platform.ncpus,
        platform.source,
        online,
        info.ram_bytes(),
        apic::nodes(),
        if apic::pv_ipi_port().is_some() {
            "paravirtual"
        } else {
            "LAPIC"
        }
    );
    virtio::probe_all(info, bsp);
    pmem::init(info);
    power::init(info);
    let (pool_lo, pool_hi) = mm::pool();
    let (arena, arena_len) = user::arena();
    kprintln!(
        "probe: task arena {:#x}+{:#x}, kernel page pool {:#x}+{:#x}",
        arena,
        arena_len,
        pool_lo,
        pool_hi - pool_lo
    );
    tasks::read_only_note();
    let status = tasks::run_all(info);
    for i in 0..virtio::count() {
        kprintln!(
            "probe: disk {} raised {} interrupts",
            i,
            virtio::irq_count(i)
        );
    }
    kprintln!("probe: done, exit status {}", status);
    power::soft_off_if_asked();
    exit_vm(status)
}

/// Shared by kernel and user code: a user task that panics reports through its own system
/// calls (it cannot touch kernel state) and ends; a kernel panic ends the VM.
#[panic_handler]
fn panic(info: &PanicInfo) -> ! {
    if arch::cpl() == 3 {
        let mut l = ulib::Line::new();
        l.push("{\"probe\":\"panic\",\"cpl\":3,\"message\":\"");
        let _ = write!(ulib::JsonEscape(&mut l), "{}", info);
        l.push("\"}\n");
        l.send();
        ulib::exit(STATUS_USER_FAULT)
    }
    let mut c = serial::Console;
    let _ = write!(
        c,
        "!! kernel panic: {}\n{{\"probe\":\"panic\",\"cpl\":0,\"message\":\"",
        info
    );
    let _ = write!(ulib::JsonEscape(&mut c), "{}", info);
    let _ = writeln!(c, "\"}}");
    exit_vm(STATUS_KERNEL_FAULT)
}
