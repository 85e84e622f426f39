//! The API thread: owns the listening socket and serves its connections one request each,
//! with a poll(2) loop, so a slow or silent client never holds up another.

use crate::http::{self, Parsed, Response};
use crate::routes::{self, PingInfo};
use crate::VmControl;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Clients held at once, which bounds the memory the API thread keeps for them. The
/// listener is polled all the same: a client past the limit takes the place of the one held
/// longest, so slow clients cannot keep a prompt one waiting in the kernel's backlog.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a client has from being accepted (at once, as it connects, unless an action is
/// running) to a complete request (and, once answered, to take the answer): one that says
/// nothing, or too little, is closed after this.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// What the API thread's filter may fail with: whatever the caller's filter reports.
pub type FilterError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Something other than a socket is at the path: never removed, it may be the user's.
    #[error("API socket {}: the path exists and is not a socket (not replaced)", .0.display())]
    NotASocket(PathBuf),
    /// Another process answers on the socket at the path.
    #[error("API socket {}: another process is serving on it", .0.display())]
    InUse(PathBuf),
    #[error("API socket {}: cannot {op}: {source}", path.display())]
    Socket {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("cannot start the API thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The filter the caller installs on the API thread failed; the thread has ended.
    #[error("API thread: {0}")]
    Filter(#[source] FilterError),
    /// The API thread ended before it reported on its filter.
    #[error("API thread: the thread ended before serving")]
    Ended,
}

/// A running API server. Stopping it (or dropping it) ends its thread and removes the
/// socket file.
pub struct ApiServer {
    path: PathBuf,
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `path` (so every error is reported here, naming it) and starts the thread
    /// named "api", which calls `filter` (where the caller installs its seccomp filter)
    /// before it serves anything; an error from `filter` is returned here.
    pub fn start(
        path: &Path,
        control: Arc<dyn VmControl>,
        filter: impl FnOnce() -> Result<(), FilterError> + Send + 'static,
    ) -> Result<ApiServer, ApiError> {
        let listener = bind(path)?;
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            let source = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(path);
            return Err(socket_error(path, "create its stop eventfd", source));
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let stop = unsafe { OwnedFd::from_raw_fd(fd) };
        let stop_poll = match stop.try_clone() {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(socket_error(path, "duplicate its stop eventfd", e));
            }
        };
        // Taken here: the thread's filter need not allow the calls behind them.
        let ping = PingInfo::current();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                let filtered = filter();
                let ok = filtered.is_ok();
                let _ = ready_tx.send(filtered);
                if ok {
                    serve(&listener, &stop_poll, &*control, &ping, uid);
                }
            });
        let thread = match spawned {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(ApiError::Thread(e));
            }
        };
        let server = ApiServer {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(server),
            Ok(Err(e)) => Err(ApiError::Filter(e)),
            Err(_) => Err(ApiError::Ended),
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Ends the thread (a request being answered is finished first) and removes the socket.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one` to the eventfd this server owns.
        unsafe {
            libc::write(
                self.stop.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        let _ = thread.join();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn socket_error(path: &Path, op: &'static str, source: std::io::Error) -> ApiError {
    ApiError::Socket {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// A listening socket at `path`, its file mode 0600 before any client can connect: the
/// mode is set between bind and listen, and connecting before listen is refused.
fn bind(path: &Path) -> Result<UnixListener, ApiError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => return Err(ApiError::NotASocket(path.into())),
        // A socket file nobody answers on is left from a run that ended without cleaning
        // up; one somebody answers on belongs to a live server.
        Ok(_) if UnixStream::connect(path).is_ok() => return Err(ApiError::InUse(path.into())),
        Ok(_) => std::fs::remove_file(path)
            .map_err(|e| socket_error(path, "remove the stale socket", e))?,
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(socket_error(path, "inspect the path", e)),
    }
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value to fill in.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(socket_error(
            path,
            "bind",
            std::io::Error::new(
                ErrorKind::InvalidInput,
                format!("the path is longer than {} bytes", addr.sun_path.len() - 1),
            ),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: socket takes no pointers; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(socket_error(
            path,
            "create a socket",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a filled sockaddr_un and the length is its size.
    let r = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(socket_error(path, "bind", std::io::Error::last_os_error()));
    }
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        let _ = std::fs::remove_file(path);
        return Err(socket_error(path, "set its mode to 0600", e));
    }
    // SAFETY: listen takes no pointers.
    if unsafe { libc::listen(sock.as_raw_fd(), MAX_CONNECTIONS as libc::c_int) } < 0 {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_file(path);
        return Err(socket_error(path, "listen", e));
    }
    Ok(UnixListener::from(sock))
}

/// Who is at the other end of `stream` (its pid, uid and gid, as the kernel recorded them
/// when it connected): the API server and a partition's supervisor admit clients by it.
pub fn peer_credentials(stream: &UnixStream) -> std::io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

/// One client: reading its request, then writing its answer.
struct Conn {
    stream: UnixStream,
    read: Vec<u8>,
    /// The answer and how much of it is written; `None` while the request is read.
    answer: Option<(Vec<u8>, usize)>,
    continue_sent: bool,
    deadline: Instant,
}

#[derive(Debug, PartialEq, Eq)]
enum Progress {
    Open,
    Done,
}

impl Conn {
    fn new(stream: UnixStream) -> Self {
        Conn {
            stream,
            read: Vec::new(),
            answer: None,
            continue_sent: false,
            deadline: Instant::now() + DEADLINE,
        }
    }

    fn on_readable(&mut self, vm: &dyn VmControl, ping: &PingInfo) -> Progress {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Progress::Done,
                Ok(n) => self.read.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Progress::Done,
            }
            if self.read.len() > http::MAX_HEAD + http::MAX_BODY {
                break;
            }
        }
        let response = match http::parse(&self.read) {
            Parsed::Incomplete { expect_continue } => {
                if expect_continue && !self.continue_sent {
                    self.continue_sent = true;
                    let _ = self.stream.write_all(&Response::empty(100).to_bytes());
                }
                return Progress::Open;
            }
            Parsed::Refused(r) => r,
            Parsed::Request(req) => {
                let r = routes::handle(&req, vm, ping);
                tracing::debug!("API {} {}: {}", req.method, req.path, r.status);
                r
            }
        };
        self.answer = Some((response.to_bytes(), 0));
        // The action may have taken long; the client gets its own time to take the answer.
        self.deadline = Instant::now() + DEADLINE;
        self.on_writable()
    }

    fn on_writable(&mut self) -> Progress {
        let Some((bytes, done)) = &mut self.answer else {
            return Progress::Open;
        };
        while *done < bytes.len() {
            match self.stream.write(&bytes[*done..]) {
                Ok(0) => return Progress::Done,
                Ok(n) => *done += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Progress::Open,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Progress::Done,
            }
        }
        Progress::Done
    }
}

fn pollfd(fd: i32, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// Serves until `stop` is readable.
fn serve(
    listener: &UnixListener,
    stop: &OwnedFd,
    vm: &dyn VmControl,
    ping: &PingInfo,
    uid: libc::uid_t,
) {
    let mut conns: Vec<Conn> = Vec::new();
    loop {
        let mut fds = vec![pollfd(stop.as_raw_fd(), libc::POLLIN)];
        fds.push(pollfd(listener.as_raw_fd(), libc::POLLIN));
        for c in &conns {
            let events = if c.answer.is_some() {
                libc::POLLOUT
            } else {
                libc::POLLIN
            };
            fds.push(pollfd(c.stream.as_raw_fd(), events));
        }
        let now = Instant::now();
        let timeout = conns
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min()
            .map_or(-1, |d| d.as_millis().min(i32::MAX as u128) as i32 + 1);
        // SAFETY: `fds` holds `fds.len()` initialised pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("API server: poll failed, no longer serving: {e}");
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        // Connections first, by index into `fds` as built above; then drop the finished.
        let mut keep = Vec::with_capacity(conns.len());
        for (mut c, pfd) in conns.drain(..).zip(&fds[2..]) {
            let progress = if pfd.revents & libc::POLLIN != 0 {
                c.on_readable(vm, ping)
            } else if pfd.revents & libc::POLLOUT != 0 {
                c.on_writable()
            } else if pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                Progress::Done
            } else {
                Progress::Open
            };
            let expired = Instant::now() >= c.deadline;
            if matches!(progress, Progress::Open) && !expired {
                keep.push(c);
            } else if expired && matches!(progress, Progress::Open) {
                tracing::debug!("API: closing a client that did not finish in time");
            }
        }
        conns = keep;
        if fds[1].revents != 0 {
            accept(listener, &mut conns, uid, vm, ping);
        }
    }
}

/// Takes the waiting clients, refusing any but this process's user and root. A request
/// already sent is answered at once. At the limit the client held longest (one still
/// sending its request before one taking its answer) is closed to make room: it has had
/// the most time, and a client that sends its request as it connects is served however
/// many slow ones there are. At most a full set is taken per turn, so a stream of
/// connections cannot starve the clients held.
fn accept(
    listener: &UnixListener,
    conns: &mut Vec<Conn>,
    uid: libc::uid_t,
    vm: &dyn VmControl,
    ping: &PingInfo,
) {
    for _ in 0..MAX_CONNECTIONS {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            // A client gone before it was taken (ECONNABORTED) and the like.
            Err(e) => {
                tracing::debug!("API: accept: {e}");
                return;
            }
        };
        match peer_credentials(&stream).map(|c| c.uid) {
            Ok(peer) if peer == uid || peer == 0 => {}
            Ok(peer) => {
                tracing::warn!("API: refused a client of uid {peer} (serving uid {uid} and root)");
                continue;
            }
            Err(e) => {
                tracing::warn!("API: refused a client whose credentials are unknown: {e}");
                continue;
            }
        }
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let mut conn = Conn::new(stream);
        if conn.on_readable(vm, ping) == Progress::Done {
            continue;
        }
        if conns.len() >= MAX_CONNECTIONS {
            make_room(conns);
        }
        conns.push(conn);
    }
}

/// Closes the client held longest, preferring one still sending its request.
fn make_room(conns: &mut Vec<Conn>) {
    let oldest = conns
        .iter()
        .enumerate()
        .min_by_key(|(_, c)| (c.answer.is_some(), c.deadline))
        .map(|(i, _)| i);
    if let Some(i) = oldest {
        conns.swap_remove(i);
        tracing::debug!("API: closed the client held longest to take a new one");
    }
}
