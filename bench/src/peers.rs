//! The `--compare` list, and Firecracker and Cloud Hypervisor as peers of `bench boot`:
//! found on `PATH`, booting the same probe guest ELF, timed to their first `KVM_RUN` by
//! Musubi's own `LD_PRELOAD` shim ([`build_shim`]) exactly as Musubi is.

use super::find_on_path;
use super::watch::{last_words, observe, Watch};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The hypervisors `--compare` takes.
pub const KNOWN: [&str; 3] = ["qemu", "firecracker", "cloud-hypervisor"];

/// The peers a `--compare` value names, in its order and each once; `None` (no
/// `--compare`) names none. Refuses a name that is not a peer, the mistake a person must
/// correct.
pub fn parse_compare(value: Option<&str>) -> Result<Vec<&'static str>, String> {
    let mut out: Vec<&'static str> = Vec::new();
    for name in value.unwrap_or("").split(',').map(str::trim) {
        if name.is_empty() {
            continue;
        }
        let known = KNOWN.iter().find(|k| **k == name).ok_or_else(|| {
            format!(
                "--compare {:?}: {name:?} is not a hypervisor to compare with; known: {} \
                 (comma-separated)",
                value.unwrap_or(""),
                KNOWN.join(", ")
            )
        })?;
        if !out.contains(known) {
            out.push(known);
        }
    }
    Ok(out)
}

/// The C source of the timing shim, Musubi's own.
const SHIM_SOURCE: &str = include_str!("kvm_run_stamp.c");
/// The environment variable naming the file the shim writes its stamp to.
pub const STAMP_ENV: &str = "MUSUBI_KVM_RUN_STAMP";
const CC_LIMIT: Duration = Duration::from_secs(60);

/// Compiles the timing shim into `dir` with the system's C compiler, or says why not.
pub fn build_shim(dir: &Path) -> Result<PathBuf, String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if find_on_path(&cc).is_none() && !Path::new(&cc).is_file() {
        return Err(format!(
            "no C compiler ({cc} is not on PATH) to build the KVM_RUN timing shim"
        ));
    }
    let src = dir.join("kvm_run_stamp.c");
    let so = dir.join("kvm_run_stamp.so");
    std::fs::write(&src, SHIM_SOURCE)
        .map_err(|e| format!("cannot write {}: {e}", src.display()))?;
    let mut cmd = Command::new(&cc);
    cmd.args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&so)
        .arg(&src)
        .arg("-ldl");
    let w = Watch {
        marker: "\u{0}",
        guest_bytes: None,
        timeout: CC_LIMIT,
        sample_every: Duration::from_millis(20),
    };
    let o = observe(cmd, &w).map_err(|e| format!("cannot run {cc}: {e}"))?;
    match o.status {
        Some(s) if s.success() && so.is_file() => Ok(so),
        _ => Err(format!(
            "{cc} could not build the KVM_RUN timing shim: {}",
            last_words(&o, 3)
        )),
    }
}

/// Runs `cmd` with the shim loaded, stamping into `stamp`.
pub fn with_shim(cmd: &mut Command, shim: &Path, stamp: &Path) {
    cmd.env("LD_PRELOAD", shim).env(STAMP_ENV, stamp);
}

/// The shim's stamp (CLOCK_MONOTONIC ns at the first KVM_RUN), if it wrote one.
pub fn read_stamp(stamp: &Path) -> Option<u64> {
    std::fs::read_to_string(stamp).ok()?.trim().parse().ok()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Firecracker,
    CloudHypervisor,
}

impl Kind {
    pub fn of(name: &str) -> Option<Kind> {
        match name {
            "firecracker" => Some(Kind::Firecracker),
            "cloud-hypervisor" => Some(Kind::CloudHypervisor),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Firecracker => "firecracker",
            Kind::CloudHypervisor => "cloud-hypervisor",
        }
    }

    /// How it runs here, for the report: Cloud Hypervisor's seccomp filter kills a process
    /// that carries the shim, so it runs without it; Firecracker keeps its filters (the
    /// shim opens its file before they are installed).
    pub fn filters(self, shim: bool) -> &'static str {
        match (self, shim) {
            (Kind::CloudHypervisor, true) => "without its seccomp filter (--seccomp false)",
            _ => "with its seccomp filters",
        }
    }
}

/// A peer VMM that boots a PVH ELF directly.
#[derive(Clone, Debug)]
pub struct Micro {
    pub kind: Kind,
    exe: PathBuf,
    elf: PathBuf,
    /// Firecracker's configuration file (it takes no kernel on its command line).
    config: PathBuf,
}

/// The probe guest's hello task, as `bench boot` runs it everywhere.
const CMDLINE: &str = "probe.tasks=hello";

impl Micro {
    /// Finds `kind` on PATH and prepares its run of `elf` (files go to `dir`).
    pub fn find(kind: Kind, elf: &Path, dir: &Path) -> Result<Micro, String> {
        let exe =
            find_on_path(kind.name()).ok_or_else(|| format!("{} is not on PATH", kind.name()))?;
        let config = dir.join(format!("{}.json", kind.name()));
        if kind == Kind::Firecracker {
            let json = serde_json::json!({
                "boot-source": {"kernel_image_path": elf, "boot_args": CMDLINE},
                "drives": [],
                "machine-config": {"vcpu_count": 1, "mem_size_mib": 128},
            });
            std::fs::write(&config, json.to_string())
                .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        }
        Ok(Micro {
            kind,
            exe,
            elf: elf.to_path_buf(),
            config,
        })
    }

    /// The probe guest's hello task, 1 vCPU, 128 MiB, console on stdout.
    pub fn command(&self, shim: bool) -> Command {
        let mut cmd = Command::new(&self.exe);
        match self.kind {
            Kind::Firecracker => {
                cmd.args(["--no-api", "--config-file"]).arg(&self.config);
            }
            Kind::CloudHypervisor => {
                cmd.arg("--kernel")
                    .arg(&self.elf)
                    .args(["--cmdline", CMDLINE, "--memory", "size=128M"])
                    .args(["--cpus", "boot=1", "--serial", "tty", "--console", "off"]);
                if shim {
                    cmd.args(["--seccomp", "false"]);
                }
            }
        }
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_lists_are_split_trimmed_and_deduplicated() {
        assert_eq!(parse_compare(None).unwrap(), Vec::<&str>::new());
        assert_eq!(parse_compare(Some("qemu")).unwrap(), ["qemu"]);
        assert_eq!(
            parse_compare(Some("firecracker, cloud-hypervisor,,qemu,firecracker")).unwrap(),
            ["firecracker", "cloud-hypervisor", "qemu"]
        );
        let e = parse_compare(Some("qemu,xen")).unwrap_err();
        assert!(
            e.starts_with("--compare \"qemu,xen\": \"xen\" is not a hypervisor")
                && e.contains("qemu, firecracker, cloud-hypervisor"),
            "{e}"
        );
    }

    #[test]
    fn the_shim_source_stamps_the_first_kvm_run() {
        assert!(SHIM_SOURCE.contains("0xAE80UL") && SHIM_SOURCE.contains(STAMP_ENV));
    }
}
