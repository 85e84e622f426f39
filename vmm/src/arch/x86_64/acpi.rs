//! ACPI tables: RSDP, XSDT, FADT, DSDT and MADT.
//!
//! Kernels built without `CONFIG_X86_MPPARSE` (Debian's cloud kernel among them) never
//! look at the MP table, so without ACPI they see only the boot CPU. These tables give
//! them the CPUs and the IOAPIC; the MP table stays for guests that read that instead.
//!
//! The platform is full (not HW-reduced) ACPI for one reason: the power button. Its
//! fixed-feature form needs only a PM1a event and control block and an SCI, which the PM
//! device (`devices::legacy::Pm`) serves, where the HW-reduced form would need a Generic
//! Event Device described in AML. There is still no PM timer, no GPE block and no FACS
//! (Linux runs without them), and the DSDT holds only `\_S5_`, the sleep type the PM
//! device takes as "power off". Everything sits in
//! `0xe0000..0x100000`, the BIOS area that Linux scans for the RSDP when it boots
//! through the Linux boot protocol without being told the address; the E820 map does
//! not list that range as RAM, so the guest never reuses it.

use acpi_tables::fadt::{FADTBuilder, Flags, FADT};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use devices::legacy::{PM1A_CNT, PM1A_EVT, PM1_CNT_LEN, PM1_EVT_LEN, SCI_IRQ, SLP_TYP_S5};
use devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::layout::{APIC_START, HIGH_MEMORY_START, IOAPIC_START};

/// The RSDP must start on a 16-byte boundary inside `0xe0000..0x100000` for the BIOS-area
/// scan to find it; the other tables follow it.
pub const RSDP_START: u64 = 0xe0000;
/// The tables must end here: above it the kernel is loaded.
pub const ACPI_END: u64 = HIGH_MEMORY_START;

const OEM_ID: [u8; 6] = *b"MUSUBI";
const OEM_TABLE_ID: [u8; 8] = *b"MUSUBIVM";
const OEM_REVISION: u32 = 1;

/// Revisions as ACPI 6.5 defines them (the FADT's 6.5 comes from `FADTBuilder`).
/// DSDT revision 2 means AML integers are 64 bits wide.
const DSDT_REVISION: u8 = 2;
const MADT_REVISION: u8 = 6;

const HEADER_LEN: usize = 36;
/// MADT: the common header, then the local APIC address and the flags.
const MADT_HEADER_LEN: usize = HEADER_LEN + 8;
const MADT_LAPIC_ENTRY_LEN: usize = 8;
const MADT_IOAPIC_ENTRY_LEN: usize = 12;
/// An interrupt source override: the SCI is level-triggered and active-high, as ACPI asks of
/// an SCI wired to an IOAPIC and as KVM's IOAPIC sees a raised line.
const MADT_ISO_ENTRY_LEN: usize = 10;
const MADT_ISO_TYPE: u8 = 2;
/// MPS INTI flags: polarity 01 (active high), trigger mode 11 (level).
const MADT_ISO_LEVEL_HIGH: u16 = 0b1101;
/// The machine also has dual 8259s; Linux then keeps the legacy IRQs 0-15 identity
/// mapped to IOAPIC pins, as KVM wires them.
const MADT_PCAT_COMPAT: u32 = 1 << 0;

/// FADT `IAPC_BOOT_ARCH`: Musubi has an 8042 (its reset line ends the VM), but no VGA,
/// no MSI-capable bus and no CMOS RTC, so Linux should not probe for them.
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_MSI_NOT_SUPPORTED: u16 = 1 << 3;
const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;
/// Writing 0xfe to the 8042 command port resets the machine; advertising it as the ACPI
/// reset register lets `reboot=a` (and Linux's default reboot order) use it.
const I8042_COMMAND_PORT: u64 = 0x64;
const I8042_RESET_VALUE: u8 = 0xfe;

/// Tables other than the RSDP start on this boundary; not required, but it keeps them
/// readable in a memory dump.
const TABLE_ALIGN: u64 = 16;

/// xAPIC ids are 8 bits and 0xff is the broadcast id; the IOAPIC takes the id after the
/// last CPU, so CPUs may use ids 0..=253.
pub const MAX_CPUS: u8 = 254;

/// Where each table goes, for `num_cpus` CPUs.
struct Placement {
    xsdt: u64,
    fadt: u64,
    dsdt: u64,
    madt: u64,
    end: u64,
}

const fn align_up(addr: u64) -> u64 {
    addr.div_ceil(TABLE_ALIGN) * TABLE_ALIGN
}

const fn madt_len(num_cpus: u8) -> usize {
    MADT_HEADER_LEN
        + num_cpus as usize * MADT_LAPIC_ENTRY_LEN
        + MADT_IOAPIC_ENTRY_LEN
        + MADT_ISO_ENTRY_LEN
}

/// The DSDT's AML: `Name (_S5_, Package (1) { SLP_TYP_S5 })`, 10 bytes, checked in a test.
const DSDT_AML_LEN: usize = 10;
const DSDT_LEN: usize = HEADER_LEN + DSDT_AML_LEN;

/// XSDT entries: the FADT and the MADT (the DSDT is reached through the FADT).
const XSDT_ENTRIES: usize = 2;

/// `FADT::len()` is not a `const fn`; this is the ACPI 6.x FADT size, checked in a test.
const FADT_LEN: usize = 276;

const fn placement(num_cpus: u8) -> Placement {
    let rsdp_len = 36;
    let xsdt = align_up(RSDP_START + rsdp_len);
    let fadt = align_up(xsdt + (HEADER_LEN + XSDT_ENTRIES * 8) as u64);
    let dsdt = align_up(fadt + FADT_LEN as u64);
    let madt = align_up(dsdt + DSDT_LEN as u64);
    let end = madt + madt_len(num_cpus) as u64;
    Placement {
        xsdt,
        fadt,
        dsdt,
        madt,
        end,
    }
}

// The CPU limit comes from the APIC id space, not from the room below 1 MiB: even the
// largest table set leaves most of the BIOS area free.
const _: () = assert!(placement(MAX_CPUS).end <= ACPI_END);

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("the ACPI tables need at least one CPU, got 0")]
    NoCpus,
    #[error(
        "{requested} CPUs cannot be described in the MADT: xAPIC ids are 8 bits and the IOAPIC takes the id after the last CPU, so at most {max} fit"
    )]
    TooManyCpus { requested: u8, max: u8 },
    #[error("writing the ACPI {what} at {addr:#x} into guest memory: {source}")]
    Write {
        what: &'static str,
        addr: u64,
        #[source]
        source: GuestMemoryError,
    },
}

fn to_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

/// `\_S5_` is what Linux looks up before it offers ACPI power-off; its value is the
/// SLP_TYP the PM device ends the VM on.
fn dsdt() -> Vec<u8> {
    let mut table = Sdt::new(
        *b"DSDT",
        HEADER_LEN as u32,
        DSDT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    let s5 = to_bytes(&aml::Name::new(
        "_S5_".into(),
        &aml::Package::new(vec![&SLP_TYP_S5]),
    ));
    table.append_slice(&s5);
    to_bytes(&table)
}

/// A fixed-feature register block in system I/O space, for the FADT's 64-bit fields.
fn io_block(port: u16, len: u8) -> GAS {
    let size = if len >= 4 {
        AccessSize::DwordAccess
    } else {
        AccessSize::WordAccess
    };
    GAS::new(AddressSpace::SystemIo, len * 8, 0, size, port.into())
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut builder = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::ResetRegSup)
        // PWR_BUTTON clear: the power button is the fixed-feature one of PM1. There is no
        // sleep button.
        .flag(Flags::SlpButton);
    // SMI_CMD stays 0: the platform is always in ACPI mode (SCI_EN reads as set), so the
    // OS has no SMI handshake to make.
    builder.sci_int = (SCI_IRQ as u16).into();
    builder.pm1a_evt_blk = u32::from(PM1A_EVT).into();
    builder.pm1a_cnt_blk = u32::from(PM1A_CNT).into();
    builder.pm1_evt_len = PM1_EVT_LEN;
    builder.pm1_cnt_len = PM1_CNT_LEN;
    builder.x_pm1a_evt_blk = io_block(PM1A_EVT, PM1_EVT_LEN);
    builder.x_pm1a_cnt_blk = io_block(PM1A_CNT, PM1_CNT_LEN);
    builder.iapc_boot_arch =
        (IAPC_8042 | IAPC_VGA_NOT_PRESENT | IAPC_MSI_NOT_SUPPORTED | IAPC_CMOS_RTC_NOT_PRESENT)
            .into();
    builder.reset_reg = GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        I8042_COMMAND_PORT,
    );
    builder.reset_value = I8042_RESET_VALUE;
    let table: FADT = builder.finalize();
    to_bytes(&table)
}

/// Built on `Sdt` rather than the crate's `MADT`, which offers no way to set the
/// PCAT_COMPAT flag and writes an ACPI 1.0 revision.
fn madt(num_cpus: u8) -> Vec<u8> {
    let mut table = Sdt::new(
        *b"APIC",
        MADT_HEADER_LEN as u32,
        MADT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    table.write_u32(HEADER_LEN, APIC_START as u32);
    table.write_u32(HEADER_LEN + 4, MADT_PCAT_COMPAT);

    let mut entries = Vec::new();
    for cpu in 0..num_cpus {
        // The processor UID only has to be unique; the APIC id is what Linux starts APs by.
        ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled).to_aml_bytes(&mut entries);
    }
    // KVM's IOAPIC has its pin n on GSI n, so the GSI base is 0.
    IoApic::new(num_cpus, IOAPIC_START as u32, 0).to_aml_bytes(&mut entries);
    // Bus 0 (ISA), source IRQ = GSI = the SCI; only the flags differ from the default.
    entries.extend_from_slice(&[MADT_ISO_TYPE, MADT_ISO_ENTRY_LEN as u8, 0, SCI_IRQ as u8]);
    entries.extend_from_slice(&SCI_IRQ.to_le_bytes());
    entries.extend_from_slice(&MADT_ISO_LEVEL_HIGH.to_le_bytes());
    table.append_slice(&entries);
    to_bytes(&table)
}

fn write(
    mem: &GuestMemoryMmap,
    what: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), AcpiError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| AcpiError::Write { what, addr, source })
}

/// Writes the tables for `num_cpus` CPUs with APIC ids `0..num_cpus` and one IOAPIC with
/// id `num_cpus`, and returns the guest-physical address of the RSDP, which PVH passes in
/// `hvm_start_info.rsdp_paddr` and the Linux boot protocol in `boot_params.acpi_rsdp_addr`.
pub fn write_acpi_tables(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<u64, AcpiError> {
    if num_cpus == 0 {
        return Err(AcpiError::NoCpus);
    }
    if num_cpus > MAX_CPUS {
        return Err(AcpiError::TooManyCpus {
            requested: num_cpus,
            max: MAX_CPUS,
        });
    }
    let at = placement(num_cpus);

    let dsdt = dsdt();
    let fadt = fadt(at.dsdt);
    let madt = madt(num_cpus);
    debug_assert_eq!(fadt.len(), FADT_LEN);
    debug_assert_eq!(dsdt.len(), DSDT_LEN);
    debug_assert_eq!(madt.len(), madt_len(num_cpus));
    debug_assert!(at.end <= ACPI_END);

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(at.fadt);
    xsdt.add_entry(at.madt);
    let xsdt = to_bytes(&xsdt);
    let rsdp = to_bytes(&Rsdp::new(OEM_ID, at.xsdt));

    write(mem, "RSDP", RSDP_START, &rsdp)?;
    write(mem, "XSDT", at.xsdt, &xsdt)?;
    write(mem, "FADT", at.fadt, &fadt)?;
    write(mem, "DSDT", at.dsdt, &dsdt)?;
    write(mem, "MADT", at.madt, &madt)?;
    Ok(RSDP_START)
}

#[cfg(test)]
mod tests {
    use super::super::mptable::firmware_tests::{check_cpu_limits, guest_mem, sum};
    use super::*;
    use crate::arch::x86_64::layout::LEGACY_HOLE_START;

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    /// Reads a whole system description table, checking what every table header must hold.
    fn table(mem: &GuestMemoryMmap, addr: u64, signature: &[u8; 4], revision: u8) -> Vec<u8> {
        let header = read(mem, addr, HEADER_LEN);
        assert_eq!(&header[..4], signature, "signature at {addr:#x}");
        let len = u32_at(&header, 4) as usize;
        assert!(len >= HEADER_LEN);
        let bytes = read(mem, addr, len);
        assert_eq!(
            bytes[8],
            revision,
            "{} revision",
            String::from_utf8_lossy(signature)
        );
        assert_eq!(
            sum(&bytes),
            0,
            "{} checksum",
            String::from_utf8_lossy(signature)
        );
        assert_eq!(&bytes[10..16], b"MUSUBI");
        assert!(
            addr >= LEGACY_HOLE_START && addr + len as u64 <= ACPI_END,
            "{} at {addr:#x}+{len:#x} leaves the BIOS area",
            String::from_utf8_lossy(signature)
        );
        bytes
    }

    /// What a guest learns, found the way Linux finds it: from the RSDP down.
    struct Parsed {
        fadt: Vec<u8>,
        dsdt: Vec<u8>,
        lapic_addr: u32,
        madt_flags: u32,
        /// (processor UID, APIC id, flags)
        cpus: Vec<(u8, u8, u32)>,
        /// (id, address, GSI base)
        ioapics: Vec<(u8, u32, u32)>,
        /// Interrupt source overrides: (bus, source IRQ, GSI, flags)
        isos: Vec<(u8, u8, u32, u16)>,
    }

    fn parse(mem: &GuestMemoryMmap, rsdp_addr: u64) -> Parsed {
        assert_eq!(rsdp_addr % 16, 0);
        let rsdp = read(mem, rsdp_addr, 36);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0, "RSDP checksum (first 20 bytes)");
        assert_eq!(sum(&rsdp), 0, "RSDP extended checksum");
        assert_eq!(&rsdp[9..15], b"MUSUBI");
        assert_eq!(rsdp[15], 2, "RSDP revision");
        assert_eq!(u32_at(&rsdp, 16), 0, "no RSDT");
        assert_eq!(u32_at(&rsdp, 20), 36, "RSDP length");

        let xsdt = table(mem, u64_at(&rsdp, 24), b"XSDT", 1);
        assert_eq!((xsdt.len() - HEADER_LEN) % 8, 0);
        let entries: Vec<u64> = (HEADER_LEN..xsdt.len())
            .step_by(8)
            .map(|off| u64_at(&xsdt, off))
            .collect();
        assert_eq!(entries.len(), 2, "XSDT lists the FADT and the MADT");
        let signature = |addr: u64| read(mem, addr, 4);
        let fadt_addr = *entries.iter().find(|&&a| signature(a) == b"FACP").unwrap();
        let madt_addr = *entries.iter().find(|&&a| signature(a) == b"APIC").unwrap();

        let fadt = table(mem, fadt_addr, b"FACP", 6);
        assert_eq!(fadt.len(), 276);
        assert_eq!(fadt[131], 5, "FADT minor version");
        let x_dsdt = u64_at(&fadt, 140);
        assert_eq!(u32_at(&fadt, 40), 0, "only the 64-bit DSDT pointer is set");
        let dsdt = table(mem, x_dsdt, b"DSDT", 2);

        let madt = table(mem, madt_addr, b"APIC", 6);
        let mut parsed = Parsed {
            fadt,
            dsdt,
            lapic_addr: u32_at(&madt, 36),
            madt_flags: u32_at(&madt, 40),
            cpus: Vec::new(),
            ioapics: Vec::new(),
            isos: Vec::new(),
        };
        let mut at = MADT_HEADER_LEN;
        while at < madt.len() {
            let (kind, len) = (madt[at], usize::from(madt[at + 1]));
            let e = &madt[at..at + len];
            match (kind, len) {
                (0, 8) => parsed.cpus.push((e[2], e[3], u32_at(e, 4))),
                (1, 12) => {
                    assert_eq!(e[3], 0, "reserved");
                    parsed.ioapics.push((e[2], u32_at(e, 4), u32_at(e, 8)));
                }
                (2, 10) => parsed.isos.push((e[2], e[3], u32_at(e, 4), u16_at(e, 8))),
                other => panic!("unexpected MADT entry {other:?} at offset {at}"),
            }
            at += len;
        }
        assert_eq!(at, madt.len(), "MADT entries overrun the table");
        parsed
    }

    fn check(num_cpus: u8) -> Parsed {
        let mem = guest_mem();
        let rsdp = write_acpi_tables(&mem, num_cpus).unwrap();
        assert_eq!(rsdp, 0xe0000);
        let p = parse(&mem, rsdp);

        assert_eq!(p.lapic_addr, 0xfee0_0000);
        assert_eq!(p.madt_flags, 1, "PCAT_COMPAT");
        let expected: Vec<_> = (0..num_cpus).map(|i| (i, i, 1)).collect();
        assert_eq!(p.cpus, expected);
        assert_eq!(p.ioapics, vec![(num_cpus, 0xfec0_0000, 0)]);
        // The SCI: ISA IRQ 3 on GSI 3, level-triggered, active high.
        assert_eq!(p.isos, vec![(0, 3, 3, 0b1101)]);
        p
    }

    #[test]
    fn one_to_the_most_cpus() {
        for n in [1, 2, 100, MAX_CPUS] {
            check(n);
        }
    }

    /// The FADT was HW-reduced with an empty DSDT before the power button; the assertions
    /// on what did not change are kept as they were.
    #[test]
    fn fadt_has_pm1_blocks_and_an_sci_and_the_dsdt_names_s5() {
        let p = check(2);
        let flags = u32_at(&p.fadt, 112);
        assert_eq!(flags & (1 << 20), 0, "not HW_REDUCED_ACPI");
        assert_eq!(
            flags & (1 << 4),
            0,
            "PWR_BUTTON clear: a fixed-feature power button"
        );
        assert_ne!(flags & (1 << 5), 0, "SLP_BUTTON set: no sleep button");
        assert_ne!(flags & (1 << 10), 0, "RESET_REG_SUP");
        let boot_arch = u16_at(&p.fadt, 109);
        assert_eq!(boot_arch, 0b10_1110);
        // Reset register: system I/O, 8 bits at 0x64, value 0xfe.
        assert_eq!(&p.fadt[116..120], &[1, 8, 0, 1]);
        assert_eq!(u64_at(&p.fadt, 120), 0x64);
        assert_eq!(p.fadt[128], 0xfe);
        // No FACS: Linux goes without one (there is no global lock and no S3/S4 wake).
        assert_eq!(u32_at(&p.fadt, 36), 0);
        assert_eq!(u64_at(&p.fadt, 132), 0);
        // SCI_INT 3, no SMI_CMD (always in ACPI mode).
        assert_eq!(u16_at(&p.fadt, 46), 3);
        assert_eq!(u32_at(&p.fadt, 48), 0);
        // PM1a event block at 0x600 (4 bytes), control block at 0x604 (2 bytes); no PM1b,
        // no PM timer, no GPE blocks.
        assert_eq!(u32_at(&p.fadt, 56), 0x600);
        assert_eq!(u32_at(&p.fadt, 64), 0x604);
        assert_eq!((p.fadt[88], p.fadt[89]), (4, 2));
        for (off, what) in [
            (60, "PM1b_EVT"),
            (68, "PM1b_CNT"),
            (76, "PM_TMR"),
            (80, "GPE0"),
        ] {
            assert_eq!(u32_at(&p.fadt, off), 0, "{what}");
        }
        // The 64-bit forms: system I/O, 32 and 16 bits wide.
        assert_eq!(&p.fadt[148..152], &[1, 32, 0, 3]);
        assert_eq!(u64_at(&p.fadt, 152), 0x600);
        assert_eq!(&p.fadt[172..176], &[1, 16, 0, 2]);
        assert_eq!(u64_at(&p.fadt, 176), 0x604);
        // Name (_S5_, Package (1) { 5 }): the SLP_TYP the PM device powers off on.
        assert_eq!(
            &p.dsdt[HEADER_LEN..],
            &[0x08, b'_', b'S', b'5', b'_', 0x12, 0x04, 0x01, 0x0a, 0x05]
        );
    }

    #[test]
    fn tables_do_not_overlap() {
        for n in [1, 2, MAX_CPUS] {
            let at = placement(n);
            let rsdp_end = RSDP_START + 36;
            let xsdt_end = at.xsdt + (HEADER_LEN + 16) as u64;
            assert!(rsdp_end <= at.xsdt);
            assert!(xsdt_end <= at.fadt);
            assert!(at.fadt + FADT::len() as u64 <= at.dsdt);
            assert!(at.dsdt + DSDT_LEN as u64 <= at.madt);
            assert_eq!(at.end, at.madt + madt_len(n) as u64);
            assert!(at.end <= ACPI_END);
        }
        assert_eq!(FADT::len(), FADT_LEN);
    }

    #[test]
    fn tables_need_guest_memory_below_1_mib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        let err = write_acpi_tables(&mem, 1).unwrap_err();
        assert!(matches!(
            err,
            AcpiError::Write {
                what: "RSDP",
                addr: 0xe0000,
                ..
            }
        ));
    }

    #[test]
    fn cpu_counts_outside_the_madt_are_refused_naming_the_limit() {
        check_cpu_limits(write_acpi_tables, MAX_CPUS);
    }
}
