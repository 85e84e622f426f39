//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the seeded smoke tests for what
//! a file can feed the VMM: a hostile kernel image and the JSON configuration's parts.
//! Each takes arbitrary bytes and returns the first broken rule; none may panic.

use crate::config::rng::RngConfig;
use crate::config::{parse_size, ConfigError, DiskConfig, ExitsMode, KernelImage, SerialMode};
use crate::loader::{load_kernel, EntryPoint, LoadError};
use crate::pmem::PmemConfig;
use devices::GuestMemoryMmap;
use vm_memory::GuestAddress;

/// Guest RAM of the loader target: small, so images easily reach past its end.
const LOADER_MEMORY: usize = 4 << 20;

/// A rule the loader or a parser broke, or (`Memory`) guest memory the run could not make.
#[derive(Debug, thiserror::Error)]
pub enum Finding {
    #[error(transparent)]
    Memory(#[from] vm_memory::mmap::FromRangesError),
    #[error("the error does not name the image: {0}")]
    UnnamedImage(#[source] LoadError),
    #[error("kernel end {end:#x} is past guest memory ({top:#x})")]
    EndPastMemory { end: u64, top: u64 },
    #[error("64-bit entry {0:#x} is outside guest memory")]
    EntryOutside(u64),
    /// A disk that parsed from JSON but not from its own flag spec.
    #[error("{disk:?} as {spec:?}: {error}")]
    DiskSpec {
        disk: Box<DiskConfig>,
        spec: String,
        #[source]
        error: ConfigError,
    },
    /// A value (shown as `Debug`) that reads back through its own syntax as another.
    #[error("{value} reads back as {back}")]
    ReadsBack { value: String, back: String },
    #[error("{value} does not read back: {error}")]
    NoReadBack {
        value: String,
        #[source]
        error: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A refusal of `text` that does not name its flag.
    #[error("{text:?}: {error}")]
    UnnamedFlag {
        text: String,
        #[source]
        error: ConfigError,
    },
    #[error("{0:?} parses with an empty file")]
    EmptyFile(String),
    #[error("{text:?}: {error}")]
    Digits {
        text: String,
        #[source]
        error: std::num::ParseIntError,
    },
    #[error("{text:?} is {bytes} bytes, fewer than its number")]
    FewerBytes { text: String, bytes: u64 },
}

/// Loads `data` as a kernel image into small guest memory. It must be refused with an error
/// naming the image or be loaded whole inside guest memory; the VMM later places the initrd
/// and boot structures using the end it reports, so that end must lie in guest memory too.
pub fn kernel_image(data: &[u8]) -> Result<(), Finding> {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), LOADER_MEMORY)])?;
    let image = KernelImage::Bytes {
        name: "fuzz-kernel".into(),
        data: data.to_vec().into(),
    };
    let (entry, end) = match load_kernel(&mem, &image) {
        Ok(loaded) => loaded,
        Err(e) if e.to_string().contains("fuzz-kernel") => return Ok(()),
        Err(e) => return Err(Finding::UnnamedImage(e)),
    };
    let top = LOADER_MEMORY as u64;
    if end > top {
        return Err(Finding::EndPastMemory { end, top });
    }
    if let EntryPoint::Linux64 { entry, .. } = entry {
        if entry >= top {
            return Err(Finding::EntryOutside(entry));
        }
    }
    Ok(())
}

/// Parses `data` as each part of the JSON configuration (a disk, a pmem region, the serial
/// and exits modes, the entropy device) and, as UTF-8 text, as the matching flag specs (and
/// `--vsock`'s) and a size. Refusals must
/// name the flag; what parses must read back the same through its own syntax.
pub fn config(data: &[u8]) -> Result<(), Finding> {
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
            let back: DiskConfig = match spec.parse() {
                Ok(back) => back,
                Err(error) => {
                    return Err(Finding::DiskSpec {
                        disk: Box::new(disk),
                        spec,
                        error,
                    })
                }
            };
            if back != disk {
                return Err(Finding::ReadsBack {
                    value: format!("{disk:?}"),
                    back: format!("{back:?}"),
                });
            }
        }
    }
    let _ = serde_json::from_slice::<PmemConfig>(data);
    if let Ok(serial) = serde_json::from_slice::<SerialMode>(data) {
        same_again(&serial, serial.to_string().parse())?;
    }
    if let Ok(rng) = serde_json::from_slice::<RngConfig>(data) {
        // JSON may carry a zero rate, which the device refuses when it is built.
        if rng.bytes_per_sec != Some(0) {
            same_again(&rng, rng.to_string().parse())?;
        }
    }
    if let Ok(exits) = serde_json::from_slice::<ExitsMode>(data) {
        same_again(&exits, exits.to_string().parse())?;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return Ok(());
    };
    let unnamed = |error| Finding::UnnamedFlag {
        text: text.into(),
        error,
    };
    match text.parse::<DiskConfig>() {
        Err(e) if !e.to_string().contains("--disk") => return Err(unnamed(e)),
        _ => {}
    }
    match text.parse::<PmemConfig>() {
        Ok(pmem) if pmem.file.as_os_str().is_empty() => {
            return Err(Finding::EmptyFile(text.into()))
        }
        Err(e) if !e.to_string().contains("--pmem") => return Err(unnamed(e)),
        _ => {}
    }
    if let Ok(serial) = text.parse::<SerialMode>() {
        same_again(&serial, serial.to_string().parse())?;
    }
    match text.parse::<RngConfig>() {
        Ok(rng) => same_again(&rng, rng.to_string().parse())?,
        Err(e) if !e.to_string().contains("--rng") => return Err(unnamed(e)),
        Err(_) => {}
    }
    match text.parse::<crate::config::vsock::VsockConfig>() {
        // Printed back as a spec, it reads the same (a path with a separator aside).
        Ok(v) if !v.socket.to_string_lossy().contains([',', '=']) => {
            same_again(&v, v.to_string().parse())?;
        }
        Err(e) if !e.to_string().contains("--vsock") => return Err(unnamed(e)),
        _ => {}
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
                whole.parse::<u64>().map_err(|error| Finding::Digits {
                    text: text.into(),
                    error,
                })?
            };
            if n < unit {
                return Err(Finding::FewerBytes {
                    text: text.into(),
                    bytes: n,
                });
            }
        }
        Err(e) if !e.to_string().contains("--memory") => return Err(unnamed(e)),
        Err(_) => {}
    }
    Ok(())
}

fn same_again<T, E>(value: &T, again: Result<T, E>) -> Result<(), Finding>
where
    T: PartialEq + std::fmt::Debug,
    E: std::error::Error + Send + Sync + 'static,
{
    match again {
        Ok(v) if v == *value => Ok(()),
        Ok(v) => Err(Finding::ReadsBack {
            value: format!("{value:?}"),
            back: format!("{v:?}"),
        }),
        Err(e) => Err(Finding::NoReadBack {
            value: format!("{value:?}"),
            error: Box::new(e),
        }),
    }
}
