//! `musubi bench boot` end to end: it boots real VMs, writes one CSV row per run and a chart.

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(240);

#[test]
fn bench_boot_quick_writes_csv_and_svg() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test boots VMs and needs /dev/kvm, which this machine lacks"
    );
    let (r, out) = quick_bench("boot", LIMIT);
    let (stdout, explain) = (&r.stdout, r.explain());
    let t = CsvFile::read(&out.path().join("boot.csv"));
    let (csv, rows) = (&t.text, &t.rows);
    let (hv, hello, first) = (
        t.col("hypervisor"),
        t.col("to_hello_ms"),
        t.col("to_first_kvm_run_ms"),
    );
    let musubi: Vec<_> = rows.iter().filter(|r| r[hv] == "musubi").collect();
    assert_eq!(musubi.len(), 3, "three quick runs of musubi\n{csv}");
    for r in &musubi {
        let h: f64 = r[hello].parse().unwrap();
        let f: f64 = r[first].parse().unwrap();
        assert!(f > 0.0 && h >= f, "first KVM_RUN comes before hello: {r:?}");
    }
    let qemu = rows.iter().filter(|r| r[hv].starts_with("qemu")).count();
    assert!(
        qemu == 0 || qemu == 3,
        "QEMU runs all or none: {qemu}\n{csv}"
    );
    assert_eq!(rows.len(), 3 + qemu, "{csv}");
    if qemu == 0 {
        assert!(stdout.contains("QEMU: skipped"), "{explain}");
    }

    let svg = std::fs::read_to_string(out.path().join("boot.svg")).expect("boot.svg");
    assert!(svg.starts_with("<svg") && svg.contains("musubi"), "{svg}");
    assert!(
        stdout.contains("MET") || stdout.contains("MISSED"),
        "{explain}"
    );
}

/// `musubi bench mint` creates two partitions and boots VMs in them, so it needs /dev/kvm and
/// a writable cgroupfs (root); without them it fails, and so does this test.
#[test]
fn bench_mint_quick_covers_all_seven_configurations() {
    const MINT_LIMIT: Duration = Duration::from_secs(180);
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test boots VMs and needs /dev/kvm, which this machine lacks"
    );
    let (r, out) = quick_bench("mint", MINT_LIMIT);
    let (stdout, explain) = (&r.stdout, r.explain());
    let t = CsvFile::read(&out.path().join("mint.csv"));
    let (csv, rows) = (&t.text, &t.rows);
    let (config, workload, ns) = (t.col("config"), t.col("workload"), t.col("ns"));
    for c in 1..=7 {
        let mine: Vec<_> = rows.iter().filter(|r| r[config] == c.to_string()).collect();
        for w in ["cpu", "mem-256K", "mem-1024K", "io-256K", "io-1024K"] {
            assert!(
                mine.iter().any(|r| r[workload] == w),
                "no {w} rows for configuration {c}\n{csv}"
            );
        }
        for r in &mine {
            let v: f64 = r[ns].parse().unwrap();
            assert!(v > 0.0, "a repetition took no time: {r:?}");
        }
    }
    assert!(out.path().join("mint.svg").exists(), "{explain}");
    assert!(
        stdout.contains("MET") || stdout.contains("MISSED"),
        "{explain}"
    );
    // Nothing of the benchmark's partitions is left behind.
    assert!(
        std::fs::read_dir(out.path())
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with("mint-disks")),
        "scratch disks left in {}",
        out.path().display()
    );
}
