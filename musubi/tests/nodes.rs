//! One VM over several node processes on this host: what the guest sees, what the nodes
//! refuse, and how they end when one of them is lost.

mod common;

use common::{musubi, run_probe, wait_with_limit, Run};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
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
        let log =
            |s: &str| std::fs::File::create(self.dir.path().join(format!("node{k}.{s}"))).unwrap();
        musubi()
            .arg("node")
            .arg("--cluster")
            .arg(self.file())
            .args([
                "--id",
                &k.to_string(),
                "--kernel",
                "probe",
                "--memory",
                "64M",
            ])
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

fn assert_kvm() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "these tests need /dev/kvm, which this machine lacks"
    );
}

/// Waits (bounded) until `path` has at least `min` bytes.
fn wait_for_output(path: &Path, what: &str, limit: Duration) {
    let t0 = Instant::now();
    while std::fs::read_to_string(path)
        .map(|s| !s.contains(what))
        .unwrap_or(true)
    {
        assert!(
            t0.elapsed() < limit,
            "{} never printed {what:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
            err.contains("pages"),
            "node {k} says how many pages it owned: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_node_with_another_secret_is_refused() {
    assert_kvm();
    let c = Cluster::new(&[&[0], &[1]]);
    let other = c.dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("secret"), b"not the secret of this VM at all").unwrap();
    std::fs::copy(c.file(), other.join("cluster.json")).unwrap();
    let mut a = c.spawn(0, 2, "hello", &[]);
    let mut b = musubi()
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
    let sb = wait_with_limit(&mut b, Duration::from_secs(60), "node 1");
    let sa = wait_with_limit(&mut a, Duration::from_secs(60), "node 0");
    let mut err_b = String::new();
    b.stderr.take().unwrap().read_to_string(&mut err_b).unwrap();
    assert_ne!(sa.code(), Some(0));
    assert_ne!(sb.code(), Some(0));
    let both = format!("{}\n{err_b}", c.stderr(0));
    assert!(
        both.contains("secret") || both.contains("authenticat"),
        "the refusal names the secret: {both}"
    );
    assert!(!both.contains("panicked"), "{both}");
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

#[test]
fn two_and_three_node_vms_start_every_cpu_on_its_own_node() {
    for nodes in [2u16, 3] {
        let r = run_nodes(nodes, nodes as u8, "hello", &[]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        let h = r.result("hello");
        assert_eq!(h["cpus"], nodes, "{}", r.explain());
        assert_eq!(h["nodes"], nodes);
        assert_eq!(h["pv_ipi"], true);
        let mut on: Vec<u64> = h["cpu_nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        on.sort();
        assert_eq!(
            on,
            (0..nodes as u64).collect::<Vec<_>>(),
            "one CPU per node: {h}"
        );
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
        assert_eq!(r.code, Some(0), "{protocol}: {}", r.explain());
        let c = r.result("shared-counter");
        assert_eq!(c["expected"], 2000 * nodes as u64, "{c}");
        assert_eq!(c["locked"], c["expected"], "{protocol}: spinlock total {c}");
        assert_eq!(c["xadd"], c["expected"], "{protocol}: lock xadd total {c}");
        assert_eq!(c["exact"], true);
    }
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
