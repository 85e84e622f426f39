//! `vm.counters` (`musubi remote counters`): device name to counter name to value, with
//! the vCPUs' exits as one more "device", as Cloud Hypervisor answers it.

use crate::metrics::{NetCounters, RngCounters};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub vcpus: VcpuCounters,
    /// Musubi's device names (`virtio-blk0`, `virtio-net0`, `virtio-pmem0`, `virtio-rng0`,
    /// ...); the API keys disks and network devices by their ids in the VmConfig (`_disk0`),
    /// as Cloud Hypervisor does.
    #[serde(flatten)]
    pub devices: BTreeMap<String, DeviceCounters>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuCounters {
    /// Every vCPU's exits, kicks included.
    pub exits: u64,
}

/// A device's counters: a network device's packets, a block or pmem device's requests, or
/// the entropy device's bytes. Untagged: each variant has fields the others lack, so a
/// reader tells them apart by shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceCounters {
    Net(NetCounters),
    Block(BlockCounters),
    Rng(RngCounters),
}

impl DeviceCounters {
    /// Interrupts the device raised, whatever it is.
    pub fn interrupts(&self) -> u64 {
        match self {
            DeviceCounters::Net(n) => n.interrupts,
            DeviceCounters::Block(b) => b.interrupts,
            DeviceCounters::Rng(r) => r.interrupts,
        }
    }
}

/// A block or pmem device's requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCounters {
    pub requests: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub errors: u64,
    pub interrupts: u64,
}

display_json!(Counters, DeviceCounters);
