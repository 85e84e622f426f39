//! Host back-end for one VM spread over several hosts: guest RAM under userfaultfd, kept
//! coherent by the `dsm` protocols, with peers reached over authenticated TCP.
//!
//! The protocol stays pure in `dsm`; this crate is the host side of its interface. Each node
//! runs one coherence thread ([`coherence`]) that waits on the userfaultfd of its memory
//! ([`memory`]) and on the messages its peers send ([`transport`], [`link`]), feeds them to
//! its `dsm::Node`, and carries out the node's actions ([`backend`]). A link can hold its frames
//! back for a fixed time ([`delay`]) to emulate a slower network. Nothing here uses KVM, so
//! it runs and is tested on plain anonymous memory; the VMM puts guest RAM on a [`Memory`].

pub mod backend;
pub mod coherence;
pub mod delay;
pub mod demand;
pub mod door;
pub mod envelope;
pub mod failure;
pub mod link;
pub mod memory;
pub mod poll_window;
pub mod stats;
pub mod transport;
mod uffd;

pub use backend::Backend;
pub use coherence::{CoherenceError, CoherenceHandle, NodeEvent, Setup, DEFAULT_PAGE_HOLD};
pub use delay::{DelayFailed, DelayLine, MAX_LINK_DELAY};
pub use door::{DoorLimits, Refusal, Refusals};
pub use envelope::{Envelope, EnvelopeError, Exit, Interrupt, IoSpace, MAX_MIGRATION_BYTES};
pub use link::{
    config_hash, config_hash_of_parts, Link, LinkError, LinkParams, LinkReader, Role,
    HANDSHAKE_READ,
};
pub use memory::{Fault, FaultKind, Memory, MemoryError};
pub use poll_window::DEFAULT_POLL_WINDOW;
pub use stats::{hottest, NodeStats, PageFaults, HOT_PAGES};
pub use transport::{
    Inbound, Inbox, InboxSender, Liveness, PeerReader, TcpConfig, TcpTransport, Transport,
    TransportError, DEFAULT_HEARTBEAT, DEFAULT_LOSS_TIMEOUT,
};
