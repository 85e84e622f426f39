//! How busy the VMM under test kept the host's CPUs while a stream ran: the CPU time of
//! every thread of the other processes in the calling thread's network namespace, read from
//! outside through `/proc` (no code loaded into any VMM), split into vCPU threads and the
//! rest. A stream whose vCPU threads were busy the whole time was bound by its guest, which
//! every VMM runs alike; one whose other threads were, by the VMM's own side.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// CPUs kept busy on average (CPU seconds per second) between a [`Mark`] and its `since`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Busy {
    pub vcpu: f64,
    pub other: f64,
}

/// The namespace's threads' CPU times at one moment.
pub(crate) struct Mark {
    at: Instant,
    /// Per (pid, tid): whether it is a vCPU thread, and its CPU time in ns.
    threads: HashMap<(u32, u32), (bool, u64)>,
}

impl Mark {
    pub(crate) fn now() -> Mark {
        Mark {
            at: Instant::now(),
            threads: threads(),
        }
    }

    /// The CPUs the threads kept busy since the mark; a thread born since counts from
    /// nothing, one that ended since is lost (the VMM outlives the stream it serves).
    pub(crate) fn since(&self) -> Busy {
        let wall = self.at.elapsed().as_secs_f64();
        let mut ns = (0u64, 0u64);
        for (id, (vcpu, now)) in threads() {
            let before = self.threads.get(&id).map_or(0, |t| t.1);
            let spent = now.saturating_sub(before);
            if vcpu {
                ns.0 += spent;
            } else {
                ns.1 += spent;
            }
        }
        if wall <= 0.0 {
            return Busy::default();
        }
        Busy {
            vcpu: ns.0 as f64 / 1e9 / wall,
            other: ns.1 as f64 / 1e9 / wall,
        }
    }
}

/// Whether a thread of that name runs a vCPU: Musubi's `vcpu0`, Firecracker's `fc_vcpu 0`,
/// QEMU's `CPU 0/KVM`.
fn is_vcpu(name: &str) -> bool {
    name.contains("vcpu") || (name.starts_with("CPU ") && name.ends_with("/KVM"))
}

/// Every thread of the other processes in this thread's network namespace, with its CPU
/// time. A process or thread that ends while it is read is skipped.
fn threads() -> HashMap<(u32, u32), (bool, u64)> {
    let mut out = HashMap::new();
    let Ok(ours) = std::fs::read_link("/proc/thread-self/ns/net") else {
        return out;
    };
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me || std::fs::read_link(p.path().join("ns/net")).ok() != Some(ours.clone()) {
            continue;
        }
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(entry) = thread(&t.path()) {
                out.insert((pid, tid), entry);
            }
        }
    }
    out
}

/// A thread's kind and CPU time: `schedstat`'s first field, in ns.
fn thread(dir: &Path) -> Option<(bool, u64)> {
    let name = std::fs::read_to_string(dir.join("comm")).ok()?;
    let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
    let ns = stat.split_whitespace().next()?.parse().ok()?;
    Some((is_vcpu(name.trim_end()), ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_threads_of_each_vmm_are_told_from_the_rest() {
        for name in ["vcpu0", "vcpu12", "fc_vcpu 0", "CPU 0/KVM", "CPU 3/KVM"] {
            assert!(is_vcpu(name), "{name}");
        }
        for name in [
            "virtio-io",
            "fc_api",
            "qemu-system-x86",
            "IO mon_iothread",
            "CPU",
        ] {
            assert!(!is_vcpu(name), "{name}");
        }
    }

    #[test]
    fn another_process_of_the_namespace_is_read_and_this_one_left_out() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        let id = (child.id(), child.id());
        let first = threads().get(&id).copied();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let then = threads().get(&id).copied();
        let me = std::process::id();
        let ours = threads().keys().any(|&(pid, _)| pid == me);
        let _ = child.kill();
        let _ = child.wait();
        let (Some((false, a)), Some((false, b))) = (first, then) else {
            panic!("the spinning child was not read: {first:?} {then:?}");
        };
        assert!(b > a, "its CPU time grew: {a} then {b}");
        assert!(!ours, "the bench's own threads are left out");
    }
}
