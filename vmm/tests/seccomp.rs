//! A vCPU thread that makes a system call outside its filter ends the VM with a message
//! naming the thread kind and the call. Its own test binary, because the hook that makes
//! vCPUs misbehave is process-wide.

use vmm::config::{ExitsMode, KernelImage, SerialMode, VmConfig};
use vmm::seccomp::SeccompMode;
use vmm::testing::{make_vcpus_call_a_refused_syscall, pvh_elf, Code};
use vmm::{run_vm, Outcome, RunOptions};

#[test]
fn a_refused_call_on_a_vcpu_thread_ends_the_vm_naming_thread_and_call() {
    make_vcpus_call_a_refused_syscall();
    let code = Code::default().spin().0;
    let config = VmConfig {
        kernel: KernelImage::Bytes {
            name: "spin".into(),
            data: pvh_elf(&code).into(),
        },
        cmdline: String::new(),
        initrd: None,
        cpus: 1,
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
    let r = run_vm(&config, &opts).expect("VM runs (needs /dev/kvm)");
    let Outcome::VmmError(m) = &r.outcome else {
        panic!("expected a VMM error, got {:?}", r.outcome)
    };
    assert!(m.contains("seccomp: the vCPU thread"), "{m}");
    assert!(
        m.contains(&format!("system call {}", libc::SYS_socket)),
        "{m}"
    );
}
