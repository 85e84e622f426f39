//! Memory coherence for a virtual multiprocessor: one VM whose vCPUs run on several hosts,
//! with guest RAM kept coherent page by page (write-invalidate, one writer or many readers).
//!
//! The protocols are pure state machines ([`Node`]): events in ([`Event`]: a local fault, a
//! message, a host completion), actions out ([`Action`]: messages, page protection changes,
//! vCPU resumes). No threads, sockets, clocks or KVM, so the same code runs under the
//! deterministic simulator ([`sim`]) and under a real host backend.
//!
//! Two protocols: the asynchronous one of Kaneda, Oyama and Yonezawa (SWoPP 2005, Fig. 5) and
//! Ivy's synchronous invalidation (Li & Hudak 1989), which that paper compares against
//! ([`table3`]). The asynchronous protocol acknowledges write invalidations by default so
//! that an x86 guest sees TSO across nodes ([`Ordering::Tso`]); the paper's fire-and-forget
//! invalidations stay selectable ([`Ordering::Paper`], unsafe for x86 guests), and
//! [`sim::litmus`] shows the difference.

pub mod event;
pub mod fuzz;
pub mod node;
pub mod placement;
pub mod rng;
pub mod sim;
pub mod table3;
pub mod types;
pub mod wire;

pub use event::{Action, Event, PageOp};
pub use node::{Config, ConfigError, Node, Ordering, Protocol, ProtocolError};
pub use placement::{Fixed, Modulo, Placement};
pub use types::{Access, NodeId, NodeSet, PageData, PageNo, Prot, VcpuId, PAGE_SIZE};
pub use wire::{DecodeError, Message, WIRE_VERSION};
