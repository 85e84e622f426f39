//! One node's half of the coherence protocol: the part both protocols share (vCPU faults and
//! waiters, one outstanding fetch per page, host completions, loopback of messages a node
//! sends to itself) and the dispatch to the protocol's message handlers.
//!
//! Events are handled one at a time and each handler runs to completion, which gives the
//! paper's guarded atomic actions. A handler checks everything it needs before changing
//! anything, so a message a node cannot handle is refused with an error and leaves the node as
//! it was.

mod ivy;
mod vmp;

use crate::event::{Action, Event, PageOp};
use crate::placement::Placement;
use crate::types::{Access, NodeId, NodeSet, PageNo, Prot, VcpuId, MAX_NODES};
use crate::wire::Message;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use thiserror::Error;

/// Which coherence protocol a node runs. All nodes of a VM must run the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Kaneda et al., Fig. 5: the manager sends invalidations and nobody waits for them.
    Vmp,
    /// Li & Hudak's Ivy (improved centralized manager): the owner invalidates every copy and
    /// waits for each acknowledgement before it hands the page over.
    Ivy,
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Protocol, String> {
        match s {
            "vmp" => Ok(Protocol::Vmp),
            "ivy" => Ok(Protocol::Ivy),
            _ => Err("expected vmp or ivy".into()),
        }
    }
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Vmp => "vmp",
            Protocol::Ivy => "ivy",
        }
    }
}

/// What a guest may observe across nodes. All nodes of a VM must use the same one.
///
/// Only the asynchronous protocol has a choice. Under [`Ordering::Paper`] a write
/// invalidation is fire-and-forget (Fig. 5): the manager sends `inv` to the owner and to every
/// read copy at once, the owner hands the page to the writer at once, and a read copy keeps
/// serving reads of the old value until its `inv` arrives. With a flag and its data on
/// different pages, a reader can then fetch the new flag and still read the old data from its
/// doomed copy (the message-passing pattern, forbidden on x86). Under [`Ordering::Tso`] the
/// manager sends `inv` to the read copies first, each copy drops the page and answers the
/// manager with `inval-ack`, and only when every copy has answered does the manager send the
/// owner its `inv` (the one that moves the page). A writer therefore gets the page only once
/// no other copy exists: every readable copy holds the last value written, so no node (and no
/// vCPU of the writer's own node) can see a write while another still reads what it replaced.
/// That is sequential consistency per page plus a single global order of writes, stronger
/// than x86-TSO requires and so safe for x86 guests. Reads are unchanged; a write costs one
/// `inval-ack` per other copy and, when there are copies, one round trip more before the
/// writer resumes.
///
/// Ivy needs no option: its owner already waits for every acknowledgement before it hands a
/// page to a writer, so its copies never lag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Ordering {
    /// Invalidations acknowledged before a writer gets the page: x86-TSO (indeed SC) holds.
    #[default]
    Tso,
    /// The paper's fire-and-forget invalidations. **Unsafe for x86 guests**: a reader can see
    /// a later write to one page and an earlier write to another not yet (stale reads).
    Paper,
}

impl std::str::FromStr for Ordering {
    type Err = String;
    fn from_str(s: &str) -> Result<Ordering, String> {
        match s {
            "tso" => Ok(Ordering::Tso),
            "paper" => Ok(Ordering::Paper),
            _ => Err("expected tso or paper (paper is unsafe for x86 guests)".into()),
        }
    }
}

impl Ordering {
    pub fn name(self) -> &'static str {
        match self {
            Ordering::Tso => "tso",
            Ordering::Paper => "paper",
        }
    }
}

pub struct Config {
    pub id: NodeId,
    pub nodes: u16,
    pub protocol: Protocol,
    pub placement: Arc<dyn Placement>,
    /// Defaults to [`Ordering::Tso`]; ignored by Ivy.
    pub ordering: Ordering,
    /// How long a page given to this node stays before a request that takes it away (or
    /// takes its write access away) is served: Mirage's Δ. Without it, two nodes writing one
    /// page take turns at the rate of the network, and each vCPU gets one access per round
    /// trip; with it, each gets the page for at least this long, whatever the page's sharing.
    /// In the units of the clock the host passes to [`Node::advance`]; 0: no hold.
    pub hold: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("a VM spans 1 to {MAX_NODES} nodes, got {0}")]
    Nodes(u16),
    #[error("node id {id} is outside the VM's {nodes} nodes (0..{nodes})")]
    Id { id: NodeId, nodes: u16 },
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("{from} named node {node}, but the VM has nodes 0..{nodes}")]
    NoSuchNode {
        from: NodeId,
        node: NodeId,
        nodes: u16,
    },
    #[error("{msg} for page {page:#x} from {from}: {why}")]
    Unexpected {
        from: NodeId,
        page: PageNo,
        msg: &'static str,
        why: &'static str,
    },
    /// The event was accepted, but a message the node then sent itself was refused: the
    /// node's state was already inconsistent (only reachable with a misbehaving peer).
    #[error("while handling its own message: {0}")]
    Loopback(Box<ProtocolError>),
    /// The completion was accepted, but a message held back until it arrived was then refused.
    #[error("message held back for a completion: {0}")]
    Deferred(Box<ProtocolError>),
    #[error("{what} for page {page:#x}: {why}")]
    Local {
        page: PageNo,
        what: &'static str,
        why: &'static str,
    },
}

/// A completion the node is waiting for from its host; the page's copy does not change until
/// it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Pending {
    #[default]
    None,
    /// `SendPage` issued; on `PageSent`, drop the local copy if `drop_after`.
    Sending { drop_after: bool },
    /// `Install` issued for a fetch of this access.
    Installing(Access),
}

/// The local copy of one page and the requests around it.
#[derive(Debug, Default, PartialEq)]
struct Copy {
    /// The paper's `p.state`, as last told to the host.
    prot: Prot,
    /// This node holds the current contents and is (or is about to be recorded as) the
    /// owner. A late invalidation must then hide the page, never discard it.
    master: bool,
    /// The fetch this node has asked for and not yet received (at most one per page).
    fetch: Option<Access>,
    /// vCPUs stopped on this page, in fault order.
    waiters: Vec<(VcpuId, Access)>,
    pending: Pending,
    /// Messages about this copy that arrived while a completion was pending or the copy was
    /// held, in arrival order.
    deferred: VecDeque<(NodeId, Message)>,
    /// Until when the copy stays here ([`Config::hold`]).
    held_until: u64,
    /// The `held_until` a `HoldUntil` was last asked for.
    hold_timer: u64,
    // Ivy owner side.
    copyset: NodeSet,
    queue: VecDeque<(NodeId, Access)>,
    /// Write request being served and the copies yet to acknowledge their invalidation.
    invalidating: Option<(NodeId, NodeSet)>,
}

/// The paper's manager record for one page (`p.own`, `p.copyset`, `p.busy`), plus the queue
/// of fetches that found it busy.
#[derive(Debug, PartialEq)]
struct Managed {
    owner: NodeId,
    copyset: NodeSet,
    busy: Option<(NodeId, Access)>,
    queue: VecDeque<(NodeId, Access)>,
    /// [`Ordering::Tso`]: read copies of the write fetch being served that have not yet
    /// acknowledged their invalidation; the owner is told to hand over when this empties.
    acks: NodeSet,
}

pub struct Node {
    id: NodeId,
    nodes: u16,
    protocol: Protocol,
    ordering: Ordering,
    placement: Arc<dyn Placement>,
    hold: u64,
    /// The host's clock, as last told ([`Node::advance`]).
    now: u64,
    copies: BTreeMap<PageNo, Copy>,
    managed: BTreeMap<PageNo, Managed>,
    /// Messages this node sent to itself, handled before `handle` returns.
    local: VecDeque<(NodeId, Message)>,
}

/// Records still in their initial state are left out: they are created on first look and
/// mean the same as no record, so two nodes that print alike behave alike.
impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copies: Vec<_> = self
            .copies
            .iter()
            .filter(|(p, c)| **c != self.fresh_copy(**p))
            .collect();
        let managed: Vec<_> = self
            .managed
            .iter()
            .filter(|(p, m)| **m != self.fresh_managed(**p))
            .collect();
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("protocol", &self.protocol)
            .field("copies", &copies)
            .field("managed", &managed)
            .field("local", &self.local)
            .finish()
    }
}

fn unexpected(from: NodeId, msg: &Message, why: &'static str) -> ProtocolError {
    ProtocolError::Unexpected {
        from,
        page: msg.page(),
        msg: msg.name(),
        why,
    }
}

/// A message that makes node `me` give up its copy of the page, or its write access, for
/// another node: what a hold ([`Config::hold`]) keeps waiting.
fn takes_away(me: NodeId, msg: &Message) -> bool {
    match *msg {
        Message::Inv { requester, .. } | Message::Fwd { requester, .. } => requester != me,
        Message::Inval { .. } => true,
        _ => false,
    }
}

impl Node {
    pub fn new(cfg: Config) -> Result<Node, ConfigError> {
        if cfg.nodes == 0 || cfg.nodes as usize > MAX_NODES {
            return Err(ConfigError::Nodes(cfg.nodes));
        }
        if cfg.id.0 >= cfg.nodes {
            return Err(ConfigError::Id {
                id: cfg.id,
                nodes: cfg.nodes,
            });
        }
        Ok(Node {
            id: cfg.id,
            nodes: cfg.nodes,
            protocol: cfg.protocol,
            ordering: cfg.ordering,
            placement: cfg.placement,
            hold: cfg.hold,
            now: 0,
            copies: BTreeMap::new(),
            managed: BTreeMap::new(),
            local: VecDeque::new(),
        })
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    pub fn ordering(&self) -> Ordering {
        self.ordering
    }

    /// Moves the node's clock to `now` (it never goes back); a host calls it before each
    /// event when pages are held ([`Config::hold`]).
    pub fn advance(&mut self, now: u64) {
        self.now = self.now.max(now);
    }

    /// Protection this node has given its copy of `page`.
    pub fn prot(&self, page: PageNo) -> Prot {
        match self.copies.get(&page) {
            Some(c) => c.prot,
            None if self.placement.initial_owner(page) == self.id => Prot::ReadWrite,
            None => Prot::None,
        }
    }

    /// Messages about `page` held back until a host completion arrives.
    pub fn deferred(&self, page: PageNo) -> impl Iterator<Item = &Message> {
        self.copies
            .get(&page)
            .into_iter()
            .flat_map(|c| c.deferred.iter().map(|d| &d.1))
    }

    /// Nothing in progress: no fetch, waiter, completion, held-back message, busy manager
    /// record or unfinished invalidation.
    pub fn is_quiet(&self) -> bool {
        self.local.is_empty()
            && self.copies.values().all(|c| {
                c.fetch.is_none()
                    && c.waiters.is_empty()
                    && c.pending == Pending::None
                    && c.deferred.is_empty()
                    && c.queue.is_empty()
                    && c.invalidating.is_none()
            })
            && self
                .managed
                .values()
                .all(|m| m.busy.is_none() && m.queue.is_empty() && m.acks.is_empty())
    }

    /// What this node knows of `page`, for a report on a fault that waits too long: its copy
    /// (protection, the fetch it awaits, a completion pending, messages held back and until
    /// when) and the manager's record, kept here or on the node named.
    pub fn describe(&self, page: PageNo) -> String {
        let copy = match self.copies.get(&page) {
            Some(c) => format!(
                "copy here: {:?}{}, fetch out {:?}, waiters {}, pending {:?}, held back {:?}, \
                 held until {} (now {})",
                c.prot,
                if c.master { " (current, owner)" } else { "" },
                c.fetch,
                c.waiters.len(),
                c.pending,
                c.deferred
                    .iter()
                    .map(|(n, m)| format!("{} from {n}", m.name()))
                    .collect::<Vec<_>>(),
                c.held_until,
                self.now
            ),
            None => "no copy here, never asked for".to_string(),
        };
        let manager = self.manager(page);
        let record = match self.managed.get(&page) {
            _ if manager != self.id => format!("managed by {manager}"),
            Some(m) => format!(
                "managed here: owner {}, copies {:?}, serving {:?}, queued {:?}, awaiting \
                 acknowledgements from {:?}",
                m.owner, m.copyset, m.busy, m.queue, m.acks
            ),
            None => format!(
                "managed here, never asked for (owner {})",
                self.placement.initial_owner(page)
            ),
        };
        format!("{copy}; {record}")
    }

    /// How many pages of `pages` this node's manager directory says `peer` holds: the pages
    /// this node manages whose recorded owner is `peer`. Meant for a host that has lost `peer`
    /// and must say how much of the guest went with it.
    ///
    /// Only the directory kept here is consulted, so with N nodes this covers about 1/N of the
    /// pages (those placed on this node as manager); what `peer` holds of pages managed
    /// elsewhere only their managers know. A page never asked for counts for its initial owner.
    /// Per protocol:
    /// - VMP: the owner recorded at the last `finish`, and also a page whose write fetch by
    ///   `peer` is being served (the old owner has given up or is giving up its copy, so the
    ///   only current one may be in flight to `peer`).
    /// - Ivy: the manager's probable owner, which already names a writer from the moment its
    ///   request was forwarded, so a page in flight to `peer` is counted too.
    pub fn pages_owned_by(&self, peer: NodeId, pages: std::ops::Range<PageNo>) -> u64 {
        let mut n = 0;
        for page in pages {
            if self.manager(page) != self.id {
                continue;
            }
            let owned = match self.managed.get(&page) {
                None => self.placement.initial_owner(page) == peer,
                Some(m) => {
                    m.owner == peer
                        || (self.protocol == Protocol::Vmp && m.busy == Some((peer, Access::Write)))
                }
            };
            n += u64::from(owned);
        }
        n
    }

    /// Feeds one event; the actions to carry out, in order, are appended to `out`. On error
    /// the event was refused and the node is unchanged by it.
    pub fn handle(&mut self, ev: Event, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        let r = match ev {
            Event::Fault { vcpu, page, access } => self.fault(vcpu, page, access, out),
            Event::Message { from, msg } => {
                if from.0 >= self.nodes {
                    Err(ProtocolError::NoSuchNode {
                        from,
                        node: from,
                        nodes: self.nodes,
                    })
                } else if from == self.id {
                    Err(unexpected(
                        from,
                        &msg,
                        "a node's messages to itself are handled inside it, never delivered",
                    ))
                } else {
                    self.message(from, msg, out)
                }
            }
            Event::PageSent { page } => self.page_sent(page, out),
            Event::PageInstalled { page } => self.page_installed(page, out),
            Event::HoldOver { page } => self.hold_over(page, out),
        };
        // A refused event changed nothing and sent nothing, so there is nothing to drain.
        r?;
        self.drain_local(out)
            .map_err(|e| ProtocolError::Loopback(Box::new(e)))
    }

    fn drain_local(&mut self, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        let mut first = Ok(());
        while let Some((from, msg)) = self.local.pop_front() {
            let r = self.message(from, msg, out);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    fn fresh_copy(&self, page: PageNo) -> Copy {
        let owner = self.placement.initial_owner(page) == self.id;
        Copy {
            prot: if owner { Prot::ReadWrite } else { Prot::None },
            master: owner,
            ..Copy::default()
        }
    }

    fn fresh_managed(&self, page: PageNo) -> Managed {
        let owner = self.placement.initial_owner(page);
        Managed {
            owner,
            copyset: NodeSet::single(owner),
            busy: None,
            queue: VecDeque::new(),
            acks: NodeSet::EMPTY,
        }
    }

    fn copy(&mut self, page: PageNo) -> &mut Copy {
        if !self.copies.contains_key(&page) {
            let fresh = self.fresh_copy(page);
            self.copies.insert(page, fresh);
        }
        self.copies.get_mut(&page).expect("inserted above")
    }

    fn managed(&mut self, page: PageNo) -> &mut Managed {
        if !self.managed.contains_key(&page) {
            let fresh = self.fresh_managed(page);
            self.managed.insert(page, fresh);
        }
        self.managed.get_mut(&page).expect("inserted above")
    }

    fn manager(&self, page: PageNo) -> NodeId {
        self.placement.manager(page)
    }

    /// The paper's "send": to another node through the host, to itself by loopback.
    fn send(&mut self, to: NodeId, msg: Message, out: &mut Vec<Action>) {
        if to == self.id {
            self.local.push_back((self.id, msg));
        } else {
            out.push(Action::Send { to, msg });
        }
    }

    fn set_prot(&mut self, page: PageNo, prot: Prot, out: &mut Vec<Action>) {
        let c = self.copy(page);
        if c.prot == prot {
            return;
        }
        let op = match prot {
            Prot::ReadOnly => PageOp::ReadOnly,
            Prot::ReadWrite => PageOp::Writable,
            Prot::None if c.master => PageOp::Hide,
            Prot::None => PageOp::Drop,
        };
        c.prot = prot;
        out.push(Action::Page { page, op });
    }

    fn fault(
        &mut self,
        vcpu: VcpuId,
        page: PageNo,
        access: Access,
        out: &mut Vec<Action>,
    ) -> Result<(), ProtocolError> {
        let c = self.copy(page);
        if c.waiters.iter().any(|w| w.0 == vcpu) {
            return Err(ProtocolError::Local {
                page,
                what: "fault",
                why: "this vCPU is already stopped on the page",
            });
        }
        c.waiters.push((vcpu, access));
        self.kick(page, out);
        Ok(())
    }

    /// Resumes every waiter the copy now satisfies, and asks for the page if some still wait
    /// and no fetch is out. A write is asked for if any waiter writes, so one fetch serves all.
    fn kick(&mut self, page: PageNo, out: &mut Vec<Action>) {
        let c = self.copy(page);
        if c.pending != Pending::None {
            return;
        }
        let prot = c.prot;
        c.waiters.retain(|&(vcpu, a)| {
            if prot.permits(a) {
                out.push(Action::Resume { vcpu, page });
                false
            } else {
                true
            }
        });
        if c.waiters.is_empty() || c.fetch.is_some() {
            return;
        }
        let access = if c.waiters.iter().any(|w| w.1 == Access::Write) {
            Access::Write
        } else {
            Access::Read
        };
        c.fetch = Some(access);
        let requester = self.id;
        let msg = match self.protocol {
            Protocol::Vmp => Message::Fetch {
                page,
                access,
                requester,
            },
            Protocol::Ivy => Message::Req {
                page,
                access,
                requester,
            },
        };
        self.send(self.manager(page), msg, out);
    }

    fn message(
        &mut self,
        from: NodeId,
        msg: Message,
        out: &mut Vec<Action>,
    ) -> Result<(), ProtocolError> {
        let named = match &msg {
            Message::Fetch { requester, .. }
            | Message::Finish { requester, .. }
            | Message::Req { requester, .. }
            | Message::Fwd { requester, .. } => [Some(*requester), None],
            Message::Inv {
                requester, owner, ..
            } => [Some(*requester), Some(*owner)],
            _ => [None, None],
        };
        if let Some(node) = named.into_iter().flatten().find(|n| n.0 >= self.nodes) {
            return Err(ProtocolError::NoSuchNode {
                from,
                node,
                nodes: self.nodes,
            });
        }
        let ours = match self.protocol {
            Protocol::Vmp => match msg {
                Message::Fetch { .. }
                | Message::Inv { .. }
                | Message::Finish { .. }
                | Message::PageData { .. } => true,
                Message::InvalAck { .. } => self.ordering == Ordering::Tso,
                _ => false,
            },
            Protocol::Ivy => !matches!(
                msg,
                Message::Fetch { .. } | Message::Inv { .. } | Message::Finish { .. }
            ),
        };
        if !ours {
            return Err(unexpected(
                from,
                &msg,
                "message of the other protocol (or, inval-ack, of the other ordering)",
            ));
        }
        // Manager traffic never waits for the local copy; everything else does. Under VMP an
        // `inval-ack` goes to the manager; under Ivy to the owner's copy.
        let to_copy = !matches!(
            (self.protocol, &msg),
            (
                _,
                Message::Fetch { .. } | Message::Finish { .. } | Message::Req { .. }
            ) | (Protocol::Vmp, Message::InvalAck { .. })
        );
        let page = msg.page();
        if to_copy {
            let held = takes_away(self.id, &msg) && self.held(page);
            let c = self.copy(page);
            if c.pending != Pending::None || !c.deferred.is_empty() || held {
                c.deferred.push_back((from, msg));
                if held {
                    self.hold_timer(page, out);
                }
                return Ok(());
            }
        }
        self.dispatch(from, msg, out)
    }

    fn dispatch(
        &mut self,
        from: NodeId,
        msg: Message,
        out: &mut Vec<Action>,
    ) -> Result<(), ProtocolError> {
        match self.protocol {
            Protocol::Vmp => vmp::on_message(self, from, msg, out),
            Protocol::Ivy => ivy::on_message(self, from, msg, out),
        }
    }

    /// The page came here less than [`Config::hold`] ago.
    fn held(&mut self, page: PageNo) -> bool {
        let now = self.now;
        self.copy(page).held_until > now
    }

    /// The page was given to this node now: it stays for the hold.
    fn start_hold(&mut self, page: PageNo) {
        if self.hold > 0 {
            let until = self.now.saturating_add(self.hold);
            self.copy(page).held_until = until;
        }
    }

    /// Asks the host to say when the hold of `page` is over, once per hold.
    fn hold_timer(&mut self, page: PageNo, out: &mut Vec<Action>) {
        let c = self.copy(page);
        if c.hold_timer != c.held_until {
            c.hold_timer = c.held_until;
            out.push(Action::HoldUntil {
                page,
                until: c.held_until,
            });
        }
    }

    fn hold_over(&mut self, page: PageNo, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        if self.held(page) {
            // Early, or the page came back and was held again meanwhile.
            self.hold_timer(page, out);
            return Ok(());
        }
        let r = self.run_deferred(page, out);
        if self.protocol == Protocol::Ivy {
            ivy::serve(self, page, out);
        }
        r
    }

    fn page_sent(&mut self, page: PageNo, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        let c = self.copy(page);
        let Pending::Sending { drop_after } = c.pending else {
            return Err(ProtocolError::Local {
                page,
                what: "page sent",
                why: "no page was being sent",
            });
        };
        c.pending = Pending::None;
        if drop_after {
            // The copy was hidden before its bytes left; now nobody needs them here.
            c.prot = Prot::None;
            out.push(Action::Page {
                page,
                op: PageOp::Drop,
            });
        }
        self.after_change(page, out);
        self.run_deferred(page, out)
    }

    fn page_installed(&mut self, page: PageNo, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        let c = self.copy(page);
        let Pending::Installing(access) = c.pending else {
            return Err(ProtocolError::Local {
                page,
                what: "page installed",
                why: "no page was being installed",
            });
        };
        c.pending = Pending::None;
        c.prot = Prot::granted_by(access);
        c.fetch = None;
        if access == Access::Write {
            c.master = true;
            c.copyset = NodeSet::EMPTY;
        }
        self.start_hold(page);
        // The paper sends finish, then restarts the VM process. Restarting first takes a
        // send off the waiting vCPU's path: finish only frees the manager for the next
        // fetch of this page, which has to wait for it either way. A fetch that `kick`
        // sends for a stronger access reaches the manager first and waits in its queue.
        self.after_change(page, out);
        self.finish_fetch(page, access, out);
        self.run_deferred(page, out)
    }

    /// Tells the manager a fetch is over (the asynchronous protocol only; Ivy's owner
    /// already knows).
    fn finish_fetch(&mut self, page: PageNo, access: Access, out: &mut Vec<Action>) {
        if self.protocol == Protocol::Vmp {
            let requester = self.id;
            let finish = Message::Finish {
                page,
                access,
                requester,
            };
            self.send(self.manager(page), finish, out);
        }
    }

    /// A local copy was granted without any data moving (the owner asked for its own page).
    fn grant_local(&mut self, page: PageNo, access: Access, out: &mut Vec<Action>) {
        self.set_prot(page, Prot::granted_by(access), out);
        self.copy(page).fetch = None;
        self.start_hold(page);
        self.kick(page, out);
        self.finish_fetch(page, access, out);
    }

    fn after_change(&mut self, page: PageNo, out: &mut Vec<Action>) {
        self.kick(page, out);
        if self.protocol == Protocol::Ivy {
            ivy::serve(self, page, out);
        }
    }

    /// Handles the held-back messages of `page` in order, until a completion is pending again
    /// or the next one is held.
    fn run_deferred(&mut self, page: PageNo, out: &mut Vec<Action>) -> Result<(), ProtocolError> {
        let mut first = Ok(());
        let me = self.id;
        loop {
            let held = self.held(page);
            let c = self.copy(page);
            if c.pending != Pending::None {
                break;
            }
            let Some((_, front)) = c.deferred.front() else {
                break;
            };
            if held && takes_away(me, front) {
                self.hold_timer(page, out);
                break;
            }
            let (from, msg) = self
                .copy(page)
                .deferred
                .pop_front()
                .expect("looked at above");
            let r = self.dispatch(from, msg, out);
            if first.is_ok() {
                first = r.map_err(|e| ProtocolError::Deferred(Box::new(e)));
            }
        }
        first
    }
}
