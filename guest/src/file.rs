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
//! The page cache is direct-mapped: file page `p` lives in slot `p % slots` at
//! `cache + slot * 4096`, so runs of missing or dirty pages go to the device as single
//! requests. There is a slot for every page unless `probe.page_cache=SIZE` caps the cache
//! (as a guest with less RAM than the file has): a page then evicts the one in its slot,
//! written back first if dirty. A sequential pass over a file twice the cap evicts each page
//! before the next pass reaches it, as LRU or FIFO would: the proportion of paper 000's §5.2
//! (256 MB of guest RAM, a 512 MB file), where warm virtio reads still reach the device.

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
    /// Cache slots (pages), and per slot the file page in it plus one (0: empty), as u32.
    slots: u64,
    owner: u64,
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
        slots: 0,
        owner: 0,
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
                if pages >= 1 << 32 {
                    return Err(Error::OutOfRange);
                }
                let slots = cap_pages().map_or(pages, |c| c.clamp(1, pages));
                let state_pages = pages.div_ceil(PAGE);
                let owner_pages = (slots * 4).div_ceil(PAGE);
                if mm::free_bytes() < (slots + state_pages + owner_pages) * PAGE {
                    return Err(Error::NoMemory);
                }
                f.cache = mm::alloc(slots).ok_or(Error::NoMemory)?;
                f.state = mm::alloc(state_pages).ok_or(Error::NoMemory)?;
                f.owner = mm::alloc(owner_pages).ok_or(Error::NoMemory)?;
                f.slots = slots;
                mm::zero(f.state, state_pages * PAGE);
                mm::zero(f.owner, owner_pages * PAGE);
            }
        }
        _ => return Err(Error::BadArgument),
    }
    *open_file() = Some(f);
    Ok(FD)
}

/// The page cache's size in pages from `probe.page_cache=SIZE` (K, M, G suffixes), at
/// least one readahead; None: no cap.
fn cap_pages() -> Option<u64> {
    let v = crate::bootinfo::get().param(b"probe.page_cache")?;
    let bytes = workloads::task::parse_num(core::str::from_utf8(v).ok()?)?;
    Some((bytes / PAGE).max(READAHEAD))
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

    fn slot(&self, p: u64) -> u64 {
        p % self.slots
    }

    /// Where file page `p` lives (or will) in the cache.
    fn at(&self, p: u64) -> u64 {
        self.cache + self.slot(p) * PAGE
    }

    /// The file page in slot `s`, if any.
    fn owner(&self, s: u64) -> Option<u64> {
        debug_assert!(s < self.slots);
        // SAFETY: `open` gave a cached file one u32 per slot in pool pages of its own, which
        // live until the next task; every caller passes a slot below `slots`.
        let o = unsafe { *((self.owner + s * 4) as *const u32) };
        (o != 0).then(|| u64::from(o) - 1)
    }

    fn set_owner(&self, s: u64, p: Option<u64>) {
        debug_assert!(s < self.slots);
        let v = p.map_or(0, |p| p as u32 + 1);
        // SAFETY: as in `owner`.
        unsafe { *((self.owner + s * 4) as *mut u32) = v };
    }

    /// Bytes of the run of pages `p..e` that are inside the file.
    fn run_len(&self, p: u64, e: u64) -> u64 {
        ((e - p) * PAGE).min(self.bytes - p * PAGE)
    }

    /// The end of the run of slots from `s` (below `s1`) that hold dirty file pages
    /// `q, q + 1, ...`: one device request writes it back.
    fn dirty_run(&self, s: u64, s1: u64, q: u64) -> u64 {
        let mut e = s + 1;
        while e < s1 && self.owner(e) == Some(q + (e - s)) && self.st(q + (e - s)) == DIRTY {
            e += 1;
        }
        e
    }

    /// Empties slots `s0..s1` (no wrap), writing dirty pages back one request per run of
    /// consecutive file pages and unmapping the pages that leave.
    fn evict(&self, s0: u64, s1: u64) -> Result<(), Error> {
        let mut s = s0;
        while s < s1 {
            let Some(q) = self.owner(s) else {
                s += 1;
                continue;
            };
            let mut e = s + 1;
            if self.st(q) == DIRTY {
                e = self.dirty_run(s, s1, q);
                let len = self.run_len(q, q + (e - s));
                virtio::rw(self.disk(), true, q * 8, self.cache + s * PAGE, len)?;
            }
            for k in s..e {
                let page = q + (k - s);
                self.set_st(page, ABSENT);
                self.set_owner(k, None);
                if self.mapped {
                    mm::unmap(Which::File, page);
                }
            }
            s = e;
        }
        Ok(())
    }

    /// Gives every absent page in `p0..p1` (at most `slots` pages) its slot, reading it from
    /// the disk when `read`, one request per run; else it is about to be overwritten whole.
    fn fill_with(&self, p0: u64, p1: u64, read: bool) -> Result<(), Error> {
        debug_assert!(p1 - p0 <= self.slots);
        let mut p = p0;
        while p < p1 {
            if self.st(p) != ABSENT {
                p += 1;
                continue;
            }
            let room = self.slots - self.slot(p);
            let mut e = p + 1;
            while e < p1 && e - p < room && self.st(e) == ABSENT {
                e += 1;
            }
            let (s0, s1) = (self.slot(p), self.slot(p) + (e - p));
            self.evict(s0, s1)?;
            if read {
                virtio::rw(self.disk(), false, p * 8, self.at(p), self.run_len(p, e))?;
            }
            for q in p..e {
                self.set_st(q, CLEAN);
                self.set_owner(self.slot(q), Some(q));
            }
            p = e;
        }
        Ok(())
    }

    /// Reads every absent page in `p0..p1` (at most `slots` pages) from the disk.
    fn fill(&self, p0: u64, p1: u64) -> Result<(), Error> {
        self.fill_with(p0, p1, true)
    }

    /// Makes pages `p0..p1` (at most `slots` pages) present, reading ahead on a miss as far
    /// as the cache holds without evicting `p0..p1` themselves.
    fn ensure(&self, p0: u64, p1: u64) -> Result<(), Error> {
        for p in p0..p1 {
            if self.st(p) == ABSENT {
                let end = p1.max(p + READAHEAD).min(self.pages).min(p0 + self.slots);
                return self.fill(p, end);
            }
        }
        Ok(())
    }

    /// The end of the chunk of pages starting at `p` below `p1` that lies in consecutive
    /// slots, so one copy reaches it.
    fn chunk_end(&self, p: u64, p1: u64) -> u64 {
        p1.min(p + (self.slots - self.slot(p)))
    }

    /// Writes every dirty page back (one request per run), write-protecting mapped pages.
    fn writeback(&self) -> Result<(), Error> {
        let mut s = 0;
        while s < self.slots {
            let Some(q) = self.owner(s).filter(|&q| self.st(q) == DIRTY) else {
                s += 1;
                continue;
            };
            let e = self.dirty_run(s, self.slots, q);
            let len = self.run_len(q, q + (e - s));
            virtio::rw(self.disk(), true, q * 8, self.cache + s * PAGE, len)?;
            for k in 0..e - s {
                self.set_st(q + k, CLEAN);
                if self.mapped {
                    mm::write_protect(Which::File, q + k);
                }
            }
            s = e;
        }
        Ok(())
    }

    /// Read or write system call on the page cache: chunk by chunk of consecutive slots.
    fn cached_rw(&self, write: bool, buf: u64, pos: u64, n: u64) -> Result<(), Error> {
        let (p0, p1) = (pos / PAGE, (pos + n).div_ceil(PAGE));
        let mut c0 = p0;
        while c0 < p1 {
            let c1 = self.chunk_end(c0, p1);
            let b0 = pos.max(c0 * PAGE);
            let b1 = (pos + n).min(c1 * PAGE);
            let (cache, user) = (self.at(c0) + (b0 - c0 * PAGE), buf + (b0 - pos));
            if write {
                for p in [c0, c1 - 1] {
                    let whole = p * PAGE >= b0 && (p + 1) * PAGE <= b1;
                    if !whole {
                        self.fill(p, p + 1)?;
                    }
                }
                self.fill_with(c0, c1, false)?;
                mm::kcopy(cache, user, b1 - b0);
                for p in c0..c1 {
                    self.set_st(p, DIRTY);
                }
            } else {
                self.ensure(c0, c1)?;
                mm::kcopy(user, cache, b1 - b0);
            }
            c0 = c1;
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
        Backing::Blk { direct: false, .. } => f.cached_rw(write, buf, pos, n)?,
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
        mm::zero(f.owner, (f.slots * 4).div_ceil(PAGE) * PAGE);
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
            Some((f.at(k), f.st(k) == DIRTY))
        }
    }
}
