//! Serves virtio queue notifications that KVM signals through ioeventfds, and the devices'
//! own event sources (a TAP with frames to read), on a thread of its own, so a notifying
//! vCPU never returns to user space.

use crate::control::{panic_message, Outcome, RunControl};
use crate::seccomp::{SeccompMode, ThreadKind};
use crate::vstate::pause::PauseGate;
use devices::virtio::MmioTransport;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Why the I/O thread stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum IoThreadError {
    #[error("epoll_wait: {0}")]
    Wait(#[source] std::io::Error),
    #[error("reading a doorbell eventfd: {0}")]
    Doorbell(#[source] std::io::Error),
    #[error("a device panicked: {0}")]
    Panicked(String),
}

/// Something that serves a queue when its doorbell rings.
pub trait QueueServer: Send + Sync {
    fn serve(&self, queue: u16);

    /// The device's own event source `index` (see [`DeviceEvent`]) became ready.
    fn serve_event(&self, _index: usize) {}
}

impl QueueServer for Mutex<MmioTransport> {
    fn serve(&self, queue: u16) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .process_queue(queue);
    }

    fn serve_event(&self, index: usize) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .process_event(index);
    }
}

/// A device's own event source: a TAP with frames to read, a rate limiter's timer. Watched
/// edge-triggered, so a device that stops reading (no receive buffers) is not woken again
/// and again for what it cannot take; it reads on when a doorbell brings buffers.
pub struct DeviceEvent {
    /// Owned by the device, which `server` keeps alive as long as this entry.
    pub fd: RawFd,
    pub server: Arc<dyn QueueServer>,
    pub index: usize,
}

/// One queue's doorbell: KVM writes `eventfd` when the guest notifies queue `queue`.
pub struct Notifier {
    pub eventfd: EventFd,
    pub server: Arc<dyn QueueServer>,
    pub queue: u16,
}

/// Started per VM in the kernel exit mode; stopped through `stop`.
pub struct IoThread {
    stop: EventFd,
    /// Written to make the thread park at the VM's pause gate.
    park: Arc<EventFd>,
    handle: Option<std::thread::JoinHandle<()>>,
    served: Arc<AtomicU64>,
}

impl IoThread {
    /// Starts serving `notifiers`. If the thread fails (an epoll error, a device that
    /// panics), it ends the VM through `control` with a VMM error: doorbells nobody serves
    /// would otherwise leave the guest waiting forever.
    pub fn start(
        notifiers: Vec<Notifier>,
        device_events: Vec<DeviceEvent>,
        control: Arc<RunControl>,
        seccomp: SeccompMode,
        gate: Arc<PauseGate>,
    ) -> std::io::Result<Self> {
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let park = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let epoll = Epoll::new()?;
        let stop_token = notifiers.len() as u64;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, stop_token),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            park.as_raw_fd(),
            EpollEvent::new(EventSet::IN, stop_token + 1),
        )?;
        for (i, n) in notifiers.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                n.eventfd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, i as u64),
            )?;
        }
        for (i, d) in device_events.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                d.fd,
                EpollEvent::new(
                    EventSet::IN | EventSet::EDGE_TRIGGERED,
                    stop_token + 2 + i as u64,
                ),
            )?;
        }
        let served = Arc::new(AtomicU64::new(0));
        let count = served.clone();
        let parking = Parking {
            eventfd: park.clone(),
            gate,
            control: control.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("virtio-io".into())
            .spawn(move || {
                crate::seccomp::block_process_signals(&[]);
                if let Err(e) = crate::seccomp::apply(ThreadKind::Io, seccomp) {
                    control.finish(Outcome::VmmError(e.to_string()));
                    return;
                }
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve(&epoll, &notifiers, &device_events, stop_token, &count, &parking)
                }));
                let failure = match result {
                    Ok(Ok(())) => return,
                    Ok(Err(e)) => e,
                    Err(panic) => IoThreadError::Panicked(panic_message(&*panic)),
                };
                control.finish(Outcome::VmmError(format!(
                    "the virtio I/O thread failed, so queue notifications would go unserved: {failure}"
                )));
            })?;
        Ok(Self {
            stop,
            park,
            handle: Some(handle),
            served,
        })
    }

    /// What to write to have the thread park at the pause gate.
    pub fn park_bell(&self) -> Arc<EventFd> {
        self.park.clone()
    }

    /// A counter of notifications served that outlives the thread.
    pub fn served_counter(&self) -> Arc<AtomicU64> {
        self.served.clone()
    }

    pub fn stop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }

    /// As [`IoThread::stop`], waiting at most `limit`: false if the thread is still busy
    /// then (a device waiting on guest memory that will never come), and it is left to end
    /// with the process.
    pub fn stop_within(&mut self, limit: std::time::Duration) -> bool {
        let _ = self.stop.write(1);
        let Some(h) = self.handle.take() else {
            return true;
        };
        let deadline = std::time::Instant::now() + limit;
        while !h.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if !h.is_finished() {
            return false;
        }
        let _ = h.join();
        true
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How the I/O thread learns of a pause and where it waits it out.
struct Parking {
    eventfd: Arc<EventFd>,
    gate: Arc<PauseGate>,
    control: Arc<RunControl>,
}

/// Serves doorbells until the stop token fires; an error ends the thread.
fn serve(
    epoll: &Epoll,
    notifiers: &[Notifier],
    device_events: &[DeviceEvent],
    stop_token: u64,
    served: &AtomicU64,
    parking: &Parking,
) -> Result<(), IoThreadError> {
    let mut events = vec![EpollEvent::default(); notifiers.len() + device_events.len() + 2];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(IoThreadError::Wait(e)),
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == stop_token {
                return Ok(());
            }
            if token == stop_token + 1 {
                // Parked between two requests: every queue pass has finished.
                let _ = parking.eventfd.read();
                if parking.gate.asked() {
                    parking.gate.park_io(&parking.control);
                }
                continue;
            }
            if token > stop_token + 1 {
                if let Some(d) = device_events.get((token - stop_token - 2) as usize) {
                    d.server.serve_event(d.index);
                }
                continue;
            }
            let Some(notifier) = notifiers.get(token as usize) else {
                continue;
            };
            // Several notifications may have been coalesced into one eventfd count; one
            // pass over the queue serves them all.
            match notifier.eventfd.read() {
                Ok(_) => {
                    served.fetch_add(1, Ordering::Relaxed);
                    notifier.server.serve(notifier.queue);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(IoThreadError::Doorbell(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct Counting(AtomicU64);
    impl QueueServer for Counting {
        fn serve(&self, queue: u16) {
            assert_eq!(queue, 1);
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Broken;
    impl QueueServer for Broken {
        fn serve(&self, _: u16) {
            panic!("descriptor table corrupted beyond repair");
        }
    }

    fn doorbell(server: Arc<dyn QueueServer>) -> (Notifier, EventFd) {
        let eventfd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let ring = eventfd.try_clone().unwrap();
        (
            Notifier {
                eventfd,
                server,
                queue: 1,
            },
            ring,
        )
    }

    /// An I/O thread serving one doorbell with `server`, and the doorbell's ringing end.
    fn serving(server: Arc<dyn QueueServer>, control: &Arc<RunControl>) -> (IoThread, EventFd) {
        let (n, ring) = doorbell(server);
        let t = IoThread::start(
            vec![n],
            Vec::new(),
            control.clone(),
            SeccompMode::Off,
            Arc::new(PauseGate::new(0, true)),
        )
        .unwrap();
        (t, ring)
    }

    #[test]
    fn doorbells_are_served_until_stopped() {
        let control = Arc::new(RunControl::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let (mut t, ring) = serving(counting.clone(), &control);
        ring.write(1).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while counting.0.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(counting.0.load(Ordering::SeqCst), 1);
        assert_eq!(t.served_counter().load(Ordering::SeqCst), 1);
        t.stop();
        assert!(!control.is_finished(), "a clean stop is no failure");
    }

    #[test]
    fn a_failed_io_thread_ends_the_vm_with_a_vmm_error() {
        let control = Arc::new(RunControl::default());
        let (_t, ring) = serving(Arc::new(Broken), &control);
        ring.write(1).unwrap();
        let outcome = control.wait(Duration::from_millis(5), || None);
        let Outcome::VmmError(m) = &outcome else {
            panic!("{outcome:?}")
        };
        assert!(m.contains("virtio I/O thread failed"), "{m}");
        assert!(m.contains("descriptor table corrupted"), "{m}");
        assert_eq!(outcome.exit_code(), 126);
    }
}
