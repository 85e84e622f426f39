//! A "compile"-like task (paper 004's `gcc`): generate `n` lines of C-like source text in
//! blocks, tokenize each block, intern identifiers in an open-addressing symbol table, fold
//! numeric literals and hash the token stream into "object code". No allocation: the caller
//! passes the text buffer and the symbol table.

use crate::rng::XorShift64;
use crate::{fnv1a, FNV_OFFSET};

/// Smallest text buffer (one generated line is at most 96 bytes).
pub const MIN_TEXT: usize = 4096;
/// Symbol-table slots needed at least (a power of two; identifiers are drawn from about
/// 1100 names).
pub const MIN_SYMS: usize = 4096;
/// The sizes the guest and the native program use.
pub const TEXT_BYTES: usize = 64 * 1024;
pub const SYMS: usize = 4096;

pub(crate) const LONGEST_LINE: usize = 96;
const KEYWORDS: [&[u8]; 6] = [b"int", b"return", b"if", b"while", b"for", b"else"];
const OPS: [&[u8]; 6] = [b" + ", b" - ", b" * ", b" & ", b" | ", b" ^ "];

pub(crate) struct Text<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) len: usize,
}

impl Text<'_> {
    pub(crate) fn put(&mut self, s: &[u8]) {
        self.buf[self.len..self.len + s.len()].copy_from_slice(s);
        self.len += s.len();
    }

    pub(crate) fn num(&mut self, mut v: u64) {
        let mut d = [0u8; 20];
        let mut k = 0;
        loop {
            d[k] = b'0' + (v % 10) as u8;
            k += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        while k > 0 {
            k -= 1;
            self.buf[self.len] = d[k];
            self.len += 1;
        }
    }

    fn operand(&mut self, r: &mut XorShift64) {
        match r.below(3) {
            0 => {
                self.put(b"v");
                self.num(r.below(1000));
            }
            1 => self.num(r.below(100_000)),
            _ => {
                self.put(b"f");
                self.num(r.below(100));
                self.put(b"(v");
                self.num(r.below(1000));
                self.put(b")");
            }
        }
    }

    /// One statement line, at most `LONGEST_LINE` bytes.
    pub(crate) fn line(&mut self, r: &mut XorShift64) {
        let kind = r.below(8);
        match kind {
            0 => self.put(b"  if (v"),
            1 => self.put(b"  while (v"),
            2 => self.put(b"  return v"),
            _ => self.put(b"  int v"),
        }
        self.num(r.below(1000));
        match kind {
            0 | 1 => self.put(b" < "),
            2 => self.put(b" + "),
            _ => self.put(b" = "),
        }
        self.operand(r);
        for _ in 0..r.below(3) {
            self.put(OPS[r.below(OPS.len() as u64) as usize]);
            self.operand(r);
        }
        self.put(match kind {
            0 | 1 => b") { v1 = v1 + 1; }\n",
            _ => b";\n",
        });
    }
}

/// The symbol slot of identifier hash `h` (never 0) in `syms` (length a power of two).
fn intern(syms: &mut [u64], h: u64) -> u64 {
    let mask = syms.len() - 1;
    let mut i = (h as usize) & mask;
    for _ in 0..syms.len() {
        if syms[i] == h {
            return i as u64;
        }
        if syms[i] == 0 {
            syms[i] = h;
            return i as u64;
        }
        i = (i + 1) & mask;
    }
    u64::MAX
}

/// Tokenizes `text` and folds it into `code`, handing each token's word to `emit`; returns
/// the number of tokens.
pub(crate) fn compile_block(
    text: &[u8],
    syms: &mut [u64],
    code: &mut u64,
    mut emit: impl FnMut(u64),
) -> u64 {
    let mut tokens = 0;
    let mut i = 0;
    while i < text.len() {
        let c = text[i];
        if c == b' ' || c == b'\n' {
            i += 1;
            continue;
        }
        tokens += 1;
        let start = i;
        let word: u64 = if c.is_ascii_alphabetic() || c == b'_' {
            while i < text.len() && (text[i].is_ascii_alphanumeric() || text[i] == b'_') {
                i += 1;
            }
            let ident = &text[start..i];
            match KEYWORDS.iter().position(|k| *k == ident) {
                Some(k) => 0x1000 + k as u64,
                None => 0x2000 + intern(syms, fnv1a(FNV_OFFSET, ident) | 1),
            }
        } else if c.is_ascii_digit() {
            let mut v = 0u64;
            while i < text.len() && text[i].is_ascii_digit() {
                v = v.wrapping_mul(10).wrapping_add((text[i] - b'0') as u64);
                i += 1;
            }
            (v << 16) | 0x3
        } else {
            i += 1;
            c as u64
        };
        *code = (*code ^ word).wrapping_mul(0x0000_0100_0000_01b3);
        emit(word);
    }
    tokens
}

/// Compiles `n` generated lines. `text` is at least `MIN_TEXT` bytes, `syms` at least
/// `MIN_SYMS` slots and a power of two. Returns a hash of the "object code", the symbol
/// count and the token count.
pub fn compile_like(n: u64, text: &mut [u8], syms: &mut [u64]) -> u64 {
    assert!(
        text.len() >= MIN_TEXT,
        "compile_like: text buffer too small"
    );
    assert!(
        syms.len() >= MIN_SYMS && syms.len().is_power_of_two(),
        "compile_like: symbol table must be a power of two of at least MIN_SYMS"
    );
    syms.fill(0);
    let mut r = XorShift64::new(0xc0de);
    let mut code = FNV_OFFSET;
    let mut tokens = 0u64;
    let mut left = n;
    while left > 0 {
        let mut t = Text {
            buf: &mut *text,
            len: 0,
        };
        while left > 0 && t.buf.len() - t.len >= LONGEST_LINE {
            t.line(&mut r);
            left -= 1;
        }
        let len = t.len;
        tokens += compile_block(&text[..len], syms, &mut code, |_| {});
    }
    let symbols = syms.iter().filter(|&&s| s != 0).count() as u64;
    code ^ (symbols << 48) ^ tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_independent_of_block_size() {
        let mut syms = [0u64; SYMS];
        let mut big = [0u8; TEXT_BYTES];
        let mut small = [0u8; MIN_TEXT];
        let a = compile_like(2000, &mut big, &mut syms);
        let b = compile_like(2000, &mut small, &mut syms);
        assert_eq!(a, b);
        assert_ne!(a, compile_like(2001, &mut big, &mut syms));
        assert_eq!(compile_like(0, &mut big, &mut syms), FNV_OFFSET);
    }

    #[test]
    fn tokens_counted() {
        let mut syms = [0u64; SYMS];
        let mut code = FNV_OFFSET;
        assert_eq!(
            compile_block(b"  int v1 = 42 + f3(v9);\n", &mut syms, &mut code, |_| {}),
            10
        );
        assert_eq!(syms.iter().filter(|&&s| s != 0).count(), 3);
    }

    #[test]
    fn lines_are_short_enough() {
        let mut r = XorShift64::new(7);
        let mut buf = [0u8; 256];
        for _ in 0..10_000 {
            let mut t = Text {
                buf: &mut buf,
                len: 0,
            };
            t.line(&mut r);
            assert!(t.len <= LONGEST_LINE, "{}", t.len);
        }
    }
}
