//! `musubi`: the command-line front end of the Musubi hypervisor.

mod bench;
mod cli;
mod demo;
mod partition_cli;
mod probe;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "musubi",
    version,
    about = "A KVM hypervisor: storage as memory, kernel or user exit paths, host partitions"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot one VM and run it until the guest exits, shuts down or crashes. The exit status
    /// is the guest's (probe guest: its exit port; other guests: 0 on shutdown or reboot),
    /// 125 if the guest crashed, 126 on a VMM error, 128+N on signal N.
    Run {
        #[command(flatten)]
        vm: cli::VmArgs,
        /// Stop the VM after this many seconds (status 126).
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<f64>,
        /// Write a JSON report at exit: outcome, exits by reason with VMM time, interrupts,
        /// and the time to the first KVM_RUN.
        #[arg(long, value_name = "FILE")]
        report: Option<std::path::PathBuf>,
        /// Write the exit accounting (per vCPU, per port and device register, VMM time
        /// with a log2 histogram, doorbells and interrupts by path) as JSON at exit and on
        /// SIGUSR1.
        #[arg(long, value_name = "FILE")]
        metrics: Option<std::path::PathBuf>,
    },
    /// Boot the bundled probe guest on 2 vCPUs with a temporary disk, run hello, blk-fill
    /// and blk-crc, check the disk on the host, and summarize.
    Demo,
    /// Run an experiment and report it beside the papers' figures.
    Bench(bench::BenchArgs),
    /// Host partitions: disjoint CPUs, memory and disks, each with its own supervisor and VMs.
    Partition(partition_cli::PartitionArgs),
    /// The bundled probe guest.
    Guest {
        #[command(subcommand)]
        command: GuestCommand,
    },
}

#[derive(Subcommand)]
enum GuestCommand {
    /// Write the probe guest's ELF to the cache directory and print its path (so QEMU can
    /// boot the same image).
    Path,
}

fn main() -> ExitCode {
    // Output piped into `head` and the like ends quietly, as for other command-line tools.
    // SAFETY: restoring a signal's default disposition has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MUSUBI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            vm,
            timeout,
            report,
            metrics,
        } => run(&vm, timeout, report.as_deref(), metrics),
        Command::Demo => demo::run(),
        Command::Bench(args) => bench::run(&args),
        Command::Partition(args) => partition_cli::run(args),
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

fn fail(msg: String) -> ExitCode {
    eprintln!("musubi: {msg}");
    ExitCode::from(1)
}

fn run(
    args: &cli::VmArgs,
    timeout: Option<f64>,
    report_path: Option<&std::path::Path>,
    metrics_path: Option<std::path::PathBuf>,
) -> ExitCode {
    let config = match args.to_config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let opts = vmm::RunOptions {
        capture_serial: false,
        metrics_path,
        timeout: match timeout {
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return fail(format!(
                    "--timeout {t}: expected a positive number of seconds"
                ))
            }
            None => None,
        },
    };
    match vmm::run_vm(&config, &opts) {
        Ok(report) => {
            if let Some(p) = report_path {
                if let Err(e) = std::fs::write(p, report_json(&report).to_string()) {
                    eprintln!("musubi: --report {}: {e}", p.display());
                }
            }
            match &report.outcome {
                vmm::Outcome::GuestCrash(m) => eprintln!("musubi: guest crashed: {m}"),
                vmm::Outcome::VmmError(m) => eprintln!("musubi: {m}"),
                vmm::Outcome::Signal(s) => {
                    eprintln!("musubi: stopped by signal {s}; disks flushed")
                }
                _ => {}
            }
            ExitCode::from(report.outcome.exit_code() as u8)
        }
        Err(e) => fail(e.to_string()),
    }
}

fn report_json(r: &vmm::RunReport) -> serde_json::Value {
    serde_json::json!({
        "outcome": format!("{:?}", r.outcome),
        "exit_code": r.outcome.exit_code(),
        "exits": r.exits,
        "total_exits": r.total_exits,
        "interrupts": r.interrupts,
        "to_first_run_ns": r.to_first_run.map(|d| d.as_nanos() as u64),
        "first_run_monotonic_ns": r.first_run_monotonic_ns,
        "wall_ns": r.wall.as_nanos() as u64,
    })
}
