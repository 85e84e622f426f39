//! Creates the VM's devices, puts them on the port and MMIO buses and wires their interrupts.

use crate::arch::x86_64::layout::{
    GuestLayout, VirtioSlot, MAX_IRQ, VIRTIO_IRQ_BASE, VIRTIO_MMIO_SIZE,
};
use crate::config::{ExitsMode, SerialMode, VmConfig};
use crate::control::RunControl;
use crate::exit::DeviceBus;
use crate::io_thread::{DeviceEvent, Notifier};
use crate::irq::{IrqLine, UserIrq};
use crate::metrics::MmioTarget;
use crate::vstate::vm::{KvmVm, VmError};
use devices::legacy::{
    ExitPort, Pm, Serial, SerialOutput, COM1_BASE, COM1_IRQ, COM1_LEN, EXIT_PORT, I8042,
    I8042_BASE, I8042_LEN, PM_BASE, PM_LEN, SCI_IRQ,
};
use devices::virtio::block::{Block, BlockConfig};
use devices::virtio::{MmioTransport, VirtioDevice};
use devices::GuestMemoryMmap;
use devices::{EventFdIrq, Irq};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use vm_device::bus::{MmioAddress, MmioRange, PioAddress, PioRange};
use vm_device::device_manager::{IoManager, MmioManager, PioManager};
use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--serial {path}: {source}")]
    SerialFile {
        path: String,
        source: std::io::Error,
    },
    #[error("--disk {}: {source}", path.display())]
    Block {
        path: std::path::PathBuf,
        source: devices::virtio::block::BlockError,
    },
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error("--rng: {0}")]
    Rng(#[from] devices::virtio::RngError),
    #[error("--vsock cid={cid},socket={}: {source}", path.display())]
    Vsock {
        cid: u64,
        path: std::path::PathBuf,
        source: devices::virtio::VsockError,
    },
    #[error("--vsock: {0}")]
    TakeOver(#[from] devices::virtio::TakeOverError),
    #[error("too many devices: IRQ {0} is past the last IOAPIC pin {MAX_IRQ}")]
    OutOfIrqs(u32),
    #[error("cannot create an interrupt eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("bus registration failed: {0:?}")]
    Bus(vm_device::bus::Error),
    #[error(transparent)]
    Vm(#[from] VmError),
}

/// Names MMIO exits for the exit accounting: `device:queue_notify` for doorbells, the
/// device name for its other registers, `unclaimed` elsewhere. Ranges are kept sorted, so
/// an exit finds its target by binary search.
#[derive(Default)]
pub struct MmioNames {
    /// (base, size, name, name of the queue-notify register), sorted by base.
    ranges: Vec<(u64, u64, Arc<str>, Arc<str>)>,
}

impl MmioNames {
    fn add(&mut self, base: u64, size: u64, name: Arc<str>, notify: Arc<str>) {
        let at = self.ranges.partition_point(|r| r.0 < base);
        self.ranges.insert(at, (base, size, name, notify));
    }

    /// Target 0 is unclaimed; range `i` is `2i + 1`, its doorbell `2i + 2`.
    pub fn target(&self, addr: u64) -> MmioTarget {
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        match i.checked_sub(1).map(|i| (i, &self.ranges[i])) {
            Some((i, (base, size, _, _))) if addr - base < *size => {
                let notify = u16::from(addr - base == VIRTIO_MMIO_QUEUE_NOTIFY);
                MmioTarget((2 * i as u16 + 1) + notify)
            }
            _ => MmioTarget(0),
        }
    }

    pub fn name(&self, target: MmioTarget) -> Arc<str> {
        match target.0.checked_sub(1) {
            Some(t) => match self.ranges.get(t as usize / 2) {
                Some((_, _, name, notify)) => {
                    if t % 2 == 1 {
                        notify.clone()
                    } else {
                        name.clone()
                    }
                }
                None => Arc::from("unclaimed"),
            },
            None => Arc::from("unclaimed"),
        }
    }
}

/// The exit bus of a VM whose devices are all local.
pub struct LocalBus {
    io: IoManager,
    names: Arc<MmioNames>,
}

impl DeviceBus for LocalBus {
    fn pio_read(&self, _: u8, port: u16, data: &mut [u8]) {
        if self.io.pio_read(PioAddress(port), data).is_err() {
            data.fill(0xff);
        }
    }
    fn pio_write(&self, _: u8, port: u16, data: &[u8]) {
        let _ = self.io.pio_write(PioAddress(port), data);
    }
    fn mmio_read(&self, _: u8, addr: u64, data: &mut [u8]) {
        if self.io.mmio_read(MmioAddress(addr), data).is_err() {
            data.fill(0xff);
        }
    }
    fn mmio_write(&self, _: u8, addr: u64, data: &[u8]) {
        let _ = self.io.mmio_write(MmioAddress(addr), data);
    }
    fn mmio_target(&self, addr: u64) -> MmioTarget {
        self.names.target(addr)
    }
}

/// Offset of the virtio-mmio QueueNotify register (virtio 1.x, 4.2.2).
const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x50;

/// The devices of one VM, kept so they can be flushed and inspected after it stops.
pub struct Devices {
    pub bus: Arc<LocalBus>,
    pub mmio_names: Arc<MmioNames>,
    pub serial: Arc<Mutex<Serial>>,
    /// The ACPI PM1 registers: the power button is pressed here.
    pub pm: Arc<Mutex<Pm>>,
    pub disks: Vec<Arc<Mutex<MmioTransport>>>,
    /// Every virtio transport (the disks, network and memory-storage devices, then the
    /// entropy device), in creation order: the order a snapshot saves them in.
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    /// The image behind each entry of `disks`, for messages.
    pub disk_paths: Vec<std::path::PathBuf>,
    /// Each disk's write journal, in `--disk` order, off until a replicator starts it.
    pub journals: Vec<Arc<devices::virtio::WriteJournal>>,
    /// `virtio_mmio.device=` fragments announcing the virtio devices to the guest.
    pub cmdline_fragments: Vec<String>,
    pub irqs: Vec<Arc<dyn IrqLine>>,
    /// Queue doorbells for the I/O thread (kernel exit mode only).
    pub notifiers: Vec<Notifier>,
    /// The devices' own event sources for the I/O thread (both exit modes).
    pub device_events: Vec<DeviceEvent>,
    /// The network devices, in `--net` order.
    pub nets: Vec<Arc<Mutex<MmioTransport>>>,
    /// Each network device's MAC, made up ones included: a snapshot keeps them, since the
    /// guest goes on using the MAC it read.
    pub net_macs: Vec<[u8; 6]>,
    /// Its listener's file, removed when the VM ends (on the control thread: the device may
    /// be dropped last on a thread whose filter has no `unlink`).
    pub vsock_socket: Option<devices::virtio::SocketFile>,
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

    /// The devices whose state a saved VM keeps.
    pub fn device_set(&self) -> crate::persist::DeviceSet {
        crate::persist::DeviceSet {
            serial: self.serial.clone(),
            pm: self.pm.clone(),
            transports: self.transports.clone(),
        }
    }

    /// Moves a staged vsock listener onto its path (see [`crate::VmBuilder::staged_sockets`]):
    /// from here on host programs reach this VM, not the process it came from.
    pub fn take_over_sockets(&self) -> Result<(), devices::virtio::TakeOverError> {
        match &self.vsock_socket {
            Some(f) => f.take_over(),
            None => Ok(()),
        }
    }

    /// Removes what the devices left in the file system (the vsock listener's socket).
    pub fn remove_sockets(&self) {
        if let Some(f) = &self.vsock_socket {
            f.remove();
        }
    }

    /// Interrupts raised by all devices so far.
    pub fn interrupts(&self) -> u64 {
        self.irqs.iter().map(|i| i.count()).sum()
    }
}

/// Devices built elsewhere (by `pmem`), placed after the disks: virtio devices take the next
/// virtio-mmio slots; plain MMIO devices sit at their own (base, size).
#[derive(Default)]
pub struct ExtraDevices {
    pub virtio: Vec<(String, Box<dyn VirtioDevice + Send>)>,
    pub mmio: Vec<(
        u64,
        u64,
        String,
        Arc<dyn vm_device::DeviceMmio + Send + Sync>,
    )>,
}

/// Places devices and wires their interrupts and doorbells the way the exit mode asks.
struct Wiring<'a> {
    vm: &'a KvmVm,
    mem: &'a GuestMemoryMmap,
    mode: ExitsMode,
    io: IoManager,
    irqs: Vec<Arc<dyn IrqLine>>,
    names: MmioNames,
    notifiers: Vec<Notifier>,
    device_events: Vec<DeviceEvent>,
    fragments: Vec<String>,
    virtio_count: u64,
    /// The virtio windows the layout set aside.
    slots: &'a [VirtioSlot],
}

impl Wiring<'_> {
    fn irq_line(&mut self, gsi: u32) -> Result<Arc<dyn IrqLine>, DeviceError> {
        if gsi > MAX_IRQ {
            return Err(DeviceError::OutOfIrqs(gsi));
        }
        let irq: Arc<dyn IrqLine> = match self.mode {
            ExitsMode::Kernel => {
                let irq = Arc::new(EventFdIrq::new().map_err(DeviceError::EventFd)?);
                self.vm.register_irqfd(irq.eventfd(), gsi)?;
                irq
            }
            ExitsMode::User => Arc::new(UserIrq::new(self.vm.shared_fd(), gsi)),
        };
        self.irqs.push(irq.clone());
        Ok(irq)
    }

    fn pio(
        &mut self,
        base: u16,
        len: u16,
        dev: Arc<dyn vm_device::DevicePio + Send + Sync>,
    ) -> Result<(), DeviceError> {
        self.io
            .register_pio(
                PioRange::new(PioAddress(base), len).map_err(DeviceError::Bus)?,
                dev,
            )
            .map_err(DeviceError::Bus)
    }

    /// Puts a virtio device in the next virtio-mmio slot, announces it on the command line
    /// and, in the kernel exit mode, gives each of its queues an ioeventfd doorbell.
    fn add_virtio(
        &mut self,
        name: &str,
        device: Box<dyn VirtioDevice + Send>,
    ) -> Result<Arc<Mutex<MmioTransport>>, DeviceError> {
        let i = self.virtio_count;
        let VirtioSlot { base, gsi } = *self
            .slots
            .get(i as usize)
            .ok_or(DeviceError::OutOfIrqs(VIRTIO_IRQ_BASE + i as u32))?;
        let irq = self.irq_line(gsi)?;
        let t = Arc::new(Mutex::new(MmioTransport::new(
            device,
            self.mem.clone(),
            irq,
        )));
        self.io
            .register_mmio(
                MmioRange::new(MmioAddress(base), VIRTIO_MMIO_SIZE).map_err(DeviceError::Bus)?,
                t.clone(),
            )
            .map_err(DeviceError::Bus)?;
        let transport = t.lock().unwrap_or_else(|e| e.into_inner());
        let events: Vec<(RawFd, usize)> = (transport.event_fds().into_iter().enumerate())
            .map(|(index, fd)| (fd, transport.event_lane(index)))
            .collect();
        let queues: Vec<(bool, usize)> = (0..transport.num_queues() as u16)
            .map(|q| (transport.pollable(q), transport.queue_lane(q)))
            .collect();
        drop(transport);
        for (index, (fd, lane)) in events.into_iter().enumerate() {
            self.device_events.push(DeviceEvent {
                fd,
                server: t.clone(),
                index,
                lane,
            });
        }
        if self.mode == ExitsMode::Kernel {
            for (q, (polled, lane)) in queues.into_iter().enumerate() {
                let eventfd = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
                self.vm
                    .register_ioevent(&eventfd, base + VIRTIO_MMIO_QUEUE_NOTIFY, q as u32)?;
                self.notifiers.push(Notifier {
                    eventfd,
                    server: t.clone(),
                    queue: q as u16,
                    polled,
                    lane,
                });
            }
        }
        self.names.add(
            base,
            VIRTIO_MMIO_SIZE,
            Arc::from(name),
            Arc::from(format!("{name}:queue_notify")),
        );
        self.fragments
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        self.virtio_count += 1;
        Ok(t)
    }
}

/// How the devices' host side is set up, beside what the configuration says.
#[derive(Default)]
pub struct HostSide {
    /// Keeps a copy of COM1's output for the report.
    pub capture: Option<Arc<Mutex<Vec<u8>>>>,
    /// The vsock listener is bound beside its path until the VM starts (a migration's
    /// destination, see [`crate::VmBuilder::staged_sockets`]).
    pub staged_sockets: bool,
}

pub fn create_devices(
    vm: &KvmVm,
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    layout: &GuestLayout,
    host: HostSide,
    extra: ExtraDevices,
    control: Arc<RunControl>,
) -> Result<Devices, DeviceError> {
    let HostSide {
        capture,
        staged_sockets,
    } = host;
    let (serial_mode, disks, mode) = (&config.serial, &config.disks[..], config.exits);
    let mut w = Wiring {
        vm,
        mem,
        mode,
        io: IoManager::new(),
        irqs: Vec::new(),
        names: MmioNames::default(),
        notifiers: Vec::new(),
        device_events: Vec::new(),
        fragments: Vec::new(),
        virtio_count: 0,
        slots: &layout.virtio,
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
    let com1_irq: Arc<dyn Irq> = w.irq_line(COM1_IRQ)?;
    let serial = Arc::new(Mutex::new(Serial::new(
        com1_irq,
        SerialOutput::new(sink, capture),
    )));
    w.pio(COM1_BASE, COM1_LEN, serial.clone())?;
    w.pio(
        I8042_BASE,
        I8042_LEN,
        Arc::new(Mutex::new(I8042::new(control.clone()))),
    )?;
    w.pio(
        EXIT_PORT,
        4,
        Arc::new(Mutex::new(ExitPort::new(control.clone()))),
    )?;
    let sci: Arc<dyn Irq> = w.irq_line(SCI_IRQ)?;
    let pm = Arc::new(Mutex::new(Pm::new(sci, control)));
    w.pio(PM_BASE, PM_LEN, pm.clone())?;

    let mut transports = Vec::new();
    let mut journals = Vec::new();
    for (i, d) in disks.iter().enumerate() {
        let journal = devices::virtio::WriteJournal::open(&d.path)
            .map(Arc::new)
            .map_err(|source| DeviceError::Block {
                path: d.path.clone(),
                source: devices::virtio::BlockError::Io {
                    path: d.path.clone(),
                    what: "opening it again to read what replication ships",
                    source,
                },
            })?;
        journals.push(journal.clone());
        let block = Block::new(BlockConfig {
            path: d.path.clone(),
            readonly: d.readonly,
            cache: d.cache,
            id: format!("musubi-disk{i}"),
        })
        .map_err(|source| DeviceError::Block {
            path: d.path.clone(),
            source,
        })?
        .with_journal(journal);
        transports.push(w.add_virtio(&format!("virtio-blk{i}"), Box::new(block))?);
    }
    let mut all = transports.clone();
    let (mut nets, mut net_macs) = (Vec::new(), Vec::new());
    for (i, n) in config.net.iter().enumerate() {
        let device = crate::net::open(n)?;
        net_macs.push(device.mac());
        nets.push(w.add_virtio(&format!("virtio-net{i}"), Box::new(device))?);
    }
    all.extend(nets.iter().cloned());
    let mut vsock_socket = None;
    if let Some(v) = &config.vsock {
        let device = if staged_sockets {
            devices::virtio::Vsock::staged(v.cid, &v.socket)
        } else {
            devices::virtio::Vsock::new(v.cid, &v.socket)
        }
        .map_err(|source| DeviceError::Vsock {
            cid: v.cid,
            path: v.socket.clone(),
            source,
        })?;
        let file = device.socket_file();
        let t = match w.add_virtio("virtio-vsock", Box::new(device)) {
            Ok(t) => t,
            Err(e) => {
                file.remove();
                return Err(e);
            }
        };
        vsock_socket = Some(file);
        all.push(t);
    }
    for (name, device) in extra.virtio {
        all.push(w.add_virtio(&name, device)?);
    }
    // Last, so the slots of the devices before it are where they were without it.
    if let Some(r) = &config.rng {
        let device = devices::virtio::Rng::new(r.bytes_per_sec)?;
        all.push(w.add_virtio("virtio-rng0", Box::new(device))?);
    }
    for (base, size, name, device) in extra.mmio {
        w.io.register_mmio(
            MmioRange::new(MmioAddress(base), size).map_err(DeviceError::Bus)?,
            device,
        )
        .map_err(DeviceError::Bus)?;
        let name: Arc<str> = Arc::from(name);
        w.names.add(base, size, name.clone(), name);
    }
    let names = Arc::new(w.names);
    Ok(Devices {
        bus: Arc::new(LocalBus {
            io: w.io,
            names: names.clone(),
        }),
        mmio_names: names,
        serial,
        pm,
        disks: transports,
        transports: all,
        disk_paths: disks.iter().map(|d| d.path.clone()).collect(),
        journals,
        cmdline_fragments: w.fragments,
        irqs: w.irqs,
        notifiers: w.notifiers,
        device_events: w.device_events,
        nets,
        net_macs,
        vsock_socket,
    })
}
