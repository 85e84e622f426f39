//! Library for code that runs at CPL3: system-call stubs, a line buffer, JSON escaping and
//! CRC-32. Nothing here touches kernel statics (user tasks cannot read them); the kernel
//! also uses the pure helpers.

use core::fmt;

use crate::abi::{self, decode, Error};

// The system-call gate (see user.rs): the kernel resumes after the `ud2`, at the `ret`.
core::arch::global_asm!(
    r#"
    .section .text.ugate, "ax"
    .global user_syscall_gate
user_syscall_gate:
    ud2
    ret
    "#
);

extern "C" {
    fn user_syscall_gate();
}

pub fn syscall_gate() -> u64 {
    user_syscall_gate as *const () as u64
}

#[inline(always)]
fn syscall(n: u64, a0: u64, a1: u64, a2: u64, a3: u64) -> u64 {
    let r: u64;
    unsafe {
        core::arch::asm!(
            "call {gate}",
            gate = sym user_syscall_gate,
            inlateout("rax") n => r,
            in("rdi") a0,
            in("rsi") a1,
            in("rdx") a2,
            in("r10") a3,
        );
    }
    r
}

pub fn exit(status: u8) -> ! {
    syscall(abi::SYS_EXIT, status as u64, 0, 0, 0);
    // The kernel never returns from exit; fault loudly if it did.
    loop {
        unsafe { core::arch::asm!("ud2", options(nomem, nostack)) };
    }
}

pub fn write(b: &[u8]) {
    syscall(abi::SYS_WRITE, b.as_ptr() as u64, b.len() as u64, 0, 0);
}

pub fn disk_count() -> usize {
    syscall(abi::SYS_DISK_COUNT, 0, 0, 0, 0) as usize
}

/// Capacity in 512-byte sectors.
pub fn disk_capacity(disk: usize) -> Result<u64, Error> {
    decode(syscall(abi::SYS_DISK_CAPACITY, disk as u64, 0, 0, 0))
}

pub fn blk_read(disk: usize, sector: u64, buf: u64, len: u64) -> Result<(), Error> {
    decode(syscall(abi::SYS_BLK_READ, disk as u64, sector, buf, len)).map(|_| ())
}

pub fn blk_write(disk: usize, sector: u64, buf: u64, len: u64) -> Result<(), Error> {
    decode(syscall(abi::SYS_BLK_WRITE, disk as u64, sector, buf, len)).map(|_| ())
}

pub fn blk_flush(disk: usize) -> Result<(), Error> {
    decode(syscall(abi::SYS_BLK_FLUSH, disk as u64, 0, 0, 0)).map(|_| ())
}

/// Writes the device's 20-byte ID string to `buf`.
pub fn blk_get_id(disk: usize, buf: u64) -> Result<(), Error> {
    decode(syscall(abi::SYS_BLK_GET_ID, disk as u64, buf, 0, 0)).map(|_| ())
}

pub fn tsc_hz() -> u64 {
    syscall(abi::SYS_TSC_HZ, 0, 0, 0, 0)
}

pub fn rdtsc() -> u64 {
    crate::arch::rdtsc()
}

pub fn cycles_to_ns(cycles: u64, hz: u64) -> u64 {
    (cycles as u128 * 1_000_000_000 / hz.max(1) as u128) as u64
}

/// One output line, built on the task's stack and written with a single system call.
pub struct Line {
    buf: [u8; 2048],
    len: usize,
}

impl Line {
    pub fn new() -> Line {
        Line {
            buf: [0; 2048],
            len: 0,
        }
    }

    pub fn push(&mut self, s: &str) {
        for &b in s.as_bytes() {
            if self.len < self.buf.len() {
                self.buf[self.len] = b;
                self.len += 1;
            }
        }
    }

    pub fn send(&mut self) {
        if self.len == self.buf.len() {
            self.buf[self.len - 1] = b'\n';
        }
        write(&self.buf[..self.len]);
        self.len = 0;
    }
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push(s);
        Ok(())
    }
}

/// Escapes whatever is formatted through it for use inside a JSON string.
pub struct JsonEscape<'a, W: fmt::Write>(pub &'a mut W);

impl<W: fmt::Write> fmt::Write for JsonEscape<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            match c {
                '"' => self.0.write_str("\\\"")?,
                '\\' => self.0.write_str("\\\\")?,
                c if (c as u32) < 0x20 => write!(self.0, "\\u{:04x}", c as u32)?,
                c => self.0.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// Bytes shown as a JSON string body: printable ASCII as is, everything else `\u00XX`.
pub struct JsonBytes<'a>(pub &'a [u8]);

impl fmt::Display for JsonBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for &b in self.0 {
            match b {
                b'"' => f.write_str("\\\"")?,
                b'\\' => f.write_str("\\\\")?,
                0x20..=0x7e => fmt::Write::write_char(f, b as char)?,
                _ => write!(f, "\\u{:04x}", b)?,
            }
        }
        Ok(())
    }
}

const fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut s = 1;
        while s < 8 {
            t[s][i] = (t[s - 1][i] >> 8) ^ t[0][(t[s - 1][i] & 0xff) as usize];
            s += 1;
        }
        i += 1;
    }
    t
}

/// In rodata, which user tasks may read.
static CRC: [[u32; 256]; 8] = crc_tables();

/// CRC-32 (IEEE 802.3, reflected, as zlib): start with `!0`, finish with `!crc`.
/// Slice-by-8, since whole disks go through it.
pub fn crc32_update(mut crc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let lo = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ crc;
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = CRC[7][(lo & 0xff) as usize]
            ^ CRC[6][((lo >> 8) & 0xff) as usize]
            ^ CRC[5][((lo >> 16) & 0xff) as usize]
            ^ CRC[4][(lo >> 24) as usize]
            ^ CRC[3][(hi & 0xff) as usize]
            ^ CRC[2][((hi >> 8) & 0xff) as usize]
            ^ CRC[1][((hi >> 16) & 0xff) as usize]
            ^ CRC[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = CRC[0][((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}
