//! What the loader handed over in `hvm_start_info`, copied into the kernel so the low memory
//! holding it can be reused (the AP trampoline goes to 0x8000).

use crate::global::Global;
use crate::kprintln;

const START_INFO_MAGIC: u32 = 0x336e_c578;
const MAX_CMDLINE: usize = 4096;
const MAX_MEMMAP: usize = 64;

#[derive(Clone, Copy)]
pub struct MemEntry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub struct BootInfo {
    cmdline: [u8; MAX_CMDLINE],
    cmdline_len: usize,
    mem: [MemEntry; MAX_MEMMAP],
    mem_len: usize,
    pub rsdp: u64,
    /// Extended BIOS data area, from the BDA word at 0x40e (read before page 0 is unmapped).
    pub ebda: u64,
}

static INFO: Global<BootInfo> = Global::new(BootInfo {
    cmdline: [0; MAX_CMDLINE],
    cmdline_len: 0,
    mem: [MemEntry {
        addr: 0,
        size: 0,
        kind: 0,
    }; MAX_MEMMAP],
    mem_len: 0,
    rsdp: 0,
    ebda: 0,
});

impl BootInfo {
    pub fn cmdline(&self) -> &[u8] {
        &self.cmdline[..self.cmdline_len]
    }

    pub fn memmap(&self) -> &[MemEntry] {
        &self.mem[..self.mem_len]
    }

    /// Bytes of E820 type 1 (usable RAM).
    pub fn ram_bytes(&self) -> u64 {
        self.memmap()
            .iter()
            .filter(|e| e.kind == 1)
            .map(|e| e.size)
            .sum()
    }

    /// End of the highest usable-RAM entry.
    pub fn ram_end(&self) -> u64 {
        self.memmap()
            .iter()
            .filter(|e| e.kind == 1)
            .map(|e| e.addr + e.size)
            .max()
            .unwrap_or(0)
    }

    /// The `value` of the first `key=value` word on the command line.
    pub fn param<'a>(&'a self, key: &'a [u8]) -> Option<&'a [u8]> {
        self.params(key).next()
    }

    /// Every `value` of `key=value` words (several `virtio_mmio.device=` may appear).
    pub fn params<'a>(&'a self, key: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.cmdline()
            .split(|&b| b == b' ' || b == b'\t' || b == b'\n')
            .filter_map(move |w| {
                if w.len() > key.len() && w.starts_with(key) && w[key.len()] == b'=' {
                    Some(&w[key.len() + 1..])
                } else {
                    None
                }
            })
    }
}

pub fn get() -> &'static BootInfo {
    // SAFETY: `parse` writes INFO once, at boot, before the first call here; every reference
    // handed out afterwards is shared, so none of them sees a write.
    unsafe { INFO.get() }
}

/// # Safety
/// `start_info` is the physical address from EBX at PVH entry (or 0); memory is
/// identity-mapped, page 0 included; no reference from `get` exists yet.
pub unsafe fn parse(start_info: u64) {
    let info = INFO.get();
    info.ebda = (core::ptr::read_volatile(0x40e as *const u16) as u64) << 4;
    let p = start_info as *const u8;
    let rd32 = |off: usize| core::ptr::read_unaligned(p.add(off) as *const u32);
    let rd64 = |off: usize| core::ptr::read_unaligned(p.add(off) as *const u64);
    if start_info == 0 || rd32(0) != START_INFO_MAGIC {
        kprintln!(
            "probe: no hvm_start_info at {:#x} (not booted through PVH?)",
            start_info
        );
        return;
    }
    let version = rd32(4);
    let cmd = rd64(24);
    info.rsdp = rd64(32);
    if cmd != 0 {
        let c = cmd as *const u8;
        let mut n = 0;
        while n < MAX_CMDLINE && *c.add(n) != 0 {
            info.cmdline[n] = *c.add(n);
            n += 1;
        }
        info.cmdline_len = n;
    }
    if version >= 1 {
        let map = rd64(40) as *const u8;
        let entries = (rd32(48) as usize).min(MAX_MEMMAP);
        for i in 0..entries {
            let e = map.add(i * 24);
            info.mem[i] = MemEntry {
                addr: core::ptr::read_unaligned(e as *const u64),
                size: core::ptr::read_unaligned(e.add(8) as *const u64),
                kind: core::ptr::read_unaligned(e.add(16) as *const u32),
            };
        }
        info.mem_len = entries;
    } else {
        kprintln!("probe: hvm_start_info version 0 has no memory map");
    }
}
