//! `musubi vmm`: a VMM that starts with no VM and takes Cloud Hypervisor's life cycle
//! through its API: vm.create, vm.boot, vm.pause/resume, vm.shutdown, vm.reboot,
//! vm.power-button, vm.delete, vm.restore, vm.receive-migration and vm.send-migration, and
//! vmm.shutdown to end the process.
//!
//! The API thread only forwards each call to this process's main thread and waits for its
//! answer: building a VM opens files, maps memory and starts threads, which the API
//! thread's system-call filter does not allow. The main thread keeps no filter of its own
//! for the same reason; the vCPU and I/O threads of every VM get theirs as under `run`.

use crate::ch_config::ChVm;
use crate::cli::RestoreMemory;
use musubi_api::{ActionError, DeviceKind, VmControl};
use musubi_migration::vm::{Migrator, Receiving};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// What the main thread is asked to do.
enum Call {
    Create(Vec<u8>),
    Boot,
    Reboot,
    PowerButton,
    Pause,
    Resume,
    Shutdown,
    Delete,
    Info,
    Counters,
    Snapshot(PathBuf),
    AddDevice(DeviceKind, Vec<u8>),
    RemoveDevice(String),
    Restore(musubi_api::Restore),
    Receive(musubi_api::ReceiveMigration),
    Send(musubi_api::SendMigration),
    ShutdownVmm,
}

enum Msg {
    Api(Call, mpsc::Sender<Result<Value, ActionError>>),
    /// The VM booted as `generation` ended (on its own, or stopped).
    Ended(u64),
    Signal(i32),
}

/// The API's side: every call goes to the main thread.
struct Forward(Mutex<mpsc::Sender<Msg>>);

impl Forward {
    fn call(&self, call: Call) -> Result<Value, ActionError> {
        let (tx, rx) = mpsc::channel();
        let sent = self
            .0
            .lock()
            .map_err(|_| ActionError::internal("the VMM's main thread is gone"))?
            .send(Msg::Api(call, tx));
        if sent.is_err() {
            return Err(ActionError::internal("the VMM is shutting down"));
        }
        rx.recv()
            .unwrap_or_else(|_| Err(ActionError::internal("the VMM is shutting down")))
    }

    fn act(&self, call: Call) -> Result<(), ActionError> {
        self.call(call).map(drop)
    }
}

impl VmControl for Forward {
    fn info(&self) -> Result<Value, ActionError> {
        self.call(Call::Info)
    }
    fn counters(&self) -> Result<Value, ActionError> {
        self.call(Call::Counters)
    }
    fn create(&self, body: &[u8]) -> Result<(), ActionError> {
        self.act(Call::Create(body.to_vec()))
    }
    fn boot(&self) -> Result<(), ActionError> {
        self.act(Call::Boot)
    }
    fn reboot(&self) -> Result<(), ActionError> {
        self.act(Call::Reboot)
    }
    fn delete(&self) -> Result<(), ActionError> {
        self.act(Call::Delete)
    }
    fn power_button(&self) -> Result<(), ActionError> {
        self.act(Call::PowerButton)
    }
    fn pause(&self) -> Result<(), ActionError> {
        self.act(Call::Pause)
    }
    fn resume(&self) -> Result<(), ActionError> {
        self.act(Call::Resume)
    }
    fn snapshot(&self, dir: &std::path::Path) -> Result<(), ActionError> {
        self.act(Call::Snapshot(dir.to_path_buf()))
    }
    fn shutdown_vm(&self) -> Result<(), ActionError> {
        self.act(Call::Shutdown)
    }
    fn shutdown_vmm(&self) -> Result<(), ActionError> {
        self.act(Call::ShutdownVmm)
    }
    fn add_device(&self, kind: DeviceKind, body: &[u8]) -> Result<(), ActionError> {
        self.act(Call::AddDevice(kind, body.to_vec()))
    }
    fn remove_device(&self, id: &str) -> Result<(), ActionError> {
        self.act(Call::RemoveDevice(id.to_string()))
    }
    fn restore(&self, req: &musubi_api::Restore) -> Result<(), ActionError> {
        self.act(Call::Restore(req.clone()))
    }
    fn receive_migration(&self, req: &musubi_api::ReceiveMigration) -> Result<(), ActionError> {
        self.act(Call::Receive(req.clone()))
    }
    fn send_migration(&self, req: &musubi_api::SendMigration) -> Result<(), ActionError> {
        self.act(Call::Send(req.clone()))
    }
}

/// A running VM, the thread that waits for its end, and the thread that can move it.
struct Booted {
    handle: vmm::VmHandle,
    waiter: std::thread::JoinHandle<vmm::RunReport>,
    generation: u64,
    /// `None` if its thread could not start: the VM runs, but cannot be migrated.
    migrator: Option<Migrator>,
}

/// Where the VM is in Cloud Hypervisor's life cycle; Paused is a Running VM's handle's.
enum State {
    Empty,
    Created(Box<ChVm>),
    Running(Box<ChVm>, Booted),
    /// The VM is gone, its configuration kept; `why` is how it ended.
    Shutdown(Box<ChVm>, Value),
}

struct Vmm {
    state: State,
    opts: vmm::RunOptions,
    tx: mpsc::Sender<Msg>,
    generation: u64,
    /// `--secret-file`: the secret of a migration whose request names none.
    secret_file: Option<PathBuf>,
    /// The last stop signal, for a wait (a migration's) that cannot read the channel.
    signal: Arc<AtomicI32>,
}

const NOT_CREATED: &str = "no VM is created (vm.create first)";

impl Vmm {
    fn boot(&mut self, vm: &ChVm) -> Result<Booted, ActionError> {
        let built = vmm::VmBuilder::new(&vm.config)
            .options(self.opts.clone())
            .build()
            .map_err(|e| ActionError::internal(e.to_string()))?;
        self.start(built, None)
    }

    /// Puts back the VM a snapshot holds, paused unless the request asks it to resume, as
    /// Cloud Hypervisor leaves a restored VM.
    fn restore(&mut self, req: &musubi_api::Restore) -> Result<(ChVm, Booted), ActionError> {
        if req.prefault && req.on_demand {
            return Err(ActionError::bad_request(
                "prefault reads the whole memory file before the VM runs, memory_restore_mode \
                 OnDemand reads each page at its first touch: ask for one of them",
            ));
        }
        let fail = |e: String| {
            ActionError::internal(format!("source_url file://{}: {e}", req.dir.display()))
        };
        let snap = vmm::snapshot::Snapshot::open(&req.dir).map_err(|e| fail(e.to_string()))?;
        snap.config.check_files().map_err(|e| fail(e.to_string()))?;
        let config = snap
            .config
            .to_vm_config()
            .map_err(|e| fail(e.to_string()))?;
        let memory = match (req.on_demand, req.prefault) {
            (true, _) => RestoreMemory::Ondemand,
            (false, true) => RestoreMemory::Prefault,
            (false, false) => RestoreMemory::Mapped,
        };
        let mut built =
            crate::run::restored_vm(&config, snap, self.opts.clone(), memory).map_err(fail)?;
        if !req.resume {
            built.hold_paused();
        }
        let booted = self.start(built, None)?;
        if req.resume && booted.handle.is_paused() {
            if let Err(e) = booted.handle.resume() {
                let why = e.to_string();
                Self::stop(booted, vmm::Outcome::VmmError(why.clone()));
                return Err(ActionError::internal(why));
            }
        }
        Ok((ChVm::from_config(config), booted))
    }

    /// Waits for one VM sent by another VMM and runs it; its pages follow (post-copy) or
    /// came first (pre-copy), as the sender chose.
    fn receive(
        &mut self,
        req: &musubi_api::ReceiveMigration,
    ) -> Result<(ChVm, Booted), ActionError> {
        let secret =
            crate::migrate::secret(req.secret_file.as_deref(), self.secret_file.as_deref())?;
        let signal = self.signal.clone();
        let mut stop = || match signal.load(Ordering::Relaxed) {
            0 => None,
            s => Some(format!(
                "stopped by signal {s} while waiting for a migration"
            )),
        };
        let mut log = |m: &str| tracing::info!("{m}");
        let received = musubi_migration::vm::receive(
            Receiving {
                flag: "--receive-migration",
                url: &req.url,
                secret_file: &secret,
                given: Default::default(),
                foreign_storage: &[],
                foreign_taps: &[],
                opts: self.opts.clone(),
            },
            &mut stop,
            &mut log,
        )
        .map_err(|e| ActionError::internal(e.to_string()))?;
        let config = received.config.clone();
        let incoming = Some(received.ram.clone());
        let built = musubi_migration::vm::received_vm(received);
        let booted = self.start(built, incoming)?;
        Ok((ChVm::from_config(config), booted))
    }

    /// Runs a built VM, with a thread that tells the main thread when it ends and one that
    /// can send it elsewhere.
    fn start(
        &mut self,
        built: vmm::Vm,
        incoming: Option<Arc<musubi_migration::destination::PostCopyRam>>,
    ) -> Result<Booted, ActionError> {
        let running = built
            .start()
            .map_err(|e| ActionError::internal(e.to_string()))?;
        let migrator = Migrator::start(running.handle(), incoming)
            .map_err(|e| tracing::warn!("cannot start the migrator thread: {e}"))
            .ok();
        self.generation += 1;
        let generation = self.generation;
        let handle = running.handle();
        let tx = self.tx.clone();
        let waiter = std::thread::Builder::new()
            .name("vm-wait".into())
            .spawn(move || {
                let report = running.wait();
                let _ = tx.send(Msg::Ended(generation));
                report
            })
            .map_err(|e| ActionError::internal(format!("cannot start the VM's thread: {e}")))?;
        Ok(Booted {
            handle,
            waiter,
            generation,
            migrator,
        })
    }

    /// Stops a running VM (if it has not ended already) and waits until it is gone.
    fn stop(booted: Booted, why: vmm::Outcome) -> Value {
        booted.handle.stop(why);
        match booted.waiter.join() {
            Ok(report) => ended(&report),
            Err(_) => json!({"vmm_error": "the VM's thread panicked"}),
        }
    }

    fn handle(&mut self, call: Call) -> Result<Value, ActionError> {
        let state = std::mem::replace(&mut self.state, State::Empty);
        let (state, result) = self.transition(state, call);
        self.state = state;
        result
    }

    fn transition(&mut self, state: State, call: Call) -> (State, Result<Value, ActionError>) {
        let done = Ok(Value::Null);
        match (state, call) {
            (State::Empty, Call::Create(body)) => match crate::ch_config::parse(&body) {
                Ok(vm) => (State::Created(Box::new(vm)), done),
                Err(e) => (State::Empty, Err(ActionError::bad_request(e.to_string()))),
            },
            (State::Empty, call @ (Call::Restore(_) | Call::Receive(_))) => {
                let made = match &call {
                    Call::Restore(r) => self.restore(r),
                    Call::Receive(r) => self.receive(r),
                    _ => Err(ActionError::internal("not a restore or a migration")),
                };
                match made {
                    Ok((vm, b)) => (State::Running(Box::new(vm), b), done),
                    Err(e) => (State::Empty, Err(e)),
                }
            }
            (s, Call::Create(_) | Call::Restore(_) | Call::Receive(_)) => (
                s,
                Err(ActionError::wrong_state(
                    "a VM is already created (vm.delete it first)",
                )),
            ),
            (State::Empty, Call::Delete) => (State::Empty, done),
            (State::Running(_, b), Call::Delete) => {
                Self::stop(b, vmm::Outcome::Shutdown);
                (State::Empty, done)
            }
            (_, Call::Delete) => (State::Empty, done),
            (State::Empty, Call::ShutdownVmm) => (State::Empty, done),
            (State::Running(vm, b), Call::ShutdownVmm) => {
                let why = Self::stop(b, vmm::Outcome::Shutdown);
                (State::Shutdown(vm, why), done)
            }
            (s, Call::ShutdownVmm) => (s, done),
            (State::Empty, _) => (State::Empty, Err(ActionError::not_created(NOT_CREATED))),
            (State::Created(vm) | State::Shutdown(vm, _), Call::Boot) => match self.boot(&vm) {
                Ok(b) => (State::Running(vm, b), done),
                Err(e) => (State::Created(vm), Err(e)),
            },
            (State::Running(vm, b), Call::Reboot) => {
                Self::stop(b, vmm::Outcome::Shutdown);
                match self.boot(&vm) {
                    Ok(b) => (State::Running(vm, b), done),
                    Err(e) => {
                        let why = json!({"vmm_error": e.message.clone()});
                        (State::Shutdown(vm, why), Err(e))
                    }
                }
            }
            (State::Running(vm, b), Call::Shutdown) => {
                let why = Self::stop(b, vmm::Outcome::Shutdown);
                (State::Shutdown(vm, why), done)
            }
            // Devices change only the config the next boot builds from: virtio-mmio devices
            // are found by the guest's kernel at boot, never later.
            (State::Created(vm), call @ (Call::AddDevice(..) | Call::RemoveDevice(_))) => {
                match reconfigure(&vm, call) {
                    Ok(new) => (State::Created(Box::new(new)), done),
                    Err(e) => (State::Created(vm), Err(e)),
                }
            }
            (State::Shutdown(vm, why), call @ (Call::AddDevice(..) | Call::RemoveDevice(_))) => {
                match reconfigure(&vm, call) {
                    Ok(new) => (State::Shutdown(Box::new(new), why), done),
                    Err(e) => (State::Shutdown(vm, why), Err(e)),
                }
            }
            (State::Running(vm, b), Call::AddDevice(..) | Call::RemoveDevice(_)) => (
                State::Running(vm, b),
                Err(ActionError::internal(musubi_api::NO_HOTPLUG)),
            ),
            (state, Call::Info) => {
                let info = info(&state);
                (state, Ok(info))
            }
            (State::Running(vm, b), call) => {
                let refused = |e: vmm::ControlError| ActionError::internal(e.to_string());
                let r = match call {
                    Call::Pause => b.handle.pause().map(|_| Value::Null).map_err(refused),
                    Call::Resume => b.handle.resume().map(|_| Value::Null).map_err(refused),
                    Call::PowerButton => b
                        .handle
                        .power_button()
                        .map(|_| Value::Null)
                        .map_err(refused),
                    Call::Snapshot(dir) => b
                        .handle
                        .snapshot(&dir)
                        .map(|_| Value::Null)
                        .map_err(refused),
                    Call::Counters => Ok(serde_json::to_value(vm.keyed_by_id(b.handle.counters()))
                        .unwrap_or_default()),
                    Call::Send(req) => self.send(&b, &req).map(|_| Value::Null),
                    Call::Boot => Err(ActionError::wrong_state("the VM is already booted")),
                    _ => Ok(Value::Null),
                };
                (State::Running(vm, b), r)
            }
            (s, call) => {
                let name = match &s {
                    State::Created(_) => "Created",
                    _ => "Shutdown",
                };
                let what = match call {
                    Call::Pause => "paused",
                    Call::Resume => "resumed",
                    Call::Shutdown => "shut down",
                    Call::Reboot => "rebooted",
                    Call::PowerButton => "told of a power button press",
                    Call::Snapshot(_) => "snapshotted",
                    Call::Send(_) => "migrated",
                    _ => "asked for its counters",
                };
                let e = ActionError::wrong_state(format!(
                    "the VM is {name}, not booted: it cannot be {what} (vm.boot first)"
                ));
                (s, Err(e))
            }
        }
    }

    /// Moves the running VM to the VMM waiting at the request's URL. The VM ends here once
    /// it runs there, which the main thread hears as for any end.
    fn send(&self, b: &Booted, req: &musubi_api::SendMigration) -> Result<(), ActionError> {
        let Some(m) = &b.migrator else {
            return Err(ActionError::internal(
                "this VM cannot be migrated: its migrator thread did not start",
            ));
        };
        let req = crate::migrate::send_request(req, self.secret_file.as_deref())?;
        m.send(&req)
            .map_err(|e| ActionError::internal(e.to_string()))
    }

    /// The VM booted as `generation` ended by itself: the VMM stays, in state Shutdown.
    fn ended(&mut self, generation: u64) {
        let state = std::mem::replace(&mut self.state, State::Empty);
        self.state = match state {
            State::Running(vm, b) if b.generation == generation => {
                let why = match b.waiter.join() {
                    Ok(report) => ended(&report),
                    Err(_) => json!({"vmm_error": "the VM's thread panicked"}),
                };
                tracing::info!("the VM ended: {why}");
                State::Shutdown(vm, why)
            }
            other => other,
        };
    }
}

/// `vm`'s config with a device added or removed; an id another device has is a conflict
/// (409), any other refused device a bad request (400).
fn reconfigure(vm: &ChVm, call: Call) -> Result<ChVm, ActionError> {
    let changed = match call {
        Call::AddDevice(kind, body) => vm.add_device(kind, &body).map(|(vm, id)| {
            tracing::info!("cold-plugged {} {id}", kind.name());
            vm
        }),
        Call::RemoveDevice(id) => vm.remove_device(&id),
        _ => return Err(ActionError::internal("not a device change")),
    };
    changed.map_err(|e| match e {
        crate::ch_config::ChConfigError::TakenId(_)
        | crate::ch_config::ChConfigError::SecondVsock(_) => ActionError::conflict(e.to_string()),
        e => ActionError::bad_request(e.to_string()),
    })
}

/// How a VM ended, as `vm.info` reports it: the outcome as `--report` writes it.
fn ended(report: &vmm::RunReport) -> Value {
    serde_json::to_value(musubi_types::Outcome::from(&report.outcome)).unwrap_or_default()
}

/// Cloud Hypervisor's VmInfo for `state`, with how a shut-down VM ended under `musubi`.
fn info(state: &State) -> Value {
    let (vm, name, why) = match state {
        State::Empty => return Value::Null,
        State::Created(vm) => (vm, "Created", None),
        State::Running(vm, b) if b.handle.is_paused() => (vm, "Paused", None),
        State::Running(vm, _) => (vm, "Running", None),
        State::Shutdown(vm, why) => (vm, "Shutdown", Some(why)),
    };
    let mut info = vm.vm_info(name);
    if let Some(why) = why {
        info[crate::ch_config::EXTENSION] = json!({ "ended": why });
    }
    info
}

/// Serves the API on `socket` until vmm.shutdown or a stop signal.
pub fn run(
    socket: &std::path::Path,
    seccomp: vmm::seccomp::SeccompMode,
    secret_file: Option<PathBuf>,
) -> ExitCode {
    let signals = match crate::run::stop_signals() {
        Ok(s) => s,
        Err(e) => return crate::fail(e),
    };
    let (tx, rx) = mpsc::channel();
    let forward = std::sync::Arc::new(Forward(Mutex::new(tx.clone())));
    let filter =
        move || vmm::seccomp::apply(vmm::seccomp::ThreadKind::Api, seccomp).map_err(Into::into);
    let server = match musubi_api::ApiServer::start(socket, forward, filter) {
        Ok(s) => s,
        Err(e) => return crate::fail(format!("--api-socket: {e}")),
    };
    let mut signals = signals;
    let signal_handle = signals.handle();
    let signal_tx = tx.clone();
    let signal = Arc::new(AtomicI32::new(0));
    let last_signal = signal.clone();
    let signal_thread = std::thread::spawn(move || {
        for s in signals.forever() {
            if s == signal_hook::consts::SIGUSR1 {
                continue;
            }
            last_signal.store(s, Ordering::Relaxed);
            if signal_tx.send(Msg::Signal(s)).is_err() {
                return;
            }
        }
    });
    let mut vmm = Vmm {
        state: State::Empty,
        opts: vmm::RunOptions {
            capture_serial: false,
            timeout: None,
            seccomp,
            io_poll: vmm::DEFAULT_IO_POLL,
            io_poll_hold: false,
            io_threads: vmm::IoThreadCount::Auto,
        },
        tx,
        generation: 0,
        secret_file,
        signal,
    };
    let mut code = ExitCode::SUCCESS;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Api(Call::ShutdownVmm, reply) => {
                let r = vmm.handle(Call::ShutdownVmm);
                let _ = reply.send(r);
                break;
            }
            Msg::Api(call, reply) => {
                let _ = reply.send(vmm.handle(call));
            }
            Msg::Ended(generation) => vmm.ended(generation),
            Msg::Signal(s) => {
                if let State::Running(_, b) = std::mem::replace(&mut vmm.state, State::Empty) {
                    Vmm::stop(b, vmm::Outcome::Signal(s));
                }
                eprintln!("musubi: stopped by signal {s}");
                code = ExitCode::from(128u8.wrapping_add(s as u8));
                break;
            }
        }
    }
    server.stop();
    signal_handle.close();
    let _ = signal_thread.join();
    code
}
