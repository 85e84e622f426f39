//! Snapshot and restore of the probe guest through the control API: a VM snapshotted in
//! the middle of a task, shut down and restored ends that task as an uninterrupted run
//! does; a snapshot restores any number of times; and a restore that cannot be what was
//! saved is refused before any guest code runs.

mod common;
use common::*;
use musubi_types::Metrics;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every musubi process here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(120);
/// How long after a task has started the snapshot is taken.
const INTO_TASK: Duration = Duration::from_millis(300);
const MEMORY: &str = "128M";
/// `fib=FIB_N` takes about 2.5 s on the test machine.
const FIB_N: u64 = 44;
/// `blk-fill` of a disk this size takes about 1.5 s on the test machine with `--exits user`
/// (every doorbell an exit), about 0.6 s with the default.
const DISK_BYTES: usize = 512 << 20;
const BLK_FLAGS: [&str; 4] = ["--memory", MEMORY, "--exits", "user"];
const SEED: u64 = 7;
/// `shared-counter=COUNTER_N` on 2 vCPUs takes about 1.6 s.
const COUNTER_N: u64 = 100_000_000;

/// The serial line that says a task placed after `hello` has started.
const HELLO: &str = "{\"probe\":\"hello\"";
const DONE: &str = "probe: done, exit status 0";

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The files of a snapshot directory.
const SNAPSHOT_FILES: [&str; 3] = ["config.json", "state", "memory"];

/// A VM snapshotted while a task ran, its original shut down.
struct Snapped {
    /// The snapshot directory.
    snap: PathBuf,
    /// The original's console when it was snapshotted (paused).
    before: String,
}

impl Snapped {
    /// `task` had not ended when the snapshot was taken.
    fn assert_mid_task(&self, task: &str) {
        assert!(
            !results_in(&self.before).iter().any(|v| v["probe"] == task),
            "{task} had ended before the snapshot, so it was not taken mid-task:\n{}",
            self.before
        );
    }
}

/// Starts the probe guest with `tasks` (and `flags`), waits until its console shows
/// `started` and then [`INTO_TASK`], snapshots it into `dir/snap`, checks the original is
/// paused, and shuts the original down.
fn snapshot_mid_task(dir: &Path, tasks: &str, started: &str, flags: &[&str]) -> Snapped {
    let socket = dir.join("original.sock");
    let serial = dir.join("original.out");
    let snap = dir.join("snap");
    let mut vm = start_probe_with_api(tasks, &socket, &serial, flags);
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, started, LIMIT);
    std::thread::sleep(INTO_TASK);
    let answer = remote(&socket, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(answer.code, Some(0), "snapshot: {}", answer.explain());
    for f in SNAPSHOT_FILES {
        assert!(snap.join(f).is_file(), "no {f} in {}", snap.display());
    }
    let info = remote_json(&socket, &["info"]);
    assert_eq!(info["state"], "Paused", "info after snapshot: {info}");
    let before = read_text(&serial);
    let down = remote(&socket, &["shutdown"]);
    assert_eq!(down.code, Some(0), "shutdown: {}", down.explain());
    guard.defuse();
    let original = vm.finish(LIMIT);
    assert!(
        !read_text(&serial).contains(DONE),
        "the original ran its tasks to the end after the snapshot and shutdown\n{}\n{}",
        read_text(&serial),
        original.explain()
    );
    Snapped { snap, before }
}

/// `musubi run --restore SNAP --serial file=SERIAL FLAGS...`, bounded to 200 s.
fn restore_args(snap: &Path, serial: &Path, flags: &[&str]) -> Vec<String> {
    let mut args = restore_without_timeout(snap, serial, &["--timeout", "200"]);
    args.extend(flags.iter().map(|f| f.to_string()));
    args
}

/// `musubi run --restore SNAP --serial file=SERIAL FLAGS...`.
fn restore_without_timeout(snap: &Path, serial: &Path, flags: &[&str]) -> Vec<String> {
    let mut args = vec![
        "run".to_string(),
        "--restore".into(),
        snap.display().to_string(),
        "--serial".into(),
        format!("file={}", serial.display()),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    args
}

fn restore(snap: &Path, serial: &Path, flags: &[&str]) -> Run {
    let args = restore_args(snap, serial, flags);
    run_with_limit(&args, LIMIT)
}

/// The probe guest's run with `tasks` and `flags`, from boot to end, its console on stdout.
fn uninterrupted(tasks: &str, flags: &[&str]) -> Run {
    let args = probe_args(tasks, flags);
    let r = run_with_limit(&args, LIMIT);
    assert_eq!(r.code, Some(0), "uninterrupted run: {}", r.explain());
    r
}

/// A restored run's console: it ended its tasks with status 0, and did not boot again.
fn restored_console(r: &Run, serial: &Path) -> String {
    let text = read_text(serial);
    assert_eq!(
        r.code,
        Some(0),
        "restore: {}\nconsole:\n{text}",
        r.explain()
    );
    assert!(text.contains(DONE), "restored console:\n{text}");
    assert!(
        !results_in(&text).iter().any(|v| v["probe"] == "hello"),
        "the restored VM ran hello again, so it booted instead of resuming:\n{text}"
    );
    text
}

fn fib_tasks() -> String {
    format!("hello,fib={FIB_N}")
}

/// What of a `fib` line does not depend on time: its N and value.
fn fib_fields(f: &Value) -> (u64, u64) {
    (u(&f["n"]), u(&f["result"]))
}

#[test]
fn fib_snapshotted_mid_task_and_restored_ends_as_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = fib_tasks();
    let plain = uninterrupted(&tasks, &["--memory", MEMORY]);
    let want = fib_fields(&plain.result("fib"));
    assert_eq!(want, (FIB_N, fib_value(FIB_N)), "{}", plain.explain());

    let s = snapshot_mid_task(dir.path(), &tasks, HELLO, &["--memory", MEMORY]);
    s.assert_mid_task("fib");
    let serial = dir.path().join("restored.out");
    let r = restore(&s.snap, &serial, &[]);
    let text = restored_console(&r, &serial);
    assert_eq!(fib_fields(&result_in(&text, "fib")), want, "{text}");
}

#[test]
fn a_restore_with_pages_read_on_demand_ends_as_an_uninterrupted_run_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = fib_tasks();
    let want = (FIB_N, fib_value(FIB_N));
    let s = snapshot_mid_task(dir.path(), &tasks, HELLO, &["--memory", MEMORY]);
    let serial = dir.path().join("ondemand.out");
    let metrics = dir.path().join("metrics.json");
    let metrics_arg = metrics.display().to_string();
    let r = restore(
        &s.snap,
        &serial,
        &["--restore-memory", "ondemand", "--metrics", &metrics_arg],
    );
    let text = restored_console(&r, &serial);
    assert_eq!(fib_fields(&result_in(&text, "fib")), want, "{text}");
    let m: Metrics = serde_json::from_str(&read_text(&metrics)).unwrap();
    assert_eq!(m.memory.backend, "ondemand", "{m}");
    let paging = m
        .demand_paging
        .unwrap_or_else(|| panic!("no demand_paging section: {m}"));
    // The guest's code, stack and page tables at least came from the file, and every fault
    // was served either from the file or as a hole.
    assert!(paging.pages_read > 0, "{paging}");
    assert_eq!(
        paging.faults,
        paging.pages_read + paging.zero_pages,
        "{paging}"
    );
}

/// CRC-32 of the first `len` bytes a `blk-fill=seed` writes.
#[test]
fn a_rate_limited_rng_read_snapshotted_mid_task_ends_after_restore() {
    // 16 KiB at 4 KiB a second takes three seconds: the snapshot finds a request held back
    // on the ring, which the restored device (a fresh bucket) must still serve.
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--memory", MEMORY, "--rng", "bytes_per_sec=4096"];
    let s = snapshot_mid_task(dir.path(), "hello,rng=16K", HELLO, &flags);
    s.assert_mid_task("rng");
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(s.snap.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["rng"]["bytes_per_sec"], 4096, "{saved}");
    let serial = dir.path().join("restored.out");
    let r = restore(&s.snap, &serial, &[]);
    let text = restored_console(&r, &serial);
    let v = result_in(&text, "rng");
    assert_eq!(
        (&v["ok"], &v["bytes"]),
        (&true.into(), &16384.into()),
        "{text}"
    );
}

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

fn blk_crc(text: &str) -> (u64, String) {
    let c = result_in(text, "blk-crc");
    let d = &c["disks"][0];
    (u(&d["bytes"]), d["crc32"].as_str().unwrap().to_string())
}

#[test]
fn blk_fill_snapshotted_mid_fill_and_restored_writes_the_same_disk() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = format!("hello,blk-fill={SEED},blk-crc");
    let fresh = temp_image(dir.path(), "fresh.img", DISK_BYTES);
    let fresh_disk = format!("path={}", fresh.display());
    let plain = uninterrupted(&tasks, &[&BLK_FLAGS[..], &["--disk", &fresh_disk]].concat());
    let want = blk_crc(&plain.stdout);
    let host_crc = format!("{:#010x}", fill_crc(DISK_BYTES, SEED));
    assert_eq!(
        want,
        (DISK_BYTES as u64, host_crc.clone()),
        "{}",
        plain.explain()
    );

    let img = temp_image(dir.path(), "snap.img", DISK_BYTES);
    let disk = format!("path={}", img.display());
    let s = snapshot_mid_task(
        dir.path(),
        &tasks,
        HELLO,
        &[&BLK_FLAGS[..], &["--disk", &disk]].concat(),
    );
    s.assert_mid_task("blk-fill");
    let serial = dir.path().join("restored.out");
    let r = restore(&s.snap, &serial, &[]);
    let text = restored_console(&r, &serial);
    let fill = result_in(&text, "blk-fill");
    assert_eq!(fill["disks"][0]["ok"], true, "{text}");
    assert_eq!(u(&fill["disks"][0]["bytes"]), DISK_BYTES as u64, "{text}");
    assert_eq!(blk_crc(&text), want, "{text}");

    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len(), DISK_BYTES);
    if let Some(off) = (0..data.len()).find(|&o| data[o] != fill_byte(o as u64, SEED)) {
        panic!(
            "byte {off} of {} is {:#04x}, blk-fill={SEED} writes {:#04x}",
            img.display(),
            data[off],
            fill_byte(off as u64, SEED)
        );
    }
}

#[test]
fn shared_counter_on_two_vcpus_is_exact_after_restore() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = format!("hello,shared-counter={COUNTER_N}");
    let flags = ["--cpus", "2", "--memory", MEMORY];
    let s = snapshot_mid_task(dir.path(), &tasks, HELLO, &flags);
    s.assert_mid_task("shared-counter");
    let serial = dir.path().join("restored.out");
    let r = restore(&s.snap, &serial, &[]);
    let text = restored_console(&r, &serial);
    assert_counter_exact(&result_in(&text, "shared-counter"), 2, COUNTER_N, &text);
}

fn file_crc(path: &Path) -> u32 {
    crc32fast::hash(&std::fs::read(path).unwrap())
}

#[test]
fn one_snapshot_restores_twice_into_independent_vms() {
    let dir = tempfile::tempdir().unwrap();
    let s = snapshot_mid_task(dir.path(), &fib_tasks(), HELLO, &["--memory", MEMORY]);
    let memory = s.snap.join("memory");
    let crc_before = file_crc(&memory);
    let len_before = std::fs::metadata(&memory).unwrap().len();

    // Both at once: each maps the memory file copy-on-write.
    let serials: Vec<PathBuf> = (0..2)
        .map(|i| dir.path().join(format!("restored{i}.out")))
        .collect();
    let vms: Vec<Started> = serials
        .iter()
        .map(|serial| {
            let args = restore_args(&s.snap, serial, &[]);
            start_command(musubi(), &args, None)
        })
        .collect();
    let runs: Vec<Run> = vms.into_iter().map(|vm| vm.finish(LIMIT)).collect();
    for (r, serial) in runs.iter().zip(&serials) {
        let text = restored_console(r, serial);
        assert_eq!(
            fib_fields(&result_in(&text, "fib")),
            (FIB_N, fib_value(FIB_N)),
            "{text}"
        );
    }
    assert_eq!(std::fs::metadata(&memory).unwrap().len(), len_before);
    assert_eq!(
        file_crc(&memory),
        crc_before,
        "restoring changed the snapshot's memory file"
    );
}

// ---- refusals ----

/// A snapshot of a 2-CPU VM with one disk, taken while `fib` ran, its original shut down.
struct Fixture {
    dir: tempfile::TempDir,
    snap: PathBuf,
    disk: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let disk = temp_image(dir.path(), "disk.img", 1 << 20);
    let d = format!("path={}", disk.display());
    let tasks = format!("hello,fib={FIB_N}");
    let s = snapshot_mid_task(
        dir.path(),
        &tasks,
        HELLO,
        &["--cpus", "2", "--memory", MEMORY, "--disk", &d],
    );
    Fixture {
        snap: s.snap,
        dir,
        disk,
    }
}

impl Fixture {
    /// A copy of the snapshot as `name` (the memory file hard-linked: nothing here
    /// writes it).
    fn copy(&self, name: &str) -> PathBuf {
        let to = self.dir.path().join(name);
        std::fs::create_dir(&to).unwrap();
        for f in ["config.json", "state"] {
            std::fs::copy(self.snap.join(f), to.join(f)).unwrap();
        }
        std::fs::hard_link(self.snap.join("memory"), to.join("memory")).unwrap();
        to
    }

    fn serial(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.out"))
    }

    /// A copy of the snapshot as `name` with its state file changed by `edit`; returns that
    /// state file.
    fn copy_with_state(&self, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
        let state = self.copy(name).join("state");
        let mut bytes = std::fs::read(&state).unwrap();
        edit(&mut bytes);
        std::fs::write(&state, &bytes).unwrap();
        state
    }

    /// Restores the copy `name` without flags and checks it is refused naming each of
    /// `names` (see [`assert_refused`]).
    fn assert_copy_refused(&self, name: &str, names: &[&str]) {
        assert_refused(&self.dir.path().join(name), &self.serial(name), &[], names);
    }
}

/// Restores `snap` with `flags` and checks it is refused: status 1, every one of `names` in
/// the message, and no guest output.
fn assert_refused(snap: &Path, serial: &Path, flags: &[&str], names: &[&str]) {
    let r = restore(snap, serial, flags);
    assert_eq!(r.code, Some(1), "restore {flags:?}: {}", r.explain());
    for n in names {
        assert!(
            r.stderr.contains(n),
            "restore {flags:?}: the message does not name {n:?}: {}",
            r.explain()
        );
    }
    let out = read_text(serial);
    assert!(
        out.is_empty(),
        "restore {flags:?} was refused after guest code ran; console:\n{out}"
    );
    assert!(
        !r.stdout.contains("{\"probe\""),
        "restore {flags:?}: guest output on stdout: {}",
        r.explain()
    );
}

const HEADER_LEN: usize = 32;

#[test]
fn restore_refuses_a_state_file_of_another_format_version() {
    let fx = fixture();
    let state = fx.copy_with_state("version", |bytes| {
        let version = u32::from_le_bytes(bytes[16..20].try_into().unwrap());
        bytes[16..20].copy_from_slice(&(version + 1).to_le_bytes());
    });
    fx.assert_copy_refused("version", &[state.to_str().unwrap(), "format version"]);
}

#[test]
fn restore_refuses_a_corrupted_state_file() {
    let fx = fixture();
    let len = std::fs::read(fx.snap.join("state")).unwrap().len();
    assert!(len > HEADER_LEN, "state file of {len} bytes");
    let body = len - HEADER_LEN;
    // The body's first byte, one in its middle and its last.
    for (i, at) in [HEADER_LEN, HEADER_LEN + body / 2, len - 1]
        .into_iter()
        .enumerate()
    {
        let name = format!("corrupt{i}");
        let state = fx.copy_with_state(&name, |bytes| bytes[at] ^= 0x20);
        fx.assert_copy_refused(&name, &[state.to_str().unwrap(), "corrupted: checksum"]);
    }
}

#[test]
fn restore_refuses_a_memory_file_shorter_than_the_ram() {
    let fx = fixture();
    let snap = fx.copy("short");
    let memory = snap.join("memory");
    let len = std::fs::metadata(&memory).unwrap().len();
    // A file of its own: the snapshot's is not changed.
    std::fs::remove_file(&memory).unwrap();
    let f = std::fs::File::create(&memory).unwrap();
    f.set_len(len - 4096).unwrap();
    drop(f);
    fx.assert_copy_refused(
        "short",
        &[memory.to_str().unwrap(), "shorter than the snapshot's"],
    );
}

#[test]
fn restore_refuses_flags_that_differ_from_the_snapshot() {
    let fx = fixture();
    let other = temp_image(fx.dir.path(), "other.img", 1 << 20);
    let other_disk = format!("path={}", other.display());
    let same_disk = format!("path={}", fx.disk.display());
    let cases: [(&str, Vec<&str>, &str); 4] = [
        ("cpus", vec!["--cpus", "4"], "--cpus"),
        ("memory", vec!["--memory", "256M"], "--memory"),
        ("disk", vec!["--disk", &other_disk], "--disk"),
        (
            "disks",
            vec!["--disk", &same_disk, "--disk", &other_disk],
            "--disk",
        ),
    ];
    for (name, flags, flag) in cases {
        assert_refused(&fx.snap, &fx.serial(name), &flags, &[flag]);
    }
    // The flags the snapshot was taken with are no refusal: this restore runs.
    let serial = fx.serial("same");
    let r = restore(
        &fx.snap,
        &serial,
        &["--cpus", "2", "--memory", MEMORY, "--disk", &same_disk],
    );
    let text = restored_console(&r, &serial);
    assert_eq!(
        fib_fields(&result_in(&text, "fib")),
        (FIB_N, fib_value(FIB_N))
    );
}

#[test]
fn restore_refuses_a_missing_disk_by_name() {
    let fx = fixture();
    std::fs::remove_file(&fx.disk).unwrap();
    assert_refused(
        &fx.snap,
        &fx.serial("missing"),
        &[],
        &["--disk", fx.disk.to_str().unwrap()],
    );
}

#[test]
fn restore_with_kernel_or_config_is_refused_by_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vm.json");
    std::fs::write(&config, "{\"kernel\": \"probe\"}").unwrap();
    let snap = dir.path().join("snap");
    let cases: [(&str, &[&str]); 2] = [
        ("--kernel", &["--kernel", "probe"]),
        ("--config", &["--config", config.to_str().unwrap()]),
    ];
    for (flag, extra) in cases {
        let serial = dir.path().join("out");
        let args = restore_without_timeout(&snap, &serial, extra);
        let r = run_with_limit(&args, LIMIT);
        // clap's usage errors end with status 2.
        assert_eq!(r.code, Some(2), "{flag} with --restore: {}", r.explain());
        assert!(
            r.stderr.contains(flag) && r.stderr.contains("--restore"),
            "{flag} with --restore: {}",
            r.explain()
        );
        assert!(read_text(&serial).is_empty(), "{}", r.explain());
    }
}
