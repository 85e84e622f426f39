//! The virtio-net driver, run at CPL3: both split queues, their buffers and the device's
//! QueueNotify register all live where the task can reach them (`SYS_NET_OPEN` set that
//! up), so a packet costs no system call and, while traffic flows, no interrupt.
//!
//! Descriptor i of a queue always points at buffer i of that queue (2 KiB each), so the
//! rings carry nothing but indices. Interrupts stay suppressed (`VIRTQ_AVAIL_F_NO_INTERRUPT`)
//! except around `SYS_NET_WAIT`, and a queue is notified once per batch and only when the
//! device has not said it is polling anyway (`VIRTQ_USED_F_NO_NOTIFY`).

use core::sync::atomic::{compiler_fence, fence, Ordering};

use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

use super::Carve;
use crate::abi::{self, Error, NetOpen};
use crate::ulib;

/// Bytes per buffer: a 1514-byte frame and its header fit, so no packet needs two.
const BUF: u64 = 2048;
/// `virtio_net_hdr_v1` (VERSION_1: always with `num_buffers`).
const HDR: u64 = 12;
/// The largest Ethernet frame without offloads (1500-byte MTU plus the 14-byte header).
const MAX_FRAME: usize = 1514;

const F_MRG_RXBUF: u64 = 1 << 15;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const USED_F_NO_NOTIFY: u16 = 1;
const D_WRITE: u16 = 2;

/// Reads a `T` the device may change at any time.
pub(crate) fn load<T: Copy>(addr: u64) -> T {
    // SAFETY: every caller passes an aligned address inside the ring or buffer memory this
    // task carved from its arena for the device; only integers are read, so any bytes the
    // device left are valid.
    unsafe { core::ptr::read_volatile(addr as *const T) }
}

/// Writes a `T` the device may read at any time.
pub(crate) fn store<T: Copy>(addr: u64, v: T) {
    // SAFETY: as in `load`: aligned, inside this task's ring or buffer memory, which no Rust
    // reference covers.
    unsafe { core::ptr::write_volatile(addr as *mut T, v) }
}

/// One split virtqueue in the task's memory (layout: `abi::NET_*_OFF`); the vsock driver
/// uses it too.
pub(crate) struct Ring {
    pub(crate) base: u64,
    pub(crate) size: u16,
    pub(crate) queue: u32,
    pub(crate) notify: u64,
    pub(crate) avail_idx: u16,
    pub(crate) used_seen: u16,
    /// Buffers offered since the last notification.
    pub(crate) unkicked: u16,
    pub(crate) kicks: u64,
}

impl Ring {
    fn avail(&self) -> u64 {
        self.base + abi::NET_AVAIL_OFF
    }

    fn used(&self) -> u64 {
        self.base + abi::NET_USED_OFF
    }

    pub(crate) fn set_desc(&self, id: u16, addr: u64, len: u32, flags: u16) {
        let d = self.base + id as u64 * 16;
        store(d, addr);
        store(d + 8, len);
        store(d + 12, flags);
        store(d + 14, 0u16);
    }

    /// Publishes descriptor `id`. x86 keeps stores in order, so a compiler fence is all
    /// the ordering the descriptor → ring slot → index sequence needs.
    pub(crate) fn offer(&mut self, id: u16) {
        store(
            self.avail() + 4 + (self.avail_idx % self.size) as u64 * 2,
            id,
        );
        compiler_fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        store(self.avail() + 2, self.avail_idx);
        self.unkicked += 1;
    }

    fn used_idx(&self) -> u16 {
        load(self.used() + 2)
    }

    pub(crate) fn pending(&self) -> bool {
        self.used_idx() != self.used_seen
    }

    /// The next used entry: (descriptor, bytes written by the device).
    pub(crate) fn take(&mut self) -> Option<(u16, u32)> {
        if !self.pending() {
            return None;
        }
        // Loads are not reordered with loads on x86: the entry is read after the index.
        compiler_fence(Ordering::SeqCst);
        let e = self.used() + 4 + (self.used_seen % self.size) as u64 * 8;
        let id = load::<u32>(e);
        let len = load::<u32>(e + 4);
        self.used_seen = self.used_seen.wrapping_add(1);
        Some(((id % self.size as u32) as u16, len))
    }

    /// Notifies the device of what was offered since the last call, unless it said it
    /// does not need to be told. The full fence orders the index store before the flag
    /// load (virtio 1.x, 2.7.7.2).
    pub(crate) fn kick(&mut self) {
        if self.unkicked == 0 {
            return;
        }
        self.unkicked = 0;
        fence(Ordering::SeqCst);
        if load::<u16>(self.used()) & USED_F_NO_NOTIFY == 0 {
            store(self.notify, self.queue);
            self.kicks += 1;
        }
    }

    pub(crate) fn set_interrupts(&self, on: bool) {
        store(self.avail(), if on { 0 } else { AVAIL_F_NO_INTERRUPT });
    }
}

pub struct Rx {
    ring: Ring,
    bufs: u64,
    /// VIRTIO_NET_F_MRG_RXBUF was negotiated (`num_buffers` is meaningful).
    pub merged: bool,
    /// Further buffers of a merged packet still to be thrown away.
    skip: u16,
    /// If not 0, IPv4 TCP and UDP frames to another port are dropped (`foreign`): a
    /// frame of another copy's flow that the host put on this pair must not reach this
    /// copy's stack, which would answer it with a reset.
    pub only_port: u16,
    pub packets: u64,
    pub dropped: u64,
    pub foreign: u64,
}

impl Rx {
    fn recycle(&mut self, id: u16) {
        self.ring.offer(id);
    }

    /// False for an IPv4 TCP or UDP frame at `at` whose destination port is not
    /// `only_port`; everything else (ARP, ICMP, fragments) is ours.
    fn ours(&self, at: u64, len: usize) -> bool {
        if len < 14 + 20 || load::<u16>(at + 12) != 0x0008 {
            return true;
        }
        let ip = at + 14;
        let ihl = (load::<u8>(ip) & 0xf) as usize * 4;
        let proto = load::<u8>(ip + 9);
        let frag = u16::from_be(load::<u16>(ip + 6)) & 0x1fff;
        if !(proto == 6 || proto == 17) || frag != 0 || len < 14 + ihl + 4 {
            return true;
        }
        let port = ((load::<u8>(ip + ihl as u64 + 2) as u16) << 8)
            | load::<u8>(ip + ihl as u64 + 3) as u16;
        port == self.only_port
    }

    /// The next whole frame: (buffer, frame bytes). Frames spread over several buffers
    /// cannot happen without offloads; should one come anyway, it is dropped.
    fn next(&mut self) -> Option<(u16, usize)> {
        loop {
            let (id, len) = self.ring.take()?;
            let buf = self.bufs + id as u64 * BUF;
            if self.skip > 0 {
                self.skip -= 1;
                self.recycle(id);
                continue;
            }
            let parts = if self.merged {
                load::<u16>(buf + 10)
            } else {
                1
            };
            if parts != 1 || (len as u64) <= HDR || len as u64 > BUF {
                self.skip = parts.saturating_sub(1);
                self.dropped += 1;
                self.recycle(id);
                continue;
            }
            let frame = (len as u64 - HDR) as usize;
            if self.only_port != 0 && !self.ours(buf + HDR, frame) {
                self.foreign += 1;
                self.recycle(id);
                continue;
            }
            self.packets += 1;
            return Some((id, frame));
        }
    }
}

pub struct Tx {
    ring: Ring,
    bufs: u64,
    free: [u16; abi::NET_MAX_QUEUE as usize],
    nfree: usize,
    pub packets: u64,
}

impl Tx {
    fn reclaim(&mut self) {
        while let Some((id, _)) = self.ring.take() {
            if self.nfree < self.free.len() {
                self.free[self.nfree] = id;
                self.nfree += 1;
            }
        }
    }

    fn full(&self) -> bool {
        self.nfree == 0
    }
}

pub struct VirtioNet {
    pub rx: Rx,
    pub tx: Tx,
    pub mac: [u8; 6],
    /// `SYS_NET_WAIT` calls.
    pub waits: u64,
    /// The task's deadline (TSC; 0: none) and how long to poll before waiting.
    pub deadline: u64,
    pub poll_us: u64,
    /// The pair this driver runs (queues 2k and 2k+1), the pairs the device uses, its
    /// `max_virtqueue_pairs` and what became of its control queue (`abi::NET_CTRL_*`).
    pub pair: u32,
    pub pairs: u32,
    pub max_pairs: u32,
    pub ctrl: u32,
}

/// Rings for `pairs` queue pairs, zeroed, ready for `VirtioNet::open`.
pub fn carve_rings(mem: &mut Carve, pairs: u32) -> Result<u64, Error> {
    let bytes = abi::NET_RING_BYTES * pairs.clamp(1, abi::NET_MAX_PAIRS) as u64;
    let rings = mem.take(bytes).ok_or(Error::NoMemory)?;
    // SAFETY: freshly carved from this task's arena, nothing else refers to it, and the
    // device is not using it yet.
    unsafe { core::ptr::write_bytes(rings as *mut u8, 0, bytes as usize) };
    Ok(rings)
}

impl VirtioNet {
    /// Carves rings for `pairs` queue pairs and the buffers of one from `mem`, has the
    /// kernel bring the device up on them, and drives the calling CPU's pair.
    pub fn open(mem: &mut Carve, pairs: u32) -> Result<VirtioNet, Error> {
        let rings = carve_rings(mem, pairs)?;
        let mut b = NetOpen {
            rings,
            want_queue: abi::NET_MAX_QUEUE,
            pairs: pairs.clamp(1, abi::NET_MAX_PAIRS),
            pair: abi::NET_PAIR_ANY,
            ..NetOpen::default()
        };
        let bufs = Self::carve_bufs(mem)?;
        ulib::net_open(&mut b)?;
        Ok(Self::start(&b, bufs))
    }

    /// Brings the device up on `rings` (from `carve_rings`, room for `pairs`) and drives
    /// pair `pair`, with buffers from `mem`; the task's other CPUs then `attach`.
    pub fn open_on(rings: u64, pairs: u32, pair: u32, mem: &mut Carve) -> Result<VirtioNet, Error> {
        let mut b = NetOpen {
            rings,
            want_queue: abi::NET_MAX_QUEUE,
            pairs,
            pair,
            ..NetOpen::default()
        };
        let bufs = Self::carve_bufs(mem)?;
        ulib::net_open(&mut b)?;
        Ok(Self::start(&b, bufs))
    }

    /// Drives pair `pair` of the device another CPU of this task brought up on `rings`.
    pub fn attach(rings: u64, pair: u32, mem: &mut Carve) -> Result<VirtioNet, Error> {
        let mut b = NetOpen {
            rings,
            pair,
            flags: abi::NET_OPEN_PAIR,
            ..NetOpen::default()
        };
        let bufs = Self::carve_bufs(mem)?;
        ulib::net_open(&mut b)?;
        Ok(Self::start(&b, bufs))
    }

    fn carve_bufs(mem: &mut Carve) -> Result<(u64, u64), Error> {
        let qbytes = abi::NET_MAX_QUEUE as u64 * BUF;
        let rx_bufs = mem.take(qbytes).ok_or(Error::NoMemory)?;
        let tx_bufs = mem.take(qbytes).ok_or(Error::NoMemory)?;
        Ok((rx_bufs, tx_bufs))
    }

    /// Posts every receive buffer of the pair the kernel gave this CPU.
    fn start(b: &NetOpen, (rx_bufs, tx_bufs): (u64, u64)) -> VirtioNet {
        let size = b.queue_size as u16;
        let ring = |queue: u32| Ring {
            base: b.rings + queue as u64 * abi::NET_QUEUE_BYTES,
            size,
            queue,
            notify: b.notify,
            avail_idx: 0,
            used_seen: 0,
            unkicked: 0,
            kicks: 0,
        };
        let mut rx = Rx {
            ring: ring(2 * b.pair),
            bufs: rx_bufs,
            merged: b.features & F_MRG_RXBUF != 0,
            skip: 0,
            only_port: 0,
            packets: 0,
            dropped: 0,
            foreign: 0,
        };
        let mut tx = Tx {
            ring: ring(2 * b.pair + 1),
            bufs: tx_bufs,
            free: [0; abi::NET_MAX_QUEUE as usize],
            nfree: size as usize,
            packets: 0,
        };
        for id in 0..size {
            tx.free[id as usize] = size - 1 - id;
            rx.ring
                .set_desc(id, rx_bufs + id as u64 * BUF, BUF as u32, D_WRITE);
            rx.recycle(id);
        }
        rx.ring.set_interrupts(false);
        tx.ring.set_interrupts(false);
        rx.ring.kick();
        let mut mac = [0; 6];
        mac.copy_from_slice(&b.mac[..6]);
        VirtioNet {
            rx,
            tx,
            mac,
            waits: 0,
            deadline: b.deadline,
            poll_us: b.poll_us,
            pair: b.pair,
            pairs: b.pairs,
            max_pairs: b.max_pairs,
            ctrl: b.ctrl,
        }
    }

    pub fn kicks(&self) -> u64 {
        self.rx.ring.kicks + self.tx.ring.kicks
    }

    /// Notifies both queues of what the last round of work offered.
    pub fn flush(&mut self) {
        self.rx.ring.kick();
        self.tx.ring.kick();
    }

    /// True if the device has handed back something worth a look: a frame, or transmit
    /// buffers while all of them are in flight.
    pub fn ready(&self) -> bool {
        self.rx.ring.pending() || (self.tx.full() && self.tx.ring.pending())
    }

    /// Polls for up to `poll_us` (bounded by `max_us`), then halts in the kernel until the
    /// device interrupts or `max_us` passes. The interrupt is enabled only for this wait,
    /// and the rings are looked at once more after enabling it, so nothing that came in
    /// between is slept through.
    pub fn idle(&mut self, max_us: u64, hz: u64) {
        let t0 = ulib::rdtsc();
        let spin = self.poll_us.min(max_us) * hz / 1_000_000;
        while ulib::rdtsc() - t0 < spin {
            if self.ready() {
                return;
            }
            core::hint::spin_loop();
        }
        self.tx.reclaim();
        let watch_tx = self.tx.full();
        self.rx.ring.set_interrupts(true);
        if watch_tx {
            self.tx.ring.set_interrupts(true);
        }
        fence(Ordering::SeqCst);
        if !self.ready() {
            let left = max_us.saturating_sub((ulib::rdtsc() - t0) * 1_000_000 / hz.max(1));
            self.waits += 1;
            ulib::net_wait(
                left,
                self.rx.ring.used_seen,
                watch_tx.then_some(self.tx.ring.used_seen),
            );
        }
        self.rx.ring.set_interrupts(false);
        self.tx.ring.set_interrupts(false);
    }
}

pub struct RxToken<'a> {
    rx: &'a mut Rx,
    id: u16,
    len: usize,
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        let at = self.rx.bufs + self.id as u64 * BUF + HDR;
        // SAFETY: buffer `id` of the receive queue, which the device handed back and will
        // not touch until it is offered again below; `len` fits the buffer (`Rx::next`).
        let r = f(unsafe { core::slice::from_raw_parts(at as *const u8, self.len) });
        self.rx.recycle(self.id);
        r
    }
}

pub struct TxToken<'a> {
    tx: &'a mut Tx,
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let tx = self.tx;
        // A token is made only with a buffer free (`receive`, `transmit`).
        tx.nfree -= 1;
        let id = tx.free[tx.nfree];
        let buf = tx.bufs + id as u64 * BUF;
        let len = len.min(MAX_FRAME);
        store(buf, 0u64);
        store(buf + 8, 0u32);
        // SAFETY: buffer `id` of the transmit queue is free (the device gave it back, or
        // never had it), and `HDR + len` fits in `BUF`.
        let r = f(unsafe { core::slice::from_raw_parts_mut((buf + HDR) as *mut u8, len) });
        tx.ring.set_desc(id, buf, (HDR as usize + len) as u32, 0);
        tx.ring.offer(id);
        tx.packets += 1;
        r
    }
}

impl phy::Device for VirtioNet {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    /// A frame comes with the right to answer it, so one is handed out only while a
    /// transmit buffer is free.
    fn receive(&mut self, _: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        self.tx.reclaim();
        if self.tx.full() {
            self.tx.ring.kick();
            return None;
        }
        let (id, len) = self.rx.next()?;
        Some((
            RxToken {
                rx: &mut self.rx,
                id,
                len,
            },
            TxToken { tx: &mut self.tx },
        ))
    }

    fn transmit(&mut self, _: Instant) -> Option<TxToken<'_>> {
        self.tx.reclaim();
        if self.tx.full() {
            self.tx.ring.kick();
            return None;
        }
        Some(TxToken { tx: &mut self.tx })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = MAX_FRAME;
        c
    }
}
