//! One vCPU: its KVM set-up and the thread that runs it, turning exits into bus accesses.

use crate::arch::x86_64::cpuid::filter_cpuid;
use crate::control::{Outcome, RunControl};
use crate::device_manager::MmioNames;
use crate::metrics::{ExitReason, VcpuMetrics};
use kvm_bindings::{kvm_lapic_state, kvm_msr_entry, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vm_device::bus::{MmioAddress, PioAddress};
use vm_device::device_manager::{IoManager, MmioManager, PioManager};

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {id}: {what} failed: {source}")]
    Ioctl {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: KVM refused to set MSR {index:#x}")]
    MsrRejected { id: u8, index: u32 },
}

/// Signal used to kick a vCPU thread out of KVM_RUN.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

/// Installs a do-nothing handler for the kick signal, so it interrupts KVM_RUN with EINTR
/// instead of killing the process.
pub fn install_kick_handler() -> std::io::Result<()> {
    extern "C" fn noop(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
    vmm_sys_util::signal::register_signal_handler(kick_signal(), noop)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

pub struct Vcpu {
    pub id: u8,
    pub fd: VcpuFd,
}

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
    pub fn new(kvm: &Kvm, vm: &VmFd, id: u8, count: u8) -> Result<Self, VcpuError> {
        let err = |what| move |source| VcpuError::Ioctl { id, what, source };
        let fd = vm.create_vcpu(id as u64).map_err(err("KVM_CREATE_VCPU"))?;
        let mut cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(err("KVM_GET_SUPPORTED_CPUID"))?;
        filter_cpuid(&mut cpuid, id, count);
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

    /// Runs the vCPU until the VM is told to stop. Exits are dispatched to `io` on this
    /// thread; anything fatal is recorded in `control`.
    pub fn run(
        mut self,
        io: Arc<IoManager>,
        control: Arc<RunControl>,
        stop: Arc<AtomicBool>,
        metrics: Arc<VcpuMetrics>,
        names: Arc<MmioNames>,
    ) {
        let id = self.id;
        while !stop.load(Ordering::Acquire) {
            let result = self.fd.run();
            let handled_at = Instant::now();
            let kind = match result {
                Ok(exit) => match exit {
                    VcpuExit::IoOut(port, data) => {
                        // Writes nobody claims are dropped, as on a PC bus.
                        let _ = io.pio_write(PioAddress(port), data);
                        ExitReason::IoOut(port)
                    }
                    VcpuExit::IoIn(port, data) => {
                        if io.pio_read(PioAddress(port), data).is_err() {
                            data.fill(0xff);
                        }
                        ExitReason::IoIn(port)
                    }
                    VcpuExit::MmioWrite(addr, data) => {
                        let _ = io.mmio_write(MmioAddress(addr), data);
                        ExitReason::MmioWrite(names.name(addr))
                    }
                    VcpuExit::MmioRead(addr, data) => {
                        if io.mmio_read(MmioAddress(addr), data).is_err() {
                            data.fill(0xff);
                        }
                        ExitReason::MmioRead(names.name(addr))
                    }
                    VcpuExit::Hlt => {
                        // With the in-kernel LAPIC, HLT reaches user space only if the guest
                        // halted with interrupts off: it can never wake again.
                        control.finish(Outcome::GuestCrash(format!(
                            "vCPU {id} halted with interrupts disabled"
                        )));
                        ExitReason::Hlt
                    }
                    VcpuExit::Shutdown => {
                        let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                        control.finish(Outcome::GuestCrash(format!(
                            "vCPU {id}: triple fault (the guest hit an exception it could not handle), last RIP {rip:#x}"
                        )));
                        ExitReason::Shutdown
                    }
                    VcpuExit::SystemEvent(kind, _) => {
                        // Shutdown (1), reset (2) or crash (3) requested through KVM.
                        if kind == kvm_bindings::KVM_SYSTEM_EVENT_CRASH {
                            control.finish(Outcome::GuestCrash(format!(
                                "vCPU {id}: guest reported a crash"
                            )));
                        } else {
                            control.finish(Outcome::Shutdown);
                        }
                        ExitReason::SystemEvent
                    }
                    VcpuExit::Intr => ExitReason::Interrupted,
                    VcpuExit::FailEntry(reason, cpu) => {
                        control.finish(Outcome::VmmError(format!(
                            "vCPU {id}: KVM could not enter the guest (hardware reason {reason:#x}, host CPU {cpu})"
                        )));
                        ExitReason::FailEntry
                    }
                    VcpuExit::InternalError => {
                        let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                        control.finish(Outcome::GuestCrash(format!(
                            "vCPU {id}: KVM internal error at RIP {rip:#x} (often an instruction KVM cannot emulate)"
                        )));
                        ExitReason::InternalError
                    }
                    other => {
                        control.finish(Outcome::VmmError(format!(
                            "vCPU {id}: unexpected exit {other:?}"
                        )));
                        ExitReason::Other
                    }
                },
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    ExitReason::Interrupted
                }
                Err(e) => {
                    control.finish(Outcome::VmmError(format!("vCPU {id}: KVM_RUN failed: {e}")));
                    ExitReason::Other
                }
            };
            metrics.record(kind, handled_at.elapsed().as_nanos() as u64);
            if control.is_finished() {
                break;
            }
        }
    }
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
