//! System-call filters per thread kind, so a guest that subverts a device model or a vCPU
//! thread is still held to the few calls that thread needs.
//!
//! A call outside a filter does not kill the process: it fails with EPERM, and the VM ends
//! with a VMM error naming the thread kind and the call, after the usual teardown (disks
//! and memory storage are still flushed).

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use std::cell::Cell;
use std::collections::BTreeMap;
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

impl std::str::FromStr for SeccompMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "true" | "on" => Ok(SeccompMode::Enforce),
            "log" => Ok(SeccompMode::Log),
            "false" | "off" => Ok(SeccompMode::Off),
            _ => Err(format!("--seccomp {s:?}: expected true, false or log")),
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
}

impl ThreadKind {
    fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vCPU",
            ThreadKind::Io => "virtio I/O",
            ThreadKind::Control => "control",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {kind} thread's seccomp filter: {source}")]
    Build {
        kind: &'static str,
        source: seccompiler::BackendError,
    },
    #[error("cannot install the {kind} thread's seccomp filter: {source}")]
    Install {
        kind: &'static str,
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
}

/// Calls every Rust thread here makes: memory for the allocator, futexes for locks,
/// signal return for kicks, writes of log lines, thread exit.
const BASE: &[i64] = &[
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_mprotect,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_sched_yield,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_getrandom,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    // musl's spellings of the same: `stat` for metadata, `tkill` for pthread_kill.
    libc::SYS_stat,
    libc::SYS_tgkill,
    libc::SYS_tkill,
];

/// Device I/O against disk images and memory-storage files, and interrupt eventfds.
const DEVICE_IO: &[i64] = &[
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_msync,
];

/// What the control thread does after start: wait, kick, flush, write reports, unmap,
/// start a signal or console thread, restore the terminal.
const CONTROL: &[i64] = &[
    libc::SYS_openat,
    // musl opens files with `open`.
    libc::SYS_open,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_ioctl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_rt_sigaction,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    libc::SYS_sched_getaffinity,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_pipe2,
    libc::SYS_kill,
    libc::SYS_wait4,
];

/// KVM's ioctls all have type 0xAE; a vCPU or I/O thread needs no other ioctl.
const KVMIO: u64 = 0xae;

fn kvm_ioctls_only() -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
    Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(0xff00),
        KVMIO << 8,
    )?])?])
}

fn program(kind: ThreadKind, mode: SeccompMode) -> Result<BpfProgram, SeccompError> {
    let build = |e| SeccompError::Build {
        kind: kind.name(),
        source: e,
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let lists: &[&[i64]] = match kind {
        ThreadKind::Vcpu | ThreadKind::Io => &[BASE, DEVICE_IO],
        ThreadKind::Control => &[BASE, DEVICE_IO, CONTROL],
    };
    for nr in lists.iter().flat_map(|l| l.iter()) {
        rules.insert(*nr, vec![]);
    }
    if kind == ThreadKind::Vcpu {
        // A vCPU of a multi-node VM hands forwarded exits and IPIs to its node's coherence
        // thread, whose inbox rings a socket bell. It can send only on sockets it already
        // has: `socket` and `connect` stay refused.
        rules.insert(libc::SYS_sendto, vec![]);
    }
    if kind != ThreadKind::Control {
        rules.insert(libc::SYS_ioctl, kvm_ioctls_only().map_err(build)?);
        rules.insert(libc::SYS_epoll_wait, vec![]);
        rules.insert(libc::SYS_epoll_pwait, vec![]);
    }
    let mismatch = match mode {
        SeccompMode::Log => SeccompAction::Log,
        _ => SeccompAction::Trap,
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(build)?;
    filter.try_into().map_err(build)
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
    let bpf = program(kind, mode)?;
    seccompiler::apply_filter(&bpf).map_err(|source| SeccompError::Install {
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
    fn every_kind_compiles_in_every_mode() {
        for kind in [ThreadKind::Vcpu, ThreadKind::Io, ThreadKind::Control] {
            for mode in [SeccompMode::Enforce, SeccompMode::Log] {
                assert!(!program(kind, mode).unwrap().is_empty());
            }
        }
    }

    #[test]
    fn modes_parse_as_the_flag_takes_them() {
        assert_eq!("true".parse::<SeccompMode>(), Ok(SeccompMode::Enforce));
        assert_eq!("log".parse::<SeccompMode>(), Ok(SeccompMode::Log));
        assert_eq!("false".parse::<SeccompMode>(), Ok(SeccompMode::Off));
        let e = "maybe".parse::<SeccompMode>().unwrap_err();
        assert!(e.contains("--seccomp") && e.contains("maybe"), "{e}");
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
}
