//! Live migration (post-copy) of the probe guest between `musubi run` processes on
//! loopback: a VM moved in the middle of a task ends that task on the destination as an
//! uninterrupted run does, and a move that cannot happen leaves it running where it was.
//!
//! Every wait here is bounded and waits for something it can read (a console line, a
//! listening socket in /proc/net/tcp, a process's end), never for time to pass.

mod common;
use common::*;
use musubi_types::{Metrics, Outcome, RunReport};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Every musubi process here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(150);
const MEMORY: &str = "128M";
/// Long enough (several seconds) that a migration asked for right after `hello` starts it
/// before it ends, even on a loaded machine.
const FIB_N: u64 = 46;
/// `shared-counter=COUNTER_N` on 2 vCPUs takes a few seconds.
const COUNTER_N: u64 = 100_000_000;
const HELLO: &str = "{\"probe\":\"hello\"";
const DONE: &str = "probe: done, exit status 0";

/// `musubi run --receive-migration tcp:127.0.0.1:PORT`, its console in `serial`, listening
/// once this returns.
fn start_destination(port: u16, secret: &Path, serial: &Path, flags: &[&str]) -> Started {
    let url = format!("tcp:127.0.0.1:{port}");
    let serial = format!("file={}", serial.display());
    let mut args = vec![
        "run",
        "--receive-migration",
        &url,
        "--secret-file",
        secret.to_str().unwrap(),
        "--serial",
        &serial,
        "--timeout",
        "120",
    ];
    args.extend_from_slice(flags);
    start_listening(&args, port, LIMIT)
}

fn send_migration(socket: &Path, port: u16, secret: &Path) -> Run {
    send_migration_to(socket, &format!("tcp:127.0.0.1:{port}"), secret)
}

/// A source VM running `tasks` with its API on `dir/NAME.sock`, its console in
/// `dir/NAME.out` and its report in `dir/NAME.json`, once its console shows `hello`.
struct Source {
    vm: Started,
    socket: PathBuf,
    serial: PathBuf,
    report: PathBuf,
}

fn start_source(dir: &Path, name: &str, tasks: &str, flags: &[&str]) -> Source {
    let socket = dir.join(format!("{name}.sock"));
    let serial = dir.join(format!("{name}.out"));
    let report = dir.join(format!("{name}.json"));
    let mut all = vec!["--report", report.to_str().unwrap()];
    all.extend_from_slice(flags);
    let mut vm = start_probe_with_api(tasks, &socket, &serial, &all);
    vm.wait_for_text(&serial, HELLO, LIMIT);
    Source {
        vm,
        socket,
        serial,
        report,
    }
}

/// The source after a migration: it exited 0, its report says migrated, and its console
/// never got to the end of its tasks (they ended elsewhere).
fn assert_migrated_away(s: Source, port: u16) {
    let run = s.vm.finish(LIMIT);
    let console = read_text(&s.serial);
    assert_eq!(run.code, Some(0), "source: {}\n{console}", run.explain());
    let report: RunReport = serde_json::from_str(&read_text(&s.report)).unwrap();
    assert_eq!(report.outcome.kind(), "migrated", "{report}");
    assert_eq!(
        report.outcome,
        Outcome::Migrated {
            to: format!("tcp:127.0.0.1:{port}")
        },
        "{report}"
    );
    assert!(
        !console.contains(DONE),
        "the source ran its tasks to the end, so the move was not mid-task:\n{console}"
    );
}

/// The destination's console after the move: the tasks ended with status 0, without
/// booting again.
fn finished_destination(vm: Started, serial: &Path) -> String {
    let run = vm.finish(LIMIT);
    let text = read_text(serial);
    assert_eq!(
        run.code,
        Some(0),
        "destination: {}\nconsole:\n{text}",
        run.explain()
    );
    assert!(text.contains(DONE), "destination console:\n{text}");
    assert!(
        !results_in(&text).iter().any(|v| v["probe"] == "hello"),
        "the destination ran hello again, so it booted instead of resuming:\n{text}"
    );
    text
}

/// Moves a VM running `tasks` (`flags` its own) on loopback right after its hello, with a
/// secret made of `seed`, and returns the destination's console once both ends have
/// ended as a move mid-task must.
fn moved_mid_task(seed: u8, tasks: &str, flags: &[&str]) -> String {
    moved_mid_task_with(seed, tasks, flags, &[]).0
}

/// As [`moved_mid_task`], with `send` added to `remote send-migration`; also returns the
/// destination's `--metrics`.
fn moved_mid_task_with(seed: u8, tasks: &str, flags: &[&str], send: &[&str]) -> (String, Metrics) {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", seed);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest_metrics = dir.path().join("dest-metrics.json");
    let dest = start_destination(
        port,
        &key,
        &dest_serial,
        &["--metrics", dest_metrics.to_str().unwrap()],
    );
    let dest_guard = KillOnPanic::new(&dest);
    let src = start_source(dir.path(), "src", tasks, flags);
    let src_guard = KillOnPanic::new(&src.vm);
    let url = format!("tcp:127.0.0.1:{port}");
    let mut args = vec![
        "send-migration",
        &url,
        "--secret-file",
        key.to_str().unwrap(),
    ];
    args.extend_from_slice(send);
    let r = remote(&src.socket, &args);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    src_guard.defuse();
    assert_migrated_away(src, port);
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    let metrics: Metrics = serde_json::from_str(&read_text(&dest_metrics)).unwrap();
    (text, metrics)
}

fn assert_fib(text: &str) {
    let f = result_in(text, "fib");
    assert_eq!(
        (u(&f["n"]), u(&f["result"])),
        (FIB_N, fib_value(FIB_N)),
        "{text}"
    );
}

#[test]
fn fib_migrated_mid_task_ends_on_the_destination_as_an_uninterrupted_run() {
    let text = moved_mid_task(7, &format!("hello,fib={FIB_N}"), &["--memory", MEMORY]);
    assert_fib(&text);
}

#[test]
fn shared_counter_on_two_vcpus_is_exact_after_migration() {
    let text = moved_mid_task(
        9,
        &format!("hello,shared-counter={COUNTER_N}"),
        &["--cpus", "2", "--memory", MEMORY],
    );
    assert_counter_exact(&result_in(&text, "shared-counter"), 2, COUNTER_N, &text);
}

#[test]
fn a_vm_migrated_twice_ends_its_task_on_the_third_process() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 3);
    let (port_b, port_c) = (free_port(), free_port());
    assert_ne!(port_b, port_c);
    let b_serial = dir.path().join("b.out");
    let c_serial = dir.path().join("c.out");
    let b_socket = dir.path().join("b.sock");
    let b_report = dir.path().join("b.json");
    let mut b = start_destination(
        port_b,
        &key,
        &b_serial,
        &[
            "--api-socket",
            b_socket.to_str().unwrap(),
            "--report",
            b_report.to_str().unwrap(),
        ],
    );
    let b_guard = KillOnPanic::new(&b);
    let c = start_destination(port_c, &key, &c_serial, &[]);
    let c_guard = KillOnPanic::new(&c);

    let tasks = format!("hello,fib={}", FIB_N + 1);
    let a = start_source(dir.path(), "a", &tasks, &["--memory", MEMORY]);
    let a_guard = KillOnPanic::new(&a.vm);
    let r = send_migration(&a.socket, port_b, &key);
    assert_eq!(r.code, Some(0), "A to B: {}", r.explain());
    a_guard.defuse();
    assert_migrated_away(a, port_b);

    // B serves its API once its VM runs; it refuses to move the VM on while pages are
    // still coming from A, and says so: ask again until it has them all.
    b.wait_for_file(&b_socket, LIMIT);
    let start = Instant::now();
    loop {
        let r = send_migration(&b_socket, port_c, &key);
        if r.code == Some(0) {
            break;
        }
        assert!(
            r.stderr.contains("still receiving") && start.elapsed() < LIMIT,
            "B to C: {}",
            r.explain()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    b_guard.defuse();
    let b_run = b.finish(LIMIT);
    assert_eq!(b_run.code, Some(0), "B: {}", b_run.explain());
    let report: RunReport = serde_json::from_str(&read_text(&b_report)).unwrap();
    assert_eq!(report.outcome.kind(), "migrated", "{report}");
    assert!(!read_text(&b_serial).contains(DONE), "B ended the tasks");

    c_guard.defuse();
    let text = finished_destination(c, &c_serial);
    let f = result_in(&text, "fib");
    assert_eq!(
        (u(&f["n"]), u(&f["result"])),
        (FIB_N + 1, fib_value(FIB_N + 1)),
        "{text}"
    );
}

/// A source whose move failed: the VM ran its tasks to the end itself, with status 0.
fn assert_finished_at_source(s: Source) {
    let run = s.vm.finish(LIMIT);
    let console = read_text(&s.serial);
    assert_eq!(run.code, Some(0), "source: {}\n{console}", run.explain());
    assert!(console.contains(DONE), "source console:\n{console}");
    let f = result_in(&console, "fib");
    assert_eq!(u(&f["result"]), fib_value(u(&f["n"])), "{console}");
}

#[test]
fn nobody_listening_is_named_and_the_vm_runs_on_at_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 5);
    let port = free_port();
    let src = start_source(dir.path(), "src", "hello,fib=40", &["--memory", MEMORY]);
    let guard = KillOnPanic::new(&src.vm);
    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(1), "send-migration: {}", r.explain());
    assert!(
        r.stderr.contains(&format!("127.0.0.1:{port}")) && r.stderr.contains("runs on here"),
        "{}",
        r.explain()
    );
    guard.defuse();
    assert_finished_at_source(src);
}

#[test]
fn strangers_at_the_destination_are_refused_and_do_not_hold_up_the_migration() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 9);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest = start_destination(port, &key, &dest_serial, &[]);
    let dest_guard = KillOnPanic::new(&dest);
    // One stays silent (it would have held a destination that served one handshake at a
    // time for its whole 30 s set-up limit), one sends garbage.
    let _silent = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut garbage = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage.write_all(&[0xff; 4096]).unwrap();
    let src = start_source(
        dir.path(),
        "src",
        &format!("hello,fib={FIB_N}"),
        &["--memory", MEMORY],
    );
    let src_guard = KillOnPanic::new(&src.vm);
    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    src_guard.defuse();
    assert_migrated_away(src, port);
    dest_guard.defuse();
    let d = dest.finish(LIMIT);
    let text = read_text(&dest_serial);
    assert_eq!(d.code, Some(0), "destination: {}\n{text}", d.explain());
    assert_fib(&text);
    assert!(
        d.stderr
            .contains("does not speak the musubi node handshake"),
        "the garbage was refused by name: {}",
        d.explain()
    );
}

#[test]
fn a_wrong_secret_is_refused_and_the_destination_keeps_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let right = secret_file(dir.path(), "right", 1);
    let wrong = secret_file(dir.path(), "wrong", 2);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let mut dest = start_destination(port, &right, &dest_serial, &[]);
    let dest_guard = KillOnPanic::new(&dest);
    let src = start_source(dir.path(), "src", "hello,fib=40", &["--memory", MEMORY]);
    let src_guard = KillOnPanic::new(&src.vm);
    let r = send_migration(&src.socket, port, &wrong);
    assert_eq!(r.code, Some(1), "send-migration: {}", r.explain());
    assert!(
        r.stderr.contains("authentication") && r.stderr.contains("runs on here"),
        "{}",
        r.explain()
    );
    src_guard.defuse();
    assert_finished_at_source(src);

    // The destination refused the stranger and waits on for a VM: still running, still
    // listening; a SIGTERM ends the wait (128 + 15).
    assert!(
        dest.child.try_wait().unwrap().is_none(),
        "the destination ended"
    );
    assert!(
        listening_on_loopback(port),
        "the destination stopped listening"
    );
    // SAFETY: kill(2) on our own child, not yet waited for.
    unsafe { libc::kill(dest.child.id() as libc::pid_t, libc::SIGTERM) };
    dest_guard.defuse();
    let d = dest.finish(LIMIT);
    assert_eq!(d.code, Some(143), "destination: {}", d.explain());
    assert!(
        d.stderr.contains("failed authentication")
            && d.stderr.contains("refused 127.0.0.1:")
            && d.stderr.contains("while waiting for a VM"),
        "{}",
        d.explain()
    );
    assert!(!dest_serial.exists() || !read_text(&dest_serial).contains("probe"));
}

#[test]
fn mem_check_migrated_mid_task_reads_back_every_byte_on_the_destination() {
    let text = moved_mid_task(
        11,
        &format!("hello,mem-check={MEM_CHECK_MIB},iters={MEM_CHECK_ROUNDS}"),
        &["--memory", MEM_CHECK_MEMORY],
    );
    assert_mem_check(&text, MEM_CHECK_ROUNDS);
}

/// The bytes of two snapshot memory files, compared page by page (a hole reads as zeros,
/// so a page one side never wrote and the other wrote as zeros are the same).
fn first_difference(a: &Path, b: &Path) -> Option<(u64, usize)> {
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let len = fa
        .metadata()
        .unwrap()
        .len()
        .max(fb.metadata().unwrap().len());
    let (mut pa, mut pb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut differing = None;
    let mut at = 0u64;
    while at < len {
        for (f, p) in [(&mut fa, &mut pa), (&mut fb, &mut pb)] {
            p.fill(0);
            let mut got = 0;
            while got < p.len() {
                match f.read(&mut p[got..]).unwrap() {
                    0 => break,
                    n => got += n,
                }
            }
        }
        let pages = pa
            .chunks(4096)
            .zip(pb.chunks(4096))
            .filter(|(x, y)| x != y)
            .count();
        if pages > 0 {
            let (first, _) = differing.unwrap_or((at, 0));
            let total = differing.map_or(0, |d: (u64, usize)| d.1) + pages;
            differing = Some((first, total));
        }
        at += pa.len() as u64;
    }
    differing
}

#[test]
fn a_paused_vm_arrives_paused_with_guest_ram_the_same_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 0x5a);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest_sock = dir.path().join("dest.sock");
    let dest = start_destination(
        port,
        &key,
        &dest_serial,
        &["--api-socket", dest_sock.to_str().unwrap()],
    );
    let dest_guard = KillOnPanic::new(&dest);
    let src = start_source(
        dir.path(),
        "src",
        &format!("hello,mem-check={MEM_CHECK_MIB},iters={MEM_CHECK_ROUNDS}"),
        &["--memory", MEM_CHECK_MEMORY],
    );
    let src_guard = KillOnPanic::new(&src.vm);
    // Quiesced: nothing runs from the pause on, on either side, until the resume. The
    // moment lets mem-check write more of its pattern first.
    std::thread::sleep(Duration::from_secs(1));
    let (before, after) = (dir.path().join("before"), dir.path().join("after"));
    for args in [vec!["pause"], vec!["snapshot", before.to_str().unwrap()]] {
        let r = remote(&src.socket, &args);
        assert_eq!(r.code, Some(0), "{args:?}: {}", r.explain());
    }
    let url = format!("tcp:127.0.0.1:{port}");
    let r = remote(
        &src.socket,
        &[
            "send-migration",
            &url,
            "--secret-file",
            key.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    src_guard.defuse();
    // The source exits once the destination holds every page.
    assert_migrated_away(src, port);
    let info = remote(&dest_sock, &["info"]);
    let v: Value =
        serde_json::from_str(&info.stdout).unwrap_or_else(|_| panic!("{}", info.explain()));
    assert_eq!(v["state"], "Paused", "it arrives as it left: {v}");
    let r = remote(&dest_sock, &["snapshot", after.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    // Not two empty files: the guest's 64 MiB of pattern are in the first.
    use std::os::unix::fs::MetadataExt;
    let held = std::fs::metadata(before.join("memory")).unwrap().blocks() * 512;
    assert!(
        held >= MEM_CHECK_MIB << 20,
        "the snapshot holds {held} bytes"
    );
    assert_eq!(
        first_difference(&before.join("memory"), &after.join("memory")),
        None,
        "(first differing MiB at byte offset, pages differing)"
    );
    let r = remote(&dest_sock, &["resume"]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    assert_mem_check(&text, MEM_CHECK_ROUNDS);
}

#[test]
fn mem_check_pre_copied_reads_back_every_byte_and_no_page_follows_the_switch() {
    // Pages the guest rewrites during the rounds, and those it wrote last, must arrive
    // before the switch; a round limit of 2 makes the pause send what the rounds left.
    let (text, metrics) = moved_mid_task_with(
        12,
        &format!("hello,mem-check={MEM_CHECK_MIB},iters={MEM_CHECK_ROUNDS}"),
        &["--memory", MEM_CHECK_MEMORY],
        &[
            "--mode",
            "precopy",
            "--downtime-ms",
            "1",
            "--max-rounds",
            "2",
        ],
    );
    assert_mem_check(&text, MEM_CHECK_ROUNDS);
    let m = metrics
        .migration
        .unwrap_or_else(|| panic!("no migration section: {metrics}"));
    assert!(m.precopied > 0, "no page came before the switch: {m}");
    assert_eq!(
        m.data_pages,
        Some(0),
        "a page was listed to follow the switch: {m}"
    );
    assert!(m.all_held, "{m}");
}

#[test]
fn fib_pre_copied_with_the_default_downtime_ends_as_an_uninterrupted_run() {
    let (text, metrics) = moved_mid_task_with(
        13,
        &format!("hello,fib={FIB_N}"),
        &["--memory", MEMORY],
        &["--mode", "precopy"],
    );
    assert_fib(&text);
    assert!(
        metrics.migration.is_some_and(|m| m.precopied > 0),
        "{metrics}"
    );
}

#[test]
fn pre_copy_bounds_without_the_pre_copy_mode_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 14);
    let socket = dir.path().join("none.sock");
    for (args, says) in [
        (vec!["--downtime-ms", "5"], "--mode precopy"),
        (vec!["--max-rounds", "0"], "--max-rounds"),
        (vec!["--mode", "fast"], "fast"),
    ] {
        let mut all = vec![
            "send-migration",
            "tcp:127.0.0.1:9",
            "--secret-file",
            key.to_str().unwrap(),
        ];
        all.extend_from_slice(&args);
        let r = remote(&socket, &all);
        assert_ne!(r.code, Some(0), "{args:?}");
        assert!(r.stderr.contains(says), "{args:?}: {}", r.explain());
    }
}

/// A post-copy caught after its switch: the source's guest filled 16 MiB before its hello
/// and then only waits on timers, and the background push is held to 16 pages a second, so
/// most of its 4,096 pages with data are still on the source for minutes. Returns the
/// source, the destination (API on `dest.sock`, metrics on `dest.json`) and the pending
/// send-migration, once the destination runs the VM and knows how many pages will come.
struct AfterSwitch {
    _dir: tempfile::TempDir,
    src: Source,
    dest: Started,
    dest_metrics: PathBuf,
    send: std::thread::JoinHandle<Run>,
}

fn caught_after_the_switch(seed: u8) -> AfterSwitch {
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", seed);
    let port = free_port();
    let dest_socket = dir.path().join("dest.sock");
    let dest_metrics = dir.path().join("dest.json");
    let mut dest = start_destination(
        port,
        &key,
        &dir.path().join("dest.out"),
        &[
            "--api-socket",
            dest_socket.to_str().unwrap(),
            "--metrics",
            dest_metrics.to_str().unwrap(),
        ],
    );
    let dest_guard = KillOnPanic::new(&dest);
    let tasks = format!("mem-check=16,iters=1,hello{}", ",timer".repeat(200));
    let src = start_source(dir.path(), "src", &tasks, &["--memory", MEM_CHECK_MEMORY]);
    let src_guard = KillOnPanic::new(&src.vm);
    let send = {
        let (socket, url) = (src.socket.clone(), format!("tcp:127.0.0.1:{port}"));
        std::thread::spawn(move || {
            let key = key.to_str().unwrap();
            remote(
                &socket,
                &[
                    "send-migration",
                    &url,
                    "--secret-file",
                    key,
                    "--push-limit",
                    "64K",
                ],
            )
        })
    };
    // The destination serves its API once its VM runs; SIGUSR1 then writes its metrics,
    // which count the pages with data once the source has listed them.
    dest.wait_for_file(&dest_socket, LIMIT);
    let start = Instant::now();
    loop {
        // SAFETY: a signal to a child this test started and has not reaped.
        unsafe { libc::kill(dest.child.id() as libc::pid_t, libc::SIGUSR1) };
        std::thread::sleep(Duration::from_millis(50));
        let listed = std::fs::read_to_string(&dest_metrics)
            .ok()
            .and_then(|t| serde_json::from_str::<Metrics>(&t).ok())
            .and_then(|m| m.migration?.data_pages);
        if let Some(n) = listed {
            assert!(n >= 4096, "16 MiB were filled, but {n} pages are listed");
            break;
        }
        assert!(start.elapsed() < LIMIT, "the source never listed its pages");
    }
    src_guard.defuse();
    dest_guard.defuse();
    AfterSwitch {
        _dir: dir,
        src,
        dest,
        dest_metrics,
        send,
    }
}

#[test]
fn a_destination_killed_after_the_switch_ends_the_source_naming_the_pages_never_sent() {
    let a = caught_after_the_switch(21);
    let src_guard = KillOnPanic::new(&a.src.vm);
    // SAFETY: a signal to a child this test started and has not reaped.
    unsafe { libc::kill(a.dest.child.id() as libc::pid_t, libc::SIGKILL) };
    let sent = a.send.join().unwrap();
    assert_ne!(sent.code, Some(0), "send-migration: {}", sent.explain());
    assert!(
        sent.stderr.contains("lost after the switch")
            && sent.stderr.contains("pages with data were never sent"),
        "{}",
        sent.explain()
    );
    src_guard.defuse();
    let run = a.src.vm.finish(LIMIT);
    assert_eq!(run.code, Some(126), "source: {}", run.explain());
    assert!(
        run.stderr.contains("pages with data were never sent"),
        "{}",
        run.explain()
    );
    let report: RunReport = serde_json::from_str(&read_text(&a.src.report)).unwrap();
    assert_eq!(report.outcome.kind(), "vmm_error", "{report}");
    let _ = a.dest.finish(LIMIT);
}

#[test]
fn a_source_frozen_after_the_switch_ends_the_destination_naming_the_pages_that_never_came() {
    let a = caught_after_the_switch(22);
    // A stopped source never reaches its own --timeout: kill it if the test fails.
    let src_guard = KillOnPanic::new(&a.src.vm);
    let src_pid = a.src.vm.child.id() as libc::pid_t;
    // SAFETY: a signal to a child this test started and has not reaped.
    unsafe { libc::kill(src_pid, libc::SIGSTOP) };
    // The destination hears nothing, not even a heartbeat, for 10 s and ends the VM.
    let run = a.dest.finish(LIMIT);
    // SAFETY: as above; SIGKILL ends the stopped source too.
    unsafe { libc::kill(src_pid, libc::SIGKILL) };
    assert_eq!(run.code, Some(126), "destination: {}", run.explain());
    assert!(
        run.stderr
            .contains("source was lost before every page came")
            && run.stderr.contains("pages listed with data"),
        "{}",
        run.explain()
    );
    let metrics: Metrics = serde_json::from_str(&read_text(&a.dest_metrics)).unwrap();
    assert_eq!(
        metrics.migration.map(|m| m.all_held),
        Some(false),
        "{metrics}"
    );
    src_guard.defuse();
    let _ = a.src.vm.finish(LIMIT);
    let sent = a.send.join().unwrap();
    assert_ne!(sent.code, Some(0), "send-migration: {}", sent.explain());
}

/// Two network namespaces joined by a veth pair, `10.77.0.1/24` in the first and
/// `10.77.0.2/24` in the second (the host's namespace gets no link and no address).
/// Dropping it (also while a test panics) deletes both namespaces, and with them the pair.
struct NetnsPair {
    nets: [netns::Netns; 2],
}

impl NetnsPair {
    const ADDRS: [&'static str; 2] = ["10.77.0.1", "10.77.0.2"];

    fn new(tag: &str) -> NetnsPair {
        let pair = NetnsPair {
            nets: [0, 1].map(|k| netns::Netns::new(&format!("{tag}{k}"))),
        };
        let [a, b] = [&pair.nets[0].name, &pair.nets[1].name];
        // Made inside the first namespace with its peer inside the second: no end of the
        // pair is ever in the host's namespace.
        netns::ip(&[
            "-n", a, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1", "netns", b,
        ]);
        for (k, (name, dev)) in [(a, "veth0"), (b, "veth1")].into_iter().enumerate() {
            let addr = format!("{}/24", Self::ADDRS[k]);
            netns::ip(&["-n", name, "addr", "add", &addr, "dev", dev]);
            netns::ip(&["-n", name, "link", "set", dev, "up"]);
        }
        pair
    }

    /// `musubi` run inside namespace `k`.
    fn musubi(&self, k: usize) -> std::process::Command {
        self.nets[k].command(MUSUBI)
    }
}

/// A source VM in namespace 0 and a destination waiting for it in namespace 1 (listening
/// on the veth address there), the source once its console shows `hello`.
struct NetnsMove {
    dir: tempfile::TempDir,
    nets: NetnsPair,
    key: PathBuf,
    url: String,
    dest: Started,
    dest_serial: PathBuf,
    src: Source,
}

impl NetnsMove {
    /// `tag` names the namespaces, so tests running side by side do not meet.
    fn start(tag: &str, tasks: &str, src_flags: &[&str], dest_flags: &[&str]) -> NetnsMove {
        let dir = tempfile::tempdir().unwrap();
        let nets = NetnsPair::new(tag);
        let key = secret_file(dir.path(), "secret", 13);
        let port = 4470;
        let addr: std::net::Ipv4Addr = NetnsPair::ADDRS[1].parse().unwrap();
        let url = format!("tcp:{addr}:{port}");

        let dest_serial = dir.path().join("dest.out");
        let serial_arg = format!("file={}", dest_serial.display());
        let mut dest_args = vec![
            "run",
            "--receive-migration",
            &url,
            "--secret-file",
            key.to_str().unwrap(),
            "--serial",
            &serial_arg,
            "--timeout",
            "120",
        ];
        dest_args.extend_from_slice(dest_flags);
        let mut dest = start_command(nets.musubi(1), &dest_args, None);
        let dest_guard = KillOnPanic::new(&dest);
        let pid = dest.child.id();
        dest.wait_for(
            LIMIT,
            || listening_in(pid, addr, port).then_some(()),
            || format!("a socket listening on {url}"),
        );

        let socket = dir.path().join("src.sock");
        let serial = dir.path().join("src.out");
        let report = dir.path().join("src.json");
        let src_serial_arg = format!("file={}", serial.display());
        let mut flags = vec![
            "--memory",
            MEMORY,
            "--api-socket",
            socket.to_str().unwrap(),
            "--serial",
            &src_serial_arg,
            "--report",
            report.to_str().unwrap(),
        ];
        flags.extend_from_slice(src_flags);
        let args = probe_args(tasks, &flags);
        let mut vm = start_command(nets.musubi(0), &args, None);
        let src_guard = KillOnPanic::new(&vm);
        vm.wait_for_text(&serial, HELLO, LIMIT);
        src_guard.defuse();
        dest_guard.defuse();
        NetnsMove {
            dir,
            nets,
            key,
            url,
            dest,
            dest_serial,
            src: Source {
                vm,
                socket,
                serial,
                report,
            },
        }
    }

    fn send(&self) -> Run {
        send_migration_to(&self.src.socket, &self.url, &self.key)
    }

    /// The source ended as one that moved away, mid-task, to this destination.
    fn assert_source_moved(self) -> (Started, PathBuf, NetnsPair, tempfile::TempDir) {
        let run = self.src.vm.finish(LIMIT);
        let console = read_text(&self.src.serial);
        assert_eq!(run.code, Some(0), "source: {}\n{console}", run.explain());
        let report: RunReport = serde_json::from_str(&read_text(&self.src.report)).unwrap();
        assert_eq!(report.outcome.kind(), "migrated", "{report}");
        assert_eq!(
            report.outcome,
            Outcome::Migrated {
                to: self.url.clone()
            },
            "{report}"
        );
        assert!(
            !console.contains(DONE),
            "the source ran its tasks to the end, so the move was not mid-task:\n{console}"
        );
        (self.dest, self.dest_serial, self.nets, self.dir)
    }
}

#[test]
fn fib_migrates_between_two_network_namespaces_over_a_veth_link() {
    let m = NetnsMove::start("m", &format!("hello,fib={FIB_N}"), &[], &[]);
    let r = m.send();
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    let (dest, dest_serial, nets, _dir) = m.assert_source_moved();
    let text = finished_destination(dest, &dest_serial);
    assert_fib(&text);
    drop(nets);
}

/// The guest's TAP, made at the source in namespace 0, is made again by name at the
/// destination in namespace 1, and the guest goes on serving there with the MAC it had.
#[test]
fn a_vm_serving_http_migrates_with_its_network_device() {
    let tap = "tap=tap0,ip=10.0.0.1,mask=255.255.255.0";
    let tasks = "hello,http-serve=8080,n=2 probe.ip=10.0.0.2/24";
    let m = NetnsMove::start("mnet", tasks, &["--net", tap], &[]);
    let get = |k: usize, path: &'static str| {
        m.nets.nets[k]
            .spawn(move || {
                let addr: std::net::SocketAddr = "10.0.0.2:8080".parse().unwrap();
                let t0 = Instant::now();
                let mut s = loop {
                    match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                        Ok(s) => break s,
                        Err(e) => {
                            assert!(t0.elapsed() < LIMIT, "the guest never answered: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                };
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                write!(s, "GET {path} HTTP/1.1\r\nHost: g\r\n\r\n").unwrap();
                let mut answer = String::new();
                s.read_to_string(&mut answer).unwrap();
                answer
            })
            .join()
            .unwrap()
    };
    let before = get(0, "/at-the-source");
    assert!(
        before.contains("musubi probe: /at-the-source"),
        "{before:?}"
    );
    let r = m.send();
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    let after = get(1, "/at-the-destination");
    assert!(
        after.contains("musubi probe: /at-the-destination"),
        "{after:?}"
    );
    let (dest, dest_serial, nets, _dir) = m.assert_source_moved();
    let text = finished_destination(dest, &dest_serial);
    assert_eq!(result_in(&text, "http-serve")["served"], 2, "{text}");
    drop(nets);
}

/// A destination told that another partition owns a TAP (as a partition's supervisor
/// tells it) refuses a VM that names it, before the switch: the VM runs on at the source.
#[test]
fn a_migrating_vm_whose_tap_belongs_to_another_partition_is_refused_on_arrival() {
    let tap = "tap=tap0,ip=10.0.0.1,mask=255.255.255.0";
    let m = NetnsMove::start(
        "mtap",
        &format!("hello,fib={FIB_N}"),
        &["--net", tap],
        &["--foreign-tap", "a:tap0"],
    );
    let r = m.send();
    assert_eq!(r.code, Some(1), "send-migration: {}", r.explain());
    assert!(
        r.stderr.contains("tap=tap0: belongs to partition a"),
        "{}",
        r.explain()
    );
    let NetnsMove { src, mut dest, .. } = m;
    assert_finished_at_source(src);
    let _ = dest.child.kill();
    let _ = dest.child.wait();
}

/// A VM with vsock moved between two processes on this host, at the same socket path: the
/// destination's listener takes the path at the switch, the connection open at the source
/// is reset on both ends, and a new host connection reaches the guest's echo there.
#[test]
fn a_vm_with_vsock_moves_within_one_host_and_its_socket_follows_it() {
    use common::vsock::*;
    const PORT: u32 = 52;
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 41);
    let port = free_port();
    let socket = dir.path().join("v.sock");
    let vsock = format!("cid=3,socket={}", socket.display());
    let dest_serial = dir.path().join("dest.out");
    let dest = start_destination(port, &key, &dest_serial, &[]);
    let dest_guard = KillOnPanic::new(&dest);
    let mut src = start_source(
        dir.path(),
        "src",
        &format!("hello,vsock-echo={PORT}"),
        &["--memory", MEMORY, "--vsock", &vsock],
    );
    let src_guard = KillOnPanic::new(&src.vm);
    src.vm
        .wait_for_text(&src.serial, "vsock-echo: cid 3 listening", LIMIT);
    let (mut old, line) = connect_at(&socket, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(3000);
    assert!(echo_round_trip(&mut old, &data) == data, "the echo differs");

    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    // The path is the destination's now: a new connection reaches the guest there.
    let (mut new, line) = connect_at(&socket, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    assert!(echo_round_trip(&mut new, &data) == data, "the echo differs");
    drop(new);
    src_guard.defuse();
    assert_migrated_away(src, port);
    assert!(closed(&mut old), "the connection to the source outlived it");
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    assert!(!socket.exists(), "the moved VM's socket file outlived it");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("v.sock"))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    let r = result_in(&text, "vsock-echo");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["resets"], 1, "no transport reset reached the guest: {r}");
    assert_eq!(r["lost_to_resets"], 1, "{r}");
    assert_eq!(r["connections"], 1, "{r}");
}

/// `--vsock` given to the destination moves the host side to another path (the cid must
/// be the VM's); `--rng` that differs from the VM's is refused by name, and the
/// destination keeps waiting.
#[test]
fn a_destinations_vsock_and_rng_flags_are_held_to_the_arriving_vm() {
    use common::vsock::*;
    const PORT: u32 = 52;
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 43);
    let socket = dir.path().join("v.sock");
    let elsewhere = dir.path().join("w.sock");
    let vsock = format!("cid=3,socket={}", socket.display());
    let mut src = start_source(
        dir.path(),
        "src",
        &format!("hello,vsock-echo={PORT},rng=4096"),
        &[
            "--memory",
            MEMORY,
            "--vsock",
            &vsock,
            "--rng",
            "bytes_per_sec=65536",
        ],
    );
    let src_guard = KillOnPanic::new(&src.vm);
    src.vm
        .wait_for_text(&src.serial, "vsock-echo: cid 3 listening", LIMIT);

    // Each refusing destination names what differs, and the source's VM runs on. A
    // socket at the path that is not the source's listener is not taken over.
    let other_cid = format!("cid=4,socket={}", elsewhere.display());
    let moved = format!("cid=3,socket={}", elsewhere.display());
    let squatted = dir.path().join("squat.sock");
    let _squatter = std::os::unix::net::UnixListener::bind(&squatted).unwrap();
    let onto_squatter = format!("cid=3,socket={}", squatted.display());
    for (flags, names) in [
        (
            vec!["--vsock", onto_squatter.as_str()],
            vec!["--vsock", "squat.sock", "not the source's listener"],
        ),
        (
            vec!["--vsock", other_cid.as_str()],
            vec!["--vsock", "cid is 3", "cid=4"],
        ),
        (
            vec!["--vsock", moved.as_str(), "--rng"],
            vec!["--rng", "bytes_per_sec=65536", "uncapped"],
        ),
    ] {
        let port = free_port();
        let serial = dir.path().join("refusing.out");
        let dest = start_destination(port, &key, &serial, &flags);
        let dest_guard = KillOnPanic::new(&dest);
        let r = send_migration(&src.socket, port, &key);
        assert_ne!(r.code, Some(0), "{flags:?}: {}", r.explain());
        for n in &names {
            assert!(
                r.stderr.contains(n) || r.stdout.contains(n),
                "{flags:?}: no {n:?} in {}",
                r.explain()
            );
        }
        assert!(
            !elsewhere.exists(),
            "{flags:?}: a refusing destination listened"
        );
        // SAFETY: kill(2) on our own child, not yet waited for.
        unsafe { libc::kill(dest.child.id() as libc::pid_t, libc::SIGTERM) };
        dest_guard.defuse();
        let gone = dest.finish(LIMIT);
        assert_eq!(gone.code, Some(143), "{flags:?}: {}", gone.explain());
        assert!(
            gone.stderr.contains(names[0]),
            "{flags:?}: the destination did not say why: {}",
            gone.explain()
        );
    }

    assert!(squatted.exists(), "a refused VM took another socket's path");
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest = start_destination(
        port,
        &key,
        &dest_serial,
        &["--vsock", &moved, "--rng", "bytes_per_sec=65536"],
    );
    let dest_guard = KillOnPanic::new(&dest);
    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    let (mut s, line) = connect_at(&elsewhere, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(3000);
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    src_guard.defuse();
    assert_migrated_away(src, port);
    assert!(!socket.exists(), "the source's socket file outlived it");
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    assert!(
        !elsewhere.exists(),
        "the moved VM's socket file outlived it"
    );
    let v = result_in(&text, "vsock-echo");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["resets"], 1, "{v}");
    let r = result_in(&text, "rng");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["bytes"], 4096, "{r}");
}
