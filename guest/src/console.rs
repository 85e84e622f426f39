//! Console input: the `console-echo` task reads one line typed into COM1.
//!
//! The line is gathered by polling the line status register, but the task also routes IRQ4
//! and enables the UART's received-data interrupt, so a byte's arrival wakes the halted CPU
//! at once and the result shows that the interrupt path (UART → IOAPIC pin 4 → LAPIC) works,
//! the path a Linux guest's getty depends on.

use core::sync::atomic::{AtomicU64, Ordering};

use crate::abi::STATUS_CONSOLE_TIMEOUT;
use crate::arch::{inb, outb};
use crate::tasks::Lossy;
use crate::{apic, kprintln, timer};

const COM1: u16 = 0x3f8;
const COM1_IRQ: u32 = 4;
const IER_RX_DATA: u8 = 0x01;
const LSR_DATA_READY: u8 = 0x01;
pub const CONSOLE_VECTOR: u64 = 0x28;
/// Longer lines are cut here; the result says so.
const MAX_LINE: usize = 128;
pub const DEFAULT_WAIT_S: u64 = 30;

static RX_INTERRUPTS: AtomicU64 = AtomicU64::new(0);

/// The receive interrupt: counted, and acknowledged by reading the interrupt identification
/// register. The bytes stay in the FIFO for the waiting task.
pub fn irq() {
    RX_INTERRUPTS.fetch_add(1, Ordering::Relaxed);
    let _ = inb(COM1 + 2);
    apic::eoi();
}

/// Reads one line (ended by CR or LF) for up to `secs` seconds and reports it.
pub fn echo_task(secs: u64) -> u8 {
    let mut line = [0u8; MAX_LINE];
    let mut len = 0;
    let mut ended = false;
    apic::ioapic_route(COM1_IRQ, CONSOLE_VECTOR as u8, apic::id());
    outb(COM1 + 1, IER_RX_DATA);
    // Tells whoever types that input is now awaited (tests wait for this line).
    kprintln!("probe: console-echo: type a line");
    let got = timer::wait_for(secs * 1000, || {
        while !ended && len < MAX_LINE && inb(COM1 + 5) & LSR_DATA_READY != 0 {
            match inb(COM1) {
                b'\r' | b'\n' => ended = true,
                b => {
                    line[len] = b;
                    len += 1;
                }
            }
        }
        ended || len == MAX_LINE
    });
    // Polling may find the whole line before its interrupt is taken: the IOAPIC delivers
    // asynchronously, and input that was already waiting raises it only when the receive
    // interrupt is enabled above. Allow it a bounded moment, so the count tells whether
    // the interrupt path works.
    if len > 0 || ended {
        timer::wait_for(1000, || RX_INTERRUPTS.load(Ordering::Relaxed) > 0);
    }
    outb(COM1 + 1, 0);
    let rx = RX_INTERRUPTS.load(Ordering::Relaxed);
    let text = Lossy(&line[..len]);
    if got {
        kprintln!(
            "{{\"probe\":\"console-echo\",\"ok\":true,\"line\":\"{}\",\"truncated\":{},\"rx_interrupts\":{}}}",
            text,
            !ended,
            rx
        );
        0
    } else {
        kprintln!(
            "{{\"probe\":\"console-echo\",\"ok\":false,\"error\":\"no complete line within {} s\",\"line\":\"{}\",\"rx_interrupts\":{}}}",
            secs,
            text,
            rx
        );
        STATUS_CONSOLE_TIMEOUT
    }
}
