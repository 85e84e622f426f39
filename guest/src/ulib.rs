//! Library for code that runs at CPL3: system-call stubs, a line buffer, JSON escaping,
//! CRC-32 and the test streams' bytes. Nothing here touches kernel statics (user tasks
//! cannot read them); the kernel also uses the pure helpers.

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
    /// The system-call gate; never called as a function, only by `syscall`'s asm.
    fn user_syscall_gate();
}

pub fn syscall_gate() -> u64 {
    user_syscall_gate as *const () as u64
}

#[inline(always)]
fn syscall(n: u64, a0: u64, a1: u64, a2: u64, a3: u64) -> u64 {
    let r: u64;
    // SAFETY: the gate's `ud2` traps into the kernel, which restores every register but rax
    // (the result) and resumes at the gate's `ret`. The kernel reads and writes only memory
    // the call names and it checked (in the task's arena), which the asm may touch (no
    // `nomem`); `call` pushes onto the task's stack (no `nostack`).
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
        // SAFETY: raises #UD, which ends the task; it has no other effect.
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

    /// Starts item `i` of a JSON list: a comma before every item but the first.
    pub fn item(&mut self, i: usize) {
        if i > 0 {
            self.push(",");
        }
    }

    pub fn as_str(&self) -> &str {
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
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

/// CRC-32 lives in the shared workload crate (the native program uses the same code).
pub use workloads::crc32_update;

/// Up to `len` (at most 64 KiB) random bytes from the virtio-rng device at `buf`; how many
/// came.
pub fn rng_read(buf: u64, len: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_RNG_READ, buf, len, 0, 0))
}

pub fn getpid() -> u64 {
    syscall(abi::SYS_GETPID, 0, 0, 0, 0)
}

pub fn pmem_count() -> usize {
    syscall(abi::SYS_PMEM_COUNT, 0, 0, 0, 0) as usize
}

/// `what`: `abi::PMEM_BASE`, `PMEM_SIZE` or `PMEM_SOURCE`.
pub fn pmem_info(i: usize, what: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_PMEM_INFO, i as u64, what, 0, 0))
}

/// True if a device flush was needed (virtio-pmem), false if not (E820).
pub fn pmem_flush(i: usize) -> Result<bool, Error> {
    decode(syscall(abi::SYS_PMEM_FLUSH, i as u64, 0, 0, 0)).map(|v| v != 0)
}

pub fn open(storage: u64, index: usize, bytes: u64, flags: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_OPEN, storage, index as u64, bytes, flags))
}

pub fn read(fd: u64, buf: u64, len: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_READ, fd, buf, len, 0))
}

pub fn write_fd(fd: u64, buf: u64, len: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_WRITE_FD, fd, buf, len, 0))
}

pub fn lseek(fd: u64, off: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_LSEEK, fd, off, 0, 0))
}

pub fn fsync(fd: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_FSYNC, fd, 0, 0, 0))
}

pub fn mmap(fd: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_MMAP, fd, 0, 0, 0))
}

pub fn drop_caches(fd: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_DROP_CACHES, fd, 0, 0, 0))
}

pub fn anon_map(pages: u64) -> Result<u64, Error> {
    decode(syscall(abi::SYS_ANON_MAP, pages, 0, 0, 0))
}

/// The kernel's counters (`abi::STAT_*`), in one snapshot.
#[derive(Clone, Copy, Default)]
pub struct Stats {
    pub kernel_copy_bytes: u64,
    pub page_faults: u64,
    pub virtio_requests: u64,
    pub interrupts: u64,
}

pub fn stats() -> Stats {
    let s = |w| syscall(abi::SYS_STATS, w, 0, 0, 0);
    Stats {
        kernel_copy_bytes: s(abi::STAT_KERNEL_COPY_BYTES),
        page_faults: s(abi::STAT_PAGE_FAULTS),
        virtio_requests: s(abi::STAT_VIRTIO_REQUESTS),
        interrupts: s(abi::STAT_INTERRUPTS),
    }
}

impl Stats {
    /// What happened between `self` (earlier) and `later`, as the report's counters.
    pub fn delta(&self, later: &Stats) -> workloads::task::Counters {
        workloads::task::Counters {
            kernel_copy_bytes: Some(later.kernel_copy_bytes - self.kernel_copy_bytes),
            page_faults: Some(later.page_faults - self.page_faults),
            virtio_requests: Some(later.virtio_requests - self.virtio_requests),
            interrupts: Some(later.interrupts - self.interrupts),
        }
    }
}

pub fn cpu_count() -> usize {
    syscall(abi::SYS_CPU_COUNT, 0, 0, 0, 0) as usize
}

pub fn cpu_node(cpu: usize) -> Result<u64, Error> {
    decode(syscall(abi::SYS_CPU_NODE, cpu as u64, 0, 0, 0))
}

/// Starts `entry(arg, cpu, 0)` at CPL3 on AP `cpu` with the stack ending at `stack_top`.
pub fn cpu_start(
    cpu: usize,
    entry: extern "C" fn(u64, u64, u64) -> !,
    stack_top: u64,
    arg: u64,
) -> Result<(), Error> {
    let e = entry as usize as u64;
    decode(syscall(abi::SYS_CPU_START, cpu as u64, e, stack_top, arg)).map(|_| ())
}

/// Waits for AP `cpu`'s entry to end: its exit status, `abi::CPU_FAULTED | vector` or
/// `abi::CPU_TIMED_OUT`.
pub fn cpu_wait(cpu: usize) -> Result<u64, Error> {
    decode(syscall(abi::SYS_CPU_WAIT, cpu as u64, 0, 0, 0))
}

/// Brings the virtio-net device up on the rings `block` names and fills in the rest of it
/// (see `abi::NetOpen`).
pub fn net_open(block: &mut abi::NetOpen) -> Result<(), Error> {
    let at = block as *mut abi::NetOpen as u64;
    decode(syscall(abi::SYS_NET_OPEN, at, abi::DEV_NET, 0, 0)).map(|_| ())
}

/// Halts until the receive used ring moves past `seen_rx` (and, if given, the transmit one
/// past `seen_tx`), an interrupt comes or `timeout_us` passes; true if a ring moved.
pub fn net_wait(timeout_us: u64, seen_rx: u16, seen_tx: Option<u16>) -> bool {
    let tx = seen_tx.map_or(0, |t| (t as u64) << 16 | abi::NET_WAIT_TX);
    syscall(
        abi::SYS_NET_WAIT,
        timeout_us,
        seen_rx as u64 | tx,
        abi::DEV_NET,
        0,
    ) == 1
}

/// As [`net_open`], for the virtio-vsock device (three queues; `block.mac` is the cid).
pub fn vsock_open(block: &mut abi::NetOpen) -> Result<(), Error> {
    let at = block as *mut abi::NetOpen as u64;
    decode(syscall(abi::SYS_NET_OPEN, at, abi::DEV_VSOCK, 0, 0)).map(|_| ())
}

/// As [`net_wait`], for the virtio-vsock device.
pub fn vsock_wait(timeout_us: u64, seen_rx: u16, seen_tx: Option<u16>) -> bool {
    let tx = seen_tx.map_or(0, |t| (t as u64) << 16 | abi::NET_WAIT_TX);
    syscall(
        abi::SYS_NET_WAIT,
        timeout_us,
        seen_rx as u64 | tx,
        abi::DEV_VSOCK,
        0,
    ) == 1
}

/// Interrupts the virtio-net device has raised since boot.
pub fn net_interrupts() -> u64 {
    syscall(abi::SYS_STATS, abi::STAT_NET_INTERRUPTS, 0, 0, 0)
}

/// Writes the bytes of `tcp-send`'s and `vsock-send`'s stream from offset `off` into `b`
/// (byte i is i mod 251, which the host's checks expect): one period computed, the rest
/// copied from it, so the sender's own work stays small beside the path it measures.
pub fn stream_bytes(b: &mut [u8], off: u64) {
    const PERIOD: usize = 251;
    let first = b.len().min(PERIOD);
    for (i, x) in b[..first].iter_mut().enumerate() {
        *x = ((off + i as u64) % PERIOD as u64) as u8;
    }
    // `have` stays a multiple of the period, so each copy continues the stream.
    let mut have = first;
    while have < b.len() {
        let n = have.min(b.len() - have);
        b.copy_within(..n, have);
        have += n;
    }
}
