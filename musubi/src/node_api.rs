//! What the control API does to a node of a VM over several hosts: the VM's state and
//! counters as this node sees them, where each vCPU runs, moving a vCPU to another node, and
//! ending the VM. Pause, resume, snapshots and migration are refused by name: each node
//! would do them to its own share alone.

use musubi_api::{ActionError, VmControl};

/// The node the API serves.
pub struct NodeApi {
    pub vm: vmm::VmHandle,
    pub mover: musubi_cluster::Mover,
    pub described: crate::api_target::Described,
}

fn refused(what: &str) -> ActionError {
    ActionError::internal(format!(
        "{what} is not done for a VM over several nodes: each node would act on its own \
         share alone"
    ))
}

impl VmControl for NodeApi {
    fn info(&self) -> Result<serde_json::Value, ActionError> {
        let mut info = crate::api_target::info_json(&self.vm, &self.described);
        info["vcpu_nodes"] = serde_json::json!(self.mover.vcpu_nodes());
        Ok(info)
    }

    fn counters(&self) -> Result<serde_json::Value, ActionError> {
        Ok(serde_json::to_value(self.vm.counters()).unwrap_or_default())
    }

    fn pause(&self) -> Result<(), ActionError> {
        Err(refused("pausing"))
    }

    fn resume(&self) -> Result<(), ActionError> {
        Err(refused("resuming"))
    }

    fn snapshot(&self, _dir: &std::path::Path) -> Result<(), ActionError> {
        Err(refused("a snapshot"))
    }

    /// The PM device a press reaches is this node's, and only the I/O node's is the
    /// guest's; refused by name rather than pressed on a copy the guest never reads.
    fn power_button(&self) -> Result<(), ActionError> {
        Err(refused("a power button press"))
    }

    fn send_migration(&self, _req: &musubi_api::SendMigration) -> Result<(), ActionError> {
        Err(refused("a migration"))
    }

    fn shutdown_vm(&self) -> Result<(), ActionError> {
        self.vm.stop(vmm::Outcome::Shutdown);
        Ok(())
    }

    fn move_vcpu(&self, vcpu: u8, node: u16) -> Result<(), ActionError> {
        self.mover
            .move_vcpu(vcpu, node)
            .map_err(|e| ActionError::internal(e.to_string()))
    }
}
