//! The Musubi VMM: builds a KVM virtual machine from a [`config::VmConfig`] and runs it.
//!
//! The surface is small on purpose: a configuration ([`config`], with the memory-storage
//! specs of [`pmem`]), [`Vmm::build`] → [`Vm::start`] → [`RunningVm::wait`], and what a run
//! reports. Everything else is the VMM's own business.

mod arch;
mod builder;
pub mod config;
mod control;
mod device_manager;
mod exit;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod io_thread;
mod irq;
mod loader;
mod metrics;
pub mod node;
pub mod pmem;
pub mod seccomp;
#[cfg(feature = "testing")]
pub mod testing;
mod vstate;

pub use builder::{
    monotonic_ns, run_vm, BuildError, RunOptions, RunReport, RunningVm, Vm, VmHandle, Vmm,
};
pub use control::{Outcome, NODE_LOST_STATUS};
pub use vstate::host::HostPrep;
