//! The system-call interface between user tasks and the kernel (the `ud2` gate, user.rs).
//!
//! Number in RAX, arguments in RDI, RSI, RDX, R10, R8; result in RAX. Every other register is
//! preserved. Results at or above `ERR_BASE` are errors (`-code` as i64).

pub const SYS_EXIT: u64 = 0;
pub const SYS_WRITE: u64 = 1;
pub const SYS_DISK_COUNT: u64 = 2;
pub const SYS_DISK_CAPACITY: u64 = 3;
pub const SYS_BLK_READ: u64 = 4;
pub const SYS_BLK_WRITE: u64 = 5;
pub const SYS_BLK_FLUSH: u64 = 6;
pub const SYS_TSC_HZ: u64 = 7;
pub const SYS_BLK_GET_ID: u64 = 8;
/// A trivial call (paper 004's `getpid`): returns 1.
pub const SYS_GETPID: u64 = 9;
/// Memory-storage regions (`pmem`): count; `info(i, what)` with `PMEM_*` below; flush.
pub const SYS_PMEM_COUNT: u64 = 10;
pub const SYS_PMEM_INFO: u64 = 11;
pub const SYS_PMEM_FLUSH: u64 = 12;
/// The one open file of a task (`file.rs`): `open(storage, index, bytes, flags)` → `FD`.
pub const SYS_OPEN: u64 = 13;
pub const SYS_READ: u64 = 14;
pub const SYS_WRITE_FD: u64 = 15;
pub const SYS_LSEEK: u64 = 16;
pub const SYS_FSYNC: u64 = 17;
/// Maps the whole extent into the task on demand; returns its virtual address.
pub const SYS_MMAP: u64 = 18;
/// Writes back dirty pages, empties the page cache and removes the mapping's pages.
pub const SYS_DROP_CACHES: u64 = 19;
/// Cumulative kernel counters: `STAT_*` below.
pub const SYS_STATS: u64 = 20;
/// A demand-zero mapping of N pages; returns its virtual address.
pub const SYS_ANON_MAP: u64 = 21;
/// CPUs online (indices `0..n`; 0 is the BSP).
pub const SYS_CPU_COUNT: u64 = 22;
/// `cpu_node(cpu)`: the node (host) CPU `cpu` runs on; 0 on a single-node VM.
pub const SYS_CPU_NODE: u64 = 23;
/// `cpu_start(cpu, entry, stack_top, arg)`, from the BSP only: AP `cpu` enters
/// `entry(arg, cpu, 0)` at CPL3 on `stack_top` (in the arena), under the caller's deadline.
pub const SYS_CPU_START: u64 = 24;
/// `cpu_wait(cpu)`, from the BSP only: waits (bounded by the caller's deadline) for AP
/// `cpu`'s entry to end; returns its exit status, `CPU_FAULTED | vector` or `CPU_TIMED_OUT`.
pub const SYS_CPU_WAIT: u64 = 25;
/// `net_open(block, kind)`: resets the virtio-net (`DEV_NET`) or virtio-vsock
/// (`DEV_VSOCK`) device, sets its queues (a pair per CPU the device and the rings allow;
/// three for vsock) up on the rings the task named in its `NetOpen` block, brings it to
/// DRIVER_OK and maps its register page for the task; fills in the rest of the block and
/// makes the block's `pair` the calling CPU's. With `NET_OPEN_PAIR` it only attaches the
/// calling CPU to a pair of the device already up. The task drives the queues itself.
pub const SYS_NET_OPEN: u64 = 26;
/// `net_wait(timeout_us, seen, kind)`: halts until the used rings of the calling CPU's pair
/// move past `seen` (receive used index in bits 0..16; the transmit one in bits 16..32,
/// looked at only with `NET_WAIT_TX`), an interrupt arrives or the time passes. Returns 1
/// if a ring moved.
pub const SYS_NET_WAIT: u64 = 27;
pub const DEV_NET: u64 = 0;
pub const DEV_VSOCK: u64 = 1;
pub const NET_WAIT_TX: u64 = 1 << 32;
/// `rng_read(buf, len)`: up to `len` (at most 64 KiB) random bytes from the virtio-rng
/// device into the task's buffer; returns how many the device wrote.
pub const SYS_RNG_READ: u64 = 28;
/// The most `rng_read` asks the device for at once: what Musubi's device fills per request.
pub const RNG_MAX_REQUEST: u64 = 64 << 10;

pub const CPU_FAULTED: u64 = 0x100;
pub const CPU_TIMED_OUT: u64 = 0x200;

pub const PMEM_BASE: u64 = 0;
pub const PMEM_SIZE: u64 = 1;
/// 0: E820 type 12, 1: virtio-pmem.
pub const PMEM_SOURCE: u64 = 2;

pub const STORAGE_PMEM: u64 = 0;
pub const STORAGE_BLK: u64 = 1;
/// `open` flag: no page cache; reads and writes go between the device and the user buffer.
pub const OPEN_DIRECT: u64 = 1;
pub const FD: u64 = 3;

pub const STAT_KERNEL_COPY_BYTES: u64 = 0;
pub const STAT_PAGE_FAULTS: u64 = 1;
pub const STAT_VIRTIO_REQUESTS: u64 = 2;
pub const STAT_INTERRUPTS: u64 = 3;
/// Interrupts from the virtio-net device (not part of `STAT_INTERRUPTS`).
pub const STAT_NET_INTERRUPTS: u64 = 4;
/// Interrupts from the virtio-vsock device.
pub const STAT_VSOCK_INTERRUPTS: u64 = 5;

/// Bytes of one virtio-net queue in the `NetOpen::rings` area: descriptor table, avail
/// ring and used ring, a page each (room for `NET_MAX_QUEUE` entries).
pub const NET_QUEUE_BYTES: u64 = 3 * 4096;
pub const NET_AVAIL_OFF: u64 = 4096;
pub const NET_USED_OFF: u64 = 8192;
/// One queue pair: receive queue 2k and transmit queue 2k+1. A task lays the pairs out
/// one after another, pair k at `NetOpen::rings + k * NET_RING_BYTES`.
pub const NET_RING_BYTES: u64 = 2 * NET_QUEUE_BYTES;
/// The most queue pairs a task may lay rings out for (`NetOpen::pairs`).
pub const NET_MAX_PAIRS: u32 = 16;
/// `NetOpen::pair`: the pair of the calling CPU (its index modulo the pairs in use).
pub const NET_PAIR_ANY: u32 = u32::MAX;
/// `NetOpen::flags`: attach to a pair of the device another CPU of the same task brought
/// up on the same rings, instead of bringing it up (the only open a worker CPU may make).
pub const NET_OPEN_PAIR: u32 = 1;
/// `NetOpen::ctrl`: what became of the control queue at bring-up.
pub const NET_CTRL_NONE: u32 = 0;
/// VQ_PAIRS_SET was answered OK (or the device has a control queue but no MQ).
pub const NET_CTRL_OK: u32 = 1;
/// VQ_PAIRS_SET was answered VIRTIO_NET_ERR: the device uses one pair.
pub const NET_CTRL_ERR: u32 = 2;
/// VQ_PAIRS_SET got no used entry in time: the device uses one pair.
pub const NET_CTRL_NO_ANSWER: u32 = 3;
/// The control queue could not be set up (too small, already live): one pair.
pub const NET_CTRL_UNUSABLE: u32 = 4;
/// virtio-vsock's receive, transmit and event queues.
pub const VSOCK_RING_BYTES: u64 = 3 * NET_QUEUE_BYTES;
pub const NET_MAX_QUEUE: u32 = 256;
/// The longest `net_wait`: the task looks at its own deadline at least this often.
pub const NET_MAX_WAIT_US: u64 = 1_000_000;

/// The block `net_open` works on, in the task's arena. The task fills `rings` (4 KiB
/// aligned, `pairs * NET_RING_BYTES` for virtio-net, zeroed and with the receive buffers
/// already posted if it likes), `want_queue`, `pairs`, `pair` and `flags`; the kernel
/// fills the rest.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NetOpen {
    pub rings: u64,
    pub want_queue: u32,
    /// In: queue pairs `rings` has room for (0 counts as 1). Out: pairs the device uses,
    /// at most that, the device's `max_virtqueue_pairs` and the CPUs online.
    pub pairs: u32,
    /// In: the pair this CPU drives (`NET_PAIR_ANY`: its index modulo the pairs in use).
    /// Out: the pair it got.
    pub pair: u32,
    /// `NET_OPEN_PAIR` or 0.
    pub flags: u32,
    /// Out: the device's `max_virtqueue_pairs` (1 without VIRTIO_NET_F_MQ).
    pub max_pairs: u32,
    /// Out: `NET_CTRL_*`.
    pub ctrl: u32,
    /// Entries of each queue: a power of two, at most `want_queue` and the device's limit.
    pub queue_size: u32,
    /// Negotiated feature bits.
    pub features: u64,
    /// virtio-net: from the device's configuration if it offers VIRTIO_NET_F_MAC, else a
    /// fixed locally administered address; 2 bytes of padding. virtio-vsock: the guest's
    /// cid (le64).
    pub mac: [u8; 8],
    /// The QueueNotify register, mapped for the task (uncached).
    pub notify: u64,
    /// The task's deadline (TSC; 0: none), so its loops end before the kernel ends them.
    pub deadline: u64,
    /// `probe.virtio_poll_us`: how long to poll before waiting.
    pub poll_us: u64,
}

pub const ERR_BASE: u64 = (-4096i64) as u64;

/// Errors a system call (mostly a block request) can return.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u64)]
pub enum Error {
    /// The device answered VIRTIO_BLK_S_IOERR.
    IoErr = 1,
    /// The device answered VIRTIO_BLK_S_UNSUPP.
    Unsupported = 2,
    /// No used-ring entry within the bound; the disk is then out of service until reset.
    Timeout = 3,
    /// A buffer outside the task's memory, or a length that is not a whole number of sectors.
    BadArgument = 4,
    NoSuchDisk = 5,
    /// The device completed the request without writing a known status byte.
    BadStatus = 6,
    /// The disk failed to initialise or an earlier request timed out.
    NotReady = 7,
    /// Sectors beyond the disk's capacity.
    OutOfRange = 8,
    NoSuchCall = 9,
    /// The kernel's page pool is too small for the request.
    NoMemory = 10,
    /// No such file descriptor, memory-storage region, or the file was not opened.
    BadFd = 11,
    /// No such CPU online, or the call is for the BSP only.
    NoSuchCpu = 12,
    /// The CPU still runs an earlier entry.
    Busy = 13,
    /// No device of the kind asked for (virtio-net), or it failed to initialise.
    NoDevice = 14,
}

impl Error {
    pub fn from_code(c: u64) -> Error {
        match c {
            1 => Error::IoErr,
            2 => Error::Unsupported,
            3 => Error::Timeout,
            4 => Error::BadArgument,
            5 => Error::NoSuchDisk,
            6 => Error::BadStatus,
            7 => Error::NotReady,
            8 => Error::OutOfRange,
            10 => Error::NoMemory,
            11 => Error::BadFd,
            12 => Error::NoSuchCpu,
            13 => Error::Busy,
            14 => Error::NoDevice,
            _ => Error::NoSuchCall,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Error::IoErr => "ioerr",
            Error::Unsupported => "unsupported",
            Error::Timeout => "timeout",
            Error::BadArgument => "bad-argument",
            Error::NoSuchDisk => "no-such-disk",
            Error::BadStatus => "bad-status",
            Error::NotReady => "not-ready",
            Error::OutOfRange => "out-of-range",
            Error::NoSuchCall => "no-such-call",
            Error::NoMemory => "no-memory",
            Error::BadFd => "bad-fd",
            Error::NoSuchCpu => "no-such-cpu",
            Error::Busy => "busy",
            Error::NoDevice => "no-device",
        }
    }

    pub fn encode(self) -> u64 {
        (self as u64).wrapping_neg()
    }
}

/// Splits a raw system-call result into a value or an error.
pub fn decode(r: u64) -> Result<u64, Error> {
    if r >= ERR_BASE {
        Err(Error::from_code(r.wrapping_neg()))
    } else {
        Ok(r)
    }
}

/// Task exit statuses that the kernel turns into the VM's exit status.
pub const STATUS_UNKNOWN_TASK: u8 = 2;
pub const STATUS_BLK_FAILED: u8 = 3;
pub const STATUS_USER_FAULT: u8 = 4;
pub const STATUS_CONSOLE_TIMEOUT: u8 = 5;
/// A multi-CPU task computed a wrong result (`shared-counter` not exact, `fib` mismatch).
pub const STATUS_WRONG_RESULT: u8 = 6;
/// A network task failed: no device, no reply, the connection broke or time ran out.
pub const STATUS_NET_FAILED: u8 = 7;
/// The `rng` task failed: no usable virtio-rng device, or a request failed or kept coming
/// back empty.
pub const STATUS_RNG_FAILED: u8 = 8;
/// `wait-power`: no power button, or no press acted on in time.
pub const STATUS_POWER_TIMEOUT: u8 = 9;
pub const STATUS_KERNEL_FAULT: u8 = 101;
