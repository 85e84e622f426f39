//! `musubi bench vmp`: paper 004 §5.2 — one VM over 1..N node processes on this host, its
//! memory kept coherent page by page over loopback TCP. Parallel fib (Fig. 6: speedup over
//! one node), the per-vCPU breakdown of Table 2 as far as it can be measured here, the page
//! fetch latencies (Fig. 8) and the fetched guest-physical ranges (Fig. 7), and messages per
//! fetch beside the simulator's Table 3. In the same run it times one loopback TCP round trip
//! and one VM exit, so the fetch latency can be judged against what it is made of. The
//! largest node count also runs over a delayed link (`--link-delay`) and, as root, with each
//! node in its own network namespace (`--netns`), beside the loopback runs.

use super::driver::{Columns, Outputs, Runs, Verdicts};
use super::guest_run::in_vm;
use super::report::{Csv, Figure, Table};
use super::stats::median;
use super::watch::{observe, tail, Observed, Watch};
use super::{plot, Harness};
use crate::probe;
use dsm::table3::{measure_ordered, ManagerAt};
use musubi_types::{ClusterMetrics, Coherence, Metrics};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::config::ExitsMode;

/// A wedged node process, not a slow one: the largest full-size run takes about a second.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// A shared-counter run on up to 8 nodes ends in about a second here.
const COUNTER_LIMIT: Duration = Duration::from_secs(30);
/// The coherence messages (the nodes also send `interrupt`, an IPI, which is not one).
const COHERENCE: [&str; 8] = [
    "fetch",
    "inv",
    "finish",
    "req",
    "fwd",
    "inval",
    "inval-ack",
    "page",
];
/// The messages that open a remote fetch: the paper's protocol's and Ivy's.
const REQUESTS: [&str; 2] = ["fetch", "req"];
/// Paper 004 Fig. 6: fib(46), 8 processes, 8 nodes.
const PAPER_SPEEDUP_8: f64 = 6.6;

/// How the nodes of a run are linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Link {
    /// Each node in its own network namespace, joined by veth links and a bridge.
    netns: bool,
    /// One-way delay on every frame (zero: none).
    delay: Duration,
}

const LOOPBACK: Link = Link {
    netns: false,
    delay: Duration::ZERO,
};

impl Link {
    fn name(&self) -> String {
        let base = if self.netns { "netns" } else { "loopback" };
        if self.delay.is_zero() {
            base.into()
        } else {
            format!("{base}+{}", delay_name(self.delay))
        }
    }
}

/// `100us`, `2ms`: as `--link-delay` takes it.
fn delay_name(d: Duration) -> String {
    let us = d.as_micros();
    if us >= 1000 && us.is_multiple_of(1000) {
        format!("{}ms", us / 1000)
    } else if d.as_nanos().is_multiple_of(1000) {
        format!("{us}us")
    } else {
        format!("{}ns", d.as_nanos())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Config {
    nodes: u16,
    protocol: &'static str,
    ordering: &'static str,
    /// fib(n) per process; 1 is the baseline run (boot, start-up and reporting only).
    fib: u32,
    link: Link,
    /// Nodes poll for a peer's answer before sleeping (`run --fetch-poll`, default); false
    /// runs them with `--fetch-poll 0us` to show what polling saves.
    poll: bool,
}

impl Config {
    /// The paper's protocol with x86 ordering over loopback, polling: the configuration every
    /// node count and grain runs, and the one the figures single out.
    fn vmp_tso(nodes: u16, fib: u32) -> Config {
        Config {
            nodes,
            protocol: "vmp",
            ordering: "tso",
            fib,
            link: LOOPBACK,
            poll: true,
        }
    }

    fn name(&self) -> String {
        format!(
            "{}n {}/{} fib({}){}",
            self.nodes,
            self.protocol,
            self.ordering,
            self.fib,
            self.link_suffix()
        )
    }
    fn label(&self) -> String {
        if self.nodes == 1 {
            "1 node".into()
        } else {
            format!(
                "{}n {}/{}{}",
                self.nodes,
                self.protocol,
                self.ordering,
                self.link_suffix()
            )
        }
    }
    fn link_suffix(&self) -> String {
        let mut s = String::new();
        if self.link != LOOPBACK {
            s = format!(" {}", self.link.name());
        }
        if !self.poll {
            s.push_str(" no-poll");
        }
        s
    }
}

/// One node's figures from `--metrics`.
#[derive(Clone, Debug, Default)]
struct NodeFigures {
    id: u16,
    faults: u64,
    fetches: u64,
    messages: u64,
    buckets: Vec<u64>,
    by_range: BTreeMap<u64, u64>,
    range_bytes: u64,
    /// Faults on the probe kernel's pages (guest-physical below 2 MiB).
    kernel_faults: u64,
    /// The node's most-faulted pages: (guest-physical address, faults, what lies there).
    hot: Vec<(u64, u64, String)>,
    exits: u64,
    vmm_ns: f64,
    protocol_errors: u64,
}

/// One run: the guest's own times and each node's figures.
#[derive(Clone, Debug)]
struct RunFigures {
    wall_ns: f64,
    /// (cpu, ns) of every fib task.
    tasks: Vec<(u64, f64)>,
    nodes: Vec<NodeFigures>,
}

impl RunFigures {
    fn busy_ns(&self, cpu: u64) -> f64 {
        self.tasks.iter().filter(|t| t.0 == cpu).map(|t| t.1).sum()
    }
}

/// Task grains. Even the quick one keeps each node busy many times as long as the nodes take
/// to start and fetch what a task needs (fib(40) is about 0.2 s a task on these hosts); the
/// full run ends with the paper's fib(46), about 3.7 s a task here.
fn grains(quick: bool) -> Vec<u32> {
    if quick {
        vec![40]
    } else {
        vec![36, 41, 46]
    }
}

/// Paper 004 on these hosts: faults on the probe kernel's pages, on any node of any run at
/// the largest grain, and the slowest such run's wall time over one node's.
const KERNEL_FAULTS_GOAL: u64 = 250;
const SLOWEST_OVER_ONE_NODE_GOAL: f64 = 0.8;
/// The shared counter's runs: the slowest at most this many times the median.
const COUNTER_SPREAD_GOAL: f64 = 2.0;

fn default_nodes() -> u16 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u16)
        .unwrap_or(2)
        .max(2)
}

/// The runs of every configuration, as the driver measured them.
type VmpRuns = Runs<Config, RunFigures>;

/// The sizes of one bench run, which every table and figure is about.
struct Shape {
    max_nodes: u16,
    /// The paper ran 8 processes on 1..8 nodes: the same work on every node count. Here the
    /// process count is the largest node count, one vCPU per node.
    procs: u16,
    grains: Vec<u32>,
    reps: usize,
}

impl Shape {
    /// The largest grain, which the breakdown, the latencies and the goals are judged at.
    fn top(&self) -> u32 {
        *self.grains.last().unwrap_or(&1)
    }
}

/// The two costs a remote page fetch is built from, measured in the same run.
struct Costs {
    rtt: Vec<f64>,
    rtt_page: Vec<f64>,
    pings: usize,
    exit_ns: f64,
}

impl Costs {
    fn measure(quick: bool) -> Result<Costs, String> {
        let count = if quick { 200 } else { 2000 };
        let rtt = loopback_rtt(count, 64, 64)?;
        let rtt_page = loopback_rtt(count, 64, 4096)?;
        let pings = count;
        let r = in_vm(&format!("port-ping={pings}"), ExitsMode::Kernel, None)?;
        let exit_ns = r.ns().ok_or("port-ping: no time in its result")? / pings as f64;
        Ok(Costs {
            rtt,
            rtt_page,
            pings,
            exit_ns,
        })
    }
}

pub fn run(h: &Harness, args: &super::BenchArgs) -> Result<(), String> {
    let max_nodes = args.nodes.unwrap_or_else(default_nodes).clamp(1, 8);
    let s = Shape {
        max_nodes,
        procs: max_nodes,
        grains: grains(h.quick),
        reps: if h.quick { 1 } else { 3 },
    };
    let configs = plan(&s, args.link_delay);
    let exe = crate::probe::musubi()?;
    let scratch = tempfile::tempdir().map_err(|e| format!("scratch directory: {e}"))?;
    let load_before = loadavg();
    let started = Instant::now();
    let runs = Runs::measure(h, configs, s.reps, Config::name, |rep, c| {
        run_one(&exe, scratch.path(), c, s.procs, rep)
    })?;
    let costs = Costs::measure(h.quick)?;
    let procs = s.procs;
    let csv = node_columns(procs).csv(
        runs.iter()
            .flat_map(|(rep, c, r)| r.nodes.iter().map(move |n| (rep, c, r, n))),
    );

    let (speedups, lines) = speedup_table(&runs, &s);
    hottest_pages(&runs, s.top(), max_nodes);
    links_side_by_side(&runs, &s.grains, args.link_delay);
    breakdown(&runs, &s);
    let fetches = fetch_latencies(&runs, &s);
    let mut verdicts = goals(&runs, &s, &costs, &speedups, fetches.vmp_median);
    if max_nodes > 1 && !runs.of(&Config::vmp_tso(max_nodes, s.top())).is_empty() {
        verdicts.push(shared_counter_runs(
            &exe,
            max_nodes,
            if h.quick { 3 } else { 20 },
        )?);
    }
    println!("{}", verdicts.table());
    if h.quick {
        println!(
            "(--quick: fib({}) is a small grain, so the speedup goal is judged on a grain far below the paper's.)",
            s.top()
        );
    }
    println!(
        "runs took {:.1} s in all; grains {:?}; {} run(s) per configuration; host load average \
         (1 min) {} before, {} after, on {} cores: whatever else runs takes cores from the nodes",
        started.elapsed().as_secs_f64(),
        s.grains,
        s.reps,
        load_before,
        loadavg(),
        default_nodes()
    );
    let out = Outputs::new(h);
    out.csv("vmp-latency.csv", &fetches.hist_csv)?;
    let drawings = fetches.drawings(lines, &s);
    let p = out.csv("vmp.csv", &csv)?;
    let svg = out.chart("vmp.svg", "one VM over several nodes", &drawings)?;
    println!("csv: {}\nplot: {}", p.display(), svg.display());
    Ok(())
}

/// Every configuration: each grain (and the fib(1) baseline) on 1..N nodes with both
/// protocols, the paper's ordering and no polling on the most nodes, and the other links at
/// the largest node count and the task grains (the breakdown's baseline runs stay on
/// loopback).
fn plan(s: &Shape, link_delay: Duration) -> Vec<Config> {
    let max_nodes = s.max_nodes;
    let with = |nodes, protocol, ordering, fib, link, poll| Config {
        nodes,
        protocol,
        ordering,
        fib,
        link,
        poll,
    };
    let mut configs = Vec::new();
    for &fib in s.grains.iter().chain([1].iter()) {
        for nodes in 1..=max_nodes {
            if nodes == 1 {
                configs.push(Config::vmp_tso(nodes, fib));
                continue;
            }
            for protocol in ["vmp", "ivy"] {
                configs.push(with(nodes, protocol, "tso", fib, LOOPBACK, true));
            }
        }
        if max_nodes > 1 {
            configs.push(with(max_nodes, "vmp", "paper", fib, LOOPBACK, true));
            if Some(&fib) == s.grains.last() {
                configs.push(with(max_nodes, "vmp", "tso", fib, LOOPBACK, false));
            }
        }
    }
    let links = other_links(link_delay);
    if max_nodes > 1 {
        for &fib in &s.grains {
            for &link in &links {
                for protocol in ["vmp", "ivy"] {
                    configs.push(with(max_nodes, protocol, "tso", fib, link, true));
                }
            }
        }
    }
    configs
}

/// One CSV row per node of every run.
type NodeRow<'a> = (usize, &'a Config, &'a RunFigures, &'a NodeFigures);

/// `vmp.csv`'s columns.
fn node_columns<'c>(procs: u16) -> Columns<'c, NodeRow<'c>> {
    Columns::new()
        .col("nodes", |x: &NodeRow| x.1.nodes.to_string())
        .col("protocol", |x| x.1.protocol.to_string())
        .col("ordering", |x| x.1.ordering.to_string())
        .col("link", |x| x.1.link.name())
        .col("polling", |x| {
            if x.1.poll { "yes" } else { "no" }.to_string()
        })
        .col("fib", |x| x.1.fib.to_string())
        .col("procs", move |_| procs.to_string())
        .col("rep", |x| x.0.to_string())
        .col("node", |x| x.3.id.to_string())
        .col("wall_ns", |x| format!("{:.0}", x.2.wall_ns))
        .col("task_ns", |x| format!("{:.0}", x.2.busy_ns(x.3.id as u64)))
        .col("faults", |x| x.3.faults.to_string())
        .col("fetches", |x| x.3.fetches.to_string())
        .col("coherence_messages", |x| x.3.messages.to_string())
        .col("fault_ns_estimate", |x| {
            format!("{:.0}", fault_ns(&x.3.buckets))
        })
        .col("exits", |x| x.3.exits.to_string())
        .col("vmm_exit_ns", |x| format!("{:.0}", x.3.vmm_ns))
        .col("protocol_errors", |x| x.3.protocol_errors.to_string())
}

/// The median of `xs`, taken by value.
fn med(xs: Vec<f64>) -> Option<f64> {
    median(&xs)
}

/// Speedups by (grain, label), and the speedup lines of the chart by name.
type Speedups = (
    BTreeMap<(u32, String), f64>,
    BTreeMap<String, Vec<(f64, f64)>>,
);

/// Fig. 6: prints wall time and speedup over one node of every loopback configuration.
fn speedup_table(runs: &VmpRuns, s: &Shape) -> Speedups {
    println!(
        "Parallel fib over 1..{} nodes (paper 004 Fig. 6; {} processes on every node count, \
         one vCPU per node, {} run(s) each, median)",
        s.max_nodes, s.procs, s.reps
    );
    let mut t = Table::new(&[
        "grain",
        "nodes",
        "protocol",
        "ordering",
        "polling",
        ">wall ms",
        ">speedup",
        ">faults/run",
        ">fetches/run",
        ">kernel faults, worst node",
    ]);
    let mut speedups: BTreeMap<(u32, String), f64> = BTreeMap::new();
    // Speedup against node count, one line per protocol and grain (over loopback).
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for &fib in &s.grains {
        let base = one_node_wall(runs, fib);
        for c in runs
            .configs
            .iter()
            .filter(|c| c.fib == fib && c.link == LOOPBACK)
        {
            let rs = runs.of(c);
            let wall = med(rs.iter().map(|r| r.wall_ns).collect());
            let sp = match (base, wall) {
                (Some(b), Some(w)) if w > 0.0 => Some(b / w),
                _ => None,
            };
            let per_run = |f: fn(&NodeFigures) -> u64| {
                med(rs
                    .iter()
                    .map(|r| r.nodes.iter().map(f).sum::<u64>() as f64)
                    .collect())
            };
            let kernel = med(rs.iter().map(|r| worst_kernel_faults(r) as f64).collect());
            if let Some(sp) = sp {
                speedups.insert((fib, c.label()), sp);
                if c.nodes > 1 {
                    let label = c.label();
                    let line = label.split_once(' ').map_or(label.as_str(), |(_, l)| l);
                    let points = lines.entry(format!("{line} fib({fib})")).or_default();
                    if points.is_empty() {
                        points.push((1.0, 1.0));
                    }
                    points.push((c.nodes as f64, sp));
                }
            }
            t.row([
                format!("fib({fib})"),
                c.nodes.to_string(),
                c.protocol.to_string(),
                c.ordering.to_string(),
                if c.nodes == 1 {
                    "-"
                } else if c.poll {
                    "yes"
                } else {
                    "no"
                }
                .to_string(),
                opt(wall.map(|w| w / 1e6), 2),
                opt(sp, 2),
                opt(per_run(|n| n.faults), 0),
                opt(per_run(|n| n.fetches), 0),
                opt(kernel, 0),
            ]);
        }
    }
    println!("{}", t.render());
    println!(
        "wall = the guest's own time from starting the workers to the last task's end (rdtsc);\n\
         speedup = 1-node wall / N-node wall for the same {procs} processes. Paper: {PAPER_SPEEDUP_8}x on 8 nodes\n\
         for fib(46). This host has {} cores and every node is a process on it, with a vCPU thread and a\n\
         coherence thread each, so more nodes than cores cannot speed up. Every link in this table is\n\
         loopback; the other links follow below. polling: whether a node polls for a peer's answer\n\
         before it sleeps while one of its faults waits (run --fetch-poll; no = --fetch-poll 0us).\n\
         kernel faults: faults on the probe kernel's pages (below 2 MiB) on the node with the most,\n\
         median of the runs; a CPU-bound task should cost next to none.\n",
        default_nodes(),
        procs = s.procs
    );
    (speedups, lines)
}

/// Table 2: prints the per-vCPU breakdown at the largest grain on one and the most nodes.
fn breakdown(runs: &VmpRuns, s: &Shape) {
    let top = s.top();
    let native_task = med(runs
        .of(&Config::vmp_tso(1, top))
        .iter()
        .flat_map(|r| r.tasks.iter().map(|t| t.1))
        .collect());
    let mut t2 = Table::new(&[
        "vm",
        "vcpu",
        ">Total ms",
        ">Native ms",
        ">Mem ms",
        ">Misc ms",
        ">Idle ms",
        ">rest ms",
    ]);
    let shown = runs.configs.iter().filter(|c| {
        c.fib == top && c.link == LOOPBACK && c.poll && (c.nodes == 1 || c.nodes == s.max_nodes)
    });
    for c in shown {
        let rs = runs.of(c);
        let bs = runs.of(&Config { fib: 1, ..*c });
        for cpu in 0..c.nodes {
            t2.row(breakdown_row(c, cpu, &rs, &bs, native_task));
        }
    }
    println!("Breakdown per vCPU, fib({top}) (paper 004 Table 2: fib(44); 8 nodes: Total 27.9 s = Native 22.1 + Mem 3.7 + Misc 0.1 + Idle 2.0)");
    println!("{}", t2.render());
    println!(
        "Total: the run's wall (as the paper's: until every process has ended). Native: the 1-node time of\n\
         one fib({top}) task times the tasks this vCPU ran. Mem: the node's page-fault latencies summed\n\
         (each fault taken at the middle of its power-of-two bucket, so within about a third), less the\n\
         same sum in a fib(1) run of the same VM (boot, start-up, reporting): faults are counted per node,\n\
         not per moment, so this is the fault time of the task phase only as far as the baseline is the\n\
         same; it includes faults of the node's VMM threads, not only its vCPU's. Misc: the VMM's own\n\
         handling time of this vCPU's exits less the baseline's (the nested KVM's share of each exit is not\n\
         in it). Idle: Total less the time this vCPU spent in fib tasks (waiting for the others, and start-up).\n\
         rest: Total - Native - Mem - Misc - Idle, what none of the columns explains: chiefly time a vCPU\n\
         thread waited for a host core (node processes, their coherence threads and any other load share\n\
         this host's cores), and the nested KVM's share of exits; negative when the estimates overlap.\n\
         Mem and Misc are whole-run figures less a baseline run's: with small grains or one run each\n\
         (--quick) the run-to-run spread of start-up alone can exceed the task phase, so read them there\n\
         as noise.\n"
    );
}

/// One vCPU's row of the breakdown: `rs` are the runs of `c`, `bs` its fib(1) baseline's.
fn breakdown_row(
    c: &Config,
    cpu: u16,
    rs: &[&RunFigures],
    bs: &[&RunFigures],
    native_task: Option<f64>,
) -> [String; 8] {
    // vCPU i runs on node i (one vCPU per node, dealt round-robin).
    let node_of = |r: &&RunFigures| r.nodes.iter().find(|n| n.id == cpu).cloned();
    let total = med(rs.iter().map(|r| r.wall_ns).collect());
    let tasks_here = rs
        .first()
        .map(|r| r.tasks.iter().filter(|t| t.0 == cpu as u64).count())
        .unwrap_or(0);
    let native = native_task.map(|n| n * tasks_here as f64);
    // A node figure in the runs, less its median in the baseline runs.
    let above_baseline = |f: &dyn Fn(&NodeFigures) -> f64| {
        let base = med(bs.iter().filter_map(node_of).map(|n| f(&n)).collect());
        med(rs
            .iter()
            .filter_map(node_of)
            .map(|n| (f(&n) - base.unwrap_or(0.0)).max(0.0))
            .collect())
    };
    let mem = above_baseline(&|n| fault_ns(&n.buckets));
    let misc = above_baseline(&|n| n.vmm_ns);
    let busy = med(rs.iter().map(|r| r.busy_ns(cpu as u64)).collect());
    let idle = match (total, busy) {
        (Some(t), Some(b)) => Some((t - b).max(0.0)),
        _ => None,
    };
    let rest = match (total, native, mem, misc, idle) {
        (Some(t), Some(n), Some(m), Some(x), Some(i)) => Some(t - n - m - x - i),
        _ => None,
    };
    let ms = |v: Option<f64>| opt(v.map(|v| v / 1e6), 2);
    [
        c.label(),
        cpu.to_string(),
        ms(total),
        ms(native),
        ms(mem),
        ms(misc),
        ms(idle),
        ms(rest),
    ]
}

/// Fig. 8 and Fig. 7 at the largest grain on the most nodes: what the chart and the goals
/// take from them.
struct Fetches {
    hist_csv: Csv,
    cdf: Vec<plot::Series>,
    range_bars: Vec<plot::Bar>,
    /// The median remote fetch of vmp/tso with polling.
    vmp_median: Option<f64>,
}

impl Fetches {
    /// The chart: the speedup `lines`, the fetch latencies and the fetched ranges.
    fn drawings(self, lines: BTreeMap<String, Vec<(f64, f64)>>, s: &Shape) -> Vec<plot::Drawing> {
        let mut drawings = vec![plot::Drawing::Lines(plot::Lines {
            title: "speedup over 1 node (loopback)".into(),
            x_desc: "nodes".into(),
            y_desc: "speedup (x)".into(),
            log_x: false,
            legend: plotters::prelude::SeriesLabelPosition::UpperLeft,
            series: lines
                .into_iter()
                .map(|(name, points)| plot::Series { name, points })
                .collect(),
        })];
        if !self.cdf.is_empty() {
            drawings.push(plot::Drawing::Lines(plot::Lines {
                title: format!(
                    "remote fetch latency, fib({}), {} nodes (cumulative)",
                    s.top(),
                    s.max_nodes
                ),
                x_desc: "latency (us, log scale; at the top of each power-of-two bucket)".into(),
                y_desc: "fetches done (%)".into(),
                log_x: true,
                legend: plotters::prelude::SeriesLabelPosition::LowerRight,
                series: self.cdf,
            }));
        }
        if !self.range_bars.is_empty() {
            drawings.push(plot::Drawing::Bars(plot::Panel {
                title: "faults by guest-physical range, top 5".into(),
                unit: "faults".into(),
                bars: self.range_bars,
            }));
        }
        drawings
    }
}

/// One configuration's faults over all its runs and nodes.
struct FaultSums {
    all: Vec<u64>,
    remote: Vec<u64>,
    ranges: BTreeMap<u64, u64>,
    faults: u64,
    fetches: u64,
    msgs: u64,
    range_bytes: u64,
}

impl FaultSums {
    fn of(rs: &[&RunFigures]) -> FaultSums {
        let mut f = FaultSums {
            all: vec![0u64; 64],
            remote: vec![0u64; 64],
            ranges: BTreeMap::new(),
            faults: 0,
            fetches: 0,
            msgs: 0,
            range_bytes: 0,
        };
        for n in rs.iter().flat_map(|r| &r.nodes) {
            add(&mut f.all, &n.buckets);
            add(&mut f.remote, &slowest(&n.buckets, n.fetches));
            for (k, v) in &n.by_range {
                *f.ranges.entry(*k).or_default() += v;
            }
            f.faults += n.faults;
            f.fetches += n.fetches;
            f.msgs += n.messages;
            f.range_bytes = n.range_bytes;
        }
        f
    }

    /// Cumulative share of fetches done by the top of each power-of-two bucket.
    fn cdf(&self) -> Vec<(f64, f64)> {
        let total: u64 = self.remote.iter().sum();
        let mut done = 0u64;
        let mut points = Vec::new();
        for (i, r) in self.remote.iter().enumerate() {
            done += r;
            if total > 0 && done > 0 && done - r < total {
                points.push((
                    (1u64 << (i + 1)) as f64 / 1e3,
                    100.0 * done as f64 / total as f64,
                ));
            }
        }
        points
    }
}

/// Prints the fault latencies, histogram and ranges of every protocol on the most nodes at
/// the largest grain, and the messages per fetch beside the simulator's Table 3.
fn fetch_latencies(runs: &VmpRuns, s: &Shape) -> Fetches {
    let (top, max_nodes) = (s.top(), s.max_nodes);
    let mut out = Fetches {
        hist_csv: Csv::new(&[
            "protocol",
            "ordering",
            "polling",
            "bucket_ns_low",
            "faults",
            "remote_fetches",
        ]),
        cdf: Vec::new(),
        range_bars: Vec::new(),
        vmp_median: None,
    };
    let mut msg_table = Table::new(&[
        "vm",
        ">messages/fault",
        ">messages/fetch",
        ">sim Table 3 (c=0..N-2)",
        "paper Table 3",
    ]);
    for c in runs
        .configs
        .iter()
        .filter(|c| c.fib == top && c.nodes == max_nodes && c.nodes > 1 && c.link == LOOPBACK)
    {
        let rs = runs.of(c);
        let f = FaultSums::of(&rs);
        let top_ranges = fault_report(c, top, rs.len(), &f, &mut out);
        let points = f.cdf();
        if !points.is_empty() {
            let label = c.label();
            let name = label.split_once(' ').map_or(label.as_str(), |(_, l)| l);
            out.cdf.push(plot::Series {
                name: name.to_string(),
                points,
            });
        }
        if c.protocol == "vmp" && c.ordering == "tso" && c.poll {
            out.vmp_median = quantile(&f.remote, 0.5);
            for (start, n) in top_ranges.iter().take(5) {
                out.range_bars.push(plot::Bar {
                    label: format!("{:#x}", start),
                    value: *n as f64,
                    low: None,
                });
            }
        }
        let (sim, paper) = sim_range(c, max_nodes);
        let per = |n: u64| opt((n > 0).then(|| f.msgs as f64 / n as f64), 2);
        msg_table.row([c.label(), per(f.faults), per(f.fetches), sim, paper]);
    }
    println!(
        "A node's fault histogram mixes faults resolved without a message (a write to a page it already\n\
         owns) with remote fetches; the remote fetches are taken to be its slowest k faults, k = the fetch\n\
         requests it sent (fetch for vmp, req for Ivy). Quantiles interpolate inside the power-of-two\n\
         buckets. Paper Fig. 8: most fetches took a few ms, some tens of ms (100 Mb/s Ethernet, 2005).\n"
    );
    println!("Messages per page fetch (coherence messages sent, IPIs excluded) beside the simulator's Table 3");
    println!("{}", msg_table.render());
    println!(
        "messages/fetch counts every coherence message sent by all nodes over the fetch requests they sent;\n\
         the simulator's cells are single fetches in an idle system (read and write, each manager position\n\
         possible with this many nodes), so a live run sits inside their range only when no fetch races\n\
         another for the same page.\n"
    );
    out
}

/// Prints one configuration's fault latencies, histogram and most-faulted ranges, adds its
/// histogram to `out`'s CSV, and returns the ranges, most faults first.
fn fault_report(
    c: &Config,
    top: u32,
    nruns: usize,
    f: &FaultSums,
    out: &mut Fetches,
) -> Vec<(u64, u64)> {
    for (i, (a, r)) in f.all.iter().zip(&f.remote).enumerate() {
        if *a > 0 {
            out.hist_csv.row([
                c.protocol.to_string(),
                c.ordering.to_string(),
                if c.poll { "yes" } else { "no" }.to_string(),
                (1u64 << i).to_string(),
                a.to_string(),
                r.to_string(),
            ]);
        }
    }
    let (m_all, m_remote, p99) = (
        quantile(&f.all, 0.5),
        quantile(&f.remote, 0.5),
        quantile(&f.remote, 0.99),
    );
    println!(
        "Page faults, {} fib({top}), {nruns} run(s): {} faults, {} remote fetches; \
         latency median of all faults {}, of remote fetches {} (p99 {})",
        c.label(),
        f.faults,
        f.fetches,
        us(m_all),
        us(m_remote),
        us(p99)
    );
    println!(
        "  latency histogram (all faults / remote fetches):{}",
        f.all
            .iter()
            .zip(&f.remote)
            .enumerate()
            .filter(|(_, (a, _))| **a > 0)
            .map(|(i, (a, r))| format!(" [{}: {a}/{r}]", span(i)))
            .collect::<String>()
    );
    let mut top_ranges: Vec<(u64, u64)> = f.ranges.iter().map(|(k, v)| (*k, *v)).collect();
    top_ranges.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let shown: Vec<String> = top_ranges
        .iter()
        .take(5)
        .map(|(start, n)| format!("{start:#x}: {n}"))
        .collect();
    println!(
        "  faults by guest-physical range ({} KiB each, top 5): {}",
        f.range_bytes / 1024,
        shown.join(", ")
    );
    top_ranges
}

/// Prints the costs a fetch is made of and returns the goals judged on the runs (the
/// shared counter's comes after, from runs of its own).
fn goals(
    runs: &VmpRuns,
    s: &Shape,
    costs: &Costs,
    speedups: &BTreeMap<(u32, String), f64>,
    vmp_median: Option<f64>,
) -> Verdicts {
    let (top, max_nodes) = (s.top(), s.max_nodes);
    let mut v = Verdicts::new();
    let rtt_med = median(&costs.rtt);
    println!(
        "Loopback TCP round trip (127.0.0.1, {} ping-pongs): 64 B each way {}; 64 B out, 4 KiB back {}",
        costs.rtt.len(),
        us(rtt_med),
        us(median(&costs.rtt_page))
    );
    println!(
        "One VM exit (port-ping from guest user mode, {} writes, one node, in-kernel exits): {}",
        costs.pings,
        us(Some(costs.exit_ns))
    );
    let budget = rtt_med.map(|r| r + costs.exit_ns);
    let ratio = match (vmp_median, budget) {
        (Some(m), Some(b)) if b > 0.0 => Some(m / b),
        _ => None,
    };
    println!(
        "median remote fetch (vmp/tso, {max_nodes} nodes, fib({top})) = {} x (exit + RTT = {})",
        opt(ratio, 2),
        us(budget)
    );
    let goal = |what: String, ours: Option<f64>, bound: String, met: Option<bool>| Figure {
        what,
        ours: opt(ours, 2),
        reference: bound,
        source: "goal".into(),
        met,
    };
    v.push(goal(
        "median page fetch / (exit + RTT)".into(),
        ratio,
        "<= 1.2".into(),
        ratio.map(|r| r <= 1.2),
    ));
    let two = speedups.get(&(top, "2n vmp/tso".to_string())).copied();
    v.push(goal(
        format!("2-node speedup, vmp/tso fib({top})"),
        two,
        ">= 1.8".into(),
        two.filter(|_| max_nodes >= 2).map(|s| s >= 1.8),
    ));
    if max_nodes > 2 {
        let best = speedups
            .get(&(top, format!("{max_nodes}n vmp/tso")))
            .copied();
        v.push(Figure {
            what: format!("{max_nodes}-node speedup, vmp/tso fib({top})"),
            ours: opt(best, 2),
            reference: format!("{PAPER_SPEEDUP_8} on 8 nodes, fib(46)"),
            source: "paper 004 Fig. 6".into(),
            met: None,
        });
    }
    let top_runs = runs.of(&Config::vmp_tso(max_nodes, top));
    if max_nodes > 1 && !top_runs.is_empty() {
        let worst = top_runs.iter().map(|r| worst_kernel_faults(r)).max();
        v.push(Figure {
            what: format!(
                "kernel-page faults, worst node of any run ({max_nodes}n vmp/tso fib({top}))"
            ),
            ours: opt(worst.map(|w| w as f64), 0),
            reference: format!("<= {KERNEL_FAULTS_GOAL}"),
            source: "goal".into(),
            met: worst.map(|w| w <= KERNEL_FAULTS_GOAL),
        });
        let slowest = top_runs.iter().map(|r| r.wall_ns).reduce(f64::max);
        let ratio = match (slowest, one_node_wall(runs, top)) {
            (Some(s), Some(one)) if one > 0.0 => Some(s / one),
            _ => None,
        };
        v.push(goal(
            format!("slowest run / one node's wall ({max_nodes}n vmp/tso fib({top}))"),
            ratio,
            format!("<= {SLOWEST_OVER_ONE_NODE_GOAL}"),
            ratio.map(|r| r <= SLOWEST_OVER_ONE_NODE_GOAL),
        ));
    }
    v
}

/// The links the largest node count runs over besides loopback: loopback with `delay`, and,
/// where this process may create network namespaces, namespaces with and without it.
fn other_links(delay: Duration) -> Vec<Link> {
    let mut links = Vec::new();
    if !delay.is_zero() {
        links.push(Link {
            netns: false,
            delay,
        });
    }
    match netns_available() {
        Ok(()) => {
            links.push(Link {
                netns: true,
                delay: Duration::ZERO,
            });
            if !delay.is_zero() {
                links.push(Link { netns: true, delay });
            }
        }
        Err(why) => println!("(--netns runs left out: {why})"),
    }
    links
}

/// Whether `run --netns` can work here: root, and iproute2's `ip`.
fn netns_available() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("iproute2's `ip` is not installed".into()),
    }
}

/// The remote fetches of `rs` as a log2 histogram: each node's slowest k faults, k = the
/// fetch requests it sent.
fn remote_fetches(rs: &[&RunFigures]) -> Vec<u64> {
    let mut remote = vec![0u64; 64];
    for n in rs.iter().flat_map(|r| &r.nodes) {
        add(&mut remote, &slowest(&n.buckets, n.fetches));
    }
    remote
}

/// Faults on the probe kernel's pages on the node of `r` with the most.
fn worst_kernel_faults(r: &RunFigures) -> u64 {
    r.nodes.iter().map(|n| n.kernel_faults).max().unwrap_or(0)
}

/// Prints the most-faulted pages of the first vmp/tso run at grain `fib` on `nodes` nodes,
/// with what lies there: where the faults that remain come from.
fn hottest_pages(runs: &VmpRuns, fib: u32, nodes: u16) {
    let c = Config::vmp_tso(nodes, fib);
    let Some(r) = runs.of(&c).into_iter().next() else {
        return;
    };
    println!(
        "Most-faulted pages, {} (first run; each node's top 3)",
        c.name()
    );
    for n in &r.nodes {
        let pages: Vec<String> = n
            .hot
            .iter()
            .take(3)
            .map(|(gpa, faults, symbol)| {
                let what = if symbol.is_empty() {
                    "task arena or firmware"
                } else {
                    symbol
                };
                format!("{gpa:#x} {faults} ({what})")
            })
            .collect();
        println!("  node {}: {}", n.id, pages.join("; "));
    }
    println!();
}

/// `shared-counter=2000` on `nodes` nodes, `runs` times: every run must end and be exact,
/// and the slowest should take at most [`COUNTER_SPREAD_GOAL`] times the median (the guest's
/// own time for the task). Pages every CPU writes move the most here.
fn shared_counter_runs(exe: &Path, nodes: u16, runs: usize) -> Result<Figure, String> {
    let mut times = Vec::new();
    let mut failed = Vec::new();
    for i in 0..runs {
        let mut cmd = Command::new(exe);
        cmd.args([
            "run",
            "--nodes",
            &nodes.to_string(),
            "--kernel",
            "probe",
            "--cpus",
        ])
        .arg(nodes.to_string())
        .args(["--cmdline", "probe.tasks=shared-counter=2000"]);
        let o = run_nodes(exe, cmd, COUNTER_LIMIT)?;
        let results = probe::results(o.stdout.as_bytes());
        match probe::result(&results, "shared-counter") {
            Some(l) if !o.timed_out && l["exact"] == true => {
                times.push(l["ns"].as_f64().unwrap_or(0.0));
            }
            _ if o.timed_out => failed.push(format!("run {i}: did not end in {COUNTER_LIMIT:?}")),
            l => failed.push(format!("run {i}: {:?}, {l:?}", o.status)),
        }
    }
    let med = median(&times);
    let slowest = times.iter().copied().reduce(f64::max);
    println!(
        "shared-counter=2000 on {nodes} nodes, {runs} runs: {} exact and ended; task time median {} ms, slowest {} ms{}",
        times.len(),
        opt(med.map(|m| m / 1e6), 1),
        opt(slowest.map(|m| m / 1e6), 1),
        if failed.is_empty() { String::new() } else { format!("; failed: {}", failed.join("; ")) }
    );
    let spread = match (slowest, med) {
        (Some(s), Some(m)) if m > 0.0 => Some(s / m),
        _ => None,
    };
    Ok(Figure {
        what: format!("shared-counter on {nodes} nodes, {runs} runs: slowest / median (all exact)"),
        ours: if failed.is_empty() {
            opt(spread, 2)
        } else {
            format!("{} of {runs} failed", failed.len())
        },
        reference: format!("<= {COUNTER_SPREAD_GOAL}"),
        source: "goal".into(),
        met: Some(failed.is_empty() && spread.is_some_and(|s| s <= COUNTER_SPREAD_GOAL)),
    })
}

/// Runs `cmd` (a `musubi run --nodes` of `exe`) until the probe is done or `limit` passes,
/// with memory unsampled (a sampler would take a core from the nodes).
fn run_nodes(exe: &Path, cmd: Command, limit: Duration) -> Result<Observed, String> {
    let w = Watch {
        marker: "probe: done",
        guest_bytes: None,
        timeout: limit,
        sample_every: Duration::from_millis(100),
    };
    observe(cmd, &w).map_err(|e| format!("cannot run {}: {e}", exe.display()))
}

/// The median wall time of fib(`fib`) on one node.
fn one_node_wall(runs: &VmpRuns, fib: u32) -> Option<f64> {
    let walls: Vec<f64> = runs
        .of(&Config::vmp_tso(1, fib))
        .iter()
        .map(|r| r.wall_ns)
        .collect();
    median(&walls)
}

/// The largest node count's runs over each link, beside its loopback runs.
fn links_side_by_side(runs: &VmpRuns, grains: &[u32], delay: Duration) {
    let configs = &runs.configs;
    if configs.iter().all(|c| c.link == LOOPBACK) {
        return;
    }
    let mut t = Table::new(&[
        "grain",
        "vm",
        "link",
        ">wall ms",
        ">speedup",
        ">x loopback wall",
        ">fetch median",
        ">- loopback's",
        ">fetch p99",
        ">msgs/fetch",
    ]);
    for &fib in grains {
        let shown = configs.iter().filter(|c| {
            c.fib == fib
                && c.nodes > 1
                && c.ordering == "tso"
                && c.poll
                && configs
                    .iter()
                    .any(|o| o.link != LOOPBACK && o.protocol == c.protocol && o.nodes == c.nodes)
        });
        for c in shown {
            let rs = runs.of(c);
            let loopback = Config {
                link: LOOPBACK,
                poll: true,
                ..*c
            };
            let loop_rs = runs.of(&loopback);
            let wall = median(&rs.iter().map(|r| r.wall_ns).collect::<Vec<_>>());
            let loop_wall = median(&loop_rs.iter().map(|r| r.wall_ns).collect::<Vec<_>>());
            let remote = remote_fetches(&rs);
            let fetch = quantile(&remote, 0.5);
            let loop_fetch = quantile(&remote_fetches(&loop_rs), 0.5);
            let (fetches, msgs) = rs
                .iter()
                .flat_map(|r| &r.nodes)
                .fold((0u64, 0u64), |(f, m), n| (f + n.fetches, m + n.messages));
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            t.row([
                format!("fib({fib})"),
                format!("{}n {}", c.nodes, c.protocol),
                c.link.name(),
                opt(wall.map(|w| w / 1e6), 2),
                opt(ratio(one_node_wall(runs, fib), wall), 2),
                opt(ratio(wall, loop_wall), 2),
                us(fetch),
                match (fetch, loop_fetch) {
                    (Some(a), Some(b)) => format!("{:+.1} us", (a - b) / 1e3),
                    _ => "n/a".into(),
                },
                us(quantile(&remote, 0.99)),
                opt((fetches > 0).then(|| msgs as f64 / fetches as f64), 2),
            ]);
        }
    }
    println!(
        "Links side by side, {} nodes (loopback; loopback with a one-way delay of {} on every frame;\n\
         each node in its own network namespace, veth links and a bridge, as root), median of the runs",
        configs.iter().map(|c| c.nodes).max().unwrap_or(1),
        delay_name(delay)
    );
    println!("{}", t.render());
    println!(
        "The delay is --link-delay {d}, added by the nodes' own link layer (tc netem is not in this host's\n\
         kernel): every frame is held {d} on the sending side. A remote fetch crosses the link at least\n\
         twice (request, page), so it should take at least 2 x {d} longer than over loopback; more when\n\
         a fetch is forwarded or waits for invalidations. speedup = 1-node wall / this wall, as above.\n",
        d = delay_name(delay)
    );
}

/// Runs one VM over `c.nodes` node processes and reads its result line and metrics.
fn run_one(
    exe: &Path,
    scratch: &Path,
    c: &Config,
    procs: u16,
    rep: usize,
) -> Result<RunFigures, String> {
    let metrics: PathBuf = scratch.join(format!(
        "{}-{}-{}-{}-{}-{rep}.json",
        c.nodes,
        c.protocol,
        c.ordering,
        c.link.name(),
        c.fib
    ));
    let mut cmd = Command::new(exe);
    cmd.args([
        "run",
        "--nodes",
        &c.nodes.to_string(),
        "--kernel",
        "probe",
        "--cpus",
        &c.nodes.to_string(),
        "--cmdline",
        &format!("probe.tasks=fib={},procs={procs}", c.fib),
        "--protocol",
        c.protocol,
        "--ordering",
        c.ordering,
        "--metrics",
    ])
    .arg(&metrics);
    if c.link.netns {
        cmd.arg("--netns");
    }
    if !c.link.delay.is_zero() {
        cmd.args(["--link-delay", &delay_name(c.link.delay)]);
    }
    if !c.poll {
        cmd.args(["--fetch-poll", "0us"]);
    }
    let o = run_nodes(exe, cmd, RUN_LIMIT)?;
    let why = if o.timed_out {
        Some(format!("did not end within {} s", RUN_LIMIT.as_secs()))
    } else if !o.status.is_some_and(|s| s.success()) {
        Some(format!("ended with {:?}", o.status))
    } else {
        None
    };
    let results = probe::results(o.stdout.as_bytes());
    let line = probe::result(&results, "fib").cloned();
    let line = match (why, line) {
        (None, Some(l)) if l["ok"] == true => l,
        (why, l) => {
            return Err(format!(
                "{}; result {}; console:\n{}\n{}",
                why.unwrap_or_else(|| "no good result".into()),
                l.map(|l| l.to_string()).unwrap_or_else(|| "none".into()),
                tail(&o.stdout, 10),
                tail(&o.stderr, 10)
            ))
        }
    };
    let text =
        std::fs::read_to_string(&metrics).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let m: ClusterMetrics =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let none = Metrics::default();
    let nodes = m
        .nodes
        .iter()
        .map(|n| node_figures(n.as_ref().unwrap_or(&none)))
        .collect::<Vec<_>>();
    if nodes.len() != c.nodes as usize {
        return Err(format!(
            "--metrics lists {} nodes, not {}",
            nodes.len(),
            c.nodes
        ));
    }
    if let Some(n) = nodes.iter().find(|n| n.protocol_errors > 0) {
        return Err(format!(
            "node {} counted {} protocol errors",
            n.id, n.protocol_errors
        ));
    }
    let tasks = line["tasks"]
        .as_array()
        .ok_or("the result has no tasks")?
        .iter()
        .map(|t| {
            (
                t["cpu"].as_u64().unwrap_or(0),
                t["ns"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    Ok(RunFigures {
        wall_ns: line["wall_ns"]
            .as_f64()
            .ok_or("the result has no wall_ns")?,
        tasks,
        nodes,
    })
}

fn node_figures(m: &Metrics) -> NodeFigures {
    let node = m.node.as_ref();
    let co = node.and_then(|n| n.coherence.as_ref());
    let buckets = co.map_or_else(|| vec![0; 64], |c| c.faults.latency_log2_ns.clone());
    let absent = Coherence::default();
    let co = co.unwrap_or(&absent);
    let f = &co.faults;
    let range_bytes = f.range_bytes.max(1);
    let kernel_faults = f
        .by_range
        .iter()
        .filter(|(start, _)| **start < 2 << 20 && *start + range_bytes <= 2 << 20)
        .map(|(_, n)| n)
        .sum();
    let hot = f
        .hot_pages
        .iter()
        .map(|p| (p.gpa, p.faults, p.symbol.clone().unwrap_or_default()))
        .collect();
    let (exits, vmm_ns) = m
        .vcpus
        .iter()
        .flat_map(|v| &v.exits)
        .fold((0u64, 0.0), |(n, t), e| (n + e.count, t + e.vmm_ns as f64));
    NodeFigures {
        id: node.map_or(0, |n| n.id),
        faults: f.count,
        fetches: co.sent_of(&REQUESTS),
        messages: co.sent_of(&COHERENCE),
        buckets,
        by_range: f.by_range.clone(),
        range_bytes,
        kernel_faults,
        hot,
        exits,
        vmm_ns,
        protocol_errors: co.protocol_errors,
    }
}

/// The simulator's messages per fetch for this VM's protocol and ordering over what a fetch
/// can be with `nodes` nodes, and the paper's printed range (its orderings only).
fn sim_range(c: &Config, nodes: u16) -> (String, String) {
    let protocol = match c.protocol {
        "ivy" => dsm::Protocol::Ivy,
        _ => dsm::Protocol::Vmp,
    };
    let ordering = match c.ordering {
        "paper" => dsm::Ordering::Paper,
        _ => dsm::Ordering::Tso,
    };
    let max_c = u32::from(nodes.saturating_sub(2));
    let managers: &[ManagerAt] = if nodes >= 3 {
        &ManagerAt::ALL
    } else {
        &[ManagerAt::Requester, ManagerAt::Owner]
    };
    let (mut lo, mut hi, mut plo, mut phi) = (u64::MAX, 0, u64::MAX, 0);
    for access in [dsm::Access::Read, dsm::Access::Write] {
        for &m in managers {
            for k in 0..=max_c {
                if let Ok(cell) = measure_ordered(protocol, ordering, access, m, k) {
                    lo = lo.min(cell.messages);
                    hi = hi.max(cell.messages);
                }
                let (p, _) = dsm::table3::paper(protocol, access, m, k);
                plo = plo.min(p);
                phi = phi.max(p);
            }
        }
    }
    let r = |a: u64, b: u64| {
        if a > b {
            "n/a".to_string()
        } else {
            format!("{a}-{b}")
        }
    };
    (r(lo, hi), r(plo, phi))
}

/// Times `count` round trips over 127.0.0.1 (`out` bytes there, `back` bytes back, no
/// Nagle), at most ten seconds of them.
fn loopback_rtt(count: usize, out: usize, back: usize) -> Result<Vec<f64>, String> {
    let err = |e: std::io::Error| format!("loopback round trip: {e}");
    let l = TcpListener::bind("127.0.0.1:0").map_err(err)?;
    let addr = l.local_addr().map_err(err)?;
    let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(err)?;
    let (mut s, _) = l.accept().map_err(err)?;
    for x in [&c, &s] {
        x.set_nodelay(true).map_err(err)?;
        x.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(err)?;
    }
    let server = std::thread::spawn(move || {
        let (mut a, b) = (vec![0u8; out], vec![7u8; back]);
        while s.read_exact(&mut a).is_ok() {
            if s.write_all(&b).is_err() {
                break;
            }
        }
    });
    let (a, mut b) = (vec![1u8; out], vec![0u8; back]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut times = Vec::with_capacity(count);
    let mut result = Ok(());
    for _ in 0..count {
        let t0 = Instant::now();
        if let Err(e) = c.write_all(&a).and_then(|_| c.read_exact(&mut b)) {
            result = Err(err(e));
            break;
        }
        times.push(t0.elapsed().as_nanos() as f64);
        if Instant::now() > deadline {
            break;
        }
    }
    drop(c);
    let _ = server.join();
    result.map(|_| times)
}

/// The host's 1-minute load average, as /proc/loadavg gives it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(String::from))
        .unwrap_or_else(|| "n/a".into())
}

fn add(into: &mut [u64], b: &[u64]) {
    for (i, v) in b.iter().enumerate().take(into.len()) {
        into[i] += v;
    }
}

/// The `k` slowest entries of a log2 histogram, as a histogram.
fn slowest(b: &[u64], mut k: u64) -> Vec<u64> {
    let mut out = vec![0u64; b.len()];
    for i in (0..b.len()).rev() {
        let take = b[i].min(k);
        out[i] = take;
        k -= take;
    }
    out
}

/// Sum of the latencies in a log2 histogram, each taken at its bucket's middle (1.5 * 2^i).
fn fault_ns(b: &[u64]) -> f64 {
    b.iter()
        .enumerate()
        .map(|(i, n)| *n as f64 * 1.5 * (i as f64).exp2())
        .sum()
}

/// The `q` quantile of a log2 histogram, interpolated geometrically inside its bucket.
fn quantile(b: &[u64], q: f64) -> Option<f64> {
    let total: u64 = b.iter().sum();
    if total == 0 {
        return None;
    }
    let want = q * total as f64;
    let mut before = 0.0;
    for (i, n) in b.iter().enumerate() {
        let n = *n as f64;
        if n > 0.0 && before + n >= want {
            let frac = ((want - before) / n).clamp(0.0, 1.0);
            return Some((i as f64 + frac).exp2());
        }
        before += n;
    }
    None
}

/// A bucket's span, `[2^i, 2^(i+1))` ns, in readable units.
fn span(i: usize) -> String {
    let lo = (1u64 << i) as f64;
    if lo >= 1e6 {
        format!("{:.0}ms", lo / 1e6)
    } else if lo >= 1e3 {
        format!("{:.0}us", lo / 1e3)
    } else {
        format!("{lo:.0}ns")
    }
}

fn us(v: Option<f64>) -> String {
    v.map(|v| format!("{:.1} us", v / 1e3))
        .unwrap_or_else(|| "n/a".into())
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map(|v| format!("{v:.decimals$}"))
        .unwrap_or_else(|| "n/a".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_and_sums() {
        let mut b = vec![0u64; 64];
        b[10] = 2;
        b[16] = 2;
        assert_eq!(quantile(&b, 0.5), Some(2048.0));
        assert!(quantile(&b, 0.99).unwrap() > 65536.0);
        assert_eq!(quantile(&[0; 64], 0.5), None);
        assert_eq!(fault_ns(&b), 2.0 * 1.5 * 1024.0 + 2.0 * 1.5 * 65536.0);
        let s = slowest(&b, 3);
        assert_eq!((s[16], s[10]), (2, 1));
        assert_eq!(span(16), "66us");
    }

    #[test]
    fn loopback_round_trips_are_timed() {
        let t = loopback_rtt(5, 8, 16).unwrap();
        assert_eq!(t.len(), 5);
        assert!(t.iter().all(|x| *x > 0.0));
    }

    #[test]
    fn links_are_named_as_the_flags_take_them() {
        let d = |us| Duration::from_micros(us);
        assert_eq!(LOOPBACK.name(), "loopback");
        let delayed = Link {
            netns: false,
            delay: d(100),
        };
        assert_eq!(delayed.name(), "loopback+100us");
        let ns = Link {
            netns: true,
            delay: d(2000),
        };
        assert_eq!(ns.name(), "netns+2ms");
        assert_eq!(delay_name(Duration::from_nanos(1500)), "1500ns");
        for s in ["100us", "2ms", "1500ns", "1500us"] {
            let parsed = musubi_cluster::parse_duration(s).unwrap();
            assert_eq!(
                musubi_cluster::parse_duration(&delay_name(parsed)),
                Ok(parsed)
            );
        }
    }

    #[test]
    fn simulator_range_for_two_nodes() {
        let c = Config {
            nodes: 2,
            protocol: "vmp",
            ordering: "paper",
            fib: 1,
            link: LOOPBACK,
            poll: true,
        };
        assert_eq!(sim_range(&c, 2), ("2-3".to_string(), "2-3".to_string()));
    }
}
