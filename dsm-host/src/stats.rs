//! What a node counts while it keeps memory coherent, in a form `--metrics` can print.

use dsm::{Access, PAGE_SIZE};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::memory::{Fault, FaultKind};

/// Faults served by one node. Latency runs from reading the fault to waking the thread.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct FaultStats {
    pub count: u64,
    pub missing: u64,
    pub write_protect: u64,
    pub reads: u64,
    pub writes: u64,
    /// Faults whose thread has been woken.
    pub resolved: u64,
    /// `latency_log2_ns[i]` counts resolutions that took `2^i ..= 2^(i+1)-1` ns.
    pub latency_log2_ns: Vec<u64>,
    /// Size of a guest-physical range in `by_range` (a power of two).
    pub range_bytes: u64,
    /// Faults by guest-physical range, keyed by the range's first address.
    pub by_range: BTreeMap<u64, u64>,
    /// Faults by page, printed as the [`HOT_PAGES`] pages with the most faults: a page
    /// two nodes keep taking from each other stands out here, where `by_range` only says
    /// which megabyte it is in.
    #[serde(rename = "hot_pages", serialize_with = "serialize_hottest")]
    pub by_page: HashMap<u64, PageFaults>,
}

/// How many pages `--metrics` lists in `hot_pages`.
pub const HOT_PAGES: usize = 16;

/// The faults of one guest page.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PageFaults {
    pub reads: u64,
    pub writes: u64,
}

/// One entry of `hot_pages`.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct HotPage {
    /// Guest-physical address of the page.
    pub gpa: u64,
    pub faults: u64,
    pub reads: u64,
    pub writes: u64,
}

fn serialize_hottest<S: serde::Serializer>(
    by_page: &HashMap<u64, PageFaults>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(hottest(by_page, HOT_PAGES))
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
        })
        .collect();
    all.sort_unstable_by(|a, b| b.faults.cmp(&a.faults).then(a.gpa.cmp(&b.gpa)));
    all.truncate(n);
    all
}

impl FaultStats {
    pub fn new(range_bytes: u64) -> FaultStats {
        FaultStats {
            latency_log2_ns: vec![0; 64],
            range_bytes: range_bytes.max(PAGE_SIZE as u64).next_power_of_two(),
            ..FaultStats::default()
        }
    }

    pub fn record_fault(&mut self, f: &Fault) {
        self.count += 1;
        match f.kind {
            FaultKind::Missing => self.missing += 1,
            FaultKind::WriteProtect => self.write_protect += 1,
        }
        let gpa = f.page * PAGE_SIZE as u64;
        let page = self.by_page.entry(gpa).or_default();
        match f.access {
            Access::Read => {
                self.reads += 1;
                page.reads += 1;
            }
            Access::Write => {
                self.writes += 1;
                page.writes += 1;
            }
        }
        *self
            .by_range
            .entry(gpa & !(self.range_bytes - 1))
            .or_default() += 1;
    }

    pub fn record_resolved(&mut self, took: Duration) {
        self.resolved += 1;
        let ns = took.as_nanos().clamp(1, u64::MAX as u128) as u64;
        self.latency_log2_ns[ns.ilog2() as usize] += 1;
    }
}

/// Everything one node's coherence thread counts.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct NodeStats {
    pub node: u16,
    pub faults: FaultStats,
    /// Protocol messages sent, by name (`fetch`, `inv`, `page`, ...).
    pub sent: BTreeMap<String, u64>,
    pub received: BTreeMap<String, u64>,
    /// Control messages (exits, interrupts, stop, heartbeat) received and handed on.
    pub control_received: u64,
    /// Messages a node refused (a misbehaving peer); the node stayed as it was.
    pub protocol_errors: u64,
    pub last_protocol_error: Option<String>,
    /// Pages whose bytes were installed from a peer.
    pub installs: u64,
    /// Faults reported for waiting more than a few seconds: each is a protocol bug, told on
    /// stderr with the node's view of the page.
    pub overdue_faults: u64,
    pub polling: PollStats,
}

/// The waits of the coherence thread while a fault of its node was outstanding
/// ([`crate::poll_window`]).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PollStats {
    /// Something came while the thread polled.
    pub answered: u64,
    /// Nothing came within the window: the thread slept.
    pub slept: u64,
    /// Time spent in those waits before something came or the thread went to sleep.
    pub polled_ns: u64,
}

impl NodeStats {
    pub fn new(node: u16, range_bytes: u64) -> NodeStats {
        NodeStats {
            node,
            faults: FaultStats::new(range_bytes),
            ..NodeStats::default()
        }
    }

    pub fn total_sent(&self) -> u64 {
        self.sent.values().sum()
    }

    pub fn total_received(&self) -> u64 {
        self.received.values().sum()
    }

    pub(crate) fn count(map: &mut BTreeMap<String, u64>, name: &str) {
        *map.entry(name.to_string()).or_default() += 1;
    }

    /// The node's `coherence` section of `--metrics`, the [`HOT_PAGES`] hottest pages
    /// listed (their symbols are the caller's to add).
    pub fn to_metrics(&self) -> musubi_types::Coherence {
        let f = &self.faults;
        musubi_types::Coherence {
            node: self.node,
            faults: musubi_types::FaultStats {
                count: f.count,
                missing: f.missing,
                write_protect: f.write_protect,
                reads: f.reads,
                writes: f.writes,
                resolved: f.resolved,
                latency_log2_ns: f.latency_log2_ns.clone(),
                range_bytes: f.range_bytes,
                by_range: f.by_range.clone(),
                hot_pages: hottest(&f.by_page, HOT_PAGES)
                    .into_iter()
                    .map(|p| musubi_types::HotPage {
                        gpa: p.gpa,
                        faults: p.faults,
                        reads: p.reads,
                        writes: p.writes,
                        symbol: None,
                    })
                    .collect(),
            },
            sent: self.sent.clone(),
            received: self.received.clone(),
            control_received: self.control_received,
            protocol_errors: self.protocol_errors,
            last_protocol_error: self.last_protocol_error.clone(),
            installs: self.installs,
            overdue_faults: self.overdue_faults,
            polling: musubi_types::PollStats {
                answered: self.polling.answered,
                slept: self.polling.slept,
                polled_ns: self.polling.polled_ns,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_section_is_the_stats_own_json() {
        let mut s = NodeStats::new(1, 1 << 20);
        s.faults.count = 3;
        s.faults.by_range.insert(2 << 20, 3);
        s.faults.latency_log2_ns[12] = 3;
        for (gpa, reads, writes) in [(0x1000, 1, 0), (0x2000, 0, 2)] {
            s.faults.by_page.insert(gpa, PageFaults { reads, writes });
        }
        NodeStats::count(&mut s.sent, "fetch");
        s.last_protocol_error = Some("bad page".into());
        s.polling.slept = 4;
        for stats in [s, NodeStats::default()] {
            assert_eq!(
                serde_json::to_value(stats.to_metrics()).unwrap(),
                serde_json::to_value(&stats).unwrap()
            );
        }
    }
}
