//! One region of anonymous memory under userfaultfd: the page primitives the coherence
//! protocol needs (install, write-protect, discard, wake) and the faults it must serve.

use crate::uffd::Uffd;
use dsm::{Access, PageData, PageNo, PAGE_SIZE};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum MemoryError {
    #[error(
        "userfaultfd is unavailable ({source}): kernel-mode faults need root, CAP_SYS_PTRACE, \
         read-write access to /dev/userfaultfd or vm.unprivileged_userfaultfd=1, and \
         write-protect faults need Linux 5.7 or later"
    )]
    Unavailable { source: std::io::Error },
    #[error("region of {len} bytes at guest-physical {gpa:#x}: {why}")]
    Layout {
        gpa: u64,
        len: usize,
        why: &'static str,
    },
    #[error("mmap of {len} bytes of anonymous memory failed: {source}")]
    Map { len: usize, source: std::io::Error },
    #[error(
        "registering {len} bytes at {addr:#x} with userfaultfd (missing + write-protect): {source}"
    )]
    Register {
        addr: usize,
        len: usize,
        source: std::io::Error,
    },
    #[error("page {page:#x} is outside the region (pages {first:#x}..{end:#x})")]
    OutOfRange {
        page: PageNo,
        first: PageNo,
        end: PageNo,
    },
    #[error("{op} on page {page:#x} (host address {addr:#x}) failed: {source}")]
    Op {
        op: &'static str,
        page: PageNo,
        addr: usize,
        source: std::io::Error,
    },
    #[error("reading userfaultfd events: {0}")]
    Read(std::io::Error),
    #[error("waiting for userfaultfd events: {0}")]
    Poll(std::io::Error),
}

/// Whether the fault found no page or a write-protected one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Missing,
    WriteProtect,
}

/// A thread stopped on the region, as reported by userfaultfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub page: PageNo,
    pub addr: usize,
    pub kind: FaultKind,
    pub access: Access,
    /// Kernel thread id of the faulting thread.
    pub thread: i32,
}

/// Guest RAM of one node: `MAP_PRIVATE|MAP_ANONYMOUS`, registered for missing and
/// write-protect faults, not restricted to user-mode faults so that kernel-side copies into it
/// (`preadv` by a device thread) stop and get served like vCPU accesses.
#[derive(Debug)]
pub struct Memory {
    base: NonNull<u8>,
    len: usize,
    gpa: u64,
    uffd: Uffd,
    /// Set by [`Memory::release`]: no vCPU of this node runs any more, so protecting and
    /// waking are moot, and the region's userfaultfd operations would fail with ENOENT while
    /// the coherence thread still serves peers that have not yet heard of the end.
    released: AtomicBool,
}

// SAFETY: the mapping is owned by `Memory` and lives until it is dropped; every operation on
// it goes through the kernel (ioctl, madvise) or copies bytes of pages the caller has shown to
// be present, so sharing the handle between threads is sound.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`; no method hands out references into the mapping.
unsafe impl Sync for Memory {}

impl Memory {
    /// Maps `len` bytes (a multiple of the page size) standing for guest-physical
    /// `gpa..gpa+len`. Every page starts absent, so its first access faults.
    pub fn new(gpa: u64, len: usize) -> Result<Memory, MemoryError> {
        let layout = |why| MemoryError::Layout { gpa, len, why };
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) {
            return Err(layout("length must be a non-zero multiple of 4096"));
        }
        if !gpa.is_multiple_of(PAGE_SIZE as u64) {
            return Err(layout("guest-physical base must be page-aligned"));
        }
        if gpa.checked_add(len as u64).is_none() {
            return Err(layout("region wraps the guest-physical address space"));
        }
        let uffd = Uffd::open().map_err(|source| MemoryError::Unavailable { source })?;
        // SAFETY: a fresh anonymous private mapping at an address the kernel picks; no
        // existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemoryError::Map {
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(p.cast::<u8>()).expect("mmap never returns null on success");
        let mem = Memory {
            base,
            len,
            gpa,
            uffd,
            released: AtomicBool::new(false),
        };
        mem.uffd
            .register(p as u64, len as u64)
            .map_err(|source| MemoryError::Register {
                addr: p as usize,
                len,
                source,
            })?;
        Ok(mem)
    }

    /// Takes the region out of userfaultfd: faults waiting on it are let go and later ones
    /// are served by the kernel as for any anonymous memory (zeros where nothing is).
    ///
    /// For the end of a VM only, once its vCPUs are stopped: a page whose holder has already
    /// ended can never be fetched, and a fault KVM started on its own (an asynchronous page
    /// fault worker) would otherwise hold up the VM's destruction for good. No guest code
    /// runs after this, so nothing sees the stale or empty pages.
    pub fn release(&self) -> Result<(), MemoryError> {
        self.released.store(true, Ordering::SeqCst);
        self.uffd
            .unregister(self.base.as_ptr() as u64, self.len as u64)
            .map_err(|source| MemoryError::Register {
                addr: self.base.as_ptr() as usize,
                len: self.len,
                source,
            })
    }

    /// Host address of the first byte; guest-physical `gpa()` lives there.
    pub fn host_addr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Guest page numbers `first..end` this region holds.
    pub fn pages(&self) -> std::ops::Range<PageNo> {
        let first = self.gpa / PAGE_SIZE as u64;
        first..first + (self.len / PAGE_SIZE) as u64
    }

    /// The guest page a host address falls in.
    pub fn page_of(&self, addr: usize) -> Option<PageNo> {
        let off = addr.checked_sub(self.base.as_ptr() as usize)?;
        (off < self.len).then(|| (self.gpa + off as u64) / PAGE_SIZE as u64)
    }

    /// Host address of a guest page.
    pub fn page_addr(&self, page: PageNo) -> Result<*mut u8, MemoryError> {
        let r = self.pages();
        if !r.contains(&page) {
            return Err(MemoryError::OutOfRange {
                page,
                first: r.start,
                end: r.end,
            });
        }
        let off = ((page - r.start) as usize) * PAGE_SIZE;
        // SAFETY: `off` is inside the mapping, checked above.
        Ok(unsafe { self.base.as_ptr().add(off) })
    }

    fn op_err(
        &self,
        op: &'static str,
        page: PageNo,
        addr: *mut u8,
        e: std::io::Error,
    ) -> MemoryError {
        MemoryError::Op {
            op,
            page,
            addr: addr as usize,
            source: e,
        }
    }

    /// Places `data` in an absent page (`UFFDIO_COPY`), write-protected unless `writable`.
    /// Faulting threads stay stopped until [`Memory::wake`]. Returns false if the page was
    /// already present (nothing changed).
    pub fn install(
        &self,
        page: PageNo,
        data: &[u8; PAGE_SIZE],
        writable: bool,
    ) -> Result<bool, MemoryError> {
        let addr = self.page_addr(page)?;
        // The kernel reads PAGE_SIZE bytes from `data`, a live buffer of that size, and
        // writes only into our registered mapping, at a page-aligned address inside it.
        let r = if self.is_released() {
            Err(std::io::Error::from_raw_os_error(libc::ENOENT))
        } else {
            self.uffd
                .copy(addr as u64, data.as_ptr(), PAGE_SIZE as u64, !writable)
        };
        match r {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(e) if self.released_during(&e) => {
                // SAFETY: `addr` is a page inside the mapping, which is no longer under
                // userfaultfd, so the stores cannot stop this thread; no vCPU runs any more.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr, PAGE_SIZE) };
                Ok(true)
            }
            Err(e) => Err(self.op_err("UFFDIO_COPY", page, addr, e)),
        }
    }

    fn is_released(&self) -> bool {
        self.released.load(Ordering::SeqCst)
    }

    /// True if `e` is what an operation on the region gets once [`Memory::release`] has taken
    /// it out of userfaultfd (the flag is set before that, so it is seen here).
    fn released_during(&self, e: &std::io::Error) -> bool {
        e.raw_os_error() == Some(libc::ENOENT) && self.is_released()
    }

    /// Write-protects a present page (`UFFDIO_WRITEPROTECT` mode WP), or lifts that without
    /// waking anyone. Once it returns, no thread can complete a write to the page.
    pub fn write_protect(&self, page: PageNo, on: bool) -> Result<(), MemoryError> {
        let addr = self.page_addr(page)?;
        if self.is_released() {
            return Ok(());
        }
        match self.uffd.write_protect(addr as u64, PAGE_SIZE as u64, on) {
            Err(e) if !self.released_during(&e) => {
                Err(self.op_err("UFFDIO_WRITEPROTECT", page, addr, e))
            }
            _ => Ok(()),
        }
    }

    /// Discards the page (`MADV_DONTNEED`): its next access faults as missing.
    pub fn discard(&self, page: PageNo) -> Result<(), MemoryError> {
        let addr = self.page_addr(page)?;
        // SAFETY: the range is one page inside our own mapping; dropping its contents is the
        // point, and no Rust reference into the mapping exists.
        let r = unsafe { libc::madvise(addr.cast(), PAGE_SIZE, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(self.op_err("MADV_DONTNEED", page, addr, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Lets every thread stopped on the page retry its access (`UFFDIO_WAKE`).
    pub fn wake(&self, page: PageNo) -> Result<(), MemoryError> {
        let addr = self.page_addr(page)?;
        if self.is_released() {
            return Ok(());
        }
        match self.uffd.wake(addr as u64, PAGE_SIZE as u64) {
            Err(e) if !self.released_during(&e) => Err(self.op_err("UFFDIO_WAKE", page, addr, e)),
            _ => Ok(()),
        }
    }

    /// Copies a page out with plain loads.
    ///
    /// The caller must know the page is present (installed and not discarded since): a load
    /// on an absent page would stop the calling thread on its own userfaultfd, which is the
    /// coherence thread itself.
    pub(crate) fn read_present(&self, page: PageNo) -> Result<PageData, MemoryError> {
        let addr = self.page_addr(page)?;
        let mut out = dsm::types::zero_page();
        // SAFETY: `addr` is a page inside the mapping and present (caller's contract), so the
        // loads do not fault; other threads may only read it meanwhile because the protocol
        // write-protects a page before asking for its bytes.
        unsafe { std::ptr::copy_nonoverlapping(addr, out.as_mut_ptr(), PAGE_SIZE) };
        Ok(out)
    }

    /// Overwrites a present page with plain stores.
    ///
    /// # Safety
    /// The page must be present (a store on an absent page would stop the calling thread on
    /// the userfaultfd it may be serving), and no other thread may access it meanwhile.
    pub unsafe fn write_present(
        &self,
        page: PageNo,
        data: &[u8; PAGE_SIZE],
    ) -> Result<(), MemoryError> {
        let addr = self.page_addr(page)?;
        // SAFETY: `addr` is a page inside the mapping; the caller guarantees it is present
        // and not accessed by anyone else.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr, PAGE_SIZE) };
        Ok(())
    }

    /// Waits up to `timeout` (forever if `None`) for one fault. `Ok(None)` means none came.
    pub fn next_fault(&self, timeout: Option<Duration>) -> Result<Option<Fault>, MemoryError> {
        let mut fd = [libc::pollfd {
            fd: self.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if poll(&mut fd, timeout).map_err(MemoryError::Poll)? == 0 {
            return Ok(None);
        }
        self.read_fault()
    }

    /// Reads one pending fault without waiting.
    pub fn read_fault(&self) -> Result<Option<Fault>, MemoryError> {
        loop {
            let Some(f) = self.uffd.read_fault().map_err(MemoryError::Read)? else {
                return Ok(None);
            };
            let addr = f.addr as usize;
            let Some(page) = self.page_of(addr) else {
                // Only our region is registered; anything else is not ours to serve.
                continue;
            };
            let kind = if f.write_protected {
                FaultKind::WriteProtect
            } else {
                FaultKind::Missing
            };
            let write = f.write_protected || f.write;
            return Ok(Some(Fault {
                page,
                addr,
                kind,
                access: if write { Access::Write } else { Access::Read },
                thread: f.thread as i32,
            }));
        }
    }
}

impl AsRawFd for Memory {
    /// The userfaultfd, readable when a fault is pending.
    fn as_raw_fd(&self) -> RawFd {
        self.uffd.as_raw_fd()
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `new` with this length and nothing refers into
        // it once its owner is gone.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// `ppoll(2)` on `fds`, retried when a signal interrupts it (for the time left); the number
/// of ready descriptors (0 on timeout; `None` waits forever). Nanoseconds, not poll(2)'s
/// milliseconds: a page's hold ends well within a millisecond.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> std::io::Result<usize> {
    let end = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let left = end.map(|e| {
            let d = e.saturating_duration_since(std::time::Instant::now());
            libc::timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64) as _,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            }
        });
        let ts = left
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfds for the call, `ts`
        // null or a timespec that outlives it, and the signal mask pointer null (unchanged).
        let r = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                ts,
                std::ptr::null(),
            )
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
