//! Watching a hypervisor process from outside: when it was spawned, when a line appeared
//! on its console, and how much memory it held beyond its guest's RAM. Measuring from the
//! parent treats every hypervisor alike, whatever it reports about itself.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// CLOCK_MONOTONIC in nanoseconds: the clock the VMM stamps its first KVM_RUN with, so the
/// two processes' times can be subtracted.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Resident memory of a process split into its guest RAM and everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rss {
    pub total: u64,
    pub guest: u64,
    /// Private_Clean + Private_Dirty: what this process alone holds, without the shared
    /// libraries' pages that `total` counts in full.
    pub private: u64,
    pub guest_private: u64,
    pub guest_mappings: usize,
    pub mappings: usize,
}

impl Rss {
    pub fn overhead(&self) -> u64 {
        self.total.saturating_sub(self.guest)
    }

    pub fn private_overhead(&self) -> u64 {
        self.private.saturating_sub(self.guest_private)
    }
}

/// Parses `/proc/PID/smaps`. Guest RAM is recognised as an anonymous mapping (no inode, no
/// path) at least `guest_bytes` long: hypervisors map the guest's RAM as one such block per
/// range, and no other anonymous mapping of a small VMM comes near that size.
pub fn parse_smaps(text: &str, guest_bytes: u64) -> Rss {
    let mut rss = Rss::default();
    let mut in_guest = false;
    for line in text.lines() {
        if let Some((size, anon)) = mapping_header(line) {
            rss.mappings += 1;
            in_guest = anon && size >= guest_bytes;
            if in_guest {
                rss.guest_mappings += 1;
            }
        } else if let Some(rest) = line.strip_prefix("Rss:") {
            let b = kib(rest);
            rss.total += b;
            if in_guest {
                rss.guest += b;
            }
        } else if let Some(rest) = line
            .strip_prefix("Private_Clean:")
            .or_else(|| line.strip_prefix("Private_Dirty:"))
        {
            let b = kib(rest);
            rss.private += b;
            if in_guest {
                rss.guest_private += b;
            }
        }
    }
    rss
}

/// Bytes from a `   123 kB` field.
fn kib(field: &str) -> u64 {
    field
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .unwrap_or(0)
        * 1024
}

/// `start-end perms offset dev inode [path]`: returns the mapping's size and whether it is
/// anonymous; `None` for the `Key: value` lines that follow each header.
fn mapping_header(line: &str) -> Option<(u64, bool)> {
    let mut f = line.split_whitespace();
    let range = f.next()?;
    let (a, b) = range.split_once('-')?;
    let start = u64::from_str_radix(a, 16).ok()?;
    let end = u64::from_str_radix(b, 16).ok()?;
    let _perms = f.next()?;
    let _offset = f.next()?;
    let _dev = f.next()?;
    let inode = f.next()?;
    let path = f.next();
    Some((end.saturating_sub(start), inode == "0" && path.is_none()))
}

/// What to watch for while a child runs.
pub struct Watch<'a> {
    /// The console line (after leading whitespace) that marks the milestone.
    pub marker: &'a str,
    pub guest_bytes: u64,
    pub timeout: Duration,
    pub sample_every: Duration,
}

/// One observed run. Times are CLOCK_MONOTONIC nanoseconds.
#[derive(Debug)]
pub struct Observed {
    pub spawn_ns: u64,
    pub marker_ns: Option<u64>,
    pub end_ns: u64,
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    /// Samples of `/proc/PID/smaps` that found the process's mappings.
    pub samples: u32,
    /// Samples in which the guest's RAM mapping was present.
    pub guest_samples: u32,
    pub max_overhead: Option<u64>,
    pub max_private_overhead: Option<u64>,
}

/// Spawns `cmd` with its console on a pipe, stamps the marker line, samples memory until it
/// ends, and kills it at the timeout.
pub fn observe(mut cmd: Command, w: &Watch) -> std::io::Result<Observed> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let spawn_ns = monotonic_ns();
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let out = child.stdout.take().expect("stdout is piped");
    let err = child.stderr.take().expect("stderr is piped");
    let marker = w.marker.to_string();
    let reader = std::thread::spawn(move || read_console(out, &marker));
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(err).read_to_string(&mut s);
        s
    });
    let mut o = Observed {
        spawn_ns,
        marker_ns: None,
        end_ns: 0,
        status: None,
        timed_out: false,
        stdout: String::new(),
        stderr: String::new(),
        samples: 0,
        guest_samples: 0,
        max_overhead: None,
        max_private_overhead: None,
    };
    let smaps = format!("/proc/{}/smaps", child.id());
    loop {
        sample(&smaps, w.guest_bytes, &mut o);
        if let Some(s) = child.try_wait()? {
            o.status = Some(s);
            break;
        }
        if started.elapsed() > w.timeout {
            o.timed_out = true;
            kill(&mut child);
            break;
        }
        std::thread::sleep(w.sample_every);
    }
    o.end_ns = monotonic_ns();
    let (stdout, marker_ns) = reader.join().unwrap_or_default();
    o.stdout = stdout;
    o.marker_ns = marker_ns;
    o.stderr = err_reader.join().unwrap_or_default();
    Ok(o)
}

fn sample(smaps: &str, guest_bytes: u64, o: &mut Observed) {
    // A process that has exited but not been reaped has an empty smaps: not a sample.
    let Ok(text) = std::fs::read_to_string(smaps) else {
        return;
    };
    let rss = parse_smaps(&text, guest_bytes);
    if rss.mappings == 0 {
        return;
    }
    o.samples += 1;
    if rss.guest_mappings > 0 {
        o.guest_samples += 1;
    }
    o.max_overhead = Some(o.max_overhead.unwrap_or(0).max(rss.overhead()));
    o.max_private_overhead = Some(
        o.max_private_overhead
            .unwrap_or(0)
            .max(rss.private_overhead()),
    );
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Reads the console to its end and returns it with the time the marker line arrived.
fn read_console(out: impl Read, marker: &str) -> (String, Option<u64>) {
    let mut r = BufReader::new(out);
    let mut all = Vec::new();
    let mut line = Vec::new();
    let mut at = None;
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if at.is_none()
            && String::from_utf8_lossy(&line)
                .trim_start()
                .starts_with(marker)
        {
            at = Some(monotonic_ns());
        }
        all.extend_from_slice(&line);
    }
    (String::from_utf8_lossy(&all).into_owned(), at)
}

/// The last `n` lines of `s`, for error messages that show what a failed child said.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0a20000 r-xp 00000000 08:01 1234 /usr/bin/musubi
Size:                128 kB
Rss:                 100 kB
Pss:                 100 kB
Private_Clean:         0 kB
Private_Dirty:         0 kB
7f0000000000-7f0008000000 rw-p 00000000 00:00 0 
Size:             131072 kB
Rss:                2048 kB
Private_Clean:         0 kB
Private_Dirty:      2048 kB
7f0010000000-7f0010800000 rw-p 00000000 00:00 0 
Size:               8192 kB
Rss:                  40 kB
7f0020000000-7f0020021000 rw-p 00000000 00:00 0 [heap]
Size:                132 kB
Rss:                 132 kB
Private_Clean:         4 kB
Private_Dirty:       128 kB
VmFlags: rd wr mr mw me ac
";

    #[test]
    fn guest_ram_is_split_from_the_rest() {
        let r = parse_smaps(SMAPS, 128 << 20);
        assert_eq!(r.mappings, 4);
        assert_eq!(r.guest_mappings, 1);
        assert_eq!(r.total, (100 + 2048 + 40 + 132) * 1024);
        assert_eq!(r.guest, 2048 * 1024);
        assert_eq!(r.overhead(), (100 + 40 + 132) * 1024);
        assert_eq!(r.private, (2048 + 132) * 1024);
        assert_eq!(r.private_overhead(), 132 * 1024);
    }

    #[test]
    fn smaller_or_file_backed_mappings_are_not_guest_ram() {
        let r = parse_smaps(SMAPS, 256 << 20);
        assert_eq!(r.guest_mappings, 0);
        assert_eq!(r.overhead(), r.total);
        let file = "7f0000000000-7f0010000000 rw-s 00000000 08:01 99 /tmp/disk.img\nRss: 4 kB\n";
        assert_eq!(parse_smaps(file, 1).guest_mappings, 0);
    }

    #[test]
    fn empty_smaps_has_no_mappings() {
        assert_eq!(parse_smaps("", 1), Rss::default());
    }

    #[test]
    fn observes_a_marker_line_and_the_exit() {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "echo booting; echo '  {\"probe\":\"hello\"}'; sleep 0.05; exit 3",
        ]);
        let o = observe(
            cmd,
            &Watch {
                marker: "{\"probe\":\"hello\"",
                guest_bytes: 1 << 40,
                timeout: Duration::from_secs(20),
                sample_every: Duration::from_millis(2),
            },
        )
        .unwrap();
        assert_eq!(o.status.unwrap().code(), Some(3));
        assert!(!o.timed_out);
        let at = o.marker_ns.expect("marker seen");
        assert!(at >= o.spawn_ns && at <= o.end_ns);
        assert!(o.stdout.starts_with("booting\n"));
        assert!(o.samples >= 1, "the shell was sampled while it slept");
        assert_eq!(o.guest_samples, 0);
    }

    #[test]
    fn a_child_past_its_time_is_killed() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let o = observe(
            cmd,
            &Watch {
                marker: "x",
                guest_bytes: 1,
                timeout: Duration::from_millis(100),
                sample_every: Duration::from_millis(5),
            },
        )
        .unwrap();
        assert!(o.timed_out);
        assert!(o.marker_ns.is_none());
        assert!(o.end_ns - o.spawn_ns < 10_000_000_000);
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
