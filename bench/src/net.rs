//! `musubi bench net`: virtio-net over a TAP, Musubi on both exit paths beside Firecracker
//! and QEMU (no vhost), on the same probe guest: UDP request/response rate and latency, TCP
//! stream throughput, and what each packet costs in doorbells, interrupts and exits; and
//! the same loads with no VM (`no-vm`, a client on a veth: `net_ceiling`), the ceiling each
//! VMM is read against; then Musubi's two flows over two queue pairs beside one
//! (`net_flows`).
//!
//! All traffic stays in a network namespace made for the run ([`Netns`]): a persistent TAP
//! `tap0` (10.0.0.1/24) that every VMM opens in turn, and the host's ends (a UDP echo, a TCP
//! sink) on threads of this program that entered it. Each run boots the guest twice, once
//! per task, so the VMM's counters of a run belong to one kind of load.

use super::driver::{
    chart_title, contender_rows, measure_contenders, measured_per_config, print_dropped,
    summary_bars, warm_up, Columns, Contender, ContenderRuns, Missing, Outputs, Verdicts,
};
use super::ns_cpu::{Busy, Mark};
use super::peers::{self, Micro};
use super::probe::Ending;
use super::qemu::{self, Peer, Qemu};
use super::report::{cell, Csv, Figure, Table};
use super::stats::{max, ratio, Summary};
use super::{plot, BenchArgs, Harness};
use musubi_types::Metrics;
use serde_json::Value;
use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const HOST: &str = "10.0.0.1";
const GUEST: &str = "10.0.0.2/24";
const UDP_PORT: u16 = 7777;
pub(crate) const TCP_PORT: u16 = 9000;
const TAP: &str = "tap0";
/// Firecracker wants the guest's MAC; the others pick their own.
const GUEST_MAC: &str = "06:00:0a:00:00:02";
const MEMORY_MIB: u64 = 128;
/// One boot with its task, on a loaded two-core machine; a hung VM fails its run here.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
/// Lines of a VMM's output quoted when a run fails: enough to reach back past a peer's
/// shutdown lines to what it logged about the device.
const LINES: usize = 10;

/// Musubi's goals, each against the better of Firecracker and QEMU in the same run.
const GOAL_RATE: f64 = 1.2;
const GOAL_STREAM: f64 = 1.5;
const GOAL_P50: f64 = 1.0;
const GOAL_SOURCE: &str = "Musubi goal, same run";
/// The aim for the kernel path's UDP rate as a fraction of the no-VM ceiling.
const AIM_CEILING_RATE: f64 = 0.5;
/// The ceiling row's name.
const NO_VM: &str = "no-vm";

/// How much each run moves.
#[derive(Clone, Copy, Debug)]
struct Load {
    udp_rounds: u64,
    tcp_bytes: u64,
}

/// Some seconds a run on this machine (100000 rounds at 7000 to 35000 a second, 512 MiB at
/// about a Gbit/s), long enough that the boot is a small part of the VMM's counts and the
/// host's drifts average out, short enough that 5 runs of 4 VMMs take a few minutes.
const FULL: Load = Load {
    udp_rounds: 100_000,
    tcp_bytes: 512 << 20,
};
const QUICK: Load = Load {
    udp_rounds: 200,
    tcp_bytes: 1 << 20,
};
/// The discarded first run of each VMM: ARP, page cache and the peer's availability.
const WARM_UP: Load = Load {
    udp_rounds: 50,
    tcp_bytes: 256 << 10,
};

#[derive(Clone, Debug)]
enum Vmm {
    Musubi {
        exe: PathBuf,
        elf: PathBuf,
        exits: &'static str,
        /// `--io-poll`, when not the default.
        io_poll: Option<&'static str>,
    },
    Firecracker {
        micro: Micro,
    },
    Qemu(Qemu),
    /// No VM: the guest's loads from a client on a veth (`net_ceiling`). A failure puts it
    /// out of the run as a peer's does.
    NoVm,
}

impl Contender for Vmm {
    fn name(&self) -> String {
        match self {
            Vmm::Musubi {
                exits,
                io_poll: None,
                ..
            } => format!("musubi-{exits}"),
            Vmm::Musubi { exits, .. } => format!("musubi-{exits}-nopoll"),
            Vmm::Firecracker { .. } => "firecracker".into(),
            Vmm::Qemu(_) => "qemu".into(),
            Vmm::NoVm => NO_VM.into(),
        }
    }

    fn is_peer(&self) -> bool {
        !matches!(self, Vmm::Musubi { .. })
    }
}

impl Vmm {
    /// The VMM booting the probe guest with `cmdline` on `tap0`, its console on stdout, its
    /// files in `dir` (Musubi's counters in `metrics.json`). Not yet inside the namespace.
    fn command(&self, cmdline: &str, dir: &Path) -> Result<Command, String> {
        Ok(match self {
            Vmm::Musubi {
                exe,
                elf,
                exits,
                io_poll,
            } => {
                let mut cmd = Command::new(exe);
                cmd.args(["run", "--kernel"])
                    .arg(elf)
                    .args(["--cmdline", cmdline])
                    .args(["--memory", &format!("{MEMORY_MIB}M")])
                    .args(["--exits", exits, "--net", &format!("tap={TAP}")])
                    .arg("--metrics")
                    .arg(dir.join("metrics.json"));
                if let Some(p) = io_poll {
                    cmd.args(["--io-poll", p]);
                }
                cmd
            }
            Vmm::Firecracker { micro } => micro.firecracker_with(
                dir,
                cmdline,
                MEMORY_MIB,
                (
                    "network-interfaces",
                    serde_json::json!([
                        {"iface_id": "eth0", "host_dev_name": TAP, "guest_mac": GUEST_MAC}
                    ]),
                ),
            )?,
            Vmm::Qemu(q) => {
                let mut cmd = q.command(MEMORY_MIB, cmdline);
                let netdev = format!("tap,id=n0,ifname={TAP},script=no,downscript=no,vhost=off");
                cmd.args(["-global", "virtio-mmio.force-legacy=false", "-no-reboot"])
                    .args(["-netdev", &netdev, "-device", "virtio-net-device,netdev=n0"]);
                cmd
            }
            Vmm::NoVm => return Err("the no-VM row boots nothing".into()),
        })
    }
}

/// The VMM's own counts over one boot (Musubi's `--metrics`).
#[derive(Clone, Copy, Debug)]
struct VmmCounts {
    exits: f64,
    doorbell_exits: f64,
    packets: f64,
    /// The I/O thread's CPU time, the part of it spent polling (`--io-poll`), and its
    /// wake-ups from sleep, in ns and counts.
    io_cpu_ns: f64,
    io_poll_ns: f64,
    io_wakeups: f64,
}

/// The guest driver's counts over one task.
#[derive(Clone, Copy, Debug)]
struct GuestCounts {
    packets: f64,
    kicks: f64,
    interrupts: f64,
    /// The share of the stream the guest's driver spent polling its rings or halted for
    /// the device (`tcp-send`'s `waited_us` over `us`; none for other tasks): a vCPU thread
    /// that is busy throughout may still be waiting for the host most of that time.
    waiting: Option<f64>,
}

impl GuestCounts {
    fn of(r: &Value) -> Result<GuestCounts, String> {
        let n = |k: &str| r[k].as_f64().ok_or_else(|| format!("no {k} in {r}"));
        Ok(GuestCounts {
            packets: n("tx_packets")? + n("rx_packets")?,
            kicks: n("kicks")?,
            interrupts: n("interrupts")?,
            waiting: r["waited_us"]
                .as_f64()
                .zip(r["us"].as_f64())
                .and_then(|(waited, us)| ratio(waited, us)),
        })
    }
}

#[derive(Clone, Debug)]
struct Sample {
    rounds: u64,
    lost: u64,
    rate_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    udp_guest: GuestCounts,
    udp_vmm: Option<VmmCounts>,
    tcp_bytes: u64,
    sink_bytes: u64,
    mbit_per_s: f64,
    tcp_guest: GuestCounts,
    tcp_vmm: Option<VmmCounts>,
    /// How busy the VMM's vCPU threads and its other threads kept the CPUs during the
    /// stream (none for no-vm).
    tcp_busy: Option<Busy>,
}

/// The runs of every VMM; a peer's may have failed or not been made.
type NetRuns = ContenderRuns<Vmm, Sample>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let listed = peers::parse_compare(args.compare.as_deref())?;
    let ns = Netns::new()?;
    let load = if h.quick { QUICK } else { FULL };
    let reps = if h.quick { 1 } else { 5 };
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    println!(
        "net: probe guest, 1 vCPU, {MEMORY_MIB} MiB, virtio-net on the persistent TAP {TAP} ({HOST}/24) \
         in the network namespace {}",
        ns.name
    );
    println!(
        "  udp-echo n={} (64-byte request/response) and tcp-send bytes={} MiB, one boot each;",
        load.udp_rounds,
        load.tcp_bytes >> 20
    );
    println!("  {reps} run(s) per hypervisor, interleaved, after one discarded warm-up run each");
    let (configs, mut missing) = vmms(h, args, &listed, &exe, &elf)?;
    let standing = warm_up(&configs, &mut missing, |c| one_run(c, &ns, WARM_UP))?;
    let (runs, standing) =
        measure_contenders(h, configs, standing, reps, |c| one_run(c, &ns, load))?;
    let csv_path = Outputs::new(h).csv("net.csv", &csv(&runs, &missing))?;
    let sums: Vec<Sums> = measured_per_config(&runs)
        .iter()
        .map(|s| Sums::of(s))
        .collect();
    let configs = &runs.configs;
    print_table(configs, &sums);
    print_dropped(configs, &standing, &missing);
    for (c, s) in configs.iter().zip(&sums).filter(|(_, s)| s.lost > 0) {
        println!("{}: {} UDP replies lost over its runs", c.name(), s.lost);
    }
    println!();
    print!("{}", verdicts(configs, &sums).table());
    println!(
        "(better peer: the higher rate and throughput, the lower p50, of firecracker and qemu;"
    );
    println!("  \"not measured\" when neither ran)");
    println!();
    println!(
        "This machine may run KVM nested: the guest's CPL0 code is emulated there, which slows"
    );
    println!("  each interrupt and SYS_NET_WAIT alike for every VMM.");
    let (title, panels) = chart(configs, &sums, &missing);
    let svg_path = Outputs::new(h).bars("net.svg", &title, &panels)?;
    println!();
    let flows = crate::net_flows::measure(&ns, &exe, &elf, load.tcp_bytes, reps)?;
    print!("{}", crate::net_flows::report(&flows, load.tcp_bytes));
    let flows_path = Outputs::new(h).csv("net-flows.csv", &crate::net_flows::csv(&flows))?;
    println!();
    println!(
        "wrote {}, {} and {}",
        csv_path.display(),
        svg_path.display(),
        flows_path.display()
    );
    Ok(())
}

/// Musubi's two exit paths and the peers asked for that can run, and the peers that
/// cannot with why.
fn vmms(
    h: &Harness,
    args: &BenchArgs,
    listed: &[&str],
    exe: &Path,
    elf: &Path,
) -> Result<(Vec<Vmm>, Missing), String> {
    let mut configs = vec![Vmm::NoVm];
    configs.extend(musubi_paths(exe, elf));
    configs.push(Vmm::Musubi {
        exe: exe.to_path_buf(),
        elf: elf.to_path_buf(),
        exits: "kernel",
        io_poll: Some(NO_POLL),
    });
    let mut missing = Missing::new();
    if let Some(micro) = peers::firecracker_peer(args, listed, elf, &h.out, &mut missing) {
        configs.push(Vmm::Firecracker { micro });
    }
    // The probe guest finds virtio-mmio devices on its command line, which QEMU writes
    // only without ACPI.
    match qemu::peer(args, &["microvm,acpi=off"])? {
        Peer::Skipped(why) => println!("QEMU: skipped, {why}"),
        Peer::Ready(q) => configs.push(Vmm::Qemu(q)),
        Peer::Unavailable(why) => missing.push(("qemu".into(), why)),
    }
    if listed.contains(&"cloud-hypervisor") {
        println!("cloud-hypervisor: not compared here (it has no virtio-mmio, which the probe guest's network driver needs)");
    }
    Ok((configs, missing))
}

/// Musubi's counts of one load (`udp_vmm`, `tcp_vmm`), and one figure of them.
type LoadCounts = fn(&Sample) -> Option<VmmCounts>;
type Count = fn(&VmmCounts) -> f64;

/// `net.csv`'s columns of the I/O thread's waiting, each per packet: its CPU and the time
/// it polled in us, and its wake-ups.
const IO_COLUMNS: [(&str, LoadCounts, Count); 6] = [
    (
        "udp_io_cpu_us_per_packet",
        |s| s.udp_vmm,
        |v| v.io_cpu_ns / 1e3,
    ),
    (
        "udp_io_poll_us_per_packet",
        |s| s.udp_vmm,
        |v| v.io_poll_ns / 1e3,
    ),
    ("udp_io_wakeups_per_packet", |s| s.udp_vmm, |v| v.io_wakeups),
    (
        "tcp_io_cpu_us_per_packet",
        |s| s.tcp_vmm,
        |v| v.io_cpu_ns / 1e3,
    ),
    (
        "tcp_io_poll_us_per_packet",
        |s| s.tcp_vmm,
        |v| v.io_poll_ns / 1e3,
    ),
    ("tcp_io_wakeups_per_packet", |s| s.tcp_vmm, |v| v.io_wakeups),
];

/// `net.csv`: a row per run made, and one per peer that never ran.
fn csv(runs: &NetRuns, missing: &Missing) -> Csv {
    let f3 = |x: Option<f64>| cell(x.map(|v| format!("{v:.3}")));
    let per_packet = |g: fn(&Sample) -> GuestCounts, count: fn(&GuestCounts) -> f64| {
        move |s: &Sample| f3(ratio(count(&g(s)), g(s).packets))
    };
    let vmm = |g: fn(&Sample) -> Option<VmmCounts>, count: fn(&VmmCounts) -> f64| {
        move |s: &Sample| f3(g(s).and_then(|v| ratio(count(&v), v.packets)))
    };
    let mut cols = Columns::new()
        .run_heads()
        .measured("udp_rounds", |s: &Sample| s.rounds.to_string())
        .measured("udp_lost", |s| s.lost.to_string())
        .measured("udp_rate_per_s", |s| format!("{:.0}", s.rate_per_s))
        .measured("udp_p50_us", |s| format!("{:.0}", s.p50_us))
        .measured("udp_p99_us", |s| format!("{:.0}", s.p99_us))
        .measured(
            "udp_kicks_per_packet",
            per_packet(|s| s.udp_guest, |g| g.kicks),
        )
        .measured(
            "udp_interrupts_per_packet",
            per_packet(|s| s.udp_guest, |g| g.interrupts),
        )
        .measured("udp_exits_per_packet", vmm(|s| s.udp_vmm, |v| v.exits))
        .measured(
            "udp_doorbell_exits_per_packet",
            vmm(|s| s.udp_vmm, |v| v.doorbell_exits),
        )
        .measured("tcp_bytes", |s| s.tcp_bytes.to_string())
        .measured("tcp_sink_bytes", |s| s.sink_bytes.to_string())
        .measured("tcp_mbit_per_s", |s| format!("{:.1}", s.mbit_per_s))
        .measured(
            "tcp_kicks_per_packet",
            per_packet(|s| s.tcp_guest, |g| g.kicks),
        )
        .measured(
            "tcp_interrupts_per_packet",
            per_packet(|s| s.tcp_guest, |g| g.interrupts),
        )
        .measured("tcp_exits_per_packet", vmm(|s| s.tcp_vmm, |v| v.exits))
        .measured(
            "tcp_doorbell_exits_per_packet",
            vmm(|s| s.tcp_vmm, |v| v.doorbell_exits),
        )
        .measured("tcp_vcpu_busy", move |s| f3(s.tcp_busy.map(|b| b.vcpu)))
        .measured("tcp_other_busy", move |s| f3(s.tcp_busy.map(|b| b.other)))
        .measured("tcp_guest_waiting", move |s| f3(s.tcp_guest.waiting));
    for (name, load, count) in IO_COLUMNS {
        cols = cols.measured(name, vmm(load, count));
    }
    cols.unavailable().csv(contender_rows(runs, missing))
}

/// Prints every VMM's medians and what they measure.
fn print_table(configs: &[Vmm], sums: &[Sums]) {
    let med = |s: Option<Summary>, digits: usize| {
        s.map(|s| format!("{:.*}", digits, s.median))
            .unwrap_or_else(|| "n/a".into())
    };
    let mut t = Table::new(&[
        "hypervisor",
        ">UDP rounds/s",
        ">p50 us",
        ">p99 us",
        ">TCP Mbit/s",
        ">of no-vm (udp rate / tcp)",
        ">kicks/pkt (udp / tcp)",
        ">irqs/pkt (udp / tcp)",
        ">exits/pkt (udp / tcp)",
        ">doorbell exits/pkt (udp / tcp)",
        ">I/O thread CPU us/pkt (udp / tcp)",
        ">of it polling (udp / tcp)",
        ">I/O wake-ups/pkt (udp / tcp)",
        ">CPUs busy in tcp (vCPU / other)",
        ">guest waiting in tcp",
    ]);
    let ceiling = ceiling(configs, sums);
    for (c, s) in configs.iter().zip(sums) {
        if s.n == 0 {
            t.row([c.name(), "unavailable (below)".into()]);
            continue;
        }
        let pair =
            |a: Option<Summary>, b: Option<Summary>| format!("{} / {}", med(a, 2), med(b, 2));
        let of = |g: fn(&Sums) -> Option<Summary>| {
            let f = ceiling.and_then(|k| ratio(g(s)?.median, g(k)?.median));
            f.map_or_else(|| "n/a".into(), |f| format!("{f:.2}"))
        };
        t.row([
            c.name(),
            med(s.rate, 0),
            med(s.p50, 0),
            med(s.p99, 0),
            med(s.mbit, 1),
            format!("{} / {}", of(|s| s.rate), of(|s| s.mbit)),
            pair(s.udp_kicks, s.tcp_kicks),
            pair(s.udp_irqs, s.tcp_irqs),
            pair(s.udp_exits, s.tcp_exits),
            pair(s.udp_doorbells, s.tcp_doorbells),
            pair(s.udp_io_cpu, s.tcp_io_cpu),
            pair(s.udp_io_poll, s.tcp_io_poll),
            pair(s.udp_io_wakeups, s.tcp_io_wakeups),
            pair(s.tcp_vcpu_busy, s.tcp_other_busy),
            med(s.tcp_guest_waiting, 2),
        ]);
    }
    println!();
    print!("{}", t.render());
    print!("{}", TABLE_NOTES);
}

/// The no-VM row's sums, if it ran.
fn ceiling<'s>(configs: &[Vmm], sums: &'s [Sums]) -> Option<&'s Sums> {
    configs
        .iter()
        .zip(sums)
        .find(|(c, s)| matches!(c, Vmm::NoVm) && s.n > 0)
        .map(|(_, s)| s)
}

/// What the table's columns measure.
const TABLE_NOTES: &str = "\
medians over the runs. rounds/s, p50 and p99: the guest's udp-echo (answered rounds per
  second, round-trip percentiles); Mbit/s: the guest's tcp-send, its bytes checked against
  the host's sink. no-vm: the same loads, echo and sink with no VM, from a client thread on
  a veth into the bench's namespace (the host's own stack both ends, offloads as the host
  sets them: GSO/TSO on a veth; for TCP no ceiling: its one client thread also runs the
  receiver's stack, which a VM's stream leaves to the VMM's I/O thread); \"of no-vm\":
  each row's median rate and throughput over no-vm's. kicks and irqs per packet: the
  guest driver's doorbell writes and interrupts over its packets (every VMM); exits and
  doorbell exits (QueueNotify MMIO exits) per packet: Musubi's --metrics over the whole
  boot, boot included (n/a for the peers); it counts the exits that reach Musubi's user
  space, so a kick on the kernel path (an ioeventfd, served inside KVM) is a kick but not
  an exit here. Musubi's rows run with the default `--io-poll 32us` (the I/O thread polls
  up to 32 us, adapting, after each event before it sleeps); musubi-kernel-nopoll has
  `--io-poll 0`, it never polls. I/O thread CPU: its CPU time per packet (user and
  system, the TAP writes' host stack included); of it polling: the share of that time its
  poll windows took (CPU that bought the saved wake-ups); I/O wake-ups: its sleeps in
  epoll_wait that an event ended, per packet. Musubi only. CPUs busy in tcp: the CPU
  time of the VMM's vCPU threads and of its other threads (any VMM, read from /proc) from
  the stream's connection to its last byte, over that time. guest waiting: the share of
  the stream the guest's driver spent polling its rings or halted for the device (the
  guest's own clock); the driver polls before it halts, so a vCPU thread busy throughout
  whose guest waited most of the time was bound by the host side, not by its guest.
";

/// Musubi's kernel path against the better peer, and its doorbell exits.
fn verdicts(configs: &[Vmm], sums: &[Sums]) -> Verdicts {
    let find = |name: &str| {
        configs
            .iter()
            .zip(sums)
            .find(|(c, s)| c.name() == name && s.n > 0)
            .map(|(_, s)| s)
    };
    let kernel = find("musubi-kernel");
    let peer_sums: Vec<&Sums> = ["firecracker", "qemu"]
        .iter()
        .filter_map(|n| find(n))
        .collect();
    let better = |g: fn(&Sums) -> Option<Summary>, pick: fn(f64, f64) -> f64| {
        peer_sums
            .iter()
            .filter_map(|s| g(s).map(|x| x.median))
            .reduce(pick)
    };
    let vs = |g: fn(&Sums) -> Option<Summary>, pick: fn(f64, f64) -> f64| {
        kernel
            .and_then(g)
            .zip(better(g, pick))
            .and_then(|(m, p)| ratio(m.median, p))
    };
    let mut v = Verdicts::new();
    let mut fig = |what: &str, r: Option<f64>, reference: String, met: &dyn Fn(f64) -> bool| {
        v.push(Figure {
            what: what.into(),
            ours: shown_ratio(r),
            reference,
            source: GOAL_SOURCE.into(),
            met: r.map(met),
        })
    };
    fig(
        "UDP rounds/s, musubi-kernel / better peer",
        vs(|s| s.rate, f64::max),
        format!(">= {GOAL_RATE:.2}x"),
        &|x| x >= GOAL_RATE,
    );
    fig(
        "TCP Mbit/s, musubi-kernel / better peer",
        vs(|s| s.mbit, f64::max),
        format!(">= {GOAL_STREAM:.2}x"),
        &|x| x >= GOAL_STREAM,
    );
    let user = find("musubi-user");
    fig(
        "TCP Mbit/s, musubi-kernel / musubi-user",
        kernel
            .and_then(|k| k.mbit)
            .zip(user.and_then(|u| u.mbit))
            .and_then(|(k, u)| ratio(k.median, u.median)),
        ">= 1.00x".into(),
        &|x| x >= 1.0,
    );
    fig(
        "UDP p50 latency, musubi-kernel / better peer",
        vs(|s| s.p50, f64::min),
        format!("<= {GOAL_P50:.2}x"),
        &|x| x <= GOAL_P50,
    );
    let no_vm = ceiling(configs, sums);
    let of_ceiling = kernel
        .zip(no_vm)
        .and_then(|(k, c)| ratio(k.rate?.median, c.rate?.median));
    fig(
        "UDP rounds/s, musubi-kernel / no-vm",
        of_ceiling,
        format!(">= {AIM_CEILING_RATE:.2}x (aim)"),
        &|x| x >= AIM_CEILING_RATE,
    );
    // The host's own stack without a VM beside the better peer. For TCP it is no ceiling:
    // the no-VM client's one thread runs the sender's stack and, through the veth, the
    // receiver's too, where a VM's stream spreads that work over its vCPU and the VMM's
    // I/O thread.
    let no_vm_tcp = no_vm
        .and_then(|c| c.mbit)
        .zip(better(|s| s.mbit, f64::max))
        .and_then(|(c, p)| ratio(c.median, p));
    v.compared("TCP Mbit/s, no-vm / better peer", shown_ratio(no_vm_tcp));
    let doorbells = kernel.and_then(|k| max(&[k.max_udp_doorbells?, k.max_tcp_doorbells?]));
    v.push(Figure {
        what: "doorbell exits per packet, musubi-kernel (max of runs)".into(),
        ours: doorbells
            .map(|d| format!("{d:.3}"))
            .unwrap_or_else(|| "not measured".into()),
        reference: "0".into(),
        source: GOAL_SOURCE.into(),
        met: doorbells.map(|d| d == 0.0),
    });
    v
}

/// A ratio as the verdicts print it.
fn shown_ratio(r: Option<f64>) -> String {
    r.map(|x| format!("{x:.2}x"))
        .unwrap_or_else(|| "not measured".into())
}

/// The chart's title and panels: each bar a VMM's median, its minimum marked. A peer
/// without bars says so in the title, so the chart is not read as Musubi alone by choice.
fn chart(configs: &[Vmm], sums: &[Sums], missing: &Missing) -> (String, Vec<plot::Panel>) {
    let panel = |title: &str, unit: &str, g: fn(&Sums) -> Option<Summary>| plot::Panel {
        title: title.into(),
        unit: unit.into(),
        bars: summary_bars(configs.iter().zip(sums.iter().map(g)), Vmm::name),
    };
    let panels = vec![
        panel("UDP request/response rate (median, min)", "rounds/s", |s| {
            s.rate
        }),
        panel("UDP round trip p50 (median, min)", "us", |s| s.p50),
        panel("UDP round trip p99 (median, min)", "us", |s| s.p99),
        panel("TCP stream throughput (median, min)", "Mbit/s", |s| s.mbit),
    ];
    let title = chart_title(
        "net",
        configs.iter().zip(sums.iter().map(|s| s.n > 0)),
        missing,
    );
    (title, panels)
}

struct Sums {
    n: usize,
    lost: u64,
    rate: Option<Summary>,
    p50: Option<Summary>,
    p99: Option<Summary>,
    mbit: Option<Summary>,
    udp_kicks: Option<Summary>,
    tcp_kicks: Option<Summary>,
    udp_irqs: Option<Summary>,
    tcp_irqs: Option<Summary>,
    udp_exits: Option<Summary>,
    tcp_exits: Option<Summary>,
    udp_doorbells: Option<Summary>,
    tcp_doorbells: Option<Summary>,
    udp_io_cpu: Option<Summary>,
    tcp_io_cpu: Option<Summary>,
    udp_io_poll: Option<Summary>,
    tcp_io_poll: Option<Summary>,
    udp_io_wakeups: Option<Summary>,
    tcp_io_wakeups: Option<Summary>,
    tcp_vcpu_busy: Option<Summary>,
    tcp_other_busy: Option<Summary>,
    tcp_guest_waiting: Option<Summary>,
    max_udp_doorbells: Option<f64>,
    max_tcp_doorbells: Option<f64>,
}

impl Sums {
    fn of(s: &[&Sample]) -> Sums {
        let f = |g: &dyn Fn(&Sample) -> Option<f64>| {
            s.iter().filter_map(|x| g(x)).collect::<Vec<f64>>()
        };
        let sum = |g: &dyn Fn(&Sample) -> Option<f64>| Summary::of(&f(g));
        let udp_doorbells = f(&|x| x.udp_vmm.and_then(|v| ratio(v.doorbell_exits, v.packets)));
        let tcp_doorbells = f(&|x| x.tcp_vmm.and_then(|v| ratio(v.doorbell_exits, v.packets)));
        Sums {
            n: s.len(),
            lost: s.iter().map(|x| x.lost).sum(),
            rate: sum(&|x| Some(x.rate_per_s)),
            p50: sum(&|x| Some(x.p50_us)),
            p99: sum(&|x| Some(x.p99_us)),
            mbit: sum(&|x| Some(x.mbit_per_s)),
            udp_kicks: sum(&|x| ratio(x.udp_guest.kicks, x.udp_guest.packets)),
            tcp_kicks: sum(&|x| ratio(x.tcp_guest.kicks, x.tcp_guest.packets)),
            udp_irqs: sum(&|x| ratio(x.udp_guest.interrupts, x.udp_guest.packets)),
            tcp_irqs: sum(&|x| ratio(x.tcp_guest.interrupts, x.tcp_guest.packets)),
            udp_exits: sum(&|x| x.udp_vmm.and_then(|v| ratio(v.exits, v.packets))),
            tcp_exits: sum(&|x| x.tcp_vmm.and_then(|v| ratio(v.exits, v.packets))),
            udp_doorbells: Summary::of(&udp_doorbells),
            tcp_doorbells: Summary::of(&tcp_doorbells),
            udp_io_cpu: sum(&|x| x.udp_vmm.and_then(|v| ratio(v.io_cpu_ns / 1e3, v.packets))),
            tcp_io_cpu: sum(&|x| x.tcp_vmm.and_then(|v| ratio(v.io_cpu_ns / 1e3, v.packets))),
            udp_io_poll: sum(&|x| x.udp_vmm.and_then(|v| ratio(v.io_poll_ns, v.io_cpu_ns))),
            tcp_io_poll: sum(&|x| x.tcp_vmm.and_then(|v| ratio(v.io_poll_ns, v.io_cpu_ns))),
            udp_io_wakeups: sum(&|x| x.udp_vmm.and_then(|v| ratio(v.io_wakeups, v.packets))),
            tcp_io_wakeups: sum(&|x| x.tcp_vmm.and_then(|v| ratio(v.io_wakeups, v.packets))),
            tcp_vcpu_busy: sum(&|x| x.tcp_busy.map(|b| b.vcpu)),
            tcp_other_busy: sum(&|x| x.tcp_busy.map(|b| b.other)),
            tcp_guest_waiting: sum(&|x| x.tcp_guest.waiting),
            max_udp_doorbells: max(&udp_doorbells),
            max_tcp_doorbells: max(&tcp_doorbells),
        }
    }
}

/// Musubi on its kernel exit path, then on its user one.
fn musubi_paths(exe: &Path, elf: &Path) -> Vec<Vmm> {
    ["kernel", "user"]
        .into_iter()
        .map(|exits| Vmm::Musubi {
            exe: exe.to_path_buf(),
            elf: elf.to_path_buf(),
            exits,
            io_poll: None,
        })
        .collect()
}

/// The row `musubi-kernel-nopoll`: the kernel path with its I/O thread never polling.
const NO_POLL: &str = "0";

/// What `bench composite`'s network row takes from one run of Musubi on one exit path:
/// paper 002's question asked of a network device.
pub(crate) struct PathRun {
    pub exits: &'static str,
    pub rounds: u64,
    pub rate_per_s: f64,
    pub p50_us: f64,
    /// Musubi's own counts over the UDP boot.
    pub exits_total: f64,
    pub doorbell_exits: f64,
    pub packets: f64,
}

/// Request/response over a TAP on Musubi's kernel and user exit paths, interleaved, for
/// `bench composite`: each run's figures, in the order run.
pub(crate) fn exit_paths(h: &Harness) -> Result<Vec<PathRun>, String> {
    let ns = Netns::new()?;
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    let (load, reps) = if h.quick {
        (QUICK, 1)
    } else {
        (
            Load {
                udp_rounds: 20_000,
                tcp_bytes: 1 << 20,
            },
            3,
        )
    };
    let configs = musubi_paths(&exe, &elf);
    for c in &configs {
        one_run(c, &ns, WARM_UP).map_err(|e| format!("{} warm-up run: {e}", c.name()))?;
    }
    let runs = h.run_schedule(&configs, reps, Vmm::name, |_, c| one_run(c, &ns, load))?;
    runs.into_iter()
        .map(|(_, ci, s)| {
            let Vmm::Musubi { exits, .. } = configs[ci] else {
                unreachable!("only Musubi runs here")
            };
            let v = s
                .udp_vmm
                .ok_or_else(|| format!("musubi-{exits}: no --metrics counts"))?;
            Ok(PathRun {
                exits,
                rounds: s.rounds,
                rate_per_s: s.rate_per_s,
                p50_us: s.p50_us,
                exits_total: v.exits,
                doorbell_exits: v.doorbell_exits,
                packets: v.packets,
            })
        })
        .collect()
}

/// One run: a boot for the UDP rounds, then one for the TCP stream.
fn one_run(c: &Vmm, ns: &Netns, load: Load) -> Result<Sample, String> {
    if let Vmm::NoVm = c {
        return no_vm_run(ns, load);
    }
    let n = load.udp_rounds;
    let echo = ns.spawn(move |stop, ready| udp_echo(stop, ready, n))?;
    let (udp, udp_vmm) = boot(
        c,
        ns,
        &format!("udp-echo={HOST}:{UDP_PORT},n={n}"),
        "udp-echo",
    );
    let answered = echo.finish()?;
    let udp = udp?;
    let num = |r: &Value, k: &str| r[k].as_f64().ok_or_else(|| format!("no {k} in {r}"));
    let rounds = num(&udp, "rounds")? as u64;
    if rounds != n {
        return Err(format!("udp-echo ran {rounds} rounds, not {n}: {udp}"));
    }
    let lost = num(&udp, "lost")? as u64;
    if answered < n - lost {
        return Err(format!(
            "the guest counts {} answered rounds, the echo answered {answered}",
            n - lost
        ));
    }

    let bytes = load.tcp_bytes;
    let sink = ns.spawn(move |stop, ready| tcp_sink(stop, ready, bytes))?;
    let (tcp, tcp_vmm) = boot(
        c,
        ns,
        &format!("tcp-send={HOST}:{TCP_PORT},bytes={bytes}"),
        "tcp-send",
    );
    let counted = sink.finish();
    let tcp = tcp?;
    let (counted, tcp_busy) = counted?;
    let sent = num(&tcp, "bytes")? as u64;
    if sent != bytes || counted != bytes {
        return Err(format!(
            "tcp-send: asked for {bytes} bytes, the guest says it sent {sent}, the sink counted {counted}"
        ));
    }
    Ok(Sample {
        rounds,
        lost,
        rate_per_s: num(&udp, "rate_per_s")?,
        p50_us: num(&udp, "p50_us")?,
        p99_us: num(&udp, "p99_us")?,
        udp_guest: GuestCounts::of(&udp)?,
        udp_vmm: udp_vmm?,
        tcp_bytes: sent,
        sink_bytes: counted,
        mbit_per_s: num(&tcp, "mbit_per_s")?,
        tcp_guest: GuestCounts::of(&tcp)?,
        tcp_vmm: tcp_vmm?,
        tcp_busy: Some(tcp_busy),
    })
}

/// One run of the ceiling: the same loads, echo and sink, from a client on a veth.
fn no_vm_run(ns: &Netns, load: Load) -> Result<Sample, String> {
    let n = load.udp_rounds;
    let echo = ns.spawn(move |stop, ready| udp_echo(stop, ready, n))?;
    let udp = crate::net_ceiling::udp(&ns.name, UDP_PORT, n);
    let answered = echo.finish()?;
    let udp = udp?;
    if answered < n - udp.lost {
        return Err(format!(
            "the client counts {} answered rounds, the echo answered {answered}",
            n - udp.lost
        ));
    }
    let bytes = load.tcp_bytes;
    let sink = ns.spawn(move |stop, ready| tcp_sink(stop, ready, bytes))?;
    let mbit = crate::net_ceiling::tcp(&ns.name, TCP_PORT, bytes);
    let counted = sink.finish();
    let mbit = mbit?;
    // The client is a thread of this program, which the sink does not count.
    let (counted, _) = counted?;
    if counted != bytes {
        return Err(format!(
            "the no-VM client sent {bytes} bytes, the sink counted {counted}"
        ));
    }
    // No guest: its driver's counts are none (n/a per packet).
    let none = GuestCounts {
        packets: 0.0,
        kicks: 0.0,
        interrupts: 0.0,
        waiting: None,
    };
    Ok(Sample {
        rounds: udp.rounds,
        lost: udp.lost,
        rate_per_s: udp.rate_per_s,
        p50_us: udp.p50_us,
        p99_us: udp.p99_us,
        udp_guest: none,
        udp_vmm: None,
        tcp_bytes: bytes,
        sink_bytes: counted,
        mbit_per_s: mbit,
        tcp_guest: none,
        tcp_vmm: None,
        tcp_busy: None,
    })
}

type Boot = (Result<Value, String>, Result<Option<VmmCounts>, String>);

/// Boots the guest with one network task in the namespace and returns its result line and,
/// for Musubi, its counters.
fn boot(c: &Vmm, ns: &Netns, task: &str, name: &str) -> Boot {
    let fail = |e: String| (Err(e), Ok(None));
    let tmp = match tempfile::tempdir() {
        Ok(t) => t,
        Err(e) => return fail(format!("cannot make a temporary directory: {e}")),
    };
    let cmdline = format!("probe.ip={GUEST} probe.tasks={task}");
    let cmd = match c.command(&cmdline, tmp.path()) {
        Ok(cmd) => ns.command(&cmd),
        Err(e) => return fail(e),
    };
    // Firecracker has no exit port: it is stopped once the result line is out.
    let ending = match c {
        Vmm::Musubi { .. } => Ending::Status(0),
        Vmm::Qemu(_) => Ending::Status(qemu::CLEAN_STATUS),
        Vmm::Firecracker { .. } | Vmm::NoVm => Ending::AtResult,
    };
    let result = crate::probe::task_result(&c.name(), cmd, name, ending, RUN_TIMEOUT, LINES);
    let counts = match c {
        Vmm::Musubi { .. } if result.is_ok() => {
            vmm_counts(&tmp.path().join("metrics.json")).map(Some)
        }
        _ => Ok(None),
    };
    (result, counts)
}

fn vmm_counts(path: &Path) -> Result<VmmCounts, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("musubi's --metrics {}: {e}", path.display()))?;
    let m: Metrics = serde_json::from_str(&text)
        .map_err(|e| format!("musubi's --metrics {}: {e}", path.display()))?;
    let net = m
        .net
        .first()
        .ok_or_else(|| format!("--metrics lacks a count: {m}"))?;
    let io = m
        .io_thread
        .ok_or_else(|| format!("--metrics lacks the I/O thread's counts: {m}"))?;
    Ok(VmmCounts {
        exits: m.total_exits as f64,
        doorbell_exits: m.notifications.mmio_exit as f64,
        packets: (net.rx_packets + net.tx_packets) as f64,
        io_cpu_ns: io.cpu_ns as f64,
        io_poll_ns: io.poll_ns as f64,
        io_wakeups: io.wakeups as f64,
    })
}

/// Answers every datagram until told to stop, at most `rounds` and a few more (the
/// guest's untimed first exchange may be tried three times), and for at most a run's time.
fn udp_echo(stop: &AtomicBool, ready: &dyn Fn(), rounds: u64) -> Result<u64, String> {
    let s = UdpSocket::bind(("0.0.0.0", UDP_PORT))
        .map_err(|e| format!("the UDP echo cannot bind port {UDP_PORT}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_millis(20)))
        .map_err(|e| format!("the UDP echo: {e}"))?;
    ready();
    let (t0, mut answered, mut buf) = (Instant::now(), 0u64, [0u8; 2048]);
    while !stop.load(Ordering::Relaxed) && t0.elapsed() < RUN_TIMEOUT && answered < rounds + 8 {
        if let Ok((n, from)) = s.recv_from(&mut buf) {
            // A reply that cannot go is the guest's loss, which it counts.
            if s.send_to(&buf[..n], from).is_ok() {
                answered += 1;
            }
        }
    }
    Ok(answered)
}

/// Takes one connection and reads it to its end, checking the stream's pattern (byte i is
/// i mod 251); for at most a run's time, and not beyond `bytes`.
fn tcp_sink(stop: &AtomicBool, ready: &dyn Fn(), bytes: u64) -> Result<(u64, Busy), String> {
    let (counted, busy) = tcp_sinks(stop, ready, bytes, 1)?;
    Ok((counted[0], busy))
}

/// The TCP sink for `conns` streams at once (`tcp-send procs=P`): takes them all, then reads
/// and checks each on a thread of its own; each stream's byte count, in the order they
/// connected, and how busy the VMM kept the CPUs from the last connection to the last byte.
pub(crate) fn tcp_sinks(
    stop: &AtomicBool,
    ready: &dyn Fn(),
    bytes: u64,
    conns: usize,
) -> Result<(Vec<u64>, Busy), String> {
    let l = TcpListener::bind(("0.0.0.0", TCP_PORT))
        .map_err(|e| format!("the TCP sink cannot bind port {TCP_PORT}: {e}"))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("the TCP sink: {e}"))?;
    ready();
    let t0 = Instant::now();
    let going = || !stop.load(Ordering::Relaxed) && t0.elapsed() < RUN_TIMEOUT;
    let mut streams = Vec::new();
    while streams.len() < conns {
        match l.accept() {
            Ok((s, _)) => streams.push(s),
            Err(_) if going() => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                return Err(format!(
                    "{} of {conns} guest streams connected to the TCP sink: {e}",
                    streams.len()
                ))
            }
        }
    }
    let mark = Mark::now();
    let counted = std::thread::scope(|scope| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|s| scope.spawn(|| drain_checked(s, bytes, &going)))
            .collect();
        readers
            .into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|_| Err("a TCP sink reader panicked".into()))
            })
            .collect::<Result<Vec<u64>, String>>()
    })?;
    Ok((counted, mark.since()))
}

/// Whether `a` and `b` hold the same bytes. Slice equality calls the C library's
/// `memcmp`, which the static (musl) build does a byte at a time, 4.5 GB/s here: the sink's
/// check, not the VMM, then bounded a stream at about 18 Gbit/s. Eight bytes at a time
/// compares 35 GB/s.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (wa, wb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_match = wa.remainder() == wb.remainder();
    let word = |w: &[u8]| u64::from_ne_bytes(w.try_into().expect("chunks of 8"));
    tails_match && wa.zip(wb).all(|(x, y)| word(x) == word(y))
}

/// Reads one guest stream to its end, checking every byte; its length.
fn drain_checked(
    mut s: std::net::TcpStream,
    bytes: u64,
    going: &dyn Fn() -> bool,
) -> Result<u64, String> {
    s.set_nonblocking(false)
        .and_then(|()| s.set_read_timeout(Some(Duration::from_millis(100))))
        .map_err(|e| format!("the TCP sink: {e}"))?;
    const BUF: usize = 1 << 16;
    // The stream as it must be from any offset: one compare per read against it, so the
    // check takes little of a core the VMM competes for.
    let pattern: Vec<u8> = (0..BUF + 251).map(|i| (i % 251) as u8).collect();
    let (mut total, mut buf) = (0u64, vec![0u8; BUF]);
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => {
                let at = (total % 251) as usize;
                if !same_bytes(&buf[..n], &pattern[at..at + n]) {
                    let i = (0..n).find(|&i| buf[i] != pattern[at + i]).unwrap_or(0);
                    return Err(format!(
                        "the TCP stream is corrupt at byte {}",
                        total + i as u64
                    ));
                }
                total += n as u64;
                if total > bytes {
                    return Err(format!("the TCP stream ran past {bytes} bytes"));
                }
            }
            Err(_) if going() => {}
            Err(e) => {
                return Err(format!(
                    "the TCP stream stopped after {total} bytes without a close: {e}"
                ))
            }
        }
    }
}

/// A network namespace of the benchmark's own, with the TAP every VMM opens. Dropping it
/// deletes both; nothing of it is in the host's namespace.
pub(crate) struct Netns {
    pub(crate) name: String,
}

impl Netns {
    /// `musubi-bench-<pid>`, loopback up, `tap0` persistent with 10.0.0.1/24 and up.
    fn new() -> Result<Netns, String> {
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            return Err(format!(
                "this benchmark makes a network namespace and a TAP device in it, which needs \
                 root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as euid {euid}"
            ));
        }
        ip(&["-V"])?;
        let name = format!("musubi-bench-{}", std::process::id());
        ip(&["netns", "add", &name])?;
        // Owned from here: a failure below still deletes it, and so does a signal.
        let ns = Netns { name };
        delete_on_signal(&format!("/run/netns/{}", ns.name));
        let n = ns.name.as_str();
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "tuntap", "add", TAP, "mode", "tap"])?;
        ip(&["-n", n, "addr", "add", &format!("{HOST}/24"), "dev", TAP])?;
        ip(&["-n", n, "link", "set", TAP, "up"])?;
        Ok(ns)
    }

    /// `cmd` run inside the namespace (`ip netns exec` execs it, so the pid is the VMM's).
    pub(crate) fn command(&self, cmd: &Command) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name])
            .arg(cmd.get_program())
            .args(cmd.get_args());
        c
    }

    /// Runs `f` on a thread that entered the namespace (that thread alone), so its sockets
    /// are the namespace's; returns once `f` calls its second argument (it has bound them).
    pub(crate) fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&AtomicBool, &dyn Fn()) -> Result<T, String> + Send + 'static,
    ) -> Result<Server<T>, String> {
        let path = format!("/run/netns/{}", self.name);
        let file = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<()>();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            // SAFETY: setns(2) on a descriptor this thread holds open; it moves only the
            // calling thread into the namespace.
            let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if r != 0 {
                return Err(format!(
                    "setns into {path}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            f(&flag, &move || {
                let _ = tx.send(());
            })
        });
        if rx.recv().is_err() {
            // It ended before it was ready: its error says why.
            return Err(match thread.join() {
                Ok(Err(e)) => e,
                _ => "the host-side server thread ended before it was ready".into(),
            });
        }
        Ok(Server { stop, thread })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        MOUNT.store(std::ptr::null_mut(), Ordering::SeqCst);
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The namespace's file under /run/netns while it exists, for [`on_signal`].
static MOUNT: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());

/// Has SIGINT, SIGTERM and SIGHUP delete the namespace at `path` (Ctrl-C, `bench all`'s
/// time limit and a closed terminal end the program without running its destructors).
fn delete_on_signal(path: &str) {
    let Ok(c) = std::ffi::CString::new(path) else {
        return;
    };
    // Leaked: the handler may read it at any time until the program ends.
    MOUNT.store(c.into_raw(), Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `on_signal` makes only async-signal-safe calls.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Deletes the namespace as `ip netns delete` does (detaches its mount, removes the file),
/// then lets the signal end the program as it would have.
extern "C" fn on_signal(sig: libc::c_int) {
    let p = MOUNT.swap(std::ptr::null_mut(), Ordering::SeqCst);
    // SAFETY: `p` is null or the NUL-terminated path leaked by `delete_on_signal`;
    // umount2, unlink, signal and raise are async-signal-safe.
    unsafe {
        if !p.is_null() {
            libc::umount2(p, libc::MNT_DETACH);
            libc::unlink(p);
        }
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// A host-side server thread in the namespace.
pub(crate) struct Server<T> {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<T, String>>,
}

impl<T> Server<T> {
    /// Tells it to stop and takes its result.
    pub(crate) fn finish(self) -> Result<T, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .unwrap_or_else(|_| Err("the host-side server thread panicked".into()))
    }
}

/// Runs `ip ARGS`, or says what it printed when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    testkit::netns::try_ip(args)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::same_bytes;

    #[test]
    fn same_bytes_finds_a_difference_in_any_word_and_in_the_tail() {
        let a: Vec<u8> = (0..1003).map(|i| (i % 251) as u8).collect();
        assert!(same_bytes(&a, &a.clone()));
        for at in [0, 7, 8, 500, 999, 1000, 1002] {
            let mut b = a.clone();
            b[at] ^= 0x40;
            assert!(!same_bytes(&a, &b), "a difference at byte {at}");
        }
        assert!(!same_bytes(&a, &a[..1002]), "a shorter slice");
        assert!(same_bytes(&[], &[]));
    }
}
