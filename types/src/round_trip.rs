//! Files that `musubi` wrote read into the types and written back to the same JSON: a
//! field the types miss, misname or reshape fails here before a reader meets it.

use crate::{ClusterMetrics, Counters, Metrics, RunReport};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// Reads `text` as `T` and checks `T` writes the very JSON value it was read from.
fn same_json<T: DeserializeOwned + Serialize>(name: &str, text: &str) -> T {
    let read: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let typed: T = serde_json::from_value(read.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let written = serde_json::to_value(&typed).unwrap();
    assert_eq!(written, read, "{name}: written back differently");
    typed
}

#[test]
fn a_probe_runs_report_and_metrics() {
    let r: RunReport = same_json(
        "probe.report.json",
        include_str!("../testdata/probe.report.json"),
    );
    assert_eq!(r.outcome.kind(), "guest_exit");
    assert!(r.total_exits > 0 && r.to_first_run_ns.is_some());
    let m: Metrics = same_json(
        "probe.metrics.json",
        include_str!("../testdata/probe.metrics.json"),
    );
    assert!(!m.exits.is_empty() && !m.vcpus.is_empty());
    assert!(m.exits.iter().any(|e| !e.histogram_ns.is_empty()));
}

#[test]
fn a_running_vms_counters() {
    let c: Counters = same_json("counters.json", include_str!("../testdata/counters.json"));
    assert!(c.vcpus.exits > 0);
    assert!(matches!(
        c.devices.get("virtio-blk0"),
        Some(crate::DeviceCounters::Block(_))
    ));
    assert!(matches!(
        c.devices.get("virtio-net0"),
        Some(crate::DeviceCounters::Net(_))
    ));
    assert!(matches!(
        c.devices.get("virtio-rng0"),
        Some(crate::DeviceCounters::Rng(r)) if r.bytes == 65536
    ));
}

#[test]
fn a_multi_node_runs_report_and_metrics() {
    let r: RunReport = same_json(
        "nodes.report.json",
        include_str!("../testdata/nodes.report.json"),
    );
    let nodes = r.nodes.as_deref().unwrap_or_default();
    assert_eq!(nodes.len(), 2);
    assert!(nodes.iter().flatten().all(|n| n.coherence().is_some()));
    let m: ClusterMetrics = same_json(
        "nodes.metrics.json",
        include_str!("../testdata/nodes.metrics.json"),
    );
    let node = m.nodes[1].as_ref().and_then(|n| n.node.as_ref()).unwrap();
    let coherence = node.coherence.as_ref().unwrap();
    assert!(coherence.faults.count > 0 && !coherence.faults.by_range.is_empty());
}

#[test]
fn restored_and_migrated_ram_sections() {
    let m: Metrics = same_json(
        "ondemand.metrics.json",
        include_str!("../testdata/ondemand.metrics.json"),
    );
    assert!(m.demand_paging.is_some_and(|d| d.faults > 0));
    let m: Metrics = same_json(
        "migrated.metrics.json",
        include_str!("../testdata/migrated.metrics.json"),
    );
    assert!(m.migration.is_some_and(|m| m.all_held));
    let r: RunReport = same_json(
        "source.report.json",
        include_str!("../testdata/source.report.json"),
    );
    assert_eq!(r.outcome.kind(), "migrated");
}

#[test]
fn every_outcome_keeps_its_shape() {
    for text in [
        r#"{"kind":"guest_exit","status":3}"#,
        r#"{"kind":"shutdown"}"#,
        r#"{"kind":"guest_crash","message":"triple fault"}"#,
        r#"{"kind":"vmm_error","message":"KVM_RUN: EFAULT"}"#,
        r#"{"kind":"signal","signal":15}"#,
        r#"{"kind":"console_quit"}"#,
        r#"{"kind":"peer","node":1,"status":3}"#,
        r#"{"kind":"node_lost","node":2,"pages":10,"message":"link down"}"#,
        r#"{"kind":"migrated","to":"tcp:127.0.0.1:4000"}"#,
    ] {
        let o: crate::Outcome = same_json(text, text);
        assert_eq!(text, o.to_string());
    }
}
