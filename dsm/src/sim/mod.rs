//! A deterministic simulator: N nodes running the protocol, a network with random delays that
//! keeps each sender/receiver pair in order (as TCP does) and lets different pairs overtake,
//! hosts that report completions late, and several vCPUs per node issuing random accesses.
//!
//! Everything random comes from one seeded generator and every collection is walked in a fixed
//! order, so a configuration line ([`SimConfig`]'s `Display`) replays a run exactly.
//!
//! After every step the simulator checks, for the page the step touched:
//! - at most one node can write the page;
//! - every readable copy holds the value of the last write performed; under the asynchronous
//!   protocol with [`Ordering::Paper`] a read-only copy may lag only while a write
//!   invalidation is on its way to it (or held at the node), which is the window the paper's
//!   design accepts and which the simulator counts as `stale_reads`; under Ivy and under
//!   [`Ordering::Tso`] there is no such window;
//!   data a node installs is always the last value written;
//! - no vCPU has waited longer than a bound derived from the delays and the node count;
//! - every message goes to another member of the VM, and that member accepts it.
//!
//! At the end the vCPUs stop and the run must drain: every fault resumed, every node quiet.
//!
//! Instead of random accesses, vCPUs can run fixed programs ([`Sim::load_programs`]) while
//! the simulator records what each access read or wrote ([`Sim::history`]); [`litmus`] checks
//! those histories against the x86 litmus patterns.

mod config;
pub mod litmus;
mod workload;

pub use config::{SimConfig, Workload};

use crate::event::{Action, Event, PageOp};
use crate::node::{Config, Node, Ordering as MemOrdering, Protocol};
use crate::placement::{Modulo, Placement};
use crate::rng::Rng;
use crate::types::{zero_page, Access, NodeId, PageData, PageNo, Prot, VcpuId, PAGE_SIZE};
use crate::wire::Message;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::fmt;
use std::sync::Arc;

/// Counts from a run (or from one phase of a scripted run, after [`Sim::reset_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub steps: u64,
    /// Messages between different nodes (loopback is not a message).
    pub messages: u64,
    pub bytes: u64,
    pub by_kind: BTreeMap<&'static str, u64>,
    pub faults: u64,
    pub reads: u64,
    pub writes: u64,
    /// Reads that returned an older value while an invalidation was on its way (asynchronous
    /// protocol only).
    pub stale_reads: u64,
    /// Longest chain of messages each caused by the previous one.
    pub max_depth: u32,
    /// Chain length at the last vCPU resume: how many messages it waited for in sequence.
    pub last_resume_depth: Option<u32>,
    pub max_wait: u64,
    /// Retried accesses ([`SimConfig::retry`]) that found their page gone again: the page
    /// came and left before the vCPU used it.
    pub refaults: u64,
}

/// A broken invariant, with what is needed to replay it.
#[derive(Clone, Debug)]
pub struct Failure {
    pub config: SimConfig,
    pub step: u64,
    pub time: u64,
    pub what: Box<str>,
    /// Filled in by [`shrink`] / [`run_traced`].
    pub trace: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "invariant broken at step {} (t={}): {}",
            self.step, self.time, self.what
        )?;
        writeln!(
            f,
            "replay: DSM_REPLAY='{}' cargo test --release -p dsm --test sim replay -- --nocapture",
            self.config
        )?;
        if !self.trace.is_empty() {
            writeln!(f, "trace ({} steps):", self.trace.len())?;
            for l in &self.trace {
                writeln!(f, "  {l}")?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct Slot {
    prot: Prot,
    /// The value the page holds here; `None` once dropped.
    data: Option<u64>,
}

/// The accesses a vCPU still has to issue, in order.
type Program = VecDeque<(PageNo, Access)>;

/// One access a vCPU performed: the value it read, or the value it wrote. Every write in a
/// run writes a value never written before, and pages start at 0, so a value names its write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observed {
    pub page: PageNo,
    pub access: Access,
    pub value: u64,
}

#[derive(Clone, Copy, Debug)]
struct Blocked {
    page: PageNo,
    access: Access,
    since: u64,
}

enum Item {
    Deliver {
        from: u16,
        to: u16,
        bytes: Vec<u8>,
        depth: u32,
    },
    Complete {
        node: u16,
        ev: Event,
        depth: u32,
    },
    Vcpu {
        node: u16,
        vcpu: u16,
    },
    /// A resumed vCPU retries the access it faulted on.
    Retry {
        node: u16,
        vcpu: u16,
    },
}

struct Sched {
    time: u64,
    seq: u64,
    item: Item,
}

impl PartialEq for Sched {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.seq) == (o.time, o.seq)
    }
}
impl Eq for Sched {}
impl PartialOrd for Sched {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Sched {
    // Reversed: BinaryHeap pops the earliest.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.time, o.seq).cmp(&(self.time, self.seq))
    }
}

pub struct Sim {
    cfg: SimConfig,
    rng: Rng,
    nodes: Vec<Node>,
    mem: Vec<Vec<Slot>>,
    truth: Vec<u64>,
    next_value: u64,
    vcpus: Vec<Vec<Option<Blocked>>>,
    heap: BinaryHeap<Sched>,
    seq: u64,
    now: u64,
    /// Latest delivery time per (from, to), to keep each pair in order.
    chan: Vec<u64>,
    /// Write invalidations in the network, per (node, page).
    inflight_winv: Vec<u32>,
    auto: bool,
    /// Per node and vCPU, the accesses still to issue, when vCPUs run fixed programs.
    programs: Option<Vec<Vec<Program>>>,
    /// Per node and vCPU, what each access observed (recorded while programs run).
    history: Vec<Vec<Vec<Observed>>>,
    bound: u64,
    pub stats: Stats,
    trace: Option<Vec<String>>,
    step_no: u64,
}

fn page_bytes(value: u64) -> PageData {
    let mut d = zero_page();
    for (i, w) in d.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(value ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    }
    d
}

fn page_value(d: &[u8; PAGE_SIZE]) -> Option<u64> {
    let v = u64::from_le_bytes(d[..8].try_into().ok()?);
    (page_bytes(v)[..] == d[..]).then_some(v)
}

fn short(m: &Message) -> String {
    match m {
        Message::Fetch {
            page,
            access,
            requester,
        }
        | Message::Finish {
            page,
            access,
            requester,
        }
        | Message::Req {
            page,
            access,
            requester,
        }
        | Message::Fwd {
            page,
            access,
            requester,
        } => format!("{}(p{page} {access} by {requester})", m.name()),
        Message::Inv {
            page,
            access,
            requester,
            owner,
        } => format!("inv(p{page} {access} for {requester} owner {owner})"),
        Message::Inval { page } | Message::InvalAck { page } => format!("{}(p{page})", m.name()),
        Message::PageData { page, access, data } => format!(
            "page(p{page} {access} value {})",
            page_value(data).map_or("corrupt".into(), |v| v.to_string())
        ),
    }
}

impl Sim {
    pub fn new(cfg: SimConfig) -> Sim {
        let placement: Arc<dyn Placement> = Arc::new(Modulo { nodes: cfg.nodes });
        Sim::with_placement(cfg, placement)
    }

    /// `placement` decides managers and initial owners; the initial owner starts with the page
    /// writable and holding value 0.
    pub fn with_placement(cfg: SimConfig, placement: Arc<dyn Placement>) -> Sim {
        let n = cfg.nodes as usize;
        let pages = cfg.pages as usize;
        let nodes = (0..cfg.nodes)
            .map(|i| {
                Node::new(Config {
                    id: NodeId(i),
                    nodes: cfg.nodes,
                    protocol: cfg.protocol,
                    placement: placement.clone(),
                    ordering: cfg.ordering,
                    hold: u64::from(cfg.hold),
                })
                .expect("simulated node count is within MAX_NODES")
            })
            .collect();
        let mem = (0..n)
            .map(|i| {
                (0..pages)
                    .map(|p| {
                        let owner = placement.initial_owner(p as PageNo).0 as usize == i;
                        Slot {
                            prot: if owner { Prot::ReadWrite } else { Prot::None },
                            data: owner.then_some(0),
                        }
                    })
                    .collect()
            })
            .collect();
        // Per fetch: at most six messages in sequence plus two completions and a held-back
        // wait; a vCPU waits behind at most every other node's fetch, twice (a read then a
        // write), plus one completion. Acknowledged invalidations add a round trip.
        let chain = match cfg.ordering {
            MemOrdering::Tso => 8,
            MemOrdering::Paper => 6,
        };
        // A fetch may wait out two holds: the read copies' and then the owner's.
        let per_fetch =
            chain * cfg.delay + 4 * cfg.local + 4 + 2 * u64::from(cfg.hold) + u64::from(cfg.retry);
        let bound = (3 * n as u64 + 3) * per_fetch;
        Sim {
            rng: Rng::new(cfg.seed),
            nodes,
            mem,
            truth: vec![0; pages],
            next_value: 0,
            vcpus: vec![vec![None; cfg.vcpus as usize]; n],
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0,
            chan: vec![0; n * n],
            inflight_winv: vec![0; n * pages],
            auto: false,
            programs: None,
            history: vec![vec![Vec::new(); cfg.vcpus as usize]; n],
            bound,
            stats: Stats::default(),
            trace: None,
            step_no: 0,
            cfg,
        }
    }

    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    pub fn node(&self, i: u16) -> &Node {
        &self.nodes[i as usize]
    }

    pub fn enable_trace(&mut self) {
        self.trace = Some(Vec::new());
    }

    pub fn take_trace(&mut self) -> Vec<String> {
        self.trace.take().unwrap_or_default()
    }

    pub fn reset_stats(&mut self) {
        self.stats = Stats::default();
    }

    fn fail(&self, what: String) -> Failure {
        Failure {
            config: self.cfg,
            step: self.step_no,
            time: self.now,
            what: what.into(),
            trace: Vec::new(),
        }
    }

    fn schedule(&mut self, time: u64, item: Item) {
        self.seq += 1;
        self.heap.push(Sched {
            time,
            seq: self.seq,
            item,
        });
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(format!("#{} t={} {}", self.step_no, self.now, line()));
        }
    }

    /// Starts every active vCPU of the workload issuing random accesses.
    pub fn start_workload(&mut self) {
        self.auto = true;
        for node in 0..self.cfg.nodes {
            for vcpu in 0..self.cfg.vcpus {
                if workload::active(self.cfg.workload, node, vcpu) {
                    let t = self.now + self.rng.range(0, self.cfg.think);
                    self.schedule(t, Item::Vcpu { node, vcpu });
                }
            }
        }
    }

    /// Each vCPU `programs[node][vcpu]` issues its accesses in order, after a random start
    /// delay and with random think times between them, instead of random accesses; what each
    /// access observes is recorded ([`Sim::history`]). Run with [`Sim::run_until_quiet`].
    pub fn load_programs(&mut self, programs: Vec<Vec<Vec<(PageNo, Access)>>>) {
        self.auto = true;
        let mut progs = Vec::new();
        for (node, vs) in programs.into_iter().enumerate() {
            let mut row = Vec::new();
            for (vcpu, p) in vs.into_iter().enumerate() {
                if !p.is_empty() {
                    let t = self.now + self.rng.range(0, self.cfg.think);
                    let (node, vcpu) = (node as u16, vcpu as u16);
                    self.schedule(t, Item::Vcpu { node, vcpu });
                }
                row.push(VecDeque::from(p));
            }
            progs.push(row);
        }
        self.programs = Some(progs);
    }

    /// What vCPU `vcpu` of `node` observed, in program order.
    pub fn history(&self, node: u16, vcpu: u16) -> &[Observed] {
        &self.history[node as usize][vcpu as usize]
    }

    /// The value of the last write to `page` (0 if none).
    pub fn last_value(&self, page: PageNo) -> u64 {
        self.truth[page as usize]
    }

    /// vCPUs finish their current access and issue no more.
    pub fn stop_workload(&mut self) {
        self.auto = false;
    }

    /// One vCPU makes one access now (faulting if its node lacks the access).
    pub fn access(
        &mut self,
        node: u16,
        vcpu: u16,
        page: PageNo,
        access: Access,
    ) -> Result<(), Failure> {
        if self.vcpus[node as usize][vcpu as usize].is_some() {
            return Err(self.fail(format!("n{node} v{vcpu} is still stopped on a fault")));
        }
        self.log(|| format!("n{node} v{vcpu} {access} p{page}"));
        if self.mem[node as usize][page as usize].prot.permits(access) {
            self.perform((node, vcpu), page, access)?;
            self.next_access(node, vcpu);
            return self.check_page(page);
        }
        self.stats.faults += 1;
        self.vcpus[node as usize][vcpu as usize] = Some(Blocked {
            page,
            access,
            since: self.now,
        });
        let ev = Event::Fault {
            vcpu: VcpuId::from(vcpu),
            page,
            access,
        };
        self.feed(node, ev, 0)?;
        self.check_page(page)
    }

    fn next_access(&mut self, node: u16, vcpu: u16) {
        if self.auto {
            let t = self.now + self.rng.range(0, self.cfg.think);
            self.schedule(t, Item::Vcpu { node, vcpu });
        }
    }

    /// The access itself, on the node's memory, by vCPU `vcpu` of `node`.
    fn perform(
        &mut self,
        (node, vcpu): (u16, u16),
        page: PageNo,
        access: Access,
    ) -> Result<(), Failure> {
        let slot = &self.mem[node as usize][page as usize];
        let truth = self.truth[page as usize];
        let Some(v) = slot.data else {
            return Err(self.fail(format!("n{node} accessed p{page} with no contents")));
        };
        match access {
            Access::Read => {
                self.stats.reads += 1;
                self.observe(node, vcpu, page, access, v);
                if v != truth {
                    if self.may_lag(node, page) {
                        self.stats.stale_reads += 1;
                    } else {
                        return Err(self.fail(format!(
                            "n{node} read value {v} of p{page}, last write was {truth}"
                        )));
                    }
                }
            }
            Access::Write => {
                self.stats.writes += 1;
                if v != truth {
                    return Err(self.fail(format!(
                        "n{node} wrote p{page} holding value {v}, last write was {truth}"
                    )));
                }
                self.next_value += 1;
                self.truth[page as usize] = self.next_value;
                self.mem[node as usize][page as usize].data = Some(self.next_value);
                self.observe(node, vcpu, page, access, self.next_value);
            }
        }
        Ok(())
    }

    fn observe(&mut self, node: u16, vcpu: u16, page: PageNo, access: Access, value: u64) {
        if self.programs.is_some() {
            self.history[node as usize][vcpu as usize].push(Observed {
                page,
                access,
                value,
            });
        }
    }

    /// The copy may hold an older value than the last write: only under the paper's
    /// fire-and-forget invalidations, and only while one is on its way to this copy.
    fn may_lag(&self, node: u16, page: PageNo) -> bool {
        self.cfg.protocol == Protocol::Vmp
            && self.cfg.ordering == MemOrdering::Paper
            && self.condemned(node, page)
    }

    /// A write invalidation for this copy is in the network or held at the node.
    fn condemned(&self, node: u16, page: PageNo) -> bool {
        let n = node as usize;
        self.inflight_winv[n * self.cfg.pages as usize + page as usize] > 0
            || self.nodes[n].deferred(page).any(|m| {
                matches!(
                    m,
                    Message::Inv {
                        access: Access::Write,
                        ..
                    }
                )
            })
    }

    fn feed(&mut self, node: u16, ev: Event, depth: u32) -> Result<(), Failure> {
        let mut out = Vec::new();
        let desc = self.trace.is_some().then(|| match &ev {
            Event::Message { from, msg } => format!("n{node} <- {from}: {}", short(msg)),
            other => format!("n{node} {other:?}"),
        });
        self.nodes[node as usize].advance(self.now);
        let r = self.nodes[node as usize].handle(ev, &mut out);
        if let Some(d) = desc {
            let acts: Vec<String> = out
                .iter()
                .map(|a| match a {
                    Action::Send { to, msg } => format!("send {to} {}", short(msg)),
                    Action::SendPage { to, page, access } => {
                        format!("send-page {to} p{page} {access}")
                    }
                    Action::Page { page, op } => match op {
                        PageOp::Install { data, writable } => format!(
                            "install p{page} value {} {}",
                            page_value(data).map_or("corrupt".into(), |v| v.to_string()),
                            if *writable { "rw" } else { "ro" }
                        ),
                        op => format!("{op:?} p{page}"),
                    },
                    Action::Resume { vcpu, page } => format!("resume v{vcpu} p{page}"),
                    Action::HoldUntil { page, until } => format!("hold p{page} until {until}"),
                })
                .collect();
            self.log(|| format!("{d} => [{}]", acts.join("; ")));
        }
        if let Err(e) = r {
            return Err(self.fail(format!("n{node} refused an event: {e}")));
        }
        for a in out {
            self.apply(node, a, depth)?;
        }
        Ok(())
    }

    fn apply(&mut self, node: u16, a: Action, depth: u32) -> Result<(), Failure> {
        let n = node as usize;
        match a {
            Action::Send { to, msg } => self.transmit(node, to, msg, depth + 1),
            Action::SendPage { to, page, access } => {
                let Some(v) = self.mem.get(n).and_then(|m| m.get(page as usize)?.data) else {
                    return Err(self.fail(format!("n{node} must send p{page} but has no contents")));
                };
                let msg = Message::PageData {
                    page,
                    access,
                    data: page_bytes(v),
                };
                self.transmit(node, to, msg, depth + 1)?;
                let t = self.now + self.rng.range(0, self.cfg.local);
                self.schedule(
                    t,
                    Item::Complete {
                        node,
                        ev: Event::PageSent { page },
                        depth,
                    },
                );
                Ok(())
            }
            Action::Page { page, op } => {
                let Some(slot) = self.mem.get(n).and_then(|m| m.get(page as usize)) else {
                    return Err(self.fail(format!("n{node} changed p{page}, outside the run")));
                };
                let has = slot.data.is_some();
                let (prot, data) = match op {
                    PageOp::Drop => (Prot::None, None),
                    PageOp::Hide if has => (Prot::None, slot.data),
                    PageOp::ReadOnly if has => (Prot::ReadOnly, slot.data),
                    PageOp::Writable if has => (Prot::ReadWrite, slot.data),
                    PageOp::Install { data, writable } => {
                        let Some(v) = page_value(&data) else {
                            return Err(self.fail(format!("n{node} got corrupt bytes for p{page}")));
                        };
                        if v != self.truth[page as usize] {
                            return Err(self.fail(format!(
                                "n{node} installs value {v} of p{page}, last write was {}",
                                self.truth[page as usize]
                            )));
                        }
                        let t = self.now + self.rng.range(0, self.cfg.local);
                        self.schedule(
                            t,
                            Item::Complete {
                                node,
                                ev: Event::PageInstalled { page },
                                depth,
                            },
                        );
                        let p = if writable {
                            Prot::ReadWrite
                        } else {
                            Prot::ReadOnly
                        };
                        (p, Some(v))
                    }
                    op => {
                        return Err(
                            self.fail(format!("n{node} {op:?} on p{page}, which it does not hold"))
                        )
                    }
                };
                self.mem[n][page as usize] = Slot { prot, data };
                Ok(())
            }
            Action::HoldUntil { page, until } => {
                if until <= self.now {
                    return Err(self.fail(format!(
                        "n{node} holds p{page} until {until}, which has passed"
                    )));
                }
                let ev = Event::HoldOver { page };
                self.schedule(until, Item::Complete { node, ev, depth });
                Ok(())
            }
            Action::Resume { vcpu, page } => {
                let v = vcpu as usize;
                match self.vcpus[n].get(v).copied().flatten() {
                    Some(b) if b.page == page => {
                        if !self.mem[n][page as usize].prot.permits(b.access) {
                            return Err(self.fail(format!(
                                "n{node} v{vcpu} resumed without {} access to p{page}",
                                b.access
                            )));
                        }
                        self.stats.last_resume_depth = Some(depth);
                        if self.cfg.retry > 0 {
                            let retry = u64::from(self.cfg.retry);
                            let t = self.now + self.rng.range(retry / 2, retry);
                            let vcpu = vcpu as u16;
                            self.schedule(t, Item::Retry { node, vcpu });
                            return Ok(());
                        }
                        self.vcpus[n][v] = None;
                        self.stats.max_wait = self.stats.max_wait.max(self.now - b.since);
                        self.perform((node, vcpu as u16), page, b.access)?;
                        self.next_access(node, vcpu as u16);
                        Ok(())
                    }
                    _ => Err(self.fail(format!("n{node} resumed v{vcpu}, not stopped on p{page}"))),
                }
            }
        }
    }

    fn transmit(&mut self, from: u16, to: NodeId, msg: Message, depth: u32) -> Result<(), Failure> {
        if to.0 >= self.cfg.nodes || to.0 == from {
            return Err(self.fail(format!("n{from} sent {} to {to}", short(&msg))));
        }
        if let Message::Inv {
            page,
            access: Access::Write,
            ..
        } = msg
        {
            self.inflight_winv[to.0 as usize * self.cfg.pages as usize + page as usize] += 1;
        }
        let bytes = msg.to_bytes();
        self.stats.messages += 1;
        self.stats.bytes += bytes.len() as u64;
        *self.stats.by_kind.entry(msg.name()).or_default() += 1;
        self.stats.max_depth = self.stats.max_depth.max(depth);
        let n = self.cfg.nodes as usize;
        let pair = from as usize * n + to.0 as usize;
        let t = (self.now + self.rng.range(1, self.cfg.delay.max(1))).max(self.chan[pair]);
        self.chan[pair] = t;
        self.schedule(
            t,
            Item::Deliver {
                from,
                to: to.0,
                bytes,
                depth,
            },
        );
        Ok(())
    }

    /// Processes the next scheduled event. `Ok(false)` when nothing is left.
    pub fn step(&mut self) -> Result<bool, Failure> {
        let Some(s) = self.heap.pop() else {
            return Ok(false);
        };
        self.now = s.time;
        self.step_no += 1;
        self.stats.steps += 1;
        let page = match s.item {
            Item::Vcpu { node, vcpu } => {
                if !self.auto || self.vcpus[node as usize][vcpu as usize].is_some() {
                    return Ok(true);
                }
                let (page, access) = match &mut self.programs {
                    Some(p) => match p[node as usize][vcpu as usize].pop_front() {
                        Some(op) => op,
                        None => return Ok(true),
                    },
                    None => workload::next(&mut self.rng, &self.cfg, node, vcpu),
                };
                return self.access(node, vcpu, page, access).map(|_| true);
            }
            Item::Retry { node, vcpu } => {
                let (n, v) = (node as usize, vcpu as usize);
                let Some(b) = self.vcpus[n][v] else {
                    return Err(self.fail(format!("n{node} v{vcpu} retries, but was not stopped")));
                };
                if self.mem[n][b.page as usize].prot.permits(b.access) {
                    self.vcpus[n][v] = None;
                    self.stats.max_wait = self.stats.max_wait.max(self.now - b.since);
                    self.perform((node, vcpu), b.page, b.access)?;
                    self.next_access(node, vcpu);
                } else {
                    // Gone again: the vCPU faults anew, still waiting since its first fault.
                    self.stats.refaults += 1;
                    self.stats.faults += 1;
                    let ev = Event::Fault {
                        vcpu: VcpuId::from(vcpu),
                        page: b.page,
                        access: b.access,
                    };
                    self.feed(node, ev, 0)?;
                }
                b.page
            }
            Item::Deliver {
                from,
                to,
                bytes,
                depth,
            } => {
                let msg = Message::decode(&bytes)
                    .map_err(|e| self.fail(format!("n{from} -> n{to}: undecodable: {e}")))?;
                let page = msg.page();
                if let Message::Inv {
                    access: Access::Write,
                    ..
                } = msg
                {
                    self.inflight_winv[to as usize * self.cfg.pages as usize + page as usize] -= 1;
                }
                let ev = Event::Message {
                    from: NodeId(from),
                    msg,
                };
                self.feed(to, ev, depth)?;
                page
            }
            Item::Complete { node, ev, depth } => {
                let page = match ev {
                    Event::PageSent { page }
                    | Event::PageInstalled { page }
                    | Event::HoldOver { page } => page,
                    _ => unreachable!("only completions and hold ends are scheduled"),
                };
                self.feed(node, ev, depth)?;
                page
            }
        };
        self.check_page(page)?;
        self.check_waits()?;
        Ok(true)
    }

    fn check_page(&self, page: PageNo) -> Result<(), Failure> {
        let p = page as usize;
        let truth = self.truth[p];
        let mut writer = None;
        for (i, m) in self.mem.iter().enumerate() {
            let s = &m[p];
            if s.prot == Prot::ReadWrite {
                if let Some(w) = writer {
                    return Err(self.fail(format!("n{w} and n{i} can both write p{page}")));
                }
                writer = Some(i);
            }
            if s.prot != Prot::None && s.data != Some(truth) {
                let excused = s.prot == Prot::ReadOnly && self.may_lag(i as u16, page);
                if !excused {
                    return Err(self.fail(format!(
                        "n{i} can {} p{page} holding {:?}, last write was {truth}",
                        if s.prot == Prot::ReadOnly {
                            "read"
                        } else {
                            "write"
                        },
                        s.data
                    )));
                }
            }
        }
        Ok(())
    }

    fn check_waits(&mut self) -> Result<(), Failure> {
        for (n, vs) in self.vcpus.iter().enumerate() {
            for (v, b) in vs.iter().enumerate() {
                if let Some(b) = b {
                    if self.now - b.since > self.bound {
                        return Err(self.fail(format!(
                            "n{n} v{v} has waited {} ticks for {} p{} (bound {})",
                            self.now - b.since,
                            b.access,
                            b.page,
                            self.bound
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Steps until nothing is scheduled; fails if that takes unreasonably long.
    pub fn run_until_quiet(&mut self) -> Result<(), Failure> {
        let limit = self.step_no + 1_000_000;
        while self.step()? {
            if self.step_no > limit {
                return Err(self.fail("the run does not drain".into()));
            }
        }
        for (n, vs) in self.vcpus.iter().enumerate() {
            if let Some(v) = vs.iter().position(Option::is_some) {
                return Err(self.fail(format!("n{n} v{v} never resumed")));
            }
        }
        if let Some(n) = self.nodes.iter().position(|n| !n.is_quiet()) {
            return Err(self.fail(format!(
                "n{n} has work left with nothing scheduled: {:?}",
                self.nodes[n]
            )));
        }
        Ok(())
    }
}

/// Runs a configuration: `steps` events of random accesses, then a drain.
pub fn run(cfg: SimConfig) -> Result<Stats, Failure> {
    let mut sim = Sim::new(cfg);
    drive(&mut sim)?;
    Ok(sim.stats)
}

fn drive(sim: &mut Sim) -> Result<(), Failure> {
    sim.start_workload();
    while sim.step_no < sim.cfg.steps && sim.step()? {}
    sim.stop_workload();
    sim.run_until_quiet()
}

/// Runs with a trace of every step; the trace is attached to a failure.
pub fn run_traced(cfg: SimConfig) -> (Result<Stats, Failure>, Vec<String>) {
    let mut sim = Sim::new(cfg);
    sim.enable_trace();
    let r = drive(&mut sim);
    let trace = sim.take_trace();
    match r {
        Ok(()) => (Ok(sim.stats), trace),
        Err(mut f) => {
            f.trace = trace.clone();
            (Err(f), trace)
        }
    }
}

/// Makes a failing configuration smaller (fewer steps, nodes, vCPUs, pages, shorter delays)
/// while it still fails, then replays it with a trace.
pub fn shrink(f: Failure) -> Failure {
    let fails = |c: SimConfig| run(c).err();
    let mut best = f;
    best.config.steps = best.step;
    loop {
        let c = best.config;
        let mut tries = Vec::new();
        if c.nodes > 2 {
            tries.push(SimConfig {
                nodes: c.nodes - 1,
                ..c
            });
        }
        if c.vcpus > 1 {
            tries.push(SimConfig {
                vcpus: c.vcpus - 1,
                ..c
            });
        }
        if c.pages > 1 {
            tries.push(SimConfig {
                pages: c.pages - 1,
                ..c
            });
        }
        for (d, l, t) in [
            (c.delay / 2, c.local, c.think),
            (c.delay, c.local / 2, c.think),
        ] {
            if (d, l) != (c.delay, c.local) && d >= 1 {
                tries.push(SimConfig {
                    delay: d,
                    local: l,
                    think: t,
                    ..c
                });
            }
        }
        let next = tries.into_iter().find_map(|t| {
            fails(t).map(|mut f| {
                f.config.steps = f.step;
                f
            })
        });
        match next {
            Some(n) => best = n,
            None => break,
        }
    }
    let (r, trace) = run_traced(best.config);
    match r {
        Err(mut f) => {
            f.trace = trace;
            f
        }
        Ok(_) => best,
    }
}
