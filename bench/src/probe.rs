//! The programs and guest the benchmarks run: the `musubi` binary beside this one, and the
//! probe guest it carries (asked of it, so both always boot the same image).

use crate::watch::{last_words, observe, observe_to_marker, time_to_marker, Watch};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;
use vmm::config::KernelImage;

/// The `musubi` binary in this program's directory, where the workspace build puts both.
pub fn musubi() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let musubi = exe.with_file_name("musubi");
    if musubi.is_file() {
        Ok(musubi)
    } else {
        Err(format!(
            "{} is missing: the benchmarks run VMs with it; build both with \
             `cargo build --release -p musubi -p musubi-bench`",
            musubi.display()
        ))
    }
}

/// The probe guest's ELF, written to the cache by `musubi guest path`, read once.
fn elf() -> Result<&'static (PathBuf, Vec<u8>), String> {
    static ELF: OnceLock<Result<(PathBuf, Vec<u8>), String>> = OnceLock::new();
    ELF.get_or_init(|| {
        let musubi = musubi()?;
        let out = std::process::Command::new(&musubi)
            .args(["guest", "path"])
            .output()
            .map_err(|e| format!("{}: {e}", musubi.display()))?;
        if !out.status.success() {
            return Err(format!(
                "`{} guest path` failed ({}): {}",
                musubi.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let data =
            std::fs::read(&path).map_err(|e| format!("the probe guest {}: {e}", path.display()))?;
        Ok((path, data))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Where the probe guest's ELF is, for hypervisors that boot it from a file.
pub fn materialize() -> Result<PathBuf, String> {
    Ok(elf()?.0.clone())
}

/// The probe guest, for VMs this program boots itself. Every experiment asks for
/// [`materialize`] before it boots anything, so the image is there by then.
pub fn image() -> KernelImage {
    let data = match elf() {
        Ok((_, data)) => data.as_slice(),
        Err(e) => panic!("the probe guest is not available: {e}"),
    };
    KernelImage::Bytes {
        name: "probe (bundled probe guest)".into(),
        data: data.into(),
    }
}

/// Result lines are read by the one parser the binary, the benchmarks and their tests share.
pub use probe_lines::{result, results};

/// How a VMM's boot of one probe task ends.
#[derive(Clone, Copy, Debug)]
pub enum Ending {
    /// It exits by itself with this status once the guest is done (Musubi's 0, QEMU's
    /// exit-port status).
    Status(i32),
    /// It has no exit port: it is stopped once the task's result line is out (Firecracker).
    AtResult,
}

/// Boots `cmd` (the VMM `vmm` running the probe guest, its console on stdout) until the
/// end of task `name`, for at most `timeout`: the task's result line if it succeeded, else
/// why not, with the VMM's last `lines` lines.
pub fn task_result(
    vmm: &str,
    cmd: Command,
    name: &str,
    ending: Ending,
    timeout: Duration,
    lines: usize,
) -> Result<Value, String> {
    let marker = format!("{{\"probe\":\"{name}\"");
    let watch = Watch {
        marker: &marker,
        guest_bytes: None,
        timeout,
        sample_every: Duration::from_millis(20),
    };
    let o = match ending {
        Ending::Status(_) => observe(cmd, &watch),
        Ending::AtResult => observe_to_marker(cmd, &watch),
    }
    .map_err(|e| format!("cannot start {vmm}: {e}"))?;
    let ended = match (ending, o.marker_ns) {
        (Ending::Status(want), _) => time_to_marker(&o, want, lines).map(|_| ()),
        (Ending::AtResult, Some(_)) => Ok(()),
        (Ending::AtResult, None) => Err(format!(
            "no {name} result line{}; {}",
            if o.timed_out { " in time" } else { "" },
            last_words(&o, lines)
        )),
    };
    let results = results(o.stdout.as_bytes());
    match (result(&results, name), ended) {
        (Some(r), Ok(())) if r["ok"] == true => Ok(r.clone()),
        (Some(r), _) => Err(format!(
            "the guest's {name} failed: {r}; {}",
            last_words(&o, lines)
        )),
        (None, Err(e)) => Err(e),
        (None, Ok(())) => Err(format!("no {name} result; {}", last_words(&o, lines))),
    }
}
