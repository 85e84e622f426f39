//! A vCPU's architectural state as KVM holds it: read when the VM is saved, written back on
//! restore, on the thread that runs the vCPU.

use super::Persist;
pub use crate::vstate::vcpu::MSR_IA32_TSC;
use crate::vstate::vcpu::{Vcpu, VcpuError};
use kvm_bindings::{
    kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use serde::{Deserialize, Serialize};

/// Everything KVM keeps of one vCPU that the guest can observe. The order of the fields is
/// the order they are written back in (see `Vcpu::restore_state`).
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vCPU {} (rip {:#x}, {} MSRs)",
            self.id,
            self.regs.rip,
            self.msrs.len()
        )
    }
}

impl VcpuState {
    /// The TSC the vCPU had when it was saved, if its MSRs were read.
    pub fn tsc(&self) -> Option<u64> {
        self.msrs
            .iter()
            .find(|m| m.index == MSR_IA32_TSC)
            .map(|m| m.data)
    }
}

/// KVM reads and writes MSRs in batches and stops at the first one it refuses, returning
/// how many it did. A host may list an MSR it then will not read for this vCPU (one its
/// CPUID hides), so a refused MSR is skipped and the batch goes on after it.
fn each_batch(
    entries: &[kvm_msr_entry],
    mut op: impl FnMut(&mut Msrs) -> Result<usize, kvm_ioctls::Error>,
    mut done: impl FnMut(&[kvm_msr_entry]),
    mut refused: impl FnMut(u32),
) -> Result<(), kvm_ioctls::Error> {
    let mut at = 0;
    // Each turn either finishes or moves past one refused entry, so this ends.
    while at < entries.len() {
        let mut msrs = Msrs::from_entries(&entries[at..]).expect("the MSR list fits a batch");
        let n = op(&mut msrs)?;
        done(&msrs.as_slice()[..n]);
        at += n;
        if at < entries.len() {
            refused(entries[at].index);
            at += 1;
        }
    }
    Ok(())
}

impl Persist for Vcpu {
    type State = VcpuState;
    /// What KVM says a VMM should save of the MSRs, asked once per VM rather than per vCPU.
    type SaveArgs = [u32];
    type Error = VcpuError;

    /// Reads the vCPU's state; `msr_list` is what KVM says a VMM should save.
    fn save(&self, msr_list: &[u32]) -> Result<VcpuState, VcpuError> {
        let id = self.id;
        let err = |what| move |source| VcpuError::Ioctl { id, what, source };
        let fd = &self.fd;
        let wanted: Vec<kvm_msr_entry> = msr_list
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Vec::with_capacity(wanted.len());
        each_batch(
            &wanted,
            |m| fd.get_msrs(m),
            |got| msrs.extend_from_slice(got),
            |index| tracing::debug!(vcpu = id, index, "MSR listed but not readable; not saved"),
        )
        .map_err(err("KVM_GET_MSRS"))?;
        Ok(VcpuState {
            id,
            mp_state: fd.get_mp_state().map_err(err("KVM_GET_MP_STATE"))?,
            regs: fd.get_regs().map_err(err("KVM_GET_REGS"))?,
            sregs: fd.get_sregs().map_err(err("KVM_GET_SREGS"))?,
            xsave: fd.get_xsave().map_err(err("KVM_GET_XSAVE"))?,
            xcrs: fd.get_xcrs().map_err(err("KVM_GET_XCRS"))?,
            debugregs: fd.get_debug_regs().map_err(err("KVM_GET_DEBUGREGS"))?,
            lapic: fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?,
            msrs,
            events: fd.get_vcpu_events().map_err(err("KVM_GET_VCPU_EVENTS"))?,
        })
    }

    /// Writes a saved state back. The order follows KVM's dependencies: the MP state and
    /// registers first, the LAPIC before the MSRs (the TSC-deadline MSR is checked against
    /// it), the TSC before the TSC deadline (their order in KVM's own list), and pending
    /// events last so nothing written after them clears them.
    fn restore(&self, s: &VcpuState) -> Result<(), VcpuError> {
        let id = self.id;
        let err = |what| move |source| VcpuError::Ioctl { id, what, source };
        let fd = &self.fd;
        fd.set_mp_state(s.mp_state)
            .map_err(err("KVM_SET_MP_STATE"))?;
        fd.set_regs(&s.regs).map_err(err("KVM_SET_REGS"))?;
        fd.set_sregs(&s.sregs).map_err(err("KVM_SET_SREGS"))?;
        // SAFETY: a `kvm_xsave` is the legacy 4 KiB area KVM_SET_XSAVE reads, and the one
        // saved came from KVM_GET_XSAVE, which writes no more than that.
        unsafe { fd.set_xsave(&s.xsave) }.map_err(err("KVM_SET_XSAVE"))?;
        fd.set_xcrs(&s.xcrs).map_err(err("KVM_SET_XCRS"))?;
        fd.set_debug_regs(&s.debugregs)
            .map_err(err("KVM_SET_DEBUGREGS"))?;
        fd.set_lapic(&s.lapic).map_err(err("KVM_SET_LAPIC"))?;
        each_batch(
            &s.msrs,
            |m| fd.set_msrs(m),
            |_| {},
            |index| tracing::warn!(vcpu = id, index, "KVM refused a saved MSR; left as it was"),
        )
        .map_err(err("KVM_SET_MSRS"))?;
        fd.set_vcpu_events(&s.events)
            .map_err(err("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(indices: &[u32]) -> Vec<kvm_msr_entry> {
        indices
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn a_refused_msr_is_skipped_and_the_rest_still_done() {
        let all = entries(&[1, 2, 3, 4, 5]);
        let (mut done, mut refused) = (Vec::new(), Vec::new());
        // A KVM that refuses index 3: every batch stops just before it.
        each_batch(
            &all,
            |m| Ok(m.as_slice().iter().take_while(|e| e.index != 3).count()),
            |got| done.extend(got.iter().map(|e| e.index)),
            |i| refused.push(i),
        )
        .unwrap();
        assert_eq!(done, [1, 2, 4, 5]);
        assert_eq!(refused, [3]);
    }

    #[test]
    fn a_state_round_trips_through_json() {
        let s = VcpuState {
            id: 1,
            mp_state: Default::default(),
            regs: kvm_regs {
                rip: 0x1234,
                ..Default::default()
            },
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            debugregs: Default::default(),
            lapic: Default::default(),
            msrs: entries(&[MSR_IA32_TSC]),
            events: Default::default(),
        };
        let back: VcpuState = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back.regs.rip, 0x1234);
        assert_eq!(back.tsc(), Some(0));
        assert_eq!(format!("{back:?}"), "vCPU 1 (rip 0x1234, 1 MSRs)");
    }
}
