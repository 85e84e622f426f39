//! The kernel's share of the devices user tasks drive, virtio-net and virtio-vsock: bring
//! the device up on rings that live in the task's arena, open its register page to the
//! task, and halt until the device has something.
//!
//! Everything per packet (buffers, descriptors, notifications, the TCP/IP stack, vsock's
//! connections) runs at CPL3 in `crate::net` and `crate::vsock`: kernel-mode code is
//! emulated on the development machines and would cost more than the packets themselves.

use core::sync::atomic::{AtomicU64, Ordering};

use super::transport::Reg;
use crate::abi::{self, Error, NetOpen};
use crate::arch::{mmio_read32, mmio_write32, rdtsc};
use crate::global::Global;
use crate::{paging, timer, user};

const S_ACK: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;
const S_FAILED: u32 = 0x80;

const F_MAC: u64 = 1 << 5;
const F_MRG_RXBUF: u64 = 1 << 15;
const F_VERSION_1: u64 = 1 << 32;
/// Checksum and segmentation offloads are left off: every frame is a plain Ethernet frame
/// of at most 1514 bytes, which keeps the user-mode driver simple.
const WANTED: u64 = F_VERSION_1 | F_MAC | F_MRG_RXBUF;
/// virtio-vsock has no feature bits of its own that the task needs.
const WANTED_VSOCK: u64 = F_VERSION_1;

/// Used when the device has no MAC of its own (locally administered).
const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x4d, 0x53, 0x42];

#[derive(Clone, Copy)]
struct Net {
    base: u64,
    /// The task's rings while the device is open (0: closed).
    rings: u64,
}

/// The devices by kind (`abi::DEV_NET`, `abi::DEV_VSOCK`).
static NET: Global<[Net; 2]> = Global::new([Net { base: 0, rings: 0 }; 2]);
/// MMIO bases for the interrupt handler, which must not touch `NET`.
static BASE: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];
static IRQS: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];

fn net(kind: usize) -> &'static mut Net {
    // SAFETY: touched only on the BSP's kernel path (boot, the running task's system calls
    // and its end), one call at a time; no caller keeps the reference.
    unsafe { &mut NET.get()[kind] }
}

/// Records the device of `kind` found at `base` (the first one only).
pub fn found(kind: usize, base: u64) -> bool {
    let n = net(kind);
    if n.base != 0 {
        return false;
    }
    n.base = base;
    BASE[kind].store(base, Ordering::Relaxed);
    true
}

pub fn irq(kind: usize) {
    let base = BASE[kind].load(Ordering::Relaxed);
    if base != 0 {
        let s = mmio_read32(Reg::InterruptStatus.at(base));
        mmio_write32(Reg::InterruptAck.at(base), s);
    }
    IRQS[kind].fetch_add(1, Ordering::Relaxed);
}

pub fn irq_count(kind: usize) -> u64 {
    IRQS[kind].load(Ordering::Relaxed)
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
/// so a task may open it again.
pub fn open(kind: u64, at: u64) -> Result<u64, Error> {
    let kind = match kind {
        abi::DEV_NET | abi::DEV_VSOCK => kind as usize,
        _ => return Err(Error::BadArgument),
    };
    let (ring_bytes, queues, wanted) = if kind == abi::DEV_VSOCK as usize {
        (abi::VSOCK_RING_BYTES, 3, WANTED_VSOCK)
    } else {
        (abi::NET_RING_BYTES, 2, WANTED)
    };
    let len = core::mem::size_of::<NetOpen>() as u64;
    if crate::smp::current() != 0 {
        return Err(Error::NoSuchCpu);
    }
    if !user::in_arena(at, len) || !at.is_multiple_of(8) {
        return Err(Error::BadArgument);
    }
    // SAFETY: checked to lie in the task's arena, aligned; the task is stopped in this call.
    let mut b = unsafe { core::ptr::read_volatile(at as *const NetOpen) };
    if !b.rings.is_multiple_of(4096) || !user::in_arena(b.rings, ring_bytes) {
        return Err(Error::BadArgument);
    }
    close_one(kind);
    let n = net(kind);
    if n.base == 0 {
        return Err(Error::NoDevice);
    }
    let base = n.base;
    let (features, qsize) = match init(base, b.rings, b.want_queue, queues, wanted) {
        Ok(v) => v,
        Err(()) => {
            w32(base, Reg::Status, r32(base, Reg::Status) | S_FAILED);
            return Err(Error::NoDevice);
        }
    };
    let mut mac = [0u8; 8];
    if kind == abi::DEV_VSOCK as usize {
        // The guest's cid, a le64 at the start of the configuration.
        mac[..4].copy_from_slice(&mmio_read32(base + 0x100).to_le_bytes());
        mac[4..].copy_from_slice(&mmio_read32(base + 0x104).to_le_bytes());
    } else if features & F_MAC != 0 {
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
    n.rings = b.rings;
    b.queue_size = qsize;
    b.features = features;
    b.mac = mac;
    b.notify = notify;
    b.deadline = user::deadline(0);
    b.poll_us = super::transport::poll_us();
    // SAFETY: as for the read above.
    unsafe { core::ptr::write_volatile(at as *mut NetOpen, b) };
    Ok(0)
}

/// Reset, feature negotiation, `queues` queues at `rings` (0 receive, 1 transmit, 2 vsock's
/// events), DRIVER_OK (virtio 1.x, 3.1.1). Returns the features and the queue size.
fn init(base: u64, rings: u64, want: u32, queues: u32, wanted: u64) -> Result<(u64, u32), ()> {
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
    let features = offered & wanted;
    w32(base, Reg::DriverFeaturesSel, 0);
    w32(base, Reg::DriverFeatures, features as u32);
    w32(base, Reg::DriverFeaturesSel, 1);
    w32(base, Reg::DriverFeatures, (features >> 32) as u32);
    w32(base, Reg::Status, S_ACK | S_DRIVER | S_FEATURES_OK);
    if r32(base, Reg::Status) & S_FEATURES_OK == 0 {
        return Err(());
    }
    let mut q = want.clamp(2, abi::NET_MAX_QUEUE);
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
        let at = rings + i as u64 * abi::NET_QUEUE_BYTES;
        w32(base, Reg::QueueSel, i);
        w32(base, Reg::QueueNum, q);
        w64(base, Reg::QueueDesc, at);
        w64(base, Reg::QueueAvail, at + abi::NET_AVAIL_OFF);
        w64(base, Reg::QueueUsed, at + abi::NET_USED_OFF);
        w32(base, Reg::QueueReady, 1);
    }
    w32(
        base,
        Reg::Status,
        S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
    );
    Ok((features, q))
}

/// Stops the devices (reset) so that they no longer write into the arena, which the next
/// task uses for something else, and takes their register pages back from user mode.
pub fn close() {
    close_one(abi::DEV_NET as usize);
    close_one(abi::DEV_VSOCK as usize);
}

fn close_one(kind: usize) {
    let n = net(kind);
    if n.rings == 0 {
        return;
    }
    n.rings = 0;
    w32(n.base, Reg::Status, 0);
    paging::set_user_mmio(Reg::QueueNotify.at(n.base) & !0xfff, false);
}

fn used_idx(rings: u64, queue: u64) -> u16 {
    let at = rings + queue * abi::NET_QUEUE_BYTES + abi::NET_USED_OFF + 2;
    // SAFETY: `rings` was checked to lie in the task's arena when the device was opened,
    // and the task (stopped in this call) still owns it; a u16 has no invalid values.
    unsafe { core::ptr::read_volatile(at as *const u16) }
}

/// `SYS_NET_WAIT`: the used indices are checked with interrupts off right before each
/// halt, so an interrupt that raced the task's own last look still wakes it.
pub fn wait(timeout_us: u64, seen: u64, kind: u64) -> Result<u64, Error> {
    let kind = match kind {
        abi::DEV_NET | abi::DEV_VSOCK => kind as usize,
        _ => return Err(Error::BadArgument),
    };
    let rings = net(kind).rings;
    if rings == 0 {
        return Err(Error::NoDevice);
    }
    let us = timeout_us.min(abi::NET_MAX_WAIT_US);
    let mut end = rdtsc().saturating_add(us * timer::tsc_hz() / 1_000_000);
    let deadline = user::deadline(0);
    if deadline != 0 {
        end = end.min(deadline);
    }
    let irqs = irq_count(kind);
    let moved = || {
        used_idx(rings, 0) != seen as u16
            || (seen & abi::NET_WAIT_TX != 0 && used_idx(rings, 1) != (seen >> 16) as u16)
            || irq_count(kind) != irqs
    };
    loop {
        if moved() {
            return Ok(1);
        }
        if rdtsc() >= end {
            return Ok(0);
        }
        timer::idle();
    }
}
