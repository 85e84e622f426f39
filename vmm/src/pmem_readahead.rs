//! Host-side readahead for a memory-storage mapping, so a guest's first pass over a
//! disk-backed region does not fault the file in one host page at a time.
//!
//! Without it each guest touch of a page not yet in the host page cache is a synchronous
//! 4 KiB read by the host kernel, where virtio-blk's requests are 64 KiB and more: that is
//! why cold system-call reads of storage as memory on a disk-backed file trail virtio.

use std::io;
use std::str::FromStr;

/// What to tell the host kernel about a region's mapping when it is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Readahead {
    /// The kernel's default fault-around and readahead.
    #[default]
    Default,
    /// `MADV_SEQUENTIAL`: aggressive readahead on faults, pages dropped soon after use.
    Sequential,
    /// `MADV_WILLNEED`: start reading the whole file into the host page cache now, without
    /// waiting; the guest's faults then find the pages there (minor faults).
    WillNeed,
    /// `MADV_POPULATE_READ` (Linux 5.14): read the file and fill the page tables before the
    /// guest starts, so no guest touch faults on the host; costs the whole read up front.
    Populate,
}

impl FromStr for Readahead {
    type Err = String;

    fn from_str(s: &str) -> Result<Readahead, String> {
        match s {
            "default" => Ok(Readahead::Default),
            "sequential" => Ok(Readahead::Sequential),
            "willneed" => Ok(Readahead::WillNeed),
            "populate" => Ok(Readahead::Populate),
            _ => Err(format!(
                "{s:?}: expected default, sequential, willneed or populate"
            )),
        }
    }
}

/// Linux's `MADV_POPULATE_READ`, which the libc crate may not name on every target.
const MADV_POPULATE_READ: libc::c_int = 22;

/// Applies `how` to the mapping at `addr` of `len` bytes (a region's whole host mapping,
/// page aligned, as `mmap` returned it).
pub fn apply(addr: *mut u8, len: usize, how: Readahead) -> io::Result<()> {
    let advice = match how {
        Readahead::Default => return Ok(()),
        Readahead::Sequential => libc::MADV_SEQUENTIAL,
        Readahead::WillNeed => libc::MADV_WILLNEED,
        Readahead::Populate => MADV_POPULATE_READ,
    };
    // SAFETY: madvise only changes the kernel's paging policy for, or pre-reads, the range;
    // the caller passes a live mapping of its own, so no memory of ours changes.
    let r = unsafe { libc::madvise(addr.cast(), len, advice) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn every_advice_applies_to_a_file_mapping_and_leaves_its_bytes_alone() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        for how in ["default", "sequential", "willneed", "populate"] {
            let how: Readahead = how.parse().unwrap();
            // SAFETY: a fresh shared read-only mapping of our own file, unmapped below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    data.len(),
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            apply(p.cast(), data.len(), how).unwrap_or_else(|e| panic!("{how:?}: {e}"));
            // SAFETY: the mapping is `data.len()` readable bytes until the munmap below.
            let seen = unsafe { std::slice::from_raw_parts(p as *const u8, data.len()) };
            assert!(seen == &data[..], "{how:?} changed the bytes");
            // SAFETY: unmapping the mapping made above; `seen` is not used after.
            unsafe { libc::munmap(p, data.len()) };
        }
        assert!("fast".parse::<Readahead>().is_err());
    }
}
