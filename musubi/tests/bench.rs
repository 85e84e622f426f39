//! `musubi bench boot` with peers that fail or refuse a CPU model: Musubi still measures,
//! and the report quotes the peer. (The quick run with the real QEMU is part of `bench all`
//! in bench_smoke.rs.)

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(240);

fn boot_bench_with(qemu: &Path) -> (Run, tempfile::TempDir) {
    quick_bench_with("boot", &["--qemu", qemu.to_str().unwrap()], LIMIT)
}

/// A peer that cannot start at all: the bench still measures and writes Musubi's figures,
/// exits 0, and writes QEMU as unavailable with what it said on stderr, not as numbers.
#[test]
fn a_peer_that_fails_to_start_is_reported_unavailable_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let said = "qemu-system-x86_64: failed to initialize kvm: Operation not permitted";
    let qemu = fake_qemu(dir.path(), &format!("echo '{said}' >&2; exit 1"));
    let (r, out) = boot_bench_with(&qemu);
    let explain = r.explain();
    let csv = BootCsv::read(out.path());
    csv.assert_musubi_measured();
    let peer = csv.rows_of("qemu");
    assert_eq!(
        peer.len(),
        1,
        "one row for the unavailable peer\n{}",
        csv.t.text
    );
    let why = &peer[0][csv.t.col("unavailable")];
    assert!(why.contains(said), "the row does not quote QEMU: {why}");
    for col in [
        "to_hello_ms",
        "to_exit_ms",
        "max_overhead_mib",
        "exit_status",
    ] {
        assert!(
            peer[0][csv.t.col(col)].is_empty(),
            "{col} has a figure: {:?}",
            peer[0]
        );
    }
    // Every CPU model was tried, and the report says why there is no comparison.
    for cpu in [
        "-cpu host",
        "-cpu host,-arch-capabilities",
        "-cpu max",
        "(QEMU's default CPU model)",
    ] {
        let tried = format!("QEMU: -M microvm {cpu} did not boot the probe guest: ");
        assert!(r.stdout.contains(&tried), "{cpu} was not tried\n{explain}");
    }
    let report = r
        .stdout
        .lines()
        .find(|l| l.starts_with("qemu: unavailable, no comparison:"))
        .unwrap_or_else(|| panic!("the report does not say QEMU is unavailable\n{explain}"));
    assert!(report.contains(said), "{report}");
    assert!(out.path().join("boot.svg").exists(), "{explain}");
}

/// A QEMU that aborts on `-cpu host`, as QEMU 7.2 did on a 6.18 kernel, and boots with
/// anything else: the bench falls back to the next CPU model, says so, and measures with it.
#[test]
fn the_peer_falls_back_to_a_cpu_model_it_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let qemu = fake_qemu(
        dir.path(),
        "case \" $* \" in *' -cpu host '*) \
           echo 'qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69' >&2; kill -ABRT $$;; esac\n\
         echo '{\"probe\":\"hello\"}'; exit 1",
    );
    let (r, out) = boot_bench_with(&qemu);
    let explain = r.explain();
    assert!(
        r.stdout.contains(
            "QEMU: -M microvm -cpu host did not boot the probe guest: killed by signal 6; \
             stderr: qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69"
        ),
        "{explain}"
    );
    assert!(
        r.stdout
            .contains("QEMU: runs with -M microvm -cpu host,-arch-capabilities"),
        "{explain}"
    );
    let csv = BootCsv::read(out.path());
    csv.assert_musubi_measured();
    let peer = csv.rows_of("qemu (microvm)");
    assert_eq!(peer.len(), 3, "{}", csv.t.text);
    for row in peer {
        assert_eq!(
            row[csv.t.col("cpu_model")],
            "host,-arch-capabilities",
            "{row:?}"
        );
        assert!(row[csv.t.col("unavailable")].is_empty(), "{row:?}");
        assert!(!row[csv.t.col("to_hello_ms")].is_empty(), "{row:?}");
    }
}
