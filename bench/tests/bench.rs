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

/// Firecracker and Cloud Hypervisor on PATH that fail at once (stand-ins: CI has neither):
/// each is reported unavailable with what it said, in the CSV and the report, with no
/// figures; Musubi's runs are measured and written, and the bench exits 0.
#[test]
fn failing_firecracker_and_cloud_hypervisor_are_reported_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let said = |name: &str| format!("{name}: Error: cannot open /dev/kvm (fake)");
    for name in ["firecracker", "cloud-hypervisor"] {
        fake_vmm(
            dir.path(),
            name,
            &format!("echo '{}' >&2; exit 1", said(name)),
        );
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut cmd = musubi();
    cmd.env(
        "PATH",
        std::env::join_paths(
            std::iter::once(dir.path().to_path_buf()).chain(std::env::split_paths(&path)),
        )
        .unwrap(),
    );
    let (r, out) = quick_bench_in(
        cmd,
        "boot",
        &["--compare", "firecracker,cloud-hypervisor"],
        LIMIT,
    );
    let explain = r.explain();
    let csv = BootCsv::read(out.path());
    csv.assert_musubi_measured();
    assert!(
        csv.rows_of("qemu").is_empty(),
        "qemu was not listed
{}",
        csv.t.text
    );
    for name in ["firecracker", "cloud-hypervisor"] {
        let rows = csv.rows_of(name);
        assert_eq!(
            rows.len(),
            1,
            "one row for {name}
{}",
            csv.t.text
        );
        let why = &rows[0][csv.t.col("unavailable")];
        assert!(
            why.contains(&said(name)),
            "the row does not quote {name}: {why}"
        );
        for col in ["to_first_kvm_run_ms", "to_hello_ms", "max_overhead_mib"] {
            assert!(rows[0][csv.t.col(col)].is_empty(), "{col}: {:?}", rows[0]);
        }
        let report = r
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name}: unavailable, no comparison:")))
            .unwrap_or_else(|| panic!("the report does not say {name} is unavailable\n{explain}"));
        assert!(report.contains(&said(name)), "{report}");
    }
    assert_eq!(csv.t.rows.len(), 3 + 2, "{}", csv.t.text);
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
