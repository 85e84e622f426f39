//! The virtio-rng driver: one device-writable descriptor over the caller's buffer (its
//! physical address: identity mapping), so the random bytes reach a user buffer without a
//! copy at CPL0.

use super::transport::{D_WRITE, F_VERSION_1};
use super::{device, HAS_RNG, RNG_SLOT};
use crate::abi::{Error, RNG_MAX_REQUEST};
use core::sync::atomic::Ordering;

/// What the driver accepts of a virtio-rng device's offer.
pub(super) const FEATURES: u64 = F_VERSION_1;

/// Asks the device for up to `len` (at most `RNG_MAX_REQUEST`) random bytes at `addr`;
/// returns how many it wrote, which may be fewer (a rate-limited device fills at most its
/// bucket per request) or none (a device that found the request malformed).
pub fn rng_read(addr: u64, len: u64) -> Result<u64, Error> {
    if !HAS_RNG.load(Ordering::Relaxed) {
        return Err(Error::NoDevice);
    }
    let d = device(RNG_SLOT);
    if !d.ready {
        return Err(Error::NotReady);
    }
    if len == 0 || len > RNG_MAX_REQUEST {
        return Err(Error::BadArgument);
    }
    d.write_linked(0, addr, len as u32, D_WRITE);
    d.transact()?;
    // A device claiming more than the buffer holds is believed only up to its size.
    Ok(u64::from(d.last_used_len()).min(len))
}
