//! The fuzz targets' entry points on seeded inputs, so CI runs the same checks on stable Rust
//! for a few seconds each: a valid script per target with random changes, random scripts,
//! and the inputs that once found a bug.

use devices::fuzzing::{self, smoke};

/// Scripts in the entry points' action language (see `devices::fuzzing`): a blk request
/// header, then a chain of header, data and status descriptors at the driver's request
/// areas, notified. The first byte picks the disk: bit 0 read-only, bit 1 `O_DIRECT`.
const BLK_GET_ID: &[u8] = &[
    0, 6, 3, 0, 0, 7, 2, 0, 0, 0, 16, 0, 0, 1, 0, 0, 20, 2, 0, 2, 0, 0, 1, 2, 0,
];
const BLK_READ: &[u8] = &[
    0, 6, 0, 0, 1, 7, 2, 0, 0, 0, 16, 0, 0, 1, 0, 3, 1, 2, 0, 2, 0, 0, 1, 2, 0,
];
const BLK_WRITE: &[u8] = &[
    2, 6, 1, 0, 2, 7, 2, 0, 0, 0, 16, 0, 0, 1, 0, 3, 1, 0, 0, 2, 0, 0, 1, 2, 0,
];
/// A flush request: its type (0) written at the request area, then a request and a
/// response descriptor, notified.
const PMEM_FLUSH: &[u8] = &[
    2, 0, 0, 4, 0, 0, 0, 0, 7, 1, 0, 0, 0, 4, 0, 0, 1, 0, 0, 4, 2, 0,
];

fn samples(list: &[&[u8]]) -> Vec<Vec<u8>> {
    list.iter().map(|s| s.to_vec()).collect()
}

#[test]
fn mmio_transport_survives_hostile_guests() {
    // From power-on: negotiate and set up the queue (action 8), then a flush.
    let up_and_flush = [&[0, 8, 0, 0][..], PMEM_FLUSH].concat();
    smoke(
        "mmio_transport",
        fuzzing::mmio_transport,
        &[up_and_flush],
        0x3310,
        3000,
    );
}

#[test]
fn virtio_blk_survives_hostile_requests() {
    smoke(
        "virtio_blk",
        fuzzing::virtio_blk,
        &samples(&[BLK_GET_ID, BLK_READ, BLK_WRITE]),
        0xB10C,
        1500,
    );
}

#[test]
fn virtio_pmem_survives_hostile_requests() {
    let flush = [&[0][..], PMEM_FLUSH].concat();
    smoke("virtio_pmem", fuzzing::virtio_pmem, &[flush], 0x93E3, 3000);
}

#[test]
fn virtio_rng_survives_hostile_requests() {
    smoke(
        "virtio_rng",
        fuzzing::virtio_rng,
        &fuzzing::virtio_rng_samples(),
        0x4E6D,
        3000,
    );
}

#[test]
fn virtio_vsock_survives_hostile_guests_and_host_programs() {
    smoke(
        "virtio_vsock",
        fuzzing::virtio_vsock,
        &fuzzing::virtio_vsock_samples(),
        0x750C,
        1000,
    );
}
