//! Identifiers and small value types shared by the wire format, the state machines and the
//! simulator.

use std::fmt;

/// Coherence granule: one x86 page, the unit userfaultfd and `MADV_DONTNEED` work on.
pub const PAGE_SIZE: usize = 4096;

/// Copysets are 64-bit masks, so a VM spans at most this many nodes (the paper ran 8).
pub const MAX_NODES: usize = 64;

/// One host taking part in the VM (the paper's virtual processor `proc_i`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u16);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// Guest-physical page number (`gpa >> 12`).
pub type PageNo = u64;

/// A vCPU of the local node; the protocol only hands it back in `Resume`.
pub type VcpuId = u32;

/// The contents of one page as carried by a data message.
pub type PageData = Box<[u8; PAGE_SIZE]>;

/// A zero-filled page, allocated directly on the heap.
pub fn zero_page() -> PageData {
    vec![0u8; PAGE_SIZE]
        .into_boxed_slice()
        .try_into()
        .expect("length is PAGE_SIZE")
}

/// What a faulting access needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    Read,
    Write,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
        })
    }
}

/// Local protection of a page copy (the paper's `p.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Prot {
    #[default]
    None,
    ReadOnly,
    ReadWrite,
}

impl Prot {
    /// The negation of the paper's `violation(p, a)`.
    pub fn permits(self, a: Access) -> bool {
        matches!(
            (self, a),
            (Prot::ReadOnly, Access::Read) | (Prot::ReadWrite, _)
        )
    }

    pub fn granted_by(a: Access) -> Prot {
        match a {
            Access::Read => Prot::ReadOnly,
            Access::Write => Prot::ReadWrite,
        }
    }
}

/// A set of nodes (copysets, pending acknowledgements), ordered by id so that every walk over
/// it, and so every run of the simulator, is deterministic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct NodeSet(u64);

impl NodeSet {
    pub const EMPTY: NodeSet = NodeSet(0);

    pub fn single(n: NodeId) -> NodeSet {
        let mut s = NodeSet::EMPTY;
        s.insert(n);
        s
    }
    pub fn insert(&mut self, n: NodeId) {
        self.0 |= 1u64 << (n.0 as usize % MAX_NODES);
    }
    pub fn remove(&mut self, n: NodeId) {
        self.0 &= !(1u64 << (n.0 as usize % MAX_NODES));
    }
    pub fn contains(&self, n: NodeId) -> bool {
        (n.0 as usize) < MAX_NODES && self.0 & (1u64 << n.0) != 0
    }
    pub fn len(&self) -> usize {
        self.0.count_ones() as usize
    }
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }
    pub fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        let bits = self.0;
        (0..MAX_NODES as u16)
            .filter(move |i| bits & (1u64 << i) != 0)
            .map(NodeId)
    }
}
