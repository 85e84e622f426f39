//! How long the coherence thread keeps polling, instead of sleeping, while a fault of its
//! node waits for a peer's answer.
//!
//! A thread asleep in poll(2) costs whoever wakes it a wake-up, and where idle cores halt,
//! the answer to a remote fetch also waits for the core to come back. Meanwhile the vCPU that
//! faulted is stopped, so its core has little else to do. On the 2-core development host,
//! polling up to 200 us took the median remote fetch from 71 to 57-60 us (about 1,700 fetches
//! each), the page's trip from the owner to the requester most of all; in `bench vmp`, which
//! runs without polling beside it, the gain showed in one full run and not in the next.
//!
//! The window adapts as KVM's halt polling does: an answer that came soon after the window
//! ended grows it, one that came much later (a slow or delayed link) shrinks it, so polling
//! costs little where it cannot help. `yield` between polls lets any other runnable thread
//! on this core go first.

use std::time::{Duration, Instant};

/// The most a node polls by default, as KVM's default `halt_poll_ns` (200 us).
pub const DEFAULT_POLL_WINDOW: Duration = Duration::from_micros(200);

/// Where a window grows from after shrinking to nothing.
const GROW_FROM: Duration = Duration::from_micros(10);

/// How one wait for the descriptors ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// Something was ready while polling, `after` the wait began.
    Polled { after: Duration },
    /// Nothing came while polling (or no poll was due); the thread slept until something
    /// came or the timeout passed, `after` the wait began.
    Slept { after: Duration },
}

/// The adaptive polling window of one coherence thread.
#[derive(Clone, Debug)]
pub struct PollWindow {
    max: Duration,
    now: Duration,
}

impl PollWindow {
    /// A window that never exceeds `max` (zero: never poll).
    pub fn new(max: Duration) -> PollWindow {
        PollWindow { max, now: max }
    }

    /// How long the next wait polls.
    pub fn current(&self) -> Duration {
        self.now
    }

    /// Adapts to how a wait during which a fault was outstanding ended.
    pub fn update(&mut self, w: Waited) {
        let Waited::Slept { after } = w else {
            return;
        };
        if self.max.is_zero() {
            return;
        }
        self.now = if after <= self.max {
            // A longer window would have caught it.
            (self.now * 2).max(GROW_FROM).min(self.max)
        } else {
            let half = self.now / 2;
            if half < GROW_FROM {
                Duration::ZERO
            } else {
                half
            }
        };
    }
}

/// Polls `fds` without sleeping for up to `window`, then sleeps in poll(2) for up to
/// `timeout` (`None`: no limit).
pub(crate) fn wait(
    fds: &mut [libc::pollfd],
    window: Duration,
    timeout: Option<Duration>,
) -> std::io::Result<Waited> {
    let start = Instant::now();
    if !window.is_zero() {
        loop {
            if crate::memory::poll(fds, Some(Duration::ZERO))? > 0 {
                return Ok(Waited::Polled {
                    after: start.elapsed(),
                });
            }
            if start.elapsed() >= window {
                break;
            }
            std::thread::yield_now();
        }
    }
    crate::memory::poll(fds, timeout)?;
    Ok(Waited::Slept {
        after: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn answers_soon_after_the_window_grow_it_and_late_ones_shrink_it_to_nothing() {
        let mut w = PollWindow::new(200 * US);
        assert_eq!(w.current(), 200 * US);
        w.update(Waited::Slept { after: 5000 * US });
        assert_eq!(w.current(), 100 * US);
        for _ in 0..4 {
            w.update(Waited::Slept { after: 5000 * US });
        }
        assert_eq!(w.current(), Duration::ZERO);
        w.update(Waited::Slept { after: 150 * US });
        assert_eq!(w.current(), GROW_FROM);
        w.update(Waited::Polled { after: US });
        assert_eq!(w.current(), GROW_FROM);
        for _ in 0..10 {
            w.update(Waited::Slept { after: 150 * US });
        }
        assert_eq!(w.current(), 200 * US, "never past the most it may poll");
    }

    #[test]
    fn a_zero_window_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        w.update(Waited::Slept { after: US });
        assert_eq!(w.current(), Duration::ZERO);
    }

    #[test]
    fn ready_descriptors_end_the_polling_and_silent_ones_sleep_until_the_timeout() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut fds = [libc::pollfd {
            fd: b.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let r = wait(
            &mut fds,
            Duration::from_millis(1),
            Some(Duration::from_millis(1)),
        )
        .unwrap();
        assert!(matches!(r, Waited::Slept { after } if after >= Duration::from_millis(1)));
        std::io::Write::write_all(&mut &a, b"x").unwrap();
        let r = wait(&mut fds, Duration::from_secs(5), None).unwrap();
        assert!(matches!(r, Waited::Polled { .. }), "{r:?}");
        assert_eq!(fds[0].revents & libc::POLLIN, libc::POLLIN);
    }
}
