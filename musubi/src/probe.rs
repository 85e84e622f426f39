//! The bundled probe guest: its ELF image and the result lines it prints.

use std::path::PathBuf;
use vmm::config::KernelImage;

static PROBE_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/probe.elf"));

/// The name `--kernel` accepts for the bundled guest.
pub const PROBE_NAME: &str = "probe";

pub fn image() -> KernelImage {
    KernelImage::Bytes {
        name: "probe (bundled probe guest)".into(),
        data: PROBE_ELF.into(),
    }
}

/// Writes the bundled ELF to a cache file named by its checksum, so other hypervisors
/// (QEMU) can boot exactly the same image, and returns its path.
pub fn materialize() -> std::io::Result<PathBuf> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("musubi");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("probe-{:08x}.elf", crc32fast::hash(PROBE_ELF)));
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(PROBE_ELF.len() as u64) {
        let tmp = dir.join(format!(".probe-{}.tmp", std::process::id()));
        std::fs::write(&tmp, PROBE_ELF)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
}

/// Result lines are read by the one parser the binary, the benchmarks and their tests share.
pub use probe_lines::{result, results};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_image_is_an_elf() {
        assert_eq!(&PROBE_ELF[..4], b"\x7fELF");
    }
}
