//! Moving vCPUs between the shares of a VM that runs over several processes: one share
//! releases a vCPU (its state read, the vCPU left standing by), another adopts it.

use super::{ControlError, VmHandle};
use crate::persist::{Persist, PersistError};

impl VmHandle {
    /// The local index of vCPU `id` (its APIC id), if this process created it.
    fn vcpu_index(&self, id: u8) -> Result<usize, ControlError> {
        self.shared
            .vcpu_ids
            .iter()
            .position(|&v| v == id)
            .ok_or(ControlError::NoSuchVcpu(id))
    }

    /// Takes vCPU `id` out of this process's run, for another share of the VM to run it: the
    /// VM is paused for the moment it takes to read the vCPU's state, then goes on without
    /// it, the vCPU standing by. A VM paused before stays paused.
    pub fn release_vcpu(&self, id: u8) -> Result<crate::persist::VcpuState, ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared;
        let index = self.vcpu_index(id)?;
        if sh.gate.is_standby(index) {
            return Err(ControlError::VcpuNotRunning(id));
        }
        // Asked of KVM before the pause, so its failure leaves the VM running.
        let msr_list = sh.parts.msr_list()?;
        let was_paused = sh.gate.is_paused();
        if !was_paused {
            self.pause_locked()?;
        }
        let saved = sh
            .gate
            .on_vcpu(index, &sh.control, move |v| v.save(&msr_list));
        let result = match saved {
            Ok(Ok(state)) => {
                sh.gate.set_standby(index, true);
                Ok(state)
            }
            Ok(Err(e)) => Err(PersistError::from(e).into()),
            Err(e) => Err(e.into()),
        };
        if !was_paused {
            self.resume_locked()?;
        }
        result
    }

    /// Runs vCPU `state.id`, standing by here, from `state` (as [`VmHandle::release_vcpu`]
    /// read it elsewhere): its registers, interrupt controller, MSRs and time stamp counter
    /// go on from there.
    pub fn adopt_vcpu(&self, state: crate::persist::VcpuState) -> Result<(), ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared;
        let id = state.id;
        let index = self.vcpu_index(id)?;
        if !sh.gate.is_standby(index) {
            return Err(ControlError::VcpuRunning(id));
        }
        sh.gate
            .on_vcpu(index, &sh.control, move |v| v.restore(&state))?
            .map_err(PersistError::from)?;
        sh.gate.set_standby(index, false);
        Ok(())
    }

    /// The vCPUs (global ids) running in this process, not standing by.
    pub fn running_vcpus(&self) -> Vec<u8> {
        let sh = &self.shared;
        sh.vcpu_ids
            .iter()
            .enumerate()
            .filter(|(i, _)| !sh.gate.is_standby(*i))
            .map(|(_, &id)| id)
            .collect()
    }
}
