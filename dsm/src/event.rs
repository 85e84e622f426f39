//! What goes into a node and what comes out: the whole interface between the protocol and a
//! host (userfaultfd + TCP in production, the simulator in tests).

use crate::types::{Access, NodeId, PageData, PageNo, VcpuId};
use crate::wire::Message;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A local vCPU touched `page` without the needed access and is stopped until `Resume`.
    Fault {
        vcpu: VcpuId,
        page: PageNo,
        access: Access,
    },
    /// A message from another node, already decoded.
    Message { from: NodeId, msg: Message },
    /// The host has captured the bytes asked for by `SendPage` (and sent them); the page may
    /// now change again.
    PageSent { page: PageNo },
    /// The host has placed the bytes of `PageOp::Install` in local memory with the given
    /// protection.
    PageInstalled { page: PageNo },
    /// The time asked for by `Action::HoldUntil` has come (see [`crate::Config::hold`]).
    HoldOver { page: PageNo },
}

/// A change to the local copy of a page. Applied in the order emitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageOp {
    /// No access, and the contents are not needed any more (`MADV_DONTNEED`).
    Drop,
    /// No access, but keep the contents: this node holds the only current copy and will serve
    /// or re-expose it later. Arises when a late invalidation reaches the current owner.
    Hide,
    /// Reads only; the contents stay (write-protect).
    ReadOnly,
    /// Reads and writes on the contents already there.
    Writable,
    /// Replace the contents and grant access. Report `PageInstalled` when done.
    Install { data: PageData, writable: bool },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a message to another node (never to the sending node itself: the protocol
    /// handles those locally, as the paper does).
    Send { to: NodeId, msg: Message },
    /// Read the local page and send it as `Message::PageData { page, access, data }` to `to`;
    /// report `PageSent` once the bytes are captured. Local writes are already blocked.
    SendPage {
        to: NodeId,
        page: PageNo,
        access: Access,
    },
    /// Change the local copy.
    Page { page: PageNo, op: PageOp },
    /// Let the vCPU stopped by a `Fault` on `page` run again.
    Resume { vcpu: VcpuId, page: PageNo },
    /// A request to take `page` away waits here until time `until` (the node's clock, see
    /// [`crate::Node::advance`]); report `HoldOver` then.
    HoldUntil { page: PageNo, until: u64 },
}
