//! The host side of guest networking: the TAP interface frames go through, and the rate
//! limiter that keeps one guest from taking all of the host's bandwidth.
//!
//! Kept apart from the virtio-net device so the device can run over any frame pipe (tests use
//! a socketpair) and the VMM can open or hand over TAPs without knowing virtio.

pub mod rate_limiter;
pub mod tap;

pub use rate_limiter::{RateLimit, RateLimiter, TokenBucketConfig};
pub use tap::{Tap, TapError};
