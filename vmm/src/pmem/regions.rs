//! The mapped regions of one VM: each file mapped `MAP_SHARED`, placed, given its KVM memory
//! slot, listed in the E820 map or as a virtio-pmem device, and `msync`ed at the end.

use super::file::open_file;
use super::guard::ReadonlyGuard;
#[cfg(test)]
use super::place;
use super::{file_err, Advertise, PmemConfig, PmemError};
use crate::arch::x86_64::layout::{MAX_IRQ, VIRTIO_IRQ_BASE};
use crate::config::DiskConfig;
use crate::device_manager::ExtraDevices;
use crate::vstate::vm::KvmVm;
use devices::virtio::Pmem as VirtioPmem;
use devices::MmapRegion;
use devices::{GuestMemoryMmap, GuestRegionMmap};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryRegion};

/// boot_params holds 128 E820 entries; RAM takes at most 4 of them.
const MAX_E820_PMEM: usize = 128 - 4;

/// Checks that KVM has a memory slot for every region beside the ones RAM uses.
pub fn check_slots(in_use: usize, regions: usize, available: usize) -> Result<(), PmemError> {
    if in_use + regions > available {
        return Err(PmemError::Layout(format!(
            "{regions} regions need {regions} KVM memory slots besides the {in_use} guest RAM \
             uses, but this host's KVM offers {available} in all (KVM_CAP_NR_MEMSLOTS)"
        )));
    }
    Ok(())
}

/// One placed and mapped region. A clone shares the mapping (a snapshot syncs it from the
/// API thread while the VM holds it).
#[derive(Clone)]
pub struct PmemRegion {
    pub index: usize,
    pub config: PmemConfig,
    pub guest_addr: u64,
    pub size: u64,
    /// Its KVM memory slot, once registered (for dirty logging while replicated).
    pub slot: Option<u32>,
    /// The host mapping. vm-memory's `MmapRegion` (rather than a bare `libc::mmap`) because a
    /// writable region joins the guest memory that devices DMA into, with the same bounds
    /// checks as RAM, and the mapping is unmapped when the last user drops it.
    mapping: Arc<GuestRegionMmap>,
}

impl PmemRegion {
    /// `msync(MS_SYNC)` of the whole mapping: every page the guest dirtied reaches the file.
    pub fn sync(&self) -> std::io::Result<()> {
        sync_mapping(&self.mapping)
    }

    pub fn host_addr(&self) -> *mut u8 {
        self.mapping.as_ptr()
    }

    /// The mapping, whose bitmap records the VMM's own writes (device DMA into the region).
    pub(crate) fn mapping(&self) -> &GuestRegionMmap {
        &self.mapping
    }

    /// Length and CRC-32 of the region's whole file as it is now (the page cache holds the
    /// guest's stores), read through the descriptor the mapping was made from.
    pub fn checksum(&self) -> std::io::Result<devices::virtio::FileSum> {
        let file = self
            .mapping
            .file_offset()
            .map(|f| f.file())
            .ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "the mapping has no file")
            })?;
        devices::virtio::FileSum::of(file)
    }
}

fn sync_mapping(m: &GuestRegionMmap) -> std::io::Result<()> {
    // SAFETY: the range is exactly one live mapping owned by `m`.
    let r = unsafe {
        libc::msync(
            m.as_ptr() as *mut libc::c_void,
            m.len() as usize,
            libc::MS_SYNC,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Every `--pmem` region of a VM.
#[derive(Default)]
pub struct PmemRegions {
    pub regions: Vec<PmemRegion>,
    /// Guest writes to read-only regions, dropped and counted.
    pub readonly_writes: Arc<AtomicU64>,
}

/// The regions' files, open and checked, before the guest layout says where they go.
pub struct PmemFiles {
    opened: Vec<(PmemConfig, std::fs::File, u64)>,
}

impl PmemFiles {
    /// (size, announced in the E820 map) of each region, in order, for the guest layout.
    pub fn spans(&self) -> Vec<(u64, bool)> {
        self.opened
            .iter()
            .map(|(c, _, size)| (*size, c.advertise == Advertise::E820))
            .collect()
    }

    /// How many regions become virtio-pmem devices.
    pub fn virtio_devices(&self) -> usize {
        self.opened
            .iter()
            .filter(|(c, _, _)| c.advertise == Advertise::Virtio)
            .count()
    }

    /// Maps each region at the guest-physical address the layout gave it (`addrs`, in the
    /// regions' order).
    pub fn map(self, addrs: &[u64]) -> Result<PmemRegions, PmemError> {
        let mut regions = Vec::new();
        for (index, ((config, file, size), &addr)) in self.opened.into_iter().zip(addrs).enumerate()
        {
            let prot = if config.readonly {
                libc::PROT_READ
            } else {
                libc::PROT_READ | libc::PROT_WRITE
            };
            let len = usize::try_from(size)
                .map_err(|_| file_err(&config.file, "too large for this host"))?;
            let region = MmapRegion::build(
                Some(FileOffset::new(file, 0)),
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
            )
            .map_err(|e| file_err(&config.file, format!("mmap: {e}")))?;
            let mapping = GuestRegionMmap::new(region, GuestAddress(addr))
                .ok_or_else(|| file_err(&config.file, "region wraps the address space"))?;
            regions.push(PmemRegion {
                index,
                config,
                guest_addr: addr,
                size,
                slot: None,
                mapping: Arc::new(mapping),
            });
        }
        Ok(PmemRegions {
            regions,
            readonly_writes: Arc::default(),
        })
    }
}

impl PmemRegions {
    /// Opens and checks every region's file. Nothing touches KVM yet, so bad input is
    /// reported before a VM exists. `disks` are checked so one file is not both a disk and
    /// a region.
    pub fn open_files(
        configs: &[PmemConfig],
        disks: &[DiskConfig],
    ) -> Result<PmemFiles, PmemError> {
        let e820_count = configs
            .iter()
            .filter(|c| c.advertise == Advertise::E820)
            .count();
        if e820_count > MAX_E820_PMEM {
            return Err(PmemError::Layout(format!(
                "{e820_count} regions advertised by E820, but the firmware map holds at most \
                 {MAX_E820_PMEM} besides RAM; use advertise=virtio for some"
            )));
        }
        let virtio_count = configs
            .iter()
            .filter(|c| c.advertise == Advertise::Virtio)
            .count();
        let irqs_left = (MAX_IRQ + 1 - VIRTIO_IRQ_BASE) as usize;
        if disks.len() + virtio_count > irqs_left {
            return Err(PmemError::Layout(format!(
                "{virtio_count} virtio-pmem devices and {} disks need {} interrupt lines; the \
                 IOAPIC has {irqs_left} for virtio devices",
                disks.len(),
                disks.len() + virtio_count
            )));
        }

        // Identity of every file by (device, inode): one file mapped twice, or mapped and
        // also driven as a disk, is two views of the same storage that neither side knows of.
        let mut seen: Vec<((u64, u64), String)> = Vec::new();
        for d in disks {
            if let Ok(m) = std::fs::metadata(&d.path) {
                seen.push((
                    (m.dev(), m.ino()),
                    format!("--disk path={}", d.path.display()),
                ));
            }
        }
        let mut opened = Vec::new();
        for c in configs {
            let (file, size) = open_file(c)?;
            let meta = file
                .metadata()
                .map_err(|e| file_err(&c.file, format!("stat: {e}")))?;
            let id = (meta.dev(), meta.ino());
            if let Some((_, other)) = seen.iter().find(|(k, _)| *k == id) {
                return Err(file_err(
                    &c.file,
                    format!(
                        "the same file is already used by {other}; the guest would see one \
                         storage as two and corrupt it"
                    ),
                ));
            }
            seen.push((id, format!("--pmem file={}", c.file.display())));
            opened.push((c.clone(), file, size));
        }

        Ok(PmemFiles { opened })
    }

    /// Opens, places and maps every region in one step, as the builder does through the
    /// guest layout.
    #[cfg(test)]
    pub fn open(
        configs: &[PmemConfig],
        ram_size: u64,
        disks: &[DiskConfig],
        phys_bits: u8,
    ) -> Result<PmemRegions, PmemError> {
        let files = Self::open_files(configs, disks)?;
        let sizes: Vec<u64> = files.spans().iter().map(|s| s.0).collect();
        let addrs = place(ram_size, &sizes, phys_bits).map_err(Box::new)?;
        files.map(&addrs)
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Gives every region its KVM memory slot; read-only regions get `KVM_MEM_READONLY`, so
    /// a guest store becomes an MMIO exit instead of reaching the file.
    pub fn register(&mut self, vm: &mut KvmVm) -> Result<(), PmemError> {
        if self.regions.is_empty() {
            return Ok(());
        }
        check_slots(
            vm.slots_in_use(),
            self.regions.len(),
            vm.kvm().get_nr_memslots(),
        )?;
        if self.regions.iter().any(|r| r.config.readonly)
            && !vm.kvm().check_extension(kvm_ioctls::Cap::ReadonlyMem)
        {
            return Err(PmemError::Layout(
                "readonly=on needs read-only memory slots (KVM_CAP_READONLY_MEM), which this \
                 host's KVM lacks"
                    .into(),
            ));
        }
        for r in &mut self.regions {
            // SAFETY: the mapping is kept alive by `self`, which the builder drops only after
            // the VM fd; KVM re-checks the range against the process's mappings anyway.
            let slot = unsafe {
                vm.add_memory_slot(
                    r.guest_addr,
                    r.size,
                    r.host_addr() as u64,
                    r.config.readonly,
                )
            }
            .map_err(|e| file_err(&r.config.file, e.to_string()))?;
            r.slot = Some(slot);
        }
        Ok(())
    }

    /// Guest memory as devices see it: RAM plus the writable regions, so a driver may point
    /// a DMA buffer into persistent memory as on real hardware. Read-only regions stay out:
    /// a device "writing" there would fault in the VMM itself.
    pub fn extend_guest_memory(&self, mem: GuestMemoryMmap) -> Result<GuestMemoryMmap, PmemError> {
        let mut mem = mem;
        for r in self.regions.iter().filter(|r| !r.config.readonly) {
            mem = mem
                .insert_region(r.mapping.clone())
                .map_err(|e| file_err(&r.config.file, format!("joining guest memory: {e:?}")))?;
        }
        Ok(mem)
    }

    /// The devices the regions need: a virtio-pmem device for each `advertise=virtio` region
    /// (placed after the disks), and a write logger over every read-only region.
    pub fn devices(&self) -> ExtraDevices {
        let mut extra = ExtraDevices::default();
        for r in &self.regions {
            if r.config.readonly {
                extra.mmio.push((
                    r.guest_addr,
                    r.size,
                    format!("pmem{}:readonly", r.index),
                    Arc::new(ReadonlyGuard {
                        file: r.config.file.clone(),
                        mapping: r.mapping.clone(),
                        writes: self.readonly_writes.clone(),
                    }),
                ));
            }
            if r.config.advertise == Advertise::Virtio {
                let mapping = r.mapping.clone();
                let readonly = r.config.readonly;
                let flush = move || {
                    if readonly {
                        Ok(())
                    } else {
                        sync_mapping(&mapping)
                    }
                };
                extra.virtio.push((
                    format!("virtio-pmem{}", r.index),
                    Box::new(VirtioPmem::new(r.guest_addr, r.size, Box::new(flush))),
                ));
            }
        }
        extra
    }

    /// Makes every writable region durable; one message per region that failed.
    pub fn sync(&self) -> Vec<SyncError> {
        sync_regions(&self.regions)
    }
}

/// A region whose writes may not be in its file.
#[derive(Debug, thiserror::Error)]
#[error("--pmem file={}: msync failed: {source}", file.display())]
pub struct SyncError {
    pub file: std::path::PathBuf,
    pub source: std::io::Error,
}

/// Makes every writable region of `regions` durable; one error per region that failed.
pub fn sync_regions(regions: &[PmemRegion]) -> Vec<SyncError> {
    {
        regions
            .iter()
            .filter(|r| !r.config.readonly)
            .filter_map(|r| {
                r.sync().err().map(|source| SyncError {
                    file: r.config.file.clone(),
                    source,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::e820_map;
    use crate::arch::x86_64::layout::{E820Entry, E820Kind, GuestLayout};
    use crate::pmem::test_files::{cfg, file_of};
    use std::io::Write;

    const MIB: u64 = 1 << 20;

    #[test]
    fn too_many_regions_for_the_slots() {
        let e = check_slots(1, 32, 32).unwrap_err().to_string();
        assert!(e.contains("--pmem") && e.contains("offers 32"), "{e}");
        check_slots(1, 31, 32).unwrap();
    }

    #[test]
    fn one_file_is_one_region_and_not_also_a_disk() {
        let f = file_of(4 * MIB);
        let open_err = |configs: &[PmemConfig], disks: &[DiskConfig]| match PmemRegions::open(
            configs,
            32 * MIB,
            disks,
            46,
        ) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        };
        let e = open_err(&[cfg(f.path()), cfg(f.path())], &[]);
        assert!(e.contains("already used by --pmem"), "{e}");
        let disk = DiskConfig {
            path: f.path().to_path_buf(),
            readonly: false,
            cache: Default::default(),
        };
        let e = open_err(&[cfg(f.path())], &[disk]);
        assert!(e.contains("already used by --disk"), "{e}");
    }

    #[test]
    fn a_file_longer_than_size_shows_its_prefix() {
        let f = file_of(8 * MIB);
        let mut c = cfg(f.path());
        c.size = Some(2 * MIB);
        let p = PmemRegions::open(&[c], 32 * MIB, &[], 46).unwrap();
        assert_eq!(p.regions[0].size, 2 * MIB);
        assert_eq!(
            f.as_file().metadata().unwrap().len(),
            8 * MIB,
            "file untouched"
        );
    }

    #[test]
    fn e820_lists_only_e820_regions_as_type_12() {
        let a = file_of(2 * MIB);
        let b = file_of(4 * MIB);
        let c = file_of(2 * MIB);
        let mut vb = cfg(b.path());
        vb.advertise = Advertise::Virtio;
        let mut rc = cfg(c.path());
        rc.readonly = true;
        let files = PmemRegions::open_files(&[cfg(a.path()), vb, rc], &[]).unwrap();
        let layout =
            GuestLayout::new(64 * MIB, 1, &files.spans(), files.virtio_devices(), 46).unwrap();
        let addrs: Vec<u64> = layout.pmem.iter().map(|r| r.addr).collect();
        assert_eq!(addrs, vec![64 * MIB, 66 * MIB, 70 * MIB]);
        let e: Vec<E820Entry> = layout
            .e820()
            .into_iter()
            .filter(|e| e.kind == E820Kind::Pmem)
            .collect();
        assert_eq!(
            e,
            vec![
                E820Entry {
                    addr: 64 * MIB,
                    size: 2 * MIB,
                    kind: E820Kind::Pmem
                },
                E820Entry {
                    addr: 70 * MIB,
                    size: 2 * MIB,
                    kind: E820Kind::Pmem
                },
            ]
        );
        // The whole map stays sorted and RAM keeps its size.
        let mut map = e820_map(64 * MIB);
        let ram_before: u64 = map
            .iter()
            .filter(|e| e.kind == E820Kind::Ram)
            .map(|e| e.size)
            .sum();
        map.extend(e);
        assert!(map.windows(2).all(|w| w[0].addr + w[0].size <= w[1].addr));
        let ram_after: u64 = map
            .iter()
            .filter(|e| e.kind == E820Kind::Ram)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram_before, ram_after);
    }

    #[test]
    fn pvh_and_boot_params_carry_the_same_pmem_entries() {
        use crate::arch::x86_64::layout::{CMDLINE_START, PVH_MEMMAP_START, ZERO_PAGE_START};
        use linux_loader::loader::bootparam::boot_params;
        use linux_loader::loader::elf::start_info::hvm_memmap_table_entry;
        use vm_memory::Bytes;
        let a = file_of(4 * MIB);
        let files = PmemRegions::open_files(&[cfg(a.path())], &[]).unwrap();
        let map = GuestLayout::new(32 * MIB, 1, &files.spans(), 0, 46)
            .unwrap()
            .e820();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        crate::arch::x86_64::pvh::write_start_info(&mem, &map, CMDLINE_START, None).unwrap();
        let last: hvm_memmap_table_entry = mem
            .read_obj(GuestAddress(
                PVH_MEMMAP_START
                    + (map.len() as u64 - 1) * std::mem::size_of::<hvm_memmap_table_entry>() as u64,
            ))
            .unwrap();
        assert_eq!((last.addr, last.size, last.type_), (32 * MIB, 4 * MIB, 12));
        crate::arch::x86_64::linux::write_boot_params(&mem, None, &map, CMDLINE_START, 1, None)
            .unwrap();
        let bp: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let e = bp.e820_table[map.len() - 1];
        assert_eq!(
            ({ e.addr }, { e.size }, { e.r#type }),
            (32 * MIB, 4 * MIB, 12)
        );
    }

    #[test]
    fn mapping_is_shared_with_the_file_and_sync_succeeds() {
        let mut f = file_of(2 * MIB);
        f.as_file_mut().write_all(b"host").unwrap();
        let p = PmemRegions::open(&[cfg(f.path())], 32 * MIB, &[], 46).unwrap();
        let r = &p.regions[0];
        // SAFETY: the region is 2 MiB of live writable mapping.
        let s = unsafe { std::slice::from_raw_parts_mut(r.host_addr(), 8) };
        assert_eq!(&s[..4], b"host");
        s[4..8].copy_from_slice(b"gst!");
        assert!(p.sync().is_empty());
        let back = std::fs::read(f.path()).unwrap();
        assert_eq!(&back[..8], b"hostgst!");
        // Writable regions join guest memory; read-only ones do not.
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let mem = p.extend_guest_memory(mem).unwrap();
        use vm_memory::{Bytes, GuestMemoryBackend};
        assert_eq!(mem.num_regions(), 2);
        let mut buf = [0u8; 8];
        mem.read_slice(&mut buf, GuestAddress(32 * MIB)).unwrap();
        assert_eq!(&buf, b"hostgst!");
    }

    #[test]
    fn readonly_regions_open_read_only_and_stay_out_of_device_memory() {
        let f = file_of(2 * MIB);
        let mut perms = f.as_file().metadata().unwrap().permissions();
        use std::os::unix::fs::PermissionsExt;
        perms.set_mode(0o444);
        std::fs::set_permissions(f.path(), perms).unwrap();
        let mut c = cfg(f.path());
        c.readonly = true;
        let p = PmemRegions::open(&[c], 32 * MIB, &[], 46).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        use vm_memory::GuestMemoryBackend;
        assert_eq!(p.extend_guest_memory(mem).unwrap().num_regions(), 1);
        assert!(p.sync().is_empty());
    }
}
