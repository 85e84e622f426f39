//! Both ends of a migration over the `vmm` crate's VMs: the [`destination::Host`] that
//! builds an arriving VM and the [`source::SourceVm`] over a running one, so a program that
//! embeds Musubi only parses its arguments and calls [`receive`] or starts a [`Migrator`].
//!
//! [`destination::Host`]: crate::destination::Host
//! [`source::SourceVm`]: crate::source::SourceVm

mod destination;
mod source;

pub use destination::{receive, received_vm, NotReceived, Received, Receiving};
pub use source::{MigrateError, Migrator, SendRequest};
