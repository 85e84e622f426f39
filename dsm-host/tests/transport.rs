//! The node link refuses strangers, peers of another VM configuration, and every frame it
//! cannot trust, with an error that says which; it never panics on what a peer sends.

mod common;

use common::{params, WAIT};
use dsm::{Access, Message, NodeId};
use dsm_host::{
    DoorLimits, Envelope, Inbound, Inbox, Link, LinkError, LinkParams, LinkReader, Liveness, Role,
    TcpConfig, TcpTransport,
};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Node 0 waiting, on a thread, for one peer to dial in and run the handshake.
fn accept_one(p: LinkParams) -> (SocketAddr, JoinHandle<Result<Link, LinkError>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        Link::handshake(s, Role::Listener, None, &p)
    });
    (addr, t)
}

/// Node 0 accepts and node 1 dials, each with its own parameters; returns both outcomes and
/// a second handle on node 1's stream for writing raw bytes.
fn meet(
    listener_side: LinkParams,
    dialer_side: LinkParams,
) -> (Result<Link, LinkError>, Result<Link, LinkError>, TcpStream) {
    let (addr, t) = accept_one(listener_side);
    let s = TcpStream::connect(addr).unwrap();
    let raw = s.try_clone().unwrap();
    let d = Link::handshake(s, Role::Dialer, Some(NodeId(0)), &dialer_side);
    (t.join().expect("no panic"), d, raw)
}

fn linked() -> (Link, Link, TcpStream) {
    let (l, d, raw) = meet(params(0, b"s3cret", b"cfg"), params(1, b"s3cret", b"cfg"));
    (l.expect("listener links"), d.expect("dialer links"), raw)
}

/// Both sides' errors, failing the test if either side linked.
fn refusals(l: Result<Link, LinkError>, d: Result<Link, LinkError>) -> [LinkError; 2] {
    [
        l.err().expect("listener refuses"),
        d.err().expect("dialer refuses"),
    ]
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let (l, d, _) = meet(params(0, b"right", b"cfg"), params(1, b"wrong", b"cfg"));
    for e in refusals(l, d) {
        assert!(matches!(e, LinkError::Auth { .. }), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains("failed authentication") && m.contains("shared secret"),
            "{m}"
        );
    }
}

#[test]
fn a_different_vm_configuration_is_refused_with_a_message_saying_so() {
    let (l, d, _) = meet(params(0, b"s", b"4 vcpus"), params(1, b"s", b"8 vcpus"));
    for e in refusals(l, d) {
        let m = e.to_string();
        assert!(m.contains("different VM configuration"), "{m}");
        assert!(m.contains("same configuration"), "{m}");
    }
}

#[test]
fn a_peer_not_speaking_the_handshake_is_refused() {
    let (addr, t) = accept_one(params(0, b"s", b"c"));
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&[0x47u8; 200]).unwrap();
    let e = t.join().expect("no panic").err().expect("refused");
    assert!(matches!(e, LinkError::NotANode { .. }), "{e:?}");
    // Hanging up halfway through the handshake is an error too, not a wait forever.
    let (addr, t) = accept_one(params(0, b"s", b"c"));
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"MUSUBI").unwrap();
    s.shutdown(Shutdown::Both).unwrap();
    let e = t.join().expect("no panic").err().expect("refused");
    assert!(matches!(e, LinkError::Closed { .. }), "{e:?}");
}

/// A page, a heartbeat and a stop: the largest frame and the two smallest.
fn page_beat_stop(page: u64, access: Access, code: i32) -> [Envelope; 3] {
    [
        Envelope::Dsm(Message::PageData {
            page,
            access,
            data: common::pattern(page as u8),
        }),
        Envelope::Heartbeat { seq: 1 },
        Envelope::Stop { code },
    ]
}

#[test]
fn frames_arrive_in_order_and_intact() {
    let (mut l, mut d, _) = linked();
    assert_eq!((l.peer, d.peer), (NodeId(1), NodeId(0)));
    let sent = page_beat_stop(42, Access::Write, 0);
    for e in &sent {
        d.writer.send(e).unwrap();
    }
    for e in &sent {
        assert_eq!(&l.reader.recv().unwrap(), e);
    }
    l.writer.send(&Envelope::Heartbeat { seq: 2 }).unwrap();
    assert_eq!(d.reader.recv().unwrap(), Envelope::Heartbeat { seq: 2 });
    d.writer.shutdown();
    assert!(matches!(l.reader.recv(), Err(LinkError::Closed { .. })));
}

/// A polling reader gets whole frames whatever pieces the bytes arrive in, and in order; the
/// peer closing between frames is a close.
#[test]
fn frames_read_without_waiting_arrive_whole_and_in_order() {
    let (mut l, mut d, mut raw) = linked();
    let sent = page_beat_stop(7, Access::Read, 4);
    let mut frames = Vec::new();
    l.reader
        .recv_ready(&mut frames)
        .expect("nothing yet is no error");
    assert!(frames.is_empty());
    // The frames as the writer puts them on the wire, taken off the reader's socket before
    // the reader sees them, then sent again from the writer's side in pieces that end inside
    // a length and inside a body.
    for e in &sent {
        d.writer.send(e).unwrap();
    }
    // SAFETY: a duplicate of the reader's socket, owned and closed by `tap`.
    let mut tap = unsafe {
        <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(libc::dup(l.reader.as_raw_fd()))
    };
    tap.set_read_timeout(Some(WAIT)).unwrap();
    let mut wire = Vec::new();
    for _ in &sent {
        let mut len = [0u8; 4];
        tap.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        tap.read_exact(&mut body).unwrap();
        wire.extend_from_slice(&len);
        wire.extend_from_slice(&body);
    }
    let cuts = [2, 9, 4100, wire.len()];
    let mut at = 0;
    for cut in cuts {
        raw.write_all(&wire[at..cut]).unwrap();
        at = cut;
        std::thread::sleep(Duration::from_millis(5));
        l.reader.recv_ready(&mut frames).unwrap();
    }
    assert_eq!(frames, sent);
    raw.shutdown(Shutdown::Write).unwrap();
    let e = recv_ready_until_error(&mut l.reader);
    assert!(matches!(e, LinkError::Closed { .. }), "{e:?}");
}

/// A delayed link delivers every frame intact, in order, and none before its send time plus
/// the delay, and a frame sent just before the writer is dropped still arrives when the delay
/// line is flushed first.
#[test]
fn a_delayed_link_keeps_order_and_holds_every_frame_for_the_delay() {
    let delay = Duration::from_millis(2);
    let (mut l, mut d, _) = linked();
    d.writer.delay_by(delay).unwrap();
    let mut sent_at = Vec::new();
    for seq in 0..50u64 {
        sent_at.push(Instant::now());
        d.writer.send(&Envelope::Heartbeat { seq }).unwrap();
        if seq % 10 == 9 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mut got_at = Vec::new();
    for seq in 0..50u64 {
        assert_eq!(l.reader.recv().unwrap(), Envelope::Heartbeat { seq });
        got_at.push(Instant::now());
    }
    for (seq, (s, g)) in sent_at.iter().zip(&got_at).enumerate() {
        assert!(
            *g >= *s + delay,
            "frame {seq} arrived {:?} after its send, before the {delay:?} delay",
            g.duration_since(*s)
        );
    }
    d.writer.send(&Envelope::Stop { code: 7 }).unwrap();
    let line = d.writer.delay_line().expect("the link is delayed");
    assert!(line.flush(Duration::from_secs(10)));
    drop(d);
    assert_eq!(l.reader.recv().unwrap(), Envelope::Stop { code: 7 });
}

/// Writes `bytes` on an authenticated link behind its back and returns what the receiver
/// makes of them.
/// Reads with [`LinkReader::recv_ready`], as a polling thread does, until it fails.
fn recv_ready_until_error(r: &mut LinkReader) -> LinkError {
    let t0 = Instant::now();
    let mut frames = Vec::new();
    loop {
        assert!(t0.elapsed() < WAIT, "no error after {WAIT:?}: {frames:?}");
        if let Err(e) = r.recv_ready(&mut frames) {
            return e;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Both ways of reading a link: waiting for a frame, and taking what has arrived.
const READERS: [fn(&mut LinkReader) -> LinkError; 2] = [
    |r| r.recv().expect_err("the receiver refuses the bytes"),
    recv_ready_until_error,
];

fn inject(bytes: &[u8], hang_up: bool, read: fn(&mut LinkReader) -> LinkError) -> LinkError {
    let (mut l, _d, mut raw) = linked();
    raw.write_all(bytes).unwrap();
    if hang_up {
        raw.shutdown(Shutdown::Write).unwrap();
    }
    let e = read(&mut l.reader);
    // The receiver has ended the connection: the sender sees it closed.
    raw.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 64];
    match raw.read(&mut buf) {
        Ok(0) => {}
        Err(x) if x.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("connection still open after {e}: {other:?}"),
    }
    e
}

fn frame(body: &[u8], tag: [u8; 32]) -> Vec<u8> {
    let mut f = ((body.len() + 32) as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f.extend_from_slice(&tag);
    f
}

#[test]
fn bad_frames_end_the_link_with_an_error_naming_the_fault() {
    for read in READERS {
        bad_frames_end_the_link(|bytes, hang_up| inject(bytes, hang_up, read));
    }
}

fn bad_frames_end_the_link(inject: impl Fn(&[u8], bool) -> LinkError) {
    let hb = Envelope::Heartbeat { seq: 1 }.to_bytes();
    let e = inject(&frame(&hb, [0; 32]), false);
    assert!(matches!(e, LinkError::BadMac { seq: 0, .. }), "{e:?}");
    assert!(e.to_string().contains("fails its MAC"), "{e}");

    let e = inject(&u32::MAX.to_le_bytes(), false);
    assert!(
        matches!(e, LinkError::FrameLength { len, .. } if len == u32::MAX as usize),
        "{e:?}"
    );
    let e = inject(&0u32.to_le_bytes(), false);
    assert!(matches!(e, LinkError::FrameLength { len: 0, .. }), "{e:?}");

    let mut cut = 100u32.to_le_bytes().to_vec();
    cut.extend_from_slice(&[7; 10]);
    let e = inject(&cut, true);
    assert!(
        matches!(
            e,
            LinkError::Truncated {
                got: 10,
                len: 100,
                ..
            }
        ),
        "{e:?}"
    );

    let garbage: Vec<u8> = (0..300u32).map(|i| (i * 151 % 251) as u8).collect();
    let e = inject(&garbage, true);
    assert!(
        matches!(
            e,
            LinkError::FrameLength { .. } | LinkError::BadMac { .. } | LinkError::Truncated { .. }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("127.0.0.1"),
        "the error names the peer: {e}"
    );
}

#[test]
fn the_tcp_transport_reports_a_forged_frame_as_a_failed_peer() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, mut inbox) = Inbox::new().unwrap();
    let cfg = TcpConfig {
        link: params(0, b"s", b"c"),
        peers: vec![(NodeId(1), addr)],
        connect_timeout: WAIT,
        liveness: Liveness::default(),
        link_delay: Duration::ZERO,
        door: DoorLimits::default(),
    };
    let t = std::thread::spawn(move || TcpTransport::establish(&cfg, l, tx));
    let s = TcpStream::connect(addr).unwrap();
    let mut raw = s.try_clone().unwrap();
    let mut peer = Link::handshake(s, Role::Dialer, Some(NodeId(0)), &params(1, b"s", b"c"))
        .expect("node 1 links");
    let mut transport = t.join().expect("no panic").expect("node 0 links");
    transport.spawn_receivers().expect("receiver threads start");

    // Heartbeats are consumed by the transport; anything else reaches the inbox.
    peer.writer.send(&Envelope::Heartbeat { seq: 5 }).unwrap();
    let reply = Envelope::ExitReply {
        vcpu: 3,
        data: vec![5],
    };
    peer.writer.send(&reply).unwrap();
    let hb = Envelope::Heartbeat { seq: 6 }.to_bytes();
    raw.write_all(&frame(&hb, [0xab; 32])).unwrap();

    let t0 = Instant::now();
    let mut got = Vec::new();
    while got.len() < 2 {
        assert!(t0.elapsed() < WAIT, "inbox after {WAIT:?}: {got:?}");
        got.extend(inbox.drain());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        matches!(
            &got[0],
            Inbound::Frame {
                from: NodeId(1),
                env
            } if *env == reply
        ),
        "{got:?}"
    );
    match &got[1] {
        Inbound::PeerFailed { peer, error } => {
            assert_eq!(*peer, NodeId(1));
            assert!(error.contains("fails its MAC"), "{error}");
        }
        other => panic!("expected the link to fail, got {other:?}"),
    }
    drop(transport);
    let _ = peer.reader.recv();
}
