//! Transport and virtio-blk driven the way a guest driver would, over mock guest memory.

use super::block::{Block, BlockConfig, BlockError, CacheMode, MAX_CHAIN_DESCRIPTORS};
use super::driver::{Driver, DATA, HDR, INDIRECT, MEM_SIZE, N, QSIZE, RING, STATUS, W};
use super::mmio::{MMIO_MAGIC, MMIO_VENDOR_ID};
use super::VirtioStats;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::*;
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_INDIRECT,
};
use vm_memory::{Bytes, GuestAddress};

const DISK_SECTORS: u64 = 64;
const IND: u16 = VRING_DESC_F_INDIRECT as u16;

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

/// A writable, write-back virtio-blk device on `f`.
fn block(f: &tempfile::NamedTempFile) -> Block {
    Block::new(cfg(f.path().into(), false, CacheMode::Writeback)).unwrap()
}

/// A disk of DISK_SECTORS sectors and its device, brought up.
fn disk(readonly: bool, cache: CacheMode) -> (tempfile::NamedTempFile, Driver) {
    let f = disk_file(DISK_SECTORS);
    let d = Driver::up(Block::new(cfg(f.path().into(), readonly, cache)).unwrap());
    (f, d)
}

/// The common case: a writable, write-back disk.
fn rw_disk() -> (tempfile::NamedTempFile, Driver) {
    disk(false, CacheMode::Writeback)
}

/// virtio-blk framing the tests alone use; the rest is in the driver.
impl Driver {
    /// The used element of a chain the test just submitted, and its status byte.
    fn served(&mut self) -> ((u32, u32), u8) {
        (self.next_used(), self.status_byte())
    }

    fn guest_data(&self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(DATA)).unwrap();
        v
    }
}

fn file_bytes(f: &tempfile::NamedTempFile, off: u64, len: usize) -> Vec<u8> {
    let mut h = std::fs::File::open(f.path()).unwrap();
    h.seek(SeekFrom::Start(off)).unwrap();
    let mut v = vec![0u8; len];
    h.read_exact(&mut v).unwrap();
    v
}

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;

// ---- transport registers ----

#[test]
fn identity_registers() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(block(&f));
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
    let (_f, mut d) = rw_disk();
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
    d.write_bytes(0x100, &[0xff; 8]);
    assert_eq!(d.config_u64(0), DISK_SECTORS);
    // Narrow or unaligned register accesses read zero and change nothing.
    let mut b = [0xaau8; 2];
    d.read_bytes(0, &mut b);
    assert_eq!(b, [0, 0]);
    d.write_bytes(u64::from(VIRTIO_MMIO_STATUS), &[0]);
    assert_ne!(d.status() & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    d.alive();
}

#[test]
fn config_space_any_width_and_out_of_range() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(block(&f));
    let mut full = [0u8; 8];
    d.read_bytes(0x100, &mut full);
    assert_eq!(u64::from_le_bytes(full), DISK_SECTORS);
    for width in [1usize, 2, 4] {
        for off in (0..8).step_by(width) {
            let mut b = vec![0u8; width];
            d.read_bytes(0x100 + off as u64, &mut b);
            assert_eq!(b, full[off..off + width]);
        }
    }
    assert_eq!(d.read(VIRTIO_MMIO_CONFIG + 12), 254, "seg_max");
    assert_eq!(d.read(VIRTIO_MMIO_CONFIG + 20), 512, "blk_size");
    // Straddling the end, past the end, past the window: zeros, no panic.
    for off in [0x13c_u64, 0x140, 0x800, 0xffc, 0x1000, u64::MAX - 8] {
        let mut b = [0xaau8; 8];
        d.read_bytes(off, &mut b);
        assert_eq!(b, [0; 8], "offset {off:#x}");
    }
}

#[test]
fn features_without_version_1_are_refused() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(block(&f));
    assert!(!d.negotiate(1 << VIRTIO_F_VERSION_1));
    // The device stays unusable: DRIVER_OK is not taken and notifies do nothing.
    d.setup_queue(u32::from(QSIZE));
    d.driver_ok();
    assert_eq!(d.status() & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.submit(&[(HDR, 16, 0), (DATA, 20, W), (STATUS, 1, W)]);
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
    let (_f, mut d) = rw_disk();
    d.alive();
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 1);
    d.write(VIRTIO_MMIO_INTERRUPT_ACK, 1);
    assert_eq!(d.read(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    d.write(VIRTIO_MMIO_STATUS, 0);
    assert_eq!(d.status(), 0);
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    d.restart();
    d.alive();
}

#[test]
fn bad_queue_sizes_are_refused() {
    let f = disk_file(DISK_SECTORS);
    for size in [0u32, 3, 12, 512, 65536, u32::MAX] {
        let mut d = Driver::new(block(&f));
        assert!(d.negotiate(0));
        d.setup_queue(size);
        assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0, "size {size}");
        assert!(d.needs_reset(), "size {size}");
        d.driver_ok();
        d.header(VIRTIO_BLK_T_GET_ID, 0);
        d.submit(&[(HDR, 16, 0), (DATA, 20, W), (STATUS, 1, W)]);
        assert_eq!(d.used_idx(), 0);
        // Reset recovers.
        d.bring_up(u32::from(QSIZE));
        d.alive();
    }
}

#[test]
fn rings_outside_memory_are_refused() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(block(&f));
    assert!(d.negotiate(0));
    d.write(VIRTIO_MMIO_QUEUE_SEL, 0);
    d.write(VIRTIO_MMIO_QUEUE_NUM, 16);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, 0);
    d.write(VIRTIO_MMIO_QUEUE_DESC_HIGH, 0x10);
    d.write(VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x3000);
    d.write(VIRTIO_MMIO_QUEUE_USED_LOW, (MEM_SIZE - 8) as u32);
    d.write(VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    assert!(d.needs_reset());
    // Misaligned descriptor table.
    assert!(d.negotiate(0));
    d.setup_queue(16);
    d.write(VIRTIO_MMIO_QUEUE_READY, 0);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, RING as u32 + 8);
    d.write(VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(d.read(VIRTIO_MMIO_QUEUE_READY), 0);
    assert!(d.needs_reset());
}

#[test]
fn notify_of_missing_or_unready_queue_is_ignored() {
    let f = disk_file(DISK_SECTORS);
    let mut d = Driver::new(block(&f));
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
    assert!(!d.needs_reset());
    // Once the queue is set up the same request is served.
    d.avail_idx = 0;
    d.bring_up(u32::from(QSIZE));
    d.alive();
}

#[test]
fn queue_registers_locked_while_ready() {
    let (_f, mut d) = rw_disk();
    d.write(VIRTIO_MMIO_QUEUE_NUM, 3);
    d.write(VIRTIO_MMIO_QUEUE_DESC_LOW, 0xdead_0000);
    d.alive();
}

// ---- block good paths ----

#[test]
fn read_returns_file_data() {
    let (_f, mut d) = rw_disk();
    let (s, len) = d.request(VIRTIO_BLK_T_IN, 3, 4096, true);
    assert_eq!(s, OK);
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

/// A read of sectors 1 to 3 into 512 bytes at DATA + 0x5000, then 1024 at DATA.
fn read_scattered(d: &mut Driver) -> ((u32, u32), u8) {
    d.header(VIRTIO_BLK_T_IN, 1);
    d.submit(&[
        (HDR, 16, 0),
        (DATA + 0x5000, 512, W),
        (DATA, 1024, W),
        (STATUS, 1, W),
    ]);
    d.served()
}

#[test]
fn read_scattered_over_several_descriptors() {
    let (_f, mut d) = rw_disk();
    assert_eq!(read_scattered(&mut d), ((0, 1537), OK));
    let mut a = vec![0u8; 512];
    d.mem
        .read_slice(&mut a, GuestAddress(DATA + 0x5000))
        .unwrap();
    assert_eq!(a, pattern(512, 512));
    assert_eq!(d.guest_data(1024), pattern(1024, 1024));
}

/// Whether the page of `gpa` is marked in its region's dirty bitmap.
fn dirty(d: &Driver, gpa: u64) -> bool {
    use vm_memory::bitmap::Bitmap;
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let (region, offset) = d.mem.to_region_addr(GuestAddress(gpa)).unwrap();
    region.bitmap().dirty_at(offset.0 as usize)
}

#[test]
fn reads_mark_the_pages_the_device_filled_dirty_on_both_cache_paths() {
    // The data pages and the used ring are written by the device alone (the driver writes
    // the header, descriptors and available ring): a migration must resend them.
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let (_f, mut d) = disk(false, cache);
        let untouched = DATA + 0x9000;
        assert!(!dirty(&d, DATA) && !dirty(&d, DATA + 0x5000) && !dirty(&d, untouched));
        assert_eq!(read_scattered(&mut d), ((0, 1537), OK), "{cache:?}");
        assert!(dirty(&d, DATA), "{cache:?}");
        assert!(dirty(&d, DATA + 0x5000), "{cache:?}");
        assert!(dirty(&d, RING + 0x2000), "the used ring, {cache:?}");
        assert!(!dirty(&d, untouched), "{cache:?}");
    }
}

#[test]
fn no_interrupt_flag_suppresses_the_completion_interrupt() {
    let (_f, mut d) = rw_disk();
    // VIRTQ_AVAIL_F_NO_INTERRUPT: a polling driver asks for no interrupt.
    d.set_avail_flags(1);
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, 0, 512, true);
    assert_eq!(d.irq.count(), 0);
    d.set_avail_flags(0);
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, 0, 512, true);
    assert_eq!(d.irq.count(), 1);
}

#[test]
fn read_into_device_readable_data_is_refused() {
    let (_f, mut d) = rw_disk();
    d.mem.write_slice(&[0xaa; 512], GuestAddress(DATA)).unwrap();
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_IN, 1, 512, false);
    assert_eq!(
        d.guest_data(512),
        vec![0xaa; 512],
        "the device wrote into a read-only buffer"
    );
}

#[test]
fn write_with_device_writable_data_is_refused() {
    let (f, mut d) = rw_disk();
    let before = std::fs::read(f.path()).unwrap();
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_OUT, 1, 512, true);
    assert_eq!(std::fs::read(f.path()).unwrap(), before);
}

#[test]
fn header_and_status_in_one_odd_framing() {
    // The spec lets drivers frame requests any way; split the header over two descriptors
    // and put the status at the end of the data buffer.
    let (_f, mut d) = rw_disk();
    d.header(VIRTIO_BLK_T_IN, 2);
    d.submit(&[(HDR, 4, 0), (HDR + 4, 12, 0), (DATA, 513, W)]);
    assert_eq!(d.next_used(), (0, 513));
    assert_eq!(d.guest_data(512), pattern(1024, 512));
    let s: u8 = d.mem.read_obj(GuestAddress(DATA + 512)).unwrap();
    assert_eq!(s, OK);
}

#[test]
fn write_reaches_file_and_flush() {
    let (f, mut d) = rw_disk();
    let data: Vec<u8> = (0..2048u32).map(|i| (i % 13) as u8 + 100).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let (s, len) = d.request(VIRTIO_BLK_T_OUT, 5, 2048, false);
    assert_eq!((s, len), (OK, 1));
    // Visible in the file as soon as the request completes.
    assert_eq!(file_bytes(&f, 5 * 512, 2048), data);
    assert_eq!(file_bytes(&f, 4 * 512, 512), pattern(4 * 512, 512));
    let (s, len) = d.request(VIRTIO_BLK_T_FLUSH, 0, 0, false);
    assert_eq!((s, len), (OK, 1));
    d.t.flush().unwrap();
    let st = d.t.stats();
    assert_eq!(st.bytes_written, 2048);
    assert_eq!(st.flushes, 1);
    assert_eq!(st.requests, 2);
    assert_eq!(st.interrupts, 2);
}

#[test]
fn get_id_is_nul_padded() {
    let (_f, mut d) = rw_disk();
    d.mem.write_slice(&[0xaa; 20], GuestAddress(DATA)).unwrap();
    let (s, len) = d.request(VIRTIO_BLK_T_GET_ID, 0, 20, true);
    assert_eq!((s, len), (OK, 21));
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
    let (_f, mut d) = rw_disk();
    for ty in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_SCSI_CMD, 0xdead_beef] {
        let (s, len) = d.request(ty, 0, 512, true);
        assert_eq!((s, len), (VIRTIO_BLK_S_UNSUPP as u8, 1), "type {ty}");
    }
    assert_eq!(d.t.stats().errors, 3);
}

#[test]
fn read_only_disk() {
    let (f, mut d) = disk(true, CacheMode::Writeback);
    d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    assert_ne!(
        d.read(VIRTIO_MMIO_DEVICE_FEATURES) & (1 << VIRTIO_BLK_F_RO),
        0
    );
    d.mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_OUT, 0, 512, false);
    assert_eq!(file_bytes(&f, 0, 512), pattern(0, 512));
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, 0, 512, true);
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH, 0, 0, false);
    d.t.flush().unwrap();
}

#[test]
fn capacity_rounds_down_to_sectors() {
    let mut f = disk_file(10);
    f.write_all(&[1; 100]).unwrap();
    f.flush().unwrap();
    let b = block(&f);
    assert_eq!(b.capacity(), 10);
    let mut d = Driver::up(b);
    assert_eq!(d.config_u64(0), 10);
    // The partial sector at the end is not addressable.
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_IN, 9, 1024, true);
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, 9, 512, true);
}

#[test]
fn out_of_range_sectors() {
    let (f, mut d) = rw_disk();
    for (sector, len) in [
        (DISK_SECTORS, 512),
        (DISK_SECTORS - 1, 1024),
        (u64::MAX, 512),
        (u64::MAX / 512, 512),
        (u64::MAX / 512 + 1, 0),
    ] {
        d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_IN, sector, len, true);
        d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_OUT, sector, len, false);
    }
    assert_eq!(
        std::fs::metadata(f.path()).unwrap().len(),
        DISK_SECTORS * 512
    );
}

#[test]
fn data_not_a_sector_multiple() {
    let (_f, mut d) = rw_disk();
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_IN, 0, 100, true);
    d.expect(VIRTIO_BLK_S_IOERR, VIRTIO_BLK_T_OUT, 0, 513, false);
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
    let mut d = Driver::up(b);
    // Aligned and unaligned (to the host block) reads, through the bounce buffer.
    for (sector, len) in [(0u64, 4096u32), (1, 512), (3, 5120), (7, 1536)] {
        let (s, l) = d.request(VIRTIO_BLK_T_IN, sector, len, true);
        assert_eq!((s, l), (OK, len + 1));
        assert_eq!(
            d.guest_data(len as usize),
            pattern(sector * 512, len as usize)
        );
    }
    // Unaligned writes keep the neighbouring bytes of the host blocks they touch.
    let data: Vec<u8> = (0..1536u32).map(|i| (i % 17) as u8 + 1).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_OUT, 9, 1536, false);
    assert_eq!(file_bytes(&f, 9 * 512, 1536), data);
    assert_eq!(file_bytes(&f, 0, 9 * 512), pattern(0, 9 * 512));
    assert_eq!(file_bytes(&f, 12 * 512, 4096), pattern(12 * 512, 4096));
    // A single sector inside one host block.
    d.mem.write_slice(&[0x77; 512], GuestAddress(DATA)).unwrap();
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_OUT, 33, 512, false);
    assert_eq!(file_bytes(&f, 33 * 512, 512), vec![0x77; 512]);
    assert_eq!(file_bytes(&f, 32 * 512, 512), pattern(32 * 512, 512));
    assert_eq!(file_bytes(&f, 34 * 512, 512), pattern(34 * 512, 512));
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH, 0, 0, false);
    d.t.flush().unwrap();
}

#[test]
fn direct_io_larger_than_bounce_buffer() {
    // 3 MiB requests cross the 1 MiB bounce buffer several times.
    let sectors = 8192;
    let f = disk_file(sectors);
    let mut d = Driver::up(Block::new(cfg(f.path().into(), false, CacheMode::None)).unwrap());
    let len = 3 << 20;
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, 1, len, true);
    assert!(d.guest_data(len as usize) == pattern(512, len as usize));
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    d.expect(VIRTIO_BLK_S_OK, VIRTIO_BLK_T_OUT, 3, len, false);
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
    let (_f, mut d) = rw_disk();
    for (addr, len, flags) in [
        (MEM_SIZE as u64 - 256, 512, W),
        (MEM_SIZE as u64 - 256, 512, 0),
        (0x1_0000_0000, 512, W),
        (u64::MAX - 100, 512, W),
    ] {
        d.header(VIRTIO_BLK_T_IN, 0);
        d.submit(&[(HDR, 16, 0), (addr, len, flags), (STATUS, 1, W)]);
        assert_eq!(d.served(), ((0, 1), IOERR), "{addr:#x} {len:#x}");
    }
    // 4 GiB descriptors: the chain's byte count overflows, so the chain is cut there and
    // the request is either failed or, with no status byte left, returned empty.
    for flags in [W, 0] {
        d.header(VIRTIO_BLK_T_IN, 0);
        d.submit(&[(HDR, 16, 0), (DATA, 0xffff_ffff, flags), (STATUS, 1, W)]);
        let ((id, len), s) = d.served();
        assert_eq!(id, 0);
        assert!(len == 0 || (len == 1 && s == IOERR));
        assert_ne!(s, OK);
    }
    // A header outside memory.
    d.chain(&[(u64::MAX - 7, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);
    d.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    d.notify();
    assert_eq!(d.served(), ((0, 1), IOERR));
    assert!(!d.needs_reset());
    d.alive();
}

#[test]
fn status_outside_memory_or_missing() {
    let (_f, mut d) = rw_disk();
    d.header(VIRTIO_BLK_T_IN, 0);
    // Status byte beyond the end of memory: nothing can be reported, used len 0.
    d.submit(&[(HDR, 16, 0), (DATA, 512, W), (MEM_SIZE as u64 + 4, 1, W)]);
    assert_eq!(d.next_used(), (0, 0));
    // No writable descriptor at all.
    d.submit(&[(HDR, 16, 0), (DATA, 512, 0)]);
    assert_eq!(d.next_used(), (0, 0));
    // Zero-length writable descriptor only.
    d.submit(&[(HDR, 16, 0), (STATUS, 0, W)]);
    assert_eq!(d.next_used(), (0, 0));
    // A readable descriptor after a writable one (wrong order): failed, not served.
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.submit(&[(STATUS, 1, W), (HDR, 16, 0)]);
    assert_eq!(d.served(), ((0, 1), IOERR));
    d.header(VIRTIO_BLK_T_GET_ID, 0);
    d.submit(&[(HDR, 16, 0), (DATA, 16, 0), (STATUS, 1, W), (HDR, 16, 0)]);
    assert_eq!(d.served(), ((0, 1), IOERR));
    // Short header.
    d.header(VIRTIO_BLK_T_IN, 0);
    d.submit(&[(HDR, 8, 0), (STATUS, 1, W)]);
    assert_eq!(d.served(), ((0, 1), IOERR));
    assert_eq!(d.t.stats().errors, 6);
    d.alive();
}

#[test]
fn looping_chains_end() {
    let (_f, mut d) = rw_disk();
    d.header(VIRTIO_BLK_T_IN, 0);
    // 0 -> 1 -> 2 -> 1 -> ...
    d.submit_raw(&[
        (HDR, 16, N, 1),
        (DATA, 512, W | N, 2),
        (STATUS, 1, W | N, 1),
    ]);
    let (id, len) = d.next_used();
    assert_eq!(id, 0);
    assert!(len <= 1);
    // A descriptor pointing at itself.
    d.submit_raw(&[(STATUS, 1, W | N, 0)]);
    assert_eq!(d.next_used().0, 0);
    // A next index beyond the table.
    d.submit_raw(&[(HDR, 16, N, 200), (STATUS, 1, W, 0)]);
    assert_eq!(d.next_used(), (0, 0));
    assert!(!d.needs_reset());
    d.alive();
}

#[test]
fn indirect_tables() {
    let (_f, mut d) = rw_disk();
    // A good indirect request works.
    d.header(VIRTIO_BLK_T_IN, 2);
    d.write_table(
        INDIRECT,
        &[(HDR, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)],
    );
    d.submit_raw(&[(INDIRECT, 48, IND, 0)]);
    assert_eq!(d.served(), ((0, 513), OK));
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
        d.submit_raw(&[(addr, len, IND, 0)]);
        let ((id, _), s) = d.served();
        assert_eq!(id, 0);
        assert_ne!(s, OK, "{addr:#x} {len:#x}");
    }
    // An indirect descriptor inside an indirect table.
    d.write_table(INDIRECT + 0x800, &[(INDIRECT, 48, IND, 0)]);
    d.submit_raw(&[(INDIRECT + 0x800, 16, IND, 0)]);
    assert_eq!(d.next_used(), (0, 0));
    // An indirect table that loops on itself is cut off.
    let looped: Vec<_> = (0..64u16)
        .map(|i| (DATA, 512, W | N, (i + 1) % 64))
        .collect();
    d.write_table(INDIRECT + 0x2000, &looped);
    d.submit_raw(&[(INDIRECT + 0x2000, 64 * 16, IND, 0)]);
    assert_eq!(d.next_used().0, 0);
    assert!(!d.needs_reset());
    d.alive();
}

#[test]
fn overlong_indirect_chain_is_cut() {
    let (_f, mut d) = rw_disk();
    let n = MAX_CHAIN_DESCRIPTORS as u16 + 10;
    d.header(VIRTIO_BLK_T_IN, 0);
    let mut table = vec![(HDR, 16, N, 1)];
    table.extend((1..n - 1).map(|i| (DATA, 0, W | N, i + 1)));
    table.push((STATUS, 1, W, 0));
    d.write_table(INDIRECT, &table);
    d.submit_raw(&[(INDIRECT, u32::from(n) * 16, IND, 0)]);
    let ((id, _), s) = d.served();
    assert_eq!(id, 0);
    assert_ne!(s, OK);
    d.alive();
}

#[test]
fn absurd_avail_index_needs_reset() {
    let (_f, mut d) = rw_disk();
    d.alive();
    let irqs = d.irq.count();
    d.set_avail_idx(d.avail_idx.wrapping_add(QSIZE + 1));
    d.notify();
    assert!(d.needs_reset());
    assert_eq!(
        d.read(VIRTIO_MMIO_INTERRUPT_STATUS) & VIRTIO_MMIO_INT_CONFIG,
        VIRTIO_MMIO_INT_CONFIG
    );
    assert_eq!(d.irq.count(), irqs + 1);
    assert_eq!(d.used_idx(), d.used_seen);
    // Further notifies are ignored until the driver resets the device.
    d.notify();
    assert_eq!(d.irq.count(), irqs + 1);
    d.restart();
    d.alive();
}

#[test]
fn full_ring_of_requests_in_one_pass() {
    let (_f, mut d) = rw_disk();
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
    let (_f, mut d) = rw_disk();
    d.publish(QSIZE + 3);
    d.notify();
    assert!(d.needs_reset());
    assert_eq!(d.used_idx(), 0);
}

#[test]
fn used_ring_in_memory_hole_after_setup() {
    // A queue whose rings were valid at setup can still not crash the device later: here
    // the avail ring advertises a head whose descriptor is all zeros (address 0, length 0).
    let (_f, mut d) = rw_disk();
    d.submit_raw(&[(0, 0, 0, 0)]);
    assert_eq!(d.next_used(), (0, 0));
    d.alive();
}

#[test]
fn random_rings_never_hurt_the_device() {
    // A deterministic stream of junk descriptor tables, avail entries and indices. The
    // device may fail requests or ask for a reset, but must not panic, hang, or touch the
    // file outside the disk.
    let (f, mut d) = rw_disk();
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
        if d.needs_reset() {
            resets += 1;
            d.restart();
        } else {
            d.used_seen = d.used_idx();
            d.avail_idx = d.avail_idx_in_ring();
        }
    }
    assert_eq!(
        std::fs::metadata(f.path()).unwrap().len(),
        DISK_SECTORS * 512
    );
    let st = d.t.stats();
    eprintln!("fuzz: {resets} resets, {st:?}");
    assert!(resets > 0 && st.requests > 500 && st.errors > 0);
    d.restart();
    d.alive();
}

#[test]
fn a_restored_transport_goes_on_where_the_saved_one_stopped() {
    let (f, mut d) = rw_disk();
    let (s, _) = d.request(VIRTIO_BLK_T_IN, 3, 4096, true);
    assert_eq!(s, OK);
    let saved = d.t.state();
    // The same disk behind a new transport over the same memory, as a restore builds it.
    let mut restored = Driver::new_in(block(&f), d.mem.clone());
    restored.t.restore(&saved).unwrap();
    assert_eq!(restored.t.state(), saved);
    restored.avail_idx = d.avail_idx;
    restored.used_seen = d.used_seen;
    let (s, len) = restored.request(VIRTIO_BLK_T_IN, 5, 4096, true);
    assert_eq!((s, len), (OK, 4097));
    assert_eq!(restored.guest_data(4096), pattern(5 * 512, 4096));
}

#[test]
fn a_saved_ring_outside_guest_memory_is_refused_on_restore() {
    let (f, d) = rw_disk();
    let mut saved = serde_json::to_value(d.t.state()).unwrap();
    saved["queues"][0]["desc"] = serde_json::json!(0x7fff_0000_0000u64);
    let saved: crate::virtio::TransportState = serde_json::from_value(saved).unwrap();
    let mut other = Driver::new_in(block(&f), d.mem.clone());
    let e = other.t.restore(&saved).unwrap_err();
    assert!(
        matches!(e, crate::virtio::RestoreError::Queue { queue: 0, .. }),
        "{e}"
    );
}
