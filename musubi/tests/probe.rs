//! The probe guest on KVM: CPUs, memory, virtio-blk data paths, exit status and crashes.

mod common;
use common::*;
use musubi_types::Metrics;
use std::io::Write;

/// RAM the guest's E820 map reports: everything but the MP table KiB and the legacy hole.
fn e820_ram(bytes: u64) -> u64 {
    bytes - (0x10_0000 - 0x9_fc00)
}

fn hello(cpus: &str) {
    let r = run_probe("hello", &["--cpus", cpus, "--memory", "128M"]);
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
    let r = run_probe("exit=7", &[]);
    assert_eq!(r.code, Some(7), "{}", r.explain());
}

#[test]
fn guest_triple_fault_ends_the_vm_with_a_message() {
    let r = run_probe("triple-fault", &[]);
    assert_eq!(r.code, Some(125), "{}", r.explain());
    assert!(r.stderr.contains("triple fault"), "{}", r.explain());
}

/// Both places hot traps can be handled; every device test runs under each.
const MODES: [&str; 2] = ["kernel", "user"];

fn fill_then_check(cache: &str, dir: &std::path::Path) {
    for mode in MODES {
        fill_then_check_in(cache, dir, mode);
    }
}

fn fill_then_check_in(cache: &str, dir: &std::path::Path, mode: &str) {
    let size = 3 << 20;
    let img = temp_image(dir, "fill.img", size);
    let disk = format!("path={},cache={cache}", img.display());
    let r = run_probe("blk-fill=9", &["--exits", mode, "--disk", &disk]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len(), size);
    for (off, b) in data.iter().enumerate() {
        assert_eq!(
            *b,
            fill_byte(off as u64, 9),
            "byte {off} of {} ({cache}, --exits {mode})",
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
    for mode in MODES {
        crc_matches_host_in(cache, dir, mode);
    }
}

fn crc_matches_host_in(cache: &str, dir: &std::path::Path, mode: &str) {
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
    let r = run_probe("blk-crc", &["--exits", mode, "--disk", &disk]);
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

/// `ms=N` is a promise of the guest's own clock, not a measurement: the paced fill's pieces
/// each wait for their share of N ms, so the fill reports at least N ms and still writes the
/// pattern; on another task the option is refused by name and the next task runs.
#[test]
fn a_paced_fill_lasts_its_ms_and_the_option_is_refused_on_other_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let size = 2 << 20;
    let img = temp_image(dir.path(), "paced.img", size);
    let disk = format!("path={}", img.display());
    let r = run_probe("blk-fill=4,ms=300,hello,ms=5,hello", &["--disk", &disk]);
    let fill = r.result("blk-fill");
    let d = &fill["disks"][0];
    assert_eq!(
        (d["ok"].as_bool(), d["bytes"].as_u64()),
        (Some(true), Some(size as u64)),
        "{}",
        r.explain()
    );
    assert!(d["ns"].as_u64().unwrap() >= 300_000_000, "{}", r.explain());
    let data = std::fs::read(&img).unwrap();
    assert!(data
        .iter()
        .enumerate()
        .all(|(o, b)| *b == fill_byte(o as u64, 4)));
    assert!(
        r.stdout
            .contains("ms=N applies to blk-fill and pmem-fill only"),
        "{}",
        r.explain()
    );
}

#[test]
fn readonly_disk_refuses_guest_writes_and_the_vmm_stays_up() {
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let img = temp_image(dir.path(), "ro.img", 1 << 20);
        let disk = format!("path={},readonly=on", img.display());
        let r = run_probe("blk-fill=1,hello", &["--exits", mode, "--disk", &disk]);
        let fill = r.result("blk-fill");
        assert_eq!(fill["ok"], false, "{}", r.explain());
        // The VM went on to the next task: the device error did not stop the VMM.
        r.result("hello");
        assert!(
            std::fs::read(&img).unwrap().iter().all(|b| *b == 0),
            "a read-only image changed ({mode})"
        );
    }
}

#[test]
fn hostile_virtio_driver_does_not_crash_or_hang_the_vmm() {
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let img = temp_image(dir.path(), "hostile.img", 1 << 20);
        let disk = format!("path={}", img.display());
        let r = run_probe("hostile-virtio", &["--exits", mode, "--disk", &disk]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        let h = r.result("hostile-virtio");
        assert_eq!(h["good_read"], true, "{}", r.explain());
        assert!(h["cases"].as_u64().unwrap() >= 5, "{}", r.explain());
    }
}

/// Reads the `--metrics` file of a probe-guest run of `tasks` with one disk.
fn metrics_of(mode: &str, tasks: &str) -> Metrics {
    let dir = tempfile::tempdir().unwrap();
    let img = temp_image(dir.path(), "m.img", 1 << 20);
    let disk = format!("path={}", img.display());
    let metrics = dir.path().join("metrics.json");
    let r = run_probe(
        tasks,
        &[
            "--exits",
            mode,
            "--disk",
            &disk,
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let text = std::fs::read_to_string(&metrics)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", metrics.display(), r.explain()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("metrics JSON is invalid: {e}\n{text}"))
}

#[test]
fn kernel_mode_takes_no_doorbell_exits_and_user_mode_takes_them_all() {
    // With polling off the guest waits for every completion's interrupt, so both interrupt
    // paths (irqfd, KVM_IRQ_LINE from user space) are exercised.
    const TASKS: &str = "blk-crc probe.virtio_poll_us=0";
    let k = metrics_of("kernel", TASKS);
    assert_eq!(k.exits_mode, "kernel");
    assert_eq!(k.notifications.mmio_exit, 0, "{k:#}");
    assert!(k.notifications.ioeventfd > 0, "{k:#}");
    assert!(k.interrupts.irqfd.unwrap() > 0, "{k:#}");
    assert!(k.interrupts.user.is_none(), "{k:#}");
    let notify_exits = k
        .exits
        .iter()
        .filter(|e| {
            e.detail
                .as_deref()
                .is_some_and(|d| d.ends_with(":queue_notify"))
        })
        .count();
    assert_eq!(notify_exits, 0, "{k:#}");

    let u = metrics_of("user", TASKS);
    assert_eq!(u.exits_mode, "user");
    assert_eq!(u.notifications.ioeventfd, 0, "{u:#}");
    assert!(u.notifications.mmio_exit > 0, "{u:#}");
    assert!(u.interrupts.user.unwrap() > 0, "{u:#}");
    assert!(u.interrupts.irqfd.is_none(), "{u:#}");
    // Every per-vCPU line adds up to the VM total.
    let total: u64 = u
        .vcpus
        .iter()
        .flat_map(|v| v.exits.iter())
        .map(|e| e.count)
        .sum();
    assert_eq!(total, u.total_exits);
}

/// `probe.page_cache=` caps the guest's page cache below the file, as paper 000's 256 MB
/// guest reading a 512 MB file: a warm pass then goes to the disk again where an uncapped
/// cache serves it alone, and the dirty pages the cap evicts reach the disk intact.
#[test]
fn a_capped_page_cache_rereads_a_warm_file_and_keeps_every_evicted_write() {
    const EXTENT: usize = 1 << 20;
    const CHUNK: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    for path in ["syscall", "mmap"] {
        let img = temp_image(dir.path(), "cache.img", 2 * EXTENT);
        let disk = format!("path={},cache=writeback", img.display());
        let requests = |task: &str, cap: &str| {
            let r = run_probe(&format!("{task}{cap}"), &["--disk", &disk]);
            assert_eq!(r.code, Some(0), "{}", r.explain());
            r.result("storage-io")["virtio_requests"]
                .as_u64()
                .unwrap_or_else(|| panic!("no virtio_requests\n{}", r.explain()))
        };
        let cap = " probe.page_cache=256K";
        // Two passes of writes through a cache a quarter of the file: most pages are evicted
        // dirty, some twice.
        let written = requests(&format!("storage-io=blk:write:{path}:warm:1M:64K"), cap);
        assert!(written > 0, "{path}: no request for the timed write pass");
        let data = std::fs::read(&img).unwrap();
        let mut chunk = vec![0u8; CHUNK];
        workloads::fill(&mut chunk, 0, 0);
        for (i, c) in data[..EXTENT].chunks(CHUNK).enumerate() {
            assert!(c == &chunk[..], "{path}: chunk {i} of the file differs");
        }
        assert!(
            data[EXTENT..].iter().all(|&b| b == 0),
            "{path}: bytes past the extent were written"
        );
        let read = format!("storage-io=blk:read:{path}:warm:1M:64K");
        assert_eq!(
            requests(&read, ""),
            0,
            "{path}: an uncapped cache holding the file went to the disk on a warm pass"
        );
        assert!(
            requests(&read, cap) > 0,
            "{path}: a cache a quarter of the file served a warm pass without the disk"
        );
    }
}

/// `mem-check=16`: 16 MiB filled, rewritten a sixteenth per round for the default 8 rounds,
/// and every byte reads back as written; a size beyond the task buffer, a zero size and
/// `iters=0` are refused (status 2) with the buffer's size in MiB.
#[test]
fn mem_check_reads_back_every_byte_and_refuses_a_size_that_does_not_fit() {
    let r = run_probe("mem-check=16", &["--memory", "256M"]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let m = r.result("mem-check");
    assert_eq!(
        (
            m["mib"].as_u64(),
            m["rounds"].as_u64(),
            m["errors"].as_u64()
        ),
        (Some(16), Some(8), Some(0)),
        "{}",
        r.explain()
    );
    assert_eq!(m["ok"], true, "{}", r.explain());

    for task in [
        "mem-check=100000",
        "mem-check=0",
        "mem-check=16,iters=0",
        "mem-check=x",
    ] {
        let r = run_probe(task, &["--memory", "256M"]);
        assert_eq!(r.code, Some(2), "{task}: {}", r.explain());
        let m = r.result("mem-check");
        assert_eq!(m["ok"], false, "{task}: {}", r.explain());
        // `iters=R` is an option item of its own, not part of the task's item.
        let item = task.split(",iters=").next().unwrap();
        assert_eq!(m["task"], item, "{}", r.explain());
        assert!(
            m["error"]
                .as_str()
                .unwrap_or("")
                .contains("needs MIB in 1..=max_mib"),
            "{task}: {}",
            r.explain()
        );
        let max = m["max_mib"].as_u64().unwrap_or(0);
        assert!((16..100_000).contains(&max), "{task}: {}", r.explain());
    }
}
