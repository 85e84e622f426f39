//! The fuzz targets' entry points on seeded random inputs, so CI runs the same checks on
//! stable Rust for a few seconds each; inputs that once found a bug replay first.

use devices::fuzzing;
use dsm::rng::Rng;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `target` on each regression input, then on `count` random scripts of up to `max`
/// bytes; a broken rule or a panic fails the test and prints the input to replay it.
fn drive(target: fn(&[u8]) -> Result<(), String>, seed: u64, count: u64, max: u64) {
    let mut rng = Rng::new(seed);
    let random = (0..count).map(|_| {
        let len = rng.below(max + 1) as usize;
        (0..len).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>()
    });
    for input in regressions().into_iter().chain(random) {
        match catch_unwind(AssertUnwindSafe(|| target(&input))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("input {}: {e}", hex(&input)),
            Err(_) => panic!("input {} panicked (message above)", hex(&input)),
        }
    }
}

/// The input as one hex string, to paste into `regressions`.
fn hex(input: &[u8]) -> String {
    input.iter().map(|b| format!("{b:02x}")).collect()
}

/// Inputs the fuzzer found bugs with; every target must get through each of them.
fn regressions() -> Vec<Vec<u8>> {
    Vec::new()
}

#[test]
fn mmio_transport_survives_random_guests() {
    drive(fuzzing::mmio_transport, 0x3310, 3000, 400);
}

#[test]
fn virtio_blk_survives_random_requests() {
    drive(fuzzing::virtio_blk, 0xB10C, 1500, 400);
}

#[test]
fn virtio_pmem_survives_random_requests() {
    drive(fuzzing::virtio_pmem, 0x93E3, 3000, 400);
}
