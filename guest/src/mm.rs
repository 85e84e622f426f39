//! The kernel's page pool and the mappings it makes for user tasks on demand.
//!
//! The pool is RAM beside the task arena (see `user::init`). It holds the page cache of
//! `file.rs`, page tables and demand-zero pages, and is emptied at the start of every task
//! (nothing in it outlives a task). Two windows of user virtual space are filled page by page
//! from the #PF handler: the file window (`mmap` of the open file: memory storage itself, or
//! page-cache pages) and the anonymous window (demand-zero pages, `page-touch`). Each window's
//! tables are contiguous pool pages, so its PTEs form one flat array.
//!
//! CPL0 code is slow on the development machines, so the kernel's bulk work here is only
//! zeroing tables and pages (`rep stosq`) and the copies of read/write system calls
//! (`kcopy`, counted in `KCOPY_BYTES`).

use core::sync::atomic::{AtomicU64, Ordering};

use crate::global::Global;
use crate::paging::{flush_tlb, invlpg, P, PML4, RW, US};

pub const PAGE: u64 = 4096;

/// Bytes copied by the kernel (read/write system calls), since boot.
pub static KCOPY_BYTES: AtomicU64 = AtomicU64::new(0);
/// User page faults the kernel resolved (file and anonymous windows), since boot.
pub static PAGE_FAULTS: AtomicU64 = AtomicU64::new(0);

struct Pool {
    lo: u64,
    hi: u64,
    next: u64,
}

static POOL: Global<Pool> = Global::new(Pool {
    lo: 0,
    hi: 0,
    next: 0,
});

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Which {
    File = 0,
    Anon = 1,
}

/// PML4 slots of the windows: 32 TiB and 48 TiB, far from the identity map (slot 0) and
/// from the address the `fault` task reads (slot 254).
const SLOTS: [usize; 2] = [64, 96];

#[derive(Clone, Copy)]
struct Window {
    base: u64,
    pages: u64,
    /// Physical address of the flat PTE array.
    ptes: u64,
}

static WINDOWS: Global<[Option<Window>; 2]> = Global::new([None, None]);

/// The pool's bounds and fill mark.
fn the_pool() -> &'static mut Pool {
    // SAFETY: the pool is used only on the BSP's kernel path (boot, system calls, the #PF
    // handler for user faults, which never interrupts one of those), and no caller keeps the
    // reference past its own call.
    unsafe { POOL.get() }
}

pub fn init(lo: u64, hi: u64) {
    *the_pool() = Pool { lo, hi, next: lo };
}

pub fn pool() -> (u64, u64) {
    let p = the_pool();
    (p.lo, p.hi)
}

/// Empties the pool and removes both windows (between tasks).
pub fn reset() {
    let p = the_pool();
    // SAFETY: WINDOWS and the page tables are touched only on the BSP's kernel path, like
    // the pool, and no other reference to them is live during this call.
    let (w, pml4) = unsafe { (WINDOWS.get(), PML4.get()) };
    p.next = p.lo;
    for (i, slot) in SLOTS.iter().enumerate() {
        pml4.0[*slot] = 0;
        w[i] = None;
    }
    flush_tlb();
}

/// `n` contiguous pool pages (not zeroed).
pub fn alloc(n: u64) -> Option<u64> {
    let p = the_pool();
    let bytes = n.checked_mul(PAGE)?;
    if p.hi.saturating_sub(p.next) < bytes {
        return None;
    }
    let a = p.next;
    p.next += bytes;
    Some(a)
}

/// Pool bytes still free.
pub fn free_bytes() -> u64 {
    let p = the_pool();
    p.hi - p.next
}

/// Zeroes `bytes` (a multiple of 8) at `addr` with `rep stosq`.
pub fn zero(addr: u64, bytes: u64) {
    // SAFETY: callers pass pool memory they own (from `alloc`, identity-mapped RAM no Rust
    // reference points into); the count and direction flag (clear, per the ABI) keep the
    // stores inside it.
    unsafe {
        core::arch::asm!(
            "rep stosq",
            inout("rcx") bytes / 8 => _,
            inout("rdi") addr => _,
            in("rax") 0u64,
            options(nostack, preserves_flags),
        );
    }
}

/// The kernel side of read/write system calls: `rep movsq`, then the odd bytes. Counted.
pub fn kcopy(dst: u64, src: u64, len: u64) {
    // SAFETY: callers checked both ranges (user arena, storage, or page cache): mapped,
    // `len` bytes long, and not the same bytes; the task that owns them is stopped in a
    // system call, so no reference to them is live.
    unsafe {
        core::arch::asm!(
            "rep movsq",
            "mov rcx, {rest}",
            "rep movsb",
            rest = in(reg) len % 8,
            inout("rcx") len / 8 => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags),
        );
    }
    KCOPY_BYTES.fetch_add(len, Ordering::Relaxed);
}

/// Creates window `which` for `pages` pages, all absent; returns its user address.
pub fn map_window(which: Which, pages: u64) -> Option<u64> {
    let slot = SLOTS[which as usize];
    let base = (slot as u64) << 39;
    if pages == 0 || pages > 1 << 27 {
        return None;
    }
    let pts = pages.div_ceil(512);
    let pds = pts.div_ceil(512);
    let total = 1 + pds + pts;
    let mem = alloc(total)?;
    zero(mem, total * PAGE);
    let pd_base = mem + PAGE;
    let pt_base = pd_base + pds * PAGE;
    // SAFETY: `mem` is `total` fresh pool pages from `alloc` (identity-mapped, used by no one
    // else), the stores stay in its first `1 + pds` pages; PML4 and WINDOWS are touched only
    // on the BSP's kernel path and no other reference to them is live here.
    unsafe {
        for d in 0..pds {
            *((mem + d * 8) as *mut u64) = (pd_base + d * PAGE) | P | RW | US;
        }
        for t in 0..pts {
            *((pd_base + t * 8) as *mut u64) = (pt_base + t * PAGE) | P | RW | US;
        }
        PML4.get().0[slot] = mem | P | RW | US;
        WINDOWS.get()[which as usize] = Some(Window {
            base,
            pages,
            ptes: pt_base,
        });
    }
    flush_tlb();
    Some(base)
}

fn window(which: Which) -> Option<Window> {
    // SAFETY: a copy read on the BSP's kernel path; no reference to WINDOWS is live.
    unsafe { WINDOWS.get()[which as usize] }
}

/// Removes every page of the window (keeps the window).
pub fn unmap_all(which: Which) {
    if let Some(w) = window(which) {
        zero(w.ptes, w.pages * 8);
        flush_tlb();
    }
}

/// Replaces page `k`'s PTE by what `f` makes of it, if anything, and drops the old one
/// from the TLB.
fn edit_pte(which: Which, k: u64, f: impl FnOnce(u64) -> Option<u64>) {
    if let Some(w) = window(which) {
        if k < w.pages {
            let pte = (w.ptes + k * 8) as *mut u64;
            // SAFETY: `k < w.pages`, so `pte` is inside the window's flat PTE array (pool
            // pages `map_window` allocated, which no Rust reference points into).
            unsafe {
                if let Some(v) = f(*pte) {
                    *pte = v;
                    invlpg(w.base + k * PAGE);
                }
            }
        }
    }
}

/// Removes page `k` of the window if it is mapped (its page-cache slot went to another
/// page).
pub fn unmap(which: Which, k: u64) {
    edit_pte(which, k, |e| (e & P != 0).then_some(0));
}

/// Makes page `k` of the window read-only if it is mapped.
pub fn write_protect(which: Which, k: u64) {
    edit_pte(which, k, |e| (e & RW != 0).then_some(e & !RW));
}

/// Handles a #PF from CPL3 in one of the windows. False: not ours (the task faulted).
pub fn user_fault(error: u64, cr2: u64) -> bool {
    let write = error & 2 != 0;
    for which in [Which::File, Which::Anon] {
        let Some(w) = window(which) else { continue };
        if cr2 < w.base || (cr2 - w.base) / PAGE >= w.pages {
            continue;
        }
        let k = (cr2 - w.base) / PAGE;
        let target = match which {
            Which::File => crate::file::fault(k, write),
            Which::Anon => alloc(1).map(|page| {
                zero(page, PAGE);
                (page, true)
            }),
        };
        let Some((phys, writable)) = target else {
            return false;
        };
        let pte = (w.ptes + k * 8) as *mut u64;
        // SAFETY: as in `write_protect`: `k < w.pages` was checked above.
        unsafe {
            let was = *pte;
            *pte = phys | P | US | if writable { RW } else { 0 };
            if was & P != 0 {
                invlpg(w.base + k * PAGE);
            }
        }
        PAGE_FAULTS.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}
