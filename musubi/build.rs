//! Builds the probe guest (its own workspace, target x86_64-unknown-none) so that one
//! `cargo build` yields a `musubi` binary that carries the guest it boots by default.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let guest = manifest.parent().unwrap().join("guest");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // A target directory of its own: the outer build holds the lock on the workspace's.
    let target_dir = out.join("guest-target");

    // The guest's own files and the workload crate it shares with the host.
    let workloads = guest.with_file_name("workloads");
    let guest_files = [
        "Cargo.toml",
        "Cargo.lock",
        "src",
        ".cargo",
        "link.ld",
        "build.rs",
    ];
    let watched = guest_files
        .iter()
        .map(|p| guest.join(p))
        .chain(["Cargo.toml", "src"].iter().map(|p| workloads.join(p)));
    for path in watched {
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&guest)
        .args(["build", "--release", "--target", "x86_64-unknown-none"])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's settings are for the host target; none may leak into the guest's.
    for (k, _) in std::env::vars() {
        if (k.starts_with("CARGO_") && k != "CARGO_HOME")
            || k.starts_with("RUSTC")
            || k == "RUSTFLAGS"
            || k == "RUSTDOCFLAGS"
        {
            cmd.env_remove(k);
        }
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "cannot run cargo to build the probe guest in {}: {e}",
            guest.display()
        )
    });
    if !status.success() {
        panic!(
            "building the probe guest in {} failed (is the target installed? run `rustup target add x86_64-unknown-none`)",
            guest.display()
        );
    }
    let elf = target_dir.join("x86_64-unknown-none/release/probe");
    copy(&elf, &out.join("probe.elf"));
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", from.display(), to.display()));
}
