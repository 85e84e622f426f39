//! One authenticated stream between two nodes: the handshake (shared-secret challenge and
//! response, VM configuration check) and the MAC-protected, length-prefixed frames after it.
//!
//! Handshake, both sides at once: each sends `hello` (magic, version, node id, 32-byte
//! nonce, hash of its resolved VM configuration), reads the peer's, then sends
//! `proof = HMAC(secret, "proof" ‖ role ‖ own hello ‖ peer hello)` and checks the peer's. The
//! nonces make every proof fresh and the role stops a proof being reflected back. Only then
//! are the configuration hashes compared, so a mismatch is reported by an authenticated peer.
//!
//! Frame: `len: u32 LE` then `len` bytes: an [`Envelope`] and a 32-byte
//! `HMAC(key, seq ‖ len ‖ envelope)`, where `seq` counts the frames of that direction and
//! the key of each direction is derived from the secret and both nonces.

use crate::delay::DelayLine;
use crate::envelope::{Envelope, EnvelopeError};
use dsm::NodeId;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

type HmacSha256 = Hmac<Sha256>;

const MAGIC: &[u8; 8] = b"MUSUBIDS";
/// Bumped on any change of the handshake or frame layout.
pub const LINK_VERSION: u8 = 2;
const HELLO_LEN: usize = 8 + 1 + 2 + 32 + 32;
const MAC_LEN: usize = 32;
/// Bytes the handshake reads from a peer before it has proved the secret: its hello and its
/// proof, whatever else it sends.
pub const HANDSHAKE_READ: usize = HELLO_LEN + MAC_LEN;
/// Largest frame body accepted: a page message is about 4.1 KiB.
pub const MAX_FRAME: usize = 16 * 1024;

#[derive(Debug, Error)]
pub enum LinkError {
    #[error("{what} with peer {peer}: {source}")]
    Io {
        peer: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("peer {peer} does not speak the musubi node handshake (first bytes {got:02x?})")]
    NotANode { peer: String, got: Vec<u8> },
    #[error(
        "peer {peer} speaks node link version {got}, this build speaks version {LINK_VERSION}"
    )]
    Version { peer: String, got: u8 },
    #[error("peer {peer} says it is node {claimed}, expected {expected}")]
    WrongNode {
        peer: String,
        claimed: NodeId,
        expected: String,
    },
    #[error(
        "peer {peer} (claims node {node}) failed authentication: its shared secret differs from \
         this node's"
    )]
    Auth { peer: String, node: NodeId },
    #[error(
        "peer {peer} (node {node}) runs a different VM configuration ({differs} differ; hash \
         {theirs} there, {ours} here): start every node with the same configuration"
    )]
    ConfigMismatch {
        peer: String,
        node: NodeId,
        ours: String,
        theirs: String,
        /// The parts of the configuration whose hashes differ ([`LinkParams::config_parts`]).
        differs: String,
    },
    #[error("frame from {peer} announces {len} bytes, accepted {min}..={max}")]
    FrameLength {
        peer: String,
        len: usize,
        min: usize,
        max: usize,
    },
    #[error("frame {seq} from {peer} ends after {got} of {len} bytes")]
    Truncated {
        peer: String,
        seq: u64,
        got: usize,
        len: usize,
    },
    #[error("frame {seq} from {peer} fails its MAC: forged, corrupted or out of order")]
    BadMac { peer: String, seq: u64 },
    #[error("frame {seq} from {peer} is malformed: {source}")]
    Malformed {
        peer: String,
        seq: u64,
        source: EnvelopeError,
    },
    #[error("peer {peer} closed the connection")]
    Closed { peer: String },
    #[error(
        "no frame from {peer} for {ms} ms (not even a heartbeat): it is down, hung or cut off"
    )]
    Silent { peer: String, ms: u128 },
    #[error("the link to {peer} is unusable since a send failed part way: {why}")]
    Unusable { peer: String, why: String },
}

/// Which end opened the connection; part of what each proof covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Dialer,
    Listener,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Dialer => 0,
            Role::Listener => 1,
        }
    }
}

/// What a node proves and checks when it meets a peer.
#[derive(Clone)]
pub struct LinkParams {
    pub me: NodeId,
    pub secret: Vec<u8>,
    /// Hash of this node's resolved VM configuration ([`config_hash`]), or, when
    /// `config_parts` names its parts, one 4-byte hash per part ([`config_hash_of_parts`]), so
    /// a refusal can say which parts differ.
    pub config_hash: [u8; 32],
    pub config_parts: Vec<String>,
    /// Bound on each read and write of the handshake.
    pub timeout: Duration,
}

impl std::fmt::Debug for LinkParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkParams")
            .field("me", &self.me)
            .field("secret", &"<redacted>")
            .field("config_hash", &hex(&self.config_hash))
            .finish()
    }
}

/// SHA-256 of a canonical encoding of the resolved VM configuration, compared at handshake.
pub fn config_hash(canonical: &[u8]) -> [u8; 32] {
    Sha256::digest(canonical).into()
}

/// The most parts [`config_hash_of_parts`] keeps apart.
pub const MAX_CONFIG_PARTS: usize = 8;

/// A configuration hash made of one 4-byte SHA-256 prefix per part (at most
/// [`MAX_CONFIG_PARTS`]; later parts share the last slot), so two nodes that disagree learn
/// which parts differ without sending the configuration itself.
pub fn config_hash_of_parts(parts: &[&[u8]]) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut last = Sha256::new();
    for (i, p) in parts.iter().enumerate() {
        if i < MAX_CONFIG_PARTS - 1 {
            out[i * 4..i * 4 + 4].copy_from_slice(&Sha256::digest(p)[..4]);
        } else {
            last.update(p);
        }
    }
    if parts.len() >= MAX_CONFIG_PARTS {
        out[28..].copy_from_slice(&last.finalize()[..4]);
    }
    out
}

fn differing_parts(names: &[String], ours: &[u8; 32], theirs: &[u8; 32]) -> String {
    let differ: Vec<&str> = names
        .iter()
        .take(MAX_CONFIG_PARTS)
        .enumerate()
        .filter(|(i, _)| ours[i * 4..i * 4 + 4] != theirs[i * 4..i * 4 + 4])
        .map(|(_, n)| n.as_str())
        .collect();
    if differ.is_empty() {
        "some settings".into()
    } else {
        differ.join(", ")
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// The body length a frame's length word gives, if it is one a peer may send.
fn frame_len(peer: &str, len_le: [u8; 4]) -> Result<usize, LinkError> {
    let len = u32::from_le_bytes(len_le) as usize;
    let min = MAC_LEN + 1;
    if !(min..=MAX_FRAME).contains(&len) {
        return Err(LinkError::FrameLength {
            peer: peer.to_string(),
            len,
            min,
            max: MAX_FRAME,
        });
    }
    Ok(len)
}

/// Checks the MAC of frame number `*seq` (`frame` is its body and tag) and decodes it; the
/// number moves on only for a frame that passes.
fn open_frame(
    key: &[u8],
    seq: &mut u64,
    peer: &str,
    len_le: [u8; 4],
    frame: &[u8],
) -> Result<Envelope, LinkError> {
    let n = *seq;
    let (body, tag) = frame.split_at(frame.len() - MAC_LEN);
    if !verify(key, &[&n.to_le_bytes(), &len_le, body], tag) {
        return Err(LinkError::BadMac {
            peer: peer.to_string(),
            seq: n,
        });
    }
    *seq += 1;
    Envelope::decode(body).map_err(|source| LinkError::Malformed {
        peer: peer.to_string(),
        seq: n,
        source,
    })
}

/// Sending half of a link.
pub struct LinkWriter {
    stream: TcpStream,
    peer: String,
    key: [u8; 32],
    seq: u64,
    buf: Vec<u8>,
    /// Why an earlier send failed: the peer may hold part of a frame, so nothing more may
    /// follow on this stream.
    broken: Option<String>,
    /// Set when frames are held back before they are written ([`LinkWriter::delay_by`]).
    line: Option<Arc<DelayLine>>,
}

/// Receiving half of a link.
pub struct LinkReader {
    stream: TcpStream,
    peer: String,
    key: [u8; 32],
    seq: u64,
    buf: Vec<u8>,
    /// Longest wait for the next bytes before the peer counts as lost.
    silence: Option<Duration>,
    /// Bytes [`LinkReader::recv_ready`] has read past the last whole frame.
    pending: Vec<u8>,
}

/// An authenticated stream to one peer.
pub struct Link {
    pub peer: NodeId,
    pub addr: SocketAddr,
    pub reader: LinkReader,
    pub writer: LinkWriter,
}

fn peer_name(addr: &SocketAddr, node: Option<NodeId>) -> String {
    match node {
        Some(n) => format!("{n} at {addr}"),
        None => addr.to_string(),
    }
}

fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    peer: &str,
    what: &'static str,
) -> Result<(), LinkError> {
    s.read_exact(buf).map_err(|source| match source.kind() {
        ErrorKind::UnexpectedEof => LinkError::Closed {
            peer: peer.to_string(),
        },
        _ => LinkError::Io {
            peer: peer.to_string(),
            what,
            source,
        },
    })
}

impl Link {
    /// Runs the handshake on a connected stream. `expect` is the node the dialer meant to
    /// reach; a listener passes `None` and checks the claimed id itself.
    pub fn handshake(
        mut stream: TcpStream,
        role: Role,
        expect: Option<NodeId>,
        p: &LinkParams,
    ) -> Result<Link, LinkError> {
        let addr = stream.peer_addr().map_err(|source| LinkError::Io {
            peer: "?".into(),
            what: "reading the peer address",
            source,
        })?;
        let mut peer = peer_name(&addr, expect);
        let io = |peer: &str, what| {
            let peer = peer.to_string();
            move |source| LinkError::Io { peer, what, source }
        };
        stream
            .set_nodelay(true)
            .map_err(io(&peer, "setting TCP_NODELAY"))?;
        stream
            .set_read_timeout(Some(p.timeout))
            .map_err(io(&peer, "setting the handshake timeout"))?;
        stream
            .set_write_timeout(Some(p.timeout))
            .map_err(io(&peer, "setting the handshake timeout"))?;

        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| LinkError::Io {
            peer: peer.clone(),
            what: "drawing a nonce",
            source: std::io::Error::other(e.to_string()),
        })?;
        let mut hello = Vec::with_capacity(HELLO_LEN);
        hello.extend_from_slice(MAGIC);
        hello.push(LINK_VERSION);
        hello.extend_from_slice(&p.me.0.to_le_bytes());
        hello.extend_from_slice(&nonce);
        hello.extend_from_slice(&p.config_hash);
        stream
            .write_all(&hello)
            .map_err(io(&peer, "sending hello"))?;

        let mut theirs = [0u8; HELLO_LEN];
        read_exact(&mut stream, &mut theirs, &peer, "reading hello")?;
        if &theirs[..8] != MAGIC {
            return Err(LinkError::NotANode {
                peer,
                got: theirs[..8].to_vec(),
            });
        }
        if theirs[8] != LINK_VERSION {
            return Err(LinkError::Version {
                peer,
                got: theirs[8],
            });
        }
        let claimed = NodeId(u16::from_le_bytes([theirs[9], theirs[10]]));
        if claimed == p.me || expect.is_some_and(|e| e != claimed) {
            return Err(LinkError::WrongNode {
                peer,
                claimed,
                expected: match expect {
                    Some(e) => e.to_string(),
                    None => format!("any node but {}", p.me),
                },
            });
        }
        peer = peer_name(&addr, Some(claimed));
        let their_nonce: [u8; 32] = theirs[11..43].try_into().expect("32 bytes");
        let their_hash: [u8; 32] = theirs[43..75].try_into().expect("32 bytes");

        let other = match role {
            Role::Dialer => Role::Listener,
            Role::Listener => Role::Dialer,
        };
        let proof = mac(&p.secret, &[b"proof", &[role.byte()], &hello, &theirs]);
        stream
            .write_all(&proof)
            .map_err(io(&peer, "sending proof"))?;
        let mut their_proof = [0u8; MAC_LEN];
        read_exact(&mut stream, &mut their_proof, &peer, "reading proof")?;
        if !verify(
            &p.secret,
            &[b"proof", &[other.byte()], &theirs, &hello],
            &their_proof,
        ) {
            return Err(LinkError::Auth {
                peer,
                node: claimed,
            });
        }
        if their_hash != p.config_hash {
            return Err(LinkError::ConfigMismatch {
                peer,
                node: claimed,
                ours: hex(&p.config_hash[..8]),
                theirs: hex(&their_hash[..8]),
                differs: differing_parts(&p.config_parts, &p.config_hash, &their_hash),
            });
        }

        let (dialer_nonce, listener_nonce) = match role {
            Role::Dialer => (&nonce, &their_nonce),
            Role::Listener => (&their_nonce, &nonce),
        };
        let session = mac(&p.secret, &[b"session", dialer_nonce, listener_nonce]);
        let d2l = mac(&session, &[b"dialer to listener"]);
        let l2d = mac(&session, &[b"listener to dialer"]);
        let (send_key, recv_key) = match role {
            Role::Dialer => (d2l, l2d),
            Role::Listener => (l2d, d2l),
        };
        // Frames after the handshake block as long as needed unless the owner of the link
        // bounds the silence it accepts ([`LinkReader::limit_silence`]); stopping shuts the
        // socket down.
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(None))
            .map_err(io(&peer, "clearing the handshake timeout"))?;
        let read_half = stream
            .try_clone()
            .map_err(io(&peer, "cloning the stream"))?;
        Ok(Link {
            peer: claimed,
            addr,
            reader: LinkReader {
                stream: read_half,
                peer: peer.clone(),
                key: recv_key,
                seq: 0,
                buf: Vec::new(),
                silence: None,
                pending: Vec::new(),
            },
            writer: LinkWriter {
                stream,
                peer,
                key: send_key,
                seq: 0,
                buf: Vec::new(),
                broken: None,
                line: None,
            },
        })
    }
}

impl LinkWriter {
    /// Sends one envelope as one frame; frames arrive in the order sent. A failed send leaves
    /// the link unusable and ends this direction, so the peer sees the link end rather than
    /// a torn frame followed by good ones.
    pub fn send(&mut self, env: &Envelope) -> Result<(), LinkError> {
        if let Some(why) = &self.broken {
            return Err(LinkError::Unusable {
                peer: self.peer.clone(),
                why: why.clone(),
            });
        }
        self.buf.clear();
        self.buf.extend_from_slice(&[0; 4]);
        env.encode(&mut self.buf);
        let len = self.buf.len() - 4 + MAC_LEN;
        assert!(
            len <= MAX_FRAME,
            "every envelope fits a frame ({len} bytes)"
        );
        let len_le = (len as u32).to_le_bytes();
        self.buf[..4].copy_from_slice(&len_le);
        let tag = mac(
            &self.key,
            &[&self.seq.to_le_bytes(), &len_le, &self.buf[4..]],
        );
        self.buf.extend_from_slice(&tag);
        self.seq += 1;
        if let Some(line) = &self.line {
            let room = self.buf.len();
            let frame = std::mem::replace(&mut self.buf, Vec::with_capacity(room));
            return line.push(frame).map_err(|e| {
                let why = e.to_string();
                self.broken = Some(why.clone());
                LinkError::Unusable {
                    peer: self.peer.clone(),
                    why,
                }
            });
        }
        self.stream.write_all(&self.buf).map_err(|source| {
            let _ = self.stream.shutdown(Shutdown::Write);
            let stalled = matches!(source.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
            let e = LinkError::Io {
                peer: self.peer.clone(),
                what: if stalled {
                    "sending a frame (the peer stopped reading)"
                } else {
                    "sending a frame"
                },
                source,
            };
            self.broken = Some(e.to_string());
            e
        })
    }

    /// Bounds how long one send may wait for the peer to make room: a peer that stops
    /// reading must not hold up the sender (and its heartbeats to other peers) forever.
    pub fn limit_stall(&self, limit: Duration) -> Result<(), LinkError> {
        self.stream
            .set_write_timeout(Some(limit))
            .map_err(|source| LinkError::Io {
                peer: self.peer.clone(),
                what: "setting the send timeout",
                source,
            })
    }

    /// A second handle on the socket, for ending it from another thread while a send waits.
    pub fn try_clone_socket(&self) -> Result<TcpStream, LinkError> {
        self.stream.try_clone().map_err(|source| LinkError::Io {
            peer: self.peer.clone(),
            what: "cloning the stream",
            source,
        })
    }

    /// From now on holds every frame `delay` after its send before it is written, on a
    /// thread of its own ([`DelayLine`]), so one machine can emulate a slower network while
    /// [`LinkWriter::send`] still returns at once. A zero delay leaves the link as it is.
    /// Call it after [`LinkWriter::limit_stall`]: the delaying thread writes through the same
    /// socket and so under the same bound.
    pub fn delay_by(&mut self, delay: Duration) -> Result<(), LinkError> {
        if delay.is_zero() || self.line.is_some() {
            return Ok(());
        }
        let io = |what| {
            let peer = self.peer.clone();
            move |source| LinkError::Io { peer, what, source }
        };
        let sink = self
            .stream
            .try_clone()
            .map_err(io("cloning the stream for the delay"))?;
        let line = DelayLine::start(sink, delay, "dsm-delay".into())
            .map_err(io("starting the delay thread"))?;
        self.line = Some(Arc::new(line));
        Ok(())
    }

    /// The delay this link's frames go through, if any: whoever closes the link flushes it
    /// first, so frames already sent are not cut off.
    pub fn delay_line(&self) -> Option<Arc<DelayLine>> {
        self.line.clone()
    }

    /// True once a send has failed; nothing more goes out.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some() || self.line.as_ref().is_some_and(|l| l.failed().is_some())
    }

    /// Ends both directions, which also wakes a reader blocked on this stream.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }
}

impl AsRawFd for LinkReader {
    /// Readable when bytes of a frame have arrived, or the stream has ended.
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

impl LinkReader {
    /// Reads the next frame. Any error ends the link (the socket is shut down both ways):
    /// after a bad frame nothing further on the stream can be trusted.
    pub fn recv(&mut self) -> Result<Envelope, LinkError> {
        let r = self.read_frame();
        if r.is_err() {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        r
    }

    /// Makes a peer that sends nothing at all (not even heartbeats) for `limit` an error of
    /// its own, [`LinkError::Silent`], instead of a wait that never ends.
    pub fn limit_silence(&mut self, limit: Duration) -> Result<(), LinkError> {
        self.stream
            .set_read_timeout(Some(limit))
            .map_err(|source| LinkError::Io {
                peer: self.peer.clone(),
                what: "setting the receive timeout",
                source,
            })?;
        self.silence = Some(limit);
        Ok(())
    }

    /// A read timeout under [`Self::limit_silence`] is the peer's silence, said as such.
    fn quiet(&self, e: LinkError) -> LinkError {
        match (e, self.silence) {
            (LinkError::Io { source, .. }, Some(limit))
                if matches!(source.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                LinkError::Silent {
                    peer: self.peer.clone(),
                    ms: limit.as_millis(),
                }
            }
            (e, _) => e,
        }
    }

    /// Reads what has arrived, without waiting, and appends the whole frames in it to `out`;
    /// the start of a frame not yet complete waits for the next call. For a thread that
    /// polls the socket beside other work. The socket itself stays blocking (each read asks
    /// not to wait), since the writer shares it. An error ends the link as for
    /// [`LinkReader::recv`], after the frames before it are in `out`; the peer closing the
    /// stream between frames is [`LinkError::Closed`].
    pub fn recv_ready(&mut self, out: &mut Vec<Envelope>) -> Result<(), LinkError> {
        let r = self.read_ready(out);
        if r.is_err() {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        r
    }

    fn read_ready(&mut self, out: &mut Vec<Envelope>) -> Result<(), LinkError> {
        const CHUNK: usize = 64 * 1024;
        let mut closed = false;
        loop {
            // Read into the spare capacity, not into bytes zeroed first: this runs for every
            // message a node receives.
            self.pending.reserve(CHUNK);
            let spare = self.pending.spare_capacity_mut();
            let room = spare.len();
            // SAFETY: the pointer and length name `pending`'s spare capacity, which recv
            // writes at most `room` bytes of.
            let n = unsafe {
                libc::recv(
                    self.stream.as_raw_fd(),
                    spare.as_mut_ptr().cast(),
                    room,
                    libc::MSG_DONTWAIT,
                )
            };
            let got = usize::try_from(n).unwrap_or(0);
            // SAFETY: recv initialized the first `got` bytes of the spare capacity.
            unsafe { self.pending.set_len(self.pending.len() + got) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    ErrorKind::WouldBlock => break,
                    ErrorKind::Interrupted => continue,
                    _ => {
                        return Err(LinkError::Io {
                            peer: self.peer.clone(),
                            what: "reading frames",
                            source: e,
                        })
                    }
                }
            }
            if n == 0 {
                closed = true;
                break;
            }
            if got < room {
                break;
            }
        }
        let mut at = 0;
        while let Some(len_le) = self.pending.get(at..at + 4) {
            let len_le: [u8; 4] = len_le.try_into().expect("four bytes");
            let len = frame_len(&self.peer, len_le)?;
            let Some(frame) = self.pending.get(at + 4..at + 4 + len) else {
                break;
            };
            out.push(open_frame(
                &self.key,
                &mut self.seq,
                &self.peer,
                len_le,
                frame,
            )?);
            at += 4 + len;
        }
        self.pending.drain(..at);
        // Said as `recv` says it: an end inside the length is a close, inside the body a cut.
        match self.pending.get(..4) {
            _ if !closed => Ok(()),
            None => Err(LinkError::Closed {
                peer: self.peer.clone(),
            }),
            Some(len_le) => Err(LinkError::Truncated {
                peer: self.peer.clone(),
                seq: self.seq,
                got: self.pending.len() - 4,
                len: u32::from_le_bytes(len_le.try_into().expect("four bytes")) as usize,
            }),
        }
    }

    /// Ends the link both ways, as a read error does.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// The longest silence allowed ([`LinkReader::limit_silence`]), if any.
    pub fn silence_limit(&self) -> Option<Duration> {
        self.silence
    }

    /// The error a silence longer than [`LinkReader::silence_limit`] is.
    pub fn silent_error(&self) -> LinkError {
        LinkError::Silent {
            peer: self.peer.clone(),
            ms: self.silence.unwrap_or_default().as_millis(),
        }
    }

    fn read_frame(&mut self) -> Result<Envelope, LinkError> {
        let seq = self.seq;
        let mut len_le = [0u8; 4];
        read_exact(
            &mut self.stream,
            &mut len_le,
            &self.peer,
            "reading a frame length",
        )
        .map_err(|e| self.quiet(e))?;
        let len = frame_len(&self.peer, len_le)?;
        self.buf.resize(len, 0);
        let mut got = 0;
        while got < len {
            match self.stream.read(&mut self.buf[got..]) {
                Ok(0) => {
                    return Err(LinkError::Truncated {
                        peer: self.peer.clone(),
                        seq,
                        got,
                        len,
                    })
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(self.quiet(LinkError::Io {
                        peer: self.peer.clone(),
                        what: "reading a frame",
                        source,
                    }))
                }
            }
        }
        open_frame(&self.key, &mut self.seq, &self.peer, len_le, &self.buf)
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }
}
