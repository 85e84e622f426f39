//! A "directory listing"-like task (paper 004's `ls`): walk an in-memory tree of `n` entries
//! in depth-first order and format one `ls -l`-style line per entry into an output buffer,
//! as a listing written to a pipe. The result is the FNV-1a hash of every byte formatted.
//!
//! The tree is implicit: entry 0 is the root, the children of entry `i` are
//! `8i+1 ..= 8i+8` (those below `n`); an entry with children is a directory. Names, sizes
//! and dates come from a hash of the entry's index.

use crate::{fnv1a, FNV_OFFSET};

const FANOUT: u64 = 8;
/// Bytes the output buffer needs at least (one line).
pub const MIN_OUT: usize = 256;

const STEMS: [&[u8]; 8] = [
    b"main", b"util", b"readme", b"config", b"data", b"lib", b"test", b"log",
];
const EXTS: [&[u8]; 6] = [b".c", b".h", b".txt", b".o", b".rs", b".md"];
const MONTHS: [&[u8]; 12] = [
    b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec",
];

/// Pre-order successor of `i` in the implicit tree of `n` entries.
fn next(i: u64, n: u64) -> Option<u64> {
    let c = i * FANOUT + 1;
    if c < n {
        return Some(c);
    }
    let mut j = i;
    while j != 0 {
        if !j.is_multiple_of(FANOUT) && j + 1 < n {
            return Some(j + 1);
        }
        j = (j - 1) / FANOUT;
    }
    None
}

fn depth(mut i: u64) -> usize {
    let mut d = 0;
    while i != 0 {
        i = (i - 1) / FANOUT;
        d += 1;
    }
    d
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

struct Out<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Out<'_> {
    fn put(&mut self, s: &[u8]) {
        let end = self.len + s.len();
        self.buf[self.len..end].copy_from_slice(s);
        self.len = end;
    }

    fn byte(&mut self, b: u8) {
        self.buf[self.len] = b;
        self.len += 1;
    }

    /// `v` in decimal, right-aligned in `width` columns.
    fn num(&mut self, v: u64, width: usize) {
        let mut digits = [0u8; 20];
        let mut k = 0;
        let mut v = v;
        loop {
            digits[k] = b'0' + (v % 10) as u8;
            k += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        for _ in k..width {
            self.byte(b' ');
        }
        while k > 0 {
            k -= 1;
            self.byte(digits[k]);
        }
    }
}

/// Lists `n` entries; `out` is the pipe buffer (at least `MIN_OUT` bytes): when the next
/// line might not fit, the buffer is "sent" (hashed) and reused.
pub fn ls_like(n: u64, out: &mut [u8]) -> u64 {
    assert!(out.len() >= MIN_OUT, "ls_like: output buffer too small");
    let mut hash = FNV_OFFSET;
    let mut o = Out { buf: out, len: 0 };
    let mut cur = if n > 0 { Some(0) } else { None };
    while let Some(i) = cur {
        if o.buf.len() - o.len < MIN_OUT {
            hash = fnv1a(hash, &o.buf[..o.len]);
            o.len = 0;
        }
        let h = mix(i);
        let dir = i * FANOUT + 1 < n;
        o.put(if dir { b"drwxr-xr-x" } else { b"-rw-r--r--" });
        o.num(if dir { 2 } else { 1 }, 3);
        o.put(b" user staff");
        o.num(if dir { 4096 } else { h % 1_000_000 }, 9);
        o.byte(b' ');
        o.put(MONTHS[(h >> 20) as usize % 12]);
        o.num((h >> 24) % 28 + 1, 3);
        o.num((h >> 32) % 24, 3);
        o.byte(b':');
        let min = (h >> 40) % 60;
        o.byte(b'0' + (min / 10) as u8);
        o.byte(b'0' + (min % 10) as u8);
        o.byte(b' ');
        for _ in 0..depth(i).min(16) {
            o.put(b"  ");
        }
        if i == 0 {
            o.byte(b'.');
        } else if dir {
            o.put(b"dir");
            o.num(i, 0);
            o.byte(b'/');
        } else {
            o.put(STEMS[(h & 7) as usize]);
            o.byte(b'_');
            o.num(i, 0);
            o.put(EXTS[(h >> 3) as usize % EXTS.len()]);
        }
        o.byte(b'\n');
        cur = next(i, n);
    }
    fnv1a(hash, &o.buf[..o.len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visits_every_entry_once() {
        for n in [1u64, 2, 8, 9, 10, 73, 100, 1000] {
            let mut seen = [false; 1000];
            let mut cur = Some(0);
            let mut count = 0;
            while let Some(i) = cur {
                assert!(!seen[i as usize], "n={n} i={i} twice");
                seen[i as usize] = true;
                count += 1;
                cur = next(i, n);
            }
            assert_eq!(count, n);
        }
    }

    #[test]
    fn result_does_not_depend_on_buffer_size_and_is_stable() {
        let mut small = [0u8; MIN_OUT];
        let mut big = [0u8; 8192];
        // Different pipe sizes hash in different pieces, but FNV-1a is a streaming hash.
        assert_eq!(ls_like(500, &mut small), ls_like(500, &mut big));
        assert_ne!(ls_like(500, &mut big), ls_like(501, &mut big));
        assert_eq!(ls_like(0, &mut big), FNV_OFFSET);
    }

    #[test]
    fn lines_look_like_ls() {
        let mut buf = [0u8; 4096];
        ls_like(3, &mut buf);
        let text = core::str::from_utf8(&buf[..buf.iter().position(|&b| b == 0).unwrap()]).unwrap();
        let mut lines = text.lines();
        assert!(lines
            .next()
            .unwrap()
            .starts_with("drwxr-xr-x  2 user staff     4096 "));
        assert!(lines
            .next()
            .unwrap()
            .starts_with("-rw-r--r--  1 user staff"));
    }
}
