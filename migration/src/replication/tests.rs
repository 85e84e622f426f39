//! Both loops over loopback: a fake VM on the primary, a fake host on the standby, and a
//! hand-driven primary where an epoch must be cut short.

use super::primary::{replicate, Epochs, PrimaryError};
use super::standby::{stand_by, ReplicaRam, Standby};
use super::ReplicationStats;
use crate::destination::Host;
use crate::protocol::{Blob, Frames, Msg};
use crate::testing::{FakeVm, RANGES};
use crate::{send, send_blob, Options, VmFault};
use dsm::PAGE_SIZE;
use musubi_types::ReplicationState;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"0123456789abcdef";

#[derive(Default)]
struct FakeHost {
    ram: Option<Arc<ReplicaRam>>,
    applied: Option<Vec<u8>>,
    /// The standby's disk copies.
    disks: Vec<std::path::PathBuf>,
    /// The standby's memory-storage copies.
    pmem: Vec<std::path::PathBuf>,
}

impl Host<ReplicaRam> for FakeHost {
    fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, VmFault> {
        assert_eq!(config, b"the config");
        Ok(RANGES.to_vec())
    }
    fn build(&mut self, ram: &Arc<ReplicaRam>) -> Result<(), VmFault> {
        self.ram = Some(ram.clone());
        Ok(())
    }
    fn apply(&mut self, state: &[u8]) -> Result<(), VmFault> {
        self.applied = Some(state.to_vec());
        Ok(())
    }
    fn disk_copies(&self) -> Vec<std::path::PathBuf> {
        self.disks.clone()
    }
    fn pmem_copies(&self) -> Vec<std::path::PathBuf> {
        self.pmem.clone()
    }
}

impl FakeHost {
    /// The first byte of each page of the standby's RAM.
    fn firsts(&self) -> Vec<u8> {
        let ram = self.ram.as_ref().expect("built");
        // SAFETY: reads inside the mapping, which the host holds; no VM runs on it.
        (0..96)
            .map(|p| unsafe { *ram.host_addr().add(p * PAGE_SIZE) })
            .collect()
    }
}

fn opts() -> Options {
    let mut o = Options::new(SECRET.to_vec());
    o.silence = Duration::from_secs(20);
    o
}

type Waited = (Result<Standby, crate::ReceiveError>, FakeHost, Vec<String>);

/// The standby on its own thread, until it ends or has logged `refusals` refusals.
fn standby(refusals: usize) -> (String, std::thread::JoinHandle<Waited>) {
    standby_with(refusals, FakeHost::default())
}

/// [`standby`] with `host`.
fn standby_with(refusals: usize, mut host: FakeHost) -> (String, std::thread::JoinHandle<Waited>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let seen = logs.clone();
        let mut stop = move || (seen.lock().unwrap().len() >= refusals).then(|| "enough".into());
        let l2 = logs.clone();
        let mut log = move |m: &str| l2.lock().unwrap().push(m.to_string());
        let r = stand_by(
            &l,
            &opts(),
            Duration::from_secs(5),
            &mut host,
            &mut stop,
            &mut log,
        );
        let logs = logs.lock().unwrap().clone();
        (r, host, logs)
    });
    (addr, t)
}

/// A primary replicating a fake VM to `addr` every 5 ms from a thread of its own.
fn primary(
    addr: String,
    copy_limit: usize,
) -> (
    Arc<FakeVm>,
    Arc<ReplicationStats>,
    std::thread::JoinHandle<Result<(), PrimaryError>>,
) {
    let vm = Arc::new(FakeVm::new());
    let stats = Arc::new(ReplicationStats::new("tcp:x", Duration::from_millis(5)));
    let epochs = Epochs {
        every: Duration::from_millis(5),
        copy_limit,
    };
    let p = {
        let (vm, stats) = (vm.clone(), stats.clone());
        std::thread::spawn(move || replicate(&*vm, &addr, &opts(), &epochs, &stats))
    };
    (vm, stats, p)
}

/// The VM runs on: every capture was resumed, and the dirty log is off again.
fn assert_left_running(vm: &FakeVm) {
    assert_eq!(
        vm.resumed.load(Ordering::SeqCst),
        vm.captures.load(Ordering::SeqCst)
    );
    assert!(!vm.logging.load(Ordering::SeqCst));
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(60), "no {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn epochs_reach_the_standby_and_a_vm_that_ends_is_not_taken_over() {
    let (addr, st) = standby(usize::MAX);
    let (vm, stats, p) = primary(addr, 2 * PAGE_SIZE);
    wait_until("first epoch", || stats.to_metrics().epochs_acked >= 1);
    // The guest writes five pages: more than the copy holds, so some go out paused.
    for page in [1, 2, 4, 50, 95] {
        vm.write(page, 0x70 + page as u8);
    }
    let acked = stats.to_metrics().epochs_acked;
    wait_until("an epoch after the writes", || {
        stats.to_metrics().epochs_acked >= acked + 2
    });
    vm.ended.store(true, Ordering::SeqCst);
    p.join().unwrap().unwrap();
    let (r, host, logs) = st.join().unwrap();
    match r {
        Ok(Standby::PrimaryEnded { epochs }) => assert!(epochs >= 3, "{epochs}"),
        other => panic!("{other:?} {logs:?}"),
    }
    let want: Vec<u8> = (0..96)
        .map(|p| vm.ram.lock().unwrap()[p * PAGE_SIZE])
        .collect();
    assert_eq!(host.firsts(), want);
    assert!(host.applied.is_none(), "the standby took over");
    let m = stats.to_metrics();
    assert_eq!(m.state, ReplicationState::Ended);
    assert_eq!(m.epochs_sent, m.epochs_acked);
    assert_eq!(vm.captures.load(Ordering::SeqCst) as u64, m.epochs_sent);
    assert_left_running(&vm);
}

/// The first steps of a standby driven by hand: takes the primary's connection on `l`,
/// reads the VM's configuration and answers that it stands by (100 ms heartbeats).
fn stand_by_by_hand(l: &TcpListener) -> (dsm_host::link::LinkReader, dsm_host::link::LinkWriter) {
    let (stream, _) = l.accept().unwrap();
    let link = dsm_host::Link::handshake(
        stream,
        dsm_host::Role::Listener,
        None,
        &opts().params(crate::DESTINATION),
    )
    .unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    let first = crate::recv(&mut r).unwrap();
    crate::recv_blob(&mut r, Blob::Config, first).unwrap();
    send(&mut w, &Msg::Standing { heartbeat_ms: 100 }).unwrap();
    (r, w)
}

/// A standby driven by hand: it acknowledges two epochs and goes.
fn standby_for_two_epochs() -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let st = std::thread::spawn(move || {
        let (mut r, mut w) = stand_by_by_hand(&l);
        let mut acked = 0;
        while acked < 2 {
            if let Msg::Commit { epoch, .. } = crate::recv(&mut r).unwrap() {
                send(&mut w, &Msg::Acked(epoch)).unwrap();
                acked += 1;
            }
        }
    });
    (addr, st)
}

#[test]
fn a_lost_standby_leaves_the_vm_running_and_says_after_how_many_epochs() {
    let (addr, st) = standby_for_two_epochs();
    let vm = FakeVm::new();
    let stats = ReplicationStats::new("tcp:x", Duration::from_millis(5));
    let epochs = Epochs {
        every: Duration::from_millis(5),
        ..Epochs::default()
    };
    let e = replicate(&vm, &addr, &opts(), &epochs, &stats).unwrap_err();
    st.join().unwrap();
    match &e {
        PrimaryError::Lost { acked, .. } => assert_eq!(*acked, 2, "{e}"),
        other => panic!("{other}"),
    }
    assert!(
        e.to_string().contains("the standby was lost after 2"),
        "{e}"
    );
    let m = stats.to_metrics();
    assert_eq!(m.state, ReplicationState::Lost);
    assert!(m.lost.is_some());
    // Output is held from before the first checkpoint, the output of each acknowledged one
    // released after it, and everything let go once the standby is lost.
    let output = vm.output.lock().unwrap().clone();
    assert_eq!(
        output,
        [("hold", 0), ("release", 1), ("release", 2), ("open", 3)],
        "(what, captures by then)"
    );
    assert_left_running(&vm);
}

/// A primary driven by hand: the configuration, then whole epochs of one page each
/// (`value` written to page `page`), then half an epoch, then the link drops.
#[test]
fn a_half_received_epoch_is_dropped_and_the_last_whole_one_is_taken_over() {
    let (addr, st) = standby(usize::MAX);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    assert!(matches!(
        crate::recv(&mut r).unwrap(),
        Msg::Standing { heartbeat_ms: 5000 }
    ));
    let page = |p: u64, v: u8| Msg::Page {
        page: p,
        data: Box::new([v; PAGE_SIZE]),
    };
    for (epoch, (p, v)) in [(3u64, 0x33u8), (3, 0x34), (7, 0x77)]
        .into_iter()
        .enumerate()
    {
        send(&mut w, &page(p, v)).unwrap();
        send_blob(&mut w, Blob::State, format!("state {epoch}").as_bytes()).unwrap();
        let epoch = epoch as u64;
        send(&mut w, &Msg::Commit { epoch, pages: 1 }).unwrap();
        assert_eq!(crate::recv(&mut r).unwrap(), Msg::Acked(epoch));
    }
    // Epoch 3 never closes: its pages and state must not reach the VM.
    send(&mut w, &page(3, 0xee)).unwrap();
    send(&mut w, &page(9, 0xee)).unwrap();
    send_blob(&mut w, Blob::State, b"state 3").unwrap();
    drop((r, w));
    let (res, host, logs) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver { epoch, why, .. }) => {
            assert_eq!(epoch, 2, "{why}");
            assert!(why.contains("closed"), "{why}");
        }
        other => panic!("{other:?} {logs:?}"),
    }
    assert_eq!(host.applied.as_deref(), Some(&b"state 2"[..]));
    let firsts = host.firsts();
    assert_eq!((firsts[3], firsts[7], firsts[9]), (0x34, 0x77, 0));
}

#[test]
fn an_epoch_that_does_not_add_up_counts_as_the_primary_lost() {
    let (addr, st) = standby(usize::MAX);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    crate::recv(&mut r).unwrap();
    send_blob(&mut w, Blob::State, b"state 0").unwrap();
    send(&mut w, &Msg::Commit { epoch: 0, pages: 0 }).unwrap();
    assert_eq!(crate::recv(&mut r).unwrap(), Msg::Acked(0));
    send(
        &mut w,
        &Msg::Page {
            page: 1,
            data: Box::new([1; PAGE_SIZE]),
        },
    )
    .unwrap();
    send_blob(&mut w, Blob::State, b"state 1").unwrap();
    send(&mut w, &Msg::Commit { epoch: 1, pages: 2 }).unwrap();
    let (res, host, _) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver { epoch, why, .. }) => {
            assert_eq!(epoch, 0);
            assert!(why.contains("2 pages, 1 came"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(host.applied.as_deref(), Some(&b"state 0"[..]));
    assert_eq!(host.firsts()[1], 0);
}

#[test]
fn a_primary_lost_before_its_first_whole_epoch_leaves_the_standby_waiting() {
    let (addr, st) = standby(2);
    // A wrong secret, then a primary that goes before its first epoch closes.
    let mut wrong = opts();
    wrong.secret = b"fedcba9876543210".to_vec();
    let e = crate::dial(&addr, "standby", &wrong)
        .err()
        .expect("a wrong secret is refused");
    assert!(e.to_string().contains("authentication"), "{e}");
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    crate::recv(&mut r).unwrap();
    drop((r, w));
    let (res, host, logs) = st.join().unwrap();
    assert!(
        matches!(res, Err(crate::ReceiveError::Stopped(_))),
        "{res:?}"
    );
    assert!(host.applied.is_none());
    assert!(
        logs.iter().any(|l| l.contains("authentication")),
        "{logs:?}"
    );
    assert!(
        logs.iter()
            .any(|l| l.contains("before its first epoch was whole") && l.contains("still waiting")),
        "{logs:?}"
    );
}

#[test]
fn a_primary_with_no_standby_says_so() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let vm = FakeVm::new();
    let stats = ReplicationStats::new("tcp:x", Duration::from_millis(5));
    let e = replicate(&vm, &addr, &opts(), &Epochs::default(), &stats).unwrap_err();
    assert!(matches!(e, PrimaryError::NotStarted { .. }), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
    assert_eq!(stats.to_metrics().state, ReplicationState::Lost);
    assert!(!vm.captured.load(Ordering::SeqCst));
}

#[test]
fn a_standby_asked_to_stop_closes_the_link_and_the_primary_goes_on_alone() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = {
        let stopping = stopping.clone();
        std::thread::spawn(move || {
            let mut host = FakeHost::default();
            let mut stop = || {
                stopping
                    .load(Ordering::SeqCst)
                    .then(|| "stopped by signal 15".to_string())
            };
            let r = stand_by(
                &l,
                &opts(),
                Duration::from_secs(5),
                &mut host,
                &mut stop,
                &mut |_| {},
            );
            (r, host)
        })
    };
    let (vm, stats, p) = primary(addr, Epochs::default().copy_limit);
    wait_until("two epochs", || stats.to_metrics().epochs_acked >= 2);
    stopping.store(true, Ordering::SeqCst);
    let (r, host) = st.join().unwrap();
    match r {
        Err(crate::ReceiveError::Stopped(why)) => assert!(why.contains("signal 15"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(host.applied.is_none(), "a stopped standby took over");
    let e = p.join().unwrap().unwrap_err();
    assert!(matches!(e, PrimaryError::Lost { .. }), "{e}");
    assert_left_running(&vm);
}

/// A standby's disk copy of `len` zero bytes in `dir`, and the sums a primary whose disk
/// holds the same sends.
fn zero_copy(dir: &std::path::Path, len: usize) -> (std::path::PathBuf, Msg) {
    let path = dir.join("copy.img");
    std::fs::write(&path, vec![0u8; len]).unwrap();
    let sum = vmm::FileSum::of(&std::fs::File::open(&path).unwrap()).unwrap();
    (path, Msg::DiskSums(vec![(sum.len, sum.crc32)]))
}

#[test]
fn disk_writes_reach_the_standbys_copy_at_commit_and_a_half_epochs_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, sums) = zero_copy(dir.path(), 8192);
    let host = FakeHost {
        disks: vec![copy.clone()],
        ..FakeHost::default()
    };
    let (addr, st) = standby_with(usize::MAX, host);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    send(&mut w, &sums).unwrap();
    assert!(matches!(crate::recv(&mut r).unwrap(), Msg::Standing { .. }));
    let write = |offset: u64, v: u8| Msg::DiskWrite {
        disk: 0,
        offset,
        data: vec![v; 512],
    };
    // Epoch 0: two writes, the second over part of the first.
    send(&mut w, &write(0, 1)).unwrap();
    send(&mut w, &write(4096, 2)).unwrap();
    send(&mut w, &write(256, 3)).unwrap();
    send_blob(&mut w, Blob::State, b"state 0").unwrap();
    send(&mut w, &Msg::Commit { epoch: 0, pages: 0 }).unwrap();
    assert_eq!(crate::recv(&mut r).unwrap(), Msg::Acked(0));
    // Acknowledged: on the copy already.
    let on_copy = std::fs::read(&copy).unwrap();
    assert_eq!((on_copy[0], on_copy[256], on_copy[4096]), (1, 3, 2));
    // Epoch 1 never closes: its write must not reach the copy.
    send(&mut w, &write(0, 9)).unwrap();
    send_blob(&mut w, Blob::State, b"state 1").unwrap();
    drop((r, w));
    let (res, host, logs) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver { epoch, .. }) => assert_eq!(epoch, 0),
        other => panic!("{other:?} {logs:?}"),
    }
    assert_eq!(host.applied.as_deref(), Some(&b"state 0"[..]));
    let on_copy = std::fs::read(&copy).unwrap();
    assert_eq!(on_copy.len(), 8192);
    assert_eq!((on_copy[0], on_copy[255], on_copy[256]), (1, 1, 3));
    assert!(on_copy[768..4096].iter().all(|&b| b == 0));
}

#[test]
fn a_copy_of_another_size_or_content_is_refused_by_name_and_the_standby_waits() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, _) = zero_copy(dir.path(), 8192);
    let host = FakeHost {
        disks: vec![copy.clone()],
        ..FakeHost::default()
    };
    let (addr, st) = standby_with(2, host);
    let named = copy.display().to_string();
    for (sums, says) in [
        (vec![(4096, 0)], "same size"),
        (vec![(8192, 1)], "differs from the primary's disk 0"),
    ] {
        let link = crate::dial(&addr, "standby", &opts()).unwrap();
        let (mut r, mut w) = (link.reader, link.writer);
        send_blob(&mut w, Blob::Config, b"the config").unwrap();
        send(&mut w, &Msg::DiskSums(sums)).unwrap();
        match crate::recv(&mut r).unwrap() {
            Msg::Refused(why) => assert!(why.contains(&named) && why.contains(says), "{why}"),
            m => panic!("{m:?}"),
        }
    }
    let (res, host, logs) = st.join().unwrap();
    assert!(
        matches!(res, Err(crate::ReceiveError::Stopped(_))),
        "{res:?}"
    );
    assert!(host.applied.is_none());
    assert!(logs.iter().all(|l| l.contains(&named)), "{logs:?}");
    assert_eq!(std::fs::read(&copy).unwrap(), vec![0u8; 8192]);
}

#[test]
fn stretched_epochs_show_in_the_metrics_beside_the_one_asked_for() {
    let stats = ReplicationStats::new("tcp:127.0.0.1:1", Duration::from_millis(20));
    assert_eq!(stats.to_metrics().epoch_ms_median, 0);
    for ms in [20, 21, 250, 260, 240] {
        stats.interval(Duration::from_millis(ms));
    }
    let m = stats.to_metrics();
    assert_eq!(
        (m.epoch_ms, m.epoch_ms_median, m.epoch_ms_max),
        (20, 240, 260)
    );
}

#[test]
fn the_pause_p99_shows_long_pauses_the_median_hides_and_ignores_a_single_one() {
    let stats = ReplicationStats::new("tcp:127.0.0.1:1", Duration::from_millis(20));
    assert_eq!(stats.to_metrics().pause_us_p99, 0);
    for _ in 0..199 {
        stats.sent(4096, Duration::from_micros(100));
    }
    stats.sent(4096, Duration::from_micros(50_000));
    let m = stats.to_metrics();
    // One long pause in 200 is the max, not the 99th percentile.
    assert_eq!(
        (m.pause_us_median, m.pause_us_p99, m.pause_us_max),
        (100, 100, 50_000)
    );
    for _ in 0..3 {
        stats.sent(4096, Duration::from_micros(50_000));
    }
    let m = stats.to_metrics();
    assert_eq!((m.pause_us_median, m.pause_us_p99), (100, 50_000));
}

/// A frame as a network device holds it, recognisable by `v`.
fn held_frame(v: u8) -> Vec<u8> {
    vec![v; 12 + 60]
}

#[test]
fn an_epochs_frames_go_with_it_and_are_said_released_once_written() {
    // A standby driven by hand: it reads two epochs, acknowledges them and goes.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let vm = Arc::new(FakeVm::new());
    // Sent by the guest before the first checkpoint: that epoch's.
    *vm.sending.lock().unwrap() = vec![(0, held_frame(1)), (1, held_frame(2)), (0, held_frame(3))];
    let st = {
        let vm = vm.clone();
        std::thread::spawn(move || {
            let (mut r, mut w) = stand_by_by_hand(&l);
            // Per epoch: the frames it carried, and what came after its acknowledgement.
            let mut epochs = Vec::new();
            let mut frames = Vec::new();
            let mut after = Vec::new();
            while epochs.len() < 2 {
                match crate::recv(&mut r).unwrap() {
                    m @ Msg::Part(Blob::Frames, _) => {
                        let doc = crate::recv_blob(&mut r, Blob::Frames, m).unwrap();
                        frames = crate::protocol::decode_frames(&doc).unwrap();
                    }
                    m @ Msg::Part(Blob::State, _) => {
                        crate::recv_blob(&mut r, Blob::State, m).unwrap();
                        assert!(frames.is_empty(), "the frames came before the state");
                    }
                    Msg::Commit { epoch, .. } => {
                        epochs.push(std::mem::take(&mut frames));
                        send(&mut w, &Msg::Acked(epoch)).unwrap();
                        // What follows the acknowledgement, before the next epoch's pages.
                        let next = crate::recv(&mut r).unwrap();
                        if next == Msg::Released(epoch) {
                            let output = vm.output.lock().unwrap().clone();
                            assert_eq!(output.last(), Some(&("release", epoch as usize + 1)));
                        }
                        after.push(next);
                    }
                    _ => {}
                }
            }
            (epochs, after)
        })
    };
    let stats = ReplicationStats::new("tcp:x", Duration::from_millis(5));
    let epochs = Epochs {
        every: Duration::from_millis(5),
        ..Epochs::default()
    };
    let e = replicate(&*vm, &addr, &opts(), &epochs, &stats).unwrap_err();
    assert!(matches!(e, PrimaryError::Lost { .. }), "{e}");
    let (carried, after) = st.join().unwrap();
    assert_eq!(
        carried,
        [
            vec![(0, held_frame(1)), (1, held_frame(2)), (0, held_frame(3))],
            vec![]
        ]
    );
    assert_eq!(after[0], Msg::Released(0), "written, and said so");
    assert!(
        !matches!(after[1], Msg::Released(_)),
        "an epoch without frames has nothing to release: {:?}",
        after[1]
    );
}

/// A hand-driven primary's epoch `epoch`: one page, its state, `frames` if any, and
/// (`commit`) its commit, acknowledged.
fn epoch_with_frames(
    r: &mut dsm_host::link::LinkReader,
    w: &mut dsm_host::link::LinkWriter,
    epoch: u64,
    frames: &[(u32, Vec<u8>)],
    commit: bool,
) {
    send(
        w,
        &Msg::Page {
            page: epoch,
            data: Box::new([epoch as u8 + 1; PAGE_SIZE]),
        },
    )
    .unwrap();
    send_blob(w, Blob::State, format!("state {epoch}").as_bytes()).unwrap();
    if !frames.is_empty() {
        send_blob(w, Blob::Frames, &crate::protocol::encode_frames(frames)).unwrap();
    }
    if commit {
        send(w, &Msg::Commit { epoch, pages: 1 }).unwrap();
        assert_eq!(crate::recv(r).unwrap(), Msg::Acked(epoch));
    }
}

/// One epoch of [`take_over_after`]'s script: its frames, whether it commits, whether its
/// frames are then said released.
type Scripted = (Frames, bool, bool);

/// Drives a standby through `script`, drops the link, and returns the epoch it took over
/// and the frames it left to send.
fn take_over_after(script: &[Scripted]) -> (u64, Frames) {
    let (addr, st) = standby(usize::MAX);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    assert!(matches!(crate::recv(&mut r).unwrap(), Msg::Standing { .. }));
    for (epoch, (frames, commit, released)) in script.iter().enumerate() {
        epoch_with_frames(&mut r, &mut w, epoch as u64, frames, *commit);
        if *released {
            send(&mut w, &Msg::Released(epoch as u64)).unwrap();
        }
    }
    drop((r, w));
    let (res, host, logs) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver {
            epoch, unreleased, ..
        }) => {
            assert_eq!(
                host.applied.as_deref(),
                Some(format!("state {epoch}").as_bytes())
            );
            (epoch, unreleased)
        }
        other => panic!("{other:?} {logs:?}"),
    }
}

#[test]
fn a_standby_sends_the_frames_of_the_epoch_it_resumes_from_unless_they_were_released() {
    let a = vec![(0, held_frame(0xa1)), (1, held_frame(0xa2))];
    let b = vec![(0, held_frame(0xb1))];
    // Not released: the primary may have died holding them.
    assert_eq!(take_over_after(&[(a.clone(), true, false)]), (0, a.clone()));
    // Released: the primary wrote them, and the standby does not again.
    assert_eq!(take_over_after(&[(a.clone(), true, true)]), (0, Vec::new()));
    // Each commit replaces the frames of the epoch before, released or not.
    assert_eq!(
        take_over_after(&[(a.clone(), true, true), (b.clone(), true, false)]),
        (1, b.clone())
    );
    assert_eq!(
        take_over_after(&[(a.clone(), true, true), (vec![], true, false)]),
        (1, Vec::new())
    );
    // A half-received epoch's frames go with it: the standby resumes before them, and its
    // VM sends them again itself.
    assert_eq!(
        take_over_after(&[(a.clone(), true, false), (b.clone(), false, false)]),
        (0, a.clone())
    );
    assert_eq!(
        take_over_after(&[(a, true, true), (b, false, false)]),
        (0, Vec::new())
    );
}

#[test]
fn a_release_of_another_epoch_counts_as_the_primary_lost() {
    let (addr, st) = standby(usize::MAX);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    crate::recv(&mut r).unwrap();
    let a = vec![(0, held_frame(0xa1))];
    epoch_with_frames(&mut r, &mut w, 0, &a, true);
    send(&mut w, &Msg::Released(1)).unwrap();
    let (res, _, logs) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver {
            epoch,
            why,
            unreleased,
            ..
        }) => {
            assert_eq!(epoch, 0);
            assert!(why.contains("released epoch 1"), "{why}");
            assert_eq!(unreleased, a, "not released");
        }
        other => panic!("{other:?} {logs:?}"),
    }
}

#[test]
fn under_policy_stop_a_lost_standby_leaves_the_output_held_for_the_caller_to_open() {
    let (addr, st) = standby_for_two_epochs();
    let vm = FakeVm::new();
    let stats = ReplicationStats::new("tcp:x", Duration::from_millis(5))
        .with_policy(musubi_types::ReplicationPolicy::Stop);
    let epochs = Epochs {
        every: Duration::from_millis(5),
        ..Epochs::default()
    };
    let e = replicate(&vm, &addr, &opts(), &epochs, &stats).unwrap_err();
    st.join().unwrap();
    assert!(matches!(e, PrimaryError::Lost { .. }), "{e}");
    let output = vm.output.lock().unwrap().clone();
    assert_eq!(
        output,
        [("hold", 0), ("release", 1), ("release", 2)],
        "nothing unacknowledged let go: (what, captures by then)"
    );
}

#[test]
fn pmem_pages_reach_the_standbys_copy_at_commit_and_a_half_epochs_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, _) = zero_copy(dir.path(), 4 * PAGE_SIZE);
    let sum = vmm::FileSum::of(&std::fs::File::open(&copy).unwrap()).unwrap();
    let host = FakeHost {
        pmem: vec![copy.clone()],
        ..FakeHost::default()
    };
    let (addr, st) = standby_with(usize::MAX, host);
    let link = crate::dial(&addr, "standby", &opts()).unwrap();
    let (mut r, mut w) = (link.reader, link.writer);
    send_blob(&mut w, Blob::Config, b"the config").unwrap();
    send(&mut w, &Msg::PmemSums(vec![(sum.len, sum.crc32)])).unwrap();
    assert!(matches!(crate::recv(&mut r).unwrap(), Msg::Standing { .. }));
    let page = |offset: u64, v: u8| Msg::PmemPage {
        region: 0,
        offset,
        data: Box::new([v; PAGE_SIZE]),
    };
    // Epoch 0: page 2, then page 1 twice (the later copy wins). Nothing is on the copy
    // before the commit, the first epoch's pages included.
    send(&mut w, &page(2 * PAGE_SIZE as u64, 2)).unwrap();
    send(&mut w, &page(PAGE_SIZE as u64, 1)).unwrap();
    send(&mut w, &page(PAGE_SIZE as u64, 3)).unwrap();
    send_blob(&mut w, Blob::State, b"state 0").unwrap();
    send(&mut w, &Msg::Commit { epoch: 0, pages: 0 }).unwrap();
    assert_eq!(crate::recv(&mut r).unwrap(), Msg::Acked(0));
    let on_copy = std::fs::read(&copy).unwrap();
    assert_eq!(
        (on_copy[0], on_copy[PAGE_SIZE], on_copy[2 * PAGE_SIZE]),
        (0, 3, 2)
    );
    // Epoch 1 never closes: its page must not reach the copy.
    send(&mut w, &page(0, 9)).unwrap();
    send_blob(&mut w, Blob::State, b"state 1").unwrap();
    drop((r, w));
    let (res, host, logs) = st.join().unwrap();
    match res {
        Ok(Standby::TakeOver { epoch, .. }) => assert_eq!(epoch, 0),
        other => panic!("{other:?} {logs:?}"),
    }
    assert_eq!(host.applied.as_deref(), Some(&b"state 0"[..]));
    let on_copy = std::fs::read(&copy).unwrap();
    assert_eq!(on_copy.len(), 4 * PAGE_SIZE);
    assert!(on_copy[..PAGE_SIZE].iter().all(|&b| b == 0));
    assert!(on_copy[PAGE_SIZE..2 * PAGE_SIZE].iter().all(|&b| b == 3));
    assert!(on_copy[3 * PAGE_SIZE..].iter().all(|&b| b == 0));
}

#[test]
fn a_pmem_copy_that_differs_is_refused_by_name_and_a_missing_one_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, _) = zero_copy(dir.path(), 2 * PAGE_SIZE);
    let host = FakeHost {
        pmem: vec![copy.clone()],
        ..FakeHost::default()
    };
    let (addr, st) = standby_with(2, host);
    let named = format!("--pmem file={}", copy.display());
    for (sums, says) in [
        (
            vec![(2 * PAGE_SIZE as u64, 1)],
            "differs from the primary's memory-storage file 0",
        ),
        (vec![(1, 0), (1, 0)], "the VM has 2 memory-storage files"),
    ] {
        let link = crate::dial(&addr, "standby", &opts()).unwrap();
        let (mut r, mut w) = (link.reader, link.writer);
        send_blob(&mut w, Blob::Config, b"the config").unwrap();
        send(&mut w, &Msg::PmemSums(sums)).unwrap();
        match crate::recv(&mut r).unwrap() {
            Msg::Refused(why) => assert!(why.contains(says), "{why}"),
            m => panic!("{m:?}"),
        }
    }
    let (res, host, logs) = st.join().unwrap();
    assert!(
        matches!(res, Err(crate::ReceiveError::Stopped(_))),
        "{res:?}"
    );
    assert!(host.applied.is_none());
    assert!(logs[0].contains(&named), "{logs:?}");
    assert_eq!(std::fs::read(&copy).unwrap(), vec![0u8; 2 * PAGE_SIZE]);
}
