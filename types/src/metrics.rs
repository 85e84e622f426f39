//! `musubi run --metrics` (and SIGUSR1's rewrite of it): the exit accounting per vCPU and
//! per port or device register, doorbells, interrupt paths, network counters, and the
//! sections a VM's memory back-end adds (demand paging, migration, a node's coherence).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One VM's (or one node's) metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// `kernel` or `user`: which path vCPU exits and doorbells take.
    pub exits_mode: String,
    pub total_exits: u64,
    /// Every vCPU's exits by reason and detail, largest count first.
    pub exits: Vec<ExitDetail>,
    pub vcpus: Vec<VcpuExits>,
    pub notifications: Notifications,
    pub interrupts: Interrupts,
    /// One entry per network device.
    pub net: Vec<NetCounters>,
    /// The entropy device (`--rng`), when the VM has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng: Option<RngCounters>,
    /// The I/O threads' waiting, when the VM has any (a doorbell or a TAP to serve).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_thread: Option<IoThreadCounters>,
    /// Each I/O thread's own, when there are several (`run --io-threads`); `io_thread`
    /// adds them up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub io_threads: Vec<IoThreadCounters>,
    pub memory: MemoryUse,
    /// Guest RAM restored on demand (`--restore-memory ondemand`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_paging: Option<DemandPaging>,
    /// Guest RAM still arriving from a migration's source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationPaging>,
    /// This node of a multi-node VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeMetrics>,
    /// A primary's replication to its standby (`run --replicate-to`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationMetrics>,
}

impl Metrics {
    /// The exits of `reason` (`io_out`, `mmio_write`, ...) whose detail is `detail` (a port
    /// such as `0x3f8`, or `virtio-blk0:queue_notify`).
    pub fn exit(&self, reason: &str, detail: &str) -> Option<&ExitDetail> {
        self.exits
            .iter()
            .find(|e| e.reason == reason && e.detail.as_deref() == Some(detail))
    }
}

/// The metrics of a VM over several nodes: each node's, node 0 first; `None` for a node
/// that wrote none.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterMetrics {
    pub nodes: Vec<Option<Metrics>>,
}

/// One line of the exit accounting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitDetail {
    pub reason: String,
    /// The port (`0x3f8`) or device register (`virtio-blk0:queue_notify`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub count: u64,
    pub vmm_ns: u64,
    pub mean_vmm_ns: u64,
    /// Non-empty log2 buckets as (upper bound in ns, count).
    pub histogram_ns: Vec<(u64, u64)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuExits {
    pub id: u8,
    pub exits: Vec<ExitDetail>,
}

/// Interrupts raised, by the path they took; a path no device took is left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interrupts {
    /// Through an irqfd, by KVM (the kernel exit path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub irqfd: Option<u64>,
    /// Injected by the VMM itself (the user exit path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<u64>,
    /// Paths this crate does not know by name.
    #[serde(flatten)]
    pub other: BTreeMap<String, u64>,
}

impl Interrupts {
    /// Counts `n` more interrupts on `path`.
    pub fn add(&mut self, path: &str, n: u64) {
        let slot = match path {
            "irqfd" => self.irqfd.get_or_insert(0),
            "user" => self.user.get_or_insert(0),
            _ => self.other.entry(path.to_string()).or_insert(0),
        };
        *slot += n;
    }
}

/// Queue notifications (doorbells), by how they reached the VMM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notifications {
    /// Trapped writes to a queue-notify register.
    pub mmio_exit: u64,
    /// Served by the I/O thread through an ioeventfd, without an exit.
    pub ioeventfd: u64,
}

/// A network device's counters, in `--metrics` and `vm.counters` alike. Plain numbers so
/// the device can copy them out under a lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetCounters {
    /// Frames put in guest receive buffers.
    pub rx_packets: u64,
    /// Their bytes, virtio-net header excluded.
    pub rx_bytes: u64,
    /// Frames from the backend that never reached the guest (too short, or no usable
    /// buffers for them), plus malformed receive chains returned unused.
    pub rx_drops: u64,
    /// Receive queue doorbells.
    pub rx_notifications: u64,
    /// Times the receive rate limiter held a frame back.
    pub rx_throttled: u64,
    /// Frames the guest sent that the backend took.
    pub tx_packets: u64,
    /// Their bytes, virtio-net header excluded.
    pub tx_bytes: u64,
    /// Transmit chains dropped as malformed or refused by the backend.
    pub tx_drops: u64,
    /// Passes over the transmit queues: one per doorbell, and one per poll of the I/O
    /// thread's that found frames there (`io_thread.ring_hits`) or served them as it ended.
    pub tx_notifications: u64,
    /// Times the transmit rate limiter held a frame back.
    pub tx_throttled: u64,
    /// Interrupts the device's transport raised, for either queue or the configuration.
    pub interrupts: u64,
    /// Frames the guest sent that a replicated VM held until their epoch was safe on the
    /// standby (they count in `tx_packets` once released and written).
    #[serde(default)]
    pub tx_held: u64,
    /// Their bytes, virtio-net header excluded.
    #[serde(default)]
    pub tx_held_bytes: u64,
    /// Held frames released and written to the backend.
    #[serde(default)]
    pub tx_released: u64,
    /// Times the held frames filled their bound and the guest had to wait to send.
    #[serde(default)]
    pub tx_held_full: u64,
    /// Gratuitous ARPs sent for the guest where its VM resumed (a failover, a migration).
    #[serde(default)]
    pub announcements: u64,
    /// Frames from the network the guest's receive filter turned away (promiscuous mode
    /// off, the destination neither the guest's nor in its tables).
    #[serde(default)]
    pub rx_filtered: u64,
    /// Commands on the control queue, refused ones included.
    #[serde(default)]
    pub ctrl_commands: u64,
    /// Of those, the ones answered VIRTIO_NET_ERR or dropped without an ack: unknown,
    /// not negotiated, malformed.
    #[serde(default)]
    pub ctrl_errors: u64,
}

/// The entropy device's counters, in `--metrics` and `vm.counters` alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngCounters {
    /// Chains completed, whatever their length (malformed ones with 0 bytes).
    pub requests: u64,
    /// Random bytes put in guest buffers.
    pub bytes: u64,
    /// Times the rate limiter (`bytes_per_sec=`) held a request back until its bucket
    /// refilled.
    pub throttled: u64,
    /// Chains completed with no bytes because they were malformed: a device-readable
    /// buffer, one outside guest memory, a broken or over-long chain.
    pub errors: u64,
    /// Interrupts the device's transport raised.
    pub interrupts: u64,
}

/// How the I/O thread waited for work, so that what `run --io-poll` saves (wake-ups) is
/// read beside what it costs (CPU while nothing came).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoThreadCounters {
    /// `--io-poll` in microseconds: the longest it polls after an event before it sleeps.
    pub poll_us: u64,
    /// Sleeps in `epoll_wait` that an event ended: each a wake-up by the host's scheduler.
    pub wakeups: u64,
    /// Events a poll window found without sleeping.
    pub poll_hits: u64,
    /// Poll windows that ran out with nothing, after which the thread slept.
    pub poll_misses: u64,
    /// Of the hits, those that found chains on a transmit queue polled with its doorbell
    /// off: each saved the guest a doorbell, a VM exit.
    #[serde(default)]
    pub ring_hits: u64,
    /// Of the misses, windows ended early because more tasks were runnable than the host
    /// has CPUs: one waited for a CPU while the thread polled (`run --io-poll-hold` keeps
    /// polling instead).
    #[serde(default)]
    pub poll_yields: u64,
    /// Time spent polling, in windows that found an event or not.
    pub poll_ns: u64,
    /// The thread's CPU time (user and system) up to its last sleep.
    pub cpu_ns: u64,
}

/// What keeps guest RAM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryUse {
    /// `anonymous`, `coherent`, `snapshot`, `ondemand`, ...
    pub backend: String,
    /// Each vCPU's thread id, once it has run.
    pub vcpu_threads: Vec<Option<i32>>,
}

/// The fault-serving thread of RAM restored on demand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemandPaging {
    pub faults: u64,
    /// Pages read from the memory file.
    pub pages_read: u64,
    /// Pages installed as zeros (holes of the file).
    pub zero_pages: u64,
}

/// Where a primary's replication stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationState {
    /// Connecting, or the standby is building the VM.
    #[default]
    Connecting,
    /// Sending whole RAM as the first epoch.
    Seeding,
    /// Checkpointing every epoch: the standby can take over.
    Protected,
    /// The standby was lost, or never came: the VM runs alone.
    Lost,
    /// The standby was lost and the policy is [`ReplicationPolicy::Stop`]: the VM is paused
    /// and waits for its operator (`vm.resume` runs it on alone).
    Stopped,
    /// The VM ended and the standby was told.
    Ended,
}

/// What a primary does when it loses its standby.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplicationPolicy {
    /// Goes on alone, unprotected, and says so.
    #[default]
    GoOn,
    /// Pauses the VM and waits for its operator, who may resume it alone.
    Stop,
}

impl std::str::FromStr for ReplicationPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<ReplicationPolicy, String> {
        match s {
            "go-on" => Ok(ReplicationPolicy::GoOn),
            "stop" => Ok(ReplicationPolicy::Stop),
            _ => Err(format!("{s}: expected go-on or stop")),
        }
    }
}

impl std::fmt::Display for ReplicationPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplicationPolicy::GoOn => "go-on",
            ReplicationPolicy::Stop => "stop",
        })
    }
}

/// A primary's epochs: how many, how big and how long the VM paused for each.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicationMetrics {
    /// The standby, as given (`tcp:HOST:PORT`).
    pub to: String,
    /// The epoch asked for; a link that falls behind makes epochs longer.
    pub epoch_ms: u64,
    /// What the VM does if the standby is lost.
    #[serde(default)]
    pub policy: ReplicationPolicy,
    pub state: ReplicationState,
    pub epochs_sent: u64,
    pub epochs_acked: u64,
    /// Pages and state, over every epoch (the first is the whole RAM with data).
    pub bytes_sent: u64,
    /// Over the most recent 1024 epochs.
    pub bytes_per_epoch_median: u64,
    pub bytes_per_epoch_max: u64,
    /// The vCPUs' pause for each checkpoint, in microseconds: median and 99th percentile
    /// of the most recent 1024 epochs, and the longest of all.
    pub pause_us_median: u64,
    /// Absent from the metrics of a Musubi older than it.
    #[serde(default)]
    pub pause_us_p99: u64,
    pub pause_us_max: u64,
    /// The epochs as they came (checkpoint to checkpoint), in milliseconds: median of the
    /// most recent 1024 and the longest. Longer than `epoch_ms` when the standby's
    /// acknowledgements come later than that: the guest writes faster than the link
    /// carries, and the epochs stretch instead of a copy growing. Absent from the metrics
    /// of a Musubi older than them.
    #[serde(default)]
    pub epoch_ms_median: u64,
    #[serde(default)]
    pub epoch_ms_max: u64,
    /// Why the standby was lost, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
}

/// The pages of a VM received by migration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationPaging {
    pub faults: u64,
    pub asked: u64,
    pub installed: u64,
    pub precopied: u64,
    /// How many pages the source listed as holding data; `null` before it has.
    pub data_pages: Option<u64>,
    /// Every listed page is here: the source is no longer needed.
    pub all_held: bool,
}

/// A node of a multi-node VM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeMetrics {
    pub id: u16,
    pub nodes: u16,
    pub protocol: String,
    pub ordering: String,
    pub forwarded_exits: u64,
    pub ipis_local: u64,
    pub ipis_remote: u64,
    /// `null` once the coherence layer is gone.
    pub coherence: Option<Coherence>,
}

/// Everything one node's coherence thread counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Coherence {
    pub node: u16,
    pub faults: FaultStats,
    /// Protocol messages sent, by name (`fetch`, `inv`, `page`, ...).
    pub sent: BTreeMap<String, u64>,
    pub received: BTreeMap<String, u64>,
    /// Control messages (exits, interrupts, stop, heartbeat) received and handed on.
    pub control_received: u64,
    /// Messages the node refused (a misbehaving peer); the node stayed as it was.
    pub protocol_errors: u64,
    pub last_protocol_error: Option<String>,
    /// Pages whose bytes were installed from a peer.
    pub installs: u64,
    /// Faults reported for waiting more than a few seconds: each is a protocol bug, told on
    /// stderr with the node's view of the page.
    pub overdue_faults: u64,
    pub polling: PollStats,
}

impl Coherence {
    /// Messages sent under any of `names`.
    pub fn sent_of(&self, names: &[&str]) -> u64 {
        names.iter().filter_map(|n| self.sent.get(*n)).sum()
    }

    pub fn total_sent(&self) -> u64 {
        self.sent.values().sum()
    }

    pub fn total_received(&self) -> u64 {
        self.received.values().sum()
    }
}

/// The guest's page faults on one node. Latency runs from reading the fault to waking the
/// thread.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultStats {
    pub count: u64,
    pub missing: u64,
    pub write_protect: u64,
    pub reads: u64,
    pub writes: u64,
    /// Faults whose thread has been woken.
    pub resolved: u64,
    /// `latency_log2_ns[i]` counts resolutions that took `2^i ..= 2^(i+1)-1` ns.
    pub latency_log2_ns: Vec<u64>,
    /// Size of a guest-physical range in `by_range` (a power of two).
    pub range_bytes: u64,
    /// Faults by guest-physical range, keyed by the range's first address.
    pub by_range: BTreeMap<u64, u64>,
    /// The pages with the most faults, most first.
    pub hot_pages: Vec<HotPage>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotPage {
    /// Guest-physical address of the page.
    pub gpa: u64,
    pub faults: u64,
    pub reads: u64,
    pub writes: u64,
    /// What the kernel keeps in the page, where its symbols say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbol: Option<String>,
}

/// The coherence thread's waits while a fault of its node was outstanding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollStats {
    /// Something came while the thread polled.
    pub answered: u64,
    /// Nothing came within the window: the thread slept.
    pub slept: u64,
    /// Time spent in those waits before something came or the thread went to sleep.
    pub polled_ns: u64,
}

display_json!(
    Metrics,
    ClusterMetrics,
    MigrationPaging,
    DemandPaging,
    NodeMetrics,
    Coherence,
    FaultStats,
    PollStats,
    NetCounters,
    RngCounters
);
