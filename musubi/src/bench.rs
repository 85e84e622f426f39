//! `musubi bench`: hands the command line to the `musubi-bench` program beside this one, so
//! the benchmarks, their charts and progress bars stay out of the hypervisor's binary.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

/// Everything after `bench`, `--help` included, goes to `musubi-bench` as it is: that program
/// owns the experiments' flags and their help.
#[derive(clap::Args, Debug)]
#[command(disable_help_flag = true)]
pub struct BenchArgs {
    /// EXPERIMENT and its flags (boot, composite, seq, dsm-table, mint, vmms, vmp, all;
    /// `musubi bench --help` lists them and their flags).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    args: Vec<OsString>,
}

/// Replaces this process with `musubi-bench ARGS`, so its exit status and signals are the
/// command's own; returns only when that cannot be done.
pub fn run(args: &BenchArgs) -> ExitCode {
    let prog = match program() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("musubi bench: {e}");
            return ExitCode::from(1);
        }
    };
    let e = std::process::Command::new(&prog).args(&args.args).exec();
    eprintln!("musubi bench: cannot run {}: {e}", prog.display());
    ExitCode::from(1)
}

/// `musubi-bench` in this program's directory, where the workspace build puts both.
fn program() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let prog = exe.with_file_name("musubi-bench");
    if prog.is_file() {
        Ok(prog)
    } else {
        Err(format!(
            "{} is missing: the benchmarks are a program of their own; build it with \
             `cargo build --release -p musubi-bench`",
            prog.display()
        ))
    }
}
