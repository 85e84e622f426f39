//! Shannon entropy of a byte histogram in fixed point, for the probe guest's `rng` task:
//! the guest is soft-float without SSE, so the logarithms are integer arithmetic.
//!
//! H = log2(N) - (1/N) * sum(c * log2 c) over the non-empty bins, in bits per byte, with
//! every logarithm carried to 32 fractional bits: the result is within 2^-28 bits of the
//! exact value for any N below 2^40, far finer than the 4 decimals printed.

/// Fractional bits of the fixed-point values here.
pub const FRAC_BITS: u32 = 32;
/// 1.0 in that fixed point.
pub const ONE: u64 = 1 << FRAC_BITS;

/// log2(x) for x >= 1, with `FRAC_BITS` fractional bits (rounded down); 0 for x = 0.
pub fn log2_fixed(x: u64) -> u64 {
    if x == 0 {
        return 0;
    }
    let int = 63 - u64::from(x.leading_zeros());
    // The mantissa x / 2^int in [1, 2), with 62 fractional bits.
    let mut m: u128 = (u128::from(x) << 62) >> int;
    let mut frac = 0u64;
    // Squaring the mantissa doubles its logarithm: each time it reaches 2, the next bit of
    // the fraction is 1 and the mantissa is halved back into [1, 2).
    for bit in (0..FRAC_BITS).rev() {
        m = (m * m) >> 62;
        if m >= 2 << 62 {
            m >>= 1;
            frac |= 1 << bit;
        }
    }
    (int << FRAC_BITS) | frac
}

/// Entropy in bits per byte of the bytes counted in `hist`, with `FRAC_BITS` fractional
/// bits (8.0 is `8 << FRAC_BITS`); 0 for an empty histogram.
pub fn shannon_fixed(hist: &[u64; 256]) -> u64 {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0;
    }
    let weighted: u128 = hist
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| u128::from(c) * u128::from(log2_fixed(c)))
        .sum();
    let mean = (weighted / u128::from(total)) as u64;
    log2_fixed(total).saturating_sub(mean)
}

/// A fixed-point value as a decimal with four places (rounded down), for JSON.
pub struct Fixed4(pub u64);

impl core::fmt::Display for Fixed4 {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let int = self.0 >> FRAC_BITS;
        let frac = ((self.0 & (ONE - 1)) as u128 * 10_000) >> FRAC_BITS;
        write!(f, "{}.{:04}", int, frac)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::format;

    fn as_f64(v: u64) -> f64 {
        v as f64 / ONE as f64
    }

    #[test]
    fn logarithms_match_the_float_ones() {
        assert_eq!(log2_fixed(1), 0);
        assert_eq!(log2_fixed(2), ONE);
        assert_eq!(log2_fixed(1 << 40), 40 * ONE);
        for x in [3u64, 5, 7, 10, 255, 1000, 65_537, 123_456_789, u64::MAX] {
            let want = (x as f64).log2();
            let got = as_f64(log2_fixed(x));
            assert!((got - want).abs() < 1e-8, "log2({x}): {got} vs {want}");
        }
    }

    #[test]
    fn uniform_and_skewed_histograms() {
        assert_eq!(shannon_fixed(&[0; 256]), 0);
        let mut one = [0u64; 256];
        one[7] = 1000;
        assert_eq!(shannon_fixed(&one), 0);
        assert_eq!(shannon_fixed(&[256; 256]), 8 * ONE);
        let mut two = [0u64; 256];
        (two[0], two[1]) = (500, 500);
        assert_eq!(shannon_fixed(&two), ONE);
        // Against the float formula on an uneven histogram.
        let hist: [u64; 256] = core::array::from_fn(|i| 1 + (i as u64 * 2_654_435_761) % 97);
        let n: u64 = hist.iter().sum();
        let want: f64 = hist
            .iter()
            .map(|&c| {
                let p = c as f64 / n as f64;
                -p * p.log2()
            })
            .sum();
        let got = as_f64(shannon_fixed(&hist));
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }

    #[test]
    fn prints_four_decimals() {
        assert_eq!(format!("{}", Fixed4(8 * ONE)), "8.0000");
        assert_eq!(format!("{}", Fixed4(ONE / 2 + 7 * ONE)), "7.5000");
        assert_eq!(format!("{}", Fixed4(0)), "0.0000");
        assert_eq!(format!("{}", Fixed4(ONE - 1)), "0.9999");
    }
}
