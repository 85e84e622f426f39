//! `musubi bench vmms --quick` end to end: every storage, access path and warmth that the
//! host allows has a row, and the counts show the mechanism the benchmark is about — storage
//! as memory moves data without a single virtio request, virtio-blk cannot. No timing is
//! asserted.

mod common;
use common::*;
use std::collections::HashMap;
use std::time::Duration;

#[test]
fn quick_vmms_bench_covers_every_case_and_vmms_uses_no_virtio() {
    assert!(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join("qemu-system-x86_64").exists()),
        "this test compares with QEMU, and qemu-system-x86_64 is not installed \
         (Debian: apt-get install qemu-system-x86)"
    );
    let (r, out) = quick_bench("vmms", Duration::from_secs(600));
    let t = CsvFile::read(&out.path().join("vmms.csv"));
    assert!(out.path().join("vmms.svg").exists(), "no vmms.svg");
    let col = |name: &str| t.col(name);
    let (exp, storage, fs, op, path, warm, requests) = (
        col("experiment"),
        col("storage"),
        col("host_fs"),
        col("op"),
        col("path"),
        col("warm"),
        col("virtio_requests"),
    );
    let (doorbells, unavailable) = (col("run_doorbells"), col("unavailable"));
    let rows = &t.rows;
    // QEMU runs the read cases on tmpfs, or is reported unavailable with QEMU's reason.
    let peer: Vec<_> = rows
        .iter()
        .filter(|r| r[storage].starts_with("qemu"))
        .collect();
    if peer.iter().all(|r| r[unavailable].is_empty()) {
        for p in ["syscall", "mmap"] {
            for w in ["warm", "cold"] {
                assert!(
                    peer.iter().any(|r| r[fs] == "tmpfs"
                        && r[op] == "read"
                        && r[path] == p
                        && r[warm] == w),
                    "no QEMU row for read {p} {w}\n{}",
                    r.explain()
                );
            }
        }
    } else {
        assert!(
            r.stdout.contains("qemu: unavailable, no comparison:"),
            "{}",
            r.explain()
        );
    }
    let mut seen: HashMap<(String, String, String, String, String), u64> = HashMap::new();
    for row in rows
        .iter()
        .filter(|r| r[exp] == "5.2" && r[unavailable].is_empty())
    {
        let key = (
            row[storage].to_string(),
            row[fs].to_string(),
            row[op].to_string(),
            row[path].to_string(),
            row[warm].to_string(),
        );
        let n: u64 = row[requests]
            .parse()
            .unwrap_or_else(|_| panic!("no virtio request count in {row:?}"));
        // The guest counts the timed pass only, which a warm read serves from its cache;
        // the VMM's doorbell count covers the whole run (QEMU runs have none).
        let rung: Option<u64> = row[doorbells].parse().ok();
        if row[storage] == "vmms" {
            assert_eq!(n, 0, "a VMMS run posted virtio requests: {row:?}");
            assert_eq!(rung, Some(0), "a VMMS run rang a virtio doorbell: {row:?}");
        } else {
            if row[storage].starts_with("virtio") {
                assert!(
                    rung.is_some_and(|d| d > 0),
                    "a virtio run rang no doorbell: {row:?}"
                );
            }
            if row[warm] == "cold" || row[op] == "write" {
                assert!(n > 0, "a virtio run posted no virtio requests: {row:?}");
            }
        }
        seen.insert(key, n);
    }
    let none_on_tmpfs_skipped = r.stdout.contains("virtio/none is skipped");
    for s in ["vmms", "virtio/writeback", "virtio/none"] {
        for f in ["tmpfs", "disk"] {
            if s == "virtio/none" && f == "tmpfs" && none_on_tmpfs_skipped {
                continue;
            }
            for o in ["read", "write"] {
                for p in ["syscall", "mmap"] {
                    for w in ["warm", "cold"] {
                        let key = (s.into(), f.into(), o.into(), p.into(), w.into());
                        assert!(
                            seen.contains_key(&key),
                            "no row for {key:?} in vmms.csv\n{}",
                            r.explain()
                        );
                    }
                }
            }
        }
    }
    // §5.3 ran too: the alone and disturbed conditions have rows.
    let disturb = col("disturb");
    for cond in ["none", "disturb"] {
        assert!(
            rows.iter().any(|r| r[exp] == "5.3" && r[disturb] == cond),
            "no §5.3 rows for {cond}\n{}",
            r.explain()
        );
    }
    assert!(
        r.stdout.contains("MET") || r.stdout.contains("MISSED"),
        "{}",
        r.explain()
    );
}

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
