//! The state directory's mode under a permissive umask. A test binary of its own: the umask is
//! process-wide, and tests running beside it in one process would create their own files
//! and directories under it.

use partition::store::Store;
use std::os::unix::fs::PermissionsExt;

#[test]
fn a_new_state_directory_is_private_whatever_the_umask() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("a/b");
    // SAFETY: umask only changes this process's file-creation mask, and no other test
    // runs in this process.
    let old = unsafe { libc::umask(0) };
    let r = Store::open(&d);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r.unwrap();
    let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}
