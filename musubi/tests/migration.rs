//! Live migration (post-copy) of the probe guest between `musubi run` processes on
//! loopback: a VM moved in the middle of a task ends that task on the destination as an
//! uninterrupted run does, and a move that cannot happen leaves it running where it was.
//!
//! Every wait here is bounded and waits for something it can read (a console line, a
//! listening socket in /proc/net/tcp, a process's end), never for time to pass.

mod common;
use common::*;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
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

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A secret file, mode 0600.
fn secret(dir: &Path, name: &str, byte: u8) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, [byte; 32]).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// A loopback port nothing listens on (the kernel's pick of a free one).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Whether a socket listens on 127.0.0.1:`port`, from /proc/net/tcp (no connection made,
/// so the destination sees no stranger).
fn listening(port: u16) -> bool {
    let want = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1] == want && f[3] == "0A"
        })
}

/// Waits until `vm` listens on `port`; fails if it ends first or after [`LIMIT`].
fn wait_listening(vm: &mut Started, port: u16) {
    let start = Instant::now();
    while !listening(port) {
        if let Some(s) = vm.child.try_wait().unwrap() {
            panic!("the destination ended ({s}) before it listened on port {port}");
        }
        assert!(
            start.elapsed() < LIMIT,
            "nothing listens on port {port} after {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` exists (an API socket a VM creates once it runs).
fn wait_for_file(vm: &mut Started, path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        if let Some(s) = vm.child.try_wait().unwrap() {
            panic!("the VM ended ({s}) before it made {}", path.display());
        }
        assert!(
            start.elapsed() < LIMIT,
            "no {} after {LIMIT:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

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
    let mut vm = start_command(musubi(), &args, None);
    wait_listening(&mut vm, port);
    vm
}

fn send_migration(socket: &Path, port: u16, secret: &Path) -> Run {
    let url = format!("tcp:127.0.0.1:{port}");
    remote(
        socket,
        &[
            "send-migration",
            &url,
            "--secret-file",
            secret.to_str().unwrap(),
        ],
    )
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
    wait_for_text(&mut vm, &serial, HELLO, LIMIT);
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
    let report: Value = serde_json::from_str(&read_text(&s.report)).unwrap();
    assert_eq!(report["outcome"]["kind"], "migrated", "{report}");
    assert_eq!(
        report["outcome"]["to"],
        format!("tcp:127.0.0.1:{port}"),
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
    let dir = tempfile::tempdir().unwrap();
    let key = secret(dir.path(), "secret", 7);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest = start_destination(port, &key, &dest_serial, &[]);
    let dest_guard = KillOnPanic::new(&dest);
    let tasks = format!("hello,fib={FIB_N}");
    let src = start_source(dir.path(), "src", &tasks, &["--memory", MEMORY]);
    let src_guard = KillOnPanic::new(&src.vm);
    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    src_guard.defuse();
    assert_migrated_away(src, port);
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    assert_fib(&text);
}

#[test]
fn shared_counter_on_two_vcpus_is_exact_after_migration() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret(dir.path(), "secret", 9);
    let port = free_port();
    let dest_serial = dir.path().join("dest.out");
    let dest = start_destination(port, &key, &dest_serial, &[]);
    let dest_guard = KillOnPanic::new(&dest);
    let tasks = format!("hello,shared-counter={COUNTER_N}");
    let src = start_source(
        dir.path(),
        "src",
        &tasks,
        &["--cpus", "2", "--memory", MEMORY],
    );
    let src_guard = KillOnPanic::new(&src.vm);
    let r = send_migration(&src.socket, port, &key);
    assert_eq!(r.code, Some(0), "send-migration: {}", r.explain());
    src_guard.defuse();
    assert_migrated_away(src, port);
    dest_guard.defuse();
    let text = finished_destination(dest, &dest_serial);
    let c = result_in(&text, "shared-counter");
    let expected = 2 * COUNTER_N;
    assert_eq!(u(&c["cpus"]), 2, "{text}");
    assert_eq!(u(&c["expected"]), expected, "{text}");
    assert_eq!(u(&c["locked"]), expected, "{text}");
    assert_eq!(u(&c["xadd"]), expected, "{text}");
    assert_eq!(c["exact"], true, "{text}");
}

#[test]
fn a_vm_migrated_twice_ends_its_task_on_the_third_process() {
    let dir = tempfile::tempdir().unwrap();
    let key = secret(dir.path(), "secret", 3);
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
    wait_for_file(&mut b, &b_socket);
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
    let report: Value = serde_json::from_str(&read_text(&b_report)).unwrap();
    assert_eq!(report["outcome"]["kind"], "migrated", "{report}");
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
    let key = secret(dir.path(), "secret", 5);
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
fn a_wrong_secret_is_refused_and_the_destination_keeps_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let right = secret(dir.path(), "right", 1);
    let wrong = secret(dir.path(), "wrong", 2);
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
    assert!(listening(port), "the destination stopped listening");
    // SAFETY: kill(2) on our own child, not yet waited for.
    unsafe { libc::kill(dest.child.id() as libc::pid_t, libc::SIGTERM) };
    dest_guard.defuse();
    let d = dest.finish(LIMIT);
    assert_eq!(d.code, Some(143), "destination: {}", d.explain());
    assert!(
        d.stderr.contains("authentication") && d.stderr.contains("still waiting"),
        "{}",
        d.explain()
    );
    assert!(!dest_serial.exists() || !read_text(&dest_serial).contains("probe"));
}
