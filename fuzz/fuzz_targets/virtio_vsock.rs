#![no_main]
// The check lives in `devices::fuzzing` so the seeded smoke tests run it on stable Rust too.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = devices::fuzzing::virtio_vsock(data) {
        panic!("{e}");
    }
});
