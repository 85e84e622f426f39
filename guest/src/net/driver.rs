//! The virtio-net driver, run at CPL3: both split queues, their buffers and the device's
//! QueueNotify register all live where the task can reach them (`SYS_NET_OPEN` set that
//! up), so a packet costs no system call and, while traffic flows, no interrupt.
//!
//! Descriptor i of a queue points at buffer i of that queue (2 KiB each), but for a large
//! TCP frame, which gets a slot of `tso`'s; so what the device hands back is an index and
//! nothing else. Interrupts stay suppressed (`VIRTQ_AVAIL_F_NO_INTERRUPT`)
//! except around `SYS_NET_WAIT`, and a queue is notified once per batch and only when the
//! device has not said it is polling anyway (`VIRTQ_USED_F_NO_NOTIFY`).

use core::sync::atomic::{compiler_fence, fence, AtomicU64, Ordering};

use smoltcp::phy::{self, Checksum, DeviceCapabilities, Medium, PacketMeta};
use smoltcp::time::Instant;

use super::tso::{self, Tso};
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
const F_HOST_TSO4: u64 = 1 << 11;
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
    /// Queue `queue` of a device whose rings start at `rings` (one `abi::NET_QUEUE_BYTES`
    /// each), nothing posted yet.
    pub(crate) fn at(rings: u64, queue: u32, size: u16, notify: u64) -> Ring {
        Ring {
            base: rings + queue as u64 * abi::NET_QUEUE_BYTES,
            size,
            queue,
            notify,
            avail_idx: 0,
            used_seen: 0,
            unkicked: 0,
            kicks: 0,
        }
    }

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
    /// Where a frame for another copy's port goes instead (`VirtioNet::share`): the
    /// copies' boxes, copy i's port being `only_port - me + i`, and this copy's index.
    forward: Option<(&'static [FrameBox], u16)>,
    pub packets: u64,
    pub dropped: u64,
    pub foreign: u64,
}

impl Rx {
    fn recycle(&mut self, id: u16) {
        self.ring.offer(id);
    }

    /// The destination port of an IPv4 TCP or UDP frame at `at` that is not `only_port`;
    /// `None` for everything else (ours, ARP, ICMP, fragments).
    fn foreign_port(&self, at: u64, len: usize) -> Option<u16> {
        if len < 14 + 20 || load::<u16>(at + 12) != 0x0008 {
            return None;
        }
        let ip = at + 14;
        let ihl = (load::<u8>(ip) & 0xf) as usize * 4;
        let proto = load::<u8>(ip + 9);
        let frag = u16::from_be(load::<u16>(ip + 6)) & 0x1fff;
        if !(proto == 6 || proto == 17) || frag != 0 || len < 14 + ihl + 4 {
            return None;
        }
        let l4 = ip + ihl as u64;
        let port = ((load::<u8>(l4 + 2) as u16) << 8) | load::<u8>(l4 + 3) as u16;
        (port != self.only_port).then_some(port)
    }

    /// Hands a frame for `port` to the copy that has it, if one does and it fits a box.
    fn pass_on(&self, port: u16, at: u64, len: usize) {
        let Some((boxes, me)) = self.forward else {
            return;
        };
        let first = self.only_port.wrapping_sub(me);
        let i = port.wrapping_sub(first) as usize;
        if i < boxes.len() && i != me as usize && len <= ARP_BYTES {
            boxes[i].publish(me as u32, at, len);
        }
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
            if self.only_port != 0 {
                if let Some(port) = self.foreign_port(buf + HDR, frame) {
                    self.pass_on(port, buf + HDR, frame);
                    self.foreign += 1;
                    self.recycle(id);
                    continue;
                }
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
    /// Large frames' slots and the headers that leave checksums and segmentation to the
    /// device, when it takes them (`HOST_TSO4`).
    pub tso: Option<Tso>,
}

impl Tx {
    fn reclaim(&mut self) {
        while let Some((id, _)) = self.ring.take() {
            if let Some(t) = &mut self.tso {
                t.done(id);
            }
            if self.nfree < self.free.len() {
                self.free[self.nfree] = id;
                self.nfree += 1;
            }
        }
    }

    /// True unless every buffer, or with TSO every large frame's slot, is with the device:
    /// a token is handed out only when the frame it makes has somewhere to go.
    fn full(&self) -> bool {
        self.nfree == 0 || self.tso.as_ref().is_some_and(|t| !t.has_room())
    }
}

/// A driver's buffers: receive and transmit (one per descriptor), and the TSO frames'
/// slots if there was room.
struct Bufs {
    rx: u64,
    tx: u64,
    tso: Option<u64>,
}

pub struct VirtioNet {
    /// The receive queue of this driver's pair.
    pub rx: Rx,
    /// The receive queues of the device's other pairs, for a driver that is the only one
    /// (`take_all_pairs`): the host's TAP puts frames of no known flow (an ARP reply, a
    /// new connection) on any queue.
    others: [Option<Rx>; abi::NET_MAX_PAIRS as usize - 1],
    pub tx: Tx,
    pub mac: [u8; 6],
    /// `SYS_NET_WAIT` calls.
    pub waits: u64,
    /// TSC cycles spent polling the rings in `idle` and halted in `SYS_NET_WAIT`: what
    /// of the task's time went to waiting for the host rather than to its own work.
    pub spin_cycles: u64,
    pub wait_cycles: u64,
    /// The task's deadline (TSC; 0: none) and how long to poll before waiting.
    pub deadline: u64,
    pub poll_us: u64,
    /// The pair this driver runs (queues 2k and 2k+1), the pairs the device uses, its
    /// `max_virtqueue_pairs` and what became of its control queue (`abi::NET_CTRL_*`).
    pub pair: u32,
    pub pairs: u32,
    pub max_pairs: u32,
    pub ctrl: u32,
    /// What the kernel answered to the open (for `take_pairs`).
    open: NetOpen,
    /// The copies' shared ARP frame and this copy's own box (`share`), the last of each
    /// seen, a copy of one to hand to the stack, and how many were taken from there.
    arp: Option<(&'static FrameBox, &'static FrameBox)>,
    arp_seen: u64,
    inbox_seen: u64,
    arp_frame: [u8; ARP_BYTES],
    pub arp_in: u64,
    pub passed_in: u64,
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
        let mut d = Self::start(&b, bufs);
        d.take_pairs(0, mem)?;
        Ok(d)
    }

    /// Also takes the receive queues of the device's pairs from `first` on but its own,
    /// with buffers from `mem`: for a driver that is the only one of the device (`first`
    /// 0), or that of copy 0 of a task whose copies leave the pairs from `first` on
    /// unused. Its transmit queue stays its own pair's.
    pub fn take_pairs(&mut self, first: u32, mem: &mut Carve) -> Result<(), Error> {
        let b = self.open;
        let qbytes = abi::NET_MAX_QUEUE as u64 * BUF;
        let mut slots = self.others.iter_mut().filter(|r| r.is_none());
        for pair in (first..b.pairs.min(abi::NET_MAX_PAIRS)).filter(|&p| p != b.pair) {
            let bufs = mem.take(qbytes).ok_or(Error::NoMemory)?;
            if let Some(slot) = slots.next() {
                *slot = Some(Self::new_rx(&b, 2 * pair, bufs));
            }
        }
        Ok(())
    }

    /// Makes this driver copy `me` of a `procs=P` task whose copies share `arp` (every ARP
    /// frame a pair receives) and `boxes` (box i: a frame for copy i's port that another
    /// pair received). `rx.only_port` must be set first.
    pub fn share(&mut self, arp: &'static FrameBox, boxes: &'static [FrameBox], me: u16) {
        self.arp_seen = arp.seq.load(Ordering::Acquire);
        self.inbox_seen = boxes[me as usize].seq.load(Ordering::Acquire);
        self.arp = Some((arp, &boxes[me as usize]));
        self.rx.forward = Some((boxes, me));
        for r in self.others.iter_mut().flatten() {
            r.only_port = self.rx.only_port;
            r.forward = Some((boxes, me));
        }
    }

    /// Frames taken from the other pairs' receive queues, and those dropped there.
    pub fn other_pairs_rx(&self) -> (u64, u64) {
        self.others
            .iter()
            .flatten()
            .fold((0, 0), |(p, d), r| (p + r.packets, d + r.dropped))
    }

    /// Frames taken from every receive queue this driver has.
    pub fn rx_packets(&self) -> u64 {
        self.rx.packets + self.other_pairs_rx().0
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

    fn carve_bufs(mem: &mut Carve) -> Result<Bufs, Error> {
        let qbytes = abi::NET_MAX_QUEUE as u64 * BUF;
        let rx = mem.take(qbytes).ok_or(Error::NoMemory)?;
        let tx = mem.take(qbytes).ok_or(Error::NoMemory)?;
        // Without room for them, segments go one by one.
        let tso = mem.take(tso::SLOTS as u64 * tso::SLOT_BYTES);
        Ok(Bufs { rx, tx, tso })
    }

    /// Receive queue `queue` on `bufs`, every buffer posted, interrupts off.
    fn new_rx(b: &NetOpen, queue: u32, bufs: u64) -> Rx {
        let size = b.queue_size as u16;
        let mut rx = Rx {
            ring: Ring::at(b.rings, queue, size, b.notify),
            bufs,
            merged: b.features & F_MRG_RXBUF != 0,
            skip: 0,
            only_port: 0,
            forward: None,
            packets: 0,
            dropped: 0,
            foreign: 0,
        };
        for id in 0..size {
            rx.ring
                .set_desc(id, bufs + id as u64 * BUF, BUF as u32, D_WRITE);
            rx.recycle(id);
        }
        rx.ring.set_interrupts(false);
        rx.ring.kick();
        rx
    }

    /// Posts every receive buffer of the pair the kernel gave this CPU.
    fn start(b: &NetOpen, bufs: Bufs) -> VirtioNet {
        let size = b.queue_size as u16;
        let ring = |queue: u32| Ring::at(b.rings, queue, size, b.notify);
        let rx = Self::new_rx(b, 2 * b.pair, bufs.rx);
        let mut tx = Tx {
            ring: ring(2 * b.pair + 1),
            bufs: bufs.tx,
            free: [0; abi::NET_MAX_QUEUE as usize],
            nfree: size as usize,
            packets: 0,
            tso: bufs
                .tso
                .filter(|_| b.features & F_HOST_TSO4 != 0)
                .map(Tso::new),
        };
        for id in 0..size {
            tx.free[id as usize] = size - 1 - id;
        }
        tx.ring.set_interrupts(false);
        let mut mac = [0; 6];
        mac.copy_from_slice(&b.mac[..6]);
        VirtioNet {
            rx,
            others: [const { None }; abi::NET_MAX_PAIRS as usize - 1],
            tx,
            mac,
            waits: 0,
            spin_cycles: 0,
            wait_cycles: 0,
            deadline: b.deadline,
            poll_us: b.poll_us,
            pair: b.pair,
            pairs: b.pairs,
            max_pairs: b.max_pairs,
            ctrl: b.ctrl,
            open: *b,
            arp: None,
            arp_seen: 0,
            inbox_seen: 0,
            arp_frame: [0; ARP_BYTES],
            arp_in: 0,
            passed_in: 0,
        }
    }

    /// TSC cycles polled or halted for the device so far (`spin_cycles`, `wait_cycles`).
    pub fn waited_cycles(&self) -> u64 {
        self.spin_cycles + self.wait_cycles
    }

    pub fn kicks(&self) -> u64 {
        let others: u64 = self.others.iter().flatten().map(|r| r.ring.kicks).sum();
        self.rx.ring.kicks + self.tx.ring.kicks + others
    }

    /// Notifies the queues of what the last round of work offered.
    pub fn flush(&mut self) {
        self.rx.ring.kick();
        for r in self.others.iter_mut().flatten() {
            r.ring.kick();
        }
        self.tx.ring.kick();
    }

    /// True if the device has handed back something worth a look: a frame, or transmit
    /// buffers while all of them are in flight.
    pub fn ready(&self) -> bool {
        self.rx.ring.pending()
            || self.others.iter().flatten().any(|r| r.ring.pending())
            || self
                .arp
                .is_some_and(|(a, b)| a.changed(self.arp_seen) || b.changed(self.inbox_seen))
            || (self.tx.full() && self.tx.ring.pending())
    }

    fn set_rx_interrupts(&self, on: bool) {
        self.rx.ring.set_interrupts(on);
        for r in self.others.iter().flatten() {
            r.ring.set_interrupts(on);
        }
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
                self.spin_cycles += ulib::rdtsc() - t0;
                return;
            }
            core::hint::spin_loop();
        }
        let t1 = ulib::rdtsc();
        self.spin_cycles += t1 - t0;
        self.tx.reclaim();
        let watch_tx = self.tx.full();
        // The kernel watches this pair's rings; an interrupt from another pair's receive
        // queue ends the wait too.
        self.set_rx_interrupts(true);
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
            self.wait_cycles += ulib::rdtsc() - t1;
        }
        self.set_rx_interrupts(false);
        self.tx.ring.set_interrupts(false);
    }
}

pub enum RxToken<'a> {
    /// Buffer `id` of a receive queue, `len` bytes of frame.
    Ring { rx: &'a mut Rx, id: u16, len: usize },
    /// A frame another copy took from its pair (`FrameBox`).
    Shared(&'a [u8]),
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        match self {
            RxToken::Ring { rx, id, len } => {
                let at = rx.bufs + id as u64 * BUF + HDR;
                // SAFETY: buffer `id` of the receive queue, which the device handed back
                // and will not touch until it is offered again below; `len` fits the
                // buffer (`Rx::next`).
                let r = f(unsafe { core::slice::from_raw_parts(at as *const u8, len) });
                rx.recycle(id);
                r
            }
            RxToken::Shared(frame) => f(frame),
        }
    }
}

/// One frame in memory the copies of a `procs=P` task share, handed from the copy whose
/// pair received it to the copy (or copies) it is for. The copies have one address and one
/// MAC but a stack each, and the host's TAP puts a frame of no flow it knows (an ARP reply,
/// a connection's first answer) on whichever queue it likes: without this, the copy it was
/// for would wait for its retry (a second) while another copy dropped it.
#[repr(C)]
pub struct FrameBox {
    /// Even: settled; odd: being written. Every write adds 2.
    seq: AtomicU64,
    /// The pair that wrote it, and its length.
    from: AtomicU64,
    len: AtomicU64,
    frame: [AtomicU64; ARP_WORDS],
}

/// Bytes of a frame kept: an ARP frame (42, padded to Ethernet's 60) and a TCP segment
/// without data (a SYN-ACK with options, 66 or so) fit.
const ARP_WORDS: usize = 16;
const ARP_BYTES: usize = ARP_WORDS * 8;

impl FrameBox {
    pub fn clear(&self) {
        self.seq.store(0, Ordering::SeqCst);
    }

    fn publish(&self, from: u32, at: u64, len: usize) {
        let mut s = self.seq.load(Ordering::Relaxed);
        loop {
            if s.is_multiple_of(2) {
                match self
                    .seq
                    .compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                {
                    Ok(_) => break,
                    Err(now) => s = now,
                }
            } else {
                core::hint::spin_loop();
                s = self.seq.load(Ordering::Relaxed);
            }
        }
        let len = len.min(ARP_BYTES);
        let mut b = [0u8; ARP_BYTES];
        for (i, x) in b[..len].iter_mut().enumerate() {
            *x = load::<u8>(at + i as u64);
        }
        for (w, c) in self.frame.iter().zip(b.chunks_exact(8)) {
            w.store(
                u64::from_le_bytes(c.try_into().unwrap_or([0; 8])),
                Ordering::Relaxed,
            );
        }
        self.from.store(from as u64, Ordering::Relaxed);
        self.len.store(len as u64, Ordering::Relaxed);
        self.seq.store(s + 2, Ordering::Release);
    }

    fn changed(&self, seen: u64) -> bool {
        let s = self.seq.load(Ordering::Acquire);
        s != seen && s.is_multiple_of(2)
    }

    /// The frame into `out` if it is new since `seen` and another pair's: its length.
    fn take(&self, seen: &mut u64, me: u32, out: &mut [u8; ARP_BYTES]) -> Option<usize> {
        let s = self.seq.load(Ordering::Acquire);
        if s == *seen || !s.is_multiple_of(2) {
            return None;
        }
        for (w, c) in self.frame.iter().zip(out.chunks_exact_mut(8)) {
            c.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        let (from, len) = (
            self.from.load(Ordering::Relaxed),
            self.len.load(Ordering::Relaxed) as usize,
        );
        if self.seq.load(Ordering::Acquire) != s {
            return None;
        }
        *seen = s;
        (from != me as u64).then_some(len.min(ARP_BYTES))
    }
}

pub struct TxToken<'a> {
    tx: &'a mut Tx,
    /// The MSS smoltcp asks the device to cut this frame at (`segmentation-offload`).
    mss: Option<u16>,
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let tx = self.tx;
        // A token is made only with a buffer free, and with TSO a slot too (`Tx::full`).
        tx.nfree -= 1;
        let id = tx.free[tx.nfree];
        let small = tx.bufs + id as u64 * BUF;
        // A frame longer than the buffer goes in a slot (`Tx::full` kept one free).
        let slot = tx.tso.as_mut().filter(|_| len > MAX_FRAME);
        let (hdr, room) = match slot.and_then(|t| t.claim(id)) {
            Some(at) => (at, tso::MAX_FRAME),
            None => (small, MAX_FRAME),
        };
        let len = len.min(room);
        // SAFETY: buffer `id` of the transmit queue, or the slot just claimed for it, is
        // free (the device gave it back, or never had it), and `HDR + len` fits in it.
        let frame = unsafe { core::slice::from_raw_parts_mut((hdr + HDR) as *mut u8, len) };
        let r = f(frame);
        match &mut tx.tso {
            Some(t) => t.header(hdr, frame, self.mss),
            None => {
                store(hdr, 0u64);
                store(hdr + 8, 0u32);
            }
        }
        tx.packets += 1;
        tx.ring.set_desc(id, hdr, (HDR as usize + len) as u32, 0);
        tx.ring.offer(id);
        r
    }

    fn set_meta(&mut self, meta: PacketMeta) {
        self.mss = meta.segmentation_offload_size.map(|m| m.get());
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
        if let Some((arp, inbox)) = self.arp {
            let got = match arp.take(&mut self.arp_seen, self.pair, &mut self.arp_frame) {
                Some(len) => {
                    self.arp_in += 1;
                    Some(len)
                }
                None => inbox
                    .take(&mut self.inbox_seen, u32::MAX, &mut self.arp_frame)
                    .inspect(|_| self.passed_in += 1),
            };
            if let Some(len) = got {
                return Some((
                    RxToken::Shared(&self.arp_frame[..len]),
                    TxToken {
                        tx: &mut self.tx,
                        mss: None,
                    },
                ));
            }
        }
        let rx = match self.rx.next() {
            Some(got) => Some((&mut self.rx, got)),
            None => self
                .others
                .iter_mut()
                .flatten()
                .find_map(|r| r.next().map(|got| (r, got))),
        };
        let (rx, (id, len)) = rx?;
        if let Some((arp, _)) = self.arp {
            let at = rx.bufs + id as u64 * BUF + HDR;
            if len >= 14 && load::<u16>(at + 12) == 0x0608 {
                arp.publish(self.pair, at, len);
            }
        }
        Some((
            RxToken::Ring { rx, id, len },
            TxToken {
                tx: &mut self.tx,
                mss: None,
            },
        ))
    }

    fn transmit(&mut self, _: Instant) -> Option<TxToken<'_>> {
        self.tx.reclaim();
        if self.tx.full() {
            self.tx.ring.kick();
            return None;
        }
        Some(TxToken {
            tx: &mut self.tx,
            mss: None,
        })
    }

    /// With TSO, smoltcp builds segments of up to 64 KiB and leaves every TCP checksum
    /// to the device (`tso`).
    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = MAX_FRAME;
        if self.tx.tso.is_some() {
            c.checksum.tcp = Checksum::Rx;
            c.segmentation.tcpv4 = core::num::NonZeroUsize::new(tso::MAX_FRAME);
        }
        c
    }
}
