//! A vCPU whose set-up fails ends the VM with the reason: the other vCPUs, the BSP waiting
//! for every vCPU before it enters the guest among them, are stopped, and nothing hangs. Its
//! own test binary, because the hook that makes a set-up fail is process-wide.

use vmm::config::{ExitsMode, KernelImage, SerialMode, VmConfig};
use vmm::seccomp::SeccompMode;
use vmm::testing::{make_vcpu_set_up_panic, pvh_elf, Code};
use vmm::{run_vm, Outcome, RunOptions};

#[test]
fn a_vcpu_whose_set_up_panics_ends_the_vm_naming_it() {
    make_vcpu_set_up_panic(1);
    let code = Code::default().exit(0).0;
    let config = VmConfig {
        kernel: KernelImage::Bytes {
            name: "exit".into(),
            data: pvh_elf(&code).into(),
        },
        cmdline: String::new(),
        initrd: None,
        cpus: 3,
        memory: 32 << 20,
        disks: vec![],
        pmem: vec![],
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    };
    let opts = RunOptions {
        capture_serial: false,
        timeout: Some(std::time::Duration::from_secs(60)),
        seccomp: SeccompMode::Enforce,
    };
    let r = run_vm(&config, &opts).expect("VM builds (needs /dev/kvm)");
    let Outcome::VmmError(m) = &r.outcome else {
        panic!("expected a VMM error, got {:?}", r.outcome)
    };
    assert!(m.contains("vCPU 1: its set-up panicked"), "{m}");
    assert!(m.contains("injected by a test"), "{m}");
}
