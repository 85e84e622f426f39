//! The probe guest's multiprocessor tasks on one host (no paravirtual leaf, so IPIs go
//! through the LAPIC): every CPU comes up, runs user code, shares memory, and a task's user
//! code can be moved to an AP (`cpu=K`).

mod common;
use common::*;
use serde_json::Value;
use std::time::Duration;

/// Each VM here finishes in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(90);

/// Runs `tasks` on `cpus` vCPUs, every user task bounded to 30 s in the guest.
fn smp_run(tasks: &str, cpus: u32, flags: &[&str]) -> Run {
    let tasks = format!("{tasks} probe.task_timeout=30");
    let cpus = cpus.to_string();
    let mut all = vec!["--cpus", cpus.as_str(), "--memory", "128M"];
    all.extend_from_slice(flags);
    let args = probe_args(&tasks, &all);
    run_with_limit(&args, LIMIT)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn hello_sees_every_cpu_on_node_zero_without_the_paravirtual_leaf() {
    for cpus in [2, 3] {
        let r = smp_run("hello", cpus, &[]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        let h = r.result("hello");
        assert_eq!(u(&h["cpus"]), cpus as u64, "{}", r.explain());
        assert_eq!(u(&h["nodes"]), 1, "{}", r.explain());
        assert_eq!(h["pv_ipi"], false, "{}", r.explain());
        assert!(h["memory_bytes"].as_u64().is_some(), "{}", r.explain());
        let nodes: Vec<u64> = h["cpu_nodes"].as_array().unwrap().iter().map(u).collect();
        assert_eq!(nodes, vec![0; cpus as usize], "{}", r.explain());
    }
}

#[test]
fn hello_is_printed_by_the_cpu_asked_for() {
    let r = smp_run("hello,cpu=2", 3, &[]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let h = r.result("hello");
    assert_eq!(u(&h["cpu"]), 2, "{}", r.explain());
    assert_eq!(u(&h["cpus"]), 3, "{}", r.explain());
}

#[test]
fn shared_counter_is_exact_on_every_cpu() {
    for cpus in [2, 3] {
        let r = smp_run("shared-counter=20000", cpus, &[]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        assert_counter_exact(
            &r.result("shared-counter"),
            cpus as u64,
            20000,
            &r.explain(),
        );
    }
}

#[test]
fn fib_procs_runs_every_task_round_robin_and_options_attach_to_their_task() {
    let r = smp_run("fib=20,procs=5,hello", 3, &[]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let f = r.result("fib");
    assert_eq!(f["ok"], true, "{}", r.explain());
    assert_eq!(u(&f["procs"]), 5, "{}", r.explain());
    assert_eq!(u(&f["cpus"]), 3, "{}", r.explain());
    assert!(u(&f["wall_ns"]) > 0, "{}", r.explain());
    let tasks = f["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 5, "{}", r.explain());
    for (i, t) in tasks.iter().enumerate() {
        assert_eq!(u(&t["task"]), i as u64, "{}", r.explain());
        assert_eq!(u(&t["cpu"]), i as u64 % 3, "{}", r.explain());
        assert_eq!(u(&t["result"]), 6765, "{}", r.explain());
        assert!(t["cycles"].as_u64().is_some(), "{}", r.explain());
    }
    // `procs=5` belonged to fib: hello still ran as a task of its own.
    assert_eq!(u(&r.result("hello")["cpus"]), 3, "{}", r.explain());
}

#[test]
fn single_cpu_fib_keeps_its_form() {
    let r = smp_run("fib=20", 2, &[]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let f = r.result("fib");
    assert_eq!(u(&f["result"]), 6765, "{}", r.explain());
    assert!(f.get("tasks").is_none(), "{}", r.explain());
}

fn litmus(r: &Run, test: &str, iters: u64) -> Value {
    let l = r
        .results()
        .into_iter()
        .find(|v| v["probe"] == "litmus" && v["test"] == test)
        .unwrap_or_else(|| panic!("no litmus {test} result\n{}", r.explain()));
    assert_eq!(u(&l["iters"]), iters, "{}", r.explain());
    let seen: u64 = l["outcomes"]
        .as_object()
        .unwrap_or_else(|| panic!("no outcomes\n{}", r.explain()))
        .values()
        .map(u)
        .sum();
    assert_eq!(
        seen,
        iters,
        "every iteration has one outcome\n{}",
        r.explain()
    );
    l
}

#[test]
fn litmus_on_one_host_sees_no_forbidden_outcome() {
    for cpus in [2, 3] {
        let r = smp_run("litmus=mp,iters=300,litmus=2+2w,iters=300", cpus, &[]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        for test in ["mp", "2+2w"] {
            let l = litmus(&r, test, 300);
            // One host's KVM is TSO: message passing and 2+2W hold.
            assert_eq!(u(&l["forbidden"]), 0, "{}", r.explain());
            let used: Vec<u64> = l["cpus"].as_array().unwrap().iter().map(u).collect();
            assert_eq!(used, vec![0, cpus as u64 - 1], "{}", r.explain());
        }
    }
}

#[test]
fn litmus_iriw_needs_four_cpus_and_says_so() {
    let r = smp_run("litmus=iriw,iters=10", 3, &[]);
    assert_eq!(r.code, Some(2), "{}", r.explain());
    let l = r.result("litmus");
    assert_eq!(l["ok"], false, "{}", r.explain());
    assert!(
        l["error"].as_str().unwrap().contains("4 cpus"),
        "{}",
        r.explain()
    );
}

#[test]
fn blk_crc_on_an_ap_matches_the_bsp_and_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let mut data = vec![0u8; 1 << 20];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let img = dir.path().join("smp.img");
    std::fs::write(&img, &data).unwrap();
    let disk = format!("path={},readonly=on", img.display());
    let r = smp_run("blk-crc,blk-crc,cpu=1", 2, &["--disk", &disk]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let crcs: Vec<String> = r
        .results()
        .into_iter()
        .filter(|v| v["probe"] == "blk-crc")
        .map(|v| v["disks"][0]["crc32"].as_str().unwrap().to_string())
        .collect();
    let host = format!("{:#010x}", crc32fast::hash(&data));
    assert_eq!(crcs, vec![host.clone(), host], "{}", r.explain());
}

#[test]
fn a_task_that_overruns_on_an_ap_is_ended_and_named() {
    let tasks = "probe.tasks=spin=0,cpu=1,hello probe.task_timeout=1";
    let args = [
        "run",
        "--kernel",
        "probe",
        "--timeout",
        "60",
        "--cpus",
        "2",
        "--cmdline",
        tasks,
    ];
    let r = run_with_limit(&args, LIMIT);
    assert_eq!(r.code, Some(4), "{}", r.explain());
    let s = r.result("spin");
    assert_eq!(s["ok"], false, "{}", r.explain());
    let cpus: Vec<u64> = s["unfinished_cpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(u)
        .collect();
    assert_eq!(cpus, vec![1], "{}", r.explain());
    // The VM goes on with the next task.
    assert_eq!(u(&r.result("hello")["cpus"]), 2, "{}", r.explain());
}

#[test]
fn bad_options_are_refused() {
    for tasks in [
        "procs=2",
        "hello,cpu=2",
        "timer,cpu=1",
        "hello,procs=2",
        "litmus=xyz",
    ] {
        let r = smp_run(tasks, 2, &[]);
        assert_eq!(r.code, Some(2), "{tasks}: {}", r.explain());
        assert!(
            r.results().iter().any(|v| v["ok"] == false),
            "{tasks}: {}",
            r.explain()
        );
    }
}
