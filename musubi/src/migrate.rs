//! Live migration between `musubi run` processes (post-copy, or pre-copy on request), the
//! control API and the `musubi-migration` crate:
//! - destination: `run --receive-migration tcp:HOST:PORT --secret-file F` waits for one VM
//!   ([`receive`]) and builds it on guest RAM whose pages come from the source;
//! - source: a migrator thread ([`Migrator`]), started before the system-call filters go
//!   on, connects and moves the VM when the API asks (`PUT vm.send-migration`); the API
//!   thread only hands it the request and waits for the answer.

use crate::cli;
use musubi_migration::destination::{self, Host, PostCopyRam};
use musubi_migration::source::{self, SourceError, SourceVm};
use musubi_migration::{parse_url, read_secret, Mode, Options};
use signal_hook::iterator::Signals;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

/// A VM received from a migration's source, built and not started; its pages are on their
/// way into `ram`.
pub struct Received {
    pub vm: vmm::Vm,
    pub config: vmm::config::VmConfig,
    pub ram: Arc<PostCopyRam>,
}

/// Why no VM came: the message, and the exit status.
pub struct NotReceived {
    pub message: String,
    pub code: u8,
}

/// Builds the incoming VM with what the destination's own flags allow.
struct VmHost<'a> {
    given: cli::GivenDevices,
    /// Storage files other partitions own (partition, path): an arriving VM may use none.
    foreign: Vec<(String, PathBuf)>,
    /// TAPs other partitions own (partition, name): an arriving VM may name none.
    foreign_taps: Vec<(String, String)>,
    opts: vmm::RunOptions,
    from: &'a str,
    config: Option<vmm::config::VmConfig>,
    built: Option<vmm::Vm>,
}

impl Host for VmHost<'_> {
    fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, String> {
        let saved: vmm::snapshot::SavedConfig = serde_json::from_slice(config)
            .map_err(|e| format!("the source's VM configuration is not understood here: {e}"))?;
        let g = &self.given;
        saved
            .check_given(g.cpus, g.memory, g.disks.as_deref(), g.pmem.as_deref())
            .map_err(|e| e.to_string())?;
        saved.check_files().map_err(|e| e.to_string())?;
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
                return Err(format!(
                    "{flag} {}: belongs to partition {owner}, not to this one; a disk belongs \
                     to one partition",
                    path.display()
                ));
            }
        }
        for tap in saved.net.iter().filter_map(|n| n.tap.as_deref()) {
            if let Some((owner, _)) = self.foreign_taps.iter().find(|(_, t)| t == tap) {
                return Err(format!(
                    "--net tap={tap}: belongs to partition {owner}, not to this one; a TAP \
                     belongs to one partition"
                ));
            }
        }
        for d in &saved.disks {
            std::fs::OpenOptions::new()
                .read(true)
                .write(!d.readonly)
                .open(&d.path)
                .map_err(|e| format!("--disk {}: cannot open it here: {e}", d.path.display()))?;
        }
        let mut vm = saved.to_vm_config()?;
        if let Some(serial) = g.serial.clone() {
            vm.serial = serial;
        }
        if let Some(exits) = g.exits.filter(|&e| e != vm.exits) {
            return Err(format!(
                "the VM's exit path is {}, but this destination's --exits asks for {exits}",
                vm.exits
            ));
        }
        let ranges = vmm::ram_ranges(vm.memory);
        self.config = Some(vm);
        Ok(ranges)
    }

    fn build(&mut self, ram: &Arc<PostCopyRam>) -> Result<(), String> {
        let config = self.config.as_ref().ok_or("no configuration came")?;
        // SAFETY: the mapping is `ram`'s, `ram.len()` bytes, read-write, and stays mapped
        // while the `ram` handed over as owner lives; only its release changes it (out of
        // userfaultfd, never unmapped).
        let ext =
            unsafe { vmm::ExternalRam::new(ram.host_addr(), ram.len(), ram.clone()) }.on_demand();
        let owner = ram.clone();
        let vm = vmm::VmBuilder::new(config)
            .options(self.opts.clone())
            .guest_ram(vmm::GuestRamSource::External(ext))
            .on_stopped(move || owner.release())
            .restore_later()
            .build()
            .map_err(|e| e.to_string())?;
        self.built = Some(vm);
        Ok(())
    }

    fn apply(&mut self, state: &[u8]) -> Result<(), String> {
        let state: vmm::snapshot::VmState = serde_json::from_slice(state)
            .map_err(|e| format!("the source's VM state is not understood here: {e}"))?;
        let vm = self.built.as_mut().ok_or("no VM was built")?;
        vm.apply_state(format!("the migration from {}", self.from), state)
            .map_err(|e| e.to_string())
    }
}

/// What other partitions own, as their supervisor tells a VM that waits for a migration
/// (`--foreign-storage PARTITION:PATH`, `--foreign-tap PARTITION:NAME`).
pub struct Foreign<'a> {
    pub storage: &'a [String],
    pub taps: &'a [String],
}

/// `run --receive-migration URL`: waits for one VM and builds it. A signal (SIGTERM,
/// SIGINT, SIGHUP) ends the wait with status 128+N.
pub fn receive(
    url: &str,
    secret_file: &Path,
    foreign: Foreign<'_>,
    vm: &cli::VmArgs,
    opts: vmm::RunOptions,
    signals: &mut Signals,
) -> Result<Received, NotReceived> {
    let fail = |message: String| NotReceived { message, code: 1 };
    let addr = parse_url(url).map_err(|e| fail(format!("--receive-migration: {e}")))?;
    let secret = read_secret(secret_file).map_err(fail)?;
    let given = vm.given_devices().map_err(fail)?;
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| fail(format!("--receive-migration {url}: cannot listen: {e}")))?;
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| addr.to_string());
    eprintln!("musubi: waiting for a migration on tcp:{bound}");
    let owned = |flag: &str, syntax: &str, list: &[String]| {
        list.iter()
            .map(|f| match f.split_once(':') {
                Some((owner, what)) => Ok((owner.to_string(), what.to_string())),
                None => Err(fail(format!("{flag} {f:?}: expected {syntax}"))),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let foreign_files = owned("--foreign-storage", "PARTITION:PATH", foreign.storage)?;
    let foreign_taps = owned("--foreign-tap", "PARTITION:NAME", foreign.taps)?;
    let mut host = VmHost {
        given,
        foreign: foreign_files
            .into_iter()
            .map(|(owner, path)| (owner, PathBuf::from(path)))
            .collect(),
        foreign_taps,
        opts,
        from: url,
        config: None,
        built: None,
    };
    let mut signal = None;
    let mut stop = || {
        for s in signals.pending() {
            if s != signal_hook::consts::SIGUSR1 {
                signal = Some(s);
                return Some(format!(
                    "stopped by signal {s} while waiting for a migration"
                ));
            }
        }
        None
    };
    let mut log = |m: &str| eprintln!("musubi: {m}");
    let r = destination::receive(
        &listener,
        &Options::new(secret),
        &mut host,
        &mut stop,
        &mut log,
    );
    match r {
        Ok(ram) => {
            let (Some(vm), Some(config)) = (host.built.take(), host.config.take()) else {
                return Err(fail(
                    "the migration switched over without a built VM".into(),
                ));
            };
            Ok(Received { vm, config, ram })
        }
        Err(e) => Err(NotReceived {
            message: e.to_string(),
            code: signal.map_or(1, |s| 128 + s as u8),
        }),
    }
}

/// The running VM as the migration's source sees it.
struct HandleVm<'a>(&'a vmm::VmHandle);

impl SourceVm for HandleVm<'_> {
    fn config(&self) -> Vec<u8> {
        serde_json::to_vec(self.0.config()).unwrap_or_default()
    }
    fn capture(&self) -> Result<Vec<u8>, String> {
        let state = self.0.capture().map_err(|e| e.to_string())?;
        // The destination opens the same disks and memory-storage files: what the guest
        // wrote to them here must be in the files before it runs there (shared storage
        // between hosts sees only what was written back).
        if let Err(e) = self.0.flush_storage() {
            let _ = self.0.resume();
            return Err(e);
        }
        serde_json::to_vec(&state).map_err(|e| e.to_string())
    }
    fn resume(&self) -> Result<(), String> {
        self.0.resume().map_err(|e| e.to_string())
    }
    fn ram_ranges(&self) -> Vec<(u64, u64)> {
        self.0.ram_ranges()
    }
    fn pages_with_data(&self) -> Result<Vec<u64>, String> {
        self.0
            .pages_with_data()
            .map_err(|e| format!("finding the pages with data: {e}"))
    }
    fn read_page(&self, gpa: u64, buf: &mut [u8; dsm::PAGE_SIZE]) -> Result<(), String> {
        self.0.read_ram(gpa, &mut buf[..])
    }
    fn has_ended(&self) -> bool {
        self.0.has_ended()
    }
    fn start_dirty_log(&self) -> Result<(), String> {
        self.0.start_dirty_log()
    }
    fn dirty_pages(&self) -> Result<Vec<u64>, String> {
        self.0.dirty_pages()
    }
    fn stop_dirty_log(&self) -> Result<(), String> {
        self.0.stop_dirty_log()
    }
}

struct Request {
    req: musubi_api::SendMigration,
    reply: mpsc::Sender<Result<(), String>>,
}

/// Moves the VM elsewhere when asked, from a thread of its own: the API thread's filter
/// allows neither connecting nor starting threads, so this thread, started before the
/// filters go on, does both.
pub struct Migrator {
    requests: Mutex<mpsc::Sender<Request>>,
}

impl Migrator {
    /// `incoming` is the RAM of a VM that came by migration itself: it cannot move on
    /// before all its pages are here.
    pub fn start(
        vm: vmm::VmHandle,
        incoming: Option<Arc<PostCopyRam>>,
    ) -> std::io::Result<Migrator> {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("migrator".into())
            .spawn(move || {
                for r in rx {
                    let _ = r.reply.send(send(&vm, incoming.as_deref(), &r.req));
                }
            })?;
        Ok(Migrator {
            requests: Mutex::new(tx),
        })
    }

    /// Moves the VM as `req` asks: `Ok` once it runs there and this side holds nothing it
    /// needs (the VM here has then ended as migrated).
    pub fn send(&self, req: &musubi_api::SendMigration) -> Result<(), String> {
        let (tx, rx) = mpsc::channel();
        let req = Request {
            req: req.clone(),
            reply: tx,
        };
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(req)
            .map_err(|_| "the migrator thread has stopped".to_string())?;
        rx.recv()
            .map_err(|_| "the migrator thread has stopped".to_string())?
    }
}

fn send(
    vm: &vmm::VmHandle,
    incoming: Option<&PostCopyRam>,
    req: &musubi_api::SendMigration,
) -> Result<(), String> {
    let url = req.url.as_str();
    if incoming.is_some_and(|r| !r.all_held()) {
        return Err(
            "this VM is still receiving its pages from its previous migration; ask again once \
             they are all here"
                .into(),
        );
    }
    let addr = parse_url(url)?;
    let secret = read_secret(&req.secret_file)?;
    let mut opts = Options::new(secret);
    opts.push_limit = req.push_limit;
    if let Some(p) = req.precopy {
        opts.mode = Mode::PreCopy {
            downtime: std::time::Duration::from_millis(p.downtime_ms),
            max_rounds: p.max_rounds,
        };
    }
    match source::migrate(&HandleVm(vm), addr, &opts) {
        Ok(r) => {
            let pre = r.precopy.clone().unwrap_or_default();
            tracing::info!(
                to = url,
                data_pages = r.data_pages,
                asked = r.pages_asked,
                pushed = r.pages_pushed,
                ended_there = r.ended_there,
                precopy_rounds = pre.rounds,
                precopy_live = pre.pages_live,
                precopy_paused = pre.pages_paused,
                precopy_converged = pre.converged,
                "migrated"
            );
            vm.stop(vmm::Outcome::Migrated {
                to: url.to_string(),
            });
            Ok(())
        }
        Err(SourceError::After(e)) => {
            vm.stop(vmm::Outcome::VmmError(e.clone()));
            Err(e)
        }
        Err(e) => Err(e.to_string()),
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
    vm.set_extra_metrics(Arc::new(
        move || serde_json::json!({ "migration": ram.to_json() }),
    ));
    vm
}
