//! Builds, starts and waits for this host's node of the VM.

use crate::bus::{self, BusCounters, NodeBus, Replies};
use crate::ipi::{Msi, IPI_PORT};
use crate::moving::{MoveMsg, Route, Routes};
use crate::spec::{ClusterError, ClusterSpec};
use crate::symbols::KernelSymbols;
use dsm::NodeId;
use dsm_host::{
    config_hash_of_parts, CoherenceHandle, DoorLimits, Envelope, Inbound, Inbox, InboxSender,
    Interrupt, LinkParams, Liveness, Memory, NodeEvent, Setup, TcpConfig, TcpTransport,
};
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use vmm::config::{KernelImage, VmConfig};
use vmm::{
    BuildError, DeviceBus, ExternalRam, GuestRamSource, Outcome, RunControl, RunOptions, RunReport,
    RunningVm, Topology, VcpuState, VmBuilder, VmHandle,
};

/// After a node is lost, how long the survivors' teardown may take before the node reports
/// anyway: a vCPU stopped on a page the lost node held can stay stopped in the kernel, and
/// the process that embeds the node ends it by exiting.
const LOSS_TEARDOWN: Duration = Duration::from_secs(2);
/// Once the VM has an outcome, how long its vCPUs may take to stop before guest RAM leaves
/// userfaultfd, so a vCPU waiting on a page no node will send (its holder ended first) is let
/// go. A vCPU that is not waiting stops within microseconds of its kick, and one waiting on a
/// live peer's page gets it within milliseconds; what is left after this waits on a node that
/// is gone. Every run over several nodes used to end a second late when one vCPU did.
const STOP_UNSTICK: Duration = Duration::from_millis(200);
const TEARDOWN: Duration = Duration::from_secs(10);

/// Faults are counted by guest-physical ranges of this size in `--metrics`.
const FAULT_RANGE_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("node {id}: cannot listen on {addr}: {source}")]
    Listen {
        id: u16,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("--kernel {path}: {source}")]
    Kernel {
        path: String,
        source: std::io::Error,
    },
    #[error("node {id}: joining the other nodes: {source}")]
    Join {
        id: u16,
        source: dsm_host::TransportError,
    },
    #[error("node {id}: guest RAM: {source}")]
    Memory {
        id: u16,
        source: dsm_host::MemoryError,
    },
    #[error("node {id}: {source}")]
    Coherence {
        id: u16,
        source: dsm_host::CoherenceError,
    },
    #[error("node {id}: {source}")]
    Build { id: u16, source: BuildError },
    #[error("node {id}: cannot start its {what} thread: {source}")]
    Thread {
        id: u16,
        what: &'static str,
        source: std::io::Error,
    },
}

/// Why a vCPU move asked of this node ([`Mover::move_vcpu`]) did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("node {me} is not the I/O node (node {io_node}): ask that one")]
    NotIoNode { me: u16, io_node: u16 },
    #[error("vCPU {vcpu}: the VM has vCPUs 0 to {last}")]
    NoSuchVcpu { vcpu: u8, last: usize },
    #[error("node {node}: the VM has nodes 0 to {last}")]
    NoSuchNode { node: u16, last: u16 },
    #[error("vCPU {vcpu} already runs on node {node}")]
    AlreadyThere { vcpu: u8, node: u16 },
    #[error(
        "vCPU {vcpu} runs on the I/O node (node {node}), whose in-kernel interrupt controller \
         delivers the devices' interrupts to its own vCPUs only; it stays"
    )]
    OnIoNode { vcpu: u8, node: u16 },
    #[error("the VM has ended")]
    Ended,
    #[error("a move of vCPU {0} is under way")]
    UnderWay(u8),
    #[error("vCPU {vcpu} went to node {node}, not {to}")]
    WentElsewhere { vcpu: u8, node: u16, to: u16 },
    /// The vCPU's node refused; `why` is its reason, as it sent it.
    #[error("node {from} did not move vCPU {vcpu}: {why}")]
    Refused { from: u16, vcpu: u8, why: String },
    #[error("vCPU {vcpu}'s move from node {from} to node {to} was not done within {MOVE_LIMIT:?}")]
    TimedOut { vcpu: u8, from: u16, to: u16 },
}

/// Why the old node keeps a vCPU it was asked to give away; its message goes to the I/O
/// node in the move's `Failed`.
#[derive(Debug, thiserror::Error)]
enum GiveAwayError {
    #[error("the VM is not running yet")]
    NotRunning,
    #[error("vCPU {vcpu} does not run on node {me}, or node {to} cannot take it")]
    NotHere { vcpu: u8, me: u16, to: u16 },
    #[error(transparent)]
    Release(#[from] vmm::ControlError),
    #[error("encoding its state: {0}")]
    Encode(#[source] serde_json::Error),
}

/// Why a vCPU's state that came from another node cannot be run here.
#[derive(Debug, thiserror::Error)]
enum TakeOverError {
    #[error("vCPU {vcpu}'s state from node {from} does not decode: {source}")]
    Decode {
        vcpu: u8,
        from: u16,
        source: serde_json::Error,
    },
    #[error("node {from} sent vCPU {sent}'s state as vCPU {vcpu}'s")]
    WrongVcpu { from: u16, sent: u8, vcpu: u8 },
}

/// Which node this is, of which cluster.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub cluster: ClusterSpec,
    pub id: u16,
    /// How long to wait for every other node to come up and link.
    pub connect_timeout: Duration,
    /// One-way delay on every frame this node sends (zero: none), to emulate a slower
    /// network. Not part of the configuration hash: it changes timing, never what the guest
    /// can observe of memory.
    pub link_delay: Duration,
    /// The most this node's coherence thread polls for a peer's answer, while one of its
    /// faults waits, before it sleeps (zero: it sleeps at once). Timing only, like
    /// `link_delay`: not part of the configuration hash.
    pub fetch_poll: Duration,
    /// How long a page this node was given stays before another node may take it (zero:
    /// it may go at once). Timing only, like `link_delay`.
    pub page_hold: Duration,
}

/// A node with its VM share built and its peers linked, not yet running.
pub struct Node {
    id: u16,
    memory: Arc<Memory>,
    vm: vmm::Vm,
    coherence: Arc<CoherenceHandle>,
    symbols: Arc<KernelSymbols>,
    events: mpsc::Receiver<NodeEvent>,
    ctx: ControlContext,
}

/// How long the I/O node waits for a vCPU move it asked for to be done or refused.
const MOVE_LIMIT: Duration = Duration::from_secs(10);

/// A move the I/O node asked for, waiting for the node the vCPU went to (or the refusal).
type PendingMoves = Arc<Mutex<BTreeMap<u8, mpsc::Sender<Result<u16, String>>>>>;

/// What the node's control thread needs to act on messages from peers.
#[derive(Clone)]
struct ControlContext {
    me: u16,
    nodes: u16,
    io_node: u16,
    routes: Arc<Routes>,
    /// The running VM, once it runs: what a vCPU leaves from and arrives in.
    handle: Arc<OnceLock<VmHandle>>,
    moves: PendingMoves,
    local: Option<Arc<dyn DeviceBus>>,
    msi: vmm::MsiInjector,
    replies: Arc<Replies>,
    control: Arc<RunControl>,
    outbox: InboxSender,
    /// Set when the VM ended because a peer said so, so this node does not echo the stop.
    ended_by_peer: Arc<AtomicBool>,
    /// When a peer was lost, and what that ends the VM with.
    lost: Arc<Mutex<Option<(Instant, Outcome)>>>,
}

/// A node whose vCPUs run.
pub struct RunningNode {
    ctx: ControlContext,
    id: u16,
    memory: Arc<Memory>,
    control: Arc<RunControl>,
    running: RunningVm,
    coherence: Arc<CoherenceHandle>,
    symbols: Arc<KernelSymbols>,
    ended_by_peer: Arc<AtomicBool>,
    lost: Arc<Mutex<Option<(Instant, Outcome)>>>,
    control_thread: Option<std::thread::JoinHandle<()>>,
}

/// What one node reports at the end.
#[derive(Debug)]
pub struct NodeReport {
    pub node: u16,
    pub report: RunReport,
    /// The coherence counters (faults, messages), as in `--metrics`; `None` if the
    /// coherence layer failed.
    pub coherence: Option<musubi_types::Coherence>,
    /// Why the coherence layer failed, if it did.
    pub coherence_error: Option<String>,
    /// Some of this node's threads could not be stopped (they wait on pages a lost node
    /// held); the caller should end the process.
    pub threads_left: bool,
}

impl Node {
    /// Links with every other node of `node.cluster`, puts guest RAM under the coherence
    /// protocol and builds this node's share of the VM. Blocks until all nodes are up.
    pub fn build(
        config: &VmConfig,
        opts: &RunOptions,
        node: &NodeOptions,
    ) -> Result<Node, NodeError> {
        let cluster = &node.cluster;
        let id = node.id;
        cluster.check(config, id)?;
        let me = &cluster.nodes[id as usize];
        let listener = TcpListener::bind(me.address).map_err(|source| NodeError::Listen {
            id,
            addr: me.address,
            source,
        })?;
        let parts = canonical_parts(config, cluster)?;
        let hash =
            config_hash_of_parts(&parts.iter().map(|(_, p)| p.as_slice()).collect::<Vec<_>>());
        let (outbox, inbox) = Inbox::new().map_err(|source| NodeError::Thread {
            id,
            what: "coherence inbox",
            source,
        })?;
        let peers: Vec<u16> = (0..cluster.nodes.len() as u16)
            .filter(|&p| p != id)
            .collect();
        let tcp = TcpConfig {
            link: LinkParams {
                me: NodeId(id),
                secret: cluster.secret.clone(),
                config_hash: hash,
                config_parts: parts.iter().map(|(n, _)| n.to_string()).collect(),
                timeout: node.connect_timeout,
            },
            peers: peers
                .iter()
                .map(|&p| (NodeId(p), cluster.nodes[p as usize].address))
                .collect(),
            connect_timeout: node.connect_timeout,
            liveness: Liveness::default(),
            link_delay: node.link_delay,
            door: DoorLimits::default(),
        };
        let transport = TcpTransport::establish(&tcp, listener, outbox.clone())
            .map_err(|source| NodeError::Join { id, source })?;

        let memory = Arc::new(
            Memory::new(0, config.memory as usize)
                .map_err(|source| NodeError::Memory { id, source })?,
        );
        let (events_tx, events) = mpsc::channel();
        let nodes = cluster.nodes.len() as u16;
        let coherence = Arc::new(
            CoherenceHandle::spawn(Setup {
                memory: Arc::clone(&memory),
                node: dsm::Config {
                    id: NodeId(id),
                    nodes,
                    protocol: cluster.protocol,
                    placement: Arc::new(dsm::Modulo { nodes }),
                    ordering: cluster.ordering,
                    hold: node.page_hold.as_nanos().min(u64::MAX as u128) as u64,
                },
                transport: Box::new(transport),
                inbox: (outbox.clone(), inbox),
                events: Some(events_tx),
                range_bytes: FAULT_RANGE_BYTES,
                poll_window: node.fetch_poll,
            })
            .map_err(|source| NodeError::Coherence { id, source })?,
        );

        let holds_devices = id == cluster.io_node;
        // SAFETY: `Memory` keeps its mapping while it lives, and the VM keeps it as the
        // mapping's owner.
        let ram = unsafe { ExternalRam::new(memory.host_addr(), memory.len(), memory.clone()) };
        let held = Arc::clone(&memory);
        let mut vm = VmBuilder::new(config)
            .options(opts.clone())
            .vcpus(me.vcpus.clone())
            .standby_vcpus((0..config.cpus).filter(|v| !me.vcpus.contains(v)).collect())
            .guest_ram(GuestRamSource::External(ram))
            .devices(holds_devices)
            .topology(Topology {
                nodes,
                node: id,
                ipi_port: IPI_PORT,
            })
            .on_stopped(move || {
                if let Err(e) = held.release() {
                    tracing::warn!(node = id, "letting go of guest RAM's userfaultfd: {e}");
                }
            })
            .build()
            .map_err(|source| NodeError::Build { id, source })?;
        let routes = Arc::new(Routes::new(
            id,
            (0..config.cpus)
                .map(|v| cluster.node_of(v).expect("checked: every vCPU has a node"))
                .collect(),
        ));
        let replies = Arc::new(Replies::new(config.cpus));
        let counters = Arc::new(BusCounters::default());
        let local = holds_devices.then(|| vm.device_bus());
        let bus = NodeBus {
            io_node: cluster.io_node,
            cpus: config.cpus,
            routes: Arc::clone(&routes),
            local: local.clone(),
            outbox: outbox.clone(),
            msi: vm.msi_injector(),
            replies: replies.clone(),
            control: vm.run_control(),
            counters: counters.clone(),
        };
        vm.set_device_bus(Arc::new(bus));
        let weak: Weak<CoherenceHandle> = Arc::downgrade(&coherence);
        let (protocol, ordering) = (cluster.protocol, cluster.ordering);
        let symbols = Arc::new(KernelSymbols::new(config.kernel.clone()));
        let named = Arc::clone(&symbols);
        vm.set_extra_metrics(Arc::new(move |m: &mut musubi_types::Metrics| {
            m.node = Some(musubi_types::NodeMetrics {
                id,
                nodes,
                protocol: protocol.name().to_string(),
                ordering: ordering.name().to_string(),
                forwarded_exits: counters.forwarded.load(Ordering::Relaxed),
                ipis_local: counters.ipis_local.load(Ordering::Relaxed),
                ipis_remote: counters.ipis_remote.load(Ordering::Relaxed),
                coherence: weak.upgrade().map(|c| named.coherence(c.stats())),
            })
        }));
        let ctx = ControlContext {
            me: id,
            nodes,
            io_node: cluster.io_node,
            routes,
            handle: Arc::default(),
            moves: Arc::default(),
            local,
            msi: vm.msi_injector(),
            replies,
            control: vm.run_control(),
            outbox: outbox.clone(),
            ended_by_peer: Arc::default(),
            lost: Arc::default(),
        };
        Ok(Node {
            id,
            memory,
            vm,
            coherence,
            symbols,
            events,
            ctx,
        })
    }

    /// Starts this node's vCPUs and the thread that answers its peers.
    pub fn start(self) -> Result<RunningNode, NodeError> {
        let id = self.id;
        let ctx = self.ctx.clone();
        let events = self.events;
        let control_thread = std::thread::Builder::new()
            .name(format!("node{id}-control"))
            .spawn(move || control_loop(ctx, events))
            .map_err(|source| NodeError::Thread {
                id,
                what: "control",
                source,
            })?;
        let running = self
            .vm
            .start()
            .map_err(|source| NodeError::Build { id, source })?;
        let _ = self.ctx.handle.set(running.handle());
        Ok(RunningNode {
            ctx: self.ctx.clone(),
            id,
            memory: self.memory,
            control: self.ctx.control.clone(),
            running,
            coherence: self.coherence,
            symbols: self.symbols,
            ended_by_peer: self.ctx.ended_by_peer,
            lost: self.ctx.lost,
            control_thread: Some(control_thread),
        })
    }
}

impl RunningNode {
    pub fn handle(&self) -> VmHandle {
        self.running.handle()
    }

    /// A handle for asking this node to move vCPUs (the I/O node serves the API that asks).
    pub fn mover(&self) -> Mover {
        Mover {
            ctx: self.ctx.clone(),
        }
    }

    /// Waits for the VM to end here or anywhere; an end that started here is told to every
    /// other node, with the status this node reports.
    pub fn wait(mut self) -> NodeReport {
        let handle = self.running.handle();
        let started = Instant::now();
        let (tx, rx) = mpsc::channel();
        let running = self.running;
        std::thread::spawn(move || {
            let _ = tx.send(running.wait());
        });
        let mut threads_left = false;
        let mut finished_at: Option<Instant> = None;
        let mut released = false;
        let report = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => break r,
                Err(_) => {
                    if self.control.is_finished() {
                        let at = *finished_at.get_or_insert_with(Instant::now);
                        if !released && at.elapsed() > STOP_UNSTICK {
                            released = true;
                            tracing::info!(node = self.id, "vCPUs still running {:?} after the VM ended; letting go of guest RAM's userfaultfd", at.elapsed());
                            let _ = self.memory.release();
                        }
                    }
                    let lost = self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let stuck = finished_at
                        .filter(|at| at.elapsed() > TEARDOWN)
                        .and_then(|at| self.control.outcome().map(|o| (at, o)));
                    if let Some((at, outcome)) = lost
                        .filter(|(at, _)| at.elapsed() > LOSS_TEARDOWN)
                        .or(stuck)
                    {
                        tracing::warn!(
                            "node {}: threads still stopped {:?} after the VM ended",
                            self.id,
                            at.elapsed()
                        );
                        threads_left = true;
                        break RunReport {
                            outcome,
                            exits: Vec::new(),
                            total_exits: 0,
                            interrupts: 0,
                            serial: Vec::new(),
                            metrics: handle.metrics(),
                            ioeventfd_notifications: 0,
                            to_first_run: None,
                            first_run_monotonic_ns: None,
                            wall: started.elapsed(),
                        };
                    }
                }
            }
        };
        if !self.ended_by_peer.load(Ordering::Acquire) {
            self.coherence.broadcast_stop(report.outcome.exit_code());
        }
        if !threads_left {
            if let Some(t) = self.control_thread.take() {
                let _ = t.join();
            }
        }
        let coherence = match Arc::try_unwrap(self.coherence) {
            Ok(c) if !threads_left => c.join(),
            Ok(c) => Ok(c.stats()),
            Err(shared) => Ok(shared.stats()),
        };
        let (coherence, coherence_error) = match coherence {
            Ok(stats) => (Some(self.symbols.coherence(stats)), None),
            Err(e) => (None, Some(e.to_string())),
        };
        NodeReport {
            node: self.id,
            report,
            coherence,
            coherence_error,
            threads_left,
        }
    }
}

/// Answers peers until the VM ends: serves forwarded accesses (on the I/O node), hands
/// answers to waiting vCPUs, injects interrupts and ends the VM when a peer ends it.
fn control_loop(ctx: ControlContext, events: mpsc::Receiver<NodeEvent>) {
    while !ctx.control.is_finished() {
        let (from, env) = match events.recv_timeout(Duration::from_millis(50)) {
            Ok(NodeEvent::Control(from, env)) => (from, env),
            Ok(NodeEvent::PeerStopped { peer, code }) => {
                ctx.ended_by_peer.store(true, Ordering::Release);
                ctx.control.finish(Outcome::Peer { node: peer.0, code });
                continue;
            }
            Ok(NodeEvent::PeerLost {
                peer,
                pages_owned,
                why,
            }) => {
                // The coherence thread reports the first loss, whether it found it or a
                // peer told of it, so every survivor names the node that went first.
                ctx.ended_by_peer.store(true, Ordering::Release);
                let outcome = Outcome::NodeLost {
                    node: peer.0,
                    pages: pages_owned,
                    why,
                };
                *ctx.lost.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((Instant::now(), outcome.clone()));
                ctx.control.finish(outcome);
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                ctx.control.finish(Outcome::VmmError(format!(
                    "node {}: the coherence thread stopped; guest memory can no longer be kept coherent",
                    ctx.me
                )));
                return;
            }
        };
        match env {
            Envelope::Exit(e) => {
                // Only the node that holds the devices serves accesses, and only for vCPUs
                // the sender runs: anything else is a peer's fault, dropped.
                let sender_runs_it = u8::try_from(e.vcpu)
                    .ok()
                    .and_then(|v| ctx.routes.node_of(v))
                    == Some(from.0);
                if let (Some(local), true) = (&ctx.local, sender_runs_it) {
                    let data = bus::serve(local.as_ref(), &e);
                    ctx.outbox.push(Inbound::Send {
                        to: from,
                        env: Envelope::ExitReply { vcpu: e.vcpu, data },
                    });
                }
            }
            Envelope::ExitReply { vcpu, data }
                if u8::try_from(vcpu).ok().and_then(|v| ctx.routes.node_of(v)) == Some(ctx.me) =>
            {
                ctx.replies.answer(vcpu, data);
            }
            Envelope::Interrupt(Interrupt::Msi { address, data }) => {
                if let Ok(address) = u32::try_from(address) {
                    let m = Msi {
                        vcpu: crate::ipi::target_of(address),
                        address,
                        data,
                    };
                    deliver(&ctx, m);
                }
            }
            Envelope::Move(bytes) => match MoveMsg::decode(&bytes) {
                Ok(m) => on_move(&ctx, from, m),
                Err(e) => tracing::warn!("node {}: from {from}: {e}", ctx.me),
            },
            _ => {}
        }
    }
}

/// An interrupt for `m.vcpu`: injected here, held while the vCPU is on its way here, or
/// sent on to the node that runs it now.
fn deliver(ctx: &ControlContext, m: Msi) {
    if let Route::To(node) = ctx
        .routes
        .route(m, |m| bus::inject(&ctx.msi, m.address, m.data))
    {
        send_to(ctx, node, bus::msi_envelope(&m));
    }
}

fn send_to(ctx: &ControlContext, node: u16, env: Envelope) {
    ctx.outbox.push(Inbound::Send {
        to: NodeId(node),
        env,
    });
}

fn send_move(ctx: &ControlContext, node: u16, m: &MoveMsg) {
    send_to(ctx, node, Envelope::Move(m.encode()));
}

/// Tells the I/O node's waiting request how the move of `vcpu` ended.
fn settle(ctx: &ControlContext, vcpu: u8, result: Result<u16, String>) {
    let waiting = ctx
        .moves
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&vcpu);
    if let Some(tx) = waiting {
        let _ = tx.send(result);
    }
}

/// One step of a vCPU's move (see [`crate::moving`]).
fn on_move(ctx: &ControlContext, from: NodeId, m: MoveMsg) {
    match m {
        MoveMsg::Move { vcpu, to } if from.0 == ctx.io_node => {
            if let Err(why) = give_away(ctx, vcpu, to) {
                tracing::warn!("node {}: vCPU {vcpu} stays: {why}", ctx.me);
                let failed = MoveMsg::Failed {
                    vcpu,
                    node: ctx.me,
                    why: why.to_string(),
                };
                send_move(ctx, ctx.io_node, &failed);
            }
        }
        MoveMsg::Coming { vcpu } => ctx.routes.coming(vcpu),
        MoveMsg::State { vcpu, last, bytes } => match ctx.routes.piece(vcpu, &bytes, last) {
            Ok(None) => {}
            Ok(Some(state)) => take_over(ctx, from.0, vcpu, &state),
            Err(why) => tracing::warn!("node {}: from {from}: {why}", ctx.me),
        },
        MoveMsg::Moved { vcpu, node } => {
            if node != ctx.me {
                ctx.routes.set(vcpu, node);
            }
            settle(ctx, vcpu, Ok(node));
        }
        MoveMsg::Failed { vcpu, node, why } => {
            if node != ctx.me && ctx.routes.node_of(vcpu) == Some(ctx.me) {
                for m in ctx.routes.abandon(vcpu, node) {
                    send_to(ctx, node, bus::msi_envelope(&m));
                }
            }
            settle(ctx, vcpu, Err(why));
        }
        MoveMsg::Move { .. } => {
            tracing::warn!("node {}: a move asked by {from}, not the I/O node", ctx.me);
        }
    }
}

/// The old node's part: the vCPU's interrupts go to `to` from now on, and its state is read
/// and sent there. On a failure the vCPU runs on here.
fn give_away(ctx: &ControlContext, vcpu: u8, to: u16) -> Result<(), GiveAwayError> {
    let me = ctx.me;
    let handle = ctx.handle.get().ok_or(GiveAwayError::NotRunning)?;
    if ctx.routes.node_of(vcpu) != Some(me) || to == me || to >= ctx.nodes {
        return Err(GiveAwayError::NotHere { vcpu, me, to });
    }
    send_move(ctx, to, &MoveMsg::Coming { vcpu });
    ctx.routes.set(vcpu, to);
    let state = handle
        .release_vcpu(vcpu)
        .map_err(GiveAwayError::from)
        .and_then(|s| serde_json::to_vec(&s).map_err(GiveAwayError::Encode));
    match state {
        Ok(bytes) => {
            for piece in MoveMsg::pieces(vcpu, &bytes) {
                send_move(ctx, to, &piece);
            }
            tracing::info!(
                "node {me}: vCPU {vcpu} left for node {to} ({} bytes of state)",
                bytes.len()
            );
            Ok(())
        }
        Err(why) => {
            ctx.routes.set(vcpu, me);
            let failed = MoveMsg::Failed {
                vcpu,
                node: me,
                why: why.to_string(),
            };
            send_move(ctx, to, &failed);
            Err(why)
        }
    }
}

/// The new node's part: every node learns where the vCPU runs before it does, then it runs
/// here from the state that came and gets the interrupts held for it.
fn take_over(ctx: &ControlContext, from: u16, vcpu: u8, bytes: &[u8]) {
    let me = ctx.me;
    let state: Result<VcpuState, TakeOverError> = serde_json::from_slice(bytes)
        .map_err(|source| TakeOverError::Decode { vcpu, from, source })
        .and_then(|s: VcpuState| {
            if s.id == vcpu {
                Ok(s)
            } else {
                Err(TakeOverError::WrongVcpu {
                    from,
                    sent: s.id,
                    vcpu,
                })
            }
        });
    let Some(handle) = ctx.handle.get() else {
        return;
    };
    let state = match state {
        Ok(s) => s,
        Err(why) => {
            // The state is gone with the message: the VM cannot go on without that vCPU.
            ctx.control
                .finish(Outcome::VmmError(format!("node {me}: {why}")));
            return;
        }
    };
    for n in (0..ctx.nodes).filter(|&n| n != me) {
        send_move(ctx, n, &MoveMsg::Moved { vcpu, node: me });
    }
    if let Err(e) = handle.adopt_vcpu(state) {
        ctx.control.finish(Outcome::VmmError(format!(
            "node {me}: vCPU {vcpu} came from node {from} and cannot run here: {e}"
        )));
        return;
    }
    for m in ctx.routes.arrived(vcpu) {
        deliver(ctx, m);
    }
    tracing::info!("node {me}: vCPU {vcpu} runs here now, come from node {from}");
    settle(ctx, vcpu, Ok(me));
}

/// Asks for vCPU moves: the I/O node's, for its control API.
#[derive(Clone)]
pub struct Mover {
    ctx: ControlContext,
}

impl Mover {
    /// Moves vCPU `vcpu` to node `to` while the VM runs, and returns once it runs there.
    /// The vCPU's pages follow it as it touches them. Refused: a vCPU or node that does not
    /// exist, a vCPU already there, one on the I/O node (whose in-kernel interrupt
    /// controller delivers the devices' interrupts to its own vCPUs only), and any move
    /// asked of a node other than the I/O node.
    pub fn move_vcpu(&self, vcpu: u8, to: u16) -> Result<(), MoveError> {
        let ctx = &self.ctx;
        if ctx.me != ctx.io_node {
            return Err(MoveError::NotIoNode {
                me: ctx.me,
                io_node: ctx.io_node,
            });
        }
        let cpus = ctx.routes.all().len();
        let Some(from) = ctx.routes.node_of(vcpu) else {
            return Err(MoveError::NoSuchVcpu {
                vcpu,
                last: cpus - 1,
            });
        };
        if to >= ctx.nodes {
            return Err(MoveError::NoSuchNode {
                node: to,
                last: ctx.nodes - 1,
            });
        }
        if from == to {
            return Err(MoveError::AlreadyThere { vcpu, node: to });
        }
        if from == ctx.io_node {
            return Err(MoveError::OnIoNode { vcpu, node: from });
        }
        if ctx.control.is_finished() {
            return Err(MoveError::Ended);
        }
        let (tx, rx) = mpsc::channel();
        {
            let mut moves = ctx.moves.lock().unwrap_or_else(|e| e.into_inner());
            if moves.contains_key(&vcpu) {
                return Err(MoveError::UnderWay(vcpu));
            }
            moves.insert(vcpu, tx);
        }
        send_move(ctx, from, &MoveMsg::Move { vcpu, to });
        let answer = rx.recv_timeout(MOVE_LIMIT);
        ctx.moves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&vcpu);
        match answer {
            Ok(Ok(node)) if node == to => Ok(()),
            Ok(Ok(node)) => Err(MoveError::WentElsewhere { vcpu, node, to }),
            Ok(Err(why)) => Err(MoveError::Refused { from, vcpu, why }),
            Err(_) => Err(MoveError::TimedOut { vcpu, from, to }),
        }
    }

    /// Which node runs each vCPU, by vCPU id, as this node knows it.
    pub fn vcpu_nodes(&self) -> Vec<u16> {
        self.ctx.routes.all()
    }
}

/// What every node's configuration hash covers, part by part so a refusal can name what
/// differs: the VM as resolved (the kernel's contents, not its path, so hosts may keep it in
/// different places) and the cluster.
fn canonical_parts(
    config: &VmConfig,
    cluster: &ClusterSpec,
) -> Result<Vec<(&'static str, Vec<u8>)>, NodeError> {
    let kernel = match &config.kernel {
        KernelImage::File(p) => std::fs::read(p).map_err(|source| NodeError::Kernel {
            path: p.display().to_string(),
            source,
        })?,
        KernelImage::Bytes { data, .. } => data.to_vec(),
    };
    let disks: Vec<String> = config
        .disks
        .iter()
        .map(|d| format!("{}:{}:{:?}", d.path.display(), d.readonly, d.cache))
        .collect();
    let text = |s: String| s.into_bytes();
    Ok(vec![
        ("kernel", kernel),
        ("cmdline", text(config.cmdline.clone())),
        ("cpus", text(config.cpus.to_string())),
        ("memory", text(config.memory.to_string())),
        ("disks", text(format!("{disks:?}"))),
        ("exits", text(config.exits.to_string())),
        // Each is a device in the layout every node builds, though only the I/O node makes
        // it; the guest reads the vsock's cid, the socket is the I/O node's business.
        ("rng", text(format!("{:?}", config.rng))),
        (
            "vsock cid",
            text(format!("{:?}", config.vsock.as_ref().map(|v| v.cid))),
        ),
        (
            "cluster (nodes, vCPUs, protocol, ordering)",
            text(cluster.canonical()),
        ),
        ("initrd", text(format!("{:?}", config.initrd))),
    ])
}
