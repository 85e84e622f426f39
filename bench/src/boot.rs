//! `musubi bench boot`: how fast a VM starts and how much memory the VMM itself costs,
//! Musubi beside QEMU, Firecracker and Cloud Hypervisor on the same probe guest image,
//! measured the same way from outside: spawn to first `KVM_RUN` by the kernel's
//! `sys_enter_ioctl` tracepoint ([`KvmRunTrace`]), memory from `/proc/PID/smaps` outside the
//! guest-RAM mapping.

use super::driver::{
    measured_per_config, summary_bars, Columns, Missing, Outputs, PeerRow, Runs, Verdicts,
};
use super::kvm_trace::KvmRunTrace;
use super::peers::{self, Kind, Micro};
use super::qemu::{self, Outcome, Peer, Qemu, Standing};
use super::report::{cell, median_min, mib, ms, Csv, Table};
use super::stats::{max, ratio, Summary};
use super::watch::{observe, observe_to_marker, time_to_marker, Observed, Watch};
use super::{plot, BenchArgs, Harness};
use musubi_types::RunReport;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const GUEST_BYTES: u64 = 128 << 20;
/// Every few ms: fine enough to catch a VM that lives tens of ms, coarse enough that
/// reading smaps does not steal a core from the VM on a two-core machine.
const SAMPLE_EVERY: Duration = Duration::from_millis(3);
const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of a failed Musubi run's output quoted in the error: Musubi is the subject, so
/// its failure ends the benchmark and is worth reading in full.
const MUSUBI_LINES: usize = 10;

/// Musubi's own targets and Firecracker's published figures.
const TARGET_FIRST_RUN_MS: f64 = 5.0;
const TARGET_OVERHEAD_MIB: f64 = 3.0;
const FC_STARTUP_CPU_MS: f64 = 8.0;
const FC_OVERHEAD_MIB: f64 = 5.0;
const FC_SOURCE: &str = "Firecracker's published specification";
/// Goals against the peers, each a ratio from one run.
const GOAL_FIRST_RUN_VS_CH: f64 = 0.5;
const GOAL_OVERHEAD_VS_FC: f64 = 0.75;
const GOAL_SOURCE: &str = "Musubi goal, same run";

#[derive(Clone, Debug)]
enum Hv {
    /// Boots the probe guest from the same ELF file as the peers, not from the copy the
    /// binary carries, so every VMM reads the same file the same way.
    Musubi {
        exe: PathBuf,
        elf: PathBuf,
    },
    Qemu(Qemu),
    Micro(Micro),
}

impl Hv {
    fn name(&self) -> String {
        match self {
            Hv::Musubi { .. } => "musubi".into(),
            Hv::Qemu(q) => format!("qemu ({})", q.machine),
            Hv::Micro(m) => m.kind.name().into(),
        }
    }

    /// The peer's name in the comparison rows and the unavailable lines.
    fn peer_name(&self) -> &'static str {
        match self {
            Hv::Micro(p) => p.kind.name(),
            _ => "qemu",
        }
    }

    fn cpu_model(&self) -> &'static str {
        match self {
            Hv::Musubi { .. } | Hv::Micro(_) => "",
            Hv::Qemu(q) => q.cpu_model(),
        }
    }
}

/// One run, all times from the parent's spawn of the hypervisor.
#[derive(Clone, Debug)]
struct Sample {
    /// The VMM's process, whose thread group the trace names.
    pid: u32,
    /// When the parent spawned the VMM (CLOCK_MONOTONIC ns).
    spawn_ns: u64,
    /// From the trace; `None` when it holds no KVM_RUN of this process.
    to_first_run_ns: Option<u64>,
    /// Musubi only: the same from its `--report`'s `first_run_monotonic_ns`, to check the
    /// trace against.
    report_first_run_ns: Option<u64>,
    /// The part of `to_first_run_ns` spent inside the VMM's VM setup (the report's own
    /// `to_first_run_ns`); the rest is exec, process start-up and argument parsing.
    setup_ns: Option<u64>,
    to_hello_ns: u64,
    to_exit_ns: u64,
    max_overhead: Option<u64>,
    max_private_overhead: Option<u64>,
    mem_samples: u32,
    exits: Option<u64>,
    /// `None` for a peer killed once it printed hello.
    status: Option<i32>,
}

/// The runs of every hypervisor; a peer's may have failed or not been made.
type BootRuns = Runs<Hv, Outcome<Sample>>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("boots VMs")?;
    let reps = if h.quick { 3 } else { 10 };
    let exe = crate::probe::musubi()?;
    let listed = peers::parse_compare(args.compare.as_deref())?;
    // Every VMM's first KVM_RUN comes from the kernel's trace, the same way for each.
    let trace = KvmRunTrace::open().map_err(|e| {
        format!("first KVM_RUN is timed by the kernel's sys_enter_ioctl tracepoint: {e}")
    })?;
    println!(
        "first KVM_RUN: from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );
    println!(
        "boot: probe guest (probe.tasks=hello), 1 vCPU, 128 MiB; {reps} runs per hypervisor, interleaved"
    );
    let (configs, mut missing) = hypervisors(h, args, &listed, exe)?;
    let (runs, standing) = measure(h, configs, reps, &trace)?;
    // A peer that never started, or failed its warm-up, has no runs, and one row that says
    // why.
    for (i, (c, st)) in runs.configs.iter().zip(&standing).enumerate().skip(1) {
        let ran = runs
            .runs
            .iter()
            .any(|r| r.1 == i && !matches!(r.2, Outcome::NotMade));
        if let (false, Some(why)) = (ran, &st.unavailable) {
            missing.push((c.name(), why.clone()));
        }
    }
    let csv_path = Outputs::new(h).csv("boot.csv", &csv(&runs, &missing))?;
    let per: Vec<Vec<&Sample>> = measured_per_config(&runs);
    let sums: Vec<Sums> = per.iter().map(|s| Sums::of(s)).collect();
    print_table(&runs.configs, &sums);
    print_peers(&runs.configs, &standing, &missing);
    print_musubi(&sums[0], &per[0]);
    for (c, s) in runs.configs.iter().zip(&per) {
        let missed = s.iter().filter(|x| x.max_overhead.is_none()).count();
        if missed > 0 {
            println!(
                "{}: memory sampling missed {missed} of {} runs (the VM ended before /proc/PID/smaps was read)",
                c.name(),
                s.len()
            );
        }
    }
    println!();
    print!("{}", verdicts(&runs.configs, &sums).table());
    println!();
    print!("{}", NOTES);
    println!(
        "every {} ms; shared libraries count in full. \"of it private\": Private_Clean+Private_Dirty,",
        SAMPLE_EVERY.as_millis()
    );
    println!(
        "  the pages no other process shares. The targets are checked against the full overhead."
    );
    let svg_path = Outputs::new(h).bars(
        "boot.svg",
        "musubi bench boot",
        &panels(&runs.configs, &sums),
    )?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

/// Musubi and the peers that can run, and the peers that cannot with why. microvm boots a
/// PVH ELF with `-kernel` and has the least device model, so it is the fair comparison;
/// `-M pc` is the fallback if this QEMU's microvm cannot boot the probe. The probe's
/// successful boot is QEMU's warm-up run.
fn hypervisors(
    h: &Harness,
    args: &BenchArgs,
    listed: &[&str],
    exe: PathBuf,
) -> Result<(Vec<Hv>, Missing), String> {
    let elf = crate::probe::materialize()?;
    let mut configs = vec![Hv::Musubi {
        exe,
        elf: elf.clone(),
    }];
    let mut missing = Missing::new();
    match qemu::peer(args, &["microvm", "pc"])? {
        Peer::Skipped(why) => println!("QEMU: skipped, {why}"),
        Peer::Ready(q) => configs.push(Hv::Qemu(q)),
        Peer::Unavailable(why) => missing.push(("qemu".into(), why)),
    }
    for kind in listed.iter().filter_map(|n| Kind::of(n)) {
        match Micro::find(kind, &elf, &h.out) {
            Ok(m) => {
                println!("{}: runs with its seccomp filters", kind.name());
                configs.push(Hv::Micro(m));
            }
            Err(why) => {
                println!("{}: unavailable, Musubi runs alone: {why}", kind.name());
                missing.push((kind.name().into(), why));
            }
        }
    }
    Ok((configs, missing))
}

/// One discarded run each, so the first measured run does not pay for cold caches (a peer
/// whose warm-up fails is out), then every hypervisor's runs interleaved.
fn measure(
    h: &Harness,
    configs: Vec<Hv>,
    reps: usize,
    trace: &KvmRunTrace,
) -> Result<(BootRuns, Vec<Standing>), String> {
    one_run(&configs[0], trace).map_err(|e| format!("{} warm-up run: {e}", configs[0].name()))?;
    let mut standing: Vec<Standing> = configs.iter().map(|_| Standing::default()).collect();
    for (c, st) in configs.iter().zip(standing.iter_mut()).skip(1) {
        if let Hv::Micro(_) = c {
            let _ = st.run(&format!("{} warm-up run", c.name()), || one_run(c, trace));
        }
    }
    let runs = Runs::measure_indexed(h, configs, reps, Hv::name, |rep, i, c| match c {
        Hv::Musubi { .. } => one_run(c, trace).map(Outcome::Measured),
        _ => Ok(
            standing[i].run(&format!("{} run {}", c.name(), rep + 1), || {
                one_run(c, trace)
            }),
        ),
    })?;
    Ok((runs, standing))
}

/// `boot.csv`: a row per run made, and one per peer that never ran.
fn csv(runs: &BootRuns, missing: &[(String, String)]) -> Csv {
    /// Run and repetition (empty for a peer that never ran), hypervisor, CPU model.
    type Head = (String, String, String, &'static str);
    let msf = |n: Option<u64>| cell(n.map(|n| ms(n as f64)));
    let mibf = |b: Option<u64>| cell(b.map(|b| mib(b as f64)));
    let cols = Columns::new()
        .head("run", |h: &Head| h.0.clone())
        .head("rep", |h| h.1.clone())
        .head("hypervisor", |h| h.2.clone())
        .measured("to_first_kvm_run_ms", move |s: &Sample| {
            msf(s.to_first_run_ns)
        })
        .measured("report_first_kvm_run_ms", move |s| {
            msf(s.report_first_run_ns)
        })
        .measured("vm_setup_ms", move |s| msf(s.setup_ns))
        .measured("to_hello_ms", |s| ms(s.to_hello_ns as f64))
        .measured("to_exit_ms", |s| ms(s.to_exit_ns as f64))
        .measured("max_overhead_mib", move |s| mibf(s.max_overhead))
        .measured("max_private_overhead_mib", move |s| {
            mibf(s.max_private_overhead)
        })
        .measured("memory_samples", |s| s.mem_samples.to_string())
        .measured("total_exits", |s| cell(s.exits))
        .measured("exit_status", |s| cell(s.status))
        .head("cpu_model", |h| h.3.to_string())
        .unavailable();
    let mut rows = PeerRow::of_runs(runs, |i, rep, hv: &Hv| {
        (
            (i + 1).to_string(),
            (rep + 1).to_string(),
            hv.name(),
            hv.cpu_model(),
        )
    });
    rows.extend(missing.iter().map(|(name, why)| {
        PeerRow::missing((String::new(), String::new(), name.clone(), ""), why)
    }));
    cols.csv(rows)
}

/// Prints each hypervisor's figures and Musubi's over each peer's.
fn print_table(configs: &[Hv], sums: &[Sums]) {
    let mut t = Table::new(&[
        "hypervisor",
        ">first KVM_RUN ms (med / min)",
        ">hello ms (med / min)",
        ">max overhead MiB",
        ">of it private",
        ">exits (run)",
    ]);
    for (c, s) in configs.iter().zip(sums) {
        t.row([
            c.name(),
            median_min(s.first_run, ms),
            median_min(s.hello, ms),
            s.overhead_text(),
            s.private.map(mib).unwrap_or_else(|| "n/a".into()),
            s.exits
                .map(|e| format!("{e:.0}"))
                .unwrap_or_else(|| "n/a".into()),
        ]);
    }
    let r = |a: Option<f64>, b: Option<f64>| {
        a.zip(b)
            .and_then(|(a, b)| ratio(a, b))
            .map(|x| format!("{x:.2}x"))
            .unwrap_or_else(|| "n/a".into())
    };
    let both = |m: Option<Summary>, q: Option<Summary>| {
        format!(
            "{} / {}",
            r(m.map(|s| s.median), q.map(|s| s.median)),
            r(m.map(|s| s.min), q.map(|s| s.min))
        )
    };
    let m = &sums[0];
    for (c, q) in configs.iter().zip(sums).skip(1) {
        if q.hello.is_none() {
            continue;
        }
        t.row([
            format!("musubi / {}", c.peer_name()),
            both(m.first_run, q.first_run),
            both(m.hello, q.hello),
            r(m.overhead, q.overhead),
            r(m.private, q.private),
            "n/a".into(),
        ]);
    }
    println!();
    print!("{}", t.render());
    println!(
        "first KVM_RUN: spawn (CLOCK_MONOTONIC just before it) to the process's first KVM_RUN"
    );
    println!("  ioctl, from the kernel's sys_enter_ioctl tracepoint (clock mono, to the us), for every VMM.");
    println!("  exits: the whole run, i.e. hello plus the exit-port write; the peers' are not counted (n/a).");
    println!(
        "  The peers without an exit port (firecracker, cloud-hypervisor) are killed at hello."
    );
}

/// Prints how each peer ran, or why it did not.
fn print_peers(configs: &[Hv], standing: &[Standing], missing: &[(String, String)]) {
    for c in configs {
        match c {
            Hv::Qemu(q) => println!("{}: ran with {}.", c.name(), q.options()),
            Hv::Micro(m) => println!("{}: ran with its seccomp filters.", m.kind.name()),
            Hv::Musubi { .. } => {}
        }
    }
    for (c, st) in configs.iter().zip(standing).skip(1) {
        st.print_as(c.peer_name());
    }
    for (name, why) in missing {
        if !configs.iter().any(|c| c.name() == *name) {
            println!("{name}: unavailable, no comparison: {why}");
        }
    }
}

/// Prints Musubi's phases to first KVM_RUN and its report's stamp against the trace's.
fn print_musubi(m: &Sums, samples: &[&Sample]) {
    if let (Some(all), Some(setup)) = (m.first_run, m.setup) {
        println!(
            "musubi's phases to first KVM_RUN, median: {} ms before run_vm (exec, process start-up,",
            ms(all.median - setup.median),
        );
        println!(
            "  argument parsing), {} ms in VM setup (run_vm to KVM_RUN; per-phase times with",
            ms(setup.median)
        );
        println!("  MUSUBI_LOG=vmm=debug).");
    }
    let gaps: Vec<f64> = samples
        .iter()
        .filter_map(|s| {
            let (a, b) = (s.to_first_run_ns?, s.report_first_run_ns?);
            Some(b as f64 - a as f64)
        })
        .collect();
    if let Some(gap) = super::stats::median(&gaps) {
        println!(
            "musubi: --report's first_run_monotonic_ns minus the trace's, median {:.1} us",
            gap / 1e3
        );
        println!("  (the report stamps just before the ioctl; the trace at its entry, to the us).");
    }
}

/// Musubi's targets, Firecracker's published figures and the goals against the peers.
fn verdicts(configs: &[Hv], sums: &[Sums]) -> Verdicts {
    let peer_sums = |kind: Kind| {
        configs
            .iter()
            .zip(sums)
            .find(|(c, _)| matches!(c, Hv::Micro(m) if m.kind == kind))
            .map(|(_, s)| s)
    };
    let m = &sums[0];
    let ch_first = peer_sums(Kind::CloudHypervisor)
        .and_then(|p| p.first_run)
        .zip(m.first_run);
    let vs_ch = ch_first.and_then(|(p, m)| ratio(m.median, p.median));
    let vs_ch_min = ch_first.and_then(|(p, m)| ratio(m.min, p.min));
    let vs_fc = peer_sums(Kind::Firecracker)
        .and_then(|p| p.overhead)
        .zip(m.overhead)
        .and_then(|(p, m)| ratio(m, p));
    let first_ms = m.first_run.map(|s| s.median / 1e6);
    let overhead_mib = m.overhead.map(in_mib);
    let mut v = Verdicts::new();
    let mut fig = |what: &str,
                   ours: Option<f64>,
                   unit: &str,
                   reference: String,
                   source: &str,
                   met: &dyn Fn(f64) -> bool| {
        v.judged(
            what,
            ours,
            |x| format!("{x:.2} {unit}"),
            reference,
            source,
            met,
        )
    };
    let target = "Musubi target";
    fig(
        "time to first KVM_RUN (median)",
        first_ms,
        "ms",
        format!("<= {TARGET_FIRST_RUN_MS} ms"),
        target,
        &|v| v <= TARGET_FIRST_RUN_MS,
    );
    fig(
        "memory overhead (max)",
        overhead_mib,
        "MiB",
        format!("< {TARGET_OVERHEAD_MIB} MiB"),
        target,
        &|v| v < TARGET_OVERHEAD_MIB,
    );
    fig(
        "start-up (ours: wall ms to first KVM_RUN)",
        first_ms,
        "ms",
        format!("<= {FC_STARTUP_CPU_MS} CPU ms to API socket"),
        FC_SOURCE,
        &|v| v <= FC_STARTUP_CPU_MS,
    );
    fig(
        "memory overhead (max)",
        overhead_mib,
        "MiB",
        format!("<= {FC_OVERHEAD_MIB} MiB"),
        FC_SOURCE,
        &|v| v <= FC_OVERHEAD_MIB,
    );
    let vs = format!("<= {GOAL_FIRST_RUN_VS_CH:.2}x");
    fig(
        "first KVM_RUN, musubi / cloud-hypervisor (median)",
        vs_ch,
        "x",
        vs.clone(),
        GOAL_SOURCE,
        &|v| v <= GOAL_FIRST_RUN_VS_CH,
    );
    fig(
        "first KVM_RUN, musubi / cloud-hypervisor (min)",
        vs_ch_min,
        "x",
        vs,
        GOAL_SOURCE,
        &|v| v <= GOAL_FIRST_RUN_VS_CH,
    );
    fig(
        "RSS outside guest RAM, musubi / firecracker (max)",
        vs_fc,
        "x",
        format!("<= {GOAL_OVERHEAD_VS_FC:.2}x"),
        GOAL_SOURCE,
        &|v| v <= GOAL_OVERHEAD_VS_FC,
    );
    v
}

/// How to read the figures on this machine.
const NOTES: &str = "\
This machine runs KVM nested: guest code at CPL0 goes through KVM's instruction emulator
(a few million instructions/s) and each VM exit costs ~85 us. Time to hello is dominated
by that, so it and the musubi/qemu hello ratio measure the nested KVM and the guest more
than the VMM. Time to first KVM_RUN and memory overhead are host-native and not distorted.
Overhead = Rss of the VMM process minus Rss of its guest-RAM mapping, max over samples
";

/// The chart: time to first KVM_RUN and to hello, and the memory overhead.
fn panels(configs: &[Hv], sums: &[Sums]) -> Vec<plot::Panel> {
    let bars = |f: &dyn Fn(&Sums) -> Option<Summary>| {
        summary_bars(configs.iter().zip(sums).map(|(c, s)| (c, f(s))), Hv::name)
    };
    vec![
        plot::Panel {
            title: "time to first KVM_RUN (median, min)".into(),
            unit: "ms".into(),
            bars: bars(&|s| s.first_run.map(|x| x.scaled(1e-6))),
        },
        plot::Panel {
            title: "time to hello (median, min)".into(),
            unit: "ms".into(),
            bars: bars(&|s| s.hello.map(|x| x.scaled(1e-6))),
        },
        plot::Panel {
            title: "VMM memory overhead (max)".into(),
            unit: "MiB".into(),
            bars: configs
                .iter()
                .zip(sums)
                .filter_map(|(c, s)| {
                    s.overhead.map(|b| plot::Bar {
                        label: c.name(),
                        value: in_mib(b),
                        low: None,
                    })
                })
                .collect(),
        },
    ]
}

fn in_mib(bytes: f64) -> f64 {
    bytes / (1u64 << 20) as f64
}

struct Sums {
    first_run: Option<Summary>,
    setup: Option<Summary>,
    hello: Option<Summary>,
    overhead: Option<f64>,
    private: Option<f64>,
    exits: Option<f64>,
}

impl Sums {
    fn of(s: &[&Sample]) -> Sums {
        let f = |g: &dyn Fn(&Sample) -> Option<f64>| -> Vec<f64> {
            s.iter().filter_map(|x| g(x)).collect()
        };
        Sums {
            first_run: Summary::of(&f(&|x| x.to_first_run_ns.map(|n| n as f64))),
            setup: Summary::of(&f(&|x| x.setup_ns.map(|n| n as f64))),
            hello: Summary::of(&f(&|x| Some(x.to_hello_ns as f64))),
            overhead: max(&f(&|x| x.max_overhead.map(|b| b as f64))),
            private: max(&f(&|x| x.max_private_overhead.map(|b| b as f64))),
            exits: super::stats::median(&f(&|x| x.exits.map(|e| e as f64))),
        }
    }

    fn overhead_text(&self) -> String {
        match self.overhead {
            Some(b) => mib(b),
            None => "not sampled".into(),
        }
    }
}

/// One run of `hv`, its first KVM_RUN from `trace`.
fn one_run(hv: &Hv, trace: &KvmRunTrace) -> Result<Sample, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    trace.clear()?;
    let mut s = match hv {
        Hv::Musubi { exe, elf } => run_musubi(exe, elf, dir.path())?,
        Hv::Qemu(q) => run_qemu(q)?,
        Hv::Micro(m) => run_micro(m, m.command())?,
    };
    s.to_first_run_ns = trace
        .first_run_ns(s.pid)?
        .map(|at| at.saturating_sub(s.spawn_ns));
    Ok(s)
}

fn watch() -> Watch<'static> {
    Watch {
        marker: qemu::HELLO_MARKER,
        guest_bytes: Some(GUEST_BYTES),
        timeout: RUN_TIMEOUT,
        sample_every: SAMPLE_EVERY,
    }
}

fn run_musubi(exe: &Path, elf: &Path, dir: &Path) -> Result<Sample, String> {
    let report = dir.join("report.json");
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--kernel"])
        .arg(elf)
        .args([
            "--cpus",
            "1",
            "--memory",
            "128M",
            "--cmdline",
            "probe.tasks=hello",
            "--serial",
            "stdio",
            "--report",
        ])
        .arg(&report);
    let o = observe(cmd, &watch()).map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let hello = time_to_marker(&o, 0, MUSUBI_LINES)?;
    let text = std::fs::read_to_string(&report)
        .map_err(|e| format!("musubi wrote no --report file {}: {e}", report.display()))?;
    let r: RunReport = serde_json::from_str(&text)
        .map_err(|e| format!("--report {}: not a report: {e}", report.display()))?;
    let first = r.first_run_monotonic_ns.ok_or_else(|| {
        format!(
            "--report {} has no first_run_monotonic_ns: {text}",
            report.display()
        )
    })?;
    Ok(Sample {
        pid: o.pid,
        spawn_ns: o.spawn_ns,
        to_first_run_ns: None,
        report_first_run_ns: Some(first.saturating_sub(o.spawn_ns)),
        setup_ns: r.to_first_run_ns,
        to_hello_ns: hello,
        to_exit_ns: o.end_ns - o.spawn_ns,
        max_overhead: o.max_overhead,
        max_private_overhead: o.max_private_overhead,
        mem_samples: o.samples,
        exits: Some(r.total_exits),
        status: Some(0),
    })
}

fn run_qemu(q: &Qemu) -> Result<Sample, String> {
    let o = observe(q.hello_command(), &watch()).map_err(|e| format!("cannot start QEMU: {e}"))?;
    let hello = time_to_marker(&o, qemu::CLEAN_STATUS, qemu::STDERR_LINES)?;
    Ok(peer_sample(&o, hello, Some(qemu::CLEAN_STATUS)))
}

/// Firecracker or Cloud Hypervisor: no exit port, so the run ends when hello is printed.
fn run_micro(m: &Micro, cmd: Command) -> Result<Sample, String> {
    let o = observe_to_marker(cmd, &watch())
        .map_err(|e| format!("cannot start {}: {e}", m.kind.name()))?;
    match o.marker_ns {
        Some(at) => Ok(peer_sample(&o, at.saturating_sub(o.spawn_ns), None)),
        None => Err(time_to_marker(&o, 0, qemu::STDERR_LINES)
            .err()
            .unwrap_or_else(|| "no hello".into())),
    }
}

/// A peer's run: memory from outside; its first KVM_RUN comes from the trace.
fn peer_sample(o: &Observed, hello: u64, status: Option<i32>) -> Sample {
    Sample {
        pid: o.pid,
        spawn_ns: o.spawn_ns,
        to_first_run_ns: None,
        report_first_run_ns: None,
        setup_ns: None,
        to_hello_ns: hello,
        to_exit_ns: o.end_ns - o.spawn_ns,
        max_overhead: o.max_overhead,
        max_private_overhead: o.max_private_overhead,
        mem_samples: o.samples,
        exits: None,
        status,
    }
}
