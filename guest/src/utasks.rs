//! Task bodies that run at CPL3. Each gets (buffer base, buffer bytes, parameter) — the
//! buffer is the task's arena below its stack — and ends with `ulib::exit`. They may use
//! only `ulib`, their arena and their stack.

use core::fmt::Write;

use crate::abi::STATUS_BLK_FAILED;
use crate::ulib::{self, JsonBytes, Line};

/// Bytes per block request: large requests keep the number of exits (and CPL0 work) small.
const CHUNK: u64 = 1 << 20;

fn chunk(buf_len: u64) -> u64 {
    CHUNK.min(buf_len & !511)
}

pub extern "C" fn user_hello(_buf: u64, _len: u64, _param: u64) -> ! {
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"user-hello\",\"cpl\":{},\"tsc\":{},\"tsc_hz\":{}}}",
        crate::arch::cpl(),
        ulib::rdtsc(),
        ulib::tsc_hz()
    );
    l.send();
    ulib::exit(0)
}

pub extern "C" fn blk_crc(buf: u64, buf_len: u64, _param: u64) -> ! {
    let hz = ulib::tsc_hz();
    let step = chunk(buf_len);
    let mut l = Line::new();
    let mut status = 0;
    l.push("{\"probe\":\"blk-crc\",\"disks\":[");
    for i in 0..ulib::disk_count() {
        if i > 0 {
            l.push(",");
        }
        let bytes = match ulib::disk_capacity(i) {
            Ok(sectors) => sectors * 512,
            Err(e) => {
                status = STATUS_BLK_FAILED;
                let _ = write!(
                    l,
                    "{{\"index\":{},\"ok\":false,\"error\":\"{}\"}}",
                    i,
                    e.name()
                );
                continue;
            }
        };
        let t0 = ulib::rdtsc();
        let mut crc = !0u32;
        let mut off = 0;
        let mut err = None;
        while off < bytes {
            let n = step.min(bytes - off);
            if let Err(e) = ulib::blk_read(i, off / 512, buf, n) {
                err = Some(e);
                break;
            }
            crc = ulib::crc32_update(crc, unsafe {
                core::slice::from_raw_parts(buf as *const u8, n as usize)
            });
            off += n;
        }
        let cycles = ulib::rdtsc() - t0;
        match err {
            None => {
                let _ = write!(
                    l,
                    "{{\"index\":{},\"bytes\":{},\"crc32\":\"{:#010x}\",\"ok\":true,\"cycles\":{},\"ns\":{}}}",
                    i,
                    bytes,
                    !crc,
                    cycles,
                    ulib::cycles_to_ns(cycles, hz)
                );
            }
            Some(e) => {
                status = STATUS_BLK_FAILED;
                let _ = write!(
                    l,
                    "{{\"index\":{},\"bytes\":{},\"ok\":false,\"error\":\"{}\",\"at_byte\":{}}}",
                    i,
                    bytes,
                    e.name(),
                    off
                );
            }
        }
    }
    l.push("]}\n");
    l.send();
    ulib::exit(status)
}

/// Byte at disk offset `o` is `((o / 512) * 131 + o % 512 + seed) % 256`.
fn fill(buf: &mut [u8], first_sector: u64, seed: u64) {
    for (s, sector) in buf.chunks_exact_mut(512).enumerate() {
        let v = (first_sector + s as u64)
            .wrapping_mul(131)
            .wrapping_add(seed) as u8;
        for (j, b) in sector.iter_mut().enumerate() {
            *b = v.wrapping_add(j as u8);
        }
    }
}

pub extern "C" fn blk_fill(buf: u64, buf_len: u64, seed: u64) -> ! {
    let hz = ulib::tsc_hz();
    let step = chunk(buf_len);
    let mut l = Line::new();
    let mut status = 0;
    let _ = write!(l, "{{\"probe\":\"blk-fill\",\"seed\":{},\"disks\":[", seed);
    for i in 0..ulib::disk_count() {
        if i > 0 {
            l.push(",");
        }
        let bytes = ulib::disk_capacity(i).map(|s| s * 512).unwrap_or(0);
        let t0 = ulib::rdtsc();
        let mut off = 0;
        let mut err = None;
        while off < bytes {
            let n = step.min(bytes - off);
            let data = unsafe { core::slice::from_raw_parts_mut(buf as *mut u8, n as usize) };
            fill(data, off / 512, seed);
            if let Err(e) = ulib::blk_write(i, off / 512, buf, n) {
                err = Some(("write", e));
                break;
            }
            off += n;
        }
        if err.is_none() {
            if let Err(e) = ulib::blk_flush(i) {
                err = Some(("flush", e));
            }
        }
        let cycles = ulib::rdtsc() - t0;
        let _ = write!(l, "{{\"index\":{},\"bytes\":{},", i, off);
        match err {
            None => l.push("\"ok\":true"),
            Some((what, e)) => {
                status = STATUS_BLK_FAILED;
                let _ = write!(l, "\"ok\":false,\"error\":\"{} {}\"", what, e.name());
            }
        }
        let _ = write!(
            l,
            ",\"cycles\":{},\"ns\":{}}}",
            cycles,
            ulib::cycles_to_ns(cycles, hz)
        );
    }
    let _ = writeln!(l, "],\"ok\":{}}}", status == 0);
    l.send();
    ulib::exit(status)
}

pub extern "C" fn blk_id(buf: u64, _buf_len: u64, _param: u64) -> ! {
    let mut l = Line::new();
    let mut status = 0;
    l.push("{\"probe\":\"blk-id\",\"disks\":[");
    for i in 0..ulib::disk_count() {
        if i > 0 {
            l.push(",");
        }
        let id = unsafe { core::slice::from_raw_parts_mut(buf as *mut u8, 20) };
        id.fill(0);
        match ulib::blk_get_id(i, buf) {
            Ok(()) => {
                let n = id.iter().position(|&b| b == 0).unwrap_or(20);
                let _ = write!(
                    l,
                    "{{\"index\":{},\"ok\":true,\"id\":\"{}\"}}",
                    i,
                    JsonBytes(&id[..n])
                );
            }
            Err(e) => {
                status = STATUS_BLK_FAILED;
                let _ = write!(
                    l,
                    "{{\"index\":{},\"ok\":false,\"error\":\"{}\"}}",
                    i,
                    e.name()
                );
            }
        }
    }
    l.push("]}\n");
    l.send();
    ulib::exit(status)
}

/// N iterations of register increments at CPL3 (the CPU loop of the Mint paper); N = 0
/// spins until the task timeout ends it.
pub extern "C" fn spin(_buf: u64, _len: u64, n: u64) -> ! {
    let t0 = ulib::rdtsc();
    let mut i = 0u64;
    let mut x = 0u64;
    while n == 0 || i < n {
        x = core::hint::black_box(x.wrapping_add(i));
        i += 1;
    }
    let cycles = ulib::rdtsc() - t0;
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"spin\",\"iterations\":{},\"cycles\":{},\"ns\":{}}}",
        n,
        cycles,
        ulib::cycles_to_ns(cycles, ulib::tsc_hz())
    );
    l.send();
    ulib::exit(0)
}

/// Reads an address no page table maps (PML4 slot 254): the kernel must report the #PF
/// and end the task.
pub const FAULT_ADDR: u64 = 0x7f00_0000_0000;

pub extern "C" fn fault(_buf: u64, _len: u64, _param: u64) -> ! {
    let v = unsafe { core::ptr::read_volatile(FAULT_ADDR as *const u64) };
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"fault\",\"ok\":false,\"error\":\"no fault, read {:#x}\"}}",
        v
    );
    l.send();
    ulib::exit(crate::abi::STATUS_USER_FAULT)
}
