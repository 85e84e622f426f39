//! The vsock tasks, all at CPL3: a virtio-vsock driver (`driver`) and `vsock-echo` and
//! `vsock-send` (`tasks`). The kernel only opens the device for the task and halts it
//! while there is nothing to do (`virtio::net`).

mod driver;
mod tasks;

pub use tasks::{vsock_echo, vsock_send};

/// A vsock task's parameters, parsed by the kernel from the command line and copied to the
/// end of the task's data area (`user::run_task`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Params {
    /// The port to listen on (`vsock-echo`) or the host port to connect to (`vsock-send`).
    pub port: u32,
    /// Connections (`vsock-echo`) or bytes (`vsock-send`).
    pub count: u64,
}
