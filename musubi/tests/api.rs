//! The control API of a running VM (`musubi run --api-socket`): pause and resume while a
//! task runs, how the real binary's socket answers bad requests, and `musubi remote`
//! without a VM.

mod common;
use common::*;
use musubi_types::{Counters, DeviceCounters};
use serde_json::Value;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every musubi process here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(120);
/// `fib=FIB_N` takes about 2.5 s on the test machine.
const FIB_N: u64 = 44;
const HELLO: &str = "{\"probe\":\"hello\"";

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn pause_and_resume_while_a_task_runs() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let serial = dir.path().join("console.out");
    let tasks = format!("hello,fib={FIB_N}");
    // A disk, so the counters have a device's too.
    let img = temp_image(dir.path(), "disk.img", 1 << 20);
    let disk = format!("path={}", img.display());
    let mut vm = start_probe_with_api(
        &tasks,
        &socket,
        &serial,
        &["--memory", "128M", "--disk", &disk],
    );
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, HELLO, LIMIT);

    let info = remote_json(&socket, &["info"]);
    assert_eq!(info["state"], "Running", "{info}");
    // Cloud Hypervisor's VmInfo, whoever started the VM.
    assert_eq!(info["config"]["memory"]["size"], 128u64 << 20, "{info}");
    assert_eq!(
        info["config"]["disks"][0]["path"],
        img.to_str().unwrap(),
        "{info}"
    );
    assert_eq!(info["config"]["disks"][0]["id"], "_disk0", "{info}");
    assert!(info["device_tree"]["_disk0"].is_object(), "{info}");
    remote_json(&socket, &["pause"]);
    let info = remote_json(&socket, &["info"]);
    assert_eq!(info["state"], "Paused", "{info}");

    let counters = |v: Value| -> Counters { serde_json::from_value(v).unwrap() };
    let first = counters(remote_json(&socket, &["counters"]));
    std::thread::sleep(Duration::from_millis(300));
    let second = counters(remote_json(&socket, &["counters"]));
    // The vCPUs' exits are there, or the answer would not read as `Counters`.
    assert!(
        matches!(first.devices.get("_disk0"), Some(DeviceCounters::Block(_))),
        "counters: {first}"
    );
    assert_eq!(first, second, "the counters moved while the VM was paused");
    assert!(
        !read_text(&serial).contains("{\"probe\":\"fib\""),
        "fib ended before the pause:\n{}",
        read_text(&serial)
    );

    let again = remote(&socket, &["pause"]);
    assert_eq!(again.code, Some(1), "pause twice: {}", again.explain());
    assert!(
        again.stderr.contains("500"),
        "pause twice: {}",
        again.explain()
    );
    assert_eq!(remote_json(&socket, &["info"])["state"], "Paused");

    remote_json(&socket, &["resume"]);
    guard.defuse();
    let run = vm.finish(LIMIT);
    let text = read_text(&serial);
    assert_eq!(run.code, Some(0), "{}\nconsole:\n{text}", run.explain());
    let f = result_in(&text, "fib");
    assert_eq!(u(&f["n"]), FIB_N, "{text}");
    assert_eq!(u(&f["result"]), fib_value(FIB_N), "{text}");
    assert!(text.contains("probe: done, exit status 0"), "{text}");
}

/// Sends `request` on a new connection to `socket` (a write error, as when the server
/// answers and closes before taking all of it, is ignored) and returns the answer's
/// status and body.
fn exchange(socket: &Path, request: &[u8]) -> (u16, String) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(request);
    read_answer(&mut s)
}

fn read_answer(s: &mut UnixStream) -> (u16, String) {
    let mut answer = Vec::new();
    // The server closes the connection after its answer; a reset after it is taken as the
    // end too.
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset && !answer.is_empty() => break,
            Err(e) => panic!(
                "reading the answer: {e} (so far {:?})",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP/1.1 answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn request(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// A probe VM busy with a task far longer than any test, its API on `api.sock` in `dir`,
/// once its guest has said hello (a VM that never does is killed with the returned value);
/// also the file its console writes to.
fn busy_vm_with_api(dir: &Path) -> (PathBuf, PathBuf, Started) {
    let socket = dir.join("api.sock");
    let serial = dir.join("console.out");
    let mut vm = start_probe_with_api("hello,fib=60", &socket, &serial, &["--memory", "128M"]);
    vm.wait_for_text(&serial, HELLO, LIMIT);
    (socket, serial, vm)
}

#[test]
fn the_socket_answers_bad_requests_and_serves_past_a_silent_client() {
    let dir = tempfile::tempdir().unwrap();
    // A task far longer than this test: the VM is shut down through the API at the end.
    let (socket, serial, vm) = busy_vm_with_api(dir.path());
    let guard = KillOnPanic::new(&vm);

    let meta = std::fs::metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket(), "{meta:?}");
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "mode of {}",
        socket.display()
    );

    let (status, body) = exchange(&socket, &request("GET", "/api/v1/no.such.thing", b""));
    assert_eq!(status, 404, "{body}");
    let (status, body) = exchange(&socket, &request("GET", "/elsewhere", b""));
    assert_eq!(status, 404, "{body}");

    let snap = dir.path().join("snap");
    let malformed = format!("{{\"destination_url\": \"file://{}\"", snap.display());
    let (status, body) = exchange(
        &socket,
        &request("PUT", "/api/v1/vm.snapshot", malformed.as_bytes()),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        !snap.join("state").exists(),
        "a malformed request snapshotted"
    );

    let (status, body) = exchange(&socket, &request("GET", "/api/v1/vm.pause", b""));
    assert!(
        (400..500).contains(&status),
        "GET vm.pause: {status} {body}"
    );
    let (status, body) = exchange(
        &socket,
        &request("PUT", "/api/v1/vm.pause", &vec![b' '; 64 * 1024 + 1]),
    );
    assert_eq!(status, 413, "{body}");
    // None of those paused the VM.
    assert_eq!(remote_json(&socket, &["info"])["state"], "Running");

    // A client that connects and says nothing holds up no other.
    let mut silent = UnixStream::connect(&socket).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let (status, body) = exchange(&socket, &request("GET", "/api/v1/vmm.ping", b""));
    assert_eq!(status, 200, "{body}");
    let ping: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(u(&ping["pid"]), vm.child.id() as u64, "{ping}");
    silent.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    match silent.read(&mut byte) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the silent client is no longer connected and waiting: {other:?}"),
    }
    drop(silent);

    let down = remote(&socket, &["shutdown"]);
    assert_eq!(down.code, Some(0), "{}", down.explain());
    guard.defuse();
    let run = vm.finish(LIMIT);
    assert!(
        !read_text(&serial).contains("probe: done"),
        "the VM was not shut down by the API: {}",
        run.explain()
    );
    assert!(!socket.exists(), "the socket file is left behind");
}

#[test]
fn remote_to_a_missing_socket_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-vm-here.sock");
    for command in ["ping", "info", "pause"] {
        let r = remote(&socket, &[command]);
        assert_eq!(r.code, Some(1), "{command}: {}", r.explain());
        assert!(
            r.stderr.contains(socket.to_str().unwrap()),
            "{command}: {}",
            r.explain()
        );
    }
}

/// 40 clients sending a byte a second hold up no other client of a running VM's API (the
/// API thread under its seccomp filter): a ping is answered before any of them has sent its
/// third byte, while some are still connected, and each is closed before it is through.
#[test]
fn forty_slow_clients_do_not_hold_up_a_ping() {
    let dir = tempfile::tempdir().unwrap();
    let (socket, _, vm) = busy_vm_with_api(dir.path());
    let guard = KillOnPanic::new(&vm);
    testkit::assert_served_past_slow_clients(&socket, 40, Duration::from_secs(30), || {
        exchange(&socket, &request("GET", "/api/v1/vmm.ping", b""))
    });

    let down = remote(&socket, &["shutdown"]);
    assert_eq!(down.code, Some(0), "{}", down.explain());
    guard.defuse();
    let run = vm.finish(LIMIT);
    assert!(
        !run.stderr.contains("filter does not allow"),
        "{}",
        run.explain()
    );
}
