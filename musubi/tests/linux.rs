//! Debian's cloud kernel under Musubi: banner, the E820 map Musubi laid out, and the CPUs
//! it announced, and the initrd where Musubi put it. Both entry paths: PVH (ELF vmlinux,
//! initrd as a start-info module) and the 64-bit boot protocol (bzImage, initrd in
//! boot_params).

mod common;
use common::*;

fn boots_far_enough(image: &str) {
    let k = linux_kernel(image);
    let dir = tempfile::tempdir().unwrap();
    let initrd = dir.path().join("initrd.img");
    std::fs::write(&initrd, vec![0x5au8; 1 << 20]).unwrap();
    let r = run_with_limit(
        &[
            "run",
            "--kernel",
            k.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--cpus",
            "2",
            "--memory",
            "512M",
            "--cmdline",
            "console=ttyS0 earlyprintk=ttyS0 reboot=k panic=1",
            "--timeout",
            "600",
        ],
        std::time::Duration::from_secs(660),
    );
    let out = &r.stdout;
    assert!(out.contains("Linux version"), "no banner:\n{}", r.explain());
    // Musubi's layout for 512 MiB: low RAM below the MP table, then RAM from 1 MiB up.
    assert!(
        out.contains("BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable"),
        "{}",
        r.explain()
    );
    assert!(
        out.contains("BIOS-e820: [mem 0x0000000000100000-0x000000001fffffff] usable"),
        "{}",
        r.explain()
    );
    // 1 MiB of initrd at the top of the 512 MiB of low RAM.
    assert!(
        out.contains("RAMDISK: [mem 0x1ff00000-0x1fffffff]"),
        "initrd not found where Musubi put it:\n{}",
        r.explain()
    );
    assert!(
        out.contains("smpboot: Allowing 2 CPUs"),
        "CPU count not found:\n{}",
        r.explain()
    );
    // Whatever the kernel does next, the VMM must end on its own with a status, not hang.
    assert!(r.code.is_some(), "{}", r.explain());
}

#[test]
fn debian_vmlinux_boots_through_pvh() {
    boots_far_enough("vmlinux");
}

#[test]
fn debian_bzimage_boots_through_the_linux_boot_protocol() {
    boots_far_enough("vmlinuz");
}
