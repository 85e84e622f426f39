//! Architecture-specific parts of the VM: layout, boot structures and CPU set-up.

pub mod x86_64;
