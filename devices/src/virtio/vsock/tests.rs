//! The device driven as a guest would drive it, over mock guest memory, against real UNIX
//! sockets standing in for host programs.

use super::conn::BUF_ALLOC;
use super::packet::*;
use super::*;
use crate::virtio::driver::{Driver, Ring, DATA, HDR, QSIZE, RX_BUF, W};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

const CID: u64 = 3;
/// Bytes of each receive buffer the test driver posts.
const RX_LEN: u32 = 4096;

pub(crate) struct Guest {
    pub d: Driver,
    rx: Ring,
    tx: Ring,
    pub ev: Ring,
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl Guest {
    pub fn new() -> Guest {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let mut d = Driver::new(Vsock::new(CID, &path).unwrap());
        let (rx, tx, ev) = d.vsock_up();
        Guest {
            d,
            rx,
            tx,
            ev,
            _dir: dir,
            path,
        }
    }

    /// Posts `n` receive buffers; descriptor i always points at buffer i.
    pub fn post_rx(&mut self, n: u16) {
        for _ in 0..n {
            let id = self.rx.avail_idx % QSIZE;
            let at = RX_BUF + u64::from(id) * u64::from(RX_LEN);
            self.d.chain_on(&mut self.rx, id, &[(at, RX_LEN, W)]);
        }
        self.d.notify_queue(0);
    }

    /// Sends one packet: header and payload in descriptors of their own, as Linux does.
    pub fn send(&mut self, mut h: Header, data: &[u8]) {
        if h.len == 0 {
            h.len = data.len() as u32;
        }
        let id = (self.tx.avail_idx % (QSIZE / 2)) * 2;
        let hdr = HDR + u64::from(id) * 64;
        self.d
            .mem
            .write_slice(&h.encode(), GuestAddress(hdr))
            .unwrap();
        if data.is_empty() {
            self.d
                .chain_on(&mut self.tx, id, &[(hdr, HDR_LEN as u32, 0)]);
        } else {
            let at = DATA + u64::from(id) * 0x1_0000;
            self.d.mem.write_slice(data, GuestAddress(at)).unwrap();
            // Two descriptors, id and id + 1: ids are even.
            self.d.chain_on(
                &mut self.tx,
                id,
                &[(hdr, HDR_LEN as u32, 0), (at, data.len() as u32, 0)],
            );
        }
        self.d.notify_queue(1);
    }

    pub fn events(&mut self) {
        for _ in 0..4 {
            self.d.t.process_event(0);
        }
    }

    /// The next packet the device put in a receive buffer.
    pub fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        let (id, len) = self.d.next_used_on(&mut self.rx)?;
        assert!(len as usize >= HDR_LEN, "used length {len}");
        let at = RX_BUF + u64::from(id) * u64::from(RX_LEN);
        let b = self.d.guest_bytes(at, len as usize);
        let h = Header::parse(b[..HDR_LEN].try_into().unwrap());
        assert_eq!(h.len as usize, len as usize - HDR_LEN);
        Some((h, b[HDR_LEN..].to_vec()))
    }

    /// Serves events until a packet arrives.
    pub fn expect(&mut self) -> (Header, Vec<u8>) {
        for _ in 0..50 {
            if let Some(p) = self.recv() {
                return p;
            }
            self.events();
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("no packet from the device");
    }

    pub fn nothing(&mut self) {
        self.events();
        if let Some(p) = self.recv() {
            panic!("unexpected packet {p:?}");
        }
    }
}

pub(crate) fn hdr(op: u16, src_port: u32, dst_port: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        type_: TYPE_STREAM,
        op,
        buf_alloc: 65536,
        ..Header::default()
    }
}

/// Whether the device closed its end: end of file, or a reset when it closed with the
/// client's bytes unread.
fn closed(c: &mut UnixStream) -> bool {
    let mut rest = Vec::new();
    match c.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    }
}

fn client(g: &Guest) -> UnixStream {
    let s = UnixStream::connect(&g.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// A host program's connection to guest port 52, accepted by the guest: (stream, the
/// host-side port).
fn connected(g: &mut Guest) -> (UnixStream, u32) {
    let mut c = client(g);
    c.write_all(b"CONNECT 52\n").unwrap();
    let (h, _) = g.expect();
    assert_eq!(
        (h.op, h.dst_port, h.dst_cid, h.src_cid),
        (OP_REQUEST, 52, CID, HOST_CID)
    );
    assert!(h.src_port >= 1 << 30);
    g.send(hdr(OP_RESPONSE, 52, h.src_port), &[]);
    let mut line = [0u8; 32];
    let n = c.read(&mut line).unwrap();
    assert_eq!(
        std::str::from_utf8(&line[..n]).unwrap(),
        format!("OK {}\n", h.src_port)
    );
    (c, h.src_port)
}

#[test]
fn config_space_is_the_guest_cid() {
    let mut g = Guest::new();
    assert_eq!(g.d.config_u64(0), CID);
    assert_eq!(
        g.d.read(virtio_bindings::virtio_mmio::VIRTIO_MMIO_DEVICE_ID),
        19
    );
}

#[test]
fn host_program_reaches_a_guest_listener_and_back() {
    let mut g = Guest::new();
    g.post_rx(8);
    let (mut c, port) = connected(&mut g);
    c.write_all(b"ping from the host").unwrap();
    let (h, data) = g.expect();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RW, port, 52));
    assert_eq!(data, b"ping from the host");
    assert_eq!(h.buf_alloc, BUF_ALLOC);
    g.send(hdr(OP_RW, 52, port), b"pong from the guest");
    let mut back = [0u8; 19];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"pong from the guest");
    // The host closes: the guest is told no more comes, then the connection is reset.
    drop(c);
    let (h, _) = g.expect();
    assert_eq!((h.op, h.flags), (OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND));
    let (h, _) = g.expect();
    assert_eq!(h.op, OP_RST);
    assert_eq!(g.d.t.stats().errors, 0);
}

#[test]
fn host_data_waits_for_the_guests_credit() {
    let mut g = Guest::new();
    g.post_rx(8);
    let mut c = client(&g);
    c.write_all(b"CONNECT 52\n").unwrap();
    let (h, _) = g.expect();
    let mut resp = hdr(OP_RESPONSE, 52, h.src_port);
    resp.buf_alloc = 5;
    g.send(resp, &[]);
    let mut line = [0u8; 32];
    assert!(c.read(&mut line).unwrap() > 0);
    c.write_all(b"0123456789").unwrap();
    let (h, data) = g.expect();
    assert_eq!((h.op, data.as_slice()), (OP_RW, &b"01234"[..]));
    g.nothing();
    let mut upd = hdr(OP_CREDIT_UPDATE, 52, h.src_port);
    upd.buf_alloc = 5;
    upd.fwd_cnt = 5;
    g.send(upd, &[]);
    let (_, data) = g.expect();
    assert_eq!(data, b"56789");
}

#[test]
fn guest_reaches_the_host_listener_at_path_port() {
    let mut g = Guest::new();
    g.post_rx(8);
    let listener = UnixListener::bind(format!("{}_5000", g.path.display())).unwrap();
    g.send(hdr(OP_REQUEST, 1234, 5000), &[]);
    let (h, _) = g.expect();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RESPONSE, 5000, 1234));
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.send(hdr(OP_RW, 1234, 5000), b"stream");
    let mut shut = hdr(OP_SHUTDOWN, 1234, 5000);
    shut.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(shut, &[]);
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"stream");
    let (h, _) = g.expect();
    assert_eq!(h.op, OP_RST);
    assert_eq!(g.d.t.stats().errors, 0);
}

#[test]
fn guest_connecting_to_a_port_nobody_listens_on_is_reset() {
    let mut g = Guest::new();
    g.post_rx(8);
    g.send(hdr(OP_REQUEST, 1234, 5001), &[]);
    let (h, _) = g.expect();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RST, 5001, 1234));
}

#[test]
fn hostile_guest_packets_are_dropped_or_reset() {
    let mut g = Guest::new();
    g.post_rx(8);
    // Someone else's cid: dropped without a word.
    let mut h = hdr(OP_REQUEST, 1, 5000);
    h.src_cid = 7;
    g.send(h, &[]);
    let mut h = hdr(OP_REQUEST, 1, 5000);
    h.dst_cid = 9;
    g.send(h, &[]);
    g.nothing();
    // Data for no connection, an unknown op, a datagram: reset.
    for (op, ty) in [(OP_RW, TYPE_STREAM), (99, TYPE_STREAM), (OP_REQUEST, 2)] {
        let mut h = hdr(op, 1, 5000);
        h.type_ = ty;
        g.send(h, b"xx");
        let (r, _) = g.expect();
        assert_eq!(r.op, OP_RST, "op {op} type {ty}");
    }
    // An RST for no connection is not answered.
    g.send(hdr(OP_RST, 1, 5000), &[]);
    g.nothing();
    // A length past the chain: dropped and reset, the device goes on.
    let mut h = hdr(OP_RW, 1, 5000);
    h.len = 0xffff_ffff;
    g.send(h, &[]);
    let (r, _) = g.expect();
    assert_eq!(r.op, OP_RST);
    assert!(!g.d.needs_reset());
    // An unknown op on a live connection resets that connection and closes the host end.
    let (mut c, port) = connected(&mut g);
    g.send(hdr(42, 52, port), &[]);
    let (r, _) = g.expect();
    assert_eq!(r.op, OP_RST);
    let mut rest = Vec::new();
    assert_eq!(c.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn a_guest_sending_past_its_credit_is_reset_and_nothing_grows() {
    let mut g = Guest::new();
    g.post_rx(8);
    // The host program never reads.
    let (c, port) = connected(&mut g);
    let chunk = vec![0x5au8; 60 * 1024];
    let mut reset = false;
    for _ in 0..((2 * BUF_ALLOC as usize + (8 << 20)) / chunk.len()) {
        g.send(hdr(OP_RW, 52, port), &chunk);
        g.events();
        if let Some((h, _)) = g.recv() {
            if h.op == OP_RST {
                reset = true;
                break;
            }
        }
    }
    assert!(reset, "a guest ignoring credit was never reset");
    drop(c);
}

#[test]
fn bad_host_clients_are_closed_and_the_next_one_works() {
    let mut g = Guest::new();
    g.post_rx(8);
    for bad in [&b"GET / HTTP/1.1\r\n"[..], b"CONNECT banana\n", &[b'x'; 64]] {
        let mut c = client(&g);
        c.write_all(bad).unwrap();
        g.events();
        assert!(closed(&mut c), "{bad:?}");
    }
    g.nothing();
    // CONNECT to a port the guest does not listen on: the guest resets, the client closes.
    let mut c = client(&g);
    c.write_all(b"CONNECT 99\n").unwrap();
    let (h, _) = g.expect();
    assert_eq!(h.op, OP_REQUEST);
    g.send(hdr(OP_RST, 99, h.src_port), &[]);
    g.events();
    assert!(closed(&mut c));
    let (mut c, port) = connected(&mut g);
    c.write_all(b"still here").unwrap();
    let (h, data) = g.expect();
    assert_eq!((h.src_port, data.as_slice()), (port, &b"still here"[..]));
}

#[test]
fn host_clients_past_the_limits_are_refused() {
    let mut g = Guest::new();
    // Silent clients: only the newest MAX_PENDING_CLIENTS stay.
    let silent: Vec<UnixStream> = (0..muxer::MAX_PENDING_CLIENTS + 4)
        .map(|_| {
            let c = client(&g);
            g.events();
            c
        })
        .collect();
    let mut first = silent[0].try_clone().unwrap();
    assert!(closed(&mut first), "oldest silent client kept");
    drop(silent);
    g.events();
    g.post_rx(8);
    let mut conns = Vec::new();
    for _ in 0..MAX_CONNS {
        let mut c = client(&g);
        c.write_all(b"CONNECT 52\n").unwrap();
        g.events();
        conns.push(c);
    }
    let mut extra = client(&g);
    extra.write_all(b"CONNECT 52\n").unwrap();
    g.events();
    assert!(closed(&mut extra));
    assert!(g.d.t.stats().errors == 0);
}

/// A burst of host programs, more than one pass accepts and more than may wait without a
/// line, all with their CONNECT line written before the device looks: each reaches the
/// guest. (Once, those past the first pass's accepts waited for a later connection to wake
/// the listener, and half of the first pass's were dropped as silent before being read.)
#[test]
fn a_burst_of_host_programs_past_one_pass_all_reach_the_guest() {
    let mut g = Guest::new();
    let burst = 2 * muxer::MAX_PENDING_CLIENTS + 8;
    let clients: Vec<UnixStream> = (0..burst)
        .map(|_| {
            let mut c = client(&g);
            c.write_all(b"CONNECT 52\n").unwrap();
            c
        })
        .collect();
    g.post_rx(QSIZE);
    let mut ports = std::collections::BTreeSet::new();
    while ports.len() < burst {
        let (h, _) = g.expect();
        assert_eq!((h.op, h.dst_port), (OP_REQUEST, 52), "{h:?}");
        assert!(
            ports.insert(h.src_port),
            "REQUEST from port {} twice",
            h.src_port
        );
        g.post_rx(1);
    }
    g.nothing();
    drop(clients);
}

#[test]
fn transport_reset_event_reaches_the_driver() {
    let mut g = Guest::new();
    g.post_rx(8);
    let (mut c, _) = connected(&mut g);
    let at = crate::virtio::driver::STATUS;
    g.d.mem.write_slice(&[0xff; 4], GuestAddress(at)).unwrap();
    g.d.chain_on(&mut g.ev, 0, &[(at, 4, W)]);
    g.d.notify_queue(2);
    assert!(g.d.next_used_on(&mut g.ev).is_none());
    // What a restore does to the device.
    g.d.t.transport_reset();
    g.events();
    let (_, len) = g.d.next_used_on(&mut g.ev).expect("no event");
    assert_eq!(len, 4);
    assert_eq!(g.d.guest_bytes(at, 4), EVENT_TRANSPORT_RESET.to_le_bytes());
    let mut rest = Vec::new();
    assert_eq!(c.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn a_connect_the_guest_never_answers_is_given_up() {
    let mut g = Guest::new();
    g.post_rx(8);
    let mut c = client(&g);
    c.write_all(b"CONNECT 52\n").unwrap();
    let (h, _) = g.expect();
    assert_eq!(h.op, OP_REQUEST);
    std::thread::sleep(muxer::CONNECT_TIMEOUT + Duration::from_millis(100));
    let (r, _) = g.expect();
    assert_eq!((r.op, r.src_port, r.dst_port), (OP_RST, h.src_port, 52));
    assert!(closed(&mut c));
    assert_eq!(g.d.t.stats().errors, 0);
}
