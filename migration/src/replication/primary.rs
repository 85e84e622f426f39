//! The primary's loop: connects to the standby, has it build the VM, sends the first epoch
//! (every page with data) while the VM runs, then checkpoints every epoch until the VM ends
//! (the standby is told, and does not take over) or the standby is lost (the VM goes on
//! alone).
//!
//! Memory stays bounded: one epoch is in flight at a time (the next checkpoint waits for
//! the last one's acknowledgement, so a slow link makes epochs longer), and its copy holds
//! at most `copy_limit` bytes of pages; pages written beyond that are sent straight from
//! guest RAM before the vCPUs resume, which lengthens that pause instead.
//!
//! Disks: before the standby answers, the primary starts each disk's write journal and
//! sends the images' checksums (the VM paused meanwhile, so no write falls between). Each
//! capture seals the journals; a journal within its bound goes out after the VM resumes,
//! one past it is read from the image and sent before it resumes (see
//! `devices::virtio::journal`), so the pause grows rather than memory.
//!
//! Output: the frames the network devices held for an epoch go with it, copied after the
//! VM resumes (sealed, they no longer change), before its `Commit`. Once the standby
//! acknowledges the epoch they are written to the TAPs, and the standby is told
//! (`Released`): until then a standby taking over sends them itself, so a primary that
//! dies between the acknowledgement and its writes loses nothing. Only a primary that
//! dies between its writes and queuing `Released` (microseconds) leaves them to be sent
//! twice.
//!
//! Memory-storage files: right after the disks, the primary turns on the dirty log of their
//! regions and sends the files' checksums (paused again). Each checkpoint copies the regions'
//! pages written since the last after the RAM pages, in the same copy and bound.

use super::ReplicationStats;
use crate::protocol::{
    encode_frames, Blob, Frames, Msg, RamLayout, RamLayoutError, DISK_WRITE_BYTES,
};
use crate::source::SourceVm;
use crate::{recv, send, send_blob, DialError, Options, ProtocolError, VmFault};
use dsm::PAGE_SIZE;
use dsm_host::link::{LinkReader, LinkWriter};
use dsm_host::{Envelope, Link, LinkError};
use musubi_types::ReplicationState;
use std::time::{Duration, Instant};
use vmm::SealedWrites;

/// Largest copy of one epoch's pages by default.
pub const DEFAULT_COPY_LIMIT: usize = 64 << 20;

/// How the primary checkpoints.
#[derive(Clone, Copy, Debug)]
pub struct Epochs {
    /// Time from one checkpoint to the next, at least.
    pub every: Duration,
    /// Most bytes of pages copied while the vCPUs are paused.
    pub copy_limit: usize,
}

impl Default for Epochs {
    fn default() -> Epochs {
        Epochs {
            every: super::DEFAULT_EPOCH,
            copy_limit: DEFAULT_COPY_LIMIT,
        }
    }
}

/// An epoch's journaled disk writes, held while the VM resumes: each disk's number and its
/// (offset, bytes) writes in order.
type HeldWrites = Vec<(u32, Vec<(u64, Vec<u8>)>)>;

/// Why replication ended before the VM did; the VM runs on alone either way.
#[derive(Debug, thiserror::Error)]
pub enum PrimaryError {
    #[error("replication to {to}: no standby ({why})")]
    NotStarted {
        to: String,
        #[source]
        why: Box<NotStarted>,
    },
    #[error("replication to {to}: the standby was lost after {acked} acknowledged epochs ({why})")]
    Lost {
        to: String,
        acked: u64,
        #[source]
        why: Box<LostWhy>,
    },
}

/// What failed before the standby had the VM built.
#[derive(Debug, thiserror::Error)]
pub enum NotStarted {
    #[error(transparent)]
    Dial(#[from] Box<DialError>),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The standby's reason, as it sent it.
    #[error("the standby refused the VM: {0}")]
    Refused(String),
    #[error("expected the standby's answer, got a {0} message")]
    Unexpected(&'static str),
    #[error(transparent)]
    Layout(#[from] RamLayoutError),
    #[error("recording the disks' writes: {0}")]
    Disks(#[source] VmFault),
    #[error("tracking the memory-storage files' pages: {0}")]
    Pmem(#[source] VmFault),
}

/// Why epochs could no longer be sent.
#[derive(Debug, thiserror::Error)]
pub enum LostWhy {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("expected the acknowledgement of epoch {want}, got {got}")]
    Ack { want: u64, got: String },
    /// Pausing, reading the state, the dirty log or a page.
    #[error("{0}")]
    Vm(#[source] VmFault),
    #[error("reading disk {disk} at {offset}: {why}")]
    Disk {
        disk: usize,
        offset: u64,
        #[source]
        why: VmFault,
    },
}

/// The link and what the loop keeps between epochs.
struct Primary<'a> {
    vm: &'a dyn SourceVm,
    layout: RamLayout,
    reader: LinkReader,
    writer: LinkWriter,
    /// How often to prove this side lives when there is nothing else to send.
    beat: Duration,
    beats: u64,
    last_send: Instant,
    /// The copy of an epoch's pages, kept between epochs (at most `copy_limit` bytes).
    copy: Vec<u8>,
    /// Epochs the standby acknowledged.
    acked: u64,
    /// Bytes of disk writes and memory-storage pages the epoch under way carried.
    disk_bytes: u64,
    /// The memory-storage pages of the epoch's copy.
    pmem: PmemCopy,
}

/// The memory-storage pages copied at a checkpoint: they follow the RAM pages in
/// `Primary::copy`, from byte `at` on, one page each of `pages` (region, offset).
#[derive(Default)]
struct PmemCopy {
    at: usize,
    pages: Vec<(u32, u64)>,
}

/// Replicates `vm` to the standby at `to` (`HOST:PORT`) until the VM ends (`Ok`, the
/// standby told) or replication cannot go on; counts in `stats`. The held output is let go
/// at the end, except when the standby is lost under `--replicate-policy stop`
/// (`stats`' policy): the caller pauses the VM then, and opens the output
/// ([`SourceVm::open_output`]) once its operator lets it go on alone.
pub fn replicate(
    vm: &dyn SourceVm,
    to: &str,
    opts: &Options,
    epochs: &Epochs,
    stats: &ReplicationStats,
) -> Result<(), PrimaryError> {
    let mut p = start(vm, to, opts).map_err(|why| {
        vm.stop_disk_journals();
        vm.stop_pmem_log();
        stats.lost(why.to_string());
        PrimaryError::NotStarted {
            to: to.into(),
            why: Box::new(why),
        }
    })?;
    stats.set_state(ReplicationState::Seeding);
    let r = p.run(epochs, stats);
    // Alone again: what the guest sent goes out, whether or not the standby has it; unless
    // the VM is to wait for its operator.
    if r.is_ok() || stats.policy() != musubi_types::ReplicationPolicy::Stop {
        vm.open_output();
    }
    let _ = vm.stop_dirty_log();
    vm.stop_disk_journals();
    vm.stop_pmem_log();
    p.writer.shutdown();
    r.map_err(|why| {
        stats.lost(why.to_string());
        PrimaryError::Lost {
            to: to.into(),
            acked: p.acked,
            why: Box::new(why),
        }
    })
}

/// Connects, and has the standby build the VM.
fn start<'a>(vm: &'a dyn SourceVm, to: &str, opts: &Options) -> Result<Primary<'a>, NotStarted> {
    let layout = RamLayout::new(vm.ram_ranges())?;
    let Link {
        mut reader,
        mut writer,
        ..
    } = crate::dial(to, "standby", opts).map_err(Box::new)?;
    reader.limit_silence(opts.setup_limit)?;
    writer.limit_stall(opts.setup_limit)?;
    send_blob(&mut writer, Blob::Config, &vm.config())?;
    send_disk_sums(vm, &mut writer)?;
    send_pmem_sums(vm, &mut writer)?;
    let heartbeat = match recv(&mut reader)? {
        Msg::Standing { heartbeat_ms } => Duration::from_millis(heartbeat_ms),
        Msg::Refused(why) => return Err(NotStarted::Refused(why)),
        m => return Err(NotStarted::Unexpected(m.name())),
    };
    // An acknowledgement may take as long as the standby needs to store an epoch, which
    // the primary cannot tell from a standby gone quiet: the migration's silence bound.
    reader.limit_silence(opts.silence)?;
    writer.limit_stall(opts.silence)?;
    Ok(Primary {
        vm,
        layout,
        reader,
        writer,
        beat: (heartbeat / 3).max(Duration::from_millis(1)),
        beats: 0,
        last_send: Instant::now(),
        copy: Vec::new(),
        acked: 0,
        disk_bytes: 0,
        pmem: PmemCopy::default(),
    })
}

/// Starts recording the VM's disk writes and tells the standby what its copies must hold
/// (nothing is sent for a VM without disks).
fn send_disk_sums(vm: &dyn SourceVm, writer: &mut LinkWriter) -> Result<(), NotStarted> {
    let sums = vm.start_disk_journals().map_err(NotStarted::Disks)?;
    if !sums.is_empty() {
        send(writer, &Msg::DiskSums(sums))?;
    }
    Ok(())
}

/// Starts tracking the pages the guest writes in its memory-storage regions and tells the
/// standby what its copies of the files must hold (nothing is sent for a VM without them).
/// The first epoch sends none of their contents: the copies are equal, and only pages
/// written since go.
fn send_pmem_sums(vm: &dyn SourceVm, writer: &mut LinkWriter) -> Result<(), NotStarted> {
    let sums = vm.start_pmem_log().map_err(NotStarted::Pmem)?;
    if !sums.is_empty() {
        send(writer, &Msg::PmemSums(sums))?;
    }
    Ok(())
}

impl Primary<'_> {
    fn send(&mut self, m: &Msg) -> Result<(), LinkError> {
        self.last_send = Instant::now();
        send(&mut self.writer, m)
    }

    /// A page of guest RAM, read now.
    fn send_page(&mut self, gpa: u64, buf: &mut [u8; PAGE_SIZE]) -> Result<bool, LostWhy> {
        let Some(page) = self.layout.page_of(gpa) else {
            return Ok(false);
        };
        self.vm.read_page(gpa, buf).map_err(LostWhy::Vm)?;
        self.send(&Msg::Page {
            page,
            data: Box::new(*buf),
        })?;
        Ok(true)
    }

    /// Proves this side lives if nothing went for a beat.
    fn beat(&mut self) -> Result<(), LinkError> {
        if self.last_send.elapsed() >= self.beat {
            self.beats += 1;
            self.writer.send(&Envelope::Heartbeat { seq: self.beats })?;
            self.last_send = Instant::now();
        }
        Ok(())
    }

    fn run(&mut self, epochs: &Epochs, stats: &ReplicationStats) -> Result<(), LostWhy> {
        self.vm.start_dirty_log().map_err(LostWhy::Vm)?;
        // The first epoch: every page that may hold data, while the VM runs; its checkpoint
        // below sends what was written meanwhile.
        let mut buf = Box::new([0u8; PAGE_SIZE]);
        let mut live = 0u64;
        let with_data = self.vm.pages_with_data().map_err(LostWhy::Vm)?;
        self.beat()?;
        for gpa in with_data {
            if self.send_page(gpa, &mut buf)? {
                live += 1;
            }
        }
        let mut epoch = 0u64;
        let mut last_pause: Option<Instant> = None;
        // Output before the first checkpoint needs no holding: that checkpoint includes
        // whatever produced it.
        self.vm.hold_output();
        loop {
            // Wait out the epoch, proving this side lives; a VM that ended is said so.
            loop {
                if self.vm.has_ended() {
                    let _ = self.send(&Msg::Ended);
                    stats.set_state(ReplicationState::Ended);
                    return Ok(());
                }
                let left = last_pause
                    .map(|t| (t + epochs.every).saturating_duration_since(Instant::now()))
                    .unwrap_or_default();
                if left.is_zero() {
                    break;
                }
                self.beat()?;
                std::thread::sleep(left.min(self.beat));
            }
            let now = Instant::now();
            if let Some(t) = last_pause {
                stats.interval(now - t);
            }
            last_pause = Some(now);
            let (pages, state, frames, pause) = match self.checkpoint(epochs, &mut buf) {
                Ok(c) => c,
                // The VM ended while the checkpoint was taken: said at the top.
                Err(_) if self.vm.has_ended() => continue,
                Err(e) => return Err(e),
            };
            let pages = pages + std::mem::take(&mut live);
            let copied = last_pause.map(|t| t.elapsed()).unwrap_or_default();
            send_blob(&mut self.writer, Blob::State, &state)?;
            let frames = (!frames.is_empty()).then(|| (frames.len(), encode_frames(&frames)));
            if let Some((_, doc)) = &frames {
                send_blob(&mut self.writer, Blob::Frames, doc)?;
            }
            self.send(&Msg::Commit { epoch, pages })?;
            let disk_bytes = std::mem::take(&mut self.disk_bytes);
            let frame_bytes = frames.as_ref().map_or(0, |f| f.1.len() as u64);
            stats.sent(
                pages * PAGE_SIZE as u64 + state.len() as u64 + disk_bytes + frame_bytes,
                pause,
            );
            let sent = last_pause.map(|t| t.elapsed()).unwrap_or_default();
            let ack = recv(&mut self.reader);
            tracing::debug!(
                epoch,
                pages,
                state_bytes = state.len(),
                frames = frames.as_ref().map_or(0, |f| f.0),
                pause_us = pause.as_micros() as u64,
                pages_sent_us = copied.as_micros() as u64,
                committed_us = sent.as_micros() as u64,
                acked_us = last_pause.map(|t| t.elapsed().as_micros() as u64),
                "replication epoch"
            );
            match ack? {
                Msg::Acked(e) if e == epoch => {}
                m => {
                    return Err(LostWhy::Ack {
                        want: epoch,
                        got: format!("{m:?}").chars().take(80).collect(),
                    })
                }
            }
            self.acked += 1;
            self.vm.release_output();
            if frames.is_some() {
                // Written: a standby that takes over from this epoch must not send them.
                self.send(&Msg::Released(epoch))?;
            }
            stats.acked();
            if epoch == 0 {
                stats.set_state(ReplicationState::Protected);
            }
            epoch += 1;
        }
    }

    /// Pauses the vCPUs, reads the state and the pages written since the last checkpoint,
    /// resumes the VM (unless its owner had paused it) and sends the copy: returns the
    /// pages sent, the state, the frames held for the epoch and how long the vCPUs were
    /// paused.
    fn checkpoint(
        &mut self,
        epochs: &Epochs,
        buf: &mut [u8; PAGE_SIZE],
    ) -> Result<(u64, Vec<u8>, Frames, Duration), LostWhy> {
        let started = Instant::now();
        let was_paused = self.vm.is_paused();
        let state = self.vm.checkpoint().map_err(LostWhy::Vm)?;
        let copied = self.copy_dirty(epochs, buf);
        let pmem = (copied.as_ref().ok()).map(|(_, c)| self.copy_pmem_dirty(epochs, c.len(), buf));
        let disk = copied.as_ref().ok().map(|_| self.disk_writes_paused());
        self.vm.end_checkpoint(was_paused).map_err(LostWhy::Vm)?;
        let pause = started.elapsed();
        let (mut pages, copied) = copied?;
        // Sealed with the state: they stay as they are until this epoch is released.
        let frames = self.vm.captured_output();
        pmem.unwrap_or(Ok(()))?;
        let disk = disk.unwrap_or_else(|| Ok(Vec::new()))?;
        let copy = std::mem::take(&mut self.copy);
        let sent = (|| {
            for (&page, data) in copied.iter().zip(copy.chunks_exact(PAGE_SIZE)) {
                buf.copy_from_slice(data);
                self.send(&Msg::Page {
                    page,
                    data: Box::new(*buf),
                })?;
            }
            Ok::<_, LostWhy>(())
        })();
        self.copy = copy;
        sent?;
        self.send_disk_writes(disk)?;
        self.send_pmem_copy(buf)?;
        pages += copied.len() as u64;
        Ok((pages, state, frames, pause))
    }

    /// While paused, after the capture sealed the disks' journals: sends at once the writes
    /// of each disk whose journal went past its bound (read from the file now, so they hold
    /// what the guest last wrote there) and returns the others' for
    /// [`Primary::send_disk_writes`] once the VM runs again.
    fn disk_writes_paused(&mut self) -> Result<HeldWrites, LostWhy> {
        let mut held = Vec::new();
        let mut buf = vec![0u8; DISK_WRITE_BYTES];
        for (disk, w) in self.vm.take_disk_writes().into_iter().enumerate() {
            match w {
                SealedWrites::Bytes(v) if v.is_empty() => {}
                SealedWrites::Bytes(v) => held.push((disk as u32, v)),
                SealedWrites::FromFile(ranges) => {
                    for (offset, len) in ranges {
                        let mut at = offset;
                        while at < offset + len {
                            let n = ((offset + len - at) as usize).min(DISK_WRITE_BYTES);
                            self.vm.read_disk(disk, at, &mut buf[..n]).map_err(|why| {
                                LostWhy::Disk {
                                    disk,
                                    offset: at,
                                    why,
                                }
                            })?;
                            self.send_disk_write(disk as u32, at, &buf[..n])?;
                            at += n as u64;
                        }
                    }
                }
            }
        }
        Ok(held)
    }

    /// The journaled writes of an epoch, in the order the disks made them.
    fn send_disk_writes(&mut self, held: HeldWrites) -> Result<(), LostWhy> {
        for (disk, writes) in held {
            for (offset, data) in writes {
                for (i, piece) in data.chunks(DISK_WRITE_BYTES).enumerate() {
                    let at = offset + (i * DISK_WRITE_BYTES) as u64;
                    self.send_disk_write(disk, at, piece)?;
                }
            }
        }
        Ok(())
    }

    fn send_disk_write(&mut self, disk: u32, offset: u64, data: &[u8]) -> Result<(), LinkError> {
        self.disk_bytes += data.len() as u64;
        self.send(&Msg::DiskWrite {
            disk,
            offset,
            data: data.to_vec(),
        })
    }

    /// While paused: the pages written since the last look, copied up to the limit and
    /// the rest sent at once. Returns how many were sent and the copied pages' numbers.
    fn copy_dirty(
        &mut self,
        epochs: &Epochs,
        buf: &mut [u8; PAGE_SIZE],
    ) -> Result<(u64, Vec<u64>), LostWhy> {
        let mut dirty = self.vm.dirty_pages().map_err(LostWhy::Vm)?;
        dirty.sort_unstable();
        dirty.dedup();
        let fits = (epochs.copy_limit / PAGE_SIZE).max(1);
        let mut copied = Vec::with_capacity(dirty.len().min(fits));
        self.copy.clear();
        let mut sent = 0;
        for (n, gpa) in dirty.into_iter().enumerate() {
            // A copy longer than the standby's heartbeat must not look like this side's
            // death.
            if n % 256 == 255 {
                self.beat()?;
            }
            let Some(page) = self.layout.page_of(gpa) else {
                continue;
            };
            if copied.len() < fits {
                let at = self.copy.len();
                self.copy.resize(at + PAGE_SIZE, 0);
                let page_buf: &mut [u8; PAGE_SIZE] = (&mut self.copy[at..at + PAGE_SIZE])
                    .try_into()
                    .expect("one page");
                self.vm.read_page(gpa, page_buf).map_err(LostWhy::Vm)?;
                copied.push(page);
            } else if self.send_page(gpa, buf)? {
                sent += 1;
            }
        }
        Ok((sent, copied))
    }
}

impl Primary<'_> {
    /// While paused, after [`Primary::copy_dirty`] copied `ram_copied` pages: the
    /// memory-storage pages written since the last look, copied after them while the
    /// epoch's copy bound allows and the rest sent at once.
    fn copy_pmem_dirty(
        &mut self,
        epochs: &Epochs,
        ram_copied: usize,
        buf: &mut [u8; PAGE_SIZE],
    ) -> Result<(), LostWhy> {
        self.pmem.pages.clear();
        self.pmem.at = ram_copied * PAGE_SIZE;
        let mut dirty = self.vm.pmem_dirty_pages().map_err(LostWhy::Vm)?;
        dirty.sort_unstable();
        dirty.dedup();
        let fits = (epochs.copy_limit / PAGE_SIZE)
            .max(1)
            .saturating_sub(ram_copied);
        self.copy.truncate(self.pmem.at);
        for (n, (region, offset)) in dirty.into_iter().enumerate() {
            if n % 256 == 255 {
                self.beat()?;
            }
            if self.pmem.pages.len() < fits {
                let at = self.copy.len();
                self.copy.resize(at + PAGE_SIZE, 0);
                let page: &mut [u8; PAGE_SIZE] = (&mut self.copy[at..at + PAGE_SIZE])
                    .try_into()
                    .expect("one page");
                self.vm
                    .read_pmem(region, offset, page)
                    .map_err(LostWhy::Vm)?;
                self.pmem.pages.push((region, offset));
            } else {
                self.vm
                    .read_pmem(region, offset, buf)
                    .map_err(LostWhy::Vm)?;
                self.send_pmem_page(region, offset, buf)?;
            }
        }
        Ok(())
    }

    /// Once the VM runs again: the memory-storage pages the checkpoint copied.
    fn send_pmem_copy(&mut self, buf: &mut [u8; PAGE_SIZE]) -> Result<(), LinkError> {
        let copy = std::mem::take(&mut self.copy);
        let pages = std::mem::take(&mut self.pmem.pages);
        let at = self.pmem.at.min(copy.len());
        let sent = pages
            .iter()
            .zip(copy[at..].chunks_exact(PAGE_SIZE))
            .try_for_each(|(&(region, offset), data)| {
                buf.copy_from_slice(data);
                self.send_pmem_page(region, offset, buf)
            });
        self.copy = copy;
        self.pmem.pages = pages;
        sent
    }

    fn send_pmem_page(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8; PAGE_SIZE],
    ) -> Result<(), LinkError> {
        self.disk_bytes += PAGE_SIZE as u64;
        self.send(&Msg::PmemPage {
            region,
            offset,
            data: Box::new(*data),
        })
    }
}
