//! HTTP/1.1 as the API speaks it: one request per connection, a body only by Content-Length,
//! and bounded sizes, so a client can make the server hold at most a fixed amount per
//! connection.

/// The longest request head (request line and headers) taken; a longer one is answered 431.
pub const MAX_HEAD: usize = 8 * 1024;
/// The longest request body taken; a longer one is answered 413 before it is read.
pub const MAX_BODY: usize = 64 * 1024;
/// More headers than any API client sends; more are answered 431 as a head too large.
const MAX_HEADERS: usize = 32;

/// A complete request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The request target without its query string.
    pub path: String,
    pub body: Vec<u8>,
}

/// An answer: a status and, for every status but 1xx and 204, a JSON body (maybe empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    pub fn json(status: u16, body: String) -> Self {
        Response { status, body }
    }

    pub fn empty(status: u16) -> Self {
        Response {
            status,
            body: String::new(),
        }
    }

    /// Cloud Hypervisor's error answer: a JSON array of messages, the outermost first and
    /// the cause last, which ch-remote prints as it is.
    pub fn error<S: AsRef<str>>(status: u16, messages: &[S]) -> Self {
        let list: Vec<&str> = messages.iter().map(AsRef::as_ref).collect();
        Response::json(status, serde_json::to_string(&list).unwrap_or_default())
    }

    /// The bytes on the wire. The status line has an empty reason phrase ("HTTP/1.1 200 "),
    /// as Cloud Hypervisor's server writes it: ch-remote reads everything between the
    /// version and the line's end as the number, so "200 OK" would fail there.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} \r\nServer: Musubi API\r\nConnection: close\r\n",
            self.status
        );
        // RFC 9110 forbids a Content-Length in a 1xx or 204 answer.
        let bodiless = self.status < 200 || self.status == 204;
        if !bodiless {
            out.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                self.body.len()
            ));
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        if !bodiless {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

/// What the bytes read so far on a connection amount to.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Read more. `expect_continue`: the head is complete, its body not yet, and the client
    /// waits for a "100 Continue" before sending it (curl does for larger bodies).
    Incomplete {
        expect_continue: bool,
    },
    Request(Request),
    /// Answer this and close.
    Refused(Response),
}

fn refuse(status: u16, message: &str) -> Parsed {
    Parsed::Refused(Response::error(status, &[message]))
}

/// Parses `buf`, everything read on a connection so far. Called again after each read, so
/// a request split over several reads is taken once all of it is there; bytes past the
/// request are ignored (one request per connection).
pub fn parse(buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return refuse(431, "Request Header Fields Too Large");
        }
        Ok(httparse::Status::Partial) => {
            return Parsed::Incomplete {
                expect_continue: false,
            }
        }
        Err(httparse::Error::TooManyHeaders) => {
            return refuse(431, "Request Header Fields Too Large");
        }
        Err(e) => return refuse(400, &format!("Bad Request: {e}")),
    };
    if head_len > MAX_HEAD {
        return refuse(431, "Request Header Fields Too Large");
    }
    let mut length: Option<usize> = None;
    let mut expect_continue = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return refuse(411, "Length Required: send the body with a Content-Length");
        }
        if h.name.eq_ignore_ascii_case("expect") {
            expect_continue = h.value.eq_ignore_ascii_case(b"100-continue");
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = match std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
            {
                Some(n) => n,
                None => return refuse(400, "Bad Request: invalid Content-Length"),
            };
            if length.is_some_and(|l| l != n) {
                return refuse(400, "Bad Request: conflicting Content-Length headers");
            }
            length = Some(n);
        }
    }
    let length = length.unwrap_or(0);
    if length > MAX_BODY {
        return refuse(
            413,
            &format!("Payload Too Large: the API takes bodies of at most {MAX_BODY} bytes"),
        );
    }
    if buf.len() - head_len < length {
        return Parsed::Incomplete { expect_continue };
    }
    let target = req.path.unwrap_or("/");
    Parsed::Request(Request {
        method: req.method.unwrap_or("").to_string(),
        path: target.split('?').next().unwrap_or("").to_string(),
        body: buf[head_len..head_len + length].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(p: Parsed) -> u16 {
        match p {
            Parsed::Refused(r) => r.status,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn a_request_split_over_several_reads_is_taken_when_complete() {
        let whole =
            b"PUT /api/v1/vm.snapshot?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello";
        for cut in 1..whole.len() {
            assert_eq!(
                parse(&whole[..cut]),
                Parsed::Incomplete {
                    expect_continue: false
                },
                "cut at {cut}"
            );
        }
        assert_eq!(
            parse(whole),
            Parsed::Request(Request {
                method: "PUT".into(),
                path: "/api/v1/vm.snapshot".into(),
                body: b"hello".to_vec(),
            })
        );
    }

    #[test]
    fn a_head_over_the_limit_is_refused_431() {
        let mut head = b"GET /api/v1/vmm.ping HTTP/1.1\r\nX: ".to_vec();
        head.resize(MAX_HEAD + 1, b'a');
        assert_eq!(status(parse(&head)), 431);
        let mut complete = b"GET / HTTP/1.1\r\nX: ".to_vec();
        complete.resize(MAX_HEAD + 10, b'a');
        complete.extend_from_slice(b"\r\n\r\n");
        assert_eq!(status(parse(&complete)), 431);
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("H{i}: v\r\n"))
            .collect();
        assert_eq!(
            status(parse(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes())),
            431
        );
    }

    #[test]
    fn a_body_over_the_limit_is_refused_413_before_it_is_read() {
        let head = format!("PUT / HTTP/1.1\r\nContent-Length: {}\r\n\r\n", MAX_BODY + 1);
        assert_eq!(status(parse(head.as_bytes())), 413);
        let at_limit = format!("PUT / HTTP/1.1\r\nContent-Length: {MAX_BODY}\r\n\r\n");
        assert!(matches!(
            parse(at_limit.as_bytes()),
            Parsed::Incomplete { .. }
        ));
    }

    #[test]
    fn bad_lengths_chunked_bodies_and_garbage_are_refused() {
        assert_eq!(
            status(parse(b"PUT / HTTP/1.1\r\nContent-Length: x\r\n\r\n")),
            400
        );
        assert_eq!(
            status(parse(
                b"PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
            )),
            400
        );
        assert_eq!(
            status(parse(
                b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            )),
            411
        );
        assert_eq!(status(parse(b"\x01\x02 / HTTP/1.1\r\n\r\n")), 400);
    }

    #[test]
    fn expect_continue_is_reported_while_the_body_is_awaited() {
        let head = b"PUT / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
        assert_eq!(
            parse(head),
            Parsed::Incomplete {
                expect_continue: true
            }
        );
    }

    #[test]
    fn answers_have_no_reason_phrase_and_no_length_when_bodiless() {
        let ok = String::from_utf8(Response::json(200, "{}".into()).to_bytes()).unwrap();
        assert!(ok.starts_with("HTTP/1.1 200 \r\n"), "{ok}");
        assert!(
            ok.contains("Content-Length: 2\r\n") && ok.ends_with("\r\n\r\n{}"),
            "{ok}"
        );
        let none = String::from_utf8(Response::empty(204).to_bytes()).unwrap();
        assert!(!none.contains("Content-Length"), "{none}");
        let e = Response::error(404, &["Not Found"]);
        assert_eq!(e.body, r#"["Not Found"]"#);
    }
}
