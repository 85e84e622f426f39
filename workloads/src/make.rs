//! A make-like build (paper 002, Table 1: a make of GNU awk 3.1.4, about 140 sources and
//! 60,000 lines): deterministic C-like sources, a compile of each into an "object", and the
//! disk layout the probe guest reads them from.
//!
//! The guest reads the sources from a virtio-blk disk and writes the objects back to it;
//! natively the same sources are real files. Both compile with [`compile`], so the host
//! can check that every object the guest wrote is byte for byte the native one.
//!
//! Disk layout (all offsets and lengths in bytes, little-endian):
//! - `0..4096`: the directory: [`MAGIC`], the file count (u32), 4 reserved bytes, then one
//!   entry of four u32 per file: source offset, source length, object offset, object room.
//! - the sources, each from a 4 KiB boundary, in file order;
//! - the object slots, each from a 4 KiB boundary, [`object_bound`] bytes of room each.

use core::fmt::Write;

use crate::compile::{compile_block, Text, LONGEST_LINE};
use crate::json::Obj;
use crate::rng::XorShift64;
use crate::task::Counters;
use crate::{fnv1a, FNV_OFFSET};

pub const MAGIC: [u8; 8] = *b"MUSUMAKE";
/// The directory's size, and the alignment of every source and object slot.
pub const BLOCK: u64 = 4096;
const DIR_HEAD: usize = 16;
const ENTRY: usize = 16;
/// Files one directory block holds.
pub const MAX_FILES: usize = (BLOCK as usize - DIR_HEAD) / ENTRY;
/// The largest source [`source`] writes (with room to spare) and the guest accepts.
pub const MAX_SOURCE: usize = 128 * 1024;
/// An object's header: magic, tokens, symbols, passes (u32 each), code hash, source hash.
pub const OBJ_HEADER: usize = 32;
pub const OBJ_MAGIC: [u8; 4] = *b"MOBJ";
/// GNU awk 3.1.4's size, as paper 002 describes it: about 140 files, 60,000 lines.
pub const PAPER_FILES: u64 = 140;
/// Optimisation passes over each token stream: the compile's weight per line (see
/// `compile`). About 7 µs of work per source line natively on the machines here.
pub const DEFAULT_PASSES: u64 = 96;
const FIRST_LINES: u64 = 50;
const SPREAD_LINES: u64 = 621;

/// A file's place on the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub src_off: u64,
    pub src_len: u64,
    pub obj_off: u64,
    pub obj_room: u64,
}

/// The room an object of a source of `src_len` bytes may need (a token is at least one
/// byte of source and two bytes of object).
pub fn object_bound(src_len: u64) -> u64 {
    OBJ_HEADER as u64 + 2 * src_len
}

fn align(v: u64) -> u64 {
    v.div_ceil(BLOCK) * BLOCK
}

/// The file name of source `i` (natively), e.g. `awk007.c`; the object is `awk007.o`.
pub fn name(i: usize, ext: char, out: &mut impl Write) {
    let _ = write!(out, "awk{i:03}.{ext}");
}

/// Statement lines of file `i`: 50 to 670, 360 on average; with the function heads and
/// tails, 140 files have about 60,000 lines.
pub fn lines_of(i: usize) -> u64 {
    let mut r = XorShift64::new(0x6177_6b00 + i as u64);
    FIRST_LINES + r.below(SPREAD_LINES)
}

/// Writes source file `i` into `buf` (at least [`MAX_SOURCE`] bytes) and returns its length:
/// a comment, an include, and functions of 8 to 40 statement lines.
pub fn source(i: usize, buf: &mut [u8]) -> usize {
    assert!(buf.len() >= MAX_SOURCE, "make::source: buffer too small");
    let mut r = XorShift64::new(0x6d61_6b65_0000 + i as u64);
    let mut t = Text { buf, len: 0 };
    t.put(b"/* awk");
    t.num(i as u64);
    t.put(b".c: generated */\n#include \"awk.h\"\n\n");
    let mut left = lines_of(i);
    let mut f = 0;
    while left > 0 {
        let body = left.min(8 + r.below(33));
        t.put(b"int f");
        t.num(i as u64 * 100 + f);
        t.put(b"(int v1, int v2) {\n");
        for _ in 0..body {
            debug_assert!(t.buf.len() - t.len >= LONGEST_LINE);
            t.line(&mut r);
        }
        t.put(b"  return v1;\n}\n\n");
        left -= body;
        f += 1;
    }
    t.len
}

/// Lays out `files` sources of the given lengths; returns the disk's size in bytes.
pub fn layout(src_lens: &[u64], entries: &mut [Entry]) -> u64 {
    assert!(src_lens.len() <= MAX_FILES && entries.len() >= src_lens.len());
    let mut at = BLOCK;
    for (e, &len) in entries.iter_mut().zip(src_lens) {
        *e = Entry {
            src_off: at,
            src_len: len,
            ..Entry::default()
        };
        at += align(len);
    }
    for e in entries[..src_lens.len()].iter_mut() {
        e.obj_off = at;
        e.obj_room = align(object_bound(e.src_len));
        at += e.obj_room;
    }
    at
}

fn put32(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
}

fn get32(b: &[u8], at: usize) -> u64 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as u64
}

/// Writes the directory of `entries` into `dir` (at least [`BLOCK`] bytes).
pub fn write_dir(entries: &[Entry], dir: &mut [u8]) {
    assert!(entries.len() <= MAX_FILES && dir.len() >= BLOCK as usize);
    dir[..BLOCK as usize].fill(0);
    dir[..8].copy_from_slice(&MAGIC);
    put32(dir, 8, entries.len() as u64);
    for (i, e) in entries.iter().enumerate() {
        let at = DIR_HEAD + i * ENTRY;
        put32(dir, at, e.src_off);
        put32(dir, at + 4, e.src_len);
        put32(dir, at + 8, e.obj_off);
        put32(dir, at + 12, e.obj_room);
    }
}

/// The file count of directory `dir`, checked.
pub fn read_dir(dir: &[u8]) -> Result<usize, &'static str> {
    if dir.len() < BLOCK as usize || dir[..8] != MAGIC {
        return Err("the disk holds no make directory");
    }
    let n = get32(dir, 8) as usize;
    if n > MAX_FILES {
        return Err("the make directory lists too many files");
    }
    Ok(n)
}

/// Entry `i` of directory `dir` (checked with [`read_dir`]).
pub fn entry(dir: &[u8], i: usize) -> Entry {
    let at = DIR_HEAD + i * ENTRY;
    Entry {
        src_off: get32(dir, at),
        src_len: get32(dir, at + 4),
        obj_off: get32(dir, at + 8),
        obj_room: get32(dir, at + 12),
    }
}

/// What [`compile`] made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Object {
    /// Bytes of `obj` written.
    pub len: usize,
    pub code: u64,
    pub tokens: u64,
}

fn word16(obj: &[u8], k: usize) -> u16 {
    let at = OBJ_HEADER + 2 * k;
    u16::from_le_bytes([obj[at], obj[at + 1]])
}

/// Compiles `src` into `obj` (at least [`object_bound`] bytes): tokenizes it, interning
/// identifiers in `syms` (a power of two of at least `compile::MIN_SYMS` slots), emits one
/// 16-bit word per token, then runs `passes` optimisation passes over the words, each
/// folding every word with its predecessor and a symbol-table probe and rewriting it.
/// `None` if `obj` or `syms` is too small.
pub fn compile(src: &[u8], passes: u64, syms: &mut [u64], obj: &mut [u8]) -> Option<Object> {
    if (obj.len() as u64) < object_bound(src.len() as u64)
        || syms.len() < crate::compile::MIN_SYMS
        || !syms.len().is_power_of_two()
    {
        return None;
    }
    syms.fill(0);
    let mut code = FNV_OFFSET;
    let mut n = 0;
    let words = &mut obj[OBJ_HEADER..];
    let tokens = compile_block(src, syms, &mut code, |w| {
        let w16 = (w ^ (w >> 16) ^ (w >> 32) ^ (w >> 48)) as u16;
        words[2 * n..2 * n + 2].copy_from_slice(&w16.to_le_bytes());
        n += 1;
    });
    let mask = syms.len() - 1;
    for p in 0..passes {
        let mut h = code ^ p;
        let mut prev = 0u16;
        for k in 0..n {
            let w = word16(obj, k);
            h = (h ^ (w as u64) ^ ((prev as u64) << 16)).wrapping_mul(0x0000_0100_0000_01b3);
            h ^= syms[(h >> 7) as usize & mask] >> 13;
            let nw = w ^ (h >> 40) as u16;
            let at = OBJ_HEADER + 2 * k;
            obj[at..at + 2].copy_from_slice(&nw.to_le_bytes());
            prev = nw;
        }
        code = h;
    }
    let symbols = syms.iter().filter(|&&s| s != 0).count() as u64;
    obj[..4].copy_from_slice(&OBJ_MAGIC);
    put32(obj, 4, tokens);
    put32(obj, 8, symbols);
    put32(obj, 12, passes);
    obj[16..24].copy_from_slice(&code.to_le_bytes());
    obj[24..32].copy_from_slice(&fnv1a(FNV_OFFSET, src).to_le_bytes());
    Some(Object {
        len: OBJ_HEADER + 2 * n,
        code,
        tokens,
    })
}

/// Folds object codes into a build's result.
pub fn fold(result: u64, code: u64) -> u64 {
    fnv1a(result, &code.to_le_bytes())
}

/// What a build measured, natively or in the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Build {
    pub files: u64,
    pub passes: u64,
    /// The whole build, directory read to final sync.
    pub cycles: u64,
    pub ns: u64,
    /// Inside file system calls (open/read/write/lseek/fsync): the guest kernel's share.
    pub sys_ns: u64,
    /// In the compile, user mode.
    pub compile_ns: u64,
    pub syscalls: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Every object's code, folded with [`fold`] in file order.
    pub result: u64,
}

/// Writes the result line of a build (`{"probe":"make",...}`).
pub fn report<W: Write>(w: &mut W, b: &Build, c: &Counters) {
    Obj::new(w, "make")
        .u("files", b.files)
        .u("passes", b.passes)
        .u("cycles", b.cycles)
        .u("ns", b.ns)
        .u("sys_ns", b.sys_ns)
        .u("compile_ns", b.compile_ns)
        .u("syscalls", b.syscalls)
        .u("bytes_read", b.bytes_read)
        .u("bytes_written", b.bytes_written)
        .u("result", b.result)
        .opt("kernel_copy_bytes", c.kernel_copy_bytes)
        .opt("page_faults", c.page_faults)
        .opt("virtio_requests", c.virtio_requests)
        .opt("interrupts", c.interrupts)
        .end();
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::compile::SYMS;
    use std::{vec, vec::Vec};

    #[test]
    fn sources_are_deterministic_and_gawk_sized() {
        let mut a = vec![0u8; MAX_SOURCE];
        let mut b = vec![0u8; MAX_SOURCE];
        let mut total_lines = 0;
        let mut longest = 0;
        for i in 0..PAPER_FILES as usize {
            let n = source(i, &mut a);
            assert_eq!(source(i, &mut b), n);
            assert_eq!(a[..n], b[..n]);
            total_lines += a[..n].iter().filter(|&&c| c == b'\n').count();
            longest = longest.max(n);
        }
        assert!((50_000..80_000).contains(&total_lines), "{total_lines}");
        assert!(longest < MAX_SOURCE / 2, "{longest}");
    }

    #[test]
    fn directory_round_trips() {
        let lens = [5000u64, 1, 4096];
        let mut e = [Entry::default(); 3];
        let size = layout(&lens, &mut e);
        assert_eq!(e[0].src_off, 4096);
        assert_eq!(e[1].src_off, 4096 + 8192);
        assert_eq!(e[2].src_off, 4096 + 12288);
        assert_eq!(e[0].obj_off, 4096 + 16384);
        assert!(e.iter().all(|e| e.obj_room >= object_bound(e.src_len)
            && e.obj_off % BLOCK == 0
            && e.src_off % BLOCK == 0));
        assert_eq!(size, e[2].obj_off + e[2].obj_room);
        let mut dir = vec![0u8; BLOCK as usize];
        write_dir(&e, &mut dir);
        assert_eq!(read_dir(&dir), Ok(3));
        for (i, x) in e.iter().enumerate() {
            assert_eq!(entry(&dir, i), *x);
        }
        dir[0] = b'X';
        assert!(read_dir(&dir).is_err());
    }

    #[test]
    fn compile_is_deterministic_and_depends_on_source_and_passes() {
        let mut src = vec![0u8; MAX_SOURCE];
        let n = source(3, &mut src);
        let mut syms = vec![0u64; SYMS];
        let mut obj = vec![0u8; object_bound(n as u64) as usize];
        let a = compile(&src[..n], 4, &mut syms, &mut obj).unwrap();
        let first: Vec<u8> = obj[..a.len].to_vec();
        assert_eq!(compile(&src[..n], 4, &mut syms, &mut obj), Some(a));
        assert_eq!(obj[..a.len], first[..]);
        assert_eq!(obj[..4], OBJ_MAGIC);
        assert_eq!(a.len, OBJ_HEADER + 2 * a.tokens as usize);
        assert!(a.len < n, "objects are smaller than their sources");
        assert_ne!(
            compile(&src[..n], 5, &mut syms, &mut obj).unwrap().code,
            a.code
        );
        src[40] ^= 1;
        assert_ne!(
            compile(&src[..n], 4, &mut syms, &mut obj).unwrap().code,
            a.code
        );
        assert_eq!(compile(&src[..n], 4, &mut syms, &mut obj[..10]), None);
    }

    #[test]
    fn report_line() {
        let mut l = crate::json::LineBuf::<1024>::new();
        report(
            &mut l,
            &Build {
                files: 2,
                passes: 1,
                ns: 9,
                ..Build::default()
            },
            &Counters::default(),
        );
        let s = core::str::from_utf8(l.as_bytes()).unwrap();
        assert!(
            s.starts_with("{\"probe\":\"make\",\"files\":2,\"passes\":1,"),
            "{s}"
        );
        assert!(s.ends_with("\"interrupts\":null}\n"), "{s}");
    }
}
