//! KVM state of a VM, kept apart from devices: the VM fd, guest memory and vCPUs.

pub mod dirty;
pub mod memory;
pub mod pause;
pub mod vcpu;
pub mod vcpu_thread;
pub mod vm;
