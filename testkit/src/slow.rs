//! Slow-loris clients of a UNIX socket: each sends a request one byte a second, to show a
//! server serves others while they are connected.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Clients that each send a request one byte a second and never finish it: at most
/// [`SlowClients::MAX_BYTES`] bytes each, so they end by themselves, and all are closed
/// when this is dropped, whichever way the test ends.
pub struct SlowClients {
    clients: Arc<Mutex<Vec<UnixStream>>>,
    /// How many bytes each client has sent (all send in step).
    sent: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SlowClients {
    /// Bytes each sends, a second apart: fewer than its request has.
    pub const MAX_BYTES: usize = 10;
    const REQUEST: &'static [u8] = b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: x\r\n\r\n";

    /// Connects `count` clients to `path` and returns once each has sent its first byte;
    /// panics (with all closed) if that takes longer than `bound`.
    pub fn start(path: &Path, count: usize, bound: Duration) -> Self {
        let clients = Arc::new(Mutex::new(Vec::with_capacity(count)));
        let sent = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (clients, sent, stop) = (clients.clone(), sent.clone(), stop.clone());
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                for i in 0..count {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let s = match UnixStream::connect(&path) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(format!(
                                "slow client {i}: cannot connect to {}: {e}",
                                path.display()
                            )));
                            return;
                        }
                    };
                    // One byte never blocks; reads must not, to tell held from closed.
                    if s.set_nonblocking(true).is_ok() {
                        clients.lock().unwrap().push(s);
                    }
                }
                for n in 1..=Self::MAX_BYTES {
                    // A client the server closed fails to write (EPIPE) and is dropped.
                    clients
                        .lock()
                        .unwrap()
                        .retain(|mut s| s.write(&Self::REQUEST[n - 1..n]).is_ok());
                    sent.store(n, Ordering::SeqCst);
                    if n == 1 {
                        let _ = ready_tx.send(Ok(()));
                    }
                    for _ in 0..10 {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
        };
        let mut me = SlowClients {
            clients,
            sent,
            stop,
            thread: Some(thread),
        };
        let ready = ready_rx.recv_timeout(bound);
        if !matches!(ready, Ok(Ok(()))) {
            me.close();
            panic!(
                "{count} slow clients did not connect and send a byte within {bound:?}: {ready:?}"
            );
        }
        me
    }

    /// How many bytes each client has sent.
    pub fn bytes_sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    /// How many of the clients the server still holds: nothing to read and not closed.
    pub fn held(&self) -> usize {
        let mut b = [0u8; 1];
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|s| {
                let mut s: &UnixStream = s;
                matches!(s.read(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock)
            })
            .count()
    }

    /// Stops sending and closes every client.
    pub fn close(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Drop for SlowClients {
    fn drop(&mut self) {
        self.close();
    }
}

/// Holds `count` slow clients on `socket` while `ask` puts a request to the same server,
/// and checks what a server that no client can hold up must show: `ask` was answered 200
/// before any slow client sent its third byte, while some were still connected, and every
/// slow client was closed within `bound`, before it was through its request.
pub fn assert_served_past_slow_clients(
    socket: &Path,
    count: usize,
    bound: Duration,
    ask: impl FnOnce() -> (u16, String),
) {
    let mut slow = SlowClients::start(socket, count, bound);
    let asked = std::time::Instant::now();
    let (status, body) = ask();
    let (sent, held) = (slow.bytes_sent(), slow.held());
    eprintln!(
        "answered {status} in {:?}: the slow clients had sent {sent} bytes each, {held} held",
        asked.elapsed()
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        sent < 3,
        "the request waited for the slow clients' byte {sent}"
    );
    assert!(
        held > 0,
        "the request was answered only once the slow clients were closed"
    );
    let waited = std::time::Instant::now();
    while slow.held() > 0 && waited.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(100));
    }
    let sent = slow.bytes_sent();
    assert_eq!(slow.held(), 0, "slow clients still held after {bound:?}");
    assert!(
        sent < SlowClients::MAX_BYTES,
        "the slow clients were held until they sent all {sent} bytes"
    );
    slow.close();
}
