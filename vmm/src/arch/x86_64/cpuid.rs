//! The CPUID each vCPU sees: KVM's supported set, made per-CPU and trimmed of what the
//! guest must not rely on.

use kvm_bindings::CpuId;

/// Leaf 1 ECX bit 31: "running under a hypervisor".
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
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
                e.ecx |= LEAF1_ECX_HYPERVISOR;
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
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn apic_id_and_hypervisor_bit_are_set() {
        let mut c = CpuId::from_entries(&[
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xff00_0800,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                ..Default::default()
            },
        ])
        .unwrap();
        filter_cpuid(&mut c, 3, 4);
        let l1 = c.as_slice()[0];
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800);
        assert_ne!(l1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_eq!(c.as_slice()[1].edx, 3);
    }
}
