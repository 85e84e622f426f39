//! Each VMM's first `KVM_RUN`, seen from outside by the kernel's `sys_enter_ioctl`
//! tracepoint, so static binaries (which no preloaded library can enter) and processes
//! under their own seccomp filters are timed exactly like Musubi.
//!
//! The events go to a tracefs instance of this process's own, so neither the global trace
//! nor another run's instance is disturbed; dropping [`KvmRunTrace`] removes it.

use std::path::{Path, PathBuf};

/// Where tracefs is mounted (and mounted by [`KvmRunTrace::open`] when it is not).
const TRACEFS: &str = "/sys/kernel/tracing";
/// `KVM_RUN`, `_IO(KVMIO, 0x80)`.
const KVM_RUN: u32 = 0xae80;
/// `KVM_GET_CLOCK`, `_IOR(KVMIO, 0x7c, struct kvm_clock_data)` (48 bytes): a VMM reads the
/// KVM clock right after its vCPUs stop in a pause (Musubi's and Cloud Hypervisor's pause).
pub const KVM_GET_CLOCK: u32 = 0x8030_ae7c;

/// A tracefs instance recording every `KVM_RUN` ioctl on the host, with the thread group
/// of the caller and a `CLOCK_MONOTONIC` time stamp.
pub struct KvmRunTrace {
    dir: PathBuf,
}

impl KvmRunTrace {
    /// Creates and enables the instance, or says why tracing cannot be done here.
    pub fn open() -> Result<KvmRunTrace, String> {
        KvmRunTrace::open_with(&[])
    }

    /// [`open`](Self::open), recording the ioctls `also` beside `KVM_RUN` (for
    /// [`last_ns`](Self::last_ns)).
    pub fn open_with(also: &[u32]) -> Result<KvmRunTrace, String> {
        let root = Path::new(TRACEFS);
        if !root.join("instances").is_dir() {
            mount_tracefs(root)?;
        }
        let dir = root
            .join("instances")
            .join(format!("musubi-boot-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| {
            format!(
                "cannot create the tracefs instance {} (tracing needs root): {e}",
                dir.display()
            )
        })?;
        // From here on the instance exists, and dropping `trace` removes it.
        let trace = KvmRunTrace { dir };
        let event = trace.dir.join("events/syscalls/sys_enter_ioctl");
        if !event.is_dir() {
            return Err(format!(
                "{} is missing: this kernel has no syscall tracepoints (CONFIG_FTRACE_SYSCALLS)",
                event.display()
            ));
        }
        trace.write("trace_clock", "mono")?;
        trace.write("options/record-tgid", "1")?;
        // A full buffer drops new events rather than the oldest: the first KVM_RUN is the one
        // wanted.
        trace.write("options/overwrite", "0")?;
        let filter: Vec<String> = std::iter::once(KVM_RUN)
            .chain(also.iter().copied())
            // The tracepoint holds the command sign-extended to 64 bits (as it prints it).
            .map(|c| format!("cmd == {:#x}", c as i32 as i64 as u64))
            .collect();
        trace.write(
            "events/syscalls/sys_enter_ioctl/filter",
            &filter.join(" || "),
        )?;
        trace.write("events/syscalls/sys_enter_ioctl/enable", "1")?;
        Ok(trace)
    }

    /// The instance's directory, for the report.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The `CLOCK_MONOTONIC` time (ns) of the first `KVM_RUN` by thread group `tgid` since
    /// the last [`clear`](Self::clear), if there was one.
    pub fn first_run_ns(&self, tgid: u32) -> Result<Option<u64>, String> {
        Ok(self
            .events()?
            .into_iter()
            .filter(|e| e.tgid == tgid && e.cmd == Some(KVM_RUN))
            .map(|e| e.ns)
            .min())
    }

    /// The `CLOCK_MONOTONIC` time (ns) of the last ioctl `cmd` (one asked for in
    /// [`open_with`](Self::open_with)) by thread group `tgid` at or before `before`, since
    /// the last [`clear`](Self::clear).
    pub fn last_ns(&self, tgid: u32, cmd: u32, before: u64) -> Result<Option<u64>, String> {
        Ok(self
            .events()?
            .into_iter()
            .filter(|e| e.tgid == tgid && e.cmd == Some(cmd) && e.ns <= before)
            .map(|e| e.ns)
            .max())
    }

    fn events(&self) -> Result<Vec<Event>, String> {
        let path = self.dir.join("trace");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Ok(text.lines().filter_map(parse_line).collect())
    }

    /// Empties the buffer, so each run reads only its own events.
    pub fn clear(&self) -> Result<(), String> {
        self.write("trace", "")
    }

    fn write(&self, file: &str, value: &str) -> Result<(), String> {
        let path = self.dir.join(file);
        std::fs::write(&path, value)
            .map_err(|e| format!("cannot write {value:?} to {}: {e}", path.display()))
    }
}

impl Drop for KvmRunTrace {
    fn drop(&mut self) {
        let _ = self.write("events/syscalls/sys_enter_ioctl/enable", "0");
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!(
                "cannot remove the tracefs instance {}: {e}",
                self.dir.display()
            );
        }
    }
}

fn mount_tracefs(root: &Path) -> Result<(), String> {
    let fail = |e: std::io::Error| {
        format!(
            "tracefs is not mounted at {} and cannot be (`mount -t tracefs nodev {}`; needs root): {e}",
            root.display(),
            root.display()
        )
    };
    let target = std::ffi::CString::new(root.as_os_str().as_encoded_bytes())
        .map_err(|e| fail(std::io::Error::other(e)))?;
    // SAFETY: every pointer is to a NUL-terminated string that outlives the call; no data.
    let r = unsafe {
        libc::mount(
            c"nodev".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        // Another run (a test beside this one) mounted it first: that mount serves both.
        if root.join("instances").is_dir() {
            return Ok(());
        }
        return Err(fail(e));
    }
    Ok(())
}

/// One ioctl event of the trace.
#[derive(Debug, PartialEq, Eq)]
struct Event {
    tgid: u32,
    /// `CLOCK_MONOTONIC`, to the microsecond the trace prints.
    ns: u64,
    /// The ioctl's command, when the line shows it.
    cmd: Option<u32>,
}

/// An event line, `  COMM-PID  ( TGID) [CPU] FLAGS  SECS.USECS: sys_ioctl(...)`; `None` for
/// headers, other events and lines without a thread group. The command name may hold any
/// character, so the line is read from its right end.
fn parse_line(line: &str) -> Option<Event> {
    let (left, right) = line.split_once(": sys_ioctl(")?;
    let cmd = right.split_once("cmd: ").and_then(|(_, c)| {
        let c = c.split([',', ')']).next()?.trim();
        // Printed sign-extended (`0xffffffff8030ae7c`): the low 32 bits are the command.
        u64::from_str_radix(c.trim_start_matches("0x"), 16)
            .ok()
            .map(|c| c as u32)
    });
    let (before, stamp) = left.trim_end().rsplit_once(char::is_whitespace)?;
    let (secs, usecs) = stamp.split_once('.')?;
    if usecs.len() != 6 {
        return None;
    }
    let ns = secs.parse::<u64>().ok()? * 1_000_000_000 + usecs.parse::<u64>().ok()? * 1_000;
    let close = before.rfind(')')?;
    let open = before[..close].rfind('(')?;
    let tgid = before[open + 1..close].trim().parse().ok()?;
    Some(Event { tgid, ns, cmd })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lines_give_their_thread_group_and_monotonic_time() {
        let e = |tgid, ns| {
            Some(Event {
                tgid,
                ns,
                cmd: Some(KVM_RUN),
            })
        };
        assert_eq!(
            parse_line("           vcpu0-2832    (   2829) [001] .....  5272.920817: sys_ioctl(fd: 8, cmd: 0xae80, arg: 0)"),
            e(2829, 5_272_920_817_000)
        );
        assert_eq!(
            parse_line("  musubi-1234  (   1234) [001] .....  5678.123456: sys_ioctl(fd: 9, cmd: ae80, arg: 0)"),
            e(1234, 5_678_123_456_000)
        );
        // A command name with spaces, dashes and parentheses of its own.
        assert_eq!(
            parse_line(" fc_vcpu (0)-77 x-9  (     70) [000] d..1.    12.000001: sys_ioctl(fd: 20, cmd: 0xae80, arg: 0)"),
            e(70, 12_000_001_000)
        );
        assert_eq!(
            parse_line("       migrator-91     (     88) [000] .....    13.000002: sys_ioctl(fd: 5, cmd: 0xffffffff8030ae7c, arg: 0x7ffd)"),
            Some(Event {
                tgid: 88,
                ns: 13_000_002_000,
                cmd: Some(KVM_GET_CLOCK),
            })
        );
    }

    #[test]
    fn headers_unknown_groups_and_other_lines_are_not_events() {
        for line in [
            "# tracer: nop",
            "#           TASK-PID       TGID    CPU#  |||||  TIMESTAMP  FUNCTION",
            "",
            "           vcpu0-2832    (-------) [001] .....  5272.920817: sys_ioctl(fd: 8, cmd: 0xae80, arg: 0)",
            "           vcpu0-2832    (   2829) [001] .....  5272.920817: sys_read(fd: 8)",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
    }
}
