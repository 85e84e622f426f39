//! COM1: a vm-superio 8250 whose output goes to stdout, a file, or nowhere.

use crate::irq::SuperioTrigger;
use crate::Irq;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use vm_device::bus::{PioAddress, PioAddressOffset};
use vm_device::MutDevicePio;
pub use vm_superio::serial::SerialState;

pub const COM1_BASE: u16 = 0x3f8;
pub const COM1_LEN: u16 = 8;
pub const COM1_IRQ: u32 = 4;

/// Where the guest's console goes. Every byte is also kept in a capture buffer when asked,
/// so the VMM can read the probe guest's result lines without parsing stdout.
pub struct SerialOutput {
    sink: Option<Box<dyn Write + Send>>,
    capture: Option<Arc<Mutex<Vec<u8>>>>,
}

impl SerialOutput {
    pub fn new(sink: Option<Box<dyn Write + Send>>, capture: Option<Arc<Mutex<Vec<u8>>>>) -> Self {
        Self { sink, capture }
    }
}

impl Write for SerialOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(c) = &self.capture {
            c.lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(buf);
        }
        if let Some(s) = &mut self.sink {
            // A closed stdout must not take the VM down: the console is best effort.
            let _ = s.write_all(buf);
            if buf.contains(&b'\n') {
                let _ = s.flush();
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if let Some(s) = &mut self.sink {
            let _ = s.flush();
        }
        Ok(())
    }
}

pub struct Serial {
    inner: vm_superio::Serial<SuperioTrigger, vm_superio::serial::NoEvents, SerialOutput>,
}

/// The saved UART state vm-superio refused (its receive FIFO holds more than fits).
#[derive(Debug, thiserror::Error)]
#[error("serial port: {0:?}")]
pub struct SerialRestoreError(#[source] vm_superio::serial::Error<io::Error>);

/// The UART's registers and receive FIFO, as saved in a snapshot: vm-superio's
/// `SerialState`, which has no serde of its own, written field by field as [`StateFields`]
/// lists them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct SerialSnapshot(#[serde(with = "StateFields")] pub SerialState);

/// `SerialState`'s fields for serde; the snapshot's JSON names them so.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(remote = "SerialState", rename = "SerialSnapshot")]
struct StateFields {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

impl Serial {
    /// The UART's state for a snapshot.
    pub fn state(&self) -> SerialSnapshot {
        SerialSnapshot(self.inner.state())
    }

    /// Rebuilds the UART from a saved state, keeping this one's interrupt line and output.
    pub fn restore(&mut self, s: &SerialSnapshot) -> Result<(), SerialRestoreError> {
        let trigger = SuperioTrigger(self.inner.interrupt_evt().0.clone());
        let out = std::mem::replace(self.inner.writer_mut(), SerialOutput::new(None, None));
        self.inner =
            vm_superio::Serial::from_state(&s.0, trigger, vm_superio::serial::NoEvents, out)
                .map_err(SerialRestoreError)?;
        Ok(())
    }

    pub fn new(irq: Arc<dyn Irq>, out: SerialOutput) -> Self {
        Self {
            inner: vm_superio::Serial::new(SuperioTrigger(irq), out),
        }
    }

    /// Feeds host input to the guest's receive FIFO and raises the receive interrupt when the
    /// guest enabled it. Returns how many bytes were taken: fewer than offered (even 0) when
    /// the 64-byte FIFO is full, because a UART cannot make its guest read faster; the caller
    /// keeps the rest and offers it again once the guest has read.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let room = self.inner.fifo_capacity();
        match self.inner.enqueue_raw_bytes(bytes) {
            Ok(n) => n,
            Err(vm_superio::serial::Error::FullFifo) => 0,
            // The bytes are in the FIFO; only the interrupt was lost, and the guest still
            // finds them through the line status register.
            Err(e) => {
                tracing::warn!("serial: receive interrupt: {e:?}");
                bytes.len().min(room)
            }
        }
    }

    pub fn flush(&mut self) {
        let _ = self.inner.writer_mut().flush();
    }
}

impl MutDevicePio for Serial {
    fn pio_read(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &mut [u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            data[0] = self.inner.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn pio_write(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &[u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            if let Err(e) = self.inner.write(offset as u8, data[0]) {
                tracing::warn!("serial: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::irq::test_util::CountingIrq;

    #[test]
    fn transmitted_bytes_reach_the_capture() {
        let cap = Arc::new(Mutex::new(Vec::new()));
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq, SerialOutput::new(None, Some(cap.clone())));
        for b in b"hi\n" {
            s.pio_write(PioAddress(COM1_BASE), 0, &[*b]);
        }
        assert_eq!(&*cap.lock().unwrap(), b"hi\n");
    }

    #[test]
    fn a_snapshot_is_the_registers_by_name_and_restores() {
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq.clone(), SerialOutput::new(None, None));
        s.pio_write(PioAddress(COM1_BASE), 7, &[0x5a]);
        assert_eq!(s.enqueue_input(b"ab"), 2);
        let snap = s.state();
        let json = serde_json::to_value(&snap).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "baud_divisor_low": 12,
                "baud_divisor_high": 0,
                "interrupt_enable": 0,
                "interrupt_identification": 1,
                "line_control": 3,
                "line_status": 0x61,
                "modem_control": 8,
                "modem_status": 0xb0,
                "scratch": 0x5a,
                "in_buffer": [b'a', b'b'],
            })
        );
        let read: SerialSnapshot = serde_json::from_value(json).unwrap();
        assert_eq!(read, snap);
        let mut t = Serial::new(irq, SerialOutput::new(None, None));
        t.restore(&read).unwrap();
        assert_eq!(t.state(), snap);
        assert_eq!(read_reg(&mut t, 7), 0x5a);
    }

    fn read_reg(s: &mut Serial, offset: u16) -> u8 {
        let mut d = [0u8];
        s.pio_read(PioAddress(COM1_BASE + offset), offset, &mut d);
        d[0]
    }

    const IER: u16 = 1;
    const LSR: u16 = 5;
    const LSR_DATA_READY: u8 = 0x01;

    #[test]
    fn input_reaches_the_guest_with_a_receive_interrupt() {
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq.clone(), SerialOutput::new(None, None));
        assert_eq!(read_reg(&mut s, LSR) & LSR_DATA_READY, 0);
        // The guest enables the received-data interrupt, as Linux's 8250 driver does.
        s.pio_write(PioAddress(COM1_BASE + IER), IER, &[0x01]);
        let before = irq.count();
        assert_eq!(s.enqueue_input(b"ok\r"), 3);
        assert!(irq.count() > before, "no receive interrupt");
        let mut got = Vec::new();
        while read_reg(&mut s, LSR) & LSR_DATA_READY != 0 {
            got.push(read_reg(&mut s, 0));
        }
        assert_eq!(got, b"ok\r");
    }

    #[test]
    fn a_full_fifo_takes_nothing_until_the_guest_reads() {
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq, SerialOutput::new(None, None));
        let input: Vec<u8> = (0..100).collect();
        let taken = s.enqueue_input(&input);
        assert!(taken > 0 && taken < input.len(), "took {taken}");
        assert_eq!(s.enqueue_input(&input[taken..]), 0);
        assert_eq!(read_reg(&mut s, 0), 0);
        assert_eq!(s.enqueue_input(&input[taken..]), 1);
        let mut got = Vec::new();
        while read_reg(&mut s, LSR) & LSR_DATA_READY != 0 {
            got.push(read_reg(&mut s, 0));
        }
        assert_eq!(got, input[1..=taken]);
    }

    #[test]
    fn wide_accesses_are_ignored_not_fatal() {
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq, SerialOutput::new(None, None));
        let mut d = [0u8; 4];
        s.pio_read(PioAddress(COM1_BASE), 0, &mut d);
        assert_eq!(d, [0xff; 4]);
        s.pio_write(PioAddress(COM1_BASE), 0, &[1, 2, 3, 4]);
    }
}
