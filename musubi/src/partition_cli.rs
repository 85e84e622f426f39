//! `musubi partition`: host partitions, each a cgroup with its own supervisor and VMs.

use clap::{Args, Parser, Subcommand};
use partition::manager::{
    CreateRequest, Manager, PartitionView, StorageFile, SupervisorState, VmResources,
    STORAGE_FILES_COMMAND,
};
use partition::store::{self, VmRecord, VmState};
use partition::ErrorKind;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use vmm::config::Size;

#[derive(Args, Debug)]
pub struct PartitionArgs {
    /// Where partitions are recorded [default: $MUSUBI_STATE_DIR, else
    /// /var/lib/musubi/partitions].
    #[arg(long, value_name = "DIR", global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: PartitionCommand,
}

#[derive(Args, Debug)]
struct CreateArgs {
    name: String,
    /// CPUs the partition owns, e.g. 0 or 2-3.
    #[arg(long, value_name = "LIST")]
    cpus: String,
    /// Memory limit of the partition (its supervisor and all its VMs), e.g. 2G or 1.5G.
    #[arg(long, value_name = "SIZE")]
    memory: String,
    /// NUMA memory nodes [default: all].
    #[arg(long, value_name = "NODES")]
    mems: Option<String>,
    /// Block-I/O weight (cgroup v1: 10-1000, v2: 1-10000).
    #[arg(long, value_name = "N")]
    io_weight: Option<u32>,
    /// A disk image (or block device) the partition owns; repeatable.
    #[arg(long = "disk", value_name = "FILE")]
    disks: Vec<PathBuf>,
    /// A TAP interface (by name; it need not exist yet) the partition owns; repeatable.
    #[arg(long = "tap", value_name = "NAME")]
    taps: Vec<String>,
}

impl From<CreateArgs> for CreateRequest {
    fn from(a: CreateArgs) -> CreateRequest {
        CreateRequest {
            name: a.name,
            cpus: a.cpus,
            memory: a.memory,
            mems: a.mems,
            io_weight: a.io_weight,
            disks: a.disks,
            taps: a.taps,
        }
    }
}

#[derive(Subcommand, Debug)]
enum PartitionCommand {
    /// Create a partition (a cgroup with its CPUs, memory and disks) and start its
    /// supervisor. CPU sets may not overlap, memory may not exceed what the host can give,
    /// and a disk or a TAP belongs to one partition.
    Create(CreateArgs),
    /// List partitions: resources, supervisor and VMs.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show one partition in detail.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Start a VM in a partition: `musubi partition run NAME -- --kernel probe ...`, or
    /// restore one from a snapshot: `musubi partition run NAME -- --restore DIR`. A VM whose
    /// disk, memory-storage file or TAP (`--net tap=NAME`; with --restore, the snapshot's)
    /// belongs to another partition is refused. Each VM serves its control API on `NAME/vms/ID.sock` in the
    /// state directory (for pause, resume and snapshot) unless its arguments give
    /// --api-socket PATH.
    Run {
        name: String,
        /// Wait for the VM to end, print its console and exit with its status.
        #[arg(long)]
        wait: bool,
        /// Arguments of `musubi run`.
        #[arg(last = true, required = true, value_name = "RUN ARGS")]
        args: Vec<String>,
    },
    /// Stop a VM of a partition (SIGTERM: its disks are flushed), paused or not.
    Stop { name: String, vm: u32 },
    /// Pause a running VM of a partition through its control API: its vCPUs stop where they
    /// are; its process, memory and disks stay until `resume`, `stop` or `destroy`.
    Pause { name: String, vm: u32 },
    /// Resume a VM of a partition paused by `pause` or `snapshot`.
    Resume { name: String, vm: u32 },
    /// Snapshot a running or paused VM of a partition into DIR through its control API
    /// (DIR is created if need be; a snapshot already there is replaced). The VM is paused
    /// for it and stays paused: `resume` it to go on, or `stop` it and bring it back later
    /// with `musubi partition run NAME -- --restore DIR` (or `musubi run --restore DIR`).
    /// Memory-storage files and disks are referenced, not copied: keep them unchanged until
    /// the restore.
    Snapshot {
        name: String,
        vm: u32,
        /// The snapshot directory (relative to the current directory or absolute).
        dir: PathBuf,
    },
    /// Stop a partition's supervisor and VMs and remove its cgroup and state.
    Destroy { name: String },
    /// The supervisor process itself (started by `create`).
    #[command(hide = true)]
    Supervise { name: String },
    /// Print, as JSON, the storage files and TAPs of the VM that `musubi run ARGS` would
    /// boot in this directory (asked by `run` to check disk and TAP ownership).
    #[command(name = STORAGE_FILES_COMMAND, hide = true)]
    StorageFiles {
        #[arg(last = true, value_name = "RUN ARGS")]
        args: Vec<String>,
    },
}

fn fail(e: partition::Error) -> ExitCode {
    eprintln!("musubi partition: {e}");
    ExitCode::from(match e.kind {
        ErrorKind::Refused | ErrorKind::NotFound => 1,
        ErrorKind::System => 2,
    })
}

pub fn run(args: PartitionArgs) -> ExitCode {
    let dir = store::state_dir(args.state_dir.as_deref());
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("musubi partition: cannot find the musubi executable: {e}");
            return ExitCode::from(2);
        }
    };
    let m = match Manager::new(&dir, program.clone()) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    match args.command {
        PartitionCommand::Create(args) => match m.create(&args.into()) {
            Ok(rec) => {
                let view = m.view(rec);
                println!(
                    "partition {} created: supervisor pid {}",
                    view.record.name,
                    view.record.supervisor.map(|s| s.pid).unwrap_or(0)
                );
                print_detail(&view);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::List { json } => match m.list() {
            Ok(views) if json => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&views).unwrap_or_default()
                );
                ExitCode::SUCCESS
            }
            Ok(views) => {
                print_table(&views, &m);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::Show { name, json } => match m.show(&name) {
            Ok(v) if json => {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Ok(v) => {
                print_detail(&v);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::Run { name, wait, args } => {
            let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
            match m.run(&name, &args, &cwd) {
                Ok(vm) => {
                    println!(
                        "partition {name}: vm {} started, pid {}, console {}",
                        vm.id,
                        vm.pid,
                        vm.log.display()
                    );
                    if wait {
                        wait_for(&m, &name, vm.id)
                    } else {
                        ExitCode::SUCCESS
                    }
                }
                Err(e) => fail(e),
            }
        }
        PartitionCommand::Stop { name, vm } => match m.stop(&name, vm) {
            Ok(vm) => {
                println!("partition {name}: vm {} {}", vm.id, state_text(&vm.state));
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::Pause { name, vm } => match m.pause(&name, vm) {
            Ok(vm) => {
                println!("partition {name}: vm {} {}", vm.id, state_text(&vm.state));
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::Resume { name, vm } => match m.resume(&name, vm) {
            Ok(vm) => {
                println!("partition {name}: vm {} {}", vm.id, state_text(&vm.state));
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::Snapshot { name, vm, dir } => {
            let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
            let dir = cwd.join(dir);
            match m.snapshot(&name, vm, &dir, &cwd) {
                Ok(vm) => {
                    println!(
                        "partition {name}: vm {} snapshotted into {}, {}; `musubi partition \
                         resume {name} {}` goes on, `musubi partition run {name} -- --restore \
                         {}` restores it",
                        vm.id,
                        dir.display(),
                        state_text(&vm.state),
                        vm.id,
                        dir.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        PartitionCommand::Destroy { name } => match m.destroy(&name) {
            Ok(vms) => {
                println!(
                    "partition {name} destroyed ({} VM(s) ended, cgroup removed)",
                    vms.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        PartitionCommand::StorageFiles { args } => storage_files(&args),
        PartitionCommand::Supervise { name } => {
            match partition::supervisor::run(&m.store, &name, &program) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("musubi partition supervise {name}: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// Answers `partition storage-files -- ARGS`: the VM that `musubi run ARGS` would boot is
/// parsed by the same command-line grammar and resolved by the same `to_config`, so
/// partition rules judge the storage and TAPs the VM will really use, whether flags or the
/// JSON file name them. With `--restore DIR` it is the snapshot's VM, read and checked as `run` will
/// (`open_snapshot`), so a restore is judged like a boot.
fn storage_files(args: &[String]) -> ExitCode {
    let argv = ["musubi", "run"].map(String::from).into_iter();
    let vm = match crate::Cli::try_parse_from(argv.chain(args.iter().cloned())) {
        Ok(crate::Cli {
            command: Some(crate::Command::Run(crate::RunCmd { control, .. })),
            ..
        }) if control.receive_migration.is_some() => {
            // Known only when the VM arrives: the supervisor hands the VM the other
            // partitions' files (`--foreign-storage`) and it refuses them then.
            Ok(None)
        }
        Ok(crate::Cli {
            command: Some(crate::Command::Run(crate::RunCmd { vm, control, .. })),
            ..
        }) => match &control.restore {
            Some(dir) => crate::run::open_snapshot(dir, &vm).map(|(_, config)| Some(config)),
            None => vm.to_config().map(Some),
        },
        Ok(_) => Err("the arguments after -- are not those of `musubi run`".into()),
        Err(e) => Err(e.to_string().trim_end().to_string()),
    };
    let uses = match vm {
        Ok(None) => VmResources::default(),
        Ok(Some(vm)) => VmResources {
            files: vm
                .storage_files()
                .into_iter()
                .map(|f| StorageFile {
                    flag: f.flag.to_string(),
                    path: f.path.to_path_buf(),
                })
                .collect(),
            taps: vm.net.iter().filter_map(|n| n.tap.clone()).collect(),
        },
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(1);
        }
    };
    match serde_json::to_string(&uses) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("storage files: {e}");
            ExitCode::from(2)
        }
    }
}

/// Polls the VM until it ends, then prints its console and exits with its status.
fn wait_for(m: &Manager, name: &str, id: u32) -> ExitCode {
    loop {
        let vm = match m.show(name) {
            Ok(v) => v.vms.into_iter().find(|v| v.id == id),
            Err(e) => return fail(e),
        };
        let Some(vm) = vm else {
            eprintln!("musubi partition: vm {id} of {name} disappeared");
            return ExitCode::from(2);
        };
        if !vm.state.is_live() {
            print!("{}", std::fs::read_to_string(&vm.log).unwrap_or_default());
            eprintln!("partition {name}: vm {id} {}", state_text(&vm.state));
            return match vm.state {
                VmState::Exited {
                    status: Some(s), ..
                } => ExitCode::from(s as u8),
                VmState::Exited {
                    signal: Some(sig), ..
                } => ExitCode::from(128u8.wrapping_add(sig as u8)),
                _ => ExitCode::from(2),
            };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn state_text(s: &VmState) -> String {
    match s {
        VmState::Running => "running".into(),
        VmState::Paused => "paused".into(),
        VmState::Exited {
            status,
            signal,
            stopped,
        } => {
            let how = match (status, signal) {
                (Some(c), _) => format!("status {c}"),
                (None, Some(sig)) => format!("signal {sig}"),
                _ => "unknown status".into(),
            };
            format!("exited ({how}{})", if *stopped { ", stopped" } else { "" })
        }
        VmState::Lost { reason } => format!("lost ({reason})"),
    }
}

fn supervisor_text(s: &SupervisorState) -> String {
    match s {
        SupervisorState::Running { pid } => format!("pid {pid}"),
        SupervisorState::Silent { pid, .. } => format!("pid {pid} (not answering)"),
        SupervisorState::Gone { pid: Some(p) } => format!("gone (pid {p})"),
        SupervisorState::Gone { pid: None } => "never started".into(),
    }
}

fn weight_text(v: &PartitionView) -> String {
    match (v.record.io_weight, &v.record.io_weight_file) {
        (None, _) => "-".into(),
        (Some(w), Some(_)) => w.to_string(),
        (Some(w), None) => format!("{w} (not enforced)"),
    }
}

fn vm_line(vm: &VmRecord) -> String {
    format!(
        "  vm {}  pid {}  {}  started {}  console {}{}  run {}",
        vm.id,
        vm.pid,
        state_text(&vm.state),
        vm.started,
        vm.log.display(),
        match &vm.api_socket {
            Some(p) => format!("  api {}", p.display()),
            None => String::new(),
        },
        vm.args.join(" ")
    )
}

fn print_table(views: &[PartitionView], m: &Manager) {
    if views.is_empty() {
        println!("no partitions in {}", m.store.dir.display());
        return;
    }
    println!(
        "{:<16} {:<8} {:<5} {:<8} {:<10} {:<5} {:<16} {:<20} VMS",
        "NAME", "CPUS", "MEMS", "MEMORY", "IO-WEIGHT", "DISKS", "TAPS", "SUPERVISOR"
    );
    for v in views {
        let running = v.vms.iter().filter(|x| x.state == VmState::Running).count();
        let paused = v.vms.iter().filter(|x| x.state == VmState::Paused).count();
        let lost = v
            .vms
            .iter()
            .filter(|x| matches!(x.state, VmState::Lost { .. }))
            .count();
        println!(
            "{:<16} {:<8} {:<5} {:<8} {:<10} {:<5} {:<16} {:<20} {} running, {} paused, {} lost, \
             {} total",
            v.record.name,
            v.record.cpus.to_string(),
            v.record.mems.to_string(),
            Size(v.record.memory),
            weight_text(v),
            v.record.disks.len(),
            if v.record.taps.is_empty() {
                "-".to_string()
            } else {
                v.record.taps.join(",")
            },
            supervisor_text(&v.supervisor_state),
            running,
            paused,
            lost,
            v.vms.len()
        );
        for vm in &v.vms {
            println!("{}", vm_line(vm));
        }
    }
}

fn print_detail(v: &PartitionView) {
    let r = &v.record;
    println!("partition {}", r.name);
    println!("  cpus        {}", r.cpus);
    println!("  mems        {}", r.mems);
    println!("  memory      {}", Size(r.memory));
    println!("  io-weight   {}", weight_text(v));
    for d in &r.disks {
        println!("  disk        {}", d.display());
    }
    for t in &r.taps {
        println!("  tap         {t}");
    }
    println!("  cgroup      v{}", r.cgroup.version);
    for p in &r.cgroup.places {
        println!("    {:<9} {}", p.controller, p.dir().display());
    }
    println!("  supervisor  {}", supervisor_text(&v.supervisor_state));
    if let SupervisorState::Silent { error, .. } = &v.supervisor_state {
        println!("    {error}");
    }
    println!("  log         {}", v.supervisor_log.display());
    println!("  socket      {}", v.socket.display());
    if v.vms.is_empty() {
        println!("  no VMs");
    }
    for vm in &v.vms {
        println!("{}", vm_line(vm));
    }
}
