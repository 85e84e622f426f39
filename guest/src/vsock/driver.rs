//! The virtio-vsock driver, run at CPL3 on rings in the task's arena (`SYS_NET_OPEN` with
//! `DEV_VSOCK` set them up): packets in and out, one 4 KiB buffer each, and the event
//! queue's transport resets. Descriptor i of a queue always points at buffer i of it.

use core::sync::atomic::{fence, Ordering};

use crate::abi::{self, Error, NetOpen};
use crate::net::driver::{load, store, Ring};
use crate::net::Carve;
use crate::ulib;

/// Bytes per buffer: a header and up to `MAX_DATA` bytes of payload.
const BUF: u64 = 4096;
pub const HDR: usize = 44;
pub const MAX_DATA: usize = BUF as usize - HDR;
const D_WRITE: u16 = 2;
/// Event buffers posted: a `virtio_vsock_event` is one le32.
const EVENT_BUFS: u16 = 4;

pub const HOST_CID: u64 = 2;
pub const TYPE_STREAM: u16 = 1;
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;
pub const SHUTDOWN_BOTH: u32 = 3;
const EVENT_TRANSPORT_RESET: u32 = 0;

/// `struct virtio_vsock_hdr`.
#[derive(Clone, Copy, Default)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    fn read(at: u64) -> Header {
        Header {
            src_cid: load(at),
            dst_cid: load(at + 8),
            src_port: load(at + 16),
            dst_port: load(at + 20),
            len: load(at + 24),
            type_: load(at + 28),
            op: load(at + 30),
            flags: load(at + 32),
            buf_alloc: load(at + 36),
            fwd_cnt: load(at + 40),
        }
    }

    fn write(&self, at: u64) {
        store(at, self.src_cid);
        store(at + 8, self.dst_cid);
        store(at + 16, self.src_port);
        store(at + 20, self.dst_port);
        store(at + 24, self.len);
        store(at + 28, self.type_);
        store(at + 30, self.op);
        store(at + 32, self.flags);
        store(at + 36, self.buf_alloc);
        store(at + 40, self.fwd_cnt);
    }
}

/// A received packet: its header and receive buffer `id`, which goes back to the device
/// with [`Vsock::done`].
pub struct Packet {
    pub hdr: Header,
    id: u16,
    data: u64,
}

impl Packet {
    pub fn data(&self) -> &[u8] {
        // SAFETY: buffer `id` of the receive queue, handed back by the device and not
        // offered again until `done`; the length was checked to fit the buffer.
        unsafe { core::slice::from_raw_parts(self.data as *const u8, self.hdr.len as usize) }
    }
}

pub struct Vsock {
    pub cid: u64,
    rx: Ring,
    tx: Ring,
    ev: Ring,
    rx_bufs: u64,
    tx_bufs: u64,
    ev_bufs: u64,
    free: [u16; abi::NET_MAX_QUEUE as usize],
    nfree: usize,
    pub deadline: u64,
    poll_us: u64,
    pub hz: u64,
    /// Transport resets the device announced.
    pub resets: u64,
    pub dropped: u64,
}

impl Vsock {
    pub fn open(mem: &mut Carve) -> Result<Vsock, Error> {
        let rings = mem.take(abi::VSOCK_RING_BYTES).ok_or(Error::NoMemory)?;
        let qbytes = abi::NET_MAX_QUEUE as u64 * BUF;
        let rx_bufs = mem.take(qbytes).ok_or(Error::NoMemory)?;
        let tx_bufs = mem.take(qbytes).ok_or(Error::NoMemory)?;
        let ev_bufs = mem.take(4096).ok_or(Error::NoMemory)?;
        // SAFETY: freshly carved from this task's arena, nothing else refers to it, and the
        // device is not using it yet.
        unsafe { core::ptr::write_bytes(rings as *mut u8, 0, abi::VSOCK_RING_BYTES as usize) };
        let mut b = NetOpen {
            rings,
            want_queue: abi::NET_MAX_QUEUE,
            ..NetOpen::default()
        };
        ulib::vsock_open(&mut b)?;
        let size = b.queue_size as u16;
        let ring = |queue: u32| Ring::at(rings, queue, size, b.notify);
        let mut v = Vsock {
            cid: u64::from_le_bytes(b.mac),
            rx: ring(0),
            tx: ring(1),
            ev: ring(2),
            rx_bufs,
            tx_bufs,
            ev_bufs,
            free: [0; abi::NET_MAX_QUEUE as usize],
            nfree: size as usize,
            deadline: b.deadline,
            poll_us: b.poll_us,
            hz: ulib::tsc_hz().max(1),
            resets: 0,
            dropped: 0,
        };
        for id in 0..size {
            v.free[id as usize] = size - 1 - id;
            v.rx.set_desc(id, rx_bufs + id as u64 * BUF, BUF as u32, D_WRITE);
            v.rx.offer(id);
        }
        for id in 0..EVENT_BUFS.min(size) {
            v.ev.set_desc(id, ev_bufs + id as u64 * 8, 8, D_WRITE);
            v.ev.offer(id);
        }
        v.rx.set_interrupts(false);
        v.tx.set_interrupts(false);
        v.ev.set_interrupts(false);
        v.rx.kick();
        v.ev.kick();
        Ok(v)
    }

    /// The next packet from the device, if one is there. Transport resets are counted
    /// on the way (see `resets`).
    pub fn recv(&mut self) -> Option<Packet> {
        while let Some((id, _)) = self.ev.take() {
            if load::<u32>(self.ev_bufs + id as u64 * 8) == EVENT_TRANSPORT_RESET {
                self.resets += 1;
            }
            self.ev.offer(id);
            self.ev.kick();
        }
        loop {
            let (id, len) = self.rx.take()?;
            let at = self.rx_bufs + id as u64 * BUF;
            let hdr = Header::read(at);
            if (len as usize) < HDR || hdr.len as usize > len as usize - HDR {
                self.dropped += 1;
                self.rx.offer(id);
                continue;
            }
            return Some(Packet {
                hdr,
                id,
                data: at + HDR as u64,
            });
        }
    }

    /// Gives a packet's buffer back to the device.
    pub fn done(&mut self, p: Packet) {
        self.rx.offer(p.id);
    }

    fn reclaim(&mut self) {
        while let Some((id, _)) = self.tx.take() {
            if self.nfree < self.free.len() {
                self.free[self.nfree] = id;
                self.nfree += 1;
            }
        }
    }

    /// Whether `send` can take a packet now.
    pub fn can_send(&mut self) -> bool {
        self.reclaim();
        self.nfree > 0
    }

    /// Queues a packet (`data` at most `MAX_DATA` bytes, made by `fill`); false if every
    /// transmit buffer is in flight. The device hears of it at the next `flush`.
    pub fn send(&mut self, mut hdr: Header, len: usize, fill: impl FnOnce(&mut [u8])) -> bool {
        if !self.can_send() {
            return false;
        }
        self.nfree -= 1;
        let id = self.free[self.nfree];
        let at = self.tx_bufs + id as u64 * BUF;
        let len = len.min(MAX_DATA);
        hdr.src_cid = self.cid;
        hdr.dst_cid = HOST_CID;
        hdr.type_ = TYPE_STREAM;
        hdr.len = len as u32;
        hdr.write(at);
        // SAFETY: transmit buffer `id` is free (the device gave it back, or never had it),
        // and `HDR + len` fits in it.
        fill(unsafe { core::slice::from_raw_parts_mut((at + HDR as u64) as *mut u8, len) });
        self.tx.set_desc(id, at, (HDR + len) as u32, 0);
        self.tx.offer(id);
        true
    }

    /// Notifies the device of what was offered since the last call.
    pub fn flush(&mut self) {
        self.rx.kick();
        self.tx.kick();
    }

    pub fn us_since(&self, tsc: u64) -> u64 {
        ((ulib::rdtsc() - tsc) as u128 * 1_000_000 / self.hz as u128) as u64
    }

    /// Whether the task's deadline is less than 100 ms away.
    pub fn out_of_time(&self) -> bool {
        self.deadline != 0 && ulib::rdtsc().saturating_add(self.hz / 10) >= self.deadline
    }

    fn ready(&self) -> bool {
        self.rx.pending() || self.ev.pending() || (self.nfree == 0 && self.tx.pending())
    }

    /// Flushes, then polls for up to `probe.virtio_poll_us` and halts in the kernel until
    /// the device interrupts or `max_us` passes.
    pub fn idle(&mut self, max_us: u64) {
        self.flush();
        let t0 = ulib::rdtsc();
        let spin = self.poll_us.min(max_us) * self.hz / 1_000_000;
        while ulib::rdtsc() - t0 < spin {
            if self.ready() {
                return;
            }
            core::hint::spin_loop();
        }
        self.reclaim();
        let watch_tx = self.nfree == 0;
        self.rx.set_interrupts(true);
        self.ev.set_interrupts(true);
        if watch_tx {
            self.tx.set_interrupts(true);
        }
        fence(Ordering::SeqCst);
        if !self.ready() {
            let left = max_us.saturating_sub(self.us_since(t0));
            ulib::vsock_wait(
                left.min(abi::NET_MAX_WAIT_US),
                self.rx.used_seen,
                watch_tx.then_some(self.tx.used_seen),
            );
        }
        self.rx.set_interrupts(false);
        self.ev.set_interrupts(false);
        self.tx.set_interrupts(false);
    }
}
