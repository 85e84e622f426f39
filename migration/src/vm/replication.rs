//! Both ends of replication over Musubi VMs: a standby that builds the primary's VM with
//! what its own flags allow and hands it over, state applied, when the primary is lost; and
//! the replicator thread that keeps a running VM on its standby.

use super::destination::{listen, NotReceived, Receiving};
use super::source::HandleVm;
use crate::replication::primary::{replicate, Epochs, PrimaryError};
use crate::replication::standby::{stand_by as wait_as_standby, Standby};
use crate::replication::ReplicationStats;
use crate::{parse_url, read_secret, Options, SecretError, UrlError};
use musubi_types::ReplicationPolicy;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How a standby's wait ended.
pub enum StandbyEnd {
    /// The primary was lost.
    TakeOver(Box<TakenOver>),
    /// The primary's VM ended: nothing to take over.
    PrimaryEnded { epochs: u64 },
}

/// The VM a standby takes over: built, holding the last whole epoch, not started.
pub struct TakenOver {
    pub vm: vmm::Vm,
    pub config: vmm::config::VmConfig,
    /// The epoch it holds.
    pub epoch: u64,
    /// Why the primary counts as lost.
    pub why: String,
    /// Frames of that epoch the primary had not said it wrote, which the VM has sent
    /// (after its gratuitous ARP, before it runs).
    pub replayed: usize,
}

/// Waits as the standby of a primary (`r.url`), until the primary is lost or its VM ends.
/// `heartbeat` is the longest silence of the primary before it counts as lost; `stop` and
/// `log` as for [`super::receive`].
pub fn stand_by(
    r: Receiving<'_>,
    heartbeat: Duration,
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<StandbyEnd, NotReceived> {
    let (listener, secret, mut host) = listen(r, "primary to stand by for", log)?;
    let opts = Options::new(secret);
    match wait_as_standby(&listener, &opts, heartbeat, &mut host, stop, log)? {
        Standby::TakeOver {
            ram: _,
            epoch,
            why,
            unreleased,
        } => {
            // The VM holds the RAM (as its owner) from here on.
            let (vm, config) = host.take().ok_or(NotReceived::NotBuilt)?;
            // The state applied has sent these; the primary may have died before it did.
            let replayed = vm.send_frames(unreleased);
            Ok(StandbyEnd::TakeOver(Box::new(TakenOver {
                vm,
                config,
                epoch,
                why,
                replayed,
            })))
        }
        Standby::PrimaryEnded { epochs } => Ok(StandbyEnd::PrimaryEnded { epochs }),
    }
}

/// Why replication cannot start at all.
#[derive(Debug, thiserror::Error)]
pub enum ReplicateError {
    #[error("--replicate-to: {0}")]
    Url(#[from] UrlError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("--replicate-to: cannot start the replication thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Where to replicate and how often.
pub struct ReplicateTo<'a> {
    /// `tcp:HOST:PORT`.
    pub url: &'a str,
    pub secret_file: &'a Path,
    pub epoch: Duration,
    /// What the VM does if the standby is lost.
    pub policy: ReplicationPolicy,
}

/// Checks what `to` names before the VM is built, so a mistake ends the run at once; the
/// returned value starts the thread.
pub struct Replication {
    addr: String,
    opts: Options,
    epochs: Epochs,
    policy: ReplicationPolicy,
    stats: Arc<ReplicationStats>,
}

impl Replication {
    pub fn new(to: &ReplicateTo<'_>) -> Result<Replication, ReplicateError> {
        let addr = parse_url(to.url)?.to_string();
        let opts = Options::new(read_secret(to.secret_file)?);
        let epochs = Epochs {
            every: to.epoch,
            ..Epochs::default()
        };
        Ok(Replication {
            addr,
            opts,
            epochs,
            policy: to.policy,
            stats: Arc::new(ReplicationStats::new(to.url, to.epoch).with_policy(to.policy)),
        })
    }

    /// What the replication counts, for the VM's metrics.
    pub fn stats(&self) -> Arc<ReplicationStats> {
        self.stats.clone()
    }

    /// Replicates `vm` from a thread of its own (started before the system-call filters go
    /// on: it connects) until the VM ends or the standby is lost; `log` hears the loss.
    pub fn start(
        self,
        vm: vmm::VmHandle,
        log: Box<dyn Fn(&str) + Send>,
    ) -> Result<Replicator, ReplicateError> {
        let thread = std::thread::Builder::new()
            .name("replicator".into())
            .spawn(move || {
                let r = replicate(
                    &HandleVm(&vm),
                    &self.addr,
                    &self.opts,
                    &self.epochs,
                    &self.stats,
                );
                match r {
                    Ok(()) => {}
                    Err(e @ PrimaryError::NotStarted { .. }) => {
                        log(&format!("{e}; the VM runs alone, unprotected"))
                    }
                    Err(e @ PrimaryError::Lost { .. }) => {
                        lost(&vm, self.policy, &self.stats, &e, &*log)
                    }
                }
            })
            .map_err(ReplicateError::Thread)?;
        Ok(Replicator { thread })
    }
}

/// How often a VM paused for its lost standby is looked at for its operator's resume.
const RESUME_POLL: Duration = Duration::from_millis(5);

/// What the VM does once its standby is lost: goes on alone, or (`stop`) pauses and waits
/// for its operator, its output still held (the standby did not acknowledge what produced
/// it) until the operator resumes it; says which through `log`.
fn lost(
    vm: &vmm::VmHandle,
    policy: ReplicationPolicy,
    stats: &ReplicationStats,
    e: &PrimaryError,
    log: &dyn Fn(&str),
) {
    match policy {
        ReplicationPolicy::GoOn => log(&format!("{e}; the VM goes on alone, unprotected")),
        ReplicationPolicy::Stop => match vm.pause() {
            Ok(()) | Err(vmm::ControlError::AlreadyPaused) => {
                stats.stopped();
                log(&format!(
                    "{e}; --replicate-policy stop: the VM is paused and waits; resume it \
                     through the API (vm.resume) to run it on alone, unprotected"
                ));
                // Frames the guest sends once resumed queue behind the held ones.
                while vm.is_paused() && !vm.has_ended() {
                    std::thread::sleep(RESUME_POLL);
                }
                vm.open_output();
            }
            // The VM ended meanwhile: nothing to stop.
            Err(why) => {
                vm.open_output();
                log(&format!(
                    "{e}; --replicate-policy stop: the VM could not be paused ({why})"
                ))
            }
        },
    }
}

/// The replication thread of a running VM.
pub struct Replicator {
    thread: std::thread::JoinHandle<()>,
}

impl Replicator {
    /// Once the VM has ended: waits until the standby has been told (so it does not take
    /// over a VM that ended) or was lost.
    pub fn finish(self) {
        let _ = self.thread.join();
    }
}

/// Where a VM's replication stands, once it has started (by `--replicate-to` or through the
/// API): what `vm.info` and the metrics read.
pub type ReplicationSlot = Arc<std::sync::OnceLock<Arc<ReplicationStats>>>;

/// A replication asked for through the API (`vm.replicate`).
#[derive(Clone, Debug)]
pub struct ReplicateRequest {
    /// `tcp:HOST:PORT`.
    pub url: String,
    pub secret_file: std::path::PathBuf,
    pub epoch: Duration,
    pub policy: ReplicationPolicy,
}

/// Why `vm.replicate` did not start a replication.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the VM is already replicated to {0}; it has one standby at a time")]
    Already(String),
    #[error(transparent)]
    Start(#[from] ReplicateError),
    #[error("{0}")]
    NotStarted(String),
    #[error("the replication thread has stopped")]
    Stopped,
}

struct Asked {
    req: ReplicateRequest,
    reply: std::sync::mpsc::Sender<Result<(), RequestError>>,
}

/// Starts replication when the API asks, from a thread of its own started before the
/// system-call filters go on: the API thread may neither connect nor start threads.
pub struct OnRequest {
    requests: std::sync::Mutex<Option<std::sync::mpsc::Sender<Asked>>>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Longest wait for a standby to take the VM before `vm.replicate` answers.
const START_LIMIT: Duration = Duration::from_secs(60);

impl OnRequest {
    /// Serves requests for `vm`; the replication started records itself in `slot` (taken
    /// already by `--replicate-to`'s, if any). `log` hears the loss of a standby.
    pub fn start(
        vm: vmm::VmHandle,
        slot: ReplicationSlot,
        log: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> std::io::Result<OnRequest> {
        let (tx, rx) = std::sync::mpsc::channel::<Asked>();
        let thread = std::thread::Builder::new()
            .name("replicate-on-request".into())
            .spawn(move || {
                let mut running = None;
                for asked in rx {
                    let (r, started) = start_asked(&vm, &slot, &asked.req, log.clone());
                    running = running.or(started);
                    let _ = asked.reply.send(r);
                }
                // The API has gone: the VM has ended, and the standby is told so.
                if let Some(r) = running {
                    Replicator::finish(r);
                }
            })?;
        Ok(OnRequest {
            requests: std::sync::Mutex::new(Some(tx)),
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Starts replicating as `req` asks: `Ok` once the standby has taken the VM.
    pub fn replicate(&self, req: &ReplicateRequest) -> Result<(), RequestError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let asked = Asked {
            req: req.clone(),
            reply: tx,
        };
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .ok_or(RequestError::Stopped)?
            .send(asked)
            .map_err(|_| RequestError::Stopped)?;
        rx.recv().map_err(|_| RequestError::Stopped)?
    }

    /// Once the VM has ended: takes no more requests, and waits until a replication the
    /// API started has told its standby (or lost it).
    pub fn finish(&self) {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Starts one asked replication, unless one runs; waits until the standby has taken the VM
/// or refused it.
fn start_asked(
    vm: &vmm::VmHandle,
    slot: &ReplicationSlot,
    req: &ReplicateRequest,
    log: Arc<dyn Fn(&str) + Send + Sync>,
) -> (Result<(), RequestError>, Option<Replicator>) {
    use musubi_types::ReplicationState as S;
    if let Some(s) = slot.get() {
        return (Err(RequestError::Already(s.to_metrics().to)), None);
    }
    let to = ReplicateTo {
        url: &req.url,
        secret_file: &req.secret_file,
        epoch: req.epoch,
        policy: req.policy,
    };
    let replication = match Replication::new(&to) {
        Ok(r) => r,
        Err(e) => return (Err(e.into()), None),
    };
    let stats = replication.stats();
    if slot.set(stats.clone()).is_err() {
        let to = slot.get().map(|s| s.to_metrics().to).unwrap_or_default();
        return (Err(RequestError::Already(to)), None);
    }
    let started = match replication.start(vm.clone(), Box::new(move |m| log(m))) {
        Ok(r) => r,
        Err(e) => return (Err(e.into()), None),
    };
    let deadline = std::time::Instant::now() + START_LIMIT;
    loop {
        match stats.state() {
            S::Connecting if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            S::Connecting => {
                return (
                    Err(RequestError::NotStarted(format!(
                        "replication to {}: the standby has not taken the VM after {} s; \
                         still trying (see vm.info)",
                        req.url,
                        START_LIMIT.as_secs()
                    ))),
                    Some(started),
                )
            }
            S::Lost | S::Stopped => {
                let why = stats.to_metrics().lost.unwrap_or_default();
                return (Err(RequestError::NotStarted(why)), Some(started));
            }
            _ => return (Ok(()), Some(started)),
        }
    }
}
