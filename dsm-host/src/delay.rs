//! A one-way delay on the frames a node sends, in Musubi's own link layer, so a slower
//! network can be emulated on any host. `tc netem` would do this in the kernel, but the host
//! kernels these nodes are developed on lack it (`CONFIG_NET_SCH_NETEM` is not set), and a
//! delay that lives in the link works the same over loopback, network namespaces and real
//! hosts, without root.
//!
//! Every frame gets a due time (when it was sent plus the delay) and waits in a queue that
//! one thread per link drains. The delay is the same for every frame, so due times rise in
//! the order frames are sent and one FIFO keeps both the order and the timing: the thread
//! sleeps until the oldest frame is due (a timed wait, never a spin), writes it and every
//! later frame already due in one write, and waits again. A sender only appends to the
//! queue, so neither the coherence thread nor a vCPU ever waits out the delay.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest delay accepted. Heartbeats are delayed like every other frame, so a delay
/// near the transport's loss timeout (1.5 s by default) would have a peer counted as lost
/// before its first heartbeat arrives; half a second keeps well clear of it and still covers
/// links across continents.
pub const MAX_LINK_DELAY: Duration = Duration::from_millis(500);

/// Timer slack of the delaying thread. Linux lets a timed wait of a normal thread end up to
/// 50 µs late so that wake-ups can be merged; against a delay of 100 µs that would be half
/// of it again.
const TIMER_SLACK_NS: libc::c_ulong = 1_000;

/// Where a delay line writes: the stream to the peer.
pub trait DelaySink: Write + Send + 'static {
    /// Called once after a write failed: the peer may hold part of a frame, so the stream
    /// must end rather than carry anything more.
    fn end(&mut self);
}

impl DelaySink for TcpStream {
    fn end(&mut self) {
        let _ = self.shutdown(Shutdown::Write);
    }
}

/// A write of the delaying thread failed: the stream has ended, and the line refuses every
/// later frame with this same error (hence the shared `io::Error`).
#[derive(Clone, Debug, thiserror::Error)]
#[error("a delayed send failed: {0}")]
pub struct DelayFailed(#[source] Arc<std::io::Error>);

struct Queue {
    /// (due, frame), oldest first.
    frames: VecDeque<(Instant, Vec<u8>)>,
    /// The thread holds frames taken from the queue and not yet written.
    writing: bool,
    /// The line is being dropped: the thread ends without writing what is left.
    closed: bool,
    /// Why a write failed; nothing more is accepted or written after it.
    failed: Option<DelayFailed>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when a frame is queued to an empty queue, when a write completes or fails,
    /// and when the line closes.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending side's delay for one link.
pub struct DelayLine {
    delay: Duration,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl DelayLine {
    /// Starts the thread that writes frames to `sink` once they are `delay` old.
    pub fn start<W: DelaySink>(
        sink: W,
        delay: Duration,
        name: String,
    ) -> std::io::Result<DelayLine> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                frames: VecDeque::new(),
                writing: false,
                closed: false,
                failed: None,
            }),
            changed: Condvar::new(),
        });
        let for_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || drain(sink, &for_thread))?;
        Ok(DelayLine {
            delay,
            shared,
            thread: Some(thread),
        })
    }

    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Queues one whole frame, due `delay` from now. Never waits for the delay or the
    /// network; refused (with the reason) once a write has failed.
    pub fn push(&self, frame: Vec<u8>) -> Result<(), DelayFailed> {
        let mut q = self.shared.lock();
        if let Some(why) = &q.failed {
            return Err(why.clone());
        }
        // Taken under the lock, so due times rise in queue order even with several senders.
        let due = Instant::now() + self.delay;
        let was_empty = q.frames.is_empty();
        q.frames.push_back((due, frame));
        drop(q);
        if was_empty {
            self.shared.changed.notify_all();
        }
        Ok(())
    }

    /// Waits until every frame queued so far is written (or a write failed), at most
    /// `limit`. True if nothing is left.
    pub fn flush(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut q = self.shared.lock();
        while (!q.frames.is_empty() || q.writing) && q.failed.is_none() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            q = self
                .shared
                .changed
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Why a write failed, if one did.
    pub fn failed(&self) -> Option<DelayFailed> {
        self.shared.lock().failed.clone()
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            // The thread only waits on the condition variable, which the line just
            // signalled, or in a write, which the stream's send timeout bounds.
            let _ = t.join();
        }
    }
}

/// The delaying thread: waits for the oldest frame to be due, writes every frame due by
/// then in one write, until the line closes or a write fails.
fn drain<W: DelaySink>(mut sink: W, shared: &Shared) {
    // SAFETY: PR_SET_TIMERSLACK changes only the calling thread's timer slack; the other
    // arguments are ignored.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) };
    let mut batch = Vec::new();
    loop {
        let mut q = shared.lock();
        // Each pass either ends, writes, or waits until the oldest frame is due or the queue
        // changes.
        loop {
            if q.closed {
                return;
            }
            let now = Instant::now();
            match q.frames.front() {
                Some((due, _)) if *due <= now => break,
                Some((due, _)) => {
                    let left = *due - now;
                    q = shared
                        .changed
                        .wait_timeout(q, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                None => q = shared.changed.wait(q).unwrap_or_else(|e| e.into_inner()),
            }
        }
        let now = Instant::now();
        batch.clear();
        while let Some((_, f)) = q.frames.front().filter(|(due, _)| *due <= now) {
            batch.extend_from_slice(f);
            q.frames.pop_front();
        }
        q.writing = true;
        drop(q);
        let r = sink.write_all(&batch).and_then(|()| sink.flush());
        let mut q = shared.lock();
        q.writing = false;
        if let Err(e) = r {
            sink.end();
            q.failed = Some(DelayFailed(Arc::new(e)));
            q.frames.clear();
            drop(q);
            shared.changed.notify_all();
            return;
        }
        drop(q);
        shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Records when each write arrives.
    struct Recorder {
        tx: mpsc::Sender<(Instant, Vec<u8>)>,
        fail: bool,
        ended: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Write for Recorder {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.fail {
                return Err(std::io::Error::other("the peer went away"));
            }
            let _ = self.tx.send((Instant::now(), b.to_vec()));
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl DelaySink for Recorder {
        fn end(&mut self) {
            self.ended.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn recorder(fail: bool) -> (Recorder, mpsc::Receiver<(Instant, Vec<u8>)>) {
        let (tx, rx) = mpsc::channel();
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (Recorder { tx, fail, ended }, rx)
    }

    /// Frames come out in the order they went in, each no earlier than its send time plus
    /// the delay. (No upper bound: how late a loaded host wakes a thread is not this code's
    /// behaviour.)
    #[test]
    fn frames_leave_in_order_and_not_before_they_are_due() {
        let delay = Duration::from_micros(300);
        let (sink, rx) = recorder(false);
        let line = DelayLine::start(sink, delay, "test-delay".into()).unwrap();
        let mut sent = Vec::new();
        for i in 0u32..200 {
            sent.push((Instant::now(), i));
            line.push(i.to_le_bytes().to_vec()).unwrap();
            // Bursts and gaps, so some writes carry several frames and some one.
            if i % 16 == 15 {
                std::thread::sleep(Duration::from_micros(250));
            }
        }
        assert!(
            line.flush(Duration::from_secs(10)),
            "every frame is written"
        );
        let mut got = Vec::new();
        for (at, bytes) in rx.try_iter() {
            for f in bytes.chunks(4) {
                got.push((at, u32::from_le_bytes(f.try_into().unwrap())));
            }
        }
        let order: Vec<u32> = got.iter().map(|g| g.1).collect();
        assert_eq!(order, (0..200).collect::<Vec<_>>());
        for ((sent_at, i), (written_at, _)) in sent.iter().zip(&got) {
            assert!(
                *written_at >= *sent_at + delay,
                "frame {i} left {:?} after it was sent, before its delay of {delay:?}",
                written_at.duration_since(*sent_at)
            );
        }
    }

    #[test]
    fn a_push_returns_before_its_frame_is_written() {
        let (sink, rx) = recorder(false);
        let line = DelayLine::start(sink, MAX_LINK_DELAY, "test-delay".into()).unwrap();
        let mut returned = Vec::new();
        for i in 0u8..10 {
            line.push(vec![i]).unwrap();
            returned.push(Instant::now());
        }
        assert!(line.flush(Duration::from_secs(10)));
        let written: Vec<(Instant, u8)> = rx
            .try_iter()
            .flat_map(|(at, b)| b.into_iter().map(move |x| (at, x)))
            .collect();
        assert_eq!(
            written.iter().map(|w| w.1).collect::<Vec<_>>(),
            (0u8..10).collect::<Vec<_>>()
        );
        for (r, (w, i)) in returned.iter().zip(&written) {
            assert!(r < w, "the push of frame {i} waited for its write");
        }
    }

    #[test]
    fn a_failed_write_ends_the_stream_and_refuses_further_frames() {
        let (sink, _rx) = recorder(true);
        let ended = Arc::clone(&sink.ended);
        let line = DelayLine::start(sink, Duration::from_micros(100), "test-delay".into()).unwrap();
        line.push(vec![1]).unwrap();
        assert!(line.flush(Duration::from_secs(10)));
        assert!(ended.load(std::sync::atomic::Ordering::SeqCst));
        let why = line.failed().expect("the failure is kept");
        assert!(why.to_string().contains("the peer went away"), "{why}");
        assert_eq!(line.push(vec![2]).unwrap_err().to_string(), why.to_string());
    }

    #[test]
    fn dropping_a_line_with_frames_queued_ends_its_thread_without_writing_them() {
        let (sink, rx) = recorder(false);
        let line = DelayLine::start(sink, MAX_LINK_DELAY, "test-delay".into()).unwrap();
        line.push(vec![1]).unwrap();
        drop(line);
        // The thread has ended and dropped the sink: the channel is closed, and empty.
        assert_eq!(rx.recv(), Err(mpsc::RecvError));
    }
}
