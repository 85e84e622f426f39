//! `--quick` smoke runs of the paper experiments: each runs end to end on KVM and writes
//! its CSV. Figures are not asserted (timings belong to the benchmarks); what each run
//! must show — rows for every configuration, matching results — is.

mod common;
use common::*;
use std::time::Duration;

/// Runs `musubi bench EXPERIMENT --quick`, checks that its report has `heading`, and
/// returns its CSV.
fn bench_csv(experiment: &str, heading: &str) -> CsvFile {
    let (r, out) = quick_bench(experiment, Duration::from_secs(400));
    assert!(r.stdout.contains(heading), "{}", r.explain());
    CsvFile::read(&out.path().join(format!("{experiment}.csv")))
}

#[test]
fn dsm_table_matches_the_paper_in_every_message_count() {
    let t = bench_csv("dsm-table", "Table 3");
    assert_eq!(
        t.rows.len(),
        2 * 2 * 3 * 3,
        "protocol x access x manager x c=0..2"
    );
    let (messages, paper) = (t.col("messages"), t.col("paper_messages"));
    for row in &t.rows {
        assert_eq!(row[messages], row[paper], "{row:?}");
    }
}

#[test]
fn composite_runs_every_workload_on_both_exit_paths() {
    let t = bench_csv("composite", "paper 002 Table 1");
    let (workload, at, doorbell_exits) =
        (t.col("workload"), t.col("where"), t.col("doorbell_exits"));
    for w in ["blk-small-reads", "serial-out", "port-ping", "page-touch"] {
        for path in ["user", "kernel"] {
            assert!(
                t.rows.iter().any(|r| r[workload] == w && r[at] == path),
                "{w} {path} missing"
            );
        }
    }
    // The kernel path takes no doorbell exits at all; the user path takes them.
    for row in t.rows.iter().filter(|r| r[workload] == "blk-small-reads") {
        let doorbells = || row[doorbell_exits].parse::<u64>().unwrap();
        match row[at].as_str() {
            "kernel" => assert_eq!(doorbells(), 0, "{row:?}"),
            "user" => assert!(doorbells() > 0, "{row:?}"),
            _ => {}
        }
    }
}

#[test]
fn seq_computes_the_same_results_natively_and_in_the_vm() {
    let t = bench_csv("seq", "V/P");
    let (program, result) = (t.col("program"), t.col("result"));
    // getpid's result is the process id, which differs by design.
    assert_eq!(t.rows.iter().filter(|r| r[program] == "getpid").count(), 2);
    for p in ["fib", "ls", "gcc"] {
        let results: Vec<&String> = t
            .rows
            .iter()
            .filter(|r| r[program] == p)
            .map(|r| &r[result])
            .collect();
        assert_eq!(results.len(), 2, "{p}: one native and one VM run");
        assert_eq!(results[0], results[1], "{p}: native and VM results differ");
    }
}
