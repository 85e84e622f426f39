//! Helpers shared by the integration tests: regions, patterned pages, and threads that touch
//! memory and may stop on a fault, waited for with a bound.

#![allow(dead_code)]

use dsm::{PageData, PageNo, PAGE_SIZE};
use dsm_host::Memory;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// Bound on every wait; a test that needs it has failed.
pub const WAIT: Duration = Duration::from_secs(10);

/// A region of `pages` pages at guest-physical `gpa`; fails the test, saying why, when
/// userfaultfd cannot be had (these tests must never pass without it).
pub fn region(gpa: u64, pages: usize) -> Arc<Memory> {
    match Memory::new(gpa, pages * PAGE_SIZE) {
        Ok(m) => Arc::new(m),
        Err(e) => panic!("this test needs userfaultfd and could not have it: {e}"),
    }
}

pub fn page_of(gpa: u64) -> PageNo {
    gpa / PAGE_SIZE as u64
}

/// A page whose bytes depend on `seed` and their offset.
pub fn pattern(seed: u8) -> PageData {
    let mut p = dsm::types::zero_page();
    for (i, b) in p.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    p
}

/// A thread about to access one page of a region.
pub struct Toucher {
    addr: usize,
}

/// The access running on its own thread; it may be stopped on a fault.
pub struct Pending<T> {
    rx: mpsc::Receiver<T>,
    what: String,
}

pub fn toucher(mem: &Memory, page: PageNo) -> Toucher {
    Toucher {
        addr: mem.page_addr(page).expect("page in the region") as usize,
    }
}

impl Toucher {
    /// Copies the whole page out with loads.
    pub fn read(self) -> Pending<Vec<u8>> {
        let addr = self.addr;
        spawn(format!("read of {addr:#x}"), move || {
            let mut v = vec![0u8; PAGE_SIZE];
            // SAFETY: `addr` is a page of a live region (the test keeps it alive); a missing
            // or write-protected page only stops this thread until it is served.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), PAGE_SIZE) };
            v
        })
    }

    /// Stores one byte.
    pub fn write(self, offset: usize, value: u8) -> Pending<()> {
        let addr = self.addr + offset;
        spawn(format!("write of {addr:#x}"), move || {
            // SAFETY: as for `read`; one byte inside the page.
            unsafe { std::ptr::write_volatile(addr as *mut u8, value) }
        })
    }

    /// Fills the whole page with stores only (no load first, so one write fault).
    pub fn fill(self, data: PageData) -> Pending<()> {
        let addr = self.addr;
        spawn(format!("fill of {addr:#x}"), move || {
            // SAFETY: as for `read`; exactly one page.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, PAGE_SIZE) }
        })
    }
}

fn spawn<T: Send + 'static>(what: String, f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    Pending { rx, what }
}

impl<T> Pending<T> {
    /// The access's result; fails the test if it is still stopped after [`WAIT`].
    pub fn wait(self) -> T {
        self.rx
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("the {} was not let go within {WAIT:?}", self.what))
    }

    /// True while the access has not completed.
    pub fn still_stopped(&self) -> bool {
        matches!(self.rx.try_recv(), Err(mpsc::TryRecvError::Empty))
    }
}
