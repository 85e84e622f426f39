//! Token buckets that cap a device's bandwidth and frame rate, with a timer to wake the
//! device when a refused transfer would be allowed.
//!
//! The semantics are those of Firecracker's `rate=`: a bucket holds at most `size` tokens,
//! refills completely in `refill_time_ms` at a constant rate, starts full, and may have a
//! one-time burst that is spent first and never refills. A transfer larger than the whole
//! bucket is let through once the bucket is full, leaving it in debt, so an over-sized frame
//! is slowed down rather than blocked forever.
//!
//! Tokens are counted in token-nanoseconds (tokens times the refill time), so refilling
//! after any elapsed time is exact integer arithmetic and nothing is lost to rounding.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};
use vmm_sys_util::timerfd::TimerFd;

/// One bucket's settings. A zero `size` or `refill_time_ms` means no limit, as in
/// Firecracker's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucketConfig {
    /// Tokens (bytes or frames) the bucket holds when full.
    pub size: u64,
    /// Time for an empty bucket to fill up again.
    pub refill_time_ms: u64,
    /// Extra tokens available once, at start, before the bucket itself is drawn on.
    pub one_time_burst: u64,
}

/// Limits for one direction of a device: bytes and frames, either or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimit {
    pub bandwidth: Option<TokenBucketConfig>,
    pub ops: Option<TokenBucketConfig>,
}

/// Where the limiter reads the time, so tests can move time by hand instead of sleeping.
pub trait Clock: Send {
    /// A monotonic time since some fixed point.
    fn now(&self) -> Duration;
}

struct Monotonic(Instant);

impl Clock for Monotonic {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

#[derive(Debug)]
struct TokenBucket {
    size: u64,
    refill_ns: u128,
    /// Token-nanoseconds available; negative after a transfer larger than the bucket.
    budget: i128,
    burst: u64,
    last: Duration,
}

impl TokenBucket {
    fn new(cfg: &TokenBucketConfig, now: Duration) -> Option<TokenBucket> {
        if cfg.size == 0 || cfg.refill_time_ms == 0 {
            return None;
        }
        let refill_ns = u128::from(cfg.refill_time_ms) * 1_000_000;
        Some(TokenBucket {
            size: cfg.size,
            refill_ns,
            budget: (u128::from(cfg.size) * refill_ns) as i128,
            burst: cfg.one_time_burst,
            last: now,
        })
    }

    fn capacity(&self) -> i128 {
        (u128::from(self.size) * self.refill_ns) as i128
    }

    fn refill(&mut self, now: Duration) {
        let elapsed = now.saturating_sub(self.last).as_nanos();
        self.last = self.last.max(now);
        let added = elapsed.saturating_mul(u128::from(self.size));
        let added = i128::try_from(added).unwrap_or(i128::MAX);
        self.budget = self.budget.saturating_add(added).min(self.capacity());
    }

    /// Token-nanoseconds `n` tokens need from the refilling part, after the burst.
    fn needed(&self, n: u64) -> i128 {
        let from_bucket = n.saturating_sub(self.burst);
        if from_bucket > self.size {
            // Over-sized: allowed from a full bucket only.
            self.capacity()
        } else {
            (u128::from(from_bucket) * self.refill_ns) as i128
        }
    }

    fn can_take(&self, n: u64) -> bool {
        self.budget >= self.needed(n)
    }

    fn take(&mut self, n: u64) {
        let from_burst = n.min(self.burst);
        self.burst -= from_burst;
        let rest = u128::from(n - from_burst) * self.refill_ns;
        self.budget = self
            .budget
            .saturating_sub(i128::try_from(rest).unwrap_or(i128::MAX));
    }

    /// Gives back what a `take(n)` took from the refilling part (the burst is not restored:
    /// it is a one-time allowance either way).
    fn give_back(&mut self, n: u64) {
        let back = i128::try_from(u128::from(n) * self.refill_ns).unwrap_or(i128::MAX);
        self.budget = self.budget.saturating_add(back).min(self.capacity());
    }

    /// How long until `n` tokens can be taken.
    fn wait(&self, n: u64) -> Duration {
        let deficit = self.needed(n) - self.budget;
        if deficit <= 0 {
            return Duration::ZERO;
        }
        let per_ns = i128::from(self.size);
        let ns = (deficit + per_ns - 1) / per_ns;
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

/// A bandwidth and frame-rate limiter for one direction of one device.
pub struct RateLimiter {
    bytes: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    timer: TimerFd,
    blocked: bool,
    clock: Box<dyn Clock>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("bytes", &self.bytes)
            .field("ops", &self.ops)
            .field("blocked", &self.blocked)
            .finish()
    }
}

/// Shortest timer armed: a zero duration would disarm the timerfd instead.
const MIN_WAIT: Duration = Duration::from_micros(1);

impl RateLimiter {
    pub fn new(limit: &RateLimit) -> io::Result<RateLimiter> {
        RateLimiter::with_clock(limit, Box::new(Monotonic(Instant::now())))
    }

    /// A limiter reading time from `clock`; its timer still runs on the real clock.
    pub fn with_clock(limit: &RateLimit, clock: Box<dyn Clock>) -> io::Result<RateLimiter> {
        let timer = TimerFd::new().map_err(io::Error::from)?;
        // Non-blocking, so a spurious wake-up can read the timer without sleeping.
        super::set_nonblocking(timer.as_raw_fd())?;
        let now = clock.now();
        Ok(RateLimiter {
            bytes: limit
                .bandwidth
                .as_ref()
                .and_then(|c| TokenBucket::new(c, now)),
            ops: limit.ops.as_ref().and_then(|c| TokenBucket::new(c, now)),
            timer,
            blocked: false,
            clock,
        })
    }

    /// Takes `bytes` bytes and one frame if both buckets have them. If not, nothing is taken,
    /// the timer is armed for when they will, and further calls refuse until the owner has
    /// handled the timer (`on_timer`): a blocked device stays quiet rather than polling.
    pub fn consume(&mut self, bytes: u64) -> bool {
        if self.blocked {
            return false;
        }
        let now = self.clock.now();
        let mut wait = Duration::ZERO;
        for (bucket, n) in [(&mut self.bytes, bytes), (&mut self.ops, 1)] {
            if let Some(b) = bucket {
                b.refill(now);
                if !b.can_take(n) {
                    wait = wait.max(b.wait(n));
                }
            }
        }
        if wait > Duration::ZERO {
            self.blocked = true;
            if let Err(e) = self.timer.reset(wait.max(MIN_WAIT), None) {
                // Without the timer nothing would wake the device: let this one through.
                tracing::warn!("rate limiter timer: {e}; not limiting");
                self.blocked = false;
            } else {
                return false;
            }
        }
        for (bucket, n) in [(&mut self.bytes, bytes), (&mut self.ops, 1)] {
            if let Some(b) = bucket {
                b.take(n);
            }
        }
        true
    }

    /// Returns what a successful `consume(bytes)` took, for a transfer that did not happen
    /// after all (the backend could not take the frame yet).
    pub fn refund(&mut self, bytes: u64) {
        for (bucket, n) in [(&mut self.bytes, bytes), (&mut self.ops, 1)] {
            if let Some(b) = bucket {
                b.give_back(n);
            }
        }
    }

    /// Arms the timer to fire at once, so the owner looks again at work that may be waiting
    /// without anything else to bring it back (a device restored with a request its
    /// predecessor held back still on the ring).
    pub fn wake_soon(&mut self) {
        if let Err(e) = self.timer.reset(MIN_WAIT, None) {
            tracing::warn!("rate limiter timer: {e}");
        }
    }

    /// Whether a refused transfer is waiting for the timer.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// The timer to watch for readability while blocked.
    pub fn timer_fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }

    /// Handles the timer's expiry (or a spurious wake-up): transfers may be tried again.
    pub fn on_timer(&mut self) {
        // Non-blocking: an early call finds nothing to read, which is fine.
        let _ = self.timer.wait();
        self.blocked = false;
    }

    /// Whether the timer is armed; for tests and diagnostics.
    pub fn timer_armed(&self) -> bool {
        self.timer.is_armed().unwrap_or(false)
    }
}

/// A clock the tests move by hand.
#[cfg(any(test, feature = "fuzzing"))]
#[derive(Clone, Default)]
pub struct ManualClock(pub std::sync::Arc<std::sync::atomic::AtomicU64>);

#[cfg(any(test, feature = "fuzzing"))]
impl ManualClock {
    pub fn advance(&self, d: Duration) {
        self.0
            .fetch_add(d.as_nanos() as u64, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(any(test, feature = "fuzzing"))]
impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(size: u64, refill_time_ms: u64, one_time_burst: u64) -> Option<TokenBucketConfig> {
        Some(TokenBucketConfig {
            size,
            refill_time_ms,
            one_time_burst,
        })
    }

    fn limiter(limit: RateLimit) -> (RateLimiter, ManualClock) {
        let clock = ManualClock::default();
        (
            RateLimiter::with_clock(&limit, Box::new(clock.clone())).unwrap(),
            clock,
        )
    }

    #[test]
    fn no_buckets_never_limit() {
        let (mut l, _) = limiter(RateLimit::default());
        for _ in 0..1000 {
            assert!(l.consume(1 << 30));
        }
        // Zero size or refill time is Firecracker's way of saying "no limit".
        let (mut l, _) = limiter(RateLimit {
            bandwidth: bucket(0, 100, 0),
            ops: bucket(10, 0, 0),
        });
        assert!(l.consume(1 << 30));
        assert!(!l.timer_armed());
    }

    #[test]
    fn bandwidth_blocks_then_refills_at_its_rate() {
        // 1000 bytes per 100 ms.
        let (mut l, clock) = limiter(RateLimit {
            bandwidth: bucket(1000, 100, 0),
            ops: None,
        });
        assert!(l.consume(600));
        assert!(l.consume(400));
        assert!(!l.consume(1));
        assert!(l.is_blocked());
        assert!(l.timer_armed());
        // Blocked: refused without looking at the clock until the timer is handled.
        clock.advance(Duration::from_millis(100));
        assert!(!l.consume(1));
        l.on_timer();
        assert!(!l.is_blocked());
        assert!(l.consume(1000));
        // Half the refill time gives half the bucket, exactly.
        l.consume(1);
        l.on_timer();
        clock.advance(Duration::from_millis(50));
        assert!(l.consume(500));
        assert!(!l.consume(1));
    }

    #[test]
    fn the_timer_is_armed_for_when_the_tokens_are_there() {
        let (mut l, _) = limiter(RateLimit {
            bandwidth: bucket(1000, 1000, 0),
            ops: None,
        });
        assert!(l.consume(1000));
        assert!(!l.consume(500));
        let b = l.bytes.as_ref().unwrap();
        assert_eq!(b.wait(500), Duration::from_millis(500));
    }

    #[test]
    fn frames_are_counted_apart_from_bytes() {
        let (mut l, clock) = limiter(RateLimit {
            bandwidth: bucket(1 << 20, 100, 0),
            ops: bucket(2, 100, 0),
        });
        assert!(l.consume(10));
        assert!(l.consume(10));
        assert!(!l.consume(10), "third frame in the same instant");
        l.on_timer();
        clock.advance(Duration::from_millis(50));
        assert!(l.consume(10));
        assert!(!l.consume(10));
    }

    #[test]
    fn a_refused_transfer_takes_nothing() {
        let (mut l, _) = limiter(RateLimit {
            bandwidth: bucket(100, 100, 0),
            ops: bucket(1, 100, 0),
        });
        assert!(l.consume(100));
        assert!(!l.consume(50));
        let (bytes, ops) = (l.bytes.as_ref().unwrap(), l.ops.as_ref().unwrap());
        assert_eq!((bytes.budget, ops.budget), (0, 0));
    }

    #[test]
    fn the_one_time_burst_is_spent_first_and_not_refilled() {
        let (mut l, clock) = limiter(RateLimit {
            bandwidth: bucket(100, 100, 1000),
            ops: None,
        });
        assert!(l.consume(1000));
        assert!(l.consume(100));
        assert!(!l.consume(1));
        l.on_timer();
        clock.advance(Duration::from_secs(10));
        assert!(l.consume(100));
        assert!(!l.consume(1), "the burst came back");
    }

    #[test]
    fn an_oversized_transfer_passes_from_a_full_bucket_and_leaves_debt() {
        let (mut l, clock) = limiter(RateLimit {
            bandwidth: bucket(100, 100, 0),
            ops: None,
        });
        assert!(l.consume(300));
        l.on_timer();
        clock.advance(Duration::from_millis(100));
        assert!(!l.consume(1), "still 100 in debt after one refill time");
        l.on_timer();
        clock.advance(Duration::from_millis(200));
        assert!(l.consume(300));
    }

    #[test]
    fn a_refund_gives_the_tokens_back() {
        let (mut l, _) = limiter(RateLimit {
            bandwidth: bucket(100, 100, 0),
            ops: bucket(1, 100, 0),
        });
        assert!(l.consume(100));
        l.refund(100);
        assert!(l.consume(100));
    }

    #[test]
    fn the_real_timer_fires() {
        let mut l = RateLimiter::new(&RateLimit {
            bandwidth: None,
            ops: bucket(1, 1, 0),
        })
        .unwrap();
        assert!(l.consume(1));
        assert!(!l.consume(1));
        let mut pfd = libc::pollfd {
            fd: l.timer_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, alive for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(n, 1, "timer did not fire within 5 s");
        l.on_timer();
        assert!(l.consume(1));
    }
}
