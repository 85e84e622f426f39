//! What KVM itself keeps of a VM outside its vCPUs: the in-kernel interrupt controllers and
//! PIT, and the KVM clock.

use super::Persist;
use crate::vstate::vm::VmError;
use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;

/// The in-kernel devices' state and the KVM clock, as a saved VM keeps them.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct KvmVmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// The PICs, the IOAPIC and the PIT of the VM behind the fd. The clock is saved with them
/// (the one read when the VM paused, not a fresh one) but set back apart, by [`Clock`], when
/// the VM starts or resumes: set earlier, it would run while nothing else does.
pub struct InKernel<'a>(pub &'a VmFd);

impl Persist for InKernel<'_> {
    type State = KvmVmState;
    /// The KVM clock read when the VM paused.
    type SaveArgs = kvm_clock_data;
    type Error = VmError;

    fn save(&self, clock: &kvm_clock_data) -> Result<KvmVmState, VmError> {
        let err = |what| move |source| VmError::Ioctl { what, source };
        let chip = |id| {
            let mut c = kvm_irqchip {
                chip_id: id,
                ..Default::default()
            };
            self.0
                .get_irqchip(&mut c)
                .map(|_| c)
                .map_err(err("KVM_GET_IRQCHIP"))
        };
        Ok(KvmVmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
            pit: self.0.get_pit2().map_err(err("KVM_GET_PIT2"))?,
            clock: *clock,
        })
    }

    fn restore(&self, s: &KvmVmState) -> Result<(), VmError> {
        let err = |what| move |source| VmError::Ioctl { what, source };
        for chip in [&s.pic_master, &s.pic_slave, &s.ioapic] {
            self.0.set_irqchip(chip).map_err(err("KVM_SET_IRQCHIP"))?;
        }
        self.0.set_pit2(&s.pit).map_err(err("KVM_SET_PIT2"))?;
        Ok(())
    }
}

/// The KVM clock of the VM behind the fd: read when the VM pauses, set back when it goes
/// on, so the guest sees no time pass while it was stopped.
pub struct Clock<'a>(pub &'a VmFd);

impl Persist for Clock<'_> {
    type State = kvm_clock_data;
    type SaveArgs = ();
    type Error = VmError;

    fn save(&self, _: &()) -> Result<kvm_clock_data, VmError> {
        self.0.get_clock().map_err(|source| VmError::Ioctl {
            what: "KVM_GET_CLOCK",
            source,
        })
    }

    /// Only the clock itself is set: KVM_CLOCK_REALTIME would have KVM add the time that
    /// passed.
    fn restore(&self, saved: &kvm_clock_data) -> Result<(), VmError> {
        let clock = kvm_clock_data {
            clock: saved.clock,
            ..Default::default()
        };
        self.0.set_clock(&clock).map_err(|source| VmError::Ioctl {
            what: "KVM_SET_CLOCK",
            source,
        })
    }
}
