//! virtio-rng (virtio 1.1, 5.4): one request queue whose device-writable buffers the device
//! fills with bytes from the host's getrandom(2), optionally at most so many bytes a second.
//!
//! Each chain is checked whole before a byte is written: every descriptor device-writable,
//! the part to be filled inside guest memory, the chain neither broken, looping nor longer
//! than [`MAX_CHAIN_DESCRIPTORS`]. A chain that fails completes with 0 bytes, which the spec
//! allows a driver to see. At most [`MAX_CHAIN_BYTES`] are filled per chain (less when the
//! rate limit's bucket is smaller), so a 4 GiB descriptor costs no more than a small one,
//! and the bytes pass through one fixed device-side buffer, so nothing the guest asks for
//! makes the device allocate.
//!
//! A limited device leaves the chain it cannot pay for on the ring and comes back to it when
//! the limiter's timer fires (its one event source), as virtio-net's transmit side does.

use super::{available, corrupt, pop, QueueCorrupt, VirtioDevice, VirtioStats};
use crate::net::rate_limiter::{RateLimit, RateLimiter, TokenBucketConfig};
use crate::GuestMemoryMmap;
use std::io;
use std::os::fd::RawFd;
use tracing::{debug, warn};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

/// The device's counters; `interrupts` is the transport's to fill.
pub use musubi_types::RngCounters;

/// Most bytes filled for one chain: what Linux's hwrng core reads at a time is far less, and
/// a bound keeps a pass over a full ring of huge buffers short.
pub const MAX_CHAIN_BYTES: usize = 64 << 10;
/// Descriptors followed per chain at most (indirect tables are followed whether or not they
/// were offered, and could otherwise be long). Drivers post one.
pub const MAX_CHAIN_DESCRIPTORS: usize = 64;
/// The one request queue.
pub const REQUEST_QUEUE: u16 = 0;
/// Bytes asked of getrandom(2) at a time: its reads up to 256 bytes never fail part-way,
/// and larger ones are served from the same ChaCha state in one call anyway.
const BOUNCE_BYTES: usize = 16 << 10;

/// Fills a buffer with random bytes; the host's getrandom(2) outside tests.
pub type EntropySource = Box<dyn FnMut(&mut [u8]) -> io::Result<()> + Send>;

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("virtio-rng: bytes_per_sec=0 would never serve a byte")]
    ZeroRate,
    #[error("virtio-rng: rate limiter timer: {0}")]
    Timer(#[source] io::Error),
}

/// Why a chain got no bytes, for the debug log.
type Fault = &'static str;

/// A virtio-rng device.
pub struct Rng {
    source: EntropySource,
    limiter: Option<RateLimiter>,
    /// Most bytes one chain gets: [`MAX_CHAIN_BYTES`], or the rate limit's bucket if it is
    /// smaller, so a limited guest is paced by its requests rather than let through once
    /// with a request larger than the bucket (which the limiter allows from a full bucket).
    per_chain: usize,
    bounce: Vec<u8>,
    counters: RngCounters,
}

impl Rng {
    /// A device fed by getrandom(2), limited to `bytes_per_sec` when given: a token bucket
    /// one second deep, full at start.
    pub fn new(bytes_per_sec: Option<u64>) -> Result<Rng, RngError> {
        let limiter = match bytes_per_sec {
            None => None,
            Some(0) => return Err(RngError::ZeroRate),
            Some(n) => Some(RateLimiter::new(&rate_limit(n)).map_err(RngError::Timer)?),
        };
        Ok(Rng::with_parts(
            Box::new(host_random),
            limiter,
            bytes_per_sec,
        ))
    }

    /// A device over any source and limiter (tests move the limiter's clock by hand);
    /// `bytes_per_sec` is the limiter's bucket, which bounds the bytes per chain.
    pub fn with_parts(
        source: EntropySource,
        limiter: Option<RateLimiter>,
        bytes_per_sec: Option<u64>,
    ) -> Rng {
        let per_chain = match bytes_per_sec {
            Some(n) if limiter.is_some() => {
                MAX_CHAIN_BYTES.min(usize::try_from(n).unwrap_or(usize::MAX).max(1))
            }
            _ => MAX_CHAIN_BYTES,
        };
        Rng {
            source,
            limiter,
            per_chain,
            bounce: vec![0; BOUNCE_BYTES.min(per_chain)],
            counters: RngCounters::default(),
        }
    }

    pub fn counters(&self) -> RngCounters {
        self.counters
    }

    /// Serves the chains available on the request queue until they run out or the limiter
    /// says wait. Returns how many were put on the used ring.
    fn serve(&mut self, q: &mut Queue, mem: &GuestMemoryMmap) -> Result<usize, QueueCorrupt> {
        if !q.ready() {
            return Ok(0);
        }
        let (_, pending) = available(REQUEST_QUEUE, q, mem)?;
        let mut used = 0;
        for _ in 0..pending {
            let chain = pop(REQUEST_QUEUE, q, mem)?;
            let head = chain.head_index();
            let len = match self.plan(chain, mem) {
                Ok((segments, total)) => {
                    if let Some(l) = &mut self.limiter {
                        if !l.consume(total as u64) {
                            // The chain stays available; the limiter's timer brings the device
                            // back to it.
                            self.counters.throttled += 1;
                            q.go_to_previous_position();
                            return Ok(used);
                        }
                    }
                    let written = self.fill(&segments, mem);
                    if written < total {
                        if let Some(l) = &mut self.limiter {
                            l.refund((total - written) as u64);
                        }
                    }
                    written
                }
                Err(why) => {
                    debug!("virtio-rng: chain {head} completed empty: {why}");
                    self.counters.errors += 1;
                    0
                }
            };
            // At most MAX_CHAIN_BYTES, so it fits.
            q.add_used(mem, head, len as u32)
                .map_err(|e| corrupt(REQUEST_QUEUE, "writing used ring", e))?;
            self.counters.requests += 1;
            self.counters.bytes += len as u64;
            used += 1;
        }
        Ok(used)
    }

    /// The guest ranges this chain's bytes go to, in order, at most `per_chain` in all, and
    /// their total; or why the chain gets none.
    fn plan(
        &self,
        chain: DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> Result<(Vec<(GuestAddress, usize)>, usize), Fault> {
        let mut segments = Vec::new();
        let mut total = 0usize;
        let mut last_has_next = false;
        for (k, d) in chain.enumerate() {
            if k == MAX_CHAIN_DESCRIPTORS {
                return Err("chain longer than 64 descriptors");
            }
            last_has_next = d.has_next();
            if !d.is_write_only() {
                return Err("device-readable descriptor");
            }
            // Only the part that will be written must lie in guest memory: a driver may post
            // a buffer longer than the device fills.
            let n = (d.len() as usize).min(self.per_chain - total);
            if n == 0 {
                continue;
            }
            if d.addr().0.checked_add(n as u64).is_none()
                || !mem.check_range(d.addr(), n, Permissions::Write)
            {
                return Err("buffer outside guest memory");
            }
            segments.push((d.addr(), n));
            total += n;
        }
        // The iterator stops quietly on a bad index, an unreadable table or a loop; a last
        // descriptor still asking for a successor is how that shows.
        if last_has_next {
            return Err("broken or looping chain");
        }
        if total == 0 {
            return Err("no device-writable bytes");
        }
        Ok((segments, total))
    }

    /// Writes random bytes over `segments`; returns how many reached the guest, from the
    /// first on (fewer than asked only if the host source or guest memory failed).
    fn fill(&mut self, segments: &[(GuestAddress, usize)], mem: &GuestMemoryMmap) -> usize {
        let mut written = 0;
        for &(addr, len) in segments {
            let mut off = 0;
            while off < len {
                let n = (len - off).min(self.bounce.len());
                let buf = &mut self.bounce[..n];
                if let Err(e) = (self.source)(buf) {
                    warn!("virtio-rng: getrandom: {e}");
                    return written;
                }
                // `plan` checked the whole range; `off < len` keeps this inside it.
                let at = GuestAddress(addr.0 + off as u64);
                if let Err(e) = mem.write_slice(buf, at) {
                    debug!("virtio-rng: writing random bytes: {e}");
                    return written;
                }
                off += n;
                written += n;
            }
        }
        written
    }
}

/// `bytes_per_sec` as a token bucket one second deep, full at start.
fn rate_limit(bytes_per_sec: u64) -> RateLimit {
    RateLimit {
        bandwidth: Some(TokenBucketConfig {
            size: bytes_per_sec,
            refill_time_ms: 1000,
            one_time_burst: 0,
        }),
        ops: None,
    }
}

fn host_random(buf: &mut [u8]) -> io::Result<()> {
    getrandom::fill(buf).map_err(|e| match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::other(e.to_string()),
    })
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn num_queues(&self) -> usize {
        1
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    /// virtio-rng has no configuration space.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn activate(&mut self, _acked_features: u64) {
        // A device restored from a snapshot may find a request its predecessor held back
        // still on the ring, and no doorbell will come for it: the timer's event brings the
        // device to it. After a driver's own set-up this finds nothing to do.
        if let Some(l) = &mut self.limiter {
            l.wake_soon();
        }
    }

    fn reset(&mut self) {
        // A refusal the timer has not answered yet would keep refusing the next driver
        // until it fires; the next request looks at the bucket again instead.
        if let Some(l) = &mut self.limiter {
            l.on_timer();
        }
    }

    fn process_queue(
        &mut self,
        index: u16,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<usize, QueueCorrupt> {
        if index != REQUEST_QUEUE {
            return Ok(0);
        }
        self.serve(queue, mem)
    }

    fn event_fds(&self) -> Vec<RawFd> {
        self.limiter.iter().map(|l| l.timer_fd()).collect()
    }

    fn process_event(
        &mut self,
        index: usize,
        queues: &mut [Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<Vec<u16>, QueueCorrupt> {
        let Some(l) = self.limiter.as_mut().filter(|_| index == 0) else {
            debug!(index, "virtio-rng: event the device does not have");
            return Ok(Vec::new());
        };
        l.on_timer();
        let Some(q) = queues.first_mut() else {
            return Ok(Vec::new());
        };
        Ok(if self.serve(q, mem)? > 0 {
            vec![REQUEST_QUEUE]
        } else {
            Vec::new()
        })
    }

    fn stats(&self) -> VirtioStats {
        let c = &self.counters;
        VirtioStats {
            requests: c.requests,
            bytes_read: c.bytes,
            errors: c.errors,
            ..VirtioStats::default()
        }
    }

    fn rng_counters(&self) -> Option<RngCounters> {
        Some(self.counters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::rate_limiter::ManualClock;
    use crate::virtio::driver::{Driver, DATA, INDIRECT, MEM_SIZE, N, QSIZE, W};
    use std::sync::atomic::{AtomicBool, Ordering as AO};
    use std::sync::Arc;
    use std::time::Duration;
    use virtio_bindings::virtio_mmio::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;

    const IND: u16 = VRING_DESC_F_INDIRECT as u16;

    /// A source that counts up from 1, so tests can tell which bytes it wrote.
    fn counting() -> EntropySource {
        let mut next = 0u8;
        Box::new(move |buf: &mut [u8]| {
            for b in buf {
                next = next.wrapping_add(1);
                *b = next;
            }
            Ok(())
        })
    }

    fn rng() -> Driver {
        Driver::up(Rng::with_parts(counting(), None, None))
    }

    /// A device limited to `bytes_per_sec` on a clock the test moves.
    fn limited(bytes_per_sec: u64) -> (Driver, ManualClock) {
        let clock = ManualClock::default();
        let l =
            RateLimiter::with_clock(&rate_limit(bytes_per_sec), Box::new(clock.clone())).unwrap();
        let d = Driver::up(Rng::with_parts(counting(), Some(l), Some(bytes_per_sec)));
        (d, clock)
    }

    fn counters(d: &Driver) -> RngCounters {
        d.t.rng_counters().unwrap()
    }

    /// A one-buffer request that must be served whole.
    fn read(d: &mut Driver, len: u32) {
        d.submit(&[(DATA, len, W)]);
        assert_eq!(d.next_used(), (0, len));
    }

    #[test]
    fn identifies_as_an_entropy_device_with_one_queue_and_no_config() {
        let mut d = Driver::new(Rng::new(None).unwrap());
        assert_eq!(d.read(VIRTIO_MMIO_DEVICE_ID), 4);
        d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(d.read(VIRTIO_MMIO_DEVICE_FEATURES), 1, "VERSION_1 only");
        d.write(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        assert_eq!(d.read(VIRTIO_MMIO_DEVICE_FEATURES), 0);
        d.write(VIRTIO_MMIO_QUEUE_SEL, 1);
        assert_eq!(d.read(VIRTIO_MMIO_QUEUE_NUM_MAX), 0, "only one queue");
        assert_eq!(d.read(VIRTIO_MMIO_CONFIG), 0);
        assert!(
            d.t.event_fds().is_empty(),
            "an unlimited device waits on nothing"
        );
    }

    #[test]
    fn host_bytes_fill_the_buffer_and_are_counted() {
        let mut d = Driver::up(Rng::new(None).unwrap());
        d.mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
        read(&mut d, 4096);
        let bytes = d.guest_bytes(DATA, 4096);
        // 4096 zeros from getrandom(2) would be a broken host, not bad luck.
        assert!(bytes.iter().filter(|&&b| b != 0).count() > 3500);
        let mut seen = [false; 256];
        bytes.iter().for_each(|&b| seen[usize::from(b)] = true);
        assert!(seen.iter().filter(|&&s| s).count() > 200);
        assert_eq!(d.irq.count(), 1);
        let c = counters(&d);
        assert_eq!(
            (c.requests, c.bytes, c.errors, c.throttled),
            (1, 4096, 0, 0)
        );
        assert_eq!(c.interrupts, 1);
        let s = d.t.stats();
        assert_eq!((s.requests, s.bytes_read), (1, 4096));
    }

    #[test]
    fn a_chain_of_several_buffers_is_filled_in_order() {
        let mut d = rng();
        d.submit(&[(DATA, 3, W), (DATA + 0x100, 0, W), (DATA + 0x200, 5, W)]);
        assert_eq!(d.next_used(), (0, 8));
        assert_eq!(d.guest_bytes(DATA, 3), [1, 2, 3]);
        assert_eq!(d.guest_bytes(DATA + 0x200, 5), [4, 5, 6, 7, 8]);
        // Indirect tables are followed too.
        d.write_table(INDIRECT, &[(DATA, 2, W | N, 1), (DATA + 0x10, 2, W, 0)]);
        d.submit_raw(&[(INDIRECT, 32, IND, 0)]);
        assert_eq!(d.next_used(), (0, 4));
        assert_eq!(d.guest_bytes(DATA, 2), [9, 10]);
    }

    #[test]
    fn huge_buffers_get_at_most_the_cap_per_chain() {
        let mut d = rng();
        d.submit(&[(DATA, 1 << 20, W)]);
        assert_eq!(d.next_used(), (0, MAX_CHAIN_BYTES as u32));
        // The rest of the buffer is untouched.
        assert_eq!(d.guest_bytes(DATA + MAX_CHAIN_BYTES as u64, 16), [0; 16]);
        // A 4 GiB length whose first 64 KiB are in guest memory: served, capped.
        d.submit(&[(DATA, u32::MAX, W)]);
        assert_eq!(d.next_used(), (0, MAX_CHAIN_BYTES as u32));
        // The cap is per chain, over all its buffers.
        let half = MAX_CHAIN_BYTES as u32 / 2 + 1;
        d.submit(&[(DATA, half, W), (DATA + 0x10_0000, half, W)]);
        assert_eq!(d.next_used(), (0, MAX_CHAIN_BYTES as u32));
        assert_eq!(counters(&d).bytes, 3 * MAX_CHAIN_BYTES as u64);
    }

    #[test]
    fn hostile_chains_complete_empty_and_the_device_lives_on() {
        let mut d = rng();
        let cases: [&[(u64, u32, u16)]; 6] = [
            // Device-readable only, and readable after a writable buffer.
            &[(DATA, 64, 0)],
            &[(DATA, 64, W), (DATA + 0x100, 64, 0)],
            // Outside guest memory, straddling its end, wrapping the address space.
            &[(0x1_0000_0000, 64, W)],
            &[(MEM_SIZE as u64 - 16, 64, W)],
            &[(u64::MAX - 8, 64, W)],
            // Nothing writable at all.
            &[(DATA, 0, W)],
        ];
        d.mem.write_slice(&[0xee; 256], GuestAddress(DATA)).unwrap();
        for (k, chain) in cases.iter().enumerate() {
            d.submit(chain);
            assert_eq!(d.next_used(), (0, 0), "case {k}");
        }
        assert_eq!(d.guest_bytes(DATA, 256), [0xee; 256], "nothing written");
        // A chain whose next index runs off the table, and one that loops.
        d.submit_raw(&[(DATA, 8, W | N, 200)]);
        assert_eq!(d.next_used(), (0, 0));
        d.submit_raw(&[(DATA, 8, W | N, 1), (DATA + 8, 8, W | N, 0)]);
        assert_eq!(d.next_used(), (0, 0));
        // An indirect table looping on itself longer than the device walks.
        let looped: Vec<_> = (0..QSIZE)
            .map(|i| (DATA, 1, W | N, (i + 1) % QSIZE))
            .collect();
        d.write_table(INDIRECT, &looped);
        d.submit_raw(&[(INDIRECT, 16 * u32::from(QSIZE), IND, 0)]);
        assert_eq!(d.next_used(), (0, 0));
        // More descriptors than the device follows.
        let n = MAX_CHAIN_DESCRIPTORS as u16 + 1;
        let long: Vec<_> = (0..n)
            .map(|i| {
                (
                    DATA + u64::from(i),
                    1,
                    if i + 1 < n { W | N } else { W },
                    i + 1,
                )
            })
            .collect();
        d.write_table(INDIRECT, &long);
        d.submit_raw(&[(INDIRECT, 16 * u32::from(n), IND, 0)]);
        assert_eq!(d.next_used(), (0, 0));
        let c = counters(&d);
        assert_eq!((c.requests, c.errors, c.bytes), (10, 10, 0));
        assert!(!d.needs_reset());
        read(&mut d, 16);
    }

    #[test]
    fn a_broken_ring_needs_a_reset() {
        let mut d = rng();
        d.set_avail_idx(QSIZE + 5);
        d.notify();
        assert!(d.needs_reset());
        d.restart();
        read(&mut d, 32);
    }

    #[test]
    fn a_failing_host_source_completes_what_it_wrote() {
        let fail = Arc::new(AtomicBool::new(true));
        let f = fail.clone();
        let source: EntropySource = Box::new(move |buf: &mut [u8]| {
            if f.load(AO::SeqCst) {
                Err(io::Error::from_raw_os_error(libc::EIO))
            } else {
                buf.fill(7);
                Ok(())
            }
        });
        let mut d = Driver::up(Rng::with_parts(source, None, None));
        d.submit(&[(DATA, 64, W)]);
        assert_eq!(d.next_used(), (0, 0));
        fail.store(false, AO::SeqCst);
        read(&mut d, 64);
        assert_eq!(d.guest_bytes(DATA, 64), [7; 64]);
    }

    #[test]
    fn a_limited_device_paces_requests_and_counts_the_waits() {
        let (mut d, clock) = limited(1000);
        // The bucket bounds each chain: a 4 KiB buffer gets 1000 bytes.
        d.submit(&[(DATA, 4096, W)]);
        assert_eq!(d.next_used(), (0, 1000));
        assert_eq!(d.t.event_fds().len(), 1, "the limiter's timer");
        // The bucket is empty: the next request waits on the ring, not completed.
        d.submit(&[(DATA, 500, W)]);
        assert_eq!(d.used_idx(), d.used_seen);
        assert_eq!(counters(&d).throttled, 1);
        // Doorbells meanwhile change nothing.
        d.notify();
        assert_eq!(d.used_idx(), d.used_seen);
        // Half a second later the timer fires and half the bucket is there.
        clock.advance(Duration::from_millis(500));
        let irqs = d.irq.count();
        d.t.process_event(0);
        assert_eq!(d.next_used(), (0, 500));
        assert_eq!(d.irq.count(), irqs + 1);
        let c = counters(&d);
        assert_eq!((c.requests, c.bytes, c.throttled), (2, 1500, 2));
        // After a reset the device looks at the bucket again rather than waiting for a
        // timer the old driver armed.
        d.submit(&[(DATA, 100, W)]);
        assert_eq!(d.used_idx(), d.used_seen);
        clock.advance(Duration::from_secs(1));
        d.restart();
        read(&mut d, 100);
    }

    #[test]
    fn a_restored_device_serves_the_request_its_predecessor_held_back() {
        let (mut d, _clock) = limited(100);
        read(&mut d, 100);
        d.submit(&[(DATA, 100, W)]);
        assert_eq!(d.used_idx(), d.used_seen, "held back");
        let saved = d.t.state();
        // A fresh device over the same memory, as a restore builds it: its bucket is full,
        // and no doorbell will come.
        let clock = ManualClock::default();
        let l = RateLimiter::with_clock(&rate_limit(100), Box::new(clock)).unwrap();
        let rng = Rng::with_parts(counting(), Some(l), Some(100));
        let mut r = Driver::new_in(rng, d.mem.clone());
        r.t.restore(&saved).unwrap();
        r.used_seen = d.used_seen;
        let mut pfd = libc::pollfd {
            fd: r.t.event_fds()[0],
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, alive for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(n, 1, "the restored device's timer did not fire within 5 s");
        r.t.process_event(0);
        assert_eq!(r.next_used(), (0, 100));
    }

    #[test]
    fn a_zero_rate_is_refused() {
        let e = Rng::new(Some(0)).err().unwrap().to_string();
        assert!(e.contains("bytes_per_sec=0"), "{e}");
        let d = Rng::new(Some(4096)).unwrap();
        assert_eq!(d.per_chain, 4096);
        assert_eq!(d.event_fds().len(), 1);
    }
}
