//! virtio-blk backed by a host file or block device.
//!
//! Every request is finished (data in the file, or in guest memory) before its chain goes on
//! the used ring, so a completed write is never only in this process. With `cache=writeback`
//! data moves between the file and guest memory with `preadv`/`pwritev` straight on guest
//! pages; with `cache=none` the file is opened `O_DIRECT`, which needs aligned buffers and
//! offsets that guest pages cannot promise, so the data goes through an aligned bounce
//! buffer and partial host blocks are read, patched and written back.

use super::{
    read_config_bytes, serve_available, QueueCorrupt, VirtioDevice, VirtioStats, QUEUE_MAX_SIZE,
};
use crate::GuestMemoryMmap;
use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use tracing::{debug, warn};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::bitmap::Bitmap;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

/// virtio-blk always counts in 512-byte sectors, whatever the host block size.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the GET_ID answer fixed by the spec.
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
/// Segments per request we tell the driver to stay under: a full ring minus the header
/// and status descriptors.
pub const SEG_MAX: u32 = QUEUE_MAX_SIZE as u32 - 2;
/// Longest chain accepted. Indirect tables may be longer than the ring, so the ring size
/// alone does not bound the walk; anything past this is treated as a broken chain.
pub const MAX_CHAIN_DESCRIPTORS: usize = 1024;

/// `O_DIRECT` requires buffer addresses aligned at least to the logical block size; a page
/// covers every device in practice.
const DIRECT_ALIGN: usize = 4096;
/// Bounce buffer size for `cache=none`: large requests are split into pieces of this size,
/// so a guest asking for gigabytes cannot make the VMM allocate gigabytes.
const BOUNCE_LEN: usize = 1 << 20;
/// Kernel limit on iovecs per `preadv`/`pwritev` call.
const IOV_MAX: usize = 1024;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const HEADER_LEN: usize = 16;
const CONFIG_LEN: usize = 64;

/// How the host page cache is used for the image. The one definition: the VM configuration
/// re-exports it, and its words (`writeback`, `none`) are those of `--disk cache=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Buffered I/O; guest FLUSH requests become `fdatasync`.
    #[default]
    Writeback,
    /// `O_DIRECT`: the host page cache is bypassed, as a real disk would be.
    None,
}

impl std::str::FromStr for CacheMode {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<CacheMode, &'static str> {
        match s {
            "writeback" => Ok(CacheMode::Writeback),
            "none" => Ok(CacheMode::None),
            _ => Err("expected writeback or none"),
        }
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheMode::Writeback => "writeback",
            CacheMode::None => "none",
        })
    }
}

/// What the VMM knows about a `--disk`.
#[derive(Clone, Debug)]
pub struct BlockConfig {
    pub path: PathBuf,
    pub readonly: bool,
    pub cache: CacheMode,
    /// Serial reported by GET_ID; at most 20 bytes.
    pub id: String,
}

/// Why a disk image could not be opened. Every message names the file, because the user
/// may have passed several.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("disk image {}: {}", path.display(), describe_open_error(source))]
    Open { path: PathBuf, source: io::Error },
    #[error(
        "disk image {}: the filesystem{} does not support O_DIRECT, which cache=none needs; \
         use cache=writeback or put the image on another filesystem",
        path.display(),
        if *tmpfs { " (tmpfs)" } else { "" }
    )]
    DirectIoUnsupported { path: PathBuf, tmpfs: bool },
    #[error(
        "disk image {}: length {len} is not a multiple of the host block size {block}, \
         which cache=none needs",
        path.display()
    )]
    UnalignedLength { path: PathBuf, len: u64, block: u64 },
    #[error("disk image {}: not a regular file or block device", path.display())]
    NotADisk { path: PathBuf },
    #[error("disk image {}: id {id:?} is longer than {ID_BYTES} bytes", path.display())]
    IdTooLong { path: PathBuf, id: String },
    #[error("disk image {}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
}

fn describe_open_error(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "no such file".to_string(),
        io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ if e.raw_os_error() == Some(libc::EROFS) => {
            "read-only filesystem (open it read-only)".to_string()
        }
        _ if e.raw_os_error() == Some(libc::EISDIR) => "is a directory".to_string(),
        _ => e.to_string(),
    }
}

/// A heap buffer aligned for `O_DIRECT`; `Vec<u8>` cannot promise the alignment.
struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is owned exclusively, like a Vec, so another thread may own it.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, DIRECT_ALIGN).expect("valid bounce layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `layout.size()` bytes, initialised by alloc_zeroed, and
        // borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Guest buffers of one direction of a request, as (address, length) pieces.
#[derive(Clone, Debug, Default)]
struct Segments {
    list: Vec<(GuestAddress, usize)>,
    len: u64,
}

impl Segments {
    fn push(&mut self, addr: GuestAddress, len: usize) {
        if len > 0 {
            self.list.push((addr, len));
            self.len += len as u64;
        }
    }

    /// The same buffers without their first `n` bytes.
    fn skip(&self, mut n: u64) -> Segments {
        let mut out = Segments::default();
        for &(addr, len) in &self.list {
            if n >= len as u64 {
                n -= len as u64;
                continue;
            }
            // n < len <= usize::MAX, and addr + len was checked to be in guest memory.
            out.push(addr.unchecked_add(n), len - n as usize);
            n = 0;
        }
        out
    }

    /// The same buffers cut to at most `n` bytes.
    fn take(&self, mut n: u64) -> Segments {
        let mut out = Segments::default();
        for &(addr, len) in &self.list {
            if n == 0 {
                break;
            }
            let l = (len as u64).min(n);
            out.push(addr, l as usize);
            n -= l;
        }
        out
    }

    fn in_memory(&self, mem: &GuestMemoryMmap, access: Permissions) -> bool {
        self.list
            .iter()
            .all(|&(addr, len)| mem.check_range(addr, len, access))
    }

    /// Copies guest bytes starting `pos` bytes into the buffers into `buf`.
    fn gather(&self, mem: &GuestMemoryMmap, pos: u64, buf: &mut [u8]) -> bool {
        let mut done = 0;
        for &(addr, len) in &self.skip(pos).take(buf.len() as u64).list {
            if mem.read_slice(&mut buf[done..done + len], addr).is_err() {
                return false;
            }
            done += len;
        }
        done == buf.len()
    }

    /// Copies `buf` into the buffers, starting `pos` bytes in.
    fn scatter(&self, mem: &GuestMemoryMmap, pos: u64, buf: &[u8]) -> bool {
        let mut done = 0;
        for &(addr, len) in &self.skip(pos).take(buf.len() as u64).list {
            if mem.write_slice(&buf[done..done + len], addr).is_err() {
                return false;
            }
            done += len;
        }
        done == buf.len()
    }
}

/// Runs `preadv`/`pwritev` until every iovec is done, resuming after short transfers.
fn transfer_vectored(
    file: &File,
    iovs: &mut [libc::iovec],
    mut offset: u64,
    write: bool,
) -> io::Result<()> {
    let mut start = 0;
    while start < iovs.len() {
        if iovs[start].iov_len == 0 {
            start += 1;
            continue;
        }
        let cnt = (iovs.len() - start).min(IOV_MAX) as libc::c_int;
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: every iovec points into guest memory that `check_range` and `get_slices`
        // validated and that stays mapped for the life of the GuestMemoryMmap we borrow.
        let r = unsafe {
            if write {
                libc::pwritev(file.as_raw_fd(), iovs[start..].as_ptr(), cnt, off)
            } else {
                libc::preadv(file.as_raw_fd(), iovs[start..].as_ptr(), cnt, off)
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(if write {
                io::ErrorKind::WriteZero.into()
            } else {
                io::ErrorKind::UnexpectedEof.into()
            });
        }
        let mut n = r as usize;
        offset += n as u64;
        while n > 0 {
            let iov = &mut iovs[start];
            if n >= iov.iov_len {
                n -= iov.iov_len;
                start += 1;
            } else {
                // SAFETY: n < iov_len, so the new base stays inside the same buffer.
                iov.iov_base = unsafe { (iov.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                iov.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Outcome of one request: the status byte and how many bytes of data went to the guest.
struct Done {
    status: u8,
    written_to_guest: u32,
}

impl Done {
    fn status(status: u32) -> Self {
        Done {
            status: status as u8,
            written_to_guest: 0,
        }
    }
}

/// A virtio-blk device.
pub struct Block {
    path: PathBuf,
    file: File,
    readonly: bool,
    cache: CacheMode,
    id: [u8; ID_BYTES],
    /// Bytes the guest may address: the file length rounded down to whole sectors.
    disk_len: u64,
    /// Alignment `O_DIRECT` needs for file offsets and lengths; SECTOR_SIZE for writeback.
    block_size: u64,
    bounce: Option<AlignedBuf>,
    config: [u8; CONFIG_LEN],
    stats: VirtioStats,
    /// Where completed writes are recorded for a replica, if anyone may ask.
    journal: Option<std::sync::Arc<super::WriteJournal>>,
}

impl Block {
    pub fn new(cfg: BlockConfig) -> Result<Block, BlockError> {
        let path = cfg.path;
        if cfg.id.len() > ID_BYTES {
            return Err(BlockError::IdTooLong { path, id: cfg.id });
        }
        let mut id = [0u8; ID_BYTES];
        id[..cfg.id.len()].copy_from_slice(cfg.id.as_bytes());

        let mut opts = OpenOptions::new();
        opts.read(true).write(!cfg.readonly);
        if cfg.cache == CacheMode::None {
            opts.custom_flags(libc::O_DIRECT);
        }
        let mut file = match opts.open(&path) {
            Ok(f) => f,
            Err(e) if cfg.cache == CacheMode::None && e.raw_os_error() == Some(libc::EINVAL) => {
                let tmpfs = is_tmpfs(&path);
                return Err(BlockError::DirectIoUnsupported { path, tmpfs });
            }
            Err(source) => return Err(BlockError::Open { path, source }),
        };
        let meta = file.metadata().map_err(|source| BlockError::Io {
            path: path.clone(),
            what: "stat",
            source,
        })?;
        {
            use std::os::unix::fs::FileTypeExt;
            let ft = meta.file_type();
            if !ft.is_file() && !ft.is_block_device() {
                return Err(BlockError::NotADisk { path });
            }
        }
        // Seeking to the end works for block devices too, whose metadata length is 0.
        let file_len = file
            .seek(SeekFrom::End(0))
            .map_err(|source| BlockError::Io {
                path: path.clone(),
                what: "finding its length",
                source,
            })?;

        let (block_size, bounce) = match cfg.cache {
            CacheMode::Writeback => (SECTOR_SIZE, None),
            CacheMode::None => {
                let mut buf = AlignedBuf::new(BOUNCE_LEN);
                let bs = match probe_direct_block_size(&file, &mut buf) {
                    Ok(bs) => bs,
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        let tmpfs = is_tmpfs(&path);
                        return Err(BlockError::DirectIoUnsupported { path, tmpfs });
                    }
                    Err(source) => {
                        return Err(BlockError::Io {
                            path,
                            what: "probing O_DIRECT block size",
                            source,
                        })
                    }
                };
                // Read-modify-write of the last block would otherwise grow the file.
                if file_len % bs != 0 {
                    return Err(BlockError::UnalignedLength {
                        path,
                        len: file_len,
                        block: bs,
                    });
                }
                (bs, Some(buf))
            }
        };

        let disk_len = file_len / SECTOR_SIZE * SECTOR_SIZE;
        let mut config = [0u8; CONFIG_LEN];
        config[0..8].copy_from_slice(&(disk_len / SECTOR_SIZE).to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        config[20..24].copy_from_slice(&(block_size as u32).to_le_bytes());

        Ok(Block {
            path,
            file,
            readonly: cfg.readonly,
            cache: cfg.cache,
            id,
            disk_len,
            block_size,
            bounce,
            config,
            stats: VirtioStats::default(),
            journal: None,
        })
    }

    /// Records every write that completes in `journal` (while it is on), for replication.
    pub fn with_journal(mut self, journal: std::sync::Arc<super::WriteJournal>) -> Block {
        self.journal = Some(journal);
        self
    }

    /// Capacity in 512-byte sectors, as the guest sees it.
    pub fn capacity(&self) -> u64 {
        self.disk_len / SECTOR_SIZE
    }

    /// Host block size that `cache=none` I/O is aligned to (512 for writeback).
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Walks one chain and serves it; returns the used length to report.
    fn handle_chain(
        &mut self,
        chain: DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> u32 {
        self.stats.requests += 1;
        let mut descs: Vec<Descriptor> = Vec::with_capacity(4);
        let mut broken = false;
        for d in chain {
            if descs.len() == MAX_CHAIN_DESCRIPTORS {
                broken = true;
                break;
            }
            descs.push(d);
        }
        // The chain iterator stops silently on a bad index, an unreadable descriptor, a
        // loop or a bad indirect table; the last descriptor still asking for a successor
        // is how that shows.
        if descs.last().is_some_and(|d| d.has_next()) {
            broken = true;
        }

        let first_w = descs
            .iter()
            .position(|d| d.is_write_only())
            .unwrap_or(descs.len());
        if descs[first_w..].iter().any(|d| !d.is_write_only()) {
            broken = true;
        }

        let mut readable = Segments::default();
        let mut writable = Segments::default();
        for d in &descs {
            let len = d.len() as usize;
            if d.addr().0.checked_add(len as u64).is_none() {
                broken = true;
                continue;
            }
            if d.is_write_only() {
                writable.push(d.addr(), len);
            } else {
                readable.push(d.addr(), len);
            }
        }

        // The status byte is the last device-writable byte of the chain.
        let Some(&(last_addr, last_len)) = writable.list.last() else {
            debug!("virtio-blk chain without a writable status byte; dropped");
            self.stats.errors += 1;
            return 0;
        };
        let status_addr = last_addr.unchecked_add(last_len as u64 - 1);
        if !mem.check_range(status_addr, 1, Permissions::Write) {
            debug!(
                addr = status_addr.0,
                "virtio-blk status byte outside guest memory; dropped"
            );
            self.stats.errors += 1;
            return 0;
        }
        let data_out = writable.take(writable.len - 1);

        let done = if broken {
            debug!("malformed virtio-blk descriptor chain");
            Done::status(VIRTIO_BLK_S_IOERR)
        } else if !readable.in_memory(mem, Permissions::Read)
            || !data_out.in_memory(mem, Permissions::Write)
        {
            debug!("virtio-blk buffer outside guest memory");
            Done::status(VIRTIO_BLK_S_IOERR)
        } else {
            self.serve(mem, &readable, &data_out)
        };

        if done.status != VIRTIO_BLK_S_OK as u8 {
            self.stats.errors += 1;
        }
        if mem.write_obj(done.status, status_addr).is_err() {
            return 0;
        }
        done.written_to_guest.saturating_add(1)
    }

    fn serve(&mut self, mem: &GuestMemoryMmap, readable: &Segments, data_out: &Segments) -> Done {
        let mut header = [0u8; HEADER_LEN];
        if readable.len < HEADER_LEN as u64 || !readable.gather(mem, 0, &mut header) {
            debug!("virtio-blk request header missing or short");
            return Done::status(VIRTIO_BLK_S_IOERR);
        }
        let req_type = u32::from_le_bytes(header[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap());
        let data_in = readable.skip(HEADER_LEN as u64);

        match req_type {
            VIRTIO_BLK_T_IN => {
                // Data the guest marked device-readable cannot receive a read: the device
                // may not write into it, so the request is refused rather than half-done.
                if data_in.len != 0 {
                    debug!("virtio-blk read into device-readable buffers");
                    return Done::status(VIRTIO_BLK_S_IOERR);
                }
                let Some(offset) = self.check_range(sector, data_out.len) else {
                    return Done::status(VIRTIO_BLK_S_IOERR);
                };
                match self.transfer(mem, data_out, offset, false) {
                    Ok(()) => {
                        self.stats.bytes_read += data_out.len;
                        Done {
                            status: VIRTIO_BLK_S_OK as u8,
                            written_to_guest: u32::try_from(data_out.len).unwrap_or(u32::MAX),
                        }
                    }
                    Err(e) => {
                        warn!(
                            "disk image {}: read of {} bytes at {offset} failed: {e}",
                            self.path.display(),
                            data_out.len
                        );
                        Done::status(VIRTIO_BLK_S_IOERR)
                    }
                }
            }
            VIRTIO_BLK_T_OUT => {
                if self.readonly {
                    debug!("write to read-only disk {}", self.path.display());
                    return Done::status(VIRTIO_BLK_S_IOERR);
                }
                if data_out.len != 0 {
                    debug!("virtio-blk write with device-writable data buffers");
                    return Done::status(VIRTIO_BLK_S_IOERR);
                }
                let Some(offset) = self.check_range(sector, data_in.len) else {
                    return Done::status(VIRTIO_BLK_S_IOERR);
                };
                match self.transfer(mem, &data_in, offset, true) {
                    Ok(()) => {
                        self.stats.bytes_written += data_in.len;
                        // Recorded before the guest can see the write complete, so the
                        // checkpoint that holds its completion holds the write too.
                        if let Some(j) = &self.journal {
                            j.record(offset, data_in.len, |buf| data_in.gather(mem, 0, buf));
                        }
                        Done::status(VIRTIO_BLK_S_OK)
                    }
                    Err(e) => {
                        warn!(
                            "disk image {}: write of {} bytes at {offset} failed: {e}",
                            self.path.display(),
                            data_in.len
                        );
                        Done::status(VIRTIO_BLK_S_IOERR)
                    }
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                self.stats.flushes += 1;
                match self.sync() {
                    Ok(()) => Done::status(VIRTIO_BLK_S_OK),
                    Err(e) => {
                        warn!("disk image {}: flush failed: {e}", self.path.display());
                        Done::status(VIRTIO_BLK_S_IOERR)
                    }
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = data_out.len.min(ID_BYTES as u64) as usize;
                if data_out.scatter(mem, 0, &self.id[..n]) {
                    Done {
                        status: VIRTIO_BLK_S_OK as u8,
                        written_to_guest: n as u32,
                    }
                } else {
                    Done::status(VIRTIO_BLK_S_IOERR)
                }
            }
            other => {
                debug!(req_type = other, "unsupported virtio-blk request");
                Done::status(VIRTIO_BLK_S_UNSUPP)
            }
        }
    }

    /// Byte offset of `sector` if `len` bytes from there fit on the disk and are whole
    /// sectors (5.2.6.1: the driver must use sector multiples).
    fn check_range(&self, sector: u64, len: u64) -> Option<u64> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            debug!(len, "virtio-blk data length not a multiple of 512");
            return None;
        }
        let offset = sector.checked_mul(SECTOR_SIZE)?;
        let end = offset.checked_add(len)?;
        if end > self.disk_len {
            debug!(
                sector,
                len,
                disk_len = self.disk_len,
                "virtio-blk request past the end of the disk"
            );
            return None;
        }
        Some(offset)
    }

    fn sync(&self) -> io::Result<()> {
        if self.readonly {
            return Ok(());
        }
        self.file.sync_data()
    }

    /// Moves the bytes of `segs` between guest memory and the file at `offset`; `write`
    /// means guest to file.
    fn transfer(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &Segments,
        offset: u64,
        write: bool,
    ) -> io::Result<()> {
        match (self.cache, write) {
            _ if segs.len == 0 => Ok(()),
            (CacheMode::Writeback, _) => self.vectored(mem, segs, offset, write),
            (CacheMode::None, false) => self.direct_read(mem, segs, offset),
            (CacheMode::None, true) => self.direct_write(mem, segs, offset),
        }
    }

    /// Zero-copy I/O between the file and guest pages.
    fn vectored(
        &self,
        mem: &GuestMemoryMmap,
        segs: &Segments,
        offset: u64,
        write: bool,
    ) -> io::Result<()> {
        let access = if write {
            Permissions::Read
        } else {
            Permissions::Write
        };
        let mut slices = Vec::with_capacity(segs.list.len());
        for &(addr, len) in &segs.list {
            let it = mem
                .get_slices(addr, len, access)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            for s in it {
                slices.push(s.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?);
            }
        }
        let guards: Vec<_> = slices.iter().map(|s| s.ptr_guard_mut()).collect();
        let mut iovs: Vec<libc::iovec> = guards
            .iter()
            .map(|g| libc::iovec {
                iov_base: g.as_ptr() as *mut libc::c_void,
                iov_len: g.len(),
            })
            .collect();
        transfer_vectored(&self.file, &mut iovs, offset, write)?;
        if !write {
            // The file was read straight into guest pages, past vm-memory's accessors: mark
            // them as the accessors would, so a live migration resends them.
            for s in &slices {
                s.bitmap().mark_dirty(0, s.len());
            }
        }
        Ok(())
    }

    fn direct_read(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &Segments,
        offset: u64,
    ) -> io::Result<()> {
        self.direct_pieces(offset, segs.len, |file, buf, p| {
            file.read_exact_at(buf, p.file_at)?;
            guest_ok(segs.scatter(mem, p.done, &buf[p.skip..p.skip + p.len]))
        })
    }

    fn direct_write(
        &mut self,
        mem: &GuestMemoryMmap,
        segs: &Segments,
        offset: u64,
    ) -> io::Result<()> {
        let bs = self.block_size as usize;
        self.direct_pieces(offset, segs.len, |file, buf, p| {
            let n = buf.len();
            // Partial host blocks at either end keep their old contents.
            if p.skip != 0 {
                file.read_exact_at(&mut buf[..bs], p.file_at)?;
            }
            let tail = n - bs;
            if p.skip + p.len < n && !(p.skip != 0 && tail == 0) {
                file.read_exact_at(&mut buf[tail..], p.file_at + tail as u64)?;
            }
            guest_ok(segs.gather(mem, p.done, &mut buf[p.skip..p.skip + p.len]))?;
            file.write_all_at(buf, p.file_at)
        })
    }

    /// Walks the `len` guest bytes at file offset `offset` in loads of whole host blocks
    /// that fit the bounce buffer, handing each to `load` with its stretch of the buffer: the
    /// alignment arithmetic `cache=none` reads and writes share.
    fn direct_pieces(
        &mut self,
        offset: u64,
        len: u64,
        mut load: impl FnMut(&File, &mut [u8], DirectPiece) -> io::Result<()>,
    ) -> io::Result<()> {
        let bs = self.block_size;
        let end = offset + len;
        let buf = self
            .bounce
            .as_mut()
            .expect("cache=none has a bounce buffer")
            .as_mut_slice();
        let mut cur = offset;
        while cur < end {
            let astart = cur / bs * bs;
            let aend = (end.div_ceil(bs) * bs).min(astart + BOUNCE_LEN as u64);
            let upto = end.min(aend);
            let piece = DirectPiece {
                file_at: astart,
                skip: (cur - astart) as usize,
                len: (upto - cur) as usize,
                done: cur - offset,
            };
            load(&self.file, &mut buf[..(aend - astart) as usize], piece)?;
            cur = upto;
        }
        Ok(())
    }
}

/// One bounce-buffer load of a `cache=none` transfer: whole host blocks from file offset
/// `file_at`, of which the guest's `len` bytes start `skip` bytes in and `done` bytes into
/// the guest buffers.
struct DirectPiece {
    file_at: u64,
    skip: usize,
    len: usize,
    done: u64,
}

/// Guest buffers are checked before a transfer starts; one that still cannot be reached
/// midway fails the request rather than the VMM.
fn guest_ok(reached: bool) -> io::Result<()> {
    if reached {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "guest buffer became invalid",
        ))
    }
}

fn is_tmpfs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes only into the zeroed struct we pass.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC
    }
}

/// Finds the smallest block size `O_DIRECT` accepts on this file: EINVAL on a 512-byte read
/// means the device underneath has 4 KiB sectors.
fn probe_direct_block_size(file: &File, buf: &mut AlignedBuf) -> io::Result<u64> {
    let buf = buf.as_mut_slice();
    let mut last = io::Error::from_raw_os_error(libc::EINVAL);
    for bs in [512usize, 4096] {
        match file.read_at(&mut buf[..bs], 0) {
            Ok(_) => return Ok(bs as u64),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn num_queues(&self) -> usize {
        1
    }

    fn features(&self) -> u64 {
        // Indirect descriptors let the driver keep many large requests in flight on a
        // 256-entry ring; the chain walk is bounded either way.
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE);
        if self.readonly {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        serve_available(index, queue, mem, |chain| self.handle_chain(chain, mem))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sync().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("disk image {}: flush: {e}", self.path.display()),
            )
        })
    }

    fn stats(&self) -> VirtioStats {
        self.stats
    }
}
