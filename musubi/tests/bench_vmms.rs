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
    let doorbells = col("run_doorbells");
    let rows = &t.rows;
    let mut seen: HashMap<(String, String, String, String, String), u64> = HashMap::new();
    for row in rows.iter().filter(|r| r[exp] == "5.2") {
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
