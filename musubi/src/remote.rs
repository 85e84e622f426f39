//! `musubi remote`: one request to a running VM's API socket, its answer printed.

use crate::migrate::MigrationUrl;
use crate::value::{from_str, Own};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct RemoteArgs {
    /// The socket the VM serves its API on (`run --api-socket PATH`, `node --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    api_socket: PathBuf,
    #[command(subcommand)]
    command: RemoteCommand,
}

#[derive(Subcommand, Debug)]
enum RemoteCommand {
    /// Print the VMM's version and process id (GET vmm.ping).
    Ping,
    /// Print the VM's configuration and state (Created, Running, Paused or Shutdown), as
    /// Cloud Hypervisor's VmInfo (GET vm.info).
    Info,
    /// Print the VM's counters (GET vm.counters).
    Counters,
    /// Pause the VM's vCPUs (PUT vm.pause); a paused VM answers an error.
    Pause,
    /// Resume a paused VM (PUT vm.resume).
    Resume,
    /// Write a snapshot of the VM into DIR (PUT vm.snapshot with file://DIR, made absolute).
    Snapshot {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// Shut the VM down (PUT vm.shutdown): under `run` the process ends with it; a waiting
    /// `musubi vmm` keeps its config, and `boot` boots it afresh.
    Shutdown,
    /// Create a VM from Cloud Hypervisor's VmConfig JSON in FILE, on a waiting `musubi vmm`
    /// (PUT vm.create); it stays Created until `boot`.
    Create {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Boot the created VM, or boot afresh one that was shut down (PUT vm.boot).
    Boot,
    /// Restart the running VM from its config (PUT vm.reboot).
    Reboot,
    /// Press the VM's ACPI power button (PUT vm.power-button): a guest that handles it
    /// shuts down, one that ignores it runs on.
    PowerButton,
    /// Stop the VM if it runs and forget it; the VMM waits for the next `create`
    /// (PUT vm.delete).
    Delete,
    /// End the VMM process, and its VM if any (PUT vmm.shutdown), as ch-remote spells it.
    ShutdownVmm,
    /// Add a disk to a VM not running, for its next boot (PUT vm.add-disk with Cloud
    /// Hypervisor's DiskConfig).
    AddDisk {
        #[arg(value_name = "path=FILE[,readonly=on|off][,cache=writeback|none]", value_parser = from_str::<vmm::config::DiskConfig>())]
        disk: vmm::config::DiskConfig,
        /// The device's id; without it the VMM gives one (`_disk1`, ...).
        #[arg(long, value_name = "ID")]
        id: Option<String>,
    },
    /// Add a network device to a VM not running (PUT vm.add-net with Cloud Hypervisor's
    /// NetConfig); the spec is `run --net`'s.
    AddNet {
        #[arg(value_name = "tap=NAME[,ip=ADDR,mask=MASK][,mac=MAC][,num_queues=Q]", value_parser = from_str::<vmm::config::net::NetConfig>())]
        net: vmm::config::net::NetConfig,
        #[arg(long, value_name = "ID")]
        id: Option<String>,
    },
    /// Add memory storage to a VM not running (PUT vm.add-pmem with Cloud Hypervisor's
    /// PmemConfig); the spec is `run --pmem`'s without `advertise`.
    AddPmem {
        #[arg(value_name = "file=PATH[,size=SIZE]", value_parser = from_str::<vmm::pmem::PmemConfig>())]
        pmem: vmm::pmem::PmemConfig,
        #[arg(long, value_name = "ID")]
        id: Option<String>,
    },
    /// Add a vsock device to a VM not running (PUT vm.add-vsock with Cloud Hypervisor's
    /// VsockConfig); the spec is `run --vsock`'s.
    AddVsock {
        #[arg(value_name = "cid=N,socket=PATH", value_parser = from_str::<vmm::config::vsock::VsockConfig>())]
        vsock: vmm::config::vsock::VsockConfig,
        #[arg(long, value_name = "ID")]
        id: Option<String>,
    },
    /// Remove the device with this id from a VM not running (PUT vm.remove-device).
    RemoveDevice {
        #[arg(value_name = "ID")]
        id: String,
    },
    /// Put back the VM a snapshot in DIR holds, in a waiting `musubi vmm` (PUT vm.restore);
    /// it waits paused for `resume` unless --resume is given.
    Restore {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Read the whole memory file in before the VM runs.
        #[arg(long, conflicts_with = "on_demand")]
        prefault: bool,
        /// Fill RAM page by page at the guest's first touch, through userfaultfd.
        #[arg(long)]
        on_demand: bool,
        /// Run the VM at once.
        #[arg(long)]
        resume: bool,
    },
    /// Make a waiting `musubi vmm` wait on tcp:HOST:PORT for a VM another VMM sends (PUT
    /// vm.receive-migration); exits 0 once the VM runs there.
    ReceiveMigration {
        #[arg(value_name = "tcp:HOST:PORT", value_parser = from_str::<MigrationUrl>())]
        url: MigrationUrl,
        /// The shared secret, the same file as the sender's; without it the VMM's own
        /// --secret-file.
        #[arg(long, value_name = "FILE")]
        secret_file: Option<PathBuf>,
    },
    /// Move vCPU N of a VM over several hosts to node K while it runs (PUT vm.move-vcpu, on
    /// the I/O node's socket, `node --api-socket`); exits 0 once it runs there. Its pages
    /// follow it as it touches them.
    MoveVcpu {
        #[arg(long, value_name = "N")]
        vcpu: u8,
        #[arg(long, value_name = "K")]
        node: u16,
    },
    /// Move the VM, live, to the musubi waiting at tcp:HOST:PORT (`run --receive-migration`,
    /// or a waiting `musubi vmm` told `receive-migration`)
    /// (PUT vm.send-migration). Exits 0 once it runs there; on a failure before the switch
    /// the VM runs on here.
    SendMigration {
        #[arg(value_name = "tcp:HOST:PORT", value_parser = from_str::<MigrationUrl>())]
        url: MigrationUrl,
        /// The shared secret, the same file as the destination's --secret-file; without it
        /// the VMM's own --secret-file.
        #[arg(long, value_name = "FILE")]
        secret_file: Option<PathBuf>,
        /// postcopy: switch at once and let the pages follow (the pause holds no page).
        /// precopy: copy the pages while the VM runs, in rounds, and pause once what is left
        /// fits --downtime-ms (nothing follows the switch).
        #[arg(long, value_enum, default_value_t = MigrationMode::Postcopy)]
        mode: MigrationMode,
        /// Pre-copy: pause once what is left can be sent within this many milliseconds
        /// at the last round's rate [default: 300].
        #[arg(long, value_name = "MS")]
        downtime_ms: Option<u64>,
        /// Pre-copy: pause after this many rounds whatever is left [default: 10].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
        max_rounds: Option<u32>,
        /// Post-copy: most bytes per second the background push sends after the switch
        /// (K, M, G suffixes; at least 4K); pages the VM asks for are never held back.
        #[arg(long, value_name = "BYTES_PER_S", value_parser = Own(push_limit))]
        push_limit: Option<u64>,
    },
    /// Keep the VM on the standby waiting at tcp:HOST:PORT (`run --standby-for`), which
    /// takes over if this VMM dies (PUT vm.replicate, Musubi's own call). Exits 0 once the
    /// standby has taken the VM; `remote info` then shows where the replication stands.
    Replicate {
        #[arg(long, value_name = "tcp:HOST:PORT", value_parser = from_str::<MigrationUrl>())]
        to: MigrationUrl,
        /// The shared secret, the same file as the standby's --secret-file; without it the
        /// VMM's own --secret-file.
        #[arg(long, value_name = "FILE")]
        secret_file: Option<PathBuf>,
        /// Time between two checkpoints, in milliseconds [default: 20].
        #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        epoch: Option<u64>,
        /// What the VM does if its standby is lost: go-on (alone) or stop (paused until
        /// vm.resume) [default: go-on].
        #[arg(long, value_name = "go-on|stop", value_parser = from_str::<musubi_types::ReplicationPolicy>())]
        policy: Option<musubi_types::ReplicationPolicy>,
    },
}

/// The method, endpoint and body a command sends.
fn request_of(
    command: &RemoteCommand,
) -> Result<(&'static str, &'static str, Option<String>), String> {
    Ok(match command {
        RemoteCommand::Ping => ("GET", "vmm.ping", None),
        RemoteCommand::Info => ("GET", "vm.info", None),
        RemoteCommand::Counters => ("GET", "vm.counters", None),
        RemoteCommand::Pause => ("PUT", "vm.pause", None),
        RemoteCommand::Resume => ("PUT", "vm.resume", None),
        RemoteCommand::Shutdown => ("PUT", "vm.shutdown", None),
        RemoteCommand::ShutdownVmm => ("PUT", "vmm.shutdown", None),
        RemoteCommand::AddDisk { disk, id } => (
            "PUT",
            "vm.add-disk",
            Some(with_id(crate::ch_config::disk_json(disk), id)),
        ),
        RemoteCommand::AddNet { net, id } => (
            "PUT",
            "vm.add-net",
            Some(with_id(crate::ch_config::net_json(net), id)),
        ),
        RemoteCommand::AddPmem { pmem, id } => (
            "PUT",
            "vm.add-pmem",
            Some(with_id(crate::ch_config::pmem_json(pmem), id)),
        ),
        RemoteCommand::AddVsock { vsock, id } => (
            "PUT",
            "vm.add-vsock",
            Some(with_id(
                serde_json::json!({
                    "cid": vsock.cid,
                    "socket": std::path::absolute(&vsock.socket)
                        .map_err(|e| format!("--vsock socket={}: {e}", vsock.socket.display()))?,
                }),
                id,
            )),
        ),
        RemoteCommand::RemoveDevice { id } => (
            "PUT",
            "vm.remove-device",
            Some(serde_json::json!({ "id": id }).to_string()),
        ),
        RemoteCommand::Restore {
            dir,
            prefault,
            on_demand,
            resume,
        } => {
            let mut body: serde_json::Value = serde_json::from_str(&snapshot_body(dir)?)
                .map_err(|e| format!("snapshot directory {}: {e}", dir.display()))?;
            body["source_url"] = body["destination_url"].take();
            if let Some(o) = body.as_object_mut() {
                o.remove("destination_url");
            }
            body["prefault"] = (*prefault).into();
            body["memory_restore_mode"] = if *on_demand { "OnDemand" } else { "Copy" }.into();
            body["resume"] = (*resume).into();
            ("PUT", "vm.restore", Some(body.to_string()))
        }
        RemoteCommand::ReceiveMigration { url, secret_file } => {
            let mut body = serde_json::json!({ "receiver_url": url.as_str() });
            if let Some(f) = secret_file {
                body["secret_file"] = absolute_secret(f)?.into();
            }
            ("PUT", "vm.receive-migration", Some(body.to_string()))
        }
        RemoteCommand::Create { file } => ("PUT", "vm.create", Some(create_body(file)?)),
        RemoteCommand::Boot => ("PUT", "vm.boot", None),
        RemoteCommand::Reboot => ("PUT", "vm.reboot", None),
        RemoteCommand::PowerButton => ("PUT", "vm.power-button", None),
        RemoteCommand::Delete => ("PUT", "vm.delete", None),
        RemoteCommand::MoveVcpu { vcpu, node } => (
            "PUT",
            "vm.move-vcpu",
            Some(serde_json::json!({ "vcpu": vcpu, "node": node }).to_string()),
        ),
        RemoteCommand::Snapshot { dir } => ("PUT", "vm.snapshot", Some(snapshot_body(dir)?)),
        RemoteCommand::SendMigration {
            url,
            secret_file,
            mode,
            downtime_ms,
            max_rounds,
            push_limit,
        } => {
            let mut body = migration_body(url, secret_file.as_deref())?;
            match mode {
                MigrationMode::Postcopy => {
                    if downtime_ms.is_some() || max_rounds.is_some() {
                        return Err("--downtime-ms and --max-rounds bound a pre-copy; add \
                                    --mode precopy"
                            .into());
                    }
                    if let Some(limit) = push_limit {
                        body["push_limit"] = (*limit).into();
                    }
                }
                MigrationMode::Precopy if push_limit.is_some() => {
                    return Err("--push-limit bounds a post-copy's background push; a \
                                pre-copy pushes nothing after the switch"
                        .into());
                }
                MigrationMode::Precopy => {
                    body["mode"] = "precopy".into();
                    if let Some(ms) = downtime_ms {
                        body["downtime_ms"] = (*ms).into();
                    }
                    if let Some(n) = max_rounds {
                        body["max_rounds"] = (*n).into();
                    }
                }
            }
            ("PUT", "vm.send-migration", Some(body.to_string()))
        }
        RemoteCommand::Replicate {
            to,
            secret_file,
            epoch,
            policy,
        } => {
            let mut body = migration_body(to, secret_file.as_deref())?;
            if let Some(ms) = epoch {
                body["epoch_ms"] = (*ms).into();
            }
            if let Some(p) = policy {
                body["policy"] = p.to_string().into();
            }
            ("PUT", "vm.replicate", Some(body.to_string()))
        }
    })
}

/// `{"destination_url": "file:///abs/dir"}`: the VM runs in another process with its own
/// working directory, so a relative DIR is made absolute here.
fn snapshot_body(dir: &Path) -> Result<String, String> {
    let abs = std::path::absolute(dir)
        .map_err(|e| format!("snapshot directory {}: {e}", dir.display()))?;
    let abs = abs
        .to_str()
        .ok_or_else(|| format!("snapshot directory {}: not UTF-8", abs.display()))?;
    Ok(serde_json::json!({ "destination_url": format!("file://{abs}") }).to_string())
}

/// The VmConfig file's text, checked to be JSON here so that a wrong path or a stray file is
/// named on this side rather than coming back as the VMM's anonymous "bad body".
fn create_body(file: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("VmConfig file {}: {e}", file.display()))?;
    serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| format!("VmConfig file {}: not JSON: {e}", file.display()))?;
    Ok(text)
}

/// `--push-limit`'s bytes per second: a size, at least one page.
fn push_limit(value: &str) -> Result<u64, String> {
    let n = vmm::config::parse_size("--push-limit", value).map_err(|e| e.to_string())?;
    if n < 4096 {
        return Err(format!(
            "--push-limit {value}: at least 4K (one page) per second"
        ));
    }
    Ok(n)
}

/// How `send-migration` moves guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MigrationMode {
    Postcopy,
    Precopy,
}

/// `{"destination_url": URL, "secret_file": "/abs/path"}`, without the secret file when
/// none is given (the VMM uses its own).
fn migration_body(
    url: &MigrationUrl,
    secret_file: Option<&Path>,
) -> Result<serde_json::Value, String> {
    let mut body = serde_json::json!({ "destination_url": url.as_str() });
    if let Some(f) = secret_file {
        body["secret_file"] = absolute_secret(f)?.into();
    }
    Ok(body)
}

/// `--secret-file` made absolute: the VMM runs in another working directory.
fn absolute_secret(secret_file: &Path) -> Result<String, String> {
    let abs = std::path::absolute(secret_file)
        .map_err(|e| format!("--secret-file {}: {e}", secret_file.display()))?;
    abs.to_str()
        .map(String::from)
        .ok_or_else(|| format!("--secret-file {}: not UTF-8", abs.display()))
}

/// A device body with the id asked for, if one was.
fn with_id(mut device: serde_json::Value, id: &Option<String>) -> String {
    if let Some(id) = id {
        device["id"] = id.as_str().into();
    }
    device.to_string()
}

/// The answer's body to print on success, or the message for a refusal.
fn call(args: &RemoteArgs) -> Result<String, String> {
    let (method, endpoint, body) = request_of(&args.command)?;
    let path = format!("{}/{endpoint}", musubi_api::API_ROOT);
    let (status, answer) = musubi_api::request(&args.api_socket, method, &path, body.as_deref())
        .map_err(|e| e.to_string())?;
    if !(200..300).contains(&status) {
        // CH's error answers are a list of messages, the outermost first.
        let message = match serde_json::from_str::<Vec<String>>(&answer) {
            Ok(list) => list.join(": "),
            Err(_) => answer,
        };
        return Err(format!("{endpoint}: the VM answered {status}: {message}"));
    }
    Ok(match serde_json::from_str::<serde_json::Value>(&answer) {
        Ok(v) => serde_json::to_string_pretty(&v).unwrap_or(answer),
        Err(_) => answer,
    })
}

pub fn run(args: &RemoteArgs) -> ExitCode {
    match call(args) {
        Ok(out) => {
            if !out.is_empty() {
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("musubi: remote: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use musubi_api::{ActionError, ApiServer, VmControl};
    use std::sync::{Arc, Mutex};

    /// A VM that records what it is asked; pausing it twice is refused as CH refuses it.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<String>>,
    }

    impl Recorder {
        fn note(&self, s: String) -> Result<(), ActionError> {
            let mut calls = self.calls.lock().unwrap();
            let twice = s == "pause" && calls.iter().any(|c| c == "pause");
            calls.push(s);
            if twice {
                return Err(ActionError::internal(
                    "invalid VM state transition: Paused to Paused",
                ));
            }
            Ok(())
        }
    }

    impl VmControl for Recorder {
        fn info(&self) -> Result<serde_json::Value, ActionError> {
            Ok(serde_json::json!({"config": {}, "state": "Running"}))
        }
        fn counters(&self) -> Result<serde_json::Value, ActionError> {
            Ok(serde_json::json!({}))
        }
        fn pause(&self) -> Result<(), ActionError> {
            self.note("pause".into())
        }
        fn resume(&self) -> Result<(), ActionError> {
            self.note("resume".into())
        }
        fn snapshot(&self, dir: &Path) -> Result<(), ActionError> {
            self.note(format!("snapshot {}", dir.display()))
        }
        fn shutdown_vm(&self) -> Result<(), ActionError> {
            self.note("shutdown_vm".into())
        }
        fn shutdown_vmm(&self) -> Result<(), ActionError> {
            self.note("shutdown_vmm".into())
        }
        fn create(&self, body: &[u8]) -> Result<(), ActionError> {
            self.note(format!("create {}", String::from_utf8_lossy(body)))
        }
        fn boot(&self) -> Result<(), ActionError> {
            self.note("boot".into())
        }
        fn reboot(&self) -> Result<(), ActionError> {
            self.note("reboot".into())
        }
        fn delete(&self) -> Result<(), ActionError> {
            self.note("delete".into())
        }
        fn power_button(&self) -> Result<(), ActionError> {
            self.note("power_button".into())
        }
        fn add_device(&self, kind: musubi_api::DeviceKind, body: &[u8]) -> Result<(), ActionError> {
            let body: serde_json::Value = serde_json::from_slice(body).unwrap();
            self.note(format!("add {kind:?} {body}"))
        }
        fn remove_device(&self, id: &str) -> Result<(), ActionError> {
            self.note(format!("remove {id}"))
        }
        fn restore(&self, r: &musubi_api::Restore) -> Result<(), ActionError> {
            self.note(format!("restore {r:?}"))
        }
        fn receive_migration(&self, r: &musubi_api::ReceiveMigration) -> Result<(), ActionError> {
            self.note(format!("receive {r:?}"))
        }
        fn replicate(&self, r: &musubi_api::Replicate) -> Result<(), ActionError> {
            self.note(format!("replicate {r:?}"))
        }
    }

    #[test]
    fn replicate_sends_the_standby_an_absolute_secret_the_epoch_and_the_policy() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vm = Arc::new(Recorder::default());
        let _server = ApiServer::start(&socket, vm.clone(), || Ok(())).unwrap();
        let replicate = RemoteCommand::Replicate {
            to: "tcp:127.0.0.1:7001".parse().unwrap(),
            secret_file: Some(PathBuf::from("/k")),
            epoch: Some(5),
            policy: Some(musubi_types::ReplicationPolicy::Stop),
        };
        call(&args(&socket, replicate)).unwrap();
        let bare = RemoteCommand::Replicate {
            to: "tcp:127.0.0.1:7001".parse().unwrap(),
            secret_file: None,
            epoch: None,
            policy: None,
        };
        call(&args(&socket, bare)).unwrap();
        let calls = vm.calls.lock().unwrap();
        assert_eq!(
            calls[..],
            [
                r#"replicate Replicate { url: "tcp:127.0.0.1:7001", secret_file: Some("/k"), epoch_ms: Some(5), policy: Some("stop") }"#,
                r#"replicate Replicate { url: "tcp:127.0.0.1:7001", secret_file: None, epoch_ms: None, policy: None }"#,
            ]
        );
    }

    #[test]
    fn device_restore_and_migration_verbs_send_cloud_hypervisors_bodies() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vm = Arc::new(Recorder::default());
        let _server = ApiServer::start(&socket, vm.clone(), || Ok(())).unwrap();
        let disk = RemoteCommand::AddDisk {
            disk: "path=/d.img,cache=none".parse().unwrap(),
            id: Some("data".into()),
        };
        call(&args(&socket, disk)).unwrap();
        let net = RemoteCommand::AddNet {
            net: "tap=t0".parse().unwrap(),
            id: None,
        };
        call(&args(&socket, net)).unwrap();
        let remove = RemoteCommand::RemoveDevice { id: "data".into() };
        call(&args(&socket, remove)).unwrap();
        let restore = RemoteCommand::Restore {
            dir: PathBuf::from("/s"),
            prefault: true,
            on_demand: false,
            resume: true,
        };
        call(&args(&socket, restore)).unwrap();
        let receive = RemoteCommand::ReceiveMigration {
            url: "tcp:127.0.0.1:7000".parse().unwrap(),
            secret_file: None,
        };
        call(&args(&socket, receive)).unwrap();
        let calls = vm.calls.lock().unwrap();
        assert_eq!(calls.len(), 5, "{calls:?}");
        assert!(
            calls[0].starts_with("add Disk")
                && calls[0].contains(r#""direct":true"#)
                && calls[0].contains(r#""id":"data""#)
                && calls[0].contains(r#""path":"/d.img""#),
            "{}",
            calls[0]
        );
        assert!(
            calls[1].starts_with("add Net") && calls[1].contains(r#""tap":"t0""#),
            "{}",
            calls[1]
        );
        assert_eq!(calls[2], "remove data");
        assert_eq!(
            calls[3],
            r#"restore Restore { dir: "/s", prefault: true, on_demand: false, resume: true }"#
        );
        assert_eq!(
            calls[4],
            r#"receive ReceiveMigration { url: "tcp:127.0.0.1:7000", secret_file: None }"#
        );
    }

    fn args(socket: &Path, command: RemoteCommand) -> RemoteArgs {
        RemoteArgs {
            api_socket: socket.to_path_buf(),
            command,
        }
    }

    #[test]
    fn commands_reach_the_vm_and_refusals_carry_chs_messages() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vm = Arc::new(Recorder::default());
        let _server = ApiServer::start(&socket, vm.clone(), || Ok(())).unwrap();
        let info = call(&args(&socket, RemoteCommand::Info)).unwrap();
        assert!(info.contains("\"state\": \"Running\""), "{info}");
        assert_eq!(call(&args(&socket, RemoteCommand::Pause)).unwrap(), "");
        let e = call(&args(&socket, RemoteCommand::Pause)).unwrap_err();
        assert!(e.contains("500") && e.contains("Paused to Paused"), "{e}");
        let snap = RemoteCommand::Snapshot {
            dir: PathBuf::from("rel/snap"),
        };
        call(&args(&socket, snap)).unwrap();
        call(&args(&socket, RemoteCommand::Shutdown)).unwrap();
        call(&args(&socket, RemoteCommand::ShutdownVmm)).unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            *vm.calls.lock().unwrap(),
            [
                "pause".to_string(),
                "pause".into(),
                format!("snapshot {}", cwd.join("rel/snap").display()),
                "shutdown_vm".into(),
                "shutdown_vmm".into(),
            ]
        );
    }

    #[test]
    fn the_life_cycle_verbs_reach_the_vmm_and_a_bad_config_file_never_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vm = Arc::new(Recorder::default());
        let _server = ApiServer::start(&socket, vm.clone(), || Ok(())).unwrap();
        let config = dir.path().join("vm.json");
        std::fs::write(&config, r#"{"cpus": {"boot_vcpus": 1}}"#).unwrap();
        let create = |file: &Path| {
            call(&args(
                &socket,
                RemoteCommand::Create {
                    file: file.to_path_buf(),
                },
            ))
        };
        create(&config).unwrap();
        for command in [
            RemoteCommand::Boot,
            RemoteCommand::Reboot,
            RemoteCommand::Delete,
            RemoteCommand::ShutdownVmm,
        ] {
            call(&args(&socket, command)).unwrap();
        }
        let missing = dir.path().join("missing.json");
        let e = create(&missing).unwrap_err();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        let text = dir.path().join("text.json");
        std::fs::write(&text, "cpus=1").unwrap();
        let e = create(&text).unwrap_err();
        assert!(
            e.contains(&text.display().to_string()) && e.contains("not JSON"),
            "{e}"
        );
        assert_eq!(
            *vm.calls.lock().unwrap(),
            [
                r#"create {"cpus": {"boot_vcpus": 1}}"#,
                "boot",
                "reboot",
                "delete",
                "shutdown_vmm"
            ]
        );
    }

    #[test]
    fn power_button_reaches_the_vm_as_a_bodiless_put() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vm = Arc::new(Recorder::default());
        let _server = ApiServer::start(&socket, vm.clone(), || Ok(())).unwrap();
        assert_eq!(
            request_of(&RemoteCommand::PowerButton).unwrap(),
            ("PUT", "vm.power-button", None)
        );
        assert_eq!(
            call(&args(&socket, RemoteCommand::PowerButton)).unwrap(),
            ""
        );
        assert_eq!(*vm.calls.lock().unwrap(), ["power_button"]);
    }

    #[test]
    fn a_missing_socket_is_named() {
        let e = call(&args(
            Path::new("/nonexistent/vm.sock"),
            RemoteCommand::Ping,
        ))
        .unwrap_err();
        assert!(e.contains("/nonexistent/vm.sock"), "{e}");
    }
}
