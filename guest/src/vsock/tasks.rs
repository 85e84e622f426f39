//! `vsock-echo` and `vsock-send`: stream connections over virtio-vsock, with credit-based
//! flow control both ways (virtio 1.1, 5.10.6.3). Each ends on its count, or shortly before
//! the task's deadline, and reports one JSON line; a task that cannot finish exits with
//! `STATUS_NET_FAILED`.

use core::fmt::Write;

use super::driver::*;
use super::Params;
use crate::abi::STATUS_NET_FAILED;
use crate::net::Carve;
use crate::ulib::{self, Line};

/// Connections `vsock-echo` serves at once.
const CONNS: usize = 8;
/// Each connection's receive buffer: what the host may send before the guest echoes it.
const ECHO_BUF: usize = 64 * 1024;
/// `vsock-send` gives up when the host takes no byte for this long.
const STALL_MS: u64 = 10_000;

fn params(p: u64) -> Params {
    // SAFETY: the kernel copied a `Params` to this address at the end of the task's data
    // area (`user::run_task`), aligned, and nothing writes it while the task runs.
    unsafe { core::ptr::read(p as *const Params) }
}

fn fail(name: &str, why: &str, extra: &str) -> ! {
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\"{}}}",
        name, why, extra
    );
    l.send();
    ulib::exit(STATUS_NET_FAILED)
}

fn open(name: &str, mem: &mut Carve) -> Vsock {
    match Vsock::open(mem) {
        Ok(d) => d,
        Err(crate::abi::Error::NoDevice) => fail(name, "no usable virtio-vsock device", ""),
        Err(e) => fail(name, e.name(), ""),
    }
}

/// A reply on the connection `h` arrived on.
fn reply(h: &Header, op: u16) -> Header {
    Header {
        src_port: h.dst_port,
        dst_port: h.src_port,
        op,
        ..Header::default()
    }
}

/// One echoed connection: the bytes received and not yet sent back, in a ring.
struct Conn {
    live: bool,
    local: u32,
    peer: u32,
    buf: &'static mut [u8],
    head: usize,
    len: usize,
    /// Bytes taken out of `buf` (sent back), ever: our `fwd_cnt`.
    fwd_cnt: u32,
    /// Bytes sent to the host, and what it said of its buffer.
    tx_cnt: u32,
    peer_alloc: u32,
    peer_fwd: u32,
}

impl Conn {
    fn credit(&self) -> u32 {
        self.peer_alloc
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd))
    }

    fn header(&self, op: u16) -> Header {
        Header {
            src_port: self.local,
            dst_port: self.peer,
            op,
            buf_alloc: ECHO_BUF as u32,
            fwd_cnt: self.fwd_cnt,
            ..Header::default()
        }
    }
}

pub extern "C" fn vsock_echo(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "vsock-echo";
    let p = params(param);
    let mut mem = Carve::new(buf, len);
    let mut dev = open(NAME, &mut mem);
    let mut conns: [Option<Conn>; CONNS] = [const { None }; CONNS];
    for c in conns.iter_mut() {
        let Some(buf) = mem.slice(ECHO_BUF) else {
            fail(NAME, "no memory for echo buffers", "")
        };
        *c = Some(Conn {
            live: false,
            local: p.port,
            peer: 0,
            buf,
            head: 0,
            len: 0,
            fwd_cnt: 0,
            tx_cnt: 0,
            peer_alloc: 0,
            peer_fwd: 0,
        });
    }
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "probe: vsock-echo: cid {} listening on port {}",
        dev.cid, p.port
    );
    l.send();
    let t0 = ulib::rdtsc();
    let (mut done, mut bytes, mut refused, mut lost) = (0u64, 0u64, 0u64, 0u64);
    let mut resets_seen = 0;
    while done < p.count {
        while let Some(pkt) = dev.recv() {
            if dev.resets != resets_seen {
                // The VM moved: the device dropped every connection, so do we (5.10.6.6).
                resets_seen = dev.resets;
                for c in conns.iter_mut().flatten().filter(|c| c.live) {
                    c.live = false;
                    lost += 1;
                }
            }
            let h = pkt.hdr;
            let slot = conns
                .iter_mut()
                .flatten()
                .find(|c| c.live && c.peer == h.src_port && c.local == h.dst_port);
            match (slot, h.op) {
                (None, OP_REQUEST) if h.dst_port == p.port => {
                    match conns.iter_mut().flatten().find(|c| !c.live) {
                        Some(c) => {
                            c.live = true;
                            (c.peer, c.head, c.len) = (h.src_port, 0, 0);
                            (c.fwd_cnt, c.tx_cnt) = (0, 0);
                            (c.peer_alloc, c.peer_fwd) = (h.buf_alloc, h.fwd_cnt);
                            let r = c.header(OP_RESPONSE);
                            dev.send(r, 0, |_| {});
                        }
                        None => {
                            refused += 1;
                            dev.send(reply(&h, OP_RST), 0, |_| {});
                        }
                    }
                }
                (None, OP_RST) => {}
                (None, _) => {
                    dev.send(reply(&h, OP_RST), 0, |_| {});
                }
                (Some(c), op) => {
                    (c.peer_alloc, c.peer_fwd) = (h.buf_alloc, h.fwd_cnt);
                    match op {
                        OP_RW => {
                            let data = pkt.data();
                            if c.len + data.len() > c.buf.len() {
                                // The host sent past our credit.
                                c.live = false;
                                done += 1;
                                dev.send(c.header(OP_RST), 0, |_| {});
                            } else {
                                for &b in data {
                                    let at = (c.head + c.len) % c.buf.len();
                                    c.buf[at] = b;
                                    c.len += 1;
                                }
                            }
                        }
                        OP_CREDIT_REQUEST => {
                            dev.send(c.header(OP_CREDIT_UPDATE), 0, |_| {});
                        }
                        OP_SHUTDOWN | OP_RST => {
                            c.live = false;
                            done += 1;
                            if op == OP_SHUTDOWN {
                                dev.send(c.header(OP_RST), 0, |_| {});
                            }
                        }
                        _ => {}
                    }
                }
            }
            dev.done(pkt);
        }
        // Echo what each connection holds, as far as the host's credit goes.
        for c in conns.iter_mut().flatten().filter(|c| c.live) {
            while c.len > 0 && c.credit() > 0 && dev.can_send() {
                let n = c.len.min(MAX_DATA).min(c.credit() as usize);
                let n = n.min(c.buf.len() - c.head);
                c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
                c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
                let h = c.header(OP_RW);
                let (src, head) = (&c.buf[..], c.head);
                dev.send(h, n, |b| b.copy_from_slice(&src[head..head + n]));
                c.head = (c.head + n) % c.buf.len();
                c.len -= n;
                bytes += n as u64;
            }
        }
        if done >= p.count {
            break;
        }
        if dev.out_of_time() {
            let mut extra = Line::new();
            let _ = write!(extra, ",\"connections\":{},\"bytes\":{}", done, bytes);
            fail(NAME, "the task's time ran out", extra.as_str());
        }
        dev.idle(100_000);
    }
    dev.flush();
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"{}\",\"ok\":true,\"cid\":{},\"port\":{},\"connections\":{},\"bytes\":{},\"refused\":{},\"resets\":{},\"lost_to_resets\":{},\"us\":{}}}",
        NAME,
        dev.cid,
        p.port,
        done,
        bytes,
        refused,
        dev.resets,
        lost,
        dev.us_since(t0)
    );
    l.send();
    ulib::exit(0)
}

pub extern "C" fn vsock_send(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "vsock-send";
    let p = params(param);
    let mut mem = Carve::new(buf, len);
    let mut dev = open(NAME, &mut mem);
    let local = 1024 + (ulib::rdtsc() % 30000) as u32;
    let mut c = Header {
        src_port: local,
        dst_port: p.port,
        buf_alloc: 4096,
        ..Header::default()
    };
    c.op = OP_REQUEST;
    let t0 = ulib::rdtsc();
    if !dev.send(c, 0, |_| {}) {
        fail(NAME, "no transmit buffer", "");
    }
    let total = p.count;
    let (mut sent, mut crc) = (0u64, !0u32);
    let (mut established, mut shut) = (false, false);
    let (mut peer_alloc, mut peer_fwd) = (0u32, 0u32);
    let mut last_progress = t0;
    let mut closed = false;
    let error = loop {
        while let Some(pkt) = dev.recv() {
            let h = pkt.hdr;
            dev.done(pkt);
            if h.src_port != p.port || h.dst_port != local {
                continue;
            }
            (peer_alloc, peer_fwd) = (h.buf_alloc, h.fwd_cnt);
            last_progress = ulib::rdtsc();
            match h.op {
                OP_RESPONSE => established = true,
                // The device resets the connection once every byte reached the host.
                OP_RST | OP_SHUTDOWN if shut => closed = true,
                OP_RST | OP_SHUTDOWN if !established => {
                    dev.flush();
                    fail(NAME, "connection refused", "");
                }
                OP_RST | OP_SHUTDOWN => closed = true,
                OP_CREDIT_REQUEST => {
                    let mut u = c;
                    u.op = OP_CREDIT_UPDATE;
                    dev.send(u, 0, |_| {});
                }
                _ => {}
            }
        }
        if closed {
            break (!shut).then_some("connection reset");
        }
        if dev.resets > 0 {
            break Some("transport reset: the VM moved and the connection is gone");
        }
        if established && !shut {
            let in_flight = (sent as u32).wrapping_sub(peer_fwd);
            let mut credit = u64::from(peer_alloc.saturating_sub(in_flight));
            while sent < total && credit > 0 && dev.can_send() {
                let n = (total - sent).min(MAX_DATA as u64).min(credit) as usize;
                let mut h = c;
                h.op = OP_RW;
                let off = sent;
                dev.send(h, n, |b| {
                    ulib::stream_bytes(b, off);
                    crc = workloads::crc32::crc32_update(crc, b);
                });
                sent += n as u64;
                credit -= n as u64;
                last_progress = ulib::rdtsc();
            }
            if sent == total && dev.can_send() {
                let mut h = c;
                h.op = OP_SHUTDOWN;
                h.flags = SHUTDOWN_BOTH;
                dev.send(h, 0, |_| {});
                shut = true;
            }
        }
        if dev.us_since(last_progress) > STALL_MS * 1000 {
            break Some("no progress for 10 s");
        }
        if dev.out_of_time() {
            break Some("the task's time ran out");
        }
        dev.idle(100_000);
    };
    dev.flush();
    let us = dev.us_since(t0);
    if let Some(why) = error {
        let mut extra = Line::new();
        let _ = write!(
            extra,
            ",\"bytes\":{},\"sent\":{},\"us\":{}",
            total, sent, us
        );
        fail(NAME, why, extra.as_str());
    }
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"{}\",\"ok\":true,\"port\":{},\"bytes\":{},\"crc32\":\"{:#010x}\",\"us\":{}}}",
        NAME,
        p.port,
        sent,
        !crc,
        us
    );
    l.send();
    ulib::exit(0)
}
