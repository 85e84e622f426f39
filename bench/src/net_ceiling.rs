//! The no-VM ceiling of `bench net`: the probe guest's `udp-echo` and `tcp-send` loads run
//! by a client thread of this program on a veth, against the same echo and sink the VMMs
//! reach through the TAP, so each VMM's figures read as a fraction of what the host does
//! without a guest.
//!
//! The client's end of the veth is in a network namespace of its own thread's making
//! (`unshare(CLONE_NEWNET)`: nameless, gone with the thread); the other end is in the
//! bench's namespace, where the echo and sink listen on every address. Nothing is added to
//! the host's own namespace.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpStream, UdpSocket};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::stats::percentile;

/// The bench namespace's end of the veth and its address.
const NEAR: &str = "ceil0";
const NEAR_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 1);
/// The client namespace's end and its address.
const FAR: &str = "ceil1";
const FAR_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
/// Bytes of a request, as the guest's `udp-echo` sends.
const UDP_PAYLOAD: usize = 64;
/// A round without its reply by then is lost, as in the guest.
const ROUND: Duration = Duration::from_secs(1);
/// How long the client polls for a reply before it sleeps in `recv`: the probe guest's
/// driver polls as long (its `probe.virtio_poll_us` default) before it halts, so the
/// ceiling's client waits as the guests do, not with a wake-up of its own per round that
/// none of the VMs' rows has.
const POLL: Duration = Duration::from_micros(300);
/// Tries at the untimed first exchange, as in the guest (it also resolves the MAC).
const WARMUP_TRIES: u64 = 3;
/// The stream gives up when nothing moves for this long (the guest's `tcp-send` limit).
const STALL: Duration = Duration::from_secs(10);

/// The client's `udp-echo` figures, as the guest reports them.
#[derive(Clone, Copy, Debug)]
pub struct Udp {
    pub rounds: u64,
    pub lost: u64,
    pub rate_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// `rounds` request/response rounds of 64 bytes with the echo on `port` of the bench's
/// namespace `ns`, each waiting for its own reply.
pub fn udp(ns: &str, port: u16, rounds: u64) -> Result<Udp, String> {
    in_client_namespace(ns, move || udp_rounds(port, rounds))
}

/// Streams `bytes` (byte i = i mod 251) to the sink on `port` and waits for the sink's
/// close; Mbit/s from connect to that close, as the guest's `tcp-send` measures to its FIN
/// being acknowledged.
pub fn tcp(ns: &str, port: u16, bytes: u64) -> Result<f64, String> {
    in_client_namespace(ns, move || tcp_stream(port, bytes))
}

fn udp_rounds(port: u16, n: u64) -> Result<Udp, String> {
    let err = |e: std::io::Error| format!("the no-VM UDP client: {e}");
    let s = UdpSocket::bind((FAR_ADDR, 0)).map_err(err)?;
    s.connect((NEAR_ADDR, port)).map_err(err)?;
    let warm = (0..WARMUP_TRIES).any(|i| round(&s, u64::MAX - i).is_some());
    if !warm {
        return Err(format!(
            "the no-VM UDP client had no reply from the echo on {NEAR_ADDR}:{port}"
        ));
    }
    let t0 = Instant::now();
    let mut rtts = Vec::with_capacity(n as usize);
    for seq in 0..n {
        if let Some(rtt) = round(&s, seq) {
            rtts.push(rtt.as_nanos() as f64 / 1000.0);
        }
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    // The guest reports whole microseconds.
    let pct = |p: f64| percentile(&rtts, p).map_or(0.0, f64::floor);
    Ok(Udp {
        rounds: n,
        lost: n - rtts.len() as u64,
        rate_per_s: rtts.len() as f64 / secs,
        p50_us: pct(50.0),
        p99_us: pct(99.0),
    })
}

/// Sends request `seq` and waits for its echo; replies to other requests are dropped.
fn round(s: &UdpSocket, seq: u64) -> Option<Duration> {
    let mut req = [0u8; UDP_PAYLOAD];
    req[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in req[8..].iter_mut().enumerate() {
        *b = (seq as u8).wrapping_add(i as u8);
    }
    s.set_nonblocking(true).ok()?;
    let t0 = Instant::now();
    s.send(&req).ok()?;
    let mut reply = [0u8; UDP_PAYLOAD + 1];
    let mut polling = true;
    loop {
        if polling && t0.elapsed() >= POLL {
            polling = false;
            s.set_nonblocking(false).ok()?;
        }
        if !polling {
            let left = ROUND.checked_sub(t0.elapsed())?;
            s.set_read_timeout(Some(left.max(Duration::from_micros(1))))
                .ok()?;
        }
        match s.recv(&mut reply) {
            Ok(n) if n == UDP_PAYLOAD && reply[..n] == req => return Some(t0.elapsed()),
            Ok(_) => {}
            Err(e) if polling && e.kind() == std::io::ErrorKind::WouldBlock => {
                std::hint::spin_loop()
            }
            Err(_) => return None,
        }
    }
}

fn tcp_stream(port: u16, bytes: u64) -> Result<f64, String> {
    let err = |e: std::io::Error| format!("the no-VM TCP client: {e}");
    let to = SocketAddrV4::new(NEAR_ADDR, port);
    let t0 = Instant::now();
    let mut s = TcpStream::connect_timeout(&to.into(), STALL).map_err(err)?;
    s.set_write_timeout(Some(STALL)).map_err(err)?;
    s.set_read_timeout(Some(STALL)).map_err(err)?;
    const CHUNK: usize = 1 << 16;
    let pattern: Vec<u8> = (0..CHUNK + 251).map(|i| (i % 251) as u8).collect();
    let mut sent = 0u64;
    while sent < bytes {
        let at = (sent % 251) as usize;
        let n = (bytes - sent).min(CHUNK as u64) as usize;
        let wrote = s.write(&pattern[at..at + n]).map_err(err)?;
        sent += wrote as u64;
    }
    s.shutdown(Shutdown::Write).map_err(err)?;
    // The sink closes once it has read the whole stream.
    match s.read(&mut [0u8; 64]) {
        Ok(0) => {}
        Ok(_) => return Err("the TCP sink answered with data".into()),
        Err(e) => return Err(format!("the no-VM TCP client waited for the close: {e}")),
    }
    let us = t0.elapsed().as_micros().max(1) as f64;
    Ok(bytes as f64 * 8.0 / us)
}

/// Runs `f` on a thread in a fresh network namespace joined to the bench's namespace `ns`
/// by a veth (10.0.1.2 there, 10.0.1.1 on the bench's side); the link is deleted after.
fn in_client_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let (tid_tx, tid_rx) = mpsc::channel::<Result<libc::pid_t, String>>();
    let (go_tx, go_rx) = mpsc::channel::<bool>();
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) moves only the calling thread into a new network namespace;
        // gettid(2) has no preconditions.
        let tid = unsafe {
            if libc::unshare(libc::CLONE_NEWNET) != 0 {
                let e = std::io::Error::last_os_error();
                let _ = tid_tx.send(Err(format!("unshare(CLONE_NEWNET): {e}")));
                return Err(format!("unshare(CLONE_NEWNET): {e}"));
            }
            libc::gettid()
        };
        let _ = tid_tx.send(Ok(tid));
        if go_rx.recv() != Ok(true) {
            return Err("the veth to the bench's namespace was not made".into());
        }
        // `ip` started from this thread runs in its namespace.
        let addr = format!("{FAR_ADDR}/24");
        ip(&["link", "set", "lo", "up"])?;
        ip(&["addr", "add", &addr, "dev", FAR])?;
        ip(&["link", "set", FAR, "up"])?;
        f()
    });
    let link = tid_rx
        .recv()
        .map_err(|_| "the no-VM client thread ended at once".to_string())
        .and_then(|tid| Veth::new(ns, tid?));
    let _ = go_tx.send(link.is_ok());
    let result = thread
        .join()
        .unwrap_or_else(|_| Err("the no-VM client thread panicked".into()));
    // The thread's error says more than "not made" when the link failed.
    link.and(result)
}

/// The veth between the bench's namespace and a client thread's, deleted when dropped (a
/// namespace going away removes its links only later, and the next run makes the link
/// again under the same name).
struct Veth {
    ns: String,
}

impl Veth {
    fn new(ns: &str, client_tid: libc::pid_t) -> Result<Veth, String> {
        ip(&[
            "-n", ns, "link", "add", NEAR, "type", "veth", "peer", "name", FAR,
        ])?;
        let v = Veth { ns: ns.into() };
        let addr = format!("{NEAR_ADDR}/24");
        ip(&["-n", ns, "addr", "add", &addr, "dev", NEAR])?;
        ip(&["-n", ns, "link", "set", NEAR, "up"])?;
        // A thread's id names its network namespace as a process id does.
        ip(&[
            "-n",
            ns,
            "link",
            "set",
            FAR,
            "netns",
            &client_tid.to_string(),
        ])?;
        Ok(v)
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        let _ = testkit::netns::try_ip(&["-n", &self.ns, "link", "delete", NEAR]);
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    testkit::netns::try_ip(args)
        .map(drop)
        .map_err(|e| e.to_string())
}
