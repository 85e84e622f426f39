//! Bad input is refused before a VM starts, with a message naming the problem.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn refused(args: &[&str], needles: &[&str]) {
    let r = run(args);
    assert_ne!(r.code, Some(0), "{args:?} was accepted:\n{}", r.explain());
    for n in needles {
        assert!(
            r.stderr.contains(n),
            "{args:?}: stderr lacks {n:?}:\n{}",
            r.explain()
        );
    }
}

/// `musubi run --kernel probe FLAGS` is refused with `needles` in its message.
fn refused_probe(flags: &[&str], needles: &[&str]) {
    let mut args = vec!["run", "--kernel", "probe"];
    args.extend_from_slice(flags);
    refused(&args, needles);
}

#[test]
fn missing_kernel_is_named() {
    refused(
        &["run", "--kernel", "/nonexistent/vmlinux"],
        &["--kernel", "/nonexistent/vmlinux"],
    );
}

#[test]
fn a_file_that_is_not_a_kernel_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.txt");
    std::fs::write(&p, "just some text, not a kernel\n".repeat(100)).unwrap();
    refused(
        &["run", "--kernel", p.to_str().unwrap()],
        &["notes.txt", "not a kernel"],
    );
}

#[test]
fn zero_memory_is_refused() {
    refused_probe(&["--memory", "0"], &["--memory", "at least"]);
}

#[test]
fn more_memory_than_the_host_has_is_refused() {
    refused_probe(
        &["--memory", "64T"],
        &["--memory", "more than this host has"],
    );
}

#[test]
fn malformed_memory_is_refused() {
    for (memory, why) in [
        ("lots", "\"lots\" is not a number"),
        ("-1G", "a size cannot be negative"),
        ("2Q", "unknown suffix \"Q\""),
    ] {
        refused_probe(
            &[&format!("--memory={memory}")],
            &[&format!("--memory {memory:?}: invalid size: {why}")],
        );
    }
}

#[test]
fn memory_takes_decimal_sizes_as_partitions_do() {
    let r = run_probe("hello", &["--memory", "64.5M"]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    // Guest RAM less what the boot structures below 1 MiB reserve.
    let seen = r.result("hello")["memory_bytes"].as_u64().unwrap();
    assert!(seen > 64 << 20 && seen < (64 << 20) + (512 << 10), "{seen}");
}

#[test]
fn missing_disk_is_named() {
    refused_probe(
        &["--disk", "path=/nonexistent/disk.img"],
        &["--disk", "/nonexistent/disk.img"],
    );
}

#[test]
fn malformed_disk_is_refused() {
    refused_probe(&["--disk", "cache=none"], &["--disk", "path= is missing"]);
    refused_probe(
        &["--disk", "path=x.img,cache=sometimes"],
        &["--disk", "cache"],
    );
}

#[test]
fn bad_json_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("vm.json");
    std::fs::write(&p, "{\"kernel\": \"probe\", \"cpus\": }").unwrap();
    refused(
        &["run", "--config", p.to_str().unwrap()],
        &["--config", "vm.json", "invalid JSON"],
    );
    std::fs::write(&p, "{\"kernel\": \"probe\", \"colour\": \"red\"}").unwrap();
    refused(
        &["run", "--config", p.to_str().unwrap()],
        &["unknown field", "colour"],
    );
}

#[test]
fn zero_cpus_is_refused() {
    refused_probe(&["--cpus", "0"], &["--cpus"]);
}

#[test]
fn more_cpus_than_the_mp_table_holds_are_refused_before_any_vm_work() {
    let r = run(&["run", "--kernel", "probe", "--cpus", "40"]);
    assert_eq!(r.code, Some(1), "{}", r.explain());
    assert!(
        r.stderr.contains("--cpus 40") && r.stderr.contains("at most 37"),
        "{}",
        r.explain()
    );
    // Refused while reading the configuration: the builder, which would report that the
    // MP table is full once the VM and its memory exist, never ran.
    assert!(r.stdout.is_empty(), "{}", r.explain());
    assert!(
        !r.stderr.contains("do not fit in the MP table"),
        "{}",
        r.explain()
    );
}

#[test]
fn help_lists_the_run_flags() {
    let r = run(&["run", "--help"]);
    assert_eq!(r.code, Some(0));
    for flag in [
        "--kernel",
        "--cmdline",
        "--initrd",
        "--cpus",
        "--memory",
        "--disk",
        "--serial",
        "--config",
    ] {
        assert!(r.stdout.contains(flag), "help lacks {flag}");
    }
}

#[test]
fn an_initrd_that_does_not_fit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("big-initrd.img");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(200 << 20)
        .unwrap();
    refused_probe(
        &["--memory", "64M", "--initrd", p.to_str().unwrap()],
        &["initrd"],
    );
    refused_probe(
        &["--initrd", "/nonexistent/initrd.img"],
        &["--initrd", "/nonexistent/initrd.img"],
    );
}

#[test]
fn a_directory_or_a_fifo_is_not_a_disk() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    for (path, kind) in [(dir.path(), "a directory"), (fifo.as_path(), "a FIFO")] {
        let spec = format!("path={}", path.display());
        refused_probe(
            &["--disk", &spec],
            &[
                &format!("--disk {spec}"),
                kind,
                "expected a regular file or a block device",
            ],
        );
    }
}

/// A loop device over a file, detached when dropped, also when an assertion fails.
struct LoopDevice {
    dev: PathBuf,
}

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .unwrap_or_else(|e| panic!("this test needs losetup (util-linux): {e}"));
        assert!(
            out.status.success(),
            "this test needs root and loop devices: losetup -f --show {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDevice {
            dev: PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        match Command::new("losetup").arg("-d").arg(&self.dev).status() {
            Ok(s) if s.success() => {}
            other => eprintln!("losetup -d {}: {other:?}", self.dev.display()),
        }
    }
}

#[test]
fn a_block_device_is_a_disk() {
    const SIZE: usize = 4 << 20;
    let dir = direct_io_dir();
    let img = temp_image(dir.path(), "backing.img", SIZE);
    let dev = LoopDevice::attach(&img);
    let disk = format!("path={}", dev.dev.display());
    let r = run_probe("blk-fill=7,blk-crc", &["--disk", &disk]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    // The guest's writes went through the device into the backing file.
    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len(), SIZE);
    if let Some(o) = (0..SIZE).find(|&o| data[o] != fill_byte(o as u64, 7)) {
        panic!("{}: byte {o:#x} is not the fill pattern", img.display());
    }
    let crc = format!("{:#010x}", crc32fast::hash(&data));
    let d = &r.result("blk-crc")["disks"][0];
    assert_eq!(d["bytes"], SIZE as u64, "{}", r.explain());
    assert_eq!(d["crc32"], crc.as_str(), "{}", r.explain());
    // With O_DIRECT the device's own block size sets the alignment.
    let r = run_probe("blk-crc", &["--disk", &format!("{disk},cache=none")]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    assert_eq!(
        r.result("blk-crc")["disks"][0]["crc32"],
        crc.as_str(),
        "{}",
        r.explain()
    );
}
