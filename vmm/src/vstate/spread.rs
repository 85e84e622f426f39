//! Start-up threads asked to run beside the thread that starts them, not after it.
//!
//! Start-up overlaps work on helper threads: KVM is opened and the host's CPUID probed
//! while the arguments are parsed, and each vCPU is set up while the VM is built. A
//! scheduler that packs runnable threads onto busy cores (the development host's kernel
//! does, `sched_vcpu_pack`) leaves a new thread queued behind its spawner until the spawner
//! blocks, so none of that overlapped: measured there, 31 runs alternating two builds, the
//! median time to the first KVM_RUN went from 2.44 to 1.87 ms with the helpers kept off the
//! spawner's core (and the vCPU filter installed beside the build). Where the scheduler
//! spreads threads anyway, this only says so outright.
//!
//! The helper's CPU mask becomes the spawner's without the spawner's current core; with no
//! other core allowed (one CPU, or a cpuset of one) nothing changes. A thread that goes on
//! to run a vCPU gets the whole mask back first.

use std::mem::size_of;

/// The CPU mask a helper thread had before [`away_from_caller`] narrowed it.
pub struct Narrowed {
    mask: libc::cpu_set_t,
}

/// Asks `thread` to run on any core of the calling thread's mask but the one the caller is
/// on. `None` if there is no other core or the kernel refused; the thread is unchanged then.
pub fn away_from_caller(thread: libc::pthread_t) -> Option<Narrowed> {
    // SAFETY: the masks are plain bit sets the calls fill or read within their size, and
    // `thread` is a live thread of this process (its JoinHandle is held by the caller).
    unsafe {
        let mut mask: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut mask) != 0 {
            return None;
        }
        let here = usize::try_from(libc::sched_getcpu()).ok()?;
        let mut elsewhere = mask;
        libc::CPU_CLR(here, &mut elsewhere);
        if libc::CPU_COUNT(&elsewhere) == 0 {
            return None;
        }
        let r = libc::pthread_setaffinity_np(thread, size_of::<libc::cpu_set_t>(), &elsewhere);
        (r == 0).then_some(Narrowed { mask })
    }
}

impl Narrowed {
    /// Gives `thread`, the one narrowed, its whole mask back. It must not have been joined.
    pub fn restore(self, thread: libc::pthread_t) {
        // SAFETY: as above; the caller keeps the thread's JoinHandle, so it is not joined.
        unsafe {
            libc::pthread_setaffinity_np(thread, size_of::<libc::cpu_set_t>(), &self.mask);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::thread::JoinHandleExt;

    fn mask_of_self() -> libc::cpu_set_t {
        // SAFETY: fills a plain bit set of the size given.
        unsafe {
            let mut m: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut m),
                0
            );
            m
        }
    }

    #[test]
    fn a_helper_runs_off_the_callers_core_until_its_mask_is_given_back() {
        let before = mask_of_self();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let helper = std::thread::spawn(move || {
            for _ in 0..2 {
                go_rx.recv().unwrap();
                seen_tx.send(mask_of_self()).unwrap();
            }
        });
        // SAFETY: CPU_COUNT only reads the set behind the reference it is given.
        let count = |m: &libc::cpu_set_t| unsafe { libc::CPU_COUNT(m) };
        let id = helper.as_pthread_t() as libc::pthread_t;
        match away_from_caller(id) {
            None => assert_eq!(count(&before), 1, "a second core was allowed but not used"),
            Some(n) => {
                go_tx.send(()).unwrap();
                let narrowed = seen_rx.recv().unwrap();
                assert_eq!(count(&narrowed), count(&before) - 1);
                n.restore(id);
                go_tx.send(()).unwrap();
                assert!(
                    // SAFETY: CPU_EQUAL only reads the two sets behind the references it is given.
                    unsafe { libc::CPU_EQUAL(&seen_rx.recv().unwrap(), &before) },
                    "the whole mask is back"
                );
            }
        }
        drop(go_tx);
        helper.join().unwrap();
    }
}
