//! Both ends of replication over Musubi VMs: a standby that builds the primary's VM with
//! what its own flags allow and hands it over, state applied, when the primary is lost; and
//! the replicator thread that keeps a running VM on its standby.

use super::destination::{listen, NotReceived, Receiving};
use super::source::HandleVm;
use crate::replication::primary::{replicate, Epochs, PrimaryError};
use crate::replication::standby::{stand_by as wait_as_standby, Standby};
use crate::replication::ReplicationStats;
use crate::{parse_url, read_secret, Options, SecretError, UrlError};
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
        Standby::TakeOver { ram: _, epoch, why } => {
            // The VM holds the RAM (as its owner) from here on.
            let (vm, config) = host.take().ok_or(NotReceived::NotBuilt)?;
            Ok(StandbyEnd::TakeOver(Box::new(TakenOver {
                vm,
                config,
                epoch,
                why,
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
}

/// Checks what `to` names before the VM is built, so a mistake ends the run at once; the
/// returned value starts the thread.
pub struct Replication {
    addr: String,
    opts: Options,
    epochs: Epochs,
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
            stats: Arc::new(ReplicationStats::new(to.url, to.epoch)),
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
                        log(&format!("{e}; the VM goes on alone, unprotected"))
                    }
                }
            })
            .map_err(ReplicateError::Thread)?;
        Ok(Replicator { thread })
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
