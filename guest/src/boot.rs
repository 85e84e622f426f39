//! PVH entry: the ELF note that announces it and the 32-bit stub that gets to 64-bit Rust.
//!
//! PVH starts the BSP in 32-bit protected mode, paging off, EBX = `hvm_start_info`. The
//! stub clears .bss, builds the boot page tables (see paging.rs), enables long mode and calls
//! `kmain(start_info)` on the BSP stack.

use crate::cpu::{GDT, GDT_BYTES};
use crate::global::Global;
use crate::paging::{PDPT, PDS, PML4};

pub const BSP_STACK_SIZE: usize = 64 * 1024;

#[repr(C, align(4096))]
pub struct Stack<const N: usize>(pub [u8; N]);

#[link_section = ".noinit.bspstack"]
pub static BSP_STACK: Global<Stack<BSP_STACK_SIZE>> = Global::new(Stack([0; BSP_STACK_SIZE]));

/// From 32-bit protected mode with the boot tables built to long mode: PAE, CR3 = `{pml4}`,
/// EFER.LME, then paging and write protection (PE is on already). Shared by the BSP's entry
/// and the APs' trampoline, each of which far-jumps to its 64-bit code next.
macro_rules! enter_long_mode {
    () => {
        r#"
    mov %cr4, %eax
    or $0x20, %eax
    mov %eax, %cr4
    mov ${pml4}, %eax
    mov %eax, %cr3
    mov $0xc0000080, %ecx
    rdmsr
    or $0x100, %eax
    wrmsr
    mov %cr0, %eax
    or $0x80010000, %eax
    mov %eax, %cr0
"#
    };
}
pub(crate) use enter_long_mode;

/// The first thing 64-bit code does on every CPU: kernel data selector `{kdata}` in DS, ES
/// and SS, null in FS and GS.
macro_rules! load_data_segments {
    () => {
        r#"
    mov ${kdata}, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
    xor %eax, %eax
    mov %ax, %fs
    mov %ax, %gs
"#
    };
}
pub(crate) use load_data_segments;

core::arch::global_asm!(
    r#"
    .section .note.Xen, "a", @note
    .p2align 2
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .p2align 2
    .long pvh_start

    .section .text.boot, "ax"
    .code32
    .global pvh_start
pvh_start:
    cli
    cld
    mov %ebx, %esi

    mov $__bss_start, %edi
    mov $__bss_end, %ecx
    sub %edi, %ecx
    shr $2, %ecx
    xor %eax, %eax
    rep stosl

    mov ${pml4}, %edi
    mov $1024, %ecx
    rep stosl
    mov ${pdpt}, %edi
    mov $1024, %ecx
    rep stosl

    mov ${pdpt}, %eax
    or $7, %eax
    mov %eax, {pml4}
    mov ${pds}, %eax
    or $7, %eax
    mov ${pdpt}, %edi
    mov %eax, (%edi)
    add $4096, %eax
    mov %eax, 8(%edi)
    add $4096, %eax
    mov %eax, 16(%edi)
    add $4096, %eax
    mov %eax, 24(%edi)

    mov ${pds}, %edi
    xor %ecx, %ecx
1:
    mov %ecx, %eax
    shl $21, %eax
    or $0x87, %eax
    cmp $1536, %ecx
    jb 2f
    and $0xfffffffb, %eax
    or $0x18, %eax
2:
    mov %eax, (%edi,%ecx,8)
    movl $0, 4(%edi,%ecx,8)
    inc %ecx
    cmp $2048, %ecx
    jb 1b
    movl $0x83, (%edi)
"#,
    enter_long_mode!(),
    r#"
    lgdt boot_gdt_ptr
    ljmp ${kcode}, $long_entry

    .p2align 3
boot_gdt_ptr:
    .word {gdt_limit}
    .long {gdt}

    .code64
long_entry:
"#,
    load_data_segments!(),
    r#"
    mov ${stack}, %rsp
    add ${stack_size}, %rsp
    mov %esi, %edi
    call {kmain}
3:
    cli
    hlt
    jmp 3b
    "#,
    pml4 = sym PML4,
    pdpt = sym PDPT,
    pds = sym PDS,
    gdt = sym GDT,
    gdt_limit = const GDT_BYTES - 1,
    stack = sym BSP_STACK,
    stack_size = const BSP_STACK_SIZE,
    kmain = sym crate::kmain,
    kcode = const crate::cpu::KCODE,
    kdata = const crate::cpu::KDATA,
    options(att_syntax)
);
