//! QEMU as a comparison peer: which executable, which machine and CPU model boot the probe
//! guest on this host, and, when none does, QEMU's own words on why.
//!
//! QEMU is what Musubi is measured against, not what is measured: a peer that is missing,
//! refuses the host's CPU, crashes, hangs or prints nonsense is reported as unavailable and
//! the benchmark goes on with Musubi's own figures.

use super::watch::{observe, time_to_marker, Watch};
use super::{find_on_path, is_executable, BenchArgs};
use crate::probe;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub const QEMU: &str = "qemu-system-x86_64";
/// isa-debug-exit reports exit-port value N as status (N << 1) | 1; the probe writes 0 after
/// its tasks.
pub const CLEAN_STATUS: i32 = 1;
pub const HELLO_MARKER: &str = "{\"probe\":\"hello\"";

/// `-cpu` values in the order tried (`None`: QEMU's default). `host` shows the guest what
/// Musubi shows it, so it comes first. Some QEMU and kernel pairs refuse a value `host`
/// carries over (QEMU 7.2 on a 6.18 kernel aborts with "failed to set MSR 0x10a"), which
/// `-arch-capabilities` leaves out; `max` and the default are the last resorts. Which one
/// works changes with the host, so every benchmark run finds it again.
const CPU_MODELS: [Option<&str>; 4] = [
    Some("host"),
    Some("host,-arch-capabilities"),
    Some("max"),
    None,
];

/// How long finding a working set-up may take.
struct Patience {
    /// One try: a hello boot takes QEMU about a second even where guest kernel code is
    /// emulated.
    one: Duration,
    /// All tries together, so that a peer that hangs holds the benchmark up for a minute at
    /// most.
    all: Duration,
}

const PATIENCE: Patience = Patience {
    one: Duration::from_secs(20),
    all: Duration::from_secs(60),
};
/// How much of QEMU's stderr a report quotes: its error and the abort that may follow it.
pub const STDERR_LINES: usize = 3;
const PROBE_MIB: u64 = 128;

/// QEMU set up as it booted the probe guest on this host.
#[derive(Clone, Debug)]
pub struct Qemu {
    exe: PathBuf,
    elf: PathBuf,
    pub machine: &'static str,
    cpu: Option<&'static str>,
}

impl Qemu {
    /// The start of every QEMU command line here: KVM with the probed machine and CPU model,
    /// one vCPU, no default devices, user configuration or display, the console on stdout,
    /// the probe guest booted with `append`, and the exit port it ends through. Its threads
    /// are named for what they run (`CPU 0/KVM`), so their CPU time can be read apart.
    pub fn command(&self, memory_mib: u64, append: &str) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.args(["-M", self.machine, "-enable-kvm"]);
        if let Some(cpu) = self.cpu {
            cmd.args(["-cpu", cpu]);
        }
        cmd.arg("-m")
            .arg(format!("{memory_mib}M"))
            .args(["-smp", "1", "-nodefaults", "-no-user-config"])
            .args(["-display", "none", "-serial", "stdio"])
            .arg("-kernel")
            .arg(&self.elf)
            .arg("-append")
            .arg(append)
            .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=4"])
            .args(["-name", "probe,debug-threads=on"]);
        cmd
    }

    /// The probe guest's hello task, 1 vCPU, 128 MiB: the probe boot, and `bench boot`'s run.
    pub fn hello_command(&self) -> Command {
        self.command(PROBE_MIB, "probe.tasks=hello")
    }

    /// The `-cpu` value, for tables and CSV files.
    pub fn cpu_model(&self) -> &'static str {
        self.cpu.unwrap_or("default")
    }

    /// The options that chose the machine and CPU model, as on QEMU's command line.
    pub fn options(&self) -> String {
        match self.cpu {
            Some(cpu) => format!("-M {} -cpu {cpu}", self.machine),
            None => format!("-M {} (QEMU's default CPU model)", self.machine),
        }
    }
}

/// The peer as this benchmark run has it.
pub enum Peer {
    /// Neither asked for nor installed: why it is left out.
    Skipped(String),
    Ready(Qemu),
    /// Asked for or installed, but it cannot boot the probe guest: why, on one line, in
    /// QEMU's own words where it said any.
    Unavailable(String),
}

/// What became of one scheduled run in a benchmark that compares with the peer.
pub enum Outcome<S> {
    Measured(S),
    /// The peer failed this run: why.
    PeerFailed(String),
    /// Not made: the peer was unavailable by then.
    NotMade,
}

impl<S> Outcome<S> {
    pub fn measured(&self) -> Option<&S> {
        match self {
            Outcome::Measured(s) => Some(s),
            _ => None,
        }
    }
}

/// The measured samples of each of `configs` configurations, from `run_schedule`'s runs
/// (rep, configuration, outcome); failed and unmade runs left out.
pub fn measured_per_config<S>(runs: &[(usize, usize, Outcome<S>)], configs: usize) -> Vec<Vec<&S>> {
    (0..configs)
        .map(|c| {
            runs.iter()
                .filter(|r| r.1 == c)
                .filter_map(|r| r.2.measured())
                .collect()
        })
        .collect()
}

/// Whether the peer is still in the running, over one benchmark run. It drops out at its
/// probe or its first failed run, and its remaining runs are not made: a peer that hangs
/// would otherwise cost its whole time limit on every run.
#[derive(Default)]
pub struct Standing {
    /// Why the peer is unavailable, once it is.
    pub unavailable: Option<String>,
}

impl Standing {
    /// Makes the peer's run `what` with `f`, unless the peer has dropped out.
    pub fn run<S>(&mut self, what: &str, f: impl FnOnce() -> Result<S, String>) -> Outcome<S> {
        if self.unavailable.is_some() {
            return Outcome::NotMade;
        }
        match f() {
            Ok(s) => Outcome::Measured(s),
            Err(e) => {
                self.unavailable = Some(format!("{what} failed: {e}"));
                Outcome::PeerFailed(e)
            }
        }
    }

    /// The report's line on the peer when it dropped out.
    pub fn print(&self) {
        self.print_as("qemu");
    }

    /// The same for the peer called `name`.
    pub fn print_as(&self, name: &str) {
        if let Some(why) = &self.unavailable {
            println!("{name}: unavailable, no comparison: {why}");
        }
    }
}

/// Finds QEMU (`--qemu`, else `qemu-system-x86_64` on PATH) and, when `--compare` lists
/// `qemu`, `--qemu` asks for it, or it is installed and no `--compare` list leaves it out, boots the probe guest with each of `machines`
/// and each CPU model in turn until one works, printing what it tried. Fails only on a
/// `--compare` value that names no peer, the one mistake the person must correct.
pub fn peer(args: &BenchArgs, machines: &[&'static str]) -> Result<Peer, String> {
    let listed = super::peers::parse_compare(args.compare.as_deref())?;
    let asked = listed.contains(&"qemu") || args.qemu.is_some();
    if args.compare.is_some() && !asked {
        return Ok(Peer::Skipped("not in --compare".into()));
    }
    let exe = match &args.qemu {
        Some(p) if is_executable(p) => Ok(p.clone()),
        Some(p) => Err(format!("--qemu {}: not an executable file", p.display())),
        None => find_on_path(QEMU).ok_or_else(|| {
            format!("{QEMU} is not on PATH (Debian: apt-get install qemu-system-x86)")
        }),
    };
    let exe = match exe {
        Ok(exe) => exe,
        Err(why) if asked => return Ok(unavailable(why)),
        Err(why) => return Ok(Peer::Skipped(why)),
    };
    let elf = match probe::materialize() {
        Ok(elf) => elf,
        Err(e) => {
            return Ok(unavailable(format!(
                "cannot write the probe guest's ELF for it: {e}"
            )))
        }
    };
    Ok(match start(&exe, &elf, machines, &PATIENCE) {
        Ok(q) => {
            println!("QEMU: runs with {} ({})", q.options(), exe.display());
            Peer::Ready(q)
        }
        Err(tries) => unavailable(summary(&tries)),
    })
}

fn unavailable(why: String) -> Peer {
    println!("QEMU: unavailable, Musubi runs alone: {why}");
    Peer::Unavailable(why)
}

/// One failed try of a machine and CPU model.
#[derive(Debug)]
struct Try {
    options: String,
    why: String,
}

/// The failed tries on one line: once when they all failed alike, as a QEMU that cannot
/// reach KVM does, else each with its own reason.
fn summary(tries: &[Try]) -> String {
    match tries {
        [first, rest @ ..] if !rest.is_empty() && rest.iter().all(|t| t.why == first.why) => {
            format!(
                "all {} set-ups tried failed alike: {}",
                tries.len(),
                first.why
            )
        }
        _ => tries
            .iter()
            .map(|t| format!("{}: {}", t.options, t.why))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// Boots the probe guest's hello task with each machine (preferred first) and each CPU
/// model until one prints hello and exits cleanly, printing each failed try; returns what
/// every failed try said if none works.
fn start(
    exe: &Path,
    elf: &Path,
    machines: &[&'static str],
    patience: &Patience,
) -> Result<Qemu, Vec<Try>> {
    let started = Instant::now();
    let mut failed = Vec::new();
    for &machine in machines {
        for cpu in CPU_MODELS {
            let q = Qemu {
                exe: exe.to_path_buf(),
                elf: elf.to_path_buf(),
                machine,
                cpu,
            };
            let left = patience.all.saturating_sub(started.elapsed());
            if left.is_zero() {
                failed.push(Try {
                    options: q.options(),
                    why: format!(
                        "not tried, the {:.0} s for finding a working set-up were spent",
                        patience.all.as_secs_f64()
                    ),
                });
                continue;
            }
            let watch = Watch {
                marker: HELLO_MARKER,
                guest_bytes: None,
                timeout: left.min(patience.one),
                sample_every: Duration::from_millis(10),
            };
            let why = match observe(q.hello_command(), &watch) {
                Ok(o) => match time_to_marker(&o, CLEAN_STATUS, STDERR_LINES) {
                    Ok(_) => return Ok(q),
                    Err(e) => e,
                },
                Err(e) => format!("cannot start {}: {e}", exe.display()),
            };
            println!("QEMU: {} did not boot the probe guest: {why}", q.options());
            failed.push(Try {
                options: q.options(),
                why,
            });
        }
    }
    Err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(compare: Option<&str>, qemu: Option<PathBuf>) -> BenchArgs {
        BenchArgs {
            experiment: "boot".into(),
            quick: true,
            out: std::env::temp_dir(),
            compare: compare.map(String::from),
            extent: None,
            qemu,
            nodes: None,
            link_delay: std::time::Duration::from_micros(100),
            ch_remote: None,
        }
    }

    /// A stand-in for QEMU: a shell script with `body`.
    fn script(dir: &Path, body: &str) -> PathBuf {
        testkit::shell_script(&dir.join("fake-qemu"), body)
    }

    #[test]
    fn after_its_first_failure_the_peer_runs_no_more() {
        let mut st = Standing::default();
        assert!(matches!(
            st.run("run 1", || Ok::<_, String>(1)),
            Outcome::Measured(1)
        ));
        assert!(matches!(
            st.run("run 2", || Err::<u32, _>("crashed".to_string())),
            Outcome::PeerFailed(e) if e == "crashed"
        ));
        let mut called = false;
        assert!(matches!(
            st.run("run 3", || {
                called = true;
                Ok(3)
            }),
            Outcome::NotMade
        ));
        assert!(!called);
        assert_eq!(st.unavailable.as_deref(), Some("run 2 failed: crashed"));
    }

    #[test]
    fn an_unknown_peer_is_refused() {
        let e = peer(&args(Some("xen"), None), &["microvm"]).err().unwrap();
        assert!(e.starts_with("--compare \"xen\""), "{e}");
    }

    #[test]
    fn a_missing_qemu_is_unavailable_when_asked_for() {
        let p = PathBuf::from("/nonexistent/qemu");
        match peer(&args(None, Some(p)), &["microvm"]).unwrap() {
            Peer::Unavailable(why) => {
                assert_eq!(why, "--qemu /nonexistent/qemu: not an executable file")
            }
            _ => panic!("a missing --qemu was not reported as unavailable"),
        }
    }

    #[test]
    fn every_cpu_model_is_tried_and_each_refusal_quoted() {
        let dir = tempfile::tempdir().unwrap();
        let exe = script(dir.path(), "echo \"qemu: refused $*\" >&2; exit 1");
        let tries = start(&exe, Path::new("/dev/null"), &["microvm"], &PATIENCE)
            .err()
            .unwrap();
        let options: Vec<&str> = tries.iter().map(|t| t.options.as_str()).collect();
        assert_eq!(
            options,
            [
                "-M microvm -cpu host",
                "-M microvm -cpu host,-arch-capabilities",
                "-M microvm -cpu max",
                "-M microvm (QEMU's default CPU model)"
            ]
        );
        for t in &tries {
            assert!(
                t.why.starts_with(
                    "exited with status 1 but without the marker line; stderr: qemu: refused -M microvm -enable-kvm "
                ),
                "{t:?}"
            );
        }
        assert!(
            tries[0].why.contains("-enable-kvm -cpu host -m"),
            "{tries:?}"
        );
        assert!(!tries[3].why.contains("-cpu"), "{tries:?}");
        // Different words from each try: each is quoted with its set-up.
        let s = summary(&tries);
        assert!(
            s.starts_with("-M microvm -cpu host: exited with status 1")
                && s.contains("; -M microvm -cpu max: exited"),
            "{s}"
        );
    }

    #[test]
    fn tries_that_failed_alike_are_summed_up_once() {
        let t = |o: &str| Try {
            options: o.into(),
            why: "exited with status 1; stderr: no KVM".into(),
        };
        assert_eq!(
            summary(&[t("-M microvm -cpu host"), t("-M pc -cpu max")]),
            "all 2 set-ups tried failed alike: exited with status 1; stderr: no KVM"
        );
        assert_eq!(
            summary(&[t("-M microvm -cpu host")]),
            "-M microvm -cpu host: exited with status 1; stderr: no KVM"
        );
    }

    #[test]
    fn the_first_model_that_boots_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        // Refuses `-cpu host` as QEMU 7.2 did on a 6.18 kernel; boots with anything else.
        let exe = script(
            dir.path(),
            "case \" $* \" in *' -cpu host '*) echo 'error: failed to set MSR 0x10a to 0x69' >&2; kill -ABRT $$;; esac\n\
             echo '{\"probe\":\"hello\"}'; exit 1",
        );
        let q = start(&exe, Path::new("/dev/null"), &["microvm"], &PATIENCE).unwrap();
        assert_eq!(q.cpu_model(), "host,-arch-capabilities");
        assert_eq!(q.options(), "-M microvm -cpu host,-arch-capabilities");
    }

    #[test]
    fn a_peer_that_hangs_is_given_up_within_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let exe = script(dir.path(), "echo booting; sleep 30");
        let patience = Patience {
            one: Duration::from_millis(300),
            all: Duration::from_millis(700),
        };
        let tries = start(&exe, Path::new("/dev/null"), &["microvm"], &patience)
            .err()
            .unwrap();
        assert_eq!(tries.len(), CPU_MODELS.len(), "{tries:?}");
        assert!(
            tries[0].why.contains("killed; console: booting"),
            "{tries:?}"
        );
        assert_eq!(
            tries[3].why,
            "not tried, the 1 s for finding a working set-up were spent"
        );
    }

    #[test]
    fn a_run_that_prints_garbage_or_crashes_does_not_count() {
        let dir = tempfile::tempdir().unwrap();
        let w = Watch {
            marker: HELLO_MARKER,
            guest_bytes: None,
            timeout: PATIENCE.one,
            sample_every: Duration::from_millis(5),
        };
        let garbage = script(dir.path(), "head -c 300 /dev/urandom; exit 1");
        let o = observe(Command::new(&garbage), &w).unwrap();
        let e = time_to_marker(&o, CLEAN_STATUS, STDERR_LINES).unwrap_err();
        assert!(
            e.starts_with("exited with status 1 but without the marker line; console: "),
            "{e}"
        );
        let crash = script(dir.path(), "echo 'segfault here' >&2; kill -SEGV $$");
        let o = observe(Command::new(&crash), &w).unwrap();
        assert_eq!(
            time_to_marker(&o, CLEAN_STATUS, STDERR_LINES).unwrap_err(),
            "killed by signal 11; stderr: segfault here"
        );
    }
}
