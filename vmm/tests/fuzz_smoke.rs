//! The kernel-image and configuration fuzz targets' entry points on seeded random and
//! mutated inputs, so CI runs the same checks on stable Rust for a few seconds each.

use dsm::rng::Rng;
use vmm::fuzzing;

/// One random change: a byte replaced, a run of bytes cut, or a byte inserted.
fn mutate(rng: &mut Rng, v: &mut Vec<u8>) {
    let at = rng.below(v.len() as u64 + 1) as usize;
    match rng.below(4) {
        0 | 1 if at < v.len() => v[at] = rng.next_u64() as u8,
        2 if at < v.len() => {
            let end = (at + 1 + rng.below(64) as usize).min(v.len());
            v.drain(at..end);
        }
        _ => v.insert(at, rng.next_u64() as u8),
    }
}

/// Runs `target` on `count` inputs: each a valid sample with a few random changes, or (one
/// in four) random bytes. A broken rule fails the test and prints the input.
fn drive(target: fn(&[u8]) -> Result<(), String>, samples: &[Vec<u8>], seed: u64, count: u64) {
    let mut rng = Rng::new(seed);
    for sample in samples {
        target(sample).unwrap_or_else(|e| panic!("sample {}: {e}", hex(sample)));
    }
    for _ in 0..count {
        let input = if rng.below(4) == 0 {
            let len = rng.below(300) as usize;
            (0..len).map(|_| rng.next_u64() as u8).collect()
        } else {
            let mut v = samples[rng.below(samples.len() as u64) as usize].clone();
            for _ in 0..1 + rng.below(8) {
                mutate(&mut rng, &mut v);
            }
            v
        };
        target(&input).unwrap_or_else(|e| panic!("input {}: {e}", hex(&input)));
    }
}

/// The input as one hex string, to paste into a regression test.
fn hex(input: &[u8]) -> String {
    input.iter().map(|b| format!("{b:02x}")).collect()
}

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
    drive(fuzzing::kernel_image, &samples, 0x4E11, 20_000);
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
        "256M",
        "1T",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    drive(fuzzing::config, &samples, 0xC0F1, 100_000);
}
