//! Boots hand-assembled PVH guests, so the VMM's own path (loader, PVH entry, port exits,
//! exit status, crash reporting) is tested without depending on the probe guest.

use std::sync::Arc;
use vmm::config::{ExitsMode, KernelImage, SerialMode, VmConfig};
use vmm::{run_vm, Outcome, RunOptions};

const LOAD: u32 = 0x10_0000;

/// An ELF64 image with one PT_LOAD of `code` at 1 MiB and a Xen PVH entry note.
fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    note.extend_from_slice(&4u32.to_le_bytes()); // namesz ("Xen\0")
    note.extend_from_slice(&4u32.to_le_bytes()); // descsz
    note.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&LOAD.to_le_bytes());
    let note_off = 64 + 2 * 56;
    let code_off = 0x1000usize;
    let mut e = vec![0u8; code_off];
    e[..4].copy_from_slice(b"\x7fELF");
    e[4] = 2; // 64-bit
    e[5] = 1; // little endian
    e[6] = 1; // version
    e[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    e[20..24].copy_from_slice(&1u32.to_le_bytes());
    e[24..32].copy_from_slice(&(LOAD as u64).to_le_bytes()); // entry
    e[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
    e[52..54].copy_from_slice(&64u16.to_le_bytes()); // ehsize
    e[54..56].copy_from_slice(&56u16.to_le_bytes()); // phentsize
    e[56..58].copy_from_slice(&2u16.to_le_bytes()); // phnum
    let ph = |e: &mut Vec<u8>, at: usize, typ: u32, off: u64, addr: u64, len: u64| {
        e[at..at + 4].copy_from_slice(&typ.to_le_bytes());
        e[at + 4..at + 8].copy_from_slice(&5u32.to_le_bytes()); // R+X
        e[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
        e[at + 16..at + 24].copy_from_slice(&addr.to_le_bytes());
        e[at + 24..at + 32].copy_from_slice(&addr.to_le_bytes());
        e[at + 32..at + 40].copy_from_slice(&len.to_le_bytes());
        e[at + 40..at + 48].copy_from_slice(&len.to_le_bytes());
        e[at + 48..at + 56].copy_from_slice(&0x1000u64.to_le_bytes());
    };
    ph(
        &mut e,
        64,
        1,
        code_off as u64,
        LOAD as u64,
        code.len() as u64,
    );
    ph(&mut e, 120, 4, note_off as u64, 0, note.len() as u64);
    e[note_off..note_off + note.len()].copy_from_slice(&note);
    e.extend_from_slice(code);
    e
}

fn config(code: &[u8], cpus: u8) -> VmConfig {
    VmConfig {
        kernel: KernelImage::Bytes {
            name: "tiny".into(),
            data: Arc::from(pvh_elf(code)),
        },
        cmdline: String::new(),
        initrd: None,
        cpus,
        memory: 32 << 20,
        disks: vec![],
        pmem: vec![],
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    }
}

fn opts() -> RunOptions {
    RunOptions {
        capture_serial: true,
        timeout: Some(std::time::Duration::from_secs(60)),
        ..Default::default()
    }
}

/// `mov dx, port; mov al, byte; out dx, al` in 32-bit code.
fn out8(port: u16, byte: u8) -> Vec<u8> {
    let p = port.to_le_bytes();
    vec![0x66, 0xba, p[0], p[1], 0xb0, byte, 0xee]
}

#[test]
fn serial_output_and_exit_status_reach_the_host() {
    let mut code = Vec::new();
    for b in b"Hi\n" {
        code.extend(out8(0x3f8, *b));
    }
    code.extend(out8(0xf4, 42));
    code.push(0xf4); // hlt, never reached
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::GuestExit(42));
    assert_eq!(r.outcome.exit_code(), 42);
    assert_eq!(r.serial, b"Hi\n");
    let outs = r.exits.iter().find(|e| e.reason == "io_out").unwrap();
    assert_eq!(outs.count, 4, "three serial bytes and one exit-port write");
}

#[test]
fn i8042_reset_is_a_clean_shutdown() {
    let mut code = out8(0x64, 0xfe);
    code.push(0xf4);
    let r = run_vm(&config(&code, 2), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::Shutdown);
    assert_eq!(r.outcome.exit_code(), 0);
}

#[test]
fn triple_fault_is_reported_as_a_guest_crash() {
    // lidt [zero descriptor]; ud2 — the #UD cannot be delivered, nor the #DF after it.
    let desc_addr = LOAD + 16;
    let mut code = vec![0x0f, 0x01, 0x1d];
    code.extend_from_slice(&desc_addr.to_le_bytes());
    code.extend_from_slice(&[0x0f, 0x0b]);
    code.resize(16, 0x90);
    code.extend_from_slice(&[0u8; 8]);
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    match &r.outcome {
        Outcome::GuestCrash(m) => assert!(m.contains("triple fault"), "{m}"),
        o => panic!("expected a crash, got {o:?}"),
    }
    assert_eq!(r.outcome.exit_code(), 125);
}

#[test]
fn unclaimed_ports_read_all_ones_and_do_not_stop_the_vm() {
    // in al, 0x80 ... then out to 0x3f8 the value read, then exit 0.
    let mut code = vec![0x66, 0xba, 0x34, 0x12, 0xec]; // mov dx,0x1234; in al,dx
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xee]); // mov dx,0x3f8; out dx,al
    code.extend(out8(0xf4, 0));
    let r = run_vm(&config(&code, 1), &opts()).expect("VM runs (needs /dev/kvm)");
    assert_eq!(r.outcome, Outcome::GuestExit(0));
    assert_eq!(r.serial, vec![0xff]);
}

#[test]
fn every_port_write_is_one_exit_at_that_port_in_both_modes() {
    const N: usize = 37;
    for mode in [ExitsMode::User, ExitsMode::Kernel] {
        let mut code = Vec::new();
        for _ in 0..N {
            code.extend(out8(0x80, 0x55));
        }
        code.extend(out8(0xf4, 0));
        let mut cfg = config(&code, 1);
        cfg.exits = mode;
        let r = run_vm(&cfg, &opts()).expect("VM runs (needs /dev/kvm)");
        assert_eq!(r.outcome, Outcome::GuestExit(0));
        let exits = r.metrics["exits"].as_array().unwrap();
        let port80 = exits
            .iter()
            .find(|e| e["reason"] == "io_out" && e["detail"] == "0x80")
            .unwrap_or_else(|| panic!("no port 0x80 exits in {:#}", r.metrics));
        assert_eq!(port80["count"], N as u64, "{mode}");
        assert_eq!(r.metrics["exits_mode"], mode.to_string());
        let hist: u64 = port80["histogram_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b[1].as_u64().unwrap())
            .sum();
        assert_eq!(hist, N as u64, "every exit lands in one histogram bucket");
    }
}
