//! The command line of a VM over several nodes: `musubi node` and `musubi run --nodes N`,
//! turned into the cluster crate's calls, with their errors printed.

use crate::cli::{FileConfig, RunFlags, VmArgs};
use crate::run::{stop_signals, write_json, SignalWatch};
use clap::Args;
use musubi_cluster::{
    parse_duration, rank_from_launcher, ClusterFile, Launch, LaunchError, Node, NodeFiles,
    NodeOptions, Timing,
};
use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// How long a node waits for every other node to come up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

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
    /// With --nodes: how long a page a node was just given stays there before another node
    /// may take it or its write access away (the cluster file's "page_hold"; default 500us,
    /// 0 to let it go at once). Nodes writing one page then take turns at this pace instead
    /// of the network's, and each gets work done on it in its turn.
    #[arg(long, value_name = "DURATION", requires = "nodes", value_parser = parse_duration)]
    pub page_hold: Option<Duration>,
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
    let opts = run.run_options();
    let (id, from) = match id {
        Some(id) => (id, None),
        None => match rank_from_launcher(|k| std::env::var(k).ok()) {
            Ok((id, name)) => (id, Some(name)),
            Err(e) => {
                musubi_cluster::say!("musubi: node: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let fail = |msg: String| {
        musubi_cluster::say!("musubi: node {id}: {msg}");
        ExitCode::from(1)
    };
    let file = match ClusterFile::<FileConfig>::read(cluster_path) {
        Ok(f) => f,
        Err(e) => return fail(format!("--cluster {e}")),
    };
    let holds_devices = id == file.spec.io_node;
    let config = match vm.to_config_for(file.vm, holds_devices) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let (cluster, link_delay, fetch_poll, page_hold) =
        (file.spec, file.link_delay, file.fetch_poll, file.page_hold);
    if let Some(name) = from {
        let n = cluster.nodes.len();
        if usize::from(id) >= n {
            return fail(format!(
                "{name}={id} names no node: --cluster {} has {n} (ids 0 to {})",
                cluster_path.display(),
                n.saturating_sub(1)
            ));
        }
        musubi_cluster::say!("musubi: node {id}: id {id} from the launcher's {name}");
    }
    let signals = match stop_signals() {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let node_opts = NodeOptions {
        cluster,
        id,
        connect_timeout: CONNECT_TIMEOUT,
        link_delay,
        fetch_poll,
        page_hold,
    };
    let built = match Node::build(&config, &opts, &node_opts) {
        Ok(n) => n,
        Err(e) => {
            musubi_cluster::say!("musubi: {e}");
            return ExitCode::from(1);
        }
    };
    let running = match built.start() {
        Ok(r) => r,
        Err(e) => {
            musubi_cluster::say!("musubi: {e}");
            return ExitCode::from(1);
        }
    };
    let api = api_socket.and_then(|path| {
        let target = std::sync::Arc::new(crate::node_api::NodeApi {
            vm: running.handle(),
            mover: running.mover(),
            described: crate::api_target::Described::of(&running.handle()),
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
        let mut r = report.to_report();
        r.node = Some(id);
        r.coherence = Some(done.coherence.clone());
        write_json(p, "--report", &r);
    }
    match &report.outcome {
        vmm::Outcome::GuestCrash(m) => musubi_cluster::say!("musubi: node {id}: guest crashed: {m}"),
        vmm::Outcome::VmmError(m) => musubi_cluster::say!("musubi: node {id}: {m}"),
        vmm::Outcome::Signal(s) => musubi_cluster::say!("musubi: node {id}: stopped by signal {s}"),
        vmm::Outcome::NodeLost { node, pages, why } => musubi_cluster::say!(
            "musubi: node {id}: lost node {node} ({why}); it owned at least {pages} pages of guest memory (those this node's directory manages), so the VM cannot go on"
        ),
        _ => {}
    }
    if let Some(e) = &done.coherence_error {
        if !matches!(report.outcome, vmm::Outcome::NodeLost { .. }) {
            musubi_cluster::say!("musubi: node {id}: coherence: {e}");
        }
    }
    ExitCode::from(report.outcome.exit_code() as u8)
}

/// What `run --nodes` was given, its protocol and ordering already parsed.
pub struct LaunchArgs<'a> {
    pub nodes: u16,
    pub protocol: dsm::Protocol,
    pub ordering: dsm::Ordering,
    pub vm: &'a VmArgs,
    pub run: &'a RunFlags,
    pub net: &'a NetFlags,
}

/// `musubi run --nodes N`: the VM over N node processes on this host, each this program's
/// `musubi node` with the same VM flags.
pub fn launch(args: LaunchArgs) -> ExitCode {
    let fail = |msg: String| {
        musubi_cluster::say!("musubi: {msg}");
        ExitCode::from(1)
    };
    let config = match args.vm.to_config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(format!("cannot find this program to start the nodes: {e}")),
    };
    let node_args = |f: &NodeFiles| -> Vec<OsString> {
        let mut a: Vec<OsString> = vec![
            "node".into(),
            "--cluster".into(),
            f.cluster.into(),
            "--id".into(),
            f.id.to_string().into(),
        ];
        a.extend(args.vm.to_args().into_iter().map(OsString::from));
        a.extend([
            "--seccomp".into(),
            args.run.seccomp.to_string().into(),
            "--report".into(),
            f.report.into(),
        ]);
        if let Some(m) = f.metrics {
            a.extend(["--metrics".into(), m.into()]);
        }
        if let Some(t) = args.run.timeout {
            a.extend(["--timeout".into(), t.as_secs_f64().to_string().into()]);
        }
        a
    };
    let launched = Launch {
        nodes: args.nodes,
        config: &config,
        protocol: args.protocol,
        ordering: args.ordering,
        netns: args.net.netns,
        timing: Timing {
            link_delay: args.net.link_delay,
            fetch_poll: args.net.fetch_poll,
            page_hold: args.net.page_hold,
        },
        program: &exe,
        node_args: &node_args,
        metrics: args.run.metrics.is_some(),
    }
    .run();
    let done = match launched {
        Ok(d) => d,
        Err(LaunchError::Refused { nodes, why }) => return fail(format!("--nodes {nodes}: {why}")),
        Err(e) => {
            musubi_cluster::say!("musubi: {e}");
            return ExitCode::from(e.exit_status());
        }
    };
    if let Some(p) = &args.run.report {
        write_json(p, "--report", &done.report);
    }
    if let (Some(p), Some(m)) = (&args.run.metrics, &done.metrics) {
        write_json(p, "--metrics", m);
    }
    ExitCode::from(done.exit_code as u8)
}
