//! The `--compare` list, and Firecracker and Cloud Hypervisor as peers of `bench boot`:
//! found on `PATH`, booting the same probe guest ELF with their own seccomp filters.

use super::driver::Missing;
use super::{find_on_path, BenchArgs};
use std::path::{Path, PathBuf};
use std::process::Command;

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
}

/// A peer VMM that boots a PVH ELF directly.
#[derive(Clone, Debug)]
pub struct Micro {
    pub kind: Kind,
    pub exe: PathBuf,
    elf: PathBuf,
    /// Firecracker's configuration file (it takes no kernel on its command line).
    config: PathBuf,
    cmdline: String,
    mem_mib: u64,
}

/// The probe guest's hello task, as `bench boot` runs it everywhere.
const CMDLINE: &str = "probe.tasks=hello";

impl Micro {
    /// Finds `kind` on PATH and prepares its run of `elf` (files go to `dir`).
    pub fn find(kind: Kind, elf: &Path, dir: &Path) -> Result<Micro, String> {
        Micro::find_with(kind, elf, dir, CMDLINE, 128)
    }

    /// [`find`](Self::find) for another probe command line and RAM size (1 vCPU either way);
    /// Firecracker's configuration file is named after both, so several can share `dir`.
    pub fn find_with(
        kind: Kind,
        elf: &Path,
        dir: &Path,
        cmdline: &str,
        mem_mib: u64,
    ) -> Result<Micro, String> {
        let exe =
            find_on_path(kind.name()).ok_or_else(|| format!("{} is not on PATH", kind.name()))?;
        let config = if cmdline == CMDLINE && mem_mib == 128 {
            dir.join(format!("{}.json", kind.name()))
        } else {
            dir.join(format!("{}-{mem_mib}M.json", kind.name()))
        };
        if kind == Kind::Firecracker {
            write_firecracker_config(&config, elf, cmdline, mem_mib, None)?;
        }
        Ok(Micro {
            kind,
            exe,
            elf: elf.to_path_buf(),
            config,
            cmdline: cmdline.to_string(),
            mem_mib,
        })
    }

    /// The probe guest's tasks (hello unless [`find_with`](Self::find_with) said otherwise),
    /// 1 vCPU, 128 MiB unless said otherwise, console on stdout, no API.
    pub fn command(&self) -> Command {
        self.command_api(None)
    }

    /// Firecracker booting its ELF with `cmdline`, `mem_mib` of RAM and `device` (key and
    /// value of its configuration file, which is written to `dir/firecracker.json`), its
    /// console on stdout, no API.
    pub fn firecracker_with(
        &self,
        dir: &Path,
        cmdline: &str,
        mem_mib: u64,
        device: (&str, serde_json::Value),
    ) -> Result<Command, String> {
        let config = dir.join("firecracker.json");
        write_firecracker_config(&config, &self.elf, cmdline, mem_mib, Some(device))?;
        let mut cmd = Command::new(&self.exe);
        cmd.arg("--no-api").arg("--config-file").arg(config);
        Ok(cmd)
    }

    /// [`command`](Self::command), serving the VMM's HTTP API on the UNIX socket `api`
    /// when given (for snapshots).
    pub fn command_api(&self, api: Option<&Path>) -> Command {
        let mut cmd = Command::new(&self.exe);
        match self.kind {
            Kind::Firecracker => {
                match api {
                    Some(sock) => cmd.arg("--api-sock").arg(sock),
                    None => cmd.arg("--no-api"),
                };
                cmd.arg("--config-file").arg(&self.config);
            }
            Kind::CloudHypervisor => {
                let memory = format!("size={}M", self.mem_mib);
                cmd.arg("--kernel")
                    .arg(&self.elf)
                    .args(["--cmdline", &self.cmdline, "--memory", &memory])
                    .args(["--cpus", "boot=1", "--serial", "tty", "--console", "off"]);
                if let Some(sock) = api {
                    cmd.arg("--api-socket")
                        .arg(format!("path={}", sock.display()));
                }
            }
        }
        cmd
    }
}

/// Firecracker for a benchmark that compares with it whenever it is found (no `--compare`)
/// or when `--compare` lists it, printing what became of it: `None` when it is not asked for
/// or not found, and then, if `--compare` listed it, why in `missing`.
pub fn firecracker_peer(
    args: &BenchArgs,
    listed: &[&str],
    elf: &Path,
    dir: &Path,
    missing: &mut Missing,
) -> Option<Micro> {
    if args.compare.is_some() && !listed.contains(&"firecracker") {
        return None;
    }
    match Micro::find(Kind::Firecracker, elf, dir) {
        Ok(micro) => {
            println!("firecracker: runs with its seccomp filters");
            Some(micro)
        }
        Err(why) if listed.contains(&"firecracker") => {
            println!("firecracker: unavailable, Musubi runs alone: {why}");
            missing.push(("firecracker".into(), why));
            None
        }
        Err(why) => {
            println!("firecracker: skipped, {why}");
            None
        }
    }
}

/// Writes Firecracker's configuration file at `path`: the probe guest `elf` with
/// `cmdline`, one vCPU with `mem_mib` of RAM, no drives, and `device` if given (its key as
/// Firecracker names it, `"network-interfaces"`, `"vsock"`, ..., and its value).
fn write_firecracker_config(
    path: &Path,
    elf: &Path,
    cmdline: &str,
    mem_mib: u64,
    device: Option<(&str, serde_json::Value)>,
) -> Result<(), String> {
    let mut json = serde_json::json!({
        "boot-source": {"kernel_image_path": elf, "boot_args": cmdline},
        "drives": [],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": mem_mib},
    });
    if let (Some((key, value)), Some(o)) = (device, json.as_object_mut()) {
        o.insert(key.into(), value);
    }
    std::fs::write(path, json.to_string())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
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
}
