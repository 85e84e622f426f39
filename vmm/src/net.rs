//! Turns a `--net` into a virtio-net device: opens (or creates) its TAP, one queue per
//! queue pair, gives a created TAP's host end its address, and sets the rate limits.

use crate::config::net::{NetConfig, RateLimit};
use devices::net::rate_limiter::{RateLimit as Buckets, TokenBucketConfig};
use devices::net::tap::Tap;
use devices::virtio::net::{Net, NetConfig as DeviceConfig};
use std::os::fd::{FromRawFd, OwnedFd};

/// A `--net` that cannot be had, named as the flag gave it.
#[derive(Debug, thiserror::Error)]
#[error("{name}: {why}")]
pub struct NetError {
    name: String,
    why: String,
}

/// The device `n` describes. Errors name the flag and the TAP.
pub fn open(n: &NetConfig) -> Result<Net, NetError> {
    let err = |why: String| NetError {
        name: n.name(),
        why,
    };
    let taps = match (&n.tap, &n.fd) {
        (Some(name), _) => {
            Tap::open_queues(name, n.queue_pairs()).map_err(|e| err(e.to_string()))?
        }
        (None, Some(fds)) if n.num_queues != fds.queues() => {
            return Err(err(format!(
                "num_queues={}: each handed-over descriptor is one TAP queue, so one queue pair",
                n.num_queues
            )))
        }
        (None, Some(fds)) => {
            let taps = fds
                .0
                .iter()
                .map(|&fd| handed_over(fd).map_err(&err))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(why) = not_one_multiqueue_tap(&taps) {
                return Err(err(why));
            }
            taps
        }
        (None, None) => return Err(err("give tap=NAME or fd=N".into())),
    };
    if let Some(ip) = n.ip {
        let mask = n.mask.unwrap_or(std::net::Ipv4Addr::new(255, 255, 255, 0));
        taps[0]
            .set_up_with_address(ip, mask)
            .map_err(|e| err(e.to_string()))?;
    }
    Net::new(DeviceConfig {
        taps,
        mac: n.mac.map(|m| m.0),
        queue_size: n.queue_size,
        rx_rate: n.rate.map(buckets),
        tx_rate: n.rate.map(buckets),
    })
    .map_err(|e| err(e.to_string()))
}

/// The TAP queue descriptor `fd` this process was handed, owned from here on.
fn handed_over(fd: i32) -> Result<Tap, String> {
    // The descriptor must be open in this process: fstat says so without taking it.
    // SAFETY: fstat only writes the stat buffer it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a closed descriptor makes it fail with EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(format!(
            "descriptor {fd} is not open in this process: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: the descriptor is open (checked above) and was handed to this process for the
    // device to own; nothing else in the VMM uses it (`check_distinct` refused a second
    // device on it).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Tap::from_fd(owned).map_err(|e| e.to_string())
}

/// Why several handed-over queues cannot be one device's pairs, if they cannot: each must
/// be a queue of one multiqueue TAP, or the guest's flows would leave by different
/// interfaces.
fn not_one_multiqueue_tap(taps: &[Tap]) -> Option<String> {
    let first = taps.first()?;
    if taps.len() > 1 && !first.is_multi_queue() {
        return Some(format!(
            "{} is not a multiqueue TAP (IFF_MULTI_QUEUE), so it has one queue to hand over",
            first.name()
        ));
    }
    taps.iter().find(|t| t.name() != first.name()).map(|t| {
        format!(
            "the descriptors are queues of {} and {}; a device's queues must be one TAP's",
            first.name(),
            t.name()
        )
    })
}

/// A limit of so much a second as two token buckets a second deep.
fn buckets(r: RateLimit) -> Buckets {
    let bucket = |per_s: u64| TokenBucketConfig {
        size: per_s,
        refill_time_ms: 1000,
        one_time_burst: 0,
    };
    Buckets {
        bandwidth: r.bytes_per_s.map(bucket),
        ops: r.packets_per_s.map(bucket),
    }
}
