//! The host side of the device (Firecracker's and Cloud Hypervisor's "hybrid vsock"): a UNIX
//! listener at PATH where a host program asks for a guest port with `CONNECT <port>\n` and
//! gets `OK <hostport>\n`, and for a guest connecting to host port P a connection to the
//! UNIX listener at `PATH_P`. It keeps the connections, routes guest packets to them and
//! picks the next packet for the guest.
//!
//! Every socket sits in an epoll set of the muxer's own, watched edge-triggered; the
//! device's owner watches that one descriptor, whose list of sockets changes as
//! connections come and go.

use super::conn::{Conn, State};
use super::packet::*;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use tracing::debug;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

/// Connections at once, either way. A further host program is refused (closed) and a
/// further guest REQUEST reset.
pub const MAX_CONNS: usize = 64;
/// Host programs that have connected but not yet sent their CONNECT line; past this the
/// oldest silent one is dropped, so silent clients cannot keep the others out (one whose
/// line may still be unread is not dropped; see `Muxer::accept`).
pub const MAX_PENDING_CLIENTS: usize = 16;
/// Longest CONNECT line, newline included.
const MAX_LINE: usize = 32;
/// RSTs to unknown connections waiting for a guest buffer; past this they are dropped
/// (they are courtesy only: the guest's own timeout ends such a connection too).
const MAX_QUEUED_RSTS: usize = 64;
const ACCEPTS_PER_PASS: usize = 32;
const EVENTS_PER_PASS: usize = 64;
/// Local ports given to host-initiated connections start here, clear of the small ports
/// guest listeners and host listeners use.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// How long a host program's CONNECT waits for the guest's RESPONSE before the device gives
/// up on it (RST to the guest, the client closed), as Firecracker does.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

const LISTENER: u64 = 0;
const RESUME: u64 = 1;
const TIMER: u64 = 2;

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("vsock: guest cid {0} is reserved; use 3 or more")]
    Cid(u64),
    #[error("vsock socket {}: {what}: {source}", path.display())]
    Socket {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
}

/// (host-side port, guest port).
type Key = (u32, u32);

/// The listener's socket file, removed with the device, but only while it is still the file
/// this device made: a later VM (or this VM moved to another process) may have taken the
/// path since. A listener bound beside its path ([`Muxer::staged`]) is moved onto it by
/// [`SocketFile::take_over`]; every clone sees where the file is now.
#[derive(Clone, Debug)]
pub struct SocketFile {
    /// Where host programs look for it.
    path: PathBuf,
    at: std::sync::Arc<std::sync::Mutex<Bound>>,
}

#[derive(Debug)]
struct Bound {
    /// Where the file is now: `path`, or beside it until taken over.
    file: PathBuf,
    /// (device, inode) of the file as bound (a rename keeps it).
    id: Option<(u64, u64)>,
}

/// Why a staged listener could not take its path.
#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    #[error(
        "vsock socket {}: something other than a socket is there; a moved VM replaces only \
         a socket (its previous listener's)",
        .0.display()
    )]
    NotASocket(PathBuf),
    #[error("vsock socket {}: cannot move the listener there from {}: {source}", path.display(), from.display())]
    Rename {
        path: PathBuf,
        from: PathBuf,
        source: io::Error,
    },
}

impl SocketFile {
    fn of(path: &Path, file: &Path) -> SocketFile {
        use std::os::unix::fs::MetadataExt;
        SocketFile {
            path: path.to_path_buf(),
            at: std::sync::Arc::new(std::sync::Mutex::new(Bound {
                file: file.to_path_buf(),
                id: std::fs::symlink_metadata(file)
                    .ok()
                    .map(|m| (m.dev(), m.ino())),
            })),
        }
    }

    fn bound(&self) -> std::sync::MutexGuard<'_, Bound> {
        self.at.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (device, inode) of the listener's file as bound: the same after a take-over, so
    /// another process on this host can tell this listener's file from any other.
    pub fn id(&self) -> Option<(u64, u64)> {
        self.bound().id
    }

    /// Where the listener's file is now (beside `path` until taken over).
    pub fn file(&self) -> PathBuf {
        self.bound().file.clone()
    }

    /// Moves a staged listener onto its path in one rename, replacing the socket another
    /// process (the VM's previous home) still listens on there: from here on host programs
    /// reach this one, and that process's own [`SocketFile::remove`] leaves this file be.
    /// Nothing but a socket is replaced. Done once; later calls do nothing.
    pub fn take_over(&self) -> Result<(), TakeOverError> {
        use std::os::unix::fs::FileTypeExt;
        let mut b = self.bound();
        if b.file == self.path {
            return Ok(());
        }
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if !m.file_type().is_socket() {
                return Err(TakeOverError::NotASocket(self.path.clone()));
            }
        }
        std::fs::rename(&b.file, &self.path).map_err(|source| TakeOverError::Rename {
            path: self.path.clone(),
            from: b.file.clone(),
            source,
        })?;
        b.file = self.path.clone();
        Ok(())
    }

    pub fn remove(&self) {
        use std::os::unix::fs::MetadataExt;
        let b = self.bound();
        match std::fs::symlink_metadata(&b.file) {
            Ok(m) if Some((m.dev(), m.ino())) == b.id => {
                let _ = std::fs::remove_file(&b.file);
            }
            _ => {}
        }
    }
}

/// Where [`Muxer::staged`] binds for `path`: beside it, in the same directory (a rename
/// moves it), named for this process.
pub fn staging_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.moving", std::process::id()));
    path.with_file_name(name)
}

struct Client {
    stream: UnixStream,
    line: Vec<u8>,
    /// `Muxer::drains` when it was taken: once a later batch of events has collected every
    /// ready one, a client still without its line is silent, not unread.
    drained_at: u64,
}

enum Entry {
    Client(Client),
    Conn(Key),
}

pub struct Muxer {
    cid: u64,
    path: PathBuf,
    file: SocketFile,
    /// Guest REQUESTs for host ports, connected on the next pass: the connecting is done
    /// where the device's events are served, never on a vCPU thread (whose system-call
    /// filter has no `socket` or `connect`).
    connects: VecDeque<Header>,
    listener: UnixListener,
    epoll: Epoll,
    resume: EventFd,
    /// Fires at the earliest CONNECT that waits for the guest's answer.
    timer: TimerFd,
    entries: HashMap<u64, Entry>,
    conns: HashMap<Key, (Conn, u64)>,
    /// Connections with something for the guest, each at most once (`Conn::queued`).
    work: VecDeque<Key>,
    /// RSTs answering packets that named no connection.
    rsts: VecDeque<Header>,
    next_token: u64,
    next_port: u32,
    /// Batches of events that collected every ready one (fewer than a full batch).
    drains: u64,
    /// The listener reported new clients, or may hold more than `accept` took (it reports
    /// no new edge for those): `accept` runs after the batch's clients are read.
    backlog_left: bool,
}

fn socket_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> VsockError + 'a {
    move |source| VsockError::Socket {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// A connection to the UNIX listener at `path` that never waits: a listener whose backlog
/// is full refuses rather than holding the device's thread.
fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::other("socket path too long"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain system call; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a filled sockaddr_un and the length is its size.
    let r = unsafe {
        libc::connect(
            fd,
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

/// `CONNECT <port>\n` → the port.
fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?;
    let port = s.strip_prefix("CONNECT ")?.trim_end_matches(['\r', '\n']);
    port.parse().ok()
}

impl Muxer {
    /// Listens at `path`, which must not exist yet.
    pub fn new(cid: u64, path: &Path) -> Result<Muxer, VsockError> {
        Muxer::bound_at(cid, path, path)
    }

    /// Listens beside `path` ([`staging_path`]) for a VM that arrives while its previous
    /// process still listens at `path`: [`SocketFile::take_over`] moves the listener onto
    /// `path` once the VM is this process's. Guests still reach host listeners at
    /// `PATH_P` meanwhile.
    pub fn staged(cid: u64, path: &Path) -> Result<Muxer, VsockError> {
        Muxer::bound_at(cid, path, &staging_path(path))
    }

    fn bound_at(cid: u64, path: &Path, file: &Path) -> Result<Muxer, VsockError> {
        if cid <= HOST_CID || cid > u64::from(u32::MAX) - 1 {
            return Err(VsockError::Cid(cid));
        }
        let listener = UnixListener::bind(file).map_err(socket_err(file, "cannot listen"))?;
        let m = Muxer::with_listener(cid, path, file, listener);
        if m.is_err() {
            let _ = std::fs::remove_file(file);
        }
        m
    }

    fn with_listener(
        cid: u64,
        path: &Path,
        file: &Path,
        listener: UnixListener,
    ) -> Result<Muxer, VsockError> {
        listener
            .set_nonblocking(true)
            .map_err(socket_err(path, "non-blocking listener"))?;
        let epoll = Epoll::new().map_err(socket_err(path, "epoll"))?;
        let resume = EventFd::new(EFD_NONBLOCK).map_err(socket_err(path, "eventfd"))?;
        let timer = TimerFd::new().map_err(|e| VsockError::Socket {
            path: path.to_path_buf(),
            what: "timerfd",
            source: e.into(),
        })?;
        for (fd, token) in [
            (listener.as_raw_fd(), LISTENER),
            (resume.as_raw_fd(), RESUME),
            (timer.as_raw_fd(), TIMER),
        ] {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, token),
                )
                .map_err(socket_err(path, "epoll_ctl"))?;
        }
        Ok(Muxer {
            cid,
            path: path.to_path_buf(),
            file: SocketFile::of(path, file),
            connects: VecDeque::new(),
            listener,
            epoll,
            resume,
            timer,
            entries: HashMap::new(),
            conns: HashMap::new(),
            work: VecDeque::new(),
            rsts: VecDeque::new(),
            next_token: TIMER + 1,
            next_port: FIRST_LOCAL_PORT,
            drains: 0,
            backlog_left: false,
        })
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn socket_file(&self) -> SocketFile {
        self.file.clone()
    }

    /// The one descriptor the owner watches: readable when any socket has news.
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Asks for another pass soon: work was left that no socket will report again.
    pub fn kick(&self) {
        if let Err(e) = self.resume.write(1) {
            debug!("vsock: resume eventfd: {e}");
        }
    }

    pub fn has_rx_work(&self) -> bool {
        !self.rsts.is_empty() || !self.work.is_empty() || !self.connects.is_empty()
    }

    /// Drops every connection (the driver reset the device or the VM moved): host programs
    /// see their socket closed. Waiting clients stay.
    pub fn reset(&mut self) {
        for (_, (_, token)) in self.conns.drain() {
            self.entries.remove(&token);
        }
        self.work.clear();
        self.rsts.clear();
        self.connects.clear();
    }

    fn watch(&mut self, fd: RawFd, entry: Entry) -> io::Result<u64> {
        let token = self.next_token;
        self.next_token += 1;
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(
                EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
                token,
            ),
        )?;
        self.entries.insert(token, entry);
        Ok(token)
    }

    fn queue(&mut self, key: Key) {
        if let Some((c, _)) = self.conns.get_mut(&key) {
            if !c.queued && c.has_rx_work() {
                c.queued = true;
                self.work.push_back(key);
            }
        }
    }

    fn remove(&mut self, key: Key) {
        if let Some((_, token)) = self.conns.remove(&key) {
            self.entries.remove(&token);
        }
    }

    /// Resets a connection: the host end is closed now, the guest told by an RST.
    fn reset_conn(&mut self, key: Key, why: &str) {
        debug!(
            local = key.0,
            peer = key.1,
            "vsock: connection reset: {why}"
        );
        if let Some((c, token)) = self.conns.get_mut(&key) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            c.owed = Default::default();
            c.owed.rst = true;
            c.host_readable = false;
            let token = *token;
            // The socket is closed with the connection once the RST is out; it says nothing
            // more meanwhile.
            if let Some(Entry::Conn(_)) = self.entries.get(&token) {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    c.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
        }
        self.queue(key);
    }

    fn rst_for(&mut self, h: &Header) {
        if h.op == OP_RST {
            return;
        }
        if self.rsts.len() >= MAX_QUEUED_RSTS {
            debug!("vsock: RST queue full, one dropped");
            return;
        }
        let mut r = h.reply(OP_RST);
        r.src_cid = HOST_CID;
        r.dst_cid = self.cid;
        self.rsts.push_back(r);
    }

    /// Serves what the sockets reported since the last pass. In each batch of events the
    /// clients are read before the listener's new clients are taken, so that a client is
    /// dropped for silence only after a batch that collected every ready event has shown it
    /// had no line (see `Client::drained_at`).
    pub fn handle_events(&mut self) {
        while let Some(h) = self.connects.pop_front() {
            self.guest_connect(&h);
        }
        let mut events = [EpollEvent::default(); EVENTS_PER_PASS];
        for _ in 0..8 {
            let n = match self.epoll.wait(0, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    debug!("vsock: epoll_wait: {e}");
                    return;
                }
            };
            for ev in &events[..n] {
                let set = ev.event_set();
                match ev.data() {
                    LISTENER => self.backlog_left = true,
                    RESUME => {
                        let _ = self.resume.read();
                    }
                    TIMER => self.expire_connects(),
                    token => self.socket_event(token, set),
                }
            }
            let all = n < events.len();
            if all {
                self.drains += 1;
            }
            if std::mem::take(&mut self.backlog_left) {
                self.accept();
            }
            if all {
                return;
            }
        }
        // Edges not yet collected stay in the set; come back for them.
        self.kick();
    }

    /// Takes new clients from the listener, up to a budget per pass. Whatever it leaves
    /// there (budget spent, or every pending client still unread) is taken on a later pass:
    /// the listener reports no new edge for it.
    fn accept(&mut self) {
        for _ in 0..ACCEPTS_PER_PASS {
            let clients: Vec<(u64, u64)> = self
                .entries
                .iter()
                .filter_map(|(t, e)| match e {
                    Entry::Client(c) => Some((*t, c.drained_at)),
                    Entry::Conn(_) => None,
                })
                .collect();
            let mut pending = clients.len();
            let silent = clients
                .iter()
                .filter(|(_, at)| *at < self.drains)
                .min()
                .map(|(t, _)| *t);
            if pending >= MAX_PENDING_CLIENTS && silent.is_none() {
                // Every pending client may have its line queued, unread: read them first.
                self.backlog_left = true;
                self.kick();
                return;
            }
            // SAFETY: plain system call on the listener's descriptor; the result is checked.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => return,
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        // ECONNABORTED and friends concern one client; EMFILE would repeat.
                        debug!("vsock: accept: {e}");
                        if e.raw_os_error() == Some(libc::ECONNABORTED) {
                            continue;
                        }
                        return;
                    }
                }
            }
            // SAFETY: accept4 returned a new descriptor nothing else owns.
            let stream = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
            if pending >= MAX_PENDING_CLIENTS {
                if let Some(oldest) = silent {
                    debug!("vsock: too many clients without a CONNECT line; oldest dropped");
                    self.entries.remove(&oldest);
                    pending -= 1;
                }
            }
            if self.conns.len() + pending >= MAX_CONNS {
                debug!("vsock: connection limit reached; host client refused");
                continue;
            }
            let raw = stream.as_raw_fd();
            if let Err(e) = self.watch(
                raw,
                Entry::Client(Client {
                    stream,
                    line: Vec::new(),
                    drained_at: self.drains,
                }),
            ) {
                debug!("vsock: watching a client: {e}");
            }
        }
        // More may wait; the listener will not report them again.
        self.backlog_left = true;
        self.kick();
    }

    fn socket_event(&mut self, token: u64, set: EventSet) {
        match self.entries.get_mut(&token) {
            Some(Entry::Client(_)) => self.client_readable(token),
            Some(Entry::Conn(key)) => {
                let key = *key;
                let Some((c, _)) = self.conns.get_mut(&key) else {
                    return;
                };
                if set.intersects(
                    EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP | EventSet::ERROR,
                ) {
                    c.host_readable = true;
                }
                if set.contains(EventSet::OUT) {
                    if let Err(why) = c.flush() {
                        self.reset_conn(key, why);
                        return;
                    }
                    self.after_flush(key);
                }
                self.queue(key);
            }
            None => {}
        }
    }

    /// A closing connection whose bytes have all reached the host ends.
    fn after_flush(&mut self, key: Key) {
        if let Some((c, _)) = self.conns.get_mut(&key) {
            if c.state == State::Closing && c.flushed() {
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
                self.reset_conn(key, "guest closed");
            }
        }
    }

    fn client_readable(&mut self, token: u64) {
        let Some(Entry::Client(client)) = self.entries.get_mut(&token) else {
            return;
        };
        let mut buf = [0u8; MAX_LINE];
        let room = MAX_LINE - client.line.len();
        let n = loop {
            match client.stream.read(&mut buf[..room]) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => break 0,
            }
        };
        if n == 0 {
            self.entries.remove(&token);
            return;
        }
        client.line.extend_from_slice(&buf[..n]);
        let Some(end) = client.line.iter().position(|&b| b == b'\n') else {
            if client.line.len() >= MAX_LINE {
                debug!("vsock: host client sent no CONNECT line; closed");
                self.entries.remove(&token);
            }
            return;
        };
        let Some(Entry::Client(client)) = self.entries.remove(&token) else {
            return;
        };
        let Some(port) = parse_connect(&client.line[..=end]) else {
            debug!("vsock: host client sent a bad CONNECT line; closed");
            return;
        };
        if self.conns.len() >= MAX_CONNS {
            debug!("vsock: connection limit reached; CONNECT {port} refused");
            return;
        }
        let Some(local) = self.free_local_port(port) else {
            return;
        };
        let mut c = Conn::new(client.stream, local, port, State::Connecting);
        c.prefix = client.line[end + 1..].to_vec();
        c.owed.request = true;
        c.deadline = Some(std::time::Instant::now() + CONNECT_TIMEOUT);
        let key = (local, port);
        self.entries.insert(token, Entry::Conn(key));
        self.conns.insert(key, (c, token));
        self.queue(key);
        self.arm_timer();
        // Bytes past the line may have been all there was; say so on the next read.
        if let Some((c, _)) = self.conns.get_mut(&key) {
            c.host_readable = true;
        }
    }

    /// Sets the timer for the earliest CONNECT still waiting for the guest.
    fn arm_timer(&mut self) {
        let now = std::time::Instant::now();
        let next = self
            .conns
            .values()
            .filter(|(c, _)| c.state == State::Connecting && !c.owed.rst)
            .filter_map(|(c, _)| c.deadline)
            .min();
        let result = match next {
            Some(d) => self.timer.reset(
                d.saturating_duration_since(now)
                    .max(std::time::Duration::from_millis(1)),
                None,
            ),
            None => self.timer.clear(),
        };
        if let Err(e) = result {
            debug!("vsock: connect timer: {e}");
        }
    }

    /// Gives up on the CONNECTs the guest has not answered in time.
    fn expire_connects(&mut self) {
        let now = std::time::Instant::now();
        let late: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, (c, _))| {
                c.state == State::Connecting && !c.owed.rst && c.deadline.is_some_and(|d| d <= now)
            })
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            self.reset_conn(key, "the guest did not answer a CONNECT in time");
        }
        self.arm_timer();
    }

    fn free_local_port(&mut self, peer: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNS {
            let p = self.next_port;
            self.next_port = self.next_port.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.contains_key(&(p, peer)) {
                return Some(p);
            }
        }
        None
    }

    /// A packet from the guest: `data` is its payload, already checked to be `h.len`
    /// bytes. Anything that does not fit a connection's state resets it.
    pub fn from_guest(&mut self, h: &Header, data: &[u8]) {
        if h.src_cid != self.cid || h.dst_cid != HOST_CID {
            debug!(
                src = h.src_cid,
                dst = h.dst_cid,
                "vsock: packet with foreign cids dropped"
            );
            return;
        }
        if h.type_ != TYPE_STREAM {
            self.rst_for(h);
            return;
        }
        let key = (h.dst_port, h.src_port);
        let Some((c, _)) = self.conns.get_mut(&key) else {
            match h.op {
                OP_REQUEST if self.connects.len() < MAX_CONNS => {
                    self.connects.push_back(*h);
                    self.kick();
                }
                OP_RST => {}
                _ => self.rst_for(h),
            }
            return;
        };
        if c.owed.rst {
            // Reset already: the RST on its way says all there is to say.
            if h.op == OP_RST {
                self.remove(key);
            }
            return;
        }
        c.peer_credit_from(h);
        let result: Result<(), &'static str> = match (h.op, c.state) {
            (OP_RESPONSE, State::Connecting) => {
                c.state = State::Established;
                let ok = format!("OK {}\n", c.local_port);
                match c.stream.write(ok.as_bytes()) {
                    Ok(n) if n == ok.len() => Ok(()),
                    _ => Err("host client gone before the guest answered"),
                }
            }
            (OP_RW, State::Established) => c.from_guest(data),
            (OP_RW, State::Closing) => Err("data after the guest shut down"),
            (OP_CREDIT_UPDATE, _) => Ok(()),
            (OP_CREDIT_REQUEST, _) => {
                c.owed.credit_update = true;
                Ok(())
            }
            (OP_SHUTDOWN, State::Established) => {
                if h.flags & SHUTDOWN_SEND != 0 {
                    c.state = State::Closing;
                }
                Ok(())
            }
            (OP_RST, _) => {
                self.remove(key);
                return;
            }
            (OP_SHUTDOWN, _) => Ok(()),
            (OP_RESPONSE | OP_REQUEST | OP_RW, _) => Err("packet out of turn"),
            _ => Err("unknown op"),
        };
        match result {
            Err(why) => self.reset_conn(key, why),
            Ok(()) => {
                self.after_flush(key);
                self.queue(key);
            }
        }
    }

    fn guest_connect(&mut self, h: &Header) {
        if self.conns.contains_key(&(h.dst_port, h.src_port)) {
            // A second REQUEST for a connection made meanwhile.
            self.reset_conn((h.dst_port, h.src_port), "REQUEST for a live connection");
            return;
        }
        if self.conns.len() >= MAX_CONNS {
            debug!("vsock: connection limit reached; guest REQUEST refused");
            self.rst_for(h);
            return;
        }
        let mut target = self.path.clone().into_os_string();
        target.push(format!("_{}", h.dst_port));
        let stream = match connect_nonblocking(Path::new(&target)) {
            Ok(s) => s,
            Err(e) => {
                debug!(port = h.dst_port, "vsock: guest connect refused: {e}");
                self.rst_for(h);
                return;
            }
        };
        let key = (h.dst_port, h.src_port);
        let mut c = Conn::new(stream, h.dst_port, h.src_port, State::Established);
        c.peer_credit_from(h);
        c.owed.response = true;
        let raw = c.stream.as_raw_fd();
        match self.watch(raw, Entry::Conn(key)) {
            Ok(token) => {
                self.conns.insert(key, (c, token));
                self.queue(key);
            }
            Err(e) => {
                debug!("vsock: watching a connection: {e}");
                self.rst_for(h);
            }
        }
    }

    /// The next packet for the guest, its payload (if any) read into `buf`; `None` when
    /// nothing is due.
    pub fn next_rx(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(h) = self.rsts.pop_front() {
            return Some((h, 0));
        }
        while let Some(&key) = self.work.front() {
            let Some((c, _)) = self.conns.get_mut(&key) else {
                self.work.pop_front();
                continue;
            };
            let mut h = Header {
                src_cid: HOST_CID,
                dst_cid: self.cid,
                src_port: c.local_port,
                dst_port: c.peer_port,
                type_: TYPE_STREAM,
                ..Header::default()
            };
            let mut len = 0;
            let mut done = false;
            if c.owed.rst {
                h.op = OP_RST;
                done = true;
            } else if c.owed.request {
                c.owed.request = false;
                h.op = OP_REQUEST;
            } else if c.owed.response {
                c.owed.response = false;
                h.op = OP_RESPONSE;
            } else if c.owed.shutdown {
                c.owed.shutdown = false;
                c.owed.rst = true;
                h.op = OP_SHUTDOWN;
                h.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
            } else if c.state == State::Established
                && (c.host_readable || !c.prefix.is_empty())
                && c.peer_credit() > 0
            {
                match c.read_host(buf) {
                    Ok(0) => {
                        // The host closed: tell the guest no more is coming, then reset.
                        c.host_readable = false;
                        h.op = OP_SHUTDOWN;
                        h.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
                        c.owed.rst = true;
                    }
                    Ok(n) => {
                        h.op = OP_RW;
                        len = n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => {
                        self.reset_conn(key, "host end failed");
                        continue;
                    }
                }
            }
            if h.op == 0 && c.owed.credit_update {
                h.op = OP_CREDIT_UPDATE;
            }
            if h.op != 0 {
                c.owed.credit_update = false;
                c.stamp(&mut h);
                h.len = len as u32;
            }
            // The connection goes to the back if it has more, leaves the list if not.
            self.work.pop_front();
            c.queued = false;
            if done {
                self.remove(key);
            } else {
                self.queue(key);
            }
            if h.op != 0 {
                return Some((h, len));
            }
        }
        None
    }
}

impl Drop for Muxer {
    /// The socket file goes with the VM, so the next VM can listen at the same path.
    fn drop(&mut self) {
        self.file.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52\n"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 52\r\n"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 4294967295\n"), Some(u32::MAX));
        assert_eq!(parse_connect(b"CONNECT 4294967296\n"), None);
        assert_eq!(parse_connect(b"connect 52\n"), None);
        assert_eq!(parse_connect(b"CONNECT -1\n"), None);
        assert_eq!(parse_connect(b"\xff\xfe\n"), None);
    }

    #[test]
    fn reserved_cids_and_taken_paths_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        assert!(matches!(Muxer::new(2, &path), Err(VsockError::Cid(2))));
        let m = Muxer::new(3, &path).unwrap();
        let e = Muxer::new(4, &path).err().unwrap().to_string();
        assert!(e.contains("v.sock") && e.contains("cannot listen"), "{e}");
        drop(m);
        assert!(!path.exists(), "socket file left behind");
    }

    #[test]
    fn a_staged_listener_takes_over_the_path_from_another_listener_there() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let before = Muxer::new(3, &path).unwrap();
        let after = Muxer::staged(3, &path).unwrap();
        let file = after.socket_file();
        assert_eq!(file.file(), staging_path(&path));
        assert_eq!(after.path(), path);
        file.take_over().unwrap();
        assert_eq!(file.file(), path);
        assert!(!staging_path(&path).exists());
        file.take_over().unwrap();
        // The previous listener goes and leaves the path to the one that took it.
        drop(before);
        assert!(
            path.exists(),
            "the previous listener removed its successor's file"
        );
        UnixStream::connect(&path).expect("the new listener takes clients");
        drop(after);
        assert!(!path.exists(), "socket file left behind");
    }

    #[test]
    fn a_staged_listener_replaces_nothing_but_a_socket_and_goes_unmoved() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        std::fs::write(&path, b"keep me").unwrap();
        let m = Muxer::staged(3, &path).unwrap();
        let e = m.socket_file().take_over().unwrap_err().to_string();
        assert!(
            e.contains("v.sock") && e.contains("other than a socket"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
        drop(m);
        assert!(!staging_path(&path).exists(), "staged file left behind");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
    }
}
