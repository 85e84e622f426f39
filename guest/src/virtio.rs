//! virtio-mmio (version 2, virtio 1.x) block and pmem devices with one split virtqueue each.
//!
//! Block devices (id 2) are disks 0, 1, ... in command-line order, device slots
//! `0..MAX_DISKS`; virtio-pmem devices (id 27) take slots `MAX_DISKS..MAX_DEVS` (their
//! regions are announced by `pmem.rs`). A device's interrupt vector is `VECTOR_BASE + slot`.
//!
//! Requests are synchronous: one chain in flight per disk, descriptors 0..n. The data
//! descriptors carry the caller's physical addresses (identity mapping), so a user buffer
//! goes to the device without a copy at CPL0. Completion is seen in the used ring; the CPU
//! waits in `hlt`, woken by the device's IOAPIC interrupt or the LAPIC tick, and every wait
//! is bounded.

use core::sync::atomic::{compiler_fence, AtomicU32, AtomicU64, Ordering};

use crate::abi::Error;
use crate::arch::{mmio_read32, mmio_write32};
use crate::bootinfo::BootInfo;
use crate::global::Global;
use crate::{apic, kprintln, timer};

pub const MAX_DISKS: usize = 8;
pub const MAX_PMEM_DEVS: usize = 4;
pub const MAX_DEVS: usize = MAX_DISKS + MAX_PMEM_DEVS;
const ID_BLK: u32 = 2;
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
fn poll_us() -> u64 {
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
const ID_PMEM: u32 = 27;
pub const VECTOR_BASE: u64 = 0x30;
pub const ID_LEN: u64 = 20;

const QMAX: u16 = 64;
const REQUEST_TIMEOUT_MS: u64 = 10_000;
const HOSTILE_TIMEOUT_MS: u64 = 300;

const MAGIC: u64 = 0x000;
const VERSION: u64 = 0x004;
const DEVICE_ID: u64 = 0x008;
const DEV_FEATURES: u64 = 0x010;
const DEV_FEATURES_SEL: u64 = 0x014;
const DRV_FEATURES: u64 = 0x020;
const DRV_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const QUEUE_NOTIFY: u64 = 0x050;
const INT_STATUS: u64 = 0x060;
const INT_ACK: u64 = 0x064;
const STATUS: u64 = 0x070;
const QUEUE_DESC: u64 = 0x080;
const QUEUE_AVAIL: u64 = 0x090;
const QUEUE_USED: u64 = 0x0a0;
const CONFIG: u64 = 0x100;

const S_ACK: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;

const F_SIZE_MAX: u64 = 1 << 1;
const F_SEG_MAX: u64 = 1 << 2;
const F_RO: u64 = 1 << 5;
const F_BLK_SIZE: u64 = 1 << 6;
const F_FLUSH: u64 = 1 << 9;
const F_INDIRECT: u64 = 1 << 28;
const F_VERSION_1: u64 = 1 << 32;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;

const D_NEXT: u16 = 1;
const D_WRITE: u16 = 2;
const D_INDIRECT: u16 = 4;

// Layout of each disk's 8 KiB of queue memory.
const OFF_DESC: u64 = 0;
const OFF_AVAIL: u64 = 1024;
const OFF_USED: u64 = 2048;
const OFF_HDR: u64 = 3072;
const OFF_STATUS: u64 = 3200;
const OFF_SCRATCH: u64 = 4096;

#[repr(C, align(4096))]
struct QMem([u8; 8192]);

#[link_section = ".noinit.virtq"]
static QMEM: Global<[QMem; MAX_DEVS]> = Global::new([const { QMem([0; 8192]) }; MAX_DEVS]);

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

#[derive(Clone, Copy)]
pub struct Disk {
    base: u64,
    pmem: bool,
    /// virtio-pmem: the region (config `start`, `size`).
    pub region: (u64, u64),
    irq: u32,
    mem: u64,
    features: u64,
    capacity: u64,
    size_max: u32,
    seg_max: u32,
    qsize: u16,
    avail_idx: u16,
    used_seen: u16,
    ready: bool,
    error: &'static str,
}

const NO_DISK: Disk = Disk {
    base: 0,
    pmem: false,
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

static DISKS: Global<[Disk; MAX_DEVS]> = Global::new([NO_DISK; MAX_DEVS]);
static NDISKS: AtomicU32 = AtomicU32::new(0);
static NPMEM: AtomicU32 = AtomicU32::new(0);
/// MMIO bases for the interrupt handler, which must not touch `DISKS`.
static BASES: [AtomicU64; MAX_DEVS] = [const { AtomicU64::new(0) }; MAX_DEVS];
static IRQS: [AtomicU32; MAX_DEVS] = [const { AtomicU32::new(0) }; MAX_DEVS];
/// Requests posted to any device since boot (counted for the storage benchmarks).
pub static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Interrupts from all virtio devices since boot.
pub fn total_irqs() -> u64 {
    IRQS.iter().map(|c| c.load(Ordering::Relaxed) as u64).sum()
}

pub fn pmem_count() -> usize {
    NPMEM.load(Ordering::Relaxed) as usize
}

/// The region of virtio-pmem device `j`, if it initialised.
pub fn pmem_region(j: usize) -> Option<(u64, u64)> {
    if j < pmem_count() {
        let d = unsafe { &DISKS.get()[MAX_DISKS + j] };
        d.ready.then_some(d.region)
    } else {
        None
    }
}

/// A virtio-pmem flush: `{type: u32 = 0}` device-readable, `{ret: u32}` device-writable;
/// the device answers once the region is durable on the host (`msync`).
pub fn pmem_flush(j: usize) -> Result<(), Error> {
    if j >= pmem_count() {
        return Err(Error::BadFd);
    }
    let d = unsafe { &mut DISKS.get()[MAX_DISKS + j] };
    if !d.ready {
        return Err(Error::NotReady);
    }
    d.pmem_flush()
}

pub fn count() -> usize {
    NDISKS.load(Ordering::Relaxed) as usize
}

fn disk(i: usize) -> Result<&'static mut Disk, Error> {
    if i < count() {
        Ok(unsafe { &mut DISKS.get()[i] })
    } else {
        Err(Error::NoSuchDisk)
    }
}

pub fn irq(i: usize) {
    let base = BASES[i].load(Ordering::Relaxed);
    if base != 0 {
        let s = mmio_read32(base + INT_STATUS);
        mmio_write32(base + INT_ACK, s);
    }
    IRQS[i].fetch_add(1, Ordering::Relaxed);
}

pub fn irq_count(i: usize) -> u32 {
    IRQS[i].load(Ordering::Relaxed)
}

/// Parses `<size>@<addr>:<irq>[:<id>]` (sizes like `4K`, `0x1000`, `512`).
fn parse_device(s: &[u8]) -> Option<(u64, u64, u32)> {
    let s = core::str::from_utf8(s).ok()?;
    let (size, rest) = s.split_once('@')?;
    let mut parts = rest.split(':');
    let addr = parse_num(parts.next()?)?;
    let irq = parse_num(parts.next()?)? as u32;
    Some((parse_num(size)?, addr, irq))
}

pub fn parse_num(s: &str) -> Option<u64> {
    let (digits, mult) = match s.as_bytes().last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 1 << 10),
        b'm' | b'M' => (&s[..s.len() - 1], 1 << 20),
        b'g' | b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v = if let Some(h) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        u64::from_str_radix(h, 16).ok()?
    } else {
        digits.parse::<u64>().ok()?
    };
    v.checked_mul(mult)
}

/// Finds the block devices announced on the command line, sets them up and routes their
/// interrupts to the BSP.
pub fn probe_all(info: &BootInfo, bsp: u32) {
    let pins = apic::ioapic_pins();
    for frag in info.params(b"virtio_mmio.device") {
        let Some((size, base, irq)) = parse_device(frag) else {
            kprintln!(
                "probe: cannot parse virtio_mmio.device={}",
                crate::tasks::Lossy(frag)
            );
            continue;
        };
        if size < 0x200 || mmio_read32(base + MAGIC) != 0x7472_6976 {
            kprintln!("probe: no virtio-mmio device at {:#x}", base);
            continue;
        }
        let id = mmio_read32(base + DEVICE_ID);
        let slot = match id {
            ID_BLK if count() < MAX_DISKS => NDISKS.fetch_add(1, Ordering::Relaxed) as usize,
            ID_PMEM if pmem_count() < MAX_PMEM_DEVS => {
                MAX_DISKS + NPMEM.fetch_add(1, Ordering::Relaxed) as usize
            }
            ID_BLK | ID_PMEM => {
                kprintln!(
                    "probe: too many virtio devices of type {}, {:#x} ignored",
                    id,
                    base
                );
                continue;
            }
            0 => continue,
            _ => {
                kprintln!("probe: virtio device type {} at {:#x} ignored", id, base);
                continue;
            }
        };
        let d = unsafe { &mut DISKS.get()[slot] };
        *d = Disk {
            base,
            irq,
            pmem: id == ID_PMEM,
            mem: QMEM.addr() + slot as u64 * 8192,
            ..NO_DISK
        };
        BASES[slot].store(base, Ordering::Relaxed);
        if irq < pins {
            apic::ioapic_route(irq, (VECTOR_BASE + slot as u64) as u8, bsp);
        }
        if d.pmem {
            let j = slot - MAX_DISKS;
            match d.init() {
                Ok(()) => kprintln!(
                    "probe: virtio-pmem {}: at {:#x} irq {}, region {:#x}+{:#x}, queue {}",
                    j,
                    base,
                    d.irq,
                    d.region.0,
                    d.region.1,
                    d.qsize
                ),
                Err(e) => kprintln!("probe: virtio-pmem {}: at {:#x} failed: {}", j, base, e),
            }
            continue;
        }
        let i = slot;
        match d.init() {
            Ok(()) => kprintln!(
                "probe: disk {}: virtio-blk at {:#x} irq {}, {} sectors{}, queue {}, features {:#x}",
                i,
                base,
                d.irq,
                d.capacity,
                if d.features & F_RO != 0 { " (read-only)" } else { "" },
                d.qsize,
                d.features
            ),
            Err(e) => kprintln!("probe: disk {}: virtio-blk at {:#x} failed: {}", i, base, e),
        }
    }
}

pub fn capacity(i: usize) -> Result<u64, Error> {
    Ok(disk(i)?.capacity)
}

pub fn read_only(i: usize) -> bool {
    disk(i).map(|d| d.features & F_RO != 0).unwrap_or(false)
}

pub fn rw(i: usize, write: bool, sector: u64, addr: u64, len: u64) -> Result<(), Error> {
    let d = disk(i)?;
    if !d.ready {
        return Err(Error::NotReady);
    }
    if len == 0 || !len.is_multiple_of(512) {
        return Err(Error::BadArgument);
    }
    match sector.checked_add(len / 512) {
        Some(end) if end <= d.capacity => {}
        _ => return Err(Error::OutOfRange),
    }
    let seg = if d.size_max >= 512 {
        d.size_max as u64
    } else {
        4 << 20
    };
    let mut segs = (d.qsize - 2) as u64;
    if d.seg_max > 0 {
        segs = segs.min(d.seg_max as u64);
    }
    let per_request = (seg * segs) & !511;
    let typ = if write { T_OUT } else { T_IN };
    let mut off = 0;
    while off < len {
        let n = per_request.min(len - off);
        d.request(typ, sector + off / 512, addr + off, n, seg)?;
        off += n;
    }
    Ok(())
}

/// Without VIRTIO_BLK_F_FLUSH the device has no write cache to flush: nothing to do.
pub fn flush(i: usize) -> Result<(), Error> {
    let d = disk(i)?;
    if !d.ready {
        return Err(Error::NotReady);
    }
    if d.features & F_FLUSH == 0 {
        return Ok(());
    }
    d.request(T_FLUSH, 0, 0, 0, 0)
}

pub fn get_id(i: usize, addr: u64) -> Result<(), Error> {
    let d = disk(i)?;
    if !d.ready {
        return Err(Error::NotReady);
    }
    d.request(T_GET_ID, 0, addr, ID_LEN, ID_LEN)
}

impl Disk {
    fn r32(&self, off: u64) -> u32 {
        mmio_read32(self.base + off)
    }

    fn w32(&self, off: u64, v: u32) {
        mmio_write32(self.base + off, v)
    }

    fn w64(&self, off: u64, v: u64) {
        self.w32(off, v as u32);
        self.w32(off + 4, (v >> 32) as u32);
    }

    /// Reset, feature negotiation and queue 0 set-up (virtio 1.x, 3.1.1).
    fn init(&mut self) -> Result<(), &'static str> {
        self.ready = false;
        let r = self.init_inner();
        if let Err(e) = r {
            self.error = e;
            self.w32(STATUS, self.r32(STATUS) | 0x80);
        }
        r
    }

    fn init_inner(&mut self) -> Result<(), &'static str> {
        if self.r32(VERSION) != 2 {
            return Err("not a virtio 1.x (version 2) virtio-mmio device");
        }
        self.w32(STATUS, 0);
        if !timer::wait_for(1000, || self.r32(STATUS) == 0) {
            return Err("device did not reset");
        }
        self.w32(STATUS, S_ACK);
        self.w32(STATUS, S_ACK | S_DRIVER);
        self.w32(DEV_FEATURES_SEL, 0);
        let lo = self.r32(DEV_FEATURES) as u64;
        self.w32(DEV_FEATURES_SEL, 1);
        let offered = lo | (self.r32(DEV_FEATURES) as u64) << 32;
        if offered & F_VERSION_1 == 0 {
            return Err("device does not offer VIRTIO_F_VERSION_1");
        }
        let wanted = if self.pmem {
            F_VERSION_1
        } else {
            F_VERSION_1 | F_SIZE_MAX | F_SEG_MAX | F_RO | F_BLK_SIZE | F_FLUSH | F_INDIRECT
        };
        self.features = offered & wanted;
        self.w32(DRV_FEATURES_SEL, 0);
        self.w32(DRV_FEATURES, self.features as u32);
        self.w32(DRV_FEATURES_SEL, 1);
        self.w32(DRV_FEATURES, (self.features >> 32) as u32);
        self.w32(STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
        if self.r32(STATUS) & S_FEATURES_OK == 0 {
            return Err("device rejected the features (FEATURES_OK not kept)");
        }
        self.w32(QUEUE_SEL, 0);
        if self.r32(QUEUE_READY) != 0 {
            return Err("queue 0 already live after reset");
        }
        let max = self.r32(QUEUE_NUM_MAX);
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
        unsafe {
            for off in [OFF_AVAIL, OFF_AVAIL + 2, OFF_USED, OFF_USED + 2] {
                core::ptr::write_volatile((self.mem + off) as *mut u16, 0);
            }
        }
        // Completions are first looked for by polling; the interrupt is asked for only
        // when a wait is about to halt (see `wait_used`). Without polling, always.
        self.set_avail_flags(quiet_flags());
        self.w32(QUEUE_NUM, q as u32);
        self.w64(QUEUE_DESC, self.mem + OFF_DESC);
        self.w64(QUEUE_AVAIL, self.mem + OFF_AVAIL);
        self.w64(QUEUE_USED, self.mem + OFF_USED);
        self.w32(QUEUE_READY, 1);
        if self.pmem {
            let rd64 =
                |off| self.r32(CONFIG + off) as u64 | (self.r32(CONFIG + off + 4) as u64) << 32;
            self.region = (rd64(0), rd64(8));
            self.w32(STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
            self.ready = true;
            return Ok(());
        }
        self.capacity = self.r32(CONFIG) as u64 | (self.r32(CONFIG + 4) as u64) << 32;
        self.size_max = if self.features & F_SIZE_MAX != 0 {
            self.r32(CONFIG + 8)
        } else {
            0
        };
        self.seg_max = if self.features & F_SEG_MAX != 0 {
            self.r32(CONFIG + 12)
        } else {
            0
        };
        self.w32(STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        self.ready = true;
        Ok(())
    }

    fn write_desc(&self, i: u16, d: Desc) {
        let p = (self.mem + OFF_DESC + (i % self.qsize) as u64 * 16) as *mut u8;
        unsafe {
            core::ptr::write_volatile(p as *mut u64, d.addr);
            core::ptr::write_volatile(p.add(8) as *mut u32, d.len);
            core::ptr::write_volatile(p.add(12) as *mut u16, d.flags);
            core::ptr::write_volatile(p.add(14) as *mut u16, d.next);
        }
    }

    /// Publishes `head` in the avail ring. x86 keeps stores in order, so a compiler fence
    /// is all the ordering the descriptor → ring → index → notify sequence needs.
    fn push_avail(&mut self, head: u16) {
        let slot = self.mem + OFF_AVAIL + 4 + (self.avail_idx % self.qsize) as u64 * 2;
        unsafe { core::ptr::write_volatile(slot as *mut u16, head) };
        compiler_fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        unsafe {
            core::ptr::write_volatile((self.mem + OFF_AVAIL + 2) as *mut u16, self.avail_idx)
        };
        compiler_fence(Ordering::SeqCst);
    }

    fn used_idx(&self) -> u16 {
        unsafe { core::ptr::read_volatile((self.mem + OFF_USED + 2) as *const u16) }
    }

    /// Takes every used entry the device has produced; returns how many.
    fn drain_used(&mut self) -> u16 {
        let idx = self.used_idx();
        let n = idx.wrapping_sub(self.used_seen);
        self.used_seen = idx;
        n
    }

    fn set_avail_flags(&self, flags: u16) {
        unsafe { core::ptr::write_volatile((self.mem + OFF_AVAIL) as *mut u16, flags) };
    }

    /// Polls the used ring with the device's interrupt suppressed for `poll_us()`, then asks
    /// for the interrupt and halts until it comes. The used index is read again after the
    /// flag changes, so a completion that raced the change is not waited for in vain.
    fn wait_used(&mut self, ms: u64) -> bool {
        let seen = self.used_seen;
        let mut done = timer::spin_for(poll_us(), || self.used_idx() != seen);
        if !done {
            self.set_avail_flags(0);
            done = timer::wait_for(ms, || self.used_idx() != seen);
            self.set_avail_flags(quiet_flags());
        }
        if done {
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        done
    }

    fn status_byte(&self, slot: u64) -> u8 {
        unsafe { core::ptr::read_volatile((self.mem + OFF_STATUS + slot) as *const u8) }
    }

    fn write_header(&self, typ: u32, sector: u64) {
        unsafe {
            let h = (self.mem + OFF_HDR) as *mut u8;
            core::ptr::write_volatile(h as *mut u32, typ);
            core::ptr::write_volatile(h.add(4) as *mut u32, 0);
            core::ptr::write_volatile(h.add(8) as *mut u64, sector);
        }
    }

    fn pmem_flush(&mut self) -> Result<(), Error> {
        let req = self.mem + OFF_HDR;
        let resp = self.mem + OFF_STATUS;
        unsafe {
            core::ptr::write_volatile(req as *mut u32, 0);
            core::ptr::write_volatile(resp as *mut u32, 0xffff_ffff);
        }
        self.write_desc(
            0,
            Desc {
                addr: req,
                len: 4,
                flags: D_NEXT,
                next: 1,
            },
        );
        self.write_desc(
            1,
            Desc {
                addr: resp,
                len: 4,
                flags: D_WRITE,
                next: 0,
            },
        );
        REQUESTS.fetch_add(1, Ordering::Relaxed);
        self.push_avail(0);
        self.w32(QUEUE_NOTIFY, 0);
        if !self.wait_used(REQUEST_TIMEOUT_MS) {
            self.ready = false;
            self.error = "request timed out";
            return Err(Error::Timeout);
        }
        match unsafe { core::ptr::read_volatile(resp as *const u32) } {
            0 => Ok(()),
            _ => Err(Error::IoErr),
        }
    }

    fn request(
        &mut self,
        typ: u32,
        sector: u64,
        addr: u64,
        len: u64,
        seg: u64,
    ) -> Result<(), Error> {
        self.write_header(typ, sector);
        unsafe { core::ptr::write_volatile((self.mem + OFF_STATUS) as *mut u8, 0xff) };
        let device_writes = if typ == T_IN || typ == T_GET_ID {
            D_WRITE
        } else {
            0
        };
        let mut n: u16 = 0;
        self.write_desc(
            0,
            Desc {
                addr: self.mem + OFF_HDR,
                len: 16,
                flags: D_NEXT,
                next: 1,
            },
        );
        n += 1;
        let mut off = 0;
        while off < len {
            let l = seg.min(len - off);
            self.write_desc(
                n,
                Desc {
                    addr: addr + off,
                    len: l as u32,
                    flags: D_NEXT | device_writes,
                    next: n + 1,
                },
            );
            n += 1;
            off += l;
        }
        self.write_desc(
            n,
            Desc {
                addr: self.mem + OFF_STATUS,
                len: 1,
                flags: D_WRITE,
                next: 0,
            },
        );
        REQUESTS.fetch_add(1, Ordering::Relaxed);
        self.push_avail(0);
        self.w32(QUEUE_NOTIFY, 0);
        if !self.wait_used(REQUEST_TIMEOUT_MS) {
            self.ready = false;
            self.error = "request timed out";
            return Err(Error::Timeout);
        }
        match self.status_byte(0) {
            0 => Ok(()),
            1 => Err(Error::IoErr),
            2 => Err(Error::Unsupported),
            _ => Err(Error::BadStatus),
        }
    }
}

pub struct CaseResult {
    pub name: &'static str,
    pub completed: u16,
    pub status: u8,
}

pub struct Hostile {
    pub results: [CaseResult; 12],
    pub cases: usize,
    pub good_read: bool,
    pub error: &'static str,
}

/// Misbehaves on purpose on disk `i` (see README, `hostile-virtio`), then resets the device
/// and checks that one ordinary read still works.
/// Placeholder address for "this case's own status byte".
const STATUS_SLOT: u64 = u64::MAX;

/// Posts one hostile chain (descriptor `next` fields relative to the case's first slot),
/// or a bare head / notify, and waits a bounded time for the used ring. Each case uses its
/// own descriptors and status byte, so a late completion of one case cannot be mistaken
/// for another's.
fn hostile_case(
    d: &mut Disk,
    h: &mut Hostile,
    name: &'static str,
    descs: &[Desc],
    head: Option<u16>,
    notify: u32,
) {
    let k = h.cases as u16;
    let first = k * 4;
    let status = d.mem + OFF_STATUS + 1 + k as u64;
    unsafe { core::ptr::write_volatile(status as *mut u8, 0xff) };
    for (j, desc) in descs.iter().enumerate() {
        let mut desc = *desc;
        if desc.flags & D_NEXT != 0 {
            desc.next = (first + desc.next) % d.qsize;
        }
        if desc.addr == STATUS_SLOT {
            desc.addr = status;
        }
        d.write_desc(first + j as u16, desc);
    }
    if let Some(head) = head {
        d.push_avail(head);
    } else if !descs.is_empty() {
        d.push_avail(first % d.qsize);
    }
    d.w32(QUEUE_NOTIFY, notify);
    let used_before = d.used_seen;
    timer::wait_for(HOSTILE_TIMEOUT_MS, || d.used_idx() != used_before);
    let completed = d.drain_used();
    h.results[h.cases] = CaseResult {
        name,
        completed,
        status: d.status_byte(1 + k as u64),
    };
    h.cases += 1;
}

pub fn hostile(i: usize, ram_end: u64, spare: u64) -> Result<Hostile, Error> {
    let d = disk(i)?;
    if !d.ready {
        return Err(Error::NotReady);
    }
    let mut h = Hostile {
        results: [const {
            CaseResult {
                name: "",
                completed: 0,
                status: 0,
            }
        }; 12],
        cases: 0,
        good_read: false,
        error: "",
    };
    const BAD: u64 = 0xffff_ffff_f000;
    let hdr = d.mem + OFF_HDR;
    let scratch = d.mem + OFF_SCRATCH;
    d.write_header(T_IN, 0);

    let st = Desc {
        addr: STATUS_SLOT,
        len: 1,
        flags: D_WRITE,
        next: 0,
    };
    let hd = Desc {
        addr: hdr,
        len: 16,
        flags: D_NEXT,
        next: 1,
    };
    let data = |addr: u64, len: u32, flags: u16| Desc {
        addr,
        len,
        flags: flags | D_NEXT,
        next: 2,
    };
    let run = hostile_case;

    run(
        d,
        &mut h,
        "data-beyond-physical",
        &[hd, data(BAD, 512, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "data-past-ram",
        &[hd, data(ram_end, 4096, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "header-beyond-physical",
        &[Desc { addr: BAD, ..hd }, data(scratch, 512, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "data-not-device-writable",
        &[hd, data(scratch, 512, 0), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "chain-loop",
        &[
            hd,
            Desc {
                addr: scratch,
                len: 512,
                flags: D_NEXT | D_WRITE,
                next: 0,
            },
        ],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "length-4g",
        &[hd, data(spare, 0xffff_ffff, D_WRITE), st],
        None,
        0,
    );
    if d.features & F_INDIRECT != 0 {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for w in 0..512u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            unsafe { core::ptr::write_volatile((scratch + w * 8) as *mut u64, x | 1 << 47) };
        }
        run(
            d,
            &mut h,
            "indirect-garbage",
            &[Desc {
                addr: scratch,
                len: 4096,
                flags: D_INDIRECT,
                next: 0,
            }],
            None,
            0,
        );
        run(
            d,
            &mut h,
            "indirect-beyond-physical",
            &[Desc {
                addr: BAD,
                len: 256,
                flags: D_INDIRECT,
                next: 0,
            }],
            None,
            0,
        );
    }
    run(d, &mut h, "head-out-of-range", &[], Some(d.qsize + 3), 0);
    run(d, &mut h, "notify-unset-queue-7", &[], None, 7);
    // The avail index far ahead of what was posted: the device would find stale heads.
    d.avail_idx = d.avail_idx.wrapping_add(d.qsize * 2 + 5);
    unsafe { core::ptr::write_volatile((d.mem + OFF_AVAIL + 2) as *mut u16, d.avail_idx) };
    run(d, &mut h, "avail-index-jump", &[], None, 0);

    match d.init() {
        Ok(()) => {
            h.good_read = d.request(T_IN, 0, scratch, 512, 512).is_ok();
            if !h.good_read {
                h.error = "read of sector 0 after reset failed";
            }
        }
        Err(e) => h.error = e,
    }
    Ok(h)
}
