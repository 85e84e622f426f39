//! Finds the virtio-mmio devices named on the command line and keeps the table of them.
//!
//! Block devices (id 2) are disks 0, 1, ... in command-line order, device slots
//! `0..MAX_DISKS`; virtio-pmem devices (id 27) take the next `MAX_PMEM_DEVS` slots (their
//! regions are announced by `pmem.rs`); the first virtio-rng device (id 4) the last one,
//! `RNG_SLOT`. A device's interrupt vector is `VECTOR_BASE + slot`.
//! The first virtio-net device (id 1) and the first virtio-vsock device (id 19) are kept
//! apart (`net.rs`): user tasks drive them.

mod block;
mod hostile;
pub mod net;
mod pmem;
mod rng;
mod transport;

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

pub use block::{capacity, flush, get_id, read_only, rw, ID_LEN};
pub use hostile::hostile;
pub use pmem::{pmem_flush, pmem_region};
pub use rng::rng_read;

use crate::arch::{mmio_read32, mmio_write32};
use crate::bootinfo::BootInfo;
use crate::global::Global;
use crate::{apic, kprintln};
use transport::{Device, Kind, Reg, NO_DEVICE};

pub const MAX_DISKS: usize = 8;
pub const MAX_PMEM_DEVS: usize = 4;
/// The one virtio-rng device's slot.
pub const RNG_SLOT: usize = MAX_DISKS + MAX_PMEM_DEVS;
pub const MAX_DEVS: usize = RNG_SLOT + 1;
const ID_BLK: u32 = 2;
const ID_RNG: u32 = 4;
const ID_PMEM: u32 = 27;
const ID_NET: u32 = 1;
const ID_VSOCK: u32 = 19;
pub const VECTOR_BASE: u64 = 0x30;
/// The virtio-net device's interrupt vector, after the storage devices' ones.
pub const NET_VECTOR: u64 = VECTOR_BASE + MAX_DEVS as u64;
pub const VSOCK_VECTOR: u64 = NET_VECTOR + 1;

static DEVICES: Global<[Device; MAX_DEVS]> = Global::new([NO_DEVICE; MAX_DEVS]);
static NDISKS: AtomicU32 = AtomicU32::new(0);
static NPMEM: AtomicU32 = AtomicU32::new(0);
/// Whether `RNG_SLOT` holds a device.
static HAS_RNG: AtomicBool = AtomicBool::new(false);
/// MMIO bases for the interrupt handler, which must not touch `DEVICES`.
static BASES: [AtomicU64; MAX_DEVS] = [const { AtomicU64::new(0) }; MAX_DEVS];
static IRQS: [AtomicU32; MAX_DEVS] = [const { AtomicU32::new(0) }; MAX_DEVS];
/// Requests posted to any device since boot (counted for the storage benchmarks).
pub static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// The device in `slot` (`0..MAX_DEVS`).
fn device(slot: usize) -> &'static mut Device {
    // SAFETY: the table is touched only on the BSP's kernel path (the probe at boot, then the
    // system calls of the one running task, one at a time); the interrupt handler reads
    // `BASES` and `IRQS` instead, and no caller keeps the reference past its own call.
    unsafe { &mut DEVICES.get()[slot] }
}

/// Interrupts from all virtio devices since boot.
pub fn total_irqs() -> u64 {
    IRQS.iter().map(|c| c.load(Ordering::Relaxed) as u64).sum()
}

pub fn count() -> usize {
    NDISKS.load(Ordering::Relaxed) as usize
}

pub fn pmem_count() -> usize {
    NPMEM.load(Ordering::Relaxed) as usize
}

pub fn irq(i: usize) {
    let base = BASES[i].load(Ordering::Relaxed);
    if base != 0 {
        let s = mmio_read32(Reg::InterruptStatus.at(base));
        mmio_write32(Reg::InterruptAck.at(base), s);
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

/// Finds the devices announced on the command line, sets the storage devices up and routes
/// their interrupts (and the virtio-net device's, set up later by its task) to the BSP.
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
        if size < 0x200 || mmio_read32(Reg::Magic.at(base)) != 0x7472_6976 {
            kprintln!("probe: no virtio-mmio device at {:#x}", base);
            continue;
        }
        let id = mmio_read32(Reg::DeviceId.at(base));
        let slot = match id {
            ID_BLK if count() < MAX_DISKS => NDISKS.fetch_add(1, Ordering::Relaxed) as usize,
            ID_PMEM if pmem_count() < MAX_PMEM_DEVS => {
                MAX_DISKS + NPMEM.fetch_add(1, Ordering::Relaxed) as usize
            }
            ID_RNG if !HAS_RNG.swap(true, Ordering::Relaxed) => RNG_SLOT,
            ID_BLK | ID_PMEM | ID_RNG => {
                kprintln!(
                    "probe: too many virtio devices of type {}, {:#x} ignored",
                    id,
                    base
                );
                continue;
            }
            ID_NET | ID_VSOCK => {
                let (kind, vector, what) = if id == ID_NET {
                    (crate::abi::DEV_NET, NET_VECTOR, "virtio-net")
                } else {
                    (crate::abi::DEV_VSOCK, VSOCK_VECTOR, "virtio-vsock")
                };
                if net::found(kind as usize, base) {
                    if irq < pins {
                        apic::ioapic_route(irq, vector as u8, bsp);
                    }
                    kprintln!("probe: {} at {:#x} irq {}", what, base, irq);
                } else {
                    kprintln!("probe: another {} at {:#x} ignored", what, base);
                }
                continue;
            }
            0 => continue,
            _ => {
                kprintln!("probe: virtio device type {} at {:#x} ignored", id, base);
                continue;
            }
        };
        let kind = match id {
            ID_PMEM => Kind::Pmem,
            ID_RNG => Kind::Rng,
            _ => Kind::Blk,
        };
        let d = device(slot);
        *d = Device::new(base, irq, kind, slot);
        BASES[slot].store(base, Ordering::Relaxed);
        if irq < pins {
            apic::ioapic_route(irq, (VECTOR_BASE + slot as u64) as u8, bsp);
        }
        if d.kind == Kind::Rng {
            match d.init() {
                Ok(()) => kprintln!(
                    "probe: virtio-rng at {:#x} irq {}, queue {}",
                    base,
                    d.irq,
                    d.qsize
                ),
                Err(e) => kprintln!("probe: virtio-rng at {:#x} failed: {}", base, e),
            }
            continue;
        }
        if d.kind == Kind::Pmem {
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
                if d.features & block::F_RO != 0 { " (read-only)" } else { "" },
                d.qsize,
                d.features
            ),
            Err(e) => kprintln!("probe: disk {}: virtio-blk at {:#x} failed: {}", i, base, e),
        }
    }
}
