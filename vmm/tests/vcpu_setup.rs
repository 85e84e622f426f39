//! A vCPU whose set-up fails ends the VM with the reason: the other vCPUs, the BSP waiting
//! for every vCPU before it enters the guest among them, are stopped, and nothing hangs. Its
//! own test binary, because the hook that makes a set-up fail is process-wide.

use vmm::testing::{make_vcpu_set_up_panic, tiny_config, tiny_opts, Code};
use vmm::{run_vm, Outcome};

#[test]
fn a_vcpu_whose_set_up_panics_ends_the_vm_naming_it() {
    // The panic message without a backtrace, whatever RUST_BACKTRACE says: printing one
    // calls getcwd and opens the executable on the panicking vCPU thread, which its filter
    // refuses, and that refusal could end the VM before the set-up failure does.
    std::panic::set_hook(Box::new(|info| eprintln!("{info}")));
    make_vcpu_set_up_panic(1);
    let code = Code::default().exit(0).0;
    let config = tiny_config(&code, 3);
    let opts = tiny_opts(false);
    let r = run_vm(&config, &opts).expect("VM builds (needs /dev/kvm)");
    let Outcome::VmmError(m) = &r.outcome else {
        panic!("expected a VMM error, got {:?}", r.outcome)
    };
    assert!(m.contains("vCPU 1: its set-up panicked"), "{m}");
    assert!(m.contains("injected by a test"), "{m}");
}
