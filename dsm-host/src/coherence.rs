//! The coherence thread of one node: waits on the userfaultfd and the inbox, turns faults and
//! messages into dsm events, and carries out the node's actions on memory and peers.
//!
//! It also tells the VMM about its peers ([`NodeEvent`]). A peer that leaves says `Stop`
//! first ([`CoherenceHandle::broadcast_stop`]); one that goes silent or whose link ends
//! without it is lost, and since the pages it held cannot be had any more and any copy here
//! may be stale, this node then serves no more faults and the VMM is expected to end.

use crate::backend::Backend;
use crate::envelope::Envelope;
use crate::memory::{Memory, MemoryError};
use crate::poll_window::{self, PollWindow, Waited};
use crate::stats::{self, NodeStats, Tally};
use crate::transport::{Inbound, Inbox, InboxSender, PeerReader, Transport, TransportError};
use dsm::{Action, ConfigError, Event, Message, Node, NodeId, PageNo, PageOp, VcpuId};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CoherenceError {
    #[error("node configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("node {node}: {source}")]
    Memory { node: NodeId, source: MemoryError },
    #[error("node {node} sending {msg} to node {to}: {source}")]
    Send {
        node: NodeId,
        to: NodeId,
        msg: &'static str,
        source: Box<TransportError>,
    },
    #[error(
        "node {node} lost node {peer}: {why}; it owned at least {pages_owned} pages (those \
         this node's directory manages), and this node stopped serving faults"
    )]
    PeerLost {
        node: NodeId,
        peer: NodeId,
        pages_owned: u64,
        why: String,
    },
    #[error("node {node} waiting for faults and messages: {source}")]
    Poll {
        node: NodeId,
        source: std::io::Error,
    },
    #[error("starting the coherence thread of node {node}: {source}")]
    Spawn {
        node: NodeId,
        source: std::io::Error,
    },
    #[error("the coherence thread of node {0} panicked")]
    Panicked(NodeId),
}

/// What the VMM hears from its node's coherence thread, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeEvent {
    /// A control envelope from a peer: an exit to serve, the reply to one, an interrupt.
    /// Never a `Stop` (that is [`NodeEvent::PeerStopped`]) nor a heartbeat (the transport
    /// consumes those).
    Control(NodeId, Envelope),
    /// `peer` went silent for the loss timeout, or its link ended (reset, closed, a frame
    /// failing its MAC or malformed) without a `Stop`. `pages_owned` is how many pages this
    /// node's manager directory says it held ([`dsm::Node::pages_owned_by`]), a lower bound
    /// on what the VM lost with it. This node has stopped serving faults: `join` will return
    /// [`CoherenceError::PeerLost`] for the first peer lost.
    PeerLost {
        peer: NodeId,
        pages_owned: u64,
        why: String,
    },
    /// `peer` said `Stop`: the VM is ending with exit status `code`. Its link ending after
    /// that is no loss.
    PeerStopped { peer: NodeId, code: i32 },
}

/// What one node's coherence thread needs.
pub struct Setup {
    pub memory: Arc<Memory>,
    /// The protocol's clock is the thread's: nanoseconds, so `node.hold` is in nanoseconds.
    pub node: dsm::Config,
    pub transport: Box<dyn Transport>,
    /// Both ends of the inbox the transport's receivers feed.
    pub inbox: (InboxSender, Inbox),
    /// Where control messages from peers and news of their stopping or loss go; dropped if
    /// `None`.
    pub events: Option<mpsc::Sender<NodeEvent>>,
    /// Size of the guest-physical ranges faults are counted by.
    pub range_bytes: u64,
    /// The most the thread polls for a peer's answer before it sleeps, while a fault waits
    /// (zero: it sleeps at once); see [`crate::poll_window`].
    pub poll_window: Duration,
}

/// The default page hold (`dsm::Config::hold`, `--page-hold`): a few times the round trip of
/// a page fetch between two nodes on one host, so a node that was just given a page gets some
/// work done on it before it may lose it, and short beside the 10 ms a guest's timer tick
/// paces most sharing at.
pub const DEFAULT_PAGE_HOLD: Duration = Duration::from_micros(500);

type Outcome = (Result<(), CoherenceError>, Box<dyn Transport>);

/// A fault unanswered for this long is reported (see `Worker::report_overdue`). Fetches take
/// milliseconds, and a node that is lost is declared so in about a second.
const OVERDUE: Duration = Duration::from_secs(5);

/// A fault the protocol has not resumed yet.
struct Waiting {
    since: Instant,
    page: PageNo,
    access: dsm::Access,
    /// Already reported as overdue.
    reported: bool,
}

impl Waiting {
    fn new(f: &crate::memory::Fault) -> Waiting {
        Waiting {
            since: Instant::now(),
            page: f.page,
            access: f.access,
            reported: false,
        }
    }
}

/// A running coherence thread.
pub struct CoherenceHandle {
    node: NodeId,
    inbox: InboxSender,
    stats: Arc<Mutex<Tally>>,
    thread: Option<JoinHandle<Outcome>>,
}

impl CoherenceHandle {
    /// Starts the thread. Faults on `memory` are served from then on.
    pub fn spawn(s: Setup) -> Result<CoherenceHandle, CoherenceError> {
        let me = s.node.id;
        let placement = Arc::clone(&s.node.placement);
        let nodes = s.node.nodes;
        let node = Node::new(s.node)?;
        let stats = Arc::new(Mutex::new(Tally::new(me.0, s.range_bytes)));
        let (sender, inbox) = s.inbox;
        let mut worker = Worker {
            me,
            node,
            backend: Backend::new(s.memory, me, placement),
            transport: s.transport,
            peers: (0..nodes)
                .map(NodeId)
                .filter(|&n| n != me)
                .map(|n| (n, PeerState::Up))
                .collect(),
            lost: None,
            ending: false,
            events: s.events,
            stats: Arc::clone(&stats),
            waiting: HashMap::new(),
            next_id: 0,
            poll: PollWindow::new(s.poll_window),
            clock: Instant::now(),
            holds: BinaryHeap::new(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("dsm-node-{}", me.0))
            .spawn(move || {
                let r = worker.run(inbox);
                (r, worker.transport)
            })
            .map_err(|source| CoherenceError::Spawn { node: me, source })?;
        Ok(CoherenceHandle {
            node: me,
            inbox: sender,
            stats,
            thread: Some(thread),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> NodeStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).stats()
    }

    /// Has the thread send `env` to `to`, in order with its protocol messages.
    pub fn send(&self, to: NodeId, env: Envelope) -> bool {
        self.inbox.push(Inbound::Send { to, env })
    }

    /// Asks the thread to stop after what it has already received; `join` waits for it. Peers
    /// are not told: once this node's transport closes they count it lost, so stop every
    /// node before joining any, or use [`Self::broadcast_stop`].
    pub fn stop(&self) {
        self.inbox.push(Inbound::Stop);
    }

    /// Tells every peer still linked that the VM ends with `code` (they see
    /// [`NodeEvent::PeerStopped`]) and stops the thread; `join` then closes the links, after
    /// the `Stop`s have been delivered (bounded wait). False if the thread has already gone.
    pub fn broadcast_stop(&self, code: i32) -> bool {
        self.inbox.push(Inbound::StopAll { code })
    }

    /// Stops the thread (if not yet asked), waits for it, and then closes its transport.
    /// Returns [`CoherenceError::PeerLost`] if a peer was lost while it ran.
    pub fn join(mut self) -> Result<NodeStats, CoherenceError> {
        self.stop();
        let t = self.thread.take().expect("joined once");
        let (r, transport) = t.join().map_err(|_| CoherenceError::Panicked(self.node))?;
        drop(transport);
        r.map(|()| self.stats())
    }
}

impl Drop for CoherenceHandle {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.inbox.push(Inbound::Stop);
            let _ = t.join();
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerState {
    Up,
    /// A send failed: nothing more goes to it, and its receiver will soon say whether it left
    /// (`Stop`) or was lost.
    SendFailed,
    Stopped,
    Lost,
}

/// The receiving end of one link, as the coherence thread reads it.
struct Link {
    r: PeerReader,
    /// When the last frame (a heartbeat at least) came.
    heard: Instant,
    /// Still read: no error, no silence past the limit.
    open: bool,
}

impl Link {
    /// When the peer counts as silent unless a frame comes first.
    fn deadline(&self) -> Option<Instant> {
        self.r.reader.silence_limit().map(|d| self.heard + d)
    }
}

/// How the coherence thread ended: cleanly, or with the first peer lost.
type Ended = Result<(), CoherenceError>;

struct Worker {
    me: NodeId,
    node: Node,
    backend: Backend,
    transport: Box<dyn Transport>,
    peers: BTreeMap<NodeId, PeerState>,
    /// The first peer lost: from then on no fault is served.
    lost: Option<(NodeId, u64, String)>,
    /// A peer said `Stop`: the VM is ending, and the other peers closing their links as
    /// they end too is no loss.
    ending: bool,
    events: Option<mpsc::Sender<NodeEvent>>,
    stats: Arc<Mutex<Tally>>,
    /// Faults not yet resumed, by the id given to the protocol as the "vCPU". Each fault gets
    /// a fresh id: a thread woken early (a wake covers every thread on the page) faults again
    /// and must not look like the same stop twice.
    waiting: HashMap<VcpuId, Waiting>,
    next_id: VcpuId,
    poll: PollWindow,
    /// The protocol's clock counts nanoseconds from here.
    clock: Instant,
    /// Pages whose hold ends, earliest first ([`Action::HoldUntil`]).
    holds: BinaryHeap<Reverse<(u64, PageNo)>>,
}

impl Worker {
    fn mem_err(&self, source: MemoryError) -> CoherenceError {
        CoherenceError::Memory {
            node: self.me,
            source,
        }
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Says which faults have waited longer than [`OVERDUE`], once each: a fetch that never
    /// ends is a bug, and the node's view of the page says where it is stuck.
    fn report_overdue(&mut self) {
        let now = Instant::now();
        for w in self.waiting.values_mut() {
            let waited = now.saturating_duration_since(w.since);
            if w.reported || waited < OVERDUE {
                continue;
            }
            w.reported = true;
            tracing::warn!(
                "node {}: a {} fault on guest-physical {:#x} has waited {:.1} s; {}",
                self.me,
                w.access,
                w.page * dsm::PAGE_SIZE as u64,
                waited.as_secs_f64(),
                self.node.describe(w.page)
            );
            self.stats
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .counts
                .overdue_faults += 1;
        }
    }

    /// The protocol's clock: nanoseconds since the thread started.
    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    fn run(&mut self, mut inbox: Inbox) -> Result<(), CoherenceError> {
        let mem = Arc::clone(self.backend.memory());
        // The links are read here, beside the faults, rather than by a thread per link
        // handing frames on: that hand-off woke this thread once per message, about 22 us
        // a message on the 2-core development host, and a remote fetch waits for two or
        // more messages.
        let mut links: Vec<Link> = self
            .transport
            .take_readers()
            .into_iter()
            .map(|r| Link {
                heard: Instant::now(),
                r,
                open: true,
            })
            .collect();
        let pollfd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = vec![pollfd(mem.as_raw_fd()), pollfd(inbox.as_raw_fd())];
        fds.extend(links.iter().map(|l| pollfd(l.r.reader.as_raw_fd())));
        let mut frames = Vec::new();
        let mut closed = Vec::new();
        loop {
            if self.lost.is_some() {
                // Faults stay unanswered: the pages may be stale or gone with the peer.
                fds[0].fd = -1;
            }
            let now = Instant::now();
            let hold_end = self
                .holds
                .peek()
                .map(|Reverse((until, _))| self.clock + Duration::from_nanos(*until));
            // While faults wait, wake at least once a second to look for one waiting too long.
            let watch = (!self.waiting.is_empty()).then(|| now + Duration::from_secs(1));
            let timeout = links
                .iter()
                .filter(|l| l.open)
                .filter_map(|l| l.deadline())
                .chain(hold_end)
                .chain(watch)
                .map(|d| d.saturating_duration_since(now))
                .min();
            // Polled only while a fault waits for a peer: its vCPU is stopped until then.
            let outstanding = !self.waiting.is_empty() && self.lost.is_none();
            let window = if outstanding {
                self.poll.current()
            } else {
                Duration::ZERO
            };
            let waited = poll_window::wait(&mut fds, window, timeout).map_err(|source| {
                CoherenceError::Poll {
                    node: self.me,
                    source,
                }
            })?;
            if outstanding {
                self.poll.update(waited);
                let mut s = self.stats();
                let polled = match waited {
                    Waited::Polled { after } => {
                        s.counts.polling.answered += 1;
                        after
                    }
                    Waited::Slept { .. } => {
                        s.counts.polling.slept += 1;
                        window
                    }
                };
                s.counts.polling.polled_ns += polled.as_nanos() as u64;
            }
            while self.lost.is_none() {
                let Some(f) = mem.read_fault().map_err(|e| self.mem_err(e))? else {
                    break;
                };
                tracing::trace!(node = %self.me, page = f.page, addr = f.addr, thread = f.thread,
                    kind = ?f.kind, access = %f.access, "fault");
                self.stats().record_fault(&f);
                let id = self.next_id;
                self.next_id = self.next_id.wrapping_add(1);
                self.waiting.insert(id, Waiting::new(&f));
                self.feed(Event::Fault {
                    vcpu: id,
                    page: f.page,
                    access: f.access,
                })?;
            }
            for (i, l) in links.iter_mut().enumerate() {
                let fd = &mut fds[2 + i];
                if !l.open || fd.revents == 0 {
                    continue;
                }
                let read = l.r.reader.recv_ready(&mut frames);
                if !frames.is_empty() {
                    l.heard = Instant::now();
                }
                for env in frames.drain(..) {
                    match env {
                        Envelope::Heartbeat { .. } => {}
                        env => {
                            if matches!(env, Envelope::Stop { .. }) {
                                l.r.note_stop();
                            }
                            if let Some(done) = self.handle(Inbound::Frame {
                                from: l.r.peer,
                                env,
                            })? {
                                return done;
                            }
                        }
                    }
                }
                if let Err(e) = read {
                    l.open = false;
                    fd.fd = -1;
                    closed.push((l.r.peer, e.to_string()));
                }
            }
            let now = Instant::now();
            for (i, l) in links.iter_mut().enumerate() {
                if l.open && l.deadline().is_some_and(|d| now >= d) {
                    l.open = false;
                    fds[2 + i].fd = -1;
                    l.r.reader.shutdown();
                    self.lose(l.r.peer, l.r.reader.silent_error().to_string());
                }
            }
            for item in inbox.drain() {
                if let Some(done) = self.handle(item)? {
                    return done;
                }
            }
            if self.lost.is_none() {
                self.report_overdue();
            }
            let now = self.now();
            while let Some(&Reverse((until, page))) = self.holds.peek() {
                if until > now || self.lost.is_some() {
                    break;
                }
                self.holds.pop();
                self.feed(Event::HoldOver { page })?;
            }
            // A close is judged after the inbox: when this node was told to stop in the same
            // wake-up, the peer that closed was ending too, and that is no loss.
            for (peer, why) in closed.drain(..) {
                self.lose(peer, why);
            }
        }
    }

    /// Handles one thing that arrived; `Some` with the thread's outcome when it is to end.
    fn handle(&mut self, item: Inbound) -> Result<Option<Ended>, CoherenceError> {
        match item {
            Inbound::Stop => return Ok(Some(self.outcome())),
            Inbound::StopAll { code } => {
                for to in self.peers_up() {
                    self.send(to, Envelope::Stop { code })?;
                }
                return Ok(Some(self.outcome()));
            }
            Inbound::PeerFailed { peer, error } => self.lose(peer, error),
            Inbound::Send { to, env } => self.send(to, env)?,
            Inbound::Frame {
                from,
                env: Envelope::Dsm(msg),
            } => {
                stats::count(&mut self.stats().counts.received, msg.name());
                if self.lost.is_none() {
                    self.feed(Event::Message { from, msg })?;
                }
            }
            Inbound::Frame {
                from,
                env: Envelope::Stop { code },
            } => {
                self.stats().counts.control_received += 1;
                let s = self.peers.entry(from).or_insert(PeerState::Up);
                if matches!(*s, PeerState::Up | PeerState::SendFailed) {
                    *s = PeerState::Stopped;
                    let first = !self.ending;
                    self.ending = true;
                    tracing::info!(node = %self.me, peer = %from, code, "peer stopped");
                    self.event(NodeEvent::PeerStopped { peer: from, code });
                    // Passed on before this node ends and closes its links: a peer that
                    // sees this node's link close before `from`'s own Stop reaches it
                    // would otherwise take the close for a loss.
                    if first {
                        for to in self.peers_up().into_iter().filter(|&p| p != from) {
                            let _ = self.send(to, Envelope::Stop { code });
                        }
                    }
                }
            }
            Inbound::Frame {
                from,
                env: Envelope::Lost { node, why },
            } => {
                self.stats().counts.control_received += 1;
                // A peer saying it lost this very node is one whose link to it broke; its
                // own close, read next, is what this node reports.
                if NodeId(node) != self.me {
                    self.lose(NodeId(node), format!("node {from} lost it: {why}"));
                }
            }
            Inbound::Frame { from, env } => {
                self.stats().counts.control_received += 1;
                self.event(NodeEvent::Control(from, env));
            }
        }
        Ok(None)
    }

    fn event(&self, e: NodeEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    fn outcome(&self) -> Result<(), CoherenceError> {
        match &self.lost {
            None => Ok(()),
            Some((peer, pages_owned, why)) => Err(CoherenceError::PeerLost {
                node: self.me,
                peer: *peer,
                pages_owned: *pages_owned,
                why: why.clone(),
            }),
        }
    }

    /// The peers still up, collected so that sending to them may change their state.
    fn peers_up(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|p| *p.1 == PeerState::Up)
            .map(|p| *p.0)
            .collect()
    }

    /// Reports `peer` lost, once, unless it said `Stop` first, and stops serving faults.
    fn lose(&mut self, peer: NodeId, why: String) {
        let s = self.peers.entry(peer).or_insert(PeerState::Up);
        if matches!(*s, PeerState::Stopped | PeerState::Lost) {
            return;
        }
        if self.ending {
            *s = PeerState::Stopped;
            tracing::info!(node = %self.me, %peer, why, "peer left while the VM ends");
            return;
        }
        *s = PeerState::Lost;
        let pages_owned = self
            .node
            .pages_owned_by(peer, self.backend.memory().pages());
        tracing::error!(node = %self.me, %peer, pages_owned, why, "peer lost; no more faults served");
        self.event(NodeEvent::PeerLost {
            peer,
            pages_owned,
            why: why.clone(),
        });
        if self.lost.is_none() {
            // The peers still up hear of it before this node's links close as it ends, so
            // that none of them takes this node's leaving for the first loss.
            for to in self.peers_up() {
                let notice = Envelope::Lost {
                    node: peer.0,
                    why: why.clone(),
                };
                if let Err(e) = self.send(to, notice) {
                    tracing::warn!(node = %self.me, %to, error = %e, "could not tell of the loss");
                }
            }
            self.lost = Some((peer, pages_owned, why));
        }
    }

    /// Sends to a peer that is still up; what is meant for a peer that left, was lost or
    /// whose link broke is dropped, since nobody is there to act on it. A failed send on a
    /// link is not reported here: the link's receiver says soon after whether the peer left
    /// or was lost, and only it can tell.
    fn send(&mut self, to: NodeId, env: Envelope) -> Result<(), CoherenceError> {
        let name = env.name();
        let state = self.peers.get(&to).copied().unwrap_or(PeerState::Up);
        if state != PeerState::Up {
            tracing::debug!(node = %self.me, %to, msg = name, ?state, "not sent: peer is not up");
            return Ok(());
        }
        match self.transport.send(to, &env) {
            Ok(()) => {}
            Err(TransportError::Link(e)) => {
                tracing::warn!(node = %self.me, %to, msg = name, error = %e, "send failed");
                self.peers.insert(to, PeerState::SendFailed);
                return Ok(());
            }
            Err(source) => {
                return Err(CoherenceError::Send {
                    node: self.me,
                    to,
                    msg: name,
                    source: Box::new(source),
                })
            }
        }
        stats::count(&mut self.stats().counts.sent, name);
        Ok(())
    }

    /// Feeds one event and carries out its actions, and those of the completions they cause,
    /// in order.
    fn feed(&mut self, ev: Event) -> Result<(), CoherenceError> {
        let mut queue = VecDeque::from([ev]);
        let mut out = Vec::new();
        while let Some(ev) = queue.pop_front() {
            out.clear();
            let now = self.now();
            self.node.advance(now);
            if let Err(e) = self.node.handle(ev, &mut out) {
                // Refused and unchanged: a misbehaving peer, not a reason to stop serving.
                tracing::warn!(node = %self.me, error = %e, "coherence event refused");
                let mut s = self.stats();
                s.counts.protocol_errors += 1;
                s.counts.last_protocol_error = Some(e.to_string());
                continue;
            }
            for action in out.drain(..) {
                match action {
                    Action::Send { to, msg } => self.send(to, Envelope::Dsm(msg))?,
                    Action::SendPage { to, page, access } => {
                        let data = self.backend.capture(page).map_err(|e| self.mem_err(e))?;
                        let msg = Message::PageData { page, access, data };
                        self.send(to, Envelope::Dsm(msg))?;
                        queue.push_back(Event::PageSent { page });
                    }
                    Action::Page { page, op } => {
                        let install = matches!(op, PageOp::Install { .. });
                        self.backend.apply(page, &op).map_err(|e| self.mem_err(e))?;
                        if install {
                            self.stats().counts.installs += 1;
                            queue.push_back(Event::PageInstalled { page });
                        }
                    }
                    Action::HoldUntil { page, until } => self.holds.push(Reverse((until, page))),
                    Action::Resume { vcpu, page } => {
                        // Counted before the wake, so whoever sees the thread go on sees it.
                        if let Some(w) = self.waiting.remove(&vcpu) {
                            self.stats().record_resolved(w.since.elapsed());
                        }
                        self.backend.resume(page).map_err(|e| self.mem_err(e))?;
                    }
                }
            }
        }
        Ok(())
    }
}
