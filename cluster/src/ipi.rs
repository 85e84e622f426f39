//! Paravirtual IPIs: what the guest wrote to the IPI port, turned into the MSIs that reach
//! each target vCPU through its own node's in-kernel LAPIC.
//!
//! KVM delivers a LAPIC ICR write in the kernel, to vCPUs of the same KVM VM only, and user
//! space cannot intercept it; a vCPU on another node would never see it. So a guest of a
//! multi-node VM writes its ICR value to a port instead (advertised in CPUID, see
//! `arch::x86_64::cpuid::NODE_LEAF`), and the node that holds the target injects it with
//! `KVM_SIGNAL_MSI`, which takes the same delivery modes as the ICR, INIT and STARTUP
//! included.

/// The port a multi-node guest writes `(dest << 24) | (icr_low & 0xf_ffff)` to.
pub const IPI_PORT: u16 = 0x5a0;

const DELIVERY_MODE_SHIFT: u32 = 8;
const DM_INIT: u32 = 5;
const DM_STARTUP: u32 = 6;
/// Delivery modes the ICR has that an MSI cannot carry (lowest priority is fine, SMI and the
/// reserved mode are not something a guest may ask another node for).
const DM_SMI: u32 = 2;
const DM_RESERVED: u32 = 3;
const LEVEL_ASSERT: u32 = 1 << 14;
const TRIGGER_LEVEL: u32 = 1 << 15;
const SHORTHAND_SHIFT: u32 = 18;
/// The MSI address window of the local APICs.
const MSI_ADDRESS: u32 = 0xfee0_0000;

/// One interrupt for one vCPU, in the form `KVM_SIGNAL_MSI` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msi {
    pub vcpu: u8,
    pub address: u32,
    pub data: u32,
}

/// The MSIs one port write asks for, sent by vCPU `sender` of a VM with vCPUs `0..cpus`.
/// Writes that are not a 4-byte value or name nothing deliverable ask for none.
pub fn decode(sender: u8, cpus: u8, data: &[u8]) -> Vec<Msi> {
    let Ok(bytes) = <[u8; 4]>::try_from(data) else {
        return Vec::new();
    };
    let value = u32::from_le_bytes(bytes);
    let icr = value & 0xf_ffff;
    let dest = (value >> 24) as u8;
    let mode = (icr >> DELIVERY_MODE_SHIFT) & 7;
    // An INIT de-assert (level clear) does nothing on any CPU since the Pentium 4; an MSI
    // has no level, so passing it on would INIT the target a second time.
    if mode == DM_INIT && icr & LEVEL_ASSERT == 0 {
        return Vec::new();
    }
    if mode == DM_SMI || mode == DM_RESERVED {
        return Vec::new();
    }
    let targets: Vec<u8> = match (icr >> SHORTHAND_SHIFT) & 3 {
        0 => vec![dest],
        1 => vec![sender],
        2 => (0..cpus).collect(),
        _ => (0..cpus).filter(|&v| v != sender).collect(),
    };
    let data = (icr & 0xff)
        | (mode << DELIVERY_MODE_SHIFT)
        | (icr & TRIGGER_LEVEL)
        | if mode == DM_STARTUP || mode == DM_INIT {
            LEVEL_ASSERT
        } else {
            icr & LEVEL_ASSERT
        };
    targets
        .into_iter()
        .filter(|&v| v < cpus)
        .map(|vcpu| Msi {
            vcpu,
            address: MSI_ADDRESS | ((vcpu as u32) << 12),
            data,
        })
        .collect()
}

/// The vCPU an MSI address names (physical destination mode).
pub fn target_of(address: u32) -> u8 {
    ((address >> 12) & 0xff) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dest: u8, icr: u32) -> [u8; 4] {
        ((dest as u32) << 24 | icr).to_le_bytes()
    }

    #[test]
    fn fixed_init_and_startup_reach_their_target() {
        let fixed = decode(0, 4, &write(2, 0x40 | LEVEL_ASSERT));
        assert_eq!(
            fixed,
            vec![Msi {
                vcpu: 2,
                address: 0xfee0_2000,
                data: 0x4040
            }]
        );
        assert_eq!(target_of(fixed[0].address), 2);
        let init = decode(0, 4, &write(3, (DM_INIT << 8) | LEVEL_ASSERT));
        assert_eq!(init[0].data, 0x4500);
        let sipi = decode(0, 4, &write(1, (DM_STARTUP << 8) | 0x08));
        assert_eq!((sipi[0].vcpu, sipi[0].data), (1, 0x4608));
    }

    #[test]
    fn shorthands_name_the_right_vcpus() {
        let all_but_me: Vec<u8> = decode(1, 3, &write(0, (3 << 18) | 0x30))
            .iter()
            .map(|m| m.vcpu)
            .collect();
        assert_eq!(all_but_me, vec![0, 2]);
        assert_eq!(decode(2, 3, &write(0, (1 << 18) | 0x30))[0].vcpu, 2);
        assert_eq!(decode(0, 3, &write(0, (2 << 18) | 0x30)).len(), 3);
    }

    #[test]
    fn nothing_deliverable_is_dropped() {
        assert!(
            decode(0, 2, &write(1, DM_INIT << 8)).is_empty(),
            "INIT de-assert"
        );
        assert!(decode(0, 2, &write(1, DM_SMI << 8)).is_empty());
        assert!(decode(0, 2, &write(7, 0x30)).is_empty(), "no such vCPU");
        assert!(decode(0, 2, &[1, 2]).is_empty(), "a 2-byte write");
    }
}
