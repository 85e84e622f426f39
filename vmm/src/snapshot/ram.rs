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
use host_resources::data_extents;
use std::fs::File;
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

/// Calls `visit(region index, page index in the region, host address of the page)` for
/// every page of `ram` that may hold data, in guest-physical order.
fn scan_pages(
    ram: &GuestRam,
    mut visit: impl FnMut(usize, u64, u64) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut file_offset = 0u64;
    let mut entries = vec![0u64; PAGEMAP_BATCH];
    for (index, region) in ram.memory().iter().enumerate() {
        let host = region.as_ptr() as u64;
        let len = region.len();
        let pages = len / PAGE;
        let extents = match ram.source() {
            Some(src) => data_extents(src, file_offset, len)?,
            None => Vec::new(),
        };
        // Extents are sorted and pages visited in order, so one cursor walks them.
        let mut ext = 0usize;
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
                if e & (PM_PRESENT | PM_SWAPPED) != 0 || in_file {
                    visit(index, p, host + at)?;
                }
            }
            page += n as u64;
        }
        file_offset += len;
    }
    Ok(())
}

/// Guest-physical addresses of the pages of `ram` that may hold data (see the module
/// comment); every other page is all zeros. A page server pushes these and no others.
pub fn pages_that_may_hold_data(ram: &GuestRam) -> std::io::Result<Vec<u64>> {
    let starts: Vec<u64> = ram.memory().iter().map(|r| r.start_addr().0).collect();
    let mut out = Vec::new();
    scan_pages(ram, |region, page, _| {
        out.push(starts[region] + page * PAGE);
        Ok(())
    })?;
    Ok(out)
}

/// Writes `ram` to `path` (created or truncated), its regions one after the other.
pub fn write_ram(ram: &GuestRam, path: &Path) -> std::io::Result<RamWritten> {
    let out = super::private_file(path)?;
    let mem = ram.memory();
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    out.set_len(total)?;
    let bases: Vec<(u64, u64)> = {
        let mut at = 0;
        mem.iter()
            .map(|r| {
                let b = (r.as_ptr() as u64, at);
                at += r.len();
                b
            })
            .collect()
    };
    let mut done = RamWritten {
        ram_bytes: total,
        ..RamWritten::default()
    };
    // (region, first page, pages): contiguous pages with data, written together.
    let mut run: Option<(usize, u64, u64)> = None;
    scan_pages(ram, |region, p, host_page| {
        done.pages_examined += 1;
        // SAFETY: `host_page` is a page of the region's mapping, which the guest cannot unmap
        // and which lives while `ram` does; the VM is paused.
        let bytes = unsafe { std::slice::from_raw_parts(host_page as *const u8, PAGE as usize) };
        if bytes.iter().all(|&b| b == 0) {
            return Ok(());
        }
        run = match run {
            Some((r, first, count))
                if r == region && first + count == p && count * PAGE < WRITE_MAX =>
            {
                Some((r, first, count + 1))
            }
            Some((r, first, count)) => {
                let (host, off) = bases[r];
                flush(&out, host, off, (first, count), &mut done)?;
                Some((region, p, 1))
            }
            None => Some((region, p, 1)),
        };
        Ok(())
    })?;
    if let Some((r, first, count)) = run {
        let (host, off) = bases[r];
        flush(&out, host, off, (first, count), &mut done)?;
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
