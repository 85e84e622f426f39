//! A host program's side of a VM's hybrid vsock ([`testkit::vsock`]), failing the test
//! where it fails.

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Sends `data` on `s` from a thread of its own while this one reads the echo back, so
/// neither side waits on the other's buffers.
pub fn echo_round_trip(s: &mut UnixStream, data: &[u8]) -> Vec<u8> {
    testkit::vsock::echo_round_trip(s, data).expect("the echo comes back whole")
}

/// Connects to guest port `port` through the socket at `socket` once it exists.
pub fn connect_at(socket: &Path, port: u32, limit: Duration) -> (UnixStream, String) {
    testkit::vsock::connect(socket, port, limit).expect("the vsock socket takes clients")
}

/// Whether the device closed the stream: end of file, or a reset if it closed with bytes
/// of ours unread.
pub fn closed(s: &mut UnixStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    }
}

/// `len` bytes that are not all alike, to echo.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 253) as u8).collect()
}
