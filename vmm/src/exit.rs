//! Turns one KVM exit into bus accesses and, when the VM must end, the reason why.
//!
//! Kept apart from the vCPU thread so the same dispatch serves a local VM and a node that
//! forwards its device accesses elsewhere, and so it is testable without KVM.

use crate::control::Outcome;
use crate::metrics::{ExitReason, MmioTarget};
use kvm_ioctls::VcpuExit;

/// Where port and MMIO accesses that leave KVM_RUN go. A local VM serves them from its own
/// devices; a node of a multi-host VM forwards them to the node that holds the devices.
pub trait DeviceBus: Send + Sync {
    /// Fills `data` from the device at `port`; unclaimed ports read as all ones. `vcpu` is
    /// the global id of the vCPU that exited: a node forwarding the access names it, and
    /// paravirtual ports (IPIs) need the sender.
    fn pio_read(&self, vcpu: u8, port: u16, data: &mut [u8]);
    /// Writes nobody claims are dropped, as on a PC bus.
    fn pio_write(&self, vcpu: u8, port: u16, data: &[u8]);
    /// Fills `data` from the device at `addr`; unclaimed addresses read as all ones.
    fn mmio_read(&self, vcpu: u8, addr: u64, data: &mut [u8]);
    fn mmio_write(&self, vcpu: u8, addr: u64, data: &[u8]);
    /// Which device register `addr` is, for the exit accounting.
    fn mmio_target(&self, addr: u64) -> MmioTarget;
}

/// Why the guest itself cannot go on; the vCPU adds where it stopped (RIP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    TripleFault,
    InternalError,
}

/// What the vCPU does after an exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitAction {
    /// Re-enter the guest.
    Continue,
    /// KVM_RUN was cut short by a signal (a kick): look at the VM's requests, then go on.
    Kicked,
    /// The VM ends with this outcome.
    End(Outcome),
    /// The guest crashed; the outcome needs the vCPU's registers.
    Crash(Crash),
}

/// Dispatches one exit of vCPU `id` and says what it was, for the accounting.
pub fn handle_exit(
    exit: Result<VcpuExit<'_>, kvm_ioctls::Error>,
    bus: &dyn DeviceBus,
    id: u8,
) -> (ExitReason, ExitAction) {
    let exit = match exit {
        Ok(exit) => exit,
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
            return (ExitReason::Interrupted, ExitAction::Kicked)
        }
        Err(e) => {
            return (
                ExitReason::Other,
                ExitAction::End(Outcome::VmmError(format!("vCPU {id}: KVM_RUN failed: {e}"))),
            )
        }
    };
    match exit {
        VcpuExit::IoOut(port, data) => {
            bus.pio_write(id, port, data);
            (ExitReason::IoOut(port), ExitAction::Continue)
        }
        VcpuExit::IoIn(port, data) => {
            bus.pio_read(id, port, data);
            (ExitReason::IoIn(port), ExitAction::Continue)
        }
        VcpuExit::MmioWrite(addr, data) => {
            bus.mmio_write(id, addr, data);
            (
                ExitReason::MmioWrite(bus.mmio_target(addr)),
                ExitAction::Continue,
            )
        }
        VcpuExit::MmioRead(addr, data) => {
            bus.mmio_read(id, addr, data);
            (
                ExitReason::MmioRead(bus.mmio_target(addr)),
                ExitAction::Continue,
            )
        }
        VcpuExit::Shutdown => (ExitReason::Shutdown, ExitAction::Crash(Crash::TripleFault)),
        VcpuExit::SystemEvent(kind, _) => {
            // Shutdown (1), reset (2) or crash (3) requested through KVM.
            let outcome = if kind == kvm_bindings::KVM_SYSTEM_EVENT_CRASH {
                Outcome::GuestCrash(format!("vCPU {id}: guest reported a crash"))
            } else {
                Outcome::Shutdown
            };
            (ExitReason::SystemEvent, ExitAction::End(outcome))
        }
        VcpuExit::Intr => (ExitReason::Interrupted, ExitAction::Kicked),
        VcpuExit::FailEntry(reason, cpu) => (
            ExitReason::FailEntry,
            ExitAction::End(Outcome::VmmError(format!(
                "vCPU {id}: KVM could not enter the guest (hardware reason {reason:#x}, host CPU {cpu})"
            ))),
        ),
        VcpuExit::InternalError => (
            ExitReason::InternalError,
            ExitAction::Crash(Crash::InternalError),
        ),
        // HLT never reaches user space: the in-kernel LAPIC keeps a halted vCPU inside
        // KVM_RUN. A guest that halts for good is found by the VM's idle check instead.
        other => (
            ExitReason::Other,
            ExitAction::End(Outcome::VmmError(format!(
                "vCPU {id}: unexpected exit {other:?}"
            ))),
        ),
    }
}

/// The crash message for `crash` of vCPU `id` stopped at `rip`.
pub fn crash_outcome(crash: Crash, id: u8, rip: u64) -> Outcome {
    Outcome::GuestCrash(match crash {
        Crash::TripleFault => format!(
            "vCPU {id}: triple fault (the guest hit an exception it could not handle), last RIP {rip:#x}"
        ),
        Crash::InternalError => format!(
            "vCPU {id}: KVM internal error at RIP {rip:#x} (often an instruction KVM cannot emulate)"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records every access and answers reads with a fixed byte.
    #[derive(Default)]
    struct RecordingBus {
        log: Mutex<Vec<String>>,
    }

    impl DeviceBus for RecordingBus {
        fn pio_read(&self, _: u8, port: u16, data: &mut [u8]) {
            self.log.lock().unwrap().push(format!("in {port:#x}"));
            data.fill(0x5a);
        }
        fn pio_write(&self, _: u8, port: u16, data: &[u8]) {
            self.log
                .lock()
                .unwrap()
                .push(format!("out {port:#x} {data:?}"));
        }
        fn mmio_read(&self, _: u8, addr: u64, data: &mut [u8]) {
            self.log.lock().unwrap().push(format!("read {addr:#x}"));
            data.fill(0xa5);
        }
        fn mmio_write(&self, _: u8, addr: u64, data: &[u8]) {
            self.log
                .lock()
                .unwrap()
                .push(format!("write {addr:#x} {data:?}"));
        }
        fn mmio_target(&self, addr: u64) -> MmioTarget {
            MmioTarget((addr & 0xffff) as u16)
        }
    }

    #[test]
    fn port_and_mmio_exits_reach_the_bus() {
        let bus = RecordingBus::default();
        let (r, a) = handle_exit(Ok(VcpuExit::IoOut(0x3f8, b"A")), &bus, 0);
        assert_eq!((r, a), (ExitReason::IoOut(0x3f8), ExitAction::Continue));
        let mut byte = [0u8; 1];
        let (r, _) = handle_exit(Ok(VcpuExit::IoIn(0x3fd, &mut byte)), &bus, 0);
        assert_eq!(r, ExitReason::IoIn(0x3fd));
        assert_eq!(byte, [0x5a]);
        let mut word = [0u8; 4];
        let (r, _) = handle_exit(Ok(VcpuExit::MmioRead(0xd000_0008, &mut word)), &bus, 1);
        assert_eq!(r, ExitReason::MmioRead(MmioTarget(8)));
        assert_eq!(word, [0xa5; 4]);
        let (r, a) = handle_exit(Ok(VcpuExit::MmioWrite(0xd000_0050, &[1, 0, 0, 0])), &bus, 1);
        assert_eq!(r, ExitReason::MmioWrite(MmioTarget(0x50)));
        assert_eq!(a, ExitAction::Continue);
        assert_eq!(
            *bus.log.lock().unwrap(),
            [
                "out 0x3f8 [65]",
                "in 0x3fd",
                "read 0xd0000008",
                "write 0xd0000050 [1, 0, 0, 0]"
            ]
        );
    }

    #[test]
    fn ending_exits_carry_their_outcome() {
        let bus = RecordingBus::default();
        let (_, a) = handle_exit(Ok(VcpuExit::Shutdown), &bus, 2);
        assert_eq!(a, ExitAction::Crash(Crash::TripleFault));
        let (_, a) = handle_exit(
            Ok(VcpuExit::SystemEvent(
                kvm_bindings::KVM_SYSTEM_EVENT_RESET,
                &[],
            )),
            &bus,
            0,
        );
        assert_eq!(a, ExitAction::End(Outcome::Shutdown));
        let (_, a) = handle_exit(
            Ok(VcpuExit::SystemEvent(
                kvm_bindings::KVM_SYSTEM_EVENT_CRASH,
                &[],
            )),
            &bus,
            0,
        );
        assert!(matches!(a, ExitAction::End(Outcome::GuestCrash(_))));
        let (_, a) = handle_exit(Ok(VcpuExit::FailEntry(7, 1)), &bus, 3);
        let ExitAction::End(Outcome::VmmError(m)) = a else {
            panic!("{a:?}")
        };
        assert!(m.contains("vCPU 3") && m.contains("0x7"), "{m}");
        let (_, a) = handle_exit(Ok(VcpuExit::Hlt), &bus, 0);
        assert!(matches!(a, ExitAction::End(Outcome::VmmError(_))), "{a:?}");
        assert!(bus.log.lock().unwrap().is_empty());
        let m = crash_outcome(Crash::InternalError, 1, 0x1234);
        assert!(format!("{m:?}").contains("0x1234"));
    }

    #[test]
    fn kicks_and_failures_of_kvm_run() {
        let bus = RecordingBus::default();
        let eintr = kvm_ioctls::Error::new(libc::EINTR);
        assert_eq!(
            handle_exit(Err(eintr), &bus, 0),
            (ExitReason::Interrupted, ExitAction::Kicked)
        );
        let (r, a) = handle_exit(Err(kvm_ioctls::Error::new(libc::EFAULT)), &bus, 4);
        assert_eq!(r, ExitReason::Other);
        let ExitAction::End(Outcome::VmmError(m)) = a else {
            panic!("{a:?}")
        };
        assert!(m.contains("vCPU 4: KVM_RUN failed"), "{m}");
    }
}
