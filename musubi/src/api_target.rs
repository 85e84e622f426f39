//! What the control API does to the VM of `musubi run`: the API's requests turned into
//! calls on the VM's handle, and its errors into Cloud Hypervisor's answers.

use musubi_api::{ActionError, VmControl};

/// The VM the API controls.
pub struct ApiTarget {
    pub vm: vmm::VmHandle,
    /// Moves the VM elsewhere (vm.send-migration); `None` if its thread could not start.
    pub migrator: Option<musubi_migration::vm::Migrator>,
    /// `--secret-file`: the secret of a migration whose request names none.
    pub secret_file: Option<std::path::PathBuf>,
    pub described: Described,
    /// Where the replication stands once one runs (`--replicate-to`, vm.replicate), shown
    /// by `vm.info`.
    pub replication: musubi_migration::vm::ReplicationSlot,
    /// Starts a replication (vm.replicate); `None` if its thread could not start.
    pub replicate_on_request: Option<std::sync::Arc<musubi_migration::vm::OnRequest>>,
}

fn refused(e: vmm::ControlError) -> ActionError {
    ActionError::internal(e.to_string())
}

/// Serves the API for `target` on `path`, on a thread under the API's own filter. A
/// failure to start ends `vm` with the reason, naming the flag.
pub fn serve(
    path: &std::path::Path,
    target: std::sync::Arc<dyn VmControl>,
    seccomp: vmm::seccomp::SeccompMode,
    vm: &vmm::VmHandle,
) -> Option<musubi_api::ApiServer> {
    let filter =
        move || vmm::seccomp::apply(vmm::seccomp::ThreadKind::Api, seccomp).map_err(Into::into);
    match musubi_api::ApiServer::start(path, target, filter) {
        Ok(s) => Some(s),
        Err(e) => {
            vm.stop(vmm::Outcome::VmmError(format!("--api-socket: {e}")));
            None
        }
    }
}

/// A running VM's VmConfig as `vm.info` shows it, worked out once on the thread that
/// starts the API: reading a config checks it against the host, which the API thread's
/// filter does not let it do.
pub enum Described {
    Ch(Box<crate::ch_config::ChVm>),
    /// A saved setting no VmConfig can hold: Musubi's own form, so nothing is hidden.
    Own(serde_json::Value, u64),
}

impl Described {
    pub fn of(vm: &vmm::VmHandle) -> Described {
        match vm.config().to_vm_config() {
            Ok(config) => Described::Ch(Box::new(crate::ch_config::ChVm::from_config(config))),
            Err(_) => Described::Own(
                serde_json::to_value(vm.config()).unwrap_or_default(),
                vm.config().memory,
            ),
        }
    }
}

/// What `vm.info` answers for `vm`: its configuration and state, as Cloud Hypervisor's.
pub fn info_json(vm: &vmm::VmHandle, described: &Described) -> serde_json::Value {
    let state = if vm.has_ended() {
        "Shutdown"
    } else if vm.is_paused() {
        "Paused"
    } else {
        "Running"
    };
    match described {
        Described::Ch(ch) => ch.vm_info(state),
        Described::Own(config, memory) => serde_json::json!({
            "config": config,
            "state": state,
            "memory_actual_size": memory,
        }),
    }
}

impl VmControl for ApiTarget {
    fn info(&self) -> Result<serde_json::Value, ActionError> {
        let mut info = info_json(&self.vm, &self.described);
        if let (Some(r), Some(map)) = (self.replication.get(), info.as_object_mut()) {
            // Musubi's own key beside Cloud Hypervisor's: whether a standby protects the VM.
            map.insert(
                "replication".into(),
                serde_json::to_value(r.to_metrics()).unwrap_or_default(),
            );
        }
        Ok(info)
    }

    fn counters(&self) -> Result<serde_json::Value, ActionError> {
        let counters = match &self.described {
            Described::Ch(ch) => ch.keyed_by_id(self.vm.counters()),
            Described::Own(..) => self.vm.counters(),
        };
        Ok(serde_json::to_value(counters).unwrap_or_default())
    }

    fn pause(&self) -> Result<(), ActionError> {
        self.vm.pause().map_err(refused)
    }

    fn resume(&self) -> Result<(), ActionError> {
        self.vm.resume().map_err(refused)
    }

    fn snapshot(&self, dir: &std::path::Path) -> Result<(), ActionError> {
        let r = self.vm.snapshot(dir).map_err(refused)?;
        tracing::info!(
            dir = %r.dir.display(),
            ram_mib = r.ram.ram_bytes >> 20,
            pages_written = r.ram.pages_written,
            ms = r.took.as_secs_f64() * 1e3,
            "snapshot written; the VM stays paused"
        );
        Ok(())
    }

    fn send_migration(&self, req: &musubi_api::SendMigration) -> Result<(), ActionError> {
        match &self.migrator {
            Some(m) => m
                .send(&crate::migrate::send_request(
                    req,
                    self.secret_file.as_deref(),
                )?)
                .map_err(|e| ActionError::internal(e.to_string())),
            None => Err(ActionError::internal(
                "this VMM cannot send its VM: its migrator thread did not start",
            )),
        }
    }

    fn replicate(&self, req: &musubi_api::Replicate) -> Result<(), ActionError> {
        let Some(on_request) = &self.replicate_on_request else {
            return Err(ActionError::internal(
                "this VMM cannot replicate its VM: its replication thread did not start",
            ));
        };
        let secret_file = match (&req.secret_file, &self.secret_file) {
            (Some(f), _) | (None, Some(f)) => f.clone(),
            (None, None) => {
                return Err(ActionError::internal(
                    "vm.replicate: the body names no secret_file and this VMM has no \
                     --secret-file",
                ))
            }
        };
        let policy = match req.policy.as_deref() {
            Some(p) => p
                .parse()
                .map_err(|e| ActionError::internal(format!("vm.replicate: policy {e}")))?,
            None => musubi_types::ReplicationPolicy::GoOn,
        };
        let epoch = req.epoch_ms.map_or(
            musubi_migration::replication::DEFAULT_EPOCH,
            std::time::Duration::from_millis,
        );
        on_request
            .replicate(&musubi_migration::vm::ReplicateRequest {
                url: req.url.clone(),
                secret_file,
                epoch,
                policy,
            })
            .map_err(|e| ActionError::internal(e.to_string()))
    }

    fn power_button(&self) -> Result<(), ActionError> {
        self.vm.power_button().map(drop).map_err(refused)
    }

    fn shutdown_vm(&self) -> Result<(), ActionError> {
        self.vm.stop(vmm::Outcome::Shutdown);
        Ok(())
    }
}
