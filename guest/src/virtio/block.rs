//! The virtio-blk driver: reads, writes, flushes and GET_ID on disks `0..count()`.
//!
//! The data descriptors carry the caller's physical addresses (identity mapping), so a user
//! buffer goes to the device without a copy at CPL0.

use super::transport::{Device, D_NEXT, D_WRITE, F_VERSION_1, OFF_HDR, OFF_STATUS};
use super::{count, device};
use crate::abi::Error;

pub const ID_LEN: u64 = 20;

const F_SIZE_MAX: u64 = 1 << 1;
const F_SEG_MAX: u64 = 1 << 2;
pub(super) const F_RO: u64 = 1 << 5;
const F_BLK_SIZE: u64 = 1 << 6;
const F_FLUSH: u64 = 1 << 9;
pub(super) const F_INDIRECT: u64 = 1 << 28;
/// What the driver accepts of a block device's offer.
pub(super) const FEATURES: u64 =
    F_VERSION_1 | F_SIZE_MAX | F_SEG_MAX | F_RO | F_BLK_SIZE | F_FLUSH | F_INDIRECT;

pub(super) const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;

fn disk(i: usize) -> Result<&'static mut Device, Error> {
    if i < count() {
        Ok(device(i))
    } else {
        Err(Error::NoSuchDisk)
    }
}

/// Disk `i`, if it initialised and has not timed out since.
pub(super) fn ready_disk(i: usize) -> Result<&'static mut Device, Error> {
    let d = disk(i)?;
    if !d.ready {
        return Err(Error::NotReady);
    }
    Ok(d)
}

pub fn capacity(i: usize) -> Result<u64, Error> {
    Ok(disk(i)?.capacity)
}

pub fn read_only(i: usize) -> bool {
    disk(i).map(|d| d.features & F_RO != 0).unwrap_or(false)
}

pub fn rw(i: usize, write: bool, sector: u64, addr: u64, len: u64) -> Result<(), Error> {
    let d = ready_disk(i)?;
    if len == 0 || !len.is_multiple_of(512) {
        return Err(Error::BadArgument);
    }
    match sector.checked_add(len / 512) {
        Some(end) if end <= d.capacity => {}
        _ => return Err(Error::OutOfRange),
    }
    let seg = if d.size_max >= 512 {
        d.size_max as u64
    } else {
        4 << 20
    };
    let mut segs = (d.qsize - 2) as u64;
    if d.seg_max > 0 {
        segs = segs.min(d.seg_max as u64);
    }
    let per_request = (seg * segs) & !511;
    let typ = if write { T_OUT } else { T_IN };
    let mut off = 0;
    while off < len {
        let n = per_request.min(len - off);
        d.request(typ, sector + off / 512, addr + off, n, seg)?;
        off += n;
    }
    Ok(())
}

/// Without VIRTIO_BLK_F_FLUSH the device has no write cache to flush: nothing to do.
pub fn flush(i: usize) -> Result<(), Error> {
    let d = ready_disk(i)?;
    if d.features & F_FLUSH == 0 {
        return Ok(());
    }
    d.request(T_FLUSH, 0, 0, 0, 0)
}

pub fn get_id(i: usize, addr: u64) -> Result<(), Error> {
    ready_disk(i)?.request(T_GET_ID, 0, addr, ID_LEN, ID_LEN)
}

impl Device {
    /// virtio-blk configuration: capacity, then the limits the negotiated features enable.
    pub(super) fn read_blk_config(&mut self) {
        self.capacity = self.config64(0);
        self.size_max = if self.features & F_SIZE_MAX != 0 {
            self.config32(8)
        } else {
            0
        };
        self.seg_max = if self.features & F_SEG_MAX != 0 {
            self.config32(12)
        } else {
            0
        };
    }

    /// Status byte `slot` of queue memory (0: the request's own; hostile cases use more).
    pub(super) fn status_byte(&self, slot: u64) -> u8 {
        self.qmem_read(OFF_STATUS + slot)
    }

    pub(super) fn write_header(&self, typ: u32, sector: u64) {
        self.qmem_write(OFF_HDR, typ);
        self.qmem_write(OFF_HDR + 4, 0u32);
        self.qmem_write(OFF_HDR + 8, sector);
    }

    /// One request: header, the data at `addr` in descriptors of at most `seg` bytes, status.
    pub(super) fn request(
        &mut self,
        typ: u32,
        sector: u64,
        addr: u64,
        len: u64,
        seg: u64,
    ) -> Result<(), Error> {
        self.write_header(typ, sector);
        self.qmem_write(OFF_STATUS, 0xffu8);
        let device_writes = if typ == T_IN || typ == T_GET_ID {
            D_WRITE
        } else {
            0
        };
        self.write_linked(0, self.qmem_addr(OFF_HDR), 16, D_NEXT);
        let mut n: u16 = 1;
        let mut off = 0;
        while off < len {
            let l = seg.min(len - off);
            self.write_linked(n, addr + off, l as u32, D_NEXT | device_writes);
            n += 1;
            off += l;
        }
        self.write_linked(n, self.qmem_addr(OFF_STATUS), 1, D_WRITE);
        self.transact()?;
        match self.status_byte(0) {
            0 => Ok(()),
            1 => Err(Error::IoErr),
            2 => Err(Error::Unsupported),
            _ => Err(Error::BadStatus),
        }
    }
}
