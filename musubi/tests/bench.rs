//! `musubi bench boot` end to end: it boots real VMs, writes one CSV row per run and a chart.

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(240);

/// The boot benchmark's CSV, split by hypervisor.
struct BootCsv {
    t: CsvFile,
}

impl BootCsv {
    fn read(out: &Path) -> BootCsv {
        BootCsv {
            t: CsvFile::read(&out.join("boot.csv")),
        }
    }

    fn rows_of(&self, prefix: &str) -> Vec<&Vec<String>> {
        let hv = self.t.col("hypervisor");
        self.t
            .rows
            .iter()
            .filter(|r| r[hv].starts_with(prefix))
            .collect()
    }

    /// Musubi's three quick runs, each with its figures.
    fn assert_musubi_measured(&self) {
        let (hello, first) = (self.t.col("to_hello_ms"), self.t.col("to_first_kvm_run_ms"));
        let musubi = self.rows_of("musubi");
        assert_eq!(
            musubi.len(),
            3,
            "three quick runs of musubi\n{}",
            self.t.text
        );
        for r in &musubi {
            let h: f64 = r[hello].parse().unwrap();
            let f: f64 = r[first].parse().unwrap();
            assert!(f > 0.0 && h >= f, "first KVM_RUN comes before hello: {r:?}");
        }
    }
}

fn boot_bench_with(qemu: &Path) -> (Run, tempfile::TempDir) {
    quick_bench_with("boot", &["--qemu", qemu.to_str().unwrap()], LIMIT)
}

/// With the real QEMU: Musubi's runs and QEMU's, or, if no CPU model lets QEMU boot on
/// this host, QEMU reported unavailable in its own words; either way the bench succeeds.
#[test]
fn bench_boot_quick_writes_csv_and_svg() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test boots VMs and needs /dev/kvm, which this machine lacks"
    );
    assert!(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join("qemu-system-x86_64").exists()),
        "this test compares with QEMU, and qemu-system-x86_64 is not installed \
         (Debian: apt-get install qemu-system-x86)"
    );
    let (r, out) = quick_bench("boot", LIMIT);
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
