//! The Musubi VMM: builds a KVM virtual machine from a [`config::VmConfig`] and runs it.
//!
//! The surface is small on purpose: a configuration ([`config`], with the memory-storage
//! specs of [`pmem`]), [`Vm::build`] → [`Vm::start`] → [`RunningVm::wait`], and what a run
//! reports. Everything else is the VMM's own business.
//!
//! A VM that is not made in one piece on this host (a node of a VM over several hosts, in
//! the `musubi-cluster` crate) is built with [`VmBuilder`] and routes its device accesses
//! through its own [`DeviceBus`].

mod arch;
mod boot_data;
mod builder;
pub mod config;
mod control;
mod device_manager;
mod exit;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod idle;
mod io_thread;
mod irq;
mod loader;
mod metrics;
mod net;
pub mod pmem;
mod running;
pub mod seccomp;
pub mod snapshot;
#[cfg(feature = "testing")]
pub mod testing;
mod vstate;

pub use arch::x86_64::cpuid::Topology;
pub use arch::x86_64::layout::ram_ranges;
pub use builder::{
    BuildError, ExternalRam, ExtraMetrics, GuestRamSource, MsiInjector, RunOptions, Vm, VmBuilder,
};
pub use control::{Outcome, RunControl, NODE_LOST_STATUS};
pub use exit::DeviceBus;
pub use metrics::MmioTarget;
pub use running::{
    monotonic_ns, run_vm, ControlError, RunReport, RunningVm, SnapshotReport, VmHandle,
};
pub use vstate::vcpu_state::VcpuState;
