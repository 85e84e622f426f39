//! virtio-net over a TAP (or any frame pipe with the same framing): up to
//! [`MAX_QUEUE_PAIRS`] receive and transmit queue pairs, each over a backend of its own (a
//! queue of a multiqueue TAP), and a control queue; frames pass with their 12-byte
//! virtio-net header untouched so the guest's checksum and segmentation offloads reach the
//! host kernel.
//!
//! Queue layout (virtio 1.2, 5.1.2): receiveq(k) is queue 2k, transmitq(k) queue 2k+1, the
//! control queue 2N with VIRTIO_NET_F_MQ (N pairs) and 2 without it. Until the driver sets
//! the number of pairs with VQ_PAIRS_SET only pair 0 receives; the backends of the pairs
//! not in use are disabled (a TAP queue detached), so the kernel does not queue frames
//! where no guest reads them. Every transmit queue sends through its own pair's backend,
//! in use or not (a detached TAP queue still takes frames to send).
//!
//! A received frame is read into a device-side buffer first: one that does not fit the
//! receive buffers the guest posted can then be held without holding guest memory. A
//! transmitted frame goes from guest memory to the backend without a copy of the device's
//! (a TAP gets the guest's buffers as the iovecs of one `writev`, as QEMU's and vhost-net's
//! transmit paths hand them over): the kernel copies it once, so a guest that changes it
//! meanwhile garbles only its own frame, and every buffer was checked to lie in guest
//! memory first. A frame held for output commit is copied, as it must outlive the chain.
//!
//! Besides its doorbells the device waits on each pair's backend becoming readable, on the
//! rate limiters' timers (shared by the pairs) and on an eventfd of its own that it signals
//! when it stopped early with work left (a bounded pass, or activation with frames already
//! queued, or frames a replicated VM's output gate released); see
//! [`VirtioDevice::event_fds`]. These should be watched edge-triggered: while the guest
//! posts no receive buffers the device leaves frames in the backend, which then stays
//! readable.
//!
//! A replicated VM's device holds what the guest transmits until the replicator releases it
//! (see [`crate::net::output_gate`]), in one ordered queue written through pair 0's
//! backend; it learns the guest's IPv4 address from the frames going out and announces it
//! with a gratuitous ARP wherever the VM is restored (see [`crate::net::announce`]).

use super::{
    available, corrupt, pop, read_config_bytes, serve_available, DeviceState, QueueCorrupt,
    VirtioDevice, VirtioStats, QUEUE_MAX_SIZE,
};
use crate::net::announce::{gratuitous_arp, sender_ipv4};
use crate::net::control::{decode, Command, RxFilter};
use crate::net::output_gate::{OutputGate, DEFAULT_HELD_BYTES};
use crate::net::rate_limiter::{RateLimit, RateLimiter};
use crate::net::tap::{offload_flags, Tap, TapError, VNET_HDR_LEN};
use crate::GuestMemoryMmap;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use tracing::{debug, warn};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::*;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_USED_F_NO_NOTIFY};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::bitmap::{AtomicBitmap, BS};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions, VolatileSlice};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The device's counters; `interrupts` is the transport's to fill.
pub use musubi_types::NetCounters;

/// Longest frame (after the virtio-net header) either way: a 64 KiB GSO frame plus its
/// Ethernet and VLAN headers, as Linux's virtio-net driver sizes its big receive buffers.
pub const MAX_FRAME_LEN: usize = 65_562;
/// Queue the guest posts receive buffers on (of pair 0; pair k's is 2k).
pub const RX_QUEUE: u16 = 0;
/// Queue the guest posts frames to send on (of pair 0; pair k's is 2k+1).
pub const TX_QUEUE: u16 = 1;
/// Queue pairs a device may have: each is a TAP queue (a descriptor) and two doorbells, and
/// Linux's TAP takes 256 queues at most; 16 covers the vCPUs Musubi's guests have.
pub const MAX_QUEUE_PAIRS: u16 = 16;
/// Descriptors followed per chain at most. Direct chains are bounded by the ring already;
/// an indirect table (followed whether or not it was offered) could otherwise be huge.
pub const MAX_CHAIN_DESCRIPTORS: usize = 512;
/// Longest control command (header and data) the device reads: two MAC tables of a
/// thousand addresses and more, far more than it keeps (see [`MAC_TABLE_ENTRIES`]).
///
/// [`MAC_TABLE_ENTRIES`]: crate::net::control::MAC_TABLE_ENTRIES
pub const CTRL_MAX_LEN: usize = 16 << 10;

/// Passes over a ring before a notification handler yields (and signals its resume
/// eventfd), so a guest refilling as fast as the device drains cannot keep it forever.
const TX_ROUNDS: usize = 4;
const CONFIG_LEN: usize = 10;
/// Offset of `num_buffers` in `virtio_net_hdr_v1`.
const NUM_BUFFERS_OFFSET: usize = 10;

/// Feature bits offered by every device; a device of several pairs adds VIRTIO_NET_F_MQ.
pub const NET_FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_RING_F_EVENT_IDX)
    | (1 << VIRTIO_NET_F_MAC)
    | (1 << VIRTIO_NET_F_STATUS)
    | (1 << VIRTIO_NET_F_MRG_RXBUF)
    | (1 << VIRTIO_NET_F_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_TSO4)
    | (1 << VIRTIO_NET_F_GUEST_TSO6)
    | (1 << VIRTIO_NET_F_HOST_TSO4)
    | (1 << VIRTIO_NET_F_HOST_TSO6)
    | (1 << VIRTIO_NET_F_CTRL_VQ)
    | (1 << VIRTIO_NET_F_CTRL_RX);

const MQ: u64 = 1 << VIRTIO_NET_F_MQ;
const CTRL_VQ: u64 = 1 << VIRTIO_NET_F_CTRL_VQ;

/// Where frames go and come from. A trait so the device tests and the fuzz target can use a
/// socketpair instead of a TAP, which needs privileges.
pub trait NetBackend: Send {
    /// Reads one frame, virtio-net header first; `WouldBlock` when none is queued, `Ok(0)`
    /// when the other end is gone.
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes one frame, header first, whole; `WouldBlock` when it cannot be taken now.
    fn write_frame(&mut self, iovs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Writes one frame that lies in guest memory, as `write_frame`. The default copies it
    /// out first.
    fn write_guest(&mut self, parts: &[GuestSlice<'_>]) -> io::Result<usize> {
        let mut frame = vec![0; parts.iter().map(|p| p.len()).sum()];
        let mut at = 0;
        for p in parts {
            at += p.copy_to(&mut frame[at..]);
        }
        self.write_frame(&[IoSlice::new(&frame)])
    }
    /// The descriptor that becomes readable when a frame is queued.
    fn raw_fd(&self) -> RawFd;
    /// Tells the backend which `TUN_F_*` offloads the guest takes on receive.
    fn set_offload(&mut self, flags: u32) -> io::Result<()>;
    /// Whether the network should queue frames here: the queue pair it serves is in use.
    /// Backends that cannot say so (one queue, a socket) ignore it.
    fn set_enabled(&mut self, on: bool) -> io::Result<()> {
        let _ = on;
        Ok(())
    }
}

impl NetBackend for Tap {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf)
    }
    fn write_frame(&mut self, iovs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.write_vectored(iovs)
    }
    fn write_guest(&mut self, parts: &[GuestSlice<'_>]) -> io::Result<usize> {
        writev_guest(self.as_raw_fd(), parts)
    }
    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
    fn set_offload(&mut self, flags: u32) -> io::Result<()> {
        Tap::set_offload(self, flags).map_err(io::Error::other)
    }
    fn set_enabled(&mut self, on: bool) -> io::Result<()> {
        Tap::set_queue_enabled(self, on).map_err(io::Error::other)
    }
}

/// What the VMM knows about a `--net`.
#[derive(Debug)]
pub struct NetConfig {
    /// One TAP queue per queue pair, pair 0's first.
    pub taps: Vec<Tap>,
    /// The guest's MAC; a locally administered one is made up when `None`.
    pub mac: Option<[u8; 6]>,
    /// Largest ring the guest may set up: a power of two up to [`QUEUE_MAX_SIZE`].
    pub queue_size: u16,
    pub rx_rate: Option<RateLimit>,
    pub tx_rate: Option<RateLimit>,
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("virtio-net: queue size {0} is not a power of two from 1 to {QUEUE_MAX_SIZE}")]
    QueueSize(u16),
    #[error("virtio-net: {0} queue pairs; a device has 1 to {MAX_QUEUE_PAIRS}")]
    QueuePairs(usize),
    #[error("virtio-net: MAC {0} is a multicast address; a NIC needs a unicast one")]
    MulticastMac(String),
    #[error("virtio-net: {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
}

/// The fds the device waits on besides its doorbells, in `event_fds` order: pair 0's
/// backend, the resume eventfd and the timers keep the places they had before the device
/// had several pairs, the other pairs' backends follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    Backend(usize),
    Resume,
    RxTimer,
    TxTimer,
}

/// What a queue index is, given the features the driver accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Rx(usize),
    Tx(usize),
    Ctrl,
    Unused,
}

/// What became of the frame waiting to be received.
enum Delivery {
    Done,
    /// Dropped; any chains taken for it were returned with nothing written.
    Dropped,
    /// Not enough buffers yet; the ring's available index when that was found.
    Wait(u16),
}

/// Why a chain was refused, for the debug log.
type Fault = &'static str;

/// A stretch of guest memory a frame lies in.
pub type GuestSlice<'a> = VolatileSlice<'a, BS<'a, AtomicBitmap>>;

/// What the driver set through the control queue, kept across a snapshot or a move.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ControlState {
    /// Queue pairs in use (VQ_PAIRS_SET).
    pub pairs: u16,
    pub filter: RxFilter,
}

/// What the device keeps across a snapshot or a move besides its transport's registers.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetState {
    /// The guest's IPv4 address as its frames showed it, announced where the VM resumes.
    #[serde(default)]
    pub guest_ip: Option<Ipv4Addr>,
    /// States written before the device had a control queue have none: the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<ControlState>,
}

/// One receive and transmit queue pair's host side.
struct Pair {
    backend: Box<dyn NetBackend>,
    /// Whether the backend was last told to take frames (see [`NetBackend::set_enabled`]).
    enabled: bool,
    /// A frame read from the backend, header included, not yet in guest buffers.
    rx_buf: Vec<u8>,
    /// Length of the frame in `rx_buf`; zero when there is none.
    rx_len: usize,
    /// Whether the rate limiter already counted the frame in `rx_buf`.
    rx_paid: bool,
    /// A backend refused a frame of this pair's transmit queue with `WouldBlock`: retry on
    /// a backend's next event.
    tx_stalled: bool,
    /// The VMM polls this pair's transmit queue (see [`VirtioDevice::set_polled`]): a pass
    /// leaves the driver's doorbells off.
    tx_polled: bool,
}

/// A virtio-net device.
pub struct Net {
    pairs: Vec<Pair>,
    /// Pairs the driver uses; receive is served on these only.
    active_pairs: usize,
    filter: RxFilter,
    config: [u8; CONFIG_LEN],
    queue_size: u16,
    acked: u64,
    active: bool,
    rx_limiter: Option<RateLimiter>,
    tx_limiter: Option<RateLimiter>,
    resume: EventFd,
    events: Vec<Event>,
    counters: NetCounters,
    /// Whether transmitted frames are held for output commit, and until when.
    gate: Arc<OutputGate>,
    /// Frames held (header included), each with the epoch it was sent in, oldest first;
    /// written through pair 0's backend.
    held: VecDeque<(u64, Vec<u8>)>,
    held_bytes: usize,
    /// Most bytes `held` may reach before the guest is made to wait.
    held_limit: usize,
    guest_ip: Option<Ipv4Addr>,
}

fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A locally administered unicast MAC in QEMU's 52:54:00 range; the seed only has to make
/// two VMs on one bridge unlikely to clash.
fn generated_mac() -> [u8; 6] {
    let r = vmm_sys_util::rand::xor_pseudo_rng_u32().to_le_bytes();
    [0x52, 0x54, 0x00, r[0], r[1], r[2]]
}

fn limiter(rate: Option<RateLimit>, what: &'static str) -> Result<Option<RateLimiter>, NetError> {
    rate.map(|r| RateLimiter::new(&r).map_err(|source| NetError::Io { what, source }))
        .transpose()
}

/// Writes a frame that lies in guest memory to descriptor `fd` with one `writev`: the
/// guest's buffers go to the kernel as they are, which copies them once.
pub(crate) fn writev_guest(fd: RawFd, parts: &[GuestSlice<'_>]) -> io::Result<usize> {
    let guards: Vec<_> = parts.iter().map(|p| p.ptr_guard()).collect();
    let iovs: Vec<libc::iovec> = guards
        .iter()
        .zip(parts)
        .map(|(g, p)| libc::iovec {
            iov_base: g.as_ptr() as *mut libc::c_void,
            iov_len: p.len(),
        })
        .collect();
    let count = libc::c_int::try_from(iovs.len())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: each iovec covers one slice of guest memory that stays mapped while `guards`
    // lives (past the call); the kernel only reads it, and Rust holds no reference to it,
    // so the guest changing it meanwhile is no data race of ours.
    let n = unsafe { libc::writev(fd, iovs.as_ptr(), count) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Runs `write`, again if a signal interrupted it, a few times at most.
fn retry_interrupted(mut write: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
    let mut result = Err(io::ErrorKind::Interrupted.into());
    for _ in 0..8 {
        result = write();
        if !matches!(&result, Err(e) if e.kind() == io::ErrorKind::Interrupted) {
            break;
        }
    }
    result
}

/// Writes `frame` to `backend` (see [`retry_interrupted`]).
fn write_to(backend: &mut dyn NetBackend, frame: &[u8]) -> io::Result<usize> {
    retry_interrupted(|| backend.write_frame(&[IoSlice::new(frame)]))
}

/// Bytes of a frame read to learn the guest's address from: an Ethernet header and an
/// ARP body, more than an IPv4 header's first 16.
const SENDER_BYTES: usize = 14 + 28;

/// Copies the first `out.len()` bytes of the chain's buffers `bufs` into `out`.
fn gather(mem: &GuestMemoryMmap, bufs: &[(GuestAddress, usize)], out: &mut [u8]) -> Result<(), ()> {
    let mut at = 0;
    for &(addr, n) in bufs {
        let n = n.min(out.len() - at);
        if n == 0 {
            break;
        }
        mem.read_slice(&mut out[at..at + n], addr).map_err(|_| ())?;
        at += n;
    }
    Ok(())
}

/// The guest memory the chain's buffers `bufs` cover, in order (a buffer that crosses
/// from one memory region into the next is two); `None` if any of it is not there.
fn guest_slices<'m>(
    mem: &'m GuestMemoryMmap,
    bufs: &[(GuestAddress, usize)],
) -> Option<Vec<GuestSlice<'m>>> {
    let mut parts = Vec::with_capacity(bufs.len());
    for &(addr, n) in bufs {
        for s in mem.get_slices(addr, n, Permissions::Read).ok()? {
            parts.push(s.ok()?);
        }
    }
    Some(parts)
}

impl Net {
    pub fn new(cfg: NetConfig) -> Result<Net, NetError> {
        let backends = cfg
            .taps
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn NetBackend>)
            .collect();
        Net::with_backends(backends, cfg.mac, cfg.queue_size, cfg.rx_rate, cfg.tx_rate)
    }

    /// A device of one queue pair over any frame pipe with the TAP's framing.
    pub fn with_backend(
        backend: Box<dyn NetBackend>,
        mac: Option<[u8; 6]>,
        queue_size: u16,
        rx_rate: Option<RateLimit>,
        tx_rate: Option<RateLimit>,
    ) -> Result<Net, NetError> {
        Net::with_backends(vec![backend], mac, queue_size, rx_rate, tx_rate)
    }

    /// A device of one queue pair per backend, pair 0's first.
    pub fn with_backends(
        backends: Vec<Box<dyn NetBackend>>,
        mac: Option<[u8; 6]>,
        queue_size: u16,
        rx_rate: Option<RateLimit>,
        tx_rate: Option<RateLimit>,
    ) -> Result<Net, NetError> {
        if queue_size == 0 || queue_size > QUEUE_MAX_SIZE || !queue_size.is_power_of_two() {
            return Err(NetError::QueueSize(queue_size));
        }
        let n = backends.len();
        if n == 0 || n > usize::from(MAX_QUEUE_PAIRS) {
            return Err(NetError::QueuePairs(n));
        }
        let mac = mac.unwrap_or_else(generated_mac);
        if mac[0] & 1 != 0 {
            return Err(NetError::MulticastMac(format_mac(&mac)));
        }
        let rx_limiter = limiter(rx_rate, "receive rate limiter timer")?;
        let tx_limiter = limiter(tx_rate, "transmit rate limiter timer")?;
        let resume = EventFd::new(EFD_NONBLOCK).map_err(|source| NetError::Io {
            what: "resume eventfd",
            source,
        })?;
        let wake = resume.try_clone().map_err(|source| NetError::Io {
            what: "resume eventfd for the output gate",
            source,
        })?;
        let mut events = vec![Event::Backend(0), Event::Resume];
        if rx_limiter.is_some() {
            events.push(Event::RxTimer);
        }
        if tx_limiter.is_some() {
            events.push(Event::TxTimer);
        }
        events.extend((1..n).map(Event::Backend));
        let mut config = [0u8; CONFIG_LEN];
        config[0..6].copy_from_slice(&mac);
        config[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        config[8..10].copy_from_slice(&(n as u16).to_le_bytes());
        let pairs = backends
            .into_iter()
            .map(|backend| Pair {
                backend,
                enabled: true,
                rx_buf: vec![0; VNET_HDR_LEN + MAX_FRAME_LEN],
                rx_len: 0,
                rx_paid: false,
                tx_stalled: false,
                tx_polled: false,
            })
            .collect();
        let mut net = Net {
            pairs,
            active_pairs: n,
            filter: RxFilter::default(),
            config,
            queue_size,
            acked: 0,
            active: false,
            rx_limiter,
            tx_limiter,
            resume,
            events,
            counters: NetCounters::default(),
            gate: Arc::new(OutputGate::new(wake)),
            held: VecDeque::new(),
            held_bytes: 0,
            held_limit: DEFAULT_HELD_BYTES,
            guest_ip: None,
        };
        net.set_active_pairs(1);
        Ok(net)
    }

    /// Sets how many bytes of held frames the device keeps at most (at least one frame is
    /// always taken).
    pub fn set_held_limit(&mut self, bytes: usize) {
        self.held_limit = bytes;
    }

    /// The guest's IPv4 address, once a frame it sent has shown it.
    pub fn guest_ip(&self) -> Option<Ipv4Addr> {
        self.guest_ip
    }

    pub fn mac(&self) -> [u8; 6] {
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&self.config[0..6]);
        mac
    }

    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    /// Queue pairs the device has.
    pub fn max_pairs(&self) -> usize {
        self.pairs.len()
    }

    /// Queue pairs the driver uses now.
    pub fn active_pairs(&self) -> usize {
        self.active_pairs
    }

    fn mergeable(&self) -> bool {
        self.acked & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0
    }

    /// What queue `index` is under the features the driver accepted.
    fn role(&self, index: u16) -> Role {
        let i = usize::from(index);
        if self.ctrl_queue() == Some(i) {
            Role::Ctrl
        } else if i < 2 * self.pairs.len() {
            if i % 2 == 0 {
                Role::Rx(i / 2)
            } else {
                Role::Tx(i / 2)
            }
        } else {
            Role::Unused
        }
    }

    /// Puts the first `n` pairs in use and the others out of it: their backends told so,
    /// and a frame one of them held for the guest dropped.
    fn set_active_pairs(&mut self, n: usize) {
        for (k, pair) in self.pairs.iter_mut().enumerate() {
            let on = k < n;
            if !on && pair.rx_len != 0 {
                pair.rx_len = 0;
                pair.rx_paid = false;
                self.counters.rx_drops += 1;
            }
            if pair.enabled != on {
                if let Err(e) = pair.backend.set_enabled(on) {
                    warn!("virtio-net: queue pair {k}: enabling {on}: {e}");
                }
                pair.enabled = on;
            }
        }
        self.active_pairs = n;
    }

    /// Asks the owner to call `process_event(Resume)` soon.
    fn yield_with_work_left(&self) {
        if let Err(e) = self.resume.write(1) {
            warn!("virtio-net: resume eventfd: {e}");
        }
    }

    /// Serves pair `k`'s transmit queue: each chain's frame goes to the backend or is
    /// dropped. Returns how many chains were put on the used ring.
    fn process_tx(
        &mut self,
        k: usize,
        q: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        let index = (2 * k + 1) as u16;
        self.pairs[k].tx_stalled = false;
        self.flush_held();
        if !q.ready() {
            return Ok(0);
        }
        let mut used = 0;
        for _ in 0..TX_ROUNDS {
            let (avail, pending) = available(index, q, mem)?;
            for _ in 0..pending {
                let chain = pop(index, q, mem)?;
                let head = chain.head_index();
                if !self.transmit(k, chain, mem) {
                    // The frame stays available: the limiter's timer, the backend or the
                    // next doorbell brings the device back to it.
                    q.go_to_previous_position();
                    kick_on_next(q, mem, avail);
                    return Ok(used);
                }
                q.add_used(mem, head, 0)
                    .map_err(|e| corrupt(index, "writing used ring", e))?;
                used += 1;
            }
            let more = if self.pairs[k].tx_polled {
                available(index, q, mem)?.1 != 0
            } else {
                q.enable_notification(mem)
                    .map_err(|e| corrupt(index, "re-enabling notifications", e))?
            };
            if !more {
                return Ok(used);
            }
        }
        self.yield_with_work_left();
        Ok(used)
    }

    /// Sends one chain's frame from pair `k`'s transmit queue. False if it has to be tried
    /// again later (the chain is then not used); a malformed chain or a frame the backend
    /// refuses counts as a drop.
    fn transmit(
        &mut self,
        k: usize,
        chain: DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> bool {
        let (bufs, len) = match buffers(chain, mem, false) {
            Ok(b) => b,
            Err(why) => return self.tx_drop(why),
        };
        if len <= VNET_HDR_LEN {
            return self.tx_drop("frame no longer than the virtio-net header");
        }
        if len > VNET_HDR_LEN + MAX_FRAME_LEN {
            return self.tx_drop("frame longer than 65562 bytes");
        }
        let hold = self.gate.is_holding() || !self.held.is_empty();
        if hold && !self.held.is_empty() && self.held_bytes + len > self.held_limit {
            // Full: the chain waits, as for a backend that would block, until a release.
            self.counters.tx_held_full += 1;
            return false;
        }
        if let Some(l) = &mut self.tx_limiter {
            if !l.consume((len - VNET_HDR_LEN) as u64) {
                self.counters.tx_throttled += 1;
                return false;
            }
        }
        let mut head = [0u8; VNET_HDR_LEN + SENDER_BYTES];
        let head_len = len.min(head.len());
        if gather(mem, &bufs, &mut head[..head_len]).is_err() {
            return self.tx_drop("buffer unreadable");
        }
        let mac = self.mac();
        if let Some(ip) = sender_ipv4(&head[VNET_HDR_LEN..head_len], &mac) {
            self.guest_ip = Some(ip);
        }
        if hold {
            let mut frame = vec![0; len];
            if gather(mem, &bufs, &mut frame).is_err() {
                return self.tx_drop("buffer unreadable");
            }
            self.held.push_back((self.gate.epoch(), frame));
            self.held_bytes += len;
            self.counters.tx_held += 1;
            self.counters.tx_held_bytes += (len - VNET_HDR_LEN) as u64;
            // Behind frames already released (the gate opened): they go now, in order.
            self.flush_held();
            return true;
        }
        let Some(parts) = guest_slices(mem, &bufs) else {
            return self.tx_drop("buffer unreadable");
        };
        let backend = self.pairs[k].backend.as_mut();
        let result = retry_interrupted(|| backend.write_guest(&parts));
        match result {
            Ok(_) => {
                self.counters.tx_packets += 1;
                self.counters.tx_bytes += (len - VNET_HDR_LEN) as u64;
                true
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Some(l) = &mut self.tx_limiter {
                    l.refund((len - VNET_HDR_LEN) as u64);
                }
                self.pairs[k].tx_stalled = true;
                false
            }
            Err(e) => {
                debug!("virtio-net: backend refused a frame: {e}");
                self.counters.tx_drops += 1;
                true
            }
        }
    }

    /// Writes the held frames the gate released, oldest first, through pair 0's backend,
    /// until one is not released yet or the backend would block.
    fn flush_held(&mut self) {
        while let Some((epoch, frame)) = self.held.front() {
            if !self.gate.is_released(*epoch) {
                return;
            }
            let len = frame.len();
            match write_to(self.pairs[0].backend.as_mut(), frame) {
                Ok(_) => {
                    self.counters.tx_packets += 1;
                    self.counters.tx_bytes += (len - VNET_HDR_LEN) as u64;
                    self.counters.tx_released += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.pairs[0].tx_stalled = true;
                    return;
                }
                Err(e) => {
                    debug!("virtio-net: backend refused a released frame: {e}");
                    self.counters.tx_drops += 1;
                }
            }
            self.held.pop_front();
            self.held_bytes -= len;
        }
    }

    /// Sends a gratuitous ARP for the guest, so that bridges and neighbours learn the port
    /// the VM is reached through now.
    fn announce(&mut self) {
        let mac = self.mac();
        let ip = self.guest_ip.unwrap_or(Ipv4Addr::UNSPECIFIED);
        // Header, then the ARP padded to Ethernet's shortest frame.
        let mut frame = [0u8; VNET_HDR_LEN + 60];
        frame[VNET_HDR_LEN..VNET_HDR_LEN + 42].copy_from_slice(&gratuitous_arp(&mac, ip));
        match self.pairs[0].backend.write_frame(&[IoSlice::new(&frame)]) {
            Ok(_) => self.counters.announcements += 1,
            Err(e) => warn!("virtio-net: announcing {ip} at {}: {e}", format_mac(&mac)),
        }
    }

    fn tx_drop(&mut self, why: Fault) -> bool {
        debug!("virtio-net: transmit chain dropped: {why}");
        self.counters.tx_drops += 1;
        true
    }

    /// Moves frames from pair `k`'s backend into the guest's receive buffers on its receive
    /// queue until the backend has none, the guest has no room, the limiter says wait, or
    /// the pass's budget is spent. Returns how many chains were put on the used ring.
    fn process_rx(
        &mut self,
        k: usize,
        q: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        if !q.ready() || k >= self.active_pairs {
            return Ok(0);
        }
        let index = (2 * k) as u16;
        let mut used = 0;
        // While buffers are posted the TAP's readiness, not the driver, brings the device
        // here, so a refill needs no doorbell: each one is a VM exit. Doorbells are asked
        // for again only when the device runs out (below).
        if !q.event_idx_enabled() {
            set_no_notify(q, mem, true);
        }
        // Two passes' worth of a full ring: bounded, yet enough to drain a burst.
        for _ in 0..2 * usize::from(q.size()).max(32) {
            if self.pairs[k].rx_len == 0 {
                if !self.read_frame(k) {
                    return Ok(used);
                }
                let mac = self.mac();
                let pair = &mut self.pairs[k];
                if !self
                    .filter
                    .accepts(&mac, &pair.rx_buf[VNET_HDR_LEN..pair.rx_len])
                {
                    pair.rx_len = 0;
                    self.counters.rx_filtered += 1;
                    continue;
                }
            }
            if !self.pairs[k].rx_paid {
                if let Some(l) = &mut self.rx_limiter {
                    if !l.consume((self.pairs[k].rx_len - VNET_HDR_LEN) as u64) {
                        self.counters.rx_throttled += 1;
                        return Ok(used);
                    }
                }
                self.pairs[k].rx_paid = true;
            }
            let before = q.next_used();
            let outcome = self.deliver(k, q, mem)?;
            used += usize::from(q.next_used().wrapping_sub(before));
            match outcome {
                Delivery::Done | Delivery::Dropped => {
                    self.pairs[k].rx_len = 0;
                    self.pairs[k].rx_paid = false;
                }
                Delivery::Wait(seen) => {
                    // Ask for a doorbell on the next buffer, then look again in case one
                    // came before the request was visible.
                    if !q.event_idx_enabled() {
                        set_no_notify(q, mem, false);
                    }
                    kick_on_next(q, mem, seen);
                    let (avail, _) = available(index, q, mem)?;
                    if avail == seen {
                        return Ok(used);
                    }
                }
            }
        }
        self.yield_with_work_left();
        Ok(used)
    }

    /// Reads the next frame from pair `k`'s backend into its `rx_buf`; false if there is
    /// none now.
    fn read_frame(&mut self, k: usize) -> bool {
        // Runts are dropped and the next frame read; bounded like everything else. An empty
        // read is a runt too, not the end: a datagram backend hands one over and still holds
        // the frames behind it, which no edge would report again.
        let mut empty = 0;
        for _ in 0..64 {
            let pair = &mut self.pairs[k];
            match pair.backend.read_frame(&mut pair.rx_buf) {
                Ok(n) if n <= VNET_HDR_LEN => {
                    debug!(len = n, "virtio-net: frame from the backend without data");
                    self.counters.rx_drops += 1;
                    empty += usize::from(n == 0);
                }
                Ok(n) => {
                    pair.rx_len = n;
                    return true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) => {
                    warn!("virtio-net: reading from the backend: {e}");
                    return false;
                }
            }
        }
        // More may be queued, and an edge-triggered watch would not say so again; a backend
        // that reads nothing but empty frames is at its end, and is not polled forever.
        if empty < 64 {
            self.yield_with_work_left();
        }
        false
    }

    /// Puts the frame in pair `k`'s `rx_buf` into guest receive buffers: one chain, or with
    /// MRG_RXBUF as many as it takes, `num_buffers` saying how many.
    fn deliver(
        &mut self,
        k: usize,
        q: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<Delivery, QueueCorrupt> {
        let index = (2 * k) as u16;
        let frame_len = self.pairs[k].rx_len;
        let (avail, pending) = available(index, q, mem)?;
        let mut taken: Vec<(u16, Vec<(GuestAddress, usize)>)> = Vec::new();
        let mut room = 0usize;
        let mut fault = None;
        while room < frame_len {
            if taken.len() == usize::from(pending) {
                for _ in 0..taken.len() {
                    q.go_to_previous_position();
                }
                if pending < q.size() {
                    return Ok(Delivery::Wait(avail));
                }
                // A full ring that cannot hold the frame never will.
                return Ok(self.rx_drop("frame larger than every posted buffer together"));
            }
            let chain = pop(index, q, mem)?;
            let head = chain.head_index();
            match buffers(chain, mem, true) {
                Ok((bufs, len)) if len >= VNET_HDR_LEN => {
                    taken.push((head, bufs));
                    room = room.saturating_add(len);
                }
                Ok(_) => {
                    taken.push((head, Vec::new()));
                    fault = Some("receive chain smaller than the virtio-net header");
                    break;
                }
                Err(why) => {
                    taken.push((head, Vec::new()));
                    fault = Some(why);
                    break;
                }
            }
            if !self.mergeable() {
                break;
            }
        }
        if fault.is_none() && room < frame_len {
            // Without MRG_RXBUF a frame goes in one chain; this one stays for the next frame.
            q.go_to_previous_position();
            return Ok(self.rx_drop("frame larger than the receive chain"));
        }
        let num_buffers = taken.len() as u16;
        let rx_buf = &mut self.pairs[k].rx_buf;
        rx_buf[NUM_BUFFERS_OFFSET..VNET_HDR_LEN].copy_from_slice(&num_buffers.to_le_bytes());
        let mut lens = vec![0u32; taken.len()];
        if fault.is_none() {
            let mut at = 0;
            'chains: for (c, (_, bufs)) in taken.iter().enumerate() {
                for &(addr, n) in bufs {
                    let n = n.min(frame_len - at);
                    if n == 0 {
                        break 'chains;
                    }
                    if mem.write_slice(&rx_buf[at..at + n], addr).is_err() {
                        fault = Some("receive buffer unwritable");
                        break 'chains;
                    }
                    at += n;
                    lens[c] += n as u32;
                }
            }
        }
        if fault.is_some() {
            lens.fill(0);
        }
        for (&(head, _), &len) in taken.iter().zip(&lens) {
            q.add_used(mem, head, len)
                .map_err(|e| corrupt(index, "writing used ring", e))?;
        }
        Ok(match fault {
            Some(why) => self.rx_drop(why),
            None => {
                self.counters.rx_packets += 1;
                self.counters.rx_bytes += (frame_len - VNET_HDR_LEN) as u64;
                Delivery::Done
            }
        })
    }

    fn rx_drop(&mut self, why: Fault) -> Delivery {
        debug!("virtio-net: received frame dropped: {why}");
        self.counters.rx_drops += 1;
        Delivery::Dropped
    }

    /// Serves the control queue (queue `index`): each command is carried out or refused,
    /// and its ack written. Returns how many chains were put on the used ring.
    fn process_ctrl(
        &mut self,
        index: u16,
        q: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        if !q.ready() {
            return Ok(0);
        }
        let mut used = 0;
        for _ in 0..TX_ROUNDS {
            used += serve_available(index, q, mem, |chain| self.control(chain, mem))?;
            // With EVENT_IDX the driver rings again only past the avail_event written here.
            let more = q
                .enable_notification(mem)
                .map_err(|e| corrupt(index, "re-enabling notifications", e))?;
            if !more {
                return Ok(used);
            }
        }
        self.yield_with_work_left();
        Ok(used)
    }

    /// The control queue's index, if the driver took it.
    fn ctrl_queue(&self) -> Option<usize> {
        if self.acked & CTRL_VQ == 0 {
            None
        } else if self.acked & MQ != 0 {
            Some(2 * self.pairs.len())
        } else {
            Some(2)
        }
    }

    /// Carries out one control command; returns the bytes written to the guest (the ack,
    /// or nothing when the chain has nowhere to put one).
    fn control(&mut self, chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> u32 {
        self.counters.ctrl_commands += 1;
        let (command, ack) = control_parts(chain, mem);
        let outcome = match (command, ack) {
            (Err(why), _) => Err(why),
            (Ok(_), None) => Err("no device-writable byte for the ack"),
            (Ok(bytes), Some(_)) => decode(&bytes, self.acked, self.pairs.len() as u16),
        };
        let status = match outcome {
            Ok(command) => {
                self.apply(command);
                VIRTIO_NET_OK
            }
            Err(why) => {
                debug!("virtio-net: control command refused: {why}");
                self.counters.ctrl_errors += 1;
                VIRTIO_NET_ERR
            }
        } as u8;
        match ack {
            Some(at) if mem.write_obj(status, at).is_ok() => 1,
            _ => 0,
        }
    }

    fn apply(&mut self, command: Command) {
        match command {
            Command::Promisc(on) => self.filter.promisc = on,
            Command::AllMulti(on) => self.filter.allmulti = on,
            Command::MacTable { unicast, multicast } => self.filter.set_tables(unicast, multicast),
            Command::QueuePairs(n) => {
                self.set_active_pairs(usize::from(n));
                // Frames may wait in the backends just put in use; no new edge would say so.
                self.yield_with_work_left();
            }
        }
    }
}

/// The device-readable bytes of a control chain (class, command, data; at most
/// [`CTRL_MAX_LEN`]) and where its ack goes: the first device-writable byte. The readable
/// part comes first and the writable part after it, every buffer in guest memory; a chain
/// that breaks that has its bytes refused, and still gets an ack if it has a place for one.
fn control_parts(
    chain: DescriptorChain<&GuestMemoryMmap>,
    mem: &GuestMemoryMmap,
) -> (Result<Vec<u8>, Fault>, Option<GuestAddress>) {
    let mut readable: Vec<(GuestAddress, usize)> = Vec::new();
    let mut total = 0usize;
    let mut ack = None;
    let mut fault = None;
    let mut last_has_next = false;
    for (k, d) in chain.enumerate() {
        if k == MAX_CHAIN_DESCRIPTORS {
            fault.get_or_insert("chain longer than 512 descriptors");
            last_has_next = false;
            break;
        }
        last_has_next = d.has_next();
        let len = d.len() as usize;
        let access = if d.is_write_only() {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if len == 0 {
            fault.get_or_insert("zero-length descriptor");
            continue;
        }
        if d.addr().0.checked_add(len as u64).is_none() || !mem.check_range(d.addr(), len, access) {
            fault.get_or_insert("buffer outside guest memory");
            continue;
        }
        if d.is_write_only() {
            ack.get_or_insert(d.addr());
        } else if ack.is_some() {
            fault.get_or_insert("device-readable descriptor after a device-writable one");
        } else {
            total = total.saturating_add(len);
            if total > CTRL_MAX_LEN {
                fault.get_or_insert("command longer than 16 KiB");
            } else {
                readable.push((d.addr(), len));
            }
        }
    }
    if last_has_next {
        fault.get_or_insert("broken or looping chain");
    }
    if let Some(why) = fault {
        return (Err(why), ack);
    }
    let mut bytes = vec![0u8; total];
    let mut at = 0;
    for (addr, n) in readable {
        if mem.read_slice(&mut bytes[at..at + n], addr).is_err() {
            return (Err("command unreadable"), ack);
        }
        at += n;
    }
    (Ok(bytes), ack)
}

/// Without EVENT_IDX, sets or clears `VRING_USED_F_NO_NOTIFY` in the used ring's flags
/// (virtio 1.x, 2.7.7): the driver skips its doorbell while the flag is set.
fn set_no_notify(q: &Queue, mem: &GuestMemoryMmap, on: bool) {
    let flags: u16 = if on { VRING_USED_F_NO_NOTIFY as u16 } else { 0 };
    if let Err(e) = mem.write_obj(flags.to_le(), GuestAddress(q.used_ring())) {
        debug!("virtio-net: writing used flags: {e}");
    }
    fence(Ordering::SeqCst);
}

/// With EVENT_IDX, asks the driver to notify once the available index moves past `avail`
/// (virtio-queue's `enable_notification` would ask from `next_avail`, which a device that
/// left chains on the ring has already passed).
fn kick_on_next(q: &Queue, mem: &GuestMemoryMmap, avail: u16) {
    if !q.event_idx_enabled() {
        return;
    }
    let at = q.used_ring() + 4 + 8 * u64::from(q.size());
    if let Err(e) = mem.write_obj(avail.to_le(), GuestAddress(at)) {
        debug!("virtio-net: writing avail_event: {e}");
    }
    fence(Ordering::SeqCst);
}

/// The guest buffers of a chain, all of which must go one way (device-writable for
/// receive, device-readable for transmit), with their total length. Every descriptor is
/// checked to lie in guest memory; an empty one, a broken or over-long chain is refused.
pub(crate) fn buffers(
    chain: DescriptorChain<&GuestMemoryMmap>,
    mem: &GuestMemoryMmap,
    writable: bool,
) -> Result<(Vec<(GuestAddress, usize)>, usize), Fault> {
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut last_has_next = false;
    for (k, d) in chain.enumerate() {
        if k == MAX_CHAIN_DESCRIPTORS {
            return Err("chain longer than 512 descriptors");
        }
        last_has_next = d.has_next();
        if d.is_write_only() != writable {
            return Err(if writable {
                "device-readable descriptor in a receive chain"
            } else {
                "device-writable descriptor in a transmit chain"
            });
        }
        let len = d.len() as usize;
        if len == 0 {
            return Err("zero-length descriptor");
        }
        let access = if writable {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if d.addr().0.checked_add(len as u64).is_none() || !mem.check_range(d.addr(), len, access) {
            return Err("buffer outside guest memory");
        }
        out.push((d.addr(), len));
        // Bounded by MAX_CHAIN_DESCRIPTORS descriptors of at most 4 GiB each.
        total = total.saturating_add(len);
    }
    // The iterator stops quietly on a bad index, an unreadable table or a loop; a last
    // descriptor still asking for a successor is how that shows.
    if last_has_next {
        return Err("broken or looping chain");
    }
    if out.is_empty() {
        return Err("empty chain");
    }
    Ok((out, total))
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    /// Two per pair and the control queue.
    fn num_queues(&self) -> usize {
        2 * self.pairs.len() + 1
    }

    fn queue_max_size(&self) -> u16 {
        self.queue_size
    }

    fn features(&self) -> u64 {
        if self.pairs.len() > 1 {
            NET_FEATURES | MQ
        } else {
            NET_FEATURES
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn activate(&mut self, acked_features: u64) {
        self.acked = acked_features;
        self.active = true;
        let flags = offload_flags(acked_features);
        for pair in &mut self.pairs {
            if let Err(e) = pair.backend.set_offload(flags) {
                warn!("virtio-net: passing the guest's offloads to the backend: {e}");
            }
        }
        // Frames may have queued before the driver was ready; no new edge would report them.
        self.yield_with_work_left();
    }

    /// Held frames stay: the guest saw them sent. The filter and the pairs in use go back
    /// to their defaults.
    fn reset(&mut self) {
        for pair in &mut self.pairs {
            if pair.rx_len != 0 {
                self.counters.rx_drops += 1;
            }
            pair.rx_len = 0;
            pair.rx_paid = false;
            pair.tx_stalled = false;
        }
        self.acked = 0;
        self.active = false;
        self.filter = RxFilter::default();
        self.set_active_pairs(1);
    }

    /// The VM resumes elsewhere (a standby taking over, a migration, a snapshot restored):
    /// the network is told where the guest is now.
    fn transport_reset(&mut self) {
        self.announce();
    }

    /// Seals the held output at this point (see [`crate::net::output_gate`]).
    fn save_state(&self) -> Option<DeviceState> {
        self.gate.seal();
        Some(DeviceState::Net(NetState {
            guest_ip: self.guest_ip,
            control: Some(ControlState {
                pairs: self.active_pairs as u16,
                filter: self.filter.clone(),
            }),
        }))
    }

    fn restore_state(&mut self, state: &DeviceState) {
        let DeviceState::Net(s) = state;
        self.guest_ip = s.guest_ip;
        let control = s.control.clone().unwrap_or(ControlState {
            pairs: 1,
            filter: RxFilter::default(),
        });
        // A state file is checked as if the guest had written it: tables longer than the
        // device keeps take every address of their kind, the pairs are 1 to the device's.
        let mut filter = control.filter;
        let (unicast, multicast) = (
            std::mem::take(&mut filter.unicast),
            std::mem::take(&mut filter.multicast),
        );
        let (all_unicast, all_multicast) = (filter.all_unicast, filter.all_multicast);
        filter.set_tables(unicast, multicast);
        filter.all_unicast |= all_unicast;
        filter.all_multicast |= all_multicast;
        self.filter = filter;
        let pairs = usize::from(control.pairs).clamp(1, self.pairs.len());
        self.set_active_pairs(pairs);
    }

    fn output_gate(&self) -> Option<Arc<OutputGate>> {
        Some(self.gate.clone())
    }

    fn flush_output(&mut self) -> bool {
        self.flush_held();
        self.held
            .front()
            .is_some_and(|(epoch, _)| self.gate.is_released(*epoch))
    }

    fn captured_output(&self) -> Vec<Vec<u8>> {
        self.held
            .iter()
            .filter(|(epoch, _)| self.gate.in_last_capture(*epoch))
            .map(|(_, frame)| frame.clone())
            .collect()
    }

    /// The frames join the held queue as free to go (no epoch is before the first), so
    /// `flush_held` writes them in order, and what the backend cannot take now goes before
    /// the guest's own frames later.
    fn send_frames(&mut self, frames: Vec<Vec<u8>>) -> usize {
        let mut taken = 0;
        for frame in frames {
            if frame.len() <= VNET_HDR_LEN || frame.len() > VNET_HDR_LEN + MAX_FRAME_LEN {
                self.counters.tx_drops += 1;
                continue;
            }
            self.held_bytes += frame.len();
            self.held.push_back((0, frame));
            taken += 1;
        }
        self.flush_held();
        taken
    }

    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        if !self.active {
            return Ok(0);
        }
        match self.role(index) {
            Role::Rx(k) => {
                self.counters.rx_notifications += 1;
                self.process_rx(k, queue, mem)
            }
            Role::Tx(k) => {
                self.counters.tx_notifications += 1;
                self.process_tx(k, queue, mem)
            }
            Role::Ctrl => self.process_ctrl(index, queue, mem),
            Role::Unused => Ok(0),
        }
    }

    fn pollable(&self, index: u16) -> bool {
        matches!(self.role(index), Role::Tx(_))
    }

    fn set_polled(&mut self, index: u16, on: bool) {
        if let Role::Tx(k) = self.role(index) {
            self.pairs[k].tx_polled = on;
        }
    }

    /// Pair k's queues, and its backend below, go to lane k; the control queue and the
    /// device-wide events (its resume eventfd, the limiters' timers) to lane 0.
    fn queue_lane(&self, index: u16) -> usize {
        let i = usize::from(index);
        if i < 2 * self.pairs.len() {
            i / 2
        } else {
            0
        }
    }

    fn event_lane(&self, index: usize) -> usize {
        match self.events.get(index) {
            Some(Event::Backend(k)) => *k,
            _ => 0,
        }
    }

    fn event_fds(&self) -> Vec<RawFd> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::Backend(k) => Some(self.pairs[*k].backend.raw_fd()),
                Event::Resume => Some(self.resume.as_raw_fd()),
                Event::RxTimer => self.rx_limiter.as_ref().map(|l| l.timer_fd()),
                Event::TxTimer => self.tx_limiter.as_ref().map(|l| l.timer_fd()),
            })
            .collect()
    }

    fn process_event(
        &mut self,
        index: usize,
        queues: &mut [Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<Vec<u16>, QueueCorrupt> {
        let Some(&event) = self.events.get(index) else {
            debug!(index, "virtio-net: event the device does not have");
            return Ok(Vec::new());
        };
        let n = self.pairs.len();
        // Which pairs' receive queues to serve, and whether the transmit queues are served:
        // all of them, or (`stalled`) those a full backend stopped.
        let mut ctrl = None;
        let (rx, tx, stalled) = match event {
            Event::Backend(k) => (k..k + 1, true, true),
            Event::Resume => {
                // Non-blocking: nothing to read after a spurious wake-up, which is fine.
                let _ = self.resume.read();
                // A control queue pass that stopped early continues here too.
                ctrl = self.ctrl_queue();
                (0..n, true, false)
            }
            Event::RxTimer => {
                if let Some(l) = &mut self.rx_limiter {
                    l.on_timer();
                }
                (0..n, false, false)
            }
            Event::TxTimer => {
                if let Some(l) = &mut self.tx_limiter {
                    l.on_timer();
                }
                (0..0, true, false)
            }
        };
        let mut served = Vec::new();
        if !self.active {
            // Released frames go even while the driver resets the device.
            self.flush_held();
            return Ok(served);
        }
        for k in rx {
            let Some(q) = queues.get_mut(2 * k) else {
                break;
            };
            if self.role((2 * k) as u16) == Role::Rx(k) && self.process_rx(k, q, mem)? > 0 {
                served.push((2 * k) as u16);
            }
        }
        if tx {
            for k in 0..n {
                if stalled && !self.pairs[k].tx_stalled {
                    continue;
                }
                let Some(q) = queues.get_mut(2 * k + 1) else {
                    break;
                };
                if self.process_tx(k, q, mem)? > 0 {
                    served.push((2 * k + 1) as u16);
                }
            }
        }
        if let Some(i) = ctrl {
            if let Some(q) = queues.get_mut(i) {
                if self.process_ctrl(i as u16, q, mem)? > 0 {
                    served.push(i as u16);
                }
            }
        }
        Ok(served)
    }

    fn stats(&self) -> VirtioStats {
        let c = &self.counters;
        VirtioStats {
            requests: c.rx_packets + c.tx_packets,
            bytes_read: c.rx_bytes,
            bytes_written: c.tx_bytes,
            flushes: 0,
            errors: c.rx_drops + c.tx_drops,
            interrupts: 0,
        }
    }

    fn net_counters(&self) -> Option<NetCounters> {
        Some(self.counters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_backend() -> (Box<dyn NetBackend>, std::os::unix::net::UnixDatagram) {
        let (b, peer) = crate::virtio::driver::SocketBackend::pair();
        (Box::new(b), peer)
    }

    /// A transmitted frame is written straight from guest memory: one that crosses from
    /// one memory region into the next goes as one frame, its bytes in order, and one that
    /// runs past guest memory is not written at all.
    #[test]
    fn a_frame_across_two_memory_regions_is_written_whole_from_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
        ])
        .unwrap();
        let frame: Vec<u8> = (0..0x300u32).map(|i| (i * 7 % 251) as u8).collect();
        mem.write_slice(&frame[..0x100], GuestAddress(0x100))
            .unwrap();
        mem.write_slice(&frame[0x100..], GuestAddress(0xf00))
            .unwrap();
        // Two descriptors: the header and the first bytes, then the rest, across regions.
        let bufs = [(GuestAddress(0x100), 0x100), (GuestAddress(0xf00), 0x200)];
        let parts = guest_slices(&mem, &bufs).unwrap();
        assert_eq!(
            parts.len(),
            3,
            "the second buffer is a slice of each region"
        );
        let (mut backend, peer) = socket_backend();
        assert_eq!(backend.write_guest(&parts).unwrap(), frame.len());
        let mut got = vec![0u8; 0x1000];
        let n = peer.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &frame[..], "one datagram, the frame in order");
        let mut head = [0u8; 0x180];
        gather(&mem, &bufs, &mut head).unwrap();
        assert_eq!(&head[..], &frame[..0x180]);
        assert!(guest_slices(&mem, &[(GuestAddress(0x1f00), 0x200)]).is_none());
    }

    #[test]
    fn queue_sizes_must_be_powers_of_two_within_the_transports_limit() {
        for size in [0u16, 3, 512] {
            let (b, _peer) = socket_backend();
            let e = Net::with_backend(b, None, size, None, None).err().unwrap();
            assert!(e.to_string().contains(&format!("queue size {size}")), "{e}");
        }
        let (b, _peer) = socket_backend();
        assert_eq!(
            Net::with_backend(b, None, 64, None, None)
                .unwrap()
                .queue_max_size(),
            64
        );
    }

    #[test]
    fn the_mac_is_the_given_one_or_a_local_unicast_one() {
        let (b, _peer) = socket_backend();
        let e = Net::with_backend(b, Some([1, 2, 3, 4, 5, 6]), 256, None, None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("01:02:03:04:05:06"), "{e}");
        let (b, _peer) = socket_backend();
        let n = Net::with_backend(b, None, 256, None, None).unwrap();
        let mac = n.mac();
        assert_eq!(mac[..3], [0x52, 0x54, 0x00]);
        assert_eq!(mac[0] & 0b11, 0b10, "locally administered unicast");
        let mut cfg = [0u8; 10];
        n.read_config(0, &mut cfg);
        assert_eq!(cfg[..6], mac);
        assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1, "link up");
        assert_eq!(u16::from_le_bytes([cfg[8], cfg[9]]), 1, "one queue pair");
    }

    #[test]
    fn rate_limiter_timers_are_event_sources() {
        let limit = RateLimit {
            bandwidth: Some(crate::net::TokenBucketConfig {
                size: 1000,
                refill_time_ms: 100,
                one_time_burst: 0,
            }),
            ops: None,
        };
        let (b, _peer) = socket_backend();
        let fd = b.raw_fd();
        let n = Net::with_backend(b, None, 256, None, None).unwrap();
        assert_eq!(n.event_fds().len(), 2);
        assert_eq!(n.event_fds()[0], fd);
        let (b, _peer) = socket_backend();
        let n = Net::with_backend(b, None, 256, Some(limit), Some(limit)).unwrap();
        assert_eq!(n.event_fds().len(), 4);
    }
}
