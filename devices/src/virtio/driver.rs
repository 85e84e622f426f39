//! A guest driver for device tests: mock guest memory, one split ring laid out in it, the
//! transport's registers written as a guest would, and the used ring read back.
//!
//! Tests of the transport, virtio-blk and virtio-pmem and the fuzzing entry points all drive
//! their device through this, so a request is built the same way everywhere and only the
//! device's own framing (at the end of this file) differs.

use crate::irq::test_util::CountingIrq;
use crate::virtio::pmem::VIRTIO_PMEM_REQ_TYPE_FLUSH;
use crate::virtio::{MmioTransport, VirtioDevice};
use crate::GuestMemoryMmap;
use std::sync::Arc;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_GET_ID};
use virtio_bindings::virtio_config::*;
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::{Descriptor as SplitDescriptor, VirtqUsedElem};
use virtio_queue::desc::RawDescriptor;
use vm_device::bus::MmioAddress;
use vm_device::MutDeviceMmio;
use vm_memory::{Bytes, GuestAddress};

pub const MEM_SIZE: usize = 0x100_0000;
/// Descriptor table, available ring and used ring, a page apart from here.
pub const RING: u64 = 0x1000;
const DESC: u64 = RING;
const AVAIL: u64 = RING + 0x1000;
const USED: u64 = RING + 0x2000;
/// Where tests put the parts of their requests.
pub const HDR: u64 = 0x10_0000;
pub const DATA: u64 = 0x20_0000;
pub const INDIRECT: u64 = 0xc0_0000;
pub const STATUS: u64 = 0xf0_0000;
pub const QSIZE: u16 = 16;
pub const W: u16 = VRING_DESC_F_WRITE as u16;
pub const N: u16 = VRING_DESC_F_NEXT as u16;

/// A descriptor as the driver writes it: address, length, flags, next.
pub type Desc = (u64, u32, u16, u16);

pub struct Driver {
    pub mem: GuestMemoryMmap,
    pub t: MmioTransport,
    pub irq: Arc<CountingIrq>,
    pub avail_idx: u16,
    pub used_seen: u16,
}

impl Driver {
    /// `device` behind a transport, as the guest finds it: not yet negotiated.
    pub fn new(device: impl VirtioDevice + Send + 'static) -> Driver {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        Driver::new_in(device, mem)
    }

    /// `device` over `mem`, which must hold the rings and the request areas above.
    pub fn new_in(device: impl VirtioDevice + Send + 'static, mem: GuestMemoryMmap) -> Driver {
        let irq = Arc::new(CountingIrq::default());
        let t = MmioTransport::new(Box::new(device), mem.clone(), irq.clone());
        Driver {
            mem,
            t,
            irq,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// `device` negotiated, with queue 0 of QSIZE ready and DRIVER_OK set.
    pub fn up(device: impl VirtioDevice + Send + 'static) -> Driver {
        let mut d = Driver::new(device);
        d.bring_up(u32::from(QSIZE));
        d
    }

    /// A register access of any width at `offset` in the device's MMIO window.
    pub fn read_bytes(&mut self, offset: u64, data: &mut [u8]) {
        self.t.mmio_read(MmioAddress(0xd000_0000), offset, data);
    }

    pub fn write_bytes(&mut self, offset: u64, data: &[u8]) {
        self.t.mmio_write(MmioAddress(0xd000_0000), offset, data);
    }

    pub fn read(&mut self, off: u32) -> u32 {
        let mut b = [0u8; 4];
        self.read_bytes(off.into(), &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write(&mut self, off: u32, v: u32) {
        self.write_bytes(off.into(), &v.to_le_bytes());
    }

    /// Eight configuration bytes at `off`, read in one access.
    pub fn config_u64(&mut self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.read_bytes(u64::from(VIRTIO_MMIO_CONFIG) + off, &mut b);
        u64::from_le_bytes(b)
    }

    pub fn status(&mut self) -> u32 {
        self.read(VIRTIO_MMIO_STATUS)
    }

    pub fn needs_reset(&mut self) -> bool {
        self.status() & VIRTIO_CONFIG_S_NEEDS_RESET != 0
    }

    /// Resets the device and accepts every offered feature but `drop_bits`; true if the
    /// device kept FEATURES_OK.
    pub fn negotiate(&mut self, drop_bits: u64) -> bool {
        self.write(VIRTIO_MMIO_STATUS, 0);
        self.write(VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        self.write(
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        let mut features = 0u64;
        for sel in 0..2u32 {
            self.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
            features |= u64::from(self.read(VIRTIO_MMIO_DEVICE_FEATURES)) << (32 * sel);
        }
        features &= !drop_bits;
        for sel in 0..2u32 {
            self.write(VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
            self.write(VIRTIO_MMIO_DRIVER_FEATURES, (features >> (32 * sel)) as u32);
        }
        let s = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        self.write(VIRTIO_MMIO_STATUS, s);
        self.read(VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK != 0
    }

    /// Points queue 0 at the rings and sets it ready; `size` is written as given.
    pub fn setup_queue(&mut self, size: u32) {
        self.write(VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(self.read(VIRTIO_MMIO_QUEUE_READY), 0);
        self.write(VIRTIO_MMIO_QUEUE_NUM, size);
        for (low, addr) in [
            (VIRTIO_MMIO_QUEUE_DESC_LOW, DESC),
            (VIRTIO_MMIO_QUEUE_AVAIL_LOW, AVAIL),
            (VIRTIO_MMIO_QUEUE_USED_LOW, USED),
        ] {
            self.write(low, addr as u32);
            self.write(low + 4, (addr >> 32) as u32);
        }
        self.write(VIRTIO_MMIO_QUEUE_READY, 1);
    }

    pub fn driver_ok(&mut self) {
        let s = self.read(VIRTIO_MMIO_STATUS);
        self.write(VIRTIO_MMIO_STATUS, s | VIRTIO_CONFIG_S_DRIVER_OK);
    }

    pub fn bring_up(&mut self, size: u32) {
        assert!(self.negotiate(0));
        self.setup_queue(size);
        assert_eq!(self.read(VIRTIO_MMIO_QUEUE_READY), 1);
        self.driver_ok();
        assert!(!self.needs_reset());
    }

    /// Brings the device up again on zeroed rings, as a driver does after a reset.
    pub fn restart(&mut self) {
        self.mem
            .write_slice(&[0u8; 0x3000], GuestAddress(RING))
            .unwrap();
        self.avail_idx = 0;
        self.used_seen = 0;
        self.bring_up(u32::from(QSIZE));
    }

    /// The available ring's flags word (VIRTQ_AVAIL_F_NO_INTERRUPT is bit 0).
    pub fn set_avail_flags(&self, flags: u16) {
        self.mem.write_obj(flags, GuestAddress(AVAIL)).unwrap();
    }

    /// Writes the available index the device reads, whatever the driver has published.
    pub fn set_avail_idx(&self, idx: u16) {
        self.mem.write_obj(idx, GuestAddress(AVAIL + 2)).unwrap();
    }

    pub fn avail_idx_in_ring(&self) -> u16 {
        self.mem.read_obj(GuestAddress(AVAIL + 2)).unwrap()
    }

    /// Writes raw descriptors as a table at `addr` (the ring's own, or an indirect one).
    pub fn write_table(&self, addr: u64, descs: &[Desc]) {
        for (i, &(a, len, flags, next)) in descs.iter().enumerate() {
            let d = RawDescriptor::from(SplitDescriptor::new(a, len, flags, next));
            self.mem
                .write_obj(d, GuestAddress(addr + 16 * i as u64))
                .unwrap();
        }
    }

    /// Writes raw descriptors into the ring's table from index `first`.
    pub fn put_descs(&self, first: u16, descs: &[Desc]) {
        self.write_table(DESC + 16 * u64::from(first), descs);
    }

    pub fn publish(&mut self, head: u16) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// Puts a chain at descriptor 0, linked in order (NEXT on all but the last), and
    /// publishes it.
    pub fn chain(&mut self, descs: &[(u64, u32, u16)]) {
        let linked: Vec<Desc> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, f))| {
                if i + 1 < descs.len() {
                    (a, l, f | N, i as u16 + 1)
                } else {
                    (a, l, f & !N, 0)
                }
            })
            .collect();
        self.put_descs(0, &linked);
        self.publish(0);
    }

    /// `chain`, then notify.
    pub fn submit(&mut self, descs: &[(u64, u32, u16)]) {
        self.chain(descs);
        self.notify();
    }

    /// Descriptors exactly as given at index 0, published and notified: for chains no
    /// well-behaved driver would build.
    pub fn submit_raw(&mut self, descs: &[Desc]) {
        self.put_descs(0, descs);
        self.publish(0);
        self.notify();
    }

    pub fn notify(&mut self) {
        self.write(VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    }

    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    fn used_elem(&self, n: u16) -> VirtqUsedElem {
        let at = USED + 4 + 8 * u64::from(n % QSIZE);
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// The next used element as (id, len); it must exist.
    pub fn next_used(&mut self) -> (u32, u32) {
        assert_ne!(self.used_idx(), self.used_seen, "no used entry");
        let e = self.used_elem(self.used_seen);
        self.used_seen = self.used_seen.wrapping_add(1);
        (e.id(), e.len())
    }

    /// (used index, length of the last used element), however many the driver has seen.
    pub fn last_used(&self) -> (u16, u32) {
        let idx = self.used_idx();
        (idx, self.used_elem(idx.wrapping_sub(1)).len())
    }
}

/// virtio-blk framing: header at HDR, data at DATA, status at STATUS.
impl Driver {
    pub fn header(&self, ty: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&ty.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    pub fn status_byte(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    /// Submits a standard three-part request and returns (status, used len).
    pub fn request(
        &mut self,
        ty: u32,
        sector: u64,
        data_len: u32,
        data_writable: bool,
    ) -> (u8, u32) {
        self.header(ty, sector);
        let mut descs = vec![(HDR, 16, 0)];
        if data_len > 0 {
            descs.push((DATA, data_len, if data_writable { W } else { 0 }));
        }
        descs.push((STATUS, 1, W));
        self.submit(&descs);
        let (id, len) = self.next_used();
        assert_eq!(id, 0);
        (self.status_byte(), len)
    }

    /// A standard request that must end with `status`.
    pub fn expect(&mut self, status: u32, ty: u32, sector: u64, data_len: u32, writable: bool) {
        let (s, _) = self.request(ty, sector, data_len, writable);
        assert_eq!(s, status as u8, "type {ty} sector {sector} len {data_len}");
    }

    /// A well-formed request still works after whatever came before.
    pub fn alive(&mut self) {
        self.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_GET_ID, 0, 20, true);
    }
}

/// virtio-pmem framing: request at HDR, response at DATA.
impl Driver {
    pub fn response(&self) -> u32 {
        self.mem.read_obj(GuestAddress(DATA)).unwrap()
    }

    pub fn clear_response(&self) {
        self.mem.write_obj(0xffu32, GuestAddress(DATA)).unwrap();
    }

    pub fn flush_request(&mut self) {
        self.mem
            .write_obj(VIRTIO_PMEM_REQ_TYPE_FLUSH, GuestAddress(HDR))
            .unwrap();
        self.clear_response();
        self.submit(&[(HDR, 4, N), (DATA, 4, W)]);
    }
}

/// virtio-net framing: two queues, each on its own [`Ring`]; frames to send at DATA, receive
/// buffers from RX_BUF on; the backend a datagram socketpair standing in for the TAP.
pub const TX_RING: u64 = 0x8000;
pub const RX_BUF: u64 = 0x30_0000;

/// One queue's rings (descriptor table, available and used ring a page apart from `base`)
/// and how far the driver has got in them.
pub struct Ring {
    pub base: u64,
    pub avail_idx: u16,
    pub used_seen: u16,
}

impl Ring {
    pub fn new(base: u64) -> Ring {
        Ring {
            base,
            avail_idx: 0,
            used_seen: 0,
        }
    }
    pub fn desc(&self) -> u64 {
        self.base
    }
    pub fn avail(&self) -> u64 {
        self.base + 0x1000
    }
    pub fn used(&self) -> u64 {
        self.base + 0x2000
    }
}

impl Driver {
    /// Points queue `queue` at `ring` and sets it ready.
    pub fn setup_queue_on(&mut self, queue: u32, ring: &Ring, size: u32) {
        self.write(VIRTIO_MMIO_QUEUE_SEL, queue);
        self.write(VIRTIO_MMIO_QUEUE_NUM, size);
        for (low, addr) in [
            (VIRTIO_MMIO_QUEUE_DESC_LOW, ring.desc()),
            (VIRTIO_MMIO_QUEUE_AVAIL_LOW, ring.avail()),
            (VIRTIO_MMIO_QUEUE_USED_LOW, ring.used()),
        ] {
            self.write(low, addr as u32);
            self.write(low + 4, (addr >> 32) as u32);
        }
        self.write(VIRTIO_MMIO_QUEUE_READY, 1);
    }

    /// Negotiates every offered feature but `drop_bits`, sets up receive (queue 0, on the
    /// driver's own rings) and transmit (queue 1, at TX_RING) and sets DRIVER_OK; returns
    /// the two rings on zeroed memory.
    pub fn net_up(&mut self, drop_bits: u64) -> (Ring, Ring) {
        self.mem
            .write_slice(&[0u8; 0x3000], GuestAddress(RING))
            .unwrap();
        self.mem
            .write_slice(&[0u8; 0x3000], GuestAddress(TX_RING))
            .unwrap();
        assert!(self.negotiate(drop_bits));
        let (rx, tx) = (Ring::new(RING), Ring::new(TX_RING));
        self.setup_queue_on(0, &rx, u32::from(QSIZE));
        self.setup_queue_on(1, &tx, u32::from(QSIZE));
        self.driver_ok();
        assert!(!self.needs_reset());
        (rx, tx)
    }

    /// Writes raw descriptors into `ring`'s table from index `first`.
    pub fn put_descs_on(&self, ring: &Ring, first: u16, descs: &[Desc]) {
        self.write_table(ring.desc() + 16 * u64::from(first), descs);
    }

    pub fn publish_on(&mut self, ring: &mut Ring, head: u16) {
        let slot = ring.avail() + 4 + 2 * u64::from(ring.avail_idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        ring.avail_idx = ring.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(ring.avail_idx, GuestAddress(ring.avail() + 2))
            .unwrap();
    }

    /// Puts a chain at descriptor `first` on, linked in order, and publishes it.
    pub fn chain_on(&mut self, ring: &mut Ring, first: u16, descs: &[(u64, u32, u16)]) {
        let linked: Vec<Desc> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, f))| {
                let next = first + i as u16 + 1;
                if i + 1 < descs.len() {
                    (a, l, f | N, next)
                } else {
                    (a, l, f & !N, 0)
                }
            })
            .collect();
        self.put_descs_on(ring, first, &linked);
        self.publish_on(ring, first);
    }

    pub fn notify_queue(&mut self, queue: u32) {
        self.write(VIRTIO_MMIO_QUEUE_NOTIFY, queue);
    }

    pub fn used_idx_on(&self, ring: &Ring) -> u16 {
        self.mem.read_obj(GuestAddress(ring.used() + 2)).unwrap()
    }

    /// The next used element on `ring` as (id, len), if the device has put one there.
    pub fn next_used_on(&mut self, ring: &mut Ring) -> Option<(u32, u32)> {
        if self.used_idx_on(ring) == ring.used_seen {
            return None;
        }
        let at = ring.used() + 4 + 8 * u64::from(ring.used_seen % QSIZE);
        let e: VirtqUsedElem = self.mem.read_obj(GuestAddress(at)).unwrap();
        ring.used_seen = ring.used_seen.wrapping_add(1);
        Some((e.id(), e.len()))
    }

    /// The driver's used_event (EVENT_IDX): interrupt once the used index passes it.
    pub fn set_used_event(&self, ring: &Ring, idx: u16) {
        let at = ring.avail() + 4 + 2 * u64::from(QSIZE);
        self.mem.write_obj(idx, GuestAddress(at)).unwrap();
    }

    /// The device's avail_event (EVENT_IDX): the available index it wants a doorbell for.
    pub fn avail_event(&self, ring: &Ring) -> u16 {
        let at = ring.used() + 4 + 8 * u64::from(QSIZE);
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    pub fn guest_bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
}

/// A frame pipe standing in for a TAP: one end of a datagram socketpair, which keeps frame
/// boundaries and, like a TAP, says `WouldBlock` when the other end has not read enough.
/// The offload flags the device last asked for are kept for tests to look at.
pub struct SocketBackend {
    pub sock: std::os::unix::net::UnixDatagram,
    pub offload: Arc<std::sync::atomic::AtomicU32>,
}

impl SocketBackend {
    /// The backend and the peer end a test sends and receives frames on.
    pub fn pair() -> (SocketBackend, std::os::unix::net::UnixDatagram) {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().expect("socketpair");
        a.set_nonblocking(true).expect("non-blocking socket");
        b.set_nonblocking(true).expect("non-blocking socket");
        let backend = SocketBackend {
            sock: a,
            offload: Arc::new(std::sync::atomic::AtomicU32::new(u32::MAX)),
        };
        (backend, b)
    }
}

impl crate::virtio::NetBackend for SocketBackend {
    fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.sock.recv(buf)
    }
    fn write_frame(&mut self, iovs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        let frame: Vec<u8> = iovs.iter().flat_map(|s| s.iter().copied()).collect();
        self.sock.send(&frame)
    }
    /// As a TAP's: one datagram straight from the guest's buffers, so the device tests and
    /// the fuzz target exercise that path.
    fn write_guest(
        &mut self,
        parts: &[crate::virtio::net::GuestSlice<'_>],
    ) -> std::io::Result<usize> {
        crate::virtio::net::writev_guest(std::os::fd::AsRawFd::as_raw_fd(&self.sock), parts)
    }
    fn raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.sock)
    }
    fn set_offload(&mut self, flags: u32) -> std::io::Result<()> {
        self.offload
            .store(flags, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// Where the vsock tests keep the event queue's rings.
pub const EVENT_RING: u64 = 0xc000;

impl Driver {
    /// Negotiates, sets up receive (queue 0, the driver's own rings), transmit (queue 1, at
    /// TX_RING) and event (queue 2, at EVENT_RING) and sets DRIVER_OK: a virtio-vsock
    /// driver's start.
    pub fn vsock_up(&mut self) -> (Ring, Ring, Ring) {
        for at in [RING, TX_RING, EVENT_RING] {
            self.mem
                .write_slice(&[0u8; 0x3000], GuestAddress(at))
                .unwrap();
        }
        assert!(self.negotiate(0));
        let (rx, tx, ev) = (Ring::new(RING), Ring::new(TX_RING), Ring::new(EVENT_RING));
        self.setup_queue_on(0, &rx, u32::from(QSIZE));
        self.setup_queue_on(1, &tx, u32::from(QSIZE));
        self.setup_queue_on(2, &ev, u32::from(QSIZE));
        self.driver_ok();
        assert!(!self.needs_reset());
        (rx, tx, ev)
    }
}

/// Where the rings of virtio-net's pairs past the first go: a page per ring part, four
/// pages per ring, clear of every area above (and of the fuzzing memory's hole).
pub const PAIR_RINGS: u64 = 0xd0_0000;

/// A multiqueue virtio-net driver's rings: receive and transmit per pair (set up only for
/// the pairs the driver can use: pair 0 alone without MQ), and control.
pub struct NetRings {
    pub rx: Vec<Ring>,
    pub tx: Vec<Ring>,
    pub ctrl: Ring,
    /// The control queue's index: 2N with MQ negotiated, 2 without.
    pub ctrl_queue: u32,
}

impl Driver {
    /// Negotiates every offered feature but `drop_bits`, sets up `pairs` receive and
    /// transmit queues (pair 0 where [`Driver::net_up`] puts it, the others from
    /// PAIR_RINGS) and the control queue (at EVENT_RING), and sets DRIVER_OK. The control
    /// queue is at 2 * `pairs` when MQ is kept, else at 2, as the spec lays it out.
    pub fn net_up_pairs(&mut self, drop_bits: u64, pairs: u32) -> NetRings {
        use virtio_bindings::virtio_net::VIRTIO_NET_F_MQ;
        let ring_base = |q: u32| match q {
            0 => RING,
            1 => TX_RING,
            q => PAIR_RINGS + 0x4000 * u64::from(q),
        };
        for q in 0..2 * pairs {
            self.mem
                .write_slice(&[0u8; 0x3000], GuestAddress(ring_base(q)))
                .unwrap();
        }
        self.mem
            .write_slice(&[0u8; 0x3000], GuestAddress(EVENT_RING))
            .unwrap();
        assert!(self.negotiate(drop_bits));
        let mq = drop_bits & (1 << VIRTIO_NET_F_MQ) == 0 && pairs > 1;
        let ctrl_queue = if mq { 2 * pairs } else { 2 };
        let used_pairs = if mq { pairs } else { 1 };
        let mut rings = NetRings {
            rx: Vec::new(),
            tx: Vec::new(),
            ctrl: Ring::new(EVENT_RING),
            ctrl_queue,
        };
        for k in 0..pairs {
            let (rx, tx) = (Ring::new(ring_base(2 * k)), Ring::new(ring_base(2 * k + 1)));
            if k < used_pairs {
                self.setup_queue_on(2 * k, &rx, u32::from(QSIZE));
                self.setup_queue_on(2 * k + 1, &tx, u32::from(QSIZE));
            }
            rings.rx.push(rx);
            rings.tx.push(tx);
        }
        self.setup_queue_on(ctrl_queue, &rings.ctrl, u32::from(QSIZE));
        self.driver_ok();
        assert!(!self.needs_reset());
        rings
    }

    /// Sends a control command as Linux's driver does (header, data if any, ack in
    /// descriptors of their own, from descriptor `first`) and returns the ack and the used
    /// length, or `None` if the device put nothing on the used ring.
    pub fn control(
        &mut self,
        rings: &mut NetRings,
        first: u16,
        class: u8,
        cmd: u8,
        data: &[u8],
    ) -> Option<(u8, u32)> {
        self.mem
            .write_slice(&[class, cmd], GuestAddress(HDR))
            .unwrap();
        self.mem.write_slice(data, GuestAddress(DATA)).unwrap();
        let mut descs = vec![(HDR, 2, 0)];
        if !data.is_empty() {
            descs.push((DATA, data.len() as u32, 0));
        }
        descs.push((STATUS, 1, W));
        self.control_chain(rings, first, &descs)
    }

    /// Publishes `descs` (linked in order from descriptor `first`) on the control queue
    /// with 0xff at STATUS, notifies, and returns STATUS and the used length, if the device
    /// used the chain.
    pub fn control_chain(
        &mut self,
        rings: &mut NetRings,
        first: u16,
        descs: &[(u64, u32, u16)],
    ) -> Option<(u8, u32)> {
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        self.chain_on(&mut rings.ctrl, first, descs);
        self.notify_queue(rings.ctrl_queue);
        let (_, len) = self.next_used_on(&mut rings.ctrl)?;
        Some((self.status_byte(), len))
    }
}
