//! Finds a guest that can never run again, which KVM's in-kernel LAPIC never reports.

use crate::control::Outcome;
use crate::metrics::VcpuMetrics;
use crate::vstate::vcpu::{kick_signal, VcpuState, VcpuStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm_sys_util::signal::Killable;

/// How long the guest must cause no exit before the VM asks its vCPUs whether they are
/// halted for good.
const IDLE_CHECK_AFTER: Duration = Duration::from_millis(1000);

/// Finds a guest that can never run again: every vCPU halted with interrupts disabled (or
/// still waiting for a start-up IPI nobody will send). With the in-kernel LAPIC such a vCPU
/// sleeps inside KVM_RUN and no exit ever tells the VMM, so after a quiet spell the vCPUs
/// are kicked and each reports its state.
#[derive(Default)]
pub(crate) struct IdleCheck {
    last_exits: u64,
    quiet_since: Option<Instant>,
    asked: Option<u64>,
}

impl IdleCheck {
    pub(crate) fn poll(
        &mut self,
        metrics: &[Arc<VcpuMetrics>],
        statuses: &[Arc<VcpuStatus>],
        request: &AtomicU64,
        threads: &[std::thread::JoinHandle<()>],
    ) -> Option<Outcome> {
        let exits: u64 = metrics.iter().map(|m| m.guest_exits()).sum();
        let now = Instant::now();
        if exits != self.last_exits {
            self.last_exits = exits;
            self.quiet_since = Some(now);
            self.asked = None;
            return None;
        }
        let quiet_since = *self.quiet_since.get_or_insert(now);
        if let Some(req) = self.asked {
            let answers: Option<Vec<VcpuState>> = statuses.iter().map(|s| s.get(req)).collect();
            let answers = answers?;
            self.asked = None;
            self.quiet_since = Some(now);
            let halted = answers.iter().enumerate().find_map(|(i, s)| match s {
                VcpuState::HaltedForGood { rip } => Some((i, *rip)),
                _ => None,
            });
            let all_stuck = answers.iter().all(|s| {
                matches!(
                    s,
                    VcpuState::HaltedForGood { .. } | VcpuState::WaitingForStartup
                )
            });
            return match halted {
                Some((i, rip)) if all_stuck => Some(Outcome::GuestCrash(format!(
                    "every vCPU is halted with interrupts disabled and nothing can wake it (vCPU {i} at RIP {rip:#x})"
                ))),
                _ => None,
            };
        }
        if now.duration_since(quiet_since) >= IDLE_CHECK_AFTER {
            // Requests are tagged with 8 bits and 0 means "never answered".
            let mut req = request.load(Ordering::Relaxed) + 1;
            if req & 0xff == 0 {
                req += 1;
            }
            request.store(req, Ordering::Release);
            self.asked = Some(req);
            for t in threads {
                let _ = t.kill(kick_signal());
            }
        }
        None
    }
}
