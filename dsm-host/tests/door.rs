//! A linking node refuses every connection that fails the handshake, logs why and who, and
//! goes on waiting: strangers neither stop nor hold up a VM's start, and nothing is accepted
//! once the nodes have linked.

mod common;

use common::{params, tcp_config, CONFIG, SECRET, WAIT};
use dsm::NodeId;
use dsm_host::{
    DoorLimits, Inbox, Link, LinkError, Liveness, Refusals, Role, TcpTransport, TransportError,
    HANDSHAKE_READ,
};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Node 0 of a VM of `nodes` nodes, linking on a thread with `door` and `connect` as its
/// connect timeout; the other nodes' addresses are reserved but nobody listens there.
struct Linking {
    addrs: Vec<SocketAddr>,
    done: mpsc::Receiver<Result<TcpTransport, TransportError>>,
    thread: JoinHandle<()>,
    /// The other nodes' listeners, held so their ports stay theirs.
    others: Vec<Option<TcpListener>>,
}

fn node0(nodes: u16, door: DoorLimits, connect: Duration) -> Linking {
    let mut ls: Vec<Option<TcpListener>> = (0..nodes)
        .map(|_| Some(TcpListener::bind("127.0.0.1:0").unwrap()))
        .collect();
    let addrs: Vec<SocketAddr> = ls
        .iter()
        .map(|l| l.as_ref().unwrap().local_addr().unwrap())
        .collect();
    let mut cfg = tcp_config(0, &addrs, Liveness::default());
    cfg.door = door;
    cfg.connect_timeout = connect;
    let l = ls[0].take().unwrap();
    let (tx, done) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let (itx, _inbox) = Inbox::new().unwrap();
        let _ = tx.send(TcpTransport::establish(&cfg, l, itx));
    });
    Linking {
        addrs,
        done,
        thread,
        others: ls,
    }
}

impl Linking {
    /// Starts real node `k` on a thread; it dials node 0.
    fn real(&mut self, k: u16) -> JoinHandle<Result<TcpTransport, TransportError>> {
        let l = self.others[k as usize]
            .take()
            .expect("each node starts once");
        let cfg = tcp_config(k, &self.addrs, Liveness::default());
        std::thread::spawn(move || {
            let (itx, _inbox) = Inbox::new().unwrap();
            TcpTransport::establish(&cfg, l, itx)
        })
    }

    /// Node 0's outcome, failing the test if it takes longer than [`WAIT`].
    fn outcome(self) -> Result<TcpTransport, TransportError> {
        let r = self
            .done
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("node 0 still linking after {WAIT:?}"));
        self.thread.join().expect("no panic");
        r
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// Reads until node 0 closes the connection (bounded by [`WAIT`]); returns the bytes it sent.
fn until_closed(s: &mut TcpStream) -> usize {
    let mut n = 0;
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return n,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return n,
            Err(e) => panic!("node 0 never closed the connection: {e}"),
        }
    }
}

/// The refusal of the connection from `from`, failing the test if there is none.
fn refusal_of<'a>(r: &'a Refusals, from: &TcpStream) -> &'a str {
    let me = from.local_addr().unwrap();
    r.kept
        .iter()
        .find(|x| x.addr == me)
        .map(|x| x.why.as_str())
        .unwrap_or_else(|| panic!("no refusal of {me} among {:?}", r.kept))
}

fn linked(t: JoinHandle<Result<TcpTransport, TransportError>>) -> TcpTransport {
    t.join()
        .expect("no panic")
        .unwrap_or_else(|e| panic!("the real node links: {e}"))
}

#[test]
fn strangers_are_refused_one_by_one_and_the_real_peer_links_after_them() {
    let mut n = node0(2, DoorLimits::default(), WAIT);
    let addr = n.addrs[0];

    let mut garbage = connect(addr);
    garbage.write_all(&[0xc3; 4096]).unwrap();
    until_closed(&mut garbage);

    let mut half = connect(addr);
    half.write_all(b"MUSUBIDS").unwrap();
    half.shutdown(Shutdown::Write).unwrap();
    until_closed(&mut half);

    // Someone with the wrong secret, someone with the secret claiming a node the cluster does
    // not have, and one claiming to be node 0 itself.
    let wrong_secret = connect(addr);
    let ws = wrong_secret.try_clone().unwrap();
    let e = Link::handshake(ws, Role::Dialer, None, &params(1, b"a guess", CONFIG)).err();
    assert!(matches!(e, Some(LinkError::Auth { .. })), "{e:?}");
    let stranger_id = connect(addr);
    let sid = stranger_id.try_clone().unwrap();
    let held = Link::handshake(sid, Role::Dialer, None, &params(7, SECRET, CONFIG))
        .expect("a peer with the secret completes the handshake");
    let mut itself = connect(addr);
    let it = itself.try_clone().unwrap();
    let e = Link::handshake(it, Role::Dialer, None, &params(0, SECRET, CONFIG)).err();
    assert!(matches!(e, Some(LinkError::WrongNode { .. })), "{e:?}");
    until_closed(&mut itself);

    // Fifty that connect and close at once; past the door's bound some are closed unread.
    let quick: Vec<SocketAddr> = (0..50)
        .map(|_| {
            let s = connect(addr);
            let a = s.local_addr().unwrap();
            s.shutdown(Shutdown::Both).unwrap();
            a
        })
        .collect();

    let node1 = n.real(1);
    let t = n.outcome().expect("node 0 links with the real node 1");
    let _one = linked(node1);
    drop(held);

    let r = t.refusals();
    // The real node may have met a full door and dialed again: more refusals, never fewer.
    assert!(r.count >= 55, "every stranger is refused: {:?}", r.kept);
    let why = refusal_of(r, &garbage);
    assert!(
        why.contains("does not speak the musubi node handshake"),
        "{why}"
    );
    let why = refusal_of(r, &half);
    assert!(why.contains("closed the connection"), "{why}");
    for a in &quick {
        let times = r.kept.iter().filter(|x| x.addr == *a).count();
        assert_eq!(times, 1, "{a} refused {times} times");
    }
    let why = refusal_of(r, &wrong_secret);
    assert!(why.contains("failed authentication"), "{why}");
    let why = refusal_of(r, &stranger_id);
    assert!(
        why.contains("as node n7, but this node waits for n1"),
        "{why}"
    );
    let why = refusal_of(r, &itself);
    assert!(why.contains("says it is node n0"), "{why}");
}

#[test]
fn a_silent_stranger_does_not_hold_up_the_real_peer_and_is_cut_at_its_deadline() {
    // A deadline far past the test's own bound: the real node links while the silent one
    // still holds its connection, or the test fails.
    let long = DoorLimits {
        handshake: Duration::from_secs(3600),
        ..DoorLimits::default()
    };
    let mut n = node0(2, long, WAIT);
    let mut silent = connect(n.addrs[0]);
    let node1 = n.real(1);
    let t = n
        .outcome()
        .expect("node 0 links while a stranger is silent");
    let _one = linked(node1);
    let why = refusal_of(t.refusals(), &silent);
    assert!(
        why.contains("still in its handshake when linking ended"),
        "{why}"
    );
    let sent = until_closed(&mut silent);
    assert_eq!(
        sent,
        HANDSHAKE_READ - 32,
        "node 0 sent its hello and nothing else"
    );

    // With a short deadline the silent stranger is cut before the real peer comes.
    let short = DoorLimits {
        handshake: Duration::from_millis(200),
        ..DoorLimits::default()
    };
    let mut n = node0(2, short, WAIT);
    let mut silent = connect(n.addrs[0]);
    until_closed(&mut silent);
    let node1 = n.real(1);
    let t = n
        .outcome()
        .expect("node 0 links after cutting the stranger");
    let _one = linked(node1);
    let why = refusal_of(t.refusals(), &silent);
    assert!(why.contains("no complete handshake within 200 ms"), "{why}");
}

#[test]
fn a_second_connection_for_a_linked_peer_is_refused_and_linking_goes_on() {
    let n = node0(3, DoorLimits::default(), WAIT);
    let as_node = |k: u16, s: &TcpStream| {
        Link::handshake(
            s.try_clone().unwrap(),
            Role::Dialer,
            Some(NodeId(0)),
            &params(k, SECRET, CONFIG),
        )
        .unwrap_or_else(|e| panic!("node {k} proves the secret: {e}"))
    };
    let (first, mut again) = (connect(n.addrs[0]), connect(n.addrs[0]));
    let _l1 = as_node(1, &first);
    let _l1_again = as_node(1, &again);
    // One of the two is linked and the other refused; node 0 goes on waiting for node 2.
    let two = connect(n.addrs[0]);
    let _l2 = as_node(2, &two);
    let t = n.outcome().expect("node 0 links with nodes 1 and 2");
    assert_eq!(t.peers().collect::<Vec<_>>(), [NodeId(1), NodeId(2)]);
    let r = t.refusals();
    assert_eq!(r.count, 1, "{:?}", r.kept);
    let refused = r.kept[0].addr;
    let (a, b) = (first.local_addr().unwrap(), again.local_addr().unwrap());
    assert!(refused == a || refused == b, "{refused} is neither node 1");
    assert!(
        r.kept[0].why.contains("node n1, which is already linked"),
        "{:?}",
        r.kept
    );
    if refused == b {
        until_closed(&mut again);
    }
}

#[test]
fn handshakes_past_the_bound_are_closed_unread_and_a_real_peer_links_once_one_frees() {
    let door = DoorLimits {
        half_open: 4,
        handshake: Duration::from_secs(3600),
        ..DoorLimits::default()
    };
    let mut n = node0(2, door, WAIT);
    let mut holding: Vec<TcpStream> = Vec::new();
    for _ in 0..4 {
        let mut s = connect(n.addrs[0]);
        let mut hello = [0u8; HANDSHAKE_READ - 32];
        s.read_exact(&mut hello)
            .expect("a slot answers with its hello");
        holding.push(s);
    }
    let mut fifth = connect(n.addrs[0]);
    assert_eq!(until_closed(&mut fifth), 0, "past the bound: closed unread");
    // The real node dials into a full door: it is closed and dials again until a slot frees.
    let node1 = n.real(1);
    holding.pop().unwrap().shutdown(Shutdown::Both).unwrap();
    let t = n.outcome().expect("node 0 links once a slot frees");
    let _one = linked(node1);
    let why = refusal_of(t.refusals(), &fifth);
    assert!(why.contains("4 handshakes already in progress"), "{why}");
}

#[test]
fn nothing_is_accepted_once_the_nodes_have_linked() {
    let mut n = node0(2, DoorLimits::default(), WAIT);
    let addr = n.addrs[0];
    let node1 = n.real(1);
    let t = n.outcome().expect("node 0 links");
    let _one = linked(node1);
    let e = TcpStream::connect(addr).expect_err("node 0's port is closed after linking");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    assert_eq!(t.refusals().count, 0);
}

#[test]
fn linking_that_runs_out_of_time_says_who_is_missing_and_what_was_refused() {
    let n = node0(2, DoorLimits::default(), Duration::from_millis(800));
    let mut s = connect(n.addrs[0]);
    s.write_all(&[0u8; 200]).unwrap();
    until_closed(&mut s);
    let e = n.outcome().err().expect("nobody real came");
    let m = e.to_string();
    assert!(
        m.contains("n1 never linked before the connect deadline"),
        "{m}"
    );
    assert!(m.contains("1 connections were refused"), "{m}");
    assert!(
        m.contains("does not speak the musubi node handshake"),
        "{m}"
    );
}

#[test]
fn an_authenticated_peer_with_another_configuration_still_ends_linking() {
    let n = node0(2, DoorLimits::default(), WAIT);
    let s = connect(n.addrs[0]);
    let e = Link::handshake(s, Role::Dialer, None, &params(1, SECRET, b"8 vcpus")).err();
    assert!(matches!(e, Some(LinkError::ConfigMismatch { .. })), "{e:?}");
    let m = n
        .outcome()
        .err()
        .expect("a set-up fault ends linking")
        .to_string();
    assert!(m.contains("different VM configuration"), "{m}");
}
