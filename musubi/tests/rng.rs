//! The entropy device end to end (`musubi run --rng`): the probe guest's `rng` task reads
//! from it on both exit paths with the system-call filters on, a rate limit shows in the
//! counters, and a bad `--rng` is refused by name.

mod common;
use common::*;
use musubi_types::{Counters, DeviceCounters, Metrics, RngCounters};
use std::path::Path;
use std::time::{Duration, Instant};

/// Every run here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(120);

fn metrics_in(path: &Path, run: &Run) -> Metrics {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", path.display(), run.explain()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("metrics JSON is invalid: {e}\n{text}"))
}

fn entropy(v: &serde_json::Value) -> f64 {
    v["entropy_bits_per_byte"]
        .as_f64()
        .unwrap_or_else(|| panic!("no entropy in {v}"))
}

#[test]
fn the_probe_reads_64k_of_good_entropy_on_both_exit_paths() {
    for mode in ["kernel", "user"] {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.json");
        // --seccomp defaults to true: getrandom(2) must be allowed on whichever thread serves
        // the doorbell (the I/O thread, or the vCPU on the user path).
        let r = run_probe(
            "rng=64K",
            &[
                "--rng",
                "--exits",
                mode,
                "--metrics",
                metrics.to_str().unwrap(),
            ],
        );
        assert_eq!(r.code, Some(0), "--exits {mode}: {}", r.explain());
        let v = r.result("rng");
        assert_eq!(v["ok"], true, "{v}");
        assert_eq!(v["bytes"], 65536, "{v}");
        assert!(entropy(&v) > 7.5, "--exits {mode}: {v}");
        assert!(entropy(&v) <= 8.0, "--exits {mode}: {v}");
        let m = metrics_in(&metrics, &r);
        let c = m.rng.unwrap_or_else(|| panic!("no rng counters: {m:#}"));
        assert_eq!(c.bytes, 65536, "{c:?}");
        assert_eq!((c.errors, c.throttled), (0, 0), "{c:?}");
        assert_eq!(c.requests, v["requests"].as_u64().unwrap(), "{c:?} {v}");
    }
}

#[test]
fn without_rng_the_task_fails_and_the_metrics_have_no_rng() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.json");
    let r = run_probe("rng=1K", &["--metrics", metrics.to_str().unwrap()]);
    assert_eq!(r.code, Some(8), "{}", r.explain());
    let v = r.result("rng");
    assert_eq!(
        (&v["ok"], &v["error"]),
        (&false.into(), &"no-device".into())
    );
    assert!(metrics_in(&metrics, &r).rng.is_none());
}

#[test]
fn a_rate_limited_device_paces_the_guest_and_counts_it_in_vm_counters() {
    // 4 KiB a second, 16 KiB read: each request gets at most the bucket, the first at
    // once and the other three a second apart, so vm.counters has three seconds to show
    // the device holding requests back.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let serial = dir.path().join("console.out");
    let metrics = dir.path().join("metrics.json");
    let started = Instant::now();
    let vm = start_probe_with_api(
        "rng=16K",
        &socket,
        &serial,
        &[
            "--rng",
            "bytes_per_sec=4096",
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    let guard = KillOnPanic::new(&vm);
    let mut seen: Option<RngCounters> = None;
    let done = || read_text(&serial).contains("{\"probe\":\"rng\"");
    let throttled = wait_until(LIMIT, || {
        if done() {
            return true;
        }
        if !socket.exists() {
            return false;
        }
        let r = remote(&socket, &["counters"]);
        if r.code != Some(0) {
            return false;
        }
        let c: Counters = serde_json::from_str(&r.stdout).unwrap();
        match c.devices.get("virtio-rng0") {
            Some(DeviceCounters::Rng(r)) => {
                seen = Some(*r);
                r.throttled > 0
            }
            other => panic!("virtio-rng0 in vm.counters: {other:?}\n{c:#}"),
        }
    });
    assert!(
        throttled,
        "neither throttling nor the task's end seen: {seen:?}"
    );
    assert!(
        seen.is_some_and(|c| c.throttled > 0),
        "the task ended before vm.counters showed throttling: {seen:?}\n{}",
        read_text(&serial)
    );
    guard.defuse();
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let v = result_in(&read_text(&serial), "rng");
    assert_eq!(
        (&v["ok"], &v["bytes"]),
        (&true.into(), &16384.into()),
        "{v}"
    );
    assert!(v["requests"].as_u64().unwrap() >= 4, "{v}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "16 KiB at 4 KiB a second took {:?}",
        started.elapsed()
    );
    let c = metrics_in(&metrics, &run).rng.unwrap();
    assert!(c.throttled > 0 && c.bytes == 16384, "{c:?}");
}

#[test]
fn a_bad_rng_value_is_refused_naming_flag_and_value() {
    for (value, why) in [
        ("bytes_per_sec=fast", "is not a positive whole number"),
        ("bytes_per_sec=0", "would never serve a byte"),
        ("src=/dev/urandom", "unknown key \"src\""),
    ] {
        let r = run_with_limit(&["run", "--kernel", "probe", "--rng", value], LIMIT);
        assert_eq!(r.code, Some(2), "{value}: {}", r.explain());
        assert!(
            r.stderr.contains(&format!("--rng {value:?}: ")) && r.stderr.contains(why),
            "{value}: {}",
            r.explain()
        );
    }
}
