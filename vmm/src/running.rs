//! Runs a built VM: starts its I/O and vCPU threads, waits for an outcome, then stops every
//! thread and makes the guest's writes durable before the VM is destroyed.
//!
//! The library installs no process-wide signal handlers: the program that embeds it decides
//! what SIGTERM or SIGUSR1 mean and acts through a [`VmHandle`].

use crate::builder::{BuildError, ExtraMetrics, RunOptions, Vm, Vmm};
use crate::config::{ExitsMode, VmConfig};
use crate::control::{Outcome, RunControl};
use crate::idle::IdleCheck;
use crate::io_thread::IoThread;
use crate::irq::IrqLine;
use crate::metrics::{detailed, summarize, ExitSummary, VcpuMetrics};
use crate::vstate::memory::GuestRam;
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
    serial: Arc<Mutex<devices::legacy::Serial>>,
}

impl Shared {
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
    threads: Vec<std::thread::JoinHandle<()>>,
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
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_input(bytes)
    }
}

impl Vm {
    /// Starts the I/O thread (kernel exit path) and one thread per vCPU.
    pub fn start(mut self) -> Result<RunningVm, BuildError> {
        let notifiers = std::mem::take(&mut self.devices.notifiers);
        let io_thread = if notifiers.is_empty() {
            None
        } else {
            Some(
                IoThread::start(notifiers, self.control.clone(), self.opts.seccomp).map_err(
                    |source| BuildError::Thread {
                        what: "virtio I/O",
                        source,
                    },
                )?,
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
            serial: self.devices.serial.clone(),
        });
        let first_run: Arc<OnceLock<(Instant, u64)>> = Arc::default();
        let request = Arc::new(AtomicU64::new(0));
        let statuses: Vec<Arc<VcpuStatus>> = self.vcpus.iter().map(|_| Arc::default()).collect();
        let mut threads = Vec::new();
        // The BSP has its entry state; APs wait for INIT/SIPI in the kernel. A vCPU whose
        // set-up failed ends the VM with the reason as soon as it is told to run.
        for ((vcpu, metrics), status) in std::mem::take(&mut self.vcpus)
            .into_iter()
            .zip(&shared.metrics)
            .zip(&statuses)
        {
            threads.push(vcpu.run(VcpuContext {
                bus: self.bus.clone(),
                control: self.control.clone(),
                metrics: metrics.clone(),
                status: status.clone(),
                request: request.clone(),
                ram: self.ram.clone(),
                first_run: first_run.clone(),
            }));
        }
        Ok(RunningVm {
            vm: self,
            shared,
            threads,
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
            idle.poll(
                &self.shared.metrics,
                &self.statuses,
                &self.request,
                &self.threads,
            )
        });

        // Stop every vCPU, then make the guest's writes durable.
        stop_vcpus(std::mem::take(&mut self.threads));
        if let Some(t) = self.io_thread.as_mut() {
            t.stop();
        }
        if let Some(f) = self.vm.on_stopped.take() {
            f();
        }
        let mut flush_errors = self.vm.devices.flush();
        flush_errors.extend(self.vm.pmem.sync());
        if !flush_errors.is_empty() {
            outcome = Outcome::VmmError(format!(
                "guest writes may not be on disk: {}",
                flush_errors.join("; ")
            ));
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

/// Kicks every vCPU thread out of KVM_RUN once and waits for it to return. The kick sets
/// `immediate_exit`, so it is not lost even when it lands just before a thread re-enters
/// the guest; the VM's control is already finished, so no thread goes back in.
fn stop_vcpus(handles: Vec<std::thread::JoinHandle<()>>) {
    for h in &handles {
        let _ = h.kill(kick_signal());
    }
    for h in handles {
        let _ = h.join();
    }
}

/// Builds, starts and waits for the VM described by `config`.
pub fn run_vm(config: &VmConfig, opts: &RunOptions) -> Result<RunReport, BuildError> {
    Ok(Vmm::build(config, opts)?.start()?.wait())
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
