//! `musubi bench door`: the time from a stranger's connection to a running VM, when the
//! stranger knocks on node 0's port while three nodes link up, for each kind of stranger,
//! beside a start with none. A stranger that held the door would show as a start delayed by
//! the node's handshake deadline (2 s) or its connect deadline (20 s).

use crate::plot::{Bar, Panel};
use crate::report::{Csv, Table};
use crate::stats::{ratio, Summary};
use crate::Harness;
use dsm::NodeId;
use dsm_host::{Link, LinkParams, Role};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What knocks on node 0's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stranger {
    None,
    Garbage,
    Silent,
    EarlyClose,
    /// Fifty connections closed at once: more than the door's handshake slots.
    Quick50,
    WrongSecret,
    /// The secret, but a node the cluster does not have.
    BadId,
    /// The secret, as node 1, which is already linked.
    Duplicate,
}

const CASES: [Stranger; 8] = [
    Stranger::None,
    Stranger::Garbage,
    Stranger::Silent,
    Stranger::EarlyClose,
    Stranger::Quick50,
    Stranger::WrongSecret,
    Stranger::BadId,
    Stranger::Duplicate,
];

impl Stranger {
    fn name(self) -> &'static str {
        match self {
            Stranger::None => "none",
            Stranger::Garbage => "garbage (4 KiB)",
            Stranger::Silent => "silent",
            Stranger::EarlyClose => "early close",
            Stranger::Quick50 => "50 connect-and-close",
            Stranger::WrongSecret => "wrong secret",
            Stranger::BadId => "unknown node id",
            Stranger::Duplicate => "second node 1",
        }
    }
}

/// One start: milliseconds from the stranger's connection (or, with none, from the last
/// node's start) to the guest's first output, and the refusals node 0 logged.
struct Start {
    ms: f64,
    refusals: usize,
}

const SECRET: &[u8] = b"the secret of the nodes of this VM";
const NODES: usize = 3;
/// Bounds on one start's steps, for a wedged run, not a slow one.
const STEP_LIMIT: Duration = Duration::from_secs(60);

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("/dev/kvm does not exist: this benchmark runs VMs and needs KVM".into());
    }
    let reps = if h.quick { 1 } else { 5 };
    let exe = crate::probe::musubi()?;
    println!(
        "door: probe guest (hello) on {NODES} nodes on loopback, one vCPU each; node 1 \
         linked with node 0, then a stranger knocks on node 0's port and node 2 starts at once"
    );
    println!("  time from the stranger's connection to the guest's first output; {reps} run(s) per case, interleaved");
    let runs = h.run_schedule(&CASES, reps, |c| c.name().into(), |_, &c| one(&exe, c))?;

    let mut csv = Csv::new(&["case", "run", "ms_to_vm", "refusals_logged"]);
    for (rep, c, s) in &runs {
        csv.row([
            CASES[*c].name().to_string(),
            (rep + 1).to_string(),
            format!("{:.2}", s.ms),
            s.refusals.to_string(),
        ]);
    }
    let summary = |i: usize| {
        let ms: Vec<f64> = runs.iter().filter(|r| r.1 == i).map(|r| r.2.ms).collect();
        Summary::of(&ms)
    };
    let base = summary(0).map(|s| s.median);
    let mut t = Table::new(&[
        "stranger",
        ">ms to VM (median / min)",
        ">x none",
        ">refusals logged one by one",
    ]);
    let mut bars = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        let s = summary(i);
        let refusals = runs
            .iter()
            .filter(|r| r.1 == i)
            .map(|r| r.2.refusals)
            .max()
            .unwrap_or(0);
        t.row([
            c.name().to_string(),
            s.map_or("n/a".into(), |s| format!("{:.1} / {:.1}", s.median, s.min)),
            match (s, base) {
                (Some(s), Some(b)) => {
                    ratio(s.median, b).map_or("n/a".into(), |r| format!("{r:.2}"))
                }
                _ => "n/a".into(),
            },
            refusals.to_string(),
        ]);
        if let Some(s) = s {
            bars.push(Bar {
                label: c.name().into(),
                value: s.median,
                low: Some(s.min),
            });
        }
    }
    println!("{}", t.render());
    println!(
        "every start ran the VM; a stranger that held the door would add its handshake deadline (2000 ms)"
    );
    h.write_results(
        "door",
        &csv,
        "A stranger at a linking node's port: time to a running VM",
        &[Panel {
            title:
                "from the stranger's connection to the guest's first output (median, min marked)"
                    .into(),
            unit: "ms".into(),
            bars,
        }],
    )
}

/// Kills the nodes still running when a start ends early.
struct Nodes(Vec<Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

fn one(exe: &Path, case: Stranger) -> Result<Start, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
    std::fs::write(dir.path().join("secret"), SECRET).map_err(|e| format!("the secret: {e}"))?;
    let addrs = free_ports()?;
    let nodes: Vec<serde_json::Value> = addrs
        .iter()
        .enumerate()
        .map(|(k, a)| serde_json::json!({"address": a.to_string(), "vcpus": [k]}))
        .collect();
    let file = dir.path().join("cluster.json");
    let cluster = serde_json::json!({"secret_file": "secret", "nodes": nodes});
    std::fs::write(&file, cluster.to_string()).map_err(|e| format!("the cluster file: {e}"))?;
    let path = |k: usize, s: &str| dir.path().join(format!("node{k}.{s}"));
    let mut running = Nodes(Vec::new());
    let spawn = |k: usize| -> Result<Child, String> {
        let log = |s: &str| {
            std::fs::File::create(path(k, s)).map_err(|e| format!("{}: {e}", path(k, s).display()))
        };
        Command::new(exe)
            .args(["node", "--cluster"])
            .arg(&file)
            .args([
                "--id",
                &k.to_string(),
                "--kernel",
                "probe",
                "--memory",
                "64M",
            ])
            .args(["--cpus", &NODES.to_string(), "--timeout", "60"])
            .args(["--cmdline", "probe.tasks=hello"])
            .env("MUSUBI_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log("out")?)
            .stderr(log("err")?)
            .spawn()
            .map_err(|e| format!("{}: {e}", exe.display()))
    };
    running.0.push(spawn(0)?);
    wait_for(&path(0, "err"), "waits at", &mut running)?;
    running.0.push(spawn(1)?);
    wait_for(&path(0, "err"), "linked with n1", &mut running)?;
    // A stranger with the secret must also bring the VM's configuration hash; a misconfigured
    // real node would. It is read from node 0's hello on a connection made for that.
    let hash = match case {
        Stranger::BadId | Stranger::Duplicate => Some(config_hash_of(addrs[0])?),
        _ => None,
    };

    let door = addrs[0];
    let connect = || TcpStream::connect(door).map_err(|e| format!("connecting to {door}: {e}"));
    let t0 = Instant::now();
    let mut held: Vec<TcpStream> = Vec::new();
    let mut handshake = None;
    match case {
        Stranger::None => {}
        Stranger::Garbage => {
            let mut s = connect()?;
            s.write_all(&[0xa5; 4096])
                .map_err(|e| format!("sending garbage: {e}"))?;
            held.push(s);
        }
        Stranger::Silent => held.push(connect()?),
        Stranger::EarlyClose => {
            let mut s = connect()?;
            let _ = s.write_all(b"MUSUBI");
        }
        Stranger::Quick50 => {
            for _ in 0..50 {
                drop(connect()?);
            }
        }
        Stranger::WrongSecret | Stranger::BadId | Stranger::Duplicate => {
            let s = connect()?;
            let (id, secret) = match case {
                Stranger::WrongSecret => (1, b"a guess at the secret".as_slice()),
                Stranger::BadId => (7, SECRET),
                _ => (1, SECRET),
            };
            let p = LinkParams {
                me: NodeId(id),
                secret: secret.to_vec(),
                config_hash: hash.unwrap_or([0; 32]),
                config_parts: Vec::new(),
                timeout: STEP_LIMIT,
            };
            handshake = Some(std::thread::spawn(move || {
                Link::handshake(s, Role::Dialer, None, &p).map(|_| ())
            }));
        }
    }
    running.0.push(spawn(2)?);
    let ms = first_output(&path(0, "out"), t0, &mut running)?;
    if let Some(t) = handshake {
        let _ = t.join();
    }
    drop(held);
    for (k, c) in running.0.iter_mut().enumerate() {
        let st = wait_bounded(c, STEP_LIMIT).map_err(|e| format!("node {k}: {e}"))?;
        if !st.success() {
            return Err(format!(
                "node {k} ended with {st}: {}",
                std::fs::read_to_string(path(k, "err")).unwrap_or_default()
            ));
        }
    }
    let out = std::fs::read_to_string(path(0, "out")).unwrap_or_default();
    if !out.contains("\"probe\":\"hello\"") || !out.contains("\"cpus\":3") {
        return Err(format!("the guest did not see its three vCPUs:\n{out}"));
    }
    let err = std::fs::read_to_string(path(0, "err")).unwrap_or_default();
    let refusals = err
        .lines()
        .filter(|l| l.contains(" refused ") && l.contains("while linking"))
        .count();
    // The connection that read the configuration hash is refused too.
    let probe = usize::from(hash.is_some());
    let expected = if case == Stranger::None {
        refusals == 0
    } else {
        refusals > probe
    };
    if !expected {
        return Err(format!(
            "{}: node 0 logged {refusals} refusals, which is not what the case makes:\n{err}",
            case.name()
        ));
    }
    Ok(Start { ms, refusals })
}

/// Three loopback addresses free at this moment.
fn free_ports() -> Result<Vec<SocketAddr>, String> {
    let ls: Vec<TcpListener> = (0..NODES)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("reserving a loopback port: {e}"))?;
    ls.iter()
        .map(|l| l.local_addr().map_err(|e| e.to_string()))
        .collect()
}

/// The configuration hash in the hello a node sends on every connection.
fn config_hash_of(addr: SocketAddr) -> Result<[u8; 32], String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    s.set_read_timeout(Some(STEP_LIMIT))
        .map_err(|e| e.to_string())?;
    let mut hello = [0u8; 75];
    s.read_exact(&mut hello)
        .map_err(|e| format!("node 0's hello: {e}"))?;
    Ok(hello[43..75].try_into().expect("32 bytes"))
}

fn wait_for(path: &Path, what: &str, nodes: &mut Nodes) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        if std::fs::read_to_string(path).is_ok_and(|s| s.contains(what)) {
            return Ok(());
        }
        if t0.elapsed() > STEP_LIMIT || exited(nodes) {
            return Err(format!(
                "{} never said {what:?}:\n{}",
                path.display(),
                std::fs::read_to_string(path).unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Polls `path` until the guest has printed something; the milliseconds since `t0`.
fn first_output(path: &Path, t0: Instant, nodes: &mut Nodes) -> Result<f64, String> {
    loop {
        if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
            return Ok(t0.elapsed().as_secs_f64() * 1e3);
        }
        if t0.elapsed() > STEP_LIMIT || exited(nodes) {
            return Err(format!("the guest printed nothing on {}", path.display()));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn exited(nodes: &mut Nodes) -> bool {
    nodes
        .0
        .iter_mut()
        .any(|c| matches!(c.try_wait(), Ok(Some(_))))
}

fn wait_bounded(c: &mut Child, limit: Duration) -> Result<std::process::ExitStatus, String> {
    let t0 = Instant::now();
    loop {
        if let Some(s) = c.try_wait().map_err(|e| e.to_string())? {
            return Ok(s);
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            return Err(format!("still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
