//! How a node reaches its peers: the [`Transport`] trait the coherence thread sends through,
//! the [`Inbox`] that received messages arrive in, and the TCP transport (one authenticated
//! stream per pair of nodes, which gives the per-pair order the protocol relies on).

use crate::envelope::Envelope;
use crate::link::{Link, LinkError, LinkParams, LinkWriter, Role};
use dsm::NodeId;
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
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
    #[error("node {0} connected twice")]
    Duplicate(NodeId),
    #[error("starting the receiver thread for node {peer}: {source}")]
    Spawn {
        peer: NodeId,
        source: std::io::Error,
    },
}

/// Sends to peers. Messages to one peer must arrive in the order sent.
pub trait Transport: Send {
    fn send(&mut self, to: NodeId, env: &Envelope) -> Result<(), TransportError>;
}

/// Something for the coherence thread to handle.
#[derive(Debug)]
pub enum Inbound {
    Frame {
        from: NodeId,
        env: Envelope,
    },
    /// The link to `peer` ended; nothing more comes from it.
    PeerFailed {
        peer: NodeId,
        error: String,
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

/// Addresses and credentials for joining the other nodes.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    pub link: LinkParams,
    /// Every other node of the VM and where it listens.
    pub peers: Vec<(NodeId, SocketAddr)>,
    /// How long to keep dialing a peer that is not listening yet, and to wait for peers to
    /// dial in.
    pub connect_timeout: Duration,
}

/// One stream per pair of nodes: a node dials the peers with lower ids and accepts the ones
/// with higher ids, so each pair opens exactly one connection.
pub struct TcpTransport {
    writers: BTreeMap<NodeId, LinkWriter>,
    readers: Vec<JoinHandle<()>>,
}

impl TcpTransport {
    /// Connects to every peer (blocking until all are linked or one fails) and starts one
    /// receiver thread per peer feeding `inbox`. A connection that fails the handshake ends
    /// this with its error: the nodes of a VM start together from one configuration, so a
    /// stranger or a mismatched node is a set-up fault to report, not to wait out.
    pub fn establish(
        cfg: &TcpConfig,
        listener: &TcpListener,
        inbox: InboxSender,
    ) -> Result<TcpTransport, TransportError> {
        let me = cfg.link.me;
        let deadline = Instant::now() + cfg.connect_timeout;
        let mut links: BTreeMap<NodeId, Link> = BTreeMap::new();
        for &(peer, addr) in cfg.peers.iter().filter(|p| p.0 < me) {
            let stream = dial(peer, addr, deadline)?;
            let link = Link::handshake(stream, Role::Dialer, Some(peer), &cfg.link)?;
            links.insert(peer, link);
        }
        let mut waiting: Vec<NodeId> = cfg.peers.iter().map(|p| p.0).filter(|&p| p > me).collect();
        let accept_err = |waiting: &Vec<NodeId>, what, source| TransportError::Accept {
            missing: waiting.clone(),
            what,
            source,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| accept_err(&waiting, "making the listener non-blocking", e))?;
        while !waiting.is_empty() {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| accept_err(&waiting, "making a stream blocking", e))?;
                    let link = Link::handshake(stream, Role::Listener, None, &cfg.link)?;
                    if !waiting.contains(&link.peer) {
                        return Err(if links.contains_key(&link.peer) {
                            TransportError::Duplicate(link.peer)
                        } else {
                            LinkError::WrongNode {
                                peer: link.addr.to_string(),
                                claimed: link.peer,
                                expected: format!("one of {waiting:?}"),
                            }
                            .into()
                        });
                    }
                    waiting.retain(|&w| w != link.peer);
                    links.insert(link.peer, link);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(accept_err(
                            &waiting,
                            "no connection in time",
                            std::io::Error::from(ErrorKind::TimedOut),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(accept_err(&waiting, "accepting", e)),
            }
        }
        let mut t = TcpTransport {
            writers: BTreeMap::new(),
            readers: Vec::new(),
        };
        for (peer, link) in links {
            let Link {
                mut reader, writer, ..
            } = link;
            t.writers.insert(peer, writer);
            let inbox = inbox.clone();
            let h = std::thread::Builder::new()
                .name(format!("dsm-rx-{}", peer.0))
                .spawn(move || loop {
                    match reader.recv() {
                        Ok(env) => {
                            if !inbox.push(Inbound::Frame { from: peer, env }) {
                                return;
                            }
                        }
                        Err(e) => {
                            inbox.push(Inbound::PeerFailed {
                                peer,
                                error: e.to_string(),
                            });
                            return;
                        }
                    }
                })
                .map_err(|source| TransportError::Spawn { peer, source })?;
            t.readers.push(h);
        }
        Ok(t)
    }

    /// Closes every link and waits for the receiver threads.
    pub fn close(&mut self) {
        for w in self.writers.values() {
            w.shutdown();
        }
        for h in self.readers.drain(..) {
            let _ = h.join();
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
        let w = self
            .writers
            .get_mut(&to)
            .ok_or(TransportError::NoPeer(to))?;
        Ok(w.send(env)?)
    }
}

/// Connects, retrying while the peer is not listening yet, until `deadline`.
fn dial(peer: NodeId, addr: SocketAddr, deadline: Instant) -> Result<TcpStream, TransportError> {
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
