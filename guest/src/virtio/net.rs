//! The kernel's share of the devices user tasks drive, virtio-net and virtio-vsock: bring
//! the device up on rings that live in the task's arena, open its register page to the
//! task, and halt until the device has something.
//!
//! Everything per packet (buffers, descriptors, notifications, the TCP/IP stack, vsock's
//! connections) runs at CPL3 in `crate::net` and `crate::vsock`: kernel-mode code is
//! emulated on the development machines and would cost more than the packets themselves.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::transport::Reg;
use crate::abi::{self, Error, NetOpen};
use crate::arch::{mmio_read16, mmio_read32, mmio_write32, rdtsc};
use crate::cpu::MAX_CPUS;
use crate::global::Global;
use crate::{paging, smp, timer, user};

const S_ACK: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;
const S_FAILED: u32 = 0x80;

const F_MAC: u64 = 1 << 5;
const F_MRG_RXBUF: u64 = 1 << 15;
const F_CTRL_VQ: u64 = 1 << 17;
const F_MQ: u64 = 1 << 22;
const F_VERSION_1: u64 = 1 << 32;
const F_CSUM: u64 = 1 << 0;
const F_HOST_TSO4: u64 = 1 << 11;
/// Received frames stay plain Ethernet frames of at most 1514 bytes (no GUEST_* offloads),
/// which keeps the user-mode driver's receive side simple; on transmit it merges TCP
/// segments into TSO frames where the device takes them (HOST_TSO4, which needs CSUM),
/// unless `probe.net_tso=0`. The control queue is taken for VIRTIO_NET_F_MQ alone (the
/// only command sent is VQ_PAIRS_SET).
const WANTED: u64 = F_VERSION_1 | F_MAC | F_MRG_RXBUF | F_CTRL_VQ | F_MQ | F_CSUM | F_HOST_TSO4;
/// virtio-vsock has no feature bits of its own that the task needs.
const WANTED_VSOCK: u64 = F_VERSION_1;

/// Used when the device has no MAC of its own (locally administered).
const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x4d, 0x53, 0x42];

/// A device of one kind as the tasks' system calls see it. Bring-up and close write it
/// (the kernel path of a task that is not a worker, one call at a time); workers of the
/// same task read it from other CPUs to attach to their pair, hence the atomics.
struct Dev {
    base: AtomicU64,
    irqs: AtomicU64,
    /// The task's rings while the device is open (0: closed).
    rings: AtomicU64,
    /// Queue pairs in use (vsock: 1).
    pairs: AtomicU32,
    max_pairs: AtomicU32,
    ctrl: AtomicU32,
    qsize: AtomicU32,
    features: AtomicU64,
    /// `NetOpen::mac` as a le64.
    mac: AtomicU64,
    notify: AtomicU64,
}

/// The devices by kind (`abi::DEV_NET`, `abi::DEV_VSOCK`).
static DEV: [Dev; 2] = [const {
    Dev {
        base: AtomicU64::new(0),
        irqs: AtomicU64::new(0),
        rings: AtomicU64::new(0),
        pairs: AtomicU32::new(0),
        max_pairs: AtomicU32::new(0),
        ctrl: AtomicU32::new(0),
        qsize: AtomicU32::new(0),
        features: AtomicU64::new(0),
        mac: AtomicU64::new(0),
        notify: AtomicU64::new(0),
    }
}; 2];

/// The virtio-net pair each CPU opened, plus one (0: none).
static CPU_PAIR: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];
/// CPUs halted in `wait`: the device interrupts the BSP only, whose handler wakes them.
static WAITERS: AtomicU64 = AtomicU64::new(0);

/// Records the device of `kind` found at `base` (the first one only).
pub fn found(kind: usize, base: u64) -> bool {
    DEV[kind]
        .base
        .compare_exchange(0, base, Ordering::Relaxed, Ordering::Relaxed)
        .is_ok()
}

pub fn irq(kind: usize) {
    let base = DEV[kind].base.load(Ordering::Relaxed);
    if base != 0 {
        let s = mmio_read32(Reg::InterruptStatus.at(base));
        mmio_write32(Reg::InterruptAck.at(base), s);
    }
    DEV[kind].irqs.fetch_add(1, Ordering::SeqCst);
    let me = smp::current();
    let mut w = WAITERS.load(Ordering::SeqCst);
    while w != 0 {
        let cpu = w.trailing_zeros() as usize;
        w &= w - 1;
        if cpu != me {
            smp::wake(cpu);
        }
    }
}

pub fn irq_count(kind: usize) -> u64 {
    DEV[kind].irqs.load(Ordering::SeqCst)
}

fn r32(base: u64, r: Reg) -> u32 {
    mmio_read32(r.at(base))
}

fn w32(base: u64, r: Reg, v: u32) {
    mmio_write32(r.at(base), v)
}

fn w64(base: u64, r: Reg, v: u64) {
    w32(base, r, v as u32);
    mmio_write32(r.at(base) + 4, (v >> 32) as u32);
}

/// `SYS_NET_OPEN`: the block at `at` names the rings; the device of `kind` is reset first,
/// so a task may open it again. With `NET_OPEN_PAIR`, attaches the calling CPU to a pair
/// of the device already up instead.
pub fn open(kind: u64, at: u64) -> Result<u64, Error> {
    let kind = match kind {
        abi::DEV_NET | abi::DEV_VSOCK => kind as usize,
        _ => return Err(Error::BadArgument),
    };
    let len = core::mem::size_of::<NetOpen>() as u64;
    if !user::in_arena(at, len) || !at.is_multiple_of(8) {
        return Err(Error::BadArgument);
    }
    // SAFETY: checked to lie in the task's arena, aligned; the task is stopped in this call.
    let mut b = unsafe { core::ptr::read_volatile(at as *const NetOpen) };
    let cpu = smp::current();
    if kind == abi::DEV_NET as usize && b.flags & abi::NET_OPEN_PAIR != 0 {
        attach(&mut b, cpu)?;
    } else {
        // Bringing the device up resets it under every other CPU of the task.
        if smp::on_worker() {
            return Err(Error::NoSuchCpu);
        }
        bring_up(kind, &mut b, cpu)?;
    }
    // SAFETY: as for the read above.
    unsafe { core::ptr::write_volatile(at as *mut NetOpen, b) };
    Ok(0)
}

/// The pair `want` names for CPU `cpu` when `pairs` are in use.
fn pick_pair(want: u32, cpu: usize, pairs: u32) -> Result<u32, Error> {
    match want {
        abi::NET_PAIR_ANY => Ok(cpu as u32 % pairs.max(1)),
        p if p < pairs => Ok(p),
        _ => Err(Error::BadArgument),
    }
}

/// Fills the block from the device's record and makes `b.pair` the pair of CPU `cpu`.
fn fill(kind: usize, b: &mut NetOpen, cpu: usize) -> Result<(), Error> {
    let d = &DEV[kind];
    let pairs = d.pairs.load(Ordering::SeqCst);
    b.pair = pick_pair(b.pair, cpu, pairs)?;
    b.pairs = pairs;
    b.max_pairs = d.max_pairs.load(Ordering::SeqCst);
    b.ctrl = d.ctrl.load(Ordering::SeqCst);
    b.queue_size = d.qsize.load(Ordering::SeqCst);
    b.features = d.features.load(Ordering::SeqCst);
    b.mac = d.mac.load(Ordering::SeqCst).to_le_bytes();
    b.notify = d.notify.load(Ordering::SeqCst);
    b.deadline = user::deadline(cpu);
    b.poll_us = super::transport::poll_us();
    if kind == abi::DEV_NET as usize && cpu < MAX_CPUS {
        CPU_PAIR[cpu].store(b.pair + 1, Ordering::SeqCst);
    }
    Ok(())
}

/// `NET_OPEN_PAIR`: nothing touches the device; the rings must be those it was brought up
/// on, so a task cannot name memory the device does not use.
fn attach(b: &mut NetOpen, cpu: usize) -> Result<(), Error> {
    let kind = abi::DEV_NET as usize;
    let rings = DEV[kind].rings.load(Ordering::SeqCst);
    if rings == 0 {
        return Err(Error::NoDevice);
    }
    if b.rings != rings {
        return Err(Error::BadArgument);
    }
    fill(kind, b, cpu)
}

fn bring_up(kind: usize, b: &mut NetOpen, cpu: usize) -> Result<(), Error> {
    let vsock = kind == abi::DEV_VSOCK as usize;
    let room = if vsock {
        1
    } else {
        b.pairs.clamp(1, abi::NET_MAX_PAIRS)
    };
    let ring_bytes = if vsock {
        abi::VSOCK_RING_BYTES
    } else {
        abi::NET_RING_BYTES * room as u64
    };
    if !b.rings.is_multiple_of(4096) || !user::in_arena(b.rings, ring_bytes) {
        return Err(Error::BadArgument);
    }
    close_one(kind);
    let base = DEV[kind].base.load(Ordering::Relaxed);
    if base == 0 {
        return Err(Error::NoDevice);
    }
    let up = match init(base, b, room, vsock) {
        Ok(v) => v,
        Err(()) => {
            w32(base, Reg::Status, r32(base, Reg::Status) | S_FAILED);
            return Err(Error::NoDevice);
        }
    };
    let mut mac = [0u8; 8];
    if vsock {
        // The guest's cid, a le64 at the start of the configuration.
        mac[..4].copy_from_slice(&mmio_read32(base + 0x100).to_le_bytes());
        mac[4..].copy_from_slice(&mmio_read32(base + 0x104).to_le_bytes());
    } else if up.features & F_MAC != 0 {
        let lo = mmio_read32(base + 0x100).to_le_bytes();
        let hi = mmio_read32(base + 0x104).to_le_bytes();
        mac[..4].copy_from_slice(&lo);
        mac[4..6].copy_from_slice(&hi[..2]);
    } else {
        mac[..6].copy_from_slice(&DEFAULT_MAC);
    }
    let notify = Reg::QueueNotify.at(base);
    if !paging::set_user_mmio(notify & !0xfff, true) {
        w32(base, Reg::Status, 0);
        return Err(Error::NoDevice);
    }
    let d = &DEV[kind];
    d.pairs.store(up.pairs, Ordering::SeqCst);
    d.max_pairs.store(up.max_pairs, Ordering::SeqCst);
    d.ctrl.store(up.ctrl, Ordering::SeqCst);
    d.qsize.store(up.qsize, Ordering::SeqCst);
    d.features.store(up.features, Ordering::SeqCst);
    d.mac.store(u64::from_le_bytes(mac), Ordering::SeqCst);
    d.notify.store(notify, Ordering::SeqCst);
    d.rings.store(b.rings, Ordering::SeqCst);
    fill(kind, b, cpu)
}

/// What `init` set up.
struct Up {
    features: u64,
    qsize: u32,
    pairs: u32,
    max_pairs: u32,
    ctrl: u32,
}

/// Reset, feature negotiation, the queues at `b.rings` (receive 2k and transmit 2k+1 of
/// each pair in use; vsock: receive, transmit, events), the control queue if the device
/// has one, DRIVER_OK (virtio 1.x, 3.1.1), then VQ_PAIRS_SET for several pairs.
fn init(base: u64, b: &NetOpen, room: u32, vsock: bool) -> Result<Up, ()> {
    if r32(base, Reg::Version) != 2 {
        return Err(());
    }
    w32(base, Reg::Status, 0);
    if !timer::wait_for(1000, || r32(base, Reg::Status) == 0) {
        return Err(());
    }
    // Acknowledge first, then DRIVER: some devices (Firecracker's) refuse both at once.
    w32(base, Reg::Status, S_ACK);
    w32(base, Reg::Status, S_ACK | S_DRIVER);
    w32(base, Reg::DeviceFeaturesSel, 0);
    let lo = r32(base, Reg::DeviceFeatures) as u64;
    w32(base, Reg::DeviceFeaturesSel, 1);
    let offered = lo | (r32(base, Reg::DeviceFeatures) as u64) << 32;
    if offered & F_VERSION_1 == 0 {
        return Err(());
    }
    let mut features = offered & if vsock { WANTED_VSOCK } else { WANTED };
    if crate::bootinfo::get().param(b"probe.net_tso") == Some(b"0") {
        features &= !(F_CSUM | F_HOST_TSO4);
    }
    // TSO frames need the device to finish their checksums (virtio 1.2, 5.1.3.1).
    if features & F_CSUM == 0 {
        features &= !F_HOST_TSO4;
    }
    // MQ depends on the control queue (virtio 1.2, 5.1.3.1).
    if features & F_CTRL_VQ == 0 {
        features &= !F_MQ;
    }
    w32(base, Reg::DriverFeaturesSel, 0);
    w32(base, Reg::DriverFeatures, features as u32);
    w32(base, Reg::DriverFeaturesSel, 1);
    w32(base, Reg::DriverFeatures, (features >> 32) as u32);
    w32(base, Reg::Status, S_ACK | S_DRIVER | S_FEATURES_OK);
    if r32(base, Reg::Status) & S_FEATURES_OK == 0 {
        return Err(());
    }
    // `max_virtqueue_pairs`, a le16 at offset 8 of the configuration (1..=0x8000).
    let max_pairs = if features & F_MQ != 0 {
        (mmio_read16(base + 0x108) as u32).clamp(1, 0x8000)
    } else {
        1
    };
    // `probe.net_pairs=N` is sent as given, so a value the device lacks shows the fallback.
    let asked = net_pairs_param();
    let want = asked.map_or(smp::online().max(1) as u32, u32::from);
    let pairs = max_pairs.min(room).min(want).max(1);
    let queues = if vsock { 3 } else { 2 * pairs };
    let mut q = b.want_queue.clamp(2, abi::NET_MAX_QUEUE);
    for i in 0..queues {
        w32(base, Reg::QueueSel, i);
        if r32(base, Reg::QueueReady) != 0 {
            return Err(());
        }
        q = q.min(r32(base, Reg::QueueNumMax));
    }
    if q < 2 {
        return Err(());
    }
    let q = 1 << q.ilog2();
    for i in 0..queues {
        let at = b.rings + i as u64 * abi::NET_QUEUE_BYTES;
        set_queue(
            base,
            i,
            q,
            [at, at + abi::NET_AVAIL_OFF, at + abi::NET_USED_OFF],
        );
    }
    // The control queue follows the last receive/transmit queue the device has.
    let ctrl_index = if features & F_MQ != 0 {
        2 * max_pairs
    } else {
        2
    };
    let mut ctrl = if features & F_CTRL_VQ != 0 {
        ctrl_setup(base, ctrl_index)
    } else {
        abi::NET_CTRL_NONE
    };
    w32(
        base,
        Reg::Status,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    let mut pairs = pairs;
    if features & F_MQ != 0 {
        if ctrl == abi::NET_CTRL_OK {
            ctrl = ctrl_command(
                base,
                ctrl_index,
                CTRL_MQ,
                CTRL_MQ_VQ_PAIRS_SET,
                asked.unwrap_or(pairs as u16),
            );
        }
        if ctrl != abi::NET_CTRL_OK {
            pairs = 1;
        }
    }
    Ok(Up {
        features,
        qsize: q,
        pairs,
        max_pairs,
        ctrl,
    })
}

/// `probe.net_pairs=N` (0..=65535), if given.
fn net_pairs_param() -> Option<u16> {
    crate::bootinfo::get()
        .param(b"probe.net_pairs")
        .and_then(|v| core::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
}

/// Queue `i` with `size` entries: descriptor table, avail ring and used ring at `at`.
fn set_queue(base: u64, i: u32, size: u32, at: [u64; 3]) {
    w32(base, Reg::QueueSel, i);
    w32(base, Reg::QueueNum, size);
    w64(base, Reg::QueueDesc, at[0]);
    w64(base, Reg::QueueAvail, at[1]);
    w64(base, Reg::QueueUsed, at[2]);
    w32(base, Reg::QueueReady, 1);
}

// ---- The control queue: kernel memory, used only at bring-up ----

const CTRL_MQ: u8 = 4;
const CTRL_MQ_VQ_PAIRS_SET: u8 = 0;
/// Entries of the control queue: one command (three descriptors) at a time.
const CTRL_QSIZE: u32 = 4;
/// How long a command may go without its used entry.
const CTRL_TIMEOUT_MS: u64 = 1000;
// Layout of the control queue's page.
const CQ_DESC: u64 = 0;
const CQ_AVAIL: u64 = 256;
const CQ_USED: u64 = 512;
const CQ_HDR: u64 = 1024;
const CQ_DATA: u64 = 1040;
const CQ_ACK: u64 = 1056;

#[repr(C, align(4096))]
struct CtrlPage([u8; 4096]);

/// Not zeroed at boot (CPL0 stores are slow here): `ctrl_setup` clears what it uses.
#[link_section = ".noinit.virtq"]
static CTRL: Global<CtrlPage> = Global::new(CtrlPage([0; 4096]));
/// Commands posted since the control queue was set up (the avail index).
static CTRL_SENT: AtomicU32 = AtomicU32::new(0);

fn cq(off: u64) -> u64 {
    CTRL.addr() + off
}

fn cq_write<T: Copy>(off: u64, v: T) {
    // SAFETY: `off` lies in the control page with room for a `T` and is aligned for it (the
    // layout above); the page is reached only through these raw accesses, by the one CPU
    // bringing the device up.
    unsafe { core::ptr::write_volatile(cq(off) as *mut T, v) }
}

fn cq_read<T: Copy>(off: u64) -> T {
    // SAFETY: as for `cq_write`; only integers are read, valid for any bytes the device left.
    unsafe { core::ptr::read_volatile(cq(off) as *const T) }
}

/// Sets the control queue `index` up in the kernel's page; `NET_CTRL_OK` if it could be.
fn ctrl_setup(base: u64, index: u32) -> u32 {
    w32(base, Reg::QueueSel, index);
    if r32(base, Reg::QueueReady) != 0 || r32(base, Reg::QueueNumMax) < CTRL_QSIZE {
        return abi::NET_CTRL_UNUSABLE;
    }
    for off in (0..CQ_ACK + 8).step_by(8) {
        cq_write(off, 0u64);
    }
    CTRL_SENT.store(0, Ordering::Relaxed);
    set_queue(
        base,
        index,
        CTRL_QSIZE,
        [cq(CQ_DESC), cq(CQ_AVAIL), cq(CQ_USED)],
    );
    abi::NET_CTRL_OK
}

/// Sends `{class, cmd}`, a le16 and a writable ack byte as three descriptors (as Linux
/// does), and waits a bounded time for the used entry.
fn ctrl_command(base: u64, index: u32, class: u8, cmd: u8, data: u16) -> u32 {
    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    cq_write(CQ_HDR, class);
    cq_write(CQ_HDR + 1, cmd);
    cq_write(CQ_DATA, data.to_le());
    cq_write(CQ_ACK, 0xffu8);
    for (i, (off, len, flags)) in [(CQ_HDR, 2u32, NEXT), (CQ_DATA, 2, NEXT), (CQ_ACK, 1, WRITE)]
        .into_iter()
        .enumerate()
    {
        let d = CQ_DESC + i as u64 * 16;
        cq_write(d, cq(off));
        cq_write(d + 8, len);
        cq_write(d + 12, flags);
        cq_write(d + 14, if flags & NEXT != 0 { i as u16 + 1 } else { 0 });
    }
    let idx = CTRL_SENT.load(Ordering::Relaxed) as u16;
    cq_write(CQ_AVAIL + 4 + (idx as u32 % CTRL_QSIZE) as u64 * 2, 0u16);
    core::sync::atomic::fence(Ordering::SeqCst);
    let next = idx.wrapping_add(1);
    cq_write(CQ_AVAIL + 2, next);
    CTRL_SENT.store(next as u32, Ordering::Relaxed);
    core::sync::atomic::fence(Ordering::SeqCst);
    w32(base, Reg::QueueNotify, index);
    if !timer::wait_for(CTRL_TIMEOUT_MS, || cq_read::<u16>(CQ_USED + 2) == next) {
        return abi::NET_CTRL_NO_ANSWER;
    }
    if cq_read::<u8>(CQ_ACK) == 0 {
        abi::NET_CTRL_OK
    } else {
        abi::NET_CTRL_ERR
    }
}

/// Stops the devices (reset) so that they no longer write into the arena, which the next
/// task uses for something else, and takes their register pages back from user mode.
pub fn close() {
    close_one(abi::DEV_NET as usize);
    close_one(abi::DEV_VSOCK as usize);
    for p in &CPU_PAIR {
        p.store(0, Ordering::SeqCst);
    }
}

fn close_one(kind: usize) {
    let d = &DEV[kind];
    if d.rings.swap(0, Ordering::SeqCst) == 0 {
        return;
    }
    let base = d.base.load(Ordering::Relaxed);
    w32(base, Reg::Status, 0);
    paging::set_user_mmio(Reg::QueueNotify.at(base) & !0xfff, false);
}

fn used_idx(rings: u64, queue: u64) -> u16 {
    let at = rings + queue * abi::NET_QUEUE_BYTES + abi::NET_USED_OFF + 2;
    // SAFETY: `rings` was checked to lie in the task's arena when the device was opened
    // (`queue` is one of the queues set up there), and the task (stopped in this call on
    // this CPU) still owns it; a u16 has no invalid values.
    unsafe { core::ptr::read_volatile(at as *const u16) }
}

/// `SYS_NET_WAIT`: the used indices of the calling CPU's pair are checked with interrupts
/// off right before each halt, so an interrupt that raced the task's own last look still
/// wakes it (on an AP, through the BSP's handler: `irq`).
pub fn wait(timeout_us: u64, seen: u64, kind: u64) -> Result<u64, Error> {
    let kind = match kind {
        abi::DEV_NET | abi::DEV_VSOCK => kind as usize,
        _ => return Err(Error::BadArgument),
    };
    let cpu = smp::current();
    let mut rings = DEV[kind].rings.load(Ordering::SeqCst);
    if rings == 0 || cpu >= MAX_CPUS {
        return Err(Error::NoDevice);
    }
    if kind == abi::DEV_NET as usize {
        match CPU_PAIR[cpu].load(Ordering::SeqCst) {
            0 => return Err(Error::NoDevice),
            p => rings += (p - 1) as u64 * abi::NET_RING_BYTES,
        }
    }
    let us = timeout_us.min(abi::NET_MAX_WAIT_US);
    let mut end = rdtsc().saturating_add(us * timer::tsc_hz() / 1_000_000);
    let deadline = user::deadline(cpu);
    if deadline != 0 {
        end = end.min(deadline);
    }
    let irqs = irq_count(kind);
    let moved = || {
        used_idx(rings, 0) != seen as u16
            || (seen & abi::NET_WAIT_TX != 0 && used_idx(rings, 1) != (seen >> 16) as u16)
            || irq_count(kind) != irqs
    };
    let bit = 1u64 << cpu;
    WAITERS.fetch_or(bit, Ordering::SeqCst);
    let r = loop {
        if moved() {
            break 1;
        }
        if rdtsc() >= end {
            break 0;
        }
        timer::idle();
    };
    WAITERS.fetch_and(!bit, Ordering::SeqCst);
    Ok(r)
}
