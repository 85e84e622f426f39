//! Exit accounting: how often each vCPU left KVM_RUN, why, and how long the VMM took
//! before re-entering. Counts are exact; times are only the VMM's own share.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// Exit reasons that reach the VMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitKind {
    IoIn,
    IoOut,
    MmioRead,
    MmioWrite,
    Hlt,
    Shutdown,
    SystemEvent,
    Interrupted,
    Other,
}

impl ExitKind {
    pub const ALL: [ExitKind; 9] = [
        ExitKind::IoIn,
        ExitKind::IoOut,
        ExitKind::MmioRead,
        ExitKind::MmioWrite,
        ExitKind::Hlt,
        ExitKind::Shutdown,
        ExitKind::SystemEvent,
        ExitKind::Interrupted,
        ExitKind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ExitKind::IoIn => "io_in",
            ExitKind::IoOut => "io_out",
            ExitKind::MmioRead => "mmio_read",
            ExitKind::MmioWrite => "mmio_write",
            ExitKind::Hlt => "hlt",
            ExitKind::Shutdown => "shutdown",
            ExitKind::SystemEvent => "system_event",
            ExitKind::Interrupted => "interrupted",
            ExitKind::Other => "other",
        }
    }
}

/// One vCPU's counters; written only by its own thread, read by anyone.
#[derive(Default)]
pub struct VcpuMetrics {
    counts: [AtomicU64; 9],
    vmm_ns: [AtomicU64; 9],
}

impl VcpuMetrics {
    pub fn record(&self, kind: ExitKind, vmm_ns: u64) {
        let i = kind as usize;
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.vmm_ns[i].fetch_add(vmm_ns, Ordering::Relaxed);
    }

    pub fn count(&self, kind: ExitKind) -> u64 {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }

    pub fn vmm_ns(&self, kind: ExitKind) -> u64 {
        self.vmm_ns[kind as usize].load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        ExitKind::ALL.iter().map(|k| self.count(*k)).sum()
    }
}

/// A snapshot of one reason's figures, summed over vCPUs.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ExitSummary {
    pub reason: &'static str,
    pub count: u64,
    pub vmm_ns: u64,
}

/// Sums the per-vCPU counters by reason, largest count first, omitting reasons never seen.
pub fn summarize(vcpus: &[std::sync::Arc<VcpuMetrics>]) -> Vec<ExitSummary> {
    let mut out: Vec<ExitSummary> = ExitKind::ALL
        .iter()
        .map(|k| ExitSummary {
            reason: k.name(),
            count: vcpus.iter().map(|m| m.count(*k)).sum(),
            vmm_ns: vcpus.iter().map(|m| m.vmm_ns(*k)).sum(),
        })
        .filter(|s| s.count > 0)
        .collect();
    out.sort_by_key(|s| std::cmp::Reverse(s.count));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn summary_adds_vcpus_and_sorts() {
        let a = Arc::new(VcpuMetrics::default());
        let b = Arc::new(VcpuMetrics::default());
        a.record(ExitKind::IoOut, 10);
        a.record(ExitKind::IoOut, 5);
        b.record(ExitKind::IoOut, 1);
        b.record(ExitKind::MmioWrite, 7);
        let s = summarize(&[a.clone(), b]);
        assert_eq!(
            s[0],
            ExitSummary {
                reason: "io_out",
                count: 3,
                vmm_ns: 16
            }
        );
        assert_eq!(s[1].count, 1);
        assert_eq!(s.len(), 2);
        assert_eq!(a.total(), 2);
    }
}
