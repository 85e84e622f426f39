//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the seeded smoke tests for what
//! a file can feed the VMM: a hostile kernel image and the JSON configuration's parts.
//! Each takes arbitrary bytes and returns the first broken rule; none may panic.

use crate::config::{parse_size, DiskConfig, ExitsMode, KernelImage, SerialMode};
use crate::loader::{load_kernel, EntryPoint};
use crate::pmem::PmemConfig;
use devices::GuestMemoryMmap;
use vm_memory::GuestAddress;

/// Guest RAM of the loader target: small, so images easily reach past its end.
const LOADER_MEMORY: usize = 4 << 20;

/// Loads `data` as a kernel image into small guest memory. It must be refused with an error
/// naming the image or be loaded whole inside guest memory; the VMM later places the initrd
/// and boot structures using the end it reports, so that end must lie in guest memory too.
pub fn kernel_image(data: &[u8]) -> Result<(), String> {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), LOADER_MEMORY)])
        .map_err(|e| e.to_string())?;
    let image = KernelImage::Bytes {
        name: "fuzz-kernel".into(),
        data: data.to_vec().into(),
    };
    let (entry, end) = match load_kernel(&mem, &image) {
        Ok(loaded) => loaded,
        Err(e) if e.to_string().contains("fuzz-kernel") => return Ok(()),
        Err(e) => return Err(format!("the error does not name the image: {e}")),
    };
    let top = LOADER_MEMORY as u64;
    if end > top {
        return Err(format!(
            "kernel end {end:#x} is past guest memory ({top:#x})"
        ));
    }
    if let EntryPoint::Linux64 { entry, .. } = entry {
        if entry >= top {
            return Err(format!("64-bit entry {entry:#x} is outside guest memory"));
        }
    }
    Ok(())
}

/// Parses `data` as each part of the JSON configuration (a disk, a pmem region, the serial
/// and exits modes) and, as UTF-8 text, as the matching flag specs and a size. Refusals must
/// name the flag; what parses must read back the same through its own syntax.
pub fn config(data: &[u8]) -> Result<(), String> {
    if let Ok(disk) = serde_json::from_slice::<DiskConfig>(data) {
        // The same disk written as a --disk spec must read back the same, wherever the
        // path can be written in one (no separators in it).
        let path = disk.path.to_string_lossy();
        if !path.is_empty() && !path.contains([',', '=']) && disk.path.to_str().is_some() {
            let spec = format!(
                "path={path},readonly={},cache={}",
                if disk.readonly { "on" } else { "off" },
                disk.cache
            );
            let back: DiskConfig = spec
                .parse()
                .map_err(|e| format!("{disk:?} as {spec:?}: {e}"))?;
            if back != disk {
                return Err(format!("{disk:?} reads back as {back:?}"));
            }
        }
    }
    let _ = serde_json::from_slice::<PmemConfig>(data);
    if let Ok(serial) = serde_json::from_slice::<SerialMode>(data) {
        same_again(&serial, serial.to_string().parse())?;
    }
    if let Ok(exits) = serde_json::from_slice::<ExitsMode>(data) {
        same_again(&exits, exits.to_string().parse())?;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return Ok(());
    };
    match text.parse::<DiskConfig>() {
        Err(e) if !e.to_string().contains("--disk") => return Err(format!("{text:?}: {e}")),
        _ => {}
    }
    match text.parse::<PmemConfig>() {
        Ok(pmem) if pmem.file.as_os_str().is_empty() => {
            return Err(format!("{text:?} parses with an empty file"))
        }
        Err(e) if !e.to_string().contains("--pmem") => return Err(format!("{text:?}: {e}")),
        _ => {}
    }
    if let Ok(serial) = text.parse::<SerialMode>() {
        same_again(&serial, serial.to_string().parse())?;
    }
    match parse_size("--memory", text) {
        Ok(n) => {
            let digits = text
                .trim()
                .trim_end_matches(|c: char| c.is_ascii_alphabetic());
            // Decimals are accepted and rounded down: the whole part is a lower bound.
            let whole = digits.split('.').next().unwrap_or("");
            let unit = if whole.is_empty() {
                0
            } else {
                whole.parse::<u64>().map_err(|e| format!("{text:?}: {e}"))?
            };
            if n < unit {
                return Err(format!("{text:?} is {n} bytes, fewer than its number"));
            }
        }
        Err(e) if !e.to_string().contains("--memory") => return Err(format!("{text:?}: {e}")),
        Err(_) => {}
    }
    Ok(())
}

fn same_again<T: PartialEq + std::fmt::Debug, E: std::fmt::Display>(
    value: &T,
    again: Result<T, E>,
) -> Result<(), String> {
    match again {
        Ok(v) if v == *value => Ok(()),
        Ok(v) => Err(format!("{value:?} reads back as {v:?}")),
        Err(e) => Err(format!("{value:?} does not read back: {e}")),
    }
}
