//! virtio-vsock end to end, with its hybrid host side: host programs on the VM's UNIX
//! socket (`CONNECT <port>`) talking to the probe guest's `vsock-echo`, and the guest's
//! `vsock-send` reaching a host listener at `PATH_<port>`, on both exit paths.

mod common;
use common::vsock::*;
use common::*;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every guest test's limit: a loaded machine booting the probe and moving a few hundred
/// KiB through its emulated kernel path, with room to spare.
const LIMIT: Duration = Duration::from_secs(120);
const PORT: u32 = 52;

/// A VM running the probe with `tasks`, its vsock at `dir/v.sock`, its console in
/// `dir/serial`.
struct Vsock {
    vm: Started,
    socket: PathBuf,
    serial: PathBuf,
}

fn start(dir: &Path, tasks: &str, exits: &str) -> Vsock {
    let socket = dir.join("v.sock");
    let serial = dir.join("serial");
    let vsock = format!("cid=3,socket={}", socket.display());
    let console = format!("file={}", serial.display());
    let mut args = probe_args(tasks, &["--memory", "128M", "--exits", exits]);
    args.extend(["--vsock", &vsock, "--serial", &console].map(String::from));
    Vsock {
        vm: start_command(musubi(), &args, None),
        socket,
        serial,
    }
}

impl Vsock {
    /// Waits for the guest's listener, then connects to guest port `port` as a host program
    /// does; the device's answer line is returned with the stream.
    fn connect(&mut self, port: u32) -> (UnixStream, String) {
        self.vm
            .wait_for_text(&self.serial, "vsock-echo: cid 3 listening", LIMIT);
        connect_at(&self.socket, port, LIMIT)
    }

    /// Waits for the VM to end: how it ended, and what the guest printed.
    fn finish(self) -> (Run, String) {
        let run = self.vm.finish(LIMIT);
        assert!(
            !self.socket.exists(),
            "the socket file outlived the VM\n{}",
            run.explain()
        );
        (run, read_text(&self.serial))
    }
}

fn echo_runs(exits: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), &format!("vsock-echo={PORT}"), exits);
    let (mut s, line) = vm.connect(PORT);
    let hostport: u32 = line
        .strip_prefix("OK ")
        .and_then(|p| p.trim_end().parse().ok())
        .unwrap_or_else(|| panic!("answer to CONNECT: {line:?}"));
    assert!(line.ends_with('\n') && hostport > 0, "{line:?}");
    let data = pattern(200 * 1024);
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    let (run, console) = vm.finish();
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    let r = result_in(&console, "vsock-echo");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["connections"], 1, "{r}");
    assert_eq!(r["bytes"], data.len(), "{r}");
    assert_eq!(r["cid"], 3, "{r}");
}

#[test]
fn a_host_program_talks_to_the_guests_listener_kernel_exits() {
    echo_runs("kernel");
}

#[test]
fn a_host_program_talks_to_the_guests_listener_user_exits() {
    echo_runs("user");
}

fn send_runs(exits: &str) {
    let dir = tempfile::tempdir().unwrap();
    let bytes = 300_000usize;
    let listener = UnixListener::bind(dir.path().join("v.sock_5000")).unwrap();
    let host = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("the guest's connection arrives");
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("the stream ends cleanly");
        got
    });
    let vm = start(dir.path(), &format!("vsock-send=5000,bytes={bytes}"), exits);
    let (run, console) = vm.finish();
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    let got = host.join().unwrap();
    let expected: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    assert_eq!(got.len(), bytes);
    assert!(got == expected, "the stream differs from the pattern");
    let r = result_in(&console, "vsock-send");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["bytes"], bytes, "{r}");
    assert_eq!(
        r["crc32"],
        format!("{:#010x}", crc32fast::hash(&got)),
        "the guest's CRC-32 is not the host's"
    );
}

#[test]
fn the_guest_streams_to_a_host_listener_kernel_exits() {
    send_runs("kernel");
}

#[test]
fn the_guest_streams_to_a_host_listener_user_exits() {
    send_runs("user");
}

#[test]
fn a_guest_connecting_to_a_port_nobody_listens_on_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (run, console) = start(dir.path(), "vsock-send=5001,bytes=1000", "kernel").finish();
    assert_eq!(run.code, Some(7), "{}\n{console}", run.explain());
    let r = result_in(&console, "vsock-send");
    assert_eq!(
        (&r["ok"], &r["error"]),
        (&false.into(), &"connection refused".into()),
        "{r}"
    );
}

#[test]
fn hostile_host_clients_are_closed_and_the_vmm_serves_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), &format!("vsock-echo={PORT}"), "kernel");
    vm.vm
        .wait_for_text(&vm.serial, "vsock-echo: cid 3 listening", LIMIT);
    // Garbage instead of CONNECT, a line that never ends, a port that is no number.
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[b'C'; 200],
        b"CONNECT fifty-two\n",
        b"\x00\xff\xfe\n",
    ] {
        let mut s = UnixStream::connect(&vm.socket).unwrap();
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let _ = s.write_all(junk);
        assert!(closed(&mut s), "{junk:?} was not closed");
    }
    // A port the guest does not listen on: the guest resets, the client is closed
    // without an OK.
    let (mut s, line) = vm.connect(99);
    assert_eq!(line, "", "CONNECT 99 was answered");
    assert!(closed(&mut s));
    // A client that connects and says nothing, and one that leaves mid-line, do not
    // keep the next one out.
    let _silent = UnixStream::connect(&vm.socket).unwrap();
    {
        let mut half = UnixStream::connect(&vm.socket).unwrap();
        half.write_all(b"CONN").unwrap();
    }
    let (mut s, line) = vm.connect(PORT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(5000);
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    let (run, console) = vm.finish();
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    let r = result_in(&console, "vsock-echo");
    assert_eq!(
        (&r["ok"], &r["connections"]),
        (&true.into(), &1.into()),
        "{r}"
    );
}

#[test]
fn bad_vsock_values_are_refused_naming_the_flag_and_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let taken = dir.path().join("taken");
    std::fs::write(&taken, b"").unwrap();
    for (value, why) in [
        ("cid=2,socket=/tmp/x".to_string(), "cid 2 is reserved"),
        ("cid=three,socket=/tmp/x".to_string(), "cid=\"three\""),
        ("socket=/tmp/x".to_string(), "cid= is missing"),
        (
            format!("cid=3,socket={}", taken.display()),
            "already exists",
        ),
    ] {
        let run = run_probe("hello", &["--vsock", &value]);
        assert_ne!(run.code, Some(0), "{value} was accepted");
        assert!(
            run.stderr.contains("--vsock")
                && run.stderr.contains(&value)
                && run.stderr.contains(why),
            "{value}: {}",
            run.stderr
        );
    }
}

#[test]
fn a_restored_vm_tells_the_guest_its_connections_are_gone_and_takes_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (api, serial) = (dir.path().join("api.sock"), dir.path().join("original.out"));
    let socket = dir.path().join("v.sock");
    let snap = dir.path().join("snap");
    let vsock = format!("cid=3,socket={}", socket.display());
    let mut vm = start_probe_with_api(
        &format!("vsock-echo={PORT}"),
        &api,
        &serial,
        &["--memory", "128M", "--vsock", &vsock],
    );
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, "vsock-echo: cid 3 listening", LIMIT);
    // A connection is open when the VM is saved.
    let (mut old, line) = connect_at(&socket, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(3000);
    assert!(echo_round_trip(&mut old, &data) == data, "the echo differs");
    let answer = remote(&api, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(answer.code, Some(0), "snapshot: {}", answer.explain());
    let down = remote(&api, &["shutdown"]);
    assert_eq!(down.code, Some(0), "shutdown: {}", down.explain());
    guard.defuse();
    vm.finish(LIMIT);
    assert!(!socket.exists(), "the original's socket file outlived it");
    assert!(closed(&mut old), "the original's connection outlived it");

    let restored = dir.path().join("restored.out");
    let args = [
        "run".to_string(),
        "--restore".into(),
        snap.display().to_string(),
        "--serial".into(),
        format!("file={}", restored.display()),
        "--timeout".into(),
        "200".into(),
    ];
    let mut vm = start_command(musubi(), &args, None);
    vm.wait_for_file(&socket, LIMIT);
    let (mut s, line) = connect_at(&socket, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    let run = vm.finish(LIMIT);
    let console = read_text(&restored);
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    assert!(
        !socket.exists(),
        "the restored VM's socket file outlived it"
    );
    let r = result_in(&console, "vsock-echo");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["resets"], 1, "no transport reset reached the guest: {r}");
    assert_eq!(r["lost_to_resets"], 1, "{r}");
    assert_eq!(r["connections"], 1, "{r}");
}

#[test]
fn a_restore_given_another_vsock_socket_listens_there_while_the_original_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let (api, serial) = (dir.path().join("api.sock"), dir.path().join("original.out"));
    let socket = dir.path().join("v.sock");
    let elsewhere = dir.path().join("w.sock");
    let snap = dir.path().join("snap");
    let vsock = format!("cid=3,socket={}", socket.display());
    let mut vm = start_probe_with_api(
        &format!("vsock-echo={PORT}"),
        &api,
        &serial,
        &[
            "--memory",
            "128M",
            "--vsock",
            &vsock,
            "--rng",
            "bytes_per_sec=4096",
        ],
    );
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, "vsock-echo: cid 3 listening", LIMIT);
    let answer = remote(&api, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(answer.code, Some(0), "snapshot: {}", answer.explain());

    // The original still listens at the saved path: a restore must be told where else.
    let restore = |flags: &[&str]| -> Vec<String> {
        let mut a = vec![
            "run".to_string(),
            "--restore".into(),
            snap.display().to_string(),
            "--serial".into(),
            format!("file={}", dir.path().join("restored.out").display()),
            "--timeout".into(),
            "200".into(),
        ];
        a.extend(flags.iter().map(|f| f.to_string()));
        a
    };
    let moved = format!("cid=3,socket={}", elsewhere.display());
    let other_cid = format!("cid=4,socket={}", elsewhere.display());
    for (flags, names) in [
        (
            vec![],
            vec!["--restore", "v.sock", "already exists", "--vsock"],
        ),
        (
            vec!["--vsock", other_cid.as_str()],
            vec!["--vsock", "cid is 3", "cid=4"],
        ),
        (
            vec!["--vsock", moved.as_str(), "--rng"],
            vec!["--rng", "bytes_per_sec=4096", "uncapped"],
        ),
        (
            vec!["--vsock", moved.as_str(), "--rng", "bytes_per_sec=1"],
            vec!["--rng", "bytes_per_sec=4096", "bytes_per_sec=1"],
        ),
    ] {
        let r = run(&restore(&flags));
        assert_eq!(r.code, Some(1), "{flags:?}: {}", r.explain());
        for n in names {
            assert!(
                r.stderr.contains(n),
                "{flags:?}: no {n:?} in {}",
                r.explain()
            );
        }
        assert!(!elsewhere.exists(), "{flags:?}: a refused restore listened");
    }

    let mut restored = start_command(
        musubi(),
        &restore(&["--vsock", &moved, "--rng", "bytes_per_sec=4096"]),
        None,
    );
    let restored_guard = KillOnPanic::new(&restored);
    restored.wait_for_file(&elsewhere, LIMIT);
    let (mut s, line) = connect_at(&elsewhere, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    let data = pattern(3000);
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    restored_guard.defuse();
    let run = restored.finish(LIMIT);
    let console = read_text(&dir.path().join("restored.out"));
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    assert!(
        !elsewhere.exists(),
        "the restored VM's socket file outlived it"
    );
    let r = result_in(&console, "vsock-echo");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["resets"], 1, "no transport reset reached the guest: {r}");
    assert_eq!(r["connections"], 1, "{r}");

    // The original kept its own socket all along, and serves it again once resumed (a
    // snapshot leaves the VM paused).
    assert!(
        socket.exists(),
        "the restore took the original's socket file"
    );
    let answer = remote(&api, &["resume"]);
    assert_eq!(answer.code, Some(0), "resume: {}", answer.explain());
    let (mut s, line) = connect_at(&socket, PORT, LIMIT);
    assert!(line.starts_with("OK "), "{line:?}");
    assert!(echo_round_trip(&mut s, &data) == data, "the echo differs");
    drop(s);
    guard.defuse();
    let run = vm.finish(LIMIT);
    let console = read_text(&serial);
    assert_eq!(run.code, Some(0), "{}\n{console}", run.explain());
    assert!(!socket.exists(), "the original's socket file outlived it");
}
