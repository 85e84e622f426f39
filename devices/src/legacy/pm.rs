//! The ACPI PM1a registers: the fixed-feature power button and the soft-off (S5) sleep
//! control, so the VMM can ask a guest to shut down and the guest can power the machine off.
//!
//! Only what the power button and S5 need is kept; other status and enable bits read as 0
//! and writes to them are dropped, so an OS probing them (Linux tries GBL_EN for the global
//! lock) learns they are not there.

use crate::{EndRequest, EndSink, Irq};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use vm_device::bus::{PioAddress, PioAddressOffset};
use vm_device::MutDevicePio;

/// PM1a event block: PM1_STS (16 bits) then PM1_EN (16 bits). Port 0x600 is where QEMU's
/// ICH9 puts its PM block too; nothing else of a Musubi VM sits in 0x600..0x606.
pub const PM1A_EVT: u16 = 0x600;
pub const PM1_EVT_LEN: u8 = 4;
/// PM1a control block: PM1_CNT (16 bits), right after the event block.
pub const PM1A_CNT: u16 = PM1A_EVT + PM1_EVT_LEN as u16;
pub const PM1_CNT_LEN: u8 = 2;
/// The device's whole port range, event and control blocks together.
pub const PM_BASE: u16 = PM1A_EVT;
pub const PM_LEN: u16 = (PM1_EVT_LEN + PM1_CNT_LEN) as u16;

/// The SCI's ISA IRQ (= GSI). 9 is customary, but IRQs 5 to 23 belong to the virtio-mmio
/// slots here; 3 (COM2's) is the free legacy line.
pub const SCI_IRQ: u32 = 3;

/// The SLP_TYP that means S5 (soft off); the DSDT's `\_S5_` names this value.
pub const SLP_TYP_S5: u8 = 5;

/// PM1_STS / PM1_EN: the power button's status and enable bits.
pub const PWRBTN_STS: u16 = 1 << 8;
pub const PWRBTN_EN: u16 = 1 << 8;
/// PM1_CNT: SCI_EN (events raise the SCI, not an SMI), SLP_TYP and SLP_EN (write-only).
pub const SCI_EN: u16 = 1 << 0;
const SLP_TYP_SHIFT: u16 = 10;
const SLP_TYP_MASK: u16 = 0b111 << SLP_TYP_SHIFT;
pub const SLP_EN: u16 = 1 << 13;

/// Byte offsets of the registers in the device's range.
const STS: u64 = 0;
const EN: u64 = 2;
const CNT: u64 = 4;

/// The registers a saved VM keeps. An older snapshot has none: it gets the state of a
/// machine just powered on, as its guest (booted with HW-reduced tables) never used them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PmState {
    pub status: u16,
    pub enable: u16,
    pub control: u16,
}

impl Default for PmState {
    /// There is no SMI_CMD, so the machine is always in ACPI mode: SCI_EN reads as set.
    fn default() -> Self {
        PmState {
            status: 0,
            enable: 0,
            control: SCI_EN,
        }
    }
}

pub struct Pm {
    regs: PmState,
    sci: Arc<dyn Irq>,
    sink: Arc<dyn EndSink>,
}

impl Pm {
    pub fn new(sci: Arc<dyn Irq>, sink: Arc<dyn EndSink>) -> Self {
        Pm {
            regs: PmState::default(),
            sci,
            sink,
        }
    }

    /// Presses the power button: PWRBTN_STS is set, and the SCI raised if the guest enabled
    /// it. Returns whether it was: a guest that never enabled the button is not told.
    pub fn press_power_button(&mut self) -> std::io::Result<bool> {
        let before = self.pending();
        self.regs.status |= PWRBTN_STS;
        self.raise_if_new(before)
    }

    pub fn state(&self) -> PmState {
        self.regs
    }

    /// Takes a saved state, keeping only the bits the device has, as a guest write would.
    pub fn restore(&mut self, s: &PmState) {
        self.regs = PmState {
            status: s.status & PWRBTN_STS,
            enable: s.enable & PWRBTN_EN,
            control: s.control & (SCI_EN | SLP_TYP_MASK),
        };
    }

    /// Whether an enabled event is waiting: the SCI's level.
    fn pending(&self) -> bool {
        self.regs.control & SCI_EN != 0 && self.regs.status & self.regs.enable != 0
    }

    /// The SCI is level-triggered, but both interrupt paths pulse a line: a pulse when the
    /// level goes up (an event, or the guest enabling one already pending) tells the guest
    /// once, and its handler clears the status.
    fn raise_if_new(&self, before: bool) -> std::io::Result<bool> {
        if !before && self.pending() {
            self.sci.trigger()?;
            return Ok(true);
        }
        Ok(false)
    }

    fn read_byte(&self, offset: u64) -> u8 {
        let (reg, shift) = match offset {
            STS | 1 => (self.regs.status, (offset - STS) * 8),
            EN | 3 => (self.regs.enable, (offset - EN) * 8),
            CNT | 5 => (self.regs.control, (offset - CNT) * 8),
            _ => return 0xff,
        };
        (reg >> shift) as u8
    }

    /// Applies one byte of a write of any width; SLP_EN is acted on once the whole access is in.
    fn write_byte(&mut self, offset: u64, value: u8) {
        match offset {
            STS | 1 => {
                // Write 1 to clear.
                let bits = u16::from(value) << ((offset - STS) * 8);
                self.regs.status &= !bits;
            }
            EN | 3 => {
                let shift = (offset - EN) * 8;
                let kept = self.regs.enable & !(0xff << shift);
                self.regs.enable = (kept | (u16::from(value) << shift)) & PWRBTN_EN;
            }
            CNT | 5 => {
                let shift = (offset - CNT) * 8;
                let kept = self.regs.control & !(0xff << shift);
                self.regs.control = kept | (u16::from(value) << shift);
            }
            _ => {}
        }
    }
}

impl MutDevicePio for Pm {
    fn pio_read(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.read_byte(u64::from(offset) + i as u64);
        }
    }

    fn pio_write(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &[u8]) {
        let before = self.pending();
        for (i, &b) in data.iter().enumerate() {
            self.write_byte(u64::from(offset) + i as u64, b);
        }
        let sleep = self.regs.control & SLP_EN != 0;
        let typ = (self.regs.control & SLP_TYP_MASK) >> SLP_TYP_SHIFT;
        // SLP_EN is write-only; other bits the device lacks are dropped.
        self.regs.control &= SCI_EN | SLP_TYP_MASK;
        if sleep && typ == u16::from(SLP_TYP_S5) {
            self.sink.request_end(EndRequest::PowerOff);
        }
        // Other sleep states are not offered (no `\_S1_`..`\_S4_`): the write is dropped.
        if let Err(e) = self.raise_if_new(before) {
            tracing::warn!("PM device: cannot raise the SCI (IRQ {SCI_IRQ}): {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::irq::test_util::CountingIrq;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<EndRequest>>);
    impl EndSink for Recorder {
        fn request_end(&self, r: EndRequest) {
            self.0.lock().unwrap().push(r);
        }
    }

    fn pm() -> (Pm, Arc<CountingIrq>, Arc<Recorder>) {
        let irq = Arc::new(CountingIrq::default());
        let rec = Arc::new(Recorder::default());
        (Pm::new(irq.clone(), rec.clone()), irq, rec)
    }

    fn read16(pm: &mut Pm, port: u16) -> u16 {
        let mut b = [0u8; 2];
        pm.pio_read(PioAddress(PM_BASE), port - PM_BASE, &mut b);
        u16::from_le_bytes(b)
    }

    fn write16(pm: &mut Pm, port: u16, v: u16) {
        pm.pio_write(PioAddress(PM_BASE), port - PM_BASE, &v.to_le_bytes());
    }

    #[test]
    fn a_powered_on_machine_is_in_acpi_mode_with_nothing_pending() {
        let (mut pm, irq, _) = pm();
        assert_eq!(read16(&mut pm, PM1A_EVT), 0);
        assert_eq!(read16(&mut pm, PM1A_EVT + 2), 0);
        assert_eq!(read16(&mut pm, PM1A_CNT), SCI_EN);
        assert_eq!(irq.count(), 0);
    }

    #[test]
    fn a_press_sets_the_status_and_raises_the_sci_only_when_enabled() {
        let (mut pm, irq, _) = pm();
        assert!(!pm.press_power_button().unwrap());
        assert_eq!(read16(&mut pm, PM1A_EVT), PWRBTN_STS);
        assert_eq!(irq.count(), 0, "the button is not enabled yet");
        // Enabling an event already pending raises the SCI at once.
        write16(&mut pm, PM1A_EVT + 2, PWRBTN_EN);
        assert_eq!(irq.count(), 1);
        // A second press while the first is not acknowledged raises nothing new.
        assert!(!pm.press_power_button().unwrap());
        assert_eq!(irq.count(), 1);
        // Acknowledged (write 1 to clear), the next press interrupts again.
        write16(&mut pm, PM1A_EVT, PWRBTN_STS);
        assert_eq!(read16(&mut pm, PM1A_EVT), 0);
        assert!(pm.press_power_button().unwrap());
        assert_eq!(irq.count(), 2);
    }

    #[test]
    fn status_bits_clear_only_where_one_is_written() {
        let (mut pm, _, _) = pm();
        pm.press_power_button().unwrap();
        write16(&mut pm, PM1A_EVT, !PWRBTN_STS);
        assert_eq!(read16(&mut pm, PM1A_EVT), PWRBTN_STS, "writing 0 keeps it");
        // A byte write to the high half clears bit 8.
        pm.pio_write(PioAddress(PM_BASE), 1, &[1]);
        assert_eq!(read16(&mut pm, PM1A_EVT), 0);
    }

    #[test]
    fn only_the_power_button_enable_sticks() {
        let (mut pm, _, _) = pm();
        // GBL_EN (bit 5) is how Linux looks for a global lock: it must not stick.
        write16(&mut pm, PM1A_EVT + 2, 0xffff);
        assert_eq!(read16(&mut pm, PM1A_EVT + 2), PWRBTN_EN);
        // A dword write covers status and enable together.
        pm.pio_write(PioAddress(PM_BASE), 0, &[0, 0, 0, 0]);
        assert_eq!(read16(&mut pm, PM1A_EVT + 2), 0);
    }

    #[test]
    fn no_sci_while_sci_en_is_clear() {
        let (mut pm, irq, _) = pm();
        write16(&mut pm, PM1A_CNT, 0);
        write16(&mut pm, PM1A_EVT + 2, PWRBTN_EN);
        assert!(!pm.press_power_button().unwrap());
        assert_eq!(irq.count(), 0);
        write16(&mut pm, PM1A_CNT, SCI_EN);
        assert_eq!(irq.count(), 1, "setting SCI_EN raises the pending event");
    }

    #[test]
    fn slp_en_with_the_s5_type_powers_off_and_other_types_do_nothing() {
        let (mut pm, _, rec) = pm();
        let s5 = u16::from(SLP_TYP_S5) << SLP_TYP_SHIFT;
        // SLP_TYP alone is only stored; SLP_EN reads back as 0.
        write16(&mut pm, PM1A_CNT, SCI_EN | s5);
        assert_eq!(read16(&mut pm, PM1A_CNT), SCI_EN | s5);
        write16(&mut pm, PM1A_CNT, SCI_EN | (1 << SLP_TYP_SHIFT) | SLP_EN);
        assert_eq!(read16(&mut pm, PM1A_CNT) & SLP_EN, 0);
        assert!(rec.0.lock().unwrap().is_empty(), "S1 is not offered");
        // Linux writes SLP_TYP first and then SLP_EN with it, each as a word.
        write16(&mut pm, PM1A_CNT, SCI_EN | s5 | SLP_EN);
        assert_eq!(*rec.0.lock().unwrap(), vec![EndRequest::PowerOff]);
        // A byte write of the high half (SLP_EN | SLP_TYP) works too.
        pm.pio_write(PioAddress(PM_BASE), 5, &[((s5 | SLP_EN) >> 8) as u8]);
        assert_eq!(rec.0.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_restored_state_keeps_only_the_bits_the_device_has() {
        let (mut pm, irq, _) = pm();
        pm.restore(&PmState {
            status: 0xffff,
            enable: 0xffff,
            control: 0xffff,
        });
        assert_eq!(
            pm.state(),
            PmState {
                status: PWRBTN_STS,
                enable: PWRBTN_EN,
                control: SCI_EN | SLP_TYP_MASK,
            }
        );
        assert_eq!(irq.count(), 0, "a restore raises nothing");
        let (mut fresh, _, _) = self::pm();
        fresh.restore(&pm.state());
        assert_eq!(fresh.state(), pm.state());
    }

    #[test]
    fn reads_past_the_registers_float() {
        let (mut pm, _, _) = pm();
        let mut b = [0u8; 4];
        pm.pio_read(PioAddress(PM_BASE), 4, &mut b);
        assert_eq!(b, [1, 0, 0xff, 0xff]);
    }
}
