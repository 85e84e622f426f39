//! `udp-counter=PORT`: a service whose every answer depends on all the requests before it,
//! so a client can tell a lost or replayed piece of its history (a replicated VM's failover
//! must show neither): each datagram gets back, in decimal ASCII, the next value of a
//! counter kept in guest RAM, the first answer being 1.

use core::fmt::Write;

use smoltcp::iface::SocketStorage;
use smoltcp::socket::udp;

use super::stack::Stack;
use super::tasks::{fail, fail_with, open, params, run_until, LINGER_MS};
use super::Carve;
use crate::ulib::{self, Line};

/// Datagrams waiting either way at most; more are dropped by the stack (the client resends).
const QUEUED: usize = 64;

pub extern "C" fn udp_counter(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "udp-counter";
    let p = params(param);
    let mut mem = Carve::new(buf, len);
    let dev = open(NAME, &mut mem, 1);
    let (Some(rx), Some(tx)) = (mem.slice(16 * 1024), mem.slice(16 * 1024)) else {
        fail(NAME, "no memory for socket buffers")
    };
    let mut rx_meta = [udp::PacketMetadata::EMPTY; QUEUED];
    let mut tx_meta = [udp::PacketMetadata::EMPTY; QUEUED];
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, &p, &mut storage);
    let mut sock = udp::Socket::new(
        udp::PacketBuffer::new(&mut rx_meta[..], rx),
        udp::PacketBuffer::new(&mut tx_meta[..], tx),
    );
    if sock.bind(p.port).is_err() {
        fail(NAME, "cannot bind the UDP port");
    }
    let h = net.sockets.add(sock);
    let mut l = Line::new();
    let _ = writeln!(l, "probe: udp-counter: listening on port {}", p.port);
    l.send();
    let mut counter = 0u64;
    while counter < p.count {
        net.poll();
        let s = net.sockets.get_mut::<udp::Socket>(h);
        // Only as many as can be answered now: a request left queued is answered on a
        // later pass, never counted without its answer.
        while counter < p.count && s.can_recv() && s.can_send() {
            let Ok((_, meta)) = s.recv() else { break };
            let next = counter + 1;
            let mut digits = [0u8; 20];
            let text = decimal(next, &mut digits);
            if s.send_slice(text, meta.endpoint).is_err() {
                break;
            }
            counter = next;
        }
        if net.out_of_time() {
            let mut extra = Line::new();
            let _ = write!(
                extra,
                "\"port\":{},\"answered\":{},\"wanted\":{},",
                p.port, counter, p.count
            );
            fail_with(NAME, "the task's time ran out", &net, extra.as_str());
        }
        net.poll();
        net.idle(1_000_000);
    }
    run_until(&mut net, LINGER_MS, |_| false);
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":true,\"port\":{},\"answered\":{},",
        NAME, p.port, counter
    );
    net.counters(&mut l);
    l.push("}\n");
    l.send();
    ulib::exit(0)
}

/// `v` in decimal ASCII, in the end of `buf`.
fn decimal(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[at..];
        }
    }
}
