//! One node of a VM spread over several hosts: its share of the vCPUs, on guest RAM the
//! coherence layer (`dsm-host`) keeps consistent with the other nodes, with device accesses
//! forwarded to the node that holds the devices and IPIs carried to the node of their target.
//!
//! Every node builds the same guest-physical layout from the same configuration; only the
//! I/O node loads the guest and creates devices, and the other nodes' vCPUs wait for the
//! start-up IPIs its BSP sends them.
//!
//! Built on the `vmm` crate's public [`vmm::VmBuilder`]: a node builds its share of the
//! vCPUs on guest RAM that `dsm-host` maps, and routes the vCPUs' port and MMIO accesses
//! through its own [`vmm::DeviceBus`].
//!
//! The nodes find each other through a cluster file ([`ClusterFile`]); [`Launch`] runs a
//! whole VM as node processes on one host, from a cluster file it writes.

mod bus;
mod file;
mod ipi;
mod launch;
mod moving;
mod netns;
mod node;
pub mod spec;
mod symbols;

pub use dsm_host::{DEFAULT_PAGE_HOLD, DEFAULT_POLL_WINDOW, MAX_LINK_DELAY};
pub use file::{
    fresh_secret, parse_duration, parse_ordering, parse_protocol, rank_from_launcher,
    write_cluster, ClusterFile, DurationError, FileError, FileFault, NameError, RankError,
    SecretError, Timing, WriteError, RANK_VARIABLES,
};
pub use ipi::IPI_PORT;
pub use launch::{Launch, LaunchError, Launched, NodeFiles, SetupError, Unrunnable};
pub use netns::NetnsError;
pub use node::{MoveError, Mover, Node, NodeError, NodeOptions, NodeReport, RunningNode};
pub use spec::{ClusterError, ClusterSpec, NodeAddr};

/// Prints one line on stderr in a single write. The node processes of `run --nodes` share
/// their launcher's stderr, and `eprintln!` writes a line in pieces, so lines two nodes
/// printed at the same moment came out mixed mid-line ("musubi: node musubi: node 2: ...").
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say_line(format_args!($($arg)*))
    };
}

/// The function behind [`say!`].
pub fn say_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
