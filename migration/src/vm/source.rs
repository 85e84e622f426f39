//! The source's side over a running Musubi VM: a migrator thread that moves the VM when
//! asked, and the VM as the migration's source sees it.

use crate::destination::PostCopyRam;
use crate::source::{self, SourceError, SourceVm};
use crate::{parse_url, read_secret, Mode, Options};
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

/// The running VM as the migration's source sees it.
struct HandleVm<'a>(&'a vmm::VmHandle);

impl SourceVm for HandleVm<'_> {
    fn config(&self) -> Vec<u8> {
        serde_json::to_vec(self.0.config()).unwrap_or_default()
    }
    fn capture(&self) -> Result<Vec<u8>, String> {
        let state = self.0.capture().map_err(|e| e.to_string())?;
        // The destination opens the same disks and memory-storage files: what the guest
        // wrote to them here must be in the files before it runs there (shared storage
        // between hosts sees only what was written back).
        if let Err(e) = self.0.flush_storage() {
            let _ = self.0.resume();
            return Err(e.to_string());
        }
        serde_json::to_vec(&state).map_err(|e| e.to_string())
    }
    fn resume(&self) -> Result<(), String> {
        self.0.resume().map_err(|e| e.to_string())
    }
    fn ram_ranges(&self) -> Vec<(u64, u64)> {
        self.0.ram_ranges()
    }
    fn pages_with_data(&self) -> Result<Vec<u64>, String> {
        self.0
            .pages_with_data()
            .map_err(|e| format!("finding the pages with data: {e}"))
    }
    fn read_page(&self, gpa: u64, buf: &mut [u8; dsm::PAGE_SIZE]) -> Result<(), String> {
        self.0
            .read_ram(gpa, &mut buf[..])
            .map_err(|e| e.to_string())
    }
    fn has_ended(&self) -> bool {
        self.0.has_ended()
    }
    fn start_dirty_log(&self) -> Result<(), String> {
        self.0.start_dirty_log().map_err(|e| e.to_string())
    }
    fn dirty_pages(&self) -> Result<Vec<u64>, String> {
        self.0.dirty_pages().map_err(|e| e.to_string())
    }
    fn stop_dirty_log(&self) -> Result<(), String> {
        self.0.stop_dirty_log().map_err(|e| e.to_string())
    }
}

struct Request {
    req: SendRequest,
    reply: mpsc::Sender<Result<(), String>>,
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
    pub fn send(&self, req: &SendRequest) -> Result<(), String> {
        let (tx, rx) = mpsc::channel();
        let req = Request {
            req: req.clone(),
            reply: tx,
        };
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(req)
            .map_err(|_| "the migrator thread has stopped".to_string())?;
        rx.recv()
            .map_err(|_| "the migrator thread has stopped".to_string())?
    }
}

fn send(
    vm: &vmm::VmHandle,
    incoming: Option<&PostCopyRam>,
    req: &SendRequest,
) -> Result<(), String> {
    let url = req.url.as_str();
    if incoming.is_some_and(|r| !r.all_held()) {
        return Err(
            "this VM is still receiving its pages from its previous migration; ask again once \
             they are all here"
                .into(),
        );
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
        Err(SourceError::After(e)) => {
            vm.stop(vmm::Outcome::VmmError(e.clone()));
            Err(e)
        }
        Err(e) => Err(e.to_string()),
    }
}
