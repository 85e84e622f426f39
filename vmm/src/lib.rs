//! The Musubi VMM: builds a KVM virtual machine from a [`config::VmConfig`] and runs it.

pub mod arch;
pub mod builder;
pub mod config;
pub mod control;
pub mod device_manager;
pub mod io_thread;
pub mod irq;
pub mod loader;
pub mod metrics;
pub mod pmem;
pub mod testing;
pub mod vstate;

pub use builder::{run_vm, RunOptions, RunReport};
pub use control::Outcome;
