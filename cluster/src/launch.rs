//! Runs one VM as several node processes on this host and supervises them until it ends.

use crate::netns::{self, Netns};
use crate::{fresh_secret, write_cluster, ClusterSpec, Timing};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vmm::config::VmConfig;

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

/// One VM over `nodes` processes of `program` on this host, vCPUs dealt round-robin and
/// node 0 holding the devices.
pub struct Launch<'a> {
    pub nodes: u16,
    /// Checked against the cluster before any node starts, so what no node could run is
    /// refused once rather than by every node.
    pub config: &'a VmConfig,
    pub protocol: dsm::Protocol,
    pub ordering: dsm::Ordering,
    /// Each node in a network namespace of its own, so node traffic crosses a real network
    /// stack; needs root and iproute2's `ip`. Otherwise the nodes meet on loopback.
    pub netns: bool,
    /// Left out of the cluster file when not given, so the nodes' own defaults apply (see
    /// [`crate::NodeOptions`]).
    pub timing: Timing,
    /// The program every node process runs.
    pub program: &'a Path,
    /// Node `files.id`'s command line: the program must run that node of the cluster file
    /// `files.cluster` and write its report (and metrics, when asked for) where `files`
    /// says, since the launcher reads them to judge a lost node and to merge them.
    pub node_args: &'a dyn Fn(&NodeFiles) -> Vec<OsString>,
    /// Whether the nodes are asked for metrics (and [`Launched::metrics`] is filled).
    pub metrics: bool,
}

/// The files one node process is given.
pub struct NodeFiles<'a> {
    pub id: u16,
    pub cluster: &'a Path,
    /// The node writes its run report here, as JSON with the outcome under `outcome`.
    pub report: &'a Path,
    /// The node writes its metrics here, as JSON; `None` unless metrics were asked for.
    pub metrics: Option<&'a Path>,
}

/// How a launched VM ended.
#[derive(Debug)]
pub struct Launched {
    /// Node 0's exit status if it exited, else the first non-zero one, else 1: the I/O node
    /// saw the guest's own end, the others at most a loss.
    pub exit_code: i32,
    /// Node 0's report with `exit_code` set to [`Launched::exit_code`] and every node's
    /// report (`null` for one that wrote none) under `nodes`.
    pub report: serde_json::Value,
    /// `{"nodes": [...]}`, every node's metrics; `None` unless metrics were asked for.
    pub metrics: Option<serde_json::Value>,
}

/// Why no VM ran. Whatever was set up has been removed again by the time this is returned.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The VM cannot be spread over that many nodes; nothing was set up.
    #[error("{nodes} nodes: {why}")]
    Refused { nodes: u16, why: Unrunnable },
    /// Setting up the nodes' files or network, or starting a node, failed.
    #[error("{source}")]
    Failed {
        source: SetupError,
        /// The stop signal that ended the set-up, if one did.
        signal: Option<i32>,
    },
}

/// Why no node could run the VM, whatever the nodes' addresses.
#[derive(Debug, thiserror::Error)]
pub enum Unrunnable {
    #[error("a VM needs at least one node")]
    NoNodes,
    #[error(transparent)]
    Spec(#[from] crate::ClusterError),
}

/// What failed while the nodes' files and network were set up or the nodes started.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot create a directory for the cluster file: {0}")]
    Dir(#[source] std::io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    #[error("cannot find a free loopback port: {0}")]
    Ports(#[source] std::io::Error),
    #[error(transparent)]
    Secret(#[from] crate::SecretError),
    #[error(transparent)]
    Write(#[from] crate::WriteError),
    #[error("cannot start node {node}: {source}")]
    Start { node: u16, source: std::io::Error },
}

impl LaunchError {
    /// The exit status for this error: 128 plus the signal's number when a signal stopped
    /// the set-up, as a shell reports a process a signal ended; 1 otherwise.
    pub fn exit_status(&self) -> u8 {
        match self {
            LaunchError::Failed {
                signal: Some(s), ..
            } => 128 + *s as u8,
            _ => 1,
        }
    }
}

fn failed(source: impl Into<SetupError>) -> LaunchError {
    LaunchError::Failed {
        source: source.into(),
        signal: None,
    }
}

impl Launch<'_> {
    /// Starts the nodes and waits for all of them to end; stop signals (SIGTERM, SIGINT,
    /// SIGHUP) are passed on to them, and a node the others declare lost is killed.
    pub fn run(&self) -> Result<Launched, LaunchError> {
        let n = self.nodes;
        if n == 0 {
            return Err(LaunchError::Refused {
                nodes: n,
                why: Unrunnable::NoNodes,
            });
        }
        // Refuse what no node could run before starting any.
        let placeholder: Vec<SocketAddr> = (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 1 + i)))
            .collect();
        let check = ClusterSpec::round_robin(
            &placeholder,
            self.config.cpus,
            self.protocol,
            self.ordering,
            vec![0; 32],
        );
        if let Err(e) = check.check(self.config, 0) {
            return Err(LaunchError::Refused {
                nodes: n,
                why: e.into(),
            });
        }
        let dir = tempfile::Builder::new()
            .prefix("musubi-nodes-")
            .tempdir()
            .map_err(|e| failed(SetupError::Dir(e)))?;
        // Before anything is made that must be removed again: a stop signal from here on is
        // seen, not fatal, so every exit path runs the clean-up.
        let mut signals =
            Signals::new([SIGTERM, SIGINT, SIGHUP]).map_err(|e| failed(SetupError::Signals(e)))?;
        let mut stopped_by = None;
        let net = if self.netns {
            let mut interrupted = || {
                let s = signals.pending().next();
                stopped_by = stopped_by.or(s);
                s
            };
            match Netns::create(n, &mut interrupted) {
                Ok(net) => Some(net),
                Err(e) => {
                    return Err(LaunchError::Failed {
                        source: e.into(),
                        signal: stopped_by,
                    })
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
        let cluster_path = addrs
            .and_then(|addrs| {
                let secret = fresh_secret()?;
                let spec = ClusterSpec::round_robin(
                    &addrs,
                    self.config.cpus,
                    self.protocol,
                    self.ordering,
                    secret,
                );
                Ok(write_cluster(dir.path(), &spec, &self.timing)?)
            })
            .map_err(failed)?;
        let report_of = |k: u16| dir.path().join(format!("node{k}.report.json"));
        let metrics_of = |k: u16| dir.path().join(format!("node{k}.metrics.json"));
        let mut children: Vec<(u16, Child)> = Vec::new();
        for k in 0..n {
            let (report, metrics) = (report_of(k), metrics_of(k));
            let files = NodeFiles {
                id: k,
                cluster: &cluster_path,
                report: &report,
                metrics: self.metrics.then_some(metrics.as_path()),
            };
            let mut cmd = Command::new(self.program);
            cmd.args((self.node_args)(&files));
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
                    return Err(failed(SetupError::Start { node: k, source: e }));
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
        let nodes: Vec<serde_json::Value> = (0..n).map(|k| read(report_of(k))).collect();
        let mut report = nodes[0].clone();
        if !report.is_object() {
            report = serde_json::json!({});
        }
        report["exit_code"] = serde_json::json!(code);
        report["nodes"] = serde_json::Value::Array(nodes);
        let metrics = self.metrics.then(|| {
            let nodes: Vec<serde_json::Value> = (0..n).map(|k| read(metrics_of(k))).collect();
            serde_json::json!({ "nodes": nodes })
        });
        Ok(Launched {
            exit_code: code,
            report,
            metrics,
        })
    }
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
                    crate::say!(
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
                crate::say!(
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
fn free_loopback_ports(n: u16) -> Result<Vec<SocketAddr>, SetupError> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(SetupError::Ports)?;
    listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()
        .map_err(SetupError::Ports)
}
