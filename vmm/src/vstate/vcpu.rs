//! One vCPU: its KVM set-up and the thread that runs it until the VM ends.

use crate::arch::x86_64::cpuid::{add_node_leaves, filter_cpuid, Topology};
use crate::control::{panic_message, Outcome, RunControl};
use crate::exit::{crash_outcome, handle_exit, DeviceBus, ExitAction};
use crate::metrics::VcpuMetrics;
use crate::vstate::memory::GuestRam;
use kvm_bindings::{
    kvm_lapic_state, kvm_msr_entry, kvm_run, CpuId, Msrs, KVM_MP_STATE_HALTED,
    KVM_MP_STATE_INIT_RECEIVED, KVM_MP_STATE_UNINITIALIZED,
};
use kvm_ioctls::{VcpuFd, VmFd};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {id}: {what} failed: {source}")]
    Ioctl {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: no room left in the CPUID table for the multi-node leaves")]
    CpuidFull { id: u8 },
    #[error("vCPU {id}: KVM refused to set MSR {index:#x}")]
    MsrRejected { id: u8, index: u32 },
    #[error("KVM_GET_SUPPORTED_CPUID failed: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
    #[error("vCPU {id}: {source}")]
    Seccomp {
        id: u8,
        source: crate::seccomp::SeccompError,
    },
    #[error("vCPU {id}: its thread ended while the VM was being built")]
    ThreadEnded { id: u8 },
    #[error("vCPU {id}: its set-up panicked: {why}")]
    SetUpPanicked { id: u8, why: String },
}

/// Signal used to kick a vCPU thread out of KVM_RUN.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

thread_local! {
    /// This thread's vCPU run structure, for the kick handler.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// Sets `immediate_exit` on the kicked thread's vCPU, so KVM_RUN returns at once whether
/// the kick lands inside the guest or just before the thread re-enters it: a kick cannot
/// be lost, and stopping needs no polling.
extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN.with(|run| {
        let run = run.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's own kvm_run mapping, set while its
            // VcpuFd is alive and cleared before the fd is dropped.
            unsafe { std::ptr::write_volatile(&mut (*run).immediate_exit, 1) };
        }
    });
}

/// Installs the kick handler once per process.
pub fn install_kick_handler() -> std::io::Result<()> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
                .map_err(|e| e.errno())
        })
        .map_err(std::io::Error::from_raw_os_error)
}

/// What a vCPU was doing when the VM last asked (see [`VcpuState`]), tagged with the
/// request it answers.
#[derive(Default)]
pub struct VcpuStatus(AtomicU64);

/// What a kicked vCPU reports about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuState {
    Running,
    /// HLT with interrupts enabled: an interrupt will wake it.
    Idle,
    /// HLT with interrupts disabled: nothing but NMI or INIT wakes it.
    HaltedForGood {
        rip: u64,
    },
    /// An AP still waiting for INIT/SIPI.
    WaitingForStartup,
}

impl VcpuStatus {
    fn set(&self, request: u64, state: VcpuState) {
        let (code, rip) = match state {
            VcpuState::Running => (1, 0),
            VcpuState::Idle => (2, 0),
            VcpuState::HaltedForGood { rip } => (3, rip),
            VcpuState::WaitingForStartup => (4, 0),
        };
        // The RIP of a halted vCPU fits in 48 bits on every x86-64 guest.
        self.0.store(
            (request << 56) | (code << 48) | (rip & 0xffff_ffff_ffff),
            Ordering::Release,
        );
    }

    /// The state reported for `request`, if the vCPU has answered it yet.
    pub fn get(&self, request: u64) -> Option<VcpuState> {
        let v = self.0.load(Ordering::Acquire);
        if v >> 56 != request & 0xff {
            return None;
        }
        Some(match (v >> 48) & 0xff {
            2 => VcpuState::Idle,
            3 => VcpuState::HaltedForGood {
                rip: v & 0xffff_ffff_ffff,
            },
            4 => VcpuState::WaitingForStartup,
            _ => VcpuState::Running,
        })
    }
}

/// What a vCPU thread shares with the VM that runs it.
pub struct VcpuContext {
    pub bus: Arc<dyn DeviceBus>,
    pub control: Arc<RunControl>,
    pub metrics: Arc<VcpuMetrics>,
    pub status: Arc<VcpuStatus>,
    /// The VM's current "what are you doing?" request; answered at the next kick.
    pub request: Arc<AtomicU64>,
    pub ram: Arc<GuestRam>,
    /// Set by the BSP at its first KVM_RUN.
    pub first_run: Arc<OnceLock<(Instant, u64)>>,
    /// Where this vCPU parks while the VM is paused, as local vCPU `index`.
    pub pause: Arc<super::pause::PauseGate>,
    pub index: usize,
}

pub struct Vcpu {
    pub id: u8,
    pub fd: VcpuFd,
}

/// The time-stamp counter.
pub const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled with write-back as the default type, as PC firmware leaves them: with
/// MTRRs off, every access is uncached.
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MTRR_ENABLE_WB_DEFAULT: u64 = (1 << 11) | 6;
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7;
const APIC_MODE_NMI: u32 = 0x4;

impl Vcpu {
    /// Creates vCPU `id` of `count` with the host's `supported` CPUID, as KVM reports it.
    pub fn new(
        supported: &CpuId,
        vm: &VmFd,
        id: u8,
        count: u8,
        node: Option<Topology>,
    ) -> Result<Self, VcpuError> {
        let err = |what| move |source| VcpuError::Ioctl { id, what, source };
        let fd = vm.create_vcpu(id as u64).map_err(err("KVM_CREATE_VCPU"))?;
        let mut cpuid = supported.clone();
        filter_cpuid(&mut cpuid, id, count);
        if let Some(leaves) = node {
            add_node_leaves(&mut cpuid, leaves).map_err(|_| VcpuError::CpuidFull { id })?;
        }
        fd.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
        let msrs = Msrs::from_entries(&[
            kvm_msr_entry {
                index: MSR_IA32_MISC_ENABLE,
                data: MISC_ENABLE_FAST_STRING,
                ..Default::default()
            },
            kvm_msr_entry {
                index: MSR_MTRR_DEF_TYPE,
                data: MTRR_ENABLE_WB_DEFAULT,
                ..Default::default()
            },
        ])
        .expect("two MSRs fit");
        let set = fd.set_msrs(&msrs).map_err(err("KVM_SET_MSRS"))?;
        if set != msrs.as_slice().len() {
            return Err(VcpuError::MsrRejected {
                id,
                index: msrs.as_slice()[set].index,
            });
        }
        // LINT0 delivers the PIC's ExtINT and LINT1 NMIs, as a PC's firmware leaves them;
        // Linux relies on that for its early timer checks.
        let mut lapic: kvm_lapic_state = fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
        set_lvt_mode(&mut lapic, APIC_LVT0, APIC_MODE_EXTINT);
        set_lvt_mode(&mut lapic, APIC_LVT1, APIC_MODE_NMI);
        fd.set_lapic(&lapic).map_err(err("KVM_SET_LAPIC"))?;
        Ok(Self { id, fd })
    }

    pub fn set_regs(
        &self,
        regs: &kvm_bindings::kvm_regs,
        sregs_fn: impl FnOnce(&mut kvm_bindings::kvm_sregs),
    ) -> Result<(), VcpuError> {
        let id = self.id;
        let err = |what| move |source| VcpuError::Ioctl { id, what, source };
        let mut sregs = self.fd.get_sregs().map_err(err("KVM_GET_SREGS"))?;
        sregs_fn(&mut sregs);
        self.fd.set_sregs(&sregs).map_err(err("KVM_SET_SREGS"))?;
        self.fd.set_regs(regs).map_err(err("KVM_SET_REGS"))?;
        Ok(())
    }

    /// Makes this thread the one the vCPU is kicked on: the kick handler finds its run
    /// structure here. Only the thread that runs the vCPU calls it.
    pub fn bind_to_thread(&mut self) {
        KVM_RUN.with(|r| r.set(self.fd.get_kvm_run()));
    }

    /// Runs the vCPU on the thread bound to it (its filter already installed) until the VM
    /// ends. Exits are dispatched on this thread; anything fatal, a panic included, is
    /// recorded in the VM's control as its outcome.
    pub fn run(mut self, ctx: VcpuContext) {
        let id = self.id;
        let control = ctx.control.clone();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ctx.ram.register_vcpu_thread(id, current_tid());
            #[cfg(feature = "testing")]
            if crate::testing::vcpu_makes_a_refused_call() {
                // SAFETY: socket() only creates a descriptor; the filter refuses it.
                unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
            }
            self.run_loop(&ctx);
        }));
        unbind_thread();
        if let Err(panic) = result {
            control.finish(Outcome::VmmError(format!(
                "vCPU {id} thread panicked: {}",
                panic_message(&*panic)
            )));
        }
    }

    fn run_loop(&mut self, ctx: &VcpuContext) {
        let id = self.id;
        if id == 0 {
            let _ = ctx
                .first_run
                .set((Instant::now(), crate::clock::monotonic_ns()));
        }
        // A VM that starts paused parks each vCPU before it ever runs.
        if ctx.pause.asked() {
            ctx.pause.park_vcpu(ctx.index, self, &ctx.control);
        }
        while !ctx.control.is_finished() {
            if ctx.pause.is_standby(ctx.index) {
                ctx.pause.wait_standby(ctx.index, self, &ctx.control);
                continue;
            }
            let result = self.fd.run();
            if ctx.control.is_finished() {
                // The VM has ended while this vCPU ran: its last exit is not served, so no
                // device acts for a VM whose outcome is already decided (and whose memory
                // may be gone, as when a migration's source is lost).
                break;
            }
            let handled_at = Instant::now();
            let (reason, action) = handle_exit(result, &*ctx.bus, id);
            let end = match action {
                ExitAction::Continue => None,
                ExitAction::Kicked => {
                    self.fd.set_kvm_immediate_exit(0);
                    self.answer(ctx);
                    None
                }
                ExitAction::End(outcome) => Some(outcome),
                ExitAction::Crash(crash) => {
                    let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    Some(crash_outcome(crash, id, rip))
                }
            };
            ctx.metrics
                .record(reason, handled_at.elapsed().as_nanos() as u64);
            if let Some(outcome) = end {
                ctx.control.finish(outcome);
            }
            // Between two exits nothing is half done: a device access has been answered
            // and the next instruction has not run.
            if ctx.pause.asked() {
                self.complete_pending_exit();
                ctx.pause.park_vcpu(ctx.index, self, &ctx.control);
            }
        }
    }

    /// Finishes the instruction behind the last exit without running another: KVM
    /// completes a port or MMIO read only when KVM_RUN is entered again, so until then
    /// the registers a snapshot would read are those of a half-done instruction. With
    /// `immediate_exit` set, KVM_RUN completes it and returns at once.
    fn complete_pending_exit(&mut self) {
        self.fd.set_kvm_immediate_exit(1);
        let _ = self.fd.run();
        self.fd.set_kvm_immediate_exit(0);
    }

    /// Reports what this vCPU was doing, if the VM asked since the last answer.
    fn answer(&self, ctx: &VcpuContext) {
        let request = ctx.request.load(Ordering::Acquire);
        if ctx.status.get(request).is_some() {
            return;
        }
        let state = match self.fd.get_mp_state().map(|s| s.mp_state) {
            Ok(KVM_MP_STATE_HALTED) => match self.fd.get_regs() {
                Ok(r) if r.rflags & RFLAGS_IF == 0 => VcpuState::HaltedForGood { rip: r.rip },
                _ => VcpuState::Idle,
            },
            Ok(KVM_MP_STATE_UNINITIALIZED | KVM_MP_STATE_INIT_RECEIVED) => {
                VcpuState::WaitingForStartup
            }
            _ => VcpuState::Running,
        };
        ctx.status.set(request, state);
    }
}

/// The interrupt-enable flag in RFLAGS.
const RFLAGS_IF: u64 = 1 << 9;

/// Forgets this thread's vCPU run structure, before the vCPU fd that maps it is dropped.
pub fn unbind_thread() {
    KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
}

fn current_tid() -> i32 {
    // The system call rather than libc's `gettid`: in a static musl build linked with LTO
    // that symbol came out unresolved (address 0), and the vCPU thread jumped there.
    // SAFETY: gettid has no preconditions and takes no arguments.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

fn set_lvt_mode(lapic: &mut kvm_lapic_state, reg: usize, mode: u32) {
    let bytes: &mut [u8] =
        // SAFETY: `regs` is a plain byte array of the LAPIC page; reinterpreting i8 as u8 is
        // always valid.
        unsafe { std::slice::from_raw_parts_mut(lapic.regs.as_mut_ptr() as *mut u8, lapic.regs.len()) };
    let mut v = u32::from_le_bytes(bytes[reg..reg + 4].try_into().unwrap());
    v = (v & !0x700) | (mode << 8);
    bytes[reg..reg + 4].copy_from_slice(&v.to_le_bytes());
}

/// The TSC alone, which a pause reads and a resume sets back.
impl Vcpu {
    /// Sets only the TSC: a resumed vCPU goes on from the count it stopped at.
    pub fn set_tsc(&self, tsc: u64) -> Result<(), VcpuError> {
        let id = self.id;
        let msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: MSR_IA32_TSC,
            data: tsc,
            ..Default::default()
        }])
        .expect("one MSR fits");
        match self.fd.set_msrs(&msrs) {
            Ok(1) => Ok(()),
            Ok(_) => Err(VcpuError::MsrRejected {
                id,
                index: MSR_IA32_TSC,
            }),
            Err(source) => Err(VcpuError::Ioctl {
                id,
                what: "KVM_SET_MSRS",
                source,
            }),
        }
    }

    /// Reads the TSC.
    pub fn tsc(&self) -> Result<u64, VcpuError> {
        let id = self.id;
        let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: MSR_IA32_TSC,
            ..Default::default()
        }])
        .expect("one MSR fits");
        match self.fd.get_msrs(&mut msrs) {
            Ok(1) => Ok(msrs.as_slice()[0].data),
            Ok(_) => Err(VcpuError::MsrRejected {
                id,
                index: MSR_IA32_TSC,
            }),
            Err(source) => Err(VcpuError::Ioctl {
                id,
                what: "KVM_GET_MSRS",
                source,
            }),
        }
    }
}
