//! Task bodies that run at CPL3. Each gets (buffer base, buffer bytes, parameter) — the
//! buffer is the task's arena below its stack — and ends with `ulib::exit`. They may use
//! only `ulib`, their arena and their stack.

use core::fmt::Write;

use crate::abi::{RNG_MAX_REQUEST, STATUS_BLK_FAILED, STATUS_RNG_FAILED};
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
        l.item(i);
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
            // SAFETY: the first `n <= buf_len` bytes of this task's arena, just read into by
            // the device; nothing else refers to them.
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

/// A fill's seed and least duration in ms (`ms=`, 0 for none) as one task parameter, or
/// `None` when either is missing or too large to pack.
pub fn fill_param(seed: Option<u64>, ms: Option<u64>) -> Option<u64> {
    let (seed, ms) = (seed?, ms.unwrap_or(0));
    (seed >> 32 == 0 && ms >> 32 == 0).then_some(seed | ms << 32)
}

/// Waits until the share of the fill's `ms` that `done` of `total` bytes stand for has
/// passed since `t0`, so that a fill of `ms` lasts at least that long.
fn pace(t0: u64, hz: u64, ms: u64, done: u64, total: u64) {
    if ms == 0 || total == 0 {
        return;
    }
    let share = ms as u128 * hz as u128 * done as u128 / (1000 * total as u128);
    let due = t0.saturating_add(share as u64);
    while ulib::rdtsc() < due {
        core::hint::spin_loop();
    }
}

pub extern "C" fn blk_fill(buf: u64, buf_len: u64, param: u64) -> ! {
    let (seed, ms) = (param & 0xffff_ffff, param >> 32);
    let hz = ulib::tsc_hz();
    let step = chunk(buf_len);
    let mut l = Line::new();
    let mut status = 0;
    let _ = write!(l, "{{\"probe\":\"blk-fill\",\"seed\":{},\"disks\":[", seed);
    for i in 0..ulib::disk_count() {
        l.item(i);
        let bytes = ulib::disk_capacity(i).map(|s| s * 512).unwrap_or(0);
        let t0 = ulib::rdtsc();
        let mut off = 0;
        let mut err = None;
        while off < bytes {
            let n = step.min(bytes - off);
            // SAFETY: the first `n <= buf_len` bytes of this task's arena; the slice is not
            // used after the write request reads them.
            let data = unsafe { core::slice::from_raw_parts_mut(buf as *mut u8, n as usize) };
            workloads::fill(data, off, seed);
            if let Err(e) = ulib::blk_write(i, off / 512, buf, n) {
                err = Some(("write", e));
                break;
            }
            off += n;
            pace(t0, hz, ms, off, bytes);
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
        l.item(i);
        // SAFETY: the first 20 bytes of this task's arena, which hold nothing else; the slice
        // ends before the device writes there.
        unsafe { core::slice::from_raw_parts_mut(buf as *mut u8, 20) }.fill(0);
        match ulib::blk_get_id(i, buf) {
            Ok(()) => {
                // SAFETY: the same bytes, now holding the device's answer.
                let id = unsafe { core::slice::from_raw_parts(buf as *const u8, 20) };
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
    // SAFETY: nothing maps FAULT_ADDR, so this read never completes: the #PF ends the task.
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

fn pmem_source(i: usize) -> &'static str {
    match ulib::pmem_info(i, crate::abi::PMEM_SOURCE) {
        Ok(1) => "virtio",
        _ => "e820",
    }
}

/// Starts region `i`'s entry in the JSON list `l` and returns the region's base and size;
/// a region the kernel cannot name gets an entry saying so (after `fields`), and `None`.
fn pmem_entry(l: &mut Line, i: usize, fields: &str) -> Option<(u64, u64)> {
    l.item(i);
    match (
        ulib::pmem_info(i, crate::abi::PMEM_BASE),
        ulib::pmem_info(i, crate::abi::PMEM_SIZE),
    ) {
        (Ok(base), Ok(bytes)) => Some((base, bytes)),
        _ => {
            let _ = write!(
                l,
                "{{\"index\":{},{}\"ok\":false,\"error\":\"no such region\"}}",
                i, fields
            );
            None
        }
    }
}

/// CRC-32 of every memory-storage region, computed at CPL3 straight from its mapping.
pub extern "C" fn pmem_crc(_buf: u64, _len: u64, _param: u64) -> ! {
    let hz = ulib::tsc_hz();
    let mut l = Line::new();
    let mut status = 0;
    l.push("{\"probe\":\"pmem-crc\",\"regions\":[");
    for i in 0..ulib::pmem_count() {
        let Some((base, bytes)) = pmem_entry(&mut l, i, "") else {
            status = STATUS_BLK_FAILED;
            continue;
        };
        let t0 = ulib::rdtsc();
        // SAFETY: the kernel maps every region user-accessible, and it is storage no Rust
        // reference points into; only this task uses it while it runs.
        let data = unsafe { core::slice::from_raw_parts(base as *const u8, bytes as usize) };
        let crc = !ulib::crc32_update(!0, data);
        let cycles = ulib::rdtsc() - t0;
        let _ = write!(
            l,
            "{{\"index\":{},\"source\":\"{}\",\"bytes\":{},\"crc32\":\"{:#010x}\",\"cycles\":{},\"ns\":{}}}",
            i,
            pmem_source(i),
            bytes,
            crc,
            cycles,
            ulib::cycles_to_ns(cycles, hz)
        );
    }
    l.push("]}\n");
    l.send();
    ulib::exit(status)
}

/// Writes every byte of every region with the fill pattern at CPL3, then flushes. A region
/// whose first word does not read back as written is read-only (the VMM drops the writes):
/// it is reported and left alone.
pub extern "C" fn pmem_fill(_buf: u64, _len: u64, param: u64) -> ! {
    const PIECE: u64 = 1 << 20;
    let (seed, ms) = (param & 0xffff_ffff, param >> 32);
    let hz = ulib::tsc_hz();
    let mut regions = Line::new();
    let mut status = 0;
    for i in 0..ulib::pmem_count() {
        let Some((base, bytes)) = pmem_entry(&mut regions, i, "\"bytes\":0,") else {
            status = STATUS_BLK_FAILED;
            continue;
        };
        let _ = write!(
            regions,
            "{{\"index\":{},\"source\":\"{}\",",
            i,
            pmem_source(i)
        );
        let t0 = ulib::rdtsc();
        let mut first = [0u8; 8];
        workloads::fill(&mut first, 0, seed);
        let want = u64::from_le_bytes(first);
        // SAFETY: the region's first word (mapped and aligned, as in `pmem_crc`).
        let back = unsafe {
            core::ptr::write_volatile(base as *mut u64, want);
            core::ptr::read_volatile(base as *const u64)
        };
        if back != want {
            status = STATUS_BLK_FAILED;
            let _ = write!(
                regions,
                "\"bytes\":0,\"ok\":false,\"error\":\"read-only: a write did not read back\"}}"
            );
            continue;
        }
        let mut off = 0;
        while off < bytes {
            let n = PIECE.min(bytes - off);
            // SAFETY: `off + n <= bytes`, inside the region (as in `pmem_crc`); the slice ends
            // with this iteration.
            let data =
                unsafe { core::slice::from_raw_parts_mut((base + off) as *mut u8, n as usize) };
            workloads::fill(data, off, seed);
            off += n;
            pace(t0, hz, ms, off, bytes);
        }
        let flush = match ulib::pmem_flush(i) {
            Ok(true) => "virtio",
            Ok(false) => "none-needed",
            Err(e) => {
                status = STATUS_BLK_FAILED;
                e.name()
            }
        };
        let cycles = ulib::rdtsc() - t0;
        let _ = write!(
            regions,
            "\"bytes\":{},\"ok\":{},\"flush\":\"{}\",\"cycles\":{},\"ns\":{}}}",
            bytes,
            flush == "virtio" || flush == "none-needed",
            flush,
            cycles,
            ulib::cycles_to_ns(cycles, hz)
        );
    }
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"pmem-fill\",\"seed\":{},\"ok\":{},\"regions\":[",
        seed,
        status == 0
    );
    l.push(regions.as_str());
    l.push("]}\n");
    l.send();
    ulib::exit(status)
}

/// `mem-check`'s parameter: MiB in the low 32 bits, rounds in the high 32.
pub fn mem_check_param(mib: u64, rounds: u64) -> u64 {
    mib | rounds << 32
}

/// The word `mem-check` stores at address `addr` in round `round` (0: the first fill): a
/// mix of both (splitmix64's finaliser), so a word moved, lost or left from another round
/// reads wrong.
fn mem_check_word(addr: u64, round: u64) -> u64 {
    let mut x = addr ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Writes round `round`'s pattern over the words `[lo, hi)` (addresses, 8-byte aligned).
fn mem_check_write(lo: u64, hi: u64, round: u64) {
    let mut a = lo;
    while a < hi {
        // SAFETY: callers pass a range inside this task's arena (aligned words), which
        // nothing else uses while the task runs.
        unsafe { core::ptr::write_volatile(a as *mut u64, mem_check_word(a, round)) };
        a += 8;
    }
}

/// `mem-check=MIB[,iters=R]`: fills MIB MiB of the arena with round 0's pattern, then for
/// rounds 1..=R rewrites sixteenth (r - 1) mod 16 with round r's, and at the end counts the
/// bytes that differ from what each word must hold (the pattern of the last round that
/// wrote it). The kernel checked that MIB fits the arena.
pub extern "C" fn mem_check(buf: u64, buf_len: u64, param: u64) -> ! {
    let (mib, rounds) = (param & 0xffff_ffff, param >> 32);
    let bytes = (mib << 20).min(buf_len & !0xffff);
    let part = bytes / 16;
    let hz = ulib::tsc_hz();
    let t0 = ulib::rdtsc();
    mem_check_write(buf, buf + bytes, 0);
    for r in 1..=rounds {
        let lo = buf + ((r - 1) % 16) * part;
        mem_check_write(lo, lo + part, r);
    }
    let mut errors = 0u64;
    for s in 0..16 {
        // The last round in 1..=R with (r - 1) mod 16 == s, else the first fill.
        let last = if rounds > s {
            s + 1 + 16 * ((rounds - 1 - s) / 16)
        } else {
            0
        };
        let mut a = buf + s * part;
        while a < buf + (s + 1) * part {
            // SAFETY: inside the range written above (this task's arena).
            let got = unsafe { core::ptr::read_volatile(a as *const u64) };
            let diff = got ^ mem_check_word(a, last);
            if diff != 0 {
                errors += diff.to_le_bytes().iter().filter(|&&b| b != 0).count() as u64;
            }
            a += 8;
        }
    }
    let cycles = ulib::rdtsc() - t0;
    let mut l = Line::new();
    let _ = writeln!(
        l,
        "{{\"probe\":\"mem-check\",\"mib\":{},\"rounds\":{},\"errors\":{},\"ok\":{},\"cycles\":{},\"ns\":{}}}",
        mib,
        rounds,
        errors,
        errors == 0,
        cycles,
        ulib::cycles_to_ns(cycles, hz)
    );
    l.send();
    ulib::exit(if errors == 0 {
        0
    } else {
        crate::abi::STATUS_WRONG_RESULT
    })
}

/// Empty answers in a row after which the `rng` task gives up on the device.
const RNG_EMPTY_LIMIT: u32 = 16;

/// Reads `bytes` random bytes from the virtio-rng device in requests of up to 64 KiB, counts
/// them in a histogram as they come, and reports the histogram's Shannon entropy (bits per
/// byte, fixed point: no floating point in the guest) with its smallest and largest bin.
pub extern "C" fn rng(buf: u64, buf_len: u64, bytes: u64) -> ! {
    let hz = ulib::tsc_hz();
    let step = RNG_MAX_REQUEST.min(buf_len);
    let mut hist = [0u64; 256];
    let (mut got, mut requests, mut empty) = (0u64, 0u64, 0u32);
    let mut error = None;
    let t0 = ulib::rdtsc();
    while got < bytes {
        match ulib::rng_read(buf, step.min(bytes - got)) {
            Ok(0) => {
                requests += 1;
                empty += 1;
                if empty == RNG_EMPTY_LIMIT {
                    error = Some("the device kept answering with no bytes");
                    break;
                }
            }
            Ok(n) => {
                requests += 1;
                empty = 0;
                // SAFETY: the first `n <= step <= buf_len` bytes of this task's arena, just
                // written by the device; nothing else refers to them.
                let data = unsafe { core::slice::from_raw_parts(buf as *const u8, n as usize) };
                for &b in data {
                    hist[usize::from(b)] += 1;
                }
                got += n;
            }
            Err(e) => {
                error = Some(e.name());
                break;
            }
        }
    }
    let cycles = ulib::rdtsc() - t0;
    let entropy = workloads::entropy::shannon_fixed(&hist);
    let (min, max) = hist
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &c| (lo.min(c), hi.max(c)));
    let mut l = Line::new();
    let _ = write!(
        l,
        "{{\"probe\":\"rng\",\"bytes\":{},\"requests\":{},\"entropy_bits_per_byte\":{},\"min_count\":{},\"max_count\":{},\"ok\":{},",
        got,
        requests,
        workloads::entropy::Fixed4(entropy),
        min,
        max,
        error.is_none()
    );
    if let Some(e) = error {
        let _ = write!(l, "\"error\":\"{}\",", e);
    }
    let _ = writeln!(
        l,
        "\"cycles\":{},\"ns\":{}}}",
        cycles,
        ulib::cycles_to_ns(cycles, hz)
    );
    l.send();
    ulib::exit(if error.is_none() {
        0
    } else {
        STATUS_RNG_FAILED
    })
}
