//! `musubi bench snapshot`: how long a VM takes to be saved and to come back, Musubi beside
//! Firecracker and Cloud Hypervisor, on the probe guest caught in the middle of a task.
//!
//! Each run boots the probe guest (`hello`, then a CPL3 `spin` that touches no memory)
//! with the VMM's API socket, waits for hello on the console, and then:
//!
//! 1. snapshots it through the API, timed from the request to the answer (Musubi:
//!    `vm.snapshot`; Firecracker: `PATCH /vm` Paused, then `PUT /snapshot/create`; Cloud
//!    Hypervisor: `vm.pause`, then `vm.snapshot`; the peers' pause is also timed alone);
//! 2. ends that VMM and measures the memory file (length and allocated blocks);
//! 3. restores the snapshot in a new process, timed from its spawn to its first `KVM_RUN`
//!    (the kernel's `sys_enter_ioctl` tracepoint, as `bench boot` times a boot) and to the
//!    spin task's result line on its console (the rest of the task after the restore).

use super::apivm::{api, one_line, Vm, Vmm, ERROR_LINES};
use super::driver::{
    measured_per_config, print_unavailable, summary_bars, Columns, Missing, Outputs, PeerRow, Runs,
    Verdicts,
};
use super::kvm_trace::KvmRunTrace;
use super::peers::{self, Kind, Micro};
use super::qemu::{Outcome, Standing};
use super::report::{cell, median_min, mib, ms, ram_size, ram_sizes, Csv, Table};
use super::stats::{max, ratio, Summary};
use super::watch::{last_words, observe, observe_to_marker, time_to_marker, Observed, Watch};
use super::{plot, BenchArgs, Harness};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Spin iterations after hello: about 0.5 s at CPL3 here, long enough that the snapshot
/// always lands inside the task (the pause comes a few ms after hello), short enough that
/// the rest of the task after a restore stays a small part of a run.
const SPIN: u64 = 1_000_000_000;
const HELLO: &str = "{\"probe\":\"hello\"";
const SPIN_RESULT: &str = "{\"probe\":\"spin\"";
/// Bounds on every wait: a boot to hello, an API answer (a full 4 GiB snapshot is written
/// before it), a VMM's exit after shutdown, a whole restored run.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
const RESTORE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the restored VMM's memory is read (`/proc/PID/smaps`); coarse, so the sampler
/// does not take a core from the restore it measures on a two-core machine.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The issue's goals.
const GOAL_RESTORE_VS_FC: f64 = 0.5;
const GOAL_FLAT: f64 = 1.2;
const GOAL_SNAPSHOT_VS_FC: f64 = 1.0;
const GOAL_SOURCE: &str = "Musubi goal, same run";

#[derive(Clone, Debug)]
struct Config {
    vmm: Vmm,
    mib: u64,
}

impl Config {
    fn vmm_name(&self) -> &'static str {
        self.vmm.name()
    }

    fn name(&self) -> String {
        format!("{} {}", self.vmm_name(), ram_size(self.mib))
    }
}

/// One run's figures. Times in ns.
#[derive(Clone, Debug)]
struct Sample {
    /// The peers' pause request alone (part of `snapshot_ns`); Musubi pauses inside
    /// `vm.snapshot`.
    pause_ns: Option<u64>,
    /// From the (first) request to the (last) answer.
    snapshot_ns: u64,
    mem_len: Option<u64>,
    mem_allocated: Option<u64>,
    /// The restoring process's spawn to its first KVM_RUN.
    restore_first_run_ns: Option<u64>,
    /// The peers' restore request (`/snapshot/load`, or `vm.resume` after `--restore`),
    /// from spawn to its answer.
    restore_api_ns: Option<u64>,
    /// Spawn to the spin task's result line.
    restore_end_ns: u64,
    /// Highest total RSS of the restoring process seen.
    restore_rss: Option<u64>,
}

/// The runs of every configuration; a peer's may have failed or not been made.
type SnapshotRuns = Runs<Config, Outcome<Sample>>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let reps = if h.quick { 1 } else { 5 };
    let sizes: &[u64] = if h.quick {
        &[128, 256]
    } else {
        &[128, 1024, 4096]
    };
    let listed = peers::parse_compare(args.compare.as_deref())?;
    let trace = KvmRunTrace::open().map_err(|e| {
        format!("restore to first KVM_RUN is timed by the kernel's sys_enter_ioctl tracepoint: {e}")
    })?;
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    let tasks = format!("probe.tasks=hello,spin={SPIN}");
    println!(
        "snapshot: probe guest ({tasks}), 1 vCPU, {}; snapshotted after hello, inside spin;",
        ram_sizes(sizes)
    );
    println!("  {reps} run(s) per hypervisor and size, interleaved");
    println!(
        "first KVM_RUN: from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );
    let (vmms, missing) = vmms(h, &listed, exe, &elf, &tasks, sizes[0]);
    let mut configs = Vec::new();
    for &mib in sizes {
        for v in &vmms {
            let vmm = match v {
                Vmm::Peer(m) => Vmm::Peer(Micro::find_with(m.kind, &elf, &h.out, &tasks, mib)?),
                musubi => musubi.clone(),
            };
            configs.push(Config { vmm, mib });
        }
    }
    let standing = warm_up(&configs, vmms.len(), &trace)?;
    let (runs, standing) = measure(h, configs, standing, reps, &trace)?;
    let csv_path = Outputs::new(h).csv("snapshot.csv", &csv(&runs, &missing))?;
    let sums: Vec<Sums> = measured_per_config(&runs)
        .iter()
        .map(|s| Sums::of(s))
        .collect();
    print_table(&runs.configs, &sums);
    print_unavailable(
        runs.configs.iter().map(Config::vmm_name).zip(&standing),
        &missing,
    );
    let f = Found {
        configs: &runs.configs,
        sums,
    };
    println!();
    print!("{}", verdicts(&f, sizes).table());
    if !listed.contains(&"firecracker") {
        println!("(no --compare firecracker: the goals against Firecracker are not measured, n/a)");
    }
    if h.quick {
        println!(
            "(--quick: {} and {} only; the goal is stated for 4 GiB against 128 MiB)",
            ram_size(sizes[0]),
            ram_size(sizes[sizes.len() - 1])
        );
    }
    println!();
    println!(
        "This machine runs KVM nested: the guest's CPL0 code is emulated (slow), but snapshot,"
    );
    println!("restore and first KVM_RUN are VMM work on the host and not distorted by it.");
    let svg_path = Outputs::new(h).bars("snapshot.svg", "musubi bench snapshot", &panels(&f))?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

/// Musubi and the listed peers that can run, and the peers that cannot with why.
fn vmms(
    h: &Harness,
    listed: &[&str],
    exe: PathBuf,
    elf: &Path,
    tasks: &str,
    mib: u64,
) -> (Vec<Vmm>, Missing) {
    let mut vmms = vec![Vmm::Musubi {
        exe,
        elf: elf.to_path_buf(),
    }];
    let mut missing = Missing::new();
    for name in listed {
        let Some(kind) = Kind::of(name) else {
            println!(
                "{name}: not compared here (snapshot compares firecracker and cloud-hypervisor)"
            );
            continue;
        };
        match Micro::find_with(kind, elf, &h.out, tasks, mib) {
            Ok(m) => {
                println!("{}: runs with its seccomp filters", kind.name());
                vmms.push(Vmm::Peer(m));
            }
            Err(why) => {
                println!("{}: unavailable, Musubi runs alone: {why}", kind.name());
                missing.push((kind.name().into(), why));
            }
        }
    }
    (vmms, missing)
}

/// One discarded run per VMM at the smallest size (the first `vmms` configurations), so the
/// first measured run does not pay for cold caches. Musubi's failure ends the benchmark; a
/// peer whose warm-up fails is out at every size, with its error.
fn warm_up(configs: &[Config], vmms: usize, trace: &KvmRunTrace) -> Result<Vec<Standing>, String> {
    let mut standing: Vec<Standing> = configs.iter().map(|_| Standing::default()).collect();
    for c in configs.iter().take(vmms) {
        match c.vmm {
            Vmm::Musubi { .. } => {
                one_run(c, trace).map_err(|e| format!("{} warm-up run: {e}", c.name()))?;
            }
            Vmm::Peer(_) => {
                if let Err(e) = one_run(c, trace) {
                    let why = format!("warm-up run ({}) failed: {}", ram_size(c.mib), e);
                    for (d, st) in configs.iter().zip(standing.iter_mut()) {
                        if d.vmm_name() == c.vmm_name() {
                            st.unavailable = Some(why.clone());
                        }
                    }
                }
            }
        }
    }
    Ok(standing)
}

/// Every configuration's runs, interleaved; a peer that has dropped out makes none.
fn measure(
    h: &Harness,
    configs: Vec<Config>,
    mut standing: Vec<Standing>,
    reps: usize,
    trace: &KvmRunTrace,
) -> Result<(SnapshotRuns, Vec<Standing>), String> {
    let runs = Runs::measure_indexed(h, configs, reps, Config::name, |rep, i, c| match c.vmm {
        Vmm::Musubi { .. } => one_run(c, trace).map(Outcome::Measured),
        Vmm::Peer(_) => Ok(
            standing[i].run(&format!("{} run {}", c.name(), rep + 1), || {
                one_run(c, trace)
            }),
        ),
    })?;
    Ok((runs, standing))
}

/// `snapshot.csv`: one row per run; a peer that failed, or never ran, says why in
/// `unavailable`.
fn csv(runs: &SnapshotRuns, missing: &[(String, String)]) -> Csv {
    /// Run and repetition (empty for a peer that never ran), hypervisor, memory.
    type Head = (String, String, String, String);
    let msf = |n: Option<u64>| cell(n.map(|n| ms(n as f64)));
    let cols = Columns::new()
        .head("run", |h: &Head| h.0.clone())
        .head("rep", |h| h.1.clone())
        .head("hypervisor", |h| h.2.clone())
        .head("memory_mib", |h| h.3.clone())
        .measured("pause_ms", move |s: &Sample| msf(s.pause_ns))
        .measured("snapshot_ms", |s| ms(s.snapshot_ns as f64))
        .measured("memory_file_bytes", |s| cell(s.mem_len))
        .measured("memory_file_allocated_bytes", |s| cell(s.mem_allocated))
        .measured("restore_first_kvm_run_ms", move |s| {
            msf(s.restore_first_run_ns)
        })
        .measured("restore_api_ms", move |s| msf(s.restore_api_ns))
        .measured("restore_to_end_ms", |s| ms(s.restore_end_ns as f64))
        .measured("restore_max_rss_mib", |s| {
            cell(s.restore_rss.map(|b| mib(b as f64)))
        })
        .unavailable();
    let mut rows = PeerRow::of_runs(runs, |i, rep, c: &Config| {
        (
            (i + 1).to_string(),
            (rep + 1).to_string(),
            c.vmm_name().to_string(),
            c.mib.to_string(),
        )
    });
    rows.extend(missing.iter().map(|(name, why)| {
        PeerRow::missing(
            (String::new(), String::new(), name.clone(), String::new()),
            why,
        )
    }));
    cols.csv(rows)
}

/// Prints every configuration's figures and what they measure.
fn print_table(configs: &[Config], sums: &[Sums]) {
    let mut t = Table::new(&[
        "hypervisor",
        ">RAM",
        ">pause ms",
        ">snapshot ms (med / min)",
        ">mem file MiB (disk / length)",
        ">restore to 1st KVM_RUN ms (med / min)",
        ">restore to task end ms (med / min)",
        ">max RSS MiB",
    ]);
    for (c, s) in configs.iter().zip(sums) {
        if s.n == 0 {
            t.row([
                c.vmm_name().to_string(),
                ram_size(c.mib),
                "unavailable (below)".into(),
            ]);
            continue;
        }
        t.row([
            c.vmm_name().to_string(),
            ram_size(c.mib),
            s.pause.map(|p| ms(p.median)).unwrap_or_else(|| "-".into()),
            median_min(s.snapshot, ms),
            match (s.mem_allocated, s.mem_len) {
                (Some(a), Some(l)) => format!("{} / {}", mib(a), mib(l)),
                _ => "n/a".into(),
            },
            median_min(s.first_run, ms),
            median_min(s.end, ms),
            s.rss.map(mib).unwrap_or_else(|| "n/a".into()),
        ]);
    }
    println!();
    print!("{}", t.render());
    println!("snapshot: request to answer (peers: pause and snapshot requests together; pause also alone).");
    println!("mem file: the memory file's allocated blocks (du) and its length.");
    println!(
        "restore: from the spawn of the restoring process (peers: with the API request that loads"
    );
    println!(
        "  or resumes it, sent as soon as its socket answers); first KVM_RUN from the tracepoint;"
    );
    println!(
        "  task end = the spin task's result line on the console (the rest of spin, about 0.5 s"
    );
    println!(
        "  of CPL3 work here, is in it). max RSS: the restoring process's, sampled every {} ms.",
        SAMPLE_EVERY.as_millis()
    );
}

/// Each configuration's summaries, found by VMM and size.
struct Found<'a> {
    configs: &'a [Config],
    sums: Vec<Sums>,
}

impl Found<'_> {
    fn find(&self, vmm: &str, mib: u64) -> Option<&Sums> {
        self.configs
            .iter()
            .zip(&self.sums)
            .find(|(c, _)| c.vmm_name() == vmm && c.mib == mib)
            .map(|(_, s)| s)
    }
}

/// The goals against Firecracker at every size, and Musubi's largest size over its smallest.
fn verdicts(f: &Found, sizes: &[u64]) -> Verdicts {
    let mut v = Verdicts::new();
    let mut fig = |what: String, r: Option<f64>, bound: f64| {
        v.judged(
            what,
            r,
            |x| format!("{x:.2}x"),
            format!("<= {bound:.2}x"),
            GOAL_SOURCE,
            |x| x <= bound,
        )
    };
    for &mib in sizes {
        let (m, fc) = (f.find("musubi", mib), f.find("firecracker", mib));
        let r = |g: fn(&Sums) -> Option<Summary>| {
            m.and_then(g)
                .zip(fc.and_then(g))
                .and_then(|(a, b)| ratio(a.median, b.median))
        };
        fig(
            format!(
                "restore to 1st KVM_RUN, musubi / firecracker, {}",
                ram_size(mib)
            ),
            r(|s| s.first_run),
            GOAL_RESTORE_VS_FC,
        );
        fig(
            format!("snapshot time, musubi / firecracker, {}", ram_size(mib)),
            r(|s| s.snapshot),
            GOAL_SNAPSHOT_VS_FC,
        );
    }
    let (small, large) = (sizes[0], sizes[sizes.len() - 1]);
    let flat = |g: fn(&Sums) -> Option<Summary>| {
        f.find("musubi", large)
            .and_then(g)
            .zip(f.find("musubi", small).and_then(g))
            .and_then(|(a, b)| ratio(a.median, b.median))
    };
    let sizes_text = format!("{} / {}", ram_size(large), ram_size(small));
    fig(
        format!("musubi restore to 1st KVM_RUN, {sizes_text}"),
        flat(|s| s.first_run),
        GOAL_FLAT,
    );
    fig(
        format!("musubi snapshot time, {sizes_text}"),
        flat(|s| s.snapshot),
        GOAL_FLAT,
    );
    v
}

/// The chart: snapshot time, and restore to first KVM_RUN and to the task's end.
fn panels(f: &Found) -> Vec<plot::Panel> {
    let bars = |g: fn(&Sums) -> Option<Summary>| {
        summary_bars(
            f.configs
                .iter()
                .zip(&f.sums)
                .map(|(c, s)| (c, g(s).map(|x| x.scaled(1e-6)))),
            Config::name,
        )
    };
    let panel = |title: &str, bars: Vec<plot::Bar>| plot::Panel {
        title: title.into(),
        unit: "ms".into(),
        bars,
    };
    vec![
        panel(
            "snapshot, request to answer (median, min)",
            bars(|s| s.snapshot),
        ),
        panel(
            "restore, spawn to first KVM_RUN (median, min)",
            bars(|s| s.first_run),
        ),
        panel(
            "restore, spawn to end of the guest's task (median, min)",
            bars(|s| s.end),
        ),
    ]
}

struct Sums {
    n: usize,
    pause: Option<Summary>,
    snapshot: Option<Summary>,
    first_run: Option<Summary>,
    end: Option<Summary>,
    mem_len: Option<f64>,
    mem_allocated: Option<f64>,
    rss: Option<f64>,
}

impl Sums {
    fn of(s: &[&Sample]) -> Sums {
        let f = |g: &dyn Fn(&Sample) -> Option<u64>| -> Vec<f64> {
            s.iter().filter_map(|x| g(x)).map(|v| v as f64).collect()
        };
        Sums {
            n: s.len(),
            pause: Summary::of(&f(&|x| x.pause_ns)),
            snapshot: Summary::of(&f(&|x| Some(x.snapshot_ns))),
            first_run: Summary::of(&f(&|x| x.restore_first_run_ns)),
            end: Summary::of(&f(&|x| Some(x.restore_end_ns))),
            mem_len: max(&f(&|x| x.mem_len)),
            mem_allocated: max(&f(&|x| x.mem_allocated)),
            rss: max(&f(&|x| x.restore_rss)),
        }
    }
}

/// [`api`] once the socket accepts connections (the VMM creates it as it starts), timed
/// from `since` to the answer.
fn api_when_up(
    socket: &Path,
    requests: &[(&str, &str, Option<String>)],
    since: Instant,
) -> Result<u64, String> {
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if since.elapsed() > RESTORE_TIMEOUT {
            return Err(format!(
                "the API socket {} did not answer within {} s",
                socket.display(),
                RESTORE_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    for (method, path, body) in requests {
        api(socket, method, path, body.as_deref())?;
    }
    Ok(since.elapsed().as_nanos() as u64)
}

/// File length and allocated bytes.
fn file_size(p: &Path) -> (Option<u64>, Option<u64>) {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(p) {
        Ok(m) => (Some(m.len()), Some(m.blocks() * 512)),
        Err(_) => (None, None),
    }
}

/// Where one run keeps its files.
struct Paths {
    socket: PathBuf,
    snap: PathBuf,
    console: PathBuf,
    /// `snap` as the `file://` URL the APIs take.
    url: String,
}

fn one_run(c: &Config, trace: &KvmRunTrace) -> Result<Sample, String> {
    let tmp = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let dir = tmp.path();
    let snap = dir.join("snap");
    let p = Paths {
        socket: dir.join("api.sock"),
        console: dir.join("console.out"),
        url: format!("file://{}", snap.display()),
        snap,
    };
    std::fs::create_dir(&p.snap).map_err(|e| format!("cannot create {}: {e}", p.snap.display()))?;

    // Boot the source VM and wait for hello: the spin task is running from there on.
    let src = boot_source(c, dir, &p)?;
    let t0 = Instant::now();
    let (mem_file, pause_ns) = snapshot(c, &p, t0)?;
    let snapshot_ns = t0.elapsed().as_nanos() as u64;
    let before = std::fs::read_to_string(&p.console).unwrap_or_default();
    if before.contains(SPIN_RESULT) {
        return Err(format!(
            "the spin task ended before the snapshot (make SPIN longer): {}",
            one_line(&before, 300)
        ));
    }
    // End the source: Musubi through its API (it stays paused after a snapshot), the
    // peers by the kill the drop does.
    if let Vmm::Musubi { .. } = c.vmm {
        api(&p.socket, "PUT", "/api/v1/vmm.shutdown", None)?;
        if !src.wait_exit(EXIT_TIMEOUT) {
            return Err(format!(
                "musubi did not end within {} s of vmm.shutdown",
                EXIT_TIMEOUT.as_secs()
            ));
        }
    }
    drop(src);
    let _ = std::fs::remove_file(&p.socket);
    let (mem_len, mem_allocated) = file_size(&mem_file);

    // Restore it in a new process.
    trace.clear()?;
    let (o, restore_api_ns) = restore(c, &p)?;
    if o.stdout.contains(HELLO) {
        return Err(format!(
            "the restored VM printed hello again: it booted instead of resuming: {}",
            one_line(&o.stdout, 300)
        ));
    }
    let restore_end_ns = o.marker_ns.unwrap_or(o.end_ns).saturating_sub(o.spawn_ns);
    let restore_first_run_ns = trace
        .first_run_ns(o.pid)?
        .map(|at| at.saturating_sub(o.spawn_ns));
    Ok(Sample {
        pause_ns,
        snapshot_ns,
        mem_len,
        mem_allocated,
        restore_first_run_ns,
        restore_api_ns,
        restore_end_ns,
        restore_rss: o.max_overhead,
    })
}

/// Boots the source VM with its API socket and waits for hello on its console.
fn boot_source(c: &Config, dir: &Path, p: &Paths) -> Result<Vm, String> {
    let (cmd, name) = match &c.vmm {
        Vmm::Musubi { exe, elf } => {
            let mut cmd = Command::new(exe);
            cmd.args(["run", "--kernel"])
                .arg(elf)
                .args(["--cpus", "1", "--memory", &format!("{}M", c.mib)])
                .args(["--cmdline", &format!("probe.tasks=hello,spin={SPIN}")])
                .arg("--api-socket")
                .arg(&p.socket)
                .arg("--serial")
                .arg(format!("file={}", p.console.display()));
            (cmd, "musubi")
        }
        Vmm::Peer(m) => (m.command_api(Some(&p.socket)), m.kind.name()),
    };
    let src = Vm::start(cmd, name, dir)?;
    src.wait_for_line(&p.console, HELLO, BOOT_TIMEOUT)?;
    Ok(src)
}

/// Snapshots the source through its API (the peers pause it first); returns the memory
/// file and, for the peers, the time the pause took from `t0`.
fn snapshot(c: &Config, p: &Paths, t0: Instant) -> Result<(PathBuf, Option<u64>), String> {
    let (socket, snap) = (&p.socket, &p.snap);
    let mut pause_ns = None;
    let mem_file = match &c.vmm {
        Vmm::Musubi { .. } => {
            let body = serde_json::json!({ "destination_url": p.url }).to_string();
            api(socket, "PUT", "/api/v1/vm.snapshot", Some(&body))?;
            snap.join("memory")
        }
        Vmm::Peer(m) if m.kind == Kind::Firecracker => {
            api(socket, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#))?;
            pause_ns = Some(t0.elapsed().as_nanos() as u64);
            let body = serde_json::json!({
                "snapshot_type": "Full",
                "snapshot_path": snap.join("vmstate"),
                "mem_file_path": snap.join("memory"),
            })
            .to_string();
            api(socket, "PUT", "/snapshot/create", Some(&body))?;
            snap.join("memory")
        }
        Vmm::Peer(_) => {
            api(socket, "PUT", "/api/v1/vm.pause", None)?;
            pause_ns = Some(t0.elapsed().as_nanos() as u64);
            let body = serde_json::json!({ "destination_url": p.url }).to_string();
            api(socket, "PUT", "/api/v1/vm.snapshot", Some(&body))?;
            snap.join("memory-ranges")
        }
    };
    Ok((mem_file, pause_ns))
}

/// Restores the snapshot in a new process and watches it to the spin task's result; the
/// peers' restore request's time from spawn to answer beside it.
fn restore(c: &Config, p: &Paths) -> Result<(Observed, Option<u64>), String> {
    let watch = Watch {
        marker: SPIN_RESULT,
        // No anonymous mapping is this large: every byte counts as the VMM's, so the
        // sampled "overhead" is the whole RSS, the restored guest's pages included.
        guest_bytes: Some(u64::MAX),
        timeout: RESTORE_TIMEOUT,
        sample_every: SAMPLE_EVERY,
    };
    let m = match &c.vmm {
        Vmm::Musubi { exe, .. } => {
            let mut cmd = Command::new(exe);
            cmd.args(["run", "--restore"])
                .arg(&p.snap)
                .args(["--serial", "stdio"]);
            let o = observe(cmd, &watch).map_err(|e| format!("cannot start musubi: {e}"))?;
            time_to_marker(&o, 0, ERROR_LINES)?;
            return Ok((o, None));
        }
        Vmm::Peer(m) => m,
    };
    let mut cmd = Command::new(&m.exe);
    let requests: Vec<(&str, &str, Option<String>)> = match m.kind {
        Kind::Firecracker => {
            cmd.arg("--api-sock").arg(&p.socket);
            let body = serde_json::json!({
                "snapshot_path": p.snap.join("vmstate"),
                "mem_backend": {"backend_type": "File", "backend_path": p.snap.join("memory")},
                "resume_vm": true,
            })
            .to_string();
            vec![("PUT", "/snapshot/load", Some(body))]
        }
        Kind::CloudHypervisor => {
            cmd.arg("--api-socket")
                .arg(format!("path={}", p.socket.display()))
                .arg("--restore")
                .arg(format!("source_url={}", p.url));
            vec![("PUT", "/api/v1/vm.resume", None)]
        }
    };
    // The API requests go from a thread of their own while `observe` watches the
    // process; the thread gives up at RESTORE_TIMEOUT like `observe`.
    let sock = p.socket.clone();
    let since = Instant::now();
    let helper = std::thread::spawn(move || api_when_up(&sock, &requests, since));
    let o = observe_to_marker(cmd, &watch)
        .map_err(|e| format!("cannot start {}: {e}", m.kind.name()))?;
    let api_result = helper
        .join()
        .unwrap_or_else(|_| Err("the API thread panicked".into()));
    let api_ns =
        api_result.map_err(|e| format!("restore: {e}; {}", last_words(&o, ERROR_LINES)))?;
    if o.marker_ns.is_none() {
        return Err(format!(
            "restored, but no spin result line{}; {}",
            if o.timed_out {
                " before the time limit"
            } else {
                ""
            },
            last_words(&o, ERROR_LINES)
        ));
    }
    Ok((o, Some(api_ns)))
}
