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
use super::kvm_trace::KvmRunTrace;
use super::peers::{self, Kind, Micro};
use super::qemu::{measured_per_config, Outcome, Standing};
use super::report::{cell, figures_table, median_min, mib, ms, Csv, Figure, Table};
use super::stats::{max, ratio, Summary};
use super::watch::{last_words, observe, observe_to_marker, time_to_marker, Watch};
use super::{plot, BenchArgs, Harness};
use std::path::Path;
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
        format!("{} {}", self.vmm_name(), size_text(self.mib))
    }
}

fn size_text(mib: u64) -> String {
    if mib >= 1024 && mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
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

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("/dev/kvm does not exist: this benchmark runs VMs and needs KVM".into());
    }
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
        sizes
            .iter()
            .map(|m| size_text(*m))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("  {reps} run(s) per hypervisor and size, interleaved");
    println!(
        "first KVM_RUN: from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );

    let mut vmms = vec![Vmm::Musubi {
        exe,
        elf: elf.clone(),
    }];
    let mut missing: Vec<(String, String)> = Vec::new();
    for name in &listed {
        let Some(kind) = Kind::of(name) else {
            println!(
                "{name}: not compared here (snapshot compares firecracker and cloud-hypervisor)"
            );
            continue;
        };
        match Micro::find_with(kind, &elf, &h.out, &tasks, sizes[0]) {
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

    // One discarded run per VMM at the smallest size, so the first measured run does not
    // pay for cold caches. Musubi's failure ends the benchmark; a peer whose warm-up fails
    // is out at every size, with its error.
    let mut standing: Vec<Standing> = configs.iter().map(|_| Standing::default()).collect();
    for c in configs.iter().take(vmms.len()) {
        match c.vmm {
            Vmm::Musubi { .. } => {
                one_run(c, &trace).map_err(|e| format!("{} warm-up run: {e}", c.name()))?;
            }
            Vmm::Peer(_) => {
                if let Err(e) = one_run(c, &trace) {
                    let why = format!("warm-up run ({}) failed: {}", size_text(c.mib), e);
                    for (d, st) in configs.iter().zip(standing.iter_mut()) {
                        if d.vmm_name() == c.vmm_name() {
                            st.unavailable = Some(why.clone());
                        }
                    }
                }
            }
        }
    }
    let runs = h.run_schedule(&configs, reps, Config::name, |rep, c| {
        let i = configs.iter().position(|x| std::ptr::eq(x, c)).unwrap_or(0);
        match c.vmm {
            Vmm::Musubi { .. } => one_run(c, &trace).map(Outcome::Measured),
            Vmm::Peer(_) => Ok(
                standing[i].run(&format!("{} run {}", c.name(), rep + 1), || {
                    one_run(c, &trace)
                }),
            ),
        }
    })?;

    // CSV: one row per run; a peer that failed says why in `unavailable`.
    let mut csv = Csv::new(&[
        "run",
        "rep",
        "hypervisor",
        "memory_mib",
        "pause_ms",
        "snapshot_ms",
        "memory_file_bytes",
        "memory_file_allocated_bytes",
        "restore_first_kvm_run_ms",
        "restore_api_ms",
        "restore_to_end_ms",
        "restore_max_rss_mib",
        "unavailable",
    ]);
    for (i, (rep, c, r)) in runs.iter().enumerate() {
        let cfg = &configs[*c];
        let head = [
            (i + 1).to_string(),
            (rep + 1).to_string(),
            cfg.vmm_name().to_string(),
            cfg.mib.to_string(),
        ];
        match r {
            Outcome::Measured(s) => csv.row(head.into_iter().chain([
                cell(s.pause_ns.map(|n| ms(n as f64))),
                ms(s.snapshot_ns as f64),
                cell(s.mem_len),
                cell(s.mem_allocated),
                cell(s.restore_first_run_ns.map(|n| ms(n as f64))),
                cell(s.restore_api_ns.map(|n| ms(n as f64))),
                ms(s.restore_end_ns as f64),
                cell(s.restore_rss.map(|b| mib(b as f64))),
                String::new(),
            ])),
            Outcome::PeerFailed(why) => csv.row(
                head.into_iter()
                    .chain(std::iter::repeat_n(String::new(), 8))
                    .chain([why.clone()]),
            ),
            Outcome::NotMade => {}
        }
    }
    for (name, why) in &missing {
        let mut row = vec![String::new(), String::new(), name.clone(), String::new()];
        row.extend(std::iter::repeat_n(String::new(), 8));
        row.push(why.clone());
        csv.row(row);
    }
    let csv_path = h.write_csv("snapshot.csv", &csv)?;

    let sums: Vec<Sums> = measured_per_config(&runs, configs.len())
        .iter()
        .map(|s| Sums::of(s))
        .collect();

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
    for (c, s) in configs.iter().zip(&sums) {
        if s.n == 0 {
            t.row([
                c.vmm_name().to_string(),
                size_text(c.mib),
                "unavailable (below)".into(),
            ]);
            continue;
        }
        t.row([
            c.vmm_name().to_string(),
            size_text(c.mib),
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
    // Each failed peer once, in its own words.
    let mut said: Vec<&String> = Vec::new();
    for (c, st) in configs.iter().zip(&standing) {
        if let Some(why) = &st.unavailable {
            if !said.contains(&why) {
                said.push(why);
                println!("{}: unavailable, no comparison: {why}", c.vmm_name());
            }
        }
    }
    for (name, why) in &missing {
        println!("{name}: unavailable, no comparison: {why}");
    }

    // Goals.
    let find = |vmm: &str, mib: u64| {
        configs
            .iter()
            .zip(&sums)
            .find(|(c, _)| c.vmm_name() == vmm && c.mib == mib)
            .map(|(_, s)| s)
    };
    let mut figs = Vec::new();
    let fig = |what: String, v: Option<f64>, bound: f64, met: fn(f64, f64) -> bool| Figure {
        what,
        ours: v
            .map(|x| format!("{x:.2}x"))
            .unwrap_or_else(|| "n/a".into()),
        reference: format!("<= {bound:.2}x"),
        source: GOAL_SOURCE.into(),
        met: v.map(|x| met(x, bound)),
    };
    let le = |x: f64, b: f64| x <= b;
    for &mib in sizes {
        let m = find("musubi", mib);
        let f = find("firecracker", mib);
        let r = |g: fn(&Sums) -> Option<Summary>| {
            m.and_then(g)
                .zip(f.and_then(g))
                .and_then(|(a, b)| ratio(a.median, b.median))
        };
        figs.push(fig(
            format!(
                "restore to 1st KVM_RUN, musubi / firecracker, {}",
                size_text(mib)
            ),
            r(|s| s.first_run),
            GOAL_RESTORE_VS_FC,
            le,
        ));
        figs.push(fig(
            format!("snapshot time, musubi / firecracker, {}", size_text(mib)),
            r(|s| s.snapshot),
            GOAL_SNAPSHOT_VS_FC,
            le,
        ));
    }
    let (small, large) = (sizes[0], sizes[sizes.len() - 1]);
    let flat = |g: fn(&Sums) -> Option<Summary>| {
        find("musubi", large)
            .and_then(g)
            .zip(find("musubi", small).and_then(g))
            .and_then(|(a, b)| ratio(a.median, b.median))
    };
    figs.push(fig(
        format!(
            "musubi restore to 1st KVM_RUN, {} / {}",
            size_text(large),
            size_text(small)
        ),
        flat(|s| s.first_run),
        GOAL_FLAT,
        le,
    ));
    figs.push(fig(
        format!(
            "musubi snapshot time, {} / {}",
            size_text(large),
            size_text(small)
        ),
        flat(|s| s.snapshot),
        GOAL_FLAT,
        le,
    ));
    println!();
    print!("{}", figures_table(&figs));
    if !listed.contains(&"firecracker") {
        println!("(no --compare firecracker: the goals against Firecracker are not measured, n/a)");
    }
    if h.quick {
        println!(
            "(--quick: {} and {} only; the goal is stated for 4 GiB against 128 MiB)",
            size_text(small),
            size_text(large)
        );
    }
    println!();
    println!(
        "This machine runs KVM nested: the guest's CPL0 code is emulated (slow), but snapshot,"
    );
    println!("restore and first KVM_RUN are VMM work on the host and not distorted by it.");

    let bars = |g: fn(&Sums) -> Option<Summary>| -> Vec<plot::Bar> {
        configs
            .iter()
            .zip(&sums)
            .filter_map(|(c, s)| {
                g(s).map(|x| plot::Bar {
                    label: c.name(),
                    value: x.median / 1e6,
                    low: Some(x.min / 1e6),
                })
            })
            .collect()
    };
    let panels = vec![
        plot::Panel {
            title: "snapshot, request to answer (median, min)".into(),
            unit: "ms".into(),
            bars: bars(|s| s.snapshot),
        },
        plot::Panel {
            title: "restore, spawn to first KVM_RUN (median, min)".into(),
            unit: "ms".into(),
            bars: bars(|s| s.first_run),
        },
        plot::Panel {
            title: "restore, spawn to end of the guest's task (median, min)".into(),
            unit: "ms".into(),
            bars: bars(|s| s.end),
        },
    ];
    let svg_path = h.write_chart("snapshot.svg", "musubi bench snapshot", &panels)?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
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

fn one_run(c: &Config, trace: &KvmRunTrace) -> Result<Sample, String> {
    let tmp = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let dir = tmp.path();
    let socket = dir.join("api.sock");
    let snap = dir.join("snap");
    let console = dir.join("console.out");
    std::fs::create_dir(&snap).map_err(|e| format!("cannot create {}: {e}", snap.display()))?;
    let url = format!("file://{}", snap.display());

    // Boot the source VM and wait for hello: the spin task is running from there on.
    let (cmd, name) = match &c.vmm {
        Vmm::Musubi { exe, elf } => {
            let mut cmd = Command::new(exe);
            cmd.args(["run", "--kernel"])
                .arg(elf)
                .args(["--cpus", "1", "--memory", &format!("{}M", c.mib)])
                .args(["--cmdline", &format!("probe.tasks=hello,spin={SPIN}")])
                .arg("--api-socket")
                .arg(&socket)
                .arg("--serial")
                .arg(format!("file={}", console.display()));
            (cmd, "musubi")
        }
        Vmm::Peer(m) => (m.command_api(Some(&socket)), m.kind.name()),
    };
    let src = Vm::start(cmd, name, dir)?;
    src.wait_for_line(&console, HELLO, BOOT_TIMEOUT)?;

    // Snapshot it.
    let t0 = Instant::now();
    let mut pause_ns = None;
    let mem_file = match &c.vmm {
        Vmm::Musubi { .. } => {
            let body = serde_json::json!({ "destination_url": url }).to_string();
            api(&socket, "PUT", "/api/v1/vm.snapshot", Some(&body))?;
            snap.join("memory")
        }
        Vmm::Peer(m) if m.kind == Kind::Firecracker => {
            api(&socket, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#))?;
            pause_ns = Some(t0.elapsed().as_nanos() as u64);
            let body = serde_json::json!({
                "snapshot_type": "Full",
                "snapshot_path": snap.join("vmstate"),
                "mem_file_path": snap.join("memory"),
            })
            .to_string();
            api(&socket, "PUT", "/snapshot/create", Some(&body))?;
            snap.join("memory")
        }
        Vmm::Peer(_) => {
            api(&socket, "PUT", "/api/v1/vm.pause", None)?;
            pause_ns = Some(t0.elapsed().as_nanos() as u64);
            let body = serde_json::json!({ "destination_url": url }).to_string();
            api(&socket, "PUT", "/api/v1/vm.snapshot", Some(&body))?;
            snap.join("memory-ranges")
        }
    };
    let snapshot_ns = t0.elapsed().as_nanos() as u64;
    let before = std::fs::read_to_string(&console).unwrap_or_default();
    if before.contains(SPIN_RESULT) {
        return Err(format!(
            "the spin task ended before the snapshot (make SPIN longer): {}",
            one_line(&before, 300)
        ));
    }
    // End the source: Musubi through its API (it stays paused after a snapshot), the
    // peers by the kill the drop does.
    if let Vmm::Musubi { .. } = c.vmm {
        api(&socket, "PUT", "/api/v1/vmm.shutdown", None)?;
        if !src.wait_exit(EXIT_TIMEOUT) {
            return Err(format!(
                "musubi did not end within {} s of vmm.shutdown",
                EXIT_TIMEOUT.as_secs()
            ));
        }
    }
    drop(src);
    let _ = std::fs::remove_file(&socket);
    let (mem_len, mem_allocated) = file_size(&mem_file);

    // Restore it in a new process.
    trace.clear()?;
    let watch = Watch {
        marker: SPIN_RESULT,
        // No anonymous mapping is this large: every byte counts as the VMM's, so the
        // sampled "overhead" is the whole RSS, the restored guest's pages included.
        guest_bytes: Some(u64::MAX),
        timeout: RESTORE_TIMEOUT,
        sample_every: SAMPLE_EVERY,
    };
    let (o, restore_api_ns) = match &c.vmm {
        Vmm::Musubi { exe, .. } => {
            let mut cmd = Command::new(exe);
            cmd.args(["run", "--restore"])
                .arg(&snap)
                .args(["--serial", "stdio"]);
            let o = observe(cmd, &watch).map_err(|e| format!("cannot start musubi: {e}"))?;
            time_to_marker(&o, 0, ERROR_LINES)?;
            (o, None)
        }
        Vmm::Peer(m) => {
            let mut cmd = Command::new(&m.exe);
            let requests: Vec<(&str, &str, Option<String>)> = match m.kind {
                Kind::Firecracker => {
                    cmd.arg("--api-sock").arg(&socket);
                    let body = serde_json::json!({
                        "snapshot_path": snap.join("vmstate"),
                        "mem_backend": {"backend_type": "File", "backend_path": snap.join("memory")},
                        "resume_vm": true,
                    })
                    .to_string();
                    vec![("PUT", "/snapshot/load", Some(body))]
                }
                Kind::CloudHypervisor => {
                    cmd.arg("--api-socket")
                        .arg(format!("path={}", socket.display()))
                        .arg("--restore")
                        .arg(format!("source_url={url}"));
                    vec![("PUT", "/api/v1/vm.resume", None)]
                }
            };
            // The API requests go from a thread of their own while `observe` watches the
            // process; the thread gives up at RESTORE_TIMEOUT like `observe`.
            let sock = socket.clone();
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
            (o, Some(api_ns))
        }
    };
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
