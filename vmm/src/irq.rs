//! The two ways an interrupt reaches the guest: an irqfd that KVM serves in the kernel, or
//! a KVM_IRQ_LINE ioctl issued from user space, as a VMM without irqfd would.

use devices::{EventFdIrq, Irq};
use kvm_ioctls::VmFd;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// An interrupt line whose raises are counted, whatever delivers them.
pub trait IrqLine: Irq {
    fn count(&self) -> u64;
    /// `"irqfd"` or `"user"`.
    fn path(&self) -> &'static str;
}

impl IrqLine for EventFdIrq {
    fn count(&self) -> u64 {
        EventFdIrq::count(self)
    }
    fn path(&self) -> &'static str {
        "irqfd"
    }
}

/// Raises an edge on an IOAPIC pin from user space.
pub struct UserIrq {
    vm: Arc<VmFd>,
    gsi: u32,
    count: AtomicU64,
}

impl UserIrq {
    pub fn new(vm: Arc<VmFd>, gsi: u32) -> Self {
        Self {
            vm,
            gsi,
            count: AtomicU64::new(0),
        }
    }
}

impl Irq for UserIrq {
    fn trigger(&self) -> io::Result<()> {
        self.count.fetch_add(1, Ordering::Relaxed);
        let e = |e: kvm_ioctls::Error| io::Error::from_raw_os_error(e.errno());
        self.vm.set_irq_line(self.gsi, true).map_err(e)?;
        self.vm.set_irq_line(self.gsi, false).map_err(e)
    }
}

impl IrqLine for UserIrq {
    fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
    fn path(&self) -> &'static str {
        "user"
    }
}
