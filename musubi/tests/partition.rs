//! `musubi partition` on this machine's real cgroups: life cycle, refusals, confinement of
//! VMs, isolation of supervisors, and state that outlives the CLI.
//!
//! Each test has its own state directory and cgroup prefix, so tests run in parallel
//! and beside other users of the host; a guard destroys the test's partitions even when an
//! assertion fails. These tests need root (writable cgroupfs) and /dev/kvm, and fail,
//! rather than skip, without them.

mod common;

use common::Run;
use partition::cgroup::Host;
use partition::manager::Manager;
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Iterations of the probe guest's CPU loop that keep a VM busy for several seconds here
/// (about 4.5 s per 10^9).
const LONG_SPIN: u64 = 2_000_000_000;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A private state directory and cgroup prefix; destroys every partition on drop.
struct Env {
    dir: tempfile::TempDir,
    prefix: String,
}

impl Env {
    fn new() -> Env {
        common::assert_kvm();
        check_cgroups_writable();
        Env {
            dir: tempfile::tempdir().unwrap(),
            prefix: format!(
                "mt{}x{}-",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::SeqCst)
            ),
        }
    }

    /// Partitions `a`, owning a disk of `bytes` bytes, and `b`, with none: the disk's
    /// path is returned.
    fn with_owned_disk(bytes: usize) -> (Env, PathBuf) {
        let env = Env::new();
        let owned = common::temp_image(env.state(), "owned.img", bytes);
        let o = owned.to_str().unwrap();
        env.ok(&[
            "create", "a", "--cpus", "0", "--memory", "512M", "--disk", o,
        ]);
        env.ok(&["create", "b", "--cpus", "1", "--memory", "512M"]);
        (env, owned)
    }

    fn state(&self) -> &Path {
        self.dir.path()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = common::musubi();
        // Before the subcommand: `run` takes everything after `--` for the VM.
        c.arg("partition")
            .arg("--state-dir")
            .arg(self.state())
            .args(args)
            .env("MUSUBI_CGROUP_PREFIX", &self.prefix)
            .stdin(Stdio::null());
        c
    }

    /// Runs one CLI command to completion.
    fn pm(&self, args: &[&str]) -> Run {
        let out = self
            .command(args)
            .output()
            .unwrap_or_else(|e| panic!("musubi partition {args:?}: {e}"));
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into(),
            stderr: String::from_utf8_lossy(&out.stderr).into(),
        }
    }

    /// Runs one CLI command that must end with `status`.
    fn expect(&self, args: &[&str], status: i32) -> Run {
        let r = self.pm(args);
        assert_eq!(
            r.code,
            Some(status),
            "musubi partition {args:?} should exit {status}:\n{}",
            r.explain()
        );
        r
    }

    fn ok(&self, args: &[&str]) -> Run {
        self.expect(args, 0)
    }

    /// A refused command: status 1 and its message.
    fn refused(&self, args: &[&str]) -> String {
        self.expect(args, 1).stderr
    }

    fn list(&self) -> Vec<Value> {
        let r = self.ok(&["list", "--json"]);
        serde_json::from_str::<Value>(&r.stdout)
            .unwrap_or_else(|e| panic!("list --json: {e}\n{}", r.stdout))
            .as_array()
            .cloned()
            .unwrap()
    }

    fn show(&self, name: &str) -> Value {
        let r = self.ok(&["show", name, "--json"]);
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("show --json: {e}\n{}", r.stdout))
    }

    fn vm(&self, name: &str, id: u64) -> Value {
        self.show(name)["vms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no vm {id} in partition {name}"))
    }

    /// Polls `vm` until `done` holds or `limit` passes.
    fn wait_vm(
        &self,
        name: &str,
        id: u64,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let v = self.vm(name, id);
            if done(&v) {
                return v;
            }
            assert!(
                start.elapsed() < limit,
                "vm {id} of {name} not in the expected state after {limit:?}: {v}\nconsole:\n{}",
                console(&v)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let Ok(m) = Manager::new(self.state(), PathBuf::from(env!("CARGO_BIN_EXE_musubi"))) else {
            return;
        };
        for name in m.store.names().unwrap_or_default() {
            if let Err(e) = m.destroy(&name) {
                eprintln!("cleanup: destroying partition {name}: {e}");
            }
        }
    }
}

fn check_cgroups_writable() {
    let host = Host::detect().unwrap_or_else(|e| {
        panic!("partition tests need cgroups (v1 cpuset, memory, blkio or v2): {e}")
    });
    let probe = host
        .plan(&format!("mt-writable-{}", std::process::id()))
        .unwrap();
    for p in &probe.places {
        let d = p.dir();
        if let Err(e) = std::fs::create_dir(&d) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                panic!(
                    "cgroups are not writable here ({}: {e}): partition tests need root and a \
                     writable cgroupfs",
                    d.display()
                );
            }
        }
        let _ = std::fs::remove_dir(&d);
    }
}

fn console(vm: &Value) -> String {
    std::fs::read_to_string(vm["log"].as_str().unwrap_or_default()).unwrap_or_default()
}

fn pid_alive(pid: u64) -> bool {
    partition::store::ProcId::of(pid as u32).is_some()
}

fn status_field(pid: u64, field: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// The cgroup paths a member of partition `p` shows in /proc/PID/cgroup.
fn member_paths(p: &Value) -> Vec<(String, String)> {
    p["cgroup"]["places"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pl| {
            (
                pl["controller"].as_str().unwrap().to_string(),
                pl["proc_path"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Asserts from /proc that `pid` (and each of its threads) is in partition `p`'s cgroup
/// and may run only on `cpus`.
fn assert_confined(pid: u64, p: &Value, cpus: &str) {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for (controller, path) in member_paths(p) {
        let found = cg.lines().any(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctls, rest) = (f.next(), f.next().unwrap_or(""), f.next());
            let ctl_ok = if controller == "unified" {
                ctls.is_empty()
            } else {
                ctls.split(',').any(|c| c == controller)
            };
            ctl_ok && rest == Some(path.as_str())
        });
        assert!(
            found,
            "pid {pid} is not in {controller} cgroup {path}; /proc/{pid}/cgroup:\n{cg}"
        );
    }
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let tid = task.file_name().to_string_lossy().to_string();
        let st = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if st.is_empty() {
            continue; // the thread ended meanwhile
        }
        let allowed = st
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim();
        assert_eq!(
            allowed, cpus,
            "thread {tid} of pid {pid} may run on CPUs {allowed}"
        );
    }
}

fn place_dirs(p: &Value) -> Vec<PathBuf> {
    p["cgroup"]["places"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pl| Path::new(pl["mount"].as_str().unwrap()).join(pl["rel"].as_str().unwrap()))
        .collect()
}

fn read_trim(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

#[test]
fn create_list_show_destroy() {
    let env = Env::new();
    let disk = common::temp_image(env.state(), "a.img", 1 << 20);
    let r = env.ok(&[
        "create",
        "alpha",
        "--cpus",
        "0",
        "--memory",
        "512M",
        "--io-weight",
        "100",
        "--disk",
        disk.to_str().unwrap(),
    ]);
    assert!(
        r.stdout.contains("partition alpha created"),
        "{}",
        r.explain()
    );
    let list = env.list();
    assert_eq!(list.len(), 1);
    let p = &list[0];
    assert_eq!(p["name"], "alpha");
    assert_eq!(p["cpus"], "0");
    assert_eq!(p["memory"], 512u64 << 20);
    assert_eq!(p["io_weight"], 100);
    assert_eq!(
        p["disks"][0],
        disk.canonicalize().unwrap().to_str().unwrap()
    );
    assert_eq!(p["supervisor_state"]["state"], "running", "{p}");
    let sup = p["supervisor_state"]["pid"].as_u64().unwrap();
    assert_eq!(p["supervisor"]["pid"], sup);
    assert_confined(sup, p, "0");

    // The cgroup really carries the limits.
    for d in place_dirs(p) {
        assert!(d.is_dir(), "{} missing", d.display());
        if d.join("cpuset.cpus").exists() {
            assert_eq!(read_trim(&d.join("cpuset.cpus")), "0");
        }
        if d.join("memory.limit_in_bytes").exists() {
            assert_eq!(
                read_trim(&d.join("memory.limit_in_bytes")),
                (512u64 << 20).to_string()
            );
        }
        if d.join("memory.max").exists() {
            assert_eq!(read_trim(&d.join("memory.max")), (512u64 << 20).to_string());
        }
    }

    let table = env.ok(&["list"]).stdout;
    assert!(table.contains("alpha"), "{table}");
    assert!(table.contains(&format!("pid {sup}")), "{table}");
    let detail = env.ok(&["show", "alpha"]).stdout;
    assert!(detail.contains("cpus        0"), "{detail}");
    assert!(detail.contains("memory      512M"), "{detail}");
    assert!(detail.contains("no VMs"), "{detail}");

    let r = env.ok(&["destroy", "alpha"]);
    assert!(
        r.stdout.contains("partition alpha destroyed"),
        "{}",
        r.explain()
    );
    for d in place_dirs(p) {
        assert!(!d.exists(), "cgroup {} left behind", d.display());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pid_alive(sup) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!pid_alive(sup), "supervisor {sup} outlived destroy");
    assert!(env.list().is_empty());
    assert!(env.ok(&["list"]).stdout.contains("no partitions"));
}

#[test]
fn conflicting_requests_are_refused_naming_the_partitions_involved() {
    let env = Env::new();
    let d1 = common::temp_image(env.state(), "d1.img", 4096);
    let d2 = common::temp_image(env.state(), "d2.img", 4096);
    let (d1s, d2s) = (d1.to_str().unwrap(), d2.to_str().unwrap());
    env.ok(&[
        "create", "a", "--cpus", "0", "--memory", "1G", "--disk", d1s,
    ]);

    let e = env.refused(&["create", "b", "--cpus", "0-1", "--memory", "1G"]);
    assert!(e.contains("overlaps partition a (cpus 0) on CPU 0"), "{e}");

    let total = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .unwrap()
        * 1024;
    // What is left beside `a` is less than MemTotal less a's 1G.
    let too_much = (total - (1 << 30)).to_string();
    let e = env.refused(&["create", "b", "--cpus", "1", "--memory", &too_much]);
    assert!(e.contains("host reserve"), "{e}");
    assert!(e.contains("partitions hold a 1G"), "{e}");
    let e = env.refused(&["create", "b", "--cpus", "1", "--memory", "100T"]);
    assert!(e.contains("partitions hold a 1G"), "{e}");

    let e = env.refused(&[
        "create", "b", "--cpus", "1", "--memory", "1G", "--disk", d1s,
    ]);
    assert!(e.contains("belongs to partition a"), "{e}");

    let e = env.refused(&["create", "a", "--cpus", "1", "--memory", "1G"]);
    assert!(e.contains("partition a already exists"), "{e}");

    for bad in ["1-x", "", "1-0", "a"] {
        let e = env.refused(&["create", "b", "--cpus", bad, "--memory", "1G"]);
        assert!(
            e.contains("--cpus") && e.contains("expected a list"),
            "{bad:?}: {e}"
        );
    }
    let e = env.refused(&["create", "b", "--cpus", "4095", "--memory", "1G"]);
    assert!(e.contains("not online"), "{e}");
    let e = env.refused(&["create", "b/c", "--cpus", "1", "--memory", "1G"]);
    assert!(e.contains("partition name"), "{e}");

    for args in [
        vec!["show", "nosuch"],
        vec!["destroy", "nosuch"],
        vec!["stop", "nosuch", "1"],
        vec!["run", "nosuch", "--", "--kernel", "probe"],
    ] {
        let e = env.refused(&args);
        assert!(e.contains("unknown partition \"nosuch\""), "{args:?}: {e}");
        assert!(e.contains("partitions: a"), "{args:?}: {e}");
    }
    let e = env.refused(&["stop", "a", "7"]);
    assert!(e.contains("partition a has no VM 7"), "{e}");

    // Nothing the refusals touched was left behind: `b` is created cleanly now.
    let b_planned = Host::detect()
        .unwrap()
        .plan(&format!("{}b", env.prefix))
        .unwrap();
    assert!(!b_planned.exists(), "a refused create left a cgroup");
    env.ok(&[
        "create", "b", "--cpus", "1", "--memory", "1G", "--disk", d2s,
    ]);
    let names: Vec<Value> = env.list().iter().map(|p| p["name"].clone()).collect();
    assert_eq!(names, ["a", "b"]);
}

#[test]
fn a_disk_of_another_partition_is_refused_however_the_vm_names_it() {
    // 2 MiB, so it would also be a valid --pmem region.
    let (env, owned) = Env::with_owned_disk(2 << 20);
    let o = owned.to_str().unwrap();
    let config = env.state().join("vm.json");
    std::fs::write(
        &config,
        serde_json::json!({"kernel": "probe", "disks": [{"path": o}]}).to_string(),
    )
    .unwrap();
    let disk = format!("path={o}");
    let pmem = format!("file={o}");
    for named in [
        ["--disk", disk.as_str()],
        ["--config", config.to_str().unwrap()],
        ["--pmem", pmem.as_str()],
    ] {
        let mut args = vec!["run", "b", "--", "--kernel", "probe"];
        args.extend(named);
        let e = env.refused(&args);
        assert!(
            e.contains("belongs to partition a, not to b") && e.contains(o),
            "{named:?}: {e}"
        );
    }
    assert_eq!(env.show("b")["vms"], serde_json::json!([]), "a VM started");
}

#[test]
fn a_tap_belongs_to_one_partition_at_create_and_at_run() {
    let env = Env::new();
    // Only recorded, never opened: every refusal comes before a VM could create it.
    let tap = format!("mt{}t", std::process::id());
    let t = tap.as_str();
    env.ok(&["create", "a", "--cpus", "0", "--memory", "512M", "--tap", t]);
    assert_eq!(env.show("a")["taps"], serde_json::json!([t]));
    let detail = env.ok(&["show", "a"]).stdout;
    assert!(detail.contains(&format!("  tap         {t}\n")), "{detail}");
    let table = env.ok(&["list"]).stdout;
    assert!(table.contains("TAPS") && table.contains(t), "{table}");

    let e = env.refused(&[
        "create", "b", "--cpus", "1", "--memory", "512M", "--tap", "other0", "--tap", t,
    ]);
    assert!(
        e.contains(&format!(
            "--tap {t}: belongs to partition a; a TAP belongs to one partition"
        )),
        "{e}"
    );
    for bad in ["a/b", "a b", "sixteen-bytes-xx"] {
        let e = env.refused(&[
            "create", "b", "--cpus", "1", "--memory", "512M", "--tap", bad,
        ]);
        assert!(e.contains(&format!("--tap {bad:?}")), "{bad:?}: {e}");
    }
    assert_eq!(env.list().len(), 1, "a refused create left a partition");

    env.ok(&["create", "b", "--cpus", "1", "--memory", "512M"]);
    let config = env.state().join("vm.json");
    std::fs::write(
        &config,
        serde_json::json!({"kernel": "probe", "net": [{"tap": t}]}).to_string(),
    )
    .unwrap();
    let net = format!("tap={t}");
    for named in [
        vec!["--kernel", "probe", "--net", &net],
        vec!["--config", config.to_str().unwrap()],
    ] {
        let mut args = vec!["run", "b", "--"];
        args.extend(&named);
        let e = env.refused(&args);
        assert!(
            e.contains(&format!("--net tap={t}: belongs to partition a, not to b")),
            "{named:?}: {e}"
        );
    }
    assert_eq!(env.show("b")["vms"], serde_json::json!([]), "a VM started");
}

#[test]
fn a_vm_runs_in_its_partitions_cgroup_on_its_cpus() {
    let env = Env::new();
    env.ok(&["create", "p", "--cpus", "1", "--memory", "1G"]);
    let r = env.ok(&[
        "run",
        "p",
        "--",
        "--kernel",
        "probe",
        "--cpus",
        "2",
        "--cmdline",
        "probe.task_timeout=120 probe.tasks=hello,spin=0",
    ]);
    assert!(
        r.stdout.contains("partition p: vm 1 started"),
        "{}",
        r.explain()
    );
    let vm = env.wait_vm("p", 1, Duration::from_secs(60), |v| {
        v["state"] != "running" || console(v).contains("\"probe\":\"hello\"")
    });
    assert_eq!(vm["state"], "running", "{vm}\n{}", console(&vm));
    let pid = vm["pid"].as_u64().unwrap();
    let p = env.show("p");
    // Both vCPU threads and the VMM's own threads are confined to CPU 1.
    assert_confined(pid, &p, "1");
    assert_eq!(status_field(pid, "Cpus_allowed_list"), "1");
    let procs: Vec<u64> = place_dirs(&p)
        .iter()
        .flat_map(|d| {
            read_trim(&d.join("cgroup.procs"))
                .split_whitespace()
                .map(|s| s.parse::<u64>().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        procs.contains(&pid),
        "vm pid {pid} not in cgroup.procs {procs:?}"
    );

    let r = env.ok(&["stop", "p", "1"]);
    assert!(r.stdout.contains("exited"), "{}", r.explain());
    let vm = env.vm("p", 1);
    assert_eq!(vm["state"], "exited");
    assert_eq!(vm["stopped"], true);
    assert!(!pid_alive(pid));
    let text = env.ok(&["list"]).stdout;
    assert!(text.contains("vm 1") && text.contains("stopped"), "{text}");
}

#[test]
fn killing_one_supervisor_stops_only_its_own_vms() {
    let env = Env::new();
    env.ok(&["create", "a", "--cpus", "0", "--memory", "1G"]);
    env.ok(&["create", "b", "--cpus", "1", "--memory", "1G"]);
    let tasks = format!("probe.tasks=spin={LONG_SPIN}");
    for name in ["a", "b"] {
        env.ok(&["run", name, "--", "--kernel", "probe", "--cmdline", &tasks]);
    }
    // Both guests are up and in their loops.
    let mut pids = Vec::new();
    for name in ["a", "b"] {
        let vm = env.wait_vm(name, 1, Duration::from_secs(60), |v| {
            v["state"] != "running" || console(v).contains("task arena")
        });
        assert_eq!(vm["state"], "running", "{vm}\n{}", console(&vm));
        pids.push(vm["pid"].as_u64().unwrap());
    }
    let a = env.show("a");
    let sup_a = a["supervisor_state"]["pid"].as_u64().unwrap();
    let sup_b = env.show("b")["supervisor_state"]["pid"].as_u64().unwrap();
    assert_eq!(
        // SAFETY: kill(2) on the supervisor this test's partition started.
        unsafe { libc::kill(sup_a as libc::pid_t, libc::SIGKILL) },
        0
    );

    // a's VM follows its supervisor; b's goes on.
    let deadline = Instant::now() + Duration::from_secs(20);
    while pid_alive(pids[0]) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !pid_alive(pids[0]),
        "vm of a (pid {}) survived its supervisor",
        pids[0]
    );
    assert!(pid_alive(sup_b), "supervisor of b died with a's");
    assert!(pid_alive(pids[1]), "vm of b died with a's supervisor");
    assert_eq!(env.vm("b", 1)["state"], "running");

    let lost = env.vm("a", 1);
    assert_eq!(lost["state"], "lost", "{lost}");
    assert_eq!(
        lost["reason"],
        format!("supervisor pid {sup_a} gone"),
        "{lost}"
    );
    let a_view = env.show("a");
    assert_eq!(a_view["supervisor_state"]["state"], "gone");
    let table = env.ok(&["list"]).stdout;
    assert!(
        table.contains(&format!("lost (supervisor pid {sup_a} gone)")),
        "{table}"
    );
    let e = env.refused_or_system(&["run", "a", "--", "--kernel", "probe"]);
    assert!(e.contains(&format!("supervisor pid {sup_a} gone")), "{e}");

    // b's VM finishes its work correctly.
    let vm = env.wait_vm("b", 1, Duration::from_secs(120), |v| {
        v["state"] != "running"
    });
    let out = console(&vm);
    assert_eq!(vm["state"], "exited", "{vm}\n{out}");
    assert_eq!(vm["status"], 0, "{vm}\n{out}");
    let spin = out
        .lines()
        .find(|l| l.starts_with("{\"probe\":\"spin\""))
        .unwrap_or_else(|| panic!("no spin result from b:\n{out}"));
    let spin: Value = serde_json::from_str(spin).unwrap();
    assert_eq!(spin["iterations"], LONG_SPIN, "{spin}");

    // Destroying a partition whose supervisor is gone still removes its cgroup.
    env.ok(&["destroy", "a"]);
    for d in place_dirs(&a) {
        assert!(!d.exists(), "cgroup {} left behind", d.display());
    }
}

#[test]
fn partition_state_survives_a_cli_restart() {
    let env = Env::new();
    env.ok(&["create", "keep", "--cpus", "0", "--memory", "256M"]);
    let first = env.list();
    let sup = first[0]["supervisor_state"]["pid"].as_u64().unwrap();
    // The supervisor is its own session leader, detached from the CLI that started it.
    let stat = std::fs::read_to_string(format!("/proc/{sup}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    assert_eq!(
        fields[3],
        sup.to_string(),
        "session of the supervisor: {stat}"
    );
    // Every command is a new CLI process; a few later, the same partition and supervisor.
    for _ in 0..3 {
        let again = env.list();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0]["name"], "keep");
        assert_eq!(again[0]["cpus"], first[0]["cpus"]);
        assert_eq!(again[0]["cgroup"], first[0]["cgroup"]);
        assert_eq!(again[0]["supervisor_state"]["pid"], sup);
        assert_eq!(again[0]["supervisor_state"]["state"], "running");
    }
    // And a manager built from nothing but the state directory sees it too.
    let m = Manager::new(env.state(), PathBuf::from(env!("CARGO_BIN_EXE_musubi"))).unwrap();
    let views = m.list().unwrap();
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].record.supervisor.unwrap().pid as u64, sup);
}

impl Env {
    /// A command that fails (status 1 or 2) and its message.
    fn refused_or_system(&self, args: &[&str]) -> String {
        let r = self.pm(args);
        assert!(
            matches!(r.code, Some(1) | Some(2)),
            "musubi partition {args:?} should fail:\n{}",
            r.explain()
        );
        r.stderr
    }
}

#[test]
fn a_state_directory_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    std::fs::set_permissions(env.state(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = env.refused(&["list"]);
    assert!(
        e.contains("writable by its group or by others") && e.contains("chmod go-w"),
        "{e}"
    );
    std::fs::set_permissions(env.state(), std::fs::Permissions::from_mode(0o700)).unwrap();
    env.ok(&["list"]);
}

#[test]
fn a_supervisor_refuses_callers_other_than_root_and_its_owner() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    env.ok(&["create", "p", "--cpus", "0", "--memory", "256M"]);
    let sock = env.state().join("p").join("supervisor.sock");
    assert!(sock.exists(), "no socket at {}", sock.display());
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is the owner's alone");
    // Open the way to the socket, as a careless administrator might: the supervisor must
    // still check who is calling.
    for d in [env.state().to_path_buf(), env.state().join("p")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let client = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.settimeout(10); \
         s.connect({:?}); s.sendall(b'{{\"op\": \"list\"}}\\n'); print(s.recv(4096).decode())",
        sock.to_str().unwrap()
    );
    let out = Command::new("python3")
        .args(["-c", &client])
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 runs the unprivileged client (Debian: apt-get install python3)");
    let reply = String::from_utf8_lossy(&out.stdout);
    assert!(
        reply.contains("neither root nor the partition's owner"),
        "reply to uid 65534: {reply:?}, stderr {:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::fs::read_to_string(env.state().join("p").join("supervisor.log")).unwrap();
    assert!(
        log.contains("refused a connection: uid 65534"),
        "supervisor log:\n{log}"
    );
    // The owner (root here) is still answered.
    env.ok(&["show", "p"]);
}

// ---- pause, resume and snapshot through the partition ----

/// The console line that says the probe guest's first task (`hello`) is done, so the task
/// after it has started.
const HELLO: &str = "{\"probe\":\"hello\"";
const DONE: &str = "probe: done, exit status 0";
/// `fib=FIB_N` takes about 2.5 s on the test machine.
const FIB_N: u64 = 44;
/// How long after a task has started the snapshot is taken.
const INTO_TASK: Duration = Duration::from_millis(300);
/// Any one CLI command or VM here ends well within this; a hung one fails the test.
const LIMIT: Duration = Duration::from_secs(180);
/// Iterations of the probe guest's CPU loop that keep a VM busy while it is paused,
/// resumed or snapshotted: a few seconds on a fast host (about 0.3 s per 10^9), a minute
/// or so on a slow one. Being slower only widens the window the tests act in.
const HOLD_SPIN: u64 = 10_000_000_000;

impl Env {
    /// Runs one CLI command in directory `cwd`, failing the test after [`LIMIT`].
    fn pm_in(&self, cwd: &Path, args: &[&str]) -> Run {
        let mut cmd = self.command(args);
        cmd.current_dir(cwd);
        common::run_command(cmd, &[] as &[&str], None, LIMIT)
    }

    /// Waits until the console of `vm` shows `text` while it runs.
    fn wait_console(&self, name: &str, vm: u64, text: &str) -> Value {
        let v = self.wait_vm(name, vm, LIMIT, |v| {
            v["state"] != "running" || console(v).contains(text)
        });
        assert_eq!(v["state"], "running", "{v}\n{}", console(&v));
        v
    }
}

/// `GET /api/v1/vm.info` on the VM's own socket: the state the VM itself reports.
fn api_state(socket: &Path) -> String {
    let (status, body) = musubi_api::request_with_timeout(
        socket,
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(30),
    )
    .unwrap_or_else(|e| panic!("vm.info: {e}"));
    assert_eq!(status, 200, "vm.info: {body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    info["state"].as_str().unwrap_or_default().to_string()
}

/// The probe guest's arguments for `musubi partition run NAME -- ...`.
fn probe_run(tasks: &str, flags: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--kernel", "probe", "--timeout", "200", "--cmdline"]
        .map(String::from)
        .into();
    a.push(format!("probe.task_timeout=150 probe.tasks={tasks}"));
    a.extend(flags.iter().map(|f| f.to_string()));
    a
}

fn with_args<'a>(head: &[&'a str], tail: &'a [String]) -> Vec<&'a str> {
    head.iter()
        .copied()
        .chain(tail.iter().map(String::as_str))
        .collect()
}

#[test]
fn a_vm_in_a_partition_is_paused_and_resumed_and_finishes_its_task() {
    let env = Env::new();
    env.ok(&["create", "p", "--cpus", "0", "--memory", "1G"]);
    let args = probe_run(&format!("hello,spin={HOLD_SPIN}"), &[]);
    env.ok(&with_args(&["run", "p", "--"], &args));
    let vm = env.wait_console("p", 1, HELLO);
    // The supervisor gave the VM its control API in the partition's directory.
    let socket = PathBuf::from(vm["api_socket"].as_str().unwrap());
    assert_eq!(socket, env.state().join("p").join("vms").join("1.sock"));
    assert_eq!(api_state(&socket), "Running");

    let r = env.ok(&["pause", "p", "1"]);
    assert!(
        r.stdout.contains("partition p: vm 1 paused"),
        "{}",
        r.explain()
    );
    assert_eq!(env.vm("p", 1)["state"], "paused");
    assert_eq!(api_state(&socket), "Paused");
    let table = env.ok(&["list"]).stdout;
    assert!(
        table.contains("0 running, 1 paused") && table.contains("vm 1  pid"),
        "{table}"
    );
    assert!(env.ok(&["show", "p"]).stdout.contains("paused"));
    // The API's own refusal comes back with its message; the record stays true.
    let e = env.refused(&["pause", "p", "1"]);
    assert!(
        e.contains("pause refused") && e.contains("the VM is already paused"),
        "{e}"
    );
    assert_eq!(env.vm("p", 1)["state"], "paused");

    let r = env.ok(&["resume", "p", "1"]);
    assert!(
        r.stdout.contains("partition p: vm 1 running"),
        "{}",
        r.explain()
    );
    assert_eq!(env.vm("p", 1)["state"], "running");
    assert_eq!(api_state(&socket), "Running");
    let e = env.refused(&["resume", "p", "1"]);
    assert!(e.contains("the VM is not paused"), "{e}");

    let vm = env.wait_vm("p", 1, LIMIT, |v| v["state"] != "running");
    let out = console(&vm);
    assert_eq!(vm["state"], "exited", "{vm}\n{out}");
    assert_eq!(vm["status"], 0, "{vm}\n{out}");
    let spin = common::result_in(&out, "spin");
    assert_eq!(spin["iterations"], HOLD_SPIN, "{spin}");
    assert!(!socket.exists(), "{} outlived its VM", socket.display());

    // Only a running VM can be asked, and only a VM the partition has.
    let e = env.refused(&["pause", "p", "1"]);
    assert!(e.contains("vm 1 of partition p is not running"), "{e}");
    let e = env.refused(&["resume", "p", "9"]);
    assert!(e.contains("partition p has no VM 9"), "{e}");
}

/// What of a `fib` line does not depend on time: its N and value.
fn fib_of(text: &str) -> (Value, Value) {
    let f = common::result_in(text, "fib");
    (f["n"].clone(), f["result"].clone())
}

/// What of a `blk-crc` line does not depend on time: each disk's size and CRC.
fn crc_of(text: &str) -> Vec<(Value, Value)> {
    common::result_in(text, "blk-crc")["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["bytes"].clone(), d["crc32"].clone()))
        .collect()
}

#[test]
fn a_vm_snapshotted_in_its_partition_restores_there_as_an_uninterrupted_run() {
    let env = Env::new();
    let disk = common::temp_image(env.state(), "own.img", 1 << 20);
    let d = disk.to_str().unwrap();
    env.ok(&["create", "p", "--cpus", "0", "--memory", "1G", "--disk", d]);
    let tasks = format!("hello,fib={FIB_N},blk-crc");
    let path = format!("path={d}");
    let args = probe_run(&tasks, &["--memory", "128M", "--disk", &path]);

    // Uninterrupted, in the same partition.
    let plain = env.pm_in(
        env.state(),
        &with_args(&["run", "p", "--wait", "--"], &args),
    );
    assert_eq!(plain.code, Some(0), "{}", plain.explain());
    let want_fib = fib_of(&plain.stdout);
    assert_eq!(
        want_fib,
        (FIB_N.into(), common::fib_value(FIB_N).into()),
        "{}",
        plain.explain()
    );
    let want_crc = crc_of(&plain.stdout);
    assert_eq!(want_crc.len(), 1, "{}", plain.explain());

    // Snapshotted mid-fib through the partition, into a directory relative to the CLI's.
    env.ok(&with_args(&["run", "p", "--"], &args));
    env.wait_console("p", 2, HELLO);
    std::thread::sleep(INTO_TASK);
    let r = env.pm_in(env.state(), &["snapshot", "p", "2", "snap"]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let snap = env.state().join("snap");
    assert!(
        r.stdout
            .contains(&format!("vm 2 snapshotted into {}, paused", snap.display())),
        "{}",
        r.explain()
    );
    for f in ["config.json", "state", "memory"] {
        assert!(snap.join(f).is_file(), "no {f} in {}", snap.display());
    }
    let vm = env.vm("p", 2);
    assert_eq!(vm["state"], "paused", "{vm}");
    assert_eq!(
        api_state(Path::new(vm["api_socket"].as_str().unwrap())),
        "Paused"
    );
    let before = console(&vm);
    assert!(
        !common::results_in(&before)
            .iter()
            .any(|v| v["probe"] == "fib"),
        "fib had ended before the snapshot, so it was not taken mid-task:\n{before}"
    );
    let r = env.ok(&["stop", "p", "2"]);
    assert!(r.stdout.contains("exited"), "{}", r.explain());
    assert!(!console(&env.vm("p", 2)).contains(DONE));

    // Restored in the partition that owns its disk: the task ends as it would have.
    let snap_s = snap.to_str().unwrap();
    let r = env.pm_in(
        env.state(),
        &[
            "run",
            "p",
            "--wait",
            "--",
            "--restore",
            snap_s,
            "--timeout",
            "200",
        ],
    );
    assert_eq!(r.code, Some(0), "restore: {}", r.explain());
    assert!(r.stdout.contains(DONE), "{}", r.explain());
    assert!(
        !r.results().iter().any(|v| v["probe"] == "hello"),
        "the restored VM ran hello again, so it booted instead of resuming:\n{}",
        r.stdout
    );
    assert_eq!(fib_of(&r.stdout), want_fib, "{}", r.stdout);
    assert_eq!(crc_of(&r.stdout), want_crc, "{}", r.stdout);
    let restored = env.vm("p", 3);
    assert_eq!(restored["state"], "exited");
    assert_eq!(restored["status"], 0);
    assert_eq!(restored["args"][0], "--restore");
}

#[test]
fn a_snapshot_whose_disk_belongs_to_another_partition_is_not_restored_there() {
    let (env, owned) = Env::with_owned_disk(1 << 20);
    let o = owned.to_str().unwrap();
    let path = format!("path={o}");
    let args = probe_run(
        &format!("hello,spin={HOLD_SPIN}"),
        &["--memory", "128M", "--disk", &path],
    );
    env.ok(&with_args(&["run", "a", "--"], &args));
    env.wait_console("a", 1, HELLO);
    let snap = env.state().join("snap-a");
    let snap_s = snap.to_str().unwrap();
    env.ok(&["snapshot", "a", "1", snap_s]);
    env.ok(&["stop", "a", "1"]);

    let e = env.refused(&["run", "b", "--", "--restore", snap_s]);
    assert!(
        e.contains("belongs to partition a, not to b") && e.contains(o),
        "{e}"
    );
    // A snapshot that cannot be read is refused with run's own message, not a boot's.
    let missing = env.state().join("no-such-snapshot");
    let e = env.refused(&["run", "b", "--", "--restore", missing.to_str().unwrap()]);
    assert!(
        e.contains("--restore") && e.contains("no-such-snapshot") && !e.contains("--kernel"),
        "{e}"
    );
    assert_eq!(env.show("b")["vms"], serde_json::json!([]), "a VM started");
}

// ---- live migration between partitions ----

/// `fib=MIGRATE_FIB_N` runs for several seconds, so a move asked for right after `hello`
/// lands mid-task (as in tests/migration.rs).
const MIGRATE_FIB_N: u64 = 46;

impl Env {
    /// Starts VM 1 of `partition` waiting for a migration on loopback, with a secret made
    /// of `seed`, and returns the secret file and the URL once it listens.
    fn wait_for_migration(&self, partition: &str, seed: u8) -> (PathBuf, String) {
        use std::os::unix::fs::PermissionsExt;
        let key = self.state().join("secret");
        std::fs::write(&key, [seed; 32]).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp:127.0.0.1:{port}");
        let secret = key.to_str().unwrap();
        let args = [
            "run",
            partition,
            "--",
            "--receive-migration",
            &url,
            "--secret-file",
            secret,
            "--timeout",
            "200",
        ];
        self.ok(&args);
        let start = Instant::now();
        while !common::listening_on_loopback(port) {
            let v = self.vm(partition, 1);
            assert_eq!(v["state"], "running", "{v}\n{}", console(&v));
            assert!(
                start.elapsed() < LIMIT,
                "nothing listens on {url} after {LIMIT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        (key, url)
    }
}

#[test]
fn a_vm_migrated_from_one_partition_to_another_ends_its_task_in_the_second() {
    let env = Env::new();
    env.ok(&["create", "a", "--cpus", "0", "--memory", "1G"]);
    env.ok(&["create", "b", "--cpus", "1", "--memory", "1G"]);
    // The destination waits in partition b, confined there before any VM arrives: the
    // VM will run in this process.
    let (key, url) = env.wait_for_migration("b", 21);
    let dest = env.vm("b", 1);
    let dest_pid = dest["pid"].as_u64().unwrap();
    assert_confined(dest_pid, &env.show("b"), "1");

    let args = probe_run(&format!("hello,fib={MIGRATE_FIB_N}"), &["--memory", "128M"]);
    env.ok(&with_args(&["run", "a", "--"], &args));
    let src = env.wait_console("a", 1, HELLO);
    assert_confined(src["pid"].as_u64().unwrap(), &env.show("a"), "0");
    let socket = PathBuf::from(src["api_socket"].as_str().unwrap());
    let r = common::send_migration_to(&socket, &url, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());

    // The source hands the VM over and exits 0 without ending its tasks.
    let src = env.wait_vm("a", 1, LIMIT, |v| v["state"] != "running");
    let src_out = console(&src);
    assert_eq!(src["state"], "exited", "{src}\n{src_out}");
    assert_eq!(src["status"], 0, "{src}\n{src_out}");
    assert!(
        !src_out.contains(DONE),
        "the source ran its tasks to the end, so the move was not mid-task:\n{src_out}"
    );

    // The destination, in b all along, ends the task as an uninterrupted run would.
    let dest = env.wait_vm("b", 1, LIMIT, |v| v["state"] != "running");
    let out = console(&dest);
    assert_eq!(dest["pid"].as_u64(), Some(dest_pid), "{dest}");
    assert_eq!(dest["state"], "exited", "{dest}\n{out}");
    assert_eq!(dest["status"], 0, "{dest}\n{out}");
    assert!(out.contains(DONE), "{out}");
    assert!(
        !common::results_in(&out)
            .iter()
            .any(|v| v["probe"] == "hello"),
        "the destination ran hello again, so it booted instead of resuming:\n{out}"
    );
    assert_eq!(
        fib_of(&out),
        (
            MIGRATE_FIB_N.into(),
            common::fib_value(MIGRATE_FIB_N).into()
        ),
        "{out}"
    );
}

#[test]
fn a_migrating_vm_whose_disk_belongs_to_another_partition_is_refused_on_arrival() {
    let (env, owned) = Env::with_owned_disk(1 << 20);
    let o = owned.to_str().unwrap();
    let (key, url) = env.wait_for_migration("b", 22);
    // The source runs in partition a, which owns the disk.
    let path = format!("path={o}");
    let args = probe_run(
        &format!("hello,fib={MIGRATE_FIB_N}"),
        &["--memory", "128M", "--disk", &path],
    );
    env.ok(&with_args(&["run", "a", "--"], &args));
    let src = env.wait_console("a", 1, HELLO);
    let socket = PathBuf::from(src["api_socket"].as_str().unwrap());
    let r = common::send_migration_to(&socket, &url, &key);
    assert_eq!(r.code, Some(1), "send-migration: {}", r.explain());
    assert!(
        r.stderr.contains("belongs to partition a") && r.stderr.contains(o),
        "{}",
        r.explain()
    );
    // The VM was never paused for good: it ends its task where it is.
    let src = env.wait_vm("a", 1, LIMIT, |v| v["state"] != "running");
    let out = console(&src);
    assert_eq!(src["status"], 0, "{src}\n{out}");
    assert!(out.contains(DONE), "{out}");
    env.ok(&["stop", "b", "1"]);
}
