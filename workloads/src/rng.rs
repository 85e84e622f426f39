//! xorshift64 (Marsaglia), for random offsets and generated inputs.

#[derive(Clone, Copy, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A zero seed (a fixed point of xorshift) is replaced by a fixed odd constant.
    pub fn new(seed: u64) -> XorShift64 {
        XorShift64(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }

    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A random offset, a multiple of `align`, at which `len` bytes fit in `span` bytes.
    pub fn offset(&mut self, span: u64, len: u64, align: u64) -> u64 {
        let align = align.max(1);
        let slots = span.saturating_sub(len) / align + 1;
        self.below(slots) * align
    }
}

/// The seed of repetition `rep` of the `mint-io` task (same offsets natively and in a VM).
pub fn mint_io_seed(rep: u32) -> u64 {
    0x5eed_0000 + rep as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_fit_and_are_aligned() {
        let mut r = XorShift64::new(1);
        for _ in 0..10_000 {
            let o = r.offset(1 << 20, 256 << 10, 4096);
            assert_eq!(o % 4096, 0);
            assert!(o + (256 << 10) <= 1 << 20);
        }
        assert_eq!(XorShift64::new(0).offset(100, 200, 8), 0);
    }

    #[test]
    fn deterministic() {
        let a: [u64; 4] = {
            let mut r = XorShift64::new(42);
            core::array::from_fn(|_| r.next())
        };
        let mut r = XorShift64::new(42);
        assert!(a.iter().all(|&v| v == r.next()));
        assert_ne!(a[0], a[1]);
    }
}
