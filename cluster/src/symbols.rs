//! Names the guest-physical pages of `--metrics`' hottest pages after the kernel ELF's symbols,
//! so a page the nodes keep taking from each other reads as `TICKS` or `MAILBOXES+0x40`
//! instead of a bare address.
//!
//! Only the kernel image is known to the host; pages outside it (the probe's task arena, a
//! Linux guest's heap) get no name.

use object::read::{ReadCache, ReadRef};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
use std::sync::OnceLock;
use vmm::config::KernelImage;

/// The kernel a node runs, read for its symbols when they are first needed (metrics are
/// written at the end, or when asked for), not at start-up.
pub(crate) struct KernelSymbols {
    kernel: KernelImage,
    symbols: OnceLock<Option<GuestSymbols>>,
}

impl KernelSymbols {
    pub(crate) fn new(kernel: KernelImage) -> KernelSymbols {
        KernelSymbols {
            kernel,
            symbols: OnceLock::new(),
        }
    }

    /// `coherence` as `--metrics` gives it, each of its `hot_pages` with what lies there
    /// (`symbol`) when the kernel is an ELF file with symbols that can still be read.
    pub(crate) fn coherence(&self, mut coherence: dsm_host::NodeStats) -> musubi_types::Coherence {
        // Through a cache that copies what it reads: the object crate reads headers in
        // place and refuses them where they are not aligned, as in the image the binary
        // carries; a vmlinux file is read only where its symbols are.
        let symbols = self.symbols.get_or_init(|| match &self.kernel {
            KernelImage::File(p) => {
                GuestSymbols::from_elf(&ReadCache::new(std::fs::File::open(p).ok()?))
            }
            KernelImage::Bytes { data, .. } => {
                GuestSymbols::from_elf(&ReadCache::new(std::io::Cursor::new(&data[..])))
            }
        });
        if let Some(symbols) = symbols {
            for page in &mut coherence.faults.hot_pages {
                page.symbol = symbols.page(page.gpa);
            }
        }
        coherence
    }
}

/// A kernel's symbols by guest-physical address.
pub struct GuestSymbols {
    /// (first byte, size, name), sorted by address.
    symbols: Vec<(u64, u64, String)>,
    /// (first byte, size, name) of the allocated sections, for what no symbol covers.
    sections: Vec<(u64, u64, String)>,
}

impl GuestSymbols {
    /// Reads the symbol table of an ELF kernel; `None` for anything else (a bzImage, an ELF
    /// stripped of its symbols and sections).
    ///
    /// Addresses are moved from the link-time virtual address to where the loader put the
    /// bytes (each segment's physical address), so a higher-half kernel is named too.
    pub fn from_elf<'data, R: ReadRef<'data>>(image: R) -> Option<GuestSymbols> {
        let file = object::File::parse(image).ok()?;
        let segments = loaded_segments(&file);
        let to_gpa = |vaddr: u64| {
            segments
                .iter()
                .find(|&&(v, size, _)| vaddr >= v && vaddr - v < size.max(1))
                .map_or(vaddr, |&(v, _, p)| p + (vaddr - v))
        };
        let mut symbols: Vec<(u64, u64, String)> = file
            .symbols()
            .filter(|s| matches!(s.kind(), SymbolKind::Data | SymbolKind::Text) && s.address() != 0)
            .filter_map(|s| {
                let name = s.name().ok()?;
                Some((to_gpa(s.address()), s.size(), demangle(name)))
            })
            .collect();
        symbols.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut sections: Vec<(u64, u64, String)> = file
            .sections()
            .filter(|s| s.address() != 0 && s.size() != 0)
            .filter_map(|s| Some((to_gpa(s.address()), s.size(), s.name().ok()?.to_string())))
            .collect();
        sections.sort_unstable();
        (!symbols.is_empty() || !sections.is_empty()).then_some(GuestSymbols { symbols, sections })
    }

    /// What lies in the page at `gpa`: the symbols that overlap it (at most three, then how
    /// many more), else the section it is in.
    pub fn page(&self, gpa: u64) -> Option<String> {
        let end = gpa + dsm::PAGE_SIZE as u64;
        let overlapping: Vec<&(u64, u64, String)> = self
            .symbols
            .iter()
            .filter(|(a, size, _)| *a < end && a + (*size).max(1) > gpa)
            .collect();
        if overlapping.is_empty() {
            return self
                .sections
                .iter()
                .find(|(a, size, _)| gpa < a + size && *a < end)
                .map(|(_, _, name)| name.clone());
        }
        let mut names: Vec<String> = overlapping
            .iter()
            .take(3)
            .map(|(a, _, name)| {
                if *a < gpa {
                    format!("{name}+{:#x}", gpa - a)
                } else {
                    name.clone()
                }
            })
            .collect();
        if overlapping.len() > 3 {
            names.push(format!("{} more", overlapping.len() - 3));
        }
        Some(names.join(", "))
    }
}

/// (virtual address, size in memory, physical address) of each loaded segment of a 64-bit
/// ELF; none for anything else, whose addresses are then taken as they are.
fn loaded_segments<'data, R: ReadRef<'data>>(
    file: &object::File<'data, R>,
) -> Vec<(u64, u64, u64)> {
    use object::read::elf::ProgramHeader;
    let endian = object::Endianness::Little;
    match file {
        object::File::Elf64(elf) => elf
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == object::elf::PT_LOAD)
            .map(|ph| (ph.p_vaddr(endian), ph.p_memsz(endian), ph.p_paddr(endian)))
            .collect(),
        _ => Vec::new(),
    }
}

/// A Rust symbol's path without its hash or crate disambiguators, enough to recognise the
/// static (`probe::timer::TICKS`); anything else as it is.
fn demangle(name: &str) -> String {
    rustc_demangle::try_demangle(name)
        .map(|d| format!("{d:#}"))
        .unwrap_or_else(|_| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anything_but_an_elf_has_no_symbols() {
        assert!(GuestSymbols::from_elf(&b"not an ELF image"[..]).is_none());
        assert!(GuestSymbols::from_elf(&[][..]).is_none());
    }

    #[test]
    fn a_page_is_named_by_the_symbols_overlapping_it_and_else_by_its_section() {
        let s = GuestSymbols {
            symbols: vec![
                (0x10_0ff0, 0x20, "a".into()),
                (0x10_1100, 8, "b".into()),
                (0x10_3000, 8, "c".into()),
            ],
            sections: vec![(0x10_0000, 0x4000, ".data".into())],
        };
        assert_eq!(s.page(0x10_0000).as_deref(), Some("a"));
        assert_eq!(s.page(0x10_1000).as_deref(), Some("a+0x10, b"));
        assert_eq!(s.page(0x10_2000).as_deref(), Some(".data"));
        assert_eq!(s.page(0x20_0000), None);
    }
}
