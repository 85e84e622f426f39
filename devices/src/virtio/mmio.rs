//! The virtio-mmio transport (virtio 1.x, register layout version 2).
//!
//! Queue registers written by the driver are kept as shadow values and only handed to the
//! `Queue` when the driver sets QueueReady, after all of them have been checked together.
//! That way a half-written or nonsensical configuration never reaches the ring code, and a
//! bad one is refused in one place (the device then reports NEEDS_RESET).

use super::{NetCounters, RngCounters, VirtioDevice, VirtioStats};
use crate::GuestMemoryMmap;
use crate::Irq;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use tracing::{debug, warn};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_device::bus::{MmioAddress, MmioAddressOffset};
use vm_device::MutDeviceMmio;
use vm_memory::{Bytes, GuestAddress};

/// "virt" in little-endian, as the spec requires.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// Register layout of virtio 1.x; version 1 is the legacy layout, which Musubi does not offer.
pub const MMIO_VERSION: u32 = 2;
/// Vendor id reported to the guest ("MUSB"); drivers do not interpret it.
pub const MMIO_VENDOR_ID: u32 = 0x4253_554d;
/// Bytes of MMIO space each device occupies.
pub const MMIO_SIZE: u64 = 0x1000;

/// Spec alignment of the split-ring parts (2.7: descriptor table 16, avail 2, used 4).
const DESC_ALIGN: u64 = 16;
const AVAIL_ALIGN: u64 = 2;
const USED_ALIGN: u64 = 4;

/// What the driver has written to a queue's registers; applied to the `Queue` on ready.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct QueueRegs {
    size: u32,
    desc: u64,
    avail: u64,
    used: u64,
}

/// A virtio device reachable at one 4 KiB MMIO window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice + Send>,
    mem: GuestMemoryMmap,
    irq: Arc<dyn Irq>,
    queues: Vec<Queue>,
    regs: Vec<QueueRegs>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    /// Status as written by the driver; NEEDS_RESET is tracked apart because it is the
    /// device's to set and only a reset clears it.
    status: u32,
    needs_reset: bool,
    interrupt_status: u32,
    interrupts: u64,
}

/// Why a saved transport state does not fit this transport.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(
        "saved device type {saved_type} with {saved_queues} queues, this one is type \
         {device_type} with {queues}"
    )]
    OtherDevice {
        saved_type: u32,
        saved_queues: usize,
        device_type: u32,
        queues: usize,
    },
    #[error("queue {queue}: {source}")]
    Queue {
        queue: usize,
        source: QueueLayoutError,
    },
}

/// Why a queue's registers (a driver's or a saved state's) do not describe a usable queue.
#[derive(Debug, thiserror::Error)]
pub enum QueueLayoutError {
    #[error("queue size {size} (max {max})")]
    Size { size: u32, max: u16 },
    #[error("{what} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        what: &'static str,
        addr: u64,
        align: u64,
    },
    #[error(transparent)]
    Queue(#[from] virtio_queue::Error),
    #[error(
        "rings (desc {desc:#x}, avail {avail:#x}, used {used:#x}, size {size}) are not in guest \
         memory"
    )]
    OutsideMemory {
        desc: u64,
        avail: u64,
        used: u64,
        size: u16,
    },
}

/// Everything a transport holds that the guest can change, so a snapshot can bring the
/// device back exactly where the driver left it. The device behind it keeps nothing the
/// guest set except the features it accepted, which `activate` hands it again.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportState {
    pub device_type: u32,
    queues: Vec<SavedQueue>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    status: u32,
    needs_reset: bool,
    interrupt_status: u32,
    interrupts: u64,
    /// The device's own state; states written before devices kept any have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<super::DeviceState>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct SavedQueue {
    size: u16,
    ready: bool,
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
    next_used: u16,
    /// What the driver last wrote to the queue's registers.
    regs: QueueRegs,
}

fn set_half(value: &mut u64, high: bool, half: u32) {
    if high {
        *value = (*value & 0xffff_ffff) | (u64::from(half) << 32);
    } else {
        *value = (*value & !0xffff_ffff) | u64::from(half);
    }
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice + Send>,
        mem: GuestMemoryMmap,
        irq: Arc<dyn Irq>,
    ) -> MmioTransport {
        let n = device.num_queues();
        let max = device.queue_max_size();
        let queues = (0..n)
            .map(|_| Queue::new(max).expect("devices offer a power of two up to 32768"))
            .collect();
        let regs = vec![QueueRegs::default(); n];
        MmioTransport {
            device,
            mem,
            irq,
            queues,
            regs,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            status: 0,
            needs_reset: false,
            interrupt_status: 0,
            interrupts: 0,
        }
    }

    /// Whether the driver set VIRTQ_AVAIL_F_NO_INTERRUPT in queue `i`'s available ring. An
    /// unreadable ring counts as not suppressed: the driver then still hears of the
    /// completion.
    fn interrupt_suppressed(&self, i: usize) -> bool {
        const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
        let flags: Option<u16> = self
            .mem
            .read_obj(GuestAddress(self.queues[i].avail_ring()))
            .ok();
        flags.is_some_and(|f| f & VIRTQ_AVAIL_F_NO_INTERRUPT != 0)
    }

    /// Queue `index` as the device holds it, so the fuzzing checks can find the rings the
    /// driver's register writes actually set up.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn queue(&self, index: usize) -> Option<&Queue> {
        self.queues.get(index)
    }

    /// The transport's state for a snapshot. Call it with no queue being served (the VM
    /// paused): the ring positions are read as they are, and a network device's held output
    /// is sealed at them (see [`crate::net::output_gate`]).
    pub fn state(&self) -> TransportState {
        TransportState {
            device_type: self.device.device_type(),
            queues: self
                .queues
                .iter()
                .zip(&self.regs)
                .map(|(q, r)| SavedQueue {
                    size: q.size(),
                    ready: q.ready(),
                    desc: q.desc_table(),
                    avail: q.avail_ring(),
                    used: q.used_ring(),
                    next_avail: q.next_avail(),
                    next_used: q.next_used(),
                    regs: *r,
                })
                .collect(),
            queue_sel: self.queue_sel,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            status: self.status,
            needs_reset: self.needs_reset,
            interrupt_status: self.interrupt_status,
            interrupts: self.interrupts,
            device: self.device.save_state(),
        }
    }

    /// Puts the transport back in a saved state, on a device built from the same
    /// configuration. The state file is checksummed but still checked here as if the guest
    /// had written it: a ready queue goes through the same checks as a driver's, so a state
    /// that names rings outside guest memory is refused, never trusted.
    pub fn restore(&mut self, s: &TransportState) -> Result<(), RestoreError> {
        if s.device_type != self.device.device_type() || s.queues.len() != self.queues.len() {
            return Err(RestoreError::OtherDevice {
                saved_type: s.device_type,
                saved_queues: s.queues.len(),
                device_type: self.device.device_type(),
                queues: self.queues.len(),
            });
        }
        self.reset();
        self.queue_sel = s.queue_sel;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.acked_features = s.acked_features;
        for (i, q) in s.queues.iter().enumerate() {
            if q.ready {
                self.regs[i] = QueueRegs {
                    size: q.size.into(),
                    desc: q.desc,
                    avail: q.avail,
                    used: q.used,
                };
                self.configure_queue(i)
                    .map_err(|source| RestoreError::Queue { queue: i, source })?;
                self.queues[i].set_next_avail(q.next_avail);
                self.queues[i].set_next_used(q.next_used);
            }
            self.regs[i] = q.regs;
        }
        self.status = s.status;
        self.needs_reset = s.needs_reset;
        self.interrupt_status = s.interrupt_status;
        self.interrupts = s.interrupts;
        if let Some(d) = &s.device {
            self.device.restore_state(d);
        }
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.device.activate(self.acked_features);
        }
        Ok(())
    }

    /// Serves every live queue once, as if each had been notified: a notification the
    /// I/O thread had not read yet when the VM was paused is then not lost by a snapshot.
    /// Serving a queue with nothing available does nothing.
    pub fn serve_all(&mut self) {
        for i in 0..self.queues.len() {
            self.process_queue(i as u16);
        }
    }

    /// See [`VirtioDevice::transport_reset`]; the snapshot and migration paths call it on
    /// the restored side.
    pub fn transport_reset(&mut self) {
        self.device.transport_reset();
    }

    /// The gate holding the device's output while the VM is replicated, if it has one.
    pub fn output_gate(&self) -> Option<std::sync::Arc<crate::net::OutputGate>> {
        self.device.output_gate()
    }

    /// See [`VirtioDevice::flush_output`].
    pub fn flush_output(&mut self) -> bool {
        self.device.flush_output()
    }

    /// See [`VirtioDevice::captured_output`].
    pub fn captured_output(&self) -> Vec<Vec<u8>> {
        self.device.captured_output()
    }

    /// See [`VirtioDevice::send_frames`].
    pub fn send_frames(&mut self, frames: Vec<Vec<u8>>) -> usize {
        self.device.send_frames(frames)
    }

    /// The virtio device type behind this transport (2 block, 27 pmem).
    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    /// Queues the device has, so the VMM can give each its own doorbell.
    pub fn num_queues(&self) -> usize {
        self.queues.len()
    }

    /// Serves queue `index` now. Notify calls this and nothing else, so moving queue work to
    /// another thread later means calling this from there instead.
    pub fn process_queue(&mut self, index: u16) {
        let i = usize::from(index);
        if i >= self.queues.len() {
            debug!(index, "notify of a queue the device does not have");
            return;
        }
        if !self.live(i) {
            debug!(
                index,
                status = self.status,
                "notify of a queue that is not live"
            );
            return;
        }
        let before = self.queues[i].next_used();
        let result = self
            .device
            .process_queue(index, &mut self.queues[i], &self.mem);
        if self.queues[i].next_used() != before {
            self.used_buffers_added(i);
        }
        if let Err(e) = result {
            warn!(index, "virtio queue unusable, device needs reset: {e}");
            self.mark_needs_reset();
        }
    }

    /// See [`VirtioDevice::queue_lane`].
    pub fn queue_lane(&self, index: u16) -> usize {
        self.device.queue_lane(index)
    }

    /// See [`VirtioDevice::event_lane`].
    pub fn event_lane(&self, index: usize) -> usize {
        self.device.event_lane(index)
    }

    /// See [`VirtioDevice::pollable`].
    pub fn pollable(&self, index: u16) -> bool {
        usize::from(index) < self.queues.len() && self.device.pollable(index)
    }

    fn live(&self, i: usize) -> bool {
        !self.needs_reset
            && self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && self.queues.get(i).is_some_and(|q| q.ready())
    }

    /// Starts or ends polling queue `index` (see [`VirtioDevice::set_polled`]): the driver's
    /// doorbells go off while it is polled. Ending it turns them back on and then serves what
    /// the driver made available before it could see that, which no doorbell will announce.
    pub fn set_polled(&mut self, index: u16, on: bool) {
        if !self.pollable(index) {
            return;
        }
        self.device.set_polled(index, on);
        let i = usize::from(index);
        if !self.live(i) {
            return;
        }
        let result = if on {
            self.queues[i]
                .disable_notification(&self.mem)
                .map(|_| false)
        } else {
            self.queues[i].enable_notification(&self.mem)
        };
        match result {
            Ok(false) => {}
            Ok(true) => self.process_queue(index),
            Err(e) => {
                warn!(index, "virtio queue unusable, device needs reset: {e}");
                self.mark_needs_reset();
            }
        }
    }

    /// Serves queue `index` if the driver made chains available since the last pass, as
    /// its doorbell would have; true if the pass took any. A chain the device leaves on the
    /// ring (its backend full) counts as nothing taken, so a stalled queue is no reason to
    /// poll on.
    pub fn poll_queue(&mut self, index: u16) -> bool {
        let i = usize::from(index);
        if !self.live(i) {
            return false;
        }
        let before = self.queues[i].next_avail();
        match self.queues[i].avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire) {
            Ok(avail) if avail.0 != before => {}
            _ => return false,
        }
        self.process_queue(index);
        self.queues[i].next_avail() != before
    }

    /// Interrupts the driver for new used entries on queue `i` unless it asked not to be:
    /// with EVENT_IDX through the used_event index (`needs_notification`), without it through
    /// VIRTQ_AVAIL_F_NO_INTERRUPT, which virtio-queue does not look at. A polling driver then
    /// costs no interrupt (and no acknowledging exits).
    fn used_buffers_added(&mut self, i: usize) {
        let notify = if self.queues[i].event_idx_enabled() {
            self.queues[i].needs_notification(&self.mem).unwrap_or(true)
        } else {
            !self.interrupt_suppressed(i)
        };
        if notify {
            self.raise(VIRTIO_MMIO_INT_VRING);
        }
    }

    /// Descriptors the device needs watched besides its doorbells (see
    /// [`VirtioDevice::event_fds`]); the VMM's I/O thread adds them to its epoll set and
    /// calls `process_event` with the index of the one that became readable.
    pub fn event_fds(&self) -> Vec<RawFd> {
        self.device.event_fds()
    }

    /// Lets the device handle its event source `index`, then interrupts for the queues it
    /// used. Ignored until the driver has set DRIVER_OK (the device sees the event again
    /// through its own resume signal on activation) or while the device needs a reset.
    pub fn process_event(&mut self, index: usize) {
        if self.needs_reset || self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0 {
            debug!(
                index,
                status = self.status,
                "device event while the device is not live"
            );
            return;
        }
        let result = self
            .device
            .process_event(index, &mut self.queues, &self.mem);
        let mut used = match result {
            Ok(used) => used,
            Err(e) => {
                warn!(index, "virtio queue unusable, device needs reset: {e}");
                self.mark_needs_reset();
                return;
            }
        };
        used.sort_unstable();
        used.dedup();
        for q in used {
            let i = usize::from(q);
            if i < self.queues.len() && self.queues[i].ready() {
                self.used_buffers_added(i);
            }
        }
    }

    /// Makes all completed guest writes durable; the VMM calls it before exiting.
    pub fn flush(&mut self) -> io::Result<()> {
        self.device.flush()
    }

    /// Per-direction counters if the device is a network device, with the interrupts this
    /// transport raised.
    pub fn net_counters(&self) -> Option<NetCounters> {
        let mut c = self.device.net_counters()?;
        c.interrupts = self.interrupts;
        Some(c)
    }

    /// The entropy device's counters, with the interrupts this transport raised.
    pub fn rng_counters(&self) -> Option<RngCounters> {
        let mut c = self.device.rng_counters()?;
        c.interrupts = self.interrupts;
        Some(c)
    }

    /// Device counters plus the interrupts this transport raised.
    pub fn stats(&self) -> VirtioStats {
        let mut s = self.device.stats();
        s.interrupts = self.interrupts;
        s
    }

    /// Device status as the driver reads it.
    pub fn status(&self) -> u32 {
        self.status
            | if self.needs_reset {
                VIRTIO_CONFIG_S_NEEDS_RESET
            } else {
                0
            }
    }

    /// Current interrupt status register (bit 0 used buffer, bit 1 configuration change).
    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    fn raise(&mut self, bit: u32) {
        self.interrupt_status |= bit;
        self.interrupts += 1;
        if let Err(e) = self.irq.trigger() {
            warn!("virtio-mmio interrupt injection failed: {e}");
        }
    }

    /// The spec asks for a configuration-change interrupt so a driver that is running notices.
    fn mark_needs_reset(&mut self) {
        if self.needs_reset {
            return;
        }
        self.needs_reset = true;
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.raise(VIRTIO_MMIO_INT_CONFIG);
        }
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.regs.iter_mut().for_each(|r| *r = QueueRegs::default());
        self.queue_sel = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.status = 0;
        self.needs_reset = false;
        self.interrupt_status = 0;
    }

    fn selected(&self) -> Option<usize> {
        let i = self.queue_sel as usize;
        (i < self.queues.len()).then_some(i)
    }

    fn read_reg(&self, offset: u32) -> u32 {
        match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => MMIO_VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self
                .selected()
                .map_or(0, |_| self.device.queue_max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self
                .selected()
                .map_or(0, |i| u32::from(self.queues[i].ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status(),
            // The configuration never changes after creation.
            VIRTIO_MMIO_CONFIG_GENERATION => 0,
            // No shared memory regions: the spec's answer for a missing one is a length of -1.
            VIRTIO_MMIO_SHM_LEN_LOW | VIRTIO_MMIO_SHM_LEN_HIGH => u32::MAX,
            VIRTIO_MMIO_SHM_BASE_LOW | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            _ => {
                debug!(
                    offset,
                    "read of a write-only or unknown virtio-mmio register"
                );
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u32, value: u32) {
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(value),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            VIRTIO_MMIO_QUEUE_NUM
            | VIRTIO_MMIO_QUEUE_DESC_LOW
            | VIRTIO_MMIO_QUEUE_DESC_HIGH
            | VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | VIRTIO_MMIO_QUEUE_USED_LOW
            | VIRTIO_MMIO_QUEUE_USED_HIGH => self.write_queue_reg(offset, value),
            VIRTIO_MMIO_QUEUE_READY => self.write_queue_ready(value),
            VIRTIO_MMIO_QUEUE_NOTIFY => match u16::try_from(value) {
                Ok(index) => self.process_queue(index),
                Err(_) => debug!(value, "notify of an out-of-range queue index"),
            },
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !value,
            VIRTIO_MMIO_STATUS => self.write_status(value),
            VIRTIO_MMIO_SHM_SEL => {}
            _ => debug!(
                offset,
                value, "write to a read-only or unknown virtio-mmio register"
            ),
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features may only change between DRIVER and FEATURES_OK (3.1.1).
        if self.status & VIRTIO_CONFIG_S_DRIVER == 0
            || self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
        {
            debug!(
                status = self.status,
                "driver features written outside feature negotiation"
            );
            return;
        }
        let shift = match self.driver_features_sel {
            0 => 0,
            1 => 32,
            sel => {
                debug!(sel, value, "driver features written to an unknown page");
                return;
            }
        };
        self.acked_features =
            (self.acked_features & !(0xffff_ffffu64 << shift)) | (u64::from(value) << shift);
    }

    fn write_queue_reg(&mut self, offset: u32, value: u32) {
        let Some(i) = self.selected() else {
            debug!(
                queue = self.queue_sel,
                offset, "queue register written for a queue the device does not have"
            );
            return;
        };
        if self.queues[i].ready() {
            debug!(
                queue = i,
                offset, "queue register written while the queue is ready"
            );
            return;
        }
        let r = &mut self.regs[i];
        match offset {
            VIRTIO_MMIO_QUEUE_NUM => r.size = value,
            VIRTIO_MMIO_QUEUE_DESC_LOW => set_half(&mut r.desc, false, value),
            VIRTIO_MMIO_QUEUE_DESC_HIGH => set_half(&mut r.desc, true, value),
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => set_half(&mut r.avail, false, value),
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => set_half(&mut r.avail, true, value),
            VIRTIO_MMIO_QUEUE_USED_LOW => set_half(&mut r.used, false, value),
            VIRTIO_MMIO_QUEUE_USED_HIGH => set_half(&mut r.used, true, value),
            _ => unreachable!("write_queue_reg called for offset {offset:#x}"),
        }
    }

    fn write_queue_ready(&mut self, value: u32) {
        let Some(i) = self.selected() else {
            debug!(
                queue = self.queue_sel,
                "QueueReady written for a missing queue"
            );
            return;
        };
        if value == 0 {
            // Drivers clear QueueReady only when tearing the queue down; start afresh.
            self.queues[i].reset();
            return;
        }
        if self.queues[i].ready() {
            return;
        }
        match self.configure_queue(i) {
            Ok(()) => {}
            Err(why) => {
                warn!(queue = i, "driver enabled a queue with a bad layout: {why}");
                self.queues[i].reset();
                self.mark_needs_reset();
            }
        }
    }

    fn configure_queue(&mut self, i: usize) -> Result<(), QueueLayoutError> {
        let r = self.regs[i];
        let max = self.device.queue_max_size();
        let size = u16::try_from(r.size)
            .ok()
            .filter(|s| *s != 0 && *s <= max && s.is_power_of_two())
            .ok_or(QueueLayoutError::Size { size: r.size, max })?;
        for (what, addr, align) in [
            ("descriptor table", r.desc, DESC_ALIGN),
            ("available ring", r.avail, AVAIL_ALIGN),
            ("used ring", r.used, USED_ALIGN),
        ] {
            if addr % align != 0 {
                return Err(QueueLayoutError::Misaligned { what, addr, align });
            }
        }
        let q = &mut self.queues[i];
        q.try_set_size(size)?;
        q.try_set_desc_table_address(GuestAddress(r.desc))?;
        q.try_set_avail_ring_address(GuestAddress(r.avail))?;
        q.try_set_used_ring_address(GuestAddress(r.used))?;
        // Features are settled before queues are set up; DRIVER_OK sets this again for a
        // driver that did it the other way round.
        q.set_event_idx(self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        q.set_ready(true);
        if !q.is_valid(&self.mem) {
            return Err(QueueLayoutError::OutsideMemory {
                desc: r.desc,
                avail: r.avail,
                used: r.used,
                size,
            });
        }
        Ok(())
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let mut value = value & !VIRTIO_CONFIG_S_NEEDS_RESET;
        let newly = value & !self.status;
        if newly & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            let version_1 = 1u64 << VIRTIO_F_VERSION_1;
            if self.acked_features & version_1 == 0 || self.acked_features & !offered != 0 {
                debug!(
                    acked = self.acked_features,
                    offered, "refusing FEATURES_OK: VERSION_1 missing or unknown features"
                );
                value &= !VIRTIO_CONFIG_S_FEATURES_OK;
            }
        }
        if newly & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            if value & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
                debug!("DRIVER_OK without FEATURES_OK; device stays inactive");
                value &= !VIRTIO_CONFIG_S_DRIVER_OK;
            } else {
                let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
                for q in &mut self.queues {
                    q.set_event_idx(event_idx);
                }
                self.device.activate(self.acked_features);
            }
        }
        self.status = value;
    }
}

/// Where an access to the transport's window lands.
enum Target {
    /// The device's configuration space, this far into it.
    Config(u64),
    /// A 32-bit transport register.
    Register(u32),
    /// Past the window, or a register access that is not 32-bit aligned: ignored, and
    /// read as zeros.
    Nothing,
}

impl Target {
    /// Where an access of `len` bytes at `offset` lands; `what` (`read`, `write`) names it
    /// in the log line of a misaligned one.
    fn of(offset: MmioAddressOffset, len: usize, what: &str) -> Target {
        let config = u64::from(VIRTIO_MMIO_CONFIG);
        if offset >= config {
            return if offset < MMIO_SIZE {
                Target::Config(offset - config)
            } else {
                Target::Nothing
            };
        }
        if len != 4 || !offset.is_multiple_of(4) {
            debug!(
                offset,
                len, "virtio-mmio register {what} that is not 32-bit aligned"
            );
            return Target::Nothing;
        }
        Target::Register(offset as u32)
    }
}

impl MutDeviceMmio for MmioTransport {
    fn mmio_read(&mut self, _base: MmioAddress, offset: MmioAddressOffset, data: &mut [u8]) {
        match Target::of(offset, data.len(), "read") {
            Target::Config(at) => {
                data.fill(0);
                self.device.read_config(at, data);
            }
            Target::Register(reg) => data.copy_from_slice(&self.read_reg(reg).to_le_bytes()),
            Target::Nothing => data.fill(0),
        }
    }

    fn mmio_write(&mut self, _base: MmioAddress, offset: MmioAddressOffset, data: &[u8]) {
        match Target::of(offset, data.len(), "write") {
            Target::Config(at) => self.device.write_config(at, data),
            Target::Register(reg) => self.write_reg(
                reg,
                u32::from_le_bytes([data[0], data[1], data[2], data[3]]),
            ),
            Target::Nothing => {}
        }
    }
}
