//! A host program's side of a VM's hybrid vsock: `CONNECT <port>` on its UNIX socket, and
//! bytes echoed back by the probe's `vsock-echo`.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// One line, byte by byte, so nothing after it is taken from the stream.
pub fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') && line.len() < 64 {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(_) => line.push(b[0]),
        }
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// Sends `data` on `s` from a thread of its own while this one reads the echo back, so
/// neither side waits on the other's buffers.
pub fn echo_round_trip(s: &mut UnixStream, data: &[u8]) -> Vec<u8> {
    let mut w = s.try_clone().unwrap();
    let out = data.to_vec();
    let writer = std::thread::spawn(move || w.write_all(&out));
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).expect("the echo comes back whole");
    writer.join().unwrap().expect("the guest takes every byte");
    back
}

/// Connects to guest port `port` through the socket at `socket` once it exists.
pub fn connect_at(socket: &Path, port: u32, limit: Duration) -> (UnixStream, String) {
    let mut s = UnixStream::connect(socket).expect("the vsock socket takes clients");
    s.set_read_timeout(Some(limit)).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    (s.try_clone().unwrap(), read_line(&mut s))
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
