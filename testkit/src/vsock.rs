//! A host program's side of a VM's hybrid vsock (Firecracker's, Cloud Hypervisor's and
//! Musubi's): `CONNECT <port>` on the VM's UNIX socket, and bytes echoed back by the probe's
//! `vsock-echo`. Shared by the tests and `musubi bench vsock`, which must speak it alike to
//! every VMM.

use std::io::{self, Read, Write};
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

/// Connects to guest port `port` through the socket at `socket`, reads waiting at most
/// `limit`: the stream and the device's answer line (`OK <hostport>\n`, or empty when the
/// device closed the stream instead).
pub fn connect(socket: &Path, port: u32, limit: Duration) -> io::Result<(UnixStream, String)> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(limit))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    Ok((s.try_clone()?, read_line(&mut s)))
}

/// Sends `data` on `s` from a thread of its own while this one reads the echo back, so
/// neither side waits on the other's buffers.
pub fn echo_round_trip(s: &mut UnixStream, data: &[u8]) -> io::Result<Vec<u8>> {
    let mut w = s.try_clone()?;
    let out = data.to_vec();
    let writer = std::thread::spawn(move || w.write_all(&out));
    let mut back = vec![0u8; data.len()];
    let read = s.read_exact(&mut back);
    let written = writer
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the writer thread panicked")));
    read.and(written).map(|()| back)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echoing_peer_sends_everything_back_and_lines_stop_at_the_newline() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let echo = std::thread::spawn(move || {
            b.write_all(b"OK 7\nrest").unwrap();
            let mut buf = vec![0u8; 300_000];
            b.read_exact(&mut buf).unwrap();
            b.write_all(&buf).unwrap();
        });
        assert_eq!(read_line(&mut a), "OK 7\n");
        let mut rest = [0u8; 4];
        a.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"rest");
        let data: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
        assert!(echo_round_trip(&mut a, &data).unwrap() == data);
        echo.join().unwrap();
    }
}
