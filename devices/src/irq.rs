//! Interrupt lines as devices see them: one edge per `trigger`.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// An edge-triggered interrupt line into the guest.
///
/// The kernel path backs it with an irqfd (the write never leaves the host kernel); other
/// back-ends inject from user space. Devices must not care which one they hold.
pub trait Irq: Send + Sync {
    fn trigger(&self) -> io::Result<()>;
}

/// An interrupt line backed by an eventfd, normally registered with KVM as an irqfd.
pub struct EventFdIrq {
    fd: EventFd,
    count: AtomicU64,
}

impl EventFdIrq {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            fd: EventFd::new(libc::EFD_NONBLOCK)?,
            count: AtomicU64::new(0),
        })
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.fd
    }

    /// Interrupts raised so far, for exit and interrupt accounting.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Irq for EventFdIrq {
    fn trigger(&self) -> io::Result<()> {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.fd.write(1)
    }
}

impl<T: Irq + ?Sized> Irq for Arc<T> {
    fn trigger(&self) -> io::Result<()> {
        (**self).trigger()
    }
}

/// Adapts an [`Irq`] to vm-superio's `Trigger`.
#[derive(Clone)]
pub struct SuperioTrigger(pub Arc<dyn Irq>);

impl vm_superio::Trigger for SuperioTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.trigger()
    }
}

#[cfg(any(test, feature = "fuzzing"))]
#[cfg_attr(not(test), allow(dead_code))] // the fuzzing entry points only count nothing
pub(crate) mod test_util {
    use super::*;

    /// Counts triggers, for device tests and the fuzzing entry points.
    #[derive(Default)]
    pub struct CountingIrq(pub AtomicU64);

    impl CountingIrq {
        pub fn count(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    impl Irq for CountingIrq {
        fn trigger(&self) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventfd_irq_counts_and_signals() {
        let irq = EventFdIrq::new().unwrap();
        irq.trigger().unwrap();
        irq.trigger().unwrap();
        assert_eq!(irq.count(), 2);
        assert_eq!(irq.eventfd().read().unwrap(), 2);
    }
}
