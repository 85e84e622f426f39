//! The probe guest on KVM: CPUs, memory, virtio-blk data paths, exit status and crashes.

mod common;
use common::*;
use std::io::Write;

/// RAM the guest's E820 map reports: everything but the MP table KiB and the legacy hole.
fn e820_ram(bytes: u64) -> u64 {
    bytes - (0x10_0000 - 0x9_fc00)
}

fn hello(cpus: &str) {
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--cpus",
        cpus,
        "--memory",
        "128M",
        "--cmdline",
        "probe.tasks=hello",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let h = r.result("hello");
    assert_eq!(
        h["cpus"].as_u64(),
        Some(cpus.parse().unwrap()),
        "{}",
        r.explain()
    );
    assert_eq!(
        h["memory_bytes"].as_u64(),
        Some(e820_ram(128 << 20)),
        "{}",
        r.explain()
    );
}

#[test]
fn hello_on_one_vcpu() {
    hello("1");
}

#[test]
fn hello_on_two_vcpus() {
    hello("2");
}

#[test]
fn exit_status_propagates() {
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--cmdline",
        "probe.tasks=exit=7",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(7), "{}", r.explain());
}

#[test]
fn guest_triple_fault_ends_the_vm_with_a_message() {
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--cmdline",
        "probe.tasks=triple-fault",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(125), "{}", r.explain());
    assert!(r.stderr.contains("triple fault"), "{}", r.explain());
}

fn fill_then_check(cache: &str, dir: &std::path::Path) {
    let size = 3 << 20;
    let img = temp_image(dir, "fill.img", size);
    let disk = format!("path={},cache={cache}", img.display());
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--disk",
        &disk,
        "--cmdline",
        "probe.tasks=blk-fill=9",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len(), size);
    for (off, b) in data.iter().enumerate() {
        assert_eq!(
            *b,
            fill_byte(off as u64, 9),
            "byte {off} of {} ({cache})",
            img.display()
        );
    }
}

#[test]
fn blk_fill_writes_every_byte_writeback() {
    let dir = tempfile::tempdir().unwrap();
    fill_then_check("writeback", dir.path());
}

#[test]
fn blk_fill_writes_every_byte_cache_none() {
    let dir = direct_io_dir();
    fill_then_check("none", dir.path());
}

fn crc_matches_host(cache: &str, dir: &std::path::Path) {
    let mut data = vec![0u8; 2 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let img = dir.join("random.img");
    std::fs::File::create(&img)
        .unwrap()
        .write_all(&data)
        .unwrap();
    let disk = format!("path={},cache={cache},readonly=on", img.display());
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--disk",
        &disk,
        "--cmdline",
        "probe.tasks=blk-crc",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let c = r.result("blk-crc");
    let d = &c["disks"][0];
    assert_eq!(
        d["bytes"].as_u64(),
        Some(data.len() as u64),
        "{}",
        r.explain()
    );
    assert_eq!(
        d["crc32"].as_str().unwrap(),
        format!("{:#010x}", crc32fast::hash(&data)),
        "{}",
        r.explain()
    );
}

#[test]
fn blk_crc_matches_the_host_writeback() {
    let dir = tempfile::tempdir().unwrap();
    crc_matches_host("writeback", dir.path());
}

#[test]
fn blk_crc_matches_the_host_cache_none() {
    let dir = direct_io_dir();
    crc_matches_host("none", dir.path());
}

#[test]
fn readonly_disk_refuses_guest_writes_and_the_vmm_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let img = temp_image(dir.path(), "ro.img", 1 << 20);
    let disk = format!("path={},readonly=on", img.display());
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--disk",
        &disk,
        "--cmdline",
        "probe.tasks=blk-fill=1,hello",
        "--timeout",
        "200",
    ]);
    let fill = r.result("blk-fill");
    assert_eq!(fill["ok"], false, "{}", r.explain());
    // The VM went on to the next task: the device error did not stop the VMM.
    r.result("hello");
    assert!(
        std::fs::read(&img).unwrap().iter().all(|b| *b == 0),
        "a read-only image changed"
    );
}

#[test]
fn hostile_virtio_driver_does_not_crash_or_hang_the_vmm() {
    let dir = tempfile::tempdir().unwrap();
    let img = temp_image(dir.path(), "hostile.img", 1 << 20);
    let disk = format!("path={}", img.display());
    let r = run(&[
        "run",
        "--kernel",
        "probe",
        "--disk",
        &disk,
        "--cmdline",
        "probe.tasks=hostile-virtio",
        "--timeout",
        "200",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let h = r.result("hostile-virtio");
    assert_eq!(h["good_read"], true, "{}", r.explain());
    assert!(h["cases"].as_u64().unwrap() >= 5, "{}", r.explain());
}
