//! Peers that die, hang, lie or leave: each is told apart and reported to the VMM within the
//! loss timeout, a lost peer stops this node serving faults, and a clean stop is never taken
//! for a loss. No VM: anonymous memory and loopback TCP.

mod common;

use common::{
    cluster, events_until, params, pattern, region, start, tcp_config, toucher, Running, CONFIG,
    SECRET, WAIT,
};
use dsm::{Access, Message, NodeId, Protocol};
use dsm_host::{CoherenceError, Envelope, Inbox, Link, Liveness, NodeEvent, Role, TcpTransport};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Short enough for quick tests, long enough that a loaded machine running other builds
/// does not lose a peer that is merely slow.
const FAST: Liveness = Liveness {
    heartbeat: Duration::from_millis(50),
    loss_timeout: Duration::from_millis(700),
};

fn lost(events: &[NodeEvent]) -> Vec<&NodeEvent> {
    events
        .iter()
        .filter(|e| matches!(e, NodeEvent::PeerLost { .. }))
        .collect()
}

/// What a node should report when `peer` leaves with `code`, and nothing else.
fn only_stopped(peer: u16, code: i32) -> Vec<NodeEvent> {
    vec![NodeEvent::PeerStopped {
        peer: NodeId(peer),
        code,
    }]
}

/// Waits (bounded) until every protocol message sent has been received, so that every
/// manager's directory is up to date.
fn settle(nodes: &[Running]) {
    let t0 = Instant::now();
    loop {
        let stats: Vec<_> = nodes.iter().map(|n| n.node.stats()).collect();
        let sent: u64 = stats.iter().map(|s| s.total_sent()).sum();
        let received: u64 = stats.iter().flat_map(|s| s.received.values()).sum();
        if sent == received {
            return;
        }
        assert!(t0.elapsed() < WAIT, "messages still in flight: {stats:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn a_node_gone_without_stop_is_lost_with_the_pages_it_owned(protocol: Protocol) {
    let mut nodes = cluster(3, protocol, FAST);
    // Node 2 takes pages 0 and 3 (managed by node 0) and page 1 (managed by node 1).
    for page in [0, 3, 1] {
        toucher(&nodes[2].mem, page).write(8, 0xaa).wait();
    }
    settle(&nodes);

    // Its transport goes away without a word: sockets closed, no Stop.
    let gone = nodes.pop().unwrap();
    let t0 = Instant::now();
    gone.node.join().expect("node 2 itself lost nobody");
    for (n, owned) in nodes.iter().zip([2, 1]) {
        let got = events_until(&n.events, WAIT, |e| !lost(e).is_empty());
        match lost(&got)[..] {
            [NodeEvent::PeerLost {
                peer,
                pages_owned,
                why,
            }] => {
                assert_eq!(*peer, NodeId(2));
                assert_eq!(*pages_owned, owned, "{}", protocol.name());
                assert!(why.contains("closed the connection"), "{why}");
            }
            _ => panic!("expected node 2 lost, got {got:?}"),
        }
    }
    assert!(
        t0.elapsed() < FAST.loss_timeout,
        "a closed connection is a loss at once, took {:?}",
        t0.elapsed()
    );

    // Node 0 serves no more faults, even for a page node 1, still up, holds.
    let stuck = toucher(&nodes[0].mem, 1).read();
    std::thread::sleep(FAST.loss_timeout / 2);
    assert!(stuck.still_stopped(), "a fault was served after a loss");
    // The stopped thread must never see its memory unmapped; the process ends it.
    std::mem::forget(Arc::clone(&nodes[0].mem));

    for n in nodes {
        match n.node.join() {
            Err(e @ CoherenceError::PeerLost { .. }) => {
                let m = e.to_string();
                assert!(m.contains("lost node n2"), "{m}");
                assert!(m.contains("stopped serving faults"), "{m}");
            }
            other => panic!("join should name the lost peer: {other:?}"),
        }
    }
}

#[test]
fn a_node_gone_without_stop_is_lost_under_vmp() {
    a_node_gone_without_stop_is_lost_with_the_pages_it_owned(Protocol::Vmp);
}

#[test]
fn a_node_gone_without_stop_is_lost_under_ivy() {
    a_node_gone_without_stop_is_lost_with_the_pages_it_owned(Protocol::Ivy);
}

#[test]
fn a_stop_broadcast_reaches_every_peer_is_passed_on_and_is_no_loss() {
    let nodes = cluster(3, Protocol::Vmp, FAST);
    let mut nodes = nodes.into_iter();
    let first = nodes.next().unwrap();
    let rest: Vec<Running> = nodes.collect();
    assert!(first.node.broadcast_stop(3));
    first.node.join().expect("node 0 ends cleanly");
    // Each of the others hears node 0, and neither takes the other's closing link for a
    // loss. A node passes the first stop it hears on, so the other one's stop reaches a
    // node unless that node's own passing-on reached the other first: then the other's
    // first stop came from it, and it is not sent back. Longer than the loss timeout: a
    // loss, were one reported, would be among these.
    let mut heard = 0;
    for (k, n) in rest.iter().enumerate() {
        let got = events_until(&n.events, 2 * FAST.loss_timeout, |_| false);
        heard += got.len();
        let other = if k == 0 { 2 } else { 1 };
        let from_0 = only_stopped(0, 3).remove(0);
        let from_other = only_stopped(other, 3).remove(0);
        assert!(got.contains(&from_0), "node {}: {got:?}", k + 1);
        assert!(
            got.iter().all(|e| *e == from_0 || *e == from_other) && got.len() <= 2,
            "node {}: {got:?}",
            k + 1
        );
    }
    // At least one of the two heard the other pass the stop on: whichever heard node 0
    // first passed it on to a peer that had not yet passed it on to it.
    assert!(heard >= 3, "{heard} stops heard by nodes 1 and 2 together");

    for n in rest {
        let stats = n.node.join().expect("ends cleanly");
        assert_eq!(stats.protocol_errors, 0);
    }
}

/// A node that lost a peer tells the others before it ends, so that a node hearing the
/// notifier's close before the lost peer's own still names the peer that went first.
#[test]
fn a_loss_told_by_a_peer_is_the_first_loss_even_when_that_peer_closes_next() {
    let mut nodes = cluster(3, Protocol::Vmp, FAST);
    // Node 1 plays the node that lost node 2 and tells node 0, then ends at once.
    assert!(nodes[1].node.send(
        NodeId(0),
        Envelope::Lost {
            node: 2,
            why: "peer n2 closed the connection".into(),
        }
    ));
    let got = events_until(&nodes[0].events, WAIT, |e| !lost(e).is_empty());
    match lost(&got)[..] {
        [NodeEvent::PeerLost { peer, why, .. }] => {
            assert_eq!(*peer, NodeId(2));
            assert!(
                why.contains("node n1 lost it") && why.contains("n2 closed"),
                "{why}"
            );
        }
        _ => panic!("expected node 2 lost, got {got:?}"),
    }
    let notifier = nodes.remove(1);
    let _ = notifier.node.join();
    // Node 1's close is a loss too, reported, but not the first.
    let got = events_until(&nodes[0].events, WAIT, |e| !lost(e).is_empty());
    assert!(
        matches!(
            lost(&got)[..],
            [NodeEvent::PeerLost {
                peer: NodeId(1),
                ..
            }]
        ),
        "{got:?}"
    );
    std::mem::forget(Arc::clone(&nodes[0].mem));
    let last = nodes.pop().unwrap();
    let _ = last.node.join();
    match nodes.pop().unwrap().node.join() {
        Err(CoherenceError::PeerLost { peer, .. }) => assert_eq!(peer, NodeId(2)),
        other => panic!("join should name node 2, lost first: {other:?}"),
    }
}

/// Node 0 of two running for real; node 1 played by the test over a bare link.
struct RawPeer {
    node0: Running,
    link: Link,
    /// The same socket as the link's, for writing bytes behind its back.
    raw: TcpStream,
}

fn raw_peer(liveness: Liveness) -> RawPeer {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let cfg = tcp_config(0, &[addr, addr], liveness);
    let inbox = Inbox::new().unwrap();
    let tx = inbox.0.clone();
    let t = std::thread::spawn(move || TcpTransport::establish(&cfg, l, tx));
    let s = TcpStream::connect(addr).unwrap();
    let raw = s.try_clone().unwrap();
    let link = Link::handshake(s, Role::Dialer, Some(NodeId(0)), &params(1, SECRET, CONFIG))
        .expect("node 1 links");
    let transport = t.join().expect("no panic").expect("node 0 links");
    let mem = region(0, 4);
    let (etx, events) = mpsc::channel();
    let node = start(&mem, 0, 2, Protocol::Vmp, Box::new(transport), inbox, etx);
    RawPeer {
        node0: Running { mem, node, events },
        link,
        raw,
    }
}

#[test]
fn a_peer_that_keeps_its_connection_but_falls_silent_is_lost_by_timeout() {
    let RawPeer {
        node0, mut link, ..
    } = raw_peer(FAST);
    // Alive for three loss timeouts on heartbeats alone.
    let beats = 3 * FAST.loss_timeout.as_millis() / FAST.heartbeat.as_millis();
    for seq in 0..beats as u64 {
        link.writer.send(&Envelope::Heartbeat { seq }).unwrap();
        std::thread::sleep(FAST.heartbeat);
    }
    assert_eq!(node0.events.try_iter().collect::<Vec<_>>(), vec![]);

    // Then silence, with the socket open.
    let t0 = Instant::now();
    let got = events_until(&node0.events, FAST.loss_timeout + WAIT, |e| !e.is_empty());
    let took = t0.elapsed();
    match &got[..] {
        [NodeEvent::PeerLost {
            peer: NodeId(1),
            pages_owned: 0,
            why,
        }] => {
            assert!(why.contains("no frame") && why.contains("700 ms"), "{why}");
        }
        _ => panic!("expected node 1 lost by timeout, got {got:?}"),
    }
    assert!(
        took >= FAST.loss_timeout - FAST.heartbeat && took < FAST.loss_timeout + WAIT / 2,
        "lost after {took:?}"
    );

    // Node 0 beat all along, in sequence, until it gave up on the link.
    let mut seqs = Vec::new();
    for _ in 0..10_000 {
        match link.reader.recv() {
            Ok(Envelope::Heartbeat { seq }) => seqs.push(seq),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => break,
        }
    }
    assert!(seqs.len() as u128 >= beats / 2, "{seqs:?}");
    assert!(
        seqs.iter().enumerate().all(|(i, &s)| s == i as u64),
        "{seqs:?}"
    );

    match node0.node.join() {
        Err(CoherenceError::PeerLost {
            peer: NodeId(1), ..
        }) => {}
        other => panic!("join should name node 1: {other:?}"),
    }
}

#[test]
fn heartbeats_flow_while_a_thread_is_stopped_on_a_fault() {
    let patient = Liveness {
        heartbeat: FAST.heartbeat,
        loss_timeout: WAIT,
    };
    let RawPeer {
        node0, mut link, ..
    } = raw_peer(patient);
    // Page 1 is node 1's: node 0 must ask for it and the test does not answer yet.
    let read = toucher(&node0.mem, 1).read();
    let mut beats_after_fetch = 0;
    let mut fetched = false;
    let t0 = Instant::now();
    while beats_after_fetch < 10 {
        assert!(t0.elapsed() < WAIT, "heartbeats stopped");
        match link.reader.recv().expect("node 0 keeps its link") {
            Envelope::Heartbeat { .. } if fetched => beats_after_fetch += 1,
            Envelope::Heartbeat { .. } => {}
            Envelope::Dsm(Message::Fetch {
                page: 1,
                access: Access::Read,
                requester: NodeId(0),
            }) => fetched = true,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(read.still_stopped());
    link.writer
        .send(&Envelope::Dsm(Message::PageData {
            page: 1,
            access: Access::Read,
            data: pattern(5),
        }))
        .unwrap();
    assert_eq!(read.wait(), pattern(5)[..]);

    link.writer.send(&Envelope::Stop { code: 7 }).unwrap();
    drop(link);
    // A peer that said Stop and then hung up has left, not been lost.
    let got = events_until(&node0.events, 2 * FAST.loss_timeout, |_| false);
    assert_eq!(got, only_stopped(1, 7));
    let stats = node0.node.join().expect("nothing was lost");
    assert_eq!(stats.faults.resolved, stats.faults.count);
}

#[test]
fn a_forged_frame_after_the_handshake_is_a_loss_naming_the_fault() {
    let RawPeer { node0, mut raw, .. } = raw_peer(FAST);
    let mut frame = 40u32.to_le_bytes().to_vec();
    frame.extend_from_slice(&Envelope::Heartbeat { seq: 0 }.to_bytes()[..8]);
    frame.extend_from_slice(&[0x5a; 32]);
    raw.write_all(&frame).unwrap();
    let got = events_until(&node0.events, WAIT, |e| !e.is_empty());
    match &got[..] {
        [NodeEvent::PeerLost {
            peer: NodeId(1),
            why,
            ..
        }] => assert!(why.contains("fails its MAC"), "{why}"),
        _ => panic!("expected node 1 lost, got {got:?}"),
    }
    let e = node0.node.join().expect_err("a peer was lost");
    assert!(e.to_string().contains("fails its MAC"), "{e}");
}
