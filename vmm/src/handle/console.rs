//! The console and the accounting of a running VM: typing into its serial port, and its
//! exit metrics and device counters as `--metrics` and `vm.counters` give them.

use super::{Shared, VmHandle};
use crate::metrics::detailed;
use musubi_types::{
    BlockCounters, Counters, DeviceCounters, Interrupts, MemoryUse, Metrics, NetCounters,
    Notifications, VcpuCounters, VcpuExits,
};
use std::sync::atomic::Ordering;

/// A network device's counters, as `--metrics` and `vm.counters` give them.
fn net_counters(t: &devices::virtio::MmioTransport) -> NetCounters {
    t.net_counters().unwrap_or(NetCounters {
        interrupts: t.stats().interrupts,
        ..NetCounters::default()
    })
}

/// The backend's name as it serialises (`anonymous`, `ondemand`, ...).
fn backend_name(b: crate::vstate::memory::RamBackend) -> String {
    match serde_json::to_value(b) {
        Ok(serde_json::Value::String(name)) => name,
        _ => String::new(),
    }
}

impl Shared {
    pub(crate) fn read_metrics(&self) -> Metrics {
        let names = |t| self.names.name(t);
        let (per_vcpu, all) = detailed(&self.metrics, &names);
        let notify_exits: u64 = all
            .iter()
            .filter(|d| {
                d.detail
                    .as_deref()
                    .is_some_and(|n| n.ends_with(":queue_notify"))
            })
            .map(|d| d.count)
            .sum();
        let mut interrupts = Interrupts::default();
        for irq in &self.irqs {
            interrupts.add(irq.path(), irq.count());
        }
        let mut metrics = Metrics {
            exits_mode: self.exits.to_string(),
            total_exits: all.iter().map(|d| d.count).sum(),
            exits: all,
            vcpus: per_vcpu
                .into_iter()
                .zip(&self.vcpu_ids)
                .map(|(exits, &id)| VcpuExits { id, exits })
                .collect(),
            notifications: Notifications {
                mmio_exit: notify_exits,
                ioeventfd: self.ioeventfd_served.load(Ordering::Relaxed),
            },
            interrupts,
            net: self
                .nets
                .iter()
                .map(|t| net_counters(&t.lock().unwrap_or_else(|e| e.into_inner())))
                .collect(),
            rng: self
                .parts
                .devices()
                .transports
                .iter()
                .find_map(|t| t.lock().unwrap_or_else(|e| e.into_inner()).rng_counters()),
            io_thread: crate::io_thread::IoThreadStats::total(&self.io_stats),
            io_threads: match self.io_stats.len() {
                0 | 1 => Vec::new(),
                _ => self.io_stats.iter().map(|s| s.counters()).collect(),
            },
            memory: MemoryUse {
                backend: backend_name(self.ram.backend()),
                vcpu_threads: self.ram.vcpu_threads(),
            },
            ..Metrics::default()
        };
        if let Some(extra) = &self.extra_metrics {
            extra(&mut metrics);
        }
        metrics
    }
}

impl VmHandle {
    /// The exit accounting so far, as `--metrics` writes it.
    pub fn metrics(&self) -> Metrics {
        self.shared.read_metrics()
    }

    /// Device counters as Cloud Hypervisor's `vm.counters` gives them: device name to
    /// counter name to value, with the vCPUs' exits as one more "device".
    pub fn counters(&self) -> Counters {
        let mut out = Counters {
            vcpus: VcpuCounters {
                exits: self.shared.metrics.iter().map(|m| m.total()).sum(),
            },
            devices: Default::default(),
        };
        let (mut blk, mut other, mut net, mut rng) = (0u32, 0u32, 0u32, 0u32);
        for t in &self.shared.parts.devices().transports {
            let t = t.lock().unwrap_or_else(|e| e.into_inner());
            let s = t.stats();
            if let Some(c) = t.rng_counters() {
                out.devices
                    .insert(format!("virtio-rng{rng}"), DeviceCounters::Rng(c));
                rng += 1;
                continue;
            }
            if t.net_counters().is_some() {
                out.devices.insert(
                    format!("virtio-net{net}"),
                    DeviceCounters::Net(net_counters(&t)),
                );
                net += 1;
                continue;
            }
            let name = match t.device_type() {
                2 => {
                    blk += 1;
                    format!("virtio-blk{}", blk - 1)
                }
                _ => {
                    other += 1;
                    format!("virtio-pmem{}", other - 1)
                }
            };
            out.devices.insert(
                name,
                DeviceCounters::Block(BlockCounters {
                    requests: s.requests,
                    read_bytes: s.bytes_read,
                    write_bytes: s.bytes_written,
                    flushes: s.flushes,
                    errors: s.errors,
                    interrupts: s.interrupts,
                }),
            );
        }
        out
    }

    /// Types `bytes` into COM1 as if they came down the serial line, raising its receive
    /// interrupt. Returns how many were taken: fewer than offered (maybe 0) while the UART's
    /// 64-byte receive FIFO is full. A UART has no way to stall its sender without losing
    /// data, so the caller keeps the rest and offers it again later; this never waits, so
    /// it cannot hold up a vCPU. Bytes offered after the VM ended are taken and ignored.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        if self.shared.control.is_finished() {
            return bytes.len();
        }
        self.shared
            .parts
            .devices()
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_input(bytes)
    }
}
