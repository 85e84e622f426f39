//! The i8042 controller, kept only for its reset line: a guest reboot ends the VM.

use crate::{EndRequest, EndSink};
use std::sync::Arc;
use vm_device::bus::{PioAddress, PioAddressOffset};
use vm_device::MutDevicePio;

/// Data port at 0x60, command port at 0x64 (offset 4 from the registered base).
pub const I8042_BASE: u16 = 0x60;
pub const I8042_LEN: u16 = 5;

struct ResetTrigger(Arc<dyn EndSink>);

impl vm_superio::Trigger for ResetTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.request_end(EndRequest::Reset);
        Ok(())
    }
}

pub struct I8042 {
    inner: vm_superio::I8042Device<ResetTrigger>,
}

impl I8042 {
    pub fn new(sink: Arc<dyn EndSink>) -> Self {
        Self {
            inner: vm_superio::I8042Device::new(ResetTrigger(sink)),
        }
    }
}

impl MutDevicePio for I8042 {
    fn pio_read(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &mut [u8]) {
        if data.len() == 1 {
            data[0] = self.inner.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn pio_write(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &[u8]) {
        if data.len() == 1 {
            // The only failure vm-superio reports is the trigger's, which is infallible here.
            let _ = self.inner.write(offset as u8, data[0]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<EndRequest>>);
    impl EndSink for Recorder {
        fn request_end(&self, r: EndRequest) {
            self.0.lock().unwrap().push(r);
        }
    }

    #[test]
    fn cpu_reset_command_requests_reset() {
        let rec = Arc::new(Recorder::default());
        let mut dev = I8042::new(rec.clone());
        dev.pio_write(PioAddress(I8042_BASE), 4, &[0xfe]);
        assert_eq!(*rec.0.lock().unwrap(), vec![EndRequest::Reset]);
    }

    #[test]
    fn other_commands_do_not_reset() {
        let rec = Arc::new(Recorder::default());
        let mut dev = I8042::new(rec.clone());
        dev.pio_write(PioAddress(I8042_BASE), 4, &[0x20]);
        let mut b = [0u8; 1];
        dev.pio_read(PioAddress(I8042_BASE), 4, &mut b);
        assert!(rec.0.lock().unwrap().is_empty());
    }
}
