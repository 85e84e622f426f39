//! `musubi bench api`: a VM's life cycle driven through the VMM's HTTP API by Cloud
//! Hypervisor's own client (`ch-remote`), Musubi beside Cloud Hypervisor on the same
//! VmConfig file, as a control plane drives a VMM that waits for its VMs.
//!
//! Each run starts the VMM with only an API socket and, in that one process, makes several
//! cycles of:
//!
//! 1. `ch-remote create FILE` and `ch-remote boot`, timed from just before the first spawn to
//!    the VMM's first `KVM_RUN` (the kernel's `sys_enter_ioctl` tracepoint, as `bench boot`
//!    times a boot);
//! 2. once the guest idles (it waits for a console line), `ch-remote shutdown` and
//!    `ch-remote delete`, timed until both returned and the process is idle again: its main
//!    thread sleeping (`/proc/PID/stat`) and no more threads than it had waiting
//!    (`/proc/PID/task`), the vCPU threads gone;
//! 3. the process's resident memory (`/proc/PID/smaps`), so the last cycle's can be set
//!    beside the first's: a leak per cycle shows as growth.

use super::apivm::{one_line, wait_until, Vm, Vmm};
use super::driver::{
    measured_per_config, print_unavailable, Missing, Outputs, PeerRow, Runs, Verdicts,
};
use super::kvm_trace::KvmRunTrace;
use super::peers::{self, Kind, Micro};
use super::qemu::{Outcome, Standing};
use super::report::{cell, median_min, mib, ms, Csv, Table};
use super::stats::{max, median, ratio, Summary};
use super::watch::parse_smaps;
use super::{find_on_path, is_executable, plot, BenchArgs, Harness};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use vmm::monotonic_ns;

const GUEST_MIB: u64 = 128;
/// Hello, then a wait for a console line that never comes: the guest idles in `hlt` until
/// it is shut down, so no guest work competes with the VMM's on a two-core host.
const TASKS: &str = "hello,console-echo=600";
/// The guest's line once it idles.
const IDLE_LINE: &str = "probe: console-echo: type a line";
/// Bound on each `ch-remote` call and each wait of a cycle.
const LIMIT: Duration = Duration::from_secs(60);
/// How often the process is looked at while it settles: finer than the figures it times.
const IDLE_POLL: Duration = Duration::from_micros(100);
/// How long a waiting VMM's thread count must hold before it counts as its idle one.
const STEADY: Duration = Duration::from_millis(50);
/// The variable naming Cloud Hypervisor's client, as the tests read it.
const CH_REMOTE_ENV: &str = "MUSUBI_CH_REMOTE";

const GOAL_FIRST_RUN_VS_CH: f64 = 0.5;
const GOAL_SOURCE: &str = "Musubi goal, same run";
/// What may stay behind per cycle, on average over a process's cycles: less than a page.
/// What a VM holds (its RAM, queues, device state, thread stacks) is pages each, so a
/// leak of it grows every cycle by more; a one-off step of the allocator's or a library's
/// (a page-sized arena first used in cycle 4, say) spreads under it.
const GROWTH_PER_CYCLE_KIB: f64 = 4.0;

/// One create/boot/shutdown/delete cycle. Times in ns.
#[derive(Clone, Debug)]
struct Cycle {
    /// `ch-remote create`, spawn to exit.
    create_ns: u64,
    /// `ch-remote boot`, spawn to exit.
    boot_ns: u64,
    /// Just before `create` is spawned to the VMM's first KVM_RUN (from the trace);
    /// `None` when the trace holds none of this process.
    to_first_run_ns: Option<u64>,
    /// The same from just before `boot` is spawned: the VMM's boot with one client start.
    boot_to_first_run_ns: Option<u64>,
    shutdown_ns: u64,
    delete_ns: u64,
    /// Just before `shutdown` is spawned to the process found idle.
    to_idle_ns: u64,
    /// Resident memory once idle: all of it, and what no other process shares.
    rss: u64,
    private_rss: u64,
    threads: usize,
    /// Anonymous mappings as large as guest RAM still there after delete.
    guest_mappings: usize,
}

/// One VMM process: how it waited before its first VM, and its cycles in order.
#[derive(Clone, Debug)]
struct Process {
    waiting_threads: usize,
    waiting_rss: u64,
    cycles: Vec<Cycle>,
}

type ApiRuns = Runs<Vmm, Outcome<Process>>;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("boots VMs through the VMM's API")?;
    let (reps, cycles) = if h.quick { (1, 3) } else { (3, 10) };
    let ch = ChRemote::find(args)?;
    let listed = peers::parse_compare(args.compare.as_deref())?;
    let trace = KvmRunTrace::open().map_err(|e| {
        format!(
            "create + boot to first KVM_RUN is timed by the kernel's sys_enter_ioctl tracepoint: {e}"
        )
    })?;
    let exe = crate::probe::musubi()?;
    let elf = crate::probe::materialize()?;
    let files = VmFiles::write(h, &elf)?;
    println!(
        "api: probe guest (probe.tasks={TASKS}), 1 vCPU, {GUEST_MIB} MiB, from the VmConfig {}",
        files.config.display()
    );
    println!(
        "  driven by {}; {reps} VMM process(es) per hypervisor, {cycles} cycles each, interleaved",
        ch.exe.display()
    );
    println!(
        "first KVM_RUN: from the sys_enter_ioctl tracepoint, tracefs instance {}",
        trace.path().display()
    );
    let (vmms, missing) = vmms(h, &listed, exe, &elf);
    let r = Rig {
        ch: &ch,
        files: &files,
        trace: &trace,
    };
    // One discarded process of one cycle each, so the first measured one does not pay for
    // cold caches; a peer whose warm-up fails is out, with its error.
    r.process(&vmms[0], 1)
        .map_err(|e| format!("musubi warm-up run: {e}"))?;
    let mut standing: Vec<Standing> = vmms.iter().map(|_| Standing::default()).collect();
    for (v, st) in vmms.iter().zip(standing.iter_mut()).skip(1) {
        let _ = st.run(&format!("{} warm-up run", v.name()), || r.process(v, 1));
    }
    let runs = Runs::measure_indexed(
        h,
        vmms,
        reps,
        |v| v.name().to_string(),
        |rep, i, v| match v {
            Vmm::Musubi { .. } => r.process(v, cycles).map(Outcome::Measured),
            Vmm::Peer(_) => Ok(
                standing[i].run(&format!("{} run {}", v.name(), rep + 1), || {
                    r.process(v, cycles)
                }),
            ),
        },
    )?;
    // A peer that failed its warm-up has no runs, and one row that says why.
    let mut no_runs = missing.clone();
    for (i, (v, st)) in runs.configs.iter().zip(&standing).enumerate().skip(1) {
        let ran = runs
            .runs
            .iter()
            .any(|r| r.1 == i && !matches!(r.2, Outcome::NotMade));
        if let (false, Some(why)) = (ran, &st.unavailable) {
            no_runs.push((v.name().into(), why.clone()));
        }
    }
    let csv_path = Outputs::new(h).csv("api.csv", &csv(&runs, &no_runs))?;
    let sums: Vec<Sums> = measured_per_config(&runs)
        .iter()
        .map(|p| Sums::of(p))
        .collect();
    print_table(&runs.configs, &sums, cycles);
    print_unavailable(
        runs.configs.iter().map(Vmm::name).zip(&standing).skip(1),
        &missing,
    );
    println!();
    print!("{}", verdicts(&runs.configs, &sums, cycles).table());
    if !runs
        .configs
        .iter()
        .any(|v| matches!(v, Vmm::Peer(m) if m.kind == Kind::CloudHypervisor))
    {
        println!("(no --compare cloud-hypervisor: the goal against Cloud Hypervisor is not measured, n/a)");
    }
    println!();
    print!("{NOTES}");
    let svg_path = Outputs::new(h).bars(
        "api.svg",
        "musubi bench api",
        &panels(&runs.configs, &sums, cycles),
    )?;
    println!();
    println!("wrote {} and {}", csv_path.display(), svg_path.display());
    Ok(())
}

const NOTES: &str = "\
create + boot: from just before `ch-remote create` is spawned to the VMM's first KVM_RUN
  (tracepoint, clock mono); both calls' own times are beside it, each spawn to exit, so
  ch-remote's start-up (twice) is in every VMM's figure alike. boot to KVM_RUN: the same
  from just before `ch-remote boot` is spawned (one client start and the VMM's boot).
shutdown + delete: from just before `ch-remote shutdown` is spawned until both calls
  returned and the process is idle: its main thread sleeping (/proc/PID/stat) with no more
  threads than it had waiting for its first VM (/proc/PID/task). threads: waiting / the
  most any process kept after a delete.
RSS: the VMM's resident set (/proc/PID/smaps) once idle after delete, and before the first
  create; medians over the processes. Growth: after the last delete minus after the first.
This machine runs KVM nested, but these are the VMM's own work on the host: the guest only
  idles between boot and shutdown.
";

/// Musubi and Cloud Hypervisor when listed and found, and the listed peers that cannot run
/// with why.
fn vmms(h: &Harness, listed: &[&str], exe: PathBuf, elf: &Path) -> (Vec<Vmm>, Missing) {
    let mut vmms = vec![Vmm::Musubi {
        exe,
        elf: elf.to_path_buf(),
    }];
    let mut missing = Missing::new();
    for name in listed {
        if Kind::of(name) != Some(Kind::CloudHypervisor) {
            println!("{name}: not compared here (api compares cloud-hypervisor, whose API ch-remote drives)");
            continue;
        }
        match Micro::find(Kind::CloudHypervisor, elf, &h.out) {
            Ok(m) => {
                println!("cloud-hypervisor: runs with its seccomp filters");
                vmms.push(Vmm::Peer(m));
            }
            Err(why) => {
                println!("cloud-hypervisor: unavailable, Musubi runs alone: {why}");
                missing.push(("cloud-hypervisor".into(), why));
            }
        }
    }
    (vmms, missing)
}

/// Cloud Hypervisor's client, run once per call as a person or a control plane would.
struct ChRemote {
    exe: PathBuf,
}

impl ChRemote {
    /// `--ch-remote`, else `MUSUBI_CH_REMOTE`, else `ch-remote` on PATH, else the shared
    /// peers' folder beside the workspace (where the tests look too).
    fn find(args: &BenchArgs) -> Result<ChRemote, String> {
        let (exe, from) = if let Some(p) = &args.ch_remote {
            (p.clone(), "--ch-remote")
        } else if let Some(p) = std::env::var_os(CH_REMOTE_ENV) {
            (PathBuf::from(p), CH_REMOTE_ENV)
        } else if let Some(p) = find_on_path("ch-remote") {
            (p, "PATH")
        } else {
            (
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/anchors/ch-remote"),
                "the default",
            )
        };
        if is_executable(&exe) {
            Ok(ChRemote { exe })
        } else {
            Err(format!(
                "ch-remote ({from}) {} is not an executable file: this benchmark drives every \
                 VMM with Cloud Hypervisor's client; name it with --ch-remote PATH or \
                 {CH_REMOTE_ENV}, or put it on PATH",
                exe.display()
            ))
        }
    }

    /// `ch-remote --api-socket SOCKET ARGS...`, waited for without polling so its end is
    /// seen when it comes; killed after [`LIMIT`]. Its time from spawn to exit, or why it
    /// failed in its own words.
    fn call(&self, socket: &Path, args: &[&str]) -> Result<u64, String> {
        let what = format!("ch-remote {}", args.join(" "));
        let start = monotonic_ns();
        let child = Command::new(&self.exe)
            .arg("--api-socket")
            .arg(socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.exe.display()))?;
        let pid = child.id() as libc::pid_t;
        let (done, ended) = mpsc::channel::<()>();
        let guard = std::thread::spawn(move || {
            let late = matches!(
                ended.recv_timeout(LIMIT),
                Err(mpsc::RecvTimeoutError::Timeout)
            );
            if late {
                // SAFETY: kill(2) on our own child, which the caller is still waiting for
                // (it sends on `done` as soon as the wait returns), so not yet reaped.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            late
        });
        let out = child.wait_with_output();
        let took = monotonic_ns().saturating_sub(start);
        let _ = done.send(());
        let killed = guard.join().unwrap_or(false);
        let out = out.map_err(|e| format!("{what}: {e}"))?;
        if killed {
            return Err(format!("{what}: no answer within {} s", LIMIT.as_secs()));
        }
        if !out.status.success() {
            let said = String::from_utf8_lossy(&out.stderr);
            // Cloud Hypervisor's errors carry a backtrace of "<unknown>" frames.
            let said = said.split("Stack backtrace:").next().unwrap_or("");
            return Err(format!(
                "{what} failed ({}): {}",
                out.status,
                one_line(said, 400)
            ));
        }
        Ok(took)
    }
}

/// The VmConfig both VMMs are given, and the console file it names.
struct VmFiles {
    config: PathBuf,
    console: PathBuf,
}

impl VmFiles {
    /// Cloud Hypervisor's VmConfig for the probe guest (as the tests write it, without
    /// Musubi's extension, so both VMMs read the very same file), in `--out`.
    fn write(h: &Harness, elf: &Path) -> Result<VmFiles, String> {
        let (config, console) = (h.out_file("api-vm.json"), h.out_file("api-console.out"));
        let json = serde_json::json!({
            "payload": {"kernel": elf, "cmdline": format!("probe.tasks={TASKS}")},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": GUEST_MIB << 20, "shared": false, "hugepages": false},
            "serial": {"mode": "File", "file": console},
            "console": {"mode": "Off"},
        });
        std::fs::write(&config, json.to_string())
            .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        Ok(VmFiles { config, console })
    }
}

/// What every run uses.
struct Rig<'a> {
    ch: &'a ChRemote,
    files: &'a VmFiles,
    trace: &'a KvmRunTrace,
}

impl Rig<'_> {
    /// One VMM process: started with only its API socket, `cycles` cycles, then killed.
    fn process(&self, v: &Vmm, cycles: usize) -> Result<Process, String> {
        let tmp =
            tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
        let socket = tmp.path().join("api.sock");
        let cmd = match v {
            Vmm::Musubi { exe, .. } => {
                let mut c = Command::new(exe);
                c.args(["vmm", "--api-socket"]).arg(&socket);
                c
            }
            Vmm::Peer(m) => {
                let mut c = Command::new(&m.exe);
                c.arg("--api-socket")
                    .arg(format!("path={}", socket.display()));
                c
            }
        };
        let vm = Vm::start(cmd, v.name(), tmp.path())?;
        let pid = vm.child.id();
        wait_until(&vm, "its API socket", LIMIT, || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        })?;
        let waiting_threads = settle_waiting(&vm, pid)?;
        let waiting_rss = rss(pid)?.total;
        let mut out = Process {
            waiting_threads,
            waiting_rss,
            cycles: Vec::with_capacity(cycles),
        };
        for k in 0..cycles {
            let c = self
                .cycle(&vm, &socket, waiting_threads)
                .map_err(|e| format!("cycle {}: {e}", k + 1))?;
            out.cycles.push(c);
        }
        Ok(out)
    }

    fn cycle(&self, vm: &Vm, socket: &Path, waiting_threads: usize) -> Result<Cycle, String> {
        let pid = vm.child.id();
        let config = self.files.config.to_string_lossy();
        // Each boot opens the console file anew; the last one's lines must not count.
        let _ = std::fs::remove_file(&self.files.console);
        self.trace.clear()?;
        let t0 = monotonic_ns();
        let create_ns = self.ch.call(socket, &["create", &config])?;
        let tb = monotonic_ns();
        let boot_ns = self.ch.call(socket, &["boot"])?;
        vm.wait_for_line(&self.files.console, IDLE_LINE, LIMIT)?;
        let first_run = self.trace.first_run_ns(pid)?;
        let t1 = monotonic_ns();
        let shutdown_ns = self.ch.call(socket, &["shutdown"])?;
        let delete_ns = self.ch.call(socket, &["delete"])?;
        let (threads, idle_at) = settle(vm, pid, waiting_threads)?;
        let r = rss(pid)?;
        Ok(Cycle {
            create_ns,
            boot_ns,
            to_first_run_ns: first_run.map(|at| at.saturating_sub(t0)),
            boot_to_first_run_ns: first_run.map(|at| at.saturating_sub(tb)),
            shutdown_ns,
            delete_ns,
            to_idle_ns: idle_at.saturating_sub(t1),
            rss: r.total,
            private_rss: r.private,
            threads,
            guest_mappings: r.guest_mappings,
        })
    }
}

/// The threads of a VMM idle before its first VM. The socket can come before the VMM's last
/// thread (Musubi starts its signal thread just after it binds the socket), so the count
/// must have held over [`STEADY`] with the main thread asleep at both ends.
fn settle_waiting(vm: &Vm, pid: u32) -> Result<usize, String> {
    let mut n = settle(vm, pid, usize::MAX)?.0;
    loop {
        std::thread::sleep(STEADY);
        let again = settle(vm, pid, usize::MAX)?.0;
        if again == n {
            return Ok(n);
        }
        n = again;
    }
}

/// Waits until the process is idle: its main thread sleeping and at most `threads` threads
/// (`usize::MAX`: any number). Its thread count then, and when it was first seen idle.
fn settle(vm: &Vm, pid: u32, threads: usize) -> Result<(usize, u64), String> {
    let start = monotonic_ns();
    loop {
        let state = main_thread_state(pid)?;
        let n = thread_count(pid)?;
        if state == "S" && n <= threads {
            return Ok((n, monotonic_ns()));
        }
        if vm.ended() {
            return Err(format!("ended while settling; {}", vm.said()));
        }
        if monotonic_ns().saturating_sub(start) > LIMIT.as_nanos() as u64 {
            return Err(format!(
                "not idle within {} s: /proc/{pid}/stat state {}, {} threads (waiting, it had {})",
                LIMIT.as_secs(),
                state,
                n,
                if threads == usize::MAX {
                    "any".to_string()
                } else {
                    threads.to_string()
                }
            ));
        }
        std::thread::sleep(IDLE_POLL);
    }
}

/// The state letter of `/proc/PID/stat` (the field after the command name, which may hold
/// any character and so is skipped from its closing parenthesis).
fn main_thread_state(pid: u32) -> Result<String, String> {
    let p = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))?;
    state_of(&text).ok_or_else(|| format!("{p}: no state in {text:?}"))
}

fn state_of(stat: &str) -> Option<String> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().next().map(str::to_string)
}

fn thread_count(pid: u32) -> Result<usize, String> {
    let p = format!("/proc/{pid}/task");
    Ok(std::fs::read_dir(&p)
        .map_err(|e| format!("{p}: {e}"))?
        .count())
}

fn rss(pid: u32) -> Result<super::watch::Rss, String> {
    let p = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))?;
    Ok(parse_smaps(&text, GUEST_MIB << 20))
}

/// `api.csv`: a row per cycle; a peer that failed a run, or never ran, has one row saying
/// why.
fn csv(runs: &ApiRuns, missing: &[(String, String)]) -> Csv {
    /// Run, process (repetition), cycle, hypervisor, threads and RSS while waiting.
    type Head = (String, String, String, String, String, String);
    let msf = |n: u64| ms(n as f64);
    let cols = super::driver::Columns::new()
        .head("run", |h: &Head| h.0.clone())
        .head("process", |h| h.1.clone())
        .head("cycle", |h| h.2.clone())
        .head("hypervisor", |h| h.3.clone())
        .head("waiting_threads", |h| h.4.clone())
        .head("waiting_rss_mib", |h| h.5.clone())
        .measured("create_ms", move |c: &Cycle| msf(c.create_ns))
        .measured("boot_ms", move |c| msf(c.boot_ns))
        .measured("to_first_kvm_run_ms", |c| {
            cell(c.to_first_run_ns.map(|n| ms(n as f64)))
        })
        .measured("boot_to_first_kvm_run_ms", |c| {
            cell(c.boot_to_first_run_ns.map(|n| ms(n as f64)))
        })
        .measured("shutdown_ms", move |c| msf(c.shutdown_ns))
        .measured("delete_ms", move |c| msf(c.delete_ns))
        .measured("to_idle_ms", move |c| msf(c.to_idle_ns))
        .measured("rss_after_delete_mib", |c| mib(c.rss as f64))
        .measured(
            "private_rss_after_delete_mib",
            |c| mib(c.private_rss as f64),
        )
        .measured("threads_after_delete", |c| c.threads.to_string())
        .measured("guest_mappings_after_delete", |c| {
            c.guest_mappings.to_string()
        })
        .unavailable();
    let mut rows = Vec::new();
    for (i, (rep, c, r)) in runs.runs.iter().enumerate() {
        let name = runs.configs[*c].name().to_string();
        let head = |k: String, p: Option<&Process>| {
            (
                (i + 1).to_string(),
                (rep + 1).to_string(),
                k,
                name.clone(),
                cell(p.map(|p| p.waiting_threads)),
                cell(p.map(|p| mib(p.waiting_rss as f64))),
            )
        };
        match r {
            Outcome::Measured(p) => {
                rows.extend(p.cycles.iter().enumerate().map(|(k, cy)| PeerRow {
                    head: head((k + 1).to_string(), Some(p)),
                    measured: Some(cy),
                    unavailable: String::new(),
                }))
            }
            Outcome::PeerFailed(why) => rows.push(PeerRow::missing(head(String::new(), None), why)),
            Outcome::NotMade => {}
        }
    }
    let empty = String::new;
    rows.extend(missing.iter().map(|(name, why)| {
        PeerRow::missing(
            (empty(), empty(), empty(), name.clone(), empty(), empty()),
            why,
        )
    }));
    cols.csv(rows)
}

/// One VMM's figures over all its measured processes.
struct Sums {
    first_run: Option<Summary>,
    boot_first_run: Option<Summary>,
    create: Option<Summary>,
    boot: Option<Summary>,
    to_idle: Option<Summary>,
    shutdown: Option<Summary>,
    delete: Option<Summary>,
    /// Medians over the processes: waiting, after the first and after the last delete.
    rss_waiting: Option<f64>,
    rss_first: Option<f64>,
    rss_last: Option<f64>,
    /// The largest growth (last minus first) of any process.
    growth: Option<f64>,
    /// Threads: waiting, and the most any process kept after a delete.
    threads_waiting: Option<f64>,
    threads_after: Option<f64>,
}

impl Sums {
    fn of(procs: &[&Process]) -> Sums {
        let cycles: Vec<&Cycle> = procs.iter().flat_map(|p| &p.cycles).collect();
        let over = |f: &dyn Fn(&Cycle) -> Option<u64>| {
            Summary::of(
                &cycles
                    .iter()
                    .filter_map(|c| f(c).map(|n| n as f64))
                    .collect::<Vec<_>>(),
            )
        };
        let per = |f: &dyn Fn(&Process) -> Option<f64>| -> Vec<f64> {
            procs.iter().filter_map(|p| f(p)).collect()
        };
        let first = |p: &Process| p.cycles.first().map(|c| c.rss as f64);
        let last = |p: &Process| p.cycles.last().map(|c| c.rss as f64);
        Sums {
            first_run: over(&|c| c.to_first_run_ns),
            boot_first_run: over(&|c| c.boot_to_first_run_ns),
            create: over(&|c| Some(c.create_ns)),
            boot: over(&|c| Some(c.boot_ns)),
            to_idle: over(&|c| Some(c.to_idle_ns)),
            shutdown: over(&|c| Some(c.shutdown_ns)),
            delete: over(&|c| Some(c.delete_ns)),
            rss_waiting: median(&per(&|p| Some(p.waiting_rss as f64))),
            rss_first: median(&per(&first)),
            rss_last: median(&per(&last)),
            growth: max(&per(&|p| Some(last(p)? - first(p)?))),
            threads_waiting: median(&per(&|p| Some(p.waiting_threads as f64))),
            threads_after: max(&cycles.iter().map(|c| c.threads as f64).collect::<Vec<_>>()),
        }
    }
}

fn kib(bytes: f64) -> String {
    format!("{:.0}", bytes / 1024.0)
}

fn print_table(configs: &[Vmm], sums: &[Sums], cycles: usize) {
    let last = format!(">after delete {cycles}");
    let mut t = Table::new(&[
        "hypervisor",
        ">create+boot to KVM_RUN ms (med / min)",
        ">create ms",
        ">boot ms",
        ">boot to KVM_RUN ms",
        ">shutdown+delete to idle ms (med / min)",
        ">shutdown ms",
        ">delete ms",
        ">RSS MiB waiting",
        ">after delete 1",
        &last,
        ">growth KiB",
        ">threads",
    ]);
    let med = |s: Option<Summary>| s.map(|s| ms(s.median)).unwrap_or_else(|| "n/a".into());
    let na = || "n/a".to_string();
    for (v, s) in configs.iter().zip(sums) {
        if s.to_idle.is_none() {
            t.row([v.name().to_string(), "unavailable (below)".into()]);
            continue;
        }
        t.row([
            v.name().to_string(),
            median_min(s.first_run, ms),
            med(s.create),
            med(s.boot),
            med(s.boot_first_run),
            median_min(s.to_idle, ms),
            med(s.shutdown),
            med(s.delete),
            s.rss_waiting.map(mib).unwrap_or_else(na),
            s.rss_first.map(mib).unwrap_or_else(na),
            s.rss_last.map(mib).unwrap_or_else(na),
            s.growth.map(kib).unwrap_or_else(na),
            format!(
                "{} / {}",
                s.threads_waiting
                    .map(|n| format!("{n:.0}"))
                    .unwrap_or_else(na),
                s.threads_after
                    .map(|n| format!("{n:.0}"))
                    .unwrap_or_else(na)
            ),
        ]);
    }
    let r = |a: Option<f64>, b: Option<f64>| {
        a.zip(b)
            .and_then(|(a, b)| ratio(a, b))
            .map(|x| format!("{x:.2}x"))
            .unwrap_or_else(na)
    };
    let both = |m: Option<Summary>, p: Option<Summary>| {
        format!(
            "{} / {}",
            r(m.map(|s| s.median), p.map(|s| s.median)),
            r(m.map(|s| s.min), p.map(|s| s.min))
        )
    };
    let medr = |m: Option<Summary>, p: Option<Summary>| r(m.map(|s| s.median), p.map(|s| s.median));
    let m = &sums[0];
    for (v, p) in configs.iter().zip(sums).skip(1) {
        if p.to_idle.is_none() {
            continue;
        }
        t.row([
            format!("musubi / {}", v.name()),
            both(m.first_run, p.first_run),
            medr(m.create, p.create),
            medr(m.boot, p.boot),
            medr(m.boot_first_run, p.boot_first_run),
            both(m.to_idle, p.to_idle),
            medr(m.shutdown, p.shutdown),
            medr(m.delete, p.delete),
            r(m.rss_waiting, p.rss_waiting),
            r(m.rss_first, p.rss_first),
            r(m.rss_last, p.rss_last),
        ]);
    }
    println!();
    print!("{}", t.render());
}

fn verdicts(configs: &[Vmm], sums: &[Sums], cycles: usize) -> Verdicts {
    let ch = configs
        .iter()
        .zip(sums)
        .find(|(v, _)| matches!(v, Vmm::Peer(m) if m.kind == Kind::CloudHypervisor))
        .and_then(|(_, s)| s.first_run);
    let m = &sums[0];
    let vs = |f: fn(&Summary) -> f64| ch.zip(m.first_run).and_then(|(p, m)| ratio(f(&m), f(&p)));
    let mut v = Verdicts::new();
    let goal = format!("<= {GOAL_FIRST_RUN_VS_CH:.2}x");
    for (what, r) in [("median", vs(|s| s.median)), ("min", vs(|s| s.min))] {
        v.judged(
            format!("Musubi's time to first KVM_RUN / Cloud Hypervisor's ({what})"),
            r,
            |x| format!("{x:.2}x"),
            goal.clone(),
            GOAL_SOURCE,
            |x| x <= GOAL_FIRST_RUN_VS_CH,
        );
    }
    let intervals = cycles.saturating_sub(1).max(1) as f64;
    v.judged(
        format!("musubi RSS growth per cycle, (after delete {cycles} - after delete 1) / {intervals} (max)"),
        m.growth.map(|b| b / 1024.0 / intervals),
        |x| format!("{x:.1} KiB"),
        format!("< {GROWTH_PER_CYCLE_KIB:.0} KiB"),
        "no leak across cycles",
        |x| x < GROWTH_PER_CYCLE_KIB,
    );
    v
}

fn panels(configs: &[Vmm], sums: &[Sums], cycles: usize) -> Vec<plot::Panel> {
    let bars = |f: &dyn Fn(&Sums) -> Option<Summary>| {
        super::driver::summary_bars(
            configs
                .iter()
                .zip(sums)
                .map(|(v, s)| (v, f(s).map(|x| x.scaled(1e-6)))),
            |v: &Vmm| v.name().to_string(),
        )
    };
    let in_mib = |b: f64| b / (1u64 << 20) as f64;
    let mut memory = Vec::new();
    for (v, s) in configs.iter().zip(sums) {
        for (when, b) in [
            ("waiting".to_string(), s.rss_waiting),
            ("after delete 1".to_string(), s.rss_first),
            (format!("after delete {cycles}"), s.rss_last),
        ] {
            if let Some(b) = b {
                memory.push(plot::Bar {
                    label: format!("{} {when}", v.name()),
                    value: in_mib(b),
                    low: None,
                });
            }
        }
    }
    vec![
        plot::Panel {
            title: "ch-remote create + boot to first KVM_RUN (median, min)".into(),
            unit: "ms".into(),
            bars: bars(&|s| s.first_run),
        },
        plot::Panel {
            title: "ch-remote shutdown + delete to idle (median, min)".into(),
            unit: "ms".into(),
            bars: bars(&|s| s.to_idle),
        },
        plot::Panel {
            title: "VMM resident set (median over processes)".into(),
            unit: "MiB".into(),
            bars: memory,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_follows_the_last_parenthesis_of_the_command_name() {
        assert_eq!(
            state_of("4242 (musubi) S 1 4242 4242 0 -1").as_deref(),
            Some("S")
        );
        assert_eq!(state_of("77 (fc_vcpu (0)) R 1 77").as_deref(), Some("R"));
        assert_eq!(state_of("garbage"), None);
    }
}
