//! Interior mutability for kernel statics.

use core::cell::UnsafeCell;

/// A static the kernel mutates in place.
///
/// The kernel is single-threaded in practice: one CPU at a time runs the kernel code paths
/// that touch these. That is the BSP, or the AP running a single-CPU task (`cpu=K`) while the
/// BSP only waits for it in `smp::wait` (which touches none of them); "the BSP's kernel path"
/// in the SAFETY comments means that CPU. The workers of multi-CPU tasks get only system
/// calls that use atomics (`smp::on_worker`), and interrupt handlers use atomics too. So a
/// plain cell is enough and avoids `static mut` references.
#[repr(transparent)]
pub struct Global<T>(UnsafeCell<T>);

// SAFETY: see the type's documentation: accesses are confined to one CPU's kernel path at
// a time.
unsafe impl<T> Sync for Global<T> {}

impl<T> Global<T> {
    pub const fn new(v: T) -> Self {
        Self(UnsafeCell::new(v))
    }

    /// # Safety
    /// The caller must not hold another reference obtained from the same `Global`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get(&self) -> &mut T {
        &mut *self.0.get()
    }

    pub fn addr(&self) -> u64 {
        self.0.get() as u64
    }
}
