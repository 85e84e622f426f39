//! `--quick` smoke runs of the paper experiments: each runs end to end on KVM and writes
//! its CSV. Figures are not asserted (timings belong to the benchmarks); what each run
//! must show — rows for every configuration, matching results — is.

mod common;
use common::*;
use std::time::Duration;

fn bench(experiment: &str) -> (Run, tempfile::TempDir) {
    quick_bench(experiment, Duration::from_secs(400))
}

fn csv_rows(dir: &tempfile::TempDir, name: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let t = CsvFile::read(&dir.path().join(name));
    (t.header, t.rows)
}

#[test]
fn dsm_table_matches_the_paper_in_every_message_count() {
    let (r, out) = bench("dsm-table");
    assert!(r.stdout.contains("Table 3"), "{}", r.explain());
    let (h, rows) = csv_rows(&out, "dsm-table.csv");
    let col = |n: &str| h.iter().position(|c| c == n).unwrap();
    assert_eq!(
        rows.len(),
        2 * 2 * 3 * 3,
        "protocol x access x manager x c=0..2"
    );
    for row in &rows {
        assert_eq!(row[col("messages")], row[col("paper_messages")], "{row:?}");
    }
}

#[test]
fn composite_runs_every_workload_on_both_exit_paths() {
    let (r, out) = bench("composite");
    assert!(r.stdout.contains("paper 002 Table 1"), "{}", r.explain());
    let (h, rows) = csv_rows(&out, "composite.csv");
    let col = |n: &str| h.iter().position(|c| c == n).unwrap();
    for w in ["blk-small-reads", "serial-out", "port-ping", "page-touch"] {
        for at in ["user", "kernel"] {
            assert!(
                rows.iter()
                    .any(|r| r[col("workload")] == w && r[col("where")] == at),
                "{w} {at} missing"
            );
        }
    }
    // The kernel path takes no doorbell exits at all; the user path takes them.
    for row in rows
        .iter()
        .filter(|r| r[col("workload")] == "blk-small-reads")
    {
        let doorbells = || row[col("doorbell_exits")].parse::<u64>().unwrap();
        match row[col("where")].as_str() {
            "kernel" => assert_eq!(doorbells(), 0, "{row:?}"),
            "user" => assert!(doorbells() > 0, "{row:?}"),
            _ => {}
        }
    }
}

#[test]
fn seq_computes_the_same_results_natively_and_in_the_vm() {
    let (r, out) = bench("seq");
    assert!(r.stdout.contains("V/P"), "{}", r.explain());
    let (h, rows) = csv_rows(&out, "seq.csv");
    let col = |n: &str| h.iter().position(|c| c == n).unwrap();
    // getpid's result is the process id, which differs by design.
    assert_eq!(
        rows.iter()
            .filter(|r| r[col("program")] == "getpid")
            .count(),
        2
    );
    for p in ["fib", "ls", "gcc"] {
        let results: Vec<&String> = rows
            .iter()
            .filter(|r| r[col("program")] == p)
            .map(|r| &r[col("result")])
            .collect();
        assert_eq!(results.len(), 2, "{p}: one native and one VM run");
        assert_eq!(results[0], results[1], "{p}: native and VM results differ");
    }
}
