//! Runs a built VM: waits for an outcome, then stops every thread and makes the guest's
//! writes durable before the VM is destroyed.
//!
//! The library installs no process-wide signal handlers: the program that embeds it decides
//! what SIGTERM or SIGUSR1 mean and acts through a [`VmHandle`].

use crate::config::VmConfig;
use crate::control::Outcome;
use crate::handle::{Shared, VmHandle};
use crate::idle::IdleCheck;
use crate::io_thread::IoThreads;
use crate::metrics::{summarize, ExitSummary};
use crate::vm::{BuildError, RunOptions, Vm};
use crate::vstate::vcpu::{kick_signal, VcpuStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
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
    pub metrics: musubi_types::Metrics,
    /// Queue notifications that reached the VMM's I/O thread through ioeventfds.
    pub ioeventfd_notifications: u64,
    /// From the start of the build to the BSP's first KVM_RUN.
    pub to_first_run: Option<Duration>,
    /// CLOCK_MONOTONIC at the BSP's first KVM_RUN, comparable across processes, so a parent
    /// can measure from its own spawn of the VMM.
    pub first_run_monotonic_ns: Option<u64>,
    pub wall: Duration,
}

/// The outcome as `--report` writes it; the same JSON as [`Outcome`]'s own `Serialize`.
impl From<&Outcome> for musubi_types::Outcome {
    fn from(o: &Outcome) -> Self {
        use musubi_types::Outcome as Report;
        match o {
            Outcome::GuestStatus(status) => Report::GuestExit { status: *status },
            Outcome::Shutdown => Report::Shutdown,
            Outcome::GuestCrash(m) => Report::GuestCrash { message: m.clone() },
            Outcome::VmmError(e) => Report::VmmError {
                message: e.to_string(),
            },
            Outcome::Signal(signal) => Report::Signal { signal: *signal },
            Outcome::ConsoleQuit => Report::ConsoleQuit,
            Outcome::Peer { node, code } => Report::Peer {
                node: *node,
                status: *code,
            },
            Outcome::NodeLost { node, pages, why } => Report::NodeLost {
                node: *node,
                pages: *pages,
                message: why.clone(),
            },
            Outcome::Migrated { to } => Report::Migrated { to: to.clone() },
        }
    }
}

impl RunReport {
    /// The `--report` file: outcome, exit status, exits by reason and timings.
    pub fn to_report(&self) -> musubi_types::RunReport {
        musubi_types::RunReport {
            outcome: (&self.outcome).into(),
            exit_code: self.outcome.exit_code(),
            exits: self.exits.clone(),
            total_exits: self.total_exits,
            interrupts: self.interrupts,
            to_first_run_ns: self.to_first_run.map(|d| d.as_nanos() as u64),
            first_run_monotonic_ns: self.first_run_monotonic_ns,
            wall_ns: self.wall.as_nanos() as u64,
            node: None,
            coherence: None,
            nodes: None,
        }
    }
}

/// A VM whose vCPUs run.
pub struct RunningVm {
    pub(crate) vm: Vm,
    pub(crate) shared: Arc<Shared>,
    pub(crate) statuses: Vec<Arc<VcpuStatus>>,
    pub(crate) request: Arc<AtomicU64>,
    pub(crate) io_threads: IoThreads,
    pub(crate) first_run: Arc<OnceLock<(Instant, u64)>>,
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
    pub fn metrics(&self) -> musubi_types::Metrics {
        self.shared.read_metrics()
    }

    /// Waits until the VM ends (the guest, a crash, [`VmHandle::stop`], or the timeout),
    /// stops every thread and makes the guest's writes durable.
    pub fn wait(mut self) -> RunReport {
        let started = self.vm.started();
        let deadline = self.vm.timeout().map(|t| started + t);
        let mut idle = IdleCheck::default();
        let mut outcome = self.shared.control.wait(Duration::from_millis(20), || {
            if let Some(refused) = crate::seccomp::refused_call() {
                return Some(Outcome::VmmError(refused));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Some(Outcome::VmmError(format!(
                    "the VM did not finish within {:?}",
                    self.vm.timeout().unwrap_or_default()
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
        let io_left = !self.io_threads.stop_within(STOP_LIMIT);
        let mut flush_errors = Vec::new();
        if vcpus_left.is_empty() && !io_left {
            flush_errors = self.vm.after_stop();
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
        flush_errors.extend(self.vm.sync_pmem());
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
        let metrics = self.shared.read_metrics();
        let first_run = self.first_run.get().copied();
        let report = RunReport {
            metrics,
            ioeventfd_notifications: self.shared.ioeventfd_served.load(Ordering::Relaxed),
            exits: summarize(&self.shared.metrics),
            total_exits: self.shared.metrics.iter().map(|m| m.total()).sum(),
            interrupts: self.vm.interrupts(),
            serial: self.vm.take_serial(),
            to_first_run: first_run.map(|t| t.0.duration_since(started)),
            first_run_monotonic_ns: first_run.map(|t| t.1),
            wall: started.elapsed(),
            outcome,
        };
        self.vm.destroy();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reports_outcome_is_the_outcomes_own_json() {
        for o in [
            Outcome::GuestStatus(3),
            Outcome::Shutdown,
            Outcome::GuestCrash("triple fault".into()),
            Outcome::VmmError("KVM_RUN: EFAULT".into()),
            Outcome::Signal(15),
            Outcome::ConsoleQuit,
            Outcome::Peer { node: 1, code: 3 },
            Outcome::NodeLost {
                node: 2,
                pages: 10,
                why: "link down".into(),
            },
            Outcome::Migrated {
                to: "tcp:127.0.0.1:4000".into(),
            },
        ] {
            let typed = musubi_types::Outcome::from(&o);
            assert_eq!(
                serde_json::to_value(&typed).unwrap(),
                serde_json::to_value(&o).unwrap(),
                "{o:?}"
            );
            assert_eq!(typed.kind(), o.kind());
        }
    }
}
