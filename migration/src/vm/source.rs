//! The source's side over a running Musubi VM: a migrator thread that moves the VM when
//! asked, and the VM as the migration's source sees it.

use crate::destination::PostCopyRam;
use crate::source::{self, SourceError, SourceVm};
use crate::{parse_url, read_secret, Mode, Options, SecretError, UrlError, VmFault};
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};

/// Where to move the VM and how.
#[derive(Clone, Debug)]
pub struct SendRequest {
    /// `tcp:HOST:PORT`.
    pub url: String,
    pub secret_file: PathBuf,
    /// Post-copy: most bytes per second the background push may send.
    pub push_limit: Option<u64>,
    pub mode: Mode,
}

/// Why a VM was not moved, or was lost moving.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("the migrator thread has stopped")]
    Stopped,
    #[error(
        "this VM is still receiving its pages from its previous migration; ask again once they \
         are all here"
    )]
    StillReceiving,
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// The page map could not be read.
#[derive(Debug, thiserror::Error)]
#[error("finding the pages with data: {0}")]
struct DataPagesError(#[source] std::io::Error);

/// The running VM as the migration's source sees it.
pub(crate) struct HandleVm<'a>(pub(crate) &'a vmm::VmHandle);

impl HandleVm<'_> {
    /// A captured state, as sent: the output the network devices held up to it is marked as
    /// this checkpoint's (see `devices::net::OutputGate::mark_captured`).
    fn sealed(&self, state: vmm::snapshot::VmState) -> Result<Vec<u8>, VmFault> {
        for g in self.0.output_gates() {
            g.mark_captured();
        }
        Ok(serde_json::to_vec(&state)?)
    }
}

impl SourceVm for HandleVm<'_> {
    fn config(&self) -> Vec<u8> {
        let mut config = serde_json::to_value(self.0.config()).unwrap_or_default();
        if let (Some(id), Some(fields)) = (self.0.vsock_listener(), config.as_object_mut()) {
            fields.insert(super::VSOCK_LISTENER.into(), serde_json::json!(id));
        }
        serde_json::to_vec(&config).unwrap_or_default()
    }
    fn capture(&self) -> Result<Vec<u8>, VmFault> {
        let state = self.0.capture()?;
        // The destination opens the same disks and memory-storage files: what the guest
        // wrote to them here must be in the files before it runs there (shared storage
        // between hosts sees only what was written back).
        if let Err(e) = self.0.flush_storage() {
            let _ = self.0.resume();
            return Err(e.into());
        }
        self.sealed(state)
    }
    fn checkpoint(&self) -> Result<Vec<u8>, VmFault> {
        let state = self.0.begin_checkpoint()?;
        self.sealed(state).inspect_err(|_| {
            let _ = self.0.end_checkpoint();
        })
    }
    fn end_checkpoint(&self, _paused_before: bool) -> Result<(), VmFault> {
        // The handle knows whether the checkpoint paused the VM, and an operator's pause
        // waited for it, so the VM is left as its owner has it.
        Ok(self.0.end_checkpoint()?)
    }
    fn hold_output(&self) {
        for g in self.0.output_gates() {
            g.hold();
        }
    }
    fn captured_output(&self) -> crate::protocol::Frames {
        self.0.captured_output()
    }
    fn release_output(&self) {
        self.0.release_output();
    }
    fn open_output(&self) {
        self.0.open_output();
    }
    fn resume(&self) -> Result<(), VmFault> {
        Ok(self.0.resume()?)
    }
    fn is_paused(&self) -> bool {
        self.0.is_paused()
    }
    fn ram_ranges(&self) -> Vec<(u64, u64)> {
        self.0.ram_ranges()
    }
    fn pages_with_data(&self) -> Result<Vec<u64>, VmFault> {
        Ok(self.0.pages_with_data().map_err(DataPagesError)?)
    }
    fn read_page(&self, gpa: u64, buf: &mut [u8; dsm::PAGE_SIZE]) -> Result<(), VmFault> {
        Ok(self.0.read_ram(gpa, &mut buf[..])?)
    }
    fn has_ended(&self) -> bool {
        self.0.has_ended()
    }
    fn start_dirty_log(&self) -> Result<(), VmFault> {
        Ok(self.0.start_dirty_log()?)
    }
    fn dirty_pages(&self) -> Result<Vec<u64>, VmFault> {
        Ok(self.0.dirty_pages()?)
    }
    fn stop_dirty_log(&self) -> Result<(), VmFault> {
        Ok(self.0.stop_dirty_log()?)
    }
    fn start_disk_journals(&self) -> Result<Vec<(u64, u32)>, VmFault> {
        let sums = self.0.start_disk_journals(vmm::DEFAULT_JOURNAL_BOUND)?;
        Ok(sums.into_iter().map(|s| (s.len, s.crc32)).collect())
    }
    fn stop_disk_journals(&self) {
        self.0.stop_disk_journals()
    }
    fn take_disk_writes(&self) -> Vec<vmm::SealedWrites> {
        self.0.take_disk_writes()
    }
    fn read_disk(&self, disk: usize, offset: u64, buf: &mut [u8]) -> Result<(), VmFault> {
        Ok(self.0.read_disk(disk, offset, buf)?)
    }
    fn start_pmem_log(&self) -> Result<Vec<(u64, u32)>, VmFault> {
        let sums = self.0.start_pmem_log()?;
        Ok(sums.into_iter().map(|s| (s.len, s.crc32)).collect())
    }
    fn pmem_dirty_pages(&self) -> Result<Vec<(u32, u64)>, VmFault> {
        let pages = self.0.pmem_dirty_pages()?;
        Ok(pages.into_iter().map(|(r, o)| (r as u32, o)).collect())
    }
    fn stop_pmem_log(&self) {
        let _ = self.0.stop_pmem_log();
    }
    fn read_pmem(
        &self,
        region: u32,
        offset: u64,
        buf: &mut [u8; dsm::PAGE_SIZE],
    ) -> Result<(), VmFault> {
        Ok(self.0.read_pmem(region as usize, offset, &mut buf[..])?)
    }
}

struct Request {
    req: SendRequest,
    reply: mpsc::Sender<Result<(), MigrateError>>,
}

/// Moves the VM elsewhere when asked, from a thread of its own: the API thread's filter
/// allows neither connecting nor starting threads, so this thread, started before the
/// filters go on, does both.
pub struct Migrator {
    requests: Mutex<mpsc::Sender<Request>>,
}

impl Migrator {
    /// `incoming` is the RAM of a VM that came by migration itself: it cannot move on
    /// before all its pages are here.
    pub fn start(
        vm: vmm::VmHandle,
        incoming: Option<Arc<PostCopyRam>>,
    ) -> std::io::Result<Migrator> {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("migrator".into())
            .spawn(move || {
                for r in rx {
                    let _ = r.reply.send(send(&vm, incoming.as_deref(), &r.req));
                }
            })?;
        Ok(Migrator {
            requests: Mutex::new(tx),
        })
    }

    /// Moves the VM as `req` asks: `Ok` once it runs there and this side holds nothing it
    /// needs (the VM here has then ended as migrated).
    pub fn send(&self, req: &SendRequest) -> Result<(), MigrateError> {
        let (tx, rx) = mpsc::channel();
        let req = Request {
            req: req.clone(),
            reply: tx,
        };
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(req)
            .map_err(|_| MigrateError::Stopped)?;
        rx.recv().map_err(|_| MigrateError::Stopped)?
    }
}

fn send(
    vm: &vmm::VmHandle,
    incoming: Option<&PostCopyRam>,
    req: &SendRequest,
) -> Result<(), MigrateError> {
    let url = req.url.as_str();
    if incoming.is_some_and(|r| !r.all_held()) {
        return Err(MigrateError::StillReceiving);
    }
    let addr = parse_url(url)?;
    let secret = read_secret(&req.secret_file)?;
    let mut opts = Options::new(secret);
    opts.push_limit = req.push_limit;
    opts.mode = req.mode;
    match source::migrate(&HandleVm(vm), addr, &opts) {
        Ok(r) => {
            let pre = r.precopy.clone().unwrap_or_default();
            tracing::info!(
                to = url,
                data_pages = r.data_pages,
                asked = r.pages_asked,
                pushed = r.pages_pushed,
                ended_there = r.ended_there,
                precopy_rounds = pre.rounds,
                precopy_live = pre.pages_live,
                precopy_paused = pre.pages_paused,
                precopy_converged = pre.converged,
                "migrated"
            );
            vm.stop(vmm::Outcome::Migrated {
                to: url.to_string(),
            });
            Ok(())
        }
        Err(e @ SourceError::After(_)) => {
            vm.stop(vmm::Outcome::VmmError(e.to_string()));
            Err(e.into())
        }
        Err(e) => Err(e.into()),
    }
}
