//! Puts a kernel image into guest memory and says how to enter it.

use crate::arch::x86_64::layout::HIGH_MEMORY_START;
use crate::config::KernelImage;
use devices::GuestMemoryMmap;
use linux_loader::bootparam::setup_header;
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::KernelLoader;
use std::io::{Cursor, Read, Seek, SeekFrom};
use vm_memory::{GuestAddress, GuestMemoryBackend};

/// How the BSP enters the loaded kernel.
#[derive(Clone, Copy, Debug)]
pub enum EntryPoint {
    /// 32-bit protected mode with EBX = `hvm_start_info`.
    Pvh(u64),
    /// 64-bit Linux boot protocol with RSI = `boot_params`.
    Linux64 {
        entry: u64,
        header: Option<setup_header>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("kernel {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("kernel {0}: not a kernel image: expected an x86-64 ELF (vmlinux, the probe guest) or a bzImage")]
    NotAKernel(String),
    #[error("kernel {path}: {what} image rejected: {source}")]
    Load {
        path: String,
        what: &'static str,
        source: linux_loader::loader::Error,
    },
    #[error("kernel {path}: {what} {addr:#x} is outside guest RAM; give the VM more --memory")]
    OutsideRam {
        path: String,
        what: &'static str,
        addr: u64,
    },
}

/// What `bytes` at the start of a file look like.
fn sniff(head: &[u8]) -> Option<&'static str> {
    if head.len() >= 4 && &head[..4] == b"\x7fELF" {
        Some("ELF")
    } else if head.len() >= 0x206 && &head[0x202..0x206] == b"HdrS" {
        Some("bzImage")
    } else {
        None
    }
}

/// Loads `kernel` at 1 MiB and returns its entry point and the end of the loaded image.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    kernel: &KernelImage,
) -> Result<(EntryPoint, u64), LoadError> {
    let path = kernel.name();
    match kernel {
        KernelImage::File(p) => {
            let mut f = std::fs::File::open(p).map_err(|source| LoadError::Open {
                path: path.clone(),
                source,
            })?;
            load_image(mem, path, &mut f)
        }
        KernelImage::Bytes { data, .. } => {
            let loaded = load_image(mem, path, &mut Cursor::new(&data[..]));
            if let std::borrow::Cow::Borrowed(image) = data {
                release_pages(image);
            }
            loaded
        }
    }
}

/// Asks the kernel to reclaim the pages of an image this process holds once it is in guest
/// memory: for an image the binary carries they are clean pages of its file, which a later
/// boot reads in again, and until then they are not part of this process's memory, as a
/// kernel read from a file would not be. `MADV_PAGEOUT` keeps the contents whatever the
/// memory is (an image read onto the heap stays as it was, swap or no swap), so nothing
/// is assumed about where the slice lives.
fn release_pages(image: &[u8]) {
    let page = 4096usize;
    let start = (image.as_ptr() as usize).next_multiple_of(page);
    let end = (image.as_ptr() as usize + image.len()) & !(page - 1);
    if end <= start {
        return;
    }
    // SAFETY: [start, end) lies inside `image`, memory this process maps; MADV_PAGEOUT only
    // moves pages out (to their file, or to swap) and never changes what they hold.
    let r = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_PAGEOUT) };
    if r != 0 {
        tracing::debug!(
            "reclaiming the kernel image's pages: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn load_image<F: Read + Seek + vm_memory::ReadVolatile>(
    mem: &GuestMemoryMmap,
    path: String,
    image: &mut F,
) -> Result<(EntryPoint, u64), LoadError> {
    let mut head = vec![0u8; 0x400];
    let n = read_up_to(image, &mut head).map_err(|source| LoadError::Open {
        path: path.clone(),
        source,
    })?;
    head.truncate(n);
    image
        .seek(SeekFrom::Start(0))
        .map_err(|source| LoadError::Open {
            path: path.clone(),
            source,
        })?;
    let high = Some(GuestAddress(HIGH_MEMORY_START));
    let (entry, end) = match sniff(&head) {
        Some("ELF") => {
            let r = Elf::load(mem, None, image, high).map_err(|source| LoadError::Load {
                path: path.clone(),
                what: "ELF",
                source,
            })?;
            let entry = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(a) => EntryPoint::Pvh(a.0),
                _ => EntryPoint::Linux64 {
                    entry: r.kernel_load.0,
                    header: None,
                },
            };
            Ok((entry, r.kernel_end))
        }
        Some(_) => {
            let r = BzImage::load(mem, None, image, high).map_err(|source| LoadError::Load {
                path: path.clone(),
                what: "bzImage",
                source,
            })?;
            // The 64-bit entry of a bzImage's protected-mode code is 0x200 past its start.
            Ok((
                EntryPoint::Linux64 {
                    entry: r.kernel_load.0 + 0x200,
                    header: r.setup_header,
                },
                r.kernel_end,
            ))
        }
        None => Err(LoadError::NotAKernel(path.clone())),
    }?;
    // linux-loader copies only a segment's file bytes and trusts its memory size and the
    // entry address, so an ELF can claim a BSS far past guest RAM (the initrd is placed above
    // the end) or start where there is no memory (the guest would crash on its first
    // instruction): both are refused here, with a fix the user can apply.
    let entry_addr = match entry {
        EntryPoint::Pvh(a) => a,
        EntryPoint::Linux64 { entry, .. } => entry,
    };
    let last = end.checked_sub(1);
    for (what, addr) in [
        ("the image's last byte", last),
        ("the entry point", Some(entry_addr)),
    ] {
        if let Some(addr) = addr.filter(|a| !mem.address_in_range(GuestAddress(*a))) {
            return Err(LoadError::OutsideRam { path, what, addr });
        }
    }
    Ok((entry, end))
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap()
    }

    #[test]
    fn text_is_not_a_kernel() {
        let k = KernelImage::Bytes {
            name: "notes.txt".into(),
            data: b"hello, this is not a kernel\n"[..].into(),
        };
        let e = load_kernel(&mem(), &k).unwrap_err().to_string();
        assert!(
            e.contains("notes.txt") && e.contains("not a kernel image"),
            "{e}"
        );
    }

    #[test]
    fn missing_file_is_named() {
        let k = KernelImage::File("/nonexistent/vmlinux".into());
        let e = load_kernel(&mem(), &k).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/vmlinux"), "{e}");
    }

    /// The error for loading `image` under `name`; it must fail.
    fn refusal(name: &str, image: Vec<u8>) -> String {
        let k = KernelImage::Bytes {
            name: name.into(),
            data: image.into(),
        };
        load_kernel(&mem(), &k).unwrap_err().to_string()
    }

    /// Found by the kernel_image fuzzing entry point: a PT_LOAD whose memory size runs
    /// 512 MiB past its file bytes loaded "successfully" and reported an end far outside
    /// guest RAM, where the builder then looked for room for the initrd.
    #[test]
    fn elf_whose_memory_size_runs_past_guest_ram_is_refused() {
        let mut elf = crate::testing::pvh_elf(&[0xf4]);
        // p_memsz of the first program header (at 64 + 40).
        elf[104..112].copy_from_slice(&0x2000_0007u64.to_le_bytes());
        let e = refusal("bss.elf", elf);
        assert!(
            e.contains("bss.elf") && e.contains("outside guest RAM") && e.contains("--memory"),
            "{e}"
        );
    }

    /// Found by the kernel_image fuzz target: an ELF whose entry lies past guest RAM (a real
    /// vmlinux's 16 MiB entry in a small VM) started a guest that crashed at once.
    #[test]
    fn elf_entered_outside_guest_ram_is_refused() {
        let mut elf = crate::testing::pvh_elf(&[0xf4]);
        // Drop the PVH note (program header 1 becomes PT_NULL) and point e_entry at 64 MiB.
        elf[120..124].copy_from_slice(&0u32.to_le_bytes());
        elf[24..32].copy_from_slice(&0x400_0000u64.to_le_bytes());
        let e = refusal("far.elf", elf);
        assert!(
            e.contains("far.elf") && e.contains("entry point 0x4000000 is outside guest RAM"),
            "{e}"
        );
    }

    /// An image held on the heap (as a program that read the probe from a file holds it)
    /// loads the same every time: what the loader gives back after a load keeps its bytes.
    #[test]
    fn a_borrowed_image_on_the_heap_loads_the_same_again() {
        let mut elf = crate::testing::pvh_elf(&[0x90; 3 * 4096]);
        elf.resize(elf.len() + 8192, 0);
        let image: &'static [u8] = Box::leak(elf.clone().into_boxed_slice());
        let k = KernelImage::Bytes {
            name: "heap.elf".into(),
            data: std::borrow::Cow::Borrowed(image),
        };
        for round in 0..2 {
            let m = mem();
            load_kernel(&m, &k).unwrap();
            let mut code = [0u8; 64];
            vm_memory::Bytes::read_slice(&m, &mut code, GuestAddress(0x10_0000 + 4096)).unwrap();
            assert_eq!(code, [0x90; 64], "load {round}");
        }
        assert_eq!(image, &elf[..], "the image itself changed");
    }

    #[test]
    fn truncated_elf_is_rejected_not_panicking() {
        let k = KernelImage::Bytes {
            name: "short.elf".into(),
            data: b"\x7fELF\x02\x01\x01"[..].into(),
        };
        let e = load_kernel(&mem(), &k).unwrap_err().to_string();
        assert!(e.contains("short.elf"), "{e}");
    }
}
