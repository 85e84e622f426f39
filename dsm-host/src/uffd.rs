//! The userfaultfd system calls the back-end uses, on the kernel's own definitions.
//!
//! The ioctl numbers and structures come from `linux-raw-sys`, which ships them generated
//! from the kernel's UAPI headers. That keeps the build free of bindgen (and so of libclang),
//! which the userfaultfd crates needed at build time; what is left here is a handful of
//! calls, each a direct ioctl, and the decoding of the one event the back-end asks for.

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The features every region needs: write-protect faults told apart from missing ones, and
/// the faulting thread's id.
const FEATURES: u64 = (uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP | uapi::UFFD_FEATURE_THREAD_ID) as u64;

// The three definitions of linux/userfaultfd.h that linux-raw-sys does not generate; the
// tests below pin them to the header's formulas.
/// `_IO(USERFAULTFD_IOC, 0x00)`: a new userfaultfd from `/dev/userfaultfd`.
const USERFAULTFD_IOC_NEW: u32 = uapi::USERFAULTFD_IOC << 8;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;

/// A userfaultfd, opened non-blocking and close-on-exec, for faults in kernel mode as well
/// as user mode (a vCPU's guest accesses are kernel-mode faults on its behalf).
#[derive(Debug)]
pub(crate) struct Uffd {
    fd: OwnedFd,
}

/// One page fault read from the descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageFault {
    pub addr: u64,
    /// The page was present but write-protected.
    pub write_protected: bool,
    pub write: bool,
    pub thread: u32,
}

impl Uffd {
    /// Opens a userfaultfd and agrees on the API with [`FEATURES`]: the system call first,
    /// then `/dev/userfaultfd` (Linux 6.1+), which a non-root user may have been given
    /// access to where `vm.unprivileged_userfaultfd` is 0.
    pub(crate) fn open() -> std::io::Result<Uffd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: userfaultfd(2) takes only flags and returns a new descriptor or -1.
        let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        let fd = if raw >= 0 {
            // SAFETY: the kernel just returned this descriptor to us alone.
            unsafe { OwnedFd::from_raw_fd(raw as RawFd) }
        } else {
            let syscall_err = std::io::Error::last_os_error();
            Self::open_device(flags).map_err(|_| syscall_err)?
        };
        let uffd = Uffd { fd };
        let mut api = uapi::uffdio_api {
            api: uapi::UFFD_API as u64,
            features: FEATURES,
            ioctls: 0,
        };
        uffd.ioctl(nr::UFFDIO_API, &mut api)?;
        if api.features & FEATURES != FEATURES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                format!(
                    "the kernel's userfaultfd lacks write-protect faults or thread ids (features {:#x})",
                    api.features
                ),
            ));
        }
        Ok(uffd)
    }

    fn open_device(flags: i32) -> std::io::Result<OwnedFd> {
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")?;
        // SAFETY: USERFAULTFD_IOC_NEW takes the new descriptor's flags as its argument and
        // returns the descriptor or -1.
        let raw = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                USERFAULTFD_IOC_NEW as _,
                flags as libc::c_ulong,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above, a descriptor the kernel gave us alone.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    /// Issues `request` with `arg`, whose type must be the one the kernel defines for it.
    fn ioctl<T>(&self, request: u32, arg: &mut T) -> std::io::Result<()> {
        // SAFETY: every caller passes the structure the kernel's definition of `request`
        // names; the kernel reads and writes only within it.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), request as _, arg as *mut T) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Registers `len` bytes at `addr` for missing and write-protect faults.
    pub(crate) fn register(&self, addr: u64, len: u64) -> std::io::Result<()> {
        let mut reg = uapi::uffdio_register {
            range: uapi::uffdio_range { start: addr, len },
            mode: (uapi::UFFDIO_REGISTER_MODE_MISSING | uapi::UFFDIO_REGISTER_MODE_WP) as u64,
            ioctls: 0,
        };
        self.ioctl(nr::UFFDIO_REGISTER, &mut reg)
    }

    /// Takes the range out of userfaultfd; threads waiting on it are woken.
    pub(crate) fn unregister(&self, addr: u64, len: u64) -> std::io::Result<()> {
        let mut range = uapi::uffdio_range { start: addr, len };
        self.ioctl(nr::UFFDIO_UNREGISTER, &mut range)
    }

    /// Copies `len` bytes from `src` into the absent range at `dst` without waking anyone,
    /// write-protected if `write_protect`. `src` must be readable for `len` bytes.
    pub(crate) fn copy(
        &self,
        dst: u64,
        src: *const u8,
        len: u64,
        write_protect: bool,
    ) -> std::io::Result<()> {
        let mut mode = uapi::UFFDIO_COPY_MODE_DONTWAKE as u64;
        if write_protect {
            mode |= uapi::UFFDIO_COPY_MODE_WP as u64;
        }
        let mut copy = uapi::uffdio_copy {
            dst,
            src: src as u64,
            len,
            mode,
            copy: 0,
        };
        self.ioctl(nr::UFFDIO_COPY, &mut copy)
    }

    /// Sets or lifts write protection on a present range, without waking anyone.
    pub(crate) fn write_protect(&self, addr: u64, len: u64, on: bool) -> std::io::Result<()> {
        let mut wp = uapi::uffdio_writeprotect {
            range: uapi::uffdio_range { start: addr, len },
            mode: if on {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                UFFDIO_WRITEPROTECT_MODE_DONTWAKE
            },
        };
        self.ioctl(nr::UFFDIO_WRITEPROTECT, &mut wp)
    }

    /// Lets the threads stopped on the range retry.
    pub(crate) fn wake(&self, addr: u64, len: u64) -> std::io::Result<()> {
        let mut range = uapi::uffdio_range { start: addr, len };
        self.ioctl(nr::UFFDIO_WAKE, &mut range)
    }

    /// Reads the next page fault without waiting; `None` when none is pending. Events of
    /// other kinds (fork, remap, remove, unmap) are never asked for and are skipped.
    pub(crate) fn read_fault(&self) -> std::io::Result<Option<PageFault>> {
        loop {
            // SAFETY: uffd_msg is plain integers and unions of them; all zeros is valid.
            let mut msg: uapi::uffd_msg = unsafe { std::mem::zeroed() };
            let size = std::mem::size_of::<uapi::uffd_msg>();
            // SAFETY: reads at most `size` bytes into `msg`, which is that large.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&mut msg as *mut uapi::uffd_msg).cast(),
                    size,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(None),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            if n as usize != size {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("userfaultfd returned a short message of {n} bytes, not {size}"),
                ));
            }
            if msg.event as u32 != uapi::UFFD_EVENT_PAGEFAULT {
                continue;
            }
            // SAFETY: the kernel fills the pagefault member for UFFD_EVENT_PAGEFAULT, and
            // `ptid` is the member THREAD_ID (negotiated in `open`) fills.
            let (flags, addr, thread) = unsafe {
                let pf = msg.arg.pagefault;
                (pf.flags, pf.address, pf.feat.ptid)
            };
            return Ok(Some(PageFault {
                addr,
                write_protected: flags & uapi::UFFD_PAGEFAULT_FLAG_WP as u64 != 0,
                write: flags & uapi::UFFD_PAGEFAULT_FLAG_WRITE as u64 != 0,
                thread,
            }));
        }
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// `_IOC(dir, type, nr, size)` as the kernel's asm-generic/ioctl.h defines it on x86-64.
    const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
        (dir << 30) | ((size as u32) << 16) | (0xAA << 8) | nr
    }
    const READ_WRITE: u32 = 3;
    const READ: u32 = 2;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(nr::UFFDIO_API, ioc(READ_WRITE, 0x3F, 24));
        assert_eq!(nr::UFFDIO_REGISTER, ioc(READ_WRITE, 0x00, 32));
        assert_eq!(nr::UFFDIO_UNREGISTER, ioc(READ, 0x01, 16));
        assert_eq!(nr::UFFDIO_WAKE, ioc(READ, 0x02, 16));
        assert_eq!(nr::UFFDIO_COPY, ioc(READ_WRITE, 0x03, 40));
        assert_eq!(nr::UFFDIO_WRITEPROTECT, ioc(READ_WRITE, 0x06, 24));
        assert_eq!(USERFAULTFD_IOC_NEW, ioc(0, 0x00, 0));
    }

    #[test]
    fn structures_have_the_kernels_sizes_and_constants_its_values() {
        assert_eq!(size_of::<uapi::uffd_msg>(), 32);
        assert_eq!(size_of::<uapi::uffdio_api>(), 24);
        assert_eq!(size_of::<uapi::uffdio_register>(), 32);
        assert_eq!(size_of::<uapi::uffdio_copy>(), 40);
        assert_eq!(size_of::<uapi::uffdio_writeprotect>(), 24);
        assert_eq!(uapi::UFFD_API, 0xAA);
        assert_eq!(uapi::UFFD_EVENT_PAGEFAULT, 0x12);
        assert_eq!(uapi::UFFD_PAGEFAULT_FLAG_WRITE, 1);
        assert_eq!(uapi::UFFD_PAGEFAULT_FLAG_WP, 2);
        assert_eq!(FEATURES, 1 | 1 << 8);
        assert_eq!(uapi::UFFDIO_COPY_MODE_DONTWAKE, 1);
        assert_eq!(uapi::UFFDIO_COPY_MODE_WP, 2);
        assert_eq!(UFFDIO_WRITEPROTECT_MODE_WP, 1);
        assert_eq!(UFFDIO_WRITEPROTECT_MODE_DONTWAKE, 2);
    }
}
