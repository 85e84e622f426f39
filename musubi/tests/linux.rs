//! Debian's cloud kernel under Musubi: banner, the E820 map Musubi laid out, and the CPUs
//! it announced. Both entry paths: PVH (ELF vmlinux) and the 64-bit boot protocol (bzImage).

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

/// The unpacked kernel, fetched with `scripts/fetch-linux.sh` when it is not there yet.
fn kernel(name: &str) -> PathBuf {
    let dir = std::env::var_os("MUSUBI_LINUX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache")
                });
            cache.join("musubi/linux")
        });
    let path = dir.join(name);
    if !path.exists() {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-linux.sh");
        let st = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .status()
            .expect("fetch-linux.sh runs");
        assert!(
            st.success(),
            "{} could not fetch Debian's kernel into {}",
            script.display(),
            dir.display()
        );
    }
    assert!(
        path.exists(),
        "{} is missing after fetch-linux.sh",
        path.display()
    );
    path
}

fn boots_far_enough(image: &str) {
    let k = kernel(image);
    let r = run_with_limit(
        &[
            "run",
            "--kernel",
            k.to_str().unwrap(),
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
