//! Host partitions: the host cut into disjoint shares of CPUs, memory and disks, each a real
//! cgroup with its own supervisor process that runs that partition's VMs (the Mint design of
//! report 003: independent hypervisors on one host, so that one hypervisor's crash or load
//! stays inside its partition).
//!
//! - [`resources`]: CPU lists, sizes, what the host has.
//! - [`cgroup`]: the cgroup v1 and v2 back-ends.
//! - [`store`]: partition records in the state directory.
//! - [`proto`]: the supervisor's JSON-lines socket protocol.
//! - [`supervisor`]: the per-partition supervisor process.
//! - [`manager`]: the operations the CLI offers (create, list, run, pause, resume, snapshot,
//!   stop, destroy).

pub mod cgroup;
pub mod manager;
pub mod proto;
pub mod resources;
pub mod store;
pub mod supervisor;

use std::fmt;

/// Whether a failure is the request's fault (the person can change the request) or the
/// host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request conflicts with the rules or with other partitions.
    Refused,
    /// No such partition or VM.
    NotFound,
    /// The host failed: cgroupfs, the state directory, a process.
    System,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn refused(message: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::Refused,
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::NotFound,
            message: message.into(),
        }
    }

    pub fn system(message: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::System,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}
