//! Serves virtio queue notifications that KVM signals through ioeventfds, and the devices'
//! own event sources (a TAP with frames to read), on threads of their own, so a notifying
//! vCPU never returns to user space. Each thread serves a [`Lane`]: one thread serves
//! everything, or a net device's queue pairs are spread over several (`run --io-threads`).
//!
//! Between events the thread sleeps in `epoll_wait`, and each event then costs a wake-up
//! by the host's scheduler. With a poll window (`run --io-poll`, vhost-net's `busy_poll`
//! idea) it first polls after each event it served: a request/response peer's next packet
//! or the guest's next doorbell is then taken without a wake-up, at the price of a CPU
//! while it polls. The window adapts within the flag's bound ([`Window`]), and both sides
//! are counted ([`IoThreadStats`]). While the window is open the queues a guest fills in
//! streams (transmit queues) have their doorbells off and the thread looks at their rings
//! itself, as vhost-net's busy polling does: a guest that sends again within the window
//! sends without a VM exit.

use crate::control::{panic_message, Outcome, RunControl};
use crate::host_load::{self, HostLoad};
use crate::seccomp::{SeccompMode, ThreadKind};
use crate::vstate::pause::PauseGate;
use devices::virtio::MmioTransport;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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

    /// Serves `queue` if its driver made chains available without ringing; true if the
    /// pass took any (see [`MmioTransport::poll_queue`]).
    fn poll(&self, _queue: u16) -> bool {
        false
    }

    /// Turns `queue`'s doorbells off for polling, or back on (see
    /// [`MmioTransport::set_polled`]).
    fn set_polled(&self, _queue: u16, _on: bool) {}
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

    /// A device another thread is serving (another lane's pair, a vCPU's register access)
    /// is not waited for: this look finds nothing and the poller looks again, where
    /// waiting would put it to sleep on the lock in the middle of its window.
    fn poll(&self, queue: u16) -> bool {
        let mut device = match self.try_lock() {
            Ok(d) => d,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        device.poll_queue(queue)
    }

    fn set_polled(&self, queue: u16, on: bool) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_polled(queue, on);
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
    /// The thread that watches it, modulo the threads there are (see [`Lane`]).
    pub lane: usize,
}

/// One queue's doorbell: KVM writes `eventfd` when the guest notifies queue `queue`.
pub struct Notifier {
    pub eventfd: EventFd,
    pub server: Arc<dyn QueueServer>,
    pub queue: u16,
    /// Whether the thread looks at the queue itself in its poll window, with the doorbell
    /// off (see [`QueueServer::poll`]).
    pub polled: bool,
    /// The thread that serves it, modulo the threads there are (see [`Lane`]).
    pub lane: usize,
}

/// The doorbells and device events one I/O thread serves. A net device's queue pair k,
/// its doorbells and its backend, asks for lane k, everything else for lane 0 (see
/// `VirtioDevice::queue_lane`): with a thread per lane, each pair's thread waits, wakes
/// and polls on its own, which one thread cannot do for two pairs at once. Serving still
/// takes the device's lock, which the pairs share, so their passes over the rings take
/// turns; a pass is short beside the guest's work on a frame.
#[derive(Default)]
pub struct Lane {
    pub notifiers: Vec<Notifier>,
    pub events: Vec<DeviceEvent>,
}

impl Lane {
    /// Deals `notifiers` and `events` out over `threads` lanes by the lane each asks for,
    /// modulo `threads`; lanes left with nothing are dropped.
    pub fn deal(notifiers: Vec<Notifier>, events: Vec<DeviceEvent>, threads: usize) -> Vec<Lane> {
        let n = threads.max(1);
        let mut lanes: Vec<Lane> = (0..n).map(|_| Lane::default()).collect();
        for x in notifiers {
            lanes[x.lane % n].notifiers.push(x);
        }
        for e in events {
            lanes[e.lane % n].events.push(e);
        }
        lanes.retain(|l| !l.notifiers.is_empty() || !l.events.is_empty());
        lanes
    }

    /// Lanes asked for: one more than the highest.
    pub fn wanted(notifiers: &[Notifier], events: &[DeviceEvent]) -> usize {
        let doorbells = notifiers.iter().map(|n| n.lane);
        doorbells
            .chain(events.iter().map(|e| e.lane))
            .max()
            .map_or(0, |l| l + 1)
    }
}

/// How many I/O threads a VM gets (`run --io-threads`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoThreadCount {
    /// One per lane asked for, as far as the host has CPUs this process may run on beyond
    /// the VM's vCPUs, and at least one: a thread that polls needs a CPU of its own, and
    /// on a host with no CPU to spare more threads only take turns with the vCPUs.
    #[default]
    Auto,
    /// This many at most (never more than the lanes asked for).
    Fixed(std::num::NonZeroUsize),
}

impl IoThreadCount {
    /// Threads for `lanes` lanes asked for, on a VM of `vcpus` vCPUs. One lane or none
    /// needs one thread whatever the host has, and is answered without asking the host
    /// (its affinity and cgroup files), which every VM start would otherwise do.
    pub fn threads(self, lanes: usize, vcpus: usize) -> usize {
        if lanes <= 1 {
            return 1;
        }
        let most = match self {
            IoThreadCount::Fixed(n) => n.get(),
            IoThreadCount::Auto => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .saturating_sub(vcpus),
        };
        most.min(lanes).max(1)
    }
}

/// One thread of [`IoThreads`].
struct Member {
    /// Written to make the thread park at the VM's pause gate.
    park: Arc<EventFd>,
    handle: Option<std::thread::JoinHandle<()>>,
    stats: Arc<IoThreadStats>,
}

/// Started per VM when it has doorbells or device events to serve, a thread per [`Lane`];
/// stopped through `stop`.
pub struct IoThreads {
    /// One eventfd in every thread's epoll set: a thread that sees it leaves it set, so
    /// each of them sees it.
    stop: EventFd,
    members: Vec<Member>,
    served: Arc<AtomicU64>,
}

/// How the threads poll after each event.
#[derive(Clone, Debug)]
pub struct Polling {
    /// The window's bound (`--io-poll`; zero: never poll).
    pub window: Duration,
    /// The load file whose runnable count, above the CPUs online, ends a window early;
    /// `None` (`--io-poll-hold`), or a file that does not read as one, polls each window
    /// to its end.
    pub load: Option<PathBuf>,
}

impl Polling {
    /// Windows of up to `window`, ended early while another task waits for a CPU unless
    /// `hold`.
    pub fn new(window: Duration, hold: bool) -> Polling {
        Polling {
            window,
            load: (!hold).then(|| host_load::HOST.into()),
        }
    }
}

/// The poll window's bound when none is asked for: QEMU's IOThreads poll up to 32,768 ns
/// by default, adapting within it as [`Window`] does; a VM that is quiet costs nothing.
pub const DEFAULT_POLL: Duration = Duration::from_micros(32);

/// How the thread waited, counted whether it polls or not, so that the wake-ups a poll
/// window saves are read beside the CPU it spends.
#[derive(Debug, Default)]
pub struct IoThreadStats {
    poll: Duration,
    wakeups: AtomicU64,
    poll_hits: AtomicU64,
    poll_misses: AtomicU64,
    ring_hits: AtomicU64,
    poll_yields: AtomicU64,
    poll_ns: AtomicU64,
    cpu_ns: AtomicU64,
}

impl IoThreadStats {
    /// The threads' counters added up (the bound, `poll_us`, is the same for each).
    pub fn total(stats: &[Arc<IoThreadStats>]) -> Option<musubi_types::IoThreadCounters> {
        stats
            .iter()
            .map(|s| s.counters())
            .reduce(|a, b| musubi_types::IoThreadCounters {
                poll_us: a.poll_us.max(b.poll_us),
                wakeups: a.wakeups + b.wakeups,
                poll_hits: a.poll_hits + b.poll_hits,
                poll_misses: a.poll_misses + b.poll_misses,
                ring_hits: a.ring_hits + b.ring_hits,
                poll_yields: a.poll_yields + b.poll_yields,
                poll_ns: a.poll_ns + b.poll_ns,
                cpu_ns: a.cpu_ns + b.cpu_ns,
            })
    }

    pub fn counters(&self) -> musubi_types::IoThreadCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        musubi_types::IoThreadCounters {
            poll_us: self.poll.as_micros() as u64,
            wakeups: get(&self.wakeups),
            poll_hits: get(&self.poll_hits),
            poll_misses: get(&self.poll_misses),
            ring_hits: get(&self.ring_hits),
            poll_yields: get(&self.poll_yields),
            poll_ns: get(&self.poll_ns),
            cpu_ns: get(&self.cpu_ns),
        }
    }

    /// Notes the calling thread's CPU time; called before each sleep, so the figure is at
    /// most one busy stretch old.
    fn note_cpu(&self) {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid, writable timespec the call fills; the clock id is a
        // constant every Linux has.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0 {
            let ns = t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
            self.cpu_ns.store(ns, Ordering::Relaxed);
        }
    }
}

impl IoThreads {
    /// Starts a thread per lane. If one fails (an epoll error, a device that panics), it
    /// ends the VM through `control` with a VMM error: doorbells nobody serves would
    /// otherwise leave the guest waiting forever.
    pub fn start(
        lanes: Vec<Lane>,
        control: Arc<RunControl>,
        seccomp: SeccompMode,
        gate: Arc<PauseGate>,
        polling: Polling,
    ) -> std::io::Result<Self> {
        let mut threads = IoThreads {
            stop: EventFd::new(libc::EFD_NONBLOCK)?,
            members: Vec::with_capacity(lanes.len()),
            served: Arc::new(AtomicU64::new(0)),
        };
        for (k, lane) in lanes.into_iter().enumerate() {
            let member = threads.spawn(k, lane, &control, seccomp, &gate, &polling)?;
            threads.members.push(member);
        }
        Ok(threads)
    }

    fn spawn(
        &self,
        k: usize,
        lane: Lane,
        control: &Arc<RunControl>,
        seccomp: SeccompMode,
        gate: &Arc<PauseGate>,
        polling: &Polling,
    ) -> std::io::Result<Member> {
        let poll = polling.window;
        // Opened here: the thread's system-call filter lets it read a file, not open one.
        let load = polling
            .load
            .as_deref()
            .filter(|_| !poll.is_zero())
            .and_then(HostLoad::open);
        let Lane {
            notifiers,
            events: device_events,
        } = &lane;
        let park = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let epoll = Epoll::new()?;
        let stop_token = notifiers.len() as u64;
        epoll.ctl(
            ControlOperation::Add,
            self.stop.as_raw_fd(),
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
        let count = self.served.clone();
        let stats = Arc::new(IoThreadStats {
            poll,
            ..Default::default()
        });
        let waits = stats.clone();
        let parking = Parking {
            eventfd: park.clone(),
            gate: gate.clone(),
            control: control.clone(),
        };
        let control = control.clone();
        // Thread names are 15 bytes at most; the first keeps the name it always had.
        let name = match k {
            0 => "virtio-io".to_string(),
            k => format!("virtio-io-{k}"),
        };
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            crate::seccomp::block_process_signals(&[]);
            if let Err(e) = crate::seccomp::apply(ThreadKind::Io, seccomp) {
                control.finish(Outcome::VmmError(e.to_string()));
                return;
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let result = serve(
                    &epoll,
                    &lane,
                    stop_token,
                    &count,
                    &parking,
                    Window::new(poll, load),
                    &waits,
                );
                waits.note_cpu();
                result
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
        Ok(Member {
            park,
            handle: Some(handle),
            stats,
        })
    }

    /// How each thread waited; outlives the threads.
    pub fn stats(&self) -> Vec<Arc<IoThreadStats>> {
        self.members.iter().map(|m| m.stats.clone()).collect()
    }

    /// What to write to have each thread park at the pause gate.
    pub fn park_bells(&self) -> Vec<Arc<EventFd>> {
        self.members.iter().map(|m| m.park.clone()).collect()
    }

    /// A counter of notifications served, by every thread, that outlives them.
    pub fn served_counter(&self) -> Arc<AtomicU64> {
        self.served.clone()
    }

    pub fn stop(&mut self) {
        let _ = self.stop.write(1);
        for m in &mut self.members {
            if let Some(h) = m.handle.take() {
                let _ = h.join();
            }
        }
    }

    /// As [`IoThreads::stop`], waiting at most `limit` in all: false if a thread is still
    /// busy then (a device waiting on guest memory that will never come), and it is left
    /// to end with the process.
    pub fn stop_within(&mut self, limit: std::time::Duration) -> bool {
        let _ = self.stop.write(1);
        let deadline = std::time::Instant::now() + limit;
        let mut all = true;
        for m in &mut self.members {
            let Some(h) = m.handle.take() else {
                continue;
            };
            while !h.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                all = false;
            }
        }
        all
    }
}

impl Drop for IoThreads {
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
    lane: &Lane,
    stop_token: u64,
    served: &AtomicU64,
    parking: &Parking,
    mut window: Window,
    stats: &IoThreadStats,
) -> Result<(), IoThreadError> {
    let Lane {
        notifiers,
        events: device_events,
    } = lane;
    let mut events = vec![EpollEvent::default(); notifiers.len() + device_events.len() + 2];
    // Set after each event while the window is open: until then look without sleeping.
    let mut poll_until: Option<Instant> = None;
    // When the thread last ran out of work: its idle time is the window it polled and the
    // sleep after it, together.
    let mut idle_since = Instant::now();
    let mut rings = Rings {
        polled: notifiers.iter().filter(|n| n.polled).collect(),
        doorbells_off: false,
    };
    loop {
        let n = match poll_until.take() {
            Some(until) => {
                rings.doorbells(false);
                match poll(
                    epoll,
                    &mut events,
                    until,
                    &rings.polled,
                    &mut window.load,
                    stats,
                )? {
                    Found::Events(n) => n,
                    // Served where they were found; the window opens again below.
                    Found::Chains => 0,
                    // To sleep, below, which turns the doorbells back on.
                    Found::Nothing => continue,
                }
            }
            None => {
                // A sleeping thread polls nothing: every doorbell must ring.
                rings.doorbells(true);
                stats.note_cpu();
                match epoll.wait(-1, &mut events) {
                    Ok(n) => {
                        stats.wakeups.fetch_add(1, Ordering::Relaxed);
                        window.after_idle(idle_since.elapsed());
                        n
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(IoThreadError::Wait(e)),
                }
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == stop_token {
                rings.doorbells(true);
                return Ok(());
            }
            if token == stop_token + 1 {
                // Parked between two requests: every queue pass has finished. The doorbells
                // go back on first: a snapshot or a move of the VM must not find a ring the
                // driver was told not to ring for a poller that is not there.
                rings.doorbells(true);
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
        idle_since = Instant::now();
        if !window.now.is_zero() {
            poll_until = Some(idle_since + window.now);
        }
    }
}

/// The queues the thread polls in its window, and whether their doorbells are off now.
struct Rings<'a> {
    polled: Vec<&'a Notifier>,
    doorbells_off: bool,
}

impl Rings<'_> {
    /// Turns the polled queues' doorbells on or off, if they are not so already.
    fn doorbells(&mut self, on: bool) {
        let off = !on;
        if self.doorbells_off == off {
            return;
        }
        for n in &self.polled {
            n.server.set_polled(n.queue, off);
        }
        self.doorbells_off = off;
    }
}

/// What a poll window found.
enum Found {
    /// This many epoll events, to be served.
    Events(usize),
    /// Chains on a polled queue, served already.
    Chains,
    /// Nothing before the window ran out.
    Nothing,
}

/// The poll window, adapted within `--io-poll` as KVM adapts its halt polling for a halted
/// vCPU: an idle spell (the window polled in vain and the sleep after it) shorter than the
/// longest window would have been saved by polling longer, so the window grows; a longer
/// one would not, so it shrinks, and a quiet VM, or a stream whose frames come further
/// apart than the bound, soon costs no polling at all.
struct Window {
    max: Duration,
    now: Duration,
    /// The host's runnable tasks, which end a window early (`poll`).
    load: Option<HostLoad>,
}

impl Window {
    /// Where a closed window reopens.
    const START: Duration = Duration::from_micros(10);

    fn new(max: Duration, load: Option<HostLoad>) -> Window {
        Window {
            max,
            now: max,
            load,
        }
    }

    fn after_idle(&mut self, idle: Duration) {
        if idle < self.max {
            self.now = (self.now * 2).max(Self::START).min(self.max);
        } else {
            self.now /= 2;
            if self.now < Duration::from_micros(1) {
                self.now = Duration::ZERO;
            }
        }
    }
}

/// Looks for events, and for chains on the `polled` queues, without sleeping until `until`.
///
/// With `load`, the window also ends, and the thread sleeps, as soon as more tasks are
/// runnable than the host has CPUs: vhost-net ends its busy poll when another task needs
/// the CPU (`need_resched`), which a user thread cannot see; the host's runnable count is
/// the nearest it can read. Without it a window keeps the CPU from the very task the last
/// write woke (the reader of a TCP stream, whose reads send the acknowledgements the guest
/// waits for), and a stream on a host with no CPU to spare went slower polling than not.
/// Yielding the CPU between looks instead hands it to a vCPU that spins in its guest for a
/// whole time slice, and with no CPU to spare the thread then waits that long for its turn.
fn poll(
    epoll: &Epoll,
    events: &mut [EpollEvent],
    until: Instant,
    polled: &[&Notifier],
    load: &mut Option<HostLoad>,
    stats: &IoThreadStats,
) -> Result<Found, IoThreadError> {
    let started = Instant::now();
    // A look that found chains served them too: that time was work, not polling.
    let mut serving = Duration::ZERO;
    let found = loop {
        match epoll.wait(0, events) {
            Ok(0) => {}
            Ok(n) => break Found::Events(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(IoThreadError::Wait(e)),
        }
        // Every polled queue gets its look, so one busy queue does not starve the others.
        // One clock read a turn: it dates the look and bounds the window.
        let look = Instant::now();
        let took = polled
            .iter()
            .fold(false, |took, n| n.server.poll(n.queue) | took);
        if took {
            serving = look.elapsed();
            stats.ring_hits.fetch_add(1, Ordering::Relaxed);
            break Found::Chains;
        }
        if look >= until {
            break Found::Nothing;
        }
        if load.as_mut().is_some_and(HostLoad::oversubscribed) {
            stats.poll_yields.fetch_add(1, Ordering::Relaxed);
            break Found::Nothing;
        }
        std::hint::spin_loop();
    };
    let spent = started.elapsed().saturating_sub(serving).as_nanos() as u64;
    stats.poll_ns.fetch_add(spent, Ordering::Relaxed);
    let counter = match found {
        Found::Nothing => &stats.poll_misses,
        _ => &stats.poll_hits,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A queue with `chains` offered that a poll takes one at a time; it records each time
    /// its doorbells were turned on or off.
    #[derive(Default)]
    struct Offered {
        chains: AtomicU64,
        taken: AtomicU64,
        doorbells: Mutex<Vec<bool>>,
    }
    impl QueueServer for Offered {
        fn serve(&self, _: u16) {}
        fn poll(&self, _: u16) -> bool {
            let took = self
                .chains
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
                .is_ok();
            if took {
                self.taken.fetch_add(1, Ordering::SeqCst);
            }
            took
        }
        fn set_polled(&self, _: u16, on: bool) {
            self.doorbells.lock().unwrap().push(!on);
        }
    }

    fn doorbell(server: Arc<dyn QueueServer>, polled: bool) -> (Notifier, EventFd) {
        let eventfd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let ring = eventfd.try_clone().unwrap();
        (
            Notifier {
                eventfd,
                server,
                queue: 1,
                polled,
                lane: 0,
            },
            ring,
        )
    }

    /// The threads' counters added up.
    fn counters(t: &IoThreads) -> musubi_types::IoThreadCounters {
        IoThreadStats::total(&t.stats()).unwrap()
    }

    /// An I/O thread serving one doorbell with `server`, polling `poll` after each event,
    /// and the doorbell's ringing end.
    fn serving(
        server: Arc<dyn QueueServer>,
        control: &Arc<RunControl>,
        poll: Duration,
    ) -> (IoThreads, EventFd) {
        serving_polled(server, false, control, poll)
    }

    /// As `serving`, with the queue polled in the window if `polled`.
    fn serving_polled(
        server: Arc<dyn QueueServer>,
        polled: bool,
        control: &Arc<RunControl>,
        poll: Duration,
    ) -> (IoThreads, EventFd) {
        serving_with(server, polled, control, Polling::new(poll, true))
    }

    /// As `serving_polled`, polling as `polling` says.
    fn serving_with(
        server: Arc<dyn QueueServer>,
        polled: bool,
        control: &Arc<RunControl>,
        polling: Polling,
    ) -> (IoThreads, EventFd) {
        let (n, ring) = doorbell(server, polled);
        let t = IoThreads::start(
            Lane::deal(vec![n], Vec::new(), 1),
            control.clone(),
            SeccompMode::Off,
            Arc::new(PauseGate::new(0, 1)),
            polling,
        )
        .unwrap();
        (t, ring)
    }

    /// An I/O thread polling, in windows of `poll`, a queue with `chains` offered on it,
    /// woken once by its doorbell.
    fn rung_with_chains(chains: u64, poll: Duration) -> (IoThreads, Arc<Offered>) {
        let control = Arc::new(RunControl::default());
        let offered = Arc::new(Offered::default());
        offered.chains.store(chains, Ordering::SeqCst);
        let (t, ring) = serving_polled(offered.clone(), true, &control, poll);
        ring.write(1).unwrap();
        (t, offered)
    }

    /// Waits (10 s at most) until `cond`.
    fn until(mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn events_within_the_poll_window_are_taken_without_a_wake_up() {
        let control = Arc::new(RunControl::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        // Longer than the test: every event after the first finds the thread polling.
        let (mut t, ring) = serving(counting.clone(), &control, Duration::from_secs(600));
        for k in 1..=3 {
            ring.write(1).unwrap();
            until(|| counting.0.load(Ordering::SeqCst) == k);
        }
        t.stop();
        let c = counters(&t);
        assert_eq!(counting.0.load(Ordering::SeqCst), 3);
        // The first doorbell woke it; the two others and the stop were found polling.
        assert_eq!((c.wakeups, c.poll_hits, c.poll_misses), (1, 3, 0), "{c:?}");
        assert_eq!(c.poll_us, 600_000_000);
        assert!(c.poll_ns > 0 && c.cpu_ns > 0, "{c:?}");
    }

    #[test]
    fn chains_on_a_polled_queue_are_taken_with_its_doorbell_off_until_the_thread_sleeps() {
        let (mut t, offered) = rung_with_chains(3, Duration::from_micros(200));
        until(|| counters(&t).poll_misses == 1);
        assert_eq!(offered.taken.load(Ordering::SeqCst), 3);
        assert_eq!(
            *offered.doorbells.lock().unwrap(),
            [false, true],
            "off for the window, on again before the sleep"
        );
        t.stop();
        let c = counters(&t);
        assert_eq!(
            (c.ring_hits, c.poll_hits, c.poll_misses),
            (3, 3, 1),
            "{c:?}"
        );
        assert_eq!(offered.doorbells.lock().unwrap().len(), 2, "stopped asleep");
    }

    #[test]
    fn a_thread_stopped_while_it_polls_turns_the_doorbells_back_on() {
        let (mut t, offered) = rung_with_chains(1, Duration::from_secs(600));
        until(|| offered.taken.load(Ordering::SeqCst) == 1);
        t.stop();
        assert_eq!(*offered.doorbells.lock().unwrap(), [false, true]);
        assert_eq!(counters(&t).ring_hits, 1);
    }

    /// Blocks its pass until `release` is set, then counts it.
    #[derive(Default)]
    struct Held {
        release: std::sync::atomic::AtomicBool,
        served: AtomicU64,
    }
    impl QueueServer for Held {
        fn serve(&self, _: u16) {
            until(|| self.release.load(Ordering::SeqCst));
            self.served.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn on_lane(lane: usize, server: Arc<dyn QueueServer>) -> (Notifier, EventFd) {
        let (mut n, ring) = doorbell(server, false);
        n.lane = lane;
        (n, ring)
    }

    #[test]
    fn doorbells_are_dealt_to_lanes_modulo_the_threads() {
        let counting: Arc<dyn QueueServer> = Arc::new(Counting(AtomicU64::new(0)));
        let four = || {
            (0..4)
                .map(|l| on_lane(l, counting.clone()).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(Lane::wanted(&four(), &[]), 4);
        assert_eq!(Lane::wanted(&[], &[]), 0);
        let lanes = Lane::deal(four(), Vec::new(), 2);
        let asked: Vec<Vec<usize>> = lanes
            .iter()
            .map(|l| l.notifiers.iter().map(|n| n.lane).collect())
            .collect();
        assert_eq!(asked, [[0, 2], [1, 3]]);
        assert_eq!(Lane::deal(four(), Vec::new(), 1).len(), 1);
        assert!(
            Lane::deal(Vec::new(), Vec::new(), 3).is_empty(),
            "nothing to serve"
        );
        let one = vec![on_lane(0, counting.clone()).0];
        assert_eq!(
            Lane::deal(one, Vec::new(), 4).len(),
            1,
            "no thread for no lane"
        );
    }

    #[test]
    fn the_thread_count_is_bounded_by_the_lanes_and_the_spare_cpus() {
        let fixed = |n| IoThreadCount::Fixed(std::num::NonZeroUsize::new(n).unwrap());
        assert_eq!(fixed(4).threads(2, 1), 2, "never more than lanes");
        assert_eq!(fixed(1).threads(4, 1), 1);
        assert_eq!(
            fixed(3).threads(4, 1000),
            3,
            "a count given is a count taken"
        );
        assert_eq!(
            IoThreadCount::Auto.threads(4, 100_000),
            1,
            "no spare CPU: one"
        );
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(IoThreadCount::Auto.threads(64, 0), cpus.min(64));
        assert_eq!(IoThreadCount::Auto.threads(0, 0), 1);
    }

    #[test]
    fn a_lane_is_served_while_another_lanes_pass_is_held() {
        let control = Arc::new(RunControl::default());
        let held = Arc::new(Held::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let (slow, ring0) = on_lane(0, held.clone());
        let (fast, ring1) = on_lane(1, counting.clone());
        let mut t = IoThreads::start(
            Lane::deal(vec![slow, fast], Vec::new(), 2),
            control.clone(),
            SeccompMode::Off,
            Arc::new(PauseGate::new(0, 2)),
            Polling::new(Duration::ZERO, true),
        )
        .unwrap();
        assert_eq!(t.stats().len(), 2);
        ring0.write(1).unwrap();
        ring1.write(1).unwrap();
        until(|| counting.0.load(Ordering::SeqCst) == 1);
        assert_eq!(
            counting.0.load(Ordering::SeqCst),
            1,
            "lane 1 waits for nobody"
        );
        assert_eq!(held.served.load(Ordering::SeqCst), 0, "lane 0 still held");
        held.release.store(true, Ordering::SeqCst);
        until(|| held.served.load(Ordering::SeqCst) == 1);
        t.stop();
        assert_eq!(held.served.load(Ordering::SeqCst), 1);
        assert_eq!(t.served_counter().load(Ordering::SeqCst), 2, "both counted");
        let each: Vec<u64> = t.stats().iter().map(|s| s.counters().wakeups).collect();
        assert_eq!(each, [2, 2], "each woken by its doorbell and the stop");
        assert_eq!(counters(&t).wakeups, 4);
        assert!(!control.is_finished());
    }

    #[test]
    fn a_ring_poll_does_not_wait_for_a_device_another_thread_is_serving() {
        use devices::virtio::rng::Rng;
        use vm_memory::GuestAddress;
        let mem = devices::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let irq = Arc::new(devices::EventFdIrq::new().unwrap());
        let device = Box::new(Rng::new(None).unwrap());
        let transport = Arc::new(Mutex::new(MmioTransport::new(device, mem, irq)));
        let serving = transport.lock().unwrap();
        let (done, answer) = std::sync::mpsc::channel();
        let poller = transport.clone();
        let t = std::thread::spawn(move || done.send(QueueServer::poll(&*poller, 0)).unwrap());
        let took = answer.recv_timeout(Duration::from_secs(10));
        drop(serving);
        t.join().unwrap();
        assert_eq!(
            took,
            Ok(false),
            "answered while the lock was held, nothing taken"
        );
    }

    #[test]
    fn the_window_closes_over_long_sleeps_and_reopens_after_short_ones() {
        let us = Duration::from_micros;
        let mut w = Window::new(us(50), None);
        w.after_idle(Duration::from_secs(1));
        assert_eq!(w.now, us(25));
        for _ in 0..10 {
            w.after_idle(Duration::from_secs(1));
        }
        assert_eq!(w.now, Duration::ZERO, "a quiet VM is not polled for");
        w.after_idle(us(30));
        assert_eq!(w.now, Window::START);
        w.after_idle(us(30));
        w.after_idle(us(30));
        assert_eq!(w.now, us(40));
        w.after_idle(us(30));
        assert_eq!(w.now, us(50), "never past --io-poll");
        let mut off = Window::new(Duration::ZERO, None);
        off.after_idle(us(1));
        assert_eq!(off.now, Duration::ZERO, "no --io-poll, no polling");
    }

    #[test]
    fn a_poll_window_that_runs_out_is_counted_and_the_thread_sleeps() {
        let control = Arc::new(RunControl::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let (mut t, ring) = serving(counting.clone(), &control, Duration::from_micros(200));
        ring.write(1).unwrap();
        until(|| counters(&t).poll_misses == 1);
        t.stop();
        let c = counters(&t);
        assert_eq!(counting.0.load(Ordering::SeqCst), 1);
        // Woken by the doorbell, polled in vain, woken again by the stop.
        assert_eq!((c.wakeups, c.poll_hits, c.poll_misses), (2, 0, 1), "{c:?}");
        assert!(c.poll_ns > 0, "{c:?}");
    }

    #[test]
    fn a_window_ends_at_once_while_more_tasks_are_runnable_than_cpus() {
        let dir = tempfile::tempdir().unwrap();
        let load = dir.path().join("loadavg");
        // More runnable tasks than any host has CPUs.
        std::fs::write(&load, "9.00 9.00 9.00 100000/100000 7\n").unwrap();
        let control = Arc::new(RunControl::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let polling = Polling {
            window: Duration::from_secs(5),
            load: Some(load),
        };
        let (mut t, ring) = serving_with(counting.clone(), false, &control, polling);
        ring.write(1).unwrap();
        // A window that ran its course would have ended as a miss with no yield counted.
        until(|| counters(&t).poll_yields == 1);
        t.stop();
        let c = counters(&t);
        assert_eq!(counting.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            (c.poll_misses, c.poll_yields, c.wakeups),
            (1, 1, 2),
            "{c:?}"
        );
    }

    #[test]
    fn doorbells_are_served_until_stopped() {
        let control = Arc::new(RunControl::default());
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let (mut t, ring) = serving(counting.clone(), &control, Duration::ZERO);
        ring.write(1).unwrap();
        until(|| counting.0.load(Ordering::SeqCst) == 1);
        assert_eq!(counting.0.load(Ordering::SeqCst), 1);
        assert_eq!(t.served_counter().load(Ordering::SeqCst), 1);
        t.stop();
        assert!(!control.is_finished(), "a clean stop is no failure");
        let c = counters(&t);
        assert_eq!(
            (c.wakeups, c.poll_hits, c.poll_misses, c.poll_ns),
            (2, 0, 0, 0)
        );
    }

    #[test]
    fn a_failed_io_thread_ends_the_vm_with_a_vmm_error() {
        let control = Arc::new(RunControl::default());
        let (_t, ring) = serving(Arc::new(Broken), &control, Duration::ZERO);
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
