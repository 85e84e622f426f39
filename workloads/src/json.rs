//! One-line JSON objects for results, written through `core::fmt::Write`, so the guest and
//! the native program print the same keys in the same order.

use core::fmt::{self, Write};

/// `{"probe":"<task>", ...}` followed by a newline once `end` is called.
pub struct Obj<'a, W: Write> {
    w: &'a mut W,
}

impl<'a, W: Write> Obj<'a, W> {
    pub fn new(w: &'a mut W, probe: &str) -> Self {
        let _ = write!(w, "{{\"probe\":\"{}\"", probe);
        Obj { w }
    }

    pub fn u(&mut self, key: &str, v: u64) -> &mut Self {
        let _ = write!(self.w, ",\"{}\":{}", key, v);
        self
    }

    /// A number, or `null` where the figure has no meaning (natively, guest-only counters).
    pub fn opt(&mut self, key: &str, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.u(key, v),
            None => {
                let _ = write!(self.w, ",\"{}\":null", key);
                self
            }
        }
    }

    pub fn b(&mut self, key: &str, v: bool) -> &mut Self {
        let _ = write!(self.w, ",\"{}\":{}", key, v);
        self
    }

    /// A string value that needs no escaping (names chosen by the program).
    pub fn s(&mut self, key: &str, v: &str) -> &mut Self {
        let _ = write!(self.w, ",\"{}\":\"{}\"", key, v);
        self
    }

    pub fn hex32(&mut self, key: &str, v: u32) -> &mut Self {
        let _ = write!(self.w, ",\"{}\":\"{:#010x}\"", key, v);
        self
    }

    pub fn arr(&mut self, key: &str, v: &[u64]) -> &mut Self {
        let _ = write!(self.w, ",\"{}\":[", key);
        for (i, x) in v.iter().enumerate() {
            let _ = write!(self.w, "{}{}", if i > 0 { "," } else { "" }, x);
        }
        let _ = self.w.write_str("]");
        self
    }

    /// Writes `,"key":` and hands the writer over for a value the caller formats.
    pub fn raw(&mut self, key: &str) -> &mut W {
        let _ = write!(self.w, ",\"{}\":", key);
        self.w
    }

    pub fn end(&mut self) {
        let _ = self.w.write_str("}\n");
    }
}

/// A fixed-capacity line buffer implementing `fmt::Write` (extra bytes are dropped).
pub struct LineBuf<const N: usize> {
    pub buf: [u8; N],
    pub len: usize,
}

impl<const N: usize> LineBuf<N> {
    pub const fn new() -> Self {
        LineBuf {
            buf: [0; N],
            len: 0,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl<const N: usize> Default for LineBuf<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> Write for LineBuf<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let n = s.len().min(N - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_line() {
        let mut l = LineBuf::<256>::new();
        Obj::new(&mut l, "mint-cpu")
            .u("m", 5)
            .arr("cycles", &[1, 2])
            .opt("interrupts", None)
            .b("ok", true)
            .hex32("crc32", 0xbe)
            .end();
        assert_eq!(
            core::str::from_utf8(l.as_bytes()).unwrap(),
            "{\"probe\":\"mint-cpu\",\"m\":5,\"cycles\":[1,2],\"interrupts\":null,\"ok\":true,\"crc32\":\"0x000000be\"}\n"
        );
    }
}
