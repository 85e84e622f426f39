//! `musubi`: the command-line front end of the Musubi hypervisor.

mod api_target;
mod bench;
mod ch_config;
mod cli;
mod cluster_cli;
mod console;
mod demo;
mod migrate;
mod node_api;
mod partition_cli;
mod probe;
mod remote;
mod run;
mod value;
mod waiting;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// dlmalloc rather than musl's allocator. musl's returns freed memory to the kernel at once,
/// so start-up's short-lived buffers cost an mmap and an munmap each, and an munmap in a
/// process with a thread on another core is a TLB shoot-down: an inter-processor interrupt,
/// a VM exit on a virtual host. Measured on such a host (31 runs), parsing `run`'s arguments
/// beside the KVM helper took 0.40 ms with musl's allocator and 0.15 ms with this one, and
/// compiling the vCPU's seccomp filter 0.13 and 0.03 ms. dlmalloc keeps freed chunks for
/// reuse and gives memory back only past a 2 MiB trim threshold. Between fork and exec no
/// child of this program allocates (every `pre_exec` closure says so), so its one lock
/// needs no fork handlers.
#[global_allocator]
static ALLOC: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

#[derive(Parser)]
#[command(
    name = "musubi",
    version,
    about = "A KVM hypervisor: storage as memory, kernel or user exit paths, host partitions"
)]
#[command(args_conflicts_with_subcommands = true, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// With no command: `musubi vmm --api-socket PATH`, as Cloud Hypervisor starts.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Boot one VM and run it until the guest exits, shuts down or crashes. The exit status
    /// is the guest's (probe guest: its exit port; other guests: 0 on shutdown or reboot),
    /// 0 after Ctrl-A x, 125 if the guest crashed, 126 on a VMM error, 128+N on signal N.
    ///
    /// With --serial stdio (the default) stdin is the guest's console input. On a terminal
    /// it is raw (every key, Ctrl-C too, goes to the guest; restored at exit) and Ctrl-A
    /// starts a command: Ctrl-A x quits, Ctrl-A Ctrl-A sends Ctrl-A, Ctrl-A h lists them.
    /// Piped stdin goes to the guest unchanged; its end leaves the VM running.
    Run(RunCmd),
    /// Run one node of a VM spread over several hosts, as the cluster file describes
    /// (JSON: "vm" with the fields of --config, "nodes" [{"address": "IP:PORT", "vcpus":
    /// [..]}], "protocol", "ordering", "secret_file", "io_node", and "link_delay",
    /// "fetch_poll" and "page_hold" as --link-delay, --fetch-poll and --page-hold of run).
    /// Every node must be
    /// started with the same cluster file, VM and secret; the node with vCPU 0 (io_node)
    /// holds the devices. Exits with the VM's status, or 123 when a node is lost.
    Node {
        #[arg(long, value_name = "FILE")]
        cluster: std::path::PathBuf,
        /// Which entry of the cluster's "nodes" this is (0-based). Without it, the rank a
        /// launcher gave the process: OMPI_COMM_WORLD_RANK (mpirun), PMI_RANK or
        /// SLURM_PROCID (srun), the first one set.
        #[arg(long, value_name = "K")]
        id: Option<u16>,
        /// VM flags override the cluster file's "vm" section.
        #[command(flatten)]
        vm: cli::VmArgs,
        /// This node's report and metrics (with its coherence counters).
        #[command(flatten)]
        run: cli::RunFlags,
        /// Serve the control API on this UNIX socket (created mode 0600): info (with the
        /// node each vCPU runs on), counters, move-vcpu (on the I/O node), shutdown.
        /// `musubi remote --api-socket PATH` is its client.
        #[arg(long, value_name = "PATH")]
        api_socket: Option<std::path::PathBuf>,
    },
    /// Start with no VM and serve the control API on this UNIX socket (created mode 0600),
    /// with Cloud Hypervisor's life cycle: vm.create (its VmConfig JSON, Musubi's own
    /// settings under "musubi"), vm.boot, vm.pause, vm.resume, vm.shutdown, vm.reboot,
    /// vm.power-button, vm.delete, vm.info, vm.counters, vm.snapshot, vm.restore,
    /// vm.send-migration, vm.receive-migration and the cold-plug calls (vm.add-disk,
    /// add-net, add-pmem, add-vsock, remove-device); vmm.shutdown ends the process. A guest
    /// that ends on its own leaves the VMM waiting, its VM in state Shutdown.
    Vmm {
        /// The UNIX socket to serve the API on; `musubi remote --api-socket PATH` and
        /// Cloud Hypervisor's ch-remote are its clients.
        #[arg(long, value_name = "PATH")]
        api_socket: std::path::PathBuf,
        /// System-call filters of each VM's threads and of the API thread, as for run.
        #[arg(long, value_name = "true|false|log", default_value = "true")]
        seccomp: vmm::seccomp::SeccompMode,
        /// The shared secret (a file of at least 16 bytes, mode 0600, the same on both ends)
        /// of a vm.send-migration or vm.receive-migration whose body names none: Cloud
        /// Hypervisor's clients cannot name one.
        #[arg(long, value_name = "FILE")]
        secret_file: Option<std::path::PathBuf>,
    },
    /// Boot the bundled probe guest on 2 vCPUs with a temporary disk, run hello, blk-fill
    /// and blk-crc, check the disk on the host, and summarize.
    Demo,
    /// Run an experiment and report it beside the papers' figures (`musubi bench --help`
    /// lists them; the musubi-bench program beside this one runs them).
    Bench(bench::BenchArgs),
    /// Host partitions: disjoint CPUs, memory and disks, each with its own supervisor and VMs.
    Partition(partition_cli::PartitionArgs),
    /// Ask a VMM started with `vmm --api-socket PATH` or `run --api-socket PATH` (or a node
    /// started with `node --api-socket PATH`) for its state or an action, over its HTTP API
    /// (Cloud Hypervisor's paths, so ch-remote and curl work too).
    Remote(remote::RemoteArgs),
    /// The bundled probe guest.
    Guest {
        #[command(subcommand)]
        command: GuestCommand,
    },
}

/// The arguments of `run`, apart so that [`parse`] can read them without building every
/// other subcommand.
#[derive(clap::Args, Debug)]
struct RunCmd {
    #[command(flatten)]
    vm: cli::VmArgs,
    #[command(flatten)]
    run: cli::RunFlags,
    // Boxed: the control flags would make this variant several times the size of the others.
    #[command(flatten)]
    control: Box<cli::ControlFlags>,
    /// Spread the VM over N node processes on this host, linked over loopback TCP (or
    /// their own network with --netns): the
    /// vCPUs are dealt round-robin, guest RAM is kept coherent page by page, node 0
    /// holds the devices. Exit status as without it; 123 if a node was lost. --pmem is
    /// refused with more than one node.
    #[arg(long, value_name = "N")]
    nodes: Option<u16>,
    /// Coherence protocol with --nodes: `vmp` (the paper's manager protocol) or `ivy`.
    #[arg(
        long,
        value_name = "vmp|ivy",
        default_value = "vmp",
        requires = "nodes"
    )]
    protocol: dsm::Protocol,
    /// Memory ordering with --nodes: `tso` (x86 ordering across nodes) or `paper` (the
    /// paper's unacknowledged invalidations; UNSAFE for x86 guests: a reader can see a
    /// new flag and old data).
    #[arg(
        long,
        value_name = "tso|paper",
        default_value = "tso",
        requires = "nodes"
    )]
    ordering: dsm::Ordering,
    #[command(flatten)]
    net: cluster_cli::NetFlags,
}

#[derive(Subcommand)]
enum GuestCommand {
    /// Write the probe guest's ELF to the cache directory and print its path (so QEMU can
    /// boot the same image).
    Path,
}

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Output piped into `head` and the like ends quietly, as for other command-line tools.
    // SAFETY: restoring a signal's default disposition has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // Without MUSUBI_LOG a plain level filter: parsing filter directives is start-up time
    // every run would pay for a feature few runs use. With it, a level, targets with levels,
    // or both (`info`, `dsm_host::coherence=trace,warn`): tracing-subscriber's `Targets`,
    // which needs no regular-expression engine in the binary, unlike its `EnvFilter`.
    match std::env::var("MUSUBI_LOG") {
        Ok(spec) => {
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::util::SubscriberInitExt;
            let targets = spec
                .parse::<tracing_subscriber::filter::Targets>()
                .unwrap_or_else(|e| {
                    eprintln!(
                        "musubi: MUSUBI_LOG={spec:?}: {e} (expected LEVEL or TARGET=LEVEL, \
                         comma-separated); logging warnings only"
                    );
                    tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN)
                });
            tracing_subscriber::registry()
                .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
                .with(targets)
                .init()
        }
        Err(_) => tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::WARN)
            .init(),
    }
    let cli = parse(args);
    let command = match (cli.command, cli.api_socket) {
        (Some(c), _) => c,
        (None, Some(api_socket)) => Command::Vmm {
            api_socket,
            seccomp: vmm::seccomp::SeccompMode::default(),
            secret_file: None,
        },
        (None, None) => return fail("give a command or --api-socket PATH (see --help)".into()),
    };
    match command {
        Command::Run(RunCmd {
            vm,
            run,
            nodes: Some(n),
            protocol,
            ordering,
            net,
            ..
        }) => cluster_cli::launch(cluster_cli::LaunchArgs {
            nodes: n,
            protocol,
            ordering,
            vm: &vm,
            run: &run,
            net: &net,
        }),
        Command::Node {
            cluster,
            id,
            vm,
            run,
            api_socket,
        } => cluster_cli::node(&cluster, id, &vm, &run, api_socket.as_deref()),
        Command::Run(RunCmd {
            vm, run, control, ..
        }) => run::run(&vm, &run, &control),
        Command::Vmm {
            api_socket,
            seccomp,
            secret_file,
        } => waiting::run(&api_socket, seccomp, secret_file),
        Command::Demo => demo::run(),
        Command::Bench(args) => bench::run(&args),
        Command::Partition(args) => partition_cli::run(args),
        Command::Remote(args) => remote::run(&args),
        Command::Guest {
            command: GuestCommand::Path,
        } => match probe::materialize() {
            Ok(p) => {
                println!("{}", p.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(format!("cannot write the probe guest: {e}")),
        },
    }
}

/// Parses the command line. `run` is read by a parser of its arguments alone: building
/// every subcommand's arguments and matching against them was about a fifth of the time
/// from exec to the guest's first instruction. Whatever that parser does not take (help,
/// version, any error) goes to the whole parser, which gives the answer and the message.
fn parse(args: Vec<std::ffi::OsString>) -> Cli {
    match parse_run(&args) {
        Some(cmd) => Cli {
            command: Some(Command::Run(cmd)),
            api_socket: None,
        },
        None => Cli::parse_from(args),
    }
}

/// `musubi run ARGS` as the whole parser would read it, or `None` for anything else and for
/// any `run` line it would answer with a message.
fn parse_run(args: &[std::ffi::OsString]) -> Option<RunCmd> {
    if args.get(1)? != "run" {
        return None;
    }
    let m = <RunCmd as clap::Args>::augment_args(clap::Command::new("run"))
        .try_get_matches_from(&args[1..])
        .ok()?;
    <RunCmd as clap::FromArgMatches>::from_arg_matches(&m).ok()
}

fn fail(msg: String) -> ExitCode {
    eprintln!("musubi: {msg}");
    ExitCode::from(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn argv(line: &str) -> Vec<std::ffi::OsString> {
        line.split_whitespace().map(Into::into).collect()
    }

    #[test]
    fn the_run_parser_reads_what_the_whole_parser_reads() {
        for line in [
            "musubi run",
            "musubi run --kernel probe --cpus 2 --memory 128M --serial off",
            "musubi run --kernel k --disk path=a --disk path=b,readonly=on --pmem file=p,size=2M",
            "musubi run --config c.json --timeout 5 --report r.json --metrics m.json --seccomp log",
            "musubi run --nodes 3 --protocol ivy --ordering paper --netns --link-delay 100us",
            "musubi run --exits=user --cmdline probe.tasks=hello",
        ] {
            let fast = parse_run(&argv(line)).unwrap_or_else(|| panic!("{line}: not taken"));
            let whole = match Cli::try_parse_from(argv(line)) {
                Ok(Cli {
                    command: Some(Command::Run(c)),
                    ..
                }) => c,
                Ok(_) => panic!("{line}: not a run"),
                Err(e) => panic!("{line}: {e}"),
            };
            assert_eq!(format!("{fast:?}"), format!("{whole:?}"), "{line}");
        }
    }

    #[test]
    fn help_version_errors_and_other_commands_go_to_the_whole_parser() {
        for line in [
            "musubi run --help",
            "musubi run -h",
            "musubi run --version",
            "musubi run --bogus",
            "musubi run --cpus many",
            "musubi run --protocol ivy",
            "musubi run extra",
            "musubi demo",
            "musubi",
            "musubi --version",
            "musubi bench boot --quick",
        ] {
            assert!(parse_run(&argv(line)).is_none(), "{line}: taken");
        }
    }
}
