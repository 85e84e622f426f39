//! One `--pmem` file: opened with the access its region needs, and the byte count the guest
//! will see, with every refusal saying how to fix the file.

use super::{describe_size, file_err, PmemConfig, PmemError, MIB, PMEM_ALIGN};
use crate::config::check_storage_file;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use tracing::info;

/// `64M` for whole MiB, else the byte count: what `truncate -s` and `size=` accept.
fn short_size(bytes: u64) -> String {
    if bytes.is_multiple_of(MIB) {
        format!("{}M", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// Opens a file for a region and returns it with the byte count the guest will see.
pub(super) fn open_file(c: &PmemConfig) -> Result<(File, u64), PmemError> {
    let f = &c.file;
    // Kind first, by name: opening a FIFO would block until a writer came.
    if f.exists() {
        check_storage_file("--pmem file=", f)?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!c.readonly)
        .open(f)
        .map_err(|e| {
            file_err(
                f,
                match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        format!(
                            "no such file (create it, e.g. `truncate -s 64M {}`)",
                            f.display()
                        )
                    }
                    std::io::ErrorKind::PermissionDenied if !c.readonly => {
                        "permission denied (add readonly=on to map it read-only)".to_string()
                    }
                    _ if e.raw_os_error() == Some(libc::EROFS) => {
                        "read-only filesystem (add readonly=on)".to_string()
                    }
                    _ => e.to_string(),
                },
            )
        })?;
    let len = (&file)
        .seek(SeekFrom::End(0))
        .map_err(|e| file_err(f, format!("finding its length: {e}")))?;
    if len == 0 {
        return Err(file_err(
            f,
            format!(
                "the file is empty; give it a size first, e.g. `truncate -s 64M {}`",
                f.display()
            ),
        ));
    }
    let size = match c.size {
        Some(0) => return Err(file_err(f, "size=0: a region needs at least 2 MiB")),
        Some(s) if s > len => {
            return Err(file_err(
                f,
                format!(
                    "size= asks for {} but the file has only {}; grow it with `truncate -s {} {}` \
                     or drop size=",
                    describe_size(s),
                    describe_size(len),
                    short_size(s),
                    f.display()
                ),
            ))
        }
        Some(s) => s,
        None => len,
    };
    if !size.is_multiple_of(PMEM_ALIGN) {
        let up = size.next_multiple_of(PMEM_ALIGN);
        let down = size / PMEM_ALIGN * PMEM_ALIGN;
        let what = if c.size.is_some() {
            "size="
        } else {
            "the file"
        };
        let mut fix = format!(
            "grow the file to {} (`truncate -s {} {}`)",
            describe_size(up),
            short_size(up),
            f.display()
        );
        if down > 0 {
            fix.push_str(&format!(" or give size={}", short_size(down)));
        }
        return Err(file_err(
            f,
            format!(
                "{what} is {}, not a whole number of 2 MiB (guests map persistent memory in \
                 2 MiB sections); {fix}",
                describe_size(size),
            ),
        ));
    }
    if size > len {
        unreachable!("size was checked against the file length");
    }
    if len > size {
        info!(
            file = %f.display(),
            len,
            size,
            "--pmem: the guest sees the first {size} bytes of a {len}-byte file"
        );
    }
    Ok((file, size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pmem::test_files::{cfg, file_of};

    fn open_err(c: &PmemConfig) -> String {
        match open_file(c) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_files_are_refused_with_flag_and_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.img");
        let e = open_err(&cfg(&missing));
        assert!(
            e.contains("--pmem file=") && e.contains("nope.img") && e.contains("no such file"),
            "{e}"
        );

        let empty = file_of(0);
        let e = open_err(&cfg(empty.path()));
        assert!(
            e.contains("empty") && e.contains(&empty.path().display().to_string()),
            "{e}"
        );

        let odd = file_of(3 * MIB);
        let e = open_err(&cfg(odd.path()));
        assert!(e.contains("2 MiB") && e.contains("4 MiB"), "{e}");

        let small = file_of(4096);
        let e = open_err(&cfg(small.path()));
        assert!(e.contains("2 MiB"), "{e}");

        let f = file_of(4 * MIB);
        let mut c = cfg(f.path());
        c.size = Some(8 * MIB);
        let e = open_err(&c);
        assert!(
            e.contains("size=") && e.contains("only 4194304 bytes"),
            "{e}"
        );
        c.size = Some(3 * MIB);
        let e = open_err(&c);
        assert!(e.contains("size= is 3145728 bytes (3 MiB)"), "{e}");
        c.size = Some(0);
        assert!(open_err(&c).contains("size=0"));
    }

    #[test]
    fn only_regular_files_and_block_devices_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = host_resources::fifo_in(dir.path());
        // A FIFO is refused by its kind, not waited on.
        for (path, what) in [(dir.path(), "is a directory"), (&fifo, "is a FIFO")] {
            let e = open_err(&cfg(path));
            assert!(
                e.starts_with(&format!("--pmem file={}: {what};", path.display())),
                "{e}"
            );
        }
    }
}
