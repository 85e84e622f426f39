//! The CPUID each vCPU sees: KVM's supported set, made per-CPU and trimmed of what the
//! guest must not rely on.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

/// Leaf 1 ECX bit 31: "running under a hypervisor".
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Intel VMX and AMD SVM: hidden, so no guest runs a hypervisor of its own, whose nested
/// state a snapshot, a migration or a vCPU's move to another node would have to carry.
const LEAF1_ECX_VMX: u32 = 1 << 5;
const LEAF_8000_0001_ECX_SVM: u32 = 1 << 2;
/// Leaf 1 ECX bit 24: TSC deadline timer. KVM emulates it only with an in-kernel LAPIC,
/// which Musubi always has, so it is kept.
/// Leaf 1 EBX bits 31..24: initial APIC id; bits 23..16: logical processors per package.
const LEAF1_EBX_APIC_ID_SHIFT: u32 = 24;
const LEAF1_EBX_LOGICAL_SHIFT: u32 = 16;
/// Leaf 1 EDX bit 28: HTT, meaning EBX[23:16] is valid.
const LEAF1_EDX_HTT: u32 = 1 << 28;

/// Adjusts `cpuid` (from `KVM_GET_SUPPORTED_CPUID`) for vCPU `id` of `count`.
pub fn filter_cpuid(cpuid: &mut CpuId, id: u8, count: u8) {
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            1 => {
                e.ecx = (e.ecx | LEAF1_ECX_HYPERVISOR) & !LEAF1_ECX_VMX;
                e.ebx = (e.ebx & 0x0000_ffff)
                    | ((id as u32) << LEAF1_EBX_APIC_ID_SHIFT)
                    | ((count as u32) << LEAF1_EBX_LOGICAL_SHIFT);
                if count > 1 {
                    e.edx |= LEAF1_EDX_HTT;
                }
            }
            // Extended topology: every leaf reports the x2APIC id in EDX.
            0xb | 0x1f => e.edx = id as u32,
            // Deterministic cache parameters: one core per package sharing nothing, so a
            // guest's topology code does not invent siblings that do not exist.
            4 => e.eax &= 0x3fff,
            0x8000_0001 => e.ecx &= !LEAF_8000_0001_ECX_SVM,
            _ => {}
        }
    }
}

/// Where a vCPU of a VM spread over several nodes learns that it is one, in the hypervisor
/// range but clear of KVM's own leaves at 0x4000_0000, which the guest may still use.
pub const NODE_LEAF: u32 = 0x4000_0100;
/// "MusubiMusubi" in EBX, ECX, EDX.
const NODE_SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"Musu"),
    u32::from_le_bytes(*b"biMu"),
    u32::from_le_bytes(*b"subi"),
];
/// Leaf `NODE_LEAF + 1`, EAX bit 0: IPIs go through the paravirtual port in EBX.
const NODE_FEATURE_PV_IPI: u32 = 1;

/// What a vCPU of a multi-node VM is told about the VM it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Topology {
    pub nodes: u16,
    /// The node this vCPU runs on.
    pub node: u16,
    /// The port a guest writes to send an IPI that may cross nodes.
    pub ipi_port: u16,
}

/// Adds the multi-node leaves: a single-node VM has none, so its guests use the LAPIC as on
/// any PC. A guest cannot send an IPI to a vCPU of another node through its LAPIC (KVM
/// delivers ICR writes in the kernel, to local vCPUs only), so it is told to use the port.
pub fn add_node_leaves(
    cpuid: &mut CpuId,
    leaves: Topology,
) -> Result<(), vmm_sys_util::fam::Error> {
    let [ebx, ecx, edx] = NODE_SIGNATURE;
    cpuid.push(kvm_cpuid_entry2 {
        function: NODE_LEAF,
        eax: NODE_LEAF + 1,
        ebx,
        ecx,
        edx,
        ..Default::default()
    })?;
    cpuid.push(kvm_cpuid_entry2 {
        function: NODE_LEAF + 1,
        eax: NODE_FEATURE_PV_IPI,
        ebx: leaves.ipi_port as u32,
        ecx: leaves.nodes as u32,
        edx: leaves.node as u32,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_leaves_carry_the_signature_and_the_node() {
        let mut c = CpuId::new(0).unwrap();
        add_node_leaves(
            &mut c,
            Topology {
                nodes: 3,
                node: 2,
                ipi_port: 0x5a0,
            },
        )
        .unwrap();
        let e = c.as_slice();
        let sig: Vec<u8> = [e[0].ebx, e[0].ecx, e[0].edx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        assert_eq!(&sig, b"MusubiMusubi");
        assert_eq!(e[0].eax, NODE_LEAF + 1);
        assert_eq!((e[1].eax, e[1].ebx, e[1].ecx, e[1].edx), (1, 0x5a0, 3, 2));
    }

    #[test]
    fn apic_id_and_hypervisor_bit_are_set() {
        let mut c = CpuId::from_entries(&[
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xff00_0800,
                ecx: LEAF1_ECX_VMX,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0x8000_0001,
                ecx: LEAF_8000_0001_ECX_SVM | 1,
                ..Default::default()
            },
        ])
        .unwrap();
        filter_cpuid(&mut c, 3, 4);
        let l1 = c.as_slice()[0];
        assert_eq!(l1.ecx & LEAF1_ECX_VMX, 0, "VMX hidden");
        assert_eq!(c.as_slice()[2].ecx, 1, "SVM hidden, the rest kept");
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800);
        assert_ne!(l1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_eq!(c.as_slice()[1].edx, 3);
    }
}
