//! The Musubi VMM: builds a KVM virtual machine from a [`config::VmConfig`] and runs it.
//!
//! The surface is small on purpose: a configuration ([`config`], with the memory-storage
//! specs of [`pmem`]), [`Vm::build`] → [`Vm::start`] → [`RunningVm::wait`], and what a run
//! reports. Everything else is the VMM's own business.
//!
//! A VM that is not made in one piece on this host (a node of a VM over several hosts, in
//! the `musubi-cluster` crate) is built with [`VmBuilder`] and routes its device accesses
//! through its own [`DeviceBus`].
//!
//! Words kept to one meaning each, since a VM has four things that could be called its
//! "exit": an **exit** is a VM exit, KVM_RUN returning to the VMM (`exit.rs`, the exit
//! accounting, `--exits kernel|user` for which part handles them); the VM **ends** with an
//! [`Outcome`], some of them asked for by a device (`devices::EndRequest`); the guest's
//! **status** is what it writes to the exit port ([`Outcome::GuestStatus`]); and the
//! process's **exit code** is what [`Outcome::exit_code`] turns an outcome into.

mod arch;
mod boot_data;
mod clock;
pub mod config;
mod control;
mod device_manager;
mod exit;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod handle;
mod host_load;
mod idle;
mod io_thread;
mod irq;
mod loader;
mod metrics;
mod net;
pub mod persist;
pub mod pmem;
mod running;
pub mod seccomp;
pub mod snapshot;
#[cfg(feature = "testing")]
pub mod testing;
mod vm;
mod vstate;

pub use arch::x86_64::cpuid::Topology;
pub use arch::x86_64::layout::ram_ranges;
pub use clock::monotonic_ns;
pub use control::{Outcome, RunControl, NODE_LOST_STATUS};
pub use devices::virtio::{FileSum, SealedWrites, DEFAULT_JOURNAL_BOUND};
pub use exit::DeviceBus;
pub use handle::{
    ControlError, DirtyLogError, JournalError, PmemLogError, RamReadError, SnapshotReport,
    StorageError, VmHandle,
};
pub use io_thread::IoThreadCount;
pub use io_thread::DEFAULT_POLL as DEFAULT_IO_POLL;
pub use metrics::MmioTarget;
pub use persist::VcpuState;
pub use running::{run_vm, RunReport, RunningVm};
pub use vm::{
    BuildError, ExternalRam, ExtraMetrics, GuestRamSource, MsiInjector, RunOptions, Vm, VmBuilder,
};
