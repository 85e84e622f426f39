//! A vCPU thread that makes a system call outside its filter ends the VM with a message
//! naming the thread kind and the call. Its own test binary, because the hook that makes
//! vCPUs misbehave is process-wide.

use vmm::testing::{make_vcpus_call_a_refused_syscall, tiny_config, tiny_opts, Code};
use vmm::{run_vm, Outcome};

#[test]
fn a_refused_call_on_a_vcpu_thread_ends_the_vm_naming_thread_and_call() {
    make_vcpus_call_a_refused_syscall();
    let code = Code::default().spin().0;
    let config = tiny_config(&code, 1);
    let opts = tiny_opts(false);
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
