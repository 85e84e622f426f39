//! `musubi vmm`, a VMM that waits for its VM, driven by Musubi's own client (`musubi
//! remote`): create from a VmConfig file, boot, reboot, delete, shutdown-vmm, and the
//! refusals it prints, the VMM's or its own for a config file it cannot send.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Every call and guest here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(60);
const HELLO: &str = "{\"probe\":\"hello\"";

/// `musubi remote ARGS...` failing, its message holding every one of `says`.
fn refused(socket: &Path, args: &[&str], says: &[&str]) {
    let r = remote(socket, args);
    assert_ne!(r.code, Some(0), "remote {args:?}: {}", r.explain());
    for s in says {
        assert!(
            r.stderr.contains(s),
            "remote {args:?}: {s:?}: {}",
            r.explain()
        );
    }
}

fn state(socket: &Path) -> Value {
    remote_json(socket, &["info"])["state"].clone()
}

#[test]
fn musubi_remote_drives_a_waiting_vmms_life_cycle_and_names_a_bad_config_file() {
    let d = VmmDir::new();
    let (dir, socket, serial) = (d.dir.path(), d.socket.clone(), d.serial.clone());
    // A task far longer than the test: the VM is ended through the API.
    let config = d.ch_vm_config("vm.json", "hello,fib=60", LIMIT);
    let mut vmm = d.start_vmm(LIMIT);

    // Files the client cannot send are refused before any request, naming the file.
    let missing = dir.join("missing.json");
    refused(
        &socket,
        &["create", missing.to_str().unwrap()],
        &[missing.to_str().unwrap()],
    );
    let text = dir.join("text.json");
    std::fs::write(&text, "cpus=1\n").unwrap();
    refused(
        &socket,
        &["create", text.to_str().unwrap()],
        &[text.to_str().unwrap(), "not JSON"],
    );

    // Nothing created: the VMM's 404 and reason come back; deleting nothing is accepted,
    // as Cloud Hypervisor accepts it.
    refused(&socket, &["info"], &["404", "no VM is created"]);
    refused(&socket, &["boot"], &["vm.boot", "404", "no VM is created"]);
    remote_json(&socket, &["delete"]);

    remote_json(&socket, &["create", config.to_str().unwrap()]);
    assert_eq!(state(&socket), "Created");
    refused(
        &socket,
        &["create", config.to_str().unwrap()],
        &["vm.create", "405", "a VM is already created"],
    );
    refused(
        &socket,
        &["reboot"],
        &["vm.reboot", "405", "the VM is Created, not booted"],
    );

    remote_json(&socket, &["boot"]);
    vmm.wait_for_text(&serial, HELLO, LIMIT);
    let info = remote_json(&socket, &["info"]);
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 1, "{info}");
    refused(&socket, &["boot"], &["vm.boot", "405", "already booted"]);

    // Each boot opens the console file anew, so it is removed first.
    std::fs::remove_file(&serial).unwrap();
    remote_json(&socket, &["reboot"]);
    vmm.wait_for_text(&serial, HELLO, LIMIT);
    assert_eq!(state(&socket), "Running");

    // Deleting a running VM stops it and forgets it; the VMM waits for the next create.
    remote_json(&socket, &["delete"]);
    refused(&socket, &["info"], &["404", "no VM is created"]);
    remote_json(&socket, &["create", config.to_str().unwrap()]);
    assert_eq!(state(&socket), "Created");

    remote_json(&socket, &["shutdown-vmm"]);
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert!(!socket.exists(), "the API socket is left behind");
}
