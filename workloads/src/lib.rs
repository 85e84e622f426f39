//! The pure computations of the Musubi probe guest's benchmark tasks.
//!
//! `#![no_std]`, no dependencies and nothing that needs SSE: the same code builds for the
//! probe guest (`x86_64-unknown-none`, soft-float) and for the host, where the
//! `musubi-native` program runs it natively, so native and virtual runs execute identical
//! workload code and print identical JSON keys (see `json` and `task`).

#![no_std]

pub mod compile;
pub mod crc32;
pub mod entropy;
pub mod fill;
pub mod json;
pub mod kernels;
pub mod ls;
pub mod make;
pub mod rng;
pub mod task;

pub use crc32::{crc32, crc32_update};
pub use fill::{fill, fill_byte};
pub use kernels::{copy_bytes, cpu_loop, fib, memcpy_loop};
pub use rng::XorShift64;

/// 64-bit FNV-1a over `data`, continuing from `h` (start with `FNV_OFFSET`).
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

pub fn fnv1a(mut h: u64, data: &[u8]) -> u64 {
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Nanoseconds for `cycles` TSC cycles at `hz`.
pub fn cycles_to_ns(cycles: u64, hz: u64) -> u64 {
    (cycles as u128 * 1_000_000_000 / hz.max(1) as u128) as u64
}
