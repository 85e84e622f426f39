//! A node's front door while the nodes link up: every handshake runs on a thread of its own
//! under a short deadline, and a connection that fails it is refused, logged and forgotten
//! while the node goes on waiting for its real peers, so a stranger can neither stop a VM's
//! start nor hold it up.
//!
//! What a stranger may cost is bounded three ways: handshakes in progress at once
//! ([`DoorLimits::half_open`]), bytes read from it before it has proved the secret
//! ([`crate::link::HANDSHAKE_READ`], fixed by the handshake's layout) and refusals logged one
//! by one per second ([`DoorLimits::logged_per_second`]). Only a peer that has proved the
//! secret can end the linking with an error, and only by running another VM configuration:
//! that is a set-up fault of the cluster, not a stranger.

use crate::link::{Link, LinkError, LinkParams, Role};
use crate::transport::{node_list, TransportError};
use dsm::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What strangers may cost a node that is linking up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DoorLimits {
    /// Handshakes in progress at once. A connection past this is closed unread; a real peer
    /// that meets a full door dials again until its connect deadline.
    pub half_open: usize,
    /// Longest one connection may take from being accepted to a finished handshake. A real
    /// peer needs two round trips, so this can be short against the connect deadline; it is
    /// what a silent or dribbling stranger holds a slot for.
    pub handshake: Duration,
    /// Refusals logged one by one in a second; the rest of that second are counted in one line.
    pub logged_per_second: u32,
}

impl Default for DoorLimits {
    fn default() -> DoorLimits {
        DoorLimits {
            half_open: 16,
            handshake: Duration::from_secs(2),
            logged_per_second: 10,
        }
    }
}

/// Why a connection could not even start its handshake: a host call on its stream failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
struct AnswerError {
    what: &'static str,
    source: std::io::Error,
}

/// A connection turned away while linking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub addr: SocketAddr,
    pub why: String,
}

/// The refusals of one linking: every one counted, the first [`KEPT_REFUSALS`] kept.
#[derive(Clone, Debug, Default)]
pub struct Refusals {
    pub count: usize,
    pub kept: Vec<Refusal>,
}

/// Refusals kept for the caller to read; later ones are only counted.
pub const KEPT_REFUSALS: usize = 64;

/// How often the door looks at the clock when nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// Pause between dials to a peer whose door was full or not open yet.
const REDIAL: Duration = Duration::from_millis(20);

/// What a dialing or answering thread reports.
enum Arrival {
    Dialed {
        peer: NodeId,
        result: Result<Link, TransportError>,
    },
    Answered {
        conn: u64,
        addr: SocketAddr,
        result: Result<Link, LinkError>,
    },
}

/// A handshake in progress on the listening side.
struct HalfOpen {
    since: Instant,
    /// Another handle on the socket, to cut a handshake that outlives its deadline.
    socket: TcpStream,
    cut: bool,
    thread: JoinHandle<()>,
}

/// Sends arrivals and wakes the door's poll.
#[derive(Clone)]
struct Bell {
    tx: mpsc::Sender<Arrival>,
    ring: Arc<UnixStream>,
}

impl Bell {
    fn send(&self, a: Arrival) {
        if self.tx.send(a).is_ok() {
            // A full buffer already means "look".
            let _ = (&*self.ring).write(&[1]);
        }
    }
}

/// The channel handshake threads report on, and the pipe that wakes the door's poll.
struct Doorbell {
    bell: Bell,
    arrivals: mpsc::Receiver<Arrival>,
    wake: UnixStream,
}

impl Doorbell {
    fn new(listener: &TcpListener, waiting: &[NodeId]) -> Result<Doorbell, TransportError> {
        let (tx, arrivals) = mpsc::channel();
        let (ring, wake) =
            UnixStream::pair().map_err(accept_err(waiting, "making a wake-up pipe"))?;
        wake.set_nonblocking(true)
            .map_err(accept_err(waiting, "making a wake-up pipe"))?;
        listener
            .set_nonblocking(true)
            .map_err(accept_err(waiting, "making the listener non-blocking"))?;
        Ok(Doorbell {
            bell: Bell {
                tx,
                ring: Arc::new(ring),
            },
            arrivals,
            wake,
        })
    }
}

/// Links with every peer: dials the ones in `dial` and waits at `listener` for the ones in
/// `answer`, all at once, until each is linked or `deadline` passes.
pub(crate) fn link_all(
    params: &LinkParams,
    dial: &[(NodeId, SocketAddr)],
    answer: &[NodeId],
    listener: &TcpListener,
    limits: DoorLimits,
    deadline: Instant,
) -> Result<(BTreeMap<NodeId, Link>, Refusals), TransportError> {
    let Doorbell {
        bell,
        arrivals: rx,
        mut wake,
    } = Doorbell::new(listener, answer)?;
    let giving_up = Arc::new(AtomicBool::new(false));
    let mut door = Door::new(
        params,
        limits,
        answer,
        dial.iter().map(|d| d.0).collect(),
        RefusalLog::new(
            format!("node {}", params.me),
            "while linking",
            limits,
            Box::new(|line: &str| tracing::warn!("{line}")),
        ),
    );
    for &(peer, addr) in dial {
        let (p, bell, stop) = (params.clone(), bell.clone(), Arc::clone(&giving_up));
        std::thread::Builder::new()
            .name(format!("dsm-dial-{}", peer.0))
            .spawn(move || {
                let result = dial_and_link(peer, addr, &p, deadline, &stop);
                bell.send(Arrival::Dialed { peer, result });
            })
            .map_err(|source| TransportError::Spawn { peer, source })?;
    }
    if let Ok(at) = listener.local_addr() {
        tracing::info!(
            "node {} waits at {at} for {}",
            params.me,
            if answer.is_empty() {
                "no node".to_string()
            } else {
                node_list(&door.waiting)
            }
        );
    }
    let mut give_up = GiveUp {
        deadline: Some(deadline),
        stop: None,
    };
    let outcome = door.run(listener, &bell, &rx, &mut wake, &mut give_up);
    giving_up.store(true, Ordering::SeqCst);
    door.close_half_open(&rx);
    door.log.flush();
    outcome.map(|()| (door.links, door.log.refusals))
}

/// Waits at `listener` for `peer` alone to prove the secret, as [`link_all`] waits
/// (strangers refused and logged, handshakes on threads of their own under `limits`), until
/// `stop` gives a reason to give up (asked between waits). `who` names this end in the lines
/// `log` is given. A migration's destination waits for its source this way.
pub fn accept_one(
    params: &LinkParams,
    peer: NodeId,
    listener: &TcpListener,
    limits: DoorLimits,
    who: &str,
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<(Link, Refusals), TransportError> {
    let Doorbell {
        bell,
        arrivals,
        mut wake,
    } = Doorbell::new(listener, &[peer])?;
    let mut door = Door::new(
        params,
        limits,
        &[peer],
        BTreeSet::new(),
        RefusalLog::new(
            who.to_string(),
            "while waiting for a VM",
            limits,
            Box::new(log),
        ),
    );
    let mut give_up = GiveUp {
        deadline: None,
        stop: Some(stop),
    };
    let outcome = door.run(listener, &bell, &arrivals, &mut wake, &mut give_up);
    door.close_half_open(&arrivals);
    door.log.flush();
    outcome?;
    let link = door
        .links
        .remove(&peer)
        .ok_or(TransportError::NoPeer(peer))?;
    Ok((link, door.log.refusals))
}

/// When a door stops waiting for its peers.
struct GiveUp<'s> {
    deadline: Option<Instant>,
    /// Asked between waits; a reason ends the wait.
    stop: Option<&'s mut dyn FnMut() -> Option<String>>,
}

fn accept_err<'a>(
    waiting: &'a [NodeId],
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> TransportError + 'a {
    move |source| TransportError::Accept {
        missing: waiting.to_vec(),
        what,
        source,
    }
}

struct Door<'a, 's> {
    params: &'a LinkParams,
    limits: DoorLimits,
    links: BTreeMap<NodeId, Link>,
    /// Peers expected to dial in and not linked yet.
    waiting: BTreeSet<NodeId>,
    /// Peers this node dials whose outcome has not come yet.
    dialing: BTreeSet<NodeId>,
    half_open: BTreeMap<u64, HalfOpen>,
    next_conn: u64,
    log: RefusalLog<'s>,
}

impl<'a, 's> Door<'a, 's> {
    fn new(
        params: &'a LinkParams,
        limits: DoorLimits,
        answer: &[NodeId],
        dialing: BTreeSet<NodeId>,
        log: RefusalLog<'s>,
    ) -> Door<'a, 's> {
        Door {
            params,
            limits,
            links: BTreeMap::new(),
            waiting: answer.iter().copied().collect(),
            dialing,
            half_open: BTreeMap::new(),
            next_conn: 0,
            log,
        }
    }

    fn run(
        &mut self,
        listener: &TcpListener,
        bell: &Bell,
        arrivals: &mpsc::Receiver<Arrival>,
        wake: &mut UnixStream,
        give_up: &mut GiveUp,
    ) -> Result<(), TransportError> {
        loop {
            if let Some(why) = give_up.stop.as_mut().and_then(|stop| stop()) {
                return Err(TransportError::Stopped(why));
            }
            let mut sink = [0u8; 64];
            while matches!(wake.read(&mut sink), Ok(n) if n > 0) {}
            while let Ok(a) = arrivals.try_recv() {
                self.arrived(a)?;
            }
            if self.waiting.is_empty() && self.dialing.is_empty() {
                return Ok(());
            }
            self.cut_overdue();
            let now = Instant::now();
            if give_up.deadline.is_some_and(|d| now >= d) {
                return Err(self.not_linked());
            }
            self.accept(listener, bell)?;
            let next = self
                .half_open
                .values()
                .filter(|h| !h.cut)
                .map(|h| h.since + self.limits.handshake)
                .chain(give_up.deadline)
                .min()
                .unwrap_or(now + TICK);
            let wait = next.saturating_duration_since(now).min(TICK);
            wait_readable(&[listener.as_raw_fd(), wake.as_raw_fd()], wait);
        }
    }

    /// Takes every connection waiting at the listener.
    fn accept(&mut self, listener: &TcpListener, bell: &Bell) -> Result<(), TransportError> {
        loop {
            let (stream, addr) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted | ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    let waiting: Vec<NodeId> = self.waiting.iter().copied().collect();
                    return Err(accept_err(&waiting, "accepting")(e));
                }
            };
            if !self.waiting.is_empty() && self.half_open.len() < self.limits.half_open {
                if let Err(why) = self.answer(stream, addr, bell) {
                    self.log.refuse(addr, why.to_string());
                }
            } else if self.waiting.is_empty() {
                self.log
                    .refuse(addr, "no peer of this node is expected to dial in".into());
            } else {
                self.log.refuse(
                    addr,
                    format!(
                        "{} handshakes already in progress, the most this node serves at once",
                        self.half_open.len()
                    ),
                );
            }
        }
    }

    /// Starts the handshake with a connection on a thread of its own.
    fn answer(
        &mut self,
        stream: TcpStream,
        addr: SocketAddr,
        bell: &Bell,
    ) -> Result<(), AnswerError> {
        let failed = |what| move |source| AnswerError { what, source };
        stream
            .set_nonblocking(false)
            .map_err(failed("making its stream blocking"))?;
        let socket = stream.try_clone().map_err(failed("cloning its stream"))?;
        let conn = self.next_conn;
        self.next_conn += 1;
        let mut p = self.params.clone();
        p.timeout = self.limits.handshake;
        let bell = bell.clone();
        let thread = std::thread::Builder::new()
            .name("dsm-door".into())
            .spawn(move || {
                let result = Link::handshake(stream, Role::Listener, None, &p);
                bell.send(Arrival::Answered { conn, addr, result });
            })
            .map_err(failed("starting its handshake thread"))?;
        self.half_open.insert(
            conn,
            HalfOpen {
                since: Instant::now(),
                socket,
                cut: false,
                thread,
            },
        );
        Ok(())
    }

    fn arrived(&mut self, a: Arrival) -> Result<(), TransportError> {
        match a {
            Arrival::Dialed { peer, result } => {
                self.dialing.remove(&peer);
                let link = result?;
                tracing::info!(
                    "node {} linked with {peer} at {}",
                    self.params.me,
                    link.addr
                );
                self.links.insert(peer, link);
            }
            Arrival::Answered { conn, addr, result } => {
                let cut = match self.half_open.remove(&conn) {
                    Some(h) => {
                        let _ = h.thread.join();
                        h.cut
                    }
                    None => false,
                };
                match result {
                    Ok(link) => self.linked(link),
                    Err(e @ LinkError::ConfigMismatch { .. }) => return Err(e.into()),
                    Err(e) if cut || timed_out(&e) => self.log.refuse(
                        addr,
                        format!(
                            "no complete handshake within {} ms",
                            self.limits.handshake.as_millis()
                        ),
                    ),
                    Err(e) => self.log.refuse(addr, e.to_string()),
                }
            }
        }
        Ok(())
    }

    /// A peer that proved the secret: linked if it is one this node waits for.
    fn linked(&mut self, link: Link) {
        let (peer, addr) = (link.peer, link.addr);
        if self.waiting.remove(&peer) {
            tracing::info!("node {} linked with {peer} at {addr}", self.params.me);
            self.links.insert(peer, link);
        } else if self.links.contains_key(&peer) || self.dialing.contains(&peer) {
            self.log.refuse(
                addr,
                format!("it proved the secret as node {peer}, which is already linked"),
            );
        } else {
            self.log.refuse(
                addr,
                format!(
                    "it proved the secret as node {peer}, but this node waits for {}",
                    node_list(&self.waiting)
                ),
            );
        }
    }

    /// Cuts the handshakes that outlived their deadline; their threads then report.
    fn cut_overdue(&mut self) {
        for h in self.half_open.values_mut() {
            if !h.cut && h.since.elapsed() >= self.limits.handshake {
                let _ = h.socket.shutdown(Shutdown::Both);
                h.cut = true;
            }
        }
    }

    /// Ends the handshakes still in progress and accounts for every connection accepted:
    /// each has then either linked or been refused.
    fn close_half_open(&mut self, arrivals: &mpsc::Receiver<Arrival>) {
        let open = std::mem::take(&mut self.half_open);
        for h in open.values() {
            let _ = h.socket.shutdown(Shutdown::Both);
        }
        let mut ended = BTreeSet::new();
        for (conn, h) in open {
            let _ = h.thread.join();
            ended.insert(conn);
        }
        for a in arrivals.try_iter() {
            match a {
                Arrival::Answered { conn, addr, .. } if ended.contains(&conn) => {
                    self.log
                        .refuse(addr, "still in its handshake when linking ended".into());
                }
                Arrival::Answered {
                    addr,
                    result: Ok(link),
                    ..
                } => self.log.refuse(
                    addr,
                    format!("it proved the secret as node {} after linking", link.peer),
                ),
                Arrival::Answered {
                    addr,
                    result: Err(e),
                    ..
                } => self.log.refuse(addr, e.to_string()),
                Arrival::Dialed { .. } => {}
            }
        }
    }

    fn not_linked(&self) -> TransportError {
        let mut missing: Vec<NodeId> = self.waiting.iter().copied().collect();
        missing.extend(self.dialing.iter().copied());
        missing.sort();
        TransportError::NotLinked {
            missing,
            refused: self.log.refusals.count,
            last: self.log.last.clone(),
        }
    }
}

/// Whether a handshake ended because a read or write waited past its timeout, which is the
/// handshake's deadline on the listening side.
fn timed_out(e: &LinkError) -> bool {
    matches!(e, LinkError::Io { source, .. }
        if matches!(source.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
}

/// Waits until one of `fds` is readable or `wait` passes.
fn wait_readable(fds: &[std::os::fd::RawFd], wait: Duration) {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `polls` is a live array of `polls.len()` pollfd structures, which poll(2) only
    // writes the `revents` of.
    unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, ms) };
}

/// Dials `peer` and runs the handshake, again while its door is full, closed or not open
/// yet, until `deadline`. A peer that answers but fails the handshake is an error at once:
/// it is the address the cluster names for that node.
fn dial_and_link(
    peer: NodeId,
    addr: SocketAddr,
    params: &LinkParams,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Link, TransportError> {
    loop {
        let stream = crate::transport::dial(peer, addr, deadline)?;
        let mut p = params.clone();
        p.timeout = deadline
            .saturating_duration_since(Instant::now())
            .min(params.timeout)
            .max(Duration::from_millis(1));
        match Link::handshake(stream, Role::Dialer, Some(peer), &p) {
            Ok(link) => return Ok(link),
            Err(LinkError::Closed { .. } | LinkError::Io { .. })
                if Instant::now() + REDIAL < deadline && !stop.load(Ordering::SeqCst) =>
            {
                std::thread::sleep(REDIAL);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Logs refusals, at most `limit` one by one per second, and keeps them for the caller.
struct RefusalLog<'s> {
    /// Where the lines go.
    sink: Box<dyn FnMut(&str) + 's>,
    /// This end, as the log names it ("node n0").
    who: String,
    /// What this end was doing ("while linking").
    during: &'static str,
    limit: u32,
    window: Instant,
    logged: u32,
    held: u64,
    last: Option<Refusal>,
    refusals: Refusals,
}

impl<'s> RefusalLog<'s> {
    fn new(
        who: String,
        during: &'static str,
        limits: DoorLimits,
        sink: Box<dyn FnMut(&str) + 's>,
    ) -> RefusalLog<'s> {
        RefusalLog {
            sink,
            who,
            during,
            limit: limits.logged_per_second,
            window: Instant::now(),
            logged: 0,
            held: 0,
            last: None,
            refusals: Refusals::default(),
        }
    }

    fn refuse(&mut self, addr: SocketAddr, why: String) {
        self.record(addr, why);
    }

    /// Records a refusal; true if it was logged one by one.
    fn record(&mut self, addr: SocketAddr, why: String) -> bool {
        if self.window.elapsed() >= Duration::from_secs(1) {
            self.flush();
            self.window = Instant::now();
            self.logged = 0;
        }
        let logged = self.logged < self.limit;
        if logged {
            let line = format!("{} refused {addr} {}: {why}", self.who, self.during);
            (self.sink)(&line);
            self.logged += 1;
        } else {
            self.held += 1;
        }
        let r = Refusal { addr, why };
        self.refusals.count += 1;
        if self.refusals.kept.len() < KEPT_REFUSALS {
            self.refusals.kept.push(r.clone());
        }
        self.last = Some(r);
        logged
    }

    fn flush(&mut self) {
        if self.held > 0 {
            let line = format!(
                "{} refused {} more connections in that second (not logged one by one)",
                self.who, self.held
            );
            (self.sink)(&line);
            self.held = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_past_the_rate_are_counted_not_logged_and_all_are_reported() {
        let limits = DoorLimits {
            logged_per_second: 5,
            ..DoorLimits::default()
        };
        let mut log = RefusalLog::new("node n0".into(), "while linking", limits, Box::new(|_| {}));
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let logged = (0..100)
            .filter(|i| log.record(addr, format!("stranger {i}")))
            .count();
        assert_eq!(logged, 5);
        assert_eq!(log.held, 95);
        assert_eq!(log.refusals.count, 100);
        assert_eq!(log.refusals.kept.len(), KEPT_REFUSALS);
        assert_eq!(log.last.as_ref().unwrap().why, "stranger 99");
        log.flush();
        assert_eq!(log.held, 0);
        // A new second logs again.
        log.window -= Duration::from_secs(1);
        assert!(log.record(addr, "stranger 100".into()));
    }
}
