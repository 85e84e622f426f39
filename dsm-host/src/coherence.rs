//! The coherence thread of one node: waits on the userfaultfd and the inbox, turns faults and
//! messages into dsm events, and carries out the node's actions on memory and peers.

use crate::backend::Backend;
use crate::envelope::Envelope;
use crate::memory::{Memory, MemoryError};
use crate::stats::NodeStats;
use crate::transport::{Inbound, Inbox, InboxSender, Transport, TransportError};
use dsm::{Action, ConfigError, Event, Message, Node, NodeId, PageOp, VcpuId};
use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
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
        source: TransportError,
    },
    #[error("node {node} lost its link to node {peer}: {error}")]
    PeerFailed {
        node: NodeId,
        peer: NodeId,
        error: String,
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

/// What one node's coherence thread needs.
pub struct Setup {
    pub memory: Arc<Memory>,
    pub node: dsm::Config,
    pub transport: Box<dyn Transport>,
    /// Both ends of the inbox the transport's receivers feed.
    pub inbox: (InboxSender, Inbox),
    /// Where control messages from peers (exits, interrupts, stop, heartbeat) go; dropped if
    /// `None`.
    pub control: Option<mpsc::Sender<(NodeId, Envelope)>>,
    /// Size of the guest-physical ranges faults are counted by.
    pub range_bytes: u64,
}

type Outcome = (Result<(), CoherenceError>, Box<dyn Transport>);

/// A running coherence thread.
pub struct CoherenceHandle {
    node: NodeId,
    inbox: InboxSender,
    stats: Arc<Mutex<NodeStats>>,
    thread: Option<JoinHandle<Outcome>>,
}

impl CoherenceHandle {
    /// Starts the thread. Faults on `memory` are served from then on.
    pub fn spawn(s: Setup) -> Result<CoherenceHandle, CoherenceError> {
        let me = s.node.id;
        let placement = Arc::clone(&s.node.placement);
        let node = Node::new(s.node)?;
        let stats = Arc::new(Mutex::new(NodeStats::new(me.0, s.range_bytes)));
        let (sender, inbox) = s.inbox;
        let mut worker = Worker {
            me,
            node,
            backend: Backend::new(s.memory, me, placement),
            transport: s.transport,
            control: s.control,
            stats: Arc::clone(&stats),
            waiting: HashMap::new(),
            next_id: 0,
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
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Has the thread send `env` to `to`, in order with its protocol messages.
    pub fn send(&self, to: NodeId, env: Envelope) -> bool {
        self.inbox.push(Inbound::Send { to, env })
    }

    /// Asks the thread to stop after what it has already received; `join` waits for it.
    pub fn stop(&self) {
        self.inbox.push(Inbound::Stop);
    }

    /// Stops the thread (if not yet asked), waits for it, and then closes its transport:
    /// stop every node before joining any, so no node sees a peer vanish while running.
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

struct Worker {
    me: NodeId,
    node: Node,
    backend: Backend,
    transport: Box<dyn Transport>,
    control: Option<mpsc::Sender<(NodeId, Envelope)>>,
    stats: Arc<Mutex<NodeStats>>,
    /// Faults not yet resumed, by the id given to the protocol as the "vCPU". Each fault gets
    /// a fresh id: a thread woken early (a wake covers every thread on the page) faults again
    /// and must not look like the same stop twice.
    waiting: HashMap<VcpuId, Instant>,
    next_id: VcpuId,
}

impl Worker {
    fn mem_err(&self, source: MemoryError) -> CoherenceError {
        CoherenceError::Memory {
            node: self.me,
            source,
        }
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, NodeStats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&mut self, mut inbox: Inbox) -> Result<(), CoherenceError> {
        let mem = Arc::clone(self.backend.memory());
        let mut fds = [
            libc::pollfd {
                fd: mem.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: inbox.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        loop {
            crate::memory::poll(&mut fds, -1).map_err(|source| CoherenceError::Poll {
                node: self.me,
                source,
            })?;
            while let Some(f) = mem.read_fault().map_err(|e| self.mem_err(e))? {
                tracing::trace!(node = %self.me, page = f.page, addr = f.addr, thread = f.thread,
                    kind = ?f.kind, access = %f.access, "fault");
                self.stats().faults.record_fault(&f);
                let id = self.next_id;
                self.next_id = self.next_id.wrapping_add(1);
                self.waiting.insert(id, Instant::now());
                self.feed(Event::Fault {
                    vcpu: id,
                    page: f.page,
                    access: f.access,
                })?;
            }
            for item in inbox.drain() {
                match item {
                    Inbound::Stop => return Ok(()),
                    Inbound::PeerFailed { peer, error } => {
                        return Err(CoherenceError::PeerFailed {
                            node: self.me,
                            peer,
                            error,
                        })
                    }
                    Inbound::Send { to, env } => self.send(to, env)?,
                    Inbound::Frame {
                        from,
                        env: Envelope::Dsm(msg),
                    } => {
                        NodeStats::count(&mut self.stats().received, msg.name());
                        self.feed(Event::Message { from, msg })?;
                    }
                    Inbound::Frame { from, env } => {
                        self.stats().control_received += 1;
                        if let Some(c) = &self.control {
                            let _ = c.send((from, env));
                        }
                    }
                }
            }
        }
    }

    fn send(&mut self, to: NodeId, env: Envelope) -> Result<(), CoherenceError> {
        let name = env.name();
        self.transport
            .send(to, &env)
            .map_err(|source| CoherenceError::Send {
                node: self.me,
                to,
                msg: name,
                source,
            })?;
        NodeStats::count(&mut self.stats().sent, name);
        Ok(())
    }

    /// Feeds one event and carries out its actions, and those of the completions they cause,
    /// in order.
    fn feed(&mut self, ev: Event) -> Result<(), CoherenceError> {
        let mut queue = VecDeque::from([ev]);
        let mut out = Vec::new();
        while let Some(ev) = queue.pop_front() {
            out.clear();
            if let Err(e) = self.node.handle(ev, &mut out) {
                // Refused and unchanged: a misbehaving peer, not a reason to stop serving.
                tracing::warn!(node = %self.me, error = %e, "coherence event refused");
                let mut s = self.stats();
                s.protocol_errors += 1;
                s.last_protocol_error = Some(e.to_string());
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
                            self.stats().installs += 1;
                            queue.push_back(Event::PageInstalled { page });
                        }
                    }
                    Action::Resume { vcpu, page } => {
                        // Counted before the wake, so whoever sees the thread go on sees it.
                        if let Some(t0) = self.waiting.remove(&vcpu) {
                            self.stats().faults.record_resolved(t0.elapsed());
                        }
                        self.backend.resume(page).map_err(|e| self.mem_err(e))?;
                    }
                }
            }
        }
        Ok(())
    }
}
