//! GDT, per-CPU TSS, IDT and the common trap path.

use core::sync::atomic::{AtomicBool, Ordering};

use crate::abi::STATUS_KERNEL_FAULT;
use crate::arch::{cpuid, exit_vm, read_cr2};
use crate::global::Global;
use crate::{apic, console, kprintln, power, smp, timer, ulib, user, virtio};

pub const MAX_CPUS: usize = 32;

// The layout is Linux's (0x10 kernel code, 0x18 kernel data, 0x2b user data, 0x33 user
// code): SYSCALL/SYSRET need user data right below user code, and PVM (the paging-based KVM
// on the development machines) accepts only these user selectors in MSR_STAR.
pub const KCODE32: u64 = 0x08;
pub const KCODE: u64 = 0x10;
pub const KDATA: u64 = 0x18;
pub const UDATA: u64 = 0x28 | 3;
pub const UCODE: u64 = 0x30 | 3;
const TSS_SEL0: u16 = 0x40;

const GDT_LEN: usize = 8 + 2 * MAX_CPUS;
pub const GDT_BYTES: usize = GDT_LEN * 8;

pub const SPURIOUS_VECTOR: u64 = 0xff;
/// Where the legacy PICs are parked (masked) so a stray IRQ cannot look like an exception.
pub const PIC_VECTOR_BASE: u64 = 0xe0;

const fn gdt_init() -> [u64; GDT_LEN] {
    let mut g = [0u64; GDT_LEN];
    g[1] = 0x00cf_9b00_0000_ffff; // 0x08 kernel code, 32-bit (boot stub, AP trampoline)
    g[2] = 0x00af_9b00_0000_ffff; // 0x10 kernel code, 64-bit
    g[3] = 0x00cf_9300_0000_ffff; // 0x18 kernel data
    g[4] = 0x00cf_fb00_0000_ffff; // 0x20 user code, 32-bit (unused; SYSRET layout)
    g[5] = 0x00cf_f300_0000_ffff; // 0x28 user data
    g[6] = 0x00af_fb00_0000_ffff; // 0x30 user code, 64-bit
    g
}

pub static GDT: Global<[u64; GDT_LEN]> = Global::new(gdt_init());

/// All TSSs share one I/O permission bitmap: TSS `i` sits at `i * TSS_STRIDE` and its
/// I/O-map base points at the common, all-zero (all ports allowed) bitmap after them. CPL3
/// tasks then use port I/O directly; IOPL=3 does not survive in PVH-booted guests here.
pub const TSS_STRIDE: usize = 128;
const IOMAP_OFF: usize = MAX_CPUS * TSS_STRIDE;
const TSS_AREA_LEN: usize = IOMAP_OFF + 8192 + 16;

#[repr(C, align(4096))]
pub struct TssArea(pub [u8; TSS_AREA_LEN]);

pub static TSS_AREA: Global<TssArea> = Global::new(TssArea([0; TSS_AREA_LEN]));

/// Stack for #DF, NMI and #MC, so a kernel stack overflow still gets reported.
const IST_SIZE: usize = 16 * 1024;
#[link_section = ".noinit.ist"]
static IST_STACK: Global<crate::boot::Stack<IST_SIZE>> =
    Global::new(crate::boot::Stack([0; IST_SIZE]));

#[repr(C, align(16))]
struct Idt([[u64; 2]; 256]);
static IDT: Global<Idt> = Global::new(Idt([[0; 2]; 256]));

#[repr(C, packed)]
struct DtPtr {
    limit: u16,
    base: u64,
}

#[repr(C)]
pub struct TrapFrame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rbp: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rbx: u64,
    pub rax: u64,
    pub vector: u64,
    pub error: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

extern "C" {
    static trap_vectors: u8;
}

core::arch::global_asm!(
    r#"
    .section .text.traps, "ax"
    .code64
    .p2align 4
    .global trap_vectors
    .global trap_common
trap_vectors:
    .set vec, 0
    .rept 256
    .p2align 4
    .if (vec == 8) || ((vec >= 10) && (vec <= 14)) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    pushq $0
    .endif
    pushq $vec
    jmp trap_common
    .set vec, vec + 1
    .endr

trap_common:
    push %rax
    push %rbx
    push %rcx
    push %rdx
    push %rsi
    push %rdi
    push %rbp
    push %r8
    push %r9
    push %r10
    push %r11
    push %r12
    push %r13
    push %r14
    push %r15
    mov %rsp, %rdi
    cld
    call {dispatch}
    pop %r15
    pop %r14
    pop %r13
    pop %r12
    pop %r11
    pop %r10
    pop %r9
    pop %r8
    pop %rbp
    pop %rdi
    pop %rsi
    pop %rdx
    pop %rcx
    pop %rbx
    pop %rax
    add $16, %rsp
    iretq
    "#,
    dispatch = sym trap_dispatch,
    options(att_syntax)
);

fn tss_addr(cpu: usize) -> u64 {
    TSS_AREA.addr() + (cpu * TSS_STRIDE) as u64
}

/// Fills every CPU's TSS and descriptor and the IDT, then loads them on the BSP.
pub fn init_bsp() {
    let ist_top = IST_STACK.addr() + IST_SIZE as u64;
    // SAFETY: boot-time, single CPU.
    let (area, gdt, idt) = unsafe { (TSS_AREA.get(), GDT.get(), IDT.get()) };
    area.0[IOMAP_OFF + 8192] = 0xff;
    for cpu in 0..MAX_CPUS {
        let t = tss_addr(cpu);
        let iomap = (IOMAP_OFF - cpu * TSS_STRIDE) as u64;
        let tss = &mut area.0[cpu * TSS_STRIDE..];
        tss[0x24..0x2c].copy_from_slice(&ist_top.to_le_bytes()); // IST1
        tss[0x66..0x68].copy_from_slice(&(iomap as u16).to_le_bytes());
        let limit = iomap + 8192;
        gdt[8 + 2 * cpu] = (limit & 0xffff)
            | ((t & 0xff_ffff) << 16)
            | (0x89 << 40)
            | (((limit >> 16) & 0xf) << 48)
            | (((t >> 24) & 0xff) << 56);
        gdt[9 + 2 * cpu] = t >> 32;
    }
    let base = core::ptr::addr_of!(trap_vectors) as u64;
    for (v, e) in idt.0.iter_mut().enumerate() {
        let h = base + v as u64 * 16;
        let kind: u64 = 0x8e;
        let ist: u64 = if matches!(v, 2 | 8 | 18) { 1 } else { 0 };
        e[0] = (h & 0xffff)
            | (KCODE << 16)
            | (ist << 32)
            | (kind << 40)
            | (((h >> 16) & 0xffff) << 48);
        e[1] = h >> 32;
    }
    load(0);
}

/// Loads the IDT and this CPU's TSS (the GDT is already loaded by the boot path).
pub fn load(cpu: usize) {
    let idtr = DtPtr {
        limit: (256 * 16 - 1) as u16,
        base: IDT.addr(),
    };
    let sel = TSS_SEL0 + 16 * cpu as u16;
    // SAFETY: the IDT is a static filled by `init_bsp` before any CPU loads it, and `sel`
    // is this CPU's TSS descriptor, written there too; both live for the whole run.
    unsafe {
        core::arch::asm!("lidt [{}]", in(reg) &idtr, options(nostack));
        core::arch::asm!("ltr {0:x}", in(reg) sel, options(nostack));
    }
}

/// Loads an empty IDT and raises #UD: nothing can be delivered, so the CPU triple-faults.
pub fn triple_fault() -> ! {
    let idtr = DtPtr { limit: 0, base: 0 };
    // SAFETY: ends the VM on purpose (the #UD cannot be delivered); nothing runs after it.
    unsafe {
        core::arch::asm!("lidt [{}]", "ud2", in(reg) &idtr, options(nostack, noreturn));
    }
}

static IN_FAULT: AtomicBool = AtomicBool::new(false);

pub fn exception_name(v: u64) -> &'static str {
    match v {
        0 => "#DE divide error",
        1 => "#DB debug",
        2 => "NMI",
        3 => "#BP breakpoint",
        4 => "#OF overflow",
        5 => "#BR bound range",
        6 => "#UD invalid opcode",
        7 => "#NM device not available",
        8 => "#DF double fault",
        10 => "#TS invalid TSS",
        11 => "#NP segment not present",
        12 => "#SS stack fault",
        13 => "#GP general protection",
        14 => "#PF page fault",
        16 => "#MF x87 error",
        17 => "#AC alignment check",
        18 => "#MC machine check",
        19 => "#XM SIMD error",
        20 => "#VE virtualization",
        21 => "#CP control protection",
        _ => "reserved exception",
    }
}

extern "C" fn trap_dispatch(f: &mut TrapFrame) {
    match f.vector {
        14 if f.cs & 3 == 3 && !smp::on_worker() && crate::mm::user_fault(f.error, read_cr2()) => {}
        6 if f.cs & 3 == 3 && f.rip == ulib::syscall_gate() => {
            f.rip += 2;
            user::syscall(f);
        }
        timer::TIMER_VECTOR => {
            let cpu = smp::current();
            if cpu == 0 {
                timer::tick();
            }
            apic::eoi();
            if f.cs & 3 == 3 {
                user::check_deadline(cpu);
            }
        }
        smp::WAKE_VECTOR => apic::eoi(),
        console::CONSOLE_VECTOR => console::irq(),
        power::POWER_VECTOR => power::irq(),
        v if (virtio::VECTOR_BASE..virtio::VECTOR_BASE + virtio::MAX_DEVS as u64).contains(&v) => {
            virtio::irq((v - virtio::VECTOR_BASE) as usize);
            apic::eoi();
        }
        virtio::NET_VECTOR => {
            virtio::net::irq(crate::abi::DEV_NET as usize);
            apic::eoi();
        }
        virtio::VSOCK_VECTOR => {
            virtio::net::irq(crate::abi::DEV_VSOCK as usize);
            apic::eoi();
        }
        SPURIOUS_VECTOR => {}
        v if (PIC_VECTOR_BASE..PIC_VECTOR_BASE + 16).contains(&v) => {}
        v if v < 32 => exception(f),
        _ => apic::eoi(),
    }
}

fn exception(f: &mut TrapFrame) {
    let cr2 = read_cr2();
    let cpl = f.cs & 3;
    if cpl == 3 {
        report(f, cr2);
        user::fault(f, cr2);
    }
    if IN_FAULT.swap(true, Ordering::SeqCst) {
        exit_vm(STATUS_KERNEL_FAULT);
    }
    report(f, cr2);
    kprintln!(
        "{{\"probe\":\"exception\",\"vector\":{},\"error_code\":{},\"rip\":\"{:#x}\",\"cr2\":\"{:#x}\",\"cpl\":{}}}",
        f.vector,
        f.error,
        f.rip,
        cr2,
        cpl
    );
    exit_vm(STATUS_KERNEL_FAULT);
}

fn report(f: &TrapFrame, cr2: u64) {
    let apic_id = cpuid(1, 0).ebx >> 24;
    kprintln!(
        "\n!! exception {} ({}) on cpu with apic id {} at cpl {}\n!!   error code {:#x}  rip {:#018x}  cr2 {:#018x}\n!!   rsp {:#018x}  rflags {:#x}  rax {:#x}  rdi {:#x}  rsi {:#x}",
        f.vector,
        exception_name(f.vector),
        apic_id,
        f.cs & 3,
        f.error,
        f.rip,
        cr2,
        f.rsp,
        f.rflags,
        f.rax,
        f.rdi,
        f.rsi
    );
}
