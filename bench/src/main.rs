//! `musubi-bench` (run as `musubi bench`): runs the papers' experiments end to end and
//! reports them beside the papers' figures. A program of its own, so that none of this code,
//! its charts or its progress bars are in the hypervisor's binary.
//!
//! The pieces every experiment shares live here: an interleaved schedule with a progress
//! bar ([`Harness::run_schedule`]) and the driver built on it that measures an experiment's
//! configurations and writes its CSV from typed columns, its chart and its verdicts
//! ([`driver`]), summaries ([`stats`]), tables and CSV ([`report`]), SVG charts ([`plot`])
//! and outside observation of a hypervisor process ([`watch`]).

mod all;
mod api;
mod apivm;
mod boot;
mod composite;
mod door;
mod driver;
mod dsm_table;
mod guest_run;
mod ha;
mod kvm_trace;
mod migrate;
mod mint;
mod net;
mod net_ceiling;
mod net_flows;
mod ns_cpu;
mod peers;
pub mod plot;
mod probe;
mod qemu;
pub mod report;
mod seq;
mod snapshot;
pub mod stats;
mod vmms;
mod vmp;
mod vsock;
pub mod watch;

use clap::{Args, Parser};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;

/// The command line, read as `musubi bench` reads it (that command hands it over whole).
#[derive(Parser, Debug)]
#[command(
    name = "musubi bench",
    bin_name = "musubi bench",
    version,
    about = "Run an experiment and report it beside the papers' figures."
)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn main() -> ExitCode {
    run(&Cli::parse().args)
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Experiment to run: boot, composite, seq, dsm-table, mint, vmms, vmp, snapshot (save and
    /// restore a VM mid-task: snapshot time, restore to first KVM_RUN and to the task's end,
    /// 128 MiB to 4 GiB), migrate (post-copy live migration: downtime, total time, pages,
    /// the guest's slowdown, 256 MiB to 4 GiB), net (virtio-net over a TAP in a network
    /// namespace of its own: UDP request/response rate and latency, TCP stream throughput,
    /// exits and interrupts per packet; needs root), door (a stranger at a linking node's
    /// port: time from its connection to a running VM, per kind of stranger), api (a VM's
    /// life cycle through the API by Cloud Hypervisor's `ch-remote`: create and boot to
    /// first KVM_RUN, shutdown and delete to an idle VMM, its memory over the cycles), vsock
    /// (virtio-vsock's hybrid UNIX-socket host side: 64-byte round trips, an echo and a
    /// guest-to-host stream, beside Firecracker), ha (a VM replicated to a standby on
    /// loopback: its slowdown beside unreplicated, pause and bytes per epoch, failover from
    /// the primary's SIGKILL to the standby's first KVM_RUN; needs root for tracefs), or all
    /// (every one, and a page `index.html` in --out that shows them together).
    pub experiment: String,
    /// A short run that finishes in seconds (for smoke tests).
    #[arg(long)]
    pub quick: bool,
    /// Directory for the CSV and plot files.
    #[arg(long, value_name = "DIR", default_value = "bench-out")]
    pub out: PathBuf,
    /// Also run the same guest under other hypervisors in the same run, a comma-separated
    /// list of qemu, firecracker, cloud-hypervisor (boot takes all three, vmms qemu, snapshot
    /// firecracker and cloud-hypervisor, migrate and api cloud-hypervisor, net qemu and
    /// firecracker, vsock firecracker; without it boot and vmms compare with QEMU whenever it
    /// is installed, net with QEMU and Firecracker whenever they are, vsock with Firecracker
    /// whenever it is). A listed peer that is missing or fails
    /// is reported unavailable; Musubi's own figures are written whatever it does.
    #[arg(long, value_name = "LIST")]
    pub compare: Option<String>,
    /// The QEMU executable to compare with, instead of qemu-system-x86_64 on PATH; implies
    /// --compare qemu.
    #[arg(long, value_name = "PATH")]
    pub qemu: Option<PathBuf>,
    /// Bytes each storage run moves (vmms; the paper used 512M), e.g. 4M, 64M, 512M.
    #[arg(long, value_name = "SIZE")]
    pub extent: Option<String>,
    /// Largest node count for vmp (runs 1..N nodes; default: this host's cores, at least 2).
    #[arg(long, value_name = "N")]
    pub nodes: Option<u16>,
    /// One-way link delay of vmp's delayed runs (`run --link-delay`), e.g. 100us, 2ms. The
    /// delayed runs come beside the loopback ones (and, as root, beside runs with each node
    /// in its own network namespace).
    #[arg(long, value_name = "DURATION", default_value = "100us", value_parser = musubi_cluster::parse_duration)]
    pub link_delay: std::time::Duration,
    /// Cloud Hypervisor's client that api drives every VMM with, instead of
    /// $MUSUBI_CH_REMOTE, `ch-remote` on PATH or the shared peers' folder beside the
    /// workspace (`../shared/anchors/ch-remote`).
    #[arg(long, value_name = "PATH")]
    pub ch_remote: Option<PathBuf>,
}

const EXPERIMENTS: &[&str] = &[
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

pub fn run(args: &BenchArgs) -> ExitCode {
    let result = match args.experiment.as_str() {
        "all" => return all::run(args),
        "boot" => Harness::new(args).and_then(|h| boot::run(&h, args)),
        "dsm-table" => Harness::new(args).and_then(|h| dsm_table::run(&h, args)),
        "composite" => Harness::new(args).and_then(|h| composite::run(&h, args)),
        "seq" => Harness::new(args).and_then(|h| seq::run(&h, args)),
        "mint" => Harness::new(args).and_then(|h| mint::run(&h, args)),
        "vmms" => Harness::new(args).and_then(|h| vmms::run(&h, args)),
        "vmp" => Harness::new(args).and_then(|h| vmp::run(&h, args)),
        "snapshot" => Harness::new(args).and_then(|h| snapshot::run(&h, args)),
        "migrate" => Harness::new(args).and_then(|h| migrate::run(&h, args)),
        "net" => Harness::new(args).and_then(|h| net::run(&h, args)),
        "door" => Harness::new(args).and_then(|h| door::run(&h, args)),
        "api" => Harness::new(args).and_then(|h| api::run(&h, args)),
        "vsock" => Harness::new(args).and_then(|h| vsock::run(&h, args)),
        "ha" => Harness::new(args).and_then(|h| ha::run(&h, args)),
        other => {
            eprintln!(
                "musubi bench: unknown experiment {other:?}; available: {}, all",
                EXPERIMENTS.join(", ")
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("musubi bench {}: {e}", args.experiment);
            ExitCode::from(1)
        }
    }
}

/// What an experiment needs from the command line, checked once.
pub struct Harness {
    pub out: PathBuf,
    pub quick: bool,
}

impl Harness {
    fn new(args: &BenchArgs) -> Result<Harness, String> {
        // Every experiment boots the probe guest or runs `musubi`; without it none can start.
        probe::materialize()?;
        std::fs::create_dir_all(&args.out).map_err(|e| {
            format!(
                "--out {}: cannot create the directory: {e}",
                args.out.display()
            )
        })?;
        Ok(Harness {
            out: args.out.clone(),
            quick: args.quick,
        })
    }

    pub fn out_file(&self, name: &str) -> PathBuf {
        self.out.join(name)
    }

    /// Runs `reps` repetitions of each configuration interleaved (A B A B ...), showing
    /// progress, and stops at the first failed run: a benchmark built on a failed run
    /// would report a figure that was never measured.
    pub fn run_schedule<C, R>(
        &self,
        configs: &[C],
        reps: usize,
        name: impl Fn(&C) -> String,
        mut one: impl FnMut(usize, &C) -> Result<R, String>,
    ) -> Result<Vec<(usize, usize, R)>, String> {
        let schedule = stats::interleaved(configs.len(), reps);
        let bar = progress(schedule.len() as u64);
        let mut out = Vec::with_capacity(schedule.len());
        for (rep, c) in schedule {
            bar.set_message(format!("{} #{}", name(&configs[c]), rep + 1));
            let r = one(rep, &configs[c]).map_err(|e| {
                bar.abandon();
                format!("{} run {}: {e}", name(&configs[c]), rep + 1)
            })?;
            out.push((rep, c, r));
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok(out)
    }

    /// Writes the CSV and says where it went.
    pub fn write_csv(&self, name: &str, csv: &report::Csv) -> Result<PathBuf, String> {
        let p = self.out_file(name);
        csv.write(&p)?;
        Ok(p)
    }

    /// Writes `NAME.csv` and the chart `NAME.svg` and says where they went, as an
    /// experiment's last words.
    pub fn write_results(
        &self,
        name: &str,
        csv: &report::Csv,
        title: &str,
        panels: &[plot::Panel],
    ) -> Result<(), String> {
        let p = self.write_csv(&format!("{name}.csv"), csv)?;
        let s = self.write_chart(&format!("{name}.svg"), title, panels)?;
        println!("csv: {}\nplot: {}", p.display(), s.display());
        Ok(())
    }

    pub fn write_chart(
        &self,
        name: &str,
        title: &str,
        panels: &[plot::Panel],
    ) -> Result<PathBuf, String> {
        let p = self.out_file(name);
        plot::bar_chart(&p, title, panels)?;
        Ok(p)
    }
}

/// A progress bar on stderr; indicatif hides it when stderr is not a terminal, so logs and
/// tests see only the results.
fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} runs  {elapsed}  {msg}") {
        bar.set_style(style);
    }
    bar
}

/// The first executable named `name` on `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// Whether `p` is a file with an execute bit, as a program named on `PATH` must be.
pub fn is_executable(p: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_runs_configurations_alternately_and_stops_on_failure() {
        let h = Harness {
            out: std::env::temp_dir(),
            quick: true,
        };
        let mut order = Vec::new();
        let r = h
            .run_schedule(
                &["a", "b"],
                2,
                |c| c.to_string(),
                |rep, c| {
                    order.push(format!("{c}{rep}"));
                    Ok(rep)
                },
            )
            .unwrap();
        assert_eq!(order, ["a0", "b0", "a1", "b1"]);
        assert_eq!(r.len(), 4);
        let e = h
            .run_schedule(
                &["a", "b"],
                2,
                |c| c.to_string(),
                |rep, c| {
                    if *c == "b" {
                        Err("no hello".to_string())
                    } else {
                        Ok(rep)
                    }
                },
            )
            .unwrap_err();
        assert_eq!(e, "b run 1: no hello");
    }

    #[test]
    fn sh_is_on_path() {
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("no-such-program-here").is_none());
    }
}
