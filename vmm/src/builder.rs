//! Builds a VM from its configuration in one readable sequence, runs it, and tears it down
//! so that nothing the guest wrote is lost.

use crate::arch::x86_64::layout::{self, CMDLINE_MAX_SIZE, CMDLINE_START, PVH_INFO_START};
use crate::arch::x86_64::{acpi, linux, mptable, pvh, regs};
use crate::config::ExitsMode;
use crate::config::VmConfig;
use crate::control::{Outcome, RunControl};
use crate::device_manager::{create_devices, Devices};
use crate::io_thread::IoThread;
use crate::loader::{load_kernel, EntryPoint};
use crate::metrics::{detailed, summarize, ExitSummary, VcpuMetrics};
use crate::pmem::{host_phys_bits, PmemRegions};
use crate::vstate::memory::create_guest_memory;
use crate::vstate::vcpu::{install_kick_handler, kick_signal, Vcpu};
use crate::vstate::vm::Vm;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::signal::Killable;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0}")]
    Msg(String),
}

fn err(e: impl std::fmt::Display) -> BuildError {
    BuildError::Msg(e.to_string())
}

/// Options that change how a VM is observed, not what it is.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Keep a copy of everything the guest writes to COM1 in the report.
    pub capture_serial: bool,
    /// Stop the VM (outcome [`Outcome::VmmError`]) if it runs longer than this.
    pub timeout: Option<Duration>,
    /// Write the exit accounting as JSON here at exit and whenever SIGUSR1 arrives.
    pub metrics_path: Option<std::path::PathBuf>,
}

/// What happened during one VM run.
#[derive(Debug)]
pub struct RunReport {
    pub outcome: Outcome,
    pub exits: Vec<ExitSummary>,
    pub total_exits: u64,
    pub interrupts: u64,
    pub serial: Vec<u8>,
    /// The full exit accounting (per vCPU, per port and device register, histograms).
    pub metrics: serde_json::Value,
    /// Queue notifications that reached the VMM's I/O thread through ioeventfds.
    pub ioeventfd_notifications: u64,
    /// From the start of [`run_vm`] to the BSP's first KVM_RUN.
    pub to_first_run: Option<Duration>,
    /// CLOCK_MONOTONIC at the BSP's first KVM_RUN, comparable across processes, so a parent
    /// can measure from its own spawn of the VMM.
    pub first_run_monotonic_ns: Option<u64>,
    pub wall: Duration,
}

static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static DUMP_METRICS: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

extern "C" fn on_usr1(_: libc::c_int) {
    DUMP_METRICS.store(true, Ordering::SeqCst);
}

/// SIGTERM and SIGINT end the VM through the normal teardown, so disks are flushed;
/// SIGUSR1 asks for the metrics file to be written while the VM runs.
fn install_signal_handlers() {
    // SAFETY: the handlers only store to atomics, which is async-signal-safe.
    unsafe {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            libc::signal(sig, on_terminate as *const () as libc::sighandler_t);
        }
        libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
    }
}

/// The exit accounting of a run so far, as written by `--metrics`.
fn metrics_json(
    mode: ExitsMode,
    vcpus: &[Arc<VcpuMetrics>],
    devices: &Devices,
    io_thread: Option<&IoThread>,
) -> serde_json::Value {
    let (per_vcpu, all) = detailed(vcpus);
    let notify_exits: u64 = all
        .iter()
        .filter(|d| {
            d.detail
                .as_deref()
                .is_some_and(|n| n.ends_with(":queue_notify"))
        })
        .map(|d| d.count)
        .sum();
    let mut irq_paths = serde_json::Map::new();
    for irq in &devices.irqs {
        let e = irq_paths.entry(irq.path()).or_insert(serde_json::json!(0));
        *e = serde_json::json!(e.as_u64().unwrap_or(0) + irq.count());
    }
    serde_json::json!({
        "exits_mode": mode.to_string(),
        "total_exits": all.iter().map(|d| d.count).sum::<u64>(),
        "exits": all,
        "vcpus": per_vcpu.into_iter().enumerate().map(|(i, e)| serde_json::json!({"id": i, "exits": e})).collect::<Vec<_>>(),
        "notifications": {
            "mmio_exit": notify_exits,
            "ioeventfd": io_thread.map(|t| t.served()).unwrap_or(0),
        },
        "interrupts": irq_paths,
    })
}

fn write_metrics(path: &std::path::Path, value: &serde_json::Value) {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    if let Err(e) = std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, path)) {
        tracing::warn!("--metrics {}: {e}", path.display());
    }
}

/// Builds and runs the VM described by `config` until it ends.
pub fn run_vm(config: &VmConfig, opts: &RunOptions) -> Result<RunReport, BuildError> {
    let started = Instant::now();
    install_signal_handlers();
    install_kick_handler()
        .map_err(|e| err(format!("cannot install the vCPU kick handler: {e}")))?;
    // Set-up time per phase, at debug level (MUSUBI_LOG=vmm=debug).
    let phase = |name: &str| {
        tracing::debug!(
            phase = name,
            us = started.elapsed().as_micros() as u64,
            "set-up"
        )
    };

    // 1. The VM and its memory. Storage as memory: file-backed regions above RAM, each its
    // own slot, opened first so bad files are reported before any KVM work.
    let pmem = PmemRegions::open(&config.pmem, config.memory, &config.disks, host_phys_bits())
        .map_err(err)?;
    let mut vm = Vm::new().map_err(err)?;
    let mem = create_guest_memory(config.memory).map_err(err)?;
    vm.register_memory(&mem).map_err(err)?;
    pmem.register(&mut vm).map_err(err)?;
    let mem = pmem.extend_guest_memory(mem).map_err(err)?;

    phase("vm and memory");
    // 2. The kernel.
    let (entry, kernel_end) = load_kernel(&mem, &config.kernel).map_err(err)?;

    phase("kernel loaded");
    // 3. Devices, and the command line that announces them.
    let control = Arc::new(RunControl::default());
    let capture = opts
        .capture_serial
        .then(|| Arc::new(Mutex::new(Vec::new())));
    let mut devices = create_devices(
        &vm,
        &mem,
        config,
        capture.clone(),
        pmem.devices(),
        control.clone(),
    )
    .map_err(err)?;
    let cmdline = build_cmdline(&config.cmdline, &devices)?;
    mem.write_slice(&cmdline, GuestAddress(CMDLINE_START))
        .map_err(|e| err(format!("cannot write the command line: {e}")))?;

    phase("devices");
    // 4. Firmware tables and boot structures.
    // Both CPU tables: the MP table for simple guests, ACPI for kernels built without
    // MP-table parsing (Debian's cloud kernel among them).
    mptable::write_mptable(&mem, config.cpus).map_err(err)?;
    let rsdp = acpi::write_acpi_tables(&mem, config.cpus).map_err(err)?;
    let mut e820 = layout::e820_map(config.memory);
    e820.extend(pmem.e820_entries());
    let initrd = load_initrd(&mem, config, &entry, kernel_end)?;
    match entry {
        EntryPoint::Pvh(_) => {
            pvh::write_start_info(&mem, &e820, CMDLINE_START, Some(rsdp)).map_err(err)?;
            if let Some((addr, size)) = initrd {
                pvh::add_initrd_module(&mem, addr, size).map_err(err)?;
            }
        }
        EntryPoint::Linux64 { header, .. } => {
            linux::write_boot_params(&mem, header, &e820, CMDLINE_START, cmdline.len(), initrd)
                .map_err(err)?;
            linux::set_acpi_rsdp_addr(&mem, rsdp).map_err(err)?;
            linux::write_boot_gdt_and_page_tables(&mem).map_err(err)?;
        }
    }

    phase("firmware tables");
    // 5. vCPUs: the BSP gets the entry state; APs wait for INIT/SIPI in the kernel.
    let mut vcpus = Vec::new();
    for id in 0..config.cpus {
        vcpus.push(Vcpu::new(vm.kvm(), vm.fd(), id, config.cpus).map_err(err)?);
    }
    match entry {
        EntryPoint::Pvh(rip) => {
            vcpus[0].set_regs(&regs::pvh_regs(rip, PVH_INFO_START), regs::pvh_sregs)
        }
        EntryPoint::Linux64 { entry, .. } => {
            vcpus[0].set_regs(&linux::long_mode_regs(entry), linux::long_mode_sregs)
        }
    }
    .map_err(err)?;

    phase("vcpus");
    // 6. Run until an outcome is recorded.
    let metrics: Vec<Arc<VcpuMetrics>> = (0..config.cpus).map(|_| Arc::default()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let first_run: Arc<OnceLock<(Instant, u64)>> = Arc::default();
    let mut io_thread = match std::mem::take(&mut devices.notifiers) {
        n if n.is_empty() => None,
        n => Some(
            IoThread::start(n)
                .map_err(|e| err(format!("cannot start the virtio I/O thread: {e}")))?,
        ),
    };
    let mut handles = Vec::new();
    for (vcpu, m) in vcpus.into_iter().zip(&metrics) {
        let (io, control, stop, m, first_run, names) = (
            devices.io.clone(),
            control.clone(),
            stop.clone(),
            m.clone(),
            first_run.clone(),
            devices.mmio_names.clone(),
        );
        let h = std::thread::Builder::new()
            .name(format!("vcpu{}", vcpu.id))
            .spawn(move || {
                if vcpu.id == 0 {
                    let _ = first_run.set((Instant::now(), monotonic_ns()));
                }
                vcpu.run(io, control, stop, m, names)
            })
            .map_err(|e| err(format!("cannot start a vCPU thread: {e}")))?;
        handles.push(h);
    }
    let deadline = opts.timeout.map(|t| started + t);
    let mut outcome = control.wait(Duration::from_millis(20), || {
        if DUMP_METRICS.swap(false, Ordering::SeqCst) {
            if let Some(p) = &opts.metrics_path {
                write_metrics(
                    p,
                    &metrics_json(config.exits, &metrics, &devices, io_thread.as_ref()),
                );
            }
        }
        let s = SIGNALLED.load(Ordering::SeqCst);
        if s != 0 {
            return Some(Outcome::Signal(s));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(Outcome::VmmError(format!(
                "the VM did not finish within {:?}",
                opts.timeout.unwrap_or_default()
            )));
        }
        None
    });

    // 7. Stop every vCPU, then make the guest's writes durable.
    stop.store(true, Ordering::Release);
    stop_vcpus(handles);
    if let Some(t) = io_thread.as_mut() {
        t.stop();
    }
    let mut flush_errors = devices.flush();
    flush_errors.extend(pmem.sync());
    if !flush_errors.is_empty() {
        outcome = Outcome::VmmError(format!(
            "guest writes may not be on disk: {}",
            flush_errors.join("; ")
        ));
    }
    let metrics_value = metrics_json(config.exits, &metrics, &devices, io_thread.as_ref());
    if let Some(p) = &opts.metrics_path {
        write_metrics(p, &metrics_value);
    }
    let report = RunReport {
        metrics: metrics_value,
        ioeventfd_notifications: io_thread.as_ref().map(|t| t.served()).unwrap_or(0),
        exits: summarize(&metrics),
        total_exits: metrics.iter().map(|m| m.total()).sum(),
        interrupts: devices.interrupts(),
        serial: capture
            .map(|c| std::mem::take(&mut *c.lock().unwrap_or_else(|e| e.into_inner())))
            .unwrap_or_default(),
        to_first_run: first_run.get().map(|t| t.0.duration_since(started)),
        first_run_monotonic_ns: first_run.get().map(|t| t.1),
        wall: started.elapsed(),
        outcome,
    };
    drop(devices);
    // The VM fd goes before the memory it maps.
    drop(vm);
    drop(mem);
    Ok(report)
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Kicks vCPU threads out of KVM_RUN until each has returned. A kick can land just before a
/// thread re-enters the guest and be missed, so it is repeated.
fn stop_vcpus(mut handles: Vec<std::thread::JoinHandle<()>>) {
    while !handles.is_empty() {
        for h in &handles {
            let _ = h.kill(kick_signal());
        }
        std::thread::sleep(Duration::from_millis(1));
        let (done, rest): (Vec<_>, Vec<_>) = handles.into_iter().partition(|h| h.is_finished());
        for h in done {
            let _ = h.join();
        }
        handles = rest;
    }
}

fn build_cmdline(base: &str, devices: &Devices) -> Result<Vec<u8>, BuildError> {
    let mut s = base.trim().to_string();
    for f in &devices.cmdline_fragments {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(f);
    }
    let mut bytes = s.into_bytes();
    bytes.push(0);
    if bytes.len() > CMDLINE_MAX_SIZE {
        return Err(err(format!(
            "--cmdline: the command line with device fragments is {} bytes; at most {} fit",
            bytes.len() - 1,
            CMDLINE_MAX_SIZE - 1
        )));
    }
    Ok(bytes)
}

fn load_initrd(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    entry: &EntryPoint,
    kernel_end: u64,
) -> Result<Option<(u64, u64)>, BuildError> {
    let Some(path) = &config.initrd else {
        return Ok(None);
    };
    let data = std::fs::read(path).map_err(|e| err(format!("--initrd {}: {e}", path.display())))?;
    let header = match entry {
        EntryPoint::Linux64 { header, .. } => header.as_ref(),
        EntryPoint::Pvh(_) => None,
    };
    let top = layout::ram_ranges(config.memory)[0].1;
    let addr = linux::initrd_address(top, data.len() as u64, header).map_err(err)?;
    if addr < kernel_end {
        return Err(err(format!(
            "--initrd {}: {} MiB does not fit between the kernel (ending at {kernel_end:#x}) and the top of low RAM ({top:#x}); give the VM more --memory",
            path.display(),
            data.len() >> 20
        )));
    }
    mem.write_slice(&data, GuestAddress(addr)).map_err(|e| {
        err(format!(
            "--initrd {}: cannot place it in guest memory: {e}",
            path.display()
        ))
    })?;
    Ok(Some((addr, data.len() as u64)))
}
