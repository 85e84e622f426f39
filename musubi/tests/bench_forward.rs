//! `musubi bench` hands its command line to the `musubi-bench` program beside `musubi`, and
//! says where it looked when that program is missing.

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// Held by each test for its whole run: a test that forks to run a program while the other
/// still has its copy of `musubi` open for writing would hand the child that descriptor,
/// and the other's exec would then fail with "Text file busy" (ETXTBSY).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A copy of the `musubi` binary alone in a fresh directory, so what lies beside it is the
/// test's choice.
fn lone_musubi() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("musubi");
    std::fs::copy(env!("CARGO_BIN_EXE_musubi"), &exe).unwrap();
    (dir, exe)
}

#[test]
fn a_missing_musubi_bench_is_named_by_path_with_the_command_that_builds_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, exe) = lone_musubi();
    let out = Command::new(&exe)
        .args(["bench", "--help"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    let looked = dir.path().join("musubi-bench");
    assert!(
        stderr.contains(&looked.display().to_string()),
        "stderr does not name {}: {stderr}",
        looked.display()
    );
    assert!(
        stderr.contains("cargo build --release -p musubi-bench"),
        "stderr: {stderr}"
    );
}

#[test]
fn arguments_help_included_and_the_exit_status_pass_through_to_musubi_bench() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, exe) = lone_musubi();
    let record = dir.path().join("args");
    testkit::shell_script(
        &dir.path().join("musubi-bench"),
        &format!("printf '%s\\n' \"$@\" > {}\nexit 7", record.display()),
    );
    let status = Command::new(&exe)
        .args(["bench", "boot", "--quick", "--help", "--out", "d i r"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    let args = std::fs::read_to_string(Path::new(&record)).unwrap();
    assert_eq!(args, "boot\n--quick\n--help\n--out\nd i r\n");
}
