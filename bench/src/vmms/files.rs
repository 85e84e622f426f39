//! The host side of the storage: a directory on tmpfs (the paper's RAM disk) or on the
//! regular file system, whether it takes O_DIRECT, and backing files full of data.

use super::plan::{HostFs, Storage, MIB};
use std::path::{Path, PathBuf};

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// A host directory holding backing files, and what the directory's file system can do.
pub(super) struct HostDir {
    pub(super) fs: HostFs,
    pub(super) dir: tempfile::TempDir,
    /// Whether files here can be opened with O_DIRECT (`cache=none`).
    pub(super) direct: bool,
}

impl HostDir {
    pub(super) fn new(fs: HostFs) -> Result<HostDir, String> {
        let candidates: Vec<PathBuf> = match fs {
            HostFs::Tmpfs => vec!["/dev/shm".into()],
            HostFs::Disk => {
                let target = std::env::current_exe()
                    .ok()
                    .and_then(|e| e.parent().map(Path::to_path_buf));
                ["/var/tmp".into()].into_iter().chain(target).collect()
            }
        };
        let mut why = Vec::new();
        for c in candidates {
            match statfs_type(&c) {
                Some(t) if (t == TMPFS_MAGIC) != (fs == HostFs::Tmpfs) => {
                    why.push(format!("{} is the wrong kind of file system", c.display()));
                    continue;
                }
                None => {
                    why.push(format!("{} is not there", c.display()));
                    continue;
                }
                _ => {}
            }
            match tempfile::Builder::new()
                .prefix("musubi-vmms-")
                .tempdir_in(&c)
            {
                Ok(dir) => {
                    let direct = direct_io_works(dir.path());
                    return Ok(HostDir { fs, dir, direct });
                }
                Err(e) => why.push(format!("{}: {e}", c.display())),
            }
        }
        Err(format!(
            "no directory for the {} backing files: {}",
            fs.name(),
            why.join("; ")
        ))
    }

    pub(super) fn file(&self, s: Storage) -> PathBuf {
        self.dir.path().join(format!("{}.img", s.file_stem()))
    }
}

fn statfs_type(p: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs is plain integers, for which all-zero bytes are a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a properly sized out-parameter.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    (r == 0).then_some(st.f_type as i64)
}

/// Older tmpfs refuses O_DIRECT with EINVAL; `cache=none` is meaningless there.
fn direct_io_works(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(".direct-probe");
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

/// Writes a backing file with data in every byte, so reads reach real blocks and no run
/// measures the host filling holes.
pub(super) fn make_file(path: &Path, len: u64) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let block: Vec<u8> = (0..MIB).map(|i| (i * 7 + 3) as u8).collect();
    let mut left = len;
    while left > 0 {
        let n = left.min(MIB) as usize;
        f.write_all(&block[..n])
            .map_err(|e| format!("{}: {e}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| format!("{}: {e}", path.display()))
}
