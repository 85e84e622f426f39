//! Replication of the probe guest to a standby on loopback (`run --replicate-to`, `run
//! --standby-for`): a primary killed mid-task has its task ended by the standby as an
//! uninterrupted run would end it; a standby killed leaves the primary running alone;
//! strangers at the standby's port are refused and it waits on.
//!
//! Every wait here is bounded and waits for something it can read (a console line, a
//! listening socket, the primary's metrics, a process's end), never for time to pass.

mod common;
use common::*;
use musubi_types::{Metrics, ReplicationState};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every musubi process here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(150);
const MEMORY: &str = "128M";
/// Several seconds of work, so a primary killed once a few epochs are acknowledged is
/// killed mid-task, even on a loaded machine.
const FIB_N: u64 = 46;
const HELLO: &str = "{\"probe\":\"hello\"";
const DONE: &str = "probe: done, exit status 0";
/// The standby's silence bound here: long enough that a loaded machine's stall of the
/// primary is not taken for its death (a killed primary closes the link at once).
const HEARTBEAT_MS: &str = "1000";
/// Epochs acknowledged before a process is killed: the standby holds more than the first.
const EPOCHS_BEFORE_KILL: u64 = 3;
/// `mem-check` rounds here: twelve times the migration tests', since an epoch that carries
/// most of its 64 MiB takes seconds in a debug build or on a loaded machine, and the primary
/// must die mid-task, after the epochs it waits for.
const ROUNDS: u64 = 12 * MEM_CHECK_ROUNDS;

/// `musubi run --standby-for tcp:127.0.0.1:PORT`, its console in `serial`, listening once
/// this returns.
fn start_standby(port: u16, secret: &Path, serial: &Path) -> Started {
    start_standby_with(port, secret, serial, &[])
}

/// [`start_standby`] with `extra` flags (its own `--disk` copies).
fn start_standby_with(port: u16, secret: &Path, serial: &Path, extra: &[&str]) -> Started {
    let url = format!("tcp:127.0.0.1:{port}");
    let serial = format!("file={}", serial.display());
    let mut args = vec![
        "run",
        "--standby-for",
        &url,
        "--secret-file",
        secret.to_str().unwrap(),
        "--heartbeat",
        HEARTBEAT_MS,
        "--serial",
        &serial,
        "--timeout",
        "120",
    ];
    args.extend_from_slice(extra);
    start_listening(&args, port, LIMIT)
}

/// A primary VM running `tasks`, replicating to the standby on `port`, its console in
/// `dir/NAME.out` and its metrics in `dir/NAME-metrics.json`.
struct Primary {
    vm: Started,
    serial: PathBuf,
    metrics: PathBuf,
    socket: PathBuf,
}

fn start_primary(
    dir: &Path,
    name: &str,
    port: u16,
    secret: &Path,
    tasks: &str,
    memory: &str,
) -> Primary {
    start_primary_with(dir, name, port, secret, tasks, memory, &[])
}

/// [`start_primary`] with `extra` flags (its `--disk`).
fn start_primary_with(
    dir: &Path,
    name: &str,
    port: u16,
    secret: &Path,
    tasks: &str,
    memory: &str,
    extra: &[&str],
) -> Primary {
    let url = format!("tcp:127.0.0.1:{port}");
    let mut flags = vec![
        "--replicate-to",
        &url,
        "--secret-file",
        secret.to_str().unwrap(),
    ];
    flags.extend_from_slice(extra);
    start_vm(dir, name, tasks, memory, &flags)
}

/// The probe guest running `tasks` with `extra` flags, its console, metrics and API socket
/// as [`start_primary`] has them.
fn start_vm(dir: &Path, name: &str, tasks: &str, memory: &str, extra: &[&str]) -> Primary {
    let serial = dir.join(format!("{name}.out"));
    let metrics = dir.join(format!("{name}-metrics.json"));
    let socket = dir.join(format!("{name}.sock"));
    let console = format!("file={}", serial.display());
    let mut flags = vec![
        "--memory",
        memory,
        "--serial",
        &console,
        "--metrics",
        metrics.to_str().unwrap(),
        "--api-socket",
        socket.to_str().unwrap(),
    ];
    flags.extend_from_slice(extra);
    let args = probe_args(tasks, &flags);
    let vm = start_command(musubi(), &args, None);
    Primary {
        vm,
        serial,
        metrics,
        socket,
    }
}

impl Primary {
    /// The primary's metrics as of now (SIGUSR1 has it write them).
    fn metrics_now(&self) -> Option<Metrics> {
        let _ = std::fs::remove_file(&self.metrics);
        // SAFETY: kill(2) on our own child, not yet waited for.
        unsafe { libc::kill(self.vm.child.id() as libc::pid_t, libc::SIGUSR1) };
        let mut m = None;
        wait_until(Duration::from_secs(5), || {
            m = std::fs::read_to_string(&self.metrics)
                .ok()
                .and_then(|t| serde_json::from_str::<Metrics>(&t).ok());
            m.is_some()
        });
        m
    }

    /// Epochs the standby has acknowledged as of now.
    fn acked(&self) -> Option<u64> {
        self.metrics_now()?.replication.map(|r| r.epochs_acked)
    }

    /// Waits until its console shows hello and the standby holds an epoch whose checkpoint
    /// came after that (the console is not held back, so the standby of an earlier epoch
    /// would print hello again), and at least [`EPOCHS_BEFORE_KILL`] epochs; returns its
    /// metrics then.
    fn wait_protected(&mut self) -> Metrics {
        let serial = self.serial.clone();
        self.vm.wait_for_text(&serial, HELLO, LIMIT);
        // Epoch `seen` had not been acknowledged when hello was seen, so the checkpoint of
        // the epoch after it came later.
        let seen = self.acked().unwrap_or(0);
        let want = EPOCHS_BEFORE_KILL.max(seen + 2);
        let mut last = None;
        let done = wait_until(LIMIT, || {
            last = self.metrics_now();
            let acked = last.as_ref().and_then(|m| m.replication.as_ref());
            acked.is_some_and(|r| r.epochs_acked >= want)
                || self.vm.child.try_wait().ok().flatten().is_some()
        });
        let r = last.as_ref().and_then(|m| m.replication.clone());
        assert!(
            done && r.as_ref().is_some_and(|r| r.epochs_acked >= want),
            "the standby acknowledged too few epochs (want {want}), or the primary ended: {r:?}"
        );
        last.unwrap()
    }

    fn kill(&mut self) {
        self.vm.child.kill().unwrap();
    }
}

/// Primary and standby with `tasks`; the primary killed once protected, mid-task. Returns
/// the standby's console once it has ended the tasks, and its stderr.
fn taken_over_mid_task(seed: u8, tasks: &str, memory: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    taken_over_mid_task_with(dir.path(), seed, tasks, memory, &[], &[])
}

/// [`taken_over_mid_task`] in `dir`, with `primary_flags` and `standby_flags` added.
fn taken_over_mid_task_with(
    dir: &Path,
    seed: u8,
    tasks: &str,
    memory: &str,
    primary_flags: &[&str],
    standby_flags: &[&str],
) -> (String, String) {
    taken_over_from(dir, seed, standby_flags, |port, key| {
        start_primary_with(dir, "primary", port, key, tasks, memory, primary_flags)
    })
}

/// [`taken_over_mid_task_with`], the primary started by `start` (given the standby's port
/// and the secret file).
fn taken_over_from(
    dir: &Path,
    seed: u8,
    standby_flags: &[&str],
    start: impl FnOnce(u16, &Path) -> Primary,
) -> (String, String) {
    let key = secret_file(dir, "secret", seed);
    let port = free_port();
    let standby_serial = dir.join("standby.out");
    let standby = start_standby_with(port, &key, &standby_serial, standby_flags);
    let standby_guard = KillOnPanic::new(&standby);
    let mut primary = start(port, &key);
    let m = primary.wait_protected();
    let r = m.replication.expect("replication metrics");
    assert_eq!(r.state, ReplicationState::Protected, "{r:?}");
    assert!(r.epochs_sent >= r.epochs_acked && r.bytes_sent > 0, "{r:?}");
    assert!(r.pause_us_max >= r.pause_us_median, "{r:?}");
    assert!(
        !standby_serial.exists() || !read_text(&standby_serial).contains("probe"),
        "the standby ran the VM while the primary lived:\n{}",
        read_text(&standby_serial)
    );
    primary.kill();
    let p = primary.vm.finish(LIMIT);
    assert_eq!(p.code, None, "the primary was killed: {}", p.explain());
    let before = read_text(&primary.serial);
    assert!(
        !before.contains(DONE),
        "the primary ended its tasks before it was killed:\n{before}"
    );
    standby_guard.defuse();
    let s = standby.finish(LIMIT);
    let text = read_text(&standby_serial);
    assert_eq!(
        s.code,
        Some(0),
        "standby: {}\nconsole:\n{text}",
        s.explain()
    );
    assert!(text.contains(DONE), "standby console:\n{text}");
    assert!(
        !results_in(&text).iter().any(|v| v["probe"] == "hello"),
        "the standby ran hello again, so it booted instead of taking over:\n{text}"
    );
    assert!(
        s.stderr.contains("was lost") && s.stderr.contains("taking over from epoch"),
        "{}",
        s.explain()
    );
    (text, s.stderr)
}

#[test]
fn fib_ends_exactly_on_the_standby_after_the_primary_is_killed_mid_task() {
    let (text, _) = taken_over_mid_task(21, &format!("hello,fib={FIB_N}"), MEMORY);
    let f = result_in(&text, "fib");
    assert_eq!(
        (u(&f["n"]), u(&f["result"])),
        (FIB_N, fib_value(FIB_N)),
        "{text}"
    );
}

#[test]
fn mem_check_reads_back_every_byte_on_the_standby_after_the_primary_is_killed() {
    let (text, _) = taken_over_mid_task(
        22,
        &format!("hello,mem-check={MEM_CHECK_MIB},iters={ROUNDS}"),
        MEM_CHECK_MEMORY,
    );
    assert_mem_check(&text, ROUNDS);
}

/// The disk the blk tests fill, on each side: small enough for two copies in a temporary
/// directory.
const DISK_BYTES: usize = 256 << 20;
const FILL_SEED: u64 = 31;
/// The least time a fill across a failover takes (the probe's `ms=`): the primary is killed
/// two epochs after it resumes, which on a loaded machine with the fill's pages or writes in
/// each epoch took over two seconds, longer than an unpaced fill of a memory region.
const FILL_MS: u64 = 8_000;

/// CRC-32 of a disk of `len` bytes after `blk-fill=seed`.
fn fill_crc(len: usize, seed: u64) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut chunk = vec![0u8; 1 << 20];
    for start in (0..len).step_by(chunk.len()) {
        let n = chunk.len().min(len - start);
        for (i, b) in chunk[..n].iter_mut().enumerate() {
            *b = fill_byte((start + i) as u64, seed);
        }
        h.update(&chunk[..n]);
    }
    h.finalize()
}

/// A primary running `tasks` with `flags`, paused from hello until the standby is
/// protected and then resumed: a task that starts right after hello would otherwise outrun
/// the first epochs (all of RAM) on a loaded machine, and end before the kill.
fn paused_until_protected(
    dir: &Path,
    port: u16,
    key: &Path,
    tasks: &str,
    flags: &[&str],
) -> Primary {
    let mut p = start_primary_with(dir, "primary", port, key, tasks, MEMORY, flags);
    let serial = p.serial.clone();
    p.vm.wait_for_text(&serial, HELLO, LIMIT);
    let paused = remote(&p.socket, &["pause"]);
    assert_eq!(paused.code, Some(0), "{}", paused.explain());
    p.wait_protected();
    let resumed = remote(&p.socket, &["resume"]);
    assert_eq!(resumed.code, Some(0), "{}", resumed.explain());
    p
}

/// A primary with `flags` whose standby refuses it: waits until its metrics say the
/// standby is lost (its VM runs a task that lasts until it is killed, so the refusal is
/// what ends the replication, not the VM), kills it and returns how it ended. `name` names
/// its console, metrics and API socket in `dir`, new for each primary (a killed one's
/// console would show hello before the next has its signal handlers).
fn refused_primary(dir: &Path, name: &str, port: u16, key: &Path, flags: &[&str]) -> Run {
    let mut primary = start_primary_with(dir, name, port, key, "hello,spin=0", MEMORY, flags);
    // Asked for metrics (SIGUSR1) only once it runs the guest, with its handler set.
    let serial = primary.serial.clone();
    primary.vm.wait_for_text(&serial, HELLO, LIMIT);
    let mut last = None;
    let lost = wait_until(LIMIT, || {
        last = primary.metrics_now().and_then(|m| m.replication);
        last.as_ref()
            .is_some_and(|r| r.state == ReplicationState::Lost)
    });
    primary.kill();
    let p = primary.vm.finish(LIMIT);
    assert!(
        lost,
        "the primary never lost its standby: {last:?}\n{}",
        p.explain()
    );
    p
}

/// A standby given `standby_flags` refuses a primary given `primary_flags`: the primary
/// says so on its stderr with each of `says` and runs alone; the standby names `says[0]`,
/// keeps waiting (it is killed here) and never ran the VM.
fn refused_by_standby(
    dir: &Path,
    name: &str,
    key: &Path,
    primary_flags: &[&str],
    standby_flags: &[&str],
    says: &[&str],
) {
    let port = free_port();
    let standby_serial = dir.join("standby.out");
    let mut standby = start_standby_with(port, key, &standby_serial, standby_flags);
    let guard = KillOnPanic::new(&standby);
    let p = refused_primary(dir, name, port, key, primary_flags);
    assert!(
        p.stderr.contains("the standby refused the VM")
            && says.iter().all(|w| p.stderr.contains(w))
            && p.stderr.contains("runs alone"),
        "{}",
        p.explain()
    );
    assert!(
        standby.child.try_wait().unwrap().is_none(),
        "the standby ended"
    );
    guard.defuse();
    standby.child.kill().unwrap();
    let s = standby.finish(LIMIT);
    assert!(s.stderr.contains(says[0]), "{}", s.explain());
    assert!(!standby_serial.exists() || !read_text(&standby_serial).contains("probe"));
}

#[test]
fn a_standby_whose_disk_copy_differs_in_size_or_content_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 27);
    let primary_img = temp_image(dir.path(), "primary.img", DISK_BYTES);
    let primary_disk = format!("path={}", primary_img.display());
    let short = temp_image(dir.path(), "short.img", DISK_BYTES / 2);
    let other = temp_image(dir.path(), "other.img", DISK_BYTES);
    std::fs::write(&other, vec![1u8; DISK_BYTES]).unwrap();
    for (copy, why) in [(&short, "same size"), (&other, "differs from the primary")] {
        let copy_disk = format!("path={}", copy.display());
        let name = format!("primary-{}", why.replace(' ', "-"));
        let named = copy.display().to_string();
        refused_by_standby(
            dir.path(),
            &name,
            &key,
            &["--disk", &primary_disk],
            &["--disk", &copy_disk],
            &[&named, why],
        );
    }
}

/// The memory-storage file the pmem test fills, on each side: many pages, each of whose
/// first store in an epoch faults for the dirty log.
const PMEM_BYTES: usize = 256 << 20;

/// CRC-32 of the file at `path`, read a piece at a time (the pmem files are large).
fn file_crc(path: &Path) -> u32 {
    crc_of(std::fs::File::open(path).unwrap())
}

fn crc_of(mut f: impl std::io::Read) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf).unwrap() {
            0 => return h.finalize(),
            n => h.update(&buf[..n]),
        }
    }
}

/// A file of `bytes` zeros at `dir/name`, written a piece at a time.
fn zero_file(dir: &Path, name: &str, bytes: usize) -> PathBuf {
    let p = dir.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..bytes / zeros.len() {
        f.write_all(&zeros).unwrap();
    }
    p
}

/// Storage the guest fills across the primary's death: a disk or a memory-storage region.
struct Filled {
    /// `--disk` or `--pmem`, and the key naming the file in its value.
    flag: &'static str,
    key: &'static str,
    /// The probe's tasks (`blk` or `pmem`) and the key of their results' list.
    tasks: &'static str,
    list: &'static str,
    bytes: usize,
    seed: u8,
}

/// The primary fills `s` and is killed during the fill; the standby ends it. The standby
/// went on from the last epoch and did not store again what the primary had stored before
/// it died, so the storage reads back whole (in the guest and in the standby's file) only
/// if the primary's stores reached the standby's copy.
fn filled_across_a_failover(s: Filled) {
    let dir = tempfile::tempdir().unwrap();
    let primary_file = zero_file(dir.path(), "primary.img", s.bytes);
    let standby_file = zero_file(dir.path(), "standby.img", s.bytes);
    let (fill, crc) = (format!("{}-fill", s.tasks), format!("{}-crc", s.tasks));
    let tasks = format!("hello,{fill}={FILL_SEED},ms={FILL_MS},{crc}");
    let primary_flag = format!("{}={}", s.key, primary_file.display());
    let standby_flag = format!("{}={}", s.key, standby_file.display());
    let (text, _) = taken_over_from(dir.path(), s.seed, &[s.flag, &standby_flag], |port, key| {
        paused_until_protected(dir.path(), port, key, &tasks, &[s.flag, &primary_flag])
    });
    let before = read_text(&dir.path().join("primary.out"));
    assert!(
        !results_in(&before)
            .iter()
            .any(|v| v["probe"] == fill.as_str()),
        "the fill ended before the primary died, so it says nothing of replication:\n{before}"
    );
    assert_ne!(
        file_crc(&primary_file),
        crc_of(std::io::Read::take(std::io::repeat(0), s.bytes as u64)),
        "the primary had stored nothing when it died"
    );
    let want = format!("{:#010x}", fill_crc(s.bytes, FILL_SEED));
    let c = result_in(&text, &crc);
    let r = &c[s.list][0];
    assert_eq!(
        (u(&r["bytes"]), r["crc32"].as_str().unwrap()),
        (s.bytes as u64, want.as_str()),
        "{text}"
    );
    let f = result_in(&text, &fill);
    assert_eq!(
        (&f["seed"], &f["ok"]),
        (&FILL_SEED.into(), &true.into()),
        "{text}"
    );
    assert_eq!(format!("{:#010x}", file_crc(&standby_file)), want);
}

#[test]
fn a_disk_filled_across_the_primarys_death_reads_back_on_the_standby_as_the_guest_wrote_it() {
    filled_across_a_failover(Filled {
        flag: "--disk",
        key: "path",
        tasks: "blk",
        list: "disks",
        bytes: DISK_BYTES,
        seed: 26,
    });
}

#[test]
fn a_pmem_region_filled_across_the_primarys_death_reads_back_on_the_standby_as_the_guest_wrote_it()
{
    filled_across_a_failover(Filled {
        flag: "--pmem",
        key: "file",
        tasks: "pmem",
        list: "regions",
        bytes: PMEM_BYTES,
        seed: 30,
    });
}

#[test]
fn a_standby_whose_pmem_copy_differs_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 31);
    const BYTES: usize = 2 << 20;
    let primary_file = temp_image(dir.path(), "primary.pmem", BYTES);
    let primary_pmem = format!("file={}", primary_file.display());
    let other = dir.path().join("other.pmem");
    std::fs::write(&other, vec![1u8; BYTES]).unwrap();
    let copy_pmem = format!("file={}", other.display());
    let named = format!("--pmem file={}", other.display());
    refused_by_standby(
        dir.path(),
        "primary",
        &key,
        &["--pmem", &primary_pmem],
        &["--pmem", &copy_pmem],
        &[&named, "differs from the primary"],
    );
    // Refused before anything was written: the copy is as it was given.
    assert_eq!(std::fs::read(&other).unwrap(), vec![1u8; BYTES]);
}

#[test]
fn an_operators_pause_and_resume_wait_out_checkpoints_and_the_standby_still_ends_the_task() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = format!("hello,fib={FIB_N}");
    let (text, _) = taken_over_from(dir.path(), 29, &[], |port, key| {
        let flags = ["--epoch", "2"];
        let mut p = start_primary_with(dir.path(), "primary", port, key, &tasks, MEMORY, &flags);
        p.wait_protected();
        // Checkpoints every 2 ms: many of these land while one has the VM paused, and
        // each waits for its end instead of being refused or resuming it early.
        for _ in 0..20 {
            for verb in ["pause", "resume"] {
                let r = remote(&p.socket, &[verb]);
                assert_eq!(r.code, Some(0), "{verb} while replicating: {}", r.explain());
            }
        }
        // Paused by its operator, the VM stays paused through later checkpoints.
        let r = remote(&p.socket, &["pause"]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        let from = p.acked().unwrap_or(0);
        assert!(
            wait_until(LIMIT, || p.acked().is_some_and(|a| a >= from + 2)),
            "no checkpoints while paused"
        );
        let info = remote_json(&p.socket, &["info"]);
        assert_eq!(info["state"], "Paused", "{info}");
        let r = remote(&p.socket, &["resume"]);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        p
    });
    let f = result_in(&text, "fib");
    assert_eq!(u(&f["result"]), fib_value(FIB_N), "{text}");
}

/// Waits for a primary that lost its standby to end its `fib` task on its own: exit 0 and
/// the exact value. Returns how it ended, for what it said.
fn ended_fib_alone(primary: Primary) -> Run {
    let p = primary.vm.finish(LIMIT);
    let text = read_text(&primary.serial);
    assert_eq!(
        p.code,
        Some(0),
        "primary: {}\nconsole:\n{text}",
        p.explain()
    );
    let f = result_in(&text, "fib");
    assert_eq!(u(&f["result"]), fib_value(FIB_N), "{text}");
    p
}

#[test]
fn a_primary_whose_standby_is_killed_ends_its_task_alone_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 23);
    let port = free_port();
    let standby_serial = dir.path().join("standby.out");
    let mut standby = start_standby(port, &key, &standby_serial);
    let tasks = format!("hello,fib={FIB_N}");
    let mut primary = start_primary(dir.path(), "primary", port, &key, &tasks, MEMORY);
    let guard = KillOnPanic::new(&primary.vm);
    primary.wait_protected();
    standby.child.kill().unwrap();
    let s = standby.finish(LIMIT);
    assert_eq!(s.code, None, "the standby was killed: {}", s.explain());
    // vm.info says so while the VM runs on.
    let mut info = Value::Null;
    wait_until(LIMIT, || {
        info = remote_json(&primary.socket, &["info"]);
        info["replication"]["state"] == "lost"
    });
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(info["replication"]["state"], "lost", "{info}");
    guard.defuse();
    let metrics = primary.metrics.clone();
    let p = ended_fib_alone(primary);
    assert!(
        p.stderr
            .contains(&format!("replication to 127.0.0.1:{port}"))
            && p.stderr.contains("the standby was lost")
            && p.stderr.contains("goes on alone"),
        "{}",
        p.explain()
    );
    let m: Metrics = serde_json::from_str(&read_text(&metrics)).unwrap();
    let r = m.replication.expect("replication metrics");
    assert_eq!(r.state, ReplicationState::Lost, "{r:?}");
    assert!(
        r.lost.is_some() && r.epochs_acked >= EPOCHS_BEFORE_KILL,
        "{r:?}"
    );
}

#[test]
fn strangers_and_a_wrong_secret_are_refused_and_the_standby_waits_for_its_primary() {
    let dir = tempfile::tempdir().unwrap();
    let right = secret_file(dir.path(), "right", 24);
    let wrong = secret_file(dir.path(), "wrong", 25);
    let port = free_port();
    let standby_serial = dir.path().join("standby.out");
    let mut standby = start_standby(port, &right, &standby_serial);
    let standby_guard = KillOnPanic::new(&standby);
    // One stays silent, one sends garbage.
    let _silent = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut garbage = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage.write_all(&[0xff; 4096]).unwrap();
    // A primary with the wrong secret runs alone, and says why.
    let stranger = start_primary(dir.path(), "stranger", port, &wrong, "hello", MEMORY);
    let s = stranger.vm.finish(LIMIT);
    assert_eq!(s.code, Some(0), "{}", s.explain());
    assert!(
        s.stderr.contains("no standby")
            && s.stderr.contains("authentication")
            && s.stderr.contains("runs alone"),
        "{}",
        s.explain()
    );
    assert!(
        standby.child.try_wait().unwrap().is_none(),
        "the standby ended"
    );
    assert!(listening_on_loopback(port), "the standby stopped listening");
    assert!(!standby_serial.exists() || !read_text(&standby_serial).contains("probe"));

    // Its own primary is taken: a VM that ends there is not taken over.
    let primary = start_primary(dir.path(), "primary", port, &right, "hello,fib=40", MEMORY);
    let p = primary.vm.finish(LIMIT);
    assert_eq!(p.code, Some(0), "primary: {}", p.explain());
    standby_guard.defuse();
    let d = standby.finish(LIMIT);
    assert_eq!(d.code, Some(0), "standby: {}", d.explain());
    assert!(
        d.stderr.contains("failed authentication")
            && d.stderr
                .contains("does not speak the musubi node handshake")
            && d.stderr.contains("nothing to take over"),
        "{}",
        d.explain()
    );
    assert!(!standby_serial.exists() || !read_text(&standby_serial).contains("probe"));
}

#[test]
fn a_primary_with_policy_stop_pauses_when_its_standby_is_killed_and_ends_its_task_once_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 28);
    let port = free_port();
    let standby_serial = dir.path().join("standby.out");
    let mut standby = start_standby(port, &key, &standby_serial);
    let tasks = format!("hello,fib={FIB_N}");
    let mut primary = start_primary_with(
        dir.path(),
        "primary",
        port,
        &key,
        &tasks,
        MEMORY,
        &["--replicate-policy", "stop"],
    );
    let guard = KillOnPanic::new(&primary.vm);
    primary.wait_protected();
    standby.child.kill().unwrap();
    let s = standby.finish(LIMIT);
    assert_eq!(s.code, None, "the standby was killed: {}", s.explain());
    // vm.info says the VM waits, paused, for its operator.
    let mut info = Value::Null;
    wait_until(LIMIT, || {
        info = remote_json(&primary.socket, &["info"]);
        info["replication"]["state"] == "stopped"
    });
    assert_eq!(info["replication"]["state"], "stopped", "{info}");
    assert_eq!(info["replication"]["policy"], "stop", "{info}");
    assert_eq!(info["state"], "Paused", "{info}");
    let m = primary
        .metrics_now()
        .expect("metrics of the paused primary");
    let r = m.replication.expect("replication metrics");
    assert_eq!(r.state, ReplicationState::Stopped, "{r:?}");
    assert!(r.lost.is_some(), "{r:?}");
    let text = read_text(&primary.serial);
    assert!(!text.contains(DONE), "the VM ran on:\n{text}");
    // The operator lets it run on alone.
    let resumed = remote(&primary.socket, &["resume"]);
    assert_eq!(resumed.code, Some(0), "{}", resumed.explain());
    guard.defuse();
    let p = ended_fib_alone(primary);
    assert!(
        p.stderr.contains("the standby was lost")
            && p.stderr
                .contains("--replicate-policy stop: the VM is paused"),
        "{}",
        p.explain()
    );
}

#[test]
fn a_vm_replicated_through_the_api_ends_its_task_exactly_on_the_standby_after_it_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = format!("hello,fib={FIB_N}");
    let (text, _) = taken_over_from(dir.path(), 29, &[], |port, key| {
        let vm = start_vm(dir.path(), "primary", &tasks, MEMORY, &[]);
        let url = format!("tcp:127.0.0.1:{port}");
        wait_until(LIMIT, || vm.socket.exists());
        // Not replicated yet: vm.info has no replication block.
        let info = remote_json(&vm.socket, &["info"]);
        assert!(info.get("replication").is_none(), "{info}");
        let r = remote(
            &vm.socket,
            &[
                "replicate",
                "--to",
                &url,
                "--secret-file",
                key.to_str().unwrap(),
                "--epoch",
                "20",
            ],
        );
        assert_eq!(r.code, Some(0), "{}", r.explain());
        let info = remote_json(&vm.socket, &["info"]);
        assert_eq!(info["replication"]["to"], url.as_str(), "{info}");
        assert_eq!(info["replication"]["epoch_ms"], 20, "{info}");
        // A second standby is refused, naming the first.
        let again = remote(
            &vm.socket,
            &[
                "replicate",
                "--to",
                &url,
                "--secret-file",
                key.to_str().unwrap(),
            ],
        );
        assert_ne!(again.code, Some(0), "{}", again.explain());
        assert!(
            again.stderr.contains("already replicated"),
            "{}",
            again.explain()
        );
        vm
    });
    let f = result_in(&text, "fib");
    assert_eq!(
        (u(&f["n"]), u(&f["result"])),
        (FIB_N, fib_value(FIB_N)),
        "{text}"
    );
}
