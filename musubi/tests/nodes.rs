//! One VM over several node processes on this host: what the guest sees, what the nodes
//! refuse, and how they end when one of them is lost.

mod common;

use common::netns::{ip, try_ip};
use common::{
    assert_kvm, musubi, probe_args, read_text, run_probe, start_command, wait_until,
    wait_with_limit, Run,
};
use musubi_types::{ClusterMetrics, Coherence, HotPage, Metrics};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// The exit status of every surviving node when a node is lost.
const NODE_LOST: i32 = 123;

/// A cluster file with `vcpus[k]` on node `k`, loopback ports free at creation and a fresh
/// secret, in a directory of its own.
struct Cluster {
    dir: tempfile::TempDir,
    addrs: Vec<SocketAddr>,
}

impl Cluster {
    fn new(vcpus: &[&[u8]]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("secret"),
            b"a secret of the nodes of this VM",
        )
        .unwrap();
        let listeners: Vec<TcpListener> = vcpus
            .iter()
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let nodes: Vec<serde_json::Value> = vcpus
            .iter()
            .zip(&addrs)
            .map(|(v, a)| serde_json::json!({"address": a.to_string(), "vcpus": v}))
            .collect();
        let file = serde_json::json!({"secret_file": "secret", "nodes": nodes});
        std::fs::write(dir.path().join("cluster.json"), file.to_string()).unwrap();
        Cluster { dir, addrs }
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("cluster.json")
    }

    /// Starts node `k` of the probe guest running `tasks` on `cpus` vCPUs, with `extra`
    /// flags; its output goes to files in the cluster's directory.
    fn spawn(&self, k: u16, cpus: u8, tasks: &str, extra: &[&str]) -> Child {
        self.spawn_ranked(k, &[("--id", &k.to_string())], &[], cpus, tasks, extra)
    }

    /// As [`Cluster::spawn`], logging as node `k`, with `id` as its `--id` flag (or none)
    /// and `env` added to its environment (a launcher's rank variable). Any launcher
    /// variable the test itself runs under is removed first.
    fn spawn_ranked(
        &self,
        k: u16,
        id: &[(&str, &str)],
        env: &[(&str, &str)],
        cpus: u8,
        tasks: &str,
        extra: &[&str],
    ) -> Child {
        let log =
            |s: &str| std::fs::File::create(self.dir.path().join(format!("node{k}.{s}"))).unwrap();
        let mut cmd = musubi();
        for v in ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"] {
            cmd.env_remove(v);
        }
        cmd.envs(env.iter().copied());
        cmd.arg("node")
            .arg("--cluster")
            .arg(self.file())
            .args(id.iter().flat_map(|(f, v)| [*f, *v]))
            .args(["--kernel", "probe", "--memory", "64M"])
            .args(["--cpus", &cpus.to_string(), "--timeout", "120"])
            .args([
                "--cmdline",
                &format!("probe.task_timeout=100 probe.tasks={tasks}"),
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log("out"))
            .stderr(log("err"))
            .spawn()
            .expect("musubi node starts")
    }

    fn stderr(&self, k: u16) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("node{k}.err"))).unwrap_or_default()
    }

    fn explain(&self, n: u16) -> String {
        (0..n)
            .map(|k| format!("node {k} stderr:\n{}", self.stderr(k)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[test]
fn nodes_started_by_a_launcher_take_their_ids_from_its_rank_variables() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1], &[2]]);
    // As mpirun, a PMI launcher and srun would start them, on one host.
    let vars = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];
    let mut nodes: Vec<Child> = (0..3u16)
        .map(|k| {
            let rank = k.to_string();
            c.spawn_ranked(k, &[], &[(vars[k as usize], &rank)], 3, "hello", &[])
        })
        .collect();
    for (k, n) in nodes.iter_mut().enumerate() {
        let s = wait_with_limit(n, Duration::from_secs(120), &format!("node {k}"));
        assert_eq!(s.code(), Some(0), "{}", c.explain(3));
        let err = c.stderr(k as u16);
        assert!(
            err.contains(&format!("id {k} from the launcher's {}", vars[k])),
            "node {k} says where its id came from: {err}"
        );
    }
    let out = std::fs::read_to_string(c.dir.path().join("node0.out")).unwrap();
    // Every node found its place: the guest sees all three vCPUs.
    let r = common::result_in(&out, "hello");
    assert_eq!(r["cpus"].as_u64(), Some(3), "{out}");
}

#[test]
fn openmpi_mpirun_starts_three_nodes_whose_shared_counter_is_exact() {
    assert_kvm();
    let mpirun = "mpirun";
    let c = Cluster::new(&[&[0], &[1], &[2]]);
    let log = |s: &str| std::fs::File::create(c.dir.path().join(format!("mpirun.{s}"))).unwrap();
    let mut cmd = std::process::Command::new(mpirun);
    for v in ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"] {
        cmd.env_remove(v);
    }
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    // Three processes on this host's cores, however few: they are mostly waiting.
    cmd.args(["--oversubscribe", "-np", "3"])
        .arg(env!("CARGO_BIN_EXE_musubi"))
        .arg("node")
        .arg("--cluster")
        .arg(c.file())
        .args(["--kernel", "probe", "--memory", "64M", "--cpus", "3"])
        .args(["--timeout", "120"])
        .args([
            "--cmdline",
            "probe.task_timeout=100 probe.tasks=shared-counter=20000",
        ])
        .stdin(Stdio::null())
        .stdout(log("out"))
        .stderr(log("err"));
    let mut run = cmd.spawn().unwrap_or_else(|e| {
        panic!("{mpirun} (OpenMPI, Debian's openmpi-bin; scripts/test installs it): {e}")
    });
    let s = wait_with_limit(&mut run, Duration::from_secs(150), "mpirun");
    let read = |s: &str| {
        std::fs::read_to_string(c.dir.path().join(format!("mpirun.{s}"))).unwrap_or_default()
    };
    let (out, err) = (read("out"), read("err"));
    assert_eq!(s.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    for k in 0..3 {
        assert!(
            err.contains(&format!(
                "node {k}: id {k} from the launcher's OMPI_COMM_WORLD_RANK"
            )),
            "{err}"
        );
    }
    let r = common::result_in(&out, "shared-counter");
    assert_eq!(r["cpus"].as_u64(), Some(3), "{out}");
    assert_eq!(r["exact"], true, "{out}");
    assert_eq!(r["locked"].as_u64(), Some(60000), "{out}");
    assert_eq!(r["xadd"].as_u64(), Some(60000), "{out}");
    assert_eq!(sorted_cpu_nodes(&r), [0, 1, 2], "one vCPU per node: {r}");
}

/// `musubi remote` on a node's API socket.
fn remote(sock: &Path, args: &[&str]) -> Run {
    let mut all = vec!["remote", "--api-socket", sock.to_str().unwrap()];
    all.extend_from_slice(args);
    common::run_with_limit(&all, Duration::from_secs(60))
}

/// A running node's coherence faults so far: SIGUSR1 has it write its `--metrics` anew.
fn coherence_faults_now(node: &Child, metrics: &Path) -> u64 {
    let _ = std::fs::remove_file(metrics);
    // SAFETY: kill(2) on the pid of a child this test started and has not waited for.
    let r = unsafe { libc::kill(node.id() as i32, libc::SIGUSR1) };
    assert_eq!(r, 0, "SIGUSR1 to node {}", node.id());
    let t0 = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(metrics).unwrap_or_default();
        if let Ok(m) = serde_json::from_str::<Metrics>(&text) {
            if let Some(c) = m.node.and_then(|n| n.coherence) {
                return c.faults.count;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} was not written on SIGUSR1: {text}",
            metrics.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn coherence_faults(metrics: &Path) -> u64 {
    let text =
        std::fs::read_to_string(metrics).unwrap_or_else(|e| panic!("{}: {e}", metrics.display()));
    let m: Metrics = serde_json::from_str(&text).unwrap();
    m.node
        .and_then(|n| n.coherence)
        .map(|c| c.faults.count)
        .unwrap_or_else(|| panic!("no fault count in {text}"))
}

#[test]
fn a_vcpu_moved_to_another_node_finishes_its_task_there_and_its_pages_follow_it() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1], &[2]]);
    let sock = c.dir.path().join("api.sock");
    let metrics = |k: u16| c.dir.path().join(format!("metrics{k}.json"));
    // vCPU 1 computes fib(40), then touches 2048 pages of its own.
    let tasks = "hello,fib=40,cpu=1,page-touch=2048,cpu=1";
    let mut nodes: Vec<Child> = (0..3u16)
        .map(|k| {
            let m = metrics(k);
            let mut extra = vec!["--metrics", m.to_str().unwrap()];
            if k == 0 {
                extra.extend(["--api-socket", sock.to_str().unwrap()]);
            }
            c.spawn(k, 3, tasks, &extra)
        })
        .collect();
    wait_for_output(
        &c.dir.path().join("node0.out"),
        "\"probe\":\"hello\"",
        Duration::from_secs(90),
    );
    // The move first, while vCPU 1 has its task ahead of it; then what is refused by name.
    let r = remote(&sock, &["move-vcpu", "--vcpu", "1", "--node", "2"]);
    assert_eq!(r.code, Some(0), "{}\n{}", r.explain(), c.explain(3));
    for (args, why) in [
        (
            ["--vcpu", "0", "--node", "1"],
            "vCPU 0 runs on the I/O node (node 0)",
        ),
        (
            ["--vcpu", "9", "--node", "1"],
            "vCPU 9: the VM has vCPUs 0 to 2",
        ),
        (
            ["--vcpu", "1", "--node", "3"],
            "node 3: the VM has nodes 0 to 2",
        ),
        (
            ["--vcpu", "1", "--node", "2"],
            "vCPU 1 already runs on node 2",
        ),
    ] {
        let mut all = vec!["move-vcpu"];
        all.extend_from_slice(&args);
        let r = remote(&sock, &all);
        assert_eq!(r.code, Some(1), "{}", r.explain());
        assert!(r.stderr.contains(why), "{}", r.explain());
    }
    let info = remote(&sock, &["info"]);
    let v: serde_json::Value =
        serde_json::from_str(&info.stdout).unwrap_or_else(|_| panic!("{}", info.explain()));
    assert_eq!(v["vcpu_nodes"], serde_json::json!([0, 2, 2]), "{v}");
    // Node 1 ran vCPU 1 alone: from here on it has no vCPU to fault for.
    let on1_at_move = coherence_faults_now(&nodes[1], &metrics(1));

    for (k, n) in nodes.iter_mut().enumerate() {
        let s = wait_with_limit(n, Duration::from_secs(120), &format!("node {k}"));
        assert_eq!(s.code(), Some(0), "{}", c.explain(3));
    }
    let out = std::fs::read_to_string(c.dir.path().join("node0.out")).unwrap();
    assert_eq!(
        common::result_in(&out, "fib")["result"],
        102_334_155,
        "{out}"
    );
    assert_eq!(
        common::result_in(&out, "page-touch")["page_faults"],
        2048,
        "{out}"
    );
    // The pages vCPU 1 touched after the move were faulted in on node 2, not node 1.
    let (on1, on2) = (coherence_faults(&metrics(1)), coherence_faults(&metrics(2)));
    assert!(on2 >= 2048, "node 2 faulted {on2} times");
    let after = on1 - on1_at_move;
    eprintln!("node 1: {on1_at_move} faults before the move, {after} after; node 2: {on2}");
    assert!(
        after < 2048 / 4,
        "node 1 faulted {after} times after vCPU 1 left it ({on1} in all), node 2 {on2}"
    );
}

#[test]
fn launcher_ranks_outside_the_cluster_disagreeing_or_missing_are_refused_by_name() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1]]);
    for (env, says) in [
        (
            &[("OMPI_COMM_WORLD_RANK", "2")][..],
            "OMPI_COMM_WORLD_RANK=2 names no node",
        ),
        (
            &[("PMI_RANK", "0"), ("SLURM_PROCID", "1")][..],
            "PMI_RANK=0 and SLURM_PROCID=1 disagree",
        ),
        (
            &[("SLURM_PROCID", "one")][..],
            "SLURM_PROCID=\"one\": not a rank",
        ),
        (&[][..], "no --id, and none of OMPI_COMM_WORLD_RANK"),
    ] {
        let mut n = c.spawn_ranked(0, &[], env, 2, "hello", &[]);
        let s = wait_with_limit(&mut n, Duration::from_secs(60), "node");
        let err = c.stderr(0);
        assert_eq!(s.code(), Some(1), "{env:?}: {err}");
        assert!(err.contains(says), "{env:?}: {err}");
    }
}

/// The node processes `musubi run --nodes` with pid `launcher` started, by id.
fn node_pids(launcher: u32) -> Vec<(u16, i32)> {
    let children = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
        .unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| {
            let pid: i32 = p.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let at = args.iter().position(|a| *a == b"--id")?;
            let id = std::str::from_utf8(args.get(at + 1)?).ok()?.parse().ok()?;
            Some((id, pid))
        })
        .collect()
}

#[test]
fn a_frozen_node_is_killed_by_the_launcher_once_another_node_declares_it_lost() {
    assert_kvm();
    let mut launcher = start_nodes(3, "spin=0", &[]);
    let guard = common::KillOnPanic::new(&launcher);
    let launcher_pid = launcher.child.id();
    let pids = launcher.wait_for(
        RUN_LIMIT,
        || Some(node_pids(launcher_pid)).filter(|p| p.len() == 3),
        || {
            format!(
                "three nodes, of which it started {:?}",
                node_pids(launcher_pid)
            )
        },
    );
    // Let the nodes link up and the guest run, then freeze node 2 (it never exits).
    std::thread::sleep(Duration::from_millis(1500));
    let frozen = pids.iter().find(|(k, _)| *k == 2).unwrap().1;
    // SAFETY: a signal to a grandchild this test's launcher started; it is reaped by the
    // launcher, which the test waits for.
    unsafe { libc::kill(frozen, libc::SIGSTOP) };
    guard.defuse();
    let r = launcher.finish(RUN_LIMIT);
    assert_eq!(r.code, Some(NODE_LOST), "{}", r.explain());
    assert!(r.stderr.contains("lost node 2"), "{}", r.explain());
    assert!(
        r.stderr.contains("node 2 was declared lost by node"),
        "the launcher killed the frozen node when it was declared lost: {}",
        r.explain()
    );
    assert!(
        !r.stderr.contains("did not end within"),
        "the launcher waited out its grace period instead: {}",
        r.explain()
    );
}

/// Waits (bounded) until `path` contains `what`.
fn wait_for_output(path: &Path, what: &str, limit: Duration) {
    assert!(
        wait_until(limit, || read_text(path).contains(what)),
        "{} never printed {what:?}",
        path.display()
    );
}

#[test]
fn killing_a_node_ends_every_other_node_with_its_name_within_five_seconds() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1], &[2]]);
    // spin=0 runs until stopped, so the VM is still running when a node goes.
    let mut nodes: Vec<Child> = (0..3).map(|k| c.spawn(k, 3, "spin=0", &[])).collect();
    wait_for_output(
        &c.dir.path().join("node0.out"),
        "command line",
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_millis(500));
    nodes[2].kill().unwrap();
    let killed = Instant::now();
    let _ = nodes[2].wait();
    for (k, n) in nodes.iter_mut().enumerate().take(2) {
        let s = wait_with_limit(n, Duration::from_secs(30), &format!("node {k}"));
        let took = killed.elapsed();
        assert_eq!(s.code(), Some(NODE_LOST), "{}", c.explain(3));
        assert!(
            took < Duration::from_secs(5),
            "node {k} ended {took:?} after the kill; {}",
            c.explain(3)
        );
        let err = c.stderr(k as u16);
        assert!(err.contains("lost node 2"), "node {k}: {err}");
        assert!(
            err.contains("it owned at least") && err.contains("pages of guest memory"),
            "node {k} says how many pages it owned, as a lower bound: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Connects to `addr`, retrying while nobody listens there yet (bounded).
fn connect_when_listening(addr: SocketAddr) -> TcpStream {
    let t0 = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(30), "{addr}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn strangers_while_the_nodes_link_are_refused_by_address_and_the_vm_still_starts() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1]]);
    // Enough timer rounds after hello for the test to knock on the door while the VM runs.
    let tasks = format!("hello{}", ",timer".repeat(15));
    let mut a = c.spawn(0, 2, &tasks, &[]);
    let door = c.addrs[0];
    // Once node 0 sends its hello, it is at its door (not still setting up with strangers
    // piling up unread); hanging up then is the first refusal.
    let mut first = connect_when_listening(door);
    first
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    first.read_exact(&mut [0u8; 75]).expect("node 0's hello");
    drop(first);
    // Each of these is refused before the next comes, so each is logged by address.
    let refused = |mut s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    };
    let mut garbage = TcpStream::connect(door).unwrap();
    garbage.write_all(&[0xff; 4096]).unwrap();
    let garbage_at = garbage.local_addr().unwrap();
    refused(garbage);
    let mut early = TcpStream::connect(door).unwrap();
    early.write_all(b"MUSUBI").unwrap();
    early.shutdown(std::net::Shutdown::Write).unwrap();
    let early_at = early.local_addr().unwrap();
    refused(early);

    // A node of another VM (another secret) claiming to be node 1.
    let other = c.dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("secret"), b"not the secret of this VM at all").unwrap();
    std::fs::copy(c.file(), other.join("cluster.json")).unwrap();
    let mut impostor = musubi()
        .args(["node", "--cluster"])
        .arg(other.join("cluster.json"))
        .args([
            "--id", "1", "--kernel", "probe", "--memory", "64M", "--cpus", "2",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let si = wait_with_limit(&mut impostor, Duration::from_secs(60), "the impostor");
    let mut err_i = String::new();
    impostor
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err_i)
        .unwrap();
    assert_eq!(si.code(), Some(1), "{err_i}");
    assert!(err_i.contains("failed authentication"), "{err_i}");

    // A silent one that stays, and fifty that connect and hang up at once.
    let _silent = TcpStream::connect(door).unwrap();
    for _ in 0..50 {
        drop(TcpStream::connect(door).unwrap());
    }

    // The real node 1 then comes, and the VM runs.
    let mut b = c.spawn(1, 2, &tasks, &[]);
    wait_for_output(
        &c.dir.path().join("node0.out"),
        "\"probe\":\"hello\"",
        Duration::from_secs(90),
    );
    let knock = TcpStream::connect(door);
    let running = a.try_wait().unwrap().is_none();
    let sb = wait_with_limit(&mut b, Duration::from_secs(90), "node 1");
    let sa = wait_with_limit(&mut a, Duration::from_secs(90), "node 0");
    assert_eq!(sa.code(), Some(0), "{}", c.explain(2));
    assert_eq!(sb.code(), Some(0), "{}", c.explain(2));
    match knock {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}"),
        Ok(_) => panic!("node 0 accepted a connection after linking"),
    }
    assert!(running, "node 0 ended before the knock: it proves nothing");

    let err = c.stderr(0);
    let refusal = |from: SocketAddr, why: &str| {
        err.lines()
            .any(|l| l.contains(&format!("refused {from} while linking")) && l.contains(why))
    };
    assert!(
        refusal(garbage_at, "does not speak the musubi node handshake"),
        "{err}"
    );
    assert!(refusal(early_at, "closed the connection"), "{err}");
    assert!(err.contains("failed authentication"), "{err}");
    assert!(
        err.contains("more connections in that second (not logged one by one)"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_node_with_another_vm_configuration_is_refused_naming_what_differs() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1]]);
    let mut a = c.spawn(0, 2, "hello", &[]);
    let mut b = c.spawn(1, 2, "hello", &["--exits", "user"]);
    let sb = wait_with_limit(&mut b, Duration::from_secs(60), "node 1");
    let sa = wait_with_limit(&mut a, Duration::from_secs(60), "node 0");
    assert_ne!(sa.code(), Some(0));
    assert_ne!(sb.code(), Some(0));
    let both = c.explain(2);
    assert!(
        both.contains("different VM configuration (exits differ"),
        "{both}"
    );
    assert!(!both.contains("panicked"), "{both}");
}

#[test]
fn a_node_with_another_rng_or_vsock_cid_is_refused_naming_it() {
    assert_kvm();
    for (a, b, what) in [
        (
            vec!["--rng"],
            vec!["--rng", "bytes_per_sec=100"],
            "different VM configuration (rng differ",
        ),
        (
            vec!["--vsock", "cid=3,socket=v0.sock"],
            vec!["--vsock", "cid=4,socket=v1.sock"],
            "different VM configuration (vsock cid differ",
        ),
    ] {
        let c = Cluster::new(&[&[0], &[1]]);
        let place = |flags: &[&str]| -> Vec<String> {
            flags
                .iter()
                .map(|f| match f.split_once("socket=") {
                    Some((head, name)) => {
                        format!("{head}socket={}", c.dir.path().join(name).display())
                    }
                    None => f.to_string(),
                })
                .collect()
        };
        let (fa, fb) = (place(&a), place(&b));
        let fa: Vec<&str> = fa.iter().map(String::as_str).collect();
        let fb: Vec<&str> = fb.iter().map(String::as_str).collect();
        let mut na = c.spawn(0, 2, "hello", &fa);
        let mut nb = c.spawn(1, 2, "hello", &fb);
        let sb = wait_with_limit(&mut nb, Duration::from_secs(60), "node 1");
        let sa = wait_with_limit(&mut na, Duration::from_secs(60), "node 0");
        assert_ne!(sa.code(), Some(0));
        assert_ne!(sb.code(), Some(0));
        let both = c.explain(2);
        assert!(both.contains(what), "{what}: {both}");
        assert!(!both.contains("panicked"), "{both}");
    }
}

#[test]
fn garbage_from_a_peer_ends_its_connection_with_an_error_not_a_crash() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1]]);
    // Node 1 dials node 0's address, where this test listens instead and answers garbage.
    let fake = TcpListener::bind(c.addrs[0]).expect("node 0's port is still free");
    let mut b = c.spawn(1, 2, "hello", &[]);
    let (mut s, _) = fake.accept().expect("node 1 dials node 0");
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(&[0xff; 4096]);
    let st = wait_with_limit(&mut b, Duration::from_secs(60), "node 1");
    let err = c.stderr(1);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(
        err.contains("node 0") || err.contains("n0"),
        "names the peer: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn pmem_with_several_nodes_is_refused() {
    assert_kvm();
    let dir = tempfile::tempdir().unwrap();
    let img = common::temp_image(dir.path(), "pm.img", 4 << 20);
    let pmem = format!("file={}", img.display());
    let r: Run = run_probe("hello", &["--nodes", "2", "--cpus", "2", "--pmem", &pmem]);
    assert_eq!(r.code, Some(1), "{}", r.explain());
    assert!(r.stderr.contains("--pmem with 2 nodes"), "{}", r.explain());
}

/// The probe guest on `nodes` node processes (`musubi run --nodes`), with `flags` added.
fn run_nodes(nodes: u16, cpus: u8, tasks: &str, flags: &[&str]) -> Run {
    let (n, c) = (nodes.to_string(), cpus.to_string());
    let mut all = vec!["--nodes", &n, "--cpus", &c, "--memory", "64M"];
    all.extend_from_slice(flags);
    run_probe(tasks, &all)
}

/// The nodes a probe result's `cpu_nodes` names, in order.
fn sorted_cpu_nodes(result: &serde_json::Value) -> Vec<u64> {
    let mut on: Vec<u64> = result["cpu_nodes"]
        .as_array()
        .unwrap_or_else(|| panic!("no cpu_nodes in {result}"))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    on.sort();
    on
}

/// `hello` saw `nodes` CPUs, each on a node of its own.
fn assert_every_cpu_on_its_own_node(r: &Run, nodes: u16) {
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let h = r.result("hello");
    assert_eq!(h["cpus"], nodes, "{}", r.explain());
    assert_eq!(h["nodes"], nodes);
    assert_eq!(h["pv_ipi"], true);
    assert_eq!(
        sorted_cpu_nodes(&h),
        (0..nodes as u64).collect::<Vec<_>>(),
        "one CPU per node: {h}"
    );
}

/// `shared-counter=2000` on `nodes` CPUs added up exactly, both ways.
fn assert_counter_exact(r: &Run, nodes: u16, what: &str) {
    assert_eq!(r.code, Some(0), "{what}: {}", r.explain());
    let c = r.result("shared-counter");
    assert_eq!(c["expected"], 2000 * nodes as u64, "{c}");
    assert_eq!(c["locked"], c["expected"], "{what}: spinlock total {c}");
    assert_eq!(c["xadd"], c["expected"], "{what}: lock xadd total {c}");
    assert_eq!(c["exact"], true);
}

#[test]
fn two_and_three_node_vms_start_every_cpu_on_its_own_node() {
    for nodes in [2u16, 3] {
        let r = run_nodes(nodes, nodes as u8, "hello", &[]);
        assert_every_cpu_on_its_own_node(&r, nodes);
    }
}

#[test]
fn a_shared_counter_is_exact_under_both_protocols() {
    for (nodes, protocol) in [(2u16, "vmp"), (2, "ivy"), (3, "vmp")] {
        let r = run_nodes(
            nodes,
            nodes as u8,
            "shared-counter=2000",
            &["--protocol", protocol],
        );
        assert_counter_exact(&r, nodes, protocol);
    }
}

/// The nodes' `polling` figures from a `--metrics` file of `run --nodes`, summed.
fn polling(metrics: &Path) -> (u64, u64) {
    let m: ClusterMetrics =
        serde_json::from_str(&std::fs::read_to_string(metrics).unwrap()).unwrap();
    let mut sum = (0, 0);
    for n in &m.nodes {
        let p = coherence_of(n).polling;
        sum.0 += p.answered;
        sum.1 += p.slept;
    }
    sum
}

#[test]
fn a_shared_counter_is_exact_whether_nodes_poll_for_answers_or_sleep() {
    let dir = tempfile::tempdir().unwrap();
    for poll in ["200us", "0us"] {
        let metrics = dir.path().join(format!("{poll}.json"));
        let m = metrics.to_str().unwrap();
        let flags = ["--fetch-poll", poll, "--metrics", m];
        let r = run_nodes(2, 2, "shared-counter=2000", &flags);
        assert_counter_exact(&r, 2, poll);
        let (answered, slept) = polling(&metrics);
        assert!(answered + slept > 0, "{poll}: no wait with a fault out");
        if poll == "0us" {
            assert_eq!(answered, 0, "a node polled with --fetch-poll 0us");
        }
    }
}

/// Each node's faults below 2 MiB (the probe kernel's image and data) and its hottest pages,
/// from a `--metrics` file of `run --nodes`.
fn kernel_faults(metrics: &Path) -> Vec<(u64, Vec<HotPage>)> {
    let m: ClusterMetrics =
        serde_json::from_str(&std::fs::read_to_string(metrics).unwrap()).unwrap();
    m.nodes
        .iter()
        .map(|n| {
            let f = coherence_of(n).faults;
            let below: u64 = f
                .by_range
                .iter()
                .filter(|(start, _)| **start < 2 << 20)
                .map(|(_, v)| v)
                .sum();
            (below, f.hot_pages)
        })
        .collect()
}

/// A node's coherence counters from the launcher's `--metrics`.
fn coherence_of(node: &Option<Metrics>) -> Coherence {
    node.as_ref()
        .and_then(|m| m.node.as_ref())
        .and_then(|n| n.coherence.clone())
        .expect("every node's metrics have its coherence counters")
}

/// Paper 004's Fig. 6 rests on this: a CPU-bound task on every node fetches almost no page of
/// the kernel while it runs. The probe's code is shared read-only by every node (it used to
/// move between them a few hundred times a second, taken for writing by KVM's asynchronous
/// page faults), and what each CPU writes lies on pages of its own. The hottest pages are
/// named after the kernel's symbols.
#[test]
fn fib_on_four_nodes_leaves_the_kernel_pages_shared() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.json");
    let flags = ["--metrics", metrics.to_str().unwrap()];
    let r = run_nodes(4, 4, "fib=40,procs=8", &flags);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let fib = r.result("fib");
    assert_eq!(fib["ok"], true, "{fib}");
    let nodes = kernel_faults(&metrics);
    assert_eq!(nodes.len(), 4);
    for (k, (below, hot)) in nodes.iter().enumerate() {
        assert!(
            *below <= 250,
            "node {k}: {below} faults on the kernel's pages (at most 250); hottest: {hot:?}"
        );
        let named = hot
            .iter()
            .filter(|p| (1 << 20..2 << 20).contains(&p.gpa))
            .all(|p| p.symbol.as_deref().is_some_and(|s| !s.is_empty()));
        assert!(named, "node {k}: a kernel page without a name: {hot:?}");
    }
}

#[test]
fn a_shared_counter_is_exact_over_a_delayed_link() {
    let r = run_nodes(2, 2, "shared-counter=2000", &["--link-delay", "100us"]);
    assert_counter_exact(&r, 2, "--link-delay 100us");
}

#[test]
fn message_passing_across_nodes_shows_no_forbidden_outcome_by_default() {
    let r = run_nodes(2, 2, "litmus=mp,iters=200", &[]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let l = r.result("litmus");
    assert_eq!(
        l["nodes"],
        serde_json::json!([0, 1]),
        "writer and reader on different nodes: {l}"
    );
    let seen: u64 = l["outcomes"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(seen, 200, "every iteration is accounted for: {l}");
    assert_eq!(l["forbidden"], 0, "{l}");
}

#[test]
fn a_vcpu_on_another_node_prints_and_reads_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let img = common::temp_image(dir.path(), "d.img", 1 << 20);
    let data = std::fs::read(&img).unwrap();
    let disk = format!("path={},readonly=on", img.display());
    let r = run_nodes(2, 2, "hello,cpu=1,blk-crc,cpu=1", &["--disk", &disk]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let h = r.result("hello");
    assert_eq!(
        (h["cpu"].as_u64(), h["cpu_nodes"][1].as_u64()),
        (Some(1), Some(1)),
        "{h}"
    );
    let c = r.result("blk-crc");
    assert_eq!(
        c["disks"][0]["crc32"].as_str().unwrap(),
        format!("{:#010x}", crc32fast::hash(&data)),
        "{}",
        r.explain()
    );
}

/// `--rng` and `--vsock`, handed to every node, reach the devices of the node that holds
/// them (node 0, with vCPU 0, where the probe's rng and vsock tasks run): the other node
/// builds the same layout but makes no listener of its own, so the path is the I/O
/// node's alone and neither node refuses it as taken.
#[test]
fn a_two_node_vm_reads_the_rng_and_echoes_over_vsock() {
    use common::vsock::{connect_at, echo_round_trip, pattern};
    const PORT: u32 = 52;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("v.sock");
    let serial = dir.path().join("serial");
    let vsock = format!("cid=3,socket={}", socket.display());
    let console = format!("file={}", serial.display());
    let mut vm = start_nodes(
        2,
        &format!("hello,cpu=1,rng=4096,vsock-echo={PORT}"),
        &[
            "--rng",
            "bytes_per_sec=65536",
            "--vsock",
            &vsock,
            "--serial",
            &console,
        ],
    );
    vm.wait_for_text(&serial, "vsock-echo: cid 3 listening", RUN_LIMIT);
    let (mut s, line) = connect_at(&socket, PORT, RUN_LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(3000);
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    let r = vm.finish(RUN_LIMIT);
    let text = read_text(&serial);
    assert_eq!(r.code, Some(0), "{}\n{text}", r.explain());
    assert!(!socket.exists(), "the socket file outlived the VM");
    let h = common::result_in(&text, "hello");
    assert_eq!(h["nodes"], 2, "{h}");
    let g = common::result_in(&text, "rng");
    assert_eq!(g["ok"], true, "{g}");
    assert_eq!(g["bytes"], 4096, "{g}");
    let v = common::result_in(&text, "vsock-echo");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["connections"], 1, "{v}");
}

/// The namespaces and links the `--netns` run of launcher `pid` left on this host: every
/// name it makes carries its pid.
fn leftovers(pid: u32) -> Vec<String> {
    let (ns, link) = (format!("musubi-{pid}-"), format!("mb{pid}"));
    let mut left: Vec<String> = ip(&["netns", "list"])
        .lines()
        .filter(|l| l.contains(&ns))
        .map(|l| format!("namespace {l}"))
        .collect();
    left.extend(
        ip(&["-o", "link", "show"])
            .lines()
            .filter(|l| l.contains(&link))
            .map(|l| format!("link {l}")),
    );
    left
}

/// `musubi run --nodes` started (not waited for) with the probe guest running `tasks`.
fn start_nodes(nodes: u16, tasks: &str, flags: &[&str]) -> common::Started {
    let n = nodes.to_string();
    let mut all = vec!["--nodes", &n, "--cpus", &n, "--memory", "64M"];
    all.extend_from_slice(flags);
    let args = probe_args(tasks, &all);
    start_command(musubi(), &args, None)
}

const RUN_LIMIT: Duration = Duration::from_secs(240);

#[test]
fn nodes_in_their_own_namespaces_over_a_delayed_link_see_every_cpu_and_leave_nothing() {
    ip(&["-V"]);
    let started = start_nodes(2, "hello", &["--netns", "--link-delay", "100us"]);
    let pid = started.child.id();
    let r = started.finish(RUN_LIMIT);
    assert_every_cpu_on_its_own_node(&r, 2);
    assert_eq!(leftovers(pid), Vec::<String>::new(), "{}", r.explain());
}

#[test]
fn sigterm_to_the_launcher_of_a_netns_run_leaves_nothing_behind() {
    ip(&["-V"]);
    // spin=0 runs until stopped, so the VM is running when the signal comes.
    let mut started = start_nodes(2, "spin=0", &["--netns"]);
    let pid = started.child.id();
    let t0 = Instant::now();
    // Both node processes are inside their namespaces (`ip netns pids` fails while a
    // namespace does not exist yet).
    let inside = |k: u16| {
        try_ip(&["netns", "pids", &format!("musubi-{pid}-n{k}")]).is_ok_and(|o| !o.is_empty())
    };
    while !(inside(0) && inside(1)) {
        if t0.elapsed() > Duration::from_secs(60) || started.child.try_wait().unwrap().is_some() {
            let r = started.finish(RUN_LIMIT);
            panic!(
                "the nodes never started in their namespaces: {}",
                r.explain()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let r = started.finish(RUN_LIMIT);
    assert_ne!(r.code, Some(0), "{}", r.explain());
    assert!(r.stderr.contains("stopped by signal 15"), "{}", r.explain());
    assert_eq!(leftovers(pid), Vec::<String>::new(), "{}", r.explain());
}

#[test]
fn a_node_whose_link_is_cut_is_lost_and_the_run_ends_with_123_leaving_nothing() {
    ip(&["-V"]);
    // spin=0 runs until stopped: the VM is running when node 2's link goes down.
    let mut started = start_nodes(3, "spin=0", &["--netns"]);
    let guard = common::KillOnPanic::new(&started);
    let pid = started.child.id();
    started.wait_for(
        Duration::from_secs(60),
        || (node_pids(pid).len() >= 3).then_some(()),
        || "the launcher's three nodes".into(),
    );
    std::thread::sleep(Duration::from_millis(1500));
    // Node 2's end of its veth pair, inside its namespace: every process lives on.
    ip(&[
        "-n",
        &format!("musubi-{pid}-n2"),
        "link",
        "set",
        &format!("mb{pid}n2"),
        "down",
    ]);
    guard.defuse();
    let r = started.finish(RUN_LIMIT);
    assert_eq!(r.code, Some(NODE_LOST), "{}", r.explain());
    assert!(
        r.stderr.contains("node 0: lost node 2") || r.stderr.contains("node 1: lost node 2"),
        "a node on the other side of the cut names node 2: {}",
        r.explain()
    );
    assert_eq!(leftovers(pid), Vec::<String>::new(), "{}", r.explain());
}

#[test]
fn a_failed_ip_command_half_way_through_set_up_is_named_and_undone() {
    ip(&["-V"]);
    let real = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("ip"))
        .find(|p| p.is_file())
        .expect("ip is on PATH");
    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("calls");
    // The 11th call adds the second node's veth pair: the first node's namespace and link
    // and the second's namespace exist by then.
    common::fake_vmm(
        dir.path(),
        "ip",
        &format!(
            "echo x >> {calls}\n\
             if [ $(wc -l < {calls}) -eq 11 ]; then echo 'RTNETLINK answers: injected failure' >&2; exit 2; fi\n\
             exec {real} \"$@\"",
            calls = calls.display(),
            real = real.display()
        ),
    );
    let path = std::env::join_paths(
        std::iter::once(dir.path().to_path_buf())
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let mut cmd = musubi();
    cmd.env("PATH", path);
    let args = probe_args("hello", &["--nodes", "2", "--cpus", "2", "--netns"]);
    let started = start_command(cmd, &args, None);
    let pid = started.child.id();
    let r = started.finish(RUN_LIMIT);
    assert_eq!(r.code, Some(1), "{}", r.explain());
    assert!(
        r.stderr.contains("--netns: `ip -n musubi-")
            && r.stderr.contains("link add")
            && r.stderr
                .contains("failed (exit status: 2): RTNETLINK answers: injected failure"),
        "names the command and what it printed: {}",
        r.explain()
    );
    assert_eq!(leftovers(pid), Vec::<String>::new(), "{}", r.explain());
}

/// Runs `cmd` (musubi, or a program that runs it) with `args`, bounded like every run here.
fn run_with(cmd: std::process::Command, args: &[String]) -> Run {
    common::run_command(cmd, args, None, RUN_LIMIT)
}

#[test]
fn netns_without_ip_on_path_says_what_is_missing() {
    let empty = tempfile::tempdir().unwrap();
    let mut cmd = musubi();
    cmd.env("PATH", empty.path());
    let args = probe_args("hello", &["--nodes", "2", "--cpus", "2", "--netns"]);
    let r = run_with(cmd, &args);
    assert_eq!(r.code, Some(1), "{}", r.explain());
    assert!(
        r.stderr.contains("--netns") && r.stderr.contains("iproute2"),
        "{}",
        r.explain()
    );
}

#[test]
fn netns_without_cap_net_admin_is_refused_naming_the_flag() {
    // setpriv (util-linux) takes CAP_NET_ADMIN out of what musubi can have, as for a user
    // without it.
    let setpriv = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("setpriv"))
        .find(|p| p.is_file())
        .expect("this test drops a capability with util-linux's setpriv, which is not on PATH");
    let mut cmd = std::process::Command::new(setpriv);
    cmd.args([
        "--bounding-set",
        "-net_admin",
        "--inh-caps",
        "-net_admin",
        "--",
    ])
    .arg(env!("CARGO_BIN_EXE_musubi"));
    let args = probe_args("hello", &["--nodes", "2", "--cpus", "2", "--netns"]);
    let r = run_with(cmd, &args);
    assert_eq!(r.code, Some(1), "{}", r.explain());
    assert!(
        r.stderr
            .contains("--netns creates network namespaces and needs root")
            && r.stderr.contains("lacks CAP_NET_ADMIN"),
        "{}",
        r.explain()
    );
}

#[test]
fn bad_link_delays_fetch_polls_and_netns_without_nodes_are_refused_by_name() {
    for (flags, wants) in [
        (
            vec!["--nodes", "2", "--link-delay", "abc"],
            vec!["--link-delay", "abc", "e.g. 100us or 2ms"],
        ),
        (
            vec!["--nodes", "2", "--link-delay", "3s"],
            vec!["--link-delay", "3s", "at most 500ms"],
        ),
        (vec!["--netns"], vec!["--netns", "--nodes"]),
        (
            vec!["--link-delay", "100us"],
            vec!["--link-delay", "--nodes"],
        ),
        (
            vec!["--nodes", "2", "--fetch-poll", "soon"],
            vec!["--fetch-poll", "soon", "e.g. 100us or 2ms"],
        ),
        (
            vec!["--fetch-poll", "100us"],
            vec!["--fetch-poll", "--nodes"],
        ),
        (
            vec!["--nodes", "2", "--page-hold", "a while"],
            vec!["--page-hold", "a while", "e.g. 100us or 2ms"],
        ),
        (vec!["--page-hold", "1ms"], vec!["--page-hold", "--nodes"]),
        (
            vec!["--nodes", "2", "--protocol", "fast"],
            vec!["--protocol", "fast", "expected vmp or ivy"],
        ),
        (
            vec!["--nodes", "2", "--ordering", "weak"],
            vec!["--ordering", "weak", "expected tso or paper"],
        ),
    ] {
        let r = run_probe("hello", &flags);
        assert_eq!(r.code, Some(2), "{flags:?}: {}", r.explain());
        for w in wants {
            assert!(
                r.stderr.contains(w),
                "{flags:?}: no {w:?} in {}",
                r.explain()
            );
        }
    }
    // The cluster file's fields, as real hosts give them.
    let c = Cluster::new(&[&[0], &[1]]);
    let text = std::fs::read_to_string(c.file()).unwrap();
    for (field, bad) in [
        ("link_delay", "fast"),
        ("fetch_poll", "-1us"),
        ("page_hold", "soon"),
    ] {
        let mut file: serde_json::Value = serde_json::from_str(&text).unwrap();
        file[field] = serde_json::json!(bad);
        std::fs::write(c.file(), file.to_string()).unwrap();
        let mut node = c.spawn(0, 2, "hello", &[]);
        let st = wait_with_limit(&mut node, Duration::from_secs(60), "node 0");
        let err = c.stderr(0);
        assert_eq!(st.code(), Some(1), "{err}");
        let wants = format!("cluster.json: {field} {bad:?}: expected a number and a unit");
        assert!(err.contains(&wants), "{err}");
    }
}
