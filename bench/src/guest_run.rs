//! Runs one workload either in the probe guest (in this process, through the VMM library)
//! or natively (the `musubi-native` program, built from the same workload code), and
//! returns the result line with the run's exit accounting.

use crate::probe;
use crate::watch::tail;
use musubi_types::Metrics;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use vmm::config::{DiskConfig, ExitsMode, SerialMode, VmConfig};

/// One workload run's result line and, for VM runs, the VMM's accounting.
pub struct WorkloadRun {
    pub result: Value,
    /// The VM run's `--metrics`; `None` for native runs.
    pub metrics: Option<Metrics>,
}

impl WorkloadRun {
    /// The task's own time in ns, as it measured it.
    pub fn ns(&self) -> Option<f64> {
        self.result["ns"].as_f64()
    }

    pub fn total_exits(&self) -> Option<u64> {
        self.metrics.as_ref().map(|m| m.total_exits)
    }

    /// Mean VMM time per exit over the whole run, in ns.
    pub fn vmm_ns_per_exit(&self) -> Option<f64> {
        let exits = &self.metrics.as_ref()?.exits;
        let (n, t) = exits
            .iter()
            .fold((0u64, 0u64), |(n, t), e| (n + e.count, t + e.vmm_ns));
        (n > 0).then(|| t as f64 / n as f64)
    }
}

/// A figure of a VM run's `--metrics`, for the tables' columns; `None` where the run has
/// none (an interrupt path it never took).
pub type VmFigure = fn(&Metrics) -> Option<u64>;

/// Doorbells the guest rang with an exit (queue-notify writes the VMM trapped).
pub const DOORBELL_EXITS: VmFigure = |m| Some(m.notifications.mmio_exit);
/// Interrupts the VMM injected itself (the user exit path).
pub const IRQ_USER: VmFigure = |m| m.interrupts.user;
/// Interrupts raised through irqfds (the kernel exit path).
pub const IRQ_IRQFD: VmFigure = |m| m.interrupts.irqfd;

/// Runs `task` (one probe task, e.g. `port-ping=1000`) in the probe guest.
pub fn in_vm(task: &str, exits: ExitsMode, disk: Option<&Path>) -> Result<WorkloadRun, String> {
    let config = VmConfig {
        kernel: probe::image(),
        cmdline: format!("probe.tasks={task}"),
        initrd: None,
        cpus: 1,
        memory: 256 << 20,
        disks: disk
            .map(|p| {
                vec![DiskConfig {
                    path: p.to_path_buf(),
                    readonly: false,
                    cache: Default::default(),
                }]
            })
            .unwrap_or_default(),
        serial: SerialMode::Off,
        exits,
        pmem: Vec::new(),
        net: Vec::new(),
        rng: None,
        vsock: None,
    };
    let name = task.split('=').next().unwrap_or(task);
    probe_in_process(
        &config,
        Duration::from_secs(600),
        &format!("{task} ({exits})"),
        name,
    )
}

/// Boots `config` (the probe guest) in this process and returns the result line named
/// `result` with the run's exit accounting; `label` names the run in errors.
pub fn probe_in_process(
    config: &VmConfig,
    timeout: Duration,
    label: &str,
    result: &str,
) -> Result<WorkloadRun, String> {
    let opts = vmm::RunOptions {
        capture_serial: true,
        timeout: Some(timeout),
        seccomp: vmm::seccomp::SeccompMode::Enforce,
        io_poll: vmm::DEFAULT_IO_POLL,
        io_poll_hold: false,
        io_threads: vmm::IoThreadCount::Auto,
    };
    let report = vmm::run_vm(config, &opts).map_err(|e| e.to_string())?;
    let console = String::from_utf8_lossy(&report.serial).into_owned();
    if report.outcome != vmm::Outcome::GuestStatus(0) {
        return Err(format!(
            "{label}: the guest ended with {:?}; console:\n{}",
            report.outcome,
            tail(&console, 15)
        ));
    }
    let results = probe::results(&report.serial);
    let line = probe::result(&results, result)
        .cloned()
        .ok_or_else(|| format!("{label}: no result line; console:\n{}", tail(&console, 15)))?;
    Ok(WorkloadRun {
        result: line,
        metrics: Some(report.metrics),
    })
}

/// The native program, built beside `musubi` by the workspace build.
pub fn native_program() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let p = exe.with_file_name("musubi-native");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is missing: build it with `cargo build --release -p musubi-bench`, which builds both programs",
            p.display()
        ))
    }
}

/// Runs `task` natively with the same workload code.
pub fn native(task: &str, disk: Option<&Path>) -> Result<WorkloadRun, String> {
    let prog = native_program()?;
    let mut cmd = std::process::Command::new(&prog);
    if let Some(d) = disk {
        cmd.arg("--disk").arg(d);
    }
    let out = cmd
        .arg(task)
        .output()
        .map_err(|e| format!("{}: {e}", prog.display()))?;
    let name = task.split('=').next().unwrap_or(task);
    let results = probe::results(&out.stdout);
    let result = probe::result(&results, name).cloned().ok_or_else(|| {
        format!(
            "{} {task}: no result line (status {:?}); stderr:\n{}",
            prog.display(),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if result["ok"] == false {
        return Err(format!("{} {task}: {}", prog.display(), result));
    }
    Ok(WorkloadRun {
        result,
        metrics: None,
    })
}
