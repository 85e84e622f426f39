//! The kernel-image and configuration fuzz targets' entry points on seeded random and
//! mutated inputs, so CI runs the same checks on stable Rust for a few seconds each (the
//! driver is the one the device targets' smoke tests use).

use devices::fuzzing::smoke;
use vmm::fuzzing;

/// A bzImage front: the setup header's magic and sizes, as far as the loader reads them.
fn bzimage() -> Vec<u8> {
    let mut v = vec![0u8; 0x1400];
    v[0x1f1] = 1; // setup_sects
    v[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    v[0x202..0x206].copy_from_slice(b"HdrS");
    v[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes()); // protocol 2.15
    v[0x211] = 1; // loadflags: LOADED_HIGH
    v[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    v
}

#[test]
fn hostile_kernel_images_are_refused_or_loaded_inside_guest_memory() {
    let samples = [
        vmm::testing::pvh_elf(&vmm::testing::Code::default().exit(0).0),
        bzimage(),
    ];
    smoke(
        "kernel_image",
        fuzzing::kernel_image,
        &samples,
        0x4E11,
        20_000,
    );
}

#[test]
fn configuration_parts_parse_or_name_their_flag() {
    let samples: Vec<Vec<u8>> = [
        r#"{"path": "/var/lib/a.img", "readonly": true, "cache": "none"}"#,
        r#"{"file": "pm.img", "size": "64M", "readonly": false, "advertise": "virtio"}"#,
        r#"{"file": "pm.img", "size": 2097152}"#,
        r#""file=/tmp/serial.log""#,
        r#""user""#,
        "path=a.img,readonly=on,cache=writeback",
        "file=pm.img,size=2M,advertise=e820",
        r#"{"bytes_per_sec": 4096}"#,
        "bytes_per_sec=65536",
        "cid=3,socket=/tmp/v.sock",
        "256M",
        "1T",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    smoke("config", fuzzing::config, &samples, 0xC0F1, 100_000);
}
