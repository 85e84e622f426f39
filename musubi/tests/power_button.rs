//! The ACPI power button (`vm.power-button`, `musubi remote power-button`): a probe guest
//! waiting for it shuts down cleanly on both exit paths, through the exit port or ACPI S5;
//! a guest that ignores it runs on; the press survives a snapshot and restore; and a
//! waiting VMM answers it as it answers vm.reboot in each state.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Every musubi process here ends in seconds; a hung one fails the test after this.
const LIMIT: Duration = Duration::from_secs(120);
/// What the probe prints once the button is enabled and it waits for a press.
const WAITING: &str = "probe: wait-power: waiting for the power button";
const IGNORED: &str = "probe: power button pressed: ignored (probe.power=ignore)";
const DONE: &str = "probe: done, exit status 0";

/// The probe's `probe.tasks=` list with more kernel parameters after it: `probe_args` puts
/// the list into `--cmdline probe.tasks=LIST`, and the command line is split on spaces.
fn tasks_and(tasks: &str, params: &str) -> String {
    format!("{tasks} {params}")
}

fn outcome(report: &Path) -> Value {
    let text = read_text(report);
    let r: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    r["outcome"].clone()
}

/// Starts the probe with `tasks` and `flags`, waits until it waits for the button, presses
/// it with `musubi remote power-button` and returns the run, its console and its report's
/// outcome.
fn press_and_finish(tasks: &str, flags: &[&str]) -> (Run, String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let (socket, serial) = (dir.path().join("api.sock"), dir.path().join("console.out"));
    let report = dir.path().join("report.json");
    let mut all = vec!["--report", report.to_str().unwrap()];
    all.extend_from_slice(flags);
    let mut vm = start_probe_with_api(tasks, &socket, &serial, &all);
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, WAITING, LIMIT);
    let press = remote(&socket, &["power-button"]);
    assert_eq!(press.code, Some(0), "power-button: {}", press.explain());
    assert_eq!(
        press.stdout.trim(),
        "",
        "204 has no body: {}",
        press.explain()
    );
    guard.defuse();
    let run = vm.finish(LIMIT);
    let text = read_text(&serial);
    let outcome = outcome(&report);
    (run, text, outcome)
}

/// The guest took the press, said so and ran no task after `wait-power`.
fn assert_shut_down_by_the_button(run: &Run, text: &str, action: &str) {
    assert_eq!(run.code, Some(0), "{}\nconsole:\n{text}", run.explain());
    let w = result_in(text, "wait-power");
    assert_eq!(w["ok"], true, "{text}");
    assert_eq!(w["presses"], 1, "{text}");
    assert_eq!(w["sci_interrupts"], 1, "{text}");
    let b = result_in(text, "power-button");
    assert_eq!(b["event"], "power-button", "{text}");
    assert_eq!(b["action"], action, "{text}");
    assert!(text.contains(DONE), "{text}");
    let hellos = results_in(text)
        .iter()
        .filter(|v| v["probe"] == "hello")
        .count();
    assert_eq!(hellos, 1, "the hello after wait-power ran:\n{text}");
}

#[test]
fn a_guest_waiting_for_the_button_ends_cleanly_on_the_kernel_exit_path() {
    let (run, text, outcome) =
        press_and_finish("hello,wait-power=100,hello", &["--exits", "kernel"]);
    assert_shut_down_by_the_button(&run, &text, "exit");
    assert_eq!(outcome["kind"], "guest_exit", "{outcome}");
    assert_eq!(outcome["status"], 0, "{outcome}");
}

#[test]
fn a_guest_waiting_for_the_button_ends_cleanly_on_the_user_exit_path() {
    let (run, text, outcome) = press_and_finish("hello,wait-power=100,hello", &["--exits", "user"]);
    assert_shut_down_by_the_button(&run, &text, "exit");
    assert_eq!(outcome["kind"], "guest_exit", "{outcome}");
    assert_eq!(outcome["status"], 0, "{outcome}");
}

/// `probe.power=s5` powers off as Linux does: SLP_TYP from the DSDT's `\_S5_` and SLP_EN
/// written to PM1a_CNT, which ends the VM as a shutdown.
#[test]
fn a_guest_powering_off_through_acpi_s5_ends_as_a_shutdown_on_both_exit_paths() {
    for exits in ["kernel", "user"] {
        let tasks = tasks_and("hello,wait-power=100,hello", "probe.power=s5");
        let (run, text, outcome) = press_and_finish(&tasks, &["--exits", exits]);
        assert_shut_down_by_the_button(&run, &text, "s5");
        assert_eq!(outcome["kind"], "shutdown", "--exits {exits}: {outcome}");
    }
}

#[test]
fn a_guest_that_ignores_the_button_runs_on_until_the_api_shuts_it_down() {
    for exits in ["kernel", "user"] {
        let dir = tempfile::tempdir().unwrap();
        let (socket, serial) = (dir.path().join("api.sock"), dir.path().join("console.out"));
        let tasks = tasks_and("hello,wait-power=100", "probe.power=ignore");
        let mut vm = start_probe_with_api(&tasks, &socket, &serial, &["--exits", exits]);
        let guard = KillOnPanic::new(&vm);
        vm.wait_for_text(&serial, WAITING, LIMIT);
        remote_json(&socket, &["power-button"]);
        // The guest took the interrupt and chose to go on.
        vm.wait_for_text(&serial, IGNORED, LIMIT);
        let info = remote_json(&socket, &["info"]);
        assert_eq!(info["state"], "Running", "--exits {exits}: {info}");
        // A second press is taken as the first was.
        remote_json(&socket, &["power-button"]);
        let info = remote_json(&socket, &["info"]);
        assert_eq!(info["state"], "Running", "--exits {exits}: {info}");
        let text = read_text(&serial);
        assert!(
            !results_in(&text).iter().any(|v| v["probe"] == "wait-power"),
            "--exits {exits}: wait-power ended though the guest ignores the button:\n{text}"
        );
        remote_json(&socket, &["shutdown"]);
        guard.defuse();
        let run = vm.finish(LIMIT);
        let text = read_text(&serial);
        assert_eq!(run.code, Some(0), "--exits {exits}: {}", run.explain());
        assert!(!text.contains(DONE), "--exits {exits}: {text}");
    }
}

/// PWRBTN_EN, which the guest set at boot, is part of the snapshot: the restored VM's
/// guest hears the button without enabling it again.
#[test]
fn the_button_reaches_a_guest_restored_from_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (socket, serial) = (dir.path().join("api.sock"), dir.path().join("original.out"));
    let snap = dir.path().join("snap");
    let mut vm = start_probe_with_api("hello,wait-power=100,hello", &socket, &serial, &[]);
    let guard = KillOnPanic::new(&vm);
    vm.wait_for_text(&serial, WAITING, LIMIT);
    remote_json(&socket, &["snapshot", snap.to_str().unwrap()]);
    remote_json(&socket, &["shutdown"]);
    guard.defuse();
    vm.finish(LIMIT);
    let state = std::fs::read(snap.join("state")).unwrap();
    let body = String::from_utf8_lossy(&state);
    assert!(
        body.contains(r#""pm":{"status":0,"enable":256,"control":1}"#),
        "the saved PM registers: {body}"
    );

    let (socket, serial) = (
        dir.path().join("restored.sock"),
        dir.path().join("restored.out"),
    );
    let args = [
        "run",
        "--restore",
        snap.to_str().unwrap(),
        "--timeout",
        "200",
        "--serial",
        &format!("file={}", serial.display()),
        "--api-socket",
        socket.to_str().unwrap(),
    ];
    let mut restored = start_command(musubi(), &args, None);
    let guard = KillOnPanic::new(&restored);
    restored.wait_for_file(&socket, LIMIT);
    remote_json(&socket, &["power-button"]);
    guard.defuse();
    let run = restored.finish(LIMIT);
    let text = read_text(&serial);
    assert_eq!(run.code, Some(0), "{}\nconsole:\n{text}", run.explain());
    assert_eq!(result_in(&text, "wait-power")["ok"], true, "{text}");
    assert_eq!(result_in(&text, "power-button")["action"], "exit", "{text}");
    assert!(text.contains(DONE), "{text}");
}

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

#[test]
fn a_waiting_vmm_answers_the_button_in_each_state_as_it_answers_a_reboot() {
    let d = VmmDir::new();
    let (socket, serial) = (d.socket.clone(), d.serial.clone());
    let config = d.ch_vm_config("vm.json", "hello,wait-power=100,hello", LIMIT);
    let mut vmm = d.start_vmm(LIMIT);
    let guard = KillOnPanic::new(&vmm);

    refused(
        &socket,
        &["power-button"],
        &["vm.power-button", "404", "no VM is created"],
    );
    remote_json(&socket, &["create", config.to_str().unwrap()]);
    refused(
        &socket,
        &["power-button"],
        &["vm.power-button", "405", "the VM is Created, not booted"],
    );

    remote_json(&socket, &["boot"]);
    vmm.wait_for_text(&serial, WAITING, LIMIT);
    remote_json(&socket, &["power-button"]);
    vmm.wait_for_text(&serial, DONE, LIMIT);
    // The VM ended on its own; the VMM stays, the VM Shutdown with the guest's status.
    assert!(
        wait_until(LIMIT, || remote_json(&socket, &["info"])["state"]
            == "Shutdown"),
        "the VM did not reach Shutdown after the button"
    );
    let info = remote_json(&socket, &["info"]);
    let ended = &info["musubi"]["ended"];
    assert_eq!(ended["kind"], "guest_exit", "{info}");
    assert_eq!(ended["status"], 0, "{info}");
    let text = read_text(&serial);
    assert_eq!(result_in(&text, "power-button")["action"], "exit", "{text}");
    refused(
        &socket,
        &["power-button"],
        &["vm.power-button", "405", "the VM is Shutdown, not booted"],
    );

    remote_json(&socket, &["shutdown-vmm"]);
    guard.defuse();
    let run = vmm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
}

#[test]
fn with_no_press_wait_power_reports_its_timeout_with_status_8() {
    let r = run_probe("wait-power=1,hello", &[]);
    let text = &r.stdout;
    assert_eq!(r.code, Some(9), "{}", r.explain());
    let w = result_in(text, "wait-power");
    assert_eq!(w["ok"], false, "{text}");
    assert_eq!(w["presses"], 0, "{text}");
    assert!(
        w["error"]
            .as_str()
            .is_some_and(|e| e.contains("no power-button press acted on within 1 s")),
        "{text}"
    );
    // No press: the tasks after it run.
    assert_eq!(result_in(text, "hello")["cpus"], 1, "{text}");
}
