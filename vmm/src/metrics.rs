//! Exit accounting: how often each vCPU left KVM_RUN, why (down to the port or device
//! register), and how long the VMM took before re-entering. Counts are exact; times are
//! only the VMM's own share, with a log2 histogram so rare slow exits stay visible.
//!
//! Each vCPU writes only its own table, without a lock, and a snapshot can be read from any
//! thread at any time: an exit costs a few plain stores, not a mutex and a map lookup.

pub use musubi_types::{ExitDetail, ExitSummary};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// A device register as the exit accounting names it (see `device_manager::MmioNames`);
/// 0 is an address no device claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MmioTarget(pub u16);

/// Why a vCPU left KVM_RUN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExitReason {
    IoIn(u16),
    IoOut(u16),
    MmioRead(MmioTarget),
    MmioWrite(MmioTarget),
    Shutdown,
    SystemEvent,
    /// KVM_RUN returned for a signal (a kick) rather than for the guest.
    Interrupted,
    FailEntry,
    InternalError,
    Other,
}

const KINDS: [&str; 10] = [
    "io_in",
    "io_out",
    "mmio_read",
    "mmio_write",
    "shutdown",
    "system_event",
    "interrupted",
    "fail_entry",
    "internal_error",
    "other",
];

impl ExitReason {
    /// The reason and its detail packed into a non-zero word (0 marks a free table slot).
    fn key(self) -> u32 {
        let (kind, detail) = match self {
            ExitReason::IoIn(p) => (0, p),
            ExitReason::IoOut(p) => (1, p),
            ExitReason::MmioRead(t) => (2, t.0),
            ExitReason::MmioWrite(t) => (3, t.0),
            ExitReason::Shutdown => (4, 0),
            ExitReason::SystemEvent => (5, 0),
            ExitReason::Interrupted => (6, 0),
            ExitReason::FailEntry => (7, 0),
            ExitReason::InternalError => (8, 0),
            ExitReason::Other => (9, 0),
        };
        ((kind + 1) << 16) | u32::from(detail)
    }

    fn from_key(key: u32) -> Self {
        let detail = (key & 0xffff) as u16;
        match (key >> 16) - 1 {
            0 => ExitReason::IoIn(detail),
            1 => ExitReason::IoOut(detail),
            2 => ExitReason::MmioRead(MmioTarget(detail)),
            3 => ExitReason::MmioWrite(MmioTarget(detail)),
            4 => ExitReason::Shutdown,
            5 => ExitReason::SystemEvent,
            6 => ExitReason::Interrupted,
            7 => ExitReason::FailEntry,
            8 => ExitReason::InternalError,
            _ => ExitReason::Other,
        }
    }

    /// The reason without its detail, for summaries.
    pub fn kind(&self) -> &'static str {
        KINDS[((self.key() >> 16) - 1) as usize]
    }

    /// The port or MMIO target, if the reason has one.
    fn detail(&self, names: &dyn Fn(MmioTarget) -> Arc<str>) -> Option<String> {
        match self {
            ExitReason::IoIn(p) | ExitReason::IoOut(p) => Some(format!("{p:#x}")),
            ExitReason::MmioRead(t) | ExitReason::MmioWrite(t) => Some(names(*t).to_string()),
            _ => None,
        }
    }
}

/// Histogram buckets: bucket `i` counts handling times in `[2^i, 2^(i+1))` ns.
pub const HIST_BUCKETS: usize = 40;

fn bucket(ns: u64) -> usize {
    (63 - ns.max(1).leading_zeros() as usize).min(HIST_BUCKETS - 1)
}

/// One reason's figures, summed.
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
    fn merge(&mut self, o: &ExitStat) {
        self.count += o.count;
        self.vmm_ns += o.vmm_ns;
        for (a, b) in self.hist.iter_mut().zip(o.hist.iter()) {
            *a += b;
        }
    }
}

struct Slot {
    key: u32,
    count: AtomicU64,
    vmm_ns: AtomicU64,
    hist: [AtomicU64; HIST_BUCKETS],
}

impl Slot {
    fn new(key: u32) -> Self {
        Self {
            key,
            count: AtomicU64::new(0),
            vmm_ns: AtomicU64::new(0),
            hist: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Distinct reasons one vCPU can tell apart; a guest that touches more distinct ports or
/// registers than this has the rest counted under `other`.
const SLOTS: usize = 256;

/// Adds `n` to a counter only this thread writes: a plain load and store, no locked
/// instruction, while readers on other threads still see whole values.
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// One vCPU's counters: written by that vCPU's thread alone, read by anyone.
pub struct VcpuMetrics {
    /// Each slot is allocated when its reason first occurs: a guest uses a handful of
    /// reasons, and a table of whole slots (344 bytes each) would cost every vCPU 86 KiB of
    /// written memory before its first exit.
    slots: Box<[OnceLock<Box<Slot>>]>,
    /// Exits other than kicks: tells the VM whether its guest still does anything.
    guest_exits: AtomicU64,
    /// Slots claimed so far.
    used: AtomicUsize,
}

impl Default for VcpuMetrics {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| OnceLock::new()).collect(),
            guest_exits: AtomicU64::new(0),
            used: AtomicUsize::new(0),
        }
    }
}

impl VcpuMetrics {
    /// Counts one exit. Must only be called from the vCPU's own thread.
    pub fn record(&self, reason: ExitReason, vmm_ns: u64) {
        if reason != ExitReason::Interrupted {
            bump(&self.guest_exits, 1);
        }
        let slot = self.slot(reason.key());
        bump(&slot.count, 1);
        bump(&slot.vmm_ns, vmm_ns);
        bump(&slot.hist[bucket(vmm_ns)], 1);
    }

    /// The slot for `key`, claiming a free one on first use (open addressing). With a
    /// single writer no two threads can race for the same free slot. The last free slot is
    /// kept for `other`, so the table never runs out.
    fn slot(&self, key: u32) -> &Slot {
        let other = ExitReason::Other.key();
        let start = (key.wrapping_mul(0x9e37_79b1) >> 24) as usize % SLOTS;
        for i in 0..SLOTS {
            let cell = &self.slots[(start + i) % SLOTS];
            match cell.get() {
                Some(slot) if slot.key == key => return slot,
                Some(_) => {}
                None if key == other || self.used.load(Ordering::Relaxed) < SLOTS - 1 => {
                    self.used
                        .store(self.used.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    return cell.get_or_init(|| Box::new(Slot::new(key)));
                }
                None => break,
            }
        }
        self.slot(other)
    }

    /// Exits so far that the guest caused (kicks excluded).
    pub fn guest_exits(&self) -> u64 {
        self.guest_exits.load(Ordering::Relaxed)
    }

    pub fn snapshot(&self) -> BTreeMap<ExitReason, ExitStat> {
        let mut out = BTreeMap::new();
        for s in self.slots.iter().filter_map(OnceLock::get) {
            let key = s.key;
            let stat = ExitStat {
                count: s.count.load(Ordering::Relaxed),
                vmm_ns: s.vmm_ns.load(Ordering::Relaxed),
                hist: std::array::from_fn(|i| s.hist[i].load(Ordering::Relaxed)),
            };
            out.insert(ExitReason::from_key(key), stat);
        }
        out
    }

    pub fn total(&self) -> u64 {
        self.snapshot().values().map(|s| s.count).sum()
    }
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
            reason: reason.to_string(),
            count,
            vmm_ns,
        })
        .collect();
    out.sort_by_key(|s| std::cmp::Reverse(s.count));
    out
}

fn detail_lines(
    stats: &BTreeMap<ExitReason, ExitStat>,
    names: &dyn Fn(MmioTarget) -> Arc<str>,
) -> Vec<ExitDetail> {
    let mut out: Vec<ExitDetail> = stats
        .iter()
        .map(|(r, s)| ExitDetail {
            reason: r.kind().to_string(),
            detail: r.detail(names),
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

/// Per-vCPU and whole-VM detail, for `--metrics`; `names` names MMIO targets.
pub fn detailed(
    vcpus: &[Arc<VcpuMetrics>],
    names: &dyn Fn(MmioTarget) -> Arc<str>,
) -> (Vec<Vec<ExitDetail>>, Vec<ExitDetail>) {
    let mut all: BTreeMap<ExitReason, ExitStat> = BTreeMap::new();
    let mut per_vcpu = Vec::new();
    for m in vcpus {
        let snap = m.snapshot();
        for (r, s) in &snap {
            all.entry(*r).or_default().merge(s);
        }
        per_vcpu.push(detail_lines(&snap, names));
    }
    (per_vcpu, detail_lines(&all, names))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(t: MmioTarget) -> Arc<str> {
        Arc::from(match t.0 {
            0 => "unclaimed",
            _ => "virtio-blk0:queue_notify",
        })
    }

    #[test]
    fn summary_adds_vcpus_and_sorts() {
        let a = Arc::new(VcpuMetrics::default());
        let b = Arc::new(VcpuMetrics::default());
        a.record(ExitReason::IoOut(0x3f8), 10);
        a.record(ExitReason::IoOut(0x80), 5);
        b.record(ExitReason::IoOut(0x3f8), 1);
        b.record(ExitReason::MmioWrite(MmioTarget(2)), 7);
        b.record(ExitReason::Interrupted, 3);
        let s = summarize(&[a.clone(), b.clone()]);
        assert_eq!(
            s[0],
            ExitSummary {
                reason: "io_out".into(),
                count: 3,
                vmm_ns: 16
            }
        );
        assert_eq!(s.len(), 3);
        assert_eq!(a.total(), 2);
        assert_eq!(b.total(), 3);
        assert_eq!(b.guest_exits(), 2, "kicks are not the guest's exits");

        let (per, all) = detailed(&[a, b], &names);
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
        m.record(ExitReason::Shutdown, 1500);
        m.record(ExitReason::Shutdown, 1600);
        m.record(ExitReason::Shutdown, 70_000);
        let (_, all) = detailed(&[Arc::new(m)], &names);
        assert_eq!(all[0].histogram_ns, vec![(2048, 2), (131072, 1)]);
        assert_eq!(all[0].mean_vmm_ns, 24366);
    }

    #[test]
    fn keys_round_trip() {
        for r in [
            ExitReason::IoIn(0xffff),
            ExitReason::IoOut(0),
            ExitReason::MmioRead(MmioTarget(7)),
            ExitReason::MmioWrite(MmioTarget(0)),
            ExitReason::Shutdown,
            ExitReason::SystemEvent,
            ExitReason::Interrupted,
            ExitReason::FailEntry,
            ExitReason::InternalError,
            ExitReason::Other,
        ] {
            assert_ne!(r.key(), 0);
            assert_eq!(ExitReason::from_key(r.key()), r);
        }
    }

    #[test]
    fn a_port_storm_past_the_table_is_counted_as_other() {
        let m = VcpuMetrics::default();
        for port in 0..2000u16 {
            m.record(ExitReason::IoOut(port), 1);
        }
        let snap = m.snapshot();
        assert_eq!(snap.values().map(|s| s.count).sum::<u64>(), 2000);
        assert!(snap[&ExitReason::Other].count >= 2000 - SLOTS as u64);
        assert_eq!(snap[&ExitReason::IoOut(0)].count, 1);
    }

    #[test]
    fn snapshots_from_another_thread_see_whole_counts() {
        let m = Arc::new(VcpuMetrics::default());
        let writer = {
            let m = m.clone();
            std::thread::spawn(move || {
                for _ in 0..100_000 {
                    m.record(ExitReason::IoOut(0x3f8), 1);
                }
            })
        };
        let mut last = 0;
        while !writer.is_finished() {
            let now = m.total();
            assert!(now >= last, "counts never go back");
            last = now;
        }
        writer.join().unwrap();
        assert_eq!(m.total(), 100_000);
    }
}
