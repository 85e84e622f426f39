//! `bench net`'s flows rows: one Musubi VM of two vCPUs with a virtio-net of two queue pairs
//! streams TCP on one flow, then on two at once (`tcp-send procs=2`: copy i on vCPU i and
//! pair i), both with one I/O thread, and on two at once again with an I/O thread per pair
//! (`--io-threads 2`), so the aggregate of two flows reads beside one flow of the same VM,
//! and a thread per pair beside one for both.
//!
//! The VM makes its own multiqueue TAP in the bench's namespace (`--net tap=NAME,ip=..,
//! num_queues=4`); it goes with the VM. The sink takes both streams and checks each byte.

use super::net::{tcp_sinks, Netns, TCP_PORT};
use super::ns_cpu::Busy;
use super::probe::{task_result, Ending};
use super::report::Csv;
use super::stats::{median, ratio};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The multiqueue TAP the VM makes, its host address and the guest's.
const TAP: &str = "tapmq0";
const HOST: &str = "10.0.2.1";
const GUEST: &str = "10.0.2.2/24";
/// Two queue pairs.
const NUM_QUEUES: u32 = 4;
const FLOWS: u32 = 2;
const TIMEOUT: Duration = Duration::from_secs(120);

/// One run's throughputs (Mbit/s, as the guest measured them) and each copy's pair.
#[derive(Clone, Debug)]
pub(crate) struct FlowsRun {
    pub(crate) one: f64,
    pub(crate) two: f64,
    /// How busy the VM's vCPU threads and its other threads kept the CPUs in each.
    pub(crate) one_busy: Busy,
    pub(crate) two_busy: Busy,
    /// Two flows with an I/O thread per pair: aggregate Mbit/s, and how busy.
    pub(crate) two_threads: f64,
    pub(crate) two_threads_busy: Busy,
    /// Per copy of the two-flow run: (pair, Mbit/s, frames sent).
    pub(crate) copies: Vec<(u64, f64, u64)>,
}

/// Runs one flow, then two, `reps` times each (interleaved), `bytes` per flow.
pub(crate) fn measure(
    ns: &Netns,
    exe: &Path,
    elf: &Path,
    bytes: u64,
    reps: usize,
) -> Result<Vec<FlowsRun>, String> {
    (0..reps)
        .map(|_| {
            let (one, one_busy) = boot(ns, exe, elf, bytes, 1, 1)?;
            let (two, two_busy) = boot(ns, exe, elf, bytes, FLOWS, 1)?;
            let (threads, two_threads_busy) = boot(ns, exe, elf, bytes, FLOWS, FLOWS)?;
            let mbit = |v: &Value| {
                v["mbit_per_s"]
                    .as_f64()
                    .ok_or_else(|| format!("tcp-send: no mbit_per_s in {v}"))
            };
            let copies = two["copies"]
                .as_array()
                .ok_or_else(|| format!("tcp-send procs={FLOWS}: no copies in {two}"))?
                .iter()
                .map(|c| {
                    Ok((
                        c["queue_pair"].as_u64().ok_or("copy without queue_pair")?,
                        mbit(c)?,
                        c["tx_packets"].as_u64().ok_or("copy without tx_packets")?,
                    ))
                })
                .collect::<Result<Vec<_>, String>>()?;
            let pairs: std::collections::BTreeSet<u64> = copies.iter().map(|c| c.0).collect();
            if pairs.len() != FLOWS as usize {
                return Err(format!(
                    "tcp-send procs={FLOWS} did not use {FLOWS} queue pairs: {two}"
                ));
            }
            Ok(FlowsRun {
                one: mbit(&one)?,
                two: mbit(&two)?,
                one_busy,
                two_busy,
                two_threads: mbit(&threads)?,
                two_threads_busy,
                copies,
            })
        })
        .collect()
}

/// Boots the VM with `io_threads` I/O threads and `tcp-send` of `procs` copies, `bytes`
/// each, against a sink taking `procs` streams; the task's result once every byte reached
/// the sink, and how busy the VM kept the CPUs meanwhile.
fn boot(
    ns: &Netns,
    exe: &Path,
    elf: &Path,
    bytes: u64,
    procs: u32,
    io_threads: u32,
) -> Result<(Value, Busy), String> {
    let sink = ns.spawn(move |stop, ready| tcp_sinks(stop, ready, bytes, procs as usize))?;
    let procs_opt = if procs > 1 {
        format!(",procs={procs}")
    } else {
        String::new()
    };
    let cmdline =
        format!("probe.ip={GUEST} probe.tasks=tcp-send={HOST}:{TCP_PORT},bytes={bytes}{procs_opt}");
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--kernel"])
        .arg(elf)
        .args(["--cmdline", &cmdline, "--memory", "128M", "--cpus", "2"])
        .args(["--exits", "kernel", "--io-threads", &io_threads.to_string()])
        .arg("--net")
        .arg(format!(
            "tap={TAP},ip={HOST},mask=255.255.255.0,num_queues={NUM_QUEUES}"
        ));
    let name = format!("musubi-kernel {procs} flow(s), {io_threads} I/O thread(s)");
    let result = task_result(
        &name,
        ns.command(&cmd),
        "tcp-send",
        Ending::Status(0),
        TIMEOUT,
        10,
    );
    let counted = sink.finish();
    let result = result?;
    let (counted, busy) = counted?;
    if counted.iter().any(|&c| c != bytes) {
        return Err(format!(
            "{name}: the sink counted {counted:?} bytes, each flow sent {bytes}"
        ));
    }
    Ok((result, busy))
}

/// The printed lines: medians of one flow and of two, and their ratio.
pub(crate) fn report(runs: &[FlowsRun], bytes: u64) -> String {
    let one: Vec<f64> = runs.iter().map(|r| r.one).collect();
    let two: Vec<f64> = runs.iter().map(|r| r.two).collect();
    let threads: Vec<f64> = runs.iter().map(|r| r.two_threads).collect();
    let (Some(one), Some(two), Some(threads)) = (median(&one), median(&two), median(&threads))
    else {
        return "flows: no run\n".into();
    };
    let per_pair = |pair: u64| {
        let xs: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.copies.iter().filter(move |c| c.0 == pair).map(|c| c.1))
            .collect();
        median(&xs).unwrap_or(f64::NAN)
    };
    let x = |a, b| ratio(a, b).map_or("n/a".into(), |r| format!("{r:.2}x"));
    let busy = |g: fn(&FlowsRun) -> Busy| {
        let of = |part: fn(&Busy) -> f64| {
            let xs: Vec<f64> = runs.iter().map(|r| part(&g(r))).collect();
            median(&xs).unwrap_or(f64::NAN)
        };
        format!(
            "CPUs busy: vCPU threads {:.2}, other threads {:.2}",
            of(|b| b.vcpu),
            of(|b| b.other)
        )
    };
    format!(
        "flows: musubi kernel path, 2 vCPUs, --net num_queues={NUM_QUEUES} (2 queue pairs), \
         tcp-send {} MiB per flow, {} run(s), medians:\n\
         \x20 one flow, one I/O thread              {one:>8.0} Mbit/s; {}\n\
         \x20 two flows at once, one I/O thread     {two:>8.0} Mbit/s aggregate (pair 0 {:.0}, pair 1 {:.0}): {} one flow; {}\n\
         \x20 two flows at once, a thread per pair  {threads:>8.0} Mbit/s aggregate: {} one flow, {} one thread; {}\n",
        bytes >> 20,
        runs.len(),
        busy(|r| r.one_busy),
        per_pair(0),
        per_pair(1),
        x(two, one),
        busy(|r| r.two_busy),
        x(threads, one),
        x(threads, two),
        busy(|r| r.two_threads_busy),
    )
}

/// `net-flows.csv`: a row per run.
pub(crate) fn csv(runs: &[FlowsRun]) -> Csv {
    let mut c = Csv::new(&[
        "run",
        "one_flow_mbit_per_s",
        "two_flows_mbit_per_s",
        "pair0_mbit_per_s",
        "pair1_mbit_per_s",
        "pair0_tx_packets",
        "pair1_tx_packets",
        "one_flow_vcpu_busy",
        "one_flow_other_busy",
        "two_flows_vcpu_busy",
        "two_flows_other_busy",
        "two_flows_two_threads_mbit_per_s",
        "two_flows_two_threads_vcpu_busy",
        "two_flows_two_threads_other_busy",
    ]);
    for (i, r) in runs.iter().enumerate() {
        let of = |pair: u64| r.copies.iter().find(|c| c.0 == pair);
        let (p0, p1) = (of(0), of(1));
        c.row([
            i.to_string(),
            format!("{:.1}", r.one),
            format!("{:.1}", r.two),
            p0.map_or(String::new(), |c| format!("{:.1}", c.1)),
            p1.map_or(String::new(), |c| format!("{:.1}", c.1)),
            p0.map_or(String::new(), |c| c.2.to_string()),
            p1.map_or(String::new(), |c| c.2.to_string()),
            format!("{:.3}", r.one_busy.vcpu),
            format!("{:.3}", r.one_busy.other),
            format!("{:.3}", r.two_busy.vcpu),
            format!("{:.3}", r.two_busy.other),
            format!("{:.1}", r.two_threads),
            format!("{:.3}", r.two_threads_busy.vcpu),
            format!("{:.3}", r.two_threads_busy.other),
        ]);
    }
    c
}
