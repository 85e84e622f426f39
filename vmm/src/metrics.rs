//! Exit accounting: how often each vCPU left KVM_RUN, why (down to the port or device
//! register), and how long the VMM took before re-entering. Counts are exact; times are
//! only the VMM's own share, with a log2 histogram so rare slow exits stay visible.

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Why a vCPU left KVM_RUN.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExitReason {
    IoIn(u16),
    IoOut(u16),
    /// An MMIO access to the named target (`device:register` or `unclaimed`).
    MmioRead(Arc<str>),
    MmioWrite(Arc<str>),
    Hlt,
    Shutdown,
    SystemEvent,
    /// KVM_RUN returned for a signal (a kick) rather than for the guest.
    Interrupted,
    FailEntry,
    InternalError,
    Other,
}

impl ExitReason {
    /// The reason without its detail, for summaries.
    pub fn kind(&self) -> &'static str {
        match self {
            ExitReason::IoIn(_) => "io_in",
            ExitReason::IoOut(_) => "io_out",
            ExitReason::MmioRead(_) => "mmio_read",
            ExitReason::MmioWrite(_) => "mmio_write",
            ExitReason::Hlt => "hlt",
            ExitReason::Shutdown => "shutdown",
            ExitReason::SystemEvent => "system_event",
            ExitReason::Interrupted => "interrupted",
            ExitReason::FailEntry => "fail_entry",
            ExitReason::InternalError => "internal_error",
            ExitReason::Other => "other",
        }
    }

    /// The port or MMIO target, if the reason has one.
    pub fn detail(&self) -> Option<String> {
        match self {
            ExitReason::IoIn(p) | ExitReason::IoOut(p) => Some(format!("{p:#x}")),
            ExitReason::MmioRead(t) | ExitReason::MmioWrite(t) => Some(t.to_string()),
            _ => None,
        }
    }
}

/// Histogram buckets: bucket `i` counts handling times in `[2^i, 2^(i+1))` ns.
pub const HIST_BUCKETS: usize = 40;

#[derive(Clone, Debug)]
pub struct ExitStat {
    pub count: u64,
    pub vmm_ns: u64,
    pub hist: [u64; HIST_BUCKETS],
}

impl Default for ExitStat {
    fn default() -> Self {
        Self {
            count: 0,
            vmm_ns: 0,
            hist: [0; HIST_BUCKETS],
        }
    }
}

impl ExitStat {
    fn add(&mut self, ns: u64) {
        self.count += 1;
        self.vmm_ns += ns;
        self.hist[bucket(ns)] += 1;
    }

    fn merge(&mut self, o: &ExitStat) {
        self.count += o.count;
        self.vmm_ns += o.vmm_ns;
        for (a, b) in self.hist.iter_mut().zip(o.hist.iter()) {
            *a += b;
        }
    }
}

fn bucket(ns: u64) -> usize {
    (63 - ns.max(1).leading_zeros() as usize).min(HIST_BUCKETS - 1)
}

/// One vCPU's counters. Only its own thread writes them, so the lock is uncontended except
/// while a snapshot is taken.
#[derive(Default)]
pub struct VcpuMetrics {
    stats: Mutex<BTreeMap<ExitReason, ExitStat>>,
}

impl VcpuMetrics {
    pub fn record(&self, reason: ExitReason, vmm_ns: u64) {
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default()
            .add(vmm_ns);
    }

    pub fn snapshot(&self) -> BTreeMap<ExitReason, ExitStat> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn total(&self) -> u64 {
        self.snapshot().values().map(|s| s.count).sum()
    }
}

/// A snapshot of one reason's figures, summed over vCPUs.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ExitSummary {
    pub reason: &'static str,
    pub count: u64,
    pub vmm_ns: u64,
}

/// Sums the per-vCPU counters by reason kind, largest count first.
pub fn summarize(vcpus: &[Arc<VcpuMetrics>]) -> Vec<ExitSummary> {
    let mut by_kind: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    for m in vcpus {
        for (r, s) in m.snapshot() {
            let e = by_kind.entry(r.kind()).or_default();
            e.0 += s.count;
            e.1 += s.vmm_ns;
        }
    }
    let mut out: Vec<ExitSummary> = by_kind
        .into_iter()
        .map(|(reason, (count, vmm_ns))| ExitSummary {
            reason,
            count,
            vmm_ns,
        })
        .collect();
    out.sort_by_key(|s| std::cmp::Reverse(s.count));
    out
}

/// One line of the detailed accounting.
#[derive(Clone, Debug, Serialize)]
pub struct ExitDetail {
    pub reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub count: u64,
    pub vmm_ns: u64,
    pub mean_vmm_ns: u64,
    /// Non-empty log2 buckets as (upper bound in ns, count).
    pub histogram_ns: Vec<(u64, u64)>,
}

fn detail_lines(stats: &BTreeMap<ExitReason, ExitStat>) -> Vec<ExitDetail> {
    let mut out: Vec<ExitDetail> = stats
        .iter()
        .map(|(r, s)| ExitDetail {
            reason: r.kind(),
            detail: r.detail(),
            count: s.count,
            vmm_ns: s.vmm_ns,
            mean_vmm_ns: s.vmm_ns / s.count.max(1),
            histogram_ns: s
                .hist
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(i, c)| (1u64 << (i + 1), *c))
                .collect(),
        })
        .collect();
    out.sort_by_key(|d| std::cmp::Reverse(d.count));
    out
}

/// Per-vCPU and whole-VM detail, for `--metrics`.
pub fn detailed(vcpus: &[Arc<VcpuMetrics>]) -> (Vec<Vec<ExitDetail>>, Vec<ExitDetail>) {
    let mut all: BTreeMap<ExitReason, ExitStat> = BTreeMap::new();
    let mut per_vcpu = Vec::new();
    for m in vcpus {
        let snap = m.snapshot();
        for (r, s) in &snap {
            all.entry(r.clone()).or_default().merge(s);
        }
        per_vcpu.push(detail_lines(&snap));
    }
    (per_vcpu, detail_lines(&all))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_adds_vcpus_and_sorts() {
        let a = Arc::new(VcpuMetrics::default());
        let b = Arc::new(VcpuMetrics::default());
        a.record(ExitReason::IoOut(0x3f8), 10);
        a.record(ExitReason::IoOut(0x80), 5);
        b.record(ExitReason::IoOut(0x3f8), 1);
        b.record(
            ExitReason::MmioWrite(Arc::from("virtio-blk0:queue_notify")),
            7,
        );
        let s = summarize(&[a.clone(), b.clone()]);
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

        let (per, all) = detailed(&[a, b]);
        assert_eq!(per.len(), 2);
        let com1 = all
            .iter()
            .find(|d| d.detail.as_deref() == Some("0x3f8"))
            .unwrap();
        assert_eq!((com1.count, com1.vmm_ns), (2, 11));
        let notify = all.iter().find(|d| d.reason == "mmio_write").unwrap();
        assert_eq!(notify.detail.as_deref(), Some("virtio-blk0:queue_notify"));
    }

    #[test]
    fn histogram_buckets_are_log2() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 0);
        assert_eq!(bucket(2), 1);
        assert_eq!(bucket(1023), 9);
        assert_eq!(bucket(1024), 10);
        assert_eq!(bucket(u64::MAX), HIST_BUCKETS - 1);
        let m = VcpuMetrics::default();
        m.record(ExitReason::Hlt, 1500);
        m.record(ExitReason::Hlt, 1600);
        m.record(ExitReason::Hlt, 70_000);
        let (_, all) = detailed(&[Arc::new(m)]);
        assert_eq!(all[0].histogram_ns, vec![(2048, 2), (131072, 1)]);
        assert_eq!(all[0].mean_vmm_ns, 24366);
    }
}
