//! `musubi bench vsock`: virtio-vsock through the hybrid UNIX-socket host side, Musubi
//! beside Firecracker on the same probe guest: 64-byte round trips host→guest→host, a large
//! buffer echoed through the guest (host→guest→host throughput), and a guest→host stream
//! checked by byte count and CRC-32, with Musubi's exits, doorbells and interrupts per MB.
//!
//! Each run boots the guest twice, `vsock-echo` for the round trips and the echo (one
//! connection) and `vsock-send` for the stream, so the VMM's counters of a boot belong to
//! one kind of load. The host's ends are threads of this program on the VM's socket.

use super::driver::{
    chart_title, contender_rows, measure_contenders, measured_per_config, print_dropped,
    summary_bars, warm_up, Columns, Contender, ContenderRuns, Missing, Outputs, Verdicts,
};
use super::peers::{self, Micro};
use super::probe::Ending;
use super::report::{cell, Csv, Table};
use super::stats::{percentile, ratio, Summary};
use super::{plot, BenchArgs, Harness};
use musubi_types::Metrics;
use serde_json::Value;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CID: u32 = 3;
const ECHO_PORT: u32 = 52;
const SEND_PORT: u32 = 5000;
const MEMORY_MIB: u64 = 128;
/// The round trips' message: a small request, as on a control channel.
const MESSAGE: usize = 64;
/// One boot with its task, on a loaded two-core machine; a hung VM fails its run here.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
/// Lines of a VMM's output quoted when a run fails.
const LINES: usize = 10;
const MB: f64 = 1e6;

/// The goal: Musubi's throughput, both ways, at least Firecracker's in the same run.
const GOAL_STREAM: f64 = 1.0;
const GOAL_SOURCE: &str = "Musubi goal, same run";

/// How much each run moves.
#[derive(Clone, Copy, Debug)]
struct Load {
    rounds: u64,
    echo_bytes: u64,
    send_bytes: u64,
}

/// Some seconds a run on this machine (round trips of 30 to 180 µs, streams of 50 to 350
/// MB/s, moving by a factor of two between runs as the host's other load comes and goes):
/// long enough that the boot is a small part of the VMM's counts, short enough that 5 runs
/// of both VMMs take a couple of minutes.
const FULL: Load = Load {
    rounds: 10_000,
    echo_bytes: 64 << 20,
    send_bytes: 256 << 20,
};
const QUICK: Load = Load {
    rounds: 50,
    echo_bytes: 256 << 10,
    send_bytes: 1 << 20,
};
/// The discarded first run of each VMM: page cache and the peer's availability.
const WARM_UP: Load = Load {
    rounds: 20,
    echo_bytes: 64 << 10,
    send_bytes: 256 << 10,
};

#[derive(Clone, Debug)]
enum Vmm {
    Musubi { exe: PathBuf, elf: PathBuf },
    Firecracker { micro: Micro },
}

impl Contender for Vmm {
    fn name(&self) -> String {
        match self {
            Vmm::Musubi { .. } => "musubi".into(),
            Vmm::Firecracker { .. } => "firecracker".into(),
        }
    }

    fn is_peer(&self) -> bool {
        !matches!(self, Vmm::Musubi { .. })
    }
}

impl Vmm {
    /// The VMM booting the probe guest with `cmdline` and a vsock device of cid 3 whose
    /// host side listens at `socket`, its console on stdout, its files in `dir` (Musubi's
    /// counters in `metrics.json`).
    fn command(&self, cmdline: &str, socket: &Path, dir: &Path) -> Result<Command, String> {
        Ok(match self {
            Vmm::Musubi { exe, elf } => {
                let mut cmd = Command::new(exe);
                cmd.args(["run", "--kernel"])
                    .arg(elf)
                    .args(["--cmdline", cmdline])
                    .args(["--memory", &format!("{MEMORY_MIB}M")])
                    .arg("--vsock")
                    .arg(format!("cid={CID},socket={}", socket.display()))
                    .arg("--metrics")
                    .arg(dir.join("metrics.json"));
                cmd
            }
            Vmm::Firecracker { micro } => micro.firecracker_with(
                dir,
                cmdline,
                MEMORY_MIB,
                (
                    "vsock",
                    serde_json::json!({"guest_cid": CID, "uds_path": socket}),
                ),
            )?,
        })
    }

    fn ending(&self) -> Ending {
        match self {
            Vmm::Musubi { .. } => Ending::Status(0),
            // No exit port: it is stopped once the result line is out.
            Vmm::Firecracker { .. } => Ending::AtResult,
        }
    }
}

/// Musubi's own counts over one boot (`--metrics`), boot included.
#[derive(Clone, Copy, Debug)]
struct VmmCounts {
    exits: f64,
    /// Queue notifications, through an ioeventfd or an MMIO exit.
    doorbells: f64,
    /// Interrupts raised, through an irqfd or from user space.
    interrupts: f64,
}

impl VmmCounts {
    fn read(path: &Path) -> Result<VmmCounts, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("musubi's --metrics {}: {e}", path.display()))?;
        let m: Metrics = serde_json::from_str(&text)
            .map_err(|e| format!("musubi's --metrics {}: {e}", path.display()))?;
        let irqs = m.interrupts.irqfd.unwrap_or(0) + m.interrupts.user.unwrap_or(0);
        Ok(VmmCounts {
            exits: m.total_exits as f64,
            doorbells: (m.notifications.ioeventfd + m.notifications.mmio_exit) as f64,
            interrupts: irqs as f64,
        })
    }

    /// Each count per MB of `bytes`.
    fn per_mb(&self, bytes: u64) -> [Option<f64>; 3] {
        let mb = bytes as f64 / MB;
        [self.exits, self.doorbells, self.interrupts].map(|n| ratio(n, mb))
    }
}

#[derive(Clone, Debug)]
struct Sample {
    rounds: u64,
    rtt_p50_us: f64,
    rtt_p99_us: f64,
    /// Bytes the host sent through the echo and read back equal, as the guest counted them.
    echoed_bytes: u64,
    /// The large buffer's echo: its bytes over the time from the first written to the last
    /// read back.
    echo_mb_s: f64,
    echo_vmm: Option<VmmCounts>,
    /// Bytes the guest says it sent, and those the host's listener read.
    send_bytes: u64,
    sink_bytes: u64,
    crc32: String,
    /// The host's time, from its accept to the stream's end.
    send_mb_s: f64,
    /// The guest's own, from its REQUEST to the device's RST.
    send_guest_mb_s: f64,
    send_vmm: Option<VmmCounts>,
}

/// The runs of every VMM; a peer's may have failed or not been made.
type VsockRuns = ContenderRuns<Vmm, Sample>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let listed = peers::parse_compare(args.compare.as_deref())?;
    let load = if h.quick { QUICK } else { FULL };
    let reps = if h.quick { 1 } else { 5 };
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    println!(
        "vsock: probe guest, 1 vCPU, {MEMORY_MIB} MiB, virtio-vsock (cid {CID}) with the hybrid \
         UNIX-socket host side; the host's ends are threads of this program"
    );
    println!(
        "  vsock-echo: {} round trips of {MESSAGE} bytes, then an echo of {} MiB; vsock-send: \
         {} MiB to the host; one boot each;",
        load.rounds,
        load.echo_bytes as f64 / (1u64 << 20) as f64,
        load.send_bytes as f64 / (1u64 << 20) as f64
    );
    println!("  {reps} run(s) per hypervisor, interleaved, after one discarded warm-up run each");
    let mut configs = vec![Vmm::Musubi {
        exe,
        elf: elf.clone(),
    }];
    let mut missing = Missing::new();
    if let Some(micro) = peers::firecracker_peer(args, &listed, &elf, &h.out, &mut missing) {
        configs.push(Vmm::Firecracker { micro });
    }
    if listed.contains(&"cloud-hypervisor") {
        println!("cloud-hypervisor: not compared here (its hybrid vsock is on PCI only, and the probe guest finds virtio-mmio devices)");
    }
    if listed.contains(&"qemu") {
        println!(
            "qemu: not compared here (it has vhost-vsock, not the hybrid UNIX-socket host side)"
        );
    }
    let standing = warm_up(&configs, &mut missing, |c| one_run(c, WARM_UP))?;
    let (runs, standing) = measure_contenders(h, configs, standing, reps, |c| one_run(c, load))?;
    let csv_path = Outputs::new(h).csv("vsock.csv", &csv(&runs, &missing))?;
    let sums: Vec<Sums> = measured_per_config(&runs)
        .iter()
        .map(|s| Sums::of(s))
        .collect();
    let configs = &runs.configs;
    print_table(configs, &sums);
    print_dropped(configs, &standing, &missing);
    println!();
    print!("{}", verdicts(configs, &sums).table());
    println!("  (\"not measured\" when Firecracker did not run)");
    println!();
    println!(
        "Guest kernel-mode work is emulated on these machines (DESIGN.md, \"The machines here\"; \
         guest/README.md,"
    );
    println!(
        "  \"Cost on the development machines\"): every interrupt and SYS_NET_WAIT of the probe's \
         driver runs in KVM's"
    );
    println!(
        "  instruction emulator, for every VMM alike, so absolute rates are low for both; read the \
         ratios."
    );
    let (title, panels) = chart(configs, &sums, &missing);
    let svg_path = Outputs::new(h).bars("vsock.svg", &title, &panels)?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

/// One run: a boot for the round trips and the echo, then one for the stream.
fn one_run(c: &Vmm, load: Load) -> Result<Sample, String> {
    let echo = echo_boot(c, load)?;
    let send = send_boot(c, load.send_bytes)?;
    Ok(Sample {
        rounds: load.rounds,
        rtt_p50_us: echo.p50_us,
        rtt_p99_us: echo.p99_us,
        echoed_bytes: echo.guest_bytes,
        echo_mb_s: load.echo_bytes as f64 / MB / echo.echo_s,
        echo_vmm: echo.vmm,
        send_bytes: send.guest_bytes,
        sink_bytes: send.sink_bytes,
        crc32: send.crc32,
        send_mb_s: send.sink_bytes as f64 / MB / send.sink_s,
        send_guest_mb_s: send.guest_bytes as f64 / MB / send.guest_s,
        send_vmm: send.vmm,
    })
}

/// A thread of this program serving one boot's host end, told to give up when the boot
/// has ended without it.
struct HostEnd<T> {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<T, String>>,
}

impl<T: Send + 'static> HostEnd<T> {
    fn spawn(f: impl FnOnce(&AtomicBool) -> Result<T, String> + Send + 'static) -> HostEnd<T> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        HostEnd {
            stop,
            thread: std::thread::spawn(move || f(&flag)),
        }
    }

    fn finish(self) -> Result<T, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .unwrap_or_else(|_| Err("the host's end panicked".into()))
    }
}

/// Boots the guest with `task` and its vsock at `dir/v.sock` while `host` serves the
/// host's end: the task's result, the host's, and Musubi's counts.
fn boot<T: Send + 'static>(
    c: &Vmm,
    dir: &Path,
    task: &str,
    name: &str,
    host: HostEnd<T>,
) -> Result<(Value, T, Option<VmmCounts>), String> {
    let socket = dir.join("v.sock");
    let result = c
        .command(&format!("probe.tasks={task}"), &socket, dir)
        .and_then(|cmd| {
            crate::probe::task_result(&c.name(), cmd, name, c.ending(), RUN_TIMEOUT, LINES)
        });
    let served = host.finish();
    // The VM's failure says more than the host's end that waited for it.
    let result = result?;
    let served = served?;
    let counts = match c {
        Vmm::Musubi { .. } => Some(VmmCounts::read(&dir.join("metrics.json"))?),
        Vmm::Firecracker { .. } => None,
    };
    Ok((result, served, counts))
}

fn temp_dir() -> Result<tempfile::TempDir, String> {
    tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))
}

fn num(r: &Value, k: &str) -> Result<f64, String> {
    r[k].as_f64().ok_or_else(|| format!("no {k} in {r}"))
}

struct Echoed {
    p50_us: f64,
    p99_us: f64,
    echo_s: f64,
    guest_bytes: u64,
    vmm: Option<VmmCounts>,
}

/// The round trips, then the large echo, on one connection to the guest's `vsock-echo`.
fn echo_boot(c: &Vmm, load: Load) -> Result<Echoed, String> {
    let dir = temp_dir()?;
    let socket = dir.path().join("v.sock");
    let host = HostEnd::spawn(move |stop| echo_client(&socket, load, stop));
    let task = format!("vsock-echo={ECHO_PORT}");
    let (r, (rtts, echo_s), vmm) = boot(c, dir.path(), &task, "vsock-echo", host)?;
    let want = load.rounds * MESSAGE as u64 + load.echo_bytes;
    let guest_bytes = num(&r, "bytes")? as u64;
    if guest_bytes != want || num(&r, "connections")? != 1.0 {
        return Err(format!(
            "vsock-echo: the host sent {want} bytes on one connection, the guest says {r}"
        ));
    }
    let p = |pct| percentile(&rtts, pct).ok_or_else(|| "no round trips".to_string());
    Ok(Echoed {
        p50_us: p(50.0)?,
        p99_us: p(99.0)?,
        echo_s,
        guest_bytes,
        vmm,
    })
}

/// Connects to the guest's listener (again and again until it listens: a CONNECT before
/// the guest's driver is up is reset or times out), makes the round trips, each timed, then
/// echoes one large buffer: the round trips in µs and the echo's time in s.
fn echo_client(socket: &Path, load: Load, stop: &AtomicBool) -> Result<(Vec<f64>, f64), String> {
    let t0 = Instant::now();
    let mut s = loop {
        if stop.load(Ordering::Relaxed) || t0.elapsed() > RUN_TIMEOUT {
            return Err(format!(
                "no CONNECT {ECHO_PORT} on {} was answered OK",
                socket.display()
            ));
        }
        if let Ok((s, line)) = testkit::vsock::connect(socket, ECHO_PORT, RUN_TIMEOUT) {
            if line.starts_with("OK ") {
                break s;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let failed = |what: &str, e: std::io::Error| format!("the echo's {what}: {e}");
    let msg: Vec<u8> = (0..MESSAGE).map(|i| (i * 7 % 253) as u8).collect();
    let mut back = [0u8; MESSAGE];
    let mut rtts = Vec::with_capacity(load.rounds as usize);
    for round in 0..load.rounds {
        let t = Instant::now();
        s.write_all(&msg).map_err(|e| failed("request", e))?;
        s.read_exact(&mut back).map_err(|e| failed("answer", e))?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
        if back[..] != msg[..] {
            return Err(format!("round trip {round} came back changed"));
        }
    }
    let data: Vec<u8> = (0..load.echo_bytes).map(|i| (i % 251) as u8).collect();
    let t = Instant::now();
    let got = testkit::vsock::echo_round_trip(&mut s, &data).map_err(|e| failed("stream", e))?;
    let echo_s = t.elapsed().as_secs_f64();
    if got != data {
        return Err("the large echo came back changed".into());
    }
    Ok((rtts, echo_s))
}

struct Sent {
    guest_bytes: u64,
    sink_bytes: u64,
    crc32: String,
    sink_s: f64,
    guest_s: f64,
    vmm: Option<VmmCounts>,
}

/// The guest's stream to the listener at `v.sock_5000`, its bytes counted and its CRC-32
/// checked against the guest's and against the pattern's.
fn send_boot(c: &Vmm, bytes: u64) -> Result<Sent, String> {
    let dir = temp_dir()?;
    let path = dir.path().join(format!("v.sock_{SEND_PORT}"));
    let listener = UnixListener::bind(&path)
        .map_err(|e| format!("cannot listen at {}: {e}", path.display()))?;
    let host = HostEnd::spawn(move |stop| sink(listener, bytes, stop));
    let task = format!("vsock-send={SEND_PORT},bytes={bytes}");
    let (r, (sink_bytes, crc, sink_s), vmm) = boot(c, dir.path(), &task, "vsock-send", host)?;
    let guest_bytes = num(&r, "bytes")? as u64;
    let crc32 = format!("{crc:#010x}");
    let mut pattern = crc32fast::Hasher::new();
    let chunk: Vec<u8> = (0..251 * 4096).map(|i| (i % 251) as u8).collect();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64);
        pattern.update(&chunk[..n as usize]);
        left -= n;
    }
    let expected = format!("{:#010x}", pattern.finalize());
    if guest_bytes != bytes || sink_bytes != bytes || r["crc32"] != crc32 || crc32 != expected {
        return Err(format!(
            "vsock-send: asked for {bytes} bytes (CRC-32 {expected}); the guest says {r}, the \
             host read {sink_bytes} (CRC-32 {crc32})"
        ));
    }
    Ok(Sent {
        guest_bytes,
        sink_bytes,
        crc32,
        sink_s,
        guest_s: num(&r, "us")? / 1e6,
        vmm,
    })
}

/// Takes the guest's one connection and reads it to its end, for at most a run's time and
/// not beyond `bytes`: the bytes, their CRC-32 and the seconds from the accept to the end.
fn sink(l: UnixListener, bytes: u64, stop: &AtomicBool) -> Result<(u64, u32, f64), String> {
    l.set_nonblocking(true)
        .map_err(|e| format!("the stream's listener: {e}"))?;
    let t0 = Instant::now();
    let mut s = loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() != ErrorKind::WouldBlock => {
                return Err(format!("the stream's listener: {e}"))
            }
            Err(_) if stop.load(Ordering::Relaxed) || t0.elapsed() > RUN_TIMEOUT => {
                return Err("the guest never connected to the stream's listener".into())
            }
            Err(_) => std::thread::sleep(Duration::from_micros(200)),
        }
    };
    let t = Instant::now();
    s.set_nonblocking(false)
        .and_then(|()| s.set_read_timeout(Some(RUN_TIMEOUT)))
        .map_err(|e| format!("the stream: {e}"))?;
    let (mut total, mut crc, mut buf) = (0u64, crc32fast::Hasher::new(), vec![0u8; 1 << 16]);
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok((total, crc.finalize(), t.elapsed().as_secs_f64())),
            Ok(n) => {
                crc.update(&buf[..n]);
                total += n as u64;
                if total > bytes {
                    return Err(format!("the stream ran past {bytes} bytes"));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("the stream stopped after {total} bytes: {e}")),
        }
    }
}

/// `vsock.csv`: a row per run made, and one per peer that never ran.
fn csv(runs: &VsockRuns, missing: &Missing) -> Csv {
    let f1 = |x: f64| format!("{x:.1}");
    let per_mb = |g: fn(&Sample) -> (Option<VmmCounts>, u64), i: usize| {
        move |s: &Sample| {
            let (v, bytes) = g(s);
            cell(
                v.and_then(|v| v.per_mb(bytes)[i])
                    .map(|x| format!("{x:.1}")),
            )
        }
    };
    let echo = |s: &Sample| (s.echo_vmm, s.echoed_bytes);
    let send = |s: &Sample| (s.send_vmm, s.send_bytes);
    let cols = Columns::new()
        .run_heads()
        .measured("rounds", |s: &Sample| s.rounds.to_string())
        .measured("rtt_p50_us", move |s| f1(s.rtt_p50_us))
        .measured("rtt_p99_us", move |s| f1(s.rtt_p99_us))
        .measured("echoed_bytes", |s| s.echoed_bytes.to_string())
        .measured("echo_mb_s", move |s| f1(s.echo_mb_s))
        .measured("echo_exits_per_mb", per_mb(echo, 0))
        .measured("echo_doorbells_per_mb", per_mb(echo, 1))
        .measured("echo_interrupts_per_mb", per_mb(echo, 2))
        .measured("send_bytes", |s| s.send_bytes.to_string())
        .measured("sink_bytes", |s| s.sink_bytes.to_string())
        .measured("crc32", |s| s.crc32.clone())
        .measured("send_mb_s", move |s| f1(s.send_mb_s))
        .measured("send_guest_mb_s", move |s| f1(s.send_guest_mb_s))
        .measured("send_exits_per_mb", per_mb(send, 0))
        .measured("send_doorbells_per_mb", per_mb(send, 1))
        .measured("send_interrupts_per_mb", per_mb(send, 2))
        .unavailable();
    cols.csv(contender_rows(runs, missing))
}

/// A VMM's medians over its runs.
struct Sums {
    n: usize,
    rtt_p50: Option<Summary>,
    rtt_p99: Option<Summary>,
    echo: Option<Summary>,
    send: Option<Summary>,
    /// Exits, doorbells and interrupts per MB echoed, then per MB sent.
    echo_per_mb: [Option<Summary>; 3],
    send_per_mb: [Option<Summary>; 3],
    bytes: Option<(u64, u64)>,
}

impl Sums {
    fn of(s: &[&Sample]) -> Sums {
        let sum = |g: &dyn Fn(&Sample) -> Option<f64>| {
            Summary::of(&s.iter().filter_map(|x| g(x)).collect::<Vec<f64>>())
        };
        let counts = |i: usize, g: fn(&Sample) -> (Option<VmmCounts>, u64)| {
            sum(&|x| {
                let (v, bytes) = g(x);
                v.and_then(|v| v.per_mb(bytes)[i])
            })
        };
        let echo = |x: &Sample| (x.echo_vmm, x.echoed_bytes);
        let send = |x: &Sample| (x.send_vmm, x.send_bytes);
        Sums {
            n: s.len(),
            rtt_p50: sum(&|x| Some(x.rtt_p50_us)),
            rtt_p99: sum(&|x| Some(x.rtt_p99_us)),
            echo: sum(&|x| Some(x.echo_mb_s)),
            send: sum(&|x| Some(x.send_mb_s)),
            echo_per_mb: [0, 1, 2].map(|i| counts(i, echo)),
            send_per_mb: [0, 1, 2].map(|i| counts(i, send)),
            bytes: s.first().map(|x| (x.echoed_bytes, x.send_bytes)),
        }
    }
}

fn med(s: Option<Summary>, digits: usize) -> String {
    s.map(|s| format!("{:.*}", digits, s.median))
        .unwrap_or_else(|| "n/a".into())
}

/// Prints every VMM's medians, Musubi's over Firecracker's, and what they measure.
fn print_table(configs: &[Vmm], sums: &[Sums]) {
    let mut t = Table::new(&[
        "hypervisor",
        ">RTT p50 us",
        ">RTT p99 us",
        ">echo MB/s",
        ">send MB/s",
        ">exits/MB (echo / send)",
        ">doorbells/MB (echo / send)",
        ">irqs/MB (echo / send)",
        ">bytes (echo / send)",
    ]);
    for (c, s) in configs.iter().zip(sums) {
        if s.n == 0 {
            t.row([c.name(), "unavailable (below)".into()]);
            continue;
        }
        let pair = |i: usize| {
            format!(
                "{} / {}",
                med(s.echo_per_mb[i], 1),
                med(s.send_per_mb[i], 1)
            )
        };
        t.row([
            c.name(),
            med(s.rtt_p50, 0),
            med(s.rtt_p99, 0),
            med(s.echo, 1),
            med(s.send, 1),
            pair(0),
            pair(1),
            pair(2),
            s.bytes
                .map(|(e, d)| format!("{e} / {d}"))
                .unwrap_or_default(),
        ]);
    }
    println!();
    print!("{}", t.render());
    if let Some(r) = ratios(configs, sums) {
        let f = |x: Option<f64>| {
            x.map(|x| format!("{x:.2}x"))
                .unwrap_or_else(|| "n/a".into())
        };
        let mut t = Table::new(&[
            "musubi / firecracker",
            ">RTT p50",
            ">RTT p99",
            ">echo MB/s",
            ">send MB/s",
        ]);
        t.row([
            "ratio of medians".to_string(),
            f(r[0]),
            f(r[1]),
            f(r[2]),
            f(r[3]),
        ]);
        println!();
        print!("{}", t.render());
    }
    print!("{}", TABLE_NOTES);
}

/// What the tables' columns measure.
const TABLE_NOTES: &str = "\
medians over the runs. RTT: the host's time to write 64 bytes to the guest's vsock-echo and
  read them back; echo MB/s: a large buffer written and read back at once (MB one way, 10^6
  bytes); send MB/s: the guest's vsock-send as the host's listener read it, from its accept
  to the stream's end, every byte counted and its CRC-32 checked. exits, doorbells (ioeventfd
  or MMIO) and irqs per MB echoed (one way) and per MB sent: Musubi's --metrics over the
  whole boot, boot included (n/a for Firecracker, whose counts this bench does not see);
  bytes: the counts of one run, equal in every run.
";

/// Musubi's medians over Firecracker's: RTT p50, RTT p99, echo and send throughput; `None`
/// when either has no runs.
fn ratios(configs: &[Vmm], sums: &[Sums]) -> Option<[Option<f64>; 4]> {
    let find = |name: &str| {
        configs
            .iter()
            .zip(sums)
            .find(|(c, s)| c.name() == name && s.n > 0)
            .map(|(_, s)| s)
    };
    let (m, f) = (find("musubi")?, find("firecracker")?);
    let r = |g: fn(&Sums) -> Option<Summary>| ratio(g(m)?.median, g(f)?.median);
    Some([
        r(|s| s.rtt_p50),
        r(|s| s.rtt_p99),
        r(|s| s.echo),
        r(|s| s.send),
    ])
}

/// Musubi's throughput against Firecracker's, both ways.
fn verdicts(configs: &[Vmm], sums: &[Sums]) -> Verdicts {
    let r = ratios(configs, sums);
    let mut v = Verdicts::new();
    for (what, x) in [
        (
            "guest->host stream MB/s, musubi / firecracker",
            r.and_then(|r| r[3]),
        ),
        (
            "host->guest->host echo MB/s, musubi / firecracker",
            r.and_then(|r| r[2]),
        ),
    ] {
        v.push(super::report::Figure {
            what: what.into(),
            ours: x
                .map(|x| format!("{x:.2}x"))
                .unwrap_or_else(|| "not measured".into()),
            reference: format!(">= {GOAL_STREAM:.2}x"),
            source: GOAL_SOURCE.into(),
            met: x.map(|x| x >= GOAL_STREAM),
        });
    }
    v
}

/// The chart's title and panels: each bar a VMM's median, its minimum marked. A peer
/// without bars says so in the title.
fn chart(configs: &[Vmm], sums: &[Sums], missing: &Missing) -> (String, Vec<plot::Panel>) {
    let panel = |title: &str, unit: &str, g: fn(&Sums) -> Option<Summary>| plot::Panel {
        title: title.into(),
        unit: unit.into(),
        bars: summary_bars(configs.iter().zip(sums.iter().map(g)), Vmm::name),
    };
    let panels = vec![
        panel("64-byte round trip p50 (median, min)", "us", |s| s.rtt_p50),
        panel("64-byte round trip p99 (median, min)", "us", |s| s.rtt_p99),
        panel("host->guest->host echo (median, min)", "MB/s", |s| s.echo),
        panel("guest->host stream (median, min)", "MB/s", |s| s.send),
    ];
    let title = chart_title(
        "vsock",
        configs.iter().zip(sums.iter().map(|s| s.n > 0)),
        missing,
    );
    (title, panels)
}
