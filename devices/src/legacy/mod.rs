//! Legacy port-I/O devices: COM1, the i8042 reset line and the exit port.

mod exit_port;
mod i8042;
mod serial;

pub use exit_port::{ExitPort, EXIT_PORT};
pub use i8042::{I8042, I8042_BASE, I8042_LEN};
pub use serial::{
    Serial, SerialOutput, SerialRestoreError, SerialSnapshot, SerialState, COM1_BASE, COM1_IRQ,
    COM1_LEN,
};
