//! User-mode (CPL3) tasks: entering them, their system calls, and their faults.
//!
//! A task runs on one CPU (the BSP unless told otherwise; an AP gets it through its
//! mailbox, `smp::post_user`) with `iretq` into the user code segment and interrupts
//! enabled. Each CPU has its own saved kernel stack pointer, TSS, deadline and fault slot.
//!
//! System calls enter through an exception: user code calls `user_syscall_gate`, whose `ud2`
//! raises #UD, and the kernel treats a #UD at exactly that address from CPL3 as a system
//! call and resumes after it. The usual gates do not work on PVM, the paging-based KVM of the
//! development machines: `int 0x80` from user mode is run by an instruction emulator that
//! has no protected-mode software interrupts (#UD), and SYSCALL lands at LSTAR still in user
//! mode. Exceptions from user mode are delivered through the guest IDT everywhere.
//! `run_user` saves the kernel's callee-saved registers and stack pointer; the exit system
//! call and a CPL3 fault come back through `resume_kernel`, which drops whatever was on the
//! kernel stack below that point and returns from `run_user`.
//!
//! Memory: a task owns one arena of RAM above 2 MiB (user pages); it also reads and executes
//! the kernel's text and rodata (user, read-only). Everything else in the first 2 MiB is
//! kernel-only. Block requests hand arena addresses straight to the device (identity
//! mapping): the kernel copies nothing.

use core::sync::atomic::{AtomicBool, Ordering};

use crate::abi::{self, Error};
use crate::arch::rdtsc;
use crate::bootinfo::BootInfo;
use crate::cpu::{self, TrapFrame, UCODE, UDATA};
use crate::global::Global;
use crate::{file, mm, paging, pmem, serial, smp, timer, virtio};

static ARENA: Global<(u64, u64)> = Global::new((0, 0));

/// What ended the current task on `cpu`, if a fault did.
fn fault_info(cpu: usize) -> &'static mut Option<FaultInfo> {
    // SAFETY: the slot is used only by that CPU while its task runs (set by the trap path
    // of the task's fault, read by `enter` once the task is over), and by the BSP once that
    // CPU reported the job done; each use ends before the next begins.
    unsafe { smp::per_cpu(cpu).fault.get() }
}

const USER_STACK: u64 = 256 * 1024;
const MAX_ARENA: u64 = 256 << 20;
const MIN_ARENA: u64 = 32 << 20;
/// Bytes at the end of a task's data area that hold its parameters (`run_task`).
const PARAM_BYTES: u64 = 512;

#[derive(Clone, Copy)]
pub struct FaultInfo {
    pub vector: u64,
    pub error: u64,
    pub rip: u64,
    pub cr2: u64,
}

pub enum Outcome {
    Exit(u8),
    Fault(FaultInfo),
    /// Still running in user mode when its time ran out (`probe.task_timeout`).
    TimedOut,
    /// The CPU asked for is not online or still runs an earlier task.
    NoCpu,
}

/// Entry of a user task: (arena base, arena bytes usable for data, task parameter).
pub type UserEntry = extern "C" fn(u64, u64, u64) -> !;

core::arch::global_asm!(
    r#"
    .section .text.user, "ax"
    .code64
    .global run_user_asm
run_user_asm:
    push %rbx
    push %rbp
    push %r12
    push %r13
    push %r14
    push %r15
    imul ${per_cpu_size}, %r9, %rax
    mov %rsp, {per_cpu}+{ksave}(%rax)
    # The TSSs share a page that every CPU reads at each interrupt from user mode: write
    # this CPU's kernel stack pointer there only when it changed (on a VM over several
    # hosts a write takes the page from the other nodes); it is the same for every task.
    imul ${tss_stride}, %r9, %rax
    cmp %rsp, {tss}+4(%rax)
    je 1f
    mov %rsp, {tss}+4(%rax)
1:
    pushq ${udata}
    push %rsi
    pushq $0x202
    pushq ${ucode}
    push %rdi
    mov %rdx, %rdi
    mov %rcx, %rsi
    mov %r8, %rdx
    xor %eax, %eax
    xor %ebx, %ebx
    xor %ecx, %ecx
    xor %ebp, %ebp
    xor %r8d, %r8d
    xor %r9d, %r9d
    xor %r10d, %r10d
    xor %r11d, %r11d
    xor %r12d, %r12d
    xor %r13d, %r13d
    xor %r14d, %r14d
    xor %r15d, %r15d
    iretq

    .global resume_kernel_asm
resume_kernel_asm:
    imul ${per_cpu_size}, %rsi, %rsi
    mov {per_cpu}+{ksave}(%rsi), %rsp
    mov %rdi, %rax
    pop %r15
    pop %r14
    pop %r13
    pop %r12
    pop %rbp
    pop %rbx
    ret
    "#,
    per_cpu = sym smp::PER_CPU,
    per_cpu_size = const core::mem::size_of::<smp::PerCpu>(),
    ksave = const core::mem::offset_of!(smp::PerCpu, ksave),
    tss = sym cpu::TSS_AREA,
    tss_stride = const cpu::TSS_STRIDE,
    udata = const UDATA,
    ucode = const UCODE,
    options(att_syntax)
);

extern "C" {
    /// Enters `entry` at CPL3 on stack `rsp` with arguments `a0..a2` on CPU `cpu` (the
    /// calling one); returns the code that `resume_kernel_asm` was given.
    ///
    /// # Safety
    /// `entry` and `rsp` must lie in memory the task may use (kernel text, its arena), and
    /// `cpu`'s TSS must be loaded: it receives the kernel stack pointer for traps from user
    /// mode.
    fn run_user_asm(entry: u64, rsp: u64, a0: u64, a1: u64, a2: u64, cpu: u64) -> u64;
    /// Returns `code` from the current `run_user_asm` of CPU `cpu` (the calling one),
    /// dropping the kernel stack above it.
    ///
    /// # Safety
    /// A `run_user_asm` must be under way on `cpu`, and nothing on the kernel stack between
    /// it and the caller may need dropping (only the trap path and system calls call this).
    fn resume_kernel_asm(code: u64, cpu: u64) -> !;
}

/// Picks the task arena and the kernel's page pool (`mm`) from the largest usable-RAM
/// stretch between 2 MiB and 3 GiB: the arena is its first quarter (at least 32 MiB, at most
/// 256 MiB; half of a stretch under 64 MiB), the pool the rest.
pub fn init(info: &BootInfo, mapped_end: u64) {
    let mut best = (0u64, 0u64);
    for e in info.memmap().iter().filter(|e| e.kind == 1) {
        let lo = e.addr.max(2 << 20).next_multiple_of(1 << 21);
        let hi = (e.addr + e.size).min(3 << 30).min(mapped_end);
        if hi > lo && hi - lo > best.1 {
            best = (lo, hi - lo);
        }
    }
    let (lo, len) = best;
    let arena = if len < MIN_ARENA * 2 {
        len / 2
    } else {
        (len / 4).clamp(MIN_ARENA, MAX_ARENA)
    } & !((1 << 21) - 1);
    // SAFETY: boot, on the BSP, before anything reads ARENA.
    unsafe { *ARENA.get() = (lo, arena) };
    mm::init(lo + arena, lo + len);
}

pub fn arena() -> (u64, u64) {
    // SAFETY: written once by `init` at boot; read-only afterwards.
    unsafe { *ARENA.get() }
}

/// Bytes of the arena a user task gets as its buffer (`run`): the arena less its stack.
pub fn data_bytes() -> u64 {
    arena().1.saturating_sub(USER_STACK)
}

/// Runs `entry` with a copy of `task` (at the end of its data area) as its parameter: the
/// entry gets the address of the copy, and a data area without it. On CPU `cpu`.
pub fn run_task<T: Copy>(cpu: usize, entry: UserEntry, task: &T, timeout_s: u64) -> Outcome {
    const {
        assert!(
            core::mem::size_of::<T>() as u64 <= PARAM_BYTES && core::mem::align_of::<T>() <= 4096
        )
    };
    let (base, len) = arena();
    if len < USER_STACK * 2 {
        return Outcome::Exit(abi::STATUS_USER_FAULT);
    }
    let at = base + len - USER_STACK - PARAM_BYTES;
    // SAFETY: `at` is in the arena (checked above to hold the stack and these bytes), which
    // no task is using now; `T` fits in PARAM_BYTES (the const assertion) and the arena
    // is 2 MiB-aligned, so `at` is aligned for it.
    unsafe { core::ptr::write(at as *mut T, *task) };
    run_inner(cpu, entry, at, timeout_s, PARAM_BYTES)
}

/// Runs `entry` at CPL3 on CPU `cpu` until it exits or faults.
pub fn run(cpu: usize, entry: UserEntry, param: u64, timeout_s: u64) -> Outcome {
    run_inner(cpu, entry, param, timeout_s, 0)
}

/// Raw codes of `enter` besides an exit status (0..=255).
const FAULTED: u64 = u64::MAX;
const TIMED_OUT: u64 = u64::MAX - 1;
/// Time the BSP allows an AP past its task's deadline to report in.
const AP_GRACE_S: u64 = 2;

fn run_inner(cpu: usize, entry: UserEntry, param: u64, timeout_s: u64, reserved: u64) -> Outcome {
    let (base, len) = arena();
    if len < USER_STACK * 2 {
        return Outcome::Exit(abi::STATUS_USER_FAULT);
    }
    crate::file::reset();
    mm::reset();
    let top = (base + len) & !15;
    // A zero return address, so the entry sees the stack alignment of a called function.
    // SAFETY: `top - 8` is an aligned word at the top of the arena, which no task uses now.
    unsafe { core::ptr::write_volatile((top - 8) as *mut u64, 0) };
    let deadline = match timeout_s {
        0 => 0,
        s => rdtsc().saturating_add(s.saturating_mul(timer::tsc_hz())),
    };
    let args = [base, len - USER_STACK - reserved, param];
    let entry = entry as usize as u64;
    if cpu == 0 {
        let code = enter(0, entry, top - 8, args, deadline);
        // A network or vsock task leaves its device writing into the arena: stop it.
        virtio::net::close();
        return outcome(0, code);
    }
    let job = smp::Job {
        entry,
        rsp: top - 8,
        a: args,
        deadline,
        worker: false,
    };
    if smp::post_user(cpu, job).is_err() {
        return Outcome::NoCpu;
    }
    let until = match deadline {
        0 => 0,
        d => d.saturating_add(AP_GRACE_S * timer::tsc_hz()),
    };
    let r = smp::wait(cpu, until);
    virtio::net::close();
    match r {
        Some(code) => outcome(cpu, code),
        None => Outcome::TimedOut,
    }
}

/// Runs `entry(a[0], a[1], a[2])` at CPL3 on stack `rsp` on this CPU, `cpu`, until it
/// exits, faults or (seen by this CPU's tick) the TSC passes `deadline` (0: no limit).
/// Returns the raw code for `outcome`.
pub fn enter(cpu: usize, entry: u64, rsp: u64, a: [u64; 3], deadline: u64) -> u64 {
    *fault_info(cpu) = None;
    smp::per_cpu(cpu)
        .deadline
        .store(deadline, Ordering::Relaxed);
    // SAFETY: callers pass a task body in kernel text (mapped user-readable) and a stack in
    // the task arena; `cpu` is the calling CPU, whose TSS `cpu::load` loaded.
    let code = unsafe { run_user_asm(entry, rsp, a[0], a[1], a[2], cpu as u64) };
    smp::per_cpu(cpu).deadline.store(0, Ordering::Relaxed);
    code
}

/// What a raw code from `enter` on `cpu` means.
pub fn outcome(cpu: usize, code: u64) -> Outcome {
    match *fault_info(cpu) {
        _ if code == TIMED_OUT => Outcome::TimedOut,
        Some(f) if code == FAULTED => Outcome::Fault(f),
        _ => Outcome::Exit(code as u8),
    }
}

/// Called on every tick that interrupted user mode on `cpu`: ends a task that overran its
/// time. The tick's EOI has been sent; the abandoned kernel stack holds nothing of value.
pub fn check_deadline(cpu: usize) {
    let d = smp::per_cpu(cpu).deadline.load(Ordering::Relaxed);
    if d != 0 && rdtsc() > d {
        // SAFETY: a deadline is set only while `run_user_asm` runs on `cpu`, and the tick's
        // trap frame below holds nothing that needs dropping.
        unsafe { resume_kernel_asm(TIMED_OUT, cpu as u64) }
    }
}

/// The calling task's deadline (TSC; 0: none).
pub fn deadline(cpu: usize) -> u64 {
    smp::per_cpu(cpu).deadline.load(Ordering::Relaxed)
}

/// Ends the current task after a CPL3 exception (already reported by the trap path).
pub fn fault(f: &TrapFrame, cr2: u64) -> ! {
    let cpu = smp::current();
    *fault_info(cpu) = Some(FaultInfo {
        vector: f.vector,
        error: f.error,
        rip: f.rip,
        cr2,
    });
    // SAFETY: the fault came from CPL3, so `run_user_asm` is under way on this CPU; the
    // trap frame below is plain data.
    unsafe { resume_kernel_asm(FAULTED, cpu as u64) }
}

pub fn in_arena(addr: u64, len: u64) -> bool {
    let (base, alen) = arena();
    addr >= base && len <= alen && addr - base <= alen - len
}

/// What the task may have the kernel read: its arena, or kernel text/rodata (string literals).
fn readable(addr: u64, len: u64) -> bool {
    let (lo, hi) = paging::user_ro_range();
    in_arena(addr, len) || (addr >= lo && len <= hi - lo && addr - lo <= hi - lo - len)
}

/// Held while a system call writes to the console.
static SERIAL_LOCK: AtomicBool = AtomicBool::new(false);

/// `cpu_start`: the BSP's task starts `entry(arg, cpu, 0)` on AP `cpu`.
fn cpu_start(cpu: usize, entry: u64, stack_top: u64, arg: u64) -> Result<u64, Error> {
    let (lo, hi) = paging::user_ro_range();
    let rsp = (stack_top & !15).wrapping_sub(8);
    if smp::current() != 0 || cpu == 0 {
        return Err(Error::NoSuchCpu);
    }
    if entry < lo || entry >= hi || !in_arena(rsp, 8) {
        return Err(Error::BadArgument);
    }
    let job = smp::Job {
        entry,
        rsp,
        a: [arg, cpu as u64, 0],
        deadline: deadline(0),
        worker: true,
    };
    smp::post_user(cpu, job).map(|_| 0).map_err(|e| match e {
        smp::PostError::NoCpu => Error::NoSuchCpu,
        smp::PostError::Busy => Error::Busy,
    })
}

/// `cpu_wait`: the BSP's task waits for AP `cpu`'s entry to end.
fn cpu_wait(cpu: usize) -> Result<u64, Error> {
    if smp::current() != 0 || cpu == 0 || smp::node_of(cpu).is_none() {
        return Err(Error::NoSuchCpu);
    }
    let until = match deadline(0) {
        0 => 0,
        d => d.saturating_add(AP_GRACE_S * timer::tsc_hz()),
    };
    match smp::wait(cpu, until).map(|code| outcome(cpu, code)) {
        Some(Outcome::Exit(c)) => Ok(c as u64),
        Some(Outcome::Fault(f)) => Ok(abi::CPU_FAULTED | f.vector),
        Some(_) => Ok(abi::CPU_TIMED_OUT),
        None => Err(Error::Timeout),
    }
}

/// True if `code` (a job result from `enter`) says the task ran out of time.
pub fn timed_out(code: u64) -> bool {
    code == TIMED_OUT
}

pub fn syscall(f: &mut TrapFrame) {
    let (a0, a1, a2, a3) = (f.rdi, f.rsi, f.rdx, f.r10);
    let shared_safe = matches!(
        f.rax,
        abi::SYS_EXIT
            | abi::SYS_WRITE
            | abi::SYS_TSC_HZ
            | abi::SYS_GETPID
            | abi::SYS_CPU_COUNT
            | abi::SYS_CPU_NODE
            // A worker attaches to its own queue pair only and waits on it; both read
            // atomics that the task's bring-up wrote before it started any worker.
            | abi::SYS_NET_OPEN
            | abi::SYS_NET_WAIT
            | abi::SYS_STATS
    );
    let result: Result<u64, Error> = match f.rax {
        _ if !shared_safe && smp::on_worker() => Err(Error::NoSuchCall),
        // SAFETY: a system call comes from the running task, inside `run_user_asm` on this
        // CPU.
        abi::SYS_EXIT => unsafe { resume_kernel_asm(a0 & 0xff, smp::current() as u64) },
        abi::SYS_WRITE => {
            if readable(a0, a1) {
                // One CPU's line at a time: tasks on several CPUs may write at once.
                while SERIAL_LOCK.swap(true, Ordering::Acquire) {
                    core::hint::spin_loop();
                }
                // SAFETY: `readable` checked that the bytes are in the task's arena or the
                // kernel's read-only image, both mapped; the task is stopped in this call.
                serial::write(unsafe { core::slice::from_raw_parts(a0 as *const u8, a1 as usize) });
                SERIAL_LOCK.store(false, Ordering::Release);
                Ok(a1)
            } else {
                Err(Error::BadArgument)
            }
        }
        abi::SYS_DISK_COUNT => Ok(virtio::count() as u64),
        abi::SYS_DISK_CAPACITY => virtio::capacity(a0 as usize),
        abi::SYS_BLK_READ | abi::SYS_BLK_WRITE => {
            let write = f.rax == abi::SYS_BLK_WRITE;
            if in_arena(a2, a3) {
                virtio::rw(a0 as usize, write, a1, a2, a3).map(|_| 0)
            } else {
                Err(Error::BadArgument)
            }
        }
        abi::SYS_BLK_FLUSH => virtio::flush(a0 as usize).map(|_| 0),
        abi::SYS_BLK_GET_ID => {
            if in_arena(a1, virtio::ID_LEN) {
                virtio::get_id(a0 as usize, a1).map(|_| virtio::ID_LEN)
            } else {
                Err(Error::BadArgument)
            }
        }
        abi::SYS_TSC_HZ => Ok(timer::tsc_hz()),
        abi::SYS_GETPID => Ok(1),
        abi::SYS_PMEM_COUNT => Ok(pmem::count() as u64),
        abi::SYS_PMEM_INFO => match pmem::region(a0 as usize) {
            Some(r) => match a1 {
                abi::PMEM_BASE => Ok(r.base),
                abi::PMEM_SIZE => Ok(r.size),
                abi::PMEM_SOURCE => Ok(r.dev.is_some() as u64),
                _ => Err(Error::BadArgument),
            },
            None => Err(Error::BadFd),
        },
        abi::SYS_PMEM_FLUSH => pmem::flush(a0 as usize).map(|f| f as u64),
        abi::SYS_OPEN => file::open(a0, a1, a2, a3),
        abi::SYS_READ => file::rw(a0, false, a1, a2),
        abi::SYS_WRITE_FD => file::rw(a0, true, a1, a2),
        abi::SYS_LSEEK => file::lseek(a0, a1),
        abi::SYS_FSYNC => file::fsync(a0),
        abi::SYS_MMAP => file::mmap(a0),
        abi::SYS_DROP_CACHES => file::drop_caches(a0),
        abi::SYS_STATS => match a0 {
            abi::STAT_KERNEL_COPY_BYTES => Ok(mm::KCOPY_BYTES.load(Ordering::Relaxed)),
            abi::STAT_PAGE_FAULTS => Ok(mm::PAGE_FAULTS.load(Ordering::Relaxed)),
            abi::STAT_VIRTIO_REQUESTS => Ok(virtio::REQUESTS.load(Ordering::Relaxed)),
            abi::STAT_INTERRUPTS => Ok(virtio::total_irqs()),
            abi::STAT_NET_INTERRUPTS => Ok(virtio::net::irq_count(abi::DEV_NET as usize)),
            abi::STAT_VSOCK_INTERRUPTS => Ok(virtio::net::irq_count(abi::DEV_VSOCK as usize)),
            _ => Err(Error::BadArgument),
        },
        abi::SYS_ANON_MAP => mm::map_window(mm::Which::Anon, a0).ok_or(Error::NoMemory),
        abi::SYS_CPU_COUNT => Ok(smp::online() as u64),
        abi::SYS_CPU_NODE => smp::node_of(a0 as usize)
            .map(u64::from)
            .ok_or(Error::NoSuchCpu),
        abi::SYS_CPU_START => cpu_start(a0 as usize, a1, a2, a3),
        abi::SYS_CPU_WAIT => cpu_wait(a0 as usize),
        abi::SYS_NET_OPEN => virtio::net::open(a1, a0),
        abi::SYS_NET_WAIT => virtio::net::wait(a0, a1, a2),
        abi::SYS_RNG_READ => {
            if in_arena(a0, a1) {
                virtio::rng_read(a0, a1)
            } else {
                Err(Error::BadArgument)
            }
        }
        _ => Err(Error::NoSuchCall),
    };
    f.rax = match result {
        Ok(v) => v,
        Err(e) => e.encode(),
    };
}
