//! The network tasks: a virtio-net driver (`driver`), smoltcp on top of it (`stack`) and
//! the tasks themselves (`tasks`, `flows` for `tcp-send` with `procs=P`, and `counter` for
//! `udp-counter`), all at CPL3. The kernel
//! only opens the device for the task and halts it while there is nothing to do
//! (`virtio::net`).

mod counter;
pub(crate) mod driver;
mod flows;
mod stack;
mod tasks;
mod tso;

pub use counter::udp_counter;
pub use tasks::{http_serve, tcp_send, udp_echo};

/// A network task's parameters, parsed by the kernel from the command line and copied to
/// the end of the task's data area (`user::run_task`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Params {
    /// `probe.ip=ADDR/PREFIX`.
    pub ip: [u8; 4],
    pub prefix: u8,
    /// `probe.gw=ADDR`, if given.
    pub has_gw: bool,
    pub gw: [u8; 4],
    /// The host to talk to (`udp-echo`, `tcp-send`); unused by `http-serve`.
    pub peer: [u8; 4],
    /// The peer's port, or the port to listen on (`http-serve`, `udp-counter`).
    pub port: u16,
    /// Rounds (`udp-echo`), bytes (`tcp-send`) or requests (`http-serve`, `udp-counter`).
    pub count: u64,
    /// `procs=P` (`tcp-send`, `udp-echo`): P copies at once, copy i on CPU i and queue
    /// pair i; 0 or 1: one copy, on the task's CPU.
    pub procs: u32,
}

/// Hands out pieces of the task's buffer, front to back.
pub struct Carve {
    next: u64,
    end: u64,
}

impl Carve {
    pub fn new(buf: u64, len: u64) -> Carve {
        Carve {
            next: buf,
            end: buf + len,
        }
    }

    /// `bytes` at a 4 KiB boundary.
    pub fn take(&mut self, bytes: u64) -> Option<u64> {
        let at = self.next.next_multiple_of(4096);
        let end = at.checked_add(bytes)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        Some(at)
    }

    /// `bytes` zeroed, as a slice that lives as long as the task.
    pub fn slice(&mut self, bytes: usize) -> Option<&'static mut [u8]> {
        let at = self.take(bytes as u64)?;
        // SAFETY: a fresh piece of this task's arena: mapped, writable, and handed out
        // only once, so this is the only reference to it; the task never returns.
        let s = unsafe { core::slice::from_raw_parts_mut(at as *mut u8, bytes) };
        s.fill(0);
        Some(s)
    }
}
