//! Serves virtio queue notifications that KVM signals through ioeventfds, on a thread of
//! its own, so a notifying vCPU never returns to user space.

use devices::virtio::MmioTransport;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// One queue's doorbell: KVM writes `eventfd` when the guest notifies queue `queue`.
pub struct Notifier {
    pub eventfd: EventFd,
    pub transport: Arc<Mutex<MmioTransport>>,
    pub queue: u16,
}

/// Started per VM in the kernel exit mode; stopped through `stop`.
pub struct IoThread {
    stop: EventFd,
    handle: Option<std::thread::JoinHandle<()>>,
    served: Arc<AtomicU64>,
}

impl IoThread {
    pub fn start(notifiers: Vec<Notifier>) -> std::io::Result<Self> {
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        let stop_token = notifiers.len() as u64;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, stop_token),
        )?;
        for (i, n) in notifiers.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                n.eventfd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, i as u64),
            )?;
        }
        let served = Arc::new(AtomicU64::new(0));
        let count = served.clone();
        let handle = std::thread::Builder::new()
            .name("virtio-io".into())
            .spawn(move || serve(epoll, notifiers, stop_token, count))?;
        Ok(Self {
            stop,
            handle: Some(handle),
            served,
        })
    }

    /// Notifications served so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    pub fn stop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(epoll: Epoll, notifiers: Vec<Notifier>, stop_token: u64, served: Arc<AtomicU64>) {
    let mut events = vec![EpollEvent::default(); notifiers.len() + 1];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("virtio I/O thread: epoll_wait failed: {e}; notifications stop");
                return;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == stop_token {
                return;
            }
            let Some(notifier) = notifiers.get(token as usize) else {
                continue;
            };
            // Several notifications may have been coalesced into one eventfd count; one
            // pass over the queue serves them all.
            if notifier.eventfd.read().is_ok() {
                served.fetch_add(1, Ordering::Relaxed);
                notifier
                    .transport
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .process_queue(notifier.queue);
            }
        }
    }
}
