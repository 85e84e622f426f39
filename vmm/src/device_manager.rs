//! Creates the VM's devices, puts them on the port and MMIO buses and wires their interrupts.

use crate::arch::x86_64::layout::{MAX_IRQ, VIRTIO_IRQ_BASE, VIRTIO_MMIO_BASE, VIRTIO_MMIO_SIZE};
use crate::config::{CacheMode, DiskConfig, SerialMode};
use crate::control::RunControl;
use crate::vstate::vm::{Vm, VmError};
use devices::legacy::{
    ExitPort, Serial, SerialOutput, COM1_BASE, COM1_IRQ, COM1_LEN, EXIT_PORT, I8042, I8042_BASE,
    I8042_LEN,
};
use devices::virtio::block::{Block, BlockConfig};
use devices::virtio::MmioTransport;
use devices::{EventFdIrq, Irq};
use std::sync::{Arc, Mutex};
use vm_device::bus::{MmioAddress, MmioRange, PioAddress, PioRange};
use vm_device::device_manager::{IoManager, MmioManager, PioManager};
use vm_memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--serial {path}: {source}")]
    SerialFile {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Block(String),
    #[error("too many devices: IRQ {0} is past the last IOAPIC pin {MAX_IRQ}")]
    OutOfIrqs(u32),
    #[error("cannot create an interrupt eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("bus registration failed: {0:?}")]
    Bus(vm_device::bus::Error),
    #[error(transparent)]
    Vm(#[from] VmError),
}

/// The devices of one VM, kept so they can be flushed and inspected after it stops.
pub struct Devices {
    pub io: Arc<IoManager>,
    pub serial: Arc<Mutex<Serial>>,
    pub disks: Vec<Arc<Mutex<MmioTransport>>>,
    /// The image behind each entry of `disks`, for messages.
    pub disk_paths: Vec<std::path::PathBuf>,
    /// `virtio_mmio.device=` fragments announcing the virtio devices to the guest.
    pub cmdline_fragments: Vec<String>,
    pub irqs: Vec<Arc<EventFdIrq>>,
}

impl Devices {
    /// Makes everything the guest wrote to its disks durable in the host files; returns
    /// one message per disk that could not be synced.
    pub fn flush(&self) -> Vec<String> {
        let mut errors = Vec::new();
        for (d, path) in self.disks.iter().zip(&self.disk_paths) {
            if let Err(e) = d.lock().unwrap_or_else(|e| e.into_inner()).flush() {
                errors.push(format!("--disk {}: sync failed: {e}", path.display()));
            }
        }
        self.serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .flush();
        errors
    }

    /// Interrupts raised by all devices so far.
    pub fn interrupts(&self) -> u64 {
        self.irqs.iter().map(|i| i.count()).sum()
    }
}

fn irq_line(
    vm: &Vm,
    gsi: u32,
    irqs: &mut Vec<Arc<EventFdIrq>>,
) -> Result<Arc<EventFdIrq>, DeviceError> {
    if gsi > MAX_IRQ {
        return Err(DeviceError::OutOfIrqs(gsi));
    }
    let irq = Arc::new(EventFdIrq::new().map_err(DeviceError::EventFd)?);
    vm.register_irqfd(irq.eventfd(), gsi)?;
    irqs.push(irq.clone());
    Ok(irq)
}

pub fn create_devices(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    serial_mode: &SerialMode,
    capture: Option<Arc<Mutex<Vec<u8>>>>,
    disks: &[DiskConfig],
    control: Arc<RunControl>,
) -> Result<Devices, DeviceError> {
    let mut io = IoManager::new();
    let mut irqs = Vec::new();
    let pio = |io: &mut IoManager,
               base: u16,
               len: u16,
               dev: Arc<dyn vm_device::DevicePio + Send + Sync>| {
        io.register_pio(
            PioRange::new(PioAddress(base), len).map_err(DeviceError::Bus)?,
            dev,
        )
        .map_err(DeviceError::Bus)
    };

    let sink: Option<Box<dyn std::io::Write + Send>> = match serial_mode {
        SerialMode::Stdio => Some(Box::new(std::io::stdout())),
        SerialMode::Off => None,
        SerialMode::File(p) => Some(Box::new(std::fs::File::create(p).map_err(|source| {
            DeviceError::SerialFile {
                path: p.display().to_string(),
                source,
            }
        })?)),
    };
    let com1_irq = irq_line(vm, COM1_IRQ, &mut irqs)?;
    let serial = Arc::new(Mutex::new(Serial::new(
        com1_irq,
        SerialOutput::new(sink, capture),
    )));
    pio(&mut io, COM1_BASE, COM1_LEN, serial.clone())?;
    pio(
        &mut io,
        I8042_BASE,
        I8042_LEN,
        Arc::new(Mutex::new(I8042::new(control.clone()))),
    )?;
    pio(
        &mut io,
        EXIT_PORT,
        4,
        Arc::new(Mutex::new(ExitPort::new(control))),
    )?;

    let mut transports = Vec::new();
    let mut fragments = Vec::new();
    for (i, d) in disks.iter().enumerate() {
        let base = VIRTIO_MMIO_BASE + i as u64 * VIRTIO_MMIO_SIZE;
        let gsi = VIRTIO_IRQ_BASE + i as u32;
        let block = Block::new(BlockConfig {
            path: d.path.clone(),
            readonly: d.readonly,
            cache: match d.cache {
                CacheMode::Writeback => devices::virtio::block::CacheMode::Writeback,
                CacheMode::None => devices::virtio::block::CacheMode::None,
            },
            id: format!("musubi-disk{i}"),
        })
        .map_err(|e| DeviceError::Block(format!("--disk {}: {e}", d.path.display())))?;
        let irq: Arc<dyn Irq> = irq_line(vm, gsi, &mut irqs)?;
        let t = Arc::new(Mutex::new(MmioTransport::new(
            Box::new(block),
            mem.clone(),
            irq,
        )));
        io.register_mmio(
            MmioRange::new(MmioAddress(base), VIRTIO_MMIO_SIZE).map_err(DeviceError::Bus)?,
            t.clone(),
        )
        .map_err(DeviceError::Bus)?;
        fragments.push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        transports.push(t);
    }
    Ok(Devices {
        io: Arc::new(io),
        serial,
        disks: transports,
        disk_paths: disks.iter().map(|d| d.path.clone()).collect(),
        cmdline_fragments: fragments,
        irqs,
    })
}
