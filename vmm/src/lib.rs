//! The Musubi VMM: builds a KVM virtual machine from a [`config::VmConfig`] and runs it.

pub mod arch;
