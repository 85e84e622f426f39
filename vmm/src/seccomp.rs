//! System-call filters per thread kind, so a guest that subverts a device model or a vCPU
//! thread is still held to the few calls that thread needs.
//!
//! A call outside a filter does not kill the process: it fails with EPERM, and the VM ends
//! with a VMM error naming the thread kind and the call, after the usual teardown (disks
//! and memory storage are still flushed).

use seccompiler::sock_filter;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// How filters are applied (`--seccomp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeccompMode {
    /// A call outside the filter fails and ends the VM.
    #[default]
    Enforce,
    /// A call outside the filter is allowed and logged by the kernel (audit log).
    Log,
    /// No filters.
    Off,
}

/// A `--seccomp` value that names no mode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--seccomp {0:?}: expected true, false or log")]
pub struct BadSeccompMode(pub String);

impl std::str::FromStr for SeccompMode {
    type Err = BadSeccompMode;
    fn from_str(s: &str) -> Result<Self, BadSeccompMode> {
        match s {
            "true" | "on" => Ok(SeccompMode::Enforce),
            "log" => Ok(SeccompMode::Log),
            "false" | "off" => Ok(SeccompMode::Off),
            _ => Err(BadSeccompMode(s.to_string())),
        }
    }
}

/// The flag value that selects this mode.
impl std::fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SeccompMode::Enforce => "true",
            SeccompMode::Log => "log",
            SeccompMode::Off => "false",
        })
    }
}

/// The kinds of threads a VM runs, each with its own filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ThreadKind {
    Vcpu = 1,
    Io = 2,
    /// The thread that builds, waits for and tears down the VM, and whatever it starts
    /// afterwards (signal and console threads of the `musubi` program).
    Control = 3,
    /// The HTTP control API's thread, which also runs the actions it is asked for.
    Api = 4,
}

impl ThreadKind {
    fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vCPU",
            ThreadKind::Io => "virtio I/O",
            ThreadKind::Control => "control",
            ThreadKind::Api => "API",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot install the {kind} thread's seccomp filter: {source}")]
    Install {
        kind: &'static str,
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
}

/// The rules, compiled to BPF by the build script; here only for the test that checks the
/// embedded programs against them.
#[cfg(test)]
#[path = "seccomp_rules.rs"]
mod rules;

/// The programs the build script compiled, one per thread kind and mismatch action.
mod programs {
    use super::sock_filter;
    include!(concat!(env!("OUT_DIR"), "/seccomp_programs.rs"));
}

/// The filter for `kind`; a call outside it traps (and fails with EPERM), or with
/// `--seccomp log` is allowed and logged by the kernel.
fn program(kind: ThreadKind, mode: SeccompMode) -> &'static [sock_filter] {
    let log = mode == SeccompMode::Log;
    match (kind, log) {
        (ThreadKind::Vcpu, false) => programs::VCPU_TRAP,
        (ThreadKind::Vcpu, true) => programs::VCPU_LOG,
        (ThreadKind::Io, false) => programs::IO_TRAP,
        (ThreadKind::Io, true) => programs::IO_LOG,
        (ThreadKind::Control, false) => programs::CONTROL_TRAP,
        (ThreadKind::Control, true) => programs::CONTROL_LOG,
        (ThreadKind::Api, false) => programs::API_TRAP,
        (ThreadKind::Api, true) => programs::API_LOG,
    }
}

thread_local! {
    static KIND: Cell<u8> = const { Cell::new(0) };
}

/// The first refused call: thread kind in bits 32..40, call number below; 0 for none.
static REFUSED: AtomicU64 = AtomicU64::new(0);

const SIGSYS_SYSCALL_OFFSET: usize = 24;

/// Records the refused call and makes it fail with EPERM, so the thread carries on to a
/// clean stop instead of the process dying with the guest's writes unflushed.
extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: for SIGSYS the kernel fills `_sigsys`, whose `_syscall` int sits at this
    // offset of siginfo_t on x86-64; `ctx` is the ucontext_t of the interrupted thread.
    unsafe {
        let nr = *((info as *const u8).add(SIGSYS_SYSCALL_OFFSET) as *const i32);
        let kind = KIND.with(|k| k.get());
        let _ = REFUSED.compare_exchange(
            0,
            (u64::from(kind) << 32) | u64::from(nr as u32) | (1 << 40),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        let uc = ctx as *mut libc::ucontext_t;
        (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::EPERM as i64);
    }
}

/// Installs the filter for `kind` on the calling thread (and the threads it starts later),
/// nothing with `--seccomp false`, after making sure the handler that reports refused calls
/// is in place.
pub fn apply(kind: ThreadKind, mode: SeccompMode) -> Result<(), SeccompError> {
    if mode == SeccompMode::Off {
        return Ok(());
    }
    static HANDLER: std::sync::OnceLock<Result<(), i32>> = std::sync::OnceLock::new();
    HANDLER
        .get_or_init(|| {
            vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_sigsys)
                .map_err(|e| e.errno())
        })
        .map_err(|e| SeccompError::Handler(std::io::Error::from_raw_os_error(e)))?;
    seccompiler::apply_filter(program(kind, mode)).map_err(|source| SeccompError::Install {
        kind: kind.name(),
        source,
    })?;
    KIND.with(|k| k.set(kind as u8));
    Ok(())
}

/// The first call a filter refused, as a message naming the thread kind and the call.
pub fn refused_call() -> Option<String> {
    let v = REFUSED.load(Ordering::SeqCst);
    if v == 0 {
        return None;
    }
    let kind = match (v >> 32) & 0xff {
        1 => ThreadKind::Vcpu.name(),
        2 => ThreadKind::Io.name(),
        3 => ThreadKind::Control.name(),
        4 => ThreadKind::Api.name(),
        _ => "unfiltered",
    };
    let nr = v as u32;
    Some(format!(
        "seccomp: the {kind} thread made system call {nr}, which its filter does not allow \
         (run with --seccomp log to find every such call, or --seccomp false)"
    ))
}

/// Blocks the process-directed signals a program may handle (SIGTERM, SIGINT, ...) in a
/// VMM thread, so they reach the program's own threads; the vCPU kick and faults stay open.
pub fn block_process_signals(keep: &[libc::c_int]) {
    // SAFETY: the set is initialised by sigfillset before use, and changing this thread's
    // mask has no other effect.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for s in keep.iter().chain(&[
            libc::SIGSYS,
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGFPE,
            libc::SIGILL,
        ]) {
            libc::sigdelset(&mut set, *s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_programs_equal_a_compile_of_the_rules_on_the_target() {
        let pairs = [
            (ThreadKind::Vcpu, rules::Kind::Vcpu),
            (ThreadKind::Io, rules::Kind::Io),
            (ThreadKind::Control, rules::Kind::Control),
            (ThreadKind::Api, rules::Kind::Api),
        ];
        for (kind, rule_kind) in pairs {
            for mode in [SeccompMode::Enforce, SeccompMode::Log] {
                let compiled = rules::program(rule_kind, mode == SeccompMode::Log).unwrap();
                assert!(!compiled.is_empty(), "{kind:?} {mode}");
                assert_eq!(program(kind, mode), &compiled[..], "{kind:?} {mode}");
            }
        }
    }

    #[test]
    fn modes_differ_only_in_the_mismatch_action() {
        for kind in [
            ThreadKind::Vcpu,
            ThreadKind::Io,
            ThreadKind::Control,
            ThreadKind::Api,
        ] {
            let trap = program(kind, SeccompMode::Enforce);
            let log = program(kind, SeccompMode::Log);
            assert_eq!(trap.len(), log.len(), "{kind:?}");
            let differing: Vec<_> = trap
                .iter()
                .zip(log)
                .filter(|(t, l)| t != l)
                .map(|(t, l)| (t.k, l.k))
                .collect();
            assert!(!differing.is_empty(), "{kind:?}");
            assert!(
                differing
                    .iter()
                    .all(|&(t, l)| t == libc::SECCOMP_RET_TRAP && l == libc::SECCOMP_RET_LOG),
                "{kind:?}: {differing:x?}"
            );
        }
    }

    #[test]
    fn modes_parse_as_the_flag_takes_them() {
        assert_eq!("true".parse::<SeccompMode>(), Ok(SeccompMode::Enforce));
        assert_eq!("log".parse::<SeccompMode>(), Ok(SeccompMode::Log));
        assert_eq!("false".parse::<SeccompMode>(), Ok(SeccompMode::Off));
        let e = "maybe".parse::<SeccompMode>().unwrap_err().to_string();
        assert!(e.contains("--seccomp") && e.contains("maybe"), "{e}");
    }

    #[test]
    fn the_threads_that_serve_virtio_rng_may_call_getrandom() {
        // Its doorbell is served on the I/O thread (kernel exits) or a vCPU thread (user
        // exits); its limiter's timer on the I/O thread.
        for kind in [ThreadKind::Io, ThreadKind::Vcpu] {
            let t = std::thread::spawn(move || {
                apply(kind, SeccompMode::Enforce).unwrap();
                let mut buf = [0u8; 64];
                // SAFETY: getrandom(2) writes at most `buf.len()` bytes into `buf`, which
                // lives for the call.
                let r = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
                (r, std::io::Error::last_os_error().raw_os_error())
            });
            let (r, errno) = t.join().unwrap();
            assert_eq!(r, 64, "{kind:?}: errno {errno:?}");
        }
    }

    #[test]
    fn the_threads_that_serve_virtio_net_may_set_offloads_and_attach_tap_queues() {
        assert_eq!(rules::TUNSETOFFLOAD, libc::TUNSETOFFLOAD as u64);
        assert_eq!(rules::TUNSETQUEUE, libc::TUNSETQUEUE as u64);
        // Doorbells (DRIVER_OK, the control queue's VQ_PAIRS_SET) are served on the I/O
        // thread or a vCPU thread. On a descriptor that is not open the ioctl fails with
        // EBADF when the filter lets it through; a refused one fails with EPERM.
        for kind in [ThreadKind::Io, ThreadKind::Vcpu] {
            let t = std::thread::spawn(move || {
                apply(kind, SeccompMode::Enforce).unwrap();
                [libc::TUNSETOFFLOAD, libc::TUNSETQUEUE].map(|request| {
                    let mut ifr = [0u8; 40];
                    // SAFETY: both requests read at most an ifreq (40 bytes) from the
                    // buffer, which lives for the call; descriptor -1 is never open.
                    let r = unsafe { libc::ioctl(-1, request as _, ifr.as_mut_ptr()) };
                    (r, std::io::Error::last_os_error().raw_os_error())
                })
            });
            for (r, errno) in t.join().unwrap() {
                assert_eq!((r, errno), (-1, Some(libc::EBADF)), "{kind:?}");
            }
        }
    }

    #[test]
    fn a_sleep_the_kernel_interrupts_without_a_handler_is_resumed_under_every_filter() {
        // A stop and continue of the process (as a process-directed signal taken by
        // another thread can) wakes a sleeping thread with no handler to run; the kernel
        // then resumes its sleep through restart_syscall.
        for kind in [
            ThreadKind::Vcpu,
            ThreadKind::Io,
            ThreadKind::Control,
            ThreadKind::Api,
        ] {
            let (tx, rx) = std::sync::mpsc::channel();
            let t = std::thread::spawn(move || {
                apply(kind, SeccompMode::Enforce).unwrap();
                tx.send(()).unwrap();
                let d = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 300_000_000,
                };
                // SAFETY: nanosleep(2) reads `d`, which outlives the call, and writes nothing
                // with a null remainder.
                let r = unsafe { libc::nanosleep(&d, std::ptr::null_mut()) };
                (r, std::io::Error::last_os_error().raw_os_error())
            });
            rx.recv().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            let pid = std::process::id();
            // Another process, since this one cannot continue itself once stopped.
            let stopped = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("kill -STOP {pid}; kill -CONT {pid}"))
                .status()
                .unwrap();
            assert!(stopped.success());
            let (r, errno) = t.join().unwrap();
            assert_eq!(r, 0, "{kind:?}: errno {errno:?}, {:?}", refused_call());
        }
    }

    #[test]
    fn a_refused_call_fails_with_eperm_and_is_named() {
        // A thread of its own: filters cannot be removed once installed.
        let t = std::thread::spawn(|| {
            apply(ThreadKind::Io, SeccompMode::Enforce).unwrap();
            // SAFETY: socket() with these arguments only creates a descriptor, and here it
            // is refused before it can.
            let r = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
            (r, std::io::Error::last_os_error().raw_os_error())
        });
        let (r, errno) = t.join().unwrap();
        assert_eq!((r, errno), (-1, Some(libc::EPERM)));
        let m = refused_call().expect("the refusal is recorded");
        assert!(m.contains("virtio I/O thread"), "{m}");
        assert!(
            m.contains(&format!("system call {}", libc::SYS_socket)),
            "{m}"
        );
    }

    #[test]
    fn the_io_thread_may_make_the_vsock_devices_unix_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            apply(ThreadKind::Io, SeccompMode::Enforce).unwrap();
            let ty = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
            // SAFETY: creates a descriptor, closed below.
            let fd = unsafe { libc::socket(libc::AF_UNIX, ty, 0) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            if fd >= 0 {
                // SAFETY: `fd` is the socket just made.
                unsafe { libc::close(fd) };
            }
            (fd >= 0, errno)
        });
        let (made, errno) = t.join().unwrap();
        assert!(made, "errno {errno:?}");
        drop(listener);
    }
}
