//! vCPU threads that start with the build: each probes the host's CPUID, installs its
//! filter, and creates and configures its own vCPU while the building thread creates
//! memory, loads the kernel and builds devices, then waits for the order to run.
//!
//! Done one after the other on the building thread, these KVM calls were the larger part of
//! the time to the first KVM_RUN: KVM_GET_SUPPORTED_CPUID executes CPUID for every leaf (each
//! one a trap when the host is itself virtual), and on Intel hosts the first
//! KVM_CREATE_VCPU registers the APIC-access memory slot, which waits for the SRCU grace
//! period that creating the in-kernel irqchip started. Here they overlap the rest of the
//! build, and the thread that runs the vCPU already exists when the VM starts.

use super::vcpu::{kick_signal, unbind_thread, Vcpu, VcpuContext, VcpuError};
use crate::arch::x86_64::cpuid::Topology;
use crate::control::{panic_message, Outcome};
use crate::persist::{Persist, VcpuState};
use crate::seccomp::{self, SeccompMode, ThreadKind};
use kvm_bindings::{kvm_regs, kvm_sregs, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VmFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

/// The host's supported CPUID, asked of KVM once per VM by whichever vCPU thread comes first.
pub(crate) type SharedCpuid = Arc<OnceLock<Result<CpuId, kvm_ioctls::Error>>>;

/// Where the BSP starts: its registers and how its special registers are set.
#[derive(Clone, Copy)]
pub struct Boot {
    pub regs: kvm_regs,
    pub sregs: fn(&mut kvm_sregs),
}

/// What the building thread tells a vCPU thread, in this order.
enum VcpuStep {
    /// The in-kernel interrupt controllers exist: create the vCPU on this VM.
    Create(Arc<VmFd>),
    /// The kernel is loaded: the BSP's entry state (`None` for the other vCPUs).
    Boot(Option<Boot>),
    /// The vCPU's state from a snapshot, instead of a boot.
    Restore(Box<VcpuState>),
    /// The VM starts.
    Run(VcpuContext),
}

/// What every vCPU thread of a VM is given when it starts.
#[derive(Clone)]
pub struct VcpuSetup {
    kvm: Arc<Kvm>,
    /// vCPUs in the whole VM (the CPUID topology).
    count: u8,
    node: Option<Topology>,
    seccomp: SeccompMode,
    cpuid: SharedCpuid,
    /// vCPUs of this process set up (or failed), against how many there are: the BSP waits
    /// for all of them before its first KVM_RUN, so no start-up IPI it sends can find an AP
    /// that does not exist yet.
    settled: Arc<(Mutex<SetUpTally>, Condvar)>,
    local: usize,
}

impl VcpuSetup {
    /// `local` vCPUs of a VM of `count` are made in this process.
    pub fn new(
        kvm: Arc<Kvm>,
        count: u8,
        local: usize,
        node: Option<Topology>,
        seccomp: SeccompMode,
    ) -> VcpuSetup {
        VcpuSetup {
            kvm,
            count,
            node,
            seccomp,
            cpuid: SharedCpuid::default(),
            settled: Arc::default(),
            local,
        }
    }

    /// Counts this thread's vCPU as settled when dropped, on every way out of its set-up
    /// (an early end or a panic included), so the BSP never waits for a thread that is gone.
    fn settling(&self) -> SetUpReport<'_> {
        SetUpReport(self, None)
    }

    /// Waits until every vCPU of this process is set up, and returns why one is not, if
    /// one failed.
    fn wait_all_settled(&self) -> Option<String> {
        let (state, changed) = &*self.settled;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        while state.count < self.local {
            state = changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.failure.clone()
    }
}

#[derive(Default)]
struct SetUpTally {
    count: usize,
    /// The first vCPU set-up that failed, and why.
    failure: Option<String>,
}

/// Counts one vCPU as settled when dropped, with its failure if `fail` recorded one.
struct SetUpReport<'a>(&'a VcpuSetup, Option<String>);

impl SetUpReport<'_> {
    fn fail(&mut self, why: String) {
        self.1 = Some(why);
    }
}

impl Drop for SetUpReport<'_> {
    fn drop(&mut self) {
        let (state, changed) = &*self.0.settled;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.count += 1;
        if state.failure.is_none() {
            state.failure = self.1.take();
        }
        changed.notify_all();
    }
}

/// A vCPU thread that has not been told to run. Dropping it ends the thread.
pub struct PendingVcpu {
    pub id: u8,
    orders: Option<Sender<VcpuStep>>,
    thread: Option<JoinHandle<()>>,
}

impl PendingVcpu {
    /// Starts the thread of vCPU `id`; it probes CPUID and installs its filter at once.
    pub(crate) fn spawn(id: u8, setup: &VcpuSetup) -> std::io::Result<PendingVcpu> {
        let (orders, inbox) = channel();
        let setup = setup.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || set_up_and_run(id, setup, inbox))?;
        Ok(PendingVcpu {
            id,
            orders: Some(orders),
            thread: Some(thread),
        })
    }

    /// Has the thread create its vCPU on `vm`, whose interrupt controllers exist.
    pub fn create(&self, vm: &Arc<VmFd>) {
        self.order(VcpuStep::Create(vm.clone()));
    }

    /// Gives the thread its entry state (the BSP) or none.
    pub fn boot(&self, boot: Option<Boot>) {
        self.order(VcpuStep::Boot(boot));
    }

    /// Gives the thread the state its vCPU had when a snapshot was taken.
    pub fn restore(&self, state: VcpuState) {
        self.order(VcpuStep::Restore(Box::new(state)));
    }

    /// Lets the vCPU run as soon as it is set up, and hands its thread over. Nothing waits
    /// here: a thread still busy with its set-up finds the order in its queue and enters the
    /// guest without sleeping, and a set-up that failed ends the VM through `ctx`'s control
    /// with the reason.
    pub fn run(mut self, ctx: VcpuContext) -> JoinHandle<()> {
        let control = ctx.control.clone();
        let sent = self
            .orders
            .take()
            .is_some_and(|o| o.send(VcpuStep::Run(ctx)).is_ok());
        if !sent {
            control.finish(Outcome::VmmError(
                VcpuError::ThreadEnded { id: self.id }.to_string(),
            ));
        }
        self.thread
            .take()
            .expect("a pending vCPU keeps its thread until it runs")
    }

    fn order(&self, order: VcpuStep) {
        // A thread that has ended reports why when it is told to run.
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

fn set_up_and_run(id: u8, setup: VcpuSetup, inbox: Receiver<VcpuStep>) {
    seccomp::block_process_signals(&[kick_signal()]);
    let mut settling = setup.settling();
    let set_up =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| set_up(id, &setup, &inbox)));
    let set_up = match set_up {
        Ok(Some(r)) => r,
        // The build was abandoned.
        Ok(None) => return,
        Err(panic) => Err(VcpuError::SetUpPanicked {
            id,
            why: panic_message(&*panic),
        }),
    };
    if let Err(e) = &set_up {
        settling.fail(e.to_string());
    }
    drop(settling);
    // Orders a failed set-up left unread come before the one to run.
    let ctx = loop {
        match inbox.recv() {
            Ok(VcpuStep::Run(ctx)) => break ctx,
            Ok(_) => continue,
            Err(_) => {
                unbind_thread();
                return;
            }
        }
    };
    match set_up {
        Ok(vcpu) => {
            // The BSP enters the guest only with every vCPU of this process in place.
            match (id == 0).then(|| setup.wait_all_settled()).flatten() {
                None => vcpu.run(ctx),
                Some(why) => {
                    unbind_thread();
                    ctx.control.finish(Outcome::VmmError(why));
                }
            }
        }
        Err(e) => {
            unbind_thread();
            ctx.control.finish(Outcome::VmmError(e.to_string()));
        }
    }
}

/// Creates and configures vCPU `id` as the orders come; `None` if the build was abandoned
/// before they all came.
fn set_up(
    id: u8,
    setup: &VcpuSetup,
    inbox: &Receiver<VcpuStep>,
) -> Option<Result<Vcpu, VcpuError>> {
    // Work that needs no VM yet: the host's CPUID first (the vCPU cannot be configured
    // without it), then the filter, while the VM's interrupt controllers are made.
    let supported = setup
        .cpuid
        .get_or_init(|| setup.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES))
        .clone()
        .map_err(VcpuError::SupportedCpuid);
    // The filter goes on before the VM's interrupt controllers exist rather than after
    // the vCPU is configured: installing it takes about 0.1 ms (the kernel walks it for
    // every system call number to find the ones it always allows), which here overlaps
    // the build instead of delaying the first KVM_RUN. Everything left to do on this
    // thread (KVM ioctls, futexes, the vCPU's mapping) is allowed by it.
    let filtered = seccomp::apply(ThreadKind::Vcpu, setup.seccomp)
        .map_err(|source| VcpuError::Seccomp { id, source });
    let Ok(VcpuStep::Create(vm)) = inbox.recv() else {
        return None;
    };
    let vcpu = filtered
        .and(supported)
        .and_then(|c| Vcpu::new(&c, &vm, id, setup.count, setup.node));
    drop(vm);
    #[cfg(feature = "testing")]
    if crate::testing::vcpu_set_up_panics(id) {
        panic!("set-up failure injected by a test");
    }
    let entry = match inbox.recv() {
        Ok(VcpuStep::Boot(boot)) => Ok(boot),
        Ok(VcpuStep::Restore(state)) => Err(state),
        _ => return None,
    };
    Some(vcpu.and_then(|mut v| {
        match entry {
            Ok(Some(b)) => v.set_regs(&b.regs, b.sregs)?,
            Ok(None) => {}
            Err(state) => v.restore(&state)?,
        }
        v.bind_to_thread();
        Ok(v)
    }))
}
