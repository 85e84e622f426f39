//! A small blocking client for the API socket: one request per connection, as the server
//! takes them.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long [`request`] waits for a whole answer. Long, because a snapshot of a large VM
/// is answered only once it is written; bounded, so a wedged server does not hang a script.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Why a request got no answer. Every message but the malformed answers' names the socket.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("API socket {}: cannot connect: {source}", socket.display())]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket {}: cannot send the request: {source}", socket.display())]
    Send {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket {}: {source}", socket.display())]
    SetTimeout {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket {}: cannot read the answer: {source}", socket.display())]
    Read {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket {}: no answer within {timeout:?}", socket.display())]
    Timeout { socket: PathBuf, timeout: Duration },
    #[error("API socket {}: closed without an answer", socket.display())]
    Closed { socket: PathBuf },
    #[error("API socket {}: the answer was cut short", socket.display())]
    CutShort { socket: PathBuf },
    #[error("the API answered with malformed HTTP: {0}")]
    Malformed(#[source] httparse::Error),
    #[error("the API answered with an invalid Content-Length")]
    ContentLength,
}

/// Sends `method path` (with a JSON `body` if given) to the server at `socket` and returns
/// the answer's status and body.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String), ClientError> {
    request_with_timeout(socket, method, path, body, DEFAULT_TIMEOUT)
}

/// [`request`] with a bound on the whole exchange.
pub fn request_with_timeout(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), ClientError> {
    let deadline = Instant::now() + timeout;
    let sock = || socket.to_path_buf();
    let mut stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        socket: sock(),
        source,
    })?;
    let mut out =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n");
    if let Some(b) = body {
        out.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    out.push_str("\r\n");
    out.push_str(body.unwrap_or(""));
    stream
        .set_write_timeout(Some(timeout))
        .and_then(|()| stream.write_all(out.as_bytes()))
        .map_err(|source| ClientError::Send {
            socket: sock(),
            source,
        })?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((status, body)) = parse_answer(&answer)? {
            return Ok((status, body));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ClientError::Timeout {
                socket: sock(),
                timeout,
            });
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|source| ClientError::SetTimeout {
                socket: sock(),
                source,
            })?;
        match stream.read(&mut chunk) {
            Ok(0) => {
                return match parse_answer(&answer)? {
                    Some(a) => Ok(a),
                    None if answer.is_empty() => Err(ClientError::Closed { socket: sock() }),
                    None => Err(ClientError::CutShort { socket: sock() }),
                }
            }
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ClientError::Timeout {
                    socket: sock(),
                    timeout,
                })
            }
            Err(source) => {
                return Err(ClientError::Read {
                    socket: sock(),
                    source,
                })
            }
        }
    }
}

/// The final answer in `buf` once all of it is there (interim 1xx answers skipped).
fn parse_answer(mut buf: &[u8]) -> Result<Option<(u16, String)>, ClientError> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let head = match resp.parse(buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(ClientError::Malformed(e)),
        };
        let status = resp.code.unwrap_or(0);
        if (100..200).contains(&status) {
            buf = &buf[head..];
            continue;
        }
        let length = resp
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| {
                std::str::from_utf8(h.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or(ClientError::ContentLength)
            })
            .transpose()?
            .unwrap_or(0);
        if buf.len() - head < length {
            return Ok(None);
        }
        let body = String::from_utf8_lossy(&buf[head..head + length]).into_owned();
        return Ok(Some((status, body)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_taken_whole_after_interim_ones() {
        let a = b"HTTP/1.1 100 \r\n\r\nHTTP/1.1 200 \r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(parse_answer(&a[..a.len() - 1]).unwrap(), None);
        assert_eq!(parse_answer(a).unwrap(), Some((200, "{}".into())));
        assert_eq!(
            parse_answer(b"HTTP/1.1 204 \r\n\r\n").unwrap(),
            Some((204, String::new()))
        );
    }
}
