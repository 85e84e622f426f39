//! The server end to end on a real socket, against a VM that only records what it is asked.

use musubi_api::{request_with_timeout, ActionError, ApiError, ApiServer, VmControl};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Generous: a bound so no test hangs, never a timing assertion.
const BOUND: Duration = Duration::from_secs(30);

#[derive(Default)]
struct MockVm {
    paused: Mutex<bool>,
    calls: Mutex<Vec<String>>,
}

impl MockVm {
    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn state(&self) -> &'static str {
        if *self.paused.lock().unwrap() {
            "Paused"
        } else {
            "Running"
        }
    }
    /// As CH: the same state again is an invalid transition, answered 500.
    fn go(&self, to_paused: bool) -> Result<(), ActionError> {
        let mut p = self.paused.lock().unwrap();
        if *p == to_paused {
            let s = if to_paused { "Paused" } else { "Running" };
            return Err(ActionError::internal(format!(
                "invalid VM state transition: {s} to {s}"
            )));
        }
        *p = to_paused;
        Ok(())
    }
}

impl VmControl for MockVm {
    fn info(&self) -> Result<serde_json::Value, ActionError> {
        self.record("info".into());
        Ok(serde_json::json!({"config": {"cpus": {"boot_vcpus": 2}}, "state": self.state()}))
    }
    fn counters(&self) -> Result<serde_json::Value, ActionError> {
        self.record("counters".into());
        Ok(serde_json::json!({"_disk0": {"read_ops": 3}}))
    }
    fn pause(&self) -> Result<(), ActionError> {
        self.record("pause".into());
        self.go(true)
    }
    fn resume(&self) -> Result<(), ActionError> {
        self.record("resume".into());
        self.go(false)
    }
    fn snapshot(&self, dir: &Path) -> Result<(), ActionError> {
        self.record(format!("snapshot {}", dir.display()));
        Ok(())
    }
    fn shutdown_vm(&self) -> Result<(), ActionError> {
        self.record("shutdown_vm".into());
        Ok(())
    }
    fn shutdown_vmm(&self) -> Result<(), ActionError> {
        self.record("shutdown_vmm".into());
        Ok(())
    }
    fn power_button(&self) -> Result<(), ActionError> {
        self.record("power_button".into());
        Ok(())
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    vm: Arc<MockVm>,
    server: Option<ApiServer>,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let vm = Arc::new(MockVm::default());
        let server = ApiServer::start(&path, vm.clone(), || Ok(())).unwrap();
        Fixture {
            _dir: dir,
            path,
            vm,
            server: Some(server),
        }
    }

    fn call(&self, method: &str, endpoint: &str, body: Option<&str>) -> (u16, String) {
        request_with_timeout(
            &self.path,
            method,
            &format!("/api/v1/{endpoint}"),
            body,
            BOUND,
        )
        .unwrap()
    }
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"))
}

#[test]
fn ping_answers_versions_and_pid() {
    let f = Fixture::new();
    let (status, body) = f.call("GET", "vmm.ping", None);
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["build_version"].is_string(), "{v}");
    assert_eq!(v["pid"], std::process::id());
    assert!(v["features"].is_array(), "{v}");
}

#[test]
fn info_and_counters_are_the_vms() {
    let f = Fixture::new();
    let (status, body) = f.call("GET", "vm.info", None);
    assert_eq!(status, 200);
    let v = json(&body);
    assert_eq!(v["state"], "Running");
    assert_eq!(v["config"]["cpus"]["boot_vcpus"], 2);
    let (status, body) = f.call("GET", "vm.counters", None);
    assert_eq!(
        (status, json(&body)["_disk0"]["read_ops"].clone()),
        (200, 3.into())
    );
    assert_eq!(f.vm.calls(), ["info", "counters"]);
}

#[test]
fn pause_and_resume_answer_204_and_an_invalid_transition_500() {
    let f = Fixture::new();
    assert_eq!(f.call("PUT", "vm.pause", None), (204, String::new()));
    assert_eq!(json(&f.call("GET", "vm.info", None).1)["state"], "Paused");
    let (status, body) = f.call("PUT", "vm.pause", None);
    assert_eq!(status, 500, "{body}");
    let messages: Vec<String> = serde_json::from_str(&body).unwrap();
    assert_eq!(messages[1], "The VM could not be paused");
    assert!(
        messages.last().unwrap().contains("Paused to Paused"),
        "{body}"
    );
    assert_eq!(f.call("PUT", "vm.resume", None), (204, String::new()));
    assert_eq!(f.call("PUT", "vm.resume", None).0, 500);
    assert_eq!(f.vm.calls(), ["pause", "info", "pause", "resume", "resume"]);
}

#[test]
fn shutdowns_answer_as_chs_do() {
    let f = Fixture::new();
    assert_eq!(f.call("PUT", "vm.shutdown", None), (204, String::new()));
    assert_eq!(f.call("PUT", "vmm.shutdown", None), (200, String::new()));
    assert_eq!(f.vm.calls(), ["shutdown_vm", "shutdown_vmm"]);
}

#[test]
fn the_power_button_is_a_bodiless_put_answered_204() {
    let f = Fixture::new();
    assert_eq!(f.call("PUT", "vm.power-button", None), (204, String::new()));
    assert_eq!(f.call("GET", "vm.power-button", None).0, 400);
    assert_eq!(f.call("PUT", "vm.power-button", Some("{}")).0, 400);
    assert_eq!(f.vm.calls(), ["power_button"]);
}

/// A VMM that does not implement it refuses, naming what is missing.
#[test]
fn a_vm_without_a_power_button_refuses_the_press() {
    struct NoButton;
    impl VmControl for NoButton {
        fn info(&self) -> Result<serde_json::Value, ActionError> {
            Ok(serde_json::json!({}))
        }
        fn counters(&self) -> Result<serde_json::Value, ActionError> {
            Ok(serde_json::json!({}))
        }
        fn pause(&self) -> Result<(), ActionError> {
            Ok(())
        }
        fn resume(&self) -> Result<(), ActionError> {
            Ok(())
        }
        fn snapshot(&self, _: &Path) -> Result<(), ActionError> {
            Ok(())
        }
        fn shutdown_vm(&self) -> Result<(), ActionError> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    let _server = ApiServer::start(&path, Arc::new(NoButton), || Ok(())).unwrap();
    let (status, body) =
        request_with_timeout(&path, "PUT", "/api/v1/vm.power-button", None, BOUND).unwrap();
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("no power button"), "{body}");
}

#[test]
fn snapshot_takes_a_file_url_and_refuses_anything_else_naming_the_field() {
    let f = Fixture::new();
    let good = r#"{"destination_url": "file:///var/snap/one"}"#;
    assert_eq!(
        f.call("PUT", "vm.snapshot", Some(good)),
        (204, String::new())
    );
    assert_eq!(f.vm.calls(), ["snapshot /var/snap/one"]);
    for bad in [
        r#"{"destination_url": "tcp:127.0.0.1:80"}"#,
        r#"{"destination_url": "file://relative"}"#,
        r#"{"destination_url": 7}"#,
        r#"{"source_url": "file:///x"}"#,
    ] {
        let (status, body) = f.call("PUT", "vm.snapshot", Some(bad));
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body.contains("destination_url"), "{bad}: {body}");
    }
    let (status, body) = f.call("PUT", "vm.snapshot", Some("{not json"));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("Failed to deserialize JSON"), "{body}");
    assert_eq!(f.call("PUT", "vm.snapshot", None).0, 400);
    assert_eq!(f.vm.calls().len(), 1, "no bad request reached the VM");
}

#[test]
fn unknown_paths_are_404_and_wrong_methods_400() {
    let f = Fixture::new();
    let (status, body) = f.call("GET", "vm.nonesuch", None);
    assert_eq!((status, body.as_str()), (404, r#"["Not Found"]"#));
    let (status, body) = request_with_timeout(&f.path, "GET", "/other", None, BOUND).unwrap();
    assert_eq!((status, body.as_str()), (404, r#"["Not Found"]"#));
    // Cloud Hypervisor's paths that Musubi has no use for say why.
    for (endpoint, why) in [
        ("vm.resize", "no CPU or memory hot-plug"),
        ("vm.add-fs", "no vhost-user devices"),
        ("vm.nmi", "does not inject NMIs"),
    ] {
        let (status, body) = f.call("PUT", endpoint, Some("{}"));
        assert_eq!(status, 500, "{endpoint}: {body}");
        assert!(
            body.contains(&format!("{endpoint} is not supported by Musubi")) && body.contains(why),
            "{endpoint}: {body}"
        );
    }
    assert_eq!(f.vm.calls().len(), 0, "a refused path reached the VM");
    for (method, endpoint) in [
        ("PUT", "vmm.ping"),
        ("POST", "vm.info"),
        ("GET", "vm.pause"),
        ("DELETE", "vm.snapshot"),
    ] {
        let (status, body) = f.call(method, endpoint, None);
        assert_eq!(
            (status, body.as_str()),
            (400, r#"["Bad Request"]"#),
            "{method} {endpoint}"
        );
    }
    // An action without a body refuses one, as CH's.
    assert_eq!(f.call("PUT", "vm.pause", Some("{}")).0, 400);
    assert!(f.vm.calls().is_empty());
}

#[test]
fn a_body_over_64_kib_is_refused_413() {
    let f = Fixture::new();
    let big = format!(
        r#"{{"destination_url": "file:///{}"}}"#,
        "a".repeat(64 * 1024)
    );
    let (status, body) = f.call("PUT", "vm.snapshot", Some(&big));
    assert_eq!(status, 413, "{body}");
    assert!(f.vm.calls().is_empty());
}

#[test]
fn a_silent_client_does_not_hold_up_another_and_is_closed() {
    let f = Fixture::new();
    let mut silent = UnixStream::connect(&f.path).unwrap();
    let (status, _) = f.call("GET", "vmm.ping", None);
    assert_eq!(status, 200);
    // The silent one was still connected while the other was answered.
    silent.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let e = silent
        .read(&mut b)
        .expect_err("still open, nothing to read");
    assert_eq!(e.kind(), ErrorKind::WouldBlock);
    // And it is closed once its time is up.
    silent.set_nonblocking(false).unwrap();
    silent.set_read_timeout(Some(BOUND)).unwrap();
    assert_eq!(silent.read(&mut b).unwrap(), 0, "closed without an answer");
}

#[test]
fn the_socket_is_mode_0600_and_removed_on_stop() {
    let mut f = Fixture::new();
    let mode = std::fs::metadata(&f.path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    f.server.take().unwrap().stop();
    assert!(!f.path.exists());
}

#[test]
fn a_stale_socket_is_replaced_and_anything_else_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    // A socket file nobody serves on: bound, then its listener dropped.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let vm = Arc::new(MockVm::default());
    let server = ApiServer::start(&path, vm.clone(), || Ok(())).unwrap();
    assert_eq!(
        request_with_timeout(&path, "GET", "/api/v1/vmm.ping", None, BOUND)
            .unwrap()
            .0,
        200
    );
    // The live one is not taken over.
    match ApiServer::start(&path, vm.clone(), || Ok(())) {
        Err(ApiError::InUse(p)) => assert_eq!(p, path),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(server);
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "mine").unwrap();
    let e = ApiServer::start(&file, vm.clone(), || Ok(()))
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains(&*file.to_string_lossy()), "{e}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}

#[test]
fn a_failing_filter_is_reported_by_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    let e = ApiServer::start(&path, Arc::new(MockVm::default()), || {
        Err("no filter today".into())
    })
    .map(|_| ())
    .unwrap_err();
    assert!(e.to_string().contains("no filter today"), "{e}");
}

#[test]
fn a_missing_socket_is_named_by_the_client() {
    let e = request_with_timeout(Path::new("/nonexistent/api.sock"), "GET", "/", None, BOUND)
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/api.sock"), "{e}");
}

/// A client of another user, in a child process that becomes `nobody`, is closed without
/// an answer; a client of this user is served.
#[test]
fn a_peer_of_another_uid_is_refused() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root: it runs a client as another user (uid 65534)"
    );
    let f = Fixture::new();
    // Let the other user reach the socket, so the refusal is the server's, not the file
    // system's.
    let dir = f.path.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&f.path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let c_path = std::ffi::CString::new(f.path.to_str().unwrap()).unwrap();
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(c_path.as_bytes_with_nul()) {
        *d = *s as libc::c_char;
    }
    let request = b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: x\r\n\r\n";
    let timeout = libc::timeval {
        tv_sec: BOUND.as_secs() as _,
        tv_usec: 0,
    };
    // SAFETY: the child makes only async-signal-safe system calls on memory prepared
    // before the fork, then _exits; the parent waits for it.
    let status = unsafe {
        let pid = libc::fork();
        assert!(pid >= 0);
        if pid == 0 {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(10);
            }
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if s < 0 {
                libc::_exit(11);
            }
            libc::setsockopt(
                s,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            if libc::connect(
                s,
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            ) != 0
            {
                libc::_exit(12);
            }
            libc::write(s, request.as_ptr().cast(), request.len());
            let mut b = [0u8; 64];
            let n = libc::read(s, b.as_mut_ptr().cast(), b.len());
            // 0: closed without an answer; an error is a reset, also a refusal.
            libc::_exit(if n > 0 { 1 } else { 0 });
        }
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        status
    };
    assert!(libc::WIFEXITED(status), "{status:#x}");
    let code = libc::WEXITSTATUS(status);
    assert_eq!(
        code, 0,
        "the other user's client: 1 = answered, 1x = setup failed"
    );
    assert_eq!(f.call("GET", "vmm.ping", None).0, 200);
}

/// 40 clients sending a byte a second do not hold up a ping: it is answered before any of
/// them has sent its third byte, while some of them are still connected.
#[test]
fn forty_slow_clients_do_not_hold_up_a_ping() {
    let f = Fixture::new();
    testkit::assert_served_past_slow_clients(&f.path, 40, BOUND, || {
        f.call("GET", "vmm.ping", None)
    });
}

/// Past the limit a new client takes the place of the one held longest, which is closed;
/// the others stay.
#[test]
fn a_client_past_the_limit_closes_the_one_held_longest() {
    use musubi_api::server::MAX_CONNECTIONS;
    let f = Fixture::new();
    let silent: Vec<UnixStream> = (0..=MAX_CONNECTIONS)
        .map(|_| UnixStream::connect(&f.path).unwrap())
        .collect();
    let mut b = [0u8; 1];
    silent[0].set_read_timeout(Some(BOUND)).unwrap();
    assert_eq!((&silent[0]).read(&mut b).unwrap(), 0, "the first is closed");
    for (i, mut s) in silent.iter().enumerate().skip(1) {
        s.set_nonblocking(true).unwrap();
        match s.read(&mut b) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            other => panic!("client {i} is no longer held: {other:?}"),
        }
    }
    assert_eq!(f.call("GET", "vmm.ping", None).0, 200);
}
