//! virtio-net driven the way a guest driver would, over mock guest memory, with a datagram
//! socketpair in place of the TAP.

use super::driver::{
    Driver, NetRings, Ring, SocketBackend, DATA, HDR, MEM_SIZE, N, QSIZE, RX_BUF, STATUS, W,
};
use super::net::{Net, MAX_FRAME_LEN, NET_FEATURES};
use super::{NetCounters, VirtioDevice};
use crate::net::rate_limiter::{RateLimit, TokenBucketConfig};
use crate::net::tap::VNET_HDR_LEN;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_net::*;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_USED_F_NO_NOTIFY};
use vm_memory::{Bytes, GuestAddress};

/// Index of the backend in `event_fds`.
const BACKEND: usize = 0;
const HDR_LEN: u32 = VNET_HDR_LEN as u32;
const MRG: u64 = 1 << VIRTIO_NET_F_MRG_RXBUF;
const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;

struct Setup {
    d: Driver,
    rx: Ring,
    tx: Ring,
    peer: UnixDatagram,
    offload: Arc<AtomicU32>,
}

const MAC: [u8; 6] = [0x52, 0x54, 0, 0xab, 0xcd, 0xef];

fn setup_with(drop_bits: u64, rx_rate: Option<RateLimit>, tx_rate: Option<RateLimit>) -> Setup {
    setup_net(drop_bits, rx_rate, tx_rate, |_| {})
}

/// A device set up as `setup_with` does, `adjust`ed before the driver sees it.
fn setup_net(
    drop_bits: u64,
    rx_rate: Option<RateLimit>,
    tx_rate: Option<RateLimit>,
    adjust: impl FnOnce(&mut Net),
) -> Setup {
    let (backend, peer) = SocketBackend::pair();
    let offload = backend.offload.clone();
    let mut net = Net::with_backend(Box::new(backend), Some(MAC), 256, rx_rate, tx_rate).unwrap();
    adjust(&mut net);
    let mut d = Driver::new(net);
    let (rx, tx) = d.net_up(drop_bits);
    // Activation asks for a pass in case frames were waiting; nothing is yet.
    d.t.process_event(1);
    Setup {
        d,
        rx,
        tx,
        peer,
        offload,
    }
}

fn setup(drop_bits: u64) -> Setup {
    setup_with(drop_bits, None, None)
}

/// A frame as it crosses the TAP: a header whose first bytes are recognisable, then data.
fn frame(data_len: usize, seed: u8) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f[0] = VIRTIO_NET_HDR_F_DATA_VALID as u8;
    f[2..4].copy_from_slice(&[0x11, 0x22]);
    f.extend((0..data_len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    f
}

impl Setup {
    fn counters(&self) -> NetCounters {
        self.d.t.net_counters().unwrap()
    }

    /// Puts `f` in guest memory at HDR (header) and DATA (the rest) and sends it as a chain
    /// of those two descriptors from descriptor `first`.
    fn send(&mut self, first: u16, f: &[u8]) {
        self.offer(first, f);
        self.d.notify_queue(1);
    }

    /// As `send`, without the doorbell.
    fn offer(&mut self, first: u16, f: &[u8]) {
        self.d.mem.write_slice(&f[..12], GuestAddress(HDR)).unwrap();
        self.d
            .mem
            .write_slice(&f[12..], GuestAddress(DATA))
            .unwrap();
        let len = (f.len() - 12) as u32;
        self.d
            .chain_on(&mut self.tx, first, &[(HDR, HDR_LEN, 0), (DATA, len, 0)]);
    }

    /// Posts receive chains of one writable buffer each, `lens[k]` bytes at
    /// RX_BUF + k * 0x2_0000, on descriptors `first..`.
    fn post_rx(&mut self, first: u16, lens: &[u32]) {
        for (k, &len) in lens.iter().enumerate() {
            let addr = RX_BUF + 0x2_0000 * (u64::from(first) + k as u64);
            self.d
                .chain_on(&mut self.rx, first + k as u16, &[(addr, len, W)]);
        }
    }

    fn rx_buf(&self, k: u16, len: usize) -> Vec<u8> {
        self.d.guest_bytes(RX_BUF + 0x2_0000 * u64::from(k), len)
    }

    fn peer_frame(&self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 70_000];
        match self.peer.recv(&mut buf) {
            Ok(n) => Some(buf[..n].to_vec()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => panic!("peer recv: {e}"),
        }
    }

    fn inject(&self, f: &[u8]) {
        self.peer.send(f).unwrap();
    }
}

// ---- identity and negotiation ----

#[test]
fn identity_features_and_config() {
    let (backend, _peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), Some([2, 0, 0, 0, 0, 7]), 64, None, None);
    let mut d = Driver::new(net.unwrap());
    assert_eq!(d.read(VIRTIO_MMIO_DEVICE_ID), 1);
    let mut features = 0u64;
    for sel in 0..2u32 {
        d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
        features |= u64::from(d.read(VIRTIO_MMIO_DEVICE_FEATURES)) << (32 * sel);
    }
    assert_eq!(features, NET_FEATURES);
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_MRG_RXBUF,
        VIRTIO_NET_F_CSUM,
        VIRTIO_NET_F_GUEST_CSUM,
        VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_GUEST_TSO6,
        VIRTIO_NET_F_HOST_TSO4,
        VIRTIO_NET_F_HOST_TSO6,
        VIRTIO_NET_F_CTRL_VQ,
        VIRTIO_NET_F_CTRL_RX,
    ] {
        assert_ne!(features & (1 << bit), 0, "feature {bit}");
    }
    assert_eq!(features & (1 << VIRTIO_NET_F_MQ), 0, "one pair: no MQ");
    // Queue size as configured, on both queues and the control queue, and no fourth.
    for (q, max) in [(0, 64), (1, 64), (2, 64), (3, 0)] {
        d.write(VIRTIO_MMIO_QUEUE_SEL, q);
        assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), max, "queue {q}");
    }
    let mut mac = [0u8; 6];
    d.read_bytes(u64::from(VIRTIO_MMIO_CONFIG), &mut mac);
    assert_eq!(mac, [2, 0, 0, 0, 0, 7]);
    assert_eq!(d.read(VIRTIO_MMIO_CONFIG + 4) >> 16, 1, "status LINK_UP");
    assert_eq!(
        d.read(VIRTIO_MMIO_CONFIG + 8) & 0xffff,
        1,
        "max_virtqueue_pairs"
    );
    // A ring bigger than the configured size is refused.
    assert!(d.negotiate(0));
    d.setup_queue_on(0, &Ring::new(0x1000), 128);
    assert!(d.needs_reset());
}

#[test]
fn activation_passes_the_guests_receive_offloads_to_the_backend() {
    let s = setup(0);
    assert_eq!(
        s.offload.load(Ordering::SeqCst),
        libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
    );
    let s = setup(1 << VIRTIO_NET_F_GUEST_CSUM);
    assert_eq!(s.offload.load(Ordering::SeqCst), 0);
}

// ---- transmit ----

#[test]
fn a_sent_frame_reaches_the_backend_with_its_header() {
    let mut s = setup(0);
    let f = frame(100, 1);
    s.send(0, &f);
    assert_eq!(s.peer_frame(), Some(f.clone()));
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    assert_eq!(s.d.irq.count(), 1);
    let c = s.counters();
    assert_eq!(
        (c.tx_packets, c.tx_bytes, c.tx_drops, c.tx_notifications),
        (1, 100, 0, 1)
    );
    // Header and data in one descriptor work as well.
    let f = frame(60, 2);
    s.d.mem.write_slice(&f, GuestAddress(DATA)).unwrap();
    s.d.chain_on(&mut s.tx, 4, &[(DATA, f.len() as u32, 0)]);
    s.d.notify_queue(1);
    assert_eq!(s.peer_frame(), Some(f));
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((4, 0)));
}

#[test]
fn the_largest_frame_passes_and_a_longer_one_is_dropped() {
    let mut s = setup(0);
    let f = frame(MAX_FRAME_LEN, 3);
    s.send(0, &f);
    assert_eq!(s.peer_frame().map(|p| p.len()), Some(f.len()));
    let f = frame(MAX_FRAME_LEN + 1, 3);
    s.send(0, &f);
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    assert_eq!(
        s.d.next_used_on(&mut s.tx),
        Some((0, 0)),
        "dropped, still used"
    );
    assert_eq!((s.counters().tx_packets, s.counters().tx_drops), (1, 1));
}

#[test]
fn header_only_or_shorter_frames_are_dropped() {
    let mut s = setup(0);
    for len in [HDR_LEN, HDR_LEN - 1, 1] {
        s.d.chain_on(&mut s.tx, 0, &[(HDR, len, 0)]);
        s.d.notify_queue(1);
        assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)), "len {len}");
    }
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.counters().tx_drops, 3);
    s.send(0, &frame(10, 0));
    assert!(s.peer_frame().is_some(), "later frames still go");
}

#[test]
fn a_transmit_chain_with_a_writable_descriptor_is_dropped() {
    let mut s = setup(0);
    s.d.chain_on(&mut s.tx, 0, &[(HDR, HDR_LEN, 0), (DATA, 100, W)]);
    s.d.notify_queue(1);
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.counters().tx_drops, 1);
}

#[test]
fn descriptors_outside_guest_memory_are_dropped() {
    let mut s = setup(0);
    let top = MEM_SIZE as u64;
    for (addr, len) in [(top, 100), (top - 50, 100), (u64::MAX - 10, 100)] {
        s.d.chain_on(&mut s.tx, 0, &[(HDR, HDR_LEN, 0), (addr, len, 0)]);
        s.d.notify_queue(1);
        assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    }
    assert_eq!(s.counters().tx_drops, 3);
    // On receive: the chain comes back empty and the frame is dropped.
    s.d.chain_on(&mut s.rx, 0, &[(top - 8, 4096, W)]);
    s.inject(&frame(100, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 0)));
    assert_eq!(s.counters().rx_drops, 1);
    assert_eq!(s.counters().rx_packets, 0);
    assert!(!s.d.needs_reset());
}

#[test]
fn looping_chains_end_in_a_drop() {
    let mut s = setup(0);
    s.d.put_descs_on(&s.tx, 0, &[(HDR, HDR_LEN, N, 1), (DATA, 100, N, 0)]);
    s.d.publish_on(&mut s.tx, 0);
    s.d.notify_queue(1);
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.counters().tx_drops, 1);
    // A receive chain that loops on itself.
    s.d.put_descs_on(&s.rx, 0, &[(RX_BUF, 4096, W | N, 0)]);
    s.d.publish_on(&mut s.rx, 0);
    s.inject(&frame(100, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 0)));
    assert_eq!(s.counters().rx_drops, 1);
}

#[test]
fn zero_length_descriptors_are_dropped() {
    let mut s = setup(0);
    s.d.chain_on(
        &mut s.tx,
        0,
        &[(HDR, HDR_LEN, 0), (DATA, 0, 0), (DATA, 100, 0)],
    );
    s.d.notify_queue(1);
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((0, 0)));
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.counters().tx_drops, 1);
    s.d.chain_on(&mut s.rx, 0, &[(RX_BUF, 0, W)]);
    s.inject(&frame(100, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 0)));
    assert_eq!(s.counters().rx_drops, 1);
}

#[test]
fn a_full_backend_leaves_frames_on_the_ring_until_the_next_doorbell() {
    let mut s = setup(0);
    // A unix datagram socket queues what fits its send buffer (about 200 KiB), then refuses.
    for k in 0..QSIZE {
        let f = frame(60_000, k as u8);
        let at = HDR + 0x1_0000 * u64::from(k);
        s.d.mem.write_slice(&f, GuestAddress(at)).unwrap();
        s.d.chain_on(&mut s.tx, k, &[(at, f.len() as u32, 0)]);
    }
    s.d.notify_queue(1);
    let mut got = 0;
    while s.peer_frame().is_some() {
        got += 1;
    }
    assert!(got > 0 && got < usize::from(QSIZE), "{got} frames went");
    assert_eq!(
        s.d.used_idx_on(&s.tx),
        got as u16,
        "only frames sent are used"
    );
    assert_eq!(s.counters().tx_drops, 0);
    // With room again, the doorbell sends the rest, in order.
    let mut rest = 0;
    for _ in 0..QSIZE {
        s.d.notify_queue(1);
        while let Some(f) = s.peer_frame() {
            assert_eq!(f, frame(60_000, (got + rest) as u8));
            rest += 1;
        }
    }
    assert_eq!(got + rest, usize::from(QSIZE));
    assert_eq!(s.d.used_idx_on(&s.tx), QSIZE);
}

#[test]
fn a_polled_transmit_queue_is_served_without_doorbells_which_come_back_on_after() {
    // Without EVENT_IDX, so the doorbells' state is one flag to read.
    let mut s = setup(EVENT_IDX);
    let flags = |s: &Setup| -> u16 { s.d.mem.read_obj(GuestAddress(s.tx.used())).unwrap() };
    assert!(s.d.t.pollable(1), "a transmit queue");
    assert!(
        !s.d.t.pollable(0),
        "a receive queue is refilled without doorbells anyway"
    );
    s.d.t.set_polled(1, true);
    assert_eq!(flags(&s), VRING_USED_F_NO_NOTIFY as u16, "off while polled");
    assert!(!s.d.t.poll_queue(1), "nothing offered yet");
    let f = frame(100, 1);
    s.offer(0, &f);
    assert!(s.d.t.poll_queue(1), "found without a doorbell");
    assert_eq!(s.peer_frame(), Some(f));
    assert_eq!(
        flags(&s),
        VRING_USED_F_NO_NOTIFY as u16,
        "a pass leaves them off"
    );
    assert!(!s.d.t.poll_queue(1), "nothing more");
    // Offered while the poller is giving up: ending the polling serves it, as no
    // doorbell will.
    let f = frame(80, 2);
    s.offer(2, &f);
    s.d.t.set_polled(1, false);
    assert_eq!(s.peer_frame(), Some(f));
    assert_eq!(flags(&s), 0, "the doorbells are back on");
    assert_eq!(s.d.used_idx_on(&s.tx), 2);
    let c = s.counters();
    assert_eq!((c.tx_packets, c.tx_notifications), (2, 2));
}

#[test]
fn polling_a_stalled_transmit_queue_finds_nothing_to_poll_on_for() {
    let mut s = setup(0);
    s.d.t.set_polled(1, true);
    // More than the socket's send buffer (about 200 KiB) takes.
    for k in 0..QSIZE {
        let f = frame(60_000, k as u8);
        let at = HDR + 0x1_0000 * u64::from(k);
        s.d.mem.write_slice(&f, GuestAddress(at)).unwrap();
        s.d.chain_on(&mut s.tx, k, &[(at, f.len() as u32, 0)]);
    }
    assert!(s.d.t.poll_queue(1), "the first frames went");
    let sent = s.d.used_idx_on(&s.tx);
    assert!(sent < QSIZE, "{sent} frames went");
    assert!(!s.d.t.poll_queue(1), "a full backend takes nothing more");
    assert_eq!(s.d.used_idx_on(&s.tx), sent);
    while s.peer_frame().is_some() {}
    assert!(s.d.t.poll_queue(1), "room again");
    assert!(s.d.used_idx_on(&s.tx) > sent);
}

// ---- receive ----

#[test]
fn receive_without_mergeable_buffers_uses_one_chain() {
    let mut s = setup(MRG);
    // One chain of two buffers: the frame is spread over both.
    s.d.chain_on(
        &mut s.rx,
        0,
        &[(RX_BUF, 100, W), (RX_BUF + 0x2_0000, 1000, W)],
    );
    let f = frame(300, 7);
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, f.len() as u32)));
    let mut got = s.rx_buf(0, 100);
    got.extend(s.rx_buf(1, f.len() - 100));
    let mut want = f.clone();
    want[10..12].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(got, want, "num_buffers is 1 without MRG_RXBUF");
    assert_eq!(s.d.irq.count(), 1);
    let c = s.counters();
    assert_eq!((c.rx_packets, c.rx_bytes, c.rx_drops), (1, 300, 0));
}

#[test]
fn an_empty_frame_from_the_backend_is_dropped_and_the_frames_behind_it_still_come() {
    let mut s = setup(0);
    s.post_rx(0, &[2000, 2000]);
    // A datagram backend hands over an empty frame and still holds the next; the watch is
    // edge-triggered, so nothing would wake the device for it again.
    s.inject(&[]);
    s.inject(&[0u8; 4]);
    let f = frame(100, 3);
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, f.len() as u32)));
    let c = s.counters();
    assert_eq!((c.rx_packets, c.rx_drops), (1, 2), "{c:?}");
}

#[test]
fn receive_with_mergeable_buffers_spreads_a_frame_over_chains() {
    let mut s = setup(0);
    s.post_rx(0, &[100, 100, 100, 100]);
    let f = frame(250, 9); // 262 bytes: 100 + 100 + 62
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 100)));
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((1, 100)));
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((2, 62)));
    assert_eq!(
        s.d.next_used_on(&mut s.rx),
        None,
        "the fourth chain is left"
    );
    let mut got = s.rx_buf(0, 100);
    got.extend(s.rx_buf(1, 100));
    got.extend(s.rx_buf(2, 62));
    let mut want = f.clone();
    want[10..12].copy_from_slice(&3u16.to_le_bytes());
    assert_eq!(got, want, "num_buffers counts the chains");
    assert_eq!(s.d.irq.count(), 1, "one interrupt for the frame");
    // The next frame starts in the chain that was left.
    let f = frame(20, 1);
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((3, f.len() as u32)));
}

#[test]
fn a_frame_larger_than_the_posted_buffers_waits_for_more() {
    let mut s = setup(0);
    s.post_rx(0, &[100]);
    let f = frame(250, 4);
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(
        s.d.used_idx_on(&s.rx),
        0,
        "nothing written outside the buffers"
    );
    assert_eq!(s.counters().rx_drops, 0);
    // The guest adds buffers and rings: the frame goes in.
    s.post_rx(1, &[100, 100]);
    s.d.notify_queue(0);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 100)));
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((1, 100)));
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((2, 62)));
    assert_eq!(s.counters().rx_packets, 1);
}

#[test]
fn a_frame_larger_than_a_whole_ring_of_buffers_is_dropped() {
    let mut s = setup(0);
    let lens = vec![16u32; usize::from(QSIZE)];
    s.post_rx(0, &lens);
    s.inject(&frame(1000, 0));
    s.inject(&frame(4, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.counters().rx_drops, 1);
    // The small frame after it still gets through.
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 16)));
    assert_eq!(s.counters().rx_packets, 1);
}

#[test]
fn without_mergeable_buffers_a_frame_too_big_for_the_chain_is_dropped() {
    let mut s = setup(MRG);
    s.post_rx(0, &[100]);
    s.inject(&frame(200, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 0);
    assert_eq!(s.counters().rx_drops, 1);
    // The chain was kept for the next frame.
    let f = frame(50, 0);
    s.inject(&f);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, f.len() as u32)));
}

#[test]
fn a_receive_chain_smaller_than_the_header_drops_the_frame() {
    let mut s = setup(0);
    s.post_rx(0, &[8, 200]);
    s.inject(&frame(50, 0));
    s.inject(&frame(50, 1));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 0)));
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((1, 62)));
    assert_eq!(s.rx_buf(1, 62)[12..], frame(50, 1)[12..]);
    assert_eq!((s.counters().rx_drops, s.counters().rx_packets), (1, 1));
}

#[test]
fn with_no_receive_buffers_the_backend_is_left_alone_until_the_doorbell() {
    let (backend, peer) = SocketBackend::pair();
    let probe = backend.sock.try_clone().unwrap();
    let net = Net::with_backend(Box::new(backend), None, 256, None, None).unwrap();
    let mut d = Driver::new(net);
    let (mut rx, _tx) = d.net_up(0);
    let (a, b) = (frame(40, 1), frame(40, 2));
    peer.send(&a).unwrap();
    peer.send(&b).unwrap();
    d.t.process_event(BACKEND);
    d.t.process_event(BACKEND);
    // One frame is held by the device; the other is still queued in the socket.
    let mut buf = [0u8; 128];
    // SAFETY: `buf` is writable for its length and outlives the call; `probe` is open.
    let n = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(&probe),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    assert!(n > 0, "second frame still in the backend");
    assert_eq!(buf[..n as usize], b[..]);
    assert_eq!(d.irq.count(), 0);
    for k in 0..2u16 {
        let addr = RX_BUF + 0x2_0000 * u64::from(k);
        d.chain_on(&mut rx, k, &[(addr, 1000, W)]);
    }
    d.notify_queue(0);
    assert_eq!(d.next_used_on(&mut rx), Some((0, 52)));
    assert_eq!(d.next_used_on(&mut rx), Some((1, 52)));
    assert_eq!(d.guest_bytes(RX_BUF + 12, 40), a[12..]);
    assert_eq!(d.guest_bytes(RX_BUF + 0x2_0000 + 12, 40), b[12..]);
    let c = d.t.net_counters().unwrap();
    assert_eq!((c.rx_packets, c.rx_notifications), (2, 1));
}

/// Without EVENT_IDX the device sets `VRING_USED_F_NO_NOTIFY` on the receive ring while
/// buffers are posted (the TAP brings it back to them, so a refill's doorbell would be a
/// wasted exit) and clears it once it runs out, so the next refill rings.
#[test]
fn receive_refills_need_no_doorbell_until_the_buffers_run_out() {
    let mut s = setup(EVENT_IDX);
    let flags = |s: &Setup| -> u16 { s.d.mem.read_obj(GuestAddress(s.rx.used())).unwrap() };
    s.post_rx(0, &[2048]);
    s.inject(&frame(40, 1));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((0, 52)));
    assert_eq!(
        flags(&s),
        VRING_USED_F_NO_NOTIFY as u16,
        "buffers were posted"
    );
    s.inject(&frame(40, 2));
    s.d.t.process_event(BACKEND);
    assert_eq!(flags(&s), 0, "out of buffers: the next refill must ring");
    s.post_rx(1, &[2048]);
    s.d.notify_queue(0);
    assert_eq!(s.d.next_used_on(&mut s.rx), Some((1, 52)));
    assert_eq!(s.counters().rx_packets, 2);
}

#[test]
fn frames_queued_before_driver_ok_are_received_after_it() {
    let (backend, peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), None, 256, None, None).unwrap();
    let mut d = Driver::new(net);
    peer.send(&frame(30, 0)).unwrap();
    d.t.process_event(BACKEND); // not live: ignored
    let (mut rx, _tx) = d.net_up(0);
    d.chain_on(&mut rx, 0, &[(RX_BUF, 1000, W)]);
    // Activation signalled the resume event; the owner serves it.
    let resume = d.t.event_fds()[1];
    let mut count = 0u64;
    // SAFETY: reads 8 bytes into `count` from an eventfd the device owns and keeps open.
    let n = unsafe { libc::read(resume, (&mut count as *mut u64).cast(), 8) };
    assert_eq!((n, count), (8, 1));
    d.t.process_event(1);
    assert_eq!(d.next_used_on(&mut rx), Some((0, 42)));
}

#[test]
fn runt_frames_from_the_backend_are_dropped() {
    let mut s = setup(0);
    s.post_rx(0, &[1000]);
    s.inject(&[0u8; 12]);
    s.inject(&[0u8; 3]);
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 0);
    assert_eq!(s.counters().rx_drops, 2);
}

// ---- interrupts ----

#[test]
fn event_idx_suppresses_interrupts_the_driver_did_not_ask_for() {
    let mut s = setup(0);
    s.post_rx(0, &[1000, 1000, 1000]);
    // The driver wants an interrupt only once the used index passes 1.
    s.d.set_used_event(&s.rx, 1);
    s.inject(&frame(10, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 1);
    assert_eq!(
        s.d.irq.count(),
        0,
        "used index 1 has not passed used_event 1"
    );
    s.inject(&frame(10, 1));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 2);
    assert_eq!(s.d.irq.count(), 1);
    // Without EVENT_IDX, the same used_event means nothing.
    let mut s = setup(EVENT_IDX);
    s.post_rx(0, &[1000]);
    s.d.set_used_event(&s.rx, 5);
    s.inject(&frame(10, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.irq.count(), 1);
}

#[test]
fn with_event_idx_the_device_asks_for_a_doorbell_when_it_runs_out() {
    let mut s = setup(0);
    s.post_rx(0, &[1000]);
    s.inject(&frame(10, 0));
    s.inject(&frame(10, 1));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 1);
    assert_eq!(
        s.d.avail_event(&s.rx),
        1,
        "the next buffer published (index 1) must ring"
    );
    // Transmit: everything served, the next frame must ring too.
    s.send(0, &frame(10, 0));
    assert_eq!(s.d.avail_event(&s.tx), 1);
}

#[test]
fn event_idx_survives_a_snapshot() {
    let mut s = setup(0);
    s.post_rx(0, &[1000, 1000]);
    let state = s.d.t.state();
    let (backend, peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), None, 256, None, None).unwrap();
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    t.restore(&state).unwrap();
    assert_eq!(t.state(), state);
    // The restored queues still honour used_event: no interrupt until the used index
    // passes 1, then one.
    s.d.set_used_event(&s.rx, 1);
    let before = s.d.irq.count();
    peer.send(&frame(10, 0)).unwrap();
    t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 1);
    assert_eq!(s.d.irq.count(), before);
    peer.send(&frame(10, 1)).unwrap();
    t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 2);
    assert_eq!(s.d.irq.count(), before + 1);
}

// ---- output commit ----

/// Index of the resume eventfd in `event_fds`: the output gate wakes the device through it.
const RESUME: usize = 1;

/// A checkpoint as the replicator takes it: the device is saved (which seals its held
/// output) and the replicator marks that seal as its own.
fn checkpoint(s: &Setup) {
    let _ = s.d.t.state();
    s.d.t.output_gate().unwrap().mark_captured();
}

#[test]
fn held_frames_reach_the_backend_only_when_their_checkpoint_is_released_and_in_order() {
    let mut s = setup(0);
    let gate = s.d.t.output_gate().unwrap();
    gate.hold();
    let frames: Vec<Vec<u8>> = (0..3).map(|k| frame(100 + k, k as u8)).collect();
    s.send(0, &frames[0]);
    s.send(2, &frames[1]);
    assert_eq!(
        s.d.next_used_on(&mut s.tx),
        Some((0, 0)),
        "the guest sees it sent"
    );
    assert_eq!(s.d.next_used_on(&mut s.tx), Some((2, 0)));
    checkpoint(&s);
    // Sent after the checkpoint: the next one's.
    s.send(4, &frames[2]);
    assert_eq!(s.peer_frame(), None, "nothing goes before a release");
    let c = s.counters();
    assert_eq!((c.tx_held, c.tx_packets, c.tx_released), (3, 0, 0));
    assert_eq!(c.tx_held_bytes, 100 + 101 + 102);
    // Waking the device without a release sends nothing.
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame(), None);
    gate.release_captured();
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame().as_ref(), Some(&frames[0]));
    assert_eq!(s.peer_frame().as_ref(), Some(&frames[1]));
    assert_eq!(s.peer_frame(), None, "the frame after the checkpoint waits");
    checkpoint(&s);
    gate.release_captured();
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame().as_ref(), Some(&frames[2]));
    let c = s.counters();
    assert_eq!((c.tx_held, c.tx_packets, c.tx_released), (3, 3, 3));
    // Replication over: what is held goes, and nothing more is held.
    s.send(6, &frames[0]);
    gate.open();
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame().as_ref(), Some(&frames[0]));
    s.send(8, &frames[1]);
    assert_eq!(s.peer_frame().as_ref(), Some(&frames[1]), "straight out");
    assert_eq!(s.counters().tx_held, 4);
}

#[test]
fn a_full_gate_stops_taking_transmit_chains_until_a_release() {
    let len = 1000;
    let mut s = setup_net(0, None, None, |n| {
        n.set_held_limit(2 * (VNET_HDR_LEN + len) + 10)
    });
    let gate = s.d.t.output_gate().unwrap();
    gate.hold();
    for k in 0..4u16 {
        let f = frame(len, k as u8);
        let at = HDR + 0x1_0000 * u64::from(k);
        s.d.mem.write_slice(&f, GuestAddress(at)).unwrap();
        s.d.chain_on(&mut s.tx, k, &[(at, f.len() as u32, 0)]);
    }
    s.d.notify_queue(1);
    assert_eq!(
        s.d.used_idx_on(&s.tx),
        2,
        "two frames fit; the others stay on the ring"
    );
    let c = s.counters();
    assert_eq!((c.tx_held, c.tx_drops), (2, 0));
    assert!(c.tx_held_full >= 1);
    // Another doorbell changes nothing while full.
    s.d.notify_queue(1);
    assert_eq!(s.d.used_idx_on(&s.tx), 2);
    assert_eq!(s.peer_frame(), None);
    checkpoint(&s);
    gate.release_captured();
    // The release's wake-up writes the two and takes the next two chains, held again.
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame(), Some(frame(len, 0)));
    assert_eq!(s.peer_frame(), Some(frame(len, 1)));
    assert_eq!(s.peer_frame(), None);
    assert_eq!(s.d.used_idx_on(&s.tx), 4);
    checkpoint(&s);
    gate.release_captured();
    s.d.t.process_event(RESUME);
    assert_eq!(s.peer_frame(), Some(frame(len, 2)));
    assert_eq!(s.peer_frame(), Some(frame(len, 3)));
    assert_eq!(s.counters().tx_released, 4);
}

#[test]
fn a_restored_device_announces_the_address_the_guest_used() {
    let mut s = setup(0);
    // The guest's own ARP for 10.1.2.3 shows its address.
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend(crate::net::announce::gratuitous_arp(
        &MAC,
        std::net::Ipv4Addr::new(10, 1, 2, 3),
    ));
    s.send(0, &f);
    assert!(s.peer_frame().is_some());
    let state = s.d.t.state();
    let (backend, peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), Some(MAC), 256, None, None).unwrap();
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    t.restore(&state).unwrap();
    t.transport_reset();
    let mut buf = [0u8; 200];
    let n = peer.recv(&mut buf).unwrap();
    assert_eq!(n, VNET_HDR_LEN + 60, "padded to Ethernet's shortest frame");
    let arp = &buf[VNET_HDR_LEN..n];
    assert_eq!(arp[..6], [0xff; 6]);
    assert_eq!(arp[6..12], MAC);
    assert_eq!(arp[28..32], [10, 1, 2, 3], "sender address");
    assert_eq!(arp[38..42], [10, 1, 2, 3], "target address");
    assert_eq!(t.net_counters().unwrap().announcements, 1);
}

#[test]
fn the_frames_of_the_last_checkpoint_are_copied_and_a_standby_sends_them_in_order() {
    let mut s = setup(0);
    let gate = s.d.t.output_gate().unwrap();
    gate.hold();
    let frames: Vec<Vec<u8>> = (0..4).map(|k| frame(60 + k, k as u8)).collect();
    s.send(0, &frames[0]);
    checkpoint(&s);
    assert_eq!(s.d.t.captured_output(), [frames[0].clone()]);
    s.send(2, &frames[1]);
    s.send(4, &frames[2]);
    checkpoint(&s);
    // The epoch before is not shipped again, and copying takes nothing out.
    assert_eq!(s.d.t.captured_output(), frames[1..3].to_vec());
    s.send(6, &frames[3]);
    assert_eq!(s.d.t.captured_output(), frames[1..3].to_vec(), "sent after");
    assert_eq!(s.peer_frame(), None);

    // A standby's device: what it is given goes out at once, in order, and nothing of it
    // counts as held; a frame no backend could take is dropped and counted.
    let (backend, peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), Some(MAC), 256, None, None).unwrap();
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    let given = vec![
        frames[1].clone(),
        vec![0u8; VNET_HDR_LEN],
        frames[2].clone(),
    ];
    assert_eq!(t.send_frames(given), 2);
    let mut buf = vec![0u8; 70_000];
    for want in &frames[1..3] {
        let n = peer.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &want[..]);
    }
    assert!(peer.recv(&mut buf).is_err(), "nothing more");
    let c = t.net_counters().unwrap();
    assert_eq!((c.tx_held, c.tx_packets, c.tx_drops), (0, 2, 1));
}

// ---- rate limiting ----

fn one_frame_per_ms() -> Option<RateLimit> {
    Some(RateLimit {
        bandwidth: None,
        ops: Some(TokenBucketConfig {
            size: 1,
            refill_time_ms: 1,
            one_time_burst: 0,
        }),
    })
}

/// Waits for `fd` to become readable, as the owner's epoll would.
fn wait_readable(fd: i32) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the call.
    let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert_eq!(n, 1, "fd {fd} not readable within 5 s");
}

#[test]
fn the_transmit_limiter_holds_a_frame_until_its_timer() {
    let mut s = setup_with(0, None, one_frame_per_ms());
    let fds = s.d.t.event_fds();
    assert_eq!(fds.len(), 3, "backend, resume, transmit timer");
    let f = frame(10, 0);
    s.send(0, &f);
    s.send(1, &f);
    assert!(s.peer_frame().is_some());
    assert_eq!(s.peer_frame(), None, "second frame held back");
    assert_eq!(s.d.used_idx_on(&s.tx), 1);
    assert_eq!(s.counters().tx_throttled, 1);
    wait_readable(fds[2]);
    s.d.t.process_event(2);
    assert_eq!(s.peer_frame(), Some(f));
    assert_eq!(s.d.used_idx_on(&s.tx), 2);
}

#[test]
fn the_receive_limiter_holds_a_frame_until_its_timer() {
    let mut s = setup_with(0, one_frame_per_ms(), None);
    let fds = s.d.t.event_fds();
    assert_eq!(fds.len(), 3, "backend, resume, receive timer");
    s.post_rx(0, &[1000, 1000]);
    s.inject(&frame(10, 0));
    s.inject(&frame(10, 1));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.d.used_idx_on(&s.rx), 1);
    assert_eq!(s.counters().rx_throttled, 1);
    wait_readable(fds[2]);
    s.d.t.process_event(2);
    assert_eq!(s.d.used_idx_on(&s.rx), 2);
    assert_eq!(s.rx_buf(1, 22)[12..], frame(10, 1)[12..]);
}

// ---- robustness ----

#[test]
fn an_absurd_available_index_needs_reset() {
    let mut s = setup(0);
    s.d.mem
        .write_obj(QSIZE + 1, GuestAddress(s.tx.avail() + 2))
        .unwrap();
    s.d.notify_queue(1);
    assert!(s.d.needs_reset());
    // Events are ignored from then on.
    s.inject(&frame(10, 0));
    s.d.t.process_event(BACKEND);
    assert_eq!(s.counters().rx_packets, 0);
}

#[test]
fn events_before_driver_ok_and_unknown_events_do_nothing() {
    let (backend, peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(backend), None, 256, None, None).unwrap();
    let mut d = Driver::new(net);
    peer.send(&frame(10, 0)).unwrap();
    d.t.process_event(BACKEND);
    d.t.process_event(99);
    let (_rx, _tx) = d.net_up(0);
    d.t.process_event(99);
    assert_eq!(d.t.net_counters().unwrap(), NetCounters::default());
    assert!(!d.needs_reset());
}

#[test]
fn stats_map_onto_the_generic_counters() {
    let mut s = setup(0);
    s.post_rx(0, &[1000]);
    s.inject(&frame(30, 0));
    s.d.t.process_event(BACKEND);
    s.send(0, &frame(20, 0));
    s.d.chain_on(&mut s.tx, 0, &[(HDR, 4, 0)]);
    s.d.notify_queue(1);
    let st = s.d.t.stats();
    assert_eq!(
        (st.requests, st.bytes_read, st.bytes_written, st.errors),
        (2, 30, 20, 1)
    );
    assert_eq!(st.interrupts, s.d.irq.count());
}

#[cfg(feature = "fuzzing")]
#[test]
fn virtio_net_survives_hostile_guests() {
    crate::fuzzing::smoke(
        "virtio_net",
        crate::fuzzing::virtio_net,
        &crate::fuzzing::virtio_net_samples(),
        0x4E7,
        1500,
    );
}

// ---- queue pairs and the control queue ----

const MQ: u64 = 1 << VIRTIO_NET_F_MQ;
const CTRL_RX: u64 = 1 << VIRTIO_NET_F_CTRL_RX;
const OK: u8 = VIRTIO_NET_OK as u8;
const ERR: u8 = VIRTIO_NET_ERR as u8;
const CLASS_RX: u8 = VIRTIO_NET_CTRL_RX as u8;
const CLASS_MAC: u8 = VIRTIO_NET_CTRL_MAC as u8;
const CLASS_MQ: u8 = VIRTIO_NET_CTRL_MQ as u8;
const PROMISC: u8 = VIRTIO_NET_CTRL_RX_PROMISC as u8;
const ALLMULTI: u8 = VIRTIO_NET_CTRL_RX_ALLMULTI as u8;
const TABLE_SET: u8 = VIRTIO_NET_CTRL_MAC_TABLE_SET as u8;
const PAIRS_SET: u8 = VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8;

/// A device of several pairs, each backend a socketpair of its own.
struct Mq {
    d: Driver,
    r: NetRings,
    peers: Vec<UnixDatagram>,
    /// Index in `event_fds` of each pair's backend.
    backend_event: Vec<usize>,
}

fn mq_device(pairs: usize) -> (Net, Vec<UnixDatagram>) {
    let (backends, peers): (Vec<Box<dyn super::NetBackend>>, Vec<UnixDatagram>) = (0..pairs)
        .map(|_| {
            let (b, p) = SocketBackend::pair();
            (Box::new(b) as Box<dyn super::NetBackend>, p)
        })
        .unzip();
    let net = Net::with_backends(backends, Some(MAC), 256, None, None).unwrap();
    (net, peers)
}

fn mq_setup(pairs: usize, drop_bits: u64) -> Mq {
    let (net, peers) = mq_device(pairs);
    let mut d = Driver::new(net);
    let r = d.net_up_pairs(drop_bits, pairs as u32);
    d.t.process_event(RESUME);
    let backend_event = (0..pairs).map(|k| if k == 0 { 0 } else { k + 1 }).collect();
    Mq {
        d,
        r,
        peers,
        backend_event,
    }
}

impl Mq {
    fn counters(&self) -> NetCounters {
        self.d.t.net_counters().unwrap()
    }

    /// Posts `n` receive buffers of 2000 bytes on pair `k`'s queue, at RX_BUF + 0x10_000 *
    /// pair + 0x1000 * buffer.
    fn post_rx(&mut self, k: usize, n: u16) {
        for i in 0..n {
            let addr = RX_BUF + 0x1_0000 * k as u64 + 0x1000 * u64::from(i);
            self.d.chain_on(&mut self.r.rx[k], i, &[(addr, 2000, W)]);
        }
    }

    /// The next frame pair `k`'s receive queue got, `num_buffers` (1) cleared so it
    /// compares with the frame sent.
    fn received(&mut self, k: usize) -> Option<Vec<u8>> {
        let (id, len) = self.d.next_used_on(&mut self.r.rx[k])?;
        let addr = RX_BUF + 0x1_0000 * k as u64 + 0x1000 * u64::from(id);
        let mut f = self.d.guest_bytes(addr, len as usize);
        assert_eq!(f[10..12], [1, 0], "num_buffers");
        f[10..12].fill(0);
        Some(f)
    }

    fn send_on(&mut self, k: usize, f: &[u8]) {
        self.d.mem.write_slice(f, GuestAddress(DATA)).unwrap();
        self.d
            .chain_on(&mut self.r.tx[k], 0, &[(DATA, f.len() as u32, 0)]);
        self.d.notify_queue(2 * k as u32 + 1);
    }

    fn peer_frame(&self, k: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 70_000];
        match self.peers[k].recv(&mut buf) {
            Ok(n) => Some(buf[..n].to_vec()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => panic!("peer recv: {e}"),
        }
    }

    fn control(&mut self, class: u8, cmd: u8, data: &[u8]) -> Option<(u8, u32)> {
        self.d.control(&mut self.r, 0, class, cmd, data)
    }

    fn pairs_set(&mut self, n: u16) -> u8 {
        self.control(CLASS_MQ, PAIRS_SET, &n.to_le_bytes())
            .expect("the command is used")
            .0
    }
}

/// A frame to `dest`: header, Ethernet header, payload.
fn frame_to(dest: [u8; 6], seed: u8) -> Vec<u8> {
    let mut f = frame(60, seed);
    f[VNET_HDR_LEN..VNET_HDR_LEN + 6].copy_from_slice(&dest);
    f
}

fn mac_tables(unicast: &[[u8; 6]], multicast: &[[u8; 6]]) -> Vec<u8> {
    let mut v = Vec::new();
    for table in [unicast, multicast] {
        v.extend_from_slice(&(table.len() as u32).to_le_bytes());
        table.iter().for_each(|m| v.extend_from_slice(m));
    }
    v
}

#[test]
fn a_device_of_two_pairs_offers_mq_five_queues_and_its_pairs_in_config() {
    let (net, _peers) = mq_device(2);
    assert_eq!(
        net.event_fds().len(),
        3,
        "two backends and the resume eventfd"
    );
    let mut d = Driver::new(net);
    let mut features = 0u64;
    for sel in 0..2u32 {
        d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
        features |= u64::from(d.read(VIRTIO_MMIO_DEVICE_FEATURES)) << (32 * sel);
    }
    assert_eq!(features, NET_FEATURES | MQ);
    for (q, max) in [(0, 256), (3, 256), (4, 256), (5, 0)] {
        d.write(VIRTIO_MMIO_QUEUE_SEL, q);
        assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), max, "queue {q}");
    }
    assert_eq!(d.t.num_queues(), 5);
    assert_eq!(
        d.read(VIRTIO_MMIO_CONFIG + 8) & 0xffff,
        2,
        "max_virtqueue_pairs"
    );
    // Limiters' timers keep their places; the second pair's backend comes after them.
    let (backends, _peers): (Vec<Box<dyn super::NetBackend>>, Vec<UnixDatagram>) = (0..3)
        .map(|_| {
            let (b, p) = SocketBackend::pair();
            (Box::new(b) as Box<dyn super::NetBackend>, p)
        })
        .unzip();
    let raw: Vec<i32> = backends.iter().map(|b| b.raw_fd()).collect();
    let n =
        Net::with_backends(backends, None, 256, one_frame_per_ms(), one_frame_per_ms()).unwrap();
    let fds = n.event_fds();
    assert_eq!(fds.len(), 6);
    assert_eq!((fds[0], fds[4], fds[5]), (raw[0], raw[1], raw[2]));
    // No pairs, or more than the bound, is no device.
    for count in [0, usize::from(super::net::MAX_QUEUE_PAIRS) + 1] {
        let backends = (0..count)
            .map(|_| Box::new(SocketBackend::pair().0) as Box<dyn super::NetBackend>)
            .collect();
        let e = Net::with_backends(backends, None, 256, None, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&format!("{count} queue pairs")), "{e}");
    }
}

#[test]
fn each_pairs_doorbells_and_backend_ask_for_the_lane_of_that_pair() {
    let (net, _peers) = mq_device(3);
    let queues: Vec<usize> = (0..7).map(|q| net.queue_lane(q)).collect();
    assert_eq!(
        queues,
        [0, 0, 1, 1, 2, 2, 0],
        "pairs 0 to 2, then the control queue"
    );
    // Pair 0's backend, the resume eventfd, then pairs 1 and 2's backends.
    let events: Vec<usize> = (0..4).map(|i| net.event_lane(i)).collect();
    assert_eq!(events, [0, 0, 1, 2]);
    assert_eq!(net.event_lane(9), 0, "no such event");
}

#[test]
fn a_second_pair_receives_only_after_vq_pairs_set() {
    let mut s = mq_setup(2, 0);
    assert_eq!(s.r.ctrl_queue, 4);
    s.post_rx(0, 4);
    s.post_rx(1, 4);
    let f1 = frame(100, 1);
    s.peers[1].send(&f1).unwrap();
    s.d.t.process_event(s.backend_event[1]);
    s.d.t.process_event(RESUME);
    assert_eq!(s.received(1), None, "pair 1 is not in use yet");
    assert_eq!(s.received(0), None, "nor does its frame go to pair 0");
    // Pair 0 works meanwhile.
    let f0 = frame(80, 0);
    s.peers[0].send(&f0).unwrap();
    s.d.t.process_event(s.backend_event[0]);
    assert_eq!(s.received(0), Some(f0.clone()));
    assert_eq!(s.pairs_set(2), OK);
    // The device asked itself for a pass: the frame waiting on pair 1 arrives on queue 2.
    s.d.t.process_event(RESUME);
    assert_eq!(s.received(1), Some(f1));
    assert_eq!(s.received(0), None);
    // From now on each backend's frames land on their own pair's queue.
    let g1 = frame(90, 3);
    s.peers[1].send(&g1).unwrap();
    s.d.t.process_event(s.backend_event[1]);
    assert_eq!(s.received(1), Some(g1));
    s.peers[0].send(&f0).unwrap();
    s.d.t.process_event(s.backend_event[0]);
    assert_eq!(s.received(0), Some(f0));
    let c = s.counters();
    assert_eq!((c.rx_packets, c.ctrl_commands, c.ctrl_errors), (4, 1, 0));
    // With EVENT_IDX the device asked for the doorbell of the next command.
    assert_eq!(s.d.avail_event(&s.r.ctrl), s.r.ctrl.avail_idx);
    // Back to one pair: pair 1's frames wait again.
    assert_eq!(s.pairs_set(1), OK);
    s.peers[1].send(&frame(70, 4)).unwrap();
    s.d.t.process_event(s.backend_event[1]);
    s.d.t.process_event(RESUME);
    assert_eq!(s.received(1), None);
    assert!(!s.d.needs_reset());
}

#[test]
fn each_transmit_queue_sends_through_its_own_pairs_backend() {
    let mut s = mq_setup(2, 0);
    let f = frame(100, 7);
    // Served on any ready transmit queue, in use or not.
    s.send_on(1, &f);
    assert_eq!(s.peer_frame(1), Some(f.clone()));
    assert_eq!(s.peer_frame(0), None);
    assert_eq!(s.d.next_used_on(&mut s.r.tx[1]), Some((0, 0)));
    assert_eq!(s.pairs_set(2), OK);
    let g = frame(50, 8);
    s.send_on(1, &g);
    assert_eq!(s.peer_frame(1), Some(g));
    s.send_on(0, &f);
    assert_eq!(s.peer_frame(0), Some(f));
    assert_eq!(s.peer_frame(1), None);
    let c = s.counters();
    assert_eq!((c.tx_packets, c.tx_notifications), (3, 3));
}

#[test]
fn vq_pairs_set_outside_one_to_max_or_without_mq_is_refused() {
    let mut s = mq_setup(2, 0);
    for n in [0u16, 3, u16::MAX] {
        assert_eq!(s.pairs_set(n), ERR, "{n} pairs");
    }
    // Short or long data, and MQ commands not offered.
    assert_eq!(s.control(CLASS_MQ, PAIRS_SET, &[2]), Some((ERR, 1)));
    assert_eq!(s.control(CLASS_MQ, PAIRS_SET, &[2, 0, 0]), Some((ERR, 1)));
    assert_eq!(s.control(CLASS_MQ, 1, &[2, 0]), Some((ERR, 1)));
    let c = s.counters();
    assert_eq!((c.ctrl_commands, c.ctrl_errors), (6, 6));
    // Still one pair in use.
    s.post_rx(1, 1);
    s.peers[1].send(&frame(40, 0)).unwrap();
    s.d.t.process_event(RESUME);
    assert_eq!(s.received(1), None);
    // Without MQ the control queue is queue 2 and VQ_PAIRS_SET is refused.
    let mut s = mq_setup(2, MQ);
    assert_eq!(s.r.ctrl_queue, 2);
    assert_eq!(s.pairs_set(1), ERR);
    assert_eq!(s.pairs_set(2), ERR);
    // Receive filter commands still work there.
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((OK, 1)));
}

#[test]
fn with_promiscuous_mode_off_only_frames_for_the_guest_are_received() {
    let mut s = mq_setup(1, 0);
    s.post_rx(0, 16);
    let other = [0x52, 0x54, 0, 9, 9, 9];
    let multi = [0x01, 0x00, 0x5e, 0, 0, 1];
    let bcast = [0xff; 6];
    // Promiscuous after reset: everything comes.
    for (k, dest) in [MAC, other, multi, bcast].into_iter().enumerate() {
        s.peers[0].send(&frame_to(dest, k as u8)).unwrap();
    }
    s.d.t.process_event(0);
    for (k, dest) in [MAC, other, multi, bcast].into_iter().enumerate() {
        assert_eq!(s.received(0), Some(frame_to(dest, k as u8)));
    }
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((OK, 1)));
    let all = [MAC, other, multi, bcast];
    let deliver = |s: &mut Mq| -> Vec<[u8; 6]> {
        for (k, dest) in all.into_iter().enumerate() {
            s.peers[0].send(&frame_to(dest, k as u8)).unwrap();
        }
        s.d.t.process_event(0);
        let mut got = Vec::new();
        while let Some(f) = s.received(0) {
            got.push(f[VNET_HDR_LEN..VNET_HDR_LEN + 6].try_into().unwrap());
        }
        got
    };
    assert_eq!(deliver(&mut s), vec![MAC, bcast]);
    assert_eq!(s.counters().rx_filtered, 2);
    assert_eq!(s.control(CLASS_RX, ALLMULTI, &[1]), Some((OK, 1)));
    assert_eq!(deliver(&mut s), vec![MAC, multi, bcast]);
    assert_eq!(s.control(CLASS_RX, ALLMULTI, &[0]), Some((OK, 1)));
    let tables = mac_tables(&[other], &[multi]);
    assert_eq!(s.control(CLASS_MAC, TABLE_SET, &tables), Some((OK, 1)));
    assert_eq!(deliver(&mut s), all.to_vec());
    assert_eq!(
        s.control(CLASS_MAC, TABLE_SET, &mac_tables(&[], &[])),
        Some((OK, 1))
    );
    assert_eq!(deliver(&mut s), vec![MAC, bcast]);
    let c = s.counters();
    assert_eq!((c.rx_filtered, c.ctrl_commands, c.ctrl_errors), (5, 5, 0));
    // Without CTRL_RX the commands are refused and everything is received.
    let mut s = mq_setup(1, CTRL_RX);
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((ERR, 1)));
    s.post_rx(0, 16);
    assert_eq!(deliver(&mut s).len(), 4);
}

#[test]
fn hostile_control_chains_get_err_or_are_dropped_and_the_device_goes_on() {
    let mut s = mq_setup(2, 0);
    let ctrl = |s: &mut Mq, descs: &[(u64, u32, u16)]| s.d.control_chain(&mut s.r, 0, descs);
    s.d.mem
        .write_slice(&[CLASS_RX, PROMISC, 0], GuestAddress(HDR))
        .unwrap();
    // Header shorter than two bytes; no data for PROMISC.
    assert_eq!(ctrl(&mut s, &[(HDR, 1, 0), (STATUS, 1, W)]), Some((ERR, 1)));
    assert_eq!(ctrl(&mut s, &[(HDR, 2, 0), (STATUS, 1, W)]), Some((ERR, 1)));
    // Nowhere to put the ack: used with nothing written, and not carried out.
    assert_eq!(ctrl(&mut s, &[(HDR, 3, 0)]), Some((0xff, 0)));
    // The header device-writable (the wrong way round): nothing to read, and the ack goes
    // to the first writable byte, the header's.
    assert_eq!(
        ctrl(&mut s, &[(HDR, 3, W), (STATUS, 1, W)]),
        Some((0xff, 1))
    );
    assert_eq!(s.d.guest_bytes(HDR, 1), [ERR]);
    s.d.mem
        .write_slice(&[CLASS_RX, PROMISC, 0], GuestAddress(HDR))
        .unwrap();
    // A readable part after the ack.
    assert_eq!(ctrl(&mut s, &[(STATUS, 1, W), (HDR, 3, 0)]), Some((ERR, 1)));
    // Outside guest memory, at its end or wrapping the address space.
    let end = MEM_SIZE as u64;
    assert_eq!(
        ctrl(&mut s, &[(end - 1, 3, 0), (STATUS, 1, W)]),
        Some((ERR, 1))
    );
    assert_eq!(
        ctrl(&mut s, &[(u64::MAX - 1, 3, 0), (STATUS, 1, W)]),
        Some((ERR, 1))
    );
    assert_eq!(ctrl(&mut s, &[(HDR, 3, 0), (end, 1, W)]), Some((0xff, 0)));
    // Zero-length descriptors.
    assert_eq!(ctrl(&mut s, &[(HDR, 0, 0), (STATUS, 1, W)]), Some((ERR, 1)));
    // Huge: a table count no data backs, a command longer than the device reads.
    let mut huge = vec![CLASS_MAC, TABLE_SET];
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    s.d.mem.write_slice(&huge, GuestAddress(DATA)).unwrap();
    assert_eq!(
        ctrl(&mut s, &[(DATA, 6, 0), (STATUS, 1, W)]),
        Some((ERR, 1))
    );
    assert_eq!(
        ctrl(&mut s, &[(DATA, 0x10_0000, 0), (STATUS, 1, W)]),
        Some((ERR, 1))
    );
    // A table too long to keep, with the data there: taken as "every address".
    let many = vec![[0x52, 0x54, 0, 7, 7, 7]; 1000];
    let tables = mac_tables(&many, &[]);
    assert_eq!(s.control(CLASS_MAC, TABLE_SET, &tables), Some((OK, 1)));
    // Unknown classes and commands.
    for (class, cmd) in [
        (2u8, 0u8),
        (3, 0),
        (5, 0),
        (6, 0),
        (0xff, 0xff),
        (CLASS_RX, 5),
    ] {
        assert_eq!(s.control(class, cmd, &[1]), Some((ERR, 1)), "{class}/{cmd}");
    }
    // A looping chain, and one whose next points past the table.
    s.d.put_descs_on(&s.r.ctrl, 0, &[(HDR, 3, N, 1), (STATUS, 1, W | N, 0)]);
    s.d.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    s.d.publish_on(&mut s.r.ctrl, 0);
    s.d.notify_queue(s.r.ctrl_queue);
    assert!(s.d.next_used_on(&mut s.r.ctrl).is_some());
    s.d.put_descs_on(&s.r.ctrl, 0, &[(HDR, 3, N, 0x7fff)]);
    s.d.publish_on(&mut s.r.ctrl, 0);
    s.d.notify_queue(s.r.ctrl_queue);
    assert!(s.d.next_used_on(&mut s.r.ctrl).is_some());
    assert!(!s.d.needs_reset());
    let c = s.counters();
    assert_eq!(
        c.ctrl_commands - c.ctrl_errors,
        1,
        "only the long table was carried out"
    );
    // The device goes on: a well-formed command, then frames both ways on both pairs.
    assert_eq!(s.pairs_set(2), OK);
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((OK, 1)));
    s.post_rx(1, 2);
    s.peers[1].send(&frame_to(MAC, 1)).unwrap();
    s.d.t.process_event(s.backend_event[1]);
    assert_eq!(s.received(1), Some(frame_to(MAC, 1)));
    s.send_on(1, &frame(40, 2));
    assert_eq!(s.peer_frame(1), Some(frame(40, 2)));
}

#[test]
fn a_reset_brings_back_one_pair_and_promiscuous_mode() {
    let mut s = mq_setup(2, 0);
    assert_eq!(s.pairs_set(2), OK);
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((OK, 1)));
    s.r = s.d.net_up_pairs(0, 2);
    s.d.t.process_event(RESUME);
    s.post_rx(0, 4);
    s.post_rx(1, 4);
    let other = frame_to([0x52, 0x54, 0, 9, 9, 9], 0);
    s.peers[0].send(&other).unwrap();
    s.peers[1].send(&frame(60, 1)).unwrap();
    s.d.t.process_event(s.backend_event[0]);
    s.d.t.process_event(s.backend_event[1]);
    assert_eq!(s.received(0), Some(other), "promiscuous again");
    assert_eq!(s.received(1), None, "one pair again");
    assert_eq!(s.counters().rx_filtered, 0);
}

#[test]
fn pairs_in_use_and_the_filter_survive_a_snapshot() {
    let mut s = mq_setup(2, 0);
    assert_eq!(s.pairs_set(2), OK);
    assert_eq!(s.control(CLASS_RX, PROMISC, &[0]), Some((OK, 1)));
    let state = s.d.t.state();
    let (net, peers) = mq_device(2);
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    t.restore(&state).unwrap();
    assert_eq!(t.state(), state);
    assert_eq!(t.num_queues(), 5);
    s.post_rx(1, 2);
    peers[1]
        .send(&frame_to([0x52, 0x54, 0, 9, 9, 9], 0))
        .unwrap();
    peers[1].send(&frame_to(MAC, 1)).unwrap();
    t.process_event(2);
    assert_eq!(s.received(1), Some(frame_to(MAC, 1)));
    assert_eq!(s.received(1), None);
    assert_eq!(t.net_counters().unwrap().rx_filtered, 1);
    // A state file is not trusted: pairs beyond the device's are clamped, a table longer
    // than the device keeps takes every address of its kind.
    let mut hostile = t.state();
    let mut json = serde_json::to_value(&hostile).unwrap();
    json["device"]["net"]["control"]["pairs"] = 40.into();
    let many = vec![[0x52, 0x54, 0, 7, 7, 7]; 1000];
    json["device"]["net"]["control"]["filter"]["unicast"] = serde_json::to_value(&many).unwrap();
    hostile = serde_json::from_value(json).unwrap();
    let (net, peers) = mq_device(2);
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    t.restore(&hostile).unwrap();
    let saved = serde_json::to_value(t.state()).unwrap();
    let control = &saved["device"]["net"]["control"];
    assert_eq!(control["pairs"], 2, "{control}");
    assert_eq!(control["filter"]["unicast"].as_array().unwrap().len(), 64);
    assert_eq!(control["filter"]["all_unicast"], true);
    s.post_rx(1, 1);
    peers[1]
        .send(&frame_to([0x52, 0x54, 0, 9, 9, 9], 2))
        .unwrap();
    t.process_event(2);
    assert_eq!(s.received(1), Some(frame_to([0x52, 0x54, 0, 9, 9, 9], 2)));
    // A one-pair device cannot take the state of a two-pair one.
    let (b, _peer) = SocketBackend::pair();
    let net = Net::with_backend(Box::new(b), Some(MAC), 256, None, None).unwrap();
    let mut t = super::MmioTransport::new(Box::new(net), s.d.mem.clone(), s.d.irq.clone());
    let e = t.restore(&state).unwrap_err().to_string();
    assert!(e.contains("5 queues"), "{e}");
}
