//! Shared helpers for tests that run `musubi-bench` (and through it the `musubi` binary).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use testkit::{
    assert_kvm, fake_vmm, run_command, start_command, wait_with_limit, Run, Started,
};

/// `musubi-bench`, after checking that the `musubi` binary it runs VMs with is beside it
/// (`cargo test --workspace` builds both into one directory; `-p musubi-bench` alone does not).
pub fn musubi() -> Command {
    let bench = Path::new(env!("CARGO_BIN_EXE_musubi-bench"));
    let musubi = bench.with_file_name("musubi");
    assert!(
        musubi.is_file(),
        "{} is missing: these tests run VMs with it; build it first \
         (`cargo build --release -p musubi`) or run `cargo test --workspace`",
        musubi.display()
    );
    Command::new(bench)
}

/// Runs `musubi-bench` with `args`, killing it after `limit` so a hung VM fails the test
/// instead of hanging the suite.
pub fn run_with_limit(args: &[&str], limit: Duration) -> Run {
    run_command(musubi(), args, None, limit)
}

/// Runs `musubi-bench EXPERIMENT --quick` (what `musubi bench` runs) into a fresh output directory within `limit`
/// and fails the test unless it exits 0.
pub fn quick_bench(experiment: &str, limit: Duration) -> (Run, tempfile::TempDir) {
    quick_bench_with(experiment, &[], limit)
}

/// [`quick_bench`] with more arguments, e.g. `--qemu PATH`.
pub fn quick_bench_with(
    experiment: &str,
    extra: &[&str],
    limit: Duration,
) -> (Run, tempfile::TempDir) {
    quick_bench_in(musubi(), experiment, extra, limit)
}

/// [`quick_bench_with`], run by `cmd` (`musubi()` with its environment changed).
pub fn quick_bench_in(
    cmd: Command,
    experiment: &str,
    extra: &[&str],
    limit: Duration,
) -> (Run, tempfile::TempDir) {
    let out = tempfile::tempdir().unwrap();
    let mut args = vec![experiment, "--quick", "--out", out.path().to_str().unwrap()];
    args.extend_from_slice(extra);
    let r = run_command(cmd, &args, None, limit);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    (r, out)
}

/// A CSV file a benchmark wrote: its text, header and rows, columns found by name.
pub struct CsvFile {
    pub text: String,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl CsvFile {
    pub fn read(path: &Path) -> CsvFile {
        let text =
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut lines = text.lines();
        let header = split_csv_line(lines.next().expect("a header"));
        let rows = lines.map(split_csv_line).collect();
        CsvFile { text, header, rows }
    }

    pub fn col(&self, name: &str) -> usize {
        self.header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no {name} column in {:?}", self.header))
    }

    /// Asserts that each of `cols` in `row` holds a number above zero.
    pub fn assert_positive(&self, row: &[String], cols: &[&str]) {
        for &col in cols {
            let v: f64 = row[self.col(col)]
                .parse()
                .unwrap_or_else(|_| panic!("no {col} in {row:?}"));
            assert!(v > 0.0, "{col} in {row:?}");
        }
    }
}

/// The cells of one CSV line; a quoted cell may hold commas and doubled quotes (the
/// benchmarks quote QEMU's CPU models and error text).
fn split_csv_line(line: &str) -> Vec<String> {
    let mut cells = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        let cell = cells.last_mut().expect("one cell at least");
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                cell.push('"');
            }
            '"' => quoted = !quoted,
            ',' if !quoted => cells.push(String::new()),
            _ => cell.push(c),
        }
    }
    cells
}

/// A stand-in for QEMU, named like it, in `dir`: a shell script with `body`, for tests of
/// what a benchmark does when its peer fails (`--qemu` points at it).
pub fn fake_qemu(dir: &Path, body: &str) -> PathBuf {
    fake_vmm(dir, "qemu-system-x86_64", body)
}

/// The boot benchmark's CSV, split by hypervisor.
/// The most resident memory outside guest RAM a probe boot may hold. With the link order
/// of `musubi/hot.ld` the same tree measured 1.55 to 1.83 MiB on a host whose kernel maps a
/// file's large page-cache folios whole: where the folios fall moves with the binary's
/// layout (a checkout's path is in its panic messages), and one stray function costs 256 to
/// 384 KiB. The tree with replication's disks, memory storage and output commit measured
/// 1.73 to 1.86 MiB in one checkout and 2.07 MiB in a fresh clone of the same commit, so the
/// bound sits a stray function above that. Without the order it is 2.73 to 2.77 MiB, which
/// this still catches. A count, not a timing: the same run touches the same pages.
pub const RSS_OVERHEAD_BOUND_MIB: f64 = 2.25;

pub struct BootCsv {
    pub t: CsvFile,
}

impl BootCsv {
    pub fn read(out: &Path) -> BootCsv {
        BootCsv {
            t: CsvFile::read(&out.join("boot.csv")),
        }
    }

    pub fn rows_of(&self, prefix: &str) -> Vec<&Vec<String>> {
        let hv = self.t.col("hypervisor");
        self.t
            .rows
            .iter()
            .filter(|r| r[hv].starts_with(prefix))
            .collect()
    }

    /// Musubi's three quick runs, each with its figures, and none held more memory outside
    /// its guest's RAM than [`RSS_OVERHEAD_BOUND_MIB`].
    pub fn assert_musubi_measured(&self) {
        let (hello, first) = (self.t.col("to_hello_ms"), self.t.col("to_first_kvm_run_ms"));
        let musubi = self.rows_of("musubi");
        assert_eq!(
            musubi.len(),
            3,
            "three quick runs of musubi\n{}",
            self.t.text
        );
        let overhead = self.t.col("max_overhead_mib");
        for r in &musubi {
            let h: f64 = r[hello].parse().unwrap();
            let f: f64 = r[first].parse().unwrap();
            assert!(f > 0.0 && h >= f, "first KVM_RUN comes before hello: {r:?}");
            let o: f64 = r[overhead].parse().unwrap();
            assert!(
                o > 0.0 && o <= RSS_OVERHEAD_BOUND_MIB,
                "musubi held {o} MiB outside guest RAM booting the probe (at most \
                 {RSS_OVERHEAD_BOUND_MIB}: a run touches about 520 KiB of code, and \
                 musubi/hot.ld keeps it together; a function added to the start-up path and \
                 missing from that list spreads it out again: rebuild the list with \
                 scripts/hot-text): {r:?}"
            );
        }
    }
}
