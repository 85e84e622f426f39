//! Starting a built VM: its I/O thread and one thread per vCPU, and the handle they share.

use super::Vm;
use crate::handle::{PausedAt, Shared};
use crate::io_thread::{IoThreads, Lane, Polling};
use crate::persist::{Clock, Persist, PersistError, VmParts};
use crate::running::RunningVm;
use crate::vm::BuildError;
use crate::vstate::pause::PauseGate;
use crate::vstate::vcpu::{VcpuContext, VcpuStatus};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

impl Vm {
    /// Starts the I/O threads (doorbells on the kernel exit path, device events on either)
    /// and one thread per vCPU.
    pub fn start(mut self) -> Result<RunningVm, BuildError> {
        if self.awaits_state {
            return Err(PersistError::NoStateApplied.into());
        }
        self.devices
            .take_over_sockets()
            .map_err(crate::device_manager::DeviceError::from)?;
        let notifiers = std::mem::take(&mut self.devices.notifiers);
        let device_events = std::mem::take(&mut self.devices.device_events);
        // Device event sources (a TAP) need the threads on either exit path: only doorbells
        // move to the vCPU threads on the user path.
        let threads = self
            .opts
            .io_threads
            .threads(Lane::wanted(&notifiers, &device_events), self.vcpus.len());
        let lanes = Lane::deal(notifiers, device_events, threads);
        let gate = Arc::new(PauseGate::new(self.vcpus.len(), lanes.len()));
        for (i, v) in self.vcpus.iter().enumerate() {
            if self.standby.contains(&v.id) {
                gate.set_standby(i, true);
            }
        }
        let io_threads = IoThreads::start(
            lanes,
            self.control.clone(),
            self.opts.seccomp,
            gate.clone(),
            Polling::new(self.opts.io_poll, self.opts.io_poll_hold),
        )
        .map_err(|source| BuildError::Thread {
            what: "virtio I/O",
            source,
        })?;
        let shared = Arc::new(Shared {
            exits: self.exits,
            vcpu_ids: self.vcpus.iter().map(|v| v.id).collect(),
            extra_metrics: self.extra_metrics.clone(),
            ram: self.ram.clone(),
            control: self.control.clone(),
            metrics: self.vcpus.iter().map(|_| Arc::default()).collect(),
            irqs: self.devices.irqs.clone(),
            names: self.devices.mmio_names.clone(),
            ioeventfd_served: io_threads.served_counter(),
            io_stats: io_threads.stats(),
            gate: gate.clone(),
            parts: VmParts::new(
                self.kvm.shared_fd(),
                self.kvm.kvm_arc(),
                self.devices.device_set(),
                &self.layout,
            ),
            vcpu_threads: Mutex::new(Vec::new()),
            io_park: io_threads.park_bells(),
            paused_at: Mutex::new(None),
            nets: self.devices.nets.clone(),
            journals: self.devices.journals.clone(),
            pmem: self.pmem.regions.clone(),
            saved_config: self.saved_config.clone(),
            vsock_socket: self.devices.vsock_socket.clone(),
            busy: Mutex::new(()),
            checkpoint: Default::default(),
            dirty: crate::vstate::dirty::DirtyLog::new(
                self.kvm.shared_fd(),
                self.ram.clone(),
                self.kvm.ram_slots().to_vec(),
            ),
            pmem_dirty: crate::vstate::dirty::PmemDirtyLog::new(
                self.kvm.shared_fd(),
                &self.pmem.regions,
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
            io_threads,
            first_run,
        })
    }
}
