//! Saving a running VM: its state for a migration or a replica, a snapshot directory, and
//! guest RAM as a migration's source reads it (whole, or the pages written meanwhile).

use super::{ControlError, VmHandle};
pub use crate::vstate::dirty::DirtyLogError;
use std::time::{Duration, Instant};

/// What taking a snapshot did.
#[derive(Clone, Debug)]
pub struct SnapshotReport {
    pub dir: std::path::PathBuf,
    pub ram: crate::snapshot::RamWritten,
    /// From the request to the last byte durable.
    pub took: Duration,
}

/// Guest writes that may not have reached the disks and memory-storage files: one message
/// per device or region, each naming it.
#[derive(Debug, thiserror::Error)]
#[error("guest writes may not be on disk: {}", .0.join("; "))]
pub struct StorageError(pub Vec<String>);

/// A disk's writes could not be recorded or read for a replica.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("--disk {}: reading it for replication: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the VM has no disk {0}")]
    NoDisk(usize),
}

/// A memory-storage region could not be tracked, checked or read for a replica.
#[derive(Debug, thiserror::Error)]
pub enum PmemLogError {
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    DirtyLog(#[from] DirtyLogError),
    #[error("--pmem file={}: reading it for replication: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the VM has no memory-storage page at region {region}, offset {offset:#x}")]
    Outside { region: usize, offset: u64 },
}

/// Guest RAM that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("guest RAM at {gpa:#x}: {source}")]
pub struct RamReadError {
    pub gpa: u64,
    pub source: vm_memory::GuestMemoryError,
}

impl VmHandle {
    /// Everything of the VM but its RAM and files, as a snapshot saves it: the VM is paused
    /// first if it runs, and left paused. A migration sends this.
    pub fn capture(&self) -> Result<crate::snapshot::VmState, ControlError> {
        let _one = self.shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        let paused = self.shared.gate.is_paused();
        if !paused {
            self.pause_locked()?;
        }
        let mut state = self.capture_locked()?;
        state.paused = paused;
        Ok(state)
    }

    pub(super) fn capture_locked(&self) -> Result<crate::snapshot::VmState, ControlError> {
        let sh = &self.shared;
        let clock = sh
            .paused_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|p| p.clock)
            .ok_or(ControlError::NotPaused)?;
        let state = sh.parts.save(&sh.gate, &sh.control, &clock)?;
        // The disks' writes so far are this state's: sealed at the same pause.
        for j in &sh.journals {
            j.seal();
        }
        Ok(state)
    }

    /// Starts recording each disk's writes (at most `bound` bytes kept per disk, see
    /// [`devices::virtio::WriteJournal`]) and returns each image's checksum as of that
    /// moment, in `--disk` order. The VM is paused meanwhile (if it runs), so no write
    /// falls between the checksum and the journal: the pause lasts as long as reading
    /// every image does.
    pub fn start_disk_journals(
        &self,
        bound: usize,
    ) -> Result<Vec<devices::virtio::FileSum>, JournalError> {
        let sh = &self.shared;
        if sh.journals.is_empty() {
            return Ok(Vec::new());
        }
        self.while_paused(|| {
            let sums = sh
                .journals
                .iter()
                .map(|j| {
                    j.start(bound);
                    j.checksum().map_err(|source| JournalError::Read {
                        path: j.path().to_path_buf(),
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>();
            if sums.is_err() {
                sh.journals.iter().for_each(|j| j.stop());
            }
            sums
        })
    }

    /// Runs `f` with the VM paused (paused for it if it runs, and resumed after), no other
    /// pause, resume or snapshot meanwhile.
    fn while_paused<T, E: From<ControlError>>(
        &self,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let _one = self.busy_after_checkpoint();
        let paused = self.shared.gate.is_paused();
        if !paused {
            self.pause_locked()?;
        }
        let r = f();
        if !paused {
            self.resume_locked()?;
        }
        r
    }

    /// Stops what [`VmHandle::start_disk_journals`] started.
    pub fn stop_disk_journals(&self) {
        self.shared.journals.iter().for_each(|j| j.stop());
    }

    /// Each disk's writes sealed by the last [`VmHandle::capture`], taken, in `--disk`
    /// order.
    pub fn take_disk_writes(&self) -> Vec<devices::virtio::SealedWrites> {
        self.shared
            .journals
            .iter()
            .map(|j| j.take_sealed())
            .collect()
    }

    /// Reads disk `disk`'s image at `offset` (what a journal past its bound ships).
    pub fn read_disk(&self, disk: usize, offset: u64, buf: &mut [u8]) -> Result<(), JournalError> {
        let j = self
            .shared
            .journals
            .get(disk)
            .ok_or(JournalError::NoDisk(disk))?;
        j.read_at(offset, buf).map_err(|source| JournalError::Read {
            path: j.path().to_path_buf(),
            source,
        })
    }

    /// Starts tracking the pages written in the writable memory-storage regions and returns
    /// each region's file checksum as of that moment, in `--pmem` order (none for a VM
    /// without regions). The VM is paused meanwhile (if it runs), so no store falls between
    /// the checksum and the tracking.
    pub fn start_pmem_log(&self) -> Result<Vec<devices::virtio::FileSum>, PmemLogError> {
        let sh = &self.shared;
        if sh.pmem.is_empty() {
            return Ok(Vec::new());
        }
        self.while_paused(|| {
            let sums = sh
                .pmem_dirty
                .start()
                .map_err(PmemLogError::from)
                .and_then(|()| {
                    sh.pmem
                        .iter()
                        .map(|r| {
                            r.checksum().map_err(|source| PmemLogError::Read {
                                path: r.config.file.clone(),
                                source,
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()
                });
            if sums.is_err() {
                let _ = sh.pmem_dirty.stop();
            }
            sums
        })
    }

    /// (region, offset) of each memory-storage page written since
    /// [`VmHandle::start_pmem_log`] or the last call.
    pub fn pmem_dirty_pages(&self) -> Result<Vec<(usize, u64)>, DirtyLogError> {
        self.shared.pmem_dirty.take()
    }

    /// Stops what [`VmHandle::start_pmem_log`] started.
    pub fn stop_pmem_log(&self) -> Result<(), DirtyLogError> {
        self.shared.pmem_dirty.stop()
    }

    /// Copies memory-storage region `region` at `offset` into `buf`, from its mapping (what
    /// the guest stored there, whether or not written back).
    pub fn read_pmem(
        &self,
        region: usize,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), PmemLogError> {
        let r = self
            .shared
            .pmem
            .get(region)
            .filter(|r| {
                offset
                    .checked_add(buf.len() as u64)
                    .is_some_and(|end| end <= r.size)
            })
            .ok_or(PmemLogError::Outside { region, offset })?;
        // SAFETY: `offset..end` lies inside the region's mapping (checked above), which lives
        // as long as `r`; the guest may store into it meanwhile, which at worst tears the
        // copy of a page a later look reports again.
        unsafe {
            std::ptr::copy_nonoverlapping(
                r.host_addr().add(offset as usize),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// Makes everything the guest wrote to its disks and memory-storage files durable in the
    /// files, as the teardown does; for a paused VM whose storage another process is about
    /// to open.
    pub fn flush_storage(&self) -> Result<(), StorageError> {
        let mut errors = Vec::new();
        for t in &self.shared.parts.devices().transports {
            if let Err(e) = t.lock().unwrap_or_else(|e| e.into_inner()).flush() {
                errors.push(format!("a virtio device's flush failed: {e}"));
            }
        }
        errors.extend(
            crate::pmem::sync_regions(&self.shared.pmem)
                .iter()
                .map(ToString::to_string),
        );
        match errors.is_empty() {
            true => Ok(()),
            false => Err(StorageError(errors)),
        }
    }

    /// The output gates of the VM's network devices, in creation order: a replicator holds
    /// their frames until its checkpoints are safe (see `devices::net::output_gate`).
    pub fn output_gates(&self) -> Vec<std::sync::Arc<devices::net::OutputGate>> {
        self.shared
            .parts
            .devices()
            .transports
            .iter()
            .filter_map(|t| t.lock().unwrap_or_else(|e| e.into_inner()).output_gate())
            .collect()
    }

    /// Lets the output each network device held up to the last checkpoint go (see
    /// `devices::net::OutputGate::release_captured`), and writes it at once from the calling
    /// thread: the standby has that checkpoint, and until the frames are out a primary that
    /// dies loses them.
    pub fn release_output(&self) {
        for t in &self.shared.parts.devices().transports {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(g) = t.output_gate() {
                // The device is woken only for what its backend could not take now.
                g.release_captured_here();
                if t.flush_output() {
                    g.wake();
                }
            }
        }
    }

    /// Replication ended: every network device stops holding and writes what it held.
    pub fn open_output(&self) {
        self.each_gate(|g| g.open());
    }

    /// Copies of the frames each network device held for the last checkpoint the
    /// replicator took, oldest first, each with the device's number among the VM's
    /// network devices: the primary ships them with that checkpoint, so that a standby
    /// taking over from it sends them if the primary dies before it does.
    pub fn captured_output(&self) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        let nets = self
            .shared
            .parts
            .devices()
            .transports
            .iter()
            .filter_map(|t| {
                let t = t.lock().unwrap_or_else(|e| e.into_inner());
                t.output_gate().map(|_| t.captured_output())
            });
        for (net, frames) in nets.enumerate() {
            out.extend(frames.into_iter().map(|f| (net as u32, f)));
        }
        out
    }

    fn each_gate(&self, f: impl Fn(&devices::net::OutputGate)) {
        for t in &self.shared.parts.devices().transports {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(g) = t.output_gate() {
                f(&g);
                t.flush_output();
            }
        }
    }

    /// Guest RAM's ranges: (guest-physical start, length).
    pub fn ram_ranges(&self) -> Vec<(u64, u64)> {
        self.shared.parts.ram_ranges().to_vec()
    }

    /// Copies guest RAM at `gpa` into `buf` (a page server reads a paused VM's pages so).
    pub fn read_ram(&self, gpa: u64, buf: &mut [u8]) -> Result<(), RamReadError> {
        use vm_memory::Bytes;
        self.shared
            .ram
            .memory()
            .read_slice(buf, vm_memory::GuestAddress(gpa))
            .map_err(|source| RamReadError { gpa, source })
    }

    /// Guest-physical addresses of every page that may hold data; all others are zeros.
    pub fn pages_with_data(&self) -> std::io::Result<Vec<u64>> {
        crate::snapshot::pages_that_may_hold_data(&self.shared.ram)
    }

    /// Starts tracking the guest RAM pages written, by the guest or by the VMM, for a
    /// pre-copy migration's rounds; [`VmHandle::dirty_pages`] then reports them.
    pub fn start_dirty_log(&self) -> Result<(), DirtyLogError> {
        self.shared.dirty.start()
    }

    /// Guest-physical addresses of the RAM pages written since tracking started or since
    /// the last call.
    pub fn dirty_pages(&self) -> Result<Vec<u64>, DirtyLogError> {
        self.shared.dirty.take()
    }

    /// Stops the tracking [`VmHandle::start_dirty_log`] started.
    pub fn stop_dirty_log(&self) -> Result<(), DirtyLogError> {
        self.shared.dirty.stop()
    }

    /// Writes a snapshot of the VM to `dir` (created if missing; files in it replaced). The
    /// VM is paused first if it runs, and left paused.
    pub fn snapshot(&self, dir: &std::path::Path) -> Result<SnapshotReport, ControlError> {
        use crate::snapshot::{self, SnapshotError};
        let _one = self.busy_after_checkpoint();
        let started = Instant::now();
        let sh = &self.shared;
        if !sh.gate.is_paused() {
            self.pause_locked()?;
        }
        let io = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| SnapshotError::Io { path, source }
        };
        snapshot::create_dir(dir)?;
        // An older snapshot's state goes first, so a failure below leaves no directory
        // that looks whole.
        match std::fs::remove_file(dir.join(snapshot::STATE_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(SnapshotError::Io {
                    path: dir.join(snapshot::STATE_FILE),
                    source: e,
                }
                .into())
            }
            _ => {}
        }
        let state = self.capture_locked()?;
        // Memory storage is referenced, so its pages must be in the files now.
        if let Some(e) = crate::pmem::sync_regions(&sh.pmem).into_iter().next() {
            return Err(e.into());
        }
        let mem_path = dir.join(snapshot::MEMORY_FILE);
        let ram = snapshot::write_ram(&sh.ram, &mem_path).map_err(io(&mem_path))?;
        snapshot::write_config(dir, &sh.saved_config)?;
        snapshot::write_state(dir, &state)?;
        Ok(SnapshotReport {
            dir: dir.to_path_buf(),
            ram,
            took: started.elapsed(),
        })
    }
}
