//! The fill pattern of `blk-fill` and `pmem-fill`: the byte at offset `o` of a disk or a
//! memory-storage region is `((o / 512) * 131 + o % 512 + SEED) % 256`.

/// The pattern byte at offset `o`.
pub fn fill_byte(o: u64, seed: u64) -> u8 {
    (o / 512)
        .wrapping_mul(131)
        .wrapping_add(o % 512)
        .wrapping_add(seed) as u8
}

/// Writes the pattern for offsets `offset .. offset + buf.len()` into `buf`.
pub fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    let mut o = offset;
    let mut rest = buf;
    while !rest.is_empty() {
        let in_sector = (o % 512) as usize;
        let n = (512 - in_sector).min(rest.len());
        let (head, tail) = rest.split_at_mut(n);
        let v = fill_byte(o, seed);
        for (j, b) in head.iter_mut().enumerate() {
            *b = v.wrapping_add(j as u8);
        }
        o += n as u64;
        rest = tail;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_formula_at_any_start() {
        let mut buf = [0u8; 3000];
        for start in [0u64, 1, 511, 512, 1000, 1 << 33] {
            fill(&mut buf, start, 77);
            for (i, &b) in buf.iter().enumerate() {
                let o = start + i as u64;
                assert_eq!(b as u64, ((o / 512) * 131 + o % 512 + 77) % 256);
            }
        }
    }
}
