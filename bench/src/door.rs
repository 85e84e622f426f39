//! `musubi bench door`: the time from a stranger's connection to a running VM, when the
//! stranger knocks on node 0's port while three nodes link up, for each kind of stranger,
//! beside a start with none. A stranger that held the door would show as a start delayed by
//! the node's handshake deadline (2 s) or its connect deadline (20 s).

use crate::apivm::{wait_until, Vm};
use crate::driver::{Columns, Runs};
use crate::plot::{Bar, Panel};
use crate::report::Table;
use crate::stats::{ratio, Summary};
use crate::Harness;
use dsm::NodeId;
use dsm_host::{Link, LinkParams, Role};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
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
const NAMES: [&str; NODES] = ["node 0", "node 1", "node 2"];
/// Bounds on one start's steps, for a wedged run, not a slow one.
const STEP_LIMIT: Duration = Duration::from_secs(60);

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    crate::driver::need_kvm("runs VMs")?;
    let reps = if h.quick { 1 } else { 5 };
    let exe = crate::probe::musubi()?;
    println!(
        "door: probe guest (hello) on {NODES} nodes on loopback, one vCPU each; node 1 \
         linked with node 0, then a stranger knocks on node 0's port and node 2 starts at once"
    );
    println!("  time from the stranger's connection to the guest's first output; {reps} run(s) per case, interleaved");
    let runs = Runs::measure(
        h,
        CASES.to_vec(),
        reps,
        |c| c.name().into(),
        |_, &c| one(&exe, c),
    )?;
    type Row<'a> = (usize, &'a Stranger, &'a Start);
    let csv = Columns::new()
        .col("case", |x: &Row| x.1.name().to_string())
        .col("run", |x| (x.0 + 1).to_string())
        .col("ms_to_vm", |x| format!("{:.2}", x.2.ms))
        .col("refusals_logged", |x| x.2.refusals.to_string())
        .csv(runs.iter());
    let summary = |i: usize| {
        let ms: Vec<f64> = runs
            .runs
            .iter()
            .filter(|r| r.1 == i)
            .map(|r| r.2.ms)
            .collect();
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
            .runs
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
    // Killed and reaped on every way out (`Vm`'s drop).
    let mut nodes: Vec<Vm> = Vec::new();
    let spawn = |k: usize| -> Result<Vm, String> {
        let mut cmd = Command::new(exe);
        cmd.args(["node", "--cluster"])
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
            .env("MUSUBI_LOG", "info");
        Vm::start_to(cmd, NAMES[k], &path(k, "out"), &path(k, "err"))
    };
    let log0 = path(0, "err");
    let said = |what: &'static str| {
        let log = log0.clone();
        move || std::fs::read_to_string(&log).is_ok_and(|s| s.contains(what))
    };
    nodes.push(spawn(0)?);
    wait_until(
        &nodes[0],
        "waiting at its port",
        STEP_LIMIT,
        said("waits at"),
    )?;
    nodes.push(spawn(1)?);
    wait_until(
        &nodes[0],
        "node 1 linked",
        STEP_LIMIT,
        said("linked with n1"),
    )?;
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
    nodes.push(spawn(2)?);
    let ms = first_output(&path(0, "out"), t0, &nodes)?;
    if let Some(t) = handshake {
        let _ = t.join();
    }
    drop(held);
    for n in &nodes {
        if !n.wait_exit(STEP_LIMIT) {
            return Err(format!("still running after {STEP_LIMIT:?}; {}", n.said()));
        }
        if n.exit_code() != Some(0) {
            return Err(format!("ended with {:?}; {}", n.exit_code(), n.said()));
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

/// Polls `path` until the guest has printed something; the milliseconds since `t0`. Polled
/// more often than [`wait_until`] does, since this is the figure measured.
fn first_output(path: &Path, t0: Instant, nodes: &[Vm]) -> Result<f64, String> {
    loop {
        if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
            return Ok(t0.elapsed().as_secs_f64() * 1e3);
        }
        if let Some(n) = nodes.iter().find(|n| n.ended()) {
            return Err(format!(
                "ended before the guest printed anything; {}",
                n.said()
            ));
        }
        if t0.elapsed() > STEP_LIMIT {
            return Err(format!("the guest printed nothing on {}", path.display()));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}
