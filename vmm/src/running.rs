//! Runs a built VM: starts its I/O and vCPU threads, waits for an outcome, then stops every
//! thread and makes the guest's writes durable before the VM is destroyed.
//!
//! The library installs no process-wide signal handlers: the program that embeds it decides
//! what SIGTERM or SIGUSR1 mean and acts through a [`VmHandle`].

use crate::builder::{BuildError, ExtraMetrics, RunOptions, Vm};
use crate::config::{ExitsMode, VmConfig};
use crate::control::{Outcome, RunControl};
use crate::idle::IdleCheck;
use crate::io_thread::IoThread;
use crate::irq::IrqLine;
use crate::metrics::{detailed, summarize, ExitSummary, VcpuMetrics};
use crate::persist::{Clock, Persist, PersistError, VmParts};
use crate::vstate::memory::GuestRam;
use crate::vstate::pause::{PauseError, PauseGate};
use crate::vstate::vcpu::{kick_signal, VcpuContext, VcpuStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use vmm_sys_util::signal::Killable;

/// What happened during one VM run.
#[derive(Debug)]
pub struct RunReport {
    pub outcome: Outcome,
    pub exits: Vec<ExitSummary>,
    pub total_exits: u64,
    pub interrupts: u64,
    pub serial: Vec<u8>,
    /// The full exit accounting (per vCPU, per port and device register, histograms).
    pub metrics: serde_json::Value,
    /// Queue notifications that reached the VMM's I/O thread through ioeventfds.
    pub ioeventfd_notifications: u64,
    /// From the start of the build to the BSP's first KVM_RUN.
    pub to_first_run: Option<Duration>,
    /// CLOCK_MONOTONIC at the BSP's first KVM_RUN, comparable across processes, so a parent
    /// can measure from its own spawn of the VMM.
    pub first_run_monotonic_ns: Option<u64>,
    pub wall: Duration,
}

/// A network device's counters, as `--metrics` and `vm.counters` give them.
fn net_json(t: &devices::virtio::MmioTransport) -> serde_json::Value {
    let c = t.net_counters().unwrap_or_default();
    serde_json::json!({
        "rx_packets": c.rx_packets,
        "rx_bytes": c.rx_bytes,
        "rx_drops": c.rx_drops,
        "rx_notifications": c.rx_notifications,
        "rx_throttled": c.rx_throttled,
        "tx_packets": c.tx_packets,
        "tx_bytes": c.tx_bytes,
        "tx_drops": c.tx_drops,
        "tx_notifications": c.tx_notifications,
        "tx_throttled": c.tx_throttled,
        "interrupts": t.stats().interrupts,
    })
}

/// What the VM's threads and its handles share.
struct Shared {
    exits: ExitsMode,
    /// Global id of each vCPU of `metrics`, in order.
    vcpu_ids: Vec<u8>,
    extra_metrics: Option<ExtraMetrics>,
    ram: Arc<GuestRam>,
    control: Arc<RunControl>,
    metrics: Vec<Arc<VcpuMetrics>>,
    irqs: Vec<Arc<dyn IrqLine>>,
    names: Arc<crate::device_manager::MmioNames>,
    ioeventfd_served: Arc<AtomicU64>,
    /// The rest is what pause, resume and snapshots need.
    gate: Arc<PauseGate>,
    /// What the VM is saved from.
    parts: VmParts,
    /// The vCPU threads: kicked to pause, taken out to be joined when the VM ends.
    vcpu_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    io_park: Option<Arc<vmm_sys_util::eventfd::EventFd>>,
    /// The KVM clock and each vCPU's TSC when the VM paused, set back on resume.
    paused_at: Mutex<Option<PausedAt>>,
    /// The network devices among the transports, in `--net` order.
    nets: Vec<Arc<Mutex<devices::virtio::MmioTransport>>>,
    pmem: Vec<crate::pmem::PmemRegion>,
    saved_config: crate::snapshot::SavedConfig,
    /// One pause, resume or snapshot at a time.
    busy: Mutex<()>,
    /// Pages written since the last look, while a pre-copy migration asks.
    dirty: crate::vstate::dirty::DirtyLog,
}

/// What a paused VM's clocks read when it stopped.
struct PausedAt {
    clock: kvm_bindings::kvm_clock_data,
    tscs: Vec<Option<u64>>,
}

/// Why a pause, resume or snapshot was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("the VM is already paused")]
    AlreadyPaused,
    #[error("the VM is not paused")]
    NotPaused,
    #[error("the VM has ended")]
    Ended,
    #[error(transparent)]
    Pause(#[from] PauseError),
    #[error("{0}")]
    Kvm(String),
    #[error("{0}")]
    Vcpu(String),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Persist(#[from] PersistError),
}

/// What taking a snapshot did.
#[derive(Clone, Debug)]
pub struct SnapshotReport {
    pub dir: std::path::PathBuf,
    pub ram: crate::snapshot::RamWritten,
    /// From the request to the last byte durable.
    pub took: Duration,
}

impl Shared {
    /// Kicks every vCPU out of KVM_RUN and rings the I/O thread's parking bell.
    fn kick_all(&self) {
        let threads = self.vcpu_threads.lock().unwrap_or_else(|e| e.into_inner());
        for t in threads.iter() {
            let _ = t.kill(kick_signal());
        }
        if let Some(bell) = &self.io_park {
            let _ = bell.write(1);
        }
    }

    fn metrics_json(&self) -> serde_json::Value {
        let names = |t| self.names.name(t);
        let (per_vcpu, all) = detailed(&self.metrics, &names);
        let notify_exits: u64 = all
            .iter()
            .filter(|d| {
                d.detail
                    .as_deref()
                    .is_some_and(|n| n.ends_with(":queue_notify"))
            })
            .map(|d| d.count)
            .sum();
        let mut irq_paths = serde_json::Map::new();
        for irq in &self.irqs {
            let e = irq_paths.entry(irq.path()).or_insert(serde_json::json!(0));
            *e = serde_json::json!(e.as_u64().unwrap_or(0) + irq.count());
        }
        let mut json = serde_json::json!({
            "exits_mode": self.exits.to_string(),
            "total_exits": all.iter().map(|d| d.count).sum::<u64>(),
            "exits": all,
            "vcpus": per_vcpu.into_iter().zip(&self.vcpu_ids).map(|(e, id)| serde_json::json!({"id": id, "exits": e})).collect::<Vec<_>>(),
            "notifications": {
                "mmio_exit": notify_exits,
                "ioeventfd": self.ioeventfd_served.load(Ordering::Relaxed),
            },
            "interrupts": irq_paths,
            "net": self.nets.iter().map(|t| net_json(&t.lock().unwrap_or_else(|e| e.into_inner()))).collect::<Vec<_>>(),
            "memory": {
                "backend": self.ram.backend(),
                "vcpu_threads": self.ram.vcpu_threads(),
            },
        });
        if let (Some(extra), Some(obj)) = (&self.extra_metrics, json.as_object_mut()) {
            if let serde_json::Value::Object(more) = extra() {
                obj.extend(more);
            }
        }
        json
    }
}

/// A VM whose vCPUs run.
pub struct RunningVm {
    vm: Vm,
    shared: Arc<Shared>,
    statuses: Vec<Arc<VcpuStatus>>,
    request: Arc<AtomicU64>,
    io_thread: Option<IoThread>,
    first_run: Arc<OnceLock<(Instant, u64)>>,
}

/// Stops a running VM or reads its accounting from any thread (a signal handler's thread,
/// a supervisor).
#[derive(Clone)]
pub struct VmHandle {
    shared: Arc<Shared>,
}

impl VmHandle {
    /// Ends the VM with `outcome` unless it has already ended.
    pub fn stop(&self, outcome: Outcome) {
        self.shared.control.finish(outcome);
    }

    /// The exit accounting so far, as `--metrics` writes it.
    pub fn metrics(&self) -> serde_json::Value {
        self.shared.metrics_json()
    }

    /// Device counters as Cloud Hypervisor's `vm.counters` gives them: device name to
    /// counter name to value, with the vCPUs' exits as one more "device".
    pub fn counters(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        let total: u64 = self.shared.metrics.iter().map(|m| m.total()).sum();
        out.insert("vcpus".into(), serde_json::json!({ "exits": total }));
        let (mut blk, mut other, mut net) = (0u32, 0u32, 0u32);
        for t in &self.shared.parts.devices().transports {
            let t = t.lock().unwrap_or_else(|e| e.into_inner());
            let s = t.stats();
            if t.net_counters().is_some() {
                out.insert(format!("virtio-net{net}"), net_json(&t));
                net += 1;
                continue;
            }
            let name = match t.device_type() {
                2 => {
                    blk += 1;
                    format!("virtio-blk{}", blk - 1)
                }
                _ => {
                    other += 1;
                    format!("virtio-pmem{}", other - 1)
                }
            };
            out.insert(
                name,
                serde_json::json!({
                    "requests": s.requests,
                    "read_bytes": s.bytes_read,
                    "write_bytes": s.bytes_written,
                    "flushes": s.flushes,
                    "errors": s.errors,
                    "interrupts": s.interrupts,
                }),
            );
        }
        serde_json::Value::Object(out)
    }

    /// Whether the VM is paused now.
    pub fn is_paused(&self) -> bool {
        self.shared.gate.is_paused()
    }

    /// Whether the VM has ended.
    pub fn has_ended(&self) -> bool {
        self.shared.control.is_finished()
    }

    /// The configuration the VM was built with, as a snapshot records it.
    pub fn config(&self) -> &crate::snapshot::SavedConfig {
        &self.shared.saved_config
    }

    /// Stops every vCPU between two instructions and the I/O thread between two requests,
    /// and reads the guest's clocks, so a resume can set them back.
    pub fn pause(&self) -> Result<(), ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.pause_locked()
    }

    fn pause_locked(&self) -> Result<(), ControlError> {
        let sh = &self.shared;
        if sh.control.is_finished() {
            return Err(ControlError::Ended);
        }
        if sh.gate.is_paused() {
            return Err(ControlError::AlreadyPaused);
        }
        sh.gate
            .pause(&sh.control, Duration::from_secs(10), || sh.kick_all())?;
        let clock = Clock(sh.parts.vm_fd()).save(&());
        let tscs = sh.gate.on_each_vcpu(&sh.control, |_, v| v.tsc().ok());
        match (clock, tscs) {
            (Ok(clock), Ok(tscs)) => {
                *sh.paused_at.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(PausedAt { clock, tscs });
                Ok(())
            }
            (Err(e), _) => {
                sh.gate.resume();
                Err(ControlError::Kvm(e.to_string()))
            }
            (_, Err(e)) => {
                sh.gate.resume();
                Err(e.into())
            }
        }
    }

    /// Lets a paused VM go on. The KVM clock and every TSC are set back to what they read
    /// at the pause, so the guest sees no time pass while it was stopped.
    pub fn resume(&self) -> Result<(), ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.resume_locked()
    }

    fn resume_locked(&self) -> Result<(), ControlError> {
        let sh = &self.shared;
        if sh.control.is_finished() {
            return Err(ControlError::Ended);
        }
        if !sh.gate.is_paused() {
            return Err(ControlError::NotPaused);
        }
        let at = sh
            .paused_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(at) = at {
            let tscs = Arc::new(at.tscs);
            let set = sh.gate.on_each_vcpu(&sh.control, {
                let tscs = tscs.clone();
                move |i, v| match tscs.get(i).copied().flatten() {
                    Some(t) => v.set_tsc(t).map_err(|e| e.to_string()),
                    None => Ok(()),
                }
            });
            if let Ok(results) = set {
                for e in results.into_iter().filter_map(Result::err) {
                    tracing::warn!("resume: the guest's TSC may jump: {e}");
                }
            }
            if let Err(e) = Clock(sh.parts.vm_fd()).restore(&at.clock) {
                tracing::warn!("resume: the guest's KVM clock may jump: {e}");
            }
        }
        sh.gate.resume();
        Ok(())
    }

    /// The local index of vCPU `id` (its APIC id), if this process created it.
    fn vcpu_index(&self, id: u8) -> Result<usize, ControlError> {
        self.shared
            .vcpu_ids
            .iter()
            .position(|&v| v == id)
            .ok_or_else(|| ControlError::Vcpu(format!("vCPU {id} was not created here")))
    }

    /// Takes vCPU `id` out of this process's run, for another share of the VM to run it: the
    /// VM is paused for the moment it takes to read the vCPU's state, then goes on without
    /// it, the vCPU standing by. A VM paused before stays paused.
    pub fn release_vcpu(&self, id: u8) -> Result<crate::persist::VcpuState, ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared;
        let index = self.vcpu_index(id)?;
        if sh.gate.is_standby(index) {
            return Err(ControlError::Vcpu(format!("vCPU {id} does not run here")));
        }
        // Asked of KVM before the pause, so its failure leaves the VM running.
        let msr_list = sh.parts.msr_list()?;
        let was_paused = sh.gate.is_paused();
        if !was_paused {
            self.pause_locked()?;
        }
        let saved = sh
            .gate
            .on_vcpu(index, &sh.control, move |v| v.save(&msr_list));
        let result = match saved {
            Ok(Ok(state)) => {
                sh.gate.set_standby(index, true);
                Ok(state)
            }
            Ok(Err(e)) => Err(PersistError::from(e).into()),
            Err(e) => Err(e.into()),
        };
        if !was_paused {
            self.resume_locked()?;
        }
        result
    }

    /// Runs vCPU `state.id`, standing by here, from `state` (as [`VmHandle::release_vcpu`]
    /// read it elsewhere): its registers, interrupt controller, MSRs and time stamp counter
    /// go on from there.
    pub fn adopt_vcpu(&self, state: crate::persist::VcpuState) -> Result<(), ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared;
        let id = state.id;
        let index = self.vcpu_index(id)?;
        if !sh.gate.is_standby(index) {
            return Err(ControlError::Vcpu(format!("vCPU {id} already runs here")));
        }
        sh.gate
            .on_vcpu(index, &sh.control, move |v| v.restore(&state))?
            .map_err(PersistError::from)?;
        sh.gate.set_standby(index, false);
        Ok(())
    }

    /// The vCPUs (global ids) running in this process, not standing by.
    pub fn running_vcpus(&self) -> Vec<u8> {
        let sh = &self.shared;
        sh.vcpu_ids
            .iter()
            .enumerate()
            .filter(|(i, _)| !sh.gate.is_standby(*i))
            .map(|(_, &id)| id)
            .collect()
    }

    /// Everything of the VM but its RAM and files, as a snapshot saves it: the VM is paused
    /// first if it runs, and left paused. A migration sends this.
    pub fn capture(&self) -> Result<crate::snapshot::VmState, ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let paused = self.shared.gate.is_paused();
        if !paused {
            self.pause_locked()?;
        }
        let mut state = self.capture_locked()?;
        state.paused = paused;
        Ok(state)
    }

    fn capture_locked(&self) -> Result<crate::snapshot::VmState, ControlError> {
        let sh = &self.shared;
        let clock = sh
            .paused_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|p| p.clock)
            .ok_or(ControlError::NotPaused)?;
        Ok(sh.parts.save(&sh.gate, &sh.control, &clock)?)
    }

    /// Makes everything the guest wrote to its disks and memory-storage files durable in the
    /// files, as the teardown does; for a paused VM whose storage another process is about
    /// to open.
    pub fn flush_storage(&self) -> Result<(), String> {
        let mut errors = Vec::new();
        for t in &self.shared.parts.devices().transports {
            if let Err(e) = t.lock().unwrap_or_else(|e| e.into_inner()).flush() {
                errors.push(format!("a virtio device's flush failed: {e}"));
            }
        }
        errors.extend(crate::pmem::sync_regions(&self.shared.pmem));
        match errors.is_empty() {
            true => Ok(()),
            false => Err(format!(
                "guest writes may not be on disk: {}",
                errors.join("; ")
            )),
        }
    }

    /// Guest RAM's ranges: (guest-physical start, length).
    pub fn ram_ranges(&self) -> Vec<(u64, u64)> {
        self.shared.parts.ram_ranges().to_vec()
    }

    /// Copies guest RAM at `gpa` into `buf` (a page server reads a paused VM's pages so).
    pub fn read_ram(&self, gpa: u64, buf: &mut [u8]) -> Result<(), String> {
        use vm_memory::Bytes;
        self.shared
            .ram
            .memory()
            .read_slice(buf, vm_memory::GuestAddress(gpa))
            .map_err(|e| format!("guest RAM at {gpa:#x}: {e}"))
    }

    /// Guest-physical addresses of every page that may hold data; all others are zeros.
    pub fn pages_with_data(&self) -> std::io::Result<Vec<u64>> {
        crate::snapshot::pages_that_may_hold_data(&self.shared.ram)
    }

    /// Starts tracking the guest RAM pages written, by the guest or by the VMM, for a
    /// pre-copy migration's rounds; [`VmHandle::dirty_pages`] then reports them.
    pub fn start_dirty_log(&self) -> Result<(), String> {
        self.shared.dirty.start()
    }

    /// Guest-physical addresses of the RAM pages written since tracking started or since
    /// the last call.
    pub fn dirty_pages(&self) -> Result<Vec<u64>, String> {
        self.shared.dirty.take()
    }

    /// Stops the tracking [`VmHandle::start_dirty_log`] started.
    pub fn stop_dirty_log(&self) -> Result<(), String> {
        self.shared.dirty.stop()
    }

    /// Writes a snapshot of the VM to `dir` (created if missing; files in it replaced). The
    /// VM is paused first if it runs, and left paused.
    pub fn snapshot(&self, dir: &std::path::Path) -> Result<SnapshotReport, ControlError> {
        use crate::snapshot::{self, SnapshotError};
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        let sh = &self.shared;
        if !sh.gate.is_paused() {
            self.pause_locked()?;
        }
        let io = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| SnapshotError::Io { path, source }
        };
        snapshot::create_dir(dir)?;
        // An older snapshot's state goes first, so a failure below leaves no directory
        // that looks whole.
        match std::fs::remove_file(dir.join(snapshot::STATE_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(SnapshotError::Io {
                    path: dir.join(snapshot::STATE_FILE),
                    source: e,
                }
                .into())
            }
            _ => {}
        }
        let state = self.capture_locked()?;
        // Memory storage is referenced, so its pages must be in the files now.
        let unsynced = crate::pmem::sync_regions(&sh.pmem);
        if let Some(e) = unsynced.first() {
            return Err(ControlError::Kvm(e.clone()));
        }
        let mem_path = dir.join(snapshot::MEMORY_FILE);
        let ram = snapshot::write_ram(&sh.ram, &mem_path).map_err(io(&mem_path))?;
        snapshot::write_config(dir, &sh.saved_config)?;
        snapshot::write_state(dir, &state)?;
        Ok(SnapshotReport {
            dir: dir.to_path_buf(),
            ram,
            took: started.elapsed(),
        })
    }

    /// Types `bytes` into COM1 as if they came down the serial line, raising its receive
    /// interrupt. Returns how many were taken: fewer than offered (maybe 0) while the UART's
    /// 64-byte receive FIFO is full. A UART has no way to stall its sender without losing
    /// data, so the caller keeps the rest and offers it again later; this never waits, so
    /// it cannot hold up a vCPU. Bytes offered after the VM ended are taken and ignored.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        if self.shared.control.is_finished() {
            return bytes.len();
        }
        self.shared
            .parts
            .devices()
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_input(bytes)
    }
}

impl Vm {
    /// Starts the I/O thread (kernel exit path) and one thread per vCPU.
    pub fn start(mut self) -> Result<RunningVm, BuildError> {
        if self.awaits_state {
            return Err(PersistError::NoStateApplied.into());
        }
        let notifiers = std::mem::take(&mut self.devices.notifiers);
        let device_events = std::mem::take(&mut self.devices.device_events);
        // Device event sources (a TAP) need the thread on either exit path: only doorbells
        // move to the vCPU threads on the user path.
        let needs_io = !notifiers.is_empty() || !device_events.is_empty();
        let gate = Arc::new(PauseGate::new(self.vcpus.len(), needs_io));
        for (i, v) in self.vcpus.iter().enumerate() {
            if self.standby.contains(&v.id) {
                gate.set_standby(i, true);
            }
        }
        let io_thread = if !needs_io {
            None
        } else {
            Some(
                IoThread::start(
                    notifiers,
                    device_events,
                    self.control.clone(),
                    self.opts.seccomp,
                    gate.clone(),
                )
                .map_err(|source| BuildError::Thread {
                    what: "virtio I/O",
                    source,
                })?,
            )
        };
        let shared = Arc::new(Shared {
            exits: self.exits,
            vcpu_ids: self.vcpus.iter().map(|v| v.id).collect(),
            extra_metrics: self.extra_metrics.clone(),
            ram: self.ram.clone(),
            control: self.control.clone(),
            metrics: self.vcpus.iter().map(|_| Arc::default()).collect(),
            irqs: self.devices.irqs.clone(),
            names: self.devices.mmio_names.clone(),
            ioeventfd_served: io_thread
                .as_ref()
                .map(|t| t.served_counter())
                .unwrap_or_default(),
            gate: gate.clone(),
            parts: VmParts::new(
                self.kvm.shared_fd(),
                self.kvm.kvm_arc(),
                self.devices.device_set(),
                &self.layout,
            ),
            vcpu_threads: Mutex::new(Vec::new()),
            io_park: io_thread.as_ref().map(|t| t.park_bell()),
            paused_at: Mutex::new(None),
            nets: self.devices.nets.clone(),
            pmem: self.pmem.regions.clone(),
            saved_config: self.saved_config.clone(),
            busy: Mutex::new(()),
            dirty: crate::vstate::dirty::DirtyLog::new(
                self.kvm.shared_fd(),
                self.ram.clone(),
                self.kvm.ram_slots().to_vec(),
            ),
        });
        // A restored VM's clock goes on from the value it was saved with.
        if let Some(clock) = &self.start_clock {
            Clock(self.kvm.fd()).restore(clock)?;
        }
        // A VM that arrives paused stays so until resumed, and then goes on from that clock.
        if self.start_paused {
            gate.pause_at_start();
            if let Some(clock) = self.start_clock {
                *shared.paused_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(PausedAt {
                    clock,
                    tscs: vec![None; self.vcpus.len()],
                });
            }
        }
        let first_run: Arc<OnceLock<(Instant, u64)>> = Arc::default();
        let request = Arc::new(AtomicU64::new(0));
        let statuses: Vec<Arc<VcpuStatus>> = self.vcpus.iter().map(|_| Arc::default()).collect();
        let mut threads = Vec::new();
        // The BSP has its entry state; APs wait for INIT/SIPI in the kernel. A vCPU whose
        // set-up failed ends the VM with the reason as soon as it is told to run.
        for (index, ((vcpu, metrics), status)) in std::mem::take(&mut self.vcpus)
            .into_iter()
            .zip(&shared.metrics)
            .zip(&statuses)
            .enumerate()
        {
            threads.push(vcpu.run(VcpuContext {
                pause: gate.clone(),
                index,
                bus: self.bus.clone(),
                control: self.control.clone(),
                metrics: metrics.clone(),
                status: status.clone(),
                request: request.clone(),
                ram: self.ram.clone(),
                first_run: first_run.clone(),
            }));
        }
        *shared
            .vcpu_threads
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = threads;
        Ok(RunningVm {
            vm: self,
            shared,
            statuses,
            request,
            io_thread,
            first_run,
        })
    }
}

impl RunningVm {
    pub fn handle(&self) -> VmHandle {
        VmHandle {
            shared: self.shared.clone(),
        }
    }

    /// Ends the VM with `outcome` unless it has already ended.
    pub fn stop(&self, outcome: Outcome) {
        self.shared.control.finish(outcome);
    }

    /// The exit accounting so far.
    pub fn metrics(&self) -> serde_json::Value {
        self.shared.metrics_json()
    }

    /// Waits until the VM ends (the guest, a crash, [`VmHandle::stop`], or the timeout),
    /// stops every thread and makes the guest's writes durable.
    pub fn wait(mut self) -> RunReport {
        let started = self.vm.started;
        let deadline = self.vm.opts.timeout.map(|t| started + t);
        let mut idle = IdleCheck::default();
        let mut outcome = self.shared.control.wait(Duration::from_millis(20), || {
            if let Some(refused) = crate::seccomp::refused_call() {
                return Some(Outcome::VmmError(refused));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Some(Outcome::VmmError(format!(
                    "the VM did not finish within {:?}",
                    self.vm.opts.timeout.unwrap_or_default()
                )));
            }
            if self.shared.gate.is_paused() {
                // Parked vCPUs answer no questions: nothing can be judged idle while paused.
                idle = IdleCheck::default();
                return None;
            }
            idle.poll(
                &self.shared.metrics,
                &self.statuses,
                &self.request,
                &self
                    .shared
                    .vcpu_threads
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            )
        });

        // Stop every vCPU, then make the guest's writes durable. No pause may kick the
        // threads once they are being joined; a parked one sees the VM has ended.
        let threads = std::mem::take(
            &mut *self
                .shared
                .vcpu_threads
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        self.shared.gate.resume();
        let vcpus_left = stop_vcpus(threads, &self.shared.vcpu_ids);
        let io_left = match self.io_thread.as_mut() {
            Some(t) => !t.stop_within(STOP_LIMIT),
            None => false,
        };
        let mut flush_errors = Vec::new();
        if vcpus_left.is_empty() && !io_left {
            if let Some(f) = self.vm.on_stopped.take() {
                f();
            }
            flush_errors = self.vm.devices.flush();
        } else {
            // Threads that wait on guest memory which will never come are not woken with
            // pages they never had: they are left to end with the process, and what they
            // may hold (a device's lock) is not waited for.
            let mut left: Vec<String> = vcpus_left.iter().map(|id| format!("vCPU {id}")).collect();
            if io_left {
                left.push("the virtio I/O thread".into());
                flush_errors.push("the disks were not synced: the I/O thread did not stop".into());
            }
            let why = format!(
                "{} did not stop within {STOP_LIMIT:?} (waiting on guest memory that never came)",
                left.join(" and ")
            );
            tracing::error!("{why}");
            outcome = match outcome {
                Outcome::VmmError(e) => Outcome::VmmError(format!("{e}; {why}")),
                _ => Outcome::VmmError(why),
            };
        }
        flush_errors.extend(self.vm.pmem.sync());
        if !flush_errors.is_empty() {
            let why = format!(
                "guest writes may not be on disk: {}",
                flush_errors.join("; ")
            );
            outcome = match outcome {
                Outcome::VmmError(e) if !vcpus_left.is_empty() || io_left => {
                    Outcome::VmmError(format!("{e}; {why}"))
                }
                _ => Outcome::VmmError(why),
            };
        }
        let metrics = self.shared.metrics_json();
        let first_run = self.first_run.get().copied();
        let report = RunReport {
            metrics,
            ioeventfd_notifications: self.shared.ioeventfd_served.load(Ordering::Relaxed),
            exits: summarize(&self.shared.metrics),
            total_exits: self.shared.metrics.iter().map(|m| m.total()).sum(),
            interrupts: self.vm.devices.interrupts(),
            serial: self
                .vm
                .capture
                .as_ref()
                .map(|c| std::mem::take(&mut *c.lock().unwrap_or_else(|e| e.into_inner())))
                .unwrap_or_default(),
            to_first_run: first_run.map(|t| t.0.duration_since(started)),
            first_run_monotonic_ns: first_run.map(|t| t.1),
            wall: started.elapsed(),
            outcome,
        };
        let Vm {
            kvm,
            devices,
            mem,
            ram,
            ..
        } = self.vm;
        drop(devices);
        // The VM fd goes before the memory it maps.
        drop(kvm);
        drop(mem);
        drop(ram);
        report
    }
}

/// How long the teardown waits for a thread it asked to stop.
const STOP_LIMIT: Duration = Duration::from_secs(5);

/// Kicks every vCPU thread out of KVM_RUN and waits for it to return, kicking again every
/// 100 ms, for at most [`STOP_LIMIT`] in all. The kick sets `immediate_exit`, so it is not
/// lost even when it lands just before a thread re-enters the guest; the VM's control is
/// already finished, so no thread goes back in. A thread that waits in the kernel on guest
/// memory that will never come (a post-copy migration whose source was lost) cannot
/// return: it is left, and the ids of those left (`ids`, in thread order) are returned.
fn stop_vcpus(handles: Vec<std::thread::JoinHandle<()>>, ids: &[u8]) -> Vec<u8> {
    let deadline = Instant::now() + STOP_LIMIT;
    let mut left = Vec::new();
    for (k, h) in handles.into_iter().enumerate() {
        let mut kicked: Option<Instant> = None;
        while !h.is_finished() && Instant::now() < deadline {
            if kicked.is_none_or(|t| t.elapsed() >= Duration::from_millis(100)) {
                let _ = h.kill(kick_signal());
                kicked = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if h.is_finished() {
            let _ = h.join();
        } else {
            left.push(ids.get(k).copied().unwrap_or(k as u8));
        }
    }
    left
}

/// Builds, starts and waits for the VM described by `config`.
pub fn run_vm(config: &VmConfig, opts: &RunOptions) -> Result<RunReport, BuildError> {
    Ok(Vm::build(config, opts)?.start()?.wait())
}
