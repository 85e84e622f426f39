//! One VM over several nodes from the command line: `musubi node` runs one node from a
//! cluster file, and `musubi run --nodes N` starts N such node processes on this host over
//! loopback (or, with `--netns`, over a network of their own) and supervises them as one VM.

use crate::cli::{FileConfig, RunFlags, VmArgs};
use crate::netns::{self, Netns};
use crate::run::{report_json, write_json, SignalWatch};
use clap::Args;
use musubi_cluster::{ClusterSpec, Node, NodeAddr, NodeOptions};
use serde::Deserialize;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// How long a node waits for every other node to come up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// After one node process ended, how long the others get to end by themselves (they see the
/// stop or the loss) before they are killed.
const PEERS_GRACE: Duration = Duration::from_secs(8);
/// How long the launcher waits, after the first declaration of a lost peer, for a majority
/// of the other nodes to name one peer before it kills the one most of them named. The
/// survivors of a freeze or a cut see the same silence, but a survivor's teardown may take
/// up to its own 2 s bound (a vCPU stopped on a page of the lost node), so one that ends
/// first must not decide alone.
const DECLARATIONS_LIMIT: Duration = Duration::from_secs(3);
/// The port every node listens on under `--netns`: each has a namespace, so ports of its own.
const NETNS_PORT: u16 = 7000;

/// How `run --nodes` links its nodes.
#[derive(Args, Debug, Clone, Default)]
pub struct NetFlags {
    /// With --nodes, as root: run each node in a network namespace of its own, the
    /// namespaces joined by veth links to a bridge (addresses from 10.211.0.0/24, seen only
    /// inside them), so node traffic crosses a real network stack instead of loopback. The
    /// namespaces, links and bridge are removed when the run ends, however it ends (short of
    /// SIGKILL). Needs iproute2's `ip`.
    #[arg(long, requires = "nodes")]
    pub netns: bool,
    /// With --nodes: hold every frame a node sends for this long before it is written (a
    /// one-way delay, e.g. 100us, 2ms; units ns, us, ms, s; at most 500ms), to emulate a
    /// slower network. Done in Musubi's own link layer rather than with `tc netem`, which
    /// some kernels lack (it needs CONFIG_NET_SCH_NETEM) and which needs root; so it works
    /// with or without --netns, and between real hosts (the cluster file's "link_delay").
    #[arg(long, value_name = "DURATION", requires = "nodes", value_parser = parse_duration)]
    pub link_delay: Option<Duration>,
    /// With --nodes: while a fault waits for a peer's answer, how long a node polls for it
    /// before it sleeps (the cluster file's "fetch_poll"; default 200us, 0 to sleep at once).
    /// The faulting vCPU is stopped meanwhile; polling saves the wake-up when the answer
    /// comes, and the window shrinks by itself on links slower than it.
    #[arg(long, value_name = "DURATION", requires = "nodes", value_parser = parse_duration)]
    pub fetch_poll: Option<Duration>,
}

pub use musubi_cluster::parse_duration;

/// The cluster file: the VM (same fields as `--config`) and its nodes.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default)]
    vm: FileConfig,
    /// `vmp` (default) or `ivy`.
    protocol: Option<String>,
    /// `tso` (default) or `paper` (unsafe for x86 guests).
    ordering: Option<String>,
    /// Relative to the cluster file's directory.
    secret_file: PathBuf,
    #[serde(default)]
    io_node: u16,
    /// One-way delay on every frame a node sends, as `--link-delay` (e.g. "100us").
    link_delay: Option<String>,
    /// As `--fetch-poll` (e.g. "200us", "0us").
    fetch_poll: Option<String>,
    nodes: Vec<ClusterNode>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ClusterNode {
    address: String,
    vcpus: Vec<u8>,
}

pub fn parse_protocol(flag: &str, s: &str) -> Result<dsm::Protocol, String> {
    match s {
        "vmp" => Ok(dsm::Protocol::Vmp),
        "ivy" => Ok(dsm::Protocol::Ivy),
        _ => Err(format!("{flag} {s:?}: expected vmp or ivy")),
    }
}

pub fn parse_ordering(flag: &str, s: &str) -> Result<dsm::Ordering, String> {
    match s {
        "tso" => Ok(dsm::Ordering::Tso),
        "paper" => Ok(dsm::Ordering::Paper),
        _ => Err(format!(
            "{flag} {s:?}: expected tso or paper (paper is unsafe for x86 guests)"
        )),
    }
}

/// What a cluster file describes.
struct Cluster {
    config: vmm::config::VmConfig,
    spec: ClusterSpec,
    link_delay: Duration,
    fetch_poll: Duration,
}

/// Reads a cluster file into the VM it describes (flags override its `vm` section) and
/// the cluster.
fn read_cluster(path: &Path, vm: &VmArgs) -> Result<Cluster, String> {
    let at = |e: String| format!("--cluster {}: {e}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
    let json = &mut serde_json::Deserializer::from_str(&text);
    let file: ClusterFile = serde_path_to_error::deserialize(json)
        .map_err(|e| at(format!("invalid cluster file: {}: {}", e.path(), e.inner())))?;
    let protocol =
        parse_protocol("protocol", file.protocol.as_deref().unwrap_or("vmp")).map_err(at)?;
    let ordering =
        parse_ordering("ordering", file.ordering.as_deref().unwrap_or("tso")).map_err(at)?;
    let link_delay = match &file.link_delay {
        Some(d) => parse_duration(d).map_err(|e| at(format!("link_delay {d:?}: {e}")))?,
        None => Duration::ZERO,
    };
    let fetch_poll = match &file.fetch_poll {
        Some(d) => parse_duration(d).map_err(|e| at(format!("fetch_poll {d:?}: {e}")))?,
        None => musubi_cluster::DEFAULT_POLL_WINDOW,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let secret_path = dir.join(&file.secret_file);
    let secret = std::fs::read(&secret_path)
        .map_err(|e| at(format!("secret_file {}: {e}", secret_path.display())))?;
    let nodes = file
        .nodes
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            let address: SocketAddr = n.address.parse().map_err(|e| {
                at(format!(
                    "nodes[{i}].address {:?}: {e} (expected IP:PORT)",
                    n.address
                ))
            })?;
            Ok(NodeAddr {
                address,
                vcpus: n.vcpus,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let config = vm.to_config_over(file.vm)?;
    let spec = ClusterSpec {
        nodes,
        protocol,
        ordering,
        io_node: file.io_node,
        secret,
    };
    Ok(Cluster {
        config,
        spec,
        link_delay,
        fetch_poll,
    })
}

/// The variables a launcher sets to each process's rank, in the order they are read:
/// OpenMPI's `mpirun`, MPICH's and Intel MPI's (PMI), Slurm's `srun`.
pub const RANK_VARIABLES: [&str; 3] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];

/// This node's id when `--id` is not given: the rank a launcher (`mpirun`, `srun`) gave the
/// process, from the first of [`RANK_VARIABLES`] that `var` finds set, with that variable's
/// name. Two variables that disagree, or a value that is not a rank, are refused by name.
pub fn rank_from_launcher(
    var: impl Fn(&str) -> Option<String>,
) -> Result<(u16, &'static str), String> {
    let mut found: Vec<(&'static str, u16)> = Vec::new();
    for name in RANK_VARIABLES {
        if let Some(value) = var(name) {
            let rank = value.trim().parse::<u16>().map_err(|_| {
                format!("{name}={value:?}: not a rank (a whole number from 0 to 65535)")
            })?;
            found.push((name, rank));
        }
    }
    let Some(&(first, rank)) = found.first() else {
        return Err(format!(
            "no --id, and none of {} is set: give --id K, or start the nodes with a launcher \
             (mpirun, srun) that sets one",
            RANK_VARIABLES.join(", ")
        ));
    };
    if let Some((other, r)) = found.iter().find(|(_, r)| *r != rank) {
        return Err(format!(
            "{first}={rank} and {other}={r} disagree, so which node this is is unclear; give \
             --id K"
        ));
    }
    Ok((rank, first))
}

/// `musubi node`: runs node `id` of `cluster` (or the one the launcher's rank names) until
/// the VM ends anywhere.
pub fn node(
    cluster_path: &Path,
    id: Option<u16>,
    vm: &VmArgs,
    run: &RunFlags,
    api_socket: Option<&Path>,
) -> ExitCode {
    let timeout = match run.timeout() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("musubi: {e}");
            return ExitCode::from(1);
        }
    };
    let (id, from) = match id {
        Some(id) => (id, None),
        None => match rank_from_launcher(|k| std::env::var(k).ok()) {
            Ok((id, name)) => (id, Some(name)),
            Err(e) => {
                eprintln!("musubi: node: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let fail = |msg: String| {
        eprintln!("musubi: node {id}: {msg}");
        ExitCode::from(1)
    };
    let Cluster {
        config,
        spec: cluster,
        link_delay,
        fetch_poll,
    } = match read_cluster(cluster_path, vm) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Some(name) = from {
        let n = cluster.nodes.len();
        if usize::from(id) >= n {
            return fail(format!(
                "{name}={id} names no node: --cluster {} has {n} (ids 0 to {})",
                cluster_path.display(),
                n.saturating_sub(1)
            ));
        }
        eprintln!("musubi: node {id}: id {id} from the launcher's {name}");
    }
    let signals = match Signals::new([SIGTERM, SIGINT, SIGHUP, SIGUSR1]) {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot install signal handlers: {e}")),
    };
    let opts = vmm::RunOptions {
        capture_serial: false,
        timeout,
        seccomp: run.seccomp,
    };
    let node_opts = NodeOptions {
        cluster,
        id,
        connect_timeout: CONNECT_TIMEOUT,
        link_delay,
        fetch_poll,
    };
    let built = match Node::build(&config, &opts, &node_opts) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("musubi: {e}");
            return ExitCode::from(1);
        }
    };
    let running = match built.start() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("musubi: {e}");
            return ExitCode::from(1);
        }
    };
    let api = api_socket.and_then(|path| {
        let target = std::sync::Arc::new(crate::node_api::NodeApi {
            vm: running.handle(),
            mover: running.mover(),
        });
        crate::api_target::serve(path, target, run.seccomp, &running.handle())
    });
    let watch = SignalWatch::start(signals, running.handle(), run.metrics.clone());
    let done = running.wait();
    drop(api);
    watch.close();
    let report = &done.report;
    if let Some(p) = &run.metrics {
        write_json(p, "--metrics", &report.metrics);
    }
    if let Some(p) = &run.report {
        let mut j = report_json(report);
        j["node"] = serde_json::json!(id);
        j["coherence"] = done.coherence.clone();
        write_json(p, "--report", &j);
    }
    match &report.outcome {
        vmm::Outcome::GuestCrash(m) => eprintln!("musubi: node {id}: guest crashed: {m}"),
        vmm::Outcome::VmmError(m) => eprintln!("musubi: node {id}: {m}"),
        vmm::Outcome::Signal(s) => eprintln!("musubi: node {id}: stopped by signal {s}"),
        vmm::Outcome::NodeLost { node, pages, why } => eprintln!(
            "musubi: node {id}: lost node {node} ({why}); it owned at least {pages} pages of guest memory (those this node's directory manages), so the VM cannot go on"
        ),
        _ => {}
    }
    if let Some(e) = &done.coherence_error {
        if !matches!(report.outcome, vmm::Outcome::NodeLost { .. }) {
            eprintln!("musubi: node {id}: coherence: {e}");
        }
    }
    ExitCode::from(report.outcome.exit_code() as u8)
}

pub struct LaunchArgs<'a> {
    pub nodes: u16,
    pub protocol: dsm::Protocol,
    pub ordering: dsm::Ordering,
    pub vm: &'a VmArgs,
    pub run: &'a RunFlags,
    pub net: &'a NetFlags,
}

/// `musubi run --nodes N`: the VM over N node processes on this host.
pub fn launch(args: LaunchArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("musubi: {msg}");
        ExitCode::from(1)
    };
    let config = match args.vm.to_config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let n = args.nodes;
    if n == 0 {
        return fail("--nodes 0: a VM needs at least one node".into());
    }
    // Refuse what no node could run before starting any.
    let placeholder: Vec<SocketAddr> = (0..n)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], 1 + i)))
        .collect();
    let check = ClusterSpec::round_robin(
        &placeholder,
        config.cpus,
        args.protocol,
        args.ordering,
        vec![0; 32],
    );
    if let Err(e) = check.check(&config, 0) {
        return fail(format!("--nodes {n}: {e}"));
    }
    let dir = match tempfile::Builder::new().prefix("musubi-nodes-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            return fail(format!(
                "cannot create a directory for the cluster file: {e}"
            ))
        }
    };
    // Before anything is made that must be removed again: a stop signal from here on is
    // seen, not fatal, so every exit path runs the clean-up.
    let mut signals = match Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot install signal handlers: {e}")),
    };
    let mut stopped_by = None;
    let net = if args.net.netns {
        let mut interrupted = || {
            let s = signals.pending().next();
            stopped_by = stopped_by.or(s);
            s
        };
        match Netns::create(n, &mut interrupted) {
            Ok(net) => Some(net),
            Err(e) => {
                eprintln!("musubi: {e}");
                return ExitCode::from(stopped_by.map_or(1, |s| 128 + s as u8));
            }
        }
    } else {
        None
    };
    let addrs = match &net {
        Some(_) => Ok((0..n)
            .map(|k| SocketAddr::from((netns::address(k), NETNS_PORT)))
            .collect()),
        None => free_loopback_ports(n),
    };
    let cluster_path = match addrs.and_then(|addrs| {
        write_cluster(
            dir.path(),
            &addrs,
            config.cpus,
            args.protocol,
            args.ordering,
            args.net,
        )
    }) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(format!("cannot find this program to start the nodes: {e}")),
    };
    let report_of = |k: u16| dir.path().join(format!("node{k}.report.json"));
    let metrics_of = |k: u16| dir.path().join(format!("node{k}.metrics.json"));
    let mut children: Vec<(u16, Child)> = Vec::new();
    for k in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.arg("node")
            .arg("--cluster")
            .arg(&cluster_path)
            .args(["--id", &k.to_string()])
            .args(args.vm.to_args())
            .args(["--seccomp", &args.run.seccomp.to_string()])
            .arg("--report")
            .arg(report_of(k));
        if args.run.metrics.is_some() {
            cmd.arg("--metrics").arg(metrics_of(k));
        }
        if let Some(t) = args.run.timeout {
            cmd.args(["--timeout", &t.to_string()]);
        }
        // The I/O node holds the serial console.
        if k != 0 {
            cmd.stdin(Stdio::null());
        }
        if let Some(net) = &net {
            net.enter(k, &mut cmd);
        }
        match cmd.spawn() {
            Ok(c) => children.push((k, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return fail(format!("cannot start node {k}: {e}"));
            }
        }
    }
    // A node that ended because it lost a peer names that peer in its report.
    let lost_by = |k: u16| -> Option<u16> {
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(report_of(k)).ok()?).ok()?;
        let outcome = &report["outcome"];
        (outcome["kind"] == "node_lost")
            .then(|| outcome["node"].as_u64())
            .flatten()
            .and_then(|n| u16::try_from(n).ok())
    };
    let statuses = supervise(&mut children, &mut signals, &lost_by);
    let code = statuses
        .iter()
        .find(|(k, _)| *k == 0)
        .and_then(|(_, c)| *c)
        .or_else(|| statuses.iter().find_map(|(_, c)| c.filter(|&c| c != 0)))
        .unwrap_or(1);
    let read = |p: PathBuf| -> serde_json::Value {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    };
    if let Some(p) = &args.run.report {
        let nodes: Vec<serde_json::Value> = (0..n).map(|k| read(report_of(k))).collect();
        let mut j = nodes[0].clone();
        if !j.is_object() {
            j = serde_json::json!({});
        }
        j["exit_code"] = serde_json::json!(code);
        j["nodes"] = serde_json::Value::Array(nodes);
        write_json(p, "--report", &j);
    }
    if let Some(p) = &args.run.metrics {
        let nodes: Vec<serde_json::Value> = (0..n).map(|k| read(metrics_of(k))).collect();
        write_json(p, "--metrics", &serde_json::json!({ "nodes": nodes }));
    }
    ExitCode::from(code as u8)
}

/// Waits for every node process; passes stop signals on, and once one process has ended,
/// gives the others [`PEERS_GRACE`] to follow before killing them. Nodes that end having
/// lost a peer (`lost_by` of one names its peer) have the peer most of them named killed
/// as soon as more than half of the other nodes named it, or [`DECLARATIONS_LIMIT`] after
/// the first declaration: a peer that froze or was cut off would otherwise hold the
/// launcher for the grace period.
/// Returns each node's exit status (None if it was killed).
fn supervise(
    children: &mut Vec<(u16, Child)>,
    signals: &mut Signals,
    lost_by: &dyn Fn(u16) -> Option<u16>,
) -> Vec<(u16, Option<i32>)> {
    let mut done: Vec<(u16, Option<i32>)> = Vec::new();
    let nodes = children.len();
    let mut first_end: Option<Instant> = None;
    // (node that ended having lost a peer, the peer it names)
    let mut declared: Vec<(u16, u16)> = Vec::new();
    let mut first_declared: Option<Instant> = None;
    let mut acted = false;
    while !children.is_empty() {
        for sig in signals.pending() {
            for (_, c) in children.iter() {
                // SAFETY: kill only sends a signal to a child this process started and has
                // not yet reaped.
                unsafe { libc::kill(c.id() as i32, sig) };
            }
        }
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait() {
                Ok(Some(status)) => {
                    let (k, _) = children.remove(i);
                    first_end.get_or_insert_with(Instant::now);
                    done.push((k, status.code()));
                    if status.code() == Some(vmm::NODE_LOST_STATUS) {
                        if let Some(l) = lost_by(k) {
                            declared.push((k, l));
                            first_declared.get_or_insert_with(Instant::now);
                        }
                    }
                }
                Ok(None) => i += 1,
                Err(_) => {
                    let (k, _) = children.remove(i);
                    done.push((k, None));
                }
            }
        }
        // Declarations are counted before one is acted on: a node cut off from the others
        // declares them lost as they declare it, and the node most nodes declared lost is
        // the one cut off or frozen.
        let votes = |l: u16| declared.iter().filter(|(_, d)| *d == l).count();
        let majority = children.iter().any(|c| 2 * votes(c.0) > nodes - 1);
        let settled = first_declared.is_some_and(|t| majority || t.elapsed() >= DECLARATIONS_LIMIT)
            || (first_declared.is_some() && children.len() <= 1);
        if settled && !acted {
            acted = true;
            let most = children.iter().map(|c| c.0).max_by_key(|&l| votes(l));
            if let Some(l) = most.filter(|&l| votes(l) > 0) {
                let by: Vec<String> = declared
                    .iter()
                    .filter(|(_, d)| *d == l)
                    .map(|(k, _)| k.to_string())
                    .collect();
                if let Some(pos) = children.iter().position(|c| c.0 == l) {
                    let (l, mut c) = children.remove(pos);
                    eprintln!(
                        "musubi: node {l} was declared lost by node(s) {}; killed",
                        by.join(", ")
                    );
                    let _ = c.kill();
                    let _ = c.wait();
                    done.push((l, None));
                }
            }
        }
        if first_end.is_some_and(|t| t.elapsed() > PEERS_GRACE) {
            for (k, c) in children.iter_mut() {
                eprintln!(
                    "musubi: node {k} did not end within {PEERS_GRACE:?} of another node; killed"
                );
                let _ = c.kill();
                let _ = c.wait();
                done.push((*k, None));
            }
            children.clear();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done
}

/// `n` loopback addresses with ports the kernel hands out now; the nodes bind them a moment
/// later.
fn free_loopback_ports(n: u16) -> Result<Vec<SocketAddr>, String> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot find a free loopback port: {e}"))?;
    listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot find a free loopback port: {e}"))
}

/// Writes a cluster file for nodes at `addrs`, with a fresh secret beside it (both readable
/// by this user only).
fn write_cluster(
    dir: &Path,
    addrs: &[SocketAddr],
    cpus: u8,
    protocol: dsm::Protocol,
    ordering: dsm::Ordering,
    net: &NetFlags,
) -> Result<PathBuf, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut secret = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(|e| format!("cannot read a secret from /dev/urandom: {e}"))?;
    let secret_path = dir.join("secret");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&secret_path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &secret))
        .map_err(|e| format!("cannot write {}: {e}", secret_path.display()))?;
    let spec = ClusterSpec::round_robin(addrs, cpus, protocol, ordering, Vec::new());
    let mut json = serde_json::json!({
        "protocol": protocol.name(),
        "ordering": ordering.name(),
        "secret_file": "secret",
        "io_node": 0,
        "nodes": spec.nodes.iter().map(|nd| serde_json::json!({
            "address": nd.address.to_string(),
            "vcpus": nd.vcpus,
        })).collect::<Vec<_>>(),
    });
    if let Some(d) = net.link_delay {
        json["link_delay"] = serde_json::json!(format!("{}ns", d.as_nanos()));
    }
    if let Some(d) = net.fetch_poll {
        json["fetch_poll"] = serde_json::json!(format!("{}ns", d.as_nanos()));
    }
    let path = dir.join("cluster.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_rank_comes_from_the_first_launcher_variable_set_and_others_must_agree() {
        assert_eq!(
            rank_from_launcher(env(&[("OMPI_COMM_WORLD_RANK", "2")])),
            Ok((2, "OMPI_COMM_WORLD_RANK"))
        );
        assert_eq!(
            rank_from_launcher(env(&[("SLURM_PROCID", "1"), ("PMI_RANK", "1")])),
            Ok((1, "PMI_RANK"))
        );
        assert_eq!(
            rank_from_launcher(env(&[("SLURM_PROCID", "0")])),
            Ok((0, "SLURM_PROCID"))
        );
        let e = rank_from_launcher(env(&[("OMPI_COMM_WORLD_RANK", "1"), ("SLURM_PROCID", "2")]))
            .unwrap_err();
        assert!(
            e.contains("OMPI_COMM_WORLD_RANK=1 and SLURM_PROCID=2 disagree"),
            "{e}"
        );
        let e = rank_from_launcher(env(&[("PMI_RANK", "-1")])).unwrap_err();
        assert!(e.contains("PMI_RANK=\"-1\": not a rank"), "{e}");
        let e = rank_from_launcher(env(&[])).unwrap_err();
        assert!(
            e.contains("no --id") && e.contains("OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID"),
            "{e}"
        );
    }

    #[test]
    fn link_delays_parse_with_their_unit() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("100us"), Duration::from_micros(100));
        assert_eq!(ok("100µs"), Duration::from_micros(100));
        assert_eq!(ok("2ms"), Duration::from_millis(2));
        assert_eq!(ok("0.5ms"), Duration::from_micros(500));
        assert_eq!(ok("250000ns"), Duration::from_micros(250));
        assert_eq!(ok("0.1s"), Duration::from_millis(100));
        assert_eq!(ok("0us"), Duration::ZERO);
        for bad in ["abc", "100", "ms", "-1ms", "1.2.3ms", "2 hours", "", "1s"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains("e.g. 100us or 2ms"), "{bad:?}: {e}");
        }
    }
}
