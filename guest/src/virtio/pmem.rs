//! The virtio-pmem driver: the region a device announces and its flush request.

use super::transport::{Device, D_NEXT, D_WRITE, F_VERSION_1, OFF_HDR, OFF_STATUS};
use super::{device, pmem_count, MAX_DISKS};
use crate::abi::Error;

/// What the driver accepts of a virtio-pmem device's offer.
pub(super) const FEATURES: u64 = F_VERSION_1;

/// The region of virtio-pmem device `j`, if it initialised.
pub fn pmem_region(j: usize) -> Option<(u64, u64)> {
    if j < pmem_count() {
        let d = device(MAX_DISKS + j);
        d.ready.then_some(d.region)
    } else {
        None
    }
}

/// A virtio-pmem flush: `{type: u32 = 0}` device-readable, `{ret: u32}` device-writable;
/// the device answers once the region is durable on the host (`msync`).
pub fn pmem_flush(j: usize) -> Result<(), Error> {
    if j >= pmem_count() {
        return Err(Error::BadFd);
    }
    let d = device(MAX_DISKS + j);
    if !d.ready {
        return Err(Error::NotReady);
    }
    d.pmem_flush()
}

impl Device {
    /// virtio-pmem configuration: the region's `start` and `size`.
    pub(super) fn read_pmem_config(&mut self) {
        self.region = (self.config64(0), self.config64(8));
    }

    fn pmem_flush(&mut self) -> Result<(), Error> {
        let (req, resp) = (OFF_HDR, OFF_STATUS);
        self.qmem_write(req, 0u32);
        self.qmem_write(resp, 0xffff_ffffu32);
        self.write_linked(0, self.qmem_addr(req), 4, D_NEXT);
        self.write_linked(1, self.qmem_addr(resp), 4, D_WRITE);
        self.transact()?;
        match self.qmem_read::<u32>(resp) {
            0 => Ok(()),
            _ => Err(Error::IoErr),
        }
    }
}
