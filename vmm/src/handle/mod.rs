//! A running VM's handle: what any thread (a signal handler's, the API's, a supervisor)
//! may do to a VM while it runs. Its jobs live in their own files: the life cycle here,
//! saving the VM in `persist`, moving vCPUs between the shares of a VM in `vcpus`, the
//! console and the accounting in `console`.

mod console;
mod persist;
mod vcpus;

pub use persist::{
    DirtyLogError, JournalError, PmemLogError, RamReadError, SnapshotReport, StorageError,
};

use crate::config::ExitsMode;
use crate::control::{Outcome, RunControl};
use crate::irq::IrqLine;
use crate::metrics::VcpuMetrics;
use crate::persist::{Clock, Persist, PersistError, VmParts};
use crate::vm::ExtraMetrics;
use crate::vstate::memory::GuestRam;
use crate::vstate::pause::{PauseError, PauseGate};
use crate::vstate::vcpu::kick_signal;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmm_sys_util::signal::Killable;

/// What the VM's threads and its handles share.
pub(crate) struct Shared {
    pub(crate) exits: ExitsMode,
    /// Global id of each vCPU of `metrics`, in order.
    pub(crate) vcpu_ids: Vec<u8>,
    pub(crate) extra_metrics: Option<ExtraMetrics>,
    pub(crate) ram: Arc<GuestRam>,
    pub(crate) control: Arc<RunControl>,
    pub(crate) metrics: Vec<Arc<VcpuMetrics>>,
    pub(crate) irqs: Vec<Arc<dyn IrqLine>>,
    pub(crate) names: Arc<crate::device_manager::MmioNames>,
    pub(crate) ioeventfd_served: Arc<AtomicU64>,
    /// How each I/O thread waited (none when the VM has nothing for one to serve).
    pub(crate) io_stats: Vec<Arc<crate::io_thread::IoThreadStats>>,
    /// The rest is what pause, resume and snapshots need.
    pub(crate) gate: Arc<PauseGate>,
    /// What the VM is saved from.
    pub(crate) parts: VmParts,
    /// The vCPU threads: kicked to pause, taken out to be joined when the VM ends.
    pub(crate) vcpu_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub(crate) io_park: Vec<Arc<vmm_sys_util::eventfd::EventFd>>,
    /// The KVM clock and each vCPU's TSC when the VM paused, set back on resume.
    pub(crate) paused_at: Mutex<Option<PausedAt>>,
    /// The network devices among the transports, in `--net` order.
    pub(crate) nets: Vec<Arc<Mutex<devices::virtio::MmioTransport>>>,
    /// Each disk's write journal, in `--disk` order (see [`VmHandle::start_disk_journals`]).
    pub(crate) journals: Vec<Arc<devices::virtio::WriteJournal>>,
    pub(crate) pmem: Vec<crate::pmem::PmemRegion>,
    pub(crate) saved_config: crate::snapshot::SavedConfig,
    /// The vsock listener's file, if the VM has one here.
    pub(crate) vsock_socket: Option<devices::virtio::SocketFile>,
    /// One pause, resume or snapshot at a time.
    pub(crate) busy: Mutex<()>,
    /// A replica's checkpoint under way (see [`VmHandle::begin_checkpoint`]).
    pub(crate) checkpoint: CheckpointHold,
    /// Pages written since the last look, while a pre-copy migration asks.
    pub(crate) dirty: crate::vstate::dirty::DirtyLog,
    /// Memory-storage pages written since the last look, while a replica asks.
    pub(crate) pmem_dirty: crate::vstate::dirty::PmemDirtyLog,
}

/// A replica's checkpoint keeps the VM paused from its capture until its pages are copied.
/// An operator's pause, resume or snapshot asked meanwhile waits for its end instead of
/// acting on the pause it made: a resume then would let the guest write pages the
/// checkpoint is still copying, and a pause would be refused as already made.
#[derive(Default)]
pub(crate) struct CheckpointHold {
    /// While one is under way: whether it paused the VM (and so resumes it at its end).
    under_way: Mutex<Option<bool>>,
    ended: std::sync::Condvar,
}

/// Longest an operator's call waits for a checkpoint to end before it goes ahead.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(10);

/// What a paused VM's clocks read when it stopped.
pub(crate) struct PausedAt {
    pub(crate) clock: kvm_bindings::kvm_clock_data,
    pub(crate) tscs: Vec<Option<u64>>,
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
    #[error(transparent)]
    Kvm(#[from] crate::vstate::vm::VmError),
    #[error(transparent)]
    Unsynced(#[from] crate::pmem::SyncError),
    #[error("vCPU {0} was not created here")]
    NoSuchVcpu(u8),
    #[error("vCPU {0} does not run here")]
    VcpuNotRunning(u8),
    #[error("vCPU {0} already runs here")]
    VcpuRunning(u8),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("cannot raise the SCI (IRQ {irq}) for the power button: {source}")]
    Sci { irq: u32, source: std::io::Error },
}

impl Shared {
    /// Kicks every vCPU out of KVM_RUN and rings the I/O thread's parking bell.
    fn kick_all(&self) {
        let threads = self.vcpu_threads.lock().unwrap_or_else(|e| e.into_inner());
        for t in threads.iter() {
            let _ = t.kill(kick_signal());
        }
        for bell in &self.io_park {
            let _ = bell.write(1);
        }
    }
}

/// Stops a running VM or reads its accounting from any thread (a signal handler's thread,
/// a supervisor).
#[derive(Clone)]
pub struct VmHandle {
    pub(crate) shared: Arc<Shared>,
}

/// The life cycle: pausing, resuming, ending, and what state the VM is in.
impl VmHandle {
    /// Ends the VM with `outcome` unless it has already ended.
    pub fn stop(&self, outcome: Outcome) {
        self.shared.control.finish(outcome);
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

    /// (device, inode) of the vsock listener's socket file: a migration's destination on
    /// this host finds this file at the path and knows it may take the path over.
    pub fn vsock_listener(&self) -> Option<(u64, u64)> {
        self.shared.vsock_socket.as_ref().and_then(|f| f.id())
    }

    /// Presses the ACPI power button. The guest is told through the SCI if it enabled the
    /// button, and decides itself whether to shut down: a guest that ignores it runs on.
    /// Returns whether the SCI was raised now (not if the button was not enabled, or a
    /// press before this one is not acknowledged yet). A paused VM takes the interrupt when
    /// it resumes.
    pub fn power_button(&self) -> Result<bool, ControlError> {
        let sh = &self.shared;
        if sh.control.is_finished() {
            return Err(ControlError::Ended);
        }
        let pm = &sh.parts.devices().pm;
        let raised = pm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .press_power_button()
            .map_err(|source| ControlError::Sci {
                irq: devices::legacy::SCI_IRQ,
                source,
            })?;
        tracing::info!(sci_raised = raised, "power button pressed");
        Ok(raised)
    }

    /// Stops every vCPU between two instructions and the I/O thread between two requests,
    /// and reads the guest's clocks, so a resume can set them back.
    pub fn pause(&self) -> Result<(), ControlError> {
        let _one = self.busy_after_checkpoint();
        self.pause_locked()
    }

    /// The `busy` lock, taken once no replica's checkpoint is under way (or, if one never
    /// ends, after [`CHECKPOINT_WAIT`]).
    pub(crate) fn busy_after_checkpoint(&self) -> std::sync::MutexGuard<'_, ()> {
        let sh = &self.shared;
        let until = std::time::Instant::now() + CHECKPOINT_WAIT;
        loop {
            let one = sh.busy.lock().unwrap_or_else(|e| e.into_inner());
            let under_way = sh
                .checkpoint
                .under_way
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let left = until.saturating_duration_since(std::time::Instant::now());
            if under_way.is_none() || left.is_zero() {
                return one;
            }
            drop(one);
            let _ = sh.checkpoint.ended.wait_timeout(under_way, left);
        }
    }

    /// A replica's checkpoint: pauses the VM if it runs and returns its state as
    /// [`VmHandle::capture`] does, and keeps it paused for the checkpoint (operators' calls
    /// wait) until [`VmHandle::end_checkpoint`].
    pub fn begin_checkpoint(&self) -> Result<crate::snapshot::VmState, ControlError> {
        let _one = self.busy_after_checkpoint();
        let paused = self.shared.gate.is_paused();
        if !paused {
            self.pause_locked()?;
        }
        match self.capture_locked() {
            Ok(mut state) => {
                state.paused = paused;
                *self
                    .shared
                    .checkpoint
                    .under_way
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(!paused);
                Ok(state)
            }
            Err(e) => {
                if !paused {
                    let _ = self.resume_locked();
                }
                Err(e)
            }
        }
    }

    /// Ends the checkpoint [`VmHandle::begin_checkpoint`] began: resumes the VM if that
    /// paused it, then lets waiting operators' calls go.
    pub fn end_checkpoint(&self) -> Result<(), ControlError> {
        let sh = &self.shared;
        let _one = sh.busy.lock().unwrap_or_else(|e| e.into_inner());
        let mut under_way = sh
            .checkpoint
            .under_way
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let r = match under_way.take() {
            Some(true) => self.resume_locked(),
            _ => Ok(()),
        };
        sh.checkpoint.ended.notify_all();
        r
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
                Err(e.into())
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
        let _one = self.busy_after_checkpoint();
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
}
