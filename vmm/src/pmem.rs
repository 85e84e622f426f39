//! Storage as memory: file-backed guest-physical regions (VMMS, paper 000).
//!
//! Each `--pmem` file is mapped `MAP_SHARED` into this process and registered as its own KVM
//! memory slot above guest RAM. Guest loads and stores then hit the host page cache pages of
//! the file directly: no device model runs, and a store is in the file's page cache the
//! moment the guest makes it, so it survives even a SIGKILL of the VMM. `msync` at flush and
//! at exit pushes it on to the disk.
//!
//! Placement and the region list live here and nowhere else: the E820 / PVH memory map
//! entries, the virtio-pmem configuration and the KVM slots are all derived from
//! [`PmemRegions`], so they cannot disagree.
//!
//! Sizes: a region must be a whole number of 2 MiB. Linux maps persistent memory with
//! `struct page`s in 2 MiB subsections (DAX needs them), and a region that ends mid-section is
//! refused by the guest. Padding is not offered: it would mean either growing the user's file
//! behind their back or mapping past its end, where any access is a SIGBUS. A file longer
//! than `size=` is allowed: the guest sees its first `size` bytes and the rest is untouched.

use crate::arch::x86_64::layout::{
    ram_ranges, E820Entry, E820Kind, MAX_IRQ, MMIO_HOLE_END, MMIO_HOLE_START, VIRTIO_IRQ_BASE,
};
use crate::config::{parse_size, DiskConfig};
use crate::device_manager::ExtraDevices;
use crate::vstate::vm::Vm;
use devices::virtio::Pmem as VirtioPmem;
use serde::Deserialize;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tracing::{info, warn};
use vm_device::bus::{MmioAddress, MmioAddressOffset};
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

const MIB: u64 = 1 << 20;
/// Alignment of every region's start and size (see the module comment).
pub const PMEM_ALIGN: u64 = 2 * MIB;
/// boot_params holds 128 E820 entries; RAM takes at most 4 of them.
const MAX_E820_PMEM: usize = 128 - 4;

pub const PMEM_SYNTAX: &str = "file=PATH[,size=SIZE][,readonly=on][,advertise=e820|virtio]";

/// How the guest learns where a region is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Advertise {
    /// An E820 type-12 (legacy persistent memory) entry in boot_params and the PVH memory map:
    /// Linux makes `/dev/pmemN` of it with no driver beyond `nd_e820`.
    #[default]
    E820,
    /// A virtio-pmem device whose configuration names the range; not in the E820 map.
    Virtio,
}

/// One `--pmem` as the user gave it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "PmemJson")]
pub struct PmemConfig {
    pub file: PathBuf,
    /// Bytes the guest sees; `None` means the file's length.
    pub size: Option<u64>,
    pub readonly: bool,
    pub advertise: Advertise,
}

/// The JSON form: `size` may be a number of bytes or a string such as "64M".
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PmemJson {
    file: PathBuf,
    #[serde(default)]
    size: Option<serde_json::Value>,
    #[serde(default)]
    readonly: bool,
    #[serde(default)]
    advertise: Advertise,
}

impl TryFrom<PmemJson> for PmemConfig {
    type Error = String;

    fn try_from(j: PmemJson) -> Result<Self, String> {
        let flag = format!("pmem (config) file={}: size", j.file.display());
        let size = match j.size {
            None => None,
            Some(serde_json::Value::Number(n)) => Some(
                n.as_u64()
                    .ok_or_else(|| format!("{flag}: {n} is not a byte count"))?,
            ),
            Some(serde_json::Value::String(s)) => {
                Some(parse_size(&flag, &s).map_err(|e| e.to_string())?)
            }
            Some(v) => return Err(format!("{flag}: {v} is not a size")),
        };
        if j.file.as_os_str().is_empty() {
            return Err("pmem (config): file is empty".into());
        }
        Ok(PmemConfig {
            file: j.file,
            size,
            readonly: j.readonly,
            advertise: j.advertise,
        })
    }
}

impl std::str::FromStr for PmemConfig {
    type Err = PmemError;

    fn from_str(spec: &str) -> Result<Self, PmemError> {
        let bad = |why: String| PmemError::Spec {
            spec: spec.to_string(),
            why,
        };
        let mut file = None;
        let mut size = None;
        let mut readonly = false;
        let mut advertise = Advertise::E820;
        for part in spec.split(',') {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("{part:?} is not key=value")))?;
            match key {
                "file" if !value.is_empty() => file = Some(PathBuf::from(value)),
                "file" => return Err(bad("file is empty".into())),
                "size" => {
                    size = Some(parse_size("size", value).map_err(|e| bad(e.to_string()))?);
                }
                "readonly" => {
                    readonly = match value {
                        "on" | "true" | "yes" | "1" => true,
                        "off" | "false" | "no" | "0" => false,
                        _ => return Err(bad(format!("readonly={value:?} is not on or off"))),
                    }
                }
                "advertise" => {
                    advertise = match value {
                        "e820" => Advertise::E820,
                        "virtio" => Advertise::Virtio,
                        _ => return Err(bad(format!("advertise={value:?} is not e820 or virtio"))),
                    }
                }
                _ => return Err(bad(format!("unknown key {key:?}"))),
            }
        }
        let file = file.ok_or_else(|| bad("file= is missing".into()))?;
        Ok(PmemConfig {
            file,
            size,
            readonly,
            advertise,
        })
    }
}

/// Why a `--pmem` region cannot be set up; every message names the flag and the file.
#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    #[error("--pmem {spec:?}: {why}; expected {PMEM_SYNTAX}")]
    Spec { spec: String, why: String },
    #[error("--pmem file={}: {why}", file.display())]
    File { file: PathBuf, why: String },
    #[error("--pmem: {0}")]
    Layout(String),
}

fn file_err(file: &Path, why: impl Into<String>) -> PmemError {
    PmemError::File {
        file: file.to_path_buf(),
        why: why.into(),
    }
}

/// `64M` for whole MiB, else the byte count: what `truncate -s` and `size=` accept.
fn short_size(bytes: u64) -> String {
    if bytes.is_multiple_of(MIB) {
        format!("{}M", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

fn describe_size(bytes: u64) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{bytes} bytes ({} MiB)", bytes / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// Where each region goes, given guest RAM and the region sizes in order: from the first
/// 2 MiB boundary above RAM, one after another, jumping over the 32-bit MMIO hole, and never
/// past the guest's physical address width.
pub fn place(ram_size: u64, sizes: &[u64], phys_bits: u8) -> Result<Vec<u64>, String> {
    let ram_end = ram_ranges(ram_size)
        .iter()
        .map(|&(a, l)| a + l)
        .max()
        .unwrap_or(0);
    let limit = 1u128 << phys_bits.min(64);
    let mut cursor = ram_end.next_multiple_of(PMEM_ALIGN);
    let mut out = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        if size == 0 || !size.is_multiple_of(PMEM_ALIGN) {
            return Err(format!(
                "region {i}: {size} bytes is not a positive multiple of 2 MiB"
            ));
        }
        if cursor < MMIO_HOLE_END && cursor.saturating_add(size) > MMIO_HOLE_START {
            cursor = MMIO_HOLE_END;
        }
        let end = u128::from(cursor) + u128::from(size);
        if end > limit {
            return Err(format!(
                "region {i} ({}) would end at {end:#x}, past the guest's {phys_bits}-bit \
                 physical address space; use fewer or smaller regions",
                describe_size(size)
            ));
        }
        out.push(cursor);
        cursor = (end as u64).next_multiple_of(PMEM_ALIGN);
    }
    check_layout(
        ram_size,
        &out.iter()
            .copied()
            .zip(sizes.iter().copied())
            .collect::<Vec<_>>(),
    )?;
    Ok(out)
}

/// Checks that regions (start, size) are aligned and overlap neither RAM, the MMIO hole nor
/// each other. `place` only produces layouts that pass; this is the statement of what
/// "never overlapping" means, kept apart so it can be tested on its own.
pub fn check_layout(ram_size: u64, regions: &[(u64, u64)]) -> Result<(), String> {
    let mut taken: Vec<(u64, u64, String)> = ram_ranges(ram_size)
        .into_iter()
        .map(|(a, l)| (a, a + l, "guest RAM".to_string()))
        .collect();
    taken.push((
        MMIO_HOLE_START,
        MMIO_HOLE_END,
        "the 32-bit MMIO hole".into(),
    ));
    for (i, &(start, size)) in regions.iter().enumerate() {
        if !start.is_multiple_of(PMEM_ALIGN) || !size.is_multiple_of(PMEM_ALIGN) || size == 0 {
            return Err(format!(
                "region {i} at {start:#x}, {size:#x} bytes, is not 2 MiB aligned"
            ));
        }
        let end = start
            .checked_add(size)
            .ok_or_else(|| format!("region {i} at {start:#x} wraps the address space"))?;
        for (a, b, what) in &taken {
            if start < *b && *a < end {
                return Err(format!(
                    "region {i} at {start:#x}..{end:#x} overlaps {what} at {a:#x}..{b:#x}"
                ));
            }
        }
        taken.push((start, end, format!("region {i}")));
    }
    Ok(())
}

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

/// The guest's physical address width, as the host CPU reports it (CPUID 0x80000008), which
/// KVM passes on to the guest.
pub fn host_phys_bits() -> u8 {
    let max = std::arch::x86_64::__cpuid(0x8000_0000).eax;
    if max < 0x8000_0008 {
        return 36;
    }
    (std::arch::x86_64::__cpuid(0x8000_0008).eax & 0xff) as u8
}

/// One placed and mapped region.
pub struct PmemRegion {
    pub index: usize,
    pub config: PmemConfig,
    pub guest_addr: u64,
    pub size: u64,
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

/// Opens a file for a region and returns it with the byte count the guest will see.
fn open_file(c: &PmemConfig) -> Result<(File, u64), PmemError> {
    let f = &c.file;
    let file = OpenOptions::new()
        .read(true)
        .write(!c.readonly)
        .open(f)
        .map_err(|e| {
            file_err(
                f,
                match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        format!(
                            "no such file (create it, e.g. `truncate -s 64M {}`)",
                            f.display()
                        )
                    }
                    std::io::ErrorKind::PermissionDenied if !c.readonly => {
                        "permission denied (add readonly=on to map it read-only)".to_string()
                    }
                    _ if e.raw_os_error() == Some(libc::EISDIR) => "is a directory".to_string(),
                    _ if e.raw_os_error() == Some(libc::EROFS) => {
                        "read-only filesystem (add readonly=on)".to_string()
                    }
                    _ => e.to_string(),
                },
            )
        })?;
    let meta = file
        .metadata()
        .map_err(|e| file_err(f, format!("stat: {e}")))?;
    {
        use std::os::unix::fs::FileTypeExt;
        let ft = meta.file_type();
        if !ft.is_file() && !ft.is_block_device() {
            return Err(file_err(f, "not a regular file or block device"));
        }
    }
    let len = (&file)
        .seek(SeekFrom::End(0))
        .map_err(|e| file_err(f, format!("finding its length: {e}")))?;
    if len == 0 {
        return Err(file_err(
            f,
            format!(
                "the file is empty; give it a size first, e.g. `truncate -s 64M {}`",
                f.display()
            ),
        ));
    }
    let size = match c.size {
        Some(0) => return Err(file_err(f, "size=0: a region needs at least 2 MiB")),
        Some(s) if s > len => {
            return Err(file_err(
                f,
                format!(
                    "size= asks for {} but the file has only {}; grow it with `truncate -s {} {}` \
                     or drop size=",
                    describe_size(s),
                    describe_size(len),
                    short_size(s),
                    f.display()
                ),
            ))
        }
        Some(s) => s,
        None => len,
    };
    if !size.is_multiple_of(PMEM_ALIGN) {
        let up = size.next_multiple_of(PMEM_ALIGN);
        let down = size / PMEM_ALIGN * PMEM_ALIGN;
        let what = if c.size.is_some() {
            "size="
        } else {
            "the file"
        };
        let mut fix = format!(
            "grow the file to {} (`truncate -s {} {}`)",
            describe_size(up),
            short_size(up),
            f.display()
        );
        if down > 0 {
            fix.push_str(&format!(" or give size={}", short_size(down)));
        }
        return Err(file_err(
            f,
            format!(
                "{what} is {}, not a whole number of 2 MiB (guests map persistent memory in \
                 2 MiB sections); {fix}",
                describe_size(size),
            ),
        ));
    }
    if size > len {
        unreachable!("size was checked against the file length");
    }
    if len > size {
        info!(
            file = %f.display(),
            len,
            size,
            "--pmem: the guest sees the first {size} bytes of a {len}-byte file"
        );
    }
    Ok((file, size))
}

impl PmemRegions {
    /// Opens, checks, places and maps every region. Nothing touches KVM yet, so bad input
    /// is reported before a VM exists. `disks` are checked so one file is not both a disk and
    /// a region.
    pub fn open(
        configs: &[PmemConfig],
        ram_size: u64,
        disks: &[DiskConfig],
        phys_bits: u8,
    ) -> Result<PmemRegions, PmemError> {
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

        let sizes: Vec<u64> = opened.iter().map(|(_, _, s)| *s).collect();
        let addrs = place(ram_size, &sizes, phys_bits).map_err(PmemError::Layout)?;

        let mut regions = Vec::new();
        for (index, ((config, file, size), addr)) in opened.into_iter().zip(addrs).enumerate() {
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
                mapping: Arc::new(mapping),
            });
        }
        Ok(PmemRegions {
            regions,
            readonly_writes: Arc::default(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The firmware map entries for regions advertised by E820, in address order.
    pub fn e820_entries(&self) -> Vec<E820Entry> {
        self.regions
            .iter()
            .filter(|r| r.config.advertise == Advertise::E820)
            .map(|r| E820Entry {
                addr: r.guest_addr,
                size: r.size,
                kind: E820Kind::Pmem,
            })
            .collect()
    }

    /// Gives every region its KVM memory slot; read-only regions get `KVM_MEM_READONLY`, so
    /// a guest store becomes an MMIO exit instead of reaching the file.
    pub fn register(&self, vm: &mut Vm) -> Result<(), PmemError> {
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
        for r in &self.regions {
            // SAFETY: the mapping is kept alive by `self`, which the builder drops only after
            // the VM fd; KVM re-checks the range against the process's mappings anyway.
            unsafe {
                vm.add_memory_slot(
                    r.guest_addr,
                    r.size,
                    r.host_addr() as u64,
                    r.config.readonly,
                )
            }
            .map_err(|e| file_err(&r.config.file, e.to_string()))?;
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
    pub fn sync(&self) -> Vec<String> {
        self.regions
            .iter()
            .filter(|r| !r.config.readonly)
            .filter_map(|r| {
                r.sync()
                    .err()
                    .map(|e| format!("--pmem file={}: msync failed: {e}", r.config.file.display()))
            })
            .collect()
    }
}

/// Sits on the MMIO bus over a read-only region. KVM turns a guest store into a read-only
/// slot into an MMIO exit; without this the store would vanish on the "unclaimed MMIO" path
/// with nobody told. It is dropped here too, but logged and counted.
struct ReadonlyGuard {
    file: PathBuf,
    mapping: Arc<GuestRegionMmap>,
    writes: Arc<AtomicU64>,
}

/// Writes logged one by one before the log thins out to powers of two.
const LOG_FIRST: u64 = 8;

/// Whether write number `n` (1-based) is logged: the first few, then 16, 32, 64, ...
pub fn log_this_write(n: u64) -> bool {
    n <= LOG_FIRST || n.is_power_of_two()
}

impl vm_device::DeviceMmio for ReadonlyGuard {
    fn mmio_read(&self, _base: MmioAddress, offset: MmioAddressOffset, data: &mut [u8]) {
        // Loads are served by KVM from the slot; one only lands here if KVM had to emulate
        // the instruction. Answer from the file, as the slot would.
        let len = self.mapping.len();
        if offset >= len || offset + data.len() as u64 > len {
            data.fill(0xff);
            return;
        }
        // SAFETY: offset..offset+len lies inside the live read-only mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mapping.as_ptr().add(offset as usize),
                data.as_mut_ptr(),
                data.len(),
            )
        };
    }

    fn mmio_write(&self, base: MmioAddress, offset: MmioAddressOffset, data: &[u8]) {
        let n = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if log_this_write(n) {
            warn!(
                "--pmem file={} is read-only: guest write of {} bytes at {:#x} (offset {offset:#x}) dropped ({n} so far)",
                self.file.display(),
                data.len(),
                base.0 + offset,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::e820_map;
    use std::io::Write;

    const GIB: u64 = 1 << 30;

    fn file_of(len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(len).unwrap();
        f
    }

    fn cfg(f: &Path) -> PmemConfig {
        PmemConfig {
            file: f.to_path_buf(),
            size: None,
            readonly: false,
            advertise: Advertise::E820,
        }
    }

    fn open_err(configs: &[PmemConfig]) -> String {
        match PmemRegions::open(configs, 32 * MIB, &[], 46) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn specs_parse() {
        let c: PmemConfig = "file=/tmp/a.img,size=64M,readonly=on,advertise=virtio"
            .parse()
            .unwrap();
        assert_eq!(
            c,
            PmemConfig {
                file: "/tmp/a.img".into(),
                size: Some(64 * MIB),
                readonly: true,
                advertise: Advertise::Virtio
            }
        );
        let c: PmemConfig = "file=x".parse().unwrap();
        assert_eq!(
            (c.size, c.readonly, c.advertise),
            (None, false, Advertise::E820)
        );
    }

    #[test]
    fn malformed_specs_name_the_flag_and_the_problem() {
        for (spec, needle) in [
            ("size=2M", "file= is missing"),
            ("file=", "file is empty"),
            ("file=a,size=lots", "invalid size"),
            ("file=a,readonly=maybe", "readonly=\"maybe\""),
            ("file=a,advertise=acpi", "advertise=\"acpi\""),
            ("file=a,colour=red", "unknown key"),
            ("/tmp/a.img", "not key=value"),
        ] {
            let e = spec.parse::<PmemConfig>().unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
            assert!(e.starts_with("--pmem"), "{e}");
            assert!(e.contains(PMEM_SYNTAX), "{e}");
        }
    }

    #[test]
    fn json_form_takes_numbers_and_strings() {
        let v: Vec<PmemConfig> = serde_json::from_str(
            r#"[{"file":"a","size":"4M"},{"file":"b","size":2097152,"readonly":true,"advertise":"virtio"}]"#,
        )
        .unwrap();
        assert_eq!(v[0].size, Some(4 * MIB));
        assert_eq!(v[1].size, Some(2 * MIB));
        assert!(v[1].readonly);
        assert_eq!(v[1].advertise, Advertise::Virtio);
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","size":"big"}"#).is_err());
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","colour":1}"#).is_err());
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","advertise":"acpi"}"#).is_err());
    }

    #[test]
    fn regions_go_above_ram_on_2mib_boundaries() {
        assert_eq!(place(32 * MIB, &[2 * MIB], 46).unwrap(), vec![32 * MIB]);
        // RAM that is not a 2 MiB multiple: the region starts at the next boundary.
        assert_eq!(
            place(33 * MIB, &[2 * MIB, 4 * MIB], 46).unwrap(),
            vec![34 * MIB, 36 * MIB]
        );
        assert_eq!(
            place(512 * MIB, &[64 * MIB, 2 * MIB, 8 * MIB], 46).unwrap(),
            vec![512 * MIB, 576 * MIB, 578 * MIB]
        );
    }

    #[test]
    fn regions_jump_over_the_mmio_hole() {
        // Fits below the hole exactly.
        assert_eq!(place(2 * GIB, &[GIB], 46).unwrap(), vec![2 * GIB]);
        // Would run into it: goes to 4 GiB, and the next one follows.
        assert_eq!(
            place(2 * GIB, &[GIB + 2 * MIB, 2 * MIB], 46).unwrap(),
            vec![4 * GIB, 5 * GIB + 2 * MIB]
        );
        // A second one that would cross into the hole also jumps.
        assert_eq!(
            place(2 * GIB, &[GIB - 2 * MIB, 4 * MIB], 46).unwrap(),
            vec![2 * GIB, 4 * GIB]
        );
        // RAM reaching the hole: regions start after high RAM.
        assert_eq!(place(4 * GIB, &[2 * MIB], 46).unwrap(), vec![5 * GIB]);
        for (ram, sizes) in [
            (32 * MIB, vec![2 * MIB, 2 * MIB]),
            (3 * GIB, vec![2 * MIB]),
            (6 * GIB, vec![GIB, 2 * MIB]),
            (GIB + MIB, vec![2 * GIB, 2 * MIB]),
        ] {
            let addrs = place(ram, &sizes, 46).unwrap();
            let regions: Vec<_> = addrs.into_iter().zip(sizes).collect();
            check_layout(ram, &regions).unwrap();
        }
    }

    #[test]
    fn placement_respects_the_physical_address_width() {
        let e = place(32 * MIB, &[64 * GIB], 36).unwrap_err();
        assert!(e.contains("36-bit"), "{e}");
        place(32 * MIB, &[32 * GIB], 36).unwrap();
    }

    #[test]
    fn overlaps_are_named() {
        let e = check_layout(64 * MIB, &[(32 * MIB, 2 * MIB)]).unwrap_err();
        assert!(e.contains("guest RAM"), "{e}");
        let e = check_layout(64 * MIB, &[(MMIO_HOLE_START - 2 * MIB, 4 * MIB)]).unwrap_err();
        assert!(e.contains("MMIO hole"), "{e}");
        let e = check_layout(64 * MIB, &[(64 * MIB, 4 * MIB), (66 * MIB, 2 * MIB)]).unwrap_err();
        assert!(e.contains("region 0"), "{e}");
        let e = check_layout(64 * MIB, &[(65 * MIB, 2 * MIB)]).unwrap_err();
        assert!(e.contains("aligned"), "{e}");
        check_layout(64 * MIB, &[(64 * MIB, 2 * MIB), (66 * MIB, 2 * MIB)]).unwrap();
    }

    #[test]
    fn too_many_regions_for_the_slots() {
        let e = check_slots(1, 32, 32).unwrap_err().to_string();
        assert!(e.contains("--pmem") && e.contains("offers 32"), "{e}");
        check_slots(1, 31, 32).unwrap();
    }

    #[test]
    fn bad_files_are_refused_with_flag_and_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.img");
        let e = open_err(&[cfg(&missing)]);
        assert!(
            e.contains("--pmem file=") && e.contains("nope.img") && e.contains("no such file"),
            "{e}"
        );

        let empty = file_of(0);
        let e = open_err(&[cfg(empty.path())]);
        assert!(
            e.contains("empty") && e.contains(&empty.path().display().to_string()),
            "{e}"
        );

        let odd = file_of(3 * MIB);
        let e = open_err(&[cfg(odd.path())]);
        assert!(e.contains("2 MiB") && e.contains("4 MiB"), "{e}");

        let small = file_of(4096);
        let e = open_err(&[cfg(small.path())]);
        assert!(e.contains("2 MiB"), "{e}");

        let f = file_of(4 * MIB);
        let mut c = cfg(f.path());
        c.size = Some(8 * MIB);
        let e = open_err(&[c.clone()]);
        assert!(
            e.contains("size=") && e.contains("only 4194304 bytes"),
            "{e}"
        );
        c.size = Some(3 * MIB);
        let e = open_err(&[c.clone()]);
        assert!(e.contains("size= is 3145728 bytes (3 MiB)"), "{e}");
        c.size = Some(0);
        assert!(open_err(&[c]).contains("size=0"));

        let e = open_err(&[cfg(dir.path())]);
        assert!(
            e.contains("directory") || e.contains("not a regular file"),
            "{e}"
        );

        let e = open_err(&[cfg(f.path()), cfg(f.path())]);
        assert!(e.contains("already used by --pmem"), "{e}");

        let disk = DiskConfig {
            path: f.path().to_path_buf(),
            readonly: false,
            cache: Default::default(),
        };
        let e = match PmemRegions::open(&[cfg(f.path())], 32 * MIB, &[disk], 46) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a file that is also a disk must be refused"),
        };
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
        let p = PmemRegions::open(&[cfg(a.path()), vb, rc], 64 * MIB, &[], 46).unwrap();
        let addrs: Vec<u64> = p.regions.iter().map(|r| r.guest_addr).collect();
        assert_eq!(addrs, vec![64 * MIB, 66 * MIB, 70 * MIB]);
        let e = p.e820_entries();
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
        let p = PmemRegions::open(&[cfg(a.path())], 32 * MIB, &[], 46).unwrap();
        let mut map = e820_map(32 * MIB);
        map.extend(p.e820_entries());
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

    #[test]
    fn readonly_write_log_thins_out() {
        let logged: Vec<u64> = (1..=100).filter(|&n| log_this_write(n)).collect();
        assert_eq!(logged, vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]);
    }
}
