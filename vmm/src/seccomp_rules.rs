//! The system calls each thread kind may make: one list, read by the build script, which
//! compiles it to the BPF programs the VMM embeds, and by the unit test that checks those
//! programs against a compile of the same rules on the target.
//!
//! Every number is the kernel's for x86-64, whichever C library the compiling program links:
//! libc's `SYS_*` constants are the kernel's table on glibc and musl alike, and the KVM
//! ioctl type comes from kvm-bindings, generated from the kernel's headers.

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// The thread kinds with a filter of their own, mirrored by `seccomp::ThreadKind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Vcpu,
    Io,
    Control,
    Api,
}

// The build script walks every kind by name; the unit test names them one by one.
#[cfg_attr(test, allow(dead_code))]
impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Vcpu, Kind::Io, Kind::Control, Kind::Api];

    /// The stem of the generated constants that hold this kind's programs.
    pub fn ident(self) -> &'static str {
        match self {
            Kind::Vcpu => "VCPU",
            Kind::Io => "IO",
            Kind::Control => "CONTROL",
            Kind::Api => "API",
        }
    }
}

/// Calls every Rust thread here makes: memory for the allocator, futexes for locks,
/// signal return for kicks, writes of log lines, thread exit. A sleep that a handled
/// signal interrupts (`musubi run`'s SIGUSR1 for its metrics, say) is resumed by the kernel
/// through restart_syscall, so that is here too.
const BASE: &[i64] = &[
    libc::SYS_restart_syscall,
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
    // musl's spellings of the same: `stat` (and `lstat`, for a vsock device's check that
    // its socket file is still its own) for metadata, `tkill` for pthread_kill.
    libc::SYS_stat,
    libc::SYS_lstat,
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

/// What the API thread does after start (its socket and stop eventfd already exist).
const API: &[i64] = &[
    // Taking clients and checking who they are (SO_PEERCRED); musl's `accept` besides
    // std's `accept4`.
    libc::SYS_accept4,
    libc::SYS_accept,
    libc::SYS_getsockopt,
    // Waiting on the listener, the stop eventfd and the clients.
    libc::SYS_poll,
    libc::SYS_ppoll,
    // Requests in and answers out (reads and writes are in BASE and DEVICE_IO).
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    // Making a client non-blocking (std uses FIONBIO), and the KVM ioctls of the vCPUs'
    // and VM's state, which a snapshot it triggers reads on this thread: any ioctl.
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    // Writing a snapshot: its directory, files written whole under a temporary name and
    // renamed, the old ones removed.
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_getdents64,
    libc::SYS_lseek,
    // Pausing and resuming kick the vCPU threads; vmm.shutdown signals the process.
    libc::SYS_kill,
    libc::SYS_tgkill,
    // A snapshot serves the doorbells nobody read yet, and a vsock device may then reset a
    // connection: shut its socket down and drop it from the device's epoll set.
    libc::SYS_shutdown,
    libc::SYS_epoll_ctl,
];

/// A vCPU or I/O thread needs no ioctl outside KVM's type.
fn kvm_ioctls_only() -> Result<Vec<SeccompRule>, BackendError> {
    Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(0xff00),
        u64::from(kvm_bindings::KVMIO) << 8,
    )?])?])
}

/// `TUNSETOFFLOAD`: a virtio-net device passes the offloads its driver accepted on to its
/// TAP when the driver sets DRIVER_OK, which a vCPU's MMIO write (or the I/O thread's
/// doorbell) does. `_IOW('T', 208, unsigned int)`.
pub const TUNSETOFFLOAD: u64 = 0x4004_54d0;

/// `TUNSETQUEUE`: a virtio-net device of several queue pairs attaches and detaches its TAP
/// queues as the driver's VQ_PAIRS_SET (a doorbell on its control queue) or a reset puts
/// pairs in use or out of it. `_IOW('T', 217, int)`.
pub const TUNSETQUEUE: u64 = 0x4004_54d9;

fn net_device_ioctls() -> Result<Vec<SeccompRule>, BackendError> {
    [TUNSETOFFLOAD, TUNSETQUEUE]
        .into_iter()
        .map(|request| {
            SeccompRule::new(vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                request,
            )?])
        })
        .collect()
}

/// `socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)` and nothing else: the
/// vsock device connecting a guest to a host program's listener at `PATH_P`. Any other
/// socket, a blocking one included, stays refused on the I/O thread.
fn vsock_socket() -> Result<Vec<SeccompRule>, BackendError> {
    let ty = (libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) as u64;
    Ok(vec![SeccompRule::new(vec![
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            libc::AF_UNIX as u64,
        )?,
        SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, ty)?,
        SeccompCondition::new(2, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, 0)?,
    ])?])
}

fn fcntl_getfd() -> Result<Vec<SeccompRule>, BackendError> {
    Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::F_GETFD as u64,
    )?])?])
}

/// The filter for `kind`; a call outside it traps (the VMM's SIGSYS handler makes it fail
/// with EPERM), or with `log` is allowed and logged by the kernel.
pub fn program(kind: Kind, log: bool) -> Result<BpfProgram, BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let lists: &[&[i64]] = match kind {
        Kind::Vcpu | Kind::Io => &[BASE, DEVICE_IO],
        Kind::Control => &[BASE, DEVICE_IO, CONTROL],
        Kind::Api => &[BASE, DEVICE_IO, API],
    };
    for nr in lists.iter().flat_map(|l| l.iter()) {
        rules.insert(*nr, vec![]);
    }
    if kind == Kind::Vcpu {
        // A vCPU of a multi-node VM hands forwarded exits and IPIs to its node's coherence
        // thread, whose inbox rings a socket bell. It can send only on sockets it already
        // has: `socket` and `connect` stay refused.
        rules.insert(libc::SYS_sendto, vec![]);
    }
    if matches!(kind, Kind::Vcpu | Kind::Io) {
        let mut ioctls = kvm_ioctls_only()?;
        ioctls.extend(net_device_ioctls()?);
        rules.insert(libc::SYS_ioctl, ioctls);
        // A network device's rate limiter arms its timer where it finds a bucket empty.
        rules.insert(libc::SYS_timerfd_settime, vec![]);
        rules.insert(libc::SYS_timerfd_gettime, vec![]);
        rules.insert(libc::SYS_readv, vec![]);
        rules.insert(libc::SYS_epoll_wait, vec![]);
        rules.insert(libc::SYS_epoll_pwait, vec![]);
        // A vsock device reads and writes its connections' streams wherever a queue is
        // served (std's socket reads and writes are `recvfrom` and `sendto`), and on a
        // guest's RST or a reset shuts one down and drops it from its epoll set.
        rules.insert(libc::SYS_recvfrom, vec![]);
        rules.insert(libc::SYS_sendto, vec![]);
        rules.insert(libc::SYS_shutdown, vec![]);
        rules.insert(libc::SYS_epoll_ctl, vec![]);
        // Closing those sockets: std's debug builds first check the descriptor is open
        // with F_GETFD, and nothing else of fcntl.
        rules.insert(libc::SYS_fcntl, fcntl_getfd()?);
    }
    if kind == Kind::Io {
        // A vsock device takes host programs on its listener and connects guests to host
        // listeners only where its events are served (musl's `accept` besides `accept4`).
        rules.insert(libc::SYS_accept4, vec![]);
        rules.insert(libc::SYS_accept, vec![]);
        rules.insert(libc::SYS_socket, vsock_socket()?);
        rules.insert(libc::SYS_connect, vec![]);
    }
    let mismatch = if log {
        SeccompAction::Log
    } else {
        SeccompAction::Trap
    };
    SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)?.try_into()
}
