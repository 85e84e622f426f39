//! `musubi bench all --quick`: one run of every paper experiment end to end on KVM, shared
//! by the tests here so CI runs each experiment once. The page it writes must show every
//! experiment with its charts; each experiment's report and CSV must show what that
//! experiment is about — rows for every configuration, matching results, the mechanism's
//! counts. Figures are not asserted (timings belong to the benchmarks).

mod common;
use common::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

/// Every experiment's quick limit together, with room for a loaded CI machine.
const ALL_LIMIT: Duration = Duration::from_secs(1800);

const EXPERIMENTS: [&str; 14] = [
    "boot",
    "composite",
    "seq",
    "dsm-table",
    "mint",
    "vmms",
    "vmp",
    "snapshot",
    "migrate",
    "net",
    "door",
    "api",
    "vsock",
    "ha",
];

/// The one `musubi bench all --quick` run, made by whichever test asks first. A run that
/// hangs fails every test here once, instead of being started again by each.
fn all_quick() -> &'static (Run, tempfile::TempDir) {
    static ALL: OnceLock<Result<(Run, tempfile::TempDir), String>> = OnceLock::new();
    let run = ALL.get_or_init(|| {
        let out = tempfile::tempdir().unwrap();
        let args = ["all", "--quick", "--out", out.path().to_str().unwrap()];
        std::panic::catch_unwind(|| run_with_limit(&args, ALL_LIMIT))
            .map(|r| (r, out))
            .map_err(|e| {
                e.downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "musubi bench all panicked".into())
            })
    });
    run.as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// One experiment of the shared run: its own report (the `EXPERIMENT.log` the run keeps)
/// as stdout, and the run's directory; the experiment must have succeeded.
fn quick(experiment: &str) -> (Run, &'static tempfile::TempDir) {
    let (all, out) = all_quick();
    assert!(
        !all.stdout.contains(&format!("== {experiment}: FAILED")),
        "{}",
        all.explain()
    );
    let log = out.path().join(format!("{experiment}.log"));
    let stdout = std::fs::read_to_string(&log).unwrap_or_else(|e| {
        panic!(
            "{}: {e}
{}",
            log.display(),
            all.explain()
        )
    });
    let r = Run {
        code: all.code,
        stdout,
        stderr: all.stderr.clone(),
    };
    (r, out)
}

/// The page has a section for every experiment, and every image it shows is a file beside
/// it (relative paths, so the directory can be moved or served as it is).
#[test]
fn bench_all_writes_a_page_with_every_experiment_and_its_charts() {
    let (r, out) = all_quick();
    let page = std::fs::read_to_string(out.path().join("index.html"))
        .unwrap_or_else(|e| panic!("index.html: {e}\n{}", r.explain()));
    for e in EXPERIMENTS {
        assert!(
            page.contains(&format!("<section id=\"{e}\">")),
            "no section for {e}\n{page}"
        );
    }
    for key in ["CPU", "kernel", "KVM", "date", "Musubi commit"] {
        assert!(
            page.contains(&format!("<th>{key}</th>")),
            "no {key}\n{page}"
        );
    }
    let images: Vec<&str> = page
        .split("<img src=\"")
        .skip(1)
        .map(|s| &s[..s.find('"').unwrap()])
        .collect();
    // Every experiment but dsm-table, which is a table only, has a chart.
    for e in EXPERIMENTS.iter().filter(|e| **e != "dsm-table") {
        assert!(
            images.contains(&format!("{e}.svg").as_str()),
            "{e}.svg is not on the page: {images:?}"
        );
    }
    for i in images {
        assert!(!Path::new(i).is_absolute(), "{i} is not relative");
        assert!(out.path().join(i).is_file(), "{i} does not exist");
    }
    assert!(!page.contains("<span class=\"fail\">"), "{page}");
    assert_eq!(r.code, Some(0), "{}", r.explain());
}

/// The boot and vmms tests compare with QEMU.
fn assert_qemu_installed() {
    assert!(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join("qemu-system-x86_64").exists()),
        "this test compares with QEMU, and qemu-system-x86_64 is not installed \
         (Debian: apt-get install qemu-system-x86)"
    );
}

/// Checks that `experiment`'s report has `heading`, and returns its CSV.
fn bench_csv(experiment: &str, heading: &str) -> CsvFile {
    let (r, _, t) = quick_csv(experiment);
    assert!(r.stdout.contains(heading), "{}", r.explain());
    t
}

/// [`quick`], with the experiment's CSV (`EXPERIMENT.csv`).
fn quick_csv(experiment: &str) -> (Run, &'static tempfile::TempDir, CsvFile) {
    let (r, out) = quick(experiment);
    let t = CsvFile::read(&out.path().join(format!("{experiment}.csv")));
    (r, out, t)
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
    for w in [
        "blk-small-reads",
        "serial-out",
        "port-ping",
        "page-touch",
        "udp-echo",
    ] {
        for path in ["user", "kernel"] {
            assert!(
                t.rows.iter().any(|r| r[workload] == w && r[at] == path),
                "{w} {path} missing"
            );
        }
    }
    // The kernel path takes no doorbell exits at all, for disk requests and packets alike;
    // the user path takes them.
    for row in t
        .rows
        .iter()
        .filter(|r| r[workload] == "blk-small-reads" || r[workload] == "udp-echo")
    {
        let doorbells = || row[doorbell_exits].parse::<u64>().unwrap();
        match row[at].as_str() {
            "kernel" => assert_eq!(doorbells(), 0, "{row:?}"),
            "user" => assert!(doorbells() > 0, "{row:?}"),
            _ => {}
        }
    }
}

/// Paper 002's Table 1 workload: a make-like build natively and on both exit paths, its
/// table beside the paper's three times with exits per file, and every object the guest
/// wrote checked against the native build (a run whose objects differ fails).
#[test]
fn composite_builds_the_make_workload_natively_and_on_both_exit_paths() {
    let (r, out) = quick("composite");
    let report = r.stdout.split("\nmake of ").nth(1).unwrap_or_else(|| {
        panic!("no make table\n{}", r.explain());
    });
    let header = report.lines().nth(1).unwrap_or_default();
    for col in [
        "paper s",
        "exits/file",
        "doorbell exits/file",
        "guest-kernel emulation",
    ] {
        assert!(header.contains(col), "no {col} column\n{report}");
    }
    for (row, paper) in [("native", "13.0"), ("user", "20.4"), ("kernel", "15.5")] {
        let line = report
            .lines()
            .find(|l| l.starts_with(&format!("{row} ")))
            .unwrap_or_else(|| panic!("no {row} row\n{report}"));
        assert!(line.contains(paper), "{line}");
    }
    assert!(
        report.contains("byte for byte the native compile"),
        "{report}"
    );
    let t = CsvFile::read(&out.path().join("composite-make.csv"));
    let (at, files, verified, doorbells) = (
        t.col("where"),
        t.col("files"),
        t.col("objects_verified"),
        t.col("doorbell_exits"),
    );
    for path in ["native", "user", "kernel"] {
        assert!(
            t.rows.iter().any(|r| r[at] == path && r[files] != "1"),
            "no full {path} build\n{}",
            t.text
        );
    }
    for row in &t.rows {
        assert_eq!(row[verified], row[files], "{row:?}");
        match row[at].as_str() {
            "kernel" => assert_eq!(row[doorbells], "0", "{row:?}"),
            "user" => assert!(row[doorbells].parse::<u64>().unwrap() > 0, "{row:?}"),
            _ => {}
        }
    }
}

/// One VM over one and two nodes: every configuration ran, over loopback, a delayed link
/// and (CI is root) network namespaces with and without the delay; each node's coherence
/// counted faults (the 2-node runs fetched pages over the wire) and no protocol error, and the
/// report has the speedup table, the links side by side, the breakdown, the fetch latencies,
/// messages beside Table 3, the most-faulted pages, and the goal lines (the kernel-page faults,
/// the slowest run against one node, and the shared counter's runs).
#[test]
fn vmp_runs_fib_on_one_and_two_nodes_with_both_protocols() {
    assert_kvm();
    let t = bench_csv("vmp", "Parallel fib over 1..");
    let (r, out) = quick("vmp");
    for heading in [
        "Breakdown per vCPU",
        "Page faults, 2n vmp/tso",
        "beside the simulator's Table 3",
        "median page fetch / (exit + RTT)",
        "2-node speedup",
        "Links side by side, 2 nodes",
        "--link-delay 100us",
        "Most-faulted pages, 2n vmp/tso",
        "kernel-page faults, worst node of any run",
        "slowest run / one node's wall",
        "shared-counter on 2 nodes, 3 runs: slowest / median (all exact)",
    ] {
        assert!(
            r.stdout.contains(heading),
            "no {heading:?}\n{}",
            r.explain()
        );
    }
    let (nodes, protocol, ordering, link, node) = (
        t.col("nodes"),
        t.col("protocol"),
        t.col("ordering"),
        t.col("link"),
        t.col("node"),
    );
    let (faults, fetches, errors) = (t.col("faults"), t.col("fetches"), t.col("protocol_errors"));
    for (n, p, o, l) in [
        ("1", "vmp", "tso", "loopback"),
        ("2", "vmp", "tso", "loopback"),
        ("2", "ivy", "tso", "loopback"),
        ("2", "vmp", "paper", "loopback"),
        ("2", "vmp", "tso", "loopback+100us"),
        ("2", "ivy", "tso", "loopback+100us"),
        ("2", "vmp", "tso", "netns"),
        ("2", "ivy", "tso", "netns+100us"),
    ] {
        let rows: Vec<_> = t
            .rows
            .iter()
            .filter(|r| r[nodes] == n && r[protocol] == p && r[ordering] == o && r[link] == l)
            .collect();
        assert!(!rows.is_empty(), "no {n}-node {p}/{o} {l} rows\n{}", t.text);
        for node_id in 0..n.parse::<u32>().unwrap() {
            assert!(
                rows.iter().any(|r| r[node] == node_id.to_string()),
                "{n}-node {p}/{o}: no row for node {node_id}\n{}",
                t.text
            );
        }
        for row in &rows {
            assert_eq!(row[errors], "0", "{row:?}");
            if n == "2" {
                assert!(row[faults].parse::<u64>().unwrap() > 0, "{row:?}");
                assert!(row[fetches].parse::<u64>().unwrap() > 0, "{row:?}");
            }
        }
    }
    assert!(out.path().join("vmp.svg").exists(), "no vmp.svg");
    assert!(
        out.path().join("vmp-latency.csv").exists(),
        "no vmp-latency.csv"
    );
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

/// With the real QEMU: Musubi's runs and QEMU's, or, if no CPU model lets QEMU boot on
/// this host, QEMU reported unavailable in its own words; either way the bench succeeds.
#[test]
fn bench_boot_quick_writes_csv_and_svg() {
    assert_kvm();
    assert_qemu_installed();
    let (r, out) = quick("boot");
    let (stdout, explain) = (&r.stdout, r.explain());
    let csv = BootCsv::read(out.path());
    csv.assert_musubi_measured();
    let (cpu, unavailable) = (csv.t.col("cpu_model"), csv.t.col("unavailable"));
    let qemu = csv.rows_of("qemu");
    let hello = csv.t.col("to_hello_ms");
    if stdout.contains("QEMU: runs with") {
        // Three runs; a peer that fails one of them drops out and its row says why.
        assert!((1..=3).contains(&qemu.len()), "{}", csv.t.text);
        for r in &qemu {
            assert!(!r[cpu].is_empty(), "{r:?}");
            assert!(
                stdout.contains(&format!("-cpu {}", r[cpu])) || r[cpu] == "default",
                "the CPU model {} is not named in the output\n{explain}",
                r[cpu]
            );
            if r[unavailable].is_empty() {
                assert!(!r[hello].is_empty(), "{r:?}");
            } else {
                assert!(
                    stdout.contains("qemu: unavailable, no comparison:"),
                    "{explain}"
                );
            }
        }
        assert!(
            qemu.len() == 3 || !qemu.last().unwrap()[unavailable].is_empty(),
            "{}",
            csv.t.text
        );
    } else {
        assert_eq!(qemu.len(), 1, "{}", csv.t.text);
        assert!(qemu[0][unavailable].contains("-cpu host"), "{:?}", qemu[0]);
        assert!(
            stdout.contains("qemu: unavailable, no comparison:"),
            "{explain}"
        );
    }
    assert_eq!(csv.t.rows.len(), 3 + qemu.len(), "{}", csv.t.text);

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
    assert_kvm();
    let (r, out, t) = quick_csv("mint");
    let (stdout, explain) = (&r.stdout, r.explain());
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

#[test]
fn quick_vmms_bench_covers_every_case_and_vmms_uses_no_virtio() {
    assert_qemu_installed();
    let (r, out, t) = quick_csv("vmms");
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

/// `musubi bench snapshot --quick` without peers: Musubi snapshots the probe guest mid-task
/// at both quick sizes and restores it to the task's end, with every figure measured; the
/// memory file is as long as RAM and sparse (the guest touched a few MiB).
#[test]
fn bench_snapshot_quick_saves_and_restores_musubi_at_both_sizes() {
    assert_kvm();
    let (r, out, t) = quick_csv("snapshot");
    let (hv, mem, unavailable) = (
        t.col("hypervisor"),
        t.col("memory_mib"),
        t.col("unavailable"),
    );
    let (len, allocated) = (
        t.col("memory_file_bytes"),
        t.col("memory_file_allocated_bytes"),
    );
    for mib in [128u64, 256] {
        let rows: Vec<_> = t
            .rows
            .iter()
            .filter(|row| row[hv] == "musubi" && row[mem] == mib.to_string())
            .collect();
        assert_eq!(rows.len(), 1, "musubi {mib} MiB\n{}", t.text);
        let row = rows[0];
        assert!(row[unavailable].is_empty(), "{row:?}");
        t.assert_positive(
            row,
            &[
                "snapshot_ms",
                "restore_first_kvm_run_ms",
                "restore_to_end_ms",
                "restore_max_rss_mib",
            ],
        );
        assert_eq!(row[len], (mib << 20).to_string(), "{row:?}");
        let on_disk: u64 = row[allocated].parse().expect("allocated bytes");
        assert!(
            on_disk < mib << 20,
            "the memory file is not sparse: {row:?}"
        );
    }
    // Without --compare no peer runs.
    assert!(t.rows.iter().all(|row| row[hv] == "musubi"), "{}", t.text);
    let svg = std::fs::read_to_string(out.path().join("snapshot.svg")).expect("snapshot.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("musubi 128 MiB"),
        "{svg}"
    );
    assert!(
        r.stdout.contains("restore to 1st KVM_RUN") && r.stdout.contains("MET")
            || r.stdout.contains("MISSED"),
        "{}",
        r.explain()
    );
}

/// `musubi bench migrate --quick` without peers: Musubi moves the probe guest mid-task at
/// both quick sizes, idle and writing, and every task ends right on the destination (the
/// write task verifies its memory), with the downtime, the total time and the pages
/// measured, beside an unmigrated run of each.
#[test]
fn bench_migrate_quick_moves_musubi_idle_and_writing_at_both_sizes() {
    assert_kvm();
    let (r, out, t) = quick_csv("migrate");
    let (hv, mem, task, migrated, mode, unavailable) = (
        t.col("hypervisor"),
        t.col("memory_mib"),
        t.col("task"),
        t.col("migrated"),
        t.col("mode"),
        t.col("unavailable"),
    );
    for mib in [128u64, 256] {
        for work in ["idle", "write"] {
            for (moved, how) in [("true", "post-copy"), ("true", "pre-copy"), ("false", "")] {
                let rows: Vec<_> = t
                    .rows
                    .iter()
                    .filter(|row| {
                        row[hv] == "musubi"
                            && row[mem] == mib.to_string()
                            && row[task].starts_with(work)
                            && row[migrated] == moved
                            && row[mode] == how
                    })
                    .collect();
                assert_eq!(
                    rows.len(),
                    1,
                    "musubi {mib} MiB {work} {moved} {how}\n{}",
                    t.text
                );
                let row = rows[0];
                assert!(row[unavailable].is_empty(), "{row:?}");
                let mut cols = vec!["task_ms"];
                if moved == "true" {
                    cols.extend(["downtime_ms", "request_to_first_kvm_run_ms", "total_ms"]);
                }
                if how == "post-copy" {
                    cols.push("data_pages");
                }
                t.assert_positive(row, &cols);
                let n = |col: &str| -> u64 { row[t.col(col)].parse().expect(col) };
                if how == "post-copy" {
                    assert!(
                        n("pages_asked") + n("pages_pushed") >= n("data_pages"),
                        "{row:?}"
                    );
                }
                if how == "pre-copy" {
                    // Every page came before the switch: none listed to follow it.
                    assert_eq!(n("data_pages"), 0, "{row:?}");
                    assert!(n("precopy_rounds") >= 1, "{row:?}");
                    assert!(n("pages_sent_live") > 0, "{row:?}");
                }
            }
        }
    }
    assert!(t.rows.iter().all(|row| row[hv] == "musubi"), "{}", t.text);
    let svg = std::fs::read_to_string(out.path().join("migrate.svg")).expect("migrate.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("musubi 128 MiB write"),
        "{svg}"
    );
    assert!(
        r.stdout.contains("musubi downtime")
            && (r.stdout.contains("MET") || r.stdout.contains("MISSED")),
        "{}",
        r.explain()
    );
}

/// `musubi bench net --quick` on its own (it runs as root, as CI does): both of Musubi's exit
/// paths complete every UDP round and the TCP stream, the kernel path with no doorbell exit
/// per packet, and the chart is written; the namespace it made is gone afterwards.
#[test]
fn bench_net_quick_runs_musubi_on_both_exit_paths_in_a_namespace_of_its_own() {
    assert_kvm();
    let out = tempfile::tempdir().unwrap();
    let args = ["net", "--quick", "--out", out.path().to_str().unwrap()];
    let r = run_with_limit(&args, Duration::from_secs(600));
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let t = CsvFile::read(&out.path().join("net.csv"));
    let c = |name: &str| t.col(name);
    let (hv, rounds, unavailable) = (c("hypervisor"), c("udp_rounds"), c("unavailable"));
    let (tcp, sink) = (c("tcp_bytes"), c("tcp_sink_bytes"));
    for path in ["musubi-kernel", "musubi-user"] {
        let rows: Vec<_> = t.rows.iter().filter(|row| row[hv] == path).collect();
        assert_eq!(rows.len(), 1, "{path}\n{}", t.text);
        let row = rows[0];
        assert!(row[unavailable].is_empty(), "{row:?}");
        assert_eq!(row[rounds], "200", "{row:?}");
        assert_eq!(row[tcp], (1 << 20).to_string(), "{row:?}");
        assert_eq!(row[sink], row[tcp], "{row:?}");
        t.assert_positive(
            row,
            &[
                "udp_kicks_per_packet",
                "udp_exits_per_packet",
                "tcp_exits_per_packet",
            ],
        );
        let value = |col: &str| -> f64 { row[c(col)].parse().expect(col) };
        // The stream is too short here for a CPU share that must be above zero.
        for col in ["tcp_vcpu_busy", "tcp_other_busy"] {
            let busy = value(col);
            assert!(busy.is_finite() && busy >= 0.0, "{col} {busy}: {row:?}");
        }
        let waiting = value("tcp_guest_waiting");
        assert!(
            (0.0..=1.0).contains(&waiting),
            "tcp_guest_waiting {waiting}: {row:?}"
        );
        if path == "musubi-kernel" {
            assert_eq!(value("udp_doorbell_exits_per_packet"), 0.0, "{row:?}");
            assert_eq!(value("tcp_doorbell_exits_per_packet"), 0.0, "{row:?}");
        } else {
            assert!(value("udp_doorbell_exits_per_packet") > 0.0, "{row:?}");
        }
    }
    let svg = std::fs::read_to_string(out.path().join("net.svg")).expect("net.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("musubi-kernel") && svg.contains("musubi-user"),
        "{svg}"
    );
    assert!(
        r.stdout.contains("doorbell exits per packet")
            && (r.stdout.contains("MET") || r.stdout.contains("MISSED")),
        "{}",
        r.explain()
    );
    // Two flows over two queue pairs beside one: each flow on a pair of its own sent frames
    // and every byte reached the sink (the bench fails otherwise).
    let f = CsvFile::read(&out.path().join("net-flows.csv"));
    assert_eq!(f.rows.len(), 1, "{}", f.text);
    flows_positive(&f);
    // Its own namespace, by the name it printed: a `bench all` run of other tests may have
    // one of its own alive meanwhile.
    let made = r
        .stdout
        .split("in the network namespace ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the bench did not name its namespace: {}", r.explain()));
    assert!(made.starts_with("musubi-bench-"), "{made}");
    let netns = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let listed = String::from_utf8_lossy(&netns.stdout);
    assert!(
        !listed.split_whitespace().any(|n| n == made),
        "the benchmark's namespace {made} was left behind: {listed}"
    );
}

/// Every throughput and frame count of `net-flows.csv`'s rows is above zero.
fn flows_positive(f: &CsvFile) {
    for row in &f.rows {
        f.assert_positive(
            row,
            &[
                "one_flow_mbit_per_s",
                "two_flows_mbit_per_s",
                "pair0_mbit_per_s",
                "pair1_mbit_per_s",
                "pair0_tx_packets",
                "pair1_tx_packets",
            ],
        );
    }
}

/// `musubi bench vsock --quick`, Musubi's row (a Firecracker found on PATH may run too):
/// every round trip, the echo and the stream went through, the host's listener counted the
/// guest's bytes and matched its CRC-32, and Musubi's counts are there.
#[test]
fn bench_vsock_quick_moves_every_byte_through_musubis_hybrid_vsock() {
    assert_kvm();
    let (r, out, t) = quick_csv("vsock");
    let c = |name: &str| t.col(name);
    let rows: Vec<_> = t
        .rows
        .iter()
        .filter(|row| row[c("hypervisor")] == "musubi")
        .collect();
    assert_eq!(rows.len(), 1, "{}", t.text);
    let row = rows[0];
    assert!(row[c("unavailable")].is_empty(), "{row:?}");
    assert_eq!(row[c("rounds")], "50", "{row:?}");
    assert_eq!(
        row[c("echoed_bytes")],
        (50 * 64 + (256 << 10)).to_string(),
        "{row:?}"
    );
    assert_eq!(row[c("send_bytes")], (1 << 20).to_string(), "{row:?}");
    assert_eq!(row[c("sink_bytes")], row[c("send_bytes")], "{row:?}");
    // CRC-32 of 1 MiB of byte i = i mod 251.
    assert_eq!(row[c("crc32")], "0xef0e6054", "{row:?}");
    t.assert_positive(
        row,
        &[
            "rtt_p50_us",
            "echo_mb_s",
            "send_mb_s",
            "echo_exits_per_mb",
            "echo_doorbells_per_mb",
            "send_exits_per_mb",
        ],
    );
    let svg = std::fs::read_to_string(out.path().join("vsock.svg")).expect("vsock.svg");
    assert!(svg.starts_with("<svg") && svg.contains("musubi"), "{svg}");
    assert!(
        r.stdout.contains("guest->host stream MB/s")
            && r.stdout.contains("Guest kernel-mode work is emulated"),
        "{}",
        r.explain()
    );
}

/// `musubi bench door --quick`: the VM over three nodes starts past every kind of stranger,
/// and node 0 logged a refusal for each stranger and none without one.
#[test]
fn bench_door_quick_starts_the_vm_past_every_kind_of_stranger() {
    assert_kvm();
    let (r, out) = quick("door");
    assert!(r.stdout.contains("refusals logged"), "{}", r.explain());
    let t = CsvFile::read(&out.path().join("door.csv"));
    let (case, refusals) = (t.col("case"), t.col("refusals_logged"));
    let cases = [
        "none",
        "garbage (4 KiB)",
        "silent",
        "early close",
        "50 connect-and-close",
        "wrong secret",
        "unknown node id",
        "second node 1",
    ];
    assert_eq!(t.rows.len(), cases.len(), "{}", t.text);
    for name in cases {
        let row = t
            .rows
            .iter()
            .find(|row| row[case] == name)
            .unwrap_or_else(|| panic!("no row for {name}\n{}", t.text));
        t.assert_positive(row, &["ms_to_vm"]);
        let n: u64 = row[refusals].parse().unwrap();
        assert_eq!(n == 0, name == "none", "{row:?}");
    }
}

/// `musubi bench api --quick` without peers: one waiting Musubi takes three cycles of
/// create, boot, shutdown and delete from Cloud Hypervisor's `ch-remote`, each timed to its
/// first KVM_RUN and back to an idle process with no vCPU thread and no guest RAM left.
#[test]
fn bench_api_quick_cycles_a_waiting_musubi_through_ch_remote() {
    assert_kvm();
    let (r, out, t) = quick_csv("api");
    let (hv, cycle, unavailable) = (t.col("hypervisor"), t.col("cycle"), t.col("unavailable"));
    let (waiting, after, guest) = (
        t.col("waiting_threads"),
        t.col("threads_after_delete"),
        t.col("guest_mappings_after_delete"),
    );
    // Without --compare no peer runs.
    assert!(t.rows.iter().all(|row| row[hv] == "musubi"), "{}", t.text);
    let cycles: Vec<&str> = t.rows.iter().map(|row| row[cycle].as_str()).collect();
    assert_eq!(cycles, ["1", "2", "3"], "{}", t.text);
    for row in &t.rows {
        assert!(row[unavailable].is_empty(), "{row:?}");
        t.assert_positive(
            row,
            &[
                "create_ms",
                "boot_ms",
                "to_first_kvm_run_ms",
                "shutdown_ms",
                "delete_ms",
                "to_idle_ms",
                "rss_after_delete_mib",
            ],
        );
        let (w, a): (u64, u64) = (row[waiting].parse().unwrap(), row[after].parse().unwrap());
        assert!(a <= w, "threads left after delete: {row:?}");
        assert_eq!(
            row[guest], "0",
            "guest RAM still mapped after delete: {row:?}"
        );
    }
    let svg = std::fs::read_to_string(out.path().join("api.svg")).expect("api.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("musubi after delete 3"),
        "{svg}"
    );
    assert!(
        r.stdout
            .contains("Musubi's time to first KVM_RUN / Cloud Hypervisor's")
            && (r.stdout.contains("MET") || r.stdout.contains("MISSED")),
        "{}",
        r.explain()
    );
}

/// `musubi bench ha --quick`: fib and mem-check unreplicated and at every epoch, each
/// replicated run protected by its standby with its pauses and bytes counted; the primary
/// killed twice, each kill timed to the standby's first KVM_RUN (the standby then ended fib
/// exactly, or the run failed); in network namespaces (CI runs it as root), udp-echo at
/// every epoch with its rate and round trips, and two kills with a udp-counter client, each
/// timed to the client's first answer from the standby, its answers checked for repeats and
/// gaps.
#[test]
fn bench_ha_quick_replicates_fib_and_mem_check_and_times_each_failover() {
    assert_kvm();
    let (r, out, t) = quick_csv("ha");
    let c = |name: &str| t.col(name);
    let (measure, task, epoch) = (c("measure"), c("task"), c("epoch_ms"));
    for work in ["fib", "mem-check"] {
        for e in ["", "5", "20", "50"] {
            let rows: Vec<_> = t
                .rows
                .iter()
                .filter(|row| row[measure] == "overhead" && row[task] == work && row[epoch] == e)
                .collect();
            assert_eq!(rows.len(), 1, "{work} epoch {e:?}\n{}", t.text);
            let row = rows[0];
            t.assert_positive(row, &["wall_ms", "guest_task_ms", "own_core_ms"]);
            if e.is_empty() {
                assert!(row[c("epochs_sent")].is_empty(), "{row:?}");
            } else {
                t.assert_positive(
                    row,
                    &[
                        "epochs_sent",
                        "epochs_acked",
                        "bytes_per_epoch_median",
                        "pause_us_median",
                        "effective_epoch_ms",
                    ],
                );
                let n = |col: &str| -> u64 { row[c(col)].parse().expect(col) };
                assert!(n("pause_us_p99") >= n("pause_us_median"), "{row:?}");
                assert!(n("pause_us_max") >= n("pause_us_p99"), "{row:?}");
                assert!(n("epochs_sent") >= n("epochs_acked"), "{row:?}");
            }
        }
    }
    let kills: Vec<_> = t
        .rows
        .iter()
        .filter(|row| row[measure] == "failover")
        .collect();
    assert_eq!(kills.len(), 2, "{}", t.text);
    for row in kills {
        t.assert_positive(row, &["kill_to_first_kvm_run_ms", "acked_before_kill"]);
        assert_eq!(row[c("heartbeat_ms")], "100", "{row:?}");
        assert!(row[c("kill_to_first_answer_ms")].is_empty(), "{row:?}");
    }
    for e in ["", "5", "20", "50"] {
        let rows: Vec<_> = t
            .rows
            .iter()
            .filter(|row| row[measure] == "overhead" && row[task] == "udp-echo" && row[epoch] == e)
            .collect();
        assert_eq!(rows.len(), 1, "udp-echo epoch {e:?}\n{}", t.text);
        let row = rows[0];
        t.assert_positive(row, &["echo_rate_per_s", "echo_p50_us", "echo_p99_us"]);
        let n = |col: &str| -> u64 { row[c(col)].parse().expect(col) };
        assert!(n("echo_p99_us") >= n("echo_p50_us"), "{row:?}");
        if !e.is_empty() {
            // Held until its epoch is acknowledged: a round trip waits for a checkpoint.
            assert!(n("echo_p50_us") >= 1000, "{row:?}");
            t.assert_positive(row, &["epochs_acked"]);
        }
    }
    let client_kills: Vec<_> = t
        .rows
        .iter()
        .filter(|row| row[measure] == "failover-client")
        .collect();
    assert_eq!(client_kills.len(), 2, "{}", t.text);
    for row in client_kills {
        t.assert_positive(
            row,
            &[
                "kill_to_first_answer_ms",
                "kill_to_first_kvm_run_ms",
                "acked_before_kill",
                "answers",
            ],
        );
        assert_eq!(row[c("heartbeat_ms")], "100", "{row:?}");
        let n = |col: &str| -> u64 { row[c(col)].parse().expect(col) };
        assert!(n("answers") >= n("answers_at_kill") + 30, "{row:?}");
        assert_eq!(n("answers_repeated"), 0, "{row:?}");
    }
    let svg = std::fs::read_to_string(out.path().join("ha.svg")).expect("ha.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("fib 20 ms") && svg.contains("failover"),
        "{svg}"
    );
    for said in [
        "fib task time on its own core, replicated / unreplicated, 20 ms epoch",
        "SIGKILL to standby's first KVM_RUN",
        "SIGKILL to the client's first answer",
        "udp-counter answers repeated over 2 kills",
        "udp-counter answers skipped over 2 kills",
    ] {
        assert!(r.stdout.contains(said), "{said}\n{}", r.explain());
    }
    assert!(
        r.stdout.contains("MET") || r.stdout.contains("MISSED"),
        "{}",
        r.explain()
    );
}
