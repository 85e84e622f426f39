//! Initial register state for the boot protocols Musubi starts guests with.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};

const CR0_PE: u64 = 1 << 0;
const CR0_ET: u64 = 1 << 4;

fn flat_segment(selector: u16, type_: u8, db: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// The PVH entry state: 32-bit protected mode, paging off, flat 4 GiB segments
/// (Xen's PVH ABI, which QEMU and Linux follow too).
pub fn pvh_sregs(sregs: &mut kvm_sregs) {
    sregs.cs = flat_segment(0x10, 0xb, 1);
    let data = flat_segment(0x18, 0x3, 1);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: 0,
        limit: 0x67,
        selector: 0x20,
        type_: 0xb,
        present: 1,
        s: 0,
        ..Default::default()
    };
    sregs.cr0 = CR0_PE | CR0_ET;
    sregs.cr4 = 0;
    sregs.efer = 0;
}

pub fn pvh_regs(entry: u64, start_info: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rbx: start_info,
        rflags: 0x2,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvh_state_is_flat_protected_mode() {
        let mut s = kvm_sregs::default();
        pvh_sregs(&mut s);
        assert_eq!(s.cr0 & CR0_PE, CR0_PE);
        assert_eq!(s.cs.db, 1);
        assert_eq!(s.cs.l, 0);
        assert_eq!(s.ss.limit, 0xffff_ffff);
        let r = pvh_regs(0x10_0000, 0x6000);
        assert_eq!((r.rip, r.rbx, r.rflags), (0x10_0000, 0x6000, 2));
    }
}
