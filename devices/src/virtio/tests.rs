//! Transport and virtio-blk driven the way a guest driver would, over mock guest memory.

use super::block::{Block, BlockConfig, BlockError, CacheMode, MAX_CHAIN_DESCRIPTORS};
use super::mmio::{MmioTransport, MMIO_MAGIC, MMIO_VENDOR_ID};
use super::VirtioStats;
use crate::irq::test_util::CountingIrq;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::Arc;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::*;
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT,
    VRING_DESC_F_WRITE,
};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::split::VirtqUsedElem;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::DescriptorTable;
use vm_device::bus::MmioAddress;
use vm_device::MutDeviceMmio;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

const MEM_SIZE: usize = 0x100_0000;
const RING: u64 = 0x1000;
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0xf0_0000;
const INDIRECT: u64 = 0xc0_0000;
const QSIZE: u16 = 16;
const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;
const DISK_SECTORS: u64 = 64;

/// A temp file in /var/tmp (not tmpfs, so O_DIRECT works) filled with a known pattern.
fn disk_file(sectors: u64) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
    let data: Vec<u8> = (0..sectors * 512).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&data).unwrap();
    f.flush().unwrap();
    f
}

fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (offset..offset + len as u64)
        .map(|i| (i * 7 % 251) as u8)
        .collect()
}

fn cfg(path: PathBuf, readonly: bool, cache: CacheMode) -> BlockConfig {
    BlockConfig {
        path,
        readonly,
        cache,
        id: "musubi-disk0".to_string(),
    }
}

struct Driver {
    mem: GuestMemoryMmap,
    t: MmioTransport,
    irq: Arc<CountingIrq>,
    avail_idx: u16,
    used_seen: u16,
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
}

impl Driver {
    fn new(block: Block) -> Driver {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let irq = Arc::new(CountingIrq::default());
        let t = MmioTransport::new(Box::new(block), mem.clone(), irq.clone());
        // Rings a page apart. (MockSplitQueue's own layout places the used ring over the
        // second half of the avail ring, so only its descriptor table helper is used.)
        let (desc, avail, used) = (
            GuestAddress(RING),
            GuestAddress(RING + 0x1000),
            GuestAddress(RING + 0x2000),
        );
        Driver {
            mem,
            t,
            irq,
            avail_idx: 0,
            used_seen: 0,
            desc,
            avail,
            used,
        }
    }

    fn with_disk(path: PathBuf, readonly: bool, cache: CacheMode) -> Driver {
        let mut d = Driver::new(Block::new(cfg(path, readonly, cache)).unwrap());
        d.bring_up(u32::from(QSIZE));
        d
    }

    fn table(&self) -> DescriptorTable<'_, GuestMemoryMmap> {
        DescriptorTable::new(&self.mem, self.desc, QSIZE)
    }

    fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, self.avail.unchecked_add(2))
            .unwrap();
    }

    fn read(&mut self, off: u32) -> u32 {
        let mut b = [0u8; 4];
        self.t
            .mmio_read(MmioAddress(0xd000_0000), off.into(), &mut b);
        u32::from_le_bytes(b)
    }

    fn write(&mut self, off: u32, v: u32) {
        self.t
            .mmio_write(MmioAddress(0xd000_0000), off.into(), &v.to_le_bytes());
    }

    fn negotiate(&mut self, drop_bits: u64) -> bool {
        self.write(VIRTIO_MMIO_STATUS, 0);
        self.write(VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        self.write(
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        let mut features = 0u64;
        for sel in 0..2u32 {
            self.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
            features |= u64::from(self.read(VIRTIO_MMIO_DEVICE_FEATURES)) << (32 * sel);
        }
        features &= !drop_bits;
        for sel in 0..2u32 {
            self.write(VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
            self.write(VIRTIO_MMIO_DRIVER_FEATURES, (features >> (32 * sel)) as u32);
        }
        let s = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        self.write(VIRTIO_MMIO_STATUS, s);
        self.read(VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK != 0
    }

    fn setup_queue(&mut self, size: u32) {
        let (desc, avail, used) = (self.desc.0, self.avail.0, self.used.0);
        self.write(VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(self.read(VIRTIO_MMIO_QUEUE_READY), 0);
        self.write(VIRTIO_MMIO_QUEUE_NUM, size);
        self.write(VIRTIO_MMIO_QUEUE_DESC_LOW, desc as u32);
        self.write(VIRTIO_MMIO_QUEUE_DESC_HIGH, (desc >> 32) as u32);
        self.write(VIRTIO_MMIO_QUEUE_AVAIL_LOW, avail as u32);
        self.write(VIRTIO_MMIO_QUEUE_AVAIL_HIGH, (avail >> 32) as u32);
        self.write(VIRTIO_MMIO_QUEUE_USED_LOW, used as u32);
        self.write(VIRTIO_MMIO_QUEUE_USED_HIGH, (used >> 32) as u32);
        self.write(VIRTIO_MMIO_QUEUE_READY, 1);
    }

    fn driver_ok(&mut self) {
        let s = self.read(VIRTIO_MMIO_STATUS);
        self.write(VIRTIO_MMIO_STATUS, s | VIRTIO_CONFIG_S_DRIVER_OK);
    }

    fn bring_up(&mut self, size: u32) {
        assert!(self.negotiate(0));
        self.setup_queue(size);
        assert_eq!(self.read(VIRTIO_MMIO_QUEUE_READY), 1);
        self.driver_ok();
        assert_eq!(self.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    }

    fn status(&mut self) -> u32 {
        self.read(VIRTIO_MMIO_STATUS)
    }

    /// Writes raw descriptors at table index `first` and publishes `head`.
    fn put_descs(&mut self, first: u16, descs: &[(u64, u32, u16, u16)]) {
        let table = self.table();
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            table
                .store(
                    first + i as u16,
                    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next)),
                )
                .unwrap();
        }
    }

    fn publish(&mut self, head: u16) {
        let slot = self
            .avail
            .unchecked_add(4 + 2 * u64::from(self.avail_idx % QSIZE));
        self.mem.write_obj(head, slot).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// Puts a chain at descriptor 0 (linked in order) and publishes it.
    fn chain(&mut self, descs: &[(u64, u32, u16)]) {
        let linked: Vec<_> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, f))| {
                if i + 1 < descs.len() {
                    (a, l, f | N, i as u16 + 1)
                } else {
                    (a, l, f & !N, 0)
                }
            })
            .collect();
        self.put_descs(0, &linked);
        self.publish(0);
    }

    fn notify(&mut self) {
        self.write(VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(self.used.unchecked_add(2)).unwrap()
    }

    /// The next used element, which must exist.
    fn next_used(&mut self) -> (u32, u32) {
        assert_ne!(self.used_idx(), self.used_seen, "no used entry");
        let e: VirtqUsedElem = self
            .mem
            .read_obj(
                self.used
                    .unchecked_add(4 + 8 * u64::from(self.used_seen % QSIZE)),
            )
            .unwrap();
        self.used_seen = self.used_seen.wrapping_add(1);
        (e.id(), e.len())
    }

    fn header(&self, ty: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&ty.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    fn status_byte(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    /// Submits a standard three-part request and returns (status, used len).
    fn request(&mut self, ty: u32, sector: u64, data_len: u32, data_writable: bool) -> (u8, u32) {
        self.header(ty, sector);
        let mut descs = vec![(HDR, 16, 0)];
        if data_len > 0 {
            descs.push((DATA, data_len, if data_writable { W } else { 0 }));
        }
        descs.push((STATUS, 1, W));
        self.chain(&descs);
        self.notify();
        let (id, len) = self.next_used();
        assert_eq!(id, 0);
        (self.status_byte(), len)
    }

    fn guest_data(&self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(DATA)).unwrap();
        v
    }

    fn alive(&mut self) {
        // A well-formed request still works after whatever the test did.
        let (s, _) = self.request(VIRTIO_BLK_T_GET_ID, 0, 20, true);
        assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    }
}

fn file_bytes(f: &tempfile::NamedTempFile, off: u64, len: usize) -> Vec<u8> {
    let mut h = std::fs::File::open(f.path()).unwrap();
    h.seek(SeekFrom::Start(off)).unwrap();
    let mut v = vec![0u8; len];
    h.read_exact(&mut v).unwrap();
    v
}

// ---- transport registers ----

#[test]
fn identity_registers() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
    assert_eq!(d.read(VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC);
    assert_eq!(d.read(VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
    assert_eq!(d.read(VIRTIO_MMIO_VERSION), 2);
    assert_eq!(d.read(VIRTIO_MMIO_DEVICE_ID), 2);
    assert_eq!(d.read(VIRTIO_MMIO_VENDOR_ID), MMIO_VENDOR_ID);
    d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
    assert_eq!(
        d.read(VIRTIO_MMIO_DEVICE_FEATURES),
        1,
        "VERSION_1 is bit 32"
    );
    d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    let lo = d.read(VIRTIO_MMIO_DEVICE_FEATURES);
    assert_ne!(lo & (1 << VIRTIO_BLK_F_FLUSH), 0);
    assert_eq!(lo & (1 << VIRTIO_BLK_F_RO), 0);
    assert_ne!(lo & (1 << VIRTIO_RING_F_INDIRECT_DESC), 0);
    assert_eq!(lo & (1 << VIRTIO_RING_F_EVENT_IDX), 0);
    d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
    assert_eq!(d.read(VIRTIO_MMIO_DEVICE_FEATURES), 0);
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), 256);
    d.write(VIRTIO_MMIO_QUEUE_SEL, 1);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), 0, "only one queue");
    assert_eq!(d.read(VIRTIO_MMIO_CONFIG_GENERATION), 0);
}

#[test]
fn read_only_registers_ignore_writes() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.write(VIRTIO_MMIO_MAGIC_VALUE, 0);
    d.write(VIRTIO_MMIO_VERSION, 1);
    d.write(VIRTIO_MMIO_DEVICE_ID, 9);
    d.write(VIRTIO_MMIO_INTERRUPT_STATUS, 3);
    d.write(VIRTIO_MMIO_QUEUE_NUM_MAX, 4);
    d.write(0x400, 1);
    assert_eq!(d.read(VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC);
    assert_eq!(d.read(VIRTIO_MMIO_VERSION), 2);
    assert_eq!(d.read(VIRTIO_MMIO_DEVICE_ID), 2);
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), 256);
    // Config space is read-only for block.
    d.t.mmio_write(MmioAddress(0), 0x100, &[0xff; 8]);
    let mut cap = [0u8; 8];
    d.t.mmio_read(MmioAddress(0), 0x100, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), DISK_SECTORS);
    // Narrow or unaligned register accesses read zero and change nothing.
    let mut b = [0xaau8; 2];
    d.t.mmio_read(MmioAddress(0), 0, &mut b);
    assert_eq!(b, [0, 0]);
    d.t.mmio_write(MmioAddress(0), u64::from(VIRTIO_MMIO_STATUS), &[0]);
    assert_ne!(d.status() & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    d.alive();
}

#[test]
fn config_space_any_width_and_out_of_range() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
    let mut full = [0u8; 8];
    d.t.mmio_read(MmioAddress(0), 0x100, &mut full);
    assert_eq!(u64::from_le_bytes(full), DISK_SECTORS);
    for width in [1usize, 2, 4] {
        for off in (0..8).step_by(width) {
            let mut b = vec![0u8; width];
            d.t.mmio_read(MmioAddress(0), 0x100 + off as u64, &mut b);
            assert_eq!(b, full[off..off + width]);
        }
    }
    let mut seg = [0u8; 4];
    d.t.mmio_read(MmioAddress(0), 0x100 + 12, &mut seg);
    assert_eq!(u32::from_le_bytes(seg), 254);
    let mut bs = [0u8; 4];
    d.t.mmio_read(MmioAddress(0), 0x100 + 20, &mut bs);
    assert_eq!(u32::from_le_bytes(bs), 512);
    // Straddling the end, past the end, past the window: zeros, no panic.
    for off in [0x13c_u64, 0x140, 0x800, 0xffc, 0x1000, u64::MAX - 8] {
        let mut b = [0xaau8; 8];
        d.t.mmio_read(MmioAddress(0), off, &mut b);
        assert_eq!(b, [0; 8], "offset {off:#x}");
    }
}

#[test]
fn features_without_version_1_are_refused() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
    assert!(!d.negotiate(1 << VIRTIO_F_VERSION_1));
    // The device stays unusable: DRIVER_OK is not taken and notifies do nothing.
    d.setup_queue(u32::from(QSIZE));
    d.driver_ok();
    assert_eq!(d.status() & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.chain(&[(HDR, 16, 0), (DATA, 20, W), (STATUS, 1, W)]);
    d.notify();
    assert_eq!(d.used_idx(), 0);
    // A driver that asks for a feature never offered is refused as well.
    assert!(d.negotiate(0));
    d.write(VIRTIO_MMIO_STATUS, 0);
    d.write(
        VIRTIO_MMIO_STATUS,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
    );
    d.write(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    d.write(VIRTIO_MMIO_DRIVER_FEATURES, 1);
    d.write(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    d.write(VIRTIO_MMIO_DRIVER_FEATURES, 1 << 31);
    d.write(
        VIRTIO_MMIO_STATUS,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
    );
    assert_eq!(d.status() & VIRTIO_CONFIG_S_FEATURES_OK, 0);
}

#[test]
fn reset_clears_device_state() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.alive();
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 1);
    d.write(VIRTIO_MMIO_INTERRUPT_ACK, 1);
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    d.write(VIRTIO_MMIO_STATUS, 0);
    assert_eq!(d.status(), 0);
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    // Bring it up again on fresh rings.
    d.mem
        .write_slice(&[0u8; 0x3000], GuestAddress(RING))
        .unwrap();
    d.avail_idx = 0;
    d.used_seen = 0;
    d.bring_up(u32::from(QSIZE));
    d.alive();
}

#[test]
fn bad_queue_sizes_are_refused() {
    let f = disk_file(DISK_SECTORS);
    for size in [0u32, 3, 12, 512, 65536, u32::MAX] {
        let mut d =
            Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
        assert!(d.negotiate(0));
        d.setup_queue(size);
        assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0, "size {size}");
        assert_ne!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0, "size {size}");
        d.driver_ok();
        d.header(VIRTIO_BLK_T_GET_ID, 0);
        d.chain(&[(HDR, 16, 0), (DATA, 20, W), (STATUS, 1, W)]);
        d.notify();
        assert_eq!(d.used_idx(), 0);
        // Reset recovers.
        d.bring_up(u32::from(QSIZE));
        d.alive();
    }
}

#[test]
fn rings_outside_memory_are_refused() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
    assert!(d.negotiate(0));
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    d.write(VIRTIO_MMIO_QUEUE_NUM, 16);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, 0);
    d.write(VIRTIO_MMIO_QUEUE_DESC_HIGH, 0x10);
    d.write(VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x3000);
    d.write(VIRTIO_MMIO_QUEUE_USED_LOW, (MEM_SIZE - 8) as u32);
    d.write(VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    assert_ne!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    // Misaligned descriptor table.
    assert!(d.negotiate(0));
    d.setup_queue(16);
    d.write(VIRTIO_MMIO_QUEUE_READY, 0);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, RING as u32 + 8);
    d.write(VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    assert_ne!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
}

#[test]
fn notify_of_missing_or_unready_queue_is_ignored() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap());
    assert!(d.negotiate(0));
    d.driver_ok();
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.chain(&[(HDR, 16, 0), (DATA, 20, W), (STATUS, 1, W)]);
    for q in [0u32, 1, 7, 0xffff, 0x1_0000, u32::MAX] {
        d.write(VIRTIO_MMIO_QUEUE_NOTIFY, q);
    }
    d.t.process_queue(7);
    assert_eq!(d.used_idx(), 0);
    assert_eq!(d.irq.count(), 0);
    assert_eq!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    // Once the queue is set up the same request is served.
    d.avail_idx = 0;
    d.bring_up(u32::from(QSIZE));
    d.alive();
}

#[test]
fn queue_registers_locked_while_ready() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.write(VIRTIO_MMIO_QUEUE_NUM, 3);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, 0xdead_0000);
    d.alive();
}

// ---- block good paths ----

#[test]
fn read_returns_file_data() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let (s, len) = d.request(VIRTIO_BLK_T_IN, 3, 4096, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert_eq!(len, 4097);
    assert_eq!(d.guest_data(4096), pattern(3 * 512, 4096));
    assert_eq!(d.irq.count(), 1);
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 1);
    let st = d.t.stats();
    assert_eq!(
        st,
        VirtioStats {
            requests: 1,
            bytes_read: 4096,
            bytes_written: 0,
            flushes: 0,
            errors: 0,
            interrupts: 1,
        }
    );
}

#[test]
fn read_scattered_over_several_descriptors() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_IN, 1);
    d.chain(&[
        (HDR, 16, 0),
        (DATA + 0x5000, 512, W),
        (DATA, 1024, W),
        (STATUS, 1, W),
    ]);
    d.notify();
    assert_eq!(d.next_used(), (0, 1537));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_OK as u8);
    let mut a = vec![0u8; 512];
    d.mem
        .read_slice(&mut a, GuestAddress(DATA + 0x5000))
        .unwrap();
    assert_eq!(a, pattern(512, 512));
    assert_eq!(d.guest_data(1024), pattern(1024, 1024));
}

#[test]
fn no_interrupt_flag_suppresses_the_completion_interrupt() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    // VIRTQ_AVAIL_F_NO_INTERRUPT: a polling driver asks for no interrupt.
    d.mem.write_obj(1u16, d.avail).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 0, 512, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert_eq!(d.irq.count(), 0);
    d.mem.write_obj(0u16, d.avail).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 0, 512, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert_eq!(d.irq.count(), 1);
}

#[test]
fn read_into_device_readable_data_is_refused() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.mem.write_slice(&[0xaa; 512], GuestAddress(DATA)).unwrap();
    d.header(VIRTIO_BLK_T_IN, 1);
    d.chain(&[(HDR, 16, 0), (DATA, 512, 0), (STATUS, 1, W)]);
    d.notify();
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(
        d.guest_data(512),
        vec![0xaa; 512],
        "the device wrote into a read-only buffer"
    );
}

#[test]
fn write_with_device_writable_data_is_refused() {
    let f = disk_file(DISK_SECTORS);
    let before = std::fs::read(f.path()).unwrap();
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_OUT, 1);
    d.chain(&[(HDR, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);
    d.notify();
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(std::fs::read(f.path()).unwrap(), before);
}

#[test]
fn header_and_status_in_one_odd_framing() {
    // The spec lets drivers frame requests any way; split the header over two descriptors
    // and put the status at the end of the data buffer.
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_IN, 2);
    d.chain(&[(HDR, 4, 0), (HDR + 4, 12, 0), (DATA, 513, W)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 513));
    assert_eq!(d.guest_data(512), pattern(1024, 512));
    let s: u8 = d.mem.read_obj(GuestAddress(DATA + 512)).unwrap();
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
}

#[test]
fn write_reaches_file_and_flush() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let data: Vec<u8> = (0..2048u32).map(|i| (i % 13) as u8 + 100).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let (s, len) = d.request(VIRTIO_BLK_T_OUT, 5, 2048, false);
    assert_eq!((s, len), (VIRTIO_BLK_S_OK as u8, 1));
    // Visible in the file as soon as the request completes.
    assert_eq!(file_bytes(&f, 5 * 512, 2048), data);
    assert_eq!(file_bytes(&f, 4 * 512, 512), pattern(4 * 512, 512));
    let (s, len) = d.request(VIRTIO_BLK_T_FLUSH, 0, 0, false);
    assert_eq!((s, len), (VIRTIO_BLK_S_OK as u8, 1));
    d.t.flush().unwrap();
    let st = d.t.stats();
    assert_eq!(st.bytes_written, 2048);
    assert_eq!(st.flushes, 1);
    assert_eq!(st.requests, 2);
    assert_eq!(st.interrupts, 2);
}

#[test]
fn get_id_is_nul_padded() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.mem.write_slice(&[0xaa; 20], GuestAddress(DATA)).unwrap();
    let (s, len) = d.request(VIRTIO_BLK_T_GET_ID, 0, 20, true);
    assert_eq!((s, len), (VIRTIO_BLK_S_OK as u8, 21));
    let mut want = [0u8; 20];
    want[..12].copy_from_slice(b"musubi-disk0");
    assert_eq!(d.guest_data(20), want);
}

#[test]
fn id_longer_than_20_bytes_is_rejected() {
    let f = disk_file(DISK_SECTORS);
    let mut c = cfg(f.path().into(), false, CacheMode::Writeback);
    c.id = "x".repeat(21);
    let e = Block::new(c).err().unwrap();
    assert!(matches!(e, BlockError::IdTooLong { .. }));
}

#[test]
fn unsupported_request_type() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    for ty in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_SCSI_CMD, 0xdead_beef] {
        let (s, len) = d.request(ty, 0, 512, true);
        assert_eq!((s, len), (VIRTIO_BLK_S_UNSUPP as u8, 1), "type {ty}");
    }
    assert_eq!(d.t.stats().errors, 3);
}

#[test]
fn read_only_disk() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), true, CacheMode::Writeback);
    d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    assert_ne!(
        d.read(VIRTIO_MMIO_DEVICE_FEATURES) & (1 << VIRTIO_BLK_F_RO),
        0
    );
    d.mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_OUT, 0, 512, false);
    assert_eq!(s, VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(file_bytes(&f, 0, 512), pattern(0, 512));
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 0, 512, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    let (s, _) = d.request(VIRTIO_BLK_T_FLUSH, 0, 0, false);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    d.t.flush().unwrap();
}

#[test]
fn capacity_rounds_down_to_sectors() {
    let mut f = disk_file(10);
    f.write_all(&[1; 100]).unwrap();
    f.flush().unwrap();
    let b = Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap();
    assert_eq!(b.capacity(), 10);
    let mut d = Driver::new(b);
    d.bring_up(u32::from(QSIZE));
    let mut cap = [0u8; 8];
    d.t.mmio_read(MmioAddress(0), 0x100, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 10);
    // The partial sector at the end is not addressable.
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 9, 1024, true);
    assert_eq!(s, VIRTIO_BLK_S_IOERR as u8);
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 9, 512, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
}

#[test]
fn out_of_range_sectors() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    for (sector, len) in [
        (DISK_SECTORS, 512),
        (DISK_SECTORS - 1, 1024),
        (u64::MAX, 512),
        (u64::MAX / 512, 512),
        (u64::MAX / 512 + 1, 0),
    ] {
        let (s, _) = d.request(VIRTIO_BLK_T_IN, sector, len, true);
        assert_eq!(s, VIRTIO_BLK_S_IOERR as u8, "sector {sector} len {len}");
        let (s, _) = d.request(VIRTIO_BLK_T_OUT, sector, len, false);
        assert_eq!(s, VIRTIO_BLK_S_IOERR as u8, "sector {sector} len {len}");
    }
    assert_eq!(
        std::fs::metadata(f.path()).unwrap().len(),
        DISK_SECTORS * 512
    );
}

#[test]
fn data_not_a_sector_multiple() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 0, 100, true);
    assert_eq!(s, VIRTIO_BLK_S_IOERR as u8);
    let (s, _) = d.request(VIRTIO_BLK_T_OUT, 0, 513, false);
    assert_eq!(s, VIRTIO_BLK_S_IOERR as u8);
}

#[test]
fn open_errors_name_the_file() {
    let missing = PathBuf::from("/var/tmp/musubi-no-such-disk.img");
    let e = Block::new(cfg(missing, false, CacheMode::Writeback))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/var/tmp/musubi-no-such-disk.img"), "{e}");
    assert!(e.contains("no such file"), "{e}");
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let e = Block::new(cfg(dir.path().into(), true, CacheMode::Writeback))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&dir.path().display().to_string()), "{e}");
}

// ---- cache=none ----

#[test]
fn direct_io_round_trip() {
    let f = disk_file(DISK_SECTORS);
    let b = Block::new(cfg(f.path().into(), false, CacheMode::None)).unwrap();
    let bs = b.block_size();
    assert!(bs == 512 || bs == 4096);
    let mut d = Driver::new(b);
    d.bring_up(u32::from(QSIZE));
    // Aligned and unaligned (to the host block) reads, through the bounce buffer.
    for (sector, len) in [(0u64, 4096u32), (1, 512), (3, 5120), (7, 1536)] {
        let (s, l) = d.request(VIRTIO_BLK_T_IN, sector, len, true);
        assert_eq!((s, l), (VIRTIO_BLK_S_OK as u8, len + 1));
        assert_eq!(
            d.guest_data(len as usize),
            pattern(sector * 512, len as usize)
        );
    }
    // Unaligned writes keep the neighbouring bytes of the host blocks they touch.
    let data: Vec<u8> = (0..1536u32).map(|i| (i % 17) as u8 + 1).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_OUT, 9, 1536, false);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert_eq!(file_bytes(&f, 9 * 512, 1536), data);
    assert_eq!(file_bytes(&f, 0, 9 * 512), pattern(0, 9 * 512));
    assert_eq!(file_bytes(&f, 12 * 512, 4096), pattern(12 * 512, 4096));
    // A single sector inside one host block.
    d.mem.write_slice(&[0x77; 512], GuestAddress(DATA)).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_OUT, 33, 512, false);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert_eq!(file_bytes(&f, 33 * 512, 512), vec![0x77; 512]);
    assert_eq!(file_bytes(&f, 32 * 512, 512), pattern(32 * 512, 512));
    assert_eq!(file_bytes(&f, 34 * 512, 512), pattern(34 * 512, 512));
    let (s, _) = d.request(VIRTIO_BLK_T_FLUSH, 0, 0, false);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    d.t.flush().unwrap();
}

#[test]
fn direct_io_larger_than_bounce_buffer() {
    // 3 MiB requests cross the 1 MiB bounce buffer several times.
    let sectors = 8192;
    let f = disk_file(sectors);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::None);
    let len = 3 << 20;
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 1, len, true);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert!(d.guest_data(len as usize) == pattern(512, len as usize));
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let (s, _) = d.request(VIRTIO_BLK_T_OUT, 3, len, false);
    assert_eq!(s, VIRTIO_BLK_S_OK as u8);
    assert!(file_bytes(&f, 3 * 512, len as usize) == data);
    assert_eq!(file_bytes(&f, 0, 3 * 512), pattern(0, 3 * 512));
}

#[test]
fn direct_io_on_tmpfs_is_explained() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        return;
    }
    let f = tempfile::NamedTempFile::new_in(shm).unwrap();
    f.as_file().set_len(4096).unwrap();
    match Block::new(cfg(f.path().into(), false, CacheMode::None)) {
        Err(e @ BlockError::DirectIoUnsupported { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&f.path().display().to_string()), "{msg}");
            assert!(msg.contains("O_DIRECT"), "{msg}");
            assert!(msg.contains("tmpfs"), "{msg}");
        }
        Err(e) => panic!("unexpected error {e}"),
        // Not tmpfs here, or a kernel whose tmpfs accepts O_DIRECT (6.6+): nothing to check.
        Ok(_) => {}
    }
}

#[test]
fn direct_io_rejects_unaligned_file_length() {
    let mut f = disk_file(8);
    f.write_all(&[0; 100]).unwrap();
    f.flush().unwrap();
    let e = Block::new(cfg(f.path().into(), false, CacheMode::None))
        .err()
        .unwrap();
    assert!(matches!(e, BlockError::UnalignedLength { .. }), "{e}");
    assert!(e.to_string().contains(&f.path().display().to_string()));
}

// ---- hostile driver ----

#[test]
fn data_outside_guest_memory() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    for (addr, len, flags) in [
        (MEM_SIZE as u64 - 256, 512, W),
        (MEM_SIZE as u64 - 256, 512, 0),
        (0x1_0000_0000, 512, W),
        (u64::MAX - 100, 512, W),
    ] {
        d.header(VIRTIO_BLK_T_IN, 0);
        d.chain(&[(HDR, 16, 0), (addr, len, flags), (STATUS, 1, W)]);
        d.notify();
        assert_eq!(d.next_used(), (0, 1), "{addr:#x} {len:#x}");
        assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    }
    // 4 GiB descriptors: the chain's byte count overflows, so the chain is cut there and
    // the request is either failed or, with no status byte left, returned empty.
    for flags in [W, 0] {
        d.header(VIRTIO_BLK_T_IN, 0);
        d.chain(&[(HDR, 16, 0), (DATA, 0xffff_ffff, flags), (STATUS, 1, W)]);
        d.notify();
        let (id, len) = d.next_used();
        assert_eq!(id, 0);
        assert!(len == 0 || (len == 1 && d.status_byte() == VIRTIO_BLK_S_IOERR as u8));
        assert_ne!(d.status_byte(), VIRTIO_BLK_S_OK as u8);
    }
    // A header outside memory.
    d.chain(&[(u64::MAX - 7, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);
    d.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    d.notify();
    assert_eq!(d.next_used(), (0, 1));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    d.alive();
}

#[test]
fn status_outside_memory_or_missing() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_IN, 0);
    // Status byte beyond the end of memory: nothing can be reported, used len 0.
    d.chain(&[(HDR, 16, 0), (DATA, 512, W), (MEM_SIZE as u64 + 4, 1, W)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    // No writable descriptor at all.
    d.chain(&[(HDR, 16, 0), (DATA, 512, 0)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    // Zero-length writable descriptor only.
    d.chain(&[(HDR, 16, 0), (STATUS, 0, W)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    // A readable descriptor after a writable one (wrong order): failed, not served.
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.chain(&[(STATUS, 1, W), (HDR, 16, 0)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 1));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.chain(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, W), (HDR, 16, 0)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 1));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    // Short header.
    d.header(VIRTIO_BLK_T_IN, 0);
    d.chain(&[(HDR, 8, 0), (STATUS, 1, W)]);
    d.notify();
    assert_eq!(d.next_used(), (0, 1));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(d.t.stats().errors, 6);
    d.alive();
}

#[test]
fn looping_chains_end() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_IN, 0);
    // 0 -> 1 -> 2 -> 1 -> ...
    d.put_descs(
        0,
        &[
            (HDR, 16, N, 1),
            (DATA, 512, W | N, 2),
            (STATUS, 1, W | N, 1),
        ],
    );
    d.publish(0);
    d.notify();
    let (id, len) = d.next_used();
    assert_eq!(id, 0);
    assert!(len <= 1);
    // A descriptor pointing at itself.
    d.put_descs(0, &[(STATUS, 1, W | N, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used().0, 0);
    // A next index beyond the table.
    d.put_descs(0, &[(HDR, 16, N, 200), (STATUS, 1, W, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    assert_eq!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    d.alive();
}

#[test]
fn indirect_tables() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let ind = VRING_DESC_F_INDIRECT as u16;
    // A good indirect request works.
    d.header(VIRTIO_BLK_T_IN, 2);
    let table = [
        RawDescriptor::from(SplitDescriptor::new(HDR, 16, N, 1)),
        RawDescriptor::from(SplitDescriptor::new(DATA, 512, W | N, 2)),
        RawDescriptor::from(SplitDescriptor::new(STATUS, 1, W, 0)),
    ];
    for (i, t) in table.iter().enumerate() {
        d.mem
            .write_obj(*t, GuestAddress(INDIRECT + 16 * i as u64))
            .unwrap();
    }
    d.put_descs(0, &[(INDIRECT, 48, ind, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used(), (0, 513));
    assert_eq!(d.status_byte(), VIRTIO_BLK_S_OK as u8);
    assert_eq!(d.guest_data(512), pattern(1024, 512));

    // Table outside guest memory, of absurd length, misaligned length, nested, and
    // garbage contents: none of them completes as OK, none stops the device.
    let garbage: Vec<u8> = (0..0x10000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    d.mem
        .write_slice(&garbage, GuestAddress(INDIRECT + 0x1000))
        .unwrap();
    for (addr, len) in [
        (0x1_0000_0000u64, 48u32),
        (MEM_SIZE as u64 - 16, 48),
        (INDIRECT, 0xffff_fff0),
        (INDIRECT, 47),
        (INDIRECT, 0),
        (INDIRECT + 0x1000, 0xfff0),
    ] {
        d.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        d.put_descs(0, &[(addr, len, ind, 0)]);
        d.publish(0);
        d.notify();
        let (id, _) = d.next_used();
        assert_eq!(id, 0);
        assert_ne!(d.status_byte(), VIRTIO_BLK_S_OK as u8, "{addr:#x} {len:#x}");
    }
    // An indirect descriptor inside an indirect table.
    d.mem
        .write_obj(
            RawDescriptor::from(SplitDescriptor::new(INDIRECT, 48, ind, 0)),
            GuestAddress(INDIRECT + 0x800),
        )
        .unwrap();
    d.put_descs(0, &[(INDIRECT + 0x800, 16, ind, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    // An indirect table that loops on itself is cut off.
    let mut looped = Vec::new();
    for i in 0..64u16 {
        looped.push(RawDescriptor::from(SplitDescriptor::new(
            DATA,
            512,
            W | N,
            (i + 1) % 64,
        )));
    }
    for (i, t) in looped.iter().enumerate() {
        d.mem
            .write_obj(*t, GuestAddress(INDIRECT + 0x2000 + 16 * i as u64))
            .unwrap();
    }
    d.put_descs(0, &[(INDIRECT + 0x2000, 64 * 16, ind, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used().0, 0);
    assert_eq!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    d.alive();
}

#[test]
fn overlong_indirect_chain_is_cut() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let n = MAX_CHAIN_DESCRIPTORS as u16 + 10;
    d.header(VIRTIO_BLK_T_IN, 0);
    let mut table = vec![RawDescriptor::from(SplitDescriptor::new(HDR, 16, N, 1))];
    for i in 1..n - 1 {
        table.push(RawDescriptor::from(SplitDescriptor::new(
            DATA,
            0,
            W | N,
            i + 1,
        )));
    }
    table.push(RawDescriptor::from(SplitDescriptor::new(STATUS, 1, W, 0)));
    for (i, t) in table.iter().enumerate() {
        d.mem
            .write_obj(*t, GuestAddress(INDIRECT + 16 * i as u64))
            .unwrap();
    }
    d.put_descs(
        0,
        &[(INDIRECT, u32::from(n) * 16, VRING_DESC_F_INDIRECT as u16, 0)],
    );
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used().0, 0);
    assert_ne!(d.status_byte(), VIRTIO_BLK_S_OK as u8);
    d.alive();
}

#[test]
fn absurd_avail_index_needs_reset() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.alive();
    let irqs = d.irq.count();
    d.set_avail_idx(d.avail_idx.wrapping_add(QSIZE + 1));
    d.notify();
    assert_ne!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    assert_eq!(
        d.read(VIRTIO_MMIO_INTERRUPT_STATUS) & VIRTIO_MMIO_INT_CONFIG,
        VIRTIO_MMIO_INT_CONFIG
    );
    assert_eq!(d.irq.count(), irqs + 1);
    assert_eq!(d.used_idx(), d.used_seen);
    // Further notifies are ignored until the driver resets the device.
    d.notify();
    assert_eq!(d.irq.count(), irqs + 1);
    d.mem
        .write_slice(&[0u8; 0x3000], GuestAddress(RING))
        .unwrap();
    d.avail_idx = 0;
    d.used_seen = 0;
    d.bring_up(u32::from(QSIZE));
    d.alive();
}

#[test]
fn full_ring_of_requests_in_one_pass() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.put_descs(
        0,
        &[(HDR, 16, N, 1), (DATA, 20, W | N, 2), (STATUS, 1, W, 0)],
    );
    // The same chain published QSIZE times: legal enough, and exactly a full ring.
    for _ in 0..QSIZE {
        d.publish(0);
    }
    d.notify();
    assert_eq!(d.used_idx(), QSIZE);
    assert_eq!(d.irq.count(), 1);
    assert_eq!(d.t.stats().requests, u64::from(QSIZE));
}

#[test]
fn head_index_outside_ring_needs_reset() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.publish(QSIZE + 3);
    d.notify();
    assert_ne!(d.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    assert_eq!(d.used_idx(), 0);
}

#[test]
fn used_ring_in_memory_hole_after_setup() {
    // A queue whose rings were valid at setup can still not crash the device later: here
    // the avail ring advertises a head whose descriptor is all zeros (address 0, length 0).
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    d.put_descs(0, &[(0, 0, 0, 0)]);
    d.publish(0);
    d.notify();
    assert_eq!(d.next_used(), (0, 0));
    d.alive();
}

#[test]
fn random_rings_never_hurt_the_device() {
    // A deterministic stream of junk descriptor tables, avail entries and indices. The
    // device may fail requests or ask for a reset, but must not panic, hang, or touch the
    // file outside the disk.
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::with_disk(f.path().into(), false, CacheMode::Writeback);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let addrs = [
        HDR,
        DATA,
        STATUS,
        INDIRECT,
        MEM_SIZE as u64 - 8,
        0x1_0000_0000,
        u64::MAX - 3,
    ];
    let mut resets = 0;
    for _ in 0..3000 {
        let mut table = Vec::new();
        for _ in 0..QSIZE {
            let r = rnd();
            let addr = addrs[(r % addrs.len() as u64) as usize].wrapping_add((r >> 8) % 64);
            let len = match (r >> 16) % 5 {
                0 => 0,
                1 => 1,
                2 => 16,
                3 => 512,
                _ => (r >> 24) as u32,
            };
            let flags = ((r >> 40) % 8) as u16; // NEXT, WRITE, INDIRECT in any mix
            let next = ((r >> 48) % 20) as u16;
            table.push((addr, len, flags, next));
        }
        d.put_descs(0, &table);
        // Random indirect table contents too.
        let junk: Vec<u8> = (0..256).map(|_| rnd() as u8).collect();
        d.mem.write_slice(&junk, GuestAddress(INDIRECT)).unwrap();
        d.header((rnd() % 10) as u32, rnd() % (DISK_SECTORS + 4));
        let n = (rnd() % 4) as usize;
        for _ in 0..n {
            let head = (rnd() % 18) as u16;
            d.publish(head);
        }
        if rnd() % 16 == 0 {
            d.set_avail_idx(rnd() as u16);
        }
        d.notify();
        if d.status() & VIRTIO_CONFIG_S_NEEDS_RESET != 0 {
            resets += 1;
            d.mem
                .write_slice(&[0u8; 0x3000], GuestAddress(RING))
                .unwrap();
            d.avail_idx = 0;
            d.used_seen = 0;
            d.bring_up(u32::from(QSIZE));
        } else {
            d.used_seen = d.used_idx();
            d.avail_idx = d.mem.read_obj(d.avail.unchecked_add(2)).unwrap();
        }
    }
    assert_eq!(
        std::fs::metadata(f.path()).unwrap().len(),
        DISK_SECTORS * 512
    );
    let st = d.t.stats();
    eprintln!("fuzz: {resets} resets, {st:?}");
    assert!(resets > 0 && st.requests > 500 && st.errors > 0);
    d.mem
        .write_slice(&[0u8; 0x3000], GuestAddress(RING))
        .unwrap();
    d.avail_idx = 0;
    d.used_seen = 0;
    d.bring_up(u32::from(QSIZE));
    d.alive();
}
