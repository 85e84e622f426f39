//! Guest RAM written to a snapshot's memory file, sparse: only pages that may hold data are
//! read, and only those that are not all zero are written.
//!
//! Which pages may hold data is asked of the kernel rather than found by reading every
//! page: the page map (`/proc/self/pagemap`) says which pages of this process are present
//! or swapped, and for RAM that is itself mapped from an earlier snapshot, the data extents
//! of that file (SEEK_DATA) name the pages the guest has not touched yet but which still
//! hold the earlier snapshot's contents. A 4 GiB guest that touched 10 MiB is written in
//! the time it takes to write 10 MiB.

use crate::vstate::memory::GuestRam;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

const PAGE: u64 = 4096;
/// Page-map entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
/// Pages whose page-map entries are read at once.
const PAGEMAP_BATCH: usize = 16384;
/// Largest single write: contiguous pages with data are written together up to this.
const WRITE_MAX: u64 = 4 << 20;

/// What writing the memory file did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RamWritten {
    /// Bytes of guest RAM (the file's length).
    pub ram_bytes: u64,
    /// Pages read because they might hold data.
    pub pages_examined: u64,
    /// Pages written (not all zero).
    pub pages_written: u64,
}

/// Writes `ram` to `path` (created or truncated), its regions one after the other.
pub fn write_ram(ram: &GuestRam, path: &Path) -> std::io::Result<RamWritten> {
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let mem = ram.memory();
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    out.set_len(total)?;
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut done = RamWritten {
        ram_bytes: total,
        ..RamWritten::default()
    };
    let mut file_offset = 0u64;
    for region in mem.iter() {
        let host = region.as_ptr() as u64;
        let len = region.len();
        let pages = len / PAGE;
        let extents = match ram.source() {
            Some(src) => data_extents(src, file_offset, len)?,
            None => Vec::new(),
        };
        // Extents are sorted and pages visited in order, so one cursor walks them.
        let mut ext = 0usize;
        let mut run: Option<(u64, u64)> = None; // (first page, pages)
        let mut entries = vec![0u64; PAGEMAP_BATCH];
        let mut page = 0u64;
        while page < pages {
            let n = (pages - page).min(PAGEMAP_BATCH as u64) as usize;
            read_pagemap(&pagemap, host + page * PAGE, &mut entries[..n])?;
            for (i, e) in entries[..n].iter().enumerate() {
                let p = page + i as u64;
                let at = p * PAGE;
                while ext < extents.len() && extents[ext].0 + extents[ext].1 <= at {
                    ext += 1;
                }
                let in_file = extents.get(ext).is_some_and(|&(s, _)| s <= at);
                let maybe_data = e & (PM_PRESENT | PM_SWAPPED) != 0 || in_file;
                let has_data = maybe_data && {
                    done.pages_examined += 1;
                    // SAFETY: `p` is a page inside this region's mapping, which the guest
                    // cannot unmap and which lives while `ram` does; the VM is paused.
                    let bytes = unsafe {
                        std::slice::from_raw_parts((host + p * PAGE) as *const u8, PAGE as usize)
                    };
                    bytes.iter().any(|&b| b != 0)
                };
                run = match (run, has_data) {
                    (Some((first, count)), true) if count * PAGE < WRITE_MAX => {
                        Some((first, count + 1))
                    }
                    (Some(r), true) => {
                        flush(&out, host, file_offset, r, &mut done)?;
                        Some((p, 1))
                    }
                    (None, true) => Some((p, 1)),
                    (Some(r), false) => {
                        flush(&out, host, file_offset, r, &mut done)?;
                        None
                    }
                    (None, false) => None,
                };
            }
            page += n as u64;
        }
        if let Some(r) = run {
            flush(&out, host, file_offset, r, &mut done)?;
        }
        file_offset += len;
    }
    out.sync_all()?;
    Ok(done)
}

fn flush(
    out: &File,
    host: u64,
    file_offset: u64,
    (first, count): (u64, u64),
    done: &mut RamWritten,
) -> std::io::Result<()> {
    // SAFETY: as in `write_ram`: pages of the region's live mapping.
    let bytes = unsafe {
        std::slice::from_raw_parts((host + first * PAGE) as *const u8, (count * PAGE) as usize)
    };
    out.write_all_at(bytes, file_offset + first * PAGE)?;
    done.pages_written += count;
    Ok(())
}

fn read_pagemap(pagemap: &File, addr: u64, entries: &mut [u64]) -> std::io::Result<()> {
    // SAFETY: a u64 slice viewed as its bytes, for the read to fill.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(entries.as_mut_ptr() as *mut u8, entries.len() * 8)
    };
    pagemap.read_exact_at(bytes, addr / PAGE * 8)
}

/// The data extents of `file` within `[start, start + len)`, relative to `start`.
fn data_extents(file: &File, start: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let end = start + len;
    let mut out = Vec::new();
    let mut at = start;
    // Each turn moves `at` forward past one data extent, so this ends.
    while at < end {
        // SAFETY: lseek on a descriptor this function borrows; no memory is touched.
        let data = unsafe { libc::lseek(fd, at as i64, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after `at`
            }
            return Err(e);
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as i64, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hole = (hole as u64).min(end);
        out.push((data - start, hole - data));
        at = hole;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_extents_skip_holes() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 8 << 20).unwrap();
        let ext = data_extents(&f, 0, 64 << 20).unwrap();
        assert!(!ext.is_empty());
        let covered = ext.iter().any(|&(s, l)| s <= 8 << 20 && s + l > 8 << 20);
        assert!(covered, "{ext:?}");
        assert!(ext.iter().map(|e| e.1).sum::<u64>() < 64 << 20, "{ext:?}");
        assert!(data_extents(&f, 16 << 20, 16 << 20).unwrap().is_empty());
    }
}
