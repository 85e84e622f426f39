//! One configuration, run: in this process through the VMM library, or under QEMU. Each
//! returns what the guest measured and, for Musubi, what the VMM counted.

use super::plan::{Plan, Storage, MIB};
use crate::guest_run::probe_in_process;
use crate::probe;
use crate::qemu::{self, Qemu};
use crate::watch::{observe, tail, time_to_marker, Watch};
use musubi_types::Metrics;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use vmm::config::{CacheMode, DiskConfig, ExitsMode, SerialMode, VmConfig};
use vmm::pmem::{Advertise, PmemConfig};

const RESULT_MARKER: &str = "{\"probe\":\"storage-io\"";

#[derive(Clone, Debug)]
pub(super) struct Sample {
    pub(super) ns: f64,
    pub(super) kernel_copy_bytes: Option<f64>,
    pub(super) page_faults: Option<f64>,
    pub(super) virtio_requests: Option<f64>,
    pub(super) interrupts: Option<f64>,
    /// VM exits of the whole run (boot, untimed warm pass, timed pass); `None` under QEMU.
    pub(super) exits: Option<f64>,
    /// Virtio queue notifications the VMM saw over the whole run: the guest's counts cover
    /// only the timed pass, which a warm read serves from the guest cache without a request.
    pub(super) doorbells: Option<f64>,
}

impl Sample {
    fn of(result: &Value, metrics: Option<&Metrics>) -> Result<Sample, String> {
        if result["ok"] == false {
            return Err(format!("the guest reported a failure: {result}"));
        }
        let ns = result["ns"]
            .as_f64()
            .ok_or_else(|| format!("no ns in {result}"))?;
        Ok(Sample {
            ns,
            kernel_copy_bytes: result["kernel_copy_bytes"].as_f64(),
            page_faults: result["page_faults"].as_f64(),
            virtio_requests: result["virtio_requests"].as_f64(),
            interrupts: result["interrupts"].as_f64(),
            exits: metrics.map(|m| m.total_exits as f64),
            doorbells: metrics
                .map(|m| (m.notifications.ioeventfd + m.notifications.mmio_exit) as f64),
        })
    }
}

/// The same for Musubi and QEMU: both boot the probe guest, whose page cache is capped.
fn cmdline(plan: &Plan, task: &str) -> String {
    format!(
        "probe.task_timeout=0 probe.page_cache={} probe.tasks={task}",
        plan.page_cache
    )
}

fn vm_config(plan: &Plan, storage: Storage, file: &Path, task: &str) -> VmConfig {
    let disk = |cache| {
        vec![DiskConfig {
            path: file.to_path_buf(),
            readonly: false,
            cache,
        }]
    };
    let (disks, pmem) = match storage {
        Storage::Vmms => (
            Vec::new(),
            vec![PmemConfig {
                file: file.to_path_buf(),
                size: None,
                readonly: false,
                advertise: Advertise::E820,
            }],
        ),
        Storage::VirtioNone => (disk(CacheMode::None), Vec::new()),
        Storage::VirtioWb | Storage::QemuWb => (disk(CacheMode::Writeback), Vec::new()),
    };
    VmConfig {
        kernel: probe::image(),
        cmdline: cmdline(plan, task),
        initrd: None,
        cpus: 1,
        memory: plan.memory,
        disks,
        pmem,
        net: Vec::new(),
        rng: None,
        vsock: None,
        serial: SerialMode::Off,
        exits: ExitsMode::Kernel,
    }
}

/// Runs one probe task in this process and returns its result line and exit accounting.
pub(super) fn musubi_run(
    plan: &Plan,
    storage: Storage,
    file: &Path,
    task: &str,
) -> Result<Sample, String> {
    let config = vm_config(plan, storage, file, task);
    let run = probe_in_process(&config, plan.timeout, task, "storage-io")?;
    Sample::of(&run.result, run.metrics.as_ref())
}

/// The same task under QEMU (microvm, virtio-blk over virtio-mmio, host page cache on).
pub(super) fn qemu_run(q: &Qemu, plan: &Plan, file: &Path, task: &str) -> Result<Sample, String> {
    let mut cmd = q.command(plan.memory / MIB, &cmdline(plan, task));
    // With acpi=off microvm appends `virtio_mmio.device=` for each transport to the command
    // line, which is how the probe finds disks; the probe speaks virtio-mmio version 2 only.
    cmd.args(["-global", "virtio-mmio.force-legacy=false"])
        .arg("-drive")
        .arg(format!(
            "if=none,id=d0,file={},format=raw,cache=writeback",
            file.display()
        ))
        .args(["-device", "virtio-blk-device,drive=d0"]);
    let watch = Watch {
        marker: RESULT_MARKER,
        // A sampler would take CPU time from the measured VM.
        guest_bytes: None,
        timeout: plan.timeout,
        sample_every: Duration::from_millis(20),
    };
    let o = observe(cmd, &watch).map_err(|e| format!("cannot start QEMU: {e}"))?;
    time_to_marker(&o, qemu::CLEAN_STATUS, qemu::STDERR_LINES)?;
    let results = probe::results(o.stdout.as_bytes());
    let r = probe::result(&results, "storage-io")
        .ok_or_else(|| format!("a storage-io line that is not JSON: {}", tail(&o.stdout, 3)))?;
    Sample::of(r, None)
}
