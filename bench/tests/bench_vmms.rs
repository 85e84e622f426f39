//! `musubi bench vmms --quick` with a peer that fails: Musubi's figures are still measured
//! and written. (The quick run with the real QEMU is part of `bench all` in bench_smoke.rs.)

mod common;
use common::*;
use std::time::Duration;

/// A QEMU that cannot start: the benchmark measures and writes every Musubi configuration,
/// exits 0, and writes QEMU as unavailable, quoting its error, instead of figures.
#[test]
fn quick_vmms_bench_survives_a_peer_that_fails() {
    let dir = tempfile::tempdir().unwrap();
    let said = "qemu-system-x86_64: -drive if=none: Could not open: Permission denied";
    let qemu = fake_qemu(dir.path(), &format!("echo '{said}' >&2; exit 1"));
    let (r, out) = quick_bench_with(
        "vmms",
        &["--compare", "qemu", "--qemu", qemu.to_str().unwrap()],
        Duration::from_secs(600),
    );
    let t = CsvFile::read(&out.path().join("vmms.csv"));
    let (storage, ns, unavailable) = (t.col("storage"), t.col("ns"), t.col("unavailable"));
    let peer: Vec<_> = t
        .rows
        .iter()
        .filter(|r| r[storage].starts_with("qemu"))
        .collect();
    assert_eq!(
        peer.len(),
        1,
        "one row for the unavailable peer\n{}",
        t.text
    );
    assert!(
        peer[0][ns].is_empty(),
        "the peer has a figure: {:?}",
        peer[0]
    );
    assert!(peer[0][unavailable].contains(said), "{:?}", peer[0]);
    for s in ["vmms", "virtio/writeback"] {
        let ours = t.rows.iter().filter(|r| r[storage] == s).count();
        assert!(
            ours >= 16,
            "{ours} rows of {s}: Musubi's runs are missing\n{}",
            t.text
        );
    }
    assert!(
        t.rows
            .iter()
            .filter(|r| !r[storage].starts_with("qemu"))
            .all(|r| r[ns].parse::<f64>().is_ok() && r[unavailable].is_empty()),
        "{}",
        t.text
    );
    let report = r
        .stdout
        .lines()
        .find(|l| l.starts_with("qemu: unavailable, no comparison:"))
        .unwrap_or_else(|| {
            panic!(
                "the report does not say QEMU is unavailable\n{}",
                r.explain()
            )
        });
    assert!(report.contains(said), "{report}");
}
