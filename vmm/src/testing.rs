//! Hand-assembled guests: a PVH ELF wrapper and a tiny 32-bit code builder, so tests of the
//! VMM's own paths (entry, port exits, memory slots, crash handling) need no guest kernel.

/// Where the code of [`pvh_elf`] images is loaded and entered.
pub const LOAD: u32 = 0x10_0000;

/// An ELF64 image with one PT_LOAD of `code` at 1 MiB and a Xen PVH entry note.
pub fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    note.extend_from_slice(&4u32.to_le_bytes()); // namesz ("Xen\0")
    note.extend_from_slice(&4u32.to_le_bytes()); // descsz
    note.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&LOAD.to_le_bytes());
    let note_off = 64 + 2 * 56;
    let code_off = 0x1000usize;
    let mut e = vec![0u8; code_off];
    e[..4].copy_from_slice(b"\x7fELF");
    e[4] = 2; // 64-bit
    e[5] = 1; // little endian
    e[6] = 1; // version
    e[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    e[20..24].copy_from_slice(&1u32.to_le_bytes());
    e[24..32].copy_from_slice(&u64::from(LOAD).to_le_bytes()); // entry
    e[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
    e[52..54].copy_from_slice(&64u16.to_le_bytes()); // ehsize
    e[54..56].copy_from_slice(&56u16.to_le_bytes()); // phentsize
    e[56..58].copy_from_slice(&2u16.to_le_bytes()); // phnum
    let ph = |e: &mut Vec<u8>, at: usize, typ: u32, off: u64, addr: u64, len: u64| {
        e[at..at + 4].copy_from_slice(&typ.to_le_bytes());
        e[at + 4..at + 8].copy_from_slice(&7u32.to_le_bytes()); // RWX
        e[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
        e[at + 16..at + 24].copy_from_slice(&addr.to_le_bytes());
        e[at + 24..at + 32].copy_from_slice(&addr.to_le_bytes());
        e[at + 32..at + 40].copy_from_slice(&len.to_le_bytes());
        e[at + 40..at + 48].copy_from_slice(&len.to_le_bytes());
        e[at + 48..at + 56].copy_from_slice(&0x1000u64.to_le_bytes());
    };
    let len = code.len() as u64;
    ph(&mut e, 64, 1, code_off as u64, u64::from(LOAD), len);
    ph(&mut e, 120, 4, note_off as u64, 0, note.len() as u64);
    e[note_off..note_off + note.len()].copy_from_slice(&note);
    e.extend_from_slice(code);
    e
}

/// 32-bit protected-mode code, paging off: what a PVH entry starts in.
#[derive(Default, Clone)]
pub struct Code(pub Vec<u8>);

impl Code {
    pub fn out8(mut self, port: u16, byte: u8) -> Self {
        let p = port.to_le_bytes();
        self.0.extend([0x66, 0xba, p[0], p[1], 0xb0, byte, 0xee]);
        self
    }

    /// Stores `(i * 7 + seed) as u8` at `base + i * stride` for `i` in `0..count`.
    pub fn fill(mut self, base: u32, count: u32, stride: u32, seed: u8) -> Self {
        self.0.extend([0x31, 0xc9]); // xor ecx, ecx
        self.0.push(0xbf); // mov edi, base
        self.0.extend(base.to_le_bytes());
        let body = [
            vec![0x89, 0xc8],                                           // mov eax, ecx
            vec![0x6b, 0xc0, 0x07],                                     // imul eax, eax, 7
            vec![0x04, seed],                                           // add al, seed
            vec![0x88, 0x07],                                           // mov [edi], al
            [vec![0x81, 0xc7], stride.to_le_bytes().to_vec()].concat(), // add edi, stride
            vec![0x41],                                                 // inc ecx
            [vec![0x81, 0xf9], count.to_le_bytes().to_vec()].concat(),  // cmp ecx, count
        ]
        .concat();
        let back = -((body.len() + 2) as i8);
        self.0.extend(body);
        self.0.extend([0x72, back as u8]); // jb body
        self
    }

    /// Sends the byte at guest-physical `addr` to COM1.
    pub fn echo(mut self, addr: u32) -> Self {
        self.0.push(0xa0); // mov al, [addr]
        self.0.extend(addr.to_le_bytes());
        self.0.extend([0x66, 0xba, 0xf8, 0x03, 0xee]); // mov dx, 0x3f8; out dx, al
        self
    }

    pub fn exit(self, status: u8) -> Self {
        self.out8(0xf4, status)
    }

    /// `cli; hlt`: a CPU nothing but NMI or INIT can wake again.
    pub fn halt_for_good(mut self) -> Self {
        self.0.extend([0xfa, 0xf4]);
        self
    }

    /// `sti; hlt` in a loop: idle, waiting for interrupts.
    pub fn idle(mut self) -> Self {
        self.0.extend([0xfb, 0xf4, 0xeb, 0xfc]);
        self
    }

    pub fn spin(mut self) -> Self {
        self.0.extend([0xeb, 0xfe]);
        self
    }

    /// An IDT of limit 0 and then #UD: nothing can be delivered, so the CPU shuts down.
    pub fn triple_fault(mut self) -> Self {
        self.0.extend([0x0f, 0x01, 0x1d]); // lidt [0x5000] (zeros)
        self.0.extend(0x5000u32.to_le_bytes());
        self.0.extend([0x0f, 0x0b]); // ud2
        self
    }
}

static VCPU_REFUSED_CALL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every vCPU thread started from now on issue one system call its seccomp filter
/// refuses, so tests can check how a refused call ends the VM. Process-wide: use it only
/// in a test binary of its own.
pub fn make_vcpus_call_a_refused_syscall() {
    VCPU_REFUSED_CALL.store(true, std::sync::atomic::Ordering::SeqCst);
}

pub(crate) fn vcpu_makes_a_refused_call() -> bool {
    VCPU_REFUSED_CALL.load(std::sync::atomic::Ordering::SeqCst)
}

/// vCPU whose set-up is made to panic, plus one; 0 for none.
static VCPU_SET_UP_PANICS: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

/// Makes the set-up of vCPU `id` panic in every VM built from now on, so tests can check that
/// a vCPU that never came up ends the VM with the reason instead of leaving it waiting.
/// Process-wide: use it only in a test binary of its own.
pub fn make_vcpu_set_up_panic(id: u8) {
    VCPU_SET_UP_PANICS.store(u16::from(id) + 1, std::sync::atomic::Ordering::SeqCst);
}

pub(crate) fn vcpu_set_up_panics(id: u8) -> bool {
    VCPU_SET_UP_PANICS.load(std::sync::atomic::Ordering::SeqCst) == u16::from(id) + 1
}

/// A VM of `cpus` vCPUs and 32 MiB that boots `code` (see [`Code`]), serial off.
pub fn tiny_config(code: &[u8], cpus: u8) -> crate::config::VmConfig {
    use crate::config::{ExitsMode, KernelImage, SerialMode, VmConfig};
    VmConfig {
        kernel: KernelImage::Bytes {
            name: "tiny".into(),
            data: pvh_elf(code).into(),
        },
        cmdline: String::new(),
        initrd: None,
        cpus,
        memory: 32 << 20,
        disks: vec![],
        pmem: vec![],
        net: vec![],
        rng: None,
        vsock: None,
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    }
}

/// Filters enforced, a minute at most, and the serial output kept when `capture_serial`.
pub fn tiny_opts(capture_serial: bool) -> crate::RunOptions {
    crate::RunOptions {
        capture_serial,
        timeout: Some(std::time::Duration::from_secs(60)),
        seccomp: crate::seccomp::SeccompMode::Enforce,
        io_poll: std::time::Duration::ZERO,
        io_poll_hold: false,
        io_threads: crate::IoThreadCount::Auto,
    }
}
