//! Interior mutability for kernel statics.

use core::cell::UnsafeCell;

/// A static the kernel mutates in place.
///
/// The kernel is single-threaded in practice: only the BSP runs kernel code paths that touch
/// these (APs only use atomics), and interrupt handlers use atomics too. So a plain cell is
/// enough and avoids `static mut` references.
#[repr(transparent)]
pub struct Global<T>(UnsafeCell<T>);

// SAFETY: see the type's documentation: accesses are confined to the BSP's main path.
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
