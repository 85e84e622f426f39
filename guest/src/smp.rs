//! CPU discovery (Intel MP table, else ACPI MADT) and AP start-up (INIT, SIPI, SIPI).

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::apic;
use crate::arch::{rdtsc, sti_hlt_cli};
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

/// Kernel stack of each AP; also what its traps from user mode run on (`current` tells
/// the CPUs apart by it).
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
    let cpu = idx as usize;
    cpu::load(cpu);
    apic::enable();
    CPU_APIC[cpu].store(apic::id(), Ordering::Relaxed);
    CPU_NODE[cpu].store(apic::this_node(), Ordering::Relaxed);
    init_per_cpu(cpu);
    if apic::nodes() > 1 {
        read_user_image();
    }
    timer::start_ap_timer();
    CPU_UP[cpu].store(true, Ordering::SeqCst);
    ONLINE.fetch_add(1, Ordering::SeqCst);
    let mb = mailbox(cpu);
    loop {
        if mb.state.load(Ordering::Acquire) != POSTED {
            // Woken by the dispatch IPI or, should one be lost, by this CPU's tick.
            sti_hlt_cli();
            continue;
        }
        mb.state.store(RUNNING, Ordering::SeqCst);
        // Another task may have changed the user windows since this CPU last ran one.
        crate::paging::flush_tlb();
        let a = [
            mb.a0.load(Ordering::Relaxed),
            mb.a1.load(Ordering::Relaxed),
            mb.a2.load(Ordering::Relaxed),
        ];
        let entry = mb.entry.load(Ordering::Relaxed);
        let result = if mb.kernel.load(Ordering::Relaxed) {
            // SAFETY: `post_kernel` stored a `KernelJob` function pointer here.
            let f: KernelJob = unsafe { core::mem::transmute::<u64, KernelJob>(entry) };
            f(a[0])
        } else {
            crate::user::enter(
                cpu,
                entry,
                mb.rsp.load(Ordering::Relaxed),
                a,
                mb.deadline.load(Ordering::Relaxed),
            )
        };
        mb.result.store(result, Ordering::Relaxed);
        mb.state.store(DONE, Ordering::SeqCst);
        apic::send_ipi(CPU_APIC[0].load(Ordering::Relaxed), WAKE_IPI);
    }
}

/// Reads every page of the kernel image that user tasks execute or read (text and rodata),
/// with interrupts off, so that this CPU's node holds a read copy of each before any user
/// task runs here.
///
/// On a VM spread over several hosts, a page a node lacks is fetched when a vCPU first
/// touches it. From user mode with interrupts on, KVM hands that fault to a kernel worker
/// that asks for the page as if to write it (its asynchronous page faults), so a node that
/// only executes the page takes it from every other node, which then take it back the same
/// way: the code page of a task running on four nodes moved about 300 times a second. With
/// interrupts off, KVM faults the page in itself, as the read it is, and nodes share it.
fn read_user_image() {
    let (start, end) = crate::paging::user_ro_range();
    let mut page = start;
    while page < end {
        // SAFETY: the kernel image is mapped (identity, readable) from `start` to `end`.
        unsafe { core::ptr::read_volatile(page as *const u8) };
        page += 4096;
    }
}

/// Vector of the IPI that tells a CPU its mailbox has work (or the BSP that a job is done);
/// its handler only acknowledges it.
pub const WAKE_VECTOR: u64 = 0x50;
/// ICR low word of a wake-up: fixed delivery, level assert, no shorthand.
const WAKE_IPI: u32 = (1 << 14) | WAKE_VECTOR as u32;

/// APIC id and node of each CPU index (0: the BSP; APs in the order they reported in).
static CPU_APIC: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];
static CPU_NODE: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];
static CPU_UP: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// A function an AP runs at CPL0 for the BSP (`post_kernel`); returns the job's result.
pub type KernelJob = fn(u64) -> u64;

const IDLE: u32 = 0;
const POSTED: u32 = 1;
const RUNNING: u32 = 2;
const DONE: u32 = 3;

/// One CPU's work slot. The BSP fills it and sets `state` to POSTED; the CPU runs the job,
/// stores `result` and sets DONE; the BSP takes the result and sets IDLE. A DONE slot whose
/// result nobody collected (its waiter gave up) may be posted to again.
#[repr(C, align(64))]
struct Mailbox {
    state: AtomicU32,
    kernel: AtomicBool,
    /// A worker of a task that runs on several CPUs at once (`user::cpu_start`).
    worker: AtomicBool,
    entry: AtomicU64,
    rsp: AtomicU64,
    a0: AtomicU64,
    a1: AtomicU64,
    a2: AtomicU64,
    deadline: AtomicU64,
    result: AtomicU64,
}

/// What one CPU writes while tasks run, on a page of its own: on a VM spread over several
/// hosts, a write to a page another CPU reads takes that page away from the other's node, and
/// these are written at every task's start and end and read at every tick.
#[repr(C, align(4096))]
pub struct PerCpu {
    mailbox: Mailbox,
    /// TSC value after which a task that the tick finds in user mode is ended; 0 = no limit.
    pub deadline: AtomicU64,
    /// The kernel stack pointer `user::run_user_asm` saved, to resume at.
    pub ksave: AtomicU64,
    /// What ended the CPU's current task, if a fault did (`user::fault_info`).
    pub fault: Global<Option<crate::user::FaultInfo>>,
}

/// Never zeroed as a whole (CPL0 code is slow on nested KVM): each CPU sets its own page up
/// when it comes online (`init_per_cpu`), and only pages of CPUs that did are touched.
#[link_section = ".noinit.percpu"]
pub(crate) static PER_CPU: [PerCpu; MAX_CPUS] = [const {
    PerCpu {
        mailbox: Mailbox {
            state: AtomicU32::new(IDLE),
            kernel: AtomicBool::new(false),
            worker: AtomicBool::new(false),
            entry: AtomicU64::new(0),
            rsp: AtomicU64::new(0),
            a0: AtomicU64::new(0),
            a1: AtomicU64::new(0),
            a2: AtomicU64::new(0),
            deadline: AtomicU64::new(0),
            result: AtomicU64::new(0),
        },
        deadline: AtomicU64::new(0),
        ksave: AtomicU64::new(0),
        fault: Global::new(None),
    }
}; MAX_CPUS];

/// CPU `cpu`'s own page (the last one for an index out of range).
pub fn per_cpu(cpu: usize) -> &'static PerCpu {
    &PER_CPU[cpu.min(MAX_CPUS - 1)]
}

/// Sets up the calling CPU's page, before it counts as up.
fn init_per_cpu(cpu: usize) {
    let p = per_cpu(cpu);
    let mb = &p.mailbox;
    mb.state.store(IDLE, Ordering::Relaxed);
    mb.kernel.store(false, Ordering::Relaxed);
    mb.worker.store(false, Ordering::Relaxed);
    for f in [
        &mb.entry,
        &mb.rsp,
        &mb.a0,
        &mb.a1,
        &mb.a2,
        &mb.deadline,
        &mb.result,
    ] {
        f.store(0, Ordering::Relaxed);
    }
    p.deadline.store(0, Ordering::Relaxed);
    p.ksave.store(0, Ordering::Relaxed);
    // SAFETY: the CPU is not up yet, so nothing else uses its fault slot.
    unsafe { *p.fault.get() = None };
}

fn mailbox(cpu: usize) -> &'static Mailbox {
    &per_cpu(cpu).mailbox
}

/// Records the BSP as CPU 0 (after `apic::pv_detect`, before `start_aps`).
pub fn init_bsp(bsp: u32) {
    init_per_cpu(0);
    CPU_APIC[0].store(bsp, Ordering::Relaxed);
    CPU_NODE[0].store(apic::this_node(), Ordering::Relaxed);
    CPU_UP[0].store(true, Ordering::SeqCst);
}

pub fn online() -> usize {
    ONLINE.load(Ordering::SeqCst) as usize
}

/// The node CPU `cpu` read from CPUID when it came up (0 on a single-node VM).
pub fn node_of(cpu: usize) -> Option<u32> {
    (cpu < MAX_CPUS && CPU_UP[cpu].load(Ordering::SeqCst))
        .then(|| CPU_NODE[cpu].load(Ordering::Relaxed))
}

/// Index of the CPU running this kernel code, from the stack it runs on (AP `i` runs on
/// AP stack `i - 1`; the BSP, the IST stack and anything else count as CPU 0).
pub fn current() -> usize {
    let rsp: u64;
    // SAFETY: reads the stack pointer; no other effect.
    unsafe {
        core::arch::asm!("mov {}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags))
    };
    let base = AP_STACKS.addr();
    if rsp > base && rsp < base + (AP_STACK_SIZE * (MAX_CPUS - 1)) as u64 {
        ((rsp - base) / AP_STACK_SIZE as u64) as usize + 1
    } else {
        0
    }
}

/// Why a job could not be handed to a CPU.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PostError {
    /// No such CPU, it is not online, or it is the BSP.
    NoCpu,
    /// It still runs an earlier job.
    Busy,
}

/// What an AP runs from its mailbox: `entry` on stack `rsp` with arguments `a`, ended by
/// its tick once the TSC passes `deadline` (0: never). A `worker` runs beside the BSP's
/// task (see `on_worker`).
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub entry: u64,
    pub rsp: u64,
    pub a: [u64; 3],
    pub deadline: u64,
    pub worker: bool,
}

/// Hands `job` to AP `cpu`, to run at CPL0 if `kernel`, else at CPL3.
fn post(cpu: usize, kernel: bool, job: Job) -> Result<(), PostError> {
    if cpu == 0 || node_of(cpu).is_none() {
        return Err(PostError::NoCpu);
    }
    let mb = mailbox(cpu);
    let s = mb.state.load(Ordering::SeqCst);
    if s == POSTED || s == RUNNING {
        return Err(PostError::Busy);
    }
    mb.kernel.store(kernel, Ordering::Relaxed);
    mb.worker.store(job.worker, Ordering::Relaxed);
    mb.entry.store(job.entry, Ordering::Relaxed);
    mb.rsp.store(job.rsp, Ordering::Relaxed);
    mb.a0.store(job.a[0], Ordering::Relaxed);
    mb.a1.store(job.a[1], Ordering::Relaxed);
    mb.a2.store(job.a[2], Ordering::Relaxed);
    mb.deadline.store(job.deadline, Ordering::Relaxed);
    mb.state.store(POSTED, Ordering::SeqCst);
    apic::send_ipi(CPU_APIC[cpu].load(Ordering::Relaxed), WAKE_IPI);
    Ok(())
}

/// Has AP `cpu` run `job` at CPL3 (see `user::enter`).
pub fn post_user(cpu: usize, job: Job) -> Result<(), PostError> {
    post(cpu, false, job)
}

/// Wakes CPU `cpu` from `hlt`: a CPU waiting for a device whose interrupt only the BSP
/// takes is told by the BSP's handler (`virtio::net::irq`).
pub fn wake(cpu: usize) {
    if cpu < MAX_CPUS && CPU_UP[cpu].load(Ordering::Relaxed) {
        apic::send_ipi(CPU_APIC[cpu].load(Ordering::Relaxed), WAKE_IPI);
    }
}

/// True if this CPU runs a worker of a multi-CPU task: other CPUs run user code and system
/// calls at the same time, so it gets only the system calls that touch no shared kernel
/// state, and no demand-paged windows.
pub fn on_worker() -> bool {
    let cpu = current();
    cpu != 0 && mailbox(cpu).worker.load(Ordering::Relaxed)
}

/// Has AP `cpu` run `f(arg)` at CPL0.
pub fn post_kernel(cpu: usize, f: KernelJob, arg: u64) -> Result<(), PostError> {
    let job = Job {
        entry: f as usize as u64,
        rsp: 0,
        a: [arg, 0, 0],
        deadline: 0,
        worker: false,
    };
    post(cpu, true, job)
}

/// Waits until CPU `cpu` finishes its job or the TSC passes `until` (0: no limit); returns
/// the job's result, or `None` if it is still running.
pub fn wait(cpu: usize, until: u64) -> Option<u64> {
    let mb = mailbox(cpu);
    loop {
        if mb.state.load(Ordering::SeqCst) == DONE {
            let r = mb.result.load(Ordering::Relaxed);
            // A job its deadline ended stays DONE, so the task's report names the CPU
            // (`unfinished`) until `reap` clears it before the next task.
            if !crate::user::timed_out(r) {
                mb.state.store(IDLE, Ordering::SeqCst);
            }
            return Some(r);
        }
        if until != 0 && rdtsc() >= until {
            return None;
        }
        timer::idle();
    }
}

/// Forgets the results nobody collected (jobs ended by an earlier task's deadline), so
/// `unfinished` speaks of the next task only.
pub fn reap() {
    for cpu in (0..MAX_CPUS).filter(|&c| node_of(c).is_some()) {
        let _ = mailbox(cpu)
            .state
            .compare_exchange(DONE, IDLE, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// True if CPU `cpu`'s job is still posted or running, or ended by its deadline with
/// nobody collecting the result (for reports of tasks that ran out of time).
pub fn unfinished(cpu: usize) -> bool {
    if node_of(cpu).is_none() {
        return false;
    }
    let mb = mailbox(cpu);
    match mb.state.load(Ordering::SeqCst) {
        POSTED | RUNNING => true,
        DONE => crate::user::timed_out(mb.result.load(Ordering::Relaxed)),
        _ => false,
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

pub(crate) fn rd8(a: u64) -> u8 {
    // SAFETY: a firmware-table address (see above).
    unsafe { core::ptr::read_volatile(a as *const u8) }
}
pub(crate) fn rd16(a: u64) -> u16 {
    // SAFETY: a firmware-table address (see above); unaligned reads are allowed.
    unsafe { core::ptr::read_unaligned(a as *const u16) }
}
pub(crate) fn rd32(a: u64) -> u32 {
    // SAFETY: as in `rd16`.
    unsafe { core::ptr::read_unaligned(a as *const u32) }
}
pub(crate) fn rd64(a: u64) -> u64 {
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

/// The ACPI table with `signature` that the RSDP's XSDT (or RSDT) lists, if it lies below
/// 4 GiB.
pub(crate) fn find_acpi_table(info: &BootInfo, signature: &[u8; 4]) -> Option<u64> {
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
    while a + step <= root + root_len {
        let t = if wide { rd64(a) } else { rd32(a) as u64 };
        if t != 0 && t < 0x1_0000_0000 && rd32(t) == u32::from_le_bytes(*signature) {
            return Some(t);
        }
        a += step;
    }
    None
}

fn from_madt(info: &BootInfo) -> Option<Platform> {
    let madt = find_acpi_table(info, b"APIC")?;
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
