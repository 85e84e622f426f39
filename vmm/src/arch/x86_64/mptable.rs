//! Intel MultiProcessor Specification 1.4 tables.
//!
//! Without ACPI, the MP table is how a guest learns how many CPUs it has, where the
//! IOAPIC is and how ISA interrupts reach it. Linux and the probe guest both find it by
//! scanning the last KiB of base memory for the floating pointer, so the whole table lives
//! in `MPTABLE_START..LEGACY_HOLE_START`, which the E820 map marks reserved.

use std::mem::size_of;

use devices::GuestMemoryMmap;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryError};

use super::layout::{APIC_START, IOAPIC_START, LEGACY_HOLE_START, MAX_IRQ, MPTABLE_START};

/// The space between the floating pointer's address and the legacy hole.
const MPTABLE_SPACE: usize = (LEGACY_HOLE_START - MPTABLE_START) as usize;

const SPEC_REV: u8 = 4;
const OEM_ID: [u8; 8] = *b"MUSUBI  ";
const PRODUCT_ID: [u8; 12] = *b"MUSUBI VM   ";

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

const CPU_ENABLED: u8 = 1 << 0;
const CPU_BOOTSTRAP: u8 = 1 << 1;
/// KVM's in-kernel local APIC reports this version; guests may compare the two.
const LAPIC_VERSION: u8 = 0x14;
/// Family 6, model 0xf, stepping 1: any P6-class value keeps old guests on their
/// ordinary paths; real feature detection uses CPUID, not this field.
const CPU_SIGNATURE: u32 = (6 << 8) | (0xf << 4) | 1;
/// CPUID.1:EDX bits the spec says to copy here: FPU and on-chip APIC.
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);

const ISA_BUS_ID: u8 = 0;
const IOAPIC_VERSION: u8 = 0x11;
const IOAPIC_ENABLED: u8 = 1;

const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Polarity and trigger mode "conform to the bus": edge, active high for ISA.
const INT_FLAGS_CONFORMING: u16 = 0;
/// A local interrupt entry with this destination applies to every local APIC.
const ALL_LOCAL_APICS: u8 = 0xff;

/// IOAPIC pins listed: all of them, so that virtio IRQs up to `MAX_IRQ` have an entry.
const IOAPIC_PINS: usize = MAX_IRQ as usize + 1;
const LOCAL_INTERRUPTS: usize = 2;

#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct FloatingPointer {
    signature: [u8; 4],
    physptr: u32,
    /// In 16-byte paragraphs.
    length: u8,
    spec_rev: u8,
    checksum: u8,
    /// 0: a configuration table is present (no default configuration).
    feature1: u8,
    feature2: u8,
    feature3_5: [u8; 3],
}

#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct ConfigHeader {
    signature: [u8; 4],
    base_table_length: u16,
    spec_rev: u8,
    checksum: u8,
    oem_id: [u8; 8],
    product_id: [u8; 12],
    oem_table_pointer: u32,
    oem_table_size: u16,
    entry_count: u16,
    lapic_addr: u32,
    ext_table_length: u16,
    ext_table_checksum: u8,
    reserved: u8,
}

#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct ProcessorEntry {
    entry_type: u8,
    lapic_id: u8,
    lapic_version: u8,
    cpu_flags: u8,
    cpu_signature: u32,
    feature_flags: u32,
    reserved: [u32; 2],
}

#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct BusEntry {
    entry_type: u8,
    bus_id: u8,
    bus_type: [u8; 6],
}

#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct IoApicEntry {
    entry_type: u8,
    ioapic_id: u8,
    ioapic_version: u8,
    flags: u8,
    addr: u32,
}

/// Shared by I/O interrupt entries (destination: an IOAPIC pin) and local interrupt
/// entries (destination: a local APIC's LINTn); only the meaning of the last two bytes differs.
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct InterruptEntry {
    entry_type: u8,
    int_type: u8,
    flags: u16,
    src_bus_id: u8,
    src_bus_irq: u8,
    dst_id: u8,
    dst_pin: u8,
}

// SAFETY: plain integers and byte arrays, `packed` so there is no padding; every bit
// pattern is a valid value.
unsafe impl ByteValued for FloatingPointer {}
// SAFETY: as above.
unsafe impl ByteValued for ConfigHeader {}
// SAFETY: as above.
unsafe impl ByteValued for ProcessorEntry {}
// SAFETY: as above.
unsafe impl ByteValued for BusEntry {}
// SAFETY: as above.
unsafe impl ByteValued for IoApicEntry {}
// SAFETY: as above.
unsafe impl ByteValued for InterruptEntry {}

/// Bytes taken by everything except the per-CPU processor entries.
const FIXED_SIZE: usize = size_of::<FloatingPointer>()
    + size_of::<ConfigHeader>()
    + size_of::<BusEntry>()
    + size_of::<IoApicEntry>()
    + IOAPIC_PINS * size_of::<InterruptEntry>()
    + LOCAL_INTERRUPTS * size_of::<InterruptEntry>();

/// The most CPUs whose processor entries still fit below the legacy hole. The IOAPIC
/// takes the APIC id after the last CPU, so this must also stay below KVM's 254 ids.
pub const MAX_CPUS: u8 = {
    let n = (MPTABLE_SPACE - FIXED_SIZE) / size_of::<ProcessorEntry>();
    assert!(n < 254);
    n as u8
};

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("the MP table needs at least one CPU, got 0")]
    NoCpus,
    #[error(
        "{requested} CPUs do not fit in the MP table: the 1 KiB at {MPTABLE_START:#x} holds at most {max}"
    )]
    TooManyCpus { requested: u8, max: u8 },
    #[error(
        "writing the MP table at {MPTABLE_START:#x} ({len} bytes) into guest memory: {source}"
    )]
    Write {
        len: usize,
        #[source]
        source: GuestMemoryError,
    },
}

/// The value that makes `bytes` sum to zero modulo 256, as every MP structure requires.
fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// Writes the floating pointer and configuration table for `num_cpus` CPUs with APIC
/// ids `0..num_cpus` (0 is the BSP) and one IOAPIC with id `num_cpus`.
pub fn write_mptable(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MpTableError> {
    let table = build(num_cpus)?;
    mem.write_slice(&table, GuestAddress(MPTABLE_START))
        .map_err(|source| MpTableError::Write {
            len: table.len(),
            source,
        })
}

/// The whole table as it must appear at `MPTABLE_START`, built in host memory first so
/// the checksums can be computed over the final bytes.
fn build(num_cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if num_cpus == 0 {
        return Err(MpTableError::NoCpus);
    }
    if num_cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus {
            requested: num_cpus,
            max: MAX_CPUS,
        });
    }
    let ioapic_id = num_cpus;

    let mut entries = Vec::new();
    let mut entry_count: u16 = 0;
    let mut push = |bytes: &[u8]| {
        entries.extend_from_slice(bytes);
        entry_count += 1;
    };

    for cpu in 0..num_cpus {
        let bsp = if cpu == 0 { CPU_BOOTSTRAP } else { 0 };
        push(
            ProcessorEntry {
                entry_type: ENTRY_PROCESSOR,
                lapic_id: cpu,
                lapic_version: LAPIC_VERSION,
                cpu_flags: CPU_ENABLED | bsp,
                cpu_signature: CPU_SIGNATURE,
                feature_flags: CPU_FEATURES,
                reserved: [0; 2],
            }
            .as_slice(),
        );
    }
    push(
        BusEntry {
            entry_type: ENTRY_BUS,
            bus_id: ISA_BUS_ID,
            bus_type: *b"ISA   ",
        }
        .as_slice(),
    );
    push(
        IoApicEntry {
            entry_type: ENTRY_IOAPIC,
            ioapic_id,
            ioapic_version: IOAPIC_VERSION,
            flags: IOAPIC_ENABLED,
            addr: IOAPIC_START as u32,
        }
        .as_slice(),
    );
    // KVM wires GSI n to IOAPIC pin n, so every IRQ maps to the pin of the same number.
    // IRQs 16..23 are not ISA IRQs strictly, but the virtio devices behind them are
    // edge-triggered and active high just like ISA ones, so the ISA bus describes them right.
    for irq in 0..IOAPIC_PINS as u8 {
        push(
            InterruptEntry {
                entry_type: ENTRY_IO_INTERRUPT,
                int_type: INT_TYPE_INT,
                flags: INT_FLAGS_CONFORMING,
                src_bus_id: ISA_BUS_ID,
                src_bus_irq: irq,
                dst_id: ioapic_id,
                dst_pin: irq,
            }
            .as_slice(),
        );
    }
    // The PIC's output reaches the CPU through LINT0 (virtual wire mode), NMIs through LINT1.
    for (int_type, lint) in [(INT_TYPE_EXTINT, 0), (INT_TYPE_NMI, 1)] {
        push(
            InterruptEntry {
                entry_type: ENTRY_LOCAL_INTERRUPT,
                int_type,
                flags: INT_FLAGS_CONFORMING,
                src_bus_id: ISA_BUS_ID,
                src_bus_irq: 0,
                dst_id: ALL_LOCAL_APICS,
                dst_pin: lint,
            }
            .as_slice(),
        );
    }

    let fp_size = size_of::<FloatingPointer>();
    let table_len = size_of::<ConfigHeader>() + entries.len();
    let mut header = ConfigHeader {
        signature: *b"PCMP",
        base_table_length: table_len as u16,
        spec_rev: SPEC_REV,
        checksum: 0,
        oem_id: OEM_ID,
        product_id: PRODUCT_ID,
        oem_table_pointer: 0,
        oem_table_size: 0,
        entry_count,
        lapic_addr: APIC_START as u32,
        ext_table_length: 0,
        ext_table_checksum: 0,
        reserved: 0,
    };
    let sum = header
        .as_slice()
        .iter()
        .chain(&entries)
        .fold(0u8, |s, b| s.wrapping_add(*b));
    header.checksum = sum.wrapping_neg();

    let mut fp = FloatingPointer {
        signature: *b"_MP_",
        physptr: (MPTABLE_START + fp_size as u64) as u32,
        length: (fp_size / 16) as u8,
        spec_rev: SPEC_REV,
        ..Default::default()
    };
    fp.checksum = checksum(fp.as_slice());

    let mut table = Vec::with_capacity(fp_size + table_len);
    table.extend_from_slice(fp.as_slice());
    table.extend_from_slice(header.as_slice());
    table.extend_from_slice(&entries);
    debug_assert!(table.len() <= MPTABLE_SPACE);
    Ok(table)
}

/// What the tests of every firmware table that lists CPUs share.
#[cfg(test)]
pub(super) mod firmware_tests {
    use devices::GuestMemoryMmap;
    use std::fmt::Display;
    use vm_memory::GuestAddress;

    pub fn guest_mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap()
    }

    /// The byte sum that every table's checksum makes zero.
    pub fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    /// Checks the CPU counts a table writer promises: `max` CPUs are written; 0 is refused,
    /// and so is `max + 1`, naming the limit.
    pub fn check_cpu_limits<T, E: Display>(
        write: impl Fn(&GuestMemoryMmap, u8) -> Result<T, E>,
        max: u8,
    ) {
        let mem = guest_mem();
        assert!(write(&mem, max).is_ok(), "{max} CPUs must fit");
        assert!(write(&mem, 0).is_err(), "0 CPUs must be refused");
        match write(&mem, max + 1) {
            Ok(_) => panic!("{} CPUs must be refused", max + 1),
            Err(e) => assert!(e.to_string().contains(&format!("at most {max}")), "{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::firmware_tests::{check_cpu_limits, guest_mem, sum};
    use super::*;

    /// What a guest would learn from the table, read back the way a guest reads it.
    #[derive(Debug, Default)]
    struct Parsed {
        cpus: Vec<(u8, u8)>,
        buses: Vec<(u8, [u8; 6])>,
        ioapics: Vec<(u8, u8, u32)>,
        io_ints: Vec<(u8, u8, u8, u8)>,
        local_ints: Vec<(u8, u8, u8)>,
        end: u64,
    }

    fn parse(mem: &GuestMemoryMmap) -> Parsed {
        let fp: FloatingPointer = mem.read_obj(GuestAddress(MPTABLE_START)).unwrap();
        assert_eq!(&fp.signature, b"_MP_");
        assert_eq!(fp.length, 1);
        assert_eq!(fp.spec_rev, 4);
        assert_eq!(fp.feature1, 0);
        assert_eq!(sum(fp.as_slice()), 0, "floating pointer checksum");

        let table_addr = GuestAddress(u64::from(fp.physptr));
        let header: ConfigHeader = mem.read_obj(table_addr).unwrap();
        assert_eq!(&header.signature, b"PCMP");
        assert_eq!(header.spec_rev, 4);
        assert_eq!({ header.lapic_addr }, 0xfee0_0000);
        assert_eq!(&header.oem_id[..6], b"MUSUBI");
        let len = usize::from(header.base_table_length);
        let mut table = vec![0u8; len];
        mem.read_slice(&mut table, table_addr).unwrap();
        assert_eq!(sum(&table), 0, "configuration table checksum");

        let mut parsed = Parsed {
            end: u64::from(fp.physptr) + len as u64,
            ..Default::default()
        };
        let mut at = size_of::<ConfigHeader>();
        for _ in 0..header.entry_count {
            match table[at] {
                ENTRY_PROCESSOR => {
                    let e = ProcessorEntry::from_slice(&table[at..at + 20]).unwrap();
                    assert_eq!(e.lapic_version, LAPIC_VERSION);
                    assert_eq!({ e.cpu_signature } >> 8 & 0xf, 6);
                    parsed.cpus.push((e.lapic_id, e.cpu_flags));
                    at += 20;
                }
                ENTRY_BUS => {
                    let e = BusEntry::from_slice(&table[at..at + 8]).unwrap();
                    parsed.buses.push((e.bus_id, e.bus_type));
                    at += 8;
                }
                ENTRY_IOAPIC => {
                    let e = IoApicEntry::from_slice(&table[at..at + 8]).unwrap();
                    assert_eq!(e.flags, IOAPIC_ENABLED);
                    parsed.ioapics.push((e.ioapic_id, e.ioapic_version, e.addr));
                    at += 8;
                }
                ENTRY_IO_INTERRUPT => {
                    let e = InterruptEntry::from_slice(&table[at..at + 8]).unwrap();
                    assert_eq!({ e.flags }, 0);
                    assert_eq!(e.int_type, INT_TYPE_INT);
                    parsed
                        .io_ints
                        .push((e.src_bus_id, e.src_bus_irq, e.dst_id, e.dst_pin));
                    at += 8;
                }
                ENTRY_LOCAL_INTERRUPT => {
                    let e = InterruptEntry::from_slice(&table[at..at + 8]).unwrap();
                    parsed.local_ints.push((e.int_type, e.dst_id, e.dst_pin));
                    at += 8;
                }
                other => panic!("unknown entry type {other} at offset {at}"),
            }
        }
        assert_eq!(at, len, "entry_count and base_table_length disagree");
        parsed
    }

    fn check(num_cpus: u8) {
        let mem = guest_mem();
        write_mptable(&mem, num_cpus).unwrap();
        let p = parse(&mem);
        assert!(p.end <= LEGACY_HOLE_START, "table ends at {:#x}", p.end);

        assert_eq!(p.cpus.len(), usize::from(num_cpus));
        for (i, &(id, flags)) in p.cpus.iter().enumerate() {
            assert_eq!(usize::from(id), i);
            let expected = if i == 0 { 3 } else { 1 };
            assert_eq!(flags, expected, "flags of CPU {i}");
        }
        assert_eq!(p.buses, vec![(0, *b"ISA   ")]);
        assert_eq!(p.ioapics, vec![(num_cpus, 0x11, 0xfec0_0000)]);
        let expected: Vec<_> = (0..24).map(|i| (0, i, num_cpus, i)).collect();
        assert_eq!(p.io_ints, expected);
        assert_eq!(p.local_ints, vec![(3, 0xff, 0), (1, 0xff, 1)]);
    }

    #[test]
    fn every_cpu_count_that_fits() {
        assert_eq!(MAX_CPUS, 37);
        for n in 1..=MAX_CPUS {
            check(n);
        }
        // The bound is tight: one more entry would cross into the legacy hole.
        assert!(FIXED_SIZE + (usize::from(MAX_CPUS) + 1) * 20 > MPTABLE_SPACE);
    }

    #[test]
    fn memory_without_base_ram_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        assert!(matches!(
            write_mptable(&mem, 1),
            Err(MpTableError::Write { .. })
        ));
    }

    #[test]
    fn cpu_counts_outside_the_table_are_refused_naming_the_limit() {
        check_cpu_limits(write_mptable, MAX_CPUS);
        assert!(write_mptable(&guest_mem(), 254).is_err());
    }
}
