//! Debian's cloud kernel sees `--pmem ...,advertise=e820` regions as legacy persistent
//! memory: its `BIOS-e820` map shows `persistent (type 12)` for exactly the ranges Musubi
//! placed, RAM stays as it was, and a region advertised by virtio-pmem is not in the map.
//! Both entry paths: PVH (the map comes from hvm_start_info) and the 64-bit boot protocol
//! (boot_params).

mod common;
use common::*;
use std::path::PathBuf;

fn sparse(dir: &std::path::Path, name: &str, bytes: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
    p
}

fn e820_shows_the_regions(image: &str) {
    let k = linux_kernel(image);
    let dir = tempfile::tempdir().unwrap();
    let a = sparse(dir.path(), "a.img", 64 << 20);
    let v = sparse(dir.path(), "v.img", 2 << 20);
    let b = sparse(dir.path(), "b.img", 4 << 20);
    let (pa, pv, pb) = (
        format!("file={}", a.display()),
        format!("file={},advertise=virtio", v.display()),
        format!("file={},readonly=on", b.display()),
    );
    let r = run_with_limit(
        &[
            "run",
            "--kernel",
            k.to_str().unwrap(),
            "--memory",
            "512M",
            "--cmdline",
            "console=ttyS0 earlyprintk=ttyS0 reboot=k panic=1",
            "--pmem",
            &pa,
            "--pmem",
            &pv,
            "--pmem",
            &pb,
            "--timeout",
            "400",
        ],
        std::time::Duration::from_secs(460),
    );
    let out = &r.stdout;
    assert!(out.contains("Linux version"), "no banner:\n{}", r.explain());
    // RAM as without regions.
    assert!(
        out.contains("BIOS-e820: [mem 0x0000000000100000-0x000000001fffffff] usable"),
        "{}",
        r.explain()
    );
    // Region 0: 64 MiB right above 512 MiB of RAM. Region 1 (virtio, 2 MiB) follows it
    // but is not in the map. Region 2 (4 MiB) comes after that.
    assert!(
        out.contains("BIOS-e820: [mem 0x0000000020000000-0x0000000023ffffff] persistent (type 12)"),
        "{}",
        r.explain()
    );
    assert!(
        out.contains("BIOS-e820: [mem 0x0000000024200000-0x00000000245fffff] persistent (type 12)"),
        "{}",
        r.explain()
    );
    let map: Vec<&str> = out.lines().filter(|l| l.contains("BIOS-e820:")).collect();
    assert!(
        !map.iter().any(|l| l.contains("0x0000000024000000")),
        "the virtio-pmem region must not be in the E820 map: {map:#?}"
    );
    assert_eq!(
        map.iter().filter(|l| l.contains("persistent")).count(),
        2,
        "{map:#?}"
    );
    assert!(r.code.is_some(), "{}", r.explain());
}

#[test]
fn debian_vmlinux_sees_pmem_through_the_pvh_memory_map() {
    e820_shows_the_regions("vmlinux");
}

#[test]
fn debian_bzimage_sees_pmem_through_boot_params() {
    e820_shows_the_regions("vmlinuz");
}
