//! The KVM work that depends on nothing in a VM's configuration (opening `/dev/kvm`,
//! creating an empty VM, probing the host's CPUID), started before the configuration is
//! known. A program that parses its arguments first gets this done beside the parsing.

use super::vm::{open_kvm, KvmVm, VmError};
use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use std::thread::JoinHandle;

/// KVM made ready on a thread of its own; [`crate::Vmm::build_on`] takes it.
pub struct HostPrep(Option<JoinHandle<Result<Ready, VmError>>>);

pub(crate) struct Ready {
    pub vm: KvmVm,
    pub cpuid: Result<CpuId, kvm_ioctls::Error>,
}

impl HostPrep {
    /// Starts the work. Nothing fails here: a host without KVM, or a thread that cannot
    /// start, is reported by the build that takes the result, as it would be without it.
    pub fn start() -> HostPrep {
        let work = || {
            let kvm = open_kvm()?;
            let vm = KvmVm::create(kvm.clone())?;
            let cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES);
            Ok(Ready { vm, cpuid })
        };
        HostPrep(
            std::thread::Builder::new()
                .name("kvm-prep".into())
                .spawn(work)
                .ok(),
        )
    }

    /// The prepared VM; `None` if the thread could not start or did not finish, for the
    /// build to do the work itself.
    pub(crate) fn take(mut self) -> Option<Result<Ready, VmError>> {
        self.0.take()?.join().ok()
    }
}
