//! `--metrics` while a VM runs: SIGUSR1 writes the accounting without stopping the guest,
//! and SIGTERM still ends the run through the normal teardown that writes it again.

mod common;
use common::*;
use musubi_types::Metrics;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn sigusr1_writes_metrics_while_the_vm_runs() {
    common::assert_kvm();
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.json");
    let mut child = musubi()
        .args([
            "run",
            "--kernel",
            "probe",
            "--serial",
            "stdio",
            "--timeout",
            "120",
            "--metrics",
        ])
        .arg(&metrics)
        .args(["--cmdline", "probe.tasks=spin=0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("musubi starts");
    let pid = child.id() as i32;
    // SIGUSR1 before the VMM has installed its handler would end the process, so wait for
    // the guest's first console line: the handlers are in place before the guest runs.
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the probe guest printed nothing within 60 s");
    // The guest's busy loop keeps the VM alive; ask for metrics until they show the guest
    // has run (the first request may come before the first KVM_RUN).
    let start = Instant::now();
    let m = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no metrics with exits after SIGUSR1"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the VM ended while SIGUSR1 was being sent"
        );
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGUSR1) };
        std::thread::sleep(Duration::from_millis(100));
        let Ok(text) = std::fs::read_to_string(&metrics) else {
            continue;
        };
        let m: Metrics = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        if m.total_exits > 0 {
            break m;
        }
    };
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGUSR1 stopped the VM"
    );
    assert_eq!(m.exits_mode, "kernel");

    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    let end: Metrics = serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert!(
        end.total_exits >= m.total_exits,
        "final metrics went backwards"
    );
}
