//! Coherence threads serving real faults: a kernel-side copy into guest memory on one node,
//! and one page moving between two nodes over loopback TCP.

mod common;

use common::{cluster, pattern, region, start, toucher, WAIT};
use dsm::{NodeId, Protocol, PAGE_SIZE};
use dsm_host::{
    CoherenceHandle, Envelope, Exit, Inbox, Interrupt, IoSpace, Liveness, Memory, NodeEvent,
    NodeStats, Transport, TransportError,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// A transport for a VM of one node: there is nobody to send to.
struct Alone;

impl Transport for Alone {
    fn send(&mut self, to: NodeId, _: &Envelope) -> Result<(), TransportError> {
        Err(TransportError::NoPeer(to))
    }
}

#[test]
fn a_kernel_side_copy_into_an_absent_page_is_served_by_the_coherence_thread() {
    let mem = region(0, 4);
    let node = start(
        &mem,
        0,
        1,
        Protocol::Vmp,
        Box::new(Alone),
        Inbox::new().unwrap(),
        mpsc::channel().0,
    );

    let mut file = tempfile::tempfile().unwrap();
    let data = pattern(7);
    file.write_all(&data[..]).unwrap();
    let fd = file.as_raw_fd();
    let dst = mem.page_addr(2).unwrap() as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: `dst` is a page of the live region; the kernel's copy into it stops on the
        // missing page until the coherence thread serves it.
        let n = unsafe { libc::pread(fd, dst as *mut libc::c_void, PAGE_SIZE, 0) };
        let _ = tx.send((n, std::io::Error::last_os_error().to_string()));
    });
    let (n, err) = rx
        .recv_timeout(WAIT)
        .expect("pread into the region was not served");
    assert_eq!(n, PAGE_SIZE as isize, "pread: {err}");
    assert_eq!(toucher(&mem, 2).read().wait(), data[..]);

    let stats = node.join().expect("coherence thread");
    assert!(
        stats.faults.count >= 1 && stats.faults.missing >= 1,
        "{stats:?}"
    );
    assert!(
        stats.faults.writes >= 1,
        "the kernel's copy is a write: {stats:?}"
    );
    assert_eq!(stats.faults.resolved, stats.faults.count);
    assert_eq!(
        stats.faults.by_range.keys().copied().collect::<Vec<_>>(),
        vec![2 * PAGE_SIZE as u64]
    );
    assert_eq!(
        stats.faults.latency_log2_ns.iter().sum::<u64>(),
        stats.faults.resolved
    );
    assert_eq!(stats.total_sent(), 0);
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["faults"]["count"], stats.faults.count);
}

/// Two nodes of one VM in this process, linked over loopback.
struct Pair {
    ma: Arc<Memory>,
    a: CoherenceHandle,
    mb: Arc<Memory>,
    b: CoherenceHandle,
    /// What node 1 reported.
    b_events: mpsc::Receiver<NodeEvent>,
}

fn pair(protocol: Protocol) -> Pair {
    let mut nodes = cluster(2, protocol, Liveness::default());
    let b = nodes.pop().unwrap();
    let a = nodes.pop().unwrap();
    Pair {
        ma: a.mem,
        a: a.node,
        mb: b.mem,
        b: b.node,
        b_events: b.events,
    }
}

/// Waits (bounded) until every message either node sent has been received by the other,
/// then ends both and returns their final counts. A node may still be sending when the
/// thread it woke has gone on (it wakes the thread first), so the figures to check are the
/// ones `join` returns, after the coherence thread has finished what it was doing.
fn settle_and_end(a: CoherenceHandle, b: CoherenceHandle) -> (NodeStats, NodeStats) {
    let t0 = Instant::now();
    loop {
        let (sa, sb) = (a.stats(), b.stats());
        if sa.sent == sb.received && sb.sent == sa.received {
            a.stop();
            b.stop();
            return (
                a.join().expect("node 0 ends cleanly"),
                b.join().expect("node 1 ends cleanly"),
            );
        }
        assert!(
            t0.elapsed() < WAIT,
            "messages still in flight: {sa:?} {sb:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn single_writer_round_trip(protocol: Protocol) -> (NodeStats, NodeStats) {
    let Pair { ma, a, mb, b, .. } = pair(protocol);
    // Page 1 is managed and first held by node 1 (B).
    let data = pattern(3);
    toucher(&ma, 1).fill(data.clone()).wait();
    assert_eq!(
        toucher(&mb, 1).read().wait(),
        data[..],
        "B reads what A wrote"
    );
    toucher(&mb, 1).write(100, 0xee).wait();
    let mut expect = data.clone();
    expect[100] = 0xee;
    assert_eq!(
        toucher(&ma, 1).read().wait(),
        expect[..],
        "A reads what B wrote"
    );
    let (sa, sb) = settle_and_end(a, b);
    assert_eq!(sa.protocol_errors + sb.protocol_errors, 0, "{sa:?} {sb:?}");
    assert_eq!(sa.faults.resolved, sa.faults.count);
    assert_eq!(sb.faults.resolved, sb.faults.count);
    (sa, sb)
}

#[test]
fn a_page_written_on_one_node_is_read_on_the_other_and_back_under_vmp() {
    let (sa, sb) = single_writer_round_trip(Protocol::Vmp);
    // A: write fetch (page from B, finish), later a read fetch (page from B, finish), and it
    // answers B's read and write invalidations with the page. B: page out twice, and the
    // two invalidations it sends A as manager for its own fetches.
    assert_eq!(sa.sent, counts(&[("fetch", 2), ("finish", 2), ("page", 2)]));
    assert_eq!(sb.sent, counts(&[("inv", 2), ("page", 2)]));
    assert_eq!(sa.installs + sb.installs, 4);
    // A's first write faulted missing; its final read faulted missing again, because B's
    // write took the page away from it (one writer).
    assert_eq!((sa.faults.missing, sa.faults.write_protect), (2, 0));
    // B: missing on its read (its copy went to A), write-protect on its write.
    assert_eq!((sb.faults.missing, sb.faults.write_protect), (1, 1));
}

#[test]
fn a_page_written_on_one_node_is_read_on_the_other_and_back_under_ivy() {
    let (sa, sb) = single_writer_round_trip(Protocol::Ivy);
    assert!(sa.total_sent() > 0 && sb.total_sent() > 0);
    assert_eq!((sa.faults.missing, sa.faults.write_protect), (2, 0));
    assert_eq!((sb.faults.missing, sb.faults.write_protect), (1, 1));
}

#[test]
fn control_messages_reach_the_peer_in_order_with_the_protocol_traffic() {
    let p = pair(Protocol::Vmp);
    let sent = [
        Envelope::Exit(Exit {
            vcpu: 1,
            space: IoSpace::Port,
            write: true,
            addr: 0x3f8,
            data: vec![b'x'],
        }),
        Envelope::Interrupt(Interrupt::Ipi {
            vcpu: 1,
            icr: 0x0000_4500,
        }),
        Envelope::ExitReply {
            vcpu: 0,
            data: vec![0x60],
        },
    ];
    for env in &sent {
        assert!(p.a.send(NodeId(1), env.clone()));
    }
    assert!(p.a.send(NodeId(1), Envelope::Stop { code: 4 }));
    for env in &sent {
        let got = p
            .b_events
            .recv_timeout(WAIT)
            .expect("control message arrives");
        assert_eq!(got, NodeEvent::Control(NodeId(0), env.clone()));
    }
    let got = p.b_events.recv_timeout(WAIT).expect("stop arrives");
    assert_eq!(
        got,
        NodeEvent::PeerStopped {
            peer: NodeId(0),
            code: 4
        }
    );
    p.a.stop();
    p.b.stop();
    let sa = p.a.join().unwrap();
    let sb = p.b.join().unwrap();
    assert_eq!(sb.control_received, 4);
    assert_eq!(
        sa.sent,
        counts(&[
            ("exit", 1),
            ("interrupt", 1),
            ("exit-reply", 1),
            ("stop", 1)
        ])
    );
    // Heartbeats flowed all along but are the transport's business, not the VMM's.
    assert!(p.b_events.try_iter().next().is_none());
}

/// Threads on both nodes increment their own counters, all in the same two pages, so the
/// pages move back and forth for every few increments. A write made on a stale copy, or a
/// thread let go without access, would lose an increment or hang.
fn contended_counters(protocol: Protocol) {
    const ROUNDS: u64 = 150;
    const THREADS: usize = 2;
    let p = pair(protocol);
    let mut running = Vec::new();
    for (mem, node) in [(&p.ma, 0usize), (&p.mb, 1)] {
        for t in 0..THREADS {
            // Pages 0 and 1: one managed by each node; slots spread over both.
            let slot = node * THREADS + t;
            let addr = mem.page_addr((slot % 2) as u64).unwrap() as usize + 8 * slot;
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    // SAFETY: an aligned u64 inside a live region; only this thread writes it.
                    unsafe {
                        let v = std::ptr::read_volatile(addr as *const u64);
                        std::ptr::write_volatile(addr as *mut u64, v + 1);
                    }
                    // Lets the other node's thread take the page between rounds.
                    std::thread::yield_now();
                }
                let _ = tx.send(());
            });
            running.push(rx);
        }
    }
    for rx in running {
        rx.recv_timeout(WAIT * 3)
            .expect("every thread finishes its rounds");
    }
    for mem in [&p.ma, &p.mb] {
        for page in 0..2u64 {
            let bytes = toucher(mem, page).read().wait();
            for slot in (0..2 * THREADS).filter(|s| s % 2 == page as usize) {
                let v = u64::from_le_bytes(bytes[8 * slot..8 * slot + 8].try_into().unwrap());
                assert_eq!(v, ROUNDS, "slot {slot} on page {page}");
            }
        }
    }
    let (sa, sb) = settle_and_end(p.a, p.b);
    assert_eq!(sa.protocol_errors + sb.protocol_errors, 0, "{sa:?} {sb:?}");
}

#[test]
fn contended_pages_keep_every_write_under_vmp() {
    contended_counters(Protocol::Vmp);
}

#[test]
fn contended_pages_keep_every_write_under_ivy() {
    contended_counters(Protocol::Ivy);
}

#[test]
fn a_node_whose_vm_has_ended_still_serves_its_pages_to_a_peer_that_has_not_heard_yet() {
    let Pair { ma, a, mb, b, .. } = pair(Protocol::Vmp);
    // A takes page 1 (first held by B) and writes it; then A's VM ends and its memory leaves
    // userfaultfd, while B, not told yet, reads and then writes the page.
    let data = pattern(9);
    toucher(&ma, 1).fill(data.clone()).wait();
    ma.release().expect("releasing A's memory");
    assert_eq!(
        toucher(&mb, 1).read().wait(),
        data[..],
        "B reads what A wrote"
    );
    toucher(&mb, 1).write(7, 0x11).wait();
    let (sa, sb) = settle_and_end(a, b);
    assert_eq!(sa.protocol_errors + sb.protocol_errors, 0, "{sa:?} {sb:?}");
    assert_eq!(sb.faults.resolved, sb.faults.count, "{sb:?}");
}
