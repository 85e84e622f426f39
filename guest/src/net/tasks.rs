//! `udp-echo`, `tcp-send` and `http-serve`: user-mode task bodies. Each loop ends on its
//! count, on its own time bound, or shortly before the task's deadline, and reports one
//! JSON line; a task that cannot finish exits with `STATUS_NET_FAILED`.

use core::fmt::Write;

use smoltcp::iface::{SocketHandle, SocketStorage};
use smoltcp::socket::tcp::{self, State};
use smoltcp::socket::udp;
use smoltcp::wire::{IpAddress, IpEndpoint, Ipv4Address};

use super::driver::VirtioNet;
use super::stack::Stack;
use super::{Carve, Params};
use crate::abi::{self, STATUS_NET_FAILED};
use crate::ulib::{self, Line};

/// Bytes of each `udp-echo` request (a sequence number, then a pattern).
const UDP_PAYLOAD: usize = 64;
/// A `udp-echo` round without its reply by then counts as lost.
const UDP_ROUND_MS: u64 = 1000;
/// Tries at the untimed first exchange (it also resolves the host's MAC).
const UDP_WARMUP_TRIES: u32 = 3;
/// `tcp-send` gives up when no byte is acknowledged for this long.
const TCP_STALL_MS: u64 = 10_000;
const TCP_TX_BUFFER: usize = 256 * 1024;
/// How long a finished task goes on answering (the peer's FIN, late ACKs).
pub(super) const LINGER_MS: u64 = 200;
/// Connections `http-serve` holds at once (each a listening socket until a SYN takes it).
const HTTP_SOCKETS: usize = 16;
const HTTP_REQUEST_MAX: usize = 1024;
/// A connection still in its handshake after this (the client vanished after its SYN, or
/// the SYN-ACK cannot reach it) is dropped.
const HTTP_HANDSHAKE_MS: u64 = 2_000;
/// A connection that sends no complete request, or does not close, within this is dropped.
const HTTP_IDLE_MS: u64 = 5_000;
/// With every slot taken, the oldest connection that has not asked is given up for new
/// ones once it is this old: a client that means to ask has asked by then.
const HTTP_EVICT_AFTER_MS: u64 = 250;

pub(super) fn params(p: u64) -> Params {
    // SAFETY: the kernel copied a `Params` to this address at the end of the task's data
    // area (`user::run_task`), aligned, and nothing writes it while the task runs.
    unsafe { core::ptr::read(p as *const Params) }
}

pub(super) fn fail(name: &str, why: &str) -> ! {
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\"}}",
        name, why
    );
    l.send();
    ulib::exit(STATUS_NET_FAILED)
}

/// Ends the task with a failure line that carries the driver's counters.
pub(super) fn fail_with(name: &str, why: &str, net: &Stack, extra: &str) -> ! {
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\",{}",
        name, why, extra
    );
    net.counters(&mut l);
    l.push("}\n");
    l.send();
    ulib::exit(STATUS_NET_FAILED)
}

/// Brings the device up with room for `pairs` queue pairs and drives the calling CPU's.
pub(super) fn open(name: &str, mem: &mut Carve, pairs: u32) -> VirtioNet {
    match VirtioNet::open(mem, pairs) {
        Ok(d) => d,
        Err(crate::abi::Error::NoDevice) => fail(name, "no usable virtio-net device"),
        Err(e) => fail(name, e.name()),
    }
}

fn endpoint(p: &Params) -> IpEndpoint {
    let [a, b, c, d] = p.peer;
    IpEndpoint::new(IpAddress::Ipv4(Ipv4Address::new(a, b, c, d)), p.port)
}

/// An ephemeral port that differs from run to run, so a host still holding an old
/// connection's state does not confuse a new one; the next `MAX_PAIRS - 1` ports are free
/// for the other copies of a `procs=P` task.
pub(super) fn local_port() -> u16 {
    49152 + (ulib::rdtsc() % (16384 - abi::NET_MAX_PAIRS as u64)) as u16
}

/// Pairs a client task lays rings out for: one per CPU, so the task uses its CPU's pair.
/// Servers take one pair: the host's TAP puts a new connection on any queue.
pub(super) fn client_pairs() -> u32 {
    (ulib::cpu_count() as u32).clamp(1, abi::NET_MAX_PAIRS)
}

/// Polls and idles until `done` holds or `ms` pass; true if `done` held.
pub(super) fn run_until(
    net: &mut Stack,
    ms: u64,
    mut done: impl FnMut(&mut Stack) -> bool,
) -> bool {
    let t0 = ulib::rdtsc();
    loop {
        net.poll();
        if done(net) {
            return true;
        }
        let waited = net.us_since(t0);
        if waited >= ms * 1000 || net.out_of_time() {
            return false;
        }
        net.idle(ms * 1000 - waited);
    }
}

/// One request/response exchange: sends request `seq` and waits up to `ms` for its echo.
/// Replies to other requests (late ones) are dropped. Returns the round trip in TSC cycles.
fn udp_round(net: &mut Stack, h: SocketHandle, to: IpEndpoint, seq: u64, ms: u64) -> Option<u64> {
    let mut req = [0u8; UDP_PAYLOAD];
    req[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in req[8..].iter_mut().enumerate() {
        *b = (seq as u8).wrapping_add(i as u8);
    }
    let t0 = ulib::rdtsc();
    if net
        .sockets
        .get_mut::<udp::Socket>(h)
        .send_slice(&req, to)
        .is_err()
    {
        return None;
    }
    let mut got = false;
    let ok = run_until(net, ms, |net| {
        let s = net.sockets.get_mut::<udp::Socket>(h);
        let mut reply = [0u8; UDP_PAYLOAD + 1];
        while let Ok((n, _)) = s.recv_slice(&mut reply) {
            got |= n == UDP_PAYLOAD && reply[..UDP_PAYLOAD] == req;
        }
        got
    });
    ok.then(|| ulib::rdtsc() - t0)
}

/// The value at fraction `pct`/100 of the sorted `v` (nearest rank).
pub(super) fn percentile(v: &[u32], pct: usize) -> u32 {
    if v.is_empty() {
        return 0;
    }
    let rank = (v.len() * pct).div_ceil(100).max(1);
    v[rank - 1]
}

/// What `echo_rounds` did: rounds run, answered and lost, and their time.
pub(super) struct Echo {
    pub rounds: u64,
    pub done: usize,
    pub lost: u64,
    pub ns: u64,
}

/// The untimed first exchange (up to `UDP_WARMUP_TRIES`), then `p.count` timed rounds on
/// socket `h`, or fewer if the task's time runs out; the answered rounds' times (ns) go to
/// the front of `rtts`, sorted. `None` if the first exchange got no answer.
pub(super) fn echo_rounds(
    net: &mut Stack,
    h: SocketHandle,
    p: &Params,
    rtts: &mut [u32],
) -> Option<Echo> {
    let to = endpoint(p);
    let warm = (0..UDP_WARMUP_TRIES)
        .any(|i| udp_round(net, h, to, u64::MAX - i as u64, UDP_ROUND_MS).is_some());
    if !warm {
        return None;
    }
    let hz = net.hz;
    let t0 = ulib::rdtsc();
    let (mut done, mut lost) = (0usize, 0u64);
    let mut rounds = 0;
    while rounds < p.count && done < rtts.len() {
        if net.out_of_time() {
            break;
        }
        match udp_round(net, h, to, rounds, UDP_ROUND_MS) {
            Some(c) => {
                rtts[done] = (c as u128 * 1_000_000_000 / hz as u128).min(u32::MAX as u128) as u32;
                done += 1;
            }
            None => lost += 1,
        }
        rounds += 1;
    }
    let ns = ulib::cycles_to_ns(ulib::rdtsc() - t0, hz).max(1);
    rtts[..done].sort_unstable();
    Some(Echo {
        rounds,
        done,
        lost,
        ns,
    })
}

/// Bytes of each `udp-echo` socket buffer.
pub(super) const UDP_BUFFER: usize = 16 * 1024;

pub extern "C" fn udp_echo(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "udp-echo";
    let p = params(param);
    if p.procs > 1 {
        super::flows::udp_echo_procs(buf, len, param)
    }
    let mut mem = Carve::new(buf, len);
    let dev = open(NAME, &mut mem, client_pairs());
    let Some(rtts) = mem.slice(p.count as usize * 4) else {
        fail(NAME, "n=N does not fit the task buffer")
    };
    // SAFETY: `rtts` is 4-byte aligned (carved at a page boundary) and `count` u32s long.
    let rtts =
        unsafe { core::slice::from_raw_parts_mut(rtts.as_mut_ptr() as *mut u32, p.count as usize) };
    let (Some(rx), Some(tx)) = (mem.slice(UDP_BUFFER), mem.slice(UDP_BUFFER)) else {
        fail(NAME, "no memory for socket buffers")
    };
    let mut rx_meta = [udp::PacketMetadata::EMPTY; 16];
    let mut tx_meta = [udp::PacketMetadata::EMPTY; 16];
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, &p, &mut storage);
    let mut sock = udp::Socket::new(
        udp::PacketBuffer::new(&mut rx_meta[..], rx),
        udp::PacketBuffer::new(&mut tx_meta[..], tx),
    );
    if sock.bind(local_port()).is_err() {
        fail(NAME, "cannot bind a UDP port");
    }
    let h = net.sockets.add(sock);
    let Some(Echo {
        rounds,
        done,
        lost,
        ns,
    }) = echo_rounds(&mut net, h, &p, rtts)
    else {
        fail_with(NAME, "no reply from the echo server", &net, "")
    };
    let rtts = &rtts[..done];
    let us = |v: u32| v / 1000;
    let mut l = Line::new();
    let ok = rounds == p.count && done > 0;
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":{},\"rounds\":{},\"lost\":{},\"payload\":{},\"rate_per_s\":{},\"p50_us\":{},\"p99_us\":{},\"min_us\":{},\"max_us\":{},\"ns\":{},",
        NAME,
        ok,
        rounds,
        lost,
        UDP_PAYLOAD,
        done as u128 * 1_000_000_000 / ns as u128,
        us(percentile(rtts, 50)),
        us(percentile(rtts, 99)),
        us(rtts.first().copied().unwrap_or(0)),
        us(rtts.last().copied().unwrap_or(0)),
        ns
    );
    if rounds < p.count {
        l.push("\"error\":\"the task's time ran out\",");
    }
    net.counters(&mut l);
    l.push("}\n");
    l.send();
    ulib::exit(if ok { 0 } else { STATUS_NET_FAILED })
}

/// What one `tcp-send` flow did: bytes the host acknowledged, microseconds from connect
/// to the end, and why it failed if it did.
pub(super) struct Flow {
    pub acked: u64,
    pub us: u64,
    /// Of `us`, the time the driver polled its rings or was halted for the device.
    pub waited_us: u64,
    pub error: Option<&'static str>,
}

/// Connects socket `h` from `port` to the peer, sends `p.count` bytes of the stream and
/// closes; once the host has it all, goes on answering for a moment so the host closes
/// cleanly too.
pub(super) fn send_flow(net: &mut Stack, h: SocketHandle, p: &Params, port: u16) -> Flow {
    let t0 = ulib::rdtsc();
    let waited0 = net.dev.waited_cycles();
    let cx = net.iface.context();
    if net
        .sockets
        .get_mut::<tcp::Socket>(h)
        .connect(cx, endpoint(p), port)
        .is_err()
    {
        return Flow {
            acked: 0,
            us: 0,
            waited_us: 0,
            error: Some("cannot connect"),
        };
    }
    let total = p.count;
    let (mut sent, mut closing, mut established) = (0u64, false, false);
    let mut progress = (u64::MAX, usize::MAX);
    let mut last_progress = t0;
    let error = loop {
        net.poll();
        let s = net.sockets.get_mut::<tcp::Socket>(h);
        established |= s.state() == State::Established;
        while sent < total && s.can_send() {
            let want = (total - sent) as usize;
            let n = s
                .send(|b| {
                    let n = b.len().min(want);
                    ulib::stream_bytes(&mut b[..n], sent);
                    (n, n)
                })
                .unwrap_or(0);
            if n == 0 {
                break;
            }
            sent += n as u64;
        }
        if sent == total && !closing {
            s.close();
            closing = true;
        }
        let state = s.state();
        if closing && matches!(state, State::FinWait2 | State::TimeWait | State::Closed) {
            break None;
        }
        if state == State::Closed {
            break Some(if established {
                "connection reset"
            } else {
                "connection refused"
            });
        }
        let now = (sent, s.send_queue());
        if now != progress {
            progress = now;
            last_progress = ulib::rdtsc();
        } else if net.us_since(last_progress) > TCP_STALL_MS * 1000 {
            break Some("no progress for 10 s");
        }
        if net.out_of_time() {
            break Some("the task's time ran out");
        }
        net.idle(TCP_STALL_MS * 1000);
    };
    let us = net.us_since(t0).max(1);
    let waited_us = net.us_of(net.dev.waited_cycles() - waited0);
    let acked = sent - net.sockets.get_mut::<tcp::Socket>(h).send_queue() as u64;
    if error.is_none() {
        // Acknowledge the host's FIN, so the host side closes cleanly too.
        run_until(net, LINGER_MS, |net| {
            net.sockets.get_mut::<tcp::Socket>(h).state() == State::TimeWait
        });
    }
    Flow {
        acked,
        us,
        waited_us,
        error,
    }
}

/// A rate in Mbit/s with one decimal, as `(whole, tenths)`.
pub(super) fn mbit(bytes: u64, us: u64) -> (u128, u128) {
    let tenths = bytes as u128 * 80 / us.max(1) as u128;
    (tenths / 10, tenths % 10)
}

pub extern "C" fn tcp_send(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "tcp-send";
    let p = params(param);
    if p.procs > 1 {
        super::flows::tcp_send_procs(buf, len, param)
    }
    let mut mem = Carve::new(buf, len);
    let dev = open(NAME, &mut mem, client_pairs());
    let (Some(rx), Some(tx)) = (mem.slice(4096), mem.slice(TCP_TX_BUFFER)) else {
        fail(NAME, "no memory for socket buffers")
    };
    let mut storage = [SocketStorage::EMPTY; 1];
    let mut net = Stack::new(dev, &p, &mut storage);
    let h = net.sockets.add(tcp_socket(rx, tx));
    let total = p.count;
    let f = send_flow(&mut net, h, &p, local_port());
    if let Some(why) = f.error {
        let mut extra = Line::new();
        let _ = write!(
            extra,
            "\"bytes\":{},\"acked\":{},\"us\":{},",
            total, f.acked, f.us
        );
        fail_with(NAME, why, &net, extra.as_str());
    }
    let (whole, tenths) = mbit(total, f.us);
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":true,\"bytes\":{},\"mbit_per_s\":{}.{},\"us\":{},\"waited_us\":{},",
        NAME, total, whole, tenths, f.us, f.waited_us
    );
    net.counters(&mut l);
    l.push("}\n");
    l.send();
    ulib::exit(0)
}

/// The `tcp-send` socket on `rx` and `tx` (its buffers).
pub(super) fn tcp_socket(rx: &'static mut [u8], tx: &'static mut [u8]) -> tcp::Socket<'static> {
    tcp::Socket::new(tcp::SocketBuffer::new(rx), tcp::SocketBuffer::new(tx))
}

/// Bytes of the `tcp-send` socket's transmit buffer.
pub(super) const TCP_TX_BYTES: usize = TCP_TX_BUFFER;

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Listening,
    /// Taken by a SYN: in the handshake, or reading the request.
    Reading,
    Closing {
        get: bool,
    },
    /// Aborted: the reset goes out with the next poll, then the socket listens again.
    Dropped,
}

/// One `http-serve` connection slot.
#[derive(Clone, Copy)]
struct Conn {
    handle: SocketHandle,
    phase: Phase,
    since: u64,
    req: [u8; HTTP_REQUEST_MAX],
    len: usize,
}

impl Conn {
    /// How readily this slot is given up for a new connection when every slot is taken
    /// (lower first), and since when; `None` for one that must run its course: a served
    /// GET being closed counts only once closed.
    fn eviction_rank(&self, s: &tcp::Socket) -> Option<(u8, u64)> {
        let rank = match self.phase {
            Phase::Listening | Phase::Dropped | Phase::Closing { get: true } => return None,
            Phase::Reading if s.state() == State::SynReceived => 0,
            Phase::Reading => 1,
            Phase::Closing { get: false } => 2,
        };
        Some((rank, self.since))
    }
}

/// The path of a request line `GET /path HTTP/1.1`, if the request is a GET.
fn get_path(req: &[u8]) -> Option<&[u8]> {
    let line = req.split(|&b| b == b'\r' || b == b'\n').next()?;
    let mut words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
    (words.next()? == b"GET").then_some(())?;
    words.next()
}

/// Queues the response to the request read so far; true if it was a GET.
fn respond(s: &mut tcp::Socket, req: &[u8]) -> bool {
    let mut head = Line::new();
    let mut body = Line::new();
    let path = get_path(req);
    match path {
        Some(path) => {
            let path = &path[..path.len().min(512)];
            body.push("musubi probe: ");
            for &b in path {
                let c = if b.is_ascii_graphic() { b } else { b'?' };
                body.push(core::str::from_utf8(&[c]).unwrap_or("?"));
            }
            body.push("\n");
            head.push("HTTP/1.1 200 OK\r\n");
        }
        None => {
            body.push("musubi probe: only GET\n");
            head.push("HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\n");
        }
    }
    let _ = write!(
        head,
        "Content-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.as_str().len()
    );
    let _ = s.send_slice(head.as_str().as_bytes());
    let _ = s.send_slice(body.as_str().as_bytes());
    s.close();
    path.is_some()
}

/// Aborts the connection in slot `c`; it listens again after the next poll.
fn drop_conn(s: &mut tcp::Socket, c: &mut Conn) {
    s.abort();
    c.phase = Phase::Dropped;
}

/// Advances one connection; returns 1 when it has finished serving a GET. Every phase but
/// listening is bounded in time, so a client that opens and then goes quiet, or vanishes
/// mid-handshake, frees its slot.
fn step(net: &mut Stack, c: &mut Conn, port: u16) -> u64 {
    let now = ulib::rdtsc();
    let age_ms = net.us_since(c.since) / 1000;
    let s = net.sockets.get_mut::<tcp::Socket>(c.handle);
    match c.phase {
        Phase::Listening => {
            if s.state() != State::Listen {
                c.phase = Phase::Reading;
                c.since = now;
                c.len = 0;
            }
            0
        }
        Phase::Dropped => {
            // Closed since the abort (a closed socket takes no packets); `listen` also
            // forgets a reset that could not be sent.
            let _ = s.listen(port);
            c.phase = Phase::Listening;
            0
        }
        Phase::Reading => {
            let state = s.state();
            if state == State::Listen {
                // A reset during the handshake puts smoltcp's socket back to listening.
                c.phase = Phase::Listening;
                return 0;
            }
            if s.can_recv() {
                if let Ok(n) = s.recv_slice(&mut c.req[c.len..]) {
                    c.len += n;
                }
            }
            let got = &c.req[..c.len];
            let whole = got.windows(4).any(|w| w == b"\r\n\r\n") || c.len == HTTP_REQUEST_MAX;
            if whole || (!s.may_recv() && c.len > 0) {
                let get = respond(s, got);
                c.phase = Phase::Closing { get };
                c.since = now;
            } else if !s.is_open()
                // Closed by the client before it asked anything: nothing to answer.
                || (!s.may_recv() && state != State::SynReceived)
                || (state == State::SynReceived && age_ms > HTTP_HANDSHAKE_MS)
                || age_ms > HTTP_IDLE_MS
            {
                drop_conn(s, c);
            }
            0
        }
        Phase::Closing { get } => {
            let state = s.state();
            let finished = matches!(state, State::TimeWait | State::Closed);
            if finished || age_ms > HTTP_IDLE_MS {
                let served = get && (finished || state == State::FinWait2);
                drop_conn(s, c);
                return served as u64;
            }
            0
        }
    }
}

/// With every slot taken, a new SYN would be refused: gives up the slot least likely to
/// be a client about to ask (a handshake first, then a connection yet to send its
/// request, then one being closed; the oldest of each, and none younger than
/// `HTTP_EVICT_AFTER_MS`), so a flood of connections that never ask cannot lock other
/// clients out for the length of the timeouts.
fn keep_one_listening(net: &mut Stack, conns: &mut [Conn]) {
    let mut victim: Option<(usize, (u8, u64))> = None;
    for (i, c) in conns.iter().enumerate() {
        let s = net.sockets.get::<tcp::Socket>(c.handle);
        if matches!(c.phase, Phase::Listening | Phase::Dropped) || s.state() == State::Listen {
            return;
        }
        let settled = net.us_since(c.since) > HTTP_EVICT_AFTER_MS * 1000;
        if let Some(r) = c.eviction_rank(s).filter(|_| settled) {
            if victim.is_none_or(|(_, best)| r < best) {
                victim = Some((i, r));
            }
        }
    }
    if let Some((i, _)) = victim {
        let c = &mut conns[i];
        drop_conn(net.sockets.get_mut::<tcp::Socket>(c.handle), c);
    }
}

pub extern "C" fn http_serve(buf: u64, len: u64, param: u64) -> ! {
    const NAME: &str = "http-serve";
    let p = params(param);
    let mut mem = Carve::new(buf, len);
    let dev = open(NAME, &mut mem, 1);
    let mut storage = [SocketStorage::EMPTY; HTTP_SOCKETS];
    let mut net = Stack::new(dev, &p, &mut storage);
    let mut conns = [Conn {
        handle: SocketHandle::default(),
        phase: Phase::Listening,
        since: 0,
        req: [0; HTTP_REQUEST_MAX],
        len: 0,
    }; HTTP_SOCKETS];
    for c in conns.iter_mut() {
        let (Some(rx), Some(tx)) = (mem.slice(4096), mem.slice(4096)) else {
            fail(NAME, "no memory for socket buffers")
        };
        let mut s = tcp::Socket::new(tcp::SocketBuffer::new(rx), tcp::SocketBuffer::new(tx));
        if s.listen(p.port).is_err() {
            fail(NAME, "cannot listen on the port");
        }
        c.handle = net.sockets.add(s);
    }
    let mut l = Line::new();
    let _ = writeln!(l, "probe: http-serve: listening on port {}", p.port);
    l.send();
    let mut served = 0;
    while served < p.count {
        net.poll();
        for c in conns.iter_mut() {
            served += step(&mut net, c, p.port);
        }
        keep_one_listening(&mut net, &mut conns);
        if net.out_of_time() {
            let mut extra = Line::new();
            let _ = write!(
                extra,
                "\"port\":{},\"served\":{},\"wanted\":{},",
                p.port, served, p.count
            );
            fail_with(NAME, "the task's time ran out", &net, extra.as_str());
        }
        net.idle(HTTP_IDLE_MS * 1000);
    }
    run_until(&mut net, LINGER_MS, |_| false);
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"{}\",\"ok\":true,\"port\":{},\"served\":{},",
        NAME, p.port, served
    );
    net.counters(&mut l);
    l.push("}\n");
    l.send();
    ulib::exit(0)
}
