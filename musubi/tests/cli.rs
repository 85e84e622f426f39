//! Bad input is refused before a VM starts, with a message naming the problem.

mod common;
use common::*;

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
    refused(
        &["run", "--kernel", "probe", "--memory", "0"],
        &["--memory", "at least"],
    );
}

#[test]
fn more_memory_than_the_host_has_is_refused() {
    refused(
        &["run", "--kernel", "probe", "--memory", "64T"],
        &["--memory", "more than this host has"],
    );
}

#[test]
fn malformed_memory_is_refused() {
    refused(
        &["run", "--kernel", "probe", "--memory", "lots"],
        &["--memory", "\"lots\""],
    );
}

#[test]
fn missing_disk_is_named() {
    refused(
        &[
            "run",
            "--kernel",
            "probe",
            "--disk",
            "path=/nonexistent/disk.img",
        ],
        &["--disk", "/nonexistent/disk.img"],
    );
}

#[test]
fn malformed_disk_is_refused() {
    refused(
        &["run", "--kernel", "probe", "--disk", "cache=none"],
        &["--disk", "path= is missing"],
    );
    refused(
        &[
            "run",
            "--kernel",
            "probe",
            "--disk",
            "path=x.img,cache=sometimes",
        ],
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
    refused(&["run", "--kernel", "probe", "--cpus", "0"], &["--cpus"]);
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
    refused(
        &[
            "run",
            "--kernel",
            "probe",
            "--memory",
            "64M",
            "--initrd",
            p.to_str().unwrap(),
        ],
        &["initrd"],
    );
    refused(
        &[
            "run",
            "--kernel",
            "probe",
            "--initrd",
            "/nonexistent/initrd.img",
        ],
        &["--initrd", "/nonexistent/initrd.img"],
    );
}
