//! The destination's side over a Musubi VM: checking the configuration that arrives against
//! what this process's own flags allow, building the VM on guest RAM the source fills, and
//! putting the state into it.

use crate::destination::{self, Host, PostCopyRam, ReceiveError};
use crate::replication::standby::ReplicaRam;
use crate::{parse_url, read_secret, Options, SecretError, UrlError, VmFault};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vmm::snapshot::GivenDevices;

/// A VM received from a migration's source, built and not started; its pages are on their
/// way into `ram`.
pub struct Received {
    pub vm: vmm::Vm,
    pub config: vmm::config::VmConfig,
    pub ram: Arc<PostCopyRam>,
}

/// Why no VM came.
#[derive(Debug, thiserror::Error)]
pub enum NotReceived {
    #[error("{flag}: {source}")]
    Url {
        flag: &'static str,
        source: UrlError,
    },
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("{flag} {url}: cannot listen: {source}")]
    Listen {
        flag: &'static str,
        url: String,
        source: std::io::Error,
    },
    #[error("{flag} {entry:?}: expected {syntax}")]
    Owner {
        flag: &'static str,
        entry: String,
        syntax: &'static str,
    },
    #[error(transparent)]
    Receive(#[from] ReceiveError),
    #[error("the migration switched over without a built VM")]
    NotBuilt,
}

/// Why this process does not take the VM a source offers, or cannot build it.
#[derive(Debug, thiserror::Error)]
enum HostError {
    #[error("the source's VM configuration is not understood here: {0}")]
    Config(#[source] serde_json::Error),
    #[error(transparent)]
    Snapshot(#[from] vmm::snapshot::SnapshotError),
    #[error(
        "{flag} {}: belongs to partition {owner}, not to this one; a disk belongs to one \
         partition",
        path.display()
    )]
    ForeignFile {
        flag: &'static str,
        path: PathBuf,
        owner: String,
    },
    #[error(
        "--net tap={tap}: belongs to partition {owner}, not to this one; a TAP belongs to one \
         partition"
    )]
    ForeignTap { tap: String, owner: String },
    #[error("--disk {}: cannot open it here: {source}", path.display())]
    Disk {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the VM's exit path is {saved}, but this destination's --exits asks for {given}")]
    Exits {
        saved: vmm::config::ExitsMode,
        given: vmm::config::ExitsMode,
    },
    #[error(
        "--vsock socket={}: already exists and is not the source's listener; give --vsock \
         cid=N,socket=OTHER to listen elsewhere",
        .0.display()
    )]
    VsockPath(PathBuf),
    #[error("no configuration came")]
    NoConfig,
    #[error(
        "the VM has {primary} disks, this standby was given {given} (--disk): a standby keeps \
         its own copy of every disk, so give --disk path=COPY for each, in the primary's order"
    )]
    DiskCopies { primary: usize, given: usize },
    #[error(
        "the VM has {primary} memory-storage files, this standby was given {given} (--pmem): \
         a standby keeps its own copy of every one, so give --pmem file=COPY for each, in the \
         primary's order"
    )]
    PmemCopies { primary: usize, given: usize },
    #[error("no VM was built")]
    NoVm,
    #[error(transparent)]
    Build(Box<vmm::BuildError>),
    #[error("the source's VM state is not understood here: {0}")]
    State(#[source] serde_json::Error),
}

/// Builds the incoming VM with what the destination's own flags allow.
pub(super) struct VmHost<'a> {
    given: GivenDevices,
    /// Storage files other partitions own (partition, path): an arriving VM may use none.
    foreign: Vec<(String, PathBuf)>,
    /// TAPs other partitions own (partition, name): an arriving VM may name none.
    foreign_taps: Vec<(String, String)>,
    opts: vmm::RunOptions,
    /// What brought the VM (`migration`, `replication`) and from where, for messages.
    what: &'static str,
    from: &'a str,
    config: Option<vmm::config::VmConfig>,
    built: Option<vmm::Vm>,
}

impl Host for VmHost<'_> {
    fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, VmFault> {
        Ok(self.check_config(config)?)
    }

    fn build(&mut self, ram: &Arc<PostCopyRam>) -> Result<(), VmFault> {
        // SAFETY: the mapping is `ram`'s, `ram.len()` bytes, read-write, and stays mapped
        // while the `ram` handed over as owner lives; only its release changes it (out of
        // userfaultfd, never unmapped).
        let ext =
            unsafe { vmm::ExternalRam::new(ram.host_addr(), ram.len(), ram.clone()) }.on_demand();
        let owner = ram.clone();
        Ok(self.build_on(ext, move || owner.release())?)
    }

    fn apply(&mut self, state: &[u8]) -> Result<(), VmFault> {
        Ok(self.apply_state(state)?)
    }
}

impl Host<ReplicaRam> for VmHost<'_> {
    fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, VmFault> {
        Ok(self.check_config_with(config, true)?)
    }

    fn disk_copies(&self) -> Vec<PathBuf> {
        let disks = self.config.as_ref().map(|c| &c.disks[..]).unwrap_or(&[]);
        disks.iter().map(|d| d.path.clone()).collect()
    }

    fn pmem_copies(&self) -> Vec<PathBuf> {
        let pmem = self.config.as_ref().map(|c| &c.pmem[..]).unwrap_or(&[]);
        pmem.iter().map(|p| p.file.clone()).collect()
    }

    fn build(&mut self, ram: &Arc<ReplicaRam>) -> Result<(), VmFault> {
        // SAFETY: the mapping is `ram`'s, `ram.len()` bytes, read-write, and stays mapped
        // while the `ram` handed over as owner lives (it is unmapped only when dropped).
        let ext =
            unsafe { vmm::ExternalRam::new(ram.host_addr(), ram.len(), ram.clone()) }.on_demand();
        Ok(self.build_on(ext, || {})?)
    }

    fn apply(&mut self, state: &[u8]) -> Result<(), VmFault> {
        Ok(self.apply_state(state)?)
    }
}

impl VmHost<'_> {
    fn check_config(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, HostError> {
        self.check_config_with(config, false)
    }

    /// `copies`: the VM's disks and memory-storage files are this process's own `--disk` and
    /// `--pmem` files (a standby's copies), not the ones the configuration names.
    fn check_config_with(
        &mut self,
        config: &[u8],
        copies: bool,
    ) -> Result<Vec<(u64, u64)>, HostError> {
        let mut offered: serde_json::Value =
            serde_json::from_slice(config).map_err(HostError::Config)?;
        let listener = offered
            .as_object_mut()
            .and_then(|o| o.remove(super::VSOCK_LISTENER))
            .and_then(|id| serde_json::from_value::<(u64, u64)>(id).ok());
        let mut saved: vmm::snapshot::SavedConfig =
            serde_json::from_value(offered).map_err(HostError::Config)?;
        if copies {
            self.own_copies(&mut saved)?;
        }
        let g = &self.given;
        saved.check_given_devices(g)?;
        saved.check_files()?;
        let files = saved
            .disks
            .iter()
            .map(|d| ("--disk", &d.path))
            .chain(saved.pmem.iter().map(|p| ("--pmem", &p.file)));
        for (flag, path) in files {
            let canon = path.canonicalize().unwrap_or_else(|_| path.clone());
            let owner = self
                .foreign
                .iter()
                .find(|(_, f)| f.canonicalize().unwrap_or_else(|_| f.clone()) == canon);
            if let Some((owner, _)) = owner {
                return Err(HostError::ForeignFile {
                    flag,
                    path: path.clone(),
                    owner: owner.clone(),
                });
            }
        }
        for tap in saved.net.iter().filter_map(|n| n.tap.as_deref()) {
            if let Some((owner, _)) = self.foreign_taps.iter().find(|(_, t)| t == tap) {
                return Err(HostError::ForeignTap {
                    tap: tap.into(),
                    owner: owner.clone(),
                });
            }
        }
        for d in &saved.disks {
            std::fs::OpenOptions::new()
                .read(true)
                .write(!d.readonly)
                .open(&d.path)
                .map_err(|source| HostError::Disk {
                    path: d.path.clone(),
                    source,
                })?;
        }
        let mut vm = saved.to_vm_config()?;
        vmm::snapshot::SavedConfig::apply_given(&mut vm, g);
        // The source may listen there still (a move within one host): the VM's listener
        // takes that socket's place at the switch. Anything else there (another VM's
        // socket) stays, and so does the VM where it is.
        if let Some(v) = &vm.vsock {
            use std::os::unix::fs::MetadataExt;
            if let Ok(m) = std::fs::symlink_metadata(&v.socket) {
                if listener != Some((m.dev(), m.ino())) {
                    return Err(HostError::VsockPath(v.socket.clone()));
                }
            }
        }
        if let Some(exits) = g.exits.filter(|&e| e != vm.exits) {
            return Err(HostError::Exits {
                saved: vm.exits,
                given: exits,
            });
        }
        let ranges = vmm::ram_ranges(vm.memory);
        self.config = Some(vm);
        Ok(ranges)
    }

    /// Puts the standby's own `--disk` and `--pmem` files in the place of the primary's, in
    /// order (each region keeps the primary's size and advertisement: the guest found it so).
    fn own_copies(&self, saved: &mut vmm::snapshot::SavedConfig) -> Result<(), HostError> {
        let given = self.given.disks.as_deref().unwrap_or(&[]);
        if given.len() != saved.disks.len() {
            return Err(HostError::DiskCopies {
                primary: saved.disks.len(),
                given: given.len(),
            });
        }
        let cwd = std::env::current_dir().unwrap_or_default();
        for (d, copy) in saved.disks.iter_mut().zip(given) {
            d.path = cwd.join(&copy.path);
        }
        self.own_pmem_copies(saved, &cwd)
    }

    fn own_pmem_copies(
        &self,
        saved: &mut vmm::snapshot::SavedConfig,
        cwd: &Path,
    ) -> Result<(), HostError> {
        let given = self.given.pmem.as_deref().unwrap_or(&[]);
        if given.len() != saved.pmem.len() {
            return Err(HostError::PmemCopies {
                primary: saved.pmem.len(),
                given: given.len(),
            });
        }
        for (p, copy) in saved.pmem.iter_mut().zip(given) {
            p.file = cwd.join(&copy.file);
        }
        Ok(())
    }

    /// Builds the checked VM on `ext`, not started; `on_stopped` runs once it has stopped.
    fn build_on(
        &mut self,
        ext: vmm::ExternalRam,
        on_stopped: impl FnOnce() + Send + 'static,
    ) -> Result<(), HostError> {
        let config = self.config.as_ref().ok_or(HostError::NoConfig)?;
        let vm = vmm::VmBuilder::new(config)
            .options(self.opts.clone())
            .guest_ram(vmm::GuestRamSource::External(ext))
            .on_stopped(on_stopped)
            .restore_later()
            .staged_sockets()
            .build()
            .map_err(|e| HostError::Build(Box::new(e)))?;
        self.built = Some(vm);
        Ok(())
    }

    fn apply_state(&mut self, state: &[u8]) -> Result<(), HostError> {
        let state: vmm::snapshot::VmState =
            serde_json::from_slice(state).map_err(HostError::State)?;
        let vm = self.built.as_mut().ok_or(HostError::NoVm)?;
        vm.apply_state(format!("the {} from {}", self.what, self.from), state)
            .map_err(|e| HostError::Build(Box::new(e)))
    }
}

/// What the destination waits with: where, the secret, what its own flags allow, and what
/// other partitions own (`--foreign-storage PARTITION:PATH`, `--foreign-tap PARTITION:NAME`,
/// as their supervisor tells a VM that waits for a migration).
pub struct Receiving<'a> {
    /// The flag that gave `url`, for messages.
    pub flag: &'static str,
    pub url: &'a str,
    pub secret_file: &'a Path,
    pub given: GivenDevices,
    pub foreign_storage: &'a [String],
    pub foreign_taps: &'a [String],
    pub opts: vmm::RunOptions,
}

/// Waits for one VM and builds it, not started. `stop` is asked now and then whether to give
/// up waiting (a signal), and says why; `log` hears about the progress.
pub fn receive(
    r: Receiving<'_>,
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<Received, NotReceived> {
    let (listener, secret, mut host) = listen(r, "migration", log)?;
    let ram = destination::receive(&listener, &Options::new(secret), &mut host, stop, log)?;
    let (Some(vm), Some(config)) = (host.built.take(), host.config.take()) else {
        return Err(NotReceived::NotBuilt);
    };
    Ok(Received { vm, config, ram })
}

/// Listens where `r` says, with its secret, and the host that builds what comes by `what`.
pub(super) fn listen<'a>(
    r: Receiving<'a>,
    what: &'static str,
    log: &mut dyn FnMut(&str),
) -> Result<(std::net::TcpListener, Vec<u8>, VmHost<'a>), NotReceived> {
    let (flag, url) = (r.flag, r.url);
    let addr = parse_url(url).map_err(|source| NotReceived::Url { flag, source })?;
    let secret = read_secret(r.secret_file)?;
    let listener = std::net::TcpListener::bind(addr).map_err(|source| NotReceived::Listen {
        flag,
        url: url.into(),
        source,
    })?;
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| addr.to_string());
    log(&format!("waiting for a {what} on tcp:{bound}"));
    let owned = |flag: &'static str, syntax: &'static str, list: &[String]| {
        list.iter()
            .map(|f| match f.split_once(':') {
                Some((owner, what)) => Ok((owner.to_string(), what.to_string())),
                None => Err(NotReceived::Owner {
                    flag,
                    entry: f.clone(),
                    syntax,
                }),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let foreign_files = owned("--foreign-storage", "PARTITION:PATH", r.foreign_storage)?;
    let foreign_taps = owned("--foreign-tap", "PARTITION:NAME", r.foreign_taps)?;
    let host = VmHost {
        given: r.given,
        foreign: foreign_files
            .into_iter()
            .map(|(owner, path)| (owner, PathBuf::from(path)))
            .collect(),
        foreign_taps,
        opts: r.opts,
        what,
        from: url,
        config: None,
        built: None,
    };
    Ok((listener, secret, host))
}

impl<'a> VmHost<'a> {
    /// The VM built and its configuration, once a session has succeeded.
    pub(super) fn take(&mut self) -> Option<(vmm::Vm, vmm::config::VmConfig)> {
        Some((self.built.take()?, self.config.take()?))
    }
}

/// The received VM with its failures wired to end it and its page traffic in the metrics.
pub fn received_vm(r: Received) -> vmm::Vm {
    let mut vm = r.vm;
    let control = vm.run_control();
    r.ram.on_failure(Box::new(move |why| {
        control.finish(vmm::Outcome::VmmError(why))
    }));
    let ram = r.ram.clone();
    vm.set_extra_metrics(Arc::new(move |m: &mut musubi_types::Metrics| {
        m.migration = Some(ram.to_metrics())
    }));
    vm
}
