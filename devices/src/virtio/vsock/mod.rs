//! virtio-vsock (virtio 1.1, 5.10) with Firecracker's and Cloud Hypervisor's "hybrid" host
//! side: guest stream sockets meet host programs on UNIX sockets (see [`muxer`]).
//!
//! The device turns descriptor chains into packets and back; [`muxer::Muxer`] owns the
//! sockets and the connections, [`conn::Conn`] one connection's state and credit, and
//! [`packet`] the header. Packets the transmit queue provokes (a RESPONSE, an RST) go out
//! on the receive queue, which `process_queue` cannot reach: the device then asks for a
//! pass through its event source, which sees every queue.

pub mod conn;
pub mod muxer;
pub mod packet;
#[cfg(test)]
mod tests;

pub use muxer::{staging_path, Muxer, SocketFile, TakeOverError, VsockError, MAX_CONNS};

use super::net::buffers;
use super::{available, corrupt, pop};
use super::{read_config_bytes, QueueCorrupt, VirtioDevice, VirtioStats};
use crate::GuestMemoryMmap;
use packet::{Header, HDR_LEN};
use std::os::fd::RawFd;
use std::path::Path;
use tracing::debug;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

pub const VIRTIO_ID_VSOCK: u32 = 19;
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const EVENT_QUEUE: u16 = 2;
/// Largest payload of one packet either way (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_PKT_LEN: usize = 64 * 1024;
/// Chains served per queue pass, so a busy guest or host cannot keep the thread.
const CHAINS_PER_PASS: usize = 256;

pub struct Vsock {
    muxer: Muxer,
    config: [u8; 8],
    active: bool,
    /// Payload of the packet being moved, either way.
    buf: Vec<u8>,
    stats: VirtioStats,
    /// The driver must be told its connections are gone (after a restore).
    reset_event_due: bool,
}

impl Vsock {
    /// A device for guest `cid` whose host side listens at `socket`.
    pub fn new(cid: u64, socket: &Path) -> Result<Vsock, VsockError> {
        Ok(Vsock::with_muxer(Muxer::new(cid, socket)?))
    }

    /// A device for a VM arriving from another process that may still listen at `socket`:
    /// it listens beside it until its [`SocketFile::take_over`] (see [`Muxer::staged`]).
    pub fn staged(cid: u64, socket: &Path) -> Result<Vsock, VsockError> {
        Ok(Vsock::with_muxer(Muxer::staged(cid, socket)?))
    }

    fn with_muxer(muxer: Muxer) -> Vsock {
        let cid = muxer.cid();
        Vsock {
            muxer,
            config: cid.to_le_bytes(),
            active: false,
            buf: vec![0; MAX_PKT_LEN],
            stats: VirtioStats::default(),
            reset_event_due: false,
        }
    }

    pub fn cid(&self) -> u64 {
        self.muxer.cid()
    }

    pub fn socket(&self) -> &Path {
        self.muxer.path()
    }

    /// The listener's file, for the VMM to remove when the VM ends.
    pub fn socket_file(&self) -> SocketFile {
        self.muxer.socket_file()
    }

    pub fn connections(&self) -> usize {
        self.muxer.connections()
    }

    /// Reads the guest packets on the transmit queue and hands them to the muxer.
    fn process_tx(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<usize, QueueCorrupt> {
        let (_, pending) = available(TX_QUEUE, q, mem)?;
        let pending = usize::from(pending).min(CHAINS_PER_PASS);
        for _ in 0..pending {
            let chain = pop(TX_QUEUE, q, mem)?;
            let head = chain.head_index();
            if let Err(why) = self.transmit(chain, mem) {
                debug!("vsock: transmit chain dropped: {why}");
                self.stats.errors += 1;
            }
            self.stats.requests += 1;
            q.add_used(mem, head, 0)
                .map_err(|e| corrupt(TX_QUEUE, "writing used ring", e))?;
        }
        if pending == CHAINS_PER_PASS || self.muxer.has_rx_work() {
            self.muxer.kick();
        }
        Ok(pending)
    }

    fn transmit(
        &mut self,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> Result<(), &'static str> {
        let (bufs, total) = buffers(chain, mem, false)?;
        if total < HDR_LEN {
            return Err("chain shorter than the packet header");
        }
        let mut hdr = [0u8; HDR_LEN];
        gather(mem, &bufs, 0, &mut hdr)?;
        let h = Header::parse(&hdr);
        let len = h.len as usize;
        if len > MAX_PKT_LEN || len > total - HDR_LEN {
            // The connection it names cannot be trusted to stay in step: an op no
            // connection accepts resets it.
            let mut bad = h;
            bad.op = 0;
            self.muxer.from_guest(&bad, &[]);
            return Err("payload length past the chain or the packet limit");
        }
        if h.op == packet::OP_RW {
            gather(mem, &bufs, HDR_LEN, &mut self.buf[..len])?;
            self.stats.bytes_written += len as u64;
        }
        self.muxer.from_guest(&h, &self.buf[..len]);
        Ok(())
    }

    /// Fills the guest's receive buffers with what the muxer has for it.
    fn process_rx(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<usize, QueueCorrupt> {
        let mut used = 0;
        for _ in 0..CHAINS_PER_PASS {
            if !self.muxer.has_rx_work() {
                return Ok(used);
            }
            let (_, pending) = available(RX_QUEUE, q, mem)?;
            if pending == 0 {
                // The driver's next buffer rings the doorbell.
                return Ok(used);
            }
            let chain = pop(RX_QUEUE, q, mem)?;
            let head = chain.head_index();
            let written = match buffers(chain, mem, true) {
                Ok((bufs, cap)) if cap >= HDR_LEN => {
                    let room = (cap - HDR_LEN).min(MAX_PKT_LEN);
                    let Some((mut h, len)) = self.muxer.next_rx(&mut self.buf[..room]) else {
                        q.go_to_previous_position();
                        return Ok(used);
                    };
                    h.len = len as u32;
                    let ok = scatter(mem, &bufs, 0, &h.encode()).is_ok()
                        && scatter(mem, &bufs, HDR_LEN, &self.buf[..len]).is_ok();
                    if ok {
                        self.stats.bytes_read += len as u64;
                        (HDR_LEN + len) as u32
                    } else {
                        // The packet is lost with the buffer; the connection cannot go on.
                        self.stats.errors += 1;
                        0
                    }
                }
                Ok(_) | Err(_) => {
                    debug!("vsock: receive chain unusable");
                    self.stats.errors += 1;
                    0
                }
            };
            self.stats.requests += 1;
            q.add_used(mem, head, written)
                .map_err(|e| corrupt(RX_QUEUE, "writing used ring", e))?;
            used += 1;
        }
        self.muxer.kick();
        Ok(used)
    }

    /// Sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET if one is due and the driver gave a buffer.
    fn process_event_queue(
        &mut self,
        q: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        if !self.reset_event_due || !q.ready() {
            return Ok(0);
        }
        let (_, pending) = available(EVENT_QUEUE, q, mem)?;
        if pending == 0 {
            return Ok(0);
        }
        let chain = pop(EVENT_QUEUE, q, mem)?;
        let head = chain.head_index();
        let written = match buffers(chain, mem, true) {
            Ok((bufs, cap)) if cap >= 4 => {
                let id = packet::EVENT_TRANSPORT_RESET.to_le_bytes();
                u32::from(scatter(mem, &bufs, 0, &id).is_ok()) * 4
            }
            _ => 0,
        };
        self.reset_event_due = false;
        q.add_used(mem, head, written)
            .map_err(|e| corrupt(EVENT_QUEUE, "writing used ring", e))?;
        Ok(1)
    }
}

/// Copies `out.len()` bytes from the chain's buffers, starting `skip` bytes in.
fn gather(
    mem: &GuestMemoryMmap,
    bufs: &[(GuestAddress, usize)],
    mut skip: usize,
    out: &mut [u8],
) -> Result<(), &'static str> {
    let mut at = 0;
    for &(addr, n) in bufs {
        if at == out.len() {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let k = (n - skip).min(out.len() - at);
        mem.read_slice(&mut out[at..at + k], GuestAddress(addr.0 + skip as u64))
            .map_err(|_| "buffer unreadable")?;
        at += k;
        skip = 0;
    }
    if at < out.len() {
        return Err("chain shorter than its packet");
    }
    Ok(())
}

/// Copies `data` into the chain's buffers, starting `skip` bytes in.
fn scatter(
    mem: &GuestMemoryMmap,
    bufs: &[(GuestAddress, usize)],
    mut skip: usize,
    data: &[u8],
) -> Result<(), &'static str> {
    let mut at = 0;
    for &(addr, n) in bufs {
        if at == data.len() {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let k = (n - skip).min(data.len() - at);
        mem.write_slice(&data[at..at + k], GuestAddress(addr.0 + skip as u64))
            .map_err(|_| "buffer unwritable")?;
        at += k;
        skip = 0;
    }
    if at < data.len() {
        return Err("chain shorter than its packet");
    }
    Ok(())
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn num_queues(&self) -> usize {
        3
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn activate(&mut self, _acked_features: u64) {
        self.active = true;
        // Sockets may have spoken before the driver was ready; no new edge would say so.
        self.muxer.kick();
    }

    fn reset(&mut self) {
        self.active = false;
        self.muxer.reset();
    }

    /// Host connections cannot follow a restored or moved VM: they are dropped, and the
    /// driver is sent VIRTIO_VSOCK_EVENT_TRANSPORT_RESET so it drops its side too.
    fn transport_reset(&mut self) {
        self.muxer.reset();
        self.reset_event_due = true;
        self.muxer.kick();
    }

    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        match index {
            RX_QUEUE => self.process_rx(queue, mem),
            TX_QUEUE => self.process_tx(queue, mem),
            EVENT_QUEUE => self.process_event_queue(queue, mem),
            _ => Ok(0),
        }
    }

    fn stats(&self) -> VirtioStats {
        self.stats
    }

    fn event_fds(&self) -> Vec<RawFd> {
        vec![self.muxer.fd()]
    }

    fn process_event(
        &mut self,
        _index: usize,
        queues: &mut [Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<Vec<u16>, QueueCorrupt> {
        self.muxer.handle_events();
        let mut used = Vec::new();
        if !self.active {
            return Ok(used);
        }
        if let Some(q) = queues.get_mut(usize::from(EVENT_QUEUE)) {
            if self.process_event_queue(q, mem)? > 0 {
                used.push(EVENT_QUEUE);
            }
        }
        if let Some(q) = queues.get_mut(usize::from(RX_QUEUE)) {
            if q.ready() && self.process_rx(q, mem)? > 0 {
                used.push(RX_QUEUE);
            }
        }
        Ok(used)
    }
}
