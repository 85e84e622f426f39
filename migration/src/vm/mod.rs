//! Both ends of a migration, and of replication, over the `vmm` crate's VMs: the [`destination::Host`] that
//! builds an arriving VM and the [`source::SourceVm`] over a running one, so a program that
//! embeds Musubi only parses its arguments and calls [`receive`] or starts a [`Migrator`].
//!
//! [`destination::Host`]: crate::destination::Host
//! [`source::SourceVm`]: crate::source::SourceVm

mod destination;
mod replication;
mod source;

pub use destination::{receive, received_vm, NotReceived, Received, Receiving};
pub use replication::{
    stand_by, OnRequest, ReplicateError, ReplicateRequest, ReplicateTo, Replication,
    ReplicationSlot, Replicator, RequestError, StandbyEnd,
};
pub use source::{MigrateError, Migrator, SendRequest};

/// The key the source adds to the configuration it sends: (device, inode) of its vsock
/// listener's file, so a destination on the same host takes over that file's path and no
/// other socket it finds there.
const VSOCK_LISTENER: &str = "vsock_listener";
