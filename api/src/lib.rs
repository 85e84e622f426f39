//! Musubi's control API: HTTP/1.1 with JSON bodies on a UNIX socket, with Cloud
//! Hypervisor's paths, bodies and status codes where it has them, so its clients
//! (ch-remote, `curl --unix-socket`) drive a Musubi VM unchanged.
//!
//! Requests are parsed with `httparse` (small, well kept, no allocation, no async runtime):
//! one thread under its own seccomp filter serves a few short requests, which an async
//! runtime and its worker threads would only make larger and harder to filter.

pub mod client;
pub mod http;
pub mod routes;
pub mod server;

pub use client::{request, request_with_timeout, ClientError};
pub use server::{ApiError, ApiServer, FilterError};

/// The prefix of every path, as Cloud Hypervisor's.
pub const API_ROOT: &str = "/api/v1";

/// What the API asks of the VM it controls. Every method is called on the API thread, one
/// at a time, so an implementation only has to be safe against the VM's own threads.
pub trait VmControl: Send + Sync {
    /// `{"config": {...}, "state": "Running"|"Paused", ...}`, answered to GET vm.info.
    fn info(&self) -> Result<serde_json::Value, ActionError>;
    /// Answered to GET vm.counters: device name to counter name to value, as CH's.
    fn counters(&self) -> Result<serde_json::Value, ActionError>;
    /// Creates the VM from Cloud Hypervisor's VmConfig JSON (`body`, not yet parsed). A VMM
    /// started with its VM has one already.
    fn create(&self, body: &[u8]) -> Result<(), ActionError> {
        let _ = body;
        Err(ActionError::wrong_state(
            "this VMM runs the VM it was started with; `musubi vmm --api-socket PATH` \
             waits for vm.create",
        ))
    }
    /// Boots the created VM, or boots it afresh after a shutdown.
    fn boot(&self) -> Result<(), ActionError> {
        Err(ActionError::wrong_state("the VM is already booted"))
    }
    /// Restarts the VM from its kernel with the same configuration.
    fn reboot(&self) -> Result<(), ActionError> {
        Err(ActionError::wrong_state(
            "this VMM ends with the VM it was started with; it does not reboot it",
        ))
    }
    /// Presses the VM's ACPI power button: the guest decides whether to shut down (a guest
    /// that ignores it runs on), so `Ok` means the press was delivered, not that it ended.
    fn power_button(&self) -> Result<(), ActionError> {
        Err(ActionError::internal(
            "this VMM has no power button to press",
        ))
    }
    /// Shuts the VM down if it runs and forgets its configuration.
    fn delete(&self) -> Result<(), ActionError> {
        Err(ActionError::wrong_state(
            "this VMM ends with the VM it was started with; use vm.shutdown or vmm.shutdown",
        ))
    }
    fn pause(&self) -> Result<(), ActionError>;
    fn resume(&self) -> Result<(), ActionError>;
    /// Writes a snapshot into `dir` (an absolute path, from a `file://` destination_url).
    fn snapshot(&self, dir: &std::path::Path) -> Result<(), ActionError>;
    /// Moves the VM to the musubi waiting at the request's `tcp:HOST:PORT` (`run
    /// --receive-migration`), proving the secret in its file. `Ok` once the VM runs there
    /// and needs nothing from here; on `Err` the message says whether the VM runs on here
    /// (a failure before the switch) or was lost.
    fn send_migration(&self, req: &SendMigration) -> Result<(), ActionError> {
        let _ = req;
        Err(ActionError::internal("this VMM does not migrate VMs"))
    }
    /// Starts keeping the VM on the standby waiting at the request's `tcp:HOST:PORT` (`run
    /// --standby-for`), Musubi's own call: `Ok` once the standby has taken the VM (its
    /// first epoch under way); `vm.info` then shows where the replication stands.
    fn replicate(&self, req: &Replicate) -> Result<(), ActionError> {
        let _ = req;
        Err(ActionError::internal("this VMM does not replicate VMs"))
    }
    /// Puts back the VM saved in a snapshot, in a VMM that has none (Cloud Hypervisor's
    /// vm.restore). A VMM started with its VM has one already.
    fn restore(&self, req: &Restore) -> Result<(), ActionError> {
        let _ = req;
        Err(ActionError::wrong_state(
            "this VMM runs the VM it was started with; restore into `musubi vmm              --api-socket PATH`, or start `musubi run --restore DIR`",
        ))
    }
    /// Waits for a VM sent by another VMM and runs it, in a VMM that has none.
    fn receive_migration(&self, req: &ReceiveMigration) -> Result<(), ActionError> {
        let _ = req;
        Err(ActionError::wrong_state(
            "this VMM runs the VM it was started with; receive into `musubi vmm              --api-socket PATH`, or start `musubi run --receive-migration URL`",
        ))
    }
    fn shutdown_vm(&self) -> Result<(), ActionError>;
    /// A VMM runs one VM and ends when it does, so by default shutting the VMM down is
    /// shutting its VM down.
    fn shutdown_vmm(&self) -> Result<(), ActionError> {
        self.shutdown_vm()
    }
    /// Adds a device of `kind` (Cloud Hypervisor's DiskConfig, NetConfig, PmemConfig or VsockConfig JSON
    /// in `body`, not yet parsed) to a VM not running, for its next boot. A VMM started
    /// with its VM has it running already, and its virtio-mmio devices cannot be hot-plugged.
    fn add_device(&self, kind: DeviceKind, body: &[u8]) -> Result<(), ActionError> {
        let _ = (kind, body);
        Err(ActionError::internal(NO_HOTPLUG))
    }
    /// Removes the device with this id from a VM not running, for its next boot.
    fn remove_device(&self, id: &str) -> Result<(), ActionError> {
        let _ = id;
        Err(ActionError::internal(NO_HOTPLUG))
    }
    /// Moves vCPU `vcpu` to node `node` of a VM over several hosts while the VM runs (`Ok`
    /// once it runs there); its pages follow it as it touches them.
    fn move_vcpu(&self, vcpu: u8, node: u16) -> Result<(), ActionError> {
        let _ = (vcpu, node);
        Err(ActionError::internal(
            "this VM runs on one host: it has no other node to move a vCPU to",
        ))
    }
}

/// Why a running VM takes no device, worded so a user knows what to do instead.
pub const NO_HOTPLUG: &str = "virtio-mmio has no hot-plug: add devices before vm.boot";

/// What a `vm.add-*` call adds, by its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Disk,
    Net,
    Pmem,
    Vsock,
}

impl DeviceKind {
    /// The device's name in Cloud Hypervisor's messages ("The disk could not be added").
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Disk => "disk",
            DeviceKind::Net => "network device",
            DeviceKind::Pmem => "pmem device",
            DeviceKind::Vsock => "vsock device",
        }
    }
}

/// A `vm.send-migration` request: `{"destination_url": "tcp:HOST:PORT", "secret_file":
/// "/PATH"}`, with `"mode": "precopy"` (or Cloud Hypervisor's `"memory_mode": "Precopy"`)
/// and optionally `"downtime_ms"` and `"max_rounds"` for a pre-copy, or `"push_limit"`
/// (bytes per second, at least 4096) for the default post-copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendMigration {
    pub url: String,
    /// `None` when the body names none (Cloud Hypervisor's clients cannot): the VMM's own
    /// `--secret-file` is used then.
    pub secret_file: Option<std::path::PathBuf>,
    /// `None` for post-copy.
    pub precopy: Option<PreCopy>,
    /// Post-copy: most bytes per second the background push may send (`push_limit`).
    pub push_limit: Option<u64>,
}

/// A `vm.replicate` request (Musubi's own): `{"destination_url": "tcp:HOST:PORT",
/// "secret_file": "/PATH", "epoch_ms": 20, "policy": "go-on"}`, all but the URL optional.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replicate {
    pub url: String,
    /// `None`: the VMM's own `--secret-file`.
    pub secret_file: Option<std::path::PathBuf>,
    /// Time between two checkpoints; `None`: the VMM's default (20 ms).
    pub epoch_ms: Option<u64>,
    /// What the VM does if its standby is lost: `go-on` (`None`) or `stop`.
    pub policy: Option<String>,
}

/// A `vm.restore` request, Cloud Hypervisor's RestoreConfig: `{"source_url":
/// "file:///DIR"}` with `prefault`, `memory_restore_mode` and `resume`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restore {
    pub dir: std::path::PathBuf,
    /// Read the whole memory file in before the VM runs (`"prefault": true`).
    pub prefault: bool,
    /// Fill RAM page by page at first touch through userfaultfd (`"memory_restore_mode":
    /// "OnDemand"`) rather than map the memory file.
    pub on_demand: bool,
    /// Run the VM at once (`"resume": true`); otherwise it waits paused for vm.resume.
    pub resume: bool,
}

/// A `vm.receive-migration` request: `{"receiver_url": "tcp:HOST:PORT"}`, with the secret
/// file as in [`SendMigration`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveMigration {
    pub url: String,
    pub secret_file: Option<std::path::PathBuf>,
}

/// A pre-copy's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreCopy {
    /// Pause once what is left can be sent within this many milliseconds (Cloud
    /// Hypervisor's `downtime_ms`, 300 by default).
    pub downtime_ms: u64,
    /// Pause after this many rounds whatever is left.
    pub max_rounds: u32,
}

impl PreCopy {
    pub const DEFAULT_DOWNTIME_MS: u64 = 300;
    pub const DEFAULT_MAX_ROUNDS: u32 = 10;
}

/// Why an action failed, and the status to answer with: CH answers 500 for most failures
/// (an invalid state transition such as pausing a paused VM among them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActionError {
    pub status: u16,
    pub message: String,
}

impl ActionError {
    /// A call made before any VM is created (CH's 404).
    pub fn not_created(message: impl Into<String>) -> Self {
        ActionError {
            status: 404,
            message: message.into(),
        }
    }

    /// A call the VM's state does not allow (CH's 405), such as pausing a VM not booted.
    pub fn wrong_state(message: impl Into<String>) -> Self {
        ActionError {
            status: 405,
            message: message.into(),
        }
    }

    /// A request body that is refused (400): a VmConfig Musubi cannot honour.
    /// A name already taken (a device id twice): Cloud Hypervisor's clients read 409 so.
    pub fn conflict(message: impl Into<String>) -> Self {
        ActionError {
            status: 409,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ActionError {
            status: 400,
            message: message.into(),
        }
    }

    /// A failure CH reports as an internal error (500).
    pub fn internal(message: impl Into<String>) -> Self {
        ActionError {
            status: 500,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ActionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ActionError {}
