//! KVM state of a VM, kept apart from devices: the VM fd, guest memory and vCPUs.

pub mod host;
pub mod memory;
pub mod spread;
pub mod vcpu;
pub mod vcpu_thread;
pub mod vm;
