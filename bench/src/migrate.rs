//! `musubi bench migrate`: live migration of a running probe guest between two `musubi run`
//! processes on loopback, post-copy and pre-copy on the same VMM, and Cloud Hypervisor's
//! (pre-copy) migration beside them with `--compare cloud-hypervisor`.
//!
//! Each migrated run starts a destination (`run --receive-migration tcp:127.0.0.1:PORT`),
//! boots the source with its API socket, waits for hello on its console and then asks it
//! to move (`PUT /api/v1/vm.send-migration`). Measured:
//!
//! - downtime: from the source's `KVM_GET_CLOCK`, which Musubi (and Cloud Hypervisor)
//!   issues right after its vCPUs have stopped in the pause, to the destination's first
//!   `KVM_RUN`, both from the kernel's `sys_enter_ioctl` tracepoint (`CLOCK_MONOTONIC`,
//!   one host); the same interval from the request instead of the pause is kept as an upper
//!   bound, and the destination's `--report` stamp as a check;
//! - total: from the request to the source process's exit;
//! - pages: data pages, pages asked for by the destination and pushed by the source, and
//!   for a pre-copy its rounds and the pages sent while the VM ran and during the pause,
//!   from the source's `migrated` log line;
//! - slowdown: the guest task's own time (the `ns` of its result line) migrated, against
//!   the same task in an unmigrated run of the same size.

use super::apivm::{api, one_line, wait_until, Vm, Vmm};
use super::driver::{
    measured_per_config, print_unavailable, summary_bars, Columns, Missing, Outputs, PeerRow, Runs,
    Verdicts,
};
use super::kvm_trace::{KvmRunTrace, KVM_GET_CLOCK};
use super::peers::{self, Kind, Micro};
use super::qemu::{Outcome, Standing};
use super::report::{cell, median_min, ms, ram_size, ram_sizes, Csv, Figure, Table};
use super::stats::{ratio, Summary};
use super::{plot, BenchArgs, Harness};
use musubi_types::RunReport;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::monotonic_ns;

const HELLO: &str = "{\"probe\":\"hello\"";
/// Bounds on every wait: a boot to hello, a listening destination, a source's exit after
/// its migration, a whole run of a guest's task.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
const EXIT_TIMEOUT: Duration = Duration::from_secs(60);
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// The VMMs' own limit, above ours, so a run we abandon does not outlive us by much.
const VM_TIMEOUT_S: &str = "400";

/// The goals.
const GOAL_DOWNTIME_MS: f64 = 5.0;
const GOAL_VS_CH: f64 = 0.1;
const GOAL_SOURCE: &str = "Musubi goal, same run";

/// The guest's task after hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    /// `timer` [`IDLE_TIMERS`] times: each waits 20 ticks (200 ms) on the LAPIC timer,
    /// touching no memory.
    Idle,
    /// `mem-check=MIB,iters=R`: fills MIB ([`write_mib`]) with a pattern, rewrites a
    /// sixteenth of it per round (about 5 GiB written in all, 2 s here), and verifies all of
    /// it (its `errors` must be 0).
    Write,
}

impl Work {
    fn name(self) -> &'static str {
        match self {
            Work::Idle => "idle",
            Work::Write => "write",
        }
    }

    fn probe(self) -> &'static str {
        match self {
            Work::Idle => "timer",
            Work::Write => "mem-check",
        }
    }

    fn task(self, mib: u64) -> String {
        match self {
            Work::Idle => ["timer"; IDLE_TIMERS].join(","),
            Work::Write => {
                let m = write_mib(mib);
                format!("mem-check={m},iters={}", (WRITE_TOTAL_MIB * 16 / m).max(16))
            }
        }
    }

    /// Result lines a run prints.
    fn lines(self) -> usize {
        match self {
            Work::Idle => IDLE_TIMERS,
            Work::Write => 1,
        }
    }

    fn short(self, mib: u64) -> String {
        match self {
            Work::Idle => format!("idle ({IDLE_TIMERS}x timer)"),
            Work::Write => format!("write (mem-check={})", write_mib(mib)),
        }
    }
}

const IDLE_TIMERS: usize = 10;
/// MiB `mem-check` rewrites in its rounds.
const WRITE_TOTAL_MIB: u64 = 12288;

/// `mem-check`'s size: an eighth of RAM, at most 240 MiB (the probe's user buffer is a
/// quarter of RAM less a little, and at most 255 MiB).
fn write_mib(mib: u64) -> u64 {
    (mib / 8).clamp(1, 240)
}

#[derive(Clone, Debug)]
struct Config {
    vmm: Vmm,
    mib: u64,
    work: Work,
    migrated: bool,
    /// Musubi's pre-copy rather than its post-copy (a peer migrates its own way).
    precopy: bool,
}

impl Config {
    fn vmm_name(&self) -> &'static str {
        self.vmm.name()
    }

    fn tasks(&self) -> String {
        format!("hello,{}", self.work.task(self.mib))
    }

    fn name(&self) -> String {
        format!(
            "{} {} {}{}",
            self.vmm_name(),
            ram_size(self.mib),
            self.work.name(),
            match (self.migrated, self.precopy) {
                (false, _) => " unmigrated",
                (true, true) => " pre-copy",
                (true, false) => "",
            }
        )
    }

    /// How guest RAM moved, for the CSV and the table.
    fn mode(&self) -> &'static str {
        match (&self.vmm, self.migrated, self.precopy) {
            (_, false, _) => "",
            (Vmm::Peer(_), true, _) => "its own (pre-copy)",
            (_, true, true) => "pre-copy",
            (_, true, false) => "post-copy",
        }
    }
}

/// One run's figures; times in ns. An unmigrated run has only `task_ns`.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// The source's KVM_GET_CLOCK after its pause to the destination's first KVM_RUN.
    downtime_ns: Option<u64>,
    /// The request to the destination's first KVM_RUN (an upper bound of the downtime).
    from_request_ns: Option<u64>,
    /// The destination's `--report` first_run_monotonic_ns, less the source's pause.
    report_downtime_ns: Option<u64>,
    /// The request to its answer.
    answer_ns: Option<u64>,
    /// The request to the source process's exit.
    total_ns: Option<u64>,
    data_pages: Option<u64>,
    asked: Option<u64>,
    pushed: Option<u64>,
    /// Pre-copy: rounds while the VM ran, pages sent then, and pages sent in the pause.
    rounds: Option<u64>,
    live: Option<u64>,
    paused: Option<u64>,
    /// The task's own time, from its result line.
    task_ns: u64,
}

/// The runs of every configuration; a peer's may have failed or not been made.
type MigrateRuns = Runs<Config, Outcome<Sample>>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let reps = if h.quick { 1 } else { 5 };
    let sizes: &[u64] = if h.quick {
        &[128, 256]
    } else {
        &[256, 1024, 4096]
    };
    let listed = peers::parse_compare(args.compare.as_deref())?;
    let trace = KvmRunTrace::open_with(&[KVM_GET_CLOCK]).map_err(|e| {
        format!("downtime is timed by the kernel's sys_enter_ioctl tracepoint: {e}")
    })?;
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    print_plan(sizes, reps, &trace);
    let (vmms, missing) = vmms(h, &listed, exe, &elf, sizes[0]);
    let configs = plan(h, &vmms, &elf, sizes)?;
    let runs = measure(h, configs, reps, &trace)?;
    let csv_path = Outputs::new(h).csv("migrate.csv", &csv(&runs, &missing))?;
    let sums = Found {
        configs: &runs.configs,
        sums: measured_per_config(&runs)
            .iter()
            .map(|s| Sums::of(s))
            .collect(),
    };
    print_table(&sums);
    print_unavailable(
        runs.configs
            .iter()
            .map(Config::vmm_name)
            .zip(&runs.standing),
        &missing,
    );
    println!();
    print!("{}", verdicts(&sums, sizes, &listed).table());
    if !listed.contains(&"cloud-hypervisor") {
        println!(
            "(no --compare cloud-hypervisor: the goal against Cloud Hypervisor is not measured)"
        );
    }
    if h.quick {
        println!(
            "(--quick: 128 and 256 MiB, one run each; the goal is stated for 256 MiB to 4 GiB)"
        );
    }
    println!();
    println!(
        "This machine runs KVM nested: the guest's CPL0 code is emulated (slow), and every EPT"
    );
    println!(
        "fault is handled by two hypervisors, so the task times and their slowdown are inflated;"
    );
    println!("the downtime is VMM work on the host and less distorted.");
    let svg_path = Outputs::new(h).bars("migrate.svg", "musubi bench migrate", &panels(&sums))?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

/// The runs and, beside them, whether each configuration's peer is still in the running.
struct Measured {
    runs: MigrateRuns,
    standing: Vec<Standing>,
}

impl std::ops::Deref for Measured {
    type Target = MigrateRuns;
    fn deref(&self) -> &MigrateRuns {
        &self.runs
    }
}

fn print_plan(sizes: &[u64], reps: usize, trace: &KvmRunTrace) {
    println!(
        "migrate: live migration on loopback, post-copy and pre-copy, probe guest, 1 vCPU, {};",
        ram_sizes(sizes)
    );
    println!(
        "  tasks: idle = hello then {IDLE_TIMERS}x timer (200 ms each on the LAPIC timer); write = hello,mem-check=MIB,iters=R"
    );
    println!(
        "  (fills MIB = RAM/8, at most 240, rewrites a sixteenth per round, {WRITE_TOTAL_MIB} MiB in all, verifies)"
    );
    println!(
        "  migrated right after hello; each also run unmigrated; {reps} run(s) each, interleaved"
    );
    println!(
        "  pre-copy: Musubi's defaults (pause when what is left fits 300 ms at the last round's rate, at most 10 rounds)"
    );
    println!(
        "  KVM_RUN and KVM_GET_CLOCK from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );
}

/// Musubi and the listed peers that can run, and the peers that cannot with why.
fn vmms(h: &Harness, listed: &[&str], exe: PathBuf, elf: &Path, mib: u64) -> (Vec<Vmm>, Missing) {
    let mut vmms = vec![Vmm::Musubi {
        exe,
        elf: elf.to_path_buf(),
    }];
    let mut missing = Missing::new();
    for name in listed {
        match Kind::of(name) {
            Some(Kind::CloudHypervisor) => {
                match Micro::find_with(Kind::CloudHypervisor, elf, &h.out, "", mib) {
                    Ok(m) => vmms.push(Vmm::Peer(m)),
                    Err(why) => {
                        println!("cloud-hypervisor: unavailable, Musubi runs alone: {why}");
                        missing.push(("cloud-hypervisor".into(), why));
                    }
                }
            }
            _ => println!(
                "{name}: not compared here (migrate compares cloud-hypervisor; Firecracker \
                 does not migrate)"
            ),
        }
    }
    (vmms, missing)
}

/// Every size and task on every VMM: Musubi post-copy, pre-copy and unmigrated, a peer its
/// own (pre-copy) migration.
fn plan(h: &Harness, vmms: &[Vmm], elf: &Path, sizes: &[u64]) -> Result<Vec<Config>, String> {
    let mut configs = Vec::new();
    for &mib in sizes {
        for work in [Work::Idle, Work::Write] {
            for v in vmms {
                match v {
                    Vmm::Musubi { .. } => {
                        for (migrated, precopy) in [(true, false), (true, true), (false, false)] {
                            configs.push(Config {
                                vmm: v.clone(),
                                mib,
                                work,
                                migrated,
                                precopy,
                            });
                        }
                    }
                    Vmm::Peer(_) => {
                        let tasks = format!("probe.tasks=hello,{}", work.task(mib));
                        let m = Micro::find_with(Kind::CloudHypervisor, elf, &h.out, &tasks, mib)?;
                        configs.push(Config {
                            vmm: Vmm::Peer(m),
                            mib,
                            work,
                            migrated: true,
                            precopy: true,
                        });
                    }
                }
            }
        }
    }
    Ok(configs)
}

/// Runs every configuration; a peer that failed once is out at every size and task.
fn measure(
    h: &Harness,
    configs: Vec<Config>,
    reps: usize,
    trace: &KvmRunTrace,
) -> Result<Measured, String> {
    let mut standing: Vec<Standing> = configs.iter().map(|_| Standing::default()).collect();
    let names: Vec<&'static str> = configs.iter().map(|c| c.vmm_name()).collect();
    let runs = Runs::measure_indexed(h, configs, reps, Config::name, |rep, i, c| match c.vmm {
        Vmm::Musubi { .. } => one_run(c, trace).map(Outcome::Measured),
        Vmm::Peer(_) => {
            if let Some(why) = standing
                .iter()
                .zip(&names)
                .find(|(s, d)| s.unavailable.is_some() && **d == c.vmm_name())
                .and_then(|(s, _)| s.unavailable.clone())
            {
                standing[i].unavailable = Some(why);
                return Ok(Outcome::NotMade);
            }
            Ok(
                standing[i].run(&format!("{} run {}", c.name(), rep + 1), || {
                    one_run(c, trace)
                }),
            )
        }
    })?;
    Ok(Measured { runs, standing })
}

/// `migrate.csv`: a row per run made, and one per peer that never ran.
fn csv(runs: &Measured, missing: &[(String, String)]) -> Csv {
    type Head<'a> = (usize, usize, Option<&'a Config>, String);
    let msf = |n: Option<u64>| cell(n.map(|n| ms(n as f64)));
    let of_config = |f: fn(&Config) -> String| move |h: &Head| h.2.map(f).unwrap_or_default();
    let cols = Columns::new()
        .head("run", |h: &Head| {
            if h.2.is_some() {
                (h.0 + 1).to_string()
            } else {
                String::new()
            }
        })
        .head("rep", |h| {
            if h.2.is_some() {
                (h.1 + 1).to_string()
            } else {
                String::new()
            }
        })
        .head("hypervisor", |h| h.3.clone())
        .head("memory_mib", of_config(|c| c.mib.to_string()))
        .head("task", of_config(|c| c.work.short(c.mib)))
        .head("migrated", of_config(|c| c.migrated.to_string()))
        .head("mode", of_config(|c| c.mode().to_string()))
        .measured("downtime_ms", move |s: &Sample| msf(s.downtime_ns))
        .measured("request_to_first_kvm_run_ms", move |s| {
            msf(s.from_request_ns)
        })
        .measured("report_downtime_ms", move |s| msf(s.report_downtime_ns))
        .measured("request_to_answer_ms", move |s| msf(s.answer_ns))
        .measured("total_ms", move |s| msf(s.total_ns))
        .measured("data_pages", |s| cell(s.data_pages))
        .measured("pages_asked", |s| cell(s.asked))
        .measured("pages_pushed", |s| cell(s.pushed))
        .measured("precopy_rounds", |s| cell(s.rounds))
        .measured("pages_sent_live", |s| cell(s.live))
        .measured("pages_sent_paused", |s| cell(s.paused))
        .measured("task_ms", |s| ms(s.task_ns as f64))
        .unavailable();
    let mut rows = PeerRow::of_runs(&runs.runs, |i, rep, c: &Config| {
        (i, rep, Some(c), c.vmm_name().to_string())
    });
    rows.extend(
        missing
            .iter()
            .map(|(name, why)| PeerRow::missing((0, 0, None, name.clone()), why)),
    );
    cols.csv(rows)
}

/// Each configuration's summaries, found by what they ran.
struct Found<'a> {
    configs: &'a [Config],
    sums: Vec<Sums>,
}

impl Found<'_> {
    fn find(
        &self,
        vmm: &str,
        mib: u64,
        work: Work,
        migrated: bool,
        precopy: bool,
    ) -> Option<&Sums> {
        self.configs
            .iter()
            .zip(&self.sums)
            .find(|(c, _)| {
                c.vmm_name() == vmm
                    && c.mib == mib
                    && c.work == work
                    && c.migrated == migrated
                    && (c.precopy == precopy || !c.migrated || matches!(c.vmm, Vmm::Peer(_)))
            })
            .map(|(_, s)| s)
    }

    fn pairs(&self) -> impl Iterator<Item = (&Config, &Sums)> {
        self.configs.iter().zip(&self.sums)
    }
}

/// Prints the migrated runs' table and what its columns measure.
fn print_table(f: &Found) {
    let mut t = Table::new(&[
        "hypervisor",
        ">RAM",
        "task",
        "mode",
        ">downtime ms (med / min)",
        ">from request ms",
        ">total ms (med / min)",
        ">data pages",
        ">asked / pushed",
        ">rounds, sent live / paused",
        ">task ms migrated / not",
        ">slowdown",
    ]);
    for (c, s) in f.pairs().filter(|(c, _)| c.migrated) {
        if s.n == 0 {
            t.row([
                c.vmm_name().to_string(),
                ram_size(c.mib),
                c.work.short(c.mib),
                c.mode().into(),
                "unavailable (below)".into(),
            ]);
            continue;
        }
        let base = f
            .find(c.vmm_name(), c.mib, c.work, false, false)
            .and_then(|b| b.task);
        t.row(table_row(c, s, base));
    }
    println!();
    print!("{}", t.render());
    print!("{}", TABLE_NOTES);
}

/// One migrated configuration's row; `base` is the task's time unmigrated.
fn table_row(c: &Config, s: &Sums, base: Option<Summary>) -> [String; 12] {
    let med = |x: Option<Summary>| x.map(|x| format!("{:.0}", x.median));
    let na = || "n/a".to_string();
    [
        c.vmm_name().to_string(),
        ram_size(c.mib),
        c.work.short(c.mib),
        c.mode().into(),
        median_min(s.downtime, ms),
        s.from_request.map(|x| ms(x.median)).unwrap_or_else(na),
        median_min(s.total, ms),
        med(s.data_pages).unwrap_or_else(na),
        match (med(s.asked), med(s.pushed)) {
            (Some(a), Some(p)) => format!("{a} / {p}"),
            _ => na(),
        },
        match (med(s.rounds), med(s.live), med(s.paused)) {
            (Some(r), Some(l), Some(p)) => format!("{r}, {l} / {p}"),
            _ => "-".into(),
        },
        format!(
            "{} / {}",
            s.task.map(|x| ms(x.median)).unwrap_or_else(na),
            base.map(|x| ms(x.median)).unwrap_or_else(na)
        ),
        s.task
            .zip(base)
            .and_then(|(m, b)| ratio(m.median, b.median))
            .map(|r| format!("{r:.2}x"))
            .unwrap_or_else(na),
    ]
}

/// What the table's columns measure.
const TABLE_NOTES: &str = "\
downtime: from the source's KVM_GET_CLOCK, issued right after its vCPUs stopped in the
  pause (so the pause's own kick, microseconds, is not in it), to the destination's first
  KVM_RUN; both from the sys_enter_ioctl tracepoint, CLOCK_MONOTONIC to the microsecond.
  It holds capturing and sending the vCPU and device state and building the VM there;
  in post-copy the pages follow after it; in pre-copy it also holds sending the pages
  written during the last round. Cloud Hypervisor: the same two ioctls.
from request: the send-migration request to the destination's first KVM_RUN (an upper
  bound of the downtime: it adds the API, the connection and its handshake).
total: the request to the source process's exit (every page with data is on the
  destination by then). pages: the source's count of pages with data, and of those sent
  because the destination faulted on them (asked) or in the background (pushed);
  for a pre-copy, its rounds and the pages sent while the VM ran / in the pause (a page
  written again is sent again).
task ms: the task's own time from its result line, migrated right after hello and in an
  unmigrated run; the guest sees no time pass while paused, so the slowdown is the cost
  of the pages following (faults waiting for the source), not the downtime.
";

/// The downtime goals, and pre-copy beside post-copy on Musubi.
fn verdicts(f: &Found, sizes: &[u64], listed: &[&str]) -> Verdicts {
    let mut v = Verdicts::new();
    for &mib in sizes {
        for work in [Work::Idle, Work::Write] {
            let m = f
                .find("musubi", mib, work, true, false)
                .and_then(|s| s.downtime);
            v.push(Figure {
                what: format!("musubi downtime, {}, {}", ram_size(mib), work.short(mib)),
                ours: m
                    .map(|x| format!("{} ms", ms(x.median)))
                    .unwrap_or_else(|| "n/a".into()),
                reference: format!("<= {GOAL_DOWNTIME_MS} ms"),
                source: GOAL_SOURCE.into(),
                met: m.map(|x| x.median <= GOAL_DOWNTIME_MS * 1e6),
            });
            let ch = f
                .find("cloud-hypervisor", mib, work, true, true)
                .and_then(|s| s.downtime);
            if listed.contains(&"cloud-hypervisor") {
                let r = m.zip(ch).and_then(|(a, b)| ratio(a.median, b.median));
                v.push(Figure {
                    what: format!(
                        "downtime, musubi / cloud-hypervisor, {}, {}",
                        ram_size(mib),
                        work.name()
                    ),
                    ours: r
                        .map(|x| format!("{x:.3}x"))
                        .unwrap_or_else(|| "n/a (CH unavailable)".into()),
                    reference: format!("<= {GOAL_VS_CH}x"),
                    source: GOAL_SOURCE.into(),
                    met: r.map(|x| x <= GOAL_VS_CH),
                });
            }
        }
    }
    // The two ways on one VMM, in one run: no goal, a comparison.
    for &mib in sizes {
        for work in [Work::Idle, Work::Write] {
            let post = f.find("musubi", mib, work, true, false);
            let pre = f.find("musubi", mib, work, true, true);
            for (what, g) in [
                (
                    "downtime",
                    (|s: &Sums| s.downtime) as fn(&Sums) -> Option<Summary>,
                ),
                ("total", |s: &Sums| s.total),
            ] {
                let r = post
                    .and_then(g)
                    .zip(pre.and_then(g))
                    .and_then(|(a, b)| ratio(b.median, a.median));
                v.compared(
                    format!(
                        "{what}, pre-copy / post-copy, {}, {}",
                        ram_size(mib),
                        work.name()
                    ),
                    r.map(|x| format!("{x:.2}x"))
                        .unwrap_or_else(|| "n/a".into()),
                );
            }
        }
    }
    v
}

/// The chart: downtime and total of the migrated runs, the task's time migrated and not.
fn panels(f: &Found) -> Vec<plot::Panel> {
    let bars = |g: fn(&Sums) -> Option<Summary>, migrated: bool| -> Vec<plot::Bar> {
        summary_bars(
            f.pairs()
                .filter(|(c, _)| c.migrated == migrated)
                .map(|(c, s)| (c, g(s).map(|x| x.scaled(1e-6)))),
            Config::name,
        )
    };
    let mut task_bars = bars(|s| s.task, true);
    task_bars.extend(bars(|s| s.task, false));
    vec![
        plot::Panel {
            title: "downtime, source's pause to destination's first KVM_RUN (median, min)".into(),
            unit: "ms".into(),
            bars: bars(|s| s.downtime, true),
        },
        plot::Panel {
            title: "total, request to the source's exit (median, min)".into(),
            unit: "ms".into(),
            bars: bars(|s| s.total, true),
        },
        plot::Panel {
            title: "the guest task's own time, migrated and not (median, min)".into(),
            unit: "ms".into(),
            bars: task_bars,
        },
    ]
}

struct Sums {
    n: usize,
    downtime: Option<Summary>,
    from_request: Option<Summary>,
    total: Option<Summary>,
    data_pages: Option<Summary>,
    asked: Option<Summary>,
    pushed: Option<Summary>,
    rounds: Option<Summary>,
    live: Option<Summary>,
    paused: Option<Summary>,
    task: Option<Summary>,
}

impl Sums {
    fn of(s: &[&Sample]) -> Sums {
        let f = |g: &dyn Fn(&Sample) -> Option<u64>| -> Option<Summary> {
            let v: Vec<f64> = s.iter().filter_map(|x| g(x)).map(|v| v as f64).collect();
            Summary::of(&v)
        };
        Sums {
            n: s.len(),
            downtime: f(&|x| x.downtime_ns),
            from_request: f(&|x| x.from_request_ns),
            total: f(&|x| x.total_ns),
            data_pages: f(&|x| x.data_pages),
            asked: f(&|x| x.asked),
            pushed: f(&|x| x.pushed),
            rounds: f(&|x| x.rounds),
            live: f(&|x| x.live),
            paused: f(&|x| x.paused),
            task: f(&|x| Some(x.task_ns)),
        }
    }
}

/// A loopback port nothing listens on (the kernel's pick of a free one).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free loopback port: {e}"))
}

/// The task's result lines on `consoles` (the source's before the move, the destination's
/// after): the sum of their `ns`, or why there are not all of them or one failed.
fn task_result(consoles: &[&Path], work: Work) -> Result<u64, String> {
    let marker = format!("{{\"probe\":\"{}\"", work.probe());
    let mut sum = 0;
    let mut n = 0;
    let mut text = String::new();
    for c in consoles {
        text = std::fs::read_to_string(c).unwrap_or_default();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&marker))
        {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| format!("{line}: not JSON: {e}"))?;
            if v["ok"] == false || v["errors"].as_u64().is_some_and(|e| e != 0) {
                return Err(format!("the task failed: {line}"));
            }
            sum += v["ns"]
                .as_u64()
                .ok_or_else(|| format!("no ns in the result line {line}"))?;
            n += 1;
        }
    }
    if n != work.lines() {
        return Err(format!(
            "{n} {} result line(s), not {}: {}",
            work.probe(),
            work.lines(),
            one_line(&text, 300)
        ));
    }
    Ok(sum)
}

/// `key=value` of the source's `migrated` log line (tracing's format, colours removed).
fn log_field(stderr: &str, key: &str) -> Option<u64> {
    let line = stderr
        .lines()
        .find(|l| l.contains("migrated") && l.contains("pushed"))?;
    let mut clean = String::new();
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for e in chars.by_ref() {
                if e.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            clean.push(ch);
        }
    }
    clean
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

fn write_secret(dir: &Path) -> Result<PathBuf, String> {
    let p = dir.join("secret");
    let mut key = [0u8; 32];
    let seed = monotonic_ns() ^ u64::from(std::process::id()) << 32;
    for (i, b) in key.iter_mut().enumerate() {
        *b = (seed.rotate_left(i as u32 * 7) as u8) ^ (i as u8);
    }
    std::fs::write(&p, key)
        .and_then(|()| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)))
        .map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    Ok(p)
}

fn one_run(c: &Config, trace: &KvmRunTrace) -> Result<Sample, String> {
    let tmp = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let dir = tmp.path();
    match &c.vmm {
        Vmm::Musubi { exe, elf } if !c.migrated => unmigrated(c, exe, elf, dir),
        Vmm::Musubi { exe, elf } => musubi_migrated(c, exe, elf, dir, trace),
        Vmm::Peer(m) => ch_migrated(c, m, dir, trace),
    }
}

fn musubi_source(c: &Config, exe: &Path, elf: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--kernel"])
        .arg(elf)
        .args(["--cpus", "1", "--memory", &format!("{}M", c.mib)])
        .args(["--cmdline", &format!("probe.tasks={}", c.tasks())])
        .arg("--serial")
        .arg(format!("file={}", dir.join("src.console").display()))
        .arg("--report")
        .arg(dir.join("src.json"))
        .args(["--timeout", VM_TIMEOUT_S]);
    cmd
}

fn start(cmd: Command, name: &'static str, dir: &Path, tag: &str) -> Result<Vm, String> {
    Vm::start_to(
        cmd,
        name,
        &dir.join(format!("{tag}.stdout")),
        &dir.join(format!("{tag}.stderr")),
    )
}

fn unmigrated(c: &Config, exe: &Path, elf: &Path, dir: &Path) -> Result<Sample, String> {
    let vm = start(musubi_source(c, exe, elf, dir), "musubi", dir, "src")?;
    if !vm.wait_exit(RUN_TIMEOUT) {
        return Err(format!(
            "the run did not end within {} s",
            RUN_TIMEOUT.as_secs()
        ));
    }
    let task_ns = task_result(&[&dir.join("src.console")], c.work)
        .map_err(|e| format!("{e}; {}", vm.said()))?;
    Ok(Sample {
        task_ns,
        ..Sample::default()
    })
}

/// Sends the request and waits for the source's exit: (answer, exit) in ns from `t0`.
fn send_and_wait(src: &Vm, socket: &Path, body: &str, t0: u64) -> Result<(u64, u64), String> {
    api(socket, "PUT", "/api/v1/vm.send-migration", Some(body))?;
    let answer = monotonic_ns() - t0;
    let start = Instant::now();
    while !src.ended() {
        if start.elapsed() > EXIT_TIMEOUT {
            return Err(format!(
                "the source did not end within {} s of its migration",
                EXIT_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    Ok((answer, monotonic_ns() - t0))
}

/// The downtime figures from the trace: (pause to first run, request to first run).
fn downtime(
    trace: &KvmRunTrace,
    src: u32,
    dst: u32,
    t0: u64,
) -> Result<(Option<u64>, u64, Option<u64>), String> {
    let first = trace
        .first_run_ns(dst)?
        .ok_or("the trace holds no KVM_RUN of the destination (its buffer may have filled)")?;
    let pause = trace
        .last_ns(src, KVM_GET_CLOCK, first)?
        .filter(|&p| p >= t0);
    Ok((pause.map(|p| first - p), first.saturating_sub(t0), pause))
}

fn musubi_migrated(
    c: &Config,
    exe: &Path,
    elf: &Path,
    dir: &Path,
    trace: &KvmRunTrace,
) -> Result<Sample, String> {
    let secret = write_secret(dir)?;
    let port = free_port()?;
    let url = format!("tcp:127.0.0.1:{port}");
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--receive-migration", &url, "--secret-file"])
        .arg(&secret)
        .arg("--serial")
        .arg(format!("file={}", dir.join("dst.console").display()))
        .arg("--report")
        .arg(dir.join("dst.json"))
        .args(["--timeout", VM_TIMEOUT_S]);
    let dst = start(cmd, "musubi (destination)", dir, "dst")?;
    wait_until(&dst, "a listening socket", LISTEN_TIMEOUT, || {
        testkit::tcp::listening_on_loopback(port)
    })?;

    let socket = dir.join("api.sock");
    let mut cmd = musubi_source(c, exe, elf, dir);
    cmd.arg("--api-socket")
        .arg(&socket)
        .env("MUSUBI_LOG", "warn,musubi_migration::vm=info")
        .env("NO_COLOR", "1");
    let src = start(cmd, "musubi (source)", dir, "src")?;
    let console = dir.join("src.console");
    src.wait_for_line(&console, HELLO, BOOT_TIMEOUT)?;
    wait_until(&src, "its API socket", BOOT_TIMEOUT, || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    })?;

    trace.clear()?;
    let mut body = serde_json::json!({ "destination_url": url, "secret_file": secret });
    if c.precopy {
        body["mode"] = "precopy".into();
    }
    let body = body.to_string();
    let t0 = monotonic_ns();
    let (answer, total) = send_and_wait(&src, &socket, &body, t0)
        .map_err(|e| format!("{e}; {}; {}", src.said(), dst.said()))?;
    let (down, from_request, pause) = downtime(trace, src.child.id(), dst.child.id(), t0)?;

    if !dst.wait_exit(RUN_TIMEOUT) {
        return Err(format!(
            "the destination did not end within {} s",
            RUN_TIMEOUT.as_secs()
        ));
    }
    let dst_console = dir.join("dst.console");
    let task_ns = task_result(&[&console, &dst_console], c.work)
        .map_err(|e| format!("destination: {e}; {}", dst.said()))?;
    let after = std::fs::read_to_string(&dst_console).unwrap_or_default();
    if after.contains(HELLO) {
        return Err(format!(
            "the destination printed hello: it booted instead of resuming: {}",
            one_line(&after, 300)
        ));
    }
    let before = std::fs::read_to_string(&console).unwrap_or_default();
    if before.contains("probe: done") {
        return Err(format!(
            "the tasks ended on the source, before the migration: {}",
            one_line(&before, 300)
        ));
    }
    let read_report = |name: &str| -> Option<RunReport> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let report = read_report("src.json");
    if report.as_ref().map(|r| r.outcome.kind()) != Some("migrated") {
        return Err(format!(
            "the source's report does not say migrated: {}",
            report.map_or_else(|| "null".into(), |r| r.to_string())
        ));
    }
    let report_downtime_ns = read_report("dst.json")
        .and_then(|r| r.first_run_monotonic_ns)
        .zip(pause)
        .map(|(f, p)| f.saturating_sub(p));
    let log = std::fs::read_to_string(&src.stderr).unwrap_or_default();
    Ok(Sample {
        downtime_ns: down,
        from_request_ns: Some(from_request),
        report_downtime_ns,
        answer_ns: Some(answer),
        total_ns: Some(total),
        data_pages: log_field(&log, "data_pages"),
        asked: log_field(&log, "asked"),
        pushed: log_field(&log, "pushed"),
        rounds: log_field(&log, "precopy_rounds").filter(|_| c.precopy),
        live: log_field(&log, "precopy_live").filter(|_| c.precopy),
        paused: log_field(&log, "precopy_paused").filter(|_| c.precopy),
        task_ns,
    })
}

/// Cloud Hypervisor: a bare destination process told to receive on a UNIX socket, then
/// the source told to send there.
fn ch_migrated(c: &Config, m: &Micro, dir: &Path, trace: &KvmRunTrace) -> Result<Sample, String> {
    let dst_api = dir.join("dst-api.sock");
    let src_api = dir.join("src-api.sock");
    let channel = dir.join("migration.sock");
    let mut cmd = Command::new(&m.exe);
    cmd.arg("--api-socket")
        .arg(format!("path={}", dst_api.display()));
    let dst = start(cmd, "cloud-hypervisor (destination)", dir, "dst")?;
    wait_until(&dst, "its API socket", LISTEN_TIMEOUT, || {
        std::os::unix::net::UnixStream::connect(&dst_api).is_ok()
    })?;
    let receiver_url = format!("unix:{}", channel.display());
    let body = serde_json::json!({ "receiver_url": receiver_url }).to_string();
    let sock = dst_api.clone();
    // The receive request is answered when the migration has come in; it waits in a
    // thread of its own, bounded by the API's time limit.
    let receiver =
        std::thread::spawn(move || api(&sock, "PUT", "/api/v1/vm.receive-migration", Some(&body)));
    let result = (|| {
        wait_until(&dst, "its migration socket", LISTEN_TIMEOUT, || {
            channel.exists()
        })?;
        let src = start(
            m.command_api(Some(&src_api)),
            "cloud-hypervisor",
            dir,
            "src",
        )?;
        let console = dir.join("src.stdout");
        src.wait_for_line(&console, HELLO, BOOT_TIMEOUT)?;
        trace.clear()?;
        let body = serde_json::json!({ "destination_url": receiver_url }).to_string();
        let t0 = monotonic_ns();
        let (answer, total) = send_and_wait(&src, &src_api, &body, t0)
            .map_err(|e| format!("{e}; {}; {}", src.said(), dst.said()))?;
        let (down, from_request, _) = downtime(trace, src.child.id(), dst.child.id(), t0)
            .map_err(|e| format!("{e}; {}; {}", src.said(), dst.said()))?;
        let dst_console = dir.join("dst.stdout");
        dst.wait_for_line(&dst_console, "probe: done", RUN_TIMEOUT)?;
        let task_ns = task_result(&[&console, &dst_console], c.work)?;
        Ok(Sample {
            downtime_ns: down,
            from_request_ns: Some(from_request),
            answer_ns: Some(answer),
            total_ns: Some(total),
            task_ns,
            ..Sample::default()
        })
    })();
    // Ending the destination ends its receive request too, so the join is bounded.
    drop(dst);
    let received = receiver
        .join()
        .unwrap_or_else(|_| Err("the receiving thread panicked".into()));
    match (result, received) {
        (Ok(s), _) => Ok(s),
        (Err(e), Err(r)) => Err(format!("{e}; vm.receive-migration: {r}")),
        (Err(e), Ok(())) => Err(e),
    }
}
