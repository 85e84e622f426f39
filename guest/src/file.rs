//! The one open file of a user task: an extent of memory storage or of a disk, reached by
//! read/write/lseek/fsync system calls or mapped into the task (the four access paths of the
//! VMMS paper, §5.2).
//!
//! - Memory storage (XIP): read/write copy between the region and the user buffer; `mmap`
//!   maps the region's own pages. No page cache.
//! - Disk, cached (as a conventional kernel): a page cache of 4 KiB pool pages, filled from
//!   virtio-blk on a miss (with readahead of `READAHEAD` pages), written back by fsync;
//!   read/write copy between cache pages and the user buffer; `mmap` maps cache pages on
//!   fault (read faults map read-only, so the first write to a page faults again and marks
//!   it dirty; writeback write-protects the page again).
//! - Disk, direct (`OPEN_DIRECT`, for `mint-io`): read/write go straight between the device
//!   and the user buffer, whole sectors only.
//!
//! The page cache is direct-mapped: file page `p` lives at `cache + p * 4096`, so runs of
//! missing or dirty pages go to the device as single requests.

use crate::abi::{Error, FD, OPEN_DIRECT, STORAGE_BLK, STORAGE_PMEM};
use crate::global::Global;
use crate::mm::{self, Which, PAGE};
use crate::{pmem, virtio};

/// Pages read on a cache miss (64 KiB), beyond what the request itself needs.
pub const READAHEAD: u64 = 16;

const ABSENT: u8 = 0;
const CLEAN: u8 = 1;
const DIRTY: u8 = 2;

#[derive(Clone, Copy)]
enum Backing {
    Pmem { base: u64, region: usize },
    Blk { disk: usize, direct: bool },
}

#[derive(Clone, Copy)]
struct File {
    backing: Backing,
    bytes: u64,
    pages: u64,
    pos: u64,
    /// Page cache (pool pages) and one state byte per page; 0 for pmem and direct.
    cache: u64,
    state: u64,
    mapped: bool,
}

static FILE: Global<Option<File>> = Global::new(None);

/// The open file, if any.
fn open_file() -> &'static mut Option<File> {
    // SAFETY: FILE is used only on the BSP's kernel path: the system calls of the one
    // running task and the #PF handler for its file window, which runs while the task (not
    // a system call) executes. Each use ends before the next begins.
    unsafe { FILE.get() }
}

/// Forgets the file (the pool it used is emptied by `mm::reset`).
pub fn reset() {
    *open_file() = None;
}

fn file(fd: u64) -> Result<&'static mut File, Error> {
    match open_file() {
        Some(f) if fd == FD => Ok(f),
        _ => Err(Error::BadFd),
    }
}

pub fn open(storage: u64, index: u64, bytes: u64, flags: u64) -> Result<u64, Error> {
    if bytes == 0 || !bytes.is_multiple_of(512) {
        return Err(Error::BadArgument);
    }
    let pages = bytes.div_ceil(PAGE);
    let index = index as usize;
    let mut f = File {
        backing: Backing::Blk {
            disk: index,
            direct: true,
        },
        bytes,
        pages,
        pos: 0,
        cache: 0,
        state: 0,
        mapped: false,
    };
    match storage {
        STORAGE_PMEM => {
            let r = pmem::region(index).ok_or(Error::BadFd)?;
            if bytes > r.size {
                return Err(Error::OutOfRange);
            }
            f.backing = Backing::Pmem {
                base: r.base,
                region: index,
            };
        }
        STORAGE_BLK => {
            if bytes > virtio::capacity(index)? * 512 {
                return Err(Error::OutOfRange);
            }
            let direct = flags & OPEN_DIRECT != 0;
            f.backing = Backing::Blk {
                disk: index,
                direct,
            };
            if !direct {
                let state_pages = pages.div_ceil(PAGE);
                if mm::free_bytes() < (pages + state_pages) * PAGE {
                    return Err(Error::NoMemory);
                }
                f.cache = mm::alloc(pages).ok_or(Error::NoMemory)?;
                f.state = mm::alloc(state_pages).ok_or(Error::NoMemory)?;
                mm::zero(f.state, state_pages * PAGE);
            }
        }
        _ => return Err(Error::BadArgument),
    }
    *open_file() = Some(f);
    Ok(FD)
}

impl File {
    /// State of page `p < pages` of a cached file.
    fn st(&self, p: u64) -> u8 {
        debug_assert!(p < self.pages && self.state != 0);
        // SAFETY: `open` gave a cached file one state byte per page in pool pages of its own,
        // which live until the next task; every caller passes a page of the file.
        unsafe { *((self.state + p) as *const u8) }
    }

    fn set_st(&self, p: u64, v: u8) {
        debug_assert!(p < self.pages && self.state != 0);
        // SAFETY: as in `st`.
        unsafe { *((self.state + p) as *mut u8) = v };
    }

    fn disk(&self) -> usize {
        match self.backing {
            Backing::Blk { disk, .. } => disk,
            Backing::Pmem { .. } => 0,
        }
    }

    /// Reads every absent page in `p0..p1` from the disk, one request per run.
    fn fill(&self, p0: u64, p1: u64) -> Result<(), Error> {
        let mut p = p0;
        while p < p1 {
            if self.st(p) != ABSENT {
                p += 1;
                continue;
            }
            let mut e = p + 1;
            while e < p1 && self.st(e) == ABSENT {
                e += 1;
            }
            let len = ((e - p) * PAGE).min(self.bytes - p * PAGE);
            virtio::rw(self.disk(), false, p * 8, self.cache + p * PAGE, len)?;
            for q in p..e {
                self.set_st(q, CLEAN);
            }
            p = e;
        }
        Ok(())
    }

    /// Makes pages `p0..p1` present, reading ahead on a miss.
    fn ensure(&self, p0: u64, p1: u64) -> Result<(), Error> {
        for p in p0..p1 {
            if self.st(p) == ABSENT {
                let end = p1.max(p + READAHEAD).min(self.pages);
                return self.fill(p, end);
            }
        }
        Ok(())
    }

    /// Writes every dirty page back (one request per run), write-protecting mapped pages.
    fn writeback(&self) -> Result<(), Error> {
        let mut p = 0;
        while p < self.pages {
            if self.st(p) != DIRTY {
                p += 1;
                continue;
            }
            let mut e = p + 1;
            while e < self.pages && self.st(e) == DIRTY {
                e += 1;
            }
            let len = ((e - p) * PAGE).min(self.bytes - p * PAGE);
            virtio::rw(self.disk(), true, p * 8, self.cache + p * PAGE, len)?;
            for q in p..e {
                self.set_st(q, CLEAN);
                if self.mapped {
                    mm::write_protect(Which::File, q);
                }
            }
            p = e;
        }
        Ok(())
    }
}

/// Checks a user buffer: inside the task's arena.
fn user_buf(buf: u64, len: u64) -> Result<(), Error> {
    if crate::user::in_arena(buf, len) {
        Ok(())
    } else {
        Err(Error::BadArgument)
    }
}

pub fn rw(fd: u64, write: bool, buf: u64, len: u64) -> Result<u64, Error> {
    let f = file(fd)?;
    user_buf(buf, len)?;
    let n = len.min(f.bytes.saturating_sub(f.pos));
    if n == 0 {
        return Ok(0);
    }
    let pos = f.pos;
    match f.backing {
        Backing::Pmem { base, .. } => {
            if write {
                mm::kcopy(base + pos, buf, n);
            } else {
                mm::kcopy(buf, base + pos, n);
            }
        }
        Backing::Blk { disk, direct: true } => {
            if !pos.is_multiple_of(512) || !n.is_multiple_of(512) {
                return Err(Error::BadArgument);
            }
            virtio::rw(disk, write, pos / 512, buf, n)?;
        }
        Backing::Blk { direct: false, .. } => {
            let (p0, p1) = (pos / PAGE, (pos + n).div_ceil(PAGE));
            if write {
                for p in [p0, p1 - 1] {
                    let whole = p * PAGE >= pos && (p + 1) * PAGE <= pos + n;
                    if !whole {
                        f.fill(p, p + 1)?;
                    }
                }
                mm::kcopy(f.cache + pos, buf, n);
                for p in p0..p1 {
                    f.set_st(p, DIRTY);
                }
            } else {
                f.ensure(p0, p1)?;
                mm::kcopy(buf, f.cache + pos, n);
            }
        }
    }
    f.pos = pos + n;
    Ok(n)
}

pub fn lseek(fd: u64, off: u64) -> Result<u64, Error> {
    let f = file(fd)?;
    if off > f.bytes {
        return Err(Error::OutOfRange);
    }
    f.pos = off;
    Ok(off)
}

/// Makes everything written durable: writeback and FLUSH for a disk, the region's flush for
/// memory storage. Returns 1 if a device request was needed for it, else 0.
pub fn fsync(fd: u64) -> Result<u64, Error> {
    let f = file(fd)?;
    match f.backing {
        Backing::Pmem { region, .. } => pmem::flush(region).map(|v| v as u64),
        Backing::Blk { disk, direct } => {
            if !direct {
                f.writeback()?;
            }
            virtio::flush(disk).map(|_| 1)
        }
    }
}

pub fn mmap(fd: u64) -> Result<u64, Error> {
    let f = file(fd)?;
    if matches!(f.backing, Backing::Blk { direct: true, .. }) {
        return Err(Error::BadArgument);
    }
    if f.mapped {
        return Err(Error::BadArgument);
    }
    let va = mm::map_window(Which::File, f.pages).ok_or(Error::NoMemory)?;
    f.mapped = true;
    Ok(va)
}

/// Cold state: dirty pages written back, the page cache empty, no page mapped.
pub fn drop_caches(fd: u64) -> Result<u64, Error> {
    let f = file(fd)?;
    if let Backing::Blk { direct: false, .. } = f.backing {
        f.writeback()?;
        mm::zero(f.state, f.pages.div_ceil(PAGE) * PAGE);
    }
    if f.mapped {
        mm::unmap_all(Which::File);
    }
    Ok(0)
}

/// The page to map at page `k` of the file window, and whether writable.
pub fn fault(k: u64, write: bool) -> Option<(u64, bool)> {
    let f = open_file().as_ref()?;
    if k >= f.pages {
        return None;
    }
    match f.backing {
        Backing::Pmem { base, .. } => Some((base + k * PAGE, true)),
        Backing::Blk { direct: true, .. } => None,
        Backing::Blk { direct: false, .. } => {
            f.ensure(k, k + 1).ok()?;
            if write {
                f.set_st(k, DIRTY);
            }
            Some((f.cache + k * PAGE, f.st(k) == DIRTY))
        }
    }
}
