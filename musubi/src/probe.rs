//! The bundled probe guest: its ELF image and the result lines it prints.

use serde_json::Value;
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

/// The probe guest's result lines (`{"probe": ...}`) in `console` output, in order.
pub fn results(console: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(console)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            if !l.starts_with("{\"probe\"") {
                return None;
            }
            serde_json::from_str(l).ok()
        })
        .collect()
}

/// The first result of task `task`.
pub fn result<'a>(results: &'a [Value], task: &str) -> Option<&'a Value> {
    results.iter().find(|v| v["probe"] == task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_are_picked_out_of_console_text() {
        let out = b"booting\r\n{\"probe\":\"hello\",\"cpus\":2}\r\nnoise {\"probe\":1}\n{\"probe\":\"blk-crc\",\"disks\":[]}\n";
        let r = results(out);
        assert_eq!(r.len(), 2);
        assert_eq!(result(&r, "hello").unwrap()["cpus"], 2);
        assert!(result(&r, "exit").is_none());
    }

    #[test]
    fn bundled_image_is_an_elf() {
        assert_eq!(&PROBE_ELF[..4], b"\x7fELF");
    }
}
