//! One stream connection between a guest port and a host UNIX socket: its state, the
//! credit each side has given the other, and the guest's bytes the host has not taken yet.
//!
//! The device never holds more than it advertised: guest bytes wait here only up to
//! [`BUF_ALLOC`] (a guest that sends past its credit is reset), and host bytes are read
//! only when the guest has credit and a buffer for them, so a host program that floods the
//! socket is held back by its own socket buffer.

use super::packet::*;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;

/// Receive buffer the device advertises per connection: at most this many guest bytes are
/// kept for a host program that does not read.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// Forwarded bytes after which the guest is told of its new credit without asking.
const CREDIT_UPDATE_EVERY: u32 = BUF_ALLOC / 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// A host program asked for the guest's port: REQUEST sent or to send, no RESPONSE yet.
    Connecting,
    Established,
    /// The guest shut down both ways: the bytes it sent go to the host, then RST.
    Closing,
}

/// Control packets owed to the guest, sent before data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owed {
    pub request: bool,
    pub response: bool,
    pub credit_update: bool,
    /// SHUTDOWN (both ways) for the host's end of file, before the RST.
    pub shutdown: bool,
    pub rst: bool,
}

/// Why a connection was reset.
pub type Fault = &'static str;

pub struct Conn {
    pub stream: UnixStream,
    /// The host side's port, and the guest's.
    pub local_port: u32,
    pub peer_port: u32,
    pub state: State,
    pub owed: Owed,
    /// Bytes from the host that arrived with the CONNECT line, sent before any read.
    pub prefix: Vec<u8>,
    /// The host end has data (or an end of file) the device has not read yet.
    pub host_readable: bool,
    /// In the device's list of connections with packets for the guest.
    pub queued: bool,
    /// When a host program's CONNECT stops waiting for the guest's RESPONSE.
    pub deadline: Option<std::time::Instant>,
    tx_buf: VecDeque<u8>,
    /// Guest bytes passed to the host, ever.
    fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    fwd_told: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Host bytes passed to the guest, ever.
    rx_cnt: Wrapping<u32>,
}

impl Conn {
    pub fn new(stream: UnixStream, local_port: u32, peer_port: u32, state: State) -> Conn {
        Conn {
            stream,
            local_port,
            peer_port,
            state,
            owed: Owed::default(),
            prefix: Vec::new(),
            host_readable: false,
            queued: false,
            deadline: None,
            tx_buf: VecDeque::new(),
            fwd_cnt: Wrapping(0),
            fwd_told: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
        }
    }

    /// Takes the credit fields every guest packet carries.
    pub fn peer_credit_from(&mut self, h: &Header) {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd_cnt = Wrapping(h.fwd_cnt);
    }

    /// Bytes the guest can take now. A guest claiming to have consumed more than it was
    /// sent gets nothing rather than a wrapped-around huge credit.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Fills the credit fields of a packet to the guest, which tells it our `fwd_cnt`.
    pub fn stamp(&mut self, h: &mut Header) {
        h.buf_alloc = BUF_ALLOC;
        h.fwd_cnt = self.fwd_cnt.0;
        self.fwd_told = self.fwd_cnt;
    }

    /// Whether anything is owed to the guest or host data could go to it now.
    pub fn has_rx_work(&self) -> bool {
        let o = self.owed;
        o.request
            || o.response
            || o.credit_update
            || o.shutdown
            || o.rst
            || (self.state == State::Established
                && (self.host_readable || !self.prefix.is_empty())
                && self.peer_credit() > 0)
    }

    /// Guest bytes for the host: written now as far as the socket takes them, the rest kept.
    pub fn from_guest(&mut self, data: &[u8]) -> Result<(), Fault> {
        if self.tx_buf.len() + data.len() > BUF_ALLOC as usize {
            return Err("guest sent past the credit the device gave it");
        }
        self.tx_buf.extend(data);
        self.flush()
    }

    /// Passes kept guest bytes to the host until its socket is full. Owes the guest a credit
    /// update once it has sent a quarter of its credit unacknowledged.
    pub fn flush(&mut self) -> Result<(), Fault> {
        while !self.tx_buf.is_empty() {
            let (a, _) = self.tx_buf.as_slices();
            match self.stream.write(a) {
                Ok(0) => return Err("host end stopped taking data"),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return Err("host end closed while the guest was sending"),
            }
        }
        if (self.fwd_cnt - self.fwd_told).0 >= CREDIT_UPDATE_EVERY {
            self.owed.credit_update = true;
        }
        Ok(())
    }

    pub fn flushed(&self) -> bool {
        self.tx_buf.is_empty()
    }

    /// Reads host data for the guest into `buf`, no more than the guest's credit. `Ok(0)`
    /// is the host's end of file; `WouldBlock` clears `host_readable`.
    pub fn read_host(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.peer_credit() as usize);
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if !self.prefix.is_empty() {
            let k = n.min(self.prefix.len());
            buf[..k].copy_from_slice(&self.prefix[..k]);
            self.prefix.drain(..k);
            self.rx_cnt += Wrapping(k as u32);
            return Ok(k);
        }
        loop {
            match self.stream.read(&mut buf[..n]) {
                Ok(k) => {
                    self.rx_cnt += Wrapping(k as u32);
                    return Ok(k);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if e.kind() == io::ErrorKind::WouldBlock {
                        self.host_readable = false;
                    }
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Conn, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (Conn::new(a, 1024, 5000, State::Established), b)
    }

    #[test]
    fn credit_follows_the_guests_buffer_and_what_it_consumed() {
        let (mut c, mut host) = pair();
        assert_eq!(c.peer_credit(), 0);
        let mut h = Header {
            buf_alloc: 10,
            ..Header::default()
        };
        c.peer_credit_from(&h);
        assert_eq!(c.peer_credit(), 10);
        host.write_all(b"0123456789abcdef").unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(c.read_host(&mut buf).unwrap(), 10);
        assert_eq!(c.peer_credit(), 0);
        assert_eq!(
            c.read_host(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        h.fwd_cnt = 4;
        c.peer_credit_from(&h);
        assert_eq!(c.read_host(&mut buf).unwrap(), 4);
        assert_eq!(&buf[..4], b"abcd");
        // A guest that claims to have consumed more than it got earns nothing.
        h.fwd_cnt = 1000;
        c.peer_credit_from(&h);
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn guest_bytes_are_kept_up_to_the_advertised_buffer_and_no_further() {
        let (mut c, host) = pair();
        let chunk = vec![7u8; 64 * 1024];
        let mut sent = 0usize;
        // The host never reads: the socket fills, then the device's buffer.
        while c.from_guest(&chunk).is_ok() {
            sent += chunk.len();
            assert!(sent < 64 << 20, "buffered without bound");
        }
        assert!(!c.flushed());
        let mut h = Header::default();
        c.stamp(&mut h);
        assert_eq!(h.buf_alloc, BUF_ALLOC);
        assert!(sent as u64 - u64::from(h.fwd_cnt) <= u64::from(BUF_ALLOC));
        drop(host);
        assert!(c.flush().is_err());
    }

    #[test]
    fn forwarding_a_quarter_of_the_buffer_owes_a_credit_update() {
        let (mut c, mut host) = pair();
        c.from_guest(&vec![1u8; CREDIT_UPDATE_EVERY as usize - 1])
            .unwrap();
        assert!(!c.owed.credit_update);
        c.from_guest(&[1u8]).unwrap();
        assert!(c.owed.credit_update);
        let mut got = vec![0u8; CREDIT_UPDATE_EVERY as usize];
        host.read_exact(&mut got).unwrap();
    }
}
