//! Live migration of a running VM from one Musubi process to another. By default
//! post-copy, the coherence protocol run the other way round: the source pauses the VM and
//! sends its configuration and its vCPU and device state; the destination builds it on guest
//! RAM whose every page is absent and starts it at once; pages then follow, each asked for
//! by the destination's first fault on it and pushed by the source meanwhile, until the
//! destination holds them all and the source ends its VM. Pre-copy ([`Mode::PreCopy`]) sends
//! the pages into that same RAM before the pause instead, in rounds, so that nothing follows.
//!
//! - [`protocol`]: the messages and the page numbering both ends share.
//! - [`source`]: the sending side, over a [`source::SourceVm`].
//! - [`destination`]: the receiving side: waiting for a VM, having a [`destination::Host`]
//!   build it, and [`destination::PostCopyRam`], the guest RAM that serves its faults from
//!   the source.
//! - [`replication`]: a running VM kept on a standby, epoch by epoch, which takes over
//!   when the primary is lost (Remus-style checkpoints, without output commit yet).
//! - [`vm`]: both ends over the `vmm` crate's VMs, for the program that embeds Musubi.
//!
//! Both ends talk over one `dsm_host::Link` (shared-secret handshake, MAC'd frames) carrying
//! [`protocol::Msg`] in `Envelope::Migration`; neither side compares VM configurations in
//! the handshake (the destination checks the configuration itself), so the handshake's
//! configuration hash is a constant.

pub mod destination;
pub mod protocol;
pub mod replication;
pub mod source;
#[cfg(test)]
mod testing;
pub mod vm;

use dsm::NodeId;
use dsm_host::link::{LinkReader, LinkWriter};
use dsm_host::{Envelope, Link, LinkError, LinkParams, Role};
use protocol::{Blob, Msg};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A failure of the VM side of a migration (the program that embeds it, through
/// [`source::SourceVm`] or [`destination::Host`]), kept whole for its message and source.
pub type VmFault = Box<dyn std::error::Error + Send + Sync>;

/// The source's node id on the link.
pub const SOURCE: NodeId = NodeId(0);
/// The destination's node id on the link.
pub const DESTINATION: NodeId = NodeId(1);
/// What both ends put in the handshake's configuration hash.
const LINK_CONFIG: &[u8] = b"musubi-migration";
/// Largest configuration or state document accepted.
const MAX_DOCUMENT: usize = 64 << 20;
/// Shortest secret accepted, as for the nodes of a cluster.
pub const MIN_SECRET: usize = 16;

/// How guest RAM moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Switch at once; the pages follow, each asked for by the destination's first fault on
    /// it and pushed by the source meanwhile. The pause holds no page.
    PostCopy,
    /// Copy the pages while the VM runs here, then in rounds the pages written meanwhile
    /// (KVM's dirty log and the VMM's own writes), and pause once what is left can be sent
    /// within `downtime` at the rate the last round reached, or after `max_rounds` rounds
    /// whatever is left. The pause sends what was written last; nothing follows the switch.
    PreCopy { downtime: Duration, max_rounds: u32 },
}

impl Mode {
    /// Cloud Hypervisor's downtime target (`downtime_ms`, 300 by default) and a bound on
    /// rounds, for a guest that writes faster than the link carries.
    pub const PRECOPY_DEFAULT: Mode = Mode::PreCopy {
        downtime: Duration::from_millis(300),
        max_rounds: 10,
    };
}

/// How a migration's link is authenticated and bounded, and how RAM moves.
#[derive(Clone)]
pub struct Options {
    pub secret: Vec<u8>,
    pub mode: Mode,
    /// Post-copy: most bytes per second the background push sends (asked pages are never
    /// held back), so a migration leaves room on a shared link; `None` sends as fast as
    /// the link takes them.
    pub push_limit: Option<u64>,
    /// Longest silence of the peer (not even a heartbeat) after the switch before it counts
    /// as lost.
    pub silence: Duration,
    /// How often a side with nothing else to send proves it lives, after the switch.
    pub heartbeat: Duration,
    /// Bound on connecting, on the handshake and on each answer before the switch (building
    /// the VM on the destination is one).
    pub setup_limit: Duration,
}

impl Options {
    pub fn new(secret: Vec<u8>) -> Options {
        Options {
            secret,
            mode: Mode::PostCopy,
            push_limit: None,
            silence: Duration::from_secs(10),
            heartbeat: Duration::from_secs(1),
            setup_limit: Duration::from_secs(30),
        }
    }

    fn params(&self, me: NodeId) -> LinkParams {
        LinkParams {
            me,
            secret: self.secret.clone(),
            config_hash: dsm_host::config_hash(LINK_CONFIG),
            config_parts: Vec::new(),
            timeout: self.setup_limit,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("secret", &"<redacted>")
            .field("mode", &self.mode)
            .field("push_limit", &self.push_limit)
            .field("silence", &self.silence)
            .field("heartbeat", &self.heartbeat)
            .field("setup_limit", &self.setup_limit)
            .finish()
    }
}

/// A migration URL that is not `tcp:HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("migration URL {url:?}: expected tcp:HOST:PORT (e.g. tcp:192.0.2.7:6000)")]
pub struct UrlError {
    pub url: String,
}

/// Why a secret file cannot be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("--secret-file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--secret-file {}: mode {mode:04o} lets others read or change the secret; make it 0600 \
         (chmod 600)",
        path.display()
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error("--secret-file {}: {len} bytes; a secret needs at least {MIN_SECRET}", path.display())]
    Short { path: PathBuf, len: usize },
}

/// Why the messages on a migration's link did not make sense, or the link failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Msg(#[from] protocol::MsgError),
    #[error("unexpected {0} frame on a migration link")]
    Frame(&'static str),
    #[error("{0:?} document longer than {MAX_DOCUMENT} bytes")]
    TooLong(Blob),
    #[error("expected the {what:?} document, got a {got} message")]
    NotDocument { what: Blob, got: &'static str },
    #[error("unexpected {0} message")]
    Unexpected(&'static str),
}

/// `HOST:PORT` of a `tcp:HOST:PORT` migration URL, or why it is not one.
pub fn parse_url(url: &str) -> Result<&str, UrlError> {
    match url.strip_prefix("tcp:") {
        Some(rest)
            if rest
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) =>
        {
            Ok(rest)
        }
        _ => Err(UrlError { url: url.into() }),
    }
}

/// The shared secret in `path`: at least [`MIN_SECRET`] bytes, in a file only its owner may
/// read or write.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, SecretError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| SecretError::Io {
        path: path.into(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Mode {
            path: path.into(),
            mode,
        });
    }
    let secret = std::fs::read(path).map_err(io)?;
    if secret.len() < MIN_SECRET {
        return Err(SecretError::Short {
            path: path.into(),
            len: secret.len(),
        });
    }
    Ok(secret)
}

/// Why no link to a peer came about; each names the peer, as `role` and address.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("{role} {to}: {source}")]
    Resolve {
        role: &'static str,
        to: String,
        source: std::io::Error,
    },
    #[error("{role} {to}: no address")]
    NoAddress { role: &'static str, to: String },
    #[error("cannot connect to the {role} {to}: {source}")]
    Connect {
        role: &'static str,
        to: String,
        source: std::io::Error,
    },
    #[error("{role} {to}: {source}")]
    Handshake {
        role: &'static str,
        to: String,
        source: Box<LinkError>,
    },
}

/// Connects to the listening end at `to` (`HOST:PORT`, whose part is `role`) and proves the
/// secret, each step bounded by the set-up limit.
pub(crate) fn dial(to: &str, role: &'static str, opts: &Options) -> Result<Link, DialError> {
    let addr = to
        .to_socket_addrs()
        .map_err(|source| DialError::Resolve {
            role,
            to: to.into(),
            source,
        })?
        .next()
        .ok_or_else(|| DialError::NoAddress {
            role,
            to: to.into(),
        })?;
    let stream = TcpStream::connect_timeout(&addr, opts.setup_limit).map_err(|source| {
        DialError::Connect {
            role,
            to: to.into(),
            source,
        }
    })?;
    Link::handshake(
        stream,
        Role::Dialer,
        Some(DESTINATION),
        &opts.params(SOURCE),
    )
    .map_err(|source| DialError::Handshake {
        role,
        to: to.into(),
        source: Box::new(source),
    })
}

/// Why the wait for a peer ended without one.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    #[error("{0}")]
    Stopped(String),
    #[error("waiting for a migration: {0}")]
    Transport(#[source] dsm_host::TransportError),
}

/// Asked now and then whether to give up waiting (a signal): `Some(why)` does.
pub(crate) type Stop<'a> = dyn FnMut() -> Option<String> + 'a;

/// Waits on `listener` for peers that prove the secret, and runs `session` with each until
/// one succeeds; a session that fails is logged (`what` from the peer, `refused`, and why)
/// and the wait goes on. A session gets `stop` too, for one that lasts.
/// Handshakes run as at a node's door (`dsm_host::door`): each on a thread of its own, a
/// short deadline each, so a silent or slow stranger cannot hold the real peer up; strangers
/// are logged too. `stop` is asked between waits: `Some(why)` gives up. `door` names this
/// end in what is logged.
pub(crate) fn serve_first<T, E: std::fmt::Display>(
    listener: &TcpListener,
    opts: &Options,
    door: &str,
    (what, refused): (&str, &str),
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
    session: &mut dyn FnMut(Link, &mut Stop<'_>) -> Result<T, E>,
) -> Result<T, ReceiveError> {
    let params = opts.params(DESTINATION);
    let limits = dsm_host::DoorLimits {
        handshake: dsm_host::DoorLimits::default()
            .handshake
            .min(opts.setup_limit),
        ..dsm_host::DoorLimits::default()
    };
    loop {
        let link = dsm_host::door::accept_one(&params, SOURCE, listener, limits, door, stop, log)
            .map(|(link, _)| link)
            .map_err(|e| match e {
                dsm_host::TransportError::Stopped(why) => ReceiveError::Stopped(why),
                other => ReceiveError::Transport(other),
            })?;
        let peer = link.addr;
        match session(link, &mut *stop) {
            Ok(t) => return Ok(t),
            Err(e) => log(&format!("{what} from {peer} {refused}: {e}; still waiting")),
        }
    }
}

/// The halves of a link to a peer that proved the secret, each wait bounded by the set-up
/// limit, and the VM configuration the peer sends first.
pub(crate) fn recv_config(
    link: Link,
    opts: &Options,
) -> Result<(LinkReader, LinkWriter, Vec<u8>), ProtocolError> {
    let Link {
        mut reader, writer, ..
    } = link;
    reader.limit_silence(opts.setup_limit)?;
    writer.limit_stall(opts.setup_limit)?;
    let first = recv(&mut reader)?;
    let config = recv_blob(&mut reader, Blob::Config, first)?;
    Ok((reader, writer, config))
}

pub(crate) fn send(w: &mut LinkWriter, m: &Msg) -> Result<(), LinkError> {
    w.send(&Envelope::Migration(m.encode()))
}

/// The next migration message; heartbeats are skipped, anything else is an error.
pub(crate) fn recv(r: &mut LinkReader) -> Result<Msg, ProtocolError> {
    loop {
        match r.recv()? {
            Envelope::Migration(b) => return Ok(Msg::decode(&b)?),
            Envelope::Heartbeat { .. } => continue,
            e => return Err(ProtocolError::Frame(e.name())),
        }
    }
}

pub(crate) fn send_blob(w: &mut LinkWriter, what: Blob, bytes: &[u8]) -> Result<(), LinkError> {
    for part in bytes.chunks(protocol::PART_BYTES) {
        send(w, &Msg::Part(what, part.to_vec()))?;
    }
    send(w, &Msg::End(what))
}

/// A document sent in parts; `first` is a message already read.
pub(crate) fn recv_blob(
    r: &mut LinkReader,
    what: Blob,
    first: Msg,
) -> Result<Vec<u8>, ProtocolError> {
    let mut out = Vec::new();
    let mut m = first;
    loop {
        match m {
            Msg::Part(b, bytes) if b == what => {
                if out.len() + bytes.len() > MAX_DOCUMENT {
                    return Err(ProtocolError::TooLong(what));
                }
                out.extend_from_slice(&bytes);
            }
            Msg::End(b) if b == what => return Ok(out),
            other => {
                return Err(ProtocolError::NotDocument {
                    what,
                    got: other.name(),
                })
            }
        }
        m = recv(r)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn urls_are_tcp_host_port() {
        assert_eq!(parse_url("tcp:127.0.0.1:4000").unwrap(), "127.0.0.1:4000");
        assert_eq!(parse_url("tcp:[::1]:4000").unwrap(), "[::1]:4000");
        for bad in [
            "127.0.0.1:4000",
            "tcp:host",
            "tcp::4000",
            "tcp:h:99999",
            "unix:/x",
        ] {
            assert!(
                parse_url(bad)
                    .unwrap_err()
                    .to_string()
                    .contains("tcp:HOST:PORT"),
                "{bad}"
            );
        }
    }

    #[test]
    fn secrets_must_be_private_and_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, [7u8; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_secret(&p)
            .unwrap_err()
            .to_string()
            .contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret(&p).unwrap(), [7u8; 32]);
        std::fs::write(&p, b"short").unwrap();
        assert!(read_secret(&p)
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        assert!(read_secret(&dir.path().join("none"))
            .unwrap_err()
            .to_string()
            .contains("none"));
    }
}
