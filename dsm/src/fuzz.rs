//! Entry points shared by the cargo-fuzz targets (`dsm/fuzz`) and the seeded property tests,
//! so CI covers the same checks without a nightly toolchain. Each takes arbitrary bytes and
//! returns a description of the first broken rule; none may panic.

use crate::event::{Action, Event};
use crate::node::{Config, Node, Ordering, Protocol, ProtocolError};
use crate::placement::Modulo;
use crate::sim::{self, SimConfig, Workload};
use crate::types::{zero_page, Access, NodeId, PageNo, VcpuId};
use crate::wire::Message;
use std::collections::BTreeSet;
use std::sync::Arc;

/// Decoding never panics, and whatever decodes encodes back to the same bytes.
pub fn decode(bytes: &[u8]) -> Result<(), String> {
    match Message::decode(bytes) {
        Ok(m) if m.to_bytes() != bytes => Err(format!("{m:?} does not re-encode to its input")),
        _ => Ok(()),
    }
}

/// Reads bytes as a stream of small numbers; runs dry as zeros.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn below(&mut self, n: u8) -> u8 {
        self.u8() % n.max(1)
    }
    fn access(&mut self) -> Access {
        if self.u8() & 1 == 0 {
            Access::Read
        } else {
            Access::Write
        }
    }
}

const NODES: u16 = 3;
const PAGES: u8 = 4;
const VCPUS: u8 = 3;

/// The first byte picks the protocol (bit 0) and, for the asynchronous one, the ordering
/// (bit 1).
fn protocol_and_ordering(b: &mut Bytes) -> (Protocol, Ordering) {
    let first = b.u8();
    let protocol = if first & 1 == 0 {
        Protocol::Vmp
    } else {
        Protocol::Ivy
    };
    let ordering = if first & 2 == 0 {
        Ordering::Tso
    } else {
        Ordering::Paper
    };
    (protocol, ordering)
}

/// Drives three nodes of one protocol with an arbitrary sequence of events (faults, messages
/// from anyone about anything, completions out of the blue). Checked after each event: a
/// refused event leaves the node as it was; a node never sends to itself or to a non-member,
/// never resumes a vCPU that is not stopped on that page, never resumes one twice.
pub fn node_events(bytes: &[u8]) -> Result<(), String> {
    let mut b = Bytes(bytes);
    let (protocol, ordering) = protocol_and_ordering(&mut b);
    let placement = Arc::new(Modulo { nodes: NODES });
    let mut nodes: Vec<Node> = (0..NODES)
        .map(|i| {
            Node::new(Config {
                id: NodeId(i),
                nodes: NODES,
                protocol,
                placement: placement.clone(),
                ordering,
                hold: 0,
            })
            .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut stopped: Vec<BTreeSet<(VcpuId, PageNo)>> = vec![BTreeSet::new(); NODES as usize];
    while !b.0.is_empty() {
        let n = b.below(NODES as u8) as usize;
        let page = PageNo::from(b.below(PAGES));
        let ev = match b.below(4) {
            0 => Event::Fault {
                vcpu: VcpuId::from(b.below(VCPUS)),
                page,
                access: b.access(),
            },
            1 => Event::PageSent { page },
            2 => Event::PageInstalled { page },
            _ => {
                // Node ids up to one past the VM, so out-of-range ids are exercised too.
                let node = |b: &mut Bytes| NodeId(u16::from(b.below(NODES as u8 + 1)));
                let from = node(&mut b);
                let (access, requester, owner) = (b.access(), node(&mut b), node(&mut b));
                let msg = match b.below(8) {
                    0 => Message::Fetch {
                        page,
                        access,
                        requester,
                    },
                    1 => Message::Inv {
                        page,
                        access,
                        requester,
                        owner,
                    },
                    2 => Message::Finish {
                        page,
                        access,
                        requester,
                    },
                    3 => Message::Req {
                        page,
                        access,
                        requester,
                    },
                    4 => Message::Fwd {
                        page,
                        access,
                        requester,
                    },
                    5 => Message::Inval { page },
                    6 => Message::InvalAck { page },
                    _ => Message::PageData {
                        page,
                        access,
                        data: zero_page(),
                    },
                };
                Event::Message { from, msg }
            }
        };
        if let Event::Fault { vcpu, page, .. } = ev {
            // A real vCPU cannot fault again while it is stopped.
            if stopped[n].iter().any(|s| s.0 == vcpu) {
                continue;
            }
            stopped[n].insert((vcpu, page));
        }
        let before = format!("{:?}", nodes[n]);
        let mut out = Vec::new();
        let desc = format!("{ev:?}");
        match nodes[n].handle(ev.clone(), &mut out) {
            Ok(()) | Err(ProtocolError::Loopback(_) | ProtocolError::Deferred(_)) => {}
            Err(e) => {
                if let Event::Fault { vcpu, page, .. } = ev {
                    stopped[n].remove(&(vcpu, page));
                }
                if !out.is_empty() || format!("{:?}", nodes[n]) != before {
                    return Err(format!("n{n} refused {desc} ({e}) but acted on it"));
                }
            }
        }
        for a in out {
            match a {
                Action::Send { to, .. } | Action::SendPage { to, .. }
                    if to.0 >= NODES || to.0 as usize == n =>
                {
                    return Err(format!("n{n} sent to {to} after {desc}"));
                }
                Action::Resume { vcpu, page } if !stopped[n].remove(&(vcpu, page)) => {
                    return Err(format!("n{n} resumed v{vcpu} p{page} after {desc}"));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Turns bytes into a small simulation (2 to 8 nodes, at most 3000 steps) and runs it with all
/// of the simulator's invariants.
pub fn simulation(bytes: &[u8]) -> Result<(), String> {
    let mut b = Bytes(bytes);
    let (protocol, ordering) = protocol_and_ordering(&mut b);
    let seed = (0..8).fold(0u64, |s, _| s << 8 | u64::from(b.u8()));
    let workload = match b.below(4) {
        0 => Workload::FalseSharing,
        1 => Workload::ReadStorm,
        2 => Workload::PingPong,
        _ => Workload::Uniform {
            write_pct: b.below(101),
        },
    };
    let cfg = SimConfig {
        protocol,
        ordering,
        seed,
        nodes: 2 + u16::from(b.below(7)),
        vcpus: 1 + u16::from(b.below(4)),
        pages: 1 + u64::from(b.below(8)),
        steps: 100 + 100 * u64::from(b.below(30)),
        delay: 1 + u64::from(b.below(20)),
        local: u64::from(b.below(6)),
        think: u64::from(b.below(10)),
        workload,
        hold: [0, 0, 4, 30][usize::from(b.below(4))],
        retry: 0,
    };
    // A vCPU that retries later than its page is held can starve: a hold is only promised to
    // keep the invariants with retries no longer than it.
    let cfg = SimConfig {
        retry: u32::from(b.below(31)).min(cfg.hold),
        ..cfg
    };
    sim::run(cfg).map(|_| ()).map_err(|f| f.to_string())
}
