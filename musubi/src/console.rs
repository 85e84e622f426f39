//! The interactive serial console of `musubi run --serial stdio`: stdin typed into COM1.
//!
//! On a terminal, stdin goes raw (as QEMU's `-serial stdio`) so every key, Ctrl-C included,
//! reaches the guest, and `Ctrl-A` starts a VMM command: `Ctrl-A x` quits, `Ctrl-A Ctrl-A`
//! sends one `Ctrl-A`, `Ctrl-A h` lists these. Piped stdin is passed on byte for byte,
//! without commands, and its end only stops the reading: the VM runs on.
//!
//! The terminal belongs to this process, not to the VMM library, so raw mode and its
//! restoration live here. Restoring happens when the guard is dropped (normal end, guest
//! crash, SIGTERM/SIGINT, which `run` turns into a VM stop) and in a panic hook.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, Once};
use std::thread::JoinHandle;

/// The escape character, as in QEMU: Ctrl-A.
const ESCAPE: u8 = 0x01;

/// How often bytes the guest has not yet made room for are offered again. A UART cannot
/// stall its sender, so a full receive FIFO is retried, never overwritten.
const RETRY_MS: i32 = 10;

/// Terminal input kept for a guest that does not read is bounded; past this the console
/// stops reading until the guest catches up. Piped input keeps at most one read.
const MAX_PENDING: usize = 1 << 20;

const HELP: &str = "\r\nmusubi console: C-a x  quit (status 0)\r\n                C-a C-a  send C-a\r\n                C-a h  this help\r\n";

/// The terminal settings to put back, for the guard and the panic hook alike.
static SAVED: Mutex<Option<(RawFd, libc::termios)>> = Mutex::new(None);
static PANIC_HOOK: Once = Once::new();

fn restore_saved() {
    let saved = SAVED.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some((fd, t)) = saved {
        // SAFETY: tcsetattr reads the termios it is given; a bad fd only makes it fail.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) };
    }
}

pub fn is_terminal(fd: RawFd) -> bool {
    // SAFETY: isatty has no memory effects.
    unsafe { libc::isatty(fd) == 1 }
}

fn termios_of(fd: RawFd) -> io::Result<libc::termios> {
    // SAFETY: an all-zero termios is a valid value to be overwritten by tcgetattr.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes only the termios it is given.
    if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(t)
}

/// A terminal in raw mode until this is dropped (or the process panics).
pub struct RawMode(());

impl RawMode {
    /// Makes `fd` raw: no echo, no line editing, no signals from keys, no input translation.
    /// Output processing stays on, so the host's own messages keep their line breaks.
    pub fn enter(fd: RawFd) -> io::Result<RawMode> {
        let saved = termios_of(fd)?;
        let mut raw = saved;
        raw.c_iflag &= !(libc::IGNBRK
            | libc::BRKINT
            | libc::PARMRK
            | libc::ISTRIP
            | libc::INLCR
            | libc::IGNCR
            | libc::ICRNL
            | libc::IXON);
        raw.c_lflag &= !(libc::ECHO | libc::ECHONL | libc::ICANON | libc::ISIG | libc::IEXTEN);
        raw.c_cflag &= !(libc::CSIZE | libc::PARENB);
        raw.c_cflag |= libc::CS8;
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        PANIC_HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore_saved();
                previous(info);
            }));
        });
        *SAVED.lock().unwrap_or_else(|e| e.into_inner()) = Some((fd, saved));
        // SAFETY: tcsetattr reads the termios it is given.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            let e = io::Error::last_os_error();
            SAVED.lock().unwrap_or_else(|e| e.into_inner()).take();
            return Err(e);
        }
        Ok(RawMode(()))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore_saved();
    }
}

/// What a console command asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Quit,
    Help,
}

/// Splits terminal input into bytes for the guest and `Ctrl-A` commands.
struct Escapes {
    enabled: bool,
    after_escape: bool,
}

impl Escapes {
    fn new(enabled: bool) -> Self {
        Self {
            enabled,
            after_escape: false,
        }
    }

    /// Appends what `b` sends to the guest to `out`; returns a command if it completes one.
    /// An unknown command key is sent on, with its `Ctrl-A`, so nothing typed is lost.
    fn feed(&mut self, b: u8, out: &mut Vec<u8>) -> Option<Command> {
        if !self.enabled {
            out.push(b);
            return None;
        }
        if !self.after_escape {
            if b == ESCAPE {
                self.after_escape = true;
            } else {
                out.push(b);
            }
            return None;
        }
        self.after_escape = false;
        match b {
            b'x' | b'X' => Some(Command::Quit),
            b'h' | b'H' | b'?' => Some(Command::Help),
            ESCAPE => {
                out.push(ESCAPE);
                None
            }
            other => {
                out.extend_from_slice(&[ESCAPE, other]);
                None
            }
        }
    }
}

/// The thread that carries stdin to the guest's COM1 until the VM ends or stdin does.
pub struct Input {
    /// Closing this pipe's write end tells the thread to stop. A pipe rather than an
    /// eventfd: a system-call filter on the control thread then needs no more than `pipe2`,
    /// `poll`, `read` and `close` for it.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl Input {
    /// Starts reading `fd`; `commands` turns on the `Ctrl-A` commands (for a terminal).
    pub fn start(vm: vmm::VmHandle, fd: RawFd, commands: bool) -> io::Result<Input> {
        let mut ends = [0; 2];
        // SAFETY: pipe2 writes two new descriptors into the array, owned below.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors are fresh and owned by nothing else.
        let (stopped, stop) =
            unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        let thread = std::thread::Builder::new()
            .name("console".into())
            .spawn(move || pump(&vm, fd, stopped.as_raw_fd(), Escapes::new(commands)))?;
        Ok(Input {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Input {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pump(vm: &vmm::VmHandle, fd: RawFd, stop: RawFd, mut escapes: Escapes) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 256];
    let mut reading = true;
    loop {
        if !pending.is_empty() {
            let n = vm.serial_input(&pending);
            pending.drain(..n);
        }
        let limit = if escapes.enabled { MAX_PENDING } else { 1 };
        let want_input = reading && pending.len() < limit;
        if !want_input && pending.is_empty() {
            return;
        }
        let mut fds = [
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let nfds = if want_input { 2 } else { 1 };
        let timeout = if pending.is_empty() { -1 } else { RETRY_MS };
        // SAFETY: poll reads and writes `nfds` entries of the live array.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), nfds, timeout) };
        if r < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        if !want_input || fds[1].revents == 0 {
            continue;
        }
        // SAFETY: read writes at most `buf.len()` bytes into the live buffer.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(
                e.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
            ) {
                continue;
            }
            tracing::debug!("console: stdin: {e}; no more input");
            reading = false;
            continue;
        }
        if n == 0 {
            // End of input: what was read still goes to the guest; the VM runs on.
            reading = false;
            continue;
        }
        for &b in &buf[..n as usize] {
            match escapes.feed(b, &mut pending) {
                Some(Command::Quit) => {
                    vm.stop(vmm::Outcome::ConsoleQuit);
                    return;
                }
                Some(Command::Help) => {
                    let _ = io::stderr().write_all(HELP.as_bytes());
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(e: &mut Escapes, input: &[u8]) -> (Vec<u8>, Vec<Command>) {
        let mut out = Vec::new();
        let mut cmds = Vec::new();
        for &b in input {
            cmds.extend(e.feed(b, &mut out));
        }
        (out, cmds)
    }

    #[test]
    fn ctrl_a_x_quits_and_ctrl_a_twice_sends_one() {
        let mut e = Escapes::new(true);
        let (out, cmds) = feed_all(&mut e, b"ab\x01\x01c\x01qd\x01x");
        assert_eq!(out, b"ab\x01c\x01qd");
        assert_eq!(cmds, [Command::Quit]);
        let (_, cmds) = feed_all(&mut e, b"\x01h");
        assert_eq!(cmds, [Command::Help]);
    }

    #[test]
    fn piped_input_passes_unchanged() {
        let mut e = Escapes::new(false);
        let (out, cmds) = feed_all(&mut e, b"\x01x\x01\x01");
        assert_eq!(out, b"\x01x\x01\x01");
        assert!(cmds.is_empty());
    }
}
