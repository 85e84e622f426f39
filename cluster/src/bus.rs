//! The exit bus of a node: IPIs to whichever node runs the target, device accesses to the
//! node that holds the devices (served here when that is this node), answers back to the
//! waiting vCPU.

use super::ipi::{self, Msi, IPI_PORT};
use super::moving::{Route, Routes};
use dsm::NodeId;
use dsm_host::{Envelope, Exit, Inbound, InboxSender, Interrupt, IoSpace};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use vmm::{DeviceBus, MmioTarget, MsiInjector, RunControl};

/// How often a vCPU waiting for a forwarded access checks whether the VM has ended.
const REPLY_TICK: Duration = Duration::from_millis(50);

/// The answer slot of each vCPU: one forwarded access at a time, since the vCPU waits.
pub(crate) struct Replies {
    slots: Vec<(Mutex<Option<Vec<u8>>>, Condvar)>,
}

impl Replies {
    pub fn new(cpus: u8) -> Replies {
        Replies {
            slots: (0..cpus)
                .map(|_| (Mutex::new(None), Condvar::new()))
                .collect(),
        }
    }

    /// Hands `data` to vCPU `vcpu`; false if no such vCPU.
    pub fn answer(&self, vcpu: u32, data: Vec<u8>) -> bool {
        let Some((slot, cv)) = self.slots.get(vcpu as usize) else {
            return false;
        };
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(data);
        cv.notify_all();
        true
    }

    /// Waits for vCPU `vcpu`'s answer until the VM ends.
    fn wait(&self, vcpu: u8, control: &RunControl) -> Option<Vec<u8>> {
        let (slot, cv) = self.slots.get(vcpu as usize)?;
        let mut g = slot.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(d) = g.take() {
                return Some(d);
            }
            if control.is_finished() {
                return None;
            }
            g = cv
                .wait_timeout(g, REPLY_TICK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn clear(&self, vcpu: u8) {
        if let Some((slot, _)) = self.slots.get(vcpu as usize) {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// Counters of what the bus sent elsewhere, for `--metrics`.
#[derive(Default)]
pub(crate) struct BusCounters {
    pub forwarded: AtomicU64,
    pub ipis_local: AtomicU64,
    pub ipis_remote: AtomicU64,
}

pub(crate) struct NodeBus {
    pub io_node: u16,
    pub cpus: u8,
    /// Which node runs each vCPU.
    pub routes: Arc<Routes>,
    /// The devices, on the node that holds them.
    pub local: Option<Arc<dyn DeviceBus>>,
    /// The coherence thread's inbox: what goes to peers leaves in order with the protocol's
    /// own messages, so a doorbell never overtakes the page writes before it.
    pub outbox: InboxSender,
    pub msi: MsiInjector,
    pub replies: Arc<Replies>,
    pub control: Arc<RunControl>,
    pub counters: Arc<BusCounters>,
}

impl NodeBus {
    fn send(&self, to: u16, env: Envelope) -> bool {
        self.outbox.push(Inbound::Send {
            to: NodeId(to),
            env,
        })
    }

    /// Sends one access to the I/O node and waits for its answer; reads of a VM that ended
    /// meanwhile see all ones, as from a device that is gone.
    fn forward(&self, vcpu: u8, space: IoSpace, addr: u64, data: &[u8], out: Option<&mut [u8]>) {
        self.replies.clear(vcpu);
        self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
        let exit = Exit {
            vcpu: vcpu as u32,
            space,
            write: out.is_none(),
            addr,
            data: data.to_vec(),
        };
        let answer = if self.send(self.io_node, Envelope::Exit(exit)) {
            self.replies.wait(vcpu, &self.control)
        } else {
            None
        };
        if let Some(out) = out {
            match answer {
                Some(d) if d.len() == out.len() => out.copy_from_slice(&d),
                _ => out.fill(0xff),
            }
        }
    }

    fn ipi(&self, sender: u8, data: &[u8]) {
        for m in ipi::decode(sender, self.cpus, data) {
            match self
                .routes
                .route(m, |m| inject(&self.msi, m.address, m.data))
            {
                Route::Here | Route::Held => {
                    self.counters.ipis_local.fetch_add(1, Ordering::Relaxed);
                }
                Route::To(node) => {
                    self.counters.ipis_remote.fetch_add(1, Ordering::Relaxed);
                    self.send(node, msi_envelope(&m));
                }
                Route::Nowhere => {}
            }
        }
    }
}

/// An MSI as it crosses to the node that runs its target.
pub(crate) fn msi_envelope(m: &Msi) -> Envelope {
    Envelope::Interrupt(Interrupt::Msi {
        address: m.address as u64,
        data: m.data,
    })
}

/// Injects one MSI into this node's VM. A refused MSI means the guest named a vCPU that is
/// not here; like a PC, the interrupt is lost.
pub(crate) fn inject(msi: &MsiInjector, address: u32, data: u32) {
    if let Err(e) = msi.signal(address, data) {
        tracing::debug!(vcpu = ipi::target_of(address), "MSI not delivered: {e}");
    }
}

impl DeviceBus for NodeBus {
    fn pio_read(&self, vcpu: u8, port: u16, data: &mut [u8]) {
        match &self.local {
            _ if port == IPI_PORT => data.fill(0xff),
            Some(local) => local.pio_read(vcpu, port, data),
            None => self.forward(
                vcpu,
                IoSpace::Port,
                port as u64,
                &vec![0; data.len()],
                Some(data),
            ),
        }
    }
    fn pio_write(&self, vcpu: u8, port: u16, data: &[u8]) {
        match &self.local {
            _ if port == IPI_PORT => self.ipi(vcpu, data),
            Some(local) => local.pio_write(vcpu, port, data),
            None => self.forward(vcpu, IoSpace::Port, port as u64, data, None),
        }
    }
    fn mmio_read(&self, vcpu: u8, addr: u64, data: &mut [u8]) {
        match &self.local {
            Some(local) => local.mmio_read(vcpu, addr, data),
            None => self.forward(vcpu, IoSpace::Mmio, addr, &vec![0; data.len()], Some(data)),
        }
    }
    fn mmio_write(&self, vcpu: u8, addr: u64, data: &[u8]) {
        match &self.local {
            Some(local) => local.mmio_write(vcpu, addr, data),
            None => self.forward(vcpu, IoSpace::Mmio, addr, data, None),
        }
    }
    fn mmio_target(&self, addr: u64) -> MmioTarget {
        match &self.local {
            Some(local) => local.mmio_target(addr),
            None => MmioTarget(0),
        }
    }
}

/// Serves one access another node forwarded, on the local devices; the answer for a read
/// is the bytes read, for a write nothing.
pub(crate) fn serve(local: &dyn DeviceBus, e: &Exit) -> Vec<u8> {
    let vcpu = e.vcpu as u8;
    let mut data = e.data.clone();
    match (e.space, e.write) {
        (IoSpace::Port, true) => local.pio_write(vcpu, e.addr as u16, &e.data),
        (IoSpace::Port, false) => local.pio_read(vcpu, e.addr as u16, &mut data),
        (IoSpace::Mmio, true) => local.mmio_write(vcpu, e.addr, &e.data),
        (IoSpace::Mmio, false) => local.mmio_read(vcpu, e.addr, &mut data),
    }
    if e.write {
        Vec::new()
    } else {
        data
    }
}
