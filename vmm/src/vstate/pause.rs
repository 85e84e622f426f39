//! Where a VM's threads stop when it is paused, and where a paused vCPU does work it is
//! handed (reading or writing its own state: KVM's vCPU calls belong on its thread).
//!
//! A vCPU can also stand by: created in this process but run elsewhere (by another node of a
//! VM over several hosts). It waits here, counted as parked, until its state comes and it
//! is made active; a running vCPU that leaves for another node stands by from then on.
//!
//! A pause is asked for here and the threads are kicked; each parks at its next exit (a
//! vCPU) or its next wake-up (the I/O thread), between two requests, so nothing is ever
//! half done when the last one has parked.

use crate::control::RunControl;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Work for one parked vCPU, run on its thread.
pub type VcpuJob = Box<dyn FnOnce(&mut super::vcpu::Vcpu) + Send>;

#[derive(Default)]
struct State {
    /// A pause is asked for (or in force).
    paused: bool,
    /// Threads parked now.
    parked: usize,
    /// Jobs for the vCPU at each local index.
    jobs: Vec<Option<VcpuJob>>,
}

/// Shared by every thread of one VM and whoever pauses it.
pub struct PauseGate {
    state: Mutex<State>,
    changed: Condvar,
    /// Mirrors `state.paused`, so a vCPU checks it after every exit without a lock.
    asked: AtomicBool,
    /// Threads that park: the local vCPUs and the I/O thread, if there is one.
    members: usize,
    /// The vCPUs (by local index) that stand by instead of running; changed under `state`'s
    /// lock, read without it after every exit.
    standby: Vec<AtomicBool>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PauseError {
    #[error("the VM has ended")]
    Ended,
    #[error("the vCPU runs: it must be paused or standing by")]
    Running,
    #[error("{parked} of {members} VM threads stopped within {wait:?}; the VM runs on")]
    Timeout {
        parked: usize,
        members: usize,
        wait: Duration,
    },
}

impl PauseGate {
    pub fn new(vcpus: usize, io_threads: usize) -> PauseGate {
        PauseGate {
            state: Mutex::new(State {
                jobs: (0..vcpus).map(|_| None).collect(),
                ..State::default()
            }),
            changed: Condvar::new(),
            asked: AtomicBool::new(false),
            members: vcpus + io_threads,
            standby: (0..vcpus).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// Puts the gate in a pause before any member runs: each vCPU parks before its first
    /// KVM_RUN, and the VM is paused as if [`PauseGate::pause`] had returned.
    pub fn pause_at_start(&self) {
        let mut s = self.lock();
        s.paused = true;
        self.asked.store(true, Ordering::Release);
    }

    /// Whether the vCPU at local index `index` stands by.
    pub fn is_standby(&self, index: usize) -> bool {
        self.standby
            .get(index)
            .is_some_and(|s| s.load(Ordering::Acquire))
    }

    /// Makes the vCPU at `index` stand by (`true`: it stops at its next exit and waits) or
    /// run (`false`: it leaves its wait, once no pause is in force).
    pub fn set_standby(&self, index: usize, on: bool) {
        let _s = self.lock();
        if let Some(f) = self.standby.get(index) {
            f.store(on, Ordering::Release);
        }
        self.changed.notify_all();
    }

    /// Waits while the calling vCPU (local index `index`) stands by, counted as parked so a
    /// pause never waits for it, running the jobs it is handed (its state arriving among
    /// them). Returns once it is to run and no pause is in force, or the VM has ended.
    pub fn wait_standby(&self, index: usize, vcpu: &mut super::vcpu::Vcpu, control: &RunControl) {
        self.hold(index, vcpu, |s| {
            (!self.is_standby(index) && !s.paused) || control.is_finished()
        });
    }

    /// Counts the calling vCPU (local index `index`) as parked and runs the jobs it is
    /// handed until `done` says it may go on.
    fn hold(&self, index: usize, vcpu: &mut super::vcpu::Vcpu, done: impl Fn(&State) -> bool) {
        let mut s = self.lock();
        s.parked += 1;
        self.changed.notify_all();
        loop {
            if let Some(job) = s.jobs.get_mut(index).and_then(Option::take) {
                drop(s);
                job(vcpu);
                s = self.lock();
                self.changed.notify_all();
                continue;
            }
            if done(&s) {
                break;
            }
            s = self.wait_changed(s, Duration::from_millis(100));
        }
        s.parked -= 1;
    }

    /// Runs `f` on the thread of the vCPU at `index`, which must be parked (the VM paused)
    /// or standing by, and returns its answer.
    pub fn on_vcpu<T: Send + 'static>(
        &self,
        index: usize,
        control: &RunControl,
        f: impl FnOnce(&mut super::vcpu::Vcpu) -> T + Send + 'static,
    ) -> Result<T, PauseError> {
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut s = self.lock();
            if !(s.paused || self.is_standby(index)) {
                return Err(PauseError::Running);
            }
            let Some(slot) = s.jobs.get_mut(index) else {
                return Err(PauseError::Ended);
            };
            *slot = Some(Box::new(move |v| {
                let _ = tx.send(f(v));
            }));
            self.changed.notify_all();
        }
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(t) => return Ok(t),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !control.is_finished() => {}
                Err(_) => return Err(PauseError::Ended),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits, the state unlocked, until another thread changes it or `at_most` has passed:
    /// the callers look again at what the condition variable does not announce (the VM's
    /// end, a vCPU still to kick).
    fn wait_changed<'a>(
        &self,
        s: std::sync::MutexGuard<'a, State>,
        at_most: Duration,
    ) -> std::sync::MutexGuard<'a, State> {
        self.changed
            .wait_timeout(s, at_most)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Whether a pause is asked for: checked by a vCPU after every exit.
    pub fn asked(&self) -> bool {
        self.asked.load(Ordering::Acquire)
    }

    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// Asks every member to park, calls `kick` so the running ones notice, and waits until
    /// all have parked. On a timeout the pause is taken back, so a VM is either wholly
    /// paused or running.
    pub fn pause(
        &self,
        control: &RunControl,
        wait: Duration,
        kick: impl Fn(),
    ) -> Result<(), PauseError> {
        let mut s = self.lock();
        s.paused = true;
        self.asked.store(true, Ordering::Release);
        drop(s);
        kick();
        let deadline = Instant::now() + wait;
        let mut s = self.lock();
        let mut kicked_at = Instant::now();
        while s.parked < self.members {
            if control.is_finished() {
                s.paused = false;
                self.asked.store(false, Ordering::Release);
                self.changed.notify_all();
                return Err(PauseError::Ended);
            }
            let now = Instant::now();
            if now >= deadline {
                let parked = s.parked;
                s.paused = false;
                self.asked.store(false, Ordering::Release);
                self.changed.notify_all();
                return Err(PauseError::Timeout {
                    parked,
                    members: self.members,
                    wait,
                });
            }
            // A thread that was between its check and KVM_RUN when kicked still stops (the
            // kick sets immediate_exit); kicking again is only a guard against the rare
            // thread that was not yet running at all.
            if now - kicked_at > Duration::from_millis(50) {
                drop(s);
                kick();
                kicked_at = Instant::now();
                s = self.lock();
                continue;
            }
            s = self.wait_changed(s, Duration::from_millis(10));
        }
        Ok(())
    }

    /// Lets every parked thread go on.
    pub fn resume(&self) {
        let mut s = self.lock();
        s.paused = false;
        self.asked.store(false, Ordering::Release);
        self.changed.notify_all();
    }

    /// Parks the calling vCPU (local index `index`) until the VM resumes or ends, running
    /// the jobs it is handed meanwhile.
    pub fn park_vcpu(&self, index: usize, vcpu: &mut super::vcpu::Vcpu, control: &RunControl) {
        self.hold(index, vcpu, |s| !s.paused || control.is_finished());
    }

    /// Parks the I/O thread until the VM resumes or ends.
    pub fn park_io(&self, control: &RunControl) {
        let mut s = self.lock();
        s.parked += 1;
        self.changed.notify_all();
        while s.paused && !control.is_finished() {
            s = self.wait_changed(s, Duration::from_millis(100));
        }
        s.parked -= 1;
    }

    /// Runs `f` on every parked vCPU's own thread, with its local index, and returns the
    /// answers in that order.
    /// Only while paused.
    pub fn on_each_vcpu<T: Send + 'static>(
        &self,
        control: &RunControl,
        f: impl Fn(usize, &mut super::vcpu::Vcpu) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>, PauseError> {
        let f = Arc::new(f);
        let (tx, rx) = std::sync::mpsc::channel();
        let n = {
            let mut s = self.lock();
            if !s.paused {
                return Err(PauseError::Ended);
            }
            for (i, slot) in s.jobs.iter_mut().enumerate() {
                let (f, tx) = (f.clone(), tx.clone());
                *slot = Some(Box::new(move |v| {
                    let _ = tx.send((i, f(i, v)));
                }));
            }
            self.changed.notify_all();
            s.jobs.len()
        };
        drop(tx);
        let mut answers: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            // A vCPU thread that ended drops its job, and with it its sender.
            loop {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok((i, t)) => {
                        answers[i] = Some(t);
                        break;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        if control.is_finished() {
                            return Err(PauseError::Ended);
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(PauseError::Ended)
                    }
                }
            }
        }
        answers
            .into_iter()
            .collect::<Option<Vec<T>>>()
            .ok_or(PauseError::Ended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_with_nobody_parking_times_out_and_is_taken_back() {
        let gate = PauseGate::new(0, 1);
        let control = RunControl::default();
        let e = gate
            .pause(&control, Duration::from_millis(30), || {})
            .unwrap_err();
        assert!(
            matches!(
                e,
                PauseError::Timeout {
                    parked: 0,
                    members: 1,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(!gate.is_paused() && !gate.asked());
    }

    #[test]
    fn an_io_thread_parks_until_resumed() {
        let gate = Arc::new(PauseGate::new(0, 1));
        let control = Arc::new(RunControl::default());
        let (g, c) = (gate.clone(), control.clone());
        let io = std::thread::spawn(move || {
            while !g.asked() {
                std::thread::sleep(Duration::from_millis(1));
            }
            g.park_io(&c);
        });
        gate.pause(&control, Duration::from_secs(30), || {})
            .unwrap();
        assert!(gate.is_paused());
        gate.resume();
        io.join().unwrap();
        assert!(!gate.is_paused());
    }
}
