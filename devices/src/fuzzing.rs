//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the seeded smoke tests: each
//! plays arbitrary bytes as a hostile guest against one virtio device over mock guest memory
//! and checks what must hold whatever the guest does.
//!
//! The bytes are a script of guest actions (register reads and writes of any width, bytes and
//! descriptors written into guest memory, chains published, queues notified, the device reset
//! and renegotiated). Checked on every notification: the device puts on the used ring only
//! chains that were available, in order, each with a used length no larger than the
//! device-writable bytes of its chain. Checked at the end: the device still answers its
//! registers, and after a reset it serves a well-formed request. A panic anywhere is a finding
//! too; an access outside guest memory shows as a vm-memory error (or, under the fuzzer's
//! address sanitizer, as a crash). Each entry point returns the first broken rule.

use crate::net::rate_limiter::{ManualClock, RateLimit, RateLimiter, TokenBucketConfig};
use crate::net::tap::VNET_HDR_LEN;
use crate::virtio::block::{Block, BlockConfig, CacheMode, SECTOR_SIZE};
use crate::virtio::driver::{
    Desc, Driver, NetRings, Ring, SocketBackend, DATA, HDR, INDIRECT, MEM_SIZE, QSIZE, RING, STATUS,
};
use crate::virtio::mmio::{MMIO_MAGIC, MMIO_SIZE, MMIO_VERSION};
use crate::virtio::net::{Net, MAX_FRAME_LEN};
use crate::virtio::pmem::{Pmem, VIRTIO_PMEM_RESP_OK};
use crate::virtio::rng::Rng as VirtioRng;
use crate::GuestMemoryMmap;
use dsm::rng::Rng;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_CTRL_RX, VIRTIO_NET_CTRL_RX_PROMISC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF,
    VIRTIO_NET_OK,
};
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::desc::split::{Descriptor, VirtqUsedElem};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

/// A hole in the mock guest memory, so buffers can straddle two regions or end in nothing.
const HOLE: (u64, u64) = (0x40_0000, 0x41_0000);
/// Actions played per input at most; inputs are short anyway, this only bounds the work.
const MAX_ACTIONS: usize = 512;
/// Passes without a used receive buffer after which a host program's CONNECT counts as lost:
/// one to accept it, one to read its line, one to send the REQUEST, one to spare.
const ALIVE_IDLE_PASSES: usize = 4;
/// Descriptors followed when bounding a chain: more than any device walks (virtio-blk stops
/// at 1024), so the bound covers every prefix a device may serve.
const MAX_WALK: usize = 4096;
/// Disk of the virtio-blk target: small, so sectors near its end are easy to hit.
const DISK_SECTORS: u64 = 64;

/// Registers a driver uses, so most register actions hit one rather than a hole.
const REGISTERS: [u32; 24] = [
    VIRTIO_MMIO_MAGIC_VALUE,
    VIRTIO_MMIO_VERSION,
    VIRTIO_MMIO_DEVICE_ID,
    VIRTIO_MMIO_DEVICE_FEATURES,
    VIRTIO_MMIO_DEVICE_FEATURES_SEL,
    VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL,
    VIRTIO_MMIO_QUEUE_SEL,
    VIRTIO_MMIO_QUEUE_NUM_MAX,
    VIRTIO_MMIO_QUEUE_NUM,
    VIRTIO_MMIO_QUEUE_READY,
    VIRTIO_MMIO_QUEUE_NOTIFY,
    VIRTIO_MMIO_INTERRUPT_STATUS,
    VIRTIO_MMIO_INTERRUPT_ACK,
    VIRTIO_MMIO_STATUS,
    VIRTIO_MMIO_QUEUE_DESC_LOW,
    VIRTIO_MMIO_QUEUE_DESC_HIGH,
    VIRTIO_MMIO_QUEUE_AVAIL_LOW,
    VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
    VIRTIO_MMIO_QUEUE_USED_LOW,
    VIRTIO_MMIO_QUEUE_USED_HIGH,
    VIRTIO_MMIO_SHM_SEL,
    VIRTIO_MMIO_CONFIG_GENERATION,
    VIRTIO_MMIO_CONFIG,
];

/// A rule the device broke, or (`Net`, `Io`, `NoDisk`) a device the run could not build,
/// before anything was checked.
#[derive(Debug, thiserror::Error)]
pub enum Finding {
    #[error(transparent)]
    Net(#[from] crate::virtio::net::NetError),
    /// A scratch disk image could not be made.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("no disk for the virtio-blk target: {0}")]
    NoDisk(#[source] crate::virtio::block::BlockError),
    #[error("flush after reset answered {got}, not {want}")]
    FlushAnswer { got: u32, want: u32 },
    #[error("magic {magic:#x}, version {version} after the script")]
    Identity { magic: u32, version: u32 },
    #[error("the device sent a frame of {0} bytes")]
    FrameLength(usize),
    #[error("a frame reached the backend while the output gate held and released nothing")]
    HeldFrameSent,
    #[error("{released} held frames released of {held} held")]
    HeldCount { held: u64, released: u64 },
    #[error(transparent)]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("frame sent after reset arrived as {0:?}")]
    SentFrame(std::io::Result<usize>),
    #[error("backend full after reset: {0}")]
    BackendFull(#[source] std::io::Error),
    #[error("a frame from the host end after reset never reached the guest")]
    FrameLost,
    #[error("a control command after reset was answered {0:?}, not VIRTIO_NET_OK")]
    ControlAnswer(Option<(u8, u32)>),
    #[error("a 16-byte read after reset got {got:?} bytes, not {want}")]
    RngRead { got: Option<u32>, want: u32 },
    #[error(transparent)]
    Vsock(#[from] crate::virtio::vsock::VsockError),
    #[error("a host program's CONNECT after reset never reached the guest")]
    VsockRequestLost,
    #[error("queue {index}: {served} used entries for {available} available chains")]
    TooManyUsed {
        index: u32,
        served: u16,
        available: usize,
    },
    #[error("queue {index}: used element {slot} unreadable: {source}")]
    UsedUnreadable {
        index: u32,
        slot: u16,
        source: vm_memory::GuestMemoryError,
    },
    #[error("queue {index}: used entry {k} is chain {id}, but chain {head} was next")]
    OutOfOrder {
        index: u32,
        k: usize,
        id: u32,
        head: u16,
    },
    #[error(
        "queue {index}: chain {head} used with length {len}, but its writable buffers hold \
         {bound} bytes"
    )]
    TooLong {
        index: u32,
        head: u16,
        len: u32,
        bound: u64,
    },
}

/// The virtio-mmio transport from power-on: feature negotiation, queue registers and
/// notifications in any order, with a virtio-pmem device behind it (it does no host I/O, so
/// the run is all transport).
pub fn mmio_transport(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let fail_flush = script.byte() & 1 == 1;
    let mut d = Driver::new_in(pmem(fail_flush), memory());
    play(&mut d, &mut script)?;
    pmem_alive(&mut d, fail_flush)
}

/// virtio-blk requests on a live queue: header, data and status descriptors of any shape,
/// direct and indirect, on a small disk (write-back or `O_DIRECT`, writable or read-only).
pub fn virtio_blk(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let mode = script.byte();
    let readonly = mode & 1 == 1;
    let direct = mode & 2 == 2;
    let block = disk(readonly, direct)?;
    let mut d = Driver::new_in(block, memory());
    d.bring_up(u32::from(QSIZE));
    play(&mut d, &mut script)?;
    finish(&mut d)?;
    d.restart();
    d.alive();
    Ok(())
}

/// virtio-pmem requests on a live queue, the host flush succeeding or failing.
pub fn virtio_pmem(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let fail_flush = script.byte() & 1 == 1;
    let mut d = Driver::new_in(pmem(fail_flush), memory());
    d.bring_up(u32::from(QSIZE));
    play(&mut d, &mut script)?;
    pmem_alive(&mut d, fail_flush)
}

/// virtio-rng requests on a live queue: chains of any shape, direct and indirect, with the
/// device unlimited or (first byte's bit 0) limited to a rate from the second byte, on a
/// clock the script moves; action 6 moves it and fires the limiter's timer. After a reset,
/// a read is served.
pub fn virtio_rng(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let limited = script.byte() & 1 == 1;
    let rate = 1 + u64::from(script.byte()) * 64;
    let clock = ManualClock::default();
    let limiter = if limited {
        let limit = RateLimit {
            bandwidth: Some(TokenBucketConfig {
                size: rate,
                refill_time_ms: 1000,
                one_time_burst: 0,
            }),
            ops: None,
        };
        Some(RateLimiter::with_clock(&limit, Box::new(clock.clone()))?)
    } else {
        None
    };
    let source = Box::new(|buf: &mut [u8]| {
        buf.fill(0xa5);
        Ok(())
    });
    let rng = VirtioRng::with_parts(source, limiter, limited.then_some(rate));
    let mut d = Driver::new_in(rng, memory());
    d.bring_up(u32::from(QSIZE));
    each_action(&mut d, &mut script, |d, s, op| {
        if op != 6 {
            return one_queue_action(d, s, op);
        }
        clock.advance(std::time::Duration::from_millis(u64::from(s.u16())));
        checked(d, &[0], |d| d.t.process_event(0))
    })?;
    finish(&mut d)?;
    d.restart();
    clock.advance(std::time::Duration::from_secs(2));
    let want = if limited { rate.min(16) as u32 } else { 16 };
    d.submit(&[(DATA, 16, VRING_DESC_F_WRITE as u16)]);
    match d.used_idx() == d.used_seen {
        true => Err(Finding::RngRead { got: None, want }),
        false => match d.next_used() {
            (0, got) if got == want => Ok(()),
            (_, got) => Err(Finding::RngRead {
                got: Some(got),
                want,
            }),
        },
    }
}

/// Valid scripts for the smoke test: a read into one buffer, into three, and (limited to
/// 65 bytes a second) two reads with the clock moved between them.
pub fn virtio_rng_samples() -> Vec<Vec<u8>> {
    // After the mode and rate bytes, action 7: a chain of 1 + N parts, each an address (base
    // 1 is DATA, then an offset), a length (kind 0: one byte), flags (2: writable) and a
    // next index (ignored: the chain is linked in order).
    let part = |off: u8, len: u8| vec![1, off, 0, len, 2, 0];
    let one = [vec![0, 0, 7, 0], part(0, 64)].concat();
    let three = [vec![0, 0, 7, 2], part(0, 8), part(16, 8), part(32, 200)].concat();
    let paced = [
        vec![1, 1, 7, 0],
        part(0, 100),
        vec![7, 0],
        part(0, 100),
        vec![6, 0xe8, 0x03],
    ]
    .concat();
    vec![one, three, paced]
}

/// virtio-net from both ends, over two queue pairs and the control queue: the guest posts
/// receive buffers and frames to send in chains of any shape on any queue, sends control
/// commands (well-formed or not), the host end injects frames of any length (runts to
/// over-long) on either pair's backend and drains what the device sent, the device's
/// events (a backend readable, resume) fire at any time, and the VMM's poller turns the
/// transmit queues' doorbells off and on and looks at them. The first byte picks the features:
/// bit 0 drops MRG_RXBUF, bit 1 drops EVENT_IDX, bit 3 drops MQ (the control queue then is
/// queue 2). Every notification and event is checked on every queue; at the end, after a
/// reset, a frame must go each way and a control command be answered.
pub fn virtio_net(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let mode = script.byte();
    let mut drop_bits = 0;
    if mode & 1 != 0 {
        drop_bits |= 1 << VIRTIO_NET_F_MRG_RXBUF;
    }
    if mode & 2 != 0 {
        drop_bits |= 1 << VIRTIO_RING_F_EVENT_IDX;
    }
    if mode & 8 != 0 {
        drop_bits |= 1 << VIRTIO_NET_F_MQ;
    }
    let (backend, peer) = SocketBackend::pair();
    let (backend1, peer1) = SocketBackend::pair();
    let net = Net::with_backends(
        vec![Box::new(backend), Box::new(backend1)],
        None,
        256,
        None,
        None,
    )?;
    let mut d = Driver::new_in(net, memory());
    let mut rings = d.net_up_pairs(drop_bits, NET_PAIRS);
    // Mode bit 2: the VM is replicated, its output held from the start; the script's event
    // actions then also seal, release and open the gate.
    let gate = d.t.output_gate().expect("virtio-net has an output gate");
    let held = mode & 4 != 0;
    if held {
        gate.hold();
    }
    play_net(&mut d, &mut rings, [&peer, &peer1], held, &mut script)?;
    finish(&mut d)?;
    // Replication over: what is held goes (the backend drained as it fills), then the
    // device must work as before.
    gate.open();
    let mut buf = vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN + 64];
    for _ in 0..64 {
        d.t.flush_output();
        while peer.recv(&mut buf).is_ok() {}
    }
    while peer1.recv(&mut buf).is_ok() {}
    let c = d.t.net_counters().unwrap_or_default();
    if c.tx_released > c.tx_held {
        return Err(Finding::HeldCount {
            held: c.tx_held,
            released: c.tx_released,
        });
    }
    net_alive(&mut d, &peer)?;
    net_control_alive(&mut d)
}

/// virtio-vsock from both ends: the guest posts receive buffers and packets of any header
/// (cids, ops, lengths) in chains of any shape, host programs connect to the device's
/// socket and send CONNECT lines, garbage or data, and the device's event fires at any
/// time. Every notification and event is checked on the receive and transmit queues; at
/// the end, after a reset, a host program's CONNECT must reach the guest as a REQUEST.
pub fn virtio_vsock(data: &[u8]) -> Result<(), Finding> {
    let mut script = Script(data);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("v.sock");
    let vsock = crate::virtio::vsock::Vsock::new(VSOCK_CID, &path)?;
    let mut d = Driver::new_in(vsock, memory());
    let (mut rx, mut tx, _ev) = d.vsock_up();
    let mut clients = Vec::new();
    play_vsock(&mut d, [&mut rx, &mut tx], &path, &mut clients, &mut script)?;
    finish(&mut d)?;
    drop(clients);
    vsock_alive(&mut d, &path)
}

/// Valid scripts for the smoke test: a host program's CONNECT answered by the guest, then
/// data each way; a guest REQUEST to a port nobody listens on.
pub fn virtio_vsock_samples() -> Vec<Vec<u8>> {
    let post_rx = |k: u8| vec![7, 0, k, 0, 1, k, 0, 0, 2, 0];
    // Action 6, kind 0: a client connects and sends `CONNECT 52`; kind 2: data.
    let connect = vec![6, 0, 6, 2, 9, 0];
    // Action 8: a guest packet: op, ports, length.
    let packet = |op: u8, src: u8, dst: u8, len: u8| vec![8, op, src, dst, len];
    let answered = [
        post_rx(0),
        post_rx(1),
        post_rx(2),
        connect,
        packet(2, 52, 0, 0),
        vec![6, 2, 0],
        packet(5, 52, 0, 10),
    ]
    .concat();
    let refused = [post_rx(0), packet(1, 9, 77, 0), vec![9, 0]].concat();
    vec![answered, refused]
}

/// Valid scripts for the smoke test: a frame sent, a frame received into one buffer, a
/// frame received across three buffers, a frame held until its checkpoint's release, a
/// frame each way on pair 1 after VQ_PAIRS_SET, and the receive filter set.
pub fn virtio_net_samples() -> Vec<Vec<u8>> {
    // Action 7: chain on ring (0 rx, 1 tx) from descriptor k, one part: address (base 0 is
    // HDR, 1 DATA), length, flags (2 writable), next.
    let chain = |ring: u8, k: u8, base: u8, len: u8, flags: u8| {
        vec![7, ring, k, 0, base, 0, 0, len, flags, 0]
    };
    let send = [vec![0], chain(1, 0, 0, 60, 0)].concat();
    let receive = [vec![0], chain(0, 0, 1, 200, 2), vec![6, 20]].concat();
    let merged = [
        vec![0],
        chain(0, 0, 1, 64, 2),
        chain(0, 1, 1, 64, 2),
        chain(0, 2, 1, 64, 2),
        vec![6, 20, 9, 1],
    ]
    .concat();
    // Mode 4: the output held; a frame sent, a checkpoint, its release, the host reads.
    let held = [vec![4], chain(1, 0, 0, 60, 0), vec![9, 0, 3, 9, 0, 6, 9, 2]].concat();
    // Action 9, kind 5: a control command (class, command, data length, data, first
    // descriptor); kind 4: a frame on pair 1's backend. Both pairs put in use, a frame
    // received on pair 1 and one sent on it; then promiscuous mode off and a MAC table.
    let pairs = [
        vec![0],
        vec![9, 5, 4, 0, 2, 2, 0, 0],
        chain(2, 0, 1, 200, 2),
        vec![9, 4, 20],
        chain(3, 0, 0, 60, 0),
        vec![9, 2],
    ]
    .concat();
    let filter = [
        vec![0, 9, 5, 0, 0, 1, 0, 0],
        vec![9, 5, 1, 0, 14, 1, 0, 0, 0, 2, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0],
        chain(0, 0, 1, 200, 2),
        vec![6, 20],
    ]
    .concat();
    vec![send, receive, merged, held, pairs, filter]
}

/// Drives fuzz target `name` for CI without a fuzzer: first on each input that once found a
/// bug (the files in `fuzz/regressions/NAME/`), then on each of `samples` (valid inputs), then
/// on `count` inputs made from the samples with seeded random changes (one in four plain
/// random bytes), so a failure replays from the same seed. A broken rule or a panic fails
/// with the input in hex.
pub fn smoke<E: std::fmt::Display>(
    name: &str,
    target: fn(&[u8]) -> Result<(), E>,
    samples: &[Vec<u8>],
    seed: u64,
    count: u64,
) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions");
    let mut inputs: Vec<Vec<u8>> = match std::fs::read_dir(dir.join(name)) {
        Ok(files) => files
            .map(|f| std::fs::read(f.expect("regression entry").path()).expect("regression"))
            .collect(),
        Err(_) => Vec::new(),
    };
    inputs.extend_from_slice(samples);
    let mut rng = Rng::new(seed);
    for _ in 0..count {
        let input = match samples.len() as u64 {
            n if n == 0 || rng.below(4) == 0 => {
                let len = rng.below(400) as usize;
                (0..len).map(|_| rng.next_u64() as u8).collect()
            }
            n => {
                let mut v = samples[rng.below(n) as usize].clone();
                for _ in 0..1 + rng.below(8) {
                    mutate(&mut rng, &mut v);
                }
                v
            }
        };
        inputs.push(input);
    }
    for input in inputs {
        let hex = || -> String { input.iter().map(|b| format!("{b:02x}")).collect() };
        match std::panic::catch_unwind(|| target(&input)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("input {}: {e}", hex()),
            Err(_) => panic!("input {} panicked (message above)", hex()),
        }
    }
}

/// One random change: a byte replaced, a run of up to 64 bytes cut, or a byte inserted.
fn mutate(rng: &mut Rng, v: &mut Vec<u8>) {
    let at = rng.below(v.len() as u64 + 1) as usize;
    match rng.below(4) {
        0 | 1 if at < v.len() => v[at] = rng.next_u64() as u8,
        2 if at < v.len() => {
            let end = (at + 1 + rng.below(64) as usize).min(v.len());
            v.drain(at..end);
        }
        _ => v.insert(at, rng.next_u64() as u8),
    }
}

fn memory() -> GuestMemoryMmap {
    let top = MEM_SIZE as u64;
    GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), HOLE.0 as usize),
        (GuestAddress(HOLE.1), (top - HOLE.1) as usize),
    ])
    .expect("the mock guest memory layout is valid")
}

fn pmem(fail_flush: bool) -> Pmem {
    Pmem::new(
        0x1_0000_0000,
        2 << 20,
        Box::new(move || {
            if fail_flush {
                Err(std::io::Error::from_raw_os_error(libc::EIO))
            } else {
                Ok(())
            }
        }),
    )
}

/// A fresh image per input, so no input depends on what an earlier one wrote. The file is
/// unlinked once the device holds it open. `O_DIRECT` needs a file system that has it, which
/// /tmp may not be; where /var/tmp lacks it too, the write-back mode stands in.
fn disk(readonly: bool, direct: bool) -> Result<Block, Finding> {
    let open = |dir: &str, cache| -> std::io::Result<Result<Block, _>> {
        // Sparse: what the disk holds does not matter to the checks.
        let f = tempfile::NamedTempFile::new_in(dir)?;
        f.as_file().set_len(DISK_SECTORS * SECTOR_SIZE)?;
        Ok(Block::new(BlockConfig {
            path: f.path().into(),
            readonly,
            cache,
            id: "fuzz".into(),
        }))
    };
    if direct {
        if let Ok(b) = open("/var/tmp", CacheMode::None)? {
            return Ok(b);
        }
    }
    open("/tmp", CacheMode::Writeback)?.map_err(Finding::NoDisk)
}

/// The registers still answer, and after a reset a flush request is served.
fn pmem_alive(d: &mut Driver, fail_flush: bool) -> Result<(), Finding> {
    finish(d)?;
    d.restart();
    d.flush_request();
    let want = if fail_flush {
        crate::virtio::pmem::VIRTIO_PMEM_RESP_EIO
    } else {
        VIRTIO_PMEM_RESP_OK
    };
    match d.response() {
        r if r == want => Ok(()),
        got => Err(Finding::FlushAnswer { got, want }),
    }
}

/// The identification registers read as they did before the guest's script.
fn finish(d: &mut Driver) -> Result<(), Finding> {
    let (magic, version) = (d.read(VIRTIO_MMIO_MAGIC_VALUE), d.read(VIRTIO_MMIO_VERSION));
    if (magic, version) != (MMIO_MAGIC, MMIO_VERSION) {
        return Err(Finding::Identity { magic, version });
    }
    d.status();
    Ok(())
}

/// The input as a stream of little numbers; it reads as zeros once used up.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn byte(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    /// A guest-physical address: mostly one of the request areas, a ring, the memory's
    /// edges and hole, or anything at all.
    fn addr(&mut self) -> u64 {
        let top = MEM_SIZE as u64;
        let bases = [HDR, DATA, STATUS, INDIRECT, RING, HOLE.0, HOLE.1, top];
        match self.byte() {
            b if usize::from(b) < 4 * bases.len() => {
                let near = i64::from(self.byte() as i8);
                bases[usize::from(b) % bases.len()].wrapping_add_signed(near)
            }
            b if b < 0xf0 => u64::from(self.u32()) % (top + 0x1000),
            _ => self.u64(),
        }
    }

    /// A buffer length: small, sector-sized, or anything.
    fn len(&mut self) -> u32 {
        match self.byte() % 8 {
            0..=2 => u32::from(self.byte()),
            3..=5 => u32::from(self.byte() % 16) * SECTOR_SIZE as u32,
            6 => 1 << (self.byte() % 32),
            _ => self.u32(),
        }
    }

    /// A register offset: a known register (width 4), or any offset and width in the window
    /// and a little past it.
    fn register(&mut self) -> (u64, usize) {
        let b = self.byte();
        if b < 0xc0 {
            let reg = u64::from(REGISTERS[usize::from(b) % REGISTERS.len()]);
            // Configuration fields lie at 4-byte steps past the first.
            let field = if reg == u64::from(VIRTIO_MMIO_CONFIG) {
                4 * u64::from(b / REGISTERS.len() as u8 % 8)
            } else {
                0
            };
            (reg + field, 4)
        } else {
            let offset = u64::from(self.u16()) % (MMIO_SIZE + 0x100);
            (offset, [1, 2, 4, 8][usize::from(b) % 4])
        }
    }
}

/// What every script does alike, whichever device: op 0 writes a register (a QueueNotify
/// write is checked as a notification), op 1 reads one, op 2 writes guest memory.
fn register_or_memory(d: &mut Driver, s: &mut Script, op: u8) -> Result<(), Finding> {
    match op {
        0 => {
            let (offset, width) = s.register();
            let value = s.u64().to_le_bytes();
            if offset == u64::from(VIRTIO_MMIO_QUEUE_NOTIFY) && width == 4 {
                let index = u32::from_le_bytes(value[..4].try_into().unwrap());
                notify(d, index)?;
            } else {
                d.write_bytes(offset, &value[..width]);
            }
        }
        1 => {
            let (offset, width) = s.register();
            let mut buf = [0u8; 8];
            d.read_bytes(offset, &mut buf[..width]);
        }
        _ => {
            let addr = s.addr();
            let n = usize::from(s.byte() % 65).min(s.0.len());
            let (bytes, rest) = s.0.split_at(n);
            s.0 = rest;
            // Writes that miss guest memory are the driver's mistake; nothing to check.
            let _ = d.mem.write_slice(bytes, GuestAddress(addr));
        }
    }
    Ok(())
}

/// A chain of up to four parts, as the script describes them.
fn chain_parts(s: &mut Script) -> Vec<(u64, u32, u16)> {
    let parts = 1 + usize::from(s.byte() % 4);
    (0..parts)
        .map(|_| {
            let (addr, len, flags, _) = descriptor(s);
            (addr, len, flags)
        })
        .collect()
}

/// A queue size to set up: mostly the usual one, sometimes any power of two, sometimes
/// anything.
fn queue_size(s: &mut Script) -> u32 {
    match s.byte() % 4 {
        0 | 1 => u32::from(QSIZE),
        2 => 1 << (s.byte() % 10),
        _ => s.u32(),
    }
}

/// Plays the script's actions until it (or [`MAX_ACTIONS`]) runs out. Actions 0 to 2 (a
/// register or guest memory) and 5 (a doorbell) are every device's; `device` plays 3, 4
/// and 6 to 9.
fn each_action(
    d: &mut Driver,
    s: &mut Script,
    mut device: impl FnMut(&mut Driver, &mut Script, u8) -> Result<(), Finding>,
) -> Result<(), Finding> {
    for _ in 0..MAX_ACTIONS {
        if s.0.is_empty() {
            break;
        }
        match s.byte() % 10 {
            op @ 0..=2 => register_or_memory(d, s, op)?,
            5 => {
                let index = u32::from(s.byte() % 2);
                notify(d, index)?;
            }
            op => device(d, s, op)?,
        }
    }
    Ok(())
}

/// Plays the script against the device, checking every notification; action 6 writes a
/// virtio-blk request header.
fn play(d: &mut Driver, s: &mut Script) -> Result<(), Finding> {
    each_action(d, s, |d, s, op| {
        if op != 6 {
            return one_queue_action(d, s, op);
        }
        let ty = match s.byte() % 6 {
            0 => VIRTIO_BLK_T_IN,
            1 => VIRTIO_BLK_T_OUT,
            2 => VIRTIO_BLK_T_FLUSH,
            3 => VIRTIO_BLK_T_GET_ID,
            _ => s.u32(),
        };
        let sector = match s.byte() % 4 {
            0 => u64::from(s.byte()) % (DISK_SECTORS + 2),
            1 => DISK_SECTORS - u64::from(s.byte() % 4),
            2 => u64::MAX / SECTOR_SIZE + u64::from(s.byte() % 3),
            _ => s.u64(),
        };
        d.header(ty, sector);
        Ok(())
    })
}

/// Actions 3, 4 and 7 to 9 of a device with one queue on the driver's own rings: a
/// descriptor written, a head published, a chain posted and notified, the device reset and
/// brought up again, the avail index or flags overwritten.
fn one_queue_action(d: &mut Driver, s: &mut Script, op: u8) -> Result<(), Finding> {
    match op {
        3 => {
            let table = if s.byte() & 1 == 0 { RING } else { INDIRECT };
            let index = u64::from(s.byte() % 32);
            let desc = descriptor(s);
            d.write_table(table + 16 * index, &[desc]);
        }
        4 => {
            let head = if s.byte() < 0xf0 {
                u16::from(s.byte() % 32)
            } else {
                s.u16()
            };
            d.publish(head);
        }
        7 => {
            // A chain of up to four parts, linked as a driver links them, then notified.
            let descs = chain_parts(s);
            d.chain(&descs);
            notify(d, 0)?;
        }
        8 => {
            // Reset and bring the device up again with whatever the script asks for.
            let drop_bits = if s.byte() & 1 == 0 { 0 } else { s.u64() };
            let size = queue_size(s);
            d.negotiate(drop_bits);
            d.setup_queue(size);
            d.driver_ok();
            d.avail_idx = 0;
        }
        _ => {
            if s.byte() & 1 == 0 {
                d.set_avail_idx(s.u16());
            } else {
                d.set_avail_flags(s.u16());
            }
        }
    }
    Ok(())
}

/// Queue pairs of the virtio-net target's device.
const NET_PAIRS: u32 = 2;
/// Every queue of that device, checked after each event: two pairs and the control queue.
const NET_QUEUES: [u32; 5] = [0, 1, 2, 3, 4];

/// The queue of the virtio-net target a script byte names, as (ring, queue index): 0 and
/// 1 are pair 0's receive and transmit queues (what they were when the device had one
/// pair), 2 and 3 pair 1's, 4 and 5 the control queue.
fn net_ring(r: &mut NetRings, b: u8) -> (&mut Ring, u32) {
    match ((b >> 1) % 3, b & 1) {
        (0, 0) => (&mut r.rx[0], 0),
        (0, _) => (&mut r.tx[0], 1),
        (1, 0) => (&mut r.rx[1], 2),
        (1, _) => (&mut r.tx[1], 3),
        _ => {
            let q = r.ctrl_queue;
            (&mut r.ctrl, q)
        }
    }
}

/// Plays the script against a virtio-net device of two pairs; `peers` are the host ends of
/// the pairs' backends.
fn play_net(
    d: &mut Driver,
    r: &mut NetRings,
    peers: [&std::os::unix::net::UnixDatagram; 2],
    held: bool,
    s: &mut Script,
) -> Result<(), Finding> {
    // Until the gate first lets anything go, no frame may reach a backend.
    let mut released = !held;
    let mut polled = false;
    // The host end sends a frame on pair `k` (the socket may refuse it when full), and
    // the device hears of it.
    let inject = |d: &mut Driver, s: &mut Script, k: usize| -> Result<(), Finding> {
        let len = match s.byte() {
            b if b < 0xf0 => usize::from(b) * 8,
            _ => s.u32() as usize % (VNET_HDR_LEN + MAX_FRAME_LEN + 64),
        };
        let frame: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let _ = peers[k].send(&frame);
        // Pair 0's backend is event 0, pair 1's comes after the resume eventfd.
        checked(d, &NET_QUEUES, |d| {
            d.t.process_event(if k == 0 { 0 } else { 2 })
        })
    };
    each_action(d, s, |d, s, op| {
        match op {
            3 => {
                let table = match s.byte() % 6 {
                    0 => r.rx[0].desc(),
                    1 => r.tx[0].desc(),
                    2 => INDIRECT,
                    3 => r.rx[1].desc(),
                    4 => r.tx[1].desc(),
                    _ => r.ctrl.desc(),
                };
                let index = u64::from(s.byte() % 32);
                let desc = descriptor(s);
                d.write_table(table + 16 * index, &[desc]);
            }
            4 => {
                let (ring, _) = net_ring(r, s.byte());
                let head = if s.byte() < 0xf0 {
                    u16::from(s.byte() % 32)
                } else {
                    s.u16()
                };
                d.publish_on(ring, head);
            }
            6 => inject(d, s, 0)?,
            7 => {
                let (ring, queue) = net_ring(r, s.byte());
                let first = u16::from(s.byte() % 28);
                let descs = chain_parts(s);
                d.chain_on(ring, first, &descs);
                notify(d, queue)?;
            }
            8 => {
                let drop_bits = if s.byte() & 1 == 0 { 0 } else { s.u64() };
                let size = queue_size(s);
                d.negotiate(drop_bits);
                let mq = drop_bits & (1 << VIRTIO_NET_F_MQ) == 0;
                r.ctrl_queue = if mq { 2 * NET_PAIRS } else { 2 };
                let pairs = if mq { NET_PAIRS as usize } else { 1 };
                for k in 0..pairs {
                    d.setup_queue_on(2 * k as u32, &r.rx[k], size);
                    d.setup_queue_on(2 * k as u32 + 1, &r.tx[k], size);
                }
                d.setup_queue_on(r.ctrl_queue, &r.ctrl, size);
                d.driver_ok();
                for ring in r.rx.iter_mut().chain(&mut r.tx).chain([&mut r.ctrl]) {
                    ring.avail_idx = 0;
                    ring.used_seen = 0;
                }
            }
            _ => match s.byte() % 6 {
                0 | 1 => {
                    // An event source fires (a backend, resume, or one the device lacks).
                    let b = s.byte();
                    if held {
                        // The same byte steps the gate: a checkpoint (the device saved,
                        // its seal marked), the acknowledgement's release, or the end.
                        let gate = d.t.output_gate().expect("virtio-net has an output gate");
                        match b / 3 % 4 {
                            1 => {
                                let _ = d.t.state();
                                gate.mark_captured();
                            }
                            2 => {
                                gate.release_captured();
                                d.t.flush_output();
                                released = true;
                            }
                            3 if b >= 0xf0 => {
                                gate.open();
                                released = true;
                            }
                            _ => {}
                        }
                    }
                    let index = usize::from(b % 4);
                    checked(d, &NET_QUEUES, |d| d.t.process_event(index))?;
                    if index == 3 {
                        // The VMM's poller starts or ends polling the transmit queues, and
                        // looks at them as it would between events.
                        polled = !polled;
                        checked(d, &NET_QUEUES, |d| {
                            for queue in [1, 3] {
                                d.t.set_polled(queue, polled);
                                d.t.poll_queue(queue);
                            }
                        })?;
                    }
                }
                2 => {
                    // The host end reads what the device sent: whole frames, never longer
                    // than the device accepts.
                    let mut buf = vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN + 64];
                    for peer in peers {
                        for _ in 0..64 {
                            let Ok(n) = peer.recv(&mut buf) else { break };
                            if n <= VNET_HDR_LEN || n > VNET_HDR_LEN + MAX_FRAME_LEN {
                                return Err(Finding::FrameLength(n));
                            }
                            if !released {
                                return Err(Finding::HeldFrameSent);
                            }
                        }
                    }
                }
                3 => {
                    let (ring, _) = net_ring(r, s.byte());
                    let at = if s.byte() & 1 == 0 {
                        ring.avail() + 2
                    } else {
                        ring.avail()
                    };
                    let _ = d.mem.write_obj(s.u16(), GuestAddress(at));
                }
                4 => inject(d, s, 1)?,
                _ => {
                    // A control command as a driver lays it out (header, data, ack), its
                    // class, command and data the script's: mostly ones the device knows.
                    let class = match s.byte() {
                        b if b < 0xf0 => b % 6,
                        _ => s.byte(),
                    };
                    let cmd = s.byte() % 4;
                    let len = usize::from(s.byte() % 32);
                    let data: Vec<u8> = (0..len).map(|_| s.byte()).collect();
                    d.mem.write_slice(&[class, cmd], GuestAddress(HDR))?;
                    d.mem.write_slice(&data, GuestAddress(DATA))?;
                    let mut descs = vec![(HDR, 2, 0)];
                    if len > 0 {
                        descs.push((DATA, len as u32, 0));
                    }
                    descs.push((STATUS, 1, VRING_DESC_F_WRITE as u16));
                    let first = u16::from(s.byte() % 13);
                    d.chain_on(&mut r.ctrl, first, &descs);
                    let queue = r.ctrl_queue;
                    notify(d, queue)?;
                }
            },
        }
        Ok(())
    })
}

const VSOCK_CID: u64 = 3;

/// Plays a vsock script. Host programs' streams are kept in `clients` (a few at most), so
/// the device sees them open, write and close at the script's pace.
fn play_vsock(
    d: &mut Driver,
    rings: [&mut Ring; 2],
    path: &std::path::Path,
    clients: &mut Vec<std::os::unix::net::UnixStream>,
    s: &mut Script,
) -> Result<(), Finding> {
    use crate::virtio::vsock::packet::{Header, HDR_LEN, HOST_CID, TYPE_STREAM};
    use std::io::{Read, Write};
    let [rx, tx] = rings;
    each_action(d, s, |d, s, op| {
        match op {
            3 => {
                let table = if s.byte() & 1 == 0 {
                    rx.desc()
                } else {
                    tx.desc()
                };
                let index = u64::from(s.byte() % 32);
                let desc = descriptor(s);
                d.write_table(table + 16 * index, &[desc]);
            }
            4 => {
                let ring = if s.byte() & 1 == 0 {
                    &mut *rx
                } else {
                    &mut *tx
                };
                let head = u16::from(s.byte() % 32);
                d.publish_on(ring, head);
            }
            6 => {
                match s.byte() % 4 {
                    0 if clients.len() < 8 => {
                        if let Ok(mut c) = std::os::unix::net::UnixStream::connect(path) {
                            let _ = c.set_nonblocking(true);
                            let line = match s.byte() % 4 {
                                0 => format!("CONNECT {}\n", s.byte()),
                                1 => format!("CONNECT {}\n", s.u32()),
                                2 => String::from("HELLO\n"),
                                _ => String::from_utf8_lossy(&s.take::<8>()).into_owned(),
                            };
                            let _ = c.write_all(line.as_bytes());
                            clients.push(c);
                        }
                    }
                    1 if !clients.is_empty() => {
                        let i = usize::from(s.byte()) % clients.len();
                        clients.remove(i);
                    }
                    _ if !clients.is_empty() => {
                        let i = usize::from(s.byte()) % clients.len();
                        let n = usize::from(s.byte()) * 64;
                        let _ = clients[i].write(&vec![0xa5; n]);
                        let mut buf = [0u8; 4096];
                        let _ = clients[i].read(&mut buf);
                    }
                    _ => {}
                }
                checked(d, &[0, 1], |d| d.t.process_event(0))?;
            }
            7 => {
                let ring = if s.byte() & 1 == 0 {
                    &mut *rx
                } else {
                    &mut *tx
                };
                let queue = if ring.base == RING { 0 } else { 1 };
                let first = u16::from(s.byte() % 28);
                let descs = chain_parts(s);
                d.chain_on(ring, first, &descs);
                notify(d, queue)?;
            }
            8 => {
                // A guest packet, mostly well addressed, its payload where the chain says.
                let mut h = Header {
                    src_cid: VSOCK_CID,
                    dst_cid: HOST_CID,
                    op: u16::from(s.byte() % 9),
                    src_port: u32::from(s.byte()),
                    dst_port: u32::from(s.byte()),
                    type_: TYPE_STREAM,
                    buf_alloc: 1 << 16,
                    ..Header::default()
                };
                let len = match s.byte() {
                    b if b < 0xf0 => u32::from(b) * 16,
                    _ => s.u32(),
                };
                h.len = len;
                if h.dst_port == 0 {
                    // The host side's port of the newest connection, to hit a live one.
                    h.dst_port = 1 << 30;
                }
                match s.byte() % 8 {
                    0 => h.src_cid = s.u64(),
                    1 => h.type_ = s.u16(),
                    2 => h.fwd_cnt = s.u32(),
                    _ => {}
                }
                d.mem.write_slice(&h.encode(), GuestAddress(HDR))?;
                let first = u16::from(s.byte() % 28);
                d.chain_on(
                    tx,
                    first,
                    &[(HDR, HDR_LEN as u32, 0), (DATA, len.min(1 << 20), 0)],
                );
                notify(d, 1)?;
            }
            _ => match s.byte() % 3 {
                0 => checked(d, &[0, 1], |d| d.t.process_event(0))?,
                1 => {
                    let size = queue_size(s);
                    d.negotiate(0);
                    d.setup_queue_on(0, rx, size);
                    d.setup_queue_on(1, tx, size);
                    d.driver_ok();
                    for ring in [&mut *rx, &mut *tx] {
                        ring.avail_idx = 0;
                        ring.used_seen = 0;
                    }
                }
                _ => {
                    let ring = if s.byte() & 1 == 0 { &*rx } else { &*tx };
                    let _ = d.mem.write_obj(s.u16(), GuestAddress(ring.avail() + 2));
                }
            },
        }
        Ok(())
    })
}

/// After a reset, a host program's CONNECT reaches a posted receive buffer as a REQUEST.
///
/// Host programs the script left connecting (accepted but unread, or still in the listener's
/// backlog when the guest reset the device) are new clients to the reset device, and their
/// REQUESTs come first, each taking a buffer: so the guest here, like Linux's driver, gives
/// every used buffer back, and the REQUEST must come before the device goes
/// [`ALIVE_IDLE_PASSES`] passes without using one.
fn vsock_alive(d: &mut Driver, path: &std::path::Path) -> Result<(), Finding> {
    use crate::virtio::vsock::packet::{Header, HDR_LEN, OP_REQUEST};
    use std::io::Write;
    let (mut rx, _tx, _ev) = d.vsock_up();
    let base = 0x50_0000u64;
    let buffer = |k: u16| {
        [(
            base + 0x1000 * u64::from(k),
            0x1000,
            VRING_DESC_F_WRITE as u16,
        )]
    };
    for k in 0..QSIZE {
        d.chain_on(&mut rx, k, &buffer(k));
    }
    d.notify_queue(0);
    let mut c = std::os::unix::net::UnixStream::connect(path)?;
    c.write_all(b"CONNECT 1000\n")?;
    let mut idle = 0;
    // Each pass that is not idle takes a buffer for one of at most MAX_ACTIONS clients' packets.
    for _ in 0..4 * MAX_ACTIONS {
        if idle == ALIVE_IDLE_PASSES {
            break;
        }
        d.t.process_event(0);
        idle += 1;
        while let Some((id, len)) = d.next_used_on(&mut rx) {
            idle = 0;
            let addr = base + 0x1000 * u64::from(id);
            if len as usize >= HDR_LEN {
                let h = Header::parse(&d.guest_bytes(addr, HDR_LEN).try_into().unwrap());
                if h.op == OP_REQUEST && h.dst_port == 1000 {
                    return Ok(());
                }
            }
            let k = id as u16 % QSIZE;
            d.chain_on(&mut rx, k, &buffer(k));
            d.notify_queue(0);
        }
    }
    Err(Finding::VsockRequestLost)
}

/// After a reset, a well-formed control command is carried out and acknowledged.
fn net_control_alive(d: &mut Driver) -> Result<(), Finding> {
    let mut rings = d.net_up_pairs(0, NET_PAIRS);
    let (class, cmd) = (VIRTIO_NET_CTRL_RX as u8, VIRTIO_NET_CTRL_RX_PROMISC as u8);
    match d.control(&mut rings, 0, class, cmd, &[1]) {
        Some((ack, 1)) if ack == VIRTIO_NET_OK as u8 => Ok(()),
        other => Err(Finding::ControlAnswer(other)),
    }
}

/// After a reset, a frame sent by the guest reaches the host end and a frame from the host
/// end reaches a guest buffer, behind the frames the script left in the backend (a reset
/// does not empty a TAP either), the guest refilling its ring as a driver does.
fn net_alive(d: &mut Driver, peer: &std::os::unix::net::UnixDatagram) -> Result<(), Finding> {
    let (mut rx, mut tx) = d.net_up(0);
    let mut buf = vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN + 64];
    while peer.recv(&mut buf).is_ok() {}
    let marker: Vec<u8> = (0..80u8).map(|i| i ^ 0x5a).collect();
    d.mem.write_slice(&marker, GuestAddress(DATA))?;
    d.chain_on(&mut tx, 0, &[(DATA, marker.len() as u32, 0)]);
    d.notify_queue(1);
    match peer.recv(&mut buf) {
        Ok(n) if buf[..n] == marker[..] => {}
        other => return Err(Finding::SentFrame(other)),
    }
    // Frames the script left in the backend go first: as many as the socket's buffer took,
    // which may be more than a ring holds. The guest gives each used buffer back, as a
    // driver refills its ring, until the marker arrives or a pass brings nothing more.
    let base = 0x50_0000u64;
    let stride = 0x2_0000u64;
    let post = |d: &mut Driver, rx: &mut Ring, k: u16| {
        let addr = base + stride * u64::from(k);
        d.chain_on(rx, k, &[(addr, stride as u32, VRING_DESC_F_WRITE as u16)]);
    };
    for k in 0..QSIZE {
        post(d, &mut rx, k);
    }
    d.notify_queue(0);
    // The script may have filled the socket's buffer too: the marker goes in once the
    // guest's taking frames has made room, and only a buffer that no pass empties is a
    // finding.
    let mut sent = false;
    let send = |sent: &mut bool| -> Result<(), Finding> {
        if !*sent {
            match peer.send(&marker) {
                Ok(_) => *sent = true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(Finding::BackendFull(e)),
            }
        }
        Ok(())
    };
    send(&mut sent)?;
    d.t.process_event(0);
    // Bounded: each pass that goes on takes frames the socket's buffer held, a few thousand
    // at most.
    for _ in 0..4096 {
        let mut used = 0;
        while let Some((id, len)) = d.next_used_on(&mut rx) {
            let k = (id % u32::from(QSIZE)) as u16;
            let addr = base + stride * u64::from(k);
            if len as usize == marker.len()
                && d.guest_bytes(addr + VNET_HDR_LEN as u64, marker.len() - VNET_HDR_LEN)
                    == marker[VNET_HDR_LEN..]
            {
                return Ok(());
            }
            post(d, &mut rx, k);
            used += 1;
        }
        if used == 0 {
            if sent {
                break;
            }
            // Nothing taken, and the marker still waits for room: the buffer stays full.
            peer.send(&marker).map_err(Finding::BackendFull)?;
            sent = true;
        }
        d.notify_queue(0);
        send(&mut sent)?;
        d.t.process_event(0);
    }
    Err(Finding::FrameLost)
}

/// A descriptor as a buggy or hostile driver may write it.
fn descriptor(s: &mut Script) -> Desc {
    let addr = s.addr();
    let len = s.len();
    let f = s.byte();
    let mut flags = 0;
    for (bit, flag) in [
        (1, VRING_DESC_F_NEXT),
        (2, VRING_DESC_F_WRITE),
        (4, VRING_DESC_F_INDIRECT),
    ] {
        if f & bit != 0 {
            flags |= flag as u16;
        }
    }
    if f & 0x80 != 0 {
        flags |= s.u16();
    }
    let next = if f & 0x40 != 0 {
        s.u16()
    } else {
        u16::from(s.byte() % 32)
    };
    (addr, len, flags, next)
}

/// The layout of a queue as the device holds it.
#[derive(Clone, Copy)]
struct Rings {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
}

/// Guest ranges a check reads (descriptor tables and available rings, indirect tables, used
/// rings) and ranges the device may write (used rings, writable buffers); if a write can land
/// on something read, the device's own writes may change what the check reads back, and the
/// action is not checked.
#[derive(Default)]
struct Footprint {
    rings: Vec<(u64, u64)>,
    tables: Vec<(u64, u64)>,
    used: Vec<(u64, u64)>,
    written: Vec<(u64, u64)>,
}

impl Footprint {
    fn aliased(&self) -> bool {
        let overlap = |a: &(u64, u64), b: &(u64, u64)| a.0 < b.1 && b.0 < a.1;
        let read = || self.rings.iter().chain(&self.tables);
        let used_hits = self.used.iter().enumerate().any(|(i, u)| {
            read().any(|r| overlap(u, r))
                || self.used[i + 1..].iter().any(|other| overlap(u, other))
        });
        let buffers_hit = self
            .written
            .iter()
            .any(|w| read().chain(&self.used).any(|r| overlap(w, r)));
        used_hits || buffers_hit
    }
}

fn span(addr: u64, len: u64) -> (u64, u64) {
    (addr, addr.saturating_add(len))
}

/// Notifies queue `index` and checks what the device put on its used ring.
fn notify(d: &mut Driver, index: u32) -> Result<(), Finding> {
    checked(d, &[index], |d| d.write(VIRTIO_MMIO_QUEUE_NOTIFY, index))
}

/// Runs `act` and checks what the device put on the used rings of `queues`: only chains
/// that were available, in order, none longer than its writable buffers.
fn checked(d: &mut Driver, queues: &[u32], act: impl FnOnce(&mut Driver)) -> Result<(), Finding> {
    let mut fp = Footprint::default();
    let mut before = Vec::new();
    for &index in queues {
        let live = d.t.queue(index as usize).filter(|q| q.ready()).map(|q| {
            let rings = Rings {
                size: q.size(),
                desc: q.desc_table(),
                avail: q.avail_ring(),
                used: q.used_ring(),
            };
            (rings, q.next_avail(), q.next_used())
        });
        let Some((rings, next_avail, next_used)) = live else {
            continue;
        };
        // An unreadable ring is the device's to give up on, which the transport handles.
        if let Some(expected) = pending(&d.mem, rings, next_avail, &mut fp) {
            before.push((index, rings, next_used, expected));
        }
    }
    act(d);
    if fp.aliased() {
        return Ok(());
    }
    for (index, rings, used_before, expected) in before {
        check_used(d, index, rings, used_before, &expected)?;
    }
    Ok(())
}

fn check_used(
    d: &Driver,
    index: u32,
    rings: Rings,
    used_before: u16,
    expected: &[(u16, u64)],
) -> Result<(), Finding> {
    let used_after =
        d.t.queue(index as usize)
            .map_or(used_before, |q| q.next_used());
    let served = used_after.wrapping_sub(used_before);
    if usize::from(served) > expected.len() {
        return Err(Finding::TooManyUsed {
            index,
            served,
            available: expected.len(),
        });
    }
    for (k, &(head, bound)) in expected.iter().take(usize::from(served)).enumerate() {
        let slot = used_before.wrapping_add(k as u16) % rings.size;
        let at = rings.used + 4 + 8 * u64::from(slot);
        let elem: VirtqUsedElem =
            d.mem
                .read_obj(GuestAddress(at))
                .map_err(|source| Finding::UsedUnreadable {
                    index,
                    slot,
                    source,
                })?;
        if elem.id() != u32::from(head) {
            return Err(Finding::OutOfOrder {
                index,
                k,
                id: elem.id(),
                head,
            });
        }
        if u64::from(elem.len()) > bound {
            return Err(Finding::TooLong {
                index,
                head,
                len: elem.len(),
                bound,
            });
        }
    }
    Ok(())
}

/// The chains available to the device, in order, each with the writable bytes it has; `None`
/// when the device's writes could change what the check reads back, or the ring is not
/// readable (then the device gives up on it, which the transport handles).
fn pending(
    mem: &GuestMemoryMmap,
    rings: Rings,
    next_avail: u16,
    fp: &mut Footprint,
) -> Option<Vec<(u16, u64)>> {
    let size = u64::from(rings.size);
    let avail_idx: u16 = mem
        .read_obj(GuestAddress(rings.avail.checked_add(2)?))
        .ok()?;
    let count = avail_idx.wrapping_sub(next_avail).min(rings.size);
    fp.rings.push(span(rings.desc, 16 * size));
    fp.rings.push(span(rings.avail, 6 + 2 * size));
    fp.used.push(span(rings.used, 6 + 8 * size));
    let mut out = Vec::with_capacity(usize::from(count));
    for k in 0..count {
        let slot = u64::from(next_avail.wrapping_add(k) % rings.size);
        let head: u16 = mem
            .read_obj(GuestAddress(rings.avail.checked_add(4 + 2 * slot)?))
            .ok()?;
        out.push((head, writable_bytes(mem, rings, head, fp)));
    }
    Some(out)
}

/// Sums the device-writable lengths along chain `head` as virtio-queue walks it (the ring's
/// table, then at most one indirect table), over at least as many steps as any device takes.
fn writable_bytes(mem: &GuestMemoryMmap, rings: Rings, head: u16, fp: &mut Footprint) -> u64 {
    let (mut table, mut entries, mut index) = (rings.desc, rings.size, head);
    let mut indirect = false;
    let mut sum = 0u64;
    for _ in 0..MAX_WALK {
        if index >= entries {
            break;
        }
        let Some(at) = table.checked_add(16 * u64::from(index)) else {
            break;
        };
        let Ok(desc) = mem.read_obj::<Descriptor>(GuestAddress(at)) else {
            break;
        };
        if desc.refers_to_indirect_table() {
            if indirect || desc.len() % 16 != 0 || desc.len() / 16 > u32::from(u16::MAX) {
                break;
            }
            indirect = true;
            (table, entries, index) = (desc.addr().0, (desc.len() / 16) as u16, 0);
            fp.tables.push(span(table, u64::from(desc.len())));
            continue;
        }
        if desc.is_write_only() {
            sum += u64::from(desc.len());
            fp.written.push(span(desc.addr().0, u64::from(desc.len())));
        }
        if !desc.has_next() {
            break;
        }
        index = desc.next();
    }
    sum
}
