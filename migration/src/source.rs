//! The sending side: connects, proves the secret, has the destination accept the
//! configuration, pauses the VM and sends its state, and after the switch serves the pages
//! the destination asks for while it pushes every page that may hold data.
//!
//! Up to the switch the VM can go on here: every failure resumes it (if it was paused) and
//! is returned as [`SourceError::Before`]. After the switch the VM runs on the destination
//! and needs the pages still here, so a lost link is [`SourceError::After`]: the caller
//! ends its VM with that message.

use crate::protocol::{Blob, Msg, RamLayout, RamLayoutError};
use crate::{recv, send, send_blob, Mode, Options, ProtocolError, VmFault};
use dsm::PAGE_SIZE;
use dsm_host::link::{LinkReader, LinkWriter};
use dsm_host::{Envelope, Link, LinkError};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The VM being sent, as the source sees it.
pub trait SourceVm: Send + Sync {
    /// The configuration the destination builds the VM from (JSON).
    fn config(&self) -> Vec<u8>;
    /// Pauses the VM (if it runs) and returns its vCPU and device state (JSON).
    fn capture(&self) -> Result<Vec<u8>, VmFault>;
    /// [`SourceVm::capture`] for a replica's checkpoint, which may leave the guest's writes
    /// to its storage in the page cache: the standby gets them with the epoch, so writing
    /// them back at every checkpoint would only lengthen the pause.
    fn checkpoint(&self) -> Result<Vec<u8>, VmFault> {
        self.capture()
    }
    /// Ends a [`SourceVm::checkpoint`]: the VM goes on unless it was paused before it
    /// (`paused_before`), as its owner left it.
    fn end_checkpoint(&self, paused_before: bool) -> Result<(), VmFault> {
        match paused_before {
            true => Ok(()),
            false => self.resume(),
        }
    }
    /// Lets a VM paused by [`SourceVm::capture`] go on.
    fn resume(&self) -> Result<(), VmFault>;
    /// Whether the VM is paused (by its owner, through the API): a checkpoint of a paused
    /// VM must leave it paused.
    fn is_paused(&self) -> bool {
        false
    }
    /// Guest RAM's ranges (guest-physical start, length).
    fn ram_ranges(&self) -> Vec<(u64, u64)>;
    /// Guest-physical addresses of every page that may hold data; all others are zeros.
    fn pages_with_data(&self) -> Result<Vec<u64>, VmFault>;
    fn read_page(&self, gpa: u64, buf: &mut [u8; PAGE_SIZE]) -> Result<(), VmFault>;
    /// Whether the VM has ended here (a signal, a timeout): nothing more can be sent.
    fn has_ended(&self) -> bool;
    /// Starts tracking the pages written (by the guest or the VMM), for pre-copy.
    fn start_dirty_log(&self) -> Result<(), VmFault>;
    /// Guest-physical addresses of the pages written since tracking started or the last
    /// call.
    fn dirty_pages(&self) -> Result<Vec<u64>, VmFault>;
    /// Stops that tracking (a pre-copy that failed before the switch).
    fn stop_dirty_log(&self) -> Result<(), VmFault>;
    /// Replication: starts recording each disk's writes, and returns each image's length
    /// and CRC-32 as of that moment, in `--disk` order (none for a VM without disks).
    fn start_disk_journals(&self) -> Result<Vec<(u64, u32)>, VmFault> {
        Ok(Vec::new())
    }
    /// Stops that recording.
    fn stop_disk_journals(&self) {}
    /// Replication: each disk's writes sealed by the last [`SourceVm::capture`], in
    /// `--disk` order.
    fn take_disk_writes(&self) -> Vec<vmm::SealedWrites> {
        Vec::new()
    }
    /// Reads disk `disk` at `offset` (the writes of an epoch past the journal's bound).
    fn read_disk(&self, disk: usize, offset: u64, buf: &mut [u8]) -> Result<(), VmFault> {
        let _ = (offset, buf);
        Err(format!("no disk {disk}").into())
    }
    /// Replication: starts tracking the pages written in the memory-storage regions, and
    /// returns each file's length and CRC-32 as of that moment, in `--pmem` order (none
    /// for a VM without them).
    fn start_pmem_log(&self) -> Result<Vec<(u64, u32)>, VmFault> {
        Ok(Vec::new())
    }
    /// (region, offset) of each memory-storage page written since that start or the last
    /// call.
    fn pmem_dirty_pages(&self) -> Result<Vec<(u32, u64)>, VmFault> {
        Ok(Vec::new())
    }
    /// Stops that tracking.
    fn stop_pmem_log(&self) {}
    /// Reads the page at `offset` of memory-storage region `region`.
    fn read_pmem(
        &self,
        region: u32,
        offset: u64,
        buf: &mut [u8; PAGE_SIZE],
    ) -> Result<(), VmFault> {
        let _ = (offset, buf);
        Err(format!("no memory-storage region {region}").into())
    }
    /// Replication's output commit: from now on the frames the guest transmits are held,
    /// each with the checkpoint ([`SourceVm::capture`]) that follows it.
    fn hold_output(&self) {}
    /// Copies of the frames held for the last capture (and not for the one before), each
    /// with its network device's number, in the order sent: the primary ships them with
    /// the checkpoint.
    fn captured_output(&self) -> crate::protocol::Frames {
        Vec::new()
    }
    /// The frames held up to the last capture may go: the standby has that checkpoint.
    /// They are written before this returns (unless a backend is full).
    fn release_output(&self) {}
    /// Replication ended: everything held goes, and nothing more is held.
    fn open_output(&self) {}
}

/// What a migration that succeeded did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceReport {
    /// The destination, as given.
    pub to: String,
    /// Pages that may hold data when the VM was paused.
    pub data_pages: u64,
    /// Pages sent because the destination asked for them.
    pub pages_asked: u64,
    /// Pages sent by the background push.
    pub pages_pushed: u64,
    /// The VM ended on the destination before it held every page (no page is needed then).
    pub ended_there: bool,
    /// Pre-copy only: what was sent before the switch.
    pub precopy: Option<PreCopyReport>,
}

/// What the rounds of a pre-copy sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreCopyReport {
    /// Rounds while the VM ran: the first sends every page that may hold data, each later
    /// one the pages written during the one before.
    pub rounds: u32,
    /// Pages sent while the VM ran, over every round (a page written again is sent again).
    pub pages_live: u64,
    /// Pages written during the last round and since, sent while the VM was paused.
    pub pages_paused: u64,
    /// Whether what was left fitted the downtime target (otherwise the rounds ran out).
    pub converged: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The VM did not move and runs on here.
    #[error("{0}; the VM runs on here")]
    Before(#[source] Box<Unmoved>),
    /// The VM moved but pages it needs are still here and can no longer be sent: it is lost.
    #[error(transparent)]
    After(Box<Lost>),
}

/// Why a migration ended before the switch; each names the destination.
#[derive(Debug, thiserror::Error)]
pub enum Unmoved {
    #[error(transparent)]
    Dial(#[from] crate::DialError),
    #[error("migration to {to}: {why}")]
    Setup {
        to: String,
        #[source]
        why: SetupError,
    },
}

/// What failed between the handshake and the switch.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The destination's reason, as it sent it.
    #[error("the destination refused the VM: {0}")]
    Refused(String),
    /// The destination's reason, as it sent it.
    #[error("the destination could not build the VM: {0}")]
    NotBuilt(String),
    #[error("unexpected {0} message")]
    Unexpected(&'static str),
    #[error(transparent)]
    Layout(#[from] RamLayoutError),
    #[error("finding the pages with data: {0}")]
    DataPages(#[source] VmFault),
    #[error("pausing the VM and reading its state: {0}")]
    Capture(#[source] VmFault),
    /// Reading a page or the dirty log.
    #[error("{0}")]
    Vm(#[source] VmFault),
}

/// A migration lost after the switch, with what was sent of the pages.
#[derive(Debug, thiserror::Error)]
#[error(
    "migration to {to} lost after the switch ({why}): {left}, so the VM cannot go on \
     ({asked} sent on request, {pushed} pushed)"
)]
pub struct Lost {
    pub to: String,
    #[source]
    pub why: LostWhy,
    pub left: Unsent,
    pub asked: u64,
    pub pushed: u64,
}

/// Why the pages could no longer be sent after the switch.
#[derive(Debug, thiserror::Error)]
pub enum LostWhy {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("the VM ended here")]
    EndedHere,
    #[error("the thread listing the pages with data ended")]
    ListerEnded,
    #[error("the link's reader stopped")]
    ReaderStopped,
    #[error("unexpected {0} message")]
    Unexpected(&'static str),
    /// Listing or reading the pages.
    #[error("{0}")]
    Vm(#[source] VmFault),
}

/// The pages with data that never left, when a migration was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsent {
    Pages { unsent: usize, listed: usize },
    NotListed,
}

impl std::fmt::Display for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsent::Pages { unsent, listed } => {
                write!(f, "{unsent} of {listed} pages with data were never sent")
            }
            Unsent::NotListed => {
                f.write_str("the pages with data were not yet listed, none pushed")
            }
        }
    }
}

/// Moves `vm` to the destination listening at `to` (`HOST:PORT`).
pub fn migrate(vm: &dyn SourceVm, to: &str, opts: &Options) -> Result<SourceReport, SourceError> {
    let before = |e| SourceError::Before(Box::new(e));
    let link =
        crate::dial(to, "migration destination", opts).map_err(|e| before(Unmoved::Dial(e)))?;
    let Link {
        mut reader,
        mut writer,
        ..
    } = link;
    let setup = |why: SetupError| before(Unmoved::Setup { to: to.into(), why });
    reader
        .limit_silence(opts.setup_limit)
        .and_then(|()| writer.limit_stall(opts.setup_limit))
        .map_err(|e| setup(e.into()))?;

    send_blob(&mut writer, Blob::Config, &vm.config()).map_err(|e| setup(e.into()))?;
    match recv(&mut reader).map_err(|e| setup(e.into()))? {
        Msg::Ready => {}
        Msg::Refused(why) => return Err(setup(SetupError::Refused(why))),
        m => return Err(setup(SetupError::Unexpected(m.name()))),
    }

    let layout = RamLayout::new(vm.ram_ranges()).map_err(|e| setup(e.into()))?;
    let mut precopy = None;
    let mut leftover = Vec::new();
    if let Mode::PreCopy {
        downtime,
        max_rounds,
    } = opts.mode
    {
        match rounds(vm, &layout, &mut writer, downtime, max_rounds) {
            Ok((r, left)) => {
                precopy = Some(r);
                leftover = left;
            }
            Err(e) => {
                let _ = vm.stop_dirty_log();
                return Err(setup(e));
            }
        }
    }

    // From here the VM is paused; every way out before the switch resumes it.
    let pre_copied = precopy.is_some();
    let resume = |why: SetupError| {
        if pre_copied {
            let _ = vm.stop_dirty_log();
        }
        if let Err(r) = vm.resume() {
            tracing::warn!("resuming the VM after a failed migration: {r}");
        }
        setup(why)
    };
    let state = match vm.capture() {
        Ok(s) => s,
        Err(e) => return Err(resume(SetupError::Capture(e))),
    };
    if let Some(pre) = precopy.as_mut() {
        // The pages written during the last round and since, while the VM is paused.
        let last = vm.dirty_pages().map_err(SetupError::Vm).and_then(|mut d| {
            d.append(&mut leftover);
            d.sort_unstable();
            d.dedup();
            send_pages(vm, &layout, &mut writer, &d)
        });
        match last {
            Ok(n) => pre.pages_paused = n,
            Err(e) => return Err(resume(e)),
        }
    }
    let list = |layout: &RamLayout| -> Result<Vec<u64>, VmFault> {
        if pre_copied {
            // Every page with data is there already.
            return Ok(Vec::new());
        }
        let mut data: Vec<u64> = vm
            .pages_with_data()?
            .into_iter()
            .filter_map(|gpa| layout.page_of(gpa))
            .collect();
        data.sort_unstable();
        data.dedup();
        Ok(data)
    };
    // In post-copy, the pages that may hold data are listed while the state travels and the
    // VM starts on the other side: the page map of a 4 GiB guest takes milliseconds to read,
    // which would otherwise be part of the pause. The VM does not run here again, so the
    // list made now stays true.
    let r = std::thread::scope(|scope| {
        let (listed_tx, listed) = mpsc::channel();
        let layout_for_list = layout.clone();
        scope.spawn(move || {
            let _ = listed_tx.send(list(&layout_for_list));
        });
        switch_over(vm, to, opts, writer, reader, layout, &state, listed)
    });
    if r.is_err() && pre_copied {
        let _ = vm.stop_dirty_log();
    }
    r.map(|mut report| {
        report.precopy = precopy;
        report
    })
}

/// Sends the pages numbered by guest-physical address in `gpas` (those outside guest RAM
/// are skipped) while the VM may still write them; returns how many were sent.
fn send_pages(
    vm: &dyn SourceVm,
    layout: &RamLayout,
    writer: &mut LinkWriter,
    gpas: &[u64],
) -> Result<u64, SetupError> {
    let mut buf = Box::new([0u8; PAGE_SIZE]);
    let mut sent = 0;
    for &gpa in gpas {
        let Some(page) = layout.page_of(gpa) else {
            continue;
        };
        vm.read_page(gpa, &mut buf).map_err(SetupError::Vm)?;
        let m = Msg::Page {
            page,
            data: buf.clone(),
        };
        send(writer, &m)?;
        sent += 1;
    }
    Ok(sent)
}

/// Pre-copy's rounds while the VM runs: every page that may hold data, then again and again
/// the pages written meanwhile, until what is left would take at most `downtime` to send at
/// the rate of the round before, or `max_rounds` rounds have run. Returns the pages written
/// during the last round, which the pause sends.
fn rounds(
    vm: &dyn SourceVm,
    layout: &RamLayout,
    writer: &mut LinkWriter,
    downtime: Duration,
    max_rounds: u32,
) -> Result<(PreCopyReport, Vec<u64>), SetupError> {
    vm.start_dirty_log().map_err(SetupError::Vm)?;
    let mut report = PreCopyReport::default();
    let mut pages = vm.pages_with_data().map_err(SetupError::DataPages)?;
    loop {
        let started = Instant::now();
        let n = send_pages(vm, layout, writer, &pages)?;
        report.rounds += 1;
        report.pages_live += n;
        // Pages per second this round reached; a round too short to time counts as fast.
        let rate = n as f64 / started.elapsed().as_secs_f64().max(1e-6);
        pages = vm.dirty_pages().map_err(SetupError::Vm)?;
        let left = pages.len() as f64 / rate.max(1.0);
        if left <= downtime.as_secs_f64() {
            report.converged = true;
            break;
        }
        if report.rounds >= max_rounds.max(1) {
            break;
        }
    }
    Ok((report, pages))
}

/// Sends the paused VM's state, switches over once the destination has built it, and then
/// serves its pages; before the switch every failure resumes the VM here.
#[allow(clippy::too_many_arguments)]
fn switch_over(
    vm: &dyn SourceVm,
    to: &str,
    opts: &Options,
    mut writer: LinkWriter,
    mut reader: LinkReader,
    layout: RamLayout,
    state: &[u8],
    listed: mpsc::Receiver<Result<Vec<u64>, VmFault>>,
) -> Result<SourceReport, SourceError> {
    let setup =
        |why: SetupError| SourceError::Before(Box::new(Unmoved::Setup { to: to.into(), why }));
    let prepared = (|| {
        send_blob(&mut writer, Blob::State, state)?;
        match recv(&mut reader)? {
            Msg::Built => {}
            Msg::Failed(why) => return Err(SetupError::NotBuilt(why)),
            m => return Err(SetupError::Unexpected(m.name())),
        }
        send(&mut writer, &Msg::Switch)?;
        Ok(layout)
    })();
    let layout = match prepared {
        Ok(p) => p,
        Err(e) => {
            if let Err(r) = vm.resume() {
                tracing::warn!("resuming the VM after a failed migration: {r}");
            }
            return Err(setup(e));
        }
    };

    // The switch: the VM runs on the destination now.
    let r = after_switch(vm, to, opts, &mut writer, reader, &layout, listed);
    writer.shutdown();
    r
}

/// Serves and pushes pages until the destination holds them all.
fn after_switch(
    vm: &dyn SourceVm,
    to: &str,
    opts: &Options,
    writer: &mut LinkWriter,
    mut reader: LinkReader,
    layout: &RamLayout,
    listed: mpsc::Receiver<Result<Vec<u64>, VmFault>>,
) -> Result<SourceReport, SourceError> {
    let mut report = SourceReport {
        to: to.to_string(),
        ..SourceReport::default()
    };
    // The pages that may hold data, once listed (see `send`); asked pages are served before.
    let mut data: Option<Vec<u64>> = None;
    let lost = |report: &SourceReport, data: &Option<Vec<u64>>, sent: &[bool], why: LostWhy| {
        let left = match data {
            Some(d) => Unsent::Pages {
                unsent: d.iter().filter(|&&p| !sent[p as usize]).count(),
                listed: d.len(),
            },
            None => Unsent::NotListed,
        };
        SourceError::After(Box::new(Lost {
            to: to.into(),
            why,
            left,
            asked: report.pages_asked,
            pushed: report.pages_pushed,
        }))
    };
    let mut sent = vec![false; layout.pages() as usize];
    if let Err(e) = reader
        .limit_silence(opts.silence)
        .and_then(|()| writer.limit_stall(opts.silence))
    {
        return Err(lost(&report, &data, &sent, e.into()));
    }
    let (tx, rx) = mpsc::channel();
    let listener = std::thread::Builder::new()
        .name("migration-in".into())
        .spawn(move || loop {
            let m = recv(&mut reader);
            let last = !matches!(m, Ok(Msg::Want(_)));
            if tx.send(m).is_err() || last {
                return;
            }
        });
    if let Err(e) = listener {
        return Err(lost(&report, &data, &sent, LostWhy::Thread(e)));
    }

    let mut buf = Box::new([0u8; PAGE_SIZE]);
    let mut next = 0usize;
    let mut done = false;
    let mut beat = 0u64;
    let mut last_send = Instant::now();
    // The background push keeps under `push_limit` bytes per second from the switch on;
    // asked pages are never held back (a vCPU waits for each).
    let pushing_since = Instant::now();
    let over_limit = |pushed: u64| {
        opts.push_limit.is_some_and(|limit| {
            (pushed * PAGE_SIZE as u64) as f64
                > limit as f64 * pushing_since.elapsed().as_secs_f64()
        })
    };
    loop {
        if vm.has_ended() {
            return Err(lost(&report, &data, &sent, LostWhy::EndedHere));
        }
        if data.is_none() {
            match listed.try_recv() {
                Ok(Ok(d)) => {
                    report.data_pages = d.len() as u64;
                    let m = Msg::Listed {
                        data_pages: report.data_pages,
                    };
                    if let Err(e) = send(writer, &m) {
                        return Err(lost(&report, &data, &sent, e.into()));
                    }
                    data = Some(d);
                }
                Ok(Err(e)) => return Err(lost(&report, &data, &sent, LostWhy::Vm(e))),
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(lost(&report, &data, &sent, LostWhy::ListerEnded));
                }
            }
        }
        let event = if data.is_none() {
            // Only asked pages can be served yet: wait for one briefly, then look again.
            match rx.recv_timeout(std::time::Duration::from_millis(1)) {
                Ok(m) => Some(m.map_err(LostWhy::from)),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(LostWhy::ReaderStopped)),
            }
        } else if done || over_limit(report.pages_pushed) {
            let wait = if done {
                opts.heartbeat
            } else {
                std::time::Duration::from_millis(1)
            };
            match rx.recv_timeout(wait) {
                Ok(m) => Some(m.map_err(LostWhy::from)),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(LostWhy::ReaderStopped)),
            }
        } else {
            rx.try_recv().ok().map(|m| m.map_err(LostWhy::from))
        };
        let page = match event {
            Some(Ok(Msg::Want(p))) if (p as usize) < sent.len() => {
                if sent[p as usize] {
                    // Already on its way: the link keeps order.
                    continue;
                }
                report.pages_asked += 1;
                Some(p)
            }
            Some(Ok(Msg::AllHeld)) => return Ok(report),
            Some(Ok(Msg::Ended)) => {
                report.ended_there = true;
                return Ok(report);
            }
            Some(Ok(m)) => return Err(lost(&report, &data, &sent, LostWhy::Unexpected(m.name()))),
            Some(Err(e)) => return Err(lost(&report, &data, &sent, e)),
            None if done || over_limit(report.pages_pushed) => None,
            None => {
                let Some(list) = data.as_deref() else {
                    continue;
                };
                while next < list.len() && sent[list[next] as usize] {
                    next += 1;
                }
                match list.get(next) {
                    Some(&p) => {
                        report.pages_pushed += 1;
                        Some(p)
                    }
                    None => {
                        done = true;
                        let m = Msg::Done {
                            pushed: report.pages_pushed,
                        };
                        if let Err(e) = send(writer, &m) {
                            return Err(lost(&report, &data, &sent, e.into()));
                        }
                        last_send = Instant::now();
                        None
                    }
                }
            }
        };
        if let Some(p) = page {
            let gpa = layout.gpa_of(p).expect("page numbers come from the layout");
            if let Err(e) = vm.read_page(gpa, &mut buf) {
                return Err(lost(&report, &data, &sent, LostWhy::Vm(e)));
            }
            let m = Msg::Page {
                page: p,
                data: buf.clone(),
            };
            if let Err(e) = send(writer, &m) {
                return Err(lost(&report, &data, &sent, e.into()));
            }
            sent[p as usize] = true;
            last_send = Instant::now();
        } else if last_send.elapsed() >= opts.heartbeat {
            beat += 1;
            if let Err(e) = writer.send(&Envelope::Heartbeat { seq: beat }) {
                return Err(lost(&report, &data, &sent, e.into()));
            }
            last_send = Instant::now();
        }
    }
}
