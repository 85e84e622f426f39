//! Output commit for a replicated VM (Remus): the switch between a network device and the
//! replicator that decides when the frames the guest transmitted may leave the host.
//!
//! While the gate holds, the device keeps each transmitted frame, tagged with the epoch it
//! was sent in, instead of writing it to its backend. An epoch ends when the device is saved
//! for a checkpoint ([`OutputGate::seal`], called with the transport locked and the VM
//! paused, the same point the checkpoint reads the rings at), so a frame belongs to an
//! epoch exactly when the standby's copy of the VM has already sent it. Once the standby
//! acknowledges that checkpoint the replicator releases the frames sealed up to it, and the
//! device (woken through its own event, on the thread that owns the backend) writes them
//! out in order. When replication ends the gate opens: everything held is released and
//! nothing more is held. The gate also knows which epochs the replicator's last checkpoint
//! sealed ([`OutputGate::in_last_capture`]): the device copies those frames for the
//! primary to send to the standby with the checkpoint, so that a standby taking over
//! before they were written can send them itself.
//!
//! The gate holds only numbers; the frames stay in the device, which bounds them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use vmm_sys_util::eventfd::EventFd;

/// Bytes of held frames a device keeps at most by default; past that it takes no more
/// transmit chains until some are released, as when its backend says `WouldBlock`.
pub const DEFAULT_HELD_BYTES: usize = 4 << 20;

/// One device's output gate, shared by the device and the replicator.
#[derive(Debug)]
pub struct OutputGate {
    holding: AtomicBool,
    /// The epoch frames sent now belong to; the first is 1, so 0 releases nothing.
    open: AtomicU64,
    /// The last epoch sealed by a checkpoint.
    sealed: AtomicU64,
    /// The last epoch sealed by a checkpoint the replicator took (see
    /// [`OutputGate::mark_captured`]).
    captured: AtomicU64,
    /// `captured` as it was before the last mark: the frames of the epochs after it, up to
    /// `captured`, are the ones the replicator's last checkpoint sealed.
    previous: AtomicU64,
    /// Frames of this epoch and earlier may go.
    released: AtomicU64,
    /// The device's own wake-up: it writes released frames when this fires.
    wake: EventFd,
}

impl OutputGate {
    /// A gate that does not hold; `wake` is a descriptor the device watches.
    pub fn new(wake: EventFd) -> OutputGate {
        OutputGate {
            holding: AtomicBool::new(false),
            open: AtomicU64::new(1),
            sealed: AtomicU64::new(0),
            captured: AtomicU64::new(0),
            previous: AtomicU64::new(0),
            released: AtomicU64::new(u64::MAX),
            wake,
        }
    }

    /// From now on, frames sent are held until released. Frames sealed before stay free.
    pub fn hold(&self) {
        self.released
            .store(self.sealed.load(Ordering::SeqCst), Ordering::SeqCst);
        self.holding.store(true, Ordering::SeqCst);
    }

    /// Whether frames sent now are held.
    pub fn is_holding(&self) -> bool {
        self.holding.load(Ordering::SeqCst)
    }

    /// The epoch a frame sent now belongs to.
    pub fn epoch(&self) -> u64 {
        self.open.load(Ordering::SeqCst)
    }

    /// Ends the current epoch and returns its number. The device calls it when it is saved,
    /// which a checkpoint does with the device locked and the VM paused.
    pub fn seal(&self) -> u64 {
        let e = self.open.fetch_add(1, Ordering::SeqCst);
        self.sealed.store(e, Ordering::SeqCst);
        e
    }

    /// Remembers the last seal as the replicator's checkpoint, to be released by
    /// [`OutputGate::release_captured`] once the standby has it. Called right after the
    /// checkpoint; a snapshot taken through the API in between would move the mark to its
    /// own, later seal.
    pub fn mark_captured(&self) {
        let before = self
            .captured
            .swap(self.sealed.load(Ordering::SeqCst), Ordering::SeqCst);
        self.previous.store(before, Ordering::SeqCst);
    }

    /// Whether a frame of epoch `epoch` was sealed by the replicator's last checkpoint (and
    /// not by the one before): the frames a primary ships with that checkpoint, so that a
    /// standby resuming from it can send them if the primary dies before it does.
    pub fn in_last_capture(&self, epoch: u64) -> bool {
        epoch > self.previous.load(Ordering::SeqCst)
            && epoch <= self.captured.load(Ordering::SeqCst)
    }

    /// Frames of epoch `epoch` and earlier may go; the device is woken to write them.
    pub fn release_through(&self, epoch: u64) {
        self.released.fetch_max(epoch, Ordering::SeqCst);
        self.wake_device();
    }

    /// Releases what the replicator's last checkpoint sealed (see
    /// [`OutputGate::mark_captured`]).
    pub fn release_captured(&self) {
        self.release_through(self.captured.load(Ordering::SeqCst));
    }

    /// [`OutputGate::release_captured`] without waking the device, for a caller that
    /// writes the frames itself (`VirtioDevice::flush_output`, with the device locked) and
    /// wakes it ([`OutputGate::wake`]) only if some are left: a replicator that tells its
    /// standby right after the writes should not be made to wait meanwhile for a device
    /// thread it woke for nothing.
    pub fn release_captured_here(&self) {
        self.released
            .fetch_max(self.captured.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Wakes the device to write what is released.
    pub fn wake(&self) {
        self.wake_device();
    }

    /// Stops holding and releases everything held: replication ended.
    pub fn open(&self) {
        self.holding.store(false, Ordering::SeqCst);
        self.released.store(u64::MAX, Ordering::SeqCst);
        self.wake_device();
    }

    /// Whether a frame of epoch `epoch` may go.
    pub fn is_released(&self, epoch: u64) -> bool {
        epoch <= self.released.load(Ordering::SeqCst)
    }

    fn wake_device(&self) {
        if let Err(e) = self.wake.write(1) {
            tracing::warn!("virtio-net: waking the device for released frames: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn frames_go_once_the_checkpoint_that_sealed_them_is_released() {
        let wake = EventFd::new(EFD_NONBLOCK).unwrap();
        let g = OutputGate::new(wake.try_clone().unwrap());
        assert!(!g.is_holding());
        assert!(g.is_released(g.epoch()), "an open gate lets everything go");
        g.hold();
        let first = g.epoch();
        assert!(!g.is_released(first));
        assert_eq!(g.seal(), first);
        g.mark_captured();
        let second = g.epoch();
        assert!(second > first);
        assert!(g.in_last_capture(first));
        assert!(!g.in_last_capture(second));
        g.release_captured();
        assert!(g.is_released(first));
        assert!(!g.is_released(second), "sent after the checkpoint");
        assert_eq!(wake.read().unwrap(), 1, "the device is woken");
        assert_eq!(g.seal(), second);
        g.mark_captured();
        assert!(
            !g.in_last_capture(first),
            "shipped with the checkpoint before"
        );
        assert!(g.in_last_capture(second));
        g.open();
        assert!(!g.is_holding());
        assert!(g.is_released(second));
    }
}
