//! `tcp-send=HOST:PORT,procs=P` and `udp-echo=HOST:PORT,procs=P`: P flows at once, copy i
//! on CPU i driving queue pair i of the one virtio-net device, each with its own smoltcp
//! stack and local port. Copy 0 (the task's body on the BSP) brings the device up once and
//! starts the others as workers (`ulib::cpu_start`), which only attach to their pair; it
//! then runs its own flow, waits for the workers and prints one line with every copy and
//! the aggregate.
//!
//! The host's TAP (IFF_MULTI_QUEUE) puts a flow's incoming frames on the queue the guest
//! last sent that flow on, so each copy's flow comes back on its own pair; a frame that
//! lands on another pair anyway is handed to the copy whose port it names (`FrameBox`)
//! rather than answered with a reset by a stack that does not know the connection.

use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};

use smoltcp::iface::SocketStorage;
use smoltcp::socket::udp;

use super::driver::{carve_rings, FrameBox, VirtioNet};
use super::stack::Stack;
use super::tasks::{
    echo_rounds, fail, local_port, mbit, params, percentile, send_flow, tcp_socket, TCP_TX_BYTES,
    UDP_BUFFER,
};
use super::{Carve, Params};
use crate::abi::{self, Error, STATUS_NET_FAILED};
use crate::ulib::{self, Line};

const PAGE: u64 = 4096;
const MAX_COPIES: usize = abi::NET_MAX_PAIRS as usize;
/// Each copy's share of the data area: both queues' buffers (1 MiB), its socket buffers and,
/// for a worker, its user stack at the top; `udp-echo` adds room for its round-trip times.
const REGION: u64 = 2 << 20;
const WORKER_STACK: u64 = 256 * 1024;
/// Receive buffers of a pair no copy drives, which copy 0 takes (`VirtioNet::take_pairs`).
const UNOWNED_PAIR: u64 = abi::NET_MAX_QUEUE as u64 * 2048;

/// Why a copy failed, by index (0: it did not).
const ERRORS: [&str; 11] = [
    "",
    "connection reset",
    "connection refused",
    "no progress for 10 s",
    "the task's time ran out",
    "cannot connect",
    "cannot attach to its queue pair",
    "no memory for socket buffers",
    "no reply from the echo server",
    "cannot bind a UDP port",
    "worker failed",
];
const WORKER_FAILED: usize = ERRORS.len() - 1;

fn error_index(why: &str) -> u64 {
    ERRORS
        .iter()
        .position(|e| *e == why)
        .unwrap_or(WORKER_FAILED) as u64
}

/// Which task the copies run.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    TcpSend,
    UdpEcho,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::TcpSend => "tcp-send",
            Kind::UdpEcho => "udp-echo",
        }
    }
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
    /// `udp-echo`: rounds run and lost, round-trip percentiles (ns) and the rounds' time.
    rounds: AtomicU64,
    lost: AtomicU64,
    p50_ns: AtomicU64,
    p99_ns: AtomicU64,
    ns: AtomicU64,
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
    /// `Kind::UdpEcho` as 1, and each copy's bytes of the data area.
    udp: AtomicU64,
    region: AtomicU64,
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
    let bytes = sh.region.load(Ordering::SeqCst);
    Carve::new(
        sh.regions.load(Ordering::SeqCst) + i as u64 * bytes,
        bytes - WORKER_STACK,
    )
}

fn kind(sh: &Shared) -> Kind {
    if sh.udp.load(Ordering::SeqCst) != 0 {
        Kind::UdpEcho
    } else {
        Kind::TcpSend
    }
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
    let error = match kind(sh) {
        Kind::TcpSend => tcp_copy(slot, dev, mem, p, port),
        Kind::UdpEcho => udp_copy(slot, dev, mem, p, port),
    };
    slot.error
        .store(error.map_or(0, error_index), Ordering::SeqCst);
    slot.done.store(1, Ordering::SeqCst);
}

/// The driver's counters into `slot`.
fn record(slot: &Slot, d: &VirtioNet) {
    slot.tx_packets.store(d.tx.packets, Ordering::SeqCst);
    slot.rx_packets.store(d.rx_packets(), Ordering::SeqCst);
    slot.rx_foreign.store(d.rx.foreign, Ordering::SeqCst);
    slot.kicks.store(d.kicks(), Ordering::SeqCst);
    slot.waits.store(d.waits, Ordering::SeqCst);
    slot.arp_in.store(d.arp_in, Ordering::SeqCst);
    slot.passed_in.store(d.passed_in, Ordering::SeqCst);
}

fn tcp_copy(
    slot: &Slot,
    dev: VirtioNet,
    mem: &mut Carve,
    p: &Params,
    port: u16,
) -> Option<&'static str> {
    let (Some(rx), Some(tx)) = (mem.slice(4096), mem.slice(TCP_TX_BYTES)) else {
        return Some("no memory for socket buffers");
    };
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, p, &mut storage);
    let h = net.sockets.add(tcp_socket(rx, tx));
    let f = send_flow(&mut net, h, p, port);
    slot.acked.store(f.acked, Ordering::SeqCst);
    slot.us.store(f.us, Ordering::SeqCst);
    record(slot, &net.dev);
    f.error
}

fn udp_copy(
    slot: &Slot,
    dev: VirtioNet,
    mem: &mut Carve,
    p: &Params,
    port: u16,
) -> Option<&'static str> {
    let (Some(rtts), Some(rx), Some(tx)) = (
        mem.slice(p.count as usize * 4),
        mem.slice(UDP_BUFFER),
        mem.slice(UDP_BUFFER),
    ) else {
        return Some("no memory for socket buffers");
    };
    // SAFETY: `rtts` is 4-byte aligned (carved at a page boundary) and `count` u32s long.
    let rtts =
        unsafe { core::slice::from_raw_parts_mut(rtts.as_mut_ptr() as *mut u32, p.count as usize) };
    let mut rx_meta = [udp::PacketMetadata::EMPTY; 16];
    let mut tx_meta = [udp::PacketMetadata::EMPTY; 16];
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, p, &mut storage);
    let mut sock = udp::Socket::new(
        udp::PacketBuffer::new(&mut rx_meta[..], rx),
        udp::PacketBuffer::new(&mut tx_meta[..], tx),
    );
    if sock.bind(port).is_err() {
        return Some("cannot bind a UDP port");
    }
    let h = net.sockets.add(sock);
    let e = echo_rounds(&mut net, h, p, rtts);
    record(slot, &net.dev);
    let e = e?;
    let rtts = &rtts[..e.done];
    slot.rounds.store(e.rounds, Ordering::SeqCst);
    slot.lost.store(e.lost, Ordering::SeqCst);
    slot.acked.store(e.done as u64, Ordering::SeqCst);
    slot.p50_ns
        .store(percentile(rtts, 50) as u64, Ordering::SeqCst);
    slot.p99_ns
        .store(percentile(rtts, 99) as u64, Ordering::SeqCst);
    slot.ns.store(e.ns, Ordering::SeqCst);
    if e.rounds < p.count {
        Some("the task's time ran out")
    } else if e.done == 0 {
        Some("no reply from the echo server")
    } else {
        None
    }
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

/// `tcp-send` with `procs=P`; `param` is the address of the task's `Params`.
pub fn tcp_send_procs(buf: u64, len: u64, param: u64) -> ! {
    run_procs(Kind::TcpSend, buf, len, param)
}

/// `udp-echo` with `procs=P`.
pub fn udp_echo_procs(buf: u64, len: u64, param: u64) -> ! {
    run_procs(Kind::UdpEcho, buf, len, param)
}

/// Sends the line so far once it is nearly full: the copies go out in pieces of one line.
fn spill(l: &mut Line) {
    if l.as_str().len() > 1600 {
        l.send();
    }
}

/// The coordinator (copy 0).
fn run_procs(kind: Kind, buf: u64, len: u64, param: u64) -> ! {
    let name = kind.name();
    let p = params(param);
    let procs = p.procs as usize;
    let ncpus = ulib::cpu_count();
    if procs > ncpus.min(MAX_COPIES) {
        fail(name, "procs=P needs P CPUs online (at most 16)");
    }
    let sh = shared(buf);
    let mut mem = Carve::new(buf + SHARED_BYTES, len.saturating_sub(SHARED_BYTES));
    let room = (ncpus as u32).clamp(1, abi::NET_MAX_PAIRS);
    let region_bytes = match kind {
        Kind::TcpSend => REGION,
        Kind::UdpEcho => REGION + (p.count * 4).next_multiple_of(PAGE),
    };
    // Copy 0 also takes the receive queues of the pairs no copy drives (`unowned`).
    let unowned_bytes = (room as u64).saturating_sub(procs as u64) * UNOWNED_PAIR;
    let (Ok(rings), Some(regions), Some(unowned)) = (
        carve_rings(&mut mem, room),
        mem.take(procs as u64 * region_bytes),
        mem.take(unowned_bytes),
    ) else {
        fail(name, "the task arena is too small for procs=P")
    };
    sh.params.store(param, Ordering::SeqCst);
    sh.rings.store(rings, Ordering::SeqCst);
    sh.regions.store(regions, Ordering::SeqCst);
    sh.region.store(region_bytes, Ordering::SeqCst);
    sh.udp
        .store((kind == Kind::UdpEcho) as u64, Ordering::SeqCst);
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
            &s.rounds,
            &s.lost,
            &s.p50_ns,
            &s.p99_ns,
            &s.ns,
            &s.arp_in,
            &s.passed_in,
        ] {
            f.store(0, Ordering::SeqCst);
        }
    }
    let mut mem0 = region(sh, 0);
    let mut dev = match VirtioNet::open_on(rings, room, 0, &mut mem0) {
        Ok(d) => d,
        Err(Error::NoDevice) => fail(name, "no usable virtio-net device"),
        Err(e) => fail(name, e.name()),
    };
    let _ = dev.take_pairs(procs as u32, &mut Carve::new(unowned, unowned_bytes));
    let (pairs, max_pairs, ctrl) = (dev.pairs, dev.max_pairs, dev.ctrl);
    if (pairs as usize) < procs {
        let mut l = Line::new();
        let _ = writeln!(
            l,
            "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"procs=P needs P queue pairs\",\"procs\":{},\"queue_pairs\":{},\"max_queue_pairs\":{},\"ctrl\":{}}}",
            name, procs, pairs, max_pairs, ctrl
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
        let top = regions + (i as u64 + 1) * region_bytes;
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
    let (mut total, mut rounds, mut lost) = (0u64, 0u64, 0u64);
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"procs\":{},\"queue_pairs\":{},\"max_queue_pairs\":{},\"{}\":{},\"copies\":[",
        name,
        procs,
        pairs,
        max_pairs,
        if kind == Kind::TcpSend {
            "bytes_per_copy"
        } else {
            "rounds_per_copy"
        },
        p.count
    );
    for (i, s) in sh.slots[..procs].iter().enumerate() {
        let get = |f: &AtomicU64| f.load(Ordering::SeqCst);
        let done = get(&s.done) != 0;
        let err = get(&s.error) as usize;
        let copy_ok = done && err == 0;
        ok &= copy_ok;
        let acked = get(&s.acked);
        total += acked;
        rounds += get(&s.rounds);
        lost += get(&s.lost);
        l.item(i);
        let _ = write!(
            l,
            "{{\"copy\":{},\"cpu\":{},\"queue_pair\":{},\"local_port\":{},\"ok\":{},",
            i,
            i,
            get(&s.pair),
            get(&s.port),
            copy_ok
        );
        match kind {
            Kind::TcpSend => {
                let us = get(&s.us);
                let (whole, tenths) = mbit(acked, us);
                let _ = write!(
                    l,
                    "\"bytes\":{},\"us\":{},\"mbit_per_s\":{}.{},",
                    acked, us, whole, tenths
                );
            }
            Kind::UdpEcho => {
                let ns = get(&s.ns).max(1);
                let _ = write!(
                    l,
                    "\"rounds\":{},\"answered\":{},\"lost\":{},\"rate_per_s\":{},\"p50_us\":{},\"p99_us\":{},\"ns\":{},",
                    get(&s.rounds),
                    acked,
                    get(&s.lost),
                    acked as u128 * 1_000_000_000 / ns as u128,
                    get(&s.p50_ns) / 1000,
                    get(&s.p99_ns) / 1000,
                    ns
                );
            }
        }
        let _ = write!(
            l,
            "\"tx_packets\":{},\"rx_packets\":{},\"rx_foreign\":{},\"kicks\":{},\"waits\":{},\"arp_from_other_pairs\":{},\"frames_from_other_pairs\":{}",
            get(&s.tx_packets),
            get(&s.rx_packets),
            get(&s.rx_foreign),
            get(&s.kicks),
            get(&s.waits),
            get(&s.arp_in),
            get(&s.passed_in),
        );
        if !copy_ok {
            let why = if done {
                ERRORS[err.min(WORKER_FAILED)]
            } else {
                "not run"
            };
            let _ = write!(l, ",\"error\":\"{}\"", why);
        }
        l.push("}");
        spill(&mut l);
    }
    match kind {
        Kind::TcpSend => {
            let (whole, tenths) = mbit(total, wall_us);
            let _ = write!(
                l,
                "],\"bytes\":{},\"us\":{},\"mbit_per_s\":{}.{},",
                total, wall_us, whole, tenths
            );
        }
        Kind::UdpEcho => {
            let _ = write!(
                l,
                "],\"rounds\":{},\"answered\":{},\"lost\":{},\"rate_per_s\":{},\"us\":{},",
                rounds,
                total,
                lost,
                total as u128 * 1_000_000 / wall_us as u128,
                wall_us
            );
        }
    }
    let _ = write!(
        l,
        "\"interrupts\":{},\"ok\":{}",
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
