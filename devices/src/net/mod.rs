//! The host side of guest networking: the TAP interface frames go through, the rate
//! limiter that keeps one guest from taking all of the host's bandwidth, the control
//! queue's commands and the receive filter they set, and what a
//! replicated VM needs (the gate that holds its output, the announcement after failover).
//!
//! Kept apart from the virtio-net device so the device can run over any frame pipe (tests use
//! a socketpair) and the VMM can open or hand over TAPs without knowing virtio.

pub mod announce;
pub mod control;
pub mod output_gate;
pub mod rate_limiter;
pub mod tap;

pub use output_gate::OutputGate;
pub use rate_limiter::{RateLimit, RateLimiter, TokenBucketConfig};
pub use tap::{Tap, TapError};

/// Adds `O_NONBLOCK` to an open descriptor's flags: the TAP and the limiters' timers are
/// read from an event loop that must never sleep in a read.
pub(crate) fn set_nonblocking(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL take no pointers; the caller owns `fd` and keeps it open.
    let r = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        }
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
