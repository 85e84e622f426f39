//! `musubi run`: one VM in this process until the guest ends it or a signal does, with its
//! report and metrics files. SIGTERM, SIGINT and SIGHUP stop the VM through its normal teardown, so
//! disks and memory storage are flushed; SIGUSR1 writes the metrics while it runs. With
//! `--serial stdio`, stdin is the guest's console input (see `console`).

use crate::api_target::ApiTarget;
use crate::{cli, console, migrate};
use dsm_host::demand::DemandRam;
use musubi_migration::vm::StandbyEnd;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const STDIN: std::os::fd::RawFd = 0;

pub fn run(vm: &cli::VmArgs, run: &cli::RunFlags, control: &cli::ControlFlags) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("musubi: {msg}");
        ExitCode::from(1)
    };
    let snapshot = match &control.restore {
        Some(dir) => match open_snapshot(dir, vm) {
            Ok(s) => Some(s),
            Err(e) => return fail(e),
        },
        None => None,
    };
    let opts = run.run_options();
    let mut signals = match stop_signals() {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    // `--receive-migration`: the VM comes from another musubi, built here and not started.
    let mut received = match (&control.receive_migration, &control.secret_file) {
        (Some(url), Some(secret)) => {
            let foreign = migrate::Foreign {
                storage: &control.foreign_storage,
                taps: &control.foreign_tap,
            };
            match migrate::receive(url, secret, foreign, vm, opts.clone(), &mut signals) {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("musubi: {}", e.message);
                    return ExitCode::from(e.code);
                }
            }
        }
        _ => None,
    };
    // `--standby-for`: the VM comes from a primary, run once the primary is lost.
    let mut taken_over = match (&control.standby_for, &control.secret_file) {
        (Some(url), Some(secret)) => {
            match migrate::stand_by(
                url,
                secret,
                control.heartbeat,
                vm,
                opts.clone(),
                &mut signals,
            ) {
                Ok(StandbyEnd::TakeOver(t)) => {
                    eprintln!(
                        "musubi: the primary at {url} was lost ({}); taking over from epoch {} \
                         (replayed {} frames the primary had not released)",
                        t.why, t.epoch, t.replayed
                    );
                    Some((t.vm, t.config))
                }
                Ok(StandbyEnd::PrimaryEnded { epochs }) => {
                    eprintln!(
                        "musubi: the primary's VM ended after {epochs} epochs; nothing to take over"
                    );
                    return ExitCode::SUCCESS;
                }
                Err(e) => {
                    eprintln!("musubi: {}", e.message);
                    return ExitCode::from(e.code);
                }
            }
        }
        _ => None,
    };
    // `--replicate-to`: checked before the VM is built, started once it runs.
    let replication = match (&control.replicate_to, &control.secret_file) {
        (Some(url), Some(secret)) => {
            let to = musubi_migration::vm::ReplicateTo {
                url: url.as_str(),
                secret_file: secret,
                epoch: control.epoch,
                policy: control.replicate_policy,
            };
            match musubi_migration::vm::Replication::new(&to) {
                Ok(r) => Some(r),
                Err(e) => return fail(e.to_string()),
            }
        }
        _ => None,
    };
    // Where the replication stands once one runs (`--replicate-to`'s, or vm.replicate's).
    let replicated = musubi_migration::vm::ReplicationSlot::default();
    if let Some(r) = &replication {
        let _ = replicated.set(r.stats());
    }
    let incoming = received.as_ref().map(|r| r.ram.clone());
    let config = match (&snapshot, &received, &taken_over) {
        (Some((_, config)), _, _) => config.clone(),
        (None, Some(r), _) => r.config.clone(),
        (None, None, Some((_, config))) => config.clone(),
        (None, None, None) => match vm.to_config() {
            Ok(c) => c,
            Err(e) => return fail(e),
        },
    };
    let built = match (received.take(), snapshot) {
        (None, _) if taken_over.is_some() => match taken_over.take() {
            Some((vm, _)) => vm,
            None => return fail("the standby's VM went missing".into()),
        },
        (Some(r), _) => musubi_migration::vm::received_vm(r),
        (None, Some((snap, _))) => match restored_vm(&config, snap, opts, control.restore_memory) {
            Ok(vm) => vm,
            Err(e) => return fail(e),
        },
        (None, None) => match vmm::VmBuilder::new(&config).options(opts).build() {
            Ok(mut vm) => {
                let slot = replicated.clone();
                vm.set_extra_metrics(std::sync::Arc::new(move |m: &mut musubi_types::Metrics| {
                    if let Some(stats) = slot.get() {
                        m.replication = Some(stats.to_metrics())
                    }
                }));
                vm
            }
            Err(e) => return fail(e.to_string()),
        },
    };
    // The console takes stdin only when the guest's console is on stdout. The terminal goes
    // raw before the guest runs, so no early keystroke is echoed or held for a whole line;
    // the guard restores it on every way out of this function.
    let stdio = config.serial == vmm::config::SerialMode::Stdio;
    let terminal = stdio && console::is_terminal(STDIN);
    let raw_mode = match terminal.then(|| console::RawMode::enter(STDIN)) {
        Some(Err(e)) => {
            eprintln!("musubi: --serial stdio: cannot put the terminal in raw mode: {e}");
            None
        }
        Some(Ok(r)) => Some(r),
        None => None,
    };
    if built.starts_paused() {
        eprintln!(
            "musubi: the VM arrived paused, as its source had it; {}",
            if control.api_socket.is_some() {
                "resume it through the API (vm.resume)"
            } else {
                "without --api-socket nothing can resume it here"
            }
        );
    }
    let running = match built.start() {
        Ok(r) => r,
        Err(e) => return fail(e.to_string()),
    };
    // Started before this thread's filter goes on, so the API thread has only its own.
    let api = match &control.api_socket {
        Some(path) => {
            let migrator =
                match musubi_migration::vm::Migrator::start(running.handle(), incoming.clone()) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        eprintln!("musubi: cannot start the migrator thread: {e}");
                        None
                    }
                };
            let log = std::sync::Arc::new(|m: &str| eprintln!("musubi: {m}"));
            let on_request =
                musubi_migration::vm::OnRequest::start(running.handle(), replicated.clone(), log);
            let on_request = match on_request {
                Ok(r) => Some(std::sync::Arc::new(r)),
                Err(e) => {
                    eprintln!("musubi: cannot start the thread that replicates on request: {e}");
                    None
                }
            };
            let target = std::sync::Arc::new(ApiTarget {
                vm: running.handle(),
                migrator,
                secret_file: control.secret_file.clone(),
                described: crate::api_target::Described::of(&running.handle()),
                replication: replicated.clone(),
                replicate_on_request: on_request.clone(),
            });
            crate::api_target::serve(path, target, run.seccomp, &running.handle())
                .map(|api| (api, on_request))
        }
        None => None,
    };
    // Connects, so it starts before this thread's filter goes on.
    let replicator = match replication {
        Some(r) => match r.start(running.handle(), Box::new(|m| eprintln!("musubi: {m}"))) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("musubi: {e}; the VM runs alone, unprotected");
                None
            }
        },
        None => None,
    };
    // This thread only waits, flushes and writes reports from here on; the threads it
    // starts next (signals, console input) inherit its filter.
    if let Err(e) = vmm::seccomp::apply(vmm::seccomp::ThreadKind::Control, run.seccomp) {
        running.stop(vmm::Outcome::VmmError(e.to_string()));
    }
    let input = if stdio {
        match console::Input::start(running.handle(), STDIN, terminal) {
            Ok(i) => Some(i),
            Err(e) => {
                eprintln!("musubi: --serial stdio: cannot read stdin for the guest: {e}");
                None
            }
        }
    } else {
        None
    };
    let watch = SignalWatch::start(signals, running.handle(), run.metrics.clone());
    let report = running.wait();
    if let Some(r) = replicator {
        r.finish();
    }
    if let Some(r) = api.as_ref().and_then(|(_, r)| r.as_ref()) {
        r.finish();
    }
    drop(api);
    watch.close();
    drop(input);
    drop(raw_mode);

    if let Some(p) = &run.metrics {
        write_json(p, "--metrics", &report.metrics);
    }
    if let Some(p) = &run.report {
        write_json(p, "--report", &report.to_report());
    }
    match &report.outcome {
        vmm::Outcome::GuestCrash(m) => eprintln!("musubi: guest crashed: {m}"),
        vmm::Outcome::VmmError(m) => eprintln!("musubi: {m}"),
        vmm::Outcome::Signal(s) => eprintln!("musubi: stopped by signal {s}; disks flushed"),
        vmm::Outcome::ConsoleQuit => eprintln!("musubi: quit from the console (Ctrl-A x)"),
        _ => {}
    }
    ExitCode::from(report.outcome.exit_code() as u8)
}

/// Reads and checks the snapshot `dir` for `--restore`, and the configuration to build it
/// with. Flags that ask for another VM than the saved one, and missing disks or
/// memory-storage files, are refused here, before anything is built.
pub(crate) fn open_snapshot(
    dir: &Path,
    vm: &cli::VmArgs,
) -> Result<(vmm::snapshot::Snapshot, vmm::config::VmConfig), String> {
    let flag = |e: vmm::snapshot::SnapshotError| format!("--restore {}: {e}", dir.display());
    let snap = vmm::snapshot::Snapshot::open(dir).map_err(flag)?;
    let given = vm.given_devices()?;
    snap.config.check_given_devices(&given).map_err(flag)?;
    snap.config.check_files().map_err(flag)?;
    let mut config = snap
        .config
        .to_vm_config()
        .map_err(|e| format!("--restore {}: {e}", dir.display()))?;
    vmm::snapshot::SavedConfig::apply_given(&mut config, &given);
    if let Some(exits) = given.exits.filter(|&e| e != config.exits) {
        return Err(format!(
            "--restore {}: the snapshot's exit path is {}, but --exits asks for {exits}",
            dir.display(),
            config.exits
        ));
    }
    // Named before anything is built: the saved VM's path may still be another VM's (the
    // one saved, still running), which `--vsock` of the same cid moves away from.
    if let Some(v) = &config.vsock {
        v.check_free().map_err(|e| {
            format!(
                "--restore {}: the vsock's {e}; give --vsock cid={},socket=OTHER to listen elsewhere",
                dir.display(),
                v.cid
            )
        })?;
    }
    Ok((snap, config))
}

/// Builds the VM `snap` saved (`config` is its own), its RAM filled as `memory` says, not
/// started.
pub(crate) fn restored_vm(
    config: &vmm::config::VmConfig,
    snap: vmm::snapshot::Snapshot,
    opts: vmm::RunOptions,
    memory: cli::RestoreMemory,
) -> Result<vmm::Vm, String> {
    let builder = vmm::VmBuilder::new(config).options(opts);
    if memory != cli::RestoreMemory::Ondemand {
        return builder
            .prefault(memory == cli::RestoreMemory::Prefault)
            .restore(snap)
            .build()
            .map_err(|e| e.to_string());
    }
    let (demand, ext) = on_demand_ram(&snap)?;
    let owner = demand.clone();
    let mut built = builder
        .guest_ram(vmm::GuestRamSource::External(ext))
        .on_stopped(move || owner.release())
        .restore(snap)
        .build()
        .map_err(|e| e.to_string())?;
    let control = built.run_control();
    demand.on_failure(Box::new(move |why| {
        control.finish(vmm::Outcome::VmmError(why))
    }));
    built.set_extra_metrics(std::sync::Arc::new(move |m: &mut musubi_types::Metrics| {
        m.demand_paging = Some(demand.stats().to_metrics())
    }));
    Ok(built)
}

/// Guest RAM for `--restore-memory ondemand`: empty memory whose pages a thread reads from
/// the snapshot's memory file at their first touch.
fn on_demand_ram(
    snap: &vmm::snapshot::Snapshot,
) -> Result<(std::sync::Arc<DemandRam>, vmm::ExternalRam), String> {
    let len = snap.config.memory as usize;
    let ram = DemandRam::start(snap.memory.clone(), len)
        .map(std::sync::Arc::new)
        .map_err(|e| format!("--restore-memory ondemand: {e}"))?;
    // SAFETY: the mapping is `ram`'s, `len` bytes, read-write, and stays mapped while the
    // `ram` handed over as owner lives; only its release (after the vCPUs stop) changes it.
    let ext = unsafe { vmm::ExternalRam::new(ram.host_addr(), len, ram.clone()) }
        .on_demand_from(snap.memory.clone());
    Ok((ram, ext))
}

/// The signals that stop a VM (and SIGUSR1, which writes its metrics), registered before
/// the VM exists: a signal that arrives while it is being built is held and stops it as
/// soon as it runs.
pub fn stop_signals() -> Result<Signals, String> {
    Signals::new([SIGTERM, SIGINT, SIGHUP, SIGUSR1])
        .map_err(|e| format!("cannot install signal handlers: {e}"))
}

/// Stops the VM on SIGTERM, SIGINT and SIGHUP and writes its metrics on SIGUSR1, from a
/// thread of its own, until closed.
pub struct SignalWatch {
    handle: signal_hook::iterator::Handle,
    thread: std::thread::JoinHandle<()>,
}

impl SignalWatch {
    pub fn start(mut signals: Signals, vm: vmm::VmHandle, metrics: Option<PathBuf>) -> SignalWatch {
        let handle = signals.handle();
        let thread = std::thread::spawn(move || {
            for sig in signals.forever() {
                match sig {
                    SIGUSR1 => {
                        if let Some(p) = &metrics {
                            write_json(p, "--metrics", &vm.metrics());
                        }
                    }
                    s => vm.stop(vmm::Outcome::Signal(s)),
                }
            }
        });
        SignalWatch { handle, thread }
    }

    pub fn close(self) {
        self.handle.close();
        let _ = self.thread.join();
    }
}

/// Replaces `path` whole, so a reader never sees half a file. Written through a
/// `serde_json::Value`, so the keys stay in the alphabetical order the files have always had.
pub fn write_json(path: &Path, flag: &str, value: &impl serde::Serialize) {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_value(value)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_default();
    if let Err(e) = std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, path)) {
        eprintln!("musubi: {flag} {}: {e}", path.display());
    }
}
