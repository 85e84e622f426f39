//! The virtio-mmio transport (version 2, virtio 1.x) and the one split virtqueue per device.
//!
//! Requests are synchronous: one chain in flight per device, descriptors 0..n. Completion is
//! seen in the used ring; the CPU first polls, then waits in `hlt`, woken by the device's
//! IOAPIC interrupt (routed to the BSP only) or the LAPIC tick, and every wait is bounded.

use core::mem::{align_of, size_of};
use core::sync::atomic::{compiler_fence, AtomicU64, Ordering};

use super::{block, pmem, rng, REQUESTS};
use crate::abi::Error;
use crate::arch::{mmio_read32, mmio_write32};
use crate::global::Global;
use crate::timer;

/// How long a request polls the used ring before halting for the device's interrupt: long
/// enough for a host I/O thread to serve a small request, short next to a disk's latency.
/// `probe.virtio_poll_us=` overrides it (0: always wait for the interrupt).
const DEFAULT_POLL_US: u64 = 300;

/// The avail-ring flags between waits: interrupts suppressed while the driver polls.
fn quiet_flags() -> u16 {
    if poll_us() > 0 {
        VIRTQ_AVAIL_F_NO_INTERRUPT
    } else {
        0
    }
}

/// Read once: parsing the command line on every request would cost more kernel-mode
/// instructions than the request itself on an emulated CPL0.
pub(super) fn poll_us() -> u64 {
    static POLL: AtomicU64 = AtomicU64::new(u64::MAX);
    let v = POLL.load(Ordering::Relaxed);
    if v != u64::MAX {
        return v;
    }
    let v = crate::bootinfo::get()
        .param(b"probe.virtio_poll_us")
        .and_then(|v| core::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_POLL_US);
    POLL.store(v, Ordering::Relaxed);
    v
}
/// Split-ring avail flag: the driver does not want an interrupt for used buffers.
const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;

const QMAX: u16 = 64;
const REQUEST_TIMEOUT_MS: u64 = 10_000;

/// virtio-mmio registers, as offsets into a device's window (virtio 1.x, 4.2.2).
#[derive(Clone, Copy)]
pub(super) enum Reg {
    Magic = 0x000,
    Version = 0x004,
    DeviceId = 0x008,
    DeviceFeatures = 0x010,
    DeviceFeaturesSel = 0x014,
    DriverFeatures = 0x020,
    DriverFeaturesSel = 0x024,
    QueueSel = 0x030,
    QueueNumMax = 0x034,
    QueueNum = 0x038,
    QueueReady = 0x044,
    QueueNotify = 0x050,
    InterruptStatus = 0x060,
    InterruptAck = 0x064,
    Status = 0x070,
    /// The ring addresses are 64-bit: low half here, high half in the next register.
    QueueDesc = 0x080,
    QueueAvail = 0x090,
    QueueUsed = 0x0a0,
}

impl Reg {
    /// The register's address in the window at `base`.
    pub fn at(self, base: u64) -> u64 {
        base + self as u64
    }
}

/// Device-specific configuration space, from here to the end of the window.
const CONFIG: u64 = 0x100;

const S_ACK: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;

pub(super) const F_VERSION_1: u64 = 1 << 32;

pub(super) const D_NEXT: u16 = 1;
pub(super) const D_WRITE: u16 = 2;
pub(super) const D_INDIRECT: u16 = 4;

// Layout of each device's 8 KiB of queue memory.
const OFF_DESC: u64 = 0;
const OFF_AVAIL: u64 = 1024;
const OFF_USED: u64 = 2048;
/// Request header (virtio-blk) or request (virtio-pmem).
pub(super) const OFF_HDR: u64 = 3072;
/// Status bytes (one per hostile case after the request's own) or the virtio-pmem response.
pub(super) const OFF_STATUS: u64 = 3200;
pub(super) const OFF_SCRATCH: u64 = 4096;
const QMEM_BYTES: u64 = 8192;

#[repr(C, align(4096))]
struct QMem([u8; QMEM_BYTES as usize]);

#[link_section = ".noinit.virtq"]
static QMEM: Global<[QMem; super::MAX_DEVS]> =
    Global::new([const { QMem([0; QMEM_BYTES as usize]) }; super::MAX_DEVS]);

/// The integers queue memory holds: any bytes the device leaves there read as a valid value.
pub(super) trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for u64 {}

#[derive(Clone, Copy)]
pub(super) struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// The device types this transport drives; each picks its features and configuration.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Blk,
    Pmem,
    Rng,
}

/// One virtio-mmio device and its queue 0; the fields a device type does not use stay zero.
#[derive(Clone, Copy)]
pub(super) struct Device {
    base: u64,
    pub kind: Kind,
    /// virtio-pmem: the region (config `start`, `size`).
    pub region: (u64, u64),
    pub irq: u32,
    /// Address of this device's slot of `QMEM` (0 until probed); set only by `new`, so the
    /// queue-memory accessors below can trust it.
    mem: u64,
    pub features: u64,
    /// virtio-blk: capacity in sectors and the segment limits from the configuration.
    pub capacity: u64,
    pub size_max: u32,
    pub seg_max: u32,
    pub qsize: u16,
    pub avail_idx: u16,
    pub used_seen: u16,
    pub ready: bool,
    error: &'static str,
}

pub(super) const NO_DEVICE: Device = Device {
    base: 0,
    kind: Kind::Blk,
    region: (0, 0),
    irq: 0,
    mem: 0,
    features: 0,
    capacity: 0,
    size_max: 0,
    seg_max: 0,
    qsize: 0,
    avail_idx: 0,
    used_seen: 0,
    ready: false,
    error: "",
};

impl Device {
    /// A device found at `base`, with queue memory slot `slot`; not yet initialised.
    pub fn new(base: u64, irq: u32, kind: Kind, slot: usize) -> Device {
        assert!(slot < super::MAX_DEVS);
        Device {
            base,
            irq,
            kind,
            mem: QMEM.addr() + slot as u64 * QMEM_BYTES,
            ..NO_DEVICE
        }
    }

    fn r32(&self, r: Reg) -> u32 {
        mmio_read32(r.at(self.base))
    }

    pub fn w32(&self, r: Reg, v: u32) {
        mmio_write32(r.at(self.base), v)
    }

    fn w64(&self, r: Reg, v: u64) {
        mmio_write32(r.at(self.base), v as u32);
        mmio_write32(r.at(self.base) + 4, (v >> 32) as u32);
    }

    pub fn config32(&self, off: u64) -> u32 {
        mmio_read32(self.base + CONFIG + off)
    }

    pub fn config64(&self, off: u64) -> u64 {
        self.config32(off) as u64 | (self.config32(off + 4) as u64) << 32
    }

    /// The address the device uses for byte `off` of this device's queue memory (identity
    /// mapping), for descriptors that point into it.
    pub fn qmem_addr(&self, off: u64) -> u64 {
        self.mem + off
    }

    /// Where a `T` at byte `off` of this device's queue memory lives. Panics on a device not
    /// probed, outside the slot or misaligned, so the volatile accesses below stay in memory
    /// only this driver and the device use.
    fn qmem_ptr<T: Plain>(&self, off: u64) -> *mut T {
        assert!(
            self.mem != 0
                && off <= QMEM_BYTES - size_of::<T>() as u64
                && off.is_multiple_of(align_of::<T>() as u64),
            "queue memory access out of place"
        );
        (self.mem + off) as *mut T
    }

    /// Stores into queue memory. Volatile: the device reads it behind the compiler's back.
    pub fn qmem_write<T: Plain>(&self, off: u64, v: T) {
        let p = self.qmem_ptr::<T>(off);
        // SAFETY: `p` is aligned and inside this device's slot of `QMEM` (`qmem_ptr`), a
        // static that Rust code reaches only through these raw accesses, never by reference.
        unsafe { core::ptr::write_volatile(p, v) }
    }

    /// Loads from queue memory. Volatile: the device writes it behind the compiler's back.
    pub fn qmem_read<T: Plain>(&self, off: u64) -> T {
        let p = self.qmem_ptr::<T>(off);
        // SAFETY: as in `qmem_write`; `T` is an integer, so whatever bytes the device left
        // there are a valid value.
        unsafe { core::ptr::read_volatile(p) }
    }

    /// Reset, feature negotiation and queue 0 set-up (virtio 1.x, 3.1.1).
    pub fn init(&mut self) -> Result<(), &'static str> {
        self.ready = false;
        let r = self.init_inner();
        if let Err(e) = r {
            self.error = e;
            self.w32(Reg::Status, self.r32(Reg::Status) | 0x80);
        }
        r
    }

    fn init_inner(&mut self) -> Result<(), &'static str> {
        if self.r32(Reg::Version) != 2 {
            return Err("not a virtio 1.x (version 2) virtio-mmio device");
        }
        self.w32(Reg::Status, 0);
        if !timer::wait_for(1000, || self.r32(Reg::Status) == 0) {
            return Err("device did not reset");
        }
        self.w32(Reg::Status, S_ACK);
        self.w32(Reg::Status, S_ACK | S_DRIVER);
        self.w32(Reg::DeviceFeaturesSel, 0);
        let lo = self.r32(Reg::DeviceFeatures) as u64;
        self.w32(Reg::DeviceFeaturesSel, 1);
        let offered = lo | (self.r32(Reg::DeviceFeatures) as u64) << 32;
        if offered & F_VERSION_1 == 0 {
            return Err("device does not offer VIRTIO_F_VERSION_1");
        }
        let wanted = match self.kind {
            Kind::Blk => block::FEATURES,
            Kind::Pmem => pmem::FEATURES,
            Kind::Rng => rng::FEATURES,
        };
        self.features = offered & wanted;
        self.w32(Reg::DriverFeaturesSel, 0);
        self.w32(Reg::DriverFeatures, self.features as u32);
        self.w32(Reg::DriverFeaturesSel, 1);
        self.w32(Reg::DriverFeatures, (self.features >> 32) as u32);
        self.w32(Reg::Status, S_ACK | S_DRIVER | S_FEATURES_OK);
        if self.r32(Reg::Status) & S_FEATURES_OK == 0 {
            return Err("device rejected the features (FEATURES_OK not kept)");
        }
        self.w32(Reg::QueueSel, 0);
        if self.r32(Reg::QueueReady) != 0 {
            return Err("queue 0 already live after reset");
        }
        let max = self.r32(Reg::QueueNumMax);
        if max < 4 {
            return Err("queue 0 too small or absent");
        }
        let mut q = QMAX;
        while q as u32 > max {
            q /= 2;
        }
        self.qsize = q;
        self.avail_idx = 0;
        self.used_seen = 0;
        for off in [OFF_AVAIL, OFF_AVAIL + 2, OFF_USED, OFF_USED + 2] {
            self.qmem_write(off, 0u16);
        }
        // Completions are first looked for by polling; the interrupt is asked for only
        // when a wait is about to halt (see `wait_used`). Without polling, always.
        self.set_avail_flags(quiet_flags());
        self.w32(Reg::QueueNum, q as u32);
        self.w64(Reg::QueueDesc, self.qmem_addr(OFF_DESC));
        self.w64(Reg::QueueAvail, self.qmem_addr(OFF_AVAIL));
        self.w64(Reg::QueueUsed, self.qmem_addr(OFF_USED));
        self.w32(Reg::QueueReady, 1);
        match self.kind {
            Kind::Blk => self.read_blk_config(),
            Kind::Pmem => self.read_pmem_config(),
            // virtio-rng has no configuration.
            Kind::Rng => {}
        }
        self.w32(Reg::Status, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        self.ready = true;
        Ok(())
    }

    pub fn write_desc(&self, i: u16, d: Desc) {
        let off = OFF_DESC + (i % self.qsize) as u64 * 16;
        self.qmem_write(off, d.addr);
        self.qmem_write(off + 8, d.len);
        self.qmem_write(off + 12, d.flags);
        self.qmem_write(off + 14, d.next);
    }

    /// Writes descriptor `i` of a chain laid out in order from descriptor 0: with `D_NEXT`
    /// it links to `i + 1`.
    pub fn write_linked(&self, i: u16, addr: u64, len: u32, flags: u16) {
        let next = if flags & D_NEXT != 0 { i + 1 } else { 0 };
        self.write_desc(
            i,
            Desc {
                addr,
                len,
                flags,
                next,
            },
        );
    }

    /// Publishes `head` in the avail ring. x86 keeps stores in order, so a compiler fence
    /// is all the ordering the descriptor → ring → index → notify sequence needs.
    pub fn push_avail(&mut self, head: u16) {
        let slot = OFF_AVAIL + 4 + (self.avail_idx % self.qsize) as u64 * 2;
        self.qmem_write(slot, head);
        compiler_fence(Ordering::SeqCst);
        self.set_avail_idx(self.avail_idx.wrapping_add(1));
        compiler_fence(Ordering::SeqCst);
    }

    /// Publishes `idx` as the avail index; hostile cases also move it past what was posted.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.qmem_write(OFF_AVAIL + 2, idx);
    }

    pub fn used_idx(&self) -> u16 {
        self.qmem_read(OFF_USED + 2)
    }

    /// The length the device reported for the last used entry taken (`used_seen - 1`).
    pub fn last_used_len(&self) -> u32 {
        let slot = self.used_seen.wrapping_sub(1) % self.qsize;
        self.qmem_read(OFF_USED + 4 + slot as u64 * 8 + 4)
    }

    /// Takes every used entry the device has produced; returns how many.
    pub fn drain_used(&mut self) -> u16 {
        let idx = self.used_idx();
        let n = idx.wrapping_sub(self.used_seen);
        self.used_seen = idx;
        n
    }

    fn set_avail_flags(&self, flags: u16) {
        self.qmem_write(OFF_AVAIL, flags);
    }

    /// Polls the used ring with the device's interrupt suppressed for `poll_us()`, then asks
    /// for the interrupt and halts until it comes. The used index is read again after the
    /// flag changes, so a completion that raced the change is not waited for in vain.
    ///
    /// On an AP (a task moved there with `cpu=K`) the interrupt would go to the BSP, so
    /// the wait goes on polling, halting until this CPU's tick between looks.
    fn wait_used(&mut self, ms: u64) -> bool {
        let seen = self.used_seen;
        let mut done = timer::spin_for(poll_us(), || self.used_idx() != seen);
        if !done {
            let bsp = crate::smp::current() == 0;
            if bsp {
                self.set_avail_flags(0);
            }
            done = timer::wait_for(ms, || self.used_idx() != seen);
            if bsp {
                self.set_avail_flags(quiet_flags());
            }
        }
        if done {
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        done
    }

    /// Posts the chain at descriptor 0, notifies queue 0 and waits for the device to use it.
    /// A device that does not answer in time is taken out of service, so later requests
    /// fail at once instead of waiting again.
    pub fn transact(&mut self) -> Result<(), Error> {
        REQUESTS.fetch_add(1, Ordering::Relaxed);
        self.push_avail(0);
        self.w32(Reg::QueueNotify, 0);
        if !self.wait_used(REQUEST_TIMEOUT_MS) {
            self.ready = false;
            self.error = "request timed out";
            return Err(Error::Timeout);
        }
        Ok(())
    }
}
