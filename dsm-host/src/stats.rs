//! What a node counts while it keeps memory coherent: the `coherence` section of
//! `--metrics` as `musubi-types` defines it, and the per-page faults its `hot_pages` are
//! picked from.

use dsm::{Access, PAGE_SIZE};
use musubi_types::HotPage;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::memory::{Fault, FaultKind};

/// Everything one node's coherence thread counts, as `--metrics` prints it.
pub type NodeStats = musubi_types::Coherence;

/// How many pages `--metrics` lists in `hot_pages`.
pub const HOT_PAGES: usize = 16;

/// The faults of one guest page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageFaults {
    pub reads: u64,
    pub writes: u64,
}

/// The `n` pages with the most faults, most first (lower address first among equals).
pub fn hottest(by_page: &HashMap<u64, PageFaults>, n: usize) -> Vec<HotPage> {
    let mut all: Vec<HotPage> = by_page
        .iter()
        .map(|(&gpa, p)| HotPage {
            gpa,
            faults: p.reads + p.writes,
            reads: p.reads,
            writes: p.writes,
            symbol: None,
        })
        .collect();
    all.sort_unstable_by(|a, b| b.faults.cmp(&a.faults).then(a.gpa.cmp(&b.gpa)));
    all.truncate(n);
    all
}

/// A node's counters as its coherence thread keeps them. Every page's faults are kept, not
/// only the hottest: a page two nodes keep taking from each other stands out in
/// `hot_pages`, where `by_range` only says which megabyte it is in, and which pages are the
/// hottest is only known when the counters are read.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// All but `faults.hot_pages`, which [`Tally::stats`] fills.
    pub(crate) counts: NodeStats,
    by_page: HashMap<u64, PageFaults>,
}

impl Tally {
    pub(crate) fn new(node: u16, range_bytes: u64) -> Tally {
        let mut counts = NodeStats {
            node,
            ..NodeStats::default()
        };
        counts.faults.latency_log2_ns = vec![0; 64];
        counts.faults.range_bytes = range_bytes.max(PAGE_SIZE as u64).next_power_of_two();
        Tally {
            counts,
            by_page: HashMap::new(),
        }
    }

    /// The counters so far, the [`HOT_PAGES`] hottest pages listed (their symbols are the
    /// caller's to add).
    pub(crate) fn stats(&self) -> NodeStats {
        let mut s = self.counts.clone();
        s.faults.hot_pages = hottest(&self.by_page, HOT_PAGES);
        s
    }

    pub(crate) fn record_fault(&mut self, f: &Fault) {
        let faults = &mut self.counts.faults;
        faults.count += 1;
        match f.kind {
            FaultKind::Missing => faults.missing += 1,
            FaultKind::WriteProtect => faults.write_protect += 1,
        }
        let gpa = f.page * PAGE_SIZE as u64;
        let page = self.by_page.entry(gpa).or_default();
        match f.access {
            Access::Read => {
                faults.reads += 1;
                page.reads += 1;
            }
            Access::Write => {
                faults.writes += 1;
                page.writes += 1;
            }
        }
        *faults
            .by_range
            .entry(gpa & !(faults.range_bytes - 1))
            .or_default() += 1;
    }

    /// A fault's thread woken `took` after its fault was read.
    pub(crate) fn record_resolved(&mut self, took: Duration) {
        let faults = &mut self.counts.faults;
        faults.resolved += 1;
        let ns = took.as_nanos().clamp(1, u64::MAX as u128) as u64;
        faults.latency_log2_ns[ns.ilog2() as usize] += 1;
    }
}

/// Counts one more message called `name` in `map` (`sent` or `received`).
pub(crate) fn count(map: &mut BTreeMap<String, u64>, name: &str) {
    *map.entry(name.to_string()).or_default() += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(page: u64, kind: FaultKind, access: Access) -> Fault {
        Fault {
            page,
            addr: 0,
            kind,
            access,
            thread: 1,
        }
    }

    #[test]
    fn faults_are_counted_by_kind_access_range_and_page() {
        let mut t = Tally::new(1, 1 << 20);
        t.record_fault(&fault(1, FaultKind::Missing, Access::Read));
        t.record_fault(&fault(2, FaultKind::Missing, Access::Write));
        t.record_fault(&fault(2, FaultKind::WriteProtect, Access::Write));
        t.record_fault(&fault(0x300, FaultKind::Missing, Access::Read));
        t.record_resolved(Duration::from_nanos(5000));
        count(&mut t.counts.sent, "fetch");
        count(&mut t.counts.sent, "fetch");
        let s = t.stats();
        assert_eq!(s.node, 1);
        let f = &s.faults;
        assert_eq!((f.count, f.missing, f.write_protect), (4, 3, 1));
        assert_eq!((f.reads, f.writes, f.resolved), (2, 2, 1));
        assert_eq!(f.latency_log2_ns[12], 1);
        assert_eq!(
            f.by_range,
            BTreeMap::from([(0, 3), (0x300 * PAGE_SIZE as u64, 1)])
        );
        let hot: Vec<_> = f.hot_pages.iter().map(|p| (p.gpa, p.faults)).collect();
        assert_eq!(hot, [(0x2000, 2), (0x1000, 1), (0x300_000, 1)]);
        assert_eq!(s.sent_of(&["fetch"]), 2);
    }

    #[test]
    fn only_the_hottest_pages_are_listed() {
        let mut t = Tally::new(0, 0);
        assert_eq!(t.counts.faults.range_bytes, PAGE_SIZE as u64);
        for page in 0..HOT_PAGES as u64 + 4 {
            for _ in 0..=page {
                t.record_fault(&fault(page, FaultKind::Missing, Access::Read));
            }
        }
        let hot = t.stats().faults.hot_pages;
        assert_eq!(hot.len(), HOT_PAGES);
        assert_eq!(hot[0].gpa, (HOT_PAGES as u64 + 3) * PAGE_SIZE as u64);
        assert!(hot.windows(2).all(|w| w[0].faults > w[1].faults));
        assert!(t.counts.faults.hot_pages.is_empty());
    }
}
