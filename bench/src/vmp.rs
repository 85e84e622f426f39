//! `musubi bench vmp`: paper 004 §5.2 — one VM over 1..N node processes on this host, its
//! memory kept coherent page by page over loopback TCP. Parallel fib (Fig. 6: speedup over
//! one node), the per-vCPU breakdown of Table 2 as far as it can be measured here, the page
//! fetch latencies (Fig. 8) and the fetched guest-physical ranges (Fig. 7), and messages per
//! fetch beside the simulator's Table 3. In the same run it times one loopback TCP round trip
//! and one VM exit, so the fetch latency can be judged against what it is made of. The
//! largest node count also runs over a delayed link (`--link-delay`) and, as root, with each
//! node in its own network namespace (`--netns`), beside the loopback runs.

use super::guest_run::in_vm;
use super::report::{figures_table, Csv, Figure, Table};
use super::stats::median;
use super::watch::{observe, tail, Observed, Watch};
use super::{plot, Harness};
use crate::probe;
use dsm::table3::{measure_ordered, ManagerAt};
use serde_json::Value;
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

pub fn run(h: &Harness, args: &super::BenchArgs) -> Result<(), String> {
    let max_nodes = args.nodes.unwrap_or_else(default_nodes).clamp(1, 8);
    // The paper ran 8 processes on 1..8 nodes: the same work on every node count. Here the
    // process count is the largest node count, one vCPU per node.
    let procs = max_nodes;
    let grains = grains(h.quick);
    let reps = if h.quick { 1 } else { 3 };
    let mut configs = Vec::new();
    for &fib in grains.iter().chain([1].iter()) {
        for nodes in 1..=max_nodes {
            if nodes == 1 {
                configs.push(Config::vmp_tso(nodes, fib));
                continue;
            }
            for protocol in ["vmp", "ivy"] {
                configs.push(Config {
                    nodes,
                    protocol,
                    ordering: "tso",
                    fib,
                    link: LOOPBACK,
                    poll: true,
                });
            }
        }
        if max_nodes > 1 {
            configs.push(Config {
                nodes: max_nodes,
                protocol: "vmp",
                ordering: "paper",
                fib,
                link: LOOPBACK,
                poll: true,
            });
            if Some(&fib) == grains.last() {
                configs.push(Config {
                    nodes: max_nodes,
                    protocol: "vmp",
                    ordering: "tso",
                    fib,
                    link: LOOPBACK,
                    poll: false,
                });
            }
        }
    }
    // The other links, at the largest node count and the task grains (the breakdown's
    // baseline runs stay on loopback).
    let links = other_links(args.link_delay);
    if max_nodes > 1 {
        for &fib in &grains {
            for &link in &links {
                for protocol in ["vmp", "ivy"] {
                    configs.push(Config {
                        nodes: max_nodes,
                        protocol,
                        ordering: "tso",
                        fib,
                        link,
                        poll: true,
                    });
                }
            }
        }
    }
    let exe = crate::probe::musubi()?;
    let scratch = tempfile::tempdir().map_err(|e| format!("scratch directory: {e}"))?;
    let load_before = loadavg();
    let started = Instant::now();
    let runs = h.run_schedule(&configs, reps, Config::name, |rep, c| {
        run_one(&exe, scratch.path(), c, procs, rep)
    })?;

    // The two costs a remote page fetch is built from, measured in the same run.
    let rtt = loopback_rtt(if h.quick { 200 } else { 2000 }, 64, 64)?;
    let rtt_page = loopback_rtt(if h.quick { 200 } else { 2000 }, 64, 4096)?;
    let pings = if h.quick { 200 } else { 2000 };
    let exit_ns = {
        let r = in_vm(&format!("port-ping={pings}"), ExitsMode::Kernel, None)?;
        r.ns().ok_or("port-ping: no time in its result")? / pings as f64
    };

    let of = |c: &Config| runs_of(&runs, &configs, c);
    let med = |xs: Vec<f64>| median(&xs);
    let one_node_wall = |fib: u32| one_node_wall(&runs, &configs, fib);

    let mut csv = Csv::new(&[
        "nodes",
        "protocol",
        "ordering",
        "link",
        "polling",
        "fib",
        "procs",
        "rep",
        "node",
        "wall_ns",
        "task_ns",
        "faults",
        "fetches",
        "coherence_messages",
        "fault_ns_estimate",
        "exits",
        "vmm_exit_ns",
        "protocol_errors",
    ]);
    for (rep, ci, r) in &runs {
        let c = configs[*ci];
        for n in &r.nodes {
            csv.row([
                c.nodes.to_string(),
                c.protocol.to_string(),
                c.ordering.to_string(),
                c.link.name(),
                if c.poll { "yes" } else { "no" }.to_string(),
                c.fib.to_string(),
                procs.to_string(),
                rep.to_string(),
                n.id.to_string(),
                format!("{:.0}", r.wall_ns),
                format!("{:.0}", r.busy_ns(n.id as u64)),
                n.faults.to_string(),
                n.fetches.to_string(),
                n.messages.to_string(),
                format!("{:.0}", fault_ns(&n.buckets)),
                n.exits.to_string(),
                format!("{:.0}", n.vmm_ns),
                n.protocol_errors.to_string(),
            ]);
        }
    }

    // ---- Fig. 6: wall time and speedup over one node ----
    println!(
        "Parallel fib over 1..{max_nodes} nodes (paper 004 Fig. 6; {procs} processes on every node count, \
         one vCPU per node, {reps} run(s) each, median)"
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
    for &fib in &grains {
        let base = one_node_wall(fib);
        for c in configs
            .iter()
            .filter(|c| c.fib == fib && c.link == LOOPBACK)
        {
            let rs = of(c);
            let wall = med(rs.iter().map(|r| r.wall_ns).collect());
            let sp = match (base, wall) {
                (Some(b), Some(w)) if w > 0.0 => Some(b / w),
                _ => None,
            };
            let faults = med(rs
                .iter()
                .map(|r| r.nodes.iter().map(|n| n.faults).sum::<u64>() as f64)
                .collect());
            let fetches = med(rs
                .iter()
                .map(|r| r.nodes.iter().map(|n| n.fetches).sum::<u64>() as f64)
                .collect());
            let kernel = med(rs.iter().map(|r| worst_kernel_faults(r) as f64).collect());
            if let Some(s) = sp {
                speedups.insert((fib, c.label()), s);
                if c.nodes > 1 {
                    let label = c.label();
                    let line = label.split_once(' ').map_or(label.as_str(), |(_, l)| l);
                    let points = lines.entry(format!("{line} fib({fib})")).or_default();
                    if points.is_empty() {
                        points.push((1.0, 1.0));
                    }
                    points.push((c.nodes as f64, s));
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
                opt(faults, 0),
                opt(fetches, 0),
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
        default_nodes()
    );
    hottest_pages(&runs, &configs, *grains.last().unwrap_or(&1), max_nodes);
    links_side_by_side(&runs, &configs, &grains, args.link_delay);

    // ---- Table 2: per-vCPU breakdown at the largest grain on the most nodes ----
    let top = *grains.last().unwrap_or(&1);
    let native_task = {
        med(of(&Config::vmp_tso(1, top))
            .iter()
            .flat_map(|r| r.tasks.iter().map(|t| t.1))
            .collect())
    };
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
    let breakdown_configs: Vec<Config> = configs
        .iter()
        .filter(|c| {
            c.fib == top && c.link == LOOPBACK && c.poll && (c.nodes == 1 || c.nodes == max_nodes)
        })
        .copied()
        .collect();
    for c in &breakdown_configs {
        let baseline = Config { fib: 1, ..*c };
        let rs = of(c);
        let bs = of(&baseline);
        for cpu in 0..c.nodes {
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
            t2.row([
                c.label(),
                cpu.to_string(),
                ms(total),
                ms(native),
                ms(mem),
                ms(misc),
                ms(idle),
                ms(rest),
            ]);
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

    // ---- Fig. 8 and Fig. 7 at the largest grain on the most nodes ----
    let mut figures = Vec::new();
    let mut hist_csv = Csv::new(&[
        "protocol",
        "ordering",
        "polling",
        "bucket_ns_low",
        "faults",
        "remote_fetches",
    ]);
    let mut cdf: Vec<plot::Series> = Vec::new();
    let mut range_bars = Vec::new();
    let mut msg_table = Table::new(&[
        "vm",
        ">messages/fault",
        ">messages/fetch",
        ">sim Table 3 (c=0..N-2)",
        "paper Table 3",
    ]);
    let mut vmp_median = None;
    for c in configs
        .iter()
        .filter(|c| c.fib == top && c.nodes == max_nodes && c.nodes > 1 && c.link == LOOPBACK)
    {
        let rs = of(c);
        let mut all = vec![0u64; 64];
        let mut remote = vec![0u64; 64];
        let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();
        let (mut faults, mut fetches, mut msgs, mut range_bytes) = (0u64, 0u64, 0u64, 0u64);
        for r in &rs {
            for n in &r.nodes {
                add(&mut all, &n.buckets);
                add(&mut remote, &slowest(&n.buckets, n.fetches));
                for (k, v) in &n.by_range {
                    *ranges.entry(*k).or_default() += v;
                }
                faults += n.faults;
                fetches += n.fetches;
                msgs += n.messages;
                range_bytes = n.range_bytes;
            }
        }
        for (i, (a, r)) in all.iter().zip(&remote).enumerate() {
            if *a > 0 {
                hist_csv.row([
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
            quantile(&all, 0.5),
            quantile(&remote, 0.5),
            quantile(&remote, 0.99),
        );
        println!(
            "Page faults, {} fib({top}), {} run(s): {faults} faults, {fetches} remote fetches; \
             latency median of all faults {}, of remote fetches {} (p99 {})",
            c.label(),
            rs.len(),
            us(m_all),
            us(m_remote),
            us(p99)
        );
        println!(
            "  latency histogram (all faults / remote fetches):{}",
            all.iter()
                .zip(&remote)
                .enumerate()
                .filter(|(_, (a, _))| **a > 0)
                .map(|(i, (a, r))| format!(" [{}: {a}/{r}]", span(i)))
                .collect::<String>()
        );
        let mut top_ranges: Vec<(u64, u64)> = ranges.into_iter().collect();
        top_ranges.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let shown: Vec<String> = top_ranges
            .iter()
            .take(5)
            .map(|(start, n)| format!("{start:#x}: {n}"))
            .collect();
        println!(
            "  faults by guest-physical range ({} KiB each, top 5): {}",
            range_bytes / 1024,
            shown.join(", ")
        );
        // Cumulative share of fetches done by the top of each power-of-two bucket.
        let total: u64 = remote.iter().sum();
        let mut done = 0u64;
        let mut points = Vec::new();
        for (i, r) in remote.iter().enumerate() {
            done += r;
            if total > 0 && done > 0 && done - r < total {
                points.push((
                    (1u64 << (i + 1)) as f64 / 1e3,
                    100.0 * done as f64 / total as f64,
                ));
            }
        }
        if !points.is_empty() {
            let label = c.label();
            let name = label.split_once(' ').map_or(label.as_str(), |(_, l)| l);
            cdf.push(plot::Series {
                name: name.to_string(),
                points,
            });
        }
        if c.protocol == "vmp" && c.ordering == "tso" && c.poll {
            vmp_median = m_remote;
            for (start, n) in top_ranges.iter().take(5) {
                range_bars.push(plot::Bar {
                    label: format!("{:#x}", start),
                    value: *n as f64,
                    low: None,
                });
            }
        }
        let (sim, paper) = sim_range(c, max_nodes);
        msg_table.row([
            c.label(),
            opt((faults > 0).then(|| msgs as f64 / faults as f64), 2),
            opt((fetches > 0).then(|| msgs as f64 / fetches as f64), 2),
            sim,
            paper,
        ]);
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

    // ---- The goals ----
    let rtt_med = median(&rtt);
    let rtt_page_med = median(&rtt_page);
    println!(
        "Loopback TCP round trip (127.0.0.1, {} ping-pongs): 64 B each way {}; 64 B out, 4 KiB back {}",
        rtt.len(),
        us(rtt_med),
        us(rtt_page_med)
    );
    println!(
        "One VM exit (port-ping from guest user mode, {pings} writes, one node, in-kernel exits): {}",
        us(Some(exit_ns))
    );
    let budget = rtt_med.map(|r| r + exit_ns);
    let ratio = match (vmp_median, budget) {
        (Some(m), Some(b)) if b > 0.0 => Some(m / b),
        _ => None,
    };
    println!(
        "median remote fetch (vmp/tso, {max_nodes} nodes, fib({top})) = {} x (exit + RTT = {})",
        opt(ratio, 2),
        us(budget)
    );
    figures.push(Figure {
        what: "median page fetch / (exit + RTT)".into(),
        ours: opt(ratio, 2),
        reference: "<= 1.2".into(),
        source: "goal".into(),
        met: ratio.map(|r| r <= 1.2),
    });
    let two = speedups.get(&(top, "2n vmp/tso".to_string())).copied();
    figures.push(Figure {
        what: format!("2-node speedup, vmp/tso fib({top})"),
        ours: opt(two, 2),
        reference: ">= 1.8".into(),
        source: "goal".into(),
        met: if max_nodes >= 2 {
            two.map(|s| s >= 1.8)
        } else {
            None
        },
    });
    if max_nodes > 2 {
        let best = speedups
            .get(&(top, format!("{max_nodes}n vmp/tso")))
            .copied();
        figures.push(Figure {
            what: format!("{max_nodes}-node speedup, vmp/tso fib({top})"),
            ours: opt(best, 2),
            reference: format!("{PAPER_SPEEDUP_8} on 8 nodes, fib(46)"),
            source: "paper 004 Fig. 6".into(),
            met: None,
        });
    }
    let top_runs = of(&Config::vmp_tso(max_nodes, top));
    if max_nodes > 1 && !top_runs.is_empty() {
        let worst = top_runs.iter().map(|r| worst_kernel_faults(r)).max();
        figures.push(Figure {
            what: format!(
                "kernel-page faults, worst node of any run ({max_nodes}n vmp/tso fib({top}))"
            ),
            ours: opt(worst.map(|w| w as f64), 0),
            reference: format!("<= {KERNEL_FAULTS_GOAL}"),
            source: "goal".into(),
            met: worst.map(|w| w <= KERNEL_FAULTS_GOAL),
        });
        let slowest = top_runs.iter().map(|r| r.wall_ns).reduce(f64::max);
        let ratio = match (slowest, one_node_wall(top)) {
            (Some(s), Some(one)) if one > 0.0 => Some(s / one),
            _ => None,
        };
        figures.push(Figure {
            what: format!("slowest run / one node's wall ({max_nodes}n vmp/tso fib({top}))"),
            ours: opt(ratio, 2),
            reference: format!("<= {SLOWEST_OVER_ONE_NODE_GOAL}"),
            source: "goal".into(),
            met: ratio.map(|r| r <= SLOWEST_OVER_ONE_NODE_GOAL),
        });
        let counter = shared_counter_runs(&exe, max_nodes, if h.quick { 3 } else { 20 })?;
        figures.push(counter);
    }
    println!("{}", figures_table(&figures));
    if h.quick {
        println!(
            "(--quick: fib({top}) is a small grain, so the speedup goal is judged on a grain far below the paper's.)"
        );
    }
    println!(
        "runs took {:.1} s in all; grains {:?}; {reps} run(s) per configuration; host load average \
         (1 min) {} before, {} after, on {} cores: whatever else runs takes cores from the nodes",
        started.elapsed().as_secs_f64(),
        grains,
        load_before,
        loadavg(),
        default_nodes()
    );

    h.write_csv("vmp-latency.csv", &hist_csv)?;
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
    if !cdf.is_empty() {
        drawings.push(plot::Drawing::Lines(plot::Lines {
            title: format!("remote fetch latency, fib({top}), {max_nodes} nodes (cumulative)"),
            x_desc: "latency (us, log scale; at the top of each power-of-two bucket)".into(),
            y_desc: "fetches done (%)".into(),
            log_x: true,
            legend: plotters::prelude::SeriesLabelPosition::LowerRight,
            series: cdf,
        }));
    }
    if !range_bars.is_empty() {
        drawings.push(plot::Drawing::Bars(plot::Panel {
            title: "faults by guest-physical range, top 5".into(),
            unit: "faults".into(),
            bars: range_bars,
        }));
    }
    let p = h.write_csv("vmp.csv", &csv)?;
    let svg = h.out_file("vmp.svg");
    plot::chart(&svg, "one VM over several nodes", &drawings)?;
    println!("csv: {}\nplot: {}", p.display(), svg.display());
    Ok(())
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

/// The runs of configuration `c`.
fn runs_of<'a>(
    runs: &'a [(usize, usize, RunFigures)],
    configs: &[Config],
    c: &Config,
) -> Vec<&'a RunFigures> {
    runs.iter()
        .filter(|(_, ci, _)| configs[*ci] == *c)
        .map(|(_, _, r)| r)
        .collect()
}

/// Faults on the probe kernel's pages on the node of `r` with the most.
fn worst_kernel_faults(r: &RunFigures) -> u64 {
    r.nodes.iter().map(|n| n.kernel_faults).max().unwrap_or(0)
}

/// Prints the most-faulted pages of the first vmp/tso run at grain `fib` on `nodes` nodes,
/// with what lies there: where the faults that remain come from.
fn hottest_pages(runs: &[(usize, usize, RunFigures)], configs: &[Config], fib: u32, nodes: u16) {
    let c = Config::vmp_tso(nodes, fib);
    let Some(r) = runs_of(runs, configs, &c).into_iter().next() else {
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
fn one_node_wall(runs: &[(usize, usize, RunFigures)], configs: &[Config], fib: u32) -> Option<f64> {
    let walls: Vec<f64> = runs_of(runs, configs, &Config::vmp_tso(1, fib))
        .iter()
        .map(|r| r.wall_ns)
        .collect();
    median(&walls)
}

/// The largest node count's runs over each link, beside its loopback runs.
fn links_side_by_side(
    runs: &[(usize, usize, RunFigures)],
    configs: &[Config],
    grains: &[u32],
    delay: Duration,
) {
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
            let rs = runs_of(runs, configs, c);
            let loopback = Config {
                link: LOOPBACK,
                poll: true,
                ..*c
            };
            let loop_rs = runs_of(runs, configs, &loopback);
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
                opt(ratio(one_node_wall(runs, configs, fib), wall), 2),
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
    let m: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let nodes = m["nodes"]
        .as_array()
        .ok_or("--metrics has no nodes")?
        .iter()
        .map(node_figures)
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

fn node_figures(m: &Value) -> NodeFigures {
    let node = &m["node"];
    let co = &node["coherence"];
    let f = &co["faults"];
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    let buckets = f["latency_log2_ns"]
        .as_array()
        .map(|a| a.iter().map(u).collect())
        .unwrap_or_else(|| vec![0; 64]);
    let by_range: BTreeMap<u64, u64> = f["by_range"]
        .as_object()
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| Some((k.parse().ok()?, u(v))))
                .collect()
        })
        .unwrap_or_default();
    let range_bytes = u(&f["range_bytes"]).max(1);
    let kernel_faults = by_range
        .iter()
        .filter(|(start, _)| **start < 2 << 20 && *start + range_bytes <= 2 << 20)
        .map(|(_, n)| n)
        .sum();
    let hot = f["hot_pages"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let symbol = p["symbol"].as_str().unwrap_or("").to_string();
            (u(&p["gpa"]), u(&p["faults"]), symbol)
        })
        .collect();
    let sent = &co["sent"];
    let (mut exits, mut vmm_ns) = (0u64, 0.0);
    for v in m["vcpus"].as_array().into_iter().flatten() {
        for e in v["exits"].as_array().into_iter().flatten() {
            exits += u(&e["count"]);
            vmm_ns += u(&e["vmm_ns"]) as f64;
        }
    }
    NodeFigures {
        id: u(&node["id"]) as u16,
        faults: u(&f["count"]),
        fetches: REQUESTS.iter().map(|k| u(&sent[*k])).sum(),
        messages: COHERENCE.iter().map(|k| u(&sent[*k])).sum(),
        buckets,
        by_range,
        range_bytes,
        kernel_faults,
        hot,
        exits,
        vmm_ns,
        protocol_errors: u(&co["protocol_errors"]),
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
