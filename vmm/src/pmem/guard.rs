//! The read-only guard: a device over each read-only region that logs and counts the guest
//! stores KVM turns into MMIO exits, instead of letting them vanish unseen.

use devices::GuestRegionMmap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tracing::warn;
use vm_device::bus::{MmioAddress, MmioAddressOffset};
use vm_memory::GuestMemoryRegion;

/// Sits on the MMIO bus over a read-only region. KVM turns a guest store into a read-only
/// slot into an MMIO exit; without this the store would vanish on the "unclaimed MMIO" path
/// with nobody told. It is dropped here too, but logged and counted.
pub(super) struct ReadonlyGuard {
    pub(super) file: PathBuf,
    pub(super) mapping: Arc<GuestRegionMmap>,
    pub(super) writes: Arc<AtomicU64>,
}

/// Writes logged one by one before the log thins out to powers of two.
const LOG_FIRST: u64 = 8;

/// Whether write number `n` (1-based) is logged: the first few, then 16, 32, 64, ...
pub fn log_this_write(n: u64) -> bool {
    n <= LOG_FIRST || n.is_power_of_two()
}

impl vm_device::DeviceMmio for ReadonlyGuard {
    fn mmio_read(&self, _base: MmioAddress, offset: MmioAddressOffset, data: &mut [u8]) {
        // Loads are served by KVM from the slot; one only lands here if KVM had to emulate
        // the instruction. Answer from the file, as the slot would.
        let len = self.mapping.len();
        if offset >= len || offset + data.len() as u64 > len {
            data.fill(0xff);
            return;
        }
        // SAFETY: offset..offset+len lies inside the live read-only mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mapping.as_ptr().add(offset as usize),
                data.as_mut_ptr(),
                data.len(),
            )
        };
    }

    fn mmio_write(&self, base: MmioAddress, offset: MmioAddressOffset, data: &[u8]) {
        let n = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if log_this_write(n) {
            warn!(
                "--pmem file={} is read-only: guest write of {} bytes at {:#x} (offset {offset:#x}) dropped ({n} so far)",
                self.file.display(),
                data.len(),
                base.0 + offset,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readonly_write_log_thins_out() {
        let logged: Vec<u64> = (1..=100).filter(|&n| log_this_write(n)).collect();
        assert_eq!(logged, vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]);
    }
}
