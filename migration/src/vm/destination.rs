//! The destination's side over a Musubi VM: checking the configuration that arrives against
//! what this process's own flags allow, building the VM on guest RAM the source fills, and
//! putting the state into it.

use crate::destination::{self, Host, PostCopyRam};
use crate::{parse_url, read_secret, Options};
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
pub struct NotReceived {
    pub message: String,
}

/// Builds the incoming VM with what the destination's own flags allow.
struct VmHost<'a> {
    given: GivenDevices,
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
        let mut vm = saved.to_vm_config().map_err(|e| e.to_string())?;
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

/// What the destination waits with: where, the secret, what its own flags allow, and what
/// other partitions own (`--foreign-storage PARTITION:PATH`, `--foreign-tap PARTITION:NAME`,
/// as their supervisor tells a VM that waits for a migration).
pub struct Receiving<'a> {
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
    let fail = |message: String| NotReceived { message };
    let url = r.url;
    let addr = parse_url(url).map_err(|e| fail(format!("--receive-migration: {e}")))?;
    let secret = read_secret(r.secret_file).map_err(fail)?;
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| fail(format!("--receive-migration {url}: cannot listen: {e}")))?;
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| addr.to_string());
    log(&format!("waiting for a migration on tcp:{bound}"));
    let owned = |flag: &str, syntax: &str, list: &[String]| {
        list.iter()
            .map(|f| match f.split_once(':') {
                Some((owner, what)) => Ok((owner.to_string(), what.to_string())),
                None => Err(fail(format!("{flag} {f:?}: expected {syntax}"))),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let foreign_files = owned("--foreign-storage", "PARTITION:PATH", r.foreign_storage)?;
    let foreign_taps = owned("--foreign-tap", "PARTITION:NAME", r.foreign_taps)?;
    let mut host = VmHost {
        given: r.given,
        foreign: foreign_files
            .into_iter()
            .map(|(owner, path)| (owner, PathBuf::from(path)))
            .collect(),
        foreign_taps,
        opts: r.opts,
        from: url,
        config: None,
        built: None,
    };
    let ram = destination::receive(&listener, &Options::new(secret), &mut host, stop, log)
        .map_err(|e| fail(e.to_string()))?;
    let (Some(vm), Some(config)) = (host.built.take(), host.config.take()) else {
        return Err(fail(
            "the migration switched over without a built VM".into(),
        ));
    };
    Ok(Received { vm, config, ram })
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
