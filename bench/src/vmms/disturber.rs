//! §5.3's disturbing VM: a second `musubi run` filling a large virtio-blk disk over and
//! over while the measured VM runs, alone or in a memory cgroup made by the `partition`
//! crate's cgroup code.

use crate::watch::tail;
use partition::cgroup::{Host, Limits, PartitionCgroup};
use partition::resources::CpuList;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Disturb {
    Alone,
    Disturbed,
    Cgroup,
}

impl Disturb {
    pub(super) fn name(self) -> &'static str {
        match self {
            Disturb::Alone => "none",
            Disturb::Disturbed => "disturb",
            Disturb::Cgroup => "disturb+cgroup",
        }
    }
}

/// The disturbing VM's cgroup, made with the partition code: the memory limit under test,
/// and as CPUs and memory nodes whatever this process may use, so that only memory is
/// confined. Removed on drop, with anything left in it.
pub(super) struct DisturbCgroup {
    cg: PartitionCgroup,
}

impl DisturbCgroup {
    pub(super) fn create(limit: u64) -> Result<DisturbCgroup, String> {
        let host = Host::detect().map_err(|e| e.to_string())?;
        let cg = host
            .plan(&format!("musubi-vmms-disturb-{}", std::process::id()))
            .map_err(|e| e.to_string())?;
        let status = std::fs::read_to_string("/proc/self/status")
            .map_err(|e| format!("/proc/self/status: {e}"))?;
        let allowed = |key: &str| -> Result<CpuList, String> {
            let line = status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .ok_or_else(|| format!("/proc/self/status has no {key} line"))?;
            CpuList::parse(key, line.trim()).map_err(|e| e.to_string())
        };
        let limits = Limits {
            cpus: allowed("Cpus_allowed_list:")?,
            mems: allowed("Mems_allowed_list:")?,
            memory: limit,
            io_weight: None,
        };
        cg.create(&limits).map_err(|e| e.to_string())?;
        Ok(DisturbCgroup { cg })
    }

    /// Starts `cmd` inside the group, so every page the disturbing VM touches, its guest
    /// RAM and the host page cache of its disk, is charged to the group.
    fn spawn_in(&self, cmd: &mut Command) -> Result<Child, String> {
        self.cg.spawn_in(cmd).map_err(|e| e.to_string())
    }

    /// The group's peak memory use (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
    pub(super) fn peak(&self) -> Option<u64> {
        self.cg
            .places
            .iter()
            .filter(|p| p.controller == "memory" || p.controller == "unified")
            .flat_map(|p| ["memory.max_usage_in_bytes", "memory.peak"].map(|f| p.dir().join(f)))
            .find_map(|f| std::fs::read_to_string(f).ok()?.trim().parse().ok())
    }
}

impl Drop for DisturbCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.cg.remove(Duration::from_secs(5)) {
            eprintln!("musubi bench vmms: {e}");
        }
    }
}

/// A disturbing VM (`musubi run ... blk-fill`) kept running, restarted whenever it finishes,
/// until dropped.
pub(super) struct Disturber {
    stop: Arc<AtomicBool>,
    fills: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Disturber {
    pub(super) fn start(
        disk: PathBuf,
        cgroup: Option<Arc<DisturbCgroup>>,
    ) -> Result<Disturber, String> {
        let exe = crate::probe::musubi()?;
        let stop = Arc::new(AtomicBool::new(false));
        let fills = Arc::new(AtomicU64::new(0));
        let (stop2, fills2) = (stop.clone(), fills.clone());
        let thread = std::thread::spawn(move || -> Result<(), String> {
            let mut seed = 1u64;
            while !stop2.load(Ordering::Relaxed) {
                let mut cmd = Command::new(&exe);
                cmd.args(["run", "--kernel", "probe", "--serial", "off"])
                    .arg("--disk")
                    .arg(format!("path={}", disk.display()))
                    .arg("--cmdline")
                    .arg(format!("probe.tasks=blk-fill={seed}"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped());
                let child = match &cgroup {
                    Some(g) => g.spawn_in(&mut cmd),
                    None => cmd.spawn().map_err(|e| e.to_string()),
                };
                let mut child =
                    child.map_err(|e| format!("disturbing VM {}: {e}", exe.display()))?;
                let status = loop {
                    if stop2.load(Ordering::Relaxed) {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Ok(());
                    }
                    match child.try_wait() {
                        Ok(Some(s)) => break s,
                        Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                        Err(e) => return Err(format!("disturbing VM: wait: {e}")),
                    }
                };
                if !status.success() {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = std::io::Read::read_to_string(&mut e, &mut err);
                    }
                    return Err(format!(
                        "the disturbing VM ended with {status}: {}",
                        tail(&err, 5)
                    ));
                }
                fills2.fetch_add(1, Ordering::Relaxed);
                seed += 1;
            }
            Ok(())
        });
        // Let it boot and start writing before anything is measured.
        std::thread::sleep(Duration::from_secs(2));
        Ok(Disturber {
            stop,
            fills,
            thread: Some(thread),
        })
    }

    /// Stops the VM and says whether it kept running the whole time, and how many whole
    /// fills of its disk it finished.
    pub(super) fn finish(mut self) -> Result<u64, String> {
        self.stop.store(true, Ordering::Relaxed);
        let r = self.thread.take().map(|t| t.join());
        match r {
            Some(Ok(Ok(()))) => Ok(self.fills.load(Ordering::Relaxed)),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err("the disturbing VM's watcher panicked".into()),
            None => Ok(0),
        }
    }
}

impl Drop for Disturber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root and a writable cgroupfs, as the benchmark's cgroup condition does.
    #[test]
    fn the_cgroup_holds_what_it_starts_and_goes_away_when_dropped() {
        let g = DisturbCgroup::create(64 << 20).expect("a cgroup (run as root)");
        let dirs: Vec<PathBuf> = g.cg.places.iter().map(|p| p.dir()).collect();
        let mut cmd = Command::new("cat");
        cmd.arg("/proc/self/cgroup").stdout(Stdio::piped());
        let out = g.spawn_in(&mut cmd).unwrap().wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let name = format!("musubi-vmms-disturb-{}", std::process::id());
        assert!(
            text.lines()
                .any(|l| l.contains("memory") && l.ends_with(&name)
                    || l.starts_with("0::") && l.ends_with(&name)),
            "{text}"
        );
        let limit =
            g.cg.places
                .iter()
                .filter(|p| p.controller == "memory" || p.controller == "unified")
                .find_map(|p| {
                    ["memory.limit_in_bytes", "memory.max"]
                        .iter()
                        .find_map(|f| std::fs::read_to_string(p.dir().join(f)).ok())
                })
                .expect("a memory limit file");
        assert_eq!(limit.trim(), (64u64 << 20).to_string());
        assert!(g.peak().is_some());
        drop(g);
        for d in dirs {
            assert!(!d.exists(), "{} is left behind", d.display());
        }
    }
}
