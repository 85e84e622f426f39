//! Writes what the guest reads at boot into its memory: the command line with the device
//! fragments, the MP and ACPI tables, the PVH start info or Linux boot parameters, the initrd.

use crate::arch::x86_64::layout::{GuestLayout, CMDLINE_MAX_SIZE};
use crate::arch::x86_64::{acpi, linux, mptable, pvh};
use crate::config::VmConfig;
use crate::device_manager::Devices;
use crate::loader::EntryPoint;
use devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

/// What the guest's boot data could not be made of, or written as.
#[derive(Debug, thiserror::Error)]
pub enum BootDataError {
    #[error("cannot write the MP table: {0}")]
    MpTable(#[from] mptable::MpTableError),
    #[error("cannot write the ACPI tables: {0}")]
    Acpi(#[from] acpi::AcpiError),
    #[error("cannot write the PVH start info: {0}")]
    Pvh(#[from] pvh::PvhError),
    #[error("cannot write the Linux boot parameters: {0}")]
    LinuxBoot(#[from] linux::LinuxBootError),
    #[error("--cmdline: {0} (with the virtio device fragments it must fit in {max} bytes of printable ASCII)", max = CMDLINE_MAX_SIZE - 1)]
    Cmdline(#[from] linux_loader::cmdline::Error),
    #[error("cannot write the command line into guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
    #[error("--initrd {}: {why}", path.display())]
    Initrd {
        path: std::path::PathBuf,
        why: String,
    },
}

/// The command line, firmware tables and boot structures, written into guest memory by the
/// process that loaded the kernel.
pub(crate) fn write_boot_data(
    config: &VmConfig,
    layout: &GuestLayout,
    mem: &GuestMemoryMmap,
    devices: &Devices,
    entry: &EntryPoint,
    kernel_end: u64,
) -> Result<(), BootDataError> {
    let cmdline = build_cmdline(&config.cmdline, devices)?;
    mem.write_slice(cmdline.as_bytes_with_nul(), GuestAddress(layout.cmdline))?;

    // 4. Firmware tables and boot structures. Both CPU tables: the MP table for simple
    // guests, ACPI for kernels built without MP-table parsing (Debian's cloud kernel).
    mptable::write_mptable(mem, layout.cpus)?;
    let rsdp = acpi::write_acpi_tables(mem, layout.cpus)?;
    let e820 = layout.e820();
    let initrd = load_initrd(mem, config, layout, entry, kernel_end)?;
    match entry {
        EntryPoint::Pvh(_) => {
            pvh::write_start_info(mem, &e820, layout.cmdline, Some(rsdp))?;
            if let Some((addr, size)) = initrd {
                pvh::add_initrd_module(mem, addr, size)?;
            }
        }
        EntryPoint::Linux64 { header, .. } => {
            let len = cmdline.as_bytes_with_nul().len() - 1;
            linux::write_boot_params(mem, *header, &e820, layout.cmdline, len, initrd)?;
            linux::set_acpi_rsdp_addr(mem, rsdp)?;
            linux::write_boot_gdt_and_page_tables(mem)?;
        }
    }
    Ok(())
}

/// The user's command line with the device fragments added to the kernel's part (before
/// any ` -- `, after which arguments go to init).
fn build_cmdline(base: &str, devices: &Devices) -> Result<std::ffi::CString, BootDataError> {
    let mut cmdline = linux_loader::cmdline::Cmdline::new(CMDLINE_MAX_SIZE)?;
    let (kernel, init) = match base.trim().split_once(" -- ") {
        Some((k, i)) => (k.trim(), Some(i.trim())),
        None => (base.trim(), None),
    };
    if !kernel.is_empty() {
        cmdline.insert_str(kernel)?;
    }
    for f in &devices.cmdline_fragments {
        cmdline.insert_str(f)?;
    }
    if let Some(init) = init.filter(|i| !i.is_empty()) {
        cmdline.insert_init_args(init)?;
    }
    Ok(cmdline.as_cstring()?)
}

fn load_initrd(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    layout: &GuestLayout,
    entry: &EntryPoint,
    kernel_end: u64,
) -> Result<Option<(u64, u64)>, BootDataError> {
    let Some(path) = &config.initrd else {
        return Ok(None);
    };
    let fail = |why: String| BootDataError::Initrd {
        path: path.clone(),
        why,
    };
    let data = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let header = match entry {
        EntryPoint::Linux64 { header, .. } => header.as_ref(),
        EntryPoint::Pvh(_) => None,
    };
    let top = layout.low_ram_end();
    let addr = linux::initrd_address(top, data.len() as u64, header)?;
    if addr < kernel_end {
        return Err(fail(format!(
            "{} MiB does not fit between the kernel (ending at {kernel_end:#x}) and the top of low RAM ({top:#x}); give the VM more --memory",
            data.len() >> 20
        )));
    }
    mem.write_slice(&data, GuestAddress(addr))
        .map_err(|e| fail(format!("cannot place it in guest memory: {e}")))?;
    Ok(Some((addr, data.len() as u64)))
}
