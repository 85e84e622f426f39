//! Guest RAM filled from a file on demand: every page starts absent and is read from the
//! file the first time anything touches it, by a thread of its own serving userfaultfd
//! faults. A snapshot restored this way costs no reading before the guest runs, and never
//! reads the pages the guest does not touch.
//!
//! Pages in a hole of the file (a sparse snapshot leaves every page the guest never wrote
//! as a hole) are installed as zeros without a read; the holes are found once, up front,
//! with SEEK_DATA/SEEK_HOLE.

use crate::memory::{Memory, MemoryError};
use dsm::PAGE_SIZE;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use crate::failure::FailureHook;
use crate::failure::FailureSlot;

/// Counters of the fault-serving thread.
#[derive(Debug, Default)]
pub struct DemandStats {
    pub faults: AtomicU64,
    /// Pages read from the file.
    pub pages_read: AtomicU64,
    /// Pages installed as zeros (holes of the file).
    pub zero_pages: AtomicU64,
}

impl DemandStats {
    /// The run's `demand_paging` metrics.
    pub fn to_metrics(&self) -> musubi_types::DemandPaging {
        musubi_types::DemandPaging {
            faults: self.faults.load(Ordering::Relaxed),
            pages_read: self.pages_read.load(Ordering::Relaxed),
            zero_pages: self.zero_pages.load(Ordering::Relaxed),
        }
    }
}

/// Shared by the owner and the fault-serving thread.
struct Shared {
    mem: Memory,
    file: Arc<File>,
    /// Sorted data extents of the file, in pages: (first, count).
    data: Vec<(u64, u64)>,
    stop: AtomicBool,
    stats: DemandStats,
    failure: FailureSlot,
}

/// Anonymous memory of `len` bytes whose pages come from `file` (offset = address - base)
/// as they are first touched.
pub struct DemandRam {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for DemandRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DemandRam({} bytes)", self.shared.mem.len())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DemandError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("finding the data in the memory file: {0}")]
    Extents(std::io::Error),
    #[error("cannot start the page-serving thread: {0}")]
    Thread(std::io::Error),
}

impl DemandRam {
    /// Maps `len` bytes, every page absent, and starts the thread that serves them from
    /// `file`.
    pub fn start(file: Arc<File>, len: usize) -> Result<DemandRam, DemandError> {
        let mem = Memory::new(0, len)?;
        let data = data_pages(&file, len as u64).map_err(DemandError::Extents)?;
        let shared = Arc::new(Shared {
            mem,
            file,
            data,
            stop: AtomicBool::new(false),
            stats: DemandStats::default(),
            failure: FailureSlot::default(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("demand-paging".into())
            .spawn(move || serve(&s))
            .map_err(DemandError::Thread)?;
        Ok(DemandRam {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn host_addr(&self) -> *mut u8 {
        self.shared.mem.host_addr()
    }

    pub fn len(&self) -> usize {
        self.shared.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shared.mem.is_empty()
    }

    pub fn stats(&self) -> &DemandStats {
        &self.shared.stats
    }

    /// Called once with the reason when a page cannot be served (an unreadable file): the
    /// owner ends the VM with it. A failure that came before is handed over at once.
    pub fn on_failure(&self, hook: FailureHook) {
        self.shared.failure.set(hook);
    }

    /// Once no guest code runs any more: takes the memory out of userfaultfd (a fault still
    /// waiting is let go) and stops the thread.
    pub fn release(&self) {
        if let Err(e) = self.shared.mem.release() {
            tracing::warn!("releasing on-demand guest RAM: {e}");
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for DemandRam {
    fn drop(&mut self) {
        self.release();
    }
}

fn fail(s: &Shared, why: String) {
    s.failure.fail(why);
}

/// Serves faults until told to stop; the first page that cannot be served ends it.
fn serve(s: &Shared) {
    let mut buf = dsm::types::zero_page();
    let zeros = dsm::types::zero_page();
    while !s.stop.load(Ordering::Acquire) {
        let fault = match s.mem.next_fault(Some(Duration::from_millis(100))) {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(e) => return fail(s, format!("on-demand guest RAM: {e}")),
        };
        s.stats.faults.fetch_add(1, Ordering::Relaxed);
        let page = fault.page;
        let data: &[u8; PAGE_SIZE] = if in_data(&s.data, page) {
            if let Err(e) = s.file.read_exact_at(&mut buf[..], page * PAGE_SIZE as u64) {
                return fail(
                    s,
                    format!("on-demand guest RAM: reading page {page:#x} of the memory file: {e}"),
                );
            }
            s.stats.pages_read.fetch_add(1, Ordering::Relaxed);
            &buf
        } else {
            s.stats.zero_pages.fetch_add(1, Ordering::Relaxed);
            &zeros
        };
        // A page another fault of the same batch already brought in is left as it is.
        let served = s
            .mem
            .install(page, data, true)
            .and_then(|_| s.mem.wake(page));
        if let Err(e) = served {
            return fail(s, format!("on-demand guest RAM: {e}"));
        }
    }
}

fn in_data(data: &[(u64, u64)], page: u64) -> bool {
    let i = data.partition_point(|&(first, _)| first <= page);
    i > 0 && page < data[i - 1].0 + data[i - 1].1
}

/// The pages of `file` within its first `len` bytes that hold data, as sorted runs.
fn data_pages(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let page = PAGE_SIZE as u64;
    Ok(host_resources::data_extents(file, 0, len)?
        .into_iter()
        .map(|(at, n)| {
            let (first, end) = (at / page, (at + n).div_ceil(page));
            (first, end - first)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_runs_are_found_and_looked_up() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 4096], 8 << 20).unwrap();
        let runs = data_pages(&f, 64 << 20).unwrap();
        assert!(in_data(&runs, (8 << 20) / 4096), "{runs:?}");
        assert!(!in_data(&runs, (40 << 20) / 4096), "{runs:?}");
        assert!(!in_data(&runs, 0) || runs[0].0 == 0, "{runs:?}");
    }

    #[test]
    fn pages_come_from_the_file_and_holes_read_as_zeros() {
        let mut f = tempfile::tempfile().unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(b"snapshot page", 3 * 4096).unwrap();
        std::io::Write::flush(&mut f).unwrap();
        let ram = match DemandRam::start(Arc::new(f), 16 << 20) {
            Ok(r) => r,
            Err(e) => panic!("this test needs userfaultfd (run as root): {e}"),
        };
        let base = ram.host_addr();
        // SAFETY: reads inside the mapping, served by the thread.
        let (page3, page9) = unsafe {
            (
                std::slice::from_raw_parts(base.add(3 * 4096), 13).to_vec(),
                *base.add(9 * 4096 + 5),
            )
        };
        assert_eq!(page3, b"snapshot page");
        assert_eq!(page9, 0);
        assert_eq!(ram.stats().faults.load(Ordering::Relaxed), 2);
        assert_eq!(ram.stats().pages_read.load(Ordering::Relaxed), 1);
        ram.release();
    }
}
