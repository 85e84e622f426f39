//! The exit port: a guest write of N ends the VM with status N (the probe guest's `exit=N`).

use crate::{EndRequest, EndSink};
use std::sync::Arc;
use vm_device::bus::{PioAddress, PioAddressOffset};
use vm_device::MutDevicePio;

/// The port QEMU's `isa-debug-exit` uses too, so one guest image runs on both.
pub const EXIT_PORT: u16 = 0xf4;

pub struct ExitPort {
    sink: Arc<dyn EndSink>,
}

impl ExitPort {
    pub fn new(sink: Arc<dyn EndSink>) -> Self {
        Self { sink }
    }
}

impl MutDevicePio for ExitPort {
    fn pio_read(&mut self, _base: PioAddress, _offset: PioAddressOffset, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn pio_write(&mut self, _base: PioAddress, offset: PioAddressOffset, data: &[u8]) {
        if offset == 0 && !data.is_empty() {
            self.sink.request_end(EndRequest::Status(data[0]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Recorder(pub Mutex<Vec<EndRequest>>);
    impl EndSink for Recorder {
        fn request_end(&self, r: EndRequest) {
            self.0.lock().unwrap().push(r);
        }
    }

    #[test]
    fn write_requests_exit_with_low_byte() {
        let rec = Arc::new(Recorder::default());
        let mut port = ExitPort::new(rec.clone());
        port.pio_write(PioAddress(EXIT_PORT), 0, &[3, 0, 0, 0]);
        port.pio_write(PioAddress(EXIT_PORT), 0, &[0x2a]);
        assert_eq!(
            *rec.0.lock().unwrap(),
            vec![EndRequest::Status(3), EndRequest::Status(0x2a)]
        );
    }
}
