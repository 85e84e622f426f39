//! Whether some task on the host is waiting for a CPU right now: the count of runnable
//! tasks (`/proc/loadavg`'s fourth field, read at the instant) against the CPUs online. A
//! polling I/O thread reads it to see what vhost-net's busy poll sees as `need_resched`:
//! that its polling keeps another task from running.
//!
//! Linux's pressure files (PSI) say the same over time, but their totals move only when
//! their averages are brought up to date, a few times a second: too late for a window of
//! microseconds. The runnable count is the kernel's sum over its run queues at the read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Where Linux reports it for the whole host. A partition's CPUs are the host's too: a
/// task waiting in another partition ends this one's polling as well, which costs it only
/// the polling's gain.
pub const HOST: &str = "/proc/loadavg";

/// An open load file, read again on each look.
#[derive(Debug)]
pub struct HostLoad {
    file: File,
    cpus: u64,
    buf: [u8; 128],
}

impl HostLoad {
    /// The file at `path` and the host's online CPUs, if the file reads as a load file and
    /// the count is known; the caller polls without it otherwise.
    pub fn open(path: &Path) -> Option<HostLoad> {
        // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let mut l = HostLoad {
            file: File::open(path).ok()?,
            cpus: u64::try_from(cpus).ok().filter(|&c| c > 0)?,
            buf: [0; 128],
        };
        l.runnable().map(|_| l)
    }

    /// Tasks running or waiting to run, the caller included.
    pub fn runnable(&mut self) -> Option<u64> {
        let n = self.file.read_at(&mut self.buf, 0).ok()?;
        runnable_of(&self.buf[..n])
    }

    /// True if more tasks are runnable than there are CPUs: one of them waits.
    pub fn oversubscribed(&mut self) -> bool {
        self.runnable().is_some_and(|r| r > self.cpus)
    }
}

/// The runnable count of a load file's text: `0.52 0.58 0.59 3/250 12345` gives 3.
fn runnable_of(text: &[u8]) -> Option<u64> {
    let field = std::str::from_utf8(text)
        .ok()?
        .split_ascii_whitespace()
        .nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runnable_count_is_the_fourth_fields_numerator() {
        assert_eq!(runnable_of(b"0.52 0.58 0.59 3/250 12345\n"), Some(3));
        assert_eq!(runnable_of(b"0.00 0.01 0.05 1/97 7\n"), Some(1));
        assert_eq!(runnable_of(b"0.52 0.58 0.59\n"), None);
        assert_eq!(runnable_of(b"0.52 0.58 0.59 x/250 1\n"), None);
    }

    #[test]
    fn a_file_is_read_again_on_each_look_and_one_that_is_not_a_load_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loadavg");
        std::fs::write(&path, "0.00 0.00 0.00 1/100 5\n").unwrap();
        let mut l = HostLoad::open(&path).unwrap();
        assert_eq!(l.runnable(), Some(1));
        assert!(!l.oversubscribed());
        std::fs::write(&path, format!("0.00 0.00 0.00 {}/100 5\n", l.cpus + 1)).unwrap();
        assert!(l.oversubscribed());
        assert!(HostLoad::open(&dir.path().join("none")).is_none());
        std::fs::write(&path, "not a load file\n").unwrap();
        assert!(HostLoad::open(&path).is_none());
    }

    #[test]
    fn the_hosts_own_file_reads_with_this_thread_runnable() {
        let mut l = HostLoad::open(Path::new(HOST)).expect("/proc/loadavg reads");
        assert!(l.runnable().is_some_and(|r| r >= 1));
    }
}
