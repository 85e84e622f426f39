//! Helpers shared by the integration tests: regions, patterned pages, threads that touch
//! memory and may stop on a fault, waited for with a bound, and nodes of one VM linked over
//! loopback.

#![allow(dead_code)]

use dsm::{Modulo, NodeId, PageData, PageNo, Protocol, PAGE_SIZE};
use dsm_host::{
    config_hash, CoherenceHandle, DoorLimits, Inbox, InboxSender, LinkParams, Liveness, Memory,
    NodeEvent, Setup, TcpConfig, TcpTransport, Transport,
};
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bound on every wait; a test that needs it has failed.
pub const WAIT: Duration = Duration::from_secs(10);

/// A region of `pages` pages at guest-physical `gpa`; fails the test, saying why, when
/// userfaultfd cannot be had (these tests must never pass without it).
pub fn region(gpa: u64, pages: usize) -> Arc<Memory> {
    match Memory::new(gpa, pages * PAGE_SIZE) {
        Ok(m) => Arc::new(m),
        Err(e) => panic!("this test needs userfaultfd and could not have it: {e}"),
    }
}

pub fn page_of(gpa: u64) -> PageNo {
    gpa / PAGE_SIZE as u64
}

/// A page whose bytes depend on `seed` and their offset.
pub fn pattern(seed: u8) -> PageData {
    let mut p = dsm::types::zero_page();
    for (i, b) in p.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    p
}

/// A thread about to access one page of a region.
pub struct Toucher {
    addr: usize,
}

/// The access running on its own thread; it may be stopped on a fault.
pub struct Pending<T> {
    rx: mpsc::Receiver<T>,
    what: String,
}

pub fn toucher(mem: &Memory, page: PageNo) -> Toucher {
    Toucher {
        addr: mem.page_addr(page).expect("page in the region") as usize,
    }
}

impl Toucher {
    /// Copies the whole page out with loads.
    pub fn read(self) -> Pending<Vec<u8>> {
        let addr = self.addr;
        spawn(format!("read of {addr:#x}"), move || {
            let mut v = vec![0u8; PAGE_SIZE];
            // SAFETY: `addr` is a page of a live region (the test keeps it alive); a missing
            // or write-protected page only stops this thread until it is served.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), PAGE_SIZE) };
            v
        })
    }

    /// Stores one byte.
    pub fn write(self, offset: usize, value: u8) -> Pending<()> {
        let addr = self.addr + offset;
        spawn(format!("write of {addr:#x}"), move || {
            // SAFETY: as for `read`; one byte inside the page.
            unsafe { std::ptr::write_volatile(addr as *mut u8, value) }
        })
    }

    /// Fills the whole page with stores only (no load first, so one write fault).
    pub fn fill(self, data: PageData) -> Pending<()> {
        let addr = self.addr;
        spawn(format!("fill of {addr:#x}"), move || {
            // SAFETY: as for `read`; exactly one page.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, PAGE_SIZE) }
        })
    }
}

fn spawn<T: Send + 'static>(what: String, f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    Pending { rx, what }
}

impl<T> Pending<T> {
    /// The access's result; fails the test if it is still stopped after [`WAIT`].
    pub fn wait(self) -> T {
        self.rx
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("the {} was not let go within {WAIT:?}", self.what))
    }

    /// True while the access has not completed.
    pub fn still_stopped(&self) -> bool {
        matches!(self.rx.try_recv(), Err(mpsc::TryRecvError::Empty))
    }
}

/// The secret and configuration every node of a test VM shares.
pub const SECRET: &[u8] = b"one VM, one secret";
pub const CONFIG: &[u8] = b"vm: test nodes, 16 KiB";

pub fn params(me: u16, secret: &[u8], config: &[u8]) -> LinkParams {
    LinkParams {
        me: NodeId(me),
        secret: secret.to_vec(),
        config_hash: config_hash(config),
        config_parts: Vec::new(),
        timeout: WAIT,
    }
}

/// Node `me`'s view of a VM whose nodes listen at `addrs` (indexed by node id).
pub fn tcp_config(me: u16, addrs: &[SocketAddr], liveness: Liveness) -> TcpConfig {
    TcpConfig {
        link: params(me, SECRET, CONFIG),
        peers: (0..addrs.len() as u16)
            .filter(|&n| n != me)
            .map(|n| (NodeId(n), addrs[n as usize]))
            .collect(),
        connect_timeout: WAIT,
        liveness,
        link_delay: Duration::ZERO,
        door: DoorLimits::default(),
    }
}

/// Starts the coherence thread of node `id` of `nodes` on `mem`, placing page `n` on node
/// `n mod nodes`, with fault ranges of two pages.
pub fn start(
    mem: &Arc<Memory>,
    id: u16,
    nodes: u16,
    protocol: Protocol,
    transport: Box<dyn Transport>,
    inbox: (InboxSender, Inbox),
    events: mpsc::Sender<NodeEvent>,
) -> CoherenceHandle {
    CoherenceHandle::spawn(Setup {
        memory: Arc::clone(mem),
        node: dsm::Config {
            id: NodeId(id),
            nodes,
            protocol,
            placement: Arc::new(Modulo { nodes }),
            ordering: dsm::Ordering::default(),
            hold: 0,
        },
        transport,
        inbox,
        events: Some(events),
        range_bytes: 2 * PAGE_SIZE as u64,
        poll_window: dsm_host::DEFAULT_POLL_WINDOW,
    })
    .expect("starting the coherence thread")
}

/// One node of a test VM: its memory, its coherence thread and what it reports.
pub struct Running {
    pub mem: Arc<Memory>,
    pub node: CoherenceHandle,
    pub events: mpsc::Receiver<NodeEvent>,
}

/// `nodes` nodes of one VM in this process, each with four pages, linked over loopback and
/// running.
pub fn cluster(nodes: u16, protocol: Protocol, liveness: Liveness) -> Vec<Running> {
    let listeners: Vec<TcpListener> = (0..nodes)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let linking: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(me, l)| {
            let cfg = tcp_config(me as u16, &addrs, liveness);
            let inbox = Inbox::new().unwrap();
            let tx = inbox.0.clone();
            let t = std::thread::spawn(move || TcpTransport::establish(&cfg, l, tx));
            (t, inbox)
        })
        .collect();
    linking
        .into_iter()
        .enumerate()
        .map(|(me, (t, inbox))| {
            let transport = t
                .join()
                .expect("no panic")
                .unwrap_or_else(|e| panic!("node {me} links to its peers: {e}"));
            let mem = region(0, 4);
            let (tx, events) = mpsc::channel();
            let node = start(
                &mem,
                me as u16,
                nodes,
                protocol,
                Box::new(transport),
                inbox,
                tx,
            );
            Running { mem, node, events }
        })
        .collect()
}

/// Events until `done` says enough or `within` passes; heartbeats must not be among them.
pub fn events_until(
    rx: &mpsc::Receiver<NodeEvent>,
    within: Duration,
    mut done: impl FnMut(&[NodeEvent]) -> bool,
) -> Vec<NodeEvent> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    while !done(&got) {
        let left = within.saturating_sub(t0.elapsed());
        match rx.recv_timeout(left) {
            Ok(e) => got.push(e),
            Err(_) => break,
        }
    }
    got
}
