//! Where each vCPU of the VM runs, and a vCPU moving to another node while the VM runs: the
//! messages the nodes exchange for it, and the routing that keeps every interrupt for the
//! vCPU on its way to wherever it runs.
//!
//! A move, asked of the I/O node (which serves the control API):
//! 1. the I/O node tells the vCPU's node (`Move`);
//! 2. that node tells the new node the vCPU is coming (`Coming`: hold its interrupts), routes
//!    the vCPU's interrupts there from now on, pauses its share of the VM for the moment it
//!    takes to read the vCPU's state, lets it stand by, and sends the state (`State`, in
//!    pieces that fit a link frame);
//! 3. the new node tells every node where the vCPU runs (`Moved`), before the vCPU runs, so
//!    the I/O node knows the vCPU's next device access comes from there; it then runs the
//!    vCPU from that state and injects the interrupts it held.
//!
//! The pages the vCPU touches follow it through the coherence protocol, as any page a vCPU
//! faults on. Every node creates every vCPU at start, those of other nodes standing by, so
//! a move creates nothing.

use crate::ipi::Msi;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Most bytes of saved state one `State` message carries: what fits one envelope.
const PIECE: usize = dsm_host::MAX_MIGRATION_BYTES - 16;
/// Most bytes of saved state accepted for one vCPU (its state is about 8 KiB of registers
/// and tables, which JSON makes several times larger).
const MAX_STATE: usize = 1 << 20;

/// A move message from a peer that is not one, or state that cannot be taken.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MoveMsgError {
    #[error("empty move message")]
    Empty,
    #[error("move message without a vCPU")]
    NoVcpu,
    #[error("move message too short")]
    TooShort,
    #[error("malformed move message (kind {tag}, {len} bytes)")]
    Malformed { tag: u8, len: usize },
    #[error("state for vCPU {0}, which is not on its way here")]
    NotComing(u8),
    #[error("vCPU {0}'s state is longer than {MAX_STATE} bytes")]
    StateTooLong(u8),
}

/// What the nodes say to each other about a move, carried in `Envelope::Move`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum MoveMsg {
    /// I/O node to the vCPU's node: move `vcpu` to node `to`.
    Move { vcpu: u8, to: u16 },
    /// Old node to new node: `vcpu` is on its way; hold its interrupts until it runs.
    Coming { vcpu: u8 },
    /// Old node to new node: a piece of `vcpu`'s saved state; `last` ends it.
    State {
        vcpu: u8,
        last: bool,
        bytes: Vec<u8>,
    },
    /// New node to every node: `vcpu` runs on `node` from now on.
    Moved { vcpu: u8, node: u16 },
    /// To the I/O node (and the new node, if it was told): the move did not happen, `vcpu`
    /// runs on `node` still.
    Failed { vcpu: u8, node: u16, why: String },
}

impl MoveMsg {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            MoveMsg::Move { vcpu, to } => {
                out.extend_from_slice(&[0, *vcpu]);
                out.extend_from_slice(&to.to_le_bytes());
            }
            MoveMsg::Coming { vcpu } => out.extend_from_slice(&[1, *vcpu]),
            MoveMsg::State { vcpu, last, bytes } => {
                out.extend_from_slice(&[2, *vcpu, u8::from(*last)]);
                out.extend_from_slice(bytes);
            }
            MoveMsg::Moved { vcpu, node } => {
                out.extend_from_slice(&[3, *vcpu]);
                out.extend_from_slice(&node.to_le_bytes());
            }
            MoveMsg::Failed { vcpu, node, why } => {
                out.extend_from_slice(&[4, *vcpu]);
                out.extend_from_slice(&node.to_le_bytes());
                let mut n = why.len().min(1024);
                while !why.is_char_boundary(n) {
                    n -= 1;
                }
                out.extend_from_slice(&why.as_bytes()[..n]);
            }
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<MoveMsg, MoveMsgError> {
        let node = |b: &[u8]| -> Result<u16, MoveMsgError> {
            b.get(2..4)
                .map(|n| u16::from_le_bytes([n[0], n[1]]))
                .ok_or(MoveMsgError::TooShort)
        };
        let (&tag, rest) = b.split_first().ok_or(MoveMsgError::Empty)?;
        let &vcpu = rest.first().ok_or(MoveMsgError::NoVcpu)?;
        Ok(match tag {
            0 if b.len() == 4 => MoveMsg::Move { vcpu, to: node(b)? },
            1 if b.len() == 2 => MoveMsg::Coming { vcpu },
            2 if b.len() >= 3 && b[2] <= 1 => MoveMsg::State {
                vcpu,
                last: b[2] == 1,
                bytes: b[3..].to_vec(),
            },
            3 if b.len() == 4 => MoveMsg::Moved {
                vcpu,
                node: node(b)?,
            },
            4 if b.len() >= 4 => MoveMsg::Failed {
                vcpu,
                node: node(b)?,
                why: String::from_utf8_lossy(&b[4..]).into_owned(),
            },
            _ => return Err(MoveMsgError::Malformed { tag, len: b.len() }),
        })
    }

    /// `state` cut into the `State` messages that carry it, in order.
    pub fn pieces(vcpu: u8, state: &[u8]) -> Vec<MoveMsg> {
        let chunks: Vec<&[u8]> = state.chunks(PIECE).collect();
        let n = chunks.len().max(1);
        (0..n)
            .map(|i| MoveMsg::State {
                vcpu,
                last: i + 1 == n,
                bytes: chunks.get(i).map(|c| c.to_vec()).unwrap_or_default(),
            })
            .collect()
    }
}

/// Which node runs each vCPU, as this node knows it, with the interrupts held for vCPUs on
/// their way here and the state pieces of those that are arriving.
pub(crate) struct Routes {
    me: u16,
    inner: Mutex<Table>,
}

struct Table {
    node_of: Vec<u16>,
    /// vCPUs coming here: their interrupts, held until they run.
    held: BTreeMap<u8, Vec<Msi>>,
    /// vCPUs coming here: their state so far.
    state: BTreeMap<u8, Vec<u8>>,
}

/// Where an interrupt for a vCPU goes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Injected here.
    Here,
    /// Held here until the vCPU, on its way, runs.
    Held,
    /// To be sent to this node.
    To(u16),
    /// The vCPU does not exist.
    Nowhere,
}

impl Routes {
    pub fn new(me: u16, node_of: Vec<u16>) -> Routes {
        Routes {
            me,
            inner: Mutex::new(Table {
                node_of,
                held: BTreeMap::new(),
                state: BTreeMap::new(),
            }),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn node_of(&self, vcpu: u8) -> Option<u16> {
        self.table().node_of.get(vcpu as usize).copied()
    }

    /// Every vCPU's node, by vCPU id.
    pub fn all(&self) -> Vec<u16> {
        self.table().node_of.clone()
    }

    pub fn set(&self, vcpu: u8, node: u16) {
        if let Some(n) = self.table().node_of.get_mut(vcpu as usize) {
            *n = node;
        }
    }

    /// Routes one interrupt for `m.vcpu`: a vCPU that runs here gets it through `inject`,
    /// called under the table's lock so that no move can take the vCPU away in between.
    pub fn route(&self, m: Msi, inject: impl FnOnce(&Msi)) -> Route {
        let mut t = self.table();
        let Some(&node) = t.node_of.get(m.vcpu as usize) else {
            return Route::Nowhere;
        };
        if node != self.me {
            return Route::To(node);
        }
        if let Some(held) = t.held.get_mut(&m.vcpu) {
            held.push(m);
            return Route::Held;
        }
        inject(&m);
        Route::Here
    }

    /// `vcpu` is on its way here: it runs here from now on as far as interrupts go, and
    /// they are held until [`Routes::arrived`].
    pub fn coming(&self, vcpu: u8) {
        let mut t = self.table();
        if let Some(n) = t.node_of.get_mut(vcpu as usize) {
            *n = self.me;
            t.held.entry(vcpu).or_default();
            t.state.insert(vcpu, Vec::new());
        }
    }

    /// Adds a piece of `vcpu`'s state; the whole state once `last` comes. A piece for a vCPU
    /// not announced, or too much state, is refused.
    pub fn piece(
        &self,
        vcpu: u8,
        bytes: &[u8],
        last: bool,
    ) -> Result<Option<Vec<u8>>, MoveMsgError> {
        let mut t = self.table();
        let Some(s) = t.state.get_mut(&vcpu) else {
            return Err(MoveMsgError::NotComing(vcpu));
        };
        if s.len() + bytes.len() > MAX_STATE {
            t.state.remove(&vcpu);
            return Err(MoveMsgError::StateTooLong(vcpu));
        }
        s.extend_from_slice(bytes);
        Ok(if last { t.state.remove(&vcpu) } else { None })
    }

    /// `vcpu` runs here now: the interrupts held for it, to inject.
    pub fn arrived(&self, vcpu: u8) -> Vec<Msi> {
        self.table().held.remove(&vcpu).unwrap_or_default()
    }

    /// `vcpu` is not coming after all and runs on `node`: the interrupts held for it, to
    /// send there.
    pub fn abandon(&self, vcpu: u8, node: u16) -> Vec<Msi> {
        let mut t = self.table();
        t.state.remove(&vcpu);
        if let Some(n) = t.node_of.get_mut(vcpu as usize) {
            *n = node;
        }
        t.held.remove(&vcpu).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msi(vcpu: u8) -> Msi {
        Msi {
            vcpu,
            address: 0xfee0_0000 | (vcpu as u32) << 12,
            data: 0x4041,
        }
    }

    #[test]
    fn every_message_comes_back_as_it_was_sent_and_state_is_cut_to_fit_frames() {
        let state: Vec<u8> = (0..40_000).map(|i| i as u8).collect();
        let mut all = vec![
            MoveMsg::Move { vcpu: 3, to: 2 },
            MoveMsg::Coming { vcpu: 3 },
            MoveMsg::Moved { vcpu: 3, node: 1 },
            MoveMsg::Failed {
                vcpu: 1,
                node: 0,
                why: "vCPU 1 does not run here".into(),
            },
        ];
        all.extend(MoveMsg::pieces(3, &state));
        for m in &all {
            let b = m.encode();
            assert!(
                b.len() <= dsm_host::MAX_MIGRATION_BYTES,
                "{} bytes",
                b.len()
            );
            assert_eq!(&MoveMsg::decode(&b).unwrap(), m);
        }
        let joined: Vec<u8> = all
            .iter()
            .filter_map(|m| match m {
                MoveMsg::State { bytes, .. } => Some(bytes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(joined, state);
        assert!(MoveMsg::decode(&[]).is_err());
        assert!(MoveMsg::decode(&[0, 1]).is_err(), "a move without its node");
        assert!(MoveMsg::decode(&[9, 1, 0, 0]).is_err());
        assert!(MoveMsg::decode(&[2, 1, 7]).is_err(), "last is 0 or 1");
    }

    #[test]
    fn interrupts_follow_a_vcpu_and_wait_for_it_while_it_is_on_its_way() {
        // Node 1 of a VM whose vCPUs 0, 1, 2 run on nodes 0, 1, 2.
        let r = Routes::new(1, vec![0, 1, 2]);
        let mut injected = Vec::new();
        assert_eq!(r.route(msi(1), |m| injected.push(*m)), Route::Here);
        assert_eq!(r.route(msi(2), |_| panic!("not here")), Route::To(2));
        assert_eq!(r.route(msi(9), |_| panic!("no such vCPU")), Route::Nowhere);
        // vCPU 2 comes here: its interrupts wait, its state arrives in pieces.
        r.coming(2);
        assert_eq!(r.route(msi(2), |_| panic!("held")), Route::Held);
        assert_eq!(r.piece(2, b"ab", false), Ok(None));
        assert_eq!(r.piece(2, b"cd", true), Ok(Some(b"abcd".to_vec())));
        assert!(r.piece(0, b"x", true).is_err(), "vCPU 0 is not coming");
        assert_eq!(r.arrived(2), vec![msi(2)]);
        assert_eq!(r.route(msi(2), |m| injected.push(*m)), Route::Here);
        assert_eq!(injected, vec![msi(1), msi(2)]);
        // vCPU 1 leaves for node 0: its interrupts go there.
        r.set(1, 0);
        assert_eq!(r.route(msi(1), |_| panic!("gone")), Route::To(0));
        // A move that fails hands back what was held.
        r.coming(0);
        assert_eq!(r.route(msi(0), |_| panic!("held")), Route::Held);
        assert_eq!(r.abandon(0, 0), vec![msi(0)]);
        assert_eq!(r.node_of(0), Some(0));
        assert_eq!(r.all(), vec![0, 0, 1]);
    }
}
