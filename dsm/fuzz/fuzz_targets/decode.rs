#![no_main]
// The check lives in `dsm::fuzz` so the crate's property tests run it on stable Rust too.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = dsm::fuzz::decode(data) {
        panic!("{e}");
    }
});
