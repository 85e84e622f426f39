//! The host resources a VM or a partition is given, in the terms both accept them: byte
//! sizes as people write them, files that can hold storage, and the host's RAM.
//!
//! The VMM and the partition manager both take these from users and must agree on them (a
//! partition's `--memory 1.5G` is the same size as a VM's); neither needs the other for it.

mod extents;
mod size;

pub use extents::data_extents;

pub use size::{Size, SizeError, SIZE_SYNTAX};

use std::path::{Path, PathBuf};

/// A size given to a flag that is not one, with the flag and the value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {value:?}: invalid size: {why}; expected {SIZE_SYNTAX}")]
pub struct BadSize {
    pub flag: String,
    pub value: String,
    pub why: SizeError,
}

/// Parses a size given to `flag` (see [`Size`] for the grammar).
pub fn parse_size(flag: &str, value: &str) -> Result<u64, BadSize> {
    value
        .parse::<Size>()
        .map(Size::bytes)
        .map_err(|why| BadSize {
            flag: flag.to_string(),
            value: value.to_string(),
            why,
        })
}

/// A path given as storage that cannot hold it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{flag}{}: {what}; expected a regular file or a block device",
    path.display()
)]
pub struct NotStorage {
    pub flag: &'static str,
    pub path: PathBuf,
    pub what: String,
}

/// Checks that `path`, given as `flag` (e.g. `--disk path=`), can hold storage: a regular
/// file or a block device (its size and, for `O_DIRECT`, its block size are the device's
/// own). Anything else is refused before it is opened: a FIFO would block the open, a
/// directory or character device holds no blocks.
pub fn check_storage_file(flag: &'static str, path: &Path) -> Result<(), NotStorage> {
    use std::os::unix::fs::FileTypeExt;
    let refuse = |what: String| NotStorage {
        flag,
        path: path.to_path_buf(),
        what,
    };
    let ft = std::fs::metadata(path)
        .map_err(|e| {
            refuse(match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".into(),
                _ => e.to_string(),
            })
        })?
        .file_type();
    let what = if ft.is_file() || ft.is_block_device() {
        return Ok(());
    } else if ft.is_dir() {
        "is a directory"
    } else if ft.is_fifo() {
        "is a FIFO"
    } else if ft.is_char_device() {
        "is a character device"
    } else if ft.is_socket() {
        "is a socket"
    } else {
        "is not a file"
    };
    Err(refuse(what.into()))
}

/// Bytes of RAM the host has, the kernel's `MemTotal` (what /proc/meminfo shows first). The
/// one place it is read, for VM sizes and for partitions alike. `sysinfo` rather than the
/// file, which every `musubi run` checks on its way to the guest: one call instead of
/// opening, reading in growing pieces and closing a file the kernel composes from all its
/// memory counters.
pub fn host_memory_bytes() -> std::io::Result<u64> {
    // SAFETY: sysinfo only fills the struct it is given; all zeros is a valid value of it.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    (info.totalram as u64)
        .checked_mul(u64::from(info.mem_unit.max(1)))
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "RAM size overflows"))
}

/// A FIFO named `pipe` in `dir`, for tests that storage refuses one without opening it.
#[cfg(any(test, feature = "testing"))]
pub fn fifo_in(dir: &Path) -> PathBuf {
    let fifo = dir.join("pipe");
    let c = std::ffi::CString::new(fifo.to_str().expect("a UTF-8 test path"))
        .expect("a path without NUL");
    // SAFETY: mkfifo(3) with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    fifo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_name_the_flag_and_the_value() {
        assert_eq!(parse_size("--memory", "1.5G").unwrap(), 3 << 29);
        let e = parse_size("--memory", "12X").unwrap_err().to_string();
        assert!(
            e.starts_with("--memory \"12X\": invalid size:") && e.contains("e.g. 4096"),
            "{e}"
        );
    }

    #[test]
    fn host_memory_is_memtotal() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("a MemTotal line");
        assert_eq!(host_memory_bytes().unwrap(), kib * 1024);
    }

    #[test]
    fn storage_is_a_regular_file_or_a_block_device() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        std::fs::write(&file, [0u8; 512]).unwrap();
        check_storage_file("--disk path=", &file).unwrap();
        let fifo = fifo_in(dir.path());
        for (path, what) in [
            (dir.path().to_path_buf(), "is a directory"),
            (fifo, "is a FIFO"),
            ("/dev/null".into(), "is a character device"),
            (dir.path().join("missing.img"), "no such file"),
        ] {
            let e = check_storage_file("--disk path=", &path)
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("--disk path={}: {what};", path.display()))
                    && e.ends_with("expected a regular file or a block device"),
                "{e}"
            );
        }
    }
}
