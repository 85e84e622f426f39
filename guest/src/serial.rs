//! COM1, polled. Also usable from CPL3 (the TSS I/O bitmap allows every port), which the
//! panic handler relies on.

use crate::arch::{inb, outb, pause};

const COM1: u16 = 0x3f8;

pub fn init() {
    outb(COM1 + 1, 0x00); // no UART interrupts: output is polled
    outb(COM1 + 3, 0x80); // divisor latch
    outb(COM1, 0x01); // 115200 baud
    outb(COM1 + 1, 0x00);
    outb(COM1 + 3, 0x03); // 8N1
    outb(COM1 + 2, 0xc7); // FIFO on, cleared
    outb(COM1 + 4, 0x03); // DTR, RTS
}

/// Every port access is a VM exit (~85 µs here), so the line status is read once per
/// 16-byte FIFO load rather than once per byte.
pub fn write(bytes: &[u8]) {
    for chunk in bytes.chunks(16) {
        let mut tries = 0u32;
        while inb(COM1 + 5) & 0x20 == 0 && tries < 100_000 {
            tries += 1;
            pause();
        }
        for &b in chunk {
            outb(COM1, b);
        }
    }
}

pub struct Console;

impl core::fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        write(s.as_bytes());
        Ok(())
    }
}

#[macro_export]
macro_rules! kprint {
    ($($arg:tt)*) => {{
        let _ = core::fmt::Write::write_fmt(&mut $crate::serial::Console, format_args!($($arg)*));
    }};
}

#[macro_export]
macro_rules! kprintln {
    ($($arg:tt)*) => {{
        let _ = core::fmt::Write::write_fmt(
            &mut $crate::serial::Console,
            format_args!("{}\n", format_args!($($arg)*)),
        );
    }};
}
