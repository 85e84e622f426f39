//! Legacy port-I/O devices: COM1, the i8042 reset line, the exit port and the ACPI PM1
//! registers (power button, soft off).

mod exit_port;
mod i8042;
mod pm;
mod serial;

pub use exit_port::{ExitPort, EXIT_PORT};
pub use i8042::{I8042, I8042_BASE, I8042_LEN};
pub use pm::{
    Pm, PmState, PM1A_CNT, PM1A_EVT, PM1_CNT_LEN, PM1_EVT_LEN, PM_BASE, PM_LEN, PWRBTN_EN,
    PWRBTN_STS, SCI_EN, SCI_IRQ, SLP_EN, SLP_TYP_S5,
};
pub use serial::{
    Serial, SerialOutput, SerialRestoreError, SerialSnapshot, SerialState, COM1_BASE, COM1_IRQ,
    COM1_LEN,
};
