//! x86-64: memory layout, firmware tables, boot protocols and vCPU register set-up.

pub mod acpi;
pub mod cpuid;
pub mod layout;
pub mod linux;
pub mod mptable;
pub mod pvh;
pub mod regs;
