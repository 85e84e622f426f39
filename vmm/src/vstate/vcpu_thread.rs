//! vCPU threads that start with the build: each installs its filter, probes the host's
//! CPUID, and creates and configures its own vCPU while the building thread creates memory,
//! loads the kernel and builds devices, then waits for the order to run.
//!
//! Done one after the other on the building thread, these KVM calls were the larger part of
//! the time to the first KVM_RUN: KVM_GET_SUPPORTED_CPUID executes CPUID for every leaf (each
//! one a trap when the host is itself virtual), and on Intel hosts the first
//! KVM_CREATE_VCPU registers the APIC-access memory slot, which waits for the SRCU grace
//! period that creating the in-kernel irqchip started. Here they overlap the rest of the
//! build, and the thread that runs the vCPU already exists when the VM starts.

use super::vcpu::{kick_signal, unbind_thread, Vcpu, VcpuContext, VcpuError};
use crate::arch::x86_64::cpuid::NodeLeaves;
use crate::seccomp::{self, SeccompMode, ThreadKind};
use kvm_bindings::{kvm_regs, kvm_sregs, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VmFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// The host's supported CPUID, asked of KVM once per VM by whichever vCPU thread comes first.
type SharedCpuid = Arc<OnceLock<Result<CpuId, kvm_ioctls::Error>>>;

/// Where the BSP starts: its registers and how its special registers are set.
#[derive(Clone, Copy)]
pub struct Boot {
    pub regs: kvm_regs,
    pub sregs: fn(&mut kvm_sregs),
}

/// What the building thread tells a vCPU thread, in this order.
enum Order {
    /// The in-kernel interrupt controllers exist: create the vCPU on this VM.
    Create(Arc<VmFd>),
    /// The kernel is loaded: the BSP's entry state (`None` for the other vCPUs).
    Boot(Option<Boot>),
    /// The VM starts.
    Run(VcpuContext),
}

/// What every vCPU thread of a VM is given when it starts.
#[derive(Clone)]
pub struct Plan {
    pub kvm: Arc<Kvm>,
    /// vCPUs in the whole VM (the CPUID topology).
    pub count: u8,
    pub node: Option<NodeLeaves>,
    pub seccomp: SeccompMode,
    cpuid: SharedCpuid,
}

impl Plan {
    pub fn new(kvm: Arc<Kvm>, count: u8, node: Option<NodeLeaves>, seccomp: SeccompMode) -> Plan {
        Plan {
            kvm,
            count,
            node,
            seccomp,
            cpuid: SharedCpuid::default(),
        }
    }
}

/// A vCPU thread that has not been told to run. Dropping it ends the thread.
pub struct PendingVcpu {
    pub id: u8,
    orders: Option<Sender<Order>>,
    ready: Receiver<Result<(), VcpuError>>,
    thread: Option<JoinHandle<()>>,
}

impl PendingVcpu {
    /// Starts the thread of vCPU `id`; it probes CPUID and compiles its filter at once.
    pub fn spawn(id: u8, plan: &Plan) -> std::io::Result<PendingVcpu> {
        let (orders, inbox) = channel();
        let (done, ready) = channel();
        let plan = plan.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || set_up_and_run(id, plan, inbox, done))?;
        Ok(PendingVcpu {
            id,
            orders: Some(orders),
            ready,
            thread: Some(thread),
        })
    }

    /// Has the thread create its vCPU on `vm`, whose interrupt controllers exist.
    pub fn create(&self, vm: &Arc<VmFd>) {
        self.order(Order::Create(vm.clone()));
    }

    /// Gives the thread its entry state (the BSP) or none, after which it installs its
    /// filter and reports.
    pub fn boot(&self, boot: Option<Boot>) {
        self.order(Order::Boot(boot));
    }

    /// Waits until the vCPU exists, is configured and filtered, or the reason it is not.
    pub fn ready(&self) -> Result<(), VcpuError> {
        self.ready
            .recv()
            .unwrap_or(Err(VcpuError::ThreadEnded { id: self.id }))
    }

    /// Lets the vCPU run; the thread is the caller's from here on.
    pub fn run(mut self, ctx: VcpuContext) -> Result<JoinHandle<()>, VcpuError> {
        let id = self.id;
        let sent = self.orders.take().map(|o| o.send(Order::Run(ctx)).is_ok());
        match (sent, self.thread.take()) {
            (Some(true), Some(t)) => Ok(t),
            (_, t) => {
                if let Some(t) = t {
                    let _ = t.join();
                }
                Err(VcpuError::ThreadEnded { id })
            }
        }
    }

    fn order(&self, order: Order) {
        // A thread that has ended has reported why through `ready`.
        if let Some(o) = &self.orders {
            let _ = o.send(order);
        }
    }
}

impl Drop for PendingVcpu {
    fn drop(&mut self) {
        // Closing the channel ends a thread that waits for its next order.
        self.orders = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn set_up_and_run(id: u8, plan: Plan, inbox: Receiver<Order>, done: Sender<Result<(), VcpuError>>) {
    seccomp::block_process_signals(&[kick_signal()]);
    // Work that needs no VM yet: the filter, which allows every KVM call left to make here,
    // and the host's CPUID.
    let filtered = seccomp::prepare(ThreadKind::Vcpu, plan.seccomp)
        .and_then(|f| f.install())
        .map_err(|source| VcpuError::Seccomp { id, source });
    let supported = plan
        .cpuid
        .get_or_init(|| plan.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES))
        .clone()
        .map_err(VcpuError::SupportedCpuid);
    let Ok(Order::Create(vm)) = inbox.recv() else {
        return;
    };
    let vcpu = filtered
        .and(supported)
        .and_then(|c| Vcpu::new(&c, &vm, id, plan.count, plan.node));
    drop(vm);
    let Ok(Order::Boot(boot)) = inbox.recv() else {
        return;
    };
    let set_up = vcpu.and_then(|mut v| {
        if let Some(b) = boot {
            v.set_regs(&b.regs, b.sregs)?;
        }
        v.bind_to_thread();
        Ok(v)
    });
    let vcpu = match set_up {
        Ok(v) => {
            let _ = done.send(Ok(()));
            v
        }
        Err(e) => {
            let _ = done.send(Err(e));
            return;
        }
    };
    match inbox.recv() {
        Ok(Order::Run(ctx)) => vcpu.run(ctx),
        _ => unbind_thread(),
    }
}
