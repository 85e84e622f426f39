//! The KVM work that depends on nothing in a VM's configuration (opening `/dev/kvm`,
//! probing the host's CPUID), started before the configuration is known, on the thread that
//! then sets up and runs the first vCPU.
//!
//! A program that parses its arguments first gets this done beside the parsing. The VM
//! itself is created by the build: KVM_GET_SUPPORTED_CPUID (a trap per CPUID leaf on a
//! virtual host, 0.3 ms there) and KVM_CREATE_VM (0.2 ms) then run at the same time on two
//! cores, where on this thread one waited for the other. Measured on such a host (41 runs
//! of each, interleaved): first KVM_RUN at 1.79 ms (median) with the VM made here, 1.60 ms
//! with it made by the build.

use super::spread::{self, Narrowed};
use super::vcpu_thread::SharedCpuid;
use super::vm::{open_kvm, VmError};
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::Kvm;
use std::os::unix::thread::JoinHandleExt;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// KVM made ready on a thread of its own; [`crate::Vmm::build_on`] takes it.
pub struct HostPrep {
    kvm: Option<Receiver<Result<Arc<Kvm>, VmError>>>,
    /// Filled by the same thread once KVM is handed over: the vCPU threads that need it
    /// wait for it there, while the build goes on with the VM.
    cpuid: SharedCpuid,
    spare: Option<SpareThread>,
}

/// Work handed to the thread once its own is done.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The thread that prepared KVM, waiting for one more job. Dropped unused, it ends.
pub(crate) struct SpareThread {
    jobs: Sender<Job>,
    thread: JoinHandle<()>,
    /// Its mask without the spawner's core, for whoever takes the thread over to restore.
    narrowed: Option<Narrowed>,
}

impl SpareThread {
    /// Runs `job` on this thread and hands over its handle and narrowed mask; the job back
    /// if the thread has already ended (it gave up when KVM could not be opened).
    pub(crate) fn take_over(self, job: Job) -> Result<(JoinHandle<()>, Option<Narrowed>), Job> {
        match self.jobs.send(job) {
            Ok(()) => Ok((self.thread, self.narrowed)),
            Err(e) => Err(e.0),
        }
    }
}

impl HostPrep {
    /// Starts the work. Nothing fails here: a host without KVM, or a thread that cannot
    /// start, is reported by the build that takes the result, as it would be without it.
    pub fn start() -> HostPrep {
        let (tx, rx) = channel();
        let (jobs, next) = channel::<Job>();
        let cpuid = SharedCpuid::default();
        let cell = cpuid.clone();
        let work = move || {
            let kvm = match open_kvm() {
                Ok(k) => k,
                Err(e) => return drop(tx.send(Err(e))),
            };
            let _ = tx.send(Ok(kvm.clone()));
            cell.get_or_init(|| kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES));
            drop(kvm);
            // Starting a thread costs the spawner about 0.07 ms on a virtual host, and the
            // new thread waits for a core; this one is running already.
            if let Ok(job) = next.recv() {
                job();
            }
        };
        let spare = std::thread::Builder::new()
            .name("kvm-prep".into())
            .spawn(work)
            .ok()
            .map(|thread| SpareThread {
                narrowed: spread::away_from_caller(thread.as_pthread_t() as libc::pthread_t),
                jobs,
                thread,
            });
        HostPrep {
            kvm: spare.is_some().then_some(rx),
            cpuid,
            spare,
        }
    }

    /// KVM, the cell the thread fills with the host's CPUID, and the thread itself; `None`
    /// if the thread could not start or ended early, for the build to do the work itself.
    pub(crate) fn take(self) -> Option<Prepared> {
        let kvm = self.kvm?.recv().ok()?;
        Some(Prepared {
            kvm,
            cpuid: self.cpuid,
            spare: self.spare,
        })
    }
}

/// What [`HostPrep::take`] hands the build.
pub(crate) struct Prepared {
    pub kvm: Result<Arc<Kvm>, VmError>,
    pub cpuid: SharedCpuid,
    pub spare: Option<SpareThread>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared() -> Prepared {
        let p = HostPrep::start()
            .take()
            .expect("the KVM helper thread starts");
        assert!(p.kvm.is_ok(), "/dev/kvm: {:?}", p.kvm.as_ref().err());
        p
    }

    #[test]
    fn the_helper_runs_the_job_it_is_handed_after_its_own_work() {
        let p = prepared();
        let cpuid = p.cpuid.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let job: Job = Box::new(move || {
            let name = std::thread::current().name().map(String::from);
            tx.send((name, cpuid.get().is_some())).unwrap();
        });
        let (thread, _) = p
            .spare
            .expect("the thread is running")
            .take_over(job)
            .unwrap_or_else(|_| panic!("the helper ended before its job came"));
        let (name, probed) = rx.recv().unwrap();
        assert_eq!(name.as_deref(), Some("kvm-prep"));
        assert!(probed, "the job ran before the host's CPUID was probed");
        thread.join().unwrap();
    }

    #[test]
    fn a_helper_given_no_job_ends() {
        let SpareThread { jobs, thread, .. } = prepared().spare.expect("the thread is running");
        drop(jobs);
        thread.join().unwrap();
    }
}
