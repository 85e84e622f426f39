//! `musubi demo`: the main job on built-in defaults, a VM doing real I/O end to end.

use crate::probe;
use std::process::ExitCode;
use std::time::Duration;
use vmm::config::{CacheMode, DiskConfig, ExitsMode, SerialMode, VmConfig};

const DISK_BYTES: usize = 4 << 20;
const SEED: u64 = 42;
const CPUS: u8 = 2;

/// Byte `offset` of a disk after the probe guest's `blk-fill=SEED`.
pub fn fill_byte(offset: u64, seed: u64) -> u8 {
    (((offset / 512) * 131 + offset % 512 + seed) % 256) as u8
}

pub fn run() -> ExitCode {
    match demo() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("musubi demo: {e}");
            ExitCode::from(1)
        }
    }
}

fn demo() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let disk = dir.path().join("demo-disk.img");
    std::fs::write(&disk, vec![0u8; DISK_BYTES]).map_err(|e| format!("{}: {e}", disk.display()))?;
    let tasks = format!("hello,blk-fill={SEED},blk-crc");
    println!(
        "musubi demo: probe guest, {CPUS} vCPUs, 128 MiB RAM, one {} MiB virtio-blk disk",
        DISK_BYTES >> 20
    );
    println!("  tasks: {tasks}");
    let config = VmConfig {
        kernel: probe::image(),
        cmdline: format!("probe.tasks={tasks}"),
        initrd: None,
        cpus: CPUS,
        memory: 128 << 20,
        disks: vec![DiskConfig {
            path: disk.clone(),
            readonly: false,
            cache: CacheMode::Writeback,
        }],
        pmem: vec![],
        net: vec![],
        rng: None,
        vsock: None,
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    };
    let opts = vmm::RunOptions {
        capture_serial: true,
        timeout: Some(Duration::from_secs(300)),
        seccomp: vmm::seccomp::SeccompMode::Enforce,
        io_poll: vmm::DEFAULT_IO_POLL,
        io_poll_hold: false,
        io_threads: vmm::IoThreadCount::Auto,
    };
    let report = vmm::run_vm(&config, &opts).map_err(|e| e.to_string())?;
    let results = probe::results(&report.serial);
    for r in &results {
        println!("  guest: {r}");
    }
    if report.outcome != vmm::Outcome::GuestStatus(0) {
        return Err(format!(
            "the guest did not finish cleanly: {:?}\nconsole:\n{}",
            report.outcome,
            String::from_utf8_lossy(&report.serial)
        ));
    }
    let hello = probe::result(&results, "hello").ok_or("no hello result from the guest")?;
    let crc = probe::result(&results, "blk-crc").ok_or("no blk-crc result from the guest")?;
    let guest_crc = crc["disks"][0]["crc32"].as_str().unwrap_or("").to_string();

    let data = std::fs::read(&disk).map_err(|e| format!("{}: {e}", disk.display()))?;
    let host_crc = format!("{:#010x}", crc32fast::hash(&data));
    let expected: Vec<u8> = (0..DISK_BYTES as u64).map(|o| fill_byte(o, SEED)).collect();
    let expected_crc = format!("{:#010x}", crc32fast::hash(&expected));
    let pattern_ok = data == expected;

    println!();
    println!("  CPUs online in the guest: {}", hello["cpus"]);
    println!(
        "  memory the guest found:  {} MiB",
        hello["memory_bytes"].as_u64().unwrap_or(0) >> 20
    );
    println!(
        "  disk CRC-32: guest {guest_crc}, host file {host_crc}, expected pattern {expected_crc}"
    );
    println!(
        "  host check of every byte of the fill pattern: {}",
        if pattern_ok { "ok" } else { "MISMATCH" }
    );
    println!(
        "  wall time {:.2} s (first KVM_RUN after {:.2} ms); {} VM exits, {} device interrupts",
        report.wall.as_secs_f64(),
        report.to_first_run.unwrap_or_default().as_secs_f64() * 1e3,
        report.total_exits,
        report.interrupts
    );
    println!("  top exits (reason, port or device, count, mean VMM time per exit):");
    for e in report.metrics.exits.iter().take(6) {
        println!(
            "    {:<12} {:<26} {:>8}  {:>7.1} us",
            e.reason,
            e.detail.as_deref().unwrap_or("-"),
            e.count,
            e.mean_vmm_ns as f64 / 1e3
        );
    }
    let doorbells = &report.metrics.notifications;
    println!(
        "  doorbells: {} through ioeventfd, {} as MMIO exits",
        doorbells.ioeventfd, doorbells.mmio_exit
    );
    if !pattern_ok || guest_crc != host_crc || host_crc != expected_crc {
        return Err("the disk contents do not match what the guest wrote".into());
    }
    println!("musubi demo: ok");
    Ok(())
}
