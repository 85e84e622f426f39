//! `musubi bench ha`: a running probe guest replicated to a standby (`run --replicate-to`,
//! `run --standby-for`; on loopback, or over bridges between network namespaces for the
//! network rows): what the replication costs the VM, beside the same VM unreplicated in the
//! same run, and how fast the standby takes over from a killed primary, for the VMM and for
//! a client.
//!
//! Measured:
//!
//! - overhead: `fib` (CPU only, little memory written) and `mem-check` (rewrites its
//!   buffer over and over) at epochs of 5, 20 and 50 ms, each beside the same VM
//!   unreplicated. The guest waits for a line on its console (`console-echo`) before the
//!   task, and the bench types it once the standby acknowledges epochs, so no setting up of
//!   the replication is in the task's time. That time is the host's, from the guest's
//!   answer to the line to the task's result line, because the guest's own `ns` leaves out
//!   the checkpoint pauses (a resume sets the TSC back to what it read at the pause). The
//!   ratios are taken on the task's time less the vCPU thread's waits for a CPU (its
//!   schedstat): on a shared host a vCPU that never sleeps waits far longer for a CPU than
//!   one paused every epoch, which alone made replicated `fib` runs look up to 30% faster;
//! - per epoch, from the primary's `--metrics` `replication` block at its end: the vCPUs'
//!   pause (median, 99th percentile and longest), the bytes sent (median, longest) and the
//!   epochs sent during the task, which over its time give the epoch the link allowed; the
//!   `fib` VM at 256 MiB is the "little dirty" case of the pause goal;
//! - failover: the primary killed with SIGKILL at a random moment once the standby holds
//!   epochs after `hello`, to the standby's first `KVM_RUN` (the kernel's `sys_enter_ioctl`
//!   tracepoint, `CLOCK_MONOTONIC`; the kill's time is read on the same clock right before
//!   kill(2)), heartbeat 100 ms; the standby must then end the task with fib's exact value;
//! - failover as a client sees it: the primary's and the standby's TAPs in network
//!   namespaces of their own, joined over a bridge in a third where the client runs
//!   ([`ReplicaNet`], the set-up `musubi/tests/replication_net.rs` uses); the guest runs
//!   `udp-counter`, the client asks it every few ms (and asks again after a short silence),
//!   the primary is SIGKILLed at a random moment with a 100 ms heartbeat; from the kill to
//!   the client's first answer that the standby sent (the first after its first `KVM_RUN`),
//!   and the counter's values over every kill checked for repeats and gaps;
//! - `udp-echo` (rate, p50/p99 round trip, the probe's own figures) against an echo peer in
//!   the client's namespace, unreplicated and at each epoch, through the same overhead runs:
//!   the held output makes every round trip wait for its epoch's acknowledgement.
//!
//! The network rows need root (namespaces, TAPs); without it they are reported unavailable
//! with the reason, and the rest runs. The namespaces go when the run ends, also by a
//! signal.

use super::apivm::{one_line, wait_until, Vm};
use super::driver::{summary_bars, Columns, Outputs, Runs, Verdicts};
use super::kvm_trace::KvmRunTrace;
use super::report::{cell, median_min, ms, Figure, Table};
use super::stats::{ratio, Summary};
use super::{plot, BenchArgs, Harness};
use musubi_types::{Metrics, ReplicationMetrics};
use std::net::{Ipv4Addr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use testkit::replica_net::{ReplicaNet, CLIENT, GUEST, STANDBY_HOST, TAP};
use vmm::monotonic_ns;

const HELLO: &str = "{\"probe\":\"hello\"";
const MEMORY_MIB: u64 = 256;
const EPOCHS_MS: [u64; 3] = [5, 20, 50];
/// The failover runs' epoch and heartbeat (Musubi's defaults).
const FAILOVER_EPOCH_MS: u64 = 20;
const HEARTBEAT_MS: u64 = 100;
/// The overhead runs' heartbeat: long enough that a stall of the primary on this loaded
/// host is not taken for its death (a standby that takes over from a live primary ends the
/// replication the run measures); it does not change what an epoch does.
const OVERHEAD_HEARTBEAT_MS: u64 = 1000;
/// Epochs acknowledged before a kill, at least: the standby holds more than the first.
const EPOCHS_BEFORE_KILL: u64 = 3;

/// Bounds on every wait: a boot to hello, a listening standby, a whole task.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// The VMMs' own limit, above ours, so a run we abandon does not outlive us by much.
const VM_TIMEOUT_S: &str = "400";

/// The goals.
const GOAL_FIB_RATIO: f64 = 1.05;
const GOAL_PAUSE_MS: f64 = 1.0;
const GOAL_FAILOVER_MS: f64 = 200.0;
const GOAL_SOURCE: &str = "Musubi goal, same run";
/// Remus (NSDI 2008) failed over in about a second.
const REMUS_FAILOVER_MS: f64 = 1000.0;
/// The client's ports in its namespace: the echo peer's and the counter's (the guest's).
const ECHO_PORT: u16 = 7001;
const COUNTER_PORT: u16 = 7000;
/// The counter client: a request, then its answer awaited this long before it asks again.
const RESEND_AFTER: Duration = Duration::from_millis(40);
/// Its pause between an answer and the next request.
const ASK_EVERY: Duration = Duration::from_millis(2);
/// Answers the client must get from the standby before the run ends.
const ANSWERS_AFTER_KILL: usize = 30;
const CONTINUE_TIMEOUT: Duration = Duration::from_secs(20);

/// How much each run does.
#[derive(Clone, Copy, Debug)]
struct Load {
    fib_n: u64,
    mem_mib: u64,
    mem_rounds: u64,
    reps: usize,
    kills: usize,
    /// The longest random wait before a kill, once the standby is protecting the VM.
    kill_within_ms: u64,
    /// The failover runs' fib: long enough that the kill falls mid-task wherever the random
    /// moment falls.
    failover_fib_n: u64,
    /// udp-echo's rounds per run, and its runs per configuration.
    echo_rounds: u64,
    echo_reps: usize,
    /// Kills of a primary that a `udp-counter` client asks.
    client_kills: usize,
}

/// Seconds of work per task: well over a hundred epochs at 20 ms, so that a run's 99th
/// percentile of the pauses is not simply its longest.
const FULL: Load = Load {
    fib_n: 45,
    mem_mib: 32,
    mem_rounds: 8192,
    reps: 5,
    kills: 20,
    kill_within_ms: 400,
    failover_fib_n: 44,
    echo_rounds: 300,
    echo_reps: 3,
    client_kills: 20,
};
const QUICK: Load = Load {
    fib_n: 40,
    mem_mib: 16,
    mem_rounds: 1024,
    reps: 1,
    kills: 2,
    kill_within_ms: 100,
    failover_fib_n: 43,
    echo_rounds: 50,
    echo_reps: 1,
    client_kills: 2,
};

/// The guest's task after hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    /// `fib=N`: recursive fib at CPL3, its stack the only memory it writes.
    Fib,
    /// `mem-check=MIB,iters=R`: fills MIB, rewrites a sixteenth of it per round, checks it.
    MemCheck,
    /// `udp-echo=CLIENT:PORT,n=N`: request and answer, one at a time, with an echo peer in
    /// the client's namespace (the VM on the TAP of [`ReplicaNet`]).
    UdpEcho,
}

impl Work {
    fn name(self) -> &'static str {
        match self {
            Work::Fib => "fib",
            Work::MemCheck => "mem-check",
            Work::UdpEcho => "udp-echo",
        }
    }

    fn task(self, load: &Load) -> String {
        match self {
            Work::Fib => format!("fib={}", load.fib_n),
            Work::MemCheck => format!("mem-check={},iters={}", load.mem_mib, load.mem_rounds),
            Work::UdpEcho => format!("udp-echo={CLIENT}:{ECHO_PORT},n={}", load.echo_rounds),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Config {
    work: Work,
    /// The epoch, or `None` for the VM unreplicated.
    epoch_ms: Option<u64>,
}

impl Config {
    fn name(&self) -> String {
        match self.epoch_ms {
            Some(e) => format!("{} {e} ms", self.work.name()),
            None => format!("{} unreplicated", self.work.name()),
        }
    }
}

/// One overhead run.
#[derive(Clone, Debug)]
struct Sample {
    /// The host's time from the guest's reading its go line (`console-echo`'s result) to
    /// the task's result line.
    wall_ns: u64,
    /// The task's own `ns` (the guest's TSC, which a checkpoint's resume sets back).
    guest_ns: u64,
    /// Of `wall_ns`, the vCPU thread's time runnable but waiting for a CPU (its schedstat),
    /// when the thread could be read at both ends.
    queued_ns: Option<u64>,
    /// The primary's counts at its end; `None` unreplicated.
    replication: Option<ReplicationMetrics>,
    /// Epochs sent from the task's start to the VM's end (the primary's count when the go
    /// line was typed, from its count at the end).
    task_epochs: Option<u64>,
    /// Bytes sent over those epochs (pages and state).
    task_bytes: Option<u64>,
    /// udp-echo's own figures, for that task.
    echo: Option<Echo>,
}

/// What the probe's udp-echo said of its rounds.
#[derive(Clone, Copy, Debug)]
struct Echo {
    rate_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    lost: u64,
}

impl Sample {
    /// The task's time per epoch sent: the epoch the link allowed (at least the one asked).
    fn effective_epoch_ns(&self) -> Option<f64> {
        ratio(self.wall_ns as f64, self.task_epochs? as f64)
    }

    /// The task's time less the vCPU's waits for a CPU: what it would take on a core of its
    /// own, the pauses and the dirty log's faults still in it.
    fn own_core_ns(&self) -> Option<f64> {
        Some(self.wall_ns.saturating_sub(self.queued_ns?) as f64)
    }

    /// Bytes per epoch during the task, the epochs of the boot and the wait left out.
    fn task_bytes_per_epoch(&self) -> Option<f64> {
        ratio(self.task_bytes? as f64, self.task_epochs? as f64)
    }
}

/// One kill of a primary that a `udp-counter` client asked.
#[derive(Clone, Debug)]
struct ClientKill {
    /// kill(2) of the primary to the client's first answer sent by the standby (the first
    /// to come after the standby's first KVM_RUN).
    to_answer_ns: u64,
    /// kill(2) to the standby's first KVM_RUN.
    to_first_run_ns: u64,
    delay_ms: u64,
    acked_before: u64,
    /// Answers the client got over the run, and by the kill.
    answers: usize,
    at_kill: usize,
    /// Answers whose number was not above the one before (given twice, or gone back).
    repeated: u64,
    /// Numbers never seen between those seen (answers lost).
    skipped: u64,
}

/// One kill of a primary.
#[derive(Clone, Debug)]
struct Kill {
    /// kill(2) of the primary to the standby's first KVM_RUN.
    failover_ns: u64,
    /// The random wait before the kill, once protected.
    delay_ms: u64,
    /// Epochs the standby had acknowledged at the last look before the kill.
    acked_before: u64,
    /// The epoch the standby said it took over from.
    taken_from: Option<u64>,
}

pub fn run(h: &Harness, _args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let load = if h.quick { QUICK } else { FULL };
    let trace = KvmRunTrace::open().map_err(|e| {
        format!("failover is timed by the kernel's sys_enter_ioctl tracepoint: {e}")
    })?;
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    // Deleted, with every interface in them, however the run ends.
    let net = ReplicaNet::try_new("ha")
        .map_err(|e| e.to_string())
        .and_then(|n| n.delete_on_signal().map(|()| n));
    print_plan(&load, &trace, &net);
    let mut configs = Vec::new();
    for work in [Work::Fib, Work::MemCheck] {
        configs.push(Config {
            work,
            epoch_ms: None,
        });
        for e in EPOCHS_MS {
            configs.push(Config {
                work,
                epoch_ms: Some(e),
            });
        }
    }
    let mut runs = Runs::measure(h, configs, load.reps, Config::name, |_, c| {
        overhead_run(&exe, &elf, c, &load, None)
    })?;
    if let Ok(net) = &net {
        let echo: Vec<Config> = std::iter::once(None)
            .chain(EPOCHS_MS.map(Some))
            .map(|epoch_ms| Config {
                work: Work::UdpEcho,
                epoch_ms,
            })
            .collect();
        let echo = Runs::measure(h, echo, load.echo_reps, Config::name, |_, c| {
            overhead_run(&exe, &elf, c, &load, Some(net))
        })?;
        runs = joined(runs, echo);
    }
    let fib_n = load.failover_fib_n;
    let mut seed = monotonic_ns() | 1;
    let mut early = Vec::new();
    let kills = Runs::measure(
        h,
        vec![format!("failover fib={fib_n}")],
        load.kills,
        String::clone,
        |_, _| loop {
            let delay = xorshift(&mut seed) % (load.kill_within_ms + 1);
            match failover_run(&exe, &elf, fib_n, delay, &trace)? {
                Attempt::Killed(k) => return Ok(k),
                // Counted and reported; a kill is made again, but not without end.
                Attempt::Early(why) if early.len() < load.kills => early.push(why),
                Attempt::Early(why) => {
                    return Err(format!(
                        "{} standbys took over from a live primary, the last: {why}",
                        early.len() + 1
                    ))
                }
            }
        },
    )?;
    let mut client_early = Vec::new();
    let client_kills = match &net {
        Ok(net) => Some(Runs::measure(
            h,
            vec!["failover, udp-counter client".to_string()],
            load.client_kills,
            String::clone,
            |_, _| loop {
                let delay = xorshift(&mut seed) % (load.kill_within_ms + 1);
                match client_failover_run(&exe, &elf, net, delay, &trace)? {
                    Attempt::Killed(k) => return Ok(k),
                    Attempt::Early(why) if client_early.len() < load.client_kills => {
                        client_early.push(why)
                    }
                    Attempt::Early(why) => {
                        return Err(format!(
                            "{} standbys took over from a live primary, the last: {why}",
                            client_early.len() + 1
                        ))
                    }
                }
            },
        )?),
        Err(_) => None,
    };
    let unavailable = net.as_ref().err().map(String::as_str);
    let csv_path = Outputs::new(h).csv("ha.csv", &csv(&runs, &kills, client_kills.as_ref()))?;
    let f = Found::of(&runs);
    let k = kill_sums(&kills);
    let ck = client_kills.as_ref().map(client_sums);
    print_table(&f);
    print_failover(&k, &kills, &early);
    match (&ck, &client_kills) {
        (Some(ck), Some(runs)) => print_client_failover(ck, runs, &client_early),
        _ => println!(
            "\nfailover to the client's first answer (udp-counter): unavailable: {}",
            unavailable.unwrap_or("not run")
        ),
    }
    match unavailable {
        None => print_echo(&f),
        Some(why) => println!("\nudp-echo under replication: unavailable: {why}"),
    }
    println!();
    print!("{}", verdicts(&f, &k, ck.as_ref(), unavailable).table());
    println!(
        "  (the failover goal is to the client's first answer; the first KVM_RUN is where the"
    );
    println!("  standby's VM runs again, the part of it that is the VMM's)");
    if h.quick {
        println!(
            "(--quick: one run per configuration, {} kills with fib and {} with a client; the goals are stated for the full run)",
            load.kills, load.client_kills
        );
    }
    println!();
    println!(
        "This machine runs KVM nested on 2 cores shared with other work: the primary, the standby"
    );
    println!(
        "and the guest's vCPU share them, so the standby's receiving competes with the guest."
    );
    let svg_path =
        Outputs::new(h).bars("ha.svg", "musubi bench ha", &panels(&f, &k, ck.as_ref()))?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

/// `b`'s configurations and runs after `a`'s, as if measured together.
fn joined<C, R>(mut a: Runs<C, R>, b: Runs<C, R>) -> Runs<C, R> {
    let off = a.configs.len();
    a.configs.extend(b.configs);
    a.runs
        .extend(b.runs.into_iter().map(|(rep, c, r)| (rep, c + off, r)));
    a
}

fn print_plan(load: &Load, trace: &KvmRunTrace, net: &Result<ReplicaNet, String>) {
    println!(
        "ha: replication to a standby (on loopback; the network rows in namespaces), probe guest, 1 vCPU, {MEMORY_MIB} MiB;"
    );
    println!(
        "  overhead: hello,{} and hello,{} unreplicated and at epochs of {} ms (heartbeat {OVERHEAD_HEARTBEAT_MS} ms), {} run(s) each, interleaved;",
        Work::Fib.task(load),
        Work::MemCheck.task(load),
        EPOCHS_MS.map(|e| e.to_string()).join(", "),
        load.reps
    );
    println!(
        "  failover: hello,fib={} at a {FAILOVER_EPOCH_MS} ms epoch, heartbeat {HEARTBEAT_MS} ms, the primary SIGKILLed at a random",
        load.failover_fib_n
    );
    println!(
        "  moment up to {} ms after the standby holds {EPOCHS_BEFORE_KILL}+ epochs past hello, {} kills;",
        load.kill_within_ms, load.kills
    );
    match net {
        Ok(n) => {
            println!(
                "  network: the primary's and the standby's {TAP} on bridges in the namespaces {} and {},",
                n.primary.name, n.standby.name
            );
            println!(
                "  joined over veths to {} where the client runs; replication link {STANDBY_HOST}, guest {GUEST};",
                n.client.name
            );
            println!(
                "  udp-echo n={} with a peer at {CLIENT}, unreplicated and at each epoch, {} run(s) each;",
                load.echo_rounds, load.echo_reps
            );
            println!(
                "  failover with a udp-counter client (a request every ~{} ms, asked again after {} ms unanswered), {} kills;",
                ASK_EVERY.as_millis(),
                RESEND_AFTER.as_millis(),
                load.client_kills
            );
        }
        Err(why) => println!("  network rows unavailable: {why}"),
    }
    println!(
        "  KVM_RUN from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );
}

/// A small, seeded generator of kill moments (no cryptographic need).
fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// fib(n) as the probe computes it (wrapping u64).
fn fib_value(n: u64) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
        (a, b) = (b, a.wrapping_add(b));
    }
    a
}

fn temp_dir() -> Result<tempfile::TempDir, String> {
    tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))
}

fn start(cmd: Command, name: &'static str, dir: &Path, tag: &str) -> Result<Vm, String> {
    Vm::start_to(
        cmd,
        name,
        &dir.join(format!("{tag}.stdout")),
        &dir.join(format!("{tag}.stderr")),
    )
}

/// `exe` as it is run: at once, or in the namespace `ns` (`ip netns exec` execs it, so the
/// child's pid is Musubi's).
fn musubi_in(exe: &Path, ns: Option<&testkit::netns::Netns>) -> Result<Command, String> {
    Ok(match ns {
        None => Command::new(exe),
        Some(ns) => ns.command(
            exe.to_str()
                .ok_or_else(|| format!("{} is not UTF-8", exe.display()))?,
        ),
    })
}

/// A MAC of its own for every VM on the bridges: a standby that took over leaves the
/// bridges sending its MAC its way, which the next run's primary must not inherit.
fn next_mac() -> String {
    static N: AtomicU64 = AtomicU64::new(1);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("52:54:00:09:{:02x}:{:02x}", (n >> 8) & 0xff, n & 0xff)
}

/// The primary (or the unreplicated VM) running `tasks` after hello, its console in
/// `console` or, without one, on stdout (`primary.stdout`, stdin typed into COM1), metrics
/// in `dir/primary-metrics.json`; replicating to `to` every `epoch_ms` if given; with `mac`,
/// a NIC on the namespace's TAP and the guest at [`GUEST`].
#[allow(clippy::too_many_arguments)]
fn primary_command(
    mut cmd: Command,
    elf: &Path,
    dir: &Path,
    tasks: &str,
    console: Option<&Path>,
    to: Option<(&str, &Path, u64)>,
    mac: Option<&str>,
) -> Command {
    let ip = match mac {
        Some(_) => format!("probe.ip={GUEST}/24 "),
        None => String::new(),
    };
    cmd.args(["run", "--kernel"])
        .arg(elf)
        .args(["--cpus", "1", "--memory", &format!("{MEMORY_MIB}M")])
        .args(["--cmdline", &format!("{ip}probe.tasks=hello,{tasks}")]);
    if let Some(mac) = mac {
        cmd.args(["--net", &format!("tap={TAP},mac={mac}")]);
    }
    cmd.arg("--serial");
    match console {
        Some(c) => cmd.arg(format!("file={}", c.display())),
        None => cmd.arg("stdio"),
    };
    cmd.arg("--metrics")
        .arg(dir.join("primary-metrics.json"))
        .args(["--timeout", VM_TIMEOUT_S]);
    if let Some((url, secret, epoch_ms)) = to {
        cmd.args(["--replicate-to", url, "--secret-file"])
            .arg(secret)
            .args(["--epoch", &epoch_ms.to_string()]);
    }
    cmd
}

/// A standby listening on a free loopback port, or with `net` on the standby host's bridge
/// in its namespace, once it listens: it, the URL and the secret.
fn standby(
    exe: &Path,
    dir: &Path,
    heartbeat_ms: u64,
    net: Option<&ReplicaNet>,
) -> Result<(Vm, String, PathBuf), String> {
    let secret = testkit::tcp::secret_file(dir, "secret", (monotonic_ns() % 251) as u8);
    let port = testkit::tcp::free_port();
    let host = match net {
        Some(_) => STANDBY_HOST.parse().expect("an IPv4 address"),
        None => Ipv4Addr::LOCALHOST,
    };
    let url = format!("tcp:{host}:{port}");
    let mut cmd = musubi_in(exe, net.map(|n| &n.standby))?;
    cmd.args(["run", "--standby-for", &url, "--secret-file"])
        .arg(&secret)
        .args(["--heartbeat", &heartbeat_ms.to_string()])
        .arg("--serial")
        .arg(format!("file={}", dir.join("standby.console").display()))
        .args(["--timeout", VM_TIMEOUT_S]);
    let vm = start(cmd, "musubi (standby)", dir, "standby")?;
    let pid = vm.child.id();
    wait_until(&vm, "a listening socket", LISTEN_TIMEOUT, || {
        testkit::tcp::listening_in(pid, host, port)
    })?;
    Ok((vm, url, secret))
}

/// The result line of `task` on `console`, checked: fib's exact value, mem-check's 0
/// errors.
fn task_result(console: &Path, work: Work, load_fib: u64) -> Result<serde_json::Value, String> {
    let text = std::fs::read(console).unwrap_or_default();
    let results = crate::probe::results(&text);
    let r = crate::probe::result(&results, work.name()).ok_or_else(|| {
        format!(
            "no {} result line on {}: {}",
            work.name(),
            console.display(),
            one_line(&String::from_utf8_lossy(&text), 300)
        )
    })?;
    let ok = match work {
        Work::Fib => r["result"].as_u64() == Some(fib_value(load_fib)),
        Work::MemCheck => r["ok"] == true && r["errors"].as_u64() == Some(0),
        Work::UdpEcho => r["ok"] == true,
    };
    if !ok {
        return Err(format!("the task's result is wrong: {r}"));
    }
    Ok(r.clone())
}

/// One overhead run: the VM alone, or primary and standby. The guest waits for a line on
/// its console (`console-echo`) before its task, and gets it once the standby protects it
/// (at once unreplicated), so the task's time holds no setting up of the replication.
fn overhead_run(
    exe: &Path,
    elf: &Path,
    c: &Config,
    load: &Load,
    net: Option<&ReplicaNet>,
) -> Result<Sample, String> {
    let tmp = temp_dir()?;
    let dir = tmp.path();
    let tasks = format!(
        "console-echo={},{}",
        LISTEN_TIMEOUT.as_secs() * 4,
        c.work.task(load)
    );
    let net = match c.work {
        Work::UdpEcho => Some(net.ok_or("udp-echo runs in the namespaces of ReplicaNet")?),
        _ => None,
    };
    let standby = match c.epoch_ms {
        Some(_) => Some(standby(exe, dir, OVERHEAD_HEARTBEAT_MS, net)?),
        None => None,
    };
    let to = standby
        .as_ref()
        .zip(c.epoch_ms)
        .map(|((_, url, secret), e)| (url.as_str(), secret.as_path(), e));
    let peer = net.map(EchoPeer::start).transpose()?;
    let mac = net.map(|_| next_mac());
    let mut vm = Vm::start_typed(
        primary_command(
            musubi_in(exe, net.map(|n| &n.primary))?,
            elf,
            dir,
            &tasks,
            None,
            to,
            mac.as_deref(),
        ),
        "musubi (primary)",
        &dir.join("primary.stdout"),
        &dir.join("primary.stderr"),
    )?;
    let console = dir.join("primary.stdout");
    let metrics = dir.join("primary-metrics.json");
    vm.wait_for_line(&console, "probe: console-echo", BOOT_TIMEOUT)?;
    let mut counts_at_start = None;
    if standby.is_some() {
        let sent = std::cell::Cell::new(None);
        wait_until(&vm, "protection by the standby", LISTEN_TIMEOUT, || {
            std::thread::sleep(POLL);
            let r = metrics_now(&vm, &metrics).and_then(|m| m.replication);
            sent.set(
                r.filter(|r| r.epochs_acked > 0)
                    .map(|r| (r.epochs_sent, r.bytes_sent)),
            );
            sent.get().is_some()
        })?;
        counts_at_start = sent.get();
    }
    let mut stdin = vm.child.stdin.take().ok_or("no stdin to the primary")?;
    std::io::Write::write_all(&mut stdin, b"go\n")
        .map_err(|e| format!("cannot type into the primary's console: {e}"))?;
    vm.wait_for_line(&console, "{\"probe\":\"console-echo\"", LISTEN_TIMEOUT)?;
    let t0 = monotonic_ns();
    let pid = vm.child.id();
    let queued = QueuedSampler::start(pid);
    let marker = format!("{{\"probe\":\"{}\"", c.work.name());
    vm.wait_for_line(&console, &marker, RUN_TIMEOUT)?;
    let wall_ns = monotonic_ns() - t0;
    let queued_ns = queued.since_start();
    if !vm.wait_exit(RUN_TIMEOUT) {
        return Err(format!(
            "the primary did not end within {} s of its task",
            RUN_TIMEOUT.as_secs()
        ));
    }
    if vm.exit_code() != Some(0) {
        return Err(format!(
            "the primary ended with {:?}; {}",
            vm.exit_code(),
            vm.said()
        ));
    }
    let r = task_result(&console, c.work, load.fib_n)?;
    let guest_ns = r["ns"]
        .as_u64()
        .ok_or_else(|| format!("no ns in the result line {r}"))?;
    if let Some(peer) = peer {
        peer.finish()?;
    }
    let echo = match c.work {
        Work::UdpEcho => {
            let f = |k: &str| {
                r[k].as_f64()
                    .ok_or_else(|| format!("no {k} in udp-echo's result line {r}"))
            };
            Some(Echo {
                rate_per_s: f("rate_per_s")?,
                p50_us: f("p50_us")?,
                p99_us: f("p99_us")?,
                lost: f("lost")? as u64,
            })
        }
        _ => None,
    };
    let replication = match standby {
        None => None,
        Some((sb, _, _)) => {
            let m = read_metrics(&metrics)?;
            let r = m
                .replication
                .ok_or("the primary's metrics have no replication block")?;
            if r.lost.is_some() || r.epochs_acked == 0 {
                return Err(format!(
                    "the standby did not protect the VM: {r:?}; {}",
                    sb.said()
                ));
            }
            if !sb.wait_exit(RUN_TIMEOUT) || sb.exit_code() != Some(0) {
                return Err(format!(
                    "the standby did not end with status 0 after the primary's VM ended; {}",
                    sb.said()
                ));
            }
            Some(r)
        }
    };
    let since_start = |f: fn(&ReplicationMetrics) -> u64, at: fn((u64, u64)) -> u64| {
        replication
            .as_ref()
            .zip(counts_at_start)
            .map(|(r, s)| f(r).saturating_sub(at(s)))
    };
    let task_epochs = since_start(|r| r.epochs_sent, |s| s.0);
    let task_bytes = since_start(|r| r.bytes_sent, |s| s.1);
    Ok(Sample {
        wall_ns,
        guest_ns,
        queued_ns,
        replication,
        task_epochs,
        task_bytes,
        echo,
    })
}

/// An echo peer on [`CLIENT`]:[`ECHO_PORT`] in the client's namespace, on a thread of its
/// own; it stops when told or dropped, and after [`RUN_TIMEOUT`] at the latest.
struct EchoPeer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<u64, String>>>,
}

impl EchoPeer {
    /// Once its socket is bound.
    fn start(net: &ReplicaNet) -> Result<EchoPeer, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, bound) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let thread = net.client.spawn(move || {
            let sock = UdpSocket::bind((CLIENT, ECHO_PORT))
                .map_err(|e| format!("the echo peer's {CLIENT}:{ECHO_PORT}: {e}"))?;
            sock.set_read_timeout(Some(Duration::from_millis(20)))
                .map_err(|e| format!("the echo peer's socket: {e}"))?;
            let _ = ready.send(());
            let (t0, mut echoed, mut buf) = (Instant::now(), 0u64, [0u8; 2048]);
            while !flag.load(Ordering::Relaxed) && t0.elapsed() < RUN_TIMEOUT {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    if sock.send_to(&buf[..n], from).is_ok() {
                        echoed += 1;
                    }
                }
            }
            Ok(echoed)
        });
        let mut peer = EchoPeer {
            stop,
            thread: Some(thread),
        };
        if bound.recv_timeout(LISTEN_TIMEOUT).is_err() {
            return Err(peer
                .finish_inner()
                .err()
                .unwrap_or_else(|| "the echo peer ended before it was ready".into()));
        }
        Ok(peer)
    }

    /// Stops it; what it echoed, or why it could not.
    fn finish(mut self) -> Result<u64, String> {
        self.finish_inner()
    }

    fn finish_inner(&mut self) -> Result<u64, String> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err("the echo peer's thread panicked".into()),
            None => Err("the echo peer was already stopped".into()),
        }
    }
}

impl Drop for EchoPeer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish_inner();
        }
    }
}

/// Follows how long `vcpu0` waits for a CPU through a task. The guest powers off right
/// after the line that ends the task, so the thread may be gone by the time the bench has
/// read that line; then the last sample (at most [`POLL`] old) stands for the end.
struct QueuedSampler {
    start: Option<u64>,
    last: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    pid: u32,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl QueuedSampler {
    fn start(pid: u32) -> QueuedSampler {
        let start = vcpu_queued_ns(pid);
        let last = Arc::new(AtomicU64::new(start.unwrap_or(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (last, stop) = (last.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match vcpu_queued_ns(pid) {
                        Some(q) => last.store(q, Ordering::Relaxed),
                        None => return,
                    }
                    std::thread::sleep(POLL);
                }
            })
        };
        QueuedSampler {
            start,
            last,
            stop,
            pid,
            thread: Some(thread),
        }
    }

    /// The vCPU's wait since `start`, from a fresh reading if the thread is still there.
    fn since_start(mut self) -> Option<u64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let end = vcpu_queued_ns(self.pid).unwrap_or(self.last.load(Ordering::Relaxed));
        self.start.map(|a| end.saturating_sub(a))
    }
}

impl Drop for QueuedSampler {
    /// A task that failed leaves no sampler behind.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The time (ns) the thread `vcpu0` of process `pid` has waited runnable for a CPU: the
/// second field of its `/proc/PID/task/TID/schedstat`.
fn vcpu_queued_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.flatten().find_map(|t| {
        let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
        if comm.trim() != "vcpu0" {
            return None;
        }
        let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
        stat.split_whitespace().nth(1)?.parse().ok()
    })
}

fn read_metrics(path: &Path) -> Result<Metrics, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("the primary's --metrics {}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("the primary's --metrics {}: {e}", path.display()))
}

/// How often the primary is asked for its metrics while the bench waits on them: each ask
/// has it write a file, work taken from the VM it times.
const POLL: Duration = Duration::from_millis(10);

/// Waits until the standby holds [`EPOCHS_BEFORE_KILL`] epochs and two past now (the epoch
/// not yet acknowledged now has its checkpoint after what the guest printed so far, so the
/// standby does not print it again); returns the epochs acknowledged then.
fn epochs_past_now(primary: &Vm, metrics: &Path) -> Result<u64, String> {
    let acked = |m: &Option<Metrics>| {
        m.as_ref()
            .and_then(|m| m.replication.as_ref())
            .map_or(0, |r| r.epochs_acked)
    };
    let want = EPOCHS_BEFORE_KILL.max(acked(&metrics_now(primary, metrics)) + 2);
    // `wait_until` asks a `Fn`: what the last look saw is kept in a cell.
    let seen = std::cell::Cell::new(0);
    wait_until(primary, "the standby's epochs", RUN_TIMEOUT, || {
        std::thread::sleep(POLL);
        seen.set(acked(&metrics_now(primary, metrics)));
        seen.get() >= want
    })?;
    Ok(seen.get())
}

/// The primary's metrics as of now: SIGUSR1 has it write them.
fn metrics_now(vm: &Vm, path: &Path) -> Option<Metrics> {
    let _ = std::fs::remove_file(path);
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(vm.child.id() as libc::pid_t, libc::SIGUSR1) };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) && !vm.ended() {
        if let Some(m) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str::<Metrics>(&t).ok())
        {
            return Some(m);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// How a kill went.
enum Attempt<K> {
    Killed(K),
    /// The standby took over while the primary still ran (it was silent past the
    /// heartbeat): no failover to time; why, in the standby's words.
    Early(String),
}

/// One kill: the primary SIGKILLed `delay_ms` after the standby holds epochs past hello,
/// timed to the standby's first KVM_RUN; the standby must end the task exactly.
fn failover_run(
    exe: &Path,
    elf: &Path,
    fib_n: u64,
    delay_ms: u64,
    trace: &KvmRunTrace,
) -> Result<Attempt<Kill>, String> {
    let tmp = temp_dir()?;
    let dir = tmp.path();
    let (sb, url, secret) = standby(exe, dir, HEARTBEAT_MS, None)?;
    let early = |sb: &Vm| {
        let said = std::fs::read_to_string(&sb.stderr).unwrap_or_default();
        said.lines()
            .find(|l| l.contains("was lost"))
            .map(|l| Attempt::Early(l.trim().to_string()))
    };
    let mut primary = start(
        primary_command(
            musubi_in(exe, None)?,
            elf,
            dir,
            &format!("fib={fib_n}"),
            Some(&dir.join("primary.console")),
            Some((&url, &secret, FAILOVER_EPOCH_MS)),
            None,
        ),
        "musubi (primary)",
        dir,
        "primary",
    )?;
    let console = dir.join("primary.console");
    let metrics = dir.join("primary-metrics.json");
    primary.wait_for_line(&console, HELLO, BOOT_TIMEOUT)?;
    // A standby that took over from the live primary ends the protection waited for.
    let acked_before = match epochs_past_now(&primary, &metrics) {
        Ok(a) => a,
        Err(e) => return early(&sb).ok_or(e),
    };
    std::thread::sleep(Duration::from_millis(delay_ms));
    if let Some(e) = early(&sb) {
        return Ok(e);
    }
    trace.clear()?;
    let killed_at = monotonic_ns();
    primary
        .child
        .kill()
        .map_err(|e| format!("cannot kill the primary: {e}"))?;
    let _ = primary.child.wait();
    let before = std::fs::read_to_string(&console).unwrap_or_default();
    if before.contains("{\"probe\":\"fib\"") {
        return Err(format!(
            "the primary ended its task before it was killed (make fib longer): {}",
            one_line(&before, 300)
        ));
    }
    let pid = sb.child.id();
    let first = std::cell::Cell::new(None);
    wait_until(&sb, "its first KVM_RUN", BOOT_TIMEOUT, || {
        first.set(trace.first_run_ns(pid).ok().flatten());
        first.get().is_some()
    })?;
    let first = first.get().ok_or("no first KVM_RUN of the standby")?;
    if first < killed_at {
        return Ok(early(&sb).unwrap_or_else(|| {
            Attempt::Early("the standby ran before the primary was killed".into())
        }));
    }
    if !sb.wait_exit(RUN_TIMEOUT) {
        return Err(format!(
            "the standby did not end the task within {} s",
            RUN_TIMEOUT.as_secs()
        ));
    }
    let standby_console = dir.join("standby.console");
    if sb.exit_code() != Some(0) {
        return Err(format!(
            "the standby ended with {:?}; {}; console: {}",
            sb.exit_code(),
            sb.said(),
            one_line(
                &std::fs::read_to_string(&standby_console).unwrap_or_default(),
                300
            )
        ));
    }
    task_result(&standby_console, Work::Fib, fib_n)?;
    let after = std::fs::read_to_string(&standby_console).unwrap_or_default();
    if after.contains(HELLO) {
        return Err(format!(
            "the standby printed hello: it booted instead of taking over: {}",
            one_line(&after, 300)
        ));
    }
    let said = std::fs::read_to_string(&sb.stderr).unwrap_or_default();
    let taken_from = said
        .split("taking over from epoch ")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse().ok());
    Ok(Attempt::Killed(Kill {
        failover_ns: first - killed_at,
        delay_ms,
        acked_before,
        taken_from,
    }))
}

/// One kill with a client: the primary runs `udp-counter` in its namespace, a client in the
/// client's asks it every few ms; the primary is SIGKILLed `delay_ms` after the standby holds
/// epochs past the client's first answers, and the run ends once the client has had
/// [`ANSWERS_AFTER_KILL`] answers from the standby.
fn client_failover_run(
    exe: &Path,
    elf: &Path,
    net: &ReplicaNet,
    delay_ms: u64,
    trace: &KvmRunTrace,
) -> Result<Attempt<ClientKill>, String> {
    let tmp = temp_dir()?;
    let dir = tmp.path();
    let (sb, url, secret) = standby(exe, dir, HEARTBEAT_MS, Some(net))?;
    let early = |sb: &Vm| {
        let said = std::fs::read_to_string(&sb.stderr).unwrap_or_default();
        said.lines()
            .find(|l| l.contains("was lost"))
            .map(|l| l.trim().to_string())
    };
    // The client asks for the guest's MAC again: the last run's is another.
    testkit::netns::try_ip(&["-n", &net.client.name, "neigh", "flush", "all"])
        .map_err(|e| e.to_string())?;
    let console = dir.join("primary.console");
    let mac = next_mac();
    let mut primary = start(
        primary_command(
            musubi_in(exe, Some(&net.primary))?,
            elf,
            dir,
            &format!("udp-counter={COUNTER_PORT},n=1000000"),
            Some(&console),
            Some((&url, &secret, FAILOVER_EPOCH_MS)),
            Some(&mac),
        ),
        "musubi (primary)",
        dir,
        "primary",
    )?;
    let metrics = dir.join("primary-metrics.json");
    primary.wait_for_line(&console, "probe: udp-counter: listening", BOOT_TIMEOUT)?;
    let client = CounterClient::start(net)?;
    let answered = wait_until(&primary, "the client's first answers", BOOT_TIMEOUT, || {
        std::thread::sleep(POLL);
        client.count() >= 5
    });
    if let Err(e) = answered {
        return early(&sb).map(Attempt::Early).ok_or(e);
    }
    let acked_before = match epochs_past_now(&primary, &metrics) {
        Ok(a) => a,
        Err(e) => return early(&sb).map(Attempt::Early).ok_or(e),
    };
    std::thread::sleep(Duration::from_millis(delay_ms));
    if let Some(why) = early(&sb) {
        return Ok(Attempt::Early(why));
    }
    trace.clear()?;
    let killed_at = monotonic_ns();
    primary
        .child
        .kill()
        .map_err(|e| format!("cannot kill the primary: {e}"))?;
    let _ = primary.child.wait();
    let at_kill = client.count();
    let pid = sb.child.id();
    let first = std::cell::Cell::new(None);
    wait_until(&sb, "its first KVM_RUN", BOOT_TIMEOUT, || {
        first.set(trace.first_run_ns(pid).ok().flatten());
        first.get().is_some()
    })?;
    let first = first.get().ok_or("no first KVM_RUN of the standby")?;
    if first < killed_at {
        return Ok(Attempt::Early(early(&sb).unwrap_or_else(|| {
            "the standby ran before the primary was killed".into()
        })));
    }
    wait_until(
        &sb,
        "the client's answers from the standby",
        CONTINUE_TIMEOUT,
        || {
            std::thread::sleep(POLL);
            client.count() >= at_kill + ANSWERS_AFTER_KILL
        },
    )
    .map_err(|e| format!("{e}; the client had {at_kill} answers at the kill"))?;
    let answers = client.stop()?;
    let to_answer_ns = answers
        .iter()
        .find(|a| a.0 > first)
        .map(|a| a.0 - killed_at)
        .ok_or("no answer after the standby's first KVM_RUN")?;
    let values: Vec<u64> = answers.iter().map(|a| a.1).collect();
    let (repeated, skipped) = repeats_and_gaps(&values);
    Ok(Attempt::Killed(ClientKill {
        to_answer_ns,
        to_first_run_ns: first - killed_at,
        delay_ms,
        acked_before,
        answers: answers.len(),
        at_kill,
        repeated,
        skipped,
    }))
}

/// Of a counter's values as a client got them (the first is 1): how many were not above
/// the one before (repeated, or gone back), and how many numbers between were never seen.
fn repeats_and_gaps(values: &[u64]) -> (u64, u64) {
    let (mut last, mut repeated, mut skipped) = (0u64, 0u64, 0u64);
    for &v in values {
        if v <= last {
            repeated += 1;
        } else {
            skipped += v - last - 1;
            last = v;
        }
    }
    (repeated, skipped)
}

/// The `udp-counter` client in the client's namespace: a request, every answer kept with
/// its `CLOCK_MONOTONIC` time, asked again after [`RESEND_AFTER`] without one, the next
/// request [`ASK_EVERY`] after an answer. It stops when told or dropped, and after
/// [`RUN_TIMEOUT`] at the latest.
struct CounterClient {
    answers: Arc<Mutex<Vec<(u64, u64)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl CounterClient {
    fn start(net: &ReplicaNet) -> Result<CounterClient, String> {
        let answers = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (got, flag) = (answers.clone(), stop.clone());
        let thread = net.client.spawn(move || -> Result<(), String> {
            let sock = UdpSocket::bind((CLIENT, 0))
                .map_err(|e| format!("the counter client's {CLIENT}:0: {e}"))?;
            sock.set_read_timeout(Some(Duration::from_millis(5)))
                .map_err(|e| format!("the counter client's socket: {e}"))?;
            let (t0, mut buf) = (Instant::now(), [0u8; 64]);
            while !flag.load(Ordering::Relaxed) && t0.elapsed() < RUN_TIMEOUT {
                let _ = sock.send_to(b"next", (GUEST, COUNTER_PORT));
                let sent = Instant::now();
                let mut answered = false;
                while sent.elapsed() < RESEND_AFTER {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            let v = std::str::from_utf8(&buf[..n])
                                .ok()
                                .and_then(|t| t.trim().parse::<u64>().ok())
                                .ok_or_else(|| format!("udp-counter answered {:?}", &buf[..n]))?;
                            got.lock()
                                .map_err(|_| "the answers' lock")?
                                .push((monotonic_ns(), v));
                            answered = true;
                        }
                        Err(_) if answered => break,
                        Err(_) => {}
                    }
                }
                if answered {
                    std::thread::sleep(ASK_EVERY);
                }
            }
            Ok(())
        });
        Ok(CounterClient {
            answers,
            stop,
            thread: Some(thread),
        })
    }

    fn count(&self) -> usize {
        self.answers.lock().map(|a| a.len()).unwrap_or(0)
    }

    /// Stops it; every answer, in the order they came.
    fn stop(mut self) -> Result<Vec<(u64, u64)>, String> {
        self.finish()?;
        let answers = self.answers.lock().map_err(|_| "the answers' lock")?;
        Ok(answers.clone())
    }

    fn finish(&mut self) -> Result<(), String> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err("the counter client's thread panicked".into()),
            None => Ok(()),
        }
    }
}

impl Drop for CounterClient {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// `ha.csv`: a row per overhead run, then one per kill.
fn csv(
    runs: &Runs<Config, Sample>,
    kills: &Runs<String, Kill>,
    client_kills: Option<&Runs<String, ClientKill>>,
) -> super::report::Csv {
    /// One row: the run's number, its repetition, and what it measured.
    enum Row<'a> {
        Run(usize, usize, &'a Config, &'a Sample),
        Kill(usize, &'a Kill),
        ClientKill(usize, &'a ClientKill),
    }
    let run = |f: fn(&Config, &Sample) -> String| {
        move |r: &Row| match r {
            Row::Run(_, _, c, s) => f(c, s),
            _ => String::new(),
        }
    };
    let rep = |f: fn(&ReplicationMetrics) -> u64| {
        move |r: &Row| match r {
            Row::Run(_, _, _, s) => cell(s.replication.as_ref().map(f)),
            _ => String::new(),
        }
    };
    let echo = |f: fn(&Echo) -> String| {
        move |r: &Row| match r {
            Row::Run(_, _, _, s) => s.echo.as_ref().map(f).unwrap_or_default(),
            _ => String::new(),
        }
    };
    let kill = |f: fn(&Kill) -> String| {
        move |r: &Row| match r {
            Row::Kill(_, k) => f(k),
            _ => String::new(),
        }
    };
    let client = |f: fn(&ClientKill) -> String| {
        move |r: &Row| match r {
            Row::ClientKill(_, k) => f(k),
            _ => String::new(),
        }
    };
    let either = |f: fn(&Kill) -> String, g: fn(&ClientKill) -> String| {
        move |r: &Row| match r {
            Row::Kill(_, k) => f(k),
            Row::ClientKill(_, k) => g(k),
            Row::Run(..) => String::new(),
        }
    };
    let cols = Columns::new()
        .col("measure", |r: &Row| {
            match r {
                Row::Run(..) => "overhead",
                Row::Kill(..) => "failover",
                Row::ClientKill(..) => "failover-client",
            }
            .to_string()
        })
        .col("run", |r| match r {
            Row::Run(i, ..) | Row::Kill(i, _) | Row::ClientKill(i, _) => (i + 1).to_string(),
        })
        .col("rep", |r| match r {
            Row::Run(_, rep, ..) => (rep + 1).to_string(),
            Row::Kill(i, _) | Row::ClientKill(i, _) => (i + 1).to_string(),
        })
        .col("memory_mib", |_| MEMORY_MIB.to_string())
        .col("task", |r| match r {
            Row::Run(_, _, c, _) => c.work.name().to_string(),
            Row::Kill(..) => "fib".into(),
            Row::ClientKill(..) => "udp-counter".into(),
        })
        .col("epoch_ms", |r| match r {
            Row::Run(_, _, c, _) => cell(c.epoch_ms),
            _ => FAILOVER_EPOCH_MS.to_string(),
        })
        .col("wall_ms", run(|_, s| ms(s.wall_ns as f64)))
        .col("guest_task_ms", run(|_, s| ms(s.guest_ns as f64)))
        .col(
            "vcpu_queued_ms",
            run(|_, s| cell(s.queued_ns.map(|n| ms(n as f64)))),
        )
        .col("own_core_ms", run(|_, s| cell(s.own_core_ns().map(ms))))
        .col("epochs_sent", rep(|r| r.epochs_sent))
        .col("epochs_acked", rep(|r| r.epochs_acked))
        .col("epochs_in_task", run(|_, s| cell(s.task_epochs)))
        .col(
            "effective_epoch_ms",
            run(|_, s| cell(s.effective_epoch_ns().map(ms))),
        )
        .col("bytes_sent", rep(|r| r.bytes_sent))
        .col(
            "task_bytes_per_epoch",
            run(|_, s| cell(s.task_bytes_per_epoch().map(|b| format!("{b:.0}")))),
        )
        .col("bytes_per_epoch_median", rep(|r| r.bytes_per_epoch_median))
        .col("bytes_per_epoch_max", rep(|r| r.bytes_per_epoch_max))
        .col("pause_us_median", rep(|r| r.pause_us_median))
        .col("pause_us_p99", rep(|r| r.pause_us_p99))
        .col("pause_us_max", rep(|r| r.pause_us_max))
        .col("echo_rate_per_s", echo(|e| format!("{:.0}", e.rate_per_s)))
        .col("echo_p50_us", echo(|e| format!("{:.0}", e.p50_us)))
        .col("echo_p99_us", echo(|e| format!("{:.0}", e.p99_us)))
        .col("echo_lost", echo(|e| e.lost.to_string()))
        .col(
            "heartbeat_ms",
            either(|_| HEARTBEAT_MS.to_string(), |_| HEARTBEAT_MS.to_string()),
        )
        .col(
            "kill_delay_ms",
            either(|k| k.delay_ms.to_string(), |k| k.delay_ms.to_string()),
        )
        .col(
            "acked_before_kill",
            either(
                |k| k.acked_before.to_string(),
                |k| k.acked_before.to_string(),
            ),
        )
        .col("taken_over_from_epoch", kill(|k| cell(k.taken_from)))
        .col(
            "kill_to_first_kvm_run_ms",
            either(
                |k| ms(k.failover_ns as f64),
                |k| ms(k.to_first_run_ns as f64),
            ),
        )
        .col(
            "kill_to_first_answer_ms",
            client(|k| ms(k.to_answer_ns as f64)),
        )
        .col("answers", client(|k| k.answers.to_string()))
        .col("answers_at_kill", client(|k| k.at_kill.to_string()))
        .col("answers_repeated", client(|k| k.repeated.to_string()))
        .col("answers_skipped", client(|k| k.skipped.to_string()));
    let mut rows: Vec<Row> = runs
        .runs
        .iter()
        .enumerate()
        .map(|(i, (rep, c, s))| Row::Run(i, *rep, &runs.configs[*c], s))
        .collect();
    rows.extend(kills.runs.iter().map(|(rep, _, k)| Row::Kill(*rep, k)));
    if let Some(ck) = client_kills {
        rows.extend(ck.runs.iter().map(|(rep, _, k)| Row::ClientKill(*rep, k)));
    }
    cols.csv(rows)
}

/// Each configuration's summaries.
struct Sums {
    config: Config,
    wall: Option<Summary>,
    own_core: Option<Summary>,
    queued: Option<Summary>,
    guest: Option<Summary>,
    epochs: Option<Summary>,
    effective_epoch: Option<Summary>,
    pause_median: Option<Summary>,
    pause_p99: Option<Summary>,
    pause_max: Option<Summary>,
    bytes_median: Option<Summary>,
    bytes_max: Option<Summary>,
    bytes_task: Option<Summary>,
    echo_rate: Option<Summary>,
    echo_p50: Option<Summary>,
    echo_p99: Option<Summary>,
    echo_lost: u64,
}

impl Sums {
    fn of(config: Config, s: &[&Sample]) -> Sums {
        let f = |g: &dyn Fn(&Sample) -> Option<f64>| -> Option<Summary> {
            Summary::of(&s.iter().filter_map(|x| g(x)).collect::<Vec<f64>>())
        };
        let r =
            |g: fn(&ReplicationMetrics) -> u64| f(&|x| x.replication.as_ref().map(|r| g(r) as f64));
        Sums {
            config,
            wall: f(&|x| Some(x.wall_ns as f64)),
            own_core: f(&Sample::own_core_ns),
            queued: f(&|x| x.queued_ns.map(|n| n as f64)),
            guest: f(&|x| Some(x.guest_ns as f64)),
            epochs: f(&|x| x.task_epochs.map(|n| n as f64)),
            effective_epoch: f(&Sample::effective_epoch_ns),
            pause_median: r(|r| r.pause_us_median),
            pause_p99: r(|r| r.pause_us_p99),
            pause_max: r(|r| r.pause_us_max),
            bytes_median: r(|r| r.bytes_per_epoch_median),
            bytes_max: r(|r| r.bytes_per_epoch_max),
            bytes_task: f(&Sample::task_bytes_per_epoch),
            echo_rate: f(&|x| x.echo.map(|e| e.rate_per_s)),
            echo_p50: f(&|x| x.echo.map(|e| e.p50_us)),
            echo_p99: f(&|x| x.echo.map(|e| e.p99_us)),
            echo_lost: s.iter().filter_map(|x| x.echo.map(|e| e.lost)).sum(),
        }
    }
}

/// The summaries of every configuration, found by what they ran.
struct Found(Vec<Sums>);

impl Found {
    fn of(runs: &Runs<Config, Sample>) -> Found {
        Found(
            runs.configs
                .iter()
                .map(|c| Sums::of(*c, &runs.of(c)))
                .collect(),
        )
    }

    fn find(&self, work: Work, epoch_ms: Option<u64>) -> Option<&Sums> {
        self.0
            .iter()
            .find(|s| s.config.work == work && s.config.epoch_ms == epoch_ms)
    }

    /// The replicated task's time over the same task's unreplicated (ratio of medians),
    /// on its own core (the vCPU's waits for a CPU left out).
    fn slowdown(&self, s: &Sums) -> Option<f64> {
        let base = self.find(s.config.work, None)?.own_core?;
        ratio(s.own_core?.median, base.median)
    }

    /// The same of the host's time as it was, the waits for a CPU in it.
    fn wall_slowdown(&self, s: &Sums) -> Option<f64> {
        let base = self.find(s.config.work, None)?.wall?;
        ratio(s.wall?.median, base.median)
    }

    /// udp-echo's figure `g` (median over the runs) replicated over unreplicated.
    fn echo_ratio(&self, s: &Sums, g: fn(&Sums) -> Option<Summary>) -> Option<f64> {
        let base = g(self.find(Work::UdpEcho, None)?)?;
        ratio(g(s)?.median, base.median)
    }

    fn replicated(&self) -> impl Iterator<Item = &Sums> {
        self.0.iter().filter(|s| s.config.epoch_ms.is_some())
    }
}

fn med(s: Option<Summary>, f: impl Fn(f64) -> String) -> String {
    s.map(|s| f(s.median)).unwrap_or_else(|| "n/a".into())
}

fn us_ms(us: f64) -> String {
    format!("{:.2}", us / 1e3)
}

fn kib(bytes: f64) -> String {
    format!("{:.0}", bytes / 1024.0)
}

/// The overhead table and what its columns measure.
fn print_table(f: &Found) {
    let mut t = Table::new(&[
        "task",
        ">epoch",
        ">task ms (med / min)",
        ">vCPU queued ms",
        ">own core ms",
        ">ratio own core / task",
        ">guest's own ms",
        ">epochs",
        ">effective epoch ms",
        ">pause ms (med / p99 / max)",
        ">KiB per epoch (task / med / max)",
    ]);
    for s in &f.0 {
        let replicated = s.config.epoch_ms.is_some();
        t.row([
            s.config.work.name().to_string(),
            s.config
                .epoch_ms
                .map(|e| format!("{e} ms"))
                .unwrap_or_else(|| "none".into()),
            median_min(s.wall, ms),
            med(s.queued, ms),
            med(s.own_core, ms),
            match (f.slowdown(s), f.wall_slowdown(s)) {
                (Some(a), Some(b)) => format!("{a:.3}x / {b:.3}x"),
                _ => "n/a".into(),
            },
            med(s.guest, ms),
            if replicated {
                med(s.epochs, |x| format!("{x:.0}"))
            } else {
                "-".into()
            },
            if replicated {
                med(s.effective_epoch, ms)
            } else {
                "-".into()
            },
            if replicated {
                format!(
                    "{} / {} / {}",
                    med(s.pause_median, us_ms),
                    med(s.pause_p99, us_ms),
                    med(s.pause_max, us_ms)
                )
            } else {
                "-".into()
            },
            if replicated {
                format!(
                    "{} / {} / {}",
                    med(s.bytes_task, kib),
                    med(s.bytes_median, kib),
                    med(s.bytes_max, kib)
                )
            } else {
                "-".into()
            },
        ]);
    }
    println!();
    print!("{}", t.render());
    print!("{}", TABLE_NOTES);
}

const TABLE_NOTES: &str = "\
medians over the runs. task ms: the host's time from the guest's answer to the line typed
  into its console once the standby protects it (at once unreplicated) to the task's result
  line, the pauses included. vCPU queued: of that, the time the vCPU thread was runnable but
  waited for a CPU (its schedstat); own core: task ms less it, the task's time on a core of
  its own, pauses and dirty-log faults still in it. On this shared host a VM that runs
  without a pause waits for a CPU much more than one that sleeps every epoch (the
  scheduler favours a thread that wakes), so task ms alone reads a replicated VM as faster.
  ratio: replicated over unreplicated, medians, on its own core / as measured. guest's own
  ms: the task's ns, which leaves the pauses out (a checkpoint's resume sets the TSC back).
  epochs: checkpoints sent from the task's start to the VM's end; effective epoch: task ms
  over those, the epoch the link allowed (one epoch is in flight at a time, so a large one
  makes the next wait). pause: the vCPUs stopped for a checkpoint (state read, dirty pages
  copied, resumed), each run's median, 99th percentile and longest over its last 1024
  epochs (boot included), the median of those over the runs; KiB per epoch: pages and
  state sent, the mean over the task's epochs, and each run's median and largest over all
  (the largest is often the first, every page with data).
";

/// The failover figures over every kill.
struct KillSums {
    n: usize,
    failover: Option<Summary>,
}

fn kill_sums(kills: &Runs<String, Kill>) -> KillSums {
    let v: Vec<f64> = kills
        .runs
        .iter()
        .map(|(_, _, k)| k.failover_ns as f64)
        .collect();
    KillSums {
        n: v.len(),
        failover: Summary::of(&v),
    }
}

fn print_failover(k: &KillSums, kills: &Runs<String, Kill>, early: &[String]) {
    let mut t = Table::new(&[
        "failover",
        ">kills",
        ">to first KVM_RUN ms (med / min / max)",
    ]);
    t.row([
        format!("fib, {FAILOVER_EPOCH_MS} ms epoch, heartbeat {HEARTBEAT_MS} ms"),
        k.n.to_string(),
        k.failover
            .map(|s| format!("{} / {} / {}", ms(s.median), ms(s.min), ms(s.max)))
            .unwrap_or_else(|| "n/a".into()),
    ]);
    println!();
    print!("{}", t.render());
    let each: Vec<String> = kills
        .runs
        .iter()
        .map(|(_, _, k)| ms(k.failover_ns as f64))
        .collect();
    println!("each kill, ms: {}", each.join(" "));
    println!(
        "standbys that took over from a live primary (silent past the {HEARTBEAT_MS} ms heartbeat), each run again: {}",
        early.len()
    );
    for why in early {
        println!("  {why}");
    }
    print!("{}", FAILOVER_NOTES);
}

const FAILOVER_NOTES: &str = "\
failover: from the bench's CLOCK_MONOTONIC read right before kill(2) of the primary to
  the standby process's first KVM_RUN (sys_enter_ioctl tracepoint, same clock, to the
  microsecond); the standby sees the link close at once, so it does not wait out the
  heartbeat. Each standby then ended fib with its exact value and did not boot again.
";

/// The client's failover figures over every kill.
struct ClientSums {
    n: usize,
    to_answer: Option<Summary>,
    to_first_run: Option<Summary>,
    repeated: u64,
    skipped: u64,
    /// Kills after which some answers were missing.
    kills_with_gaps: usize,
}

fn client_sums(kills: &Runs<String, ClientKill>) -> ClientSums {
    let all: Vec<&ClientKill> = kills.runs.iter().map(|(_, _, k)| k).collect();
    let of = |f: fn(&ClientKill) -> u64| {
        Summary::of(&all.iter().map(|k| f(k) as f64).collect::<Vec<f64>>())
    };
    ClientSums {
        n: all.len(),
        to_answer: of(|k| k.to_answer_ns),
        to_first_run: of(|k| k.to_first_run_ns),
        repeated: all.iter().map(|k| k.repeated).sum(),
        skipped: all.iter().map(|k| k.skipped).sum(),
        kills_with_gaps: all.iter().filter(|k| k.skipped > 0).count(),
    }
}

fn print_client_failover(c: &ClientSums, kills: &Runs<String, ClientKill>, early: &[String]) {
    let mmm = |s: Option<Summary>| {
        s.map(|s| format!("{} / {} / {}", ms(s.median), ms(s.min), ms(s.max)))
            .unwrap_or_else(|| "n/a".into())
    };
    let mut t = Table::new(&[
        "failover, udp-counter client",
        ">kills",
        ">to first answer ms (med / min / max)",
        ">to first KVM_RUN ms (med / min / max)",
        ">answers repeated",
        ">answers skipped (kills)",
    ]);
    t.row([
        format!("{FAILOVER_EPOCH_MS} ms epoch, heartbeat {HEARTBEAT_MS} ms"),
        c.n.to_string(),
        mmm(c.to_answer),
        mmm(c.to_first_run),
        c.repeated.to_string(),
        format!("{} ({})", c.skipped, c.kills_with_gaps),
    ]);
    println!();
    print!("{}", t.render());
    let each: Vec<String> = kills
        .runs
        .iter()
        .map(|(_, _, k)| {
            let gap = if k.skipped > 0 || k.repeated > 0 {
                format!(" ({} skipped, {} repeated)", k.skipped, k.repeated)
            } else {
                String::new()
            };
            format!("{}{gap}", ms(k.to_answer_ns as f64))
        })
        .collect();
    println!("each kill, ms to the first answer: {}", each.join(" "));
    println!(
        "standbys that took over from a live primary, each run again: {}",
        early.len()
    );
    for why in early {
        println!("  {why}");
    }
    print!("{}", CLIENT_NOTES);
}

const CLIENT_NOTES: &str = "\
failover with a client: the guest runs udp-counter (each datagram answered with the next
  value of a counter in guest RAM) on the primary's TAP; the client, in a third namespace
  bridged to both hosts', asks every few ms and asks again after 40 ms without an answer.
  To first answer: from kill(2) to the first answer that came after the standby's first
  KVM_RUN (answers the primary released before it died can still be on the wire after the
  kill). Repeated: an answer not above the one before; skipped: numbers never seen between
  those seen, over every kill's whole run (goal 0 for both).
";

fn print_echo(f: &Found) {
    let mut t = Table::new(&[
        "udp-echo",
        ">epoch",
        ">rounds/s",
        ">x unrepl.",
        ">p50 us",
        ">x unrepl.",
        ">p99 us",
        ">x unrepl.",
        ">lost",
    ]);
    let x = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or("n/a".into());
    for s in f.0.iter().filter(|s| s.config.work == Work::UdpEcho) {
        t.row([
            "udp-echo".to_string(),
            s.config
                .epoch_ms
                .map(|e| format!("{e} ms"))
                .unwrap_or_else(|| "none".into()),
            med(s.echo_rate, |v| format!("{v:.0}")),
            x(f.echo_ratio(s, |s| s.echo_rate)),
            med(s.echo_p50, |v| format!("{v:.0}")),
            x(f.echo_ratio(s, |s| s.echo_p50)),
            med(s.echo_p99, |v| format!("{v:.0}")),
            x(f.echo_ratio(s, |s| s.echo_p99)),
            s.echo_lost.to_string(),
        ]);
    }
    println!();
    print!("{}", t.render());
    print!("{}", ECHO_NOTES);
}

const ECHO_NOTES: &str = "\
udp-echo: the probe's own figures (64-byte request, its answer awaited before the next),
  medians over the runs, against a peer in the client's namespace over the bridges. A
  replicated guest's request is held with the rest of its epoch's output until the
  standby acknowledges that epoch, so a round trip grows by about the epoch (half of it
  waiting for the checkpoint on average, then the checkpoint's send and acknowledgement),
  and the rate falls with it.
";

/// The failover goal's verdicts, on the median and the longest of `n` kills, each the time
/// from the SIGKILL to `to`.
fn judge_failover(v: &mut Verdicts, n: usize, to: &str, times: Option<Summary>) {
    for (what, x) in [
        ("median", times.map(|s| s.median)),
        ("max", times.map(|s| s.max)),
    ] {
        v.judged(
            format!("failover ({what} of {n}), SIGKILL to {to}, heartbeat {HEARTBEAT_MS} ms"),
            x.map(|ns| ns / 1e6),
            |x| format!("{x:.2} ms"),
            format!("<= {GOAL_FAILOVER_MS} ms"),
            GOAL_SOURCE,
            |x| x <= GOAL_FAILOVER_MS,
        );
    }
}

/// The goals, and Remus beside the failover.
fn verdicts(
    f: &Found,
    k: &KillSums,
    c: Option<&ClientSums>,
    unavailable: Option<&str>,
) -> Verdicts {
    let mut v = Verdicts::new();
    let fib20 = f.find(Work::Fib, Some(20));
    v.judged(
        "fib task time on its own core, replicated / unreplicated, 20 ms epoch",
        fib20.and_then(|s| f.slowdown(s)),
        |r| format!("{r:.3}x"),
        format!("<= {GOAL_FIB_RATIO:.2}x"),
        GOAL_SOURCE,
        |r| r <= GOAL_FIB_RATIO,
    );
    let wall = fib20.and_then(|s| f.wall_slowdown(s));
    v.compared(
        "fib task time as measured (vCPU's waits for a CPU in it), 20 ms epoch",
        wall.map(|r| format!("{r:.3}x"))
            .unwrap_or_else(|| "n/a".into()),
    );
    for (what, g) in [
        (
            "median",
            (|s: &Sums| s.pause_median) as fn(&Sums) -> Option<Summary>,
        ),
        ("p99", |s: &Sums| s.pause_p99),
    ] {
        v.judged(
            format!("pause per epoch ({what}), {MEMORY_MIB} MiB, little dirty (fib), 20 ms epoch"),
            fib20.and_then(g).map(|s| s.median / 1e3),
            |x| format!("{x:.2} ms"),
            format!("<= {GOAL_PAUSE_MS} ms"),
            GOAL_SOURCE,
            |x| x <= GOAL_PAUSE_MS,
        );
    }
    judge_failover(&mut v, k.n, "standby's first KVM_RUN", k.failover);
    v.judged(
        "failover (median), Musubi to first KVM_RUN beside Remus",
        k.failover.map(|s| s.median / 1e6),
        |x| format!("{x:.2} ms"),
        format!("~{REMUS_FAILOVER_MS} ms"),
        "Remus, NSDI 2008",
        |x| x < REMUS_FAILOVER_MS,
    );
    match c {
        Some(c) => {
            judge_failover(&mut v, c.n, "the client's first answer", c.to_answer);
            for (what, n) in [("repeated", c.repeated), ("skipped", c.skipped)] {
                v.judged(
                    format!("udp-counter answers {what} over {} kills", c.n),
                    Some(n as f64),
                    |x| format!("{x:.0}"),
                    "0".to_string(),
                    GOAL_SOURCE,
                    |x| x == 0.0,
                );
            }
        }
        None => {
            for (what, reference) in [
                (
                    "failover, SIGKILL to the client's first answer",
                    format!("<= {GOAL_FAILOVER_MS} ms"),
                ),
                (
                    "udp-counter answers repeated or skipped over every kill",
                    "0".to_string(),
                ),
            ] {
                v.push(Figure {
                    what: what.into(),
                    ours: format!("unavailable: {}", unavailable.unwrap_or("not run")),
                    reference,
                    source: GOAL_SOURCE.into(),
                    met: None,
                });
            }
        }
    }
    v
}

/// The chart: the slowdown, the pauses and bytes per epoch, and the failover.
fn panels(f: &Found, k: &KillSums, c: Option<&ClientSums>) -> Vec<plot::Panel> {
    let name = |s: &Sums| s.config.name();
    let replicated = |g: fn(&Sums) -> Option<Summary>, scale: f64| -> Vec<plot::Bar> {
        summary_bars(
            f.replicated().map(|s| (s, g(s).map(|x| x.scaled(scale)))),
            name,
        )
    };
    // udp-echo's task time is its epochs' waits: its own panel shows its round trips.
    let compute = |s: &&Sums| s.config.work != Work::UdpEcho;
    let slowdown: Vec<plot::Bar> = f
        .replicated()
        .filter(compute)
        .flat_map(|s| {
            [
                f.slowdown(s).map(|r| plot::Bar {
                    label: format!("{}, own core", name(s)),
                    value: r,
                    low: None,
                }),
                f.wall_slowdown(s).map(|r| plot::Bar {
                    label: format!("{}, as measured", name(s)),
                    value: r,
                    low: None,
                }),
            ]
        })
        .flatten()
        .collect();
    let mut pauses = Vec::new();
    for s in f.replicated() {
        for (what, x) in [("median", s.pause_median), ("p99", s.pause_p99)] {
            if let Some(x) = x {
                pauses.push(plot::Bar {
                    label: format!("{} {what}", name(s)),
                    value: x.median / 1e3,
                    low: None,
                });
            }
        }
    }
    let median_max = |what: &str, n: usize, s: Option<Summary>| -> Vec<plot::Bar> {
        s.map(|s| {
            vec![
                plot::Bar {
                    label: format!("{what}, median of {n} kills"),
                    value: s.median / 1e6,
                    low: Some(s.min / 1e6),
                },
                plot::Bar {
                    label: format!("{what}, max of {n} kills"),
                    value: s.max / 1e6,
                    low: None,
                },
            ]
        })
        .unwrap_or_default()
    };
    let mut failover = median_max("fib: first KVM_RUN", k.n, k.failover);
    if let Some(c) = c {
        failover.extend(median_max(
            "udp-counter: first KVM_RUN",
            c.n,
            c.to_first_run,
        ));
        failover.extend(median_max(
            "udp-counter: client's first answer",
            c.n,
            c.to_answer,
        ));
    }
    let mut echo = Vec::new();
    for s in f.0.iter().filter(|s| s.config.work == Work::UdpEcho) {
        for (what, x) in [("p50", s.echo_p50), ("p99", s.echo_p99)] {
            if let Some(x) = x {
                echo.push(plot::Bar {
                    label: format!("{} {what}", name(s)),
                    value: x.median / 1e3,
                    low: None,
                });
            }
        }
    }
    vec![
        plot::Panel {
            title: "task time, replicated / unreplicated (ratio of medians; own core: less the vCPU's waits for a CPU)".into(),
            unit: "x".into(),
            bars: slowdown,
        },
        plot::Panel {
            title: "task time on its own core (median, min)".into(),
            unit: "ms".into(),
            bars: summary_bars(
                f.0.iter()
                    .filter(compute)
                    .map(|s| (s, s.own_core.map(|x| x.scaled(1e-6)))),
                name,
            ),
        },
        plot::Panel {
            title: "pause per epoch, median and p99 (median over the runs)".into(),
            unit: "ms".into(),
            bars: pauses,
        },
        plot::Panel {
            title: "bytes per epoch during the task (median, min over the runs)".into(),
            unit: "KiB".into(),
            bars: replicated(|s| s.bytes_task, 1.0 / 1024.0),
        },
        plot::Panel {
            title: format!(
                "failover, SIGKILL to the standby's first KVM_RUN and to the client's first answer (heartbeat {HEARTBEAT_MS} ms)"
            ),
            unit: "ms".into(),
            bars: failover,
        },
        plot::Panel {
            title: "udp-echo round trip, p50 and p99 (median over the runs)".into(),
            unit: "ms".into(),
            bars: echo,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fib_values_are_the_probes() {
        assert_eq!(fib_value(0), 0);
        assert_eq!(fib_value(1), 1);
        assert_eq!(fib_value(25), 75025);
        assert_eq!(fib_value(46), 1_836_311_903);
    }

    #[test]
    fn repeats_and_gaps_are_counted_over_the_whole_run() {
        assert_eq!(repeats_and_gaps(&[1, 2, 3, 4]), (0, 0));
        assert_eq!(repeats_and_gaps(&[]), (0, 0));
        // 4 and 5 lost at a failover, then 6 given twice, then 5 after 7 (went back).
        assert_eq!(repeats_and_gaps(&[1, 2, 3, 6, 6, 7, 5, 8]), (2, 2));
        // The first answer must be 1: answers before it count as skipped.
        assert_eq!(repeats_and_gaps(&[3, 4]), (0, 2));
    }

    #[test]
    fn without_the_namespaces_the_client_goals_say_why_they_are_not_judged() {
        let k = KillSums {
            n: 0,
            failover: None,
        };
        let why = "making network namespaces needs root";
        let shown = verdicts(&Found(Vec::new()), &k, None, Some(why)).table();
        assert!(shown.contains(&format!("unavailable: {why}")), "{shown}");
        assert!(
            shown.contains("SIGKILL to the client's first answer"),
            "{shown}"
        );
    }

    #[test]
    fn kill_moments_spread_over_their_range() {
        let mut s = 12345u64;
        let v: Vec<u64> = (0..200).map(|_| xorshift(&mut s) % 401).collect();
        assert!(v.iter().all(|&x| x <= 400));
        assert!(
            v.iter().any(|&x| x < 100) && v.iter().any(|&x| x > 300),
            "{v:?}"
        );
    }

    #[test]
    fn the_slowdown_is_against_the_same_task_unreplicated_each_on_its_own_core() {
        let mk = |work, epoch_ms, runs: &[(u64, u64)]| {
            let s: Vec<Sample> = runs
                .iter()
                .map(|&(wall_ns, queued)| Sample {
                    wall_ns,
                    guest_ns: wall_ns,
                    queued_ns: Some(queued),
                    replication: None,
                    task_epochs: None,
                    task_bytes: None,
                    echo: None,
                })
                .collect();
            Sums::of(Config { work, epoch_ms }, &s.iter().collect::<Vec<_>>())
        };
        // Unreplicated, the vCPU waited long for a CPU; replicated, it slept every epoch and
        // waited little: faster as measured, 5% slower on a core of its own.
        let f = Found(vec![
            mk(Work::Fib, None, &[(100, 40), (90, 30), (110, 50)]),
            mk(Work::Fib, Some(20), &[(70, 7), (200, 100), (66, 3)]),
            mk(Work::MemCheck, None, &[(10, 0)]),
        ]);
        let fib20 = f.find(Work::Fib, Some(20)).unwrap();
        assert_eq!(f.slowdown(fib20), Some(1.05));
        assert_eq!(f.wall_slowdown(fib20), Some(0.7));
        assert!(f.find(Work::MemCheck, Some(20)).is_none());
        assert_eq!(f.replicated().count(), 1);
    }
}
