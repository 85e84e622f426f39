//! COM1: a vm-superio 8250 whose output goes to stdout, a file, or nowhere.

use crate::irq::SuperioTrigger;
use crate::Irq;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use vm_device::bus::{PioAddress, PioAddressOffset};
use vm_device::MutDevicePio;

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

impl Serial {
    pub fn new(irq: Arc<dyn Irq>, out: SerialOutput) -> Self {
        Self {
            inner: vm_superio::Serial::new(SuperioTrigger(irq), out),
        }
    }

    /// Feeds host input to the guest's receive FIFO.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.inner.enqueue_raw_bytes(bytes).unwrap_or(0)
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
    fn wide_accesses_are_ignored_not_fatal() {
        let irq = Arc::new(CountingIrq::default());
        let mut s = Serial::new(irq, SerialOutput::new(None, None));
        let mut d = [0u8; 4];
        s.pio_read(PioAddress(COM1_BASE), 0, &mut d);
        assert_eq!(d, [0xff; 4]);
        s.pio_write(PioAddress(COM1_BASE), 0, &[1, 2, 3, 4]);
    }
}
