//! A running VM kept on a standby, so that it outlives the loss of its primary: Remus's
//! checkpoints (NSDI 2008; QEMU's COLO is the other reference) over the migration's link and
//! framing.
//!
//! The primary sends the VM's configuration; the standby builds the VM (not started) at
//! once. Then come epochs: the first carries every page that may hold data, read while the
//! VM runs, as a pre-copy's first round does; each epoch ends with a checkpoint: the vCPUs
//! pause, the pages written since the last one (KVM's dirty log and the VMM's own writes)
//! are copied and the vCPU and device state read, the VM resumes at once, and the copy goes
//! out while it runs on. The standby stores an epoch aside until its `Commit` has come,
//! then puts it into the VM's RAM and keeps its state as the one to start from, and
//! acknowledges it; a half-received epoch is dropped. When the link closes or the primary
//! is silent longer than the heartbeat, the standby starts the VM from the last whole epoch.
//!
//! Disks are replicated: the standby keeps its own copy of each, checked by length and
//! CRC-32 when replication starts, and each epoch carries the writes the virtio-blk devices
//! journaled during it, written on the copies and synced at the commit, before the
//! acknowledgement (see [`primary`] and [`standby`]).
//!
//! Memory-storage files (`--pmem`) are replicated the same way: the standby keeps its own
//! copy of each, checked by length and CRC-32 at the start. Their regions' KVM slots are not
//! guest RAM (outside the dirty log of pre-copy and the [`crate::protocol::RamLayout`]), so
//! the primary turns KVM's dirty log on for them while it replicates; each checkpoint copies
//! the pages written in them since the last, within the same copy bound as the RAM pages,
//! and the standby writes them into its files at the commit and syncs them before the
//! acknowledgement.
//!
//! Output commit: the frames the guest transmits are held by its network devices and go out
//! only once the checkpoint after them is acknowledged (`devices::net::output_gate`); when
//! replication ends they all go, and nothing more is held. Each epoch also carries its
//! frames to the standby, which keeps the last whole epoch's until the primary says
//! (`Released`) it wrote them; a standby that takes over first sends them itself, before
//! the VM runs. So a primary that dies between the acknowledgement and its writes loses
//! nothing; one that dies between its writes and queuing `Released` (microseconds) has
//! them sent twice.
//!
//! Not yet: a VM over several nodes, a second standby.
//!
//! - [`primary`]: the sending loop, over a [`crate::source::SourceVm`].
//! - [`standby`]: the receiving loop, over a [`crate::destination::Host`], and the RAM it
//!   fills.
//! - [`ReplicationStats`]: what the primary counts, for its metrics.

pub mod primary;
pub mod standby;

use std::sync::Mutex;
use std::time::Duration;

/// How often the primary checkpoints by default (Remus: 25 ms).
pub const DEFAULT_EPOCH: Duration = Duration::from_millis(20);
/// Longest silence of the primary the standby waits out by default.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(100);
/// Epochs whose pause and size the median is taken over (the most recent ones).
const SAMPLES: usize = 1024;

/// The last [`SAMPLES`] values of one measure, and the largest of all.
#[derive(Debug, Default)]
struct Samples {
    recent: std::collections::VecDeque<u64>,
    max: u64,
}

impl Samples {
    fn push(&mut self, v: u64) {
        if self.recent.len() == SAMPLES {
            self.recent.pop_front();
        }
        self.recent.push_back(v);
        self.max = self.max.max(v);
    }

    fn median(&self) -> u64 {
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    }

    /// The `pct` percentile of the recent values by nearest rank (the smallest with at
    /// least `pct` % of them at or below it), so a rare long pause the median hides shows;
    /// 0 before any.
    fn percentile(&self, pct: usize) -> u64 {
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        v.sort_unstable();
        let rank = (pct * v.len()).div_ceil(100).max(1);
        v.get(rank - 1).copied().unwrap_or(0)
    }
}

#[derive(Debug, Default)]
struct Counts {
    to: String,
    epoch_ms: u64,
    policy: musubi_types::ReplicationPolicy,
    state: musubi_types::ReplicationState,
    epochs_sent: u64,
    epochs_acked: u64,
    bytes_sent: u64,
    bytes: Samples,
    pause_us: Samples,
    /// Time between checkpoints, in milliseconds.
    interval_ms: Samples,
    lost: Option<String>,
}

/// What the primary's loop counts, read by the metrics while it runs.
#[derive(Debug, Default)]
pub struct ReplicationStats {
    counts: Mutex<Counts>,
}

impl ReplicationStats {
    pub fn new(to: &str, epoch: Duration) -> ReplicationStats {
        ReplicationStats {
            counts: Mutex::new(Counts {
                to: to.to_string(),
                epoch_ms: epoch.as_millis() as u64,
                ..Counts::default()
            }),
        }
    }

    /// What the VM does if the standby is lost, as the metrics show it.
    pub fn with_policy(self, policy: musubi_types::ReplicationPolicy) -> ReplicationStats {
        self.with(|c| c.policy = policy);
        self
    }

    /// What the VM does if the standby is lost.
    pub fn policy(&self) -> musubi_types::ReplicationPolicy {
        self.with(|c| c.policy)
    }

    /// Where the replication stands now.
    pub fn state(&self) -> musubi_types::ReplicationState {
        self.with(|c| c.state)
    }

    /// The standby was lost and the VM has been paused for it (`--replicate-policy stop`).
    pub fn stopped(&self) {
        self.set_state(musubi_types::ReplicationState::Stopped);
    }

    fn with<T>(&self, f: impl FnOnce(&mut Counts) -> T) -> T {
        f(&mut self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn set_state(&self, state: musubi_types::ReplicationState) {
        self.with(|c| c.state = state);
    }

    fn sent(&self, bytes: u64, pause: Duration) {
        self.with(|c| {
            c.epochs_sent += 1;
            c.bytes_sent += bytes;
            c.bytes.push(bytes);
            c.pause_us.push(pause.as_micros() as u64);
        });
    }

    /// The time from one checkpoint to the next: the epoch asked for, or longer when the
    /// last epoch's acknowledgement came later (a link slower than the guest's writes).
    fn interval(&self, d: Duration) {
        self.with(|c| c.interval_ms.push(d.as_millis() as u64));
    }

    fn acked(&self) {
        self.with(|c| c.epochs_acked += 1);
    }

    fn lost(&self, why: String) {
        self.with(|c| {
            c.state = musubi_types::ReplicationState::Lost;
            c.lost = Some(why);
        });
    }

    /// The run's `replication` metrics.
    pub fn to_metrics(&self) -> musubi_types::ReplicationMetrics {
        self.with(|c| musubi_types::ReplicationMetrics {
            to: c.to.clone(),
            epoch_ms: c.epoch_ms,
            policy: c.policy,
            state: c.state,
            epochs_sent: c.epochs_sent,
            epochs_acked: c.epochs_acked,
            bytes_sent: c.bytes_sent,
            bytes_per_epoch_median: c.bytes.median(),
            bytes_per_epoch_max: c.bytes.max,
            pause_us_median: c.pause_us.median(),
            pause_us_p99: c.pause_us.percentile(99),
            pause_us_max: c.pause_us.max,
            epoch_ms_median: c.interval_ms.median(),
            epoch_ms_max: c.interval_ms.max,
            lost: c.lost.clone(),
        })
    }
}

#[cfg(test)]
mod tests;
