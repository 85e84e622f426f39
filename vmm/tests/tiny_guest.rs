//! Boots hand-assembled PVH guests, so the VMM's own path (loader, PVH entry, port exits,
//! exit status, crash reporting) is tested without depending on the probe guest.

use vmm::config::{ExitsMode, VmConfig};
use vmm::testing::{tiny_config, tiny_opts, Code};
use vmm::{run_vm, Outcome, RunOptions, Vm};

fn config(code: &[u8], cpus: u8) -> VmConfig {
    tiny_config(code, cpus)
}

fn opts() -> RunOptions {
    tiny_opts(true)
}

fn out8(port: u16, byte: u8) -> Vec<u8> {
    Code::default().out8(port, byte).0
}

#[test]
fn serial_output_and_exit_status_reach_the_host() {
    let mut code = Vec::new();
    for b in b"Hi\n" {
        code.extend(out8(0x3f8, *b));
    }
    code.extend(out8(0xf4, 42));
    code.push(0xf4); // hlt, never reached
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::GuestStatus(42));
    assert_eq!(r.outcome.exit_code(), 42);
    assert_eq!(r.serial, b"Hi\n");
    let outs = r.exits.iter().find(|e| e.reason == "io_out").unwrap();
    assert_eq!(outs.count, 4, "three serial bytes and one exit-port write");
}

#[test]
fn i8042_reset_is_a_clean_shutdown() {
    let mut code = out8(0x64, 0xfe);
    code.push(0xf4);
    let r = run_vm(&config(&code, 2), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::Shutdown);
    assert_eq!(r.outcome.exit_code(), 0);
}

#[test]
fn triple_fault_is_reported_as_a_guest_crash() {
    let code = Code::default().triple_fault().0;
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    match &r.outcome {
        Outcome::GuestCrash(m) => assert!(m.contains("triple fault"), "{m}"),
        o => panic!("expected a crash, got {o:?}"),
    }
    assert_eq!(r.outcome.exit_code(), 125);
}

#[test]
fn unclaimed_ports_read_all_ones_and_do_not_stop_the_vm() {
    // in al, 0x80 ... then out to 0x3f8 the value read, then exit 0.
    let mut code = vec![0x66, 0xba, 0x34, 0x12, 0xec]; // mov dx,0x1234; in al,dx
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xee]); // mov dx,0x3f8; out dx,al
    code.extend(out8(0xf4, 0));
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::GuestStatus(0));
    assert_eq!(r.serial, vec![0xff]);
}

#[test]
fn every_port_write_is_one_exit_at_that_port_in_both_modes() {
    const N: usize = 37;
    for mode in [ExitsMode::User, ExitsMode::Kernel] {
        let mut code = Vec::new();
        for _ in 0..N {
            code.extend(out8(0x80, 0x55));
        }
        code.extend(out8(0xf4, 0));
        let mut cfg = config(&code, 1);
        cfg.exits = mode;
        let r = run_vm(&cfg, &opts()).expect("VM runs (needs /dev/kvm)");
        assert_eq!(r.outcome, Outcome::GuestStatus(0));
        let port80 = r
            .metrics
            .exit("io_out", "0x80")
            .unwrap_or_else(|| panic!("no port 0x80 exits in {:#}", r.metrics));
        assert_eq!(port80.count, N as u64, "{mode}");
        assert_eq!(r.metrics.exits_mode, mode.to_string());
        let hist: u64 = port80.histogram_ns.iter().map(|b| b.1).sum();
        assert_eq!(hist, N as u64, "every exit lands in one histogram bucket");
    }
}

#[test]
fn a_guest_halted_with_interrupts_off_is_a_crash_not_a_hang() {
    // One vCPU; then two, where the AP waits for a start-up IPI that never comes.
    for cpus in [1, 2] {
        let code = Code::default().out8(0x3f8, b'.').halt_for_good().0;
        let r = run_vm(&config(&code, cpus), &opts()).expect("VM runs (needs /dev/kvm)");
        match &r.outcome {
            Outcome::GuestCrash(m) => {
                assert!(m.contains("halted with interrupts disabled"), "{m}")
            }
            o => panic!("{cpus} vCPUs: expected a guest crash, got {o:?}"),
        }
        assert_eq!(r.outcome.exit_code(), 125);
        assert_eq!(r.serial, b".");
    }
}

#[test]
fn an_idle_guest_is_left_running_until_stopped() {
    let code = Code::default().idle().0;
    let running = Vm::build(&config(&code, 2), &opts())
        .expect("VM builds (needs /dev/kvm)")
        .start()
        .expect("VM starts");
    let handle = running.handle();
    let stopper = std::thread::spawn(move || {
        // Long enough for the waiting VM to have asked its idle vCPUs what they do.
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let metrics = handle.metrics();
        handle.stop(Outcome::Signal(15));
        metrics
    });
    let r = running.wait();
    let metrics = stopper.join().unwrap();
    let kicks: u64 = metrics
        .exits
        .iter()
        .filter(|e| e.reason == "interrupted")
        .map(|e| e.count)
        .sum();
    assert!(kicks >= 2, "both idle vCPUs were asked: {metrics:#}");
    assert_eq!(
        r.outcome,
        Outcome::Signal(15),
        "an idle guest is not a crash"
    );
}

#[test]
fn stopping_a_spinning_guest_ends_every_vcpu() {
    let code = Code::default().out8(0x3f8, b'!').spin().0;
    let running = Vm::build(&config(&code, 2), &opts())
        .expect("VM builds (needs /dev/kvm)")
        .start()
        .expect("VM starts");
    // Wait until the guest has written its byte, so the vCPU is in its loop.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while running.metrics().total_exits == 0 {
        assert!(std::time::Instant::now() < deadline, "the guest never ran");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    running.stop(Outcome::VmmError("stopped by the test".into()));
    let r = running.wait();
    assert_eq!(r.outcome, Outcome::VmmError("stopped by the test".into()));
    assert_eq!(r.serial, b"!");
}
