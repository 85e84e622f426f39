//! The devices' own state: the serial port, the ACPI PM1 registers and each virtio-mmio
//! transport (the queues the driver set up, its negotiated features and status), whatever
//! device sits behind it.

use super::{Persist, PersistError};
use devices::legacy::{Pm, PmState, Serial, SerialSnapshot};
use devices::virtio::{MmioTransport, TransportState};
use std::sync::{Arc, Mutex};

/// A device's lock is taken even if a thread panicked holding it: its registers are plain
/// data, still the guest's last view of the device.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Persist for Mutex<Serial> {
    type State = SerialSnapshot;
    type SaveArgs = ();
    type Error = PersistError;

    fn save(&self, _: &()) -> Result<SerialSnapshot, PersistError> {
        Ok(lock(self).state())
    }

    fn restore(&self, s: &SerialSnapshot) -> Result<(), PersistError> {
        Ok(lock(self).restore(s)?)
    }
}

impl Persist for Mutex<Pm> {
    type State = PmState;
    type SaveArgs = ();
    type Error = PersistError;

    fn save(&self, _: &()) -> Result<PmState, PersistError> {
        Ok(lock(self).state())
    }

    /// Bits the device does not have are dropped, as a guest write would drop them.
    fn restore(&self, s: &PmState) -> Result<(), PersistError> {
        lock(self).restore(s);
        Ok(())
    }
}

impl Persist for Mutex<MmioTransport> {
    type State = TransportState;
    type SaveArgs = ();
    type Error = PersistError;

    /// Call it with no queue being served (the VM paused): the ring positions are read as
    /// they are.
    fn save(&self, _: &()) -> Result<TransportState, PersistError> {
        Ok(lock(self).state())
    }

    /// The restored device is then told it moved (`transport_reset`): what lived outside
    /// guest memory and the saved registers, a vsock device's host connections, did not
    /// come along, and the driver hears so from the device.
    fn restore(&self, s: &TransportState) -> Result<(), PersistError> {
        let mut t = lock(self);
        t.restore(s)?;
        t.transport_reset();
        Ok(())
    }
}

/// Every virtio transport of a VM, in the order the devices were created: the order they
/// are saved in, so a restore gives each its own state.
impl Persist for [Arc<Mutex<MmioTransport>>] {
    type State = Vec<TransportState>;
    type SaveArgs = ();
    type Error = PersistError;

    fn save(&self, _: &()) -> Result<Vec<TransportState>, PersistError> {
        self.iter().map(|t| t.save(&())).collect()
    }

    fn restore(&self, states: &Vec<TransportState>) -> Result<(), PersistError> {
        if states.len() != self.len() {
            return Err(PersistError::TransportCount {
                saved: states.len(),
                here: self.len(),
            });
        }
        for (index, (t, s)) in self.iter().zip(states).enumerate() {
            let mut t = lock(t);
            t.restore(s)
                .map_err(|source| PersistError::Transport { index, source })?;
            // As for one transport: the device is told it moved.
            t.transport_reset();
        }
        Ok(())
    }
}
