//! Tasks that run user code on several CPUs at once (`fib=N,procs=P`, `shared-counter=N`,
//! `litmus=...`). The task's body on the BSP coordinates: it lays out shared pages at the
//! start of its data area, starts a worker entry on each AP it needs (`ulib::cpu_start`,
//! each AP with its own stack at the end of the data area), does its own share, waits for
//! the APs (`ulib::cpu_wait`) and prints the one result line. Everything here runs at CPL3
//! and uses only `ulib`, the task's arena and its stack.
//!
//! Memory the CPUs share is reached through raw pointers into the arena, with atomics for
//! everything another CPU may touch at the same time; each structure sits on its own 4 KiB
//! page (`Page`), so on a VM spread over several hosts each page moves on its own.

use core::fmt::Write;
use core::hint::{black_box, spin_loop};
use core::sync::atomic::{AtomicU64, Ordering};

use crate::abi::{self, Error, STATUS_UNKNOWN_TASK, STATUS_USER_FAULT, STATUS_WRONG_RESULT};
use crate::ulib::{self, Line};

pub const MAX_PROCS: u64 = 256;
pub const DEFAULT_ITERS: u64 = 1000;
const MAX_CPUS: usize = crate::cpu::MAX_CPUS;
const PAGE: u64 = 4096;
/// User stack of each AP's worker, carved from the end of the data area.
const WORKER_STACK: u64 = 64 * 1024;

type Worker = extern "C" fn(u64, u64, u64) -> !;

/// The data area's first pages hold the shared structures; the stacks come from its end.
fn fits(len: u64, pages: u64) -> bool {
    len >= pages * PAGE + MAX_CPUS as u64 * WORKER_STACK
}

fn stack_top(buf: u64, len: u64, cpu: usize) -> u64 {
    buf + len - (cpu as u64 - 1) * WORKER_STACK
}

/// Page `i` of the shared area at `base` as a `T`.
///
/// # Safety
/// `base` must be the page-aligned start of a data area holding at least `i + 1` pages,
/// `T` must fit in a page and be valid for any bytes (atomics and plain integers), and
/// every CPU may use it only through shared references (atomics for what others change).
unsafe fn page<'a, T>(base: u64, i: u64) -> &'a T {
    const { assert!(core::mem::size_of::<T>() as u64 <= PAGE) };
    &*((base + i * PAGE) as *const T)
}

/// Control page of every coordinated task: what the workers need to know.
#[repr(C)]
struct Control {
    /// Task parameter (N, the test, ...).
    n: AtomicU64,
    /// Second parameter (procs, iterations).
    m: AtomicU64,
    /// Participating CPUs and their ids.
    count: AtomicU64,
    cpus: [AtomicU64; MAX_CPUS],
    /// Set by the coordinator when a worker could not be started: everyone leaves.
    abort: AtomicU64,
    /// Arrivals at the start line.
    arrived: AtomicU64,
}

/// Waits until all `count` participants have arrived (or the task is aborted).
fn start_line(c: &Control) -> bool {
    c.arrived.fetch_add(1, Ordering::SeqCst);
    let n = c.count.load(Ordering::SeqCst);
    while c.arrived.load(Ordering::SeqCst) < n {
        if c.abort.load(Ordering::SeqCst) != 0 {
            return false;
        }
        spin_loop();
    }
    true
}

/// Starts `worker` on every participant but CPU 0 (the coordinator), then waits for the
/// ones started. Returns the first failure as (cpu, what happened) after `own` (CPU 0's
/// share) has run.
fn run_workers(
    buf: u64,
    len: u64,
    c: &Control,
    worker: Worker,
    own: &mut dyn FnMut() -> bool,
) -> Result<(), (usize, &'static str)> {
    let n = c.count.load(Ordering::SeqCst) as usize;
    let mut started = 0;
    let mut failure = None;
    for i in 1..n {
        let cpu = c.cpus[i].load(Ordering::SeqCst) as usize;
        match ulib::cpu_start(cpu, worker, stack_top(buf, len, cpu), buf) {
            Ok(()) => started = i + 1,
            Err(e) => {
                failure = Some((cpu, start_error(e)));
                c.abort.store(1, Ordering::SeqCst);
                break;
            }
        }
    }
    if failure.is_none() && !own() {
        failure = Some((0, "aborted"));
    }
    for i in 1..started {
        let cpu = c.cpus[i].load(Ordering::SeqCst) as usize;
        let what = match ulib::cpu_wait(cpu) {
            Ok(0) => continue,
            Ok(abi::CPU_TIMED_OUT) | Err(Error::Timeout) => "did not finish in time",
            Ok(s) if s & abi::CPU_FAULTED != 0 => "user-mode exception",
            Ok(_) => "worker failed",
            Err(_) => "cannot wait for it",
        };
        failure.get_or_insert((cpu, what));
    }
    failure.map_or(Ok(()), Err)
}

fn start_error(e: Error) -> &'static str {
    match e {
        Error::Busy => "still busy with an earlier task",
        Error::NoSuchCpu => "not online",
        _ => "cannot start",
    }
}

/// Ends the task with an error line naming the CPU that failed.
fn fail(task: &str, why: &str, cpu: Option<usize>, status: u8) -> ! {
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\"",
        task, why
    );
    if let Some(c) = cpu {
        let _ = write!(l, ",\"cpu\":{}", c);
    }
    l.push("}\n");
    l.send();
    ulib::exit(status)
}

/// Sends the line so far once it is nearly full: long lists go out in pieces of one line.
fn spill(l: &mut Line) {
    if l.as_str().len() > 1800 {
        l.send();
    }
}

fn list(l: &mut Line, key: &str, v: impl Iterator<Item = u64>) {
    let _ = write!(l, ",\"{}\":[", key);
    for (i, x) in v.enumerate() {
        l.item(i);
        let _ = write!(l, "{}", x);
    }
    l.push("]");
}

fn node(cpu: usize) -> u64 {
    ulib::cpu_node(cpu).unwrap_or(0)
}

// ---- fib=N,procs=P ----

#[repr(C)]
struct FibSlot {
    cpu: AtomicU64,
    cycles: AtomicU64,
    result: AtomicU64,
    done: AtomicU64,
}

const FIB_SLOTS_PER_PAGE: u64 = PAGE / core::mem::size_of::<FibSlot>() as u64;

fn fib_slot<'a>(buf: u64, i: u64) -> &'a FibSlot {
    let at = buf + PAGE + i * core::mem::size_of::<FibSlot>() as u64;
    // SAFETY: slot `i < MAX_PROCS` lies in the pages after the control page (the
    // coordinator checked the data area holds them); `FibSlot` is atomics only.
    unsafe { &*(at as *const FibSlot) }
}

/// Runs the tasks of CPU number `k` (of `count`): task i for i = k, k + count, ...
fn fib_share(buf: u64, c: &Control, k: u64, cpu: u64) {
    let (n, procs, count) = (
        c.n.load(Ordering::SeqCst),
        c.m.load(Ordering::SeqCst),
        c.count.load(Ordering::SeqCst),
    );
    let mut i = k;
    while i < procs {
        let t0 = ulib::rdtsc();
        let r = workloads::fib(black_box(n));
        let cycles = ulib::rdtsc() - t0;
        let s = fib_slot(buf, i);
        s.cpu.store(cpu, Ordering::Relaxed);
        s.cycles.store(cycles, Ordering::Relaxed);
        s.result.store(r, Ordering::Relaxed);
        s.done.store(1, Ordering::SeqCst);
        i += count;
    }
}

extern "C" fn fib_worker(buf: u64, cpu: u64, _: u64) -> ! {
    // SAFETY: `buf` is the coordinator's data area, page 0 its control page.
    let c: &Control = unsafe { page(buf, 0) };
    let k = (0..c.count.load(Ordering::SeqCst))
        .find(|&i| c.cpus[i as usize].load(Ordering::SeqCst) == cpu)
        .unwrap_or(0);
    fib_share(buf, c, k, cpu);
    ulib::exit(0)
}

fn fib_iter(n: u64) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
        (a, b) = (b, a.wrapping_add(b));
    }
    a
}

/// `fib=N,procs=P` (param `N | P << 32`): P copies of naive recursive fib(N), task i on
/// CPU i mod (CPUs online).
pub extern "C" fn fib_procs(buf: u64, len: u64, param: u64) -> ! {
    let (n, procs) = (param & 0xffff_ffff, param >> 32);
    let pages = 1 + MAX_PROCS.div_ceil(FIB_SLOTS_PER_PAGE);
    if !fits(len, pages) {
        fail(
            "fib",
            "the task arena is too small",
            None,
            STATUS_UNKNOWN_TASK,
        );
    }
    let hz = ulib::tsc_hz();
    let ncpus = ulib::cpu_count().clamp(1, MAX_CPUS) as u64;
    let count = ncpus.min(procs);
    // SAFETY: page 0 of this task's data area (checked above to be large enough).
    let c: &Control = unsafe { page(buf, 0) };
    c.n.store(n, Ordering::SeqCst);
    c.m.store(procs, Ordering::SeqCst);
    c.count.store(count, Ordering::SeqCst);
    for (i, slot) in c.cpus.iter().enumerate() {
        slot.store(i as u64, Ordering::SeqCst);
    }
    c.abort.store(0, Ordering::SeqCst);
    for i in 0..procs {
        fib_slot(buf, i).done.store(0, Ordering::SeqCst);
    }
    let t0 = ulib::rdtsc();
    let r = run_workers(buf, len, c, fib_worker, &mut || {
        fib_share(buf, c, 0, 0);
        true
    });
    let wall = ulib::rdtsc() - t0;
    if let Err((cpu, why)) = r {
        fail("fib", why, Some(cpu), STATUS_USER_FAULT);
    }
    let want = fib_iter(n);
    let mut ok = true;
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"fib\",\"n\":{},\"procs\":{},\"cpus\":{},\"expected\":{},\"tasks\":[",
        n, procs, ncpus, want
    );
    for i in 0..procs {
        let s = fib_slot(buf, i);
        let done = s.done.load(Ordering::SeqCst) != 0;
        let (cpu, cycles, result) = (
            s.cpu.load(Ordering::Relaxed),
            s.cycles.load(Ordering::Relaxed),
            s.result.load(Ordering::Relaxed),
        );
        ok &= done && result == want;
        l.item(i as usize);
        let _ = write!(
            l,
            "{{\"task\":{},\"cpu\":{},\"node\":{},\"done\":{},\"result\":{},\"cycles\":{},\"ns\":{}}}",
            i,
            cpu,
            node(cpu as usize),
            done,
            result,
            cycles,
            ulib::cycles_to_ns(cycles, hz)
        );
        spill(&mut l);
    }
    let _ = writeln!(
        l,
        "],\"wall_cycles\":{},\"wall_ns\":{},\"ok\":{}}}",
        wall,
        ulib::cycles_to_ns(wall, hz),
        ok
    );
    l.send();
    ulib::exit(if ok { 0 } else { STATUS_WRONG_RESULT })
}

// ---- shared-counter=N ----

/// A test-and-set spinlock (`xchg`) and the counter it guards, on one page.
#[repr(C)]
struct Locked {
    lock: AtomicU64,
    counter: AtomicU64,
}

fn lock(l: &AtomicU64) {
    while l.swap(1, Ordering::Acquire) != 0 {
        while l.load(Ordering::Relaxed) != 0 {
            spin_loop();
        }
    }
}

fn unlock(l: &AtomicU64) {
    l.store(0, Ordering::Release);
}

/// `lock xadd`, spelled out (a `fetch_add` whose result is unused may become `lock add`).
fn xadd(p: &AtomicU64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: an atomic read-modify-write of the `AtomicU64` that `p` refers to.
    unsafe {
        core::arch::asm!(
            "lock xadd qword ptr [{p}], {r}",
            p = in(reg) p.as_ptr(),
            r = inout(reg) r,
            options(nostack, preserves_flags),
        )
    };
    r
}

fn counter_share(buf: u64) -> bool {
    // SAFETY: pages 0..3 of the coordinator's data area (checked by `shared_counter`).
    let (c, locked, xadded): (&Control, &Locked, &AtomicU64) =
        unsafe { (page(buf, 0), page(buf, 1), page(buf, 2)) };
    if !start_line(c) {
        return false;
    }
    let n = c.n.load(Ordering::SeqCst);
    for _ in 0..n {
        lock(&locked.lock);
        // A plain read and write: only the lock makes the sum exact.
        let v = locked.counter.load(Ordering::Relaxed);
        locked.counter.store(v + 1, Ordering::Relaxed);
        unlock(&locked.lock);
    }
    for _ in 0..n {
        xadd(xadded, 1);
    }
    true
}

extern "C" fn counter_worker(buf: u64, _cpu: u64, _: u64) -> ! {
    ulib::exit(if counter_share(buf) {
        0
    } else {
        STATUS_USER_FAULT
    })
}

/// `shared-counter=N`: every CPU adds 1 N times to a counter under a spinlock and N
/// times to another with `lock xadd`; both must end at CPUs × N.
pub extern "C" fn shared_counter(buf: u64, len: u64, n: u64) -> ! {
    if !fits(len, 3) {
        fail(
            "shared-counter",
            "the task arena is too small",
            None,
            STATUS_UNKNOWN_TASK,
        );
    }
    let hz = ulib::tsc_hz();
    let ncpus = ulib::cpu_count().clamp(1, MAX_CPUS);
    // SAFETY: pages 0..3 of this task's data area (checked above).
    let (c, locked, xadded): (&Control, &Locked, &AtomicU64) =
        unsafe { (page(buf, 0), page(buf, 1), page(buf, 2)) };
    c.n.store(n, Ordering::SeqCst);
    c.count.store(ncpus as u64, Ordering::SeqCst);
    for (i, slot) in c.cpus.iter().enumerate() {
        slot.store(i as u64, Ordering::SeqCst);
    }
    c.abort.store(0, Ordering::SeqCst);
    c.arrived.store(0, Ordering::SeqCst);
    locked.lock.store(0, Ordering::SeqCst);
    locked.counter.store(0, Ordering::SeqCst);
    xadded.store(0, Ordering::SeqCst);
    let t0 = ulib::rdtsc();
    let r = run_workers(buf, len, c, counter_worker, &mut || counter_share(buf));
    let wall = ulib::rdtsc() - t0;
    if let Err((cpu, why)) = r {
        fail("shared-counter", why, Some(cpu), STATUS_USER_FAULT);
    }
    let (a, b) = (
        locked.counter.load(Ordering::SeqCst),
        xadded.load(Ordering::SeqCst),
    );
    let expected = ncpus as u64 * n;
    let exact = a == expected && b == expected;
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"shared-counter\",\"cpus\":{},\"n\":{},\"locked\":{},\"xadd\":{},\"expected\":{},\"exact\":{},\"cycles\":{},\"ns\":{}",
        ncpus,
        n,
        a,
        b,
        expected,
        exact,
        wall,
        ulib::cycles_to_ns(wall, hz)
    );
    list(&mut l, "cpu_nodes", (0..ncpus).map(node));
    l.push("}\n");
    l.send();
    ulib::exit(if exact { 0 } else { STATUS_WRONG_RESULT })
}

// ---- litmus=mp|iriw|2+2w,iters=N ----

/// A sense-reversing barrier, alone on its page.
#[repr(C)]
struct Barrier {
    count: AtomicU64,
    sense: AtomicU64,
}

impl Barrier {
    /// False if the task was aborted while waiting.
    fn wait(&self, n: u64, local: &mut u64, abort: &AtomicU64) -> bool {
        *local ^= 1;
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == n {
            self.count.store(0, Ordering::Relaxed);
            self.sense.store(*local, Ordering::Release);
            return true;
        }
        while self.sense.load(Ordering::Acquire) != *local {
            if abort.load(Ordering::Relaxed) != 0 {
                return false;
            }
            spin_loop();
        }
        true
    }
}

const MP: u64 = 0;
const IRIW: u64 = 1;
const TWO_PLUS_TWO_W: u64 = 2;
/// Pages: control, barrier, x, y, then one result page per thread.
const P_BARRIER: u64 = 1;
const P_X: u64 = 2;
const P_Y: u64 = 3;
const P_RESULTS: u64 = 4;

fn threads(test: u64) -> usize {
    if test == IRIW {
        4
    } else {
        2
    }
}

/// Plain (non-atomic, never merged or reordered by the compiler) accesses to the test's
/// variables: the hardware's ordering is what the test observes.
fn st(addr: u64, v: u64) {
    // SAFETY: `addr` is a variable page of the litmus area (x, y or a result slot), mapped
    // user-writable; racing accesses to it are the point of the test and are all volatile.
    unsafe { core::ptr::write_volatile(addr as *mut u64, v) }
}

fn ld(addr: u64) -> u64 {
    // SAFETY: as in `st`.
    unsafe { core::ptr::read_volatile(addr as *const u64) }
}

/// A short, varying delay so the two sides' accesses meet at different offsets.
fn jitter(seed: &mut u64) {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    for _ in 0..(*seed & 63) {
        spin_loop();
    }
}

/// Tallies of one test: outcome index → count (index bits: the observed values).
struct Tally([u64; 16]);

/// Thread `t`'s side of `iters` iterations. Thread 0 (the coordinator) also resets the
/// variables and tallies the outcome after each one.
fn litmus_share(buf: u64, t: usize, tally: &mut Tally) -> bool {
    // SAFETY: pages 0 and 1 of the coordinator's data area (checked by `litmus`).
    let (c, bar): (&Control, &Barrier) = unsafe { (page(buf, 0), page(buf, P_BARRIER)) };
    let (test, iters, n) = (
        c.n.load(Ordering::SeqCst),
        c.m.load(Ordering::SeqCst),
        c.count.load(Ordering::SeqCst),
    );
    let (x, y) = (buf + P_X * PAGE, buf + P_Y * PAGE);
    let mine = buf + (P_RESULTS + t as u64) * PAGE;
    let slot = |k: u64| buf + (P_RESULTS + k) * PAGE;
    let mut sense = 0;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1).wrapping_mul(0x2545_f491);
    for _ in 0..iters {
        if !bar.wait(n, &mut sense, &c.abort) {
            return false;
        }
        jitter(&mut seed);
        match (test, t) {
            (MP, 0) | (IRIW, 0) => {
                st(x, 1);
                if test == MP {
                    st(y, 1);
                }
            }
            (MP, _) => {
                let r1 = ld(y);
                let r2 = ld(x);
                st(mine, r1 | r2 << 1);
            }
            (IRIW, 1) => st(y, 1),
            (IRIW, 2) => {
                let r1 = ld(x);
                let r2 = ld(y);
                st(mine, r1 | r2 << 1);
            }
            (IRIW, _) => {
                let r3 = ld(y);
                let r4 = ld(x);
                st(mine, r3 | r4 << 1);
            }
            (_, 0) => {
                st(x, 1);
                st(y, 2);
            }
            _ => {
                st(y, 1);
                st(x, 2);
            }
        }
        if !bar.wait(n, &mut sense, &c.abort) {
            return false;
        }
        if t == 0 {
            let k = match test {
                MP => ld(slot(1)),
                IRIW => ld(slot(2)) | ld(slot(3)) << 2,
                _ => (ld(x).wrapping_sub(1) & 1) | (ld(y).wrapping_sub(1) & 1) << 1,
            };
            tally.0[(k & 15) as usize] += 1;
            st(x, 0);
            st(y, 0);
        }
    }
    true
}

extern "C" fn litmus_worker(buf: u64, cpu: u64, _: u64) -> ! {
    // SAFETY: `buf` is the coordinator's data area, page 0 its control page.
    let c: &Control = unsafe { page(buf, 0) };
    let t = (0..c.count.load(Ordering::SeqCst) as usize)
        .find(|&i| c.cpus[i].load(Ordering::SeqCst) == cpu)
        .unwrap_or(0);
    let mut unused = Tally([0; 16]);
    ulib::exit(if litmus_share(buf, t, &mut unused) {
        0
    } else {
        STATUS_USER_FAULT
    })
}

/// Picks `k` CPUs, CPU 0 first (the coordinator), then each time the highest-numbered CPU
/// on a node not used yet, else the highest-numbered one left: roles land on different
/// nodes where the VM has them.
fn pick_cpus(k: usize, ncpus: usize, out: &mut [usize; 4]) {
    let nodes: [u64; MAX_CPUS] = core::array::from_fn(|c| if c < ncpus { node(c) } else { 0 });
    let mut chosen = [false; MAX_CPUS];
    chosen[0] = true;
    out[0] = 0;
    for slot in out.iter_mut().take(k).skip(1) {
        let used = |n: u64| (0..ncpus).any(|c| chosen[c] && nodes[c] == n);
        let free = (1..ncpus).rev().filter(|&c| !chosen[c]);
        let c = free
            .clone()
            .find(|&c| !used(nodes[c]))
            .or_else(|| free.clone().next())
            .unwrap_or(0);
        chosen[c] = true;
        *slot = c;
    }
}

/// Outcome names and which one is forbidden, per test.
fn outcome_name(test: u64, k: usize, l: &mut Line) -> bool {
    let b = |i: usize| (k >> i) & 1;
    match test {
        MP => {
            let _ = write!(l, "\"r1={},r2={}\"", b(0), b(1));
            b(0) == 1 && b(1) == 0
        }
        IRIW => {
            let _ = write!(l, "\"r1={},r2={},r3={},r4={}\"", b(0), b(1), b(2), b(3));
            b(0) == 1 && b(1) == 0 && b(2) == 1 && b(3) == 0
        }
        _ => {
            let _ = write!(l, "\"x={},y={}\"", b(0) + 1, b(1) + 1);
            b(0) == 0 && b(1) == 0
        }
    }
}

/// `litmus=TEST,iters=N` (param `TEST | N << 8`).
pub extern "C" fn litmus(buf: u64, len: u64, param: u64) -> ! {
    let (test, iters) = (param & 0xff, param >> 8);
    let name = ["mp", "iriw", "2+2w"][test.min(TWO_PLUS_TWO_W) as usize];
    if !fits(len, P_RESULTS + 4) {
        fail(
            "litmus",
            "the task arena is too small",
            None,
            STATUS_UNKNOWN_TASK,
        );
    }
    let hz = ulib::tsc_hz();
    let ncpus = ulib::cpu_count().clamp(1, MAX_CPUS);
    let k = threads(test);
    if ncpus < k {
        let mut l = Line::new();
        let _ = writeln!(
            l,
            "{{\"probe\":\"litmus\",\"test\":\"{}\",\"ok\":false,\"error\":\"needs {} cpus, {} online\",\"cpus_online\":{}}}",
            name, k, ncpus, ncpus
        );
        l.send();
        ulib::exit(STATUS_UNKNOWN_TASK);
    }
    let mut cpus = [0usize; 4];
    pick_cpus(k, ncpus, &mut cpus);
    // SAFETY: pages 0 and 1 of this task's data area (checked above).
    let (c, bar): (&Control, &Barrier) = unsafe { (page(buf, 0), page(buf, P_BARRIER)) };
    c.n.store(test, Ordering::SeqCst);
    c.m.store(iters, Ordering::SeqCst);
    c.count.store(k as u64, Ordering::SeqCst);
    for (i, &cpu) in cpus.iter().enumerate().take(k) {
        c.cpus[i].store(cpu as u64, Ordering::SeqCst);
    }
    c.abort.store(0, Ordering::SeqCst);
    bar.count.store(0, Ordering::SeqCst);
    bar.sense.store(0, Ordering::SeqCst);
    st(buf + P_X * PAGE, 0);
    st(buf + P_Y * PAGE, 0);
    let mut tally = Tally([0; 16]);
    let t0 = ulib::rdtsc();
    let r = run_workers(buf, len, c, litmus_worker, &mut || {
        litmus_share(buf, 0, &mut tally)
    });
    let wall = ulib::rdtsc() - t0;
    if let Err((cpu, why)) = r {
        fail("litmus", why, Some(cpu), STATUS_USER_FAULT);
    }
    let mut forbidden = 0;
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"litmus\",\"test\":\"{}\",\"iters\":{}",
        name, iters
    );
    list(&mut l, "cpus", cpus[..k].iter().map(|&c| c as u64));
    list(&mut l, "nodes", cpus[..k].iter().map(|&c| node(c)));
    l.push(",\"outcomes\":{");
    let mut first = true;
    for (i, &count) in tally.0.iter().enumerate() {
        if count == 0 {
            continue;
        }
        if !first {
            l.push(",");
        }
        first = false;
        if outcome_name(test, i, &mut l) {
            forbidden += count;
        }
        let _ = write!(l, ":{}", count);
    }
    let _ = writeln!(
        l,
        "}},\"forbidden\":{},\"cycles\":{},\"ns\":{}}}",
        forbidden,
        wall,
        ulib::cycles_to_ns(wall, hz)
    );
    l.send();
    ulib::exit(0)
}
