//! The receiving side: waits for one VM, lets only a peer that proves the secret in, has the
//! [`Host`] check the configuration and build the VM on [`PostCopyRam`], and at the switch
//! starts the threads that bring its pages in.
//!
//! [`PostCopyRam`] is guest RAM whose every page starts absent. A fault thread asks the
//! source for each page the first time anything touches it; a link thread installs every
//! page the source sends (asked for or pushed) and wakes whoever waits for it. When the
//! source says it has pushed everything, every page with data is in and the rest are zeros,
//! so the memory leaves userfaultfd (absent pages then read as zeros, as on the source) and
//! the source is told it may end.

use crate::protocol::{Blob, Msg, RamLayout, RamLayoutError};
pub use crate::ReceiveError;
use crate::{recv, recv_blob, send, Options, ProtocolError, VmFault};
use dsm::PAGE_SIZE;
use dsm_host::link::{LinkReader, LinkWriter};
use dsm_host::{Envelope, Link, LinkError, Memory, MemoryError};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the destination's process does with an incoming VM, built on guest RAM of type
/// `Ram` (a migration's [`PostCopyRam`], a standby's `ReplicaRam`).
pub trait Host<Ram = PostCopyRam> {
    /// Whether this process can host the VM of `config` (its disks open here, ...):
    /// `Err(why)` refuses it before the source pauses anything. Returns the VM's RAM
    /// ranges (guest-physical start, length), laid one after the other in the mapping
    /// [`Host::build`] gets.
    fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, VmFault>;
    /// Builds the VM on `ram`, without its state and without starting it, while the source
    /// still runs it: the time this takes (it grows with RAM) is not part of the pause.
    fn build(&mut self, ram: &Arc<Ram>) -> Result<(), VmFault>;
    /// Puts the VM's state (JSON), sent once the source has paused, into the built VM.
    fn apply(&mut self, state: &[u8]) -> Result<(), VmFault>;
    /// A standby's own copies of the checked VM's disks, in `--disk` order, which it keeps
    /// equal to the primary's (a migration's destination opens the source's disks, and
    /// keeps none).
    fn disk_copies(&self) -> Vec<std::path::PathBuf> {
        Vec::new()
    }
    /// A standby's own copies of the checked VM's memory-storage files, in `--pmem` order,
    /// kept as its disks are.
    fn pmem_copies(&self) -> Vec<std::path::PathBuf> {
        Vec::new()
    }
}

/// Why one source's migration ended before the switch (the wait goes on).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The reason, also sent to the source as text.
    #[error("refused the VM: {0}")]
    Refused(#[source] Unhostable),
    #[error("pre-copied guest RAM: {0}")]
    Precopy(#[source] MemoryError),
    /// The reason, also sent to the source as text.
    #[error("could not build the VM: {0}")]
    NotBuilt(#[source] VmFault),
    #[error("expected the switch, got a {0} message")]
    NoSwitch(&'static str),
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// Why this process cannot host the VM offered.
#[derive(Debug, thiserror::Error)]
pub enum Unhostable {
    #[error("{0}")]
    Host(#[source] VmFault),
    #[error(transparent)]
    Layout(#[from] RamLayoutError),
    #[error(transparent)]
    Ram(#[from] MemoryError),
}

/// Why the threads that bring the pages in could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Thread(#[from] std::io::Error),
}

/// Why a message to the source could not go.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("no link")]
    NoLink,
}

/// Waits on `listener` for one VM, refusing (and reporting through `log`) every peer that
/// does not prove the secret or whose VM cannot be hosted, until one has switched over:
/// its VM is then built (not started) and its pages are on their way. Handshakes run as at a
/// node's door (`dsm_host::door`): each on a thread of its own, a short deadline each, so a
/// silent or slow stranger cannot hold the real source up. `stop` is asked between waits:
/// `Some(why)` gives up.
pub fn receive(
    listener: &TcpListener,
    opts: &Options,
    host: &mut dyn Host,
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<Arc<PostCopyRam>, ReceiveError> {
    crate::serve_first(
        listener,
        opts,
        "the migration destination",
        ("migration", "refused or failed before the switch"),
        stop,
        log,
        &mut |link, _| session(link, opts, host),
    )
}

/// One peer that proved the secret, from its configuration to the switch.
fn session(
    link: Link,
    opts: &Options,
    host: &mut dyn Host,
) -> Result<Arc<PostCopyRam>, SessionError> {
    let (mut reader, mut writer, config) = crate::recv_config(link, opts)?;
    // Everything that takes time in proportion to the VM is done here, while the source
    // still runs it.
    let built = host
        .check(&config)
        .map_err(Unhostable::Host)
        .and_then(|ranges| {
            let layout = RamLayout::new(ranges)?;
            let ram = PostCopyRam::new(layout, opts.clone())?;
            host.build(&ram).map_err(Unhostable::Host)?;
            Ok(ram)
        });
    let ram = match built {
        Ok(r) => r,
        Err(why) => {
            let _ = send(&mut writer, &Msg::Refused(why.to_string()));
            return Err(SessionError::Refused(why));
        }
    };
    send(&mut writer, &Msg::Ready)?;
    // A pre-copy source sends pages before the state, while its VM runs, some of them
    // several times over.
    let first = loop {
        match recv(&mut reader)? {
            Msg::Page { page, data } => ram.precopy(page, &data).map_err(SessionError::Precopy)?,
            m => break m,
        }
    };
    let state = recv_blob(&mut reader, Blob::State, first)?;
    if let Err(why) = host.apply(&state) {
        let _ = send(&mut writer, &Msg::Failed(why.to_string()));
        return Err(SessionError::NotBuilt(why));
    }
    send(&mut writer, &Msg::Built)?;
    match recv(&mut reader)? {
        Msg::Switch => {}
        m => return Err(SessionError::NoSwitch(m.name())),
    }
    ram.serve(reader, writer)?;
    Ok(ram)
}

/// `data_pages` before the source has said how many pages will come.
const NOT_LISTED: u64 = u64::MAX;

pub use dsm_host::failure::FailureHook;
use dsm_host::failure::FailureSlot;

/// Counters of the page traffic.
#[derive(Debug, Default)]
pub struct PostCopyStats {
    /// Faults read from userfaultfd.
    pub faults: AtomicU64,
    /// Pages asked of the source.
    pub asked: AtomicU64,
    /// Pages the source sent that were installed here.
    pub installed: AtomicU64,
    /// Pages a pre-copy sent before the switch, counting each time a page came again.
    pub precopied: AtomicU64,
}

/// Guest RAM filled from the migration's source: see the module comment.
pub struct PostCopyRam {
    mem: Memory,
    layout: RamLayout,
    opts: Options,
    stats: PostCopyStats,
    data_pages: AtomicU64,
    /// `Done` came: every page is in.
    held: AtomicBool,
    /// The memory has left userfaultfd.
    released: AtomicBool,
    /// The VM no longer runs.
    stopped: AtomicBool,
    writer: OnceLock<Mutex<LinkWriter>>,
    failure: FailureSlot,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for PostCopyRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PostCopyRam({} bytes)", self.mem.len())
    }
}

impl PostCopyRam {
    /// Maps RAM for `layout`, every page absent.
    pub fn new(layout: RamLayout, opts: Options) -> Result<Arc<PostCopyRam>, MemoryError> {
        let mem = Memory::new(0, layout.bytes() as usize)?;
        Ok(Arc::new(PostCopyRam {
            mem,
            layout,
            opts,
            stats: PostCopyStats::default(),
            data_pages: AtomicU64::new(NOT_LISTED),
            held: AtomicBool::new(false),
            released: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            writer: OnceLock::new(),
            failure: FailureSlot::default(),
            threads: Mutex::new(Vec::new()),
        }))
    }

    pub fn host_addr(&self) -> *mut u8 {
        self.mem.host_addr()
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    pub fn stats(&self) -> &PostCopyStats {
        &self.stats
    }

    /// Whether every page has arrived (the memory is then ordinary memory).
    pub fn all_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The run's `migration` metrics.
    pub fn to_metrics(&self) -> musubi_types::MigrationPaging {
        musubi_types::MigrationPaging {
            faults: self.stats.faults.load(Ordering::Relaxed),
            asked: self.stats.asked.load(Ordering::Relaxed),
            installed: self.stats.installed.load(Ordering::Relaxed),
            precopied: self.stats.precopied.load(Ordering::Relaxed),
            data_pages: self.listed(),
            all_held: self.all_held(),
        }
    }

    /// Called once with the reason when the VM cannot go on. A failure that came before is
    /// handed over at once.
    pub fn on_failure(&self, hook: FailureHook) {
        self.failure.set(hook);
    }

    fn fail(&self, why: String) {
        if self.stopped.load(Ordering::Acquire) {
            return;
        }
        self.failure.fail(why);
    }

    /// How many pages the source listed as holding data; `None` before it has.
    fn listed(&self) -> Option<u64> {
        let listed = self.data_pages.load(Ordering::Relaxed);
        (listed != NOT_LISTED).then_some(listed)
    }

    fn send(&self, m: &Envelope) -> Result<(), SendError> {
        match self.writer.get() {
            Some(w) => Ok(w.lock().unwrap_or_else(|e| e.into_inner()).send(m)?),
            None => Err(SendError::NoLink),
        }
    }

    fn unregister(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.mem.release() {
                tracing::warn!("taking migrated guest RAM out of userfaultfd: {e}");
            }
        }
    }

    /// Takes a page sent before the switch, when nothing but this thread touches the RAM:
    /// the first copy of a page is installed, a later one overwrites it.
    fn precopy(&self, page: u64, data: &[u8; PAGE_SIZE]) -> Result<(), MemoryError> {
        if self.mem.install(page, data, true)? {
            self.stats.installed.fetch_add(1, Ordering::Relaxed);
        } else {
            // SAFETY: before the switch no vCPU runs and no device works on this RAM, so
            // nothing else reads or writes the page, which is present (just refused as
            // such by UFFDIO_COPY).
            unsafe { self.mem.write_present(page, data) }?;
        }
        self.stats.precopied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Starts the threads that bring the pages in over the link.
    fn serve(
        self: &Arc<Self>,
        mut reader: LinkReader,
        writer: LinkWriter,
    ) -> Result<(), ServeError> {
        reader
            .limit_silence(self.opts.silence)
            .and_then(|()| writer.limit_stall(self.opts.silence))?;
        let _ = self.writer.set(Mutex::new(writer));
        let mut threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        let me = self.clone();
        threads.push(
            std::thread::Builder::new()
                .name("migration-faults".into())
                .spawn(move || me.serve_faults())?,
        );
        let me = self.clone();
        threads.push(
            std::thread::Builder::new()
                .name("migration-pages".into())
                .spawn(move || me.take_pages(reader))?,
        );
        Ok(())
    }

    /// Asks the source for each faulting page, once; proves this side lives meanwhile.
    fn serve_faults(&self) {
        let mut asked = vec![false; self.layout.pages() as usize];
        let mut beat = 0u64;
        let mut last = Instant::now();
        while !self.held.load(Ordering::Acquire) && !self.stopped.load(Ordering::Acquire) {
            match self.mem.next_fault(Some(Duration::from_millis(100))) {
                Ok(Some(f)) => {
                    self.stats.faults.fetch_add(1, Ordering::Relaxed);
                    let Some(a) = asked.get_mut(f.page as usize) else {
                        continue;
                    };
                    if !*a {
                        *a = true;
                        self.stats.asked.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.send(&Envelope::Migration(Msg::Want(f.page).encode()))
                        {
                            return self.lost(e);
                        }
                        last = Instant::now();
                    }
                }
                Ok(None) => {}
                Err(e) => return self.fail(format!("migrated guest RAM: {e}")),
            }
            if last.elapsed() >= self.opts.heartbeat {
                beat += 1;
                if let Err(e) = self.send(&Envelope::Heartbeat { seq: beat }) {
                    return self.lost(e);
                }
                last = Instant::now();
            }
        }
    }

    fn lost(&self, why: impl std::fmt::Display) {
        if self.held.load(Ordering::Acquire) {
            return;
        }
        let installed = self.stats.installed.load(Ordering::Relaxed);
        // Asked pages may be zeros, so the count that came is not subtracted from the list.
        let missing = match self.listed() {
            Some(n) => {
                format!("{n} pages listed with data, {installed} came (asked for or pushed)")
            }
            None => format!("the source had not yet listed the pages with data, {installed} came"),
        };
        self.fail(format!(
            "the migration's source was lost before every page came ({why}): {missing}; the \
             VM cannot go on"
        ));
    }

    /// Installs every page the source sends until it has sent them all.
    fn take_pages(&self, mut reader: LinkReader) {
        loop {
            let m = match recv(&mut reader) {
                Ok(m) => m,
                Err(e) => return self.lost(e),
            };
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            match m {
                Msg::Page { page, data } => {
                    let data: &[u8; PAGE_SIZE] = &data;
                    match self.mem.install(page, data, true) {
                        Ok(true) => {
                            self.stats.installed.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(false) => {}
                        Err(e) => return self.fail(format!("migrated guest RAM: {e}")),
                    }
                    if let Err(e) = self.mem.wake(page) {
                        return self.fail(format!("migrated guest RAM: {e}"));
                    }
                }
                Msg::Listed { data_pages } => {
                    self.data_pages.store(data_pages, Ordering::Relaxed);
                }
                Msg::Done { .. } => {
                    // Every page with data is in; the others are zeros, as absent anonymous
                    // memory reads once out of userfaultfd.
                    self.unregister();
                    self.held.store(true, Ordering::Release);
                    if let Err(e) = self.send(&Envelope::Migration(Msg::AllHeld.encode())) {
                        tracing::warn!("telling the migration's source all pages came: {e}");
                    }
                    return;
                }
                m => return self.lost(ProtocolError::Unexpected(m.name())),
            }
        }
    }

    /// Once no guest code runs any more: tells the source (if pages were still coming) that
    /// the VM has ended, takes the memory out of userfaultfd and stops the threads.
    pub fn release(&self) {
        self.stopped.store(true, Ordering::Release);
        if !self.all_held() && self.writer.get().is_some() {
            let _ = self.send(&Envelope::Migration(Msg::Ended.encode()));
        }
        self.unregister();
        if let Some(w) = self.writer.get() {
            w.lock().unwrap_or_else(|e| e.into_inner()).shutdown();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for PostCopyRam {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
        self.unregister();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{migrate, SourceError};
    use crate::testing::{FakeVm, RANGES};

    #[derive(Default)]
    struct FakeHost {
        refuse: Option<String>,
        fail_apply: Option<String>,
        state_len: usize,
    }

    impl Host for FakeHost {
        fn check(&mut self, config: &[u8]) -> Result<Vec<(u64, u64)>, VmFault> {
            assert_eq!(config, b"the config");
            self.refuse
                .clone()
                .map_or(Ok(RANGES.to_vec()), |why| Err(why.into()))
        }
        fn build(&mut self, _ram: &Arc<PostCopyRam>) -> Result<(), VmFault> {
            Ok(())
        }
        fn apply(&mut self, state: &[u8]) -> Result<(), VmFault> {
            self.state_len = state.len();
            self.fail_apply
                .clone()
                .map_or(Ok(()), |why| Err(why.into()))
        }
    }

    fn opts(secret: &[u8]) -> Options {
        let mut o = Options::new(secret.to_vec());
        o.heartbeat = Duration::from_millis(100);
        o
    }

    /// Runs the destination on its own thread until it has a VM or has logged `refusals`
    /// refusals; returns what it logged and the RAM if one came.
    fn destination(
        listener: TcpListener,
        secret: &'static [u8],
        host: FakeHost,
        refusals: usize,
    ) -> std::thread::JoinHandle<(Vec<String>, Option<Arc<PostCopyRam>>, FakeHost)> {
        std::thread::spawn(move || {
            let mut host = host;
            let logs = Arc::new(Mutex::new(Vec::new()));
            let seen = logs.clone();
            let mut stop =
                move || (seen.lock().unwrap().len() >= refusals).then(|| "enough".to_string());
            let l2 = logs.clone();
            let mut log = move |m: &str| l2.lock().unwrap().push(m.to_string());
            let r = receive(&listener, &opts(secret), &mut host, &mut stop, &mut log);
            let logs = logs.lock().unwrap().clone();
            (logs, r.ok(), host)
        })
    }

    /// Migrates `vm` to `addr` with `o` from a thread of its own.
    fn source(
        vm: &Arc<FakeVm>,
        addr: String,
        o: Options,
    ) -> std::thread::JoinHandle<Result<crate::source::SourceReport, SourceError>> {
        let vm = vm.clone();
        std::thread::spawn(move || migrate(&*vm, &addr, &o))
    }

    fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    }

    #[test]
    fn a_vm_moves_and_every_page_follows_asked_for_or_pushed() {
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), usize::MAX);
        let vm = Arc::new(FakeVm::new());
        let src = source(&vm, addr, opts(b"0123456789abcdef"));
        let (logs, ram, host) = dest.join().unwrap();
        let ram = ram.unwrap_or_else(|| panic!("no VM came: {logs:?}"));
        assert_eq!(host.state_len, 40_000);
        // Touch every page as a guest would: data pages and zero pages alike.
        for p in (0..96).rev() {
            // SAFETY: reads inside the mapping, served by the fault thread.
            let b = unsafe { *ram.host_addr().add(p * 4096 + 17) };
            let want = if p % 3 == 0 { p as u8 + 1 } else { 0 };
            assert_eq!(b, want, "page {p}");
        }
        let report = src.join().unwrap().unwrap();
        assert!(vm.captured.load(Ordering::SeqCst));
        assert_eq!(vm.resumed.load(Ordering::SeqCst), 0);
        assert_eq!(report.data_pages, 32);
        assert!(report.pages_asked + report.pages_pushed >= 32, "{report:?}");
        assert!(!report.ended_there);
        assert!(ram.all_held());
        ram.release();
    }

    #[test]
    fn a_wrong_secret_is_refused_before_anything_is_paused() {
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), 1);
        let vm = FakeVm::new();
        let e = migrate(&vm, &addr, &opts(b"fedcba9876543210")).unwrap_err();
        assert!(matches!(e, SourceError::Before(_)), "{e}");
        assert!(e.to_string().contains("authentication"), "{e}");
        assert!(!vm.captured.load(Ordering::SeqCst));
        let (logs, ram, _) = dest.join().unwrap();
        assert!(ram.is_none());
        assert!(logs[0].contains("authentication"), "{logs:?}");
    }

    #[test]
    fn a_vm_the_destination_cannot_host_is_refused_with_its_reason() {
        let (l, addr) = listener();
        let host = FakeHost {
            refuse: Some("--disk /gone: no such file".into()),
            ..FakeHost::default()
        };
        let dest = destination(l, b"0123456789abcdef", host, 1);
        let vm = FakeVm::new();
        let e = migrate(&vm, &addr, &opts(b"0123456789abcdef")).unwrap_err();
        assert!(e.to_string().contains("/gone: no such file"), "{e}");
        assert!(e.to_string().contains("runs on here"), "{e}");
        assert!(!vm.captured.load(Ordering::SeqCst));
        dest.join().unwrap();
    }

    #[test]
    fn nobody_listening_is_named() {
        let (l, addr) = listener();
        drop(l);
        let vm = FakeVm::new();
        let e = migrate(&vm, &addr, &opts(b"0123456789abcdef")).unwrap_err();
        assert!(e.to_string().contains(&addr), "{e}");
        assert!(!vm.captured.load(Ordering::SeqCst));
    }

    #[test]
    fn a_source_lost_after_the_switch_ends_the_vm_on_both_sides_counting_the_pages() {
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), usize::MAX);
        let vm = Arc::new(FakeVm {
            end_on_capture: true,
            ..FakeVm::new()
        });
        let src = source(&vm, addr, opts(b"0123456789abcdef"));
        let e = src.join().unwrap().unwrap_err();
        assert!(matches!(e, SourceError::After(_)), "{e}");
        // The VM ends here right after the switch, before or after the pages with data
        // were listed (they are listed beside the switch): either way none was sent.
        let e = e.to_string();
        assert!(
            e.contains("32 of 32 pages") || e.contains("not yet listed, none pushed"),
            "{e}"
        );
        let (logs, ram, _) = dest.join().unwrap();
        let ram = ram.unwrap_or_else(|| panic!("no VM came: {logs:?}"));
        let (tx, rx) = std::sync::mpsc::channel();
        ram.on_failure(Box::new(move |why| {
            let _ = tx.send(why);
        }));
        let why = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(
            why.contains("32 pages listed with data, 0 came")
                || why.contains("had not yet listed the pages with data"),
            "{why}"
        );
        assert!(!ram.all_held());
        ram.release();
    }

    fn precopy(downtime: Duration, max_rounds: u32) -> Options {
        let mut o = opts(b"0123456789abcdef");
        o.mode = crate::Mode::PreCopy {
            downtime,
            max_rounds,
        };
        o
    }

    #[test]
    fn a_precopy_sends_every_page_before_the_switch_and_the_last_written_copy_wins() {
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), usize::MAX);
        let vm = Arc::new(FakeVm {
            busy_pages: vec![1, 4],
            last: Some(7),
            ..FakeVm::new()
        });
        // A downtime of zero is never met: the rounds run out.
        let src = source(&vm, addr, precopy(Duration::ZERO, 3));
        let (logs, ram, _) = dest.join().unwrap();
        let ram = ram.unwrap_or_else(|| panic!("no VM came: {logs:?}"));
        let report = src.join().unwrap().unwrap();
        assert_eq!(
            report.precopy,
            Some(crate::source::PreCopyReport {
                rounds: 3,
                // 32 pages with data, then pages 1 and 4 written again during rounds 1 and 2.
                pages_live: 36,
                // Written during round 3 (1 and 4) and at the pause (7).
                pages_paused: 3,
                converged: false,
            })
        );
        assert_eq!((report.data_pages, report.pages_pushed), (0, 0));
        let want = vm.ram.lock().unwrap().clone();
        for p in 0..96usize {
            // SAFETY: reads inside the mapping; a page never sent is served as zeros.
            let b = unsafe { *ram.host_addr().add(p * 4096 + 17) };
            assert_eq!(b, want[p * 4096 + 17], "page {p}");
        }
        assert_eq!(
            want[4096], 3,
            "page 1 was written before each of three looks"
        );
        assert_eq!(want[7 * 4096], 0xee);
        assert_eq!(ram.stats().precopied.load(Ordering::Relaxed), 39);
        // 32 pages with data and 1, 4 and 7, once each.
        assert_eq!(ram.stats().installed.load(Ordering::Relaxed), 35);
        assert!(ram.all_held());
        ram.release();
    }

    #[test]
    fn a_precopy_stops_its_rounds_once_what_is_left_fits_the_downtime() {
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), usize::MAX);
        let vm = Arc::new(FakeVm {
            busy_pages: vec![1],
            ..FakeVm::new()
        });
        let src = source(&vm, addr, precopy(Duration::from_secs(60), 9));
        let (_, ram, _) = dest.join().unwrap();
        let report = src.join().unwrap().unwrap();
        let pre = report.precopy.unwrap();
        assert_eq!((pre.rounds, pre.pages_live, pre.pages_paused), (1, 32, 1));
        assert!(pre.converged);
        ram.unwrap().release();
    }

    #[test]
    fn a_precopy_that_fails_before_the_switch_resumes_the_vm_and_stops_the_log() {
        let (l, addr) = listener();
        let host = FakeHost {
            fail_apply: Some("the state names a device this build lacks".into()),
            ..FakeHost::default()
        };
        let dest = destination(l, b"0123456789abcdef", host, 1);
        let vm = FakeVm {
            busy_pages: vec![1],
            ..FakeVm::new()
        };
        let e = migrate(&vm, &addr, &precopy(Duration::ZERO, 2)).unwrap_err();
        assert!(matches!(e, SourceError::Before(_)), "{e}");
        assert!(e.to_string().contains("device this build lacks"), "{e}");
        assert_eq!(vm.resumed.load(Ordering::SeqCst), 1);
        assert!(!vm.logging.load(Ordering::SeqCst), "dirty logging left on");
        dest.join().unwrap();
    }

    #[test]
    fn a_push_limit_holds_back_the_push_but_never_an_asked_page() {
        // One page a second: pushing the 32 pages with data would take half a minute, but
        // every page the destination touches is asked for and served at once.
        let (l, addr) = listener();
        let dest = destination(l, b"0123456789abcdef", FakeHost::default(), usize::MAX);
        let vm = Arc::new(FakeVm::new());
        let mut o = opts(b"0123456789abcdef");
        o.push_limit = Some(4096);
        let src = source(&vm, addr, o);
        let (logs, ram, _) = dest.join().unwrap();
        let ram = ram.unwrap_or_else(|| panic!("no VM came: {logs:?}"));
        for p in 0..96 {
            // SAFETY: reads inside the mapping, served by the fault thread.
            let b = unsafe { *ram.host_addr().add(p * 4096 + 5) };
            assert_eq!(b, if p % 3 == 0 { p as u8 + 1 } else { 0 }, "page {p}");
        }
        let report = src.join().unwrap().unwrap();
        assert!(
            report.pages_pushed < 16,
            "the push was not held back: {report:?}"
        );
        assert!(report.pages_asked >= 32 - report.pages_pushed, "{report:?}");
        ram.release();
    }
}
