//! `tcp-send=HOST:PORT,procs=P`: P flows at once, copy i on CPU i driving queue pair i of
//! the one virtio-net device, each with its own smoltcp stack and local port. Copy 0 (the
//! task's body on the BSP) brings the device up once and starts the others as workers
//! (`ulib::cpu_start`), which only attach to their pair; it then runs its own flow, waits
//! for the workers and prints one line with every copy and the aggregate.
//!
//! The host's TAP (IFF_MULTI_QUEUE) puts a flow's incoming frames on the queue the guest
//! last sent that flow on, so each copy's TCP flow comes back on its own pair; a frame that
//! lands on another pair anyway is dropped there (`Rx::only_port`) rather than answered
//! with a reset by a stack that does not know the connection.

use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};

use smoltcp::iface::SocketStorage;

use super::driver::{carve_rings, FrameBox, VirtioNet};
use super::stack::Stack;
use super::tasks::{fail, local_port, mbit, params, send_flow, tcp_socket, TCP_TX_BYTES};
use super::{Carve, Params};
use crate::abi::{self, Error, STATUS_NET_FAILED};
use crate::ulib::{self, Line};

const NAME: &str = "tcp-send";
const PAGE: u64 = 4096;
const MAX_COPIES: usize = abi::NET_MAX_PAIRS as usize;
/// Each copy's share of the data area: both queues' buffers (1 MiB), its socket buffers and,
/// for a worker, its user stack at the top.
const REGION: u64 = 2 << 20;
const WORKER_STACK: u64 = 256 * 1024;
/// Receive buffers of a pair no copy drives, which copy 0 takes (`VirtioNet::take_pairs`).
const UNOWNED_PAIR: u64 = abi::NET_MAX_QUEUE as u64 * 2048;

/// Why a copy failed, by index (0: it did not).
const ERRORS: [&str; 9] = [
    "",
    "connection reset",
    "connection refused",
    "no progress for 10 s",
    "the task's time ran out",
    "cannot connect",
    "cannot attach to its queue pair",
    "no memory for socket buffers",
    "worker failed",
];

fn error_index(why: &str) -> u64 {
    ERRORS.iter().position(|e| *e == why).unwrap_or(8) as u64
}

/// What one copy reports; written by the copy's CPU, read by copy 0 after `cpu_wait`.
#[repr(C)]
struct Slot {
    done: AtomicU64,
    error: AtomicU64,
    acked: AtomicU64,
    us: AtomicU64,
    port: AtomicU64,
    pair: AtomicU64,
    tx_packets: AtomicU64,
    rx_packets: AtomicU64,
    rx_foreign: AtomicU64,
    kicks: AtomicU64,
    waits: AtomicU64,
    /// ARP frames taken from what other copies received.
    arp_in: AtomicU64,
    /// Frames for it that another copy's pair received.
    passed_in: AtomicU64,
}

/// The first pages of the data area: what the workers need, the frames they hand each
/// other, and their slots.
#[repr(C)]
struct Shared {
    /// The address of the task's `Params` (`user::run_task`).
    params: AtomicU64,
    rings: AtomicU64,
    regions: AtomicU64,
    base_port: AtomicU64,
    arp: FrameBox,
    inboxes: [FrameBox; MAX_COPIES],
    slots: [Slot; MAX_COPIES],
}

/// The data area's pages that hold `Shared`.
const SHARED_BYTES: u64 = 2 * PAGE;
const _: () = assert!(core::mem::size_of::<Shared>() as u64 <= SHARED_BYTES);

fn shared(buf: u64) -> &'static Shared {
    // SAFETY: `buf` is the page-aligned data area, whose first pages this task keeps for
    // `Shared` (atomics only, valid for any bytes); every CPU uses it through shared
    // references.
    unsafe { &*(buf as *const Shared) }
}

/// Copy `i`'s region, without the worker stack at its top.
fn region(sh: &Shared, i: usize) -> Carve {
    Carve::new(
        sh.regions.load(Ordering::SeqCst) + i as u64 * REGION,
        REGION - WORKER_STACK,
    )
}

/// Runs copy `i`'s flow on `dev` and records it in its slot.
fn run_copy(sh: &'static Shared, i: usize, mut dev: VirtioNet, mem: &mut Carve, p: &Params) {
    let procs = p.procs as usize;
    let slot = &sh.slots[i];
    let port = sh.base_port.load(Ordering::SeqCst) as u16 + i as u16;
    slot.port.store(port as u64, Ordering::SeqCst);
    slot.pair.store(dev.pair as u64, Ordering::SeqCst);
    dev.rx.only_port = port;
    dev.share(&sh.arp, &sh.inboxes[..procs], i as u16);
    let (Some(rx), Some(tx)) = (mem.slice(4096), mem.slice(TCP_TX_BYTES)) else {
        slot.error.store(
            error_index("no memory for socket buffers"),
            Ordering::SeqCst,
        );
        slot.done.store(1, Ordering::SeqCst);
        return;
    };
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, p, &mut storage);
    let h = net.sockets.add(tcp_socket(rx, tx));
    let f = send_flow(&mut net, h, p, port);
    let d = &net.dev;
    slot.acked.store(f.acked, Ordering::SeqCst);
    slot.us.store(f.us, Ordering::SeqCst);
    slot.tx_packets.store(d.tx.packets, Ordering::SeqCst);
    slot.rx_packets.store(d.rx.packets, Ordering::SeqCst);
    slot.rx_foreign.store(d.rx.foreign, Ordering::SeqCst);
    slot.kicks.store(d.kicks(), Ordering::SeqCst);
    slot.waits.store(d.waits, Ordering::SeqCst);
    slot.arp_in.store(d.arp_in, Ordering::SeqCst);
    slot.passed_in.store(d.passed_in, Ordering::SeqCst);
    slot.error
        .store(f.error.map_or(0, error_index), Ordering::SeqCst);
    slot.done.store(1, Ordering::SeqCst);
}

/// A worker: copy `cpu` on CPU `cpu`, on pair `cpu`.
extern "C" fn worker(buf: u64, cpu: u64, _: u64) -> ! {
    let sh = shared(buf);
    let i = cpu as usize;
    let p = params(sh.params.load(Ordering::SeqCst));
    let mut mem = region(sh, i);
    match VirtioNet::attach(sh.rings.load(Ordering::SeqCst), i as u32, &mut mem) {
        Ok(dev) => run_copy(sh, i, dev, &mut mem, &p),
        Err(_) => {
            let slot = &sh.slots[i];
            slot.error.store(
                error_index("cannot attach to its queue pair"),
                Ordering::SeqCst,
            );
            slot.done.store(1, Ordering::SeqCst);
        }
    }
    ulib::exit(0)
}

/// The coordinator (copy 0); `param` is the address of the task's `Params`.
pub fn tcp_send_procs(buf: u64, len: u64, param: u64) -> ! {
    let p = params(param);
    let procs = p.procs as usize;
    let ncpus = ulib::cpu_count();
    if procs > ncpus.min(MAX_COPIES) {
        fail(NAME, "procs=P needs P CPUs online (at most 16)");
    }
    let sh = shared(buf);
    let mut mem = Carve::new(buf + SHARED_BYTES, len.saturating_sub(SHARED_BYTES));
    let room = (ncpus as u32).clamp(1, abi::NET_MAX_PAIRS);
    // Copy 0 also takes the receive queues of the pairs no copy drives (`unowned`).
    let unowned_bytes = (room as u64).saturating_sub(procs as u64) * UNOWNED_PAIR;
    let (Ok(rings), Some(regions), Some(unowned)) = (
        carve_rings(&mut mem, room),
        mem.take(procs as u64 * REGION),
        mem.take(unowned_bytes),
    ) else {
        fail(NAME, "the task arena is too small for procs=P")
    };
    sh.params.store(param, Ordering::SeqCst);
    sh.rings.store(rings, Ordering::SeqCst);
    sh.regions.store(regions, Ordering::SeqCst);
    sh.base_port.store(local_port() as u64, Ordering::SeqCst);
    sh.arp.clear();
    for b in &sh.inboxes {
        b.clear();
    }
    for s in &sh.slots {
        for f in [
            &s.done,
            &s.error,
            &s.acked,
            &s.us,
            &s.port,
            &s.pair,
            &s.tx_packets,
            &s.rx_packets,
            &s.rx_foreign,
            &s.kicks,
            &s.waits,
            &s.arp_in,
            &s.passed_in,
        ] {
            f.store(0, Ordering::SeqCst);
        }
    }
    let mut mem0 = region(sh, 0);
    let mut dev = match VirtioNet::open_on(rings, room, 0, &mut mem0) {
        Ok(d) => d,
        Err(Error::NoDevice) => fail(NAME, "no usable virtio-net device"),
        Err(e) => fail(NAME, e.name()),
    };
    let _ = dev.take_pairs(procs as u32, &mut Carve::new(unowned, unowned_bytes));
    let (pairs, max_pairs, ctrl) = (dev.pairs, dev.max_pairs, dev.ctrl);
    if (pairs as usize) < procs {
        let mut l = Line::new();
        let _ = writeln!(
            l,
            "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"procs=P needs P queue pairs\",\"procs\":{},\"queue_pairs\":{},\"max_queue_pairs\":{},\"ctrl\":{}}}",
            NAME, procs, pairs, max_pairs, ctrl
        );
        l.send();
        ulib::exit(STATUS_NET_FAILED)
    }
    let hz = ulib::tsc_hz().max(1);
    let irqs0 = ulib::net_interrupts();
    let t0 = ulib::rdtsc();
    let mut started = 1;
    let mut start_error = None;
    for i in 1..procs {
        let top = sh.regions.load(Ordering::SeqCst) + (i as u64 + 1) * REGION;
        match ulib::cpu_start(i, worker, top, buf) {
            Ok(()) => started = i + 1,
            Err(e) => {
                start_error = Some((i, e));
                break;
            }
        }
    }
    run_copy(sh, 0, dev, &mut mem0, &p);
    for i in 1..started {
        let r = ulib::cpu_wait(i);
        let slot = &sh.slots[i];
        if r != Ok(0) && slot.done.load(Ordering::SeqCst) == 0 {
            slot.error
                .store(error_index("worker failed"), Ordering::SeqCst);
        }
    }
    let wall_us = ((ulib::rdtsc() - t0) as u128 * 1_000_000 / hz as u128).max(1) as u64;
    let mut ok = start_error.is_none();
    let mut total = 0u64;
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"procs\":{},\"queue_pairs\":{},\"max_queue_pairs\":{},\"bytes_per_copy\":{},\"copies\":[",
        NAME, procs, pairs, max_pairs, p.count
    );
    for (i, s) in sh.slots[..procs].iter().enumerate() {
        let done = s.done.load(Ordering::SeqCst) != 0;
        let err = s.error.load(Ordering::SeqCst) as usize;
        let copy_ok = done && err == 0;
        ok &= copy_ok;
        let (acked, us) = (s.acked.load(Ordering::SeqCst), s.us.load(Ordering::SeqCst));
        total += acked;
        let (whole, tenths) = mbit(acked, us);
        l.item(i);
        let _ = write!(
            l,
            "{{\"copy\":{},\"cpu\":{},\"queue_pair\":{},\"local_port\":{},\"ok\":{},\"bytes\":{},\"us\":{},\"mbit_per_s\":{}.{},\"tx_packets\":{},\"rx_packets\":{},\"rx_foreign\":{},\"kicks\":{},\"waits\":{},\"arp_from_other_pairs\":{},\"frames_from_other_pairs\":{}",
            i,
            i,
            s.pair.load(Ordering::SeqCst),
            s.port.load(Ordering::SeqCst),
            copy_ok,
            acked,
            us,
            whole,
            tenths,
            s.tx_packets.load(Ordering::SeqCst),
            s.rx_packets.load(Ordering::SeqCst),
            s.rx_foreign.load(Ordering::SeqCst),
            s.kicks.load(Ordering::SeqCst),
            s.waits.load(Ordering::SeqCst),
            s.arp_in.load(Ordering::SeqCst),
            s.passed_in.load(Ordering::SeqCst),
        );
        if !copy_ok {
            let why = if done { ERRORS[err.min(8)] } else { "not run" };
            let _ = write!(l, ",\"error\":\"{}\"", why);
        }
        l.push("}");
    }
    let (whole, tenths) = mbit(total, wall_us);
    let _ = write!(
        l,
        "],\"bytes\":{},\"us\":{},\"mbit_per_s\":{}.{},\"interrupts\":{},\"ok\":{}",
        total,
        wall_us,
        whole,
        tenths,
        ulib::net_interrupts() - irqs0,
        ok
    );
    if let Some((cpu, e)) = start_error {
        let _ = write!(
            l,
            ",\"error\":\"cannot start copy {} on its CPU: {}\"",
            cpu,
            e.name()
        );
    }
    l.push("}\n");
    l.send();
    ulib::exit(if ok { 0 } else { STATUS_NET_FAILED })
}
