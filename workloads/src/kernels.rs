//! The Mint report's CPU and memory loops (§5.4.2) and paper 004's fib.
//!
//! On x86-64 the loops are inline assembly, so the guest build (soft-float, no SSE) and the
//! host build run the very same instructions whatever the optimiser would otherwise pick.

/// `m` iterations of a register increment (the Mint CPU workload). Returns `m`.
pub fn cpu_loop(m: u64) -> u64 {
    if m == 0 {
        return 0;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let mut acc: u64 = 0;
        // SAFETY: registers only.
        unsafe {
            core::arch::asm!(
                "2:",
                "inc {acc}",
                "dec {n}",
                "jnz 2b",
                acc = inout(reg) acc,
                n = inout(reg) m => _,
                options(nomem, nostack),
            );
        }
        acc
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut acc = 0u64;
        for _ in 0..m {
            acc = core::hint::black_box(acc + 1);
        }
        acc
    }
}

/// Copies `src` into `dst` (equal lengths) with `rep movsb`, as C libraries do for large
/// copies on CPUs with fast string moves.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bytes: lengths differ");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: both slices are valid for `len` bytes and cannot overlap (& and &mut).
    unsafe {
        core::arch::asm!(
            "rep movsb",
            inout("rcx") src.len() => _,
            inout("rsi") src.as_ptr() => _,
            inout("rdi") dst.as_mut_ptr() => _,
            options(nostack, preserves_flags),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// The Mint memory workload: `n` copies of `src` into `dst`. Returns a byte of the result so
/// the copies are observable.
pub fn memcpy_loop(dst: &mut [u8], src: &[u8], n: u64) -> u64 {
    for _ in 0..n {
        copy_bytes(dst, src);
    }
    dst.last().copied().unwrap_or(0) as u64
}

/// Recursive Fibonacci (paper 004's `fib`), wrapping on overflow.
#[inline(never)]
pub fn fib(n: u64) -> u64 {
    if n < 2 {
        n
    } else {
        fib(n - 1).wrapping_add(fib(n - 2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_loop_counts() {
        assert_eq!(cpu_loop(0), 0);
        assert_eq!(cpu_loop(12345), 12345);
    }

    #[test]
    fn memcpy_copies() {
        let src: [u8; 4099] = core::array::from_fn(|i| i as u8);
        let mut dst = [0u8; 4099];
        assert_eq!(memcpy_loop(&mut dst, &src, 3), src[4098] as u64);
        assert_eq!(dst, src);
    }

    #[test]
    fn fib_values() {
        let want = [0u64, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55];
        for (n, &w) in want.iter().enumerate() {
            assert_eq!(fib(n as u64), w);
        }
        assert_eq!(fib(30), 832_040);
    }
}
