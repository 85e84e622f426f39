//! `musubi vmm`, a VMM that waits for its VM, driven by Cloud Hypervisor's own client
//! (`ch-remote`): its life cycle from a VmConfig file, and its refusals with their status
//! codes and messages.

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every call and guest here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(60);
const HELLO: &str = "{\"probe\":\"hello\"";

/// Cloud Hypervisor's client: `MUSUBI_CH_REMOTE`, else the workspace's shared anchor.
fn ch_remote() -> PathBuf {
    let path = std::env::var_os("MUSUBI_CH_REMOTE").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/anchors/ch-remote"),
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "ch-remote is missing at {} (set MUSUBI_CH_REMOTE to Cloud Hypervisor's ch-remote)",
        path.display()
    );
    path
}

/// Boots the created VM and waits for its guest to end on its own (status 0), which
/// leaves the VMM waiting with the VM in Shutdown.
fn boot_until_the_guest_exits(socket: &Path) {
    ch_ok(socket, &["boot"]);
    let ended = wait_for_state(socket, "Shutdown");
    assert_eq!(
        ended["musubi"]["ended"],
        serde_json::json!({"kind": "guest_exit", "status": 0}),
        "{ended}"
    );
}

/// ch-remote ARGS... failing, its message holding `says`.
fn ch_refused(socket: &Path, args: &[&str], says: &str) {
    let r = ch(socket, args);
    assert_ne!(r.code, Some(0), "{args:?}: {}", r.explain());
    assert!(
        r.stderr.contains(says),
        "{args:?}: {says:?}: {}",
        r.explain()
    );
}

/// A waiting VMM's directory, once ch-remote is known to be there to drive it.
fn vmm_dir() -> VmmDir {
    ch_remote();
    VmmDir::new()
}

/// `ch-remote --api-socket SOCKET ARGS...`, bounded.
fn ch(socket: &Path, args: &[&str]) -> Run {
    let mut all = vec!["--api-socket", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    run_command(std::process::Command::new(ch_remote()), &all, None, LIMIT)
}

/// As [`ch`], requiring success.
fn ch_ok(socket: &Path, args: &[&str]) -> String {
    let r = ch(socket, args);
    assert_eq!(r.code, Some(0), "ch-remote {args:?}: {}", r.explain());
    r.stdout
}

fn info(socket: &Path) -> Value {
    let out = ch_ok(socket, &["info"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("info is not JSON ({e}): {out}"))
}

/// The status and body of one raw API call.
fn call(socket: &Path, method: &str, endpoint: &str, body: Option<&str>) -> (u16, String) {
    musubi_api::request_with_timeout(socket, method, &format!("/api/v1/{endpoint}"), body, LIMIT)
        .unwrap_or_else(|e| panic!("{method} {endpoint}: {e}"))
}

fn wait_for_state(socket: &Path, state: &str) -> Value {
    let mut last = Value::Null;
    let reached = wait_until(LIMIT, || {
        last = info(socket);
        last["state"] == state
    });
    assert!(reached, "the VM never reached {state}: {last}");
    last
}

#[test]
fn a_waiting_vmm_takes_cloud_hypervisors_life_cycle_from_ch_remote() {
    let d = vmm_dir();
    let (socket, serial) = (d.socket.clone(), d.serial.clone());
    // A task far longer than the test: the VM is shut down through the API.
    let long = d.ch_vm_config("long.json", "hello,fib=60", LIMIT);
    let mut vmm = d.start_vmm(LIMIT);

    ch_ok(&socket, &["ping"]);
    ch_ok(&socket, &["create", long.to_str().unwrap()]);
    let created = info(&socket);
    assert_eq!(created["state"], "Created", "{created}");
    assert_eq!(created["config"]["cpus"]["boot_vcpus"], 1, "{created}");
    assert_eq!(
        created["config"]["memory"]["size"],
        128u64 << 20,
        "{created}"
    );
    assert_eq!(created["memory_actual_size"], 128u64 << 20, "{created}");
    assert!(
        created["config"]["payload"]["kernel"]
            .as_str()
            .is_some_and(|k| k.ends_with(".elf")),
        "{created}"
    );
    assert!(created["device_tree"].is_object(), "{created}");

    ch_ok(&socket, &["boot"]);
    vmm.wait_for_text(&serial, HELLO, LIMIT);
    assert_eq!(info(&socket)["state"], "Running");
    ch_ok(&socket, &["pause"]);
    assert_eq!(info(&socket)["state"], "Paused");
    ch_ok(&socket, &["resume"]);
    assert_eq!(info(&socket)["state"], "Running");
    ch_ok(&socket, &["shutdown"]);
    let down = info(&socket);
    assert_eq!(down["state"], "Shutdown", "{down}");
    assert_eq!(down["config"]["payload"], created["config"]["payload"]);

    // Booted afresh from the kept config: the guest says hello again (each boot opens the
    // console file anew, so it is removed first).
    std::fs::remove_file(&serial).unwrap();
    ch_ok(&socket, &["boot"]);
    vmm.wait_for_text(&serial, HELLO, LIMIT);
    assert_eq!(info(&socket)["state"], "Running");
    std::fs::remove_file(&serial).unwrap();
    ch_ok(&socket, &["reboot"]);
    vmm.wait_for_text(&serial, HELLO, LIMIT);
    assert_eq!(info(&socket)["state"], "Running");
    ch_ok(&socket, &["delete"]);
    let (status, body) = call(&socket, "GET", "vm.info", None);
    assert_eq!(status, 404, "info after delete: {body}");

    // A guest that ends on its own leaves the VMM waiting, the VM in Shutdown.
    let short = d.ch_vm_config("short.json", "hello", LIMIT);
    ch_ok(&socket, &["create", short.to_str().unwrap()]);
    boot_until_the_guest_exits(&socket);
    ch_ok(&socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert!(!socket.exists(), "the API socket is left behind");
}

#[test]
fn wrong_states_and_configs_musubi_cannot_honour_are_refused_with_cloud_hypervisors_codes() {
    let d = vmm_dir();
    let (dir, socket) = (d.dir.path(), d.socket.clone());
    let vmm = d.start_vmm(LIMIT);

    // Nothing created yet: 404, saying so; ch-remote fails with the message.
    for endpoint in ["vm.boot", "vm.pause", "vm.shutdown", "vm.reboot"] {
        let (status, body) = call(&socket, "PUT", endpoint, None);
        assert_eq!(status, 404, "{endpoint}: {body}");
        assert!(body.contains("no VM is created"), "{endpoint}: {body}");
    }
    let r = ch(&socket, &["boot"]);
    assert_ne!(r.code, Some(0), "boot without create: {}", r.explain());
    assert!(r.stderr.contains("no VM is created"), "{}", r.explain());

    let config = d.ch_vm_config("vm.json", "hello,fib=60", LIMIT);
    let text = std::fs::read_to_string(&config).unwrap();
    let mut base: Value = serde_json::from_str(&text).unwrap();
    for (field, value, says) in [
        (
            "memory",
            serde_json::json!({"size": 134217728, "hugepages": true}),
            "memory.hugepages true: not supported by Musubi",
        ),
        (
            "disks",
            serde_json::json!([{"path": config, "vhost_user": true}]),
            "disks[0].vhost_user true: not supported by Musubi",
        ),
        (
            "net",
            serde_json::json!([{"tap": "tap0", "num_queues": 3}]),
            "net[0].num_queues 3: not supported by Musubi",
        ),
        ("colour", serde_json::json!("red"), "colour: unknown field"),
        (
            "vsock",
            serde_json::json!({"cid": 2, "socket": "/tmp/v.sock"}),
            "vsock: cid 2 is reserved",
        ),
        (
            "rng",
            serde_json::json!({"src": "/dev/hwrng"}),
            "Musubi feeds virtio-rng from getrandom(2)",
        ),
    ] {
        let mut bad = base.clone();
        bad[field] = value;
        let (status, body) = call(&socket, "PUT", "vm.create", Some(&bad.to_string()));
        assert_eq!(status, 400, "{field}: {body}");
        assert!(body.contains(says), "{field}: {body}");
    }
    let bad = dir.join("bad.json");
    base["memory"]["hugepages"] = serde_json::json!(true);
    std::fs::write(&bad, base.to_string()).unwrap();
    let r = ch(&socket, &["create", bad.to_str().unwrap()]);
    assert_ne!(r.code, Some(0), "create with hugepages: {}", r.explain());
    assert!(
        r.stderr.contains("memory.hugepages true"),
        "{}",
        r.explain()
    );
    let (status, _) = call(&socket, "GET", "vm.info", None);
    assert_eq!(status, 404, "a refused create created a VM");

    ch_ok(&socket, &["create", config.to_str().unwrap()]);
    let (status, body) = call(&socket, "PUT", "vm.create", Some(&text));
    assert_eq!(status, 405, "second create: {body}");
    assert!(body.contains("a VM is already created"), "{body}");
    for endpoint in ["vm.pause", "vm.resume", "vm.shutdown", "vm.reboot"] {
        let (status, body) = call(&socket, "PUT", endpoint, None);
        assert_eq!(status, 405, "{endpoint} before boot: {body}");
        assert!(body.contains("the VM is Created, not booted"), "{body}");
    }
    ch_ok(&socket, &["boot"]);
    let (status, body) = call(&socket, "PUT", "vm.boot", None);
    assert_eq!(status, 405, "boot twice: {body}");
    assert!(body.contains("already booted"), "{body}");
    let (status, body) = call(&socket, "PUT", "vm.create", None);
    assert_eq!(status, 400, "create without a body: {body}");
    ch_ok(&socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
}

#[test]
fn devices_cold_plugged_before_boot_are_in_the_vm_that_boots_and_refused_after() {
    let d = vmm_dir();
    let (dir, socket) = (d.dir.path(), d.socket.clone());
    // The guest fills the disk it finds, so the file shows the disk was in the booted VM.
    let config = d.ch_vm_config("fill.json", "hello,blk-fill=5", LIMIT);
    let size = 1 << 20;
    let img = temp_image(dir, "cold.img", size);
    let spare = temp_image(dir, "spare.img", 4096);
    let vmm = d.start_vmm(LIMIT);

    let disk = format!("path={}", img.display());
    let (status, body) = call(&socket, "PUT", "vm.add-disk", Some("{}"));
    assert_eq!(status, 404, "add-disk without a VM: {body}");
    assert!(body.contains("no VM is created"), "{body}");

    ch_ok(&socket, &["create", config.to_str().unwrap()]);
    ch_ok(&socket, &["add-disk", &disk]);
    ch_ok(
        &socket,
        &["add-disk", &format!("path={},id=spare", spare.display())],
    );
    let created = info(&socket);
    let disks = &created["config"]["disks"];
    assert_eq!(disks[0]["id"], "_disk0", "{created}");
    assert_eq!(disks[0]["path"], img.to_str().unwrap(), "{created}");
    assert_eq!(disks[1]["id"], "spare", "{created}");
    assert!(created["device_tree"]["spare"].is_object(), "{created}");

    // A duplicate id: 409, naming it; ch-remote fails with the message.
    let dup = format!("path={},id=spare", spare.display());
    ch_refused(
        &socket,
        &["add-disk", &dup],
        "id \"spare\": a device of this VM has it already",
    );
    let body = format!(r#"{{"path": "{}", "id": "spare"}}"#, spare.display());
    let (status, text) = call(&socket, "PUT", "vm.add-disk", Some(&body));
    assert_eq!(status, 409, "duplicate id: {text}");
    // Fields are read as in vm.create's config.
    let body = format!(r#"{{"path": "{}", "vhost_user": true}}"#, spare.display());
    let (status, text) = call(&socket, "PUT", "vm.add-disk", Some(&body));
    assert_eq!(status, 400, "vhost_user disk: {text}");
    assert!(
        text.contains("disks[2].vhost_user true: not supported by Musubi"),
        "{text}"
    );

    ch_ok(&socket, &["remove-device", "spare"]);
    let (status, text) = call(
        &socket,
        "PUT",
        "vm.remove-device",
        Some(r#"{"id": "spare"}"#),
    );
    assert_eq!(status, 400, "removing a removed device: {text}");
    assert!(
        text.contains("no disk, net, pmem or vsock device"),
        "{text}"
    );
    let created = info(&socket);
    assert_eq!(
        created["config"]["disks"].as_array().map(Vec::len),
        Some(1),
        "{created}"
    );

    boot_until_the_guest_exits(&socket);
    let data = std::fs::read(&img).unwrap();
    for off in [0, 511, 4096, size - 1] {
        assert_eq!(
            data[off],
            fill_byte(off as u64, 5),
            "byte {off} of the cold-plugged disk"
        );
    }

    // Running: no device comes or goes, and the answer says what to do instead.
    let long = d.ch_vm_config("long.json", "hello,fib=60", LIMIT);
    ch_ok(&socket, &["delete"]);
    ch_ok(&socket, &["create", long.to_str().unwrap()]);
    ch_ok(
        &socket,
        &["add-disk", &format!("path={},id=data", spare.display())],
    );
    ch_ok(&socket, &["boot"]);
    // Counters are keyed by device id, as Cloud Hypervisor keys them.
    let out = ch_ok(&socket, &["counters"]);
    let counters: Value = serde_json::from_str(&out).unwrap();
    assert!(counters["data"].is_object(), "{counters}");
    ch_refused(
        &socket,
        &["add-disk", &disk],
        "virtio-mmio has no hot-plug: add devices before vm.boot",
    );
    for (endpoint, body) in [
        (
            "vm.add-disk",
            format!(r#"{{"path": "{}"}}"#, spare.display()),
        ),
        ("vm.add-net", r#"{"tap": "tap0"}"#.to_string()),
        (
            "vm.add-pmem",
            format!(r#"{{"file": "{}"}}"#, spare.display()),
        ),
        ("vm.remove-device", r#"{"id": "_disk0"}"#.to_string()),
    ] {
        let (status, text) = call(&socket, "PUT", endpoint, Some(&body));
        assert_eq!(status, 500, "{endpoint} after boot: {text}");
        assert!(text.contains("virtio-mmio has no hot-plug"), "{text}");
    }
    ch_ok(&socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
}

/// `fib=FIB_N` takes a few seconds, so a snapshot or a migration asked for right after
/// `hello` happens in the middle of it.
const FIB_N: u64 = 44;

/// The console a restored or received VM opened anew ends its `fib` with the right value
/// and its tasks with status 0, and has no hello (the guest went on, it did not boot
/// afresh).
fn assert_fib_ended_without_a_new_boot(text: &str) {
    let fib = result_in(text, "fib");
    assert_eq!(fib["result"], fib_value(FIB_N), "{text}");
    assert!(text.contains("probe: done, exit status 0"), "{text}");
    assert!(!text.contains(HELLO), "booted again:\n{text}");
}

#[test]
fn a_snapshot_taken_through_ch_remote_restores_into_another_waiting_vmm() {
    let (a, b) = (vmm_dir(), vmm_dir());
    let config = a.ch_vm_config("fib.json", &format!("hello,fib={FIB_N}"), LIMIT);
    let snap = a.dir.path().join("snap");
    let snap_url = format!("source_url=file://{}", snap.display());
    let mut first = a.start_vmm(LIMIT);
    ch_ok(&a.socket, &["create", config.to_str().unwrap()]);
    ch_ok(&a.socket, &["boot"]);
    first.wait_for_text(&a.serial, HELLO, LIMIT);
    ch_ok(&a.socket, &["pause"]);
    ch_ok(
        &a.socket,
        &["snapshot", &format!("file://{}", snap.display())],
    );
    ch_ok(&a.socket, &["shutdown-vmm"]);
    let run = first.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let before = read_text(&a.serial);
    // The pause may cut a line short, so the console is searched, not parsed.
    assert!(
        !before.contains("{\"probe\":\"fib\""),
        "fib had ended before the snapshot:\n{before}"
    );

    let second = b.start_vmm(LIMIT);
    ch_ok(&b.socket, &["restore", &snap_url]);
    let restored = info(&b.socket);
    assert_eq!(restored["state"], "Paused", "{restored}");
    assert_eq!(restored["config"]["cpus"]["boot_vcpus"], 1, "{restored}");
    assert_eq!(restored["memory_actual_size"], 128u64 << 20, "{restored}");
    ch_refused(
        &b.socket,
        &["restore", &snap_url],
        "a VM is already created",
    );
    ch_ok(&b.socket, &["resume"]);
    let ended = wait_for_state(&b.socket, "Shutdown");
    assert_eq!(
        ended["musubi"]["ended"],
        serde_json::json!({"kind": "guest_exit", "status": 0}),
        "{ended}"
    );
    assert_fib_ended_without_a_new_boot(&read_text(&a.serial));
    ch_ok(&b.socket, &["delete"]);
    // A snapshot that is not there is named, and the VMM waits on.
    ch_refused(
        &b.socket,
        &["restore", "source_url=file:///nonexistent/snap"],
        "/nonexistent/snap",
    );
    ch_ok(&b.socket, &["shutdown-vmm"]);
    let run = second.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
}

#[test]
fn a_vm_moves_between_waiting_vmms_with_ch_remotes_send_and_receive_migration() {
    let (a, b) = (vmm_dir(), vmm_dir());
    let secret = secret_file(a.dir.path(), "secret", 0x33);
    let flags = ["--secret-file", secret.to_str().unwrap()];
    let config = a.ch_vm_config("fib.json", &format!("hello,fib={FIB_N}"), LIMIT);
    let mut source = a.start_vmm_with(&flags, LIMIT);
    let destination = b.start_vmm_with(&flags, LIMIT);
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");

    ch_ok(&a.socket, &["create", config.to_str().unwrap()]);
    ch_ok(&a.socket, &["boot"]);
    source.wait_for_text(&a.serial, HELLO, LIMIT);
    // ch-remote's receive-migration returns once the VM runs there, so it waits on a thread.
    let receiver = {
        let (socket, url) = (b.socket.clone(), url.clone());
        std::thread::spawn(move || {
            ch(
                &socket,
                &["receive-migration", &format!("receiver_url={url}")],
            )
        })
    };
    assert!(
        wait_until(LIMIT, || listening_on_loopback(port)),
        "the destination never listened on {url}"
    );
    // ch-remote asks for a pre-copy (its default).
    ch_ok(
        &a.socket,
        &["send-migration", &format!("destination_url={url}")],
    );
    let received = receiver.join().unwrap();
    assert_eq!(
        received.code,
        Some(0),
        "receive-migration: {}",
        received.explain()
    );
    let gone = wait_for_state(&a.socket, "Shutdown");
    assert_eq!(gone["musubi"]["ended"]["kind"], "migrated", "{gone}");

    let ended = wait_for_state(&b.socket, "Shutdown");
    assert_eq!(
        ended["musubi"]["ended"],
        serde_json::json!({"kind": "guest_exit", "status": 0}),
        "{ended}"
    );
    assert_eq!(ended["config"]["memory"]["size"], 128u64 << 20, "{ended}");
    assert_fib_ended_without_a_new_boot(&read_text(&a.serial));
    ch_ok(&a.socket, &["shutdown-vmm"]);
    ch_ok(&b.socket, &["shutdown-vmm"]);
    for vmm in [source, destination] {
        let run = vmm.finish(LIMIT);
        assert_eq!(run.code, Some(0), "{}", run.explain());
    }
}

#[test]
fn an_rng_in_a_cloud_hypervisor_config_feeds_the_guest_from_getrandom() {
    let d = vmm_dir();
    let path = d.ch_vm_config("rng.json", "rng=65536", LIMIT);
    let mut config: Value = serde_json::from_str(&read_text(&path)).unwrap();
    config["rng"] = serde_json::json!({"src": "/dev/urandom"});
    std::fs::write(&path, config.to_string()).unwrap();
    let vmm = d.start_vmm(LIMIT);
    ch_ok(&d.socket, &["create", path.to_str().unwrap()]);
    assert_eq!(info(&d.socket)["config"]["rng"]["src"], "/dev/urandom");
    boot_until_the_guest_exits(&d.socket);
    let rng = result_in(&read_text(&d.serial), "rng");
    assert_eq!(
        (&rng["ok"], &rng["bytes"]),
        (&Value::Bool(true), &Value::from(65536)),
        "{rng}"
    );
    ch_ok(&d.socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
}

/// Boots the created VM and talks to its guest's `vsock-echo` on port 52 through the VM's
/// vsock socket, as a host agent would.
fn boot_and_echo_over_vsock(vmm: &mut Started, d: &VmmDir, socket: &Path) {
    // Each boot opens the console file anew.
    let _ = std::fs::remove_file(&d.serial);
    ch_ok(&d.socket, &["boot"]);
    vmm.wait_for_text(&d.serial, "vsock-echo: cid 3 listening", LIMIT);
    let (mut s, line) = common::vsock::connect_at(socket, 52, LIMIT);
    assert!(line.starts_with("OK "), "CONNECT 52 answered {line:?}");
    let data: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    let back = common::vsock::echo_round_trip(&mut s, &data);
    assert!(back == data, "the echo differs");
}

#[test]
fn a_stack_built_for_cloud_hypervisor_runs_the_whole_life_cycle_with_ch_remote() {
    let d = vmm_dir();
    let dir = d.dir.path();
    // The echo ends after one connection; fib then runs far longer than the test.
    let config = d.ch_vm_config("agent.json", "hello,vsock-echo=52,fib=60", LIMIT);
    let img = temp_image(dir, "data.img", 1 << 20);
    let vsock = dir.join("v.sock");
    let snap = dir.join("snap");
    let mut vmm = d.start_vmm(LIMIT);

    ch_ok(&d.socket, &["create", config.to_str().unwrap()]);
    ch_ok(&d.socket, &["add-disk", &format!("path={}", img.display())]);
    ch_ok(
        &d.socket,
        &["add-vsock", &format!("cid=3,socket={}", vsock.display())],
    );
    // One vsock device a VM: a second is a conflict.
    let (status, body) = call(
        &d.socket,
        "PUT",
        "vm.add-vsock",
        Some(r#"{"cid": 4, "socket": "/tmp/other.sock"}"#),
    );
    assert_eq!(status, 409, "a second vsock: {body}");

    boot_and_echo_over_vsock(&mut vmm, &d, &vsock);
    let running = info(&d.socket);
    assert_eq!(running["state"], "Running", "{running}");
    assert_eq!(running["config"]["vsock"]["cid"], 3, "{running}");
    assert_eq!(running["config"]["vsock"]["id"], "_vsock0", "{running}");
    assert_eq!(running["config"]["disks"][0]["id"], "_disk0", "{running}");
    for id in ["_disk0", "_vsock0"] {
        assert!(running["device_tree"][id].is_object(), "{id}: {running}");
    }

    ch_ok(&d.socket, &["pause"]);
    assert_eq!(info(&d.socket)["state"], "Paused");
    ch_ok(
        &d.socket,
        &["snapshot", &format!("file://{}", snap.display())],
    );
    ch_ok(&d.socket, &["resume"]);
    assert_eq!(info(&d.socket)["state"], "Running");
    ch_ok(&d.socket, &["shutdown"]);
    assert_eq!(info(&d.socket)["state"], "Shutdown");
    assert!(!vsock.exists(), "the vsock socket outlived its VM");

    // Booted afresh from the kept config: the agent's channel works again.
    boot_and_echo_over_vsock(&mut vmm, &d, &vsock);
    ch_ok(&d.socket, &["delete"]);
    let (status, body) = call(&d.socket, "GET", "vm.info", None);
    assert_eq!(status, 404, "info after delete: {body}");
    ch_ok(&d.socket, &["create", config.to_str().unwrap()]);
    assert_eq!(info(&d.socket)["state"], "Created");
    ch_ok(&d.socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert!(!d.socket.exists() && !vsock.exists(), "sockets left behind");
    assert!(
        snap.join("state").is_file(),
        "no snapshot in {}",
        snap.display()
    );
}
