//! virtio-pmem: announces a guest-physical range that the VMM has backed with a host file.
//!
//! The device moves no data. The guest reaches the storage with loads and stores on the range
//! named in the configuration space; the one request it can make is FLUSH, which asks the host
//! to make the range durable. What "durable" means (an `msync` of the host mapping) is the
//! VMM's business, so the device takes it as a closure and stays free of KVM and of the
//! mapping itself.

use super::{read_config_bytes, serve_available, QueueCorrupt, VirtioDevice, VirtioStats};
use crate::GuestMemoryMmap;
use std::io;
use tracing::{debug, warn};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_PMEM;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestMemory, Permissions};

/// Request type FLUSH (virtio spec 5.19.6).
pub const VIRTIO_PMEM_REQ_TYPE_FLUSH: u32 = 0;
/// Response: the range is durable.
pub const VIRTIO_PMEM_RESP_OK: u32 = 0;
/// Response: the host could not make it durable (or the request was not understood).
pub const VIRTIO_PMEM_RESP_EIO: u32 = 1;
/// Configuration space: `start` (le64) then `size` (le64).
pub const CONFIG_LEN: usize = 16;
/// A flush request is a le32 type; its answer a le32 status. Anything after them in the
/// chain is ignored, as the spec lets a driver pad.
const REQ_LEN: u32 = 4;
const RESP_LEN: u32 = 4;
/// Longest chain walked; a flush needs two descriptors, so this only stops loops.
const MAX_CHAIN_DESCRIPTORS: usize = 64;

/// Makes the whole backing range durable; returns the host error if it could not.
pub type FlushFn = Box<dyn FnMut() -> io::Result<()> + Send>;

/// A virtio-pmem device for one range.
pub struct Pmem {
    config: [u8; CONFIG_LEN],
    flush: FlushFn,
    stats: VirtioStats,
}

impl Pmem {
    /// `start` and `size` are the guest-physical range the VMM has mapped; `flush` runs for
    /// every FLUSH request and when the VMM asks the device to flush.
    pub fn new(start: u64, size: u64, flush: FlushFn) -> Pmem {
        let mut config = [0u8; CONFIG_LEN];
        config[0..8].copy_from_slice(&start.to_le_bytes());
        config[8..16].copy_from_slice(&size.to_le_bytes());
        Pmem {
            config,
            flush,
            stats: VirtioStats::default(),
        }
    }

    /// Serves one chain; returns the used length (the response bytes written, or 0).
    fn handle_chain(
        &mut self,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> u32 {
        let mut request = None;
        let mut response = None;
        let mut walked = 0;
        let mut last_has_next = false;
        for d in chain {
            walked += 1;
            if walked > MAX_CHAIN_DESCRIPTORS {
                break;
            }
            last_has_next = d.has_next();
            if d.is_write_only() {
                if response.is_none() && d.len() >= RESP_LEN {
                    response = Some(d.addr());
                }
            } else if request.is_none() && response.is_none() && d.len() >= REQ_LEN {
                request = Some(d.addr());
            }
        }
        let Some(resp_addr) = response else {
            debug!("virtio-pmem chain without a 4-byte writable response; dropped");
            self.stats.errors += 1;
            return 0;
        };
        if !mem.check_range(resp_addr, RESP_LEN as usize, Permissions::Write) {
            debug!(
                addr = resp_addr.raw_value(),
                "virtio-pmem response outside guest memory; dropped"
            );
            self.stats.errors += 1;
            return 0;
        }
        let broken = walked > MAX_CHAIN_DESCRIPTORS || last_has_next;
        let kind = match request {
            Some(a) if !broken => mem.read_obj::<u32>(a).ok().map(u32::from_le),
            _ => None,
        };
        let status = match kind {
            Some(VIRTIO_PMEM_REQ_TYPE_FLUSH) => {
                self.stats.flushes += 1;
                match (self.flush)() {
                    Ok(()) => VIRTIO_PMEM_RESP_OK,
                    Err(e) => {
                        warn!("virtio-pmem flush failed: {e}");
                        VIRTIO_PMEM_RESP_EIO
                    }
                }
            }
            Some(other) => {
                debug!(kind = other, "unknown virtio-pmem request type");
                VIRTIO_PMEM_RESP_EIO
            }
            None => {
                debug!("malformed virtio-pmem request");
                VIRTIO_PMEM_RESP_EIO
            }
        };
        if status != VIRTIO_PMEM_RESP_OK {
            self.stats.errors += 1;
        }
        match mem.write_obj(status.to_le(), resp_addr) {
            Ok(()) => RESP_LEN,
            Err(_) => 0,
        }
    }
}

impl VirtioDevice for Pmem {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_PMEM
    }

    fn num_queues(&self) -> usize {
        1
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config[..CONFIG_LEN], offset, data);
    }

    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        serve_available(index, queue, mem, |chain| {
            self.stats.requests += 1;
            self.handle_chain(chain, mem)
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        (self.flush)()
    }

    fn stats(&self) -> VirtioStats {
        self.stats
    }
}

/// The start and size a driver reads from a virtio-pmem configuration space.
pub fn parse_config(config: &[u8; CONFIG_LEN]) -> (u64, u64) {
    let start = u64::from_le_bytes(config[0..8].try_into().expect("8 bytes"));
    let size = u64::from_le_bytes(config[8..16].try_into().expect("8 bytes"));
    (start, size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::driver::{Driver, DATA as RESP, HDR as REQ, N, QSIZE, W};
    use std::sync::atomic::{AtomicU64, Ordering as AO};
    use std::sync::Arc;
    use virtio_bindings::virtio_mmio::*;
    use vm_memory::GuestAddress;

    const START: u64 = 0x2_0000_0000;
    const SIZE: u64 = 64 << 20;

    /// A driven Pmem whose flush counts calls (the counter is returned) and fails when
    /// `fail` is set.
    fn driver(fail: bool) -> (Driver, Arc<AtomicU64>) {
        let flushes = Arc::new(AtomicU64::new(0));
        let f = flushes.clone();
        let pmem = Pmem::new(
            START,
            SIZE,
            Box::new(move || {
                f.fetch_add(1, AO::SeqCst);
                if fail {
                    Err(io::Error::from_raw_os_error(libc::EIO))
                } else {
                    Ok(())
                }
            }),
        );
        (Driver::up(pmem), flushes)
    }

    #[test]
    fn identifies_as_pmem_with_start_and_size_in_config() {
        let (mut d, _) = driver(false);
        assert_eq!(d.read(VIRTIO_MMIO_DEVICE_ID), 27);
        let lo = d.read(VIRTIO_MMIO_CONFIG);
        let hi = d.read(VIRTIO_MMIO_CONFIG + 4);
        assert_eq!(u64::from(lo) | (u64::from(hi) << 32), START);
        let lo = d.read(VIRTIO_MMIO_CONFIG + 8);
        let hi = d.read(VIRTIO_MMIO_CONFIG + 12);
        assert_eq!(u64::from(lo) | (u64::from(hi) << 32), SIZE);
        // Past the end reads as zero.
        assert_eq!(d.read(VIRTIO_MMIO_CONFIG + 16), 0);
        let pmem = Pmem::new(START, SIZE, Box::new(|| Ok(())));
        assert_eq!(parse_config(&pmem.config), (START, SIZE));
        // Byte-wise config reads, as some drivers do.
        let mut b = [0u8; 1];
        pmem.read_config(8, &mut b);
        assert_eq!(b[0], SIZE.to_le_bytes()[0]);
    }

    #[test]
    fn flush_runs_the_host_sync_and_answers_ok_or_eio() {
        for (fail, answer) in [(false, VIRTIO_PMEM_RESP_OK), (true, VIRTIO_PMEM_RESP_EIO)] {
            let (mut d, flushes) = driver(fail);
            d.flush_request();
            assert_eq!(flushes.load(AO::SeqCst), 1);
            assert_eq!(d.response(), answer);
            assert_eq!(d.last_used(), (1, 4));
            assert_eq!(d.irq.count(), 1);
            assert_eq!(d.t.stats().errors, u64::from(fail));
            d.flush_request();
            assert_eq!(flushes.load(AO::SeqCst), 2);
            let s = d.t.stats();
            assert_eq!(
                (s.requests, s.flushes, s.errors),
                (2, 2, 2 * u64::from(fail))
            );
        }
    }

    #[test]
    fn unknown_request_type_answers_eio_without_flushing() {
        let (mut d, flushes) = driver(false);
        d.mem.write_obj(7u32, GuestAddress(REQ)).unwrap();
        d.submit(&[(REQ, 4, N), (RESP, 4, W)]);
        assert_eq!(d.response(), VIRTIO_PMEM_RESP_EIO);
        assert_eq!(flushes.load(AO::SeqCst), 0);
    }

    #[test]
    fn hostile_chains_get_an_error_or_are_dropped_and_the_device_lives_on() {
        let (mut d, flushes) = driver(false);
        // No request part at all.
        d.clear_response();
        d.submit(&[(RESP, 4, W)]);
        assert_eq!(d.response(), VIRTIO_PMEM_RESP_EIO);
        // No writable response: used with length 0, nothing written.
        d.submit(&[(REQ, 4, 0)]);
        assert_eq!(d.last_used(), (2, 0));
        // Response too short.
        d.submit(&[(REQ, 4, N), (RESP, 2, W)]);
        assert_eq!(d.last_used(), (3, 0));
        // Response outside guest memory.
        d.submit(&[(REQ, 4, N), (0x1_0000_0000, 4, W)]);
        assert_eq!(d.last_used(), (4, 0));
        // Request outside guest memory: answered with an error.
        d.clear_response();
        d.submit(&[(0x1_0000_0000, 4, N), (RESP, 4, W)]);
        assert_eq!(d.response(), VIRTIO_PMEM_RESP_EIO);
        // A chain whose next index runs off the table.
        d.mem
            .write_obj(VIRTIO_PMEM_REQ_TYPE_FLUSH, GuestAddress(REQ))
            .unwrap();
        d.clear_response();
        d.submit_raw(&[(REQ, 4, N, 1), (RESP, 4, W | N, 200)]);
        assert_eq!(d.response(), VIRTIO_PMEM_RESP_EIO);
        // A chain that loops back on itself.
        d.submit_raw(&[(REQ, 4, N, 0), (RESP, 4, W | N, 0)]);
        assert_eq!(flushes.load(AO::SeqCst), 0);
        // Still serving.
        d.flush_request();
        assert_eq!(d.response(), VIRTIO_PMEM_RESP_OK);
        assert_eq!(flushes.load(AO::SeqCst), 1);
        assert!(!d.needs_reset());
    }

    #[test]
    fn avail_index_far_ahead_needs_reset() {
        let (mut d, flushes) = driver(false);
        d.set_avail_idx(QSIZE + 5);
        d.notify();
        assert!(d.needs_reset());
        assert_eq!(flushes.load(AO::SeqCst), 0);
    }
}
