//! The JSON that crosses process boundaries, typed once: `musubi run --report` and
//! `--metrics` files and the API's `vm.counters` answer. The VMM builds these values and
//! its readers (the benchmarks, the tests) read them back through
//! the same structs, so a renamed or reshaped field is a compile error on both sides
//! instead of a `null` one side reads.
//!
//! Field names and shapes are those the files have always had; users and scripts read
//! them, so a change here is a change of the file format.

/// `Display` as the JSON text, compact or pretty with `{:#}` as `serde_json::Value`
/// prints, so messages that showed the JSON show the same text.
macro_rules! display_json {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let text = if f.alternate() {
                    serde_json::to_string_pretty(self)
                } else {
                    serde_json::to_string(self)
                };
                f.write_str(&text.map_err(|_| std::fmt::Error)?)
            }
        }
    )*};
}

pub mod counters;
pub mod metrics;
pub mod report;

pub use counters::{BlockCounters, Counters, DeviceCounters, VcpuCounters};
pub use metrics::{
    ClusterMetrics, Coherence, DemandPaging, ExitDetail, FaultStats, HotPage, Interrupts,
    IoThreadCounters, MemoryUse, Metrics, MigrationPaging, NetCounters, NodeMetrics, Notifications,
    PollStats, ReplicationMetrics, ReplicationPolicy, ReplicationState, RngCounters, VcpuExits,
};
pub use report::{ExitSummary, Outcome, RunReport};

/// Reads a present `null` as `Some(None)`, so a field that is sometimes missing and
/// sometimes `null` (`Option<Option<T>>`, skipped when `None`) writes back as it was read.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

#[cfg(test)]
mod round_trip;
