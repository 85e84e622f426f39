//! The `hostile-virtio` task's driver side: chains malformed on purpose, to check that the
//! VMM answers each with a device error (or drops it) and keeps serving.

use super::block::{ready_disk, F_INDIRECT, T_IN};
use super::transport::{
    Desc, Device, Reg, D_INDIRECT, D_NEXT, D_WRITE, OFF_HDR, OFF_SCRATCH, OFF_STATUS,
};
use crate::abi::Error;
use crate::timer;

/// How long a case waits for the device: a VMM that drops a chain never answers it.
const HOSTILE_TIMEOUT_MS: u64 = 300;

pub struct CaseResult {
    pub name: &'static str,
    pub completed: u16,
    pub status: u8,
}

pub struct Hostile {
    pub results: [CaseResult; 12],
    pub cases: usize,
    pub good_read: bool,
    pub error: &'static str,
}

/// Placeholder address for "this case's own status byte".
const STATUS_SLOT: u64 = u64::MAX;

/// Posts one hostile chain (descriptor `next` fields relative to the case's first slot),
/// or a bare head / notify, and waits a bounded time for the used ring. Each case uses its
/// own descriptors and status byte, so a late completion of one case cannot be mistaken
/// for another's.
fn hostile_case(
    d: &mut Device,
    h: &mut Hostile,
    name: &'static str,
    descs: &[Desc],
    head: Option<u16>,
    notify: u32,
) {
    let k = h.cases as u16;
    let first = k * 4;
    let status_slot = 1 + k as u64;
    let status = d.qmem_addr(OFF_STATUS + status_slot);
    d.qmem_write(OFF_STATUS + status_slot, 0xffu8);
    for (j, desc) in descs.iter().enumerate() {
        let mut desc = *desc;
        if desc.flags & D_NEXT != 0 {
            desc.next = (first + desc.next) % d.qsize;
        }
        if desc.addr == STATUS_SLOT {
            desc.addr = status;
        }
        d.write_desc(first + j as u16, desc);
    }
    if let Some(head) = head {
        d.push_avail(head);
    } else if !descs.is_empty() {
        d.push_avail(first % d.qsize);
    }
    d.w32(Reg::QueueNotify, notify);
    let used_before = d.used_seen;
    timer::wait_for(HOSTILE_TIMEOUT_MS, || d.used_idx() != used_before);
    let completed = d.drain_used();
    h.results[h.cases] = CaseResult {
        name,
        completed,
        status: d.status_byte(status_slot),
    };
    h.cases += 1;
}

/// Misbehaves on purpose on disk `i` (see README, `hostile-virtio`), then resets the device
/// and checks that one ordinary read still works.
pub fn hostile(i: usize, ram_end: u64, spare: u64) -> Result<Hostile, Error> {
    let d = ready_disk(i)?;
    let mut h = Hostile {
        results: [const {
            CaseResult {
                name: "",
                completed: 0,
                status: 0,
            }
        }; 12],
        cases: 0,
        good_read: false,
        error: "",
    };
    const BAD: u64 = 0xffff_ffff_f000;
    let hdr = d.qmem_addr(OFF_HDR);
    let scratch = d.qmem_addr(OFF_SCRATCH);
    d.write_header(T_IN, 0);

    let st = Desc {
        addr: STATUS_SLOT,
        len: 1,
        flags: D_WRITE,
        next: 0,
    };
    let hd = Desc {
        addr: hdr,
        len: 16,
        flags: D_NEXT,
        next: 1,
    };
    let data = |addr: u64, len: u32, flags: u16| Desc {
        addr,
        len,
        flags: flags | D_NEXT,
        next: 2,
    };
    let run = hostile_case;

    run(
        d,
        &mut h,
        "data-beyond-physical",
        &[hd, data(BAD, 512, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "data-past-ram",
        &[hd, data(ram_end, 4096, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "header-beyond-physical",
        &[Desc { addr: BAD, ..hd }, data(scratch, 512, D_WRITE), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "data-not-device-writable",
        &[hd, data(scratch, 512, 0), st],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "chain-loop",
        &[
            hd,
            Desc {
                addr: scratch,
                len: 512,
                flags: D_NEXT | D_WRITE,
                next: 0,
            },
        ],
        None,
        0,
    );
    run(
        d,
        &mut h,
        "length-4g",
        &[hd, data(spare, 0xffff_ffff, D_WRITE), st],
        None,
        0,
    );
    if d.features & F_INDIRECT != 0 {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for w in 0..512u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            d.qmem_write(OFF_SCRATCH + w * 8, x | 1 << 47);
        }
        run(
            d,
            &mut h,
            "indirect-garbage",
            &[Desc {
                addr: scratch,
                len: 4096,
                flags: D_INDIRECT,
                next: 0,
            }],
            None,
            0,
        );
        run(
            d,
            &mut h,
            "indirect-beyond-physical",
            &[Desc {
                addr: BAD,
                len: 256,
                flags: D_INDIRECT,
                next: 0,
            }],
            None,
            0,
        );
    }
    run(d, &mut h, "head-out-of-range", &[], Some(d.qsize + 3), 0);
    run(d, &mut h, "notify-unset-queue-7", &[], None, 7);
    // The avail index far ahead of what was posted: the device would find stale heads.
    d.set_avail_idx(d.avail_idx.wrapping_add(d.qsize * 2 + 5));
    run(d, &mut h, "avail-index-jump", &[], None, 0);

    match d.init() {
        Ok(()) => {
            h.good_read = d.request(T_IN, 0, scratch, 512, 512).is_ok();
            if !h.good_read {
                h.error = "read of sector 0 after reset failed";
            }
        }
        Err(e) => h.error = e,
    }
    Ok(h)
}
