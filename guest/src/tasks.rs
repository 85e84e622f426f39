//! The task list from `probe.tasks=` and the kernel side of each task.

use core::fmt;

use crate::abi::{STATUS_BLK_FAILED, STATUS_UNKNOWN_TASK, STATUS_USER_FAULT};
use crate::arch::exit_vm;
use crate::bootinfo::{self, BootInfo};
use crate::ulib::JsonBytes;
use crate::user::{self, Outcome, UserEntry};
use crate::{console, cpu, kprint, kprintln, smp, timer, utasks, virtio, wtasks};

/// Shows command-line bytes (which may be anything) safely inside a JSON string.
pub struct Lossy<'a>(pub &'a [u8]);

impl fmt::Display for Lossy<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        JsonBytes(self.0).fmt(f)
    }
}

/// Runs the tasks in order. The VM's status is the first non-zero task status.
pub fn run_all(info: &BootInfo) -> u8 {
    let list = info.param(b"probe.tasks").unwrap_or(b"hello");
    let mut status = 0;
    for task in list.split(|&b| b == b',').filter(|t| !t.is_empty()) {
        let s = run_one(info, task);
        if status == 0 {
            status = s;
        }
    }
    status
}

fn run_one(info: &BootInfo, task: &[u8]) -> u8 {
    let (name, arg) = match task.iter().position(|&b| b == b'=') {
        Some(i) => (&task[..i], Some(&task[i + 1..])),
        None => (task, None),
    };
    let num = |a: Option<&[u8]>| {
        a.and_then(|a| core::str::from_utf8(a).ok())
            .and_then(|s| s.parse::<u64>().ok())
    };
    if let (Ok(n), Ok(a)) = (
        core::str::from_utf8(name),
        arg.map(core::str::from_utf8).transpose(),
    ) {
        match workloads::task::parse(n, a) {
            Some(Ok(t)) => {
                return finish(t.name(), user::run_task(wtasks::workload, &t, timeout()))
            }
            Some(Err(usage)) => return bad_argument(task, usage),
            None => {}
        }
    }
    match (name, arg) {
        (b"pmem-crc", None) => run_user("pmem-crc", utasks::pmem_crc, 0),
        (b"pmem-fill", a) => match num(a) {
            Some(seed) => run_user("pmem-fill", utasks::pmem_fill, seed),
            None => bad_argument(task, "pmem-fill=SEED needs a decimal seed"),
        },
        (b"hello", None) => {
            kprintln!(
                "{{\"probe\":\"hello\",\"cpus\":{},\"memory_bytes\":{}}}",
                smp::ONLINE.load(core::sync::atomic::Ordering::SeqCst),
                info.ram_bytes()
            );
            0
        }
        (b"timer", None) => timer_task(),
        (b"console-echo", a) => match a.map_or(Some(console::DEFAULT_WAIT_S), |a| num(Some(a))) {
            Some(secs) if secs > 0 => console::echo_task(secs),
            _ => bad_argument(task, "console-echo=SECS needs a positive number of seconds"),
        },
        (b"user-hello", None) => run_user("user-hello", utasks::user_hello, 0),
        (b"blk-crc", None) => run_user("blk-crc", utasks::blk_crc, 0),
        (b"blk-id", None) => run_user("blk-id", utasks::blk_id, 0),
        (b"blk-fill", a) => match num(a) {
            Some(seed) => run_user("blk-fill", utasks::blk_fill, seed),
            None => bad_argument(task, "blk-fill=SEED needs a decimal seed"),
        },
        (b"fault", None) => run_user("fault", utasks::fault, 0),
        (b"spin", a) => match num(a) {
            Some(n) => run_user("spin", utasks::spin, n),
            None => bad_argument(task, "spin=N needs a decimal iteration count"),
        },
        (b"exit", a) => match num(a) {
            Some(n) if n <= 255 => exit_vm(n as u8),
            _ => bad_argument(task, "exit=N needs N in 0..=255"),
        },
        (b"hostile-virtio", None) => hostile(info),
        (b"triple-fault", None) => {
            kprintln!("{{\"probe\":\"triple-fault\",\"raising\":true}}");
            cpu::triple_fault()
        }
        _ => {
            kprintln!(
                "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"unknown task\"}}",
                Lossy(name)
            );
            STATUS_UNKNOWN_TASK
        }
    }
}

fn bad_argument(task: &[u8], why: &str) -> u8 {
    let name = task.split(|&b| b == b'=').next().unwrap_or(task);
    kprintln!(
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\",\"task\":\"{}\"}}",
        Lossy(name),
        why,
        Lossy(task)
    );
    STATUS_UNKNOWN_TASK
}

/// Seconds a user task may run (`probe.task_timeout=`, 0 = unlimited).
const DEFAULT_TASK_TIMEOUT_S: u64 = 600;

fn timeout() -> u64 {
    bootinfo::get()
        .param(b"probe.task_timeout")
        .and_then(|v| core::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_TASK_TIMEOUT_S)
}

fn run_user(name: &str, entry: UserEntry, param: u64) -> u8 {
    finish(name, user::run(entry, param, timeout()))
}

/// The task's status from how it ended; reports time-outs and faults.
fn finish(name: &str, outcome: Outcome) -> u8 {
    let timeout = timeout();
    match outcome {
        Outcome::Exit(code) => code,
        Outcome::TimedOut => {
            kprintln!(
                "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"task still running after {} s\"}}",
                name,
                timeout
            );
            STATUS_USER_FAULT
        }
        Outcome::Fault(f) => {
            let expected = name == "fault" && f.vector == 14 && f.cr2 == utasks::FAULT_ADDR;
            kprint!("{{\"probe\":\"{}\",\"ok\":{},", name, expected);
            if !expected {
                kprint!("\"error\":\"user-mode exception\",");
            }
            kprintln!(
                "\"vector\":{},\"exception\":\"{}\",\"error_code\":{},\"rip\":\"{:#x}\",\"cr2\":\"{:#x}\",\"cpl\":3}}",
                f.vector,
                cpu::exception_name(f.vector),
                f.error,
                f.rip,
                f.cr2
            );
            if expected {
                0
            } else {
                STATUS_USER_FAULT
            }
        }
    }
}

fn timer_task() -> u8 {
    let t0 = timer::ticks();
    let c0 = crate::arch::rdtsc();
    timer::wait_for(200, || false);
    let cycles = crate::arch::rdtsc() - c0;
    kprintln!(
        "{{\"probe\":\"timer\",\"tsc_hz\":{},\"tsc_source\":\"{}\",\"lapic_timer_hz\":{},\"tick_hz\":{},\"timer_ok\":{},\"ticks\":{},\"cycles\":{},\"ns\":{}}}",
        timer::tsc_hz(),
        timer::source(),
        timer::lapic_hz(),
        timer::TICK_HZ,
        timer::timer_ok(),
        timer::ticks() - t0,
        cycles,
        timer::cycles_to_ns(cycles)
    );
    0
}

fn hostile(info: &BootInfo) -> u8 {
    let (spare, _) = user::arena();
    let h = match virtio::hostile(0, info.ram_end(), spare) {
        Ok(h) => h,
        Err(e) => {
            kprintln!(
                "{{\"probe\":\"hostile-virtio\",\"ok\":false,\"error\":\"{}\"}}",
                if virtio::count() == 0 {
                    "no virtio-blk disk"
                } else {
                    e.name()
                }
            );
            return STATUS_BLK_FAILED;
        }
    };
    let completed = h.results[..h.cases]
        .iter()
        .filter(|r| r.completed > 0)
        .count();
    kprint!(
        "{{\"probe\":\"hostile-virtio\",\"cases\":{},\"completed\":{},\"good_read\":{},",
        h.cases,
        completed,
        h.good_read
    );
    if !h.error.is_empty() {
        kprint!("\"error\":\"{}\",", h.error);
    }
    kprint!("\"results\":[");
    for (i, r) in h.results[..h.cases].iter().enumerate() {
        kprint!(
            "{}{{\"case\":\"{}\",\"used_entries\":{},\"status\":{}}}",
            if i > 0 { "," } else { "" },
            r.name,
            r.completed,
            r.status
        );
    }
    kprintln!("]}}");
    if h.good_read {
        0
    } else {
        STATUS_BLK_FAILED
    }
}

pub fn read_only_note() {
    for i in 0..virtio::count() {
        if virtio::read_only(i) {
            kprintln!("probe: disk {} is read-only (writes will fail)", i);
        }
    }
}
