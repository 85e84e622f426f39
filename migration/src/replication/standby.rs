//! The standby's loop: waits for a primary that proves the secret (strangers are refused
//! and logged, the wait goes on), has the [`Host`] build the VM from its configuration on a
//! [`ReplicaRam`], and stores epochs until the primary is lost; then the VM gets the state
//! of the last whole epoch and is the caller's to start.
//!
//! An epoch's pages are held aside until its `Commit` has come and only then written into
//! guest RAM, so a primary lost halfway through an epoch leaves the one before intact. The
//! first epoch is the exception: before it, nothing could be started anyway, so its pages
//! go straight into RAM, and a primary lost during it sends the standby back to waiting.
//!
//! Disks: the standby keeps its own copy of each, checked against the primary's checksums
//! before it answers `Standing`. An epoch's disk writes are held in memory with its pages
//! (as many as the primary's journal bound, or what it read past that) and written on the
//! copies at `Commit`, which are made durable before the `Acked`.
//!
//! Output: the frames an epoch carries (what the primary's network devices held during
//! it) are kept with it; at its `Commit` they replace the last whole epoch's, and the
//! primary's `Released` for the epoch drops them. A standby that takes over from an epoch
//! whose frames were not released hands them to its VM to send before it runs: the
//! primary may have died holding them, and the state resumed from has already sent them.
//!
//! Memory-storage files likewise: the standby's copies are checked against the primary's
//! checksums, and an epoch's pages of them (the first epoch's too) are held until its
//! `Commit`, then written into the files and synced before the `Acked`.

use super::DEFAULT_HEARTBEAT;
use crate::destination::Host;
use crate::protocol::{decode_frames, Blob, Frames, FramesError, Msg, RamLayout, RamLayoutError};
use crate::{recv, recv_blob, send, Options, ProtocolError, ReceiveError, VmFault};
use dsm::PAGE_SIZE;
use dsm_host::{Link, LinkError};
use std::fs::File;
use std::net::TcpListener;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How the standby ended its wait.
#[derive(Debug)]
pub enum Standby {
    /// The primary was lost: the VM holds the state and RAM of epoch `epoch`, the last
    /// whole one, and is ready to start.
    TakeOver {
        ram: Arc<ReplicaRam>,
        epoch: u64,
        /// Why the primary counts as lost.
        why: String,
        /// The frames epoch `epoch` carried, if the primary did not say it had written
        /// them: the VM sends them before it runs.
        unreleased: Frames,
    },
    /// The primary's VM ended (and said so): there is nothing to take over.
    PrimaryEnded { epochs: u64 },
}

/// Why one primary's session ended without a VM to take over (the wait goes on).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The reason, also sent to the primary as text.
    #[error("refused the VM: {0}")]
    Refused(#[source] VmFault),
    #[error(transparent)]
    Layout(#[from] RamLayoutError),
    #[error("guest RAM for the standby: {0}")]
    Ram(#[source] vm_memory::mmap::MmapRegionError),
    #[error("lost before its first epoch was whole: {0}")]
    BeforeFirstEpoch(#[source] Box<Lost>),
    #[error("could not put the state of epoch {epoch} into the VM: {why}")]
    NotApplied {
        epoch: u64,
        #[source]
        why: VmFault,
    },
    /// The standby's copy of a disk failed while an epoch was written on it: it no longer
    /// holds a whole epoch, so there is nothing to take over.
    #[error(transparent)]
    Copy(DiskCopyError),
}

/// Which of the VM's files a standby's copy stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    Disk,
    /// A memory-storage file (`--pmem`).
    Pmem,
}

impl Kept {
    /// How the flag names the file at `path`.
    fn named(self, path: &std::path::Path) -> String {
        match self {
            Kept::Disk => format!("--disk {}", path.display()),
            Kept::Pmem => format!("--pmem file={}", path.display()),
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Kept::Disk => "disk",
            Kept::Pmem => "memory-storage file",
        }
    }

    /// The flag a standby gives for each copy.
    fn syntax(self) -> &'static str {
        match self {
            Kept::Disk => "--disk path=COPY",
            Kept::Pmem => "--pmem file=COPY",
        }
    }
}

/// Why a standby's copy of a disk or memory-storage file is not the primary's, or could
/// not be kept so.
#[derive(Debug, thiserror::Error)]
pub enum DiskCopyError {
    #[error(
        "the VM has {}s, but the primary sent a {got} message where their checksums were due",
        kind.noun()
    )]
    NoSums { kind: Kept, got: &'static str },
    #[error(
        "the VM has {primary} {}s, this standby was given {given} (a standby keeps its own \
         copy of each: {} for every one, in the primary's order)",
        kind.noun(),
        kind.syntax()
    )]
    Count {
        kind: Kept,
        primary: usize,
        given: usize,
    },
    #[error("{}: the standby's copy: {what}: {source}", kind.named(path))]
    Io {
        kind: Kept,
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error(
        "{}: the standby's copy is {given} bytes, the primary's {} {disk} is {primary} bytes; \
         a copy must be the same size",
        kind.named(path),
        kind.noun()
    )]
    Size {
        kind: Kept,
        path: PathBuf,
        disk: usize,
        given: u64,
        primary: u64,
    },
    #[error(
        "{}: the standby's copy differs from the primary's {} {disk} (CRC-32 {given:#010x} \
         here, {primary:#010x} there); start the standby on a copy of the primary's file",
        kind.named(path),
        kind.noun()
    )]
    Content {
        kind: Kept,
        path: PathBuf,
        disk: usize,
        given: u32,
        primary: u32,
    },
}

/// Why the primary counts as lost.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("page {page} is outside guest RAM ({pages} pages)")]
    PageOutside { page: u64, pages: u64 },
    #[error("epoch {epoch} closed with {pages} pages, {got} came")]
    Count { epoch: u64, pages: u64, got: u64 },
    #[error("epoch {got} closed where epoch {want} was due")]
    Order { want: u64, got: u64 },
    #[error("epoch {0} closed without the VM's state")]
    NoState(u64),
    #[error("the frames of epoch {epoch}: {why}")]
    Frames {
        epoch: u64,
        #[source]
        why: FramesError,
    },
    #[error(
        "released epoch {got}, which is not the last whole one ({})",
        .want.map_or("none yet".to_string(), |w| w.to_string())
    )]
    Released { want: Option<u64>, got: u64 },
    #[error("unexpected {0} message")]
    Unexpected(&'static str),
    #[error("a write to disk {disk}, of {disks}")]
    DiskOutside { disk: u32, disks: usize },
    #[error("a page at {offset:#x} of memory-storage region {region}, of {regions}")]
    PmemOutside {
        region: u32,
        offset: u64,
        regions: usize,
    },
    #[error(transparent)]
    Copy(DiskCopyError),
}

/// Waits on `listener` for a primary and keeps its VM until the primary is lost or its VM
/// ends. `heartbeat` is the longest silence of the primary before it counts as lost.
pub fn stand_by(
    listener: &TcpListener,
    opts: &Options,
    heartbeat: Duration,
    host: &mut dyn Host<ReplicaRam>,
    stop: &mut dyn FnMut() -> Option<String>,
    log: &mut dyn FnMut(&str),
) -> Result<Standby, ReceiveError> {
    let r = crate::serve_first(
        listener,
        opts,
        "the standby",
        (
            "replication",
            "refused or lost before the standby could take over",
        ),
        stop,
        log,
        &mut |link, stop| session(link, opts, heartbeat, host, stop),
    )?;
    match r {
        Session::Ended(s) => Ok(s),
        Session::Stopped(why) => Err(ReceiveError::Stopped(why)),
    }
}

/// How a session that did not fail ended.
enum Session {
    Ended(Standby),
    /// Asked to stop while standing by: the link is closed, the primary goes on alone.
    Stopped(String),
}

/// One primary that proved the secret, from its configuration to its loss or its VM's end.
fn session(
    link: Link,
    opts: &Options,
    heartbeat: Duration,
    host: &mut dyn Host<ReplicaRam>,
    stop: &mut dyn FnMut() -> Option<String>,
) -> Result<Session, SessionError> {
    let (mut reader, mut writer, config) = crate::recv_config(link, opts)?;
    let built = host.check(&config).and_then(|ranges| {
        let disks = copies(&mut reader, Kept::Disk, &host.disk_copies())?;
        let pmem = copies(&mut reader, Kept::Pmem, &host.pmem_copies())?;
        let ram = Arc::new(ReplicaRam::new(RamLayout::new(ranges)?)?);
        host.build(&ram)?;
        Ok((ram, disks, pmem))
    });
    let (ram, disks, pmem) = match built {
        Ok(r) => r,
        Err(why) => {
            let _ = send(&mut writer, &Msg::Refused(why.to_string()));
            return Err(SessionError::Refused(why));
        }
    };
    let heartbeat = if heartbeat.is_zero() {
        DEFAULT_HEARTBEAT
    } else {
        heartbeat
    };
    send(
        &mut writer,
        &Msg::Standing {
            heartbeat_ms: heartbeat.as_millis() as u64,
        },
    )?;
    let mut epochs = Epochs::new(&ram);
    epochs.disks = disks;
    epochs.pmem.files = pmem;
    let lost = loop {
        match epochs.next(&mut reader, &mut writer, stop) {
            Ok(Next::Whole) => {}
            Ok(Next::Ended) => {
                return Ok(Session::Ended(Standby::PrimaryEnded {
                    epochs: epochs.next,
                }))
            }
            Ok(Next::Stopped(why)) => {
                writer.shutdown();
                return Ok(Session::Stopped(why));
            }
            Err(Lost::Copy(e)) => {
                writer.shutdown();
                return Err(SessionError::Copy(e));
            }
            Err(e) => break e,
        }
        if epochs.next == 1 {
            // From the first whole epoch on, silence means the primary is lost.
            reader.limit_silence(heartbeat)?;
        }
    };
    writer.shutdown();
    let Some((epoch, state)) = epochs.whole.take() else {
        return Err(SessionError::BeforeFirstEpoch(Box::new(lost)));
    };
    host.apply(&state)
        .map_err(|why| SessionError::NotApplied { epoch, why })?;
    let unreleased = std::mem::take(&mut epochs.unreleased);
    Ok(Session::Ended(Standby::TakeOver {
        ram,
        epoch,
        why: lost.to_string(),
        unreleased,
    }))
}

/// What [`Epochs::next`] read to.
enum Next {
    Whole,
    Ended,
    Stopped(String),
}

/// The epochs as they arrive.
struct Epochs<'a> {
    ram: &'a ReplicaRam,
    /// The epoch due next.
    next: u64,
    /// The last whole epoch and its state.
    whole: Option<(u64, Vec<u8>)>,
    /// Pages of the epoch under way, once an epoch is whole.
    held: Vec<(u64, Box<[u8; PAGE_SIZE]>)>,
    /// Pages of the epoch under way.
    came: u64,
    state: Option<Vec<u8>>,
    /// The standby's copy of each disk, in `--disk` order.
    disks: Vec<(PathBuf, File)>,
    /// Disk writes of the epoch under way: (disk, offset, bytes), in the order sent.
    writes: Vec<(u32, u64, Vec<u8>)>,
    /// Frames of the epoch under way.
    frames: Frames,
    /// Frames of the last whole epoch, until the primary says it wrote them.
    unreleased: Frames,
    pmem: PmemCopies,
}

/// The standby's copy of each memory-storage file, and the pages of the epoch under way.
#[derive(Default)]
struct PmemCopies {
    /// In `--pmem` order.
    files: Vec<(PathBuf, File)>,
    /// (region, offset, page), in the order sent; a later page over an earlier one.
    held: Vec<(u32, u64, Box<[u8; PAGE_SIZE]>)>,
}

impl<'a> Epochs<'a> {
    fn new(ram: &'a ReplicaRam) -> Epochs<'a> {
        Epochs {
            ram,
            next: 0,
            whole: None,
            held: Vec::new(),
            came: 0,
            state: None,
            disks: Vec::new(),
            writes: Vec::new(),
            frames: Vec::new(),
            unreleased: Vec::new(),
            pmem: PmemCopies::default(),
        }
    }

    /// Reads until the next epoch is whole (stored and acknowledged) or the primary's VM has
    /// ended. `stop` is asked first: epochs come every few tens of milliseconds while the
    /// primary lives, which is often enough to notice a signal, and not a system call a page.
    fn next(
        &mut self,
        reader: &mut dsm_host::link::LinkReader,
        writer: &mut dsm_host::link::LinkWriter,
        stop: &mut dyn FnMut() -> Option<String>,
    ) -> Result<Next, Lost> {
        if let Some(why) = stop() {
            return Ok(Next::Stopped(why));
        }
        let pages = self.ram.layout.pages();
        loop {
            match recv(reader)? {
                Msg::Page { page, data } => {
                    if page >= pages {
                        return Err(Lost::PageOutside { page, pages });
                    }
                    if self.whole.is_none() {
                        self.ram.write(page, &data);
                    } else {
                        self.held.push((page, data));
                    }
                    self.came += 1;
                }
                Msg::DiskWrite { disk, offset, data } => {
                    if disk as usize >= self.disks.len() {
                        return Err(Lost::DiskOutside {
                            disk,
                            disks: self.disks.len(),
                        });
                    }
                    self.writes.push((disk, offset, data));
                }
                Msg::PmemPage {
                    region,
                    offset,
                    data,
                } => self.pmem.hold(region, offset, data)?,
                m @ Msg::Part(Blob::State, _) => {
                    self.state = Some(recv_blob(reader, Blob::State, m)?);
                }
                m @ Msg::Part(Blob::Frames, _) => {
                    let doc = recv_blob(reader, Blob::Frames, m)?;
                    let frames = decode_frames(&doc).map_err(|why| Lost::Frames {
                        epoch: self.next,
                        why,
                    })?;
                    self.frames.extend(frames);
                }
                Msg::Released(epoch) => match &self.whole {
                    Some((whole, _)) if *whole == epoch => self.unreleased.clear(),
                    whole => {
                        return Err(Lost::Released {
                            want: whole.as_ref().map(|w| w.0),
                            got: epoch,
                        })
                    }
                },
                Msg::Commit { epoch, pages } => {
                    if epoch != self.next {
                        return Err(Lost::Order {
                            want: self.next,
                            got: epoch,
                        });
                    }
                    if pages != self.came {
                        return Err(Lost::Count {
                            epoch,
                            pages,
                            got: self.came,
                        });
                    }
                    let state = self.state.take().ok_or(Lost::NoState(epoch))?;
                    for (page, data) in self.held.drain(..) {
                        self.ram.write(page, &data);
                    }
                    self.commit_disk_writes().map_err(Lost::Copy)?;
                    self.unreleased = std::mem::take(&mut self.frames);
                    self.pmem.commit().map_err(Lost::Copy)?;
                    self.whole = Some((epoch, state));
                    self.came = 0;
                    self.next += 1;
                    send(writer, &Msg::Acked(epoch))?;
                    return Ok(Next::Whole);
                }
                Msg::Ended => return Ok(Next::Ended),
                m => return Err(Lost::Unexpected(m.name())),
            }
        }
    }
}

impl Epochs<'_> {
    /// Writes the epoch's disk writes on the standby's copies and makes them durable, before
    /// the epoch is acknowledged (a guest's flush on the primary is covered by it too).
    fn commit_disk_writes(&mut self) -> Result<(), DiskCopyError> {
        write_durably(
            &self.disks,
            Kept::Disk,
            self.writes.drain(..),
            ("writing an epoch's writes", "syncing an epoch's writes"),
        )
    }
}

/// Opens the standby's copies of the VM's disks (or memory-storage files) and checks them
/// against the checksums the primary sends next (none come for a VM without them).
fn copies(
    reader: &mut dsm_host::link::LinkReader,
    kind: Kept,
    copies: &[PathBuf],
) -> Result<Vec<(PathBuf, File)>, VmFault> {
    if copies.is_empty() {
        return Ok(Vec::new());
    }
    let sums = match (kind, recv(reader)?) {
        (Kept::Disk, Msg::DiskSums(s)) | (Kept::Pmem, Msg::PmemSums(s)) => s,
        (_, m) => {
            return Err(DiskCopyError::NoSums {
                kind,
                got: m.name(),
            }
            .into())
        }
    };
    if sums.len() != copies.len() {
        return Err(DiskCopyError::Count {
            kind,
            primary: sums.len(),
            given: copies.len(),
        }
        .into());
    }
    let mut out = Vec::new();
    for (disk, (path, &(len, crc32))) in copies.iter().zip(&sums).enumerate() {
        let io = |what| {
            let path = path.clone();
            move |source| DiskCopyError::Io {
                kind,
                path,
                what,
                source,
            }
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io("opening it"))?;
        let here = vmm::FileSum::of(&file).map_err(io("reading it"))?;
        if here.len != len {
            return Err(DiskCopyError::Size {
                kind,
                path: path.clone(),
                disk,
                given: here.len,
                primary: len,
            }
            .into());
        }
        if here.crc32 != crc32 {
            return Err(DiskCopyError::Content {
                kind,
                path: path.clone(),
                disk,
                given: here.crc32,
                primary: crc32,
            }
            .into());
        }
        out.push((path.clone(), file));
    }
    Ok(out)
}

impl PmemCopies {
    /// Holds a page of the epoch under way until its `Commit` (the first epoch's too: a
    /// primary lost during it must leave the copies as they were checked).
    fn hold(&mut self, region: u32, offset: u64, data: Box<[u8; PAGE_SIZE]>) -> Result<(), Lost> {
        if region as usize >= self.files.len() || !offset.is_multiple_of(PAGE_SIZE as u64) {
            return Err(Lost::PmemOutside {
                region,
                offset,
                regions: self.files.len(),
            });
        }
        self.held.push((region, offset, data));
        Ok(())
    }

    /// Writes the epoch's pages on the standby's copies and makes them durable, before the
    /// epoch is acknowledged. The VM built on the copies maps them shared, so it sees the
    /// pages as written.
    fn commit(&mut self) -> Result<(), DiskCopyError> {
        write_durably(
            &self.files,
            Kept::Pmem,
            self.held
                .drain(..)
                .map(|(r, o, page)| (r, o, page as Box<[u8]>)),
            ("writing an epoch's pages", "syncing an epoch's pages"),
        )
    }
}

/// Writes each (file index, offset, bytes) of an epoch on the standby's copies, then syncs
/// every copy written, so that what the epoch carried is durable before it is acknowledged.
/// Indexes were checked against `files` when the items arrived.
fn write_durably<D: AsRef<[u8]>>(
    files: &[(PathBuf, File)],
    kind: Kept,
    items: impl Iterator<Item = (u32, u64, D)>,
    (writing, syncing): (&'static str, &'static str),
) -> Result<(), DiskCopyError> {
    let io = |path: &PathBuf, what, source| DiskCopyError::Io {
        kind,
        path: path.clone(),
        what,
        source,
    };
    let mut touched = vec![false; files.len()];
    for (index, offset, data) in items {
        let (path, file) = &files[index as usize];
        file.write_all_at(data.as_ref(), offset)
            .map_err(|e| io(path, writing, e))?;
        touched[index as usize] = true;
    }
    for ((path, file), _) in files.iter().zip(touched).filter(|(_, t)| *t) {
        file.sync_data().map_err(|e| io(path, syncing, e))?;
    }
    Ok(())
}

/// Guest RAM of the standby's VM: private anonymous memory the standby writes epochs into
/// while the VM does not run, and the VM's own RAM once it does. The layout's ranges lie one
/// after the other in it.
pub struct ReplicaRam {
    map: vm_memory::mmap::MmapRegion<()>,
    layout: RamLayout,
}

impl std::fmt::Debug for ReplicaRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicaRam({} bytes)", self.map.size())
    }
}

impl ReplicaRam {
    pub fn new(layout: RamLayout) -> Result<ReplicaRam, SessionError> {
        let map =
            vm_memory::mmap::MmapRegion::new(layout.bytes() as usize).map_err(SessionError::Ram)?;
        Ok(ReplicaRam { map, layout })
    }

    pub fn host_addr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.map.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// Stores a page of a whole epoch. Only the standby's loop calls it, before the VM
    /// built on this RAM has started, so no vCPU or device reads the page meanwhile.
    fn write(&self, page: u64, data: &[u8; PAGE_SIZE]) {
        let at = page as usize * PAGE_SIZE;
        assert!(
            at + PAGE_SIZE <= self.len(),
            "page {page} outside the mapping"
        );
        // SAFETY: `at..at + PAGE_SIZE` lies inside the mapping (checked above), which
        // lives as long as `self`; nothing else accesses it before the VM starts.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.host_addr().add(at), PAGE_SIZE)
        };
    }
}
