//! Where a sparse file holds data: what a snapshot's memory file is read by, so pages in its
//! holes are known to be zeros without reading them.

use std::fs::File;
use std::os::fd::AsRawFd;

/// The data extents of `file` within `[start, start + len)`, as sorted (offset from
/// `start`, length) pairs, found with SEEK_DATA and SEEK_HOLE. A file system without them
/// reports the whole file as data, which is still right, only slower to use.
pub fn data_extents(file: &File, start: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let end = start + len;
    let mut out = Vec::new();
    let mut at = start;
    // Each turn moves `at` past one data extent, so this ends.
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
        at = hole.max(data + 1);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn data_extents_skip_holes() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 8 << 20).unwrap();
        let ext = data_extents(&f, 0, 64 << 20).unwrap();
        let covered = ext.iter().any(|&(s, l)| s <= 8 << 20 && s + l > 8 << 20);
        assert!(covered, "{ext:?}");
        assert!(ext.iter().map(|e| e.1).sum::<u64>() < 64 << 20, "{ext:?}");
        assert!(data_extents(&f, 16 << 20, 16 << 20).unwrap().is_empty());
        let from_8m = data_extents(&f, 8 << 20, 4096).unwrap();
        assert_eq!(from_8m.first().map(|e| e.0), Some(0), "{from_8m:?}");
    }
}
