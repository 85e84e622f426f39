//! Watching a hypervisor process from outside: when it was spawned, when a line appeared
//! on its console, and how much memory it held beyond its guest's RAM. Measuring from the
//! parent treats every hypervisor alike, whatever it reports about itself.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

// The clock the VMM stamps its first KVM_RUN with, so the two processes' times can be
// subtracted.
use vmm::monotonic_ns;

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
    /// The guest's RAM size, to tell its mapping from the VMM's own memory; `None` leaves
    /// memory unsampled, for runs whose timing a sampler on the same cores would disturb.
    pub guest_bytes: Option<u64>,
    pub timeout: Duration,
    pub sample_every: Duration,
}

/// One observed run. Times are CLOCK_MONOTONIC nanoseconds.
#[derive(Debug)]
pub struct Observed {
    /// The process spawned (its thread group id), to find its events in a kernel trace.
    pub pid: u32,
    pub spawn_ns: u64,
    pub marker_ns: Option<u64>,
    pub end_ns: u64,
    /// `None` when the run was killed at its timeout.
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

/// How long the console readers may take to finish once the child's process group is
/// gone; only a process that left the group (a daemon) can still hold the pipes then.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// Spawns `cmd` with its console on a pipe, stamps the marker line, samples memory until it
/// ends, and kills it at the timeout.
pub fn observe(cmd: Command, w: &Watch) -> std::io::Result<Observed> {
    observe_with(cmd, w, false)
}

/// [`observe`], but the child is killed as soon as the marker line arrives: for a VMM that
/// has no exit port and would otherwise run (or reboot the guest) until the timeout.
pub fn observe_to_marker(cmd: Command, w: &Watch) -> std::io::Result<Observed> {
    observe_with(cmd, w, true)
}

fn observe_with(mut cmd: Command, w: &Watch, stop_at_marker: bool) -> std::io::Result<Observed> {
    let spawn_ns = monotonic_ns();
    let started = Instant::now();
    let mut child = spawn_in_own_group(&mut cmd)?;
    let out = child.stdout.take().expect("stdout is piped");
    let err = child.stderr.take().expect("stderr is piped");
    let marker = w.marker.to_string();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen_by_reader = seen.clone();
    let reader = std::thread::spawn(move || read_console(out, &marker, &seen_by_reader));
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(err).read_to_string(&mut s);
        s
    });
    let mut o = Observed {
        pid: child.id(),
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
    let ended = loop {
        if let Some(guest_bytes) = w.guest_bytes {
            sample(&smaps, guest_bytes, &mut o);
        }
        if stop_at_marker && seen.load(std::sync::atomic::Ordering::Acquire) {
            break Ok(());
        }
        match has_ended(&child) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        if started.elapsed() > w.timeout {
            o.timed_out = true;
            break Ok(());
        }
        std::thread::sleep(w.sample_every);
    };
    o.end_ns = monotonic_ns();
    // Whether it ended or ran out of time, nothing it started outlives the run.
    kill_group(&child);
    let status = child.wait();
    ended?;
    if !o.timed_out {
        o.status = Some(status?);
    }
    let deadline = Instant::now() + DRAIN_LIMIT;
    let (stdout, marker_ns) = join_by(reader, deadline).unwrap_or_default();
    o.stdout = stdout;
    o.marker_ns = marker_ns;
    o.stderr = join_by(err_reader, deadline).unwrap_or_default();
    Ok(o)
}

/// Starts `cmd` with stdin closed and its output on pipes, in a process group of its own,
/// so that killing the group ends whatever it started (a wrapper script's children too),
/// and with SIGTERM as its parent-death signal, so that a benchmark stopped by Ctrl-C or a
/// test's time limit leaves no VM running (the terminal's SIGINT no longer reaches it).
fn spawn_in_own_group(cmd: &mut Command) -> std::io::Result<Child> {
    spawn_group(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()))
}

/// [`spawn_in_own_group`] with stdout and stderr wherever `cmd` already sends them (a file,
/// for a VMM whose console is polled rather than piped).
pub(crate) fn spawn_group(cmd: &mut Command) -> std::io::Result<Child> {
    spawn_group_with_stdin(cmd, Stdio::null())
}

/// [`spawn_group`] with `stdin` as its standard input (a pipe, for a console the
/// benchmark types into).
pub(crate) fn spawn_group_with_stdin(cmd: &mut Command, stdin: Stdio) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(stdin).process_group(0);
    // SAFETY: the closure calls only prctl, which is async-signal-safe, and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Whether the child has ended, without reaping it: until it is reaped its pid, which is
/// also its process group's id, cannot be reused, so [`kill_group`] cannot hit a stranger.
pub(crate) fn has_ended(child: &Child) -> std::io::Result<bool> {
    Ok(ended_with(child)?.is_some())
}

/// How the child ended, if it has, without reaping it (see [`has_ended`]): its exit code,
/// or `None` inside when a signal ended it.
pub(crate) fn ended_with(child: &Child) -> std::io::Result<Option<Option<i32>>> {
    // SAFETY: an all-zero siginfo_t is valid for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child with a valid out-parameter.
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            child.id() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: waitid filled `info`; si_pid is 0 when the child has not ended, and
    // si_status is its exit code when si_code is CLD_EXITED.
    Ok(unsafe { info.si_pid() != 0 }
        .then(|| (info.si_code == libc::CLD_EXITED).then(|| unsafe { info.si_status() })))
}

/// SIGKILLs the child's process group; called before the child is reaped.
pub(crate) fn kill_group(child: &Child) {
    // SAFETY: kill(2) has no memory-safety preconditions; the group is the one the
    // unreaped child leads.
    unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
}

/// The thread's result if it finishes by `deadline`; otherwise the thread is left to end
/// on its own and `None` is returned, so a pipe held open elsewhere cannot hang the caller.
fn join_by<T>(t: std::thread::JoinHandle<T>, deadline: Instant) -> Option<T> {
    while !t.is_finished() {
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    t.join().ok()
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

/// Reads the console to its end and returns it with the time the marker line arrived.
fn read_console(
    out: impl Read,
    marker: &str,
    seen: &std::sync::atomic::AtomicBool,
) -> (String, Option<u64>) {
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
            seen.store(true, std::sync::atomic::Ordering::Release);
        }
        all.extend_from_slice(&line);
    }
    (String::from_utf8_lossy(&all).into_owned(), at)
}

/// The time from spawn to the marker line of a run that ended with status `want`, or why
/// the run does not count, on one line: how it ended and the last `lines` lines of its
/// stderr (else of its console).
pub fn time_to_marker(o: &Observed, want: i32, lines: usize) -> Result<u64, String> {
    use std::os::unix::process::ExitStatusExt;
    let ended = match (o.timed_out, o.status) {
        (true, _) => format!(
            "still running after {:.0} s, killed",
            o.end_ns.saturating_sub(o.spawn_ns) as f64 / 1e9
        ),
        (false, Some(s)) if s.code() == Some(want) => match o.marker_ns {
            Some(at) => return Ok(at.saturating_sub(o.spawn_ns)),
            None => format!("exited with status {want} but without the marker line"),
        },
        (false, Some(s)) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with status {c}, not {want}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            (None, None) => format!("ended with {s}"),
        },
        (false, None) => "ended without a status".into(),
    };
    Err(format!("{ended}; {}", last_words(o, lines)))
}

/// The last `n` lines of a run's stderr, else of its console, on one line.
pub fn last_words(o: &Observed, n: usize) -> String {
    let (what, text) = if o.stderr.trim().is_empty() {
        ("console", &o.stdout)
    } else {
        ("stderr", &o.stderr)
    };
    let said: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if said.is_empty() {
        format!("{what}: (nothing)")
    } else {
        format!(
            "{what}: {}",
            said[said.len().saturating_sub(n)..].join(" | ")
        )
    }
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
                guest_bytes: Some(1 << 40),
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
    fn observing_to_the_marker_ends_the_child_there() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo '{\"probe\":\"hello\"}'; sleep 30"]);
        let o = observe_to_marker(
            cmd,
            &Watch {
                marker: "{\"probe\":\"hello\"",
                guest_bytes: None,
                timeout: Duration::from_secs(20),
                sample_every: Duration::from_millis(2),
            },
        )
        .unwrap();
        assert!(o.marker_ns.is_some());
        assert!(
            !o.timed_out,
            "it was killed at the marker, not at the time limit"
        );
    }

    #[test]
    fn a_child_past_its_time_is_killed() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let o = observe(
            cmd,
            &Watch {
                marker: "x",
                guest_bytes: Some(1),
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
    fn what_a_timed_out_child_started_dies_with_it() {
        let mut cmd = Command::new("sh");
        // The background sleep holds the console pipe: unless it is killed too, the
        // console never ends.
        cmd.args(["-c", "sleep 30 & echo $!; wait"]);
        let o = observe(
            cmd,
            &Watch {
                marker: "x",
                guest_bytes: None,
                timeout: Duration::from_millis(300),
                sample_every: Duration::from_millis(5),
            },
        )
        .unwrap();
        assert!(o.timed_out);
        assert!(o.status.is_none());
        assert_eq!(o.samples, 0, "memory was not to be sampled");
        let pid: u32 = o
            .stdout
            .trim()
            .parse()
            .expect("the shell printed its child's pid");
        // Dead: gone, or a zombie waiting for its new parent to reap it. SIGKILL is sent
        // by the time observe returns, but the process may still be on its way out.
        let dead = |stat: &str| {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            stat.is_empty() || state.starts_with('Z') || !stat.contains("(sleep)")
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        while !dead(&stat) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        }
        assert!(dead(&stat), "the shell's sleep {pid} still runs: {stat}");
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
