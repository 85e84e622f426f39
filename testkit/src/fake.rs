//! Stand-ins for the programs a program under test runs (a peer VMM, QEMU): shell scripts
//! that act as the test needs, for what it does when its peer fails.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Writes an executable shell script with `body` at `path` and returns once it can be run.
/// Until then running it may fail with ETXTBSY: a process that another test forked while the
/// file was open for writing holds a copy of that descriptor until its own exec closes it. So
/// the script is run here (it exits at once when its first argument is `--ready`) until it
/// starts; after that nobody can hold it open for writing any more.
pub fn shell_script(path: &Path, body: &str) -> PathBuf {
    std::fs::write(
        path,
        format!("#!/bin/sh\n[ \"$1\" = --ready ] && exit 0\n{body}\n"),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    for _ in 0..500 {
        match Command::new(path).arg("--ready").status() {
            Ok(s) if s.success() => return path.to_path_buf(),
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            other => panic!("{}: {other:?}", path.display()),
        }
    }
    panic!("{}: still busy after 5 s", path.display())
}

/// A stand-in for the peer VMM `name` in `dir`: a shell script with `body`.
pub fn fake_vmm(dir: &Path, name: &str, body: &str) -> PathBuf {
    shell_script(&dir.join(name), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stand_in_runs_its_body_with_its_arguments() {
        let dir = std::env::temp_dir().join(format!("testkit-fake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vmm = fake_vmm(&dir, "qemu-system-x86_64", "echo \"peer $1\"; exit 3");
        assert_eq!(vmm, dir.join("qemu-system-x86_64"));
        let out = Command::new(&vmm).arg("--version").output().unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "peer --version\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
