//! virtio over MMIO: the transport and the devices behind it.
//!
//! The transport ([`MmioTransport`]) owns the register file, the queues and the interrupt
//! line; a device ([`VirtioDevice`]) only turns descriptor chains into work. Keeping the two
//! apart lets a device be driven by another thread later (an I/O thread calling
//! [`MmioTransport::process_queue`]) without touching the register emulation.

pub mod block;
pub mod journal;
pub mod mmio;
pub mod net;
pub mod pmem;
pub mod rng;
pub mod vsock;

pub use block::{Block, BlockConfig, BlockError, CacheMode};
pub use journal::{FileSum, SealedWrites, WriteJournal, DEFAULT_JOURNAL_BOUND};
pub use mmio::{MmioTransport, QueueLayoutError, RestoreError, TransportState};
pub use net::{Net, NetBackend, NetConfig, NetCounters, NetError};
pub use pmem::Pmem;
pub use rng::{Rng, RngCounters, RngError};
pub use vsock::{SocketFile, TakeOverError, Vsock, VsockError};

use crate::GuestMemoryMmap;
use std::io;
use std::num::Wrapping;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use virtio_queue::{DescriptorChain, Queue, QueueT};

/// Largest queue the transport offers. 256 keeps a full ring's bookkeeping small while being
/// what Linux asks for on virtio-blk anyway.
pub const QUEUE_MAX_SIZE: u16 = 256;

/// Counters the benchmarks read; plain numbers so they can be copied out under a lock and
/// compared between runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VirtioStats {
    /// Descriptor chains completed (returned to the used ring), whatever their status.
    pub requests: u64,
    /// Bytes copied from the backing store to the guest.
    pub bytes_read: u64,
    /// Bytes copied from the guest to the backing store.
    pub bytes_written: u64,
    /// Flush requests served.
    pub flushes: u64,
    /// Requests that completed with an error status or were dropped as malformed.
    pub errors: u64,
    /// Used-buffer and configuration-change interrupts raised by the transport.
    pub interrupts: u64,
}

/// Why a queue can no longer be trusted. The transport answers it by setting NEEDS_RESET,
/// since the driver is the only party that can rebuild the ring.
#[derive(Debug, thiserror::Error)]
pub enum QueueCorrupt {
    /// virtio-queue could not read or write the ring in guest memory.
    #[error("queue {queue}: {what}: {source}")]
    Ring {
        queue: u16,
        what: &'static str,
        source: virtio_queue::Error,
    },
    #[error(
        "queue {queue}: avail index {avail} is {pending} entries ahead of {next_avail} (size \
         {size})"
    )]
    AvailAhead {
        queue: u16,
        avail: u16,
        pending: u16,
        next_avail: u16,
        size: u16,
    },
    #[error("queue {queue}: available ring unreadable")]
    Unreadable { queue: u16 },
    #[error("queue {queue}: head descriptor {head} outside a ring of {size}")]
    HeadOutside { queue: u16, head: u16, size: u16 },
}

/// What a device keeps of its own across a snapshot or a move, by kind.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    Net(net::NetState),
}

/// A device as the transport sees it.
///
/// Everything guest-controlled arrives through `process_queue`, so that is the one place a
/// device has to be defensive; the transport has already checked that the queue is ready
/// and that its rings lie in guest memory.
pub trait VirtioDevice {
    /// Device type from the virtio spec (2 for block).
    fn device_type(&self) -> u32;

    /// Number of virtqueues the device uses.
    fn num_queues(&self) -> usize;

    /// Largest ring the driver may set up on each queue; a power of two.
    fn queue_max_size(&self) -> u16 {
        QUEUE_MAX_SIZE
    }

    /// Feature bits offered, including `VIRTIO_F_VERSION_1`.
    fn features(&self) -> u64;

    /// Copies device configuration space from `offset` into `data`; bytes past the end of
    /// the configuration read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Handles a driver write to configuration space. The default ignores it, which is right
    /// for devices whose configuration is read-only.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            offset,
            len = data.len(),
            "ignored write to read-only config space"
        );
    }

    /// Called when the driver sets DRIVER_OK, with the features it accepted.
    fn activate(&mut self, _acked_features: u64) {}

    /// Called when the driver resets the device (status 0).
    fn reset(&mut self) {}

    /// The VM was restored from a snapshot or moved to another host: state outside guest
    /// memory that could not follow it (a vsock device's host connections) is dropped and
    /// the driver told so. The default has nothing to drop.
    fn transport_reset(&mut self) {}

    /// Serves the chains the driver has made available on `queue` and returns how many were
    /// put on the used ring. An error means the ring itself is unusable.
    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt>;

    /// Whether the VMM may look for new chains on queue `index` itself, with the driver's
    /// doorbells off, while it has just served and expects more (a transmit queue a stream
    /// fills): each doorbell it saves is a VM exit. Fixed for the device's life.
    fn pollable(&self, _index: u16) -> bool {
        false
    }

    /// While `on`, a pass over queue `index` ends with the driver's doorbells left off, for
    /// whoever polls the queue finds its new chains; the transport turns them off and back
    /// on around the polling.
    fn set_polled(&mut self, _index: u16, _on: bool) {}

    /// Which of the VMM's I/O threads should serve queue `index`'s doorbell, as a number
    /// the VMM takes modulo the threads it has: queues whose work is unrelated (a net
    /// device's queue pairs) then wait, wake and poll on threads of their own. Fixed for the
    /// device's life.
    fn queue_lane(&self, _index: u16) -> usize {
        0
    }

    /// As [`VirtioDevice::queue_lane`], for event source `index` of `event_fds`.
    fn event_lane(&self, _index: usize) -> usize {
        0
    }

    /// Makes everything the guest has written durable.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Device-side counters; the transport adds the interrupt count.
    fn stats(&self) -> VirtioStats {
        VirtioStats::default()
    }

    /// The device's own state for a snapshot, beyond what the transport saves. Called with
    /// the transport locked and no queue being served (the VM paused), which makes it the
    /// point a replicated VM's output epoch ends at (see [`crate::net::output_gate`]).
    /// `None` for devices that keep nothing of their own.
    fn save_state(&self) -> Option<DeviceState> {
        None
    }

    /// Puts back what [`VirtioDevice::save_state`] returned, before the device is
    /// activated again. State of another kind of device is ignored.
    fn restore_state(&mut self, _state: &DeviceState) {}

    /// The gate that holds the device's output while the VM is replicated; only a network
    /// device has one.
    fn output_gate(&self) -> Option<std::sync::Arc<crate::net::OutputGate>> {
        None
    }

    /// Writes the output its gate released now, on the caller's thread, rather than when
    /// the device's own event comes round. Returns whether released output is left (the
    /// backend was full), for the device's own event to write.
    fn flush_output(&mut self) -> bool {
        false
    }

    /// Copies of the output held for the epochs the replicator's last checkpoint sealed
    /// (see [`crate::net::OutputGate::in_last_capture`]), oldest first: a primary ships
    /// them with the checkpoint. Each frame is as the backend takes it (header included).
    fn captured_output(&self) -> Vec<Vec<u8>> {
        Vec::new()
    }

    /// Writes `frames` (as [`VirtioDevice::captured_output`] gave them) to the backend,
    /// ahead of anything the guest sends from now on; a standby taking over sends so the
    /// frames its primary may have died holding. Returns how many were taken.
    fn send_frames(&mut self, frames: Vec<Vec<u8>>) -> usize {
        let _ = frames;
        0
    }

    /// Per-direction counters of a network device; `None` for every other kind.
    fn net_counters(&self) -> Option<NetCounters> {
        None
    }

    /// Counters of the entropy device; `None` for every other kind.
    fn rng_counters(&self) -> Option<RngCounters> {
        None
    }

    /// Descriptors besides the queue doorbells that the owner must watch for readability
    /// (a backend with data, a timer), for devices whose work does not all start with the
    /// guest. `process_event(i)` is called when the `i`-th becomes readable. The list is
    /// fixed for the device's life.
    fn event_fds(&self) -> Vec<RawFd> {
        Vec::new()
    }

    /// Handles event source `index` (of `event_fds`) with all the device's queues, and
    /// returns the queues it put used entries on, so the transport can interrupt for them.
    /// Like `process_queue`, an error means a ring is unusable.
    fn process_event(
        &mut self,
        index: usize,
        _queues: &mut [Queue],
        _mem: &GuestMemoryMmap,
    ) -> Result<Vec<u16>, QueueCorrupt> {
        tracing::debug!(index, "event for a device without event sources");
        Ok(Vec::new())
    }
}

/// The guest driver of the device tests, shared with the fuzzing entry points.
#[cfg(any(test, feature = "fuzzing"))]
#[cfg_attr(not(test), allow(dead_code))] // the fuzzing entry points use only part of it
pub(crate) mod driver;
#[cfg(test)]
mod net_tests;
#[cfg(test)]
mod tests;

/// Serves the chains the driver had made available when the pass started, passing each to
/// `handle` (which returns the bytes it wrote to the guest) and publishing it as used.
/// Only what was published at the start is served, so a driver cannot keep the caller here
/// by adding buffers as fast as they are consumed; a corrupt ring ends the pass with an
/// error instead of a guess.
pub fn serve_available(
    index: u16,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    mut handle: impl FnMut(DescriptorChain<&GuestMemoryMmap>) -> u32,
) -> Result<usize, QueueCorrupt> {
    let size = queue.size();
    let avail = queue
        .avail_idx(mem, Ordering::Acquire)
        .map_err(|source| QueueCorrupt::Ring {
            queue: index,
            what: "reading avail index",
            source,
        })?;
    let pending = (avail - Wrapping(queue.next_avail())).0;
    if pending > size {
        return Err(QueueCorrupt::AvailAhead {
            queue: index,
            avail: avail.0,
            pending,
            next_avail: queue.next_avail(),
            size,
        });
    }
    for _ in 0..pending {
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            return Err(QueueCorrupt::Unreadable { queue: index });
        };
        let head = chain.head_index();
        if head >= size {
            return Err(QueueCorrupt::HeadOutside {
                queue: index,
                head,
                size,
            });
        }
        let used_len = handle(chain);
        queue
            .add_used(mem, head, used_len)
            .map_err(|source| QueueCorrupt::Ring {
                queue: index,
                what: "writing used ring",
                source,
            })?;
    }
    Ok(pending as usize)
}

pub(crate) fn corrupt(queue: u16, what: &'static str, source: virtio_queue::Error) -> QueueCorrupt {
    QueueCorrupt::Ring {
        queue,
        what,
        source,
    }
}

/// The ring's available index and how many chains past `next_avail` it offers; more than the
/// ring holds means the driver broke the ring. For devices that may leave chains on the ring
/// (a full backend, a rate limiter), which [`serve_available`] cannot.
pub(crate) fn available(
    index: u16,
    q: &Queue,
    mem: &GuestMemoryMmap,
) -> Result<(u16, u16), QueueCorrupt> {
    let avail = q
        .avail_idx(mem, Ordering::Acquire)
        .map_err(|e| corrupt(index, "reading avail index", e))?;
    let pending = (avail - Wrapping(q.next_avail())).0;
    if pending > q.size() {
        return Err(QueueCorrupt::AvailAhead {
            queue: index,
            avail: avail.0,
            pending,
            next_avail: q.next_avail(),
            size: q.size(),
        });
    }
    Ok((avail.0, pending))
}

/// The next available chain; call only when `available` says there is one.
pub(crate) fn pop<'a>(
    index: u16,
    q: &mut Queue,
    mem: &'a GuestMemoryMmap,
) -> Result<DescriptorChain<&'a GuestMemoryMmap>, QueueCorrupt> {
    let chain = q
        .pop_descriptor_chain(mem)
        .ok_or(QueueCorrupt::Unreadable { queue: index })?;
    if chain.head_index() >= q.size() {
        return Err(QueueCorrupt::HeadOutside {
            queue: index,
            head: chain.head_index(),
            size: q.size(),
        });
    }
    Ok(chain)
}

/// Copies the part of a device's config space at `offset` into `data`; bytes past its end
/// read as zero, as the transport promises for any width.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= config.len() {
        return;
    }
    let n = data.len().min(config.len() - start);
    data[..n].copy_from_slice(&config[start..start + n]);
}
