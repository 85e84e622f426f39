//! How a node reaches its peers: the [`Transport`] trait the coherence thread sends through,
//! the [`Inbox`] that received messages arrive in, and the TCP transport (one authenticated
//! stream per pair of nodes, which gives the per-pair order the protocol relies on).

use crate::delay::DelayLine;
use crate::door::{DoorLimits, Refusals};
use crate::envelope::Envelope;
use crate::link::{Link, LinkError, LinkParams, LinkReader, LinkWriter};
use dsm::NodeId;
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TransportError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("no link to node {0}")]
    NoPeer(NodeId),
    #[error("node {peer} at {addr}: {what}: {source}")]
    Connect {
        peer: NodeId,
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("listening for nodes {missing:?}: {what}: {source}")]
    Accept {
        missing: Vec<NodeId>,
        what: &'static str,
        source: std::io::Error,
    },
    #[error(
        "{} never linked before the connect deadline; {refused} connections were refused \
         meanwhile{}",
        node_list(missing),
        last.as_ref().map(|r| format!(", the last from {}: {}", r.addr, r.why)).unwrap_or_default()
    )]
    NotLinked {
        missing: Vec<NodeId>,
        refused: usize,
        last: Option<crate::door::Refusal>,
    },
    #[error("stopped waiting: {0}")]
    Stopped(String),
    #[error("starting the receiver thread for node {peer}: {source}")]
    Spawn {
        peer: NodeId,
        source: std::io::Error,
    },
}

/// Node ids as a message lists them: "n1, n2".
pub(crate) fn node_list<'a>(ids: impl IntoIterator<Item = &'a NodeId>) -> String {
    let v: Vec<String> = ids.into_iter().map(|n| n.to_string()).collect();
    v.join(", ")
}

/// Sends to peers. Messages to one peer must arrive in the order sent.
pub trait Transport: Send {
    fn send(&mut self, to: NodeId, env: &Envelope) -> Result<(), TransportError>;

    /// The receiving ends of the links, for the coherence thread to read itself; a transport
    /// that hands them over puts nothing from those peers into the inbox. Empty for a
    /// transport that delivers through the inbox only.
    fn take_readers(&mut self) -> Vec<PeerReader> {
        Vec::new()
    }
}

/// The receiving end of the link to one peer, read by the thread that polls it.
pub struct PeerReader {
    pub peer: NodeId,
    pub reader: LinkReader,
    link: Arc<PeerLink>,
}

impl PeerReader {
    /// Records that the peer said `Stop`: it gets no more heartbeats.
    pub fn note_stop(&self) {
        self.link.stopped.store(true, Ordering::SeqCst);
    }
}

/// Something for the coherence thread to handle.
#[derive(Debug)]
pub enum Inbound {
    Frame {
        from: NodeId,
        env: Envelope,
    },
    /// The link to `peer` ended without a `Stop` from it, or went silent; nothing more comes
    /// from it.
    PeerFailed {
        peer: NodeId,
        error: String,
    },
    /// Send `Stop { code }` to every peer still linked, then end like [`Inbound::Stop`].
    StopAll {
        code: i32,
    },
    /// Send `env` to `to` from the coherence thread, in order with its protocol messages.
    Send {
        to: NodeId,
        env: Envelope,
    },
    Stop,
}

/// Where receivers put what they read; the coherence thread polls its file descriptor next to
/// the userfaultfd, so one thread waits on both.
#[derive(Clone, Debug)]
pub struct InboxSender {
    tx: mpsc::Sender<Inbound>,
    bell: std::sync::Arc<UnixStream>,
}

#[derive(Debug)]
pub struct Inbox {
    rx: mpsc::Receiver<Inbound>,
    bell: UnixStream,
}

impl Inbox {
    pub fn new() -> std::io::Result<(InboxSender, Inbox)> {
        let (a, b) = UnixStream::pair()?;
        a.set_nonblocking(true)?;
        b.set_nonblocking(true)?;
        let (tx, rx) = mpsc::channel();
        Ok((
            InboxSender {
                tx,
                bell: std::sync::Arc::new(a),
            },
            Inbox { rx, bell: b },
        ))
    }

    /// Everything that has arrived, without waiting.
    pub fn drain(&mut self) -> Vec<Inbound> {
        let mut sink = [0u8; 256];
        while matches!((&self.bell).read(&mut sink), Ok(n) if n > 0) {}
        self.rx.try_iter().collect()
    }
}

impl AsRawFd for Inbox {
    /// Readable when something has arrived.
    fn as_raw_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }
}

impl InboxSender {
    /// Queues an item; false if the coherence thread has gone.
    pub fn push(&self, item: Inbound) -> bool {
        if self.tx.send(item).is_err() {
            return false;
        }
        // A full socket buffer already means "look": losing this byte loses nothing.
        let _ = (&*self.bell).write(&[1]);
        true
    }
}

/// Default period of heartbeats.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(200);
/// Default silence after which a peer is lost: seven heartbeats missed, so a loaded host is
/// not mistaken for a dead one, and still short enough for a VMM to notice, stop its VM and
/// exit within a few seconds.
pub const DEFAULT_LOSS_TIMEOUT: Duration = Duration::from_millis(1500);
/// Longest [`TcpTransport::close`] waits for what it sent to be acknowledged.
const CLOSE_DRAIN: Duration = Duration::from_secs(1);

/// How a node tells a dead peer from a quiet one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// How often each peer gets a heartbeat, from a thread of its own, so that neither a busy
    /// coherence thread nor a vCPU stopped on a fault delays it.
    pub heartbeat: Duration,
    /// A peer from which nothing at all arrived for this long is lost. Also bounds one send to
    /// a peer that stopped reading. Keep it several heartbeat periods.
    pub loss_timeout: Duration,
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness {
            heartbeat: DEFAULT_HEARTBEAT,
            loss_timeout: DEFAULT_LOSS_TIMEOUT,
        }
    }
}

/// Addresses and credentials for joining the other nodes.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    pub link: LinkParams,
    /// Every other node of the VM and where it listens.
    pub peers: Vec<(NodeId, SocketAddr)>,
    /// How long to keep dialing a peer that is not listening yet, and to wait for peers to
    /// dial in.
    pub connect_timeout: Duration,
    pub liveness: Liveness,
    /// One-way delay added to every frame this node sends (zero: none), to emulate a
    /// slower network ([`crate::delay`]); at most [`crate::delay::MAX_LINK_DELAY`].
    pub link_delay: Duration,
    /// What connections that fail the handshake may cost while linking.
    pub door: DoorLimits,
}

/// What the sending side, the heartbeat thread and the receiver share about one peer.
struct PeerLink {
    id: NodeId,
    writer: Mutex<LinkWriter>,
    /// Another handle on the socket, so closing never waits for a writer stuck in a send.
    socket: TcpStream,
    /// Frames sent but held back by the link delay, flushed before the link closes.
    line: Option<Arc<DelayLine>>,
    /// The peer said `Stop`: it is leaving, so its connection ending is no loss, and it gets
    /// no more heartbeats.
    stopped: AtomicBool,
}

impl PeerLink {
    fn writer(&self) -> MutexGuard<'_, LinkWriter> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes sent to the peer and not yet acknowledged by it.
    fn unacknowledged(&self) -> Option<usize> {
        let mut n: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ for sockets) writes one int through the pointer, which
        // points at a live local.
        let r = unsafe { libc::ioctl(self.socket.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
        (r == 0).then_some(n.max(0) as usize)
    }
}

/// One stream per pair of nodes: a node dials the peers with lower ids and accepts the ones
/// with higher ids, so each pair opens exactly one connection. Every peer gets heartbeats and
/// is watched for silence ([`Liveness`]). Frames are read by the coherence thread, which
/// takes the links' receiving ends ([`Transport::take_readers`]) and reports a lost peer
/// itself; without one, [`TcpTransport::spawn_receivers`] gives each link a thread that puts
/// its frames into the inbox and reports the loss there as [`Inbound::PeerFailed`], once.
pub struct TcpTransport {
    peers: BTreeMap<NodeId, Arc<PeerLink>>,
    /// The links' receiving ends until they are taken ([`Transport::take_readers`]) or
    /// given receiver threads ([`TcpTransport::spawn_receivers`]).
    unread: Vec<PeerReader>,
    inbox: InboxSender,
    readers: Vec<JoinHandle<()>>,
    /// One heartbeat thread per peer, each ended by dropping its sender.
    beats: Vec<(mpsc::Sender<()>, JoinHandle<()>)>,
    /// Set while this node closes its own links, whose ends are then no peer's failure.
    closing: Arc<AtomicBool>,
    /// The connections turned away while linking.
    refusals: Refusals,
}

impl TcpTransport {
    /// Links with every peer (blocking until all are linked, one fails, or the connect
    /// deadline passes), then starts one heartbeat thread per peer; `inbox` is where receiver
    /// threads would put frames. A connection that fails the handshake is refused and logged
    /// and the node goes on waiting ([`crate::door`]); only a peer that proves the secret and
    /// runs another VM configuration, or a peer this node dials that fails, ends linking with
    /// an error. `listener` is closed on return: nothing is accepted after linking.
    pub fn establish(
        cfg: &TcpConfig,
        listener: TcpListener,
        inbox: InboxSender,
    ) -> Result<TcpTransport, TransportError> {
        let me = cfg.link.me;
        let deadline = Instant::now() + cfg.connect_timeout;
        let dial: Vec<(NodeId, SocketAddr)> =
            cfg.peers.iter().copied().filter(|p| p.0 < me).collect();
        let answer: Vec<NodeId> = cfg.peers.iter().map(|p| p.0).filter(|&p| p > me).collect();
        let linked =
            crate::door::link_all(&cfg.link, &dial, &answer, &listener, cfg.door, deadline);
        // Closed whatever the outcome: nothing is accepted once the nodes have linked.
        drop(listener);
        let (links, refusals) = linked?;
        let mut t = TcpTransport {
            peers: BTreeMap::new(),
            unread: Vec::new(),
            inbox,
            readers: Vec::new(),
            beats: Vec::new(),
            closing: Arc::new(AtomicBool::new(false)),
            refusals,
        };
        let live = cfg.liveness;
        for (peer, link) in links {
            let Link {
                mut reader,
                mut writer,
                ..
            } = link;
            reader.limit_silence(live.loss_timeout)?;
            writer.limit_stall(live.loss_timeout)?;
            writer.delay_by(cfg.link_delay)?;
            let socket = writer.try_clone_socket()?;
            let shared = Arc::new(PeerLink {
                id: peer,
                line: writer.delay_line(),
                writer: Mutex::new(writer),
                socket,
                stopped: AtomicBool::new(false),
            });
            t.peers.insert(peer, Arc::clone(&shared));
            t.unread.push(PeerReader {
                peer,
                reader,
                link: Arc::clone(&shared),
            });
            let (tx, rx) = mpsc::channel();
            let h = std::thread::Builder::new()
                .name(format!("dsm-beat-{}", peer.0))
                .spawn(move || beat(&shared, live.heartbeat, &rx))
                .map_err(|source| TransportError::Spawn { peer, source })?;
            t.beats.push((tx, h));
        }
        Ok(t)
    }

    /// Gives every link not taken by [`Transport::take_readers`] a receiver thread that puts
    /// its frames into the inbox.
    pub fn spawn_receivers(&mut self) -> Result<(), TransportError> {
        for PeerReader { peer, reader, link } in std::mem::take(&mut self.unread) {
            let (inbox, closing) = (self.inbox.clone(), Arc::clone(&self.closing));
            let h = std::thread::Builder::new()
                .name(format!("dsm-rx-{}", peer.0))
                .spawn(move || receive(reader, &link, &inbox, &closing))
                .map_err(|source| TransportError::Spawn { peer, source })?;
            self.readers.push(h);
        }
        Ok(())
    }

    /// Closes every link and waits for the receiver and heartbeat threads. What was sent
    /// before (a `Stop` above all) is given a bounded moment to be acknowledged first, so a
    /// peer reads it before it sees the connection end.
    pub fn close(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for (tx, h) in self.beats.drain(..) {
            drop(tx);
            let _ = h.join();
        }
        for line in self.peers.values().filter_map(|p| p.line.as_ref()) {
            line.flush(CLOSE_DRAIN + line.delay());
        }
        for p in self.peers.values() {
            let _ = p.socket.shutdown(Shutdown::Write);
        }
        let until = Instant::now() + CLOSE_DRAIN;
        for p in self.peers.values() {
            while p.unacknowledged().is_some_and(|n| n > 0) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        for p in self.peers.values() {
            let _ = p.socket.shutdown(Shutdown::Both);
        }
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }

    /// The connections turned away while linking.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The peers linked to.
    pub fn peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.peers.keys().copied()
    }
}

/// A receiver thread: hands every frame but heartbeats to the inbox, and reports the end of
/// the link as the peer's failure unless the peer said `Stop` first or this node is closing.
fn receive(mut reader: LinkReader, link: &PeerLink, inbox: &InboxSender, closing: &AtomicBool) {
    let peer = link.id;
    loop {
        match reader.recv() {
            Ok(Envelope::Heartbeat { .. }) => {}
            Ok(env) => {
                if matches!(env, Envelope::Stop { .. }) {
                    link.stopped.store(true, Ordering::SeqCst);
                }
                if !inbox.push(Inbound::Frame { from: peer, env }) {
                    return;
                }
            }
            Err(e) => {
                if !link.stopped.load(Ordering::SeqCst) && !closing.load(Ordering::SeqCst) {
                    inbox.push(Inbound::PeerFailed {
                        peer,
                        error: e.to_string(),
                    });
                }
                return;
            }
        }
    }
}

/// A heartbeat thread: one beat at once and then every `period` until told to end. A failed
/// beat is left to the receiver to report: the send has ended the link, which the peer and
/// this node's receiver then see, and a peer that stopped cleanly must not look lost.
fn beat(link: &PeerLink, period: Duration, end: &mpsc::Receiver<()>) {
    for seq in 0u64.. {
        if !link.stopped.load(Ordering::SeqCst) {
            let mut w = link.writer();
            if !w.is_broken() {
                if let Err(e) = w.send(&Envelope::Heartbeat { seq }) {
                    tracing::debug!(peer = %link.id, error = %e, "heartbeat not sent");
                }
            }
        }
        if !matches!(
            end.recv_timeout(period),
            Err(mpsc::RecvTimeoutError::Timeout)
        ) {
            return;
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.close();
    }
}

impl Transport for TcpTransport {
    fn send(&mut self, to: NodeId, env: &Envelope) -> Result<(), TransportError> {
        let p = self.peers.get(&to).ok_or(TransportError::NoPeer(to))?;
        let r = p.writer().send(env);
        Ok(r?)
    }

    fn take_readers(&mut self) -> Vec<PeerReader> {
        std::mem::take(&mut self.unread)
    }
}

/// Connects, retrying while the peer is not listening yet, until `deadline`.
pub(crate) fn dial(
    peer: NodeId,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && e.kind() == ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(TransportError::Connect {
                    peer,
                    addr,
                    what: "connecting",
                    source,
                })
            }
        }
    }
}
