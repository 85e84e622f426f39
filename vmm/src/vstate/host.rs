//! The KVM work that depends on nothing in a VM's configuration (opening `/dev/kvm`,
//! creating an empty VM, probing the host's CPUID), started before the configuration is
//! known. A program that parses its arguments first gets this done beside the parsing.

use super::vcpu_thread::SharedCpuid;
use super::vm::{open_kvm, KvmVm, VmError};
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use std::os::unix::thread::JoinHandleExt;
use std::sync::mpsc::{channel, Receiver};

/// KVM made ready on a thread of its own; [`crate::Vmm::build_on`] takes it.
pub struct HostPrep {
    vm: Option<Receiver<Result<KvmVm, VmError>>>,
    /// Filled by the same thread once the VM is handed over: the vCPU threads that need it
    /// wait for it there, while the build goes on with the VM.
    cpuid: SharedCpuid,
}

impl HostPrep {
    /// Starts the work. Nothing fails here: a host without KVM, or a thread that cannot
    /// start, is reported by the build that takes the result, as it would be without it.
    pub fn start() -> HostPrep {
        let (tx, rx) = channel();
        let cpuid = SharedCpuid::default();
        let cell = cpuid.clone();
        let work = move || {
            let kvm = match open_kvm() {
                Ok(k) => k,
                Err(e) => return drop(tx.send(Err(e))),
            };
            let _ = tx.send(KvmVm::create(kvm.clone()));
            cell.get_or_init(|| kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES));
        };
        let started = std::thread::Builder::new()
            .name("kvm-prep".into())
            .spawn(work)
            .inspect(|t| {
                // The thread ends with its work, so its narrowed mask is never given back.
                let _ = super::spread::away_from_caller(t.as_pthread_t() as libc::pthread_t);
            })
            .is_ok();
        HostPrep {
            vm: started.then_some(rx),
            cpuid,
        }
    }

    /// The prepared VM and the cell its thread fills with the host's CPUID; `None` if the
    /// thread could not start or ended early, for the build to do the work itself.
    pub(crate) fn take(self) -> Option<(Result<KvmVm, VmError>, SharedCpuid)> {
        let vm = self.vm?.recv().ok()?;
        Some((vm, self.cpuid))
    }
}
